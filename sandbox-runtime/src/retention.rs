//! The node's bound on kept exec output (`crate::exec`). Each exec keeps at most its cap per
//! stream and each sandbox its last 64 execs; on top, the output that ended execs keep on
//! the node's disk is bounded as a whole (`STRATA_EXEC_OUTPUT_BUDGET` bytes, 4 GiB by
//! default): past it, the execs that ended first are forgotten with their files (an `attach`
//! to one then finds no such exec). Running execs are never trimmed: what they keep is
//! bounded by their caps, and only the node's clients start them.

use std::sync::{Arc, OnceLock};

use crate::manager::Sandbox;

/// The default budget.
const DEFAULT_BUDGET: u64 = 4 << 30;

/// `STRATA_EXEC_OUTPUT_BUDGET`, read once.
pub(crate) fn budget() -> u64 {
    static B: OnceLock<u64> = OnceLock::new();
    *B.get_or_init(|| {
        std::env::var("STRATA_EXEC_OUTPUT_BUDGET")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_BUDGET)
    })
}

/// Forget the ended execs of `sandboxes` that ended first until what the ended ones keep
/// fits `budget`. Returns the bytes freed.
pub(crate) fn trim(sandboxes: &[Arc<Sandbox>], budget: u64) -> u64 {
    let mut ended: Vec<(std::time::Instant, u64, &Arc<Sandbox>, String)> = Vec::new();
    let mut total = 0u64;
    for sb in sandboxes {
        for e in sb.execs_snapshot() {
            let Some(r) = e.result() else { continue };
            let kept: u64 = e.kept().iter().sum();
            total += kept;
            let end = e.started + std::time::Duration::from_millis(r.duration_ms);
            ended.push((end, kept, sb, e.id.clone()));
        }
    }
    if total <= budget {
        return 0;
    }
    ended.sort_by_key(|(end, ..)| *end);
    let mut freed = 0;
    for (_, kept, sb, id) in ended {
        if total - freed <= budget {
            break;
        }
        if sb.forget_exec(&id) {
            freed += kept;
        }
    }
    tracing::info!("exec output past the node's budget ({budget} bytes): {freed} bytes freed");
    freed
}
