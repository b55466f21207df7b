//! The literature's reference points, reproduced with this crate's own policies and placer.
//!
//! - **Balls into bins** ([`balls_into_bins`]): n unit balls into n bins, one placer whose
//!   overlay is its exact view (one instance, nothing stale). The expected maximum load at
//!   n = 1,000 is ≈ 5.5 for random placement and ≈ 3.0 for two choices (Azar, Broder,
//!   Karlin, Upfal; Mitzenmacher's thesis, table 1.1).
//! - **The supermarket model with a periodically refreshed board** ([`supermarket`]): n
//!   FIFO servers of exponential service (mean 1), Poisson arrivals at rate λn; a board of
//!   the queue lengths is refreshed every T; each arrival chooses from the board alone (no
//!   overlay). Mitzenmacher, "How useful is old information?" (IEEE TPDS 2000): at n = 100,
//!   λ = 0.9, T = 10 the shortest-queue policy herds to a mean time in system of ≈ 24.7,
//!   two choices stay at ≈ 5.1 (random: 1 / (1 − λ) = 10).
//!
//! Service is simulated by uniformisation: events at total rate n(λ + 1), each an arrival
//! with probability λ / (λ + 1), else a service completion at a uniformly chosen server if
//! it is busy. The mean time in system is the time-averaged number in system over λn
//! (Little's law).

use std::sync::Arc;
use std::time::Duration;

use crate::admission::Limits;
use crate::model::{NodeId, NodeState, Request, Resources, Snapshot};
use crate::placer::{Placer, PlacerConfig};
use crate::policy::{PolicyKind, PolicyParams};
use crate::workload::exponential;
use crate::Error;

/// Bins that never refuse a unit ball: load is the ball count.
fn unit_fleet(counts: &[u64], t: Duration) -> Result<Arc<Snapshot>, Error> {
    let cap = Resources {
        cpu_millis: 1,
        mem_bytes: 1 << 40,
        disk_bytes: 1,
    };
    let limits = Limits {
        max_sandboxes: u32::MAX,
        ..Limits::default()
    };
    let nodes = counts
        .iter()
        .enumerate()
        .map(|(i, &c)| NodeState {
            id: NodeId(i as u32),
            capacity: cap,
            reserved: Resources {
                mem_bytes: c,
                ..Resources::default()
            },
            used: Resources::default(),
            sandboxes: u32::try_from(c).unwrap_or(u32::MAX),
            limits,
            layers: Arc::from(Vec::new()),
        })
        .collect();
    Ok(Arc::new(Snapshot::new(t, nodes)?))
}

const BALL: Request<'static> = Request {
    resources: Resources {
        cpu_millis: 0,
        mem_bytes: 1,
        disk_bytes: 0,
    },
    layers: &[],
};

fn check_policy(policy: PolicyKind) -> Result<(), Error> {
    match policy {
        PolicyKind::Random
        | PolicyKind::LeastLoaded
        | PolicyKind::PowerOfK
        | PolicyKind::PowerOfKOverlay => Ok(()),
        other => Err(Error::Invalid {
            what: "anchor policy",
            why: format!("{other} has no anchor"),
        }),
    }
}

/// The maximum load after `n` balls into `n` bins by `policy` (with `d` choices for the
/// power-of-k ones), seeded by `seed`. Every placement is recorded in the overlay, which is
/// then the exact state.
pub fn balls_into_bins(n: usize, policy: PolicyKind, d: usize, seed: u64) -> Result<u64, Error> {
    check_policy(policy)?;
    if n == 0 || n > 10_000_000 {
        return Err(Error::Invalid {
            what: "bins",
            why: "must be in 1..=10,000,000".into(),
        });
    }
    let params = PolicyParams {
        k: d,
        ..PolicyParams::default()
    };
    let cfg = PlacerConfig {
        overlay: true,
        overlay_ttl: Duration::MAX,
        ..PlacerConfig::default()
    };
    let mut counts = vec![0u64; n];
    let mut placer = Placer::new(
        policy.build(&params)?,
        cfg,
        unit_fleet(&counts, Duration::ZERO)?,
        seed,
    )?;
    for _ in 0..n {
        let node = placer.choose(&BALL, Duration::ZERO, &[])?;
        counts[node.0 as usize] += 1;
        placer.placed(node, &BALL, Duration::ZERO);
    }
    Ok(counts.into_iter().max().unwrap_or(0))
}

