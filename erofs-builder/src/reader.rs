//! EROFS image reader: the test oracle for the writer, and a parser for `mkfs.erofs` images.
//!
//! Every offset read from the image is checked against the image length before use (checked
//! arithmetic, no slicing on unchecked values), and allocations are bounded by what the image
//! could hold: a malformed image yields [`Error::Corrupt`] or [`Error::Unsupported`], never a
//! panic or a huge allocation. [`fuzz_read_all`] walks everything and is the fuzz entry point.

use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use zerocopy::FromBytes;

use crate::ondisk::{
    self, decode_dev, xattr_align, ChunkIndex, DeviceSlot, Dirent, InodeCompact, InodeExtended,
    SuperBlock, XattrEntry, DATALAYOUT_CHUNK_BASED, DATALAYOUT_FLAT_INLINE, DATALAYOUT_FLAT_PLAIN,
    DEVT_SLOT_SIZE, EROFS_MAGIC, FEATURE_COMPAT_SB_CHKSUM, FEATURE_INCOMPAT_ZERO_PADDING,
    ISLOT_BITS, I_FORMAT_ALL, NAME_LEN, NULL_ADDR, SUPER_OFFSET, XATTR_PREFIXES,
};
use crate::{io_err, Error, Result};

fn corrupt(msg: impl Into<String>) -> Error {
    Error::Corrupt(msg.into())
}

#[derive(Debug)]
enum Source {
    File(File),
    Bytes(Vec<u8>),
}

impl Source {
    /// Reads `buf.len()` bytes at `off`, bounds-checked against `len`.
    fn read_at(&self, len: u64, off: u64, buf: &mut [u8], what: &str) -> Result<()> {
        let end = off
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= len)
            .ok_or_else(|| {
                corrupt(format!(
                    "read {}+{} beyond {what} end {len}",
                    off,
                    buf.len(),
                ))
            })?;
        match self {
            Source::File(f) => f
                .read_exact_at(buf, off)
                .map_err(io_err(format!("read {what}"))),
            Source::Bytes(b) => {
                // Both bounds checked above against len == b.len().
                let src = b
                    .get(off as usize..end as usize)
                    .ok_or_else(|| corrupt("range"))?;
                buf.copy_from_slice(src);
                Ok(())
            }
        }
    }
}

/// An entry of the device table (an extra device, e.g. a layer's data blob).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// The tag, up to its first NUL (at most 64 bytes).
    pub tag: Vec<u8>,
    /// Blocks in the device.
    pub blocks: u32,
    /// Start of the device in the flat block address space (used when no device is given).
    pub mapped_blkaddr: u32,
}

/// An opened EROFS image.
#[derive(Debug)]
pub struct Image {
    src: Source,
    len: u64,
    sb: SuperBlock,
    blkszbits: u8,
    meta_base: u64,
    xattr_base: u64,
    device_table: Vec<DeviceInfo>,
    /// Opened extra devices (empty: flat addressing through `mapped_blkaddr`).
    devices: Vec<(Source, u64)>,
    device_id_mask: u16,
}

/// The type of an inode, from its mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FileType {
    /// Regular file.
    Regular,
    /// Directory.
    Directory,
    /// Symbolic link.
    Symlink,
    /// Character device.
    CharDevice,
    /// Block device.
    BlockDevice,
    /// Fifo.
    Fifo,
    /// Socket.
    Socket,
}

impl FileType {
    fn from_mode(mode: u16) -> Option<Self> {
        Some(match u32::from(mode) & 0o170000 {
            0o100000 => Self::Regular,
            0o040000 => Self::Directory,
            0o120000 => Self::Symlink,
            0o020000 => Self::CharDevice,
            0o060000 => Self::BlockDevice,
            0o010000 => Self::Fifo,
            0o140000 => Self::Socket,
            _ => return None,
        })
    }
}

/// A parsed inode.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inode {
    /// Node number (byte offset in the metadata area / 32).
    pub nid: u64,
    /// Type.
    pub file_type: FileType,
    /// Full mode (type and permission bits).
    pub mode: u16,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Link count.
    pub nlink: u32,
    /// Size in bytes (data, directory data or symlink target).
    pub size: u64,
    /// Modification time, seconds.
    pub mtime: i64,
    /// Modification time, nanoseconds.
    pub mtime_nsec: u32,
    /// Device number (major, minor) for device inodes.
    pub rdev: (u32, u32),
    /// Whether the 64-byte extended form is used.
    pub extended: bool,
    /// Data layout (`ondisk::DATALAYOUT_*`).
    pub datalayout: u16,
    raw_blkaddr: u32,
    pos: u64,
    isize: u64,
    xattr_icount: u16,
}

