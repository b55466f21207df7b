//! Hit throughput of the chunk cache, against reading the same bytes from a plain local file in
//! the same run.
//!
//! One group per read size (`cache_hit_{4KiB,128KiB,1MiB}`), each with four benchmarks that
//! read the same random ranges (4 KiB-aligned offsets, so larger reads may straddle a 256 KiB
//! chunk boundary, as page-aligned reads do) of the same 64 MiB blob, one read at a time:
//!
//! - `plain_file`: `FileExt::read_exact_at` (one `pread`) of the blob's own file in the
//!   `PosixBackend` store, into one reused buffer: what the page cache can deliver.
//! - `l1`: `ChunkCache::read` from a cache whose memory level holds the whole blob (warmed).
//! - `l2`: `ChunkCache::read` from a cache with a memory capacity of **0** (level 1 keeps
//!   nothing: `memory_put` refuses any chunk larger than the capacity) and a disk level that
//!   holds the whole blob (warmed), so every chunk comes from level 2.
//! - `plain_file_uncached`: the same `pread`s of the blob's file with level 2's page-cache
//!   policy: no kernel readahead (`fadvise(RANDOM)`) and the pages dropped after each read
//!   (`fadvise(DONTNEED)`), so every read goes to the disk, as every level-2 hit does.
//!
//! Level 2 keeps no pages of its own in the page cache (the reader above it keeps the bytes:
//! level 1, or the kernel's page cache over a FUSE file), so a level-2 hit reads the disk; its
//! peer is `plain_file_uncached`. `plain_file` (page cache warm: the file was just written and
//! read through once) is what memory delivers, the peer of `l1`. At the end a table of
//! throughputs and ratios is printed from criterion's estimates of this run.
//!
//! Run one level with `cargo bench -p bench --bench chunk_cache -- l2`. Figures and their
//! interpretation: `bench/README.md`.

use std::cell::OnceCell;
use std::fs::File;
use std::hint::black_box;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bench::{bench_tempdir, fill_pseudo_random, fs_type, random_offsets, size_label};
use bytes::Bytes;
use criterion::{Criterion, Throughput};
use fs_cache::chunk::disk::DiskCacheConfig;
use fs_cache::chunk::{CacheConfig, CacheStats, ChunkCache, CHUNK_SIZE};
use fs_cache::store::blob_key;
use fs_cache::{Digest, PosixBackend, Store};
use tokio::runtime::Runtime;

/// Size of the test blob.
const BLOB_SIZE: u64 = 64 << 20;
const SIZES: [u64; 3] = [4 << 10, 128 << 10, 1 << 20];
/// Read offsets are multiples of this (a page), not of the read size.
const ALIGN: u64 = 4 << 10;
/// Random offsets per size; reads cycle through them.
const OFFSETS: usize = 4096;
/// Level-1 capacity of the `l1` cache and level-2 capacity of the `l2` cache: twice the blob.
const CAPACITY: u64 = 2 * BLOB_SIZE;
/// The `l2` goal: at least this fraction of the plain file's throughput.
const L2_GOAL: f64 = 0.8;
const VARIANTS: [&str; 4] = ["plain_file", "l1", "l2", "plain_file_uncached"];

/// The blob, stored in a `PosixBackend` on the local disk, and its file opened with `std::fs`.
struct Blob {
    store: Store,
    digest: Digest,
    data: Bytes,
    file: File,
    /// A copy of the blob's file, read by `plain_file_uncached` (whose dropped pages must not
    /// make `plain_file` read the disk).
    copy: PathBuf,
    dir: tempfile::TempDir,
}

