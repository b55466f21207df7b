//! A burst through the cluster front: `STRATA_BENCH_CLUSTER_NODES` (4) node daemons on this
//! machine (each its own home, cache, run directory, runc root, cgroup parent and node name;
//! one shared POSIX store) behind `STRATA_BENCH_CLUSTER_FRONTS` (2) fronts (`strata api`),
//! and `STRATA_BENCH_CLUSTER_N` (512) sandboxes created at once by the unmodified async
//! `e2b` SDK, alternately through each front (`tests/e2b/cluster.py burst`, the test's own
//! client). Prints creations/s over the whole burst and the client-measured create latency
//! (p50/p99/max), then each node's share (count and reserved memory: max/mean). A scenario
//! harness (`harness = false`): nothing is asserted on timing.
//!
//! Set-up, never timed: the Debian tree of `scripts/debian-base.sh` as one layer in the
//! shared store, each node's template `base` of it with a 64 MiB memory limit, no warm pool
//! (every create composes a root and starts runc). Each node's first create mounts the layer.
//!
//! Binaries: `strata` beside the bench executable's directory (`target/release/strata`) or
//! `STRATA_BIN`; `runc` on `PATH`. Needs root. Everything it started is removed when it ends
//! (also on a panic). `cargo bench -p bench --bench e2b_cluster`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bench::node::{debian_tree, LocalNode};

const VENV_PYTHON: &str = "/usr/local/lib/strata/e2b/bin/python";
const KEY: &str = "bench-key";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn wait_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.trim().is_empty() {
                return s.trim().to_owned();
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The fronts, killed when the bench ends.
struct Fronts(Vec<Child>);

impl Drop for Fronts {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A node whose cgroup parent is removed after it (its `LocalNode` removes the rest).
struct Node(Option<LocalNode>, String);

impl Node {
    fn get(&self) -> &LocalNode {
        self.0.as_ref().expect("the node")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // The sandboxes first (LocalNode's drop), then the node's empty cgroup parent.
        drop(self.0.take());
        for (_, dir) in sandbox_runtime::cgroup::of_path(&format!("/strata-{}", self.1)) {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    assert!(
        rustix::process::geteuid().is_root(),
        "e2b_cluster needs root"
    );
    assert!(
        Path::new(VENV_PYTHON).exists(),
        "no {VENV_PYTHON}: scripts/install-test-deps.sh installs the e2b SDK"
    );
    let n_nodes = env_usize("STRATA_BENCH_CLUSTER_NODES", 4);
    let n_fronts = env_usize("STRATA_BENCH_CLUSTER_FRONTS", 2);
    // The smoke run (without `--bench`, as CI's `cargo test --bench '*'` runs it): 32.
    let n = env_usize(
        "STRATA_BENCH_CLUSTER_N",
        if bench::full_run() { 512 } else { 32 },
    );
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository");
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let base = debian_tree();
    let mut nodes: Vec<Node> = Vec::new();
    for i in 0..n_nodes {
        let name = format!("c{i}");
        let mut node = LocalNode::new(tmp, &format!("strata-bench-cluster-{name}-"));
        if let Some(first) = nodes.first() {
            node.share_store(&first.get().store);
        } else {
            node.ok(&[
                "layer",
                "build",
                &base.to_string_lossy(),
                "--name",
                "base/debian:12",
            ]);
        }
        let keys = node.dir.path().join("keys");
        std::fs::write(&keys, format!("{KEY}\n")).expect("write the keys");
        node.start_daemon(&[
            "--api".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--api-keys".as_ref(),
            keys.as_os_str(),
            "--node-name".as_ref(),
            name.as_ref(),
        ]);
        node.ok(&[
            "template",
            "set",
            "base",
            "--layer",
            "base/debian:12",
            "--memory",
            &(64u64 << 20).to_string(),
        ]);
        nodes.push(Node(Some(node), name));
    }
    let urls: Vec<String> = nodes
        .iter()
        .map(|n| {
            format!(
                "http://{}",
                wait_file(&n.get().dir.path().join("run/api.addr"))
            )
        })
        .collect();
    let keys = nodes[0].get().dir.path().join("keys");
    let mut fronts = Fronts(Vec::new());
    let mut front_urls = Vec::new();
    for i in 0..n_fronts {
        let addr_file = nodes[0].get().dir.path().join(format!("front{i}.addr"));
        let log = std::fs::File::create(nodes[0].get().dir.path().join(format!("front{i}.log")))
            .expect("the front's log");
        let mut c = Command::new(&nodes[0].get().bin);
        c.args(["api", "--listen", "127.0.0.1:0", "--api-keys"])
            .arg(&keys)
            .args(["--fronts", &n_fronts.to_string()])
            .arg("--addr-file")
            .arg(&addr_file)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log);
        for u in &urls {
            c.args(["--node", u]);
        }
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        fronts.0.push(c.spawn().expect("start a front"));
        front_urls.push(format!("http://{}", wait_file(&addr_file)));
    }
    println!(
        "e2b_cluster: strata {}, {n_nodes} nodes, {n_fronts} fronts, {n} sandboxes, {} CPUs",
        nodes[0].get().bin.display(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let ids = nodes[0].get().dir.path().join("ids.json");
    let out = Command::new(VENV_PYTHON)
        .arg(repo.join("tests/e2b/cluster.py"))
        .args(["burst", &n.to_string()])
        .arg(&ids)
        .env("E2B_API_KEY", KEY)
        .env("STRATA_TEMPLATE", "base")
        .env("STRATA_FRONTS", front_urls.join(","))
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_API_URL")
        .env_remove("E2B_SANDBOX_URL")
        .stderr(Stdio::inherit())
        .output()
        .expect("run tests/e2b/cluster.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the burst failed:\n{stdout}");
    let stats = stdout
        .lines()
        .find_map(|l| l.strip_prefix("STATS "))
        .expect("the script's STATS line");
    let s: serde_json::Value = serde_json::from_str(stats).expect("STATS is JSON");
    let mut counts = Vec::new();
    for n in &nodes {
        counts.push(
            n.get()
                .json(&["sandbox", "ls"])
                .as_array()
                .map_or(0, Vec::len) as f64,
        );
    }
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let max = counts.iter().cloned().fold(0.0, f64::max);
    println!("| nodes | fronts | sandboxes | wall s | creations/s | create p50 ms | p99 ms | max ms | per node | max/mean |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {n_nodes} | {n_fronts} | {} | {} | **{}** | {} | {} | {} | {:?} | {:.3} |",
        s["n"],
        s["wall_s"],
        s["creations_per_s"],
        s["p50_ms"],
        s["p99_ms"],
        s["max_ms"],
        counts,
        max / mean
    );
    drop(fronts);
}
