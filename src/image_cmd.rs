//! OCI images in and out: `strata image import` (an OCI image layout or a `docker save`
//! archive → a stack of Strata layers) and `strata layer export` (a stack → an OCI image
//! layout, or one full EROFS image). The formats and checks are `oci_image`'s (crate docs).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use fs_cache::{LayerRef, Store};
use oci_image::export::{LayerCompression, LayoutOptions};
use oci_image::import::ImportOptions;

/// `strata image ...`
#[derive(clap::Subcommand, Debug)]
pub enum ImageCmd {
    /// Import an OCI image layout (a directory, or a tar of one) or a `docker save` archive
    /// as a stack of layers: image layer k (from the bottom, k < n) becomes
    /// KIND/NAME-k:VERSION, the top one KIND/NAME:VERSION, each recording the stack beneath
    /// it as its parents. Every blob is checked against its digest, and every layer tar
    /// against the config's diff_ids, before anything is pushed.
    Import(ImportArgs),
}

/// Arguments of `strata image import`.
#[derive(clap::Args, Debug)]
pub struct ImportArgs {
    /// The OCI image layout (directory or .tar, plain/gzip/zstd) or docker save archive.
    pub path: PathBuf,
    /// The name of the top layer, KIND/NAME:VERSION.
    #[arg(long)]
    pub name: String,
    /// One layer of the whole image (whiteouts applied across layers) instead of one per
    /// image layer.
    #[arg(long)]
    pub flatten: bool,
    /// The image to take when the layout holds several: its tag
    /// (org.opencontainers.image.ref.name, or a docker RepoTags entry).
    #[arg(long = "ref", value_name = "TAG")]
    pub reference: Option<String>,
    /// The platform to take from a manifest list, OS/ARCH[/VARIANT] [default: linux/amd64].
    #[arg(long)]
    pub platform: Option<String>,
    /// How the layers' blobs are stored: `zstd` (default), `zstd:LEVEL` or `none` (as
    /// `strata layer build --compress`).
    #[arg(long, default_value = "zstd")]
    pub compress: fs_cache::Compression,
    /// Files of at most this many bytes inline in each layer's meta image (as `strata layer
    /// build --inline-max`; default by the name's kind: 4095 for base and toolkit, else 0).
    #[arg(long, value_name = "BYTES", env = "STRATA_INLINE_MAX")]
    pub inline_max: Option<u64>,
}

/// Arguments of `strata layer export`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// The layers, lowest first; each one's parents (the stack beneath it) come along.
    #[arg(required = true)]
    pub refs: Vec<String>,
    /// Write an OCI image layout: a directory, or a tar of one if PATH ends in .tar.
    #[arg(long, value_name = "PATH", required_unless_present = "erofs")]
    pub oci: Option<PathBuf>,
    /// Write the whole stack, merged, as one full EROFS image (file data inline).
    #[arg(long, value_name = "FILE", conflicts_with = "oci")]
    pub erofs: Option<PathBuf>,
    /// Layer tar compression in the layout.
    #[arg(long, default_value = "gzip", value_parser = ["gzip", "zstd"])]
    pub compression: String,
    /// The tag in index.json (org.opencontainers.image.ref.name) [default: the top layer's
    /// VERSION].
    #[arg(long)]
    pub tag: Option<String>,
}

fn work_dir(home: &Path) -> Result<tempfile::TempDir> {
    let root = home.join("tmp");
    std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
    tempfile::tempdir_in(&root).context("create a work directory")
}

