//! Read buffers backed by transparent huge pages, for large `O_DIRECT` reads.
//!
//! An `O_DIRECT` read goes to the device as one request per run of physically contiguous
//! buffer memory, up to the queue's segment limit: a `Vec` of 4 KiB pages scattered in
//! physical memory gives a request per `max_segments` pages (254 on this VM's virtio disk, so
//! about 1 MiB), and a 2 MiB level-2 run became three requests. In a 2 MiB-aligned mapping
//! advised `MADV_HUGEPAGE` the buffer is one huge page, one segment, and the run one request:
//! on this VM 2 MiB direct reads went from 1.4–1.9 GB/s to 3.3–3.7 GB/s, above a buffered
//! sequential read of the same file (3.0 GB/s; `bench/README.md`, "peers", "level-2 runs in
//! huge-page buffers"). Where the kernel gives no huge page (THP off, memory fragmented) the
//! mapping works as ordinary pages, as fast as a `Vec`.
//!
//! Freed buffers are kept for reuse, up to [`POOL_BUFFERS`]: a fresh huge page costs a fault
//! and the kernel's zeroing of 2 MiB, a kept one neither. A buffer goes back when the last
//! [`Bytes`] slice of it is dropped, so the staging area's and a reader's slices hold it.

use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::{Mutex, PoisonError};

use bytes::Bytes;

/// Size and alignment of a huge page (x86-64, aarch64 with 4 KiB pages).
pub(super) const HUGE_PAGE: usize = 2 << 20;

/// Reads at least this long get a huge-page buffer; shorter ones stay within the segment
/// limit in ordinary pages.
pub(super) const HUGE_READ_MIN: usize = 1 << 20;

/// Freed buffers kept for reuse (each [`HUGE_PAGE`] bytes): 16 MiB at most.
const POOL_BUFFERS: usize = 8;

/// Freed one-huge-page buffers, kept for reuse.
pub(super) struct Pool(Mutex<Vec<Mapping>>);

/// The pool of level-2 reads.
pub(super) static POOL: Pool = Pool(Mutex::new(Vec::new()));

impl Pool {
    fn take(&self) -> Option<Mapping> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).pop()
    }

    fn give(&self, map: Mapping) {
        let mut kept = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() < POOL_BUFFERS {
            kept.push(map);
        }
    }
}

/// An anonymous private mapping of `len` bytes (a multiple of [`HUGE_PAGE`]) at a
/// [`HUGE_PAGE`]-aligned address. Unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value alone; nothing in it is tied to a
// thread.
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(len: usize) -> Option<Self> {
        debug_assert!(len > 0 && len % HUGE_PAGE == 0);
        let over = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let base = raw as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - base, base + over - (start + len));
        // SAFETY: both ranges lie inside the mapping just made and outside `start..start+len`,
        // which is all that is kept.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // Advice only: without THP the mapping stays in ordinary pages.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        Some(Self {
            ptr: NonNull::new(start as *mut u8)?,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is a mapping this value owns; no slice of it outlives it
        // (`Filled` borrows it only through `as_ref`, for its own life).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A read buffer, [`HUGE_PAGE`]-aligned, whose one-huge-page mapping goes back to its pool.
pub(super) struct HugeBuf {
    map: Mapping,
    pool: &'static Pool,
}

impl HugeBuf {
    /// A buffer for one read of up to `len` bytes: from `pool` if `len` fits one huge page
    /// and one is kept, else a new mapping; `None` if mapping fails.
    pub(super) fn new(pool: &'static Pool, len: usize) -> Option<Self> {
        let size = len.max(1).checked_next_multiple_of(HUGE_PAGE)?;
        let map = match (size == HUGE_PAGE).then(|| pool.take()).flatten() {
            Some(map) => map,
            None => Mapping::new(size)?,
        };
        Some(Self { map, pool })
    }

