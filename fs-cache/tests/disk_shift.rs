//! Level 2 with chunk sizes other than 256 KiB (`ChunkId::shift`): the index entry versions,
//! one shift per blob (mixed at open, changed by a put), and punches of exactly a chunk's slot.
//! The shift-parametrized versions of the common cases (round trip, batch, pinned blob,
//! verify) are in `disk_cache.rs`.

#[path = "common/disk.rs"]
mod disk;
use disk::*;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use fs_cache::chunk::{CHUNK_SIZE, MAX_DISK_CHUNK_SHIFT};

/// The index of the cache in `dir` (the cache closed).
fn index(dir: &Path) -> rocksdb::DB {
    rocksdb::DB::open_default(dir.join("index")).unwrap()
}

/// A chunk entry's value: `[version][size u32 LE][seq u64 LE]` and, for v3, the shift.
fn entry(version: u8, size: u32, seq: u64, shift: Option<u8>) -> Vec<u8> {
    let mut v = vec![version];
    v.extend_from_slice(&size.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend(shift);
    v
}

/// The crc32c values of `data`, one per 4 KiB block.
fn sums(data: &[u8]) -> Vec<u8> {
    data.chunks(4096)
        .flat_map(|b| crc32c::crc32c(b).to_le_bytes())
        .collect()
}

/// The data ranges of the file at `path`, from `SEEK_DATA`/`SEEK_HOLE` (4 KiB granular on
/// the filesystems the tests run on).
fn data_ranges(path: &Path) -> Vec<(u64, u64)> {
    use rustix::fs::SeekFrom;
    let f = fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len();
    let mut out = Vec::new();
    let mut at = 0;
    while at < len {
        let Ok(data) = rustix::fs::seek(&f, SeekFrom::Data(at)) else {
            break;
        };
        let hole = rustix::fs::seek(&f, SeekFrom::Hole(data)).unwrap();
        out.push((data, hole));
        at = hole;
    }
    out
}

#[test]
fn shift_18_is_written_as_a_v2_entry_and_v2_entries_read_as_shift_18() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let (a0, a1, a2) = (id("v2", 0), id("v2", 1), id("v2", 2));
    let b = id_at("v3", 16, 0);
    {
        let cache = open(&dir, 64 * MIB);
        cache.put(&a0, &content(&a0, CHUNK_SIZE)).unwrap();
        cache.put(&a1, &content(&a1, CHUNK_SIZE)).unwrap();
        cache.put(&a2, &content(&a2, 5000)).unwrap();
        cache.put(&b, &content(&b, 64 * KIB)).unwrap();
    }
    {
        let db = index(&dir);
        let value = |id| db.get(raw_key(b'c', id)).unwrap().unwrap();
        // What a binary that knows only v2 reads (a rollback keeps these), and v3.
        let v = value(&a2);
        assert_eq!(
            (v.len(), v[0], &v[1..5]),
            (13, 2, &5000u32.to_le_bytes()[..])
        );
        let v = value(&b);
        assert_eq!((v.len(), v[0], v[13]), (14, 3, 16));
        assert_eq!(&v[1..5], &(64 * KIB as u32).to_le_bytes());
        // a1 as an old binary wrote it; a0 as a v3 value of shift 18, which no binary writes.
        db.put(raw_key(b'c', &a1), entry(2, CHUNK_SIZE as u32, 7, None))
            .unwrap();
        db.put(raw_key(b'c', &a0), entry(3, CHUNK_SIZE as u32, 8, Some(18)))
            .unwrap();
    }
    let cache = open(&dir, 64 * MIB);
    let s = cache.stats();
    // a0's entry, and its bytes (unindexed now).
    assert_eq!((s.chunks, s.recovered_orphans), (3, 2), "{s:?}");
    assert_eq!(cache.get(&a1).unwrap().unwrap(), content(&a1, CHUNK_SIZE));
    assert_eq!(cache.get(&a2).unwrap().unwrap(), content(&a2, 5000));
    assert_eq!(cache.get(&b).unwrap().unwrap(), content(&b, 64 * KIB));
    // A v2 entry is a 256 KiB chunk, never one of another chunking.
    assert!(!cache.contains(&id_at("v2", 16, 1)) && !cache.contains(&id_at("v3", 18, 0)));
    assert!(!cache.contains(&a0) && !chunk_has_data(&dir, &a0));
}

