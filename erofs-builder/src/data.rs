//! The source files' bytes on their way into an image or a layer: small files read ahead by
//! a pool of reader threads under a memory budget ([`Prefetch`]), a regular file's data as a
//! [`DataFile`] (its own open file, checked against the size the scan saw, or its range of a
//! tar spool), streamed with holes kept ([`copy_file`]: `SEEK_DATA`/`SEEK_HOLE`, all-zero
//! blocks not written).
//!
//! Invariant: a file that changed since the scan (another type, another size, shorter than
//! its size when read) fails the build with [`Error::SourceChanged`]; it is never written
//! half.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::ondisk::BLOCK_SIZE;
use crate::writer::{Kind, Node};
use crate::{io_err, Error, Result};

/// Regular files up to this size are read ahead by [`Prefetch`] reader threads.
const PREFETCH_MAX: u64 = 1 << 20;

/// Whether node `n`'s data is read ahead: small regular files of a source tree (for full
/// images and for layers alike). A tar spool was just written and is in the page cache:
/// reading it ahead gains nothing and only parks memory.
pub(crate) fn prefetched(n: &Node) -> bool {
    matches!(n.kind, Kind::Reg) && n.size <= PREFETCH_MAX && n.spool.is_none()
}

/// Reader threads of [`Prefetch`].
pub(crate) const PREFETCH_THREADS: usize = 16;
/// Upper bound on prefetched bytes not yet consumed by the writer.
const PREFETCH_BUDGET: u64 = 32 << 20;

/// Read-ahead of small regular files: reader threads claim jobs (node indexes, in node
/// order), read each whole file and park the result; the writer takes them in the same
/// order. Readers wait while more than [`PREFETCH_BUDGET`] bytes are parked, except for the
/// job the writer needs next, so memory stays bounded and no deadlock is possible.
pub(crate) struct Prefetch<'a> {
    nodes: &'a [Node],
    jobs: &'a [usize],
    state: std::sync::Mutex<PrefetchState>,
    /// Signalled when the writer consumes a result or on stop (readers wait on it).
    readers: std::sync::Condvar,
    /// Signalled when a result is parked or on stop (the writer waits on it).
    writer: std::sync::Condvar,
}

#[derive(Default)]
struct PrefetchState {
    next_claim: usize,
    next_take: usize,
    in_flight: u64,
    done: HashMap<usize, Result<Vec<u8>>>,
    stop: bool,
}

/// Stops the readers when dropped (writer finished, failed or panicked, or a reader died).
pub(crate) struct StopGuard<'p, 'a>(&'p Prefetch<'a>);

impl Drop for StopGuard<'_, '_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.stop = true;
        drop(st);
        self.0.readers.notify_all();
        self.0.writer.notify_all();
    }
}

impl<'a> Prefetch<'a> {
    pub(crate) fn new(nodes: &'a [Node], jobs: &'a [usize]) -> Self {
        Prefetch {
            nodes,
            jobs,
            state: std::sync::Mutex::default(),
            readers: std::sync::Condvar::new(),
            writer: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PrefetchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn stop_guard(&self) -> StopGuard<'_, 'a> {
        StopGuard(self)
    }

    /// A reader thread: claims and reads jobs until all are claimed or stop is set.
    pub(crate) fn reader(&self) {
        // If this thread unwinds, the writer must not wait for its job forever.
        let _stop_on_panic = PanicStop(self);
        loop {
            let mut st = self.lock();
            if st.stop || st.next_claim >= self.jobs.len() {
                return;
            }
            let j = st.next_claim;
            st.next_claim += 1;
            let size = self.nodes[self.jobs[j]].size;
            while !st.stop && j != st.next_take && st.in_flight + size > PREFETCH_BUDGET {
                st = self.readers.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.stop {
                return;
            }
            st.in_flight += size;
            drop(st);
            let result = read_small_file(&self.nodes[self.jobs[j]]);
            self.lock().done.insert(j, result);
            self.writer.notify_one();
        }
    }

    /// The contents of node `i`, the next job in order (waits for its reader).
    pub(crate) fn take(&self, i: usize) -> Result<Vec<u8>> {
        let mut st = self.lock();
        let j = st.next_take;
        if self.jobs.get(j) != Some(&i) {
            return Err(Error::Corrupt("prefetch out of order".into()));
        }
        let result = loop {
            if let Some(r) = st.done.remove(&j) {
                break r;
            }
            if st.stop {
                return Err(Error::Corrupt("prefetch reader stopped".into()));
            }
            st = self.writer.wait(st).unwrap_or_else(|e| e.into_inner());
        };
        st.next_take += 1;
        st.in_flight -= self.nodes[i].size;
        drop(st);
        self.readers.notify_all();
        result
    }
}

/// Sets stop only when the reader thread is unwinding.
struct PanicStop<'p, 'a>(&'p Prefetch<'a>);

impl Drop for PanicStop<'_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            drop(StopGuard(self.0));
        }
    }
}

/// Opens a source file without following symlinks and checks that it is still a regular file
/// of the size the scan saw.
fn open_source(n: &Node) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&n.path)
        .map_err(io_err(format!("open {}", n.path.display())))?;
    let meta = f
        .metadata()
        .map_err(io_err(format!("read {}", n.path.display())))?;
    if !meta.is_file() || meta.len() != n.size {
        return Err(Error::SourceChanged {
            path: n.path.clone(),
        });
    }
    Ok(f)
}

