//! Density: what many sandboxes of one stack cost the node's memory. A scenario harness
//! (`harness = false`) that prints markdown tables; nothing is asserted on the figures.
//!
//! 1. **Shared page cache.** A local store with `base/debian:12` (the tree of
//!    `scripts/debian-base.sh`) and two data layers, `toolkit/cold:1` (`/data/cold.bin`) and
//!    `toolkit/warm:1` (`/data/warm.bin`), each one file of `STRATA_BENCH_DENSITY_FILE_MB` (100) MB
//!    of pseudo-random (incompressible) bytes. `strata warm toolkit/warm:1` brings the second into
//!    level 2 before anything mounts it, so that its EROFS reads it in FUSE passthrough. Then
//!    `STRATA_BENCH_DENSITY_READERS` (100) sandboxes of the stack are created, idle. Each pass:
//!    `sync` + `echo 3 > /proc/sys/vm/drop_caches`, a warm-up exec (the `strata` client, `sh`
//!    and `cat` back in the page cache), a snapshot, every sandbox reads the pass's file once
//!    (`sh -c 'cat FILE > /dev/null'`: the first alone, the rest by 4 client threads), `sync`,
//!    a snapshot. The passes:
//!    - `lazy, caches cold`: `/data/cold.bin`, never read before (level 1 and 2 empty for it:
//!      the first reader's misses go to the store);
//!    - `lazy, level 1 warm`: the same file again (its chunks now in the daemon's level 1);
//!    - `lazy, passthrough`: `/data/warm.bin` (wholly in level 2 when mounted);
//!    - `eager`: every sandbox gets its own copy of the same bytes written into its upper
//!      (`/eager/copy.bin`, a plain directory on the bench directory's filesystem, ext4 here),
//!      then reads its copy: the eager baseline (an extracted copy per sandbox on local disk).
//!
//!    A snapshot: `/proc/meminfo` (Cached, MemAvailable, …), the sum of the sandboxes' memory
//!    cgroups' `total_cache` (v1; `file` on v2), the daemon's RSS (anon / file) and PSS, its
//!    level-1 bytes (`strata status`), and the page cache resident of the level-2 directory
//!    and of the store's directory (`fincore`).
//! 2. **Idle sandboxes.** After those are removed: sandboxes of `base/debian:12` alone created
//!    in steps up to `STRATA_BENCH_DENSITY_STEPS` (`0,100,250,500,1000`) by 8 client threads;
//!    at each step (after 2 s): the daemon's RSS, PSS, threads and descriptors, level-1 bytes,
//!    MemAvailable, Slab (unreclaimable), KernelStack, PageTables, the sandboxes' inits' RSS and
//!    PSS, mounts; then all removed (timed) and what the daemon and the kernel kept after.
//!    The admission defaults of `ManagerConfig::new` (the count `max_sandboxes`, the
//!    `MemAvailable` floor) are printed next to the number of idle sandboxes that would reach
//!    the floor, extrapolated from the measured cost per sandbox.
//!
//! Smoke run (without `--bench`, as `cargo test --benches` runs it in CI; or `DENSITY_SMOKE=1`):
//! 4 readers, a 4 MB file, steps `0,2,4` (a minute).
//! `STRATA_BENCH_DENSITY_SCENARIOS` (`share,idle`) picks the parts.
//!
//! Binaries: `strata` beside the bench executable's directory (`target/release/strata`, after
//! `cargo build --release --bin strata`) or `STRATA_BIN`; `runc`, `fincore` (util-linux).
//! Needs root. Everything it started is removed when it ends (also on a panic:
//! `bench::node::LocalNode` removes the sandboxes, stops the daemon, unmounts and removes its
//! directory). `cargo bench -p bench --bench density`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bench::node::{debian_tree, LocalNode};

const BASE: &str = "base/debian:12";
const COLD: &str = "toolkit/cold:1";
const WARM: &str = "toolkit/warm:1";
const COLD_FILE: &str = "/data/cold.bin";
const WARM_FILE: &str = "/data/warm.bin";
const COPY_DIR: &str = "eager";
const COPY_FILE: &str = "/eager/copy.bin";
/// Client threads for the readers (reads are I/O and page-cache copies, not the runtime).
const READ_THREADS: usize = 4;
/// Client threads for creations and removals.
const CREATE_THREADS: usize = 8;

struct Cfg {
    readers: usize,
    file_bytes: u64,
    steps: Vec<usize>,
    share: bool,
    idle: bool,
}

