//! The chunk table of a blob: its chunk size, one blake3 digest per chunk, and where each
//! chunk is stored.
//!
//! The chunk size is a property of the table, not of the blob's role: 256 KiB
//! ([`CHUNK_SIZE`]) by default, any power of two in [`MIN_CHUNK_SIZE`]..=[`MAX_CHUNK_SIZE`]
//! (Strata writes 4 KiB..=256 KiB). Readers always take it from the table.
//!
//! It is stored beside its blob as the sidecar object `blobs/xx/<blob>.chunks`, and read by the
//! chunk cache when a blob is registered. Every chunk the cache fetches is checked against it
//! (after decompression, for a compressed chunk) before it is kept or served. A plain blob of
//! 256 KiB chunks has its table written right after the blob; a compressed blob, and a blob
//! of any other chunk size, has its table written **before** the blob, so that such a stored
//! blob always has its table (see [`crate::store`]).
//!
//! # Byte layout (all integers little-endian)
//!
//! ```text
//! header, 80 bytes
//!   0   magic        [u8; 8]  "STRATACT"
//!   8   version      u32      1: every chunk plain; 2: chunks may be zstd frames
//!   12  flags        u32      0 (no table-wide flags are defined)
//!   16  chunk_size   u32      power of two, 4 KiB ..= 64 MiB (Strata writes 4 KiB ..=
//!                             256 KiB; 256 KiB unless asked otherwise)
//!   20  reserved     u32      0
//!   24  blob_size    u64      bytes of the blob (plain, uncompressed)
//!   32  stored_size  u64      bytes of the stored object (v1: = blob_size)
//!   40  chunk_count  u64      ceil(blob_size / chunk_size)
//!   48  blob         [u8; 32] blake3 of the whole plain blob: the table belongs to one blob
//! entries, chunk_count × 48 bytes
//!   0   digest        [u8; 32] blake3 of the chunk's plain (uncompressed) bytes
//!   32  stored_offset u64      where the chunk starts in the stored object
//!   40  stored_len    u32      its length there
//!   44  flags         u32      bit 0: the stored bytes are one zstd frame of the chunk
//!                               (v2 only); other bits 0
//! trailer, 32 bytes
//!   0   check         [u8; 32] blake3 of header and entries
//! ```
//!
//! # Invariants checked by [`ChunkTable::decode`]
//! The length is exactly `80 + 48 × chunk_count + 32` (so a hostile `chunk_count` cannot cause
//! a large allocation), the trailer matches, the table names the expected blob, and the chunk
//! count matches the blob size. The last chunk may be short; an empty blob has no chunks.
//! - Version 1 (written for plain blobs, and the only version before compression): every
//!   chunk `i` is stored at `i × chunk_size` with the length of its plain range, no flags,
//!   `stored_size = blob_size`.
//! - Version 2 (written for compressed blobs): the chunks are stored in order with no gap
//!   (chunk 0 at 0, each one where the previous ended, the last ending at `stored_size`), so
//!   adjacent chunks are one contiguous stored range and one backend request. A plain chunk's
//!   `stored_len` is its plain length; a zstd chunk's is at least 1 and **less** than its plain
//!   length (a frame that does not shrink is stored plain), so that decoding one chunk is
//!   bounded by the chunk size whatever the frame claims. Hence `stored_size < blob_size`
//!   whenever any chunk is compressed, and a stored object whose size is the blob's size is
//!   plain.

use std::ops::Range;

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::CHUNK_SIZE;
use crate::error::{Error, Result};
use crate::store::Digest;

/// The smallest chunk size a table may have.
pub const MIN_CHUNK_SIZE: u64 = 4 << 10;
/// The largest chunk size a table may have (tables of other writers; Strata writes at most
/// [`CHUNK_SIZE`]).
pub const MAX_CHUNK_SIZE: u64 = 64 << 20;

/// Whether `chunk_size` is one a chunk table can have: a power of two in
/// [`MIN_CHUNK_SIZE`]..=[`MAX_CHUNK_SIZE`].
pub fn is_valid_chunk_size(chunk_size: u64) -> bool {
    chunk_size.is_power_of_two() && (MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size)
}

