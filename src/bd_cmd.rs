//! `strata bd create|serve|commit`: layered block devices (OverlayBD) for microVM disks.
//!
//! A device is a directory: a writable upper (overlaybd's `data` + `log`) and a descriptor
//! naming the stored block layer it sits on (see `ublk_daemon::bd`). `serve` exposes it as a
//! FUSE image file or as `/dev/ublkbN` until SIGTERM/SIGINT. Both survive the server: a
//! `serve --ublk` after a crash reattaches to the `/dev/ublkbN` the dead server left (ublk user
//! recovery), and `serve --fuse` keeps its FUSE connection in an fd holder (`strata
//! fuse-holder`, run in `<dir>/holder/`), so that after a crash the image file stays mounted,
//! its I/O waits, and the next `serve --fuse` takes the connection over. `commit` seals the
//! upper into a new layer and pushes it, its manifest naming the base as parent. Bases are
//! read lazily through the node's chunk cache.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use fs_cache::chunk::{CacheConfig, ChunkCache};
use fs_cache::{LayerRef, Store};
use serde::Serialize;
use ublk_daemon::bd;
use ublk_daemon::holder::HolderClient;

#[derive(clap::Subcommand, Debug)]
pub enum BdCommand {
    /// Create a device directory: an empty writable upper of --size bytes on top of --base
    /// (a stored block layer) or of nothing.
    Create {
        /// The device directory (created if missing; must not hold a device yet).
        upper: PathBuf,
        /// Device size, e.g. 10GiB (a multiple of 512; default: the base's size).
        #[arg(long, value_parser = crate::cache_cmd::parse_size)]
        size: Option<u64>,
        /// The stored block layer to stack on, KIND/NAME:VERSION (its parents come along).
        #[arg(long)]
        base: Option<String>,
    },
    /// Serve a device until SIGTERM/SIGINT, then flush it and take it down: as an image file
    /// (--fuse FILE, usable by losetup, mkfs, file-backed mounts) or as /dev/ublkbN (--ublk).
    /// Either survives a crash of the server: the next serve takes over the same image file
    /// (kept open by an fd holder) or reattaches the same /dev/ublkbN, and the requests that
    /// waited meanwhile are served.
    #[command(group(clap::ArgGroup::new("frontend").required(true).args(["fuse", "ublk"])))]
    Serve {
        /// The device directory.
        upper: PathBuf,
        /// Mount the device over this regular file (created if missing).
        #[arg(long)]
        fuse: Option<PathBuf>,
        /// Expose the device as /dev/ublkbN (needs the kernel's ublk driver).
        #[arg(long)]
        ublk: bool,
        /// ublk hardware queues.
        #[arg(long, default_value_t = 2)]
        queues: u16,
        /// ublk requests in flight per queue.
        #[arg(long, default_value_t = 64)]
        depth: u16,
        /// Require reattaching to the /dev/ublkbN a server of this directory left when it died
        /// (recorded in strata-bd.ublk.json); fail rather than add a new device. Without it,
        /// serve reattaches when it can and adds a new device otherwise.
        // (`conflicts_with = "fuse"`, not `requires = "ublk"`: a flag's default counts as
        // present for `requires`; the frontend group makes "not --fuse" mean --ublk.)
        #[arg(long, conflicts_with_all = ["fuse", "new_device"])]
        recover: bool,
        /// Never reattach: delete the ublk device a dead server of this directory left
        /// (requests it holds fail) and add a new one. Also ignores an unreadable record.
        #[arg(long, conflicts_with = "fuse")]
        new_device: bool,
        /// FUSE request threads.
        #[arg(long, default_value_t = 4)]
        threads: usize,
    },
    /// Seal a device's upper (the device must not be served) into a block layer and push it
    /// as KIND/NAME:VERSION on top of the device's base.
    Commit {
        /// The device directory.
        upper: PathBuf,
        #[arg(long)]
        name: String,
    },
}

#[derive(Serialize)]
struct Served {
    upper: String,
    size: u64,
    image: Option<String>,
    ublk_device: Option<String>,
    ublk_id: Option<u32>,
    /// Whether the ublk device was reattached (left by a server that died) rather than added.
    ublk_recovered: Option<bool>,
    /// Whether the image file's FUSE connection was taken over from a server that died
    /// (kept by the fd holder) rather than mounted anew.
    fuse_resumed: Option<bool>,
}

#[derive(Serialize)]
struct Committed {
    layer: String,
    parent: Option<String>,
    blob: String,
    size: u64,
    layer_id: String,
}

