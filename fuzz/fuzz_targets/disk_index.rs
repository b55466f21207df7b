//! Fuzz the decoders of the level-2 cache index (RocksDB keys and values): a corrupt index must
//! be rejected entry by entry, never panic; what decodes must re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&b| usize::from(b) % (data.len().max(1)));
    let (key, value) = data.split_at(split);
    fs_cache::chunk::disk::fuzz_decode_index(key, value);
    fs_cache::chunk::disk::fuzz_decode_index(value, key);
});
