//! Sealed layers: parsing (with every check of `docs/format.md`) and writing.
//!
//! Byte layout (normative text in `docs/format.md`): data region, then `extent_count` 24-byte
//! [`RawExtent`]s sorted by device offset, then the 128-byte [`RawTrailer`] at the very end.

use std::fmt;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fs_cache::AtomicFile;
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::{Error, Result};
use crate::extmap::{Seg, Target};
use crate::source::LayerSource;

/// Device offsets, lengths and sizes are multiples of this.
pub const SECTOR: u64 = 512;
/// The largest extent (index entry or log record).
pub const MAX_EXTENT_LEN: u64 = 1 << 30;
/// The largest device.
pub const MAX_DEVICE_SIZE: u64 = 1 << 60;
/// Magic at the start of a sealed layer's trailer.
pub const LAYER_MAGIC: [u8; 8] = *b"STRBDLYR";
/// The sealed-layer format version this code writes and reads.
pub const LAYER_VERSION: u32 = 1;
/// Trailer flag reserved for per-chunk zstd compression (not implemented; refused).
pub const FLAG_ZSTD_CHUNKS: u32 = 1;
/// Index entry flag: the extent reads as zeros.
pub const EXTENT_ZERO: u32 = 1;
/// Domain separation prefix of the layer id hash.
const ID_DOMAIN: &[u8] = b"strata-bd-layer-v1";
/// Written data is checked for all-zero pieces of this size when sealing.
const ZERO_PIECE: u64 = 1 << 20;

/// One index entry, as stored.
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RawExtent {
    pub device_offset: U64,
    pub file_offset: U64,
    pub length: U32,
    pub flags: U32,
}
/// Size of an index entry.
pub const EXTENT_SIZE: usize = 24;
const _: () = assert!(std::mem::size_of::<RawExtent>() == EXTENT_SIZE);

/// The trailer, as stored (the last 128 bytes of a sealed layer).
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RawTrailer {
    pub magic: [u8; 8],
    pub version: U32,
    pub flags: U32,
    pub index_offset: U64,
    pub extent_count: U64,
    pub device_size: U64,
    pub layer_id: [u8; 32],
    pub parent_id: [u8; 32],
    pub reserved: [u8; 20],
    pub checksum: U32,
}
/// Size of the trailer.
pub const TRAILER_SIZE: usize = 128;
const _: () = assert!(std::mem::size_of::<RawTrailer>() == TRAILER_SIZE);

/// A layer's id (see `docs/format.md`): a chained blake3 over the parent's id and the
/// layer's content. All zeros means "no layer" (the parent of a base layer).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct LayerId(pub [u8; 32]);

impl LayerId {
    /// The id of "no layer": the parent of a base layer, the parent of an upper on nothing.
    pub const NONE: LayerId = LayerId([0; 32]);

    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for LayerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_none() {
            f.write_str("(none)")
        } else {
            f.write_str(&self.to_hex())
        }
    }
}

impl fmt::Debug for LayerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LayerId({self})")
    }
}

/// One extent of a sealed layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub device_offset: u64,
    pub length: u64,
    /// Where the bytes are in the layer file; `None`: a zero extent.
    pub file_offset: Option<u64>,
}

impl Extent {
    pub fn device_end(&self) -> u64 {
        self.device_offset + self.length
    }
}

/// A parsed, checked sealed layer over its source.
#[derive(Debug, Clone)]
pub struct SealedLayer {
    source: Arc<dyn LayerSource>,
    extents: Vec<Extent>,
    id: LayerId,
    parent: LayerId,
    device_size: u64,
    index_offset: u64,
}

