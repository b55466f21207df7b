//! zstd per chunk in the store: stored bytes, build wall time and build memory, Strata plain
//! vs Strata zstd vs nydus 2.2 (`nydus-image create`, plain and zstd) vs `mkfs.erofs` 1.8
//! `-zzstd`, on the same trees in one run; the zstd level's speed against its ratio; and cold
//! reads of a compressed vs a plain layer through the node daemon.
//!
//! A scenario harness (no criterion), run as root (drop_caches, mounts):
//!
//! ```sh
//! cargo build --release --bin strata
//! cargo bench -p bench --bench compress
//! ```
//!
//! Trees: `STRATA_COMPRESS_TREES` (colon-separated), default `/usr/lib/x86_64-linux-gnu`, the
//! Debian minbase root ([`bench::node::debian_tree`]), `~/.rustup` (a large tree: 100k+
//! entries) and `~/.cargo/registry/src` (many small files), the last two where they exist; the
//! smoke run (without `--bench`) takes the minbase root's `usr/share/doc`. nydus-image: as the
//! `peers` bench finds it ([`bench::measure::nydus_bins`]); without it its rows are skipped,
//! loudly. `mkfs.erofs` comes from
//! `STRATA_MKFS_EROFS` (default erofs-utils 1.8 at `/usr/local/lib/strata/erofs-utils-1.8`).
//!
//! 1. **Build**: for each tree, page cache dropped before each build:
//!    - `strata layer build TREE --compress none`, then `--compress zstd` (default level), each
//!      into a fresh local directory store (a fresh node); wall time of the command (walk,
//!      layout, blob and meta image written, hashed, compressed, stored, manifest pushed) and
//!      the bytes under the store's `blobs/` (objects and chunk tables);
//!    - `nydus-image create --fs-version 6 --chunk-size 0x40000 --compressor none|zstd`:
//!      wall time, blob directory + bootstrap;
//!    - `mkfs.erofs -zzstd IMG TREE` and (trees under 1 GB: it compresses on one thread)
//!      `mkfs.erofs -zzstd -C262144 IMG TREE` (physical clusters up to 256 KiB, closer to
//!      Strata's chunk): wall time and image size;
//!    - for every build, its peak anonymous and file-backed (+ shmem) RSS, sampled every 2 ms
//!      ([`bench::measure::run`]).
//! 2. **Levels** (blobs under 1 GB): the plain build's data blob put again into fresh stores at zstd levels 1, 3,
//!    6 and 9 (`Store::put_blob_file_with`, hashing, compressing on all cores, spooling and
//!    storing): seconds and stored bytes. The page cache is not dropped (the blob is read
//!    from memory each time: this is the cost of compression alone).
//! 3. **Cold reads** (the first tree only): each layer mounted through a daemon of its node
//!    (fresh caches), page cache dropped, then every file read whole in layout order (`find`
//!    order, one thread), then on a fresh node the same for every 10th file; wall time, bytes
//!    read, bytes fetched from the store (the daemon's `cache stats`).
//!
//! Figures and the machine: `bench/README.md`, "compress".

use std::collections::VecDeque;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use bench::node::LocalNode;
use fs_cache::{Compression, PosixBackend, Store};

fn drop_caches() {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").expect("drop the page cache");
}

/// Regular files under `root` in breadth-first name order (the order the builder lays out
/// data), with their sizes.
fn files_bfs(root: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let mut queue = VecDeque::from([PathBuf::new()]);
    while let Some(rel) = queue.pop_front() {
        let Ok(rd) = std::fs::read_dir(root.join(&rel)) else {
            continue;
        };
        let mut names: Vec<_> = rd.flatten().map(|e| e.file_name()).collect();
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for n in names {
            let r = rel.join(&n);
            let Ok(md) = std::fs::symlink_metadata(root.join(&r)) else {
                continue;
            };
            if md.is_dir() {
                queue.push_back(r);
            } else if md.is_file() {
                out.push((r, md.len()));
            }
        }
    }
    out
}

