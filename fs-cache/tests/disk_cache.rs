//! Level 2 of the chunk cache on real files: restarts, bounded usage, `kill -9` mid-fill,
//! corruption behind the cache's back, and a full disk (a small tmpfs; needs root).

#[path = "common/damage.rs"]
mod damage;
use damage::flip;

#[path = "common/disk.rs"]
mod disk;
use disk::*;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fs_cache::chunk::disk::{DiskCache, DiskCacheConfig};
use fs_cache::chunk::{ChunkId, CHUNK_SIZE, MAX_DISK_CHUNK_SHIFT};

#[test]
fn round_trip_and_restart_keep_entries_and_lru_order() {
    // 64 KiB chunks of a 256 KiB-chunk blob, whole 64 KiB chunks, whole 16 KiB chunks.
    round_trip(MAX_DISK_CHUNK_SHIFT, 64 * KIB);
    round_trip(16, 64 * KIB);
    round_trip(14, 16 * KIB);
}

fn round_trip(shift: u8, len: u64) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let ids: Vec<ChunkId> = (0..5).map(|i| id_at("restart", shift, i)).collect();
    {
        let cache = open(&dir, 4 * on_disk(len));
        assert_eq!(cache.get(&ids[0]).unwrap(), None);
        for c in &ids[..4] {
            cache.put(c, &content(c, len)).unwrap();
        }
        for c in &ids[..4] {
            assert!(cache.contains(c));
            assert_eq!(cache.get(c).unwrap().unwrap(), content(c, len));
        }
        // A chunk larger than its chunk size is refused, and so is a shift level 2 does
        // not keep.
        let big = vec![0u8; (1 << shift) + 1];
        assert!(cache.put(&id_at("big", shift, 0), &big).is_err());
        assert!(cache.put(&id_at("big", 11, 0), &[1; 10]).is_err());
        assert!(cache.put(&id_at("big", 19, 0), &[1; 10]).is_err());
        // Under another chunking, the chunks are not these.
        assert!(!cache.contains(&id_at("restart", shift - 1, 0)));
        let s = cache.stats();
        assert_eq!(
            (s.bytes, s.chunks, s.capacity),
            (4 * on_disk(len), 4, 4 * on_disk(len))
        );
        assert_eq!(s.evictions, 0);
    }
    let cache = open(&dir, 4 * on_disk(len));
    let s = cache.stats();
    assert_eq!(
        (s.bytes, s.chunks, s.recovered_orphans),
        (4 * on_disk(len), 4, 0)
    );
    // Read them newest first: the recency order is now the reverse of the insertion order.
    for c in ids[..4].iter().rev() {
        assert_eq!(
            cache.get(c).unwrap().unwrap(),
            content(c, len),
            "after reopen"
        );
    }
    drop(cache);
    // So after a restart 3 is the least recently used, then 2, 1, 0.
    let cache = open(&dir, 4 * on_disk(len));
    cache.put(&ids[4], &content(&ids[4], len)).unwrap();
    assert!(
        !cache.contains(&ids[3]),
        "the least recently used goes first"
    );
    assert!(cache.contains(&ids[2]) && cache.contains(&ids[0]) && cache.contains(&ids[4]));
    assert!(!chunk_has_data(&dir, &ids[3]));
    assert!(chunk_has_data(&dir, &ids[2]));
    assert_eq!(cache.stats().evictions, 1);
    // Capacity shrunk between runs: evicted at open, LRU first (2, then 1).
    drop(cache);
    let cache = open(&dir, 2 * on_disk(len));
    let s = cache.stats();
    assert_eq!((s.bytes, s.chunks, s.evictions), (2 * on_disk(len), 2, 3));
    assert!(cache.contains(&ids[0]) && cache.contains(&ids[4]));
    assert!(chunk_has_data(&dir, &ids[0]) && chunk_has_data(&dir, &ids[4]));
    assert_usage_matches(&usage(&dir), 2 * on_disk(len), 1, "after shrinking");
    // A second owner of the directory is refused while the first is open.
    let second = DiskCache::open(DiskCacheConfig {
        dir: dir.clone(),
        capacity: len,
    });
    assert!(second.is_err(), "two caches on one directory");
}

#[test]
fn a_batch_put_indexes_every_chunk_once_and_survives_a_restart() {
    batch_put(MAX_DISK_CHUNK_SHIFT);
    batch_put(16);
}

fn batch_put(shift: u8) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let chunk = 1u64 << shift;
    let (a, b) = (id_at("batch-a", shift, 0), id_at("batch-b", shift, 0));
    let ids: Vec<ChunkId> = (0..6)
        .map(|i| {
            if i % 2 == 0 {
                id_at("batch-a", shift, i)
            } else {
                id_at("batch-b", shift, i)
            }
        })
        .collect();
    let lens = |c: &ChunkId| if c.index == 5 { 1000 } else { chunk };
    {
        let cache = open(&dir, 64 * MIB);
        // One chunk cached before: the batch only marks it used.
        cache.put(&a, &content(&a, chunk)).unwrap();
        let data: Vec<Vec<u8>> = ids.iter().map(|c| content(c, lens(c))).collect();
        // Every chunk of the batch, one of them twice, across two blob files.
        let mut batch: Vec<(ChunkId, &[u8])> = ids
            .iter()
            .copied()
            .zip(data.iter().map(|d| &d[..]))
            .collect();
        batch.push((ids[3], &data[3][..]));
        cache.put_many(&batch).unwrap();
        let s = cache.stats();
        let bytes = 5 * chunk + on_disk(1000);
        assert_eq!((s.chunks, s.bytes), (6, bytes), "{s:?}");
        for c in &ids {
            assert_eq!(cache.get(c).unwrap().unwrap(), content(c, lens(c)), "{c:?}");
            assert!(chunk_has_data(&dir, c), "{c:?} in its slot");
        }
        // A chunk over the chunk size fails the whole batch before anything is written.
        let big = vec![7u8; chunk as usize + 1];
        let fresh = content(&b, chunk);
        let bad: Vec<(ChunkId, &[u8])> =
            vec![(b, &fresh[..]), (id_at("batch-b", shift, 9), &big[..])];
        assert!(cache.put_many(&bad).is_err());
        assert!(!cache.contains(&b) && !chunk_has_data(&dir, &b));
        assert_eq!(cache.stats().chunks, 6);
    }
    let cache = open(&dir, 64 * MIB);
    let s = cache.stats();
    assert_eq!(
        (s.chunks, s.recovered_orphans, s.dropped_corrupt),
        (6, 0, 0),
        "{s:?}"
    );
    for c in &ids {
        assert_eq!(
            cache.get(c).unwrap().unwrap(),
            content(c, lens(c)),
            "after reopen: {c:?}"
        );
    }
    assert_usage_matches(&usage(&dir), 5 * chunk + on_disk(1000), 2, "after reopen");
}

