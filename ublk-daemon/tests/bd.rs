//! OverlayBD frontends against the real kernel, as root.
//!
//! - `fuse_image_ext4_commit_stack`: a device served as a FUSE image file, `mkfs.ext4` on it,
//!   mounted through a loop device, a tree written; unmounted, `e2fsck -fn`, committed to a
//!   store on a POSIX directory; a second device stacked on that layer (read lazily through the
//!   chunk cache) shows the tree, is changed and committed again; a third device on top shows
//!   the change. `e2fsck -fn` is clean at every stage.
//! - `image_file_requests`: unaligned writes, reads and writes at the end, hole punching and
//!   zero ranges, resizing, fsync, through the kernel, against a byte-array model.
//! - `kill9_loses_no_flushed_write`: a child process (this test binary again) serves a device
//!   over FUSE and writes blocks through it, reporting each fsync on a pipe; it is killed with
//!   SIGKILL mid-stream, and every block acknowledged as flushed reads back from the reopened
//!   upper.
//! - `ublk_device_roundtrip`: a write / fsync / read round trip through `/dev/ublkbN`; the
//!   recovery record exists exactly while the device does.
//! - `ublk_record_format_and_stale_record`: the recovery record's documented form, written from
//!   outside, reads back; a stale record holds nothing back. Runs everywhere.
//! - `ublk_recovery_after_kill9`: a child process serves a device through ublk; data is
//!   written and flushed, a writer keeps writing, the child is killed with SIGKILL; the device
//!   stays (QUIESCED), I/O issued meanwhile waits; a second child reattaches to the same
//!   `/dev/ublkbN`, the waiting I/O completes, the writer never saw an error, and every
//!   acknowledged block reads back, through the device and from the reopened upper.
//!
//! The ublk tests run where `/dev/ublk-control` exists. Elsewhere they print a loud SKIPPED
//! line (straight to stderr, which the harness does not capture); under `CI=true` they fail
//! instead when the kernel has ublk (loaded, built in, or a module) but the control device is
//! missing, and skip only when the kernel truly lacks it (`require_ublk`).
//!
//! Mounts, loop devices and child processes are cleaned up by Drop guards even on failure.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fs_cache::chunk::{CacheConfig, ChunkCache};
use fs_cache::{LayerRef, PosixBackend, Store};
use ublk_daemon::bd;
use ublk_daemon::clean_stale_mount;

use common::{require_root, Detach};

const SIZE: u64 = 96 << 20;

fn try_run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed: {}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn run(cmd: &mut Command) -> String {
    try_run(cmd).unwrap_or_else(|e| panic!("{e}"))
}

fn fsck(image: &Path) {
    run(Command::new("e2fsck").arg("-fn").arg(image));
}

/// A loop device over an image file, detached when dropped.
struct Loop(String);

