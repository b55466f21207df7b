//! `PosixBackend`: objects as files under a root directory on a shared POSIX mount (3FS, NFS,
//! a local disk).
//!
//! # Layout
//! Key `a/b/c` is the file `ROOT/a/b/c`. Temporary files are `.strata-tmp.*` siblings of their
//! target; keys may not contain a `.strata-` segment, so a temporary file is never listed or
//! read as an object.
//!
//! # Invariants
//! - **No escape.** Every path is resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`
//!   relative to the root's directory descriptor, so `..`, absolute paths and symlinks that
//!   point out of the root are refused by the kernel itself, not by string checks alone.
//!   Directories are created one component at a time inside a directory already proven to lie
//!   beneath the root.
//! - **Whole objects only.** A put writes sequentially to a fresh temporary file, `fsync`s it,
//!   renames it over the target (`RENAME_NOREPLACE` for [`PutMode::Create`]) and `fsync`s the
//!   directory. A reader opens either the old inode or the new one: never a torn object. A
//!   failed put removes its temporary file.
//! - **Large positional reads.** A ranged read opens the file once and `pread`s the whole range
//!   into one buffer; a concurrent replacement cannot mix versions because the open descriptor
//!   pins the inode.
//! - **No cached copy of ranged reads** (unless [`PosixBackend::keep_read_pages`]). After a
//!   ranged read the range's pages are dropped (`fadvise(DONTNEED)`): ranged reads come from
//!   the chunk cache, which keeps the bytes itself (memory, its level-2 files, the kernel's
//!   cache of the lazy mount above), so a copy in this file's page cache would only double the
//!   node's memory per byte read (measured: cold reads through a lazy mount over a local store
//!   grew the page cache by 2.1 bytes per byte read; 1.04–1.13 with this). Kernel readahead past the range is left alone: a
//!   sequential reader's next range finds it (and drops it); turning it off
//!   (`fadvise(RANDOM)`) saved 0.03 bytes per byte read and cost a fifth of the cold
//!   throughput (`bench/README.md`, `lazy_read`).

use std::fmt;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, ResolveFlags};
use rustix::io::Errno;

use super::{clamp_range, validate_key, validate_prefix, Backend, ByteStream, ObjectMeta, PutMode};
use crate::error::{Error, Result};

/// A backend rooted at a directory.
#[derive(Clone)]
pub struct PosixBackend {
    inner: Arc<Inner>,
    /// Drop the pages of each ranged read (module docs); on unless turned off.
    drop_read_pages: bool,
}

struct Inner {
    root: PathBuf,
    root_fd: OwnedFd,
}

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_MAGICLINKS);
const TMP_PREFIX: &str = ".strata-tmp.";

impl fmt::Debug for PosixBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PosixBackend")
            .field("root", &self.inner.root)
            .finish()
    }
}

impl fmt::Display for PosixBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file://{}", self.inner.root.display())
    }
}

impl PosixBackend {
    /// Open (creating if needed) the directory `root` as a backend.
    pub fn open(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref();
        std::fs::create_dir_all(root).map_err(|e| Error::io("create store directory", root, e))?;
        let root = root
            .canonicalize()
            .map_err(|e| Error::io("resolve store directory", root, e))?;
        let root_fd = rustix::fs::open(
            &root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Error::io("open store directory", &root, e.into()))?;
        Ok(Self {
            inner: Arc::new(Inner { root, root_fd }),
            drop_read_pages: true,
        })
    }

    /// Keep (`true`) or drop (`false`, the default) the page-cache pages of ranged reads (see
    /// the module docs). Keeping them suits a caller without a cache of its own that reads the
    /// same ranges again (the `backend_read` bench measures page-cache reads this way).
    pub fn keep_read_pages(mut self, keep: bool) -> Self {
        self.drop_read_pages = !keep;
        self
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| {
                Error::io(
                    "run blocking I/O for",
                    self.root(),
                    std::io::Error::other(e),
                )
            })?
    }
}

