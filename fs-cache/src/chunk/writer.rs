//! Level 2's write queue: verified chunks are kept on local disk in the background.
//!
//! # Invariants
//! - **A reader never waits for a level-2 write.** A verified chunk is queued with permits
//!   for its bytes ([`MAX_PENDING_DISK_BYTES`] of them in all) and served at once; past that
//!   bound it is served but not kept ([`DiskWriter::queue`] says so, the cache counts it).
//! - **Batches.** At most [`DISK_WRITERS`] writer threads; a writer takes up to
//!   [`DISK_BATCH_BYTES`] of queued chunks (one at least) and puts them as one batch
//!   ([`DiskCache::put_many`]: one `fdatasync` per blob file, one index write). A chunk's
//!   permits go once its batch is done, put or failed.
//! - **Writes wait for a quiet moment.** A writer that finds less than [`DISK_EAGER_BYTES`]
//!   queued writes it once no demand read has begun for [`DISK_QUIET`]
//!   ([`DiskWriter::note_demand`]), or once the oldest queued chunk has waited
//!   [`DISK_LINGER`], or at once when that much is queued or someone drains the queue
//!   ([`DiskWriter::drain`]). Cold misses of small files
//!   arrive a few hundred microseconds apart; written as they came, each batch's writes,
//!   `fdatasync` and index write competed with the reader's own reads for the disk (a cold
//!   read of every 10th file of a Debian root took up to twice as long as with level 2 off:
//!   `bench/README.md`, "peers").
//! - **Drain.** After [`DiskWriter::drain`] returns, every chunk queued before it was called
//!   is on disk or was dropped (a failed batch).
//! - **No orphaned permit.** A writer that dies (a panic, a runtime that refuses the task)
//!   gives its slot back and drops what is queued, so that nothing waits on permits that no
//!   writer will return.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::cache::lock;
use super::disk::DiskCache;
use super::ChunkId;

/// Bytes of fetched chunks waiting to be written to level 2 in the background; past this, new
/// chunks are served but not kept on disk (and counted). 256 MiB, most of it shared with
/// level 1 (the chunks queued last are the ones level 1 took last): with 16 MiB, a cold read
/// of every file of a plain 780 MB layer at 500-700 MB/s left 156-311 chunks of 256 KiB out
/// of level 2 (`cargo bench -p bench --bench peers`), so the layer was not wholly local at
/// its next mount; it is [`DISK_EAGER_BYTES`] plus the 96 MiB of headroom a streaming reader
/// needs while a batch is synced.
pub const MAX_PENDING_DISK_BYTES: u64 = 256 << 20;
/// The unit of the pending-write permits: a chunk takes one per 4 KiB (at least one).
const PENDING_UNIT: u64 = 4096;
/// All the pending-write permits.
const PENDING_PERMITS: u32 = (MAX_PENDING_DISK_BYTES / PENDING_UNIT) as u32;
const _: () = assert!(MAX_PENDING_DISK_BYTES / PENDING_UNIT <= Semaphore::MAX_PERMITS as u64);
/// Level-2 writers at once: while one syncs its batch, the other writes the next.
pub const DISK_WRITERS: usize = 2;
/// Bytes per level-2 write batch (one chunk at least): 64 chunks of 256 KiB.
pub const DISK_BATCH_BYTES: u64 = 16 << 20;
/// Queued bytes that a writer writes at once, quiet or not: a reader streaming at disk speed
/// fills the pending bound (and chunks go unkept) if the writers wait much longer. A burst
/// of misses stays under it and is written after it ends: with 4 MiB, the cold read of every
/// 10th file of a Debian root (~20 MB of plain chunks) wrote 4-5 batches while it ran, and
/// took 1.15× as long as with no write during it; with 32 MiB, the cold read of every 10th
/// file of `/usr/lib/x86_64-linux-gnu` (156 MB, a 110 MB library among them) took 0.27 s
/// (median of 4) against 0.21 s with level 2 off, and 0.22 s with this (`bench/README.md`,
/// "peers").
pub const DISK_EAGER_BYTES: u64 = 160 << 20;
/// How long the cache must have had no demand read for a writer to write less than
/// [`DISK_EAGER_BYTES`].
pub const DISK_QUIET: Duration = Duration::from_millis(50);
/// How long a queued chunk waits at most for a quiet moment or [`DISK_EAGER_BYTES`]. A
/// daemon killed meanwhile loses what waited (the next one fetches it again): with 2 s,
/// readers that never paused kept level 2 empty across a daemon killed every ~0.6 s
/// (`tests/restart.rs` over S3 read 864 files instead of over 1,000). 500 ms outlasts a
/// sandbox's first burst of small-file misses (0.1-0.3 s for a tenth of a Debian root) and
/// still writes twice a second under readers that never pause.
pub const DISK_LINGER: Duration = Duration::from_millis(500);
/// The linger of a daemon that has just resumed another's mounts (a crash, a takeover), for
/// its first [`RESUMED_FOR`]: one that is crash-looping keeps on disk what it fetched
/// before the next crash (`tests/restart.rs` over S3, a daemon killed every ~0.5 s under
/// readers that never pause: 722-827 files read with 500 ms throughout, 2,765-2,877 with
/// this after each restart).
pub const RESUMED_DISK_LINGER: Duration = Duration::from_millis(100);
/// How long a resumed daemon keeps [`RESUMED_DISK_LINGER`].
pub const RESUMED_FOR: Duration = Duration::from_secs(60);