#[test]
fn usage_stays_under_capacity_while_reading_three_times_capacity() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let capacity = 4 * MIB;
    let cache = open(&dir, capacity);
    let stop = Arc::new(AtomicBool::new(false));
    let max_seen = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (stop, max_seen, dir) = (stop.clone(), max_seen.clone(), dir.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                max_seen.fetch_max(usage(&dir).bytes, Ordering::Relaxed);
            }
        })
    };
    let hot = id("bounded-hot", 0);
    cache.put(&hot, &content(&hot, CHUNK_SIZE)).unwrap();
    let n = 3 * capacity / CHUNK_SIZE;
    let started = Instant::now();
    for i in 0..n {
        let c = id("bounded", i);
        cache.put(&c, &content(&c, CHUNK_SIZE)).unwrap();
        // Keep one chunk hot: it must survive every eviction.
        assert!(cache.get(&hot).unwrap().is_some());
        let s = cache.stats();
        assert!(s.bytes <= capacity, "stats {s:?}");
        let u = usage(&dir);
        assert!(
            u.bytes <= capacity + EXTENT_SLACK,
            "on disk {u:?} after put {i}"
        );
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let seen = max_seen.load(Ordering::Relaxed);
    assert!(
        seen <= capacity + CHUNK_SIZE + EXTENT_SLACK,
        "watcher saw {seen} bytes"
    );
    let s = cache.stats();
    let per = on_disk(CHUNK_SIZE);
    assert_eq!(s.chunks, capacity / per);
    assert_eq!(s.bytes, s.chunks * per);
    assert_eq!(s.evictions, n + 1 - capacity / per);
    assert!(cache.contains(&hot));
    for i in n + 1 - capacity / per..n {
        assert!(cache.contains(&id("bounded", i)), "recent chunk {i} kept");
    }
    println!(
        "bounded: {n} puts of 256 KiB in {elapsed:?} ({:?}/put); max on disk seen {seen} (capacity {capacity})",
        elapsed / n as u32
    );
}

#[test]
fn many_threads_share_one_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let capacity = MIB;
    let len = |c: &ChunkId| 32 * KIB + c.index % 5 * 8 * KIB;
    let cache = Arc::new(open(&dir, capacity));
    let started = Instant::now();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let cache = cache.clone();
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                for _ in 0..500 {
                    let c = id("threads", rng.u64(..64));
                    match rng.u8(..10) {
                        0..=3 => cache.put(&c, &content(&c, len(&c))).unwrap(),
                        4..=7 => {
                            if let Some(b) = cache.get(&c).unwrap() {
                                assert_eq!(b, content(&c, len(&c)), "{c:?}");
                            }
                        }
                        8 => cache.remove(&c).unwrap(),
                        _ => cache.drop_corrupt(&c).unwrap(),
                    }
                    assert!(cache.stats().bytes <= capacity);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = started.elapsed();
    let s = cache.stats();
    let blobs = u64::from(s.chunks > 0);
    assert_usage_matches(&usage(&dir), s.bytes, blobs, "after the threads");

    // Hit cost: one 256 KiB chunk read back many times.
    let hot = id("threads-hot", 0);
    cache.put(&hot, &content(&hot, CHUNK_SIZE)).unwrap();
    let n = 2000;
    let t0 = Instant::now();
    for _ in 0..n {
        assert!(cache.get(&hot).unwrap().is_some());
    }
    let per_hit = t0.elapsed() / n;
    println!("threads: 4 x 500 mixed ops in {elapsed:?}; {s:?}; hit of 256 KiB: {per_hit:?}");
    drop(cache);
    let cache = open(&dir, capacity);
    for i in 0..64 {
        let c = id("threads", i);
        if cache.contains(&c) {
            assert_eq!(cache.get(&c).unwrap().unwrap(), content(&c, len(&c)));
        }
    }
}

const FILLER_ENV: &str = "STRATA_DISK_FILLER_DIR";
const FILLER_CAPACITY: u64 = MIB;
const FILLER_SEEDS: [&str; 2] = ["kill9-a", "kill9-b"];
const FILLER_INDEXES: u64 = 48;

/// The length of a filler chunk: 1 KiB ..= 97 KiB, derived from the id.
fn filler_len(c: &ChunkId) -> u64 {
    KIB + (c.index * 7 + u64::from(c.blob.0[0])) % 97 * KIB
}