impl Loop {
    fn attach(image: &Path) -> Loop {
        // Direct I/O when the kernel takes it for this file; buffered otherwise (FUSE direct_io
        // keeps no page cache of the image either way).
        let out = Command::new("losetup")
            .args(["--direct-io=on", "-f", "--show"])
            .arg(image)
            .output()
            .unwrap();
        let dev = if out.status.success() {
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        } else {
            run(Command::new("losetup").args(["-f", "--show"]).arg(image))
                .trim()
                .to_owned()
        };
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        Loop(dev)
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// A mount of the ext4 filesystem on `image` (through a loop device), torn down in order.
struct Ext4 {
    mnt: Option<PathBuf>,
    dev: Option<Loop>,
}

impl Ext4 {
    fn mount(image: &Path, at: &Path) -> Ext4 {
        std::fs::create_dir_all(at).unwrap();
        let dev = Loop::attach(image);
        run(Command::new("mount")
            .args(["-t", "ext4"])
            .arg(&dev.0)
            .arg(at));
        Ext4 {
            mnt: Some(at.to_owned()),
            dev: Some(dev),
        }
    }

    /// Clean unmount (everything reaches the image), then detach the loop device.
    fn unmount(mut self) {
        let mnt = self.mnt.take().unwrap();
        if let Err(e) = try_run(Command::new("umount").arg(&mnt)) {
            drop(Detach(mnt));
            panic!("{e}");
        }
        drop(self.dev.take());
    }
}

impl Drop for Ext4 {
    fn drop(&mut self) {
        drop(self.mnt.take().map(Detach));
        drop(self.dev.take());
    }
}

/// Files of varied sizes (empty, small, a few blocks, over a MiB) in nested directories.
fn write_tree(root: &Path, seed: u64, files: usize) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = BTreeMap::new();
    for i in 0..files {
        let rel = PathBuf::from(format!("d{}/s{}/f{seed}-{i}", i % 5, i % 3));
        let len = match i % 6 {
            0 => 0,
            1 => rng.usize(1..512),
            2 => rng.usize(4096..20_000),
            3 => rng.usize(100_000..300_000),
            4 => 1_500_000,
            _ => rng.usize(1..70_000),
        };
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        let path = root.join(&rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &data).unwrap();
        out.insert(rel, data);
    }
    if seed == 1 {
        std::os::unix::fs::symlink("d0/s0", root.join("link")).unwrap();
    }
    out
}

fn check_tree(root: &Path, want: &BTreeMap<PathBuf, Vec<u8>>) {
    for (rel, data) in want {
        let got = std::fs::read(root.join(rel)).unwrap_or_else(|e| panic!("{rel:?}: {e}"));
        assert!(
            &got == data,
            "{rel:?} differs ({} vs {} bytes)",
            got.len(),
            data.len()
        );
    }
    assert_eq!(
        std::fs::read_link(root.join("link")).unwrap(),
        PathBuf::from("d0/s0")
    );
}

/// A store on a POSIX directory, a memory-only chunk cache over it, and the runtime both live
/// on (FUSE threads block on it through the layers' `BlobSource`).
struct Env {
    cache: ChunkCache,
    store: Store,
    rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let root = dir.path().join("store");
        std::fs::create_dir_all(&root).unwrap();
        let store = Store::new(Arc::new(PosixBackend::open(&root).unwrap()));
        let cache = rt
            .block_on(ChunkCache::open(
                store.clone(),
                CacheConfig {
                    memory_bytes: 64 << 20,
                    ..CacheConfig::default()
                },
            ))
            .unwrap();
        Env {
            cache,
            store,
            rt,
            dir,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn create(&self, name: &str, size: Option<u64>, base: Option<&LayerRef>) -> PathBuf {
        let dir = self.path(name);
        self.rt
            .block_on(bd::create(&dir, size, base, &self.store, &self.cache))
            .unwrap();
        dir
    }

    fn open(&self, dir: &Path) -> bd::OpenDevice {
        self.rt
            .block_on(bd::open(dir, &self.store, &self.cache))
            .unwrap()
    }
}

#[test]
fn fuse_image_ext4_commit_stack() {
    if !require_root("fuse_image_ext4_commit_stack") {
        return;
    }
    let env = Env::new();
    let base_ref: LayerRef = "base/bd-test:1".parse().unwrap();
    let ws_ref: LayerRef = "workspace/bd-test:2".parse().unwrap();

    // Stage 1: a fresh device, formatted and filled through the image file.
    let dir1 = env.create("dev1", Some(SIZE), None);
    let tree1 = {
        let dev = env.open(&dir1);
        let img = env.path("img1");
        let fuse = bd::serve_fuse(dev.device.clone(), &img).unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), SIZE);
        // A device does not change size.
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        assert!(f.set_len(SIZE / 2).is_err(), "truncating the image worked");
        drop(f);
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096", "-E", "root_owner=0:0"])
            .arg(&img));
        fsck(&img);
        let mnt = env.path("mnt1");
        let ext4 = Ext4::mount(&img, &mnt);
        let tree = write_tree(&mnt, 1, 24);
        ext4.unmount();
        fsck(&img);
        let stats = fuse.stats();
        assert!(stats.writes > 0 && stats.flushes > 0, "{stats:?}");
        assert_eq!(stats.errors, 0, "{stats:?}");
        fuse.unmount().unwrap();
        tree
    };
    // `strata bd commit`: reopens the (unserved) device and pushes its upper.
    let pushed = env
        .rt
        .block_on(bd::commit(&dir1, &env.store, &base_ref))
        .unwrap();
    assert!(pushed.manifest.parents.is_empty());

    // Stage 2: a device on the committed layer sees the tree; change it and commit again.
    let dir2 = env.create("dev2", None, Some(&base_ref));
    assert_eq!(bd::Descriptor::read(&dir2).unwrap().size, SIZE);
    let mut tree2 = tree1.clone();
    {
        let dev = env.open(&dir2);
        let img = env.path("img2");
        let fuse = bd::serve_fuse(dev.device.clone(), &img).unwrap();
        fsck(&img);
        let mnt = env.path("mnt2");
        let ext4 = Ext4::mount(&img, &mnt);
        check_tree(&mnt, &tree1);
        // Change: remove some files, rewrite one, add more.
        let removed: Vec<PathBuf> = tree1.keys().step_by(4).cloned().collect();
        for rel in &removed {
            std::fs::remove_file(mnt.join(rel)).unwrap();
            tree2.remove(rel);
        }
        let (rel, _) = tree2
            .iter()
            .nth(1)
            .map(|(k, v)| (k.clone(), v.clone()))
            .unwrap();
        let new = vec![0x5a; 123_457];
        std::fs::write(mnt.join(&rel), &new).unwrap();
        tree2.insert(rel, new);
        tree2.extend(write_tree(&mnt, 2, 12));
        ext4.unmount();
        fsck(&img);
        fuse.unmount().unwrap();
        // Commit the served device in-process (the path a daemon would take).
        let pushed = env
            .rt
            .block_on(bd::commit_device(
                &dev.device,
                dev.descriptor.base.as_ref(),
                dev.dir(),
                &env.store,
                &ws_ref,
            ))
            .unwrap();
        assert_eq!(pushed.manifest.parents, vec![base_ref.clone()]);
    }

    // Stage 3: a device on the second commit shows the changed tree (and not the removed
    // files), and its stack is two layers deep.
    let dir3 = env.create("dev3", None, Some(&ws_ref));
    let dev = env.open(&dir3);
    assert_eq!(dev.device.layers().len(), 2);
    let img = env.path("img3");
    let fuse = bd::serve_fuse(dev.device.clone(), &img).unwrap();
    fsck(&img);
    let mnt = env.path("mnt3");
    let ext4 = Ext4::mount(&img, &mnt);
    check_tree(&mnt, &tree2);
    for rel in tree1.keys().filter(|k| !tree2.contains_key(*k)) {
        assert!(!mnt.join(rel).exists(), "{rel:?} came back");
    }
    ext4.unmount();
    fsck(&img);
    fuse.unmount().unwrap();

    // A served device is locked against a second opener.
    let again = env.rt.block_on(bd::open(&dir3, &env.store, &env.cache));
    assert!(
        matches!(again, Err(ublk_daemon::Error::Busy { .. })),
        "{again:?}"
    );
}

