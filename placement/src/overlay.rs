//! The local overlay: this instance's own placements that the snapshot does not show yet.
//!
//! Every placement the instance makes is recorded with its time. An entry counts on top of
//! the snapshot until a snapshot taken after it (by more than `settle`, the time a create
//! takes to show in the node's status) arrives, or until it is `ttl` old, whichever comes
//! first: the TTL bounds the damage when a node never reports a sandbox (its create failed
//! after admission, say). A snapshot whose nodes were taken at different times
//! ([`Snapshot::new_per_node`]) drops an entry by its node's time. Entries are kept in time
//! order: the cost is O(1) amortised per placement, plus O(entries) when a snapshot arrives.
//!
//! A placement sent to a real node (a front's create) is *in flight* until the snapshot is
//! known to show it. The time rule cannot know that: a busy node may count a create seconds
//! after it was sent. So each node's status may say how many of this instance's sends it has
//! counted (`seen`, given with the snapshot): sends are numbered per node, and the first
//! `seen` of them (sends arrive about in order) are in the snapshot, the rest are not,
//! whatever the times. Without `seen` for a node (a node that does not count them, or
//! restarted), an admitted send counts until a snapshot of its node taken `settle` after the
//! answer; a refused or failed one stops counting at its answer; the TTL bounds them all.

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

/// A placement in flight, named by [`Overlay::send`]'s answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// A send: its ticket, its number among the sends to its node, when its node admitted it.
#[derive(Clone, Copy, Debug)]
struct Sent {
    ticket: Ticket,
    seq: u64,
    admitted_at: Option<Time>,
    e: Entry,
}

#[derive(Debug)]
pub(crate) struct Overlay {
    ttl: Duration,
    settle: Duration,
    entries: VecDeque<Entry>,
    /// Sends not known to be in the snapshot yet, oldest first.
    in_flight: VecDeque<Sent>,
    next_ticket: u64,
    /// Sends so far, per node.
    sends: std::collections::HashMap<NodeId, u64>,
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
            in_flight: VecDeque::new(),
            next_ticket: 0,
            sends: Default::default(),
            delta: vec![Delta::default(); n],
            recent: vec![Vec::new(); n],
        }
    }

    /// Entries held, those in flight included.
    pub(crate) fn len(&self) -> usize {
        self.entries.len() + self.in_flight.len()
    }

    /// A new snapshot: drop what it already shows (by time, and by `seen`: per node, how
    /// many of this instance's sends its state counts), realign the rest with its nodes.
    pub(crate) fn rebase(&mut self, snapshot: &Snapshot, seen: &[(NodeId, u64)]) {
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
        self.in_flight.retain(|f| {
            let shown = seen
                .iter()
                .find(|(n, _)| *n == f.e.node)
                .is_some_and(|&(_, k)| f.seq < k);
            let settled = match (f.admitted_at, snapshot.position(f.e.node)) {
                (Some(at), Some(p)) => at.saturating_add(settle) < snapshot.taken_at_of(p),
                _ => false,
            };
            !shown && !settled
        });
        let n = snapshot.nodes().len();
        self.delta.clear();
        self.delta.resize(n, Delta::default());
        self.recent.iter_mut().for_each(Vec::clear);
        self.recent.resize_with(n, Vec::new);
        let all = self
            .entries
            .iter_mut()
            .chain(self.in_flight.iter_mut().map(|f| &mut f.e));
        for e in all {
            e.pos = snapshot.position(e.node).map(|p| p as u32);
            if let Some(p) = e.pos {
                let p = p as usize;
                add(&mut self.delta[p], &e.reserved);
                remember(&mut self.recent[p], &e.layers[..usize::from(e.n_layers)]);
            }
        }
    }

    /// Drop entries `ttl` old at `now`, in flight or not. Their layer hints stay until the
    /// next snapshot.
    pub(crate) fn expire(&mut self, now: Time) {
        let ttl = self.ttl;
        let old = |e: &Entry| e.at.saturating_add(ttl) <= now;
        while let Some(e) = self.entries.front().copied().filter(old) {
            self.subtract(&e);
            self.entries.pop_front();
        }
        while let Some(f) = self.in_flight.front().copied().filter(|f| old(&f.e)) {
            self.subtract(&f.e);
            self.in_flight.pop_front();
        }
    }

    fn subtract(&mut self, e: &Entry) {
        if let Some(p) = e.pos {
            let d = &mut self.delta[p as usize];
            d.reserved = d.reserved.minus(e.reserved);
            d.sandboxes = d.sandboxes.saturating_sub(1);
        }
    }

    /// `req` on `node` (at position `pos` of the snapshot) at `at`, counted from now on.
    fn entry(&mut self, at: Time, node: NodeId, pos: Option<usize>, req: &Request) -> Entry {
        let mut layers = [LayerId(0); LAYERS_KEPT];
        let top = &req.layers[req.layers.len().saturating_sub(LAYERS_KEPT)..];
        for (slot, l) in layers.iter_mut().zip(top) {
            *slot = l.id;
        }
        if let Some(p) = pos {
            add(&mut self.delta[p], &req.resources);
            remember(&mut self.recent[p], &layers[..top.len()]);
        }
        Entry {
            at,
            node,
            pos: pos.map(|p| p as u32),
            reserved: req.resources,
            layers,
            n_layers: top.len() as u8,
        }
    }

    /// This instance placed `req` on `node` (at position `pos` of the snapshot) at `at`,
    /// and the node admitted it then.
    pub(crate) fn record(&mut self, at: Time, node: NodeId, pos: Option<usize>, req: &Request) {
        let e = self.entry(at, node, pos, req);
        self.push(e);
    }

    /// Entries stay in time order (an answer's time is never before the newest entry's).
    fn push(&mut self, mut e: Entry) {
        if let Some(last) = self.entries.back() {
            e.at = e.at.max(last.at);
        }
        self.entries.push_back(e);
    }

    /// This instance sent `req` to `node` at `at`; its answer is to come
    /// ([`Overlay::answered`]).
    pub(crate) fn send(
        &mut self,
        at: Time,
        node: NodeId,
        pos: Option<usize>,
        req: &Request,
    ) -> Ticket {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        let n = self.sends.entry(node).or_insert(0);
        let seq = *n;
        *n += 1;
        let e = self.entry(at, node, pos, req);
        self.in_flight.push_back(Sent {
            ticket,
            seq,
            admitted_at: None,
            e,
        });
        ticket
    }

    /// The answer to `ticket` came at `at`: admitted, it counts until a snapshot shows it;
    /// not, it no longer counts. An unknown ticket (expired, shown, answered before) changes
    /// nothing.
    pub(crate) fn answered(&mut self, ticket: Ticket, at: Time, admitted: bool) {
        let Some(i) = self.in_flight.iter().position(|f| f.ticket == ticket) else {
            return;
        };
        if admitted {
            let f = &mut self.in_flight[i];
            f.admitted_at.get_or_insert(at);
        } else if let Some(f) = self.in_flight.remove(i) {
            self.subtract(&f.e);
        }
    }

    /// How many sends to `node` this instance made.
    pub(crate) fn sends_to(&self, node: NodeId) -> u64 {
        self.sends.get(&node).copied().unwrap_or(0)
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
