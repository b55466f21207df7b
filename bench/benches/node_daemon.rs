//! The node daemon under load: mount throughput through its API socket, a slow backend for
//! one layer while another is mounted, and the stall readers see when the daemon is killed
//! and restarted. A scenario harness (`harness = false`) that prints markdown tables.
//!
//! 1. **Mount throughput.** A [`Node`] started in-process (`Node::start` on a multi-thread
//!    tokio runtime, its socket served by `server::serve` on a task; run directory and cache
//!    in a temporary directory; the store a local directory under a [`FaultyBackend`] with no
//!    fault configured; the fd holder `strata-fd-holder` when found). Two small lazy layers
//!    (`erofs_builder::build_layer`, pushed with `Store::put_blob_file` + `push_manifest`)
//!    are registered (pinned: they stay mounted between user mounts) and mounted once; then
//!    `mount` of the two stacked (`[base/os:1, toolkit/tool:1]`, first lowest) with a fresh
//!    `--upper` per mount, followed by `umount`, in a loop, by 1, 8 and 64 client threads at
//!    once, each with its own [`Client`] connection and mountpoint, for `STRATA_NODE_DAEMON_SECS`
//!    seconds per client count (default 5; 1 without `--bench`). Reported: mounts per
//!    second (completed mount + umount pairs over the wall time) and the latency of each
//!    `mount` and `umount` request (p50/p99/max).
//! 2. **A slow backend for another layer.** The same node, its backend now answering every
//!    request after 200 ms. The stack above ("B", active) is mounted as in 1, alone, then
//!    while another thread mounts and unmounts fresh versions of layer A (`workspace/a:1..N`,
//!    built up front, never seen by the node: each mount fetches A's manifest, meta image
//!    and chunk table from the slow backend). B's mounts make no backend request; any wait
//!    they show is a wait behind A. Nothing is asserted on timing.
//! 3. **Restart stall.** The `strata` binary with its own `STRATA_HOME`/`STRATA_RUN_DIR`:
//!    `strata layer build`, `strata mount base/x:1 MNT --upper UP` (which starts the daemon),
//!    8 reader threads reading every file in a loop (comparing every byte, then
//!    `posix_fadvise(DONTNEED)` so the next read reaches the daemon again), the daemon
//!    `kill -9`ed `STRATA_NODE_DAEMON_KILLS` times (default 20) at random moments (50–300 ms
//!    apart) and started again at once with its own command line (`/proc/PID/cmdline`), then
//!    one `strata daemon --takeover`. Reported: read errors and wrong bytes (must be 0), the
//!    longest read, read latency p50/p99 (and in a quiet window before the first kill), the
//!    time from a restart to the new daemon answering `ping` (p50/max), the longest read
//!    overlapping each outage, and the takeover's time and stall.
//!
//! Scenario 1 runs again over S3 when `STRATA_TEST_S3_ENDPOINT` (or
//! `STRATA_BENCH_S3_ENDPOINT`) names an S3 server (moto on 127.0.0.1): a second node whose
//! store is `s3://strata-bench/node-daemon-…`.
//!
//! Binaries: `strata-fd-holder` and `strata` are looked up beside the bench executable's
//! directory (`target/release/`, after `cargo build --release -p strata -p ublk-daemon
//! --bins`), or taken from `STRATA_FD_HOLDER` / `STRATA_BIN`. Without the holder, scenarios
//! 1–2 run without one (said so); without `strata`, scenario 3 is skipped (said so).
//!
//! Needs root (mount(2), /dev/fuse); prints SKIPPED otherwise. Everything it started is
//! killed by pid (the daemon's `strata.pid`, the holder's answer to `ping`, `strata*`
//! processes naming the run directory) and every mount under its directory detached however
//! it ends (panic, SIGINT/SIGTERM/SIGHUP; not `kill -9` of the bench itself).
//! `cargo bench -p bench --bench node_daemon`.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use bench::{bench_tempdir, fill_pseudo_random, fs_type};
use fs_cache::chunk::disk::DiskCacheConfig;
use fs_cache::chunk::CacheConfig;
use fs_cache::{Backend, FaultConfig, FaultyBackend, LayerRef, Manifest, PosixBackend, Store};
use tokio::runtime::Runtime;
use ublk_daemon::node::client::Client;
use ublk_daemon::node::proto::{MountInfo, Pong, Request, Status};
use ublk_daemon::node::{server, sys, Node, NodeConfig};

const CLIENTS: [usize; 3] = [1, 8, 64];
const SLOW_LATENCY: Duration = Duration::from_millis(200);
const READERS: usize = 8;
const S3_BUCKET: &str = "strata-bench";

// ---------------------------------------------------------------------------------------
// Cleanup, however the bench ends.

