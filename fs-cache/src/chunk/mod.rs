//! The chunk cache: every read on a node goes through it. A blob's chunk size is a property
//! of its chunk table ([`CHUNK_SIZE`] by default); level 2 keeps chunks of 4 KiB ..= 256 KiB
//! ([`MAX_DISK_CHUNK_SHIFT`]), larger ones stay in level 1.
//!
//! - [`table`]: the chunk table of a blob (per-chunk blake3 digests and, for a compressed
//!   blob, where each chunk is stored), its byte layout, and how it is built while a blob is
//!   stored.
//! - [`codec`]: how chunks are stored ([`Compression`]: plain, or one zstd frame per chunk),
//!   and the bounded decoding of a frame.
//! - [`disk`]: level 2, one sparse file per blob on local disk with a RocksDB index that
//!   survives restarts.
//! - [`cache`]: the cache itself: level 1 in memory, misses coalesced into ranged backend
//!   requests, concurrent misses shared, every chunk verified before it is kept or served.
//! - [`counters`]: per-blob bytes, backend errors by kind, backend request latency.
//! - [`recorder`]: access traces recorded from demand reads and replayed as prefetch
//!   ([`crate::trace`]).
//! - `stage`: chunks read ahead from level 2 for sequential readers.
//! - `bounds`: where files' data runs end in a blob, so that a reader of one file reads
//!   ahead only to its end.
//! - `writer`: level 2's write queue (verified chunks written in batches, in the background).
//! - `window`: the fetch unit, how far a demand miss in a blob of small chunks widens its
//!   backend request ([`CacheConfig::fetch_unit_bytes`]), only while that has paid lately in
//!   the blob ([`Yield`]); and how a replayed trace's gaps are filled.

mod bounds;
pub mod cache;
pub mod codec;
pub mod counters;
pub mod disk;
pub mod recorder;
mod stage;
pub mod table;
mod window;
mod writer;
pub use writer::{DISK_LINGER, RESUMED_DISK_LINGER, RESUMED_FOR};

pub use cache::{CacheConfig, CacheStats, ChunkCache};
pub use codec::Compression;
pub use counters::BlobStats;
pub use recorder::{Recording, ReplayStats};
pub use window::{Yield, DEFAULT_MIN_YIELD_PCT};

use crate::store::Digest;

/// The fixed chunk size: 256 KiB, in the uncompressed address space of a blob.
pub const CHUNK_SIZE: u64 = 256 << 10;

/// The largest chunk level 2 keeps, as a shift: 256 KiB. A blob whose table has larger chunks
/// (the table format allows up to 64 MiB) stays in level 1.
pub const MAX_DISK_CHUNK_SHIFT: u8 = 18;
/// The smallest chunk a table may have, as a shift: 4 KiB (one crc32c block of level 2).
pub const MIN_CHUNK_SHIFT: u8 = 12;

const _: () = assert!(1u64 << MAX_DISK_CHUNK_SHIFT == CHUNK_SIZE);

/// One chunk of one blob, under one chunking: chunk `index` of `blob` cut into chunks of
/// `1 << shift` bytes (the blob's chunk table says which). The shift is part of the identity:
/// chunk `i` of a blob cut into 64 KiB chunks is other bytes than chunk `i` of the same blob
/// cut into 256 KiB chunks, and neither level may serve one for the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId {
    pub blob: Digest,
    /// log2 of the chunk size.
    pub shift: u8,
    pub index: u64,
}

impl ChunkId {
    pub fn new(blob: Digest, shift: u8, index: u64) -> Self {
        Self { blob, shift, index }
    }

    /// The chunk size: `1 << shift` bytes (saturating for a shift past 63).
    pub fn chunk_size(&self) -> u64 {
        1u64.checked_shl(u32::from(self.shift)).unwrap_or(u64::MAX)
    }
}
