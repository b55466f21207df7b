//! The inode table of a blob mount: which blobs are listed, under which inode numbers, and
//! which removed blobs are still open.
//!
//! Invariants:
//! - Inode 1 is the root directory; a blob's inode number (and file handle) is a function of
//!   its digest alone ([`ino_of`]), so a daemon that takes over a live connection from the
//!   fd holder answers the inodes and handles the kernel already holds (an EROFS mount keeps
//!   its blob files open for its whole life) with no state handed over. A stale kernel inode
//!   can never reach another blob: two listed blobs whose numbers collide are refused.
//! - A listed blob is in `listed` (keyed by inode, the readdir order) and in `by_digest`.
//! - A removed blob leaves both at once; it stays in `inodes` only while a file handle is open
//!   on it (so reads through existing handles keep working), and leaves when the last is
//!   released. Opening increments the count under the read lock; removal checks it under the
//!   write lock, so the two never race.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use std::sync::Weak;

use fs_cache::chunk::disk::BlobPin;
use fs_cache::Digest;

use crate::fuse::Channel;

/// The kernel's handle on a pinned level-2 blob file, and the pin that keeps the file's bytes
/// the blob's for as long as the kernel may read it. Dropping it closes the backing id.
#[derive(Debug)]
pub(crate) struct Backing {
    pub(crate) id: i32,
    pub(crate) channel: Weak<Channel>,
    pub(crate) _pin: Arc<BlobPin>,
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Some(ch) = self.channel.upgrade() {
            if let Err(e) = ch.backing_close(self.id) {
                tracing::debug!(id = self.id, error = %e, "FUSE_DEV_IOC_BACKING_CLOSE failed");
            }
        }
    }
}

/// The inode number (and file handle) of `digest`'s file: its first 8 bytes with the top two
/// bits set, so never the root (1) nor 0, stable across daemons.
pub(crate) fn ino_of(digest: &Digest) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest.0[..8]);
    u64::from_le_bytes(b) | (0b11 << 62)
}

/// One blob file.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) ino: u64,
    pub(crate) digest: Digest,
    pub(crate) name: String,
    pub(crate) size: u64,
    /// Open file handles.
    pub(crate) open: AtomicU64,
    /// Shown in the root directory (not removed).
    pub(crate) listed: AtomicBool,
    /// The blob's chunks pinned in level 2 (its file is the blob), for passthrough opens.
    pub(crate) local: Mutex<Option<Arc<BlobPin>>>,
    /// The kernel's handle on that file, shared by every passthrough open of this blob and
    /// closed (with its pin released) when the last of them is released.
    pub(crate) backing: Mutex<Option<Arc<Backing>>>,
}

impl Entry {
    pub(crate) fn local(&self) -> MutexGuard<'_, Option<Arc<BlobPin>>> {
        // Plain values: a panic elsewhere cannot leave them half-written.
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn backing(&self) -> MutexGuard<'_, Option<Arc<Backing>>> {
        self.backing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug, Default)]
struct Inner {
    listed: BTreeMap<u64, Arc<Entry>>,
    by_digest: HashMap<Digest, u64>,
    inodes: HashMap<u64, Arc<Entry>>,
}

/// The table (shared between the FUSE threads and the [`super::BlobFs`] handle).
#[derive(Debug, Default)]
pub(crate) struct Table {
    inner: RwLock<Inner>,
}

impl Table {
    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        // Every critical section leaves the maps consistent between statements.
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// List `digest` (of `size` bytes); returns its entry. Idempotent; a removed blob that is
    /// still open is listed again under its inode. `Err` names the listed blob whose inode
    /// number collides with this one's (about one chance in 2^62 per pair).
    pub(crate) fn add(&self, digest: Digest, size: u64) -> Result<Arc<Entry>, Digest> {
        let mut t = self.write();
        let ino = ino_of(&digest);
        if let Some(e) = t.inodes.get(&ino) {
            if e.digest != digest {
                return Err(e.digest);
            }
        }
        let reuse = t.inodes.get(&ino).cloned();
        let entry = match reuse {
            Some(e) => e,
            None => {
                let e = Arc::new(Entry {
                    ino,
                    digest,
                    name: digest.to_hex(),
                    size,
                    open: AtomicU64::new(0),
                    listed: AtomicBool::new(true),
                    local: Mutex::new(None),
                    backing: Mutex::new(None),
                });
                t.inodes.insert(ino, e.clone());
                e
            }
        };
        entry.listed.store(true, Ordering::Release);
        t.listed.insert(entry.ino, entry.clone());
        t.by_digest.insert(digest, entry.ino);
        Ok(entry)
    }

