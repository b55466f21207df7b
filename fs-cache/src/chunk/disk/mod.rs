//! Level 2 of the chunk cache: chunks on local disk, bounded in bytes, evicted least recently
//! used first, indexed in RocksDB so that the cache survives a restart.
//!
//! A chunk enters this level only after the cache verified it against its blake3 digest. Every
//! 4 KiB block of it is covered by a crc32c computed from those verified bytes (kept in the
//! index), so that a hit reads and checks just the blocks it needs ([`DiskCache::read_range`])
//! instead of reading and re-hashing the whole chunk. A block whose bytes no longer match is
//! reported as [`RangeRead::Corrupt`]; the caller drops the chunk ([`DiskCache::drop_corrupt`])
//! and refetches it: bad bytes are never served.
//!
//! # On-disk layout
//! ```text
//! <dir>/blobs/<hh>/<blob hex>    one sparse file per blob: chunk i at offset i << shift
//! <dir>/index/                   RocksDB (its own files only)
//! ```
//! `<hh>` is the first two hex digits of the blob digest (256 shard directories, created at
//! open). `shift` is log2 of the blob's chunk size (its chunk table's, 12 ..= 18: 4 KiB ..=
//! 256 KiB; [`ChunkId::shift`]). All indexed chunks of one blob have the same shift (kept per
//! blob in memory; a put of another shift first drops the blob's chunks of the old one, and
//! an open that finds one blob's entries in mixed shifts drops them all). A blob file has the
//! blob's own offsets whatever the shift: where every chunk of a blob is cached, the
//! file *is* the blob, and a reader that may skip the per-block checks (FUSE passthrough) can
//! be handed it ([`DiskCache::pin_blob`]). Ranges of chunks that are not indexed are holes: a
//! chunk's bytes are written in place, and an evicted chunk's range is punched out
//! (`FALLOC_FL_PUNCH_HOLE`). A blob file with no chunk left is unlinked.
//!
//! # Index encoding (RocksDB keys and values)
//! | key | value |
//! | --- | --- |
//! | `b'c'` + blob digest (32 bytes) + chunk index (u64 BE): 41 bytes | shift 18: `[2][size: u32 LE][seq: u64 LE]`, 13 bytes (v2); shifts 12 ..= 17: `[3][size: u32 LE][seq: u64 LE][shift: u8]`, 14 bytes (v3) |
//! | `b's'` + blob digest + chunk index: 41 bytes | crc32c (u32 LE) of each 4 KiB block of the chunk, the last one possibly short: `4 × ceil(size / 4096)` bytes |
//! | `b"m/format"` | `b"strata-chunk-index v3"` (v3: one sparse file per blob); v2 (a file per chunk) is wiped and started afresh, any other value refuses to open |
//! | `b'h'` + blob digest + nonce (u64 BE) + token (an absolute path, ≤ 4096 bytes) | `[1]` + boot id digest (16 bytes) + token device + inode (u64 LE each): 33 bytes; a hold, see `hold.rs` |
//! | `b"m/counters"` | `[1]` + evictions, dropped_corrupt, enospc, recovered_orphans (u64 LE each): 33 bytes |
//!
//! `size` is the chunk's length (at most `1 << shift`); `seq` its recency: a counter taken on
//! every put and hit, so that sorting by `seq` gives the LRU order. The chunk entry is v2
//! (which has no shift and means 256 KiB) for shift 18, so that a binary older than v3 still
//! reads those after a rollback; it drops v3 entries as undecodable and punches their bytes,
//! which a cache can afford. A v3 value of shift 18 is not one this code writes, and is
//! dropped likewise. The shift is stored with every entry rather than once per blob: it is one
//! byte, written in the same batch as the chunk, with no ordering of its own to get right. The `c` and `s` keys of a
//! chunk are written and deleted in one batch. A key or value that does not decode is treated
//! as absent and deleted at open, never a panic.
//!
//! # Ordering, and why a crash cannot make the index lie
//! - **put**: evict LRU chunks until `bytes + in flight + size <= capacity` → `pwrite` the chunk
//!   at its offset in the blob file (with `O_DIRECT` where it can, `direct.rs`) → `fdatasync`
//!   → put the index entries (a batch of chunks:
//!   every chunk written, each blob file synced once, one index write; `batch.rs`). The
//!   entries are written only once the bytes are durable, so a `kill -9` at any point leaves either no
//!   entry (the bytes, if any, are unindexed and punched out at the next open) or an entry for
//!   a whole chunk.
//! - **evict / remove**: delete the index entries, then punch the range; a crash in between
//!   leaves unindexed bytes, punched out at the next open. (When the index may not be written
//!   for lack of space, see below, the range goes first and the entries are deleted with the
//!   next index write or dropped at the next open, where a read of a hole fails its crc32c.)
//! - A chunk is *pinned* while a reader reads it (and, for [`DiskCache::pin_blob`], while its
//!   holder keeps the blob file): eviction skips pinned chunks, and a pinned chunk that must
//!   go (a corrupt one) keeps its bytes until the last pin is released, so that no reader ever
//!   reads a range that is being punched out under it. A blob pin handed to the kernel can be
//!   *held* ([`BlobPin::hold`], `hold.rs`): recorded in the index with a token path, so that
//!   after a crash the next open keeps its chunks pinned for as long as the token exists.
//! - Index writes are not synced one by one: RocksDB's WAL reaches the OS on every write, so a
//!   killed process loses nothing. After a power loss the index may be older or newer than the
//!   files; [`DiskCache::open`] checks every entry against its blob file's size, and a chunk
//!   whose bytes did not survive fails its crc32c on the first read and is refetched.
//!   [`DiskCache::flush`] (also run on drop) writes recency and counters, `fsync`s the shard
//!   directories touched since the last flush, then syncs the WAL.
//!
//! # Recovery on open
//! RocksDB's lock makes a directory single-owner; an open waits a while
//! ([`INDEX_LOCK_WAIT`]) for another process that holds it (a daemon exiting after a
//! handover: its run-directory lock goes a moment before its index's), never for itself.
//! Every entry is decoded and its blob file
//! `stat`ed; entries that do not decode, lack their crc32c value, or whose file is missing
//! (`recovered_orphans`) or too short (`dropped_corrupt`) are deleted, and so are all the
//! entries of a blob whose entries name more than one shift (`recovered_orphans`: which of
//! them its file's bytes belong to is unknown). The rest are loaded into the in-memory LRU in
//! `seq` order. In every blob file, data outside indexed chunks (left by a crash) is punched
//! out (walking `SEEK_DATA`/`SEEK_HOLE`) — except in the files of blobs still held by an
//! earlier process's reader (a chunk removed while pinned kept its bytes for that reader):
//! those slots are noted and punched out when the blob's last hold is released — and blob
//! files without an indexed chunk and any other file are deleted
//! (`recovered_orphans`). If the capacity shrank, LRU chunks are
//! evicted until usage fits.
//!
//! # Concurrency and cost
//! One mutex guards the in-memory state (an `LruCache`, the chunks in flight, pins and
//! per-blob counts) and is never held across I/O, except for the `unlink` of a blob file whose
//! last chunk went (so that no put can reopen it meanwhile); a second one serializes index
//! writes, so that a batch of recency updates cannot re-create an entry evicted meanwhile. A
//! hit is a lookup and list move under the mutex, then an `O_DIRECT` `pread` on a blob file
//! kept open ([`OPEN_FILES`] of them; where the filesystem refuses `O_DIRECT`, a buffered one
//! and `fadvise(DONTNEED)` of what was read), and a crc32c per 4 KiB block: the reader keeps
//! the bytes (level 1, or the kernel's page cache above a FUSE file), so that a byte read
//! through a lazy mount sits in the page cache once; the crc32c values come from a memory
//! LRU ([`SUMS_CACHED`] bytes of values) in front of the index. A sequential stream's readahead reads
//! runs of adjacent chunks instead, one `O_DIRECT` `pread` per run into a huge-page buffer
//! (one device request per run, `huge.rs`) and no page cache ([`DiskCache::read_chunks_direct`],
//! `direct.rs`). Recency is written to the index in
//! batches of [`RECENCY_BATCH`] hits (and on flush); losing it in a crash only makes the LRU
//! order stale. A chunk being put or removed is in flight: a second put of it returns at once,
//! and it is not evicted meanwhile. Indexed bytes (each chunk rounded up to 4 KiB) plus bytes
//! reserved by puts in flight never exceed the capacity.
//!
//! # A full disk
//! Debian's librocksdb (7.8) is built with assertions: once RocksDB meets `ENOSPC` (seen with
//! its WAL and with a memtable flush to an SST) the process aborts (`SIGABRT`) at its next write
//! or on close. So RocksDB must never meet a full disk, and the cache keeps space for it:
//! - a *reserve* (`min(16 MiB + capacity / 512, max(capacity / 8, 1 MiB))`) stays free: before
//!   writing a chunk, a put checks `statvfs` and evicts LRU chunks until the chunk plus the
//!   reserve fit. The cache gives way when others fill the disk.
//! - every index write first checks that half the reserve is free; if not, the write is refused
//!   with [`Error::Cache`] ("no space left on device …") and counted in `enospc`. An eviction
//!   that cannot write the index punches the ranges anyway (see the ordering above).
//! - a chunk write that fails with `ENOSPC`/`EDQUOT` punches out what it wrote, evicts a batch
//!   of LRU chunks and retries once; a second failure is an [`Error::Cache`] saying "no space
//!   left on device". No partial chunk and no entry remain.
//!
//! [`DiskCache::open`] refuses (the same error) when less than half the reserve is free. What is
//! left is a race with another process that fills the disk between the check and RocksDB's
//! write; the space RocksDB preallocates for its files (`fallocate`) narrows it.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};

