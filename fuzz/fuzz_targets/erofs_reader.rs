//! Fuzz the EROFS image reader: parse and walk everything; nothing may panic, loop forever
//! or allocate without bound, whatever the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    erofs_builder::reader::fuzz_read_all(data);
});
