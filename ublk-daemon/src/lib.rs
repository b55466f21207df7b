//! # ublk-daemon: the node daemon's frontends
//!
//! A Strata node serves lazily fetched layers to the kernel. This crate holds the frontends the
//! kernel reads through:
//!
//! - [`blobfs`]: a FUSE mount in which every registered data blob appears as a read-only file
//!   `<mount>/<hex digest>` of its uncompressed size. Reads go to the node's
//!   [`fs_cache::chunk::ChunkCache`] (verified chunks, memory + local disk, fetched on demand).
//!   A kernel EROFS mount of a layer's meta image names those files with `device=`, so file data
//!   moves only when something reads it. Layout, request handling and memory behaviour are
//!   described in `docs/blobfs.md`.
//! - [`node`]: the node daemon (`strata daemon`): the chunk cache, the blob mount, layer EROFS
//!   mounts (reference counted) and user mounts (bind or overlayfs), a local API socket, and
//!   state that survives a restart (`docs/daemon.md`).
//! - [`bd`]: OverlayBD frontends: a layered block device ([`overlaybd::Device`]) as a FUSE
//!   image file ([`bd::serve_fuse`]) or as `/dev/ublkbN` ([`bd::serve_ublk`]), and the device
//!   directories `strata bd create|serve|commit` work on (`docs/bd.md`).
//!
//! # Invariants
//! - A blob file's bytes are exactly the blob's bytes: every byte comes from
//!   [`fs_cache::chunk::ChunkCache::read`], which never returns unverified data.
//! - A backend failure fails that read only (EIO); the mount and the daemon stay up.
//! - A mount made by [`blobfs::BlobFs::mount`] is unmounted when the value is dropped or
//!   unmounted; a mount left by a crashed daemon is detected and detached by
//!   [`blobfs::clean_stale_mount`] (and by the next [`blobfs::BlobFs::mount`] on that path).
//!
//! Errors of the whole crate are [`Error`]; [`Error::errno`] maps each to one errno.

pub mod bd;
pub mod blobfs;
pub mod fuse;
mod fusemount;
pub mod holder;
pub mod node;
mod signal;

pub use blobfs::{clean_stale_mount, mount_bdi, set_mount_readahead, BlobFs, BlobFsConfig};

use std::path::PathBuf;

/// What went wrong in a frontend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call on a path failed (open /dev/fuse, mount, umount, stat, ...).
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The mount point is still in use (a kernel mount or an open file refers to it).
    #[error("{path} is busy: {what}")]
    Busy { path: PathBuf, what: String },
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The blob is not served by this mount.
    #[error("blob {0} is not registered with this mount")]
    UnknownBlob(String),
    /// The chunk cache or the store failed.
    #[error(transparent)]
    Cache(#[from] fs_cache::Error),
    /// The layered block device failed (see [`overlaybd::Error`]).
    #[error(transparent)]
    Device(#[from] overlaybd::Error),
    /// A block-device directory is unusable (a bad descriptor, a base that changed).
    #[error("block device {path}: {reason}")]
    BadDevice { path: PathBuf, reason: String },
    /// Two blobs would get the same inode number in the blob mount.
    #[error("blob {0}'s inode number collides with blob {1}'s")]
    InodeCollision(String, String),
    /// The ublk driver refused or failed a request.
    #[error("{op}: {reason} (errno {errno})")]
    Ublk {
        op: &'static str,
        errno: i32,
        reason: String,
    },
}

impl Error {
    /// The errno that stands for this error (the one place daemon errors become errnos).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Busy { .. } => libc::EBUSY,
            Error::InvalidConfig(_) => libc::EINVAL,
            Error::UnknownBlob(_) => libc::ENOENT,
            Error::Cache(e) if e.kind() == fs_cache::ErrorKind::NotFound => libc::ENOENT,
            Error::Cache(_) => libc::EIO,
            Error::Device(e) => e.errno(),
            Error::BadDevice { .. } => libc::EINVAL,
            Error::InodeCollision(..) => libc::EEXIST,
            Error::Ublk { errno, .. } => *errno,
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Result of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
