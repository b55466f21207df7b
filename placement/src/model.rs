//! What the placer sees: nodes, resources, layers, requests, the fleet snapshot.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::admission::Limits;
use crate::Error;

/// A point in time: the time since an epoch the caller chooses (a monotonic clock's start in
/// a front, time zero in the simulator). Every time given to one placer must use one epoch.
pub type Time = Duration;

/// A node's identity, as the watcher names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node{}", self.0)
    }
}

/// A layer's identity (a digest of its `kind/name:version`, say): what a node caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct LayerId(pub u64);

/// A layer of a request's stack, with its size (what a node fetches when it lacks it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layer {
    /// Its identity.
    pub id: LayerId,
    /// Its size in bytes (meta image + data blobs).
    pub bytes: u64,
}

/// An amount of each resource a sandbox asks for or a node has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Resources {
    /// CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Memory in bytes.
    pub mem_bytes: u64,
    /// Local disk in bytes (the sandbox's writable upper, its quota).
    pub disk_bytes: u64,
}

impl Resources {
    /// `self + other`, saturating.
    pub fn plus(self, other: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_add(other.cpu_millis),
            mem_bytes: self.mem_bytes.saturating_add(other.mem_bytes),
            disk_bytes: self.disk_bytes.saturating_add(other.disk_bytes),
        }
    }

    /// `self - other`, saturating at zero.
    pub fn minus(self, other: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_sub(other.cpu_millis),
            mem_bytes: self.mem_bytes.saturating_sub(other.mem_bytes),
            disk_bytes: self.disk_bytes.saturating_sub(other.disk_bytes),
        }
    }
}

/// A sandbox to place: what it reserves and the layers it is composed of, lowest first (the
/// last layer is the most specific one, a task's workspace, say).
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// What the sandbox reserves on its node.
    pub resources: Resources,
    /// Its layer stack, lowest first.
    pub layers: &'a [Layer],
}

/// One node as the watcher last saw it.
#[derive(Clone, Debug)]
pub struct NodeState {
    /// The node.
    pub id: NodeId,
    /// What it has.
    pub capacity: Resources,
    /// What its live sandboxes reserve (the sum of their requests): what admission counts.
    pub reserved: Resources,
    /// What they actually use (CPU and memory measured on the node); informational, since
    /// idle sandboxes use a small part of what they reserve.
    pub used: Resources,
    /// Live sandboxes.
    pub sandboxes: u32,
    /// The limits its edge admission enforces.
    pub limits: Limits,
    /// The layers it has cached, sorted and without duplicates.
    pub layers: Arc<[LayerId]>,
}

impl NodeState {
    /// Whether the node caches `layer` (binary search in the sorted list).
    pub fn caches(&self, layer: LayerId) -> bool {
        self.layers.binary_search(&layer).is_ok()
    }
}

/// The fleet as the watcher saw it at `taken_at`: shared by every placement instance (an
/// `Arc`), never changed; the watcher publishes a new one.
#[derive(Debug)]
pub struct Snapshot {
    taken_at: Time,
    /// When each node's state was taken, if not all at `taken_at` (a watcher that keeps a
    /// slow node's last state); aligned with `nodes`.
    node_taken: Option<Vec<Time>>,
    nodes: Vec<NodeState>,
    index: HashMap<NodeId, usize>,
}

impl Snapshot {
    /// A snapshot of `nodes` taken at `taken_at`. Refuses duplicate node ids and layer lists
    /// that are not sorted and free of duplicates.
    pub fn new(taken_at: Time, nodes: Vec<NodeState>) -> Result<Snapshot, Error> {
        let mut index = HashMap::with_capacity(nodes.len());
        for (i, n) in nodes.iter().enumerate() {
            if index.insert(n.id, i).is_some() {
                return Err(Error::Invalid {
                    what: "snapshot",
                    why: format!("{} appears twice", n.id),
                });
            }
            if n.layers.windows(2).any(|w| w[0] >= w[1]) {
                return Err(Error::Invalid {
                    what: "snapshot",
                    why: format!("{}'s layers are not sorted and unique", n.id),
                });
            }
        }
        Ok(Snapshot {
            taken_at,
            node_taken: None,
            nodes,
            index,
        })
    }

    /// A snapshot whose node `i` was taken at `taken[i]` (a watcher that polls nodes apart,
    /// or keeps a slow node's last state): its `taken_at` is the oldest of them, and the
    /// overlay keeps a placement on node `i` until a state of node `i` taken after it.
    pub fn new_per_node(nodes: Vec<NodeState>, taken: Vec<Time>) -> Result<Snapshot, Error> {
        if taken.len() != nodes.len() {
            return Err(Error::Invalid {
                what: "snapshot",
                why: format!("{} times for {} nodes", taken.len(), nodes.len()),
            });
        }
        let oldest = taken.iter().copied().min().unwrap_or_default();
        let mut s = Snapshot::new(oldest, nodes)?;
        s.node_taken = Some(taken);
        Ok(s)
    }

    /// When the state of the node at position `pos` was taken.
    pub fn taken_at_of(&self, pos: usize) -> Time {
        self.node_taken
            .as_ref()
            .and_then(|t| t.get(pos).copied())
            .unwrap_or(self.taken_at)
    }

    /// When the watcher took it.
    pub fn taken_at(&self) -> Time {
        self.taken_at
    }

    /// Its age at `now` (zero if `now` is earlier).
    pub fn age(&self, now: Time) -> Duration {
        now.saturating_sub(self.taken_at)
    }

    /// The nodes, in the watcher's order.
    pub fn nodes(&self) -> &[NodeState] {
        &self.nodes
    }

    /// The position of `id` in [`Snapshot::nodes`].
    pub fn position(&self, id: NodeId) -> Option<usize> {
        self.index.get(&id).copied()
    }
}
