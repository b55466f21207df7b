//! Stacks of sealed layers and an upper against a byte model.

mod common;

use std::sync::Arc;

use common::*;
use overlaybd::{Device, Error, LayerId, LayerSource, MemSource, SealedLayer, Upper};

fn stack_matches_model(depth: usize, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(seed);
    let size = 4 << 20;
    let (files, mut model) = build_stack(dir.path(), &mut rng, size, depth, 60);
    // Read-only stack.
    let dev = Device::open(open_files(&files), None).unwrap();
    check_device(&mut rng, &dev, &model);
    assert!(matches!(dev.write_at(0, &[0; 512]), Err(Error::ReadOnly)));
    // With an upper on top, then reopened from its directory.
    let udir = dir.path().join("top");
    let upper = Upper::create(&udir, size, top_id(&files)).unwrap();
    random_ops(&mut rng, &upper, &mut model, 60);
    let dev = Device::open(open_files(&files), Some(upper)).unwrap();
    check_device(&mut rng, &dev, &model);
    dev.flush().unwrap();
    drop(dev);
    let dev = Device::open(open_files(&files), Some(Upper::open(&udir).unwrap())).unwrap();
    check_device(&mut rng, &dev, &model);
    // Every layer's id is what its content hashes to.
    for l in dev.layers() {
        l.verify_id().unwrap();
    }
}

#[test]
fn one_layer() {
    stack_matches_model(1, 1);
}

#[test]
fn five_layers() {
    stack_matches_model(5, 5);
}

#[test]
fn twenty_layers() {
    stack_matches_model(20, 20);
}

#[test]
fn device_writes_unaligned_and_discards() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(99);
    let size = 1 << 20;
    let (files, mut model) = build_stack(dir.path(), &mut rng, size, 2, 40);
    let upper = Upper::create(dir.path().join("u"), size, top_id(&files)).unwrap();
    let dev = Device::open(open_files(&files), Some(upper)).unwrap();
    for _ in 0..300 {
        let off = rng.u64(0..size);
        let len = rng.u64(0..=(size - off).min(5000));
        if rng.u8(0..4) == 0 {
            dev.discard(off, len).unwrap();
            model[off as usize..(off + len) as usize].fill(0);
        } else {
            let mut data = vec![0u8; len as usize];
            rng.fill(&mut data);
            dev.write_at(off, &data).unwrap();
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
        }
    }
    check_device(&mut rng, &dev, &model);
    // Out of range is an error, not a short read.
    let mut buf = [0u8; 1024];
    assert!(matches!(
        dev.read_at(size - 512, &mut buf),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        dev.write_at(u64::MAX - 10, &buf),
        Err(Error::OutOfRange { .. })
    ));
}

#[test]
fn commit_compacts_and_stacks() {
    let dir = tempfile::tempdir().unwrap();
    let size = 1 << 20;
    let upper = Upper::create(dir.path().join("u"), size, LayerId::NONE).unwrap();
    // The same 64 KiB overwritten 50 times: only the last version is sealed.
    for i in 0..50u8 {
        upper.write_at(0, &vec![i + 1; 64 << 10]).unwrap();
    }
    upper.discard(8192, 4096).unwrap();
    let info = upper.seal(dir.path().join("l0")).unwrap();
    assert_eq!(info.data_bytes, (64 << 10) - 4096);
    assert_eq!(info.extent_count, 2, "{info:?}");
    let dev = Device::open(open_files(std::slice::from_ref(&info.path)), None).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    dev.read_at(0, &mut buf).unwrap();
    assert!(buf[..8192].iter().all(|&b| b == 50));
    assert!(buf[8192..12288].iter().all(|&b| b == 0));
    assert!(buf[12288..].iter().all(|&b| b == 50));
    // Sealing is deterministic: the same content on the same parent gives the same id/bytes.
    let again = upper.seal(dir.path().join("l0b")).unwrap();
    assert_eq!(again.id, info.id);
    assert_eq!(
        std::fs::read(&info.path).unwrap(),
        std::fs::read(&again.path).unwrap()
    );
    // A discard on a layer with a parent hides the bytes below.
    let up2 = Upper::create(dir.path().join("u2"), size, info.id).unwrap();
    up2.discard(0, 4096).unwrap();
    let l1 = up2.seal(dir.path().join("l1")).unwrap();
    let dev = Device::open(open_files(&[info.path.clone(), l1.path.clone()]), None).unwrap();
    dev.read_at(0, &mut buf).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0));
    assert!(buf[4096..8192].iter().all(|&b| b == 50));
}

