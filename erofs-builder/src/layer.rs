//! Lazy layers: a **meta image** (superblock, device table, inodes, xattrs, directories,
//! symlinks; no regular file data but, with [`LayerOptions::inline_max`], small files inline)
//! plus one **data blob** holding the data of every other regular file, addressed chunk by
//! chunk, and optionally a second blob, the **tails blob**, for the partial chunks
//! (`docs/format.md`, "Layers").
//!
//! Every other non-empty regular file is a chunk-based inode (256 KiB chunks, 8-byte chunk
//! indexes on device 1 = the blob). In the blob (placement: `placer.rs`):
//!
//! * a **full chunk** (256 KiB of file data) starts at a 256 KiB-aligned blob offset, so it is
//!   exactly one cache chunk;
//! * a **partial chunk** (a file smaller than 256 KiB, or the last piece of a larger file)
//!   takes whole 4 KiB blocks and is packed: first into the first alignment gap left before
//!   an earlier full chunk that fits it (the newest 64 gaps are kept), else at the end;
//! * the partial chunks of one directory whose partial chunks add up to at least
//!   [`TAIL_RUN_MIN_BLOCKS`] are packed together, in a run of whole chunks reserved for them
//!   at a 256 KiB boundary when the writer reaches the directory's first file (what the run
//!   does not use becomes a gap): so a directory whose files did not change packs into the
//!   same chunks, byte for byte, whatever changed before it in the tree (what dedup against
//!   an earlier version needs);
//! * identical chunks (same blake3 of their block-padded bytes) are stored once and
//!   referenced by several chunk indexes;
//! * chunks that are all zero, or lie in a hole of the source file, are not stored: their
//!   index is the hole marker (`NULL_ADDR`) and they read as zeros;
//! * with a [`ChunkDictionary`] (the chunks of blobs already stored: earlier versions of the
//!   layer, its kind's other layers), a full chunk the dictionary holds is not stored again:
//!   its index points into that blob, an extra device (ids 2.. in order of first use, at most
//!   [`MAX_DICT_DEVICES`]); the layer then needs those blobs too ([`LayerStats::devices`]).
//!   A dictionary blob's chunk `j` is 256 KiB at blob offset `j × 256 KiB`, so an index at
//!   block `j × 64` of its device reads exactly the chunk the dictionary's digest names,
//!   whatever the blob held there (a full chunk, or packed tails that happen to be equal).
//! * packed tails dedup too, in a second pass (sources that can be read twice: a directory
//!   or an upper): the first pass's blob chunks that the dictionary holds (a run of small
//!   files packed as in an earlier version) are remembered; the second pass, laying out
//!   exactly the same way, points each tail that falls wholly inside one of them at the same
//!   offset of the dictionary's chunk instead of writing it, after checking its bytes equal
//!   the first pass's there (a source changed between the passes is written, never
//!   mis-pointed). The space stays in the blob, as zeros (stored as an almost empty frame).
//!
//! ## With a tails blob ([`LayerOptions::tails`])
//!
//! The layer has two blobs of its own, and the EROFS chunk stays 256 KiB:
//!
//! * **device 1, the main blob**, holds only full chunks, each at the next 256 KiB offset:
//!   no gaps, no packed tails, its length a multiple of 256 KiB, each 256 KiB cache chunk one
//!   file chunk. Dictionary lookups and in-layer dedup of full chunks are as above.
//! * **device 2, the tails blob**, holds every partial chunk. Its cache chunk size is its own,
//!   T ([`TailsBlob::chunk_size`], a power of two, 4 KiB..=128 KiB; 16 KiB is the
//!   default), and the packing rules above apply in units of T: a directory whose tails take
//!   at least half of T (at most [`TAIL_RUN_MIN_BLOCKS`] blocks) gets a run of whole T
//!   chunks at a T boundary; gaps are what runs and alignment leave. A tail is one chunk
//!   index `(device 2, block)`; it may span several T chunks. Identical tails are stored
//!   once. The tails blob is never empty: without tails it is one zero block; nor, with a
//!   tails blob, is the main blob (one zero block when it would hold no chunk).
//! * **dictionary devices** come after: ids 3.. in order of first use, at most
//!   [`MAX_DICT_DEVICES_WITH_TAILS`] (32 devices in all); [`LayerStats::devices`] lists them
//!   in that order, so device id = 3 + position.
//! * the second pass hashes the first pass's *tails blob* in T chunks and looks them up in the
//!   dictionary's blobs with T chunks (an earlier version's tails blob). A tail whose first
//!   pass T chunks `c..=c+k` map to consecutive chunks `j..=j+k` of one such blob is pointed
//!   at the same offset there (after the same byte compare); so a rebuild where a few small
//!   files changed (same sizes) reuses every T chunk that holds none of them.
//!
//! File data is streamed through one 256 KiB buffer. Each blob's blake3 digest is computed
//! after it is complete (a second, sequential read); the main blob's becomes its device tag
//! (unless the caller supplies one), the tails blob's always is its tag; both are patched
//! into the meta image before its checksum is taken.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use zerocopy::IntoBytes;