impl Cfg {
    fn from_env() -> Self {
        let smoke = std::env::var("DENSITY_SMOKE").as_deref() == Ok("1") || !bench::full_run();
        let num = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(default)
        };
        let steps = std::env::var("STRATA_BENCH_DENSITY_STEPS")
            .unwrap_or_else(|_| {
                if smoke {
                    "0,2,4".into()
                } else {
                    "0,100,250,500,1000".into()
                }
            })
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        let scenarios =
            std::env::var("STRATA_BENCH_DENSITY_SCENARIOS").unwrap_or_else(|_| "share,idle".into());
        Self {
            readers: num("STRATA_BENCH_DENSITY_READERS", if smoke { 4 } else { 100 }) as usize,
            file_bytes: num("STRATA_BENCH_DENSITY_FILE_MB", if smoke { 4 } else { 100 })
                * 1_000_000,
            steps,
            share: scenarios.split(',').any(|s| s.trim() == "share"),
            idle: scenarios.split(',').any(|s| s.trim() == "idle"),
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

fn smib(b: i64) -> f64 {
    b as f64 / 1048576.0
}

fn diff(a: u64, b: u64) -> i64 {
    b as i64 - a as i64
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `/proc/meminfo`, in bytes.
fn meminfo() -> BTreeMap<String, u64> {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            let kb: u64 = v.split_whitespace().next()?.parse().ok()?;
            Some((k.to_owned(), kb * 1024))
        })
        .collect()
}

fn mi(m: &BTreeMap<String, u64>, k: &str) -> u64 {
    m.get(k).copied().unwrap_or(0)
}

/// One process's memory and handles.
#[derive(Clone, Copy, Debug, Default)]
struct ProcMem {
    rss: u64,
    anon: u64,
    file: u64,
    pss: u64,
    threads: u64,
    fds: u64,
}

fn proc_mem(pid: u32) -> ProcMem {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |text: &str, k: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    ProcMem {
        rss: field(&status, "VmRSS") * 1024,
        anon: field(&status, "RssAnon") * 1024,
        file: field(&status, "RssFile") * 1024 + field(&status, "RssShmem") * 1024,
        pss: field(&rollup, "Pss") * 1024,
        threads: field(&status, "Threads"),
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64),
    }
}

/// A memory cgroup's charges, bytes: page cache, anonymous memory, kernel memory (v1
/// `total_cache`, `total_rss`, `memory.kmem.usage_in_bytes`; v2 `file`, `anon`, `kernel`).
#[derive(Clone, Copy, Debug, Default)]
struct Memcg {
    cache: u64,
    anon: u64,
    kmem: u64,
}

impl std::ops::Add for Memcg {
    type Output = Memcg;
    fn add(self, o: Memcg) -> Memcg {
        Memcg {
            cache: self.cache + o.cache,
            anon: self.anon + o.anon,
            kmem: self.kmem + o.kmem,
        }
    }
}

fn memcg(dir: &Path) -> Memcg {
    let text = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let f: BTreeMap<&str, u64> = text
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k, v.trim().parse().ok()?))
        })
        .collect();
    let get = |a: &str, b: &str| f.get(a).or_else(|| f.get(b)).copied().unwrap_or(0);
    let kmem = std::fs::read_to_string(dir.join("memory.kmem.usage_in_bytes"))
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| get("kernel", "kernel"));
    Memcg {
        cache: get("total_cache", "file"),
        anon: get("total_rss", "anon"),
        kmem,
    }
}

fn memcg_sum<'a>(dirs: impl Iterator<Item = &'a Path>) -> Memcg {
    dirs.map(memcg).fold(Memcg::default(), |a, b| a + b)
}

/// The bench's own memory cgroup (v1), which it moves into before it starts anything: the
/// bench, the daemon, the clients and runc (before it joins a sandbox's cgroup) are charged to
/// it, apart from whatever else runs on the machine. Moved out of and removed when dropped.
struct OwnCgroup {
    dir: PathBuf,
    back: PathBuf,
}

static OWN_CGROUP: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

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
        let dir = root.join(format!("strata-bench-density-{}", std::process::id()));
        std::fs::create_dir(&dir).ok()?;
        if std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string()).is_err() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        let _ = OWN_CGROUP.set(dir.clone());
        Some(Self { dir, back })
    }
}

impl Drop for OwnCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.back.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        // The daemon's and the fd holder's exits may still be under way.
        for _ in 0..200 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("density: could not remove {}", self.dir.display());
    }
}

fn own_memcg() -> Memcg {
    OWN_CGROUP.get().map(|d| memcg(d)).unwrap_or_default()
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() {
            files_under(&e.path(), out);
        } else if t.is_file() {
            out.push(e.path());
        }
    }
}

/// Bytes of the regular files under `dir` that are in the page cache (`fincore`).
fn resident_under(dir: &Path) -> u64 {
    let mut files = Vec::new();
    files_under(dir, &mut files);
    let mut total = 0;
    for batch in files.chunks(256) {
        let Ok(out) = Command::new("fincore")
            .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
            .args(batch)
            .stderr(Stdio::null())
            .output()
        else {
            return 0;
        };
        total += String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse::<u64>().ok())
            .sum::<u64>();
    }
    total
}

fn drop_caches() {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").expect("drop the page cache");
}