/// Run directories (with the bench directory they live in) to clean up on a signal.
static REGISTERED: Mutex<Vec<(PathBuf, PathBuf)>> = Mutex::new(Vec::new());
/// The bench directory, removed on a signal.
static ROOT: Mutex<Option<PathBuf>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Kill, by pid, every process of `run_dir` (never this one): the daemon named by its
/// `strata.pid`, the fd holder (it answers `ping` with its pid), and any `strata*` process
/// whose command line names the run directory; then detach every mount under `root` or made
/// from `run_dir`, newest first, lazily.
fn clean_up(run_dir: &Path, root: &Path) {
    for pid in run_dir_pids(run_dir) {
        // SAFETY: plain kill(2) of a process of this run directory.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    std::thread::sleep(Duration::from_millis(100));
    for _ in 0..5 {
        let mine: Vec<PathBuf> = sys::mounts()
            .unwrap_or_default()
            .into_iter()
            .rev()
            .filter(|m| m.mount_point.starts_with(root) || sys::is_ours(m, run_dir))
            .map(|m| m.mount_point)
            .collect();
        if mine.is_empty() {
            break;
        }
        for mp in mine {
            detach(&mp);
        }
    }
}

/// The pids of `run_dir`'s daemon and fd holder (see [`clean_up`]). Looked up on a helper
/// thread, at most 5 s: reading another process's `/proc/PID/cmdline` blocks while that
/// process is stuck in a page fault (on a FUSE mount whose daemon is gone, say), so only
/// processes named `strata*` are read at all, and a lookup that hangs is abandoned.
fn run_dir_pids(run_dir: &Path) -> Vec<i32> {
    let me = std::process::id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    let run_dir = run_dir.to_owned();
    std::thread::spawn(move || {
        let mut pids = Vec::new();
        pids.extend(daemon_pid(&run_dir));
        if let Ok(h) = ublk_daemon::holder::HolderClient::connect(&run_dir) {
            pids.extend(h.ping().ok().map(|p| p as i32));
        }
        let needle = run_dir.as_os_str().as_bytes();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            if !comm.starts_with("strata") {
                continue;
            }
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if cmdline.windows(needle.len()).any(|w| w == needle) {
                pids.push(pid);
            }
        }
        let _ = tx.send(pids);
    });
    let mut pids = rx.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|_| {
        eprintln!("node_daemon: looking up the processes of a run directory hangs; skipped");
        Vec::new()
    });
    pids.retain(|p| *p != me && *p > 1);
    pids.sort_unstable();
    pids.dedup();
    pids
}

fn detach(mp: &Path) {
    if let Ok(c) = std::ffi::CString::new(mp.as_os_str().as_bytes()) {
        // SAFETY: `c` is a valid NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Cleans up one run directory when dropped (also while unwinding from a panic): kills the
/// children it holds and whatever names the run directory, detaches the mounts.
struct Guard {
    run_dir: PathBuf,
    root: PathBuf,
    children: Arc<Mutex<Vec<Child>>>,
}

impl Guard {
    fn new(run_dir: &Path, root: &Path) -> Guard {
        lock(&REGISTERED).push((run_dir.to_owned(), root.to_owned()));
        Guard {
            run_dir: run_dir.to_owned(),
            root: root.to_owned(),
            children: Arc::default(),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for mut c in lock(&self.children).drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        clean_up(&self.run_dir, &self.root);
        lock(&REGISTERED).retain(|(r, _)| r != &self.run_dir);
    }
}

/// Set on a signal: every loop of the bench stops.
static STOPPING: AtomicBool = AtomicBool::new(false);

fn stopping() -> bool {
    STOPPING.load(Ordering::Relaxed)
}

/// After a signal, wait here for the cleaning thread to end the process: start nothing new.
fn halt_if_stopping() {
    while stopping() {
        std::thread::park();
    }
}

/// The write end of the pipe that [`on_signal`] writes the signal number to.
static SIGNAL_PIPE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let b = sig as u8;
    // SAFETY: write(2) is async-signal-safe; `b` outlives the call.
    unsafe {
        libc::write(
            SIGNAL_PIPE.load(Ordering::Relaxed),
            (&b as *const u8).cast(),
            1,
        )
    };
}

/// On SIGINT, SIGTERM or SIGHUP, one thread cleans up every registered run directory and
/// exits. A handler that writes to a pipe, not a blocked signal mask: children inherit the
/// mask (`std::process::Command` keeps it), and the daemons must see their SIGTERM.
fn catch_signals() {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        eprintln!(
            "node_daemon: no pipe for signals: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    SIGNAL_PIPE.store(fds[1], Ordering::Relaxed);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `sigaction` is plain old data; all-zero bytes are a valid value (empty mask,
        // no flags); the handler only calls write(2).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    let read_end = fds[0];
    std::thread::spawn(move || {
        let mut b = 0u8;
        // SAFETY: `read_end` is the pipe's read end; `b` is a valid one-byte buffer.
        let n = unsafe { libc::read(read_end, (&mut b as *mut u8).cast(), 1) };
        if n != 1 {
            return;
        }
        let sig = i32::from(b);
        eprintln!(
            "\nnode_daemon: signal {sig}: killing what the bench started and detaching its mounts"
        );
        // Held until the exit: no scenario starts (`Guard::new` waits for it).
        let registered = lock(&REGISTERED);
        STOPPING.store(true, Ordering::Relaxed);
        // Let the loops see it and their requests in flight end.
        std::thread::sleep(Duration::from_millis(500));
        for (run_dir, root) in registered.iter() {
            clean_up(run_dir, root);
        }
        let roots = registered.iter().map(|(_, r)| r.clone());
        for root in roots.chain(lock(&ROOT).clone()) {
            let root = &root;
            for _ in 0..3 {
                if std::fs::remove_dir_all(root).is_ok() || !root.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        std::process::exit(128 + sig);
    });
}

// ---------------------------------------------------------------------------------------
// Small helpers.

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `q` quantile (0..=1) of `v` (sorted here), nearest rank; 0 for no samples.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// `name` from the environment variable `env`, else beside the bench executable's directory
/// (`target/release/deps/node_daemon-…` → `target/release/name`).
fn find_binary(env: &str, name: &str) -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(env) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("{env}={} is not a file", p.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("find the bench executable: {e}"))?;
    let p = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(name))
        .ok_or("the bench executable has no grandparent directory")?;
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!("no {} (and {env} is not set)", p.display()))
    }
}

fn describe_binary(p: &Path) -> String {
    let age = std::fs::metadata(p)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .map(|d| format!(", built {:.0} min ago", d.as_secs_f64() / 60.0))
        .unwrap_or_default();
    format!("{}{age}", p.display())
}

/// A tree of `files` files of pseudo-random bytes (`min..=max` bytes each) under `dir`, in a
/// few subdirectories; returns (relative path, contents).
fn make_tree(
    dir: &Path,
    seed: u64,
    files: usize,
    min: usize,
    max: usize,
) -> Vec<(PathBuf, Vec<u8>)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = Vec::with_capacity(files);
    for i in 0..files {
        let rel = PathBuf::from(format!("d{}/f{i:04}", i % 5));
        let mut data = vec![0u8; rng.usize(min..=max)];
        fill_pseudo_random(
            &mut data,
            seed.wrapping_mul(1_000_003).wrapping_add(i as u64),
        );
        let path = dir.join(&rel);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("create a source dir");
        std::fs::write(&path, &data).expect("write a source file");
        out.push((rel, data));
    }
    out
}

