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
//! - `state.json` is written by group commit, never under the node's lock: a change is
//!   serialised under the lock into a numbered snapshot (`Node::stage`), and the request waits
//!   (`Node::commit`) until a snapshot at least that new is on disk. One writer at a time
//!   writes the newest staged snapshot, so requests that staged meanwhile share its fsyncs,
//!   and the file never goes back to an older snapshot.
//! - At start, every mount left by an earlier daemon on this run directory (the FUSE mount,
//!   layer mounts, user mounts stacked on them) is detached before anything is mounted.

pub mod client;
mod layers;
mod local;
mod metapin;
pub mod metrics;
pub mod proto;
pub mod server;
mod start;
pub mod state;
pub mod sys;
mod trace;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fs_cache::chunk::{CacheConfig, ChunkCache};
use fs_cache::Store;
use tokio::sync::Mutex;

use crate::blobfs::BlobFs;
use crate::holder::HolderClient;
use layers::mount_info;
use proto::{ApiError, ErrorKind, NodeStats, Pong, Request, Status};
use state::{MountState, State};

pub use metapin::DEFAULT_META_PIN_BYTES;
pub use start::{check_environment, prepare_machine};
pub use trace::DEFAULT_TRACE_WINDOW;

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
    /// How long the demand reads of a layer this node mounts first are recorded into the
    /// layer's access trace when the store has none (when it has one, the trace is replayed
    /// as prefetch instead; `trace.rs`). Zero: no traces recorded or replayed.
    pub trace_window: std::time::Duration,
    /// At most this many bytes of mounted layers' meta images are kept in memory
    /// (`metapin.rs`: mapped and locked, so a cold read finds the metadata and inline small
    /// files without a disk read); 0: none.
    pub meta_pin_bytes: u64,
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
            trace_window: DEFAULT_TRACE_WINDOW,
            meta_pin_bytes: DEFAULT_META_PIN_BYTES,
        }
    }
}

struct Inner {
    state: State,
    blobfs: Option<Arc<BlobFs>>,
    /// Layers whose EROFS is mounted now, with how many of their blobs that mount reads
    /// without the daemon (FUSE passthrough, or a local device: `local.rs`).
    active: HashMap<String, u32>,
    /// The pinned level-2 blobs of layers mounted with local devices (`local.rs`).
    local_devices: HashMap<String, Vec<fs_cache::chunk::disk::BlobPin>>,
    /// Local-device pins of layers that were only detached lazily, kept for this process's
    /// life (their holds stay recorded).
    detached_pins: Vec<fs_cache::chunk::disk::BlobPin>,
    /// Uses of layers taken by requests in progress (`layers.rs`, "Locking").
    reserved: HashMap<String, u32>,
    /// Mountpoints with a mount or an umount in progress.
    busy: HashSet<PathBuf>,
}

/// The running node (see the module docs).
pub struct Node {
    config: NodeConfig,
    store: Store,
    cache: Arc<ChunkCache>,
    inner: Mutex<Inner>,
    /// One lock per layer id, held while that layer is mounted or taken down.
    layer_locks: std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Passthrough was configured, but this kernel's EROFS refuses devices on a stacked
    /// filesystem (`sys::erofs_takes_stacked_devices`): the blob mount was made without it.
    stacked_refused: bool,
    /// Mounted layers' meta images kept in memory (`metapin.rs`).
    meta_pins: Arc<metapin::MetaPins>,
    /// Layers whose file bounds the cache should have (`Node::learn_file_bounds`): a walk
    /// that finishes after its layer was taken down adds nothing.
    bounds_wanted: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    stopping: AtomicBool,
    /// The fd holder keeping the blob mount's connection (none: the mounts die with us).
    holder: Option<Arc<HolderClient>>,
    /// Every request but `handover` holds it shared; a handover takes it exclusively, so it
    /// waits for the requests in flight.
    gate: tokio::sync::RwLock<()>,
    /// Set once a handover is complete (the connection that asked has its answer).
    handed_over: AtomicBool,
    handover_done: tokio::sync::Notify,
    /// `state.json`'s group commit (see the invariants above).
    persist: Persist,
    /// When this process started serving.
    started: std::time::Instant,
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
/// The newest staged snapshot of the state, and the newest on disk.
#[derive(Debug, Default)]
struct Persist {
    /// (generation, the state file's bytes): replaced under the node's lock.
    staged: std::sync::Mutex<(u64, Arc<Vec<u8>>)>,
    /// The generation on disk; held while writing.
    written: Mutex<u64>,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| internal("a mount task stopped", e))?
}

