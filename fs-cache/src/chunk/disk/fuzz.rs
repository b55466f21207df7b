//! Level-2 recovery under fuzzing (`fuzz/fuzz_targets/level2_recovery.rs`): a cache directory
//! whose index and files were built from arbitrary bytes is opened, and what [`DiskCache::open`]
//! keeps must hold up. Not part of the cache's API.
//!
//! The input is a script. Its first two bytes are the capacity (in 4 KiB blocks); then each
//! step is an opcode byte and its operands (bytes past the end read as zeros):
//!
//! | op % 8 | step |
//! | --- | --- |
//! | 0 | a raw index entry: key (≤ 255 bytes), value (≤ 511 bytes) |
//! | 1 | a chunk entry of one of four blobs: index, size, seq, shift (18 as a v2 value; or a shift byte: 12 ..= 18 as the cache writes it, or a raw v3 value with any shift byte), and its crc32c values (none, computed from the blob file as it is now, zeros of the right length, or raw bytes) |
//! | 2 | bytes written into a blob file at an offset (the file created if missing) |
//! | 3 | a blob file cut to a length |
//! | 4 | a stray file or directory in a shard directory |
//! | 5 | the `m/format` value (v3, v2 or raw) or raw `m/counters` |
//! | 6 | a hold: a token (a real file, a missing path or raw bytes), a value that matches the token or raw bytes |
//! | 7 | a blob file replaced by a directory or a symlink |
//!
//! What must hold after the open: usage within the capacity (unless a live hold pins
//! chunks), the kept chunks of a blob share one valid shift and are no larger than their chunk
//! size, every kept chunk reads back as the bytes of its blob file (at `index << shift`) or is
//! dropped as corrupt, a chunk put afterwards (at 64 KiB, so that a blob kept at 256 KiB
//! changes its shift) survives a reopen, and a second open finds nothing left to recover (a
//! third, where a live hold kept the bytes of a chunk dropped meanwhile: the second open
//! finishes that removal).

use std::fs::{self, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rocksdb::DB;

use super::hold::token_id;
use super::index::*;
use super::*;

/// A cursor over the script; reads past its end give zeros.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head.to_vec()
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        let b = self.take(N);
        a[..b.len()].copy_from_slice(&b);
        a
    }

    fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// The four blobs a script can name.
fn blob(sel: u8) -> Digest {
    Digest(*blake3::hash(&[sel % 4]).as_bytes())
}

/// Chunks a script places stay within the first 8 of a blob (files stay small).
const MAX_CHUNKS: u64 = 8;

fn blob_file(dir: &Path, d: &Digest) -> PathBuf {
    let hex = d.to_hex();
    dir.join("blobs").join(&hex[..2]).join(hex)
}

/// Build the directory `dir` (empty or missing) from `data`, open it as a level-2 cache and
/// check what it kept; panics on any violation. `dir` is left empty.
#[doc(hidden)]
pub fn fuzz_recover(data: &[u8], dir: &Path) {
    let mut s = Script(data);
    let capacity = u64::from(s.u16()) * CHECK_BLOCK;
    build(&mut s, dir);
    let config = DiskCacheConfig {
        dir: dir.to_owned(),
        capacity,
    };
    if let Ok(cache) = DiskCache::open(config.clone()) {
        check(cache, &config);
    }
    let _ = fs::remove_dir_all(dir);
    let _ = fs::create_dir_all(dir);
}