impl Blob {
    fn new(rt: &Runtime) -> Blob {
        let dir = bench_tempdir(
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            "strata-bench.",
            "a temporary directory for the test blob",
        );
        let backend = PosixBackend::open(dir.path().join("store")).expect("open PosixBackend");
        let root = backend.root().to_owned();
        let store = Store::new(Arc::new(backend));
        let started = Instant::now();
        let mut data = vec![0u8; BLOB_SIZE as usize];
        fill_pseudo_random(&mut data, 0x4348_554E_4B53);
        let data = Bytes::from(data);
        let put = rt
            .block_on(store.put_blob(data.clone()))
            .expect("Store::put_blob");
        let path: PathBuf = root.join(blob_key(&put.digest));
        let file = File::open(&path).expect("open the blob file with std::fs");
        // Warm the page cache for the plain-file reads (and for the cache's warm-up, which
        // reads the blob through the backend), checking the bytes on the way.
        let mut buf = vec![0u8; 4 << 20];
        for off in (0..BLOB_SIZE).step_by(buf.len()) {
            file.read_exact_at(&mut buf, off).expect("warm-up read");
            assert_eq!(buf[..], data[off as usize..off as usize + buf.len()]);
        }
        eprintln!(
            "chunk_cache: {} MiB blob at {} ({} filesystem), stored and read once in {:.1?}; page cache warm",
            BLOB_SIZE >> 20,
            path.display(),
            fs_type(&path).unwrap_or_else(|| "unknown".into()),
            started.elapsed(),
        );
        let copy = dir.path().join("uncached-copy");
        std::fs::copy(&path, &copy).expect("copy the blob file");
        // Clean pages only: `fadvise(DONTNEED)` leaves dirty ones in the page cache.
        File::open(&copy)
            .and_then(|f| f.sync_all())
            .expect("sync the copy");
        Blob {
            store,
            digest: put.digest,
            data,
            file,
            copy,
            dir,
        }
    }

    /// A cache over the blob's store, warmed by `passes` full reads in 1 MiB steps; checks
    /// the bytes of the last pass and that it was served without the backend.
    fn warm_cache(&self, rt: &Runtime, name: &str, config: CacheConfig, passes: u32) -> ChunkCache {
        let started = Instant::now();
        let cache = rt
            .block_on(ChunkCache::open(self.store.clone(), config))
            .expect("ChunkCache::open");
        let step = 1 << 20;
        for pass in 0..passes {
            let before = cache.stats();
            for off in (0..BLOB_SIZE).step_by(step) {
                let got = rt
                    .block_on(cache.read(&self.digest, off, step as u64))
                    .expect("warm-up read through the cache");
                if pass + 1 == passes {
                    assert_eq!(got, self.data.slice(off as usize..off as usize + step));
                }
            }
            // Readahead of the sequential pass may still be in flight; let it land.
            rt.block_on(settle(&cache));
            if pass + 1 == passes && passes > 1 {
                let d = delta(&before, &cache.stats());
                assert_eq!(d.misses, 0, "{name}: the last warm-up pass missed: {d:?}");
            }
        }
        eprintln!(
            "chunk_cache: {name} cache warmed in {:.1?}: {}",
            started.elapsed(),
            describe(&cache.stats())
        );
        cache
    }
}

/// Wait until the cache's backend counters stop moving (background readahead has finished).
async fn settle(cache: &ChunkCache) {
    let mut last = cache.stats().backend_requests;
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = cache.stats().backend_requests;
        if now == last {
            break;
        }
        last = now;
    }
    // Level 2 is written in the background after a fetch: wait for those writes too, or the
    // next pass misses the chunks still on their way to disk (seen in the smoke run of a debug
    // build on a loaded machine).
    cache.flush().await.expect("flush the chunk cache");
}

/// `after - before` for the counters this bench checks.
fn delta(before: &CacheStats, after: &CacheStats) -> CacheStats {
    CacheStats {
        hits_memory: after.hits_memory - before.hits_memory,
        hits_disk: after.hits_disk - before.hits_disk,
        misses: after.misses - before.misses,
        bytes_read: after.bytes_read - before.bytes_read,
        backend_requests: after.backend_requests - before.backend_requests,
        ..CacheStats::default()
    }
}

fn describe(s: &CacheStats) -> String {
    format!(
        "hits: {} memory, {} disk; misses {}; backend requests {}; level 1 holds {} MiB (capacity {} MiB); level 2 holds {} MiB",
        s.hits_memory,
        s.hits_disk,
        s.misses,
        s.backend_requests,
        s.memory_bytes >> 20,
        s.memory_capacity >> 20,
        s.disk.map_or(0, |d| d.bytes >> 20),
    )
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("build the tokio runtime")
}

/// One `ChunkCache::read` at a time, cycling through `offsets`.
fn cache_reads(
    b: &mut criterion::Bencher<'_>,
    rt: &Runtime,
    cache: &ChunkCache,
    digest: Digest,
    offsets: &[u64],
    size: u64,
) {
    let mut i = 0;
    b.to_async(rt).iter(|| {
        let off = offsets[i % offsets.len()];
        i += 1;
        async move {
            let bytes = cache.read(&digest, off, size).await.expect("cache read");
            assert_eq!(bytes.len() as u64, size);
            bytes
        }
    });
}