impl Node {
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The store this node serves (manifests, blobs).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Whether this node can read blobs in FUSE passthrough mode at all (configured, the
    /// kernel agreed, fusectl mounted).
    pub async fn passthrough_available(&self) -> bool {
        self.config.passthrough
            && (self.inner.lock().await.blobfs.as_deref())
                .is_some_and(BlobFs::passthrough_available)
    }

    /// Whether passthrough was configured but left off because this kernel's EROFS refuses
    /// file-backed devices on a stacked filesystem, which a passthrough blob mount is.
    pub fn passthrough_refused_by_kernel(&self) -> bool {
        self.stacked_refused
    }

    pub fn cache(&self) -> &Arc<ChunkCache> {
        &self.cache
    }

    pub fn socket_path(&self) -> PathBuf {
        socket_path(&self.config.run_dir)
    }

    /// Serialise the state as it is now (the caller holds the node's lock) into the next
    /// snapshot; its generation, for `commit`.
    fn stage(&self, inner: &Inner) -> Result<u64> {
        let bytes = inner
            .state
            .to_bytes()
            .map_err(|e| internal("serialise the state", e))?;
        let mut staged = self
            .persist
            .staged
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        staged.0 += 1;
        staged.1 = Arc::new(bytes);
        Ok(staged.0)
    }

    /// Wait until snapshot `generation` or a newer one is in `state.json`, writing the newest
    /// staged one if no writer has yet. Call it without the node's lock.
    async fn commit(&self, generation: u64) -> Result<()> {
        let mut written = self.persist.written.lock().await;
        if *written >= generation {
            return Ok(());
        }
        let (newest, bytes) = self
            .persist
            .staged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let path = self.config.run_dir.join("state.json");
        blocking(move || {
            fs_cache::write_atomic(&path, &bytes)
                .map_err(|e| internal(format!("write {}", path.display()), e))
        })
        .await?;
        *written = newest;
        Ok(())
    }

    /// `stage` (taking the node's lock for it) and `commit`.
    async fn save_unlocked(&self) -> Result<()> {
        let g = self.stage(&*self.inner.lock().await)?;
        self.commit(g).await
    }

    /// `stage` and `commit` while the caller holds the node's lock (for the rare requests
    /// that must not let anything in between: start, handover, shutdown).
    async fn save_locked(&self, inner: &Inner) -> Result<()> {
        let g = self.stage(inner)?;
        self.commit(g).await
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
            Request::ReadBlob {
                blob,
                offset,
                length,
            } => json(serde_json::to_value(
                self.read_blob(&blob, offset, length).await?,
            )),
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
        Self::keep_local_device_holds(&mut inner);
        if let Some(fs) = inner.blobfs.take() {
            // No request is in flight (the gate), so nothing else holds the mount.
            let fs = Arc::try_unwrap(fs)
                .map_err(|_| internal("handover", "the blob mount is still in use"))?;
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
        self.save_locked(&inner).await?;
        self.handed_over.store(true, Ordering::SeqCst);
        tracing::info!("handed over to the next daemon");
        Ok(self.pong())
    }

    /// `length` bytes (at most [`proto::MAX_READ_BLOB`]) of stored blob `blob` from `offset`,
    /// through the node's chunk cache (verified like every read).
    pub async fn read_blob(
        &self,
        blob: &str,
        offset: u64,
        length: u64,
    ) -> Result<proto::BlobBytes> {
        self.check_running()?;
        let digest: fs_cache::Digest = blob
            .parse()
            .map_err(|e| ApiError::from_store("bad blob digest", &e))?;
        if length > proto::MAX_READ_BLOB {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                format!(
                    "read_blob reads at most {} bytes at a time",
                    proto::MAX_READ_BLOB
                ),
            ));
        }
        let size = self
            .cache
            .blob_size(&digest)
            .await
            .map_err(|e| ApiError::from_store(&format!("blob {digest}"), &e))?;
        if offset > size {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                format!("offset {offset} is past the end of blob {digest} ({size} bytes)"),
            ));
        }
        let bytes = self
            .cache
            .read(&digest, offset, length)
            .await
            .map_err(|e| ApiError::from_store(&format!("read blob {digest}"), &e))?;
        Ok(proto::BlobBytes {
            size,
            offset,
            hex: hex::encode(&bytes),
        })
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
            node: self.node_stats(&inner),
        }
    }

    /// The daemon's own counters.
    fn node_stats(&self, inner: &Inner) -> NodeStats {
        let fuse = inner
            .blobfs
            .as_ref()
            .map(|fs| fs.stats())
            .unwrap_or_default();
        let (meta_pinned_bytes, meta_pinned_layers) = self.meta_pins.totals();
        let (file_bounds_blobs, file_bounds_ends) = self.cache.file_bounds();
        NodeStats {
            rss_bytes: metrics::rss_bytes().unwrap_or(0),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            fuse_requests_in_flight: fuse.in_flight,
            fuse_reads: fuse.reads,
            fuse_read_bytes: fuse.read_bytes,
            fuse_read_errors: fuse.read_errors,
            restarts: inner.state.restarts,
            takeovers: inner.state.takeovers,
            meta_pinned_bytes,
            meta_pinned_layers,
            file_bounds_blobs: file_bounds_blobs as u64,
            file_bounds_ends: file_bounds_ends as u64,
        }
    }

    /// Stop: unmount user mounts (newest first, lazily if busy), then layer mounts, then the
    /// FUSE mount; flush the cache. User mounts are forgotten (a clean stop ends them);
    /// registered layers stay in the state file and come back at the next start.
    pub async fn shutdown(&self) -> Result<()> {
        self.stopping.store(true, Ordering::SeqCst);
        // Requests in flight finish first (new ones are refused: `stopping`).
        let _gate = self.gate.write().await;
        let mut inner = self.inner.lock().await;
        let mut mounts: Vec<(PathBuf, MountState)> = std::mem::take(&mut inner.state.mounts)
            .into_iter()
            .collect();
        mounts.sort_by_key(|(_, m)| std::cmp::Reverse(m.seq));
        let mut first_error = None;
        for (mp, m) in &mounts {
            let target = mp.clone();
            match blocking(move || sys::unmount_or_detach(&target, true)).await {
                // Still in use: it keeps reading its layers (an overlay holds its own copy of
                // each lower mount), so their local devices must stay held (`local.rs`).
                Ok(true) => self.mark_detached_users(&m.layer_ids),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!("unmount {}: {e}", mp.display());
                    first_error.get_or_insert(e);
                }
            }
        }
        let active: Vec<String> = inner.active.drain().map(|(id, _)| id).collect();
        let mut tokens_gone = false;
        for id in &active {
            let mnt = self.layer_dir(id).join("mnt");
            match blocking(move || sys::unmount_or_detach(&mnt, true)).await {
                Ok(detached) => {
                    self.meta_pins.unpin(id);
                    tokens_gone |= self.end_local_devices_locked(&mut inner, id, detached);
                }
                Err(e) => {
                    tracing::error!("unmount layer {id}: {e}");
                    first_error.get_or_insert(e);
                    // Still mounted: its local devices stay held.
                    self.end_local_devices_locked(&mut inner, id, true);
                }
            }
        }
        if tokens_gone {
            self.release_token_holds().await;
        }
        inner.state.layers.retain(|_, l| l.pins > 0);
        self.sweep_layer_dirs(&inner);
        if let Some(fs) = inner.blobfs.take() {
            let unmounted = match Arc::try_unwrap(fs) {
                Ok(fs) => fs.unmount(),
                // Dropped last by whoever still holds it; it unmounts then.
                Err(_) => Err(crate::Error::Busy {
                    path: self.config.run_dir.join("blobs"),
                    what: "still referenced by a request".into(),
                }),
            };
            if let Err(e) = unmounted {
                tracing::error!("unmount the blob filesystem: {e}");
                first_error.get_or_insert(internal("unmount the blob filesystem", e));
            }
        }
        if let Err(e) = self.cache.flush().await {
            first_error.get_or_insert(ApiError::from_store("flush the chunk cache", &e));
        }
        if let Err(e) = self.save_locked(&inner).await {
            first_error.get_or_insert(e);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