/// Not a test on its own: the child process of `kill_9_mid_fill_never_leaves_a_bad_entry`.
/// It fills the cache from two threads until it is killed.
#[test]
#[ignore = "the child process of kill_9_mid_fill_never_leaves_a_bad_entry"]
fn kill9_filler_child() {
    let Some(dir) = std::env::var_os(FILLER_ENV) else {
        return;
    };
    // Any failure ends the process, so that the parent sees it exit before it is killed.
    let fail = |what: String| -> ! {
        eprintln!("filler: {what}");
        std::process::exit(3)
    };
    let cache = Arc::new(open(Path::new(&dir), FILLER_CAPACITY));
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let cache = cache.clone();
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t ^ u64::from(std::process::id()));
                for op in 0u64.. {
                    let c = id(FILLER_SEEDS[rng.usize(..2)], rng.u64(..FILLER_INDEXES));
                    let done = match rng.u8(..10) {
                        0..=2 => cache.put(&c, &content(&c, filler_len(&c))),
                        // A batch of up to 8 chunks of both blobs (one sync per blob file).
                        3..=5 => {
                            let ids: Vec<ChunkId> = (0..rng.u64(1..=8))
                                .map(|_| {
                                    id(FILLER_SEEDS[rng.usize(..2)], rng.u64(..FILLER_INDEXES))
                                })
                                .collect();
                            let data: Vec<Vec<u8>> =
                                ids.iter().map(|c| content(c, filler_len(c))).collect();
                            let batch: Vec<(ChunkId, &[u8])> = ids
                                .iter()
                                .copied()
                                .zip(data.iter().map(|d| &d[..]))
                                .collect();
                            cache.put_many(&batch)
                        }
                        6..=8 => cache.get(&c).map(|got| match got {
                            Some(b) if b != content(&c, filler_len(&c)) => {
                                fail(format!("{c:?} read back wrong"))
                            }
                            _ => (),
                        }),
                        _ => cache.remove(&c),
                    };
                    let done = done.and_then(|()| match op % 64 {
                        63 => cache.flush(),
                        _ => Ok(()),
                    });
                    if let Err(e) = done {
                        fail(e.to_string());
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    fail("a filler thread stopped".into());
}

#[test]
fn kill_9_mid_fill_never_leaves_a_bad_entry() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let exe = std::env::current_exe().unwrap();
    let mut rng = fastrand::Rng::new();
    let mut seen_chunks = 0;
    for round in 0..6 {
        let delay = Duration::from_millis(rng.u64(50..=400));
        let mut child = Command::new(&exe)
            .args([
                "kill9_filler_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(FILLER_ENV, &dir)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        if let Some(status) = child.try_wait().unwrap() {
            panic!("filler exited by itself: {status}");
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let before = usage(&dir);
        let cache = open(&dir, FILLER_CAPACITY);
        let s = cache.stats();
        let mut found = 0;
        let mut bytes = 0;
        for seed in FILLER_SEEDS {
            for i in 0..FILLER_INDEXES {
                let c = id(seed, i);
                if !cache.contains(&c) {
                    assert!(!chunk_has_data(&dir, &c), "unindexed bytes kept: {c:?}");
                    continue;
                }
                let got = cache.get(&c).unwrap();
                let got =
                    got.unwrap_or_else(|| panic!("round {round}: indexed chunk {c:?} unreadable"));
                assert_eq!(got, content(&c, filler_len(&c)), "round {round}: {c:?}");
                found += 1;
                bytes += on_disk(got.len() as u64);
            }
        }
        let after = usage(&dir);
        assert_eq!((s.chunks, s.bytes), (found, bytes), "round {round}");
        let files = FILLER_SEEDS
            .iter()
            .filter(|seed| (0..FILLER_INDEXES).any(|i| cache.contains(&id(seed, i))))
            .count() as u64;
        assert_usage_matches(&after, bytes, files, &format!("round {round}"));
        assert!(bytes <= FILLER_CAPACITY);
        let s = cache.stats();
        assert_eq!(s.dropped_corrupt, 0, "round {round}: {s:?}");
        println!(
            "kill -9 round {round} after {delay:?}: {found} chunks / {bytes} bytes intact; \
             before reopen {} bytes allocated; {s:?}",
            before.bytes
        );
        seen_chunks += found;
    }
    assert!(seen_chunks > 0, "the filler never got to write anything");
}

#[test]
fn corrupt_truncated_and_stray_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let len = 32 * KIB;
    let [a, b, c] = [0, 1, 2].map(|i| id("corrupt", i));
    let d = id("corrupt-d", 0);
    let cache = open(&dir, MIB);
    for x in [&a, &b, &c, &d] {
        cache.put(x, &content(x, len)).unwrap();
    }

    // Bytes flipped behind the cache's back: never served; dropped and punched out.
    let path = blob_file(&dir, &a);
    flip(&path, a.index * CHUNK_SIZE + 100, 0xff);
    assert_eq!(cache.get(&a).unwrap(), None);
    assert!(!cache.contains(&a) && !chunk_has_data(&dir, &a));
    assert_eq!(cache.stats().dropped_corrupt, 1);
    cache.drop_corrupt(&a).unwrap(); // not cached any more: counts nothing
    cache.remove(&b).unwrap(); // plain remove counts nothing
    assert!(!cache.contains(&b) && !chunk_has_data(&dir, &b));
    assert_eq!(cache.stats().dropped_corrupt, 1);
    assert!(chunk_has_data(&dir, &c) && path.exists());

    // Truncated while open (into chunk c): c is dropped on get.
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(c.index * CHUNK_SIZE + len / 2)
        .unwrap();
    assert_eq!(cache.get(&c).unwrap(), None);
    assert!(!cache.contains(&c));
    assert_eq!(cache.stats().dropped_corrupt, 2);
    // Re-put after a drop works.
    cache.put(&a, &content(&a, len)).unwrap();
    assert_eq!(cache.get(&a).unwrap().unwrap(), content(&a, len));
    let before = cache.stats();
    drop(cache);

    // Truncated while closed: dropped at open, and its then empty file removed. Plus what a
    // crash (or a stranger) leaves: a file of an unindexed blob, unindexed bytes in an indexed
    // blob's file, and files the cache does not name that way.
    fs::File::options()
        .write(true)
        .open(blob_file(&dir, &d))
        .unwrap()
        .set_len(1)
        .unwrap();
    let stray = id("stray", 9);
    let stray_path = blob_file(&dir, &stray);
    fs::write(&stray_path, content(&stray, 10)).unwrap();
    let unindexed = id("corrupt", 5);
    {
        use std::os::unix::fs::FileExt;
        let f = fs::File::options().write(true).open(&path).unwrap();
        f.write_all_at(&content(&unindexed, len), unindexed.index * CHUNK_SIZE)
            .unwrap();
    }
    let odd_name = path.with_extension("00");
    fs::write(&odd_name, content(&a, len)).unwrap();
    let tmp_name = path.with_file_name(".tmp.partial");
    fs::write(&tmp_name, b"partial").unwrap();
    let cache = open(&dir, MIB);
    assert!(!cache.contains(&d) && !blob_file(&dir, &d).exists());
    assert!(!cache.contains(&stray) && !stray_path.exists());
    assert!(!cache.contains(&unindexed) && !chunk_has_data(&dir, &unindexed));
    assert!(!odd_name.exists() && !tmp_name.exists() && chunk_has_data(&dir, &a));
    let s = cache.stats();
    assert_eq!(s.dropped_corrupt, before.dropped_corrupt + 1);
    // d's file, the stray file, the unindexed range, the odd name and the temporary name.
    assert_eq!(s.recovered_orphans, before.recovered_orphans + 5);
    assert_eq!((s.chunks, s.bytes), (1, on_disk(len)));
    assert_eq!(cache.get(&a).unwrap().unwrap(), content(&a, len));
    drop(cache);

    // Garbage in the index (a bad value, a bad key, crc32c values of no chunk) and an entry
    // whose file is gone: treated as absent and cleaned at open, never a panic.
    {
        let db = rocksdb::DB::open_default(dir.join("index")).unwrap();
        let key = |tag: u8, x: &ChunkId| {
            let mut k = vec![tag];
            k.extend_from_slice(&x.blob.0);
            k.extend_from_slice(&x.index.to_be_bytes());
            k
        };
        db.put(key(b'c', &c), b"\x07garbage").unwrap();
        db.put(b"c-short-key", [1u8; 13]).unwrap();
        db.put(key(b's', &b), [0u8; 32]).unwrap();
        let mut value = vec![2u8];
        value.extend_from_slice(&(len as u32).to_le_bytes());
        value.extend_from_slice(&1u64.to_le_bytes());
        db.put(key(b'c', &d), &value).unwrap();
        db.put(key(b's', &d), [0u8; 32]).unwrap();
    }
    let cache = open(&dir, MIB);
    let s2 = cache.stats();
    assert_eq!(s2.recovered_orphans, s.recovered_orphans + 3);
    assert_eq!((s2.chunks, s2.bytes), (1, on_disk(len)));
    assert!(!cache.contains(&c) && !cache.contains(&d));
    assert_eq!(cache.get(&a).unwrap().unwrap(), content(&a, len));
    drop(cache);
    let s3 = open(&dir, MIB).stats();
    assert_eq!(
        s3.recovered_orphans, s2.recovered_orphans,
        "cleaned for good"
    );
}

/// A tmpfs mounted for one test, unmounted even if the test fails.
struct TmpfsMount {
    path: PathBuf,
}

impl TmpfsMount {
    fn new(path: &Path, size: &str) -> Result<Self, String> {
        fs::create_dir_all(path).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(TmpfsMount {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

fn skip_or_fail(why: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("disk-full test cannot run under CI: {why}");
    }
    eprintln!("\n*** SKIPPED disk_full_turns_into_eviction_or_a_clear_error: {why} ***\n");
}

fn check_no_space(e: &fs_cache::Error) {
    let msg = e.to_string().to_lowercase();
    assert!(
        msg.contains("no space"),
        "unclear error on a full disk: {e}"
    );
}

#[test]
fn disk_full_turns_into_eviction_or_a_clear_error() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_or_fail("needs root to mount a tmpfs");
    }
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("small");
    let _mount = match TmpfsMount::new(&mnt, "3m") {
        Ok(m) => m,
        Err(e) => return skip_or_fail(&format!("mount tmpfs: {e}")),
    };
    let dir = mnt.join("cache");
    let capacity = 8 * MIB; // more than the disk
    let len = CHUNK_SIZE;
    let all: Vec<ChunkId> = (0..60).map(|i| id("enospc", i)).collect();
    let verify = |cache: &DiskCache| {
        let mut n = 0;
        for c in &all {
            if cache.contains(c) {
                let got = cache.get(c).unwrap().expect("indexed chunk readable");
                assert_eq!(got, content(c, len), "{c:?}");
                n += 1;
            }
        }
        assert_usage_matches(
            &usage(&dir),
            n * on_disk(len),
            u64::from(n > 0),
            "after a full disk",
        );
        assert_eq!(cache.stats().chunks, n);
        n
    };

    // 1. The cache alone fills the disk: the free-space check and ENOSPC turn into eviction.
    let cache = open(&dir, capacity);
    let (mut ok, mut refused) = (0, 0);
    for c in &all[..40] {
        match cache.put(c, &content(c, len)) {
            Ok(()) => ok += 1,
            Err(e) => {
                check_no_space(&e);
                refused += 1;
            }
        }
        assert!(cache.stats().bytes <= 3 * MIB);
    }
    let s = cache.stats();
    println!("disk full, phase 1: {ok} puts ok, {refused} refused; {s:?}");
    assert!(ok >= 30, "puts should succeed through eviction");
    assert!(s.evictions > 0 && s.chunks > 0);
    drop(cache);
    let cache = open(&dir, capacity);
    let n1 = verify(&cache);

    // 2. Someone else fills the disk while the cache holds chunks: puts evict (files first,
    //    as the index may not be written below its reserve) and succeed.
    let ballast = mnt.join("ballast");
    let fill_disk = || {
        use std::io::Write;
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&ballast)
            .unwrap();
        let block = vec![0x55u8; 4 * KIB as usize];
        while f.write_all(&block).is_ok() {}
        while f.write_all(&[0x55]).is_ok() {}
    };
    fill_disk();
    for c in &all[40..45] {
        cache.put(c, &content(c, len)).unwrap();
    }
    let s = cache.stats();
    println!("disk full, phase 2 (ballast, chunks to evict): {s:?}");
    assert!(s.enospc > 0, "the full disk was noticed and counted");
    assert!(cache.contains(&all[44]));

    // 3. Full disk and nothing left to evict: a clear error, no partial file, no entry.
    for c in &all {
        cache.remove(c).unwrap();
    }
    fill_disk();
    let before = cache.stats().enospc;
    for c in &all[45..48] {
        let e = cache.put(c, &content(c, len)).unwrap_err();
        check_no_space(&e);
        assert!(!cache.contains(c));
        println!("disk full, phase 3: {e}");
    }
    check_no_space(&cache.flush().unwrap_err());
    assert!(cache.stats().enospc > before);
    assert_usage_matches(&usage(&dir), 0, 0, "nothing left");
    drop(cache); // its flush fails (no space): logged, nothing breaks
    fs::remove_file(&ballast).unwrap();

    // 4. Space is back: consistent after reopen, and puts work again.
    let cache = open(&dir, capacity);
    let n3 = verify(&cache);
    for c in &all[50..60] {
        cache.put(c, &content(c, len)).unwrap();
    }
    assert!(cache.contains(&all[59]));
    drop(cache);
    let cache = open(&dir, capacity);
    let n4 = verify(&cache);
    println!("disk full: chunks intact after each reopen: {n1}, {n3}, {n4}");
}

#[test]
fn ranged_reads_check_only_their_blocks_and_catch_damage() {
    // With O_DIRECT (on a disk-backed directory) and through the page cache.
    for direct in [true, false] {
        ranged_reads(direct);
    }
}

fn ranged_reads(direct: bool) {
    use fs_cache::chunk::disk::RangeRead;
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = tmp.path().join("cache");
    let cache = open(&dir, MIB);
    cache.set_direct_reads(direct);
    let c = id("ranged", 0);
    let data = content(&c, CHUNK_SIZE);
    cache.put(&c, &data).unwrap();
    for (r, nowait) in [
        (0..1, false),
        (4095..4097, false),
        (100_000..CHUNK_SIZE, true),
        (0..CHUNK_SIZE, false),
    ] {
        match cache.read_range(&c, r.clone(), nowait).unwrap() {
            RangeRead::Hit(b) => assert_eq!(&b[..], &data[r.start as usize..r.end as usize]),
            // Not in the page cache (the cache drops written pages): fine for a no-wait read.
            RangeRead::WouldBlock if nowait => {}
            other => panic!("{r:?}: {other:?}"),
        }
    }
    assert_eq!(
        cache.direct_reads(),
        direct,
        "the reads went {} the page cache",
        if direct { "through" } else { "around" }
    );
    assert!(cache.read_range(&c, 0..CHUNK_SIZE + 1, false).is_err());
    assert_eq!(
        cache.read_range(&id("ranged", 9), 0..1, false).unwrap(),
        RangeRead::Absent
    );

    // Damage block 10: ranges over it are refused, others still served.
    let path = blob_file(&dir, &c);
    flip(&path, 10 * 4096 + 7, 1);
    assert_eq!(
        cache.read_range(&c, 40_000..41_000, false).unwrap(),
        RangeRead::Corrupt
    );
    assert!(matches!(
        cache.read_range(&c, 0..4096, false).unwrap(),
        RangeRead::Hit(_)
    ));
    // Damage the crc32c of block 3 instead (read by a fresh cache, which has not kept it in
    // memory yet): the block it covers is refused.
    flip(&path, 10 * 4096 + 7, 1);
    drop(cache);
    {
        let db = rocksdb::DB::open_default(dir.join("index")).unwrap();
        let mut k = vec![b's'];
        k.extend_from_slice(&c.blob.0);
        k.extend_from_slice(&c.index.to_be_bytes());
        let mut sums = db.get(&k).unwrap().unwrap();
        sums[4 * 3] ^= 0x80;
        db.put(&k, &sums).unwrap();
    }
    let cache = open(&dir, MIB);
    cache.set_direct_reads(direct);
    assert_eq!(
        cache.read_range(&c, 3 * 4096..3 * 4096 + 1, false).unwrap(),
        RangeRead::Corrupt
    );
    assert!(matches!(
        cache.read_range(&c, 40_000..41_000, false).unwrap(),
        RangeRead::Hit(_)
    ));
    cache.drop_corrupt(&c).unwrap();
    assert_eq!(
        cache.read_range(&c, 0..1, false).unwrap(),
        RangeRead::Absent
    );
    assert!(!path.exists(), "the blob's last chunk went: its file too");
}

const INDEX_HOLDER_ENV: &str = "STRATA_DISK_INDEX_HOLDER_DIR";

/// Run by `an_open_waits_for_an_index_another_process_holds`: open the cache, say so (a
/// `ready` file), hold it for 800 ms, exit.
#[test]
#[ignore = "the child process of an_open_waits_for_an_index_another_process_holds"]
fn index_holder_child() {
    let Some(dir) = std::env::var_os(INDEX_HOLDER_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let cache = open(&dir.join("cache"), MIB);
    fs::write(dir.join("ready"), b"").unwrap();
    std::thread::sleep(Duration::from_millis(800));
    drop(cache);
}

#[test]
fn an_open_waits_for_an_index_another_process_holds() {
    // A daemon that hands over lets go of its run directory before its process (and the
    // index's lock) is gone: the next one's open waits for the index instead of failing.
    let tmp = tempfile::tempdir().unwrap();
    let config = DiskCacheConfig {
        dir: tmp.path().join("cache"),
        capacity: MIB,
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "index_holder_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(INDEX_HOLDER_ENV, tmp.path())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !tmp.path().join("ready").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the child never opened the cache"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child exited early"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Not waiting: refused at once, and the message says why.
    let Err(e) = DiskCache::open_waiting(config.clone(), Duration::ZERO) else {
        panic!("opened an index the child holds");
    };
    assert!(e.to_string().contains("another process has held it"), "{e}");
    // Waiting: open once the child is gone.
    let t = Instant::now();
    let cache = DiskCache::open_waiting(config.clone(), Duration::from_secs(20))
        .expect("opened once the child let go");
    assert!(child.wait().unwrap().success());
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "it did wait: {:?}",
        t.elapsed()
    );
    // This process's own open cache is never waited for.
    let t = Instant::now();
    assert!(DiskCache::open_waiting(config, Duration::from_secs(20)).is_err());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "no wait for itself: {:?}",
        t.elapsed()
    );
    drop(cache);
}

/// Each chunk's bytes are at its slot of `file` (its blob file's bytes) and read back whole.
fn assert_written(cache: &DiskCache, file: &[u8], chunks: &[(ChunkId, Vec<u8>)]) {
    for (c, want) in chunks {
        let at = slot(c) as usize;
        assert_eq!(
            &file[at..at + want.len()],
            &want[..],
            "chunk {} in the file",
            c.index
        );
        match cache.read_range(c, 0..want.len() as u64, false).unwrap() {
            fs_cache::chunk::disk::RangeRead::Hit(b) => assert_eq!(&b[..], &want[..]),
            other => panic!("chunk {}: {other:?}", c.index),
        }
    }
}

#[test]
fn chunks_written_around_or_through_the_page_cache_read_back_exactly() {
    // With direct I/O (a disk-backed directory): a whole chunk from an aligned buffer (written
    // from the buffer itself), one from an unaligned buffer (through the writer's aligned
    // copy), and a blob's short last chunk (through the page cache); and all three with
    // direct I/O off. Checked by a ranged read, in the blob file itself (exactly the chunks'
    // bytes, no padding past the last one), and after a reopen.
    for direct in [true, false] {
        let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
        let dir = tmp.path().join("cache");
        let cache = open(&dir, 4 * MIB);
        cache.set_direct_reads(direct);
        let chunks = [
            (id("written", 0), CHUNK_SIZE, 0usize),
            (id("written", 1), CHUNK_SIZE, 1),
            (id("written", 2), 5000, 0),
        ];
        let mut backing = vec![0u8; CHUNK_SIZE as usize + 2 * 4096];
        let base = backing.as_ptr().align_offset(4096);
        for (c, len, skew) in &chunks {
            let want = content(c, *len);
            let at = base + skew;
            backing[at..at + want.len()].copy_from_slice(&want);
            cache.put(c, &backing[at..at + want.len()]).unwrap();
        }
        assert_eq!(cache.direct_reads(), direct, "the filesystem took O_DIRECT");
        let file = fs::read(blob_file(&dir, &chunks[0].0)).unwrap();
        assert_eq!(file.len() as u64, 2 * CHUNK_SIZE + 5000);
        let written: Vec<(ChunkId, Vec<u8>)> = chunks
            .iter()
            .map(|(c, len, _)| (*c, content(c, *len)))
            .collect();
        let check = |cache: &DiskCache| assert_written(cache, &file, &written);
        check(&cache);
        drop(cache);
        let cache = open(&dir, 4 * MIB);
        cache.set_direct_reads(!direct);
        check(&cache);

        // A batch of adjacent chunks, listed out of order (one write of the run, `batch.rs`),
        // beside one that is not adjacent and a short last chunk.
        drop(cache);
        let cache = open(&dir, 8 * MIB);
        cache.set_direct_reads(direct);
        let ids: Vec<(ChunkId, u64)> = [5u64, 3, 4, 9, 6, 7, 10]
            .iter()
            .map(|&i| (id("run", i), if i == 10 { 777 } else { CHUNK_SIZE }))
            .collect();
        let data: Vec<Vec<u8>> = ids.iter().map(|(c, len)| content(c, *len)).collect();
        let batch: Vec<(ChunkId, &[u8])> = ids
            .iter()
            .zip(&data)
            .map(|((c, _), d)| (*c, &d[..]))
            .collect();
        cache.put_many(&batch).unwrap();
        let file = fs::read(blob_file(&dir, &ids[0].0)).unwrap();
        assert_eq!(file.len() as u64, 10 * CHUNK_SIZE + 777);
        let written: Vec<(ChunkId, Vec<u8>)> = ids
            .iter()
            .map(|(c, _)| *c)
            .zip(data.iter().cloned())
            .collect();
        assert_written(&cache, &file, &written);
        assert!(
            !chunk_has_data(&dir, &id("run", 8)),
            "no bytes between the runs"
        );
    }
}

#[test]
fn a_pinned_blob_is_the_blob_and_is_not_evicted() {
    pinned_blob(MAX_DISK_CHUNK_SHIFT);
    pinned_blob(16);
    pinned_blob(14);
}

fn pinned_blob(shift: u8) {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let chunk = 1u64 << shift;
    let capacity = 4 * chunk;
    let cache = Arc::new(open(&dir, capacity));
    // A blob of 2 chunks and a 1000-byte tail.
    let chunks: Vec<(ChunkId, u64)> = (0..3)
        .map(|i| (id_at("pinned", shift, i), if i < 2 { chunk } else { 1000 }))
        .collect();
    let blob = chunks[0].0.blob;
    for (c, len) in &chunks[..2] {
        cache.put(c, &content(c, *len)).unwrap();
    }
    assert!(
        cache.pin_blob(&blob, shift, 3, 1000).unwrap().is_none(),
        "a chunk is missing"
    );
    cache
        .put(&chunks[2].0, &content(&chunks[2].0, 1000))
        .unwrap();
    assert!(
        cache.pin_blob(&blob, shift, 3, 999).unwrap().is_none(),
        "wrong tail size"
    );
    assert!(
        cache.pin_blob(&blob, shift - 1, 3, 1000).unwrap().is_none(),
        "another chunking"
    );
    assert!(cache.pin_blob(&blob, 19, 3, 1000).is_err());
    let pin = cache.pin_blob(&blob, shift, 3, 1000).unwrap().unwrap();
    assert_eq!((pin.len(), pin.shift()), (2 * chunk + 1000, shift));
    assert!(pin.verify().unwrap());
    // The file is the blob, byte for byte.
    let blob_bytes: Vec<u8> = chunks
        .iter()
        .flat_map(|(c, len)| content(c, *len))
        .collect();
    assert_eq!(pin.file().metadata().unwrap().len(), pin.len());
    let mut whole = vec![0u8; pin.len() as usize];
    pin.file().read_exact_at(&mut whole, 0).unwrap();
    assert!(whole == blob_bytes);
    // Fill past the capacity: the pinned chunks stay, others go.
    for i in 0..8 {
        let c = id_at("pinned-other", shift, i);
        cache.put(&c, &content(&c, chunk)).unwrap();
        assert!(cache.stats().bytes <= capacity);
    }
    assert!(chunks.iter().all(|(c, _)| cache.contains(c)));
    // A chunk dropped while pinned keeps its bytes until the pin goes.
    cache.drop_corrupt(&chunks[0].0).unwrap();
    assert!(!cache.contains(&chunks[0].0));
    assert!(chunk_has_data(&dir, &chunks[0].0));
    drop(pin);
    assert!(!chunk_has_data(&dir, &chunks[0].0));
    // Damage found by verify: false, and the chunk dropped.
    cache
        .put(&chunks[0].0, &content(&chunks[0].0, chunk))
        .unwrap();
    let pin = cache.pin_blob(&blob, shift, 3, 1000).unwrap().unwrap();
    flip(&blob_file(&dir, &chunks[1].0), chunk + 5, 4);
    assert!(!pin.verify().unwrap());
    drop(pin);
    assert!(!cache.contains(&chunks[1].0));
    assert!(!chunk_has_data(&dir, &chunks[1].0));
}

#[test]
fn verifying_a_large_pinned_blob_reads_every_chunk_and_finds_damage_anywhere() {
    verify_large(MAX_DISK_CHUNK_SHIFT);
    verify_large(16);
}

fn verify_large(shift: u8) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let cache = Arc::new(open(&dir, 64 * MIB));
    let chunk = 1u64 << shift;
    // 9.25 MiB in chunks (more than the verifier's readers take in one round: 4 runs of
    // 2 MiB), a short last one.
    let n = 37 * (CHUNK_SIZE >> shift);
    let id = |i| id_at("verify-large", shift, i);
    let size = |i: u64| if i + 1 == n { 4097 } else { chunk };
    for i in 0..n {
        let c = id(i);
        cache.put(&c, &content(&c, size(i))).unwrap();
    }
    let blob = id(0).blob;
    let pin = cache
        .pin_blob(&blob, shift, n, size(n - 1))
        .unwrap()
        .unwrap();
    assert!(pin.verify().unwrap());
    assert_eq!(cache.stats().dropped_corrupt, 0);
    drop(pin);
    // One flipped bit in the short last chunk, then in a chunk in the middle.
    for damaged in [n - 1, n / 2 + 1] {
        let pin = cache
            .pin_blob(&blob, shift, n, size(n - 1))
            .unwrap()
            .unwrap();
        flip(&blob_file(&dir, &id(damaged)), damaged * chunk + 4096, 1);
        assert!(
            !pin.verify().unwrap(),
            "damage in chunk {damaged} was found"
        );
        drop(pin);
        assert!(!cache.contains(&id(damaged)));
        assert!(cache
            .pin_blob(&blob, shift, n, size(n - 1))
            .unwrap()
            .is_none());
        let c = id(damaged);
        cache.put(&c, &content(&c, size(damaged))).unwrap();
    }
    let pin = cache
        .pin_blob(&blob, shift, n, size(n - 1))
        .unwrap()
        .unwrap();
    assert!(pin.verify().unwrap());
    assert_eq!(cache.stats().dropped_corrupt, 2);
}

