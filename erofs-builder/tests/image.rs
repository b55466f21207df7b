//! End-to-end: build an image from a generated tree, then check it with fsck.erofs, the
//! kernel (file-backed mount(2)) and our reader; read a mkfs.erofs image with our reader.
//! Needs root (prints SKIPPED otherwise; fails under CI=true).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{
    compare_image, compare_trees, fsck, make_tree, mount_erofs, require_root, run, EXACT,
    FSCK15_EXTRACT,
};
use erofs_builder::{build_image, reader::fuzz_read_all, BuildOptions, Image};

const MANY: usize = 10_000;

struct Fixture {
    _dir: tempfile::TempDir,
    src: PathBuf,
    image: PathBuf,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        make_tree(&src, true, MANY);
        let image = dir.path().join("ours.erofs");
        let stats = build_image(&src, &image, &BuildOptions::default()).unwrap();
        eprintln!("built {}: {stats:?}", image.display());
        assert_eq!(stats.image_bytes, std::fs::metadata(&image).unwrap().len());
        Fixture {
            _dir: dir,
            src,
            image,
        }
    })
}

#[test]
fn fsck_erofs_accepts_our_image() {
    if !require_root("fsck_erofs_accepts_our_image") {
        return;
    }
    let f = fixture();
    fsck(Path::new("fsck.erofs"), &f.image, &[], &[]);
}

#[test]
fn fsck_erofs_extract_reproduces_the_tree() {
    if !require_root("fsck_erofs_extract_reproduces_the_tree") {
        return;
    }
    let f = fixture();
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("x");
    fsck(
        Path::new("fsck.erofs"),
        &f.image,
        &[],
        &[format!("--extract={}", dst.display())],
    );
    let n = compare_trees(&f.src, &dst, FSCK15_EXTRACT);
    assert!(n > MANY, "compared {n} entries");
}

#[test]
fn kernel_mounts_our_image_and_it_matches_the_source() {
    if !require_root("kernel_mounts_our_image_and_it_matches_the_source") {
        return;
    }
    let f = fixture();
    let mnt = tempfile::tempdir().unwrap();
    let _guard = mount_erofs(&f.image, &[], mnt.path());
    let n = compare_trees(&f.src, mnt.path(), EXACT);
    assert!(n > MANY, "compared {n} entries");
    // The root itself.
    use std::os::unix::fs::MetadataExt;
    let (s, m) = (
        std::fs::metadata(&f.src).unwrap(),
        std::fs::metadata(mnt.path()).unwrap(),
    );
    assert_eq!(
        (s.mode(), s.uid(), s.gid(), s.mtime(), s.mtime_nsec()),
        (m.mode(), m.uid(), m.gid(), m.mtime(), m.mtime_nsec())
    );
    assert_eq!(s.nlink(), m.nlink());
    // Path lookups by the kernel (binary search over our sorted dirent blocks).
    for i in (0..MANY).step_by(997) {
        let name = format!("entry-{i:05}-{}", "x".repeat(i % 40));
        assert!(
            mnt.path()
                .join("many")
                .join(&name)
                .symlink_metadata()
                .is_ok(),
            "lookup {name}"
        );
    }
    assert!(mnt
        .path()
        .join("many/no-such-entry")
        .symlink_metadata()
        .is_err());
    // The attribute comparisons above were not vacuous.
    let x = |p: &str| common::xattrs_of(&mnt.path().join(p));
    assert!(x("setuid").contains_key(&b"security.capability"[..]));
    assert!(x("acl_file").contains_key(&b"system.posix_acl_access"[..]));
    assert!(x("acl_dir").contains_key(&b"system.posix_acl_default"[..]));
    assert_eq!(x("sub")[&b"trusted.overlay.opaque"[..]], b"y");
    assert_eq!(x("small.txt")[&b"user.mime"[..]], b"text/plain");
    let m = std::fs::symlink_metadata(mnt.path().join("owned_big_ids")).unwrap();
    assert_eq!((m.uid(), m.gid()), (70_000, 80_000));
    let m = std::fs::symlink_metadata(mnt.path().join("setuid")).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o4755);
    let m = std::fs::symlink_metadata(mnt.path().join("bigdev")).unwrap();
    assert_eq!(
        (rustix::fs::major(m.rdev()), rustix::fs::minor(m.rdev())),
        (259, 0x12345)
    );
    let (a, b) = (
        std::fs::symlink_metadata(mnt.path().join("hl_a")).unwrap(),
        std::fs::symlink_metadata(mnt.path().join("sub/hl_c")).unwrap(),
    );
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 3));
}

