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

    /// A backend failed; `attempts` says how many attempts were made in all.
    #[error("{backend}: {op} {key} failed after {attempts} attempt(s): {message}")]
    Backend {
        backend: String,
        op: &'static str,
        key: String,
        attempts: u32,
        message: String,
        /// Whether another attempt could succeed (throttling, 5xx, timeouts, connection loss).
        /// Never set on the error a retry policy returns after its last attempt: that one is
        /// final (see [`crate::backend::retry`]).
        transient: bool,
        #[source]
        source: Option<BoxError>,
    },

    /// The retry deadline passed before the operation succeeded (a final error, not
    /// transient).
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

    /// The same failure, shared by every reader that waited on one backend request
    /// ([`Error::kind`] sees through it).
    #[error(transparent)]
    Shared(std::sync::Arc<Error>),

    /// A compression name is not `none`, `zstd` or `zstd:LEVEL`.
    #[error("invalid compression {0:?}: expected none, zstd or zstd:LEVEL (1-19)")]
    InvalidCompression(String),

    /// A string that should be a blake3 digest is not one.
    #[error("invalid digest {0:?}: expected 64 lowercase hex characters")]
    InvalidDigest(String),

    /// A chunk size that is not a power of two in 4 KiB..=64 MiB.
    #[error("invalid chunk size {0}: a chunk size must be a power of two in 4 KiB..=64 MiB (4096..=67108864 bytes)")]
    InvalidChunkSize(u64),

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

    /// A recorded access trace ([`crate::trace`]) could not be parsed or does not belong to
    /// its layer.
    #[error("bad access trace for {layer}: {reason}")]
    BadTrace { layer: String, reason: String },
}

/// What kind of failure an [`Error`] is, for callers that decide what to do about it (retry,
/// report a missing object, map it to an errno) without matching nested variants.
///
/// [`Error::kind`] sees through [`Error::Shared`]. More kinds may be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A missing object, blob or layer ([`Error::NotFound`], [`Error::LayerNotFound`],
    /// [`Error::MissingBlob`]).
    NotFound,
    /// A create-only write found its key taken ([`Error::AlreadyExists`],
    /// [`Error::VersionExists`]).
    AlreadyExists,
    /// The caller's input was refused: a key, a range, a URL, a digest or a layer reference.
    InvalidInput,
    /// Bytes or metadata failed their checks: a blob or chunk digest, a chunk table, a
    /// manifest.
    Corrupt,
    /// Another attempt may succeed (throttling, 5xx, timeouts, lost connections). An error
    /// that has been through the retry policy is never transient: it is [`Self::Backend`].
    Transient,
    /// A backend failed for good: it refused the request (access denied, a bad request), or
    /// kept failing transiently until the retry policy gave up ([`Error::DeadlineExceeded`],
    /// or an [`Error::Backend`] whose attempts ran out).
    Backend,
    /// Local I/O failed, or the local chunk cache did ([`Error::Io`], [`Error::Cache`]).
    Io,
}