#[test]
fn a_blob_whose_entries_mix_shifts_is_dropped_at_open() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let (x0, x1) = (id_at("mixed", 16, 0), id_at("mixed", 16, 1));
    let other = id_at("other", 16, 0);
    {
        let cache = open(&dir, 64 * MIB);
        for c in [x0, x1, other] {
            cache.put(&c, &content(&c, 64 * KIB)).unwrap();
        }
    }
    // x1 rewritten as chunk 1 of 16 KiB, with its size and crc32c values right for the bytes
    // there (x0's second quarter): every entry checks out alone, but together they cannot
    // both be right.
    let quarter = content(&x0, 64 * KIB)[16 << 10..32 << 10].to_vec();
    {
        let db = index(&dir);
        db.put(raw_key(b'c', &x1), entry(3, 16 << 10, 1, Some(14)))
            .unwrap();
        db.put(raw_key(b's', &x1), sums(&quarter)).unwrap();
    }
    let cache = open(&dir, 64 * MIB);
    let s = cache.stats();
    // Both entries and the blob's file go.
    assert_eq!((s.chunks, s.recovered_orphans), (1, 3), "{s:?}");
    for c in [x0, x1, id_at("mixed", 14, 1)] {
        assert!(!cache.contains(&c), "{c:?}");
    }
    assert!(!blob_file(&dir, &x0).exists());
    assert_eq!(
        cache.get(&other).unwrap().unwrap(),
        content(&other, 64 * KIB)
    );
    drop(cache);
    assert_eq!(open(&dir, 64 * MIB).stats().recovered_orphans, 3);
}

#[test]
fn a_put_under_another_shift_replaces_the_blobs_old_chunks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let cache = Arc::new(open(&dir, 64 * MIB));
    let old: Vec<_> = (0..3).map(|i| id("change", i)).collect();
    let old_len = |i: u64| if i == 2 { 1000 } else { CHUNK_SIZE };
    for c in &old {
        cache.put(c, &content(c, old_len(c.index))).unwrap();
    }
    let new1 = id_at("change", 16, 1);
    cache.put(&new1, &content(&new1, 64 * KIB)).unwrap();
    assert!(old.iter().all(|c| !cache.contains(c)));
    assert_eq!(cache.get(&new1).unwrap().unwrap(), content(&new1, 64 * KIB));
    let s = cache.stats();
    assert_eq!((s.chunks, s.bytes, s.shift_conflicts), (1, 64 * KIB, 0));
    // Only the new chunk's slot holds data: the old chunks' bytes went with them.
    let path = blob_file(&dir, &new1);
    assert_eq!(data_ranges(&path), [(64 * KIB, 128 * KIB)]);
    drop(cache);
    let cache = Arc::new(open(&dir, 64 * MIB));
    assert_eq!(cache.stats().chunks, 1);
    assert_eq!(cache.get(&new1).unwrap().unwrap(), content(&new1, 64 * KIB));

    // While the blob's chunks are pinned, a put under yet another shift is skipped (and
    // counted), and the pinned chunks stay; once the pin goes, it replaces them.
    let new0 = id_at("change", 16, 0);
    cache.put(&new0, &content(&new0, 64 * KIB)).unwrap();
    let pin = cache
        .pin_blob(&new0.blob, 16, 2, 64 * KIB)
        .unwrap()
        .unwrap();
    let small = id_at("change", 14, 0);
    cache.put(&small, &content(&small, 16 * KIB)).unwrap();
    assert!(!cache.contains(&small));
    assert!(cache.contains(&new0) && cache.contains(&new1));
    assert_eq!(cache.stats().shift_conflicts, 1);
    let mut whole = vec![0u8; 128 << 10];
    pin.file().read_exact_at(&mut whole, 0).unwrap();
    assert!(whole[..64 << 10] == content(&new0, 64 * KIB)[..]);
    drop(pin);
    // One batch with two shifts of one blob: the first listed wins, the other is skipped.
    let small1 = id_at("change", 14, 1);
    let (d0, d1) = (content(&small, 16 * KIB), content(&new1, 64 * KIB));
    cache
        .put_many(&[(small, &d0[..]), (new1, &d1[..])])
        .unwrap();
    assert!(cache.contains(&small) && !cache.contains(&new0) && !cache.contains(&new1));
    assert_eq!(cache.stats().shift_conflicts, 2);
    cache.put(&small1, &content(&small1, 16 * KIB)).unwrap();
    assert_eq!(data_ranges(&path), [(0, 32 * KIB)]);
    assert_eq!(
        cache.get(&small1).unwrap().unwrap(),
        content(&small1, 16 * KIB)
    );
}

