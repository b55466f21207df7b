//! Recorded access traces: which bytes of a layer's blobs its first readers on a node read, in
//! the order they first read them.
//!
//! A node records a trace for a layer the first time it mounts it and no trace is stored yet
//! ([`crate::chunk::ChunkCache::record`], for a window of seconds), and stores it beside the
//! layer's meta image as the sidecar `blobs/xx/<meta>.trace` (created once: the first node to
//! finish recording wins, later ones keep theirs). A node that mounts the layer later fetches
//! the trace and replays it as prefetch ([`crate::chunk::ChunkCache::replay`]): the chunks the
//! layer's first readers needed are fetched in that order, in large requests, ahead of the
//! new readers. A builder can also lay out the layer's next version in trace order (`strata
//! layer build --order-from`), so that what is read together is stored together.
//!
//! A trace is advisory: a missing, damaged or foreign one is ignored (and a damaged one
//! recorded again); it never changes what a read returns. It is garbage-collected with its
//! meta image (it is one of the meta blob's sidecars, [`crate::gc`]).
//!
//! # Byte layout (all integers little-endian)
//!
//! ```text
//! header, 32 bytes
//!   0   magic      [u8; 8]  "STRATATR"
//!   8   version    u16      1
//!   10  blob_count u16      1 ..= MAX_TRACE_BLOBS
//!   12  entries    u32      0 ..= MAX_TRACE_ENTRIES
//!   16  window_ms  u32      how long the recording ran
//!   20  reserved   u32      0
//!   24  check      u32      crc32c of the whole trace with this field zero
//!   28  reserved   u32      0
//! blobs, blob_count × 32 bytes: the blake3 digests of the blobs the entries point into, in
//!   the layer's device order (device 1 is blob 0)
//! entries, entries × 12 bytes, in the order the bytes were first read
//!   0   blob       u16      index into the blobs above
//!   2   reserved   u16      0
//!   4   block      u32      first 4 KiB block of the read in the blob (plain offsets)
//!   8   blocks     u32      1 ..= MAX_ENTRY_BLOCKS blocks
//! ```
//!
//! [`Trace::decode`] checks the exact length (so a hostile count cannot cause a large
//! allocation), the magic, version, reserved fields and crc32c, and that every entry names a
//! listed blob and a non-empty range that does not overflow. It does not know the blobs'
//! sizes: a replay clips each entry to its blob.

use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::{Error, Result};
use crate::store::{sidecar_key, Digest};

const MAGIC: [u8; 8] = *b"STRATATR";
const VERSION: u16 = 1;
/// The block size of trace entries (EROFS's block, the unit of a layer's file data).
pub const TRACE_BLOCK: u64 = 4096;
/// At most this many blobs in one trace (a layer's own blob and its dedup devices).
pub const MAX_TRACE_BLOBS: usize = 64;
/// At most this many entries in one trace (about 768 KiB encoded).
pub const MAX_TRACE_ENTRIES: usize = 1 << 16;
/// At most this many blocks per entry (64 MiB; a longer read is several entries).
pub const MAX_ENTRY_BLOCKS: u32 = 1 << 14;
/// The suffix of a layer's trace: the sidecar `blobs/xx/<meta>.trace` of its meta image.
pub const TRACE_SUFFIX: &str = "trace";

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct Header {
    magic: [u8; 8],
    version: U16,
    blob_count: U16,
    entries: U32,
    window_ms: U32,
    reserved: U32,
    check: U32,
    reserved2: U32,
}

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct RawEntry {
    blob: U16,
    reserved: U16,
    block: U32,
    blocks: U32,
}

const HEADER_LEN: usize = 32;
const DIGEST_LEN: usize = 32;
const ENTRY_LEN: usize = 12;
const _: () = assert!(std::mem::size_of::<Header>() == HEADER_LEN);
const _: () = assert!(std::mem::size_of::<RawEntry>() == ENTRY_LEN);

/// One read of a trace: `blocks` 4 KiB blocks of blob `blob` (an index into
/// [`Trace::blobs`]) from block `block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceEntry {
    pub blob: u16,
    pub block: u32,
    pub blocks: u32,
}

impl TraceEntry {
    /// The entry's byte range in its blob.
    pub fn bytes(&self) -> std::ops::Range<u64> {
        let start = u64::from(self.block) * TRACE_BLOCK;
        start..start + u64::from(self.blocks) * TRACE_BLOCK
    }
}