/// Refuse a chunk size a table cannot have (see [`is_valid_chunk_size`]).
///
/// The error is an [`Error::Io`] of kind [`std::io::ErrorKind::InvalidInput`] that names the
/// size (the crate's error enum has no variant for a refused chunk size yet).
pub fn check_chunk_size(chunk_size: u64) -> Result<()> {
    if is_valid_chunk_size(chunk_size) {
        return Ok(());
    }
    Err(Error::InvalidChunkSize(chunk_size))
}

const MAGIC: [u8; 8] = *b"STRATACT";
const VERSION_PLAIN: u32 = 1;
const VERSION_STORED: u32 = 2;
/// Entry flag: the stored bytes are one zstd frame.
const FLAG_ZSTD: u32 = 1;

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

/// Where one chunk sits in a compressed blob's stored object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredChunk {
    pub offset: u64,
    pub len: u32,
    /// The stored bytes are one zstd frame of the chunk (else its plain bytes).
    pub zstd: bool,
}

/// Why a stored chunk could not be turned into its verified plain bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChunkFault {
    /// The stored bytes are not as long as the table says.
    Length { got: usize, want: u64 },
    /// The zstd frame did not decode to exactly the chunk's plain length.
    Decode(String),
    /// The plain bytes do not hash to the chunk's digest.
    Digest,
    /// No such chunk.
    Index,
}

impl std::fmt::Display for ChunkFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChunkFault::Length { got, want } => write!(f, "{got} stored bytes, expected {want}"),
            ChunkFault::Decode(e) => write!(f, "decompression failed: {e}"),
            ChunkFault::Digest => f.write_str("its bytes do not match its digest"),
            ChunkFault::Index => f.write_str("no such chunk"),
        }
    }
}

/// The digests of a blob's chunks, and (for a compressed blob) where each is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkTable {
    pub blob: Digest,
    pub blob_size: u64,
    pub chunk_size: u64,
    pub digests: Vec<Digest>,
    /// `None`: the stored object is the plain blob (a version-1 table). `Some`: one entry per
    /// chunk, contiguous from 0 (a version-2 table).
    pub stored: Option<Vec<StoredChunk>>,
}

