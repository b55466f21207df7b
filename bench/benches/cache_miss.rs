//! The chunk cache's miss path over a slow backend: a scenario, not a micro-benchmark.
//!
//! A 32 MiB blob sits in a `MemoryBackend` behind a `FaultyBackend` that adds 2 ms before
//! every request (a nearby object store). Each run opens a **fresh** cache, so every first
//! read of a chunk is a miss, registers the blob (its chunk table is fetched before the
//! counters are reset), then reads one access pattern, one read at a time:
//!
//! - `sequential`: the whole blob, in order, in 128 KiB reads;
//! - `random10`: the blob cut into consecutive regions of 4 KiB..64 KiB (random multiples of
//!   4 KiB), a random tenth of them read in random order;
//! - `sequential-4MiB`: the whole blob in 4 MiB reads (a read that by itself spans
//!   `max_request_bytes`: what coalescing alone does, without readahead).
//!
//! Each pattern runs with two configurations: `default` (`CacheConfig::default()`: coalescing
//! up to 4 MiB per request, 1 MiB readahead after a sequential read) and `no-coalesce` (no
//! readahead, one chunk per request), and on two kinds of cache: `memory` (level 1 only) and
//! `memory+disk` (level 1 plus a level 2 in a fresh directory on the local disk, so that a
//! miss also writes the chunk there). After the last read the harness waits for background
//! readahead to finish before it takes the counters, so bytes fetched include readahead; the
//! wall time stops at the last read.
//!
//! Bytes and requests come from `FaultyBackend::stats()` (what the backend saw) and are
//! checked against `ChunkCache::stats()`. Every read's bytes are compared with the blob.
//! Prints markdown tables. `cargo bench -p bench --bench cache_miss`; without `--bench` (as
//! `cargo test --benches` runs it) a quick smoke run on a 4 MiB blob.

use std::fmt::Write as _;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench::{
    bench_dir, bench_tempdir, fill_pseudo_random, fs_type, median, random_regions, size_label,
};
use bytes::Bytes;
use fs_cache::chunk::disk::DiskCacheConfig;
use fs_cache::chunk::{CacheConfig, CacheStats, ChunkCache, CHUNK_SIZE};
use fs_cache::{Backend, Digest, FaultConfig, FaultyBackend, MemoryBackend, Store};

const LATENCY: Duration = Duration::from_millis(2);
const SEQUENTIAL_READ: u64 = 128 << 10;
const LARGE_READ: u64 = 4 << 20;
const REGION_MIN: u64 = 4 << 10;
const REGION_MAX: u64 = 64 << 10;
const REGION_ALIGN: u64 = 4 << 10;
const RANDOM_FRACTION: f64 = 0.1;
/// Level-2 capacity (ample: nothing is evicted).
const DISK_CAPACITY: u64 = 256 << 20;

struct Params {
    blob_size: u64,
    repeats: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Level {
    Memory,
    MemoryAndDisk,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Memory => "memory",
            Level::MemoryAndDisk => "memory+disk",
        }
    }
}

#[derive(Clone, Copy)]
enum Config {
    Default,
    NoCoalesce,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::Default => "default",
            Config::NoCoalesce => "no-coalesce",
        }
    }

    fn build(self) -> CacheConfig {
        match self {
            Config::Default => CacheConfig::default(),
            Config::NoCoalesce => CacheConfig {
                readahead_bytes: 0,
                max_request_bytes: CHUNK_SIZE,
                ..CacheConfig::default()
            },
        }
    }
}

struct Pattern {
    name: &'static str,
    reads: Vec<Range<u64>>,
}

/// What one run measured.
#[derive(Clone, Debug)]
struct Run {
    wall: Duration,
    /// Per read, sorted.
    latencies: Vec<Duration>,
    gets: u64,
    bytes_fetched: u64,
    cache: CacheStats,
}

struct World {
    faulty: Arc<FaultyBackend>,
    store: Store,
    digest: Digest,
    data: Bytes,
}

impl World {
    async fn new(blob_size: u64) -> World {
        let faulty = Arc::new(FaultyBackend::new(Arc::new(MemoryBackend::new()), 1));
        let store = Store::new(faulty.clone() as Arc<dyn Backend>);
        let mut data = vec![0u8; blob_size as usize];
        fill_pseudo_random(&mut data, 0x4D49_5353);
        let data = Bytes::from(data);
        let put = store.put_blob(data.clone()).await.expect("put_blob");
        faulty.set(FaultConfig {
            latency: LATENCY,
            ..FaultConfig::default()
        });
        World {
            faulty,
            store,
            digest: put.digest,
            data,
        }
    }