#[test]
fn parent_mismatch_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(3);
    let (a, _) = build_stack(&dir.path().join("a"), &mut rng, 1 << 20, 2, 10);
    let (b, _) = build_stack(&dir.path().join("b"), &mut rng, 1 << 20, 2, 10);
    // b's second layer on a's first: refused.
    let mixed = vec![a[0].clone(), b[1].clone()];
    let err = Device::open(open_files(&mixed), None).unwrap_err();
    assert!(matches!(err, Error::ParentMismatch { .. }), "{err}");
    // A layer with a parent as the base: refused.
    let err = Device::open(open_files(&a[1..]), None).unwrap_err();
    assert!(matches!(err, Error::ParentMismatch { .. }), "{err}");
    // An upper made on a's top opened over b: refused.
    let upper = Upper::create(dir.path().join("u"), 1 << 20, top_id(&a)).unwrap();
    let err = Device::open(open_files(&b), Some(upper)).unwrap_err();
    assert!(matches!(err, Error::ParentMismatch { .. }), "{err}");
}

#[test]
fn single_layer_reads_and_memory_source() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    let (files, model) = build_stack(dir.path(), &mut rng, 1 << 20, 1, 30);
    let bytes = std::fs::read(&files[0]).unwrap();
    let layer = SealedLayer::open(Arc::new(MemSource::new(bytes))).unwrap();
    let mut all = vec![0u8; model.len()];
    layer.read_at(0, &mut all).unwrap();
    assert_eq!(all, model);
    // Extents are sorted and disjoint.
    for w in layer.extents().windows(2) {
        assert!(w[0].device_end() <= w[1].device_offset);
    }
    let src: Arc<dyn LayerSource> = Arc::new(MemSource::new(std::fs::read(&files[0]).unwrap()));
    let dev = Device::open(vec![src], None).unwrap();
    check_device(&mut rng, &dev, &model);
}

#[test]
fn empty_stack_and_upper_only() {
    let dev = Device::open(Vec::new(), None).unwrap();
    assert_eq!(dev.size(), 0);
    let dir = tempfile::tempdir().unwrap();
    let upper = Upper::create(dir.path(), 1 << 20, LayerId::NONE).unwrap();
    assert!(matches!(
        Upper::create(dir.path(), 1 << 20, LayerId::NONE),
        Err(Error::AlreadyExists(_))
    ));
    let dev = Device::open(Vec::new(), Some(upper)).unwrap();
    let mut buf = vec![1u8; 4096];
    dev.read_at(4096, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
}

#[test]
fn concurrent_writers_and_readers() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(8);
    let size = 2 << 20;
    let (files, mut model) = build_stack(dir.path(), &mut rng, size, 3, 40);
    let upper = Upper::create(dir.path().join("u"), size, top_id(&files)).unwrap();
    let dev = Arc::new(Device::open(open_files(&files), Some(upper)).unwrap());
    let threads = 4u64;
    let region = size / threads;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let dev = dev.clone();
            let base = model[(t * region) as usize..((t + 1) * region) as usize].to_vec();
            std::thread::spawn(move || {
                // Each thread owns one region: writes in it, and reads it back against its own
                // copy, while the others do the same next door.
                let mut rng = fastrand::Rng::with_seed(100 + t);
                let mut mine = base;
                for _ in 0..200 {
                    let off = rng.u64(0..region / 512) * 512;
                    let len = (rng.u64(1..=16) * 512).min(region - off);
                    let mut data = vec![0u8; len as usize];
                    rng.fill(&mut data);
                    dev.write_at(t * region + off, &data).unwrap();
                    mine[off as usize..(off + len) as usize].copy_from_slice(&data);
                    let mut back = vec![0u8; len as usize];
                    dev.read_at(t * region + off, &mut back).unwrap();
                    assert_eq!(back, data);
                }
                mine
            })
        })
        .collect();
    for (t, h) in handles.into_iter().enumerate() {
        let mine = h.join().unwrap();
        let r = t as u64 * region;
        model[r as usize..(r + region) as usize].copy_from_slice(&mine);
    }
    check_device(&mut rng, &dev, &model);
}
