//! File helpers of level 2: blob file names, hole punching, reads into uninitialised memory,
//! free space.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::store::Digest;

/// `<blob hex>` in shard directory `shard`, exactly as [`DiskCache`] names it.
pub(super) fn parse_blob_name(shard: &str, name: &str) -> Option<Digest> {
    let blob = Digest::from_str(name).ok()?;
    (name.starts_with(shard) && blob.to_hex() == name).then_some(blob)
}

/// Punch out every data range of the blob file at `path` outside the chunks `indexed` of
/// `1 << shift` bytes (the blob's shift, 12 ..= 18); returns how many chunk slots were
/// punched.
pub(super) fn punch_unindexed(path: &Path, shift: u8, indexed: &HashSet<u64>) -> Result<u64> {
    let file = (OpenOptions::new().read(true).write(true))
        .open(path)
        .map_err(|e| Error::io("open blob file", path, e))?;
    let slots = unindexed_slots(&file, path, shift, indexed)?;
    for &index in &slots {
        punch_range(&file, index << shift, 1 << shift)
            .map_err(|e| Error::io("punch blob file", path, e))?;
    }
    Ok(slots.len() as u64)
}

/// The slots (`1 << shift` bytes each) of the blob file `file` (at `path`) that hold data but
/// no chunk of `indexed`, in ascending order.
pub(super) fn unindexed_slots(
    file: &File,
    path: &Path,
    shift: u8,
    indexed: &HashSet<u64>,
) -> Result<Vec<u64>> {
    use rustix::fs::SeekFrom;
    let len = (file.metadata())
        .map_err(|e| Error::io("stat blob file", path, e))?
        .len();
    let mut slots = Vec::new();
    let mut at = 0u64;
    while at < len {
        let data = match rustix::fs::seek(file, SeekFrom::Data(at)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(Error::io("seek blob file", path, e.into())),
        };
        let hole = match rustix::fs::seek(file, SeekFrom::Hole(data)) {
            Ok(h) => h,
            Err(e) => return Err(Error::io("seek blob file", path, e.into())),
        };
        // Offsets below the file's length (an `i64`): no shift overflows.
        let mut index = data >> shift;
        while index << shift < hole {
            if !indexed.contains(&index) {
                slots.push(index);
            }
            index += 1;
        }
        at = hole.max(at + 1);
    }
    Ok(slots)
}

pub(super) fn punch_range(file: &File, at: u64, len: u64) -> io::Result<()> {
    use rustix::fs::FallocateFlags;
    match rustix::fs::fallocate(
        file,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        at,
        len,
    ) {
        Ok(()) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub(super) fn remove_file(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io("remove", path, e)),
        _ => Ok(()),
    }
}

pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    (File::open(dir).and_then(|d| d.sync_all())).map_err(|e| Error::io("fsync directory", dir, e))
}

/// Bytes available on the filesystem holding `path`; `None` if `statvfs` fails.
pub(super) fn free_bytes(path: &Path) -> Option<u64> {
    let vfs = rustix::fs::statvfs(path).ok()?;
    Some(vfs.f_bavail.saturating_mul(vfs.f_frsize))
}

pub(super) fn is_nospace(e: &io::Error) -> bool {
    let code = e.raw_os_error();
    code == Some(rustix::io::Errno::NOSPC.raw_os_error())
        || code == Some(rustix::io::Errno::DQUOT.raw_os_error())
}

pub(super) enum ReadOutcome {
    Full,
    /// End of file before the buffer was full.
    Short,
    /// With `RWF_NOWAIT`, not all of it was in the page cache (read again without the flag).
    WouldBlock,
}

/// Read `len` bytes at `at` into `buf`'s spare capacity (no zeroing first).
/// [`read_uninit`] for a reader that keeps the bytes itself (level 1, or the kernel's page
/// cache above a FUSE file): `nowait` reads with `RWF_NOWAIT`, and what was read is dropped
/// from this file's page cache, where a second copy would only crowd out others.
pub(super) fn read_for_reader(
    file: &File,
    buf: &mut Vec<u8>,
    len: usize,
    at: u64,
    nowait: bool,
) -> io::Result<ReadOutcome> {
    let flags = if nowait {
        rustix::io::ReadWriteFlags::NOWAIT
    } else {
        rustix::io::ReadWriteFlags::empty()
    };
    let outcome = read_uninit(file, buf, len, at, flags)?;
    if matches!(outcome, ReadOutcome::Full) {
        let _ = rustix::fs::fadvise(
            file,
            at,
            std::num::NonZeroU64::new(len as u64),
            rustix::fs::Advice::DontNeed,
        );
    }
    Ok(outcome)
}

fn read_uninit(
    file: &File,
    buf: &mut Vec<u8>,
    len: usize,
    mut at: u64,
    flags: rustix::io::ReadWriteFlags,
) -> io::Result<ReadOutcome> {
    buf.clear();
    buf.reserve_exact(len);
    while buf.len() < len {
        let want = len - buf.len();
        let spare = &mut buf.spare_capacity_mut()[..want];
        let iov = libc::iovec {
            iov_base: spare.as_mut_ptr().cast(),
            iov_len: want,
        };
        let off = libc::off_t::try_from(at)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset out of range"))?;
        // SAFETY: `iov` describes `want` bytes of `buf`'s spare capacity, which is writable
        // and stays alive (and unaliased) for the call; the kernel writes at most that many.
        let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, off, flags.bits() as i32) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match rustix::io::Errno::from_io_error(&e) {
                Some(rustix::io::Errno::AGAIN | rustix::io::Errno::OPNOTSUPP)
                    if flags.contains(rustix::io::ReadWriteFlags::NOWAIT) =>
                {
                    return Ok(ReadOutcome::WouldBlock)
                }
                Some(rustix::io::Errno::INTR) => continue,
                _ => return Err(e),
            }
        }
        if n == 0 {
            return Ok(ReadOutcome::Short);
        }
        let n = n as usize;
        // SAFETY: `preadv2` initialised the first `n` (<= `want`) bytes of the spare capacity.
        unsafe { buf.set_len(buf.len() + n) };
        at += n as u64;
    }
    Ok(ReadOutcome::Full)
}
