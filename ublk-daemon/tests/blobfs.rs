//! The blob mount, as root, against the real kernel: listing, sizes and bytes of served blobs
//! (read from many threads at once), EIO for a failing backend read with the mount surviving,
//! removal with open handles, busy unmount, a kernel EROFS mount whose `device=` is a blob
//! file in the mount, and detaching a dead FUSE mount. Prints SKIPPED when not root (and
//! fails under CI=true).

mod common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fs_cache::chunk::disk::DiskCacheConfig;
use fs_cache::chunk::{CacheConfig, ChunkCache};
use fs_cache::{Digest, FaultConfig, FaultyBackend, PosixBackend, RetryPolicy, Store};
use ublk_daemon::node::sys;
use ublk_daemon::{clean_stale_mount, set_mount_readahead, BlobFs, BlobFsConfig, Error};

use common::{require_root, Detach};

fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v = vec![0u8; n];
    rng.fill(&mut v);
    v
}

/// A one-thread runtime and a default chunk cache over a POSIX store in `dir`.
fn plain_cache(dir: &std::path::Path) -> (tokio::runtime::Runtime, Arc<ChunkCache>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = Store::new(Arc::new(PosixBackend::open(dir.join("store")).unwrap()));
    let cache = Arc::new(
        rt.block_on(ChunkCache::open(store, CacheConfig::default()))
            .unwrap(),
    );
    (rt, cache)
}

/// A store on a POSIX directory behind a fault injector, a chunk cache over it, a runtime, and
/// a blob mount. Fields drop in order: the mount before the cache and the runtime.
struct Env {
    fs: Option<BlobFs>,
    cache: Arc<ChunkCache>,
    faulty: Arc<FaultyBackend>,
    store: Store,
    rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
}

impl Env {
    fn new(disk_cache: bool, tweak: impl FnOnce(&mut BlobFsConfig)) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let posix = PosixBackend::open(dir.path().join("store")).unwrap();
        let faulty = Arc::new(FaultyBackend::new(Arc::new(posix), 7));
        let store = Store::new(faulty.clone());
        let config = CacheConfig {
            memory_bytes: 4 << 20,
            disk: disk_cache.then(|| DiskCacheConfig {
                dir: dir.path().join("cache"),
                capacity: 256 << 20,
            }),
            retry: RetryPolicy::none(std::time::Duration::from_secs(30)),
            ..CacheConfig::default()
        };
        let cache = Arc::new(
            rt.block_on(ChunkCache::open(store.clone(), config))
                .unwrap(),
        );
        let mnt = dir.path().join("blobs");
        std::fs::create_dir(&mnt).unwrap();
        let mut cfg = BlobFsConfig::new(&mnt);
        cfg.threads = 4;
        tweak(&mut cfg);
        let fs = BlobFs::mount(cfg, cache.clone(), rt.handle().clone(), None).unwrap();
        Env {
            fs: Some(fs),
            cache,
            faulty,
            store,
            rt,
            dir,
        }
    }

    fn fs(&self) -> &BlobFs {
        self.fs.as_ref().unwrap()
    }

    fn put(&self, data: &[u8]) -> Digest {
        let put = self
            .rt
            .block_on(self.store.put_blob(bytes::Bytes::copy_from_slice(data)))
            .unwrap();
        assert_eq!(put.size, data.len() as u64);
        put.digest
    }

    fn add(&self, d: Digest) -> PathBuf {
        self.rt.block_on(self.fs().add_blob(d)).unwrap()
    }

    /// Build a layer of [`make_tree`] files under `<dir>/layer`, store its blob and list it
    /// in the mount.
    fn layer(&self) -> Layer {
        let work = self.dir.path().join("layer");
        let src = work.join("src");
        std::fs::create_dir_all(&src).unwrap();
        let files = make_tree(&src);
        let (meta, blob) = (work.join("meta.erofs"), work.join("blob"));
        let stats = erofs_builder::build_layer(&src, &meta, &blob, &Default::default()).unwrap();
        let digest = self
            .rt
            .block_on(self.store.put_blob_file(&blob))
            .unwrap()
            .digest;
        let blob_file = self.add(digest);
        Layer {
            work,
            src,
            files,
            meta,
            blob,
            stats,
            digest,
            blob_file,
        }
    }
}

