//! Fuzz the sealed-layer parser of `overlaybd`: arbitrary bytes must give a layer or an error,
//! never a panic or an allocation larger than the input; what parses must read consistently
//! (every mapped byte comes from where its extent says, everything else reads zeros), alone
//! and as a one-layer device.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use overlaybd::format::TRAILER_SIZE;
use overlaybd::{Device, LayerSource, MemSource, SealedLayer};

fuzz_target!(|data: &[u8]| {
    check(data);
    // Reseal the checksum so that mutations reach the checks behind it.
    if data.len() >= TRAILER_SIZE {
        let t = data.len() - TRAILER_SIZE;
        let io = u64::from_le_bytes(data[t + 16..t + 24].try_into().unwrap_or([0; 8]));
        if io <= t as u64 {
            let mut sealed = data.to_vec();
            let n = sealed.len();
            let crc = crc32c(&sealed[io as usize..n - 4]);
            sealed[n - 4..].copy_from_slice(&crc.to_le_bytes());
            check(&sealed);
        }
    }
});

/// crc32c (Castagnoli), bitwise: the fuzz crate keeps its dependencies minimal.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn check(data: &[u8]) {
    let src: Arc<dyn LayerSource> = Arc::new(MemSource::new(data.to_vec()));
    let Ok(layer) = SealedLayer::open(src.clone()) else {
        return;
    };
    let size = layer.device_size();
    // Read a window of the device (bounded) and compare with the index.
    let window = size.min(256 << 10);
    let mut buf = vec![0xAAu8; window as usize];
    layer.read_at(0, &mut buf).expect("a parsed layer reads");
    let mut expect = vec![0u8; window as usize];
    for e in layer.extents() {
        assert!(e.device_end() <= size);
        if e.device_offset >= window {
            break;
        }
        if let Some(foff) = e.file_offset {
            let end = e.device_end().min(window);
            let n = (end - e.device_offset) as usize;
            let at = foff as usize;
            expect[e.device_offset as usize..end as usize].copy_from_slice(&data[at..at + n]);
        }
    }
    assert_eq!(buf, expect);
    // Reads past the end are errors.
    let mut one = [0u8; 1];
    assert!(layer.read_at(size, &mut one).is_err());
    // The same through a device (a base layer; one with a parent is refused); odd offsets too.
    match Device::open(vec![src], None) {
        Ok(dev) => {
            assert!(layer.parent_id().is_none());
            let off = (window / 3 + 1).min(window);
            let mut b2 = vec![0u8; (window - off) as usize];
            dev.read_at(off, &mut b2).expect("device read");
            assert_eq!(b2, expect[off as usize..]);
        }
        Err(_) => assert!(!layer.parent_id().is_none()),
    }
}
