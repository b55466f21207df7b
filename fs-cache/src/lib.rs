//! # fs-cache: Strata's storage core
//!
//! Everything a Strata node or build pipeline reads or writes goes through this crate:
//!
//! - [`backend`]: the narrow [`Backend`] trait and its implementations: [`PosixBackend`] (a
//!   directory on a shared POSIX mount such as 3FS), [`S3Backend`] (any S3-compatible store),
//!   [`MemoryBackend`], the [`RetryingBackend`] wrapper (the one layer of retries, which a
//!   [`Store`] applies) and the [`FaultyBackend`] wrapper for reliability tests; chosen by URL
//!   with [`open_backend`].
//! - [`store`]: the content-addressed blob store (blobs named by blake3 digest, immutable).
//! - [`layer`]: versioned layers `KIND/NAME:VERSION` resolving to JSON manifests.
//! - [`trace`]: recorded access traces of layers (what the first readers read, replayed as
//!   prefetch on other nodes).
//! - [`gc`]: removal of blobs no manifest references, safe against concurrent pushes.
//! - [`fsutil`]: local files replaced atomically ([`write_atomic`], [`AtomicFile`]), for every
//!   crate that keeps state or outputs on local disk.
//!
//! # Invariants kept across the crate
//! - A reader never sees a torn object: every backend put is atomic.
//! - A stored blob's key is the blake3 digest of its bytes; whole reads are verified.
//! - A pushed layer version never changes.
//! - A missing object is [`Error::NotFound`], never a panic or a generic error; bad input (keys,
//!   URLs, manifests) is refused with an error that says what was expected. [`Error::kind`]
//!   classifies any error ([`ErrorKind`]), shared ones included.
//! - Backend operations are retried once over, never in nested layers, and the error after
//!   the last attempt is final ([`backend::retry`]).
//!
//! The key layout in a backend is documented in [`store`] and [`layer`].

pub mod backend;
mod error;
pub mod fsutil;
pub mod gc;
pub mod layer;
pub mod store;
pub mod trace;

pub use backend::{
    open_backend, Backend, FaultConfig, FaultyBackend, MemoryBackend, ObjectMeta, PosixBackend,
    PutMode, RetryPolicy, RetryingBackend, S3Backend, S3Config,
};
pub use chunk::Compression;
pub use error::{BoxError, Error, ErrorKind, Result};
pub use fsutil::{write_atomic, AtomicFile};
pub use layer::{BlobFile, BlobRef, BuiltBy, LayerKind, LayerRef, Manifest, Pushed};
pub use store::{Digest, PutBlob, PutOptions, Store};
pub mod chunk;