    /// Time of one request of `len` bytes through the faulty backend (median of `n`).
    async fn request_time(&self, len: u64, n: usize) -> Duration {
        let key = fs_cache::store::blob_key(&self.digest);
        let mut times = Vec::new();
        for i in 0..n as u64 {
            let start = (i * len) % (self.data.len() as u64 - len + 1);
            let t = Instant::now();
            let body = self
                .faulty
                .get_range(&key, start..start + len)
                .await
                .expect("get_range");
            times.push(t.elapsed().as_secs_f64());
            assert_eq!(body.len() as u64, len);
        }
        Duration::from_secs_f64(median(&times))
    }

    async fn run(&self, pattern: &Pattern, level: Level, config: Config) -> Run {
        let mut cfg = config.build();
        let disk_dir = match level {
            Level::Memory => None,
            Level::MemoryAndDisk => {
                let dir = bench_tempdir(
                    Path::new(env!("CARGO_TARGET_TMPDIR")),
                    "strata-bench-l2.",
                    "a level-2 directory",
                );
                cfg.disk = Some(DiskCacheConfig {
                    dir: dir.path().to_owned(),
                    capacity: DISK_CAPACITY,
                });
                Some(dir)
            }
        };
        let cache = ChunkCache::open(self.store.clone(), cfg)
            .await
            .expect("ChunkCache::open");
        cache.register(&self.digest).await.expect("register");
        self.faulty.reset_stats();
        let base = cache.stats();
        assert_eq!(base.backend_requests, 0);

        let mut latencies = Vec::with_capacity(pattern.reads.len());
        let started = Instant::now();
        for r in &pattern.reads {
            let t = Instant::now();
            let got = cache
                .read(&self.digest, r.start, r.end - r.start)
                .await
                .expect("cache read");
            latencies.push(t.elapsed());
            assert_eq!(got, self.data.slice(r.start as usize..r.end as usize));
        }
        let wall = started.elapsed();
        // Let background readahead land before counting what was fetched.
        let mut last = self.faulty.stats();
        loop {
            tokio::time::sleep(LATENCY * 10).await;
            let now = self.faulty.stats();
            if now == last {
                break;
            }
            last = now;
        }
        let stats = cache.stats();
        assert_eq!(
            (stats.backend_requests, stats.bytes_fetched),
            (last.gets, last.bytes_read),
            "the cache's counters disagree with the backend's"
        );
        drop(cache);
        drop(disk_dir);
        latencies.sort();
        Run {
            wall,
            latencies,
            gets: last.gets,
            bytes_fetched: last.bytes_read,
            cache: stats,
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// `median [min–max]` of a counter over runs, or just the value if all runs agree.
fn spread(values: impl Iterator<Item = u64>, show: impl Fn(f64) -> String) -> String {
    let v: Vec<f64> = values.map(|x| x as f64).collect();
    let (lo, hi) = v
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    if lo == hi {
        show(lo)
    } else {
        format!("{} [{}–{}]", show(median(&v)), show(lo), show(hi))
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i]
}

fn main() {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let params = if bench_mode {
        Params {
            blob_size: 32 << 20,
            repeats: 5,
        }
    } else {
        eprintln!("cache_miss: not run with --bench: quick smoke run (4 MiB blob, 1 repeat)");
        Params {
            blob_size: 4 << 20,
            repeats: 1,
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("build the tokio runtime");
    let total = Instant::now();
    let world = rt.block_on(World::new(params.blob_size));

    let in_order = |name, len: u64| Pattern {
        name,
        reads: (0..params.blob_size)
            .step_by(len as usize)
            .map(|o| o..(o + len).min(params.blob_size))
            .collect(),
    };
    let sequential = in_order("sequential", SEQUENTIAL_READ);
    let random = Pattern {
        name: "random10",
        reads: random_regions(
            params.blob_size,
            REGION_MIN,
            REGION_MAX,
            REGION_ALIGN,
            RANDOM_FRACTION,
            0x5241_4E44,
        ),
    };
    let patterns = [sequential, random, in_order("sequential-4MiB", LARGE_READ)];
    let levels = [Level::Memory, Level::MemoryAndDisk];
    let configs = [Config::Default, Config::NoCoalesce];

    let (one_chunk, four_mib) = rt.block_on(async {
        (
            world.request_time(CHUNK_SIZE, 20).await,
            world.request_time(4 << 20, 10).await,
        )
    });
    let l2_dir = bench_dir(Path::new(env!("CARGO_TARGET_TMPDIR")));
    println!();
    println!(
        "cache_miss: {} blob ({} chunks) in MemoryBackend behind FaultyBackend, latency {:?} per request \
         (measured: {} for a 256 KiB GET, {} for a 4 MiB GET, median); level 2 under {} ({}); \
         {} runs per row, each with a fresh cache",
        size_label(params.blob_size),
        params.blob_size.div_ceil(CHUNK_SIZE),
        LATENCY,
        ms(one_chunk),
        ms(four_mib),
        l2_dir.display(),
        fs_type(&l2_dir).unwrap_or_else(|| "unknown".into()),
        params.repeats,
    );

    // runs[p][l][c]: interleaved, so that a noisy moment hits every row alike.
    let mut runs: Vec<Vec<Vec<Vec<Run>>>> =
        vec![vec![vec![Vec::new(); configs.len()]; levels.len()]; patterns.len()];
    for _ in 0..params.repeats {
        for (p, pattern) in patterns.iter().enumerate() {
            for (l, &level) in levels.iter().enumerate() {
                for (c, &config) in configs.iter().enumerate() {
                    let run = rt.block_on(world.run(pattern, level, config));
                    runs[p][l][c].push(run);
                }
            }
        }
    }

    for (l, level) in levels.iter().enumerate() {
        let mut out = String::new();
        let _ = writeln!(out);
        let _ = writeln!(out, "cache: {}", level.name());
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| pattern | config | reads | bytes read | bytes fetched | fetched / read | GETs | chunks / GET | `misses` | `readahead_chunks` | wall time | per read p50 / p99 / max |"
        );
        let _ = writeln!(
            out,
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        );
        for (p, pattern) in patterns.iter().enumerate() {
            for (c, config) in configs.iter().enumerate() {
                let rs = &runs[p][l][c];
                let read = rs[0].cache.bytes_read;
                let walls: Vec<f64> = rs.iter().map(|r| r.wall.as_secs_f64()).collect();
                let wall = Duration::from_secs_f64(median(&walls));
                let wall_lo = walls.iter().copied().fold(f64::MAX, f64::min);
                let wall_hi = walls.iter().copied().fold(f64::MIN, f64::max);
                // Per-read latencies of the median run.
                let mid = rs
                    .iter()
                    .min_by(|a, b| {
                        let d = |r: &Run| (r.wall.as_secs_f64() - wall.as_secs_f64()).abs();
                        d(a).total_cmp(&d(b))
                    })
                    .expect("at least one run");
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} [{:.0}–{:.0}] | {} / {} / {} |",
                    pattern.name,
                    config.name(),
                    pattern.reads.len(),
                    mib(read),
                    spread(rs.iter().map(|r| r.bytes_fetched), |x| mib(x as u64)),
                    spread(rs.iter().map(|r| r.bytes_fetched * 1000 / read), |x| format!(
                        "**{:.2}**",
                        x / 1000.0
                    )),
                    spread(rs.iter().map(|r| r.gets), |x| format!("{x:.0}")),
                    spread(
                        rs.iter()
                            .map(|r| r.cache.coalesced_chunks * 100 / r.gets.max(1)),
                        |x| format!("{:.2}", x / 100.0)
                    ),
                    spread(rs.iter().map(|r| r.cache.misses), |x| format!("{x:.0}")),
                    spread(rs.iter().map(|r| r.cache.readahead_chunks), |x| format!(
                        "{x:.0}"
                    )),
                    ms(wall),
                    wall_lo * 1e3,
                    wall_hi * 1e3,
                    ms(quantile(&mid.latencies, 0.5)),
                    ms(quantile(&mid.latencies, 0.99)),
                    ms(quantile(&mid.latencies, 1.0)),
                );
            }
        }
        print!("{out}");
    }
    println!();
    println!(
        "cache_miss: done in {:.1?} (wall time: median [min–max] of {} runs, in ms)",
        total.elapsed(),
        params.repeats
    );
}
