//! # erofs-builder
//!
//! Writes and reads [EROFS](https://docs.kernel.org/filesystems/erofs.html) images, the
//! read-only filesystem format every Strata layer is stored in. It builds a **full image**
//! ([`build_image_from`]) and a **lazy layer** = meta image + data blob with chunk-based
//! files, optionally with a second "tails" blob for small files and file tails
//! ([`build_layer_from`], see [`layer`]) from any [`Source`]: a directory tree, an
//! overlayfs upper directory (whiteouts and opaque directories kept, overlay bookkeeping
//! xattrs dropped, `redirect`/`metacopy` refused), or an OCI/Docker layer tar stream (plain,
//! gzip or zstd; ustar, GNU and PAX; OCI whiteouts become overlayfs whiteouts; see [`tar`]),
//! or a stack of layer tars merged with overlay semantics ([`Source::TarStack`]).
//! [`build_image`] and [`build_layer`] are the directory-tree shorthands. It reads images
//! back ([`Image`], [`Image::open_with_devices`] for layers), ours or `mkfs.erofs`'s. The
//! byte layout we write, and the rules for each input, are specified in `docs/format.md`
//! (checked against the kernel's `fs/erofs/erofs_fs.h`); [`ondisk`] mirrors it as
//! `#[repr(C)]` structs.
//!
//! ```no_run
//! use erofs_builder::{build_image_from, BuildOptions, Progress, Source};
//! # fn main() -> erofs_builder::Result<()> {
//! let progress = Progress::new();
//! let mut opts = BuildOptions::default();
//! opts.progress = Some(progress.clone()); // poll progress.snapshot() from another thread
//! let src = Source::tar_file("layer.tar.gz".as_ref())?; // or Source::Tar(Box::new(stdin))
//! let stats = build_image_from(src, "layer.erofs".as_ref(), &opts)?;
//! # let _ = stats; Ok(()) }
//! ```
//!
//! ## Invariants
//!
//! * **Kernel-mountable, fsck-clean**: block size 4096, uncompressed (`FLAT_PLAIN` /
//!   `FLAT_INLINE`; layers: `CHUNK_BASED` regular files, small ones optionally `FLAT_INLINE`), inline xattrs only, no incompat
//!   feature bits except `CHUNKED_FILE | DEVICE_TABLE` in layers; an inline tail never
//!   crosses a block boundary; directory entries are sorted by name bytes, `.`/`..` included.
//! * **Deterministic**: the image is a pure function of the source and [`BuildOptions`]
//!   (sorted traversal, all padding zero, zero uuid by default, build time taken from the
//!   root directory's mtime unless [`BuildOptions::epoch`] is set; for tar input, the
//!   archive's bytes, whatever their compression).
//! * **Streaming**: file data is copied through one 1 MiB buffer from the source into the
//!   image (source holes are skipped, zero blocks stay holes), and inode records are written
//!   one at a time; only the scanned tree (names, attributes, xattrs) is held in memory, so
//!   peak RSS depends on the number of files, not on the bytes in them (`/usr/lib`, 73k
//!   inodes, 4.2 GB: 25 MB; as a layer: 34 MB, the chunk dedupe map grows with the number of
//!   distinct 256 KiB chunks, ~100 B each). Tar input is read once; file data goes to an
//!   unnamed spool file (holes and zero blocks unwritten) that the writer then copies from.
//!   The output appears atomically (temp file + rename); a source file that changes size
//!   while being copied is an error.
//! * **Nothing outside the output**: a tar entry that would climb out (`..`), go through a
//!   symlinked parent, or hard-link outside the archive is refused ([`Error::UnsafeEntry`]);
//!   the spool has no name, so an error or a crash leaves nothing behind.
//! * **No panics on input**: bad trees, archives and images return [`Error`]; the reader
//!   bounds-checks every offset against the image length and never allocates more than the
//!   image could justify (see [`reader::fuzz_read_all`]); the tar parser bounds every
//!   allocation by [`TarOptions`] (see [`tar::fuzz_read_tar`]).
//! * **Progress**: [`BuildOptions::progress`] takes a [`Progress`] (shared atomic counters:
//!   phase, scanned entries/bytes, totals, files/bytes written) for a caller's progress line.
//!
//! Not here yet: compression, shared xattrs on write.

#![forbid(unsafe_code)]

use std::path::PathBuf;

mod data;
mod dictionary;
pub mod layer;
mod merge;
pub mod ondisk;
mod placer;
pub mod reader;
mod source;
pub mod tar;
mod writer;

pub use layer::{
    build_layer, build_layer_from, ChunkDictionary, LayerOptions, LayerStats, TailsBlob, TailsStats,
};
pub use reader::{DeviceInfo, DirEntry, Extent, FileType, Image, Inode, Location};
pub use source::{Phase, Progress, ProgressSnapshot, Source, TarOptions};
pub use writer::{build_image, build_image_from, BuildOptions, BuildStats};

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
    /// A tar archive is malformed: bad header checksum or numeric field, bad PAX record or
    /// sparse map, unsupported entry type or compression.
    #[error("bad tar archive at byte {offset} (entry {entry:?}): {reason}")]
    BadArchive {
        /// Offset in the (decompressed) stream of the header concerned.
        offset: u64,
        /// The entry's name as far as known (lossy UTF-8; empty if not yet known).
        entry: String,
        /// What is wrong.
        reason: String,
    },
    /// A tar archive ends inside a header, inside an entry's data or its padding.
    #[error("tar archive truncated at byte {offset} (entry {entry:?})")]
    Truncated {
        /// Bytes of the (decompressed) stream read.
        offset: u64,
        /// The entry being read (empty between entries).
        entry: String,
    },
    /// A tar entry would escape the layer or go through a symlink: a `..` component, a NUL
    /// in a name, a symlink (or non-directory) parent, a hard link to something that is
    /// not an earlier non-directory entry, a component over 255 bytes.
    #[error("unsafe tar entry {entry:?}: {reason}")]
    UnsafeEntry {
        /// The entry's name (lossy UTF-8).
        entry: String,
        /// Why it is refused.
        reason: String,
    },
    /// A tar entry exceeds a limit of [`TarOptions`].
    #[error("tar entry {entry:?} exceeds the {what} limit ({limit})")]
    LimitExceeded {
        /// The entry's name (lossy UTF-8).
        entry: String,
        /// Which limit.
        what: String,
        /// Its value.
        limit: u64,
    },
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}
