//! Sandbox bursts: many sandboxes created at once from a lazily served three-layer stack on
//! S3 (moto on 127.0.0.1), against the eager way (download a tar.gz of the same trees, extract
//! it, run it with the same runtime), the runtime's own floor, a sustained rate and warm pools.
//! A scenario harness (`harness = false`) that prints markdown tables; nothing is asserted on
//! timing (the goals are printed next to the figures).
//!
//! Set-up, never timed: moto (`bench::S3Server`, or `STRATA_BENCH_S3_ENDPOINT`) and a bucket;
//! three trees pushed with `strata layer build` to `s3://strata-bench/sandbox-burst-…`:
//! `base/debian:1` (the Debian tree of `scripts/debian-base.sh`), `workspace/py:1` (copies of
//! `/usr/lib/python3` and `/usr/share/perl` under `/ws`, plus `/ws/list.txt`: a fixed
//! pseudo-random 10 % of its files) and `toolkit/tz:1` (`/usr/share/zoneinfo` under
//! `/opt/toolkit`); a `strata daemon` on a fresh run directory and `STRATA_HOME` (its level-1
//! and level-2 caches cold) serving that store.
//!
//! Every sandbox runs one exec, the same everywhere: `sh -c 'echo ready; cat $(cat
//! /ws/list.txt) > /dev/null; echo done'`. "First output" is the `ready` line: the moment the
//! sandbox runs a command of the caller's; the exec's duration covers the reads.
//!
//! 1. **Lazy burst**: `STRATA_BENCH_SANDBOXES` (256) `sandbox_create` + `sandbox_exec` by
//!    `STRATA_BENCH_CONCURRENCY` (32) client threads; then every sandbox idle (memory), then
//!    `sandbox_rm` of all (timed separately).
//! 2. **Eager**: the three trees as one tar.gz on the same S3; per sandbox: `GET` it
//!    (fs-cache's S3 backend), `tar -xzf -` it into a fresh directory, an OCI config from
//!    `sandbox_runtime::spec::build`, `runc run -d` (Strata's init, as the daemon), `runc exec` of
//!    the command. `STRATA_BENCH_EAGER_SANDBOXES` (default min(N, 64): each root is ~250 MB of
//!    local disk, all kept until the end as the lazy ones are), same concurrency.
//! 3. **Runtime floor**: `runc run` (foreground, the command as the container's process) on
//!    one already extracted root, N times sequentially and at the burst's concurrency; CPU of
//!    the runtime's processes from `getrusage(RUSAGE_CHILDREN)`.
//! 4. **Sustained**: create + exec + rm loops by the same threads for `STRATA_BENCH_SUSTAIN_S`
//!    (60) seconds.
//! 5. **Pool**: `sandbox_pool_set STACK 16`, wait until ready, 200 `sandbox_run`
//!    (`STRATA_BENCH_POOL_RUNS`) sequentially and at concurrency 4.
//!
//! `STRATA_BENCH_SCENARIOS` (default `lazy,eager,floor,sustain,pool`) picks scenarios.
//! Binaries: `strata` beside the bench executable's directory (`target/release/strata`, after
//! `cargo build --release --bin strata`) or `STRATA_BIN`; `runc` on `PATH`.
//! Needs root. Everything it started is removed when it ends (also on a panic): sandboxes
//! through the daemon, then the daemon (SIGTERM) and its fd holder, the eager containers
//! (`runc delete -f`), mounts left under its directory (`umount -l`), its directory, moto.
//! Smoke run without `--bench` (as `cargo test --benches` runs it in CI): 8 sandboxes, 4 at
//! once, 3 s sustained, 10 pool runs. `cargo bench -p bench --bench sandbox_burst`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bench::node::{debian_tree, strata_bin};
use sandbox_runtime::proto::{
    CreateRequest, ExecRequest, PoolInfo, PoolRequest, Request as SbRequest, RunRequest,
    SandboxInfo,
};
use sandbox_runtime::Limits;
use ublk_daemon::node::client::Client;
use ublk_daemon::node::proto::{Pong, Request as NodeRequest, Status};

#[path = "sandbox_burst/eager.rs"]
mod eager;
use eager::{eager_burst, eager_one, find_in_path, floor, run_pool, Eager};

const BUCKET: &str = "strata-bench";
const LAYERS: [&str; 3] = ["base/debian:1", "workspace/py:1", "toolkit/tz:1"];
const CMD: &str = "echo ready; cat $(cat /ws/list.txt) > /dev/null && echo done";
const POOL_SIZE: u32 = 16;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------
// Figures.

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s
}

/// `p50 / p99 / max` of milliseconds.
fn dist(v: &[f64]) -> String {
    let s = sorted(v);
    format!(
        "{:.1} / {:.1} / {:.1}",
        pct(&s, 0.5),
        pct(&s, 0.99),
        s.last().copied().unwrap_or(f64::NAN)
    )
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Sectors written (512 bytes) by the machine's real disks (`/sys/block/X/device` exists:
/// not loop, ram, dm or zram).
fn disk_written() -> u64 {
    let text = std::fs::read_to_string("/proc/diskstats").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let name = *f.get(2)?;
            if !Path::new("/sys/block").join(name).join("device").exists() {
                return None;
            }
            f.get(9)?.parse::<u64>().ok()
        })
        .sum::<u64>()
        * 512
}

