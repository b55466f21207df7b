//! Puts of several chunks at once, with one `fdatasync` per blob file and one index write.
//!
//! A put must make a chunk's bytes durable before it indexes them (module docs, "Ordering").
//! Done chunk by chunk, that is one `fdatasync` — on ext4 a journal commit, since a chunk
//! written into a hole allocates blocks — and one RocksDB write per 256 KiB: a cold reader
//! fetching small files at disk speed paid for dozens of commits in flight beside its own
//! reads. [`DiskCache::put_many`] keeps the same order for a whole batch: reserve every chunk
//! (evicting LRU chunks to fit), write all their bytes, `fdatasync` each blob file touched
//! once, then index all of them in one batch. Adjacent chunks of a blob are written together
//! (`direct.rs`, "Writes"). A crash anywhere in between leaves unindexed
//! bytes (punched out at the next open) and never an entry for bytes that are not durable.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};

use super::direct::DIRECT_RUN_BYTES;
use super::{block_sums, chunk_key, chunk_offset, cost, encode_entry, sums_key, valid_shift};
use super::{BlobRefs, ChunkId, DiskCache, Entry, PendingGuard, MAX_DISK_CHUNK_SHIFT};
use crate::error::{Error, Result};

impl DiskCache {
    /// Cache several chunks (see [`DiskCache::put`], which is a batch of one): each durable on
    /// disk before any is indexed, one `fdatasync` per blob file and one index write for the
    /// batch. Chunks already cached (or being put) are only marked used; chunks that cannot
    /// fit are not cached. A chunk larger than its chunk size (`1 << id.shift`), or of a
    /// shift level 2 does not keep (outside 12 ..= 18), fails the whole batch before anything
    /// is written; a write, sync or index failure leaves none of the batch's chunks indexed
    /// (their bytes are punched out).
    ///
    /// A blob's chunks in level 2 share one shift. A chunk of a blob cached under another
    /// shift first has the blob's old chunks removed; if one of those is in use (pinned, or
    /// being put or removed), the chunk is not cached (counted in `shift_conflicts`). So is a
    /// chunk of a blob that this batch also puts under an earlier-listed other shift.
    pub fn put_many(&self, chunks: &[(ChunkId, &[u8])]) -> Result<()> {
        for (id, data) in chunks {
            let size = data.len() as u64;
            if !valid_shift(id.shift)
                || size > 1 << id.shift
                || chunk_offset(id.index, id.shift).is_none_or(|o| o.checked_add(size).is_none())
            {
                return Err(self.error(format!(
                    "chunk {} of blob {} is {size} bytes, more than its chunk size 2^{} \
                     (or beyond any file offset, or a chunk size level 2 does not keep: \
                     2^12 ..= 2^{MAX_DISK_CHUNK_SHIFT})",
                    id.index, id.blob, id.shift
                )));
            }
        }
        // A blob cached under another shift: its old chunks go first (`State::per_blob`).
        let moved = {
            let mut st = self.lock();
            let mut seen = HashMap::new();
            let mut victims = Vec::new();
            for (id, _) in chunks {
                if seen.insert(id.blob, id.shift).is_none() {
                    victims.extend(
                        st.make_way_for_shift(&id.blob, id.shift)
                            .unwrap_or_default(),
                    );
                }
            }
            victims
        };
        self.discard(moved, None)?;
        // Reserve: the chunks to write, each with the guard that undoes its reservation
        // unless it ends up indexed.
        let mut victims = Vec::new();
        let mut todo: Vec<(PendingGuard<'_>, &[u8])> = Vec::with_capacity(chunks.len());
        {
            let mut st = self.lock();
            for (id, data) in chunks {
                let c = cost(data.len() as u64);
                if st.touch(id).is_some() || st.inflight.contains(id) {
                    continue;
                }
                if st
                    .per_blob
                    .get(&id.blob)
                    .is_some_and(|r| r.shift != id.shift)
                {
                    st.shift_conflicts += 1;
                    continue;
                }
                if st.pending + c > self.capacity {
                    continue;
                }
                let over = (st.present + st.pending + c).saturating_sub(self.capacity);
                victims.extend(st.doom_lru(over));
                st.inflight.insert(*id);
                st.pending += c;
                (st.per_blob.entry(id.blob))
                    .or_insert(BlobRefs {
                        chunks: 0,
                        shift: id.shift,
                    })
                    .chunks += 1;
                let guard = PendingGuard {
                    cache: self,
                    id: *id,
                    size: c,
                    done: false,
                };
                todo.push((guard, data));
            }
        }
        if todo.is_empty() {
            return Ok(());
        }
        self.discard(victims, Some(super::EVICTIONS))?;
        let total: u64 = todo.iter().map(|(g, _)| g.size).sum();
        self.make_room_on_disk(total)?;

        // Write every chunk's bytes; then make them durable, one blob file at a time.
        let mut written: Vec<(ChunkId, u64)> = Vec::with_capacity(todo.len());
        let undo = |written: &[(ChunkId, u64)]| {
            for (id, len) in written {
                if let Err(e) = self.punch(id, *len) {
                    tracing::warn!(error = %e, "chunk cache: unindexed chunk bytes left for the next open");
                }
            }
        };
        let mut sums = Vec::with_capacity(todo.len());
        // Adjacent chunks of a blob go to disk as one write (`direct.rs`, "Writes"): in
        // blob and index order.
        todo.sort_by_key(|(g, _)| g.id);
        let mut at = 0;
        while at < todo.len() {
            let run = direct_run(&todo[at..]);
            if run > 1 {
                let parts: Vec<&[u8]> = todo[at..at + run].iter().map(|(_, d)| *d).collect();
                let first = todo[at].0.id;
                match self.write_direct(&first, &parts) {
                    Some(Ok(())) => {
                        for (g, data) in &todo[at..at + run] {
                            written.push((g.id, data.len() as u64));
                            sums.push(block_sums(data));
                        }
                        at += run;
                        continue;
                    }
                    Some(Err(e)) => {
                        // Chunk by chunk below, where a full disk evicts and retries.
                        tracing::debug!(error = %e, "chunk cache: a run's write failed; writing its chunks one by one");
                        for (g, data) in &todo[at..at + run] {
                            let _ = self.punch(&g.id, data.len() as u64);
                        }
                    }
                    None => {}
                }
            }
            for (g, data) in &todo[at..at + run.max(1)] {
                if let Err(e) = self.store_chunk(&g.id, data) {
                    undo(&written);
                    return Err(e);
                }
                written.push((g.id, data.len() as u64));
                sums.push(block_sums(data));
            }
            at += run.max(1);
        }
        let mut files: HashMap<_, Arc<std::fs::File>> = HashMap::new();
        for (g, _) in &todo {
            if files.contains_key(&g.id.blob) {
                continue;
            }
            let synced = match self.open_blob(&g.id.blob, false) {
                Ok(Some(f)) => f
                    .sync_data()
                    .map(|()| f)
                    .map_err(|e| Error::io("sync chunks", self.blob_path(&g.id.blob), e)),
                Ok(None) => Err(self.error(format!(
                    "the file of blob {} went while its chunks were written",
                    g.id.blob
                ))),
                Err(e) => Err(e),
            };
            match synced {
                Ok(f) => {
                    files.insert(g.id.blob, f);
                }
                Err(e) => {
                    undo(&written);
                    return Err(e);
                }
            }
        }
        // Chunks written through the page cache (a blob's last one, or all where the
        // filesystem refuses O_DIRECT) left clean pages now; do not let them crowd out level 1
        // and hot files.
        for (id, len) in &written {
            if let (Some(f), Some(at)) = (files.get(&id.blob), chunk_offset(id.index, id.shift)) {
                let _ = rustix::fs::fadvise(
                    &**f,
                    at,
                    std::num::NonZeroU64::new(*len),
                    rustix::fs::Advice::DontNeed,
                );
            }
        }

        // Index the batch in one write.
        let entries: Vec<Entry> = {
            let mut st = self.lock();
            (written.iter())
                .map(|(_, len)| {
                    let seq = st.next_seq;
                    st.next_seq = seq.saturating_add(1);
                    Entry {
                        size: *len as u32,
                        seq,
                    }
                })
                .collect()
        };
        let indexed = self.write_index(
            |b| {
                for (((id, _), entry), s) in written.iter().zip(&entries).zip(&sums) {
                    b.put(chunk_key(id), encode_entry(*entry, id.shift));
                    b.put(sums_key(id), s);
                }
            },
            "cannot index a chunk; it was not cached",
        );
        if let Err(e) = indexed {
            undo(&written);
            return Err(e.0);
        }
        {
            let mut cached = self.sums.lock().unwrap_or_else(PoisonError::into_inner);
            for ((id, _), s) in written.iter().zip(sums) {
                cached.put(*id, s.into());
            }
        }
        let mut st = self.lock();
        for ((g, _), entry) in todo.iter_mut().zip(entries) {
            g.done = true;
            st.inflight.remove(&g.id);
            st.pending -= g.size;
            st.present += g.size;
            st.lru.push(g.id, entry);
        }
        Ok(())
    }
}

/// How many chunks at the head of `todo` (sorted by id) make one run: whole chunks
/// (`1 << shift` bytes) of one blob at consecutive indexes, at most [`DIRECT_RUN_BYTES`] in
/// all.
fn direct_run(todo: &[(PendingGuard<'_>, &[u8])]) -> usize {
    let Some((first, _)) = todo.first() else {
        return 0;
    };
    let full = 1usize << first.id.shift;
    let most = (DIRECT_RUN_BYTES / full).max(1);
    let mut n = 0;
    for (g, data) in todo.iter().take(most) {
        let next = first.id.index.checked_add(n as u64);
        if g.id.blob != first.id.blob
            || g.id.shift != first.id.shift
            || Some(g.id.index) != next
            || data.len() != full
        {
            break;
        }
        n += 1;
    }
    n
}
