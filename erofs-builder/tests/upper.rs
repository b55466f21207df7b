//! Overlay upper input: make real changes through a kernel overlayfs mount (delete a lower
//! file, replace a lower directory by `rm -rf` + `mkdir`, modify and add files), unmount,
//! build an image and a layer from the upper directory, and check that the image stacked on
//! the same lower shows exactly what the original overlay showed. Needs root.

mod common;

use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use common::{compare_trees, fsck, mount_erofs, mount_overlay, require_root, Strictness};
use erofs_builder::{
    build_image_from, build_layer_from, BuildOptions, Error, Image, LayerOptions, Source,
};

fn ovl(lowers: &[&Path], upper_work: Option<(&Path, &Path)>) -> String {
    let lower: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
    let mut data = format!("lowerdir={}", lower.join(":"));
    if let Some((u, w)) = upper_work {
        data.push_str(&format!(
            ",upperdir={},workdir={}",
            u.display(),
            w.display()
        ));
    }
    data
}

#[test]
fn overlay_upper_becomes_a_layer_that_hides_what_was_deleted() {
    if !require_root("overlay_upper_becomes_a_layer_that_hides_what_was_deleted") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    for d in [
        "lower",
        "lower/dir",
        "lower/keep",
        "upper",
        "work",
        "merged",
        "img",
        "layer",
        "a",
        "b",
    ] {
        fs::create_dir(p(d)).unwrap();
    }
    fs::write(p("lower/deleted"), b"lower").unwrap();
    fs::write(p("lower/modified"), b"lower").unwrap();
    fs::write(p("lower/untouched"), b"lower").unwrap();
    fs::write(p("lower/dir/old1"), b"lower").unwrap();
    fs::write(p("lower/dir/old2"), b"lower").unwrap();
    fs::write(p("lower/keep/inner"), b"lower").unwrap();
    {
        let _m = mount_overlay(
            &ovl(&[&p("lower")], Some((&p("upper"), &p("work")))),
            &p("merged"),
        );
        let m = |s: &str| p("merged").join(s);
        fs::remove_file(m("deleted")).unwrap();
        fs::write(m("modified"), b"changed in the upper").unwrap();
        fs::remove_dir_all(m("dir")).unwrap();
        fs::create_dir(m("dir")).unwrap();
        fs::write(m("dir/new"), b"new").unwrap();
        fs::write(m("keep/added"), b"added").unwrap();
        fs::write(m("top_new"), b"top").unwrap();
    }
    // The kernel wrote a whiteout, an opaque directory and its own bookkeeping (the
    // copied-up file's origin) into the upper.
    assert!(common::xattrs_of(&p("upper/modified")).contains_key(&b"trusted.overlay.origin"[..]));
    let wo = fs::symlink_metadata(p("upper/deleted")).unwrap();
    assert!(wo.file_type().is_char_device());
    assert_eq!(
        common::xattrs_of(&p("upper/dir")).get(&b"trusted.overlay.opaque"[..]),
        Some(&b"y".to_vec())
    );

    let image = p("upper.erofs");
    build_image_from(
        Source::OverlayUpper(p("upper")),
        &image,
        &BuildOptions::default(),
    )
    .unwrap();
    fsck(Path::new("fsck.erofs"), &image, &[], &[]);
    // Overlay bookkeeping (origin, impure, …) is dropped; the opaque marker is kept.
    let img = Image::open(&image).unwrap();
    let mut stack = vec![img.root().unwrap()];
    while let Some(ino) = stack.pop() {
        for (name, _) in img.xattrs(&ino).unwrap() {
            assert!(
                !name.starts_with(b"trusted.overlay.") || name == b"trusted.overlay.opaque",
                "kept {}",
                String::from_utf8_lossy(&name)
            );
        }
        if ino.file_type == erofs_builder::FileType::Directory {
            for e in img.read_dir(&ino).unwrap() {
                if e.name != b"." && e.name != b".." {
                    stack.push(img.inode(e.nid).unwrap());
                }
            }
        }
    }
    let w = img.lookup("deleted").unwrap();
    assert_eq!(w.rdev, (0, 0));

    // The same as a layer (meta + blob).
    let (meta, blob) = (p("upper.meta"), p("upper.blob"));
    build_layer_from(
        Source::OverlayUpper(p("upper")),
        &meta,
        &blob,
        &LayerOptions::default(),
    )
    .unwrap();

    // Reference: the original upper over the lower, read-only. Candidate: our image (and
    // our layer) over the same lower. They must show the same tree.
    let _a = mount_overlay(&ovl(&[&p("upper"), &p("lower")], None), &p("a"));
    let _img = mount_erofs(&image, &[], &p("img"));
    let _layer = mount_erofs(&meta, &[&blob], &p("layer"));
    let s = Strictness {
        perm_mask: 0o7777,
        owners_times_xattrs: true,
        nlink: false,
    };
    for top in ["img", "layer"] {
        let _b = mount_overlay(&ovl(&[&p(top), &p("lower")], None), &p("b"));
        let n = compare_trees(&p("a"), &p("b"), s);
        assert!(n >= 8, "{top}: compared {n}");
        assert!(!p("b/deleted").exists(), "{top}");
        assert!(!p("b/dir/old1").exists(), "{top}");
        assert_eq!(fs::read(p("b/dir/new")).unwrap(), b"new");
        assert_eq!(fs::read(p("b/modified")).unwrap(), b"changed in the upper");
        assert_eq!(fs::read(p("b/keep/inner")).unwrap(), b"lower");
        drop(_b);
    }
}

#[test]
fn overlay_upper_with_redirect_or_metacopy_is_refused() {
    if !require_root("overlay_upper_with_redirect_or_metacopy_is_refused") {
        return;
    }
    for name in ["trusted.overlay.redirect", "trusted.overlay.metacopy"] {
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        fs::create_dir_all(upper.join("d")).unwrap();
        rustix::fs::lsetxattr(
            upper.join("d"),
            name,
            b"/elsewhere",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        let out = t.path().join("out.erofs");
        let e = build_image_from(
            Source::OverlayUpper(upper.clone()),
            &out,
            &BuildOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::UnsupportedInput { reason, .. } if reason.contains("overlayfs")),
            "{e}"
        );
        assert!(!out.exists());
        // As a plain directory the xattr is just an xattr.
        build_image_from(Source::Dir(upper), &out, &BuildOptions::default()).unwrap();
    }
}
