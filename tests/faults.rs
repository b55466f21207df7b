//! The fault campaign, through real components: moto behind our faulty HTTP proxy
//! (`bench::fault_proxy`), lazy layers built into that S3 store and mounted through the real
//! node daemon (kernel EROFS over its FUSE blob files), concurrent readers that compare every
//! byte with the source, and the daemon's `/metrics` scraped as the faults happen.
//!
//! Five layers: 0 and 1 take transient faults only; 2's blob answers 404, 3's 403, and 4 has
//! one chunk whose bytes are always flipped. Phases:
//! 1. transient faults (resets before headers and mid-body, truncated and stalled bodies,
//!    500/503/SlowDown, flipped bytes, latency and jitter) while readers read layers 0 and 1:
//!    every read succeeds with the right bytes, and the retries (by cause) and verify failures
//!    the metrics show match the faults the proxy injected;
//! 2. the same plus the permanent faults while readers read every layer: no wrong byte; reads
//!    fail only where a file needs a bad chunk (the meta image's data map says which), with
//!    EIO, within the documented bound (`ublk-daemon/docs/daemon.md`, "Failed reads"); the
//!    errors show up by kind in the metrics;
//! 3. the plan ends: every file of every layer reads correctly, without a remount, from the
//!    same daemon (no restart), and `strata status --json` gives the numbers `/metrics` gives.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench::campaign::{read_and_check, spawn_readers, Campaign, Outcome, Setup, Tally};
use bench::fault_proxy::FaultPlan;

const READERS: usize = 4;
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);
const DEADLINE: Duration = Duration::from_secs(15);

fn delta(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>, key: &str) -> f64 {
    after.get(key).copied().unwrap_or(0.0) - before.get(key).copied().unwrap_or(0.0)
}