/// The pending-write permits of a chunk of `len` bytes.
fn pending_permits(len: usize) -> u32 {
    (len as u64)
        .div_ceil(PENDING_UNIT)
        .clamp(1, u64::from(PENDING_PERMITS)) as u32
}

/// A chunk waiting for a writer.
struct Pending {
    id: ChunkId,
    data: Bytes,
    /// Given back when the chunk's batch is done.
    _permit: OwnedSemaphorePermit,
    queued: Instant,
}

#[derive(Default)]
struct Queue {
    chunks: Vec<Pending>,
    bytes: u64,
}

/// The queue and its writers (one per cache).
pub(super) struct DiskWriter {
    permits: Arc<Semaphore>,
    queue: Mutex<Queue>,
    /// Wakes lingering writers: a batch filled, or a drain began.
    wake: Condvar,
    writers: AtomicUsize,
    draining: AtomicUsize,
    /// When the last demand read began, in microseconds since `base`.
    last_demand_us: AtomicU64,
    base: Instant,
    quiet: Duration,
    /// [`DISK_LINGER`] in microseconds; [`DiskWriter::set_linger`] changes it.
    linger_us: AtomicU64,
}

impl DiskWriter {
    pub(super) fn new() -> Arc<Self> {
        Self::with_linger(DISK_QUIET, DISK_LINGER)
    }

