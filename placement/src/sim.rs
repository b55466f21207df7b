//! A discrete-event simulation of placement: a fleet, a background, a burst, several
//! placement instances sharing a periodic snapshot.
//!
//! # The model
//!
//! - **Fleet**: `nodes` identical nodes, each with an [`Edge`] (its admission ledger, the
//!   truth) and a layer cache of `layer_cache_bytes` (LRU of whole layers; a layer in use by
//!   a live sandbox is never evicted).
//! - **Background**: before the burst, jobs arrive as a Poisson process for `warmup`, each a
//!   batch of 1..=2×mean sandboxes arriving at once, at the rate that keeps
//!   `background` of the fleet's memory reserved in steady state (Little's law with the
//!   lognormal lifetimes of [`Workload`]); they depart at the end of their lifetimes.
//! - **Burst**: at `warmup`, one job of `burst` sandboxes on one base and toolkit over
//!   `burst_tasks` workspaces, arriving evenly at `burst_rate` per second (0: all at once).
//! - **Instances**: every arrival goes to one of `instances` placers uniformly at random (a
//!   load balancer). An instance decides one request at a time, each taking `place_cost` of
//!   simulated time (a model of the decision; the placer's real speed is measured separately,
//!   in wall-clock time, and reported as `placements_per_s`). Admission is a synchronous
//!   call to the chosen node's edge, instantaneous in simulated time.
//! - **Watcher**: every `snapshot_age` the watcher takes a snapshot of the whole fleet and
//!   publishes it to every instance (so the snapshot's age cycles from 0 to `snapshot_age`,
//!   Mitzenmacher's periodic-update model); with `snapshot_age` = 0 every decision sees the
//!   fleet as it is.
//!
//! # What is measured
//!
//! Load balance is by **reserved memory**, the binding resource of this workload:
//! max/mean over the nodes, sampled every `sample_every` from one second before the burst to
//! `after_burst` after its last decision, and at the end of the burst (its last decision);
//! also by sandbox count at the end. Refusals (by reason), retries (attempts after the
//! first), failures (requests no node took), and the layer-cache hit rate of the burst's
//! placements (by bytes and by layer count: a layer hits when the chosen node cached it).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::admission::{Edge, Limits, RefusalReason};
use crate::model::{Layer, LayerId, NodeId, NodeState, Request, Resources, Snapshot};
use crate::placer::{Placer, PlacerConfig};
use crate::policy::{PolicyKind, PolicyParams};
use crate::workload::{exponential, Workload};
use crate::Error;

const GIB: u64 = 1 << 30;

/// A simulation's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Nodes in the fleet.
    pub nodes: usize,
    /// Each node's capacity.
    pub node_capacity: Resources,
    /// Each node's admission limits.
    pub limits: Limits,
    /// Each node's layer cache.
    pub layer_cache_bytes: u64,
    /// Sandboxes in the burst.
    pub burst: usize,
    /// Burst arrivals per second; 0: all at once.
    pub burst_rate: f64,
    /// Placement instances.
    pub instances: usize,
    /// The watcher's period: the snapshot's age cycles from 0 to this.
    pub snapshot_age: Duration,
    /// The policy.
    pub policy: PolicyKind,
    /// Its parameters.
    pub params: PolicyParams,
    /// Fraction of the fleet's memory the background reserves in steady state, in [0, 1).
    pub background: f64,
    /// Background before the burst.
    pub warmup: Duration,
    /// Simulated time per decision.
    pub place_cost: Duration,
    /// Overlay entry TTL.
    pub overlay_ttl: Duration,
    /// How many times an instance counts its own placements; `None`: the number of
    /// instances (see [`PlacerConfig::overlay_weight`]).
    pub overlay_weight: Option<f64>,
    /// Nodes tried per request.
    pub max_attempts: u32,
    /// Sampling period of the load series.
    pub sample_every: Duration,
    /// Sampling goes on this long after the burst's last decision.
    pub after_burst: Duration,
    /// The sandboxes.
    pub workload: Workload,
    /// Everything random derives from this.
    pub seed: u64,
}

