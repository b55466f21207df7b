//! Placement policies behind one narrow trait, and the view of the fleet they choose from.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::admission::allowed;
use crate::model::{NodeState, Request, Resources};
use crate::overlay::Delta;
use crate::Error;

/// The fleet as one placement instance sees it: the shared snapshot, plus (when the placer
/// uses it) its own overlay, minus the nodes it must not use now (blocked after a refusal,
/// or already tried for this request). Positions are those of [`crate::Snapshot::nodes`].
#[derive(Debug)]
pub struct View<'a> {
    pub(crate) nodes: &'a [NodeState],
    pub(crate) delta: Option<&'a [Delta]>,
    /// How many times the overlay counts (see [`crate::PlacerConfig::overlay_weight`]).
    pub(crate) weight: f64,
    pub(crate) recent: Option<&'a [Vec<crate::LayerId>]>,
    pub(crate) skip: &'a [bool],
    pub(crate) prep: &'a [Prepared],
}

/// What a placer derives from each node of a snapshot once, when it arrives: its limits in
/// absolute units (memory, CPU, disk, count), their inverses, and its rendezvous hash.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Prepared {
    limit: [u64; 4],
    inverse: [f64; 4],
    hash: u64,
}

impl Prepared {
    pub(crate) fn of(n: &NodeState) -> Prepared {
        let l = &n.limits;
        let limit = [
            allowed(n.capacity.mem_bytes, l.mem_overcommit),
            allowed(n.capacity.cpu_millis, l.cpu_overcommit),
            allowed(n.capacity.disk_bytes, l.disk_overcommit),
            u64::from(l.max_sandboxes),
        ];
        Prepared {
            limit,
            inverse: limit.map(|x| 1.0 / x.max(1) as f64),
            hash: mix(u64::from(n.id.0)),
        }
    }
}

impl View<'_> {
    /// How many nodes (available or not).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node at `pos` as the snapshot shows it.
    pub fn node(&self, pos: usize) -> &NodeState {
        &self.nodes[pos]
    }

    /// Whether the node at `pos` may be chosen now.
    pub fn available(&self, pos: usize) -> bool {
        !self.skip[pos]
    }

    /// What the node at `pos` reserves and how many sandboxes it has: the snapshot's
    /// figures plus this instance's overlay (times its weight).
    pub fn reserved(&self, pos: usize) -> (Resources, u32) {
        let n = &self.nodes[pos];
        match self.delta {
            Some(d) if self.weight == 1.0 => (
                n.reserved.plus(d[pos].reserved),
                n.sandboxes.saturating_add(d[pos].sandboxes),
            ),
            Some(d) => {
                let w = self.weight;
                let d = &d[pos];
                let scaled = Resources {
                    cpu_millis: (d.reserved.cpu_millis as f64 * w) as u64,
                    mem_bytes: (d.reserved.mem_bytes as f64 * w) as u64,
                    disk_bytes: (d.reserved.disk_bytes as f64 * w) as u64,
                };
                let count = (f64::from(d.sandboxes) * w).min(f64::from(u32::MAX)) as u32;
                (n.reserved.plus(scaled), n.sandboxes.saturating_add(count))
            }
            None => (n.reserved, n.sandboxes),
        }
    }

    /// The node's load once it took `req`: its dominant share (the largest of reserved
    /// memory, CPU, disk and sandbox count over what its limits allow), or `None` when it is
    /// unavailable or its limits would refuse `req` by this view (the rule of
    /// [`crate::Limits::check`]).
    pub fn load_after(&self, pos: usize, req: &Request<'_>) -> Option<f64> {
        if self.skip[pos] {
            return None;
        }
        let p = &self.prep[pos];
        let (r, count) = self.reserved(pos);
        let q = &req.resources;
        let have = [r.mem_bytes, r.cpu_millis, r.disk_bytes, u64::from(count)];
        let need = [q.mem_bytes, q.cpu_millis, q.disk_bytes, 1];
        let mut share = 0f64;
        for j in 0..4 {
            if need[j] > p.limit[j].saturating_sub(have[j]) {
                return None;
            }
            share = share.max(have[j].saturating_add(need[j]) as f64 * p.inverse[j]);
        }
        Some(share)
    }

    /// The fraction of `req`'s layer bytes the node at `pos` has cached (by the snapshot), or
    /// will have (this instance sent a sandbox of that layer there since): 0.0 to 1.0.
    pub fn cached_fraction(&self, pos: usize, req: &Request<'_>) -> f64 {
        let n = &self.nodes[pos];
        let recent = self.recent.map(|r| r[pos].as_slice()).unwrap_or(&[]);
        let (mut total, mut cached) = (0u64, 0u64);
        for l in req.layers {
            total = total.saturating_add(l.bytes);
            if n.caches(l.id) || recent.contains(&l.id) {
                cached = cached.saturating_add(l.bytes);
            }
        }
        if total == 0 {
            0.0
        } else {
            cached as f64 / total as f64
        }
    }
}

