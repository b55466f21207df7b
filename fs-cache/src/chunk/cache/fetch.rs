//! The fetch path of the chunk cache: chunks missing from both levels are claimed (a chunk
//! being fetched already is joined, not requested again), fetched in runs of adjacent chunks
//! (one ranged request each), decoded and checked, kept, and handed to their readers
//! (`cache.rs`, steps 3 and 4 of its module docs).
//!
//! A run's chunks that a reader waited for are decoded and published before a fetch unit's
//! ride-alongs. A demand reader on a thread that may block, over a store that reads without
//! waiting on the network, fetches on its own thread ([`Inner::fetch_run_now`]).

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::watch;

use super::{
    add, disk_shift, lock, Boost, Claim, DemandGuard, InFlight, Inner, Io, Priority, Shared,
};
use crate::backend::Backend;
use crate::chunk::table::ChunkTable;
use crate::chunk::ChunkId;
use crate::error::{Error, Result};
use crate::store::blob_key;

/// Fetches on their readers' own threads at once, at most. Such a read has no timeout (it
/// waits for the store's `pread`), so a store that stalls — a hung network mount — holds at
/// most this many FUSE workers; the other readers fetch the usual way, under the retry
/// policy's timeouts, and fail in time (`ublk-daemon/docs/daemon.md`, "Failed reads").
pub(super) const INLINE_FETCHES: usize = 4;

/// One of the [`INLINE_FETCHES`] slots, given back on drop.
struct InlineSlot<'a>(&'a Inner);

impl<'a> InlineSlot<'a> {
    fn claim(inner: &'a Inner) -> Option<Self> {
        (inner.inline_fetches)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < INLINE_FETCHES).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(inner))
    }
}

