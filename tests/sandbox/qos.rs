//! `--class be`: a best-effort sandbox's processes run under SCHED_IDLE with the lowest CPU
//! weight and cannot leave it; a latency-sensitive one keeps the defaults.

use super::{ready, Node};

#[test]
fn a_best_effort_sandbox_runs_idle_and_cannot_leave() {
    if !ready("a_best_effort_sandbox_runs_idle_and_cannot_leave") {
        return;
    }
    let node = Node::new("qos");
    let be = node.create("qos-be", &["--class", "be"]);
    let ls = node.create("qos-ls", &[]);
    let d = node.json(&["sandbox", "inspect", &be]);
    assert_eq!(d["sched_policy"], "idle", "{d}");
    assert_eq!(d["limits"]["class"], "be", "{d}");
    let cpu = d["cgroups"]["cpu"].as_str().expect("a cpu cgroup");
    let shares = std::fs::read_to_string(std::path::Path::new(cpu).join("cpu.shares"))
        .or_else(|_| std::fs::read_to_string(std::path::Path::new(cpu).join("cpu.weight")))
        .unwrap();
    // 2 as runc set it; an idle group then reports the idle weight (3 shares, weight 1).
    assert!(
        matches!(shares.trim(), "1" | "2" | "3"),
        "lowest weight: {shares}"
    );
    let idle = std::fs::read_to_string(std::path::Path::new(cpu).join("cpu.idle")).unwrap();
    assert_eq!(idle.trim(), "1", "an idle group");
    // Every process it starts inherits the policy; none can switch back, not even root.
    assert!(node.sh_ok(&be, "chrt -p $$").contains("SCHED_IDLE"));
    let out = node.sh(&be, "chrt -o -p 0 $$ && echo escaped");
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = node.sh(&be, "renice -n -5 -p $$ && echo raised");
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let d = node.json(&["sandbox", "inspect", &ls]);
    assert_eq!(d["sched_policy"], "other", "{d}");
    assert!(node.sh_ok(&ls, "chrt -p $$").contains("SCHED_OTHER"));
}

#[test]
fn admission_refuses_past_the_nodes_limits_and_says_why() {
    if !ready("admission_refuses_past_the_nodes_limits_and_says_why") {
        return;
    }
    let mut node = Node::new("admit");
    node.env.push(("STRATA_MEM_OVERCOMMIT", "1".into()));
    let total = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024;
    let big = format!("{}", total / 2 + (1 << 20));
    node.create("admit-a", &["--memory", &big]);
    let out = node
        .cmd()
        .args([
            "sandbox",
            "create",
            "--layer",
            super::BASE,
            "--id",
            "admit-b",
        ])
        .args(["--memory", &big])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("reserved memory"), "{err}");
    // A sandbox without a limit reserves nothing; the first one's removal frees its share.
    node.create("admit-c", &[]);
    node.ok(&["sandbox", "rm", "admit-a"]);
    node.create("admit-b", &["--memory", &big]);
}
