//! Fuzz the OverlayBD upper's log replay (`overlaybd::Upper::open`): an upper directory whose
//! `log` and `data` files come from the input is opened. Replay must never panic, and what it
//! keeps must be exactly the log it leaves: every byte of the device reads as an independent
//! replay of the kept records says (newest wins, zeros elsewhere), a second open drops
//! nothing and reads the same, and a write flushed after recovery survives a reopen.
//!
//! Input: `[flags][data length: u16 LE][data][log]`. Flag bits reseal what the mutator
//! cannot get right by chance: 1 the header (magic, version, checksum), 2 every record's
//! checksum, 4 the data checksum of writes, 8 a small aligned device size, 16 no parent.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use overlaybd::upper::{LOG_HEADER_SIZE, RECORD_SIZE, UPPER_MAGIC, UPPER_VERSION};
use overlaybd::{Device, Upper};

/// One scratch directory per fuzzing process; each run removes its files.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("strata-fuzz-upper-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("create the scratch directory");
        d
    })
}

const WINDOW: u64 = 256 << 10;

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

/// Shape the raw log as the flags ask.
fn reseal(flags: u8, data: &[u8], mut log: Vec<u8>) -> Vec<u8> {
    if log.len() >= LOG_HEADER_SIZE {
        if flags & 8 != 0 {
            let size = (le64(&log[16..24]) % (4 << 20)) & !511;
            log[16..24].copy_from_slice(&size.to_le_bytes());
        }
        if flags & 16 != 0 {
            log[24..56].fill(0);
        }
        if flags & 1 != 0 {
            log[..8].copy_from_slice(&UPPER_MAGIC);
            log[8..12].copy_from_slice(&UPPER_VERSION.to_le_bytes());
            let crc = crc32c::crc32c(&log[..LOG_HEADER_SIZE - 4]);
            log[LOG_HEADER_SIZE - 4..LOG_HEADER_SIZE].copy_from_slice(&crc.to_le_bytes());
        }
    }
    if log.len() > LOG_HEADER_SIZE {
        for r in log[LOG_HEADER_SIZE..].chunks_exact_mut(RECORD_SIZE) {
            if flags & 4 != 0 && le32(&r[20..]) == 1 {
                let (off, len) = (le64(&r[8..]), u64::from(le32(&r[16..])));
                if let Some(bytes) = off
                    .checked_add(len)
                    .and_then(|end| data.get(off as usize..end as usize))
                {
                    r[24..28].copy_from_slice(&crc32c::crc32c(bytes).to_le_bytes());
                }
            }
            if flags & 2 != 0 {
                let crc = crc32c::crc32c(&r[..RECORD_SIZE - 4]);
                r[RECORD_SIZE - 4..].copy_from_slice(&crc.to_le_bytes());
            }
        }
    }
    log
}

/// The first `WINDOW` bytes of the device, replayed from the log's records independently of
/// the upper's own code.
fn model(log: &[u8], data: &[u8], device_size: u64) -> Vec<u8> {
    let mut dev = vec![0u8; device_size.min(WINDOW) as usize];
    for r in log[LOG_HEADER_SIZE..].chunks_exact(RECORD_SIZE) {
        let (off, doff, len, kind) = (le64(r), le64(&r[8..]), le32(&r[16..]), le32(&r[20..]));
        let start = off.min(dev.len() as u64) as usize;
        // A barrier's offset and length mean nothing (the upper keeps any): no overflow here.
        let end = off.saturating_add(u64::from(len)).min(dev.len() as u64) as usize;
        match kind {
            1 => {
                let from = doff as usize;
                dev[start..end].copy_from_slice(&data[from..from + (end - start)]);
            }
            2 => dev[start..end].fill(0),
            _ => {}
        }
    }
    dev
}

fn read(dev: &Device) -> Vec<u8> {
    let mut buf = vec![0xA5u8; dev.size().min(WINDOW) as usize];
    dev.read_at(0, &mut buf).expect("a recovered upper reads");
    buf
}

fuzz_target!(|input: &[u8]| {
    let Some((&flags, rest)) = input.split_first() else {
        return;
    };
    let n = rest
        .get(..2)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]])) as usize;
    let rest = rest.get(2..).unwrap_or(&[]);
    let (data, log) = rest.split_at(n.min(rest.len()));
    let log = reseal(flags, data, log.to_vec());
    let d = dir();
    std::fs::write(d.join("data"), data).expect("write data");
    std::fs::write(d.join("log"), &log).expect("write log");
    check(d, data, log.len() as u64);
    let _ = std::fs::remove_file(d.join("data"));
    let _ = std::fs::remove_file(d.join("log"));
});

fn check(d: &std::path::Path, data: &[u8], log_len: u64) {
    let Ok(upper) = Upper::open(d) else {
        return;
    };
    let kept = std::fs::read(d.join("log")).expect("read the kept log");
    let rec = upper.recovered();
    assert_eq!(kept.len() as u64 + rec.dropped_log_bytes, log_len);
    assert_eq!(
        (kept.len() - LOG_HEADER_SIZE) % RECORD_SIZE,
        0,
        "a partial record kept"
    );
    let size = upper.device_size();
    assert_eq!(size % 512, 0);
    let expect = model(&kept, data, size);
    let parent = upper.parent_id();
    // A device over nothing: its upper must sit on nothing too.
    let Ok(dev) = Device::open(Vec::new(), Some(upper)) else {
        assert!(!parent.is_none(), "an upper on no layer was refused");
        return;
    };
    assert!(read(&dev) == expect, "replay differs from the kept log");
    drop(dev);
    // Recovery is idempotent.
    let again = Upper::open(d).expect("a recovered upper opens again");
    assert_eq!(
        again.recovered(),
        Default::default(),
        "a second open dropped records"
    );
    let dev = Device::open(Vec::new(), Some(again)).expect("opens again");
    assert!(read(&dev) == expect, "a second replay differs");
    // A write flushed now survives a reopen.
    if size >= 1024 {
        let sector: Vec<u8> = (0..512u32).map(|i| (i * 7 + 3) as u8).collect();
        dev.write_at(512, &sector).expect("write after recovery");
        dev.flush().expect("flush after recovery");
        drop(dev);
        let dev = Device::open(Vec::new(), Some(Upper::open(d).expect("reopen"))).expect("open");
        let mut back = vec![0u8; 512];
        dev.read_at(512, &mut back).expect("read back");
        assert_eq!(back, sector, "a flushed write was lost");
    }
}
