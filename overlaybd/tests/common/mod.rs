//! Shared helpers of the overlaybd tests: a byte model of a device and random I/O on it.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use overlaybd::{Device, FileSource, LayerId, LayerSource, SealedLayer, Upper};

pub const S: u64 = 512;

/// Random aligned writes and discards applied to both `upper` and `model`.
pub fn random_ops(rng: &mut fastrand::Rng, upper: &Upper, model: &mut [u8], ops: usize) {
    let size = model.len() as u64;
    for _ in 0..ops {
        let sectors = size / S;
        let start = rng.u64(0..sectors);
        let max = if rng.bool() { 8 } else { 160 };
        let len = rng.u64(1..=(sectors - start).min(max));
        let (off, len) = (start * S, len * S);
        if rng.u8(0..8) == 0 {
            upper.discard(off, len).unwrap();
            model[off as usize..(off + len) as usize].fill(0);
        } else {
            let mut data = vec![0u8; len as usize];
            if rng.u8(0..10) != 0 {
                rng.fill(&mut data);
            } // else: an all-zero write, which sealing stores as a zero extent
            upper.write_at(off, &data).unwrap();
            model[off as usize..(off + len) as usize].copy_from_slice(&data);
        }
    }
}

/// Compare the whole device and some random (unaligned) ranges with the model.
pub fn check_device(rng: &mut fastrand::Rng, dev: &Device, model: &[u8]) {
    assert_eq!(dev.size(), model.len() as u64);
    let mut all = vec![0u8; model.len()];
    dev.read_at(0, &mut all).unwrap();
    if all != model {
        let first = all.iter().zip(model).position(|(a, b)| a != b).unwrap();
        panic!("device differs from the model at byte {first}");
    }
    for _ in 0..200 {
        let off = rng.u64(0..model.len() as u64);
        let len = rng.u64(0..=(model.len() as u64 - off).min(20_000));
        let mut buf = vec![0xAAu8; len as usize];
        dev.read_at(off, &mut buf).unwrap();
        assert_eq!(
            buf,
            model[off as usize..(off + len) as usize],
            "read {off}+{len}"
        );
    }
}

/// Build a stack of `depth` sealed layers in `dir` by random ops, checking the device after
/// each commit; returns the layer files (base first) and the final model.
pub fn build_stack(
    dir: &Path,
    rng: &mut fastrand::Rng,
    size: u64,
    depth: usize,
    ops: usize,
) -> (Vec<std::path::PathBuf>, Vec<u8>) {
    let mut model = vec![0u8; size as usize];
    let mut files = Vec::new();
    let mut parent = LayerId::NONE;
    for i in 0..depth {
        let upper = Upper::create(dir.join(format!("upper{i}")), size, parent).unwrap();
        random_ops(rng, &upper, &mut model, ops);
        let path = dir.join(format!("layer{i}.bd"));
        let info = upper.seal(&path).unwrap();
        assert_eq!(info.parent, parent);
        parent = info.id;
        files.push(path);
    }
    (files, model)
}

pub fn open_files(files: &[std::path::PathBuf]) -> Vec<Arc<dyn LayerSource>> {
    files
        .iter()
        .map(|p| Arc::new(FileSource::open(p).unwrap()) as Arc<dyn LayerSource>)
        .collect()
}

pub fn top_id(files: &[std::path::PathBuf]) -> LayerId {
    files.last().map_or(LayerId::NONE, |p| {
        SealedLayer::open(Arc::new(FileSource::open(p).unwrap()))
            .unwrap()
            .id()
    })
}
