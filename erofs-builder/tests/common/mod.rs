//! Test helpers: a generated source tree covering every file type and attribute, and
//! comparisons of a tree (mounted or extracted) or an [`Image`] against the source.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use erofs_builder::{FileType, Image, Inode};
use rustix::fs::{FileType as RFileType, Mode, Timespec, Timestamps, CWD};

pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Returns false (after a loud SKIPPED line) if the test cannot run; fails under CI=true.
pub fn require_root(test: &str) -> bool {
    is_root()
        || skip(&format!(
            "{test}: needs root (mount(2), mknod, chown, trusted xattrs)"
        ))
}

/// A test that cannot run: prints a loud `SKIPPED` line straight to fd 2 (libtest's capture
/// would hide an `eprintln!` of a passing test) and returns false; under `CI=true` it fails
/// the test instead (CI installs everything the tests need and runs them as root).
pub fn skip(msg: &str) -> bool {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{msg} (a test may not be skipped under CI=true)"
    );
    let _ = std::io::stderr().write_all(format!("\n*** SKIPPED {msg} ***\n\n").as_bytes());
    false
}

/// Deterministic pseudo-random bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn write(p: &Path, data: &[u8]) {
    fs::File::create(p).unwrap().write_all(data).unwrap();
}

pub fn set_mtime(p: &Path, sec: i64, nsec: i64) {
    let t = Timespec {
        tv_sec: sec,
        tv_nsec: nsec,
    };
    rustix::fs::utimensat(
        CWD,
        p,
        &Timestamps {
            last_access: t,
            last_modification: t,
        },
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

pub fn chmod(p: &Path, mode: u32) {
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

pub fn setx(p: &Path, name: &str, value: &[u8]) {
    rustix::fs::lsetxattr(p, name, value, rustix::fs::XattrFlags::empty()).unwrap();
}

pub fn mknod(p: &Path, ft: RFileType, major: u32, minor: u32) {
    rustix::fs::mknodat(
        CWD,
        p,
        ft,
        Mode::from_raw_mode(0o640),
        rustix::fs::makedev(major, minor),
    )
    .unwrap();
}

/// A POSIX ACL xattr value: version 2 header, then (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

pub const LONG_NAME_LEN: usize = 255;

/// Builds the test tree under `root` (which must exist and be empty). Needs root.
pub fn make_tree(root: &Path, with_long_name: bool, many: usize) {
    let p = |rel: &str| root.join(rel);
    write(&p("empty"), b"");
    write(&p("small.txt"), b"hello, erofs\n");
    write(&p("exact4k"), &bytes(1, 4096));
    write(&p("three_blocks_and_tail"), &bytes(2, 3 * 4096 + 123));
    write(&p("big_tail"), &bytes(3, 2 * 4096 + 4000));
    write(&p("large"), &bytes(4, (1 << 20) + 17));
    {
        // Sparse-ish: a hole, then data, then a hole at the end.
        let f = fs::File::create(p("sparse")).unwrap();
        f.set_len(5 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &bytes(5, 10_000), 2 << 20).unwrap();
    }
    write(&p("setuid"), b"#!/bin/sh\n");
    chmod(&p("setuid"), 0o4755);
    write(&p("setgid"), b"x");
    chmod(&p("setgid"), 0o2711);
    write(&p("ro"), b"read only");
    chmod(&p("ro"), 0o400);
    fs::create_dir(p("sticky")).unwrap();
    chmod(&p("sticky"), 0o1777);
    fs::create_dir(p("empty_dir")).unwrap();
    // Names sorting before "." and "..".
    for n in ["!bang", "+plus", "-dash", ".hidden", "..dots"] {
        write(&p(n), n.as_bytes());
    }
    // Names that are not UTF-8 or hold spaces and newlines.
    write(
        &root.join(OsStr::from_bytes(b"\xff\xfe-not-utf8")),
        b"bytes",
    );
    write(&p("with space\nand newline"), b"ws");
    // Owners.
    write(&p("owned_big_ids"), b"ids");
    std::os::unix::fs::lchown(p("owned_big_ids"), Some(70_000), Some(80_000)).unwrap();
    write(&p("owned_small_ids"), b"ids");
    std::os::unix::fs::lchown(p("owned_small_ids"), Some(1000), Some(1001)).unwrap();
    // Symlinks.
    symlink("small.txt", p("link")).unwrap();
    symlink("does/not/exist", p("dangling")).unwrap();
    symlink("a".repeat(4000), p("long_link")).unwrap();
    std::os::unix::fs::lchown(p("link"), Some(123), Some(456)).unwrap();
    // Hard links, across directories.
    fs::create_dir(p("sub")).unwrap();
    write(&p("hl_a"), b"hard linked content");
    fs::hard_link(p("hl_a"), p("sub/hl_b")).unwrap();
    fs::hard_link(p("hl_a"), p("sub/hl_c")).unwrap();
    // Devices, fifo, socket.
    mknod(&p("null"), RFileType::CharacterDevice, 1, 3);
    mknod(&p("sda1"), RFileType::BlockDevice, 8, 1);
    mknod(&p("bigdev"), RFileType::BlockDevice, 259, 0x12345);
    mknod(&p("fifo"), RFileType::Fifo, 0, 0);
    let sock = std::os::unix::net::UnixListener::bind(p("socket")).unwrap();
    drop(sock);
    // Xattrs.
    setx(&p("small.txt"), "user.mime", b"text/plain");
    setx(&p("small.txt"), "user.empty", b"");
    setx(&p("sub"), "trusted.overlay.opaque", b"y");
    // VFS_CAP_REVISION_2: magic 0x02000000 (| effective 1), permitted/inheritable pairs.
    let mut cap = Vec::new();
    cap.extend_from_slice(&0x0200_0001u32.to_le_bytes());
    cap.extend_from_slice(&(1u32 << 10).to_le_bytes()); // CAP_NET_BIND_SERVICE
    cap.extend_from_slice(&0u32.to_le_bytes());
    cap.extend_from_slice(&0u32.to_le_bytes());
    cap.extend_from_slice(&0u32.to_le_bytes());
    setx(&p("setuid"), "security.capability", &cap);
    setx(&p("big_tail"), "user.big", &bytes(6, 2000));
    setx(&p("three_blocks_and_tail"), "user.a", b"1");
    setx(&p("three_blocks_and_tail"), "user.b", b"22");
    // POSIX ACLs (system.posix_acl_access / _default: name indexes 2 and 3).
    write(&p("acl_file"), b"acl");
    setx(
        &p("acl_file"),
        "system.posix_acl_access",
        &acl(&[
            (1, 6, u32::MAX),
            (2, 4, 1000),
            (4, 4, u32::MAX),
            (0x10, 4, u32::MAX),
            (0x20, 0, u32::MAX),
        ]),
    );
    fs::create_dir(p("acl_dir")).unwrap();
    setx(
        &p("acl_dir"),
        "system.posix_acl_default",
        &acl(&[(1, 7, u32::MAX), (4, 5, u32::MAX), (0x20, 5, u32::MAX)]),
    );
    if with_long_name {
        write(&p(&"L".repeat(LONG_NAME_LEN)), b"long name");
    }
    // A directory with many entries (files and a few subdirectories).
    fs::create_dir(p("many")).unwrap();
    for i in 0..many {
        let name = format!("entry-{i:05}-{}", "x".repeat(i % 40));
        if i % 1000 == 0 {
            fs::create_dir(p("many").join(&name)).unwrap();
        } else {
            write(&p("many").join(&name), name.as_bytes());
        }
    }
    // A deep tree.
    let mut deep = p("deep");
    for i in 0..64 {
        deep.push(format!("level{i}"));
    }
    fs::create_dir_all(&deep).unwrap();
    write(&deep.join("bottom"), b"bottom");
    // Mtimes with nanoseconds, set last (children before parents), some shared.
    let mut all = Vec::new();
    collect(root, &mut all);
    all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for (i, path) in all.iter().enumerate() {
        let (s, ns) = if i % 3 == 0 {
            (1_700_000_000, 0)
        } else {
            (1_600_000_000 + i as i64, (i as i64 * 7919) % 1_000_000_000)
        };
        set_mtime(path, s, ns);
    }
    set_mtime(&p("small.txt"), -86_400, 5); // before 1970
    set_mtime(root, 1_700_000_000, 0);
}

/// Sets the mtime of `root` and everything under it (so all inodes can be compact).
pub fn set_all_mtimes(root: &Path, sec: i64, nsec: i64) {
    let mut all = Vec::new();
    collect(root, &mut all);
    all.push(root.to_path_buf());
    for p in all {
        set_mtime(&p, sec, nsec);
    }
}

/// Every path under `dir` (not `dir` itself), children of a directory before it.
pub fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let path = e.path();
        if e.file_type().unwrap().is_dir() {
            collect(&path, out);
        }
        out.push(path);
    }
}

/// Sorted xattrs of a path (lgetxattr / llistxattr).
pub fn xattrs_of(p: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut out = BTreeMap::new();
    let n = rustix::fs::llistxattr_query(p).unwrap();
    if n == 0 {
        return out;
    }
    let mut names = vec![0u8; n];
    let n = rustix::fs::llistxattr(p, &mut names[..]).unwrap();
    names.truncate(n);
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let os = OsStr::from_bytes(name);
        let len = rustix::fs::lgetxattr_query(p, os).unwrap();
        let mut v = vec![0u8; len];
        let len = rustix::fs::lgetxattr(p, os, &mut v[..]).unwrap();
        v.truncate(len);
        out.insert(name.to_vec(), v);
    }
    out
}