use bytes::Bytes;
use lru::LruCache;
use rocksdb::{IteratorMode, WriteBatch, DB};
use serde::{Deserialize, Serialize};

use super::{ChunkId, MAX_DISK_CHUNK_SHIFT};
use crate::error::{Error, Result};
use crate::store::Digest;

mod batch;
mod direct;
mod files;
mod fuzz;
mod hold;
mod huge;
mod index;
mod pin;
mod run;
mod sums;

use files::*;
#[doc(hidden)]
pub use fuzz::fuzz_recover;
#[doc(hidden)]
pub use index::fuzz_decode_index;
use index::*;
pub use pin::{BlobPin, VERIFY_RUN};
use sums::{block_sums, blocks_match, sums_len, SumsCache};
pub use sums::{CHECK_BLOCK, SUMS_CACHED};

/// Hits whose recency is written to the index in one batch.
pub const RECENCY_BATCH: usize = 1024;
/// Blob files kept open for reads and writes.
pub const OPEN_FILES: usize = 256;

const META_PREFIX: &[u8] = b"m/";
const META_FORMAT: &[u8] = b"m/format";
const FORMAT: &[u8] = b"strata-chunk-index v3";
/// The previous format (a file per chunk under `chunks/`): a cache, so wiped, not migrated.
const FORMAT_V2: &[u8] = b"strata-chunk-index v2";
const META_COUNTERS: &[u8] = b"m/counters";
/// Bytes evicted before the one retry of a chunk write that failed with `ENOSPC`.
const ENOSPC_EVICT: u64 = 4 * MAX_CHUNK;
const MIB: u64 = 1 << 20;
/// The largest chunk kept: 256 KiB.
const MAX_CHUNK: u64 = 1 << MAX_DISK_CHUNK_SHIFT;

/// Bytes a chunk of `size` bytes is charged: its blocks.
fn cost(size: u64) -> u64 {
    size.next_multiple_of(CHECK_BLOCK)
}

/// Where chunk `index` of a blob of `1 << shift`-byte chunks starts in its blob file; `None`
/// past `u64` (or for a shift past 63).
fn chunk_offset(index: u64, shift: u8) -> Option<u64> {
    index.checked_mul(1u64.checked_shl(u32::from(shift))?)
}

/// The outcome of [`DiskCache::read_range`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RangeRead {
    /// The bytes asked for, each block checked against its crc32c.
    Hit(Bytes),
    /// Not cached (or its file vanished: dropped).
    Absent,
    /// A block does not match its crc32c: the caller must drop the chunk and refetch it.
    Corrupt,
    /// Asked not to block, and the read would wait for the disk (always, with `O_DIRECT`).
    WouldBlock,
}

const _: () = assert!(MAX_CHUNK <= u32::MAX as u64);
// Every shift kept is at least a crc32c block: a chunk that is not its blob's last is a
// whole number of blocks.
const _: () = assert!(1 << super::MIN_CHUNK_SHIFT >= CHECK_BLOCK);

/// How long [`DiskCache::open`] waits for an index that another process holds: a daemon that
/// has handed its mounts over releases the run directory's lock a moment before its process
/// is gone, and with it the index (`ublk-daemon/docs/daemon.md`, "Start, stop, crash,
/// upgrade").
pub const INDEX_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// How often a waiting open tries the index again.
const INDEX_LOCK_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Whether RocksDB refused to open because another process holds the index's lock file (its
/// `fcntl` lock, `EAGAIN`/`EACCES`), as opposed to this process holding it ("lock hold by
/// current process") or anything else.
fn held_elsewhere(e: &rocksdb::Error) -> bool {
    let m = e.as_ref();
    e.kind() == rocksdb::ErrorKind::IOError
        && m.contains("While lock file")
        && !m.contains("current process")
}

/// Where level 2 lives and how large it may grow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskCacheConfig {
    /// The cache directory (created if missing); it holds `blobs/` and `index/`.
    pub dir: PathBuf,
    /// The most bytes of chunk data kept (each chunk rounded up to 4 KiB; the index is not
    /// counted).
    pub capacity: u64,
}

