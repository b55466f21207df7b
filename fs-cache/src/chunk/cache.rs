//! The chunk cache: `read(blob, offset, len)` returns exactly those bytes of a blob, fetching
//! whatever 256 KiB chunks are missing.
//!
//! # Path of a read
//! 1. The blob's chunk table is loaded once ([`crate::Store::chunk_table`]) and kept.
//! 2. Each chunk the read covers is looked up in level 1 (memory, LRU, bounded in bytes), then
//!    level 2 ([`super::disk::DiskCache`]), which reads only the 4 KiB blocks the read needs and
//!    checks each against the crc32c written when the (blake3-verified) chunk entered the
//!    cache; a chunk that fails is dropped and refetched. Level-2 reads run on the caller's
//!    thread when it may block ([`ChunkCache::read_blocking`], FUSE workers); else on a
//!    blocking thread (where level 2 reads through the page cache rather than with
//!    `O_DIRECT`, first inline with `RWF_NOWAIT`: page-cache hits need no thread hand-off).
//!    A whole-chunk level-2 hit is promoted to level 1.
//! 3. The rest is fetched from the backend: runs of adjacent missing chunks become one ranged
//!    request each (of the chunks' stored bytes: adjacent chunks of a compressed blob are
//!    adjacent in its stored object), up to `max_request_bytes` of plain chunks (`fetch`: a
//!    FUSE worker over a POSIX store reads, decodes and checks on its own thread). A chunk already being fetched by another reader
//!    is not requested again: the reader waits for that request and shares its result or error.
//! 4. Every fetched chunk is verified before it enters either level (level 2 in the
//!    background: queued, and written in batches, `writer.rs`; a reader never waits
//!    for it; a blob whose table has chunks larger than 256 KiB
//!    ([`MAX_DISK_CHUNK_SHIFT`](super::MAX_DISK_CHUNK_SHIFT)) stays in level 1): a
//!    compressed chunk is decoded
//!    first, into a buffer of exactly its plain length ([`super::codec`]), and a frame that
//!    fails to decode or decodes to another length counts as a mismatch; both levels hold
//!    plain chunks only. A mismatch is retried once with a request for that chunk alone,
//!    then reported as [`Error::Corrupt`] and counted.
//!    Backend errors are retried with backoff up to a deadline under the cache's
//!    [`RetryPolicy`], which replaces the store's for the cache's requests (one layer of
//!    retries, see [`crate::backend::retry`]); a body shorter than its range is retried too.
//!    A read that still fails gets the error (final, never transient), and the cache stays
//!    usable.
//! 5. A read that starts where the previous read of the same blob ended (or inside the window
//!    readahead already covers: concurrent readers finish out of order) is sequential; once
//!    it asked for 1 MiB, and while its reads cover three quarters of the span they moved
//!    over, it triggers readahead of the next `readahead_bytes`, in the background, at prefetch
//!    priority, and level-2 readahead of the next `disk_readahead_bytes` (the cached chunks'
//!    pages are read ahead, so that a sequential reader of level 2 keeps the disk busy); each
//!    window at most twice what the stream asked for so far.
//!
//! A chunk is known by its blob, index and the blob's chunk size ([`ChunkId::shift`], from the
//! table): the same blob read under two chunk tables (a table replaced, a blob stored again
//! with another chunk size) never gets a chunk of one chunking served for the other, from
//! either level. Budgets of chunks (level-2 runs and batches, pending writes) are in bytes, so
//! that smaller chunks do not shrink them.
//!
//! Fetches run in their own tasks, so a reader that gives up (a cancelled future) never leaves
//! other readers waiting on a request nobody finishes. Prefetches wait while any demand fetch
//! is in flight, and run at most `prefetch_concurrency` at a time.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Notify, Semaphore};

use super::counters::{BlobStats, Extra};
use super::disk::{BlobPin, DiskCache, DiskCacheConfig, DiskStats, RangeRead};
use super::stage::{RunJob, RunQueue, Staging};
use super::table::ChunkTable;
use super::writer::DiskWriter;
use super::ChunkId;
use crate::backend::RetryPolicy;
use crate::error::{Error, Result};
use crate::store::{blob_key, Digest, Store};

/// How the cache is sized and behaves.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Level 1 capacity in bytes.
    pub memory_bytes: u64,
    /// Level 2 (none: memory only).
    pub disk: Option<DiskCacheConfig>,
    /// The largest single backend request (adjacent misses are coalesced up to this).
    pub max_request_bytes: u64,
    /// A demand miss in a blob whose chunks are smaller than this also fetches the rest of
    /// its aligned window of this many bytes that neither level holds, in the same request
    /// (`window.rs`): for stores where a request costs far more than its bytes. 0: only the
    /// chunks asked for.
    pub fetch_unit_bytes: u64,
    /// Such a miss widens only while, of the chunks recent windows of its blob brought or
    /// would have brought along, at least this percentage was then read (`window.rs`); 0:
    /// always.
    pub fetch_unit_min_yield_pct: u8,
    /// Readahead after a sequential read (0: none): chunks in neither level are fetched.
    pub readahead_bytes: u64,
    /// Level-2 readahead after a sequential read (0: none): chunks on local disk are read
    /// ahead of the reader into a small staging area (see [`DiskCache::read_chunks_direct`]).
    pub disk_readahead_bytes: u64,
    /// Prefetch requests in flight at once.
    pub prefetch_concurrency: usize,
    /// Retries of the cache's backend requests (instead of the store's policy, not on top of
    /// it).
    pub retry: RetryPolicy,
    /// Where cumulative counters are kept between runs (`stats.json`), if anywhere.
    pub stats_file: Option<PathBuf>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            memory_bytes: 256 << 20,
            disk: None,
            max_request_bytes: 4 << 20,
            fetch_unit_bytes: 0,
            fetch_unit_min_yield_pct: super::window::DEFAULT_MIN_YIELD_PCT,
            readahead_bytes: 1 << 20,
            disk_readahead_bytes: 8 << 20,
            prefetch_concurrency: 2,
            retry: RetryPolicy::default(),
            stats_file: None,
        }
    }
}