fn build(s: &mut Script<'_>, dir: &Path) {
    let index_dir = dir.join("index");
    for shard in 0..=255u8 {
        fs::create_dir_all(dir.join("blobs").join(hex::encode([shard]))).expect("mkdir shard");
    }
    fs::create_dir_all(&index_dir).expect("mkdir index");
    let mut opts = rocksdb::Options::default();
    opts.create_if_missing(true);
    opts.set_compression_type(rocksdb::DBCompressionType::None);
    let db = DB::open(&opts, &index_dir).expect("open a fresh index");
    let put = |k: &[u8], v: &[u8]| db.put(k, v).expect("index put");
    let tokens = dir.join("tokens");
    fs::create_dir_all(&tokens).expect("mkdir tokens");
    while !s.is_empty() {
        match s.u8() % 8 {
            0 => {
                let n = usize::from(s.u8());
                let k = s.take(n);
                let n = usize::from(s.u16() % 512);
                let v = s.take(n);
                put(&k, &v);
            }
            1 => {
                let flags = s.u8();
                let b = blob(flags);
                let index = if flags & 0x80 != 0 {
                    s.u64()
                } else {
                    u64::from(s.u8()) % MAX_CHUNKS
                };
                let raw_size = s.u32();
                let size = if flags & 0x40 != 0 {
                    raw_size
                } else {
                    raw_size % (MAX_CHUNK as u32 + 1)
                };
                let seq = if flags & 0x20 != 0 {
                    s.u64()
                } else {
                    u64::from(s.u16())
                };
                let entry = Entry { size, seq };
                // Shift 18 (a v2 value, as every entry before v3), a shift the cache writes
                // (v2 or v3), or a raw v3 value with any shift byte.
                let (shift, value) = match flags & 0x10 {
                    0 => (
                        MAX_DISK_CHUNK_SHIFT,
                        encode_entry(entry, MAX_DISK_CHUNK_SHIFT),
                    ),
                    _ => match s.u8() {
                        b if b & 0x80 == 0 => {
                            let shift = 12 + b % 7;
                            (shift, encode_entry(entry, shift))
                        }
                        b => {
                            let mut v = vec![ENTRY_V3];
                            v.extend_from_slice(&size.to_le_bytes());
                            v.extend_from_slice(&seq.to_le_bytes());
                            v.push(b & 0x7f);
                            (b & 0x7f, v)
                        }
                    },
                };
                let id = ChunkId {
                    blob: b,
                    shift,
                    index,
                };
                put(&chunk_key(&id), &value);
                let sums = match (flags >> 2) % 4 {
                    0 => None,
                    1 => {
                        // The values of the file's bytes now (zeros where it has none).
                        let mut bytes = vec![0u8; size.min(MAX_CHUNK as u32) as usize];
                        if let (Ok(f), Some(off)) = (
                            fs::File::open(blob_file(dir, &b)),
                            chunk_offset(index, shift),
                        ) {
                            let _ = f.read_at(&mut bytes, off);
                        }
                        Some(block_sums(&bytes))
                    }
                    2 => Some(vec![0u8; sums_len(u64::from(size)).min(1 << 12) as usize]),
                    _ => {
                        let n = usize::from(s.u8());
                        Some(s.take(n))
                    }
                };
                if let Some(sums) = sums {
                    put(&sums_key(&id), &sums);
                }
            }
            2 => {
                let b = blob(s.u8());
                let off = u64::from(s.u32()) % (MAX_CHUNKS * MAX_CHUNK);
                let n = usize::from(s.u16() % 8192);
                let bytes = s.take(n);
                let f = OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(blob_file(dir, &b));
                if let Ok(f) = f {
                    let _ = f.write_all_at(&bytes, off);
                }
            }
            3 => {
                let b = blob(s.u8());
                let len = u64::from(s.u32()) % (MAX_CHUNKS * MAX_CHUNK);
                if let Ok(f) = OpenOptions::new().write(true).open(blob_file(dir, &b)) {
                    let _ = f.set_len(len);
                }
            }
            4 => {
                let shard = hex::encode([s.u8()]);
                let kind = s.u8();
                let n = usize::from(s.u8() % 80);
                let name: String = String::from_utf8_lossy(&s.take(n))
                    .chars()
                    .filter(|c| *c != '/' && *c != '\0')
                    .collect();
                if name.is_empty() || name == "." || name == ".." {
                    continue;
                }
                let path = dir.join("blobs").join(shard).join(name);
                let _ = if kind % 2 == 0 {
                    fs::write(&path, [kind])
                } else {
                    fs::create_dir(&path)
                };
            }
            5 => match s.u8() % 4 {
                0 => put(META_FORMAT, FORMAT),
                1 => put(META_FORMAT, FORMAT_V2),
                2 => {
                    let n = usize::from(s.u8() % 32);
                    put(META_FORMAT, &s.take(n));
                }
                _ => put(META_COUNTERS, &s.array::<COUNTERS_LEN>()),
            },
            6 => {
                let b = blob(s.u8());
                let nonce = s.u64();
                let token = match s.u8() % 4 {
                    0 | 1 => {
                        let t = tokens.join(format!("t{}", nonce % 4));
                        let _ = fs::write(&t, b"token");
                        t
                    }
                    2 => tokens.join("missing"),
                    _ => {
                        let n = usize::from(s.u8() % 64);
                        PathBuf::from(std::ffi::OsStr::from_bytes(&s.take(n)))
                    }
                };
                let mut key = vec![HOLD_KEY_TAG];
                key.extend_from_slice(&b.0);
                key.extend_from_slice(&nonce.to_be_bytes());
                key.extend_from_slice(token.as_os_str().as_bytes());
                let value = match (s.u8() % 2, token_id(&token)) {
                    (0, Ok(id)) => encode_hold_value(&id).to_vec(),
                    _ => s.array::<HOLD_VALUE_LEN>().to_vec(),
                };
                put(&key, &value);
            }
            _ => {
                let b = blob(s.u8());
                let path = blob_file(dir, &b);
                let _ = fs::remove_file(&path);
                let _ = if s.u8() % 2 == 0 {
                    fs::create_dir(&path)
                } else {
                    std::os::unix::fs::symlink(&tokens, &path)
                };
            }
        }
    }
}