/// Build a lazy layer from `src` and push its meta image, blob and manifest as `name`.
fn push_layer(rt: &Runtime, store: &Store, src: &Path, name: &str, work: &Path) -> Manifest {
    let stem = name.replace(['/', ':'], "_");
    let (meta, blob) = (
        work.join(format!("{stem}.meta")),
        work.join(format!("{stem}.blob")),
    );
    erofs_builder::build_layer(src, &meta, &blob, &erofs_builder::LayerOptions::default())
        .unwrap_or_else(|e| panic!("build layer {name}: {e}"));
    rt.block_on(async {
        let meta_put = store
            .put_blob_file(&meta)
            .await
            .expect("put the meta image");
        let data_put = store.put_blob_file(&blob).await.expect("put the data blob");
        let r: LayerRef = name.parse().expect("a layer reference");
        let m = Manifest::new(
            r,
            Some(meta_put.blob_ref()),
            vec![data_put.blob_ref()],
            format!("dir:{}", src.display()),
        );
        store.push_manifest(&m).await.expect("push the manifest");
        let _ = std::fs::remove_file(&meta);
        let _ = std::fs::remove_file(&blob);
        m
    })
}

// ---------------------------------------------------------------------------------------
// Scenarios 1 and 2: an in-process node.

struct InProcess {
    node: Arc<Node>,
    server: tokio::task::JoinHandle<()>,
    sock: PathBuf,
}

fn start_node(
    rt: &Runtime,
    run_dir: &Path,
    cache_dir: &Path,
    store_url: &str,
    store: Store,
    holder: Option<&Path>,
) -> InProcess {
    std::fs::create_dir_all(cache_dir).expect("create the cache directory");
    let cache = CacheConfig {
        memory_bytes: 64 << 20,
        disk: Some(DiskCacheConfig {
            dir: cache_dir.to_owned(),
            capacity: 1 << 30,
        }),
        ..CacheConfig::default()
    };
    let mut config = NodeConfig::new(run_dir.to_owned(), store_url.to_owned(), cache);
    if let Some(h) = holder {
        config.holder_command = vec![h.as_os_str().to_owned()];
    }
    rt.block_on(async {
        let node = Node::start(config, store)
            .await
            .unwrap_or_else(|e| panic!("start the node on {}: {e}", run_dir.display()));
        let sock = node.socket_path();
        let listener = server::bind(&sock).expect("bind the API socket");
        let server = tokio::spawn(server::serve(node.clone(), listener));
        InProcess { node, server, sock }
    })
}

impl InProcess {
    fn stop(self, rt: &Runtime) {
        self.server.abort();
        if let Err(e) = rt.block_on(self.node.shutdown()) {
            eprintln!("node shutdown: {e}");
        }
    }
}

/// One client count's run of mount + umount loops.
#[derive(Default)]
struct Level {
    clients: usize,
    mounts: usize,
    secs: f64,
    mount_ms: Vec<f64>,
    umount_ms: Vec<f64>,
    errors: usize,
    first_error: Option<String>,
}

impl Level {
    fn rate(&self) -> f64 {
        self.mounts as f64 / self.secs
    }
}