/// A recorded access trace (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The blobs the entries point into, in the layer's device order.
    pub blobs: Vec<Digest>,
    /// The reads, in the order their bytes were first read.
    pub entries: Vec<TraceEntry>,
    /// How long the recording ran, in milliseconds.
    pub window_ms: u32,
}

/// The store key of the trace of the layer whose meta image is `meta`.
pub fn trace_key(meta: &Digest) -> String {
    sidecar_key(meta, TRACE_SUFFIX)
}

impl Trace {
    /// A trace over `blobs` from reads `(blob, byte range)` in the order they happened: each
    /// range widened to whole blocks, a read that continues the previous one on the same blob
    /// merged into it, one that repeats a range already listed dropped, at most
    /// [`MAX_TRACE_ENTRIES`] kept. Reads of blobs not in `blobs` are left out.
    pub fn from_reads(
        blobs: Vec<Digest>,
        reads: impl IntoIterator<Item = (Digest, std::ops::Range<u64>)>,
        window_ms: u32,
    ) -> Self {
        let mut blobs = blobs;
        blobs.truncate(MAX_TRACE_BLOBS);
        let mut entries: Vec<TraceEntry> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (d, r) in reads {
            let Some(b) = blobs.iter().position(|x| *x == d) else {
                continue;
            };
            if r.is_empty() {
                continue;
            }
            let first = r.start / TRACE_BLOCK;
            let end = r.end.div_ceil(TRACE_BLOCK);
            let (Ok(mut block), Ok(end)) = (u32::try_from(first), u32::try_from(end)) else {
                continue;
            };
            while block < end {
                let blocks = (end - block).min(MAX_ENTRY_BLOCKS);
                let e = TraceEntry {
                    blob: b as u16,
                    block,
                    blocks,
                };
                block += blocks;
                if !seen.insert((e.blob, e.block, e.blocks)) {
                    continue;
                }
                let full = entries.len() >= MAX_TRACE_ENTRIES;
                match entries.last_mut() {
                    Some(last)
                        if last.blob == e.blob
                            && last.block + last.blocks == e.block
                            && last.blocks + e.blocks <= MAX_ENTRY_BLOCKS =>
                    {
                        last.blocks += e.blocks;
                    }
                    _ if full => return Self::new(blobs, entries, window_ms),
                    _ => entries.push(e),
                }
            }
        }
        Self::new(blobs, entries, window_ms)
    }

    fn new(blobs: Vec<Digest>, entries: Vec<TraceEntry>, window_ms: u32) -> Self {
        Trace {
            blobs,
            entries,
            window_ms,
        }
    }

