//! Compressed blobs (zstd per chunk) in the store, over the in-memory, POSIX and S3 (moto)
//! backends: every read path returns the plain bytes, verified; adjacent chunks still
//! coalesce into one request; level 2 holds plain chunks (a pinned blob file is the plain
//! blob); damage in the stored object (flipped bytes, a truncated frame) is never served;
//! chunks that do not shrink are stored plain; a table and an object that do not belong
//! together are detected and repaired by the next put.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use fs_cache::chunk::disk::DiskCacheConfig;
use fs_cache::chunk::{CacheConfig, ChunkCache, Compression, CHUNK_SIZE};
use fs_cache::store::{blob_key, sidecar_key, CHUNKS_SUFFIX};
use fs_cache::{Backend, Digest, Error, ErrorKind, MemoryBackend, PosixBackend, Store};

const CHUNK: usize = CHUNK_SIZE as usize;

/// Text-like bytes that compress well (different for every seed).
fn text(seed: u64, len: usize) -> Vec<u8> {
    let words: [&[u8]; 8] = [
        b"strata ",
        b"chunk ",
        b"layer ",
        b"erofs ",
        b"sandbox ",
        b"zstd ",
        b"blob ",
        b"node\n",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(words[(x % 8) as usize]);
    }
    out.truncate(len);
    out
}

/// Bytes that do not compress.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// 6 chunks + a tail: text, text, noise, text, noise, text, text tail.
fn mixed() -> Vec<u8> {
    let mut v = Vec::new();
    for (i, compressible) in [true, true, false, true, false, true]
        .into_iter()
        .enumerate()
    {
        if compressible {
            v.extend(text(i as u64, CHUNK));
        } else {
            v.extend(noise(i as u64, CHUNK));
        }
    }
    v.extend(text(99, 12_345));
    v
}

fn cache_config(dir: &std::path::Path) -> CacheConfig {
    let mut c = CacheConfig {
        memory_bytes: 64 << 20,
        disk: Some(DiskCacheConfig {
            dir: dir.join("chunks"),
            capacity: 1 << 30,
        }),
        readahead_bytes: 0,
        disk_readahead_bytes: 0,
        ..CacheConfig::default()
    };
    c.retry.max_attempts = 2;
    c.retry.deadline = std::time::Duration::from_secs(5);
    c.retry.initial_backoff = std::time::Duration::from_millis(5);
    c
}

