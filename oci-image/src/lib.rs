//! # oci-image: OCI images in and out of Strata layer stacks
//!
//! Strata stores layers as EROFS meta images + data blobs (`erofs-builder`, `fs-cache`). This
//! crate converts between those stacks and the formats the container world exchanges:
//!
//! * **import** ([`open_image`] → [`ImagePlan`], then [`import::build_layers`] and
//!   [`store::push_stack`]): an [OCI image layout] (a directory, or a tar of one, plain, gzip
//!   or zstd) or a `docker save` archive (the old format: `manifest.json` + `<id>/layer.tar`;
//!   Docker 25+ writes an OCI layout with a `manifest.json` beside it, read as a layout) →
//!   one Strata layer per image layer, or one layer of the whole image (`flatten`);
//! * **export** ([`export::write_layout`], [`export::write_flat_image`]): a stack of Strata
//!   layers → an OCI image layout (directory or `.tar`) with one gzip or zstd layer tar per
//!   Strata layer, or one full EROFS image of the merged stack.
//!
//! [OCI image layout]: https://github.com/opencontainers/image-spec/blob/main/image-layout.md
//!
//! ## What import validates (and refuses with [`Error`], never a panic)
//!
//! * `oci-layout`: JSON, `imageLayoutVersion` `1.0.0` (any `1.x.y`); `index.json`:
//!   `schemaVersion` 2, the index media type when given. Every JSON document is at most
//!   [`MAX_JSON`] bytes (descriptor sizes are checked before reading).
//! * Descriptors: digests must be `sha256:` + 64 lowercase hex digits (anything else is
//!   refused: blob paths are made from validated digests only, `blobs/sha256/<hex>`), the
//!   media type must be one we know for its place, the size must be the blob's size.
//! * Every blob read — index (nested), manifest, config, each layer — is hashed while it is
//!   read and compared with its descriptor's digest and size; a layer is also decompressed
//!   (by its media type) and the sha256 of the tar compared with the config's
//!   `rootfs.diff_ids[i]` (`rootfs.type` must be `layers`, one diff_id per layer). Nothing is
//!   pushed to the store until every layer of the image passed.
//! * Selection: `--ref TAG` picks the index entry whose `org.opencontainers.image.ref.name`
//!   (or `io.containerd.image.name`) is TAG; without it the index must hold one image. A
//!   manifest list (an index with several platforms) resolves to `--platform OS/ARCH[/VARIANT]`,
//!   by default `linux/amd64`; when that platform is not there the error lists the ones
//!   that are. Nested indexes are followed up to [`MAX_INDEX_DEPTH`] levels. The config's
//!   `os` must be `linux`.
//! * The layout itself: in a directory every file is opened with `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_SYMLINKS)` (a symlink anywhere in a blob's path is refused, so is a path that
//!   leaves the layout); in an archive names with `..` or NUL are refused and a symlink or
//!   hard link entry is refused for OCI layouts. A `docker save` archive may name layers by
//!   paths from its `manifest.json` (checked: relative, no `..`) and may deduplicate a layer
//!   by a relative symlink to another entry of the archive, resolved by name inside the
//!   archive (one hop, never through the filesystem).
//! * The layer tars themselves are read by `erofs-builder`'s own tar reader, which refuses
//!   hostile entries (`..`, symlinked parents, links out of the layer, oversized records) and
//!   turns OCI whiteouts into overlay whiteouts (`.wh.NAME` → character device 0:0,
//!   `.wh..wh..opq` → `trusted.overlay.opaque=y`).
//!
//! ## Naming of imported layers
//!
//! An image of `n` layers imported as `KIND/NAME:VERSION` becomes `n` Strata layers: the
//! top one is `KIND/NAME:VERSION`; the one `k` levels from the bottom (`k = 1..n-1`) is
//! `KIND/NAME-k:VERSION` (a one-layer image is just `KIND/NAME:VERSION`). Each layer's
//! manifest records the stack beneath it in `parents`, lowest first — the meaning `parents`
//! has everywhere in Strata — so `KIND/NAME:VERSION` alone names the whole image. The
//! manifest's `source` records the image (`oci:PATH@sha256:<manifest>` or
//! `docker-save:PATH`) and the layer's diff_id. With `flatten` the image becomes the one
//! layer `KIND/NAME:VERSION` without parents, the layers merged as an overlay mount would
//! show them (`erofs_builder::Source::TarStack`). Building is deterministic (the layer's
//! build time is the tar's root mtime, or 0), so importing the same image twice pushes the
//! same content and the second push is a no-op.
//!
//! ## Export: the mapping from Strata layers to OCI layer tars
//!
//! Each layer is read from the store with Strata's own reader: the meta image whole
//! (verified against its blake3), file data through the chunk cache by the EROFS chunk
//! indexes (`Image::data_map`: chunk `i` of a file is at `startblk * 4096` of the blob, each
//! 256 KiB chunk verified against the blob's chunk table). No kernel mount, no daemon.
//!
//! | in the Strata layer (EROFS) | in the layer tar |
//! | --- | --- |
//! | root directory | `./` (mode, owner, mtime, xattrs) |
//! | directory, file, symlink, device, fifo | `PATH/`, `PATH`, …; ustar, with PAX records for long names and link targets, mtimes with nanoseconds, big ids and sizes, and xattrs (`SCHILY.xattr.NAME`) |
//! | a second name of a hard-linked inode | a hard link (type `1`) to the first name in tree order |
//! | overlay whiteout (character device 0:0) | an empty file `.wh.NAME` with the whiteout's mode, owner and mtime |
//! | `trusted.overlay.opaque=y` (or `user.overlay.opaque=y`) on a directory | the directory without that xattr, and an empty `DIR/.wh..wh..opq` |
//! | a name that starts with `.wh.` | **refused** ([`Error::WhiteoutName`], with the path): in a tar it would delete files of the layers beneath (podman #3582) |
//! | any other `trusted.overlay.*` / `user.overlay.*` xattr | **refused** ([`Error::Unsupported`]) |
//! | socket | skipped (tar has no socket type), counted in [`export::LayerTarStats::skipped_sockets`] |
//! | holes of sparse files | zeros (plain file data) |
//!
//! Entries are written depth first, each directory's children in name-byte order; the root
//! first. The layout: `oci-layout`, `index.json` (one manifest, tagged
//! `org.opencontainers.image.ref.name`), `blobs/sha256/` holding the layers (zstd level 3 as one
//! frame, or gzip level 6 as one member per 8 MiB of tar, two members compressed at a time;
//! compression runs beside the thread that walks the layer; no timestamps in gzip headers), the config (`rootfs.diff_ids` =
//! sha256 of each uncompressed tar, one `history` entry per layer naming it, `created` =
//! the top layer's manifest time) and the manifest. The output is a pure function of the
//! stored layers and the options: exporting twice gives the same bytes. It appears
//! atomically (a temporary directory renamed, or a temporary tar renamed).
//!
//! `--erofs`: the stack's tars (uncompressed, in an unnamed temporary file each) merged by
//! `erofs_builder::Source::TarStack` and written as one full image (file data inline,
//! whiteouts applied and gone), which `fsck.erofs` and the kernel accept.

