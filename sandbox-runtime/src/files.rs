//! `cp` between the host and a sandbox, confined to the sandbox's root.
//!
//! The sandbox side is reached from the host through its init's `/proc/<pid>/root`: the root
//! of the sandbox's own mount namespace, so paths cross its mounts (`/tmp`, the bound
//! `/etc/hostname`, secrets) as its processes see them, and writes to the root land in its
//! upper. Every path given for the sandbox side is resolved with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` from a descriptor of that root: `..`
//! and absolute symlinks stop at the sandbox's `/`, so a symlink planted inside never names
//! a host file. Below the top, a tree is walked with descriptors only (`openat` of one name
//! with `O_NOFOLLOW`, `mkdirat`, `symlinkat`): a process in the sandbox that swaps a
//! directory for a symlink mid-copy gets a failed copy, never an escape. Symlinks inside a
//! copied tree are copied as symlinks, never followed.
//!
//! Semantics follow `docker cp`: copying to a directory that exists puts the source inside it
//! under its own name; otherwise the destination is created. Copies are bounded in bytes
//! ([`DEFAULT_MAX_COPY`] unless the request says) and in entries ([`MAX_ENTRIES`]); the
//! host side is the caller's (root's) own business.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};

use crate::proto::CopyResult;
use crate::{Error, Result};

/// The default cap on a copy's file data.
pub const DEFAULT_MAX_COPY: u64 = 1 << 30;

/// The most entries one copy creates.
pub const MAX_ENTRIES: u64 = 100_000;

const RESOLVE: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);

struct Budget {
    bytes_left: u64,
    max_bytes: u64,
    result: CopyResult,
}

impl Budget {
    fn entry(&mut self) -> Result<()> {
        if self.result.files + self.result.dirs + self.result.symlinks >= MAX_ENTRIES {
            return Err(Error::Limit(format!(
                "the copy has more than {MAX_ENTRIES} entries"
            )));
        }
        Ok(())
    }

    fn take(&mut self, n: u64) -> Result<()> {
        if n > self.bytes_left {
            return Err(Error::Limit(format!(
                "the copy is larger than its cap of {} bytes",
                self.max_bytes
            )));
        }
        self.bytes_left -= n;
        self.result.bytes += n;
        Ok(())
    }
}

fn sys(context: impl Into<String>) -> impl FnOnce(rustix::io::Errno) -> Error {
    let c = context.into();
    move |e| Error::io(c, e.into())
}

/// A sandbox path as given, relative to its root (`/a/b` → `a/b`; `/` → `.`).
fn relative(path: &str) -> Result<PathBuf> {
    if path.is_empty() || path.contains('\0') {
        return Err(Error::InvalidSpec(format!("bad sandbox path {path:?}")));
    }
    let p = path.trim_start_matches('/');
    Ok(if p.is_empty() { ".".into() } else { p.into() })
}

fn open_root(root: &Path) -> Result<OwnedFd> {
    rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(sys(format!("open the sandbox root {}", root.display())))
}

fn split(rel: &Path) -> (PathBuf, std::ffi::OsString) {
    let name = rel
        .file_name()
        .map(|n| n.to_owned())
        .unwrap_or_else(|| ".".into());
    let parent = rel
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ".".into());
    (parent, name)
}

/// Copy host `src` (file, directory or symlink) to sandbox path `dst`.
pub fn copy_in(root: &Path, src: &Path, dst: &str, max_bytes: u64) -> Result<CopyResult> {
    let root_fd = open_root(root)?;
    let rel = relative(dst)?;
    let meta =
        std::fs::symlink_metadata(src).map_err(|e| Error::io(format!("{}", src.display()), e))?;
    let mut budget = Budget {
        bytes_left: max_bytes,
        max_bytes,
        result: CopyResult::default(),
    };
    // An existing directory receives the source under its own name.
    let existing = rustix::fs::openat2(
        &root_fd,
        &rel,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        RESOLVE,
    );
    let (parent, name) = match existing {
        Ok(dir) => {
            let name = src
                .file_name()
                .ok_or_else(|| Error::InvalidSpec(format!("{} has no name", src.display())))?
                .to_owned();
            (dir, name)
        }
        Err(_) => {
            let (p, n) = split(&rel);
            let dir = rustix::fs::openat2(
                &root_fd,
                &p,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                RESOLVE,
            )
            .map_err(sys(format!(
                "{}: no such directory in the sandbox",
                p.display()
            )))?;
            (dir, n)
        }
    };
    put(parent.as_fd(), Path::new(&name), src, &meta, &mut budget)?;
    Ok(budget.result)
}