/// Every entry under `root` (itself included), directories not followed through symlinks.
fn entries(root: &Path) -> u64 {
    let mut n = 1;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            n += 1;
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    n
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

/// One build: wall time, what it stored, its peak memory ([`bench::measure`]).
struct Build {
    seconds: f64,
    stored: u64,
    peak_anon: u64,
    peak_file: u64,
}

impl Build {
    fn of(m: &bench::measure::Measured, stored: u64) -> Self {
        Build {
            seconds: m.seconds,
            stored,
            peak_anon: m.peak_anon,
            peak_file: m.peak_file + m.peak_shmem,
        }
    }
}

struct Built {
    node: LocalNode,
    build: Build,
    blob_bytes: u64,
}

fn strata_build(tmp: &Path, tree: &Path, compress: &str) -> Built {
    let node = LocalNode::new(tmp, "compress-");
    drop_caches();
    let mut cmd = node.cmd();
    cmd.arg("--json").args(["layer", "build"]).arg(tree).args([
        "--name",
        "base/tree:1",
        "--compress",
        compress,
    ]);
    let m = bench::measure::run(&mut cmd).expect("run strata layer build");
    assert!(
        m.status.success(),
        "strata layer build: {}",
        m.stderr_text()
    );
    let out: serde_json::Value = serde_json::from_slice(&m.stdout).expect("its JSON");
    let stored = bench::du(&node.dir.path().join("store/blobs"));
    Built {
        build: Build::of(&m, stored),
        blob_bytes: out["blob_bytes"].as_u64().unwrap_or(0)
            + out["meta_bytes"].as_u64().unwrap_or(0),
        node,
    }
}

fn mkfs_build(tmp: &Path, tree: &Path, extra: &[&str]) -> Build {
    let mkfs = std::env::var("STRATA_MKFS_EROFS")
        .unwrap_or_else(|_| "/usr/local/lib/strata/erofs-utils-1.8/bin/mkfs.erofs".into());
    let img = tmp.join("mkfs.img");
    let _ = std::fs::remove_file(&img);
    drop_caches();
    let m = bench::measure::run(Command::new(&mkfs).args(extra).arg(&img).arg(tree))
        .expect("run mkfs.erofs");
    assert!(
        m.status.success(),
        "mkfs.erofs {extra:?}: {}",
        m.stderr_text()
    );
    let size = std::fs::metadata(&img).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&img);
    Build::of(&m, size)
}

/// `nydus-image create` (RAFS v6, 256 KiB chunks as Strata's) with `compressor`: the blob
/// directory and the bootstrap count as stored.
fn nydus_build(tmp: &Path, nydus_image: &Path, tree: &Path, compressor: &str) -> Build {
    let dir = bench::bench_tempdir(tmp, "compress-nydus-", "the nydus directory");
    let blobs = dir.path().join("blobs");
    std::fs::create_dir_all(&blobs).expect("the blob directory");
    drop_caches();
    let m = bench::measure::run(
        bench::measure::nydus_create(
            nydus_image,
            compressor,
            &blobs,
            &dir.path().join("bootstrap"),
        )
        .arg(tree),
    )
    .expect("run nydus-image");
    assert!(
        m.status.success(),
        "nydus-image create --compressor {compressor}: {}",
        m.stderr_text()
    );
    let stored = bench::du(&blobs) + bench::du(&dir.path().join("bootstrap"));
    Build::of(&m, stored)
}

