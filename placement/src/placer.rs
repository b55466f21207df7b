//! One placement instance: a policy, the shared snapshot, its own overlay, the nodes that
//! refused it, and the bounded retry loop.

use std::sync::Arc;
use std::time::Duration;

use crate::admission::Refusal;
use crate::model::{NodeId, Request, Snapshot, Time};
use crate::overlay::{Overlay, Ticket};
use crate::policy::{Policy, Prepared, View};
use crate::Error;

/// How a placer uses what it knows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlacerConfig {
    /// Overlay this instance's own recent placements on the snapshot.
    pub overlay: bool,
    /// How many times an overlay entry counts (≥ 1). With m instances on one snapshot,
    /// every instance sees the same holes in it and, counting only its own placements, each
    /// fills them whole: m times too much, then the next snapshot shows the overshoot and
    /// they all avoid it together (the feedback has gain −(m − 1)). Counting its own
    /// placements m times assumes the others made the same choices (which the shared
    /// snapshot makes likely), so together they fill each hole once. 1 for one instance;
    /// an instance that gets more than its share of the traffic then corrects a little
    /// less than it could, never more.
    pub overlay_weight: f64,
    /// An overlay entry counts for at most this long (in case a snapshot never shows it).
    pub overlay_ttl: Duration,
    /// An entry stays until a snapshot taken more than this after it: the time a create
    /// takes to show in the node's status (zero when admission is instantaneous, as in the
    /// simulator; a front sets its create round trip).
    pub settle: Duration,
    /// Nodes tried per request, the first included (≥ 1).
    pub max_attempts: u32,
    /// A node that refused is not tried again until a snapshot taken after the refusal, or
    /// for at most this long.
    pub refusal_ttl: Duration,
}

impl Default for PlacerConfig {
    fn default() -> PlacerConfig {
        PlacerConfig {
            overlay: true,
            overlay_weight: 1.0,
            overlay_ttl: Duration::from_secs(30),
            settle: Duration::ZERO,
            max_attempts: 4,
            refusal_ttl: Duration::from_secs(10),
        }
    }
}

/// Where a request went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The node that admitted it.
    pub node: NodeId,
    /// Nodes tried, this one included (1 = no retry).
    pub attempts: u32,
}

/// One placement instance. Not shared: each front instance has its own (its overlay is its
/// own by definition); they share only the snapshot.
#[derive(Debug)]
pub struct Placer {
    policy: Box<dyn Policy>,
    cfg: PlacerConfig,
    snapshot: Arc<Snapshot>,
    overlay: Overlay,
    /// (position, refused at) of nodes that refused since the snapshot.
    blocked: Vec<(usize, Time)>,
    /// Scratch, aligned with the snapshot: positions not to choose for this request.
    skip: Vec<bool>,
    /// Aligned with the snapshot: each node's limits, derived once.
    prep: Vec<Prepared>,
    rng: fastrand::Rng,
}

impl Placer {
    /// A placer of `policy` on `snapshot`, its randomness seeded by `seed`.
    pub fn new(
        policy: Box<dyn Policy>,
        cfg: PlacerConfig,
        snapshot: Arc<Snapshot>,
        seed: u64,
    ) -> Result<Placer, Error> {
        if !(cfg.overlay_weight >= 1.0 && cfg.overlay_weight <= 1e6) {
            return Err(Error::Invalid {
                what: "overlay_weight",
                why: format!("{} is not in [1, 1e6]", cfg.overlay_weight),
            });
        }
        if cfg.max_attempts == 0 {
            return Err(Error::Invalid {
                what: "max_attempts",
                why: "a placer must try at least one node".into(),
            });
        }
        let overlay = Overlay::new(cfg.overlay_ttl, cfg.settle, &snapshot);
        let skip = vec![false; snapshot.nodes().len()];
        let prep = snapshot.nodes().iter().map(Prepared::of).collect();
        Ok(Placer {
            prep,
            policy,
            cfg,
            snapshot,
            overlay,
            blocked: Vec::new(),
            skip,
            rng: fastrand::Rng::with_seed(seed),
        })
    }

