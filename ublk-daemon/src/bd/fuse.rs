//! The FUSE image file: a FUSE filesystem mounted **over a regular file**, whose root inode is
//! that file, of the device's size. `losetup FILE`, `mkfs.ext4 FILE`, `e2fsck FILE` and
//! file-backed mounts use it as a disk image.
//!
//! ```text
//! FILE   -rw------- root root  size = device size   (inode 1, the mount's root)
//! ```
//!
//! Why over a file and not a directory with `disk.img` inside: the user names the image path
//! (`strata bd serve DIR --fuse FILE`), there is no directory to list, and the kernel sends no
//! LOOKUP at all. The mount is made with mount(2) (`rootmode=100000`, `/dev/fuse` opened
//! here, no libfuse), `allow_other,default_permissions`, nosuid, nodev.
//!
//! Request mapping (each answered only after the device call returned):
//!
//! | FUSE | device |
//! | --- | --- |
//! | READ | [`Device::read_at`] (clamped at the end of the device) |
//! | WRITE | [`Device::write_at`]; past the end: the part inside, or `ENOSPC` |
//! | FALLOCATE `PUNCH_HOLE`, `ZERO_RANGE` | [`Device::discard`] (reads zeros afterwards) |
//! | FALLOCATE 0 / `KEEP_SIZE` inside the device | nothing (every byte is already backed) |
//! | FSYNC, FLUSH (close) | [`Device::flush`] |
//! | SETATTR size ≠ device size | `EINVAL` (a device does not change size) |
//!
//! The file is opened with `FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES`: the kernel keeps
//! no page cache of it (a loop device above sees the device, never stale pages; an fsync has
//! no dirty pages to write back first), and writes from several threads reach the daemon in
//! parallel. Requests are served by `threads` threads, each with its own cloned `/dev/fuse`
//! descriptor; requests up to `max_io` bytes (the kernel caps them at
//! `fs.fuse.max_pages_limit` pages, 1 MiB by default).

use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    BackgroundSession, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyEmpty, ReplyOpen,
    ReplyStatfs, ReplyWrite, Request, WriteFlags,
};
use overlaybd::Device;

use crate::blobfs::clean_stale_mount;
use crate::fusemount::{self, FuseMount};
use crate::{Error, Result};

/// `fallocate(2)` mode bits (linux/falloc.h).
const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

/// Attributes never change behind the kernel's back (the size is fixed).
const TTL: Duration = Duration::from_secs(3600);

/// How an image-file mount is made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BdFuseConfig {
    /// Threads reading requests from the kernel, 1..=64.
    pub threads: usize,
    /// The largest read or write request, 4 KiB..=16 MiB.
    pub max_io: u32,
    /// `FOPEN_DIRECT_IO` (default on): no page cache for the image file.
    pub direct_io: bool,
}

impl Default for BdFuseConfig {
    /// 4 threads, 1 MiB requests, direct I/O.
    fn default() -> Self {
        Self {
            threads: 4,
            max_io: 1 << 20,
            direct_io: true,
        }
    }
}

impl BdFuseConfig {
    fn check(&self) -> Result<()> {
        if !(1..=64).contains(&self.threads) {
            return Err(Error::InvalidConfig(format!(
                "threads must be 1..=64, got {}",
                self.threads
            )));
        }
        if !(4096..=(16 << 20)).contains(&self.max_io) {
            return Err(Error::InvalidConfig(format!(
                "max_io must be 4096..=16777216, got {}",
                self.max_io
            )));
        }
        Ok(())
    }
}

/// Counters of one image-file mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BdFuseStats {
    pub reads: u64,
    pub writes: u64,
    pub discards: u64,
    pub flushes: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    discards: AtomicU64,
    flushes: AtomicU64,
    errors: AtomicU64,
}

/// A live image-file mount. Unmounted (and the device flushed) by [`BdFuse::unmount`] or
/// when dropped.
pub struct BdFuse {
    path: PathBuf,
    device: Arc<Device>,
    counters: Arc<Counters>,
    session: Option<BackgroundSession>,
}

impl std::fmt::Debug for BdFuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BdFuse")
            .field("path", &self.path)
            .field("size", &self.device.size())
            .finish()
    }
}

/// [`serve_fuse_with`] with the default configuration.
pub fn serve_fuse(device: Arc<Device>, file: &Path) -> Result<BdFuse> {
    serve_fuse_with(device, file, &BdFuseConfig::default())
}

