//! # erofs-builder
//!
//! Writes and reads [EROFS](https://docs.kernel.org/filesystems/erofs.html) images, the
//! read-only filesystem format every Strata layer is stored in. This slice builds a **full
//! image from a directory tree** ([`build_image`]), a **lazy layer** = meta image + data blob
//! with chunk-based files ([`build_layer`], see [`layer`]), and reads images back ([`Image`],
//! [`Image::open_with_devices`] for layers), ours or `mkfs.erofs`'s. The byte layout we write is specified in `docs/format.md` (checked against
//! the kernel's `fs/erofs/erofs_fs.h`); [`ondisk`] mirrors it as `#[repr(C)]` structs.
//!
//! ## Invariants
//!
//! * **Kernel-mountable, fsck-clean**: block size 4096, uncompressed (`FLAT_PLAIN` /
//!   `FLAT_INLINE`; layers: `CHUNK_BASED` regular files), inline xattrs only, no incompat
//!   feature bits except `CHUNKED_FILE | DEVICE_TABLE` in layers; an inline tail never
//!   crosses a block boundary; directory entries are sorted by name bytes, `.`/`..` included.
//! * **Deterministic**: the image is a pure function of the tree and [`BuildOptions`]
//!   (sorted traversal, all padding zero, zero uuid by default, build time taken from the
//!   root directory's mtime unless [`BuildOptions::epoch`] is set).
//! * **Streaming**: file data is copied through one 1 MiB buffer from the source into the
//!   image (source holes are skipped, zero blocks stay holes), and inode records are written
//!   one at a time; only the scanned tree (names, attributes, xattrs) is held in memory, so
//!   peak RSS depends on the number of files, not on the bytes in them (`/usr/lib`, 73k
//!   inodes, 4.2 GB: 25 MB; as a layer: 34 MB, the chunk dedupe map grows with the number of
//!   distinct 256 KiB chunks, ~100 B each). The output appears atomically
//!   (temp file + rename); a source file that changes size while being copied is an error.
//! * **No panics on input**: bad trees and malformed images return [`Error`]; the reader
//!   bounds-checks every offset against the image length and never allocates more than the
//!   image could justify (see [`reader::fuzz_read_all`]).
//!
//! Not here yet: compression, OCI tar and overlay-upper input, shared xattrs on write.

#![forbid(unsafe_code)]

use std::path::PathBuf;

pub mod layer;
pub mod ondisk;
pub mod reader;
mod writer;

pub use layer::{build_layer, LayerOptions, LayerStats};
pub use reader::{DeviceInfo, DirEntry, FileType, Image, Inode};
pub use writer::{build_image, BuildOptions, BuildStats};

/// Everything that can go wrong while building or reading an image.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O error, with what we were doing.
    #[error("{context}: {source}")]
    Io {
        /// What failed (usually with a path).
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The source tree holds something EROFS (or this writer) cannot represent.
    #[error("cannot represent {path:?} in EROFS: {reason}")]
    UnsupportedInput {
        /// The offending source path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A source file changed (size or type) while the image was being built.
    #[error("source changed while building: {path:?}")]
    SourceChanged {
        /// The file that changed.
        path: PathBuf,
    },
    /// The image would exceed an on-disk limit (e.g. 2^32 blocks).
    #[error("image too large: {0}")]
    TooLarge(String),
    /// The image is malformed.
    #[error("corrupt EROFS image: {0}")]
    Corrupt(String),
    /// The image uses a feature this reader does not implement.
    #[error("unsupported EROFS feature: {0}")]
    Unsupported(String),
    /// A path or name does not exist in the image.
    #[error("not found in image: {0}")]
    NotFound(String),
    /// A path component or inode is not a directory where one is needed.
    #[error("not a directory: {0}")]
    NotADirectory(String),
    /// The inode is not of the kind an operation needs (e.g. `read_link` on a file).
    #[error("wrong inode type: {0}")]
    WrongType(String),
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}
