//! Strata against native reads and against nydus 2.2 (`nydus-image` + `nydusd`), side by side
//! in one run on the same trees: cold reads, a metadata walk, and reads served from each
//! daemon's local disk cache (Strata's level 2, nydusd's blobcache) after a restart.
//!
//! A scenario harness (no criterion), run as root (drop_caches, mounts, a memory cgroup):
//!
//! ```sh
//! export CARGO_TARGET_DIR=/var/cache/strata/target
//! cargo build --release --bin strata
//! cargo install --locked nydus-rs    # optional: nydus-image and nydusd 2.2 in ~/.cargo/bin
//! cargo bench -p bench --bench peers
//! ```
//!
//! Trees: `STRATA_PEERS_TREES` (colon-separated), default `/usr/lib/x86_64-linux-gnu` and the
//! Debian minbase root ([`bench::node::debian_tree`]); the smoke run (without `--bench`) takes
//! the minbase root's `usr/share/doc`. nydus: `STRATA_PEERS_NYDUS_BIN` (the directory holding
//! `nydus-image` and `nydusd`, default `~/.cargo/bin`, then `PATH`); without them the nydusd
//! columns are skipped with a loud line, and native and Strata are still measured.
//! `STRATA_PEERS_NYDUS_THREADS` sets `nydusd --fuse-threads` (default: nydusd's own, 4; the
//! Strata daemon uses its default of 8).
//!
//! Systems, each on the same tree:
//! - **native**: the tree itself, on the local disk;
//! - **Strata zstd / plain**: `strata layer build TREE --name base/t:1` (default zstd) and with
//!   `--compress none`, each into a fresh node (local POSIX store on the same disk), mounted
//!   with `strata mount` by that node's daemon;
//! - **nydusd zstd / plain**: `nydus-image create --fs-version 6 --chunk-size 0x40000
//!   --compressor zstd|none --blob-dir B --bootstrap BOOT TREE`, served by `nydusd` (FUSE,
//!   `localfs` backend on `B`, `blobcache` with its own `work_dir`, RAFS `mode: direct`, no
//!   prefetch, no digest validation: nydus's defaults; `--rlimit-nofile 0`).
//!
//! Steps, the page cache dropped (`sync; echo 3 > drop_caches`) before every timed one; a
//! "fresh" daemon is a new process with its disk cache removed:
//! 1. **cold sequential read of the largest file** (1 MiB `read`s), fresh daemon;
//! 2. **cold first read of every 10th file** (breadth-first name order — the layout order of
//!    both builders — one thread, each file read whole), fresh daemon: wall time, and the
//!    page-cache growth of the read (this process's own memory cgroup, v1 `total_cache`, which
//!    the daemons it starts are charged to as well; `/proc/meminfo` `Cached` when there is no
//!    such cgroup); bytes the daemon fetched from its backend (Strata: `strata status`'s cache
//!    counters, nydusd: its `/api/v1/metrics/backend`);
//! 3. **cold `find TREE -printf '%s\n'`** (every entry `lstat`ed), fresh daemon;
//! 4. **cold read of every file** (same order), fresh daemon; then, for Strata, `strata warm`
//!    (every chunk in level 2; it fetches nothing more when the read took every chunk);
//! 5. **level-2 hits**: the daemon restarted on its warm disk cache (level 1 empty), the layer
//!    mounted again, the page cache dropped: the sequential read of the largest file, then
//!    (restarted again) the 10% read with its page-cache growth. Strata twice: mounted while
//!    wholly in level 2 (FUSE passthrough to the pinned level-2 file, the default) and with
//!    `strata daemon --no-passthrough` (through the chunk cache from level 2); nydusd once
//!    (its blobcache kept by the restart), shown in both rows.
//!
//! Native is measured first and again last ("native, again"). Ratios are speeds (MB/s, or the
//! inverse of wall time; page-cache growth: plain ratios) against the first native cold read
//! of the same files (higher is faster), and Strata's against nydusd's with the same
//! compression.
//! Figures and the machine: `bench/README.md`, "peers".

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bench::node::LocalNode;

const LAYER: &str = "base/t:1";

