//! The chunks of blobs already stored that a layer build may point into instead of storing
//! them again ([`ChunkDictionary`]; how a build uses it: [`crate::layer`] docs).
//!
//! A dictionary blob is described by what a store's chunk table holds: its size, its cache
//! chunk size (256 KiB for a main blob, T for a tails blob; a power of two, 4 KiB..=256 KiB)
//! and the blake3 of each chunk. Only **full** chunks of a blob are held (the last one, when
//! shorter, is not), keyed by digest, each with its blob, index and size in blocks; a lookup
//! names the size it wants and misses unless both the digest and the size match. So a
//! full-chunk lookup (256 KiB) only ever finds a chunk of a 256 KiB table, and a tails lookup
//! (T) a chunk of a T table; chunk `j` of blob `b` is at block `j × chunk blocks` of `b`.
//! The digests of tables with chunks under 256 KiB are also kept in order (32 bytes per
//! chunk), so that a tail spanning several chunks can be checked chunk by chunk.

use std::collections::HashMap;

use crate::layer::CHUNK_SIZE;
use crate::ondisk::BLOCK_SIZE;

/// At most this many blobs a [`ChunkDictionary`] holds: the device table's extra slots
/// besides the layer's own blob (32 devices in all). A layer with a tails blob (device 2)
/// uses at most [`MAX_DICT_DEVICES_WITH_TAILS`] of them.
pub const MAX_DICT_DEVICES: usize = 31;

/// At most this many dictionary blobs a layer with a tails blob points into (its first ones;
/// the main blob, the tails blob and these make 32 devices).
pub const MAX_DICT_DEVICES_WITH_TAILS: usize = MAX_DICT_DEVICES - 1;

/// At most this many chunks a [`ChunkDictionary`] holds (about 64 MiB of memory; 256 GiB of
/// 256 KiB chunks).
pub const MAX_DICT_CHUNKS: usize = 1 << 20;

/// The smallest chunk size of a dictionary blob's table (one block).
const MIN_CHUNK_SIZE: u64 = BLOCK_SIZE;

/// The chunks of stored blobs a build may point into instead of storing them again: per
/// blob its device tag, size and chunk size, and each full chunk's blake3. Bounded: at most
/// [`MAX_DICT_DEVICES`] blobs and [`MAX_DICT_CHUNKS`] chunks; a chunk held twice keeps its
/// first blob.
#[derive(Debug, Default, Clone)]
pub struct ChunkDictionary {
    pub(crate) blobs: Vec<DictBlob>,
    chunks: HashMap<[u8; 32], (u32, u32)>,
}

#[derive(Debug, Clone)]
pub(crate) struct DictBlob {
    pub(crate) tag: Vec<u8>,
    pub(crate) blocks: u64,
    /// The blob's chunk size in blocks.
    pub(crate) chunk_blocks: u64,
    /// Its full chunks' digests, for blobs whose chunks are smaller than 256 KiB (tails
    /// blobs: a tail may span several of their chunks, see [`ChunkDictionary::chunk_digest`]);
    /// empty for 256 KiB tables.
    digests: Vec<[u8; 32]>,
}

