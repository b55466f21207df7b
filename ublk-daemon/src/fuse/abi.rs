//! The FUSE wire format (Linux `include/uapi/linux/fuse.h`), as far as Strata's servers use
//! it. Every struct is the kernel's byte for byte (native endian, `repr(C)`, padded to 8
//! bytes); sizes are asserted at compile time.
//!
//! A request is a [`InHeader`] (`len` = the whole request) followed by the opcode's argument
//! struct and, for name-taking opcodes, a NUL-terminated name. A reply is an [`OutHeader`]
//! (`len` = header + payload, `error` = 0 or a negative errno, `unique` echoed) followed by the
//! opcode's reply struct or data. A notification is an [`OutHeader`] with `unique` 0 and the
//! notification code in `error`.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The protocol major version.
pub const KERNEL_VERSION: u32 = 7;
/// The highest minor version this server speaks (7.40: passthrough, `FUSE_NOTIFY_RESEND`).
pub const KERNEL_MINOR_VERSION: u32 = 40;
/// The oldest minor version this server accepts (7.31: Linux 5.8, `fuse_attr.flags`).
pub const MIN_MINOR_VERSION: u32 = 31;
/// The smallest read buffer the kernel accepts on `/dev/fuse`.
pub const MIN_READ_BUFFER: usize = 8192;
/// The root's node id.
pub const ROOT_ID: u64 = 1;
/// Set in `unique` of a request the kernel sends again after `FUSE_NOTIFY_RESEND`.
pub const UNIQUE_RESEND: u64 = 1 << 63;

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const ACCESS: u32 = 34;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

/// Notification codes (`enum fuse_notify_code`).
pub mod notify {
    pub const INVAL_ENTRY: i32 = 3;
    pub const RESEND: i32 = 7;
}

/// INIT flags (`flags | flags2 << 32`).
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const PASSTHROUGH: u64 = 1 << 37;
    pub const HAS_RESEND: u64 = 1 << 39;
}

/// `fuse_open_out.open_flags`.
pub mod fopen {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    /// Direct writes to the file may run in parallel (no per-inode lock in the kernel).
    pub const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
    pub const PASSTHROUGH: u32 = 1 << 7;
}

/// `fuse_setattr_in.valid`: which attributes a SETATTR changes.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    pub const LOCKOWNER: u32 = 1 << 9;
    pub const CTIME: u32 = 1 << 10;
}

/// `fuse_fsync_in.fsync_flags`.
pub const FSYNC_FDATASYNC: u32 = 1 << 0;

/// `struct fuse_in_header`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    /// Length of the request extensions at the end, in 8-byte units.
    pub total_extlen: u16,
    pub padding: u16,
}
const _: () = assert!(std::mem::size_of::<InHeader>() == 40);

/// `struct fuse_out_header`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct OutHeader {
    pub len: u32,
    pub error: i32,
    pub unique: u64,
}
const _: () = assert!(std::mem::size_of::<OutHeader>() == 16);

/// `struct fuse_init_in` (the first 16 bytes are all a 7.x kernel must send; `flags2` from
/// 7.36).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub flags2: u32,
    pub unused: [u32; 11],
}
const _: () = assert!(std::mem::size_of::<InitIn>() == 64);

/// `struct fuse_init_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub time_gran: u32,
    pub max_pages: u16,
    pub map_alignment: u16,
    pub flags2: u32,
    pub max_stack_depth: u32,
    pub unused: [u32; 6],
}
const _: () = assert!(std::mem::size_of::<InitOut>() == 64);

/// `struct fuse_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}
const _: () = assert!(std::mem::size_of::<Attr>() == 88);

/// `struct fuse_entry_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct EntryOut {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_valid: u64,
    pub attr_valid: u64,
    pub entry_valid_nsec: u32,
    pub attr_valid_nsec: u32,
    pub attr: Attr,
}
const _: () = assert!(std::mem::size_of::<EntryOut>() == 128);

/// `struct fuse_attr_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct AttrOut {
    pub attr_valid: u64,
    pub attr_valid_nsec: u32,
    pub dummy: u32,
    pub attr: Attr,
}
const _: () = assert!(std::mem::size_of::<AttrOut>() == 104);

/// `struct fuse_getattr_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct GetattrIn {
    pub getattr_flags: u32,
    pub dummy: u32,
    pub fh: u64,
}
const _: () = assert!(std::mem::size_of::<GetattrIn>() == 16);

/// `struct fuse_open_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct OpenIn {
    pub flags: u32,
    pub open_flags: u32,
}
const _: () = assert!(std::mem::size_of::<OpenIn>() == 8);

/// `struct fuse_open_out` (`backing_id` from 7.40).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct OpenOut {
    pub fh: u64,
    pub open_flags: u32,
    pub backing_id: i32,
}
const _: () = assert!(std::mem::size_of::<OpenOut>() == 16);

/// `struct fuse_read_in` (also READDIR's argument).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub read_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}
const _: () = assert!(std::mem::size_of::<ReadIn>() == 40);

