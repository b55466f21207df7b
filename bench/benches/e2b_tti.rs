//! Time to interactive through the E2B API, measured from the unmodified `e2b` SDK as the
//! public benchmarks measure it: `Sandbox.create()`, then the first output of
//! `commands.run("echo hi")`; p50/p95/p99 over `STRATA_BENCH_TTI_N` (100) sandboxes one after
//! another, then with `STRATA_BENCH_TTI_CONCURRENCY` (64) concurrent async SDK clients over
//! `STRATA_BENCH_TTI_CONCURRENT_N` (4 × concurrency) sandboxes, failed requests counted. The
//! SDK side is `bench/e2b/tti.py`, run with the virtualenv of `scripts/install-test-deps.sh`.
//! A scenario harness (`harness = false`): it prints the script's markdown table; nothing is
//! asserted on timing.
//!
//! Set-up, never timed: the Debian tree of `scripts/debian-base.sh` built as one layer
//! (`base/debian:12`) into a local store under the bench directory, a `strata daemon --api
//! 127.0.0.1:0` on a fresh run directory and home, and a template `base` of that layer, with a
//! warm pool of `STRATA_BENCH_TTI_POOL` (0: none) sandboxes, filled before the run. Without a
//! pool the first sandbox of the run mounts the layer (counted in the sequential max).
//!
//! Binaries: `strata` beside the bench executable's directory (`target/release/strata`, after
//! `cargo build --release --bin strata`) or `STRATA_BIN`; `runc` on `PATH`. Needs root.
//! Everything it started is removed when it ends (also on a panic): the sandboxes, the daemon
//! (SIGTERM) and its fd holder, mounts left under its directory, its directory.
//! `cargo bench -p bench --bench e2b_tti`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const VENV_PYTHON: &str = "/usr/local/lib/strata/e2b/bin/python";
const KEY: &str = "bench-key";

fn strata_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("the bench's path");
    // target/release/deps/e2b_tti-… → target/release/strata
    exe.parent()
        .and_then(Path::parent)
        .map(|d| d.join("strata"))
        .filter(|p| p.is_file())
        .expect(
            "no strata binary beside the bench: cargo build --release --bin strata, or STRATA_BIN",
        )
}

struct Node {
    dir: tempfile::TempDir,
    bin: PathBuf,
    daemon: Option<Child>,
}

impl Node {
    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.env("STRATA_HOME", self.dir.path().join("home"))
            .env("STRATA_RUN_DIR", self.dir.path().join("run"))
            .env_remove("STRATA_STORE")
            .arg("--store")
            .arg(self.dir.path().join("store"));
        c
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.cmd().args(args).output().expect("run strata");
        assert!(
            out.status.success(),
            "strata {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // A warm pool would refill what is removed: emptied first.
        let _ = self
            .cmd()
            .args([
                "template",
                "set",
                "base",
                "--layer",
                "base/debian:12",
                "--pool",
                "0",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let ids: Vec<String> = serde_json::from_str::<serde_json::Value>(&String::from_utf8_lossy(
            &self
                .cmd()
                .args(["--json", "sandbox", "ls"])
                .stderr(Stdio::null())
                .output()
                .map(|o| o.stdout)
                .unwrap_or_default(),
        ))
        .ok()
        .and_then(|v| {
            v.as_array().map(|a| {
                a.iter()
                    .filter_map(|s| s["id"].as_str().map(str::to_owned))
                    .collect()
            })
        })
        .unwrap_or_default();
        for id in ids {
            let _ = self
                .cmd()
                .args(["sandbox", "rm", &id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        if let Some(mut d) = self.daemon.take() {
            if let Some(pid) = rustix::process::Pid::from_raw(d.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while d.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = d.kill();
            let _ = d.wait();
        }
        // Containers left behind (a daemon stopped while sandboxes ran keeps them).
        let runc_root = self.dir.path().join("run/runc");
        for e in std::fs::read_dir(&runc_root)
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&runc_root)
                .args(["delete", "--force"])
                .arg(e.file_name())
                .stderr(Stdio::null())
                .status();
        }
        let run = self.dir.path().join("run").to_string_lossy().into_owned();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            if args.contains(&&b"fuse-holder"[..]) && args.contains(&run.as_bytes()) {
                if let Some(p) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
                }
            }
        }
        if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
            let root = self.dir.path().to_string_lossy().into_owned();
            let mut mps: Vec<&str> = mi
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|m| m.starts_with(&root))
                .collect();
            mps.sort_by_key(|m| std::cmp::Reverse(m.len()));
            for m in mps {
                let _ = rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH);
            }
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    assert!(rustix::process::geteuid().is_root(), "e2b_tti needs root");
    assert!(
        Path::new(VENV_PYTHON).exists(),
        "no {VENV_PYTHON}: scripts/install-test-deps.sh installs the e2b SDK"
    );
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository");
    let out = Command::new(repo.join("scripts/debian-base.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/debian-base.sh");
    assert!(out.status.success(), "scripts/debian-base.sh failed");
    let base = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let dir = bench::bench_tempdir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "strata-bench-e2b",
        "the bench directory",
    );
    let mut node = Node {
        dir,
        bin: strata_bin(),
        daemon: None,
    };
    node.ok(&[
        "layer",
        "build",
        &base.to_string_lossy(),
        "--name",
        "base/debian:12",
    ]);
    let keys = node.dir.path().join("keys");
    std::fs::write(&keys, format!("{KEY}\n")).expect("write the keys");
    let log = std::fs::File::create(node.dir.path().join("daemon.log")).expect("the log");
    let mut c = node.cmd();
    c.args(["daemon", "--api", "127.0.0.1:0", "--api-keys"])
        .arg(&keys)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("the log"))
        .stderr(log);
    std::os::unix::process::CommandExt::process_group(&mut c, 0);
    node.daemon = Some(c.spawn().expect("start the daemon"));
    let addr_file = node.dir.path().join("run/api.addr");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !addr_file.exists() {
        assert!(Instant::now() < deadline, "no API within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let url = format!(
        "http://{}",
        std::fs::read_to_string(&addr_file)
            .expect("api.addr")
            .trim()
    );
    let pool: u32 = std::env::var("STRATA_BENCH_TTI_POOL")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    node.ok(&[
        "template",
        "set",
        "base",
        "--layer",
        "base/debian:12",
        "--pool",
        &pool.to_string(),
    ]);
    if pool > 0 {
        let deadline = Instant::now() + Duration::from_secs(300);
        let want = format!("{pool} wanted, {pool} ready");
        while !node.ok(&["sandbox", "pool", "ls"]).contains(&want) {
            assert!(Instant::now() < deadline, "the pool never filled");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    println!(
        "e2b_tti: strata {}, node {url}, pool {pool}, {} CPUs",
        node.bin.display(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let status = Command::new(VENV_PYTHON)
        .arg(repo.join("bench/e2b/tti.py"))
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", KEY)
        .env("STRATA_TEMPLATE", "base")
        .env_remove("E2B_DEBUG")
        .status()
        .expect("run bench/e2b/tti.py");
    assert!(status.success(), "bench/e2b/tti.py failed");
    println!(
        "public figures (client-measured, April 2026): Daytona median 0.11 s, E2B 0.44 s, \
         Modal 2.66 s; goal here: p50 ≤ 50 ms, p99 ≤ 150 ms, 0 failed at 64 concurrent"
    );
}
