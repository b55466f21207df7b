//! The chunk table of a blob: one blake3 digest per 256 KiB chunk.
//!
//! It is stored beside its blob as the sidecar object `blobs/xx/<blob>.chunks`, written right
//! after the blob by [`crate::Store`], and read by the chunk cache when a blob is registered.
//! Every chunk the cache fetches is checked against it before it is kept or served.
//!
//! # Byte layout (version 1, all integers little-endian)
//!
//! ```text
//! header, 80 bytes
//!   0   magic        [u8; 8]  "STRATACT"
//!   8   version      u32      1
//!   12  flags        u32      0 (no table-wide flags are defined)
//!   16  chunk_size   u32      power of two, 4 KiB ..= 64 MiB (Strata writes 256 KiB)
//!   20  reserved     u32      0
//!   24  blob_size    u64      bytes of the blob (uncompressed)
//!   32  stored_size  u64      bytes of the stored object (= blob_size: no chunk is compressed)
//!   40  chunk_count  u64      ceil(blob_size / chunk_size)
//!   48  blob         [u8; 32] blake3 of the whole blob: the table belongs to exactly one blob
//! entries, chunk_count × 48 bytes
//!   0   digest        [u8; 32] blake3 of the chunk's uncompressed bytes
//!   32  stored_offset u64      where the chunk starts in the stored object
//!   40  stored_len    u32      its length there
//!   44  flags         u32      0; bit 0 is reserved for "a zstd frame" (transport
//!                               compression), which this version neither writes nor accepts
//! trailer, 32 bytes
//!   0   check         [u8; 32] blake3 of header and entries
//! ```
//!
//! # Invariants checked by [`ChunkTable::decode`]
//! The length is exactly `80 + 48 × chunk_count + 32` (so a hostile `chunk_count` cannot cause
//! a large allocation), the trailer matches, the table names the expected blob, the chunk count
//! matches the blob size, and every chunk `i` is stored at `i × chunk_size` with the length of
//! its uncompressed range. The last chunk may be short; an empty blob has no chunks.

use std::ops::Range;

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::CHUNK_SIZE;
use crate::error::{Error, Result};
use crate::store::Digest;

const MAGIC: [u8; 8] = *b"STRATACT";
const VERSION: u32 = 1;

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct Header {
    magic: [u8; 8],
    version: U32,
    flags: U32,
    chunk_size: U32,
    reserved: U32,
    blob_size: U64,
    stored_size: U64,
    chunk_count: U64,
    blob: [u8; 32],
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct Entry {
    digest: [u8; 32],
    stored_offset: U64,
    stored_len: U32,
    flags: U32,
}

const HEADER_LEN: usize = 80;
const ENTRY_LEN: usize = 48;
const TRAILER_LEN: usize = 32;
const _: () = assert!(std::mem::size_of::<Header>() == HEADER_LEN);
const _: () = assert!(std::mem::size_of::<Entry>() == ENTRY_LEN);

/// The digests of a blob's chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkTable {
    pub blob: Digest,
    pub blob_size: u64,
    pub chunk_size: u64,
    pub digests: Vec<Digest>,
}

impl ChunkTable {
    /// Number of chunks.
    pub fn chunk_count(&self) -> u64 {
        self.digests.len() as u64
    }

    /// The byte range of chunk `index` in the blob.
    pub fn chunk_range(&self, index: u64) -> Range<u64> {
        let start = index * self.chunk_size;
        start..(start + self.chunk_size).min(self.blob_size)
    }

    /// The table of `data`, whose digest is `blob`.
    pub fn for_bytes(blob: Digest, data: &[u8]) -> Self {
        let mut b = ChunkTableBuilder::new();
        b.update(data);
        b.finish(blob)
    }