#[test]
fn our_reader_reads_our_image() {
    if !require_root("our_reader_reads_our_image") {
        return;
    }
    let f = fixture();
    let img = Image::open(&f.image).unwrap();
    let n = compare_image(&f.src, &img, true);
    assert!(n > MANY, "compared {n} entries");
    let deep = img.lookup("deep/level0/level1/level2").unwrap();
    assert_eq!(deep.file_type, erofs_builder::FileType::Directory);
    let link = img.lookup("link").unwrap();
    assert_eq!(img.read_link(&link).unwrap(), b"small.txt");
    assert!(matches!(
        img.lookup("nope/x"),
        Err(erofs_builder::Error::NotFound(_))
    ));
    // Both inode forms and both data layouts occur.
    assert!(img.lookup("sticky").unwrap().extended);
    // Every third entry has the root's mtime: those are compact.
    let root = img.root().unwrap();
    let compact = img
        .read_dir(&root)
        .unwrap()
        .iter()
        .filter(|e| !img.inode(e.nid).unwrap().extended)
        .count();
    assert!(compact > 5, "{compact} compact inodes under the root");
    use erofs_builder::ondisk::{DATALAYOUT_FLAT_INLINE, DATALAYOUT_FLAT_PLAIN};
    assert_eq!(
        img.lookup("exact4k").unwrap().datalayout,
        DATALAYOUT_FLAT_PLAIN
    );
    assert_eq!(
        img.lookup("small.txt").unwrap().datalayout,
        DATALAYOUT_FLAT_INLINE
    );
    assert_eq!(
        img.lookup("many").unwrap().datalayout,
        DATALAYOUT_FLAT_INLINE
    );
}

#[test]
fn our_reader_reads_a_mkfs_erofs_image() {
    if !require_root("our_reader_reads_a_mkfs_erofs_image") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    // mkfs.erofs 1.5 rejects 255-byte names.
    make_tree(&src, false, 2_000);
    // The same xattr on many inodes: mkfs.erofs shares it (shared xattr area).
    for name in [
        "empty", "exact4k", "ro", "hl_a", "sticky", "sub", "-dash", "+plus",
    ] {
        let p = src.join(name);
        rustix::fs::lsetxattr(&p, "user.shared", b"same", rustix::fs::XattrFlags::empty()).unwrap();
    }
    let image = dir.path().join("mkfs.erofs");
    let (ok, text) = run(Command::new("mkfs.erofs").arg(&image).arg(&src));
    assert!(ok, "mkfs.erofs failed:\n{text}");
    let img = Image::open(&image).unwrap();
    let n = compare_image(&src, &img, true);
    assert!(n > 2_000, "compared {n} entries");
    let sb = img.superblock();
    let shared = img.lookup("exact4k").unwrap();
    assert_eq!(
        img.shared_xattr_count(&shared).unwrap(),
        1,
        "mkfs.erofs shares xattrs"
    );
    assert_ne!(
        sb.feature_compat.get() & erofs_builder::ondisk::FEATURE_COMPAT_SB_CHKSUM,
        0
    );
}

#[test]
fn building_twice_gives_identical_bytes() {
    if !require_root("building_twice_gives_identical_bytes") {
        return;
    }
    let f = fixture();
    let again = f.image.with_file_name("again.erofs");
    build_image(&f.src, &again, &BuildOptions::default()).unwrap();
    let (a, b) = (
        std::fs::read(&f.image).unwrap(),
        std::fs::read(&again).unwrap(),
    );
    assert!(a == b, "images differ");
    std::fs::remove_file(&again).unwrap();
}

