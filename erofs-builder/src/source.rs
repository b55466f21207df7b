//! What an image is built from ([`Source`]), the limits applied to tar input
//! ([`TarOptions`]), and the progress counters a caller can watch ([`Progress`]).
//!
//! All three sources end in the same in-memory tree of metadata (names, attributes, xattrs,
//! symlink targets) that the writer lays out; file data is never held in memory:
//!
//! * [`Source::Dir`]: a directory tree, read with `lstat`/`llistxattr` and copied from the
//!   source files while the image is written.
//! * [`Source::OverlayUpper`]: the same walk, for an overlayfs upper directory: whiteouts
//!   (character devices 0:0) and `trusted.overlay.opaque` are kept as they are; overlayfs
//!   bookkeeping xattrs are dropped or refused (see [`overlay_xattr`]).
//! * [`Source::Tar`]: an OCI/Docker layer tar stream (plain, gzip or zstd), read once; each
//!   regular file's data is copied into a **spool**, an unnamed temporary file (`O_TMPFILE`,
//!   or a name unlinked right after creation) in [`TarOptions::temp_dir`] or the output's
//!   directory, at a 4 KiB-aligned offset, zero blocks and sparse holes left unwritten. The
//!   writer then copies from the spool. The spool has no name, so nothing is left behind,
//!   whatever happens.
//! * [`Source::TarStack`]: several layer tar streams, lowest first, each read as above into
//!   one spool, their trees merged with overlay semantics before layout.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::{io_err, Error, Result};

/// The input of [`crate::build_image_from`] / [`crate::build_layer_from`].
pub enum Source {
    /// A directory tree.
    Dir(PathBuf),
    /// An overlayfs upper directory (the writable layer of a sandbox).
    OverlayUpper(PathBuf),
    /// A layer tar stream: plain, gzip or zstd (detected from the first bytes).
    Tar(Box<dyn Read + Send>),
    /// A stack of layer tar streams, lowest first, merged into one tree as an overlayfs
    /// mount of them would show it: whiteouts and opaque directories applied across layers,
    /// none left in the result (see `crate::merge`). Each stream is read once, in order.
    TarStack(Vec<Box<dyn Read + Send>>),
}

impl Source {
    /// A tar stream from any reader (a file, a pipe, standard input, an HTTP body).
    pub fn tar(reader: impl Read + Send + 'static) -> Source {
        Source::Tar(Box::new(reader))
    }

    /// A tar archive read from the file at `path`.
    pub fn tar_file(path: &Path) -> Result<Source> {
        let f = File::open(path).map_err(io_err(format!("open {}", path.display())))?;
        Ok(Source::Tar(Box::new(f)))
    }
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Dir(p) => f.debug_tuple("Dir").field(p).finish(),
            Source::OverlayUpper(p) => f.debug_tuple("OverlayUpper").field(p).finish(),
            Source::Tar(_) => f.write_str("Tar(..)"),
            Source::TarStack(v) => write!(f, "TarStack({} layers)", v.len()),
        }
    }
}

/// Limits and settings for tar input (part of [`crate::BuildOptions`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TarOptions {
    /// Directory for the spool file. `None`: the directory of the output image.
    pub temp_dir: Option<PathBuf>,
    /// Largest regular file accepted (its real size, holes included). Default 1 TiB.
    pub max_file_size: u64,
    /// Largest GNU long name/link or PAX header record set, in bytes. Default 1 MiB.
    pub max_meta_size: u64,
    /// Most path components in one entry name. Default 1024.
    pub max_depth: usize,
    /// Most segments in one sparse file's map. Default 1,048,576.
    pub max_sparse_segments: u64,
    /// Largest total of the regular files' sizes (holes included, each file's start
    /// aligned to 4 KiB; replaced entries still count) in one archive. Default 16 TiB. It
    /// bounds the spool's apparent size and a layer's chunk indexes (8 bytes per 256 KiB).
    pub max_total_size: u64,
}

