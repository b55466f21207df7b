//! Lazy layers: a **meta image** (superblock, device table, inodes, xattrs, directories,
//! symlinks; no regular file data) plus one **data blob** holding the data of every regular
//! file, addressed chunk by chunk (`docs/format.md`, "Layers").
//!
//! Every non-empty regular file is a chunk-based inode (256 KiB chunks, 8-byte chunk indexes
//! on device 1 = the blob). In the blob:
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
//! File data is streamed through one 256 KiB buffer. The blob's blake3 digest is computed
//! after it is complete (a second, sequential read) and becomes the device tag (unless the
//! caller supplies one), patched into the meta image before its checksum is taken.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use zerocopy::IntoBytes;

use crate::ondisk::{ChunkIndex, DeviceSlot, BLOCK_SIZE, CHUNK_FORMAT_INDEXES, NULL_ADDR};
use crate::source::ProgressGuard;
use crate::writer::{build, tmp_path, write_nonzero, DataFile};
use crate::{io_err, BuildOptions, BuildStats, Error, Result, Source};

/// log2 of the chunk size in blocks (256 KiB / 4 KiB = 2^6).
pub const CHUNK_BLKBITS: u16 = 6;
/// Chunk size of chunk-based files in layers: 256 KiB, the cache chunk.
pub const CHUNK_SIZE: u64 = BLOCK_SIZE << CHUNK_BLKBITS;
const CHUNK_BLOCKS: u64 = 1 << CHUNK_BLKBITS;
/// `i_u.c.format` of our chunk-based inodes: 8-byte indexes, chunk = block << 6.
pub const CHUNK_FORMAT: u16 = CHUNK_FORMAT_INDEXES | CHUNK_BLKBITS;
/// The device id chunk indexes use for the blob.
pub const BLOB_DEVICE_ID: u16 = 1;

/// At most this many blobs besides its own a layer's chunks point into (the device table's
/// extra slots reserved when a dictionary is given).
pub const MAX_DICT_DEVICES: usize = 31;

/// At most this many chunks a [`ChunkDictionary`] holds (about 64 MiB of memory; 256 GiB of
/// chunks).
pub const MAX_DICT_CHUNKS: usize = 1 << 20;

/// The chunks of stored blobs a build may point into instead of storing them again: per
/// blob its device tag and size, and each full 256 KiB chunk's blake3. Bounded: at most
/// [`MAX_DICT_DEVICES`] blobs and [`MAX_DICT_CHUNKS`] chunks; a chunk held twice keeps its
/// first blob.
#[derive(Debug, Default, Clone)]
pub struct ChunkDictionary {
    blobs: Vec<DictBlob>,
    chunks: HashMap<[u8; 32], (u32, u32)>,
}

#[derive(Debug, Clone)]
struct DictBlob {
    tag: Vec<u8>,
    blocks: u64,
}

impl ChunkDictionary {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a blob of `size` bytes (a multiple of 4 KiB: a layer's data blob), tagged `tag`
    /// (what the device table names it by: Strata's blob digest in hex), whose chunks have
    /// the blake3 digests `digests` (one per 256 KiB chunk, the last possibly shorter). Its
    /// index among the added blobs, or `None` if the dictionary is full or the blob is not a
    /// layer blob (size not whole blocks, too large, a tag over 64 bytes, digests that do not
    /// match the size).
    pub fn add_blob(&mut self, tag: &[u8], size: u64, digests: &[[u8; 32]]) -> Option<usize> {
        let blocks = size / BLOCK_SIZE;
        if self.blobs.len() >= MAX_DICT_DEVICES
            || tag.len() > 64
            || size % BLOCK_SIZE != 0
            || blocks > u64::from(u32::MAX)
            || digests.len() as u64 != size.div_ceil(CHUNK_SIZE)
        {
            return None;
        }
        let b = self.blobs.len() as u32;
        let zero = zero_chunk_digest();
        for (j, d) in digests
            .iter()
            .enumerate()
            .take((size / CHUNK_SIZE) as usize)
        {
            if self.chunks.len() >= MAX_DICT_CHUNKS {
                break;
            }
            if *d != zero {
                self.chunks.entry(*d).or_insert((b, j as u32));
            }
        }
        self.blobs.push(DictBlob {
            tag: tag.to_vec(),
            blocks,
        });
        Some(b as usize)
    }

    /// Blobs added.
    pub fn blobs(&self) -> usize {
        self.blobs.len()
    }

    /// Distinct chunks held.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    fn lookup(&self, digest: &[u8; 32]) -> Option<(u32, u32)> {
        self.chunks.get(digest).copied()
    }
}

