//! The 256 KiB chunk cache: every read on a node goes through it.
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

pub mod cache;
pub mod codec;
pub mod counters;
pub mod disk;
pub mod recorder;
mod stage;
pub mod table;

pub use cache::{CacheConfig, CacheStats, ChunkCache};
pub use codec::Compression;
pub use counters::BlobStats;
pub use recorder::{Recording, ReplayStats};

use crate::store::Digest;

/// The fixed chunk size: 256 KiB, in the uncompressed address space of a blob.
pub const CHUNK_SIZE: u64 = 256 << 10;

/// One chunk of one blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId {
    pub blob: Digest,
    pub index: u64,
}
