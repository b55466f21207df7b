//! How a blob's chunks are stored: plain, or each chunk as its own zstd frame.
//!
//! # What is compressed, and how it is read back
//! A blob is named by the blake3 digest of its **plain** bytes, whatever its stored form; the
//! chunk table (see [`super::table`]) names every chunk's plain digest and, for a compressed
//! blob, where each chunk sits in the stored object and whether it is a zstd frame. Each chunk
//! (of the table's chunk size: [`CHUNK_SIZE`](super::CHUNK_SIZE) by default, see
//! [`super::table`]) is compressed alone (one frame, content size in its header, no zstd
//! checksum: blake3 of the plain bytes is the check), so that any chunk can be fetched and
//! decoded without its neighbours. A chunk whose frame is not smaller than the
//! chunk is stored plain; a blob in which no chunk shrinks is stored exactly as a plain blob.
//!
//! # Decoding is bounded
//! [`decode_chunk`] writes into a buffer of exactly the chunk's plain length: a frame that
//! would produce more fails, one that produces less is refused, and neither allocates beyond
//! that length. Any failure is reported as a verification failure by the callers (never a
//! panic, never a byte served): the chunk cache refetches once, then reports
//! [`crate::Error::Corrupt`].

use std::cell::RefCell;
use std::fmt;
use std::str::FromStr;

use crate::error::Error;
use crate::store::Digest;

/// The zstd level `strata layer build` uses by default (see `bench/README.md`, "compress": on
/// `/usr/lib/x86_64-linux-gnu`, level 3 stored 6% less than level 1 but added about twice the
/// build time; building must not get much slower).
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

/// How a blob is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Compression {
    /// The plain bytes (every blob stored before compression existed is plain).
    None,
    /// Each chunk a zstd frame at this level (chunks that do not shrink stay plain).
    Zstd { level: i32 },
}

impl Default for Compression {
    fn default() -> Self {
        Compression::Zstd {
            level: DEFAULT_ZSTD_LEVEL,
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::None => f.write_str("none"),
            Compression::Zstd { level } if *level == DEFAULT_ZSTD_LEVEL => f.write_str("zstd"),
            Compression::Zstd { level } => write!(f, "zstd:{level}"),
        }
    }
}

impl FromStr for Compression {
    type Err = Error;
    /// `none`, `zstd` (level [`DEFAULT_ZSTD_LEVEL`]) or `zstd:LEVEL` (1..=19).
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::InvalidCompression(s.to_owned());
        match s {
            "none" => Ok(Compression::None),
            "zstd" => Ok(Compression::default()),
            _ => {
                let level = s
                    .strip_prefix("zstd:")
                    .ok_or_else(bad)?
                    .parse::<i32>()
                    .map_err(|_| bad())?;
                if !(1..=19).contains(&level) {
                    return Err(bad());
                }
                Ok(Compression::Zstd { level })
            }
        }
    }
}

/// Compresses chunks at one level, reusing its zstd context (one per thread).
pub struct ChunkCompressor {
    inner: zstd::bulk::Compressor<'static>,
}

impl fmt::Debug for ChunkCompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ChunkCompressor")
    }
}

impl ChunkCompressor {
    pub fn new(level: i32) -> std::io::Result<Self> {
        let mut inner = zstd::bulk::Compressor::new(level)?;
        inner.include_checksum(false)?;
        inner.include_contentsize(true)?;
        Ok(Self { inner })
    }

    /// The zstd frame of `plain`, if it is smaller than `plain`; `None` if it is not (the
    /// chunk is then stored plain). The frame is written into a buffer one byte shorter than
    /// the chunk, so a chunk that does not shrink costs no larger allocation.
    pub fn compress(&mut self, plain: &[u8]) -> Option<Vec<u8>> {
        if plain.len() < 2 {
            return None;
        }
        let mut out = Vec::with_capacity(plain.len() - 1);
        match self.inner.compress_to_buffer(plain, &mut out) {
            Ok(n) if n < plain.len() => {
                out.truncate(n);
                Some(out)
            }
            _ => None,
        }
    }
}