/// The image file's request mapping, seen through the kernel: unaligned writes, reads at and
/// past the end, hole punching and zero ranges (read back as zeros), writes past the end,
/// resizing, and fsync.
#[test]
fn image_file_requests() {
    if !require_root("image_file_requests") {
        return;
    }
    let env = Env::new();
    let size = 4 << 20;
    let dir = env.create("dev", Some(size), None);
    let dev = env.open(&dir);
    let fuse = bd::serve_fuse(dev.device.clone(), &env.path("img")).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(fuse.path())
        .unwrap();
    let mut model = vec![0u8; size as usize];
    let mut rng = fastrand::Rng::with_seed(4);
    for _ in 0..40 {
        let off = rng.u64(0..size - 70_000);
        let mut data = vec![0u8; rng.usize(1..70_000)];
        rng.fill(&mut data);
        f.write_all_at(&data, off).unwrap();
        model[off as usize..off as usize + data.len()].copy_from_slice(&data);
    }
    // Punch a hole and zero a range (both unaligned), then compare everything.
    for (mode, off, len) in [
        (
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            10_000,
            300_001,
        ),
        (libc::FALLOC_FL_ZERO_RANGE, 1_000_003, 77_777),
    ] {
        // SAFETY: fallocate on a valid, open descriptor; no memory is passed.
        let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), mode, off, len) };
        assert_eq!(
            rc,
            0,
            "fallocate mode {mode:#x}: {}",
            std::io::Error::last_os_error()
        );
        model[off as usize..(off + len) as usize].fill(0);
    }
    f.sync_all().unwrap();
    let mut all = vec![0u8; size as usize];
    f.read_exact_at(&mut all, 0).unwrap();
    assert!(all == model, "the image differs from the model");
    // At and past the end: nothing to read, no room to write, no resizing.
    let mut buf = [0u8; 4096];
    assert_eq!(f.read_at(&mut buf, size).unwrap(), 0);
    assert_eq!(f.read_at(&mut buf, size - 100).unwrap(), 100);
    let e = f.write_at(&buf, size).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    assert_eq!(f.write_at(&buf, size - 100).unwrap(), 100);
    assert!(f.set_len(size + 4096).is_err());
    // Truncating to its own size, chmod and utimes are accepted (and change nothing).
    f.set_len(size).unwrap();
    std::fs::set_permissions(
        fuse.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    f.set_modified(std::time::SystemTime::now()).unwrap();
    assert_eq!(f.metadata().unwrap().len(), size);
    // No extended attributes; statfs counts the device's 4 KiB blocks.
    let e = rustix::fs::fgetxattr(&f, "user.x", &mut [0u8; 16]).unwrap_err();
    assert_eq!(e, rustix::io::Errno::NODATA, "{e}");
    assert_eq!(rustix::fs::flistxattr(&f, &mut [0u8; 16]).unwrap(), 0);
    let st = rustix::fs::fstatfs(&f).unwrap();
    assert_eq!((st.f_blocks, st.f_bsize), (size / 4096, 4096));
    drop(f);
    // Big writes: a 1 MiB direct write is one request (max_write and max_pages at INIT).
    let neg = fuse.negotiated();
    assert_eq!(neg.max_write, 1 << 20, "{neg:?}");
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(fuse.path())
        .unwrap();
    let mut raw = vec![0u8; (1 << 20) + 4096];
    let skew = raw.as_ptr().align_offset(4096);
    let big = &mut raw[skew..skew + (1 << 20)];
    fastrand::Rng::with_seed(5).fill(big);
    let before = fuse.stats().writes;
    direct.write_all_at(big, 1 << 20).unwrap();
    assert_eq!(fuse.stats().writes - before, 1, "a 1 MiB write was split");
    model[1 << 20..2 << 20].copy_from_slice(big);
    drop(direct);
    let stats = fuse.stats();
    assert!(stats.discards >= 2 && stats.flushes >= 1, "{stats:?}");
    fuse.unmount().unwrap();
    // The device holds the same bytes after the mount is gone.
    dev.device.read_at(0, &mut all).unwrap();
    model[size as usize - 100..].copy_from_slice(&buf[..100]);
    assert!(all == model, "the device differs from the model");
}