use crate::data::DataFile;
pub use crate::dictionary::{
    ChunkDictionary, MAX_DICT_CHUNKS, MAX_DICT_DEVICES, MAX_DICT_DEVICES_WITH_TAILS,
};
use crate::ondisk::{ChunkIndex, DeviceSlot, BLOCK_SIZE, CHUNK_FORMAT_INDEXES, NULL_ADDR};
use crate::placer::Placer;
use crate::source::ProgressGuard;
use crate::writer::{build, tmp_path};
use crate::{io_err, BuildOptions, BuildStats, Error, Result, Source};

/// log2 of the chunk size in blocks (256 KiB / 4 KiB = 2^6).
pub const CHUNK_BLKBITS: u16 = 6;
/// Chunk size of chunk-based files in layers: 256 KiB, the main blob's cache chunk.
pub const CHUNK_SIZE: u64 = BLOCK_SIZE << CHUNK_BLKBITS;
const CHUNK_BLOCKS: u64 = 1 << CHUNK_BLKBITS;
/// `i_u.c.format` of our chunk-based inodes: 8-byte indexes, chunk = block << 6.
pub const CHUNK_FORMAT: u16 = CHUNK_FORMAT_INDEXES | CHUNK_BLKBITS;
/// The device id chunk indexes use for the (main) blob.
pub const BLOB_DEVICE_ID: u16 = 1;
/// The device id chunk indexes use for the tails blob, when the layer has one.
pub const TAILS_DEVICE_ID: u16 = 2;

/// The tails blob's chunk size by default (16 KiB: `bench/README.md`, "peers").
pub const DEFAULT_TAIL_CHUNK_SIZE: u32 = 16 << 10;

/// The largest [`LayerOptions::inline_max`] that matters: a file inline in the meta image is
/// under one block (4096 bytes) with its inode.
pub const INLINE_MAX: u64 = BLOCK_SIZE - 1;

/// The default cap on a layer's inline bytes: 1/16 of its regular files' bytes (sizes as
/// the files report them), at most [`INLINE_BUDGET_MAX`]. A sandbox reads 4–13% of its
/// layers' bytes, so the meta image grows by about what a first read fetches anyway; on
/// minbase (167 MB, 4.3 MB in 3,312 files under 4 KiB) every such file fits, on a
/// `/usr/share` of 47,000 files (49 MB of them under 4 KiB) the cap keeps the meta image
/// from growing eightfold.
pub fn default_inline_budget(file_bytes: u64) -> u64 {
    (file_bytes / 16).min(INLINE_BUDGET_MAX)
}

/// The most a layer inlines by default (bytes): what a node fetches with the meta image at
/// its first mount stays a few MB, whatever the layer's size.
pub const INLINE_BUDGET_MAX: u64 = 8 << 20;
/// The smallest tails chunk size (one block).
pub const MIN_TAIL_CHUNK_SIZE: u32 = BLOCK_SIZE as u32;
/// The largest tails chunk size (128 KiB: half an EROFS chunk).
pub const MAX_TAIL_CHUNK_SIZE: u32 = 128 << 10;

/// A directory whose files' partial chunks take at least this many blocks (128 KiB) gets a
/// run of its own (see the module docs; a tails blob's runs need half of its chunk size).
pub const TAIL_RUN_MIN_BLOCKS: u64 = 32;

/// The blocks a file of `size` bytes's partial chunk takes in the blob (0: none).
pub(crate) fn tail_blocks(size: u64) -> u64 {
    (size % CHUNK_SIZE).div_ceil(BLOCK_SIZE)
}

/// Where a layer's tails blob goes and its chunk size ([`LayerOptions::tails`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TailsBlob {
    /// The tails blob file (written atomically like the main blob, after it).
    pub path: PathBuf,
    /// The tails blob's cache chunk size T in bytes: a power of two in
    /// [`MIN_TAIL_CHUNK_SIZE`]..=[`MAX_TAIL_CHUNK_SIZE`] ([`DEFAULT_TAIL_CHUNK_SIZE`]).
    pub chunk_size: u32,
}

impl TailsBlob {
    pub fn new(path: impl Into<PathBuf>, chunk_size: u32) -> Self {
        Self {
            path: path.into(),
            chunk_size,
        }
    }

