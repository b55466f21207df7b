//! A daemon that starts finds the execs its predecessor left (`<sandbox dir>/execs/*`,
//! `crate::exec`): ended ones with their output and result, for `attach` and `inspect`;
//! running ones attached again through the sandbox's init by their key (`agent::attach`), so
//! that their output, input, signals, terminal, timeout and end are served as if the daemon
//! had never gone. One whose command ended while no daemon ran is classified from the
//! status file the init wrote.
//!
//! A frozen sandbox's init cannot answer: its running execs are attached once it runs again
//! (tried every second while it is paused or suspended); a running sandbox's init that does
//! not answer [`ATTEMPTS`] times makes those execs end as lost, with the reason.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::agent::{self, SpawnError};
use crate::exec::{self, Exec};
use crate::manager::{now_ms, Sandbox};
use crate::proto::SandboxState;
use crate::run::{Job, Started};

/// Attach tries on a running sandbox before its exec counts as lost.
const ATTEMPTS: u32 = 3;

/// The execs in `sb`'s directory, oldest first (blocking).
fn load(sb: &Sandbox) -> Vec<Arc<Exec>> {
    let Ok(rd) = std::fs::read_dir(sb.dir.join(exec::EXECS_DIR)) else {
        return Vec::new();
    };
    let mut all: Vec<Arc<Exec>> = rd
        .flatten()
        .filter_map(|e| match Exec::load(e.path(), sb.id.clone()) {
            Ok(x) => Some(x),
            Err(err) => {
                // A create that died before its record: nothing to serve.
                tracing::warn!("{}: not an exec ({err}); removed", e.path().display());
                let _ = std::fs::remove_dir_all(e.path());
                None
            }
        })
        .collect();
    all.sort_by_key(|e| e.meta().started_ms);
    all
}

/// The number in an exec id `e<n>-<ms>`.
fn serial(id: &str) -> Option<u64> {
    id.strip_prefix('e')?.split('-').next()?.parse().ok()
}

/// Take in the execs of `sb` (just reattached by a starting daemon). Returns the highest
/// exec serial seen, so that new ids do not repeat old ones.
pub(crate) async fn execs(sb: &Arc<Sandbox>) -> u64 {
    let s = sb.clone();
    let found = tokio::task::spawn_blocking(move || load(&s))
        .await
        .unwrap_or_default();
    let mut top = 0;
    for e in found {
        top = top.max(serial(&e.id).unwrap_or(0));
        let running = e.result().is_none();
        sb.add_exec(e.clone());
        if running {
            sb.running_execs.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(follow(sb.clone(), e));
        }
    }
    top
}

/// Attach to `e` again, then run it to its end as `crate::run` does.
async fn follow(sb: Arc<Sandbox>, e: Arc<Exec>) {
    let meta = e.meta().clone();
    let mut tries = 0;
    let started = loop {
        let record = sb.record();
        let pid = match (record.state, record.pid) {
            (SandboxState::Paused | SandboxState::Suspended, _) => {
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            (SandboxState::Running, Some(pid)) => pid,
            (state, _) => {
                break Started::Ended(format!(
                    "the sandbox is {} and its init did not report the end",
                    crate::proto::state_name(state)
                ))
            }
        };
        let dir = sb.dir.clone();
        let r = tokio::task::spawn_blocking(move || agent::attach(&dir, pid, meta.key))
            .await
            .unwrap_or_else(|j| Err(SpawnError::Unresponsive(j.to_string())));
        match r {
            Ok(running) => {
                break Started::Init {
                    running: Arc::new(running),
                    init_pid: pid,
                }
            }
            // The init no longer has it: it ended (its status file says how).
            Err(err @ (SpawnError::Refused(_) | SpawnError::NoSocket)) => {
                break Started::Ended(format!("the sandbox's init no longer has it ({err})"))
            }
            Err(err) => {
                tries += 1;
                if tries >= ATTEMPTS {
                    tracing::warn!("exec {}: cannot attach again: {err}", e.id);
                    break Started::Ended(format!("cannot attach to it again: {err}"));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let cgroups = sb
        .record()
        .pid
        .map(crate::cgroup::of_pid)
        .unwrap_or_default();
    let deadline = meta
        .deadline_ms
        .map(|d| tokio::time::Instant::now() + Duration::from_millis(d.saturating_sub(now_ms())));
    crate::run::run(Job {
        sb,
        exec: e,
        started,
        stdin: None,
        stdin_open: meta.stdin_open,
        deadline,
        oom_before: meta.oom_before,
        cgroups,
    })
    .await;
}

#[cfg(test)]
mod tests {
    #[test]
    fn exec_serials_are_read_back() {
        assert_eq!(super::serial("e12-345678"), Some(12));
        assert_eq!(super::serial("x12-3"), None);
        assert_eq!(super::serial("e-3"), None);
    }
}
