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
//! token exists, the blob's chunks stay pinned (not evicted, not punched out);
//! [`DiskCache::release_stale_holds`] lets them go once the token is gone. A hold whose token
//! is gone at open is deleted.
//!
//! Index key: `b'h'` + blob digest (32 bytes) + token bytes (an absolute path, at most 4096
//! bytes); value `[1]`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::PoisonError;

use super::{BlobPin, ChunkId, DiskCache, HOLD_VALUE};
use crate::error::Result;
use crate::store::Digest;

/// A hold found at open whose token still existed: the chunks it pins.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) blob: Digest,
    pub(super) token: PathBuf,
    pub(super) chunks: Vec<ChunkId>,
}

/// Whether a hold's token still exists (an error other than "not found" counts as existing:
/// holding too long only costs space).
pub(super) fn token_alive(token: &Path) -> bool {
    match std::fs::symlink_metadata(token) {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

impl BlobPin {
    /// Keep this pin's chunks pinned past the death of this process, for as long as `token`
    /// exists (module docs). Replaces an earlier hold of this pin; dropping the pin deletes
    /// it. `token` must be an absolute path of at most 4096 bytes.
    pub fn hold(&mut self, token: &Path) -> Result<()> {
        let key = super::hold_key(&self.blob, token).ok_or_else(|| {
            self.cache.error(format!(
                "a hold's token must be an absolute path of at most 4096 bytes: {}",
                token.display()
            ))
        })?;
        let old = self.hold.take();
        let written = self.cache.write_index(
            |b| {
                if let Some(old) = &old {
                    b.delete(old);
                }
                b.put(&key, HOLD_VALUE);
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
                // Left in the index: the next open deletes it once its token is gone.
                tracing::warn!(blob = %self.blob, error = %e, "chunk cache: a hold stays recorded");
            }
        }
    }
}

impl DiskCache {
    /// Let go of the holds found at open whose token no longer exists: their chunks can be
    /// evicted again. Returns how many went.
    pub fn release_stale_holds(&self) -> Result<usize> {
        let gone: Vec<(Vec<u8>, Held)> = {
            let mut holds = self.holds.lock().unwrap_or_else(PoisonError::into_inner);
            let keys: Vec<Vec<u8>> = holds
                .iter()
                .filter(|(_, h)| !token_alive(&h.token))
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
        written.map_err(|(e, _)| e)?;
        Ok(gone.len())
    }

    /// Blobs held by earlier processes (holds found at open, not yet released).
    pub fn stale_holds(&self) -> Vec<(Digest, PathBuf)> {
        let holds = self.holds.lock().unwrap_or_else(PoisonError::into_inner);
        holds.values().map(|h| (h.blob, h.token.clone())).collect()
    }
}

/// A hold recorded in the index: blob, token, key.
pub(super) type Recorded = (Digest, PathBuf, Box<[u8]>);

/// At open: keep the recorded holds whose token is alive; the keys of the others go to
/// `delete`.
pub(super) fn sort_holds(found: Vec<Recorded>, delete: &mut Vec<Box<[u8]>>) -> Vec<Recorded> {
    let mut live = Vec::new();
    for (blob, token, key) in found {
        if token_alive(&token) {
            live.push((blob, token, key));
        } else {
            delete.push(key);
        }
    }
    live
}

/// At open, under the state lock: pin the indexed chunks of every live hold.
pub(super) fn pin_held(
    st: &mut super::State,
    live: Vec<Recorded>,
    indexed: &HashMap<Digest, std::collections::HashSet<u64>>,
) -> HashMap<Vec<u8>, Held> {
    let mut held = HashMap::new();
    for (blob, token, key) in live {
        let mut chunks: Vec<ChunkId> = indexed
            .get(&blob)
            .into_iter()
            .flatten()
            .map(|&index| ChunkId { blob, index })
            .collect();
        chunks.sort_unstable_by_key(|c| c.index);
        for id in &chunks {
            st.pin(id);
        }
        tracing::info!(
            %blob,
            token = %token.display(),
            chunks = chunks.len(),
            "chunk cache: kept pinned for a reader left by an earlier process"
        );
        held.insert(
            key.into_vec(),
            Held {
                blob,
                token,
                chunks,
            },
        );
    }
    held
}
