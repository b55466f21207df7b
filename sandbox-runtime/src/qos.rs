//! CPU QoS: best-effort sandboxes yield the CPU to latency-sensitive ones.
//!
//! A best-effort (`be`) sandbox's init runs under `SCHED_IDLE`, which every process it starts
//! inherits, and its cgroup has the lowest CPU weight ([`crate::spec::BE_CPU_SHARES`]) and is
//! an idle group ([`make_idle_group`]: with group scheduling a task's policy only counts inside
//! its own group, so the group itself must be idle against the other sandboxes' groups). No
//! process inside can leave `SCHED_IDLE`: that takes `CAP_SYS_NICE` (not in a sandbox's set)
//! or an `RLIMIT_NICE` above 0 (the spec pins it to 0). Latency-sensitive (`ls`) sandboxes
//! keep the defaults.
//!
//! Where the kernel has core scheduling (`PR_SCHED_CORE`, `CONFIG_SCHED_CORE`), every sandbox
//! gets a core-scheduling cookie of its own at create (inherited on fork): tasks of two
//! sandboxes never run on the two SMT siblings of one core at once, so a best-effort
//! neighbour cannot slow a latency-sensitive one through a shared core (nor read it through
//! one). Where it does not (this VM's 6.18 kernel), that is said once when the manager starts.

use crate::proto::CpuClass;

const PR_SCHED_CORE: libc::c_int = 62;
const PR_SCHED_CORE_GET: libc::c_ulong = 0;
const PR_SCHED_CORE_CREATE: libc::c_ulong = 1;
const PIDTYPE_PID: libc::c_ulong = 0;
const PIDTYPE_TGID: libc::c_ulong = 1;

/// Whether this kernel has core scheduling.
pub fn core_sched_available() -> bool {
    let mut cookie: u64 = 0;
    // SAFETY: PR_SCHED_CORE_GET writes one u64 to the address given, a local that outlives
    // the call.
    let r = unsafe {
        libc::prctl(
            PR_SCHED_CORE,
            PR_SCHED_CORE_GET,
            0 as libc::c_ulong,
            PIDTYPE_PID,
            &mut cookie as *mut u64 as libc::c_ulong,
        )
    };
    r == 0
}

/// Give the freshly started init `pid` its class (before it starts anything).
pub fn apply(pid: u32, class: CpuClass, core_sched: bool) -> std::io::Result<()> {
    if core_sched {
        // SAFETY: no pointers; a new cookie for the thread group of `pid`.
        let r = unsafe {
            libc::prctl(
                PR_SCHED_CORE,
                PR_SCHED_CORE_CREATE,
                pid as libc::c_ulong,
                PIDTYPE_TGID,
                0 as libc::c_ulong,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    if class == CpuClass::Be {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid sched_param that outlives the call.
        if unsafe { libc::sched_setscheduler(pid as libc::pid_t, libc::SCHED_IDLE, &param) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Make the CPU cgroup of `pid` (a best-effort sandbox's own) an idle group (`cpu.idle` 1, v1
/// and v2, Linux 5.15+): with group scheduling a task's SCHED_IDLE only counts against its own
/// group's tasks, while the group competes with its siblings — the other sandboxes — by
/// weight. An idle group competes as SCHED_IDLE: a latency-sensitive neighbour preempts it at
/// once on wake-up.
pub fn make_idle_group(pid: u32) -> std::io::Result<()> {
    let cg = crate::cgroup::of_pid(pid);
    let Some(dir) = cg.get("cpu").or_else(|| cg.get("unified")) else {
        return Ok(());
    };
    match std::fs::write(dir.join("cpu.idle"), "1") {
        Ok(()) => Ok(()),
        // A kernel before 5.15: SCHED_IDLE and the weight alone.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!("{}: no cpu.idle in this kernel", dir.display());
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The scheduling policy of process `pid` (`other`, `idle`, `batch`, `fifo`, `rr`), if it runs.
pub fn policy(pid: u32) -> Option<&'static str> {
    // SAFETY: no pointers.
    let p = unsafe { libc::sched_getscheduler(pid as libc::pid_t) };
    Some(match p {
        libc::SCHED_OTHER => "other",
        libc::SCHED_IDLE => "idle",
        libc::SCHED_BATCH => "batch",
        libc::SCHED_FIFO => "fifo",
        libc::SCHED_RR => "rr",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_made_best_effort_and_cannot_leave() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert_eq!(policy(pid), Some("other"));
        apply(pid, CpuClass::Be, false).unwrap();
        assert_eq!(policy(pid), Some("idle"));
        apply(pid, CpuClass::Ls, false).unwrap();
        assert_eq!(policy(pid), Some("idle"), "ls changes nothing");
        child.kill().unwrap();
        child.wait().unwrap();
        // Core scheduling is only asked for where it exists.
        if !core_sched_available() {
            let mut c = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            assert!(apply(c.id(), CpuClass::Ls, true).is_err());
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}