/// blake3 of 256 KiB of zeros (such chunks are holes, never looked up).
fn zero_chunk_digest() -> [u8; 32] {
    static ZERO: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    *ZERO.get_or_init(|| *blake3::hash(&vec![0u8; CHUNK_SIZE as usize]).as_bytes())
}

/// A directory whose files' partial chunks take at least this many blocks (128 KiB) gets a
/// run of its own (see the module docs).
pub const TAIL_RUN_MIN_BLOCKS: u64 = 32;

/// The blocks a file of `size` bytes's partial chunk takes in the blob (0: none).
pub(crate) fn tail_blocks(size: u64) -> u64 {
    (size % CHUNK_SIZE).div_ceil(BLOCK_SIZE)
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
    /// layer's data is all in its own blob).
    pub dictionary: Option<std::sync::Arc<ChunkDictionary>>,
    /// Regular files (paths relative to the source's root, `a/b/c`) whose data is laid out
    /// before everything else, in this order, their partial chunks packed together: a
    /// recorded access trace's order (`strata layer build --order-from`), so that what the
    /// trace read together is stored, and fetched, together. Paths that are not regular files
    /// with data in the source are ignored.
    pub first: Vec<std::path::PathBuf>,
}

/// What [`build_layer`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LayerStats {
    /// Counts for the tree; `image_bytes` is the meta image's size.
    pub meta: BuildStats,
    /// Bytes in the blob file (a multiple of 4096).
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
    /// The dictionary's blobs the meta image points into, in device order (device id 2 is
    /// `devices[0]`): indexes of [`ChunkDictionary::add_blob`]. Empty without a dictionary.
    pub devices: Vec<usize>,
    /// Chunk indexes that point into a dictionary's blob (not stored in this blob).
    pub dict_chunks: u64,
}

impl LayerStats {
    /// The blob's blake3 digest in lowercase hex (the default device tag).
    pub fn blob_blake3_hex(&self) -> String {
        hex(&self.blob_blake3)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Builds a lazy layer from the tree at `src_dir`: the meta image at `meta_out` and the data
/// blob at `blob_out` (each replaced atomically by a rename: the meta image first, then the
/// blob; on error neither temporary file is left behind). The same as [`build_layer_from`]
/// with [`Source::Dir`].
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
    let again = match (&source, &opts.dictionary) {
        (Source::Dir(p), Some(_)) => Some(Source::Dir(p.clone())),
        (Source::OverlayUpper(p), Some(_)) => Some(Source::OverlayUpper(p.clone())),
        _ => None,
    };
    let blob_tmp = tmp_path(blob_out);
    let mut blob = match BlobWriter::create(&blob_tmp, opts) {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&blob_tmp);
            return Err(e);
        }
    };
    let mut meta = build(source, meta_out, &opts.build, Some(&mut blob));
    if let (Some(src), Ok(_)) = (again, &meta) {
        match second_pass(src, meta_out, &blob_tmp, opts, &blob) {
            Ok(Some((m, b))) => {
                meta = Ok(m);
                blob = b;
            }
            Ok(None) => {}
            Err(e) => meta = Err(e),
        }
    }
    let done = meta.and_then(|meta| {
        std::fs::rename(&blob_tmp, blob_out).map_err(io_err(format!(
            "rename {} to {}",
            blob_tmp.display(),
            blob_out.display()
        )))?;
        Ok(meta)
    });
    let meta = match done {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_file(&blob_tmp);
            return Err(e);
        }
    };
    Ok(LayerStats {
        meta,
        blob_bytes: blob.blocks * BLOCK_SIZE,
        blob_blake3: blob.digest,
        chunks: blob.chunks,
        unique_chunks: blob.unique_chunks,
        hole_chunks: blob.hole_chunks,
        stored_bytes: blob.stored_blocks * BLOCK_SIZE,
        devices: blob.used.clone(),
        dict_chunks: blob.dict_chunks,
    })
}