/// No root needed: a small tree of plain files, dirs and symlinks, then many mutations.
#[test]
fn reader_never_panics_on_mutated_images() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("d/e")).unwrap();
    std::fs::write(src.join("a"), b"aaaa").unwrap();
    std::fs::write(src.join("d/b"), common::bytes(9, 5000)).unwrap();
    std::fs::write(src.join("d/e/c"), common::bytes(10, 300)).unwrap();
    std::os::unix::fs::symlink("../a", src.join("d/l")).unwrap();
    let image = dir.path().join("small.erofs");
    let mut opts = BuildOptions::default();
    opts.checksum = false;
    build_image(&src, &image, &opts).unwrap();
    let base = std::fs::read(&image).unwrap();
    let img = Image::from_bytes(base.clone()).unwrap();
    assert_eq!(compare_image(&src, &img, false), 6);
    fuzz_read_all(&base);
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Metadata lives in the first block(s); mutate there mostly.
    let meta_len = 8192.min(base.len());
    for _ in 0..3000 {
        let mut m = base.clone();
        for _ in 0..(1 + next() % 8) {
            let at = (next() as usize) % meta_len;
            m[at] = next() as u8;
        }
        fuzz_read_all(&m);
    }
    for cut in [0, 1, 1024, 1100, 1152, 1200, 4095, 4096, base.len() - 1] {
        fuzz_read_all(&base[..cut.min(base.len())]);
    }
    // The same for a mkfs.erofs image (shared xattrs, its own layout), when available.
    for f in ["a", "d/b", "d/e/c"] {
        let _ = rustix::fs::lsetxattr(src.join(f), "user.s", b"v", rustix::fs::XattrFlags::empty());
    }
    let mkfs_image = dir.path().join("mkfs.erofs");
    if let Ok(out) = Command::new("mkfs.erofs")
        .arg("-x1")
        .arg(&mkfs_image)
        .arg(&src)
        .output()
    {
        if out.status.success() {
            let base = std::fs::read(&mkfs_image).unwrap();
            fuzz_read_all(&base);
            for _ in 0..3000 {
                let mut m = base.clone();
                for _ in 0..(1 + next() % 8) {
                    let at = (next() as usize) % meta_len.min(base.len());
                    m[at] = next() as u8;
                }
                fuzz_read_all(&m);
            }
        }
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.erofs");
    assert!(build_image(&dir.path().join("missing"), &out, &BuildOptions::default()).is_err());
    std::fs::write(dir.path().join("file"), b"x").unwrap();
    assert!(build_image(&dir.path().join("file"), &out, &BuildOptions::default()).is_err());
    assert!(!out.exists());
    assert!(Image::from_bytes(vec![0; 10]).is_err());
    assert!(Image::from_bytes(vec![0; 8192]).is_err());
}

#[test]
fn excluded_entries_and_their_subtrees_are_left_out() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    for d in ["a/b/c", "keep/sub"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    for f in ["a/b/c/f", "a/x", "keep/sub/f", "keep/y", "top"] {
        std::fs::write(src.join(f), f.as_bytes()).unwrap();
    }
    let out = t.path().join("img");
    let mut opts = BuildOptions::default();
    opts.exclude = Some(std::sync::Arc::new(
        ["a/b", "keep/y", "nonexistent"]
            .iter()
            .map(PathBuf::from)
            .collect(),
    ));
    erofs_builder::build_image_from(erofs_builder::Source::Dir(src), &out, &opts).unwrap();
    let img = Image::open(&out).unwrap();
    for kept in ["a", "a/x", "keep/sub/f", "top"] {
        img.lookup(kept).unwrap_or_else(|e| panic!("{kept}: {e}"));
    }
    for gone in ["a/b", "a/b/c/f", "keep/y"] {
        assert!(
            matches!(img.lookup(gone), Err(erofs_builder::Error::NotFound(_))),
            "{gone} is in the image"
        );
    }
    // The directory that lost a subdirectory counts its links without it.
    assert_eq!(img.lookup("a").unwrap().nlink, 2);
}