/// What to compare besides types, names, contents and symlink targets.
#[derive(Clone, Copy)]
pub struct Strictness {
    /// Mode bits compared besides the file type (fsck.erofs 1.5 --extract loses setuid and
    /// setgid: it chowns after chmod, which clears them).
    pub perm_mask: u32,
    pub owners_times_xattrs: bool,
    pub nlink: bool,
}

/// Everything: the whole mode, owners, mtimes (ns), xattrs, nlink and hard-link identity (a
/// kernel mount of our image against its source, or against GNU tar's extraction).
pub const EXACT: Strictness = Strictness {
    perm_mask: 0o7777,
    owners_times_xattrs: true,
    nlink: true,
};

/// For a tree extracted by Debian 12's `fsck.erofs` 1.5 `--extract`: it chowns after chmod,
/// which clears setuid and setgid, so only the sticky and rwx bits of the mode are compared;
/// owners, mtimes, xattrs and nlink are not.
pub const FSCK15_EXTRACT: Strictness = Strictness {
    perm_mask: 0o1777,
    owners_times_xattrs: false,
    nlink: false,
};

/// Runs `bin` (a `fsck.erofs`) as `bin --device=D... EXTRA... IMAGE`; fails the test with
/// its output unless it succeeds.
pub fn fsck(bin: &Path, image: &Path, devices: &[&Path], extra: &[String]) {
    let mut cmd = std::process::Command::new(bin);
    for d in devices {
        cmd.arg(format!("--device={}", d.display()));
    }
    cmd.args(extra).arg(image);
    let (ok, text) = run(&mut cmd);
    assert!(
        ok,
        "{} {extra:?} {} failed:\n{text}",
        bin.display(),
        image.display()
    );
}

