//! Helpers of the level-2 tests (`disk_cache.rs`, `disk_shift.rs`): chunks whose bytes follow
//! from their ids, where they sit in their blob file, and what the files take on disk.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};

use fs_cache::chunk::disk::{DiskCache, DiskCacheConfig};
use fs_cache::chunk::{ChunkId, MAX_DISK_CHUNK_SHIFT};
use fs_cache::Digest;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// Chunk `index` of the blob named by `seed`, in 256 KiB chunks.
pub fn id(seed: &str, index: u64) -> ChunkId {
    id_at(seed, MAX_DISK_CHUNK_SHIFT, index)
}

/// Chunk `index` of the blob named by `seed`, in chunks of `1 << shift` bytes.
pub fn id_at(seed: &str, shift: u8, index: u64) -> ChunkId {
    ChunkId::new(Digest::of(seed.as_bytes()), shift, index)
}

/// The bytes of a chunk, derived from its id only (so a fresh process can check them).
pub fn content(id: &ChunkId, len: u64) -> Vec<u8> {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&id.blob.0);
    hasher.update(&id.index.to_le_bytes());
    let mut out = vec![0u8; len as usize];
    hasher.finalize_xof().fill(&mut out);
    out
}

pub fn open(dir: &Path, capacity: u64) -> DiskCache {
    match DiskCache::open(DiskCacheConfig {
        dir: dir.to_path_buf(),
        capacity,
    }) {
        Ok(c) => c,
        Err(e) => panic!("open {}: {e}", dir.display()),
    }
}

pub fn blob_file(dir: &Path, id: &ChunkId) -> PathBuf {
    let hex = id.blob.to_hex();
    dir.join("blobs").join(&hex[..2]).join(hex)
}

/// Where the chunk's slot starts in its blob file.
pub fn slot(id: &ChunkId) -> u64 {
    id.index << id.shift
}

/// Whether the chunk's slot (`1 << shift` bytes at `index << shift`) of its blob file holds
/// any data (not a hole).
pub fn chunk_has_data(dir: &Path, id: &ChunkId) -> bool {
    let Ok(f) = fs::File::open(blob_file(dir, id)) else {
        return false;
    };
    let at = slot(id);
    match rustix::fs::seek(&f, rustix::fs::SeekFrom::Data(at)) {
        Ok(d) => d < at + id.chunk_size(),
        Err(_) => false,
    }
}

/// A chunk or crc32c key of the index (`tag` `b'c'` or `b's'`), as `index.rs` writes it.
pub fn raw_key(tag: u8, x: &ChunkId) -> Vec<u8> {
    let mut k = vec![tag];
    k.extend_from_slice(&x.blob.0);
    k.extend_from_slice(&x.index.to_be_bytes());
    k
}

#[derive(Debug, Default)]
pub struct Usage {
    /// Bytes of blocks allocated to blob files.
    pub bytes: u64,
    pub files: u64,
}

/// Bytes a chunk of `len` bytes takes on disk: its blocks.
pub fn on_disk(len: u64) -> u64 {
    len.next_multiple_of(4096)
}

/// Blocks a filesystem may add for a sparse file's extent tree, per blob file.
pub const EXTENT_SLACK: u64 = 64 * KIB;

/// Walk `dir/blobs` (tolerating files that vanish during the walk).
pub fn usage(dir: &Path) -> Usage {
    use std::os::unix::fs::MetadataExt;
    let mut u = Usage::default();
    let Ok(shards) = fs::read_dir(dir.join("blobs")) else {
        return u;
    };
    for shard in shards.flatten() {
        let Ok(files) = fs::read_dir(shard.path()) else {
            continue;
        };
        for f in files.flatten() {
            let Ok(meta) = f.metadata() else { continue };
            u.bytes += meta.blocks() * 512;
            u.files += 1;
        }
    }
    u
}

/// On-disk usage matches the index: at least the indexed bytes, at most those plus extent
/// tree blocks.
pub fn assert_usage_matches(u: &Usage, bytes: u64, files: u64, what: &str) {
    assert_eq!(u.files, files, "{what}: {u:?}");
    assert!(
        u.bytes >= bytes && u.bytes <= bytes + files * EXTENT_SLACK,
        "{what}: {u:?} vs {bytes} indexed bytes"
    );
}
