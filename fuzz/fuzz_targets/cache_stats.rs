//! Fuzz the chunk cache's stats file (`stats.json`, the cumulative counters a node keeps
//! between runs): a cache opened over any file must open, count reads on top of what the file
//! says without overflowing, write the file back, and reopen with the same counters.
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use fs_cache::chunk::{CacheConfig, CacheStats, ChunkCache};
use fs_cache::{MemoryBackend, Store};
use libfuzzer_sys::fuzz_target;

/// One scratch directory per fuzzing process (libFuzzer exits without running destructors,
/// so it stays behind, empty: each run removes its file).
fn dir() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        tempfile::Builder::new()
            .prefix("strata-fuzz-cache-stats-")
            .tempdir()
            .expect("a scratch directory")
    })
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

/// The counters a reopened cache takes from the file (the live sizes are not among them).
fn counters(s: &CacheStats) -> CacheStats {
    CacheStats {
        memory_bytes: 0,
        memory_capacity: 0,
        disk: None,
        ..s.clone()
    }
}

fuzz_target!(|data: &[u8]| {
    let path: PathBuf = dir().path().join("stats.json");
    std::fs::write(&path, data).expect("write the fuzz input");
    let config = CacheConfig {
        stats_file: Some(path.clone()),
        readahead_bytes: 0,
        ..CacheConfig::default()
    };
    runtime().block_on(async {
        let store = Store::new(Arc::new(MemoryBackend::new()));
        let blob: Vec<u8> = (0..70_000u32).map(|i| (i % 253) as u8).collect();
        let put = store
            .put_blob(blob.clone().into())
            .await
            .expect("put a blob");
        let cache = ChunkCache::open(store.clone(), config.clone())
            .await
            .expect("a cache opens whatever its stats file holds");
        let base = cache.stats();
        assert_eq!(base.hits, base.hits_memory.saturating_add(base.hits_disk));
        // A miss, then a hit: the counters move from the file's values (or stay at the top).
        for _ in 0..2 {
            let got = cache.read(&put.digest, 100, 1000).await.expect("read");
            assert_eq!(&got[..], &blob[100..1100]);
        }
        let s = cache.stats();
        assert!(s.bytes_read >= base.bytes_read && s.misses >= base.misses);
        assert!(s.hits >= base.hits);
        assert_eq!(s.read_latency_us.len(), 32);
        cache.flush().await.expect("write the stats file");
        drop(cache);
        let again = ChunkCache::open(store, config)
            .await
            .expect("a written stats file opens");
        assert_eq!(counters(&again.stats()), counters(&s));
    });
    let _ = std::fs::remove_file(&path);
});
