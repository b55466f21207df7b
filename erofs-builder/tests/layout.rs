//! Layout edge cases: file sizes and xattr sizes around block boundaries, so that inode
//! records, inline tails and directory blocks land on every kind of boundary; each tree is
//! checked by fsck.erofs, the kernel and our reader. Needs root (SKIPPED otherwise).

mod common;

use std::path::Path;
use std::process::Command;

use common::{compare_image, compare_trees, fsck, require_root, EXACT};
use erofs_builder::{build_image, BuildOptions, Image};

fn check_image(src: &Path, image: &Path) {
    fsck(Path::new("fsck.erofs"), image, &[], &[]);
    let img = Image::open(image).unwrap();
    compare_image(src, &img, true);
    let mnt = tempfile::tempdir().unwrap();
    rustix::mount::mount(
        image,
        mnt.path(),
        "erofs",
        rustix::mount::MountFlags::RDONLY,
        None,
    )
    .unwrap();
    struct Guard<'a>(&'a Path);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }
    let _g = Guard(mnt.path());
    compare_trees(src, mnt.path(), EXACT);
}

#[test]
fn boundary_sizes_mount_and_fsck() {
    if !require_root("boundary_sizes_mount_and_fsck") {
        return;
    }
    for seed in 0..6u64 {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let mut rng = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
        let mut next = move |m: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % m
        };
        let sizes = [
            0u64, 1, 31, 32, 33, 4000, 4031, 4032, 4033, 4063, 4064, 4065, 4095, 4096, 4097, 8191,
            8192, 8193, 12_000,
        ];
        for (i, &size) in sizes.iter().enumerate() {
            let d = src.join(format!("d{}", next(3)));
            std::fs::create_dir_all(&d).unwrap();
            let p = d.join(format!("f{i:02}-{}", "n".repeat(next(60) as usize)));
            std::fs::write(&p, common::bytes(seed * 100 + i as u64, size as usize)).unwrap();
            if next(2) == 0 {
                let v = common::bytes(i as u64, next(3000) as usize);
                rustix::fs::lsetxattr(&p, "user.pad", &v, rustix::fs::XattrFlags::empty()).unwrap();
            }
            if next(3) == 0 {
                std::os::unix::fs::lchown(&p, Some(100_000), None).unwrap();
            }
            // Symlinks whose targets straddle the inline limit.
            let t = "t".repeat(1 + next(4095) as usize);
            std::os::unix::fs::symlink(&t, d.join(format!("s{i:02}"))).unwrap();
        }
        // A directory whose names fill blocks in different ways.
        let big = src.join("names");
        std::fs::create_dir(&big).unwrap();
        for i in 0..(300 + next(400)) {
            let name = format!("{i:04}{}", "z".repeat(next(200) as usize));
            std::fs::write(big.join(name), b"").unwrap();
        }
        if seed % 2 == 1 {
            // All mtimes equal to the root's: compact inodes wherever ids allow.
            common::set_all_mtimes(&src, 1_650_000_000, 0);
        }
        let image = dir.path().join("img.erofs");
        let stats = build_image(&src, &image, &BuildOptions::default()).unwrap();
        if seed % 2 == 1 {
            assert!(stats.extended_inodes < stats.inodes / 2, "{stats:?}");
        }
        check_image(&src, &image);
    }
}

#[test]
fn identical_trees_in_other_places_give_identical_images() {
    if !require_root("identical_trees_in_other_places_give_identical_images") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    std::fs::create_dir(&a).unwrap();
    common::make_tree(&a, true, 500);
    let b = dir.path().join("b");
    let st = Command::new("cp")
        .arg("-a")
        .arg(&a)
        .arg(&b)
        .status()
        .unwrap();
    assert!(st.success());
    let (ia, ib) = (dir.path().join("a.erofs"), dir.path().join("b.erofs"));
    build_image(&a, &ia, &BuildOptions::default()).unwrap();
    build_image(&b, &ib, &BuildOptions::default()).unwrap();
    assert!(
        std::fs::read(&ia).unwrap() == std::fs::read(&ib).unwrap(),
        "images differ"
    );
}