impl ChunkDictionary {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a blob of `size` bytes (a multiple of 4 KiB: a layer's main or tails blob),
    /// tagged `tag` (what the device table names it by: Strata's blob digest in hex), cut
    /// into chunks of `chunk_size` bytes (its chunk table's: 256 KiB for a main blob, T for
    /// a tails blob) whose blake3 digests are `digests` (one per chunk, the last possibly
    /// shorter). Its index among the added blobs, or `None` if the dictionary is full or the
    /// blob is not a layer blob (size not whole blocks, too large, a tag over 64 bytes, a
    /// chunk size that is not a power of two in 4 KiB..=256 KiB, digests that do not match
    /// the size).
    pub fn add_blob(
        &mut self,
        tag: &[u8],
        size: u64,
        chunk_size: u64,
        digests: &[[u8; 32]],
    ) -> Option<usize> {
        let blocks = size / BLOCK_SIZE;
        if self.blobs.len() >= MAX_DICT_DEVICES
            || tag.len() > 64
            || size % BLOCK_SIZE != 0
            || blocks > u64::from(u32::MAX)
            || !chunk_size.is_power_of_two()
            || !(MIN_CHUNK_SIZE..=CHUNK_SIZE).contains(&chunk_size)
            || digests.len() as u64 != size.div_ceil(chunk_size)
        {
            return None;
        }
        let chunk_blocks = chunk_size / BLOCK_SIZE;
        let b = self.blobs.len() as u32;
        let zero = zero_chunk_digest(chunk_size);
        for (j, d) in digests
            .iter()
            .enumerate()
            .take((size / chunk_size) as usize)
        {
            if self.chunks.len() >= MAX_DICT_CHUNKS {
                break;
            }
            if *d != zero {
                self.chunks.entry(*d).or_insert((b, j as u32));
            }
        }
        let full = &digests[..(size / chunk_size) as usize];
        self.blobs.push(DictBlob {
            tag: tag.to_vec(),
            blocks,
            chunk_blocks,
            digests: if chunk_size < CHUNK_SIZE {
                full.to_vec()
            } else {
                Vec::new()
            },
        });
        Some(b as usize)
    }

    /// Blobs added.
    pub fn blobs(&self) -> usize {
        self.blobs.len()
    }

    /// Distinct chunks held.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The (blob, chunk index) holding a full chunk of `blocks` blocks with this digest.
    pub(crate) fn lookup(&self, digest: &[u8; 32], blocks: u64) -> Option<(u32, u32)> {
        let (b, j) = self.chunks.get(digest).copied()?;
        (self.blobs[b as usize].chunk_blocks == blocks).then_some((b, j))
    }
}

impl ChunkDictionary {
    /// The digest of full chunk `j` of blob `b` if `b`'s chunks are smaller than 256 KiB
    /// (what a tail spanning several chunks is checked against, even where a digest occurs
    /// at several places in the blob and [`Self::lookup`] names only the first).
    pub(crate) fn chunk_digest(&self, b: u32, j: u64) -> Option<&[u8; 32]> {
        self.blobs
            .get(b as usize)?
            .digests
            .get(usize::try_from(j).ok()?)
    }
}

/// blake3 of a chunk of `chunk_size` zeros (such chunks are holes, never looked up).
fn zero_chunk_digest(chunk_size: u64) -> [u8; 32] {
    static ZERO: std::sync::Mutex<Vec<(u64, [u8; 32])>> = std::sync::Mutex::new(Vec::new());
    let mut known = ZERO.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, d)) = known.iter().find(|(s, _)| *s == chunk_size) {
        return d;
    }
    let d = *blake3::hash(&vec![0u8; chunk_size as usize]).as_bytes();
    known.push((chunk_size, d));
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_needs_the_digest_and_the_chunk_size() {
        let mut d = ChunkDictionary::new();
        let a = [1u8; 32];
        let b = [2u8; 32];
        let zero64k = zero_chunk_digest(64 << 10);
        // A 256 KiB table: one full chunk, then a short last one (never held).
        assert_eq!(
            d.add_blob(b"main", CHUNK_SIZE + 65536, CHUNK_SIZE, &[a, b]),
            Some(0)
        );
        // A 64 KiB table: a zero chunk (not held) and one chunk.
        let c = [3u8; 32];
        assert_eq!(
            d.add_blob(b"tails", 2 << 16, 1 << 16, &[zero64k, c]),
            Some(1)
        );
        assert_eq!(d.chunks(), 2);
        assert_eq!(d.lookup(&a, 64), Some((0, 0)));
        assert_eq!(d.lookup(&a, 16), None);
        assert_eq!(d.lookup(&b, 16), None, "a short last chunk is never found");
        assert_eq!(d.lookup(&c, 16), Some((1, 1)));
        assert_eq!(d.lookup(&c, 64), None);
        assert_eq!(d.lookup(&zero64k, 16), None);
        // Tails tables keep their digests in order; 256 KiB tables do not.
        assert_eq!(d.chunk_digest(1, 1), Some(&c));
        assert_eq!(d.chunk_digest(1, 0), Some(&zero64k));
        assert_eq!(d.chunk_digest(1, 2), None);
        assert_eq!(d.chunk_digest(0, 0), None);
        // Refused: not whole blocks, digests not matching the size, bad chunk sizes.
        assert_eq!(d.add_blob(b"x", 4097, CHUNK_SIZE, &[[0; 32]; 1]), None);
        assert_eq!(d.add_blob(b"x", 4096, CHUNK_SIZE, &[]), None);
        assert_eq!(d.add_blob(b"x", 1 << 16, 1 << 16, &[[0; 32]; 2]), None);
        assert_eq!(d.add_blob(b"x", 1 << 20, 1 << 20, &[[0; 32]; 1]), None);
        assert_eq!(d.add_blob(b"x", 6 << 12, 3 << 12, &[[0; 32]; 2]), None);
        assert_eq!(d.add_blob(b"x", 2048, 2048, &[[0; 32]; 1]), None);
        assert_eq!(d.add_blob(&[b'x'; 65], 4096, 4096, &[[9; 32]; 1]), None);
        assert_eq!(d.blobs(), 2);
    }
}