    pub(super) fn with_linger(quiet: Duration, linger: Duration) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(PENDING_PERMITS as usize)),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            writers: AtomicUsize::new(0),
            draining: AtomicUsize::new(0),
            last_demand_us: AtomicU64::new(0),
            base: Instant::now(),
            quiet,
            linger_us: AtomicU64::new(linger.as_micros() as u64),
        })
    }

    /// From now on a queued chunk waits at most `linger` for a quiet moment (writers waiting
    /// already see it when they next wake, at most the old linger later).
    pub(super) fn set_linger(&self, linger: Duration) {
        self.linger_us
            .store(linger.as_micros() as u64, Ordering::Release);
        let _q = lock(&self.queue);
        self.wake.notify_all();
    }

    fn linger(&self) -> Duration {
        Duration::from_micros(self.linger_us.load(Ordering::Acquire))
    }

    /// A demand read (a reader waits for it) needs the disk or the backend now: writers hold
    /// back until the cache has been quiet for a while.
    pub(super) fn note_demand(&self) {
        let now = self.base.elapsed().as_micros() as u64;
        self.last_demand_us.fetch_max(now, Ordering::AcqRel);
    }

    /// How long ago the last demand read began.
    fn since_demand(&self) -> Duration {
        let last = Duration::from_micros(self.last_demand_us.load(Ordering::Acquire));
        self.base.elapsed().saturating_sub(last)
    }

    /// Queue `data` (chunk `id`, verified) for `disk` and make sure a writer runs. `false`:
    /// the pending bound is reached, the chunk is not kept.
    pub(super) fn queue(self: &Arc<Self>, disk: &Arc<DiskCache>, id: ChunkId, data: Bytes) -> bool {
        let Ok(permit) = self
            .permits
            .clone()
            .try_acquire_many_owned(pending_permits(data.len()))
        else {
            return false;
        };
        {
            let mut q = lock(&self.queue);
            q.bytes += data.len() as u64;
            q.chunks.push(Pending {
                id,
                data,
                _permit: permit,
                queued: Instant::now(),
            });
            if q.bytes >= DISK_EAGER_BYTES {
                self.wake.notify_all();
            }
        }
        self.start(disk);
        true
    }

    /// Wait until every chunk queued so far is written (or dropped), without lingering.
    pub(super) async fn drain(&self) {
        self.draining.fetch_add(1, Ordering::AcqRel);
        {
            // Under the lock: a writer that saw no drain is waiting on `wake` by now.
            let _q = lock(&self.queue);
            self.wake.notify_all();
        }
        drop(self.permits.acquire_many(PENDING_PERMITS).await);
        self.draining.fetch_sub(1, Ordering::AcqRel);
    }

    /// Start a writer unless [`DISK_WRITERS`] run already.
    fn start(self: &Arc<Self>, disk: &Arc<DiskCache>) {
        if !self.claim() {
            return;
        }
        // The slot is given back however the writer ends.
        let mut slot = WriterSlot {
            writer: self.clone(),
            ended: false,
        };
        let disk = disk.clone();
        tokio::task::spawn_blocking(move || loop {
            let writer = &slot.writer;
            let batch = writer.next_batch();
            if batch.is_empty() {
                writer.writers.fetch_sub(1, Ordering::AcqRel);
                // A chunk queued between the batch and the line above found every writer
                // slot taken and started none: take it on (or leave it to a writer that
                // claimed a slot meanwhile).
                if lock(&writer.queue).chunks.is_empty() || !writer.claim() {
                    slot.end();
                    return;
                }
                continue;
            }
            let chunks: Vec<(ChunkId, &[u8])> = batch.iter().map(|p| (p.id, &p.data[..])).collect();
            if let Err(e) = disk.put_many(&chunks) {
                tracing::warn!(error = %e, chunks = chunks.len(), "could not keep chunks on local disk");
            }
        });
    }

    /// The next batch: up to [`DISK_BATCH_BYTES`] of the oldest queued chunks, once
    /// [`DISK_EAGER_BYTES`] are queued, the oldest has lingered long enough, the cache is
    /// quiet, or a drain began; empty when nothing is queued.
    fn next_batch(&self) -> Vec<Pending> {
        let mut q = lock(&self.queue);
        loop {
            let Some(first) = q.chunks.first() else {
                return Vec::new();
            };
            if q.bytes >= DISK_EAGER_BYTES || self.draining.load(Ordering::Acquire) > 0 {
                break;
            }
            let (waited, since, linger) =
                (first.queued.elapsed(), self.since_demand(), self.linger());
            if waited >= linger || since >= self.quiet {
                break;
            }
            let wait = (linger - waited).min(self.quiet - since);
            q = match self.wake.wait_timeout(q, wait) {
                Ok((q, _)) => q,
                Err(p) => p.into_inner().0,
            };
        }
        let mut bytes = 0;
        let n = q
            .chunks
            .iter()
            .take_while(|p| {
                let fits = bytes == 0 || bytes + p.data.len() as u64 <= DISK_BATCH_BYTES;
                bytes += p.data.len() as u64;
                fits
            })
            .count();
        let batch: Vec<Pending> = q.chunks.drain(..n).collect();
        q.bytes -= batch.iter().map(|p| p.data.len() as u64).sum::<u64>();
        batch
    }

    /// Take one of the [`DISK_WRITERS`] writer slots, if one is free.
    fn claim(&self) -> bool {
        (self.writers)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < DISK_WRITERS).then_some(n + 1)
            })
            .is_ok()
    }
}

/// A writer's slot. A writer that ends normally gives its slot back itself (`ended`);
/// dropped otherwise, it gives the slot back and drops what is queued, so that no chunk's
/// permits wait for a writer that is gone ([`DiskWriter::drain`] waits for all of them).
struct WriterSlot {
    writer: Arc<DiskWriter>,
    ended: bool,
}

impl WriterSlot {
    /// The writer gave its slot back itself.
    fn end(&mut self) {
        self.ended = true;
    }
}