fn drop_caches() {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").expect("drop the page cache");
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// Regular files under `root` in breadth-first name order (the order both builders lay out
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

/// The tree and the file sets every system reads.
#[derive(Debug)]
struct Tree {
    root: PathBuf,
    all: Vec<(PathBuf, u64)>,
    largest: PathBuf,
    largest_bytes: u64,
    tenth: Vec<(PathBuf, u64)>,
}

impl Tree {
    fn new(root: PathBuf) -> Self {
        let all = files_bfs(&root);
        let (largest, largest_bytes) = all
            .iter()
            .max_by_key(|f| f.1)
            .cloned()
            .expect("a tree with at least one file");
        let tenth = all.iter().step_by(10).cloned().collect();
        Self {
            root,
            all,
            largest,
            largest_bytes,
            tenth,
        }
    }
}

// ---- the memory cgroup --------------------------------------------------------------------

/// This process's own memory cgroup (v1), entered before anything is started: the bench and
/// every daemon it starts are charged to it, apart from whatever else runs on the machine.
/// Moved out of and removed when dropped.
#[derive(Debug)]
struct OwnCgroup {
    dir: PathBuf,
    back: PathBuf,
}

impl OwnCgroup {
    fn enter() -> Option<Self> {
        let root = Path::new("/sys/fs/cgroup/memory");
        let rel = std::fs::read_to_string("/proc/self/cgroup")
            .ok()?
            .lines()
            .find_map(|l| {
                let mut f = l.splitn(3, ':');
                f.next()?;
                let controllers = f.next()?;
                let path = f.next()?;
                controllers
                    .split(',')
                    .any(|c| c == "memory")
                    .then(|| path.trim_start_matches('/').to_owned())
            })?;
        let back = root.join(rel);
        let dir = root.join(format!("strata-bench-peers-{}", std::process::id()));
        std::fs::create_dir(&dir).ok()?;
        if std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string()).is_err() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(Self { dir, back })
    }

    fn cache(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("memory.stat"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("total_cache ")?.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for OwnCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.back.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        for _ in 0..200 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("peers: could not remove {}", self.dir.display());
    }
}

/// Bytes of page cache: the cgroup's, or the machine's `Cached`.
fn page_cache(cg: Option<&OwnCgroup>) -> u64 {
    if let Some(cg) = cg {
        return cg.cache();
    }
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let kb: u64 = l
                .strip_prefix("Cached:")?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(kb * 1024)
        })
        .unwrap_or(0)
}

/// Bytes of `files` under `root` resident in the page cache (`fincore`), if it runs.
fn resident(root: &Path, files: &[(PathBuf, u64)]) -> Option<u64> {
    let mut total = 0;
    for part in files.chunks(500) {
        let out = Command::new("fincore")
            .args(["-b", "-n", "-o", "RES"])
            .args(part.iter().map(|f| root.join(&f.0)))
            .stderr(Stdio::null())
            .output()
            .ok()?;
        total += String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse::<u64>().ok())
            .sum::<u64>();
    }
    Some(total)
}

// ---- reads ------------------------------------------------------------------------------

fn read_whole(path: &Path, buf: &mut [u8]) -> u64 {
    let mut f =
        std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut n = 0u64;
    loop {
        match f.read(buf) {
            Ok(0) => return n,
            Ok(k) => n += k as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("read {}: {e}", path.display()),
        }
    }
}

/// What one timed read gave.
#[derive(Clone, Copy, Debug, Default)]
struct Read1 {
    seconds: f64,
    bytes: u64,
    growth: u64,
}

/// Drop the page cache, then read `files` under `root` whole, one after the other.
fn timed_read(root: &Path, files: &[(PathBuf, u64)], cg: Option<&OwnCgroup>) -> Read1 {
    let mut buf = vec![0u8; 1 << 20];
    drop_caches();
    let before = page_cache(cg);
    let t = Instant::now();
    let bytes = files
        .iter()
        .map(|(rel, _)| read_whole(&root.join(rel), &mut buf))
        .sum();
    let seconds = t.elapsed().as_secs_f64();
    let growth = page_cache(cg).saturating_sub(before);
    Read1 {
        seconds,
        bytes,
        growth,
    }
}

/// Drop the page cache, then `find ROOT -printf '%s\n'` (every entry `lstat`ed).
fn timed_find(root: &Path) -> (f64, usize) {
    drop_caches();
    let t = Instant::now();
    let out = Command::new("find")
        .arg(root)
        .args(["-printf", "%s\n"])
        .stderr(Stdio::inherit())
        .output()
        .expect("run find");
    let seconds = t.elapsed().as_secs_f64();
    assert!(out.status.success(), "find {} failed", root.display());
    (seconds, out.stdout.iter().filter(|b| **b == b'\n').count())
}