/// `strata image import`.
pub async fn run(cmd: ImageCmd, store: &Store, home: &Path, json: bool) -> Result<()> {
    let ImageCmd::Import(args) = cmd;
    let name: LayerRef = args.name.parse()?;
    let work = work_dir(home)?;
    let started = Instant::now();
    let (path, dir) = (args.path.clone(), work.path().to_path_buf());
    let opts = oci_image::OpenOptions::default()
        .reference(args.reference.clone())
        .platform(args.platform.clone())
        .temp_dir(Some(dir.clone()));
    let flatten = args.flatten;
    let inline_max =
        (args.inline_max).unwrap_or_else(|| crate::build_cmd::default_inline_max(name.kind));
    let (source, platform, built) = tokio::task::spawn_blocking(move || {
        let plan = oci_image::open_image(&path, &opts)?;
        let opts = ImportOptions::new(&dir)
            .flatten(flatten)
            .inline_max(inline_max);
        let built = oci_image::import::build_layers(&plan, &opts)?;
        Ok::<_, oci_image::Error>((plan.source.clone(), plan.platform.clone(), built))
    })
    .await
    .context("the import thread")?
    .with_context(|| format!("import {}", args.path.display()))?;
    let pushed = oci_image::store::push_stack(store, &built, &name, &source, args.compress).await?;
    let seconds = started.elapsed().as_secs_f64();
    let tar_bytes: u64 = built.iter().map(|b| b.tar_bytes).sum();
    if json {
        return crate::print_json(&serde_json::json!({
            "source": source,
            "platform": platform,
            "layers": pushed,
            "tar_bytes": tar_bytes,
            "seconds": seconds,
        }));
    }
    for p in &pushed {
        println!(
            "{}: {}; meta image {} + blob {}{}",
            p.layer,
            p.outcome,
            crate::human(p.meta_bytes),
            crate::human(p.blob_bytes),
            if p.parents.is_empty() {
                String::new()
            } else {
                format!(", on {}", p.parents.join(" "))
            }
        );
    }
    println!(
        "imported {} ({platform}, {} of layer tars) as {} layer(s) in {seconds:.2} s",
        source,
        crate::human(tar_bytes),
        pushed.len()
    );
    Ok(())
}

/// `strata layer export`.
pub async fn export(args: ExportArgs, store: &Store, home: &Path, json: bool) -> Result<()> {
    let refs = args
        .refs
        .iter()
        .map(|r| r.parse::<LayerRef>())
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let manifests = oci_image::store::resolve_stack(store, &refs).await?;
    let cache = fs_cache::chunk::ChunkCache::open(
        store.clone(),
        fs_cache::chunk::CacheConfig {
            memory_bytes: 64 << 20,
            ..Default::default()
        },
    )
    .await?;
    let layers = oci_image::store::open_layers(store, &cache, manifests).await?;
    let names: Vec<String> = layers
        .iter()
        .map(|l| l.manifest.layer.to_string())
        .collect();
    let top_version = refs.last().map(|r| r.version.clone()).unwrap_or_default();
    if let Some(out) = args.erofs.clone() {
        let work = work_dir(home)?;
        let dir = work.path().to_path_buf();
        let ls = layers.clone();
        let o = out.clone();
        let stats = tokio::task::spawn_blocking(move || {
            let ex: Vec<_> = ls.iter().map(|l| l.as_export()).collect();
            oci_image::export::write_flat_image(&ex, &o, &dir)
        })
        .await
        .context("the export thread")?
        .with_context(|| format!("export {}", out.display()))?;
        let seconds = started.elapsed().as_secs_f64();
        if json {
            return crate::print_json(&serde_json::json!({
                "erofs": out.display().to_string(),
                "layers": names,
                "image_bytes": stats.image_bytes,
                "inodes": stats.inodes,
                "files": stats.files,
                "data_bytes": stats.data_bytes,
                "seconds": seconds,
            }));
        }
        println!(
            "{}: {} inodes, {} of file data, image {} from {} in {seconds:.2} s",
            out.display(),
            stats.inodes,
            crate::human(stats.data_bytes),
            crate::human(stats.image_bytes),
            names.join(" ")
        );
        return Ok(());
    }
    let Some(out) = args.oci.clone() else {
        anyhow::bail!("give --oci PATH or --erofs FILE");
    };
    let compression: LayerCompression = args
        .compression
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))?;
    let opts =
        LayoutOptions::new(args.tag.as_deref().unwrap_or(&top_version)).compression(compression);
    let ls = layers.clone();
    let o = out.clone();
    let stats = tokio::task::spawn_blocking(move || {
        let ex: Vec<_> = ls.iter().map(|l| l.as_export()).collect();
        oci_image::export::write_layout(&ex, &o, &opts)
    })
    .await
    .context("the export thread")?
    .with_context(|| format!("export {}", out.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    if json {
        return crate::print_json(&serde_json::json!({
            "oci": out.display().to_string(),
            "manifest": stats.manifest,
            "layers": stats.layers,
            "seconds": seconds,
        }));
    }
    for l in &stats.layers {
        println!(
            "{}: {} entries, tar {} → {} {}",
            l.name,
            l.tar.entries,
            crate::human(l.tar_bytes),
            crate::human(l.size),
            l.digest
        );
    }
    println!(
        "{}: OCI image layout, manifest {}, {} layer(s) in {seconds:.2} s",
        out.display(),
        stats.manifest,
        stats.layers.len()
    );
    Ok(())
}
