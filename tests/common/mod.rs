//! Helpers shared by the root crate's integration tests (`mod common;`). Not every test
//! binary uses every item.

#![allow(dead_code)]

use std::io::Write;

/// Whether this process runs as root. Otherwise prints a loud SKIPPED line for `test` and
/// returns false, or fails when `CI=true` (CI runs these tests as root).
pub fn require_root(test: &str) -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    let _ =
        std::io::stderr().write_all(format!("\n*** SKIPPED {test}: needs root ***\n\n").as_bytes());
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test} must run as root under CI"
    );
    false
}
