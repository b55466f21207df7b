//! Layers and user mounts: resolving references, mounting a layer's EROFS once per node,
//! stacking user mounts on them, and taking layers down when nothing needs them.
//!
//! ## Locking
//! The node's lock (`Node::inner`) is held for bookkeeping only, never across I/O (a manifest
//! or meta-image fetch, a chunk-table load, a passthrough check, mount(2)). What keeps
//! concurrent requests apart instead:
//! - a request takes a *use* of every layer it works on ([`Inner::reserved`]) before it
//!   mounts anything, so no other request takes the layer down meanwhile;
//! - mounting or taking down one layer holds that layer's own lock ([`Node::layer_lock`]), so
//!   a layer is mounted once however many requests want it, and a slow fetch for layer A
//!   never delays a request for an already mounted or cached layer B;
//! - a mountpoint with a mount or an umount in progress is [`Inner::busy`]: a second request
//!   for it is refused rather than queued.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fs_cache::{BlobRef, Digest, LayerRef};

use super::proto::{ApiError, ErrorKind, LayerInfo, MountInfo, WarmInfo};
use super::state::{LayerState, MountState};
use super::{blocking, internal, sys, Inner, Node, Result};
use crate::blobfs::BlobFs;

/// The most regular files of one layer whose data runs the node tells the cache about
/// (`Node::learn_file_bounds`); past it the rest read ahead as without bounds.
const MAX_BOUNDED_FILES: usize = 1 << 20;

/// A reference resolved to a layer: its id, its state (as the store describes it, for a layer
/// the node does not list yet) and the reference in canonical form.
pub(super) struct Resolved {
    pub(super) id: String,
    pub(super) layer: LayerState,
    pub(super) canonical: String,
}

impl Inner {
    /// Whether layer `id` is pinned, used by a mount, or reserved by a request in progress.
    pub(super) fn needed(&self, id: &str) -> bool {
        self.state.needed(id) || self.reserved.get(id).is_some_and(|n| *n > 0)
    }

    /// Take one use of each layer (listing it if new) for a request in progress.
    pub(super) fn reserve(&mut self, layers: &[Resolved]) {
        for r in layers {
            self.state
                .layers
                .entry(r.id.clone())
                .or_insert_with(|| r.layer.clone())
                .refs
                .insert(r.canonical.clone());
            *self.reserved.entry(r.id.clone()).or_default() += 1;
        }
    }

    /// Give back the uses [`Inner::reserve`] took.
    pub(super) fn unreserve(&mut self, ids: &[String]) {
        for id in ids {
            if let Some(n) = self.reserved.get_mut(id) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.reserved.remove(id);
                }
            }
        }
    }
}

