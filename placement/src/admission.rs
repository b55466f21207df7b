//! Edge admission: the node's own check, which has the last word.
//!
//! The placer works from a stale snapshot and can be wrong; the node is not. [`Edge`] is the
//! node-side ledger of what its live sandboxes reserve: [`Edge::try_admit`] refuses a create
//! that would take the node past one of its [`Limits`] and says which one, with the figures;
//! the placer then blocks that node until a newer snapshot and retries elsewhere (bounded).

use std::fmt;

use serde::Serialize;

use crate::model::{NodeId, Resources};

/// What a node admits, relative to its capacity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Limits {
    /// Reserved CPU may reach this multiple of the node's cores (idle sandboxes use a few
    /// percent of what they reserve).
    pub cpu_overcommit: f64,
    /// Reserved memory may reach this multiple of the node's memory (1.0: no overcommit).
    pub mem_overcommit: f64,
    /// At most this many live sandboxes.
    pub max_sandboxes: u32,
    /// Reserved disk (the uppers' quotas) may reach this multiple of the node's disk.
    pub disk_overcommit: f64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            cpu_overcommit: 8.0,
            mem_overcommit: 1.0,
            max_sandboxes: 1000,
            disk_overcommit: 1.0,
        }
    }
}

/// The resource a node ran out of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RefusalReason {
    /// Reserved memory would pass `mem_overcommit` × memory.
    Memory,
    /// Reserved CPU would pass `cpu_overcommit` × cores.
    Cpu,
    /// The node has `max_sandboxes` live sandboxes.
    Sandboxes,
    /// Reserved disk would pass `disk_overcommit` × disk.
    Disk,
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RefusalReason::Memory => "memory",
            RefusalReason::Cpu => "cpu",
            RefusalReason::Sandboxes => "sandbox count",
            RefusalReason::Disk => "disk",
        })
    }
}

/// A node's refusal of a create: which limit, what the request needed and what was left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Refusal {
    /// The node that refused.
    pub node: NodeId,
    /// The limit.
    pub reason: RefusalReason,
    /// What the request needed of that resource (bytes, CPU millis, or 1 sandbox).
    pub need: u64,
    /// What the limit left free.
    pub free: u64,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} refused: {} (needs {}, {} free)",
            self.node, self.reason, self.need, self.free
        )
    }
}

/// `capacity × ratio`, in whole units (a non-finite or negative ratio admits nothing).
pub(crate) fn allowed(capacity: u64, ratio: f64) -> u64 {
    if ratio.is_finite() && ratio > 0.0 {
        (capacity as f64 * ratio) as u64
    } else {
        0
    }
}

impl Limits {
    /// Whether a node of `capacity` with `reserved` and `sandboxes` live can take `req`;
    /// the first limit it would pass otherwise (memory, CPU, count, disk, in that order),
    /// with what it needed and what was free.
    pub fn check(
        &self,
        capacity: &Resources,
        reserved: &Resources,
        sandboxes: u32,
        req: &Resources,
    ) -> Result<(), (RefusalReason, u64, u64)> {
        let checks = [
            (
                RefusalReason::Memory,
                allowed(capacity.mem_bytes, self.mem_overcommit),
                reserved.mem_bytes,
                req.mem_bytes,
            ),
            (
                RefusalReason::Cpu,
                allowed(capacity.cpu_millis, self.cpu_overcommit),
                reserved.cpu_millis,
                req.cpu_millis,
            ),
            (
                RefusalReason::Sandboxes,
                u64::from(self.max_sandboxes),
                u64::from(sandboxes),
                1,
            ),
            (
                RefusalReason::Disk,
                allowed(capacity.disk_bytes, self.disk_overcommit),
                reserved.disk_bytes,
                req.disk_bytes,
            ),
        ];
        for (reason, limit, have, need) in checks {
            let free = limit.saturating_sub(have);
            if need > free {
                return Err((reason, need, free));
            }
        }
        Ok(())
    }
}

