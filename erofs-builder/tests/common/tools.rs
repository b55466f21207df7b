//! erofs-utils 1.8 for the interop tests: where the tools are, a loud skip (or a CI failure)
//! when they are not, and an `erofsfuse` mount that is always unmounted.
//!
//! `scripts/build-erofs-utils.sh` builds erofs-utils 1.8.x from Debian trixie's source
//! package into [`DEFAULT_DIR`], off the default `PATH` (Debian 12's 1.5 stays the default
//! `fsck.erofs`). [`DIR_ENV`] points the tests at another directory.

#![allow(dead_code)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where `scripts/build-erofs-utils.sh` installs the 1.8 binaries.
pub const DEFAULT_DIR: &str = "/usr/local/lib/strata/erofs-utils-1.8/bin";
/// Overrides [`DEFAULT_DIR`].
pub const DIR_ENV: &str = "STRATA_EROFS_UTILS_DIR";

/// The erofs-utils (1.8 or later) binaries.
#[derive(Debug, Clone)]
pub struct Tools {
    pub fsck: PathBuf,
    pub fuse: PathBuf,
    pub mkfs: PathBuf,
    /// What `fsck.erofs -V` printed first, e.g. "fsck.erofs (erofs-utils) 1.8.6".
    pub version: String,
}

/// `(major, minor)` from a `-V` line such as "fsck.erofs (erofs-utils) 1.8.6" or "fsck.erofs 1.5".
fn parse_version(line: &str) -> Option<(u32, u32)> {
    let v = line.split_whitespace().last()?;
    let mut it = v.split(['.', '-']);
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// The erofs-utils 1.8+ tools, if installed (all three binaries present and `fsck.erofs -V`
/// reporting 1.8 or later).
pub fn find() -> Option<Tools> {
    let dir = std::env::var_os(DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
    let t = Tools {
        fsck: dir.join("fsck.erofs"),
        fuse: dir.join("erofsfuse"),
        mkfs: dir.join("mkfs.erofs"),
        version: String::new(),
    };
    if !(t.fsck.is_file() && t.fuse.is_file() && t.mkfs.is_file()) {
        return None;
    }
    let out = Command::new(&t.fsck).arg("-V").output().ok()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let line = text.lines().next()?.trim().to_owned();
    (parse_version(&line)? >= (1, 8)).then_some(Tools { version: line, ..t })
}

/// The 1.8 tools, or `None` after a loud SKIPPED line; under `CI=true` a missing tool set
/// fails the test instead (CI installs it with `scripts/install-test-deps.sh`).
pub fn require(test: &str) -> Option<Tools> {
    if let Some(t) = find() {
        return Some(t);
    }
    let dir = std::env::var(DIR_ENV).unwrap_or_else(|_| DEFAULT_DIR.to_owned());
    crate::common::skip(&format!(
        "{test}: erofs-utils >= 1.8 not found in {dir} \
         (run scripts/build-erofs-utils.sh as root)"
    ));
    None
}

/// An `erofsfuse` mount (run in the foreground as our child). Dropping it unmounts
/// (`fusermount3 -u`, else a lazy `umount2(MNT_DETACH)`) and reaps the daemon (killing it if
/// it has not exited within 5 s), even when the test panics.
pub struct FuseMount {
    target: PathBuf,
    child: Option<Child>,
}

impl FuseMount {
    /// `erofsfuse -f [--device=D]... IMAGE TARGET`; returns once `TARGET` is a mount (a
    /// different `st_dev` from its parent), or panics with the daemon's output, which goes to
    /// `TARGET.erofsfuse.log` beside the mountpoint (so put `TARGET` in a temporary directory).
    pub fn mount(tools: &Tools, image: &Path, devices: &[&Path], target: &Path) -> FuseMount {
        let parent_dev = std::fs::metadata(target.parent().expect("mountpoint has a parent"))
            .expect("stat the mountpoint's parent")
            .dev();
        let log = target.with_extension("erofsfuse.log");
        let logf = std::fs::File::create(&log).expect("create the erofsfuse log");
        let mut cmd = Command::new(&tools.fuse);
        cmd.arg("-f");
        for d in devices {
            cmd.arg(format!("--device={}", d.display()));
        }
        cmd.arg(image)
            .arg(target)
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("dup the log"))
            .stderr(logf);
        let child = cmd.spawn().expect("spawn erofsfuse");
        let mut m = FuseMount {
            target: target.to_path_buf(),
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::fs::metadata(target).is_ok_and(|md| md.dev() != parent_dev) {
                return m;
            }
            let exited = m
                .child
                .as_mut()
                .and_then(|c| c.try_wait().expect("poll erofsfuse"));
            if exited.is_some() || Instant::now() > deadline {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                panic!(
                    "erofsfuse {} on {} did not mount ({exited:?}):\n{text}",
                    image.display(),
                    target.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let unmounted = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.target)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            let _ = rustix::mount::unmount(&self.target, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if !matches!(c.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn versions_parse() {
    assert_eq!(
        parse_version("fsck.erofs (erofs-utils) 1.8.6"),
        Some((1, 8))
    );
    assert_eq!(parse_version("fsck.erofs 1.5"), Some((1, 5)));
    assert_eq!(parse_version("mkfs.erofs 1.10-rc1"), Some((1, 10)));
    assert_eq!(parse_version("garbage"), None);
}
