//! Local devices: a layer whose blob is wholly in level 2 when it is mounted, on a node where
//! FUSE passthrough cannot be used, gets the level-2 file itself as its EROFS `device=`.
//!
//! FUSE passthrough is how a warm layer is read without the daemon where the kernel allows it
//! (`BlobFs::enable_passthrough`). Kernels with EROFS's stacking limit for file-backed mounts
//! (Linux 6.19, and stable kernels it was backported to, such as 6.18.44) refuse every
//! `device=` on a passthrough blob mount (`sys::erofs_takes_stacked_devices`), and some
//! kernels refuse FUSE passthrough itself. On those, the blob's level-2 file — which, once
//! every chunk is in it and pinned, holds exactly the blob's bytes ([`BlobPin`]) — is handed
//! to EROFS directly: no FUSE request, no daemon, on a plain local filesystem (depth 0, so
//! overlayfs still stacks on the layer). `cargo bench -p bench --bench lazy_read` measured
//! EROFS over such a local file at 0.97–1.09× the local disk.
//!
//! ## What keeps the bytes there
//! As for passthrough: the chunks are pinned ([`ChunkCache::pin_local`]), checked whole once
//! ([`BlobPin::verify`]), and *held* ([`BlobPin::hold`]) with a token whose life bounds the
//! kernel's reads: the file `layers/<id>/local-device`, made before the mount. The node keeps
//! the pins while the layer is mounted; a clean unmount drops them, then removes the token
//! and releases any hold an earlier daemon left on it. Across a crash or a handover the
//! holds stay recorded (the pins keep their holds, [`BlobPin::keep_hold`], before a
//! handover) and the next daemon, which adopts the mount, keeps the chunks pinned while the
//! token exists. A mount that could only be detached lazily (still in use) may still be read,
//! and so may the layer's superblock after its own clean unmount when a user mount on it was
//! detached (an overlay keeps its own copy of each lower mount), after a failed unmount, and
//! when a new daemon detached an earlier one's mounts at start: then the marker [`KEEP`] is
//! written, and the token and holds stay for good (pinned until the run directory goes at
//! reboot: a cost in level-2 space, never a wrong byte).

use fs_cache::chunk::disk::BlobPin;
use fs_cache::Digest;

use super::Node;
use crate::blobfs::BlobFs;

/// The token file of a layer's local-device holds, in its layer directory.
pub(super) const TOKEN: &str = "local-device";
/// A marker beside it: some mount of the layer (its own, or a user mount on it) was only
/// detached lazily, so a superblock of it may still read its level-2 files: its token and
/// holds are never let go again (until the run directory goes, at reboot).
pub(super) const KEEP: &str = "local-device.keep";

impl Node {
    /// Whether warm blobs are read through local devices on this node: passthrough is
    /// configured, but FUSE passthrough is not available here.
    pub(super) fn local_devices(&self, blobfs: &BlobFs) -> bool {
        self.config.passthrough && !blobfs.passthrough_available()
    }