/// Counters of a [`DiskCache`]; the event counters are cumulative across restarts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiskStats {
    /// Bytes charged for indexed chunks (each rounded up to 4 KiB).
    pub bytes: u64,
    /// Indexed chunks.
    pub chunks: u64,
    /// The configured capacity in bytes.
    pub capacity: u64,
    /// Chunks evicted to stay under the capacity or to free disk space.
    pub evictions: u64,
    /// Chunks dropped because their bytes were bad: reported by the caller (crc32c or digest
    /// mismatch), or their blob file missing or too short.
    pub dropped_corrupt: u64,
    /// Times the disk was full: `ENOSPC`/`EDQUOT` on a chunk write, or an index write refused
    /// because less than the index's share of the reserve was free.
    pub enospc: u64,
    /// Cleaned up at open: unindexed chunk bytes and files, and index entries that do not
    /// decode or whose file is missing.
    pub recovered_orphans: u64,
    /// Holds of earlier processes in force: found at open with their token alive, not yet
    /// released (`DiskCache::release_stale_holds`); their blobs' chunks stay pinned.
    pub stale_holds: u64,
    /// Chunks not cached because their blob has chunks of another size in level 2 that are
    /// in use (pinned, or being put or removed), so that they could not be dropped first
    /// (this process only: not kept in the index).
    pub shift_conflicts: u64,
}

/// Indexes into the event counters, in their order in `m/counters`.
const EVICTIONS: usize = 0;
const DROPPED_CORRUPT: usize = 1;
const ENOSPC: usize = 2;
const RECOVERED_ORPHANS: usize = 3;

/// An index write's failure, and whether it was refused for lack of space (RocksDB untouched).
type IndexResult = Result<(), (Error, bool)>;

#[derive(Debug)]
struct State {
    /// Indexed chunks, most recently used first.
    lru: LruCache<ChunkId, Entry>,
    /// Chunks being put or removed.
    inflight: HashSet<ChunkId>,
    /// Readers (and blob pins) of each chunk; pinned chunks are not evicted.
    pins: HashMap<ChunkId, u32>,
    /// Removed chunks whose range is punched out when their last pin goes (still in flight).
    deferred: HashSet<ChunkId>,
    /// Per blob: indexed chunks plus chunks in flight (its file is unlinked at zero), and
    /// their one shift.
    per_blob: HashMap<Digest, BlobRefs>,
    /// Bytes charged for the chunks in `lru`.
    present: u64,
    /// Bytes reserved by puts in flight.
    pending: u64,
    next_seq: u64,
    /// Chunks whose recency changed since it was last written to the index.
    dirty: HashSet<ChunkId>,
    /// Entries whose bytes were punched out while the index could not be written.
    stale: Vec<ChunkId>,
    /// Shard directories with creations or unlinks not yet `fsync`ed.
    dirty_dirs: [bool; 256],
    counters: [u64; 4],
    /// [`DiskStats::shift_conflicts`].
    shift_conflicts: u64,
}

/// A blob's chunks in level 2 (see [`State::per_blob`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BlobRefs {
    chunks: u32,
    shift: u8,
}

impl State {
    /// Add `n` to event counter `c`. The counters start from what the index held, which a
    /// damaged index can make anything: they saturate rather than overflow.
    fn count(&mut self, c: usize, n: u64) {
        self.counters[c] = self.counters[c].saturating_add(n);
    }

    fn touch(&mut self, id: &ChunkId) -> Option<Entry> {
        let seq = self.next_seq;
        let entry = self.lru.get_mut(id)?;
        entry.seq = seq;
        let entry = *entry;
        self.next_seq = seq.saturating_add(1);
        self.dirty.insert(*id);
        Some(entry)
    }

    /// Take unpinned LRU chunks out until `bytes` are freed (or none is left); the caller
    /// removes them with [`DiskCache::discard`]. Pinned chunks are skipped (and become most
    /// recently used: someone is reading them).
    fn doom_lru(&mut self, bytes: u64) -> Vec<(ChunkId, Entry)> {
        let mut freed = 0;
        let mut victims = Vec::new();
        let mut skipped = Vec::new();
        while freed < bytes {
            let Some((id, entry)) = self.lru.pop_lru() else {
                break;
            };
            if self.pins.contains_key(&id) {
                skipped.push((id, entry));
                continue;
            }
            freed += cost(u64::from(entry.size));
            victims.push(self.doom(id, entry));
        }
        for (id, entry) in skipped {
            self.lru.push(id, entry);
        }
        victims
    }

    fn doom(&mut self, id: ChunkId, entry: Entry) -> (ChunkId, Entry) {
        self.present -= cost(u64::from(entry.size));
        self.dirty.remove(&id);
        self.inflight.insert(id);
        (id, entry)
    }

    fn pin(&mut self, id: &ChunkId) {
        *self.pins.entry(*id).or_insert(0) += 1;
    }

    /// Make way for chunks of `blob` of `1 << shift` bytes (a blob's chunks in level 2 share
    /// one shift): if the blob has chunks of another shift, doom them all, for the caller to
    /// remove ([`DiskCache::discard`]) before it puts any chunk of the new shift. `None` if
    /// that cannot be done now because one of them is pinned or in flight (the caller skips
    /// the put). A scan of the whole LRU: a blob changes chunk size rarely, if ever.
    fn make_way_for_shift(&mut self, blob: &Digest, shift: u8) -> Option<Vec<(ChunkId, Entry)>> {
        let refs = match self.per_blob.get(blob) {
            Some(r) if r.shift != shift => *r,
            _ => return Some(Vec::new()),
        };
        let old: Vec<ChunkId> = (self.lru.iter())
            .filter(|(id, _)| id.blob == *blob)
            .map(|(id, _)| *id)
            .collect();
        // Fewer indexed than counted: some are in flight.
        if old.len() != refs.chunks as usize || old.iter().any(|id| self.pins.contains_key(id)) {
            return None;
        }
        let mut victims = Vec::with_capacity(old.len());
        for id in old {
            if let Some(entry) = self.lru.pop(&id) {
                victims.push(self.doom(id, entry));
            }
        }
        Some(victims)
    }

    /// Release a pin; `true` if the chunk was removed meanwhile and its range must now be
    /// punched out (it stays in flight until [`DiskCache::finish_removal`]).
    fn unpin(&mut self, id: &ChunkId) -> bool {
        match self.pins.get_mut(id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.pins.remove(id);
                self.deferred.remove(id)
            }
            None => false,
        }
    }
}

/// Level 2 of the chunk cache. Blocking; `Send + Sync`; see the module docs.
pub struct DiskCache {
    dir: PathBuf,
    blobs: PathBuf,
    index_dir: PathBuf,
    capacity: u64,
    /// Free space kept on the filesystem (module docs, "A full disk").
    reserve: u64,
    db: DB,
    state: Mutex<State>,
    /// Held around every index write.
    index_lock: Mutex<()>,
    /// Blob files kept open (read-write).
    open_files: Mutex<LruCache<Digest, Arc<File>>>,
    /// Blob files kept open (read-write) with `O_DIRECT` (`direct.rs`), popped with
    /// `open_files`.
    open_direct: Mutex<LruCache<Digest, Arc<File>>>,
    /// Whether a reader's blocks are read and chunks written with `O_DIRECT`: cleared when
    /// the cache's filesystem first refuses it, or by `set_direct_reads(false)`.
    direct_ok: std::sync::atomic::AtomicBool,
    /// crc32c values of recently read chunks.
    sums: Mutex<SumsCache>,
    /// Holds left by earlier processes whose token still existed at open, by index key
    /// (`hold.rs`).
    holds: Mutex<HashMap<Vec<u8>, hold::Held>>,
    /// Slots with data but no chunk found at open in the files of held blobs (chunks removed
    /// under an earlier process's hold, or a crash's leftovers), by blob, with the blob's
    /// shift: punched out when its last hold goes (`hold.rs`).
    held_orphans: Mutex<HashMap<Digest, (u8, Vec<u64>)>>,
}