/// A layer built by [`Env::layer`]: its source tree (`files` files), meta image and blob, and
/// the blob's file in the blob mount.
struct Layer {
    work: PathBuf,
    src: PathBuf,
    files: usize,
    meta: PathBuf,
    blob: PathBuf,
    stats: erofs_builder::LayerStats,
    digest: Digest,
    blob_file: PathBuf,
}

impl Layer {
    /// Mount the meta image with kernel EROFS at `<work>/mnt`, its `device=` the blob file in
    /// the blob mount (a file-backed EROFS mount: mount(2) directly, as util-linux would insert
    /// a loop device); the guard detaches it.
    fn mount_erofs(&self) -> (PathBuf, Detach) {
        let mnt = self.work.join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        sys::mount_erofs(&self.meta, std::slice::from_ref(&self.blob_file), &mnt)
            .unwrap_or_else(|e| panic!("mount erofs: {e}"));
        let guard = Detach(mnt.clone());
        (mnt, guard)
    }
}

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[test]
fn serves_blobs_listing_sizes_and_concurrent_reads() {
    if !require_root("serves_blobs_listing_sizes_and_concurrent_reads") {
        return;
    }
    let env = Env::new(true, |_| {});
    let big = random_bytes(1, (5 << 20) + 12_345);
    let odd = random_bytes(2, 10_001);
    let empty: Vec<u8> = Vec::new();
    let blobs: Vec<(Digest, &[u8])> = [&big[..], &odd[..], &empty[..]]
        .into_iter()
        .map(|b| (env.put(b), b))
        .collect();
    let mnt = env.fs().mountpoint().to_path_buf();
    assert!(sys::is_mount_point(&mnt).unwrap());
    // The mount's readahead (its bdi is named after its device number).
    set_mount_readahead(&mnt, 2 << 20).unwrap();
    let dev = std::fs::metadata(&mnt).unwrap().dev();
    let ra = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    assert_eq!(std::fs::read_to_string(ra).unwrap().trim(), "2048");
    assert!(listing(&mnt).is_empty());
    let mut paths = Vec::new();
    for (d, _) in &blobs {
        let p = env.add(*d);
        assert_eq!(p, mnt.join(d.to_hex()));
        // Idempotent.
        assert_eq!(env.add(*d), p);
        paths.push(p);
    }
    let mut want: Vec<String> = blobs.iter().map(|(d, _)| d.to_hex()).collect();
    want.sort();
    assert_eq!(listing(&mnt), want);
    let listed: BTreeMap<Digest, u64> = env.fs().blobs().into_iter().collect();
    assert_eq!(listed.len(), 3);

    for ((d, data), p) in blobs.iter().zip(&paths) {
        let md = std::fs::metadata(p).unwrap();
        assert!(md.is_file());
        assert_eq!(md.len(), data.len() as u64);
        assert_eq!(md.mode() & 0o7777, 0o444);
        assert_eq!((md.uid(), md.gid()), (0, 0));
        assert_eq!(listed[d], data.len() as u64);
        // A whole read through the kernel (large requests).
        let mut got = Vec::new();
        File::open(p).unwrap().read_to_end(&mut got).unwrap();
        assert!(got == *data, "whole read of {} differs", d.to_hex());
        // Reading at and past the end gives nothing.
        let mut buf = [0u8; 16];
        let f = File::open(p).unwrap();
        assert_eq!(f.read_at(&mut buf, data.len() as u64).unwrap(), 0);
        assert_eq!(f.read_at(&mut buf, data.len() as u64 + 4096).unwrap(), 0);
    }

    // Random preads from many threads at once, on two blobs.
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (paths, blobs) = (&paths, &blobs);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(100 + t);
                for i in 0..150 {
                    let which = (i + t as usize) % 2;
                    let data = blobs[which].1;
                    let f = File::open(&paths[which]).unwrap();
                    let off = rng.usize(..data.len());
                    let len = rng.usize(1..=(data.len() - off).min(3 << 20));
                    let mut buf = vec![0u8; len];
                    f.read_exact_at(&mut buf, off as u64).unwrap();
                    assert!(buf == data[off..off + len], "pread {off}+{len} differs");
                }
            });
        }
    });

    // Read-only: no writes, no new files.
    let w = std::fs::OpenOptions::new().write(true).open(&paths[1]);
    assert!(w.is_err(), "opened a blob file for writing");
    assert!(File::create(mnt.join("new")).is_err());
    // Unknown and malformed names are not there.
    let unknown = Digest::of(b"not served");
    assert_eq!(
        std::fs::metadata(mnt.join(unknown.to_hex()))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENOENT)
    );
    assert!(std::fs::metadata(mnt.join("xyz")).is_err());
    assert!(matches!(
        env.fs().remove_blob(&unknown),
        Err(Error::UnknownBlob(_))
    ));

    // Removal: gone from listing and lookup at once; an open handle keeps reading.
    let held = File::open(&paths[0]).unwrap();
    env.fs().remove_blob(&blobs[0].0).unwrap();
    assert!(!listing(&mnt).contains(&blobs[0].0.to_hex()));
    assert!(std::fs::metadata(&paths[0]).is_err());
    assert_eq!(env.fs().blobs().len(), 2);
    let mut buf = vec![0u8; 300_000];
    held.read_exact_at(&mut buf, 4_000_000).unwrap();
    assert!(buf == big[4_000_000..4_300_000]);
    // Listed again while still open: same contents.
    let again = env.add(blobs[0].0);
    let mut head = vec![0u8; 4096];
    File::open(&again)
        .unwrap()
        .read_exact_at(&mut head, 0)
        .unwrap();
    assert!(head == big[..4096]);
    drop(held);

    let stats = env.fs().stats();
    assert!(stats.reads > 0 && stats.read_bytes > 0, "{stats:?}");
    assert_eq!(stats.read_errors, 0);

    // Unmount while a file is open: busy, detached lazily, the open file still reads.
    let mut env = env;
    let held = File::open(&paths[1]).unwrap();
    let fs = env.fs.take().unwrap();
    assert!(matches!(fs.unmount(), Err(Error::Busy { .. })));
    assert!(
        !sys::is_mount_point(&mnt).unwrap(),
        "detached mount still listed"
    );
    let mut buf = vec![0u8; odd.len()];
    held.read_exact_at(&mut buf, 0).unwrap();
    assert!(buf == odd);
    drop(held);
}