/// A placement policy: given the view and a request, the position of the node to try.
/// `None` when no available node fits by the view. Randomness comes from the placer's
/// seeded generator, so a placer is deterministic given its seed.
pub trait Policy: Send + fmt::Debug {
    /// Choose a node for `req`.
    fn pick(
        &mut self,
        view: &View<'_>,
        req: &Request<'_>,
        rng: &mut fastrand::Rng,
    ) -> Option<usize>;
}

/// A uniformly random available node (or `None`). Tries a few random draws, then scans.
fn random_available(view: &View<'_>, rng: &mut fastrand::Rng) -> Option<usize> {
    let n = view.len();
    if n == 0 {
        return None;
    }
    for _ in 0..8 {
        let i = rng.usize(..n);
        if view.available(i) {
            return Some(i);
        }
    }
    let avail = (0..n).filter(|&i| view.available(i)).count();
    if avail == 0 {
        return None;
    }
    (0..n)
        .filter(|&i| view.available(i))
        .nth(rng.usize(..avail))
}

/// The available node of least load after `req`, ties broken uniformly at random.
fn least_loaded(view: &View<'_>, req: &Request<'_>, rng: &mut fastrand::Rng) -> Option<usize> {
    let mut best: Option<(f64, usize)> = None;
    let mut ties = 0u32;
    for i in 0..view.len() {
        let Some(l) = view.load_after(i, req) else {
            continue;
        };
        match best {
            Some((b, _)) if l > b => {}
            Some((b, _)) if l == b => {
                // Reservoir sampling among the equal minima.
                ties += 1;
                if rng.u32(..ties) == 0 {
                    best = Some((l, i));
                }
            }
            _ => {
                best = Some((l, i));
                ties = 1;
            }
        }
    }
    best.map(|(_, i)| i)
}

/// Random: any available node, whatever its load (the balls-into-bins baseline).
#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn pick(&mut self, view: &View<'_>, _: &Request<'_>, rng: &mut fastrand::Rng) -> Option<usize> {
        random_available(view, rng)
    }
}

/// Least-loaded: the node of least load by the view, ties at random. On a stale snapshot
/// without an overlay every instance picks the same few nodes: it herds.
#[derive(Debug, Default)]
pub struct LeastLoaded;

impl Policy for LeastLoaded {
    fn pick(
        &mut self,
        view: &View<'_>,
        req: &Request<'_>,
        rng: &mut fastrand::Rng,
    ) -> Option<usize> {
        least_loaded(view, req, rng)
    }
}

/// Power-of-k choices: sample k distinct available nodes, take the least loaded of them. If
/// none of the k fits by the view, the least loaded of all (a nearly full fleet still finds
/// its last free node).
#[derive(Debug)]
pub struct PowerOfK {
    k: usize,
    seen: Vec<usize>,
}

