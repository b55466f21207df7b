//! Building images and layers from the command line: what the source is (a directory, a layer
//! tar stream, an overlayfs upper), and a progress line on a terminal while the builder runs.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use erofs_builder::{Phase, Progress, ProgressSnapshot, Source};

/// The chunk size of every Strata layer: the chunk cache's, so that one EROFS chunk is one
/// cache chunk.
pub const LAYER_CHUNK_SIZE: u64 = fs_cache::chunk::CHUNK_SIZE;

/// How `strata mkfs` and `strata layer build` read SOURCE, and how they report.
#[derive(clap::Args, Debug, Clone)]
pub struct InputArgs {
    /// SOURCE is an OCI/Docker layer tar stream (plain, gzip or zstd, detected; `-` reads
    /// standard input) instead of a directory. OCI whiteouts become overlayfs whiteouts.
    #[arg(long, conflicts_with = "upper")]
    pub tar: bool,
    /// SOURCE is an overlayfs upper directory: its whiteouts and opaque directories are kept,
    /// the kernel's bookkeeping xattrs (origin, impure, ...) are dropped.
    #[arg(long)]
    pub upper: bool,
    /// Chunk size of a lazy layer's data blob. Strata layers use 262144 (256 KiB, the chunk
    /// cache's chunk) and nothing else; the flag exists for `mkfs.erofs`-style invocations.
    #[arg(long, value_name = "BYTES")]
    pub chunk_size: Option<u64>,
    /// No progress line (it is drawn on a terminal only, never with --json).
    #[arg(long, short)]
    pub quiet: bool,
}

impl InputArgs {
    /// The builder's source for `path`.
    pub fn source(&self, path: &Path) -> Result<Source> {
        Ok(if self.tar && path == Path::new("-") {
            Source::tar(std::io::stdin())
        } else if self.tar {
            Source::tar_file(path).with_context(|| format!("open the tar {}", path.display()))?
        } else if self.upper {
            Source::OverlayUpper(path.to_path_buf())
        } else {
            Source::Dir(path.to_path_buf())
        })
    }

    /// How the manifest records where a layer came from: `dir:`, `tar:` or `upper:` and the
    /// absolute path (`tar:-` for standard input).
    pub fn describe(&self, path: &Path) -> String {
        let kind = match (self.tar, self.upper) {
            (true, _) => "tar",
            (_, true) => "upper",
            _ => "dir",
        };
        if path == Path::new("-") {
            return format!("{kind}:-");
        }
        let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        format!("{kind}:{}", abs.display())
    }

    /// Refuse chunk sizes other than the cache's (module docs).
    pub fn check_chunk_size(&self) -> Result<()> {
        match self.chunk_size {
            None | Some(LAYER_CHUNK_SIZE) => Ok(()),
            Some(n) => anyhow::bail!(
                "--chunk-size {n}: Strata layers use {LAYER_CHUNK_SIZE}-byte chunks (the chunk \
                 cache's chunk size), so that each EROFS chunk is one cache chunk"
            ),
        }
    }

    /// Whether to draw a progress line.
    pub fn show_progress(&self, json: bool) -> bool {
        !self.quiet && !json && std::io::stderr().is_terminal()
    }
}

/// Run a blocking build on a blocking thread; while it runs, redraw a progress line on
/// standard error every 200 ms when `show`.
pub async fn with_progress<T: Send + 'static>(
    progress: Progress,
    show: bool,
    what: String,
    build: impl FnOnce() -> erofs_builder::Result<T> + Send + 'static,
) -> Result<T> {
    let started = Instant::now();
    let mut task = tokio::task::spawn_blocking(build);
    let result = loop {
        tokio::select! {
            r = &mut task => break r,
            _ = tokio::time::sleep(Duration::from_millis(200)), if show => {
                draw(&progress.snapshot(), started.elapsed());
            }
        }
    };
    if show {
        eprint!("\r\x1b[K");
        let _ = std::io::stderr().flush();
    }
    result
        .context("the builder stopped")?
        .with_context(|| what.clone())
}

