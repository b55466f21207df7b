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