#[test]
fn eviction_and_recovery_punch_exactly_the_chunks_slot() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let chunk = 16 * KIB;
    let c: Vec<_> = (0..3).map(|i| id_at("slots", 14, i)).collect();
    {
        let cache = open(&dir, 3 * chunk);
        // Chunk 1 is the least recently used.
        for i in [1, 0, 2] {
            cache.put(&c[i], &content(&c[i], chunk)).unwrap();
        }
        let other = id_at("slots-other", 14, 0);
        cache.put(&other, &content(&other, chunk)).unwrap();
        assert!(!cache.contains(&c[1]) && cache.contains(&c[0]) && cache.contains(&c[2]));
        assert_eq!(cache.stats().evictions, 1);
    }
    // Chunk 1's slot is a hole, its neighbours' bytes are all there.
    let path = blob_file(&dir, &c[0]);
    assert_eq!(data_ranges(&path), [(0, chunk), (2 * chunk, 3 * chunk)]);
    // Bytes left by a crash in slot 1 and past the last chunk (slot 3): punched at open, in
    // slots of the blob's chunk size, so that chunks 0 and 2 keep theirs.
    let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xaa; 100], chunk + 4000).unwrap();
    f.write_all_at(&[0xbb; 5000], 3 * chunk + 1000).unwrap();
    drop(f);
    let cache = open(&dir, 3 * chunk);
    assert_eq!(cache.stats().recovered_orphans, 2);
    assert_eq!(data_ranges(&path), [(0, chunk), (2 * chunk, 3 * chunk)]);
    for i in [0, 2] {
        assert_eq!(cache.get(&c[i]).unwrap().unwrap(), content(&c[i], chunk));
    }
    // Removing a chunk punches its slot only.
    cache.remove(&c[2]).unwrap();
    assert_eq!(data_ranges(&path), [(0, chunk)]);
    assert_eq!(cache.get(&c[0]).unwrap().unwrap(), content(&c[0], chunk));
}

#[test]
fn direct_runs_join_only_whole_chunks_of_the_blobs_shift() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cache");
    let cache = open(&dir, 64 * MIB);
    let chunk = 16 * KIB;
    // A short chunk in the middle ends a run: chunk 2 is at 2 × 16 KiB, not right after it.
    let sizes = [chunk, 10_000, chunk, chunk];
    let c: Vec<_> = (0..4).map(|i| id_at("direct16", 14, i)).collect();
    for (id, &len) in c.iter().zip(&sizes) {
        cache.put(id, &content(id, len)).unwrap();
    }
    let got = cache.read_chunks_direct(&c[0].blob, 14, 0..4).unwrap();
    assert_eq!(got.len(), 4);
    for ((i, bytes), &len) in got.iter().zip(&sizes) {
        assert_eq!(&bytes[..], &content(&c[*i as usize], len)[..], "chunk {i}");
    }
    assert_eq!(cache.stats().dropped_corrupt, 0);
    // Under another chunking there is nothing to read.
    for shift in [12, 16, MAX_DISK_CHUNK_SHIFT] {
        assert!(cache
            .read_chunks_direct(&c[0].blob, shift, 0..4)
            .unwrap()
            .is_empty());
    }
}