// ---- results ----------------------------------------------------------------------------

/// One system's figures on one tree.
#[derive(Debug, Default)]
struct Col {
    name: String,
    build_seconds: Option<f64>,
    stored: Option<u64>,
    seq: Option<Read1>,
    tenth: Option<Read1>,
    /// Bytes fetched from the backend, and backend requests, for the cold 10% read.
    tenth_fetched: Option<(u64, u64)>,
    /// Strata: FUSE read requests of the blob files and their bytes for the cold 10% read.
    tenth_fuse: Option<(u64, u64)>,
    find: Option<(f64, usize)>,
    all: Option<Read1>,
    l2_seq_pt: Option<Read1>,
    l2_tenth_pt: Option<Read1>,
    l2_seq_cache: Option<Read1>,
    l2_tenth_cache: Option<Read1>,
    /// Bytes fetched from the backend during the level-2 reads (should be 0).
    l2_fetched: Option<u64>,
    notes: Vec<String>,
}

fn speed(r: &Read1) -> f64 {
    mb(r.bytes) / r.seconds
}

// ---- Strata -----------------------------------------------------------------------------

/// A Strata node with its layer built, its daemon and its user mount.
#[derive(Debug)]
struct StrataSys {
    node: LocalNode,
    mp: PathBuf,
    mounted: bool,
}

impl StrataSys {
    fn build(tmp: &Path, tree: &Tree, compress: &str, col: &mut Col) -> Self {
        let node = LocalNode::new(tmp, "peers-strata-");
        let mp = node.dir.path().join("mnt");
        std::fs::create_dir_all(&mp).expect("a mountpoint");
        drop_caches();
        let t = Instant::now();
        node.json(&[
            "layer",
            "build",
            utf8(&tree.root),
            "--name",
            LAYER,
            "--compress",
            compress,
        ]);
        col.build_seconds = Some(t.elapsed().as_secs_f64());
        col.stored = Some(bench::du(&node.dir.path().join("store/blobs")));
        Self {
            node,
            mp,
            mounted: false,
        }
    }

    /// Stop the daemon (after unmounting), optionally empty its caches, start it with
    /// `flags` and mount the layer.
    fn restart(&mut self, wipe: bool, flags: &[&str]) {
        self.unmount();
        self.node.stop_daemon();
        if wipe {
            let _ = std::fs::remove_dir_all(self.node.dir.path().join("home/cache"));
        }
        // No access traces: a cold read here is a node's first read of a layer nobody traced
        // (a trace recorded by one step would be replayed as prefetch in the next; the
        // `locality` bench measures traces).
        let flags: Vec<&std::ffi::OsStr> = ["--trace-window", "0"]
            .iter()
            .chain(flags)
            .map(std::ffi::OsStr::new)
            .collect();
        self.node.start_daemon(&flags);
        self.node.ok(&["mount", LAYER, utf8(&self.mp)]);
        self.mounted = true;
    }

    fn unmount(&mut self) {
        if self.mounted {
            self.node.ok(&["umount", utf8(&self.mp)]);
            self.mounted = false;
        }
    }

    fn status(&self) -> serde_json::Value {
        self.node.json(&["status"])
    }

    fn fetched(&self) -> (u64, u64) {
        let s = self.status();
        (
            s["cache"]["bytes_fetched"].as_u64().unwrap_or(0),
            s["cache"]["backend_requests"].as_u64().unwrap_or(0),
        )
    }

