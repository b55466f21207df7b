//! Interop with erofs-utils 1.8 (built by `scripts/build-erofs-utils.sh` from Debian trixie's
//! source package; stricter than Debian 12's 1.5): its `fsck.erofs` (plain, `--device=BLOB`
//! for layers, `--extract=DIR`) and its `erofsfuse` (with `--device=BLOB` for layers) must
//! accept our full images and lazy layers and reproduce the source tree, attributes
//! included; and a directory of 100,000 entries, through the kernel and `fsck.erofs`.
//!
//! Needs root (the tree has devices, owners, trusted xattrs; mounts). Without the 1.8 tools
//! a test prints a loud SKIPPED line, or fails under `CI=true`.

mod common;
#[path = "common/tools.rs"]
mod tools;

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{fsck, make_tree, mount_erofs, require_root, run, write, Check};
use erofs_builder::layer::CHUNK_SIZE;
use erofs_builder::{build_image, build_layer, BuildOptions, LayerOptions, LayerStats};
use tools::{FuseMount, Tools};

/// Entries in the varied tree's `many/` directory.
const MANY: usize = 2_000;
/// Entries in the big directory.
const HUGE: usize = 100_000;

/// What `erofsfuse` 1.8 must reproduce: every attribute, except that it reports mtimes in
/// whole seconds (`erofsfuse_fill_stat` in its `fuse/main.c` sets `st_mtime` only).
const FUSE_CHECK: Check = Check {
    perm_mask: 0o7777,
    owners: true,
    mtime: true,
    mtime_nsec: false,
    xattrs: true,
    xattrs_lost: &[],
    xattrs_lost_with_empty: false,
    nlink: true,
    zero_tail_may_be_missing: false,
};

/// What `fsck.erofs` 1.8 `--extract --xattrs` must reproduce (as root: owners and exact
/// modes), except three gaps of the tool, each tolerated only as reported in [`Report`]:
///
/// * `security.capability` is lost: it sets a file's xattrs, then `lchown`s it, and the
///   kernel drops `security.capability` on every chown of a regular file
///   (`erofsfsck_dump_xattrs` runs before `erofsfsck_set_attributes` in its `fsck/main.c`).
///   `erofsfuse` shows the capability in the image is right.
/// * On an inode with an empty-valued xattr, that xattr and the ones listed after it are
///   not extracted: `erofsfsck_dump_xattrs` stops at a value size of 0 (`ret <= 0` ends the
///   loop with `ret = 0`: an error line, but fsck still succeeds). `erofsfuse` shows them.
/// * A file ending in unmapped chunks (hole chunk indexes) comes out short: it `lseek`s over
///   holes and never truncates the file to `i_size`. Every byte it lacks must be zero.
///
/// [`Report`]: common::Report
const EXTRACT_CHECK: Check = Check {
    perm_mask: 0o7777,
    owners: true,
    mtime: true,
    mtime_nsec: true,
    xattrs: true,
    xattrs_lost: &[b"security.capability"],
    xattrs_lost_with_empty: true,
    nlink: true,
    zero_tail_may_be_missing: true,
};

struct Fixture {
    dir: tempfile::TempDir,
    src: PathBuf,
    image: PathBuf,
    meta: PathBuf,
    blob: PathBuf,
    layer: LayerStats,
}

/// The varied tree of `common::make_tree` (every file type, xattrs incl. security.capability
/// and ACLs, hard links, a sparse file, a 255-byte name, a 64-level deep tree, non-UTF-8
/// names), plus files that exercise chunks in a layer: several chunks with a tail, repeated
/// chunks (dedupe), an all-zero chunk, and a sparse file with hole chunks around its data.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        make_tree(&src, true, MANY);
        let c = src.join("chunks");
        std::fs::create_dir(&c).unwrap();
        let cs = CHUNK_SIZE as usize;
        let (a, b) = (common::bytes(21, cs), common::bytes(22, cs));
        write(&c.join("multi"), &common::bytes(23, 3 * cs + 777));
        write(&c.join("repeat"), &[&a[..], &b, &a, &a].concat());
        write(
            &c.join("zero_chunk"),
            &[&b[..], &vec![0u8; cs], b"tail"].concat(),
        );
        let sp = File::create(c.join("sparse_chunks")).unwrap();
        sp.set_len(16 * CHUNK_SIZE).unwrap();
        sp.write_all_at(b"middle", 7 * CHUNK_SIZE + 3).unwrap();
        for name in ["multi", "repeat", "zero_chunk", "sparse_chunks"] {
            common::set_mtime(&c.join(name), 1_650_000_000, 123_456_789);
        }
        common::set_mtime(&c, 1_650_000_000, 1);
        common::set_mtime(&src, 1_700_000_000, 0);
        let image = dir.path().join("full.erofs");
        build_image(&src, &image, &BuildOptions::default()).unwrap();
        let (meta, blob) = (dir.path().join("meta.erofs"), dir.path().join("blob"));
        let layer = build_layer(&src, &meta, &blob, &LayerOptions::default()).unwrap();
        assert!(
            layer.hole_chunks > 0,
            "the layer has hole chunks: {layer:?}"
        );
        assert!(layer.unique_chunks < layer.chunks, "dedupe: {layer:?}");
        Fixture {
            dir,
            src,
            image,
            meta,
            blob,
            layer,
        }
    })
}

