//! Level 2 of the chunk cache: whole chunks as files on local disk, bounded in bytes, evicted
//! least recently used first, indexed in RocksDB so that the cache survives a restart.
//!
//! A chunk enters this level only after the cache verified it against its blake3 digest. On
//! disk, every 4 KiB block of it is covered by a crc32c computed from those verified bytes
//! (the file's trailer), so that a hit can read and check just the blocks it needs
//! ([`DiskCache::read_range`]) instead of reading and re-hashing the whole chunk. A block whose
//! bytes no longer match is reported as [`RangeRead::Corrupt`]; the caller drops the chunk
//! ([`DiskCache::drop_corrupt`]) and refetches it: bad bytes are never served. [`DiskCache::get`]
//! returns a whole chunk unchecked, for callers that verify it themselves.
//!
//! # On-disk layout
//! ```text
//! <dir>/chunks/<hh>/<blob hex>.<index>                  one chunk: its bytes, then the trailer
//! <dir>/chunks/<hh>/.tmp.<blob hex>.<index>.<pid>.<n>    a chunk being written; never indexed
//! <dir>/index/                                          RocksDB (its own files only)
//! ```
//! `<hh>` is the first two hex digits of the blob digest (256 shard directories, created at
//! open); `<index>` is the chunk index in decimal. A final name is only ever created by
//! `rename` of a temporary file that was completely written and `fdatasync`ed, so a final name
//! always holds a whole chunk. Files are never modified in place.
//!
//! The trailer holds one crc32c (Castagnoli, u32 LE) per 4 KiB block of the chunk, the last
//! block possibly short: a chunk of `size` bytes has a file of `size + 4 × ceil(size / 4096)`
//! bytes (a 256 KiB chunk: 256 bytes of trailer).
//!
//! # Index encoding (RocksDB keys and values)
//! | key | value |
//! | --- | --- |
//! | `b'c'` + blob digest (32 bytes) + chunk index (u64 BE): 41 bytes | `[1][size: u32 LE][seq: u64 LE]`: 13 bytes |
//! | `b"m/format"` | `b"strata-chunk-index v2"` (v2: chunk files carry a crc32c trailer); any other value refuses to open |
//! | `b"m/counters"` | `[1]` + evictions, dropped_corrupt, enospc, recovered_orphans (u64 LE each): 33 bytes |
//!
//! `size` is the chunk's length (at most [`CHUNK_SIZE`]); `seq` its recency: a counter taken on
//! every put and hit, so that sorting by `seq` gives the LRU order. A key or value that does not
//! decode is treated as absent and deleted at open, never a panic.
//!
//! # Ordering, and why a crash cannot make the index lie
//! - **put**: evict LRU chunks until `bytes + in flight + size <= capacity` → write `.tmp.*` →
//!   `fdatasync` → `rename` to the final name → put the index entry. The entry is written only
//!   once the file is durable under its final name, so a `kill -9` at any point leaves no entry
//!   (the file, if any, is an orphan removed at the next open) or an entry for a whole file.
//! - **evict / remove**: delete the index entry, then unlink the file; a crash in between leaves
//!   an orphan file, removed at the next open. (When the index may not be written for lack of
//!   space, see below, the file goes first and the entry is deleted with the next index write
//!   or dropped at the next open because its file is missing.)
//! - Index writes are not synced one by one: RocksDB's WAL reaches the OS on every write, so a
//!   killed process loses nothing. After a power loss the index may be older or newer than the
//!   directories; [`DiskCache::open`] checks every entry against its file's size, so neither
//!   case makes it serve a missing or torn chunk. [`DiskCache::flush`] (also run on drop)
//!   writes recency and counters, `fsync`s the shard directories touched since the last flush,
//!   then syncs the WAL.
//!
//! # Recovery on open
//! RocksDB's lock makes a directory single-owner. Every entry is decoded and its file
//! `stat`ed; entries that do not decode or whose file is missing (`recovered_orphans`) or has
//! another size (`dropped_corrupt`, file unlinked) are deleted. The rest are loaded into the
//! in-memory LRU in `seq` order. Every file in the shard directories that is not an indexed
//! chunk (temporary files, orphans of a crash) is deleted (`recovered_orphans`). If the
//! capacity shrank, LRU chunks are evicted until usage fits.
//!
//! # Concurrency and cost
//! One mutex guards the in-memory state (an `LruCache` plus the chunks in flight) and is never
//! held across I/O; a second one serializes index writes, so that a batch of recency updates
//! cannot re-create an entry evicted meanwhile. A hit is a lookup and list move under the mutex,
//! then `open` + `fstat` + `pread`. Recency is written to the index in batches of
//! [`RECENCY_BATCH`] hits (and on flush); losing it in a crash only makes the LRU order stale.
//! A chunk being put or removed is in flight: a second put of it returns at once, and it is not
//! evicted meanwhile. Indexed bytes plus bytes reserved by puts in flight never exceed the
//! capacity; files on disk exceed it at most by the chunks being written at that moment.
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
//!   that cannot write the index unlinks the files anyway (see the ordering above).
//! - a chunk write that fails with `ENOSPC`/`EDQUOT` removes its temporary file, evicts a batch
//!   of LRU chunks and retries once; a second failure is an [`Error::Cache`] saying "no space
//!   left on device". No partial file and no entry remain.
//!
//! [`DiskCache::open`] refuses (the same error) when less than half the reserve is free. What is
//! left is a race with another process that fills the disk between the check and RocksDB's
//! write; the space RocksDB preallocates for its files (`fallocate`) narrows it.

