//! Level-2 reads and writes with `O_DIRECT`: a reader's blocks, readahead runs for sequential
//! readers, and the writer's chunks.
//!
//! A reader's own blocks ([`DiskCache::read_for_reader`]) are read with `O_DIRECT` where the
//! cache's filesystem takes it: level 2 keeps no pages (the writer drops them once synced, a
//! buffered reader right after its read), so a buffered read would insert the pages, copy
//! them out and remove them again — on this machine's disk a random 16 KiB read took 46 µs
//! that way and 38 µs direct, a 64 KiB one 90–99 µs against 73 µs (`bench/tools/read_modes.c`,
//! `bench/README.md`, "peers"). A filesystem that refuses `O_DIRECT` gets buffered reads.
//!
//! A sequential reader of level 2 through the page cache costs, per byte, a page-cache
//! insertion, a copy out, a removal (level 2 keeps no pages, see the module docs) and one
//! 256 KiB read at a time. Read ahead instead, the next chunks of the stream are read in runs
//! (one `pread` per run of adjacent cached chunks) with `O_DIRECT`: the device writes straight
//! into the returned buffer, two runs are in flight at once, and the page cache is not
//! touched. A read of 1 MiB or more goes into a huge-page buffer (`huge.rs`), so that a run
//! is one device request, not one per `max_segments` scattered pages (254 here). Every 4 KiB
//! block is still checked against its crc32c before the chunk is handed out, so a damaged
//! chunk is dropped (and refetched by whoever reads it), never served.
//!
//! # Writes
//! A chunk that is a whole number of 4 KiB blocks is written with `O_DIRECT` too
//! ([`DiskCache::write_direct`]; a blob's last, shorter chunk goes through the page cache):
//! buffered, each byte cost a copy into a new page-cache page, its writeback at the batch's
//! `fdatasync` and the page's removal after (`fadvise(DONTNEED)`: level 2 keeps no pages).
//! In a cold read of a 110 MB file from a compressed store that was about a fifth of the
//! daemon's CPU time and a tenth of the read's (`bench/README.md`, "peers"). A batch's
//! adjacent chunks of one blob go as one write of up to [`DIRECT_RUN_BYTES`]
//! (the same call with several parts): written one 256 KiB chunk at a time, each waiting for
//! the device, the writers fell behind a cold reader of every file of `/usr/lib` and 1,352–1,974
//! chunks were served but not kept (none through the page cache, none with runs), and ext4
//! allocated the blob files in 256 KiB pieces. Bytes in an unaligned buffer (a decoded chunk
//! is a plain `Vec`) are copied into a kept aligned buffer first. The batch's `fdatasync`
//! still makes the chunks durable (the blocks the writes allocated, the file size) before
//! they are indexed. A filesystem that refuses the write (`EINVAL`) turns direct I/O off for
//! reads and writes alike.

use std::fs::{File, OpenOptions};
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use bytes::Bytes;

use super::files::{read_for_reader, ReadOutcome};
use super::huge::{self, HugeBuf, HUGE_READ_MIN};
use super::{blocks_match, chunk_offset, ChunkId, DiskCache, ReadPin, DROPPED_CORRUPT};
use crate::error::{Error, Result};
use crate::store::Digest;

/// Buffer and offset alignment for `O_DIRECT` (a multiple of any logical block size here).
const DIRECT_ALIGN: usize = 4096;