/// Root and the 1.8 tools, or `None` (after a SKIPPED line; CI fails instead).
fn setup(test: &str) -> Option<(Tools, &'static Fixture)> {
    if !require_root(test) {
        return None;
    }
    let t = tools::require(test)?;
    Some((t, fixture()))
}

/// `fsck.erofs --extract=DIR --xattrs` (as root: owners and exact permissions preserved),
/// then the extracted tree against the source.
fn extract_and_compare(t: &Tools, image: &Path, devices: &[&Path], f: &Fixture, name: &str) {
    let out = f.dir.path().join(format!("extract-{name}"));
    let _ = std::fs::remove_dir_all(&out);
    fsck(
        &t.fsck,
        image,
        devices,
        &[format!("--extract={}", out.display()), "--xattrs".into()],
    );
    let r = common::compare(&f.src, &out, EXTRACT_CHECK);
    eprintln!("{} --extract of {name}: {r:?}", t.version);
    assert!(
        r.entries > MANY && r.xattrs >= 5 && r.nsec_mtimes > MANY / 2,
        "{r:?}"
    );
    // The tolerated gaps are only where the tool's known behaviour puts them.
    for (p, x) in &r.lost_xattrs {
        assert!(
            (p.ends_with("setuid") && x == "security.capability") || p.ends_with("small.txt"),
            "{r:?}"
        );
    }
    for (p, _) in &r.short_files {
        assert!(
            p.ends_with("sparse") || p.ends_with("sparse_chunks"),
            "{r:?}"
        );
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn fsck_1_8_accepts_full_image_and_extract_reproduces_the_tree() {
    let Some((t, f)) = setup("fsck_1_8_accepts_full_image_and_extract_reproduces_the_tree") else {
        return;
    };
    fsck(&t.fsck, &f.image, &[], &[]);
    extract_and_compare(&t, &f.image, &[], f, "full");
}

#[test]
fn fsck_1_8_accepts_layer_with_device_and_extract_reproduces_the_tree() {
    let Some((t, f)) = setup("fsck_1_8_accepts_layer_with_device_and_extract_reproduces_the_tree")
    else {
        return;
    };
    fsck(&t.fsck, &f.meta, &[&f.blob], &[]);
    extract_and_compare(&t, &f.meta, &[&f.blob], f, "layer");
    // Without its blob the layer's data is unreachable: fsck must not pass it.
    let (ok, _) = run(Command::new(&t.fsck).arg("--extract").arg(&f.meta));
    assert!(
        !ok,
        "fsck.erofs --extract of a layer without its blob passed"
    );
}

fn fuse_compare(t: &Tools, image: &Path, devices: &[&Path], f: &Fixture, name: &str) {
    let mnt = f.dir.path().join(format!("fuse-{name}"));
    std::fs::create_dir_all(&mnt).unwrap();
    let m = FuseMount::mount(t, image, devices, &mnt);
    let r = common::compare(&f.src, &mnt, FUSE_CHECK);
    eprintln!("erofsfuse of {name} ({}): {r:?}", t.version);
    // Every xattr of the tree (9), security.capability and both ACLs included.
    assert!(r.entries > MANY && r.xattrs == 9, "{r:?}");
    assert!(r.lost_xattrs.is_empty() && r.short_files.is_empty());
    // The root itself, and data after a run of hole chunks.
    let (s, d) = (
        std::fs::metadata(&f.src).unwrap(),
        std::fs::metadata(&mnt).unwrap(),
    );
    assert_eq!(
        (s.mode(), s.uid(), s.gid(), s.mtime()),
        (d.mode(), d.uid(), d.gid(), d.mtime()),
        "root of {name}"
    );
    let mut mark = [0u8; 6];
    File::open(mnt.join("chunks/sparse_chunks"))
        .unwrap()
        .read_exact_at(&mut mark, 7 * CHUNK_SIZE + 3)
        .unwrap();
    assert_eq!(&mark, b"middle");
    drop(m);
}

#[test]
fn erofsfuse_1_8_mounts_full_image_and_it_matches_the_source() {
    let Some((t, f)) = setup("erofsfuse_1_8_mounts_full_image_and_it_matches_the_source") else {
        return;
    };
    fuse_compare(&t, &f.image, &[], f, "full");
}

#[test]
fn erofsfuse_1_8_mounts_layer_with_device_and_it_matches_the_source() {
    let Some((t, f)) = setup("erofsfuse_1_8_mounts_layer_with_device_and_it_matches_the_source")
    else {
        return;
    };
    assert!(f.layer.blob_bytes > 0);
    fuse_compare(&t, &f.meta, &[&f.blob], f, "layer");
}

/// A directory of [`HUGE`] entries with names of 7 to 255 bytes (files, some
/// subdirectories, symlinks), built as a full image once.
struct Huge {
    _dir: tempfile::TempDir,
    image: PathBuf,
}

fn huge_name(i: usize) -> String {
    // 6 digits + '-' + 0..=248 filler bytes: 7..=255 bytes, every length many times.
    format!("{i:06}-{}", "n".repeat((i * 7919) % 249))
}

fn huge() -> &'static Huge {
    static H: OnceLock<Huge> = OnceLock::new();
    H.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let big = src.join("big");
        std::fs::create_dir_all(&big).unwrap();
        for i in 0..HUGE {
            let p = big.join(huge_name(i));
            match i % 500 {
                0 => std::fs::create_dir(&p).unwrap(),
                1 => std::os::unix::fs::symlink("target", &p).unwrap(),
                2 => write(&p, &i.to_le_bytes()),
                _ => {
                    File::create(&p).unwrap();
                }
            }
        }
        let image = dir.path().join("huge.erofs");
        let mut opts = BuildOptions::default();
        opts.fsync = false;
        let stats = build_image(&src, &image, &opts).unwrap();
        assert_eq!(stats.inodes as usize, HUGE + 2, "{stats:?}");
        // The source is not needed any more: free its 100k inodes early.
        std::fs::remove_dir_all(&src).unwrap();
        Huge { _dir: dir, image }
    })
}