#![forbid(unsafe_code)]

use std::path::PathBuf;

pub mod archive;
pub mod digest;
pub mod export;
pub mod image;
pub mod import;
pub mod store;
pub mod tarw;

pub use digest::Sha256Digest;
pub use image::{open_image, ImagePlan, LayerPlan, OpenOptions};

/// Largest JSON document (`oci-layout`, `index.json`, a manifest, a config, a docker
/// `manifest.json`) read: 4 MiB.
pub const MAX_JSON: u64 = 4 << 20;
/// Most levels of nested image indexes followed.
pub const MAX_INDEX_DEPTH: usize = 4;

/// Everything that can go wrong importing or exporting an image.
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
    /// The image is malformed or hostile: bad JSON, a bad digest string, an unknown media
    /// type, a path that leaves the layout, a symlink in the layout, an oversized document.
    #[error("invalid image: {what}: {reason}")]
    Invalid {
        /// Which part (a file of the layout, a descriptor).
        what: String,
        /// Why.
        reason: String,
    },
    /// A blob's bytes do not hash to the digest its descriptor (or the config's diff_ids)
    /// gives.
    #[error("digest mismatch for {what}: expected {expected}, got {actual}")]
    DigestMismatch {
        /// Which blob.
        what: String,
        /// The digest the image claims.
        expected: String,
        /// The digest of the bytes read.
        actual: String,
    },
    /// A blob's size is not its descriptor's.
    #[error("size mismatch for {what}: expected {expected} bytes, got {actual}")]
    SizeMismatch {
        /// Which blob.
        what: String,
        /// The size the descriptor gives.
        expected: u64,
        /// The bytes read.
        actual: u64,
    },
    /// The image names several candidates and the options do not pick one.
    #[error("{0}")]
    Ambiguous(String),
    /// Something valid that this code does not handle (another digest algorithm, a foreign
    /// OS, an overlay xattr without an OCI equivalent).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Export: a file or directory whose name starts with `.wh.` (a whiteout in disguise).
    #[error(
        "layer {layer}: {path:?} is named like an OCI whiteout; in a layer tar it would \
         delete files of the layers beneath, so it is not exported"
    )]
    WhiteoutName {
        /// The Strata layer.
        layer: String,
        /// The path in the layer.
        path: String,
    },
    /// The layer builder or reader failed (including a hostile layer tar).
    #[error(transparent)]
    Build(#[from] erofs_builder::Error),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] fs_cache::Error),
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

pub(crate) fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Invalid {
        what: what.into(),
        reason: reason.into(),
    }
}

