//! Reading a sandbox's cgroups (the runtime creates and limits them; this only looks).
//!
//! cgroup v1 (this host: memory, cpu, pids, freezer … each on its own hierarchy) and v2 (one
//! unified hierarchy) are both read: a process's `/proc/<pid>/cgroup` names its path in each
//! hierarchy, `/proc/self/mountinfo` where each hierarchy is mounted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The cgroup directories of process `pid`, by controller (`"unified"` for v2).
pub fn of_pid(pid: u32) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let Ok(cg) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return out;
    };
    let mounts = hierarchies();
    for line in cg.lines() {
        // hierarchy-id:controller-list:path
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if ctrls.is_empty() {
            if let Some(m) = mounts.get("unified") {
                out.insert("unified".to_owned(), m.join(rel));
            }
            continue;
        }
        for c in ctrls.split(',') {
            let c = c.trim_start_matches("name=");
            if let Some(m) = mounts.get(c) {
                out.insert(c.to_owned(), m.join(rel));
            }
        }
    }
    out
}

/// Where each v1 controller's hierarchy (and the v2 hierarchy, as `"unified"`) is mounted.
fn hierarchies() -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return out;
    };
    for line in mi.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut r = right.split(' ');
        let (Some(fstype), Some(_src), Some(opts)) = (r.next(), r.next(), r.next()) else {
            continue;
        };
        let Some(mp) = left.split(' ').nth(4) else {
            continue;
        };
        let mp = PathBuf::from(unescape(mp));
        match fstype {
            "cgroup2" => {
                out.entry("unified".to_owned()).or_insert(mp);
            }
            "cgroup" => {
                for o in opts.split(',') {
                    let o = o.trim_start_matches("name=");
                    if !matches!(o, "rw" | "ro") && !o.contains('=') {
                        out.entry(o.to_owned()).or_insert_with(|| mp.clone());
                    }
                }
            }
            _ => {}
        }
    }
    out
}

fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Memory charged to a cgroup: anonymous and file-backed bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    pub anon: u64,
    pub file: u64,
}

fn stat_fields(path: &Path) -> BTreeMap<String, u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_owned(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The memory of the cgroups `cgroups` (from [`of_pid`]).
pub fn memory(cgroups: &BTreeMap<String, PathBuf>) -> Memory {
    if let Some(m) = cgroups.get("memory") {
        let s = stat_fields(&m.join("memory.stat"));
        // v1: `total_*` include descendants (runc puts everything in the one cgroup).
        let pick = |a: &str, b: &str| s.get(a).or_else(|| s.get(b)).copied().unwrap_or(0);
        return Memory {
            anon: pick("total_rss", "rss"),
            file: pick("total_cache", "cache"),
        };
    }
    if let Some(u) = cgroups.get("unified") {
        let s = stat_fields(&u.join("memory.stat"));
        return Memory {
            anon: s.get("anon").copied().unwrap_or(0),
            file: s.get("file").copied().unwrap_or(0),
        };
    }
    Memory::default()
}

/// How many times the kernel's OOM killer killed a process of these cgroups.
pub fn oom_kills(cgroups: &BTreeMap<String, PathBuf>) -> u64 {
    if let Some(m) = cgroups.get("memory") {
        if let Some(n) = stat_fields(&m.join("memory.oom_control")).get("oom_kill") {
            return *n;
        }
    }
    if let Some(u) = cgroups.get("unified") {
        if let Some(n) = stat_fields(&u.join("memory.events")).get("oom_kill") {
            return *n;
        }
    }
    0
}

/// Processes (and threads) in these cgroups now.
pub fn pids(cgroups: &BTreeMap<String, PathBuf>) -> u64 {
    let dir = cgroups.get("pids").or_else(|| cgroups.get("unified"));
    dir.and_then(|d| std::fs::read_to_string(d.join("pids.current")).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_cgroups_that_exist() {
        let cg = of_pid(std::process::id());
        assert!(!cg.is_empty(), "no cgroup found for this process");
        for (c, p) in &cg {
            assert!(p.is_dir(), "{c}: {} is not a directory", p.display());
        }
    }
}
