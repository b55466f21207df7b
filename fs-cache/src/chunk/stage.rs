//! The staging area: chunks read ahead from level 2 for sequential readers.
//!
//! A sequential stream's next chunks are read from level 2 in runs (`O_DIRECT`, see
//! [`super::disk::DiskCache::read_chunks_direct`]) before the reader asks, in the order they
//! were queued and a few at a time ([`RunQueue`]). A run is
//! *claimed* first: its chunks are marked pending, and a reader that wants one of them waits
//! for the run instead of reading the same bytes again. A filled chunk stays until a read
//! reaches its end (the stream has passed it) or it is pushed out, oldest first, past the
//! capacity. A claim that ends without filling (an error, a panic) releases its chunks and
//! wakes the waiters, who then read level 2 themselves. Every staged chunk was checked
//! against its crc32c when read, so the area never holds a wrong byte.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use lru::LruCache;
use tokio::sync::Notify;

use super::ChunkId;

struct State {
    /// Chunks being read by a claim; their readers wait on the claim's notify.
    pending: HashMap<ChunkId, Arc<Notify>>,
    /// Filled chunks, oldest first out.
    ready: LruCache<ChunkId, Bytes>,
    /// Bytes of the ready chunks.
    bytes: u64,
}

/// See the module docs.
pub(super) struct Staging {
    state: Mutex<State>,
    capacity: u64,
}

/// Chunks being read into the staging area (see [`Staging::claim`]).
pub(super) struct Claim {
    staging: Arc<Staging>,
    ids: Vec<ChunkId>,
    notify: Arc<Notify>,
}

impl Staging {
    pub(super) fn new(capacity: u64) -> Self {
        Self {
            state: Mutex::new(State {
                pending: HashMap::new(),
                ready: LruCache::unbounded(),
                bytes: 0,
            }),
            capacity,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No panics happen under this lock.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claim the chunks of `ids` that are neither staged nor pending, except those `skip`
    /// names (already cached in memory): `None` if there are none.
    pub(super) fn claim(
        self: &Arc<Self>,
        ids: impl IntoIterator<Item = ChunkId>,
        skip: impl Fn(&ChunkId) -> bool,
    ) -> Option<Claim> {
        let notify = Arc::new(Notify::new());
        let mut st = self.lock();
        let ids: Vec<ChunkId> = ids
            .into_iter()
            .filter(|id| !st.pending.contains_key(id) && !st.ready.contains(id) && !skip(id))
            .collect();
        if ids.is_empty() {
            return None;
        }
        for id in &ids {
            st.pending.insert(*id, notify.clone());
        }
        Some(Claim {
            staging: self.clone(),
            ids,
            notify,
        })
    }

    /// A staged chunk, waiting if it is being read; a read that reaches its end (`end`, in
    /// the chunk's coordinates) takes it out. `None` if it is not staged (or its read failed).
    pub(super) async fn take(&self, id: &ChunkId, end: u64) -> Option<Bytes> {
        loop {
            let notify;
            let notified;
            {
                let mut st = self.lock();
                if let Some(b) = st.ready.peek(id).cloned() {
                    if end >= b.len() as u64 {
                        st.ready.pop(id);
                        st.bytes -= b.len() as u64;
                    }
                    return Some(b);
                }
                notify = st.pending.get(id)?.clone();
                // Created under the lock: the claim's wake-up cannot be missed.
                notified = notify.notified();
            }
            notified.await;
        }
    }

    /// Ready bytes held.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.lock().bytes
    }
}

impl Claim {
    /// The claimed chunks (in the order claimed).
    pub(super) fn ids(&self) -> &[ChunkId] {
        &self.ids
    }

    /// Store the chunks read (those claimed; others are ignored) and release the claim.
    pub(super) fn fill(self, read: Vec<(ChunkId, Bytes)>) {
        let staging = &self.staging;
        let mut st = staging.lock();
        for (id, bytes) in read {
            match st.pending.get(&id) {
                Some(n) if Arc::ptr_eq(n, &self.notify) => {}
                _ => continue,
            }
            st.pending.remove(&id);
            st.bytes += bytes.len() as u64;
            st.ready.push(id, bytes);
        }
        while st.bytes > staging.capacity {
            let Some((_, old)) = st.ready.pop_lru() else {
                break;
            };
            st.bytes -= old.len() as u64;
        }
        // Drop (below) releases what was not filled and wakes the waiters.
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        {
            let mut st = self.staging.lock();
            for id in &self.ids {
                if st
                    .pending
                    .get(id)
                    .is_some_and(|n| Arc::ptr_eq(n, &self.notify))
                {
                    st.pending.remove(id);
                }
            }
        }
        self.notify.notify_waiters();
    }
}

/// A level-2 readahead run's read: reads it, fills its claim.
pub(super) type RunJob = Box<dyn FnOnce() + Send>;

/// Level-2 readahead runs, read in the order they were queued, at most `depth` at once, each
/// on a blocking thread. Spawned all at once, a window's runs (and the next window's) shared
/// the disk and came back together, 5 ms after they were issued, so that a reader waited for
/// the whole batch however soon its own run could have come (`bench/README.md`, "peers").
pub(super) struct RunQueue {
    jobs: Mutex<VecDeque<RunJob>>,
    /// Threads reading runs now.
    readers: AtomicUsize,
    depth: usize,
}

impl RunQueue {
    pub(super) fn new(depth: usize) -> Arc<Self> {
        Arc::new(Self {
            jobs: Mutex::new(VecDeque::new()),
            readers: AtomicUsize::new(0),
            depth: depth.max(1),
        })
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<RunJob>> {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queue `jobs` (in order) and start readers up to the depth. Called on a runtime.
    pub(super) fn push(self: &Arc<Self>, jobs: impl IntoIterator<Item = RunJob>) {
        let queued = {
            let mut q = self.lock();
            q.extend(jobs);
            q.len()
        };
        for _ in 0..queued {
            if !self.claim() {
                break;
            }
            let queue = self.clone();
            tokio::task::spawn_blocking(move || queue.read());
        }
    }

    /// Take a reader slot, if one is free.
    fn claim(&self) -> bool {
        (self.readers)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.depth).then_some(n + 1)
            })
            .is_ok()
    }