    /// Refuses a bad chunk size, or a path that is one of the other outputs.
    fn check(&self, meta_out: &Path, blob_out: &Path) -> Result<()> {
        let reason = if !self.chunk_size.is_power_of_two()
            || !(MIN_TAIL_CHUNK_SIZE..=MAX_TAIL_CHUNK_SIZE).contains(&self.chunk_size)
        {
            format!(
                "tails chunk size {} is not a power of two in 4 KiB..=128 KiB",
                self.chunk_size
            )
        } else if self.path == blob_out || self.path == meta_out {
            "the tails blob's path is another output's".to_owned()
        } else {
            return Ok(());
        };
        Err(Error::UnsupportedInput {
            path: self.path.clone(),
            reason,
        })
    }

    fn chunk_blocks(&self) -> u64 {
        u64::from(self.chunk_size) / BLOCK_SIZE
    }
}

/// Options for [`build_layer`].
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct LayerOptions {
    /// Options shared with full images (times, uuid, volume name, xattrs, checksum, fsync).
    pub build: BuildOptions,
    /// The blob's device tag (at most 64 bytes). `None`: the blob's blake3 digest as 64
    /// lowercase hex characters (filling the tag, no NUL), which is what Strata names blobs by.
    pub tag: Option<Vec<u8>>,
    /// Chunks already stored elsewhere, pointed at instead of stored again (`None`: the
    /// layer's data is all in its own blob(s)).
    pub dictionary: Option<std::sync::Arc<ChunkDictionary>>,
    /// Regular files (paths relative to the source's root, `a/b/c`) whose data is laid out
    /// before everything else, in this order, their partial chunks packed together: a
    /// recorded access trace's order (`strata layer build --order-from`), so that what the
    /// trace read together is stored, and fetched, together. Paths that are not regular files
    /// with data in the source are ignored.
    pub first: Vec<std::path::PathBuf>,
    /// A second blob for the partial chunks (device 2, see the module docs). `None`: one
    /// blob, laid out exactly as without this option.
    pub tails: Option<TailsBlob>,
    /// Regular files of at most this many bytes (and under 4096) are stored in the meta image
    /// itself, flat-inline after their inode, when inode, xattrs and data fit one block: a
    /// node reads them with the inode, from its local copy of the meta image, with no blob
    /// fetch or FUSE round trip. They are not in any blob, so not deduplicated across layers.
    /// 0 (the default here): every regular file with data is chunk-based. The smallest
    /// files go first, up to [`LayerOptions::inline_budget`] bytes in all.
    pub inline_max: u64,
    /// At most this many bytes of file data inline in the meta image (smallest files first).
    /// `None`: [`default_inline_budget`] of the layer's file bytes, which bounds what every
    /// node fetches with the meta image at its first mount, whether it reads those files or
    /// not.
    pub inline_budget: Option<u64>,
}

/// What [`build_layer`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LayerStats {
    /// Counts for the tree; `image_bytes` is the meta image's size.
    pub meta: BuildStats,
    /// Bytes in the (main) blob file (a multiple of 4096; of 256 KiB with a tails blob).
    pub blob_bytes: u64,
    /// blake3 of the whole blob file.
    pub blob_blake3: [u8; 32],
    /// Chunk indexes that point into the blob.
    pub chunks: u64,
    /// Distinct chunks stored in the blob (`chunks - unique_chunks` were deduplicated).
    pub unique_chunks: u64,
    /// Chunk indexes that are holes (all-zero or unallocated source ranges).
    pub hole_chunks: u64,
    /// Blob bytes occupied by stored chunks (the rest is alignment padding).
    pub stored_bytes: u64,
    /// The dictionary's blobs the meta image points into, in device order: indexes of
    /// [`ChunkDictionary::add_blob`]. `devices[i]` is device id 2 + i, or 3 + i with a tails
    /// blob (device 2). Empty without a dictionary.
    pub devices: Vec<usize>,
    /// Chunk indexes that point into a dictionary's blob (not stored in this layer's blobs).
    pub dict_chunks: u64,
    /// The tails blob, with [`LayerOptions::tails`].
    pub tails: Option<TailsStats>,
}

impl LayerStats {
    /// The blob's blake3 digest in lowercase hex (the default device tag).
    pub fn blob_blake3_hex(&self) -> String {
        hex(&self.blob_blake3)
    }
}