impl Default for SimConfig {
    /// The scenario: 160 nodes, a 32K burst at 5,000/s, 4 instances, a 1 s
    /// snapshot; nodes of 128 cores (8× overcommit), 1 TiB, 8 TiB of disk, 1,000 sandboxes.
    fn default() -> SimConfig {
        SimConfig {
            nodes: 160,
            node_capacity: Resources {
                cpu_millis: 128_000,
                mem_bytes: 1024 * GIB,
                disk_bytes: 8192 * GIB,
            },
            limits: Limits::default(),
            layer_cache_bytes: 100 * GIB,
            burst: 32_000,
            burst_rate: 5_000.0,
            instances: 4,
            snapshot_age: Duration::from_secs(1),
            policy: PolicyKind::PowerOfKOverlay,
            params: PolicyParams::default(),
            background: 0.25,
            warmup: Duration::from_secs(6 * 3600),
            place_cost: Duration::from_micros(10),
            overlay_ttl: Duration::from_secs(30),
            overlay_weight: None,
            max_attempts: 4,
            sample_every: Duration::from_millis(100),
            after_burst: Duration::from_secs(2),
            workload: Workload::default(),
            seed: 1,
        }
    }
}

impl SimConfig {
    /// Checks every parameter (the command line's values end up here).
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |what: &'static str, why: &str| {
            Err(Error::Invalid {
                what,
                why: why.to_string(),
            })
        };
        if self.nodes == 0 || self.nodes > 1_000_000 {
            return bad("nodes", "must be in 1..=1,000,000");
        }
        if self.instances == 0 || self.instances > 1024 {
            return bad("instances", "must be in 1..=1024");
        }
        if self.burst > 1_000_000 {
            return bad("burst", "at most 1,000,000");
        }
        if !(self.burst_rate >= 0.0 && self.burst_rate.is_finite()) {
            return bad("burst rate", "must be finite and ≥ 0");
        }
        if !(0.0..1.0).contains(&self.background) {
            return bad("background", "must be in [0, 1)");
        }
        if self.sample_every.is_zero() {
            return bad("sample period", "must be > 0");
        }
        if self.max_attempts == 0 {
            return bad("max attempts", "must be ≥ 1");
        }
        let horizon = self
            .warmup
            .saturating_add(self.snapshot_age)
            .saturating_add(self.after_burst);
        if horizon > Duration::from_secs(30 * 24 * 3600) {
            return bad(
                "durations",
                "warm-up, snapshot age and after-burst exceed 30 days",
            );
        }
        // The burst lasts at least as long as its arrivals and as its decisions take.
        let arrivals = if self.burst_rate > 0.0 {
            self.burst as f64 / self.burst_rate
        } else {
            0.0
        };
        let decisions = self.burst as f64 * self.place_cost.as_secs_f64() / self.instances as f64;
        let span = self.warmup.as_secs_f64()
            + arrivals.max(decisions)
            + self.after_burst.as_secs_f64()
            + 1.0;
        if arrivals.max(decisions) > 30.0 * 24.0 * 3600.0 {
            return bad(
                "burst",
                "its arrivals or decisions would last more than 30 days",
            );
        }
        if (span - self.warmup.as_secs_f64()) / self.sample_every.as_secs_f64() > 10_000_000.0 {
            return bad("sample period", "more than 10 million samples");
        }
        if !self.snapshot_age.is_zero() && span / self.snapshot_age.as_secs_f64() > 10_000_000.0 {
            return bad(
                "snapshot age",
                "more than 10 million snapshots in the simulation",
            );
        }
        if self.warmup.as_secs_f64() * self.background_job_rate() > 50_000_000.0 {
            return bad("warm-up", "more than 50 million background jobs");
        }
        self.workload.validate()?;
        self.params_check()
    }

    fn params_check(&self) -> Result<(), Error> {
        self.policy.build(&self.params).map(|_| ())
    }

    /// Background jobs per second that keep `background` of the memory reserved.
    fn background_job_rate(&self) -> f64 {
        let (_, mean_mem) = self.workload.mean_size();
        let fleet_mem = self.nodes as f64
            * crate::admission::allowed(self.node_capacity.mem_bytes, self.limits.mem_overcommit)
                as f64;
        let per_job = f64::from(self.workload.background_job.0);
        let sandboxes = self.background * fleet_mem / mean_mem.max(1.0);
        sandboxes / self.workload.lifetime.mean().max(1e-9) / per_job
    }
}