fn draw(s: &ProgressSnapshot, elapsed: Duration) {
    let secs = elapsed.as_secs_f64().max(0.001);
    let line = match s.phase {
        Phase::Scan => format!(
            "scanning: {} entries, {}",
            s.scanned_entries,
            crate::human(s.scanned_bytes)
        ),
        Phase::Write => format!(
            "writing: {}/{} files, {}/{} ({}/s)",
            s.files,
            s.total_files,
            crate::human(s.bytes),
            crate::human(s.total_bytes),
            crate::human((s.bytes as f64 / secs) as u64)
        ),
        _ => format!("finishing: {} files, {}", s.files, crate::human(s.bytes)),
    };
    eprint!("\r\x1b[K{line}");
    let _ = std::io::stderr().flush();
}

/// `layer build --inline-max`'s default for a layer of `kind`. Small files inline in the
/// meta image make a cold node's first reads of them free (`bench/README.md`, "peers" and
/// "locality": a 10% read of minbase 0.132 → 0.118 s from a local store, its `usr/share`'s
/// first command over S3 1.61 → 1.05 s), but every layer then stores its own copy:
/// 100 workspaces sharing one tree stored 1.7× as much (`dedup`), ten toolkit versions 6%
/// more. So base and toolkit layers inline, workspaces and snapshots do not.
pub fn default_inline_max(kind: fs_cache::layer::LayerKind) -> u64 {
    use fs_cache::layer::LayerKind;
    match kind {
        LayerKind::Base | LayerKind::Toolkit => erofs_builder::layer::INLINE_MAX,
        LayerKind::Workspace | LayerKind::Snapshot => 0,
    }
}

/// Build a lazy layer (meta image + data blob, and a tails blob when `tails`) from `source`,
/// against `dictionary` if given (`crate::dedup`), the files `first` laid out first
/// (`crate::order`), files of at most `inline_max` bytes inline in the meta image.
#[allow(clippy::too_many_arguments)]
pub async fn build_layer(
    input: &InputArgs,
    source: &Path,
    meta: &Path,
    blob: &Path,
    timestamp: Option<i64>,
    no_xattrs: bool,
    json: bool,
    dictionary: Option<std::sync::Arc<erofs_builder::ChunkDictionary>>,
    first: Vec<PathBuf>,
    tails: Option<erofs_builder::TailsBlob>,
    inline_max: u64,
) -> Result<erofs_builder::LayerStats> {
    input.check_chunk_size()?;
    let progress = Progress::new();
    let mut opts = erofs_builder::LayerOptions::default();
    opts.dictionary = dictionary;
    opts.tails = tails;
    opts.inline_max = inline_max;
    opts.first = first;
    opts.build.epoch = timestamp.map(|t| (t, 0));
    opts.build.xattrs = !no_xattrs;
    opts.build.progress = Some(progress.clone());
    let src = input.source(source)?;
    let (m, b): (PathBuf, PathBuf) = (meta.to_owned(), blob.to_owned());
    with_progress(
        progress,
        input.show_progress(json),
        format!("build a layer from {}", source.display()),
        move || erofs_builder::build_layer_from(src, &m, &b, &opts),
    )
    .await
}

/// Build a full image from `source`.
pub async fn build_image(
    input: &InputArgs,
    source: &Path,
    image: &Path,
    timestamp: Option<i64>,
    no_xattrs: bool,
    json: bool,
) -> Result<erofs_builder::BuildStats> {
    if input.chunk_size.is_some() {
        anyhow::bail!("--chunk-size applies to lazy layers only (with --blobdev)");
    }
    let progress = Progress::new();
    let mut opts = erofs_builder::BuildOptions::default();
    opts.epoch = timestamp.map(|t| (t, 0));
    opts.xattrs = !no_xattrs;
    opts.progress = Some(progress.clone());
    let src = input.source(source)?;
    let out = image.to_owned();
    with_progress(
        progress,
        input.show_progress(json),
        format!("build {} from {}", image.display(), source.display()),
        move || erofs_builder::build_image_from(src, &out, &opts),
    )
    .await
}