use std::collections::HashSet;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};

use bytes::Bytes;
use lru::LruCache;
use rocksdb::{IteratorMode, WriteBatch, DB};
use serde::{Deserialize, Serialize};

use super::{ChunkId, CHUNK_SIZE};
use crate::error::{Error, Result};
use crate::store::Digest;

/// Hits whose recency is written to the index in one batch.
pub const RECENCY_BATCH: usize = 1024;

const CHUNK_KEY_TAG: u8 = b'c';
const CHUNK_KEY_LEN: usize = 1 + 32 + 8;
const ENTRY_VERSION: u8 = 1;
const ENTRY_LEN: usize = 1 + 4 + 8;
const META_PREFIX: &[u8] = b"m/";
const META_FORMAT: &[u8] = b"m/format";
const FORMAT: &[u8] = b"strata-chunk-index v2";
const META_COUNTERS: &[u8] = b"m/counters";
const COUNTERS_VERSION: u8 = 1;
const COUNTERS_LEN: usize = 1 + 4 * 8;
const TMP_PREFIX: &str = ".tmp.";
/// Bytes evicted before the one retry of a chunk write that failed with `ENOSPC`.
const ENOSPC_EVICT: u64 = 4 * CHUNK_SIZE;
const MIB: u64 = 1 << 20;
/// The unit of the crc32c trailer.
pub const CHECK_BLOCK: u64 = 4096;

/// Bytes of the crc32c trailer of a chunk of `size` bytes.
fn trailer_len(size: u64) -> u64 {
    4 * size.div_ceil(CHECK_BLOCK)
}

/// Bytes of the file of a chunk of `size` bytes.
fn file_len(size: u64) -> u64 {
    size + trailer_len(size)
}

/// The crc32c trailer of `data`.
fn trailer(data: &[u8]) -> Vec<u8> {
    data.chunks(CHECK_BLOCK as usize)
        .flat_map(|b| crc32c::crc32c(b).to_le_bytes())
        .collect()
}

/// The outcome of [`DiskCache::read_range`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RangeRead {
    /// The bytes asked for, each block checked against its crc32c.
    Hit(Bytes),
    /// Not cached (or its file vanished or had the wrong size: dropped).
    Absent,
    /// A block does not match its crc32c: the caller must drop the chunk and refetch it.
    Corrupt,
    /// Asked not to block, and the bytes are not all in the page cache.
    WouldBlock,
}

const _: () = assert!(CHUNK_KEY_LEN == 41);
const _: () = assert!(ENTRY_LEN == 13);
const _: () = assert!(COUNTERS_LEN == 33);
const _: () = assert!(CHUNK_SIZE <= u32::MAX as u64);

/// Where level 2 lives and how large it may grow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskCacheConfig {
    /// The cache directory (created if missing); it holds `chunks/` and `index/`.
    pub dir: PathBuf,
    /// The most bytes of chunk data kept (chunk files; the index is not counted).
    pub capacity: u64,
}

/// Counters of a [`DiskCache`]; the event counters are cumulative across restarts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DiskStats {
    /// Bytes of indexed chunks.
    pub bytes: u64,
    /// Indexed chunks.
    pub chunks: u64,
    /// The configured capacity in bytes.
    pub capacity: u64,
    /// Chunks evicted to stay under the capacity or to free disk space.
    pub evictions: u64,
    /// Chunks dropped because their file was bad: reported by the caller (digest mismatch),
    /// missing or of the wrong size on `get`, or of the wrong size at open.
    pub dropped_corrupt: u64,
    /// Times the disk was full: `ENOSPC`/`EDQUOT` on a chunk write, or an index write refused
    /// because less than the index's share of the reserve was free.
    pub enospc: u64,
    /// Cleaned up at open: temporary and unindexed chunk files, and index entries that do not
    /// decode or whose file is missing.
    pub recovered_orphans: u64,
}