    /// The whole buffer, for the read to fill.
    pub(super) fn as_mut_slice(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: the mapping is `len` bytes, readable and writable, owned by `self` (borrowed
        // mutably here); `MaybeUninit` makes no claim about its bytes.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr.as_ptr().cast(), self.map.len) }
    }

    /// The first `len` bytes (at most the buffer), as `Bytes` that give the buffer back to
    /// the pool when the last slice of them is dropped.
    pub(super) fn into_bytes(self, len: usize) -> Bytes {
        let len = len.min(self.map.len);
        Bytes::from_owner(Filled {
            map: Some(self.map),
            len,
            pool: self.pool,
        })
    }
}

/// A filled buffer owned by `Bytes` (`Bytes::from_owner`).
struct Filled {
    map: Option<Mapping>,
    len: usize,
    pool: &'static Pool,
}

impl AsRef<[u8]> for Filled {
    fn as_ref(&self) -> &[u8] {
        match &self.map {
            // SAFETY: `len` ≤ the mapping's size; the bytes were written by the read (or are
            // zeroes of a fresh mapping), and nothing writes them while `self` is shared.
            Some(m) => unsafe { std::slice::from_raw_parts(m.ptr.as_ptr(), self.len) },
            None => &[],
        }
    }
}

impl Drop for Filled {
    fn drop(&mut self) {
        if let Some(map) = self.map.take().filter(|m| m.len == HUGE_PAGE) {
            self.pool.give(map);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static TEST_POOL: Pool = Pool(Mutex::new(Vec::new()));

    fn kept() -> Vec<usize> {
        let kept = TEST_POOL.0.lock().unwrap();
        kept.iter().map(|m| m.ptr.as_ptr() as usize).collect()
    }

    #[test]
    fn buffers_are_aligned_sized_and_go_back_to_their_pool() {
        let mut b = HugeBuf::new(&TEST_POOL, HUGE_PAGE).expect("map");
        let ptr = b.as_mut_slice().as_ptr() as usize;
        assert_eq!(ptr % HUGE_PAGE, 0);
        assert_eq!(b.as_mut_slice().len(), HUGE_PAGE);
        for (d, &c) in b.as_mut_slice().iter_mut().zip(b"abc") {
            d.write(c);
        }
        let bytes = b.into_bytes(3);
        assert_eq!(&bytes[..], b"abc");
        let part = bytes.slice(1..);
        drop(bytes);
        // Still held by the slice.
        assert!(kept().is_empty());
        assert_eq!(&part[..], b"bc");
        drop(part);
        assert_eq!(kept(), vec![ptr]);
        // The next buffer of one huge page is the kept one.
        let mut again = HugeBuf::new(&TEST_POOL, HUGE_PAGE / 2).expect("map");
        assert_eq!(again.as_mut_slice().as_ptr() as usize, ptr);
        assert!(kept().is_empty());
        drop(again);
        // Never filled into bytes: unmapped, not kept.
        assert!(kept().is_empty());

        // Larger buffers are rounded up to whole huge pages and never kept.
        let mut big = HugeBuf::new(&TEST_POOL, 3 * HUGE_PAGE + 1).expect("map");
        assert_eq!(big.as_mut_slice().len(), 4 * HUGE_PAGE);
        assert_eq!(big.as_mut_slice().as_ptr() as usize % HUGE_PAGE, 0);
        let all = big.into_bytes(10 * HUGE_PAGE);
        assert_eq!(all.len(), 4 * HUGE_PAGE);
        drop(all);
        assert!(kept().is_empty());

        // The pool keeps at most POOL_BUFFERS.
        let many: Vec<Bytes> = (0..POOL_BUFFERS + 2)
            .map(|_| {
                HugeBuf::new(&TEST_POOL, HUGE_PAGE)
                    .expect("map")
                    .into_bytes(1)
            })
            .collect();
        drop(many);
        assert_eq!(kept().len(), POOL_BUFFERS);
    }
}