const CHILD_DIR: &str = "STRATA_BD_KILL9_DIR";
const CHILD_IMG: &str = "STRATA_BD_KILL9_IMG";
const READY: &str = "strata-bd-child-ready";
const BLOCK: usize = 4096;
const KILL9_SIZE: u64 = 32 << 20;

fn block_pattern(i: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(i ^ 0x5eed_0000);
    let mut b = vec![0u8; BLOCK];
    rng.fill(&mut b);
    b[..8].copy_from_slice(&i.to_le_bytes());
    b
}

/// The child (the daemon): serve the device over FUSE, say "ready", and wait to be killed.
fn kill9_child(dir: &Path, img: &Path) -> ! {
    let env = Env::new();
    let dev = env.open(dir);
    let _fuse = bd::serve_fuse(dev.device.clone(), img).unwrap();
    let mut out = std::io::stdout().lock();
    // The harness may have printed a line without its newline before this.
    writeln!(out, "\n{READY}").unwrap();
    out.flush().unwrap();
    loop {
        std::thread::park();
    }
}

/// Kills the child (if still running) and detaches its dead mount when dropped.
struct ChildGuard(std::process::Child, PathBuf);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = clean_stale_mount(&self.1);
    }
}

/// Write blocks 0, 1, 2, ... through the image file with O_DIRECT, an fsync after every third
/// write, sending the blocks each successful fsync covered; stop at the first error (the
/// daemon died).
fn writer(img: PathBuf, tx: std::sync::mpsc::Sender<u64>) -> std::io::Error {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&img)
    {
        Ok(f) => f,
        Err(e) => return e,
    };
    // O_DIRECT wants an aligned buffer: take an aligned window of a larger one.
    let mut raw = vec![0u8; 2 * BLOCK];
    let skew = raw.as_ptr().align_offset(BLOCK);
    let buf = &mut raw[skew..skew + BLOCK];
    let mut pending = Vec::new();
    for i in 0..KILL9_SIZE / BLOCK as u64 {
        buf.copy_from_slice(&block_pattern(i));
        if let Err(e) = f.write_all_at(buf, i * BLOCK as u64) {
            return e;
        }
        pending.push(i);
        if i % 3 == 2 {
            if let Err(e) = f.sync_all() {
                return e;
            }
            for p in pending.drain(..) {
                let _ = tx.send(p);
            }
        }
    }
    std::io::Error::other("wrote the whole device before the daemon was killed")
}

#[test]
fn kill9_loses_no_flushed_write() {
    if let (Some(dir), Some(img)) = (std::env::var_os(CHILD_DIR), std::env::var_os(CHILD_IMG)) {
        kill9_child(Path::new(&dir), Path::new(&img));
    }
    if !require_root("kill9_loses_no_flushed_write") {
        return;
    }
    let env = Env::new();
    let dir = env.create("dev", Some(KILL9_SIZE), None);
    let img = env.path("img");
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "kill9_loses_no_flushed_write",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, &dir)
        .env(CHILD_IMG, &img)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut guard = ChildGuard(child, img.clone());
    let stdout = guard.0.stdout.take().unwrap();
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|l| l == READY);
    assert!(ready, "the serving child did not come up");

    // The writer is another process's view of the image: a client of the daemon.
    let (tx, rx) = std::sync::mpsc::channel();
    let w = {
        let img = img.clone();
        std::thread::spawn(move || writer(img, tx))
    };
    let mut flushed = Vec::new();
    while flushed.len() < 600 {
        match rx.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(i) => flushed.push(i),
            Err(e) => panic!(
                "the writer stopped after {} flushed blocks: {e}",
                flushed.len()
            ),
        }
    }
    // SIGKILL while the writer keeps writing.
    guard.0.kill().unwrap();
    guard.0.wait().unwrap();
    let err = w.join().unwrap();
    eprintln!("writer stopped with: {err}");
    flushed.extend(rx.try_iter());
    assert!(
        clean_stale_mount(&img).unwrap(),
        "no dead FUSE mount was left"
    );

    let dev = env.open(&dir);
    let mut buf = vec![0u8; BLOCK];
    let last = *flushed.iter().max().unwrap();
    for &i in &flushed {
        dev.device.read_at(i * BLOCK as u64, &mut buf).unwrap();
        assert!(buf == block_pattern(i), "flushed block {i} was lost");
    }
    // Blocks after the last flush hold their write or nothing, never anything else.
    let mut survived = 0;
    for i in last + 1..last + 64 {
        dev.device.read_at(i * BLOCK as u64, &mut buf).unwrap();
        if buf == block_pattern(i) {
            survived += 1;
        } else {
            assert!(buf.iter().all(|&b| b == 0), "block {i} holds garbage");
        }
    }
    eprintln!(
        "kill -9: {} flushed blocks intact, {survived} unflushed survived, recovery {:?}",
        flushed.len(),
        dev.device.upper().unwrap().recovered()
    );
}