impl Inner {
    fn display(&self) -> String {
        format!("file://{}", self.root.display())
    }

    /// Map an errno from resolving `key` to the crate's error.
    fn err(&self, op: &'static str, key: &str, e: Errno) -> Error {
        match e {
            Errno::NOENT | Errno::NOTDIR => Error::NotFound {
                backend: self.display(),
                key: key.to_owned(),
            },
            Errno::XDEV | Errno::LOOP => Error::InvalidKey {
                key: key.to_owned(),
                reason: "resolves outside the store root (symlink)",
            },
            other => Error::io(op, self.root.join(key), other.into()),
        }
    }

    fn open_beneath(&self, path: &str, flags: OFlags) -> std::result::Result<OwnedFd, Errno> {
        if path.is_empty() {
            return rustix::fs::openat(&self.root_fd, ".", flags | OFlags::CLOEXEC, Mode::empty());
        }
        loop {
            match rustix::fs::openat2(
                &self.root_fd,
                path,
                flags | OFlags::CLOEXEC,
                Mode::empty(),
                RESOLVE,
            ) {
                // openat2 returns EAGAIN when a concurrent rename raced the lookup.
                Err(Errno::AGAIN) | Err(Errno::INTR) => continue,
                other => return other,
            }
        }
    }

    /// A ranged read on this thread (module docs, "Large positional reads").
    fn read_range(&self, key: &str, range: Range<u64>, drop_pages: bool) -> Result<Bytes> {
        let (file, st) = self.open_object(key)?;
        let size = st.st_size as u64;
        let r = clamp_range(&self.display(), key, range, size)?;
        let len = usize::try_from(r.end - r.start).map_err(|_| {
            Error::io(
                "read",
                self.root.join(key),
                std::io::Error::other("range too large"),
            )
        })?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        // Read into uninitialised capacity: zeroing a fresh multi-megabyte buffer first
        // costs more than the read itself when the data is in the page cache.
        let mut buf = Vec::with_capacity(len);
        while buf.len() < len {
            let at = r.start + buf.len() as u64;
            match rustix::io::pread(&file, rustix::buffer::spare_capacity(&mut buf), at) {
                Ok(0) => {
                    return Err(Error::io(
                        "read",
                        self.root.join(key),
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!("object ended at {at}, expected {} bytes", r.end),
                        ),
                    ))
                }
                Ok(_) => {}
                Err(Errno::INTR) => {}
                Err(e) => return Err(Error::io("read", self.root.join(key), e.into())),
            }
        }
        buf.truncate(len);
        if drop_pages {
            let _ = rustix::fs::fadvise(
                &file,
                r.start,
                std::num::NonZeroU64::new(len as u64),
                rustix::fs::Advice::DontNeed,
            );
        }
        Ok(Bytes::from(buf))
    }

    /// Open the regular file `key` for reading.
    fn open_object(&self, key: &str) -> Result<(File, rustix::fs::Stat)> {
        let fd = self
            .open_beneath(key, OFlags::RDONLY)
            .map_err(|e| self.err("open", key, e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| self.err("stat", key, e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(Error::NotFound {
                backend: self.display(),
                key: key.to_owned(),
            });
        }
        Ok((File::from(fd), st))
    }

    fn meta(key: &str, st: &rustix::fs::Stat) -> ObjectMeta {
        let mtime = UNIX_EPOCH
            + Duration::new(
                u64::try_from(st.st_mtime).unwrap_or(0),
                u32::try_from(st.st_mtime_nsec).unwrap_or(0),
            );
        ObjectMeta {
            key: key.to_owned(),
            size: st.st_size as u64,
            etag: Some(format!(
                "{:x}-{:x}-{:x}.{:x}",
                st.st_ino, st.st_size, st.st_mtime, st.st_mtime_nsec
            )),
            last_modified: Some(mtime),
        }
    }

    /// Create the directories of `dir` (a validated key prefix without trailing '/') one at a
    /// time, each inside a directory already resolved beneath the root; return the last one.
    fn make_dirs(&self, key: &str, dir: &str) -> Result<OwnedFd> {
        let mut done = 0usize;
        let parts: Vec<&str> = if dir.is_empty() {
            Vec::new()
        } else {
            dir.split('/').collect()
        };
        for part in &parts {
            let parent_path = &dir[..done.saturating_sub(1)];
            let parent = self
                .open_beneath(parent_path, OFlags::RDONLY | OFlags::DIRECTORY)
                .map_err(|e| self.err("open directory for", key, e))?;
            match rustix::fs::mkdirat(&parent, *part, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(self.err("create directory for", key, e)),
            }
            done += part.len() + 1;
        }
        self.open_beneath(dir, OFlags::RDONLY | OFlags::DIRECTORY)
            .map_err(|e| match e {
                Errno::NOTDIR => Error::InvalidKey {
                    key: key.to_owned(),
                    reason: "a parent of the key is an object, not a directory",
                },
                e => self.err("open directory for", key, e),
            })
    }

    fn list_dir(
        &self,
        dir_fd: &OwnedFd,
        dir_key: &str,
        prefix: &str,
        out: &mut Vec<ObjectMeta>,
    ) -> Result<()> {
        let listing_err = |e: Errno| Error::io("list", self.root.join(dir_key), e.into());
        let entries = rustix::fs::Dir::read_from(dir_fd).map_err(listing_err)?;
        for entry in entries {
            let entry = entry.map_err(listing_err)?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." || name.starts_with(b".strata-") {
                continue;
            }
            let Ok(name) = std::str::from_utf8(name) else {
                continue; // not a key we could have written
            };
            let key = if dir_key.is_empty() {
                name.to_owned()
            } else {
                format!("{dir_key}/{name}")
            };
            let mut file_type = entry.file_type();
            if file_type == FileType::Unknown {
                match rustix::fs::statat(dir_fd, name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => file_type = FileType::from_raw_mode(st.st_mode),
                    Err(Errno::NOENT) => continue,
                    Err(e) => return Err(listing_err(e)),
                }
            }
            match file_type {
                FileType::Directory => {
                    let sub = format!("{key}/");
                    if !(sub.starts_with(prefix) || prefix.starts_with(&sub)) {
                        continue;
                    }
                    let fd = match open_subdir(dir_fd, name) {
                        Ok(fd) => fd,
                        Err(Errno::NOENT) => continue,
                        Err(e) => return Err(listing_err(e)),
                    };
                    self.list_dir(&fd, &key, prefix, out)?;
                }
                FileType::RegularFile if key.starts_with(prefix) && validate_key(&key).is_ok() => {
                    match rustix::fs::statat(dir_fd, name, AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(st) => out.push(Self::meta(&key, &st)),
                        Err(Errno::NOENT) => continue, // deleted while listing
                        Err(e) => return Err(listing_err(e)),
                    }
                }
                // Symlinks, devices, sockets: not objects.
                _ => {}
            }
        }
        Ok(())
    }
}