impl SealedLayer {
    /// Read and check the trailer and index of `source` (no data is read). Any violation of
    /// `docs/format.md` is [`Error::Corrupt`] (or [`Error::Unsupported`] for a newer version or
    /// unknown flags); at most the source's own length is allocated.
    pub fn open(source: Arc<dyn LayerSource>) -> Result<Self> {
        let what = source.describe();
        let bad = |reason: String| Error::corrupt(format!("layer {what}"), reason);
        let size = source.size();
        if size < TRAILER_SIZE as u64 {
            return Err(bad(format!(
                "{size} bytes is shorter than the {TRAILER_SIZE}-byte trailer"
            )));
        }
        let mut tb = [0u8; TRAILER_SIZE];
        source.read_exact_at(&mut tb, size - TRAILER_SIZE as u64)?;
        let t = RawTrailer::read_from_bytes(&tb[..])
            .map_err(|_| bad("trailer does not parse".into()))?;
        if t.magic != LAYER_MAGIC {
            return Err(bad("bad magic: not a strata block layer".into()));
        }
        if t.version.get() != LAYER_VERSION {
            return Err(Error::Unsupported {
                what: format!("layer {what}"),
                reason: format!(
                    "format version {} (this code reads {LAYER_VERSION})",
                    t.version.get()
                ),
            });
        }
        if t.flags.get() != 0 {
            return Err(Error::Unsupported {
                what: format!("layer {what}"),
                reason: format!(
                    "flags {:#x} (per-chunk compression is reserved, not implemented)",
                    t.flags.get()
                ),
            });
        }
        if t.reserved != [0; 20] {
            return Err(bad("reserved trailer bytes are not zero".into()));
        }
        let index_offset = t.index_offset.get();
        let count = t.extent_count.get();
        let device_size = t.device_size.get();
        let index_len = count
            .checked_mul(EXTENT_SIZE as u64)
            .ok_or_else(|| bad(format!("extent count {count} overflows")))?;
        let expect = index_offset
            .checked_add(index_len)
            .and_then(|v| v.checked_add(TRAILER_SIZE as u64));
        if expect != Some(size) {
            return Err(bad(format!(
                "trailer places an index of {count} extents at {index_offset}, which does not end at the trailer of a {size}-byte file"
            )));
        }
        if index_offset % SECTOR != 0 {
            return Err(bad(format!(
                "index offset {index_offset} is not sector-aligned"
            )));
        }
        if device_size % SECTOR != 0 || device_size > MAX_DEVICE_SIZE {
            return Err(bad(format!(
                "device size {device_size} is not sector-aligned or too large"
            )));
        }
        // index_len < size, so this allocation is bounded by the file's own length.
        let mut index = vec![0u8; index_len as usize];
        source.read_exact_at(&mut index, index_offset)?;
        let mut crc = crc32c::crc32c(&index);
        crc = crc32c::crc32c_append(crc, &tb[..TRAILER_SIZE - 4]);
        if crc != t.checksum.get() {
            return Err(bad(format!(
                "checksum mismatch: stored {:#010x}, computed {crc:#010x}",
                t.checksum.get()
            )));
        }
        let mut extents = Vec::with_capacity(count as usize);
        let mut prev_end = 0u64;
        for (i, raw) in index.chunks_exact(EXTENT_SIZE).enumerate() {
            let e = RawExtent::read_from_bytes(raw)
                .map_err(|_| bad(format!("extent {i} does not parse")))?;
            let (dev, foff, len, flags) = (
                e.device_offset.get(),
                e.file_offset.get(),
                e.length.get() as u64,
                e.flags.get(),
            );
            let ebad = |r: &str| bad(format!("extent {i} ({dev}+{len} at {foff}): {r}"));
            if flags & !EXTENT_ZERO != 0 {
                return Err(ebad("unknown flags"));
            }
            if len == 0 || len > MAX_EXTENT_LEN || len % SECTOR != 0 {
                return Err(ebad("bad length"));
            }
            if dev % SECTOR != 0 || foff % SECTOR != 0 {
                return Err(ebad("not sector-aligned"));
            }
            if dev < prev_end {
                return Err(ebad("unsorted or overlapping the previous extent"));
            }
            let end = dev
                .checked_add(len)
                .filter(|&e| e <= device_size)
                .ok_or_else(|| ebad("past the end of the device"))?;
            prev_end = end;
            let file_offset = if flags & EXTENT_ZERO != 0 {
                if foff != 0 {
                    return Err(ebad("zero extent with a file offset"));
                }
                None
            } else {
                match foff.checked_add(len) {
                    Some(fe) if fe <= index_offset => Some(foff),
                    _ => return Err(ebad("data outside the data region")),
                }
            };
            extents.push(Extent {
                device_offset: dev,
                length: len,
                file_offset,
            });
        }
        Ok(Self {
            source,
            extents,
            id: LayerId(t.layer_id),
            parent: LayerId(t.parent_id),
            device_size,
            index_offset,
        })
    }

