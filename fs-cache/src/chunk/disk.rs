//! Level 2 of the chunk cache: whole chunks as files on local disk, bounded in bytes, evicted
//! least recently used first, indexed in RocksDB so that the cache survives a restart.
//!
//! This level stores bytes; it does not judge them. The caller verifies every chunk that
//! [`DiskCache::get`] returns against its digest and calls [`DiskCache::drop_corrupt`] on a
//! mismatch, so a chunk file whose bytes went bad is dropped and refetched, never served.
//!
//! # On-disk layout
//! ```text
//! <dir>/chunks/<hh>/<blob hex>.<index>       one chunk, exactly its bytes (0 ..= CHUNK_SIZE)
//! <dir>/chunks/<hh>/.tmp.<blob hex>.<index>.<pid>.<n>   a chunk being written (never indexed)
//! <dir>/index/                                RocksDB: the index (RocksDB's own files only)
//! ```
//! `<hh>` is the first two hex digits of the blob digest (256 shard directories, all created at
//! open); `<index>` is the chunk index in decimal. A file under a final name is only ever
//! created by `rename` of a temporary file that was completely written and `fdatasync`ed, so a
//! final name always holds a whole chunk. Files are never modified in place.
//!
//! # Index (RocksDB) encoding
//! | key | bytes | value |
//! | --- | --- | --- |
//! | `b'c'` + blob digest (32) + index (u64 BE) | 41 | `[version = 1][size: u32 LE][seq: u64 LE]`, 13 bytes |
//! | `b"m/format"` | 8 | `b"strata-chunk-index v1"`; another value refuses to open |
//! | `b"m/counters"` | 10 | `[version = 1]` + evictions, dropped_corrupt, enospc, recovered_orphans (u64 LE each), 33 bytes |
//!
//! A chunk key exists only while its file is complete and present (see below). `size` is the
//! chunk's length; `seq` is its recency: a counter bumped on every put and hit, so that sorting
//! by `seq` gives the LRU order. An entry that does not decode (wrong length, version, a size
//! over [`CHUNK_SIZE`]) is treated as absent and deleted at open, never a panic.
//!
//! # Ordering, and why a crash cannot make the index lie
//! - **put**: evict LRU chunks until `bytes + in-flight + size <= capacity` → write
//!   `.tmp.*` → `fdatasync` → `rename` to the final name → put the index entry. The entry is
//!   written only after the file is durable and under its final name, so a `kill -9` at any
//!   point leaves either no entry (the file, if any, is an orphan removed at the next open) or
//!   an entry for a whole file.
//! - **evict / remove**: delete the index entry first, then unlink the file. A crash in between
//!   leaves an orphan file, removed at the next open.
//! - Index writes are not `fsync`ed one by one (RocksDB's WAL reaches the OS on every write, so
//!   a killed process loses nothing). After a power loss the index may be older or newer than
//!   the directory (a rename or unlink that did not reach the disk); [`DiskCache::open`] checks
//!   every entry against its file's size, so neither case makes it serve a missing or torn
//!   chunk. [`DiskCache::flush`] (also run on drop) persists recency and counters, `fsync`s the
//!   shard directories touched since the last flush, then syncs the WAL.
//!
//! # Recovery on open
//! The RocksDB lock makes a cache directory single-owner. Then: every chunk entry is decoded
//! and its file `stat`ed; entries that do not decode or whose file is missing
//! (`recovered_orphans`) or has another size (`dropped_corrupt`; the file is unlinked) are
//! deleted. The survivors are loaded into the in-memory LRU in `seq` order. Every file in the
//! shard directories that is not an indexed chunk (temporary files, orphans of a crash) is
//! deleted (`recovered_orphans`). If the capacity shrank, LRU chunks are evicted until usage
//! fits.
//!
//! # Concurrency and cost
//! One mutex guards the in-memory state (an `LruCache` plus the chunks being put or removed);
//! it is never held across I/O. A hit is a map lookup and list move under the mutex, then an
//! `open` + `fstat` + `pread` of the file. Recency changes are collected in memory and written
//! to the index in batches of [`RECENCY_BATCH`] (or on flush); losing them in a crash only
//! makes the LRU order slightly stale. A chunk being put or removed is in flight: a second put
//! of it returns at once (the first one will index it), and it is never evicted meanwhile.
//! `bytes` (indexed) plus the bytes reserved by puts in flight never exceed the capacity; the
//! files on disk may exceed it only by the chunks being written at that moment.
//!
//! # A full disk
//! Before writing, a put checks the filesystem's free space (`statvfs`) and evicts LRU chunks
//! until the chunk plus a reserve for the index (capacity / 64, clamped to 1..=64 MiB) fits;
//! this keeps RocksDB itself from running out of space. If a write still fails with `ENOSPC`
//! (someone else filled the disk), the temporary file is removed, a batch of LRU chunks is
//! evicted and the write retried once; a second failure returns [`Error::Cache`] saying "no
//! space left on device". Either way no partial file and no entry remain. Every `ENOSPC`
//! seen is counted in `enospc`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use bytes::Bytes;
use lru::LruCache;
use rocksdb::{IteratorMode, WriteBatch, DB};
use serde::{Deserialize, Serialize};

