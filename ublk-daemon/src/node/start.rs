//! Starting a node: checking and preparing the machine, locking the run directory, taking
//! over an earlier daemon's mounts (its FUSE connection kept by the fd holder) or cleaning up
//! after it, and restoring the state file.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fs_cache::chunk::ChunkCache;
use fs_cache::{Digest, Store};
use tokio::sync::Mutex;

use super::layers::remove_layer_dir;
use super::proto::{ApiError, ErrorKind};
use super::state::State;
use super::{blocking, internal, sys, Inner, Node, NodeConfig, Result, STALE_HOLD_CHECK};
use crate::blobfs::{BlobFs, BlobFsConfig, SavedConnection, HOLDER_ENTRY};
use crate::holder::HolderClient;

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
/// directory), raises this process's soft limit of open files to its hard limit (level 2
/// keeps up to twice `OPEN_FILES` blob files open, buffered and `O_DIRECT`, beside FUSE
/// devices and every exec's pipes: a 1,024 default is close), and checks for overlayfs.
pub fn prepare_machine() -> Vec<String> {
    let mut notes = Vec::new();
    let files = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if let (Some(soft), Some(hard)) = (files.current, files.maximum) {
        if soft < hard {
            let raised = rustix::process::Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            };
            match rustix::process::setrlimit(rustix::process::Resource::Nofile, raised) {
                Ok(()) => tracing::info!("open files limit raised from {soft} to {hard}"),
                Err(e) => notes.push(format!(
                    "could not raise the open files limit from {soft} to {hard}: {e}"
                )),
            }
        }
    }
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
        // FUSE passthrough makes the blob mount a stacked filesystem; a kernel whose EROFS
        // refuses devices on one would then refuse every layer (`sys::erofs_takes_stacked_devices`).
        let stacked_refused = config.passthrough && {
            let scratch = run_dir.join("probe");
            match blocking(move || sys::erofs_takes_stacked_devices(&scratch)).await {
                Ok(true) => false,
                Ok(false) => {
                    tracing::warn!(
                        "this kernel's EROFS refuses file-backed devices on a stacked \
                         filesystem, which FUSE passthrough would make the blob mount: no \
                         passthrough, warm layers are read through the daemon"
                    );
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no passthrough");
                    true
                }
            }
        };
        fs_config.passthrough = config.passthrough && !stacked_refused;

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
            super::local::keep_detached(&detached);
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
        if took_over {
            // The earlier daemon crashed (or handed over): if this one crashes soon as well,
            // what it fetched meanwhile should be on local disk, not lost with it.
            cache.set_disk_linger(fs_cache::chunk::RESUMED_DISK_LINGER);
            let c = Arc::downgrade(&cache);
            tokio::spawn(async move {
                tokio::time::sleep(fs_cache::chunk::RESUMED_FOR).await;
                if let Some(c) = c.upgrade() {
                    c.set_disk_linger(fs_cache::chunk::DISK_LINGER);
                }
            });
        }
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
                super::local::keep_detached(&detached);
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
        if fs_config.passthrough && !neg.passthrough() {
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
                state: State {
                    restarts: previous
                        .as_ref()
                        .map_or(0, |p| p.restarts.saturating_add(1)),
                    takeovers: previous
                        .as_ref()
                        .map_or(0, |p| p.takeovers.saturating_add(u64::from(took_over))),
                    ..State::new(&config.store_url)
                },
                blobfs: Some(Arc::new(blobfs)),
                active: HashMap::new(),
                local_devices: HashMap::new(),
                detached_pins: Vec::new(),
                reserved: HashMap::new(),
                busy: HashSet::new(),
            }),
            layer_locks: Default::default(),
            stacked_refused,
            meta_pins: Arc::new(super::metapin::MetaPins::new(config.meta_pin_bytes)),
            bounds_wanted: Default::default(),
            stopping: AtomicBool::new(false),
            holder,
            gate: tokio::sync::RwLock::new(()),
            handed_over: AtomicBool::new(false),
            handover_done: tokio::sync::Notify::new(),
            persist: Default::default(),
            started: std::time::Instant::now(),
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
        node.sweep_layer_dirs(&*node.inner.lock().await);
        node.save_locked(&*node.inner.lock().await).await?;
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
    /// (as [`Node::restore`] does), and dropped if that fails. Runs before the socket is
    /// served: no request races it.
    async fn adopt(&self, prev: State) {
        let mounted: HashMap<PathBuf, String> = sys::mounts()
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.mount_point, m.fstype))
            .collect();
        // Layers found mounted: their meta images are pinned again (the previous daemon's
        // pins went with it).
        let mut found = Vec::new();
        {
            let mut inner = self.inner.lock().await;
            inner.state.next_seq = prev.next_seq;
            inner.state.layers = prev.layers.clone();
            for (id, layer) in &prev.layers {
                let mnt = self.layer_dir(id).join("mnt");
                if mounted.get(&mnt).map(String::as_str) == Some("erofs") {
                    inner.active.insert(id.clone(), layer.passthrough_blobs);
                    found.push(id.clone());
                }
            }
        }
        for id in &found {
            self.pin_meta(id).await;
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
                    Ok(canon) if canon == mp => self.mount_layers(&mp, &m).await,
                    Ok(_) => Err(internal(mp.display(), "the path now resolves elsewhere")),
                    Err(e) => Err(e),
                }
            };
            match result {
                Ok(()) => {
                    self.inner.lock().await.state.mounts.insert(mp, m);
                }
                Err(e) => tracing::error!("take over mount {}: {e}; dropped", mp.display()),
            }
        }
        // Layers nothing needs any more (a mount that was dropped) go; layers still needed
        // but not mounted are mounted again.
        let ids: Vec<String> = self
            .inner
            .lock()
            .await
            .state
            .layers
            .keys()
            .cloned()
            .collect();
        self.release_unused(&ids).await;
        for id in ids {
            let missing = {
                let inner = self.inner.lock().await;
                inner.state.layers.contains_key(&id) && !inner.active.contains_key(&id)
            };
            if missing {
                if let Err(e) = self.activate(&id).await {
                    tracing::error!("take over layer {id}: {e}");
                }
            }
        }
        let inner = self.inner.lock().await;
        tracing::info!(
            "took over {} layers and {} mounts",
            inner.active.len(),
            inner.state.mounts.len()
        );
    }

    /// Bring back the previous daemon's layers and mounts. A layer or mount that cannot be
    /// restored is dropped from the state (and logged); the rest still come up. Runs before
    /// the socket is served.
    async fn restore(&self, prev: State) {
        self.inner.lock().await.state.next_seq = prev.next_seq;
        for (id, layer) in &prev.layers {
            if layer.pins > 0 {
                self.inner
                    .lock()
                    .await
                    .state
                    .layers
                    .insert(id.clone(), layer.clone());
                if let Err(e) = self.activate(id).await {
                    tracing::error!("restore layer {id}: {e}; dropped");
                    self.inner.lock().await.state.layers.remove(id);
                }
            }
        }
        let mut mounts: Vec<_> = prev.mounts.into_iter().collect();
        mounts.sort_by_key(|(_, m)| m.seq);
        for (mp, m) in mounts {
            {
                let mut inner = self.inner.lock().await;
                for id in &m.layer_ids {
                    if let (false, Some(l)) =
                        (inner.state.layers.contains_key(id), prev.layers.get(id))
                    {
                        let mut l = l.clone();
                        l.pins = 0;
                        inner.state.layers.insert(id.clone(), l);
                    }
                }
                // A use for each layer while it is mounted.
                for id in &m.layer_ids {
                    *inner.reserved.entry(id.clone()).or_default() += 1;
                }
            }
            let restored = match sys::check_mountpoint(&mp) {
                Ok(canon) if canon == mp => self.mount_layers(&mp, &m).await,
                Ok(_) => Err(internal(mp.display(), "the path now resolves elsewhere")),
                Err(e) => Err(e),
            };
            let failed = {
                let mut inner = self.inner.lock().await;
                inner.unreserve(&m.layer_ids);
                match restored {
                    Ok(()) => {
                        inner.state.mounts.insert(mp, m.clone());
                        false
                    }
                    Err(e) => {
                        tracing::error!("restore mount {}: {e}; dropped", mp.display());
                        true
                    }
                }
            };
            if failed {
                self.release_unused(&m.layer_ids).await;
            }
        }
    }

    /// Remove the directories of layers the state does not list (left by a crash, or
    /// unmounted at a stop).
    pub(super) fn sweep_layer_dirs(&self, inner: &Inner) {
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
}