/// Levels: the plain store's data blob, put at each level into a fresh store.
fn levels(rt: &tokio::runtime::Runtime, tmp: &Path, plain: &LocalNode) {
    let m = plain.json(&["layer", "inspect", "base/tree:1"]);
    let d = m["blobs"][0]["digest"].as_str().expect("a blob").to_owned();
    let src = plain.dir.path().join("store/blobs").join(&d[..2]).join(&d);
    let blob = tmp.join("levels-blob");
    std::fs::copy(&src, &blob).expect("copy the blob");
    let size = std::fs::metadata(&blob).map(|m| m.len()).unwrap_or(0);
    // Warm the page cache once (every level reads the blob from memory).
    let mut sink = Vec::new();
    let _ = std::fs::File::open(&blob).and_then(|mut f| f.read_to_end(&mut sink));
    drop(sink);
    for level in [1, 3, 6, 9] {
        let dir = tempfile::tempdir_in(tmp).expect("a store");
        let store = Store::new(Arc::new(PosixBackend::open(dir.path()).expect("a store")));
        let t = Instant::now();
        let put = rt
            .block_on(store.put_blob_file_with(&blob, Compression::Zstd { level }))
            .expect("put");
        let s = t.elapsed().as_secs_f64();
        println!(
            "  zstd level {level}: {:.2} s ({:.0} MB/s), stored {:.1} MB of {:.1} MB ({:.3})",
            s,
            mb(size) / s,
            mb(put.stored_size),
            mb(size),
            put.stored_size as f64 / size as f64
        );
    }
    let dir = tempfile::tempdir_in(tmp).expect("a store");
    let store = Store::new(Arc::new(PosixBackend::open(dir.path()).expect("a store")));
    let t = Instant::now();
    rt.block_on(store.put_blob_file_with(&blob, Compression::None))
        .expect("put");
    let s = t.elapsed().as_secs_f64();
    println!(
        "  plain:        {:.2} s ({:.0} MB/s), stored {:.1} MB",
        s,
        mb(size) / s,
        mb(size)
    );
    let _ = std::fs::remove_file(&blob);
}

/// Mount the node's layer through its daemon and read `files` (relative to the tree) cold.
fn cold_read(node: &mut LocalNode, files: &[(PathBuf, u64)]) -> (f64, u64, u64) {
    node.start_daemon(&[]);
    let mp = node.dir.path().join("mnt");
    std::fs::create_dir_all(&mp).expect("a mountpoint");
    node.ok(&["mount", "base/tree:1", mp.to_str().expect("UTF-8")]);
    drop_caches();
    let t = Instant::now();
    let mut read = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (rel, _) in files {
        let mut f = std::fs::File::open(mp.join(rel)).expect("open a file of the layer");
        loop {
            let n = f.read(&mut buf).expect("read a file of the layer");
            if n == 0 {
                break;
            }
            read += n as u64;
        }
    }
    let seconds = t.elapsed().as_secs_f64();
    let stats = node.json(&["cache", "stats"]);
    let fetched = stats["bytes_fetched"].as_u64().unwrap_or(0);
    node.ok(&["umount", mp.to_str().expect("UTF-8")]);
    (seconds, read, fetched)
}

