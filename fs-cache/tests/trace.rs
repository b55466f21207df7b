//! Access traces: recorded from a cache's demand reads, stored, replayed as prefetch by
//! another (cold) cache, which then serves the same reads without a demand fetch.

use std::sync::Arc;

use bytes::Bytes;
use fs_cache::chunk::{CacheConfig, ChunkCache, CHUNK_SIZE};
use fs_cache::trace::{trace_key, Trace, TraceEntry};
use fs_cache::{Backend, Digest, MemoryBackend, Store};

const MIB: u64 = 1 << 20;

fn data(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761) >> 13) as u8 ^ seed)
        .collect()
}

fn config() -> CacheConfig {
    CacheConfig {
        memory_bytes: 64 * MIB,
        // No readahead: what a cold cache fetches is what the trace or a miss asked for.
        readahead_bytes: 0,
        ..CacheConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_recorded_trace_replays_so_the_same_reads_need_no_demand_fetch() {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let store = Store::new(mem.clone());
    let a = data(1, (8 * MIB) as usize);
    let b = data(2, (3 * MIB) as usize);
    let da = store.put_blob(Bytes::from(a.clone())).await.unwrap().digest;
    let db = store.put_blob(Bytes::from(b.clone())).await.unwrap().digest;
    let other = store
        .put_blob(Bytes::from(data(3, 100_000)))
        .await
        .unwrap()
        .digest;

    // The first node's readers: scattered small reads of two blobs, and one of a blob the
    // recording does not watch.
    let reads: Vec<(Digest, u64, u64)> = vec![
        (da, 5 * MIB + 100, 3000),
        (db, 2 * MIB, 9000),
        (da, 100, 4096),
        (other, 0, 10),
        (da, 7 * MIB + 4096, 300_000),
        (db, 0, 1),
    ];
    let first = ChunkCache::open(store.clone(), config()).await.unwrap();
    let rec = first.record(vec![da, db]);
    for &(d, off, len) in &reads {
        first.read(&d, off, len).await.unwrap();
    }
    let trace = first.finish_recording(rec);
    // Reads after the recording closed are not in it.
    first.read(&da, 3 * MIB, 10).await.unwrap();
    assert_eq!(trace.blobs, vec![da, db]);
    assert_eq!(trace.entries.len(), 5, "{trace:?}");
    assert_eq!(
        trace.entries[0],
        TraceEntry {
            blob: 0,
            block: ((5 * MIB) / 4096) as u32,
            blocks: 1
        }
    );

    // Stored as the meta image's sidecar and read back exactly.
    let meta = Digest::of(b"a meta image");
    mem.put(&trace_key(&meta), Bytes::from(trace.encode()))
        .await
        .unwrap();
    let stored = Trace::decode("t", &mem.get(&trace_key(&meta)).await.unwrap()).unwrap();
    assert_eq!(stored, trace);

    // A cold cache replays it, then serves the same reads from memory.
    let second = ChunkCache::open(store.clone(), config()).await.unwrap();
    let replay = second.replay(stored).await.unwrap().unwrap();
    // da: chunks 20, 0, 28, 29; db: 8, 0.
    assert_eq!(replay.chunks, 6, "{replay:?}");
    assert_eq!(replay.fetched, 6);
    assert_eq!(replay.skipped, 0);
    let s = second.stats();
    assert_eq!(s.trace_chunks, 6);
    for &(d, off, len) in reads.iter().filter(|r| r.0 != other) {
        let got = second.read(&d, off, len).await.unwrap();
        let src = if d == da { &a } else { &b };
        assert_eq!(&got[..], &src[off as usize..(off + len) as usize]);
    }
    let s = second.stats();
    assert_eq!(s.misses, 0, "{s:?}");
    // Replayed again, nothing is fetched.
    let again = second.replay(trace.clone()).await.unwrap().unwrap();
    assert_eq!(again.fetched, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_trace_is_clipped_and_a_damaged_chunk_it_fetches_is_never_served() {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let store = Store::new(mem.clone());
    let a = data(4, (2 * MIB) as usize);
    let put = store.put_blob(Bytes::from(a.clone())).await.unwrap();
    let missing = Digest::of(b"no such blob");
    let trace = Trace {
        blobs: vec![put.digest, missing],
        entries: vec![
            // Past the blob's end.
            TraceEntry {
                blob: 0,
                block: 10_000,
                blocks: 4,
            },
            // Of a blob the store does not have.
            TraceEntry {
                blob: 1,
                block: 0,
                blocks: 1,
            },
            // The last chunk, reaching past the end: clipped.
            TraceEntry {
                blob: 0,
                block: ((2 * MIB - CHUNK_SIZE) / 4096) as u32,
                blocks: 200,
            },
        ],
        window_ms: 1,
    };
    let cache = ChunkCache::open(store.clone(), config()).await.unwrap();
    let r = cache.replay(trace.clone()).await.unwrap().unwrap();
    assert_eq!((r.chunks, r.fetched, r.skipped), (1, 1, 2), "{r:?}");

    // Damage chunk 0 in the backend: the replay fails on it, and a read of it never returns
    // the damaged bytes.
    let key = fs_cache::store::blob_key(&put.digest);
    let mut bad = mem.get(&key).await.unwrap().to_vec();
    bad[1000] ^= 0xff;
    mem.put(&key, Bytes::from(bad)).await.unwrap();
    let cold = ChunkCache::open(store.clone(), config()).await.unwrap();
    let t = Trace {
        blobs: vec![put.digest],
        entries: vec![TraceEntry {
            blob: 0,
            block: 0,
            blocks: 1,
        }],
        window_ms: 1,
    };
    let e = cold.replay(t).await.unwrap().unwrap_err();
    assert_eq!(e.kind(), fs_cache::ErrorKind::Corrupt, "{e}");
    let e = cold.read(&put.digest, 0, 4096).await.unwrap_err();
    assert_eq!(e.kind(), fs_cache::ErrorKind::Corrupt, "{e}");
    // The undamaged chunk still reads exactly.
    let got = cold.read(&put.digest, CHUNK_SIZE, 10).await.unwrap();
    assert_eq!(&got[..], &a[CHUNK_SIZE as usize..CHUNK_SIZE as usize + 10]);
}
