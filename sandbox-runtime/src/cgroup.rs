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

/// The directories of cgroup `path` (`/strata`, say) in every hierarchy mounted here, by
/// controller (`"unified"` for v2), whether or not they exist.
pub fn of_path(path: &str) -> BTreeMap<String, PathBuf> {
    let rel = path.trim_start_matches('/');
    hierarchies()
        .into_iter()
        .map(|(c, m)| (c, m.join(rel)))
        .collect()
}

/// Where each v1 controller's hierarchy (and the v2 hierarchy, as `"unified"`) is mounted.
///
/// Read from `/proc/self/mountinfo` once, then kept while each of its places is still a
/// mount point (one `statx` each): mountinfo lists every mount of the namespace, two or more
/// per sandbox, and a node's status (asked several times a second by each front) read it
/// whole each time; under a create burst, with the mounts changing, those reads took
/// seconds and the fronts placed on the node's status of before.
fn hierarchies() -> BTreeMap<String, PathBuf> {
    static KEPT: std::sync::Mutex<BTreeMap<String, PathBuf>> =
        std::sync::Mutex::new(BTreeMap::new());
    let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let still = |m: &PathBuf| ublk_daemon::node::sys::is_mount_point(m).unwrap_or(false);
    if !kept.is_empty() && kept.values().all(still) {
        return kept;
    }
    let fresh = std::fs::read_to_string("/proc/self/mountinfo")
        .map(|mi| fuzz_hierarchies(&mi))
        .unwrap_or_default();
    fresh.clone_into(&mut KEPT.lock().unwrap_or_else(|p| p.into_inner()));
    fresh
}

/// [`hierarchies`] of mountinfo text (public for the fuzz target, `fuzz/`).
#[doc(hidden)]
pub fn fuzz_hierarchies(mi: &str) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
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

/// Undo mountinfo's escapes of a space, tab, newline and backslash, in one pass (`\134040`
/// is a backslash and "040", not a space).
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let (c, n) = match rest.get(at..at + 4) {
            Some("\\040") => (' ', 4),
            Some("\\011") => ('\t', 4),
            Some("\\012") => ('\n', 4),
            Some("\\134") => ('\\', 4),
            _ => ('\\', 1),
        };
        out.push(c);
        rest = &rest[at + n..];
    }
    out.push_str(rest);
    out
}

/// Memory charged to a cgroup: anonymous and file-backed bytes (`file` includes `shmem`,
/// the sandbox's tmpfs pages), what of it is swapped out, and the whole charge.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Memory {
    pub anon: u64,
    pub file: u64,
    #[serde(default)]
    pub shmem: u64,
    #[serde(default)]
    pub swap: u64,
    /// `memory.usage_in_bytes` (v1) or `memory.current` (v2): every page charged, kernel
    /// memory included.
    #[serde(default)]
    pub usage: u64,
}

fn read_u64(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
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
            shmem: pick("total_shmem", "shmem"),
            swap: pick("total_swap", "swap"),
            usage: read_u64(&m.join("memory.usage_in_bytes")),
        };
    }
    if let Some(u) = cgroups.get("unified") {
        let s = stat_fields(&u.join("memory.stat"));
        return Memory {
            anon: s.get("anon").copied().unwrap_or(0),
            file: s.get("file").copied().unwrap_or(0),
            shmem: s.get("shmem").copied().unwrap_or(0),
            swap: read_u64(&u.join("memory.swap.current")),
            usage: read_u64(&u.join("memory.current")),
        };
    }
    Memory::default()
}

/// Reclaim what the kernel can of the memory charged to these cgroups: v1
/// `memory.force_empty` (page cache and, where the node has swap, anonymous pages), v2
/// `memory.reclaim` of the whole charge (`EAGAIN`, not all of it reclaimable, is no error).
/// Every page charged to the cgroup is a candidate, whoever else reads it: the caller decides
/// whether that is the sandbox's to drop. Which file it wrote, for the report.
pub fn reclaim(cgroups: &BTreeMap<String, PathBuf>) -> std::io::Result<&'static str> {
    if let Some(m) = cgroups.get("memory") {
        std::fs::write(m.join("memory.force_empty"), "0")?;
        return Ok("memory.force_empty");
    }
    if let Some(u) = cgroups.get("unified") {
        let current = read_u64(&u.join("memory.current"));
        return match std::fs::write(u.join("memory.reclaim"), current.max(1).to_string()) {
            Ok(()) => Ok("memory.reclaim"),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok("memory.reclaim"),
            Err(e) => Err(e),
        };
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        "no memory cgroup",
    ))
}

/// The processes of these cgroups (`cgroup.procs` of the memory, pids or freezer cgroup).
pub fn procs(cgroups: &BTreeMap<String, PathBuf>) -> Vec<u32> {
    for c in ["memory", "pids", "freezer", "unified"] {
        if let Some(d) = cgroups.get(c) {
            if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
                return s.lines().filter_map(|l| l.trim().parse().ok()).collect();
            }
        }
    }
    Vec::new()
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

    #[test]
    fn kept_hierarchies_are_mountinfos() {
        let read = || fuzz_hierarchies(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
        let (first, again) = (hierarchies(), hierarchies());
        assert!(!first.is_empty(), "no cgroup hierarchy mounted here");
        assert_eq!(first, read());
        assert_eq!(again, read(), "kept, still what mountinfo says");
    }

    #[test]
    fn mountinfo_escapes_are_undone_once() {
        let mi = "25 1 0:23 / /a\\040b\\134040 rw - cgroup2 cgroup2 rw\n\
                  26 1 0:24 / /c rw - cgroup cgroup rw,memory,name=systemd\n";
        let h = fuzz_hierarchies(mi);
        assert_eq!(h["unified"], Path::new("/a b\\040"));
        assert_eq!(h["memory"], Path::new("/c"));
        assert_eq!(h["systemd"], Path::new("/c"));
    }
}