impl DiskCache {
    /// Read the cached chunks among `chunks` (ascending indexes) of `blob` cut into chunks of
    /// `1 << shift` bytes, one `O_DIRECT` read per run of adjacent ones (a run goes on past a
    /// chunk only if that chunk is whole, `1 << shift` bytes), each checked against its crc32c:
    /// the verified chunks, whole, in order. Absent chunks (and chunks cached under another
    /// shift) are skipped; a chunk that fails its check is dropped (counted in
    /// `dropped_corrupt`) and left out. The chunks are marked used.
    pub fn read_chunks_direct(
        &self,
        blob: &Digest,
        shift: u8,
        chunks: impl IntoIterator<Item = u64>,
    ) -> Result<Vec<(u64, Bytes)>> {
        let full = 1u64.checked_shl(u32::from(shift)).unwrap_or(0);
        // Pin what is cached now (no eviction until read), grouped into runs.
        let mut pins = Vec::new();
        let mut runs: Vec<Vec<(u64, u64, u64)>> = Vec::new(); // (index, size, seq)
        {
            let mut st = self.lock();
            for index in chunks {
                let id = ChunkId {
                    blob: *blob,
                    shift,
                    index,
                };
                let Some(entry) = st.touch(&id) else {
                    continue;
                };
                st.pin(&id);
                pins.push(ReadPin { cache: self, id });
                let size = u64::from(entry.size);
                match runs.last_mut() {
                    Some(run)
                        if run
                            .last()
                            .is_some_and(|&(i, s, _)| i + 1 == index && s == full) =>
                    {
                        run.push((index, size, entry.seq))
                    }
                    _ => runs.push(vec![(index, size, entry.seq)]),
                }
            }
        }
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        let path = self.blob_path(blob);
        // Pinned chunks keep the blob file linked.
        let file = match OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("open (O_DIRECT)", &path, e)),
        };
        let mut out = Vec::new();
        for run in runs {
            let (first, ..) = run[0];
            let at = chunk_offset(first, shift).unwrap_or(u64::MAX);
            let len: u64 = run.iter().map(|&(_, s, _)| s).sum();
            let buf = read_direct(&file, at, len as usize)
                .map_err(|e| Error::io("read chunks (O_DIRECT)", &path, e))?;
            let mut from = 0usize;
            for (index, size, seq) in run {
                let id = ChunkId {
                    blob: *blob,
                    shift,
                    index,
                };
                let to = from + size as usize;
                let ok = match (buf.get(from..to), self.sums_of_opt(&id, size)?) {
                    (Some(data), Some(sums)) => blocks_match(data, &sums),
                    _ => false,
                };
                if ok {
                    out.push((index, buf.slice(from..to)));
                } else {
                    tracing::warn!(blob = %blob, chunk = index, "chunk on local disk failed its check; dropped");
                    // Dropped once this read's pin goes.
                    self.forget(&id, Some(seq), Some(DROPPED_CORRUPT))?;
                }
                from = to;
            }
        }
        drop(pins);
        Ok(out)
    }
}

