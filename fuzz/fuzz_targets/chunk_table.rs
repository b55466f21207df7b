//! Fuzz the chunk-table parser: arbitrary bytes must give a table or an error, never a panic
//! or an allocation larger than the input justifies; what parses must re-encode identically,
//! and its stored ranges (version 2: compressed chunks) must be contiguous and bounded.
#![no_main]

use fs_cache::chunk::table::ChunkTable;
use fs_cache::Digest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The blob a table names sits at bytes 48..80 of its header; use it as the expected blob
    // so the fuzzer can reach the checks past that one.
    let blob = data
        .get(48..80)
        .map(|b| {
            let mut d = [0u8; 32];
            d.copy_from_slice(b);
            Digest(d)
        })
        .unwrap_or(Digest([0; 32]));
    check(&blob, data);
    // Reseal the trailer so that mutations reach the checks behind the checksum.
    if data.len() >= 32 {
        let mut sealed = data.to_vec();
        let n = sealed.len() - 32;
        let sum = *blake3::hash(&sealed[..n]).as_bytes();
        sealed[n..].copy_from_slice(&sum);
        check(&blob, &sealed);
    }
});

fn check(blob: &Digest, data: &[u8]) {
    if let Ok(table) = ChunkTable::decode(blob, data) {
        assert_eq!(table.encode(), data);
        let mut at = 0;
        for i in 0..table.chunk_count() {
            let r = table.chunk_range(i);
            assert!(r.start < r.end && r.end <= table.blob_size);
            // Stored ranges are contiguous, within the stored object, and a zstd frame is
            // shorter than its chunk (so decoding one is bounded by the chunk size).
            let s = table.stored_range(i);
            assert_eq!(s.start, at);
            assert!(s.end > s.start && s.end <= table.stored_size());
            if table.is_zstd(i) {
                assert!(s.end - s.start < r.end - r.start);
            } else {
                assert_eq!(s.end - s.start, r.end - r.start);
            }
            at = s.end;
        }
        assert_eq!(at, table.stored_size());
        assert!(table.stored_size() <= table.blob_size);
    }
}
