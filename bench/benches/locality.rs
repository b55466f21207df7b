//! Read locality over S3: bytes fetched per byte read, and the first command's latency on a
//! cold node, for a 10% read of a tree of many small files — in build order, with a recorded
//! access trace replayed as prefetch, and with the next version laid out in the trace's
//! order (`strata layer build --order-from`).
//!
//! A scenario harness (no criterion), run as root (mounts, drop_caches):
//!
//! ```sh
//! cargo build --release --bin strata
//! cargo bench -p bench --bench locality        # smoke: cargo test -p bench --bench locality
//! ```
//!
//! The store is S3 on moto (`moto_server` on `PATH`, started on 127.0.0.1, or
//! `STRATA_BENCH_S3_ENDPOINT`), behind the fault proxy (`bench::fault_proxy`) adding
//! `STRATA_LOCALITY_LATENCY_MS` (default 2) to every ranged GET: a network store's round trip,
//! which a local moto lacks. The tree: `STRATA_LOCALITY_TREE`, default the Debian minbase
//! root's `usr/share` (3,232 files, 45 MB; the smoke run takes its `doc`). The first command
//! reads every 10th regular file (breadth-first name order, one thread, whole files); "set B"
//! is every 10th file from the 5th, a workload the trace did not see.
//!
//! For each of `--compress none` and `zstd`, every step on a fresh node (its own caches, the
//! page cache dropped):
//! 1. **build order**: v1 as built; the node records v1's trace (window
//!    `STRATA_LOCALITY_WINDOW_S`, default 15 s as the daemon's; it must cover the read) while it reads set A;
//! 2. **trace prefetch**: a new node mounts v1 (replaying the trace from the mount on) and
//!    reads set A at once;
//! 3. **trace order**: v2 = the same tree built `--order-from` v1, read (set A) by a node with
//!    traces off;
//! 4. **trace order, set B**: v2 read (set B) by a node with traces off.
//!
//! Per step: the mount's wall time, the read's wall time, bytes read by the command (file
//! sizes), bytes the node fetched from the store (its cache's `bytes_fetched`, compressed
//! bytes for zstd), their ratio, the layer's meta image as stored (fetched whole by the
//! mount: with small files inline in it, `--inline-max`, part of what a read gets) and
//! (fetched + meta) / read, the plain-equivalent ratio (plain bytes of the chunks fetched /
//! bytes read), the chunks fetched, the backend requests, and the demand misses that widened
//! to the fetch unit or did not (`fs-cache/src/chunk/window.rs`). `STRATA_TAIL_CHUNK_SIZE` (the layers' tails
//! blob chunk size) and `STRATA_CACHE_FETCH_UNIT` (the nodes' fetch unit) are passed on to
//! `strata`. Figures: `bench/README.md`, "locality".

use std::collections::VecDeque;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bench::fault_proxy::{FaultPlan, FaultProxy};
use bench::node::LocalNode;

const BUCKET: &str = "strata-bench";

fn drop_caches() {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").expect("drop the page cache");
}

/// Regular files under `root`, breadth-first in name order, with their sizes.
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

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Row {
    compress: &'static str,
    step: &'static str,
    mount_s: f64,
    read_s: f64,
    read_bytes: u64,
    fetched: u64,
    chunks: u64,
    plain: u64,
    trace_chunks: u64,
    /// Backend requests.
    requests: u64,
    /// Demand misses that widened to the fetch unit, and that did not (`window.rs`).
    widened: u64,
    narrowed: u64,
    /// The layer's meta image as stored (fetched whole by the mount, not in `fetched`).
    meta: u64,
}