/// `f(0..n)` by `threads` threads; the results in index order.
fn parallel<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let out = Mutex::new(Vec::with_capacity(n));
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                out.lock().unwrap_or_else(|p| p.into_inner()).push((i, r));
            });
        }
    });
    let mut v = out.into_inner().unwrap_or_else(|p| p.into_inner());
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, r)| r).collect()
}

/// `strata ARGS`: its stdout, or its stderr as the error; and how long it took.
fn try_strata(node: &LocalNode, args: &[&str]) -> (Result<String, String>, f64) {
    let t = Instant::now();
    let out = node.cmd().args(args).stdin(Stdio::null()).output();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let r = match out {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().to_owned()),
        Err(e) => Err(e.to_string()),
    };
    (r, ms)
}

/// The daemon's pid, level-1 bytes and level-2 bytes, bytes fetched from the store, and the
/// layers' passthrough blob counts by reference.
struct DaemonStats {
    pid: u32,
    l1: u64,
    l2: u64,
    fetched: u64,
    passthrough: BTreeMap<String, u64>,
}

fn daemon_stats(node: &LocalNode) -> DaemonStats {
    let s = node.json(&["status"]);
    let mut passthrough = BTreeMap::new();
    for l in s["layers"].as_array().into_iter().flatten() {
        for r in l["refs"].as_array().into_iter().flatten() {
            if let Some(r) = r.as_str() {
                passthrough.insert(r.to_owned(), l["passthrough_blobs"].as_u64().unwrap_or(0));
            }
        }
    }
    DaemonStats {
        pid: s["pong"]["pid"].as_u64().expect("the daemon's pid") as u32,
        l1: s["cache"]["memory_bytes"].as_u64().unwrap_or(0),
        l2: s["cache"]["disk"]["bytes"].as_u64().unwrap_or(0),
        fetched: s["cache"]["bytes_fetched"].as_u64().unwrap_or(0),
        passthrough,
    }
}

/// A sandbox of the page-cache part.
struct Sb {
    id: String,
    rootfs: PathBuf,
    upper: PathBuf,
    memcg: PathBuf,
}

fn inspect(node: &LocalNode, id: &str) -> Sb {
    let v = node.json(&["sandbox", "inspect", id]);
    let path = |k: &str| PathBuf::from(v[k].as_str().unwrap_or_else(|| panic!("inspect: {k}")));
    Sb {
        id: id.to_owned(),
        rootfs: path("rootfs"),
        upper: path("upper"),
        memcg: PathBuf::from(
            v["cgroups"]["memory"]
                .as_str()
                .or_else(|| v["cgroups"]["unified"].as_str())
                .expect("the sandbox's memory cgroup"),
        ),
    }
}

/// What one snapshot of the page-cache part holds.
struct Snap {
    mem: BTreeMap<String, u64>,
    sandboxes: Memcg,
    own: Memcg,
    daemon: ProcMem,
    stats: DaemonStats,
    l2_resident: u64,
    store_resident: u64,
}

fn snap(node: &LocalNode, sbs: &[Sb]) -> Snap {
    let stats = daemon_stats(node);
    Snap {
        mem: meminfo(),
        sandboxes: memcg_sum(sbs.iter().map(|s| s.memcg.as_path())),
        own: own_memcg(),
        daemon: proc_mem(stats.pid),
        stats,
        l2_resident: resident_under(&node.dir.path().join("home/cache")),
        store_resident: resident_under(&node.dir.path().join("store")),
    }
}

struct Pass {
    label: String,
    before: Snap,
    after: Snap,
    first_ms: f64,
    rest_ms: Vec<f64>,
    wall_s: f64,
}

/// Drop the page cache, then every sandbox reads `file` once (see the module docs).
fn read_pass(node: &LocalNode, sbs: &[Sb], file: &str, label: &str, size: u64) -> Pass {
    drop_caches();
    // The client, the daemon's code, the shell, `cat` and `wc` back in the page cache before
    // the snapshot: every sandbox runs the reader's command on /dev/null first.
    parallel(sbs.len(), READ_THREADS, |i| {
        let cmd = if i == 0 {
            "cat /dev/null | wc -c"
        } else {
            "cat /dev/null > /dev/null"
        };
        node.ok(&[
            "sandbox",
            "exec",
            &sbs[i].id,
            "--timeout",
            "600",
            "--",
            "sh",
            "-c",
            cmd,
        ]);
    });
    rustix::fs::sync();
    std::thread::sleep(Duration::from_millis(500));
    let before = snap(node, sbs);
    let t = Instant::now();
    let (out, first_ms) = try_strata(
        node,
        &[
            "sandbox",
            "exec",
            &sbs[0].id,
            "--timeout",
            "600",
            "--",
            "sh",
            "-c",
            &format!("cat {file} | wc -c"),
        ],
    );
    let out = out.unwrap_or_else(|e| panic!("{label}: the first reader: {e}"));
    assert_eq!(
        out.trim().parse::<u64>().ok(),
        Some(size),
        "{label}: the first reader read {out:?} bytes of {file}"
    );
    let rest = parallel(sbs.len() - 1, READ_THREADS, |i| {
        let (r, ms) = try_strata(
            node,
            &[
                "sandbox",
                "exec",
                &sbs[i + 1].id,
                "--timeout",
                "600",
                "--",
                "sh",
                "-c",
                &format!("cat {file} > /dev/null"),
            ],
        );
        r.unwrap_or_else(|e| panic!("{label}: reader {}: {e}", i + 1));
        ms
    });
    let wall_s = t.elapsed().as_secs_f64();
    rustix::fs::sync();
    std::thread::sleep(Duration::from_millis(500));
    let after = snap(node, sbs);
    let mut rest_ms = rest;
    rest_ms.sort_by(f64::total_cmp);
    Pass {
        label: label.to_owned(),
        before,
        after,
        first_ms,
        rest_ms,
        wall_s,
    }
}