/// Where one piece of a regular file's data lives (see [`Image::data_map`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Location {
    /// Not stored: reads as zeros (a hole chunk).
    Hole,
    /// In the image itself, at this byte offset.
    Image(u64),
    /// On extra device `device` (1 = the first entry of the device table: a layer's data
    /// blob), at this byte offset of that device.
    Device {
        /// Device id (1-based index into the device table).
        device: u16,
        /// Byte offset in the device.
        offset: u64,
    },
}

/// A run of a regular file's bytes `[file_offset, file_offset + len)` and where they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Extent {
    /// Offset in the file.
    pub file_offset: u64,
    /// Bytes in the run.
    pub len: u64,
    /// Where the run starts.
    pub location: Location,
}

/// A directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Name bytes (1..=255).
    pub name: Vec<u8>,
    /// Node number.
    pub nid: u64,
    /// File type byte (`ondisk::ft::*`).
    pub file_type: u8,
}

impl Image {
    /// Opens the image file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(io_err(format!("open {}", path.display())))?;
        let len = f
            .metadata()
            .map_err(io_err(format!("stat {}", path.display())))?
            .len();
        Self::from_source(Source::File(f), len)
    }

    /// Opens the image at `path` with its extra devices (device table order: `devices[0]` is
    /// device id 1). Their number must match the superblock's `extra_devices`, as the kernel
    /// requires. Without devices ([`Image::open`]) chunks on device k are read from the image
    /// itself at the device's `mapped_blkaddr` (flat addressing, e.g. meta image + blob
    /// concatenated).
    pub fn open_with_devices(path: &Path, devices: &[&Path]) -> Result<Self> {
        let mut img = Self::open(path)?;
        if devices.len() != img.device_table.len() {
            return Err(Error::Unsupported(format!(
                "image has {} extra devices, {} given",
                img.device_table.len(),
                devices.len()
            )));
        }
        for d in devices {
            let f = File::open(d).map_err(io_err(format!("open {}", d.display())))?;
            let len = f
                .metadata()
                .map_err(io_err(format!("stat {}", d.display())))?
                .len();
            img.devices.push((Source::File(f), len));
        }
        Ok(img)
    }

    /// Parses an image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let len = bytes.len() as u64;
        Self::from_source(Source::Bytes(bytes), len)
    }

    fn from_source(src: Source, len: u64) -> Result<Self> {
        let mut img = Image {
            src,
            len,
            sb: SuperBlock::default(),
            blkszbits: 12,
            meta_base: 0,
            xattr_base: 0,
            device_table: Vec::new(),
            devices: Vec::new(),
            device_id_mask: 0,
        };
        let raw = img.read_vec(SUPER_OFFSET, 128)?;
        let sb = SuperBlock::read_from_bytes(&raw).map_err(|_| corrupt("superblock"))?;
        if sb.magic.get() != EROFS_MAGIC {
            return Err(corrupt("bad magic"));
        }
        if !(9..=16).contains(&sb.blkszbits) {
            return Err(Error::Unsupported(format!("block size 2^{}", sb.blkszbits)));
        }
        let unknown = sb.feature_incompat.get()
            & !(FEATURE_INCOMPAT_ZERO_PADDING
                | ondisk::FEATURE_INCOMPAT_CHUNKED_FILE
                | ondisk::FEATURE_INCOMPAT_DEVICE_TABLE);
        if unknown != 0 {
            return Err(Error::Unsupported(format!(
                "incompat features {unknown:#x}"
            )));
        }
        if sb.dirblkbits != 0 {
            return Err(Error::Unsupported("dirblkbits != 0".into()));
        }
        img.blkszbits = sb.blkszbits;
        let bs = img.block_size();
        if sb.feature_compat.get() & FEATURE_COMPAT_SB_CHKSUM != 0 {
            if bs <= SUPER_OFFSET {
                return Err(Error::Unsupported(
                    "checksum with block size <= 1024".into(),
                ));
            }
            let mut block = img.read_vec(SUPER_OFFSET, bs - SUPER_OFFSET)?;
            block[4..8].fill(0);
            if ondisk::sb_crc32c(&block) != sb.checksum.get() {
                return Err(corrupt("superblock checksum mismatch"));
            }
        }
        img.meta_base = u64::from(sb.meta_blkaddr.get()) << img.blkszbits;
        img.xattr_base = u64::from(sb.xattr_blkaddr.get()) << img.blkszbits;
        let extra = sb.extra_devices.get();
        if extra > 0 {
            if sb.feature_incompat.get() & ondisk::FEATURE_INCOMPAT_DEVICE_TABLE == 0 {
                return Err(corrupt("extra devices without the DEVICE_TABLE feature"));
            }
            // Bounded: the table must lie inside the image.
            let start = u64::from(sb.devt_slotoff.get()) * DEVT_SLOT_SIZE;
            let table = img.read_vec(start, u64::from(extra) * DEVT_SLOT_SIZE)?;
            for raw in table.chunks_exact(DEVT_SLOT_SIZE as usize) {
                let d = DeviceSlot::read_from_bytes(raw).map_err(|_| corrupt("device slot"))?;
                if d.blocks_hi.get() != 0 {
                    return Err(Error::Unsupported("device of 2^32 blocks or more".into()));
                }
                let tag_len = d.tag.iter().position(|&b| b == 0).unwrap_or(d.tag.len());
                img.device_table.push(DeviceInfo {
                    tag: d.tag[..tag_len].to_vec(),
                    blocks: d.blocks_lo.get(),
                    mapped_blkaddr: d.mapped_blkaddr_lo.get(),
                });
            }
            // The kernel's roundup_pow_of_two(extra + 1) - 1.
            img.device_id_mask = ((u32::from(extra) + 1).next_power_of_two() - 1) as u16;
        }
        img.sb = sb;
        Ok(img)
    }

    /// The superblock.
    pub fn superblock(&self) -> &SuperBlock {
        &self.sb
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u64 {
        1u64 << self.blkszbits
    }

    /// The device table (empty for single-device images).
    pub fn device_table(&self) -> &[DeviceInfo] {
        &self.device_table
    }

    /// Image length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the image is empty (never true for an opened image).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        self.src.read_at(self.len, off, buf, "image")
    }

    /// Reads from device `dev` (0: the image) at byte `off` of that device.
    fn read_dev(&self, dev: u16, off: u64, buf: &mut [u8]) -> Result<()> {
        if dev == 0 {
            return self.read_at(off, buf);
        }
        let k = usize::from(dev - 1);
        if let Some((src, len)) = self.devices.get(k) {
            return src.read_at(*len, off, buf, &format!("device {dev}"));
        }
        let d = self
            .device_table
            .get(k)
            .ok_or_else(|| corrupt(format!("device id {dev} not in the device table")))?;
        // Flat addressing: the device's blocks follow at mapped_blkaddr in the image.
        let base = u64::from(d.mapped_blkaddr) << self.blkszbits;
        let off = base
            .checked_add(off)
            .ok_or_else(|| corrupt("device address overflow"))?;
        self.read_at(off, buf)
    }

    /// Reads from a chunk-based inode: `buf` at `offset`, within `ino.size` (checked by the
    /// caller); holes read as zeros.
    fn read_chunked(&self, ino: &Inode, offset: u64, buf: &mut [u8]) -> Result<()> {
        let format = (ino.raw_blkaddr & 0xffff) as u16;
        if format & !(ondisk::CHUNK_FORMAT_BLKBITS_MASK | ondisk::CHUNK_FORMAT_INDEXES) != 0 {
            return Err(Error::Unsupported(format!(
                "nid {}: chunk format {format:#x}",
                ino.nid
            )));
        }
        let chunkbits = u32::from(self.blkszbits) + u32::from(format & 0x1f);
        if chunkbits > 48 {
            return Err(corrupt(format!("nid {}: chunk bits {chunkbits}", ino.nid)));
        }
        let indexes = format & ondisk::CHUNK_FORMAT_INDEXES != 0;
        let unit = if indexes { 8 } else { 4 };
        let base = (ino.pos + ino.isize + self.xattr_size(ino)).next_multiple_of(unit);
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let chunknr = pos >> chunkbits;
            let in_chunk = pos - (chunknr << chunkbits);
            let n = ((1u64 << chunkbits) - in_chunk).min((buf.len() - done) as u64) as usize;
            let mut raw = [0u8; 8];
            let at = chunknr
                .checked_mul(unit)
                .and_then(|o| o.checked_add(base))
                .ok_or_else(|| corrupt("chunk index address overflow"))?;
            self.read_at(at, &mut raw[..unit as usize])?;
            let (dev, blk) = if indexes {
                let e = ChunkIndex::read_from_bytes(&raw).map_err(|_| corrupt("chunk index"))?;
                (e.device_id.get() & self.device_id_mask, e.startblk_lo.get())
            } else {
                (0, u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
            };
            let out = &mut buf[done..done + n];
            if blk == NULL_ADDR {
                out.fill(0);
            } else {
                let off = (u64::from(blk) << self.blkszbits) + in_chunk;
                self.read_dev(dev, off, out)?;
            }
            done += n;
        }
        Ok(())
    }

    fn read_vec(&self, off: u64, len: u64) -> Result<Vec<u8>> {
        // Bounded by the image length before allocating.
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(corrupt(format!(
                "read {off}+{len} beyond image end {}",
                self.len
            )));
        }
        let mut v = vec![0u8; len as usize];
        self.read_at(off, &mut v)?;
        Ok(v)
    }

    /// The root directory inode.
    pub fn root(&self) -> Result<Inode> {
        self.inode(u64::from(self.sb.root_nid.get()))
    }

    /// Reads the inode `nid`.
    pub fn inode(&self, nid: u64) -> Result<Inode> {
        let pos = nid
            .checked_mul(1 << ISLOT_BITS)
            .and_then(|o| o.checked_add(self.meta_base))
            .ok_or_else(|| corrupt(format!("nid {nid} out of range")))?;
        let mut raw = [0u8; 64];
        self.read_at(pos, &mut raw[..32])?;
        let c = InodeCompact::read_from_bytes(&raw[..32]).map_err(|_| corrupt("inode"))?;
        let i_format = c.i_format.get();
        if i_format & !I_FORMAT_ALL != 0 {
            return Err(corrupt(format!("nid {nid}: bad i_format {i_format:#x}")));
        }
        let extended = i_format & 1 != 0;
        let datalayout = (i_format >> 1) & 0x7;
        let mode = c.i_mode.get();
        let file_type = FileType::from_mode(mode)
            .ok_or_else(|| corrupt(format!("nid {nid}: bad mode {mode:o}")))?;
        let mut inode = Inode {
            nid,
            file_type,
            mode,
            uid: 0,
            gid: 0,
            nlink: 0,
            size: 0,
            mtime: self.sb.build_time.get() as i64,
            mtime_nsec: self.sb.build_time_nsec.get(),
            rdev: (0, 0),
            extended,
            datalayout,
            raw_blkaddr: 0,
            pos,
            isize: 32,
            xattr_icount: c.i_xattr_icount.get(),
        };
        let i_u = if extended {
            self.read_at(pos + 32, &mut raw[32..])?;
            let e = InodeExtended::read_from_bytes(&raw[..]).map_err(|_| corrupt("inode"))?;
            inode.isize = 64;
            inode.uid = e.i_uid.get();
            inode.gid = e.i_gid.get();
            inode.nlink = e.i_nlink.get();
            inode.size = e.i_size.get();
            inode.mtime = e.i_mtime.get() as i64;
            inode.mtime_nsec = e.i_mtime_nsec.get();
            e.i_u.get()
        } else {
            inode.uid = c.i_uid.get().into();
            inode.gid = c.i_gid.get().into();
            // 6.15+: bit 4 on a non-directory compact inode means nlink == 1.
            inode.nlink = if i_format & 0x10 != 0 && file_type != FileType::Directory {
                1
            } else {
                c.i_nlink.get().into()
            };
            inode.size = c.i_size.get().into();
            inode.mtime = inode.mtime.wrapping_add(i64::from(c.i_mtime.get()));
            c.i_u.get()
        };
        match file_type {
            FileType::CharDevice | FileType::BlockDevice => inode.rdev = decode_dev(i_u),
            FileType::Regular | FileType::Directory | FileType::Symlink => inode.raw_blkaddr = i_u,
            FileType::Fifo | FileType::Socket => {}
        }
        Ok(inode)
    }

    fn xattr_size(&self, ino: &Inode) -> u64 {
        ondisk::xattr_ibody_size(ino.xattr_icount)
    }

    /// Reads up to `buf.len()` bytes of `ino`'s data at `offset`; returns the count (0 at EOF).
    pub fn read_at_inode(&self, ino: &Inode, offset: u64, buf: &mut [u8]) -> Result<usize> {
        if offset >= ino.size || buf.is_empty() {
            return Ok(0);
        }
        let bs = self.block_size();
        let want = (ino.size - offset).min(buf.len() as u64);
        let buf = &mut buf[..want as usize];
        let blocks_bytes = match ino.datalayout {
            DATALAYOUT_CHUNK_BASED => {
                self.read_chunked(ino, offset, buf)?;
                return Ok(buf.len());
            }
            DATALAYOUT_FLAT_PLAIN => ino.size,
            DATALAYOUT_FLAT_INLINE => ino.size - ino.size % bs,
            other => {
                return Err(Error::Unsupported(format!(
                    "nid {}: data layout {other}",
                    ino.nid
                )))
            }
        };
        let base = u64::from(ino.raw_blkaddr) << self.blkszbits;
        let mut done = 0usize;
        if offset < blocks_bytes {
            let n = (blocks_bytes - offset).min(want) as usize;
            let off = base
                .checked_add(offset)
                .ok_or_else(|| corrupt("data address overflow"))?;
            self.read_at(off, &mut buf[..n])?;
            done = n;
        }
        if done < buf.len() {
            let tail_len = ino.size - blocks_bytes;
            let tail_pos = ino.pos + ino.isize + self.xattr_size(ino);
            if tail_pos % bs + tail_len > bs {
                return Err(corrupt(format!(
                    "nid {}: inline data crosses a block boundary",
                    ino.nid
                )));
            }
            let in_tail = offset + done as u64 - blocks_bytes;
            self.read_at(tail_pos + in_tail, &mut buf[done..])?;
            done = buf.len();
        }
        Ok(done)
    }

    /// Where `ino`'s data lives, in file order: runs in the image, on an extra device (a
    /// layer's blob: chunk `i` of a chunk-based file is at `startblk * block size` of its
    /// device), or holes. Adjacent chunks that are contiguous on one device are merged into
    /// one run, so a reader can fetch a file in a few ranged reads. Every index read is
    /// bounds-checked against the image; nothing is read from the devices.
    pub fn data_map(&self, ino: &Inode) -> Result<Vec<Extent>> {
        let mut out: Vec<Extent> = Vec::new();
        if ino.size == 0 {
            return Ok(out);
        }
        let bs = self.block_size();
        let base = u64::from(ino.raw_blkaddr) << self.blkszbits;
        match ino.datalayout {
            DATALAYOUT_FLAT_PLAIN => out.push(Extent {
                file_offset: 0,
                len: ino.size,
                location: Location::Image(base),
            }),
            DATALAYOUT_FLAT_INLINE => {
                let blocks = ino.size - ino.size % bs;
                if blocks > 0 {
                    out.push(Extent {
                        file_offset: 0,
                        len: blocks,
                        location: Location::Image(base),
                    });
                }
                let tail = ino.size - blocks;
                if tail > 0 {
                    let pos = ino.pos + ino.isize + self.xattr_size(ino);
                    if pos % bs + tail > bs {
                        return Err(corrupt(format!(
                            "nid {}: inline data crosses a block boundary",
                            ino.nid
                        )));
                    }
                    out.push(Extent {
                        file_offset: blocks,
                        len: tail,
                        location: Location::Image(pos),
                    });
                }
            }
            DATALAYOUT_CHUNK_BASED => self.chunk_map(ino, &mut out)?,
            other => {
                return Err(Error::Unsupported(format!(
                    "nid {}: data layout {other}",
                    ino.nid
                )))
            }
        }
        Ok(out)
    }

    fn chunk_map(&self, ino: &Inode, out: &mut Vec<Extent>) -> Result<()> {
        let format = (ino.raw_blkaddr & 0xffff) as u16;
        if format & !(ondisk::CHUNK_FORMAT_BLKBITS_MASK | ondisk::CHUNK_FORMAT_INDEXES) != 0 {
            return Err(Error::Unsupported(format!(
                "nid {}: chunk format {format:#x}",
                ino.nid
            )));
        }
        let chunkbits = u32::from(self.blkszbits) + u32::from(format & 0x1f);
        if chunkbits > 48 {
            return Err(corrupt(format!("nid {}: chunk bits {chunkbits}", ino.nid)));
        }
        let indexes = format & ondisk::CHUNK_FORMAT_INDEXES != 0;
        let unit: u64 = if indexes { 8 } else { 4 };
        let start = (ino.pos + ino.isize + self.xattr_size(ino)).next_multiple_of(unit);
        let chunk = 1u64 << chunkbits;
        let n = ino.size.div_ceil(chunk);
        // Bounded by the image length before allocating.
        let table = self.read_vec(
            start,
            n.checked_mul(unit)
                .ok_or_else(|| corrupt("chunk index overflow"))?,
        )?;
        for (i, raw) in table.chunks_exact(unit as usize).enumerate() {
            let file_offset = i as u64 * chunk;
            let len = (ino.size - file_offset).min(chunk);
            let (dev, blk) = if indexes {
                let e = ChunkIndex::read_from_bytes(raw).map_err(|_| corrupt("chunk index"))?;
                (e.device_id.get() & self.device_id_mask, e.startblk_lo.get())
            } else {
                (0, u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
            };
            let location = if blk == NULL_ADDR {
                Location::Hole
            } else if dev == 0 {
                Location::Image(u64::from(blk) << self.blkszbits)
            } else {
                if usize::from(dev) > self.device_table.len() {
                    return Err(corrupt(format!(
                        "nid {}: device id {dev} not in the device table",
                        ino.nid
                    )));
                }
                Location::Device {
                    device: dev,
                    offset: u64::from(blk) << self.blkszbits,
                }
            };
            if let Some(last) = out.last_mut() {
                let follows = match (last.location, location) {
                    (Location::Hole, Location::Hole) => true,
                    (Location::Image(a), Location::Image(b)) => a + last.len == b,
                    (
                        Location::Device {
                            device: d1,
                            offset: a,
                        },
                        Location::Device {
                            device: d2,
                            offset: b,
                        },
                    ) => d1 == d2 && a + last.len == b,
                    _ => false,
                };
                if follows && last.len % chunk == 0 {
                    last.len += len;
                    continue;
                }
            }
            out.push(Extent {
                file_offset,
                len,
                location,
            });
        }
        Ok(())
    }

    /// Streams all of `ino`'s data into `w`; returns the byte count.
    pub fn copy_data(&self, ino: &Inode, w: &mut impl Write) -> Result<u64> {
        let mut buf = vec![0u8; 1 << 16];
        let mut off = 0u64;
        while off < ino.size {
            let n = self.read_at_inode(ino, off, &mut buf)?;
            if n == 0 {
                break;
            }
            w.write_all(&buf[..n]).map_err(io_err("write data"))?;
            off += n as u64;
        }
        Ok(off)
    }

    /// Reads all of `ino`'s data (bounded by the length of the image and its devices; use
    /// [`Image::copy_data`] for large sparse files).
    pub fn read_data(&self, ino: &Inode) -> Result<Vec<u8>> {
        let limit = self.len + self.devices.iter().map(|d| d.1).sum::<u64>();
        if ino.size > limit {
            return Err(corrupt(format!(
                "nid {}: size {} exceeds the image",
                ino.nid, ino.size
            )));
        }
        let mut v = vec![0u8; ino.size as usize];
        let mut off = 0;
        while off < v.len() {
            let n = self.read_at_inode(ino, off as u64, &mut v[off..])?;
            if n == 0 {
                return Err(corrupt("short read"));
            }
            off += n;
        }
        Ok(v)
    }

    /// The target of a symlink inode.
    pub fn read_link(&self, ino: &Inode) -> Result<Vec<u8>> {
        if ino.file_type != FileType::Symlink {
            return Err(Error::WrongType(format!(
                "nid {} is not a symlink",
                ino.nid
            )));
        }
        if ino.size >= self.block_size() {
            return Err(corrupt(format!(
                "nid {}: symlink of {} bytes",
                ino.nid, ino.size
            )));
        }
        self.read_data(ino)
    }

    /// The entries of a directory, in on-disk order (sorted, `.` and `..` included).
    pub fn read_dir(&self, ino: &Inode) -> Result<Vec<DirEntry>> {
        if ino.file_type != FileType::Directory {
            return Err(Error::NotADirectory(format!("nid {}", ino.nid)));
        }
        if ino.size > self.len {
            return Err(corrupt(format!(
                "nid {}: directory size exceeds the image",
                ino.nid
            )));
        }
        let bs = self.block_size();
        let mut out = Vec::new();
        let mut block = vec![0u8; bs as usize];
        let mut off = 0u64;
        while off < ino.size {
            let max = (ino.size - off).min(bs) as usize;
            let blk = &mut block[..max];
            let n = self.read_at_inode(ino, off, blk)?;
            if n != max {
                return Err(corrupt("short directory read"));
            }
            parse_dir_block(blk, &mut out)
                .map_err(|e| corrupt(format!("nid {} at {off}: {e}", ino.nid)))?;
            off += max as u64;
        }
        Ok(out)
    }

    /// Looks `name` up in directory `dir`.
    pub fn lookup_in(&self, dir: &Inode, name: &[u8]) -> Result<Inode> {
        let entries = self.read_dir(dir)?;
        let e = entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| Error::NotFound(String::from_utf8_lossy(name).into_owned()))?;
        self.inode(e.nid)
    }

    /// Looks a path up from the root without following symlinks (`/` separated; empty and
    /// `.` components are skipped).
    pub fn lookup(&self, path: &str) -> Result<Inode> {
        self.lookup_bytes(path.as_bytes())
    }

    /// [`Image::lookup`] for a path given as bytes.
    pub fn lookup_bytes(&self, path: &[u8]) -> Result<Inode> {
        let mut cur = self.root()?;
        for comp in path
            .split(|&b| b == b'/')
            .filter(|c| !c.is_empty() && *c != b".")
        {
            if cur.file_type != FileType::Directory {
                return Err(Error::NotADirectory(
                    String::from_utf8_lossy(path).into_owned(),
                ));
            }
            cur = self.lookup_in(&cur, comp)?;
        }
        Ok(cur)
    }

    /// How many of `ino`'s xattrs live in the shared xattr area (we never write any;
    /// `mkfs.erofs` shares an xattr that many inodes carry).
    pub fn shared_xattr_count(&self, ino: &Inode) -> Result<usize> {
        if ino.xattr_icount == 0 {
            return Ok(0);
        }
        let mut head = [0u8; 12];
        self.read_at(ino.pos + ino.isize, &mut head)?;
        Ok(usize::from(head[4]))
    }

    /// The extended attributes of `ino` as (full name, value), inline entries first (in
    /// on-disk order), then shared ones.
    pub fn xattrs(&self, ino: &Inode) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if ino.xattr_icount == 0 {
            return Ok(Vec::new());
        }
        let size = self.xattr_size(ino);
        let area = self.read_vec(ino.pos + ino.isize, size)?;
        let shared = usize::from(area[4]);
        let mut p = 12usize
            .checked_add(4 * shared)
            .filter(|&p| p <= area.len())
            .ok_or_else(|| corrupt(format!("nid {}: shared xattr count", ino.nid)))?;
        let mut out = Vec::new();
        while p < area.len() {
            let (name, value, used) = parse_xattr_entry(&area[p..])
                .map_err(|e| corrupt(format!("nid {}: {e}", ino.nid)))?;
            out.push((name, value));
            p += used;
        }
        for i in 0..shared {
            let id_bytes = &area[12 + 4 * i..16 + 4 * i];
            let id = u32::from_le_bytes([id_bytes[0], id_bytes[1], id_bytes[2], id_bytes[3]]);
            let pos = self.xattr_base + u64::from(id) * 4;
            let head = self.read_vec(pos, 4)?;
            let e = XattrEntry::read_from_bytes(&head).map_err(|_| corrupt("xattr"))?;
            let total =
                xattr_align(4 + usize::from(e.e_name_len) + usize::from(e.e_value_size.get()));
            let raw = self.read_vec(pos, total as u64)?;
            let (name, value, _) =
                parse_xattr_entry(&raw).map_err(|e| corrupt(format!("shared xattr {id}: {e}")))?;
            out.push((name, value));
        }
        Ok(out)
    }
}