/// Flush dirty pages, then the bytes the disks have written so far.
fn synced_disk_written() -> u64 {
    // SAFETY: sync(2) takes no arguments.
    unsafe { libc::sync() };
    disk_written()
}

/// `VmRSS` and `Pss` (smaps_rollup) of `pid`, bytes.
fn rss_pss(pid: u32) -> (u64, u64) {
    let field = |text: &str, name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    (field(&status, "VmRSS:"), field(&rollup, "Pss:"))
}

fn mem_available() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// user + sys seconds of the waited-for children (and their waited-for descendants).
fn children_cpu() -> f64 {
    // SAFETY: getrusage writes one rusage into `ru`.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `ru` is a valid, writable rusage.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Total CPU seconds of the machine (user+nice+system+irq+softirq) from /proc/stat.
fn machine_cpu() -> f64 {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(l) = text.lines().next() else {
        return 0.0;
    };
    let f: Vec<f64> = l
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let busy: f64 = [0usize, 1, 2, 5, 6].iter().filter_map(|&i| f.get(i)).sum();
    // SAFETY: sysconf with a valid name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    busy / hz
}

/// The per-sandbox figures of one burst.
#[derive(Default, Clone)]
struct Sample {
    /// Sending create → its answer (eager: download + extract + runc run -d).
    create: f64,
    /// Sending create → the exec's first output.
    first_output: f64,
    /// Sending exec → its end.
    exec: f64,
    /// Eager phases.
    download: f64,
    extract: f64,
    runc_run: f64,
    /// The daemon's own create_ms (compose + runtime).
    daemon_create: f64,
}

#[derive(Default)]
struct Burst {
    samples: Vec<Sample>,
    errors: Vec<String>,
    wall: Duration,
    disk: u64,
    fetched: u64,
    requests: u64,
    cpu: f64,
}

fn print_burst(title: &str, b: &Burst, eager: bool) {
    let n = b.samples.len();
    let col = |f: fn(&Sample) -> f64| b.samples.iter().map(f).collect::<Vec<f64>>();
    println!("\n### {title}\n");
    println!("| figure | value |\n| --- | --- |");
    println!("| sandboxes (ok / failed) | {n} / {} |", b.errors.len());
    println!("| wall | {:.2} s |", b.wall.as_secs_f64());
    println!(
        "| creations/s (create + first exec done) | {:.1} |",
        n as f64 / b.wall.as_secs_f64()
    );
    println!(
        "| create, ms p50 / p99 / max | {} |",
        dist(&col(|s| s.create))
    );
    if eager {
        println!(
            "| — download (S3 GET), ms | {} |",
            dist(&col(|s| s.download))
        );
        println!(
            "| — extract (tar -xzf), ms | {} |",
            dist(&col(|s| s.extract))
        );
        println!("| — runc run -d, ms | {} |", dist(&col(|s| s.runc_run)));
    } else {
        println!(
            "| — the daemon's create_ms (compose + runc run -d), ms | {} |",
            dist(&col(|s| s.daemon_create))
        );
    }
    println!(
        "| **create → first exec output**, ms p50 / p99 / max | **{}** |",
        dist(&col(|s| s.first_output))
    );
    println!(
        "| exec duration (reads 10 % of the workspace), ms | {} |",
        dist(&col(|s| s.exec))
    );
    println!(
        "| bytes written to local disk (all real disks, synced) | {} ({} per sandbox) |",
        mib(b.disk),
        mib(b.disk / n.max(1) as u64)
    );
    println!(
        "| bytes fetched from the store | {} in {} requests |",
        mib(b.fetched),
        b.requests
    );
    println!(
        "| machine CPU (user+sys, all processes) | {:.1} s ({:.1} ms per sandbox) |",
        b.cpu,
        b.cpu * 1000.0 / n.max(1) as f64
    );
    for e in b.errors.iter().take(5) {
        println!("\nerror: {e}");
    }
}

// ---------------------------------------------------------------------------------------
// Clean-up, however the bench ends.

struct Cleanup {
    root: PathBuf,
    run_dir: PathBuf,
    daemon: Option<Child>,
    eager_runc_root: Option<PathBuf>,
}

impl Cleanup {
    fn sock(&self) -> PathBuf {
        self.run_dir.join("strata.sock")
    }

    /// rm every sandbox of the daemon (the pool drained first), 8 at a time.
    fn remove_all_sandboxes(&self) {
        let sock = self.sock();
        let Ok(mut c) = Client::connect(&sock) else {
            return;
        };
        if let Ok(pools) =
            c.call_streaming::<Vec<PoolInfo>>(&SbRequest::SandboxPoolLs {}.to_value(), |_| Ok(()))
        {
            for p in pools {
                let _ = c.call_streaming::<PoolInfo>(
                    &SbRequest::SandboxPoolSet(PoolRequest {
                        stack: p.stack,
                        size: 0,
                    })
                    .to_value(),
                    |_| Ok(()),
                );
            }
        }
        let Ok(all) =
            c.call_streaming::<Vec<SandboxInfo>>(&SbRequest::SandboxLs {}.to_value(), |_| Ok(()))
        else {
            return;
        };
        let ids: Vec<String> = all.into_iter().map(|s| s.id).collect();
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let Ok(mut c) = Client::connect(&sock) else {
                        return;
                    };
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(id) = ids.get(i) else { break };
                        let _ = c.call_streaming::<SandboxInfo>(
                            &SbRequest::SandboxRm { id: id.clone() }.to_value(),
                            |_| Ok(()),
                        );
                    }
                });
            }
        });
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            self.remove_all_sandboxes();
            let holder = ublk_daemon::holder::HolderClient::connect(&self.run_dir)
                .ok()
                .and_then(|h| h.ping().ok());
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(20) {
                if let Ok(Some(_)) = d.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = d.kill();
            let _ = d.wait();
            if let Some(pid) = holder {
                // SAFETY: kill(2) of the fd holder our daemon started (its pid from its ping).
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
        }
        if let Some(r) = &self.eager_runc_root {
            eager_delete_all(r);
        }
        for _ in 0..5 {
            let mine: Vec<PathBuf> = ublk_daemon::node::sys::mounts()
                .unwrap_or_default()
                .into_iter()
                .rev()
                .filter(|m| {
                    m.mount_point.starts_with(&self.root)
                        || ublk_daemon::node::sys::is_ours(m, &self.run_dir)
                })
                .map(|m| m.mount_point)
                .collect();
            if mine.is_empty() {
                break;
            }
            for mp in mine {
                eprintln!("sandbox_burst: left mounted, detaching: {}", mp.display());
                if let Ok(c) = std::ffi::CString::new(mp.as_os_str().as_bytes()) {
                    // SAFETY: `c` is a valid NUL-terminated path.
                    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
                }
            }
        }
    }
}