impl DiskCache {
    /// `len` bytes at `at` (4 KiB aligned) of `blob`'s file (`file`, open buffered) for a
    /// reader that keeps them: with `O_DIRECT` where the filesystem takes it (module docs),
    /// else a buffered read whose pages are dropped after. `nowait`: the caller must not
    /// block; `WouldBlock` unless the bytes are in the page cache (never, with `O_DIRECT`:
    /// level 2 keeps no pages).
    pub(super) fn read_for_reader(
        &self,
        blob: &Digest,
        file: &File,
        len: usize,
        at: u64,
        nowait: bool,
    ) -> io::Result<(ReadOutcome, Bytes)> {
        if let Some(direct) = self.open_blob_direct(blob) {
            if nowait {
                return Ok((ReadOutcome::WouldBlock, Bytes::new()));
            }
            match read_direct(&direct, at, len) {
                Ok(b) if b.len() == len => return Ok((ReadOutcome::Full, b)),
                Ok(_) => return Ok((ReadOutcome::Short, Bytes::new())),
                // A filesystem that takes O_DIRECT opens but refuses the read.
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                    self.refuse_direct()
                }
                Err(e) => return Err(e),
            }
        }
        let mut data = Vec::new();
        let outcome = read_for_reader(file, &mut data, len, at, nowait)?;
        Ok((outcome, Bytes::from(data)))
    }

    /// Write `parts` — whole chunks of `first`'s blob at consecutive indexes from `first`'s
    /// (one part: any chunk) — with one `O_DIRECT` write (module docs, "Writes"): from the
    /// part itself when it is one aligned part, else through a kept aligned buffer. `None` if
    /// not taken (direct I/O off or refused, a part not a whole number of blocks — a blob's
    /// last chunk —, more than [`DIRECT_RUN_BYTES`]): the caller writes them one by one,
    /// through the page cache where this refuses a single chunk.
    pub(super) fn write_direct(&self, first: &ChunkId, parts: &[&[u8]]) -> Option<io::Result<()>> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total == 0
            || total > DIRECT_RUN_BYTES
            || parts.iter().any(|p| p.len() % DIRECT_ALIGN != 0)
        {
            return None;
        }
        let at = chunk_offset(first.index, first.shift)?;
        if at % DIRECT_ALIGN as u64 != 0 {
            return None;
        }
        // The blob's file may not exist yet: created (and kept open) as for a buffered write.
        if let Err(e) = self.blob_file_for_write(&first.blob) {
            return Some(Err(e));
        }
        let file = self.open_blob_direct(&first.blob)?;
        let written = match parts {
            [one] if one.as_ptr().align_offset(DIRECT_ALIGN) == 0 => file.write_all_at(one, at),
            // Bytes from unaligned allocations (a decoded chunk's `Vec`, a plain chunk's copy),
            // or several chunks: one copy into a kept aligned buffer, still far cheaper than
            // the page cache's insertion, writeback and removal.
            _ => with_bounce(total, |buf| {
                let mut filled = 0;
                for p in parts {
                    buf[filled..filled + p.len()].copy_from_slice(p);
                    filled += p.len();
                }
                file.write_all_at(buf, at)
            }),
        };
        match written {
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                // Nothing was written: a filesystem that opens with O_DIRECT but refuses the
                // write (or an alignment it wants larger than 4 KiB).
                self.refuse_direct();
                None
            }
            r => Some(r),
        }
    }

    /// `blob`'s file open for reading and writing with `O_DIRECT`; `None` if it is missing or
    /// the filesystem refuses `O_DIRECT`.
    fn open_blob_direct(&self, blob: &Digest) -> Option<Arc<File>> {
        if !self.direct_ok.load(Ordering::Relaxed) {
            return None;
        }
        let lock = || {
            self.open_direct
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        if let Some(f) = lock().get(blob) {
            return Some(f.clone());
        }
        let path = self.blob_path(blob);
        match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(&path)
        {
            Ok(f) => {
                let f = Arc::new(f);
                lock().put(*blob, f.clone());
                Some(f)
            }
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                self.refuse_direct();
                None
            }
            Err(_) => None,
        }
    }

    /// Whether a reader's blocks are read (and chunks written) with `O_DIRECT` (module docs):
    /// true from open, false once the filesystem refused it or after
    /// `set_direct_reads(false)`.
    pub fn direct_reads(&self) -> bool {
        self.direct_ok.load(Ordering::Relaxed)
    }

    /// Read a reader's blocks and write chunks with `O_DIRECT` (where the filesystem takes
    /// it) or through the page cache.
    pub fn set_direct_reads(&self, on: bool) {
        self.direct_ok.store(on, Ordering::Relaxed);
        if !on {
            self.open_direct
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
    }

    fn refuse_direct(&self) {
        if self.direct_reads() {
            tracing::info!(dir = %self.blobs.display(), "level 2: the filesystem refuses O_DIRECT; reads and writes go through the page cache");
        }
        self.set_direct_reads(false);
    }
}

/// The most bytes of one write of adjacent chunks (the same call with several parts): 16
/// chunks of 256 KiB.
pub(super) const DIRECT_RUN_BYTES: usize = 4 << 20;