fn check(cache: DiskCache, config: &DiskCacheConfig) {
    let st = cache.stats();
    if st.stale_holds == 0 {
        assert!(
            st.bytes <= config.capacity,
            "{} bytes kept in a level 2 of {}",
            st.bytes,
            config.capacity
        );
    }
    let kept: Vec<(ChunkId, Entry)> = cache.lock().lru.iter().map(|(i, e)| (*i, *e)).collect();
    assert_eq!(kept.len() as u64, st.chunks);
    assert_eq!(
        kept.iter()
            .map(|(_, e)| cost(u64::from(e.size)))
            .sum::<u64>(),
        st.bytes
    );
    let mut shifts = std::collections::HashMap::new();
    for (id, entry) in &kept {
        let size = u64::from(entry.size);
        assert!(
            valid_shift(id.shift) && size <= id.chunk_size(),
            "{id:?}: {entry:?}"
        );
        assert_eq!(
            *shifts.entry(id.blob).or_insert(id.shift),
            id.shift,
            "one blob's chunks kept in two shifts"
        );
        if let Ok(Some(bytes)) = cache.get(id) {
            // What a hit returns is what the blob file holds there.
            assert_eq!(bytes.len() as u64, size);
            let mut file = vec![0u8; bytes.len()];
            let f = fs::File::open(cache.blob_path(&id.blob)).expect("a hit's file exists");
            f.read_exact_at(&mut file, chunk_offset(id.index, id.shift).expect("offset"))
                .expect("a hit's bytes are in its file");
            assert!(file == bytes[..], "a hit differs from its file");
        }
    }
    // A chunk put now survives a reopen (when it fits), and nothing is left to recover.
    let id = ChunkId {
        blob: blob(0),
        shift: 16,
        index: 1,
    };
    let chunk: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    // (A chunk the script left cached there is dropped first: a put of a cached chunk only
    // marks it used.)
    let put = cache.remove(&id).is_ok()
        && !cache.contains(&id)
        && cache.put(&id, &chunk).is_ok()
        && cache.contains(&id);
    let flushed = cache.flush().is_ok();
    let before = cache.stats();
    drop(cache);
    let again = DiskCache::open(config.clone()).expect("a recovered level 2 opens again");
    let after = again.stats();
    if flushed {
        if before.stale_holds == 0 {
            assert_eq!(after.recovered_orphans, before.recovered_orphans);
        } else {
            // A chunk dropped while an earlier process's hold pinned it keeps its bytes until
            // that hold ends, which this process cannot see: the next open finishes the
            // removal (and counts it); the open after that finds nothing.
            assert!(after.recovered_orphans >= before.recovered_orphans);
        }
        assert_eq!(after.dropped_corrupt, before.dropped_corrupt);
        assert_eq!(after.evictions, before.evictions);
    }
    assert_eq!((after.chunks, after.bytes), (before.chunks, before.bytes));
    if put {
        assert_eq!(
            again.get(&id).expect("read the put chunk").as_deref(),
            Some(&chunk[..]),
            "a chunk put after recovery did not survive a reopen"
        );
    }
    if flushed && before.stale_holds > 0 && again.flush().is_ok() {
        let settled = again.stats();
        drop(again);
        let third = DiskCache::open(config.clone()).expect("a recovered level 2 opens again");
        let last = third.stats();
        assert_eq!(last.recovered_orphans, settled.recovered_orphans);
        assert_eq!((last.chunks, last.bytes), (settled.chunks, settled.bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds of `fuzz/corpus/<target>/` (committed with the fuzz targets).
    fn seeds(target: &str) -> Vec<Vec<u8>> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/corpus")
            .join(target);
        let mut out: Vec<Vec<u8>> = fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| fs::read(e.unwrap().path()).unwrap())
            .collect();
        out.sort();
        out
    }

    /// The fuzz targets' seeds and a few hundred random scripts, in process: the harness's
    /// checks hold (shifts, entry versions and mixed blobs included) before a fuzzer ever
    /// runs it.
    #[test]
    fn the_level2_fuzz_harnesses_pass_their_seeds_and_random_scripts() {
        for seed in seeds("disk_index") {
            let split = seed
                .first()
                .map_or(0, |&b| usize::from(b) % seed.len().max(1));
            let (key, value) = seed.split_at(split);
            index::fuzz_decode_index(key, value);
            index::fuzz_decode_index(value, key);
        }
        let tmp = tempfile::tempdir().unwrap();
        for seed in seeds("level2_recovery") {
            fuzz_recover(&seed, tmp.path());
        }
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        for _ in 0..200 {
            let len = rng.usize(0..600);
            let script: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            index::fuzz_decode_index(&script[..len / 2], &script[len / 2..]);
            fuzz_recover(&script, tmp.path());
        }
    }
}
