//! The FUSE request handlers of a blob mount (run on the session's worker threads).
//!
//! Every handler does a table lookup and, for reads, one [`ChunkCache::read`] driven to
//! completion on the calling FUSE thread with [`tokio::runtime::Handle::block_on`]: a chunk in
//! memory is served without a thread hand-off, and the cache's own tasks (fetches, level-2
//! reads that would block) run on the runtime. The runtime's worker threads never wait on FUSE.

use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fs_cache::chunk::ChunkCache;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};
use tokio::runtime::Handle;

use super::table::{Backing, Entry, Table};
use crate::fusemount;

/// How long the kernel may cache blob entries and attributes: blobs are immutable, and a
/// removal invalidates the entry explicitly.
const BLOB_TTL: Duration = Duration::from_secs(3600);
/// The root directory changes as blobs come and go.
const ROOT_TTL: Duration = Duration::from_secs(1);

/// Settings the handlers need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options {
    pub(crate) max_read: u32,
    pub(crate) direct_io: bool,
    pub(crate) passthrough: bool,
}

/// What the kernel agreed to at INIT (read by [`super::BlobFs`]).
#[derive(Debug, Default)]
pub(crate) struct Negotiated {
    pub(crate) passthrough: AtomicBool,
}

/// Per-mount counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) reads: AtomicU64,
    pub(crate) read_bytes: AtomicU64,
    pub(crate) read_errors: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) max_in_flight: AtomicU64,
}

/// The filesystem: a root directory of blob files.
pub(crate) struct BlobFsImpl {
    pub(crate) table: Arc<Table>,
    pub(crate) cache: Arc<ChunkCache>,
    pub(crate) rt: Handle,
    pub(crate) opts: Options,
    pub(crate) negotiated: Arc<Negotiated>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) started: SystemTime,
}

impl BlobFsImpl {
    fn root_attr(&self) -> FileAttr {
        FileAttr {
            ino: INodeNo::ROOT,
            size: 0,
            blocks: 0,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: FileType::Directory,
            perm: 0o555,
            nlink: 2,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn blob_attr(&self, e: &Entry) -> FileAttr {
        FileAttr {
            ino: INodeNo(e.ino),
            size: e.size,
            blocks: e.size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: FileType::RegularFile,
            perm: 0o444,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            // Tools size their buffers by st_blksize: ask for whole FUSE requests.
            blksize: self.opts.max_read,
            flags: 0,
        }
    }
}

impl BlobFsImpl {
    /// The backing file for a passthrough open of `e`, when its chunks are pinned in level 2:
    /// the one already registered with the kernel, or a new registration of the pinned file.
    fn backing_for(&self, e: &Entry, reply: &ReplyOpen) -> Option<Arc<Backing>> {
        let pin = e.local().clone()?;
        let mut b = e.backing();
        if let Some(backing) = b.as_ref() {
            return Some(backing.clone());
        }
        match reply.open_backing(pin.file()) {
            Ok(id) => {
                let backing = Arc::new(Backing { id, _pin: pin });
                *b = Some(backing.clone());
                Some(backing)
            }
            Err(err) => {
                tracing::warn!(blob = %e.name, error = %err,
                    "FUSE_DEV_IOC_BACKING_OPEN failed; serving through the cache");
                None
            }
        }
    }
}

impl Filesystem for BlobFsImpl {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Readahead only matters without direct_io; take the most the kernel offers.
        if let Err(max) = config.set_max_readahead(u32::MAX) {
            let _ = config.set_max_readahead(max);
        }
        // Many reads in flight at once (EROFS submits its reads asynchronously).
        let _ = config.set_max_background(256);
        let _ = config.set_congestion_threshold(192);
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Direct I/O from an asynchronous reader (EROFS's file-backed reads) stays
        // asynchronous: a large read becomes `max_pages` requests in flight at once instead of
        // one request at a time.
        let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        if self.opts.passthrough && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok() {
            // Depth 1: backing files live on a plain filesystem, and this mount can itself be
            // the lower of one more stacking filesystem.
            if config.set_max_stack_depth(1).is_ok() {
                self.negotiated.passthrough.store(true, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent != INodeNo::ROOT {
            return reply.error(Errno::ENOENT);
        }
        match name.to_str().and_then(|n| self.table.lookup(n)) {
            Some(e) => reply.entry(&BLOB_TTL, &self.blob_attr(&e), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == INodeNo::ROOT {
            return reply.attr(&ROOT_TTL, &self.root_attr());
        }
        match self.table.get(ino.0) {
            Some(e) => reply.attr(&BLOB_TTL, &self.blob_attr(&e)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino == INodeNo::ROOT {
            return reply.error(Errno::EISDIR);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let Some(e) = self.table.open(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if self.negotiated.passthrough.load(Ordering::Relaxed) {
            if let Some(b) = self.backing_for(&e, &reply) {
                return reply.opened_passthrough(FileHandle(e.ino), FopenFlags::empty(), &b.id);
            }
        }
        let mut fl = FopenFlags::FOPEN_KEEP_CACHE;
        if self.opts.direct_io {
            // No second copy of the blob in the page cache: the reader above (EROFS) keeps its
            // own, and the chunk cache keeps its own.
            fl = FopenFlags::FOPEN_DIRECT_IO;
        }
        reply.opened(FileHandle(e.ino), fl);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(e) = self.table.get(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if offset >= e.size || size == 0 {
            return reply.data(&[]);
        }
        let len = u64::from(size.min(self.opts.max_read.max(4096)));
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let now = self.counters.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.counters
            .max_in_flight
            .fetch_max(now, Ordering::Relaxed);
        // A panic below (a runtime shut down under a detached mount) fails this read only.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.rt.block_on(self.cache.read(&e.digest, offset, len))
        }));
        let result = result.unwrap_or_else(|_| {
            Err(fs_cache::Error::Io {
                op: "read",
                path: e.name.clone().into(),
                source: std::io::Error::other("the cache's runtime panicked or is shut down"),
            })
        });
        self.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
        match result {
            Ok(bytes) => {
                self.counters
                    .read_bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                reply.data(&bytes)
            }
            Err(err) => {
                self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(blob = %e.name, offset, len, error = %err, "blob read failed");
                reply.error(Errno::EIO)
            }
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Some(e) = self.table.release(ino.0) {
            // The last handle: let the kernel close the backing file (unless a new open took
            // it meanwhile; the open count is raised before `backing` is locked).
            let mut b = e.backing();
            if e.open.load(Ordering::Acquire) == 0 {
                b.take();
            }
        }
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    /// Offsets: "." is 1, ".." is 2, a blob's offset is its inode number (inodes grow and are
    /// never reused, so a listing resumed after concurrent changes neither repeats nor skips a
    /// blob that stayed listed).
    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        if offset < 1 && reply.add(INodeNo::ROOT, 1, FileType::Directory, ".") {
            return reply.ok();
        }
        if offset < 2 && reply.add(INodeNo::ROOT, 2, FileType::Directory, "..") {
            return reply.ok();
        }
        for e in self.table.listed_after(offset.max(2)) {
            if reply.add(INodeNo(e.ino), e.ino, FileType::RegularFile, &e.name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let (files, bytes) = self.table.totals();
        reply.statfs(bytes.div_ceil(4096), 0, 0, files + 1, 0, 4096, 255, 4096);
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
