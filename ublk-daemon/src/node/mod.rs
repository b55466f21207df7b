//! # The node daemon: lazy layer mounts over the chunk cache
//!
//! One [`Node`] runs per machine (`strata daemon`). It owns the node's
//! [`ChunkCache`], the FUSE blob filesystem ([`crate::blobfs`]) at `<run-dir>/blobs`, the
//! kernel mounts of layers, and the local API socket ([`server`], protocol in [`proto`]).
//! The full description (protocol, state file, mount layout, restart rules) is in
//! `ublk-daemon/docs/daemon.md`.
//!
//! ## Mount layout
//! ```text
//! <run-dir>/                    0700, root
//!   strata.pid                  flock(LOCK_EX) held by the running daemon; holds its pid
//!   strata.sock                 the API socket, 0600
//!   state.json                  persistent state (see [`state`])
//!   blobs/                      FUSE: one read-only file per data blob, <hex digest>
//!   layers/<id>/meta.erofs      the layer's meta image, fetched whole and verified
//!   layers/<id>/mnt/            EROFS: mount(meta.erofs, device=<run-dir>/blobs/<blob>), ro
//! <mountpoint>                  bind of layers/<id>/mnt (one layer, no upper), or overlay
//!                               (lowerdir = layers, last REF first; upperdir/workdir if given)
//! ```
//! A layer's `<id>` is the hex blake3 digest of its meta image, which names its data blobs by
//! digest: two references to the same content share one mount.
//!
//! ## Invariants
//! - A layer's EROFS is mounted exactly while it is pinned (`register`) or used by a user
//!   mount; it is mounted once per node whatever the number of users.
//! - A user mount holds one use of each of its layers from its mount(2) until its umount.
//! - A blob file exists in the FUSE mount while a mounted layer names it.
//! - Every change is in `state.json` before it is acknowledged; mounts are taken down in
//!   reverse: user mounts, layer mounts, then the FUSE mount.
//! - At start, every mount left by an earlier daemon on this run directory (the FUSE mount,
//!   layer mounts, user mounts stacked on them) is detached before anything is mounted.

pub mod client;
pub mod proto;
pub mod server;
pub mod state;
pub mod sys;

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fs_cache::chunk::{CacheConfig, ChunkCache};
use fs_cache::{BlobRef, Digest, LayerRef, Store};
use tokio::sync::Mutex;

use crate::blobfs::{BlobFs, BlobFsConfig, SavedConnection, HOLDER_ENTRY};
use crate::holder::HolderClient;
use proto::{ApiError, ErrorKind, LayerInfo, MountInfo, Pong, Request, Status, WarmInfo};
use state::{LayerState, MountState, State};

/// The API socket of the node whose run directory is `run_dir`.
pub fn socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join("strata.sock")
}

/// The default [`NodeConfig::layer_readahead`]: eight of the blob mount's 1 MiB reads in
/// flight for a sequential reader (`cargo bench -p bench --bench lazy_read`).
pub const DEFAULT_LAYER_READAHEAD: u64 = 8 << 20;

/// How often the node lets go of level-2 holds left by an earlier daemon whose FUSE
/// connection has gone (see `try_passthrough`).
const STALE_HOLD_CHECK: std::time::Duration = std::time::Duration::from_secs(60);

/// How a node is set up.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Where the socket, state, FUSE mount and layer mounts live (e.g. `/run/strata`).
    pub run_dir: PathBuf,
    /// The store URL (reported by `ping`, recorded in the state file).
    pub store_url: String,
    /// The chunk cache's configuration.
    pub cache: CacheConfig,
    /// FUSE worker threads.
    pub fuse_threads: usize,
    /// Largest FUSE read the kernel is asked to send.
    pub max_read: u32,
    /// Ask the kernel for FUSE passthrough on the blob mount (on by default). A layer whose
    /// blobs are all in level 2 when it is mounted then reads them straight from the level-2
    /// files (see [`Node`]'s read path in `docs/daemon.md`).
    pub passthrough: bool,
    /// Readahead window of each layer's EROFS mount (the kernel's default for a file-backed
    /// mount is 128 KiB: one small FUSE request at a time for a sequential reader; 0 keeps
    /// the kernel's).
    pub layer_readahead: u64,
    /// The command that starts the fd holder (`crate::holder`): program and arguments, to
    /// which `--run-dir DIR` is appended (`strata` runs itself as `strata fuse-holder`).
    /// Empty: no holder, and the mounts die with the daemon.
    pub holder_command: Vec<std::ffi::OsString>,
    /// How long to wait for the run directory's lock when another daemon holds it (a
    /// takeover waits for the old daemon to exit); zero fails at once.
    pub lock_wait: std::time::Duration,
}

impl NodeConfig {
    /// A node over `cache`, with the cache's blob-level readahead turned off: the kernel
    /// already reads ahead within each file it reads through EROFS, while readahead in the
    /// blob runs past the end of the file into unrelated files' chunks (measured on a 96 MiB
    /// tree: a 10% read fetched 2.5x its bytes with 1 MiB of blob readahead, 1.65x without,
    /// and a whole-tree read was faster without).
    pub fn new(run_dir: PathBuf, store_url: String, mut cache: CacheConfig) -> Self {
        cache.readahead_bytes = 0;
        Self {
            run_dir,
            store_url,
            cache,
            fuse_threads: 8,
            max_read: crate::blobfs::DEFAULT_MAX_READ,
            passthrough: true,
            layer_readahead: DEFAULT_LAYER_READAHEAD,
            holder_command: Vec::new(),
            lock_wait: std::time::Duration::ZERO,
        }
    }
}

struct Inner {
    state: State,
    blobfs: Option<BlobFs>,
    /// Layers whose EROFS is mounted now, with how many of their blobs that mount reads in
    /// FUSE passthrough mode.
    active: HashMap<String, u32>,
}

/// The running node (see the module docs).
pub struct Node {
    config: NodeConfig,
    store: Store,
    cache: Arc<ChunkCache>,
    inner: Mutex<Inner>,
    stopping: AtomicBool,
    /// The fd holder keeping the blob mount's connection (none: the mounts die with us).
    holder: Option<Arc<HolderClient>>,
    /// Every request but `handover` holds it shared; a handover takes it exclusively, so it
    /// waits for the requests in flight.
    gate: tokio::sync::RwLock<()>,
    /// Set once a handover is complete (the connection that asked has its answer).
    handed_over: AtomicBool,
    handover_done: tokio::sync::Notify,
    /// Holds the run directory's flock for the node's lifetime.
    _lock: std::fs::File,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("run_dir", &self.config.run_dir)
            .field("store", &self.config.store_url)
            .finish()
    }
}

