//! Level-2 reads of adjacent chunks with one system call ([`DiskCache::read_run`]).
//!
//! Level 2 keeps chunk `i` of a blob at `i << shift` of the blob's file, so the chunks one
//! request spans (a small file in 16 KiB tails chunks spans two or three) lie back to back
//! there: they are read with one `preadv2`, one request to the disk, instead of one per
//! chunk. Nothing else changes: each chunk's blocks are checked against its own crc32c, each
//! chunk is pinned while it is read and marked used, and each part gets its own outcome, the
//! one [`DiskCache::read_range`] would give. Whatever is unusual about a stretch (a chunk not
//! cached, a short file, an error) sends its chunks to [`DiskCache::read_range`] one by one.

use std::ops::Range;

use bytes::Bytes;

use super::files::ReadOutcome;
use super::sums::blocks_match;
use super::{chunk_offset, DiskCache, RangeRead, CHECK_BLOCK};
use crate::chunk::ChunkId;
use crate::error::Result;

impl DiskCache {
    /// [`Self::read_range`] of each of `parts` (a chunk index and the bytes of that chunk
    /// wanted, in increasing index order) of the blob and chunk size of `chunk`; a part that
    /// runs to the end of a whole chunk and the next one, which starts at the beginning of
    /// the next chunk, are read together. One outcome per part, in order.
    pub fn read_run(
        &self,
        chunk: &ChunkId,
        parts: &[(u64, Range<u64>)],
        nowait: bool,
    ) -> Vec<Result<RangeRead>> {
        let whole = 1u64 << chunk.shift;
        let mut out = Vec::with_capacity(parts.len());
        let mut i = 0;
        while i < parts.len() {
            let mut j = i + 1;
            while j < parts.len()
                && parts[j].0 == parts[j - 1].0.wrapping_add(1)
                && parts[j - 1].1.end == whole
                && parts[j].1.start == 0
            {
                j += 1;
            }
            let stretch = &parts[i..j];
            match (stretch.len() > 1)
                .then(|| self.read_stretch(chunk, stretch, nowait))
                .flatten()
            {
                Some(outcomes) => out.extend(outcomes),
                None => out.extend(stretch.iter().map(|(index, part)| {
                    let id = ChunkId {
                        index: *index,
                        ..*chunk
                    };
                    self.read_range(&id, part.clone(), nowait)
                })),
            }
            i = j;
        }
        out
    }