fn run_phase(c: &Campaign, targets: Vec<(usize, usize)>, secs: u64, seed: u64) -> Arc<Tally> {
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let threads = spawn_readers(
        c,
        Arc::new(targets),
        READERS,
        seed,
        stop.clone(),
        tally.clone(),
    );
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    // A reader that does not come back within the bound of a failing read is a hang.
    let bound = 4 * DEADLINE + Duration::from_secs(15);
    let until = Instant::now() + bound;
    for t in threads {
        while !t.is_finished() {
            assert!(
                Instant::now() < until,
                "a reader hung for more than {bound:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        t.join().expect("a reader panicked");
    }
    tally
}

#[test]
fn faults_through_s3_proxy_fuse_and_erofs() {
    if !common::require_root("faults_through_s3_proxy_fuse_and_erofs") {
        return;
    }
    let tmp = std::env::temp_dir();
    let setup = Setup {
        layers: 5,
        files: 40,
        seed: 0x5eed_f417,
        attempt_timeout: ATTEMPT_TIMEOUT,
        deadline: DEADLINE,
        bin: Some(env!("CARGO_BIN_EXE_strata").into()),
    };
    let Some(c) = Campaign::start_or_skip(&tmp, &setup, "faults_through_s3_proxy_fuse_and_erofs")
    else {
        return;
    };
    let files = |l: usize| (0..c.layers[l].files.len()).map(move |f| (l, f));

    // Phase 1: transient faults only.
    let transient = FaultPlan::transient(
        0.03,
        ATTEMPT_TIMEOUT + Duration::from_secs(1),
        Duration::from_millis(1),
        Duration::from_millis(4),
    );
    let m0 = c.scrape().expect("scrape");
    let i0 = c.proxy.injected();
    c.proxy.set_plan(transient.clone());
    let tally = run_phase(&c, files(0).chain(files(1)).collect(), 30, 1);
    // Background fetches (readahead) may still be in flight when the readers are done, one of
    // them stalled, its retry not begun yet: count once nothing new was injected for longer
    // than an attempt's timeout (then every injected fault's retry has begun).
    let mut i1 = c.proxy.injected();
    for _ in 0..10 {
        std::thread::sleep(ATTEMPT_TIMEOUT + Duration::from_secs(1));
        let now = c.proxy.injected();
        if now == i1 {
            break;
        }
        i1 = now;
    }
    let m1 = c.scrape().expect("scrape");
    let inj = |k: &str| (i1[k] - i0[k]) as f64;
    eprintln!(
        "phase 1: {} reads ok, {} failed {:?}, {} wrong, longest {} ms; injected {:?}",
        tally.ok.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
        tally.errnos.lock().unwrap(),
        tally.wrong.load(Ordering::Relaxed),
        tally.longest_us.load(Ordering::Relaxed) / 1000,
        i1
    );
    for (k, v) in &m1 {
        if k.starts_with("strata_backend_retries")
            || k.starts_with("strata_cache_verify")
            || k.starts_with("strata_backend_errors")
        {
            eprintln!("  {k} {v} (+{})", delta(&m1, &m0, k));
        }
    }
    assert_eq!(tally.wrong.load(Ordering::Relaxed), 0, "wrong bytes");
    assert_eq!(
        tally.failed.load(Ordering::Relaxed),
        0,
        "transient faults must be absorbed: {:?}",
        tally.errnos.lock().unwrap()
    );
    assert!(tally.ok.load(Ordering::Relaxed) > 50, "too few reads");
    let retries = |cause: &str| {
        delta(
            &m1,
            &m0,
            &format!("strata_backend_retries_total{{cause=\"{cause}\"}}"),
        )
    };
    // Each injected fault makes the attempt it hit fail once, and the next attempt counts a
    // retry under the fault's cause.
    for (cause, faults) in [
        ("throttled", inj("slow_down") + inj("status_503")),
        ("server_error", inj("status_500")),
        ("connection", inj("reset_before_headers")),
        ("body", inj("reset_mid_body") + inj("truncate")),
        ("timeout", inj("stall")),
    ] {
        assert!(faults > 0.0, "the plan injected no fault for {cause}");
        assert_eq!(
            retries(cause),
            faults,
            "retries caused by {cause} against the faults injected"
        );
    }
    assert_eq!(retries("other"), 0.0, "retries of unknown cause");
    assert!(inj("flip") > 0.0);
    assert_eq!(
        delta(&m1, &m0, "strata_cache_verify_failures_total"),
        inj("flip"),
        "every flipped body is one verify failure"
    );
    assert_eq!(delta(&m1, &m0, "strata_cache_corrupt_errors_total"), 0.0);
    assert_eq!(delta(&m1, &m0, "strata_fuse_read_errors_total"), 0.0);
    let layer_bytes = |m: &BTreeMap<String, f64>, l: usize| {
        m.iter()
            .filter(|(k, _)| {
                k.starts_with("strata_layer_read_bytes_total")
                    && k.contains(&format!("ref=\"{}\"", c.layers[l].name))
            })
            .map(|(_, v)| *v)
            .sum::<f64>()
    };
    assert!(layer_bytes(&m1, 0) > 0.0 && layer_bytes(&m1, 1) > 0.0);
    assert_eq!(layer_bytes(&m1, 2), 0.0, "layer 2 was not read");

    // Phase 2: permanent faults on layers 2 (404), 3 (403) and one chunk of 4 (flipped).
    let layer4 = &c.layers[4];
    let all: BTreeSet<u64> = layer4.files.iter().flat_map(|f| f.chunks.clone()).collect();
    let all: Vec<u64> = all.into_iter().collect();
    assert!(all.len() >= 4, "layer 4 has too few chunks: {all:?}");
    let bad_chunk = all[all.len() / 2];
    let mut plan = transient.clone();
    plan.not_found = vec![c.layers[2].blob_key.clone()];
    plan.forbidden = vec![c.layers[3].blob_key.clone()];
    plan.corrupt = vec![(
        layer4.blob_key.clone(),
        bad_chunk * bench::campaign::CHUNK + 100,
    )];
    let must_fail = |l: usize, f: usize| {
        let chunks = &c.layers[l].files[f].chunks;
        match l {
            2 | 3 => !chunks.is_empty(),
            4 => chunks.contains(&bad_chunk),
            _ => false,
        }
    };
    c.proxy.set_plan(plan);
    let everything: Vec<(usize, usize)> = (0..5).flat_map(files).collect();
    let tally = run_phase(&c, everything.clone(), 20, 2);
    assert_eq!(tally.wrong.load(Ordering::Relaxed), 0, "wrong bytes");
    let failed = tally.failed_files.lock().unwrap().clone();
    for (l, f) in &failed {
        assert!(
            must_fail(*l, *f),
            "layer {l} file {:?} failed but needs no bad chunk",
            c.layers[*l].files[*f].rel
        );
    }
    let errnos = tally.errnos.lock().unwrap().clone();
    assert!(
        errnos.keys().all(|e| *e == libc::EIO),
        "failures other than EIO: {errnos:?}"
    );
    // One pass, file by file: exactly the files that need a bad chunk fail.
    let mut longest_failure = Duration::ZERO;
    let mut expected_failures = 0;
    for &(l, f) in &everything {
        let layer = &c.layers[l];
        let (o, took) = read_and_check(&layer.mnt, &layer.src, &layer.files[f].rel);
        if must_fail(l, f) {
            expected_failures += 1;
            assert_eq!(
                o,
                Outcome::Failed(libc::EIO),
                "layer {l} {:?}",
                layer.files[f].rel
            );
            longest_failure = longest_failure.max(took);
        } else {
            assert_eq!(o, Outcome::Ok, "layer {l} {:?}", layer.files[f].rel);
        }
    }
    assert!(expected_failures > 0);
    let longest_failure = longest_failure.max(Duration::from_micros(
        tally.longest_failure_us.load(Ordering::Relaxed),
    ));
    eprintln!(
        "phase 2: {} reads ok, {} failed ({} files), {} wrong; longest failing read {} ms",
        tally.ok.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
        failed.len(),
        tally.wrong.load(Ordering::Relaxed),
        longest_failure.as_millis()
    );
    // The documented bound: 2 × the retry deadline per FUSE request, and the kernel may send
    // a failed range twice (readahead, then the page itself).
    assert!(
        longest_failure < 4 * DEADLINE + Duration::from_secs(5),
        "a failing read took {longest_failure:?}"
    );
    let m2 = c.scrape().expect("scrape");
    for kind in ["not_found", "backend", "corrupt"] {
        assert!(
            delta(
                &m2,
                &m1,
                &format!("strata_backend_errors_total{{kind=\"{kind}\"}}")
            ) > 0.0,
            "no backend error of kind {kind} counted"
        );
    }
    let corrupt = delta(&m2, &m1, "strata_cache_corrupt_errors_total");
    assert!(corrupt > 0.0);
    assert!(
        delta(&m2, &m1, "strata_cache_verify_failures_total") >= 2.0 * corrupt,
        "a corrupt chunk is verified twice (fetch, refetch)"
    );
    assert!(delta(&m2, &m1, "strata_fuse_read_errors_total") > 0.0);
    assert!(c.daemon_alive(), "the daemon went away");

    // Phase 3: the plan ends; the same files read correctly without a remount.
    c.proxy.end_plan();
    for &(l, f) in &everything {
        let layer = &c.layers[l];
        let (o, _) = read_and_check(&layer.mnt, &layer.src, &layer.files[f].rel);
        assert_eq!(
            o,
            Outcome::Ok,
            "after the plan: layer {l} {:?}",
            layer.files[f].rel
        );
    }
    assert!(c.daemon_alive(), "the daemon went away");
    let status = c.status().expect("status");
    assert_eq!(status["node"]["restarts"], 0);
    // Quiet now: `strata status --json` and /metrics give the same numbers.
    let m = c.scrape().expect("scrape");
    let s = &status["cache"];
    let n = |v: &serde_json::Value| v.as_f64().unwrap_or(-1.0);
    let pairs = [
        ("strata_cache_misses_total", n(&s["misses"])),
        ("strata_cache_read_bytes_total", n(&s["bytes_read"])),
        ("strata_cache_fetched_bytes_total", n(&s["bytes_fetched"])),
        ("strata_backend_requests_total", n(&s["backend_requests"])),
        (
            "strata_cache_verify_failures_total",
            n(&s["verify_failures"]),
        ),
        ("strata_cache_corrupt_errors_total", n(&s["corrupt_errors"])),
        (
            "strata_cache_hits_total{level=\"memory\"}",
            n(&s["hits_memory"]),
        ),
        (
            "strata_cache_fetch_unit_misses_total{window=\"narrowed\"}",
            n(&s["fetch_unit_narrowed"]),
        ),
        (
            "strata_fuse_read_errors_total",
            n(&status["node"]["fuse_read_errors"]),
        ),
        (
            "strata_daemon_restarts_total",
            n(&status["node"]["restarts"]),
        ),
    ];
    for (k, want) in pairs {
        assert_eq!(
            m.get(k).copied(),
            Some(want),
            "{k}: /metrics against status"
        );
    }
    for (cause, v) in s["retries"].as_object().expect("retries") {
        let k = format!("strata_backend_retries_total{{cause=\"{cause}\"}}");
        assert_eq!(m.get(&k).copied(), Some(n(v)), "{k}");
    }
    for (kind, v) in s["backend_errors_by_kind"].as_object().expect("errors") {
        let k = format!("strata_backend_errors_total{{kind=\"{kind}\"}}");
        assert_eq!(m.get(&k).copied(), Some(n(v)), "{k}");
    }
}

/// Removes the sandboxes a test made (they outlive their daemon), however the test ends.
struct Sandboxes<'a> {
    node: &'a bench::node::LocalNode,
    ids: std::sync::Mutex<Vec<String>>,
}

impl Drop for Sandboxes<'_> {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut *self.ids.lock().unwrap_or_else(|p| p.into_inner()));
        for id in ids {
            let _ = self
                .node
                .cmd()
                .args(["sandbox", "rm", &id])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// A create whose stack waits on a stalled store gives its turn back
/// (`sandbox-runtime/src/manager.rs`, `TURN_KEPT_WHILE_MOUNTING`): more such creates than the
/// node composes at once, stalled on a layer's meta image, do not hold up a create of a stack
/// the node already has. Before, that create waited for the store's deadline.
#[test]
fn a_stalled_stack_holds_up_no_create_of_a_stack_already_here() {
    const NAME: &str = "a_stalled_stack_holds_up_no_create_of_a_stack_already_here";
    const STORE_DEADLINE: Duration = Duration::from_secs(30);
    if !common::runc_ready(NAME) {
        return;
    }
    let setup = Setup {
        layers: 1,
        files: 8,
        seed: 0x57a11,
        attempt_timeout: Duration::from_secs(2),
        deadline: STORE_DEADLINE,
        bin: Some(env!("CARGO_BIN_EXE_strata").into()),
    };
    let Some(c) = Campaign::start_or_skip(&std::env::temp_dir(), &setup, NAME) else {
        return;
    };
    // A second stack, in the store but not yet on the node.
    let src = c.node.dir.path().join("stalled-src");
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::write(src.join("etc/stalled"), "a layer behind a stalled store\n").unwrap();
    c.node.ok(&[
        "layer",
        "build",
        "--quiet",
        src.to_str().unwrap(),
        "--name",
        "base/stalled:1",
    ]);
    let sandboxes = Sandboxes {
        node: &c.node,
        ids: Default::default(),
    };
    let create = |id: &str, layer: &str| {
        sandboxes.ids.lock().unwrap().push(id.to_owned());
        c.node
            .cmd()
            .args(["sandbox", "create", "--layer", layer, "--id", id])
            .output()
            .unwrap()
    };
    let here = "base/faults0:1";
    let out = create("here-0", here);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Every ranged GET (the meta image's and the chunks') now waits longer than an attempt:
    // the stalled stack's activation retries until the store's deadline.
    c.proxy.set_plan(FaultPlan {
        latency: STORE_DEADLINE * 2,
        ..FaultPlan::default()
    });
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let stalled = 2 * cpus + 2;
    let took = std::thread::scope(|s| {
        let threads: Vec<_> = (0..stalled)
            .map(|i| {
                let create = &create;
                s.spawn(move || create(&format!("stalled-{i}"), "base/stalled:1"))
            })
            .collect();
        // Long enough for every stalled create to have taken a turn and begun its mount.
        std::thread::sleep(Duration::from_secs(3));
        let t = Instant::now();
        let out = create("here-1", here);
        let took = t.elapsed();
        let waiting = threads.iter().filter(|t| !t.is_finished()).count();
        c.proxy.end_plan();
        for t in threads {
            let _ = t.join();
        }
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            took < Duration::from_secs(10),
            "a create of a stack already here took {took:?} behind {stalled} stalled creates"
        );
        assert_eq!(
            waiting, stalled,
            "stalled creates ended before the check: the test tested nothing"
        );
        took
    });
    println!(
        "{NAME}: a create of a stack already here took {took:?} beside {stalled} stalled ones"
    );
}
