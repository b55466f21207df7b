//! The simulator at a small scale (the 32K × 160 runs belong to the CLI and the bench).

use std::time::Duration;

use placement::sim::{run, SimConfig, SimReport};
use placement::{Limits, PolicyKind};

/// 32 nodes, a 6,400 burst (200 per node, as the 32K on 160) at 1,000/s, 4
/// instances, a 1 s snapshot, 2 h of background at 25% of memory.
fn small(policy: PolicyKind, seed: u64) -> SimConfig {
    SimConfig {
        nodes: 32,
        burst: 6_400,
        burst_rate: 1_000.0,
        warmup: Duration::from_secs(2 * 3600),
        policy,
        seed,
        ..SimConfig::default()
    }
}

fn sim(cfg: &SimConfig) -> SimReport {
    let r = run(cfg).unwrap();
    eprintln!(
        "{:24} end {:.4} count {:.4} peak {:.4} refusals {} retries {} failed {} hit {:.3} {:.0}/s",
        r.policy,
        r.max_over_mean,
        r.max_over_mean_count,
        r.peak_max_over_mean,
        r.refusals,
        r.retries,
        r.failed_burst,
        r.layer_hit_rate,
        r.placements_per_s
    );
    r
}

#[test]
fn deterministic_given_the_seed() {
    let a = sim(&small(PolicyKind::PowerOfKOverlayLocality, 5));
    let b = sim(&small(PolicyKind::PowerOfKOverlayLocality, 5));
    let c = sim(&small(PolicyKind::PowerOfKOverlayLocality, 6));
    let same = |x: &SimReport, y: &SimReport| {
        // The measured speed is wall-clock time, the one thing that may differ.
        let mut y = y.clone();
        y.placements_per_s = x.placements_per_s;
        *x == y
    };
    assert!(same(&a, &b));
    assert!(!same(&a, &c));
    assert!(a.series.len() > 50, "{} samples", a.series.len());
    assert_eq!(a.failed_burst, 0);
    assert!(a.placements >= 6_400);
}

/// The ordering the issue expects, on one workload: power-of-k with the overlay balances
/// far better than random and than stale least-loaded, which herds onto the nodes the
/// snapshot shows lightest (visible as a large peak during the burst).
#[test]
fn overlay_power_of_k_beats_random_and_stale_least_loaded() {
    let random = sim(&small(PolicyKind::Random, 1));
    let ll = sim(&small(PolicyKind::LeastLoaded, 1));
    let pk = sim(&small(PolicyKind::PowerOfKOverlay, 1));
    assert!(pk.max_over_mean < random.max_over_mean);
    assert!(pk.peak_max_over_mean < ll.peak_max_over_mean);
    assert!(
        ll.peak_max_over_mean > 1.5,
        "stale least-loaded did not herd"
    );
    // 200 sandboxes per node of 1–8 GiB: a max/mean of 1.05 is 10 GiB above a mean of
    // ≈ 830 GiB; the 32K × 160 run is the CLI's, this one must be as good.
    assert!(
        pk.max_over_mean <= 1.06,
        "pow-k+overlay: {}",
        pk.max_over_mean
    );
}

/// Counting the overlay once per instance (weight 1) lets every instance fill the same
/// holes of the snapshot: the overshoot shows as a worse balance than weight = instances.
#[test]
fn the_overlay_weight_damps_the_instances_feedback() {
    let mut one = small(PolicyKind::PowerOfKOverlay, 2);
    one.overlay_weight = Some(1.0);
    one.params.k = 3;
    let mut four = one.clone();
    four.overlay_weight = None;
    let (a, b) = (sim(&one), sim(&four));
    assert_eq!(b.overlay_weight, 4.0);
    assert!(
        b.max_over_mean < a.max_over_mean,
        "{} vs {}",
        b.max_over_mean,
        a.max_over_mean
    );
}

/// Locality raises the burst's layer-cache hit rate and keeps the balance within its bound.
#[test]
fn locality_raises_hits_without_herding() {
    let pk = sim(&small(PolicyKind::PowerOfKOverlay, 3));
    let loc = sim(&small(PolicyKind::PowerOfKOverlayLocality, 3));
    assert!(loc.layer_hit_rate_count > pk.layer_hit_rate_count + 0.03);
    assert!(loc.layer_hit_rate >= pk.layer_hit_rate);
    assert!(loc.max_over_mean <= pk.max_over_mean * 1.02 + 0.01);
}

/// A burst larger than the fleet: the edges refuse with reasons, retries are bounded, and
/// what cannot be placed fails cleanly.
#[test]
fn an_overfull_burst_is_refused_with_reasons_and_bounded_retries() {
    let cfg = SimConfig {
        nodes: 4,
        burst: 500,
        burst_rate: 0.0,
        background: 0.0,
        warmup: Duration::ZERO,
        limits: Limits {
            max_sandboxes: 100,
            ..Limits::default()
        },
        policy: PolicyKind::PowerOfK,
        ..SimConfig::default()
    };
    let r = sim(&cfg);
    assert_eq!(r.placements, 400);
    assert_eq!(r.failed_burst, 100);
    assert!(r.refusals > 0 && r.refusals_by_reason.sandboxes == r.refusals);
    assert!(r.retries <= 500 * u64::from(cfg.max_attempts - 1));
    assert!((r.max_over_mean_count - 1.0).abs() < 1e-9, "all nodes full");
}

#[test]
fn bad_configurations_are_errors() {
    let base = small(PolicyKind::PowerOfK, 1);
    type Mutation = Box<dyn Fn(&mut SimConfig)>;
    let cases: Vec<Mutation> = vec![
        Box::new(|c| c.nodes = 0),
        Box::new(|c| c.instances = 0),
        Box::new(|c| c.background = 1.0),
        Box::new(|c| c.burst_rate = f64::NAN),
        Box::new(|c| c.sample_every = Duration::ZERO),
        Box::new(|c| c.params.k = 0),
        Box::new(|c| c.overlay_weight = Some(0.5)),
        Box::new(|c| c.workload.sizes.clear()),
        Box::new(|c| c.warmup = Duration::from_secs(365 * 24 * 3600)),
        Box::new(|c| c.burst_rate = 1e-9),
        Box::new(|c| c.place_cost = Duration::from_secs(3600)),
        Box::new(|c| c.snapshot_age = Duration::from_nanos(1)),
        Box::new(|c| c.params.k = usize::MAX),
        Box::new(|c| {
            c.policy = PolicyKind::PowerOfKOverlayLocality;
            c.params.homes = 1 << 40;
        }),
        Box::new(|c| c.burst = 2_000_000),
    ];
    for (i, f) in cases.iter().enumerate() {
        let mut c = base.clone();
        f(&mut c);
        assert!(run(&c).is_err(), "case {i} ran");
    }
}