/// Reads a whole small regular file with the same checks as [`copy_file`]: it must still
/// be a regular file of the scanned size. Holes read as zeros (and are skipped on write).
/// Only files of a source tree are prefetched ([`prefetched`]), never tar spool ranges.
fn read_small_file(n: &Node) -> Result<Vec<u8>> {
    let f = DataFile::open(n, None)?;
    let mut data = vec![0u8; n.size as usize];
    f.read_exact_at(&mut data, 0)?;
    f.check_end()?;
    Ok(data)
}

/// A regular file's data: an open source file (checked against the scanned size), or the
/// file's range of the tar spool.
pub(crate) struct DataFile<'a> {
    handle: Handle<'a>,
    base: u64,
    pub(crate) size: u64,
    pub(crate) path: &'a Path,
}

enum Handle<'a> {
    Own(File),
    Spool(&'a File),
}

impl<'a> DataFile<'a> {
    pub(crate) fn open(n: &'a Node, spool: Option<&'a File>) -> Result<Self> {
        let (handle, base) = match (n.spool, spool) {
            (Some(base), Some(f)) => (Handle::Spool(f), base),
            (Some(_), None) => return Err(Error::Corrupt("spooled file without a spool".into())),
            (None, _) => (Handle::Own(open_source(n)?), 0),
        };
        Ok(DataFile {
            handle,
            base,
            size: n.size,
            path: &n.path,
        })
    }

    fn file(&self) -> &File {
        match &self.handle {
            Handle::Own(f) => f,
            Handle::Spool(f) => f,
        }
    }

    /// Reads `buf.len()` bytes at `pos` of the file; a short read is [`Error::SourceChanged`].
    pub(crate) fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> Result<()> {
        read_exact_at(self.file(), buf, self.base + pos, self.path)
    }

    /// The next data extent at or after `pos` as in [`data_extent`], in file offsets (it
    /// may reach past the file's end; callers clamp).
    pub(crate) fn extent(&self, pos: u64) -> std::io::Result<Option<(u64, u64)>> {
        Ok(data_extent(self.file(), self.base + pos)?
            .map(|(d, h)| (d - self.base, h.saturating_sub(self.base))))
    }

    /// A source file must end where the scan said (the spool cannot change).
    pub(crate) fn check_end(&self) -> Result<()> {
        let Handle::Own(f) = &self.handle else {
            return Ok(());
        };
        let mut probe = [0u8; 1];
        match f.read_at(&mut probe, self.size) {
            Ok(0) => Ok(()),
            Ok(_) => Err(Error::SourceChanged {
                path: self.path.to_path_buf(),
            }),
            Err(e) => Err(io_err(format!("read {}", self.path.display()))(e)),
        }
    }
}

/// Streams one regular file: `in_blocks` bytes to the data area at `data_off`, then the tail
/// into `tail`. Source holes (`SEEK_DATA`/`SEEK_HOLE`) are not read, and all-zero blocks
/// are not written: both stay holes in the image, which read as zero.
pub(crate) fn copy_file(
    f: &DataFile<'_>,
    out: &File,
    data_off: u64,
    in_blocks: u64,
    tail: &mut [u8],
    buf: &mut [u8],
    tmp: &Path,
) -> Result<()> {
    let read_ctx = || format!("read {}", f.path.display());
    let mut pos = 0u64;
    while pos < in_blocks {
        let (data, hole) = match f.extent(pos) {
            Ok(Some((d, h))) => (d, h.min(in_blocks)),
            Ok(None) => break,
            Err(e) => return Err(io_err(read_ctx())(e)),
        };
        if data >= in_blocks {
            break;
        }
        let mut off = data;
        while off < hole {
            let want = (hole - off).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..want], off)?;
            write_nonzero(out, &buf[..want], data_off + off)
                .map_err(io_err(format!("write {}", tmp.display())))?;
            off += want as u64;
        }
        pos = hole;
    }
    f.read_exact_at(tail, in_blocks)?;
    f.check_end()
}

/// The next data extent at or after `pos`: `(data_start, hole_start)`, or `None` when only
/// a hole remains. Filesystems without `SEEK_DATA` report everything as data.
pub(crate) fn data_extent(f: &File, pos: u64) -> std::io::Result<Option<(u64, u64)>> {
    use rustix::fs::{seek, SeekFrom};
    use rustix::io::Errno;
    let data = match seek(f, SeekFrom::Data(pos)) {
        Ok(d) => d,
        Err(Errno::NXIO) => return Ok(None),
        Err(Errno::INVAL | Errno::NOTSUP) => return Ok(Some((pos, u64::MAX))),
        Err(e) => return Err(e.into()),
    };
    let hole = match seek(f, SeekFrom::Hole(data)) {
        Ok(h) => h,
        Err(Errno::NXIO) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(Some((data, hole)))
}

/// Writes `buf` at `at`, skipping 4 KiB pieces that are all zero.
pub(crate) fn write_nonzero(out: &File, buf: &[u8], at: u64) -> std::io::Result<()> {
    let bs = BLOCK_SIZE as usize;
    let zero = |k: usize| buf[k..(k + bs).min(buf.len())].iter().all(|&x| x == 0);
    let mut b = 0;
    while b < buf.len() {
        if zero(b) {
            b += bs;
            continue;
        }
        let start = b;
        while b < buf.len() && !zero(b) {
            b += bs;
        }
        let end = b.min(buf.len());
        out.write_all_at(&buf[start..end], at + start as u64)?;
    }
    Ok(())
}

pub(crate) fn read_exact_at(f: &File, buf: &mut [u8], at: u64, path: &Path) -> Result<()> {
    f.read_exact_at(buf, at).map_err(|e| {
        if e.kind() == ErrorKind::UnexpectedEof {
            Error::SourceChanged {
                path: path.to_path_buf(),
            }
        } else {
            io_err(format!("read {}", path.display()))(e)
        }
    })
}
