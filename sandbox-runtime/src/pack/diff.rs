//! The walk of a sandbox's upper that decides what a packed layer holds ([`Plan`]).
//!
//! Every upper entry is, in this order:
//! 1. **stripped** if a residue rule matches it (its subtree is not entered);
//! 2. **refused** if it carries `trusted.overlay.redirect` or `.metacopy` (the upper then
//!    does not hold the entry's contents; the runtime mounts uppers with `redirect_dir=off`
//!    and `metacopy=off`, so this is a guard);
//! 3. a **whiteout** (character device 0:0): kept, unless the lower has nothing of that name
//!    (a no-op whiteout, dropped);
//! 4. **unchanged** and dropped if the lower has the same entry with every attribute and
//!    byte equal: type, mode, owner, size, mtime (seconds and nanoseconds), device number,
//!    symlink target, xattrs (overlay bookkeeping aside) and contents. A file with more than
//!    one link is always kept (dropping one name would break the link). A directory is
//!    dropped only if it is not opaque, its own mode, owner and xattrs equal the lower's and
//!    every entry under it was dropped or stripped; its mtime is not compared (renaming
//!    `a` to `b` and back changes it and nothing else), so a dropped directory shows the
//!    lower's mtime;
//! 5. otherwise **packed**, and scanned for the builder's secrets (contents, name, symlink
//!    target, xattr values).
//!
//! Names starting with `.wh.` are plain files in an EROFS layer, but an OCI export would
//! turn them into deletions of lower files (podman #3582): they are packed as they are and
//! listed ([`Plan::disguised`]); the export refuses them.
//!
//! The lower is the sandbox's stack mounted read-only on its own (no upper). It is looked up
//! with `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH)`: a lower path that crosses a
//! symlink (an absolute one would point at the host) is never followed; such an entry
//! counts as changed and is packed.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

use super::residue::Rules;
use super::secrets::Scanner;
use crate::{Error, Result};

/// Deepest directory nesting walked.
const MAX_DEPTH: usize = 512;
/// Paths kept in each list of the result (counts stay exact).
const LISTED: usize = 1000;

/// A stripped path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stripped {
    /// As the sandbox sees it.
    pub path: String,
    /// The rule that matched (as written).
    pub rule: String,
    /// Entries and file bytes left out with it.
    pub entries: u64,
    pub bytes: u64,
}

/// A secret found in a file that would be packed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretHit {
    pub path: String,
    pub secret: String,
    /// `raw`, `hex`, `base64`, `base64url`; with ` in name`, ` in symlink target`,
    /// ` in xattr` where it was not in the contents.
    pub how: String,
}

/// What the walk decided.
#[derive(Debug, Default)]
pub struct Plan {
    /// Upper entries left out of the layer, relative to the upper.
    pub exclude: HashSet<PathBuf>,
    pub stripped: Vec<Stripped>,
    pub stripped_count: u64,
    pub unchanged: Vec<String>,
    pub unchanged_count: u64,
    pub noop_whiteouts: u64,
    pub whiteouts: u64,
    pub opaque_dirs: u64,
    pub disguised: Vec<String>,
    pub secrets: Vec<SecretHit>,
    pub upper_entries: u64,
    pub packed_entries: u64,
    pub packed_files: u64,
    pub packed_bytes: u64,
}

struct Walk<'a> {
    upper: &'a Path,
    lower: OwnedFd,
    lower_root: &'a Path,
    rules: &'a Rules,
    scanner: &'a Scanner,
    plan: Plan,
}

/// Walk `upper` against the read-only `lower` view of the stack.
pub fn plan(upper: &Path, lower: &Path, rules: &Rules, scanner: &Scanner) -> Result<Plan> {
    let lower_fd = rustix::fs::open(
        lower,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io(format!("open {}", lower.display()), e.into()))?;
    let mut w = Walk {
        upper,
        lower: lower_fd,
        lower_root: lower,
        rules,
        scanner,
        plan: Plan::default(),
    };
    w.dir(Path::new(""), 0)?;
    // The root is always packed (its attributes are the merged root's).
    w.plan.packed_entries += 1;
    w.scan_names_and_xattrs(Path::new(""), &read_xattrs(upper)?);
    Ok(w.plan)
}