/// Refusals by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RefusalCounts {
    /// Memory.
    pub memory: u64,
    /// CPU.
    pub cpu: u64,
    /// Sandbox count.
    pub sandboxes: u64,
    /// Disk.
    pub disk: u64,
}

/// What one simulation measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    /// The policy's name.
    pub policy: String,
    /// Placement instances.
    pub instances: usize,
    /// The watcher's period, seconds.
    pub snapshot_age_s: f64,
    /// Nodes.
    pub nodes: usize,
    /// Burst size.
    pub burst: usize,
    /// Burst arrivals per second (0: at once).
    pub burst_rate: f64,
    /// How many times each instance counted its own placements.
    pub overlay_weight: f64,
    /// Background memory share targeted.
    pub background: f64,
    /// The seed.
    pub seed: u64,
    /// Max/mean reserved memory over the nodes at the end of the burst.
    pub max_over_mean: f64,
    /// Max/mean sandbox count at the end of the burst.
    pub max_over_mean_count: f64,
    /// The largest max/mean (memory) sampled from the burst's start to its end.
    pub peak_max_over_mean: f64,
    /// Mean reserved memory over capacity at the end of the burst.
    pub mean_mem_util: f64,
    /// Node refusals, all requests (background and burst).
    pub refusals: u64,
    /// The same, by reason.
    pub refusals_by_reason: RefusalCounts,
    /// Attempts after the first, all requests.
    pub retries: u64,
    /// Requests no node took (burst).
    pub failed_burst: u64,
    /// Requests no node took (background).
    pub failed_background: u64,
    /// Placements made, all requests.
    pub placements: u64,
    /// The placer's measured speed: placements per second of wall time spent in
    /// `Placer::place` (each instance is one thread; this is per instance).
    pub placements_per_s: f64,
    /// Burst placements: fraction of their layers' bytes the chosen node had cached.
    pub layer_hit_rate: f64,
    /// The same by layer count.
    pub layer_hit_rate_count: f64,
    /// Simulated seconds from the burst's first arrival to its last decision.
    pub burst_seconds: f64,
    /// (seconds since the burst's start, max/mean memory) samples.
    #[serde(skip)]
    pub series: Vec<(f64, f64)>,
}

/// A node's layer cache: whole layers, LRU, never evicting one in use.
#[derive(Debug)]
struct LayerCache {
    cap: u64,
    bytes: u64,
    /// id → (bytes, live sandboxes using it, last use tick).
    map: HashMap<LayerId, (u64, u32, u64)>,
    changed: bool,
    listed: Arc<[LayerId]>,
}

impl LayerCache {
    fn new(cap: u64) -> LayerCache {
        LayerCache {
            cap,
            bytes: 0,
            map: HashMap::new(),
            changed: false,
            listed: Arc::from(Vec::new()),
        }
    }

    /// A sandbox of `layer` starts here; whether it was cached.
    fn acquire(&mut self, layer: &Layer, tick: u64) -> bool {
        let hit = match self.map.get_mut(&layer.id) {
            Some(e) => {
                e.1 += 1;
                e.2 = tick;
                true
            }
            None => {
                self.map.insert(layer.id, (layer.bytes, 1, tick));
                self.bytes = self.bytes.saturating_add(layer.bytes);
                self.changed = true;
                false
            }
        };
        self.evict();
        hit
    }