fn parse_ref(s: &str) -> Result<LayerRef> {
    s.parse::<LayerRef>()
        .with_context(|| format!("{s:?} is not a layer reference (KIND/NAME:VERSION)"))
}

use crate::print_json;

/// The chunk cache a device reads its base through: the node's (`$STRATA_HOME/cache`, shared
/// with other strata commands, one process at a time) when there is a base, and a small
/// memory-only one when there is none (nothing is read from the store then).
async fn cache_for(
    base: Option<&LayerRef>,
    store: &Store,
    opts: &crate::cache_cmd::CacheOpts,
    home: &Path,
) -> Result<ChunkCache> {
    match base {
        Some(_) => crate::cache_cmd::open(store.clone(), opts, home).await,
        None => ChunkCache::open(
            store.clone(),
            CacheConfig {
                memory_bytes: 16 << 20,
                ..CacheConfig::default()
            },
        )
        .await
        .context("open a memory chunk cache"),
    }
}

/// The fd holder of the device in `dir` (`<dir>/holder/`), started if none runs: this very
/// binary as `strata fuse-holder`. `None` (with a warning) if it cannot be had: the image file
/// then does not survive this process.
fn fuse_holder(dir: &Path) -> Option<Arc<HolderClient>> {
    let start = || -> Result<HolderClient> {
        let run_dir = bd::fuse::holder_run_dir(dir)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&run_dir)
            .with_context(|| format!("create {}", run_dir.display()))?;
        let exe = std::env::current_exe().context("find the strata binary (for its fd holder)")?;
        let cmd = [exe.into_os_string(), "fuse-holder".into()];
        HolderClient::connect_or_spawn(&run_dir, &cmd)
            .with_context(|| format!("start the fd holder in {}", run_dir.display()))
    };
    match start() {
        Ok(h) => Some(Arc::new(h)),
        Err(e) => {
            tracing::warn!("{e:#}: the image file will not survive this process");
            None
        }
    }
}

/// Serve `dev` over `file`: take over the connection the fd holder keeps for it (a server of
/// this directory died while serving `file`: the mount is still there and its I/O waits), or
/// mount anew, the connection handed to the holder.
fn serve_image(dev: &bd::OpenDevice, file: &Path, cfg: &bd::BdFuseConfig) -> Result<bd::BdFuse> {
    let holder = fuse_holder(dev.dir());
    if let Some(h) = &holder {
        match bd::fuse::kept_connection(h, &dev.device, file) {
            Ok(Some((fd, saved))) => {
                match bd::fuse::resume_fuse(dev.device.clone(), fd, &saved, cfg, holder.clone()) {
                    Ok(f) => {
                        tracing::info!(
                            image = %f.path().display(),
                            resend = f.negotiated().has_resend(),
                            "took over the image file from the server before"
                        );
                        if !f.negotiated().has_resend() {
                            tracing::warn!(
                                "this kernel has no FUSE_NOTIFY_RESEND (Linux < 6.9): requests \
                                 the dead server had read stay unanswered"
                            );
                        }
                        return Ok(f);
                    }
                    // Mounting anew lets the kept connection go first.
                    Err(e) => {
                        tracing::error!("taking over the image file failed: {e}; mounting anew")
                    }
                }
            }
            Ok(None) => {}
            Err(e) => tracing::error!("{e}; mounting anew"),
        }
    }
    Ok(bd::serve_fuse_with(dev.device.clone(), file, cfg, holder)?)
}

