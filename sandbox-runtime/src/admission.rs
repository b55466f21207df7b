//! The node's edge admission: the last word on a create, whatever a placer believed.
//!
//! A create is refused (`Error::Limit`, saying which limit, what was needed and what was free)
//! when it would take the node past one of:
//! - **reserved memory**: the memory limits (`--memory`) of its live sandboxes plus this one's
//!   may reach `mem_overcommit` × the node's memory (`MemTotal`);
//! - **reserved CPU**: their `--cpus` may reach `cpu_overcommit` × the node's CPUs;
//! - **reserved disk**: their `--disk` quotas may reach the uppers filesystem's size;
//! - **memory available now**: a create is refused while `MemAvailable` is below
//!   `min_available` — what bounds sandboxes that set no limit (they reserve nothing), so a node
//!   of idle sandboxes packs as many as its memory really holds and no more;
//! - the sandbox count (`ManagerConfig::max_sandboxes`, checked by the manager).
//!
//! The arithmetic is the placement library's (`placement::admission::Limits::check`), the same
//! the simulator's nodes apply.

use placement::admission::{Limits as EdgeLimits, RefusalReason};
use placement::Resources;

use crate::proto::Limits;
use crate::{Error, Result};

/// What a node admits (`ManagerConfig::admission`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Admission {
    pub mem_overcommit: f64,
    pub cpu_overcommit: f64,
    /// Refuse creates while the node's `MemAvailable` is below this (bytes); `None`: 5% of its
    /// memory, at least 512 MiB.
    pub min_available: Option<u64>,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            mem_overcommit: 2.0,
            cpu_overcommit: 16.0,
            min_available: None,
        }
    }
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo`, bytes.
pub fn meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

fn reservation(l: &Limits) -> Resources {
    Resources {
        cpu_millis: l.cpu_millis.unwrap_or(0),
        mem_bytes: l.memory.unwrap_or(0),
        disk_bytes: l.disk.unwrap_or(0),
    }
}

impl Admission {
    /// Whether a create asking `req` may start next to sandboxes with `live` limits, on a
    /// node with `uppers_size` of uppers (`None`: no disk quotas) and `mem` ([`meminfo`],
    /// read by the caller before it takes its table's lock).
    pub fn check(
        &self,
        live: &[Limits],
        req: &Limits,
        uppers_size: Option<u64>,
        mem: (u64, u64),
    ) -> Result<()> {
        let (total, available) = mem;
        let floor = self
            .min_available
            .unwrap_or_else(|| (total / 20).max(512 << 20));
        if total > 0 && available < floor {
            return Err(Error::Limit(format!(
                "node memory: {available} bytes available, below the {floor} this node keeps free"
            )));
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let capacity = Resources {
            cpu_millis: cpus * 1000,
            mem_bytes: total,
            disk_bytes: uppers_size.unwrap_or(u64::MAX),
        };
        let mut reserved = Resources::default();
        for l in live {
            reserved = reserved.plus(reservation(l));
        }
        let limits = EdgeLimits {
            cpu_overcommit: self.cpu_overcommit,
            mem_overcommit: self.mem_overcommit,
            max_sandboxes: u32::MAX,
            disk_overcommit: 1.0,
        };
        limits
            .check(&capacity, &reserved, 0, &reservation(req))
            .map_err(|(reason, need, free)| {
                let what = match reason {
                    RefusalReason::Memory => format!("reserved memory (x{})", self.mem_overcommit),
                    RefusalReason::Cpu => format!("reserved CPU (x{})", self.cpu_overcommit),
                    other => other.to_string(),
                };
                Error::Limit(format!(
                    "node {what}: this sandbox needs {need}, {free} is left"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_and_the_floor_refuse_with_reasons() {
        let (total, _) = meminfo();
        assert!(total > 0);
        let a = Admission {
            mem_overcommit: 1.0,
            min_available: Some(0),
            ..Admission::default()
        };
        let half = Limits {
            memory: Some(total / 2 + 1),
            ..Limits::default()
        };
        assert!(a.check(&[], &half, None, meminfo()).is_ok());
        let e = a
            .check(std::slice::from_ref(&half), &half, None, meminfo())
            .unwrap_err();
        assert!(e.to_string().contains("reserved memory"), "{e}");
        // Sandboxes without limits reserve nothing.
        assert!(a
            .check(
                &vec![Limits::default(); 100],
                &Limits::default(),
                None,
                meminfo()
            )
            .is_ok());
        let disk = Limits {
            disk: Some(2 << 30),
            ..Limits::default()
        };
        assert!(a.check(&[], &disk, Some(1 << 30), meminfo()).is_err());
        let cpu = Limits {
            cpu_millis: Some(u64::MAX / 2),
            ..Limits::default()
        };
        assert!(a
            .check(&[], &cpu, None, meminfo())
            .unwrap_err()
            .to_string()
            .contains("CPU"));
        let floor = Admission {
            min_available: Some(u64::MAX),
            ..Admission::default()
        };
        let e = floor
            .check(&[], &Limits::default(), None, meminfo())
            .unwrap_err();
        assert!(e.to_string().contains("available"), "{e}");
    }
}