type Result<T, E = ApiError> = std::result::Result<T, E>;

fn internal(what: impl std::fmt::Display, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorKind::Internal, format!("{what}: {e}"))
}

/// Run blocking system calls (mount(2) may call back into our own FUSE threads).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| internal("a mount task stopped", e))?
}

/// Take the run directory's lock (`strata.pid`), waiting up to `wait` for it, or say which
/// daemon holds it.
fn lock_run_dir(run_dir: &Path, wait: std::time::Duration) -> Result<std::fs::File> {
    let path = run_dir.join("strata.pid");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| internal(format!("open {}", path.display()), e))?;
    let deadline = std::time::Instant::now() + wait;
    let locked = loop {
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Err(rustix::io::Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => break other,
        }
    };
    if let Err(e) = locked {
        let pid = std::fs::read_to_string(&path).unwrap_or_default();
        return Err(ApiError::new(
            ErrorKind::Internal,
            format!(
                "another strata daemon (pid {}) runs on {}: {e}",
                pid.trim(),
                run_dir.display()
            ),
        ));
    }
    f.set_len(0)
        .and_then(|()| writeln!(f, "{}", std::process::id()))
        .map_err(|e| internal(format!("write {}", path.display()), e))?;
    Ok(f)
}

/// Check what the node needs before touching anything: root, and the filesystems.
pub fn check_environment() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        return Err(ApiError::new(
            ErrorKind::NotRoot,
            "the strata daemon mounts filesystems and must run as root",
        ));
    }
    for fs in ["fuse", "erofs"] {
        if !sys::kernel_has(fs) {
            return Err(ApiError::new(
                ErrorKind::KernelUnsupported,
                format!("this kernel has no {fs} filesystem (not in /proc/filesystems; try `modprobe {fs}`)"),
            ));
        }
    }
    Ok(())
}

/// Make the machine ready for the node as an init system would at boot, and say what is
/// missing and what it costs, one line each: mounts fusectl at `/sys/fs/fuse/connections`
/// when it is not mounted (FUSE passthrough holds its level-2 pins by a connection
/// directory), and checks for overlayfs.
pub fn prepare_machine() -> Vec<String> {
    let mut notes = Vec::new();
    let conns = Path::new("/sys/fs/fuse/connections");
    let mounted = sys::mounts()
        .map(|m| m.iter().any(|e| e.fstype == "fusectl"))
        .unwrap_or(false);
    if !mounted {
        if !sys::kernel_has("fusectl") || !conns.is_dir() {
            notes.push(
                "no fusectl in this kernel: warm layers are read through the daemon, not in \
                 FUSE passthrough"
                    .to_owned(),
            );
        } else {
            match rustix::mount::mount(
                "fusectl",
                conns,
                "fusectl",
                rustix::mount::MountFlags::empty(),
                None::<&std::ffi::CStr>,
            ) {
                Ok(()) => tracing::info!("mounted fusectl at {}", conns.display()),
                Err(e) => notes.push(format!(
                    "could not mount fusectl at {}: {e}: warm layers are read through the \
                     daemon, not in FUSE passthrough",
                    conns.display()
                )),
            }
        }
    }
    if !sys::kernel_has("overlay") {
        notes.push(
            "no overlay filesystem in this kernel: only single-layer read-only mounts".to_owned(),
        );
    }
    notes
}

/// What the fd holder kept of an earlier daemon's blob mount, if it is the live FUSE mount
/// at `<run-dir>/blobs` and was initialised: the connection and what was saved with it.
/// Everything else the holder listed is closed here (our copies only).
fn kept_connection(
    holder: &HolderClient,
    run_dir: &Path,
) -> Option<(std::os::fd::OwnedFd, SavedConnection)> {
    let held = match holder.list() {
        Ok(h) => h,
        Err(e) => {
            tracing::error!("asking the fd holder what it keeps: {e}");
            return None;
        }
    };
    let blobs = run_dir.join("blobs");
    let entry = held.into_iter().find(|h| h.name == HOLDER_ENTRY)?;
    let Some(saved) = SavedConnection::from_json(&entry.meta) else {
        tracing::error!(
            "the fd holder's blob-mount record does not parse: {:?}",
            entry.meta
        );
        return None;
    };
    if saved.mountpoint != blobs || saved.negotiated.is_none() {
        tracing::warn!(
            "the fd holder's blob mount was never initialised, or is not {}",
            blobs.display()
        );
        return None;
    }
    let live = crate::fusemount::mount_dev(&blobs);
    if live.is_none() || live != saved.dev {
        tracing::warn!(
            "the fd holder's blob mount (device {:?}) is not the one mounted at {} ({live:?})",
            saved.dev,
            blobs.display()
        );
        return None;
    }
    Some((entry.fd, saved))
}

impl Node {
    /// Start a node: lock the run directory, then either take over the mounts of the daemon
    /// before it (the fd holder kept its FUSE connection: nothing is unmounted, and readers
    /// never see an error) or clean up after it (detach what it left) and mount the FUSE blob
    /// filesystem anew; then restore the layers and mounts of the state file.
    pub async fn start(config: NodeConfig, store: Store) -> Result<Arc<Node>> {
        check_environment()?;
        for note in prepare_machine() {
            tracing::warn!("{note}");
        }
        let run_dir = &config.run_dir;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(run_dir.join("layers"))
            .map_err(|e| internal(format!("create {}", run_dir.display()), e))?;
        let run_dir = std::fs::canonicalize(run_dir)
            .map_err(|e| internal(format!("resolve {}", run_dir.display()), e))?;
        std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| internal(format!("chmod {}", run_dir.display()), e))?;
        let config = NodeConfig {
            run_dir: run_dir.clone(),
            ..config
        };
        let lock = {
            let (rd, wait) = (run_dir.clone(), config.lock_wait);
            blocking(move || lock_run_dir(&rd, wait)).await?
        };