impl PowerOfK {
    /// `k` in 1..=[`MAX_K`] choices.
    pub fn new(k: usize) -> Result<PowerOfK, Error> {
        check_k(k)?;
        Ok(PowerOfK {
            k,
            seen: Vec::with_capacity(k),
        })
    }
}

/// The most choices a power-of-k policy samples (a larger k is a scan, and costs memory).
pub const MAX_K: usize = 1024;

fn check_k(k: usize) -> Result<(), Error> {
    if k == 0 || k > MAX_K {
        return Err(Error::Invalid {
            what: "k",
            why: format!("power-of-k needs 1 ≤ k ≤ {MAX_K}, not {k}"),
        });
    }
    Ok(())
}

/// Sample up to `k` distinct available positions into `seen` (bounded tries).
fn sample_k(view: &View<'_>, k: usize, rng: &mut fastrand::Rng, seen: &mut Vec<usize>) {
    seen.clear();
    let n = view.len();
    if n == 0 {
        return;
    }
    let mut tries = 4 * k + 8;
    while seen.len() < k.min(n) && tries > 0 {
        tries -= 1;
        let i = rng.usize(..n);
        if view.available(i) && !seen.contains(&i) {
            seen.push(i);
        }
    }
}

impl Policy for PowerOfK {
    fn pick(
        &mut self,
        view: &View<'_>,
        req: &Request<'_>,
        rng: &mut fastrand::Rng,
    ) -> Option<usize> {
        sample_k(view, self.k, rng, &mut self.seen);
        let mut best: Option<(f64, usize)> = None;
        for &i in &self.seen {
            if let Some(l) = view.load_after(i, req) {
                if best.is_none_or(|(b, _)| l < b) {
                    best = Some((l, i));
                }
            }
        }
        best.map(|(_, i)| i)
            .or_else(|| least_loaded(view, req, rng))
    }
}

/// Power-of-k with layer locality. Candidates: k random available nodes plus the `homes`
/// nodes that rendezvous hashing assigns to the request's top (most specific) layer, so that
/// every instance, whatever its snapshot, sends one workspace to the same few nodes first.
/// Score: load × (1 − `bonus` × cached fraction); the least score wins. The bonus is bounded:
/// a node that caches the whole stack wins only while its load is below 1 / (1 − bonus)
/// times the others', so a popular stack cannot herd onto its homes: they fill up to that
/// margin and the random candidates take the rest.
#[derive(Debug)]
pub struct Locality {
    k: usize,
    homes: usize,
    bonus: f64,
    seen: Vec<usize>,
    top: Vec<(u64, usize)>,
}

impl Locality {
    /// `k` in 1..=[`MAX_K`] random choices, up to [`MAX_K`] hashed ones, a bonus in
    /// [0, 1).
    pub fn new(k: usize, homes: usize, bonus: f64) -> Result<Locality, Error> {
        check_k(k)?;
        if homes > MAX_K {
            return Err(Error::Invalid {
                what: "homes",
                why: format!("{homes} is more than {MAX_K}"),
            });
        }
        if !(0.0..1.0).contains(&bonus) {
            return Err(Error::Invalid {
                what: "locality bonus",
                why: format!("{bonus} is not in [0, 1)"),
            });
        }
        Ok(Locality {
            k,
            homes,
            bonus,
            seen: Vec::with_capacity(k + homes),
            top: Vec::with_capacity(homes + 1),
        })
    }
}