#[test]
fn backend_error_fails_that_read_only() {
    if !require_root("backend_error_fails_that_read_only") {
        return;
    }
    let env = Env::new(false, |cfg| cfg.threads = 2);
    let data = random_bytes(3, 3 << 20);
    let d = env.put(&data);
    let p = env.add(d);
    let f = File::open(&p).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    f.read_exact_at(&mut buf, 0).unwrap();
    assert!(buf == data[..64 << 10]);

    // Every backend request fails now (permanently: no retries).
    env.faulty.set(FaultConfig {
        error_rate: 1.0,
        permanent: true,
        ..FaultConfig::default()
    });
    let err = f.read_exact_at(&mut buf, 2 << 20).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(env.fs().stats().read_errors >= 1);
    assert!(env.faulty.stats().injected_errors >= 1);

    // The mount survived: listing works, and once the backend recovers the same read works.
    assert_eq!(listing(env.fs().mountpoint()), vec![d.to_hex()]);
    env.faulty.set(FaultConfig::default());
    f.read_exact_at(&mut buf, 2 << 20).unwrap();
    assert!(buf == data[2 << 20..(2 << 20) + (64 << 10)]);
    let mut all = Vec::new();
    File::open(&p).unwrap().read_to_end(&mut all).unwrap();
    assert!(all == data);
    assert!(env.cache.stats().backend_errors >= 1);
}

/// Files of assorted sizes (multi-chunk, tails, small, empty) in nested directories.
fn make_tree(root: &Path) -> usize {
    let mut n = 0;
    for (i, dir) in ["", "a", "a/b", "c"].iter().enumerate() {
        let d = root.join(dir);
        std::fs::create_dir_all(&d).unwrap();
        for (j, size) in [0usize, 1, 4095, 4096, 70_000, 262_144, 1_300_000]
            .iter()
            .enumerate()
        {
            let seed = (i * 16 + j) as u64;
            std::fs::write(d.join(format!("f{j}")), random_bytes(seed, *size)).unwrap();
            n += 1;
        }
    }
    n
}

