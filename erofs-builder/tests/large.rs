//! Large files: a sparse file over 4 GiB (extended inode, 64-bit size) and peak memory that
//! does not grow with the data size, for full images and for layers. Mounting needs root
//! (SKIPPED otherwise).

mod common;

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;

use erofs_builder::{build_image, BuildOptions, Image};

/// VmHWM is per process: the memory tests in this binary run one at a time, and each resets
/// the peak before it measures (else a later test would be measured against an earlier
/// test's peak, and could grow by that much unseen).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A `/proc/self/status` field in KiB (`VmHWM:`, `VmRSS:`).
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn vm_hwm_kib() -> u64 {
    status_kib("VmHWM:")
}

/// Reset this process's peak RSS to its current RSS (writing "5" to `/proc/self/clear_refs`,
/// Linux 4.0 and later) and return the new peak; fails if the peak was not reset.
fn reset_peak_kib() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak RSS (clear_refs)");
    let hwm = vm_hwm_kib();
    let rss = status_kib("VmRSS:");
    assert!(
        hwm <= rss + 1024,
        "peak RSS not reset: VmHWM {hwm} KiB, VmRSS {rss} KiB"
    );
    hwm
}

#[test]
fn sparse_5gib_file_and_64mib_of_data_with_bounded_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let big = 5u64 << 30;
    let marks = [
        (100u64 << 20, 1u64),
        ((9u64 << 29) + 12_345, 2),
        (big - 3, 3),
    ];
    {
        let f = File::create(src.join("sparse5g")).unwrap();
        f.set_len(big).unwrap();
        for (off, seed) in marks {
            let data = common::bytes(seed, 3);
            f.write_all_at(&data, off).unwrap();
        }
    }
    {
        let mut f = File::create(src.join("dense64m")).unwrap();
        for i in 0..64 {
            f.write_all(&common::bytes(100 + i, 1 << 20)).unwrap();
        }
    }
    let image = dir.path().join("large.erofs");
    let before = reset_peak_kib();
    let stats = build_image(&src, &image, &BuildOptions::default()).unwrap();
    let growth = vm_hwm_kib().saturating_sub(before);
    eprintln!("{stats:?}; peak RSS growth {growth} KiB");
    assert!(
        growth < 32 * 1024,
        "peak RSS grew by {growth} KiB while building"
    );
    // The image is sparse where the source was.
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(&image).unwrap();
    assert!(
        m.blocks() * 512 < 200 << 20,
        "image allocates {} bytes",
        m.blocks() * 512
    );

    let img = Image::open(&image).unwrap();
    let ino = img.lookup("sparse5g").unwrap();
    assert!(ino.extended);
    assert_eq!(ino.size, big);
    for (off, seed) in marks {
        let mut buf = [0u8; 3];
        assert_eq!(img.read_at_inode(&ino, off, &mut buf).unwrap(), 3);
        assert_eq!(buf.to_vec(), common::bytes(seed, 3));
    }
    let dense = img.lookup("dense64m").unwrap();
    let mut buf = vec![0u8; 1 << 20];
    img.read_at_inode(&dense, 63 << 20, &mut buf).unwrap();
    assert_eq!(buf, common::bytes(163, 1 << 20));

    if !common::require_root("sparse_5gib_file (kernel mount part)") {
        return;
    }
    let mnt = tempfile::tempdir().unwrap();
    rustix::mount::mount(
        &image,
        mnt.path(),
        "erofs",
        rustix::mount::MountFlags::RDONLY,
        None,
    )
    .unwrap();
    struct Guard<'a>(&'a std::path::Path);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }
    let _g = Guard(mnt.path());
    let f = File::open(mnt.path().join("sparse5g")).unwrap();
    assert_eq!(f.metadata().unwrap().len(), big);
    for (off, seed) in marks {
        let mut buf = [0u8; 3];
        f.read_exact_at(&mut buf, off).unwrap();
        assert_eq!(buf.to_vec(), common::bytes(seed, 3));
    }
    let mut zero = [1u8; 4096];
    f.read_exact_at(&mut zero, 4 << 30).unwrap();
    assert!(zero.iter().all(|&b| b == 0));
    let d = File::open(mnt.path().join("dense64m")).unwrap();
    d.read_exact_at(&mut buf, 63 << 20).unwrap();
    assert_eq!(buf, common::bytes(163, 1 << 20));
}

#[test]
fn layer_build_memory_does_not_grow_with_data() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    {
        let mut f = File::create(src.join("dense64m")).unwrap();
        for i in 0..64 {
            f.write_all(&common::bytes(100 + i, 1 << 20)).unwrap();
        }
        let s = File::create(src.join("sparse5g")).unwrap();
        s.set_len(5u64 << 30).unwrap();
        s.write_all_at(b"EROF", (3u64 << 30) + 5).unwrap();
    }
    let (meta, blob) = (dir.path().join("meta"), dir.path().join("blob"));
    let before = reset_peak_kib();
    let s = erofs_builder::build_layer(&src, &meta, &blob, &erofs_builder::LayerOptions::default())
        .unwrap();
    let growth = vm_hwm_kib().saturating_sub(before);
    eprintln!("{s:?}; peak RSS growth {growth} KiB");
    assert!(growth < 32 * 1024, "peak RSS grew by {growth} KiB");
    assert_eq!(s.blob_bytes, (64 << 20) + erofs_builder::layer::CHUNK_SIZE);
    let img = Image::open_with_devices(&meta, &[&blob]).unwrap();
    let ino = img.lookup("sparse5g").unwrap();
    let mut mark = [0u8; 4];
    img.read_at_inode(&ino, (3u64 << 30) + 5, &mut mark)
        .unwrap();
    assert_eq!(&mark, b"EROF");
}