/// Where this kernel stands on ublk.
enum UblkKernel {
    /// The driver is in the kernel: loaded, built in, or a module to load (how we know).
    Has(String),
    /// The kernel was built without it (how we know).
    Lacks(String),
    /// Nothing here says either way.
    Unknown,
}

/// Whether the kernel has the ublk driver: `/sys/module/ublk_drv`, the module lists of
/// `/lib/modules/<release>`, then the kernel's configuration (`/proc/config.gz`, or
/// `/boot/config-<release>`).
fn ublk_in_kernel() -> UblkKernel {
    if Path::new("/sys/module/ublk_drv").exists() {
        return UblkKernel::Has("the ublk_drv module is loaded (/sys/module/ublk_drv)".into());
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let modules = Path::new("/lib/modules").join(&release);
    for (file, what) in [
        ("modules.builtin", "built in"),
        ("modules.dep", "a module (modprobe ublk_drv)"),
    ] {
        let Ok(list) = std::fs::read_to_string(modules.join(file)) else {
            continue;
        };
        let listed = list.lines().any(|l| {
            let module = l.split(':').next().unwrap_or_default();
            module
                .rsplit('/')
                .next()
                .is_some_and(|name| name.starts_with("ublk_drv.ko"))
        });
        if listed {
            return UblkKernel::Has(format!(
                "ublk_drv is {what} per {}",
                modules.join(file).display()
            ));
        }
    }
    let config = Command::new("gzip")
        .args(["-dc", "/proc/config.gz"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            (
                String::from_utf8_lossy(&o.stdout).into_owned(),
                "/proc/config.gz".to_owned(),
            )
        })
        .or_else(|| {
            let path = format!("/boot/config-{release}");
            std::fs::read_to_string(&path).ok().map(|c| (c, path))
        });
    let Some((text, from)) = config else {
        return UblkKernel::Unknown;
    };
    for line in text.lines() {
        match line.trim() {
            "CONFIG_BLK_DEV_UBLK=y" => {
                return UblkKernel::Has(format!("CONFIG_BLK_DEV_UBLK=y in {from}"))
            }
            "CONFIG_BLK_DEV_UBLK=m" => {
                return UblkKernel::Has(format!(
                    "CONFIG_BLK_DEV_UBLK=m in {from} (modprobe ublk_drv)"
                ))
            }
            "# CONFIG_BLK_DEV_UBLK is not set" => {
                return UblkKernel::Lacks(format!("CONFIG_BLK_DEV_UBLK is not set in {from}"))
            }
            _ => {}
        }
    }
    UblkKernel::Lacks(format!(
        "{from} has no CONFIG_BLK_DEV_UBLK (a kernel before 6.0)"
    ))
}

/// Whether the ublk driver is usable (`/dev/ublk-control` exists). Otherwise prints a loud
/// SKIPPED line for `test` — written straight to stderr, which the test harness does not
/// capture — and returns false; under `CI=true` it fails instead when the kernel does have
/// ublk (the CI machine did not load the module or create the device node). A kernel without
/// ublk skips under CI too. The counterpart of `common::require_root`.
fn require_ublk(test: &str) -> bool {
    if bd::ublk_available() {
        return true;
    }
    let (has, why) = match ublk_in_kernel() {
        UblkKernel::Has(why) => (true, why),
        UblkKernel::Lacks(why) => (false, format!("no ublk driver in this kernel: {why}")),
        UblkKernel::Unknown => (
            false,
            "no ublk driver found, and this kernel's configuration is not readable".into(),
        ),
    };
    let line = if has {
        format!(
            "\n*** SKIPPED {test}: no {}, although the kernel has ublk ({why}) ***\n\n",
            bd::ublk::UBLK_CONTROL
        )
    } else {
        format!(
            "\n*** SKIPPED {test}: no {} ({why}) ***\n\n",
            bd::ublk::UBLK_CONTROL
        )
    };
    let _ = std::io::stderr().write_all(line.as_bytes());
    assert!(
        !(has && std::env::var("CI").as_deref() == Ok("true")),
        "{test} must run under CI: the kernel has ublk ({why}) but {} is missing",
        bd::ublk::UBLK_CONTROL
    );
    false
}

#[test]
fn ublk_device_roundtrip() {
    if !require_ublk("ublk_device_roundtrip") || !require_root("ublk_device_roundtrip") {
        return;
    }
    let env = Env::new();
    let dir = env.create("dev", Some(64 << 20), None);
    let dev = env.open(&dir);
    let device = dev.device.clone();
    let ublk = bd::serve_ublk(dev, &bd::UblkConfig::default()).unwrap();
    assert!(!ublk.recovered());
    // The record names the device while it exists; the directory stays locked.
    let rec = bd::UblkRecord::read(&dir)
        .unwrap()
        .expect("no recovery record");
    assert_eq!(rec.dev_id, ublk.dev_id());
    assert_eq!(rec.dir, std::fs::canonicalize(&dir).unwrap());
    let info = bd::ublk_device_info(ublk.dev_id()).unwrap().unwrap();
    assert_eq!((info.state, info.tag), (bd::DevState::Live, rec.tag));
    let again = env.rt.block_on(bd::open(&dir, &env.store, &env.cache));
    assert!(
        matches!(again, Err(ublk_daemon::Error::Busy { .. })),
        "{again:?}"
    );
    let mut rng = fastrand::Rng::with_seed(9);
    let mut data = vec![0u8; 1 << 20];
    rng.fill(&mut data);
    {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(ublk.path())
            .unwrap();
        f.write_all_at(&data, 3 << 20).unwrap();
        f.sync_all().unwrap();
        let mut back = vec![0u8; data.len()];
        f.read_exact_at(&mut back, 3 << 20).unwrap();
        assert!(back == data, "read back through /dev/ublkbN differs");
    }
    let id = ublk.dev_id();
    ublk.stop().unwrap();
    assert!(bd::UblkRecord::read(&dir).unwrap().is_none());
    assert!(bd::ublk_device_info(id).unwrap().is_none());
    let mut back = vec![0u8; data.len()];
    device.read_at(3 << 20, &mut back).unwrap();
    assert!(back == data, "the device does not hold what was written");
}

/// The record's documented on-disk form, written from outside: it reads back; a record whose
/// device does not exist holds nothing back (`--fuse` may serve the directory); `--recover`
/// refuses to add a device; and without a driver `serve_ublk` fails cleanly, leaving the
/// record as it was. Runs everywhere (no root, no driver needed).
#[test]
fn ublk_record_format_and_stale_record() {
    let env = Env::new();
    let dir = env.create("dev", Some(8 << 20), None);
    let canon = std::fs::canonicalize(&dir).unwrap();
    let body = format!(
        "{{\"version\":1,\"dev_id\":{},\"queues\":2,\"depth\":64,\"max_io\":524288,\
         \"size\":{},\"dir\":{},\"tag\":\"00000000000000ff\"}}",
        bd::ublk::MAX_DEV_ID,
        8 << 20,
        serde_json::to_string(canon.to_str().unwrap()).unwrap()
    );
    let check = fs_cache::Digest::of(body.as_bytes()).to_hex();
    let file = format!("{{\"record\":{body},\"check\":\"{check}\"}}\n");
    let path = dir.join(bd::ublk::RECORD_FILE);
    std::fs::write(&path, &file).unwrap();
    let rec = bd::UblkRecord::read(&dir).unwrap().expect("the record");
    assert_eq!(
        (rec.dev_id, rec.queues, rec.depth, rec.max_io, rec.size, rec.tag),
        (bd::ublk::MAX_DEV_ID, 2, 64, 512 << 10, 8 << 20, 0xff)
    );
    assert_eq!(rec.dir, canon);
    assert_eq!(bd::ublk_device_info(bd::ublk::MAX_DEV_ID).unwrap(), None);
    let dev = env.open(&dir);
    assert_eq!(bd::pending_ublk_device(&dev).unwrap(), None);
    let mut cfg = bd::UblkConfig::default();
    cfg.recovery = bd::Recovery::Require;
    let got = bd::serve_ublk(dev, &cfg);
    if bd::ublk_available() {
        match got {
            Err(ublk_daemon::Error::BadDevice { reason, .. }) => {
                assert!(reason.contains("no longer exists"), "{reason}")
            }
            other => panic!("--recover without a device to reattach: {other:?}"),
        }
    } else {
        match got {
            Err(e) => assert_eq!(e.errno(), libc::ENOENT, "{e}"),
            Ok(u) => panic!("served {u:?} without a ublk driver"),
        }
    }
    assert_eq!(std::fs::read_to_string(&path).unwrap(), file);
    // The directory is free again.
    drop(env.open(&dir));
}

const UBLK_CHILD_DIR: &str = "STRATA_BD_UBLK_CHILD_DIR";
const UBLK_READY: &str = "strata-bd-ublk-ready";
const RECOVERY_SIZE: u64 = 64 << 20;
const RECOVERY_BLOCKS: u64 = RECOVERY_SIZE / BLOCK as u64;
/// Blocks 0..FLUSHED are written and fsynced before the kill.
const FLUSHED: u64 = 256;
/// Written during the outage.
const OUTAGE_BLOCK: u64 = 512;
/// The writer across the kill starts here.
const WRITER_START: u64 = 1024;

/// The child (a ublk server): serve the device directory (reattaching when a dead server left
/// its device), report `<id> <recovered>`, serve until stdin closes, then stop cleanly.
fn ublk_child(dir: &Path) -> ! {
    let env = Env::new();
    let dev = env.open(dir);
    let ublk = bd::serve_ublk(dev, &bd::UblkConfig::default()).unwrap();
    {
        let mut out = std::io::stdout().lock();
        // The harness may have printed a line without its newline before this.
        writeln!(out, "\n{UBLK_READY} {} {}", ublk.dev_id(), ublk.recovered()).unwrap();
        out.flush().unwrap();
    }
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    let code = match ublk.stop() {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "stopping the ublk device: {e}");
            1
        }
    };
    drop(env);
    std::process::exit(code);
}

