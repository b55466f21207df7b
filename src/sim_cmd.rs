//! `strata sim`: the placement simulator (`placement::sim`) and the literature's anchors
//! (`placement::anchors`), as tables, JSON lines, and PNG plots.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use placement::anchors::{balls_into_bins_mean, supermarket, Supermarket};
use placement::sim::{SimConfig, SimReport};
use placement::PolicyKind;

#[derive(Subcommand, Debug)]
pub enum SimCmd {
    /// Simulate a burst placed by several instances from a stale snapshot: max/mean load,
    /// refusals, retries, the placer's speed, layer-cache hits, per policy. With ranges for
    /// --instances and --snapshot-age it varies one at a time around (4 instances, 1 s)
    /// (or the first value of each when those are not in the ranges).
    Placement(Box<PlacementArgs>),
    /// The literature's reference points with the same policies: n balls into n bins
    /// (n = 1,000) and Mitzenmacher's supermarket model with a board refreshed every 10
    /// service times at 90% load.
    Anchors(AnchorArgs),
}

#[derive(Args, Debug)]
pub struct PlacementArgs {
    /// Nodes in the fleet.
    #[arg(long, default_value_t = 160)]
    nodes: usize,
    /// Sandboxes in the burst.
    #[arg(long, default_value_t = 32_000)]
    burst: usize,
    /// Burst arrivals per second (0: all at once).
    #[arg(long, default_value_t = 5_000.0)]
    rate: f64,
    /// Placement instances: N, A..B (inclusive) or a comma list.
    #[arg(long, default_value = "4")]
    instances: String,
    /// The watcher's period (the snapshot's age cycles from 0 to it): D, A..B[:STEP] (step
    /// 1s unless given; e.g. 0..5s, 0..2s:500ms) or a comma list (0,250ms,1s).
    #[arg(long, default_value = "1s")]
    snapshot_age: String,
    /// Policies, comma-separated, or "all": random, least-loaded, least-loaded+overlay,
    /// pow-k, pow-k+overlay, pow-k+overlay+locality.
    #[arg(long, default_value = "all")]
    policy: String,
    /// Seed of everything random in a run.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Fraction of the fleet's memory the background reserves before the burst.
    #[arg(long, default_value_t = 0.25)]
    background: f64,
    /// Simulated background time before the burst.
    #[arg(long, default_value = "6h", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Random choices of the power-of-k policies.
    #[arg(long, default_value_t = 2)]
    k: usize,
    /// Rendezvous-hashed home candidates of the locality policy.
    #[arg(long, default_value_t = 1)]
    homes: usize,
    /// The locality bonus: a cached node wins while its load is below 1 / (1 − bonus) of
    /// the others'.
    #[arg(long, default_value_t = 0.02)]
    locality_bonus: f64,
    /// How many times an instance counts its own placements: "instances" (as many as there
    /// are) or a number ≥ 1.
    #[arg(long, default_value = "instances")]
    overlay_weight: String,
    /// Simulated time one decision takes.
    #[arg(long, default_value = "10us", value_parser = humantime::parse_duration)]
    place_cost: Duration,
    /// Nodes tried per request.
    #[arg(long, default_value_t = 4)]
    max_attempts: u32,
    /// Write placement-over-time.png (and, for ranges, placement-vs-age.png and
    /// placement-vs-instances.png) into this directory.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct AnchorArgs {
    /// Seeds for balls into bins (the mean maximum load over them).
    #[arg(long, default_value_t = 200)]
    seeds: u64,
    /// Service times simulated in the supermarket model.
    #[arg(long, default_value_t = 10_000.0)]
    horizon: f64,
}

pub fn run(cmd: SimCmd, json: bool) -> Result<()> {
    match cmd {
        SimCmd::Placement(a) => placement_cmd(*a, json),
        SimCmd::Anchors(a) => anchors_cmd(a, json),
    }
}

/// At most this many simulations per command.
const MAX_RUNS: usize = 1_000;

fn parse_list<T>(s: &str, what: &str, one: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    let v = s
        .split(',')
        .map(|p| one(p.trim()))
        .collect::<Result<Vec<T>>>()
        .with_context(|| format!("--{what} {s:?}"))?;
    if v.is_empty() {
        bail!("--{what}: no value");
    }
    Ok(v)
}

/// `N`, `A..B` (inclusive) or `A,B,C`.
fn parse_instances(s: &str) -> Result<Vec<usize>> {
    if let Some((a, b)) = s.split_once("..") {
        let a: usize = a.trim().parse().context("--instances: range start")?;
        let b: usize = b.trim().parse().context("--instances: range end")?;
        if a == 0 || b < a || b - a >= MAX_RUNS {
            bail!("--instances {s:?}: need 1 ≤ A ≤ B and fewer than {MAX_RUNS} values");
        }
        return Ok((a..=b).collect());
    }
    parse_list(s, "instances", |p| {
        let n: usize = p.parse()?;
        if n == 0 {
            bail!("0 instances");
        }
        Ok(n)
    })
}