    /// Serialise (see the module docs for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let count = self.digests.len();
        let mut out = Vec::with_capacity(HEADER_LEN + count * ENTRY_LEN + TRAILER_LEN);
        let header = Header {
            magic: MAGIC,
            version: VERSION.into(),
            flags: 0.into(),
            chunk_size: (self.chunk_size as u32).into(),
            reserved: 0.into(),
            blob_size: self.blob_size.into(),
            stored_size: self.blob_size.into(),
            chunk_count: (count as u64).into(),
            blob: self.blob.0,
        };
        out.extend_from_slice(header.as_bytes());
        for (i, d) in self.digests.iter().enumerate() {
            let r = self.chunk_range(i as u64);
            let e = Entry {
                digest: d.0,
                stored_offset: r.start.into(),
                stored_len: ((r.end - r.start) as u32).into(),
                flags: 0.into(),
            };
            out.extend_from_slice(e.as_bytes());
        }
        let check = blake3::hash(&out);
        out.extend_from_slice(check.as_bytes());
        out
    }

    /// Parse and check the table of blob `blob`.
    pub fn decode(blob: &Digest, bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::BadChunkTable {
            blob: blob.to_hex(),
            reason,
        };
        let (header, rest) = Header::ref_from_prefix(bytes)
            .map_err(|_| bad(format!("{} bytes is shorter than the header", bytes.len())))?;
        if header.magic != MAGIC {
            return Err(bad("wrong magic".into()));
        }
        if header.version.get() != VERSION {
            return Err(bad(format!("unsupported version {}", header.version.get())));
        }
        if header.flags.get() != 0 || header.reserved.get() != 0 {
            return Err(bad("unknown flags".into()));
        }
        let chunk_size = u64::from(header.chunk_size.get());
        if !chunk_size.is_power_of_two() || !(4096..=64 << 20).contains(&chunk_size) {
            return Err(bad(format!(
                "chunk size {chunk_size} is not a power of two in 4 KiB..=64 MiB"
            )));
        }
        let blob_size = header.blob_size.get();
        let count = header.chunk_count.get();
        if count != blob_size.div_ceil(chunk_size) {
            return Err(bad(format!(
                "{count} chunks cannot cover {blob_size} bytes"
            )));
        }
        if header.stored_size.get() != blob_size {
            return Err(bad(
                "stored size differs from blob size, but no chunk is compressed".into(),
            ));
        }
        if header.blob != blob.0 {
            return Err(bad(format!("it belongs to blob {}", Digest(header.blob))));
        }
        let want = (count as u128) * ENTRY_LEN as u128 + TRAILER_LEN as u128;
        if rest.len() as u128 != want {
            return Err(bad(format!(
                "{} bytes after the header, expected {want} for {count} chunks",
                rest.len()
            )));
        }
        let body_len = bytes.len() - TRAILER_LEN;
        if blake3::hash(&bytes[..body_len]).as_bytes()[..] != bytes[body_len..] {
            return Err(bad("checksum mismatch".into()));
        }
        let entries = <[Entry]>::ref_from_bytes(&rest[..rest.len() - TRAILER_LEN])
            .map_err(|_| bad("misaligned entries".into()))?;
        let mut table = ChunkTable {
            blob: *blob,
            blob_size,
            chunk_size,
            digests: Vec::with_capacity(entries.len()),
        };
        for (i, e) in entries.iter().enumerate() {
            let r = table.chunk_range(i as u64);
            if e.flags.get() != 0 {
                return Err(bad(format!(
                    "chunk {i}: unsupported flags {:#x}",
                    e.flags.get()
                )));
            }
            if e.stored_offset.get() != r.start || u64::from(e.stored_len.get()) != r.end - r.start
            {
                return Err(bad(format!(
                    "chunk {i}: stored range does not match its place in the blob"
                )));
            }
            table.digests.push(Digest(e.digest));
        }
        Ok(table)
    }
}

/// Builds a chunk table from a blob's bytes fed in pieces of any size.
#[derive(Debug)]
pub struct ChunkTableBuilder {
    current: blake3::Hasher,
    in_current: u64,
    total: u64,
    digests: Vec<Digest>,
}