impl Drop for InlineSlot<'_> {
    fn drop(&mut self) {
        self.0.inline_fetches.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The stored bytes of a run of adjacent chunks: adjacent chunks are adjacent in the stored
/// object too (compressed or not, see `table`), so a run is one ranged request.
fn run_span(table: &ChunkTable, run: &[Claim]) -> Range<u64> {
    table.stored_range(run[0].0).start..table.stored_range(run[run.len() - 1].0).end
}

/// Chunk `i`'s stored bytes in `body`, a request's body that starts at stored offset `start`.
fn piece(table: &ChunkTable, body: &Bytes, start: u64, i: u64) -> Bytes {
    let r = table.stored_range(i);
    body.slice((r.start - start) as usize..(r.end - start) as usize)
}

impl Inner {
    /// Chunks `missing` (sorted) of `table`'s blob from the backend, joining fetches already in
    /// flight; in order. `extra` (sorted, none in `missing`): chunks fetched in the same
    /// requests when not in flight already (a fetch unit's window), counted as readahead and
    /// not waited for: their failure is not the caller's.
    pub(super) async fn fetch_chunks(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        missing: &[u64],
        extra: &[u64],
        priority: Priority,
        io: Io,
    ) -> Result<Vec<Bytes>> {
        let shift = table.chunk_shift();
        let id = |i: u64| ChunkId {
            blob: table.blob,
            shift,
            index: i,
        };
        // Join fetches in flight (raising their priority if this is a demand read); claim the
        // rest.
        let mut waits: Vec<(u64, watch::Receiver<Shared>)> = Vec::new();
        let mut claimed: Vec<Claim> = Vec::new();
        let boost = Arc::new(Boost::default());
        if priority == Priority::Demand {
            boost.set.store(true, Ordering::Release);
        }
        let mut extras = 0u64;
        {
            let mut inflight = lock(&self.inflight);
            let mut all: Vec<(u64, bool)> = missing.iter().map(|&i| (i, true)).collect();
            all.extend(extra.iter().map(|&i| (i, false)));
            all.sort_unstable();
            for (i, wanted) in all {
                match inflight.get(&id(i)) {
                    Some(f) if wanted => {
                        if priority == Priority::Demand {
                            f.boost.raise();
                        }
                        waits.push((i, f.result.clone()));
                    }
                    Some(_) => {}
                    None => {
                        let (tx, rx) = watch::channel(None);
                        inflight.insert(
                            id(i),
                            InFlight {
                                result: rx.clone(),
                                boost: boost.clone(),
                            },
                        );
                        if wanted {
                            waits.push((i, rx));
                        } else {
                            extras += 1;
                        }
                        claimed.push((i, tx, wanted));
                    }
                }
            }
        }
        let counter = match priority {
            Priority::Demand => &self.counters.misses,
            Priority::Readahead => &self.counters.readahead_chunks,
            Priority::Prefetch => &self.counters.prefetch_chunks,
            Priority::Trace => &self.counters.trace_chunks,
        };
        add(counter, claimed.len() as u64 - extras);
        add(&self.counters.readahead_chunks, extras);

        // Claimed chunks: runs of adjacent indices, each at most max_request_bytes.
        let per_request = (self.config.max_request_bytes / table.chunk_size).max(1) as usize;
        let mut runs: Vec<Vec<Claim>> = Vec::new();
        for (i, tx, wanted) in claimed {
            match runs.last_mut() {
                Some(run)
                    if run.len() < per_request && run.last().map(|(j, ..)| j + 1) == Some(i) =>
                {
                    run.push((i, tx, wanted))
                }
                _ => runs.push(vec![(i, tx, wanted)]),
            }
        }
        for run in runs {
            // A demand reader on a thread that may block reads a local store itself.
            let run = if io.may_block() && priority == Priority::Demand {
                match self.fetch_run_now(table, run) {
                    Ok(()) => continue,
                    Err(run) => run,
                }
            } else {
                run
            };
            let inner = self.clone();
            let table = table.clone();
            let boost = boost.clone();
            tokio::spawn(async move { inner.fetch_run(table, run, priority, boost).await });
        }

        let mut found = Vec::with_capacity(waits.len());
        for (_, mut rx) in waits {
            let r = rx
                .wait_for(|v| v.is_some())
                .await
                .map_err(|_| {
                    Error::io(
                        "fetch",
                        blob_key(&table.blob),
                        std::io::Error::other("fetch task ended without a result"),
                    )
                })?
                .clone();
            match r {
                Some(Ok(b)) => found.push(b),
                Some(Err(e)) => return Err(Error::Shared(e)),
                // `wait_for` returned only once the value was set.
                None => {
                    return Err(Error::io(
                        "fetch",
                        blob_key(&table.blob),
                        std::io::Error::other("fetch finished without a result"),
                    ))
                }
            }
        }
        Ok(found)
    }

    /// Fetch one run of adjacent chunks with one backend request, verify, keep, publish. The
    /// run's chunks that a reader waited for when they were claimed (`true`) are decoded,
    /// kept and published first; the rest (a fetch unit's ride-alongs) after them, so that a
    /// reader's reply does not wait for chunks it did not ask for.
    async fn fetch_run(
        self: Arc<Self>,
        table: Arc<ChunkTable>,
        run: Vec<Claim>,
        priority: Priority,
        boost: Arc<Boost>,
    ) {
        let _demand = if priority == Priority::Demand {
            self.demand_active.fetch_add(1, Ordering::AcqRel);
            Some(DemandGuard(&self))
        } else {
            None
        };
        let _permit = if priority == Priority::Demand {
            None
        } else if priority == Priority::Trace {
            let boosted = boost.notify.notified();
            if boost.set.load(Ordering::Acquire) {
                None
            } else {
                let gate = if self.unit_for(&table).is_some() {
                    &self.trace_gate_unit
                } else {
                    &self.trace_gate
                };
                tokio::select! {
                    permit = gate.acquire() => permit.ok(),
                    () = boosted => None,
                }
            }
        } else {
            // Lower priority: wait until no demand fetch is in flight and a prefetch slot is
            // free — unless a demand reader joined this fetch, which then starts at once.
            loop {
                let idle = self.demand_idle.notified();
                let boosted = boost.notify.notified();
                if boost.set.load(Ordering::Acquire) {
                    break None;
                }
                if self.demand_active.load(Ordering::Acquire) == 0 {
                    tokio::select! {
                        permit = self.prefetch_gate.acquire() => break permit.ok(),
                        () = boosted => {}
                    }
                    continue;
                }
                tokio::select! {
                    () = idle => {}
                    () = boosted => {}
                }
            }
        };
        let span = run_span(&table, &run);
        let body = match self.request(&table, span.clone(), run.len() as u64).await {
            Ok(body) => body,
            Err(e) => {
                add(&self.counters.backend_errors, 1);
                self.extra.error(&e);
                let e = Arc::new(e);
                self.publish(
                    &table,
                    run.into_iter().map(|(i, tx, _)| (i, tx, Err(e.clone()))),
                );
                return;
            }
        };
        let (waited, along): (Vec<_>, Vec<_>) = run.into_iter().partition(|(_, _, w)| *w);
        for phase in [waited, along] {
            self.open_and_publish(&table, &body, span.start, phase)
                .await;
        }
    }

    /// [`Self::fetch_run`] on the caller's thread: a demand reader on a thread that may block
    /// (a FUSE worker) over a store that reads without waiting on the network (a POSIX mount,
    /// [`crate::Backend::get_range_now`]) reads, decodes and checks its chunks itself. The
    /// usual way hands a small file's miss from the reader's thread to a runtime worker, a
    /// blocking thread for the read, another for the decoding, and back: six thread wake-ups,
    /// which cost more than the local read itself (`bench/README.md`, "peers"). Chunks that
    /// fail their check and a fetch unit's ride-alongs go on the usual way. `Err(run)`: the
    /// store cannot, or the read failed; the caller fetches the run the usual way (under the
    /// retries).
    fn fetch_run_now(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        run: Vec<Claim>,
    ) -> std::result::Result<(), Vec<Claim>> {
        let span = run_span(table, &run);
        let Some(_slot) = InlineSlot::claim(self) else {
            return Err(run);
        };
        // A demand fetch from here on: prefetches wait, as for one on the runtime's threads.
        self.demand_active.fetch_add(1, Ordering::AcqRel);
        let _demand = DemandGuard(self);
        let started = Instant::now();
        let body = match (self.store.retrying()).get_range_now(&blob_key(&table.blob), span.clone())
        {
            Some(Ok(body)) if body.len() as u64 == span.end - span.start => body,
            _ => return Err(run),
        };
        self.note_request(
            table,
            run.len() as u64,
            body.len() as u64,
            started.elapsed(),
        );
        let (waited, along): (Vec<_>, Vec<_>) = run.into_iter().partition(|(_, _, w)| *w);
        let mut done = Vec::with_capacity(waited.len());
        let mut bad = Vec::new();
        for claim in waited {
            match Self::open(table, claim.0, &piece(table, &body, span.start, claim.0)) {
                Some(plain) => done.push((claim.0, claim.1, Ok(self.keep(table, claim.0, plain)))),
                None => bad.push(claim),
            }
        }
        self.publish(table, done);
        if !bad.is_empty() || !along.is_empty() {
            let (inner, table) = (self.clone(), table.clone());
            tokio::spawn(async move {
                let failed = vec![None; bad.len()];
                inner.settle(&table, bad, failed).await;
                inner
                    .open_and_publish(&table, &body, span.start, along)
                    .await;
            });
        }
        Ok(())
    }

    /// Decode and check the chunks `phase` of a request's `body` (which starts at stored
    /// offset `start`), keep them, and hand them to their readers.
    async fn open_and_publish(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        body: &Bytes,
        start: u64,
        phase: Vec<Claim>,
    ) {
        if phase.is_empty() {
            return;
        }
        let pieces: Vec<(u64, Bytes)> = phase
            .iter()
            .map(|(i, ..)| (*i, piece(table, body, start, *i)))
            .collect();
        // Decode and verify off the async workers, the chunks of one phase in parallel.
        let opened = {
            let t = table.clone();
            tokio::task::spawn_blocking(move || {
                use rayon::prelude::*;
                let open = |(i, d): &(u64, Bytes)| (*i, Self::open(&t, *i, d));
                // One chunk (a small file's miss): no hand-off to the pool and back.
                if pieces.len() == 1 {
                    return pieces.iter().map(open).collect();
                }
                pieces
                    .par_iter()
                    .map(open)
                    .collect::<Vec<(u64, Option<Bytes>)>>()
            })
            .await
            .unwrap_or_else(|_| phase.iter().map(|(i, ..)| (*i, None)).collect())
        };
        let opened = opened.into_iter().map(|(_, plain)| plain).collect();
        self.settle(table, phase, opened).await;
    }

    /// Keep the chunks `claims` (`opened`: each one's plain bytes, or `None` where it failed
    /// its check) and hand them to their readers. Refetches of chunks that failed run at
    /// once, so that a read fails within two requests' time however many of its chunks are
    /// bad.
    async fn settle(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        claims: Vec<Claim>,
        opened: Vec<Option<Bytes>>,
    ) {
        let accepts =
            (claims.iter().zip(opened)).map(|((i, ..), plain)| self.accept(table, *i, plain));
        let results = futures::future::join_all(accepts).await;
        self.publish(
            table,
            claims
                .into_iter()
                .zip(results)
                .map(|((i, tx, _), r)| (i, tx, r)),
        );
    }

    /// Hand fetched chunks (or their error) to their readers: out of the in-flight map first,
    /// so that a reader arriving after the send finds the chunk cached, not a finished fetch.
    fn publish(
        &self,
        table: &ChunkTable,
        done: impl IntoIterator<
            Item = (
                u64,
                watch::Sender<Shared>,
                std::result::Result<Bytes, Arc<Error>>,
            ),
        >,
    ) {
        let done: Vec<_> = done.into_iter().collect();
        {
            let mut inflight = lock(&self.inflight);
            for (i, ..) in &done {
                inflight.remove(&ChunkId {
                    blob: table.blob,
                    shift: table.chunk_shift(),
                    index: *i,
                });
            }
        }
        for (_, tx, r) in done {
            let _ = tx.send(Some(r));
        }
    }

    /// One ranged backend request (retried under the cache's policy); the body must be
    /// exactly the range.
    async fn request(&self, table: &ChunkTable, span: Range<u64>, chunks: u64) -> Result<Bytes> {
        let key = blob_key(&table.blob);
        let started = Instant::now();
        let body = self.store.retrying().get_range_exact(&key, span).await;
        let fetched = body.as_ref().map_or(0, |b| b.len() as u64);
        self.note_request(table, chunks, fetched, started.elapsed());
        body
    }

    /// Count one backend request of `chunks` chunks that brought `bytes` in `took`.
    fn note_request(&self, table: &ChunkTable, chunks: u64, bytes: u64, took: Duration) {
        add(&self.counters.backend_requests, 1);
        add(&self.counters.coalesced_chunks, chunks);
        if bytes > 0 {
            add(&self.counters.bytes_fetched, bytes);
            self.extra.fetched(&table.blob, bytes, took);
        }
    }

    /// Keep a fetched chunk that passed verification (its plain bytes); refetch one that did
    /// not (`None`), alone, once.
    async fn accept(
        self: &Arc<Self>,
        table: &Arc<ChunkTable>,
        index: u64,
        plain: Option<Bytes>,
    ) -> std::result::Result<Bytes, Arc<Error>> {
        let data = match plain {
            Some(data) => data,
            None => {
                add(&self.counters.verify_failures, 1);
                tracing::warn!(blob = %table.blob, chunk = index, "fetched chunk does not match its digest; refetching");
                let again = match self.request(table, table.stored_range(index), 1).await {
                    Ok(b) => b,
                    Err(e) => {
                        add(&self.counters.backend_errors, 1);
                        self.extra.error(&e);
                        return Err(Arc::new(e));
                    }
                };
                let t = table.clone();
                let opened = tokio::task::spawn_blocking(move || Self::open(&t, index, &again))
                    .await
                    .ok()
                    .flatten();
                match opened {
                    Some(data) => data,
                    None => {
                        add(&self.counters.verify_failures, 1);
                        add(&self.counters.corrupt_errors, 1);
                        let e = Error::Corrupt {
                            blob: table.blob.to_hex(),
                            chunk: index,
                        };
                        self.extra.error(&e);
                        return Err(Arc::new(e));
                    }
                }
            }
        };
        Ok(self.keep(table, index, data))
    }

    /// Keep chunk `index` of `table`'s blob (its plain bytes, verified): in level 1 now, in
    /// level 2 in the background. Returns the bytes to serve.
    fn keep(&self, table: &ChunkTable, index: u64, data: Bytes) -> Bytes {
        let id = ChunkId {
            blob: table.blob,
            shift: table.chunk_shift(),
            index,
        };
        // Own the bytes: a slice would pin the whole coalesced request in memory (a decoded
        // zstd chunk is a buffer of its own already).
        let data = if table.is_zstd(index) {
            data
        } else {
            Bytes::copy_from_slice(&data)
        };
        self.memory_put(id, data.clone());
        // Level 2 takes blobs of chunks of at most 256 KiB (shift 18; its blob files place
        // chunk `i` at `i << shift`): a blob whose table has larger chunks (the format allows
        // up to 64 MiB) stays in level 1, and its chunks never reach a batch, which they would
        // fail whole, other blobs' chunks with them.
        let disk = self.disk.clone().filter(|_| disk_shift(table).is_some());
        if let Some(disk) = disk {
            // Readers get the chunk now; level 2 keeps it in the background (the disk cache
            // indexes a chunk only once its bytes are durable, so this never exposes a partial
            // chunk). Past a bound on pending bytes, the chunk is not kept on disk.
            if !self.writer.queue(&disk, id, data.clone()) {
                add(&self.counters.disk_writes_skipped, 1);
            }
        }
        data
    }
}