/// Counters of one cache (see [`ChunkCache::stats`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheStats {
    /// Chunk lookups served from level 1 or level 2.
    pub hits: u64,
    pub hits_memory: u64,
    pub hits_disk: u64,
    /// Chunk lookups that needed the backend (demand reads).
    pub misses: u64,
    /// Bytes returned to callers.
    pub bytes_read: u64,
    /// Bytes received from the backend.
    pub bytes_fetched: u64,
    /// Backend requests, each counted once however many attempts it took.
    pub backend_requests: u64,
    /// Chunks fetched per backend request, summed (divide by `backend_requests`).
    pub coalesced_chunks: u64,
    /// Chunks evicted from level 1 and level 2.
    pub evictions: u64,
    pub evictions_memory: u64,
    /// Chunks whose bytes did not match their digest (backend or local disk).
    pub verify_failures: u64,
    /// Reads that failed with `Corrupt` after the refetch.
    pub corrupt_errors: u64,
    pub backend_errors: u64,
    /// Chunks fetched ahead of readers: sequential readahead, and the rest of a demand
    /// miss's fetch-unit window.
    pub readahead_chunks: u64,
    /// Level-2 chunks read ahead of a sequential reader, and how many of them were then read
    /// (the rest were pushed out unread, or read before they arrived).
    #[serde(default)]
    pub disk_readahead_chunks: u64,
    #[serde(default)]
    pub disk_readahead_hits: u64,
    pub prefetch_chunks: u64,
    /// Chunks fetched by replays of recorded access traces ([`ChunkCache::replay`]), the
    /// gaps they filled included.
    #[serde(default)]
    pub trace_chunks: u64,
    /// Fetched chunks not kept on local disk because too many writes were pending.
    #[serde(default)]
    pub disk_writes_skipped: u64,
    /// Demand misses in blobs of chunks smaller than the fetch unit that widened to their
    /// windows, and that fetched only their own chunks because widening had not paid lately
    /// in that blob (`window.rs`).
    #[serde(default)]
    pub fetch_unit_widened: u64,
    #[serde(default)]
    pub fetch_unit_narrowed: u64,
    /// Read latency histogram: `read_latency_us[i]` counts reads that took < 2^i µs.
    pub read_latency_us: Vec<u64>,
    pub memory_bytes: u64,
    pub memory_capacity: u64,
    /// Level 2's own counters, read live (a stats file's copy is not used).
    #[serde(default)]
    pub disk: Option<DiskStats>,
    /// Retries of backend requests, by cause ([`crate::backend::retry::RetryCause::name`]).
    #[serde(default)]
    pub retries: BTreeMap<String, u64>,
    /// Backend requests that failed for good, by error kind
    /// ([`super::counters::kind_name`]).
    #[serde(default)]
    pub backend_errors_by_kind: BTreeMap<String, u64>,
    /// Backend request latency (all attempts): `fetch_latency_us[i]` counts requests that
    /// took < 2^i µs.
    #[serde(default)]
    pub fetch_latency_us: Vec<u64>,
    /// The sum of those requests' durations, in µs.
    #[serde(default)]
    pub fetch_latency_sum_us: u64,
}

use super::counters::LATENCY_BUCKETS;