/// Indexes into the event counters, in their order in `m/counters`.
const EVICTIONS: usize = 0;
const DROPPED_CORRUPT: usize = 1;
const ENOSPC: usize = 2;
const RECOVERED_ORPHANS: usize = 3;

/// An indexed chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    size: u32,
    seq: u64,
}

/// An index write's failure, and whether it was refused for lack of space (RocksDB untouched).
type IndexResult = Result<(), (Error, bool)>;

#[derive(Debug)]
struct State {
    /// Indexed chunks, most recently used first.
    lru: LruCache<ChunkId, Entry>,
    /// Chunks being put or removed.
    inflight: HashSet<ChunkId>,
    /// Bytes of the chunks in `lru`.
    present: u64,
    /// Bytes reserved by puts in flight.
    pending: u64,
    next_seq: u64,
    /// Chunks whose recency changed since it was last written to the index.
    dirty: HashSet<ChunkId>,
    /// Entries whose file was unlinked while the index could not be written.
    stale: Vec<ChunkId>,
    /// Shard directories with renames or unlinks not yet `fsync`ed.
    dirty_dirs: [bool; 256],
    counters: [u64; 4],
}

impl State {
    fn touch(&mut self, id: &ChunkId) -> Option<Entry> {
        let seq = self.next_seq;
        let entry = self.lru.get_mut(id)?;
        entry.seq = seq;
        let entry = *entry;
        self.next_seq += 1;
        self.dirty.insert(*id);
        Some(entry)
    }

    /// Take LRU chunks out until `bytes` are freed (or none is left); the caller removes them
    /// with [`DiskCache::discard`].
    fn doom_lru(&mut self, bytes: u64) -> Vec<(ChunkId, Entry)> {
        let mut freed = 0;
        let mut victims = Vec::new();
        while freed < bytes {
            let Some((id, entry)) = self.lru.pop_lru() else {
                break;
            };
            freed += file_len(u64::from(entry.size));
            victims.push(self.doom(id, entry));
        }
        victims
    }

    fn doom(&mut self, id: ChunkId, entry: Entry) -> (ChunkId, Entry) {
        self.present -= file_len(u64::from(entry.size));
        self.dirty.remove(&id);
        self.inflight.insert(id);
        (id, entry)
    }
}

/// Level 2 of the chunk cache. Blocking; `Send + Sync`; see the module docs.
pub struct DiskCache {
    dir: PathBuf,
    chunks: PathBuf,
    index_dir: PathBuf,
    capacity: u64,
    /// Free space kept on the filesystem (module docs, "A full disk").
    reserve: u64,
    db: DB,
    state: Mutex<State>,
    /// Held around every index write.
    index_lock: Mutex<()>,
    tmp_seq: AtomicU64,
    /// Chunk files kept open for ranged reads, with their crc32c trailers (see `read_range`).
    open_files: Mutex<LruCache<ChunkId, Arc<OpenChunk>>>,
}

/// An open chunk file and its trailer. A chunk's bytes never change (its blob is named by its
/// digest), so a descriptor that outlives an eviction still reads the right bytes; evictions
/// close it anyway so that no unlinked file keeps its space.
struct OpenChunk {
    file: File,
    sums: Vec<u8>,
}

/// Chunk files kept open at most.
const OPEN_FILES: usize = 256;