/// `clients` threads, each with its own connection and mountpoint, mount `layers` with a
/// fresh upper and unmount again until `secs` have passed.
fn run_level(
    sock: &Path,
    layers: &[String],
    dir: &Path,
    tag: &str,
    clients: usize,
    secs: f64,
) -> Level {
    let barrier = Arc::new(Barrier::new(clients + 1));
    let mut threads = Vec::with_capacity(clients);
    for i in 0..clients {
        let (barrier, sock, layers) = (barrier.clone(), sock.to_owned(), layers.to_vec());
        let mp = dir.join("mnt").join(format!("{tag}-c{clients}-{i}"));
        let uppers = dir.join("up").join(format!("{tag}-c{clients}-{i}"));
        threads.push(std::thread::spawn(move || {
            std::fs::create_dir_all(&mp).expect("create a mountpoint");
            std::fs::create_dir_all(&uppers).expect("create the uppers' directory");
            let mut c = Client::connect(&sock).expect("connect to the node");
            let mut l = Level::default();
            barrier.wait();
            let deadline = Instant::now() + Duration::from_secs_f64(secs);
            let mut k = 0;
            while Instant::now() < deadline && !stopping() {
                let upper = uppers.join(format!("u{k}"));
                k += 1;
                let t = Instant::now();
                let r: Result<MountInfo, _> = c.call(Request::Mount {
                    layers: layers.clone(),
                    mountpoint: mp.clone(),
                    upper: Some(upper),
                    work: None,
                });
                l.mount_ms.push(ms(t.elapsed()));
                if let Err(e) = r {
                    l.errors += 1;
                    l.first_error.get_or_insert_with(|| format!("mount: {e}"));
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                let t = Instant::now();
                let r: Result<MountInfo, _> = c.call(Request::Umount {
                    mountpoint: mp.clone(),
                });
                l.umount_ms.push(ms(t.elapsed()));
                match r {
                    Ok(_) => l.mounts += 1,
                    Err(e) => {
                        l.errors += 1;
                        l.first_error.get_or_insert_with(|| format!("umount: {e}"));
                        detach(&mp);
                    }
                }
            }
            l
        }));
    }
    barrier.wait();
    let start = Instant::now();
    let mut total = Level {
        clients,
        ..Level::default()
    };
    for t in threads {
        let l = t.join().expect("a client thread panicked");
        total.mounts += l.mounts;
        total.mount_ms.extend(l.mount_ms);
        total.umount_ms.extend(l.umount_ms);
        total.errors += l.errors;
        if total.first_error.is_none() {
            total.first_error = l.first_error;
        }
    }
    total.secs = start.elapsed().as_secs_f64();
    total
}

fn print_levels(title: &str, levels: &mut [Level]) {
    println!();
    println!("{title}");
    println!();
    println!("| clients | mount+umount pairs | mounts/s | mount p50 | mount p99 | mount max | umount p50 | umount p99 | errors |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for l in levels.iter_mut() {
        let rate = l.rate();
        let max = l.mount_ms.iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {} | {rate:.0} | {:.1} ms | {:.1} ms | {max:.1} ms | {:.1} ms | {:.1} ms | {} |",
            l.clients,
            l.mounts,
            quantile(&mut l.mount_ms, 0.5),
            quantile(&mut l.mount_ms, 0.99),
            quantile(&mut l.umount_ms, 0.5),
            quantile(&mut l.umount_ms, 0.99),
            l.errors
        );
    }
    for l in levels.iter() {
        if let Some(e) = &l.first_error {
            println!("  {} clients, first error: {e}", l.clients);
        }
    }
}