impl Default for TarOptions {
    fn default() -> Self {
        Self {
            temp_dir: None,
            max_file_size: 1 << 40,
            max_meta_size: 1 << 20,
            max_depth: 1024,
            max_sparse_segments: 1 << 20,
            max_total_size: 1 << 44,
        }
    }
}

/// What a build is doing, see [`Progress::phase`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// Reading the source: walking the tree, or reading the tar stream into the spool.
    Scan,
    /// Writing inodes and file data.
    Write,
    /// Completing the output (layers: hashing the blob; fsync).
    Finish,
    /// Done (successfully or not).
    Done,
}

/// Live counters of a build, shared with the caller (cheap to clone: one `Arc`).
///
/// Put a clone in [`crate::BuildOptions::progress`] and poll it from another thread (e.g.
/// every 200 ms) to draw a progress line. Counters only grow, except that the phase moves
/// forward. `total_*` are known once the scan is over (phase [`Phase::Write`]).
#[derive(Debug, Clone, Default)]
pub struct Progress(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    phase: AtomicU8,
    scanned_entries: AtomicU64,
    scanned_bytes: AtomicU64,
    total_files: AtomicU64,
    total_bytes: AtomicU64,
    files: AtomicU64,
    bytes: AtomicU64,
}

/// A consistent-enough copy of [`Progress`] (each counter read once, relaxed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProgressSnapshot {
    /// The current phase.
    pub phase: Phase,
    /// Entries seen by the scan (directory entries, or tar headers of entries).
    pub scanned_entries: u64,
    /// Bytes read by the scan: for tar input, bytes of the (decompressed) tar stream; for a
    /// directory, the sizes of the regular files seen.
    pub scanned_bytes: u64,
    /// Regular files (distinct inodes) to write, known from [`Phase::Write`] on.
    pub total_files: u64,
    /// Their bytes (sizes, holes included).
    pub total_bytes: u64,
    /// Regular files written so far.
    pub files: u64,
    /// File bytes written so far (holes included: they count when skipped).
    pub bytes: u64,
}

impl Progress {
    /// New counters, all zero, phase [`Phase::Scan`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> ProgressSnapshot {
        let c = &self.0;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProgressSnapshot {
            phase: self.phase(),
            scanned_entries: get(&c.scanned_entries),
            scanned_bytes: get(&c.scanned_bytes),
            total_files: get(&c.total_files),
            total_bytes: get(&c.total_bytes),
            files: get(&c.files),
            bytes: get(&c.bytes),
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        match self.0.phase.load(Ordering::Relaxed) {
            0 => Phase::Scan,
            1 => Phase::Write,
            2 => Phase::Finish,
            _ => Phase::Done,
        }
    }

    pub(crate) fn set_phase(&self, p: Phase) {
        let v = match p {
            Phase::Scan => 0,
            Phase::Write => 1,
            Phase::Finish => 2,
            Phase::Done => 3,
        };
        self.0.phase.fetch_max(v, Ordering::Relaxed);
    }