    fn release(&mut self, id: LayerId) {
        if let Some(e) = self.map.get_mut(&id) {
            e.1 = e.1.saturating_sub(1);
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.bytes > self.cap {
            // Ticks are unique, so the victim does not depend on the map's order.
            let victim = self
                .map
                .iter()
                .filter(|(_, e)| e.1 == 0)
                .min_by_key(|(_, e)| e.2)
                .map(|(id, e)| (*id, e.0));
            let Some((id, bytes)) = victim else { break };
            self.map.remove(&id);
            self.bytes = self.bytes.saturating_sub(bytes);
            self.changed = true;
        }
    }

    fn list(&mut self) -> Arc<[LayerId]> {
        if self.changed {
            let mut v: Vec<LayerId> = self.map.keys().copied().collect();
            v.sort_unstable();
            self.listed = Arc::from(v);
            self.changed = false;
        }
        Arc::clone(&self.listed)
    }
}

#[derive(Debug)]
struct SimNode {
    edge: Edge,
    used: Resources,
    cache: LayerCache,
}

/// One sandbox, from its arrival to its departure.
#[derive(Clone, Copy, Debug)]
struct Spec {
    res: Resources,
    used: Resources,
    stack: [Layer; 3],
    lifetime_ns: u64,
    burst: bool,
    node: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Snapshot,
    Sample,
    BackgroundJob,
    BurstArrival,
    Decide { inst: u32, spec: u32 },
    Depart { spec: u32 },
}

struct Instance {
    placer: Placer,
    free_at: u64,
    calls: u64,
    busy: Duration,
}

struct Sim<'c> {
    cfg: &'c SimConfig,
    rng: fastrand::Rng,
    heap: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    fleet: Vec<SimNode>,
    specs: Vec<Spec>,
    free_specs: Vec<u32>,
    insts: Vec<Instance>,
    dirty: bool,
    tick: u64,
    burst_start: u64,
    burst_sent: usize,
    burst_done: usize,
    burst_end: Option<u64>,
    next_job: u32,
    rep: SimReport,
    hits: (u64, u64, u64, u64),
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// max / mean of `xs` (1.0 when the mean is zero: nothing to balance).
pub fn max_over_mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (mut max, mut sum, mut n) = (0f64, 0f64, 0usize);
    for x in xs {
        max = max.max(x);
        sum += x;
        n += 1;
    }
    if n == 0 || sum <= 0.0 {
        1.0
    } else {
        max / (sum / n as f64)
    }
}

impl<'c> Sim<'c> {
    fn new(cfg: &'c SimConfig) -> Result<Sim<'c>, Error> {
        cfg.validate()?;
        let fleet: Vec<SimNode> = (0..cfg.nodes)
            .map(|i| SimNode {
                edge: Edge::new(NodeId(i as u32), cfg.node_capacity, cfg.limits),
                used: Resources::default(),
                cache: LayerCache::new(cfg.layer_cache_bytes),
            })
            .collect();
        let mut sim = Sim {
            cfg,
            rng: fastrand::Rng::with_seed(cfg.seed),
            heap: BinaryHeap::new(),
            seq: 0,
            fleet,
            specs: Vec::new(),
            free_specs: Vec::new(),
            insts: Vec::new(),
            dirty: false,
            tick: 0,
            burst_start: ns(cfg.warmup),
            burst_sent: 0,
            burst_done: 0,
            burst_end: None,
            next_job: 0,
            rep: SimReport {
                policy: cfg.policy.name().to_string(),
                instances: cfg.instances,
                snapshot_age_s: cfg.snapshot_age.as_secs_f64(),
                nodes: cfg.nodes,
                burst: cfg.burst,
                burst_rate: cfg.burst_rate,
                overlay_weight: cfg.overlay_weight.unwrap_or(cfg.instances as f64),
                background: cfg.background,
                seed: cfg.seed,
                max_over_mean: 1.0,
                max_over_mean_count: 1.0,
                peak_max_over_mean: 1.0,
                mean_mem_util: 0.0,
                refusals: 0,
                refusals_by_reason: RefusalCounts::default(),
                retries: 0,
                failed_burst: 0,
                failed_background: 0,
                placements: 0,
                placements_per_s: 0.0,
                layer_hit_rate: 0.0,
                layer_hit_rate_count: 0.0,
                burst_seconds: 0.0,
                series: Vec::new(),
            },
            hits: (0, 0, 0, 0),
        };
        let snap = sim.snapshot(0)?;
        let pcfg = PlacerConfig {
            overlay: cfg.policy.overlay(),
            overlay_ttl: cfg.overlay_ttl,
            overlay_weight: cfg.overlay_weight.unwrap_or(cfg.instances as f64),
            settle: Duration::ZERO,
            max_attempts: cfg.max_attempts,
            refusal_ttl: cfg.snapshot_age.max(Duration::from_millis(1)),
        };
        for i in 0..cfg.instances {
            let policy = cfg.policy.build(&cfg.params)?;
            let seed = cfg.seed ^ (0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1));
            sim.insts.push(Instance {
                placer: Placer::new(policy, pcfg, Arc::clone(&snap), seed)?,
                free_at: 0,
                calls: 0,
                busy: Duration::ZERO,
            });
        }
        Ok(sim)
    }

