//! Where a sealed layer's bytes come from: a local file, memory, or a stored blob read lazily
//! through the chunk cache.
//!
//! # Sync block I/O over the async chunk cache
//! The device's read path is synchronous (FUSE and ublk frontends run their own I/O threads,
//! and a block read is a short, bounded operation), while [`ChunkCache`] is async. A
//! [`BlobSource`] keeps a [`tokio::runtime::Handle`] to the runtime the cache lives on and
//! blocks on it. From a thread outside any runtime (the normal case: frontend I/O threads) it
//! calls `Handle::block_on` directly. From a worker of a multi-threaded runtime (where a bare
//! `block_on` would panic) it wraps that in `tokio::task::block_in_place`, so the worker's
//! other tasks move to the rest of the pool and the cache's fetch tasks keep running even when
//! every worker is in a block read. From a current-thread runtime it runs the `block_on` on a
//! scoped helper thread; that works only when the cache's runtime is another, running one (a
//! current-thread runtime that blocks on its own cache would wait forever: don't). The cache's
//! runtime must be driven (multi-threaded, or a thread inside its `block_on`), since the cache
//! spawns its fetches as tasks.

use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fs_cache::chunk::ChunkCache;
use fs_cache::Digest;
use tokio::runtime::{Handle, RuntimeFlavor};

use crate::error::{Error, Result};

/// Random-access, read-only bytes of one sealed layer.
pub trait LayerSource: Send + Sync + fmt::Debug {
    /// The length in bytes.
    fn size(&self) -> u64;
    /// Fill `buf` with the bytes at `offset`; a range past the end is an error.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// A short description for error messages (a path, a blob digest).
    fn describe(&self) -> String;
}

/// A sealed layer in a local file.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    path: PathBuf,
    size: u64,
}

impl FileSource {
    /// Open the file at `path` (its length is taken once: the file must not change).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let file = File::open(&path).map_err(|e| Error::io("open", &path, e))?;
        let size = file
            .metadata()
            .map_err(|e| Error::io("stat", &path, e))?
            .len();
        Ok(Self { file, path, size })
    }
}

impl LayerSource for FileSource {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self, offset, buf.len())?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io("read", &self.path, e))
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// A sealed layer held in memory (tests, fuzzing, small layers).
#[derive(Debug, Clone)]
pub struct MemSource {
    bytes: std::sync::Arc<[u8]>,
}

impl MemSource {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            bytes: bytes.into().into(),
        }
    }
}

impl LayerSource for MemSource {
    fn size(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self, offset, buf.len())?;
        let start = offset as usize;
        buf.copy_from_slice(&self.bytes[start..start + buf.len()]);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("in-memory layer ({} bytes)", self.bytes.len())
    }
}

/// A sealed layer stored as a blob, read lazily (and verified) through the chunk cache.
#[derive(Debug, Clone)]
pub struct BlobSource {
    cache: ChunkCache,
    blob: Digest,
    size: u64,
    handle: Handle,
}

impl BlobSource {
    /// Register `blob` with `cache` (loads its chunk table, no data) and keep the current
    /// runtime's handle for the synchronous read path.
    pub async fn open(cache: ChunkCache, blob: Digest) -> Result<Self> {
        let size = cache.blob_size(&blob).await?;
        Ok(Self {
            cache,
            blob,
            size,
            handle: Handle::current(),
        })
    }

    /// The blob this layer is stored as.
    pub fn blob(&self) -> &Digest {
        &self.blob
    }
}

impl LayerSource for BlobSource {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self, offset, buf.len())?;
        let len = buf.len() as u64;
        let read = || {
            self.handle
                .block_on(self.cache.read(&self.blob, offset, len))
        };
        let bytes = match Handle::try_current().map(|h| h.runtime_flavor()) {
            // A plain thread (the frontends' I/O threads): block right here.
            Err(_) => read()?,
            // A multi-threaded runtime: hand this worker's other tasks to the rest of the
            // pool while blocking, so the cache's fetch tasks always have a thread to run on.
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(read)?,
            // Any other runtime (current-thread): block on a helper thread (see module docs).
            Ok(_) => std::thread::scope(|s| s.spawn(read).join()).map_err(|_| {
                Error::io(
                    "read",
                    self.describe(),
                    std::io::Error::other("chunk cache reader thread panicked"),
                )
            })??,
        };
        if bytes.len() != buf.len() {
            return Err(Error::corrupt(
                self.describe(),
                format!(
                    "short read at {offset}: {} of {} bytes",
                    bytes.len(),
                    buf.len()
                ),
            ));
        }
        buf.copy_from_slice(&bytes);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("blob {}", self.blob)
    }
}

fn check_range(src: &dyn LayerSource, offset: u64, len: usize) -> Result<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= src.size() => Ok(()),
        _ => Err(Error::corrupt(
            src.describe(),
            format!(
                "read of {len} bytes at {offset} is past its end ({} bytes)",
                src.size()
            ),
        )),
    }
}