    pub fn id(&self) -> LayerId {
        self.id
    }

    pub fn parent_id(&self) -> LayerId {
        self.parent
    }

    pub fn device_size(&self) -> u64 {
        self.device_size
    }

    /// The extents, sorted by device offset, non-overlapping.
    pub fn extents(&self) -> &[Extent] {
        &self.extents
    }

    pub fn source(&self) -> &Arc<dyn LayerSource> {
        &self.source
    }

    /// Bytes of the data region.
    pub fn data_len(&self) -> u64 {
        self.index_offset
    }

    /// Read this layer alone as a device (unmapped ranges and zero extents read zeros).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.device_size)
            .ok_or(Error::OutOfRange {
                offset,
                len: buf.len() as u64,
                size: self.device_size,
            })?;
        buf.fill(0);
        let first = self.extents.partition_point(|e| e.device_end() <= offset);
        for e in &self.extents[first..] {
            if e.device_offset >= end {
                break;
            }
            if let Some(foff) = e.file_offset {
                let s = e.device_offset.max(offset);
                let t = e.device_end().min(end);
                let dst = &mut buf[(s - offset) as usize..(t - offset) as usize];
                self.source
                    .read_exact_at(dst, foff + (s - e.device_offset))?;
            }
        }
        Ok(())
    }

    /// Recompute the layer id from the whole file (reads every byte) and compare.
    pub fn verify_id(&self) -> Result<()> {
        let mut h = id_hasher(self.parent, self.device_size);
        let mut buf = vec![0u8; 1 << 20];
        let total = self.source.size() - TRAILER_SIZE as u64;
        let mut pos = 0;
        while pos < total {
            let n = (total - pos).min(buf.len() as u64) as usize;
            self.source.read_exact_at(&mut buf[..n], pos)?;
            h.update(&buf[..n]);
            pos += n as u64;
        }
        let got = LayerId(*h.finalize().as_bytes());
        if got != self.id {
            return Err(Error::corrupt(
                format!("layer {}", self.source.describe()),
                format!("layer id is {}, but its content hashes to {got}", self.id),
            ));
        }
        Ok(())
    }
}

fn id_hasher(parent: LayerId, device_size: u64) -> blake3::Hasher {
    let mut h = blake3::Hasher::new();
    h.update(ID_DOMAIN);
    h.update(&parent.0);
    h.update(&device_size.to_le_bytes());
    h
}

/// What sealing wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedInfo {
    pub path: PathBuf,
    pub id: LayerId,
    pub parent: LayerId,
    pub device_size: u64,
    /// Length of the file.
    pub file_size: u64,
    /// Bytes of the data region.
    pub data_bytes: u64,
    pub extent_count: u64,
}

