//! Helpers shared by the root crate's integration tests (`mod common;`). Not every test
//! binary uses every item.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

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

/// The real Debian root the sandbox tests stand on: `STRATA_TEST_DEBIAN_ROOT`, or the one
/// `scripts/debian-base.sh` builds once and caches under /var/cache/strata. Found once per
/// test binary; `None` if the script failed.
pub fn debian_root() -> Option<&'static Path> {
    static R: OnceLock<Option<PathBuf>> = OnceLock::new();
    R.get_or_init(|| {
        if let Some(p) = std::env::var_os("STRATA_TEST_DEBIAN_ROOT") {
            return Some(p.into());
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/debian-base.sh");
        let out = Command::new(script)
            .stderr(Stdio::inherit())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
    .as_deref()
}