/// Every read path over one backend.
async fn every_path(backend: Arc<dyn Backend>, label: &str) {
    let store = Store::new(backend.clone());
    let tmp = tempfile::tempdir().unwrap();
    let data = mixed();
    // Through a file larger than the small-file limit (the spooled path) and in memory.
    let mut big = data.clone();
    for i in 0..20u64 {
        big.extend(text(100 + i, CHUNK));
    }
    let file = tmp.path().join("big");
    std::fs::write(&file, &big).unwrap();
    let put_big = store
        .put_blob_file_with(&file, Compression::default())
        .await
        .unwrap();
    assert!(
        !put_big.existed && put_big.is_compressed(),
        "{label}: {put_big:?}"
    );
    assert_eq!(put_big.digest, Digest::of(&big));
    assert_eq!(put_big.size, big.len() as u64);
    assert_eq!(
        backend.head(&blob_key(&put_big.digest)).await.unwrap().size,
        put_big.stored_size
    );
    // No spool file is left beside the source.
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "{label}: {left:?}");
    let put = store
        .put_blob_with(Bytes::from(data.clone()), Compression::default())
        .await
        .unwrap();
    assert!(put.is_compressed() && put.stored_size < put.size / 2 + 3 * CHUNK as u64);
    let blob = put.digest;

    // The table: text chunks are frames, noise chunks stay plain.
    let table = store.chunk_table(&blob).await.unwrap();
    let zstd: Vec<bool> = (0..table.chunk_count()).map(|i| table.is_zstd(i)).collect();
    assert_eq!(
        zstd,
        [true, true, false, true, false, true, true],
        "{label}"
    );
    assert_eq!(table.stored_size(), put.stored_size);

    // Whole reads.
    assert_eq!(store.get_blob(&blob).await.unwrap(), data, "{label}");
    let mut out = Vec::new();
    assert_eq!(
        store
            .read_blob_to(&blob, &mut out, 3 * CHUNK_SIZE)
            .await
            .unwrap(),
        data.len() as u64
    );
    assert!(out == data, "{label}: read_blob_to");
    let mut out = Vec::new();
    store
        .read_blob_to(&put_big.digest, &mut out, 1 << 20)
        .await
        .unwrap();
    assert!(out == big, "{label}: read_blob_to of the spooled blob");

    // Ranged reads through the cache: three adjacent chunks are one request, and bytes
    // fetched are the stored bytes.
    let cache = ChunkCache::open(store.clone(), cache_config(tmp.path()))
        .await
        .unwrap();
    let got = cache
        .read(&blob, CHUNK_SIZE / 2, 3 * CHUNK_SIZE)
        .await
        .unwrap();
    assert!(got[..] == data[CHUNK / 2..CHUNK / 2 + 3 * CHUNK], "{label}");
    let s = cache.stats();
    assert_eq!((s.backend_requests, s.coalesced_chunks), (1, 4), "{label}");
    let stored_span = table.stored_range(0).start..table.stored_range(3).end;
    assert_eq!(s.bytes_fetched, stored_span.end - stored_span.start);
    assert!(s.bytes_fetched < 4 * CHUNK_SIZE);
    // The rest, then everything again from the cache.
    let all = cache.read(&blob, 0, data.len() as u64).await.unwrap();
    assert!(all == data, "{label}");
    // Level 2 holds plain chunks: warmed, the pinned blob file is the plain blob.
    assert!(cache.warm_local(&blob).await.unwrap(), "{label}");
    let pin = cache
        .pin_local(&blob)
        .await
        .unwrap()
        .expect("wholly cached");
    assert!(pin.verify().unwrap(), "{label}");
    let mut file = vec![0u8; data.len()];
    std::os::unix::fs::FileExt::read_exact_at(pin.file(), &mut file, 0).unwrap();
    assert_eq!(pin.len(), data.len() as u64);
    assert!(file == data, "{label}: pinned file");
    drop(pin);
    // Putting it again uploads nothing and reports what is stored.
    let again = store
        .put_blob_with(Bytes::from(data.clone()), Compression::None)
        .await
        .unwrap();
    assert!(
        again.existed && again.stored_size == put.stored_size,
        "{again:?}"
    );

    // gc removes an unreferenced compressed blob with its table.
    let report = fs_cache::gc::collect(
        &store,
        fs_cache::gc::GcOptions {
            grace: std::time::Duration::ZERO,
            dry_run: false,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(report.removed.len(), 2, "{label}: {report:?}");
    for d in [&blob, &put_big.digest] {
        for key in [blob_key(d), sidecar_key(d, CHUNKS_SUFFIX)] {
            assert!(
                backend.head(&key).await.unwrap_err().is_not_found(),
                "{key}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_in_memory() {
    every_path(Arc::new(MemoryBackend::new()), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_over_posix() {
    let dir = tempfile::tempdir().unwrap();
    every_path(Arc::new(PosixBackend::open(dir.path()).unwrap()), "posix").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_over_s3() {
    let Some(backend) = common::moto::s3_backend("zstd").await else {
        return;
    };
    every_path(backend, "s3").await;
}

/// How a test reads through the cache.
#[derive(Clone, Copy, Debug)]
enum Reader {
    /// An async task ([`ChunkCache::read`]).
    Task,
    /// A thread that may block, as a FUSE worker ([`ChunkCache::read_blocking`]): over a
    /// POSIX store it reads, decodes and checks its chunks on its own thread.
    Thread,
}

async fn read_as(
    cache: &ChunkCache,
    how: Reader,
    blob: Digest,
    offset: u64,
    len: u64,
) -> fs_cache::Result<Bytes> {
    match how {
        Reader::Task => cache.read(&blob, offset, len).await,
        Reader::Thread => {
            let (cache, rt) = (cache.clone(), tokio::runtime::Handle::current());
            tokio::task::spawn_blocking(move || {
                cache
                    .read_blocking(&rt, &blob, offset, len)
                    .map(|parts| Bytes::from(parts.concat()))
            })
            .await
            .unwrap()
        }
    }
}

/// Damage in the stored object over one backend: a flipped byte in one frame, and the object
/// cut short inside the last frame. Neither chunk is ever served; every other chunk is.
async fn damage(backend: Arc<dyn Backend>, label: &str) {
    for how in [Reader::Task, Reader::Thread] {
        damage_as(backend.clone(), &format!("{label}, {how:?}"), how).await;
    }
}

async fn damage_as(backend: Arc<dyn Backend>, label: &str, how: Reader) {
    let store = Store::new(backend.clone());
    let tmp = tempfile::tempdir().unwrap();
    let data = mixed();
    let blob = store
        .put_blob_with(Bytes::from(data.clone()), Compression::default())
        .await
        .unwrap()
        .digest;
    let table = store.chunk_table(&blob).await.unwrap();
    let key = blob_key(&blob);
    let mut object = backend.get(&key).await.unwrap().to_vec();
    let r1 = table.stored_range(1);
    object[(r1.start + (r1.end - r1.start) / 2) as usize] ^= 0x5a;
    let last = table.chunk_count() - 1;
    let rl = table.stored_range(last);
    object.truncate((rl.start + (rl.end - rl.start) / 2) as usize);
    backend.put(&key, Bytes::from(object)).await.unwrap();

    let cache = ChunkCache::open(store.clone(), cache_config(tmp.path()))
        .await
        .unwrap();
    for i in 0..table.chunk_count() {
        let r = table.chunk_range(i);
        let got = read_as(&cache, how, blob, r.start, r.end - r.start).await;
        if i == 1 || i == last {
            let e = got.expect_err("a damaged chunk was served");
            let kind = e.kind();
            assert!(
                matches!(
                    kind,
                    ErrorKind::Corrupt | ErrorKind::Backend | ErrorKind::InvalidInput
                ),
                "{label}: chunk {i}: {e}"
            );
            if i == 1 {
                assert!(
                    matches!(e, Error::Shared(ref s) if matches!(**s, Error::Corrupt { chunk: 1, .. })),
                    "{label}: {e:?}"
                );
            }
        } else {
            let got = got.unwrap_or_else(|e| panic!("{label}: chunk {i}: {e}"));
            assert!(
                got[..] == data[r.start as usize..r.end as usize],
                "{label}: chunk {i}"
            );
        }
    }
    let s = cache.stats();
    // The flipped chunk: failed, refetched, failed again.
    assert!(
        s.verify_failures >= 2 && s.corrupt_errors >= 1,
        "{label}: {s:?}"
    );
    // Nothing damaged reached either level: a second read fails again.
    assert!(read_as(&cache, how, blob, CHUNK_SIZE, 10).await.is_err());
    // Whole reads refuse the blob.
    assert!(store.get_blob(&blob).await.is_err(), "{label}");
    let mut sink = Vec::new();
    assert!(store.read_blob_to(&blob, &mut sink, 1 << 20).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_in_memory() {
    damage(Arc::new(MemoryBackend::new()), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_over_posix() {
    let dir = tempfile::tempdir().unwrap();
    damage(Arc::new(PosixBackend::open(dir.path()).unwrap()), "posix").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_over_s3() {
    let Some(backend) = common::moto::s3_backend("zstd-damage").await else {
        return;
    };
    damage(backend, "s3").await;
}

#[tokio::test]
async fn incompressible_blobs_are_stored_plain() {
    let mem = Arc::new(MemoryBackend::new());
    let store = Store::new(mem.clone());
    let dir = tempfile::tempdir().unwrap();
    for (name, data) in [
        ("small", noise(1, 3 * CHUNK + 7)),
        ("large", noise(2, 40 * CHUNK)),
        ("one byte", vec![7u8]),
    ] {
        let p = dir.path().join("f");
        std::fs::write(&p, &data).unwrap();
        let put = store
            .put_blob_file_with(&p, Compression::default())
            .await
            .unwrap();
        assert!(
            !put.is_compressed() && put.stored_size == put.size,
            "{name}"
        );
        // Byte for byte the plain blob, with a version-1 table (or none for one chunk).
        assert!(
            mem.get(&blob_key(&put.digest)).await.unwrap() == data,
            "{name}"
        );
        let table = store.chunk_table(&put.digest).await.unwrap();
        assert!(table.stored.is_none(), "{name}");
        assert_eq!(put.blob_ref().compression, None);
    }
}

#[tokio::test]
async fn a_table_and_object_that_do_not_belong_together_are_detected_and_repaired() {
    let mem = Arc::new(MemoryBackend::new());
    let store = Store::new(mem.clone());
    let data = mixed();
    let d = Digest::of(&data);
    let tmp = tempfile::tempdir().unwrap();

    // A stale compressed table over a plain object (a plain put won a race): read as plain.
    let first = store
        .put_blob_with(Bytes::from(data.clone()), Compression::default())
        .await
        .unwrap();
    mem.put(&blob_key(&d), Bytes::from(data.clone()))
        .await
        .unwrap();
    let table = store.chunk_table(&d).await.unwrap();
    assert!(table.stored.is_none());
    let cache = ChunkCache::open(store.clone(), cache_config(tmp.path()))
        .await
        .unwrap();
    assert!(cache.read(&d, 0, data.len() as u64).await.unwrap() == data);

    // A compressed object under a plain (version-1) table: never a wrong byte; the next put
    // sees the pair does not hold together and stores the blob again.
    let compressed_object = {
        let other = Store::new(Arc::new(MemoryBackend::new()));
        let p = other
            .put_blob_with(Bytes::from(data.clone()), Compression::default())
            .await
            .unwrap();
        assert_eq!(p.stored_size, first.stored_size);
        other.backend().get(&blob_key(&d)).await.unwrap()
    };
    mem.put(&blob_key(&d), compressed_object).await.unwrap();
    mem.put(
        &sidecar_key(&d, CHUNKS_SUFFIX),
        Bytes::from(fs_cache::chunk::table::ChunkTable::for_bytes(d, &data).encode()),
    )
    .await
    .unwrap();
    let fresh = ChunkCache::open(store.clone(), CacheConfig::default())
        .await
        .unwrap();
    assert!(fresh.read(&d, 0, data.len() as u64).await.is_err());
    assert!(store.get_blob(&d).await.is_err());
    let put = store
        .put_blob_with(Bytes::from(data.clone()), Compression::default())
        .await
        .unwrap();
    assert!(!put.existed, "the broken pair was taken as stored");
    assert_eq!(store.get_blob(&d).await.unwrap(), data);
    let fresh = ChunkCache::open(store.clone(), CacheConfig::default())
        .await
        .unwrap();
    assert!(fresh.read(&d, 0, data.len() as u64).await.unwrap() == data);
}