use super::{ChunkId, CHUNK_SIZE};
use crate::error::{BoxError, Error, Result};
use crate::store::Digest;

/// Hits whose recency is written to the index in one batch.
pub const RECENCY_BATCH: usize = 1024;

const CHUNK_KEY_TAG: u8 = b'c';
const CHUNK_KEY_LEN: usize = 1 + 32 + 8;
const ENTRY_VERSION: u8 = 1;
const ENTRY_LEN: usize = 1 + 4 + 8;
const META_FORMAT: &[u8] = b"m/format";
const FORMAT: &[u8] = b"strata-chunk-index v1";
const META_COUNTERS: &[u8] = b"m/counters";
const COUNTERS_VERSION: u8 = 1;
const COUNTERS_LEN: usize = 1 + 4 * 8;
const TMP_PREFIX: &str = ".tmp.";
/// Bytes evicted before the one retry of a write that failed with `ENOSPC`.
const ENOSPC_EVICT: u64 = 4 * CHUNK_SIZE;
const MIN_RESERVE: u64 = 1 << 20;
const MAX_RESERVE: u64 = 64 << 20;

const _: () = assert!(CHUNK_KEY_LEN == 41);
const _: () = assert!(ENTRY_LEN == 13);
const _: () = assert!(COUNTERS_LEN == 33);
const _: () = assert!(CHUNK_SIZE <= u32::MAX as u64);

/// Where level 2 lives and how large it may grow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskCacheConfig {
    /// The cache directory (created if missing); it holds `chunks/` and `index/`.
    pub dir: PathBuf,
    /// The most bytes of chunk data kept (files; the index is not counted).
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
    /// found with the wrong size or missing on `get`, or with the wrong size at open.
    pub dropped_corrupt: u64,
    /// `ENOSPC`/`EDQUOT` errors met while writing a chunk or the index.
    pub enospc: u64,
    /// Cleaned up at open: temporary and unindexed chunk files, and index entries that do not
    /// decode or whose file is missing.
    pub recovered_orphans: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    evictions: u64,
    dropped_corrupt: u64,
    enospc: u64,
    recovered_orphans: u64,
}

/// An indexed chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    size: u32,
    seq: u64,
}

/// A chunk in flight: being put (its bytes are reserved) or being removed.
#[derive(Debug)]
enum Inflight {
    Pending,
    Doomed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    Evicted,
    Corrupt,
    Removed,
}

#[derive(Debug)]
struct State {
    /// Indexed chunks, most recently used first.
    lru: LruCache<ChunkId, Entry>,
    inflight: HashMap<ChunkId, Inflight>,
    /// Bytes of the chunks in `lru`.
    present: u64,
    /// Bytes reserved by puts in flight.
    pending: u64,
    next_seq: u64,
    /// Chunks whose recency changed since it was last written to the index.
    dirty: HashSet<ChunkId>,
    /// Shard directories with renames or unlinks not yet `fsync`ed.
    dirty_dirs: [bool; 256],
    counters: Counters,
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