/// Bounce buffers kept for reuse (each [`DIRECT_RUN_BYTES`]): one per level-2 writer and one
/// for a `warm`.
const BOUNCE_KEPT: usize = crate::chunk::writer::DISK_WRITERS + 1;

static BOUNCE: std::sync::Mutex<Vec<AlignedBuf>> = std::sync::Mutex::new(Vec::new());

/// Run `f` on the first `len` bytes (at most [`DIRECT_RUN_BYTES`]) of an aligned buffer: a
/// kept one (faulted in already), else a new one, kept afterwards if fewer than
/// [`BOUNCE_KEPT`] are.
fn with_bounce<R>(len: usize, f: impl FnOnce(&mut [u8]) -> io::Result<R>) -> io::Result<R> {
    let pool = || BOUNCE.lock().unwrap_or_else(PoisonError::into_inner);
    let kept = pool().pop();
    let mut buf = match kept {
        Some(b) => b,
        None => AlignedBuf::new(DIRECT_RUN_BYTES)?,
    };
    let len = len.min(buf.len());
    let r = f(&mut buf.as_mut_slice()[..len]);
    let mut pool = pool();
    if pool.len() < BOUNCE_KEPT {
        pool.push(buf);
    }
    r
}

/// A zeroed heap buffer whose start is [`DIRECT_ALIGN`]-aligned.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is plain heap memory owned by this value alone.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize) -> io::Result<Self> {
        let layout =
            std::alloc::Layout::from_size_align(len, DIRECT_ALIGN).map_err(io::Error::other)?;
        if len == 0 {
            return Err(io::Error::other("an empty aligned buffer"));
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr)
            .ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Self { ptr, layout })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len()` initialised (zeroed at allocation) bytes owned by
        // `self`, borrowed mutably here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// `len` bytes of `file` (opened with `O_DIRECT`) at `at` (aligned), fewer at end of file.
/// Reads of [`HUGE_READ_MIN`] bytes or more go into a huge-page buffer (`huge.rs`).
fn read_direct(file: &File, at: u64, len: usize) -> io::Result<Bytes> {
    let want = len.next_multiple_of(DIRECT_ALIGN);
    if want >= HUGE_READ_MIN {
        if let Some(mut buf) = HugeBuf::new(&huge::POOL, want) {
            let got = fill_direct(file, at, &mut buf.as_mut_slice()[..want])?;
            return Ok(buf.into_bytes(got.min(len)));
        }
    }
    let mut v: Vec<u8> = Vec::with_capacity(want + DIRECT_ALIGN);
    // The buffer must start on an aligned address: skip `pad` bytes of the allocation.
    let pad = v.as_ptr().align_offset(DIRECT_ALIGN);
    let got = fill_direct(file, at, &mut v.spare_capacity_mut()[pad..pad + want])?;
    // SAFETY: `pread` initialised bytes `pad..pad + got` of the spare capacity; the `pad`
    // bytes before them are set here first.
    unsafe {
        std::ptr::write_bytes(v.as_mut_ptr(), 0, pad);
        v.set_len(pad + got);
    }
    let b = Bytes::from(v);
    Ok(b.slice(pad..pad + got.min(len)))
}

/// Fill `buf` (aligned, a whole number of blocks) from `file` (opened with `O_DIRECT`) at `at`
/// (aligned): how many bytes (from its start) were read and initialised, fewer at end of file.
fn fill_direct(file: &File, at: u64, buf: &mut [MaybeUninit<u8>]) -> io::Result<usize> {
    let mut got = 0usize;
    while got < buf.len() {
        let (n, _) = rustix::io::pread(file, &mut buf[got..], at + got as u64)?;
        if n.is_empty() {
            break;
        }
        got += n.len();
        if got % DIRECT_ALIGN != 0 {
            // Only the end of the file ends a direct read off a block boundary.
            break;
        }
    }
    Ok(got)
}