    /// Before a layer's EROFS is mounted: if `blob` is wholly in level 2 and the node reads
    /// warm blobs through local devices (with room under the pin budget, `pinned` bytes
    /// pinned so far), pin, check and hold its chunks and return the pin, whose
    /// [`BlobPin::path`] is the mount's `device=`. `None`: the blob is read through the blob
    /// mount as usual.
    pub(super) async fn try_local_device(
        &self,
        blobfs: &BlobFs,
        blob: &Digest,
        layer: &str,
        pinned: u64,
    ) -> Option<BlobPin> {
        if !self.local_devices(blobfs) {
            return None;
        }
        let size = match self.cache.blob_size(blob).await {
            Ok(size) => size,
            Err(e) => {
                tracing::warn!(%blob, layer, error = %e, "no local device: blob size unknown");
                return None;
            }
        };
        if let Some(why) = self.passthrough_refusal(blobfs, size, pinned) {
            tracing::debug!(%blob, layer, "no local device: {why}");
            return None;
        }
        let token = self.layer_dir(layer).join(TOKEN);
        let started = std::time::Instant::now();
        // The token exists before the hold names it. One this call makes is named by no
        // hold yet (the layer's lock keeps other mounts of it out), so it goes again if no
        // pin is held by it.
        let made = !token.exists();
        if let Err(e) = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&token)
        {
            tracing::warn!(%blob, layer, error = %e, "no local device: create {}", token.display());
            return None;
        }
        let held = self.cache.pin_local_held(blob, token.clone()).await;
        if made && !matches!(held, Ok(Some(_))) {
            let _ = std::fs::remove_file(&token);
        }
        match held {
            Ok(Some(pin)) => {
                tracing::info!(
                    %blob,
                    layer,
                    bytes = size,
                    checked_in_ms = started.elapsed().as_millis() as u64,
                    "every chunk is in level 2: the layer reads the level-2 file directly"
                );
                Some(pin)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(%blob, layer, error = %e, "no local device");
                None
            }
        }
    }

    /// Bytes of level 2 pinned by this node's local devices (mounted and detached layers).
    pub(super) fn local_device_bytes(inner: &super::Inner) -> u64 {
        (inner.local_devices.values().flatten())
            .chain(&inner.detached_pins)
            .map(BlobPin::len)
            .sum()
    }

    /// After layer `id`'s EROFS was unmounted (`detached`: only detached lazily, perhaps
    /// still read): let its local devices go, or, if it was detached, keep them (module
    /// docs).
    pub(super) async fn end_local_devices(&self, id: &str, detached: bool) {
        let released = {
            let mut inner = self.inner.lock().await;
            self.end_local_devices_locked(&mut inner, id, detached)
        };
        if released {
            self.release_token_holds().await;
        }
    }

    /// [`Self::end_local_devices`] under the node's lock; `true` if a token went, so that
    /// holds an earlier daemon left on it can be released ([`Self::release_token_holds`]).
    pub(super) fn end_local_devices_locked(
        &self,
        inner: &mut super::Inner,
        id: &str,
        detached: bool,
    ) -> bool {
        let dir = self.layer_dir(id);
        let token = dir.join(TOKEN);
        let pins = inner.local_devices.remove(id);
        let token_there = token.exists();
        if detached {
            keep_token(&dir);
        }
        if dir.join(KEEP).exists() {
            if pins.is_some() || token_there {
                tracing::warn!(
                    layer = id,
                    "a mount of this layer was detached while in use: its level-2 files stay \
                     pinned while {} exists",
                    token.display()
                );
            }
            for mut pin in pins.into_iter().flatten() {
                pin.keep_hold();
                inner.detached_pins.push(pin);
            }
            return false;
        }
        drop(pins);
        if !token_there {
            return false;
        }
        match std::fs::remove_file(&token) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "remove {}", token.display());
                false
            }
        }
    }

    /// Record that mounts of `layers` were only detached lazily (a user mount on them, or
    /// their own): those with a local-device token keep it for good ([`KEEP`]).
    pub(super) fn mark_detached_users(&self, layers: &[String]) {
        for id in layers {
            keep_token(&self.layer_dir(id));
        }
    }

    /// Release the holds whose token is gone (an earlier daemon's, on a token just removed).
    pub(super) async fn release_token_holds(&self) {
        if let Err(e) = self.cache.release_stale_holds().await {
            tracing::warn!(error = %e, "releasing stale level-2 holds");
        }
    }

    /// Before a handover: the next daemon adopts the mounts, so the local devices' holds must
    /// outlive this process's pins.
    pub(super) fn keep_local_device_holds(inner: &mut super::Inner) {
        for pin in inner.local_devices.values_mut().flatten() {
            pin.keep_hold();
        }
    }
}

/// After an earlier daemon's mounts were detached at start (`detached`: their mount points):
/// a layer mount among them with a local-device token may still be read by whoever kept it,
/// so its token and holds stay for good ([`KEEP`]).
pub(super) fn keep_detached(detached: &[std::path::PathBuf]) {
    for m in detached.iter().filter(|m| m.ends_with("mnt")) {
        if let Some(dir) = m.parent() {
            keep_token(dir);
        }
    }
}

/// If layer directory `dir` has a local-device token, mark it kept for good ([`KEEP`]).
fn keep_token(dir: &std::path::Path) {
    if dir.join(TOKEN).exists() {
        if let Err(e) = std::fs::write(dir.join(KEEP), b"") {
            tracing::warn!(error = %e, "mark {}", dir.join(KEEP).display());
        }
    }
}