    /// Bytes the entries cover (repeats counted again).
    pub fn bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| u64::from(e.blocks) * TRACE_BLOCK)
            .sum()
    }

    /// The trace's bytes (the layout above).
    pub fn encode(&self) -> Vec<u8> {
        let blobs = &self.blobs[..self.blobs.len().min(MAX_TRACE_BLOBS)];
        let entries = &self.entries[..self.entries.len().min(MAX_TRACE_ENTRIES)];
        let mut out =
            Vec::with_capacity(HEADER_LEN + DIGEST_LEN * blobs.len() + ENTRY_LEN * entries.len());
        let header = Header {
            magic: MAGIC,
            version: VERSION.into(),
            blob_count: (blobs.len() as u16).into(),
            entries: (entries.len() as u32).into(),
            window_ms: self.window_ms.into(),
            reserved: 0.into(),
            check: 0.into(),
            reserved2: 0.into(),
        };
        out.extend_from_slice(header.as_bytes());
        for d in blobs {
            out.extend_from_slice(&d.0);
        }
        for e in entries {
            let raw = RawEntry {
                blob: e.blob.into(),
                reserved: 0.into(),
                block: e.block.into(),
                blocks: e.blocks.into(),
            };
            out.extend_from_slice(raw.as_bytes());
        }
        let check = crc32c::crc32c(&out);
        out[24..28].copy_from_slice(&check.to_le_bytes());
        out
    }

    /// Parse and check a trace (see the module docs); `layer` names it in errors.
    pub fn decode(layer: &str, bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::BadTrace {
            layer: layer.to_owned(),
            reason,
        };
        let (header, rest) = Header::read_from_prefix(bytes)
            .map_err(|_| bad(format!("{} bytes, shorter than its header", bytes.len())))?;
        if header.magic != MAGIC {
            return Err(bad("not a trace (bad magic)".into()));
        }
        if header.version.get() != VERSION {
            return Err(bad(format!(
                "version {} (this build reads 1)",
                header.version
            )));
        }
        if header.reserved.get() != 0 || header.reserved2.get() != 0 {
            return Err(bad("reserved header fields are not zero".into()));
        }
        let nblobs = usize::from(header.blob_count.get());
        let nentries = header.entries.get() as usize;
        if nblobs == 0 || nblobs > MAX_TRACE_BLOBS {
            return Err(bad(format!("{nblobs} blobs (1..={MAX_TRACE_BLOBS})")));
        }
        if nentries > MAX_TRACE_ENTRIES {
            return Err(bad(format!(
                "{nentries} entries (at most {MAX_TRACE_ENTRIES})"
            )));
        }
        let want = DIGEST_LEN * nblobs + ENTRY_LEN * nentries;
        if rest.len() != want {
            return Err(bad(format!(
                "{} bytes, expected {} for {nblobs} blobs and {nentries} entries",
                bytes.len(),
                HEADER_LEN + want
            )));
        }
        let mut zeroed = bytes.to_vec();
        zeroed[24..28].fill(0);
        if crc32c::crc32c(&zeroed) != header.check.get() {
            return Err(bad("checksum mismatch".into()));
        }
        let (digests, raw_entries) = rest.split_at(DIGEST_LEN * nblobs);
        let blobs: Vec<Digest> = digests
            .chunks_exact(DIGEST_LEN)
            .map(|c| {
                let mut d = [0u8; 32];
                d.copy_from_slice(c);
                Digest(d)
            })
            .collect();
        let mut entries = Vec::with_capacity(nentries);
        for (i, c) in raw_entries.chunks_exact(ENTRY_LEN).enumerate() {
            let raw = RawEntry::read_from_bytes(c)
                .map_err(|_| bad(format!("entry {i} is not {ENTRY_LEN} bytes")))?;
            let e = TraceEntry {
                blob: raw.blob.get(),
                block: raw.block.get(),
                blocks: raw.blocks.get(),
            };
            if raw.reserved.get() != 0 {
                return Err(bad(format!("entry {i}: reserved field is not zero")));
            }
            if usize::from(e.blob) >= nblobs {
                return Err(bad(format!("entry {i}: blob {} of {nblobs}", e.blob)));
            }
            if e.blocks == 0
                || e.blocks > MAX_ENTRY_BLOCKS
                || e.block.checked_add(e.blocks).is_none()
            {
                return Err(bad(format!(
                    "entry {i}: {} blocks at block {} (1..={MAX_ENTRY_BLOCKS}, within u32)",
                    e.blocks, e.block
                )));
            }
            entries.push(e);
        }
        Ok(Trace {
            blobs,
            entries,
            window_ms: header.window_ms.get(),
        })
    }
}