#[derive(Default)]
pub(super) struct Counters {
    hits_memory: AtomicU64,
    hits_disk: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    bytes_fetched: AtomicU64,
    backend_requests: AtomicU64,
    coalesced_chunks: AtomicU64,
    evictions_memory: AtomicU64,
    verify_failures: AtomicU64,
    corrupt_errors: AtomicU64,
    backend_errors: AtomicU64,
    readahead_chunks: AtomicU64,
    disk_readahead_chunks: AtomicU64,
    disk_readahead_hits: AtomicU64,
    prefetch_chunks: AtomicU64,
    pub(super) trace_chunks: AtomicU64,
    disk_writes_skipped: AtomicU64,
    fetch_unit_widened: AtomicU64,
    fetch_unit_narrowed: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

struct Memory {
    lru: lru::LruCache<ChunkId, Bytes>,
    bytes: u64,
}

type Shared = Option<std::result::Result<Bytes, Arc<Error>>>;
/// A chunk a fetch claimed: its index, where its result goes, and whether a reader waited
/// for it when it was claimed (else it rides along in a fetch unit's window).
type Claim = (u64, watch::Sender<Shared>, bool);

/// A chunk being fetched: its result, and a way for a demand reader that joins a low-priority
/// fetch (readahead, prefetch) still waiting for its turn to make it start at once.
#[derive(Clone)]
struct InFlight {
    result: watch::Receiver<Shared>,
    boost: Arc<Boost>,
}

#[derive(Default)]
struct Boost {
    set: std::sync::atomic::AtomicBool,
    notify: Notify,
}

impl Boost {
    fn raise(&self) {
        self.set.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }
}

/// Per-blob sequential-read state: where the stream started, how many bytes its reads asked
/// for, where they have reached, and how far backend and level-2 readahead have already been
/// issued.
#[derive(Clone, Copy, Default)]
struct Sequential {
    start: u64,
    covered: u64,
    last_end: u64,
    ahead_until: u64,
    disk_ahead_until: u64,
    /// It began where a file starts, at a known run (`bounds.rs`): it may read ahead before
    /// `STREAM_MIN_BYTES`, up to that run's end.
    from_file_start: bool,
}

impl Sequential {
    /// A stream is dense when its reads asked for at least three quarters of the span they
    /// moved over (reads that FUSE threads finish out of order leave gaps that fill soon).
    /// Only a dense stream reads ahead: a reader that skips forward through the blob (every
    /// 10th small file of a packed tree, in layout order) stays inside the window and would
    /// otherwise keep it moving, reading most of the blob for a tenth of it (a 10%
    /// read of the minbase root through the cache read 127 MB of level 2 ahead for 13 MB).
    fn dense(&self) -> bool {
        self.covered.saturating_mul(4) >= self.last_end.saturating_sub(self.start).saturating_mul(3)
    }
}

/// A stream reads ahead once its reads asked for this many bytes, then twice what they asked
/// for so far (up to the window): a file of a few hundred KiB read in two requests is a
/// stream, and reading 8 MiB of level 2 past it (into other files' chunks) for every such
/// file made a 10% read of small files through the cache 2.3-2.8x slower than native; with
/// this floor and ramp, 1.2-1.4x (minbase root, `bench/level2_read.sh`), and sequential reads
/// of large files no slower.
const STREAM_MIN_BYTES: u64 = 1 << 20;

/// The staging area holds this many `disk_readahead_bytes` windows (several streams at once).
const STAGED_WINDOWS: u64 = 4;
/// Bytes per level-2 readahead read (a whole number of chunks, at least one): a window is read
/// as several such runs. 8 chunks of 256 KiB.
pub const DISK_RUN_BYTES: u64 = 2 << 20;
/// Level-2 readahead runs read at once, oldest queued first ([`RunQueue`]).
pub const DISK_RUNS_IN_FLIGHT: usize = 2;

/// The shift of a table whose chunks level 2 keeps (4 KiB ..= 256 KiB, a power of two).
fn disk_shift(table: &ChunkTable) -> Option<u8> {
    let shift = table.chunk_shift();
    (table.chunk_size.is_power_of_two()
        && (super::MIN_CHUNK_SHIFT..=super::MAX_DISK_CHUNK_SHIFT).contains(&shift))
    .then_some(shift)
}

/// Bytes per run of [`ChunkCache::warm_local`] (one backend request).
pub const WARM_RUN_BYTES: u64 = 4 << 20;
/// Runs of [`ChunkCache::warm_local`] in flight.
pub const WARM_RUNS_IN_FLIGHT: usize = 4;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Priority {
    Demand,
    Readahead,
    Prefetch,
    /// A recorded trace's replay: below demand reads (a demand reader that joins it raises
    /// it), but not held back while demand fetches run, since it exists to run ahead of
    /// them; at most [`TRACE_REQUESTS_IN_FLIGHT`] requests at once
    /// ([`TRACE_REQUESTS_IN_FLIGHT_UNIT`] in blobs of chunks smaller than the fetch unit).
    Trace,
}

/// Backend requests of trace replays in flight at once.
pub(super) const TRACE_REQUESTS_IN_FLIGHT: usize = 4;
/// The same for blobs of chunks smaller than the fetch unit (a store whose requests cost more
/// than their bytes): a replay fetches the trace's small chunks there, not whole windows
/// (`window.rs`), in requests of at most one unit, whose latency more of them at once hide.
pub(super) const TRACE_REQUESTS_IN_FLIGHT_UNIT: usize = 16;

pub(super) struct Inner {
    store: Store,
    pub(super) config: CacheConfig,
    tables: Mutex<HashMap<Digest, Arc<ChunkTable>>>,
    memory: Mutex<Memory>,
    disk: Option<Arc<DiskCache>>,
    inflight: Mutex<HashMap<ChunkId, InFlight>>,
    sequential: Mutex<HashMap<Digest, Sequential>>,
    /// Where files' data runs end, per blob (`bounds.rs`).
    bounds: super::bounds::Bounds,
    /// Per blob, whether widening misses to the fetch unit pays (`window.rs`).
    yields: super::window::Yields,
    staging: Arc<Staging>,
    /// Level-2 readahead runs waiting to be read ([`Inner::stage`]).
    runs: Arc<RunQueue>,
    /// Level 2's background writes ([`super::writer`]).
    writer: Arc<DiskWriter>,
    counters: Counters,
    extra: Extra,
    demand_active: AtomicUsize,
    /// Fetches running on their readers' own threads ([`fetch::INLINE_FETCHES`]).
    inline_fetches: AtomicUsize,
    demand_idle: Notify,
    prefetch_gate: Semaphore,
    trace_gate: Semaphore,
    /// The trace gate of blobs of chunks smaller than the fetch unit.
    pub(super) trace_gate_unit: Semaphore,
    /// Traces being recorded ([`ChunkCache::record`]), and how many (read without the lock
    /// on every read).
    pub(super) recordings: Mutex<Vec<Arc<super::recorder::Recorder>>>,
    pub(super) recording: AtomicUsize,
    base: CacheStats,
}

mod fetch;

/// The two-level chunk cache over a store.
#[derive(Clone)]
pub struct ChunkCache {
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCache")
            .field("backend", &self.inner.store.backend().to_string())
            .field("config", &self.inner.config)
            .finish()
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section below leaves its data consistent between statements.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ChunkCache {
    /// A cache over `store` (opens level 2, if configured, and recovers its index).
    pub async fn open(store: Store, config: CacheConfig) -> Result<Self> {
        let disk = match config.disk.clone() {
            Some(dc) => Some(Arc::new(
                tokio::task::spawn_blocking(move || DiskCache::open(dc))
                    .await
                    .map_err(|e| Error::io("open", "disk cache", std::io::Error::other(e)))??,
            )),
            None => None,
        };
        let base = match &config.stats_file {
            Some(p) => match std::fs::read(p) {
                Ok(b) => serde_json::from_slice(&b).unwrap_or_default(),
                Err(_) => CacheStats::default(),
            },
            None => CacheStats::default(),
        };
        let staging = Arc::new(Staging::new(
            STAGED_WINDOWS.saturating_mul(config.disk_readahead_bytes),
        ));
        // The cache's requests retry under its own policy, in place of the store's.
        let store = store.with_retry_policy(config.retry.clone());
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                prefetch_gate: Semaphore::new(config.prefetch_concurrency.max(1)),
                trace_gate: Semaphore::new(TRACE_REQUESTS_IN_FLIGHT),
                trace_gate_unit: Semaphore::new(TRACE_REQUESTS_IN_FLIGHT_UNIT),
                recordings: Mutex::new(Vec::new()),
                recording: AtomicUsize::new(0),
                config,
                tables: Mutex::new(HashMap::new()),
                memory: Mutex::new(Memory {
                    lru: lru::LruCache::unbounded(),
                    bytes: 0,
                }),
                disk,
                inflight: Mutex::new(HashMap::new()),
                sequential: Mutex::new(HashMap::new()),
                bounds: Default::default(),
                yields: Default::default(),
                staging,
                runs: RunQueue::new(DISK_RUNS_IN_FLIGHT),
                writer: DiskWriter::new(),
                counters: Counters::default(),
                extra: Extra::default(),
                demand_active: AtomicUsize::new(0),
                inline_fetches: AtomicUsize::new(0),
                demand_idle: Notify::new(),
                base,
            }),
        })
    }

    /// Load (once) and return the chunk table of `blob`.
    pub async fn register(&self, blob: &Digest) -> Result<Arc<ChunkTable>> {
        if let Some(t) = lock(&self.inner.tables).get(blob) {
            return Ok(t.clone());
        }
        let table = Arc::new(self.inner.store.chunk_table(blob).await?);
        lock(&self.inner.tables).insert(*blob, table.clone());
        Ok(table)
    }

    /// Forget `blob`'s chunk table and sequential-read state (a long-running owner calls this
    /// when it releases the blob, so that memory does not grow with every blob ever read).
    /// Cached chunks stay; a later [`Self::register`] or read loads the table again.
    pub fn unregister(&self, blob: &Digest) {
        lock(&self.inner.tables).remove(blob);
        lock(&self.inner.sequential).remove(blob);
    }

    /// Blobs whose chunk tables are loaded.
    pub fn registered(&self) -> usize {
        lock(&self.inner.tables).len()
    }

    /// If every chunk of `blob` is in level 2, pin them there and return the pin, whose file
    /// holds exactly the blob's bytes for as long as it lives (for FUSE passthrough: the
    /// kernel then reads a local file). `None` when a chunk is missing, when there is no level
    /// 2, or when the blob's chunks are larger than 256 KiB (level 2 does not keep them). Reads of the pinned file are not checked block by block; call
    /// [`BlobPin::verify`] once to check all of it.
    pub async fn pin_local(&self, blob: &Digest) -> Result<Option<BlobPin>> {
        let table = self.register(blob).await?;
        let Some(disk) = self.inner.disk.clone() else {
            return Ok(None);
        };
        let Some(shift) = disk_shift(&table).filter(|_| table.blob_size > 0) else {
            return Ok(None);
        };
        let chunks = table.chunk_count();
        let last = table.chunk_range(chunks - 1);
        let blob = *blob;
        tokio::task::spawn_blocking(move || {
            disk.pin_blob(&blob, shift, chunks, last.end - last.start)
        })
        .await
        .map_err(|e| Error::io("pin", "disk cache", std::io::Error::other(e)))?
    }

    /// [`Self::pin_local`] for a reader that will not go through the cache (a kernel mount):
    /// the pinned file is checked whole ([`BlobPin::verify`]) and the pin held by `token`
    /// ([`BlobPin::hold`], an existing path whose life bounds the reader's), on a blocking
    /// thread. `None` when a chunk is missing or fails its check (the bad chunk is dropped).
    pub async fn pin_local_held(&self, blob: &Digest, token: PathBuf) -> Result<Option<BlobPin>> {
        let Some(mut pin) = self.pin_local(blob).await? else {
            return Ok(None);
        };
        tokio::task::spawn_blocking(move || {
            if !pin.verify()? {
                return Ok(None);
            }
            pin.hold(&token)?;
            Ok(Some(pin))
        })
        .await
        .map_err(|e| Error::io("verify", "disk cache", std::io::Error::other(e)))?
    }

    /// Make every chunk of `blob` resident in level 2 (a node warming a layer before it is
    /// mounted): chunks already there are left alone, chunks in level 1 are written from
    /// there, the others are fetched (at prefetch priority, below demand reads; verified as
    /// always) and written, [`WARM_RUNS_IN_FLIGHT`] runs of up to [`WARM_RUN_BYTES`] at a
    /// time. Unlike readahead, no write to level 2 is skipped for lack of pending-write
    /// slots: this waits for each. Fetched chunks also pass through level 1, as any fetch.
    /// Returns whether every chunk is in level 2 at the end (`false` without a level 2, for a
    /// blob whose chunks are larger than 256 KiB — level 2 does not keep those — or when
    /// level 2 is too small to keep them all).
    pub async fn warm_local(&self, blob: &Digest) -> Result<bool> {
        let table = self.register(blob).await?;
        let Some(disk) = self.inner.disk.clone() else {
            return Ok(false);
        };
        let Some(shift) = disk_shift(&table) else {
            return Ok(false);
        };
        let run_chunks = (WARM_RUN_BYTES / table.chunk_size).max(1) as usize;
        let blob = *blob;
        let id = move |index| ChunkId { blob, shift, index };
        let chunks = table.chunk_count();
        let mut runs: Vec<Vec<u64>> = Vec::new();
        for index in (0..chunks).filter(|&i| !disk.contains(&id(i))) {
            match runs.last_mut() {
                Some(run) if run.len() < run_chunks && run.last().map(|l| l + 1) == Some(index) => {
                    run.push(index)
                }
                _ => runs.push(vec![index]),
            }
        }
        let inner = &self.inner;
        let table = &table;
        futures::stream::iter(runs)
            .map(|run| {
                let disk = disk.clone();
                async move {
                    let mut have = Vec::with_capacity(run.len());
                    let mut need = Vec::new();
                    for i in run {
                        match inner.memory_get(&id(i)) {
                            Some(b) => have.push((i, b)),
                            None => need.push(i),
                        }
                    }
                    if !need.is_empty() {
                        let got = inner
                            .fetch_chunks(table, &need, &[], Priority::Prefetch, Io::Offload)
                            .await?;
                        have.extend(need.into_iter().zip(got));
                    }
                    tokio::task::spawn_blocking(move || {
                        let chunks: Vec<(ChunkId, &[u8])> =
                            have.iter().map(|(i, b)| (id(*i), &b[..])).collect();
                        disk.put_many(&chunks)
                    })
                    .await
                    .map_err(|e| Error::io("warm", "disk cache", std::io::Error::other(e)))?
                }
            })
            .buffer_unordered(WARM_RUNS_IN_FLIGHT)
            .try_collect::<Vec<()>>()
            .await?;
        // A fetched chunk may also have been handed to a background level-2 write, which
        // the put above then left alone (already being put): wait for those.
        self.inner.writer.drain().await;
        Ok((0..chunks).all(|i| disk.contains(&id(i))))
    }

    /// How long a chunk fetched while readers keep the cache busy may wait before it is
    /// written to level 2 ([`super::writer::DISK_LINGER`] by default): a daemon that resumed
    /// another's mounts sets [`super::writer::RESUMED_DISK_LINGER`] for a while, so that if
    /// it is crash-looping what it fetched survives the next crash.
    pub fn set_disk_linger(&self, linger: Duration) {
        self.inner.writer.set_linger(linger);
    }

    /// Let level 2 evict again the chunks that an earlier process's holds kept pinned, where
    /// their token is gone ([`BlobPin::hold`], [`DiskCache::release_stale_holds`]). Returns
    /// how many holds went.
    pub async fn release_stale_holds(&self) -> Result<usize> {
        let Some(disk) = self.inner.disk.clone() else {
            return Ok(0);
        };
        tokio::task::spawn_blocking(move || disk.release_stale_holds())
            .await
            .map_err(|e| Error::io("release holds", "disk cache", std::io::Error::other(e)))?
    }

    /// The uncompressed size of `blob`.
    pub async fn blob_size(&self, blob: &Digest) -> Result<u64> {
        Ok(self.register(blob).await?.blob_size)
    }

    /// Read `len` bytes of `blob` at `offset` (fewer only at the end of the blob).
    pub async fn read(&self, blob: &Digest, offset: u64, len: u64) -> Result<Bytes> {
        let parts = self.read_with(blob, offset, len, Io::Offload).await?;
        Ok(match <[Bytes; 1]>::try_from(parts) {
            Ok([one]) => one,
            Err(parts) => {
                let mut out = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
                for p in &parts {
                    out.extend_from_slice(p);
                }
                out.freeze()
            }
        })
    }

    /// [`Self::read`] for a caller on a thread of its own that may block (a FUSE worker),
    /// driving the read on `runtime`: level-2 reads run on this thread, with no hand-off
    /// to a blocking thread and back. The bytes come as the pieces of the chunks they are
    /// in, in order (a reply written with one `writev` needs no copy joining them). Must not
    /// be called from inside the runtime.
    pub fn read_blocking(
        &self,
        runtime: &tokio::runtime::Handle,
        blob: &Digest,
        offset: u64,
        len: u64,
    ) -> Result<Vec<Bytes>> {
        runtime.block_on(self.read_with(blob, offset, len, Io::Inline))
    }

    async fn read_with(&self, blob: &Digest, offset: u64, len: u64, io: Io) -> Result<Vec<Bytes>> {
        let started = Instant::now();
        let table = self.register(blob).await?;
        if offset > table.blob_size {
            return Err(Error::InvalidRange {
                backend: self.inner.store.backend().to_string(),
                key: blob_key(blob),
                start: offset,
                end: offset.saturating_add(len),
                size: table.blob_size,
            });
        }
        let end = offset.saturating_add(len).min(table.blob_size);
        if end == offset {
            return Ok(Vec::new());
        }
        if self.inner.recording.load(Ordering::Relaxed) > 0 {
            self.inner.note_read(blob, offset..end);
        }
        let first = offset / table.chunk_size;
        let last = (end - 1) / table.chunk_size;
        // The part of chunk `i` this read needs, in the chunk's own coordinates.
        let part = |i: u64| {
            let r = table.chunk_range(i);
            (offset.max(r.start) - r.start)..(end.min(r.end) - r.start)
        };

        // Sequential detection and readahead. A read continues a stream when it starts where
        // the last one ended, or inside what readahead already covers and at most a window
        // behind the furthest end (FUSE serves the kernel's readahead on several threads, so
        // a stream's reads finish out of order). A stream keeps `readahead_bytes` ahead of it
        // fetched from the backend and `disk_readahead_bytes` read ahead from level 2, each
        // issued as a whole window whenever less than half of it is left, once the stream has
        // asked for `STREAM_MIN_BYTES` (the window then twice what it asked for, at most the
        // configured one) and while it is dense ([`Sequential::dense`]). A stream still
        // inside the file run it began in, where the run's end is known (`bounds.rs`), reads
        // ahead never past that end, and, if it began where the file starts, from its first
        // read on (from level 2 at least eight times what it asked, up to
        // `STREAM_MIN_BYTES`).
        let cfg = &self.inner.config;
        let windows = [cfg.readahead_bytes, cfg.disk_readahead_bytes];
        let around = self.inner.bounds.around(blob, end);
        // A new stream here begins where a file starts if its run begins in the chunk after
        // the previous run's end at the latest: a random reader inside a file does not.
        let starts_file = around.is_some_and(|(before, _)| {
            offset / table.chunk_size <= (before / table.chunk_size).saturating_add(1)
        });
        let (ahead, disk_ahead) = {
            let mut seq = lock(&self.inner.sequential);
            let state = seq.entry(*blob).or_default();
            let frontier = state.ahead_until.max(state.disk_ahead_until);
            let lag = windows[0].max(windows[1]);
            let in_stream = offset > 0
                && (offset == state.last_end
                    || (offset < frontier && offset.saturating_add(lag) >= state.last_end));
            if in_stream {
                state.last_end = state.last_end.max(end);
                state.covered = state.covered.saturating_add(end - offset);
            } else {
                *state = Sequential {
                    start: offset,
                    covered: end - offset,
                    last_end: end,
                    from_file_start: starts_file,
                    ..Sequential::default()
                };
            }
            // The end of the run this stream began in, if known and not yet crossed.
            let cap = around
                .filter(|&(before, _)| state.start >= before)
                .map(|(_, run_end)| run_end);
            let early = state.from_file_start && cap.is_some();
            if in_stream || early {
                let dense = state.dense();
                let covered = state.covered;
                let next = (last + 1) * table.chunk_size;
                let limit = cap.unwrap_or(u64::MAX).min(table.blob_size);
                // An early stream's level-2 window is at least eight times what it asked, up
                // to STREAM_MIN_BYTES (it cannot overshoot, and local reads are cheap); the
                // backend's keeps its ramp.
                let advance = |until: &mut u64, window: u64, floor: u64| {
                    let window = window.min(covered.saturating_mul(2).max(floor));
                    let from = (*until).max(next);
                    if !dense
                        || (covered < STREAM_MIN_BYTES && !early)
                        || window == 0
                        || from >= limit
                        || from.saturating_sub(end) >= window / 2
                    {
                        return None;
                    }
                    let to = from.saturating_add(window).min(limit);
                    *until = to;
                    Some(from / table.chunk_size..to.div_ceil(table.chunk_size))
                };
                let ahead = advance(&mut state.ahead_until, windows[0], 0);
                let disk_floor = if early {
                    covered.saturating_mul(8).min(STREAM_MIN_BYTES)
                } else {
                    0
                };
                let disk_ahead = match self.inner.disk {
                    Some(_) => advance(&mut state.disk_ahead_until, windows[1], disk_floor),
                    None => None,
                };
                (ahead, disk_ahead)
            } else {
                (None, None)
            }
        };
        if let Some(ra) = ahead {
            let inner = self.inner.clone();
            let t = table.clone();
            tokio::spawn(async move {
                let _ = inner.warm(&t, ra, Priority::Readahead).await;
            });
        }
        if let (Some(ra), Some(disk), Some(shift)) =
            (disk_ahead, self.inner.disk.clone(), disk_shift(&table))
        {
            self.inner.stage(&disk, table.blob, shift, ra);
        }

        let parts = self
            .inner
            .read_parts(&table, first..last + 1, &part, io)
            .await?;

        let n: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let c = &self.inner.counters;
        add(&c.bytes_read, n);
        self.inner.extra.read(blob, n);
        let bucket = super::counters::latency_bucket(started.elapsed());
        add(&c.latency[bucket], 1);
        Ok(parts)
    }

    /// Fetch the chunks covering `ranges` of `blob` in the background, at a lower priority
    /// than demand reads. The handle resolves when they are cached (or failed).
    pub fn prefetch(
        &self,
        blob: Digest,
        ranges: Vec<Range<u64>>,
    ) -> tokio::task::JoinHandle<Result<()>> {
        let this = self.clone();
        tokio::spawn(async move {
            let table = this.register(&blob).await?;
            for r in ranges {
                if r.start >= table.blob_size || r.is_empty() {
                    continue;
                }
                let end = r.end.min(table.blob_size);
                let chunks = (r.start / table.chunk_size)..((end - 1) / table.chunk_size + 1);
                this.inner.warm(&table, chunks, Priority::Prefetch).await?;
            }
            Ok(())
        })
    }

    /// Set where layer `layer`'s files' data runs end in `blob` (byte offsets, any order;
    /// `bounds.rs`), in place of what that layer set before: a reader of one file then reads
    /// ahead only to its end, and, if it began at the file's start, from its first read on.
    /// Several layers sharing a blob each set theirs. Speed only.
    pub fn add_file_bounds(&self, blob: Digest, layer: &str, ends: &[u64]) {
        self.inner.bounds.add(blob, layer, ends);
    }

    /// Forget layer `layer`'s file bounds in `blob` (other layers' stay; with none left, its
    /// readers read ahead as without them).
    pub fn forget_file_bounds(&self, blob: &Digest, layer: &str) {
        self.inner.bounds.forget(blob, layer);
    }

    /// Blobs with file bounds, and their ends in all.
    pub fn file_bounds(&self) -> (usize, usize) {
        self.inner.bounds.counts()
    }

    /// `blob`'s fetch-unit yield now: riders its demand misses' windows offered, and how many
    /// of them were then read (`window.rs`; zeros for a blob with none).
    pub fn fetch_unit_yield(&self, blob: &Digest) -> super::window::Yield {
        self.inner.yields.get(blob)
    }

    /// Counters so far (cumulative across runs when a stats file is configured). Sums
    /// saturate: the stats file's counters are read from disk and may be anything.
    pub fn stats(&self) -> CacheStats {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let b = &self.inner.base;
        // A counter of this run on top of the stats file's.
        let on = |base: u64, now: &AtomicU64| base.saturating_add(g(now));
        let disk = self.inner.disk.as_ref().map(|d| d.stats());
        let (memory_bytes, _) = {
            let m = lock(&self.inner.memory);
            (m.bytes, m.lru.len())
        };
        let mut latency = vec![0u64; LATENCY_BUCKETS];
        for (i, l) in latency.iter_mut().enumerate() {
            *l = on(
                b.read_latency_us.get(i).copied().unwrap_or(0),
                &c.latency[i],
            );
        }
        let hits_memory = on(b.hits_memory, &c.hits_memory);
        let hits_disk = on(b.hits_disk, &c.hits_disk);
        let evictions_memory = on(b.evictions_memory, &c.evictions_memory);
        CacheStats {
            hits: hits_memory.saturating_add(hits_disk),
            hits_memory,
            hits_disk,
            misses: on(b.misses, &c.misses),
            bytes_read: on(b.bytes_read, &c.bytes_read),
            bytes_fetched: on(b.bytes_fetched, &c.bytes_fetched),
            backend_requests: on(b.backend_requests, &c.backend_requests),
            coalesced_chunks: on(b.coalesced_chunks, &c.coalesced_chunks),
            evictions: evictions_memory.saturating_add(disk.map_or(0, |d| d.evictions)),
            evictions_memory,
            verify_failures: on(b.verify_failures, &c.verify_failures),
            corrupt_errors: on(b.corrupt_errors, &c.corrupt_errors),
            backend_errors: on(b.backend_errors, &c.backend_errors),
            readahead_chunks: on(b.readahead_chunks, &c.readahead_chunks),
            disk_readahead_chunks: on(b.disk_readahead_chunks, &c.disk_readahead_chunks),
            disk_readahead_hits: on(b.disk_readahead_hits, &c.disk_readahead_hits),
            prefetch_chunks: on(b.prefetch_chunks, &c.prefetch_chunks),
            trace_chunks: on(b.trace_chunks, &c.trace_chunks),
            disk_writes_skipped: on(b.disk_writes_skipped, &c.disk_writes_skipped),
            fetch_unit_widened: on(b.fetch_unit_widened, &c.fetch_unit_widened),
            fetch_unit_narrowed: on(b.fetch_unit_narrowed, &c.fetch_unit_narrowed),
            read_latency_us: latency,
            memory_bytes,
            memory_capacity: self.inner.config.memory_bytes,
            disk,
            retries: super::counters::retries(
                &self.inner.store.retrying().retry_stats().snapshot(),
                &b.retries,
            ),
            backend_errors_by_kind: self.inner.extra.errors(&b.backend_errors_by_kind),
            fetch_latency_us: self.inner.extra.fetch_latency(&b.fetch_latency_us),
            fetch_latency_sum_us: self.inner.extra.fetch_sum_us(b.fetch_latency_sum_us),
        }
    }

    /// Bytes read and fetched per blob since the cache opened (not kept in the stats file).
    pub fn blob_stats(&self) -> HashMap<Digest, BlobStats> {
        self.inner.extra.blob_stats()
    }

    /// Wait for pending level-2 writes, then persist level 2's recency and the cumulative
    /// counters (the stats file is replaced atomically, [`crate::fsutil::write_atomic`]).
    pub async fn flush(&self) -> Result<()> {
        // Wait for the background writes to level 2 to finish.
        self.inner.writer.drain().await;
        if let Some(d) = self.inner.disk.clone() {
            tokio::task::spawn_blocking(move || d.flush())
                .await
                .map_err(|e| Error::io("flush", "disk cache", std::io::Error::other(e)))??;
        }
        if let Some(p) = self.inner.config.stats_file.clone() {
            let mut s = self.stats();
            s.disk = None;
            let body = serde_json::to_vec_pretty(&s).unwrap_or_default();
            tokio::task::spawn_blocking(move || {
                crate::fsutil::write_atomic(&p, &body).map_err(|e| Error::io("write", &p, e))
            })
            .await
            .map_err(|e| Error::io("write", "stats file", std::io::Error::other(e)))??;
        }
        Ok(())
    }
}