fn parse_xattr_entry(b: &[u8]) -> std::result::Result<(Vec<u8>, Vec<u8>, usize), String> {
    let (e, _) =
        XattrEntry::read_from_prefix(b).map_err(|_| "truncated xattr entry".to_string())?;
    let nlen = usize::from(e.e_name_len);
    let vlen = usize::from(e.e_value_size.get());
    let used = xattr_align(4 + nlen + vlen);
    if used > b.len() {
        return Err("xattr entry overruns its area".into());
    }
    let index = e.e_name_index;
    if index & 0x80 != 0 {
        return Err("long xattr name prefixes are not supported".into());
    }
    let (_, prefix, whole) = XATTR_PREFIXES
        .iter()
        .find(|(i, _, _)| *i == index)
        .ok_or_else(|| format!("unknown xattr name index {index}"))?;
    if *whole != (nlen == 0) {
        return Err(format!(
            "xattr name length {nlen} invalid for index {index}"
        ));
    }
    let mut name = prefix.as_bytes().to_vec();
    name.extend_from_slice(&b[4..4 + nlen]);
    Ok((name, b[4 + nlen..4 + nlen + vlen].to_vec(), used))
}

fn parse_dir_block(blk: &[u8], out: &mut Vec<DirEntry>) -> std::result::Result<(), String> {
    let (first, _) =
        Dirent::read_from_prefix(blk).map_err(|_| "block shorter than a dirent".to_string())?;
    let first_off = usize::from(first.nameoff.get());
    if first_off < 12 || first_off % 12 != 0 || first_off >= blk.len() {
        return Err(format!("bad first nameoff {first_off}"));
    }
    let nd = first_off / 12;
    let de = |i: usize| {
        Dirent::read_from_prefix(&blk[12 * i..])
            .map(|(d, _)| d)
            .map_err(|_| "dirent".to_string())
    };
    for i in 0..nd {
        let d = de(i)?;
        let start = usize::from(d.nameoff.get());
        let end = if i + 1 < nd {
            usize::from(de(i + 1)?.nameoff.get())
        } else {
            let rest = blk.get(start..).ok_or("nameoff beyond block")?;
            start + rest.iter().position(|&b| b == 0).unwrap_or(rest.len())
        };
        if start < first_off || end < start || end > blk.len() {
            return Err(format!("bad name range {start}..{end}"));
        }
        let name = &blk[start..end];
        if name.is_empty() || name.len() > NAME_LEN {
            return Err(format!("bad name length {}", name.len()));
        }
        out.push(DirEntry {
            name: name.to_vec(),
            nid: d.nid.get(),
            file_type: d.file_type,
        });
    }
    Ok(())
}

