//! Recording and replaying access traces ([`crate::trace`]) in the chunk cache.
//!
//! - **Recording**: while a [`Recording`] of some blobs is open, every demand read of those
//!   blobs ([`ChunkCache::read`], whatever level serves it) appends its byte range; readahead,
//!   prefetch and replays are not reads and are not recorded. A recording keeps at most
//!   [`MAX_RECORDED_READS`] reads (the rest are dropped, so a busy node's memory stays
//!   bounded) and costs one relaxed atomic load per read when no recording is open.
//! - **Replay**: a trace's entries, in order, become the chunks they cover. Per blob these
//!   are sorted (in a blob of chunks smaller than the fetch unit, the smallest gaps between
//!   them filled, up to half again as many chunks, for fewer requests: `window::fill_gaps`), cut
//!   into runs of adjacent chunks (one ranged request each, like any miss's), and the runs
//!   are fetched in the order their chunks were first read, many issued at once, at
//!   `Priority::Trace`: below demand reads (a demand reader that needs a chunk a replay is
//!   fetching joins that fetch and raises it), but not held back while demand reads run.
//!   Entries beyond a blob's end, and blobs the cache cannot register, are skipped and
//!   counted: a trace is advice, and a stale one costs fetches, never wrong bytes.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;

use super::cache::{lock, ChunkCache, Inner, Priority};
use super::table::ChunkTable;
use super::ChunkId;
use crate::error::Result;
use crate::store::Digest;
use crate::trace::Trace;

/// Reads kept by one recording at most.
pub const MAX_RECORDED_READS: usize = 1 << 18;
/// Replay runs (requests of adjacent chunks) issued at once; the cache's trace gate bounds
/// the requests actually in flight.
const REPLAY_RUNS_IN_FLIGHT: usize = 32;

/// One open recording: the blobs it watches and the reads so far.
pub(crate) struct Recorder {
    blobs: Vec<Digest>,
    reads: Mutex<Vec<(Digest, Range<u64>)>>,
    started: Instant,
}

/// An open recording (see the module docs); [`ChunkCache::finish_recording`] closes it and
/// gives its trace. Dropped without that, it stops recording.
pub struct Recording {
    recorder: Arc<Recorder>,
    cache: ChunkCache,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("blobs", &self.recorder.blobs)
            .field("reads", &lock(&self.recorder.reads).len())
            .finish()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.cache.inner.stop_recording(&self.recorder);
    }
}

/// What a replay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Distinct chunks the trace names.
    pub chunks: u64,
    /// Chunks fetched by the replay (or joined while another reader fetched them): those of
    /// the trace's not cached already, and the chunks of the gaps it filled (`fill_gaps`).
    /// The cache's `trace_chunks` counter counts the same.
    pub fetched: u64,
    /// Entries skipped: past their blob's end, or of a blob that could not be registered.
    pub skipped: u64,
}

impl Inner {
    /// Note a demand read of `range` of `blob` in every open recording of it.
    pub(super) fn note_read(&self, blob: &Digest, range: Range<u64>) {
        let recs = lock(&self.recordings);
        for r in recs.iter().filter(|r| r.blobs.contains(blob)) {
            let mut reads = lock(&r.reads);
            if reads.len() < MAX_RECORDED_READS {
                reads.push((*blob, range.clone()));
            }
        }
    }

