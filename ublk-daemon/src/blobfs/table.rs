//! The inode table of a blob mount: which blobs are listed, under which inode numbers, and
//! which removed blobs are still open.
//!
//! Invariants:
//! - Inode 1 is the root directory; blob inodes start at [`FIRST_BLOB_INO`] and are never
//!   reused while the mount lives, so a stale kernel inode can never reach another blob.
//! - A listed blob is in `listed` (keyed by inode, the readdir order) and in `by_digest`.
//! - A removed blob leaves both at once; it stays in `inodes` only while a file handle is open
//!   on it (so reads through existing handles keep working), and leaves when the last is
//!   released. Opening increments the count under the read lock; removal checks it under the
//!   write lock, so the two never race.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use fs_cache::chunk::disk::BlobPin;
use fs_cache::Digest;
use fuser::BackingId;

/// The kernel's handle on a pinned level-2 blob file, and the pin that keeps the file's bytes
/// the blob's for as long as the kernel may read it.
#[derive(Debug)]
pub(crate) struct Backing {
    pub(crate) id: BackingId,
    pub(crate) _pin: Arc<BlobPin>,
}

/// The first inode number given to a blob (1 is the root; 2 is left unused).
pub(crate) const FIRST_BLOB_INO: u64 = 3;

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
    next_ino: u64,
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
    /// still open is listed again under its old inode.
    pub(crate) fn add(&self, digest: Digest, size: u64) -> Arc<Entry> {
        let mut t = self.write();
        if let Some(ino) = t.by_digest.get(&digest) {
            if let Some(e) = t.inodes.get(ino) {
                return e.clone();
            }
        }
        let reuse = t
            .inodes
            .values()
            .find(|e| e.digest == digest && e.size == size)
            .cloned();
        let entry = match reuse {
            Some(e) => e,
            None => {
                let ino = t.next_ino.max(FIRST_BLOB_INO);
                t.next_ino = ino + 1;
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
        entry
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
        let e1 = t.add(d1, 3);
        assert_eq!(e1.ino, FIRST_BLOB_INO);
        assert_eq!(t.add(d1, 3).ino, e1.ino, "add is idempotent");
        let e2 = t.add(d2, 3);
        assert_eq!(e2.ino, FIRST_BLOB_INO + 1);
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
        // Listing it again while open reuses the inode.
        assert_eq!(t.add(d1, 3).ino, e1.ino);
        assert!(t.remove(&d1).is_some());
        assert!(t.release(e1.ino).is_some(), "last handle");
        assert!(t.get(e1.ino).is_none());
        assert!(t.release(e1.ino).is_none());
        assert!(t.open(e1.ino).is_none());
        // A later add gets a fresh inode, never a reused one.
        assert_eq!(t.add(d1, 3).ino, FIRST_BLOB_INO + 2);
        let after: Vec<u64> = t.listed_after(e2.ino).iter().map(|e| e.ino).collect();
        assert_eq!(after, vec![FIRST_BLOB_INO + 2]);
    }
}
