//! CPU QoS: a latency-sensitive step loop in one sandbox while best-effort sandboxes load the
//! CPUs, measured as DSec did — step-latency inflation unprotected, with CPU weights alone,
//! and with `--class be` (SCHED_IDLE + the lowest weight). A scenario harness
//! (`harness = false`): it prints a markdown table; nothing is asserted on timing.
//!
//! The workload is `bench/qos/step.c`, built static (`cc -O2 -static`) into a layer
//! `toolkit/qos:1` stacked on `base/debian:12`. The latency-sensitive sandbox runs `step run`:
//! a fixed step (calibrated to ~1 ms alone) due every 4 ms, each timed from its due time to its
//! end (wake-up delay + the step). The load: one best-effort sandbox per CPU, each running
//! `step burn DUTY` (busy DUTY% of every 10 ms): 50% and 100% of the node's CPUs. Modes:
//! - `unprotected`: the load's sandboxes are created like the measured one;
//! - `weights`: the same, then their cgroup's `cpu.shares` set to 2 (v1; `cpu.weight` 1 on v2);
//! - `be`: created with `--class be` (SCHED_IDLE, inherited; `cpu.shares` 2; `cpu.idle` 1).
//!
//! Core scheduling is used where the kernel has it (`sandbox-runtime/src/qos.rs`); the header
//! line says whether it does. `STRATA_BENCH_QOS_SECS` (default 8) per measurement.
//! Smoke run without `--bench` (as `cargo test --benches` runs it in CI): 1 s per row.
//! `cargo build --release --bin strata && cargo bench -p bench --bench qos`. Needs root and
//! runc; removes everything it started however it ends (`bench::node::LocalNode`).

use std::path::Path;
use std::process::Command;

use bench::node::{debian_tree, LocalNode};

const STACK: [&str; 2] = ["base/debian:12", "toolkit/qos:1"];

/// One measurement of the step loop: mean, p50, p99, max (µs).
#[derive(Clone, Copy, Debug)]
struct Steps {
    mean: f64,
    p50: f64,
    p99: f64,
    max: f64,
}

fn run_steps(node: &LocalNode, id: &str, iters: &str, secs: u64) -> Steps {
    let out = node.ok(&[
        "sandbox",
        "exec",
        id,
        "--timeout",
        &(secs + 60).to_string(),
        "--",
        "/opt/qos/step",
        "run",
        iters,
        "4000",
        &secs.to_string(),
    ]);
    let v: Vec<f64> = out
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    assert_eq!(v.len(), 5, "step run: {out}");
    Steps {
        mean: v[1],
        p50: v[2],
        p99: v[3],
        max: v[4],
    }
}

fn create(node: &LocalNode, id: &str, extra: &[&str]) {
    let mut args = vec![
        "sandbox", "create", "--layer", STACK[0], "--layer", STACK[1], "--id", id,
    ];
    args.extend_from_slice(extra);
    node.ok(&args);
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    assert!(rustix::process::geteuid().is_root(), "qos needs root");
    let secs: u64 = std::env::var("STRATA_BENCH_QOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if bench::full_run() { 8 } else { 1 });
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut node = LocalNode::new(Path::new(env!("CARGO_TARGET_TMPDIR")), "strata-bench-qos");
    let tool = node.dir.path().join("qos");
    std::fs::create_dir_all(tool.join("opt/qos")).expect("mkdir");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("qos/step.c");
    let st = Command::new("cc")
        .args(["-O2", "-static", "-o"])
        .arg(tool.join("opt/qos/step"))
        .arg(&src)
        .status()
        .expect("run cc");
    assert!(st.success(), "cc -static {}", src.display());
    node.ok(&[
        "layer",
        "build",
        &debian_tree().to_string_lossy(),
        "--name",
        STACK[0],
    ]);
    node.ok(&[
        "layer",
        "build",
        &tool.to_string_lossy(),
        "--name",
        STACK[1],
    ]);
    node.start_daemon(&[]);
    create(&node, "ls", &[]);
    let iters = node
        .ok(&["sandbox", "exec", "ls", "--", "/opt/qos/step", "calibrate"])
        .trim()
        .to_owned();
    let core_sched = sandbox_runtime::qos::core_sched_available();
    println!(
        "qos: {cpus} CPUs, step of {iters} iterations (~1 ms alone) due every 4 ms, {secs} s per \
         row, core scheduling: {}",
        if core_sched {
            "yes (a cookie per sandbox)"
        } else {
            "not in this kernel"
        }
    );
    println!();
    println!(
        "| load | mode | mean | p50 | p99 | max | alone just before: mean / p99 | mean inflation | p99 inflation |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for duty in [50, 100] {
        for mode in ["unprotected", "weights", "be"] {
            // Its own baseline, measured just before: the machine's noise drifts.
            let alone = run_steps(&node, "ls", &iters, secs);
            let ids: Vec<String> = (0..cpus).map(|i| format!("load{i}")).collect();
            for id in &ids {
                create(
                    &node,
                    id,
                    if mode == "be" {
                        &["--class", "be"]
                    } else {
                        &[]
                    },
                );
                if mode == "weights" {
                    let d = node.json(&["sandbox", "inspect", id]);
                    let cpu = d["cgroups"]["cpu"].as_str().expect("a cpu cgroup (v1)");
                    std::fs::write(Path::new(cpu).join("cpu.shares"), "2").expect("cpu.shares");
                }
                node.ok(&[
                    "sandbox",
                    "exec",
                    id,
                    "--detach",
                    "--",
                    "/opt/qos/step",
                    "burn",
                    &duty.to_string(),
                ]);
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
            let s = run_steps(&node, "ls", &iters, secs);
            println!(
                "| {duty}% | {mode} | {:.0} µs | {:.0} µs | {:.0} µs | {:.0} µs | {:.0} / {:.0} µs | {:+.1}% | {:+.1}% |",
                s.mean,
                s.p50,
                s.p99,
                s.max,
                alone.mean,
                alone.p99,
                (s.mean / alone.mean - 1.0) * 100.0,
                (s.p99 / alone.p99 - 1.0) * 100.0
            );
            for id in &ids {
                node.ok(&["sandbox", "rm", id]);
            }
        }
    }
}