impl fmt::Debug for DiskCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskCache")
            .field("dir", &self.dir)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl DiskCache {
    /// Open (or create) the cache in `config.dir`, recovering from any crash (module docs).
    pub fn open(config: DiskCacheConfig) -> Result<Self> {
        let DiskCacheConfig { dir, capacity } = config;
        let chunks = dir.join("chunks");
        let index_dir = dir.join("index");
        for d in [&dir, &chunks, &index_dir] {
            fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
        }
        for d in (0..=255u8).map(|shard| chunks.join(hex::encode([shard]))) {
            fs::create_dir_all(&d).map_err(|e| Error::io("create directory", d, e))?;
        }
        sync_dir(&chunks)?;

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
        let db = DB::open(&opts, &index_dir).map_err(|e| {
            rocks_error(
                &index_dir,
                "cannot open the index (is another process using it?)",
                e,
            )
        })?;
        let counters = match db.get(META_COUNTERS) {
            Ok(v) => v.as_deref().and_then(decode_counters).unwrap_or_default(),
            Err(e) => return Err(rocks_error(&index_dir, "cannot read the index", e)),
        };
        let cache = DiskCache {
            dir,
            chunks,
            index_dir,
            capacity,
            reserve,
            db,
            state: Mutex::new(State {
                lru: LruCache::unbounded(),
                inflight: HashSet::new(),
                present: 0,
                pending: 0,
                next_seq: 0,
                dirty: HashSet::new(),
                stale: Vec::new(),
                dirty_dirs: [false; 256],
                counters,
            }),
            index_lock: Mutex::new(()),
            tmp_seq: AtomicU64::new(0),
            open_files: Mutex::new(LruCache::new(
                std::num::NonZeroUsize::new(OPEN_FILES).unwrap_or(std::num::NonZeroUsize::MIN),
            )),
        };
        cache.recover()?;
        Ok(cache)
    }

    /// Check the format, load the index, drop entries without a whole file, delete files
    /// without an entry, and evict down to the capacity.
    fn recover(&self) -> Result<()> {
        match self.db.get(META_FORMAT) {
            Ok(Some(v)) if v == FORMAT => {}
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
        let mut bad_keys = Vec::new();
        let mut bad_files = Vec::new();
        let (mut orphans, mut corrupt) = (0u64, 0u64);
        for item in self.db.full_iterator(IteratorMode::Start) {
            let (key, value) = item.map_err(|e| self.rocks_error("cannot read the index", e))?;
            if key.starts_with(META_PREFIX) {
                continue;
            }
            let (Some(id), Some(entry)) = (decode_key(&key), decode_entry(&value)) else {
                bad_keys.push(key);
                orphans += 1;
                continue;
            };
            let path = self.chunk_path(&id);
            match fs::symlink_metadata(&path) {
                Ok(m) if m.is_file() && m.len() == file_len(u64::from(entry.size)) => {
                    entries.push((id, entry))
                }
                Ok(m) => {
                    bad_keys.push(key);
                    corrupt += 1;
                    if m.is_file() {
                        bad_files.push(path);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    bad_keys.push(key);
                    orphans += 1;
                }
                Err(e) => return Err(Error::io("stat chunk", path, e)),
            }
        }
        if !bad_keys.is_empty() {
            let delete_all = |b: &mut WriteBatch| bad_keys.iter().for_each(|k| b.delete(k));
            (self.write_index(delete_all, "cannot clean the index")).map_err(|(e, _)| e)?;
            for path in &bad_files {
                remove_file(path)?;
            }
        }

        entries.sort_unstable_by_key(|(_, e)| e.seq);
        let victims = {
            let mut st = self.lock();
            for (id, entry) in entries {
                st.present += file_len(u64::from(entry.size));
                st.next_seq = st.next_seq.max(entry.seq + 1);
                st.lru.push(id, entry);
            }
            st.counters[RECOVERED_ORPHANS] += orphans;
            st.counters[DROPPED_CORRUPT] += corrupt;
            let over = st.present.saturating_sub(self.capacity);
            st.doom_lru(over)
        };
        self.discard(victims, Some(EVICTIONS))?;

        // Files without an entry: temporary files and orphans of a crash.
        let mut removed = 0;
        for shard in 0..=255u8 {
            let shard_hex = hex::encode([shard]);
            let shard_dir = self.chunks.join(&shard_hex);
            let listing = fs::read_dir(&shard_dir).map_err(|e| Error::io("list", &shard_dir, e))?;
            for dirent in listing {
                let dirent = dirent.map_err(|e| Error::io("list", &shard_dir, e))?;
                let indexed = (dirent.file_name().to_str())
                    .and_then(|name| parse_chunk_name(&shard_hex, name))
                    .is_some_and(|id| self.lock().lru.contains(&id));
                let path = dirent.path();
                if indexed {
                    continue;
                } else if dirent.file_type().is_ok_and(|t| t.is_dir()) {
                    tracing::warn!(path = %path.display(), "unexpected directory in the chunk cache; left alone");
                    continue;
                }
                remove_file(&path)?;
                removed += 1;
            }
        }
        self.lock().counters[RECOVERED_ORPHANS] += removed;
        if removed + orphans + corrupt > 0 {
            tracing::info!(dir = %self.dir.display(), removed_files = removed, dropped_entries = orphans + corrupt, "chunk cache recovered");
        }
        self.flush()
    }

    /// The chunk's bytes, or `None` if it is not cached; marks it recently used. The bytes are
    /// not verified here: the caller checks them and calls [`Self::drop_corrupt`] on a mismatch.
    /// A file that vanished or has the wrong size is dropped (`dropped_corrupt`): `None`.
    pub fn get(&self, id: &ChunkId) -> Result<Option<Bytes>> {
        let (entry, persist) = {
            let mut st = self.lock();
            let Some(entry) = st.touch(id) else {
                return Ok(None);
            };
            (entry, st.dirty.len() >= RECENCY_BATCH)
        };
        if persist {
            if let Err(e) = self.persist_recency(false) {
                tracing::debug!(error = %e, "chunk cache: recency not saved");
            }
        }
        let path = self.chunk_path(id);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.forget(id, Some(entry.seq), Some(DROPPED_CORRUPT))?;
                return Ok(None);
            }
            Err(e) => return Err(Error::io("open chunk", path, e)),
        };
        let len = (file.metadata())
            .map_err(|e| Error::io("stat chunk", &path, e))?
            .len();
        let size = entry.size as usize;
        let len = if len == file_len(size as u64) {
            size as u64
        } else {
            u64::MAX
        };
        let mut buf = Vec::with_capacity(size);
        while len == size as u64 && buf.len() < size {
            let offset = buf.len() as u64;
            match rustix::io::pread(&file, rustix::buffer::spare_capacity(&mut buf), offset) {
                Ok(0) => break,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::io("read chunk", path, e.into())),
            }
        }
        if buf.len() != size || len != size as u64 {
            self.forget(id, Some(entry.seq), Some(DROPPED_CORRUPT))?;
            return Ok(None);
        }
        Ok(Some(Bytes::from(buf)))
    }

    /// Bytes `range` of a cached chunk, reading and checking (crc32c) only the 4 KiB blocks
    /// that cover it; marks the chunk recently used. With `nowait`, the reads do not wait for
    /// the disk (`RWF_NOWAIT`): bytes that are not in the page cache give
    /// [`RangeRead::WouldBlock`], and the caller retries on a thread that may block.
    pub fn read_range(
        &self,
        id: &ChunkId,
        range: std::ops::Range<u64>,
        nowait: bool,
    ) -> Result<RangeRead> {
        let entry = {
            let mut st = self.lock();
            match st.touch(id) {
                Some(e) => e,
                None => return Ok(RangeRead::Absent),
            }
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
        let path = self.chunk_path(id);
        let flags = if nowait {
            rustix::io::ReadWriteFlags::NOWAIT
        } else {
            rustix::io::ReadWriteFlags::empty()
        };
        let cached = (self
            .open_files
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
        .get(id)
        .cloned();
        let chunk = match cached {
            Some(c) => c,
            None => {
                let file = match File::open(&path) {
                    Ok(f) => f,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        self.forget(id, Some(entry.seq), Some(DROPPED_CORRUPT))?;
                        return Ok(RangeRead::Absent);
                    }
                    Err(e) => return Err(Error::io("open chunk", path, e)),
                };
                let len = file
                    .metadata()
                    .map_err(|e| Error::io("stat chunk", &path, e))?
                    .len();
                if len != file_len(size) {
                    self.forget(id, Some(entry.seq), Some(DROPPED_CORRUPT))?;
                    return Ok(RangeRead::Absent);
                }
                let mut sums = vec![0u8; trailer_len(size) as usize];
                match read_exact_flags(&file, &mut sums, size, flags) {
                    Ok(true) => {}
                    Ok(false) => return Ok(RangeRead::WouldBlock),
                    Err(e) => return Err(Error::io("read chunk", &path, e)),
                }
                let chunk = Arc::new(OpenChunk { file, sums });
                (self
                    .open_files
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner))
                .put(*id, chunk.clone());
                chunk
            }
        };
        let first = range.start / CHECK_BLOCK;
        let last = range.end.div_ceil(CHECK_BLOCK);
        let data_at = first * CHECK_BLOCK;
        let data_len = (last * CHECK_BLOCK).min(size) - data_at;
        let mut data = vec![0u8; data_len as usize];
        match read_exact_flags(&chunk.file, &mut data, data_at, flags) {
            Ok(true) => {}
            Ok(false) => return Ok(RangeRead::WouldBlock),
            Err(e) => return Err(Error::io("read chunk", &path, e)),
        }
        let sums = &chunk.sums[4 * first as usize..4 * last as usize];
        for (block, sum) in data.chunks(CHECK_BLOCK as usize).zip(sums.chunks_exact(4)) {
            if crc32c::crc32c(block).to_le_bytes() != sum {
                return Ok(RangeRead::Corrupt);
            }
        }
        let data = Bytes::from(data);
        Ok(RangeRead::Hit(data.slice(
            (range.start - data_at) as usize..(range.end - data_at) as usize,
        )))
    }

    /// Cache a chunk: durable on disk before it is indexed; LRU chunks are evicted first so that
    /// usage stays within the capacity. A chunk already cached (or being put) is only marked
    /// used; one that cannot fit (more than the capacity left by puts in flight) is not cached.
    /// Chunks larger than [`CHUNK_SIZE`] are refused.
    pub fn put(&self, id: &ChunkId, data: &[u8]) -> Result<()> {
        let size = data.len() as u64;
        if size > CHUNK_SIZE {
            return Err(self.error(format!(
                "chunk {} of blob {} is {size} bytes, more than the chunk size {CHUNK_SIZE}",
                id.index, id.blob
            )));
        }
        // What the chunk costs on disk: its bytes and its crc32c trailer.
        let cost = file_len(size);
        let victims = {
            let mut st = self.lock();
            if st.touch(id).is_some() || st.inflight.contains(id) {
                return Ok(());
            }
            if st.pending + cost > self.capacity {
                return Ok(());
            }
            let over = (st.present + st.pending + cost).saturating_sub(self.capacity);
            let victims = st.doom_lru(over);
            st.inflight.insert(*id);
            st.pending += cost;
            victims
        };
        let mut pending = PendingGuard {
            cache: self,
            id: *id,
            size: cost,
            done: false,
        };
        self.discard(victims, Some(EVICTIONS))?;
        self.make_room_on_disk(cost)?;
        let path = self.store_file(id, data)?;

        let entry = {
            let mut st = self.lock();
            st.next_seq += 1;
            Entry {
                size: size as u32,
                seq: st.next_seq - 1,
            }
        };
        let indexed = self.write_index(
            |b| b.put(chunk_key(id), encode_entry(entry)),
            "cannot index a chunk; it was not cached",
        );
        if let Err(e) = indexed {
            if let Err(e) = remove_file(&path) {
                tracing::warn!(error = %e, "chunk cache: unindexed chunk file left for the next open");
            }
            return Err(e.0);
        }
        pending.done = true;
        let mut st = self.lock();
        st.inflight.remove(id);
        st.pending -= cost;
        st.present += cost;
        st.lru.push(*id, entry);
        st.dirty_dirs[usize::from(id.blob.0[0])] = true;
        Ok(())
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
        }
    }

    /// Persist recency and counters, make renames and unlinks durable, and sync the index.
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
            sync_dir(&self.chunks.join(hex::encode([shard as u8])))?;
        }
        let _index = self
            .index_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.index_room()?;
        (self.db.flush_wal(true)).map_err(|e| self.rocks_error("cannot sync the index", e))
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

    /// Remove doomed chunks: index entries first, then the files (module docs).
    fn discard(&self, victims: Vec<(ChunkId, Entry)>, counter: Option<usize>) -> Result<()> {
        if victims.is_empty() {
            return Ok(());
        }
        let delete_all =
            |b: &mut WriteBatch| victims.iter().for_each(|(id, _)| b.delete(chunk_key(id)));
        let stale = match self.write_index(delete_all, "cannot remove chunks from the index") {
            Ok(()) => false,
            Err((e, true)) => {
                tracing::warn!(error = %e, "chunk cache: evicting files before their index entries");
                true
            }
            Err((e, false)) => {
                // Nothing was removed: put the chunks back, least recently used last.
                let mut st = self.lock();
                for (id, entry) in victims.iter().rev() {
                    st.inflight.remove(id);
                    st.present += file_len(u64::from(entry.size));
                    st.lru.push(*id, *entry);
                    st.lru.demote(id);
                }
                return Err(e);
            }
        };
        {
            let mut open = self
                .open_files
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (id, _) in &victims {
                open.pop(id);
            }
        }
        for (id, _) in &victims {
            if let Err(e) = remove_file(&self.chunk_path(id)) {
                tracing::warn!(error = %e, "chunk cache: evicted chunk file left for the next open");
            }
        }
        let n = victims.len() as u64;
        let mut st = self.lock();
        for (id, _) in &victims {
            st.inflight.remove(id);
            st.dirty_dirs[usize::from(id.blob.0[0])] = true;
            if stale {
                st.stale.push(*id);
            }
        }
        if let Some(c) = counter {
            st.counters[c] += n;
        }
        Ok(())
    }

    /// Evict until the filesystem has room for `size` bytes plus the reserve.
    fn make_room_on_disk(&self, size: u64) -> Result<()> {
        let want = size + self.reserve;
        let Some(free) = free_bytes(&self.chunks).filter(|f| *f < want) else {
            return Ok(());
        };
        let victims = self.lock().doom_lru(want - free);
        self.discard(victims, Some(EVICTIONS))
    }

    /// Write the chunk file under its final name, evicting and retrying once on `ENOSPC`.
    fn store_file(&self, id: &ChunkId, data: &[u8]) -> Result<PathBuf> {
        let mut retried = false;
        loop {
            let e = match self.write_file(id, data) {
                Ok(path) => return Ok(path),
                Err((path, e)) if !is_nospace(&e) => return Err(Error::io("write chunk", path, e)),
                Err((_, e)) => e,
            };
            let (victims, bytes) = {
                let mut st = self.lock();
                st.counters[ENOSPC] += 1;
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

    /// Temporary file → write → fdatasync → rename. On failure the temporary file is removed.
    fn write_file(&self, id: &ChunkId, data: &[u8]) -> Result<PathBuf, (PathBuf, io::Error)> {
        let path = self.chunk_path(id);
        let tmp = path.with_file_name(format!(
            "{TMP_PREFIX}{}.{}.{}.{}",
            id.blob,
            id.index,
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (OpenOptions::new().write(true).create_new(true).mode(0o644))
            .open(&tmp)
            .and_then(|file| {
                file.write_all_at(data, 0)?;
                file.write_all_at(&trailer(data), data.len() as u64)?;
                file.sync_data()?;
                // The pages are clean now; do not let them crowd out level 1 and hot files.
                let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed);
                fs::rename(&tmp, &path)
            });
        match written {
            Ok(()) => Ok(path),
            Err(e) => {
                if let Err(e) = remove_file(&tmp) {
                    tracing::warn!(error = %e, "chunk cache: temporary file left for the next open");
                }
                Err((tmp, e))
            }
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
                b.put(chunk_key(id), encode_entry(*entry));
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
                if !st.lru.contains(&id) && !st.inflight.contains(&id) {
                    batch.delete(chunk_key(&id));
                }
            }
        }
        self.db.write(batch).map_err(|e| {
            if is_rocks_nospace(&e) {
                self.lock().counters[ENOSPC] += 1;
                tracing::error!(error = %e, "chunk cache: RocksDB met a full disk");
            }
            (self.rocks_error(what, e), false)
        })
    }

    /// Whether the index may be written: half the reserve is free.
    fn index_room(&self) -> Result<()> {
        match free_bytes(&self.index_dir) {
            Some(free) if free < self.reserve / 2 => {
                self.lock().counters[ENOSPC] += 1;
                Err(self.error(format!(
                    "no space left on device for the index: {free} bytes free, {} kept for it",
                    self.reserve / 2
                )))
            }
            _ => Ok(()),
        }
    }

    fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        let hex = id.blob.to_hex();
        self.chunks
            .join(&hex[..2])
            .join(format!("{hex}.{}", id.index))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No I/O and no panics happen under this lock, so a poisoned state is still consistent.
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
        }
    }
}

