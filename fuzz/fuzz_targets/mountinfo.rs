//! Fuzz the readers of `/proc/self/mountinfo`: the node's (`ublk_daemon::node::sys`: the
//! entries, which of them are the node's own for stale-mount cleanup, the device number of a
//! FUSE mount) and the sandbox runtime's cgroup hierarchies (`sandbox_runtime::cgroup`). None
//! may panic; the two must read a cgroup2 line's mount point the same way (octal escapes).
//! Found: the runtime undid escapes one after another, so `\134040` (a backslash, then
//! "040") read as a space; fixed in `cgroup.rs`.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use ublk_daemon::node::sys::fuzz_mountinfo;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let run_dir = Path::new("/run/strata");
    // The target of the device-number lookup: the first line's mount point field, if any.
    let target = text
        .lines()
        .next()
        .and_then(|l| l.split(' ').nth(4))
        .unwrap_or("/mnt");
    let (entries, dev, ours) = fuzz_mountinfo(&text, target, run_dir);
    assert!(entries.len() <= text.lines().count());
    assert_eq!(ours.len(), entries.len());
    for (m, ours) in entries.iter().zip(&ours) {
        if m.mount_point.starts_with(run_dir) {
            assert!(ours, "a mount under the run directory is not claimed");
        }
        assert!(m.mount_point.as_os_str().len() <= text.len());
    }
    if let Some(dev) = dev {
        assert!(text
            .lines()
            .any(|l| l.split(' ').nth(2) == Some(dev.as_str())));
    }
    let cgroups = sandbox_runtime::cgroup::fuzz_hierarchies(&text);
    assert!(cgroups.len() <= text.len());
    // Line by line: a cgroup2 mount the runtime sees is one the node sees, at the same path,
    // wherever the line is as the kernel writes them (every backslash starts one of the four
    // escapes it uses: the runtime undoes only those).
    for line in text.lines().filter(|l| kernel_escapes(l)) {
        if let Some(unified) = sandbox_runtime::cgroup::fuzz_hierarchies(line).get("unified") {
            let (node, _, _) = fuzz_mountinfo(line, "", run_dir);
            let m = node
                .first()
                .expect("the node reads the runtime's cgroup line");
            if m.fstype != "cgroup2" {
                // A v1 hierarchy named "unified" (`name=unified`) takes the v2 key: the
                // runtime's choice of names, not a misreading of the line.
                continue;
            }
            assert_eq!(
                &m.mount_point, unified,
                "mount point read differently: {line:?}"
            );
        }
    }
});

/// Every backslash of `line` starts `\040`, `\011`, `\012` or `\134`.
fn kernel_escapes(line: &str) -> bool {
    line.match_indices('\\').all(|(at, _)| {
        matches!(
            line.get(at..at + 4),
            Some("\\040" | "\\011" | "\\012" | "\\134")
        )
    })
}