    /// Take LRU chunks out of the index's in-memory view until `bytes` are freed (or none is
    /// left); the caller removes them with [`DiskCache::discard`].
    fn doom_lru(&mut self, bytes: u64) -> Vec<(ChunkId, Entry)> {
        let mut freed = 0;
        let mut victims = Vec::new();
        while freed < bytes {
            let Some((id, entry)) = self.lru.pop_lru() else {
                break;
            };
            freed += u64::from(entry.size);
            victims.push(self.doom(id, entry));
        }
        victims
    }

    fn doom(&mut self, id: ChunkId, entry: Entry) -> (ChunkId, Entry) {
        self.present -= u64::from(entry.size);
        self.dirty.remove(&id);
        self.inflight.insert(id, Inflight::Doomed);
        (id, entry)
    }
}

/// Level 2 of the chunk cache. Blocking; `Send + Sync`; see the module docs.
pub struct DiskCache {
    dir: PathBuf,
    chunks: PathBuf,
    index_dir: PathBuf,
    capacity: u64,
    /// Free space kept on the filesystem for the index.
    reserve: u64,
    db: DB,
    state: Mutex<State>,
    /// Held while writing index entries derived from `state` (recency batches) and while
    /// deleting entries, so that a recency batch never re-creates an evicted entry.
    index_lock: Mutex<()>,
    tmp_seq: AtomicU64,
}