const HOLDER_ENV: &str = "STRATA_DISK_HOLDER_DIR";
const HOLDER_TOKEN_ENV: &str = "STRATA_DISK_HOLDER_TOKEN";
const HELD: u64 = 3;

/// Not a test on its own: the child process of `a_hold_outlives_its_process_while_its_token_exists`.
/// It caches a blob of 3 chunks, pins it twice, holds both pins with one token (the second
/// after holding it by another token first: a replaced hold), drops the first pin and exits
/// without dropping the second (as a killed process would).
#[test]
#[ignore = "the child process of a_hold_outlives_its_process_while_its_token_exists"]
fn hold_child() {
    let (Some(dir), Some(token)) = (
        std::env::var_os(HOLDER_ENV),
        std::env::var_os(HOLDER_TOKEN_ENV),
    ) else {
        return;
    };
    let cache = Arc::new(open(Path::new(&dir), 64 * MIB));
    for i in 0..HELD {
        let c = id("held", i);
        cache.put(&c, &content(&c, CHUNK_SIZE)).unwrap();
    }
    let blob = id("held", 0).blob;
    // Two pins of the blob under the same token (a blob pinned again while an earlier pin is
    // still read): dropping the first must not take the second's hold with it.
    let mut first = cache
        .pin_blob(&blob, MAX_DISK_CHUNK_SHIFT, HELD, CHUNK_SIZE)
        .unwrap()
        .unwrap();
    first.hold(Path::new(&token)).unwrap();
    let mut pin = cache
        .pin_blob(&blob, MAX_DISK_CHUNK_SHIFT, HELD, CHUNK_SIZE)
        .unwrap()
        .unwrap();
    pin.hold(Path::new(&token).parent().unwrap()).unwrap();
    pin.hold(Path::new(&token)).unwrap();
    drop(first);
    std::process::exit(0);
}