/// Write a sealed layer at `out` (replaced atomically: a temporary file, fsynced, renamed,
/// [`fs_cache::AtomicFile`]; on error the temporary file is removed) from the segments `segs`
/// (sorted, non-overlapping, inside `device_size`); the bytes of a data segment come from
/// `read(offset, buf)` at the segment's data offset.
pub(crate) fn write_layer(
    out: &Path,
    parent: LayerId,
    device_size: u64,
    segs: &[Seg],
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<SealedInfo> {
    let mut tmp = AtomicFile::create(out).map_err(|e| Error::io("create", out, e))?;
    // On an error the temporary file goes with `tmp`.
    let info = write_layer_to(&mut tmp, parent, device_size, segs, &mut read)?;
    tmp.commit()
        .map_err(|e| Error::io("fsync and rename", out, e))?;
    Ok(info)
}

/// The layer's bytes into `out`'s temporary file (not yet fsynced: the commit does it).
fn write_layer_to(
    out: &mut AtomicFile,
    parent: LayerId,
    device_size: u64,
    segs: &[Seg],
    read: &mut dyn FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<SealedInfo> {
    let (path, tmp_path) = (out.path().to_owned(), out.temp_path().to_owned());
    let tmp = tmp_path.as_path();
    let mut w = BufWriter::with_capacity(1 << 20, out.file_mut());
    let mut h = id_hasher(parent, device_size);
    let mut extents: Vec<RawExtent> = Vec::new();
    let mut file_pos = 0u64;
    let keep_zero = !parent.is_none();
    // Append an extent, joining it to the previous one where it continues it.
    let push = |extents: &mut Vec<RawExtent>, dev: u64, len: u64, foff: Option<u64>| {
        if let Some(last) = extents.last_mut() {
            let (ld, ll) = (last.device_offset.get(), last.length.get() as u64);
            let last_zero = last.flags.get() & EXTENT_ZERO != 0;
            let cont = ld + ll == dev
                && ll + len <= MAX_EXTENT_LEN
                && match foff {
                    None => last_zero,
                    Some(f) => !last_zero && last.file_offset.get() + ll == f,
                };
            if cont {
                last.length = U32::new((ll + len) as u32);
                return;
            }
        }
        extents.push(RawExtent {
            device_offset: U64::new(dev),
            file_offset: U64::new(foff.unwrap_or(0)),
            length: U32::new(len as u32),
            flags: U32::new(if foff.is_none() { EXTENT_ZERO } else { 0 }),
        });
    };
    let mut buf = vec![0u8; ZERO_PIECE as usize];
    for s in segs {
        match s.target {
            Target::Zero => {
                if keep_zero {
                    let mut off = 0;
                    while off < s.len {
                        let n = (s.len - off).min(MAX_EXTENT_LEN);
                        push(&mut extents, s.start + off, n, None);
                        off += n;
                    }
                }
            }
            Target::Data { offset, .. } => {
                let mut off = 0;
                while off < s.len {
                    let n = (s.len - off).min(ZERO_PIECE);
                    let piece = &mut buf[..n as usize];
                    read(offset + off, piece)?;
                    if piece.iter().all(|&b| b == 0) {
                        if keep_zero {
                            push(&mut extents, s.start + off, n, None);
                        }
                    } else {
                        w.write_all(piece).map_err(|e| Error::io("write", tmp, e))?;
                        h.update(piece);
                        push(&mut extents, s.start + off, n, Some(file_pos));
                        file_pos += n;
                    }
                    off += n;
                }
            }
        }
    }
    let index_offset = file_pos;
    let index: Vec<u8> = extents
        .iter()
        .flat_map(|e| e.as_bytes().iter().copied())
        .collect();
    h.update(&index);
    let id = LayerId(*h.finalize().as_bytes());
    let mut t = RawTrailer {
        magic: LAYER_MAGIC,
        version: U32::new(LAYER_VERSION),
        flags: U32::new(0),
        index_offset: U64::new(index_offset),
        extent_count: U64::new(extents.len() as u64),
        device_size: U64::new(device_size),
        layer_id: id.0,
        parent_id: parent.0,
        reserved: [0; 20],
        checksum: U32::new(0),
    };
    let crc = crc32c::crc32c_append(crc32c::crc32c(&index), &t.as_bytes()[..TRAILER_SIZE - 4]);
    t.checksum = U32::new(crc);
    w.write_all(&index)
        .map_err(|e| Error::io("write", tmp, e))?;
    w.write_all(t.as_bytes())
        .map_err(|e| Error::io("write", tmp, e))?;
    w.into_inner()
        .map_err(|e| Error::io("write", tmp, e.into_error()))?;
    Ok(SealedInfo {
        path,
        id,
        parent,
        device_size,
        file_size: index_offset + index.len() as u64 + TRAILER_SIZE as u64,
        data_bytes: index_offset,
        extent_count: extents.len() as u64,
    })
}
