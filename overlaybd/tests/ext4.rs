//! End to end with a real filesystem: ext4 images made by `mkfs.ext4 -d` are written into a
//! device, committed, stacked and read back; `e2fsck -fn` must be clean on every stage.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use overlaybd::{Device, FileSource, LayerId, LayerSource, Upper};

const SIZE: u64 = 64 << 20;
const PIECE: usize = 1 << 20;

fn tool(name: &str) -> bool {
    Command::new(name).arg("-V").output().is_ok()
}

fn mkfs(tree: &Path, image: &Path) {
    let st = Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-b",
            "4096",
            "-E",
            "lazy_itable_init=0,root_owner=0:0",
            "-U",
        ])
        .arg("6b7f4b8e-1c2d-4e5f-8a9b-0c1d2e3f4a5b")
        .arg("-d")
        .arg(tree)
        .arg(image)
        .arg(format!("{}k", SIZE >> 10))
        .status()
        .unwrap();
    assert!(st.success(), "mkfs.ext4 failed");
}

fn fsck(image: &Path) {
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "e2fsck -fn {}: {}\n{}",
        image.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn tree(root: &Path, seed: u64, files: usize) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for i in 0..files {
        let d = root.join(format!("d{}", i % 7));
        std::fs::create_dir_all(&d).unwrap();
        let mut data = vec![0u8; rng.usize(0..300_000)];
        rng.fill(&mut data);
        std::fs::write(d.join(format!("f{i}")), data).unwrap();
    }
}

/// Write the 1 MiB pieces of `image` that differ from `below` (all of them if none).
fn write_diff(dev: &Device, image: &[u8], below: Option<&[u8]>) -> usize {
    let mut written = 0;
    for (i, piece) in image.chunks(PIECE).enumerate() {
        let same = below.is_some_and(|b| &b[i * PIECE..i * PIECE + piece.len()] == piece);
        if !same {
            dev.write_at((i * PIECE) as u64, piece).unwrap();
            written += 1;
        }
    }
    dev.flush().unwrap();
    written
}

fn export(dev: &Device, path: &Path) -> Vec<u8> {
    let mut all = vec![0u8; dev.size() as usize];
    dev.read_at(0, &mut all).unwrap();
    std::fs::write(path, &all).unwrap();
    all
}

fn src(p: &Path) -> Arc<dyn LayerSource> {
    Arc::new(FileSource::open(p).unwrap())
}

#[test]
fn ext4_images_through_commit_and_stack() {
    if !tool("mkfs.ext4") || !tool("e2fsck") {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI needs mkfs.ext4 and e2fsck (e2fsprogs)"
        );
        println!("SKIPPED: ext4_images_through_commit_and_stack: mkfs.ext4/e2fsck not installed (apt-get install e2fsprogs)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Stage 1: a filesystem written into an empty device, committed as the base.
    tree(&d.join("tree1"), 1, 40);
    mkfs(&d.join("tree1"), &d.join("img1"));
    let img1 = std::fs::read(d.join("img1")).unwrap();
    let dev = Device::open(
        Vec::new(),
        Some(Upper::create(d.join("u1"), SIZE, LayerId::NONE).unwrap()),
    )
    .unwrap();
    write_diff(&dev, &img1, None);
    assert_eq!(export(&dev, &d.join("out1-upper")), img1);
    fsck(&d.join("out1-upper"));
    let l1 = dev.commit(d.join("l1.bd")).unwrap();
    drop(dev);
    let dev = Device::open(vec![src(&l1.path)], None).unwrap();
    assert_eq!(export(&dev, &d.join("out1")), img1);
    fsck(&d.join("out1"));

    // Stage 2: a changed filesystem, written as a diff into an upper on the base.
    tree(&d.join("tree2"), 2, 60);
    mkfs(&d.join("tree2"), &d.join("img2"));
    let img2 = std::fs::read(d.join("img2")).unwrap();
    let dev = Device::open(
        vec![src(&l1.path)],
        Some(Upper::create(d.join("u2"), SIZE, l1.id).unwrap()),
    )
    .unwrap();
    let pieces = write_diff(&dev, &img2, Some(&img1));
    assert!(
        pieces > 0 && pieces < SIZE as usize / PIECE,
        "{pieces} pieces differ"
    );
    assert_eq!(export(&dev, &d.join("out2-upper")), img2);
    fsck(&d.join("out2-upper"));
    let l2 = dev.commit(d.join("l2.bd")).unwrap();
    assert!(l2.data_bytes < l1.data_bytes + SIZE, "{l2:?}");
    drop(dev);
    let dev = Device::open(vec![src(&l1.path), src(&l2.path)], None).unwrap();
    assert_eq!(export(&dev, &d.join("out2")), img2);
    fsck(&d.join("out2"));
    // The base alone still reads as the first filesystem.
    let dev = Device::open(vec![src(&l1.path)], None).unwrap();
    assert_eq!(export(&dev, &d.join("out1b")), img1);
}