fn chunk_key(id: &ChunkId) -> [u8; CHUNK_KEY_LEN] {
    let mut key = [0u8; CHUNK_KEY_LEN];
    key[0] = CHUNK_KEY_TAG;
    key[1..33].copy_from_slice(&id.blob.0);
    key[33..].copy_from_slice(&id.index.to_be_bytes());
    key
}

fn decode_key(key: &[u8]) -> Option<ChunkId> {
    let key: &[u8; CHUNK_KEY_LEN] = key.try_into().ok()?;
    (key[0] == CHUNK_KEY_TAG).then_some(())?;
    Some(ChunkId {
        blob: Digest(key[1..33].try_into().ok()?),
        index: u64::from_be_bytes(key[33..].try_into().ok()?),
    })
}

fn encode_entry(entry: Entry) -> [u8; ENTRY_LEN] {
    let mut v = [0u8; ENTRY_LEN];
    v[0] = ENTRY_VERSION;
    v[1..5].copy_from_slice(&entry.size.to_le_bytes());
    v[5..].copy_from_slice(&entry.seq.to_le_bytes());
    v
}

fn decode_entry(v: &[u8]) -> Option<Entry> {
    let v: &[u8; ENTRY_LEN] = v.try_into().ok()?;
    let size = u32::from_le_bytes(v[1..5].try_into().ok()?);
    (v[0] == ENTRY_VERSION && u64::from(size) <= CHUNK_SIZE).then_some(())?;
    Some(Entry {
        size,
        seq: u64::from_le_bytes(v[5..].try_into().ok()?),
    })
}