impl fmt::Debug for DiskCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskCache")
            .field("dir", &self.dir)
            .field("capacity", &self.capacity)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl DiskCache {
    /// Open (or create) the cache in `config.dir`, recovering from any crash (module docs).
    pub fn open(config: DiskCacheConfig) -> Result<Self> {
        let dir = config.dir;
        let chunks = dir.join("chunks");
        let index_dir = dir.join("index");
        for d in [&dir, &chunks, &index_dir] {
            fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
        }
        for shard in 0..=255u8 {
            let d = chunks.join(hex::encode([shard]));
            match fs::create_dir(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io("create directory", d, e)),
            }
        }
        sync_dir(&chunks)?;

        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.set_compression_type(rocksdb::DBCompressionType::None);
        opts.set_write_buffer_size(4 << 20);
        opts.set_max_total_wal_size(16 << 20);
        opts.set_log_level(rocksdb::LogLevel::Warn);
        opts.set_keep_log_file_num(2);
        opts.set_max_log_file_size(1 << 20);
        let db = DB::open(&opts, &index_dir).map_err(|e| {
            rocks_error(
                &index_dir,
                "cannot open the index (is another process using this cache?)",
                e,
            )
        })?;
        match db.get(META_FORMAT) {
            Ok(Some(v)) if v == FORMAT => {}
            Ok(Some(v)) => {
                return Err(Error::Cache {
                    path: index_dir,
                    message: format!(
                        "index format {:?} is not {:?}; move the directory away to start afresh",
                        String::from_utf8_lossy(&v),
                        String::from_utf8_lossy(FORMAT)
                    ),
                    source: None,
                })
            }
            Ok(None) => db
                .put(META_FORMAT, FORMAT)
                .map_err(|e| rocks_error(&index_dir, "cannot write the index", e))?,
            Err(e) => return Err(rocks_error(&index_dir, "cannot read the index", e)),
        }
        let counters = match db.get(META_COUNTERS) {
            Ok(v) => v.as_deref().and_then(decode_counters).unwrap_or_default(),
            Err(e) => return Err(rocks_error(&index_dir, "cannot read the index", e)),
        };

        let capacity = config.capacity;
        let cache = DiskCache {
            dir,
            chunks,
            index_dir,
            capacity,
            reserve: (capacity / 64).clamp(MIN_RESERVE, MAX_RESERVE),
            db,
            state: Mutex::new(State {
                lru: LruCache::unbounded(),
                inflight: HashMap::new(),
                present: 0,
                pending: 0,
                next_seq: 0,
                dirty: HashSet::new(),
                dirty_dirs: [false; 256],
                counters,
            }),
            index_lock: Mutex::new(()),
            tmp_seq: AtomicU64::new(0),
        };
        cache.recover()?;
        Ok(cache)
    }

    /// Load the index, drop entries without a whole file, delete files without an entry, and
    /// evict down to the capacity.
    fn recover(&self) -> Result<()> {
        let mut entries = Vec::new();
        let mut bad_keys = Vec::new();
        let mut bad_files = Vec::new();
        let (mut orphans, mut corrupt) = (0u64, 0u64);
        for item in self.db.full_iterator(IteratorMode::Start) {
            let (key, value) = item.map_err(|e| self.rocks_error("cannot read the index", e))?;
            if key.starts_with(b"m/") {
                continue;
            }
            let (Some(id), Some(entry)) = (decode_key(&key), decode_entry(&value)) else {
                bad_keys.push(key);
                orphans += 1;
                continue;
            };
            let path = self.chunk_path(&id);
            match fs::symlink_metadata(&path) {
                Ok(m) if m.is_file() && m.len() == u64::from(entry.size) => {
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
            let mut batch = WriteBatch::default();
            for key in &bad_keys {
                batch.delete(key);
            }
            self.db
                .write(batch)
                .map_err(|e| self.rocks_error("cannot clean the index", e))?;
            for path in &bad_files {
                remove_file(path)?;
            }
        }

        entries.sort_unstable_by_key(|(_, e)| e.seq);
        let victims = {
            let mut st = self.lock();
            for (id, entry) in entries {
                st.present += u64::from(entry.size);
                st.next_seq = st.next_seq.max(entry.seq + 1);
                st.lru.push(id, entry);
            }
            st.counters.recovered_orphans += orphans;
            st.counters.dropped_corrupt += corrupt;
            let over = st.present.saturating_sub(self.capacity);
            st.doom_lru(over)
        };
        self.discard(victims, Reason::Evicted)?;

        // Files without an entry: temporary files and orphans of a crash.
        let mut removed = 0;
        for shard in 0..=255u8 {
            let shard_hex = hex::encode([shard]);
            let shard_dir = self.chunks.join(&shard_hex);
            let listing = fs::read_dir(&shard_dir).map_err(|e| Error::io("list", &shard_dir, e))?;
            for dirent in listing {
                let dirent = dirent.map_err(|e| Error::io("list", &shard_dir, e))?;
                let name = dirent.file_name();
                let keep = name
                    .to_str()
                    .and_then(|n| parse_chunk_name(&shard_hex, n))
                    .is_some_and(|id| self.lock().lru.contains(&id));
                if keep {
                    continue;
                }
                let path = dirent.path();
                if dirent.file_type().is_ok_and(|t| t.is_dir()) {
                    tracing::warn!(path = %path.display(), "unexpected directory in the chunk cache; left alone");
                    continue;
                }
                remove_file(&path)?;
                removed += 1;
            }
        }
        self.lock().counters.recovered_orphans += removed;
        if removed + orphans + corrupt > 0 {
            tracing::info!(dir = %self.dir.display(), removed_files = removed, dropped_entries = orphans + corrupt, "chunk cache recovered");
        }
        self.flush()
    }

    /// The chunk's bytes, or `None` if it is not cached; marks it recently used. The bytes are
    /// not verified here: the caller checks them and calls [`Self::drop_corrupt`] on a mismatch.
    /// A file that vanished or has the wrong size is dropped (`dropped_corrupt`) and `None`
    /// returned.
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
                tracing::warn!(error = %e, "chunk cache: recency not saved");
            }
        }
        let path = self.chunk_path(id);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.forget(id, Some(entry.seq), Reason::Corrupt)?;
                return Ok(None);
            }
            Err(e) => return Err(Error::io("open chunk", path, e)),
        };
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat chunk", &path, e))?
            .len();
        let size = entry.size as usize;
        if len != size as u64 {
            self.forget(id, Some(entry.seq), Reason::Corrupt)?;
            return Ok(None);
        }
        let mut buf = Vec::with_capacity(size);
        while buf.len() < size {
            let offset = buf.len() as u64;
            match rustix::io::pread(&file, rustix::buffer::spare_capacity(&mut buf), offset) {
                Ok(0) => break,
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::io("read chunk", path, e.into())),
            }
        }
        if buf.len() != size {
            self.forget(id, Some(entry.seq), Reason::Corrupt)?;
            return Ok(None);
        }
        Ok(Some(Bytes::from(buf)))
    }

    /// Cache a chunk: durable on disk before it is indexed; LRU chunks are evicted first so
    /// that usage stays within the capacity. A chunk already cached (or being put) is only
    /// marked used; one that cannot fit (larger than the capacity left to puts in flight) is
    /// not cached. Chunks larger than [`CHUNK_SIZE`] are refused.
    pub fn put(&self, id: &ChunkId, data: &[u8]) -> Result<()> {
        let size = data.len() as u64;
        if size > CHUNK_SIZE {
            return Err(self.error(
                format!(
                    "chunk {} of blob {} is {size} bytes, more than the chunk size {CHUNK_SIZE}",
                    id.index, id.blob
                ),
                None,
            ));
        }
        let victims = {
            let mut st = self.lock();
            if st.touch(id).is_some() || st.inflight.contains_key(id) {
                return Ok(());
            }
            if st.pending + size > self.capacity {
                tracing::debug!(chunk = id.index, blob = %id.blob, "chunk cache full of puts in flight; not caching");
                return Ok(());
            }
            let over = (st.present + st.pending + size).saturating_sub(self.capacity);
            let victims = st.doom_lru(over);
            st.inflight.insert(*id, Inflight::Pending);
            st.pending += size;
            victims
        };
        let mut pending = PendingGuard {
            cache: self,
            id: *id,
            size,
            done: false,
        };
        self.discard(victims, Reason::Evicted)?;
        self.make_room_on_disk(size)?;
        let path = self.store_file(id, data)?;

        let entry = {
            let mut st = self.lock();
            let seq = st.next_seq;
            st.next_seq += 1;
            Entry {
                size: size as u32,
                seq,
            }
        };
        if let Err(e) = self.db.put(chunk_key(id), encode_entry(entry)) {
            if let Err(e) = remove_file(&path) {
                tracing::warn!(error = %e, "chunk cache: unindexed chunk file left for the next open");
            }
            let nospace = is_rocks_nospace(&e);
            let what = if nospace {
                self.lock().counters.enospc += 1;
                "no space left on device to index a chunk; it was not cached"
            } else {
                "cannot index a chunk; it was not cached"
            };
            return Err(self.rocks_error(what, e));
        }
        pending.done = true;
        let mut st = self.lock();
        st.inflight.remove(id);
        st.pending -= size;
        st.present += size;
        st.lru.push(*id, entry);
        st.dirty_dirs[usize::from(id.blob.0[0])] = true;
        Ok(())
    }

    /// Drop a chunk (for example one the caller found corrupt); counts nothing.
    pub fn remove(&self, id: &ChunkId) -> Result<()> {
        self.remove_for(id, Reason::Removed)
    }

    /// Drop a chunk whose bytes do not match its digest; counts it in `dropped_corrupt` if it
    /// was cached.
    pub fn drop_corrupt(&self, id: &ChunkId) -> Result<()> {
        self.remove_for(id, Reason::Corrupt)
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
            evictions: st.counters.evictions,
            dropped_corrupt: st.counters.dropped_corrupt,
            enospc: st.counters.enospc,
            recovered_orphans: st.counters.recovered_orphans,
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
        self.db
            .put(META_COUNTERS, encode_counters(&counters))
            .map_err(|e| self.rocks_error("cannot write the counters", e))?;
        for (shard, _) in dirs.iter().enumerate().filter(|(_, dirty)| **dirty) {
            sync_dir(&self.chunks.join(hex::encode([shard as u8])))?;
        }
        self.db
            .flush_wal(true)
            .map_err(|e| self.rocks_error("cannot sync the index", e))
    }

    fn remove_for(&self, id: &ChunkId, reason: Reason) -> Result<()> {
        self.forget(id, None, reason)
    }

    /// Remove `id` if it is cached and, with `seq`, still the entry that was looked at (not
    /// touched, or evicted and put again, since).
    fn forget(&self, id: &ChunkId, seq: Option<u64>, reason: Reason) -> Result<()> {
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
        self.discard(vec![victim], reason)
    }

    /// Remove doomed chunks: index entries first, then the files.
    fn discard(&self, victims: Vec<(ChunkId, Entry)>, reason: Reason) -> Result<()> {
        if victims.is_empty() {
            return Ok(());
        }
        let written = {
            let _index = self
                .index_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut batch = WriteBatch::default();
            for (id, _) in &victims {
                batch.delete(chunk_key(id));
            }
            self.db.write(batch)
        };
        if let Err(e) = written {
            // Nothing was removed: put the chunks back, least recently used last.
            let mut st = self.lock();
            for (id, entry) in victims.iter().rev() {
                st.inflight.remove(id);
                st.present += u64::from(entry.size);
                st.lru.push(*id, *entry);
                st.lru.demote(id);
            }
            if is_rocks_nospace(&e) {
                st.counters.enospc += 1;
            }
            drop(st);
            return Err(self.rocks_error("cannot remove chunks from the index", e));
        }
        let mut failed = None;
        for (id, _) in &victims {
            if let Err(e) = remove_file(&self.chunk_path(id)) {
                // Unindexed now: the next open deletes it.
                failed = Some(e);
            }
        }
        if let Some(e) = failed {
            tracing::warn!(error = %e, "chunk cache: evicted chunk file left for the next open");
        }
        let n = victims.len() as u64;
        let mut st = self.lock();
        for (id, _) in &victims {
            st.inflight.remove(id);
            st.dirty_dirs[usize::from(id.blob.0[0])] = true;
        }
        match reason {
            Reason::Evicted => st.counters.evictions += n,
            Reason::Corrupt => st.counters.dropped_corrupt += n,
            Reason::Removed => {}
        }
        Ok(())
    }

    /// Evict until the filesystem has room for `size` bytes plus the index reserve.
    fn make_room_on_disk(&self, size: u64) -> Result<()> {
        let Ok(vfs) = rustix::fs::statvfs(&self.chunks) else {
            return Ok(());
        };
        let free = vfs.f_bavail.saturating_mul(vfs.f_frsize);
        let want = size + self.reserve;
        if free >= want {
            return Ok(());
        }
        let victims = self.lock().doom_lru(want - free);
        self.discard(victims, Reason::Evicted)
    }

    /// Write the chunk file under its final name, evicting and retrying once on `ENOSPC`.
    fn store_file(&self, id: &ChunkId, data: &[u8]) -> Result<PathBuf> {
        let first = match self.write_file(id, data) {
            Ok(path) => return Ok(path),
            Err((path, e)) if !is_nospace(&e) => return Err(Error::io("write chunk", path, e)),
            Err((_, e)) => e,
        };
        let victims = {
            let mut st = self.lock();
            st.counters.enospc += 1;
            st.doom_lru(ENOSPC_EVICT.max(data.len() as u64))
        };
        tracing::warn!(error = %first, evicting = victims.len(), "chunk cache: disk full");
        self.discard(victims, Reason::Evicted)?;
        match self.write_file(id, data) {
            Ok(path) => Ok(path),
            Err((path, e)) if !is_nospace(&e) => Err(Error::io("write chunk", path, e)),
            Err((_, e)) => {
                let bytes = {
                    let mut st = self.lock();
                    st.counters.enospc += 1;
                    st.present
                };
                Err(self.error(
                    format!(
                        "no space left on device for chunk {} of blob {} ({} bytes), even after \
                         evicting; the cache holds {bytes} bytes: {e}",
                        id.index,
                        id.blob,
                        data.len()
                    ),
                    Some(Box::new(e)),
                ))
            }
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
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .and_then(|file| {
                file.write_all_at(data, 0)?;
                file.sync_data()?;
                // Clean now; keep the page cache for level 1 and for hot files.
                let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed);
                Ok(())
            })
            .and_then(|()| fs::rename(&tmp, &path));
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

    /// Write the recency of chunks hit since the last time. With `wait == false`, skip if
    /// another thread is already writing the index.
    fn persist_recency(&self, wait: bool) -> Result<()> {
        let _index = match self.index_lock.try_lock() {
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
            dirty
                .into_iter()
                .filter_map(|id| st.lru.peek(&id).map(|e| (id, *e)))
                .collect()
        };
        if updates.is_empty() {
            return Ok(());
        }
        let mut batch = WriteBatch::default();
        for (id, entry) in &updates {
            batch.put(chunk_key(id), encode_entry(*entry));
        }
        self.db
            .write(batch)
            .map_err(|e| self.rocks_error("cannot write recency to the index", e))
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

    fn error(&self, message: String, source: Option<BoxError>) -> Error {
        Error::Cache {
            path: self.dir.clone(),
            message,
            source,
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
    if key[0] != CHUNK_KEY_TAG {
        return None;
    }
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
    if v[0] != ENTRY_VERSION || u64::from(size) > CHUNK_SIZE {
        return None;
    }
    Some(Entry {
        size,
        seq: u64::from_le_bytes(v[5..].try_into().ok()?),
    })
}

fn encode_counters(c: &Counters) -> [u8; COUNTERS_LEN] {
    let mut v = [0u8; COUNTERS_LEN];
    v[0] = COUNTERS_VERSION;
    let fields = [
        c.evictions,
        c.dropped_corrupt,
        c.enospc,
        c.recovered_orphans,
    ];
    for (slot, n) in v[1..].chunks_exact_mut(8).zip(fields) {
        slot.copy_from_slice(&n.to_le_bytes());
    }
    v
}

fn decode_counters(v: &[u8]) -> Option<Counters> {
    let v: &[u8; COUNTERS_LEN] = v.try_into().ok()?;
    if v[0] != COUNTERS_VERSION {
        return None;
    }
    let n = |i: usize| {
        v[1 + 8 * i..9 + 8 * i]
            .try_into()
            .ok()
            .map(u64::from_le_bytes)
    };
    Some(Counters {
        evictions: n(0)?,
        dropped_corrupt: n(1)?,
        enospc: n(2)?,
        recovered_orphans: n(3)?,
    })
}

/// `<blob hex>.<index>` in the shard directory `shard`, exactly as [`DiskCache`] names it.
fn parse_chunk_name(shard: &str, name: &str) -> Option<ChunkId> {
    let (hex, index) = name.split_once('.')?;
    if !hex.starts_with(shard) {
        return None;
    }
    let id = ChunkId {
        blob: Digest::from_str(hex).ok()?,
        index: index.parse().ok()?,
    };
    (id.index.to_string() == index).then_some(id)
}

fn remove_file(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", path, e)),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("fsync directory", dir, e))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_round_trip_and_reject_garbage() {
        let id = ChunkId {
            blob: Digest::of(b"x"),
            index: 7,
        };
        assert_eq!(decode_key(&chunk_key(&id)), Some(id));
        assert_eq!(decode_key(&chunk_key(&id)[..40]), None);
        let entry = Entry { size: 4096, seq: 9 };
        assert_eq!(decode_entry(&encode_entry(entry)), Some(entry));
        let mut bad = encode_entry(entry);
        bad[0] = 2;
        assert_eq!(decode_entry(&bad), None);
        let huge = encode_entry(Entry {
            size: CHUNK_SIZE as u32 + 1,
            seq: 0,
        });
        assert_eq!(decode_entry(&huge), None);
        assert_eq!(decode_entry(b""), None);
        let c = Counters {
            evictions: 1,
            dropped_corrupt: 2,
            enospc: 3,
            recovered_orphans: 4,
        };
        let back = decode_counters(&encode_counters(&c)).map(|c| c.recovered_orphans);
        assert_eq!(back, Some(4));
        let hex = id.blob.to_hex();
        assert_eq!(parse_chunk_name(&hex[..2], &format!("{hex}.7")), Some(id));
        assert_eq!(parse_chunk_name(&hex[..2], &format!("{hex}.07")), None);
        assert_eq!(parse_chunk_name("zz", &format!("{hex}.7")), None);
        assert_eq!(
            parse_chunk_name(&hex[..2], &format!(".tmp.{hex}.7.1.2")),
            None
        );
    }
}
