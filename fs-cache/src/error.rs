//! The one public error type of `fs-cache`.

use std::path::PathBuf;
use std::time::Duration;

/// A boxed error from a lower layer (an SDK, the OS), kept as the `source`.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in the storage core.
///
/// Every variant names what it was working on (the key, the blob, the layer) so that the
/// message alone tells an operator where to look.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The object does not exist in the backend.
    #[error("{backend}: object not found: {key}")]
    NotFound { backend: String, key: String },

    /// A create-only put found the key already present.
    #[error("{backend}: object already exists: {key}")]
    AlreadyExists { backend: String, key: String },

    /// The key is not a valid object key (see [`crate::backend::validate_key`]).
    #[error("invalid object key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },

    /// A ranged read started past the end of the object.
    #[error("{backend}: range {start}..{end} starts past the end of {key} ({size} bytes)")]
    InvalidRange {
        backend: String,
        key: String,
        start: u64,
        end: u64,
        size: u64,
    },

    /// A store URL could not be understood.
    #[error("invalid store URL {url:?}: {reason}; expected a path, file:///path, or s3://bucket/prefix?endpoint=http://host:port&region=REGION")]
    InvalidUrl { url: String, reason: String },

    /// A local I/O error, with the path it happened on.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A remote backend failed (after retries, where the error was transient).
    #[error("{backend}: {op} {key} failed after {attempts} attempt(s): {message}")]
    Backend {
        backend: String,
        op: &'static str,
        key: String,
        attempts: u32,
        message: String,
        /// Whether another attempt could succeed (throttling, 5xx, timeouts, connection loss).
        transient: bool,
        #[source]
        source: Option<BoxError>,
    },

    /// The retry deadline passed before the operation succeeded.
    #[error(
        "{backend}: {op} {key} gave up after {elapsed:?} ({attempts} attempts); last error: {last}"
    )]
    DeadlineExceeded {
        backend: String,
        op: &'static str,
        key: String,
        attempts: u32,
        elapsed: Duration,
        last: String,
    },

    /// Bytes read back do not match their content address.
    #[error("corrupt blob {blob}: expected digest {expected}, got {actual}")]
    DigestMismatch {
        blob: String,
        expected: String,
        actual: String,
    },

    /// A chunk's bytes do not match the digest in its blob's chunk table, even after a
    /// refetch (from the backend) or on local disk (dropped, then refetched).
    #[error("corrupt chunk {chunk} of blob {blob}: its bytes do not match the chunk table")]
    Corrupt { blob: String, chunk: u64 },

    /// A chunk table is malformed or does not belong to its blob.
    #[error("bad chunk table for blob {blob}: {reason}")]
    BadChunkTable { blob: String, reason: String },

    /// The local chunk cache (its index or its files) failed.
    #[error("chunk cache at {path}: {message}")]
    Cache {
        path: PathBuf,
        message: String,
        #[source]
        source: Option<BoxError>,
    },

    /// The same failure, shared by every reader that waited on one backend request.
    #[error(transparent)]
    Shared(std::sync::Arc<Error>),

    /// A string that should be a blake3 digest is not one.
    #[error("invalid digest {0:?}: expected 64 lowercase hex characters")]
    InvalidDigest(String),

    /// A layer reference is not `KIND/NAME:VERSION`.
    #[error("invalid layer reference {reference:?}: {reason}; expected KIND/NAME:VERSION with KIND one of base, workspace, toolkit, snapshot")]
    InvalidLayerRef { reference: String, reason: String },

    /// No manifest exists for this layer.
    #[error("layer not found: {0}")]
    LayerNotFound(String),

    /// A different manifest is already pushed (or was pushed and removed) under this version.
    #[error("layer {layer} already exists with different content (manifest {existing}); versions are immutable, push a new version")]
    VersionExists { layer: String, existing: String },

    /// A manifest references a blob the store does not have.
    #[error("layer {layer} references missing blob {blob}")]
    MissingBlob { layer: String, blob: String },

    /// A manifest could not be parsed or fails validation.
    #[error("bad manifest for {layer}: {reason}")]
    BadManifest { layer: String, reason: String },
}

impl Error {
    /// Whether retrying the same operation may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Backend { transient, .. } => *transient,
            Error::Shared(e) => e.is_transient(),
            Error::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::WouldBlock
            ),
            _ => false,
        }
    }

    /// Whether this is a missing object or layer.
    pub fn is_not_found(&self) -> bool {
        match self {
            Error::NotFound { .. } | Error::LayerNotFound(_) => true,
            Error::Shared(e) => e.is_not_found(),
            _ => false,
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

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