fn eager_delete_all(runc_root: &Path) {
    let Ok(out) = Command::new("runc")
        .arg("--root")
        .arg(runc_root)
        .args(["list", "-q"])
        .output()
    else {
        return;
    };
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    for id in ids {
        let _ = Command::new("runc")
            .arg("--root")
            .arg(runc_root)
            .args(["delete", "-f", &id])
            .stderr(Stdio::null())
            .status();
    }
}

// ---------------------------------------------------------------------------------------
// Set-up.

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Files (regular) under `dir`, relative, sorted.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(e.path().strip_prefix(dir).unwrap_or(&e.path()).to_owned());
            }
        }
    }
    out.sort();
    out
}

struct Trees {
    base: PathBuf,
    workspace: PathBuf,
    toolkit: PathBuf,
    ws_files: usize,
    ws_bytes: u64,
    listed: usize,
    listed_bytes: u64,
}

fn make_trees(root: &Path) -> Trees {
    let base = debian_tree();
    assert!(
        base.join("bin/sh").exists() || base.join("usr/bin/sh").exists(),
        "{}: not a Debian root",
        base.display()
    );
    let workspace = root.join("trees/workspace");
    let toolkit = root.join("trees/toolkit");
    std::fs::create_dir_all(workspace.join("ws")).unwrap();
    std::fs::create_dir_all(toolkit.join("opt/toolkit")).unwrap();
    run(
        Command::new("cp")
            .args(["-a", "/usr/lib/python3"])
            .arg(workspace.join("ws/python3")),
        "copy /usr/lib/python3",
    );
    run(
        Command::new("cp")
            .args(["-a", "/usr/share/perl"])
            .arg(workspace.join("ws/perl")),
        "copy /usr/share/perl",
    );
    run(
        Command::new("cp")
            .args(["-a", "/usr/share/zoneinfo"])
            .arg(toolkit.join("opt/toolkit/zoneinfo")),
        "copy /usr/share/zoneinfo",
    );
    let files = files_under(&workspace);
    let ws_bytes = files
        .iter()
        .map(|f| {
            std::fs::metadata(workspace.join(f))
                .map(|m| m.len())
                .unwrap_or(0)
        })
        .sum();
    // A fixed pseudo-random tenth of the files (names a shell word can carry as is).
    let mut rng = fastrand::Rng::with_seed(0x5eed_b0b5);
    let mut list = String::new();
    let (mut listed, mut listed_bytes) = (0, 0);
    for f in &files {
        let s = f.to_string_lossy();
        let plain = s
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"/._-+".contains(&c));
        if plain && rng.u32(0..10) == 0 {
            list.push_str(&format!("/{s}\n"));
            listed += 1;
            listed_bytes += std::fs::metadata(workspace.join(f))
                .map(|m| m.len())
                .unwrap_or(0);
        }
    }
    std::fs::write(workspace.join("ws/list.txt"), list).unwrap();
    Trees {
        base,
        workspace,
        toolkit,
        ws_files: files.len(),
        ws_bytes,
        listed,
        listed_bytes,
    }
}

fn tree_size(dir: &Path) -> (usize, u64) {
    let f = files_under(dir);
    let b = f
        .iter()
        .map(|p| std::fs::metadata(dir.join(p)).map(|m| m.len()).unwrap_or(0))
        .sum();
    (f.len(), b)
}