/// Whether a directory's xattrs make it opaque.
fn opaque(xattrs: &[(OsString, Vec<u8>)]) -> bool {
    xattrs.iter().any(|(n, v)| {
        (n == "trusted.overlay.opaque" || n == "user.overlay.opaque") && v.as_slice() == b"y"
    })
}

fn overlay_name(n: &OsStr) -> bool {
    let b = n.as_bytes();
    b.starts_with(b"trusted.overlay.") || b.starts_with(b"user.overlay.")
}

/// The xattrs of `path` (not followed), sorted.
fn read_xattrs(path: &Path) -> Result<Vec<(OsString, Vec<u8>)>> {
    let ctx = || format!("list the xattrs of {}", path.display());
    let mut names = vec![0u8; 1024];
    let n = loop {
        match rustix::fs::llistxattr(path, &mut names[..]) {
            Ok(n) => break n,
            Err(rustix::io::Errno::RANGE) if names.len() < 1 << 20 => {
                names.resize(names.len() * 4, 0)
            }
            Err(rustix::io::Errno::NOTSUP) => return Ok(Vec::new()),
            Err(e) => return Err(Error::io(ctx(), e.into())),
        }
    };
    let mut out = Vec::new();
    for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name = OsStr::from_bytes(name);
        let mut value = vec![0u8; 256];
        let len = loop {
            match rustix::fs::lgetxattr(path, name, &mut value[..]) {
                Ok(n) => break n,
                Err(rustix::io::Errno::RANGE) if value.len() < 1 << 17 => {
                    value.resize(value.len() * 8, 0)
                }
                Err(rustix::io::Errno::NODATA) => break usize::MAX,
                Err(e) => return Err(Error::io(ctx(), e.into())),
            }
        };
        if len != usize::MAX {
            value.truncate(len);
            out.push((name.to_owned(), value));
        }
    }
    out.sort();
    Ok(out)
}

/// The lower's entry at `rel`: `Ok(None)` if it has none, `Err` only for I/O failures; a
/// path that crosses a symlink in the lower is `Some(None)`-like: reported as `Unknown`.
enum Lower {
    Absent,
    /// Reached through a symlink, or otherwise not comparable: treated as different.
    Unknown,
    Present(std::fs::Metadata),
}