        let state_path = run_dir.join("state.json");
        let previous = match State::load(&state_path) {
            Ok(s) => s,
            Err(e) => {
                let aside = run_dir.join("state.json.bad");
                tracing::error!("{e}; set aside as {}; starting empty", aside.display());
                let _ = std::fs::rename(&state_path, &aside);
                None
            }
        };
        if let Some(prev) = &previous {
            if prev.store != config.store_url {
                return Err(ApiError::new(
                    ErrorKind::BadRequest,
                    format!(
                        "{} holds the mounts of a daemon that served store {}, not {}: start \
                         the daemon with --store {} (or stop it cleanly first)",
                        run_dir.display(),
                        prev.store,
                        config.store_url,
                        prev.store
                    ),
                ));
            }
        }

        let holder = if config.holder_command.is_empty() {
            tracing::warn!("no fd holder configured: the mounts will not survive this daemon");
            None
        } else {
            let (rd, cmd) = (run_dir.clone(), config.holder_command.clone());
            match blocking(move || {
                HolderClient::connect_or_spawn(&rd, &cmd)
                    .map_err(|e| internal("start the fd holder", e))
            })
            .await
            {
                Ok(h) => Some(Arc::new(h)),
                Err(e) => {
                    tracing::error!("{e}: the mounts will not survive this daemon");
                    None
                }
            }
        };
        let kept = match (&holder, &previous) {
            (Some(h), Some(_)) => kept_connection(h, &run_dir),
            _ => None,
        };

        let cache = Arc::new(
            ChunkCache::open(store.clone(), config.cache.clone())
                .await
                .map_err(|e| ApiError::from_store("open the chunk cache", &e))?,
        );
        let blobs_dir = run_dir.join("blobs");
        let mut fs_config = BlobFsConfig::new(blobs_dir.clone());
        fs_config.threads = config.fuse_threads;
        fs_config.max_read = config.max_read;
        fs_config.passthrough = config.passthrough;

        let mut resumed = None;
        if let (Some((dev, saved)), Some(prev)) = (kept, &previous) {
            // Keep what the state names; detach what the old daemon made but never recorded
            // (it died between mount(2) and saving): the FUSE mount, listed layers' EROFS
            // mounts, recorded user mounts stay.
            let keep_layers: std::collections::HashSet<PathBuf> = prev
                .layers
                .keys()
                .map(|id| run_dir.join("layers").join(id).join("mnt"))
                .collect();
            let keep_mounts: std::collections::HashSet<PathBuf> =
                prev.mounts.keys().cloned().collect();
            let (rd, bd) = (run_dir.clone(), blobs_dir.clone());
            let detached = blocking(move || {
                sys::detach_ours_except(&rd, |m| {
                    m.mount_point == bd
                        || keep_layers.contains(&m.mount_point)
                        || keep_mounts.contains(&m.mount_point)
                })
                .map_err(|e| internal("clean up unrecorded mounts", e))
            })
            .await?;
            for m in &detached {
                tracing::warn!(
                    "detached a mount the earlier daemon never recorded: {}",
                    m.display()
                );
            }
            let blobs: Vec<(Digest, u64)> = prev
                .layers
                .values()
                .flat_map(|l| l.blobs.iter().map(|b| (b.digest, b.size)))
                .collect();
            match BlobFs::resume(
                fs_config.clone(),
                cache.clone(),
                tokio::runtime::Handle::current(),
                holder.clone(),
                dev,
                &saved,
                &blobs,
            ) {
                Ok(fs) => {
                    tracing::info!(
                        "took over the blob mount at {} from the earlier daemon ({} blob files{})",
                        blobs_dir.display(),
                        blobs.len(),
                        if fs.negotiated().has_resend() {
                            ", unanswered requests resent"
                        } else {
                            ""
                        }
                    );
                    resumed = Some(fs);
                }
                Err(e) => tracing::error!("taking over the blob mount failed: {e}; mounting anew"),
            }
        }
        let took_over = resumed.is_some();
        let blobfs = match resumed {
            Some(fs) => fs,
            None => {
                if let Some(h) = &holder {
                    // The old connection (if any) cannot be resumed: let it go, so that its
                    // mounts end and can be detached.
                    let _ = h.drop_entry(HOLDER_ENTRY);
                }
                // Whatever an earlier daemon left mounted goes first: user mounts stacked
                // on our layers, the layer mounts, the FUSE mount.
                let rd = run_dir.clone();
                let detached = blocking(move || {
                    sys::detach_stale(&rd).map_err(|e| internal("clean up stale mounts", e))
                })
                .await?;
                for m in &detached {
                    tracing::warn!(
                        "detached a stale mount left by an earlier daemon: {}",
                        m.display()
                    );
                }
                std::fs::create_dir_all(&blobs_dir)
                    .map_err(|e| internal(format!("create {}", blobs_dir.display()), e))?;
                let (c, h, cfg) = (cache.clone(), holder.clone(), fs_config.clone());
                let rt = tokio::runtime::Handle::current();
                blocking(move || {
                    BlobFs::mount(cfg, c, rt, h).map_err(|e| {
                        internal(
                            format!("mount the blob filesystem at {}", blobs_dir.display()),
                            e,
                        )
                    })
                })
                .await?
            }
        };
        let neg = blobfs.negotiated();
        if config.passthrough && !neg.passthrough() {
            tracing::warn!(
                "the kernel refused FUSE passthrough: warm layers are read through the daemon"
            );
        }
        if holder.is_some() && !neg.has_resend() {
            tracing::warn!(
                "this kernel has no FUSE_NOTIFY_RESEND (Linux < 6.9): reads in flight when the \
                 daemon dies fail with EIO instead of being served by the next daemon"
            );
        }