/// Parses `data` as each JSON document of a layout (oci-layout, index, manifest, config,
/// docker manifest.json), and as an image archive (a plain tar, in an unnamed file in
/// `scratch`) that is then planned as an import (index → manifest → config → layers, every
/// document read checked), ignoring the results: it must return without a panic or an
/// unbounded allocation. For the `oci_layout` fuzz target.
pub fn fuzz_parse(data: &[u8], scratch: &std::path::Path) {
    use std::io::Write;
    image::fuzz_documents(data);
    let Ok(mut f) = tempfile::tempfile_in(scratch) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    if let Ok(a) = archive::Archive::from_plain_file(f) {
        let _ = image::plan_layout(
            archive::Layout::Archive(a),
            std::path::Path::new("fuzz"),
            &OpenOptions::default(),
        );
    }
}

/// Where temporary files go when the caller gives no directory.
pub(crate) fn temp_dir_or(dir: Option<&PathBuf>) -> PathBuf {
    dir.cloned().unwrap_or_else(std::env::temp_dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tarw::{EntryType, Header, TarWriter};

    /// A small valid layout archive, then thousands of mutations of it through the fuzz
    /// entry point: nothing panics, and the scratch directory stays empty.
    #[test]
    fn mutated_archives_never_panic() {
        let layer = {
            let mut t = TarWriter::new(Vec::new());
            let mut h = Header::new("f", EntryType::File);
            h.size = 1;
            t.append(&h).unwrap();
            t.data(b"x").unwrap();
            t.finish().unwrap()
        };
        let ld = Sha256Digest::of(&layer);
        let config = format!(
            r#"{{"architecture":"amd64","os":"linux","rootfs":{{"type":"layers","diff_ids":["{ld}"]}}}}"#
        );
        let cd = Sha256Digest::of(config.as_bytes());
        let manifest = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{cd}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{ld}","size":{}}}]}}"#,
            config.len(),
            layer.len()
        );
        let md = Sha256Digest::of(manifest.as_bytes());
        let index = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{md}","size":{}}}]}}"#,
            manifest.len()
        );
        let mut t = TarWriter::new(Vec::new());
        for (name, data) in [
            (
                "oci-layout".to_string(),
                br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
            ),
            ("index.json".to_string(), index.into_bytes()),
            (md.blob_path(), manifest.into_bytes()),
            (cd.blob_path(), config.into_bytes()),
            (ld.blob_path(), layer),
        ] {
            let mut h = Header::new(name.as_bytes(), EntryType::File);
            h.size = data.len() as u64;
            t.append(&h).unwrap();
            t.data(&data).unwrap();
        }
        let archive = t.finish().unwrap();
        let scratch = tempfile::tempdir().unwrap();
        // The unmutated archive plans.
        let f = tempfile::tempfile_in(scratch.path()).unwrap();
        std::io::Write::write_all(&mut &f, &archive).unwrap();
        let a = archive::Archive::from_plain_file(f).unwrap();
        let plan = image::plan_layout(
            archive::Layout::Archive(a),
            std::path::Path::new("x"),
            &OpenOptions::default(),
        )
        .unwrap();
        assert_eq!(plan.layers.len(), 1);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..3000 {
            let mut m = archive.clone();
            for _ in 0..1 + (x % 4) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % m.len();
                m[i] = (x >> 32) as u8;
            }
            fuzz_parse(&m, scratch.path());
        }
        assert_eq!(std::fs::read_dir(scratch.path()).unwrap().count(), 0);
    }
}