/// Create `name` under the sandbox directory `dir` as a copy of host `src`.
fn put(
    dir: BorrowedFd<'_>,
    name: &Path,
    src: &Path,
    meta: &std::fs::Metadata,
    budget: &mut Budget,
) -> Result<()> {
    budget.entry()?;
    let mode = Mode::from_raw_mode(meta.mode() & 0o7777);
    let ft = meta.file_type();
    if ft.is_symlink() {
        let target =
            std::fs::read_link(src).map_err(|e| Error::io(format!("{}", src.display()), e))?;
        let _ = rustix::fs::unlinkat(dir, name, AtFlags::empty());
        rustix::fs::symlinkat(&target, dir, name)
            .map_err(sys(format!("create symlink {}", name.display())))?;
        budget.result.symlinks += 1;
    } else if ft.is_dir() {
        match rustix::fs::mkdirat(dir, name, mode) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(sys(format!("mkdir {}", name.display()))(e)),
        }
        let sub = rustix::fs::openat(
            dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(sys(format!("open directory {}", name.display())))?;
        budget.result.dirs += 1;
        let mut entries: Vec<_> = std::fs::read_dir(src)
            .map_err(|e| Error::io(format!("{}", src.display()), e))?
            .collect::<std::io::Result<_>>()
            .map_err(|e| Error::io(format!("{}", src.display()), e))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let m = e
                .path()
                .symlink_metadata()
                .map_err(|err| Error::io(format!("{}", e.path().display()), err))?;
            put(
                sub.as_fd(),
                Path::new(&e.file_name()),
                &e.path(),
                &m,
                budget,
            )?;
        }
        rustix::fs::fchmod(&sub, mode).map_err(sys(format!("chmod {}", name.display())))?;
    } else if ft.is_file() {
        budget.take(meta.len())?;
        let mut from =
            File::open(src).map_err(|e| Error::io(format!("open {}", src.display()), e))?;
        // O_NOFOLLOW: a symlink the sandbox put at this name is not written through.
        let fd = rustix::fs::openat(
            dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
        )
        .map_err(sys(format!("create {} in the sandbox", name.display())))?;
        let mut to = File::from(fd);
        let copied = copy_capped(&mut from, &mut to, meta.len())
            .map_err(|e| Error::io(format!("copy {}", src.display()), e))?;
        if copied != meta.len() {
            return Err(Error::Conflict(format!(
                "{} changed size while it was copied",
                src.display()
            )));
        }
        to.set_permissions(std::fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(|e| Error::io(format!("chmod {}", name.display()), e))?;
        budget.result.files += 1;
    } else {
        return Err(Error::InvalidSpec(format!(
            "{}: only files, directories and symlinks are copied",
            src.display()
        )));
    }
    Ok(())
}

/// Copy at most `n` bytes; how many were copied.
fn copy_capped(from: &mut File, to: &mut File, n: u64) -> std::io::Result<u64> {
    let copied = std::io::copy(&mut from.take(n), to)?;
    to.flush()?;
    Ok(copied)
}