    /// The snapshot in use.
    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.snapshot
    }

    /// Overlay entries held now.
    pub fn overlay_len(&self) -> usize {
        self.overlay.len()
    }

    /// The watcher published a new snapshot: the overlay drops what it shows, refusals older
    /// than it are forgotten.
    pub fn set_snapshot(&mut self, snapshot: Arc<Snapshot>) {
        self.set_snapshot_seen(snapshot, &[]);
    }

    /// [`Placer::set_snapshot`], with what its nodes say of this instance's sends: `seen`
    /// holds, for nodes that count them, how many of the placements this instance
    /// [`Placer::sent`] there their state counts.
    pub fn set_snapshot_seen(&mut self, snapshot: Arc<Snapshot>, seen: &[(NodeId, u64)]) {
        let taken = snapshot.taken_at();
        // Positions change with the node list: map refusals through the ids.
        let old = Arc::clone(&self.snapshot);
        self.blocked.retain_mut(|(pos, at)| {
            if *at <= taken {
                return false;
            }
            match snapshot.position(old.nodes()[*pos].id) {
                Some(p) => {
                    *pos = p;
                    true
                }
                None => false,
            }
        });
        self.overlay.rebase(&snapshot, seen);
        self.skip.clear();
        self.skip.resize(snapshot.nodes().len(), false);
        self.prep.clear();
        self.prep.extend(snapshot.nodes().iter().map(Prepared::of));
        self.snapshot = snapshot;
    }

    /// Choose a node for `req` at `now`, avoiding `excluded` (nodes already tried for it) and
    /// the nodes that refused recently. Records nothing: call [`Placer::placed`] or
    /// [`Placer::refused`] with the node's answer.
    pub fn choose(
        &mut self,
        req: &Request<'_>,
        now: Time,
        excluded: &[NodeId],
    ) -> Result<NodeId, Error> {
        let ttl = self.cfg.refusal_ttl;
        self.blocked.retain(|(_, at)| at.saturating_add(ttl) > now);
        if self.cfg.overlay {
            self.overlay.expire(now);
        }
        for &(p, _) in &self.blocked {
            self.skip[p] = true;
        }
        for id in excluded {
            if let Some(p) = self.snapshot.position(*id) {
                self.skip[p] = true;
            }
        }
        let view = View {
            nodes: self.snapshot.nodes(),
            delta: self.cfg.overlay.then_some(self.overlay.delta.as_slice()),
            weight: self.cfg.overlay_weight,
            recent: self.cfg.overlay.then_some(self.overlay.recent.as_slice()),
            skip: &self.skip,
            prep: &self.prep,
        };
        let pick = self.policy.pick(&view, req, &mut self.rng);
        for &(p, _) in &self.blocked {
            self.skip[p] = false;
        }
        for id in excluded {
            if let Some(p) = self.snapshot.position(*id) {
                self.skip[p] = false;
            }
        }
        match pick {
            Some(p) => Ok(self.snapshot.nodes()[p].id),
            None => Err(Error::NoCandidate),
        }
    }

    /// `node` admitted `req` at `now`: into the overlay.
    pub fn placed(&mut self, node: NodeId, req: &Request<'_>, now: Time) {
        if self.cfg.overlay {
            let pos = self.snapshot.position(node);
            self.overlay.record(now, node, pos, req);
        }
    }

    /// `req` was sent to `node` at `now`, its answer yet to come (a create on its way to a
    /// real node): it counts in the overlay until a snapshot is known to show it (see
    /// [`Placer::set_snapshot_seen`]), or, once admitted, until a snapshot taken `settle`
    /// after [`Placer::answered`]; or the overlay's TTL. `None` without an overlay.
    pub fn sent(&mut self, node: NodeId, req: &Request<'_>, now: Time) -> Option<Ticket> {
        self.cfg.overlay.then(|| {
            let pos = self.snapshot.position(node);
            self.overlay.send(now, node, pos, req)
        })
    }

    /// How many placements this instance [`Placer::sent`] to `node`.
    pub fn sends_to(&self, node: NodeId) -> u64 {
        self.overlay.sends_to(node)
    }

    /// The node answered the request of `ticket` at `now`: `admitted`, it counts until a
    /// snapshot shows it; not (refused, failed), it no longer counts.
    pub fn answered(&mut self, ticket: Option<Ticket>, now: Time, admitted: bool) {
        if let Some(t) = ticket {
            self.overlay.answered(t, now, admitted);
        }
    }

    /// A node refused at `now`: not tried again until a newer snapshot (or `refusal_ttl`).
    pub fn refused(&mut self, refusal: &Refusal, now: Time) {
        if let Some(p) = self.snapshot.position(refusal.node) {
            match self.blocked.iter_mut().find(|(q, _)| *q == p) {
                Some(b) => b.1 = now,
                None => self.blocked.push((p, now)),
            }
        }
    }

    /// Place `req` at `now`: choose, ask the node (`admit`, the node's edge admission),
    /// and on a refusal retry elsewhere, at most `max_attempts` nodes in all.
    pub fn place<F>(
        &mut self,
        req: &Request<'_>,
        now: Time,
        mut admit: F,
    ) -> Result<Placement, Error>
    where
        F: FnMut(NodeId) -> Result<(), Refusal>,
    {
        let mut tried: [NodeId; 8] = [NodeId(0); 8];
        let mut n_tried = 0usize;
        let mut last = None;
        for attempt in 1..=self.cfg.max_attempts {
            // Exclusion is exact for the first eight nodes tried, then left to the
            // refusal blocks (which exclude refusing nodes too).
            let node = match self.choose(req, now, &tried[..n_tried]) {
                Ok(n) => n,
                Err(e) => {
                    return Err(match last {
                        Some(last) => Error::Refused {
                            attempts: attempt - 1,
                            last,
                        },
                        None => e,
                    })
                }
            };
            match admit(node) {
                Ok(()) => {
                    self.placed(node, req, now);
                    return Ok(Placement {
                        node,
                        attempts: attempt,
                    });
                }
                Err(r) => {
                    self.refused(&r, now);
                    if n_tried < tried.len() {
                        tried[n_tried] = node;
                        n_tried += 1;
                    }
                    last = Some(r);
                }
            }
        }
        Err(match last {
            Some(last) => Error::Refused {
                attempts: self.cfg.max_attempts,
                last,
            },
            None => Error::NoCandidate,
        })
    }
}