impl fmt::Debug for DiskCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskCache")
            .field("dir", &self.dir)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// A pin held for the duration of one read.
struct ReadPin<'a> {
    cache: &'a DiskCache,
    id: ChunkId,
}

impl Drop for ReadPin<'_> {
    fn drop(&mut self) {
        self.cache.release(&self.id);
    }
}

impl DiskCache {
    /// Open (or create) the cache in `config.dir`, recovering from any crash (module docs).
    /// An index that another process holds is waited for, up to [`INDEX_LOCK_WAIT`]
    /// ([`DiskCache::open_waiting`]).
    pub fn open(config: DiskCacheConfig) -> Result<Self> {
        Self::open_waiting(config, INDEX_LOCK_WAIT)
    }

    /// [`DiskCache::open`], waiting up to `wait` while another process holds the index (module
    /// docs, "Recovery on open"); zero fails at once. This process's own open cache on the
    /// same directory is never waited for: that fails at once.
    pub fn open_waiting(config: DiskCacheConfig, wait: std::time::Duration) -> Result<Self> {
        let DiskCacheConfig { dir, capacity } = config;
        let blobs = dir.join("blobs");
        let index_dir = dir.join("index");
        for d in [&dir, &blobs, &index_dir] {
            fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
        }
        for d in (0..=255u8).map(|shard| blobs.join(hex::encode([shard]))) {
            fs::create_dir_all(&d).map_err(|e| Error::io("create directory", d, e))?;
        }
        sync_dir(&blobs)?;

        let reserve = (16 * MIB + capacity / 512).min((capacity / 8).max(MIB));
        if let Some(free) = free_bytes(&index_dir).filter(|f| *f < reserve / 2) {
            return Err(Error::Cache {
                path: index_dir,
                message: format!(
                    "no space left on device to open the index: {free} bytes free, {} needed",
                    reserve / 2
                ),
                source: None,
            });
        }
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.set_compression_type(rocksdb::DBCompressionType::None);
        opts.set_write_buffer_size((reserve / 4).clamp(256 << 10, 4 * MIB) as usize);
        opts.set_max_total_wal_size(16 * MIB);
        opts.set_log_level(rocksdb::LogLevel::Warn);
        opts.set_keep_log_file_num(2);
        opts.set_max_log_file_size(MIB as usize);
        let deadline = std::time::Instant::now() + wait;
        let db = loop {
            match DB::open(&opts, &index_dir) {
                Ok(db) => break db,
                // Held by another process (RocksDB's `fcntl` lock on `index/LOCK`): a daemon
                // that handed over and is exiting, most likely.
                Err(e) if held_elsewhere(&e) && std::time::Instant::now() < deadline => {
                    std::thread::sleep(INDEX_LOCK_POLL);
                }
                Err(e) => {
                    let what = if held_elsewhere(&e) {
                        format!(
                            "cannot open the index: another process has held it for {} ms \
                             (another daemon on this cache directory?)",
                            wait.as_millis()
                        )
                    } else {
                        "cannot open the index (is another process using it?)".to_owned()
                    };
                    return Err(rocks_error(&index_dir, &what, e));
                }
            }
        };
        let counters = match db.get(META_COUNTERS) {
            Ok(v) => v.as_deref().and_then(decode_counters).unwrap_or_default(),
            Err(e) => return Err(rocks_error(&index_dir, "cannot read the index", e)),
        };
        let nonzero =
            |n: usize| std::num::NonZeroUsize::new(n).unwrap_or(std::num::NonZeroUsize::MIN);
        let cache = DiskCache {
            dir,
            blobs,
            index_dir,
            capacity,
            reserve,
            db,
            state: Mutex::new(State {
                lru: LruCache::unbounded(),
                inflight: HashSet::new(),
                pins: HashMap::new(),
                deferred: HashSet::new(),
                per_blob: HashMap::new(),
                present: 0,
                pending: 0,
                next_seq: 0,
                dirty: HashSet::new(),
                stale: Vec::new(),
                dirty_dirs: [false; 256],
                counters,
                shift_conflicts: 0,
            }),
            index_lock: Mutex::new(()),
            open_files: Mutex::new(LruCache::new(nonzero(OPEN_FILES))),
            open_direct: Mutex::new(LruCache::new(nonzero(OPEN_FILES))),
            direct_ok: std::sync::atomic::AtomicBool::new(true),
            sums: Mutex::new(SumsCache::new(SUMS_CACHED)),
            holds: Mutex::new(HashMap::new()),
            held_orphans: Mutex::new(HashMap::new()),
        };
        cache.recover()?;
        Ok(cache)
    }