/// Wait until `log` contains `line` (a daemon's log), at most `secs`.
fn wait_log(log: &Path, line: &str, secs: u64) -> bool {
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        if std::fs::read_to_string(log).is_ok_and(|t| t.contains(line)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// One step on a fresh node: start its daemon (`window` seconds of trace, 0: off), mount
/// `layer`, read `set` (whole files, in order), take its cache's counters.
#[allow(clippy::too_many_arguments)]
fn step(
    tmp: &Path,
    store: &str,
    layer: &str,
    window: u64,
    set: &[(PathBuf, u64)],
    tree: &Path,
    wait_for: Option<&str>,
    label: (&'static str, &'static str),
) -> Row {
    let mut node = LocalNode::new(tmp, "locality-");
    node.share_store(store);
    let w = window.to_string();
    node.start_daemon(&["--trace-window".as_ref(), w.as_ref()]);
    let mnt = node.dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    drop_caches();
    let t0 = Instant::now();
    node.ok(&["mount", layer, mnt.to_str().unwrap()]);
    let mount_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut read_bytes = 0u64;
    for (rel, _) in set {
        let got = std::fs::read(mnt.join(rel)).expect("read a file of the layer");
        read_bytes += got.len() as u64;
    }
    let read_s = t1.elapsed().as_secs_f64();
    // Check what was read against the tree (outside the timing).
    for (rel, _) in set.iter().step_by(7) {
        assert!(
            std::fs::read(mnt.join(rel)).unwrap() == std::fs::read(tree.join(rel)).unwrap(),
            "{} differs",
            rel.display()
        );
    }
    let log = node.dir.path().join("daemon.log");
    if let Some(line) = wait_for {
        assert!(
            wait_log(&log, line, window + 60),
            "no {line:?} in {}",
            log.display()
        );
    }
    let cache = node.json(&["status"])["cache"].clone();
    let g = |k: &str| cache[k].as_u64().unwrap_or(0);
    node.ok(&["umount", mnt.to_str().unwrap()]);
    Row {
        compress: label.0,
        step: label.1,
        mount_s,
        read_s,
        read_bytes,
        fetched: g("bytes_fetched"),
        chunks: g("misses") + g("trace_chunks") + g("readahead_chunks") + g("prefetch_chunks"),
        // Every fetched chunk is in level 1 (256 MiB, far more than a run fetches): the
        // plain bytes fetched, whatever the chunk sizes.
        plain: g("memory_bytes"),
        trace_chunks: g("trace_chunks"),
        requests: g("backend_requests"),
        widened: g("fetch_unit_widened"),
        narrowed: g("fetch_unit_narrowed"),
        meta: 0,
    }
}

fn main() {
    if !rustix::process::geteuid().is_root() {
        println!("SKIPPED locality: needs root (mounts, drop_caches)");
        return;
    }
    for (name, value) in [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
    ] {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    // The daemons log when a trace is stored or replayed (the steps wait for those lines).
    std::env::set_var("STRATA_LOG", "warn,ublk_daemon::node::trace=info");
    let full = bench::full_run();
    let tree = match std::env::var_os("STRATA_LOCALITY_TREE") {
        Some(t) => PathBuf::from(t),
        None if full => bench::node::debian_tree().join("usr/share"),
        None => bench::node::debian_tree().join("usr/share/doc"),
    };
    let latency = env_u64("STRATA_LOCALITY_LATENCY_MS", 2);
    let window = env_u64("STRATA_LOCALITY_WINDOW_S", if full { 15 } else { 1 });
    let s3 = match bench::S3Server::start() {
        Ok(Some(s)) => s,
        Ok(None) => {
            println!("SKIPPED locality: no moto_server on PATH and no STRATA_BENCH_S3_ENDPOINT");
            return;
        }
        Err(e) => panic!("start moto: {e}"),
    };
    bench::create_bucket(s3.endpoint(), BUCKET).expect("create the bucket");
    let proxy = FaultProxy::start(s3.endpoint(), 1).expect("start the proxy");
    proxy.set_plan(FaultPlan {
        latency: Duration::from_millis(latency),
        ..FaultPlan::default()
    });
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let files = files_bfs(&tree);
    let set_a: Vec<_> = files.iter().step_by(10).cloned().collect();
    let set_b: Vec<_> = files.iter().skip(5).step_by(10).cloned().collect();
    let total: u64 = files.iter().map(|f| f.1).sum();
    println!(
        "locality: {} ({} files, {:.1} MB); set A {} files {:.1} MB, set B {} files {:.1} MB; \
         +{latency} ms per ranged GET; trace window {window} s",
        tree.display(),
        files.len(),
        total as f64 / 1e6,
        set_a.len(),
        set_a.iter().map(|f| f.1).sum::<u64>() as f64 / 1e6,
        set_b.len(),
        set_b.iter().map(|f| f.1).sum::<u64>() as f64 / 1e6,
    );
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut rows = Vec::new();
    for compress in ["none", "zstd"] {
        let store = format!(
            "s3://{BUCKET}/locality-{}-{nanos}-{compress}?endpoint={}&region=us-east-1",
            std::process::id(),
            proxy.endpoint()
        );
        let builder = {
            let mut n = LocalNode::new(tmp, "locality-build-");
            n.share_store(&store);
            n
        };
        let t = tree.to_str().unwrap();
        let v1 = builder.json(&[
            "layer",
            "build",
            t,
            "--name",
            "base/loc:1",
            "--compress",
            compress,
        ]);
        let meta = |v: &serde_json::Value| v["meta_stored_bytes"].as_u64().unwrap_or(0);
        let (m1, first) = (meta(&v1), rows.len());
        println!(
            "v1 ({compress}): meta image {} bytes stored, {} files inline in it",
            m1, v1["inline_files"]
        );
        let label = |s| (compress, s);
        rows.push(step(
            tmp,
            &store,
            "base/loc:1",
            window,
            &set_a,
            &tree,
            Some("stored the layer's access trace"),
            label("build order (records the trace)"),
        ));
        rows.push(step(
            tmp,
            &store,
            "base/loc:1",
            window,
            &set_a,
            &tree,
            Some("replayed the layer's access trace"),
            label("trace prefetch"),
        ));
        let v2 = builder.json(&[
            "layer",
            "build",
            t,
            "--name",
            "base/loc:2",
            "--compress",
            compress,
            "--no-dedup",
            "--order-from",
            "base/loc:1",
        ]);
        println!(
            "v2 ({compress}): {} files laid out in trace order",
            v2["ordered_files"]
        );
        let (m2, second) = (meta(&v2), rows.len());
        rows.push(step(
            tmp,
            &store,
            "base/loc:2",
            0,
            &set_a,
            &tree,
            None,
            label("trace order"),
        ));
        rows.push(step(
            tmp,
            &store,
            "base/loc:2",
            0,
            &set_b,
            &tree,
            None,
            label("trace order, set B"),
        ));
        rows.push(step(
            tmp,
            &store,
            "base/loc:1",
            0,
            &set_b,
            &tree,
            None,
            label("build order, set B"),
        ));
        for (i, r) in rows.iter_mut().enumerate().skip(first) {
            r.meta = if (second..second + 2).contains(&i) {
                m2
            } else {
                m1
            };
        }
    }
    println!();
    println!(
        "tails blob chunk size (STRATA_TAIL_CHUNK_SIZE): {}; fetch unit (STRATA_CACHE_FETCH_UNIT): {}",
        std::env::var("STRATA_TAIL_CHUNK_SIZE").unwrap_or_else(|_| "default (16384)".into()),
        std::env::var("STRATA_CACHE_FETCH_UNIT").unwrap_or_else(|_| "default (256KiB on S3)".into())
    );
    println!(
        "inline files (STRATA_INLINE_MAX): {}",
        std::env::var("STRATA_INLINE_MAX").unwrap_or_else(|_| "default".into())
    );
    println!("| compress | step | mount s | first command s | read MB | fetched MB | fetched / read | meta MB | (fetched + meta) / read | plain fetched / read | chunks fetched | trace chunks | requests | misses widened / narrowed |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        let read = r.read_bytes.max(1) as f64;
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} / {} |",
            r.compress,
            r.step,
            r.mount_s,
            r.read_s,
            r.read_bytes as f64 / 1e6,
            r.fetched as f64 / 1e6,
            r.fetched as f64 / read,
            r.meta as f64 / 1e6,
            (r.fetched + r.meta) as f64 / read,
            r.plain as f64 / read,
            r.chunks,
            r.trace_chunks,
            r.requests,
            r.widened,
            r.narrowed
        );
    }
}
