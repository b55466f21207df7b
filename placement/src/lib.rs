//! Placement of sandboxes on a fleet of nodes from a stale snapshot, and a simulator that
//! measures how well each policy balances a burst.
//!
//! # The model
//!
//! A watcher polls every node and publishes a [`Snapshot`] of the fleet (per node: capacity,
//! what its live sandboxes reserve and use, their count, its admission [`Limits`], the layers
//! it caches) every so often; every placement instance (a stateless front) shares it, so it
//! is always somewhat old. A [`Request`] asks for resources (CPU, memory, disk) and names
//! its layer stack. Each instance is a [`Placer`]: a [`Policy`] over a [`View`] of the fleet,
//! which is the snapshot plus, when enabled, the instance's **overlay** of its own recent
//! placements the snapshot does not show yet (each with a time to live), minus the nodes
//! that refused it since the snapshot. The node keeps the last word: its [`Edge`] admission
//! refuses a create past its memory, CPU-overcommit, sandbox-count or disk limit, with a
//! [`Refusal`] that says which and by how much; the placer blocks that node until a newer
//! snapshot and retries elsewhere, at most [`PlacerConfig::max_attempts`] nodes in all.
//!
//! # The policies ([`PolicyKind`])
//!
//! - `random`: any available node. The balls-into-bins baseline.
//! - `least-loaded`: the least loaded node by the snapshot. With stale information every
//!   instance picks the same few nodes until the next snapshot: it herds, and the edge
//!   refuses what it cannot take.
//! - `least-loaded+overlay`: the same with the overlay (an instance no longer herds with
//!   itself, but all instances still agree on the same nodes).
//! - `pow-k`: k distinct random nodes, the least loaded of them. Randomness spreads the
//!   instances' choices; with k = 2 the gap above the mean is O(log log n).
//! - `pow-k+overlay`: with the overlay, an instance's own burst is balanced on top of the
//!   snapshot. With m instances on one snapshot each sees the same holes in it; counting
//!   its own placements once, each would fill them whole (m times too much, then all avoid
//!   the overshoot together at the next snapshot: a feedback of gain −(m − 1)). So the
//!   overlay counts [`PlacerConfig::overlay_weight`] times, m in a fleet of m instances:
//!   together they fill each hole about once (measured in the simulator: at 4 instances and
//!   a 1 s snapshot, weight 1 ends a 32K burst at max/mean 1.04–1.10, weight 4 at 1.02–1.03).
//! - `pow-k+overlay+locality` ([`Locality`]): the k random candidates plus the top layer's
//!   rendezvous-hashed home nodes, scored load × (1 − bonus × cached fraction). The bonus is
//!   bounded (a cached node wins only while its load is within 1 / (1 − bonus) of the
//!   others'), so locality cannot herd a popular stack onto its homes.
//!
//! "Load" is a node's dominant share after the request: the largest of reserved memory, CPU,
//! disk and sandbox count over what its limits allow.
//!
//! # Invariants
//!
//! - A placer never chooses a node that is unavailable to it (refused since the snapshot, or
//!   already tried for the request), and tries at most `max_attempts` nodes per request.
//! - A placement counts in the overlay from when it is recorded until a snapshot taken after
//!   it (by more than `settle`) or until its TTL, never twice on top of a snapshot that
//!   shows it (given a correct `settle`).
//! - [`Edge::try_admit`] never lets a node's reservations pass its limits; a refusal
//!   reserves nothing.
//! - Everything is deterministic given the seeds: the placer's randomness and the
//!   simulator's come from seeded generators, and no decision depends on hash-map order or
//!   wall-clock time (the simulator measures the placer's speed but does not use it).
//! - Bad input is an [`Error`], never a panic.
//!
//! # The simulator
//!
//! [`sim`] is a discrete-event simulation of a fleet under a background of sandboxes with
//! lognormal lifetimes and a burst of one job on top; see its docs. [`anchors`] reproduces
//! the literature's reference points with the same policies (balls into bins; Mitzenmacher's
//! supermarket model with a periodically refreshed board).

pub mod admission;
pub mod anchors;
mod model;
mod overlay;
mod placer;
#[cfg(feature = "plot")]
pub mod plot;
mod policy;
pub mod sim;
pub mod workload;

pub use admission::{Edge, Limits, Refusal, RefusalReason};
pub use model::{Layer, LayerId, NodeId, NodeState, Request, Resources, Snapshot, Time};
pub use overlay::{Delta, Ticket};
pub use placer::{Placement, Placer, PlacerConfig};
pub use policy::{LeastLoaded, Locality, Policy, PolicyKind, PolicyParams, PowerOfK, Random, View};

/// What can go wrong in placement.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No available node fits the request by the placer's view.
    #[error("no node can take the request")]
    NoCandidate,
    /// Every node tried refused.
    #[error("refused by {attempts} nodes; the last: {last}")]
    Refused {
        /// Nodes tried.
        attempts: u32,
        /// The last refusal.
        last: Refusal,
    },
    /// A parameter or an input is invalid.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// What was invalid.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// Writing a plot failed.
    #[error("plot {path}: {why}")]
    Plot {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
}