    fn passthrough_blobs(&self) -> u64 {
        self.status()["layers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| l["passthrough_blobs"].as_u64().unwrap_or(0))
            .sum()
    }
}

impl Drop for StrataSys {
    fn drop(&mut self) {
        if self.mounted {
            let _ = self
                .node
                .cmd()
                .args(["umount", utf8(&self.mp)])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        // The node's own drop stops the daemon and unmounts what is left under its directory.
    }
}

fn strata_column(
    tmp: &Path,
    tree: &Tree,
    compress: &str,
    label: &str,
    cg: Option<&OwnCgroup>,
) -> Col {
    let mut col = Col {
        name: label.to_owned(),
        ..Col::default()
    };
    let mut s = StrataSys::build(tmp, tree, compress, &mut col);
    let mp = s.mp.clone();
    let largest = [(tree.largest.clone(), tree.largest_bytes)];

    s.restart(true, &[]);
    col.seq = Some(timed_read(&mp, &largest, cg));

    s.restart(true, &[]);
    let st0 = s.status();
    col.tenth = Some(timed_read(&mp, &tree.tenth, cg));
    let st1 = s.status();
    let d = |a: &str, b: &str| {
        st1[a][b]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(st0[a][b].as_u64().unwrap_or(0))
    };
    col.tenth_fetched = Some((d("cache", "bytes_fetched"), d("cache", "backend_requests")));
    col.tenth_fuse = Some((d("node", "fuse_reads"), d("node", "fuse_read_bytes")));
    col.notes.push(format!(
        "cold 10%: cache hits {} (memory {}, disk {}), misses {}, coalesced chunks {}, \
         bytes read through the cache {:.1} MB",
        d("cache", "hits"),
        d("cache", "hits_memory"),
        d("cache", "hits_disk"),
        d("cache", "misses"),
        d("cache", "coalesced_chunks"),
        mb(d("cache", "bytes_read")),
    ));
    // What the daemon holds in memory for it (`strata daemon --meta-pin-mb`): the mounted
    // layer's meta image, whose pages the drop before each read cannot evict.
    col.notes.push(format!(
        "meta image kept in memory: {:.1} MB",
        mb(st1["node"]["meta_pinned_bytes"].as_u64().unwrap_or(0))
    ));

    s.restart(true, &[]);
    col.find = Some(timed_find(&mp));

    s.restart(true, &[]);
    let skipped = |s: &StrataSys| s.status()["cache"]["disk_writes_skipped"].as_u64();
    let sk0 = skipped(&s);
    col.all = Some(timed_read(&mp, &tree.all, cg));
    let sk1 = skipped(&s);
    let warm = s.node.json(&["warm", LAYER]);
    let warm = warm.get(0).unwrap_or(&warm);
    col.notes.push(format!(
        "cold read of every file: {} fetched chunks not kept in level 2 (too many pending \
         writes); warm after it: fetched {:.1} MB more, wholly local: {}, passthrough next: {}",
        match (sk0, sk1) {
            (Some(a), Some(b)) => (b - a).to_string(),
            _ => "?".into(),
        },
        mb(warm["fetched"].as_u64().unwrap_or(0)),
        warm["local"],
        warm["passthrough_next"],
    ));

    let mut l2_fetched = 0;
    for (flags, seq_slot, tenth_slot) in [
        (&[][..], &mut col.l2_seq_pt, &mut col.l2_tenth_pt),
        (
            &["--no-passthrough"][..],
            &mut col.l2_seq_cache,
            &mut col.l2_tenth_cache,
        ),
    ] {
        s.restart(false, flags);
        let f0 = s.fetched().0;
        let pt = s.passthrough_blobs();
        *seq_slot = Some(timed_read(&mp, &largest, cg));
        l2_fetched += s.fetched().0.saturating_sub(f0);
        s.restart(false, flags);
        let f0 = s.fetched().0;
        *tenth_slot = Some(timed_read(&mp, &tree.tenth, cg));
        l2_fetched += s.fetched().0.saturating_sub(f0);
        col.notes.push(format!(
            "level 2, daemon {flags:?}: blobs in passthrough at mount: {pt}"
        ));
    }
    col.l2_fetched = Some(l2_fetched);
    s.unmount();
    s.node.stop_daemon();
    col
}

// ---- nydus ------------------------------------------------------------------------------

/// A running `nydusd`: stopped (SIGTERM, then SIGKILL) and its mountpoint detached when
/// dropped, also on a panic.
#[derive(Debug)]
struct Nydusd {
    child: Child,
    mp: PathBuf,
    sock: PathBuf,
}

impl Nydusd {
    fn start(bin: &Path, dir: &Path, mp: &Path) -> Self {
        let sock = dir.join("api.sock");
        let _ = std::fs::remove_file(&sock);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("nydusd.log"))
            .expect("nydusd's log");
        let mut c = Command::new(bin);
        c.arg("--config")
            .arg(dir.join("config.json"))
            .arg("--bootstrap")
            .arg(dir.join("bootstrap"))
            .arg("--mountpoint")
            .arg(mp)
            .arg("--apisock")
            .arg(&sock)
            .args(["--log-level", "warn", "--rlimit-nofile", "0"]);
        if let Ok(t) = std::env::var("STRATA_PEERS_NYDUS_THREADS") {
            c.args(["--fuse-threads", &t]);
        }
        c.stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let mut d = Self {
            child: c.spawn().expect("start nydusd"),
            mp: mp.to_owned(),
            sock,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = d.child.try_wait().ok().flatten() {
                let log = std::fs::read_to_string(dir.join("nydusd.log")).unwrap_or_default();
                panic!(
                    "nydusd exited ({st}) before it mounted {}:\n{log}",
                    mp.display()
                );
            }
            let running = d
                .api("/api/v1/daemon")
                .is_some_and(|v| v["state"] == "RUNNING");
            if running && is_mountpoint(mp) {
                return d;
            }
            assert!(
                Instant::now() < deadline,
                "nydusd did not mount within 60 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `GET path` on the daemon's API socket, parsed.
    fn api(&self, path: &str) -> Option<serde_json::Value> {
        let mut s = std::os::unix::net::UnixStream::connect(&self.sock).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut got = Vec::new();
        let mut buf = [0u8; 16384];
        loop {
            let n = s.read(&mut buf).ok()?;
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            // Stop once the body named by Content-Length is in.
            if let Some(h) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..h]).to_ascii_lowercase();
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:")?.trim().parse().ok());
                if len.is_some_and(|l: usize| got.len() >= h + 4 + l) {
                    break;
                }
            }
        }
        let h = got.windows(4).position(|w| w == b"\r\n\r\n")?;
        serde_json::from_slice(&got[h + 4..]).ok()
    }