/// `struct fuse_write_in` (followed by `size` bytes of data).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct WriteIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub write_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}
const _: () = assert!(std::mem::size_of::<WriteIn>() == 40);
const _: () = assert!(std::mem::offset_of!(WriteIn, size) == 16);
const _: () = assert!(std::mem::offset_of!(WriteIn, lock_owner) == 24);
const _: () = assert!(std::mem::offset_of!(WriteIn, flags) == 32);

/// `struct fuse_write_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct WriteOut {
    pub size: u32,
    pub padding: u32,
}
const _: () = assert!(std::mem::size_of::<WriteOut>() == 8);

/// `struct fuse_setattr_in` (each field is meaningful only where its [`fattr`] bit is set in
/// `valid`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct SetattrIn {
    pub valid: u32,
    pub padding: u32,
    pub fh: u64,
    pub size: u64,
    pub lock_owner: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub unused4: u32,
    pub uid: u32,
    pub gid: u32,
    pub unused5: u32,
}
const _: () = assert!(std::mem::size_of::<SetattrIn>() == 88);
const _: () = assert!(std::mem::offset_of!(SetattrIn, size) == 16);
const _: () = assert!(std::mem::offset_of!(SetattrIn, atime) == 32);
const _: () = assert!(std::mem::offset_of!(SetattrIn, atimensec) == 56);
const _: () = assert!(std::mem::offset_of!(SetattrIn, mode) == 68);
const _: () = assert!(std::mem::offset_of!(SetattrIn, uid) == 76);

/// `struct fuse_fsync_in`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct FsyncIn {
    pub fh: u64,
    pub fsync_flags: u32,
    pub padding: u32,
}
const _: () = assert!(std::mem::size_of::<FsyncIn>() == 16);

/// `struct fuse_fallocate_in` (`mode` as fallocate(2)'s).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct FallocateIn {
    pub fh: u64,
    pub offset: u64,
    pub length: u64,
    pub mode: u32,
    pub padding: u32,
}
const _: () = assert!(std::mem::size_of::<FallocateIn>() == 32);
const _: () = assert!(std::mem::offset_of!(FallocateIn, length) == 16);
const _: () = assert!(std::mem::offset_of!(FallocateIn, mode) == 24);

/// `struct fuse_release_in` (also RELEASEDIR's argument).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct ReleaseIn {
    pub fh: u64,
    pub flags: u32,
    pub release_flags: u32,
    pub lock_owner: u64,
}
const _: () = assert!(std::mem::size_of::<ReleaseIn>() == 24);

/// `struct fuse_getxattr_in` (also LISTXATTR's argument).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct GetxattrIn {
    pub size: u32,
    pub padding: u32,
}
const _: () = assert!(std::mem::size_of::<GetxattrIn>() == 8);

/// `struct fuse_getxattr_out`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct GetxattrOut {
    pub size: u32,
    pub padding: u32,
}
const _: () = assert!(std::mem::size_of::<GetxattrOut>() == 8);

/// `struct fuse_kstatfs` (the whole of `fuse_statfs_out`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
    pub padding: u32,
    pub spare: [u32; 6],
}
const _: () = assert!(std::mem::size_of::<StatfsOut>() == 80);

/// `struct fuse_dirent` without its name (which follows, padded to 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct Dirent {
    pub ino: u64,
    pub off: u64,
    pub namelen: u32,
    pub typ: u32,
}
const _: () = assert!(std::mem::size_of::<Dirent>() == 24);

/// `struct fuse_notify_inval_entry_out` (followed by the name and a NUL).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct NotifyInvalEntryOut {
    pub parent: u64,
    pub namelen: u32,
    pub flags: u32,
}
const _: () = assert!(std::mem::size_of::<NotifyInvalEntryOut>() == 16);

/// `struct fuse_backing_map` (`FUSE_DEV_IOC_BACKING_OPEN`'s argument).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct BackingMap {
    pub fd: i32,
    pub flags: u32,
    pub padding: u64,
}
const _: () = assert!(std::mem::size_of::<BackingMap>() == 16);

const IOC_MAGIC: libc::c_ulong = 229;
const fn ioc(dir: libc::c_ulong, nr: libc::c_ulong, size: usize) -> libc::c_ulong {
    (dir << 30) | ((size as libc::c_ulong) << 16) | (IOC_MAGIC << 8) | nr
}
/// `_IOW(229, 1, struct fuse_backing_map)`.
pub const DEV_IOC_BACKING_OPEN: libc::c_ulong = ioc(1, 1, std::mem::size_of::<BackingMap>());
/// `_IOW(229, 2, uint32_t)`.
pub const DEV_IOC_BACKING_CLOSE: libc::c_ulong = ioc(1, 2, 4);

/// `S_IFDIR` / `S_IFREG` for `fuse_attr.mode`, and the `d_type`s of `fuse_dirent`.
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const DT_DIR: u32 = 4;
pub const DT_REG: u32 = 8;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel() {
        // _IOW(229, 1, 16 bytes) and _IOW(229, 2, 4 bytes) as <linux/fuse.h> defines them.
        assert_eq!(DEV_IOC_BACKING_OPEN, 0x4010_e501);
        assert_eq!(DEV_IOC_BACKING_CLOSE, 0x4004_e502);
    }
}