/// The second pass of a dictionary build (see the module docs): `None` if no chunk of the
/// first pass's blob at `blob_tmp` is in the dictionary; else the meta image rebuilt at
/// `meta_out` and the new blob's writer (its file at `blob_tmp`, the first pass's removed).
fn second_pass(
    source: Source,
    meta_out: &Path,
    blob_tmp: &Path,
    opts: &LayerOptions,
    first: &BlobWriter,
) -> Result<Option<(BuildStats, BlobWriter)>> {
    let Some(dict) = &opts.dictionary else {
        return Ok(None);
    };
    let ctx = || format!("read {}", blob_tmp.display());
    let mut remap = HashMap::new();
    let mut buf = vec![0u8; CHUNK_SIZE as usize];
    let full = first.blocks / CHUNK_BLOCKS;
    for c in 0..full {
        first
            .file
            .read_exact_at(&mut buf, c * CHUNK_SIZE)
            .map_err(io_err(ctx()))?;
        if let Some(hit) = dict.lookup(blake3::hash(&buf).as_bytes()) {
            remap.insert(c, hit);
        }
    }
    if remap.is_empty() {
        return Ok(None);
    }
    let pass1 = blob_tmp.with_extension("pass1");
    std::fs::rename(blob_tmp, &pass1).map_err(io_err(format!(
        "rename {} to {}",
        blob_tmp.display(),
        pass1.display()
    )))?;
    let result = (|| {
        let mut blob = BlobWriter::create(blob_tmp, opts)?;
        blob.remap = Some(Remap {
            chunks: remap,
            pass1: File::open(&pass1).map_err(io_err(format!("open {}", pass1.display())))?,
        });
        let meta = build(source, meta_out, &opts.build, Some(&mut blob))?;
        blob.remap = None;
        Ok((meta, blob))
    })();
    let _ = std::fs::remove_file(&pass1);
    result.map(Some)
}

/// The second pass's map: first-pass blob chunk → (dictionary blob, its chunk), and the
/// first pass's blob to check tails against.
#[derive(Debug)]
struct Remap {
    chunks: HashMap<u64, (u32, u32)>,
    pass1: File,
}

/// Writes the data blob: places, dedupes and writes chunks; emits chunk indexes.
#[derive(Debug)]
pub(crate) struct BlobWriter {
    file: File,
    path: PathBuf,
    tag: Option<Vec<u8>>,
    fsync: bool,
    /// Blob length in blocks so far (the end of the last placed chunk).
    blocks: u64,
    /// Alignment gaps `[start, end)` (blocks) left before full chunks, oldest first.
    gaps: Vec<(u64, u64)>,
    /// (blocks, blake3 of the block-padded chunk) → device and start block.
    stored: HashMap<(u64, [u8; 32]), (u16, u32)>,
    buf: Vec<u8>,
    digest: [u8; 32],
    chunks: u64,
    unique_chunks: u64,
    hole_chunks: u64,
    stored_blocks: u64,
    dict: Option<std::sync::Arc<ChunkDictionary>>,
    /// Dictionary blobs pointed into, in order of first use (device id = 2 + position).
    used: Vec<usize>,
    /// Dictionary blob → its device id here.
    device_of: HashMap<u32, u16>,
    dict_chunks: u64,
    /// In a second pass: the tails to point into dictionary chunks.
    remap: Option<Remap>,
    /// The current directory's run of partial chunks `[next, end)` (blocks), if it has one.
    run: Option<(u64, u64)>,
    /// [`LayerOptions::first`].
    pub(crate) first: Vec<PathBuf>,
}

impl BlobWriter {
    const MAX_GAPS: usize = 64;