    /// Bytes read from the backend and backend reads, since this process started.
    fn backend(&self) -> (u64, u64) {
        let v = self.api("/api/v1/metrics/backend").unwrap_or_default();
        (
            v["read_amount_total"].as_u64().unwrap_or(0),
            v["read_count"].as_u64().unwrap_or(0),
        )
    }
}

impl Drop for Nydusd {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if is_mountpoint(&self.mp) {
            let _ = rustix::mount::unmount(&self.mp, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

fn is_mountpoint(p: &Path) -> bool {
    let p = p.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(&*p))
}

/// A nydus image of the tree (bootstrap + blob directory) and its daemon's directories.
#[derive(Debug)]
struct NydusSys {
    bin: PathBuf,
    dir: tempfile::TempDir,
    mp: PathBuf,
    daemon: Option<Nydusd>,
}

impl NydusSys {
    fn build(
        tmp: &Path,
        bins: &(PathBuf, PathBuf),
        tree: &Tree,
        compressor: &str,
        col: &mut Col,
    ) -> Self {
        let dir = bench::bench_tempdir(tmp, "peers-nydus-", "the nydus directory");
        let blobs = dir.path().join("blobs");
        let mp = dir.path().join("mnt");
        std::fs::create_dir_all(&blobs).expect("the blob directory");
        std::fs::create_dir_all(&mp).expect("a mountpoint");
        drop_caches();
        let t = Instant::now();
        let out = bench::measure::nydus_create(
            &bins.0,
            compressor,
            &blobs,
            &dir.path().join("bootstrap"),
        )
        .arg(&tree.root)
        .output()
        .expect("run nydus-image");
        col.build_seconds = Some(t.elapsed().as_secs_f64());
        assert!(
            out.status.success(),
            "nydus-image create {}: {}",
            tree.root.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        col.stored = Some(bench::du(&blobs) + bench::du(&dir.path().join("bootstrap")));
        let cache = dir.path().join("cache");
        let config = serde_json::json!({
            "device": {
                "backend": { "type": "localfs", "config": { "dir": blobs } },
                "cache": { "type": "blobcache", "config": { "work_dir": cache } },
            },
            "mode": "direct",
            "digest_validate": false,
            "iostats_files": false,
            "enable_xattr": true,
            "fs_prefetch": { "enable": false },
        });
        std::fs::write(dir.path().join("config.json"), config.to_string()).expect("config");
        Self {
            bin: bins.1.clone(),
            dir,
            mp,
            daemon: None,
        }
    }

    fn restart(&mut self, wipe: bool) {
        self.daemon = None;
        let cache = self.dir.path().join("cache");
        if wipe {
            let _ = std::fs::remove_dir_all(&cache);
        }
        std::fs::create_dir_all(&cache).expect("the blobcache directory");
        self.daemon = Some(Nydusd::start(&self.bin, self.dir.path(), &self.mp));
    }

    fn backend(&self) -> (u64, u64) {
        self.daemon
            .as_ref()
            .map(Nydusd::backend)
            .unwrap_or_default()
    }
}

impl Drop for NydusSys {
    fn drop(&mut self) {
        self.daemon = None;
        bench::node::unmount_under(self.dir.path());
    }
}

fn nydus_column(
    tmp: &Path,
    bins: &(PathBuf, PathBuf),
    tree: &Tree,
    compressor: &str,
    label: &str,
    cg: Option<&OwnCgroup>,
) -> Col {
    let mut col = Col {
        name: label.to_owned(),
        ..Col::default()
    };
    let mut n = NydusSys::build(tmp, bins, tree, compressor, &mut col);
    let mp = n.mp.clone();
    let largest = [(tree.largest.clone(), tree.largest_bytes)];

    n.restart(true);
    col.seq = Some(timed_read(&mp, &largest, cg));

    n.restart(true);
    let b0 = n.backend();
    col.tenth = Some(timed_read(&mp, &tree.tenth, cg));
    let b1 = n.backend();
    col.tenth_fetched = Some((b1.0 - b0.0, b1.1 - b0.1));

    n.restart(true);
    col.find = Some(timed_find(&mp));

    n.restart(true);
    col.all = Some(timed_read(&mp, &tree.all, cg));

    let mut l2_fetched = 0;
    n.restart(false);
    let b0 = n.backend().0;
    let seq = timed_read(&mp, &largest, cg);
    l2_fetched += n.backend().0 - b0;
    n.restart(false);
    let b0 = n.backend().0;
    let tenth = timed_read(&mp, &tree.tenth, cg);
    l2_fetched += n.backend().0 - b0;
    col.l2_seq_pt = Some(seq);
    col.l2_seq_cache = Some(seq);
    col.l2_tenth_pt = Some(tenth);
    col.l2_tenth_cache = Some(tenth);
    col.l2_fetched = Some(l2_fetched);
    col.notes.push(format!(
        "blobcache after the runs: {:.1} MB on disk",
        mb(bench::du(&n.dir.path().join("cache")))
    ));
    n.daemon = None;
    col
}

// ---- the table --------------------------------------------------------------------------

fn native_column(tree: &Tree, cg: Option<&OwnCgroup>) -> Col {
    let largest = [(tree.largest.clone(), tree.largest_bytes)];
    let seq = timed_read(&tree.root, &largest, cg);
    let mut notes = Vec::new();
    drop_caches();
    if let Some(r) = resident(&tree.root, &tree.tenth) {
        notes.push(format!(
            "resident right after drop_caches (mapped by running processes): {:.1} MB of the \
             10% set's {:.1} MB",
            mb(r),
            mb(tree.tenth.iter().map(|f| f.1).sum())
        ));
    }
    let tenth = timed_read(&tree.root, &tree.tenth, cg);
    let find = timed_find(&tree.root);
    let all = timed_read(&tree.root, &tree.all, cg);
    Col {
        name: "native".into(),
        seq: Some(seq),
        tenth: Some(tenth),
        find: Some(find),
        all: Some(all),
        // Native has no daemon cache: its level-2 peer is its own cold read.
        l2_seq_pt: Some(seq),
        l2_seq_cache: Some(seq),
        l2_tenth_pt: Some(tenth),
        l2_tenth_cache: Some(tenth),
        notes,
        ..Col::default()
    }
}

/// How a row's figure is shown and compared.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// MB/s of a read; ratio: speed / speed.
    Speed,
    /// Seconds; ratio: the inverse (speed).
    Time,
    /// Bytes (MB); ratio: x / native.
    Bytes,
}

fn print_table(tree: &Tree, cols: &[Col]) {
    let native = &cols[0];
    type Get = fn(&Col) -> Option<f64>;
    let rows: Vec<(&str, Kind, Get)> = vec![
        (
            "cold sequential read, largest file (MB/s)",
            Kind::Speed,
            |c| c.seq.as_ref().map(speed),
        ),
        ("cold read of every 10th file (s)", Kind::Time, |c| {
            c.tenth.map(|r| r.seconds)
        }),
        ("— its page-cache growth (MB)", Kind::Bytes, |c| {
            c.tenth.map(|r| mb(r.growth))
        }),
        ("cold `find` (s)", Kind::Time, |c| c.find.map(|f| f.0)),
        ("cold read of every file (MB/s)", Kind::Speed, |c| {
            c.all.as_ref().map(speed)
        }),
        (
            "level 2, largest file, Strata passthrough (MB/s)",
            Kind::Speed,
            |c| c.l2_seq_pt.as_ref().map(speed),
        ),
        (
            "level 2, largest file, Strata through the cache (MB/s)",
            Kind::Speed,
            |c| c.l2_seq_cache.as_ref().map(speed),
        ),
        (
            "level 2, every 10th file, Strata passthrough (s)",
            Kind::Time,
            |c| c.l2_tenth_pt.map(|r| r.seconds),
        ),
        ("— its page-cache growth (MB)", Kind::Bytes, |c| {
            c.l2_tenth_pt.map(|r| mb(r.growth))
        }),
        (
            "level 2, every 10th file, Strata through the cache (s)",
            Kind::Time,
            |c| c.l2_tenth_cache.map(|r| r.seconds),
        ),
        ("— its page-cache growth (MB)", Kind::Bytes, |c| {
            c.l2_tenth_cache.map(|r| mb(r.growth))
        }),
    ];
    let ratio = |k: Kind, x: f64, base: f64| match k {
        Kind::Speed | Kind::Bytes => x / base,
        Kind::Time => base / x,
    };
    let tenth_bytes: u64 = tree.tenth.iter().map(|f| f.1).sum();
    let all_bytes: u64 = tree.all.iter().map(|f| f.1).sum();
    println!(
        "\n### {} ({} files, {:.1} MB; largest {} {:.1} MB; every 10th file: {} files, {:.1} MB)\n",
        tree.root.display(),
        tree.all.len(),
        mb(all_bytes),
        tree.largest.display(),
        mb(tree.largest_bytes),
        tree.tenth.len(),
        mb(tenth_bytes),
    );
    // Pairs Strata / nydusd with the same compression, when both are there.
    let pairs: Vec<(usize, usize)> = ["zstd", "plain"]
        .iter()
        .filter_map(|c| {
            let s = cols.iter().position(|x| x.name == format!("Strata {c}"))?;
            let n = cols.iter().position(|x| x.name == format!("nydusd {c}"))?;
            Some((s, n))
        })
        .collect();
    let mut head = String::from("| step |");
    let mut rule = String::from("| --- |");
    for c in cols {
        head += &format!(" {} |", c.name);
        rule += " ---: |";
    }
    for c in &cols[1..] {
        head += &format!(" {} / native |", c.name);
        rule += " ---: |";
    }
    for (s, n) in &pairs {
        head += &format!(" {} / {} |", cols[*s].name, cols[*n].name);
        rule += " ---: |";
    }
    println!("{head}\n{rule}");
    for (label, kind, get) in rows {
        let mut line = format!("| {label} |");
        for c in cols {
            line += &match get(c) {
                Some(v) if matches!(kind, Kind::Time) => format!(" {v:.3} |"),
                Some(v) => format!(" {v:.1} |"),
                None => " — |".into(),
            };
        }
        let base = get(native);
        for c in &cols[1..] {
            line += &match (get(c), base) {
                (Some(v), Some(b)) if b > 0.0 && v > 0.0 => {
                    format!(" {:.2} |", ratio(kind, v, b))
                }
                _ => " — |".into(),
            };
        }
        for (s, n) in &pairs {
            line += &match (get(&cols[*s]), get(&cols[*n])) {
                (Some(a), Some(b)) if a > 0.0 && b > 0.0 => format!(" {:.2} |", ratio(kind, a, b)),
                _ => " — |".into(),
            };
        }
        println!("{line}");
    }
    println!();
    for c in &cols[1..] {
        let mut bits = Vec::new();
        if let (Some(s), Some(b)) = (c.build_seconds, c.stored) {
            bits.push(format!("build {s:.2} s, stored {:.1} MB", mb(b)));
        }
        if let Some((f, r)) = c.tenth_fetched {
            bits.push(format!(
                "cold 10%: fetched {:.1} MB in {r} backend reads",
                mb(f)
            ));
        }
        if let Some((n, b)) = c.tenth_fuse {
            bits.push(format!(
                "{n} FUSE reads of the blob files ({:.1} MB)",
                mb(b)
            ));
        }
        if let Some(f) = c.l2_fetched {
            bits.push(format!("level-2 reads fetched {:.1} MB", mb(f)));
        }
        if !bits.is_empty() {
            println!("- {}: {}", c.name, bits.join("; "));
        }
    }
    for c in cols {
        for n in &c.notes {
            println!("- {}: {n}", c.name);
        }
        if let Some(f) = c.find {
            if c.name == "native" {
                println!("- find printed {} entries", f.1);
            }
        }
    }
    println!(
        "- bytes read: largest {:.1} MB, 10% {:.1} MB, every file {:.1} MB (each system read \
         the same bytes; checked)",
        mb(native.seq.map_or(0, |r| r.bytes)),
        mb(native.tenth.map_or(0, |r| r.bytes)),
        mb(native.all.map_or(0, |r| r.bytes)),
    );
}

fn main() {
    if !rustix::process::geteuid().is_root() {
        println!("SKIPPED peers: needs root (drop_caches, mounts)");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the peers bench needs root under CI"
        );
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let trees: Vec<PathBuf> = match std::env::var("STRATA_PEERS_TREES") {
        Ok(v) => v.split(':').map(PathBuf::from).collect(),
        Err(_) if bench::full_run() => vec![
            PathBuf::from("/usr/lib/x86_64-linux-gnu"),
            bench::node::debian_tree(),
        ],
        Err(_) => vec![bench::node::debian_tree().join("usr/share/doc")],
    };
    let nydus = bench::measure::nydus_bins();
    if let Err(why) = &nydus {
        println!(
            "\n!!!!!!!! peers: the nydusd columns are SKIPPED: {why}.\n!!!!!!!! Install nydus \
             2.2 with `cargo install --locked nydus-rs` (nydus-image and nydusd in \
             ~/.cargo/bin),\n!!!!!!!! or set STRATA_PEERS_NYDUS_BIN to their directory. \
             Native and Strata are measured.\n"
        );
    }
    let cg = OwnCgroup::enter();
    println!(
        "page-cache growth from {}",
        if cg.is_some() {
            "this bench's own memory cgroup (v1 total_cache; the daemons are charged to it)"
        } else {
            "/proc/meminfo Cached (no memory cgroup v1: the whole machine's, noisy)"
        }
    );
    let target_tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let tmp = bench::bench_tempdir(target_tmp, "peers-", "the bench directory");
    for root in trees {
        let tree = Tree::new(root);
        println!("== {}", tree.root.display());
        let mut cols = vec![native_column(&tree, cg.as_ref())];
        for (c, label) in [("zstd", "Strata zstd"), ("none", "Strata plain")] {
            println!("  {label}…");
            cols.push(strata_column(tmp.path(), &tree, c, label, cg.as_ref()));
        }
        if let Ok(bins) = &nydus {
            for (c, label) in [("zstd", "nydusd zstd"), ("none", "nydusd plain")] {
                println!("  {label}…");
                cols.push(nydus_column(tmp.path(), bins, &tree, c, label, cg.as_ref()));
            }
        }
        // Native again, last: by now the tree has been read by every build, and the daemons'
        // caches were written just before their level-2 reads (a virtual disk's host may
        // still hold either).
        let mut again = native_column(&tree, cg.as_ref());
        again.name = "native, again".into();
        cols.push(again);
        // Every system read the same bytes.
        let native = &cols[0];
        for c in &cols[1..] {
            for (what, a, b) in [
                ("largest", native.seq, c.seq),
                ("10%", native.tenth, c.tenth),
                ("every file", native.all, c.all),
                ("level-2 largest", native.seq, c.l2_seq_pt),
                ("level-2 10%", native.tenth, c.l2_tenth_cache),
            ] {
                assert_eq!(
                    a.map(|r| r.bytes),
                    b.map(|r| r.bytes),
                    "{}: {what}: bytes read differ from native",
                    c.name
                );
            }
        }
        print_table(&tree, &cols);
    }
    if nydus.is_err() {
        println!("\n!!!!!!!! peers: the nydusd columns were SKIPPED (see the top).");
    }
}