impl crate::Store {
    /// The stored trace of the layer whose meta image is `meta` (`layer` names it in errors):
    /// `None` if it has none, [`Error::BadTrace`] if it is damaged.
    pub async fn trace(&self, meta: &Digest, layer: &str) -> Result<Option<Trace>> {
        match self.backend().get(&trace_key(meta)).await {
            Ok(bytes) => Trace::decode(layer, &bytes).map(Some),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Store `trace` as the trace of the layer whose meta image is `meta`: created only if
    /// the layer has none ([`Error::AlreadyExists`] otherwise), or replacing it (`replace`).
    pub async fn put_trace(&self, meta: &Digest, trace: &Trace, replace: bool) -> Result<()> {
        let mode = if replace {
            crate::PutMode::Overwrite
        } else {
            crate::PutMode::Create
        };
        self.backend()
            .put_opts(&trace_key(meta), bytes::Bytes::from(trace.encode()), mode)
            .await
            .map(|_| ())
    }
}

/// For the fuzz target: decode anything, and a decoded trace must encode to the same bytes.
pub fn fuzz_decode(bytes: &[u8]) {
    if let Ok(t) = Trace::decode("fuzz", bytes) {
        assert_eq!(t.encode(), bytes, "a decoded trace re-encodes to its bytes");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> Digest {
        Digest([n; 32])
    }

    #[test]
    fn reads_merge_widen_and_round_trip() {
        let reads = vec![
            (d(1), 100..5000),    // blocks 0..2
            (d(1), 8192..12288),  // continues: block 2
            (d(2), 0..1),         // another blob
            (d(1), 0..4096),      // block 0 alone: not a range listed before
            (d(9), 0..4096),      // not a layer blob
            (d(1), 8192..12288),  // exact repeat: dropped
            (d(2), 40960..40960), // empty
        ];
        let t = Trace::from_reads(vec![d(1), d(2)], reads, 1500);
        assert_eq!(
            t.entries,
            vec![
                TraceEntry {
                    blob: 0,
                    block: 0,
                    blocks: 3
                },
                TraceEntry {
                    blob: 1,
                    block: 0,
                    blocks: 1
                },
                TraceEntry {
                    blob: 0,
                    block: 0,
                    blocks: 1
                },
            ]
        );
        let bytes = t.encode();
        assert_eq!(bytes.len(), HEADER_LEN + 2 * DIGEST_LEN + 3 * ENTRY_LEN);
        assert_eq!(Trace::decode("l", &bytes).unwrap(), t);
        fuzz_decode(&bytes);
    }

    #[test]
    fn long_reads_split_and_the_entry_count_is_bounded() {
        let t = Trace::from_reads(
            vec![d(1)],
            vec![(d(1), 0..(MAX_ENTRY_BLOCKS as u64 * 3) * 4096)],
            0,
        );
        assert_eq!(t.entries.len(), 3);
        assert!(t.entries.iter().all(|e| e.blocks == MAX_ENTRY_BLOCKS));
        let many = (0..(MAX_TRACE_ENTRIES as u64 + 10)).map(|i| (d(1), i * 8192..i * 8192 + 1));
        let t = Trace::from_reads(vec![d(1)], many, 0);
        assert_eq!(t.entries.len(), MAX_TRACE_ENTRIES);
    }

    #[test]
    fn damage_is_refused_with_a_reason() {
        let t = Trace::from_reads(vec![d(1)], vec![(d(1), 0..4096)], 7);
        let good = t.encode();
        for (what, bytes) in [
            ("empty", Vec::new()),
            ("short", good[..good.len() - 1].to_vec()),
            ("long", [good.clone(), vec![0]].concat()),
            ("bit flip", {
                let mut b = good.clone();
                b[HEADER_LEN + 3] ^= 1;
                b
            }),
            ("magic", {
                let mut b = good.clone();
                b[0] = b'X';
                b
            }),
        ] {
            let e = Trace::decode("l", &bytes).expect_err(what);
            assert!(matches!(e, Error::BadTrace { .. }), "{what}: {e}");
            assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
        }
        // A valid checksum over a bad entry is still refused.
        let mut raw = good.clone();
        let at = HEADER_LEN + DIGEST_LEN;
        raw[at..at + 2].copy_from_slice(&5u16.to_le_bytes());
        raw[24..28].fill(0);
        let c = crc32c::crc32c(&raw);
        raw[24..28].copy_from_slice(&c.to_le_bytes());
        let e = Trace::decode("l", &raw).unwrap_err().to_string();
        assert!(e.contains("blob 5 of 1"), "{e}");
        // A huge claimed count fails on length, without allocating for it.
        let mut huge = good;
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Trace::decode("l", &huge).is_err());
    }

    #[test]
    fn the_fuzz_seeds_are_what_their_names_say() {
        // The committed seeds of `fuzz/corpus/access_trace` (made by hand, not by `encode`).
        let seeds = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/access_trace");
        let read = |name: &str| std::fs::read(format!("{seeds}/{name}")).unwrap();
        let t = Trace::decode("seed", &read("two_blobs")).unwrap();
        assert_eq!((t.blobs.len(), t.entries.len(), t.window_ms), (2, 3, 15000));
        assert_eq!(t.entries[2].blocks, MAX_ENTRY_BLOCKS);
        assert!(Trace::decode("seed", &read("no_entries"))
            .unwrap()
            .entries
            .is_empty());
        let e = Trace::decode("seed", &read("overflow"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("within u32"), "{e}");
        let e = Trace::decode("seed", &read("bad_check"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("checksum"), "{e}");
    }
}