fn compare_tree(src: &Path, mnt: &Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let (s, m) = (e.path(), mnt.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            assert!(m.is_dir(), "{} is not a directory", m.display());
            n += compare_tree(&s, &m);
        } else {
            let want = std::fs::read(&s).unwrap();
            let got = std::fs::read(&m).unwrap();
            assert!(got == want, "{} differs", m.display());
            n += 1;
        }
    }
    n
}

#[test]
fn kernel_erofs_mount_reads_its_blob_through_the_mount() {
    if !require_root("kernel_erofs_mount_reads_its_blob_through_the_mount") {
        return;
    }
    let env = Env::new(true, |_| {});
    let layer = env.layer();
    assert_eq!(layer.digest.0, layer.stats.blob_blake3);
    let fetched_before = env.cache.stats().bytes_fetched;

    let (mnt, erofs) = layer.mount_erofs();
    // Mounting reads the meta image only: no data byte was fetched yet.
    assert_eq!(env.cache.stats().bytes_fetched, fetched_before);

    assert_eq!(compare_tree(&layer.src, &mnt), layer.files);
    assert!(env.fs().stats().read_bytes > 0);
    assert!(env.cache.stats().bytes_fetched >= layer.stats.blob_bytes);
    // The blob file is busy while EROFS uses it; once EROFS is gone the mount unmounts.
    drop(erofs);
    let mut env = env;
    env.fs.take().unwrap().unmount().unwrap();
}

/// Mount a FUSE filesystem at `mnt` and close its device fd without ever answering: what a
/// daemon that crashed leaves behind.
fn make_dead_fuse_mount(mnt: &Path) {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .unwrap();
    let opts = CString::new(format!(
        "fd={},rootmode=40000,user_id=0,group_id=0",
        dev.as_raw_fd()
    ))
    .unwrap();
    let c_mnt = CString::new(mnt.as_os_str().as_bytes()).unwrap();
    // SAFETY: valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"dead".as_ptr(),
            c_mnt.as_ptr(),
            c"fuse".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    assert_eq!(rc, 0, "mount fuse: {}", std::io::Error::last_os_error());
    drop(dev);
}

#[test]
fn clean_stale_mount_detaches_a_dead_fuse_mount() {
    if !require_root("clean_stale_mount_detaches_a_dead_fuse_mount") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("m");
    std::fs::create_dir(&mnt).unwrap();
    let _guard = Detach(mnt.clone());
    // Not a mount: nothing to do.
    assert!(!clean_stale_mount(&mnt).unwrap());
    make_dead_fuse_mount(&mnt);
    assert_eq!(
        std::fs::metadata(&mnt).unwrap_err().raw_os_error(),
        Some(libc::ENOTCONN)
    );
    assert!(clean_stale_mount(&mnt).unwrap());
    assert!(std::fs::metadata(&mnt).unwrap().is_dir());
    assert!(!sys::is_mount_point(&mnt).unwrap());
    assert!(!clean_stale_mount(&mnt).unwrap());

    // Mounting over a dead mount cleans it first.
    make_dead_fuse_mount(&mnt);
    let (rt, cache) = plain_cache(dir.path());
    let fs = BlobFs::mount(BlobFsConfig::new(&mnt), cache, rt.handle().clone(), None).unwrap();
    assert!(std::fs::metadata(&mnt).unwrap().is_dir());
    assert!(listing(&mnt).is_empty());
    fs.unmount().unwrap();
    assert!(!sys::is_mount_point(&mnt).unwrap());
}