    fn stop_recording(&self, rec: &Arc<Recorder>) {
        let mut recs = lock(&self.recordings);
        let before = recs.len();
        recs.retain(|r| !Arc::ptr_eq(r, rec));
        if recs.len() < before {
            self.recording.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl ChunkCache {
    /// Start recording the demand reads of `blobs` (a layer's blobs, in device order).
    pub fn record(&self, blobs: Vec<Digest>) -> Recording {
        let recorder = Arc::new(Recorder {
            blobs,
            reads: Mutex::new(Vec::new()),
            started: Instant::now(),
        });
        {
            let mut recs = lock(&self.inner.recordings);
            recs.push(recorder.clone());
            self.inner.recording.fetch_add(1, Ordering::Relaxed);
        }
        Recording {
            recorder,
            cache: self.clone(),
        }
    }

    /// Close `rec` and return its trace (empty if nothing was read).
    pub fn finish_recording(&self, rec: Recording) -> Trace {
        self.inner.stop_recording(&rec.recorder);
        let reads = std::mem::take(&mut *lock(&rec.recorder.reads));
        let ms = rec.recorder.started.elapsed().as_millis();
        Trace::from_reads(
            rec.recorder.blobs.clone(),
            reads,
            u32::try_from(ms).unwrap_or(u32::MAX),
        )
    }

    /// Replay `trace` as prefetch (see the module docs), in the background; the handle
    /// resolves when every run is cached or failed (the first error).
    pub fn replay(&self, trace: Trace) -> tokio::task::JoinHandle<Result<ReplayStats>> {
        let this = self.clone();
        tokio::spawn(async move { this.replay_now(&trace).await })
    }

    async fn replay_now(&self, trace: &Trace) -> Result<ReplayStats> {
        let mut stats = ReplayStats::default();
        let mut tables = Vec::with_capacity(trace.blobs.len());
        for b in &trace.blobs {
            tables.push(self.register(b).await.ok());
        }
        // The trace's chunks in first-read order, each once.
        let mut seen = std::collections::HashSet::new();
        let mut order: Vec<(usize, u64)> = Vec::new();
        for e in &trace.entries {
            let Some(Some(table)) = tables.get(usize::from(e.blob)) else {
                stats.skipped += 1;
                continue;
            };
            let r = e.bytes();
            if r.start >= table.blob_size {
                stats.skipped += 1;
                continue;
            }
            let end = r.end.min(table.blob_size);
            for c in r.start / table.chunk_size..end.div_ceil(table.chunk_size) {
                if seen.insert((e.blob, c)) {
                    order.push((usize::from(e.blob), c));
                }
            }
        }
        stats.chunks = order.len() as u64;
        // Per blob, its chunks not cached already, sorted (in a blob of chunks smaller than
        // the fetch unit, with the smallest gaps filled: half again as many chunks at most,
        // for fewer requests; not whole windows, since the trace says what will be read and
        // riders it does not list were seen to cost more bytes than they save requests,
        // `window.rs`) and cut into runs of adjacent chunks, one request each; runs fetched
        // in the order their chunks were first read.
        let rank: HashMap<(usize, u64), usize> =
            order.iter().enumerate().map(|(k, &bc)| (bc, k)).collect();
        let mut per_blob: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for &(b, c) in &order {
            per_blob.entry(b).or_default().push(c);
        }
        let mut runs: Vec<(usize, Arc<ChunkTable>, Vec<u64>)> = Vec::new();
        for (b, mut chunks) in per_blob {
            let Some(Some(table)) = tables.get(b) else {
                continue;
            };
            chunks.sort_unstable();
            let shift = table.chunk_shift();
            let blob = table.blob;
            chunks.retain(|&index| !self.inner.holds(&ChunkId { blob, shift, index }));
            let mut most = (self.inner.config.max_request_bytes / table.chunk_size).max(1);
            if let Some(unit) = self.inner.unit_for(table) {
                // Gaps no longer than a window less one (a longer one saves no request), and
                // requests of at most one window, as a widened miss's.
                let per = super::window::window_chunks(table.chunk_size, table.chunk_count(), unit);
                chunks = super::window::fill_gaps(&chunks, chunks.len() as u64 / 2, per - 1);
                most = most.min(per);
            }
            let most = most as usize;
            let mut run: Vec<u64> = Vec::new();
            let mut first = usize::MAX;
            for (k, &c) in chunks.iter().enumerate() {
                run.push(c);
                first = first.min(rank.get(&(b, c)).copied().unwrap_or(usize::MAX));
                let next = chunks.get(k + 1);
                if next != Some(&(c + 1)) || run.len() >= most {
                    runs.push((first, table.clone(), std::mem::take(&mut run)));
                    first = usize::MAX;
                }
            }
        }
        runs.sort_by_key(|r| r.0);
        let runs = runs.into_iter().map(|(_, table, run)| {
            let inner = self.inner.clone();
            async move { inner.warm_chunks(&table, run, Priority::Trace).await }
        });
        let mut results = futures::stream::iter(runs).buffered(REPLAY_RUNS_IN_FLIGHT);
        while let Some(r) = results.next().await {
            stats.fetched += r?;
        }
        Ok(stats)
    }
}