fn main() {
    if !rustix::process::geteuid().is_root() {
        println!("SKIPPED compress: needs root (drop_caches, mounts)");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the compress bench needs root under CI"
        );
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let trees: Vec<PathBuf> = match std::env::var("STRATA_COMPRESS_TREES") {
        Ok(v) => v.split(':').map(PathBuf::from).collect(),
        Err(_) if bench::full_run() => {
            let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()));
            let mut t = vec![
                PathBuf::from("/usr/lib/x86_64-linux-gnu"),
                bench::node::debian_tree(),
            ];
            // A large tree (the Rust toolchains: 100k+ entries) and one of many small files
            // (the crates' sources), where this machine has them.
            for extra in [home.join(".rustup"), home.join(".cargo/registry/src")] {
                if extra.is_dir() {
                    t.push(extra);
                } else {
                    println!(
                        "!!!!!!!! compress: {} is not here: not measured",
                        extra.display()
                    );
                }
            }
            t
        }
        // The smoke run (without `--bench`, as CI's `cargo test --bench '*'` runs it): one
        // small real tree, every step.
        Err(_) => vec![bench::node::debian_tree().join("usr/share/doc")],
    };
    let target_tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let tmp = bench::bench_tempdir(target_tmp, "compress-", "the bench directory");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let nydus = bench::measure::nydus_bins();
    if let Err(why) = &nydus {
        println!(
            "\n!!!!!!!! compress: the nydus-image rows are SKIPPED: {why}.\n!!!!!!!! Install \
             nydus 2.2 with `cargo install --locked nydus-rs`, or set STRATA_PEERS_NYDUS_BIN.\n"
        );
    }
    let mut first: Option<(LocalNode, LocalNode)> = None;
    for tree in &trees {
        let files = files_bfs(tree);
        let bytes: u64 = files.iter().map(|f| f.1).sum();
        println!(
            "== {} ({} entries, {} files, {:.1} MB of file data)",
            tree.display(),
            entries(tree),
            files.len(),
            mb(bytes)
        );
        let plain = strata_build(tmp.path(), tree, "none");
        let zstd = strata_build(tmp.path(), tree, "zstd");
        let mut rows: Vec<(String, Build)> = Vec::new();
        if let Ok((nydus_image, _)) = &nydus {
            for c in ["none", "zstd"] {
                rows.push((
                    format!("nydus-image `--compressor {c}`"),
                    nydus_build(tmp.path(), nydus_image, tree, c),
                ));
            }
        }
        rows.push((
            "`mkfs.erofs -zzstd`".into(),
            mkfs_build(tmp.path(), tree, &["-zzstd"]),
        ));
        // mkfs.erofs compresses on one thread (about 11 MB/s here): the variant with
        // Strata-sized clusters only on trees under 1 GB.
        if bytes < 1 << 30 {
            rows.push((
                "`mkfs.erofs -zzstd -C262144`".into(),
                mkfs_build(tmp.path(), tree, &["-zzstd", "-C262144"]),
            ));
        }
        println!(
            "| build | wall time | stored bytes | stored / Strata plain | peak anonymous RSS | \
             peak file-backed RSS |"
        );
        println!("| --- | ---: | ---: | ---: | ---: | ---: |");
        let row = |what: &str, b: &Build| {
            println!(
                "| {what} | {:.2} s | {:.1} MB | {:.3} | {:.0} MB | {:.0} MB |",
                b.seconds,
                mb(b.stored),
                b.stored as f64 / plain.build.stored as f64,
                mb(b.peak_anon),
                mb(b.peak_file)
            );
        };
        row("Strata `--compress none`", &plain.build);
        row("Strata zstd (default)", &zstd.build);
        for (what, b) in &rows {
            row(what, b);
        }
        println!(
            "  (meta image + data blob, plain: {:.1} MB)",
            mb(plain.blob_bytes)
        );
        if plain.blob_bytes > 1 << 30 {
            println!("levels: not run on a blob over 1 GB (the smaller trees have the sweep)");
        } else {
            println!("levels (the data blob alone, put into a fresh store):");
            levels(&rt, tmp.path(), &plain.node);
        }
        if first.is_none() {
            first = Some((plain.node, zstd.node));
        }
    }
    if let (Some((mut plain, mut zstd)), Some(tree)) = (first, trees.first()) {
        let files = files_bfs(tree);
        let tenth: Vec<_> = files.iter().step_by(10).cloned().collect();
        println!(
            "== cold reads of {} through the node daemon",
            tree.display()
        );
        println!("| layer | read | bytes read | wall time | MB/s | bytes fetched |");
        println!("| --- | --- | ---: | ---: | ---: | ---: |");
        for (label, node) in [("plain", &mut plain), ("zstd", &mut zstd)] {
            let (s, r, f) = cold_read(node, &files);
            println!(
                "| {label} | every file | {:.1} MB | {s:.2} s | {:.0} | {:.1} MB |",
                mb(r),
                mb(r) / s,
                mb(f)
            );
        }
        // Every 10th file, each node restarted with empty caches.
        for (label, node) in [("plain", &mut plain), ("zstd", &mut zstd)] {
            node.stop_daemon();
            std::fs::remove_dir_all(node.dir.path().join("home/cache")).expect("empty the caches");
            let (s, r, f) = cold_read(node, &tenth);
            println!(
                "| {label} | every 10th file | {:.1} MB | {s:.3} s | {:.0} | {:.1} MB |",
                mb(r),
                mb(r) / s,
                mb(f)
            );
        }
    }
}