    /// Check the format, load the index, drop entries without their bytes' file, punch out
    /// unindexed bytes, delete files without an entry, and evict down to the capacity.
    fn recover(&self) -> Result<()> {
        match self.db.get(META_FORMAT) {
            Ok(Some(v)) if v == FORMAT => {}
            Ok(Some(v)) if v == FORMAT_V2 => self.wipe_v2()?,
            Ok(Some(v)) => {
                return Err(self.error(format!(
                    "index format {:?} is not {:?}; move the directory away to start afresh",
                    String::from_utf8_lossy(&v),
                    String::from_utf8_lossy(FORMAT)
                )))
            }
            Ok(None) => (self.write_index(|b| b.put(META_FORMAT, FORMAT), "cannot write"))
                .map_err(|(e, _)| e)?,
            Err(e) => return Err(self.rocks_error("cannot read the index", e)),
        }
        let mut entries = Vec::new();
        // Chunk (blob, index) → length of its crc32c value (one `s` key per chunk).
        let mut with_sums: HashMap<(Digest, u64), u64> = HashMap::new();
        // The values themselves, up to what the sums cache holds: read here anyway, they are
        // put in the cache below (for kept chunks), so that the first reads after a restart
        // check level-2 bytes without an index read each (a point lookup per chunk, from
        // disk once the page cache has dropped the index's files).
        let mut values: HashMap<(Digest, u64), Arc<[u8]>> = HashMap::new();
        let mut values_bytes = 0usize;
        let mut bad_keys = Vec::new();
        let mut holds = Vec::new();
        let (mut orphans, mut corrupt) = (0u64, 0u64);
        for item in self.db.full_iterator(IteratorMode::Start) {
            let (key, value) = item.map_err(|e| self.rocks_error("cannot read the index", e))?;
            if key.starts_with(META_PREFIX) {
                continue;
            }
            if key.first() == Some(&HOLD_KEY_TAG) {
                match (decode_hold_key(&key), decode_hold_value(&value)) {
                    (Some((blob, _, token)), Some(id)) => holds.push(hold::Recorded {
                        blob,
                        token,
                        id,
                        key,
                    }),
                    _ => {
                        bad_keys.push(key);
                        orphans += 1;
                    }
                }
                continue;
            }
            match decode_key(&key) {
                Some((CHUNK_KEY_TAG, blob, index)) => match decode_entry(&value) {
                    Some((entry, shift)) => {
                        entries.push((ChunkId { blob, shift, index }, entry, key))
                    }
                    None => {
                        bad_keys.push(key);
                        orphans += 1;
                    }
                },
                Some((_, blob, index)) => {
                    with_sums.insert((blob, index), value.len() as u64);
                    if values_bytes + value.len() <= SUMS_CACHED {
                        values_bytes += value.len();
                        values.insert((blob, index), Arc::from(&value[..]));
                    }
                }
                None => {
                    bad_keys.push(key);
                    orphans += 1;
                }
            }
        }
        // The shift of each blob's entries; `None` where they name more than one.
        let mut shifts: HashMap<Digest, Option<u8>> = HashMap::new();
        for (id, ..) in &entries {
            let s = shifts.entry(id.blob).or_insert(Some(id.shift));
            if *s != Some(id.shift) {
                *s = None;
            }
        }
        // Keep entries whose crc32c values are there and whose blob file is long enough, of
        // blobs whose entries agree on their shift.
        let mut lengths: HashMap<Digest, Option<u64>> = HashMap::new();
        let mut kept = Vec::new();
        for (id, entry, key) in entries {
            let size = u64::from(entry.size);
            let sums = with_sums.remove(&(id.blob, id.index));
            if shifts.get(&id.blob) != Some(&Some(id.shift)) {
                bad_keys.push(key);
                bad_keys.push(sums_key(&id).to_vec().into_boxed_slice());
                orphans += 1;
                continue;
            }
            let len = match lengths.get(&id.blob) {
                Some(len) => *len,
                None => {
                    let path = self.blob_path(&id.blob);
                    let len = match fs::symlink_metadata(&path) {
                        Ok(m) if m.is_file() => Some(m.len()),
                        Ok(_) => None,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                        Err(e) => return Err(Error::io("stat blob file", path, e)),
                    };
                    lengths.insert(id.blob, len);
                    len
                }
            };
            let end = chunk_offset(id.index, id.shift).and_then(|o| o.checked_add(size));
            let whole = matches!((len, end), (Some(len), Some(end)) if end <= len);
            let sums_ok = sums == Some(sums_len(size));
            if whole && sums_ok {
                kept.push((id, entry));
                continue;
            }
            bad_keys.push(key);
            bad_keys.push(sums_key(&id).to_vec().into_boxed_slice());
            if whole || len.is_none() {
                orphans += 1; // no crc32c values, or no file
            } else {
                corrupt += 1; // a file too short for the chunk
            }
        }
        // crc32c values without their entry.
        for (blob, index) in with_sums.into_keys() {
            let id = ChunkId::new(blob, MAX_DISK_CHUNK_SHIFT, index);
            bad_keys.push(sums_key(&id).to_vec().into_boxed_slice());
        }
        // Holds whose token is gone.
        let live_holds = hold::sort_holds(holds, &mut bad_keys);
        if !bad_keys.is_empty() {
            let delete_all = |b: &mut WriteBatch| bad_keys.iter().for_each(|k| b.delete(k));
            (self.write_index(delete_all, "cannot clean the index")).map_err(|(e, _)| e)?;
        }

        kept.sort_unstable_by_key(|(_, e)| e.seq);
        // Per blob: its shift and indexed chunks.
        let mut indexed: HashMap<Digest, (u8, HashSet<u64>)> = HashMap::new();
        let mut sums_kept = Vec::new();
        let victims = {
            let mut st = self.lock();
            for (id, entry) in kept {
                // Kept only with values of the right length (checked above).
                if let Some(v) = values.remove(&(id.blob, id.index)) {
                    sums_kept.push((id, v));
                }
                st.present += cost(u64::from(entry.size));
                // Saturating: a damaged index can hold any seq (`u64::MAX` included); the
                // recency order then only goes stale, as after a lost batch of updates.
                st.next_seq = st.next_seq.max(entry.seq.saturating_add(1));
                st.lru.push(id, entry);
                (st.per_blob.entry(id.blob))
                    .or_insert(BlobRefs {
                        chunks: 0,
                        shift: id.shift,
                    })
                    .chunks += 1;
                (indexed.entry(id.blob))
                    .or_insert_with(|| (id.shift, HashSet::new()))
                    .1
                    .insert(id.index);
            }
            st.count(RECOVERED_ORPHANS, orphans);
            st.count(DROPPED_CORRUPT, corrupt);
            // Before any eviction: what earlier processes' readers may still read stays.
            *self.holds.lock().unwrap_or_else(PoisonError::into_inner) =
                hold::pin_held(&mut st, live_holds, &indexed);
            let over = st.present.saturating_sub(self.capacity);
            st.doom_lru(over)
        };
        {
            // Oldest first, as the chunks went into the recency order.
            let mut cache = self.sums.lock().unwrap_or_else(PoisonError::into_inner);
            for (id, v) in sums_kept {
                cache.put(id, v);
            }
        }
        for (id, _) in &victims {
            if let Some((_, set)) = indexed.get_mut(&id.blob) {
                set.remove(&id.index);
            }
        }
        self.discard(victims, Some(EVICTIONS))?;

        // Files without an entry, and bytes outside indexed chunks: leftovers of a crash. Not
        // in the file of a blob an earlier process's reader still holds: it may be reading a
        // chunk that was removed while pinned (its bytes kept until the pin went, which a
        // restart forgets); those slots are noted and go when the blob's last hold does.
        let held: HashSet<Digest> = (self.holds.lock().unwrap_or_else(PoisonError::into_inner))
            .values()
            .map(|h| h.blob)
            .collect();
        let mut removed = 0;
        for shard in 0..=255u8 {
            let shard_hex = hex::encode([shard]);
            let shard_dir = self.blobs.join(&shard_hex);
            let listing = fs::read_dir(&shard_dir).map_err(|e| Error::io("list", &shard_dir, e))?;
            for dirent in listing {
                let dirent = dirent.map_err(|e| Error::io("list", &shard_dir, e))?;
                let path = dirent.path();
                let blob = (dirent.file_name().to_str())
                    .and_then(|name| parse_blob_name(&shard_hex, name));
                let chunks = blob
                    .and_then(|b| indexed.get(&b))
                    .filter(|(_, c)| !c.is_empty());
                match chunks {
                    Some((shift, chunks)) if dirent.file_type().is_ok_and(|t| t.is_file()) => {
                        match blob.filter(|b| held.contains(b)) {
                            Some(b) => {
                                let file = (OpenOptions::new().read(true))
                                    .open(&path)
                                    .map_err(|e| Error::io("open blob file", &path, e))?;
                                let slots = unindexed_slots(&file, &path, *shift, chunks)?;
                                if !slots.is_empty() {
                                    (self.held_orphans.lock())
                                        .unwrap_or_else(PoisonError::into_inner)
                                        .insert(b, (*shift, slots));
                                }
                            }
                            None => removed += punch_unindexed(&path, *shift, chunks)?,
                        }
                    }
                    _ if dirent.file_type().is_ok_and(|t| t.is_dir()) => {
                        tracing::warn!(path = %path.display(), "unexpected directory in the chunk cache; left alone");
                    }
                    _ => {
                        remove_file(&path)?;
                        removed += 1;
                    }
                }
            }
        }
        self.lock().count(RECOVERED_ORPHANS, removed);
        if removed + orphans + corrupt > 0 {
            tracing::info!(dir = %self.dir.display(), removed, dropped_entries = orphans + corrupt, "chunk cache recovered");
        }
        self.flush()
    }