impl Drop for WriterSlot {
    fn drop(&mut self) {
        if !self.ended {
            self.writer.writers.fetch_sub(1, Ordering::AcqRel);
            let mut q = lock(&self.writer.queue);
            q.chunks.clear();
            q.bytes = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::disk::DiskCacheConfig;
    use crate::store::Digest;

    fn disk(dir: &tempfile::TempDir) -> Arc<DiskCache> {
        Arc::new(
            DiskCache::open(DiskCacheConfig {
                dir: dir.path().join("cache"),
                capacity: 1 << 30,
            })
            .unwrap(),
        )
    }

    fn chunk(index: u64) -> (ChunkId, Bytes) {
        let id = ChunkId::new(Digest::of(b"writer test blob"), 16, index);
        (id, Bytes::from(vec![index as u8 + 1; 64 << 10]))
    }

    /// Poll until `f` holds or `within` passes.
    async fn eventually(within: Duration, f: impl Fn() -> bool) -> bool {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if f() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        f()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_wait_while_readers_need_the_disk_and_go_once_it_is_quiet() {
        let dir = tempfile::tempdir().unwrap();
        let disk = disk(&dir);
        let writer = DiskWriter::with_linger(Duration::from_millis(100), Duration::from_secs(30));
        writer.note_demand();
        let (id, data) = chunk(0);
        assert!(writer.queue(&disk, id, data.clone()));
        // Demand keeps coming for 400 ms: nothing is written meanwhile.
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(400) {
            writer.note_demand();
            assert!(!disk.contains(&id), "written while readers were busy");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Quiet: written after the quiet period.
        assert!(eventually(Duration::from_secs(5), || disk.contains(&id)).await);
        writer.drain().await;
        assert_eq!(&disk.get(&id).unwrap().unwrap()[..], &data[..]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chunk_waits_no_longer_than_the_linger_and_a_drain_does_not_wait() {
        let dir = tempfile::tempdir().unwrap();
        let disk = disk(&dir);
        // Readers never stop; the linger bounds the wait.
        let writer = DiskWriter::with_linger(Duration::from_secs(30), Duration::from_millis(200));
        writer.note_demand();
        let (a, data) = chunk(1);
        assert!(writer.queue(&disk, a, data));
        assert!(!disk.contains(&a));
        assert!(eventually(Duration::from_secs(5), || disk.contains(&a)).await);

        let writer = DiskWriter::with_linger(Duration::from_secs(30), Duration::from_secs(30));
        writer.note_demand();
        let (b, data) = chunk(2);
        assert!(writer.queue(&disk, b, data));
        let started = Instant::now();
        writer.drain().await;
        assert!(disk.contains(&b));
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "drain waited for the linger"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shorter_linger_applies_to_what_is_queued_already() {
        let dir = tempfile::tempdir().unwrap();
        let disk = disk(&dir);
        let writer = DiskWriter::with_linger(Duration::from_secs(30), Duration::from_secs(30));
        writer.note_demand();
        let (id, data) = chunk(3);
        assert!(writer.queue(&disk, id, data));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!disk.contains(&id));
        let set = Instant::now();
        writer.set_linger(Duration::from_millis(50));
        assert!(eventually(Duration::from_secs(5), || disk.contains(&id)).await);
        assert!(
            set.elapsed() < Duration::from_secs(5),
            "waited for the old linger"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_starts_once_the_eager_bytes_are_queued() {
        let dir = tempfile::tempdir().unwrap();
        let disk = disk(&dir);
        let writer = DiskWriter::with_linger(Duration::from_secs(30), Duration::from_secs(30));
        writer.note_demand();
        let blob = Digest::of(b"a batch");
        let n = DISK_EAGER_BYTES / (256 << 10);
        let id = |i| ChunkId::new(blob, 18, i);
        for i in 0..n - 1 {
            assert!(writer.queue(&disk, id(i), Bytes::from(vec![7u8; 256 << 10])));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !disk.contains(&id(0)),
            "less than the eager bytes were written"
        );
        assert!(writer.queue(&disk, id(n - 1), Bytes::from(vec![7u8; 256 << 10])));
        // The oldest batch goes at once; what is left under the eager bytes waits (quiet,
        // linger) unless drained.
        let batch = DISK_BATCH_BYTES / (256 << 10);
        assert!(
            eventually(Duration::from_secs(10), || (0..batch)
                .all(|i| disk.contains(&id(i))))
            .await
        );
        writer.drain().await;
        assert!((0..n).all(|i| disk.contains(&id(i))));
    }
}