fn encode_counters(c: &[u64; 4]) -> [u8; COUNTERS_LEN] {
    let mut v = [COUNTERS_VERSION; COUNTERS_LEN];
    for (slot, n) in v[1..].chunks_exact_mut(8).zip(c) {
        slot.copy_from_slice(&n.to_le_bytes());
    }
    v
}

fn decode_counters(v: &[u8]) -> Option<[u64; 4]> {
    let v: &[u8; COUNTERS_LEN] = v.try_into().ok()?;
    let mut c = [0u64; 4];
    for (n, slot) in c.iter_mut().zip(v[1..].chunks_exact(8)) {
        *n = u64::from_le_bytes(slot.try_into().ok()?);
    }
    (v[0] == COUNTERS_VERSION).then_some(c)
}

/// `<blob hex>.<index>` in shard directory `shard`, exactly as [`DiskCache`] names it.
fn parse_chunk_name(shard: &str, name: &str) -> Option<ChunkId> {
    let (hex, index) = name.split_once('.')?;
    let id = ChunkId {
        blob: Digest::from_str(hex).ok()?,
        index: index.parse().ok()?,
    };
    (hex.starts_with(shard) && id.index.to_string() == index).then_some(id)
}

fn remove_file(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io("remove", path, e)),
        _ => Ok(()),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    (File::open(dir).and_then(|d| d.sync_all())).map_err(|e| Error::io("fsync directory", dir, e))
}

