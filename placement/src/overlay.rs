//! The local overlay: this instance's own placements that the snapshot does not show yet.
//!
//! Every placement the instance makes is recorded with its time. An entry counts on top of
//! the snapshot until a snapshot taken after it (by more than `settle`, the time a create
//! takes to show in the node's status) arrives, or until it is `ttl` old, whichever comes
//! first: the TTL bounds the damage when a node never reports a sandbox (its create failed
//! after admission, say). A snapshot whose nodes were taken at different times
//! ([`Snapshot::new_per_node`]) drops an entry by its node's time. Entries are kept in time
//! order: the cost is O(1) amortised per placement, plus O(entries) when a snapshot arrives.

use std::collections::VecDeque;
use std::time::Duration;

use crate::model::{LayerId, NodeId, Request, Resources, Snapshot, Time};

/// How many of a request's layers (the top, most specific ones) an entry remembers.
pub(crate) const LAYERS_KEPT: usize = 4;

/// What the overlay adds to one node of the snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Reserved by this instance's recent placements.
    pub reserved: Resources,
    /// How many.
    pub sandboxes: u32,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    at: Time,
    node: NodeId,
    /// The node's position in the current snapshot, `None` if it is not in it.
    pos: Option<u32>,
    reserved: Resources,
    layers: [LayerId; LAYERS_KEPT],
    n_layers: u8,
}

#[derive(Debug)]
pub(crate) struct Overlay {
    ttl: Duration,
    settle: Duration,
    entries: VecDeque<Entry>,
    /// Aligned with the snapshot's nodes.
    pub(crate) delta: Vec<Delta>,
    /// Layers this instance sent to each node since the snapshot (hints for locality:
    /// the node will cache them); aligned with the snapshot's nodes, rebuilt on rebase.
    pub(crate) recent: Vec<Vec<LayerId>>,
}

impl Overlay {
    pub(crate) fn new(ttl: Duration, settle: Duration, snapshot: &Snapshot) -> Overlay {
        let n = snapshot.nodes().len();
        Overlay {
            ttl,
            settle,
            entries: VecDeque::new(),
            delta: vec![Delta::default(); n],
            recent: vec![Vec::new(); n],
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// A new snapshot: drop what it already shows, realign the rest with its nodes.
    pub(crate) fn rebase(&mut self, snapshot: &Snapshot) {
        let taken = snapshot.taken_at();
        while let Some(e) = self.entries.front() {
            if e.at.saturating_add(self.settle) < taken {
                self.entries.pop_front();
            } else {
                break;
            }
        }
        // Nodes taken later than the snapshot's oldest: their own time decides.
        let settle = self.settle;
        self.entries.retain(|e| {
            let pos = snapshot.position(e.node);
            pos.is_none_or(|p| e.at.saturating_add(settle) >= snapshot.taken_at_of(p))
        });
        let n = snapshot.nodes().len();
        self.delta.clear();
        self.delta.resize(n, Delta::default());
        self.recent.iter_mut().for_each(Vec::clear);
        self.recent.resize_with(n, Vec::new);
        for e in self.entries.iter_mut() {
            e.pos = snapshot.position(e.node).map(|p| p as u32);
            if let Some(p) = e.pos {
                let p = p as usize;
                add(&mut self.delta[p], &e.reserved);
                remember(&mut self.recent[p], &e.layers[..usize::from(e.n_layers)]);
            }
        }
    }

    /// Drop entries `ttl` old at `now`. Their layer hints stay until the next snapshot.
    pub(crate) fn expire(&mut self, now: Time) {
        while let Some(e) = self.entries.front() {
            if e.at.saturating_add(self.ttl) <= now {
                if let Some(p) = e.pos {
                    let d = &mut self.delta[p as usize];
                    d.reserved = d.reserved.minus(e.reserved);
                    d.sandboxes = d.sandboxes.saturating_sub(1);
                }
                self.entries.pop_front();
            } else {
                break;
            }
        }
    }

    /// This instance placed `req` on `node` (at position `pos` of the snapshot) at `at`.
    pub(crate) fn record(&mut self, at: Time, node: NodeId, pos: Option<usize>, req: &Request) {
        let mut layers = [LayerId(0); LAYERS_KEPT];
        let top = &req.layers[req.layers.len().saturating_sub(LAYERS_KEPT)..];
        for (slot, l) in layers.iter_mut().zip(top) {
            *slot = l.id;
        }
        if let Some(p) = pos {
            add(&mut self.delta[p], &req.resources);
            remember(&mut self.recent[p], &layers[..top.len()]);
        }
        self.entries.push_back(Entry {
            at,
            node,
            pos: pos.map(|p| p as u32),
            reserved: req.resources,
            layers,
            n_layers: top.len() as u8,
        });
    }
}

fn add(d: &mut Delta, r: &Resources) {
    d.reserved = d.reserved.plus(*r);
    d.sandboxes = d.sandboxes.saturating_add(1);
}

fn remember(recent: &mut Vec<LayerId>, layers: &[LayerId]) {
    for l in layers {
        if !recent.contains(l) {
            recent.push(*l);
        }
    }
}
