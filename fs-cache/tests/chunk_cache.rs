//! The chunk cache against a real store (in-memory backend behind the fault-injecting wrapper,
//! and level 2 on real local disk).

#[path = "common/damage.rs"]
mod damage;
use damage::flip;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fs_cache::chunk::disk::DiskCacheConfig;
use fs_cache::chunk::table::ChunkTable;
use fs_cache::chunk::{CacheConfig, ChunkCache, CHUNK_SIZE};
use fs_cache::store::{sidecar_key, CHUNKS_SUFFIX};
use fs_cache::{
    Backend, Digest, Error, FaultConfig, FaultyBackend, MemoryBackend, RetryPolicy, Store,
};

const MIB: u64 = 1 << 20;

fn data(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761) >> 13) as u8 ^ seed)
        .collect()
}

struct Fixture {
    faulty: Arc<FaultyBackend>,
    store: Store,
    blob: Digest,
    bytes: Vec<u8>,
}

async fn fixture(len: usize) -> Fixture {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let bytes = data(1, len);
    let blob = Store::new(mem.clone())
        .put_blob(Bytes::from(bytes.clone()))
        .await
        .unwrap()
        .digest;
    let faulty = Arc::new(FaultyBackend::new(mem, 7));
    let store = Store::new(faulty.clone());
    Fixture {
        faulty,
        store,
        blob,
        bytes,
    }
}

fn quick_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        deadline: Duration::from_secs(2),
        attempt_timeout: Duration::from_secs(2),
    }
}