impl Node {
    /// The lock held while layer `id` is mounted or taken down.
    pub(super) fn layer_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.layer_locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(id.to_owned()).or_default().clone()
    }

    pub(super) fn layer_dir(&self, id: &str) -> PathBuf {
        self.config.run_dir.join("layers").join(id)
    }

    /// Where layer `id`'s meta image is kept on this node (verified when fetched; present
    /// while the layer is mounted, [`LayerInfo::mnt`]).
    pub fn meta_image(&self, id: &str) -> PathBuf {
        self.layer_dir(id).join("meta.erofs")
    }

    pub(super) fn layer_info(&self, inner: &Inner, id: &str) -> Option<LayerInfo> {
        let l = inner.state.layers.get(id)?;
        let per_blob = self.cache.blob_stats();
        let of = |f: fn(&fs_cache::chunk::BlobStats) -> u64| {
            l.blobs
                .iter()
                .filter_map(|b| per_blob.get(&b.digest).map(f))
                .sum::<u64>()
        };
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
            bytes_read: of(|s| s.bytes_read),
            bytes_fetched: of(|s| s.bytes_fetched),
            meta_pinned: self.meta_pins.pinned(id),
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

    /// Resolve `reference`: from the state if the node lists it, else from the store (the
    /// node's lock is not held while the manifest is fetched).
    pub(super) async fn resolve(&self, reference: &str) -> Result<Resolved> {
        let r = parse_ref(reference)?;
        let canonical = r.to_string();
        {
            let inner = self.inner.lock().await;
            if let Some((id, l)) = inner
                .state
                .layers
                .iter()
                .find(|(_, l)| l.refs.contains(&canonical))
            {
                return Ok(Resolved {
                    id: id.clone(),
                    layer: l.clone(),
                    canonical,
                });
            }
        }
        let (meta, blobs) = self.lazy_layer(&r).await?;
        Ok(Resolved {
            id: meta.digest.to_hex(),
            layer: LayerState {
                refs: [canonical.clone()].into(),
                meta,
                blobs,
                pins: 0,
                passthrough_blobs: 0,
            },
            canonical,
        })
    }

    /// Mount layer `id`'s EROFS if it is not mounted: fetch the meta image (unless a verified
    /// copy is on disk), expose its blobs, mount. The caller holds a use of the layer. Holds
    /// the layer's lock throughout and the node's lock only to read and record.
    pub(super) async fn activate(&self, id: &str) -> Result<()> {
        let lock = self.layer_lock(id);
        let _layer = lock.lock().await;
        let (layer, blobfs) = {
            let inner = self.inner.lock().await;
            if inner.active.contains_key(id) {
                return Ok(());
            }
            let layer = inner
                .state
                .layers
                .get(id)
                .cloned()
                .ok_or_else(|| internal(id, "not in the state"))?;
            let fs = inner.blobfs.clone().ok_or_else(|| {
                ApiError::new(ErrorKind::ShuttingDown, "the blob filesystem is gone")
            })?;
            (layer, fs)
        };
        // Level-2 chunks held for a dead daemon's readers may be free to go now.
        if let Err(e) = self.cache.release_stale_holds().await {
            tracing::warn!(error = %e, "releasing stale level-2 holds");
        }
        let dir = self.layer_dir(id);
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt)
            .map_err(|e| internal(format!("create {}", mnt.display()), e))?;
        let meta_path = dir.join("meta.erofs");
        self.fetch_meta(&layer.meta, &meta_path).await?;
        let mut devices = Vec::with_capacity(layer.blobs.len());
        let mut local = Vec::new();
        let mut pinned = Self::local_device_bytes(&*self.inner.lock().await);
        for b in &layer.blobs {
            let path = match blobfs.add_blob(b.digest).await {
                Ok(path) => path,
                Err(e) => {
                    // The local devices made so far go with their token.
                    drop(local);
                    self.end_local_devices(id, false).await;
                    return Err(ApiError::new(
                        ErrorKind::BackendUnreachable,
                        format!("expose blob {} of layer {id}: {e}", b.digest),
                    ));
                }
            };
            // A warm blob: the level-2 file itself where FUSE passthrough cannot serve it
            // (`local.rs`), else passthrough on the blob mount's file.
            match self.try_local_device(&blobfs, &b.digest, id, pinned).await {
                Some(pin) => {
                    pinned += pin.len();
                    devices.push(pin.path());
                    local.push(pin);
                }
                None => {
                    devices.push(path);
                    self.try_passthrough(&blobfs, &b.digest, id).await;
                }
            }
        }
        let passthrough = local.len() as u32
            + layer
                .blobs
                .iter()
                .filter(|b| blobfs.passthrough_enabled(&b.digest))
                .count() as u32;
        let readahead = self.config.layer_readahead;
        let mounted = blocking(move || {
            sys::mount_erofs(&meta_path, &devices, &mnt)?;
            if readahead > 0 {
                // Speed only: the mount works with the kernel's window.
                if let Err(e) = crate::blobfs::set_mount_readahead(&mnt, readahead) {
                    tracing::warn!(layer = %mnt.display(), error = %e, "could not set the layer's readahead");
                }
            }
            Ok(())
        })
        .await;
        if let Err(e) = mounted {
            drop(local);
            self.end_local_devices(id, false).await;
            return Err(e);
        }
        let mut inner = self.inner.lock().await;
        if !local.is_empty() {
            inner.local_devices.insert(id.to_owned(), local);
        }
        inner.active.insert(id.to_owned(), passthrough);
        if let Some(l) = inner.state.layers.get_mut(id) {
            l.passthrough_blobs = passthrough;
        }
        drop(inner);
        self.pin_meta(id).await;
        self.trace_layer(id, &layer, passthrough as usize == layer.blobs.len());
        Ok(())
    }

    /// Why a blob of `size` bytes, wholly in level 2, would not be read without the daemon
    /// (in passthrough mode, or through a local device where FUSE passthrough is not
    /// available: `local.rs`) if its layer were mounted now; `None` if it would.
    /// `device_bytes`: level 2 pinned by local devices so far.
    pub(super) fn passthrough_refusal(
        &self,
        blobfs: &BlobFs,
        size: u64,
        device_bytes: u64,
    ) -> Option<&'static str> {
        if !self.config.passthrough {
            return Some("passthrough is off (strata daemon --no-passthrough)");
        }
        let Some(capacity) = self.config.cache.disk.as_ref().map(|d| d.capacity) else {
            return Some("the cache has no level 2");
        };
        let pinned = blobfs.passthrough_bytes().saturating_add(device_bytes);
        if pinned.saturating_add(size) > capacity / 2 {
            return Some("it would keep more than half of level 2 pinned");
        }
        None
    }

    /// Before a layer's EROFS opens `blob`'s file: if every chunk of the blob is in level 2
    /// (and [`Node::passthrough_refusal`] has no objection), pin the chunks, check them and
    /// hold them (`BlobFs::enable_passthrough`), so that the mount reads the blob in
    /// passthrough mode, straight from the level-2 file. Otherwise, or if that fails, reads
    /// go through the cache as usual. The check reads the whole blob (`O_DIRECT`, about
    /// 0.3 s per 512 MiB here) under the layer's lock only: other requests go on.
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
        if !blobfs.passthrough_available() {
            tracing::debug!(%blob, layer, "no passthrough: not available on this node");
            return;
        }
        if let Some(why) = self.passthrough_refusal(blobfs, size, 0) {
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

    /// Keep layer `id`'s meta image in memory while its EROFS is mounted (`metapin.rs`), and
    /// learn from it where its files end ([`Node::learn_file_bounds`]). Speed only: a meta
    /// image left unpinned is read through the page cache as before.
    pub(super) async fn pin_meta(&self, id: &str) {
        let pins = self.meta_pins.clone();
        let path = self.meta_image(id);
        let pin_id = id.to_owned();
        let _ = tokio::task::spawn_blocking(move || pins.pin(&pin_id, &path)).await;
        self.learn_file_bounds(id).await;
    }

    /// Tell the cache where layer `id`'s files end in its blobs (`fs_cache` `bounds.rs`:
    /// a reader of one file reads ahead only to its end), from its meta image, in the
    /// background: the mount does not wait for the walk. A walk that ends after the layer
    /// was taken down adds nothing (`bounds_wanted`, cleared by `release_unused` before it
    /// forgets the layer's bounds). Bounds are kept per (blob, layer): a layer taken down
    /// takes only its own away. Speed only: a meta image that does not parse leaves
    /// readahead as it was.
    async fn learn_file_bounds(&self, id: &str) {
        let blobs: Vec<Digest> = match self.inner.lock().await.state.layers.get(id) {
            Some(l) => l.blobs.iter().map(|b| b.digest).collect(),
            None => return,
        };
        let wanted = self.bounds_wanted.clone();
        wanted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_owned());
        let (cache, path, id) = (self.cache.clone(), self.meta_image(id), id.to_owned());
        tokio::task::spawn_blocking(move || {
            let img = match erofs_builder::Image::open(&path) {
                Ok(img) => img,
                Err(e) => {
                    tracing::warn!(layer = %id, error = %e, "no file bounds: the meta image does not open");
                    return;
                }
            };
            let ends = erofs_builder::reader::device_run_ends(&img, MAX_BOUNDED_FILES);
            let wanted = wanted.lock().unwrap_or_else(|p| p.into_inner());
            if !wanted.contains(&id) {
                return;
            }
            // Device i + 1 of the image is the layer's blob i (as mounted).
            for (blob, ends) in blobs.iter().zip(&ends) {
                cache.add_file_bounds(*blob, &id, ends);
            }
            tracing::debug!(layer = %id, runs = ends.iter().map(Vec::len).sum::<usize>(), "file bounds learnt");
        });
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

    /// Take down the layers in `ids` that nothing needs any more (unmount, drop unused blob
    /// files, remove their directory). Failures are logged: the layer stays listed.
    pub(super) async fn release_unused(&self, ids: &[String]) -> bool {
        let mut changed = false;
        for id in ids {
            let lock = self.layer_lock(id);
            let _layer = lock.lock().await;
            let active = {
                let inner = self.inner.lock().await;
                if inner.needed(id) {
                    continue;
                }
                inner.active.contains_key(id)
            };
            if active {
                let mnt = self.layer_dir(id).join("mnt");
                match blocking(move || sys::unmount_or_detach(&mnt, true)).await {
                    Ok(detached) => self.end_local_devices(id, detached).await,
                    Err(e) => {
                        tracing::error!("unmount layer {id}: {e}");
                        // Still mounted (and listed): its local devices stay as they are.
                        continue;
                    }
                }
            }
            self.meta_pins.unpin(id);
            self.bounds_wanted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(id);
            let mut inner = self.inner.lock().await;
            inner.active.remove(id);
            // A request may have taken a use meanwhile: it mounts the layer again (it waits
            // for this layer's lock), so its entry stays.
            if inner.needed(id) {
                continue;
            }
            if let Some(layer) = inner.state.layers.remove(id) {
                changed = true;
                // This layer's file bounds go; other layers' in shared blobs stay.
                for b in &layer.blobs {
                    self.cache.forget_file_bounds(&b.digest, id);
                }
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
        changed
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
        let refusal = match (inner.blobfs.as_deref(), local) {
            (_, false) => Some(
                "not every chunk is in level 2 (it is too small for them, or a blob's chunks \
                 are larger than 256 KiB)",
            ),
            (None, true) => Some("the daemon is stopping"),
            (Some(fs), true) => {
                let local: &[fs_cache::chunk::disk::BlobPin] =
                    inner.local_devices.get(&id).map_or(&[], Vec::as_slice);
                let pinned_here: u64 = blobs
                    .iter()
                    .filter(|b| {
                        fs.passthrough_enabled(&b.digest)
                            || local.iter().any(|p| *p.blob() == b.digest)
                    })
                    .map(|b| b.size)
                    .sum();
                let device_bytes = Self::local_device_bytes(&inner);
                // Where FUSE passthrough is not available, local devices read warm blobs
                // (`local.rs`): the same limits hold for both.
                self.passthrough_refusal(
                    fs,
                    bytes - pinned_here,
                    device_bytes.saturating_sub(pinned_here),
                )
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
        let r = self.resolve(reference).await?;
        let id = r.id.clone();
        self.inner.lock().await.reserve(std::slice::from_ref(&r));
        let ids = [id.clone()];
        if let Err(e) = self.activate(&id).await {
            self.inner.lock().await.unreserve(&ids);
            self.release_unused(&ids).await;
            return Err(e);
        }
        let mut inner = self.inner.lock().await;
        inner.unreserve(&ids);
        if let Some(l) = inner.state.layers.get_mut(&id) {
            l.pins += 1;
        }
        let g = self.stage(&inner)?;
        let info = self
            .layer_info(&inner, &id)
            .ok_or_else(|| internal(&id, "vanished"));
        drop(inner);
        self.commit(g).await?;
        info
    }

    /// Drop one pin of a layer; it is unmounted when nothing else uses it.
    pub async fn release(&self, reference: &str) -> Result<LayerInfo> {
        self.check_running()?;
        let r = parse_ref(reference)?;
        let canonical = r.to_string();
        let (id, mut info, g) = {
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
            let info = self
                .layer_info(&inner, &id)
                .ok_or_else(|| internal(&id, "vanished"))?;
            (id, info, self.stage(&inner)?)
        };
        self.commit(g).await?;
        if self.release_unused(std::slice::from_ref(&id)).await {
            self.save_unlocked().await?;
        }
        if !self.inner.lock().await.state.layers.contains_key(&id) {
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
        // File system calls, on the blocking pool: a create burst runs many of these at
        // once, and the async workers must stay free to answer (a status, say).
        let (mountpoint, upper, work) = (
            mountpoint.to_owned(),
            upper.map(Path::to_owned),
            work.map(Path::to_owned),
        );
        let (mp, upper, work) = blocking(move || {
            let mp = sys::check_mountpoint(&mountpoint)?;
            let Some(u) = upper else {
                return Ok((mp, None, None));
            };
            let (u, w) = prepare_upper(&u, work.as_deref())?;
            if u.starts_with(&mp) || w.starts_with(&mp) {
                return Err(ApiError::new(
                    ErrorKind::BadRequest,
                    "the upper and work directories cannot be inside the mountpoint",
                ));
            }
            Ok((mp, Some(u), Some(w)))
        })
        .await?;
        let mut resolved = Vec::with_capacity(layers.len());
        for reference in layers {
            resolved.push(self.resolve(reference).await?);
        }
        let ids: Vec<String> = resolved.iter().map(|r| r.id.clone()).collect();
        let m = {
            let mut inner = self.inner.lock().await;
            if inner.state.mounts.contains_key(&mp) || inner.busy.contains(&mp) {
                return Err(ApiError::new(
                    ErrorKind::MountpointInUse,
                    format!("{} is already a strata mount", mp.display()),
                ));
            }
            inner.busy.insert(mp.clone());
            inner.reserve(&resolved);
            let seq = inner.state.next_seq;
            inner.state.next_seq += 1;
            MountState {
                seq,
                layers: resolved.iter().map(|r| r.canonical.clone()).collect(),
                layer_ids: ids.clone(),
                upper,
                work,
            }
        };
        let mut result = self.mount_layers(&mp, &m).await;
        let staged = {
            let mut inner = self.inner.lock().await;
            inner.unreserve(&ids);
            match result {
                Ok(()) => {
                    inner.state.mounts.insert(mp.clone(), m.clone());
                    Some(self.stage(&inner))
                }
                Err(_) => {
                    inner.busy.remove(&mp);
                    None
                }
            }
        };
        if let Some(staged) = staged {
            let committed = match staged {
                Ok(g) => self.commit(g).await,
                Err(e) => Err(e),
            };
            let mut inner = self.inner.lock().await;
            // Busy until now: no umount of it can start before it is on disk.
            inner.busy.remove(&mp);
            if let Err(e) = committed {
                inner.state.mounts.remove(&mp);
                let _ = self.stage(&inner);
                drop(inner);
                let target = mp.clone();
                if let Ok(true) = blocking(move || sys::unmount_or_detach(&target, true)).await {
                    self.mark_detached_users(&ids);
                }
                result = Err(e);
            }
        }
        if let Err(e) = result {
            if self.release_unused(&ids).await {
                let _ = self.save_unlocked().await;
            }
            return Err(e);
        }
        Ok(mount_info(&mp, &m))
    }

    /// Activate `m`'s layers and make the user mount at `mp` (the caller holds a use of each).
    pub(super) async fn mount_layers(&self, mp: &Path, m: &MountState) -> Result<()> {
        for id in &m.layer_ids {
            self.activate(id).await?;
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
        let m = {
            let mut inner = self.inner.lock().await;
            let m = inner.state.mounts.get(&mp).cloned().ok_or_else(|| {
                ApiError::new(
                    ErrorKind::NotMounted,
                    format!("{} is not a strata mount", mountpoint.display()),
                )
            })?;
            if !inner.busy.insert(mp.clone()) {
                return Err(ApiError::new(
                    ErrorKind::MountpointInUse,
                    format!("{} is being unmounted already", mp.display()),
                ));
            }
            m
        };
        let target = mp.clone();
        let unmounted = blocking(move || sys::unmount(&target, false)).await;
        let staged = {
            let mut inner = self.inner.lock().await;
            inner.busy.remove(&mp);
            match unmounted {
                Ok(()) => {
                    inner.state.mounts.remove(&mp);
                    self.stage(&inner)?
                }
                Err(e) => return Err(e),
            }
        };
        self.commit(staged).await?;
        // Saved again only if releasing the layers changed the state (a layer went).
        if self.release_unused(&m.layer_ids).await {
            self.save_unlocked().await?;
        }
        Ok(mount_info(&mp, &m))
    }
}

/// `KIND/NAME:VERSION`, or a `bad_request`-kind error saying why not.
pub(super) fn parse_ref(reference: &str) -> Result<LayerRef> {
    reference
        .parse()
        .map_err(|e| ApiError::from_store("bad layer reference", &e))
}

/// Remove a layer directory by its known entries only: never recurse into what might still
/// be a mount.
pub(super) fn remove_layer_dir(dir: &Path) {
    for f in ["meta.erofs", "meta.erofs.tmp"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let _ = std::fs::remove_dir(dir.join("mnt"));
    let _ = std::fs::remove_dir(dir);
}

pub(super) fn mount_info(mp: &Path, m: &MountState) -> MountInfo {
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