impl Error {
    /// What kind of failure this is (the same for an [`Error::Shared`] as for the error it
    /// shares).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Shared(e) => e.kind(),
            Error::NotFound { .. } | Error::LayerNotFound(_) | Error::MissingBlob { .. } => {
                ErrorKind::NotFound
            }
            Error::AlreadyExists { .. } | Error::VersionExists { .. } => ErrorKind::AlreadyExists,
            Error::InvalidKey { .. }
            | Error::InvalidRange { .. }
            | Error::InvalidUrl { .. }
            | Error::InvalidDigest(_)
            | Error::InvalidChunkSize(_)
            | Error::InvalidCompression(_)
            | Error::InvalidLayerRef { .. } => ErrorKind::InvalidInput,
            Error::DigestMismatch { .. }
            | Error::Corrupt { .. }
            | Error::BadChunkTable { .. }
            | Error::BadTrace { .. }
            | Error::BadManifest { .. } => ErrorKind::Corrupt,
            Error::Backend {
                transient: true, ..
            } => ErrorKind::Transient,
            Error::Backend { .. } | Error::DeadlineExceeded { .. } => ErrorKind::Backend,
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::Interrupted
                | std::io::ErrorKind::TimedOut
                | std::io::ErrorKind::WouldBlock => ErrorKind::Transient,
                _ => ErrorKind::Io,
            },
            Error::Cache { .. } => ErrorKind::Io,
        }
    }

    /// Whether retrying the same operation may succeed ([`ErrorKind::Transient`]).
    pub fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::Transient
    }

    /// Whether this is a missing object, blob or layer ([`ErrorKind::NotFound`]).
    pub fn is_not_found(&self) -> bool {
        self.kind() == ErrorKind::NotFound
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn backend(transient: bool) -> Error {
        Error::Backend {
            backend: "b".into(),
            op: "get",
            key: "k".into(),
            attempts: 1,
            message: "m".into(),
            transient,
            source: None,
        }
    }

    fn io(kind: std::io::ErrorKind) -> Error {
        Error::io("read", "/x", std::io::Error::from(kind))
    }

    #[test]
    fn kinds() {
        let s = |v: &str| v.to_owned();
        let cases = [
            (
                Error::NotFound {
                    backend: s("b"),
                    key: s("k"),
                },
                ErrorKind::NotFound,
            ),
            (Error::LayerNotFound(s("base/x:1")), ErrorKind::NotFound),
            (
                Error::MissingBlob {
                    layer: s("l"),
                    blob: s("d"),
                },
                ErrorKind::NotFound,
            ),
            (
                Error::AlreadyExists {
                    backend: s("b"),
                    key: s("k"),
                },
                ErrorKind::AlreadyExists,
            ),
            (
                Error::VersionExists {
                    layer: s("l"),
                    existing: s("e"),
                },
                ErrorKind::AlreadyExists,
            ),
            (
                Error::InvalidKey {
                    key: s("/"),
                    reason: "r",
                },
                ErrorKind::InvalidInput,
            ),
            (
                Error::InvalidRange {
                    backend: s("b"),
                    key: s("k"),
                    start: 2,
                    end: 3,
                    size: 1,
                },
                ErrorKind::InvalidInput,
            ),
            (
                Error::InvalidUrl {
                    url: s("u"),
                    reason: s("r"),
                },
                ErrorKind::InvalidInput,
            ),
            (Error::InvalidDigest(s("x")), ErrorKind::InvalidInput),
            (Error::InvalidChunkSize(3000), ErrorKind::InvalidInput),
            (
                Error::InvalidLayerRef {
                    reference: s("r"),
                    reason: s("r"),
                },
                ErrorKind::InvalidInput,
            ),
            (
                Error::DigestMismatch {
                    blob: s("b"),
                    expected: s("e"),
                    actual: s("a"),
                },
                ErrorKind::Corrupt,
            ),
            (
                Error::Corrupt {
                    blob: s("b"),
                    chunk: 3,
                },
                ErrorKind::Corrupt,
            ),
            (
                Error::BadChunkTable {
                    blob: s("b"),
                    reason: s("r"),
                },
                ErrorKind::Corrupt,
            ),
            (
                Error::BadManifest {
                    layer: s("l"),
                    reason: s("r"),
                },
                ErrorKind::Corrupt,
            ),
            (backend(true), ErrorKind::Transient),
            (backend(false), ErrorKind::Backend),
            (
                Error::DeadlineExceeded {
                    backend: s("b"),
                    op: "get",
                    key: s("k"),
                    attempts: 3,
                    elapsed: Duration::from_secs(1),
                    last: s("503"),
                },
                ErrorKind::Backend,
            ),
            (io(std::io::ErrorKind::TimedOut), ErrorKind::Transient),
            (io(std::io::ErrorKind::Interrupted), ErrorKind::Transient),
            (io(std::io::ErrorKind::PermissionDenied), ErrorKind::Io),
            (
                Error::Cache {
                    path: PathBuf::from("/c"),
                    message: s("m"),
                    source: None,
                },
                ErrorKind::Io,
            ),
        ];
        for (err, kind) in cases {
            assert_eq!(err.kind(), kind, "{err}");
            assert_eq!(err.is_transient(), kind == ErrorKind::Transient, "{err}");
            assert_eq!(err.is_not_found(), kind == ErrorKind::NotFound, "{err}");
            // Coalesced readers share one error, shared again by readers joining them.
            let shared = Error::Shared(Arc::new(Error::Shared(Arc::new(err))));
            assert_eq!(shared.kind(), kind, "{shared}");
            assert_eq!(shared.is_transient(), kind == ErrorKind::Transient);
            assert_eq!(shared.is_not_found(), kind == ErrorKind::NotFound);
        }
    }
}
