//! erofs-utils 1.8 for the interop tests: where the tools are, a loud skip (or a CI failure)
//! when they are not, and an `erofsfuse` mount that is always unmounted.
//!
//! `scripts/build-erofs-utils.sh` builds erofs-utils 1.8.x from Debian trixie's source
//! package into [`DEFAULT_DIR`], off the default `PATH` (Debian 12's 1.5 stays the default
//! `fsck.erofs`). [`DIR_ENV`] points the tests at another directory.

#![allow(dead_code)]

use std::io::Write;
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
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: erofs-utils >= 1.8 not found in {dir} (run scripts/build-erofs-utils.sh)"
    );
    // Straight to fd 2: libtest's capture would hide an eprintln! of a passing test.
    let _ = std::io::stderr().write_all(
        format!(
            "\n*** SKIPPED {test}: erofs-utils >= 1.8 not found in {dir} \
             (run scripts/build-erofs-utils.sh as root) ***\n\n"
        )
        .as_bytes(),
    );
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

/// What a tree comparison checks (besides names, types, sizes, contents, symlink targets and
/// device numbers, which are always compared) and which known tool gaps it tolerates.
#[derive(Debug, Clone, Copy)]
pub struct Check {
    /// Mode bits compared besides the type.
    pub perm_mask: u32,
    /// uid and gid.
    pub owners: bool,
    /// mtime seconds; and nanoseconds when `mtime_nsec`.
    pub mtime: bool,
    pub mtime_nsec: bool,
    /// Extended attributes, except the names in `xattrs_lost`.
    pub xattrs: bool,
    /// Xattr names that may be missing on the copy (a known tool gap; reported). When
    /// present they must still be equal.
    pub xattrs_lost: &'static [&'static [u8]],
    /// On an inode with an empty-valued xattr, any xattr may be missing on the copy (a known
    /// tool gap; reported).
    pub xattrs_lost_with_empty: bool,
    /// nlink of every entry and hard-link identity (one source inode ↔ one copy inode).
    pub nlink: bool,
    /// A regular file of the copy may be shorter than the source when every byte it lacks
    /// is zero in the source (a trailing hole not re-created; reported).
    pub zero_tail_may_be_missing: bool,
}

/// What [`compare`] saw.
#[derive(Debug, Default)]
pub struct Report {
    pub entries: usize,
    pub file_bytes: u64,
    /// Xattrs compared equal.
    pub xattrs: usize,
    /// Entries whose mtime had a non-zero nanosecond part that was compared.
    pub nsec_mtimes: usize,
    /// (path, xattr name) missing on the copy, tolerated by `xattrs_lost`.
    pub lost_xattrs: Vec<(PathBuf, String)>,
    /// (path, bytes missing) tolerated by `zero_tail_may_be_missing`.
    pub short_files: Vec<(PathBuf, u64)>,
}

/// Compares the tree at `src` with its copy at `dst` (mounted or extracted), entry by entry.
pub fn compare(src: &Path, dst: &Path, c: Check) -> Report {
    let mut r = Report::default();
    let mut inos = std::collections::HashMap::new();
    compare_dir(src, dst, c, &mut inos, &mut r);
    r
}

fn sorted_names(p: &Path) -> Vec<std::ffi::OsString> {
    let mut v: Vec<_> = std::fs::read_dir(p)
        .unwrap_or_else(|e| panic!("readdir {}: {e}", p.display()))
        .map(|e| e.unwrap().file_name())
        .collect();
    v.sort();
    v
}