    fn create(path: &Path, opts: &LayerOptions) -> Result<Self> {
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(path)
            .map_err(io_err(format!("create {}", path.display())))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            tag: opts.tag.clone(),
            fsync: opts.build.fsync,
            blocks: 0,
            gaps: Vec::new(),
            stored: HashMap::new(),
            buf: vec![0u8; CHUNK_SIZE as usize],
            digest: [0; 32],
            chunks: 0,
            unique_chunks: 0,
            hole_chunks: 0,
            stored_blocks: 0,
            dict: opts.dictionary.clone(),
            used: Vec::new(),
            device_of: HashMap::new(),
            dict_chunks: 0,
            remap: None,
            run: None,
            first: opts.first.clone(),
        })
    }

    /// Device table slots the meta image reserves: the blob's, and one per dictionary blob.
    pub(crate) fn device_slots(&self) -> usize {
        1 + self.dict.as_ref().map_or(0, |d| d.blobs())
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
    /// marker if it is all zeros, else its place in the blob.
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
                    self.chunks += 1;
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

    /// Stores one chunk's bytes (unless all zero: `None`) and returns its device and start
    /// block: in this blob, or in a dictionary blob that holds it already.
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
            if let Some((b, j)) = self.dict.as_ref().and_then(|d| d.lookup(&key.1)) {
                let device = self.device_for(b);
                self.dict_chunks += 1;
                return Ok(Some((device, j << CHUNK_BLKBITS)));
            }
        }
        let start = self.place(blocks);
        let blk = u32::try_from(start)
            .ok()
            .filter(|&b| b != NULL_ADDR && start + blocks <= u64::from(u32::MAX))
            .ok_or_else(|| Error::TooLarge("blob of 2^32 blocks or more".into()))?;
        if let Some(at) = self.remapped(start, blocks, data)? {
            self.stored.insert(key, at);
            self.dict_chunks += 1;
            return Ok(Some(at));
        }
        write_nonzero(&self.file, data, start * BLOCK_SIZE)
            .map_err(io_err(format!("write {}", self.path.display())))?;
        self.stored.insert(key, (BLOB_DEVICE_ID, blk));
        self.unique_chunks += 1;
        self.stored_blocks += blocks;
        Ok(Some((BLOB_DEVICE_ID, blk)))
    }

    /// The device id of dictionary blob `b` in this layer (given at its first use).
    fn device_for(&mut self, b: u32) -> u16 {
        match self.device_of.get(&b) {
            Some(&d) => d,
            None => {
                let d = BLOB_DEVICE_ID + 1 + self.used.len() as u16;
                self.used.push(b as usize);
                self.device_of.insert(b, d);
                d
            }
        }
    }

    /// In a second pass: where a tail placed at `start` (`blocks` blocks) is found in a
    /// dictionary chunk (the first pass's blob chunk holding it is one, and held exactly
    /// these bytes there); `None` to write it.
    fn remapped(&mut self, start: u64, blocks: u64, data: &[u8]) -> Result<Option<(u16, u32)>> {
        let Some(r) = &self.remap else {
            return Ok(None);
        };
        let c = start / CHUNK_BLOCKS;
        if (start + blocks).div_ceil(CHUNK_BLOCKS) != c + 1 {
            return Ok(None);
        }
        let Some(&(b, j)) = r.chunks.get(&c) else {
            return Ok(None);
        };
        let mut was = vec![0u8; data.len()];
        r.pass1
            .read_exact_at(&mut was, start * BLOCK_SIZE)
            .map_err(io_err(format!(
                "read the first pass's blob of {}",
                self.path.display()
            )))?;
        if was != data {
            return Ok(None);
        }
        let device = self.device_for(b);
        let blk = (j << CHUNK_BLKBITS) + (start - c * CHUNK_BLOCKS) as u32;
        Ok(Some((device, blk)))
    }

    /// The writer reaches the files of another directory, whose partial chunks take
    /// `tail_blocks` blocks: a run of whole chunks for them if that is enough
    /// ([`TAIL_RUN_MIN_BLOCKS`]); the previous run's rest becomes a gap.
    pub(crate) fn begin_dir(&mut self, tail_blocks: u64) {
        if let Some((next, end)) = self.run.take() {
            if end > next {
                self.add_gap(next, end);
            }
        }
        if tail_blocks >= TAIL_RUN_MIN_BLOCKS {
            let start = self.blocks.next_multiple_of(CHUNK_BLOCKS);
            if start > self.blocks {
                self.add_gap(self.blocks, start);
            }
            let end = start + tail_blocks.next_multiple_of(CHUNK_BLOCKS);
            self.blocks = end;
            self.run = Some((start, end));
        }
    }

    fn add_gap(&mut self, start: u64, end: u64) {
        if self.gaps.len() == Self::MAX_GAPS {
            self.gaps.remove(0);
        }
        self.gaps.push((start, end));
    }

    /// Chooses the start block of a new chunk of `blocks` blocks (see the module docs).
    fn place(&mut self, blocks: u64) -> u64 {
        if blocks < CHUNK_BLOCKS {
            if let Some((next, end)) = &mut self.run {
                if *end - *next >= blocks {
                    let start = *next;
                    *next += blocks;
                    return start;
                }
            }
        }
        if blocks == CHUNK_BLOCKS {
            let start = self.blocks.next_multiple_of(CHUNK_BLOCKS);
            if start > self.blocks {
                if self.gaps.len() == Self::MAX_GAPS {
                    self.gaps.remove(0);
                }
                self.gaps.push((self.blocks, start));
            }
            self.blocks = start + blocks;
            return start;
        }
        if let Some(i) = self.gaps.iter().position(|&(s, e)| e - s >= blocks) {
            let start = self.gaps[i].0;
            self.gaps[i].0 += blocks;
            if self.gaps[i].0 == self.gaps[i].1 {
                self.gaps.remove(i);
            }
            return start;
        }
        let start = self.blocks;
        self.blocks += blocks;
        start
    }

    /// Completes the blob (length, fsync, digest) and returns the device table: the blob's
    /// slot, then the dictionary blobs pointed into; `meta_blocks` is the meta image's size
    /// (the blob's place in the flat address space, the others' after it).
    pub(crate) fn finish(&mut self, meta_blocks: u32) -> Result<Vec<DeviceSlot>> {
        let ctx = || format!("write {}", self.path.display());
        self.file
            .set_len(self.blocks * BLOCK_SIZE)
            .map_err(io_err(ctx()))?;
        if self.fsync {
            self.file.sync_all().map_err(io_err(ctx()))?;
        }
        // Read back in 1 MiB pieces (an mmap would count the whole blob as resident).
        let mut h = blake3::Hasher::new();
        let mut off = 0u64;
        let len = self.blocks * BLOCK_SIZE;
        let mut buf = vec![0u8; 1 << 20];
        while off < len {
            let n = (len - off).min(buf.len() as u64) as usize;
            self.file
                .read_exact_at(&mut buf[..n], off)
                .map_err(io_err(format!("hash {}", self.path.display())))?;
            h.update_rayon(&buf[..n]);
            off += n as u64;
        }
        self.digest = *h.finalize().as_bytes();
        let tag = self
            .tag
            .clone()
            .unwrap_or_else(|| hex(&self.digest).into_bytes());
        let mut slot = DeviceSlot::default();
        slot.tag[..tag.len()].copy_from_slice(&tag);
        slot.blocks_lo = u32::try_from(self.blocks)
            .map_err(|_| Error::TooLarge("blob of 2^32 blocks or more".into()))?
            .into();
        // Where the blob would start if appended to the meta image (flat addressing).
        slot.mapped_blkaddr_lo = meta_blocks.into();
        let mut slots = vec![slot];
        let mut next = u64::from(meta_blocks) + self.blocks;
        if let Some(dict) = &self.dict {
            for &b in &self.used {
                let d = &dict.blobs[b];
                let mut slot = DeviceSlot::default();
                slot.tag[..d.tag.len()].copy_from_slice(&d.tag);
                slot.blocks_lo = (d.blocks as u32).into();
                slot.mapped_blkaddr_lo = u32::try_from(next)
                    .map_err(|_| Error::TooLarge("devices of 2^32 blocks or more".into()))?
                    .into();
                next += d.blocks;
                slots.push(slot);
            }
        }
        Ok(slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_chunks_are_aligned_and_partial_ones_fill_gaps() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = BlobWriter::create(&dir.path().join("b"), &LayerOptions::default()).unwrap();
        assert_eq!(w.place(3), 0);
        assert_eq!(w.place(CHUNK_BLOCKS), CHUNK_BLOCKS);
        assert_eq!(w.gaps, vec![(3, CHUNK_BLOCKS)]);
        assert_eq!(w.place(60), 3);
        assert_eq!(w.place(2), 2 * CHUNK_BLOCKS);
        assert_eq!(w.place(1), 63);
        assert!(w.gaps.is_empty());
        assert_eq!(w.place(CHUNK_BLOCKS), 3 * CHUNK_BLOCKS);
        assert_eq!(w.gaps, vec![(2 * CHUNK_BLOCKS + 2, 3 * CHUNK_BLOCKS)]);
    }
}