fn start_daemon(strata: &Path, root: &Path, store: &str, cleanup: &mut Cleanup) -> u32 {
    let run_dir = root.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    cleanup.run_dir = run_dir.clone();
    let log = std::fs::File::create(root.join("daemon.log")).unwrap();
    let child = Command::new(strata)
        .arg("--store")
        .arg(store)
        .arg("daemon")
        .arg("--run-dir")
        .arg(&run_dir)
        .arg("--sandbox-dir")
        .arg(root.join("sandboxes"))
        .env("STRATA_HOME", root.join("home"))
        .env(
            "STRATA_LOG",
            std::env::var("STRATA_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start strata daemon");
    cleanup.daemon = Some(child);
    let sock = run_dir.join("strata.sock");
    let t = Instant::now();
    loop {
        if let Ok(mut c) = Client::connect(&sock) {
            if let Ok(p) = c.call::<Pong>(NodeRequest::Ping) {
                return p.pid;
            }
        }
        if let Some(d) = cleanup.daemon.as_mut() {
            if let Ok(Some(s)) = d.try_wait() {
                panic!(
                    "strata daemon exited ({s}):\n{}",
                    std::fs::read_to_string(root.join("daemon.log")).unwrap_or_default()
                );
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the daemon does not answer on {}",
            sock.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------------------
// The daemon's side.

fn sb_call<T: serde::de::DeserializeOwned>(c: &mut Client, r: SbRequest) -> Result<T, String> {
    c.call_streaming(&r.to_value(), |_| Ok(()))
        .map_err(|e| e.to_string())
}

/// An exec (or run) streamed: (first Output event's instant, the result).
fn streamed(
    c: &mut Client,
    r: SbRequest,
) -> Result<(Option<Instant>, sandbox_runtime::proto::ExecResult), String> {
    let mut first = None;
    let res: sandbox_runtime::proto::ExecResult = c
        .call_streaming(&r.to_value(), |ev| {
            if first.is_none() && ev.get("type").and_then(|t| t.as_str()) == Some("output") {
                first = Some(Instant::now());
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    if res.exit_code != Some(0) {
        return Err(format!(
            "exec ended {:?} {:?}: {:?}",
            res.reason, res.exit_code, res.message
        ));
    }
    Ok((first, res))
}

fn exec_req(id: &str) -> ExecRequest {
    ExecRequest {
        id: id.to_owned(),
        args: vec!["sh".into(), "-c".into(), CMD.into()],
        ..Default::default()
    }
}

/// create + one exec of sandbox `id`.
fn lazy_one(c: &mut Client, id: &str) -> Result<Sample, String> {
    let t0 = Instant::now();
    let info: SandboxInfo = sb_call(
        c,
        SbRequest::SandboxCreate(CreateRequest {
            layers: LAYERS.iter().map(|s| s.to_string()).collect(),
            id: Some(id.to_owned()),
            ..Default::default()
        }),
    )?;
    let t1 = Instant::now();
    let (first, _) = streamed(c, SbRequest::SandboxExec(exec_req(id)))?;
    let t2 = Instant::now();
    let first = first.ok_or("no output")?;
    Ok(Sample {
        create: ms(t1 - t0),
        first_output: ms(first - t0),
        exec: ms(t2 - t1),
        daemon_create: info.create_ms as f64,
        ..Default::default()
    })
}

/// `f(client, i)` for i in 0..n by `conc` threads, each with its own connection.
fn pool_of<T: Send>(
    sock: &Path,
    n: usize,
    conc: usize,
    f: impl Fn(&mut Client, usize) -> Result<T, String> + Sync,
) -> (Vec<T>, Vec<String>, Duration) {
    let next = AtomicUsize::new(0);
    let out = Mutex::new(Vec::new());
    let errs = Mutex::new(Vec::new());
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..conc.max(1) {
            s.spawn(|| {
                let mut c = Client::connect(sock).expect("connect to the daemon");
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    match f(&mut c, i) {
                        Ok(v) => lock(&out).push(v),
                        Err(e) => lock(&errs).push(format!("#{i}: {e}")),
                    }
                }
            });
        }
    });
    let wall = t.elapsed();
    (
        out.into_inner().unwrap_or_default(),
        errs.into_inner().unwrap_or_default(),
        wall,
    )
}

fn stats(sock: &Path) -> Status {
    Client::connect(sock)
        .expect("connect")
        .call::<Status>(NodeRequest::Stats)
        .expect("stats")
}

fn lazy_burst(sock: &Path, daemon_pid: u32, n: usize, conc: usize) -> Burst {
    let s0 = stats(sock);
    let (rss0, pss0) = rss_pss(daemon_pid);
    let avail0 = mem_available();
    let d0 = synced_disk_written();
    let cpu0 = machine_cpu();
    let (samples, errors, wall) = pool_of(sock, n, conc, |c, i| lazy_one(c, &format!("lz-{i}")));
    let cpu = machine_cpu() - cpu0;
    let disk = synced_disk_written() - d0;
    let s1 = stats(sock);
    let b = Burst {
        samples,
        errors,
        wall,
        disk,
        fetched: s1.cache.bytes_fetched - s0.cache.bytes_fetched,
        requests: s1.cache.backend_requests - s0.cache.backend_requests,
        cpu,
    };
    print_burst(
        &format!("Lazy burst: {n} sandboxes from the S3 stack, {conc} clients, caches cold"),
        &b,
        false,
    );
    let meta: u64 = s1.layers.iter().map(|l| l.meta_bytes).sum();
    println!(
        "\nStore reads beyond the chunk cache's: the three meta images, {} (fetched whole at the first mount). Cache: {} misses, {} hits, L1 {} of {}; level 2 on disk: {}.",
        mib(meta),
        s1.cache.misses - s0.cache.misses,
        s1.cache.hits - s0.cache.hits,
        mib(s1.cache.memory_bytes),
        mib(s1.cache.memory_capacity),
        s1.cache
            .disk
            .as_ref()
            .map(|d| format!("{d:?}").chars().take(200).collect::<String>())
            .unwrap_or_default()
    );
    // Idle: every sandbox up, no exec running.
    std::thread::sleep(Duration::from_secs(2));
    let (rss1, pss1) = rss_pss(daemon_pid);
    let avail1 = mem_available();
    let inits: Vec<u32> = {
        let mut c = Client::connect(sock).unwrap();
        sb_call::<Vec<SandboxInfo>>(&mut c, SbRequest::SandboxLs {})
            .unwrap_or_default()
            .into_iter()
            .filter_map(|s| s.pid)
            .collect()
    };
    let (init_rss, init_pss) = inits
        .iter()
        .map(|&p| rss_pss(p))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    let live = inits.len().max(1) as u64;
    let l1 = s1.cache.memory_bytes.saturating_sub(s0.cache.memory_bytes);
    println!(
        "\n| memory, {} idle sandboxes | total | per sandbox |",
        inits.len()
    );
    println!("| --- | --- | --- |");
    println!(
        "| daemon RSS growth (before → after: {} → {}) | {} | {:.2} MiB |",
        mib(rss0),
        mib(rss1),
        mib(rss1.saturating_sub(rss0)),
        rss1.saturating_sub(rss0) as f64 / live as f64 / 1048576.0
    );
    println!(
        "| — of which level-1 chunk cache growth (shared, bounded by its capacity) | {} | {:.2} MiB |",
        mib(l1),
        l1 as f64 / live as f64 / 1048576.0
    );
    println!(
        "| **daemon RSS growth without the L1 cache** | {} | **{:.2} MiB** |",
        mib(rss1.saturating_sub(rss0).saturating_sub(l1)),
        rss1.saturating_sub(rss0).saturating_sub(l1) as f64 / live as f64 / 1048576.0
    );
    println!(
        "| daemon PSS growth ({} → {}) | {} | {:.2} MiB |",
        mib(pss0),
        mib(pss1),
        mib(pss1.saturating_sub(pss0)),
        pss1.saturating_sub(pss0) as f64 / live as f64 / 1048576.0
    );
    println!(
        "| sandbox inits (strata-init) RSS / PSS | {} / {} | {:.3} / {:.3} MiB |",
        mib(init_rss),
        mib(init_pss),
        init_rss as f64 / live as f64 / 1048576.0,
        init_pss as f64 / live as f64 / 1048576.0
    );
    println!(
        "| machine MemAvailable drop (kernel: mounts, cgroups, page cache, …) | {} | {:.2} MiB |",
        mib(avail0.saturating_sub(avail1)),
        avail0.saturating_sub(avail1) as f64 / live as f64 / 1048576.0
    );
    b
}

/// The compose step alone: the node's `mount` of the stack with a fresh upper (what
/// `sandbox_create` asks for before `runc run -d`), then `umount`, by `conc` clients.
fn compose_only(sock: &Path, root: &Path, n: usize, conc: usize) {
    let dir = root.join("compose");
    let (v, errs, wall) = pool_of(sock, n, conc, |c, i| {
        let d = dir.join(format!("m{i}"));
        let (mp, up, wk) = (d.join("root"), d.join("upper"), d.join("work"));
        for x in [&mp, &up, &wk] {
            std::fs::create_dir_all(x).map_err(|e| e.to_string())?;
        }
        let t = Instant::now();
        c.call::<ublk_daemon::node::proto::MountInfo>(NodeRequest::Mount {
            layers: LAYERS.iter().map(|s| s.to_string()).collect(),
            mountpoint: mp.clone(),
            upper: Some(up),
            work: Some(wk),
        })
        .map_err(|e| e.to_string())?;
        let m = ms(t.elapsed());
        let t = Instant::now();
        c.call::<serde_json::Value>(NodeRequest::Umount { mountpoint: mp })
            .map_err(|e| e.to_string())?;
        let u = ms(t.elapsed());
        let _ = std::fs::remove_dir_all(&d);
        Ok((m, u))
    });
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "\nCompose alone (node `mount` of the stack with a fresh upper + `umount`, {n} by {conc} clients, caches warm): {:.1} mounts/s; mount ms p50 / p99 / max {}; umount {}; {} failed",
        v.len() as f64 / wall.as_secs_f64(),
        dist(&v.iter().map(|x| x.0).collect::<Vec<_>>()),
        dist(&v.iter().map(|x| x.1).collect::<Vec<_>>()),
        errs.len()
    );
    for e in errs.iter().take(3) {
        println!("error: {e}");
    }
}

fn lazy_rm_all(sock: &Path, n: usize, conc: usize) {
    let (lat, errs, wall) = pool_of(sock, n, conc, |c, i| {
        let t = Instant::now();
        sb_call::<SandboxInfo>(
            c,
            SbRequest::SandboxRm {
                id: format!("lz-{i}"),
            },
        )?;
        Ok(ms(t.elapsed()))
    });
    println!(
        "\n`sandbox_rm` of all {n} at concurrency {conc}: {:.2} s ({:.1}/s), per rm ms p50 / p99 / max {}; {} failed",
        wall.as_secs_f64(),
        lat.len() as f64 / wall.as_secs_f64(),
        dist(&lat),
        errs.len()
    );
    for e in errs.iter().take(3) {
        println!("error: {e}");
    }
}

// ---------------------------------------------------------------------------------------
// Eager.

fn sustained(sock: &Path, conc: usize, secs: u64) {
    let stop = Instant::now() + Duration::from_secs(secs);
    let counter = AtomicUsize::new(0);
    let lat = Mutex::new(Vec::new());
    let errs = Mutex::new(Vec::new());
    let rms = Mutex::new(Vec::new());
    let cpu0 = machine_cpu();
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..conc {
            s.spawn(|| {
                let mut c = Client::connect(sock).expect("connect");
                while Instant::now() < stop {
                    let i = counter.fetch_add(1, Ordering::Relaxed);
                    let id = format!("su-{i}");
                    match lazy_one(&mut c, &id) {
                        Ok(v) => lock(&lat).push((v.first_output, v.create, v.exec)),
                        Err(e) => lock(&errs).push(e),
                    }
                    let t = Instant::now();
                    match sb_call::<SandboxInfo>(&mut c, SbRequest::SandboxRm { id }) {
                        Ok(_) => lock(&rms).push(ms(t.elapsed())),
                        Err(e) => lock(&errs).push(format!("rm: {e}")),
                    }
                }
            });
        }
    });
    let wall = t.elapsed();
    let cpu = machine_cpu() - cpu0;
    let lat = lat.into_inner().unwrap_or_default();
    let errs = errs.into_inner().unwrap_or_default();
    println!("\n### Sustained: create + exec + rm loops, {conc} clients, {secs} s (caches warm)\n");
    println!("| figure | value |\n| --- | --- |");
    println!(
        "| cycles completed / failed | {} / {} |",
        lat.len(),
        errs.len()
    );
    println!(
        "| **creations/s sustained** | **{:.1}** |",
        lat.len() as f64 / wall.as_secs_f64()
    );
    println!(
        "| **create → first output**, ms p50 / p99 / max | **{}** |",
        dist(&lat.iter().map(|x| x.0).collect::<Vec<_>>())
    );
    println!(
        "| create, ms p50 / p99 / max | {} |",
        dist(&lat.iter().map(|x| x.1).collect::<Vec<_>>())
    );
    println!(
        "| exec, ms p50 / p99 / max | {} |",
        dist(&lat.iter().map(|x| x.2).collect::<Vec<_>>())
    );
    println!(
        "| rm, ms p50 / p99 / max | {} |",
        dist(&rms.into_inner().unwrap_or_default())
    );
    println!(
        "| machine CPU per cycle | {:.1} ms ({:.0} % of the machine) |",
        cpu * 1000.0 / lat.len().max(1) as f64,
        cpu / wall.as_secs_f64() * 100.0
            / std::thread::available_parallelism()
                .map(|x| x.get())
                .unwrap_or(1) as f64
    );
    for e in errs.iter().take(3) {
        println!("error: {e}");
    }
}

fn pool_scenario(sock: &Path, runs: usize) {
    let stack = LAYERS.join(",");
    let mut c = Client::connect(sock).expect("connect");
    let t = Instant::now();
    let _: PoolInfo = sb_call(
        &mut c,
        SbRequest::SandboxPoolSet(PoolRequest {
            stack: stack.clone(),
            size: POOL_SIZE,
        }),
    )
    .expect("sandbox_pool_set");
    let ready_after = loop {
        let pools: Vec<PoolInfo> = sb_call(&mut c, SbRequest::SandboxPoolLs {}).unwrap_or_default();
        if pools
            .iter()
            .any(|p| p.stack == stack && p.ready >= POOL_SIZE)
        {
            break t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(180),
            "the pool is not ready after 180 s: {pools:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    println!(
        "\n### Pool: `sandbox_pool_set {stack} --size {POOL_SIZE}` ready in {:.2} s; then {runs} `sandbox_run` of the command\n",
        ready_after.as_secs_f64()
    );
    println!("| concurrency | wall | runs/s | **take → first output** ms p50 / p99 / max | run to end ms p50 / p99 | pool ready at the end | failed |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for conc in [1usize, 4] {
        // Full again before each row.
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(120) {
            let pools: Vec<PoolInfo> =
                sb_call(&mut c, SbRequest::SandboxPoolLs {}).unwrap_or_default();
            if pools
                .iter()
                .any(|p| p.stack == stack && p.ready >= POOL_SIZE)
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let (v, errs, wall) = pool_of(sock, runs, conc, |c, _| {
            let t0 = Instant::now();
            let (first, _) = streamed(
                c,
                SbRequest::SandboxRun(RunRequest {
                    stack: stack.clone(),
                    exec: ExecRequest {
                        args: vec!["sh".into(), "-c".into(), CMD.into()],
                        ..Default::default()
                    },
                }),
            )?;
            let first = first.ok_or("no output")?;
            Ok((ms(first - t0), ms(t0.elapsed())))
        });
        let pools: Vec<PoolInfo> = sb_call(&mut c, SbRequest::SandboxPoolLs {}).unwrap_or_default();
        let ready = pools
            .iter()
            .find(|p| p.stack == stack)
            .map(|p| p.ready)
            .unwrap_or(0);
        let s = sorted(&v.iter().map(|x| x.1).collect::<Vec<_>>());
        println!(
            "| {conc} | {:.2} s | {:.1} | {} | {:.1} / {:.1} | {ready} | {} |",
            wall.as_secs_f64(),
            v.len() as f64 / wall.as_secs_f64(),
            dist(&v.iter().map(|x| x.0).collect::<Vec<_>>()),
            pct(&s, 0.5),
            pct(&s, 0.99),
            errs.len()
        );
        for e in errs.iter().take(3) {
            println!("error: {e}");
        }
    }
    let _: Result<PoolInfo, String> = sb_call(
        &mut c,
        SbRequest::SandboxPoolSet(PoolRequest { stack, size: 0 }),
    );
}

// ---------------------------------------------------------------------------------------

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED sandbox_burst: needs root (mounts, runc)");
        return;
    }
    for b in ["runc", "tar"] {
        if find_in_path(b).is_none() {
            println!("SKIPPED sandbox_burst: no {b} on PATH");
            return;
        }
    }
    for (name, value) in [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
    ] {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let full = bench::full_run();
    let n = env_usize("STRATA_BENCH_SANDBOXES", if full { 256 } else { 8 });
    let conc = env_usize("STRATA_BENCH_CONCURRENCY", if full { 32 } else { 4 });
    let eager_n = env_usize("STRATA_BENCH_EAGER_SANDBOXES", n.min(64));
    let sustain_s = env_usize("STRATA_BENCH_SUSTAIN_S", if full { 60 } else { 3 }) as u64;
    let pool_runs = env_usize("STRATA_BENCH_POOL_RUNS", if full { 200 } else { 10 });
    let scenarios = std::env::var("STRATA_BENCH_SCENARIOS")
        .unwrap_or_else(|_| "lazy,eager,floor,sustain,pool".into());
    let on = |s: &str| scenarios.split(',').any(|x| x.trim() == s);
    let strata = strata_bin();

    let s3 = match bench::S3Server::start() {
        Ok(Some(s)) => s,
        Ok(None) => {
            println!(
                "SKIPPED sandbox_burst: no moto_server on PATH and no STRATA_BENCH_S3_ENDPOINT"
            );
            return;
        }
        Err(e) => panic!("start moto: {e}"),
    };
    bench::create_bucket(s3.endpoint(), BUCKET).expect("create the bucket");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let store = format!(
        "s3://{BUCKET}/sandbox-burst-{}-{nanos}?endpoint={}&region=us-east-1",
        std::process::id(),
        s3.endpoint()
    );
    let dir = bench::bench_tempdir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "sandbox-burst-",
        "the bench directory",
    );
    let root = dir.path().to_owned();
    // chmod of our own directory: the sandboxes' inits (root, but in their own
    // namespaces) traverse it to their bundles.
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    let mut cleanup = Cleanup {
        root: root.clone(),
        run_dir: root.join("run"),
        daemon: None,
        eager_runc_root: None,
    };
    println!(
        "sandbox_burst: {} on {}, strata {}, S3 {} ({}), N={n}, concurrency {conc}, eager N={eager_n}",
        root.display(),
        bench::fs_type(&root).unwrap_or_default(),
        strata.display(),
        s3.endpoint(),
        if s3.is_spawned() { "moto started by the bench" } else { "STRATA_BENCH_S3_ENDPOINT" }
    );

    // --- Set-up: trees, layers, daemon (never timed).
    let t = Instant::now();
    let trees = make_trees(&root);
    let (bf, bb) = tree_size(&trees.base);
    let (tf, tb) = tree_size(&trees.toolkit);
    println!(
        "\nTrees: base {} ({bf} files, {}); workspace /ws = /usr/lib/python3 + /usr/share/perl ({} files, {}); /ws/list.txt: {} files, {} (the exec reads them); toolkit /opt/toolkit/zoneinfo ({tf} files, {}).",
        trees.base.display(),
        mib(bb),
        trees.ws_files,
        mib(trees.ws_bytes),
        trees.listed,
        mib(trees.listed_bytes),
        mib(tb)
    );
    let home_build = root.join("home-build");
    for (tree, name) in [
        (&trees.base, LAYERS[0]),
        (&trees.workspace, LAYERS[1]),
        (&trees.toolkit, LAYERS[2]),
    ] {
        let t = Instant::now();
        run(
            Command::new(&strata)
                .arg("--store")
                .arg(&store)
                .args(["layer", "build"])
                .arg(tree)
                .args(["--name", name])
                .env("STRATA_HOME", &home_build),
            &format!("strata layer build {name}"),
        );
        println!("pushed {name} in {:.1} s", t.elapsed().as_secs_f64());
    }
    let _ = std::fs::remove_dir_all(&home_build);
    let daemon_pid = start_daemon(&strata, &root, &store, &mut cleanup);
    let sock = cleanup.sock();
    println!(
        "daemon pid {daemon_pid} on {} (log {}); set-up {:.1} s",
        sock.display(),
        root.join("daemon.log").display(),
        t.elapsed().as_secs_f64()
    );

    let mut lazy: Option<Burst> = None;
    if on("lazy") {
        lazy = Some(lazy_burst(&sock, daemon_pid, n, conc));
        lazy_rm_all(&sock, n, conc);
        compose_only(&sock, &root, n.min(128), conc);
    }

    // --- Eager: one tar.gz of the three trees on the same S3.
    let mut eager_b: Option<Burst> = None;
    let need_eager = on("eager") || on("floor");
    let eager = need_eager.then(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let url = store.replacen("sandbox-burst-", "sandbox-burst-eager-", 1);
        let backend = rt.block_on(fs_cache::open_backend(&url)).expect("open S3");
        let tgz = root.join("stack.tar.gz");
        let t = Instant::now();
        run(
            Command::new("tar")
                .arg("-czf")
                .arg(&tgz)
                .arg("-C")
                .arg(&trees.base)
                .arg(".")
                .arg("-C")
                .arg(&trees.workspace)
                .arg(".")
                .arg("-C")
                .arg(&trees.toolkit)
                .arg("."),
            "tar -czf the stack",
        );
        let bytes = std::fs::read(&tgz).unwrap();
        let size = bytes.len() as u64;
        rt.block_on(backend.put("stack.tar.gz", bytes.into()))
            .expect("put the tar.gz");
        let _ = std::fs::remove_file(&tgz);
        println!(
            "\nEager set-up: stack.tar.gz {} (tar -czf + PUT in {:.1} s)",
            mib(size),
            t.elapsed().as_secs_f64()
        );
        let runc_root = root.join("runc-eager");
        cleanup.eager_runc_root = Some(runc_root.clone());
        (
            Eager {
                rt,
                backend,
                key: "stack.tar.gz".into(),
                dir: root.join("eager"),
                runc_root,
                init: sandbox_runtime::agent::install_init(&root)
                    .expect("install the sandboxes' init"),
            },
            size,
        )
    });
    if let Some((e, size)) = &eager {
        std::fs::create_dir_all(&e.dir).unwrap();
        if on("eager") {
            eager_b = Some(eager_burst(e, eager_n, conc, *size));
        } else {
            // The floor needs one extracted root.
            eager_one(e, 0).expect("extract one root");
        }
        if on("floor") {
            floor(e, &e.dir.join("eg-0/rootfs"), n, conc);
        }
        // Timed: an eager sandbox's teardown is part of its cost (ext4 with `discard` here).
        let t = Instant::now();
        eager_delete_all(&e.runc_root);
        let t_runc = t.elapsed();
        let roots: Vec<PathBuf> = std::fs::read_dir(&e.dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|d| d.path())
            .collect();
        let (_, _, wall) = run_pool(roots.len(), conc, |i| {
            std::fs::remove_dir_all(&roots[i]).map_err(|x| x.to_string())
        });
        let _ = std::fs::remove_dir_all(&e.dir);
        println!(
            "\neager teardown of {} roots: runc delete -f {:.1} s, rm -rf by {conc} threads {:.1} s ({:.0} ms per root)",
            roots.len(),
            t_runc.as_secs_f64(),
            wall.as_secs_f64(),
            ms(wall) / roots.len().max(1) as f64
        );
    }

    if let (Some(l), Some(e)) = (&lazy, &eager_b) {
        let p = |b: &Burst, q: f64| {
            pct(
                &sorted(&b.samples.iter().map(|s| s.first_output).collect::<Vec<_>>()),
                q,
            )
        };
        let per = |b: &Burst| b.disk as f64 / b.samples.len().max(1) as f64;
        let rate = |b: &Burst| b.samples.len() as f64 / b.wall.as_secs_f64();
        println!(
            "\n### Lazy vs eager (per sandbox: disk and store bytes are divided by each run's N)\n"
        );
        println!("| figure | lazy | eager | ratio | goal |\n| --- | --- | --- | --- | --- |");
        println!(
            "| create → first output p50, ms | {:.1} | {:.1} | {:.1}× faster | ≥ 5× |",
            p(l, 0.5),
            p(e, 0.5),
            p(e, 0.5) / p(l, 0.5)
        );
        println!(
            "| create → first output p99, ms | {:.1} | {:.1} | {:.1}× faster | |",
            p(l, 0.99),
            p(e, 0.99),
            p(e, 0.99) / p(l, 0.99)
        );
        println!(
            "| creations/s | {:.1} | {:.1} | {:.1}× | |",
            rate(l),
            rate(e),
            rate(l) / rate(e)
        );
        println!(
            "| disk written per sandbox | {} | {} | {:.1} % | ≤ 15 % |",
            mib(per(l) as u64),
            mib(per(e) as u64),
            per(l) / per(e) * 100.0
        );
        println!(
            "| store bytes per sandbox | {} | {} | {:.2} % | |",
            mib(l.fetched / l.samples.len().max(1) as u64),
            mib(e.fetched / e.samples.len().max(1) as u64),
            l.fetched as f64
                / l.samples.len().max(1) as f64
                / (e.fetched as f64 / e.samples.len().max(1) as f64)
                * 100.0
        );
    }

    if on("sustain") && sustain_s > 0 {
        sustained(&sock, conc, sustain_s);
    }
    if on("pool") {
        pool_scenario(&sock, pool_runs);
    }
    println!(
        "\nGoals (reported, not asserted): create → first exec p50 ≤ 50 ms and p99 ≤ 150 ms at 200 creations/s; pool take → first output ≤ 10 ms; lazy ≥ 5× faster than eager with ≤ 15 % of its disk writes; ≤ 2 MiB of Strata memory per idle sandbox."
    );
    let t = Instant::now();
    drop(cleanup);
    println!("clean-up {:.1} s", t.elapsed().as_secs_f64());
    let mut left: BTreeMap<String, usize> = BTreeMap::new();
    for m in ublk_daemon::node::sys::mounts().unwrap_or_default() {
        if m.mount_point.starts_with(&root) {
            *left.entry(m.fstype).or_default() += 1;
        }
    }
    if !left.is_empty() {
        println!("mounts left under {}: {left:?}", root.display());
    }
    drop(s3);
}