fn compare_dir(
    src: &Path,
    dst: &Path,
    c: Check,
    inos: &mut std::collections::HashMap<u64, u64>,
    r: &mut Report,
) {
    use std::os::unix::fs::FileTypeExt;
    let names = sorted_names(src);
    assert_eq!(names, sorted_names(dst), "entries of {}", src.display());
    for name in names {
        let (sp, dp) = (src.join(&name), dst.join(&name));
        let sm = std::fs::symlink_metadata(&sp).unwrap();
        let dm = std::fs::symlink_metadata(&dp).unwrap();
        let what = sp.display().to_string();
        r.entries += 1;
        let ft = sm.file_type();
        assert_eq!(sm.mode() & 0o170000, dm.mode() & 0o170000, "type of {what}");
        assert_eq!(
            sm.mode() & c.perm_mask,
            dm.mode() & c.perm_mask,
            "mode of {what}"
        );
        if c.owners {
            assert_eq!(
                (sm.uid(), sm.gid()),
                (dm.uid(), dm.gid()),
                "owner of {what}"
            );
        }
        if c.mtime {
            assert_eq!(sm.mtime(), dm.mtime(), "mtime of {what}");
        }
        if c.mtime_nsec {
            assert_eq!(sm.mtime_nsec(), dm.mtime_nsec(), "mtime ns of {what}");
            r.nsec_mtimes += usize::from(sm.mtime_nsec() != 0);
        }
        if c.xattrs {
            let (sx, mut dx) = (crate::common::xattrs_of(&sp), crate::common::xattrs_of(&dp));
            let has_empty = sx.values().any(Vec::is_empty);
            for (k, v) in &sx {
                match dx.remove(k) {
                    Some(d) => {
                        assert!(d == *v, "xattr {} of {what}", String::from_utf8_lossy(k));
                        r.xattrs += 1;
                    }
                    None if c.xattrs_lost.contains(&k.as_slice())
                        || (c.xattrs_lost_with_empty && has_empty) =>
                    {
                        r.lost_xattrs
                            .push((sp.clone(), String::from_utf8_lossy(k).into_owned()));
                    }
                    None => panic!("xattr {} of {what} missing", String::from_utf8_lossy(k)),
                }
            }
            assert!(dx.is_empty(), "extra xattrs on {what}: {:?}", dx.keys());
        }
        if ft.is_char_device() || ft.is_block_device() {
            assert_eq!(sm.rdev(), dm.rdev(), "rdev of {what}");
        }
        if c.nlink {
            assert_eq!(sm.nlink(), dm.nlink(), "nlink of {what}");
            if !ft.is_dir() {
                let prev = inos.insert(sm.ino(), dm.ino());
                assert!(
                    prev.is_none() || prev == Some(dm.ino()),
                    "hard link identity of {what}"
                );
            }
        }
        if ft.is_file() {
            let n = files_equal(&sp, &dp, c.zero_tail_may_be_missing, &what);
            if n < sm.len() {
                r.short_files.push((sp.clone(), sm.len() - n));
            }
            r.file_bytes += sm.len();
        } else if ft.is_symlink() {
            assert_eq!(
                std::fs::read_link(&sp).unwrap(),
                std::fs::read_link(&dp).unwrap(),
                "target of {what}"
            );
        } else if ft.is_dir() {
            compare_dir(&sp, &dp, c, inos, r);
        }
    }
}

/// Compares contents; returns the copy's length. With `zero_tail`, a shorter copy passes
/// when the source's remaining bytes are all zero.
fn files_equal(a: &Path, b: &Path, zero_tail: bool, what: &str) -> u64 {
    use std::io::Read;
    let (la, lb) = (
        std::fs::metadata(a).unwrap().len(),
        std::fs::metadata(b).unwrap().len(),
    );
    assert!(
        la == lb || (zero_tail && lb < la),
        "size of {what}: {la} vs {lb}"
    );
    let (mut fa, mut fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    let mut off = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba);
        let nb = read_full(&mut fb, &mut bb);
        assert!(ba[..nb] == bb[..nb], "content of {what} near offset {off}");
        if na > nb {
            assert!(
                ba[nb..na].iter().all(|&x| x == 0),
                "missing non-zero tail of {what}"
            );
        }
        off += na as u64;
        if na == 0 {
            return lb;
        }
    }
    fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> usize {
        let mut n = 0;
        while n < buf.len() {
            match f.read(&mut buf[n..]).unwrap() {
                0 => break,
                k => n += k,
            }
        }
        n
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