impl Walk<'_> {
    fn lower(&self, rel: &Path) -> Result<Lower> {
        let how = rustix::fs::openat2(
            &self.lower,
            rel,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::BENEATH,
        );
        match how {
            // The descriptor names the entry the symlink-free lookup reached: its metadata,
            // with no second lookup by path.
            Ok(fd) => match File::from(fd).metadata() {
                Ok(m) => Ok(Lower::Present(m)),
                Err(e) => Err(Error::io(
                    format!("stat /{} in the lower stack", rel.display()),
                    e,
                )),
            },
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => Ok(Lower::Absent),
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::XDEV) => Ok(Lower::Unknown),
            Err(e) => Err(Error::io(
                format!("look up {} in the lower stack", rel.display()),
                e.into(),
            )),
        }
    }

    /// Walk directory `rel` (relative to the upper); whether everything under it was left
    /// out.
    fn dir(&mut self, rel: &Path, depth: usize) -> Result<bool> {
        if depth > MAX_DEPTH {
            return Err(Error::Refused(format!(
                "the upper nests deeper than {MAX_DEPTH} directories at /{}",
                rel.display()
            )));
        }
        let dir = self.upper.join(rel);
        let rd =
            std::fs::read_dir(&dir).map_err(|e| Error::io(format!("read {}", dir.display()), e))?;
        let mut names = Vec::new();
        for e in rd {
            names.push(
                e.map_err(|e| Error::io(format!("read {}", dir.display()), e))?
                    .file_name(),
            );
        }
        names.sort();
        let mut all_gone = true;
        for name in names {
            let rel = rel.join(&name);
            if !self.entry(&rel, &name, depth)? {
                all_gone = false;
            }
        }
        Ok(all_gone)
    }

    /// One entry; whether it is left out.
    fn entry(&mut self, rel: &Path, name: &OsStr, depth: usize) -> Result<bool> {
        let up = self.upper.join(rel);
        let abs = Path::new("/").join(rel);
        let shown = abs.display().to_string();
        let meta =
            std::fs::symlink_metadata(&up).map_err(|e| Error::io(format!("lstat {shown}"), e))?;
        self.plan.upper_entries += 1;
        let ft = meta.file_type();
        if let Some(rule) = self.rules.strips(&abs, ft.is_dir()) {
            let (entries, bytes) = du(&up);
            self.plan.stripped_count += 1;
            if self.plan.stripped.len() < LISTED {
                self.plan.stripped.push(Stripped {
                    path: shown,
                    rule,
                    entries,
                    bytes,
                });
            }
            self.plan.exclude.insert(rel.to_path_buf());
            return Ok(true);
        }
        let xattrs = read_xattrs(&up)?;
        for (n, _) in &xattrs {
            if n == "trusted.overlay.redirect"
                || n == "trusted.overlay.metacopy"
                || n == "user.overlay.redirect"
                || n == "user.overlay.metacopy"
            {
                return Err(Error::Refused(format!(
                    "{shown} carries {} (a renamed directory or a metadata-only copy-up: the \
                     upper does not hold its contents; mount uppers with redirect_dir=off and \
                     metacopy=off)",
                    n.to_string_lossy()
                )));
            }
        }
        if name.as_bytes().starts_with(b".wh.") && self.plan.disguised.len() < LISTED {
            self.plan.disguised.push(shown.clone());
        }
        let gone = if ft.is_char_device() && meta.rdev() == 0 {
            self.plan.whiteouts += 1;
            if matches!(self.lower(rel)?, Lower::Absent) {
                self.plan.noop_whiteouts += 1;
                true
            } else {
                false
            }
        } else if ft.is_dir() {
            let children_gone = self.dir(rel, depth + 1)?;
            if opaque(&xattrs) {
                self.plan.opaque_dirs += 1;
                false
            } else {
                children_gone && self.same_as_lower(rel, &up, &meta, &xattrs)?
            }
        } else {
            meta.nlink() == 1 && self.same_as_lower(rel, &up, &meta, &xattrs)?
        };
        if gone {
            if !(ft.is_char_device() && meta.rdev() == 0) {
                self.plan.unchanged_count += 1;
                if self.plan.unchanged.len() < LISTED {
                    self.plan.unchanged.push(shown);
                }
            }
            self.plan.exclude.insert(rel.to_path_buf());
            return Ok(true);
        }
        self.plan.packed_entries += 1;
        self.scan_names_and_xattrs(rel, &xattrs);
        if ft.is_file() {
            self.plan.packed_files += 1;
            self.plan.packed_bytes += meta.len();
            if !self.scanner.is_empty() {
                let f = open_nofollow(&up)?;
                let found = self
                    .scanner
                    .find_in(f)
                    .map_err(|e| Error::io(format!("read {shown}"), e))?;
                if let Some((secret, how)) = found {
                    self.hit(rel, secret, how.to_owned());
                }
            }
        } else if ft.is_symlink() {
            let target =
                std::fs::read_link(&up).map_err(|e| Error::io(format!("readlink {shown}"), e))?;
            if let Some((secret, how)) = self.scanner.find(target.as_os_str().as_bytes()) {
                self.hit(rel, secret, format!("{how} in symlink target"));
            }
        }
        Ok(false)
    }

    fn scan_names_and_xattrs(&mut self, rel: &Path, xattrs: &[(OsString, Vec<u8>)]) {
        if let Some(name) = rel.file_name() {
            if let Some((secret, how)) = self.scanner.find(name.as_bytes()) {
                self.hit(rel, secret, format!("{how} in name"));
            }
        }
        for (n, v) in xattrs {
            let found = self
                .scanner
                .find(v)
                .or_else(|| self.scanner.find(n.as_bytes()));
            if let Some((secret, how)) = found {
                self.hit(
                    rel,
                    secret,
                    format!("{how} in xattr {}", n.to_string_lossy()),
                );
            }
        }
    }

    fn hit(&mut self, rel: &Path, secret: &str, how: String) {
        self.plan.secrets.push(SecretHit {
            path: Path::new("/").join(rel).display().to_string(),
            secret: secret.to_owned(),
            how,
        });
    }

    /// Whether the upper entry at `rel` equals the lower's in every attribute and byte.
    fn same_as_lower(
        &self,
        rel: &Path,
        up: &Path,
        meta: &std::fs::Metadata,
        xattrs: &[(OsString, Vec<u8>)],
    ) -> Result<bool> {
        let Lower::Present(low) = self.lower(rel)? else {
            return Ok(false);
        };
        let (ft, lt) = (meta.file_type(), low.file_type());
        let same_kind = (ft.is_dir() && lt.is_dir())
            || (ft.is_file() && lt.is_file())
            || (ft.is_symlink() && lt.is_symlink())
            || (ft.is_char_device() && lt.is_char_device())
            || (ft.is_block_device() && lt.is_block_device())
            || (ft.is_fifo() && lt.is_fifo())
            || (ft.is_socket() && lt.is_socket());
        if !same_kind
            || meta.mode() != low.mode()
            || meta.uid() != low.uid()
            || meta.gid() != low.gid()
        {
            return Ok(false);
        }
        if !ft.is_dir()
            && (meta.mtime() != low.mtime()
                || meta.mtime_nsec() != low.mtime_nsec()
                || meta.size() != low.size()
                || meta.rdev() != low.rdev())
        {
            return Ok(false);
        }
        let lp = self.lower_root.join(rel);
        let strip = |x: &[(OsString, Vec<u8>)]| -> Vec<(OsString, Vec<u8>)> {
            x.iter()
                .filter(|(n, _)| !overlay_name(n))
                .cloned()
                .collect()
        };
        if strip(xattrs) != strip(&read_xattrs(&lp)?) {
            return Ok(false);
        }
        if ft.is_symlink() {
            let a = std::fs::read_link(up).map_err(|e| Error::io("readlink", e))?;
            let b = std::fs::read_link(&lp).map_err(|e| Error::io("readlink", e))?;
            return Ok(a == b);
        }
        if ft.is_file() {
            return same_bytes(up, &lp);
        }
        Ok(true)
    }
}