/// Compares two real trees (source vs mounted/extracted) entry by entry; returns the number
/// of entries compared. Hard links: a source inode maps to exactly one target inode.
pub fn compare_trees(src: &Path, dst: &Path, s: Strictness) -> usize {
    let c = Check {
        perm_mask: s.perm_mask,
        owners: s.owners_times_xattrs,
        mtime: s.owners_times_xattrs,
        mtime_nsec: s.owners_times_xattrs,
        xattrs: s.owners_times_xattrs,
        xattrs_lost: &[],
        xattrs_lost_with_empty: false,
        nlink: s.nlink,
        zero_tail_may_be_missing: false,
    };
    compare(src, dst, c).entries
}

fn sorted_names(p: &Path) -> Vec<std::ffi::OsString> {
    let mut v: Vec<_> = std::fs::read_dir(p)
        .unwrap_or_else(|e| panic!("readdir {}: {e}", p.display()))
        .map(|e| e.unwrap().file_name())
        .collect();
    v.sort();
    v
}

/// What a tree comparison checks (besides names, types, sizes, contents, symlink targets and
/// device numbers, which are always compared) and which known tool gaps it tolerates.
#[derive(Debug, Clone, Copy)]
pub struct Check {
    /// Mode bits compared besides the type.
    pub perm_mask: u32,
    /// uid and gid.
    pub owners: bool,
    /// mtime seconds; and nanoseconds when `mtime_nsec`.
    pub mtime: bool,
    pub mtime_nsec: bool,
    /// Extended attributes, except the names in `xattrs_lost`.
    pub xattrs: bool,
    /// Xattr names that may be missing on the copy (a known tool gap; reported). When
    /// present they must still be equal.
    pub xattrs_lost: &'static [&'static [u8]],
    /// On an inode with an empty-valued xattr, any xattr may be missing on the copy (a known
    /// tool gap; reported).
    pub xattrs_lost_with_empty: bool,
    /// nlink of every entry and hard-link identity (one source inode ↔ one copy inode).
    pub nlink: bool,
    /// A regular file of the copy may be shorter than the source when every byte it lacks
    /// is zero in the source (a trailing hole not re-created; reported).
    pub zero_tail_may_be_missing: bool,
}