/// Holds the demand-in-flight count up while a demand fetch runs.
struct DemandGuard<'a>(&'a Inner);

impl Drop for DemandGuard<'_> {
    fn drop(&mut self) {
        if self.0.demand_active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.demand_idle.notify_waiters();
        }
    }
}

impl Inner {
    /// The fetch unit (bounded by the largest request), if `table`'s chunks are smaller than
    /// it: a blob whose misses may widen to windows (`window.rs`), whose replays fill gaps, and
    /// whose replays have their own gate ([`TRACE_REQUESTS_IN_FLIGHT_UNIT`]).
    pub(super) fn unit_for(&self, table: &ChunkTable) -> Option<u64> {
        let unit = (self.config.fetch_unit_bytes).min(self.config.max_request_bytes);
        (unit > table.chunk_size).then_some(unit)
    }

    /// Whether level 1 or level 2 holds chunk `id`.
    pub(super) fn holds(&self, id: &ChunkId) -> bool {
        lock(&self.memory).lru.contains(id) || self.disk.as_ref().is_some_and(|d| d.contains(id))
    }

    fn memory_get(&self, id: &ChunkId) -> Option<Bytes> {
        lock(&self.memory).lru.get(id).cloned()
    }

    fn memory_put(&self, id: ChunkId, data: Bytes) {
        let cap = self.config.memory_bytes;
        if data.len() as u64 > cap {
            return;
        }
        let mut m = lock(&self.memory);
        if m.lru.contains(&id) {
            return;
        }
        m.bytes += data.len() as u64;
        m.lru.put(id, data);
        while m.bytes > cap {
            match m.lru.pop_lru() {
                Some((_, old)) => {
                    m.bytes -= old.len() as u64;
                    add(&self.counters.evictions_memory, 1);
                }
                None => break,
            }
        }
    }

