//! Meta images kept in memory while their layer is mounted.
//!
//! The kernel's EROFS reads a layer's metadata — inodes, directories, xattrs, and the data of
//! the small files inline in the meta image — through the page cache of the meta image file,
//! one 4 KiB block at a time and without readahead (`erofs_bread` → `read_mapping_folio`).
//! Once those pages are evicted, every block a read needs again is one synchronous disk read:
//! a 10% read of a Debian minbase layer touches about 525 of its ~600 blocks, 0.026 s of a
//! 0.118 s read (`bench/README.md`, "peers"). nydusd keeps its RAFS metadata in its own
//! memory; the node keeps the kernel's copy instead: each mounted layer's meta image is mapped
//! shared and read-only, populated and `mlock`ed, so its pages stay in the page cache — neither
//! reclaim nor `drop_caches` evicts a locked page — and EROFS finds them there.
//!
//! ## Invariants
//! - A pin lives exactly as long as its layer's EROFS mount in this process: made after the
//!   mount (or after a takeover found it mounted), dropped when the layer is taken down. It
//!   holds the file's pages, never a copy: the meta image is immutable while mounted.
//! - The pinned bytes never exceed the node's budget ([`MetaPins::new`],
//!   `NodeConfig::meta_pin_bytes`, `strata daemon --meta-pin-mb`): a meta image that does not
//!   fit is left to the page cache, as without pins. Bytes being mapped count against the
//!   budget before the mapping exists, so concurrent pins cannot overshoot it.
//! - Pins are this process's: a daemon that dies releases them with its address space, and
//!   the next daemon (restore or takeover) pins its layers again.
//! - No lock is held while a file is mapped or populated.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Mutex;

/// The default budget for pinned meta images (`NodeConfig::meta_pin_bytes`): a Debian minbase
/// layer's meta image is 2.5 MB, a 47k-file `/usr/share`'s 15.6 MB with its small files
/// inline.
pub const DEFAULT_META_PIN_BYTES: u64 = 512 << 20;

/// One meta image, mapped and locked.
struct Pinned {
    addr: NonNull<libc::c_void>,
    len: usize,
}

// SAFETY: the mapping is read-only and private to this struct; nothing reads through the
// pointer, which is only passed back to munmap(2) once, in `drop`.
unsafe impl Send for Pinned {}

