//! Holds: blob pins that outlive the process that took them.
//!
//! A [`BlobPin`] handed to the kernel (FUSE passthrough) is read by the kernel, not by this
//! process. If the process dies, the kernel may keep reading the blob file through mounts
//! that were detached but are still in use; if the next process then evicted or dropped one
//! of those chunks, its range would be punched out and such a reader would get zeros. A hold
//! prevents that: [`BlobPin::hold`] records the pin in the index with a *token*, a path that
//! exists for as long as the kernel may read through the pin (for a FUSE mount, its
//! connection's directory under `/sys/fs/fuse/connections/`). The hold goes with the pin when
//! it is dropped. One left behind by a dead process is found by [`DiskCache::open`]: while its
//! token is alive, the blob's chunks stay pinned (not evicted, not punched out) — pinned
//! before the open evicts anything; [`DiskCache::release_stale_holds`] lets them go once the
//! token is dead. A hold whose token is dead at open is deleted.
//!
//! A token path can come back as another file (a FUSE connection number is reused by the
//! next connection, and after a reboot by the first one). So a hold also records which file
//! its token was: the boot (`/proc/sys/kernel/random/boot_id`) and the token's device and
//! inode. A token is alive only in the same boot, as the same file; a `stat` that fails for
//! another reason than "not found" counts as alive (holding too long only costs space).
//!
//! Index key: `b'h'` + blob digest (32 bytes) + nonce (u64 BE) + token bytes (an absolute
//! path, at most 4096 bytes); value `[1]` + boot id digest (16 bytes) + device (u64 LE) +
//! inode (u64 LE), 33 bytes (`index.rs`). The nonce makes every hold its own key: two pins of
//! one blob under one token (a blob pinned again while the kernel still reads through an
//! earlier pin) never share one, so dropping one never deletes the other's.
//!
//! A chunk removed while held (dropped as corrupt, say) loses its index entry at once and keeps
//! its bytes until the hold goes. If the process dies before that, the next open finds them
//! unindexed in a held blob's file: it leaves them (the earlier reader may still read them) and
//! notes the slots, which [`DiskCache::release_stale_holds`] punches out with the blob's last
//! hold. Binaries older than holds delete hold keys at open as undecodable (the index format
//! string did not change).

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{OnceLock, PoisonError};

use super::{
    encode_hold_value, BlobPin, ChunkId, DiskCache, TokenId, EVICTIONS, RECOVERED_ORPHANS,
};
use crate::error::{Error, Result};
use crate::store::Digest;

/// A hold found at open whose token was alive: the chunks it pins.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) blob: Digest,
    pub(super) token: PathBuf,
    pub(super) id: TokenId,
    pub(super) chunks: Vec<ChunkId>,
}

/// A hold as recorded in the index.
#[derive(Debug)]
pub(super) struct Recorded {
    pub(super) blob: Digest,
    pub(super) token: PathBuf,
    pub(super) id: TokenId,
    pub(super) key: Box<[u8]>,
}

/// This boot's id, digested (zeros where `/proc` does not tell: then only the token's device
/// and inode are compared).
fn boot_id() -> [u8; 16] {
    static BOOT: OnceLock<[u8; 16]> = OnceLock::new();
    *BOOT.get_or_init(|| {
        let mut b = [0u8; 16];
        if let Ok(text) = std::fs::read("/proc/sys/kernel/random/boot_id") {
            b.copy_from_slice(&blake3::hash(&text).as_bytes()[..16]);
        }
        b
    })
}

/// Which file `token` is now.
pub(super) fn token_id(token: &Path) -> std::io::Result<TokenId> {
    let m = std::fs::symlink_metadata(token)?;
    Ok(TokenId {
        boot: boot_id(),
        dev: m.dev(),
        ino: m.ino(),
    })
}