fn run_holder(dir: &Path, token: &Path) {
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "hold_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HOLDER_ENV, dir)
        .env(HOLDER_TOKEN_ENV, token)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "holder: {status}");
}

/// Put `n` chunks of `seed`: more than a small cache holds.
fn fill_with(cache: &DiskCache, seed: &str, n: u64) {
    for i in 0..n {
        let c = id(seed, i);
        cache.put(&c, &content(&c, CHUNK_SIZE)).unwrap();
    }
}

#[test]
fn a_hold_outlives_its_process_while_its_token_exists() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let token = tmp.path().join("connection");
    fs::create_dir(&token).unwrap();
    let held: Vec<ChunkId> = (0..HELD).map(|i| id("held", i)).collect();
    let intact = |cache: &DiskCache| {
        held.iter()
            .all(|c| cache.get(c).unwrap().as_deref() == Some(&content(c, CHUNK_SIZE)[..]))
    };
    run_holder(&dir, &token);

    // Reopened smaller than what is held plus more: the held chunks are neither evicted nor
    // punched out while the token exists, and a reopen keeps them held.
    let small = 5 * CHUNK_SIZE;
    let cache = open(&dir, small);
    assert_eq!(cache.stats().stale_holds, 1);
    fill_with(&cache, "other", 8);
    assert!(intact(&cache), "held chunks were evicted");
    assert!(cache.stats().evictions > 0);
    assert_eq!(cache.release_stale_holds().unwrap(), 0, "the token exists");
    drop(cache);
    // Reopened below what is held: the held chunks are pinned before the open evicts.
    let cache = open(&dir, 2 * CHUNK_SIZE);
    assert_eq!(cache.stats().stale_holds, 1);
    assert!(intact(&cache), "held chunks were evicted at open");
    assert!(cache.stats().bytes > 2 * CHUNK_SIZE);
    drop(cache);
    let cache = open(&dir, small);
    assert_eq!(
        cache.stats().stale_holds,
        1,
        "one hold: the replaced one went"
    );
    fill_with(&cache, "other-2", 8);
    assert!(intact(&cache));
    // A held chunk dropped as damaged keeps its bytes until the hold goes.
    cache.drop_corrupt(&held[1]).unwrap();
    assert!(chunk_has_data(&dir, &held[1]));

    // The token goes: the hold is released, its chunks are evictable again, and the
    // dropped one is punched out.
    fs::remove_dir(&token).unwrap();
    assert_eq!(cache.release_stale_holds().unwrap(), 1);
    assert_eq!(cache.stats().stale_holds, 0);
    assert!(!chunk_has_data(&dir, &held[1]));
    fill_with(&cache, "other-3", 8);
    assert!(
        held.iter().all(|c| !cache.contains(c)),
        "released chunks stay"
    );
    drop(cache);
    assert_eq!(
        open(&dir, small).stats().stale_holds,
        0,
        "the hold was deleted"
    );

    // A hold whose token is gone by the next open is deleted at that open.
    fs::create_dir(&token).unwrap();
    run_holder(&dir, &token);
    fs::remove_dir(&token).unwrap();
    let cache = open(&dir, small);
    assert_eq!(cache.stats().stale_holds, 0);
    fill_with(&cache, "other-4", 8);
    assert!(held.iter().all(|c| !cache.contains(c)));
    drop(cache);

    // A token path that exists again, but as another file (a reused FUSE connection
    // number), is not the token the hold was taken by.
    fs::create_dir(&token).unwrap();
    run_holder(&dir, &token);
    let old_ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&token).unwrap());
    fs::remove_dir(&token).unwrap();
    for i in 0.. {
        fs::create_dir(&token).unwrap();
        if std::os::unix::fs::MetadataExt::ino(&fs::metadata(&token).unwrap()) != old_ino {
            break;
        }
        // The filesystem gave the old inode number back: try with another one.
        fs::rename(&token, tmp.path().join(format!("stand-in-{i}"))).unwrap();
    }
    let cache = open(&dir, small);
    assert_eq!(
        cache.stats().stale_holds,
        0,
        "a new file at the token's path"
    );
    drop(cache);
    fs::remove_dir(&token).unwrap();

    // A pin dropped in the process that held it takes its hold with it.
    fs::create_dir(&token).unwrap();
    let cache = Arc::new(open(&dir, 64 * MIB));
    fill_with(&cache, "held", HELD);
    let mut pin = cache
        .pin_blob(&held[0].blob, MAX_DISK_CHUNK_SHIFT, HELD, CHUNK_SIZE)
        .unwrap()
        .unwrap();
    pin.hold(&token).unwrap();
    assert!(
        pin.hold(Path::new("relative")).is_err(),
        "a token must be absolute"
    );
    assert!(
        pin.hold(&tmp.path().join("missing")).is_err(),
        "a token must exist"
    );
    drop(pin);
    drop(cache);
    assert_eq!(open(&dir, small).stats().stale_holds, 0);
}