fn duration(s: &str) -> Result<Duration> {
    humantime::parse_duration(s).with_context(|| format!("{s:?} is not a duration (1s, 250ms)"))
}

/// `D`, `A..B[:STEP]` or `A,B,C`.
fn parse_ages(s: &str) -> Result<Vec<Duration>> {
    if let Some((a, rest)) = s.split_once("..") {
        let (b, step) = match rest.split_once(':') {
            Some((b, st)) => (b, duration(st.trim())?),
            None => (rest, Duration::from_secs(1)),
        };
        let (a, b) = (duration(a.trim())?, duration(b.trim())?);
        if step.is_zero() || b < a {
            bail!("--snapshot-age {s:?}: need A ≤ B and a step > 0");
        }
        let n = ((b - a).as_secs_f64() / step.as_secs_f64()).floor() as usize + 1;
        if n > MAX_RUNS {
            bail!("--snapshot-age {s:?}: more than {MAX_RUNS} values");
        }
        return Ok((0..n).map(|i| a + step * i as u32).collect());
    }
    parse_list(s, "snapshot-age", duration)
}

fn parse_policies(s: &str) -> Result<Vec<PolicyKind>> {
    if s == "all" {
        return Ok(PolicyKind::ALL.to_vec());
    }
    parse_list(s, "policy", |p| Ok(p.parse::<PolicyKind>()?))
}

fn focus<T: Copy + PartialEq>(values: &[T], preferred: T) -> T {
    if values.contains(&preferred) {
        preferred
    } else {
        values[0]
    }
}

fn placement_cmd(a: PlacementArgs, json: bool) -> Result<()> {
    let instances = parse_instances(&a.instances)?;
    let ages = parse_ages(&a.snapshot_age)?;
    let policies = parse_policies(&a.policy)?;
    let weight = match a.overlay_weight.as_str() {
        "instances" => None,
        w => Some(
            w.parse::<f64>()
                .with_context(|| format!("--overlay-weight {w:?}"))?,
        ),
    };
    let (fi, fa) = (focus(&instances, 4), focus(&ages, Duration::from_secs(1)));
    // One at a time around the focus: the ages at the focus instances, the instances at
    // the focus age.
    let mut points: Vec<(usize, Duration)> = ages.iter().map(|&g| (fi, g)).collect();
    points.extend(instances.iter().filter(|&&i| i != fi).map(|&i| (i, fa)));
    if points.len() * policies.len() > MAX_RUNS {
        bail!("more than {MAX_RUNS} simulations; narrow the ranges");
    }
    let base = SimConfig {
        nodes: a.nodes,
        burst: a.burst,
        burst_rate: a.rate,
        background: a.background,
        warmup: a.warmup,
        place_cost: a.place_cost,
        max_attempts: a.max_attempts,
        overlay_weight: weight,
        seed: a.seed,
        params: placement::PolicyParams {
            k: a.k,
            homes: a.homes,
            bonus: a.locality_bonus,
        },
        ..SimConfig::default()
    };
    // Every parameter checked before the first (long) run.
    for &(i, g) in &points {
        for &p in &policies {
            SimConfig {
                instances: i,
                snapshot_age: g,
                policy: p,
                ..base.clone()
            }
            .validate()?;
        }
    }
    if !json {
        println!(
            "{} nodes, burst {} at {}, background {:.0}% of memory, seed {}",
            a.nodes,
            a.burst,
            if a.rate == 0.0 {
                "once".to_string()
            } else {
                format!("{}/s", a.rate)
            },
            a.background * 100.0,
            a.seed
        );
        println!(
            "{:<24} {:>4} {:>6} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7} {:>7} {:>11}",
            "policy",
            "inst",
            "age",
            "max/mean",
            "by count",
            "peak",
            "refusals",
            "retries",
            "failed",
            "hit B",
            "hit #",
            "placements/s"
        );
    }
    let mut reports: Vec<SimReport> = Vec::new();
    for &(i, g) in &points {
        for &p in &policies {
            let cfg = SimConfig {
                instances: i,
                snapshot_age: g,
                policy: p,
                ..base.clone()
            };
            let started = Instant::now();
            let r = placement::sim::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{:<24} {:>4} {:>6} {:>9.4} {:>9.4} {:>9.4} {:>8} {:>8} {:>7} {:>7.3} {:>7.3} {:>11.0}   ({:.1} s)",
                    r.policy,
                    r.instances,
                    humantime::format_duration(g).to_string(),
                    r.max_over_mean,
                    r.max_over_mean_count,
                    r.peak_max_over_mean,
                    r.refusals,
                    r.retries,
                    r.failed_burst,
                    r.layer_hit_rate,
                    r.layer_hit_rate_count,
                    r.placements_per_s,
                    started.elapsed().as_secs_f64()
                );
            }
            reports.push(r);
        }
    }
    if let Some(dir) = &a.plot {
        plot(dir, &reports, &policies, (fi, fa), &instances, &ages)?;
    }
    Ok(())
}

