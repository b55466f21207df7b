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
//! Smoke run without `--bench` (as `cargo test --benches` runs it in CI): 5 sandboxes in
//! sequence, 8 by 4 concurrent clients. `cargo bench -p bench --bench e2b_tti`.

use std::path::Path;
use std::process::{Command, Stdio};

use bench::node::{debian_tree, LocalNode};
use std::time::{Duration, Instant};

const VENV_PYTHON: &str = "/usr/local/lib/strata/e2b/bin/python";
const KEY: &str = "bench-key";

/// The bench's node; its template's pool is emptied first when it goes (a warm pool would
/// refill what the node's drop removes).
struct Node(LocalNode);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self
            .0
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
    let base = debian_tree();
    let mut node = Node(LocalNode::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "strata-bench-e2b",
    ));
    let node = &mut node.0;
    node.ok(&[
        "layer",
        "build",
        &base.to_string_lossy(),
        "--name",
        "base/debian:12",
    ]);
    let keys = node.dir.path().join("keys");
    std::fs::write(&keys, format!("{KEY}\n")).expect("write the keys");
    node.start_daemon(&[
        "--api".as_ref(),
        "127.0.0.1:0".as_ref(),
        "--api-keys".as_ref(),
        keys.as_os_str(),
    ]);
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
    let mut tti = Command::new(VENV_PYTHON);
    tti.arg(repo.join("bench/e2b/tti.py"));
    if !bench::full_run() {
        // The smoke run: a few sandboxes each way, unless the environment sets the sizes.
        for (k, v) in [
            ("STRATA_BENCH_TTI_N", "5"),
            ("STRATA_BENCH_TTI_CONCURRENCY", "4"),
            ("STRATA_BENCH_TTI_CONCURRENT_N", "8"),
        ] {
            if std::env::var_os(k).is_none() {
                tti.env(k, v);
            }
        }
    }
    let status = tti
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
