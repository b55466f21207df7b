//! `strata`: the command-line front of Strata.
//!
//! Every command takes `--store URL` (default: `$STRATA_HOME/store`, with `STRATA_HOME`
//! defaulting to `~/.local/share/strata`) and `--json` for machine-readable output.

mod api_cmd;
mod bd_cmd;
mod build_cmd;
mod cache_cmd;
mod dedup;
mod image_cmd;
mod metrics_cmd;
mod node_cmd;
mod order;
mod sandbox_cmd;
mod sim_cmd;
mod template_cmd;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use fs_cache::gc::{self, GcOptions};
use fs_cache::{open_backend, Digest, LayerRef, Manifest, Store};
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    name = "strata",
    version,
    about = "Layered, lazily served EROFS storage for agent sandboxes"
)]
struct Cli {
    /// Where blobs and layers live: a path, file:///path, or
    /// s3://bucket/prefix?endpoint=http://host:port&region=REGION [default: $STRATA_HOME/store].
    ///
    /// The node commands (mount, umount, status, warm) use the store of the daemon on
    /// --run-dir, which serves one store: given here or in STRATA_STORE, the store must be that
    /// one, else they fail and name both (a path and file:///path are the same store); left to
    /// the default, they use the daemon's store. When no daemon runs, mount and warm start one
    /// serving this store.
    #[arg(long, global = true, env = "STRATA_STORE")]
    store: Option<String>,
    /// Machine-readable output (JSON) instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(flatten)]
    cache: cache_cmd::CacheOpts,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Content-addressed blobs.
    #[command(subcommand)]
    Blob(BlobCmd),
    /// Versioned layers (KIND/NAME:VERSION).
    #[command(subcommand)]
    Layer(LayerCmd),
    /// The node's chunk cache.
    #[command(subcommand)]
    Cache(CacheCmd),
    /// OCI images: import an OCI image layout or a docker save archive as a layer stack.
    #[command(subcommand)]
    Image(image_cmd::ImageCmd),
    /// Build a full EROFS image (all data inside) from a directory, a layer tar (--tar) or an
    /// overlay upper (--upper); the argument order of `mkfs.erofs`. The kernel mounts it
    /// directly (file-backed).
    Mkfs {
        image: PathBuf,
        source: PathBuf,
        #[command(flatten)]
        input: build_cmd::InputArgs,
        /// Build a lazy layer instead: IMAGE gets the metadata only, and file data goes to this
        /// blob in 256 KiB chunks (chunk-based files; mount with `device=BLOB`).
        #[arg(long)]
        blobdev: Option<PathBuf>,
        /// Seconds since the epoch to use as the image's build time (default: the source
        /// root's mtime), for reproducible builds.
        #[arg(long)]
        timestamp: Option<i64>,
        /// Do not copy extended attributes.
        #[arg(long)]
        no_xattrs: bool,
    },
    /// Run the node daemon (one per machine, as root): the chunk cache, the FUSE blob files
    /// and the layer mounts, served on <run-dir>/strata.sock. `strata mount` starts it when
    /// it is not running.
    Daemon(node_cmd::DaemonArgs),
    /// The fd holder the daemon starts: keeps its FUSE connections open across a crash or an
    /// upgrade of the daemon (ublk_daemon::holder). Not for direct use.
    #[command(hide = true)]
    FuseHolder {
        #[arg(long)]
        run_dir: PathBuf,
    },
    /// Sandboxes on layer stacks, owned by the node daemon: create, exec, cp, ls, inspect,
    /// rm, warm pools.
    #[command(subcommand)]
    Sandbox(sandbox_cmd::SandboxCmd),
    /// Pack a sandbox's changes (its upper, residue stripped, checked for its secrets) into a
    /// new layer whose parents are the sandbox's stack.
    PackDiff(sandbox_cmd::PackArgs),
    /// Templates of the E2B API (`templateID` → a layer stack), kept by the node daemon.
    #[command(subcommand)]
    Template(template_cmd::TemplateCmd),
    /// Mount layers lazily: `strata mount REF... MOUNTPOINT` (first REF lowest; several
    /// layers or --upper make an overlay). Prints the mountpoint.
    Mount(node_cmd::MountArgs),
    /// Unmount a `strata mount` and release the layers it used.
    Umount(node_cmd::UmountArgs),
    /// The node daemon's layers, mounts and cache counters.
    Status(node_cmd::StatusArgs),
    /// Bring every chunk of layers into the node's local cache, so that a later mount reads
    /// them straight from local disk (FUSE passthrough, or EROFS on the cache file where the kernel
    /// refuses that); starts the daemon if needed.
    Warm(node_cmd::WarmArgs),
    /// Layered block devices (OverlayBD) for microVM disks: create, serve (FUSE image file
    /// or ublk), commit.
    #[command(subcommand)]
    Bd(bd_cmd::BdCommand),
    /// The cluster front: the E2B API in front of several nodes (`strata daemon --api
    /// --node-name`), placing creates and routing every other request by the sandbox id.
    Api(api_cmd::ApiArgs),
    /// Simulations: placement of a burst by several instances from a stale snapshot, and
    /// the literature's anchors.
    #[command(subcommand)]
    Sim(sim_cmd::SimCmd),
    /// Remove blobs that no layer references (never blobs younger than --grace).
    Gc {
        /// Keep unreferenced blobs uploaded or leased within this period (e.g. 1h, 30m).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        grace: Duration,
        /// Report what would be removed without removing it.
        #[arg(long)]
        dry_run: bool,
        /// Sweep what puts left when their process died (POSIX temporary files, S3
        /// multipart uploads) once begun longer ago than this.
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        abandoned_after: Duration,
    },
}