/// Whether the hold's token is still the file it was when the hold was taken.
pub(super) fn token_alive(token: &Path, id: &TokenId) -> bool {
    if id.boot != boot_id() {
        return false;
    }
    match std::fs::symlink_metadata(token) {
        Ok(m) => (m.dev(), m.ino()) == (id.dev, id.ino),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

/// A nonce no other hold of this or an earlier process uses: the blake3 of this process's
/// id, the time and a counter.
fn nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.update(&now.as_nanos().to_le_bytes());
    h.update(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let mut n = [0u8; 8];
    n.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(n)
}

impl BlobPin {
    /// Keep this pin's chunks pinned past the death of this process, for as long as `token`
    /// is the file it is now (module docs). Replaces an earlier hold of this pin; dropping
    /// the pin deletes it. `token` must exist and be an absolute path of at most 4096 bytes.
    pub fn hold(&mut self, token: &Path) -> Result<()> {
        let key = super::hold_key(&self.blob, nonce(), token).ok_or_else(|| {
            self.cache.error(format!(
                "a hold's token must be an absolute path of at most 4096 bytes: {}",
                token.display()
            ))
        })?;
        let id = token_id(token).map_err(|e| Error::io("stat the hold's token", token, e))?;
        let old = self.hold.take();
        let written = self.cache.write_index(
            |b| {
                if let Some(old) = &old {
                    b.delete(old);
                }
                b.put(&key, encode_hold_value(&id));
            },
            "cannot record a hold",
        );
        match written {
            Ok(()) => {
                self.hold = Some(key);
                Ok(())
            }
            Err((e, _)) => {
                self.hold = old;
                Err(e)
            }
        }
    }

    /// Delete this pin's hold (on drop).
    pub(super) fn unhold(&mut self) {
        if let Some(key) = self.hold.take() {
            if let Err((e, _)) = self
                .cache
                .write_index(|b| b.delete(&key), "cannot delete a hold")
            {
                // Left in the index: the next open deletes it once its token is dead.
                tracing::warn!(blob = %self.blob, error = %e, "chunk cache: a hold stays recorded");
            }
        }
    }
}

impl DiskCache {
    /// Let go of the holds found at open whose token is dead: their chunks can be evicted
    /// again, and are, down to the capacity. Returns how many holds went. On an error
    /// writing the index the chunks are released all the same (their keys are deleted at
    /// the next open, whose token check finds them dead).
    pub fn release_stale_holds(&self) -> Result<usize> {
        let gone: Vec<(Vec<u8>, Held)> = {
            let mut holds = self.holds.lock().unwrap_or_else(PoisonError::into_inner);
            let keys: Vec<Vec<u8>> = holds
                .iter()
                .filter(|(_, h)| !token_alive(&h.token, &h.id))
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter()
                .filter_map(|k| holds.remove(&k).map(|h| (k, h)))
                .collect()
        };
        if gone.is_empty() {
            return Ok(0);
        }
        let written = self.write_index(
            |b| gone.iter().for_each(|(k, _)| b.delete(k)),
            "cannot delete stale holds",
        );
        for (_, held) in &gone {
            tracing::info!(
                token = %held.token.display(),
                chunks = held.chunks.len(),
                "chunk cache: a hold left by an earlier process is released"
            );
            for id in &held.chunks {
                self.release(id);
            }
        }
        // What the holds kept over the capacity goes now rather than at the next put.
        let victims = {
            let mut st = self.lock();
            let over = st.present.saturating_sub(self.capacity);
            st.doom_lru(over)
        };
        self.discard(victims, Some(EVICTIONS))?;
        // The slots a released blob's file kept for the earlier reader go with its last hold.
        let still: HashSet<Digest> = (self.holds.lock().unwrap_or_else(PoisonError::into_inner))
            .values()
            .map(|h| h.blob)
            .collect();
        let released: HashSet<Digest> = gone.iter().map(|(_, h)| h.blob).collect();
        for blob in released.difference(&still) {
            if let Err(e) = self.punch_held_orphans(blob) {
                tracing::warn!(%blob, error = %e, "chunk cache: bytes of chunks removed under a hold left for the next open");
            }
        }
        written.map_err(|(e, _)| e)?;
        Ok(gone.len())
    }

    /// Punch out the slots of `blob`'s file noted at open as unindexed under a hold (see
    /// `held_orphans`), each claimed in flight first so that no put writes it meanwhile; a
    /// slot cached again since is left alone. The punch holds a reference to the blob (as a
    /// chunk in flight does), so its file is neither removed nor given another shift under
    /// it; a blob with no chunk left has no file to punch.
    fn punch_held_orphans(&self, blob: &Digest) -> Result<()> {
        let Some((shift, slots)) = (self.held_orphans.lock())
            .unwrap_or_else(PoisonError::into_inner)
            .remove(blob)
        else {
            return Ok(());
        };
        let claimed: Vec<ChunkId> = {
            let mut st = self.lock();
            match st.per_blob.get_mut(blob) {
                Some(refs) if refs.shift == shift => refs.chunks += 1,
                _ => return Ok(()),
            }
            let mut claimed = Vec::with_capacity(slots.len());
            for index in slots {
                let id = ChunkId::new(*blob, shift, index);
                if !st.lru.contains(&id) && st.inflight.insert(id) {
                    claimed.push(id);
                }
            }
            claimed
        };
        let punched = claimed
            .iter()
            .try_for_each(|id| self.punch(id, id.chunk_size()));
        let mut st = self.lock();
        for id in &claimed {
            st.inflight.remove(id);
        }
        if punched.is_ok() {
            st.count(RECOVERED_ORPHANS, claimed.len() as u64);
        }
        self.drop_blob_ref(&mut st, blob);
        punched
    }

    /// Holds of earlier processes still in force (found at open, not yet released): blob and
    /// token of each.
    pub fn stale_holds(&self) -> Vec<(Digest, PathBuf)> {
        let holds = self.holds.lock().unwrap_or_else(PoisonError::into_inner);
        holds.values().map(|h| (h.blob, h.token.clone())).collect()
    }
}

/// At open: keep the recorded holds whose token is alive; the keys of the others go to
/// `delete`.
pub(super) fn sort_holds(found: Vec<Recorded>, delete: &mut Vec<Box<[u8]>>) -> Vec<Recorded> {
    let mut live = Vec::new();
    for r in found {
        if token_alive(&r.token, &r.id) {
            live.push(r);
        } else {
            delete.push(r.key);
        }
    }
    live
}

/// At open, under the state lock, before any eviction: pin the indexed chunks of every live
/// hold.
pub(super) fn pin_held(
    st: &mut super::State,
    live: Vec<Recorded>,
    indexed: &HashMap<Digest, (u8, HashSet<u64>)>,
) -> HashMap<Vec<u8>, Held> {
    let mut held = HashMap::new();
    for r in live {
        let blob = r.blob;
        let mut chunks: Vec<ChunkId> = indexed
            .get(&blob)
            .into_iter()
            .flat_map(|(shift, set)| set.iter().map(|&index| ChunkId::new(blob, *shift, index)))
            .collect();
        chunks.sort_unstable_by_key(|c| c.index);
        for id in &chunks {
            st.pin(id);
        }
        tracing::info!(
            %blob,
            token = %r.token.display(),
            chunks = chunks.len(),
            "chunk cache: kept pinned for a reader left by an earlier process"
        );
        held.insert(
            r.key.into_vec(),
            Held {
                blob,
                token: r.token,
                id: r.id,
                chunks,
            },
        );
    }
    held
}