thread_local! {
    static COMPRESSOR: RefCell<Option<(i32, ChunkCompressor)>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// [`ChunkCompressor::compress`] with this thread's compressor for `level` (made once per
/// thread and level).
pub fn compress_chunk(level: i32, plain: &[u8]) -> Option<Vec<u8>> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().map(|(l, _)| *l) != Some(level) {
            *slot = Some((level, ChunkCompressor::new(level).ok()?));
        }
        slot.as_mut().and_then(|(_, c)| c.compress(plain))
    })
}

/// One encoded chunk: its plain digest and, if it shrank, its zstd frame.
pub type EncodedChunk = (Digest, Option<Vec<u8>>);

/// Encode consecutive chunks of a blob (`data` holds whole chunks of `chunk_size`, the last
/// one possibly short): hashed and compressed in parallel on all cores.
pub fn encode_chunks(level: i32, data: &[u8], chunk_size: usize) -> Vec<EncodedChunk> {
    use rayon::prelude::*;
    data.par_chunks(chunk_size.max(1))
        .map(|plain| (Digest::of(plain), compress_chunk(level, plain)))
        .collect()
}

/// The plain bytes of a zstd frame that must decode to exactly `plain_len` bytes. The output
/// buffer has that capacity and is never grown; an error says what was wrong (a damaged or
/// truncated frame, too many or too few bytes).
pub fn decode_chunk(frame: &[u8], plain_len: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(plain_len);
    let n = DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?);
        }
        let d = slot.as_mut().ok_or_else(|| "no zstd context".to_owned())?;
        d.decompress_to_buffer(frame, &mut out)
            .map_err(|e| format!("zstd: {e}"))
    })?;
    if n != plain_len || out.len() != plain_len {
        return Err(format!(
            "the frame decoded to {n} bytes, expected {plain_len}"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print() {
        assert_eq!("none".parse::<Compression>().unwrap(), Compression::None);
        assert_eq!(
            "zstd".parse::<Compression>().unwrap(),
            Compression::default()
        );
        assert_eq!(
            "zstd:7".parse::<Compression>().unwrap(),
            Compression::Zstd { level: 7 }
        );
        for bad in [
            "", "zstd:", "zstd:0", "zstd:20", "zstd:x", "gzip", "zstd:-1",
        ] {
            assert!(bad.parse::<Compression>().is_err(), "{bad}");
        }
        for c in [
            Compression::None,
            Compression::default(),
            Compression::Zstd { level: 9 },
        ] {
            assert_eq!(c.to_string().parse::<Compression>().unwrap(), c);
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let mut c = ChunkCompressor::new(3).unwrap();
        let text: Vec<u8> = (0..256 << 10).map(|i| b"strata "[i % 7]).collect();
        let frame = c.compress(&text).expect("repetitive text shrinks");
        assert!(frame.len() < text.len() / 10);
        assert_eq!(decode_chunk(&frame, text.len()).unwrap(), text);
        // Too small an output buffer, or too large a claim: refused, nothing grows.
        assert!(decode_chunk(&frame, text.len() - 1).is_err());
        assert!(decode_chunk(&frame, text.len() + 1).is_err());
        // Truncated and damaged frames.
        assert!(decode_chunk(&frame[..frame.len() - 1], text.len()).is_err());
        assert!(decode_chunk(&frame[..4], text.len()).is_err());
        assert!(decode_chunk(&[], text.len()).is_err());
        let mut bad = frame.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0xff;
        if let Ok(out) = decode_chunk(&bad, text.len()) {
            // zstd may decode a flipped literal without noticing; blake3 is the check then.
            assert_ne!(out, text);
        }
        // Random bytes do not shrink.
        let mut x = 0x1234_5678_9abc_def0u64;
        let noise: Vec<u8> = (0..256 << 10)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(c.compress(&noise).is_none());
        assert!(c.compress(b"a").is_none());
    }
}