/// Parses `bytes` as an image and walks everything reachable: every inode's xattrs, every
/// directory, every file's data and every symlink. Errors are ignored; the only property is
/// that it returns (no panic, no unbounded allocation, bounded work). For fuzzing.
///
/// The superblock checksum is verified once, then the image is parsed again with the
/// checksum feature bit cleared, so that mutations reach the inode and directory parsers.
pub fn fuzz_read_all(bytes: &[u8]) {
    let _ = Image::from_bytes(bytes.to_vec());
    let mut v = bytes.to_vec();
    if let Some(compat) = v.get_mut(SUPER_OFFSET as usize + 8) {
        *compat &= !(FEATURE_COMPAT_SB_CHKSUM as u8);
    }
    let Ok(img) = Image::from_bytes(v) else {
        return;
    };
    let _ = walk_all(&img, 1 << 20, 64 << 20);
    let _ = device_run_ends(&img, 1 << 16);
}

/// The most run ends [`device_run_ends`] returns, all devices together (8 bytes each).
pub const MAX_RUN_ENDS: usize = 4 << 20;

/// Where regular files' data runs end on the image's extra devices: for each device of the
/// device table (index 0 = device id 1), the sorted, distinct byte offsets at which some
/// file's contiguous run of data on that device ends. A reader of a lazily fetched device
/// uses them to stop reading ahead at the end of the file it is reading.
///
/// Walks the tree from the root, each nid once. The work is bounded whatever the image: at
/// most `max_files` regular files, `8 · max_files + 1024` directory entries and
/// [`MAX_RUN_ENDS`] ends; past a bound, or on a malformed entry, the walk stops (or skips the
/// entry) and returns what it found. So the result may miss ends, but holds no other: each
/// comes from a parsed chunk index.
pub fn device_run_ends(img: &Image, max_files: usize) -> Vec<Vec<u64>> {
    let mut ends: Vec<Vec<u64>> = vec![Vec::new(); img.device_table().len()];
    let Ok(root) = img.root() else {
        return ends;
    };
    let mut dirents = max_files.saturating_mul(8).saturating_add(1024);
    let (mut files, mut total) = (0usize, 0usize);
    // A nid is marked when it is pushed: each is walked once, and the stack holds each once.
    let mut seen = HashSet::from([root.nid]);
    let mut stack = vec![root];
    let mut one = Vec::new();
    'walk: while let Some(ino) = stack.pop() {
        match ino.file_type {
            FileType::Directory => {
                let Ok(entries) = img.read_dir(&ino) else {
                    continue;
                };
                for e in entries {
                    if dirents == 0 {
                        break 'walk;
                    }
                    dirents -= 1;
                    if seen.insert(e.nid) {
                        if let Ok(child) = img.inode(e.nid) {
                            stack.push(child);
                        }
                    }
                }
            }
            FileType::Regular => {
                if files == max_files {
                    break;
                }
                files += 1;
                let Ok(map) = img.data_map(&ino) else {
                    continue;
                };
                // This file's ends, each once (a chunk repeated in a file ends several runs
                // at the same place).
                one.clear();
                one.extend(map.iter().filter_map(|x| match x.location {
                    Location::Device { device, offset } => {
                        Some((device, offset.checked_add(x.len)?))
                    }
                    _ => None,
                }));
                one.sort_unstable();
                one.dedup();
                for &(device, end) in &one {
                    if total == MAX_RUN_ENDS {
                        break 'walk;
                    }
                    let slot = usize::from(device).checked_sub(1);
                    if let Some(list) = slot.and_then(|i| ends.get_mut(i)) {
                        list.push(end);
                        total += 1;
                    }
                }
            }
            _ => {}
        }
    }
    for list in &mut ends {
        list.sort_unstable();
        list.dedup();
    }
    ends
}

/// Walks the whole tree (each nid once, at most `budget` dirents and `data_budget` bytes of
/// file data); returns the number of inodes visited.
pub(crate) fn walk_all(img: &Image, mut budget: u64, mut data_budget: u64) -> Result<u64> {
    let root = img.root()?;
    let mut seen = HashSet::new();
    let mut stack = vec![root];
    let mut visited = 0;
    while let Some(ino) = stack.pop() {
        if !seen.insert(ino.nid) {
            continue;
        }
        visited += 1;
        let _ = img.xattrs(&ino);
        match ino.file_type {
            FileType::Directory => {
                let Ok(entries) = img.read_dir(&ino) else {
                    continue;
                };
                for e in entries {
                    if budget == 0 {
                        return Ok(visited);
                    }
                    budget -= 1;
                    if !seen.contains(&e.nid) {
                        if let Ok(child) = img.inode(e.nid) {
                            stack.push(child);
                        }
                    }
                }
            }
            FileType::Regular if ino.size <= data_budget => {
                data_budget -= ino.size;
                let _ = img.copy_data(&ino, &mut std::io::sink());
            }
            FileType::Symlink => {
                let _ = img.read_link(&ino);
            }
            _ => {}
        }
    }
    Ok(visited)
}
