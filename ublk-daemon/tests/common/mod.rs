//! Helpers shared by the root-only integration tests of this crate (`mod common;`).
//! Not every test binary uses every item.

#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;

/// Whether this process runs as root. Otherwise prints a loud SKIPPED line for `test` and
/// returns false, or fails when `CI=true` (CI runs these tests as root).
pub fn require_root(test: &str) -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    let _ = std::io::stderr().write_all(
        format!(
            "\n*** SKIPPED {test}: needs root (mount(2), /dev/fuse, loop devices, mknod) ***\n\n"
        )
        .as_bytes(),
    );
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test} must run as root under CI"
    );
    false
}

/// Lazily detaches (MNT_DETACH) the mount at its path when dropped; errors (nothing mounted
/// there) are ignored.
pub struct Detach(pub PathBuf);

impl Drop for Detach {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

/// The running kernel's release as (major, minor), from `uname -r` (`/proc/sys/kernel/osrelease`).
pub fn kernel_release() -> (u32, u32) {
    let text = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = text
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// A kernel feature `what` is not available here: print a loud SKIPPED line for `test`. Under
/// `CI=true`, fail instead when the running kernel is at least `since` (the release that
/// brought the feature): then the feature is in the kernel and only a missing setup step
/// (a filesystem not mounted, a module not loaded) can hide it.
pub fn skip_feature(test: &str, what: &str, since: (u32, u32)) {
    let _ = std::io::stderr().write_all(format!("\n*** SKIPPED {test}: {what} ***\n\n").as_bytes());
    let release = kernel_release();
    assert!(
        std::env::var("CI").as_deref() != Ok("true") || release < since,
        "{test}: {what}, but this kernel ({}.{}) has it since {}.{}: a setup step is missing",
        release.0,
        release.1,
        since.0,
        since.1
    );
}