    /// Read `chunks` of `blob` (chunks of `1 << shift` bytes) from level 2 into the staging
    /// area ([`Staging`]), in the background: runs of [`DISK_RUN_BYTES`], each claimed now
    /// (readers of its chunks wait for it) and queued, read in order [`DISK_RUNS_IN_FLIGHT`]
    /// at a time on blocking threads ([`RunQueue`]).
    fn stage(self: &Arc<Self>, disk: &Arc<DiskCache>, blob: Digest, shift: u8, chunks: Range<u64>) {
        let run_chunks = (DISK_RUN_BYTES >> shift).max(1);
        let mut at = chunks.start;
        let mut jobs: Vec<RunJob> = Vec::new();
        while at < chunks.end {
            let run = at..(at + run_chunks).min(chunks.end);
            at = run.end;
            let ids = run.map(|index| ChunkId { blob, shift, index });
            // Chunks in memory need no read; chunks not on local disk cannot be read ahead.
            let skip = |id: &ChunkId| lock(&self.memory).lru.contains(id) || !disk.contains(id);
            let Some(claim) = self.staging.claim(ids, skip) else {
                continue;
            };
            // Weak: a queued run must not keep a dropped cache (and its index) open; it is
            // then skipped, and its claim's waiters released.
            let inner = Arc::downgrade(self);
            jobs.push(Box::new(move || {
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                let Some(disk) = inner.disk.clone() else {
                    return;
                };
                let indexes = claim.ids().iter().map(|id| id.index);
                match disk.read_chunks_direct(&blob, shift, indexes) {
                    Ok(read) => {
                        add(&inner.counters.disk_readahead_chunks, read.len() as u64);
                        claim.fill(
                            read.into_iter()
                                .map(|(index, b)| (ChunkId { blob, shift, index }, b))
                                .collect(),
                        );
                    }
                    Err(e) => tracing::debug!(error = %e, "level-2 readahead failed"),
                }
            }));
        }
        self.runs.push(jobs);
    }