    pub(crate) fn scanned(&self, entries: u64, bytes: u64) {
        self.0.scanned_entries.fetch_add(entries, Ordering::Relaxed);
        self.0.scanned_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn set_totals(&self, files: u64, bytes: u64) {
        self.0.total_files.store(files, Ordering::Relaxed);
        self.0.total_bytes.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn wrote(&self, files: u64, bytes: u64) {
        self.0.files.fetch_add(files, Ordering::Relaxed);
        self.0.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Reports progress (if asked) and marks the build done when dropped.
pub(crate) struct ProgressGuard<'a>(pub(crate) Option<&'a Progress>);

impl ProgressGuard<'_> {
    pub(crate) fn scanned(&self, entries: u64, bytes: u64) {
        if let Some(p) = self.0 {
            p.scanned(entries, bytes);
        }
    }
    pub(crate) fn wrote(&self, files: u64, bytes: u64) {
        if let Some(p) = self.0 {
            p.wrote(files, bytes);
        }
    }
    pub(crate) fn phase(&self, ph: Phase) {
        if let Some(p) = self.0 {
            p.set_phase(ph);
        }
    }
    pub(crate) fn totals(&self, files: u64, bytes: u64) {
        if let Some(p) = self.0 {
            p.set_totals(files, bytes);
        }
    }
}

impl Drop for ProgressGuard<'_> {
    fn drop(&mut self) {
        self.phase(Phase::Done);
    }
}

/// What to do with an overlayfs xattr (`trusted.overlay.*` or `user.overlay.*`) found in an
/// overlay upper directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OverlayXattr {
    /// Keep it (`opaque`, the `whiteout`/`whiteouts` markers, and names we do not know).
    Keep,
    /// Drop it: bookkeeping about the old upper's own identity (`origin`, `impure`,
    /// `nlink`, `upper`, `uuid`, `protattr`) that means nothing in a new layer.
    Drop,
    /// Refuse the input: `redirect` (renamed directory whose contents stay in a lower
    /// layer) and `metacopy` (a file whose data stays in a lower layer): the upper does not
    /// hold what the new layer must contain.
    Refuse,
}

/// Classifies an xattr name of an overlay upper (see [`OverlayXattr`]).
pub(crate) fn overlay_xattr(name: &[u8]) -> OverlayXattr {
    let rest = name
        .strip_prefix(b"trusted.overlay.")
        .or_else(|| name.strip_prefix(b"user.overlay."));
    match rest {
        None => OverlayXattr::Keep,
        Some(b"origin" | b"impure" | b"nlink" | b"upper" | b"uuid" | b"protattr") => {
            OverlayXattr::Drop
        }
        Some(b"redirect" | b"metacopy") => OverlayXattr::Refuse,
        Some(_) => OverlayXattr::Keep,
    }
}

/// Creates the unnamed spool file in `dir`.
pub(crate) fn create_spool(dir: &Path) -> Result<File> {
    use rustix::fs::{Mode, OFlags};
    let ctx = || format!("create a temporary spool file in {}", dir.display());
    match rustix::fs::open(
        dir,
        OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    ) {
        Ok(fd) => return Ok(File::from(fd)),
        Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::ISDIR) => {}
        Err(e) => return Err(io_err(ctx())(e.into())),
    }
    // No O_TMPFILE on this filesystem: a fresh name, unlinked at once.
    for attempt in 0u32..100 {
        let p = dir.join(format!(".erofs-spool-{}-{attempt}", std::process::id()));
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&p)
        {
            Ok(f) => {
                std::fs::remove_file(&p).map_err(io_err(ctx()))?;
                return Ok(f);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_err(ctx())(e)),
        }
    }
    Err(Error::Io {
        context: ctx(),
        source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_xattrs_are_classified() {
        assert_eq!(overlay_xattr(b"trusted.overlay.opaque"), OverlayXattr::Keep);
        assert_eq!(overlay_xattr(b"user.overlay.opaque"), OverlayXattr::Keep);
        assert_eq!(overlay_xattr(b"trusted.overlay.origin"), OverlayXattr::Drop);
        assert_eq!(overlay_xattr(b"trusted.overlay.impure"), OverlayXattr::Drop);
        assert_eq!(
            overlay_xattr(b"trusted.overlay.redirect"),
            OverlayXattr::Refuse
        );
        assert_eq!(
            overlay_xattr(b"trusted.overlay.metacopy"),
            OverlayXattr::Refuse
        );
        assert_eq!(overlay_xattr(b"user.mime"), OverlayXattr::Keep);
    }

    #[test]
    fn spool_has_no_name() {
        let dir = tempfile::tempdir().unwrap();
        let f = create_spool(dir.path()).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"x", 0).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn progress_phase_only_moves_forward() {
        let p = Progress::new();
        p.set_phase(Phase::Write);
        p.set_phase(Phase::Scan);
        assert_eq!(p.phase(), Phase::Write);
        p.wrote(2, 10);
        let s = p.snapshot();
        assert_eq!((s.files, s.bytes), (2, 10));
    }
}
