//! Suspend and resume of a sandbox with memory of every kind: resident memory before and
//! after (anonymous, file; with and without swap), suspend and resume times, the time from
//! the resume request to the first output of an exec, and what was prefetched. A scenario
//! harness (`harness = false`): it prints a markdown table; nothing is asserted on timing.
//!
//! The sandbox (`base/debian:12`, the tree of `scripts/debian-base.sh`): a process holding
//! `STRATA_BENCH_SUSPEND_ANON_MB` (default 256) of its own memory (perl), the base layer's
//! 50 MB apt package list read and held open, 64 MB written to its upper and held open, and
//! the libraries its processes map. Each case runs `STRATA_BENCH_SUSPEND_RUNS` (3) times on a
//! fresh sandbox. With swap: a swap file of the bench's own (`/var/tmp`, 2 GiB), removed at
//! the end however the bench ends.
//!
//! Smoke run without `--bench` (as `cargo test --benches` runs it in CI): 32 MiB of anon, one
//! run. `cargo build --release --bin strata && cargo bench -p bench --bench suspend`. Needs root,
//! runc; removes everything it started (`bench::node::LocalNode`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use bench::node::{debian_tree, LocalNode};

const BASE: &str = "base/debian:12";
const BIG: &str =
    "/var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages";

struct Swap(PathBuf);

impl Swap {
    fn add(dir: &Path) -> Option<Swap> {
        let p = dir.join("swapfile");
        let s = Swap(p.clone());
        let path = p.display();
        let ok = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "dd if=/dev/zero of={path} bs=1M count=2048 status=none && chmod 600 {path} && \
                 mkswap {path} >/dev/null && swapon {path}"
            ))
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(s)
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.0).status();
        let _ = std::fs::remove_file(&self.0);
    }
}

fn mb(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or(0.0) / (1 << 20) as f64
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    assert!(rustix::process::geteuid().is_root(), "suspend needs root");
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let full = bench::full_run();
    let anon_mb = env("STRATA_BENCH_SUSPEND_ANON_MB", if full { 256 } else { 32 });
    let runs = env("STRATA_BENCH_SUSPEND_RUNS", if full { 3 } else { 1 });
    let mut node = LocalNode::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "strata-bench-suspend",
    );
    node.ok(&[
        "layer",
        "build",
        &debian_tree().to_string_lossy(),
        "--name",
        BASE,
    ]);
    node.start_daemon(&[]);
    println!(
        "suspend: a sandbox with {anon_mb} MiB of its own memory (perl), a 50 MB layer file and \
         a 64 MB upper file open, {runs} runs per case"
    );
    println!();
    println!(
        "| swap | usage before → after | anon before → after | file before → after | suspend (record / reclaim) | resume (chunks / pages / thaw) | resume → first output | prefetched: chunks / pages / swap-in |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut swap = None;
    for with_swap in [false, true] {
        if with_swap {
            swap = Swap::add(node.dir.path());
            if swap.is_none() {
                println!("| yes | swap file refused here: not measured | | | | | | |");
                break;
            }
        }
        for run in 0..runs {
            let id = format!("s{}{run}", u8::from(with_swap));
            node.ok(&["sandbox", "create", "--layer", BASE, "--id", &id]);
            // Half of the string's bytes are perl's temporary: `x` builds it, `=` copies it.
            let half = anon_mb / 2;
            node.ok(&[
                "sandbox",
                "exec",
                &id,
                "--",
                "sh",
                "-c",
                &format!(
                    "head -c 67108864 /dev/urandom > /root/up && \
                     nohup perl -e 'open(my $a, \"<\", \"{BIG}\") or die; \
                     open(my $b, \"<\", \"/root/up\") or die; local $/; my $r = <$a>; \
                     my $x = \"a\" x ({half}<<20); while (1) {{ sleep 1 }}' \
                     > /dev/null 2>&1 & sleep 3; echo ok"
                ),
            ]);
            let s = node.json(&["sandbox", "suspend", &id]);
            let t = Instant::now();
            let r = node.json(&["sandbox", "resume", &id]);
            let out = node.ok(&["sandbox", "exec", &id, "--", "echo", "ok"]);
            let first_ms = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(out, "ok\n");
            let (b, a, p) = (&s["before"], &s["after"], &r["prefetch"]);
            println!(
                "| {} | {:.1} → {:.1} MiB ({:.1}%) | {:.1} → {:.1} MiB | {:.1} → {:.1} MiB | {} ms ({} / {}) | {} ms ({} / {} / {}) | {first_ms:.0} ms | {:.1} / {:.1} / {:.1} MiB |",
                if with_swap { "yes" } else { "no" },
                mb(&b["usage"]),
                mb(&a["usage"]),
                100.0 * a["usage"].as_f64().unwrap_or(0.0) / b["usage"].as_f64().unwrap_or(1.0),
                mb(&b["anon"]),
                mb(&a["anon"]),
                mb(&b["file"]),
                mb(&a["file"]),
                s["suspend_ms"],
                s["record_ms"],
                s["reclaim_ms"],
                p["resume_ms"],
                p["chunks_ms"],
                p["pages_ms"],
                p["thaw_ms"],
                mb(&p["chunk_bytes"]),
                mb(&p["page_bytes"]),
                mb(&p["swapin_bytes"]),
            );
            node.ok(&["sandbox", "rm", &id]);
        }
    }
    drop(swap);
}