#[derive(Subcommand, Debug)]
enum BlobCmd {
    /// Store files (directories recursively) as blobs; print their digests.
    Put {
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Read every blob back from the store and check it against its digest.
        #[arg(long)]
        verify: bool,
        /// Uploads in flight.
        #[arg(long, default_value_t = 16)]
        jobs: usize,
    },
    /// Write a blob to a file (or stdout), verified against its digest.
    Get {
        digest: String,
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// List stored blobs.
    Ls,
    /// Read (part of) a blob through the node's chunk cache: only the chunks it covers are
    /// fetched, each verified against the blob's chunk table.
    Cat {
        digest: String,
        #[arg(long, default_value_t = 0)]
        offset: u64,
        #[arg(long)]
        length: Option<u64>,
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum CacheCmd {
    /// Counters of the node's chunk cache (cumulative) and its usage.
    Stats,
}

#[derive(Subcommand, Debug)]
enum LayerCmd {
    /// List layers.
    Ls,
    /// Show a layer's manifest.
    Inspect { layer: String },
    /// Remove a layer version (its blobs stay until gc; the version cannot be reused for
    /// different content).
    Rm { layer: String },
    /// Push a manifest (JSON) whose blobs are already stored.
    Push { manifest: PathBuf },
    /// Build a lazy layer from a directory, a layer tar (--tar) or an overlay upper (--upper):
    /// an EROFS meta image and a data blob of 256 KiB chunks, with its chunk table, all
    /// pushed under KIND/NAME:VERSION.
    Build {
        source: PathBuf,
        #[command(flatten)]
        input: build_cmd::InputArgs,
        #[arg(long)]
        name: String,
        /// Layers this one is meant to be stacked on (recorded in the manifest).
        #[arg(long = "parent")]
        parents: Vec<String>,
        /// Build time (seconds since the epoch) for reproducible images.
        #[arg(long)]
        timestamp: Option<i64>,
        /// Do not copy extended attributes.
        #[arg(long)]
        no_xattrs: bool,
        /// How the layer's blobs are stored: `zstd` (the default: each 256 KiB chunk a zstd
        /// frame, level 1; chunks that do not shrink stay plain), `zstd:LEVEL` (1-19) or `none`.
        /// Nodes read either the same way; their caches hold plain chunks.
        #[arg(long, default_value = "zstd")]
        compress: fs_cache::Compression,
        /// Store every chunk in the layer's own blob, even those the store holds already (by
        /// default a full 256 KiB chunk that a stored layer of the same kind has is pointed
        /// at in that layer's blob, not uploaded again).
        #[arg(long)]
        no_dedup: bool,
        /// Dedup against these layers first (then the other versions of KIND/NAME, then the
        /// kind's other layers, newest first; at most 31 blobs, 30 with a tails blob).
        #[arg(long = "dedup-from", conflicts_with = "no_dedup")]
        dedup_from: Vec<String>,
        /// Lay the files out in the order this layer's recorded access trace first read them
        /// (a node records a trace the first time it mounts a layer): what the earlier
        /// version's first readers read together is then stored, and fetched, together.
        #[arg(long = "order-from")]
        order_from: Option<String>,
        /// Chunk size of the layer's tails blob (its device 2): small files and the last
        /// partial 256 KiB of larger files are packed there, in chunks of this size (a power
        /// of two, 4096..=131072), so a node fetches, verifies and dedups them in smaller
        /// units than the main blob's 256 KiB. `0`: no tails blob (one data blob, as layers
        /// built before it).
        #[arg(long, value_name = "BYTES", env = "STRATA_TAIL_CHUNK_SIZE", default_value_t = erofs_builder::layer::DEFAULT_TAIL_CHUNK_SIZE)]
        tail_chunk_size: u32,
        /// Files of at most this many bytes (under 4096) are stored in the meta image itself,
        /// after their inode, instead of in a blob: a node reads them with the inode from its
        /// local copy of the meta image, with no fetch. They are not deduplicated across
        /// layers, and every node fetches them with the meta image at the first mount. `0`:
        /// every file's data in the blobs (as layers built before this option). Default: 4095
        /// for base and toolkit layers (what every sandbox reads first), 0 for workspace and
        /// snapshot layers (many of them share most of their files, which dedup keeps once).
        /// The smallest files go first, up to 1/16 of the layer's bytes (at most 8 MiB).
        #[arg(long, value_name = "BYTES", env = "STRATA_INLINE_MAX")]
        inline_max: Option<u64>,
    },
    /// Export a stack of layers (REFs lowest first, each with its parents) as an OCI image
    /// layout (--oci DIR or FILE.tar; one gzip/zstd layer tar per layer, whiteouts as OCI
    /// whiteouts) or as one full EROFS image (--erofs FILE).
    Export(image_cmd::ExportArgs),
}

fn strata_home() -> Result<PathBuf> {
    Ok(match std::env::var_os("STRATA_HOME") {
        Some(h) => PathBuf::from(h),
        None => {
            let home = std::env::var_os("HOME").context("neither STRATA_HOME nor HOME is set")?;
            PathBuf::from(home).join(".local/share/strata")
        }
    })
}

pub(crate) fn print_json<T: Serialize>(v: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)?;
    Ok(())
}

pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Regular files under `paths`, sorted, symlinks not followed.
fn collect_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let md = std::fs::symlink_metadata(p).with_context(|| format!("stat {}", p.display()))?;
        if md.is_file() {
            out.push(p.to_owned());
        } else if md.is_dir() {
            let mut entries: Vec<_> = std::fs::read_dir(p)
                .with_context(|| format!("read directory {}", p.display()))?
                .map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<_>>()
                .with_context(|| format!("read directory {}", p.display()))?;
            entries.sort();
            for e in entries {
                walk(&e, out)?;
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for p in paths {
        walk(p, &mut out)?;
    }
    Ok(out)
}

#[derive(Serialize)]
struct PutEntry {
    path: String,
    digest: String,
    size: u64,
    existed: bool,
}

#[derive(Serialize)]
struct PutSummary {
    files: usize,
    bytes: u64,
    unique_blobs: usize,
    uploaded_blobs: usize,
    uploaded_bytes: u64,
    seconds: f64,
    verified: Option<usize>,
    entries: Vec<PutEntry>,
}

async fn blob_put(
    store: &Store,
    paths: &[PathBuf],
    verify: bool,
    jobs: usize,
    json: bool,
) -> Result<()> {
    let files = collect_files(paths)?;
    let start = Instant::now();
    let results: Vec<(PathBuf, fs_cache::PutBlob)> = futures::stream::iter(files)
        .map(|f| async move {
            let put = store
                .put_blob_file(&f)
                .await
                .with_context(|| format!("store {}", f.display()))?;
            Ok::<_, anyhow::Error>((f, put))
        })
        .buffered(jobs.max(1))
        .try_collect()
        .await?;
    let seconds = start.elapsed().as_secs_f64();
    let mut unique = std::collections::HashSet::new();
    let mut new_blobs = std::collections::HashMap::new();
    let mut bytes = 0;
    for (_, p) in &results {
        bytes += p.size;
        unique.insert(p.digest);
        if !p.existed {
            new_blobs.insert(p.digest, p.size);
        }
    }
    let uploaded = new_blobs.len();
    let uploaded_bytes: u64 = new_blobs.values().sum();
    let verified = if verify {
        // Read every blob back the way a node does: through a chunk cache, every 256 KiB chunk
        // checked against the blob's chunk table, and the whole blob against its digest.
        let cache = fs_cache::chunk::ChunkCache::open(
            store.clone(),
            fs_cache::chunk::CacheConfig {
                memory_bytes: 64 << 20,
                ..Default::default()
            },
        )
        .await?;
        let digests: Vec<Digest> = unique.iter().copied().collect();
        let n = digests.len();
        futures::stream::iter(digests)
            .map(|d| {
                let cache = cache.clone();
                async move {
                    let size = cache.blob_size(&d).await?;
                    let mut hasher = blake3::Hasher::new();
                    let mut at = 0;
                    while at < size {
                        let buf = cache.read(&d, at, 4 << 20).await?;
                        hasher.update(&buf);
                        at += buf.len() as u64;
                    }
                    if hasher.finalize().as_bytes() != &d.0 {
                        anyhow::bail!("blob {d} read back with a different digest");
                    }
                    Ok(())
                }
            })
            .buffer_unordered(jobs.max(1))
            .try_collect::<Vec<_>>()
            .await?;
        Some(n)
    } else {
        None
    };
    let summary = PutSummary {
        files: results.len(),
        bytes,
        unique_blobs: unique.len(),
        uploaded_blobs: uploaded,
        uploaded_bytes,
        seconds,
        verified,
        entries: results
            .iter()
            .map(|(f, p)| PutEntry {
                path: f.display().to_string(),
                digest: p.digest.to_hex(),
                size: p.size,
                existed: p.existed,
            })
            .collect(),
    };
    if json {
        return print_json(&summary);
    }
    println!(
        "stored {} files, {} in {} unique blobs ({} uploaded, {} new) in {:.2} s ({}/s) to {}",
        summary.files,
        human(bytes),
        summary.unique_blobs,
        uploaded,
        human(uploaded_bytes),
        seconds,
        human((bytes as f64 / seconds.max(1e-9)) as u64),
        store.backend()
    );
    if let Some(n) = verified {
        println!(
            "verified: read {n} blobs back through the chunk cache; every chunk and every blob digest matches"
        );
    }
    Ok(())
}

async fn blob_get(store: &Store, digest: &str, output: Option<&Path>) -> Result<()> {
    let d: Digest = digest.parse()?;
    match output {
        None => {
            let data = store.get_blob(&d).await?;
            std::io::stdout().lock().write_all(&data)?;
        }
        Some(path) => {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let mut tmp = tempfile::NamedTempFile::new_in(dir)
                .with_context(|| format!("create a temporary file in {}", dir.display()))?;
            store.read_blob_to(&d, tmp.as_file_mut(), 8 << 20).await?;
            tmp.as_file().sync_all()?;
            tmp.persist(path)
                .with_context(|| format!("write {}", path.display()))?;
        }
    }
    Ok(())
}

/// A built layer's own data blobs in device order: the main blob at `blob` (256 KiB chunks)
/// and, when the build made one, the tails blob at `tails` (its chunk size).
fn own_blobs(blob: &Path, tails: &Path, s: &erofs_builder::LayerStats) -> Vec<fs_cache::BlobFile> {
    let mut v = vec![fs_cache::BlobFile::new(
        blob,
        fs_cache::Digest(s.blob_blake3),
        build_cmd::LAYER_CHUNK_SIZE,
    )];
    if let Some(t) = &s.tails {
        v.push(fs_cache::BlobFile::new(
            tails,
            fs_cache::Digest(t.blake3),
            u64::from(t.chunk_size),
        ));
    }
    v
}

fn layer_stats_json(meta: &Path, blob: &Path, s: &erofs_builder::LayerStats) -> serde_json::Value {
    let tails = s.tails.as_ref().map(|t| {
        serde_json::json!({
            "bytes": t.bytes,
            "digest": t.blake3_hex(),
            "chunk_size": t.chunk_size,
            "chunks": t.chunks,
            "unique_chunks": t.unique_chunks,
            "stored_bytes": t.stored_bytes,
        })
    });
    serde_json::json!({
        "tails": tails,
        "tails_bytes": s.tails.as_ref().map_or(0, |t| t.bytes),
        "meta": meta.display().to_string(),
        "meta_bytes": s.meta.image_bytes,
        "blob": blob.display().to_string(),
        "blob_bytes": s.blob_bytes,
        "blob_digest": s.blob_blake3_hex(),
        "chunks": s.chunks,
        "unique_chunks": s.unique_chunks,
        "hole_chunks": s.hole_chunks,
        "files": s.meta.files,
        "inline_files": s.meta.inline_files,
        "inline_bytes": s.meta.inline_bytes,
        "data_bytes": s.meta.data_bytes,
    })
}

#[derive(Serialize)]
struct LayerRow {
    layer: String,
    blobs: usize,
    size: u64,
    created: String,
    source: String,
}

async fn run(cli: Cli) -> Result<()> {
    let home = strata_home()?;
    let explicit = cli.store.is_some();
    let url = match cli.store {
        Some(s) => s,
        None => home.join("store").to_string_lossy().into_owned(),
    };
    let node_store = node_cmd::StoreArg {
        url: url.clone(),
        explicit,
    };
    // Commands served by the node daemon do not open the store here.
    let command = match cli.command {
        Command::Daemon(args) => return node_cmd::daemon(args, &url, &cli.cache, &home).await,
        Command::Api(args) => return api_cmd::run(args).await,
        Command::Mount(args) => return node_cmd::mount(args, &node_store, &cli.cache, cli.json),
        Command::Umount(args) => return node_cmd::umount(args, &node_store, cli.json),
        Command::Status(args) => return node_cmd::status(args, &node_store, cli.json),
        Command::Warm(args) => return node_cmd::warm(args, &node_store, &cli.cache, cli.json),
        Command::Sandbox(cmd) => {
            // Blocking client calls: off the async runtime's threads.
            let cache = cli.cache.clone();
            let json = cli.json;
            return tokio::task::spawn_blocking(move || {
                sandbox_cmd::run(cmd, &node_store, &cache, json)
            })
            .await
            .context("the sandbox command's thread")?;
        }
        Command::PackDiff(args) => {
            let json = cli.json;
            return tokio::task::spawn_blocking(move || sandbox_cmd::pack(args, json))
                .await
                .context("the pack command's thread")?;
        }
        Command::Template(cmd) => {
            let cache = cli.cache.clone();
            let json = cli.json;
            return tokio::task::spawn_blocking(move || {
                template_cmd::run(cmd, &node_store, &cache, json)
            })
            .await
            .context("the template command's thread")?;
        }
        Command::Sim(cmd) => {
            let json = cli.json;
            return tokio::task::spawn_blocking(move || sim_cmd::run(cmd, json))
                .await
                .context("the simulation's thread")?;
        }
        other => other,
    };
    let backend = open_backend(&url).await?;
    let store = Store::new(backend);
    match command {
        Command::Blob(BlobCmd::Put {
            paths,
            verify,
            jobs,
        }) => blob_put(&store, &paths, verify, jobs, cli.json).await?,
        Command::Blob(BlobCmd::Get { digest, output }) => {
            blob_get(&store, &digest, output.as_deref()).await?
        }
        Command::Blob(BlobCmd::Cat {
            digest,
            offset,
            length,
            output,
        }) => {
            // A running daemon holds the node cache: read through it.
            let through_daemon = match &output {
                Some(path) => {
                    let mut f = std::fs::File::create(path)
                        .with_context(|| format!("create {}", path.display()))?;
                    node_cmd::cat_through_daemon(&node_store, &digest, offset, length, &mut f)?
                }
                None => node_cmd::cat_through_daemon(
                    &node_store,
                    &digest,
                    offset,
                    length,
                    &mut std::io::stdout().lock(),
                )?,
            };
            if through_daemon.is_some() {
                return Ok(());
            }
            let cache = cache_cmd::open(store.clone(), &cli.cache, &home).await?;
            let result = match &output {
                Some(path) => {
                    let mut f = std::fs::File::create(path)
                        .with_context(|| format!("create {}", path.display()))?;
                    cache_cmd::cat(&cache, &digest, offset, length, &mut f).await
                }
                None => {
                    let mut out = std::io::stdout().lock();
                    cache_cmd::cat(&cache, &digest, offset, length, &mut out).await
                }
            };
            cache.flush().await?;
            result?;
        }
        Command::Cache(CacheCmd::Stats) => {
            let stats = match node_cmd::running_daemon_cache_stats() {
                Some(s) => s,
                None => cache_cmd::open(store.clone(), &cli.cache, &home)
                    .await?
                    .stats(),
            };
            if cli.json {
                print_json(&stats)?;
            } else {
                cache_cmd::print_stats(&stats);
            }
        }
        Command::Blob(BlobCmd::Ls) => {
            let blobs = store.list_blobs().await?;
            if cli.json {
                #[derive(Serialize)]
                struct Row {
                    digest: String,
                    size: u64,
                }
                let rows: Vec<Row> = blobs
                    .iter()
                    .map(|(d, m)| Row {
                        digest: d.to_hex(),
                        size: m.size,
                    })
                    .collect();
                print_json(&rows)?;
            } else {
                for (d, m) in &blobs {
                    println!("{d}  {:>10}", human(m.size));
                }
            }
        }
        Command::Layer(LayerCmd::Ls) => {
            let rows: Vec<LayerRow> = store
                .list_manifests()
                .await?
                .into_iter()
                .map(|m| LayerRow {
                    layer: m.layer.to_string(),
                    blobs: m.all_blobs().count(),
                    size: m.total_size(),
                    created: m.created,
                    source: m.source,
                })
                .collect();
            if cli.json {
                print_json(&rows)?;
            } else {
                println!(
                    "{:<40} {:>6} {:>10}  {:<20}  SOURCE",
                    "LAYER", "BLOBS", "SIZE", "CREATED"
                );
                for r in rows {
                    println!(
                        "{:<40} {:>6} {:>10}  {:<20}  {}",
                        r.layer,
                        r.blobs,
                        human(r.size),
                        r.created,
                        r.source
                    );
                }
            }
        }
        Command::Layer(LayerCmd::Inspect { layer }) => {
            let r: LayerRef = layer.parse()?;
            let m = store.manifest(&r).await?;
            if cli.json {
                print_json(&m)?;
            } else {
                println!("layer:    {}", m.layer);
                println!("created:  {} by {}", m.created, m.builder);
                println!("source:   {}", m.source);
                let stored = |b: &fs_cache::BlobRef| match (&b.compression, b.stored_size) {
                    (Some(c), Some(n)) => format!(" ({} stored, {c})", human(n)),
                    _ => String::new(),
                };
                if let Some(meta) = &m.meta {
                    println!(
                        "meta:     {} {}{}",
                        meta.digest,
                        human(meta.size),
                        stored(meta)
                    );
                }
                for b in &m.blobs {
                    println!("blob:     {} {}{}", b.digest, human(b.size), stored(b));
                }
                for p in &m.parents {
                    println!("parent:   {p}");
                }
                if let Some(b) = &m.built_by {
                    println!(
                        "built by: sandbox {} on {} (machine id {}){}",
                        b.sandbox,
                        b.node,
                        b.identity,
                        if b.secret_names.is_empty() {
                            String::new()
                        } else {
                            format!(", secrets {} (checked absent)", b.secret_names.join(" "))
                        }
                    );
                }
                println!("total:    {}", human(m.total_size()));
            }
        }
        Command::Layer(LayerCmd::Rm { layer }) => {
            let r: LayerRef = layer.parse()?;
            let m = store.remove_layer(&r).await?;
            if cli.json {
                print_json(&m)?;
            } else {
                println!(
                    "removed {r} ({} blobs stay until gc)",
                    m.all_blobs().count()
                );
            }
        }
        Command::Layer(LayerCmd::Build {
            source,
            input,
            name,
            parents,
            timestamp,
            no_xattrs,
            compress,
            no_dedup,
            dedup_from,
            order_from,
            tail_chunk_size,
            inline_max,
        }) => {
            let layer: LayerRef = name.parse()?;
            let inline_max =
                inline_max.unwrap_or_else(|| build_cmd::default_inline_max(layer.kind));
            let first = match &order_from {
                Some(r) => order::trace_order(&store, &r.parse()?).await?,
                None => Vec::new(),
            };
            let ordered_files = first.len();
            let dedup = if no_dedup {
                None
            } else {
                let from = dedup_from
                    .iter()
                    .map(|p| p.parse::<LayerRef>())
                    .collect::<Result<Vec<_>, _>>()?;
                Some(dedup::dictionary(&store, &layer, &from, tail_chunk_size != 0).await?)
            };
            let parents = parents
                .iter()
                .map(|p| p.parse::<LayerRef>())
                .collect::<Result<Vec<_>, _>>()?;
            let tmp_root = home.join("tmp");
            std::fs::create_dir_all(&tmp_root)
                .with_context(|| format!("create {}", tmp_root.display()))?;
            let tmp = tempfile::tempdir_in(&tmp_root).context("create a build directory")?;
            let (meta_path, blob_path) = (tmp.path().join("meta.erofs"), tmp.path().join("blob"));
            let tails_path = tmp.path().join("tails");
            let tails = (tail_chunk_size != 0)
                .then(|| erofs_builder::TailsBlob::new(&tails_path, tail_chunk_size));
            let started = Instant::now();
            let stats = build_cmd::build_layer(
                &input,
                &source,
                &meta_path,
                &blob_path,
                timestamp,
                no_xattrs,
                cli.json,
                dedup.as_ref().map(|d| d.dict.clone()),
                first,
                tails,
                inline_max,
            )
            .await?;
            let built = started.elapsed().as_secs_f64();
            let (meta, own) = store
                .put_built_layer(
                    &meta_path,
                    &own_blobs(&blob_path, &tails_path, &stats),
                    compress,
                )
                .await
                .context("store the layer's meta image and blobs")?;
            // The layer's own blobs (device 1, and the tails blob on device 2), then the
            // stored blobs its meta image points into (its device table's order).
            let mut blobs: Vec<_> = own.iter().map(|p| p.blob_ref()).collect();
            if let Some(d) = &dedup {
                blobs.extend(stats.devices.iter().map(|&i| d.blobs[i].clone()));
            }
            let mut manifest = Manifest::new(
                layer.clone(),
                Some(meta.blob_ref()),
                blobs,
                input.describe(&source),
            );
            manifest.parents = parents;
            let outcome = store.push_manifest(&manifest).await?;
            let seconds = started.elapsed().as_secs_f64();
            if cli.json {
                let mut v = layer_stats_json(&meta_path, &blob_path, &stats);
                v["layer"] = serde_json::json!(layer.to_string());
                v["outcome"] = serde_json::json!(format!("{outcome:?}").to_lowercase());
                v["meta_digest"] = serde_json::json!(meta.digest.to_hex());
                v["meta_stored_bytes"] = serde_json::json!(meta.stored_size);
                v["blob_stored_bytes"] = serde_json::json!(own[0].stored_size);
                if let Some(put) = own.get(1) {
                    v["tails_stored_bytes"] = serde_json::json!(put.stored_size);
                }
                v["compression"] = serde_json::json!(compress.to_string());
                v["uploaded_bytes"] = serde_json::json!(std::iter::once(&meta)
                    .chain(&own)
                    .filter(|p| !p.existed)
                    .map(|p| p.stored_size)
                    .sum::<u64>());
                v["dedup_chunks"] = serde_json::json!(stats.dict_chunks);
                v["dedup_blobs"] = serde_json::json!(stats.devices.len());
                v["ordered_files"] = serde_json::json!(ordered_files);
                v["build_seconds"] = serde_json::json!(built);
                v["seconds"] = serde_json::json!(seconds);
                print_json(&v)?;
            } else {
                let stored = |p: &fs_cache::PutBlob| {
                    if p.is_compressed() {
                        format!(" ({} stored, zstd)", human(p.stored_size))
                    } else {
                        String::new()
                    }
                };
                let deduped = if stats.dict_chunks > 0 {
                    format!(
                        ", {} chunks in {} stored blob(s)",
                        stats.dict_chunks,
                        stats.devices.len()
                    )
                } else {
                    String::new()
                };
                let tails = match (&stats.tails, own.get(1)) {
                    (Some(t), Some(put)) => format!(
                        " + tails {}{} ({} of {} tails stored, {} chunks)",
                        human(put.size),
                        stored(put),
                        t.unique_chunks,
                        t.chunks,
                        human(u64::from(t.chunk_size))
                    ),
                    _ => String::new(),
                };
                let tail_chunks = stats.tails.as_ref().map_or(0, |t| t.chunks);
                println!(
                    "{layer}: {outcome:?}; meta image {}{} + blob {}{} ({} of {} chunks stored{deduped}){tails} from {} files, in {:.2} s",
                    human(meta.size),
                    stored(&meta),
                    human(own[0].size),
                    stored(&own[0]),
                    stats.unique_chunks,
                    stats.chunks + tail_chunks + stats.dict_chunks,
                    stats.meta.files,
                    seconds
                );
            }
        }
        Command::Layer(LayerCmd::Push { manifest }) => {
            let bytes =
                std::fs::read(&manifest).with_context(|| format!("read {}", manifest.display()))?;
            #[derive(serde::Deserialize)]
            struct Named {
                layer: String,
            }
            let named: Named = serde_json::from_slice(&bytes)
                .with_context(|| format!("{} is not a layer manifest", manifest.display()))?;
            let r: LayerRef = named.layer.parse()?;
            let m = Manifest::parse(&r, &bytes)?;
            let outcome = store.push_manifest(&m).await?;
            if cli.json {
                print_json(
                    &serde_json::json!({"layer": r.to_string(), "outcome": format!("{outcome:?}").to_lowercase()}),
                )?;
            } else {
                println!("{r}: {outcome:?}");
            }
        }
        Command::Mkfs {
            image,
            source,
            input,
            blobdev: Some(blob),
            timestamp,
            no_xattrs,
        } => {
            let stats = build_cmd::build_layer(
                &input,
                &source,
                &image,
                &blob,
                timestamp,
                no_xattrs,
                cli.json,
                None,
                Vec::new(),
                None,
                0,
            )
            .await?;
            if cli.json {
                print_json(&layer_stats_json(&image, &blob, &stats))?;
            } else {
                println!(
                    "{}: meta image {}; {}: blob {} ({} chunks, {} stored, {} holes), digest {}",
                    image.display(),
                    human(stats.meta.image_bytes),
                    blob.display(),
                    human(stats.blob_bytes),
                    stats.chunks,
                    stats.unique_chunks,
                    stats.hole_chunks,
                    stats.blob_blake3_hex()
                );
            }
        }
        Command::Mkfs {
            image,
            source,
            input,
            blobdev: None,
            timestamp,
            no_xattrs,
        } => {
            let started = Instant::now();
            let stats =
                build_cmd::build_image(&input, &source, &image, timestamp, no_xattrs, cli.json)
                    .await?;
            let seconds = started.elapsed().as_secs_f64();
            let size = std::fs::metadata(&image).map(|m| m.len()).unwrap_or(0);
            if cli.json {
                print_json(&serde_json::json!({
                    "image": image.display().to_string(),
                    "image_bytes": size,
                    "seconds": seconds,
                    "inodes": stats.inodes,
                    "files": stats.files,
                    "dirs": stats.dirs,
                    "data_bytes": stats.data_bytes,
                }))?;
            } else {
                println!(
                    "{}: {} inodes ({} files, {} directories), {} of file data, image {} in {:.2} s",
                    image.display(),
                    stats.inodes,
                    stats.files,
                    stats.dirs,
                    human(stats.data_bytes),
                    human(size),
                    seconds
                );
            }
        }
        Command::Bd(cmd) => bd_cmd::run(cmd, &store, &cli.cache, &home, cli.json).await?,
        Command::Image(cmd) => image_cmd::run(cmd, &store, &home, cli.json).await?,
        Command::Layer(LayerCmd::Export(args)) => {
            image_cmd::export(args, &store, &home, cli.json).await?
        }
        Command::Daemon(_)
        | Command::FuseHolder { .. }
        | Command::Mount(_)
        | Command::Umount(_)
        | Command::Status(_)
        | Command::Warm(_)
        | Command::Sandbox(_)
        | Command::PackDiff(_)
        | Command::Sim(_)
        | Command::Api(_)
        | Command::Template(_) => {
            anyhow::bail!("internal: node commands are dispatched before the store is opened")
        }
        Command::Gc {
            grace,
            dry_run,
            abandoned_after,
        } => {
            let opts = GcOptions {
                grace,
                dry_run,
                abandoned_after,
            };
            let report = gc::collect(&store, opts).await?;
            if cli.json {
                print_json(&report)?;
            } else {
                println!(
                    "{} layers, {} blobs: {} referenced, {} kept as recent, {} {} ({} objects, {}); {} expired leases",
                    report.manifests,
                    report.blobs,
                    report.referenced,
                    report.kept_recent,
                    report.removed.len(),
                    if dry_run { "would be removed" } else { "removed" },
                    report.removed_objects,
                    human(report.removed_bytes),
                    report.expired_leases,
                );
                for k in &report.unrecognised {
                    println!("left alone (not a blob key): {k}");
                }
                let swept = if dry_run { "would be swept" } else { "swept" };
                for what in &report.abandoned_puts {
                    println!("abandoned put, {swept}: {what}");
                }
            }
        }
    }
    Ok(())
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Command::FuseHolder { run_dir } = &cli.command {
        // No runtime, no store: the holder is a small loop that only keeps descriptors.
        if let Err(e) = ublk_daemon::holder::run(run_dir) {
            eprintln!("strata fuse-holder: {e}");
            std::process::exit(1);
        }
        return;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("strata: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(run(cli));
    // Never wait for ever on blocking work left behind (a read of a sandbox's files stuck on
    // a mount whose FUSE workers have stopped, a call into a sandbox whose init is stopped):
    // a daemon that stops hands its mounts and sandboxes over, and the process exits.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    if let Err(e) = result {
        // A reader that went away (`strata ... | head`) is not an error worth a message.
        let broken_pipe = e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        });
        if broken_pipe {
            std::process::exit(141);
        }
        eprintln!("strata: {e:#}");
        std::process::exit(1);
    }
}