/// What [`build_layer`] wrote to the tails blob.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TailsStats {
    /// Bytes in the tails blob file (a multiple of 4096, at least 4096).
    pub bytes: u64,
    /// blake3 of the whole tails blob file (its device tag, in hex).
    pub blake3: [u8; 32],
    /// Chunk indexes that point into the tails blob.
    pub chunks: u64,
    /// Distinct partial chunks stored in it.
    pub unique_chunks: u64,
    /// Bytes occupied by stored partial chunks (the rest is padding, or zeros left where
    /// the second pass pointed a tail into a dictionary blob).
    pub stored_bytes: u64,
    /// Its cache chunk size ([`TailsBlob::chunk_size`]).
    pub chunk_size: u32,
}

impl TailsStats {
    /// The tails blob's blake3 digest in lowercase hex (its device tag).
    pub fn blake3_hex(&self) -> String {
        hex(&self.blake3)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Builds a lazy layer from the tree at `src_dir`: the meta image at `meta_out`, the data
/// blob at `blob_out` and, with [`LayerOptions::tails`], the tails blob at its path (each
/// replaced atomically by a rename: the meta image first, then the blob, then the tails blob;
/// on error no temporary file is left behind). The same as [`build_layer_from`] with
/// [`Source::Dir`].
pub fn build_layer(
    src_dir: &Path,
    meta_out: &Path,
    blob_out: &Path,
    opts: &LayerOptions,
) -> Result<LayerStats> {
    build_layer_from(Source::Dir(src_dir.to_path_buf()), meta_out, blob_out, opts)
}

/// Builds a lazy layer from `source` (a directory, an overlay upper or a layer tar stream,
/// see [`Source`]); outputs and atomicity as in [`build_layer`]. A tar stream's spool goes
/// to [`crate::TarOptions::temp_dir`] or the meta image's directory.
pub fn build_layer_from(
    source: Source,
    meta_out: &Path,
    blob_out: &Path,
    opts: &LayerOptions,
) -> Result<LayerStats> {
    if opts.tag.as_ref().is_some_and(|t| t.len() > 64) {
        return Err(Error::UnsupportedInput {
            path: blob_out.to_path_buf(),
            reason: "device tag longer than 64 bytes".into(),
        });
    }
    if let Some(t) = &opts.tails {
        t.check(meta_out, blob_out)?;
    }
    let again = match (&source, &opts.dictionary) {
        (Source::Dir(p), Some(_)) => Some(Source::Dir(p.clone())),
        (Source::OverlayUpper(p), Some(_)) => Some(Source::OverlayUpper(p.clone())),
        _ => None,
    };
    let blob_tmp = tmp_path(blob_out);
    let tails_tmp = opts.tails.as_ref().map(|t| tmp_path(&t.path));
    let remove_tmps = || {
        let _ = std::fs::remove_file(&blob_tmp);
        if let Some(t) = &tails_tmp {
            let _ = std::fs::remove_file(t);
        }
    };
    let mut blob = match BlobWriter::create(&blob_tmp, tails_tmp.as_deref(), opts) {
        Ok(b) => b,
        Err(e) => {
            remove_tmps();
            return Err(e);
        }
    };
    let mut meta = build(source, meta_out, &opts.build, Some(&mut blob));
    if let (Some(src), Ok(_)) = (again, &meta) {
        let tmps = (blob_tmp.as_path(), tails_tmp.as_deref());
        match second_pass(src, meta_out, tmps, opts, &blob) {
            Ok(Some((m, b))) => {
                meta = Ok(m);
                blob = b;
            }
            Ok(None) => {}
            Err(e) => meta = Err(e),
        }
    }
    let rename = |from: &Path, to: &Path| {
        std::fs::rename(from, to).map_err(io_err(format!(
            "rename {} to {}",
            from.display(),
            to.display()
        )))
    };
    let done = meta.and_then(|meta| {
        rename(&blob_tmp, blob_out)?;
        if let (Some(tmp), Some(t)) = (&tails_tmp, &opts.tails) {
            rename(tmp, &t.path)?;
        }
        Ok(meta)
    });
    let meta = match done {
        Ok(m) => m,
        Err(e) => {
            remove_tmps();
            return Err(e);
        }
    };
    let tails = blob.tails.as_ref().map(|t| TailsStats {
        bytes: t.blocks * BLOCK_SIZE,
        blake3: blob.tails_digest,
        chunks: blob.tails_count.chunks,
        unique_chunks: blob.tails_count.unique,
        stored_bytes: blob.tails_count.stored_blocks * BLOCK_SIZE,
        chunk_size: (t.chunk_blocks * BLOCK_SIZE) as u32,
    });
    Ok(LayerStats {
        meta,
        blob_bytes: blob.main.blocks * BLOCK_SIZE,
        blob_blake3: blob.digest,
        chunks: blob.main_count.chunks,
        unique_chunks: blob.main_count.unique,
        hole_chunks: blob.hole_chunks,
        stored_bytes: blob.main_count.stored_blocks * BLOCK_SIZE,
        devices: blob.used.clone(),
        dict_chunks: blob.dict_chunks,
        tails,
    })
}

/// The second pass of a dictionary build (see the module docs): `None` if no chunk of the
/// first pass's packing blob (the tails blob if there is one, else the blob) is in the
/// dictionary; else the meta image rebuilt at `meta_out` and the new blobs' writer (files at
/// `tmps` = (blob, tails), the first pass's packing blob removed).
fn second_pass(
    source: Source,
    meta_out: &Path,
    tmps: (&Path, Option<&Path>),
    opts: &LayerOptions,
    first: &BlobWriter,
) -> Result<Option<(BuildStats, BlobWriter)>> {
    let Some(dict) = &opts.dictionary else {
        return Ok(None);
    };
    let packer = first.packer();
    let packed_tmp = tmps.1.unwrap_or(tmps.0);
    let ctx = || format!("read {}", packed_tmp.display());
    let chunk_blocks = packer.chunk_blocks;
    let mut remap = HashMap::new();
    let mut digests = Vec::new();
    let mut buf = vec![0u8; (chunk_blocks * BLOCK_SIZE) as usize];
    for c in 0..packer.blocks / chunk_blocks {
        packer
            .file
            .read_exact_at(&mut buf, c * chunk_blocks * BLOCK_SIZE)
            .map_err(io_err(ctx()))?;
        let digest = *blake3::hash(&buf).as_bytes();
        let hit = dict
            .lookup(&digest, chunk_blocks)
            .filter(|&(b, _)| (b as usize) < first.dict_limit);
        if let Some(hit) = hit {
            remap.insert(c, hit);
        }
        if tmps.1.is_some() {
            digests.push(digest);
        }
    }
    if remap.is_empty() {
        return Ok(None);
    }
    let pass1 = packed_tmp.with_extension("pass1");
    std::fs::rename(packed_tmp, &pass1).map_err(io_err(format!(
        "rename {} to {}",
        packed_tmp.display(),
        pass1.display()
    )))?;
    let result = (|| {
        let mut blob = BlobWriter::create(tmps.0, tmps.1, opts)?;
        blob.remap = Some(Remap {
            chunks: remap,
            digests,
            chunk_blocks,
            spans: tmps.1.is_some(),
            pass1: File::open(&pass1).map_err(io_err(format!("open {}", pass1.display())))?,
        });
        let meta = build(source, meta_out, &opts.build, Some(&mut blob))?;
        blob.remap = None;
        Ok((meta, blob))
    })();
    let _ = std::fs::remove_file(&pass1);
    result.map(Some)
}

/// The second pass's map: first-pass packing blob chunk → (dictionary blob, its chunk), and
/// the first pass's packing blob to check tails against.
#[derive(Debug)]
struct Remap {
    chunks: HashMap<u64, (u32, u32)>,
    /// With a tails blob: the digest of each full chunk of the first pass's tails blob.
    digests: Vec<[u8; 32]>,
    /// The packing blob's chunk size in blocks (that of the dictionary chunks mapped to).
    chunk_blocks: u64,
    /// Whether a tail may span several chunks (with a tails blob; without one a tail must
    /// lie inside one chunk, as before tails blobs existed).
    spans: bool,
    pass1: File,
}

/// Chunk indexes and stored chunks of one of the layer's own blobs.
#[derive(Debug, Default)]
struct Counts {
    chunks: u64,
    unique: u64,
    stored_blocks: u64,
}

/// Writes the layer's blob(s): places, dedupes and writes chunks; emits chunk indexes.
#[derive(Debug)]
pub(crate) struct BlobWriter {
    /// The (main) blob, device 1.
    main: Placer,
    /// The tails blob, device 2, if the layer has one.
    tails: Option<Placer>,
    main_count: Counts,
    tails_count: Counts,
    tag: Option<Vec<u8>>,
    fsync: bool,
    /// (blocks, blake3 of the block-padded chunk) → device and start block.
    stored: HashMap<(u64, [u8; 32]), (u16, u32)>,
    buf: Vec<u8>,
    digest: [u8; 32],
    tails_digest: [u8; 32],
    hole_chunks: u64,
    dict: Option<std::sync::Arc<ChunkDictionary>>,
    /// Dictionary blobs with an index below this may be pointed into.
    dict_limit: usize,
    /// Dictionary blobs pointed into, in order of first use (device id = the first
    /// dictionary device's + position).
    used: Vec<usize>,
    /// Dictionary blob → its device id here.
    device_of: HashMap<u32, u16>,
    dict_chunks: u64,
    /// In a second pass: the tails to point into dictionary chunks.
    remap: Option<Remap>,
    /// [`LayerOptions::first`].
    pub(crate) first: Vec<PathBuf>,
    /// [`LayerOptions::inline_max`].
    pub(crate) inline_max: u64,
    /// [`LayerOptions::inline_budget`].
    pub(crate) inline_budget: Option<u64>,
}

impl BlobWriter {
    /// Creates the blob file at `path` and, if `tails` is given, the tails blob file there
    /// (with [`LayerOptions::tails`]'s chunk size).
    fn create(path: &Path, tails: Option<&Path>, opts: &LayerOptions) -> Result<Self> {
        let main = Placer::create(path, CHUNK_BLOCKS)?;
        let tails = match (tails, &opts.tails) {
            (Some(p), Some(t)) => Some(Placer::create(p, t.chunk_blocks())?),
            _ => None,
        };
        let dict_limit = if tails.is_some() {
            MAX_DICT_DEVICES_WITH_TAILS
        } else {
            MAX_DICT_DEVICES
        };
        Ok(Self {
            main,
            tails,
            main_count: Counts::default(),
            tails_count: Counts::default(),
            tag: opts.tag.clone(),
            fsync: opts.build.fsync,
            stored: HashMap::new(),
            buf: vec![0u8; CHUNK_SIZE as usize],
            digest: [0; 32],
            tails_digest: [0; 32],
            hole_chunks: 0,
            dict: opts.dictionary.clone(),
            dict_limit,
            used: Vec::new(),
            device_of: HashMap::new(),
            dict_chunks: 0,
            remap: None,
            first: opts.first.clone(),
            inline_max: opts.inline_max,
            inline_budget: opts.inline_budget,
        })
    }

    /// The blob partial chunks are packed into: the tails blob if there is one.
    fn packer(&self) -> &Placer {
        self.tails.as_ref().unwrap_or(&self.main)
    }

    /// The device id of the first dictionary blob pointed into.
    fn first_dict_device(&self) -> u16 {
        if self.tails.is_some() {
            TAILS_DEVICE_ID + 1
        } else {
            BLOB_DEVICE_ID + 1
        }
    }

    /// Device table slots the meta image reserves: the blob's, the tails blob's, and one
    /// per dictionary blob that may be pointed into.
    pub(crate) fn device_slots(&self) -> usize {
        let dict = self
            .dict
            .as_ref()
            .map_or(0, |d| d.blobs().min(self.dict_limit));
        1 + usize::from(self.tails.is_some()) + dict
    }

    /// Streams one regular file into the blob and appends its `ceil(size / CHUNK_SIZE)`
    /// chunk indexes to `idx`.
    pub(crate) fn add_file(
        &mut self,
        f: &DataFile<'_>,
        idx: &mut Vec<u8>,
        progress: &ProgressGuard<'_>,
    ) -> Result<()> {
        let size = f.size;
        let read_ctx = || format!("read {}", f.path.display());
        let nchunks = size.div_ceil(CHUNK_SIZE);
        let mut c = 0u64;
        while c < nchunks {
            let start = c * CHUNK_SIZE;
            let len = (size - start).min(CHUNK_SIZE);
            // Skip whole chunks that lie in a source hole without reading them.
            let next_data = match f.extent(start) {
                Ok(Some((d, _))) => d,
                Ok(None) => size,
                Err(e) => return Err(io_err(read_ctx())(e)),
            };
            if next_data >= start + len {
                let next = (next_data / CHUNK_SIZE).clamp(c + 1, nchunks);
                self.add_holes(next - c, idx);
                progress.wrote(0, (next * CHUNK_SIZE).min(size) - start);
                c = next;
                continue;
            }
            let mut buf = std::mem::take(&mut self.buf);
            let r = f
                .read_exact_at(&mut buf[..len as usize], start)
                .and_then(|()| self.add_chunk(&buf[..len as usize], idx));
            self.buf = buf;
            r?;
            progress.wrote(0, len);
            c += 1;
        }
        f.check_end()
    }

    /// Like [`Self::add_file`] for a file already read whole (small files read ahead): the
    /// same chunk indexes, holes where a chunk is all zeros.
    pub(crate) fn add_bytes(
        &mut self,
        data: &[u8],
        idx: &mut Vec<u8>,
        progress: &ProgressGuard<'_>,
    ) -> Result<()> {
        for chunk in data.chunks(CHUNK_SIZE as usize) {
            self.add_chunk(chunk, idx)?;
            progress.wrote(0, chunk.len() as u64);
        }
        Ok(())
    }

    /// Stores one chunk (see [`Self::store`]) and appends its index to `idx`: the hole
    /// marker if it is all zeros, else its place in a blob.
    fn add_chunk(&mut self, data: &[u8], idx: &mut Vec<u8>) -> Result<()> {
        match self.store(data)? {
            None => self.add_holes(1, idx),
            Some((device, blk)) => {
                let e = ChunkIndex {
                    startblk_hi: 0.into(),
                    device_id: device.into(),
                    startblk_lo: blk.into(),
                };
                idx.extend_from_slice(e.as_bytes());
                if device == BLOB_DEVICE_ID {
                    self.main_count.chunks += 1;
                } else if device == TAILS_DEVICE_ID && self.tails.is_some() {
                    self.tails_count.chunks += 1;
                }
            }
        }
        Ok(())
    }

    /// Appends `n` hole chunk indexes (`NULL_ADDR`: the chunk reads as zeros) to `idx`.
    fn add_holes(&mut self, n: u64, idx: &mut Vec<u8>) {
        let hole = ChunkIndex {
            startblk_lo: NULL_ADDR.into(),
            ..Default::default()
        };
        for _ in 0..n {
            idx.extend_from_slice(hole.as_bytes());
        }
        self.hole_chunks += n;
    }

    /// The dictionary chunk (blob, index) with this digest and size, among the blobs this
    /// layer may point into.
    fn dict_lookup(&self, digest: &[u8; 32], blocks: u64) -> Option<(u32, u32)> {
        let d = self.dict.as_ref()?;
        d.lookup(digest, blocks)
            .filter(|&(b, _)| (b as usize) < self.dict_limit)
    }

    /// Stores one chunk's bytes (unless all zero: `None`) and returns its device and start
    /// block: in this layer's blob (full chunks, and partial ones without a tails blob), its
    /// tails blob (partial chunks), or a dictionary blob that holds it already.
    fn store(&mut self, data: &[u8]) -> Result<Option<(u16, u32)>> {
        if data.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        let blocks = (data.len() as u64).div_ceil(BLOCK_SIZE);
        let mut h = blake3::Hasher::new();
        h.update(data);
        let pad = (blocks * BLOCK_SIZE) as usize - data.len();
        h.update(&[0u8; BLOCK_SIZE as usize][..pad]);
        let key = (blocks, *h.finalize().as_bytes());
        if let Some(&at) = self.stored.get(&key) {
            return Ok(Some(at));
        }
        if blocks == CHUNK_BLOCKS {
            if let Some((b, j)) = self.dict_lookup(&key.1, CHUNK_BLOCKS) {
                let device = self.device_for(b);
                self.dict_chunks += 1;
                return Ok(Some((device, j << CHUNK_BLKBITS)));
            }
        }
        let (device, placer) = match &mut self.tails {
            Some(t) if blocks < CHUNK_BLOCKS => (TAILS_DEVICE_ID, t),
            _ => (BLOB_DEVICE_ID, &mut self.main),
        };
        let start = placer.place(blocks);
        let blk = u32::try_from(start)
            .ok()
            .filter(|&b| b != NULL_ADDR && start + blocks <= u64::from(u32::MAX))
            .ok_or_else(|| Error::TooLarge("blob of 2^32 blocks or more".into()))?;
        // Only the packing blob's chunks are remapped (without a tails blob, the blob's).
        if self.tails.is_none() || device == TAILS_DEVICE_ID {
            if let Some(at) = self.remapped(start, blocks, data)? {
                self.stored.insert(key, at);
                self.dict_chunks += 1;
                return Ok(Some(at));
            }
        }
        let (placer, count) = match &mut self.tails {
            Some(t) if device == TAILS_DEVICE_ID => (&*t, &mut self.tails_count),
            _ => (&self.main, &mut self.main_count),
        };
        placer.write(data, start)?;
        count.unique += 1;
        count.stored_blocks += blocks;
        self.stored.insert(key, (device, blk));
        Ok(Some((device, blk)))
    }

    /// The device id of dictionary blob `b` in this layer (given at its first use).
    fn device_for(&mut self, b: u32) -> u16 {
        match self.device_of.get(&b) {
            Some(&d) => d,
            None => {
                let d = self.first_dict_device() + self.used.len() as u16;
                self.used.push(b as usize);
                self.device_of.insert(b, d);
                d
            }
        }
    }

    /// In a second pass: where a tail placed at `start` (`blocks` blocks) is found in a
    /// dictionary blob (the first pass's packing-blob chunks holding it are, in order,
    /// consecutive chunks of one dictionary blob, see [`Self::span_in_dict`], and held exactly
    /// these bytes there); `None` to write it.
    fn remapped(&mut self, start: u64, blocks: u64, data: &[u8]) -> Result<Option<(u16, u32)>> {
        let Some(r) = &self.remap else {
            return Ok(None);
        };
        let cb = r.chunk_blocks;
        let (c, last) = (start / cb, (start + blocks - 1) / cb);
        if last != c && !r.spans {
            return Ok(None);
        }
        let Some((b, j)) = self.span_in_dict(r, c, last) else {
            return Ok(None);
        };
        let mut was = vec![0u8; data.len()];
        r.pass1
            .read_exact_at(&mut was, start * BLOCK_SIZE)
            .map_err(io_err(format!(
                "read the first pass's blob of {}",
                self.packer().path.display()
            )))?;
        if was != data {
            return Ok(None);
        }
        let Ok(blk) = u32::try_from(j * cb + (start - c * cb)) else {
            return Ok(None);
        };
        let device = self.device_for(b);
        Ok(Some((device, blk)))
    }

    /// The dictionary blob and chunk `(b, j)` such that the first pass's packing-blob chunks
    /// `c..=last` are its chunks `j..=j + (last - c)`. One chunk: the dictionary's hit for it.
    /// Several (tails blobs only): each of them anchors a candidate, which every chunk's
    /// digest must confirm (a digest held at several places of a blob names only one).
    fn span_in_dict(&self, r: &Remap, c: u64, last: u64) -> Option<(u32, u64)> {
        if last == c {
            return r.chunks.get(&c).map(|&(b, j)| (b, u64::from(j)));
        }
        let dict = self.dict.as_ref()?;
        (c..=last).find_map(|a| {
            let &(b, ja) = r.chunks.get(&a)?;
            let j = u64::from(ja).checked_sub(a - c)?;
            (c..=last)
                .all(|k| {
                    let mine = usize::try_from(k).ok().and_then(|k| r.digests.get(k));
                    mine.is_some() && dict.chunk_digest(b, j + (k - c)) == mine
                })
                .then_some((b, j))
        })
    }

    /// The writer reaches the files of another directory, whose partial chunks take
    /// `tail_blocks` blocks: the packing blob's placer may reserve a run for them.
    pub(crate) fn begin_dir(&mut self, tail_blocks: u64) {
        self.tails
            .as_mut()
            .unwrap_or(&mut self.main)
            .begin_dir(tail_blocks);
    }

    /// Completes the blobs (length, fsync, digest) and returns the device table: the blob's
    /// slot, the tails blob's, then the dictionary blobs pointed into; `meta_blocks` is the
    /// meta image's size (the blob's place in the flat address space, the others' after it).
    pub(crate) fn finish(&mut self, meta_blocks: u32) -> Result<Vec<DeviceSlot>> {
        // With a tails blob, the main blob is never empty either (one zero block when every
        // chunk is a tail or in the dictionary): a node pins, warms and serves every device
        // alike, and a layer of small files only is still read without the daemon when warm.
        self.digest = self
            .main
            .finish(u64::from(self.tails.is_some()), self.fsync)?;
        let tag = self
            .tag
            .clone()
            .unwrap_or_else(|| hex(&self.digest).into_bytes());
        let too_large = || Error::TooLarge("blob of 2^32 blocks or more".into());
        let blocks = u32::try_from(self.main.blocks).map_err(|_| too_large())?;
        let mut slots = vec![device_slot(&tag, blocks, meta_blocks)];
        // Where each device would start if appended to the meta image (flat addressing).
        let mut next = u64::from(meta_blocks) + self.main.blocks;
        let mapped = |next: u64| {
            u32::try_from(next)
                .map_err(|_| Error::TooLarge("devices of 2^32 blocks or more".into()))
        };
        if let Some(t) = &mut self.tails {
            // Never empty: one zero block if no tail was written (a valid device).
            self.tails_digest = t.finish(1, self.fsync)?;
            let blocks = u32::try_from(t.blocks).map_err(|_| too_large())?;
            let tag = hex(&self.tails_digest);
            slots.push(device_slot(tag.as_bytes(), blocks, mapped(next)?));
            next += t.blocks;
        }
        if let Some(dict) = &self.dict {
            for &b in &self.used {
                let d = &dict.blobs[b];
                slots.push(device_slot(&d.tag, d.blocks as u32, mapped(next)?));
                next += d.blocks;
            }
        }
        Ok(slots)
    }
}

/// A device table slot: `tag` (at most 64 bytes), `blocks`, and where the device starts in
/// the flat block address space.
fn device_slot(tag: &[u8], blocks: u32, mapped_blkaddr: u32) -> DeviceSlot {
    let mut slot = DeviceSlot::default();
    slot.tag[..tag.len()].copy_from_slice(tag);
    slot.blocks_lo = blocks.into();
    slot.mapped_blkaddr_lo = mapped_blkaddr.into();
    slot
}