fn chunk_cache(c: &mut Criterion) {
    let rt = runtime();
    // Fixtures are made on first use, so that a filter builds only what it needs.
    let blob_cell: OnceCell<Blob> = OnceCell::new();
    let l1_cell: OnceCell<ChunkCache> = OnceCell::new();
    let l2_cell: OnceCell<ChunkCache> = OnceCell::new();
    let blob = || blob_cell.get_or_init(|| Blob::new(&rt));
    let l1 = || {
        l1_cell.get_or_init(|| {
            let config = CacheConfig {
                memory_bytes: CAPACITY,
                ..CacheConfig::default()
            };
            blob().warm_cache(&rt, "l1", config, 2)
        })
    };
    let l2 = || {
        l2_cell.get_or_init(|| {
            let b = blob();
            let config = CacheConfig {
                memory_bytes: 0,
                disk: Some(DiskCacheConfig {
                    dir: b.dir.path().join("l2"),
                    capacity: CAPACITY,
                }),
                ..CacheConfig::default()
            };
            // Pass 1 fills level 2 from the backend; pass 2 reads it back (level-2 hits).
            // Level 2 drops the pages of every hit, so the benchmark reads the disk.
            let cache = b.warm_cache(&rt, "l2", config, 2);
            let s = cache.stats();
            assert_eq!(s.hits_memory, 0, "level 1 must keep nothing: {s:?}");
            assert_eq!(s.memory_bytes, 0, "level 1 must keep nothing: {s:?}");
            cache
        })
    };

    for size in SIZES {
        let offsets = offsets_for(size);
        let mut group = c.benchmark_group(format!("cache_hit_{}", size_label(size)));
        group.throughput(Throughput::Bytes(size));
        group.bench_function("plain_file", |b| {
            let blob = blob();
            let mut buf = vec![0u8; size as usize];
            let mut i = 0;
            b.iter(|| {
                let off = offsets[i % offsets.len()];
                i += 1;
                blob.file
                    .read_exact_at(&mut buf, off)
                    .expect("read_exact_at");
                black_box(&buf);
            });
        });
        group.bench_function("plain_file_uncached", |b| {
            let blob = blob();
            let file = File::open(&blob.copy).expect("open the copy of the blob file");
            let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random);
            // Drop the whole file first: pages written by the copy may sit in large folios,
            // which a 4 KiB `DONTNEED` cannot drop; reads without readahead then bring in small
            // ones, as level 2's reads do.
            let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed);
            let mut buf = vec![0u8; size as usize];
            let mut i = 0;
            b.iter(|| {
                let off = offsets[i % offsets.len()];
                i += 1;
                file.read_exact_at(&mut buf, off).expect("read_exact_at");
                let _ = rustix::fs::fadvise(
                    &file,
                    off,
                    std::num::NonZeroU64::new(size),
                    rustix::fs::Advice::DontNeed,
                );
                black_box(&buf);
            });
        });
        group.bench_function("l1", |b| {
            let cache = l1();
            let before = cache.stats();
            cache_reads(b, &rt, cache, blob().digest, &offsets, size);
            check_hits("l1", size, &before, &cache.stats(), true);
        });
        group.bench_function("l2", |b| {
            let cache = l2();
            let before = cache.stats();
            cache_reads(b, &rt, cache, blob().digest, &offsets, size);
            check_hits("l2", size, &before, &cache.stats(), false);
        });
        group.finish();
    }
}

/// The offsets the benchmarks of `size` read at.
fn offsets_for(size: u64) -> Vec<u64> {
    random_offsets(BLOB_SIZE, size, ALIGN, OFFSETS, size)
}

/// Chunks a read of `size` at `offset` touches.
fn chunks_touched(offset: u64, size: u64) -> u64 {
    (offset + size - 1) / CHUNK_SIZE - offset / CHUNK_SIZE + 1
}

/// `0.13`, `0.042`, `0.0031`: two significant digits for small ratios.
fn ratio_text(r: f64) -> String {
    match r {
        r if r >= 0.1 => format!("{r:.2}"),
        r if r >= 0.01 => format!("{r:.3}"),
        r => format!("{r:.4}"),
    }
}

/// Every chunk lookup of a benchmark was a hit at the level it measures.
fn check_hits(name: &str, size: u64, before: &CacheStats, after: &CacheStats, memory: bool) {
    let d = delta(before, after);
    let (right, wrong) = if memory {
        (d.hits_memory, d.hits_disk)
    } else {
        (d.hits_disk, d.hits_memory)
    };
    assert!(
        d.misses == 0 && wrong == 0 && d.backend_requests == 0 && right > 0,
        "{name}/{}: not all hits at the measured level: {d:?}",
        size_label(size)
    );
}

