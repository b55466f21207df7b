//! The crc32c values of level 2: one per 4 KiB block of a chunk (the last block possibly
//! short), computed from verified bytes when the chunk is put, checked on every read; and the
//! memory cache of recently used values in front of the index, bounded in bytes
//! ([`SUMS_CACHED`]) whatever the chunk size.

use std::sync::Arc;

use lru::LruCache;

use super::ChunkId;

/// The unit of the crc32c checks.
pub const CHECK_BLOCK: u64 = 4096;

/// Bytes of crc32c values kept in memory: 4 MiB, the values of 4 GiB of chunks (16,384
/// chunks of 256 KiB, 65,536 of 64 KiB).
pub const SUMS_CACHED: usize = 4 << 20;

/// Bytes of the crc32c values of a chunk of `size` bytes.
pub(super) fn sums_len(size: u64) -> u64 {
    4 * size.div_ceil(CHECK_BLOCK)
}

/// Whether `sums` holds exactly the crc32c values of `data`'s 4 KiB blocks.
pub(super) fn blocks_match(data: &[u8], sums: &[u8]) -> bool {
    sums.len() as u64 == sums_len(data.len() as u64)
        && data
            .chunks(CHECK_BLOCK as usize)
            .zip(sums.chunks_exact(4))
            .all(|(block, sum)| crc32c::crc32c(block).to_le_bytes() == sum)
}

/// The crc32c values of `data`, one per 4 KiB block.
pub(super) fn block_sums(data: &[u8]) -> Vec<u8> {
    data.chunks(CHECK_BLOCK as usize)
        .flat_map(|b| crc32c::crc32c(b).to_le_bytes())
        .collect()
}

/// Recently used crc32c values, least recently used out first past [`SUMS_CACHED`] bytes.
#[derive(Debug)]
pub(super) struct SumsCache {
    lru: LruCache<ChunkId, Arc<[u8]>>,
    bytes: usize,
    capacity: usize,
}

impl SumsCache {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            lru: LruCache::unbounded(),
            bytes: 0,
            capacity,
        }
    }

    pub(super) fn get(&mut self, id: &ChunkId) -> Option<Arc<[u8]>> {
        self.lru.get(id).cloned()
    }

    pub(super) fn put(&mut self, id: ChunkId, sums: Arc<[u8]>) {
        self.bytes += sums.len();
        if let Some(old) = self.lru.put(id, sums) {
            self.bytes -= old.len();
        }
        while self.bytes > self.capacity {
            match self.lru.pop_lru() {
                Some((_, old)) => self.bytes -= old.len(),
                None => break,
            }
        }
    }

    pub(super) fn pop(&mut self, id: &ChunkId) {
        if let Some(old) = self.lru.pop(id) {
            self.bytes -= old.len();
        }
    }

    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Digest;

    #[test]
    fn the_sums_cache_is_bounded_in_bytes_whatever_the_chunk_size() {
        let mut c = SumsCache::new(1024);
        let id = |shift: u8, index: u64| ChunkId::new(Digest::of(b"s"), shift, index);
        // 256 KiB chunks: 256 bytes of values each, four fit.
        for i in 0..6 {
            c.put(id(18, i), Arc::from(vec![0u8; 256]));
        }
        assert_eq!(c.bytes(), 1024);
        assert!(c.get(&id(18, 1)).is_none() && c.get(&id(18, 2)).is_some());
        // 16 KiB chunks: 16 bytes each, many more fit in the same bytes.
        for i in 0..64 {
            c.put(id(14, i), Arc::from(vec![0u8; 16]));
        }
        assert_eq!(c.bytes(), 1024);
        assert!((0..64).all(|i| c.get(&id(14, i)).is_some()));
        // The same chunk put again is charged once; a popped one is not charged.
        c.put(id(14, 0), Arc::from(vec![1u8; 16]));
        c.pop(&id(14, 1));
        assert_eq!(c.bytes(), 1024 - 16);
    }

    #[test]
    fn a_reopened_level_2_holds_its_chunks_values_in_memory() {
        use crate::chunk::disk::{DiskCache, DiskCacheConfig};
        let dir = tempfile::tempdir().unwrap();
        let config = DiskCacheConfig {
            dir: dir.path().join("cache"),
            capacity: 1 << 30,
        };
        let id = |index: u64| ChunkId::new(Digest::of(b"reopened"), 14, index);
        let data: Vec<Vec<u8>> = (0..3u64)
            .map(|i| (0..16384u64).map(|b| (b * 3 + i * 17) as u8).collect())
            .collect();
        let disk = DiskCache::open(config.clone()).unwrap();
        for (i, d) in data.iter().enumerate() {
            disk.put(&id(i as u64), d).unwrap();
        }
        drop(disk);
        // The next process finds them in memory, read with the index at open: its first reads
        // check level-2 bytes without an index lookup each.
        let disk = DiskCache::open(config).unwrap();
        let mut cache = disk.sums.lock().unwrap();
        for (i, d) in data.iter().enumerate() {
            let got = cache.get(&id(i as u64)).expect("values loaded at open");
            assert_eq!(&got[..], &block_sums(d)[..]);
        }
    }
}
