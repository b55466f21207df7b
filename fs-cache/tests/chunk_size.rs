//! Blobs stored with a chunk size other than 256 KiB ([`PutOptions::chunk_size`]), over the
//! in-memory, POSIX and S3 (moto) backends: the stored table has that chunk size and one
//! blake3 digest per piece of it; every read path (whole reads, the chunk cache) decodes and
//! verifies at that size; the table is stored before the blob object, even for a small plain
//! blob that at 256 KiB would have none; an invalid chunk size is an error before anything is
//! stored; a blob already stored keeps its chunk size.

mod common;

use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use fs_cache::backend::ByteStream;
use fs_cache::chunk::{CacheConfig, ChunkCache, Compression, CHUNK_SIZE};
use fs_cache::store::{blob_key, lease_key, sidecar_key, PutOptions, CHUNKS_SUFFIX};
use fs_cache::{
    Backend, Digest, ErrorKind, MemoryBackend, ObjectMeta, PosixBackend, PutBlob, PutMode, Result,
    RetryPolicy, Store,
};

/// Bytes that compress well (different for every seed).
fn text(seed: u64, len: usize) -> Vec<u8> {
    let words: [&[u8]; 6] = [
        b"strata ", b"tails ", b"chunk ", b"erofs ", b"blob ", b"node\n",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(words[(x % 6) as usize]);
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

/// `len` bytes alternating text and noise in runs of `run`, so that a compressed blob has
/// both zstd and plain chunks.
fn mixed(seed: u64, len: usize, run: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut i = 0u64;
    while v.len() < len {
        let n = run.min(len - v.len());
        if i % 3 == 2 {
            v.extend(noise(seed * 1000 + i, n));
        } else {
            v.extend(text(seed * 1000 + i, n));
        }
        i += 1;
    }
    v
}

/// A backend that records when each put starts and ends, in order.
#[derive(Debug)]
struct PutLog {
    inner: Arc<dyn Backend>,
    events: Mutex<Vec<(Event, String)>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    Start,
    End,
}

impl PutLog {
    fn new(inner: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            events: Mutex::new(Vec::new()),
        })
    }

    fn note(&self, e: Event, key: &str) {
        self.events.lock().unwrap().push((e, key.to_owned()));
    }

    fn position(&self, e: Event, key: &str) -> Option<usize> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .rposition(|(ev, k)| *ev == e && k == key)
    }

    /// Whether the last put of `first` ended before the last put of `then` started.
    fn ended_before(&self, first: &str, then: &str) -> bool {
        match (
            self.position(Event::End, first),
            self.position(Event::Start, then),
        ) {
            (Some(a), Some(b)) => a < b,
            _ => false,
        }
    }

    async fn logged<T>(
        &self,
        key: &str,
        f: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.note(Event::Start, key);
        let out = f.await;
        if out.is_ok() {
            self.note(Event::End, key);
        }
        out
    }
}

impl fmt::Display for PutLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.inner)
    }
}

#[deny(clippy::missing_trait_methods)]
#[async_trait]
impl Backend for PutLog {
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        self.inner.get_range(key, range).await
    }

    fn get_range_now(&self, key: &str, range: Range<u64>) -> Option<Result<Bytes>> {
        self.inner.get_range_now(key, range)
    }

    async fn put_stream(&self, key: &str, body: ByteStream, mode: PutMode) -> Result<ObjectMeta> {
        self.logged(key, self.inner.put_stream(key, body, mode))
            .await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        self.inner.head(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        self.inner.list(prefix).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key).await
    }

    async fn sweep_abandoned(
        &self,
        before: std::time::SystemTime,
        dry_run: bool,
    ) -> Result<Vec<String>> {
        self.inner.sweep_abandoned(before, dry_run).await
    }

    async fn put_stream_retrying(
        &self,
        key: &str,
        body: ByteStream,
        mode: PutMode,
        retry: &RetryPolicy,
    ) -> Result<ObjectMeta> {
        self.logged(key, self.inner.put_stream_retrying(key, body, mode, retry))
            .await
    }

    async fn list_retrying(&self, prefix: &str, retry: &RetryPolicy) -> Result<Vec<ObjectMeta>> {
        self.inner.list_retrying(prefix, retry).await
    }

    async fn get(&self, key: &str) -> Result<Bytes> {
        self.inner.get(key).await
    }

    async fn put(&self, key: &str, body: Bytes) -> Result<ObjectMeta> {
        self.logged(key, self.inner.put(key, body)).await
    }

    async fn put_opts(&self, key: &str, body: Bytes, mode: PutMode) -> Result<ObjectMeta> {
        self.logged(key, self.inner.put_opts(key, body, mode)).await
    }
}

