//! Helpers shared by the root crate's integration tests (`mod common;`). Not every test
//! binary uses every item.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

pub mod cli;

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

/// The virtualenv with the pinned e2b SDK (`scripts/install-test-deps.sh`), the API tests'
/// client.
pub const E2B_PYTHON: &str = "/usr/local/lib/strata/e2b/bin/python";

fn e2b_sdk_version() -> Option<String> {
    let out = Command::new(E2B_PYTHON)
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('e2b'))",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Whether `program` is on the PATH.
pub fn installed(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Say loudly that `test` is skipped and why; under `CI=true` that is a failure.
pub fn skipped(test: &str, why: &str) {
    println!("\n*** SKIPPED {test}: {why} ***\n");
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: {why} (scripts/install-test-deps.sh installs it under CI)"
    );
}

/// Whether sandboxes can run here (root and runc); otherwise a loud SKIPPED (a failure
/// under CI).
pub fn runc_ready(test: &str) -> bool {
    if !require_root(test) {
        return false;
    }
    if !installed("runc") {
        skipped(test, "runc not installed");
        return false;
    }
    true
}

/// Whether the SDK can drive a node here (root, runc, the pinned SDK, the Debian base);
/// otherwise a loud SKIPPED (a failure under CI).
pub fn e2b_ready(test: &str) -> bool {
    if !require_root(test) {
        return false;
    }
    let why = if !installed("runc") {
        Some("runc not installed".to_owned())
    } else if e2b_sdk_version().as_deref() != Some("2.63.0") {
        Some(format!(
            "the e2b SDK 2.63.0 is not in {E2B_PYTHON}'s virtualenv (found {:?})",
            e2b_sdk_version()
        ))
    } else if debian_root().is_none() {
        Some("no Debian base root (scripts/debian-base.sh failed)".to_owned())
    } else {
        None
    };
    if let Some(why) = why {
        skipped(test, &why);
        return false;
    }
    true
}

/// Whether an SDK script passed: it exited 0 after printing `ALL OK` last; or it printed
/// `ALL OK` last and was then aborted with no Python frame on any thread (the SDK's native
/// HTTP client tearing down its runtime threads while the process leaves, which
/// `tests/e2b/finish.py` can only narrow: every check had passed). The latter is said loudly.
pub fn script_passed(
    script: &str,
    status: std::process::ExitStatus,
    stdout: &str,
    stderr: &str,
) -> bool {
    use std::os::unix::process::ExitStatusExt;
    let all_ok = stdout.trim_end().ends_with("ALL OK");
    if status.success() && all_ok {
        return true;
    }
    // The abort can end as SIGBUS: faulthandler, dumping the aborted thread, faulted itself once
    // ("Fatal Python error: Aborted" followed by "Fatal Python error: Bus error").
    let teardown = all_ok
        && matches!(status.signal(), Some(libc::SIGABRT) | Some(libc::SIGBUS))
        && stderr.contains("Fatal Python error: Aborted")
        && !stderr.contains("File \"");
    if teardown {
        println!(
            "WARNING: {script}: every check passed (ALL OK), then the SDK's HTTP client aborted \
             the interpreter on its way out (no Python frame): counted as passed"
        );
    }
    teardown
}

/// `GET path` on an E2B API at `addr` with API key `key`, HTTP/1.0 (one connection, closed
/// by the answer): the status and the body.
pub fn api_get(addr: &str, path: &str, key: &str) -> (u16, String) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nX-API-KEY: {key}\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}
