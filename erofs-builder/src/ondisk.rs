//! On-disk EROFS structures (see `docs/format.md`), little-endian, with size asserts.
//!
//! These types are plain byte layouts: every bit pattern is a valid value, so parsing is a
//! bounds-checked copy (`read_from_bytes`) and never panics.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Byte offset of the superblock in the image.
pub const SUPER_OFFSET: u64 = 1024;
/// Superblock magic.
pub const EROFS_MAGIC: u32 = 0xE0F5_E1E2;
/// log2 of the block size we write.
pub const BLKSZ_BITS: u8 = 12;
/// The block size we write.
pub const BLOCK_SIZE: u64 = 1 << BLKSZ_BITS;
/// An inode slot is 32 bytes; nid = byte offset in the metadata area / 32.
pub const ISLOT_BITS: u32 = 5;
/// Size of an inode slot.
pub const ISLOT_SIZE: u64 = 1 << ISLOT_BITS;
/// Longest file name.
pub const NAME_LEN: usize = 255;

/// `feature_compat`: superblock checksum present.
pub const FEATURE_COMPAT_SB_CHKSUM: u32 = 0x1;
/// `feature_incompat`: zero padding for compressed data (harmless without compression).
pub const FEATURE_INCOMPAT_ZERO_PADDING: u32 = 0x1;

/// `feature_incompat`: chunk-based files (datalayout 4).
pub const FEATURE_INCOMPAT_CHUNKED_FILE: u32 = 0x4;
/// `feature_incompat`: a device table (`extra_devices` slots at `devt_slotoff * 128`).
pub const FEATURE_INCOMPAT_DEVICE_TABLE: u32 = 0x8;

/// `i_u.c.format` bits 0..4: log2(chunk size / block size).
pub const CHUNK_FORMAT_BLKBITS_MASK: u16 = 0x1f;
/// `i_u.c.format` bit 5: 8-byte chunk indexes (else a 4-byte block address array).
pub const CHUNK_FORMAT_INDEXES: u16 = 0x20;
/// `i_u.c.format` bit 6 (6.15+): 48-bit block addresses (read: unsupported).
pub const CHUNK_FORMAT_48BIT: u16 = 0x40;
/// A chunk index / block map entry whose address is this is a hole (reads as zeros).
pub const NULL_ADDR: u32 = u32::MAX;
/// Size of one device table slot.
pub const DEVT_SLOT_SIZE: u64 = 128;

/// Inode layout bit (i_format bit 0): extended (64-byte) inode.
pub const I_VERSION_EXTENDED: u16 = 1;
/// Data layout: uncompressed, all data in blocks.
pub const DATALAYOUT_FLAT_PLAIN: u16 = 0;
/// Data layout: compressed, full indexes (read: unsupported).
pub const DATALAYOUT_COMPRESSED_FULL: u16 = 1;
/// Data layout: uncompressed, tail inline after the inode.
pub const DATALAYOUT_FLAT_INLINE: u16 = 2;
/// Data layout: compressed, compact indexes (read: unsupported).
pub const DATALAYOUT_COMPRESSED_COMPACT: u16 = 3;
/// Data layout: chunk based (chunk indexes after the inode and its xattrs).
pub const DATALAYOUT_CHUNK_BASED: u16 = 4;
/// All i_format bits a reader may see (bit 4: NLINK_1 / DOT_OMITTED on 6.15+).
pub const I_FORMAT_ALL: u16 = 0x1f;

/// Directory entry file types (generic `FT_*`).
pub mod ft {
    /// Regular file.
    pub const REG: u8 = 1;
    /// Directory.
    pub const DIR: u8 = 2;
    /// Character device.
    pub const CHR: u8 = 3;
    /// Block device.
    pub const BLK: u8 = 4;
    /// Fifo.
    pub const FIFO: u8 = 5;
    /// Socket.
    pub const SOCK: u8 = 6;
    /// Symbolic link.
    pub const LNK: u8 = 7;
}

/// Xattr name indexes.
pub mod xattr_index {
    /// `user.`
    pub const USER: u8 = 1;
    /// `system.posix_acl_access` (whole name)
    pub const POSIX_ACL_ACCESS: u8 = 2;
    /// `system.posix_acl_default` (whole name)
    pub const POSIX_ACL_DEFAULT: u8 = 3;
    /// `trusted.`
    pub const TRUSTED: u8 = 4;
    /// `lustre.`
    pub const LUSTRE: u8 = 5;
    /// `security.`
    pub const SECURITY: u8 = 6;
}

/// The xattr name prefixes by index (`index`, prefix, whether the prefix is the whole name).
pub const XATTR_PREFIXES: [(u8, &str, bool); 6] = [
    (xattr_index::USER, "user.", false),
    (
        xattr_index::POSIX_ACL_ACCESS,
        "system.posix_acl_access",
        true,
    ),
    (
        xattr_index::POSIX_ACL_DEFAULT,
        "system.posix_acl_default",
        true,
    ),
    (xattr_index::TRUSTED, "trusted.", false),
    (xattr_index::LUSTRE, "lustre.", false),
    (xattr_index::SECURITY, "security.", false),
];

/// The superblock (128 bytes at byte 1024).
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SuperBlock {
    pub magic: U32,
    pub checksum: U32,
    pub feature_compat: U32,
    pub blkszbits: u8,
    pub sb_extslots: u8,
    pub root_nid: U16,
    pub inos: U64,
    pub build_time: U64,
    pub build_time_nsec: U32,
    pub blocks: U32,
    pub meta_blkaddr: U32,
    pub xattr_blkaddr: U32,
    pub uuid: [u8; 16],
    pub volume_name: [u8; 16],
    pub feature_incompat: U32,
    pub u1: U16,
    pub extra_devices: U16,
    pub devt_slotoff: U16,
    pub dirblkbits: u8,
    pub xattr_prefix_count: u8,
    pub xattr_prefix_start: U32,
    pub packed_nid: U64,
    pub xattr_filter_reserved: u8,
    pub reserved2: [u8; 23],
}

