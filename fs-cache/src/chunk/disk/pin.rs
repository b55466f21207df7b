//! Blob pins: every chunk of a wholly cached blob pinned at once, so that its blob file (which
//! is then the blob, byte for byte, whatever its chunk size) can be handed to a reader that
//! skips the per-block checks (FUSE passthrough, an EROFS `device=`); and the check of all of
//! it at once ([`BlobPin::verify`]). Holds of pins are in `hold.rs`.

use std::fmt;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use super::{chunk_offset, valid_shift, ChunkId, DiskCache, MAX_DISK_CHUNK_SHIFT};
use crate::error::{Error, Result};
use crate::store::Digest;

/// Every chunk of one blob, pinned in level 2: see [`DiskCache::pin_blob`].
pub struct BlobPin {
    pub(super) cache: Arc<DiskCache>,
    pub(super) blob: Digest,
    /// log2 of the blob's chunk size: chunk `i` is at `i << shift` in the file.
    shift: u8,
    chunks: Vec<(ChunkId, u64)>,
    file: Arc<File>,
    /// The index key of this pin's hold ([`BlobPin::hold`]), deleted on drop.
    pub(super) hold: Option<Vec<u8>>,
}

impl fmt::Debug for BlobPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlobPin")
            .field("blob", &self.blob)
            .field("shift", &self.shift)
            .field("chunks", &self.chunks.len())
            .finish_non_exhaustive()
    }
}

impl BlobPin {
    /// The blob file: byte `i` of it is byte `i` of the blob, and stays so while `self` lives.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The pinned blob.
    pub fn blob(&self) -> &Digest {
        &self.blob
    }

    /// The blob file's path, for a reader that opens the file itself (an EROFS mount's
    /// `device=`). It names this very file for as long as the pin lives: a blob file with a
    /// chunk left is never unlinked or replaced.
    pub fn path(&self) -> PathBuf {
        self.cache.blob_path(&self.blob)
    }

    /// Leave this pin's hold ([`BlobPin::hold`]) recorded when the pin goes: the chunks stay
    /// pinned while this process keeps the pin, and the next [`DiskCache::open`] pins them
    /// again for as long as the hold's token exists. For a kernel mount that outlives the pin
    /// (a daemon handing over to the next one, a mount detached lazily while in use).
    pub fn keep_hold(&mut self) {
        self.hold = None;
    }

    /// The blob's chunk size, as a shift (`1 << shift` bytes).
    pub fn shift(&self) -> u8 {
        self.shift
    }

    /// The blob's size in bytes.
    pub fn len(&self) -> u64 {
        self.chunks.last().map_or(0, |(id, size)| {
            chunk_offset(id.index, self.shift)
                .unwrap_or(u64::MAX)
                .saturating_add(*size)
        })
    }

    /// Whether the blob is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Read every chunk and check each block against its crc32c; `false` (and the bad chunk
    /// dropped, its range punched out once the pin goes) if one does not match. Reads
    /// [`VERIFY_RUN`]-byte `O_DIRECT` runs (a whole number of chunks), up to 4 at once ([`DiskCache::read_chunks_direct`]): the page cache is
    /// not touched, and a fully cached blob is checked at the disk's speed. A filesystem
    /// without `O_DIRECT` is an error (FUSE passthrough under an EROFS mounted `directio`
    /// needs it too).
    pub fn verify(&self) -> Result<bool> {
        let next = AtomicUsize::new(0);
        let bad = AtomicBool::new(false);
        let run_chunks = (VERIFY_RUN >> self.shift).max(1) as usize;
        let reader = || -> Result<()> {
            while !bad.load(Ordering::Relaxed) {
                let first = next.fetch_add(run_chunks, Ordering::Relaxed);
                let end = (first + run_chunks).min(self.chunks.len());
                let Some(run) = self.chunks.get(first..end).filter(|r| !r.is_empty()) else {
                    return Ok(());
                };
                let got = match self.cache.read_chunks_direct(
                    &self.blob,
                    self.shift,
                    run.iter().map(|(id, _)| id.index),
                ) {
                    Ok(got) => got,
                    Err(e) => {
                        bad.store(true, Ordering::Relaxed);
                        return Err(e);
                    }
                };
                let whole = got.len() == run.len()
                    && got.iter().zip(run).all(|((index, bytes), (id, size))| {
                        *index == id.index && bytes.len() as u64 == *size
                    });
                if !whole {
                    bad.store(true, Ordering::Relaxed);
                }
            }
            Ok(())
        };
        let readers = VERIFY_READERS.min(self.chunks.len().div_ceil(run_chunks));
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..readers).map(|_| s.spawn(reader)).collect();
            handles.into_iter().map(|h| h.join()).collect()
        });
        for r in results {
            r.unwrap_or_else(|_| {
                Err(Error::io(
                    "verify",
                    self.cache.blob_path(&self.blob),
                    io::Error::other("a reader thread panicked"),
                ))
            })?;
        }
        Ok(!bad.load(Ordering::Relaxed))
    }
}