/// A ublk server child process, killed when dropped if still running.
struct UblkServer {
    child: std::process::Child,
    dev_id: u32,
    recovered: bool,
}

impl UblkServer {
    fn spawn(dir: &Path) -> UblkServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "ublk_recovery_after_kill9",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(UBLK_CHILD_DIR, dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix(UBLK_READY) {
                    let _ = tx.send(rest.trim().to_owned());
                }
            }
        });
        let mut server = UblkServer {
            child,
            dev_id: 0,
            recovered: false,
        };
        let ready = rx
            .recv_timeout(Duration::from_secs(90))
            .unwrap_or_else(|e| panic!("the ublk server did not come up: {e}"));
        let (id, recovered) = ready.split_once(' ').expect("a ready line");
        server.dev_id = id.parse().unwrap();
        server.recovered = recovered.parse().unwrap();
        server
    }

    fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Close its stdin (it stops the device cleanly) and wait for a successful exit.
    fn stop(mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "the ublk server stopped with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "the ublk server did not stop");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for UblkServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deletes ublk device N when dropped, if it still exists: a failed test must not leave a
/// device that holds requests (their callers get EIO and move on).
struct UblkCleanup(u32);

impl Drop for UblkCleanup {
    fn drop(&mut self) {
        if let Ok(Some(_)) = bd::ublk_device_info(self.0) {
            if let Ok(c) = libublk::ctrl::UblkCtrl::new_simple(self.0 as i32) {
                let _ = c.del_dev_async();
            }
        }
    }
}

fn wait_for_state(id: u32, want: bd::DevState, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let info = bd::ublk_device_info(id).unwrap();
        if info.map(|i| i.state) == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "ublk device {id} did not become {want:?}: {info:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `/dev/ublkbN` for O_DIRECT reads and writes, and an aligned block buffer.
fn open_direct(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// A block-sized, block-aligned window of a larger buffer (O_DIRECT wants alignment).
fn aligned(raw: &mut [u8]) -> &mut [u8] {
    let skew = raw.as_ptr().align_offset(BLOCK);
    &mut raw[skew..skew + BLOCK]
}

fn write_block(f: &std::fs::File, i: u64) -> std::io::Result<()> {
    let mut raw = vec![0u8; 2 * BLOCK];
    let buf = aligned(&mut raw);
    buf.copy_from_slice(&block_pattern(i));
    f.write_all_at(buf, i * BLOCK as u64)
}

fn read_block(f: &std::fs::File, i: u64) -> std::io::Result<Vec<u8>> {
    let mut raw = vec![0u8; 2 * BLOCK];
    let buf = aligned(&mut raw);
    f.read_exact_at(buf, i * BLOCK as u64)?;
    Ok(buf.to_vec())
}

/// Write blocks `start`, `start + 1`, ... through `path` with O_DIRECT, an fsync after every
/// fourth, sending each block once its write returned, until `stop` is set; the first error
/// ends it. Returns how many blocks it wrote.
fn ublk_writer(
    path: PathBuf,
    start: u64,
    stop: Arc<AtomicBool>,
    tx: std::sync::mpsc::Sender<u64>,
) -> std::io::Result<u64> {
    let f = open_direct(&path)?;
    let mut i = start;
    while !stop.load(Ordering::SeqCst) && i < RECOVERY_BLOCKS {
        write_block(&f, i)?;
        let _ = tx.send(i);
        if i % 4 == 3 {
            f.sync_all()?;
        }
        i += 1;
    }
    f.sync_all()?;
    Ok(i - start)
}

#[test]
fn ublk_recovery_after_kill9() {
    if let Some(dir) = std::env::var_os(UBLK_CHILD_DIR) {
        ublk_child(Path::new(&dir));
    }
    if !require_ublk("ublk_recovery_after_kill9") || !require_root("ublk_recovery_after_kill9") {
        return;
    }
    let env = Env::new();
    let dir = env.create("dev", Some(RECOVERY_SIZE), None);
    let mut first = UblkServer::spawn(&dir);
    assert!(
        !first.recovered,
        "a new device directory reattached to something"
    );
    let id = first.dev_id;
    let _cleanup = UblkCleanup(id);
    let bdev = PathBuf::from(format!("/dev/ublkb{id}"));
    let rec = bd::UblkRecord::read(&dir)
        .unwrap()
        .expect("no recovery record");
    assert_eq!(rec.dev_id, id);
    wait_for_state(id, bd::DevState::Live, Duration::from_secs(5));

    // Flushed data.
    {
        let f = open_direct(&bdev).unwrap();
        for i in 0..FLUSHED {
            write_block(&f, i).unwrap();
        }
        f.sync_all().unwrap();
    }
    // A writer that keeps going while the server is killed.
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = {
        let (bdev, stop) = (bdev.clone(), stop.clone());
        std::thread::spawn(move || ublk_writer(bdev, WRITER_START, stop, tx))
    };
    let mut acked = Vec::new();
    while acked.len() < 300 {
        let i = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the writer stalled before the kill");
        acked.push(i);
    }
    first.kill9();

    // The kernel keeps the device, without a server, and holds its requests.
    wait_for_state(id, bd::DevState::Quiesced, Duration::from_secs(20));
    assert!(
        bdev.exists(),
        "{} went away with its server",
        bdev.display()
    );
    acked.extend(rx.try_iter());
    let (otx, orx) = std::sync::mpsc::channel();
    let outage = {
        let bdev = bdev.clone();
        std::thread::spawn(move || {
            let done = (|| {
                let f = open_direct(&bdev)?;
                let got = read_block(&f, 5)?;
                write_block(&f, OUTAGE_BLOCK)?;
                f.sync_all()?;
                Ok::<_, std::io::Error>(got)
            })();
            let _ = otx.send(done);
        })
    };
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        orx.try_recv().is_err(),
        "I/O completed or failed while no server ran"
    );
    let during: Vec<u64> = rx.try_iter().collect();
    assert!(
        during.is_empty(),
        "writes completed while no server ran: {during:?}"
    );
    assert_eq!(
        bd::ublk_device_info(id).unwrap().map(|i| i.state),
        Some(bd::DevState::Quiesced)
    );

    // A new server reattaches to the same device; the held I/O completes.
    let second = UblkServer::spawn(&dir);
    assert_eq!(
        second.dev_id, id,
        "the new server did not take the same device"
    );
    assert!(
        second.recovered,
        "the new server added a device instead of reattaching"
    );
    wait_for_state(id, bd::DevState::Live, Duration::from_secs(5));
    let got = orx
        .recv_timeout(Duration::from_secs(30))
        .expect("the I/O issued during the outage never completed")
        .expect("the I/O issued during the outage failed");
    assert!(got == block_pattern(5), "flushed block 5 read back wrong");
    outage.join().unwrap();
    let before = acked.len();
    while acked.len() < before + 300 {
        let i = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the writer did not resume after the reattach");
        acked.push(i);
    }
    stop.store(true, Ordering::SeqCst);
    let written = writer
        .join()
        .unwrap()
        .expect("the writer got an I/O error across the kill (in-flight I/O not reissued?)");
    acked.extend(rx.try_iter());
    assert_eq!(written as usize, acked.len());
    let last = *acked.iter().max().unwrap();
    assert_eq!(acked, (WRITER_START..=last).collect::<Vec<_>>());

    // Everything reads back through the same /dev/ublkbN.
    let check = |read: &dyn Fn(u64) -> Vec<u8>, what: &str| {
        for i in (0..FLUSHED)
            .chain([OUTAGE_BLOCK])
            .chain(acked.iter().copied())
        {
            assert!(read(i) == block_pattern(i), "{what}: block {i} was lost");
        }
        if last + 1 < RECOVERY_BLOCKS {
            assert!(
                read(last + 1).iter().all(|&b| b == 0),
                "{what}: block {} was never written but holds data",
                last + 1
            );
        }
    };
    {
        let f = open_direct(&bdev).unwrap();
        check(&|i| read_block(&f, i).unwrap(), "through the device");
        // New I/O works as ever.
        write_block(&f, 600).unwrap();
        f.sync_all().unwrap();
        assert!(read_block(&f, 600).unwrap() == block_pattern(600));
    }
    // A clean stop takes the device and its record away.
    second.stop();
    assert!(bd::ublk_device_info(id).unwrap().is_none());
    assert!(bd::UblkRecord::read(&dir).unwrap().is_none());
    // The upper holds it all.
    let dev = env.open(&dir);
    let read = |i: u64| {
        let mut b = vec![0u8; BLOCK];
        dev.device.read_at(i * BLOCK as u64, &mut b).unwrap();
        b
    };
    check(&read, "in the upper");
    assert!(read(600) == block_pattern(600));
    eprintln!(
        "ublk recovery: {} blocks written across the kill, {} before it",
        acked.len(),
        before
    );
}