/// A held chunk dropped as damaged keeps its bytes across a restart while its hold lives
/// (the open does not punch them out under the earlier process's reader, though the restart
/// forgot that their removal waits), and loses them when the hold is released — or, if no
/// process released it, at the first open after it went.
#[test]
fn a_chunk_removed_under_a_hold_keeps_its_bytes_across_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let token = tmp.path().join("connection");
    fs::create_dir(&token).unwrap();
    run_holder(&dir, &token);
    let held: Vec<ChunkId> = (0..HELD).map(|i| id("held", i)).collect();
    let cache = open(&dir, 64 * MIB);
    assert_eq!(cache.stats().stale_holds, 1);
    cache.drop_corrupt(&held[1]).unwrap();
    assert!(chunk_has_data(&dir, &held[1]));
    let orphans = cache.stats().recovered_orphans;
    drop(cache);

    let cache = open(&dir, 64 * MIB);
    assert_eq!(cache.stats().stale_holds, 1);
    assert!(
        chunk_has_data(&dir, &held[1]),
        "punched at open under the holder's reader"
    );
    assert_eq!(cache.stats().recovered_orphans, orphans);
    assert!(!cache.contains(&held[1]));
    assert_eq!(
        cache.get(&held[0]).unwrap().as_deref(),
        Some(&content(&held[0], CHUNK_SIZE)[..])
    );
    // A chunk of the held blob cached again meanwhile is not an orphan any more.
    let again = held[2];
    cache.drop_corrupt(&again).unwrap();
    drop(cache);
    let cache = open(&dir, 64 * MIB);
    cache.put(&again, &content(&again, CHUNK_SIZE)).unwrap();

    // The token goes; releasing the hold punches the orphan out at once.
    fs::remove_dir(&token).unwrap();
    let orphans = cache.stats().recovered_orphans;
    assert_eq!(cache.release_stale_holds().unwrap(), 1);
    assert_eq!(cache.stats().stale_holds, 0);
    assert!(
        !chunk_has_data(&dir, &held[1]),
        "left after the hold was released"
    );
    assert_eq!(cache.stats().recovered_orphans, orphans + 1);
    for c in [held[0], again] {
        assert_eq!(
            cache.get(&c).unwrap().as_deref(),
            Some(&content(&c, CHUNK_SIZE)[..]),
            "chunk {} kept",
            c.index
        );
    }
    drop(cache);

    // A hold no process released: its orphans go at the first open after its token went.
    let token = tmp.path().join("connection2");
    fs::create_dir(&token).unwrap();
    let dir = tmp.path().join("cache2");
    run_holder(&dir, &token);
    let held: Vec<ChunkId> = (0..HELD).map(|i| id("held", i)).collect();
    let cache = open(&dir, 64 * MIB);
    cache.drop_corrupt(&held[1]).unwrap();
    drop(cache);
    let cache = open(&dir, 64 * MIB);
    assert!(chunk_has_data(&dir, &held[1]));
    drop(cache);
    fs::remove_dir(&token).unwrap();
    let cache = open(&dir, 64 * MIB);
    assert_eq!(cache.stats().stale_holds, 0);
    assert!(!chunk_has_data(&dir, &held[1]), "left after the hold went");
    assert!(cache.contains(&held[0]) && cache.contains(&held[2]));
}

