//! Fuzz the access-trace parser (`fs_cache::trace::Trace::decode`): a trace comes from the
//! shared store, written by any node. No input may panic or allocate without bound, and a
//! trace that parses re-encodes to exactly its bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fs_cache::trace::fuzz_decode(data);
});