/// Run one `strata bd` command against `store`; bases are read through the node's chunk
/// cache (configured by `cache_opts`, under `home`), opened only when a command needs it.
pub async fn run(
    cmd: BdCommand,
    store: &Store,
    cache_opts: &crate::cache_cmd::CacheOpts,
    home: &Path,
    json: bool,
) -> Result<()> {
    match cmd {
        BdCommand::Create { upper, size, base } => {
            let base = base.as_deref().map(parse_ref).transpose()?;
            let cache = cache_for(base.as_ref(), store, cache_opts, home).await?;
            let created = bd::create(&upper, size, base.as_ref(), store, &cache).await;
            cache.flush().await?;
            let d = created.with_context(|| format!("create device {}", upper.display()))?;
            if json {
                print_json(&d)?;
            } else {
                println!(
                    "{}: {} bytes on {}",
                    upper.display(),
                    d.size,
                    d.base
                        .as_ref()
                        .map_or_else(|| "nothing".to_owned(), |b| b.to_string())
                );
            }
        }
        BdCommand::Serve {
            upper,
            fuse,
            ublk,
            queues,
            depth,
            recover,
            new_device,
            threads,
        } => {
            // Handlers first: a signal during setup still ends in a clean shutdown.
            let stop = bd::StopSignal::install()?;
            let descriptor = bd::Descriptor::read(&upper)
                .with_context(|| format!("open device {}", upper.display()))?;
            let cache = cache_for(descriptor.base.as_ref(), store, cache_opts, home).await?;
            let dev = bd::open(&upper, store, &cache)
                .await
                .with_context(|| format!("open device {}", upper.display()))?;
            let mut served = Served {
                upper: upper.display().to_string(),
                size: dev.device.size(),
                image: None,
                ublk_device: None,
                ublk_id: None,
                ublk_recovered: None,
                fuse_resumed: None,
            };
            enum Frontend {
                Fuse(bd::BdFuse, bd::OpenDevice),
                Ublk(bd::BdUblk),
            }
            let frontend = match (fuse, ublk) {
                (Some(file), _) => {
                    // The kernel may still hold requests for this upper on a ublk device whose
                    // server died: they must reach the same upper, through ublk, first.
                    let pending = bd::pending_ublk_device(&dev).with_context(|| {
                        format!(
                            "{}: is a ublk device still waiting for it? (serve it with --ublk \
                             --new-device to replace an unreadable record)",
                            upper.display()
                        )
                    })?;
                    if let Some(id) = pending {
                        anyhow::bail!(
                            "{}: /dev/ublkb{id} still belongs to this device and waits for its \
                             server; serve it with --ublk (or --ublk --new-device to drop it)",
                            upper.display()
                        );
                    }
                    let mut cfg = bd::BdFuseConfig::default();
                    cfg.threads = threads;
                    let f = serve_image(&dev, &file, &cfg).with_context(|| {
                        format!("serve {} over {}", upper.display(), file.display())
                    })?;
                    served.image = Some(f.path().display().to_string());
                    served.fuse_resumed = Some(f.resumed());
                    Frontend::Fuse(f, dev)
                }
                (None, _) => {
                    debug_assert!(ublk, "clap requires --fuse or --ublk");
                    // Likewise, the kernel may hold requests for this upper on an image file
                    // whose server died, kept by the fd holder.
                    if let Some(image) = bd::fuse::kept_image(dev.dir()) {
                        anyhow::bail!(
                            "{}: the image file {} still belongs to this device and waits for \
                             its server; serve it with --fuse {} first",
                            upper.display(),
                            image.display(),
                            image.display()
                        );
                    }
                    let mut cfg = bd::UblkConfig::default();
                    cfg.queues = queues;
                    cfg.depth = depth;
                    cfg.recovery = match (recover, new_device) {
                        (true, _) => bd::Recovery::Require,
                        (_, true) => bd::Recovery::Fresh,
                        _ => bd::Recovery::Auto,
                    };
                    // The served device keeps the directory locked until it is stopped.
                    let u = bd::serve_ublk(dev, &cfg)
                        .with_context(|| format!("serve {} through ublk", upper.display()))?;
                    if u.recovered() {
                        tracing::info!(device = %u.path().display(), "reattached");
                    }
                    served.ublk_device = Some(u.path().display().to_string());
                    served.ublk_id = Some(u.dev_id());
                    served.ublk_recovered = Some(u.recovered());
                    Frontend::Ublk(u)
                }
            };
            if json {
                print_json(&served)?;
            } else {
                let at = served.image.clone().or(served.ublk_device.clone());
                println!("{}", at.unwrap_or_default());
                std::io::stdout().flush()?;
            }
            let sig = stop.wait().await;
            tracing::info!(signal = sig, "stopping");
            match frontend {
                Frontend::Fuse(f, dev) => {
                    f.unmount()
                        .context("unmount the image file and flush the device")?;
                    drop(dev);
                }
                Frontend::Ublk(u) => u
                    .stop()
                    .context("remove the ublk device and flush the device")?,
            }
            cache.flush().await?;
        }
        BdCommand::Commit { upper, name } => {
            let name = parse_ref(&name)?;
            let pushed = bd::commit(&upper, store, &name)
                .await
                .with_context(|| format!("commit device {} as {name}", upper.display()))?;
            let c = Committed {
                layer: pushed.manifest.layer.to_string(),
                parent: pushed.manifest.parents.first().map(|p| p.to_string()),
                blob: pushed.blob.digest.to_hex(),
                size: pushed.blob.size,
                layer_id: pushed.id.to_hex(),
            };
            if json {
                print_json(&c)?;
            } else {
                println!(
                    "{} ({} bytes, blob {}) on {}",
                    c.layer,
                    c.size,
                    c.blob,
                    c.parent.as_deref().unwrap_or("nothing")
                );
            }
        }
    }
    Ok(())
}
