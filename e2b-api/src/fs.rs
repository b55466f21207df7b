//! Filesystem operations on a sandbox's root, confined to it.
//!
//! The root is the sandbox's `/proc/<init>/root` (`Sandbox::view`: its own mount namespace,
//! `/tmp` and all). Every path is resolved from a descriptor of that root with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: `..` and absolute symlinks stop at the
//! sandbox's `/`. Operations on a final name (mkdir, unlink, rename) act on a descriptor of
//! its confined parent with that one name, so a symlink there is the entry itself, never
//! followed out. Removal of a tree walks descriptors only (`O_NOFOLLOW`).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use serde::Serialize;

use crate::{Error, Result};

const RESOLVE: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);

/// The most entries one `ListDir` answers with.
pub const MAX_LIST: usize = 100_000;

fn sys(context: impl Into<String>) -> impl FnOnce(rustix::io::Errno) -> Error {
    let c = context.into();
    move |e| Error::io(c, e.into())
}

/// A sandbox user: uid, gid and home.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

impl User {
    pub fn root() -> User {
        User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
        }
    }
}

/// A sandbox root, opened once for a request.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
}

/// The clean absolute form of `path` (relative: under `home`); `..` stops at `/`.
pub fn absolute(path: &str, home: &str) -> Result<String> {
    if path.contains('\0') {
        return Err(Error::BadRequest(format!("bad path {path:?}")));
    }
    let full = if path.starts_with('/') {
        path.to_owned()
    } else if path == "~" {
        home.to_owned()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else {
        format!("{home}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in Path::new(&full).components() {
        match c {
            Component::Normal(n) => parts.push(n.to_str().unwrap_or("")),
            Component::ParentDir => {
                parts.pop();
            }
            _ => {}
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

fn rel(abs: &str) -> PathBuf {
    let p = abs.trim_start_matches('/');
    if p.is_empty() {
        ".".into()
    } else {
        p.into()
    }
}

fn split(abs: &str) -> Result<(String, String)> {
    let (parent, name) = abs.rsplit_once('/').unwrap_or(("", abs));
    if name.is_empty() {
        return Err(Error::BadRequest("the sandbox's / itself".into()));
    }
    Ok((
        if parent.is_empty() {
            "/".into()
        } else {
            parent.into()
        },
        name.into(),
    ))
}

/// Entry types as the protocol names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

/// One entry (`filesystem.EntryInfo` in proto3 JSON).
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// int64: a string in proto3 JSON.
    pub size: String,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    pub is_symlink: bool,
    /// Its `user.e2b.*` extended attributes (the upload's `X-Metadata-*`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(skip)]
    pub file_kind: Kind,
}

/// The prefix of the extended attributes that hold a file's metadata.
pub const METADATA_XATTR: &str = "user.e2b.";

/// The `user.e2b.*` attributes of what `fd` (an `O_PATH` descriptor, not of a symlink)
/// names, read through `/proc/self/fd/N` (an `O_PATH` descriptor takes no `f*xattr`).
fn metadata_of(fd: &OwnedFd) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let mut list = vec![0u8; 16 << 10];
    let Ok(n) = rustix::fs::listxattr(&path, &mut list[..]) else {
        return out;
    };
    for name in list[..n.min(list.len())].split(|b| *b == 0) {
        let Some(key) = name.strip_prefix(METADATA_XATTR.as_bytes()) else {
            continue;
        };
        let mut value = vec![0u8; 8 << 10];
        if let Ok(m) = rustix::fs::getxattr(&path, name, &mut value[..]) {
            out.insert(
                String::from_utf8_lossy(key).into_owned(),
                String::from_utf8_lossy(&value[..m.min(value.len())]).into_owned(),
            );
        }
    }
    out
}

/// Store `metadata` on `file` as `user.e2b.<key>` attributes.
pub fn set_metadata(file: &impl AsFd, metadata: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in metadata {
        rustix::fs::fsetxattr(
            file,
            format!("{METADATA_XATTR}{k}"),
            v.as_bytes(),
            rustix::fs::XattrFlags::empty(),
        )
        .map_err(sys(format!("set the metadata {k:?}")))?;
    }
    Ok(())
}

fn kind_of(mode: u32) -> Kind {
    match FileType::from_raw_mode(mode) {
        FileType::RegularFile => Kind::File,
        FileType::Directory => Kind::Dir,
        FileType::Symlink => Kind::Symlink,
        _ => Kind::Other,
    }
}

fn proto_type(k: Kind) -> &'static str {
    match k {
        Kind::File => "FILE_TYPE_FILE",
        Kind::Dir => "FILE_TYPE_DIRECTORY",
        Kind::Symlink => "FILE_TYPE_SYMLINK",
        Kind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// `ls -l`'s mode string, as Go's `FileMode.String` writes it (`drwxr-xr-x`, `Lrwxrwxrwx`).
fn permissions(mode: u32) -> String {
    let t = match kind_of(mode) {
        Kind::Dir => 'd',
        Kind::Symlink => 'L',
        Kind::File => '-',
        Kind::Other => '?',
    };
    let mut s = String::from(t);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// Names of uids and gids, from the sandbox's `/etc/passwd` and `/etc/group`.
#[derive(Debug, Default)]
pub struct Names {
    users: Vec<(u32, String, u32, String)>,
    groups: Vec<(u32, String)>,
}

impl Names {
    pub fn user(&self, uid: u32) -> String {
        self.users
            .iter()
            .find(|u| u.0 == uid)
            .map_or_else(|| uid.to_string(), |u| u.1.clone())
    }

    pub fn group(&self, gid: u32) -> String {
        self.groups
            .iter()
            .find(|g| g.0 == gid)
            .map_or_else(|| gid.to_string(), |g| g.1.clone())
    }

    /// The user called `name` (or a numeric uid).
    pub fn lookup(&self, name: &str) -> Result<User> {
        if name == "root" {
            return Ok(User::root());
        }
        if let Some(u) = self.users.iter().find(|u| u.1 == name) {
            return Ok(User {
                name: u.1.clone(),
                uid: u.0,
                gid: u.2,
                home: u.3.clone(),
            });
        }
        Err(Error::Unauthenticated(format!(
            "invalid user: no user {name:?} in the sandbox"
        )))
    }
}

impl Root {
    pub fn open(view: &Path) -> Result<Root> {
        let fd = rustix::fs::open(
            view,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(sys("open the sandbox's root"))?;
        Ok(Root { fd })
    }

    fn open_at(&self, abs: &str, flags: OFlags, mode: Mode) -> Result<OwnedFd> {
        rustix::fs::openat2(&self.fd, rel(abs), flags | OFlags::CLOEXEC, mode, RESOLVE)
            .map_err(sys(abs.to_owned()))
    }

    /// A small file's bytes (at most `max`), or empty if it is missing.
    fn small(&self, abs: &str, max: u64) -> Vec<u8> {
        use std::io::Read;
        let Ok(fd) = self.open_at(abs, OFlags::RDONLY, Mode::empty()) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let _ = File::from(fd).take(max).read_to_end(&mut out);
        out
    }

    pub fn names(&self) -> Names {
        let mut n = Names::default();
        for line in String::from_utf8_lossy(&self.small("/etc/passwd", 4 << 20)).lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() >= 6 {
                if let (Ok(uid), Ok(gid)) = (f[2].parse(), f[3].parse()) {
                    n.users.push((uid, f[0].to_owned(), gid, f[5].to_owned()));
                }
            }
        }
        for line in String::from_utf8_lossy(&self.small("/etc/group", 4 << 20)).lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() >= 3 {
                if let Ok(gid) = f[2].parse() {
                    n.groups.push((gid, f[0].to_owned()));
                }
            }
        }
        n
    }

    fn info_from(
        &self,
        abs: &str,
        st: &rustix::fs::Stat,
        target: Option<(String, Option<rustix::fs::Stat>)>,
        names: &Names,
        metadata: BTreeMap<String, String>,
    ) -> EntryInfo {
        let own_kind = kind_of(st.st_mode);
        let (shown, is_symlink, symlink_target) = match (&target, own_kind) {
            (Some((t, Some(tst))), Kind::Symlink) => (tst, true, Some(t.clone())),
            (Some((t, None)), Kind::Symlink) => (st, true, Some(t.clone())),
            _ => (st, false, None),
        };
        let kind = kind_of(shown.st_mode);
        let name = abs.rsplit('/').next().unwrap_or("").to_owned();
        EntryInfo {
            name: if name.is_empty() { "/".into() } else { name },
            kind: proto_type(if kind == Kind::Symlink {
                Kind::Symlink
            } else {
                kind
            }),
            path: abs.to_owned(),
            size: shown.st_size.max(0).to_string(),
            mode: st.st_mode & 0o7777,
            permissions: permissions(st.st_mode),
            owner: names.user(st.st_uid),
            group: names.group(st.st_gid),
            modified_time: crate::time::rfc3339_ns(st.st_mtime, st.st_mtime_nsec as u32),
            symlink_target,
            is_symlink,
            metadata,
            file_kind: kind,
        }
    }

    /// The entry at `abs` (a symlink: the link, with its target's type and size).
    pub fn stat(&self, abs: &str, names: &Names) -> Result<EntryInfo> {
        let fd = self.open_at(abs, OFlags::PATH | OFlags::NOFOLLOW, Mode::empty())?;
        let st = rustix::fs::fstat(&fd).map_err(sys(abs.to_owned()))?;
        let is_link = kind_of(st.st_mode) == Kind::Symlink;
        let metadata = if is_link {
            BTreeMap::new()
        } else {
            metadata_of(&fd)
        };
        let target = if is_link {
            let t = rustix::fs::readlinkat(&fd, "", Vec::new())
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            let tst = self
                .open_at(abs, OFlags::PATH, Mode::empty())
                .ok()
                .and_then(|f| rustix::fs::fstat(&f).ok());
            Some((t, tst))
        } else {
            None
        };
        Ok(self.info_from(abs, &st, target, names, metadata))
    }

    /// The entries of directory `abs`, `depth` levels down (1: its own entries).
    pub fn list(&self, abs: &str, depth: u32, names: &Names) -> Result<Vec<EntryInfo>> {
        let info = self.stat(abs, names)?;
        if info.file_kind != Kind::Dir {
            return Err(Error::BadRequest(format!("{abs} is not a directory")));
        }
        let mut out = Vec::new();
        let mut todo = vec![(abs.to_owned(), 1u32)];
        while let Some((dir, level)) = todo.pop() {
            let fd = self.open_at(&dir, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())?;
            let mut entries = Vec::new();
            for e in rustix::fs::Dir::read_from(&fd).map_err(sys(dir.clone()))? {
                let e = e.map_err(sys(dir.clone()))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if name == "." || name == ".." {
                    continue;
                }
                entries.push(name);
            }
            entries.sort();
            for name in entries {
                if out.len() >= MAX_LIST {
                    return Err(Error::Limit(format!(
                        "{abs} has more than {MAX_LIST} entries to list"
                    )));
                }
                let child = if dir == "/" {
                    format!("/{name}")
                } else {
                    format!("{dir}/{name}")
                };
                let Ok(e) = self.stat(&child, names) else {
                    continue;
                };
                if e.file_kind == Kind::Dir && !e.is_symlink && level < depth {
                    todo.push((child, level + 1));
                }
                out.push(e);
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// Make directory `abs` and its missing parents, owned by `user`; `AlreadyExists` if it
    /// was there.
    pub fn make_dir(&self, abs: &str, user: &User) -> Result<bool> {
        let mut created = false;
        let mut prefix = String::new();
        let parts: Vec<&str> = abs.split('/').filter(|p| !p.is_empty()).collect();
        for part in &parts {
            let parent = if prefix.is_empty() {
                "/".to_owned()
            } else {
                prefix.clone()
            };
            prefix = format!("{prefix}/{part}");
            match self.open_at(&prefix, OFlags::PATH, Mode::empty()) {
                Ok(fd) => {
                    let st = rustix::fs::fstat(&fd).map_err(sys(prefix.clone()))?;
                    if kind_of(st.st_mode) != Kind::Dir {
                        return Err(Error::io(
                            prefix.clone(),
                            std::io::Error::from_raw_os_error(libc::ENOTDIR),
                        ));
                    }
                    created = false;
                }
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    let pfd =
                        self.open_at(&parent, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
                    match rustix::fs::mkdirat(&pfd, *part, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(Error::io(prefix.clone(), e.into())),
                    }
                    if user.uid != 0 || user.gid != 0 {
                        let _ = rustix::fs::chownat(
                            &pfd,
                            *part,
                            Some(rustix::fs::Uid::from_raw(user.uid)),
                            Some(rustix::fs::Gid::from_raw(user.gid)),
                            AtFlags::SYMLINK_NOFOLLOW,
                        );
                    }
                    created = true;
                }
                Err(e) => return Err(e),
            }
        }
        if !created {
            return Err(Error::io(
                abs.to_owned(),
                std::io::Error::from_raw_os_error(libc::EEXIST),
            ));
        }
        Ok(true)
    }

    fn ensure_parent(&self, abs: &str, user: &User) -> Result<(OwnedFd, String)> {
        let (parent, name) = split(abs)?;
        match self.make_dir(&parent, user) {
            Ok(_) => {}
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => {
            }
            Err(e) => return Err(e),
        }
        let pfd = self.open_at(&parent, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
        Ok((pfd, name))
    }

    /// Open `abs` for writing (created or truncated, parents made), owned by `user`.
    pub fn create_file(&self, abs: &str, user: &User) -> Result<File> {
        self.ensure_parent(abs, user)?;
        let fd = self.open_at(
            abs,
            OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC,
            Mode::from_raw_mode(0o644),
        )?;
        let st = rustix::fs::fstat(&fd).map_err(sys(abs.to_owned()))?;
        if kind_of(st.st_mode) != Kind::File {
            return Err(Error::BadRequest(format!("{abs} is not a regular file")));
        }
        if user.uid != 0 || user.gid != 0 {
            let _ = rustix::fs::fchown(
                &fd,
                Some(rustix::fs::Uid::from_raw(user.uid)),
                Some(rustix::fs::Gid::from_raw(user.gid)),
            );
        }
        Ok(File::from(fd))
    }

    /// Open `abs` for reading: a regular file.
    pub fn open_file(&self, abs: &str) -> Result<(File, u64)> {
        let fd = self.open_at(abs, OFlags::RDONLY, Mode::empty())?;
        let st = rustix::fs::fstat(&fd).map_err(sys(abs.to_owned()))?;
        match kind_of(st.st_mode) {
            Kind::File => Ok((File::from(fd), st.st_size.max(0) as u64)),
            Kind::Dir => Err(Error::BadRequest(format!(
                "path '{abs}' is a directory, not a file"
            ))),
            _ => Err(Error::BadRequest(format!("{abs} is not a regular file"))),
        }
    }

    /// Remove `abs`: a file, a symlink (not its target) or a whole tree.
    pub fn remove(&self, abs: &str) -> Result<()> {
        let (parent, name) = split(abs)?;
        let pfd = self.open_at(&parent, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
        let st = rustix::fs::statat(&pfd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(sys(abs.to_owned()))?;
        if kind_of(st.st_mode) == Kind::Dir {
            let dfd = rustix::fs::openat(
                &pfd,
                name.as_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(sys(abs.to_owned()))?;
            remove_tree(&dfd, abs, 0)?;
            rustix::fs::unlinkat(&pfd, name.as_str(), AtFlags::REMOVEDIR)
                .map_err(sys(abs.to_owned()))
        } else {
            rustix::fs::unlinkat(&pfd, name.as_str(), AtFlags::empty()).map_err(sys(abs.to_owned()))
        }
    }

    /// Rename `from` to `to` (the destination's parents made).
    pub fn rename(&self, from: &str, to: &str, user: &User) -> Result<()> {
        let (fparent, fname) = split(from)?;
        let ffd = self.open_at(&fparent, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())?;
        rustix::fs::statat(&ffd, fname.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(sys(from.to_owned()))?;
        let (tfd, tname) = self.ensure_parent(to, user)?;
        rustix::fs::renameat(&ffd, fname.as_str(), &tfd, tname.as_str())
            .map_err(sys(format!("rename {from} to {to}")))
    }

    /// A directory of the sandbox as a descriptor (for inotify), confined.
    pub fn open_dir(&self, abs: &str) -> Result<OwnedFd> {
        let fd = self.open_at(abs, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty());
        match fd {
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOTDIR) => {
                Err(Error::BadRequest(format!("{abs} is not a directory")))
            }
            r => r,
        }
    }
}

/// Remove everything inside directory `dir` (descriptors only, never following a link).
fn remove_tree(dir: &impl AsFd, path: &str, depth: u32) -> Result<()> {
    if depth > 256 {
        return Err(Error::Limit(format!("{path}: too deep to remove")));
    }
    let mut names = Vec::new();
    for e in rustix::fs::Dir::read_from(dir).map_err(sys(path.to_owned()))? {
        let e = e.map_err(sys(path.to_owned()))?;
        let n = e.file_name().to_owned();
        if n.as_bytes() != b"." && n.as_bytes() != b".." {
            names.push((n, e.file_type()));
        }
    }
    for (n, t) in names {
        let child = format!("{path}/{}", n.to_string_lossy());
        let is_dir = match t {
            FileType::Directory => true,
            FileType::Unknown => rustix::fs::statat(dir, n.as_c_str(), AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|s| kind_of(s.st_mode) == Kind::Dir),
            _ => false,
        };
        if is_dir {
            let sub = rustix::fs::openat(
                dir,
                n.as_c_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(sys(child.clone()))?;
            remove_tree(&sub, &child, depth + 1)?;
            rustix::fs::unlinkat(dir, n.as_c_str(), AtFlags::REMOVEDIR).map_err(sys(child))?;
        } else {
            rustix::fs::unlinkat(dir, n.as_c_str(), AtFlags::empty()).map_err(sys(child))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_cleaned_and_relative_ones_are_under_home() {
        assert_eq!(absolute("a/b", "/root").unwrap(), "/root/a/b");
        assert_eq!(absolute("/a/../../b/./c", "/root").unwrap(), "/b/c");
        assert_eq!(absolute("~/x", "/home/u").unwrap(), "/home/u/x");
        assert_eq!(absolute("/", "/root").unwrap(), "/");
        assert!(absolute("a\0b", "/").is_err());
    }

    #[test]
    fn operations_stay_in_the_root() {
        let d = tempfile::tempdir().unwrap();
        let root_dir = d.path().join("root");
        std::fs::create_dir_all(root_dir.join("etc")).unwrap();
        std::fs::write(root_dir.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("secret"), "host").unwrap();
        std::os::unix::fs::symlink(&outside, root_dir.join("escape")).unwrap();
        let root = Root::open(&root_dir).unwrap();
        let names = root.names();
        let u = User::root();
        // Through the planted absolute symlink: the sandbox's /<outside path>, not the host's.
        assert!(root.open_file("/escape/secret").is_err());
        root.make_dir("/a/b/c", &u).unwrap();
        assert!(root.make_dir("/a/b", &u).is_err());
        {
            use std::io::Write;
            let mut f = root.create_file("/a/b/f.txt", &u).unwrap();
            f.write_all(b"hello").unwrap();
        }
        let e = root.stat("/a/b/f.txt", &names).unwrap();
        assert_eq!(
            (e.kind, e.size.as_str(), e.owner.as_str()),
            ("FILE_TYPE_FILE", "5", "root")
        );
        let l = root.list("/a", 2, &names).unwrap();
        let paths: Vec<&str> = l.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["/a/b", "/a/b/c", "/a/b/f.txt"]);
        assert_eq!(root.list("/a", 1, &names).unwrap().len(), 1);
        root.rename("/a/b/f.txt", "/x/y/g.txt", &u).unwrap();
        assert!(root_dir.join("x/y/g.txt").is_file());
        let link = root.stat("/escape", &names).unwrap();
        assert!(link.is_symlink);
        // Removing the symlink removes the link, never the host tree behind it.
        root.remove("/escape").unwrap();
        assert!(outside.join("secret").is_file());
        root.remove("/a").unwrap();
        assert!(!root_dir.join("a").exists());
        assert!(root.remove("/nope").is_err());
    }
}