/// What [`compare`] saw.
#[derive(Debug, Default)]
pub struct Report {
    pub entries: usize,
    pub file_bytes: u64,
    /// Xattrs compared equal.
    pub xattrs: usize,
    /// Entries whose mtime had a non-zero nanosecond part that was compared.
    pub nsec_mtimes: usize,
    /// (path, xattr name) missing on the copy, tolerated by `xattrs_lost`.
    pub lost_xattrs: Vec<(PathBuf, String)>,
    /// (path, bytes missing) tolerated by `zero_tail_may_be_missing`.
    pub short_files: Vec<(PathBuf, u64)>,
}

/// Compares the tree at `src` with its copy at `dst` (mounted or extracted), entry by entry.
pub fn compare(src: &Path, dst: &Path, c: Check) -> Report {
    let mut r = Report::default();
    let mut inos = std::collections::HashMap::new();
    compare_dir(src, dst, c, &mut inos, &mut r);
    r
}

fn compare_dir(
    src: &Path,
    dst: &Path,
    c: Check,
    inos: &mut std::collections::HashMap<u64, u64>,
    r: &mut Report,
) {
    use std::os::unix::fs::FileTypeExt;
    let names = sorted_names(src);
    assert_eq!(names, sorted_names(dst), "entries of {}", src.display());
    for name in names {
        let (sp, dp) = (src.join(&name), dst.join(&name));
        let sm = std::fs::symlink_metadata(&sp).unwrap();
        let dm = std::fs::symlink_metadata(&dp).unwrap();
        let what = sp.display().to_string();
        r.entries += 1;
        let ft = sm.file_type();
        assert_eq!(sm.mode() & 0o170000, dm.mode() & 0o170000, "type of {what}");
        assert_eq!(
            sm.mode() & c.perm_mask,
            dm.mode() & c.perm_mask,
            "mode of {what}"
        );
        if c.owners {
            assert_eq!(
                (sm.uid(), sm.gid()),
                (dm.uid(), dm.gid()),
                "owner of {what}"
            );
        }
        if c.mtime {
            assert_eq!(sm.mtime(), dm.mtime(), "mtime of {what}");
        }
        if c.mtime_nsec {
            assert_eq!(sm.mtime_nsec(), dm.mtime_nsec(), "mtime ns of {what}");
            r.nsec_mtimes += usize::from(sm.mtime_nsec() != 0);
        }
        if c.xattrs {
            let (sx, mut dx) = (xattrs_of(&sp), xattrs_of(&dp));
            let has_empty = sx.values().any(Vec::is_empty);
            for (k, v) in &sx {
                match dx.remove(k) {
                    Some(d) => {
                        assert!(d == *v, "xattr {} of {what}", String::from_utf8_lossy(k));
                        r.xattrs += 1;
                    }
                    None if c.xattrs_lost.contains(&k.as_slice())
                        || (c.xattrs_lost_with_empty && has_empty) =>
                    {
                        r.lost_xattrs
                            .push((sp.clone(), String::from_utf8_lossy(k).into_owned()));
                    }
                    None => panic!("xattr {} of {what} missing", String::from_utf8_lossy(k)),
                }
            }
            assert!(dx.is_empty(), "extra xattrs on {what}: {:?}", dx.keys());
        }
        if ft.is_file() || ft.is_char_device() || ft.is_block_device() {
            assert_eq!(sm.rdev(), dm.rdev(), "rdev of {what}");
        }
        if c.nlink {
            assert_eq!(sm.nlink(), dm.nlink(), "nlink of {what}");
            if !ft.is_dir() {
                let prev = inos.insert(sm.ino(), dm.ino());
                assert!(
                    prev.is_none() || prev == Some(dm.ino()),
                    "hard link identity of {what}"
                );
            }
        }
        if ft.is_file() {
            let n = files_equal(&sp, &dp, c.zero_tail_may_be_missing, &what);
            if n < sm.len() {
                r.short_files.push((sp.clone(), sm.len() - n));
            }
            r.file_bytes += sm.len();
        } else if ft.is_symlink() {
            assert_eq!(
                std::fs::read_link(&sp).unwrap(),
                std::fs::read_link(&dp).unwrap(),
                "target of {what}"
            );
        } else if ft.is_dir() {
            compare_dir(&sp, &dp, c, inos, r);
        }
    }
}

