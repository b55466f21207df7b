//! Fuzz the decoding of a stored chunk: a zstd frame (or plain bytes) from the input, opened
//! against a version-2 chunk table built around it. Decoding must be bounded by the chunk's
//! plain length (never a larger allocation, never a panic), and anything it returns must be
//! exactly the chunk's plain bytes (the table's digest is of the decoded bytes when the input
//! decodes at all, so that the fuzzer reaches the success path too).
#![no_main]

use fs_cache::chunk::codec::decode_chunk;
use fs_cache::chunk::table::{ChunkTable, StoredChunk};
use fs_cache::Digest;
use libfuzzer_sys::fuzz_target;

const CHUNK: usize = 256 << 10;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    // Two bytes pick the plain length (1..=256 KiB), the rest is the stored frame.
    let plain_len = (u16::from_le_bytes([data[0], data[1]]) as usize * 4 + 1).min(CHUNK);
    let frame = &data[2..];
    let decoded = decode_chunk(frame, plain_len);
    if let Ok(out) = &decoded {
        assert_eq!(out.len(), plain_len);
    }
    // The same frame as chunk 0 of a compressed blob whose digest is what it decodes to (or
    // an arbitrary one): `open_chunk` must agree with the decoder and the digest.
    if frame.is_empty() || frame.len() >= plain_len {
        return;
    }
    let digest = match &decoded {
        Ok(out) => Digest::of(out),
        Err(_) => Digest::of(frame),
    };
    let table = ChunkTable {
        blob: digest,
        blob_size: plain_len as u64,
        chunk_size: CHUNK as u64,
        digests: vec![digest],
        stored: Some(vec![StoredChunk {
            offset: 0,
            len: frame.len() as u32,
            zstd: true,
        }]),
    };
    // The table survives its own encoding.
    let enc = table.encode();
    assert_eq!(ChunkTable::decode(&digest, &enc).ok().as_ref(), Some(&table));
    match (table.open_chunk(0, frame), &decoded) {
        (Ok(plain), Ok(out)) => assert_eq!(&plain, out),
        (Err(_), Err(_)) => {}
        (a, b) => panic!("open_chunk {:?} but decode_chunk {:?}", a.is_ok(), b.is_ok()),
    }
});