fn open_nofollow(p: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(p)
        .map_err(|e| Error::io(format!("open {}", p.display()), e))
}

fn same_bytes(a: &Path, b: &Path) -> Result<bool> {
    let (mut fa, mut fb) = (open_nofollow(a)?, open_nofollow(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(|e| Error::io("read the upper", e))?;
        let nb = read_full(&mut fb, &mut bb).map_err(|e| Error::io("read the lower", e))?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Entries and regular-file bytes under `p` (itself included), not following symlinks; an
/// explicit stack, so that no nesting depth can exhaust the thread's.
fn du(p: &Path) -> (u64, u64) {
    let (mut entries, mut bytes) = (0u64, 0u64);
    let mut todo = vec![p.to_path_buf()];
    while let Some(p) = todo.pop() {
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        entries += 1;
        if m.is_file() {
            bytes += m.len();
        } else if m.is_dir() {
            if let Ok(rd) = std::fs::read_dir(&p) {
                todo.extend(rd.flatten().map(|e| e.path()));
            }
        }
    }
    (entries, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    struct T {
        _d: tempfile::TempDir,
        upper: PathBuf,
        lower: PathBuf,
    }

    fn setup() -> T {
        let d = tempfile::tempdir().unwrap();
        let (upper, lower) = (d.path().join("upper"), d.path().join("lower"));
        for p in [&upper, &lower] {
            std::fs::create_dir_all(p.join("etc")).unwrap();
        }
        T {
            _d: d,
            upper,
            lower,
        }
    }

    /// The same file in both, with the same mtime.
    fn twin(t: &T, rel: &str, body: &str) {
        for root in [&t.lower, &t.upper] {
            std::fs::write(root.join(rel), body).unwrap();
        }
        let m = std::fs::metadata(t.lower.join(rel)).unwrap();
        let f = std::fs::File::options()
            .write(true)
            .open(t.upper.join(rel))
            .unwrap();
        f.set_modified(m.modified().unwrap()).unwrap();
    }

    fn run(t: &T, secrets: &[(String, Vec<u8>)]) -> Result<Plan> {
        let rules = Rules::new(true, None).unwrap();
        plan(&t.upper, &t.lower, &rules, &Scanner::new(secrets).unwrap())
    }

    fn has(p: &Plan, rel: &str) -> bool {
        !p.exclude.contains(Path::new(rel))
    }

    #[test]
    fn unchanged_copy_ups_go_and_real_changes_stay() {
        let t = setup();
        twin(&t, "etc/same", "x");
        twin(&t, "etc/touched", "x");
        std::fs::File::options()
            .write(true)
            .open(t.upper.join("etc/touched"))
            .unwrap()
            .set_modified(std::time::SystemTime::UNIX_EPOCH)
            .unwrap();
        twin(&t, "etc/edited", "x");
        {
            // Same size and mtime, other bytes: only the contents tell.
            let m = std::fs::metadata(t.upper.join("etc/edited")).unwrap();
            std::fs::write(t.upper.join("etc/edited"), "y").unwrap();
            let f = std::fs::File::options()
                .write(true)
                .open(t.upper.join("etc/edited"))
                .unwrap();
            f.set_modified(m.modified().unwrap()).unwrap();
        }
        twin(&t, "etc/chmodded", "x");
        std::fs::set_permissions(
            t.upper.join("etc/chmodded"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        twin(&t, "etc/linked", "x");
        std::fs::hard_link(t.upper.join("etc/linked"), t.upper.join("etc/linked2")).unwrap();
        std::fs::write(t.upper.join("etc/new"), "n").unwrap();
        std::fs::create_dir(t.upper.join("only")).unwrap();
        std::fs::create_dir(t.lower.join("only")).unwrap();
        twin(&t, "only/same", "s");
        let p = run(&t, &[]).unwrap();
        for gone in ["etc/same", "only/same"] {
            assert!(!has(&p, gone), "{gone} is packed");
        }
        for kept in [
            "etc/touched",
            "etc/edited",
            "etc/chmodded",
            "etc/linked",
            "etc/linked2",
            "etc/new",
            "etc",
        ] {
            assert!(has(&p, kept), "{kept} was dropped");
        }
        // A directory with nothing left under it and the stack's attributes goes too.
        assert!(!has(&p, "only"), "{:?}", p.unchanged);
        assert_eq!(p.unchanged_count, 3, "{:?}", p.unchanged);
    }

    #[test]
    fn whiteouts_stay_only_where_the_stack_has_the_name() {
        if !rustix::process::geteuid().is_root() {
            println!("\n*** SKIPPED whiteouts_stay_only_where_the_stack_has_the_name: needs root (mknod) ***\n");
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "needs root under CI"
            );
            return;
        }
        let t = setup();
        std::fs::write(t.lower.join("etc/old"), "o").unwrap();
        for name in ["etc/old", "etc/never"] {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                t.upper.join(name),
                rustix::fs::FileType::CharacterDevice,
                rustix::fs::Mode::from_raw_mode(0o000),
                0,
            )
            .unwrap();
        }
        let p = run(&t, &[]).unwrap();
        assert!(has(&p, "etc/old"));
        assert!(!has(&p, "etc/never"));
        assert_eq!((p.whiteouts, p.noop_whiteouts), (2, 1));
    }

    #[test]
    fn redirects_and_metacopies_are_refused_with_the_path() {
        if !rustix::process::geteuid().is_root() {
            println!("\n*** SKIPPED redirects_and_metacopies_are_refused_with_the_path: needs root (trusted xattrs) ***\n");
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "needs root under CI"
            );
            return;
        }
        for x in ["trusted.overlay.redirect", "trusted.overlay.metacopy"] {
            let t = setup();
            std::fs::create_dir(t.upper.join("etc/moved")).unwrap();
            rustix::fs::setxattr(
                t.upper.join("etc/moved"),
                x,
                b"/x",
                rustix::fs::XattrFlags::empty(),
            )
            .unwrap();
            let e = run(&t, &[]).unwrap_err();
            assert!(e.to_string().contains("/etc/moved"), "{e}");
            assert!(e.to_string().contains(x), "{e}");
        }
    }

    #[test]
    fn a_symlink_of_the_stack_is_never_followed_to_the_host() {
        let t = setup();
        // The stack's /host points at the host's root; the upper has a file under it that
        // equals the host's file byte for byte. Following the link would drop it.
        std::os::unix::fs::symlink("/", t.lower.join("host")).unwrap();
        std::fs::create_dir_all(t.upper.join("host/etc")).unwrap();
        let host = std::fs::read("/etc/hostname").unwrap_or_else(|_| b"h\n".to_vec());
        std::fs::write(t.upper.join("host/etc/hostname"), &host).unwrap();
        let p = run(&t, &[]).unwrap();
        assert!(has(&p, "host/etc/hostname"));
        assert!(has(&p, "host"));
    }

    #[test]
    fn secrets_are_found_in_contents_names_targets_and_xattrs() {
        let t = setup();
        let secret = b"hunter2-hunter2".to_vec();
        std::fs::write(t.upper.join("etc/conf"), b"pw=hunter2-hunter2\n").unwrap();
        std::fs::write(t.upper.join("etc/aHVudGVyMi1odW50ZXIy"), b"").unwrap();
        std::os::unix::fs::symlink("/x/hunter2-hunter2", t.upper.join("etc/l")).unwrap();
        std::fs::write(t.upper.join("etc/clean"), b"nothing").unwrap();
        rustix::fs::setxattr(
            t.upper.join("etc/clean"),
            "user.note",
            hex::encode(&secret).as_bytes(),
            rustix::fs::XattrFlags::empty(),
        )
        .ok();
        // Stripped residue is not scanned: it does not enter the layer.
        std::fs::create_dir_all(t.upper.join("tmp")).unwrap();
        std::fs::write(t.upper.join("tmp/leak"), &secret).unwrap();
        let p = run(&t, &[("pw".into(), secret)]).unwrap();
        let hits: Vec<(&str, &str)> = p
            .secrets
            .iter()
            .map(|h| (h.path.as_str(), h.how.as_str()))
            .collect();
        assert!(hits.contains(&("/etc/conf", "raw")), "{hits:?}");
        assert!(
            hits.contains(&("/etc/aHVudGVyMi1odW50ZXIy", "base64 in name")),
            "{hits:?}"
        );
        assert!(
            hits.contains(&("/etc/l", "raw in symlink target")),
            "{hits:?}"
        );
        assert!(!hits.iter().any(|(p, _)| p.starts_with("/tmp")), "{hits:?}");
        // tmpfs and most disks take user xattrs; where they do, the hex value is found.
        if rustix::fs::getxattr(t.upper.join("etc/clean"), "user.note", &mut [0u8; 64]).is_ok() {
            assert!(
                hits.contains(&("/etc/clean", "hex in xattr user.note")),
                "{hits:?}"
            );
        }
    }
}
