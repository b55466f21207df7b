//! Freeze the sealed-layer format: a layer encoded from `docs/format.md` by an independent
//! encoder (a short Python script, `fixtures/spec_v1.bd`) parses and reads as specified, and
//! the writer's output for fixed content is byte-identical to `fixtures/golden_*.bd`.
//! `OVERLAYBD_BLESS=1` rewrites the golden files (only after a deliberate format change).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use overlaybd::{Device, FileSource, LayerId, LayerSource, SealedLayer, Upper};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[test]
fn independently_encoded_layer_reads_as_specified() {
    // spec_v1.bd: extents (0, 512, data at 0), (4096, 1024, data at 512), (8192, 512, zero);
    // device 64 KiB; no parent.
    let bytes = std::fs::read(fixture("spec_v1.bd")).unwrap();
    let layer =
        SealedLayer::open(Arc::new(FileSource::open(fixture("spec_v1.bd")).unwrap())).unwrap();
    assert_eq!(layer.device_size(), 65536);
    assert!(layer.parent_id().is_none());
    let e = layer.extents();
    assert_eq!(e.len(), 3);
    assert_eq!(
        (e[0].device_offset, e[0].length, e[0].file_offset),
        (0, 512, Some(0))
    );
    assert_eq!(
        (e[1].device_offset, e[1].length, e[1].file_offset),
        (4096, 1024, Some(512))
    );
    assert_eq!(
        (e[2].device_offset, e[2].length, e[2].file_offset),
        (8192, 512, None)
    );
    let mut dev = vec![0xEEu8; 65536];
    layer.read_at(0, &mut dev).unwrap();
    let mut expect = vec![0u8; 65536];
    expect[..512].copy_from_slice(&bytes[..512]);
    expect[4096..5120].copy_from_slice(&bytes[512..1536]);
    assert_eq!(dev, expect);
}

fn seal_fixed(dir: &Path) -> (PathBuf, PathBuf) {
    let size = 2 << 20;
    let base = Upper::create(dir.join("u0"), size, LayerId::NONE).unwrap();
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    base.write_at(0, &pattern).unwrap();
    base.write_at(1 << 20, &[0xAB; 4096]).unwrap();
    base.write_at(64 << 10, &[0; 4096]).unwrap(); // all zeros, no parent: not stored
    base.discard(12288, 512).unwrap(); // no parent: dropped
    let l0 = base.seal(dir.join("golden_base.bd")).unwrap();
    let child = Upper::create(dir.join("u1"), size, l0.id).unwrap();
    child.write_at(512, &[0x5A; 512]).unwrap();
    child.discard(4096, 4096).unwrap();
    child.write_at(64 << 10, &[0; 8192]).unwrap(); // all zeros on a parent: a zero extent
    let l1 = child.seal(dir.join("golden_child.bd")).unwrap();
    (l0.path, l1.path)
}

#[test]
fn writer_output_is_frozen() {
    let dir = tempfile::tempdir().unwrap();
    let (base, child) = seal_fixed(dir.path());
    for (made, name) in [(&base, "golden_base.bd"), (&child, "golden_child.bd")] {
        let made = std::fs::read(made).unwrap();
        if std::env::var_os("OVERLAYBD_BLESS").is_some() {
            std::fs::write(fixture(name), &made).unwrap();
        }
        let golden = std::fs::read(fixture(name)).unwrap();
        assert!(
            made == golden,
            "{name}: the writer's output changed (format change? see docs/format.md)"
        );
    }
    let srcs: Vec<Arc<dyn LayerSource>> = [fixture("golden_base.bd"), fixture("golden_child.bd")]
        .iter()
        .map(|p| Arc::new(FileSource::open(p).unwrap()) as Arc<dyn LayerSource>)
        .collect();
    let dev = Device::open(srcs, None).unwrap();
    for l in dev.layers() {
        l.verify_id().unwrap();
    }
    assert_eq!(dev.layers()[0].extents().len(), 2);
    assert_eq!(dev.layers()[1].extents().len(), 3);
    let mut buf = vec![0u8; 8192];
    dev.read_at(0, &mut buf).unwrap();
    assert!(buf[512..1024].iter().all(|&b| b == 0x5A));
    assert!(buf[4096..].iter().all(|&b| b == 0));
    assert_eq!(buf[1024], (1024u32 * 7 % 251) as u8);
}