    /// Chunk `index`'s verified plain bytes from its stored bytes (decompressed, bounded by
    /// the chunk's length, for a compressed chunk), or `None` if they fail: a damaged or
    /// truncated frame, a wrong length, a wrong digest.
    fn open(table: &ChunkTable, index: u64, stored: &Bytes) -> Option<Bytes> {
        if !table.is_zstd(index) {
            // A plain chunk: the fetched bytes themselves (no copy here).
            return table.verify_plain(index, stored).then(|| stored.clone());
        }
        match table.open_chunk(index, stored) {
            Ok(plain) => Some(Bytes::from(plain)),
            Err(fault) => {
                tracing::warn!(blob = %table.blob, chunk = index, %fault, "stored chunk failed its check");
                None
            }
        }
    }

    /// For each chunk `i` of `range`, bytes `part(i)` of it (chunk coordinates): from level 1,
    /// else level 2 (only the 4 KiB blocks needed, each checked), else the backend.
    async fn read_parts(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        range: Range<u64>,
        part: &(dyn Fn(u64) -> Range<u64> + Sync),
        io: Io,
    ) -> Result<Vec<Bytes>> {
        let n = (range.end - range.start) as usize;
        let mut parts: Vec<Option<Bytes>> = vec![None; n];
        let unit = self.unit_for(table);
        if unit.is_some() {
            self.yields.touched(&table.blob, range.clone());
        }
        let shift = table.chunk_shift();
        let id = |i: u64| ChunkId {
            blob: table.blob,
            shift,
            index: i,
        };
        let mut missing = Vec::new();
        for i in range.clone() {
            let p = part(i);
            if let Some(b) = self.memory_get(&id(i)) {
                add(&self.counters.hits_memory, 1);
                parts[(i - range.start) as usize] = Some(b.slice(p.start as usize..p.end as usize));
            } else if let Some(b) = self.staging.take(&id(i), p.end).await {
                add(&self.counters.hits_disk, 1);
                add(&self.counters.disk_readahead_hits, 1);
                parts[(i - range.start) as usize] = Some(b.slice(p.start as usize..p.end as usize));
            } else {
                missing.push(i);
            }
        }
        if !missing.is_empty() {
            // Level 2's background writes wait while readers need the disk or the backend.
            self.writer.note_demand();
        }
        if let (false, Some(disk)) = (missing.is_empty(), self.disk.clone()) {
            // Only the blocks asked for: reading whole chunks into level 1 instead (so that the
            // next small file of a packed chunk costs no disk read) was measured no faster for
            // a 10% read of small files (`peers`, about two files per chunk) and reads up to
            // 64 times the bytes for scattered 4 KiB reads.
            let wanted: Vec<(u64, Range<u64>)> = missing.iter().map(|&i| (i, part(i))).collect();
            // A caller on a thread that may block (a FUSE worker) reads at once; others read
            // on a thread that may block — after a try that does not wait for the disk when
            // level 2 reads through the page cache (its hits cost no thread hand-off; with
            // O_DIRECT there are none).
            let mut outcomes = if io.may_block() || !disk.direct_reads() {
                disk_reads(&disk, id(0), wanted.clone(), !io.may_block())
            } else {
                (wanted.iter())
                    .map(|(i, p)| (*i, p.clone(), Ok(RangeRead::WouldBlock)))
                    .collect()
            };
            let blocked: Vec<(u64, Range<u64>)> = outcomes
                .iter()
                .filter(|(_, _, r)| matches!(r, Ok(RangeRead::WouldBlock)))
                .map(|(i, p, _)| (*i, p.clone()))
                .collect();
            if !blocked.is_empty() {
                let (d, first) = (disk.clone(), id(0));
                let more =
                    tokio::task::spawn_blocking(move || disk_reads(&d, first, blocked, false))
                        .await
                        .map_err(|e| Error::io("read", "disk cache", std::io::Error::other(e)))?;
                outcomes.retain(|(_, _, r)| !matches!(r, Ok(RangeRead::WouldBlock)));
                outcomes.extend(more);
            }
            missing.clear();
            for (i, p, outcome) in outcomes {
                match outcome {
                    Ok(RangeRead::Hit(bytes)) => {
                        add(&self.counters.hits_disk, 1);
                        let r = table.chunk_range(i);
                        if p.start == 0 && p.end == r.end - r.start {
                            self.memory_put(id(i), bytes.clone());
                        }
                        parts[(i - range.start) as usize] = Some(bytes);
                    }
                    Ok(RangeRead::Corrupt) => {
                        // Damaged on local disk: never served; dropped and refetched.
                        add(&self.counters.verify_failures, 1);
                        tracing::warn!(blob = %table.blob, chunk = i, "chunk on local disk failed its check; dropped");
                        let (d, cid) = (disk.clone(), id(i));
                        let _ = tokio::task::spawn_blocking(move || d.drop_corrupt(&cid)).await;
                        missing.push(i);
                    }
                    Ok(_) => missing.push(i),
                    Err(e) => {
                        tracing::warn!(error = %e, "disk cache read failed; fetching from the backend");
                        missing.push(i);
                    }
                }
            }
            missing.sort_unstable();
        }
        if !missing.is_empty() {
            // The rest of each miss's fetch-unit window rides along in the same requests
            // while that has paid lately in this blob (`window.rs`); the reader waits for
            // (and fails only with) its own chunks.
            let mut extra: Vec<u64> = Vec::new();
            if let Some(unit) = unit {
                let riders: Vec<u64> = super::window::widen(
                    &missing,
                    table.chunk_size,
                    table.chunk_count(),
                    unit,
                    // Chunks in flight are not riders: they are coming anyway (a replay's).
                    |j| self.holds(&id(j)) || lock(&self.inflight).contains_key(&id(j)),
                )
                .into_iter()
                .filter(|j| missing.binary_search(j).is_err())
                .collect();
                let per = super::window::window_chunks(table.chunk_size, table.chunk_count(), unit);
                if riders.is_empty() {
                    // Nothing would ride along: neither widened nor narrowed.
                } else if self.yields.miss(
                    &table.blob,
                    per,
                    &missing,
                    &riders,
                    self.config.fetch_unit_min_yield_pct,
                ) {
                    add(&self.counters.fetch_unit_widened, 1);
                    extra = riders;
                } else {
                    add(&self.counters.fetch_unit_narrowed, 1);
                }
            }
            let fetched = self
                .fetch_chunks(table, &missing, &extra, Priority::Demand, io)
                .await?;
            for (i, b) in missing.iter().zip(fetched) {
                let p = part(*i);
                parts[(*i - range.start) as usize] =
                    Some(b.slice(p.start as usize..p.end as usize));
            }
        }
        Ok(parts.into_iter().flatten().collect())
    }