/// Mount `device` over the regular file `file` (created empty if missing; a dead FUSE mount
/// left there by a crashed daemon is detached first). Needs root (mount(2), `/dev/fuse`).
pub fn serve_fuse_with(device: Arc<Device>, file: &Path, cfg: &BdFuseConfig) -> Result<BdFuse> {
    cfg.check()?;
    if clean_stale_mount(file)? {
        tracing::warn!(path = %file.display(), "detached a dead FUSE mount");
    }
    match std::fs::symlink_metadata(file) {
        Ok(md) if md.is_file() => {}
        Ok(_) => {
            return Err(Error::InvalidConfig(format!(
                "{} is not a regular file: the image is mounted over a file",
                file.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(file)
                .map_err(|e| Error::io("create", file, e))?;
        }
        Err(e) => return Err(Error::io("stat", file, e)),
    }
    let path = file
        .canonicalize()
        .map_err(|e| Error::io("canonicalize", file, e))?;
    let counters = Arc::new(Counters::default());
    let fs = ImageFs {
        device: device.clone(),
        counters: counters.clone(),
        max_io: cfg.max_io,
        direct_io: cfg.direct_io,
        started: SystemTime::now(),
    };
    let session = fusemount::start(
        &path,
        cfg.max_io,
        cfg.threads,
        FuseMount {
            name: "strata-bd",
            file_root: true,
            read_only: false,
        },
        fs,
    )?;
    Ok(BdFuse {
        path,
        device,
        counters,
        session: Some(session),
    })
}

impl BdFuse {
    /// The image file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device served.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Counters of this mount.
    pub fn stats(&self) -> BdFuseStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.counters;
        BdFuseStats {
            reads: g(&c.reads),
            writes: g(&c.writes),
            discards: g(&c.discards),
            flushes: g(&c.flushes),
            errors: g(&c.errors),
        }
    }

    /// Unmount, wait for the FUSE threads, and flush the device. If the file is still in use
    /// (a loop device, an open descriptor), it is detached lazily and [`Error::Busy`] returned:
    /// the threads keep serving the remaining users until they let go.
    pub fn unmount(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        // Unmount first: once it succeeds no request can arrive any more, and the flush below
        // covers every write that was acknowledged.
        let unmounted = fusemount::stop(
            &self.path,
            session,
            "still in use (a loop device?); detached lazily",
        );
        let flushed = self.device.flush();
        unmounted?;
        flushed.map_err(Error::from)
    }
}

impl Drop for BdFuse {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(path = %self.path.display(), error = %e, "unmounting image file");
        }
    }
}

/// The filesystem: one regular file, the root inode.
struct ImageFs {
    device: Arc<Device>,
    counters: Arc<Counters>,
    max_io: u32,
    direct_io: bool,
    started: SystemTime,
}

fn errno_of(e: &overlaybd::Error) -> Errno {
    Errno::from_i32(e.errno())
}

impl ImageFs {
    fn attr(&self) -> FileAttr {
        let size = self.device.size();
        FileAttr {
            ino: INodeNo::ROOT,
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: FileType::RegularFile,
            perm: 0o600,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn failed(&self, op: &str, offset: u64, len: u64, e: &overlaybd::Error) -> Errno {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(op, offset, len, error = %e, "image file request failed");
        errno_of(e)
    }

    fn flush_device(&self, reply: ReplyEmpty) {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        match self.device.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.failed("flush", 0, 0, &e)),
        }
    }
}

thread_local! {
    /// The read buffer of each FUSE thread (`Device::read_at` fills every byte it is given).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Filesystem for ImageFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_write(self.max_io) {
            let _ = config.set_max_write(max);
        }
        if let Err(max) = config.set_max_readahead(self.max_io) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(128);
        let _ = config.set_congestion_threshold(96);
        Ok(())
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOENT);
        }
        reply.attr(&TTL, &self.attr());
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOENT);
        }
        // A device has a fixed size; `O_TRUNC`/`truncate` to its own size is accepted.
        // Modes, owners and times are not stored (the attributes stay as they are).
        if size.is_some_and(|s| s != self.device.size()) {
            return reply.error(Errno::EINVAL);
        }
        reply.attr(&TTL, &self.attr());
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOENT);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY && self.device.upper().is_none() {
            return reply.error(Errno::EROFS);
        }
        let fl = if self.direct_io {
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
        } else {
            FopenFlags::FOPEN_KEEP_CACHE
        };
        reply.opened(FileHandle(0), fl);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let dev_size = self.device.size();
        if offset >= dev_size || size == 0 {
            return reply.data(&[]);
        }
        let len = u64::from(size.min(self.max_io)).min(dev_size - offset);
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        // One buffer per FUSE thread, grown to the largest request seen (at most `max_io`).
        READ_BUF.with_borrow_mut(|buf| {
            if buf.len() < len as usize {
                buf.resize(len as usize, 0);
            }
            let buf = &mut buf[..len as usize];
            match self.device.read_at(offset, buf) {
                Ok(()) => reply.data(buf),
                Err(e) => reply.error(self.failed("read", offset, len, &e)),
            }
        })
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let dev_size = self.device.size();
        if data.is_empty() {
            return reply.written(0);
        }
        if offset >= dev_size {
            return reply.error(Errno::ENOSPC);
        }
        let n = (data.len() as u64).min(dev_size - offset) as usize;
        self.counters.writes.fetch_add(1, Ordering::Relaxed);
        match self.device.write_at(offset, &data[..n]) {
            Ok(()) => reply.written(n as u32),
            Err(e) => reply.error(self.failed("write", offset, n as u64, &e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let dev_size = self.device.size();
        let Some(end) = offset.checked_add(length) else {
            return reply.error(Errno::EINVAL);
        };
        if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) != 0 {
            let known = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE;
            if mode & !known != 0 {
                return reply.error(Errno::EOPNOTSUPP);
            }
            // Past the end there is nothing to zero; the device never grows.
            let end = end.min(dev_size);
            if offset >= end {
                return reply.ok();
            }
            self.counters.discards.fetch_add(1, Ordering::Relaxed);
            return match self.device.discard(offset, end - offset) {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(self.failed("discard", offset, end - offset, &e)),
            };
        }
        if mode & !FALLOC_FL_KEEP_SIZE != 0 {
            return reply.error(Errno::EOPNOTSUPP);
        }
        // Plain allocation: every byte inside the device is already backed.
        if end > dev_size {
            return reply.error(Errno::EFBIG);
        }
        reply.ok()
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2): make everything written through this descriptor durable as well.
        self.flush_device(reply);
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.flush_device(reply);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let blocks = self.device.size().div_ceil(4096);
        reply.statfs(blocks, 0, 0, 1, 0, 4096, 255, 4096);
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(Errno::NO_XATTR);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        fusemount::reply_no_xattrs(size, reply);
    }
}