    /// Unlist `digest`; returns the entry it had, or `None` if it was not listed.
    pub(crate) fn remove(&self, digest: &Digest) -> Option<Arc<Entry>> {
        let mut t = self.write();
        let ino = t.by_digest.remove(digest)?;
        let e = t.listed.remove(&ino)?;
        e.listed.store(false, Ordering::Release);
        if e.open.load(Ordering::Acquire) == 0 {
            t.inodes.remove(&ino);
        }
        Some(e)
    }

    /// The listed blob named `name` (a hex digest).
    pub(crate) fn lookup(&self, name: &str) -> Option<Arc<Entry>> {
        self.listed(&name.parse().ok()?)
    }

    /// The listed blob `digest`.
    pub(crate) fn listed(&self, digest: &Digest) -> Option<Arc<Entry>> {
        let t = self.read();
        let ino = t.by_digest.get(digest)?;
        t.listed.get(ino).cloned()
    }

    /// The blob with inode `ino` (listed, or removed but still open).
    pub(crate) fn get(&self, ino: u64) -> Option<Arc<Entry>> {
        self.read().inodes.get(&ino).cloned()
    }

    /// Count a new open handle on `ino`; `None` if there is no such blob.
    pub(crate) fn open(&self, ino: u64) -> Option<Arc<Entry>> {
        let t = self.read();
        let e = t.inodes.get(&ino)?;
        e.open.fetch_add(1, Ordering::AcqRel);
        Some(e.clone())
    }

    /// Release one open handle on `ino`; forgets a removed blob with its last handle. Returns
    /// the entry when that was its last open handle.
    pub(crate) fn release(&self, ino: u64) -> Option<Arc<Entry>> {
        let e = self.get(ino)?;
        let before = e
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .unwrap_or(0);
        if before != 1 {
            return None;
        }
        if !e.listed.load(Ordering::Acquire) {
            let mut t = self.write();
            if e.open.load(Ordering::Acquire) == 0 && !e.listed.load(Ordering::Acquire) {
                t.inodes.remove(&ino);
            }
        }
        Some(e)
    }

    /// Listed blobs with inode numbers above `after`, in inode order.
    pub(crate) fn listed_after(&self, after: u64) -> Vec<Arc<Entry>> {
        let t = self.read();
        t.listed
            .range(after.saturating_add(1)..)
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// Number of listed blobs and their total size.
    pub(crate) fn totals(&self) -> (u64, u64) {
        let t = self.read();
        let n = t.listed.len() as u64;
        (n, t.listed.values().map(|e| e.size).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_remove_and_open_handles() {
        let t = Table::default();
        let d1 = Digest::of(b"one");
        let d2 = Digest::of(b"two");
        let e1 = t.add(d1, 3).unwrap();
        assert_eq!(e1.ino, ino_of(&d1));
        assert!(e1.ino > 1 << 62, "never the root");
        assert_eq!(t.add(d1, 3).unwrap().ino, e1.ino, "add is idempotent");
        let e2 = t.add(d2, 3).unwrap();
        assert_ne!(e2.ino, e1.ino);
        assert_eq!(t.lookup(&d2.to_hex()).map(|e| e.ino), Some(e2.ino));
        assert!(t.lookup("not-hex").is_none());
        assert_eq!(t.totals(), (2, 6));

        // A removed blob that is open stays readable until released.
        assert!(t.open(e1.ino).is_some());
        assert!(t.remove(&d1).is_some());
        assert!(t.remove(&d1).is_none());
        assert!(t.lookup(&d1.to_hex()).is_none());
        assert_eq!(t.listed_after(0).len(), 1);
        assert!(t.get(e1.ino).is_some());
        // Listing it again while open keeps its entry.
        assert!(Arc::ptr_eq(&t.add(d1, 3).unwrap(), &e1));
        assert!(t.remove(&d1).is_some());
        assert!(t.release(e1.ino).is_some(), "last handle");
        assert!(t.get(e1.ino).is_none());
        assert!(t.release(e1.ino).is_none());
        assert!(t.open(e1.ino).is_none());
        // A later add gets the same number: a function of the digest, as a new daemon sees it.
        assert_eq!(t.add(d1, 3).unwrap().ino, ino_of(&d1));
        let mut all: Vec<u64> = vec![e1.ino, e2.ino];
        all.sort();
        let listed: Vec<u64> = t.listed_after(0).iter().map(|e| e.ino).collect();
        assert_eq!(listed, all, "readdir order is inode order");
        // A release the table never saw the open of (a handle opened under an earlier
        // daemon) changes nothing.
        assert!(t.release(e2.ino).is_none());
        assert!(t.get(e2.ino).is_some());
    }
}
