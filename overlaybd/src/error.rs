//! The one public error type of `overlaybd`.

use std::path::PathBuf;

/// Everything that can go wrong with a layered block device.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A local I/O error, with what was being done and to which file.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A sealed layer or an upper's log is malformed: truncated, a bad checksum, an index that
    /// points outside the file, unsorted or overlapping extents, ….
    #[error("corrupt {what}: {reason}")]
    Corrupt { what: String, reason: String },

    /// A well-formed layer or upper of a version or with features this code does not read.
    #[error("unsupported {what}: {reason}")]
    Unsupported { what: String, reason: String },

    /// A layer (or the upper) was not written on top of the layer below it in the stack.
    #[error("{what} expects parent layer {expected}, but the layer below is {found}")]
    ParentMismatch {
        what: String,
        expected: String,
        found: String,
    },

    /// An I/O request outside the device.
    #[error("range {offset}+{len} is outside the device ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },

    /// A request that must be sector-aligned (512 bytes) is not.
    #[error("{what} {value} is not a multiple of 512 bytes")]
    Misaligned { what: &'static str, value: u64 },

    /// A write or discard on a device without a writable upper.
    #[error("the device is read-only: it has no writable upper")]
    ReadOnly,

    /// An upper directory already holds an upper (`Upper::create`).
    #[error("{0} already holds an upper; open it instead")]
    AlreadyExists(PathBuf),

    /// A stored layer is not a block layer (it has a meta image, or not exactly one blob), or
    /// its parent chain is unusable.
    #[error("layer {layer}: {reason}")]
    BadLayer { layer: String, reason: String },

    /// The storage core failed (store, manifests, chunk cache).
    #[error(transparent)]
    Store(#[from] fs_cache::Error),
}

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Corrupt {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// An errno for this error, for the block-device frontends (FUSE, ublk).
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { source, .. } => source.raw_os_error().unwrap_or(EIO),
            Error::OutOfRange { .. } | Error::Misaligned { .. } => EINVAL,
            Error::ReadOnly => EROFS,
            _ => EIO,
        }
    }
}

const EIO: i32 = 5;
const EINVAL: i32 = 22;
const EROFS: i32 = 30;

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