impl ChunkTable {
    /// log2 of the chunk size (12..=26 for a table that was decoded or built; the chunk size
    /// is a power of two).
    pub fn chunk_shift(&self) -> u8 {
        self.chunk_size.trailing_zeros() as u8
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> u64 {
        self.digests.len() as u64
    }

    /// The byte range of chunk `index` in the (plain) blob.
    pub fn chunk_range(&self, index: u64) -> Range<u64> {
        let start = index * self.chunk_size;
        start..(start + self.chunk_size).min(self.blob_size)
    }

    /// The byte range of chunk `index` in the stored object.
    pub fn stored_range(&self, index: u64) -> Range<u64> {
        match self.stored.as_ref().and_then(|s| s.get(index as usize)) {
            Some(s) => s.offset..s.offset + u64::from(s.len),
            None => self.chunk_range(index),
        }
    }

    /// Whether any chunk is stored as a zstd frame (the stored object is not the plain blob).
    pub fn is_compressed(&self) -> bool {
        self.stored
            .as_ref()
            .is_some_and(|s| s.iter().any(|c| c.zstd))
    }

    /// Bytes of the stored object.
    pub fn stored_size(&self) -> u64 {
        match &self.stored {
            Some(s) => s.last().map_or(0, |c| c.offset + u64::from(c.len)),
            None => self.blob_size,
        }
    }

    /// Whether chunk `index` is stored as a zstd frame.
    pub fn is_zstd(&self, index: u64) -> bool {
        self.stored
            .as_ref()
            .and_then(|s| s.get(index as usize))
            .is_some_and(|c| c.zstd)
    }

    /// Turn chunk `index`'s stored bytes into its plain bytes and check them against its
    /// digest: decompression bounded by the chunk's plain length (see [`super::codec`]).
    pub fn open_chunk(
        &self,
        index: u64,
        stored: &[u8],
    ) -> std::result::Result<Vec<u8>, ChunkFault> {
        let want = self.digests.get(index as usize).ok_or(ChunkFault::Index)?;
        let sr = self.stored_range(index);
        if stored.len() as u64 != sr.end - sr.start {
            return Err(ChunkFault::Length {
                got: stored.len(),
                want: sr.end - sr.start,
            });
        }
        let r = self.chunk_range(index);
        let plain = if self.is_zstd(index) {
            super::codec::decode_chunk(stored, (r.end - r.start) as usize)
                .map_err(ChunkFault::Decode)?
        } else {
            stored.to_vec()
        };
        if Digest::of(&plain) != *want {
            return Err(ChunkFault::Digest);
        }
        Ok(plain)
    }

    /// Whether `data` is chunk `index`'s plain bytes (length and digest).
    pub fn verify_plain(&self, index: u64, data: &[u8]) -> bool {
        let r = self.chunk_range(index);
        data.len() as u64 == r.end - r.start
            && self.digests.get(index as usize) == Some(&Digest::of(data))
    }

    /// The table of `data`, whose digest is `blob`, in chunks of [`CHUNK_SIZE`].
    pub fn for_bytes(blob: Digest, data: &[u8]) -> Self {
        let mut b = ChunkTableBuilder::new();
        b.update(data);
        b.finish(blob)
    }

    /// The table of `data`, whose digest is `blob`, in chunks of `chunk_size` (refused unless
    /// [`is_valid_chunk_size`]). The chunks are hashed in parallel.
    pub fn for_bytes_with(blob: Digest, data: &[u8], chunk_size: u64) -> Result<Self> {
        let mut b = ChunkTableBuilder::with_chunk_size(chunk_size)?;
        b.update_par(data);
        Ok(b.finish(blob))
    }

    /// Read the chunk size from the first bytes of an encoded table of blob `blob` (at least
    /// its 80-byte header), without the rest of it: the magic, version, flags, chunk size and
    /// blob are checked, but nothing is verified against the trailer, so this is for
    /// information only (a reader decodes the whole table with [`Self::decode`]).
    pub fn peek_chunk_size(blob: &Digest, prefix: &[u8]) -> Result<u64> {
        let bad = |reason: String| Error::BadChunkTable {
            blob: blob.to_hex(),
            reason,
        };
        let (header, _) = Header::ref_from_prefix(prefix)
            .map_err(|_| bad(format!("{} bytes is shorter than the header", prefix.len())))?;
        let version = header.version.get();
        let chunk_size = u64::from(header.chunk_size.get());
        if header.magic != MAGIC
            || (version != VERSION_PLAIN && version != VERSION_STORED)
            || header.flags.get() != 0
            || header.reserved.get() != 0
            || !is_valid_chunk_size(chunk_size)
        {
            return Err(bad("not a chunk table header this code reads".into()));
        }
        if header.blob != blob.0 {
            return Err(bad(format!("it belongs to blob {}", Digest(header.blob))));
        }
        Ok(chunk_size)
    }

    /// Bytes of a table's header: enough for [`Self::peek_chunk_size`].
    pub const HEADER_BYTES: u64 = HEADER_LEN as u64;

    /// Serialise (see the module docs for the layout): version 1 without `stored`, else 2.
    pub fn encode(&self) -> Vec<u8> {
        let count = self.digests.len();
        let mut out = Vec::with_capacity(HEADER_LEN + count * ENTRY_LEN + TRAILER_LEN);
        let header = Header {
            magic: MAGIC,
            version: if self.stored.is_some() {
                VERSION_STORED
            } else {
                VERSION_PLAIN
            }
            .into(),
            flags: 0.into(),
            chunk_size: (self.chunk_size as u32).into(),
            reserved: 0.into(),
            blob_size: self.blob_size.into(),
            stored_size: self.stored_size().into(),
            chunk_count: (count as u64).into(),
            blob: self.blob.0,
        };
        out.extend_from_slice(header.as_bytes());
        for (i, d) in self.digests.iter().enumerate() {
            let r = self.stored_range(i as u64);
            let e = Entry {
                digest: d.0,
                stored_offset: r.start.into(),
                stored_len: ((r.end - r.start) as u32).into(),
                flags: if self.is_zstd(i as u64) { FLAG_ZSTD } else { 0 }.into(),
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
        let version = header.version.get();
        if version != VERSION_PLAIN && version != VERSION_STORED {
            return Err(bad(format!("unsupported version {version}")));
        }
        if header.flags.get() != 0 || header.reserved.get() != 0 {
            return Err(bad("unknown flags".into()));
        }
        let chunk_size = u64::from(header.chunk_size.get());
        if !is_valid_chunk_size(chunk_size) {
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
        let stored_size = header.stored_size.get();
        if version == VERSION_PLAIN && stored_size != blob_size {
            return Err(bad(
                "stored size differs from blob size in a version-1 (plain) table".into(),
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
            stored: None,
        };
        let mut stored = Vec::new();
        let mut at = 0u64;
        for (i, e) in entries.iter().enumerate() {
            let r = table.chunk_range(i as u64);
            let plain_len = r.end - r.start;
            let (offset, len, flags) = (
                e.stored_offset.get(),
                u64::from(e.stored_len.get()),
                e.flags.get(),
            );
            if version == VERSION_PLAIN {
                if flags != 0 {
                    return Err(bad(format!(
                        "chunk {i}: unsupported flags {flags:#x} in a version-1 table"
                    )));
                }
                if offset != r.start || len != plain_len {
                    return Err(bad(format!(
                        "chunk {i}: stored range does not match its place in the blob"
                    )));
                }
            } else {
                if flags & !FLAG_ZSTD != 0 {
                    return Err(bad(format!("chunk {i}: unsupported flags {flags:#x}")));
                }
                let zstd = flags & FLAG_ZSTD != 0;
                if offset != at {
                    return Err(bad(format!(
                        "chunk {i}: stored at {offset}, expected {at} (chunks are stored in order, without gaps)"
                    )));
                }
                let fits = if zstd {
                    len >= 1 && len < plain_len
                } else {
                    len == plain_len
                };
                if !fits {
                    return Err(bad(format!(
                        "chunk {i}: {len} stored bytes for {plain_len} plain ({})",
                        if zstd {
                            "a zstd frame must be shorter than its chunk"
                        } else {
                            "a plain chunk is stored as it is"
                        }
                    )));
                }
                at += len;
                stored.push(StoredChunk {
                    offset,
                    len: len as u32,
                    zstd,
                });
            }
            table.digests.push(Digest(e.digest));
        }
        if version == VERSION_STORED {
            if at != stored_size {
                return Err(bad(format!(
                    "chunks end at {at}, but the stored size is {stored_size}"
                )));
            }
            table.stored = Some(stored);
        }
        Ok(table)
    }
}

/// Builds a chunk table from a blob's bytes fed in pieces of any size.
#[derive(Debug)]
pub struct ChunkTableBuilder {
    /// A valid chunk size ([`is_valid_chunk_size`]).
    chunk_size: u64,
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
    /// A builder of a table in chunks of [`CHUNK_SIZE`] (256 KiB).
    pub fn new() -> Self {
        Self {
            chunk_size: CHUNK_SIZE,
            current: blake3::Hasher::new(),
            in_current: 0,
            total: 0,
            digests: Vec::new(),
        }
    }

    /// A builder of a table in chunks of `chunk_size`, which must be a power of two in
    /// [`MIN_CHUNK_SIZE`]..=[`MAX_CHUNK_SIZE`] (else an error, see [`check_chunk_size`]).
    pub fn with_chunk_size(chunk_size: u64) -> Result<Self> {
        check_chunk_size(chunk_size)?;
        Ok(Self {
            chunk_size,
            ..Self::new()
        })
    }

    /// The chunk size of the table being built.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Feed the next bytes of the blob.
    pub fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            data = self.update_partial(data);
        }
    }

    /// [`Self::update`], hashing the whole chunks in `data` in parallel on all cores (for
    /// large pieces; the result is the same).
    pub fn update_par(&mut self, data: &[u8]) {
        use rayon::prelude::*;
        let mut data = data;
        if self.in_current > 0 {
            data = self.update_partial(data);
        }
        let cs = self.chunk_size as usize;
        let whole = data.len() / cs * cs;
        if whole > cs {
            let digests: Vec<Digest> = data[..whole].par_chunks_exact(cs).map(Digest::of).collect();
            self.digests.extend(digests);
            self.total += whole as u64;
            data = &data[whole..];
        }
        self.update(data);
    }

    /// Feed bytes up to the end of the current chunk; the bytes left.
    fn update_partial<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        let room = (self.chunk_size - self.in_current) as usize;
        let n = room.min(data.len());
        self.current.update(&data[..n]);
        self.in_current += n as u64;
        self.total += n as u64;
        if self.in_current == self.chunk_size {
            self.digests
                .push(Digest(*self.current.finalize().as_bytes()));
            self.current.reset();
            self.in_current = 0;
        }
        &data[n..]
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
            chunk_size: self.chunk_size,
            digests: self.digests,
            stored: None,
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
    fn builders_of_other_chunk_sizes() {
        for cs in [4096u64, 16 << 10, 64 << 10] {
            let c = cs as usize;
            for n in [0usize, 1, c - 1, c, c + 1, 5 * c + 123, 40 * c] {
                let d = data(n);
                let blob = Digest::of(&d);
                let t = ChunkTable::for_bytes_with(blob, &d, cs).unwrap();
                assert_eq!((t.chunk_size, t.blob_size), (cs, n as u64));
                assert_eq!(1u64 << t.chunk_shift(), cs);
                // One digest per `cs` piece, each the blake3 of that piece.
                let want: Vec<Digest> = d.chunks(c).map(Digest::of).collect();
                assert_eq!(t.digests, want, "{cs} {n}");
                for (i, piece) in d.chunks(c).enumerate() {
                    assert_eq!(
                        t.chunk_range(i as u64).end - t.chunk_range(i as u64).start,
                        piece.len() as u64
                    );
                    assert!(t.verify_plain(i as u64, piece));
                    assert_eq!(t.open_chunk(i as u64, piece).unwrap(), piece);
                }
                // Fed in pieces of any size, serially or in parallel: the same table.
                let mut b = ChunkTableBuilder::with_chunk_size(cs).unwrap();
                assert_eq!(b.chunk_size(), cs);
                for (k, piece) in d.chunks(10_007).enumerate() {
                    if k % 2 == 0 {
                        b.update(piece);
                    } else {
                        b.update_par(piece);
                    }
                }
                assert_eq!(b.len(), n as u64);
                assert_eq!(b.finish(blob), t);
                let enc = t.encode();
                assert_eq!(&enc[16..20], &(cs as u32).to_le_bytes());
                assert_eq!(ChunkTable::decode(&blob, &enc).unwrap(), t);
                assert_eq!(ChunkTable::peek_chunk_size(&blob, &enc[..80]).unwrap(), cs);
                // The 256 KiB table of the same bytes is another table.
                if n > c {
                    assert_ne!(ChunkTable::for_bytes(blob, &d).digests, t.digests);
                }
            }
        }
        let d = data(600_000);
        let blob = Digest::of(&d);
        let t = ChunkTable::for_bytes_with(blob, &d, CHUNK_SIZE).unwrap();
        assert_eq!(t, ChunkTable::for_bytes(blob, &d));
        assert_eq!(t.chunk_shift(), 18);
        assert_eq!(ChunkTableBuilder::new().chunk_size(), CHUNK_SIZE);
        // The header alone is not enough for the wrong blob or a short prefix.
        let enc = t.encode();
        assert!(ChunkTable::peek_chunk_size(&Digest::of(b"x"), &enc).is_err());
        assert!(ChunkTable::peek_chunk_size(&blob, &enc[..79]).is_err());
    }

    #[test]
    fn invalid_chunk_sizes_are_refused() {
        for cs in [
            0u64,
            1,
            2048,
            3000,
            4095,
            4097,
            3 << 16,
            128 << 20,
            1 << 63,
            u64::MAX,
        ] {
            let e = ChunkTableBuilder::with_chunk_size(cs).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("power of two") && msg.contains(&cs.to_string()),
                "{cs}: {msg}"
            );
            assert!(ChunkTable::for_bytes_with(Digest::of(b""), b"", cs).is_err());
            assert!(!is_valid_chunk_size(cs));
        }
        for cs in [MIN_CHUNK_SIZE, 1 << 13, CHUNK_SIZE, 1 << 20, MAX_CHUNK_SIZE] {
            assert!(ChunkTableBuilder::with_chunk_size(cs).is_ok(), "{cs}");
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

    /// A compressed table of `d`: even chunks as zstd frames, odd ones plain; with the stored
    /// object.
    fn compressed(d: &[u8]) -> (ChunkTable, Vec<u8>) {
        compressed_with(d, CHUNK_SIZE)
    }

    /// [`compressed`] in chunks of `chunk_size`.
    fn compressed_with(d: &[u8], chunk_size: u64) -> (ChunkTable, Vec<u8>) {
        let mut t = ChunkTable::for_bytes_with(Digest::of(d), d, chunk_size).unwrap();
        let mut c = crate::chunk::codec::ChunkCompressor::new(3).unwrap();
        let mut object = Vec::new();
        let mut stored = Vec::new();
        for i in 0..t.chunk_count() {
            let r = t.chunk_range(i);
            let plain = &d[r.start as usize..r.end as usize];
            let frame = if i % 2 == 0 { c.compress(plain) } else { None };
            let bytes = frame.as_deref().unwrap_or(plain);
            stored.push(StoredChunk {
                offset: object.len() as u64,
                len: bytes.len() as u32,
                zstd: frame.is_some(),
            });
            object.extend_from_slice(bytes);
        }
        t.stored = Some(stored);
        (t, object)
    }

    #[test]
    fn compressed_tables_round_trip_and_open_chunks() {
        let d = data(3 * CHUNK_SIZE as usize + 1000);
        let (t, object) = compressed(&d);
        assert!(t.is_compressed());
        assert_eq!(t.stored_size(), object.len() as u64);
        assert!(t.stored_size() < t.blob_size);
        let enc = t.encode();
        assert_eq!(&enc[8..12], &2u32.to_le_bytes());
        let back = ChunkTable::decode(&t.blob, &enc).unwrap();
        assert_eq!(back, t);
        for i in 0..t.chunk_count() {
            let sr = t.stored_range(i);
            let r = t.chunk_range(i);
            let stored = &object[sr.start as usize..sr.end as usize];
            assert_eq!(
                t.open_chunk(i, stored).unwrap(),
                &d[r.start as usize..r.end as usize]
            );
            assert_eq!(t.is_zstd(i), i % 2 == 0);
            // A flipped byte, a truncated frame, a frame of another chunk: never the bytes.
            let mut flipped = stored.to_vec();
            flipped[stored.len() / 2] ^= 0x55;
            assert!(t.open_chunk(i, &flipped).is_err());
            assert!(matches!(
                t.open_chunk(i, &stored[..stored.len() - 1]),
                Err(ChunkFault::Length { .. })
            ));
        }
        let s0 = t.stored_range(0);
        let s2 = t.stored_range(2);
        // Chunk 2's frame in chunk 0's place (same length only by chance: pad/truncate).
        let mut other = object[s2.start as usize..s2.end as usize].to_vec();
        other.resize((s0.end - s0.start) as usize, 0);
        assert!(t.open_chunk(0, &other).is_err());
        assert_eq!(t.open_chunk(99, b""), Err(ChunkFault::Index));
        // A plain table opens plain chunks.
        let plain = ChunkTable::for_bytes(t.blob, &d);
        let r = plain.chunk_range(1);
        assert!(plain
            .open_chunk(1, &d[r.start as usize..r.end as usize])
            .is_ok());
        assert!(!plain.is_compressed());
    }

    #[test]
    fn compressed_tables_of_small_chunks_round_trip() {
        for cs in [4096u64, 16 << 10, 64 << 10] {
            let d = data(7 * cs as usize + 1000);
            let (t, object) = compressed_with(&d, cs);
            assert!(t.is_compressed() && t.chunk_count() == 8);
            let back = ChunkTable::decode(&t.blob, &t.encode()).unwrap();
            assert_eq!(back, t);
            assert_eq!(back.chunk_size, cs);
            for i in 0..t.chunk_count() {
                let sr = t.stored_range(i);
                let r = t.chunk_range(i);
                assert_eq!(r.start, i * cs);
                assert_eq!(
                    back.open_chunk(i, &object[sr.start as usize..sr.end as usize])
                        .unwrap(),
                    &d[r.start as usize..r.end as usize]
                );
            }
        }
    }

    #[test]
    fn malformed_compressed_tables_are_refused() {
        let d = data(3 * CHUNK_SIZE as usize + 1000);
        let (t, _) = compressed(&d);
        let good = t.encode();
        let reseal = |mut v: Vec<u8>| {
            let n = v.len() - 32;
            let check = *blake3::hash(&v[..n]).as_bytes();
            v[n..].copy_from_slice(&check);
            v
        };
        let entry = |i: usize| 80 + 48 * i;
        let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();
        // A gap before chunk 1.
        let mut v = good.clone();
        let off = u64::from_le_bytes(v[entry(1) + 32..entry(1) + 40].try_into().unwrap());
        v[entry(1) + 32..entry(1) + 40].copy_from_slice(&(off + 1).to_le_bytes());
        cases.push((reseal(v), "without gaps"));
        // A zstd frame as long as its chunk.
        let mut v = good.clone();
        v[entry(0) + 40..entry(0) + 44].copy_from_slice(&(CHUNK_SIZE as u32).to_le_bytes());
        cases.push((reseal(v), "shorter than its chunk"));
        // A zstd frame of 0 bytes.
        let mut v = good.clone();
        v[entry(0) + 40..entry(0) + 44].copy_from_slice(&0u32.to_le_bytes());
        cases.push((reseal(v), "shorter than its chunk"));
        // A plain chunk with another length.
        let mut v = good.clone();
        v[entry(1) + 40..entry(1) + 44].copy_from_slice(&5u32.to_le_bytes());
        cases.push((reseal(v), "stored as it is"));
        // An unknown flag bit.
        let mut v = good.clone();
        v[entry(1) + 44] = 2;
        cases.push((reseal(v), "unsupported flags"));
        // The stored size disagrees with the chunks.
        let mut v = good.clone();
        v[32..40].copy_from_slice(&(t.stored_size() + 1).to_le_bytes());
        cases.push((reseal(v), "stored size"));
        // A zstd flag in a version-1 table.
        let mut v = ChunkTable::for_bytes(t.blob, &d).encode();
        v[entry(0) + 44] = 1;
        cases.push((reseal(v), "version-1"));
        // A version-1 table with another stored size.
        let mut v = ChunkTable::for_bytes(t.blob, &d).encode();
        v[32..40].copy_from_slice(&5u64.to_le_bytes());
        cases.push((reseal(v), "version-1"));
        let mut v = good.clone();
        v[8..12].copy_from_slice(&3u32.to_le_bytes());
        cases.push((reseal(v), "unsupported version"));
        for (bytes, want) in cases {
            let e = ChunkTable::decode(&t.blob, &bytes).unwrap_err();
            assert!(e.to_string().contains(want), "want {want:?}, got {e}");
        }
    }
}