/// Bytes per `O_DIRECT` read of [`BlobPin::verify`]: 8 chunks of 256 KiB, 32 of 64 KiB.
pub const VERIFY_RUN: u64 = 2 << 20;
/// Reads in flight in [`BlobPin::verify`].
const VERIFY_READERS: usize = 4;

impl Drop for BlobPin {
    fn drop(&mut self) {
        self.unhold();
        for (id, _) in &self.chunks {
            self.cache.release(id);
        }
    }
}

impl DiskCache {
    /// Pin every chunk of `blob` (`chunks` chunks of `1 << shift` bytes, the last `last_size`
    /// bytes) if all of them are cached: the returned pin keeps them (no eviction) and hands
    /// out the blob file, whose bytes are then exactly the blob's. `None` if any is missing
    /// (or cached under another shift). Reads of that file bypass the per-block checks;
    /// [`BlobPin::verify`] checks all of it. A shift level 2 does not keep (outside
    /// 12 ..= 18) is an error.
    pub fn pin_blob(
        self: &Arc<Self>,
        blob: &Digest,
        shift: u8,
        chunks: u64,
        last_size: u64,
    ) -> Result<Option<BlobPin>> {
        if !valid_shift(shift) {
            return Err(self.error(format!(
                "cannot pin blob {blob}: level 2 keeps chunks of 2^12 ..= 2^{MAX_DISK_CHUNK_SHIFT} \
                 bytes, not 2^{shift}"
            )));
        }
        let mut pinned = Vec::new();
        {
            let mut st = self.lock();
            for index in 0..chunks {
                let id = ChunkId {
                    blob: *blob,
                    shift,
                    index,
                };
                let want = if index + 1 == chunks {
                    last_size
                } else {
                    1 << shift
                };
                match st.touch(&id) {
                    Some(e) if u64::from(e.size) == want => pinned.push((id, want)),
                    _ => {
                        for (id, _) in &pinned {
                            st.unpin(id);
                        }
                        return Ok(None);
                    }
                }
                st.pin(&id);
            }
        }
        let pin_ids: Vec<ChunkId> = pinned.iter().map(|(id, _)| *id).collect();
        // A file description of its own: the cache's shared one is advised `RANDOM` (no
        // kernel readahead), which would also hold for whoever reads through the pin (FUSE
        // passthrough reads through this very description).
        let path = self.blob_path(blob);
        match File::open(&path) {
            Ok(file) => Ok(Some(BlobPin {
                cache: self.clone(),
                blob: *blob,
                shift,
                chunks: pinned,
                file: Arc::new(file),
                hold: None,
            })),
            Err(e) => {
                for id in &pin_ids {
                    self.release(id);
                }
                match e.kind() {
                    io::ErrorKind::NotFound => Ok(None),
                    _ => Err(Error::io("open", &path, e)),
                }
            }
        }
    }
}