    /// A reader: runs the queued jobs, oldest first, until none is left.
    fn read(&self) {
        loop {
            let job = self.lock().pop_front();
            match job {
                // A job that panics has dropped its claim (its waiters read level 2
                // themselves); the reader goes on with the rest.
                Some(job) => {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
                None => {
                    self.readers.fetch_sub(1, Ordering::AcqRel);
                    // A job queued after the pop above found every slot taken and started no
                    // reader: take it on (or leave it to one that claimed a slot meanwhile).
                    if self.lock().is_empty() || !self.claim() {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Digest;

    fn id(index: u64) -> ChunkId {
        ChunkId::new(Digest::of(b"blob"), 18, index)
    }

    #[tokio::test]
    async fn readers_wait_for_a_claim_and_take_what_it_filled() {
        let s = Arc::new(Staging::new(1 << 20));
        let claim = s.claim((0..3).map(id), |c| c.index == 1).expect("claim");
        assert_eq!(claim.ids(), &[id(0), id(2)]);
        // Pending chunks are not claimed twice.
        let other = s.claim((0..3).map(id), |_| false).expect("chunk 1 is free");
        assert_eq!(other.ids(), &[id(1)]);
        drop(other);
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.take(&id(0), 4).await });
        tokio::task::yield_now().await;
        claim.fill(vec![
            (id(0), Bytes::from_static(b"abcd")),
            (id(2), Bytes::from_static(b"xy")),
        ]);
        assert_eq!(waiter.await.unwrap().as_deref(), Some(&b"abcd"[..]));
        // Taken out by a read to its end; a partial read leaves it.
        assert_eq!(s.take(&id(0), 4).await, None);
        assert_eq!(s.take(&id(2), 1).await.as_deref(), Some(&b"xy"[..]));
        assert_eq!(s.bytes(), 2);
        assert_eq!(s.take(&id(2), 2).await.as_deref(), Some(&b"xy"[..]));
        assert_eq!(s.bytes(), 0);
    }

    #[tokio::test]
    async fn an_unfilled_claim_releases_its_waiters() {
        let s = Arc::new(Staging::new(1 << 20));
        let claim = s.claim([id(7)], |_| false).expect("claim");
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.take(&id(7), 1).await });
        tokio::task::yield_now().await;
        drop(claim);
        assert_eq!(waiter.await.unwrap(), None);
        // Claimable again.
        assert!(s.claim([id(7)], |_| false).is_some());
    }

    #[tokio::test]
    async fn capacity_pushes_out_the_oldest() {
        let s = Arc::new(Staging::new(8));
        for i in 0..4 {
            let c = s.claim([id(i)], |_| false).expect("claim");
            c.fill(vec![(id(i), Bytes::from(vec![i as u8; 4]))]);
        }
        assert_eq!(s.bytes(), 8);
        assert_eq!(s.take(&id(0), 0).await, None);
        assert_eq!(s.take(&id(1), 0).await, None);
        assert_eq!(s.take(&id(3), 0).await.as_deref(), Some(&[3u8; 4][..]));
    }

    /// Pushes `jobs` to `q` as jobs that record their number in `order`, track how many run
    /// at once in `most`, sleep 2 ms, and panic for `panic_at`; waits until all ran.
    async fn run_all(
        q: &Arc<RunQueue>,
        batches: &[std::ops::Range<usize>],
        panic_at: Option<usize>,
    ) -> (Vec<usize>, usize) {
        use std::time::Duration;
        let order = Arc::new(Mutex::new(Vec::new()));
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let job = |i: usize| -> RunJob {
            let (order, now, most) = (order.clone(), now.clone(), most.clone());
            Box::new(move || {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(n, Ordering::SeqCst);
                order.lock().unwrap().push(i);
                std::thread::sleep(Duration::from_millis(2));
                now.fetch_sub(1, Ordering::SeqCst);
                if Some(i) == panic_at {
                    panic!("run {i}'s read panics (this test's own panic, expected)");
                }
            })
        };
        let total: usize = batches.iter().map(|b| b.len()).sum();
        for b in batches {
            q.push(b.clone().map(job));
        }
        let start = std::time::Instant::now();
        while order.lock().unwrap().len() < total || q.readers.load(Ordering::SeqCst) > 0 {
            let got = order.lock().unwrap().clone();
            assert!(start.elapsed() < Duration::from_secs(20), "{got:?}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let got = order.lock().unwrap().clone();
        (got, most.load(Ordering::SeqCst))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_are_read_in_queue_order_and_a_panic_stops_nothing() {
        let q = RunQueue::new(1);
        let (order, most) = run_all(&q, &[0..6, 6..10], Some(3)).await;
        assert_eq!(order, (0..10).collect::<Vec<_>>());
        assert_eq!(most, 1);
        // Idle again: a later push starts a reader.
        let (order, _) = run_all(&q, &[10..11, 11..12], None).await;
        assert_eq!(order, [10, 11]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_most_depth_runs_are_read_at_once() {
        let q = RunQueue::new(2);
        let (mut order, most) = run_all(&q, &[0..8, 8..16], None).await;
        assert!((1..=2).contains(&most), "{most}");
        order.sort_unstable();
        assert_eq!(order, (0..16).collect::<Vec<_>>());
    }
}