#[test]
fn bad_configuration_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (rt, cache) = plain_cache(dir.path());
    for tweak in [
        (|c: &mut BlobFsConfig| c.threads = 0) as fn(&mut BlobFsConfig),
        |c| c.max_read = 100,
        |c| c.max_read = 1 << 30,
    ] {
        let mut cfg = BlobFsConfig::new(dir.path());
        tweak(&mut cfg);
        let err = BlobFs::mount(cfg, cache.clone(), rt.handle().clone(), None).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
        assert_eq!(err.errno(), libc::EINVAL);
    }
    let current = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = BlobFs::mount(
        BlobFsConfig::new(dir.path()),
        cache.clone(),
        current.handle().clone(),
        None,
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
    let missing = BlobFsConfig::new(dir.path().join("missing"));
    let err = BlobFs::mount(missing, cache, rt.handle().clone(), None).unwrap_err();
    assert_eq!(err.errno(), libc::ENOENT, "{err}");
}

#[test]
fn passthrough_serves_the_level2_file_without_the_daemon() {
    if !require_root("passthrough_serves_the_level2_file_without_the_daemon") {
        return;
    }
    // What the daemon sets up at start (fusectl: passthrough holds its pins by a connection
    // directory).
    for note in ublk_daemon::node::prepare_machine() {
        eprintln!("{note}");
    }
    let env = Env::new(true, |cfg| cfg.passthrough = true);
    if !env.fs().passthrough_available() {
        common::skip_feature(
            "passthrough_serves_the_level2_file_without_the_daemon",
            "the kernel refused FUSE_PASSTHROUGH or fusectl is not mounted",
            (6, 9),
        );
        return;
    }
    let layer = env.layer();
    let want = std::fs::read(&layer.blob).unwrap();

    // Before: served through the cache.
    assert!(std::fs::read(&layer.blob_file).unwrap() == want);
    let reads = env.fs().stats().reads;
    assert!(reads > 0);

    // Not every chunk is in level 2 yet (nothing was read of most of it): no passthrough.
    let probe = env.put(&random_bytes(9, 1 << 20));
    env.add(probe);
    assert!(!env
        .rt
        .block_on(env.fs().enable_passthrough(&probe))
        .unwrap());
    // The whole blob was read above: its chunks are all in level 2 once written.
    env.rt.block_on(env.cache.flush()).unwrap();
    assert!(env
        .rt
        .block_on(env.fs().enable_passthrough(&layer.digest))
        .unwrap());

    // After: opens are passthrough; the bytes are the same and no read reaches the daemon.
    assert!(std::fs::read(&layer.blob_file).unwrap() == want);
    let f = File::open(&layer.blob_file).unwrap();
    let mut buf = vec![0u8; 10_000];
    f.read_exact_at(&mut buf, 123_456).unwrap();
    assert!(buf == want[123_456..133_456]);
    // The kernel EROFS mount reads through the passthrough file, where the kernel lets
    // EROFS use a device on a stacked filesystem (a passthrough FUSE mount is one); where it
    // does not, the daemon's probe must say so, and that is what the node relies on.
    let stacked_ok = sys::erofs_takes_stacked_devices(&layer.work.join("probe"))
        .unwrap_or_else(|e| panic!("{e}"));
    if stacked_ok {
        let (mnt, erofs) = layer.mount_erofs();
        assert_eq!(compare_tree(&layer.src, &mnt), layer.files);
        drop(erofs);
    } else {
        let mnt = layer.work.join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let _guard = Detach(mnt.clone());
        let e = sys::mount_erofs(&layer.meta, std::slice::from_ref(&layer.blob_file), &mnt)
            .expect_err("the probe said EROFS refuses devices on a stacked filesystem");
        assert!(e.to_string().contains("Invalid argument"), "{e}");
        let _ = std::io::stderr().write_all(
            b"\n*** NOT TESTED passthrough_serves_the_level2_file_without_the_daemon: an EROFS \
              mount reading through the passthrough file (this kernel's EROFS refuses \
              file-backed devices on a stacked filesystem; the probe agrees) ***\n\n",
        );
    }
    assert_eq!(
        env.fs().stats().reads,
        reads,
        "passthrough reads reached the daemon"
    );
    drop(f);

    // Off again: later opens go through the cache.
    assert!(env.fs().disable_passthrough(&layer.digest).unwrap());
    assert!(std::fs::read(&layer.blob_file).unwrap() == want);
    assert!(env.fs().stats().reads > reads);
    assert!(!env.fs().disable_passthrough(&layer.digest).unwrap());
}
