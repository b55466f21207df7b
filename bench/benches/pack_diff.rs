//! `pack-diff` against the size of the upper, on one ~1 GB stack, next to the full-tree ways
//! of snapshotting the same sandbox, measured in the same run: a layer built from the whole
//! merged root (`strata layer build ROOTFS`, the same builder without a diff), and `tar -c`
//! of the merged root (what an export or a `docker commit` on a non-overlay driver reads).
//! A scenario harness (`harness = false`): it prints a markdown table; nothing is asserted on
//! timing.
//!
//! Set-up, never timed: a local store under the bench directory with `base/debian:12` (the
//! tree of `scripts/debian-base.sh`) and `toolkit/bulk:1` (`STRATA_BENCH_PACK_BULK_MB`, 800,
//! of pseudo-random 1 MiB files under `/opt/bulk`); a daemon on a fresh run directory. Per
//! upper size (`STRATA_BENCH_PACK_MB`, `1,10,100,1000`): a sandbox on the two layers writes
//! that many MB of random data under `/srv/data` (1 MiB files) and appends a line to 16 files
//! of the stack (copy-ups), `sync`; one untimed `tar` of its merged root warms the lower;
//! then, timed: `strata pack-diff` (its own figures: frozen, walk, build, push), the full
//! layer build, the `tar`. With `STRATA_BENCH_PACK_COLD=1` the page cache is dropped before
//! each timed step.
//!
//! Binaries: `strata` beside the bench executable's directory (`target/release/strata`, after
//! `cargo build --release --bin strata`) or `STRATA_BIN`; `runc`, `tar`. Needs root.
//! Everything it started is removed when it ends (also on a panic; `bench::node::LocalNode`).
//! Smoke run without `--bench` (as `cargo test --benches` runs it in CI): 1 and 10 MB, bulk
//! 8 MB. `cargo bench -p bench --bench pack_diff`.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use bench::node::{debian_tree, LocalNode};

const STACK: [&str; 2] = ["base/debian:12", "toolkit/bulk:1"];

fn env_list(name: &str, default: &str) -> Vec<u64> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

fn drop_caches() {
    let _ = Command::new("sync").status();
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3\n");
}

/// Milliseconds `f` took.
fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

fn tar_all(root: &Path) -> u64 {
    let mut tar = Command::new("tar")
        .args(["-cf", "-", "--one-file-system", "-C"])
        .arg(root)
        .arg(".")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run tar");
    let mut out = tar.stdout.take().expect("tar's output");
    let n = std::io::copy(&mut out, &mut std::io::sink()).expect("read tar's output");
    let _ = tar.wait();
    n
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    assert!(rustix::process::geteuid().is_root(), "pack_diff needs root");
    let full = bench::full_run();
    let sizes = env_list(
        "STRATA_BENCH_PACK_MB",
        if full { "1,10,100,1000" } else { "1,10" },
    );
    let bulk_mb = env_list("STRATA_BENCH_PACK_BULK_MB", if full { "800" } else { "8" })
        .first()
        .copied()
        .unwrap_or(800);
    let cold = std::env::var("STRATA_BENCH_PACK_COLD").as_deref() == Ok("1");
    let mut node = LocalNode::new(Path::new(env!("CARGO_TARGET_TMPDIR")), "strata-bench-pack");
    let base = debian_tree();
    node.ok(&[
        "layer",
        "build",
        &base.to_string_lossy(),
        "--name",
        STACK[0],
    ]);
    {
        let bulk = node.dir.path().join("bulk");
        let files = bulk.join("opt/bulk");
        std::fs::create_dir_all(&files).expect("mkdir bulk");
        let mut buf = vec![0u8; 1 << 20];
        for i in 0..bulk_mb {
            bench::fill_pseudo_random(&mut buf, i + 1);
            std::fs::write(files.join(format!("f{i:05}")), &buf).expect("write bulk");
        }
        node.ok(&[
            "layer",
            "build",
            &bulk.to_string_lossy(),
            "--name",
            STACK[1],
        ]);
        std::fs::remove_dir_all(&bulk).expect("remove the bulk tree");
    }
    node.start_daemon(&[]);
    let stack_mb = {
        let mut total = 0u64;
        for l in STACK {
            let m = node.json(&["layer", "inspect", l]);
            total += m["blobs"][0]["size"].as_u64().unwrap_or(0);
        }
        total as f64 / 1e6
    };
    println!(
        "pack_diff: strata {}, stack {} ({stack_mb:.0} MB of file data), {} CPUs, page cache {}",
        node.bin.display(),
        STACK.join(" + "),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        if cold {
            "dropped before each step"
        } else {
            "warm"
        }
    );
    println!();
    println!(
        "| upper | pack-diff | frozen | walk / build / push | full layer of the merged root | tar of the merged root | full layer / pack |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (i, mb) in sizes.iter().enumerate() {
        let id = format!("pack{i}");
        node.ok(&[
            "sandbox", "create", "--layer", STACK[0], "--layer", STACK[1], "--id", &id,
        ]);
        node.ok(&[
            "sandbox",
            "exec",
            &id,
            "--timeout",
            "600",
            "--",
            "sh",
            "-c",
            &format!(
                "set -e; mkdir -p /srv/data; i=0; while [ $i -lt {mb} ]; do \
                 head -c 1048576 /dev/urandom > /srv/data/f$i; i=$((i+1)); done; \
                 for f in $(ls /usr/share/doc | head -16); do \
                 echo x >> /usr/share/doc/$f/copyright || true; done; sync"
            ),
        ]);
        let rootfs = node.json(&["sandbox", "inspect", &id])["rootfs"]
            .as_str()
            .expect("rootfs")
            .to_owned();
        let tree_bytes = tar_all(Path::new(&rootfs));
        if cold {
            drop_caches();
        }
        let mut pack = serde_json::Value::Null;
        let pack_ms = timed(|| {
            pack = node.json(&["pack-diff", &id, "--name", &format!("snapshot/pack{i}:1")]);
        });
        if cold {
            drop_caches();
        }
        let full_ms = timed(|| {
            node.ok(&[
                "layer",
                "build",
                &rootfs,
                "--name",
                &format!("snapshot/full{i}:1"),
            ]);
        });
        if cold {
            drop_caches();
        }
        let tar_ms = timed(|| {
            tar_all(Path::new(&rootfs));
        });
        println!(
            "| {mb} MB ({} files, {:.0} MB packed) | {pack_ms:.0} ms | {} ms | {} / {} / {} ms | {full_ms:.0} ms ({:.0} MB) | {tar_ms:.0} ms | {:.1}× |",
            pack["packed_files"],
            pack["packed_bytes"].as_f64().unwrap_or(0.0) / 1e6,
            pack["frozen_ms"],
            pack["walk_ms"],
            pack["build_ms"],
            pack["push_ms"],
            tree_bytes as f64 / 1e6,
            full_ms / pack_ms,
        );
        let _ = std::io::stdout().flush();
        node.ok(&["sandbox", "rm", &id]);
    }
}