/// Compares contents; returns the copy's length. With `zero_tail`, a shorter copy passes
/// when the source's remaining bytes are all zero.
fn files_equal(a: &Path, b: &Path, zero_tail: bool, what: &str) -> u64 {
    use std::io::Read;
    let (la, lb) = (
        std::fs::metadata(a).unwrap().len(),
        std::fs::metadata(b).unwrap().len(),
    );
    assert!(
        la == lb || (zero_tail && lb < la),
        "size of {what}: {la} vs {lb}"
    );
    let (mut fa, mut fb) = (
        std::fs::File::open(a).unwrap(),
        std::fs::File::open(b).unwrap(),
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    let mut off = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba);
        let nb = read_full(&mut fb, &mut bb);
        assert!(ba[..nb] == bb[..nb], "content of {what} near offset {off}");
        if na > nb {
            assert!(
                ba[nb..na].iter().all(|&x| x == 0),
                "missing non-zero tail of {what}"
            );
        }
        off += na as u64;
        if na == 0 {
            return lb;
        }
    }
    fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> usize {
        let mut n = 0;
        while n < buf.len() {
            match f.read(&mut buf[n..]).unwrap() {
                0 => break,
                k => n += k,
            }
        }
        n
    }
}

/// Compares the source tree with an image through our reader; returns entries compared.
/// `exact_meta`: also owners, mtimes (ns), nlink and xattrs (our images; mkfs.erofs images
/// also keep them, so it is used for both).
pub fn compare_image(src: &Path, img: &Image, exact_meta: bool) -> usize {
    let root = img.root().unwrap();
    let mut inos: HashMap<u64, u64> = HashMap::new();
    let mut count = 0;
    compare_image_dir(src, img, &root, root.nid, exact_meta, &mut inos, &mut count);
    count
}

fn compare_image_dir(
    src: &Path,
    img: &Image,
    dir: &Inode,
    parent_nid: u64,
    exact: bool,
    inos: &mut HashMap<u64, u64>,
    count: &mut usize,
) {
    let entries = img.read_dir(dir).unwrap();
    // Sorted by bytes, "." and ".." present and pointing right.
    assert!(
        entries.windows(2).all(|w| w[0].name < w[1].name),
        "dirents sorted in {}",
        src.display()
    );
    let dot = entries.iter().find(|e| e.name == b".").expect(".");
    assert_eq!(dot.nid, dir.nid);
    let dotdot = entries.iter().find(|e| e.name == b"..").expect("..");
    assert_eq!(dotdot.nid, parent_nid);
    let names: Vec<Vec<u8>> = entries
        .iter()
        .map(|e| e.name.clone())
        .filter(|n| n != b"." && n != b"..")
        .collect();
    let src_names: Vec<Vec<u8>> = {
        let mut v: Vec<Vec<u8>> = sorted_names(src)
            .into_iter()
            .map(|n| n.as_bytes().to_vec())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names, src_names, "entries of {}", src.display());
    for e in entries.iter().filter(|e| e.name != b"." && e.name != b"..") {
        let sp = src.join(OsStr::from_bytes(&e.name));
        let what = sp.display().to_string();
        let sm = fs::symlink_metadata(&sp).unwrap();
        let ino = img.inode(e.nid).unwrap();
        *count += 1;
        assert_eq!(u32::from(ino.mode), sm.mode(), "mode of {what}");
        if exact {
            assert_eq!((ino.uid, ino.gid), (sm.uid(), sm.gid()), "owner of {what}");
            assert_eq!(
                (ino.mtime, i64::from(ino.mtime_nsec)),
                (sm.mtime(), sm.mtime_nsec()),
                "mtime of {what}"
            );
            let mut x: Vec<(Vec<u8>, Vec<u8>)> = img.xattrs(&ino).unwrap();
            x.sort();
            let want: Vec<(Vec<u8>, Vec<u8>)> = xattrs_of(&sp).into_iter().collect();
            assert_eq!(x, want, "xattrs of {what}");
        }
        assert_eq!(u64::from(ino.nlink), sm.nlink(), "nlink of {what}");
        if ino.file_type != FileType::Directory {
            let prev = inos.insert(sm.ino(), ino.nid);
            assert!(
                prev.is_none() || prev == Some(ino.nid),
                "hard link identity of {what}"
            );
        }
        match ino.file_type {
            FileType::Regular => {
                assert_eq!(ino.size, sm.len(), "size of {what}");
                assert!(image_file_equal(img, &ino, &sp), "content of {what}");
            }
            FileType::Symlink => {
                let t = fs::read_link(&sp).unwrap();
                assert_eq!(
                    img.read_link(&ino).unwrap(),
                    t.as_os_str().as_bytes(),
                    "target of {what}"
                );
            }
            FileType::CharDevice | FileType::BlockDevice => {
                let r = sm.rdev();
                assert_eq!(
                    ino.rdev,
                    (rustix::fs::major(r), rustix::fs::minor(r)),
                    "rdev of {what}"
                );
            }
            FileType::Directory => compare_image_dir(&sp, img, &ino, dir.nid, exact, inos, count),
            _ => {}
        }
    }
}