/// A level-1-only cache that reads exactly what is asked (no readahead).
fn memory_cache_config() -> CacheConfig {
    let mut c = CacheConfig {
        memory_bytes: 64 << 20,
        disk: None,
        readahead_bytes: 0,
        disk_readahead_bytes: 0,
        ..CacheConfig::default()
    };
    c.retry.max_attempts = 2;
    c.retry.initial_backoff = std::time::Duration::from_millis(5);
    c
}

#[derive(Clone, Copy, Debug)]
enum Via {
    Bytes,
    File,
}

async fn put(store: &Store, dir: &Path, data: &[u8], via: Via, opts: &PutOptions) -> PutBlob {
    match via {
        Via::Bytes => store
            .put_blob_opts(Bytes::copy_from_slice(data), opts)
            .await
            .unwrap(),
        Via::File => {
            let p = dir.join("src");
            std::fs::write(&p, data).unwrap();
            let put = store.put_blob_file_opts(&p, opts).await.unwrap();
            // No spool file is left beside the source.
            assert_eq!(std::fs::read_dir(dir).unwrap().count(), 1);
            std::fs::remove_file(&p).unwrap();
            put
        }
    }
}

/// One blob stored at `cs` as `compression` and `via` say, then read back every way.
async fn one(
    inner: Arc<dyn Backend>,
    label: &str,
    cs: u64,
    compression: Compression,
    via: Via,
    data: &[u8],
) {
    let label = format!("{label} {cs} {compression} {via:?} {}", data.len());
    let log = PutLog::new(inner.clone());
    let store = Store::new(log.clone());
    let tmp = tempfile::tempdir().unwrap();
    let opts = PutOptions::new(compression).with_chunk_size(cs);
    let p = put(&store, tmp.path(), data, via, &opts).await;
    let d = Digest::of(data);
    assert_eq!(
        (p.digest, p.size, p.existed, p.chunk_size),
        (d, data.len() as u64, false, cs),
        "{label}"
    );
    let zstd = matches!(compression, Compression::Zstd { .. });
    assert_eq!(p.is_compressed(), zstd, "{label}: {p:?}");
    let r = p.blob_ref();
    assert_eq!(r.chunk_size, Some(cs), "{label}");
    assert_eq!(r.stored_bytes(), p.stored_size);

    // The table went first, and is there.
    let (bk, tk) = (blob_key(&d), sidecar_key(&d, CHUNKS_SUFFIX));
    assert!(log.ended_before(&tk, &bk), "{label}: {:?}", log.events);
    assert!(inner.head(&tk).await.is_ok(), "{label}");
    assert_eq!(inner.head(&bk).await.unwrap().size, p.stored_size);

    // The table: `cs` chunks, the blake3 of each `cs` piece.
    let table = store.chunk_table(&d).await.unwrap();
    assert_eq!(table.chunk_size, cs, "{label}");
    assert_eq!(1u64 << table.chunk_shift(), cs);
    let want: Vec<Digest> = data.chunks(cs as usize).map(Digest::of).collect();
    assert!(want.len() > 4, "{label}: a multi-chunk blob");
    assert!(table.digests == want, "{label}: chunk digests");
    assert_eq!(table.stored.is_some(), zstd, "{label}");
    if zstd {
        // Both kinds of chunk, so both decode paths are read below.
        let frames = (0..table.chunk_count())
            .filter(|&i| table.is_zstd(i))
            .count();
        assert!(
            frames > 0 && frames < want.len(),
            "{label}: {frames} frames"
        );
    }

    // Whole reads.
    assert!(store.get_blob(&d).await.unwrap() == data, "{label}");
    let mut out = Vec::new();
    let n = store.read_blob_to(&d, &mut out, 3 * cs + 1).await.unwrap();
    assert!(
        n == data.len() as u64 && out == data,
        "{label}: read_blob_to"
    );

    // The chunk cache: one chunk's range fetches that chunk's stored bytes, no more.
    let cache = ChunkCache::open(store.clone(), memory_cache_config())
        .await
        .unwrap();
    let got = cache.read(&d, 2 * cs + 10, 100).await.unwrap();
    assert!(got[..] == data[2 * cs as usize + 10..2 * cs as usize + 110]);
    let sr = table.stored_range(2);
    let s = cache.stats();
    assert_eq!(
        (s.backend_requests, s.bytes_fetched),
        (1, sr.end - sr.start),
        "{label}"
    );
    // Across chunk boundaries, then everything, verified chunk by chunk.
    let got = cache.read(&d, cs / 2, 3 * cs).await.unwrap();
    assert!(got[..] == data[cs as usize / 2..cs as usize / 2 + 3 * cs as usize]);
    let all = cache.read(&d, 0, data.len() as u64).await.unwrap();
    assert!(all == data, "{label}: cache read");
    let s = cache.stats();
    assert_eq!(s.verify_failures, 0, "{label}");
    assert_eq!(
        s.bytes_fetched,
        table.stored_size(),
        "{label}: each chunk once"
    );
}