    /// Make sure the chunks `range` are cached (readahead, prefetch): fetch those in neither
    /// level.
    async fn warm(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        range: Range<u64>,
        priority: Priority,
    ) -> Result<()> {
        self.warm_chunks(table, range, priority).await.map(|_| ())
    }

    /// [`Self::warm`] of any sorted chunk indexes; how many were fetched (or joined in
    /// flight).
    pub(super) async fn warm_chunks(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        chunks: impl IntoIterator<Item = u64>,
        priority: Priority,
    ) -> Result<u64> {
        let shift = table.chunk_shift();
        let missing: Vec<u64> = chunks
            .into_iter()
            .filter(|&index| {
                !self.holds(&ChunkId {
                    blob: table.blob,
                    shift,
                    index,
                })
            })
            .collect();
        if !missing.is_empty() {
            self.fetch_chunks(table, &missing, &[], priority, Io::Offload)
                .await?;
        }
        Ok(missing.len() as u64)
    }
}

/// Where a read's local-disk I/O runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Io {
    /// On a blocking thread of the runtime's pool (the caller is an async task).
    Offload,
    /// On the caller's own thread ([`ChunkCache::read_blocking`]).
    Inline,
}

impl Io {
    fn may_block(self) -> bool {
        self == Io::Inline
    }
}

/// Level-2 reads of `wanted` (chunk index, range in the chunk) of the blob (and chunking) of
/// `chunk`.
fn disk_reads(
    disk: &DiskCache,
    chunk: ChunkId,
    wanted: Vec<(u64, Range<u64>)>,
    nowait: bool,
) -> Vec<(u64, Range<u64>, Result<RangeRead>)> {
    // Adjacent chunks' parts with one read (`DiskCache::read_run`).
    let outcomes = disk.read_run(&chunk, &wanted, nowait);
    (wanted.into_iter().zip(outcomes))
        .map(|((i, p), r)| (i, p, r))
        .collect()
}