    fn push(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((t, self.seq, ev)));
    }

    fn snapshot(&mut self, t: u64) -> Result<Arc<Snapshot>, Error> {
        let nodes = self
            .fleet
            .iter_mut()
            .map(|n| NodeState {
                id: n.edge.id(),
                capacity: n.edge.capacity(),
                reserved: n.edge.reserved(),
                used: n.used,
                sandboxes: n.edge.sandboxes(),
                limits: n.edge.limits(),
                layers: n.cache.list(),
            })
            .collect();
        self.dirty = false;
        Ok(Arc::new(Snapshot::new(Duration::from_nanos(t), nodes)?))
    }

    fn publish(&mut self, t: u64) -> Result<(), Error> {
        let snap = self.snapshot(t)?;
        for i in &mut self.insts {
            i.placer.set_snapshot(Arc::clone(&snap));
        }
        Ok(())
    }

    fn new_spec(&mut self, res: Resources, stack: [Layer; 3], burst: bool) -> u32 {
        let cfg = self.cfg;
        let w = &cfg.workload;
        let frac = |rng: &mut fastrand::Rng, (a, b): (f64, f64)| a + (b - a) * rng.f64();
        let cpu = frac(&mut self.rng, w.cpu_use);
        let mem = frac(&mut self.rng, w.mem_use);
        let life = w.lifetime.sample(&mut self.rng);
        let spec = Spec {
            res,
            used: Resources {
                cpu_millis: (res.cpu_millis as f64 * cpu) as u64,
                mem_bytes: (res.mem_bytes as f64 * mem) as u64,
                disk_bytes: 0,
            },
            stack,
            lifetime_ns: (life * 1e9).min(1e18) as u64,
            burst,
            node: 0,
        };
        match self.free_specs.pop() {
            Some(i) => {
                self.specs[i as usize] = spec;
                i
            }
            None => {
                self.specs.push(spec);
                (self.specs.len() - 1) as u32
            }
        }
    }

    /// An arrival at `t`: to a random instance, decided when that instance is free.
    fn arrive(&mut self, t: u64, spec: u32) {
        let inst = self.rng.usize(..self.insts.len());
        let i = &mut self.insts[inst];
        let at = t.max(i.free_at);
        i.free_at = at.saturating_add(ns(self.cfg.place_cost));
        self.push(
            at,
            Ev::Decide {
                inst: inst as u32,
                spec,
            },
        );
    }

    fn background_job(&mut self, t: u64) {
        let cfg = self.cfg;
        let w = &cfg.workload;
        let (mean, tasks) = w.background_job;
        let n = self.rng.u32(1..=mean.saturating_mul(2));
        let base = self.rng.u32(..w.bases.0);
        let toolkit = self.rng.u32(..w.toolkits.0);
        let job = self.next_job;
        self.next_job = self.next_job.wrapping_add(1) % (u32::MAX >> 8);
        for _ in 0..n {
            let task = self.rng.u32(..tasks);
            let stack = w.stack(base, toolkit, job, task);
            let res = w.size(&mut self.rng);
            let spec = self.new_spec(res, stack, false);
            self.arrive(t, spec);
        }
        let rate = self.cfg.background_job_rate();
        if rate > 0.0 {
            let dt = exponential(&mut self.rng, 1.0 / rate);
            let next = t.saturating_add((dt * 1e9).min(1e18) as u64);
            if next < self.burst_start {
                self.push(next, Ev::BackgroundJob);
            }
        }
    }

    fn burst_arrival(&mut self, t: u64) {
        let cfg = self.cfg;
        let w = &cfg.workload;
        let job = u32::MAX >> 8;
        // All at once: every arrival now; else one, and the next one after 1/rate.
        let count = if self.cfg.burst_rate == 0.0 {
            self.cfg.burst - self.burst_sent
        } else {
            1
        };
        for _ in 0..count {
            let task = self.rng.u32(..w.burst_tasks);
            let stack = w.stack(0, 0, job, task);
            let res = w.size(&mut self.rng);
            let spec = self.new_spec(res, stack, true);
            self.burst_sent += 1;
            self.arrive(t, spec);
        }
        if self.burst_sent < self.cfg.burst {
            let at = self.burst_start
                + (self.burst_sent as f64 / self.cfg.burst_rate * 1e9).min(1e18) as u64;
            self.push(at.max(t), Ev::BurstArrival);
        }
    }

    fn decide(&mut self, t: u64, inst: u32, sid: u32) -> Result<(), Error> {
        if self.cfg.snapshot_age.is_zero() && self.dirty {
            self.publish(t)?;
        }
        let spec = self.specs[sid as usize];
        let req = Request {
            resources: spec.res,
            layers: &spec.stack,
        };
        let now = Duration::from_nanos(t);
        let fleet = &mut self.fleet;
        let counts = &mut self.rep.refusals_by_reason;
        let refusals = &mut self.rep.refusals;
        let i = &mut self.insts[inst as usize];
        let start = Instant::now();
        let result = i.placer.place(&req, now, |node| {
            let r = fleet[node.0 as usize].edge.try_admit(&req.resources);
            if let Err(r) = &r {
                *refusals += 1;
                match r.reason {
                    RefusalReason::Memory => counts.memory += 1,
                    RefusalReason::Cpu => counts.cpu += 1,
                    RefusalReason::Sandboxes => counts.sandboxes += 1,
                    RefusalReason::Disk => counts.disk += 1,
                }
            }
            r
        });
        i.busy += start.elapsed();
        i.calls += 1;
        match result {
            Ok(p) => {
                self.rep.placements += 1;
                self.rep.retries += u64::from(p.attempts - 1);
                let node = &mut self.fleet[p.node.0 as usize];
                node.used = node.used.plus(spec.used);
                for l in &spec.stack {
                    self.tick += 1;
                    let hit = node.cache.acquire(l, self.tick);
                    if spec.burst {
                        self.hits.1 += 1;
                        self.hits.3 += l.bytes;
                        if hit {
                            self.hits.0 += 1;
                            self.hits.2 += l.bytes;
                        }
                    }
                }
                self.specs[sid as usize].node = p.node.0;
                self.dirty = true;
                self.push(t.saturating_add(spec.lifetime_ns), Ev::Depart { spec: sid });
            }
            Err(e) => {
                if let Error::Refused { attempts, .. } = e {
                    self.rep.retries += u64::from(attempts.saturating_sub(1));
                }
                if spec.burst {
                    self.rep.failed_burst += 1;
                } else {
                    self.rep.failed_background += 1;
                }
                self.free_specs.push(sid);
            }
        }
        if spec.burst {
            self.burst_done += 1;
            if self.burst_done == self.cfg.burst {
                self.end_of_burst(t);
            }
        }
        Ok(())
    }

    fn depart(&mut self, sid: u32) {
        let spec = self.specs[sid as usize];
        let node = &mut self.fleet[spec.node as usize];
        node.edge.release(&spec.res);
        node.used = node.used.minus(spec.used);
        for l in &spec.stack {
            node.cache.release(l.id);
        }
        self.dirty = true;
        self.free_specs.push(sid);
    }

    fn mem_ratio(&self) -> f64 {
        max_over_mean(
            self.fleet
                .iter()
                .map(|n| n.edge.reserved().mem_bytes as f64),
        )
    }

    fn end_of_burst(&mut self, t: u64) {
        self.burst_end = Some(t);
        self.rep.max_over_mean = self.mem_ratio();
        self.rep.peak_max_over_mean = self.rep.peak_max_over_mean.max(self.rep.max_over_mean);
        self.rep.max_over_mean_count =
            max_over_mean(self.fleet.iter().map(|n| f64::from(n.edge.sandboxes())));
        let cap = self.cfg.node_capacity.mem_bytes.max(1) as f64;
        self.rep.mean_mem_util = self
            .fleet
            .iter()
            .map(|n| n.edge.reserved().mem_bytes as f64 / cap)
            .sum::<f64>()
            / self.fleet.len() as f64;
        self.rep.burst_seconds = t.saturating_sub(self.burst_start) as f64 / 1e9;
        self.rep
            .series
            .push((self.rep.burst_seconds, self.rep.max_over_mean));
    }

    fn sample(&mut self, t: u64) {
        let r = self.mem_ratio();
        let rel = (t as f64 - self.burst_start as f64) / 1e9;
        self.rep.series.push((rel, r));
        if t >= self.burst_start && self.burst_end.is_none() {
            self.rep.peak_max_over_mean = self.rep.peak_max_over_mean.max(r);
        }
    }

    fn run(mut self) -> Result<SimReport, Error> {
        let cfg = self.cfg;
        if cfg.background > 0.0 && cfg.burst_start_after_warmup() {
            self.push(0, Ev::BackgroundJob);
        }
        if !cfg.snapshot_age.is_zero() {
            self.push(ns(cfg.snapshot_age), Ev::Snapshot);
        }
        let first_sample = self.burst_start.saturating_sub(1_000_000_000);
        self.push(first_sample, Ev::Sample);
        if cfg.burst > 0 {
            self.push(self.burst_start, Ev::BurstArrival);
        } else {
            self.end_of_burst(self.burst_start);
        }
        let after = ns(cfg.after_burst);
        let every = ns(cfg.sample_every);
        while let Some(Reverse((t, _, ev))) = self.heap.pop() {
            match ev {
                Ev::Snapshot => {
                    self.publish(t)?;
                    self.push(t.saturating_add(ns(cfg.snapshot_age)), Ev::Snapshot);
                }
                Ev::Sample => {
                    self.sample(t);
                    match self.burst_end {
                        Some(end) if t >= end.saturating_add(after) => break,
                        _ => self.push(t.saturating_add(every), Ev::Sample),
                    }
                }
                Ev::BackgroundJob => self.background_job(t),
                Ev::BurstArrival => self.burst_arrival(t),
                Ev::Decide { inst, spec } => self.decide(t, inst, spec)?,
                Ev::Depart { spec } => self.depart(spec),
            }
        }
        let (calls, busy) = self.insts.iter().fold((0u64, 0f64), |(c, b), i| {
            (c + i.calls, b + i.busy.as_secs_f64())
        });
        self.rep.placements_per_s = if busy > 0.0 { calls as f64 / busy } else { 0.0 };
        let (h, n, hb, nb) = self.hits;
        self.rep.layer_hit_rate_count = if n > 0 { h as f64 / n as f64 } else { 0.0 };
        self.rep.layer_hit_rate = if nb > 0 { hb as f64 / nb as f64 } else { 0.0 };
        self.rep.series.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(self.rep)
    }
}

impl SimConfig {
    fn burst_start_after_warmup(&self) -> bool {
        !self.warmup.is_zero()
    }
}

/// Run one simulation.
pub fn run(cfg: &SimConfig) -> Result<SimReport, Error> {
    Sim::new(cfg)?.run()
}