    /// Adjacent parts (every one but the last runs to the end of a whole chunk, every one but
    /// the first starts at 0) with one read. `None`: read them one by one instead.
    fn read_stretch(
        &self,
        chunk: &ChunkId,
        parts: &[(u64, Range<u64>)],
        nowait: bool,
    ) -> Option<Vec<Result<RangeRead>>> {
        let whole = 1u64 << chunk.shift;
        let id = |index: u64| ChunkId { index, ..*chunk };
        let mut sizes = Vec::with_capacity(parts.len());
        let mut pins = Vec::with_capacity(parts.len());
        for (index, _) in parts {
            let (entry, pin) = self.pin_for_read(&id(*index))?;
            sizes.push(u64::from(entry.size));
            pins.push(pin);
        }
        // Every chunk but the last is whole (so the next one follows it in the file); every
        // part lies within its chunk. Anything else gets read_range's answer.
        let last = parts.len() - 1;
        let fits = (parts.iter().zip(&sizes).enumerate()).all(|(k, ((_, p), size))| {
            p.start < p.end && p.end <= *size && (k == last || *size == whole)
        });
        if !fits {
            return None;
        }
        let file = self.open_blob(&chunk.blob, false).ok()??;
        let mut sums = Vec::with_capacity(parts.len());
        for ((index, _), size) in parts.iter().zip(&sizes) {
            sums.push(self.sums_of_opt(&id(*index), *size).ok()??);
        }
        // From the first part's first block to the last part's last block (or its chunk's
        // end). Byte `b` of the stretch's `k`th chunk is at `k * whole + b - skip` of the read.
        let skip = parts[0].1.start / CHECK_BLOCK * CHECK_BLOCK;
        let start = chunk_offset(parts[0].0, chunk.shift)? + skip;
        let last_blocks = parts[last].1.end.div_ceil(CHECK_BLOCK);
        let end = chunk_offset(parts[last].0, chunk.shift)?
            + (last_blocks * CHECK_BLOCK).min(sizes[last]);
        let len = usize::try_from(end.checked_sub(start)?).ok()?;
        let data = match self.read_for_reader(&chunk.blob, &file, len, start, nowait) {
            Ok((ReadOutcome::Full, data)) => data,
            Ok((ReadOutcome::WouldBlock, _)) => {
                return Some(parts.iter().map(|_| Ok(RangeRead::WouldBlock)).collect())
            }
            // A short file or an error: read_range tells which chunk it concerns.
            Ok((ReadOutcome::Short, _)) | Err(_) => return None,
        };
        drop(pins);
        let outcomes = (parts
            .iter()
            .map(|(_, p)| p)
            .zip(&sizes)
            .zip(&sums)
            .enumerate())
        .map(|(k, ((part, size), sums))| {
            let at = |b: u64| (k as u64 * whole + b - skip) as usize;
            let first = if k == 0 { skip / CHECK_BLOCK } else { 0 };
            let blocks = part.end.div_ceil(CHECK_BLOCK);
            let checked = &data[at(first * CHECK_BLOCK)..at((blocks * CHECK_BLOCK).min(*size))];
            if !blocks_match(checked, &sums[4 * first as usize..4 * blocks as usize]) {
                return Ok(RangeRead::Corrupt);
            }
            let wanted = at(part.start)..at(part.end);
            // A whole chunk may be kept in level 1 by the caller: its own buffer then, not
            // a slice that would keep the whole stretch alive.
            Ok(RangeRead::Hit(if part.start == 0 && part.end == *size {
                Bytes::copy_from_slice(&data[wanted])
            } else {
                data.slice(wanted)
            }))
        })
        .collect();
        Some(outcomes)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::chunk::disk::DiskCacheConfig;
    use crate::store::Digest;

    const SHIFT: u8 = 14;
    const WHOLE: u64 = 1 << SHIFT;

    /// A cache holding chunks 0..5 of one blob (16 KiB each, the last 5,000 bytes), each
    /// chunk's bytes distinct.
    fn cache(dir: &tempfile::TempDir) -> (DiskCache, ChunkId, Vec<Vec<u8>>) {
        let disk = DiskCache::open(DiskCacheConfig {
            dir: dir.path().join("cache"),
            capacity: 1 << 30,
        })
        .unwrap();
        let first = ChunkId::new(Digest::of(b"run test blob"), SHIFT, 0);
        let chunks: Vec<Vec<u8>> = (0..5u64)
            .map(|i| {
                let len = if i == 4 { 5000 } else { WHOLE as usize };
                (0..len).map(|b| (b as u64 * 7 + i * 131) as u8).collect()
            })
            .collect();
        for (i, c) in chunks.iter().enumerate() {
            disk.put(
                &ChunkId {
                    index: i as u64,
                    ..first
                },
                c,
            )
            .unwrap();
        }
        (disk, first, chunks)
    }

    fn hit(r: &Result<RangeRead>) -> Vec<u8> {
        match r {
            Ok(RangeRead::Hit(b)) => b.to_vec(),
            other => panic!("not a hit: {other:?}"),
        }
    }

    #[test]
    fn adjacent_parts_read_together_give_what_each_read_gives() {
        let dir = tempfile::tempdir().unwrap();
        let (disk, first, chunks) = cache(&dir);
        // The tail of 0, all of 1..=3, the head of the short last one; then a lone part.
        let parts = vec![
            (0, 5000..WHOLE),
            (1, 0..WHOLE),
            (2, 0..WHOLE),
            (3, 0..WHOLE),
            (4, 0..4097),
        ];
        // The stretch is read in one go (not one by one after a refusal).
        let joined = disk.read_stretch(&first, &parts, false).expect("one read");
        for ((i, p), r) in parts.iter().zip(&joined) {
            assert_eq!(
                hit(r),
                chunks[*i as usize][p.start as usize..p.end as usize]
            );
        }
        for nowait in [false, true] {
            let got = disk.read_run(&first, &parts, nowait);
            assert_eq!(got.len(), parts.len());
            for ((i, p), r) in parts.iter().zip(&got) {
                if nowait && matches!(r, Ok(RangeRead::WouldBlock)) {
                    continue;
                }
                assert_eq!(
                    hit(r),
                    chunks[*i as usize][p.start as usize..p.end as usize],
                    "chunk {i}"
                );
            }
        }
        // Parts that do not join (a gap, a part that stops short of its chunk's end) are
        // read one by one, with the same bytes.
        let parts = vec![(0, 0..100), (1, 10..20), (3, 0..WHOLE), (4, 0..5000)];
        let got = disk.read_run(&first, &parts, false);
        for ((i, p), r) in parts.iter().zip(&got) {
            assert_eq!(
                hit(r),
                chunks[*i as usize][p.start as usize..p.end as usize]
            );
        }
    }

    #[test]
    fn a_damaged_or_missing_chunk_in_a_stretch_is_reported_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (disk, first, chunks) = cache(&dir);
        // One byte of chunk 2 changed on disk behind the cache's back.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(disk.blob_path(&first.blob))
            .unwrap();
        file.write_all_at(&[chunks[2][9000] ^ 0xff], 2 * WHOLE + 9000)
            .unwrap();
        drop(file);
        let parts: Vec<(u64, Range<u64>)> = (0..4).map(|i| (i, 0..WHOLE)).collect();
        let joined = disk.read_stretch(&first, &parts, false).expect("one read");
        let got = disk.read_run(&first, &parts, false);
        for got in [&joined, &got] {
            assert_eq!(hit(&got[0]), chunks[0]);
            assert_eq!(hit(&got[1]), chunks[1]);
            assert_eq!(got[2].as_ref().unwrap(), &RangeRead::Corrupt);
            assert_eq!(hit(&got[3]), chunks[3]);
        }
        // Chunk 1 gone from the cache: the others still read.
        disk.remove(&ChunkId { index: 1, ..first }).unwrap();
        let got = disk.read_run(&first, &parts, false);
        assert_eq!(hit(&got[0]), chunks[0]);
        assert_eq!(got[1].as_ref().unwrap(), &RangeRead::Absent);
        assert_eq!(got[2].as_ref().unwrap(), &RangeRead::Corrupt);
        assert_eq!(hit(&got[3]), chunks[3]);
        // A part past its chunk's end: the error read_range gives, the rest read.
        let parts = vec![(3, 0..WHOLE), (4, 0..WHOLE)];
        let got = disk.read_run(&first, &parts, false);
        assert_eq!(hit(&got[0]), chunks[3]);
        assert!(got[1].is_err());
    }
}
