//! The writable upper: torn log tails, damage before a flush, and kill -9 durability.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use overlaybd::upper::{LOG_HEADER_SIZE, RECORD_SIZE};
use overlaybd::{Error, LayerId, Upper};

const BLOCK: u64 = 4096;

fn block(i: u64, seed: u8) -> Vec<u8> {
    let mut b = vec![seed; BLOCK as usize];
    b[..8].copy_from_slice(&i.to_le_bytes());
    b
}

fn read(u: &Upper, off: u64) -> Vec<u8> {
    let dev = overlaybd::Device::open(Vec::new(), Some(Upper::open(u.dir()).unwrap())).unwrap();
    let mut b = vec![0u8; BLOCK as usize];
    dev.read_at(off, &mut b).unwrap();
    b
}

fn log_len(dir: &std::path::Path) -> u64 {
    std::fs::metadata(dir.join("log")).unwrap().len()
}

#[test]
fn torn_tails_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let u = Upper::create(dir.path(), 1 << 20, LayerId::NONE).unwrap();
    u.write_at(0, &block(0, 1)).unwrap();
    u.flush().unwrap();
    let flushed = log_len(dir.path());
    u.write_at(BLOCK, &block(1, 2)).unwrap();
    u.write_at(0, &block(2, 3)).unwrap();
    drop(u);
    let full = log_len(dir.path());
    assert_eq!(full, flushed + 2 * RECORD_SIZE as u64);

    // A partial last record: dropped, the earlier unflushed but complete record kept.
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("log"))
        .unwrap()
        .set_len(full - 5)
        .unwrap();
    let u = Upper::open(dir.path()).unwrap();
    assert_eq!(u.recovered().dropped_records, 1);
    assert_eq!(log_len(dir.path()), flushed + RECORD_SIZE as u64);
    assert_eq!(read(&u, 0), block(0, 1));
    assert_eq!(read(&u, BLOCK), block(1, 2));

    // An unflushed record whose data never reached the disk: dropped.
    u.write_at(0, &block(3, 4)).unwrap();
    let data_len = std::fs::metadata(dir.path().join("data")).unwrap().len();
    drop(u);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("data"))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0u8; 100], data_len - 100).unwrap();
    let u = Upper::open(dir.path()).unwrap();
    assert_eq!(u.recovered().dropped_records, 1);
    assert_eq!(read(&u, 0), block(0, 1));
    assert_eq!(read(&u, BLOCK), block(1, 2));
    // New writes after recovery land and survive a reopen.
    u.write_at(2 * BLOCK, &block(4, 5)).unwrap();
    u.flush().unwrap();
    drop(u);
    let u = Upper::open(dir.path()).unwrap();
    assert_eq!(u.recovered().dropped_records, 0);
    assert_eq!(read(&u, 2 * BLOCK), block(4, 5));

    // A record with a bad checksum at the tail: dropped; garbage after it too.
    u.write_at(0, &block(5, 6)).unwrap();
    drop(u);
    let len = log_len(dir.path());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("log"))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xff], len - 3).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[7u8; 100], len).unwrap();
    let u = Upper::open(dir.path()).unwrap();
    assert_eq!(u.recovered().dropped_records, 5); // the bad record, 3 whole garbage, 1 partial
    assert_eq!(read(&u, 0), block(0, 1));
}

#[test]
fn damage_before_a_flush_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let u = Upper::create(dir.path(), 1 << 20, LayerId::NONE).unwrap();
    u.write_at(0, &block(0, 1)).unwrap();
    u.write_at(BLOCK, &block(1, 1)).unwrap();
    u.flush().unwrap();
    drop(u);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("log"))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xEE], LOG_HEADER_SIZE as u64 + 2).unwrap();
    let err = Upper::open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    // A damaged header, too.
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xEE], 20).unwrap();
    assert!(matches!(
        Upper::open(dir.path()),
        Err(Error::Corrupt { .. })
    ));
    f.set_len(10).unwrap();
    assert!(matches!(
        Upper::open(dir.path()),
        Err(Error::Corrupt { .. })
    ));
}

#[test]
fn misaligned_upper_io_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let u = Upper::create(dir.path(), 1 << 20, LayerId::NONE).unwrap();
    assert!(matches!(
        u.write_at(1, &[0; 512]),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        u.write_at(0, &[0; 100]),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        u.discard(1 << 20, 512),
        Err(Error::OutOfRange { .. })
    ));
    assert!(Upper::create(dir.path().join("x"), 1000, LayerId::NONE).is_err());
}

const CHILD_ENV: &str = "OVERLAYBD_TEST_WRITER_DIR";
const SLOTS: u64 = 64;

/// The offset and content of write number `i` of the writer child.
fn write_no(i: u64) -> (u64, Vec<u8>) {
    ((i * 37) % SLOTS * BLOCK, block(i, (i % 251) as u8))
}

/// The child half of `kill_9_loses_no_flushed_write`: write forever, flushing every 7 writes
/// and printing the number of the last write each flush covers. Run only by that test.
#[test]
#[ignore = "run as a child process by kill_9_loses_no_flushed_write"]
fn writer_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        println!("writer_child: nothing to do outside kill_9_loses_no_flushed_write");
        return;
    };
    let u = Upper::open(&dir).unwrap();
    for i in 0.. {
        let (off, data) = write_no(i);
        u.write_at(off, &data).unwrap();
        if i % 7 == 6 {
            u.flush().unwrap();
            println!("flushed {i}");
        }
    }
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn kill_9_loses_no_flushed_write() {
    let dir = tempfile::tempdir().unwrap();
    drop(Upper::create(dir.path(), SLOTS * BLOCK, LayerId::NONE).unwrap());
    let mut child = KillOnDrop(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "writer_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let out = child.0.stdout.take().unwrap();
    let mut last = None;
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        if let Some(n) = line.strip_prefix("flushed ") {
            last = Some(n.parse::<u64>().unwrap());
            if last >= Some(2000) {
                break;
            }
        }
    }
    // SIGKILL while the child keeps writing.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let last = last.expect("the child flushed nothing");
    let u = Upper::open(dir.path()).unwrap();
    let dev = overlaybd::Device::open(Vec::new(), Some(u)).unwrap();
    // Each slot holds the last write to it that was flushed, or a later one: never older,
    // never torn.
    for slot in 0..SLOTS {
        let expected = (0..=last)
            .rev()
            .find(|&i| write_no(i).0 == slot * BLOCK)
            .unwrap();
        let mut b = vec![0u8; BLOCK as usize];
        dev.read_at(slot * BLOCK, &mut b).unwrap();
        let got = u64::from_le_bytes(b[..8].try_into().unwrap());
        assert!(
            got >= expected,
            "slot {slot}: write {got}, flushed {expected}"
        );
        assert_eq!(
            write_no(got),
            (slot * BLOCK, b),
            "slot {slot}: torn write {got}"
        );
    }
}