/// Criterion's median time per iteration (and its 95 % interval) for one benchmark of this
/// run, in nanoseconds, from its `estimates.json`; `None` if it did not run this time.
fn estimate(dir: &Path, group: &str, id: &str, since: SystemTime) -> Option<(f64, f64, f64)> {
    let path = dir.join(group).join(id).join("new").join("estimates.json");
    let modified = std::fs::metadata(&path).ok()?.modified().ok()?;
    if modified < since {
        return None;
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
    let m = &json["median"];
    Some((
        m["point_estimate"].as_f64()?,
        m["confidence_interval"]["lower_bound"].as_f64()?,
        m["confidence_interval"]["upper_bound"].as_f64()?,
    ))
}

/// Where criterion keeps its results (as criterion 0.5 decides it).
fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .map_or_else(|| PathBuf::from("target"), Path::to_owned)
        .join("criterion")
}

/// Print the throughputs of this run and their ratios to `plain_file`, as a markdown table.
fn summary(since: SystemTime) {
    let dir = criterion_dir();
    let gibps = |size: u64, ns: f64| size as f64 / ns * 1e9 / (1u64 << 30) as f64;
    let mut rows = Vec::new();
    let mut goal = Vec::new();
    for size in SIZES {
        let group = format!("cache_hit_{}", size_label(size));
        let est: Vec<_> = VARIANTS
            .iter()
            .map(|id| estimate(&dir, &group, id, since))
            .collect();
        if est.iter().all(Option::is_none) {
            continue;
        }
        let chunks: u64 = offsets_for(size)
            .iter()
            .map(|&o| chunks_touched(o, size))
            .sum();
        let per_read = chunks as f64 / OFFSETS as f64;
        let cell = |e: &Option<(f64, f64, f64)>| match e {
            Some((ns, _, _)) if gibps(size, *ns) < 1.0 => {
                format!(
                    "{:.1} MiB/s ({:.1} µs)",
                    gibps(size, *ns) * 1024.0,
                    ns / 1e3
                )
            }
            Some((ns, _, _)) => format!("{:.2} GiB/s ({:.1} µs)", gibps(size, *ns), ns / 1e3),
            None => "–".to_owned(),
        };
        let ratio_to = |e: &Option<(f64, f64, f64)>, peer: &Option<(f64, f64, f64)>| match (e, peer)
        {
            // Throughput ratio = inverse time ratio; the interval from the two intervals.
            (Some((ns, lo, hi)), Some((f, flo, fhi))) => format!(
                "**{}** [{}–{}]",
                ratio_text(f / ns),
                ratio_text(flo / hi),
                ratio_text(fhi / lo)
            ),
            _ => "–".to_owned(),
        };
        rows.push(format!(
            "| {} | {per_read:.2} | {:.2}× | {} | {} | {} | {} | {} | {} |",
            size_label(size),
            per_read * CHUNK_SIZE as f64 / size as f64,
            cell(&est[0]),
            cell(&est[1]),
            cell(&est[3]),
            cell(&est[2]),
            ratio_to(&est[1], &est[0]),
            ratio_to(&est[2], &est[3]),
        ));
        if let (Some((f, ..)), Some((l2, ..))) = (&est[3], &est[2]) {
            let r = f / l2;
            goal.push(format!(
                "{} {} ({})",
                size_label(size),
                if r >= L2_GOAL { "meets" } else { "misses" },
                ratio_text(r)
            ));
        }
    }
    if rows.is_empty() {
        return;
    }
    println!();
    println!(
        "chunk_cache summary: criterion medians of this run (time per read in brackets); ratio = \
         throughput / its peer (l1: plain_file, page cache warm; l2: plain_file_uncached, from the \
         disk like a level-2 hit), 95 % interval from the two intervals; chunk bytes = bytes of \
         whole chunks a read touches per byte returned"
    );
    println!();
    println!("| read | chunks per read | chunk bytes / byte | plain_file | l1 | plain_file_uncached | l2 | l1 / plain_file | l2 / plain_file_uncached |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in rows {
        println!("{row}");
    }
    if !goal.is_empty() {
        println!();
        println!(
            "l2 goal (>= {L2_GOAL}x plain_file_uncached): {}",
            goal.join(", ")
        );
    }
}

fn main() {
    let since = SystemTime::now();
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    chunk_cache(&mut criterion);
    criterion.final_summary();
    summary(since);
}