#[test]
fn direct_run_reads_return_checked_chunks_and_drop_damaged_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let cache = open(&dir, 64 * MIB);
    // Chunks 0-2 and 4 (4 absent), the last one short: runs 0..3 and 4..6.
    let seed = "direct";
    let sizes = [CHUNK_SIZE, CHUNK_SIZE, CHUNK_SIZE, 0, CHUNK_SIZE, 10_000];
    for (i, &len) in sizes.iter().enumerate() {
        if len > 0 {
            let c = id(seed, i as u64);
            cache.put(&c, &content(&c, len)).unwrap();
        }
    }
    let blob = id(seed, 0).blob;
    let got = cache
        .read_chunks_direct(&blob, MAX_DISK_CHUNK_SHIFT, 0..8)
        .unwrap();
    let indexes: Vec<u64> = got.iter().map(|(i, _)| *i).collect();
    assert_eq!(indexes, [0, 1, 2, 4, 5]);
    for (i, bytes) in &got {
        let c = id(seed, *i);
        assert_eq!(
            &bytes[..],
            &content(&c, sizes[*i as usize])[..],
            "chunk {i}"
        );
    }
    // Nothing of another blob, and an empty range.
    assert!(cache
        .read_chunks_direct(&id("other", 0).blob, MAX_DISK_CHUNK_SHIFT, 0..4)
        .unwrap()
        .is_empty());
    assert!(cache
        .read_chunks_direct(&blob, MAX_DISK_CHUNK_SHIFT, 3..4)
        .unwrap()
        .is_empty());

    // A flipped bit in chunk 1: left out and dropped (counted), its neighbours still served.
    let path = blob_file(&dir, &id(seed, 0));
    flip(&path, CHUNK_SIZE + 12_345, 2);
    let got = cache
        .read_chunks_direct(&blob, MAX_DISK_CHUNK_SHIFT, 0..3)
        .unwrap();
    assert_eq!(got.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [0, 2]);
    assert!(!cache.contains(&id(seed, 1)));
    assert_eq!(cache.stats().dropped_corrupt, 1);
    assert!(
        !chunk_has_data(&dir, &id(seed, 1)),
        "the damaged chunk is punched out"
    );

    // A blob file cut short behind the cache's back: the chunks past its end are dropped.
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4 * CHUNK_SIZE + 100)
        .unwrap();
    let got = cache
        .read_chunks_direct(&blob, MAX_DISK_CHUNK_SHIFT, 4..6)
        .unwrap();
    assert!(
        got.is_empty(),
        "{:?}",
        got.iter().map(|(i, _)| *i).collect::<Vec<_>>()
    );
    assert!(!cache.contains(&id(seed, 4)) && !cache.contains(&id(seed, 5)));
}