/// The mean of [`balls_into_bins`] over seeds `0..seeds`.
pub fn balls_into_bins_mean(
    n: usize,
    policy: PolicyKind,
    d: usize,
    seeds: u64,
) -> Result<f64, Error> {
    let mut sum = 0u64;
    for s in 0..seeds {
        sum += balls_into_bins(n, policy, d, s)?;
    }
    Ok(sum as f64 / seeds.max(1) as f64)
}

/// The supermarket model's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Supermarket {
    /// Servers.
    pub n: usize,
    /// Arrival rate per server (< 1).
    pub lambda: f64,
    /// Board refresh period, in mean service times (0: always fresh).
    pub period: f64,
    /// Time simulated before measuring.
    pub warmup: f64,
    /// Time measured.
    pub horizon: f64,
    /// Choices for the power-of-k policies.
    pub d: usize,
}

impl Default for Supermarket {
    /// Mitzenmacher's setting: n = 100, λ = 0.9, T = 10.
    fn default() -> Supermarket {
        Supermarket {
            n: 100,
            lambda: 0.9,
            period: 10.0,
            warmup: 1_000.0,
            horizon: 10_000.0,
            d: 2,
        }
    }
}

/// The mean time in system of the supermarket model under `policy` (placing from the board
/// alone: no overlay), seeded by `seed`.
pub fn supermarket(m: &Supermarket, policy: PolicyKind, seed: u64) -> Result<f64, Error> {
    check_policy(policy)?;
    let ok = m.n > 0
        && m.n <= 100_000
        && m.lambda > 0.0
        && m.lambda < 1.0
        && m.period >= 0.0
        && m.period.is_finite()
        && m.warmup >= 0.0
        && m.horizon > 0.0
        && (m.warmup + m.horizon) * m.n as f64 <= 1e9;
    if !ok {
        return Err(Error::Invalid {
            what: "supermarket model",
            why: format!("{m:?}"),
        });
    }
    let params = PolicyParams {
        k: m.d,
        ..PolicyParams::default()
    };
    let cfg = PlacerConfig {
        overlay: false,
        ..PlacerConfig::default()
    };
    let mut q = vec![0u64; m.n];
    let mut placer = Placer::new(
        policy.build(&params)?,
        cfg,
        unit_fleet(&q, Duration::ZERO)?,
        seed,
    )?;
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let rate = m.n as f64 * (m.lambda + 1.0);
    let p_arrival = m.lambda / (m.lambda + 1.0);
    let (mut t, mut next_board, mut in_system) = (0.0f64, m.period, 0u64);
    let end = m.warmup + m.horizon;
    let mut area = 0.0f64;
    while t < end {
        let dt = exponential(&mut rng, 1.0 / rate);
        // The number in system is constant over [t, t + dt).
        let lo = t.max(m.warmup);
        let hi = (t + dt).min(end);
        if hi > lo {
            area += in_system as f64 * (hi - lo);
        }
        t += dt;
        if m.period == 0.0 || t >= next_board {
            let board = unit_fleet(&q, Duration::from_secs_f64(t.min(1e12)))?;
            placer.set_snapshot(board);
            if m.period > 0.0 {
                while next_board <= t {
                    next_board += m.period;
                }
            }
        }
        if rng.f64() < p_arrival {
            let node = placer.choose(&BALL, Duration::from_secs_f64(t.min(1e12)), &[])?;
            q[node.0 as usize] += 1;
            in_system += 1;
        } else {
            let i = rng.usize(..m.n);
            if q[i] > 0 {
                q[i] -= 1;
                in_system -= 1;
            }
        }
    }
    Ok(area / m.horizon / (m.lambda * m.n as f64))
}