/// Copy sandbox path `src` to host `dst`.
pub fn copy_out(root: &Path, src: &str, dst: &Path, max_bytes: u64) -> Result<CopyResult> {
    let root_fd = open_root(root)?;
    let rel = relative(src)?;
    let (parent_rel, name) = split(&rel);
    let parent = rustix::fs::openat2(
        &root_fd,
        &parent_rel,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        RESOLVE,
    )
    .map_err(sys(format!(
        "{}: no such directory in the sandbox",
        parent_rel.display()
    )))?;
    // The top is followed if it is a symlink, inside the root.
    let top = rustix::fs::openat2(
        &root_fd,
        &rel,
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        RESOLVE,
    )
    .map_err(sys(format!("{src}: not found in the sandbox")))?;
    let st = rustix::fs::fstat(&top).map_err(sys(src.to_owned()))?;
    let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
    let target = if dst.is_dir() {
        let n = if rel == Path::new(".") {
            "root".into()
        } else {
            name.clone()
        };
        dst.join(n)
    } else {
        dst.to_owned()
    };
    let mut budget = Budget {
        bytes_left: max_bytes,
        max_bytes,
        result: CopyResult::default(),
    };
    if is_dir {
        let fd = rustix::fs::openat2(
            &root_fd,
            &rel,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            RESOLVE,
        )
        .map_err(sys(src.to_owned()))?;
        get_dir(fd, &target, st.st_mode, &mut budget)?;
    } else {
        let fd = rustix::fs::openat2(
            &root_fd,
            &rel,
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
            RESOLVE,
        )
        .map_err(sys(src.to_owned()))?;
        get_file(fd, &target, &mut budget)?;
    }
    drop(parent);
    Ok(budget.result)
}

fn get_file(fd: OwnedFd, target: &Path, budget: &mut Budget) -> Result<()> {
    budget.entry()?;
    let st = rustix::fs::fstat(&fd).map_err(sys(format!("{}", target.display())))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(Error::InvalidSpec(format!(
            "{}: only files, directories and symlinks are copied",
            target.display()
        )));
    }
    let len = st.st_size as u64;
    budget.take(len)?;
    let mut from = File::from(fd);
    let mut to =
        File::create(target).map_err(|e| Error::io(format!("create {}", target.display()), e))?;
    copy_capped(&mut from, &mut to, len)
        .map_err(|e| Error::io(format!("copy to {}", target.display()), e))?;
    to.set_permissions(std::fs::Permissions::from_mode(st.st_mode & 0o7777))
        .map_err(|e| Error::io(format!("chmod {}", target.display()), e))?;
    budget.result.files += 1;
    Ok(())
}

fn get_dir(fd: OwnedFd, target: &Path, mode: u32, budget: &mut Budget) -> Result<()> {
    budget.entry()?;
    match std::fs::create_dir(target) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && target.is_dir() => {}
        Err(e) => return Err(Error::io(format!("mkdir {}", target.display()), e)),
    }
    budget.result.dirs += 1;
    let mut names = Vec::new();
    let dup = rustix::io::dup(&fd).map_err(sys(format!("{}", target.display())))?;
    let dir = rustix::fs::Dir::new(dup).map_err(sys(format!("{}", target.display())))?;
    for entry in dir {
        let entry = entry.map_err(sys(format!("read directory for {}", target.display())))?;
        let n = entry.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(entry.file_name().to_owned());
        }
    }
    names.sort();
    for n in names {
        let name = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(n.as_bytes());
        let to = target.join(name);
        let st = rustix::fs::statat(&fd, n.as_c_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(sys(format!("{}", to.display())))?;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let sub = rustix::fs::openat(
                    &fd,
                    n.as_c_str(),
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(sys(format!("{}", to.display())))?;
                get_dir(sub, &to, st.st_mode, budget)?;
            }
            FileType::Symlink => {
                budget.entry()?;
                let link = rustix::fs::readlinkat(&fd, n.as_c_str(), Vec::new())
                    .map_err(sys(format!("{}", to.display())))?;
                let link =
                    <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(link.as_bytes());
                let _ = std::fs::remove_file(&to);
                std::os::unix::fs::symlink(link, &to)
                    .map_err(|e| Error::io(format!("symlink {}", to.display()), e))?;
                budget.result.symlinks += 1;
            }
            FileType::RegularFile => {
                let f = rustix::fs::openat(
                    &fd,
                    n.as_c_str(),
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(sys(format!("{}", to.display())))?;
                get_file(f, &to, budget)?;
            }
            // Devices, fifos and sockets are not copied out (a fifo would block the copy).
            _ => {}
        }
    }
    std::fs::set_permissions(target, std::fs::Permissions::from_mode(mode & 0o7777))
        .map_err(|e| Error::io(format!("chmod {}", target.display()), e))?;
    Ok(())
}