/// A 64-bit mix (splitmix64's finaliser): the rendezvous weight of a (layer, node) pair.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Policy for Locality {
    fn pick(
        &mut self,
        view: &View<'_>,
        req: &Request<'_>,
        rng: &mut fastrand::Rng,
    ) -> Option<usize> {
        sample_k(view, self.k, rng, &mut self.seen);
        if let (Some(key), true) = (req.layers.last(), self.homes > 0) {
            // The `homes` available nodes of highest weight for this layer.
            self.top.clear();
            for i in 0..view.len() {
                if !view.available(i) {
                    continue;
                }
                let w = mix(key.id.0 ^ view.prep[i].hash);
                if self.top.len() < self.homes {
                    self.top.push((w, i));
                } else if let Some(min) = self.top.iter_mut().min_by_key(|(w, _)| *w) {
                    if w > min.0 {
                        *min = (w, i);
                    }
                }
            }
            for &(_, i) in &self.top {
                if !self.seen.contains(&i) {
                    self.seen.push(i);
                }
            }
        }
        let mut best: Option<(f64, usize)> = None;
        for &i in &self.seen {
            if let Some(l) = view.load_after(i, req) {
                let s = l * (1.0 - self.bonus * view.cached_fraction(i, req));
                if best.is_none_or(|(b, _)| s < b) {
                    best = Some((s, i));
                }
            }
        }
        best.map(|(_, i)| i)
            .or_else(|| least_loaded(view, req, rng))
    }
}

/// The policies by name, with whether the placer overlays its own placements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[non_exhaustive]
pub enum PolicyKind {
    /// [`Random`].
    Random,
    /// [`LeastLoaded`] on the snapshot alone.
    LeastLoaded,
    /// [`LeastLoaded`] on the snapshot plus the overlay (not in the list; shown
    /// because it isolates what the overlay does for a deterministic policy).
    LeastLoadedOverlay,
    /// [`PowerOfK`] on the snapshot alone.
    PowerOfK,
    /// [`PowerOfK`] on the snapshot plus the overlay.
    PowerOfKOverlay,
    /// [`Locality`] on the snapshot plus the overlay.
    PowerOfKOverlayLocality,
}

/// The parameters of the power-of-k policies.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PolicyParams {
    /// Random choices.
    pub k: usize,
    /// Rendezvous-hashed candidates of the top layer (locality only).
    pub homes: usize,
    /// The locality bonus, in [0, 1).
    pub bonus: f64,
}

impl Default for PolicyParams {
    fn default() -> PolicyParams {
        PolicyParams {
            k: 2,
            homes: 1,
            bonus: 0.02,
        }
    }
}

impl PolicyKind {
    /// Every policy, in the order the reports show them.
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::LeastLoadedOverlay,
        PolicyKind::PowerOfK,
        PolicyKind::PowerOfKOverlay,
        PolicyKind::PowerOfKOverlayLocality,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::LeastLoadedOverlay => "least-loaded+overlay",
            PolicyKind::PowerOfK => "pow-k",
            PolicyKind::PowerOfKOverlay => "pow-k+overlay",
            PolicyKind::PowerOfKOverlayLocality => "pow-k+overlay+locality",
        }
    }

    /// Whether the placer overlays its own recent placements for this policy.
    pub fn overlay(self) -> bool {
        matches!(
            self,
            PolicyKind::LeastLoadedOverlay
                | PolicyKind::PowerOfKOverlay
                | PolicyKind::PowerOfKOverlayLocality
        )
    }

    /// A new policy of this kind.
    pub fn build(self, p: &PolicyParams) -> Result<Box<dyn Policy>, Error> {
        Ok(match self {
            PolicyKind::Random => Box::new(Random),
            PolicyKind::LeastLoaded | PolicyKind::LeastLoadedOverlay => Box::new(LeastLoaded),
            PolicyKind::PowerOfK | PolicyKind::PowerOfKOverlay => Box::new(PowerOfK::new(p.k)?),
            PolicyKind::PowerOfKOverlayLocality => Box::new(Locality::new(p.k, p.homes, p.bonus)?),
        })
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<PolicyKind, Error> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| Error::Invalid {
                what: "policy",
                why: format!(
                    "{s:?} is none of {}",
                    PolicyKind::ALL.map(PolicyKind::name).join(", ")
                ),
            })
    }
}