fn memory_only(memory_bytes: u64) -> CacheConfig {
    CacheConfig {
        memory_bytes,
        readahead_bytes: 0,
        retry: quick_retry(),
        ..CacheConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_return_exactly_the_requested_bytes() {
    let f = fixture((3 * CHUNK_SIZE + 12345) as usize).await;
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    let size = f.bytes.len() as u64;
    for (off, len) in [
        (0, 1),
        (0, size),
        (CHUNK_SIZE - 3, 6),
        (size - 10, 100),
        (size, 5),
        (12345, 2 * CHUNK_SIZE),
        (3 * CHUNK_SIZE, CHUNK_SIZE),
    ] {
        let got = cache.read(&f.blob, off, len).await.unwrap();
        let end = (off + len).min(size);
        assert_eq!(
            &got[..],
            &f.bytes[off as usize..end as usize],
            "{off}+{len}"
        );
    }
    let e = cache.read(&f.blob, size + 1, 1).await.unwrap_err();
    assert!(matches!(e, Error::InvalidRange { .. }), "{e}");
    let s = cache.stats();
    assert_eq!(s.misses, 4, "each chunk fetched once: {s:?}");
    assert!(s.hits > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_readers_of_one_chunk_make_one_request() {
    let f = fixture((2 * CHUNK_SIZE) as usize).await;
    f.faulty.update(|c| c.latency = Duration::from_millis(100));
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    cache.register(&f.blob).await.unwrap();
    f.faulty.reset_stats();
    let readers = (0..64u64).map(|i| {
        let cache = cache.clone();
        let blob = f.blob;
        tokio::spawn(async move { cache.read(&blob, i * 1000, 4096).await.unwrap() })
    });
    for (i, r) in futures::future::join_all(readers)
        .await
        .into_iter()
        .enumerate()
    {
        let got = r.unwrap();
        let off = i * 1000;
        assert_eq!(&got[..], &f.bytes[off..off + 4096]);
    }
    assert_eq!(f.faulty.stats().gets, 1, "{:?}", f.faulty.stats());
    assert_eq!(cache.stats().backend_requests, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sequential_4_mib_read_is_one_request() {
    let f = fixture((8 * MIB) as usize).await;
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    cache.register(&f.blob).await.unwrap();
    f.faulty.reset_stats();
    let got = cache.read(&f.blob, 0, 4 * MIB).await.unwrap();
    assert_eq!(&got[..], &f.bytes[..(4 * MIB) as usize]);
    assert_eq!(f.faulty.stats().gets, 1);
    let s = cache.stats();
    assert_eq!((s.backend_requests, s.coalesced_chunks), (1, 16));
    assert_eq!(s.bytes_fetched, 4 * MIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sequential_small_reads_trigger_bounded_readahead() {
    let f = fixture((8 * MIB) as usize).await;
    let config = CacheConfig {
        readahead_bytes: MIB,
        ..memory_only(64 * MIB)
    };
    let cache = ChunkCache::open(f.store.clone(), config).await.unwrap();
    cache.register(&f.blob).await.unwrap();
    f.faulty.reset_stats();
    let mut off = 0;
    while off < 8 * MIB {
        let got = cache.read(&f.blob, off, 64 << 10).await.unwrap();
        assert_eq!(
            &got[..],
            &f.bytes[off as usize..(off + (64 << 10)) as usize]
        );
        off += 64 << 10;
        // The reader does a little work between reads, as readers do.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let s = cache.stats();
    // 32 chunks were read; readahead fetched most of them before they were asked for, in
    // requests of several chunks.
    assert!(s.readahead_chunks > 16, "{s:?}");
    // Readahead is issued in whole windows (1 MiB = 4 chunks), not chunk by chunk.
    assert!(s.backend_requests <= 12, "{s:?}");
    // Bounded: never more than the blob, nothing fetched twice.
    assert!(s.bytes_fetched <= 8 * MIB, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_usage_stays_bounded_reading_three_times_capacity() {
    let f = fixture((12 * MIB) as usize).await;
    let cap = 4 * MIB;
    let cache = ChunkCache::open(f.store.clone(), memory_only(cap))
        .await
        .unwrap();
    let mut off = 0;
    while off < 12 * MIB {
        let got = cache.read(&f.blob, off, 300_000).await.unwrap();
        let end = (off + 300_000).min(12 * MIB);
        assert_eq!(&got[..], &f.bytes[off as usize..end as usize]);
        assert!(cache.stats().memory_bytes <= cap, "{:?}", cache.stats());
        off += 300_000;
    }
    let s = cache.stats();
    assert!(s.evictions_memory >= 32, "{s:?}");
    assert!(s.memory_bytes <= cap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corruption_in_the_backend_is_refetched_then_reported() {
    let f = fixture((2 * CHUNK_SIZE) as usize).await;
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    cache.register(&f.blob).await.unwrap();

    // Every body damaged: the refetch fails too, and the read reports which chunk.
    f.faulty.set(FaultConfig {
        bitflip_rate: 1.0,
        ..Default::default()
    });
    let e = cache.read(&f.blob, 10, 100).await.unwrap_err();
    assert!(e.to_string().contains("corrupt chunk 0"), "{e}");
    let s = cache.stats();
    assert_eq!((s.verify_failures, s.corrupt_errors), (2, 1), "{s:?}");

    // One damaged body: the chunk is refetched alone and served correctly.
    f.faulty.set(FaultConfig {
        bitflip_next: 1,
        ..Default::default()
    });
    let before = cache.stats();
    let got = cache.read(&f.blob, CHUNK_SIZE, 10).await.unwrap();
    assert_eq!(
        &got[..],
        &f.bytes[CHUNK_SIZE as usize..CHUNK_SIZE as usize + 10]
    );
    let s = cache.stats();
    assert_eq!(s.verify_failures - before.verify_failures, 1, "{s:?}");
    assert_eq!(s.backend_requests - before.backend_requests, 2, "{s:?}");
    assert_eq!(s.corrupt_errors, before.corrupt_errors);
    // And the cache is usable afterwards, serving only verified bytes.
    let got = cache.read(&f.blob, 0, 2 * CHUNK_SIZE).await.unwrap();
    assert_eq!(&got[..], &f.bytes[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn truncated_bodies_and_errors_are_retried() {
    let f = fixture((3 * CHUNK_SIZE) as usize).await;
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    cache.register(&f.blob).await.unwrap();
    // A body cut short (the request otherwise answered): retried, never served or verified.
    let c2 = 2 * CHUNK_SIZE as usize;
    let before = f.faulty.stats();
    f.faulty.update(|c| c.truncate_next = 1);
    let got = cache.read(&f.blob, 2 * CHUNK_SIZE, 100).await.unwrap();
    assert_eq!(&got[..], &f.bytes[c2..c2 + 100]);
    let after = f.faulty.stats();
    assert_eq!(
        after.truncated - before.truncated,
        1,
        "no body was truncated"
    );
    assert_eq!(
        after.gets - before.gets,
        2,
        "the short body was not retried once"
    );
    assert_eq!(
        cache.stats().verify_failures,
        0,
        "a short body reached verification"
    );

    // Failed requests are retried too.
    f.faulty.update(|c| c.fail_next = 2);
    let got = cache.read(&f.blob, 0, 100).await.unwrap();
    assert_eq!(&got[..], &f.bytes[..100]);
    assert_eq!(f.faulty.stats().injected_errors - after.injected_errors, 2);

    // A backend that keeps failing: a clear error for this read only.
    f.faulty.update(|c| c.error_rate = 1.0);
    let e = cache.read(&f.blob, CHUNK_SIZE, 100).await.unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    // The cache survives: cached data still served, and the backend's recovery is used.
    assert_eq!(
        &cache.read(&f.blob, 0, 100).await.unwrap()[..],
        &f.bytes[..100]
    );
    f.faulty.set(FaultConfig::default());
    let got = cache.read(&f.blob, CHUNK_SIZE, 100).await.unwrap();
    assert_eq!(
        &got[..],
        &f.bytes[CHUNK_SIZE as usize..CHUNK_SIZE as usize + 100]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefetch_fills_the_cache() {
    let f = fixture((4 * MIB) as usize).await;
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    cache
        .prefetch(f.blob, vec![0..MIB, 3 * MIB..3 * MIB + 10])
        .await
        .unwrap()
        .unwrap();
    let before = cache.stats();
    assert_eq!(before.prefetch_chunks, 5);
    cache.read(&f.blob, 0, MIB).await.unwrap();
    cache.read(&f.blob, 3 * MIB, 10).await.unwrap();
    let after = cache.stats();
    assert_eq!(after.misses, 0, "{after:?}");
    assert_eq!(after.backend_requests, before.backend_requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn level_two_survives_a_restart_and_drops_damaged_chunks() {
    let f = fixture((4 * MIB) as usize).await;
    let dir = tempfile::tempdir().unwrap();
    let config = || CacheConfig {
        disk: Some(DiskCacheConfig {
            dir: dir.path().join("cache"),
            capacity: 64 * MIB,
        }),
        ..memory_only(MIB)
    };
    {
        let cache = ChunkCache::open(f.store.clone(), config()).await.unwrap();
        let got = cache.read(&f.blob, 0, 4 * MIB).await.unwrap();
        assert_eq!(&got[..], &f.bytes[..]);
        cache.flush().await.unwrap();
    }
    // After a restart, with the backend down, everything is served from local disk.
    f.faulty.update(|c| {
        c.error_rate = 1.0;
        c.permanent = true;
    });
    let cache = ChunkCache::open(f.store.clone(), config()).await.unwrap();
    // The table is fetched from the backend (level 2 holds chunks only): with the backend
    // down, registering fails with the backend's error; load it before the backend goes down.
    let e = cache.register(&f.blob).await.unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    f.faulty.set(FaultConfig::default());
    cache.register(&f.blob).await.unwrap();
    f.faulty.update(|c| {
        c.error_rate = 1.0;
        c.permanent = true;
    });
    let got = cache.read(&f.blob, 0, 4 * MIB).await.unwrap();
    assert_eq!(&got[..], &f.bytes[..]);
    let s = cache.stats();
    assert_eq!(s.hits_disk, 16, "{s:?}");
    assert_eq!(s.misses, 0);
    drop(cache);

    // Damage chunk 3 in the blob's file on disk: it is detected, dropped and refetched, never
    // served.
    let hex = f.blob.to_hex();
    let blob_file = dir.path().join("cache/blobs").join(&hex[..2]).join(&hex);
    flip(&blob_file, 3 * CHUNK_SIZE + 100, 0x40);
    f.faulty.set(FaultConfig::default());
    let cache = reopen(|| ChunkCache::open(f.store.clone(), config())).await;
    let got = cache.read(&f.blob, 0, 4 * MIB).await.unwrap();
    assert_eq!(&got[..], &f.bytes[..]);
    let s = cache.stats();
    assert_eq!(
        (s.verify_failures, s.misses, s.hits_disk),
        (1, 1, 15),
        "{s:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_demand_read_joining_a_waiting_prefetch_does_not_wait_behind_it() {
    let f = fixture((8 * CHUNK_SIZE) as usize).await;
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    cache.register(&f.blob).await.unwrap();
    f.faulty.reset_stats();
    f.faulty.update(|c| c.latency = Duration::from_millis(1500));
    let start = std::time::Instant::now();
    // A demand fetch in flight...
    let busy = {
        let cache = cache.clone();
        let blob = f.blob;
        tokio::spawn(async move { cache.read(&blob, 0, 10).await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // ...so this prefetch claims chunk 5 and waits for demand to go idle...
    let wanted = 5 * CHUNK_SIZE..5 * CHUNK_SIZE + 1;
    let prefetch = cache.prefetch(f.blob, std::iter::once(wanted).collect());
    tokio::time::sleep(Duration::from_millis(50)).await;
    // ...until a demand read of chunk 5 joins it and lifts it to demand priority.
    let got = cache.read(&f.blob, 5 * CHUNK_SIZE, 10).await.unwrap();
    assert_eq!(
        &got[..],
        &f.bytes[5 * CHUNK_SIZE as usize..5 * CHUNK_SIZE as usize + 10]
    );
    let waited = start.elapsed();
    busy.await.unwrap();
    prefetch.await.unwrap().unwrap();
    // Behind the busy fetch it would take two latencies (3 s); lifted, about one.
    assert!(waited < Duration::from_millis(2600), "waited {waited:?}");
    assert_eq!(f.faulty.stats().gets, 2, "chunk 5 was fetched once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unregister_drops_the_table_but_keeps_cached_chunks() {
    let f = fixture((2 * CHUNK_SIZE) as usize).await;
    let cache = ChunkCache::open(f.store.clone(), memory_only(64 * MIB))
        .await
        .unwrap();
    assert_eq!(cache.registered(), 0);
    let got = cache.read(&f.blob, 0, 2 * CHUNK_SIZE).await.unwrap();
    assert_eq!(&got[..], &f.bytes[..]);
    assert_eq!(cache.registered(), 1);
    let gets = f.faulty.stats().gets;
    cache.unregister(&f.blob);
    assert_eq!(cache.registered(), 0);
    // Reading again loads the table (one request for the chunk-table sidecar at most) but no
    // chunk: both are still in level 1.
    let again = cache.read(&f.blob, CHUNK_SIZE, 10).await.unwrap();
    assert_eq!(
        &again[..],
        &f.bytes[CHUNK_SIZE as usize..CHUNK_SIZE as usize + 10]
    );
    assert_eq!(cache.registered(), 1);
    let s = cache.stats();
    assert_eq!(s.misses, 2, "{s:?}");
    assert!(f.faulty.stats().gets <= gets + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fully_cached_blob_can_be_pinned_as_one_local_file() {
    use std::os::unix::fs::FileExt;
    let f = fixture((3 * CHUNK_SIZE + 777) as usize).await;
    let dir = tempfile::tempdir().unwrap();
    let config = CacheConfig {
        disk: Some(DiskCacheConfig {
            dir: dir.path().join("cache"),
            capacity: 64 * MIB,
        }),
        ..memory_only(MIB)
    };
    let cache = ChunkCache::open(f.store.clone(), config).await.unwrap();
    assert!(
        cache.pin_local(&f.blob).await.unwrap().is_none(),
        "nothing cached yet"
    );
    let size = f.bytes.len() as u64;
    cache.read(&f.blob, 0, 2 * CHUNK_SIZE).await.unwrap();
    cache.flush().await.unwrap();
    assert!(
        cache.pin_local(&f.blob).await.unwrap().is_none(),
        "two chunks missing"
    );
    cache.read(&f.blob, 2 * CHUNK_SIZE, size).await.unwrap();
    cache.flush().await.unwrap();
    let pin = cache
        .pin_local(&f.blob)
        .await
        .unwrap()
        .expect("all chunks cached");
    assert_eq!(pin.len(), size);
    assert!(pin.verify().unwrap());
    let mut whole = vec![0u8; size as usize];
    pin.file().read_exact_at(&mut whole, 0).unwrap();
    assert_eq!(whole, f.bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warming_a_blob_puts_every_chunk_in_level_2_fetching_only_what_is_missing() {
    // 40 chunks and a tail: three runs of 16 at most.
    let f = fixture((40 * CHUNK_SIZE + 999) as usize).await;
    let dir = tempfile::tempdir().unwrap();
    // A cache with 4 MiB of level 1 and a level 2 of `capacity` in `dir`.
    let open = |dir: &std::path::Path, capacity| {
        ChunkCache::open(
            f.store.clone(),
            CacheConfig {
                disk: Some(DiskCacheConfig {
                    dir: dir.join("cache"),
                    capacity,
                }),
                ..memory_only(4 * MIB)
            },
        )
    };
    let cache = open(dir.path(), 64 * MIB).await.unwrap();
    // Chunks 0-3 and 20 in level 2 (a flush waits for their writes), then, after a restart,
    // chunk 30 read just before the warm: in level 1, its level-2 write maybe still pending.
    cache.read(&f.blob, 0, 4 * CHUNK_SIZE).await.unwrap();
    cache.read(&f.blob, 20 * CHUNK_SIZE, 10).await.unwrap();
    cache.flush().await.unwrap();
    drop(cache);
    let cache = reopen(|| open(dir.path(), 64 * MIB)).await;
    cache.read(&f.blob, 30 * CHUNK_SIZE, 10).await.unwrap();
    let before = cache.stats();
    assert!(cache.warm_local(&f.blob).await.unwrap());
    let fetched = cache.stats().bytes_fetched - before.bytes_fetched;
    let size = f.bytes.len() as u64;
    assert_eq!(
        fetched,
        size - 6 * CHUNK_SIZE,
        "chunks already in level 1 or 2 are not fetched again"
    );
    // Every chunk is in level 2, whole and right: the blob can be pinned and read as a file.
    use std::os::unix::fs::FileExt;
    let pin = cache
        .pin_local(&f.blob)
        .await
        .unwrap()
        .expect("all in level 2");
    assert!(pin.verify().unwrap());
    let mut whole = vec![0u8; size as usize];
    pin.file().read_exact_at(&mut whole, 0).unwrap();
    assert!(whole == f.bytes);
    drop(pin);
    // Warm again: nothing to do.
    let before = cache.stats().bytes_fetched;
    assert!(cache.warm_local(&f.blob).await.unwrap());
    assert_eq!(cache.stats().bytes_fetched, before);
    drop(cache);

    // A level 2 smaller than the blob cannot hold it: `false`, and reads still work.
    let small = tempfile::tempdir().unwrap();
    let cache = open(small.path(), 8 * CHUNK_SIZE).await.unwrap();
    assert!(!cache.warm_local(&f.blob).await.unwrap());
    let got = cache.read(&f.blob, 0, size).await.unwrap();
    assert!(got[..] == f.bytes[..]);

    // A backend that keeps failing: an error, not a false success.
    let cold = tempfile::tempdir().unwrap();
    let cache = open(cold.path(), 64 * MIB).await.unwrap();
    cache.blob_size(&f.blob).await.unwrap();
    f.faulty.update(|c| c.error_rate = 1.0);
    assert!(cache.warm_local(&f.blob).await.is_err());
}

/// A cache of `f` in `dir` with level 2 and its 8 MiB readahead, and nothing kept in level 1
/// (every warm read comes from level 2), after every chunk of the blob was read into level 2.
async fn level_2_filled(f: &Fixture, dir: &std::path::Path) -> ChunkCache {
    let config = CacheConfig {
        disk: Some(DiskCacheConfig {
            dir: dir.join("cache"),
            capacity: 64 * MIB,
        }),
        disk_readahead_bytes: 8 * MIB,
        ..memory_only(0)
    };
    let cache = ChunkCache::open(f.store.clone(), config).await.unwrap();
    let size = f.bytes.len() as u64;
    let mut at = 0;
    while at < size {
        at += cache.read(&f.blob, at, 4 * MIB).await.unwrap().len() as u64;
        cache.flush().await.unwrap();
    }
    cache
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chunks_larger_than_level_2_takes_stay_in_level_1_and_hold_no_other_write_back() {
    let mem = Arc::new(MemoryBackend::new());
    let store = Store::new(mem.clone());
    // A blob whose table has 1 MiB chunks (a store written by another tool: the table format
    // allows 4 KiB ..= 64 MiB), and an ordinary one.
    let big = data(3, (3 * MIB + 777) as usize);
    let big_d = store
        .put_blob(Bytes::from(big.clone()))
        .await
        .unwrap()
        .digest;
    let table = ChunkTable {
        blob: big_d,
        blob_size: big.len() as u64,
        chunk_size: MIB,
        digests: big.chunks(MIB as usize).map(Digest::of).collect(),
        stored: None,
    };
    mem.put(
        &sidecar_key(&big_d, CHUNKS_SUFFIX),
        Bytes::from(table.encode()),
    )
    .await
    .unwrap();
    let small = data(4, (3 * CHUNK_SIZE) as usize);
    let small_d = store
        .put_blob(Bytes::from(small.clone()))
        .await
        .unwrap()
        .digest;
    let dir = tempfile::tempdir().unwrap();
    let config = CacheConfig {
        disk: Some(DiskCacheConfig {
            dir: dir.path().join("cache"),
            capacity: 64 * MIB,
        }),
        ..memory_only(64 * MIB)
    };
    let cache = ChunkCache::open(store, config).await.unwrap();
    assert_eq!(cache.register(&big_d).await.unwrap().chunk_size, MIB);
    // Both read in one go, so that their chunks reach the level-2 writers together.
    let (a, b) = tokio::join!(
        cache.read(&big_d, 0, big.len() as u64),
        cache.read(&small_d, 0, small.len() as u64)
    );
    assert!(a.unwrap()[..] == big[..]);
    assert!(b.unwrap()[..] == small[..]);
    cache.flush().await.unwrap();
    // The ordinary blob's three chunks are on disk; the big ones are not (and broke nothing).
    let disk = cache.stats().disk.unwrap();
    assert_eq!((disk.chunks, disk.bytes), (3, 3 * CHUNK_SIZE), "{disk:?}");
    // Both read again exactly (the big blob from level 1).
    let again = cache.read(&big_d, MIB - 5, MIB + 10).await.unwrap();
    assert!(again[..] == big[(MIB - 5) as usize..(2 * MIB + 5) as usize]);
    assert!(cache.read(&small_d, 0, 4096).await.unwrap()[..] == small[..4096]);
}

/// Chunks read ahead from level 2 so far, once the count stops moving (staged reads finish in
/// the background).
async fn staged_chunks(cache: &ChunkCache) -> u64 {
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = cache.stats().disk_readahead_chunks;
        if now == last {
            return now;
        }
        last = now;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn level_2_readahead_skips_short_streams_and_readers_that_skip_forward() {
    let chunks = 120;
    let f = fixture((chunks * CHUNK_SIZE) as usize).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = level_2_filled(&f, dir.path()).await;
    let size = f.bytes.len() as u64;
    let staged = || staged_chunks(&cache);
    let check = |at: u64, got: &[u8]| assert!(got == &f.bytes[at as usize..][..got.len()]);

    // A 300 KiB file read in two requests is a stream, but a short one: nothing read ahead.
    let before = staged().await;
    let base = 3 * CHUNK_SIZE + 4096;
    for (at, len) in [(base, 200 << 10), (base + (200 << 10), 100 << 10)] {
        check(at, &cache.read(&f.blob, at, len).await.unwrap());
    }
    assert_eq!(staged().await, before, "{:?}", cache.stats());

    // A 2 MiB file read sequentially starts a stream that reads ahead (twice what it read);
    // then a reader that takes 32 KiB of every 512 KiB (every 10th small file) stays inside
    // the window but is not dense: the window does not follow it through the blob.
    let before = staged().await;
    let base = 10 * CHUNK_SIZE;
    for at in [base, base + MIB] {
        check(at, &cache.read(&f.blob, at, MIB).await.unwrap());
    }
    let mut at = base + 2 * MIB + (512 << 10);
    while at + (32 << 10) <= size {
        check(at, &cache.read(&f.blob, at, 32 << 10).await.unwrap());
        at += 512 << 10;
    }
    let ahead = staged().await - before;
    assert!(
        ahead > 0,
        "the 2 MiB stream reads ahead: {:?}",
        cache.stats()
    );
    // At most the 4 MiB window of the stream (16 chunks), far from the 100 chunks after it.
    assert!(
        ahead <= 16,
        "{ahead} chunks read ahead: {:?}",
        cache.stats()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_file_bounds_a_reader_of_one_file_reads_ahead_from_its_first_read_to_its_end() {
    let f = fixture((120 * CHUNK_SIZE) as usize).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = level_2_filled(&f, dir.path()).await;
    let staged = || staged_chunks(&cache);
    let check = |at: u64, got: &[u8]| assert!(got == &f.bytes[at as usize..][..got.len()]);
    // Reads a "file" of 3 MiB + 5000 bytes at chunk `first` (13 chunks) 256 KiB at a time;
    // the chunks read ahead during its first read, and in all.
    let read_file = |first: u64| {
        let cache = &cache;
        async move {
            let (start, end) = (first * CHUNK_SIZE, first * CHUNK_SIZE + 3 * MIB + 5000);
            let before = staged().await;
            check(start, &cache.read(&f.blob, start, 64 << 10).await.unwrap());
            let after_first = staged().await - before;
            let mut at = start + (64 << 10);
            while at < end {
                let len = (256 << 10).min(end - at);
                check(at, &cache.read(&f.blob, at, len).await.unwrap());
                at += len;
            }
            (after_first, staged().await - before)
        }
    };
    let file_end = 10 * CHUNK_SIZE + 3 * MIB + 5000;
    cache.add_file_bounds(
        f.blob,
        "layer",
        &[10 * CHUNK_SIZE, file_end, 60 * CHUNK_SIZE],
    );
    assert_eq!(cache.file_bounds(), (1, 3));

    // Random reads inside a bounded file (not at its start), even two adjacent ones, start
    // no readahead before the usual 1 MiB.
    let before = staged().await;
    let at = 40 * CHUNK_SIZE + 8192;
    for at in [at, at + (64 << 10)] {
        check(at, &cache.read(&f.blob, at, 64 << 10).await.unwrap());
    }
    assert_eq!(staged().await, before, "{:?}", cache.stats());

    // Bounded: read ahead from the first 64 KiB (at the file's start) on, and never past the
    // file's last chunk (chunks 11..=22: at most 12).
    let (first, all) = read_file(10).await;
    assert!(
        first > 0,
        "no readahead on the first read: {:?}",
        cache.stats()
    );
    assert!(all <= 12, "{all} chunks read ahead for a 13-chunk file");
    // A reader that goes on into the next file (layout order) has crossed the end: its
    // stream reads ahead as without bounds.
    let before = staged().await;
    let mut at = file_end;
    while at < file_end + 2 * MIB {
        check(at, &cache.read(&f.blob, at, 256 << 10).await.unwrap());
        at += 256 << 10;
    }
    assert!(staged().await > before, "a stream across files reads ahead");

    // Unbounded (past every known end): nothing on the first read, and past the file's end.
    let (first, all) = read_file(70).await;
    assert_eq!(first, 0, "{:?}", cache.stats());
    assert!(all > 12, "without bounds only {all} chunks were read ahead");

    // Forgotten: as without bounds again.
    cache.forget_file_bounds(&f.blob, "layer");
    assert_eq!(cache.file_bounds(), (0, 0));
    let (first, _) = read_file(30).await;
    assert_eq!(first, 0, "{:?}", cache.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sequential_readers_of_level_2_are_served_ahead_and_never_get_damaged_bytes() {
    let f = fixture((40 * CHUNK_SIZE + 4321) as usize).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(level_2_filled(&f, dir.path()).await);
    let size = f.bytes.len() as u64;
    let fetched = cache.stats().bytes_fetched;
    assert_eq!(fetched, size);

    // One reader, 1 MiB at a time.
    let read_all = |cache: Arc<ChunkCache>, blob: Digest| async move {
        let mut out = Vec::new();
        while (out.len() as u64) < size {
            let b = cache.read(&blob, out.len() as u64, MIB).await.unwrap();
            out.extend_from_slice(&b);
        }
        out
    };
    assert!(read_all(cache.clone(), f.blob).await == f.bytes);
    let s = cache.stats();
    assert!(s.disk_readahead_hits >= 30, "{s:?}");
    assert!(s.disk_readahead_hits <= s.disk_readahead_chunks, "{s:?}");
    assert_eq!(s.bytes_fetched, fetched, "warm reads fetch nothing");

    // Once a stream has started (two adjacent reads), four readers of each next 4 MiB in any
    // order (as FUSE threads serve the kernel's readahead) continue it: still read ahead.
    let hits = s.disk_readahead_hits;
    let mut out = vec![0u8; size as usize];
    for at in [0, MIB] {
        let b = cache.read(&f.blob, at, MIB).await.unwrap();
        out[at as usize..][..b.len()].copy_from_slice(&b);
    }
    let mut base = 2 * MIB;
    while base < size {
        let mut tasks = Vec::new();
        for k in (0..4u64).rev() {
            let (c, blob) = (cache.clone(), f.blob);
            let at = (base + k * MIB).min(size);
            tasks.push(tokio::spawn(async move {
                (at, c.read(&blob, at, MIB).await.unwrap())
            }));
        }
        for t in tasks {
            let (at, b) = t.await.unwrap();
            out[at as usize..][..b.len()].copy_from_slice(&b);
        }
        base += 4 * MIB;
    }
    assert!(out == f.bytes);
    let s = cache.stats();
    assert!(s.disk_readahead_hits >= hits + 20, "{s:?}");

    // Damage chunk 30 on disk: a reader ahead of the stream finds it damaged, drops it, and the
    // read that needs it gets the right bytes from the backend (one chunk refetched).
    let disk = s.disk.unwrap();
    let hex = f.blob.to_hex();
    let path = dir.path().join("cache/blobs").join(&hex[..2]).join(&hex);
    flip(&path, 30 * CHUNK_SIZE + 999, 0x10);
    assert!(read_all(cache.clone(), f.blob).await == f.bytes);
    let s = cache.stats();
    assert_eq!(s.bytes_fetched, fetched + CHUNK_SIZE, "{s:?}");
    assert_eq!(
        s.disk.as_ref().unwrap().dropped_corrupt,
        disk.dropped_corrupt + 1,
        "{s:?}"
    );
}

/// A backend whose every ranged body has one byte of each chunk flipped, and which counts
/// the reads in flight at once.
#[derive(Debug)]
struct EveryChunkBad {
    inner: Arc<MemoryBackend>,
    in_flight: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Display for EveryChunkBad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("every-chunk-bad")
    }
}

#[async_trait::async_trait]
impl Backend for EveryChunkBad {
    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> fs_cache::Result<Bytes> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(now, SeqCst);
        // Long enough for concurrent refetches to overlap.
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.in_flight.fetch_sub(1, SeqCst);
        let body = self.inner.get_range(key, range.clone()).await?;
        if !key.starts_with("blobs/") || key.ends_with(".chunks") {
            return Ok(body);
        }
        let mut v = body.to_vec();
        for at in (0..v.len()).step_by(CHUNK_SIZE as usize) {
            v[at] ^= 0x01;
        }
        Ok(Bytes::from(v))
    }
    async fn put_stream(
        &self,
        key: &str,
        body: fs_cache::backend::ByteStream,
        mode: fs_cache::PutMode,
    ) -> fs_cache::Result<fs_cache::ObjectMeta> {
        self.inner.put_stream(key, body, mode).await
    }
    async fn head(&self, key: &str) -> fs_cache::Result<fs_cache::ObjectMeta> {
        self.inner.head(key).await
    }
    async fn list(&self, prefix: &str) -> fs_cache::Result<Vec<fs_cache::ObjectMeta>> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> fs_cache::Result<()> {
        self.inner.delete(key).await
    }

    async fn sweep_abandoned(
        &self,
        before: std::time::SystemTime,
        dry_run: bool,
    ) -> fs_cache::Result<Vec<String>> {
        self.inner.sweep_abandoned(before, dry_run).await
    }
}

/// A read whose chunks are all corrupt fails after two rounds of requests, not one refetch
/// after another: the refetches of one request's bad chunks run at once (the campaign's
/// documented bound, `ublk-daemon/docs/daemon.md` "Failed reads", is 2 × the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refetches_of_corrupt_chunks_run_at_once() {
    let mem = Arc::new(MemoryBackend::new());
    let bytes = data(3, (8 * CHUNK_SIZE) as usize);
    let blob = Store::new(mem.clone())
        .put_blob(Bytes::from(bytes))
        .await
        .unwrap()
        .digest;
    let bad = Arc::new(EveryChunkBad {
        inner: mem,
        in_flight: Default::default(),
        most: Default::default(),
    });
    let cache = ChunkCache::open(Store::new(bad.clone()), memory_only(64 * MIB))
        .await
        .unwrap();
    cache.register(&blob).await.unwrap();
    bad.most.store(0, std::sync::atomic::Ordering::SeqCst);
    let e = cache.read(&blob, 0, 8 * CHUNK_SIZE).await.unwrap_err();
    assert_eq!(e.kind(), fs_cache::ErrorKind::Corrupt, "{e}");
    let s = cache.stats();
    // One request for the eight chunks, then eight refetches, all in flight together.
    assert_eq!(s.backend_requests, 9, "{s:?}");
    assert_eq!(s.verify_failures, 16, "{s:?}");
    assert_eq!(s.corrupt_errors, 8, "{s:?}");
    assert_eq!(s.backend_errors_by_kind["corrupt"], 8, "{s:?}");
    assert_eq!(bad.most.load(std::sync::atomic::Ordering::SeqCst), 8);
}

/// Open a cache in a directory a just-dropped cache used. Its background tasks (the tail of a
/// fetch, a level-2 write) can hold the last handle on the level-2 index for a moment after
/// the drop, and the index refuses a second opener meanwhile: retried for up to 10 s.
async fn reopen<F, Fut>(open: F) -> ChunkCache
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = fs_cache::Result<ChunkCache>>,
{
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match open().await {
            Ok(c) => return c,
            Err(e)
                if std::time::Instant::now() < until
                    && e.to_string().contains("cannot open the index") =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("reopen the cache: {e}"),
        }
    }
}

/// Store `bytes` as a blob whose chunk table has `chunk_size` chunks (the table written as
/// its sidecar, replacing any); its digest.
async fn put_with_chunks(mem: &Arc<MemoryBackend>, bytes: &[u8], chunk_size: u64) -> Digest {
    let blob = Store::new(mem.clone())
        .put_blob(Bytes::copy_from_slice(bytes))
        .await
        .unwrap()
        .digest;
    set_table(mem, blob, bytes, chunk_size).await;
    blob
}

/// Replace the chunk table of `blob` (whose bytes are `bytes`) with one of `chunk_size` chunks.
async fn set_table(mem: &Arc<MemoryBackend>, blob: Digest, bytes: &[u8], chunk_size: u64) {
    let table = ChunkTable {
        blob,
        blob_size: bytes.len() as u64,
        chunk_size,
        digests: bytes.chunks(chunk_size as usize).map(Digest::of).collect(),
        stored: None,
    };
    mem.put(
        &sidecar_key(&blob, CHUNKS_SUFFIX),
        Bytes::from(table.encode()),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_blob_read_under_two_chunk_tables_never_gets_the_other_tables_chunks() {
    let mem = Arc::new(MemoryBackend::new());
    let bytes = data(5, (3 * CHUNK_SIZE + 777) as usize);
    let blob = put_with_chunks(&mem, &bytes, CHUNK_SIZE).await;
    // Level 1 only in memory (level 2 then serves nothing: every hit below is level 1), and
    // level 2 only (nothing kept in memory: every hit is level 2).
    for memory in [64 * MIB, 0] {
        let dir = tempfile::tempdir().unwrap();
        let config = CacheConfig {
            disk: Some(DiskCacheConfig {
                dir: dir.path().join("cache"),
                capacity: 64 * MIB,
            }),
            ..memory_only(memory)
        };
        let cache = ChunkCache::open(Store::new(mem.clone()), config)
            .await
            .unwrap();
        let size = bytes.len() as u64;
        // The chunks level 2 holds after each table's reads: those of the table read last,
        // but for the third read of a cache with memory, which level 1 serves whole.
        let back = if memory > 0 { 13 } else { 4 };
        for (chunk_size, chunks) in [(CHUNK_SIZE, 4), (64 << 10, 13), (CHUNK_SIZE, back)] {
            set_table(&mem, blob, &bytes, chunk_size).await;
            cache.unregister(&blob);
            assert_eq!(cache.register(&blob).await.unwrap().chunk_size, chunk_size);
            // Chunk 1 of either chunking is cached by now (but for the first table's first
            // read): a read of it must be its own bytes. (A flush after each read: level-2
            // writes of the new chunking that race the removal of the old one are skipped.)
            for (at, len) in [(70_000, 1000), (CHUNK_SIZE + 5, 100_000), (0, size)] {
                let got = cache.read(&blob, at, len).await.unwrap();
                assert!(
                    got[..] == bytes[at as usize..][..got.len()],
                    "{memory} bytes of memory, {chunk_size}-byte chunks, {at}+{len}"
                );
                cache.flush().await.unwrap();
            }
            let s = cache.stats();
            let disk = s.disk.unwrap();
            assert_eq!(
                (disk.chunks, disk.bytes),
                (chunks, 3 * CHUNK_SIZE + 4096),
                "{memory} bytes of memory, {chunk_size}-byte chunks: {s:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blob_of_64_kib_chunks_reads_exactly_fills_level_2_and_is_pinned_and_warmed() {
    use std::os::unix::fs::FileExt;
    let mem = Arc::new(MemoryBackend::new());
    let chunk = 64 << 10;
    let bytes = data(6, (40 * chunk + 999) as usize);
    let size = bytes.len() as u64;
    let blob = put_with_chunks(&mem, &bytes, chunk).await;
    let dir = tempfile::tempdir().unwrap();
    let open = |dir: &std::path::Path, memory, disk_readahead_bytes| {
        ChunkCache::open(
            Store::new(mem.clone()),
            CacheConfig {
                disk: Some(DiskCacheConfig {
                    dir: dir.join("cache"),
                    capacity: 64 * MIB,
                }),
                disk_readahead_bytes,
                ..memory_only(memory)
            },
        )
    };
    let cache = open(dir.path(), MIB, 0).await.unwrap();
    assert_eq!(cache.register(&blob).await.unwrap().chunk_size, chunk);
    for (at, len) in [
        (0, 1),
        (chunk - 3, 6),
        (5 * chunk, 3 * chunk + 17),
        (size - 10, 100),
    ] {
        let got = cache.read(&blob, at, len).await.unwrap();
        assert!(got[..] == bytes[at as usize..][..got.len()], "{at}+{len}");
    }
    cache.flush().await.unwrap();
    // Chunks 0, 1, 5-8 and the last (999 bytes) in level 2.
    let disk = cache.stats().disk.unwrap();
    assert_eq!((disk.chunks, disk.bytes), (7, 6 * chunk + 4096), "{disk:?}");
    assert!(
        cache.pin_local(&blob).await.unwrap().is_none(),
        "chunks missing"
    );
    let got = cache.read(&blob, 0, size).await.unwrap();
    assert!(got[..] == bytes[..]);
    cache.flush().await.unwrap();
    assert_eq!(cache.stats().disk.unwrap().chunks, 41);
    // Wholly cached: the level-2 file is the blob, byte for byte.
    let pin = cache
        .pin_local(&blob)
        .await
        .unwrap()
        .expect("all in level 2");
    assert_eq!((pin.len(), pin.shift()), (size, 16));
    assert_eq!(pin.file().metadata().unwrap().len(), size);
    assert!(pin.verify().unwrap());
    let mut whole = vec![0u8; size as usize];
    pin.file().read_exact_at(&mut whole, 0).unwrap();
    assert!(whole == bytes);
    drop(pin);
    drop(cache);

    // Reopened with nothing in memory: sequential reads are served from level 2, read ahead
    // in runs of 64 KiB chunks.
    let cache = reopen(|| open(dir.path(), 0, 8 * MIB)).await;
    let mut out = Vec::new();
    while (out.len() as u64) < size {
        let b = cache
            .read(&blob, out.len() as u64, 128 << 10)
            .await
            .unwrap();
        out.extend_from_slice(&b);
    }
    assert!(out == bytes);
    let s = cache.stats();
    assert_eq!(s.bytes_fetched, 0, "{s:?}");
    assert!(s.disk_readahead_hits > 0, "{s:?}");
    drop(cache);

    // Warmed from cold (two chunks already in level 1), then pinned and held.
    let cold = tempfile::tempdir().unwrap();
    let cache = open(cold.path(), MIB, 0).await.unwrap();
    cache.read(&blob, 3 * chunk, 2 * chunk).await.unwrap();
    let before = cache.stats().bytes_fetched;
    assert!(cache.warm_local(&blob).await.unwrap());
    assert_eq!(cache.stats().bytes_fetched - before, size - 2 * chunk);
    let token = cold.path().join("token");
    std::fs::write(&token, b"").unwrap();
    let pin = cache
        .pin_local_held(&blob, token)
        .await
        .unwrap()
        .expect("warmed");
    let mut whole = vec![0u8; size as usize];
    pin.file().read_exact_at(&mut whole, 0).unwrap();
    assert!(whole == bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fetch_unit_widens_a_miss_in_a_blob_of_small_chunks_to_its_aligned_window() {
    let mem = Arc::new(MemoryBackend::new());
    let chunk = 64 << 10;
    // 10 whole 64 KiB chunks and a last one of 999 bytes.
    let bytes = data(9, (10 * chunk + 999) as usize);
    let blob = put_with_chunks(&mem, &bytes, chunk).await;
    let open = |unit: u64| {
        let faulty = Arc::new(FaultyBackend::new(mem.clone(), 3));
        let config = CacheConfig {
            fetch_unit_bytes: unit,
            ..memory_only(64 * MIB)
        };
        let store = Store::new(faulty.clone());
        async move { (ChunkCache::open(store, config).await.unwrap(), faulty) }
    };
    let read = |cache: &ChunkCache, at: u64, len: u64| {
        let (cache, want) = (
            cache.clone(),
            bytes[at as usize..(at + len) as usize].to_vec(),
        );
        async move {
            let got = cache.read(&blob, at, len).await.unwrap();
            assert!(got[..] == want[..], "{at}+{len}");
        }
    };

    // Without a unit, a miss fetches its own chunk only.
    let (cache, faulty) = open(0).await;
    cache.register(&blob).await.unwrap();
    faulty.reset_stats();
    read(&cache, 5 * chunk + 7, 100).await;
    read(&cache, 6 * chunk, 100).await;
    assert_eq!(faulty.stats().gets, 2);
    assert_eq!(cache.stats().bytes_fetched, 2 * chunk);

    // A 256 KiB unit: a miss in chunk 5 fetches chunks 4..8 in one request; the other three
    // are then hits.
    let (cache, faulty) = open(256 << 10).await;
    cache.register(&blob).await.unwrap();
    faulty.reset_stats();
    read(&cache, 5 * chunk + 7, 100).await;
    assert_eq!(
        (faulty.stats().gets, cache.stats().bytes_fetched),
        (1, 4 * chunk)
    );
    for c in [4, 6, 7] {
        read(&cache, c * chunk + 1, chunk - 1).await;
    }
    assert_eq!(faulty.stats().gets, 1, "{:?}", cache.stats());
    // The last window stops at the blob's end: chunks 8, 9 and the 999-byte one.
    read(&cache, 9 * chunk, 10).await;
    assert_eq!(faulty.stats().gets, 2);
    assert_eq!(cache.stats().bytes_fetched, 6 * chunk + 999);
    read(&cache, 10 * chunk, 999).await;
    assert_eq!(faulty.stats().gets, 2);

    // What a cache level holds already is not fetched again: chunk 2 prefetched on its own,
    // a miss in chunk 1 fetches 0, 1 and 3 (two runs of adjacent chunks).
    let (cache, faulty) = open(256 << 10).await;
    cache
        .prefetch(blob, std::iter::once(2 * chunk..2 * chunk + 1).collect())
        .await
        .unwrap()
        .unwrap();
    faulty.reset_stats();
    read(&cache, chunk + 5, 10).await;
    // The reader waits for its own chunk only; chunk 3's request may still be running.
    for c in 0..4 {
        read(&cache, c * chunk, chunk).await;
    }
    let s = faulty.stats();
    assert_eq!(
        (s.gets, s.bytes_read),
        (2, 3 * chunk),
        "{:?}",
        cache.stats()
    );
    // One demand miss; the two others of its window were fetched along (readahead).
    let st = cache.stats();
    assert_eq!((st.misses, st.readahead_chunks), (1, 2), "{st:?}");

    // A unit no larger than the blob's chunks widens nothing (a 256 KiB blob, 256 KiB unit).
    let f = fixture((2 * CHUNK_SIZE) as usize).await;
    let cache = ChunkCache::open(
        f.store.clone(),
        CacheConfig {
            fetch_unit_bytes: CHUNK_SIZE,
            ..memory_only(64 * MIB)
        },
    )
    .await
    .unwrap();
    cache.read(&f.blob, 10, 10).await.unwrap();
    assert_eq!(cache.stats().bytes_fetched, CHUNK_SIZE);
}

/// A memory-only cache with fetch unit `unit` and no readahead over `mem` behind a
/// `FaultyBackend` (no faults; it counts requests), `blob` registered and the counts reset.
async fn counted_cache(
    mem: &Arc<MemoryBackend>,
    blob: Digest,
    unit: u64,
    seed: u64,
) -> (ChunkCache, Arc<FaultyBackend>) {
    let faulty = Arc::new(FaultyBackend::new(mem.clone(), seed));
    let config = CacheConfig {
        fetch_unit_bytes: unit,
        readahead_bytes: 0,
        ..memory_only(64 * MIB)
    };
    let cache = ChunkCache::open(Store::new(faulty.clone()), config)
        .await
        .expect("open the cache");
    cache.register(&blob).await.expect("register the blob");
    faulty.reset_stats();
    (cache, faulty)
}

/// A replayed trace in a blob of chunks smaller than the fetch unit fetches its own chunks
/// and fills only the smallest gaps between them (half again as many chunks at most), not whole
/// windows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_fills_small_gaps_instead_of_widening_to_the_fetch_unit() {
    use fs_cache::trace::{Trace, TraceEntry};
    let mem = Arc::new(MemoryBackend::new());
    let chunk: u64 = 16 << 10;
    let bytes = data(12, (64 * chunk) as usize);
    let blob = put_with_chunks(&mem, &bytes, chunk).await;
    let (cache, faulty) = counted_cache(&mem, blob, 256 << 10, 7).await;
    let traced = [0u64, 1, 3, 10, 20, 21, 40, 60];
    let trace = Trace {
        blobs: vec![blob],
        entries: (traced.iter())
            .map(|&c| TraceEntry {
                blob: 0,
                block: (c * chunk / 4096) as u32,
                blocks: 1,
            })
            .collect(),
        window_ms: 1000,
    };
    let r = cache.replay(trace).await.unwrap().unwrap();
    // A budget of 8 / 2 = 4 chunks: the gap of one (chunk 2) is filled, the next smallest
    // (six chunks) is not. Requests: 0..=3, 10, 20..=21, 40, 60.
    assert_eq!((r.chunks, r.fetched), (8, 9), "{r:?}");
    let f = faulty.stats();
    assert_eq!(
        (f.gets, f.bytes_read),
        (5, 9 * chunk),
        "{:?}",
        cache.stats()
    );
    for c in traced {
        let got = cache.read(&blob, c * chunk, chunk).await.unwrap();
        assert!(got[..] == bytes[(c * chunk) as usize..((c + 1) * chunk) as usize]);
    }
    assert_eq!(cache.stats().misses, 0);
}

/// A reader of one small chunk per window leaves its riders unread: the blob stops widening
/// once enough were offered; a reader of whole windows then reads the riders of its (narrow)
/// misses, and widening comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fetch_unit_widens_only_while_its_riders_are_read() {
    let mem = Arc::new(MemoryBackend::new());
    let chunk: u64 = 16 << 10;
    let per = 16; // a 256 KiB unit
    let windows = 40;
    let bytes = data(11, (windows * per * chunk) as usize);
    let blob = put_with_chunks(&mem, &bytes, chunk).await;
    let (cache, faulty) = counted_cache(&mem, blob, per * chunk, 5).await;
    let read = |c: u64| {
        let (cache, want) = (
            cache.clone(),
            bytes[(c * chunk) as usize..((c + 1) * chunk) as usize].to_vec(),
        );
        async move {
            let got = cache.read(&blob, c * chunk, chunk).await.unwrap();
            assert!(got[..] == want[..], "chunk {c}");
        }
    };

    // One chunk in each of 8 windows: the first three widen (fewer than 32 riders offered
    // before them), then none does; each read is one request.
    for w in 0..8 {
        read(w * per + 3).await;
    }
    let s = cache.stats();
    assert_eq!(
        (s.fetch_unit_widened, s.fetch_unit_narrowed),
        (3, 5),
        "{s:?}"
    );
    assert_eq!(faulty.stats().gets, 8);
    assert_eq!(s.bytes_fetched, (3 * per + 5) * chunk, "{s:?}");
    let y = cache.fetch_unit_yield(&blob);
    assert_eq!((y.offered, y.used), (8 * (per - 1), 0));

    // Whole windows from window 8 on: misses stay narrow (a request per chunk) until half the
    // riders offered were read, then a window costs one request.
    let mut w = 8;
    loop {
        assert!(
            w < windows,
            "never widened again: {:?}",
            cache.fetch_unit_yield(&blob)
        );
        let gets = faulty.stats().gets;
        for c in w * per..(w + 1) * per {
            read(c).await;
        }
        let took = faulty.stats().gets - gets;
        w += 1;
        if took == 1 {
            break;
        }
        assert_eq!(took, per, "window {}", w - 1);
    }
    // Widened again after 8 whole windows read narrow (2 × 15·w ≥ 120 + 15·w).
    assert_eq!(w, 17);
    let s = cache.stats();
    assert_eq!(s.fetch_unit_widened, 4, "{s:?}");
    // The riders of that widened window were all read: hits, no more requests.
    let y = cache.fetch_unit_yield(&blob);
    assert!(y.used * 2 >= y.offered, "{y:?}");
}