/// Bytes available on the filesystem holding `path`; `None` if `statvfs` fails.
fn free_bytes(path: &Path) -> Option<u64> {
    let vfs = rustix::fs::statvfs(path).ok()?;
    Some(vfs.f_bavail.saturating_mul(vfs.f_frsize))
}

fn is_nospace(e: &io::Error) -> bool {
    let code = e.raw_os_error();
    code == Some(rustix::io::Errno::NOSPC.raw_os_error())
        || code == Some(rustix::io::Errno::DQUOT.raw_os_error())
}

fn is_rocks_nospace(e: &rocksdb::Error) -> bool {
    let s = e.as_ref();
    s.contains("No space left") || s.contains("Disk quota") || s.contains("NoSpace")
}

fn rocks_error(index_dir: &Path, what: &str, e: rocksdb::Error) -> Error {
    Error::Cache {
        path: index_dir.to_path_buf(),
        message: format!("{what}: {e}"),
        source: Some(Box::new(e)),
    }
}

/// Fill `buf` from `file` at `at`. `Ok(false)`: with `RWF_NOWAIT`, not all of it was in the
/// page cache (nothing is lost; read again without the flag).
fn read_exact_flags(
    file: &File,
    buf: &mut [u8],
    mut at: u64,
    flags: rustix::io::ReadWriteFlags,
) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        let mut slices = [io::IoSliceMut::new(&mut buf[done..])];
        match rustix::io::preadv2(file, &mut slices, at, flags) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "chunk file shorter than its index entry",
                ))
            }
            Ok(n) => {
                done += n;
                at += n as u64;
            }
            Err(rustix::io::Errno::AGAIN) if flags.contains(rustix::io::ReadWriteFlags::NOWAIT) => {
                return Ok(false)
            }
            Err(rustix::io::Errno::OPNOTSUPP)
                if flags.contains(rustix::io::ReadWriteFlags::NOWAIT) =>
            {
                return Ok(false)
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Decoders of the index's keys and values, exposed for the fuzz target (`fuzz/`): they must
/// reject any malformed input without panicking.
#[doc(hidden)]
pub fn fuzz_decode_index(key: &[u8], value: &[u8]) {
    if let Some(id) = decode_key(key) {
        assert_eq!(chunk_key(&id)[..], key[..]);
    }
    if let Some(entry) = decode_entry(value) {
        assert_eq!(encode_entry(entry)[..], value[..]);
    }
    if let Some(c) = decode_counters(value) {
        assert_eq!(encode_counters(&c)[..], value[..]);
    }
}
