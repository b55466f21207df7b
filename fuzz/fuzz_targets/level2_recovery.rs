//! Fuzz level-2 recovery at open (`fs_cache::chunk::disk::fuzz_recover`): a cache directory
//! whose RocksDB index (chunk entries, crc32c values, holds, format and counters) and blob
//! files were built from the input is opened as the node's level 2. The open must succeed or
//! fail with an error, never panic; what it keeps must be within the capacity, read back as
//! its files' bytes or be dropped, take a new chunk that survives a reopen, and leave nothing
//! for a second open to recover. The script's format: the module docs of `fuzz_recover`.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

/// One scratch directory per fuzzing process, emptied by every run.
fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("strata-fuzz-l2-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("create the scratch directory");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    // Long scripts only make slower runs (every step is a file or index write).
    if data.len() > 32 << 10 {
        return;
    }
    fs_cache::chunk::disk::fuzz_recover(data, scratch());
});