#[test]
fn directory_with_100k_entries_kernel_mount() {
    if !require_root("directory_with_100k_entries_kernel_mount") {
        return;
    }
    let h = huge();
    let mnt = tempfile::tempdir().unwrap();
    let _guard = mount_erofs(&h.image, &[], mnt.path());
    let big = mnt.path().join("big");
    let mut names: Vec<String> = std::fs::read_dir(&big)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), HUGE);
    names.sort();
    let mut want: Vec<String> = (0..HUGE).map(huge_name).collect();
    want.sort();
    assert!(names == want, "the names read back differ from the source");
    assert_eq!(
        std::fs::metadata(&big).unwrap().nlink(),
        2 + (HUGE as u64).div_ceil(500)
    );
    // Lookups (the kernel's binary search over dirent blocks), shortest to longest names.
    for i in (0..HUGE).step_by(1009).chain([0, 1, 2, HUGE - 1]) {
        let p = big.join(huge_name(i));
        let m = std::fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("lookup {i}: {e}"));
        match i % 500 {
            0 => assert!(m.is_dir(), "{i}"),
            1 => assert_eq!(std::fs::read_link(&p).unwrap(), Path::new("target")),
            2 => assert_eq!(std::fs::read(&p).unwrap(), i.to_le_bytes()),
            _ => assert!(m.is_file() && m.len() == 0, "{i}"),
        }
    }
    for missing in ["000000-n", "0", "zzz", &format!("{:06}-", HUGE)] {
        assert!(big.join(missing).symlink_metadata().is_err(), "{missing}");
    }
}

#[test]
fn directory_with_100k_entries_fsck_1_8() {
    if !require_root("directory_with_100k_entries_fsck_1_8") {
        return;
    }
    let Some(t) = tools::require("directory_with_100k_entries_fsck_1_8") else {
        return;
    };
    let h = huge();
    fsck(&t.fsck, &h.image, &[], &["--extract".into()]);
}