/// A node's admission ledger: its capacity, limits, and what its live sandboxes reserve.
#[derive(Clone, Debug)]
pub struct Edge {
    id: NodeId,
    capacity: Resources,
    limits: Limits,
    reserved: Resources,
    sandboxes: u32,
}

impl Edge {
    /// An empty node.
    pub fn new(id: NodeId, capacity: Resources, limits: Limits) -> Edge {
        Edge {
            id,
            capacity,
            limits,
            reserved: Resources::default(),
            sandboxes: 0,
        }
    }

    /// Admit a create and reserve what it asks for, or refuse it and say why (nothing is
    /// reserved then).
    pub fn try_admit(&mut self, req: &Resources) -> Result<(), Refusal> {
        self.limits
            .check(&self.capacity, &self.reserved, self.sandboxes, req)
            .map_err(|(reason, need, free)| Refusal {
                node: self.id,
                reason,
                need,
                free,
            })?;
        self.reserved = self.reserved.plus(*req);
        self.sandboxes += 1;
        Ok(())
    }

    /// A sandbox admitted with `req` ended: release what it reserved.
    pub fn release(&mut self, req: &Resources) {
        self.reserved = self.reserved.minus(*req);
        self.sandboxes = self.sandboxes.saturating_sub(1);
    }

    /// The node.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// Its capacity.
    pub fn capacity(&self) -> Resources {
        self.capacity
    }

    /// Its limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// What its live sandboxes reserve.
    pub fn reserved(&self) -> Resources {
        self.reserved
    }

    /// How many are live.
    pub fn sandboxes(&self) -> u32 {
        self.sandboxes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn edge() -> Edge {
        Edge::new(
            NodeId(7),
            Resources {
                cpu_millis: 4_000,
                mem_bytes: 16 * GIB,
                disk_bytes: 100 * GIB,
            },
            Limits {
                cpu_overcommit: 2.0,
                mem_overcommit: 1.0,
                max_sandboxes: 3,
                disk_overcommit: 1.0,
            },
        )
    }

    fn req(cpu: u64, mem_gib: u64, disk_gib: u64) -> Resources {
        Resources {
            cpu_millis: cpu,
            mem_bytes: mem_gib * GIB,
            disk_bytes: disk_gib * GIB,
        }
    }

    #[test]
    fn each_limit_refuses_with_its_reason_and_figures() {
        let mut e = edge();
        let r = e.try_admit(&req(1000, 17, 1)).unwrap_err();
        assert_eq!(
            (r.reason, r.need, r.free),
            (RefusalReason::Memory, 17 * GIB, 16 * GIB)
        );
        let r = e.try_admit(&req(8001, 1, 1)).unwrap_err();
        assert_eq!((r.reason, r.free), (RefusalReason::Cpu, 8000));
        let r = e.try_admit(&req(1, 1, 101)).unwrap_err();
        assert_eq!(r.reason, RefusalReason::Disk);
        assert_eq!(e.sandboxes(), 0, "a refusal reserves nothing");
        for _ in 0..3 {
            e.try_admit(&req(1000, 1, 1)).unwrap();
        }
        let r = e.try_admit(&req(1, 1, 1)).unwrap_err();
        assert_eq!((r.reason, r.free), (RefusalReason::Sandboxes, 0));
        assert!(r.to_string().contains("node7 refused: sandbox count"));
        e.release(&req(1000, 1, 1));
        e.try_admit(&req(1, 1, 1)).unwrap();
        assert_eq!(e.reserved().cpu_millis, 2001);
    }

    #[test]
    fn overcommit_scales_the_limit_and_bad_ratios_admit_nothing() {
        let mut e = edge();
        // CPU: 4 cores × 2.0 = 8,000 millis reservable.
        e.try_admit(&req(8000, 1, 1)).unwrap();
        let l = Limits {
            mem_overcommit: f64::NAN,
            ..Limits::default()
        };
        let cap = req(1000, 1, 1);
        assert!(l
            .check(&cap, &Resources::default(), 0, &req(1, 1, 0))
            .is_err());
    }
}