impl Inner {
    /// Remove (unless `dry_run`) the temporary files under `dir_fd` (key `dir_key`) last
    /// written before `before`: puts whose process died before it could remove them. A put
    /// in progress writes its file as it goes, so its mtime stays recent.
    fn sweep_dir(
        &self,
        dir_fd: &OwnedFd,
        dir_key: &str,
        before: SystemTime,
        dry_run: bool,
        out: &mut Vec<String>,
    ) -> Result<()> {
        let sweep_err = |e: Errno| Error::io("sweep", self.root.join(dir_key), e.into());
        let entries = rustix::fs::Dir::read_from(dir_fd).map_err(sweep_err)?;
        let mut removed = false;
        for entry in entries {
            let entry = entry.map_err(sweep_err)?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let Ok(name) = std::str::from_utf8(name) else {
                continue; // not a name we could have written
            };
            let st = match rustix::fs::statat(dir_fd, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(sweep_err(e)),
            };
            let key = if dir_key.is_empty() {
                name.to_owned()
            } else {
                format!("{dir_key}/{name}")
            };
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory if !name.starts_with(".strata-") => {
                    let fd = match open_subdir(dir_fd, name) {
                        Ok(fd) => fd,
                        Err(Errno::NOENT) => continue,
                        Err(e) => return Err(sweep_err(e)),
                    };
                    self.sweep_dir(&fd, &key, before, dry_run, out)?;
                }
                FileType::RegularFile if name.starts_with(TMP_PREFIX) => {
                    let meta = Self::meta(&key, &st);
                    if meta.last_modified.is_none_or(|written| written >= before) {
                        continue;
                    }
                    if !dry_run {
                        match rustix::fs::unlinkat(dir_fd, name, AtFlags::empty()) {
                            Ok(()) => removed = true,
                            Err(Errno::NOENT) => continue,
                            Err(e) => return Err(sweep_err(e)),
                        }
                    }
                    out.push(format!("temporary file {key} ({} bytes)", meta.size));
                }
                _ => {}
            }
        }
        if removed {
            rustix::fs::fsync(dir_fd.as_fd()).map_err(sweep_err)?;
        }
        Ok(())
    }
}