    /// A v2 cache (a file per chunk): drop its chunk files and entries, keep the counters.
    fn wipe_v2(&self) -> Result<()> {
        tracing::warn!(dir = %self.dir.display(), "chunk cache: old layout (v2) found; starting afresh");
        let old = self.dir.join("chunks");
        match fs::remove_dir_all(&old) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(Error::io("remove old chunk files", old, e))
            }
            _ => {}
        }
        let mut keys = Vec::new();
        for item in self.db.full_iterator(IteratorMode::Start) {
            let (key, _) = item.map_err(|e| self.rocks_error("cannot read the index", e))?;
            if !key.starts_with(META_PREFIX) {
                keys.push(key);
            }
        }
        let rewrite = |b: &mut WriteBatch| {
            keys.iter().for_each(|k| b.delete(k));
            b.put(META_FORMAT, FORMAT);
        };
        (self.write_index(rewrite, "cannot rewrite the index")).map_err(|(e, _)| e)
    }

    /// The chunk's bytes, checked against their crc32c, or `None` if it is not cached (a
    /// chunk that fails its check is dropped: `None`); marks it recently used.
    pub fn get(&self, id: &ChunkId) -> Result<Option<Bytes>> {
        let Some(entry) = self.lock().lru.peek(id).copied() else {
            return Ok(None);
        };
        match self.read_range(id, 0..u64::from(entry.size), false)? {
            RangeRead::Hit(b) => Ok(Some(b)),
            RangeRead::Corrupt => {
                self.drop_corrupt(id)?;
                Ok(None)
            }
            RangeRead::Absent | RangeRead::WouldBlock => Ok(None),
        }
    }

    /// Mark a cached chunk used and pin it for a read (the pin goes with the returned
    /// guard); `None` if it is not cached. Saves recency when a batch of it is due.
    fn pin_for_read(&self, id: &ChunkId) -> Option<(Entry, ReadPin<'_>)> {
        let (entry, persist) = {
            let mut st = self.lock();
            let entry = st.touch(id)?;
            st.pin(id);
            (entry, st.dirty.len() >= RECENCY_BATCH)
        };
        let pin = ReadPin {
            cache: self,
            id: *id,
        };
        if persist {
            if let Err(e) = self.persist_recency(false) {
                tracing::debug!(error = %e, "chunk cache: recency not saved");
            }
        }
        Some((entry, pin))
    }

    /// Bytes `range` of a cached chunk, reading and checking (crc32c) only the 4 KiB blocks
    /// that cover it; marks the chunk recently used. With `nowait`, the reads do not wait for
    /// the disk: [`RangeRead::WouldBlock`] (always with `O_DIRECT`; through the page cache,
    /// `RWF_NOWAIT`, unless the bytes are there), and the caller retries on a thread that may
    /// block.
    pub fn read_range(
        &self,
        id: &ChunkId,
        range: std::ops::Range<u64>,
        nowait: bool,
    ) -> Result<RangeRead> {
        let Some((entry, _pin)) = self.pin_for_read(id) else {
            return Ok(RangeRead::Absent);
        };
        let size = u64::from(entry.size);
        if range.start > range.end || range.end > size {
            return Err(self.error(format!(
                "range {range:?} is outside chunk {} of blob {} ({size} bytes)",
                id.index, id.blob
            )));
        }
        if range.is_empty() {
            return Ok(RangeRead::Hit(Bytes::new()));
        }
        let Some(file) = self.open_blob(&id.blob, false)? else {
            drop(_pin);
            self.forget(id, Some(entry.seq), Some(DROPPED_CORRUPT))?;
            return Ok(RangeRead::Absent);
        };
        let Some(sums) = self.sums_of_opt(id, size)? else {
            drop(_pin);
            self.forget(id, Some(entry.seq), Some(DROPPED_CORRUPT))?;
            return Ok(RangeRead::Absent);
        };
        let first = range.start / CHECK_BLOCK;
        let last = range.end.div_ceil(CHECK_BLOCK);
        let data_at = first * CHECK_BLOCK;
        let data_len = (last * CHECK_BLOCK).min(size) - data_at;
        let base = chunk_offset(id.index, id.shift).unwrap_or(u64::MAX);
        let data = match self.read_for_reader(
            &id.blob,
            &file,
            data_len as usize,
            base + data_at,
            nowait,
        ) {
            Ok((ReadOutcome::Full, data)) => data,
            Ok((ReadOutcome::WouldBlock, _)) => return Ok(RangeRead::WouldBlock),
            // A blob file shorter than an indexed chunk: damaged behind our back.
            Ok((ReadOutcome::Short, _)) => return Ok(RangeRead::Corrupt),
            Err(e) => return Err(Error::io("read chunk", self.blob_path(&id.blob), e)),
        };
        if !blocks_match(&data, &sums[4 * first as usize..4 * last as usize]) {
            return Ok(RangeRead::Corrupt);
        }
        // A whole chunk may be kept in level 1 by the caller: a buffer of its own then, not a
        // slice of a larger (aligned, padded) read buffer that level 1 would not count.
        if range.start == 0 && range.end == size {
            return Ok(RangeRead::Hit(Bytes::copy_from_slice(
                &data[..size as usize],
            )));
        }
        Ok(RangeRead::Hit(data.slice(
            (range.start - data_at) as usize..(range.end - data_at) as usize,
        )))
    }

    /// Cache a chunk: durable on disk before it is indexed; LRU chunks are evicted first so that
    /// usage stays within the capacity. A chunk already cached (or being put) is only marked
    /// used; one that cannot fit (more than the capacity left by puts in flight) is not cached.
    /// Chunks larger than their chunk size, or of a shift outside 12 ..= 18, are refused.
    pub fn put(&self, id: &ChunkId, data: &[u8]) -> Result<()> {
        self.put_many(&[(*id, data)])
    }

    /// Drop a chunk; counts nothing.
    pub fn remove(&self, id: &ChunkId) -> Result<()> {
        self.forget(id, None, None)
    }

    /// Drop a chunk whose bytes do not match its digest; counted in `dropped_corrupt` if it was
    /// cached.
    pub fn drop_corrupt(&self, id: &ChunkId) -> Result<()> {
        self.forget(id, None, Some(DROPPED_CORRUPT))
    }

    /// Whether the chunk is cached (does not mark it used).
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.lock().lru.contains(id)
    }

    /// The blob file of `blob` (for tests and tools: where its cached chunks are).
    pub fn blob_path(&self, blob: &Digest) -> PathBuf {
        let hex = blob.to_hex();
        self.blobs.join(&hex[..2]).join(hex)
    }

    pub fn stats(&self) -> DiskStats {
        let st = self.lock();
        DiskStats {
            bytes: st.present,
            chunks: st.lru.len() as u64,
            capacity: self.capacity,
            evictions: st.counters[EVICTIONS],
            dropped_corrupt: st.counters[DROPPED_CORRUPT],
            enospc: st.counters[ENOSPC],
            recovered_orphans: st.counters[RECOVERED_ORPHANS],
            stale_holds: (self.holds.lock().unwrap_or_else(PoisonError::into_inner)).len() as u64,
            shift_conflicts: st.shift_conflicts,
        }
    }

    /// Persist recency and counters, make file creations and unlinks durable, and sync the
    /// index.
    pub fn flush(&self) -> Result<()> {
        self.persist_recency(true)?;
        let (counters, dirs) = {
            let mut st = self.lock();
            (
                st.counters,
                std::mem::replace(&mut st.dirty_dirs, [false; 256]),
            )
        };
        let counters = encode_counters(&counters);
        (self.write_index(
            |b| b.put(META_COUNTERS, counters),
            "cannot write the counters",
        ))
        .map_err(|(e, _)| e)?;
        for (shard, _) in dirs.iter().enumerate().filter(|(_, dirty)| **dirty) {
            sync_dir(&self.blobs.join(hex::encode([shard as u8])))?;
        }
        let _index = self
            .index_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.index_room()?;
        (self.db.flush_wal(true)).map_err(|e| self.rocks_error("cannot sync the index", e))
    }

    /// Release a pin; punch out a chunk removed while it was pinned.
    fn release(&self, id: &ChunkId) {
        let punch = self.lock().unpin(id);
        if punch {
            self.finish_removal(*id);
        }
    }

    fn sums_of_opt(&self, id: &ChunkId, size: u64) -> Result<Option<Arc<[u8]>>> {
        let cached = (self.sums.lock().unwrap_or_else(PoisonError::into_inner)).get(id);
        if let Some(s) = cached.filter(|s| s.len() as u64 == sums_len(size)) {
            return Ok(Some(s));
        }
        let value = (self.db.get_pinned(sums_key(id)))
            .map_err(|e| self.rocks_error("cannot read the index", e))?;
        let Some(value) = value.filter(|v| v.len() as u64 == sums_len(size)) else {
            return Ok(None);
        };
        let sums: Arc<[u8]> = Arc::from(&value[..]);
        (self.sums.lock().unwrap_or_else(PoisonError::into_inner)).put(*id, sums.clone());
        Ok(Some(sums))
    }

    /// The open blob file of `blob`; with `create`, created if missing; without, `None` if
    /// missing.
    fn open_blob(&self, blob: &Digest, create: bool) -> Result<Option<Arc<File>>> {
        let cached = (self
            .open_files
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
        .get(blob)
        .cloned();
        if let Some(f) = cached {
            return Ok(Some(f));
        }
        let path = self.blob_path(blob);
        let file = match (OpenOptions::new().read(true).write(true).create(create))
            .mode(0o644)
            .open(&path)
        {
            Ok(f) => {
                // No kernel readahead on blob files: a reader asks for exactly the blocks it
                // needs (and drops them after), so pages read ahead would only sit in the page
                // cache beside the copy the reader keeps.
                let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::Random);
                Arc::new(f)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && !create => return Ok(None),
            Err(e) => return Err(Error::io("open blob file", path, e)),
        };
        if create {
            self.lock().dirty_dirs[usize::from(blob.0[0])] = true;
        }
        (self
            .open_files
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
        .put(*blob, file.clone());
        Ok(Some(file))
    }

    /// Remove `id` if it is cached and, with `seq`, still the entry that was looked at.
    fn forget(&self, id: &ChunkId, seq: Option<u64>, counter: Option<usize>) -> Result<()> {
        let victim = {
            let mut st = self.lock();
            match st.lru.peek(id) {
                Some(e) if seq.is_none_or(|s| s == e.seq) => {}
                _ => return Ok(()),
            }
            let Some(entry) = st.lru.pop(id) else {
                return Ok(());
            };
            st.doom(*id, entry)
        };
        self.discard(vec![victim], counter)
    }

    /// Remove doomed chunks: index entries first, then their bytes (module docs).
    fn discard(&self, victims: Vec<(ChunkId, Entry)>, counter: Option<usize>) -> Result<()> {
        if victims.is_empty() {
            return Ok(());
        }
        let delete_all = |b: &mut WriteBatch| {
            for (id, _) in &victims {
                b.delete(chunk_key(id));
                b.delete(sums_key(id));
            }
        };
        let stale = match self.write_index(delete_all, "cannot remove chunks from the index") {
            Ok(()) => false,
            Err((e, true)) => {
                tracing::warn!(error = %e, "chunk cache: evicting bytes before their index entries");
                true
            }
            Err((e, false)) => {
                // Nothing was removed: put the chunks back, least recently used last.
                let mut st = self.lock();
                for (id, entry) in victims.iter().rev() {
                    st.inflight.remove(id);
                    st.present += cost(u64::from(entry.size));
                    st.lru.push(*id, *entry);
                    st.lru.demote(id);
                }
                return Err(e);
            }
        };
        {
            let mut sums = self.sums.lock().unwrap_or_else(PoisonError::into_inner);
            for (id, _) in &victims {
                sums.pop(id);
            }
        }
        let n = victims.len() as u64;
        let now = {
            let mut st = self.lock();
            if let Some(c) = counter {
                st.count(c, n);
            }
            let mut now = Vec::new();
            for (id, entry) in &victims {
                if stale {
                    st.stale.push(*id);
                }
                if st.pins.contains_key(id) {
                    // Being read: punched out when the last reader is done.
                    st.deferred.insert(*id);
                } else {
                    now.push((*id, u64::from(entry.size)));
                }
            }
            now
        };
        for (id, _) in now {
            self.finish_removal(id);
        }
        Ok(())
    }

    /// Punch out a removed chunk's slot, `[index << shift, +1 << shift)` (it is in flight, so
    /// nothing else touches it), then let it go; unlink its blob file if no chunk of the blob
    /// is left.
    fn finish_removal(&self, id: ChunkId) {
        if let Err(e) = self.punch(&id, id.chunk_size()) {
            tracing::warn!(error = %e, "chunk cache: evicted chunk bytes left for the next open");
        }
        let mut st = self.lock();
        st.inflight.remove(&id);
        self.drop_blob_ref(&mut st, &id.blob);
    }

    /// One chunk of `blob` fewer (indexed or in flight); at zero, its file goes. Runs under
    /// the state lock so that no put opens the file meanwhile (module docs).
    fn drop_blob_ref(&self, st: &mut State, blob: &Digest) {
        let Some(refs) = st.per_blob.get_mut(blob) else {
            return;
        };
        refs.chunks -= 1;
        if refs.chunks > 0 {
            return;
        }
        st.per_blob.remove(blob);
        (self
            .open_files
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
        .pop(blob);
        (self
            .open_direct
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
        .pop(blob);
        if let Err(e) = remove_file(&self.blob_path(blob)) {
            tracing::warn!(error = %e, "chunk cache: empty blob file left for the next open");
        }
        st.dirty_dirs[usize::from(blob.0[0])] = true;
    }

    /// Punch out up to `len` bytes of chunk `id`'s range.
    fn punch(&self, id: &ChunkId, len: u64) -> Result<()> {
        let Some(file) = self.open_blob(&id.blob, false)? else {
            return Ok(());
        };
        let at = chunk_offset(id.index, id.shift).unwrap_or(u64::MAX);
        punch_range(&file, at, len)
            .map_err(|e| Error::io("punch chunk", self.blob_path(&id.blob), e))
    }

    /// Evict until the filesystem has room for `size` bytes plus the reserve.
    fn make_room_on_disk(&self, size: u64) -> Result<()> {
        let want = size + self.reserve;
        let Some(free) = free_bytes(&self.blobs).filter(|f| *f < want) else {
            return Ok(());
        };
        let victims = self.lock().doom_lru(want - free);
        self.discard(victims, Some(EVICTIONS))
    }

    /// Write the chunk's bytes in place and make them durable, evicting and retrying once on
    /// `ENOSPC`; on failure what was written is punched out again.
    fn store_chunk(&self, id: &ChunkId, data: &[u8]) -> Result<()> {
        let mut retried = false;
        loop {
            let e = match self.write_chunk(id, data) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    if let Err(e) = self.punch(id, data.len() as u64) {
                        tracing::warn!(error = %e, "chunk cache: partial chunk left for the next open");
                    }
                    if !is_nospace(&e) {
                        return Err(Error::io("write chunk", self.blob_path(&id.blob), e));
                    }
                    e
                }
            };
            let (victims, bytes) = {
                let mut st = self.lock();
                st.count(ENOSPC, 1);
                let victims = st.doom_lru(if retried { 0 } else { ENOSPC_EVICT });
                (victims, st.present)
            };
            if retried {
                return Err(Error::Cache {
                    path: self.dir.clone(),
                    message: format!(
                        "no space left on device for chunk {} of blob {} ({} bytes), even after \
                         evicting; the cache holds {bytes} bytes: {e}",
                        id.index,
                        id.blob,
                        data.len()
                    ),
                    source: Some(Box::new(e)),
                });
            }
            tracing::warn!(error = %e, evicting = victims.len(), "chunk cache: disk full");
            self.discard(victims, Some(EVICTIONS))?;
            retried = true;
        }
    }

    fn write_chunk(&self, id: &ChunkId, data: &[u8]) -> io::Result<()> {
        // Made durable by the caller, with the rest of its batch (`batch.rs`).
        if let Some(written) = self.write_direct(id, &[data]) {
            return written;
        }
        let file = self.blob_file_for_write(&id.blob)?;
        let at = chunk_offset(id.index, id.shift).unwrap_or(u64::MAX);
        file.write_all_at(data, at)
    }

    /// `blob`'s file, created if missing and kept open (buffered), for a chunk's write: an
    /// I/O error keeps its OS error (a full disk is told apart by it, `store_chunk`).
    fn blob_file_for_write(&self, blob: &Digest) -> io::Result<Arc<File>> {
        match self.open_blob(blob, true) {
            Ok(Some(f)) => Ok(f),
            Ok(None) => Err(io::Error::from(io::ErrorKind::NotFound)),
            Err(Error::Io { source, .. }) => Err(source),
            Err(e) => Err(io::Error::other(e)),
        }
    }

    /// Write the recency of the chunks hit since last time. With `wait == false`, skip if
    /// another thread is writing the index.
    fn persist_recency(&self, wait: bool) -> Result<()> {
        let index = match self.index_lock.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) if !wait => return Ok(()),
            Err(TryLockError::WouldBlock) => self
                .index_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        };
        let updates: Vec<(ChunkId, Entry)> = {
            let mut st = self.lock();
            let dirty = std::mem::take(&mut st.dirty);
            (dirty.into_iter())
                .filter_map(|id| st.lru.peek(&id).map(|e| (id, *e)))
                .collect()
        };
        if updates.is_empty() {
            return Ok(());
        }
        let put_all = |b: &mut WriteBatch| {
            for (id, entry) in &updates {
                b.put(chunk_key(id), encode_entry(*entry, id.shift));
            }
        };
        (self.write_index_locked(&index, put_all, "cannot write recency to the index"))
            .map_err(|(e, _)| e)
    }

    fn write_index(&self, fill: impl FnOnce(&mut WriteBatch), what: &str) -> IndexResult {
        let index = self
            .index_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.write_index_locked(&index, fill, what)
    }

    /// One index write, only if there is room for it (module docs, "A full disk"); it also
    /// deletes the stale entries of chunks that are neither cached nor in flight.
    fn write_index_locked(
        &self,
        _index: &MutexGuard<'_, ()>,
        fill: impl FnOnce(&mut WriteBatch),
        what: &str,
    ) -> IndexResult {
        self.index_room().map_err(|e| (e, true))?;
        let mut batch = WriteBatch::default();
        fill(&mut batch);
        {
            let mut st = self.lock();
            let stale = std::mem::take(&mut st.stale);
            for id in stale {
                // The key has no shift: it is also the key of the chunk at the same index
                // under the blob's shift now, if that one is cached or being put.
                let now = (st.per_blob.get(&id.blob)).map_or(id, |r| ChunkId {
                    shift: r.shift,
                    ..id
                });
                let live = |c: &ChunkId| st.lru.contains(c) || st.inflight.contains(c);
                if !live(&id) && !live(&now) {
                    batch.delete(chunk_key(&id));
                    batch.delete(sums_key(&id));
                }
            }
        }
        self.db.write(batch).map_err(|e| {
            if is_rocks_nospace(&e) {
                self.lock().count(ENOSPC, 1);
                tracing::error!(error = %e, "chunk cache: RocksDB met a full disk");
            }
            (self.rocks_error(what, e), false)
        })
    }

    /// Whether the index may be written: half the reserve is free.
    fn index_room(&self) -> Result<()> {
        match free_bytes(&self.index_dir) {
            Some(free) if free < self.reserve / 2 => {
                self.lock().count(ENOSPC, 1);
                Err(self.error(format!(
                    "no space left on device for the index: {free} bytes free, {} kept for it",
                    self.reserve / 2
                )))
            }
            _ => Ok(()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No panics happen under this lock, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn error(&self, message: String) -> Error {
        Error::Cache {
            path: self.dir.clone(),
            message,
            source: None,
        }
    }

    fn rocks_error(&self, what: &str, e: rocksdb::Error) -> Error {
        rocks_error(&self.index_dir, what, e)
    }
}

impl Drop for DiskCache {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!(dir = %self.dir.display(), error = %e, "chunk cache: flush on close failed");
        }
    }
}

/// Releases the reservation of a put that did not finish.
struct PendingGuard<'a> {
    cache: &'a DiskCache,
    id: ChunkId,
    size: u64,
    done: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut st = self.cache.lock();
            st.inflight.remove(&self.id);
            st.pending -= self.size;
            self.cache.drop_blob_ref(&mut st, &self.id.blob);
        }
    }
}