fn plot(
    dir: &std::path::Path,
    reports: &[SimReport],
    policies: &[PolicyKind],
    (fi, fa): (usize, Duration),
    instances: &[usize],
    ages: &[Duration],
) -> Result<()> {
    use placement::plot::{line_chart, Line};
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let at = |r: &SimReport, i: usize, g: Duration| {
        r.instances == i && (r.snapshot_age_s - g.as_secs_f64()).abs() < 1e-9
    };
    let Some(first) = reports.first() else {
        return Ok(());
    };
    let setting = format!(
        "{} nodes, {} burst at {}/s, {:.0}% background",
        first.nodes,
        first.burst,
        first.burst_rate,
        first.background * 100.0
    );
    let over_time: Vec<Line> = policies
        .iter()
        .filter_map(|p| {
            reports
                .iter()
                .find(|r| r.policy == p.name() && at(r, fi, fa))
                .map(|r| (p.name().to_string(), r.series.clone()))
        })
        .collect();
    let path = dir.join("placement-over-time.png");
    line_chart(
        &path,
        &format!(
            "max/mean memory over time: {fi} instances, {} snapshot",
            humantime::format_duration(fa)
        ),
        &format!("seconds since the burst started ({setting})"),
        "max/mean reserved memory",
        &over_time,
    )?;
    eprintln!("wrote {}", path.display());
    let sweep = |x: &dyn Fn(&SimReport) -> Option<f64>| -> Vec<Line> {
        policies
            .iter()
            .map(|p| {
                let mut pts: Vec<(f64, f64)> = reports
                    .iter()
                    .filter(|r| r.policy == p.name())
                    .filter_map(|r| x(r).map(|x| (x, r.max_over_mean)))
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                (p.name().to_string(), pts)
            })
            .collect()
    };
    if ages.len() > 1 {
        let lines = sweep(&|r| (r.instances == fi).then_some(r.snapshot_age_s));
        let path = dir.join("placement-vs-age.png");
        line_chart(
            &path,
            &format!("max/mean at the end of the burst vs snapshot age: {fi} instances"),
            &format!("snapshot age (watcher period), s ({setting})"),
            "max/mean reserved memory",
            &lines,
        )?;
        eprintln!("wrote {}", path.display());
    }
    if instances.len() > 1 {
        let g = fa.as_secs_f64();
        let lines = sweep(&|r| ((r.snapshot_age_s - g).abs() < 1e-9).then_some(r.instances as f64));
        let path = dir.join("placement-vs-instances.png");
        line_chart(
            &path,
            &format!(
                "max/mean at the end of the burst vs instances: {} snapshot",
                humantime::format_duration(fa)
            ),
            &format!("placement instances ({setting})"),
            "max/mean reserved memory",
            &lines,
        )?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn anchors_cmd(a: AnchorArgs, json: bool) -> Result<()> {
    if a.seeds == 0 || a.seeds > 100_000 {
        bail!("--seeds must be in 1..=100,000");
    }
    let m = Supermarket {
        horizon: a.horizon,
        ..Supermarket::default()
    };
    let rows: Vec<(&str, &str, f64, f64)> = vec![
        (
            "balls into bins, n = 1,000: mean max load",
            "random",
            balls_into_bins_mean(1000, PolicyKind::Random, 2, a.seeds)?,
            5.5,
        ),
        (
            "balls into bins, n = 1,000: mean max load",
            "two choices",
            balls_into_bins_mean(1000, PolicyKind::PowerOfKOverlay, 2, a.seeds)?,
            3.0,
        ),
        (
            "supermarket, n = 100, λ = 0.9, board every T = 10: mean time in system",
            "least-loaded",
            supermarket(&m, PolicyKind::LeastLoaded, 1)?,
            24.7,
        ),
        (
            "supermarket, n = 100, λ = 0.9, board every T = 10: mean time in system",
            "two choices",
            supermarket(&m, PolicyKind::PowerOfK, 1)?,
            5.1,
        ),
        (
            "supermarket, n = 100, λ = 0.9, board every T = 10: mean time in system",
            "random",
            supermarket(&m, PolicyKind::Random, 1)?,
            10.0,
        ),
    ];
    for (what, policy, measured, published) in rows {
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "anchor": what, "policy": policy, "measured": measured, "published": published,
                })
            );
        } else {
            println!("{what:<72} {policy:<13} {measured:>7.3}  (published {published})");
        }
    }
    Ok(())
}