        let node = Arc::new(Node {
            store,
            cache,
            inner: Mutex::new(Inner {
                state: State::new(&config.store_url),
                blobfs: Some(blobfs),
                active: HashMap::new(),
            }),
            stopping: AtomicBool::new(false),
            holder,
            gate: tokio::sync::RwLock::new(()),
            handed_over: AtomicBool::new(false),
            handover_done: tokio::sync::Notify::new(),
            _lock: lock,
            config,
        });
        if let Some(prev) = previous {
            if took_over {
                node.adopt(prev).await;
            } else {
                node.restore(prev).await;
            }
        }
        {
            let inner = node.inner.lock().await;
            node.sweep_layer_dirs(&inner);
        }
        node.save(&*node.inner.lock().await)?;
        // Level-2 chunks that a crashed daemon's passthrough readers may still read stay
        // pinned (fs-cache holds) until their FUSE connection is gone; look every minute.
        let weak = Arc::downgrade(&node);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(STALE_HOLD_CHECK);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(node) = weak.upgrade() else { break };
                if node.stopping.load(Ordering::Relaxed) {
                    break;
                }
                match node.cache.release_stale_holds().await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!("released {n} level-2 holds of an earlier daemon"),
                    Err(e) => tracing::warn!(error = %e, "releasing stale level-2 holds"),
                }
            }
        });
        Ok(node)
    }

    /// Take over the previous daemon's layers and mounts, which are still mounted and served
    /// again through the resumed blob mount: mounts that are there are adopted as they are;
    /// a layer or user mount the state lists but the kernel does not show is mounted again
    /// (as [`Node::restore`] does), and dropped if that fails.
    async fn adopt(&self, prev: State) {
        let mounted: std::collections::HashMap<PathBuf, String> = sys::mounts()
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.mount_point, m.fstype))
            .collect();
        let mut inner = self.inner.lock().await;
        inner.state.next_seq = prev.next_seq;
        inner.state.layers = prev.layers.clone();
        for (id, layer) in &prev.layers {
            let mnt = self.layer_dir(id).join("mnt");
            if mounted.get(&mnt).map(String::as_str) == Some("erofs") {
                inner.active.insert(id.clone(), layer.passthrough_blobs);
            }
        }
        let mut mounts: Vec<_> = prev.mounts.into_iter().collect();
        mounts.sort_by_key(|(_, m)| m.seq);
        for (mp, m) in mounts {
            let want = if m.kind() == "bind" {
                "erofs"
            } else {
                "overlay"
            };
            let result = if mounted.get(&mp).map(String::as_str) == Some(want) {
                Ok(())
            } else {
                tracing::warn!("{} is no longer mounted; mounting it again", mp.display());
                match sys::check_mountpoint(&mp) {
                    Ok(canon) if canon == mp => self.mount_layers(&mut inner, &mp, &m).await,
                    Ok(_) => Err(internal(mp.display(), "the path now resolves elsewhere")),
                    Err(e) => Err(e),
                }
            };
            match result {
                Ok(()) => {
                    inner.state.mounts.insert(mp, m);
                }
                Err(e) => tracing::error!("take over mount {}: {e}; dropped", mp.display()),
            }
        }
        // Layers nothing needs any more (a mount that was dropped) go; layers still needed
        // but not mounted are mounted again.
        let ids: Vec<String> = inner.state.layers.keys().cloned().collect();
        self.release_unused(&mut inner, &ids).await;
        for id in ids {
            if inner.state.layers.contains_key(&id) && !inner.active.contains_key(&id) {
                if let Err(e) = self.activate(&mut inner, &id).await {
                    tracing::error!("take over layer {id}: {e}");
                }
            }
        }
        tracing::info!(
            "took over {} layers and {} mounts",
            inner.active.len(),
            inner.state.mounts.len()
        );
    }

    /// Bring back the previous daemon's layers and mounts. A layer or mount that cannot be
    /// restored is dropped from the state (and logged); the rest still come up.
    async fn restore(&self, prev: State) {
        let mut inner = self.inner.lock().await;
        inner.state.next_seq = prev.next_seq;
        for (id, layer) in &prev.layers {
            if layer.pins > 0 {
                inner.state.layers.insert(id.clone(), layer.clone());
                if let Err(e) = self.activate(&mut inner, id).await {
                    tracing::error!("restore layer {id}: {e}; dropped");
                    inner.state.layers.remove(id);
                }
            }
        }
        let mut mounts: Vec<_> = prev.mounts.into_iter().collect();
        mounts.sort_by_key(|(_, m)| m.seq);
        for (mp, m) in mounts {
            for id in &m.layer_ids {
                if let (false, Some(l)) = (inner.state.layers.contains_key(id), prev.layers.get(id))
                {
                    let mut l = l.clone();
                    l.pins = 0;
                    inner.state.layers.insert(id.clone(), l);
                }
            }
            let restored = match sys::check_mountpoint(&mp) {
                Ok(canon) if canon == mp => self.mount_layers(&mut inner, &mp, &m).await,
                Ok(_) => Err(internal(mp.display(), "the path now resolves elsewhere")),
                Err(e) => Err(e),
            };
            match restored {
                Ok(()) => {
                    inner.state.mounts.insert(mp, m);
                }
                Err(e) => {
                    tracing::error!("restore mount {}: {e}; dropped", mp.display());
                    self.release_unused(&mut inner, &m.layer_ids).await;
                }
            }
        }
    }

    /// Remove the directories of layers the state does not list (left by a crash, or
    /// unmounted at a stop).
    fn sweep_layer_dirs(&self, inner: &Inner) {
        let Ok(rd) = std::fs::read_dir(self.config.run_dir.join("layers")) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            let listed = name
                .to_str()
                .is_some_and(|n| inner.state.layers.contains_key(n));
            if !listed {
                remove_layer_dir(&e.path());
            }
        }
    }

    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// Whether this node can read blobs in FUSE passthrough mode at all (configured, the
    /// kernel agreed, fusectl mounted).
    pub async fn passthrough_available(&self) -> bool {
        self.config.passthrough
            && (self.inner.lock().await.blobfs.as_ref()).is_some_and(BlobFs::passthrough_available)
    }

    pub fn cache(&self) -> &Arc<ChunkCache> {
        &self.cache
    }

    pub fn socket_path(&self) -> PathBuf {
        socket_path(&self.config.run_dir)
    }

    fn save(&self, inner: &Inner) -> Result<()> {
        let path = self.config.run_dir.join("state.json");
        inner
            .state
            .save(&path)
            .map_err(|e| internal(format!("write {}", path.display()), e))
    }

    fn check_running(&self) -> Result<()> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(ApiError::new(
                ErrorKind::ShuttingDown,
                "the strata daemon is shutting down",
            ));
        }
        Ok(())
    }

    /// Answer one API request.
    pub async fn handle(&self, request: Request) -> Result<serde_json::Value> {
        let json = |v: Result<serde_json::Value, serde_json::Error>| {
            v.map_err(|e| internal("encode the response", e))
        };
        if request == Request::Handover {
            return json(serde_json::to_value(self.handover().await?));
        }
        let _gate = self.gate.read().await;
        match request {
            Request::Ping => json(serde_json::to_value(self.pong())),
            Request::Register { layer } => json(serde_json::to_value(self.register(&layer).await?)),
            Request::Release { layer } => json(serde_json::to_value(self.release(&layer).await?)),
            Request::Mount {
                layers,
                mountpoint,
                upper,
                work,
            } => json(serde_json::to_value(
                self.mount(&layers, &mountpoint, upper.as_deref(), work.as_deref())
                    .await?,
            )),
            Request::Umount { mountpoint } => {
                json(serde_json::to_value(self.umount(&mountpoint).await?))
            }
            Request::Stats => json(serde_json::to_value(self.status().await)),
            Request::Warm { layer } => json(serde_json::to_value(self.warm(&layer).await?)),
            Request::Handover => Err(internal("handover", "handled above")),
        }
    }

    /// Stop serving for the daemon that will take over (`strata daemon --takeover`): refuse
    /// new requests, wait for those in flight, stop the blob mount's workers without
    /// unmounting (its connection stays with the fd holder; reads wait in the kernel), flush
    /// the cache and save the state. The caller then exits ([`Node::handed_over`]); the new
    /// daemon takes the run directory's lock and resumes everything.
    pub async fn handover(&self) -> Result<Pong> {
        self.check_running()?;
        if self.holder.is_none() {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                "this daemon runs without an fd holder: its mounts cannot be handed over",
            ));
        }
        self.stopping.store(true, Ordering::SeqCst);
        let _gate = self.gate.write().await;
        let mut inner = self.inner.lock().await;
        if let Some(fs) = inner.blobfs.take() {
            blocking(move || {
                fs.hand_over();
                Ok(())
            })
            .await?;
        }
        self.cache
            .flush()
            .await
            .map_err(|e| ApiError::from_store("flush the chunk cache", &e))?;
        self.save(&inner)?;
        self.handed_over.store(true, Ordering::SeqCst);
        tracing::info!("handed over to the next daemon");
        Ok(self.pong())
    }

    /// Whether this node has handed over ([`Node::handover`]): its process should exit
    /// without unmounting anything once the answer is sent.
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::SeqCst)
    }

    /// Wake [`Node::wait_handed_over`] (called once the handover's answer is written).
    pub fn notify_handed_over(&self) {
        self.handover_done.notify_one();
    }

    /// Wait until a handover is complete and answered.
    pub async fn wait_handed_over(&self) {
        self.handover_done.notified().await
    }

    pub fn pong(&self) -> Pong {
        Pong {
            version: proto::VERSION,
            pid: std::process::id(),
            store: self.config.store_url.clone(),
            run_dir: self.config.run_dir.clone(),
        }
    }

    fn layer_dir(&self, id: &str) -> PathBuf {
        self.config.run_dir.join("layers").join(id)
    }

    fn layer_info(&self, inner: &Inner, id: &str) -> Option<LayerInfo> {
        let l = inner.state.layers.get(id)?;
        Some(LayerInfo {
            id: id.to_owned(),
            refs: l.refs.iter().cloned().collect(),
            meta_bytes: l.meta.size,
            blobs: l
                .blobs
                .iter()
                .map(|b| (b.digest.to_hex(), b.size))
                .collect(),
            pins: l.pins,
            users: inner.state.users(id),
            passthrough_blobs: inner.active.get(id).copied().unwrap_or(0),
            mnt: self.layer_dir(id).join("mnt"),
        })
    }

    /// The meta image and data blobs of the lazy layer `r`, from the store.
    async fn lazy_layer(&self, r: &LayerRef) -> Result<(BlobRef, Vec<BlobRef>)> {
        let m = self
            .store
            .manifest(r)
            .await
            .map_err(|e| ApiError::from_store(&format!("layer {r}"), &e))?;
        let meta = m.meta.clone().ok_or_else(|| {
            ApiError::new(
                ErrorKind::BadLayer,
                format!("layer {r} has no meta image (it is not a lazy EROFS layer)"),
            )
        })?;
        if m.blobs.is_empty() {
            return Err(ApiError::new(
                ErrorKind::BadLayer,
                format!("layer {r} names no data blob"),
            ));
        }
        Ok((meta, m.blobs))
    }

    /// Resolve `reference` to a layer in the state (added with no pins if new).
    async fn resolve(&self, inner: &mut Inner, reference: &str) -> Result<String> {
        let r = parse_ref(reference)?;
        let canonical = r.to_string();
        if let Some((id, _)) = inner
            .state
            .layers
            .iter()
            .find(|(_, l)| l.refs.contains(&canonical))
        {
            return Ok(id.clone());
        }
        let (meta, blobs) = self.lazy_layer(&r).await?;
        let id = meta.digest.to_hex();
        inner
            .state
            .layers
            .entry(id.clone())
            .or_insert_with(|| LayerState {
                refs: Default::default(),
                meta,
                blobs,
                pins: 0,
                passthrough_blobs: 0,
            })
            .refs
            .insert(canonical);
        Ok(id)
    }

    /// Mount layer `id`'s EROFS if it is not mounted: fetch the meta image (unless a verified
    /// copy is on disk), expose its blobs, mount.
    async fn activate(&self, inner: &mut Inner, id: &str) -> Result<()> {
        if inner.active.contains_key(id) {
            return Ok(());
        }
        // Level-2 chunks held for a dead daemon's readers may be free to go now.
        if let Err(e) = self.cache.release_stale_holds().await {
            tracing::warn!(error = %e, "releasing stale level-2 holds");
        }
        let layer = inner
            .state
            .layers
            .get(id)
            .cloned()
            .ok_or_else(|| internal(id, "not in the state"))?;
        let dir = self.layer_dir(id);
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt)
            .map_err(|e| internal(format!("create {}", mnt.display()), e))?;
        let meta_path = dir.join("meta.erofs");
        self.fetch_meta(&layer.meta, &meta_path).await?;
        let blobfs = inner
            .blobfs
            .as_ref()
            .ok_or_else(|| ApiError::new(ErrorKind::ShuttingDown, "the blob filesystem is gone"))?;
        let mut devices = Vec::with_capacity(layer.blobs.len());
        for b in &layer.blobs {
            let path = blobfs.add_blob(b.digest).await.map_err(|e| {
                ApiError::new(
                    ErrorKind::BackendUnreachable,
                    format!("expose blob {} of layer {id}: {e}", b.digest),
                )
            })?;
            devices.push(path);
            self.try_passthrough(blobfs, &b.digest, id).await;
        }
        let passthrough = layer
            .blobs
            .iter()
            .filter(|b| blobfs.passthrough_enabled(&b.digest))
            .count() as u32;
        let readahead = self.config.layer_readahead;
        blocking(move || {
            sys::mount_erofs(&meta_path, &devices, &mnt)?;
            if readahead > 0 {
                // Speed only: the mount works with the kernel's window.
                if let Err(e) = crate::blobfs::set_mount_readahead(&mnt, readahead) {
                    tracing::warn!(layer = %mnt.display(), error = %e, "could not set the layer's readahead");
                }
            }
            Ok(())
        })
        .await?;
        inner.active.insert(id.to_owned(), passthrough);
        if let Some(l) = inner.state.layers.get_mut(id) {
            l.passthrough_blobs = passthrough;
        }
        Ok(())
    }

    /// Why a blob of `size` bytes, wholly in level 2, would not be read in passthrough mode
    /// if its layer were mounted now; `None` if it would.
    fn passthrough_refusal(&self, blobfs: &BlobFs, size: u64) -> Option<&'static str> {
        if !self.config.passthrough {
            return Some("passthrough is off (strata daemon --no-passthrough)");
        }
        if !blobfs.passthrough_available() {
            return Some(
                "the kernel refused FUSE passthrough, or fusectl is not mounted at \
                 /sys/fs/fuse/connections",
            );
        }
        let Some(capacity) = self.config.cache.disk.as_ref().map(|d| d.capacity) else {
            return Some("the cache has no level 2");
        };
        if blobfs.passthrough_bytes().saturating_add(size) > capacity / 2 {
            return Some("it would keep more than half of level 2 pinned");
        }
        None
    }

    /// Before a layer's EROFS opens `blob`'s file: if every chunk of the blob is in level 2
    /// (and [`Node::passthrough_refusal`] has no objection), pin the chunks, check them and
    /// hold them (`BlobFs::enable_passthrough`), so that the mount reads the blob in
    /// passthrough mode, straight from the level-2 file. Otherwise, or if that fails, reads
    /// go through the cache as usual. The check reads the whole blob (`O_DIRECT`, about
    /// 0.3 s per 512 MiB here) while the node's lock is held: other requests wait for it.
    async fn try_passthrough(&self, blobfs: &BlobFs, blob: &Digest, layer: &str) {
        if blobfs.passthrough_enabled(blob) {
            return;
        }
        let size = match self.cache.blob_size(blob).await {
            Ok(size) => size,
            Err(e) => {
                tracing::warn!(%blob, layer, error = %e, "no passthrough: blob size unknown");
                return;
            }
        };
        if let Some(why) = self.passthrough_refusal(blobfs, size) {
            tracing::debug!(%blob, layer, "no passthrough: {why}");
            return;
        }
        let started = std::time::Instant::now();
        match blobfs.enable_passthrough(blob).await {
            Ok(true) => tracing::info!(
                %blob,
                layer,
                bytes = size,
                checked_in_ms = started.elapsed().as_millis() as u64,
                "every chunk is in level 2: passthrough"
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!(%blob, layer, error = %e, "no passthrough"),
        }
    }

    async fn fetch_meta(&self, meta: &BlobRef, path: &Path) -> Result<()> {
        if let Ok(md) = std::fs::metadata(path) {
            if md.len() == meta.size {
                let p = path.to_owned();
                let digest = tokio::task::spawn_blocking(move || Digest::of_file(&p))
                    .await
                    .map_err(|e| internal("hash the meta image", e))?;
                if matches!(digest, Ok((d, _)) if d == meta.digest) {
                    return Ok(());
                }
            }
        }
        let tmp = path.with_extension("erofs.tmp");
        let mut f = std::fs::File::create(&tmp)
            .map_err(|e| internal(format!("create {}", tmp.display()), e))?;
        if let Err(e) = self.store.read_blob_to(&meta.digest, &mut f, 8 << 20).await {
            let _ = std::fs::remove_file(&tmp);
            return Err(ApiError::from_store(
                &format!("fetch meta image {}", meta.digest),
                &e,
            ));
        }
        f.sync_all()
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| internal(format!("write {}", path.display()), e))
    }

    /// Take down layers in `ids` that nothing needs any more (unmount, drop unused blob
    /// files, remove their directory). Failures are logged: the layer stays listed.
    async fn release_unused(&self, inner: &mut Inner, ids: &[String]) {
        for id in ids {
            if inner.state.needed(id) {
                continue;
            }
            if inner.active.contains_key(id) {
                let mnt = self.layer_dir(id).join("mnt");
                if let Err(e) = blocking(move || sys::unmount(&mnt, true)).await {
                    tracing::error!("unmount layer {id}: {e}");
                    continue;
                }
                inner.active.remove(id);
            }
            if let Some(layer) = inner.state.layers.remove(id) {
                let still_used = inner.state.blobs_in_use();
                if let Some(fs) = &inner.blobfs {
                    for b in layer
                        .blobs
                        .iter()
                        .filter(|b| !still_used.contains(&b.digest))
                    {
                        if let Err(e) = fs.remove_blob(&b.digest) {
                            tracing::warn!("remove blob file {}: {e}", b.digest);
                        }
                    }
                }
            }
            remove_layer_dir(&self.layer_dir(id));
        }
    }

    /// Bring every chunk of a layer's data blobs into level 2 (`ChunkCache::warm_local`), so
    /// that the layer, when next mounted, reads them in passthrough mode. Holds no lock while
    /// fetching: other requests go on meanwhile. Changes no state (chunk tables loaded for a
    /// blob no mounted layer uses are dropped again).
    pub async fn warm(&self, reference: &str) -> Result<WarmInfo> {
        self.check_running()?;
        let r = parse_ref(reference)?;
        let (meta, blobs) = self.lazy_layer(&r).await?;
        let started = std::time::Instant::now();
        let before = self.cache.stats().bytes_fetched;
        let mut local = true;
        for b in &blobs {
            self.check_running()?;
            let warmed = self.cache.warm_local(&b.digest).await;
            local &= *warmed.as_ref().unwrap_or(&false);
            if let Err(e) = warmed {
                self.forget_unused_tables(&blobs).await;
                return Err(ApiError::from_store(
                    &format!("warm blob {} of layer {r}", b.digest),
                    &e,
                ));
            }
        }
        let fetched = self.cache.stats().bytes_fetched.saturating_sub(before);
        let seconds = started.elapsed().as_secs_f64();
        self.forget_unused_tables(&blobs).await;
        let id = meta.digest.to_hex();
        let bytes = blobs.iter().map(|b| b.size).sum();
        let inner = self.inner.lock().await;
        let passthrough_now = inner.active.get(&id).copied();
        let refusal = match (&inner.blobfs, local) {
            (_, false) => Some(
                "not every chunk is in level 2 (it is too small for them, or they are not \
                 256 KiB chunks)",
            ),
            (None, true) => Some("the daemon is stopping"),
            (Some(fs), true) => {
                let pinned_here: u64 = blobs
                    .iter()
                    .filter(|b| fs.passthrough_enabled(&b.digest))
                    .map(|b| b.size)
                    .sum();
                self.passthrough_refusal(fs, bytes - pinned_here)
            }
        };
        Ok(WarmInfo {
            layer: r.to_string(),
            id,
            bytes,
            blobs: blobs.len(),
            fetched,
            seconds,
            local,
            mounted: passthrough_now.is_some(),
            passthrough_now: passthrough_now.unwrap_or(0),
            passthrough_next: refusal.is_none(),
            no_passthrough_because: refusal.map(str::to_owned),
        })
    }

    /// Drop the chunk tables of `blobs` that no listed layer uses (they are loaded again on
    /// demand).
    async fn forget_unused_tables(&self, blobs: &[BlobRef]) {
        let used = self.inner.lock().await.state.blobs_in_use();
        for b in blobs.iter().filter(|b| !used.contains(&b.digest)) {
            self.cache.unregister(&b.digest);
        }
    }

    /// Pin a layer: fetch its meta image, expose its blobs, mount its EROFS.
    pub async fn register(&self, reference: &str) -> Result<LayerInfo> {
        self.check_running()?;
        let mut inner = self.inner.lock().await;
        let id = self.resolve(&mut inner, reference).await?;
        if let Err(e) = self.activate(&mut inner, &id).await {
            self.release_unused(&mut inner, std::slice::from_ref(&id))
                .await;
            return Err(e);
        }
        if let Some(l) = inner.state.layers.get_mut(&id) {
            l.pins += 1;
        }
        self.save(&inner)?;
        self.layer_info(&inner, &id)
            .ok_or_else(|| internal(&id, "vanished"))
    }

    /// Drop one pin of a layer; it is unmounted when nothing else uses it.
    pub async fn release(&self, reference: &str) -> Result<LayerInfo> {
        self.check_running()?;
        let r = parse_ref(reference)?;
        let canonical = r.to_string();
        let mut inner = self.inner.lock().await;
        let (id, layer) = inner
            .state
            .layers
            .iter_mut()
            .find(|(_, l)| l.refs.contains(&canonical))
            .filter(|(_, l)| l.pins > 0)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::UnknownLayer,
                    format!("layer {canonical} is not registered on this node"),
                )
            })?;
        layer.pins -= 1;
        let id = id.clone();
        let mut info = self
            .layer_info(&inner, &id)
            .ok_or_else(|| internal(&id, "vanished"))?;
        self.release_unused(&mut inner, std::slice::from_ref(&id))
            .await;
        self.save(&inner)?;
        if !inner.state.layers.contains_key(&id) {
            info.mnt = PathBuf::new();
        }
        Ok(info)
    }

    /// Mount `layers` (first lowest) at `mountpoint`.
    pub async fn mount(
        &self,
        layers: &[String],
        mountpoint: &Path,
        upper: Option<&Path>,
        work: Option<&Path>,
    ) -> Result<MountInfo> {
        self.check_running()?;
        if layers.is_empty() {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                "mount needs at least one layer",
            ));
        }
        if work.is_some() && upper.is_none() {
            return Err(ApiError::new(ErrorKind::BadRequest, "--work needs --upper"));
        }
        if (layers.len() > 1 || upper.is_some()) && !sys::kernel_has("overlay") {
            return Err(ApiError::new(
                ErrorKind::KernelUnsupported,
                "this kernel has no overlay filesystem (needed to stack layers or add an upper)",
            ));
        }
        let mut inner = self.inner.lock().await;
        let mp = sys::check_mountpoint(mountpoint)?;
        if inner.state.mounts.contains_key(&mp) {
            return Err(ApiError::new(
                ErrorKind::MountpointInUse,
                format!("{} is already a strata mount", mp.display()),
            ));
        }
        let (upper, work) = match upper {
            Some(u) => {
                let (u, w) = prepare_upper(u, work)?;
                if u.starts_with(&mp) || w.starts_with(&mp) {
                    return Err(ApiError::new(
                        ErrorKind::BadRequest,
                        "the upper and work directories cannot be inside the mountpoint",
                    ));
                }
                (Some(u), Some(w))
            }
            None => (None, None),
        };
        let mut ids = Vec::with_capacity(layers.len());
        let mut canonical = Vec::with_capacity(layers.len());
        let mut result = Ok(());
        for reference in layers {
            match self.resolve(&mut inner, reference).await {
                Ok(id) => {
                    ids.push(id);
                    canonical.push(
                        reference
                            .parse::<LayerRef>()
                            .map(|r| r.to_string())
                            .unwrap_or_default(),
                    );
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let m = MountState {
            seq: inner.state.next_seq,
            layers: canonical,
            layer_ids: ids.clone(),
            upper,
            work,
        };
        if result.is_ok() {
            result = self.mount_layers(&mut inner, &mp, &m).await;
        }
        if let Err(e) = result {
            self.release_unused(&mut inner, &ids).await;
            return Err(e);
        }
        inner.state.next_seq += 1;
        inner.state.mounts.insert(mp.clone(), m.clone());
        if let Err(e) = self.save(&inner) {
            let mpc = mp.clone();
            let _ = blocking(move || sys::unmount(&mpc, true)).await;
            inner.state.mounts.remove(&mp);
            self.release_unused(&mut inner, &ids).await;
            return Err(e);
        }
        Ok(mount_info(&mp, &m))
    }

    /// Activate `m`'s layers and make the user mount at `mp`.
    async fn mount_layers(&self, inner: &mut Inner, mp: &Path, m: &MountState) -> Result<()> {
        for id in &m.layer_ids {
            self.activate(inner, id).await?;
        }
        let mnts: Vec<PathBuf> = m
            .layer_ids
            .iter()
            .map(|id| self.layer_dir(id).join("mnt"))
            .collect();
        let (mp, upper, work) = (mp.to_owned(), m.upper.clone(), m.work.clone());
        blocking(move || match (&upper, &work) {
            (None, _) if mnts.len() == 1 => sys::bind_ro(&mnts[0], &mp),
            _ => {
                let lowers: Vec<PathBuf> = mnts.into_iter().rev().collect();
                let uw = upper.as_deref().zip(work.as_deref());
                sys::mount_overlay(&lowers, uw, &mp)
            }
        })
        .await
    }

    /// Unmount a user mount and release its layers.
    pub async fn umount(&self, mountpoint: &Path) -> Result<MountInfo> {
        self.check_running()?;
        let mp = std::fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.to_owned());
        let mut inner = self.inner.lock().await;
        let m = inner.state.mounts.get(&mp).cloned().ok_or_else(|| {
            ApiError::new(
                ErrorKind::NotMounted,
                format!("{} is not a strata mount", mountpoint.display()),
            )
        })?;
        let target = mp.clone();
        blocking(move || sys::unmount(&target, false)).await?;
        inner.state.mounts.remove(&mp);
        self.release_unused(&mut inner, &m.layer_ids).await;
        self.save(&inner)?;
        Ok(mount_info(&mp, &m))
    }

    /// Layers, mounts, blob files and cache counters.
    pub async fn status(&self) -> Status {
        let inner = self.inner.lock().await;
        let mut mounts: Vec<_> = inner.state.mounts.iter().collect();
        mounts.sort_by_key(|(_, m)| m.seq);
        Status {
            pong: self.pong(),
            layers: inner
                .state
                .layers
                .keys()
                .filter_map(|id| self.layer_info(&inner, id))
                .collect(),
            mounts: mounts
                .into_iter()
                .map(|(mp, m)| mount_info(mp, m))
                .collect(),
            cache: self.cache.stats(),
            blob_files: inner
                .blobfs
                .as_ref()
                .map(|fs| {
                    fs.blobs()
                        .into_iter()
                        .map(|(d, s)| (d.to_hex(), s))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// Stop: unmount user mounts (newest first, lazily if busy), then layer mounts, then the
    /// FUSE mount; flush the cache. User mounts are forgotten (a clean stop ends them);
    /// registered layers stay in the state file and come back at the next start.
    pub async fn shutdown(&self) -> Result<()> {
        self.stopping.store(true, Ordering::SeqCst);
        let mut inner = self.inner.lock().await;
        let mut mounts: Vec<(PathBuf, MountState)> = std::mem::take(&mut inner.state.mounts)
            .into_iter()
            .collect();
        mounts.sort_by_key(|(_, m)| std::cmp::Reverse(m.seq));
        let mut first_error = None;
        for (mp, _) in &mounts {
            let target = mp.clone();
            if let Err(e) = blocking(move || sys::unmount(&target, true)).await {
                tracing::error!("unmount {}: {e}", mp.display());
                first_error.get_or_insert(e);
            }
        }
        let active: Vec<String> = inner.active.drain().map(|(id, _)| id).collect();
        for id in &active {
            let mnt = self.layer_dir(id).join("mnt");
            if let Err(e) = blocking(move || sys::unmount(&mnt, true)).await {
                tracing::error!("unmount layer {id}: {e}");
                first_error.get_or_insert(e);
            }
        }
        inner.state.layers.retain(|_, l| l.pins > 0);
        self.sweep_layer_dirs(&inner);
        if let Some(fs) = inner.blobfs.take() {
            if let Err(e) = fs.unmount() {
                tracing::error!("unmount the blob filesystem: {e}");
                first_error.get_or_insert(internal("unmount the blob filesystem", e));
            }
        }
        if let Err(e) = self.cache.flush().await {
            first_error.get_or_insert(ApiError::from_store("flush the chunk cache", &e));
        }
        if let Err(e) = self.save(&inner) {
            first_error.get_or_insert(e);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Remove a layer directory by its known entries only: never recurse into what might still
/// be a mount.
/// `KIND/NAME:VERSION`, or a `bad_request`-kind error saying why not.
fn parse_ref(reference: &str) -> Result<LayerRef> {
    reference
        .parse()
        .map_err(|e| ApiError::from_store("bad layer reference", &e))
}

fn remove_layer_dir(dir: &Path) {
    for f in ["meta.erofs", "meta.erofs.tmp"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let _ = std::fs::remove_dir(dir.join("mnt"));
    let _ = std::fs::remove_dir(dir);
}

fn mount_info(mp: &Path, m: &MountState) -> MountInfo {
    MountInfo {
        mountpoint: mp.to_owned(),
        layers: m.layers.clone(),
        layer_ids: m.layer_ids.clone(),
        kind: m.kind().to_owned(),
        upper: m.upper.clone(),
        work: m.work.clone(),
    }
}

/// Create (if needed) the upper directory and its work directory (default: `<upper>.work`
/// next to it); both must be on one filesystem, which overlayfs checks.
fn prepare_upper(upper: &Path, work: Option<&Path>) -> Result<(PathBuf, PathBuf)> {
    let bad = |what: &Path, e: std::io::Error| {
        ApiError::new(ErrorKind::BadRequest, format!("{}: {e}", what.display()))
    };
    std::fs::create_dir_all(upper).map_err(|e| bad(upper, e))?;
    let upper = std::fs::canonicalize(upper).map_err(|e| bad(upper, e))?;
    let work = match work {
        Some(w) => w.to_owned(),
        None => {
            let mut name = upper
                .file_name()
                .map(|n| n.to_os_string())
                .unwrap_or_else(|| "upper".into());
            name.push(".work");
            upper.with_file_name(name)
        }
    };
    std::fs::create_dir_all(&work).map_err(|e| bad(&work, e))?;
    let work = std::fs::canonicalize(&work).map_err(|e| bad(&work, e))?;
    if work.starts_with(&upper) || upper.starts_with(&work) {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            "the upper and work directories must not contain each other",
        ));
    }
    sys::option_path(&upper)?;
    sys::option_path(&work)?;
    Ok((upper, work))
}