fn build_data_layer(node: &LocalNode, name: &str, file: &str, bytes: &[u8]) {
    let tree = node.dir.path().join("tree");
    let path = tree.join(file.trim_start_matches('/'));
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir the data tree");
    std::fs::write(&path, bytes).expect("write the data file");
    node.ok(&["layer", "build", &tree.to_string_lossy(), "--name", name]);
    std::fs::remove_dir_all(&tree).expect("remove the data tree");
}

fn share(node: &LocalNode, cfg: &Cfg) {
    let size = cfg.file_bytes;
    let mut bytes = vec![0u8; size as usize];
    bench::fill_pseudo_random(&mut bytes, 16);
    build_data_layer(node, COLD, COLD_FILE, &bytes);
    bench::fill_pseudo_random(&mut bytes, 17);
    build_data_layer(node, WARM, WARM_FILE, &bytes);
    let warm = node.json(&["warm", WARM]);
    let warm = warm.get(0).unwrap_or(&warm);
    println!(
        "`strata warm {WARM}`: {:.1} MB fetched in {:.2} s, all in level 2: {}, passthrough at its next mount: {}{}",
        warm["fetched"].as_f64().unwrap_or(0.0) / 1e6,
        warm["seconds"].as_f64().unwrap_or(0.0),
        warm["local"],
        warm["passthrough_next"],
        warm["no_passthrough_because"]
            .as_str()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    let n = cfg.readers;
    let t = Instant::now();
    let created = parallel(n, CREATE_THREADS, |i| {
        let id = format!("share{i:04}");
        let (r, _) = try_strata(
            node,
            &[
                "sandbox", "create", "--layer", BASE, "--layer", COLD, "--layer", WARM, "--id", &id,
            ],
        );
        r.unwrap_or_else(|e| panic!("create {id}: {e}"));
        id
    });
    println!(
        "{n} sandboxes of {BASE} + {COLD} + {WARM} created in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let sbs: Vec<Sb> = created.iter().map(|id| inspect(node, id)).collect();
    let mut passes = vec![
        read_pass(node, &sbs, "/dev/null", "control (reads /dev/null)", 0),
        read_pass(node, &sbs, COLD_FILE, "lazy, caches cold", size),
        read_pass(node, &sbs, COLD_FILE, "lazy, level 1 warm", size),
        read_pass(node, &sbs, WARM_FILE, "lazy, passthrough", size),
    ];
    // The eager baseline: a copy of the same bytes per sandbox, in its upper on local disk.
    let fs = bench::fs_type(&sbs[0].upper).unwrap_or_else(|| "?".into());
    let t = Instant::now();
    for s in &sbs {
        let dir = s.rootfs.join(COPY_DIR);
        std::fs::create_dir_all(&dir).expect("mkdir in the sandbox's root");
        std::fs::write(s.rootfs.join(COPY_FILE.trim_start_matches('/')), &bytes)
            .expect("write the sandbox's copy");
    }
    rustix::fs::sync();
    println!(
        "eager copies: {n} × {:.0} MB written into the uppers ({fs}) in {:.1} s (synced)",
        size as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    drop(bytes);
    passes.push(read_pass(
        node,
        &sbs,
        COPY_FILE,
        "eager (own copy each)",
        size,
    ));
    let cold_passthrough = passes[1].after.stats.passthrough.get(COLD).copied();
    let warm_passthrough = passes[3].after.stats.passthrough.get(WARM).copied();
    print_share(cfg, &passes, cold_passthrough, warm_passthrough);
    let t = Instant::now();
    parallel(n, CREATE_THREADS, |i| {
        node.ok(&["sandbox", "rm", &sbs[i].id]);
    });
    println!(
        "\n{n} sandboxes removed in {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

fn print_share(cfg: &Cfg, passes: &[Pass], cold_pt: Option<u64>, warm_pt: Option<u64>) {
    let size = cfg.file_bytes;
    let n = cfg.readers;
    println!();
    println!(
        "### Page cache: {n} sandboxes each read the same {:.0} MB file ({:.1} MiB)",
        size as f64 / 1e6,
        mib(size)
    );
    println!();
    println!(
        "Passthrough blobs of the mounted layers: {COLD} {}, {WARM} {}.",
        cold_pt.map_or("-".into(), |v| v.to_string()),
        warm_pt.map_or("-".into(), |v| v.to_string())
    );
    println!();
    let mut head = "| growth over the pass, MiB |".to_owned();
    let mut rule = "| --- |".to_owned();
    for p in passes {
        head += &format!(" {} |", p.label);
        rule += " --- |";
    }
    println!("{head}");
    println!("{rule}");
    let row = |name: &str, f: &dyn Fn(&Pass) -> String| {
        let mut r = format!("| {name} |");
        for p in passes {
            r += &format!(" {} |", f(p));
        }
        println!("{r}");
    };
    let machine = |p: &Pass| diff(mi(&p.before.mem, "Cached"), mi(&p.after.mem, "Cached"));
    let cg = |p: &Pass| diff(p.before.sandboxes.cache, p.after.sandboxes.cache);
    let own = |p: &Pass| diff(p.before.own.cache, p.after.own.cache);
    let cached = |p: &Pass| cg(p) + own(p);
    let store = |p: &Pass| diff(p.before.store_resident, p.after.store_resident);
    let l2 = |p: &Pass| diff(p.before.l2_resident, p.after.l2_resident);
    let anon = |p: &Pass| diff(p.before.daemon.anon, p.after.daemon.anon);
    row(
        "**page cache charged to the bench's cgroups** (sandboxes' + the bench's own)",
        &|p| format!("**{:.1}**", smib(cached(p))),
    );
    row(
        "— the sandboxes' memory cgroups (sum of total_cache)",
        &|p| format!("{:.1}", smib(cg(p))),
    );
    row(
        "— the bench's own cgroup (the daemon: store reads, level-2 writes; the clients)",
        &|p| format!("{:.1}", smib(own(p))),
    );
    row(
        "resident: the store's files (a local-directory store)",
        &|p| format!("{:.1}", smib(store(p))),
    );
    row("resident: level-2 cache files", &|p| {
        format!("{:.1}", smib(l2(p)))
    });
    row(
        "machine-wide Cached (/proc/meminfo; anything else running included)",
        &|p| format!("{:.1}", smib(machine(p))),
    );
    row("daemon RSS (anon / file)", &|p| {
        format!(
            "{:.1} ({:.1} / {:.1})",
            smib(diff(p.before.daemon.rss, p.after.daemon.rss)),
            smib(anon(p)),
            smib(diff(p.before.daemon.file, p.after.daemon.file))
        )
    });
    row("— daemon level-1 chunk cache bytes", &|p| {
        format!("{:.1}", smib(diff(p.before.stats.l1, p.after.stats.l1)))
    });
    row("level-2 cache bytes (on disk)", &|p| {
        format!("{:.1}", smib(diff(p.before.stats.l2, p.after.stats.l2)))
    });
    row("fetched from the store", &|p| {
        format!(
            "{:.1}",
            smib(diff(p.before.stats.fetched, p.after.stats.fetched))
        )
    });
    row("**charged page cache / one copy**", &|p| {
        format!("**{:.2}×**", cached(p) as f64 / size as f64)
    });
    let control = cached(&passes[0]);
    row("— less the control pass's, / one copy", &|p| {
        format!("{:.2}×", (cached(p) - control) as f64 / size as f64)
    });
    row("sandboxes' total_cache / one copy", &|p| {
        format!("{:.2}×", cg(p) as f64 / size as f64)
    });
    row(
        "all of it: charged page cache − the store's files + daemon anon growth, / one copy",
        &|p| {
            format!(
                "{:.2}×",
                (cached(p) - store(p) + anon(p)) as f64 / size as f64
            )
        },
    );
    row("first reader, ms", &|p| format!("{:.0}", p.first_ms));
    row("other readers, ms p50 / max", &|p| {
        format!(
            "{:.0} / {:.0}",
            pct(&p.rest_ms, 0.5),
            p.rest_ms.last().copied().unwrap_or(0.0)
        )
    });
    row("pass wall, s", &|p| format!("{:.1}", p.wall_s));
    if let Some(eager) = passes.last() {
        println!();
        for p in &passes[1..passes.len() - 1] {
            println!(
                "eager / {}: page cache {:.1}×, cgroups' total_cache {:.1}×",
                p.label,
                cached(eager) as f64 / cached(p).max(1) as f64,
                cg(eager) as f64 / cg(p).max(1) as f64
            );
        }
    }
    let _ = std::io::stdout().flush();
}

/// One step of the idle part.
struct Step {
    n: usize,
    created_s: f64,
    /// `strata sandbox create`, ms: p50, p99.
    create_ms: (f64, f64),
    failed: usize,
    first_error: Option<String>,
    daemon: ProcMem,
    l1: u64,
    mem: BTreeMap<String, u64>,
    init_rss: u64,
    init_pss: u64,
    sandboxes: Memcg,
    own: Memcg,
    mounts: usize,
}

/// Mounts of this node (under its directory).
fn mounts(node: &LocalNode) -> usize {
    let root = node.dir.path().to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo").map_or(0, |m| {
        m.lines()
            .filter(|l| l.split(' ').nth(4).is_some_and(|p| p.starts_with(&root)))
            .count()
    })
}

/// The node's sandboxes now: ids and init pids.
fn listed(node: &LocalNode) -> Vec<(String, Option<u32>)> {
    node.json(&["sandbox", "ls"])
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            Some((
                s["id"].as_str()?.to_owned(),
                s["pid"].as_u64().map(|p| p as u32),
            ))
        })
        .collect()
}

/// `cgroups`: the directory holding the sandboxes' memory cgroups (`<it>/<id>`).
fn measure_step(
    node: &LocalNode,
    cgroups: Option<&Path>,
    created_s: f64,
    results: &[Result<String, String>],
) -> Step {
    std::thread::sleep(Duration::from_secs(2));
    let stats = daemon_stats(node);
    let ls = listed(node);
    let inits: Vec<ProcMem> = ls.iter().filter_map(|(_, p)| p.map(proc_mem)).collect();
    let dirs: Vec<PathBuf> = cgroups
        .map(|c| ls.iter().map(|(id, _)| c.join(id)).collect())
        .unwrap_or_default();
    Step {
        n: ls.len(),
        created_s,
        create_ms: (0.0, 0.0),
        failed: results.iter().filter(|r| r.is_err()).count(),
        first_error: results.iter().find_map(|r| r.as_ref().err().cloned()),
        daemon: proc_mem(stats.pid),
        l1: stats.l1,
        mem: meminfo(),
        init_rss: inits.iter().map(|m| m.rss).sum(),
        init_pss: inits.iter().map(|m| m.pss).sum(),
        sandboxes: memcg_sum(dirs.iter().map(PathBuf::as_path)),
        own: own_memcg(),
        mounts: mounts(node),
    }
}

fn idle(node: &LocalNode, cfg: &Cfg) {
    let config = sandbox_runtime::ManagerConfig::new(
        node.dir.path().join("unused"),
        &node.dir.path().join("unused-run"),
    );
    let limit = config.max_sandboxes;
    let admission = config.admission;
    let mut cgroups: Option<PathBuf> = None;
    let mut steps: Vec<Step> = vec![measure_step(node, None, 0.0, &[])];
    let mut have = 0usize;
    for &target in cfg.steps.iter().filter(|&&s| s > 0) {
        let want = target.saturating_sub(have);
        let t = Instant::now();
        let timed = parallel(want, CREATE_THREADS, |i| {
            let id = format!("idle{:05}", have + i);
            let (r, ms) = try_strata(node, &["sandbox", "create", "--layer", BASE, "--id", &id]);
            (r.map(|_| id), ms)
        });
        let created_s = t.elapsed().as_secs_f64();
        let mut lat: Vec<f64> = timed.iter().map(|(_, ms)| *ms).collect();
        lat.sort_by(f64::total_cmp);
        let results: Vec<Result<String, String>> = timed.into_iter().map(|(r, _)| r).collect();
        have += want;
        if cgroups.is_none() {
            if let Some(Ok(id)) = results.iter().find(|r| r.is_ok()) {
                cgroups = inspect(node, id).memcg.parent().map(Path::to_owned);
            }
        }
        let mut s = measure_step(node, cgroups.as_deref(), created_s, &results);
        s.create_ms = (pct(&lat, 0.5), pct(&lat, 0.99));
        println!(
            "step {target}: {} sandboxes, {:.1} s, daemon RSS {:.1} MiB, MemAvailable {:.0} MiB",
            s.n,
            created_s,
            mib(s.daemon.rss),
            mib(mi(&s.mem, "MemAvailable"))
        );
        let _ = std::io::stdout().flush();
        let stop = s.failed > 0;
        steps.push(s);
        if stop {
            break;
        }
    }
    let base = &steps[0];
    println!();
    println!("### Idle sandboxes of {BASE}");
    println!();
    println!(
        "| sandboxes | created in (rate) | create ms p50 / p99 | failed | daemon RSS / PSS | daemon threads / fds | level 1 | inits' RSS / PSS | sandboxes' cgroups anon / cache / kernel | bench cgroup anon / cache / kernel | Percpu | MemAvailable | Slab unreclaimable | KernelStack + PageTables | mounts |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    let mut prev_n = 0;
    for s in &steps {
        println!(
            "| {} | {:.1} s ({:.1}/s) | {:.0} / {:.0} | {} | {:.1} / {:.1} | {} / {} | {:.1} | {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {} |",
            s.n,
            s.created_s,
            if s.created_s > 0.0 {
                s.n.saturating_sub(prev_n) as f64 / s.created_s
            } else {
                0.0
            },
            s.create_ms.0,
            s.create_ms.1,
            s.failed,
            mib(s.daemon.rss),
            mib(s.daemon.pss),
            s.daemon.threads,
            s.daemon.fds,
            mib(s.l1),
            mib(s.init_rss),
            mib(s.init_pss),
            mib(s.sandboxes.anon),
            mib(s.sandboxes.cache),
            mib(s.sandboxes.kmem),
            mib(s.own.anon),
            mib(s.own.cache),
            mib(s.own.kmem),
            mib(mi(&s.mem, "Percpu")),
            mib(mi(&s.mem, "MemAvailable")),
            mib(mi(&s.mem, "SUnreclaim")),
            mib(mi(&s.mem, "KernelStack") + mi(&s.mem, "PageTables")),
            s.mounts
        );
        prev_n = s.n;
    }
    println!("\n(MiB; the bench cgroup holds the bench, the daemon, the clients, runc before it joins the sandbox's cgroup.)");
    for s in &steps {
        if let Some(e) = &s.first_error {
            println!("\nat {} sandboxes: first refusal: {e}", s.n);
        }
    }
    let last = steps.last().expect("a step");
    let n = last.n.max(1) as f64;
    let per = |a: u64, b: u64| smib(diff(a, b)) / n;
    let daemon = per(base.daemon.rss, last.daemon.rss);
    let daemon_no_l1 = smib(diff(base.daemon.rss, last.daemon.rss) - diff(base.l1, last.l1)) / n;
    let avail = per(last.mem["MemAvailable"], base.mem["MemAvailable"]);
    let sb = |m: &Memcg| m.anon + m.kmem;
    let percpu = per(mi(&base.mem, "Percpu"), mi(&last.mem, "Percpu"));
    let charged = per(
        sb(&base.sandboxes) + sb(&base.own),
        sb(&last.sandboxes) + sb(&last.own),
    ) + percpu;
    println!();
    println!("| per idle sandbox (0 → {}) | MiB per sandbox |", last.n);
    println!("| --- | --- |");
    println!("| **daemon RSS growth** | **{daemon:.3}** |");
    println!("| — without its level-1 chunk cache growth | {daemon_no_l1:.3} |");
    println!(
        "| daemon threads / fds per sandbox | {:.2} / {:.2} |",
        diff(base.daemon.threads, last.daemon.threads) as f64 / n,
        diff(base.daemon.fds, last.daemon.fds) as f64 / n
    );
    println!(
        "| sandbox init (strata-init) RSS / PSS | {:.3} / {:.3} |",
        mib(last.init_rss) / n,
        mib(last.init_pss) / n
    );
    println!(
        "| the sandbox's memory cgroup: anon / page cache / kernel | {:.3} / {:.3} / {:.3} |",
        per(base.sandboxes.anon, last.sandboxes.anon),
        per(base.sandboxes.cache, last.sandboxes.cache),
        per(base.sandboxes.kmem, last.sandboxes.kmem)
    );
    println!(
        "| the bench's cgroup (daemon, runc, the node's mounts): anon / page cache / kernel | {:.3} / {:.3} / {:.3} |",
        per(base.own.anon, last.own.anon),
        per(base.own.cache, last.own.cache),
        per(base.own.kmem, last.own.kmem)
    );
    println!("| per-CPU allocations (Percpu: cgroups' counters) | {percpu:.3} |");
    println!("| **charged, not page cache: anon + kernel of both + Percpu** | **{charged:.3}** |");
    let m = |k: &str| per(mi(&base.mem, k), mi(&last.mem, k));
    let machine = m("AnonPages")
        + m("Shmem")
        + m("SUnreclaim")
        + m("KernelStack")
        + m("PageTables")
        + m("Percpu");
    println!(
        "| machine-wide (anything else running included): AnonPages / Shmem / SUnreclaim / KernelStack / PageTables / SReclaimable / Cached | {:.3} / {:.3} / {:.3} / {:.3} / {:.3} / {:.3} / {:.3} |",
        m("AnonPages"),
        m("Shmem"),
        m("SUnreclaim"),
        m("KernelStack"),
        m("PageTables"),
        m("SReclaimable"),
        m("Cached")
    );
    println!("| **machine-wide, not reclaimable: AnonPages + Shmem + SUnreclaim + KernelStack + PageTables + Percpu** | **{machine:.3}** |");
    println!("| machine-wide MemAvailable drop | {avail:.3} |");
    let avail0 = mi(&base.mem, "MemAvailable");
    let total = mi(&base.mem, "MemTotal");
    // The floor below which creates are refused: `Admission::min_available`, by default 5% of
    // MemTotal and at least 512 MiB (sandbox-runtime/src/admission.rs).
    let floor = admission
        .min_available
        .unwrap_or_else(|| (total / 20).max(512 << 20));
    let room = mib(avail0.saturating_sub(floor));
    let bound = |cost: f64| {
        if cost > 0.0 {
            (room / cost) as u64
        } else {
            u64::MAX
        }
    };
    let (b_charged, b_machine, b_avail) = (bound(charged), bound(machine), bound(avail));
    let b_min = b_charged.min(b_machine).min(b_avail);
    let show = |b: u64| {
        if b == u64::MAX {
            "∞ (no growth)".to_owned()
        } else {
            b.to_string()
        }
    };
    let (b_charged, b_machine, b_avail) = (show(b_charged), show(b_machine), show(b_avail));
    println!();
    println!(
        "Admission (ManagerConfig::new's defaults): a count, max_sandboxes = {limit}; memory \
         and CPU reserved by --memory / --cpus limits (× {} / × {}; these sandboxes set none and \
         reserve nothing); a create refused while MemAvailable < {:.0} MiB. MemTotal {:.1} GiB, \
         MemAvailable with none {:.1} GiB → the floor is reached after ~{b_charged} idle \
         sandboxes at {charged:.3} MiB charged to cgroups each, ~{b_machine} at {machine:.3} MiB \
         of machine-wide unreclaimable growth each, ~{b_avail} at the {avail:.3} MiB \
         MemAvailable drop each. Binds first: {}.",
        admission.mem_overcommit,
        admission.cpu_overcommit,
        mib(floor),
        mib(total) / 1024.0,
        mib(avail0) / 1024.0,
        if (limit as u64) <= b_min {
            format!("the count ({limit} ≤ {b_min})")
        } else {
            format!("the MemAvailable floor (~{b_min} < {limit})")
        }
    );
    let t = Instant::now();
    let ids: Vec<String> = listed(node).into_iter().map(|(id, _)| id).collect();
    let rm = parallel(ids.len(), CREATE_THREADS, |i| {
        try_strata(node, &["sandbox", "rm", &ids[i]]).0
    });
    let rm_s = t.elapsed().as_secs_f64();
    let after = measure_step(node, None, 0.0, &rm);
    let cgroups_left = cgroups
        .as_deref()
        .map_or(0, |c| ids.iter().filter(|id| c.join(id).exists()).count());
    println!(
        "\n{} removed in {rm_s:.1} s ({:.0}/s, {} failed). After (before the first): daemon RSS \
         {:.1} MiB ({:.1}), threads {} ({}), fds {} ({}), bench cgroup kernel {:.1} MiB ({:.1}), \
         Percpu {:.1} MiB ({:.1}), MemAvailable {:.0} MiB ({:.0}), mounts {} ({}), sandbox memory \
         cgroups left: {cgroups_left}.",
        ids.len(),
        ids.len() as f64 / rm_s,
        after.failed,
        mib(after.daemon.rss),
        mib(base.daemon.rss),
        after.daemon.threads,
        base.daemon.threads,
        after.daemon.fds,
        base.daemon.fds,
        mib(after.own.kmem),
        mib(base.own.kmem),
        mib(mi(&after.mem, "Percpu")),
        mib(mi(&base.mem, "Percpu")),
        mib(mi(&after.mem, "MemAvailable")),
        mib(avail0),
        after.mounts,
        base.mounts,
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    assert!(rustix::process::geteuid().is_root(), "density needs root");
    let cfg = Cfg::from_env();
    let t0 = Instant::now();
    // Dropped after the node (declared before it): the node's processes are gone by then.
    let own = OwnCgroup::enter();
    let mut node = LocalNode::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "strata-bench-density",
    );
    let base = debian_tree();
    node.ok(&["layer", "build", &base.to_string_lossy(), "--name", BASE]);
    node.start_daemon(&[]);
    let m = meminfo();
    println!(
        "density: strata {}, {} CPUs, MemTotal {:.1} GiB, MemAvailable {:.1} GiB, kernel {}, bench directory {} ({}), load average {}",
        node.bin.display(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        mib(mi(&m, "MemTotal")) / 1024.0,
        mib(mi(&m, "MemAvailable")) / 1024.0,
        std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        node.dir.path().display(),
        bench::fs_type(node.dir.path()).unwrap_or_else(|| "?".into()),
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
    );
    if cfg.share {
        share(&node, &cfg);
    }
    if cfg.idle {
        idle(&node, &cfg);
    }
    println!(
        "\ndensity: done in {:.0} s (own memory cgroup: {}; load average at the end: {})",
        t0.elapsed().as_secs_f64(),
        own.as_ref()
            .map_or("none".into(), |c| c.dir.display().to_string()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let t = Instant::now();
    drop(node);
    drop(own);
    println!("density: cleaned up in {:.1} s", t.elapsed().as_secs_f64());
}