impl Pinned {
    /// Map the whole of `path` read-only and shared, populate it and lock it in memory.
    fn map(path: &Path) -> std::io::Result<Pinned> {
        let f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        let len = usize::try_from(len)
            .ok()
            .filter(|l| *l > 0)
            .ok_or_else(|| std::io::Error::other(format!("meta image of {len} bytes")))?;
        // SAFETY: a new mapping at an address the kernel picks, of a file this function opened;
        // no existing memory is affected. MAP_FAILED is checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                f.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let pinned = Pinned {
            addr: NonNull::new(addr).ok_or_else(|| std::io::Error::other("mmap returned null"))?,
            len,
        };
        // SAFETY: `addr..addr + len` is the mapping made above; on failure `pinned` unmaps it.
        if unsafe { libc::mlock(pinned.addr.as_ptr(), len) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(pinned)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` made, unmapped once (which also unlocks it); no reference
        // into it exists.
        unsafe {
            libc::munmap(self.addr.as_ptr(), self.len);
        }
    }
}

/// The node's pinned meta images, by layer id, within a budget.
pub(super) struct MetaPins {
    budget: u64,
    inner: Mutex<Pins>,
}

#[derive(Default)]
struct Pins {
    by_layer: HashMap<String, Pinned>,
    /// Bytes pinned plus bytes being mapped now.
    used: u64,
}

impl MetaPins {
    /// Pins of at most `budget` bytes in all (0: none).
    pub(super) fn new(budget: u64) -> MetaPins {
        MetaPins {
            budget,
            inner: Mutex::new(Pins::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pins> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pin layer `id`'s meta image at `path` (blocking: it reads what is not in the page
    /// cache). Whether it is pinned now; a meta image beyond the budget, or one that cannot be
    /// mapped or locked, stays unpinned (logged), and the layer works as before.
    pub(super) fn pin(&self, id: &str, path: &Path) -> bool {
        let size = match std::fs::metadata(path) {
            Ok(md) => md.len(),
            Err(e) => {
                tracing::warn!(layer = id, error = %e, "meta image not pinned");
                return false;
            }
        };
        {
            let mut p = self.lock();
            if p.by_layer.contains_key(id) {
                return true;
            }
            if p.used.saturating_add(size) > self.budget {
                tracing::debug!(
                    layer = id,
                    bytes = size,
                    pinned = p.used,
                    budget = self.budget,
                    "meta image not pinned: over the budget"
                );
                return false;
            }
            p.used += size;
        }
        let mapped = Pinned::map(path);
        let mut p = self.lock();
        p.used -= size;
        match mapped {
            Ok(pin) => {
                // Another request for the same layer cannot have pinned it meanwhile: the
                // caller holds the layer's lock.
                p.used += pin.len as u64;
                if let Some(old) = p.by_layer.insert(id.to_owned(), pin) {
                    p.used -= old.len as u64;
                }
                true
            }
            Err(e) => {
                tracing::warn!(layer = id, error = %e, "meta image not pinned");
                false
            }
        }
    }

    /// Let layer `id`'s meta image go (its layer is taken down).
    pub(super) fn unpin(&self, id: &str) {
        let pin = {
            let mut p = self.lock();
            let pin = p.by_layer.remove(id);
            if let Some(pin) = &pin {
                p.used -= pin.len as u64;
            }
            pin
        };
        drop(pin);
    }

    /// Whether layer `id`'s meta image is pinned.
    pub(super) fn pinned(&self, id: &str) -> bool {
        self.lock().by_layer.contains_key(id)
    }

    /// Bytes pinned and how many meta images hold them.
    pub(super) fn totals(&self) -> (u64, u64) {
        let p = self.lock();
        let bytes = p.by_layer.values().map(|x| x.len as u64).sum();
        (bytes, p.by_layer.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `path` resident in the page cache, and its pages in all (mincore(2)).
    fn resident(path: &Path) -> (usize, usize) {
        let f = std::fs::File::open(path).unwrap();
        let len = f.metadata().unwrap().len() as usize;
        let pages = len.div_ceil(4096);
        let mut vec = vec![0u8; pages];
        // SAFETY: a fresh read-only mapping of a file opened here, only handed to mincore and
        // unmapped before returning.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(libc::mincore(p, len, vec.as_mut_ptr()), 0);
            libc::munmap(p, len);
        }
        (vec.iter().filter(|b| **b & 1 == 1).count(), pages)
    }

    /// Ask the kernel to drop `path`'s clean, unmapped, unlocked pages.
    fn evict(path: &Path) {
        let f = std::fs::File::open(path).unwrap();
        // SAFETY: plain syscall on a descriptor owned here.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0);
    }

    fn file(dir: &Path, name: &str, len: usize) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, vec![7u8; len]).unwrap();
        // Written pages are dirty until synced, and DONTNEED keeps dirty pages.
        std::fs::File::open(&path).unwrap().sync_all().unwrap();
        path
    }

    #[test]
    fn a_pinned_meta_image_stays_resident_within_the_budget() {
        let tmp = tempfile::tempdir().unwrap();
        let a = file(tmp.path(), "a", 64 << 10);
        let b = file(tmp.path(), "b", 48 << 10);
        let pins = MetaPins::new(100 << 10);
        assert!(pins.pin("a", &a));
        assert!(pins.pin("a", &a), "pinning twice is one pin");
        // b does not fit beside a.
        assert!(!pins.pin("b", &b));
        assert_eq!(pins.totals(), (64 << 10, 1));
        evict(&a);
        evict(&b);
        assert_eq!(resident(&a), (16, 16), "the pinned image stays");
        pins.unpin("a");
        assert_eq!(pins.totals(), (0, 0));
        assert!(!pins.pinned("a"));
        assert!(pins.pin("b", &b), "room again once a is gone");
        evict(&a);
        let (left, _) = resident(&a);
        assert!(
            left < 16,
            "an unpinned image can be evicted: {left} of 16 pages stayed"
        );
    }

    #[test]
    fn a_zero_budget_or_a_missing_file_pins_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let a = file(tmp.path(), "a", 4096);
        assert!(!MetaPins::new(0).pin("a", &a));
        let pins = MetaPins::new(1 << 20);
        assert!(!pins.pin("x", &tmp.path().join("missing")));
        let empty = file(tmp.path(), "empty", 0);
        assert!(!pins.pin("e", &empty));
        assert_eq!(pins.totals(), (0, 0));
    }
}