/// The 32-byte compact inode.
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct InodeCompact {
    pub i_format: U16,
    pub i_xattr_icount: U16,
    pub i_mode: U16,
    pub i_nlink: U16,
    pub i_size: U32,
    /// 0 on write; 6.15+ kernels add it to `build_time` as seconds.
    pub i_mtime: U32,
    /// raw_blkaddr or rdev.
    pub i_u: U32,
    pub i_ino: U32,
    pub i_uid: U16,
    pub i_gid: U16,
    pub i_reserved2: U32,
}

/// The 64-byte extended inode.
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct InodeExtended {
    pub i_format: U16,
    pub i_xattr_icount: U16,
    pub i_mode: U16,
    pub i_reserved: U16,
    pub i_size: U64,
    /// raw_blkaddr or rdev.
    pub i_u: U32,
    pub i_ino: U32,
    pub i_uid: U32,
    pub i_gid: U32,
    pub i_mtime: U64,
    pub i_mtime_nsec: U32,
    pub i_nlink: U32,
    pub i_reserved2: [u8; 16],
}

/// Header of the inline xattr area (12 bytes, then `h_shared_count` u32 ids).
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct XattrIbodyHeader {
    pub h_name_filter: U32,
    pub h_shared_count: u8,
    pub h_reserved2: [u8; 7],
}

/// One xattr entry header (4 bytes, then name suffix and value, padded to 4).
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct XattrEntry {
    pub e_name_len: u8,
    pub e_name_index: u8,
    pub e_value_size: U16,
}

/// A directory entry (12 bytes).
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct Dirent {
    pub nid: U64,
    pub nameoff: U16,
    pub file_type: u8,
    pub reserved: u8,
}

/// A chunk index (8 bytes) of a chunk-based inode with `CHUNK_FORMAT_INDEXES`.
#[derive(Debug, Clone, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ChunkIndex {
    /// Bits 32..47 of the start block with `CHUNK_FORMAT_48BIT` (pre-6.15: `advise`); 0.
    pub startblk_hi: U16,
    /// 0: the primary device (the image); k: device table slot k - 1.
    pub device_id: U16,
    /// Start block of the chunk in its device, or [`NULL_ADDR`] for a hole.
    pub startblk_lo: U32,
}

/// A device table slot (128 bytes at `devt_slotoff * 128 + 128 * k`).
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct DeviceSlot {
    /// Device tag (fscache/nydus: the blob id), NUL padded; may fill all 64 bytes.
    pub tag: [u8; 64],
    /// Blocks in the device (pre-6.15: `blocks`).
    pub blocks_lo: U32,
    /// Where the device starts in the unified (flat) block address space (6.15+: `uniaddr_lo`).
    pub mapped_blkaddr_lo: U32,
    /// Bits 32.. of the block count (48BIT only); 0.
    pub blocks_hi: U32,
    /// 6.15+: `uniaddr_hi` (u16) + 50 reserved bytes; all 0.
    pub reserved: [u8; 52],
}

impl Default for DeviceSlot {
    fn default() -> Self {
        Self {
            tag: [0; 64],
            blocks_lo: 0.into(),
            mapped_blkaddr_lo: 0.into(),
            blocks_hi: 0.into(),
            reserved: [0; 52],
        }
    }
}

const _: () = assert!(size_of::<ChunkIndex>() == 8);
const _: () = assert!(size_of::<DeviceSlot>() == 128);
const _: () = assert!(size_of::<SuperBlock>() == 128);
const _: () = assert!(size_of::<InodeCompact>() == 32);
const _: () = assert!(size_of::<InodeExtended>() == 64);
const _: () = assert!(size_of::<XattrIbodyHeader>() == 12);
const _: () = assert!(size_of::<XattrEntry>() == 4);
const _: () = assert!(size_of::<Dirent>() == 12);

/// Size of the inline xattr area for `i_xattr_icount` (0 when there is none).
pub fn xattr_ibody_size(icount: u16) -> u64 {
    if icount == 0 {
        0
    } else {
        12 + 4 * (u64::from(icount) - 1)
    }
}

/// Rounds `n` up to a multiple of 4 (xattr entry alignment).
pub fn xattr_align(n: usize) -> usize {
    n.div_ceil(4) * 4
}

/// The kernel's `new_encode_dev`.
pub fn encode_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

/// The kernel's `new_decode_dev`: (major, minor).
pub fn decode_dev(dev: u32) -> (u32, u32) {
    ((dev & 0xfff00) >> 8, (dev & 0xff) | ((dev >> 12) & 0xfff00))
}

/// The EROFS superblock checksum: CRC-32C over `data` with seed `!0`, no final inversion
/// (the kernel's `crc32c(~0, data, len)`).
pub fn sb_crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // Standard CRC-32C("123456789") = 0xE3069283 (with the final inversion).
        assert_eq!(!sb_crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn dev_encoding_round_trips() {
        for (ma, mi) in [(0, 0), (1, 3), (8, 17), (259, 0x12345), (4095, 0xfffff)] {
            assert_eq!(decode_dev(encode_dev(ma, mi)), (ma, mi));
        }
        assert_eq!(encode_dev(1, 3), 0x103);
    }
}
