//! The staging area: chunks read ahead from level 2 for sequential readers.
//!
//! A sequential stream's next chunks are read from level 2 in runs (`O_DIRECT`, several at
//! once, see [`super::disk::DiskCache::read_chunks_direct`]) before the reader asks. A run is
//! *claimed* first: its chunks are marked pending, and a reader that wants one of them waits
//! for the run instead of reading the same bytes again. A filled chunk stays until a read
//! reaches its end (the stream has passed it) or it is pushed out, oldest first, past the
//! capacity. A claim that ends without filling (an error, a panic) releases its chunks and
//! wakes the waiters, who then read level 2 themselves. Every staged chunk was checked
//! against its crc32c when read, so the area never holds a wrong byte.

use std::collections::HashMap;
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
}