/// Whether sandbox path `path` names something (confined like `cp`: a symlink inside never
/// leads out of `root`).
pub fn exists(root: &Path, path: &str) -> bool {
    let (Ok(root_fd), Ok(rel)) = (open_root(root), relative(path)) else {
        return false;
    };
    rustix::fs::openat2(
        &root_fd,
        rel,
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        RESOLVE,
    )
    .is_ok()
}

/// Read a small file of the sandbox (confined like `cp`), at most `max` bytes.
pub fn read_small(root: &Path, path: &str, max: u64) -> Result<Vec<u8>> {
    let root_fd = open_root(root)?;
    let fd = rustix::fs::openat2(
        &root_fd,
        relative(path)?,
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
        RESOLVE,
    )
    .map_err(sys(format!("{path} in the sandbox")))?;
    let mut out = Vec::new();
    File::from(fd)
        .take(max)
        .read_to_end(&mut out)
        .map_err(|e| Error::io(format!("read {path} in the sandbox"), e))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/passwd"), "sandbox's own\n").unwrap();
        (d, root)
    }

    #[test]
    fn a_symlink_planted_in_the_sandbox_does_not_reach_the_host() {
        let (d, root) = tree();
        let host_secret = d.path().join("host-secret");
        std::fs::write(&host_secret, "host\n").unwrap();
        // Absolute and relative escapes.
        std::os::unix::fs::symlink(&host_secret, root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../../host-secret", root.join("etc/rel")).unwrap();
        std::os::unix::fs::symlink("/", root.join("slash")).unwrap();
        let out = d.path().join("out");
        for p in ["/abs", "/etc/rel", "/../host-secret"] {
            let e = copy_out(&root, p, &out, 1 << 20);
            assert!(e.is_err(), "{p} resolved outside the root");
        }
        // `/slash/etc/passwd` is the sandbox's /etc/passwd, not the host's.
        copy_out(&root, "/slash/etc/passwd", &out, 1 << 20).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "sandbox's own\n");
        // Writing through a symlink to the host is refused; the host file is untouched.
        let src = d.path().join("payload");
        std::fs::write(&src, "owned\n").unwrap();
        let _ = copy_in(&root, &src, "/abs", 1 << 20);
        assert_eq!(std::fs::read_to_string(&host_secret).unwrap(), "host\n");
        let _ = copy_in(&root, &src, "/slash/../../host-secret", 1 << 20);
        assert_eq!(std::fs::read_to_string(&host_secret).unwrap(), "host\n");
    }

    #[test]
    fn directories_round_trip_and_the_cap_holds() {
        let (d, root) = tree();
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("a/b")).unwrap();
        std::fs::write(src.join("a/b/f"), vec![7u8; 10_000]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("a/link")).unwrap();
        let r = copy_in(&root, &src, "/work", 1 << 20).unwrap();
        assert_eq!((r.files, r.symlinks, r.bytes), (1, 1, 10_000));
        assert_eq!(
            std::fs::read(root.join("work/a/b/f")).unwrap().len(),
            10_000
        );
        // Into an existing directory: under the source's name.
        copy_in(&root, &src, "/etc", 1 << 20).unwrap();
        assert!(root.join("etc/src/a/b/f").is_file());
        let out = d.path().join("back");
        let r = copy_out(&root, "/work", &out, 1 << 20).unwrap();
        assert_eq!(r.files, 1);
        assert_eq!(
            std::fs::read_link(out.join("a/link")).unwrap(),
            Path::new("/etc/passwd")
        );
        let e = copy_in(&root, &src, "/small", 100).unwrap_err();
        assert!(matches!(e, Error::Limit(_)), "{e}");
    }
}
