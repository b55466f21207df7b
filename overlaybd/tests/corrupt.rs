//! Bad sealed layers: a clear error at open, never a panic, a wrong read, or a huge allocation.

mod common;

use std::sync::Arc;

use common::*;
use overlaybd::format::{EXTENT_SIZE, TRAILER_SIZE};
use overlaybd::{Error, MemSource, SealedLayer};

/// A small valid layer with several extents (data and zero).
fn sample() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(42);
    let (files, _) = build_stack(dir.path(), &mut rng, 256 << 10, 2, 12);
    std::fs::read(&files[1]).unwrap()
}

fn open(bytes: &[u8]) -> Result<SealedLayer, Error> {
    SealedLayer::open(Arc::new(MemSource::new(bytes.to_vec())))
}

/// Recompute the crc32c over index + trailer, so edits reach the checks behind it.
/// The index is taken to start where the trailer says, or at `fallback` when that is outside.
fn reseal_at(b: &mut [u8], fallback: usize) {
    let n = b.len();
    let t = n - TRAILER_SIZE;
    let stated = u64::from_le_bytes(b[t + 16..t + 24].try_into().unwrap());
    let index_offset = if stated <= t as u64 {
        stated as usize
    } else {
        fallback
    };
    let crc = crc32c::crc32c(&b[index_offset..n - 4]);
    b[n - 4..].copy_from_slice(&crc.to_le_bytes());
}

fn reseal(b: &mut [u8]) {
    reseal_at(b, b.len() - TRAILER_SIZE);
}

fn index_offset(b: &[u8]) -> usize {
    let t = b.len() - TRAILER_SIZE;
    u64::from_le_bytes(b[t + 16..t + 24].try_into().unwrap()) as usize
}

fn corrupt_reason(b: &[u8]) -> String {
    match open(b) {
        Err(Error::Corrupt { reason, .. }) => reason,
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn sample_is_valid() {
    let b = sample();
    let l = open(&b).unwrap();
    assert!(l.extents().len() >= 3);
    l.verify_id().unwrap();
}

#[test]
fn truncated_layers_are_refused() {
    let b = sample();
    for cut in [0, 1, 64, 127, 128, b.len() / 2, b.len() - 1] {
        let r = open(&b[..cut]);
        assert!(matches!(r, Err(Error::Corrupt { .. })), "cut {cut}: {r:?}");
    }
    // Extra bytes at the end move the trailer: refused too.
    let mut longer = b.clone();
    longer.extend_from_slice(&[0; 512]);
    assert!(open(&longer).is_err());
}

#[test]
fn checksum_catches_index_and_trailer_damage() {
    let b = sample();
    let start = index_offset(&b);
    for i in start..b.len() {
        let mut c = b.clone();
        c[i] ^= 0x10;
        assert!(open(&c).is_err(), "flip at {i} accepted");
    }
}

#[test]
fn trailer_pointing_outside_is_refused() {
    let b = sample();
    let t = b.len() - TRAILER_SIZE;
    for (field, value) in [
        (16, u64::MAX - 100),    // index offset
        (16, b.len() as u64),    // index offset at the end
        (24, u64::MAX / 24 + 1), // extent count overflowing
        (24, 1 << 40),           // an enormous index
        (32, 3),                 // device size unaligned
        (32, 1 << 62),           // device size too large
    ] {
        let mut c = b.clone();
        c[t + field..t + field + 8].copy_from_slice(&value.to_le_bytes());
        reseal_at(&mut c, index_offset(&b));
        let r = open(&c);
        assert!(
            matches!(r, Err(Error::Corrupt { .. })),
            "{field}={value}: {r:?}"
        );
    }
    let mut c = b.clone();
    c[t] = b'X';
    reseal(&mut c);
    assert!(corrupt_reason(&c).contains("magic"));
    let mut c = b.clone();
    c[t + 8] = 2;
    reseal(&mut c);
    assert!(matches!(open(&c), Err(Error::Unsupported { .. })));
    let mut c = b.clone();
    c[t + 12] = 1; // the reserved compression flag
    reseal(&mut c);
    assert!(matches!(open(&c), Err(Error::Unsupported { .. })));
}

type Edit<'a> = Box<dyn Fn(&mut Vec<u8>) + 'a>;

#[test]
fn bad_extents_are_refused() {
    let b = sample();
    let idx = index_offset(&b);
    let ext = |c: &mut Vec<u8>, i: usize, field: usize, value: &[u8]| {
        let at = idx + i * EXTENT_SIZE + field;
        c[at..at + value.len()].copy_from_slice(value);
        reseal(c);
    };
    let dev0 = u64::from_le_bytes(b[idx..idx + 8].try_into().unwrap());
    let dev1 = u64::from_le_bytes(b[idx + 24..idx + 32].try_into().unwrap());
    let cases: Vec<(&str, Edit)> = vec![
        (
            "unsorted",
            Box::new(|c| ext(c, 1, 0, &dev0.saturating_sub(512).to_le_bytes())),
        ),
        (
            "overlapping",
            Box::new(move |c| ext(c, 0, 16, &((dev1 - dev0 + 512) as u32).to_le_bytes())),
        ),
        (
            "zero length",
            Box::new(|c| ext(c, 0, 16, &0u32.to_le_bytes())),
        ),
        (
            "unaligned length",
            Box::new(|c| ext(c, 0, 16, &100u32.to_le_bytes())),
        ),
        (
            "unaligned offset",
            Box::new(|c| ext(c, 0, 0, &(dev0 + 1).to_le_bytes())),
        ),
        (
            "past the device",
            Box::new(|c| ext(c, 0, 0, &(1u64 << 40).to_le_bytes())),
        ),
        (
            "data outside",
            Box::new(|c| ext(c, 0, 8, &(1u64 << 40).to_le_bytes())),
        ),
        (
            "unknown flag",
            Box::new(|c| ext(c, 0, 20, &4u32.to_le_bytes())),
        ),
    ];
    for (name, edit) in cases {
        let mut c = b.clone();
        edit(&mut c);
        let r = open(&c);
        assert!(matches!(r, Err(Error::Corrupt { .. })), "{name}: {r:?}");
    }
}

#[test]
fn data_damage_is_caught_by_verify_id() {
    let b = sample();
    let mut c = b.clone();
    c[10] ^= 1;
    let l = open(&c).unwrap(); // the index is intact: open does not read data
    assert!(matches!(l.verify_id(), Err(Error::Corrupt { .. })));
}

/// Random mutations (resealed half the time): open and reads never panic.
#[test]
fn random_mutations_never_panic() {
    let b = sample();
    let mut rng = fastrand::Rng::with_seed(1234);
    let mut accepted = 0;
    for _ in 0..3000 {
        let mut c = b.clone();
        for _ in 0..rng.usize(1..4) {
            let i = if rng.bool() {
                rng.usize(index_offset(&b).min(c.len() - 1)..c.len())
            } else {
                rng.usize(0..c.len())
            };
            c[i] = rng.u8(..);
        }
        if rng.u8(0..4) == 0 {
            c.truncate(rng.usize(0..c.len()));
        }
        if c.len() >= TRAILER_SIZE && rng.bool() {
            reseal(&mut c);
        }
        if let Ok(l) = open(&c) {
            accepted += 1;
            let mut buf = vec![0u8; l.device_size().min(1 << 20) as usize];
            l.read_at(0, &mut buf).unwrap();
        }
    }
    assert!(accepted > 0, "no mutation reached the reads");
}