/// Every combination over one backend: 64 KiB and 16 KiB, plain and zstd, in memory and
/// through a file (small: read whole; large: streamed, or spooled when compressed).
async fn every_way(backend: Arc<dyn Backend>, label: &str) {
    let mut seed = 0;
    for cs in [64u64 << 10, 16 << 10] {
        for compression in [Compression::None, Compression::default()] {
            for (via, len) in [
                (Via::Bytes, 1_000_000),
                (Via::File, 700_000),
                (Via::File, (5 << 20) + 777),
            ] {
                seed += 1;
                let data = mixed(seed, len, cs as usize * 3 / 2);
                one(backend.clone(), label, cs, compression, via, &data).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_in_memory() {
    every_way(Arc::new(MemoryBackend::new()), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_over_posix() {
    let dir = tempfile::tempdir().unwrap();
    every_way(Arc::new(PosixBackend::open(dir.path()).unwrap()), "posix").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_over_s3() {
    let Some(backend) = common::moto::s3_backend("chunk-size").await else {
        return;
    };
    every_way(backend, "s3").await;
}

/// A compressed put at 64 KiB in which nothing shrinks is stored plain, with its (version 1)
/// table first, in memory and through a large file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompressible_blob_at_64k_keeps_its_table_first() {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let log = PutLog::new(mem.clone());
    let store = Store::new(log.clone());
    let tmp = tempfile::tempdir().unwrap();
    let opts = PutOptions::new(Compression::default()).with_chunk_size(64 << 10);
    for (seed, via, len) in [(1, Via::Bytes, 300_000), (2, Via::File, (5 << 20) + 3)] {
        let data = noise(seed, len);
        let p = put(&store, tmp.path(), &data, via, &opts).await;
        assert!(!p.is_compressed() && p.chunk_size == 64 << 10, "{p:?}");
        let d = p.digest;
        assert!(log.ended_before(&sidecar_key(&d, CHUNKS_SUFFIX), &blob_key(&d)));
        let table = store.chunk_table(&d).await.unwrap();
        assert!(table.stored.is_none() && table.chunk_size == 64 << 10);
        assert!(table.digests == data.chunks(64 << 10).map(Digest::of).collect::<Vec<_>>());
        assert!(mem.get(&blob_key(&d)).await.unwrap() == data);
    }
}

/// A plain blob of one chunk (or none) has no table at 256 KiB, but has one at 64 KiB, stored
/// before it: the 256 KiB fallback of `chunk_table` never describes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_plain_blob_at_64k_has_its_table_first() {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let log = PutLog::new(mem.clone());
    let store = Store::new(log.clone());
    let tmp = tempfile::tempdir().unwrap();
    let opts = PutOptions::default().with_chunk_size(64 << 10);
    for (seed, via, len) in [
        (1, Via::Bytes, 10_000),
        (2, Via::File, 10_000),
        (3, Via::Bytes, 64 << 10),
        (4, Via::Bytes, 0),
        (5, Via::File, 1),
    ] {
        let data = text(seed, len);
        let d = Digest::of(&data);
        let p = put(&store, tmp.path(), &data, via, &opts).await;
        assert!(!p.existed && p.chunk_size == 64 << 10, "{len}: {p:?}");
        let tk = sidecar_key(&d, CHUNKS_SUFFIX);
        assert!(mem.head(&tk).await.is_ok(), "{len}: no table");
        assert!(log.ended_before(&tk, &blob_key(&d)), "{len}");
        let table = store.chunk_table(&d).await.unwrap();
        assert_eq!(table.chunk_size, 64 << 10, "{len}");
        let want: Vec<Digest> = data.chunks(64 << 10).map(Digest::of).collect();
        assert_eq!(table.digests, want, "{len}");
    }
    // The same size at 256 KiB: no table, as before (its one chunk digest is the blob's).
    let data = text(9, 10_000);
    let p = store.put_blob(Bytes::from(data)).await.unwrap();
    assert_eq!(p.chunk_size, CHUNK_SIZE);
    assert_eq!(p.blob_ref().chunk_size, None);
    assert!(mem
        .head(&sidecar_key(&p.digest, CHUNKS_SUFFIX))
        .await
        .unwrap_err()
        .is_not_found());
    assert_eq!(
        store.chunk_table(&p.digest).await.unwrap().chunk_size,
        CHUNK_SIZE
    );
}

/// A chunk size a table cannot have is an error that says so, for both puts, before anything
/// is stored (not a panic, not a blob with a bad table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_chunk_sizes_are_refused_before_anything_is_stored() {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let store = Store::new(mem.clone());
    let tmp = tempfile::tempdir().unwrap();
    let small = text(1, 100_000);
    let large = text(2, (5 << 20) + 1);
    let (ps, pl) = (tmp.path().join("small"), tmp.path().join("large"));
    std::fs::write(&ps, &small).unwrap();
    std::fs::write(&pl, &large).unwrap();
    for cs in [
        0u64,
        1,
        2048,
        3000,
        (8 << 10) + 1,
        3 << 16,
        128 << 20,
        u64::MAX,
    ] {
        for compression in [Compression::None, Compression::default()] {
            let opts = PutOptions::new(compression).with_chunk_size(cs);
            let errors = [
                store
                    .put_blob_opts(Bytes::from(small.clone()), &opts)
                    .await
                    .unwrap_err(),
                store.put_blob_file_opts(&ps, &opts).await.unwrap_err(),
                store.put_blob_file_opts(&pl, &opts).await.unwrap_err(),
            ];
            for e in errors {
                let msg = e.to_string();
                assert!(
                    msg.contains("chunk size")
                        && msg.contains("power of two")
                        && msg.contains(&cs.to_string()),
                    "{cs}: {msg}"
                );
                assert_ne!(e.kind(), ErrorKind::Corrupt, "{cs}: {e}");
            }
        }
    }
    assert!(
        mem.list("").await.unwrap().is_empty(),
        "something was stored"
    );
    // The files are untouched and no spool is left.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);
}

/// A blob already stored keeps its object, its table and its chunk size, whatever the next
/// put asks for, and the put says which chunk size is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_blob_keeps_its_chunk_size() {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let store = Store::new(mem.clone());
    let tmp = tempfile::tempdir().unwrap();
    let at = |cs: u64, c: Compression| PutOptions::new(c).with_chunk_size(cs);
    let plain = Compression::None;
    let zstd = Compression::default();
    let cases: [(&str, Vec<u8>, PutOptions, PutOptions, Via); 5] = [
        // First at 256 KiB (multi-chunk, plain), then at 64 KiB.
        (
            "256K then 64K",
            text(1, 1_000_000),
            at(CHUNK_SIZE, plain),
            at(64 << 10, plain),
            Via::Bytes,
        ),
        // A small blob stored at 256 KiB without a table, then at 64 KiB: still none.
        (
            "small 256K then 64K",
            text(2, 10_000),
            at(CHUNK_SIZE, plain),
            at(64 << 10, zstd),
            Via::Bytes,
        ),
        // First at 64 KiB, then at the default.
        (
            "64K then 256K",
            text(3, 1_000_000),
            at(64 << 10, plain),
            PutOptions::default(),
            Via::Bytes,
        ),
        // Compressed at 16 KiB, then plain at 256 KiB, through a large file.
        (
            "16K zstd then 256K",
            mixed(4, (5 << 20) + 5, 24 << 10),
            at(16 << 10, zstd),
            PutOptions::default(),
            Via::File,
        ),
        // Compressed at 256 KiB, then at 64 KiB.
        (
            "256K zstd then 64K",
            mixed(5, 2_000_000, 300 << 10),
            at(CHUNK_SIZE, zstd),
            at(64 << 10, zstd),
            Via::Bytes,
        ),
    ];
    for (label, data, first, second, via) in cases {
        let d = Digest::of(&data);
        let p1 = put(&store, tmp.path(), &data, via, &first).await;
        assert!(
            !p1.existed && p1.chunk_size == first.chunk_size,
            "{label}: {p1:?}"
        );
        let table_before = mem.get(&sidecar_key(&d, CHUNKS_SUFFIX)).await.ok();
        let object_before = mem.head(&blob_key(&d)).await.unwrap();
        mem.delete(&lease_key(&d)).await.unwrap();

        let p2 = put(&store, tmp.path(), &data, via, &second).await;
        assert!(p2.existed, "{label}: {p2:?}");
        assert_eq!(p2.chunk_size, first.chunk_size, "{label}");
        assert_eq!(p2.stored_size, p1.stored_size, "{label}");
        assert_eq!(p2.blob_ref(), p1.blob_ref(), "{label}");
        assert_eq!(
            p2.blob_ref().chunk_size,
            (first.chunk_size != CHUNK_SIZE).then_some(first.chunk_size),
            "{label}"
        );
        // Nothing was stored again; the lease was renewed.
        assert_eq!(
            mem.get(&sidecar_key(&d, CHUNKS_SUFFIX)).await.ok(),
            table_before,
            "{label}"
        );
        assert_eq!(
            mem.head(&blob_key(&d)).await.unwrap(),
            object_before,
            "{label}"
        );
        assert!(mem.head(&lease_key(&d)).await.is_ok(), "{label}");
        assert_eq!(
            store.chunk_table(&d).await.unwrap().chunk_size,
            first.chunk_size
        );
        assert!(store.get_blob(&d).await.unwrap() == data, "{label}");
    }
}