/// Streams `ino`'s data (through our reader) and the file at `p` side by side.
pub fn image_file_equal(img: &Image, ino: &Inode, p: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    let f = fs::File::open(p).unwrap();
    if f.metadata().unwrap().len() != ino.size {
        return false;
    }
    let (mut a, mut b) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut off = 0u64;
    while off < ino.size {
        let n = img.read_at_inode(ino, off, &mut a).unwrap();
        assert!(n > 0, "short read at {off}");
        f.read_exact_at(&mut b[..n], off).unwrap();
        if a[..n] != b[..n] {
            return false;
        }
        off += n as u64;
    }
    true
}

/// Run a command; its success and its stdout + stderr.
pub fn run(cmd: &mut std::process::Command) -> (bool, String) {
    let out = cmd.output().expect("run command");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Unmounts (lazily if busy) when dropped, even when the test panics.
pub struct MountGuard(PathBuf);

impl Drop for MountGuard {
    fn drop(&mut self) {
        if rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::empty()).is_err() {
            let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// File-backed EROFS mount via mount(2) (no loop device), with `device=` blobs if any.
pub fn mount_erofs(image: &Path, devices: &[&Path], target: &Path) -> MountGuard {
    let data: String = devices
        .iter()
        .map(|d| format!("device={}", d.canonicalize().unwrap().display()))
        .collect::<Vec<_>>()
        .join(",");
    let data = std::ffi::CString::new(data).unwrap();
    let data = (!devices.is_empty()).then_some(data.as_c_str());
    rustix::mount::mount(
        image,
        target,
        "erofs",
        rustix::mount::MountFlags::RDONLY,
        data,
    )
    .unwrap_or_else(|e| panic!("mount -t erofs {} (data {data:?}): {e}", image.display()));
    MountGuard(target.to_path_buf())
}

/// An overlayfs mount via mount(2) with the given options (`lowerdir=…,upperdir=…`).
pub fn mount_overlay(data: &str, target: &Path) -> MountGuard {
    let c = std::ffi::CString::new(data).unwrap();
    rustix::mount::mount(
        "overlay",
        target,
        "overlay",
        rustix::mount::MountFlags::empty(),
        Some(c.as_c_str()),
    )
    .unwrap_or_else(|e| panic!("mount -t overlay ({data}): {e}"));
    MountGuard(target.to_path_buf())
}

/// Every regular file of the image with its path (`/a/b`), hard links once per name.
pub fn regular_files(img: &Image) -> Vec<(String, Inode)> {
    let mut out = Vec::new();
    let mut todo = vec![(String::new(), img.root().unwrap())];
    while let Some((path, dir)) = todo.pop() {
        for e in img.read_dir(&dir).unwrap() {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let p = format!("{path}/{}", String::from_utf8_lossy(&e.name));
            let ino = img.inode(e.nid).unwrap();
            match ino.file_type {
                FileType::Directory => todo.push((p, ino)),
                FileType::Regular => out.push((p, ino)),
                _ => {}
            }
        }
    }
    out
}