/// Directory `name` in `dir_fd`, not following a symlink.
fn open_subdir(dir_fd: &OwnedFd, name: &str) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir_fd,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn split_key(key: &str) -> (&str, &str) {
    match key.rsplit_once('/') {
        Some((dir, name)) => (dir, name),
        None => ("", key),
    }
}

/// Removes a temporary file unless disarmed.
struct TmpGuard<'a> {
    dir: &'a OwnedFd,
    name: String,
    armed: bool,
}

impl Drop for TmpGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = rustix::fs::unlinkat(self.dir, self.name.as_str(), AtFlags::empty());
        }
    }
}

#[async_trait]
impl Backend for PosixBackend {
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        validate_key(key)?;
        let key = key.to_owned();
        let drop_pages = self.drop_read_pages;
        self.blocking(move |inner| inner.read_range(&key, range, drop_pages))
            .await
    }

    fn get_range_now(&self, key: &str, range: Range<u64>) -> Option<Result<Bytes>> {
        Some(
            validate_key(key)
                .and_then(|()| self.inner.read_range(key, range, self.drop_read_pages)),
        )
    }

    async fn put_stream(
        &self,
        key: &str,
        mut body: ByteStream,
        mode: PutMode,
    ) -> Result<ObjectMeta> {
        validate_key(key)?;
        // The writer runs on a blocking thread and receives buffers through a small channel, so
        // reading the body (network, another file) overlaps with writing it.
        // `Some(buf)` carries data, `None` marks the clean end of the body: a channel that closes
        // without it means the body failed, and the temporary file is discarded, never renamed.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<Bytes>>(2);
        let owned_key = key.to_owned();
        let writer = self.blocking(move |inner| {
            let key = owned_key.as_str();
            let (dir, name) = split_key(key);
            let dir_fd = inner.make_dirs(key, dir)?;
            let tmp_name = format!(
                "{TMP_PREFIX}{}.{}.{:016x}",
                name,
                std::process::id(),
                fastrand::u64(..)
            );
            let fd = rustix::fs::openat(
                &dir_fd,
                tmp_name.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )
            .map_err(|e| inner.err("create temporary file for", key, e))?;
            let mut guard = TmpGuard {
                dir: &dir_fd,
                name: tmp_name,
                armed: true,
            };
            let tmp_path = inner.root.join(dir).join(&guard.name);
            let mut file = File::from(fd);
            loop {
                match rx.blocking_recv() {
                    Some(Some(buf)) => file
                        .write_all(&buf)
                        .map_err(|e| Error::io("write", &tmp_path, e))?,
                    Some(None) => break,
                    None => {
                        return Err(Error::io(
                            "write",
                            &tmp_path,
                            std::io::Error::other("put body ended with an error"),
                        ))
                    }
                }
            }
            file.sync_all()
                .map_err(|e| Error::io("fsync", &tmp_path, e))?;
            let st = rustix::fs::fstat(&file).map_err(|e| inner.err("stat", key, e))?;
            let flags = match mode {
                PutMode::Overwrite => RenameFlags::empty(),
                PutMode::Create => RenameFlags::NOREPLACE,
            };
            match rustix::fs::renameat_with(&dir_fd, guard.name.as_str(), &dir_fd, name, flags) {
                Ok(()) => guard.armed = false,
                Err(Errno::EXIST) => {
                    return Err(Error::AlreadyExists {
                        backend: inner.display(),
                        key: key.to_owned(),
                    })
                }
                Err(e) => return Err(inner.err("rename into place", key, e)),
            }
            rustix::fs::fsync(&dir_fd).map_err(|e| inner.err("fsync directory of", key, e))?;
            Ok(Inner::meta(key, &st))
        });
        let feeder = async move {
            while let Some(buf) = body.next().await {
                let buf = buf.map_err(|e| Error::io("read put body for", "stream", e))?;
                if tx.send(Some(buf)).await.is_err() {
                    return Ok(()); // the writer failed; its error is reported below
                }
            }
            let _ = tx.send(None).await;
            Ok::<(), Error>(())
        };
        let (fed, written) = futures::join!(feeder, writer);
        // A body error wins: the writer saw no end marker and discarded its temporary file.
        fed.and(written)
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        let key = key.to_owned();
        self.blocking(move |inner| {
            let (_, st) = inner.open_object(&key)?;
            Ok(Inner::meta(&key, &st))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        validate_prefix(prefix)?;
        let prefix = prefix.to_owned();
        self.blocking(move |inner| {
            let start = match prefix.rfind('/') {
                Some(i) => &prefix[..i],
                None => "",
            };
            let fd = match inner.open_beneath(start, OFlags::RDONLY | OFlags::DIRECTORY) {
                Ok(fd) => fd,
                Err(Errno::NOENT | Errno::NOTDIR) => return Ok(Vec::new()),
                Err(e) => return Err(inner.err("list", &prefix, e)),
            };
            let mut out = Vec::new();
            inner.list_dir(&fd, start, &prefix, &mut out)?;
            out.sort_by(|a, b| a.key.cmp(&b.key));
            Ok(out)
        })
        .await
    }

    /// Temporary files of puts whose process died (module docs), found by a walk of the
    /// whole root.
    async fn sweep_abandoned(&self, before: SystemTime, dry_run: bool) -> Result<Vec<String>> {
        self.blocking(move |inner| {
            let mut out = Vec::new();
            inner.sweep_dir(&inner.root_fd, "", before, dry_run, &mut out)?;
            out.sort();
            Ok(out)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let key = key.to_owned();
        self.blocking(move |inner| {
            let (dir, name) = split_key(&key);
            let dir_fd = match inner.open_beneath(dir, OFlags::RDONLY | OFlags::DIRECTORY) {
                Ok(fd) => fd,
                Err(Errno::NOENT | Errno::NOTDIR) => return Ok(()),
                Err(e) => return Err(inner.err("delete", &key, e)),
            };
            match rustix::fs::unlinkat(&dir_fd, name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(Errno::ISDIR) => {
                    return Err(Error::NotFound {
                        backend: inner.display(),
                        key: key.clone(),
                    })
                }
                Err(e) => return Err(inner.err("delete", &key, e)),
            }
            rustix::fs::fsync(dir_fd.as_fd()).map_err(|e| inner.err("fsync directory of", &key, e))
        })
        .await
    }
}

/// Stamp an object's modification time (used by tests of time-based policies such as gc).
pub fn set_mtime(backend: &PosixBackend, key: &str, when: SystemTime) -> Result<()> {
    validate_key(key)?;
    let path = backend.root().join(key);
    let file = File::options()
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("open", &path, e))?;
    file.set_modified(when)
        .map_err(|e| Error::io("set mtime of", &path, e))
}
