//! The FUSE request handlers of a blob mount (run on the session's worker threads).
//!
//! Every handler does a table lookup and, for reads, one [`ChunkCache::read`] driven to
//! completion on the calling FUSE thread with [`tokio::runtime::Handle::block_on`]: a chunk in
//! memory is served without a thread hand-off, and the cache's own tasks (fetches, level-2
//! reads that would block) run on the runtime. The runtime's worker threads never wait on FUSE.
//!
//! Nothing here depends on what an earlier daemon did on the same connection: inode numbers
//! and file handles are functions of the blob digest, a RELEASE of a handle this process
//! never opened is harmless, and a READ needs only the table.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fs_cache::chunk::ChunkCache;
use tokio::runtime::Handle;
use zerocopy::IntoBytes;

use super::table::{Backing, Entry, Table};
use crate::fuse::abi::{self, fopen, Attr, AttrOut, Dirent, EntryOut, OpenOut};
use crate::fuse::{Handler, Negotiated, Op, Reply, Request};

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
    pub(crate) negotiated: Negotiated,
    pub(crate) counters: Arc<Counters>,
    pub(crate) started: SystemTime,
}

fn secs(t: SystemTime) -> (u64, u32) {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    (d.as_secs(), d.subsec_nanos())
}

impl BlobFsImpl {
    fn attr(&self, ino: u64, size: u64, mode: u32, nlink: u32, blksize: u32) -> Attr {
        let (t, ns) = secs(self.started);
        Attr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            atimensec: ns,
            mtimensec: ns,
            ctimensec: ns,
            mode,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize,
            flags: 0,
        }
    }

    fn root_attr(&self) -> Attr {
        self.attr(abi::ROOT_ID, 0, abi::S_IFDIR | 0o555, 2, 4096)
    }

    fn blob_attr(&self, e: &Entry) -> Attr {
        // Tools size their buffers by st_blksize: ask for whole FUSE requests.
        self.attr(e.ino, e.size, abi::S_IFREG | 0o444, 1, self.opts.max_read)
    }

    /// The backing file for a passthrough open of `e`, when its chunks are pinned in level 2:
    /// the one already registered with the kernel, or a new registration of the pinned file.
    fn backing_for(&self, e: &Entry, reply: &Reply<'_>) -> Option<Arc<Backing>> {
        let pin = e.local().clone()?;
        let mut b = e.backing();
        if let Some(backing) = b.as_ref() {
            return Some(backing.clone());
        }
        match reply
            .channel()
            .backing_open(std::os::fd::AsFd::as_fd(pin.file()))
        {
            Ok(id) => {
                let backing = Arc::new(Backing {
                    id,
                    channel: Arc::downgrade(reply.channel()),
                    _pin: pin,
                });
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

    fn read(&self, ino: u64, offset: u64, size: u32, reply: Reply<'_>) {
        let Some(e) = self.table.get(ino) else {
            return reply.error(libc::ENOENT);
        };
        if offset >= e.size || size == 0 {
            return reply.ok(&[]);
        }
        let len = u64::from(size.min(self.opts.max_read.max(4096)));
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        let now = self.counters.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.counters
            .max_in_flight
            .fetch_max(now, Ordering::Relaxed);
        // A panic below (a runtime shut down under a detached mount) fails this read only.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.cache.read_blocking(&self.rt, &e.digest, offset, len)
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
            Ok(parts) => {
                let n: usize = parts.iter().map(|p| p.len()).sum();
                self.counters
                    .read_bytes
                    .fetch_add(n as u64, Ordering::Relaxed);
                // One piece per chunk, sent with one writev: no copy joining them (unless
                // there are more pieces than a reply takes).
                if parts.len() > crate::fuse::session::MAX_PAYLOAD_PARTS {
                    return reply.ok(&[&parts.concat()]);
                }
                let iov: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
                reply.ok(&iov)
            }
            Err(err) => {
                self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(blob = %e.name, offset, len, error = %err, "blob read failed");
                reply.error(libc::EIO)
            }
        }
    }

    /// Offsets: "." is 1, ".." is 2, a blob's offset is its inode number (listed in inode
    /// order, so a listing resumed after concurrent changes neither repeats nor skips a blob
    /// that stayed listed).
    fn readdir(&self, offset: u64, size: u32, reply: Reply<'_>) {
        let mut out = Vec::with_capacity(size as usize);
        let mut add = |ino: u64, off: u64, typ: u32, name: &[u8]| -> bool {
            let len = std::mem::size_of::<Dirent>() + name.len();
            let padded = len.next_multiple_of(8);
            if out.len() + padded > size as usize {
                return false;
            }
            let d = Dirent {
                ino,
                off,
                namelen: name.len() as u32,
                typ,
            };
            out.extend_from_slice(d.as_bytes());
            out.extend_from_slice(name);
            out.resize(out.len() + padded - len, 0);
            true
        };
        let mut full = false;
        if offset < 1 {
            full = !add(abi::ROOT_ID, 1, abi::DT_DIR, b".");
        }
        if !full && offset < 2 {
            full = !add(abi::ROOT_ID, 2, abi::DT_DIR, b"..");
        }
        if !full {
            for e in self.table.listed_after(offset.max(2)) {
                if !add(e.ino, e.ino, abi::DT_REG, e.name.as_bytes()) {
                    break;
                }
            }
        }
        reply.ok(&[&out]);
    }

    fn open(&self, ino: u64, flags: u32, reply: Reply<'_>) {
        if ino == abi::ROOT_ID {
            return reply.error(libc::EISDIR);
        }
        if flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 {
            return reply.error(libc::EROFS);
        }
        let Some(e) = self.table.open(ino) else {
            return reply.error(libc::ENOENT);
        };
        if self.negotiated.passthrough() {
            if let Some(b) = self.backing_for(&e, &reply) {
                let out = OpenOut {
                    fh: e.ino,
                    open_flags: fopen::PASSTHROUGH,
                    backing_id: b.id,
                };
                return reply.ok(&[out.as_bytes()]);
            }
        }
        // Without direct I/O the page cache may keep what it read; with it (the default) the
        // kernel keeps no second copy of the blob: the reader above (EROFS) keeps its own,
        // and the chunk cache keeps its own.
        let open_flags = if self.opts.direct_io {
            fopen::DIRECT_IO
        } else {
            fopen::KEEP_CACHE
        };
        let out = OpenOut {
            fh: e.ino,
            open_flags,
            backing_id: 0,
        };
        reply.ok(&[out.as_bytes()]);
    }

    fn release(&self, ino: u64, reply: Reply<'_>) {
        if let Some(e) = self.table.release(ino) {
            // The last handle: let the kernel close the backing file (unless a new open took
            // it meanwhile; the open count is raised before `backing` is locked).
            let mut b = e.backing();
            if e.open.load(Ordering::Acquire) == 0 {
                b.take();
            }
        }
        reply.ok(&[]);
    }
}

fn entry_out(attr: Attr, ttl: Duration) -> EntryOut {
    EntryOut {
        nodeid: attr.ino,
        generation: 0,
        entry_valid: ttl.as_secs(),
        attr_valid: ttl.as_secs(),
        entry_valid_nsec: ttl.subsec_nanos(),
        attr_valid_nsec: ttl.subsec_nanos(),
        attr,
    }
}

fn attr_out(attr: Attr, ttl: Duration) -> AttrOut {
    AttrOut {
        attr_valid: ttl.as_secs(),
        attr_valid_nsec: ttl.subsec_nanos(),
        dummy: 0,
        attr,
    }
}

impl Handler for BlobFsImpl {
    fn handle(&self, req: &Request<'_>, reply: Reply<'_>) {
        let ino = req.header.nodeid;
        match &req.op {
            Op::Lookup { name } => {
                if ino != abi::ROOT_ID {
                    return reply.error(libc::ENOENT);
                }
                match name.to_str().and_then(|n| self.table.lookup(n)) {
                    Some(e) => {
                        let out = entry_out(self.blob_attr(&e), BLOB_TTL);
                        reply.ok(&[out.as_bytes()])
                    }
                    None => reply.error(libc::ENOENT),
                }
            }
            Op::Getattr(_) => {
                if ino == abi::ROOT_ID {
                    let out = attr_out(self.root_attr(), ROOT_TTL);
                    return reply.ok(&[out.as_bytes()]);
                }
                match self.table.get(ino) {
                    Some(e) => reply.ok(&[attr_out(self.blob_attr(&e), BLOB_TTL).as_bytes()]),
                    None => reply.error(libc::ENOENT),
                }
            }
            Op::Open(o) => self.open(ino, o.flags, reply),
            Op::Read(r) => self.read(ino, r.offset, r.size, reply),
            Op::Release(_) => self.release(ino, reply),
            Op::Flush | Op::Releasedir(_) | Op::Access => reply.ok(&[]),
            Op::Opendir(_) => {
                if ino != abi::ROOT_ID {
                    return reply.error(libc::ENOTDIR);
                }
                reply.ok(&[OpenOut::default().as_bytes()])
            }
            Op::Readdir(r) => {
                if ino != abi::ROOT_ID {
                    return reply.error(libc::ENOTDIR);
                }
                self.readdir(r.offset, r.size, reply)
            }
            Op::Statfs => {
                let (files, bytes) = self.table.totals();
                reply.statfs(bytes.div_ceil(4096), files + 1)
            }
            Op::Getxattr { .. } => reply.error(libc::ENODATA),
            Op::Listxattr { size } => reply.no_xattrs(*size),
            _ => reply.error(libc::ENOSYS),
        }
    }
}