impl Default for ChunkTableBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkTableBuilder {
    pub fn new() -> Self {
        Self {
            current: blake3::Hasher::new(),
            in_current: 0,
            total: 0,
            digests: Vec::new(),
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let room = (CHUNK_SIZE - self.in_current) as usize;
            let n = room.min(data.len());
            self.current.update(&data[..n]);
            self.in_current += n as u64;
            self.total += n as u64;
            data = &data[n..];
            if self.in_current == CHUNK_SIZE {
                self.digests
                    .push(Digest(*self.current.finalize().as_bytes()));
                self.current.reset();
                self.in_current = 0;
            }
        }
    }

    /// Bytes fed so far.
    pub fn len(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    pub fn finish(mut self, blob: Digest) -> ChunkTable {
        if self.in_current > 0 {
            self.digests
                .push(Digest(*self.current.finalize().as_bytes()));
        }
        ChunkTable {
            blob,
            blob_size: self.total,
            chunk_size: CHUNK_SIZE,
            digests: self.digests,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 253) as u8).collect()
    }

    #[test]
    fn round_trip_and_piecewise_build() {
        for n in [
            0usize,
            1,
            4096,
            CHUNK_SIZE as usize,
            CHUNK_SIZE as usize + 1,
            3 * CHUNK_SIZE as usize - 7,
        ] {
            let d = data(n);
            let blob = Digest::of(&d);
            let t = ChunkTable::for_bytes(blob, &d);
            assert_eq!(t.chunk_count(), (n as u64).div_ceil(CHUNK_SIZE));
            for (i, digest) in t.digests.iter().enumerate() {
                let r = t.chunk_range(i as u64);
                assert_eq!(*digest, Digest::of(&d[r.start as usize..r.end as usize]));
            }
            let mut b = ChunkTableBuilder::new();
            for piece in d.chunks(10_007) {
                b.update(piece);
            }
            assert_eq!(b.finish(blob), t);
            let enc = t.encode();
            assert_eq!(enc.len(), 80 + 48 * t.digests.len() + 32);
            assert_eq!(ChunkTable::decode(&blob, &enc).unwrap(), t);
        }
    }

    #[test]
    fn malformed_tables_are_refused() {
        let d = data(600_000);
        let blob = Digest::of(&d);
        let good = ChunkTable::for_bytes(blob, &d).encode();
        let reseal = |mut v: Vec<u8>| {
            let n = v.len() - 32;
            let check = *blake3::hash(&v[..n]).as_bytes();
            v[n..].copy_from_slice(&check);
            v
        };
        let mut cases: Vec<(Vec<u8>, &str)> = vec![
            (Vec::new(), "shorter than the header"),
            (good[..good.len() - 1].to_vec(), "bytes after the header"),
            (good[..100].to_vec(), "bytes after the header"),
        ];
        let mut v = good.clone();
        v[0] = b'X';
        cases.push((v, "magic"));
        let mut v = good.clone();
        v[90] ^= 1;
        cases.push((v, "checksum"));
        let mut v = good.clone();
        v[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        cases.push((reseal(v), "cannot cover"));
        let mut v = good.clone();
        v[24..32].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        v[40..48].copy_from_slice(&(u64::MAX / 2).div_ceil(CHUNK_SIZE).to_le_bytes());
        v[32..40].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        cases.push((reseal(v), "bytes after the header"));
        let mut v = good.clone();
        v[16..20].copy_from_slice(&1000u32.to_le_bytes());
        cases.push((reseal(v), "power of two"));
        let mut v = good.clone();
        v[80 + 32..80 + 40].copy_from_slice(&5u64.to_le_bytes());
        cases.push((reseal(v), "stored range"));
        let mut v = good.clone();
        v[80 + 44] = 1;
        cases.push((reseal(v), "unsupported flags"));
        for (bytes, want) in cases {
            let e = ChunkTable::decode(&blob, &bytes).unwrap_err();
            assert!(e.to_string().contains(want), "want {want:?}, got {e}");
        }
        let other = Digest::of(b"other");
        let e = ChunkTable::decode(&other, &good).unwrap_err();
        assert!(e.to_string().contains("belongs to blob"), "{e}");
    }
}
