//! The fault soak: the fault campaign of `tests/faults.rs` for a long time (a harness bench).
//!
//! ```sh
//! cargo build --release --bin strata
//! sudo -E cargo bench -p bench --bench fault_soak            # 30 min, 16 readers
//! STRATA_SOAK_SMOKE=1 cargo bench -p bench --bench fault_soak  # 60 s, 4 readers
//! STRATA_SOAK_SECS=600 STRATA_SOAK_READERS=8 cargo bench -p bench --bench fault_soak
//! ```
//!
//! Six layers are built into moto behind the faulty proxy (`bench::fault_proxy`) and mounted
//! through one daemon (`--backend-attempt-timeout 3s --backend-deadline 15s`, 2 MiB of memory
//! and 4 MiB of disk cache, so that reads keep reaching the backend). Transient faults of
//! every kind run all the time (3% each, stalls 0.6%, 1-5 ms latency); permanent ones come and
//! go in cycles of 60 s on, 30 s off: layer 4's blob answers 404, layer 5's 403, and one chunk
//! of layer 3 is always flipped. Readers read random files of every layer and compare every
//! byte. Reported: reads served, reads failed (expected: the file needs a bad chunk while the
//! permanent faults are on; unexpected: anything else) by errno, wrong bytes (must be 0),
//! retries by cause and errors by kind from `/metrics`, the longest read (stall), daemon
//! restarts (must be 0). Fails if a byte was wrong, a read failed unexpectedly, a reader hung,
//! or the daemon restarted.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bench::campaign::{read_and_check, Campaign, Outcome, Setup, CHUNK};
use bench::fault_proxy::FaultPlan;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    wrong: AtomicU64,
    expected_failures: AtomicU64,
    unexpected_failures: AtomicU64,
    longest_us: AtomicU64,
    errnos: Mutex<BTreeMap<i32, u64>>,
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this too: only smoke then.
    let smoke = std::env::var_os("STRATA_SOAK_SMOKE").is_some()
        || !std::env::args().any(|a| a == "--bench");
    let secs = env_u64("STRATA_SOAK_SECS", if smoke { 60 } else { 1800 });
    let readers = env_u64("STRATA_SOAK_READERS", if smoke { 4 } else { 16 }) as usize;
    if !rustix::process::geteuid().is_root() {
        eprintln!("\n*** SKIPPED fault_soak: needs root (mounts) ***\n");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "fault_soak needs root under CI"
        );
        return;
    }
    let setup = Setup {
        layers: 6,
        files: 40,
        seed: env_u64("STRATA_SOAK_SEED", 0x50a6),
        attempt_timeout: Duration::from_secs(3),
        deadline: Duration::from_secs(15),
        bin: None,
    };
    let target_tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let Some(c) = Campaign::start_or_skip(target_tmp, &setup, "fault_soak") else {
        return;
    };
    let transient = FaultPlan::transient(
        0.03,
        Duration::from_secs(4),
        Duration::from_millis(1),
        Duration::from_millis(4),
    );
    let layer3 = &c.layers[3];
    let mut chunks: Vec<u64> = layer3.files.iter().flat_map(|f| f.chunks.clone()).collect();
    chunks.sort_unstable();
    chunks.dedup();
    let bad_chunk = chunks[chunks.len() / 2];
    let mut permanent = transient.clone();
    permanent.corrupt = vec![(layer3.blob_key.clone(), bad_chunk * CHUNK + 100)];
    permanent.not_found = vec![c.layers[4].blob_key.clone()];
    permanent.forbidden = vec![c.layers[5].blob_key.clone()];
    let needs_bad = Arc::new(
        c.layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                layer
                    .files
                    .iter()
                    .map(|f| match l {
                        3 => f.chunks.contains(&bad_chunk),
                        4 | 5 => !f.chunks.is_empty(),
                        _ => false,
                    })
                    .collect::<Vec<bool>>()
            })
            .collect::<Vec<_>>(),
    );
    // While set, the permanent faults are on (a read that started while they were on may
    // fail); readers note the generation they started in.
    let permanent_on = Arc::new(AtomicU64::new(0));
    let targets: Arc<Vec<(usize, usize)>> = Arc::new(
        c.layers
            .iter()
            .enumerate()
            .flat_map(|(l, layer)| (0..layer.files.len()).map(move |f| (l, f)))
            .collect(),
    );
    let m0 = c.scrape().expect("scrape");
    c.proxy.set_plan(transient.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let layers = Arc::new(c.layers.clone());
    let threads: Vec<_> = (0..readers)
        .map(|r| {
            let (stop, counts, layers, targets, needs_bad, permanent_on) = (
                stop.clone(),
                counts.clone(),
                layers.clone(),
                targets.clone(),
                needs_bad.clone(),
                permanent_on.clone(),
            );
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(r as u64 + 1);
                while !stop.load(Ordering::Relaxed) {
                    let (l, f) = targets[rng.usize(0..targets.len())];
                    let layer = &layers[l];
                    // Odd generations: permanent faults on.
                    let before = permanent_on.load(Ordering::Acquire);
                    let (o, took) = read_and_check(&layer.mnt, &layer.src, &layer.files[f].rel);
                    let after = permanent_on.load(Ordering::Acquire);
                    counts
                        .longest_us
                        .fetch_max(took.as_micros() as u64, Ordering::Relaxed);
                    match o {
                        Outcome::Ok => {
                            counts.ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Outcome::Wrong => {
                            counts.wrong.fetch_add(1, Ordering::Relaxed);
                        }
                        Outcome::Failed(errno) => {
                            *counts.errnos.lock().unwrap().entry(errno).or_default() += 1;
                            let during = before % 2 == 1 || after % 2 == 1 || before != after;
                            if needs_bad[l][f] && during && errno == libc::EIO {
                                counts.expected_failures.fetch_add(1, Ordering::Relaxed);
                            } else {
                                counts.unexpected_failures.fetch_add(1, Ordering::Relaxed);
                                eprintln!(
                                    "unexpected failure: layer {l} {:?} errno {errno}",
                                    layer.files[f].rel
                                );
                            }
                        }
                    }
                }
            })
        })
        .collect();
    let started = Instant::now();
    let run_for = Duration::from_secs(secs);
    let mut cycles = 0;
    while started.elapsed() < run_for {
        // 60 s with the permanent faults (shorter in short runs), then 30 s without.
        let on = Duration::from_secs((secs / 3).clamp(10, 60));
        let off = on / 2;
        c.proxy.set_plan(permanent.clone());
        permanent_on.fetch_add(1, Ordering::AcqRel);
        std::thread::sleep(on.min(run_for.saturating_sub(started.elapsed())));
        c.proxy.set_plan(transient.clone());
        permanent_on.fetch_add(1, Ordering::AcqRel);
        cycles += 1;
        std::thread::sleep(off.min(run_for.saturating_sub(started.elapsed())));
        assert!(c.daemon_alive(), "the daemon went away");
    }
    stop.store(true, Ordering::Relaxed);
    let until = Instant::now() + Duration::from_secs(90);
    for t in threads {
        while !t.is_finished() {
            assert!(Instant::now() < until, "a reader hung");
            std::thread::sleep(Duration::from_millis(50));
        }
        t.join().expect("a reader panicked");
    }
    // The plan ends: everything reads correctly, without a remount.
    c.proxy.end_plan();
    let mut after_ok = 0;
    for &(l, f) in targets.iter() {
        let layer = &c.layers[l];
        let (o, _) = read_and_check(&layer.mnt, &layer.src, &layer.files[f].rel);
        assert_eq!(
            o,
            Outcome::Ok,
            "after the plan: layer {l} {:?}",
            layer.files[f].rel
        );
        after_ok += 1;
    }
    let m1 = c.scrape().expect("scrape");
    let status = c.status().expect("status");
    let restarts = status["node"]["restarts"].as_u64().unwrap_or(u64::MAX);
    let alive = c.daemon_alive();
    let d = |k: &str| m1.get(k).copied().unwrap_or(0.0) - m0.get(k).copied().unwrap_or(0.0);
    let labelled = |prefix: &str| -> Vec<String> {
        m1.keys()
            .filter(|k| k.starts_with(prefix))
            .map(|k| format!("{} {}", &k[prefix.len()..], d(k)))
            .collect()
    };
    let wrong = counts.wrong.load(Ordering::Relaxed);
    let unexpected = counts.unexpected_failures.load(Ordering::Relaxed);
    println!("fault_soak: {secs} s, {readers} readers, {cycles} permanent-fault cycles, 6 layers x 40 files");
    println!(
        "  reads served          {}",
        counts.ok.load(Ordering::Relaxed)
    );
    println!(
        "  reads failed          {} expected (file needs a bad chunk, EIO), {} unexpected; by errno {:?}",
        counts.expected_failures.load(Ordering::Relaxed),
        unexpected,
        counts.errnos.lock().unwrap()
    );
    println!("  wrong bytes           {wrong} reads");
    println!(
        "  longest read (stall)  {} ms",
        counts.longest_us.load(Ordering::Relaxed) / 1000
    );
    println!("  faults injected       {:?}", c.proxy.injected());
    println!(
        "  retries by cause      {}",
        labelled("strata_backend_retries_total").join(", ")
    );
    println!(
        "  errors by kind        {}",
        labelled("strata_backend_errors_total").join(", ")
    );
    println!(
        "  verify failures       {} (corrupt errors {})",
        d("strata_cache_verify_failures_total"),
        d("strata_cache_corrupt_errors_total")
    );
    println!(
        "  backend requests      {}, fetched {:.1} MiB, FUSE read errors {}",
        d("strata_backend_requests_total"),
        d("strata_cache_fetched_bytes_total") / (1 << 20) as f64,
        d("strata_fuse_read_errors_total")
    );
    println!(
        "  daemon                restarts {restarts}, alive {alive}, rss {:.0} MiB; {after_ok} files read back after the plan ended",
        m1.get("strata_daemon_rss_bytes").copied().unwrap_or(0.0) / (1 << 20) as f64
    );
    assert_eq!(wrong, 0, "wrong bytes");
    assert_eq!(unexpected, 0, "unexpected failures");
    assert_eq!(restarts, 0, "the daemon restarted");
    assert!(alive, "the daemon went away");
}
