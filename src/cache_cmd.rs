//! `strata blob cat` (reads through the node's chunk cache) and `strata cache stats`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fs_cache::chunk::disk::DiskCacheConfig;
use fs_cache::chunk::{CacheConfig, CacheStats, ChunkCache};
use fs_cache::{Digest, Store};

/// Where the node cache lives and how big it may grow.
#[derive(clap::Args, Debug, Clone)]
pub struct CacheOpts {
    /// Directory of the node's chunk cache (default: $STRATA_HOME/cache).
    #[arg(long, global = true, env = "STRATA_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Level-1 (memory) capacity, e.g. 256MiB.
    #[arg(long, global = true, env = "STRATA_CACHE_MEMORY", default_value = "256MiB", value_parser = parse_size)]
    pub cache_memory: u64,
    /// Level-2 (local disk) capacity, e.g. 10GiB.
    #[arg(long, global = true, env = "STRATA_CACHE_DISK", default_value = "10GiB", value_parser = parse_size)]
    pub cache_disk: u64,
    /// A backend request of the chunk cache that takes longer than this (a stalled
    /// connection or body) is abandoned and retried.
    #[arg(long, global = true, env = "STRATA_BACKEND_ATTEMPT_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub backend_attempt_timeout: std::time::Duration,
    /// No retry of a chunk cache's backend request starts after this long: the read fails
    /// (EIO through a mount). See `ublk-daemon/docs/daemon.md`, "Failed reads".
    #[arg(long, global = true, env = "STRATA_BACKEND_DEADLINE", default_value = "60s", value_parser = humantime::parse_duration)]
    pub backend_deadline: std::time::Duration,
    /// A miss in a blob of chunks smaller than this (a layer's tails blob) also fetches the
    /// rest of its aligned window of this size, in the same request, e.g. 256KiB; 0: only
    /// the chunks read. Default: 256KiB for an S3 store, where a request costs far more
    /// than its bytes, 0 for a POSIX store.
    #[arg(long, global = true, env = "STRATA_CACHE_FETCH_UNIT", value_parser = parse_size)]
    pub cache_fetch_unit: Option<u64>,
    /// A miss in a blob of chunks smaller than the fetch unit widens to it only while, of the
    /// chunks its blob's recent windows brought (or would have brought) along, at least this
    /// percentage was then read; 0: always. See `ublk-daemon/docs/daemon.md`, "A layer's blobs and the fetch unit".
    #[arg(long, global = true, env = "STRATA_CACHE_FETCH_UNIT_YIELD", default_value_t = fs_cache::chunk::DEFAULT_MIN_YIELD_PCT, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub cache_fetch_unit_yield: u8,
}

/// The fetch unit for a store when none is given: see [`CacheOpts::cache_fetch_unit`].
pub fn default_fetch_unit(store_url: &str) -> u64 {
    if store_url.starts_with("s3://") {
        256 << 10
    } else {
        0
    }
}

/// Parse `123`, `4KiB`, `256MiB`, `10GiB`, `1TiB` (also KB/MB/GB as powers of 1000).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (expected e.g. 512MiB or 10GiB)"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        u => {
            return Err(format!(
                "unknown size unit {u:?} (expected B, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

impl CacheOpts {
    /// The cache's configuration on this node, for the store at `store_url`.
    pub fn config(&self, home: &Path, store_url: &str) -> CacheConfig {
        let dir = self.cache_dir.clone().unwrap_or_else(|| home.join("cache"));
        CacheConfig {
            memory_bytes: self.cache_memory,
            disk: Some(DiskCacheConfig {
                dir: dir.join("chunks"),
                capacity: self.cache_disk,
            }),
            stats_file: Some(dir.join("stats.json")),
            fetch_unit_bytes: self
                .cache_fetch_unit
                .unwrap_or_else(|| default_fetch_unit(store_url)),
            fetch_unit_min_yield_pct: self.cache_fetch_unit_yield,
            retry: fs_cache::RetryPolicy {
                attempt_timeout: self.backend_attempt_timeout,
                deadline: self.backend_deadline,
                ..fs_cache::RetryPolicy::default()
            },
            ..CacheConfig::default()
        }
    }
}

pub async fn open(store: Store, opts: &CacheOpts, home: &Path) -> Result<ChunkCache> {
    let config = opts.config(home, &store.backend().to_string());
    if let Some(d) = &config.disk {
        std::fs::create_dir_all(&d.dir)
            .with_context(|| format!("create cache directory {}", d.dir.display()))?;
    }
    ChunkCache::open(store, config)
        .await
        .context("open the node's chunk cache")
}

/// Copy `len` bytes of `blob` at `offset` through the cache into `out`.
pub async fn cat(
    cache: &ChunkCache,
    digest: &str,
    offset: u64,
    len: Option<u64>,
    out: &mut dyn Write,
) -> Result<u64> {
    let d: Digest = digest.parse()?;
    let size = cache.blob_size(&d).await?;
    if offset > size {
        bail!("offset {offset} is past the end of blob {d} ({size} bytes)");
    }
    let end = len.map_or(size, |l| offset.saturating_add(l).min(size));
    let mut at = offset;
    const PIECE: u64 = 4 << 20;
    while at < end {
        let n = PIECE.min(end - at);
        let buf = cache.read(&d, at, n).await?;
        out.write_all(&buf).context("write output")?;
        at += buf.len() as u64;
    }
    out.flush().context("write output")?;
    Ok(end - offset)
}

pub fn print_stats(s: &CacheStats) {
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    println!(
        "hits            {:>12}  (memory {}, disk {})",
        s.hits, s.hits_memory, s.hits_disk
    );
    println!("misses          {:>12}", s.misses);
    println!("bytes read      {:>12}", s.bytes_read);
    println!(
        "bytes fetched   {:>12}  ({:.2}× bytes read)",
        s.bytes_fetched,
        ratio(s.bytes_fetched, s.bytes_read)
    );
    println!(
        "backend requests{:>12}  ({:.1} chunks per request)",
        s.backend_requests,
        ratio(s.coalesced_chunks, s.backend_requests)
    );
    println!("evictions       {:>12}", s.evictions);
    println!("verify failures {:>12}", s.verify_failures);
    let list = |m: &std::collections::BTreeMap<String, u64>| {
        let v: Vec<String> = m
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.join(", ")
        }
    };
    println!("retries         {}", list(&s.retries));
    println!("backend errors  {}", list(&s.backend_errors_by_kind));
    println!(
        "memory          {:>12} of {}",
        s.memory_bytes, s.memory_capacity
    );
    if let Some(d) = &s.disk {
        println!(
            "disk            {:>12} of {} ({} chunks)",
            d.bytes, d.capacity, d.chunks
        );
    }
}