/// One request on a new connection; panics if it fails.
fn call(sock: &Path, r: Request) -> serde_json::Value {
    let what = format!("{r:?}");
    Client::connect(sock)
        .expect("connect to the node")
        .call(r)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Register (pin) `layers` and mount their stack once with an upper (then unmount): the
/// layers are active from then on. Returns the time of each registration and of that mount.
fn activate(sock: &Path, layers: &[String], dir: &Path) -> (Vec<f64>, f64) {
    let mut reg = Vec::new();
    for l in layers {
        let t = Instant::now();
        call(sock, Request::Register { layer: l.clone() });
        reg.push(ms(t.elapsed()));
    }
    let mp = dir.join("mnt").join("first");
    std::fs::create_dir_all(&mp).expect("create a mountpoint");
    let t = Instant::now();
    call(
        sock,
        Request::Mount {
            layers: layers.to_vec(),
            mountpoint: mp.clone(),
            upper: Some(dir.join("up").join("first")),
            work: None,
        },
    );
    let first = ms(t.elapsed());
    call(sock, Request::Umount { mountpoint: mp });
    (reg, first)
}

struct Params {
    secs: f64,
    a_versions: usize,
    kills: usize,
    /// `STRATA_NODE_DAEMON_SCENARIOS`: which to run (`1,2,s3,3`; 1 and 2 run together).
    scenarios: Vec<String>,
}

impl Params {
    fn run(&self, scenario: &str) -> bool {
        self.scenarios.iter().any(|s| s == scenario)
    }
}

/// The two small layers of scenario 1: pushed to `store`, their references.
fn push_stack(rt: &Runtime, store: &Store, root: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for (i, (name, files)) in [("base/os:1", 200), ("toolkit/tool:1", 60)]
        .into_iter()
        .enumerate()
    {
        let src = root.join(format!("src-{i}"));
        if !src.exists() {
            make_tree(&src, 100 + i as u64, files, 1 << 10, 64 << 10);
        }
        push_layer(rt, store, &src, name, root);
        names.push(name.to_owned());
    }
    names
}

fn node_scenarios(rt: &Runtime, root: &Path, p: &Params, holder: Option<&Path>) {
    let run_dir = root.join("run");
    let _guard = Guard::new(&run_dir, root);
    let posix: Arc<dyn Backend> =
        Arc::new(PosixBackend::open(root.join("store")).expect("open the store directory"));
    let faulty = Arc::new(FaultyBackend::new(posix, 42));
    let store = Store::new(faulty.clone());
    let t = Instant::now();
    let stack = push_stack(rt, &store, root);
    // Layer A's versions: each its own content, so each is a new layer to the node.
    let a_names: Vec<String> = (1..=p.a_versions)
        .map(|v| {
            let src = root.join(format!("src-a{v}"));
            make_tree(&src, 1000 + v as u64, 20, 512, 16 << 10);
            let name = format!("workspace/a:{v}");
            push_layer(rt, &store, &src, &name, root);
            name
        })
        .collect();
    println!(
        "built and pushed {} layers in {:.1} s",
        2 + a_names.len(),
        t.elapsed().as_secs_f64()
    );

    let node = start_node(
        rt,
        &run_dir,
        &root.join("cache"),
        &root.join("store").display().to_string(),
        store,
        holder,
    );
    let (reg, first) = activate(&node.sock, &stack, root);
    println!(
        "register {}: {:.1} ms, {}: {:.1} ms; first mount of the stack (layers active, upper new): {first:.1} ms",
        stack[0], reg[0], stack[1], reg[1]
    );

    // 1. Mount throughput, backend without faults.
    let mut levels: Vec<Level> = CLIENTS
        .iter()
        .map(|&c| run_level(&node.sock, &stack, root, "fast", c, p.secs))
        .collect();
    print_levels(
        &format!(
            "### 1. `mount [{}, {}] --upper NEW` + `umount`, layers active, local directory store ({} s per row)",
            stack[0], stack[1], p.secs
        ),
        &mut levels,
    );

    // 2. The backend answers every request after 200 ms.
    faulty.set(FaultConfig {
        latency: SLOW_LATENCY,
        ..FaultConfig::default()
    });
    faulty.reset_stats();
    let mut alone: Vec<Level> = CLIENTS
        .iter()
        .map(|&c| run_level(&node.sock, &stack, root, "alone", c, p.secs))
        .collect();
    let alone_requests = faulty.stats();

    faulty.reset_stats();
    let stop = Arc::new(AtomicBool::new(false));
    let a_thread = {
        let (stop, sock, names) = (stop.clone(), node.sock.clone(), a_names.clone());
        let mp = root.join("mnt").join("a");
        std::fs::create_dir_all(&mp).expect("create A's mountpoint");
        std::thread::spawn(move || {
            let mut c = Client::connect(&sock).expect("connect to the node");
            let (mut mount_ms, mut errors, mut first_error, mut i) = (Vec::new(), 0, None, 0);
            while !stop.load(Ordering::Relaxed) && !stopping() {
                let layer = names[i % names.len()].clone();
                i += 1;
                let t = Instant::now();
                let r: Result<MountInfo, _> = c.call(Request::Mount {
                    layers: vec![layer],
                    mountpoint: mp.clone(),
                    upper: None,
                    work: None,
                });
                mount_ms.push(ms(t.elapsed()));
                let r = r.and_then(|_| {
                    c.call::<MountInfo>(Request::Umount {
                        mountpoint: mp.clone(),
                    })
                });
                if let Err(e) = r {
                    errors += 1;
                    first_error.get_or_insert_with(|| e.to_string());
                    detach(&mp);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            (mount_ms, errors, first_error, i)
        })
    };
    // Let A's first mount start before B's clock does.
    std::thread::sleep(Duration::from_millis(100));
    let mut with: Vec<Level> = CLIENTS
        .iter()
        .map(|&c| run_level(&node.sock, &stack, root, "with-a", c, p.secs))
        .collect();
    stop.store(true, Ordering::Relaxed);
    let (mut a_ms, a_errors, a_error, a_mounts) = a_thread.join().expect("A's thread panicked");
    let a_requests = faulty.stats();
    faulty.set(FaultConfig::default());

    println!();
    println!(
        "### 2. B = the same stack, backend {} ms per request; A = first mounts of new layer versions meanwhile ({} s per row)",
        SLOW_LATENCY.as_millis(),
        p.secs
    );
    println!();
    println!("| clients | B alone: mounts/s | p50 | p99 | max | B while A mounts: mounts/s | p50 | p99 | max | errors (alone / with A) |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (a, w) in alone.iter_mut().zip(with.iter_mut()) {
        let (ra, rw) = (a.rate(), w.rate());
        let amax = a.mount_ms.iter().copied().fold(0.0, f64::max);
        let wmax = w.mount_ms.iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {ra:.0} | {:.1} ms | {:.1} ms | {amax:.1} ms | {rw:.0} | {:.1} ms | {:.1} ms | {wmax:.1} ms | {} / {} |",
            a.clients,
            quantile(&mut a.mount_ms, 0.5),
            quantile(&mut a.mount_ms, 0.99),
            quantile(&mut w.mount_ms, 0.5),
            quantile(&mut w.mount_ms, 0.99),
            a.errors,
            w.errors
        );
    }
    for l in alone.iter().chain(&with) {
        if let Some(e) = &l.first_error {
            println!("  B, {} clients, first error: {e}", l.clients);
        }
    }
    let reqs = |s: fs_cache::backend::FaultStats| s.gets + s.heads + s.lists + s.puts + s.deletes;
    println!();
    println!(
        "A: {a_mounts} first mounts of {} versions{} while B ran; A mount p50 {:.0} ms, max {:.0} ms; {} errors{}",
        a_names.len(),
        if a_mounts > a_names.len() {
            " (versions reused after the first round: the node had dropped them, so they were fetched again)"
        } else {
            ""
        },
        quantile(&mut a_ms, 0.5),
        a_ms.iter().copied().fold(0.0, f64::max),
        a_errors,
        a_error.map(|e| format!(" (first: {e})")).unwrap_or_default()
    );
    println!(
        "backend requests: {} while B ran alone; {} while A ran ({:.1} per A mount)",
        reqs(alone_requests),
        reqs(a_requests),
        reqs(a_requests) as f64 / a_mounts.max(1) as f64
    );
    node.stop(rt);
}

/// Scenario 1 over S3: a second node whose store is a prefix of a bucket on `endpoint`.
fn s3_scenario(rt: &Runtime, root: &Path, p: &Params, holder: Option<&Path>, endpoint: &str) {
    if let Err(e) = bench::create_bucket(endpoint, S3_BUCKET) {
        println!("\n*** S3 scenario FAILED to start: {e} ***");
        return;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let url = format!(
        "s3://{S3_BUCKET}/node-daemon-{}-{nanos}?endpoint={endpoint}&region=us-east-1",
        std::process::id()
    );
    let backend = rt
        .block_on(fs_cache::open_backend(&url))
        .unwrap_or_else(|e| panic!("open {url}: {e}"));
    let store = Store::new(backend);
    let run_dir = root.join("run-s3");
    let _guard = Guard::new(&run_dir, root);
    let stack = push_stack(rt, &store, root);
    let node = start_node(rt, &run_dir, &root.join("cache-s3"), &url, store, holder);
    let (reg, first) = activate(&node.sock, &stack, root);
    println!();
    println!(
        "S3 ({endpoint}): register {}: {:.1} ms, {}: {:.1} ms (meta image and chunk table fetched); first mount of the stack: {first:.1} ms",
        stack[0], reg[0], stack[1], reg[1]
    );
    let mut levels: Vec<Level> = CLIENTS
        .iter()
        .map(|&c| run_level(&node.sock, &stack, root, "s3", c, p.secs))
        .collect();
    print_levels(
        &format!(
            "### 1 over S3. `mount [{}, {}] --upper NEW` + `umount`, layers active, store on {endpoint} ({} s per row)",
            stack[0], stack[1], p.secs
        ),
        &mut levels,
    );
    node.stop(rt);
}

// ---------------------------------------------------------------------------------------
// Scenario 3: kill -9 and takeover of the `strata` daemon under readers.

fn daemon_pid(run_dir: &Path) -> Option<i32> {
    std::fs::read_to_string(run_dir.join("strata.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether `pid` still exists as more than a zombie. A killed multi-threaded process shows
/// its leader as a zombie while its other threads are still exiting (its files, and so the
/// run directory's lock, are let go only once the last one is gone); our own children are
/// reaped by `wait` before this is asked, others by init.
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // `pid (comm) S …`: the state follows the last ')'.
    let zombie = matches!(
        stat.rsplit_once(')')
            .and_then(|(_, s)| s.trim().chars().next()),
        Some('Z' | 'X') | None
    );
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    !zombie || threads > 1
}

fn cmdline(pid: i32) -> Vec<std::ffi::OsString> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).expect("read the daemon's cmdline");
    raw.split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| std::ffi::OsStr::from_bytes(a).to_owned())
        .collect()
}

/// Wait until the daemon with `pid` answers `ping` on `sock`; panics (with its log) after 60 s.
fn wait_answering(sock: &Path, pid: u32, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(mut c) = Client::connect(sock) {
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            if let Ok(p) = c.call::<Pong>(Request::Ping) {
                if p.pid == pid {
                    return;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "the daemon (pid {pid}) did not answer within 60 s; its log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One read: start and duration, µs since the scenario's start.
#[derive(Clone, Copy)]
struct ReadRec {
    start: u64,
    dur: u64,
}

struct ReaderOut {
    reads: Vec<ReadRec>,
    errors: u64,
    wrong: u64,
}

fn restart_scenario(strata: &Path, root: &Path, p: &Params) {
    let dir = root.join("restart");
    let (home, store, run_dir, mp, upper) = (
        dir.join("home"),
        dir.join("store"),
        dir.join("run"),
        dir.join("mnt"),
        dir.join("upper"),
    );
    std::fs::create_dir_all(&mp).expect("create the mountpoint");
    let guard = Guard::new(&run_dir, root);
    let strata_cmd = || {
        let mut c = Command::new(strata);
        c.env("STRATA_HOME", &home)
            .env("STRATA_RUN_DIR", &run_dir)
            .arg("--store")
            .arg(&store);
        c
    };
    let run_ok = |mut c: Command| {
        let out = c.output().expect("run strata");
        assert!(
            out.status.success(),
            "{c:?} failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    };
    let src = dir.join("src");
    let files = Arc::new(make_tree(&src, 7, 64, 4 << 10, 1 << 20));
    let bytes: usize = files.iter().map(|(_, d)| d.len()).sum();
    let mut c = strata_cmd();
    c.args(["layer", "build", "--quiet"])
        .arg(&src)
        .args(["--name", "base/x:1"]);
    run_ok(c);
    let mut c = strata_cmd();
    c.args(["mount", "base/x:1"])
        .arg(&mp)
        .arg("--upper")
        .arg(&upper);
    run_ok(c);
    let sock = ublk_daemon::node::socket_path(&run_dir);

    let t0 = Instant::now();
    let since = |t: Instant| t.duration_since(t0).as_micros() as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let (files, stop, mp) = (files.clone(), stop.clone(), mp.clone());
            std::thread::spawn(move || {
                let mut out = ReaderOut {
                    reads: Vec::new(),
                    errors: 0,
                    wrong: 0,
                };
                let mut i = r * 7;
                while !stop.load(Ordering::Relaxed) && !stopping() {
                    let (rel, want) = &files[i % files.len()];
                    i += 1;
                    let started = Instant::now();
                    let got = std::fs::File::open(mp.join(rel)).and_then(|mut f| {
                        let mut v = Vec::with_capacity(want.len());
                        f.read_to_end(&mut v)?;
                        // Drop the pages: the next read of this file reaches the daemon.
                        // SAFETY: `f` is an open file for the duration of the call.
                        unsafe {
                            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
                        };
                        Ok(v)
                    });
                    out.reads.push(ReadRec {
                        start: started.duration_since(t0).as_micros() as u64,
                        dur: started.elapsed().as_micros() as u64,
                    });
                    match got {
                        Ok(v) if v == *want => {}
                        Ok(_) => {
                            out.wrong += 1;
                            eprintln!("WRONG BYTES in {}", rel.display());
                        }
                        Err(e) => {
                            out.errors += 1;
                            eprintln!("READ ERROR {}: {e}", rel.display());
                        }
                    }
                }
                out
            })
        })
        .collect();

    // A quiet window first: read latency without kills.
    std::thread::sleep(Duration::from_secs(2));
    let quiet_end = since(Instant::now());

    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut pid = daemon_pid(&run_dir).expect("the daemon started by `strata mount` runs");
    let args = cmdline(pid);
    // The daemon we started last (the first was started by `strata mount`, and is not our
    // child): reaped after each kill, or its zombie looks alive.
    let mut current: Option<Child> = None;
    let (mut restart_ms, mut outages) = (Vec::new(), Vec::new());
    for k in 0..p.kills {
        std::thread::sleep(Duration::from_millis(50 + rng.u64(0..250)));
        if stopping() {
            break;
        }
        let killed = Instant::now();
        // SAFETY: plain kill(2) of the daemon's pid.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        if let Some(mut c) = current.take() {
            let _ = c.wait();
        }
        while alive(pid) {
            std::thread::sleep(Duration::from_millis(1));
        }
        halt_if_stopping();
        let log_path = dir.join(format!("daemon{k}.log"));
        let log = std::fs::File::create(&log_path).expect("create a daemon log");
        let started = Instant::now();
        let child = Command::new(&args[0])
            .args(&args[1..])
            .env("STRATA_HOME", &home)
            .env("STRATA_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup the log"))
            .stderr(log)
            .spawn()
            .expect("restart the daemon");
        let new = child.id();
        current = Some(child);
        wait_answering(&sock, new, &log_path);
        restart_ms.push(ms(started.elapsed()));
        outages.push((since(killed), since(Instant::now())));
        pid = new as i32;
    }
    // A planned upgrade, once the last restart's stalled reads are done.
    std::thread::sleep(Duration::from_secs(1));
    halt_if_stopping();
    let log_path = dir.join("takeover.log");
    let log = std::fs::File::create(&log_path).expect("create the takeover log");
    let t = Instant::now();
    let mut up = strata_cmd();
    up.args(["daemon", "--takeover"])
        .env("STRATA_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup the log"))
        .stderr(log);
    let upgraded = up.spawn().expect("start strata daemon --takeover");
    let new = upgraded.id();
    lock(&guard.children).push(upgraded);
    wait_answering(&sock, new, &log_path);
    let takeover_ms = ms(t.elapsed());
    let takeover = (since(t), since(Instant::now()));
    let old_exit = current.take().map(|mut c| c.wait());
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let outs: Vec<ReaderOut> = readers
        .into_iter()
        .map(|t| t.join().expect("a reader panicked"))
        .collect();
    let passthrough_blobs: u32 = Client::connect(&sock)
        .ok()
        .and_then(|mut c| c.call::<Status>(Request::Stats).ok())
        .map(|s| s.layers.iter().map(|l| l.passthrough_blobs).sum())
        .unwrap_or(0);

    let reads: Vec<ReadRec> = outs.iter().flat_map(|o| o.reads.iter().copied()).collect();
    let errors: u64 = outs.iter().map(|o| o.errors).sum();
    let wrong: u64 = outs.iter().map(|o| o.wrong).sum();
    let mut all: Vec<f64> = reads.iter().map(|r| r.dur as f64 / 1e3).collect();
    let mut quiet: Vec<f64> = reads
        .iter()
        .filter(|r| r.start + r.dur <= quiet_end)
        .map(|r| r.dur as f64 / 1e3)
        .collect();
    let longest = all.iter().copied().fold(0.0, f64::max);
    let stall = |(from, to): (u64, u64)| {
        reads
            .iter()
            .filter(|r| r.start < to && r.start + r.dur > from)
            .map(|r| r.dur as f64 / 1e3)
            .fold(0.0, f64::max)
    };
    let mut outage_ms: Vec<f64> = outages.iter().map(|(a, b)| (b - a) as f64 / 1e3).collect();
    let mut stalls: Vec<f64> = outages.iter().map(|w| stall(*w)).collect();
    let takeover_stall = stall(takeover);

    println!();
    println!(
        "### 3. `strata` daemon: {} kill -9 + restart, then 1 takeover, {READERS} readers of {} files ({})",
        p.kills,
        files.len(),
        mb(bytes as u64)
    );
    println!();
    println!("| | |");
    println!("| --- | ---: |");
    println!("| reads | {} |", reads.len());
    println!("| read errors / wrong bytes | **{errors} / {wrong}** |");
    println!("| longest read (the stall) | {longest:.1} ms |");
    println!(
        "| read p50 / p99, whole run | {:.2} / {:.2} ms |",
        quantile(&mut all, 0.5),
        quantile(&mut all, 0.99)
    );
    println!(
        "| read p50 / p99, quiet 2 s before the first kill | {:.2} / {:.2} ms |",
        quantile(&mut quiet, 0.5),
        quantile(&mut quiet, 0.99)
    );
    println!(
        "| restart to answering `ping`: p50 / max | {:.0} / {:.0} ms |",
        quantile(&mut restart_ms, 0.5),
        restart_ms.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "| kill to answering: p50 / max | {:.0} / {:.0} ms |",
        quantile(&mut outage_ms, 0.5),
        outage_ms.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "| longest read overlapping an outage: p50 / max | {:.0} / {:.0} ms |",
        quantile(&mut stalls, 0.5),
        stalls.iter().copied().fold(0.0, f64::max)
    );
    println!("| takeover: start to the new daemon answering | {takeover_ms:.0} ms |");
    println!("| takeover: longest read overlapping it | {takeover_stall:.1} ms |");
    println!(
        "| old daemon's exit after the handover | {} |",
        match old_exit {
            Some(Ok(s)) => s.to_string(),
            Some(Err(e)) => format!("wait failed: {e}"),
            None => "not our child".to_owned(),
        }
    );
    println!("| blobs read in passthrough at the end (0: every read reached the daemon) | {passthrough_blobs} |");
    if errors + wrong > 0 {
        for k in 0..p.kills {
            let log =
                std::fs::read_to_string(dir.join(format!("daemon{k}.log"))).unwrap_or_default();
            for l in log
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            {
                eprintln!("daemon{k}: {l}");
            }
        }
    }

    // A clean stop: unmount, stop the daemon (its holder goes with it).
    let mut c = strata_cmd();
    c.arg("umount").arg(&mp);
    let umounted = c.output().map(|o| o.status.success()).unwrap_or(false);
    // SAFETY: plain kill(2) of the daemon we started.
    unsafe { libc::kill(new as i32, libc::SIGTERM) };
    let mut children = lock(&guard.children);
    let stopped = children.last_mut().map(|c| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match c.try_wait() {
                Ok(Some(s)) => break s.to_string(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => break "still running after 30 s (killed)".to_owned(),
                Err(e) => break format!("wait failed: {e}"),
            }
        }
    });
    drop(children);
    let stopped = stopped.unwrap_or_default();
    println!(
        "clean stop: umount {}, daemon {stopped}",
        if umounted { "ok" } else { "FAILED" },
    );
    if !umounted || !stopped.contains("exit status: 0") {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        println!("the upgraded daemon's log, last lines:");
        for l in tail.into_iter().rev() {
            println!("  {l}");
        }
    }
    if errors + wrong > 0 {
        println!("\n*** READ ERRORS: {errors} errors, {wrong} wrong (must be 0) ***");
    }
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("\n*** SKIPPED node_daemon: needs root (mount(2), /dev/fuse, overlayfs) ***\n");
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    let secs = env_num("STRATA_NODE_DAEMON_SECS").unwrap_or(if full { 5.0 } else { 1.0 });
    let p = Params {
        secs,
        // About one A mount per 0.6-1 s over the three rows, with room to spare.
        a_versions: ((secs * 3.0 / 0.5).ceil() as usize + 4).max(6),
        kills: env_num("STRATA_NODE_DAEMON_KILLS").unwrap_or(if full { 20 } else { 5 }),
        scenarios: std::env::var("STRATA_NODE_DAEMON_SCENARIOS")
            .unwrap_or_else(|_| "1,2,s3,3".to_owned())
            .split(',')
            .map(|s| s.trim().to_owned())
            .collect(),
    };
    let s3 = ["STRATA_TEST_S3_ENDPOINT", bench::S3_ENDPOINT_ENV]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|e| !e.trim().is_empty()))
        .map(|e| e.trim().trim_end_matches('/').to_owned());
    if s3.is_some() {
        // Before any thread starts.
        for (name, value) in [
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
        ] {
            if std::env::var_os(name).is_none() {
                std::env::set_var(name, value);
            }
        }
    }
    catch_signals();

    let dir = bench_tempdir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "node_daemon",
        "the node_daemon bench directory",
    );
    let root = std::fs::canonicalize(dir.path()).expect("resolve the bench directory");
    *lock(&ROOT) = Some(root.clone());
    let holder = find_binary("STRATA_FD_HOLDER", "strata-fd-holder");
    let strata = find_binary("STRATA_BIN", "strata");
    println!(
        "node_daemon: in {} ({}), {} s per row, {} kills; {} CPUs",
        root.display(),
        fs_type(&root).unwrap_or_default(),
        p.secs,
        p.kills,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    match &holder {
        Ok(h) => println!("fd holder: {}", describe_binary(h)),
        Err(e) => println!(
            "\n*** NO FD HOLDER: {e}; the in-process node runs without one (build it: cargo build --release -p ublk-daemon --bins) ***\n"
        ),
    }
    match &strata {
        Ok(s) => println!("strata: {}", describe_binary(s)),
        Err(e) => println!("(strata: {e})"),
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if p.run("1") || p.run("2") {
        node_scenarios(&rt, &root, &p, holder.as_deref().ok());
    }
    match &s3 {
        Some(endpoint) if p.run("s3") => {
            s3_scenario(&rt, &root, &p, holder.as_deref().ok(), endpoint)
        }
        Some(_) => {}
        None => println!(
            "\n*** SKIPPED scenario 1 over S3: set STRATA_TEST_S3_ENDPOINT=http://127.0.0.1:PORT (moto_server) ***"
        ),
    }
    match &strata {
        Ok(s) if p.run("3") => restart_scenario(s, &root, &p),
        Ok(_) => {}
        Err(e) => println!(
            "\n*** SKIPPED scenario 3 (restart stall): {e}; build it: cargo build --release -p strata ***"
        ),
    }
    drop(rt);
}
