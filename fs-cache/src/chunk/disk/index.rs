//! The level-2 index's byte encoding (RocksDB keys and values; the table is in the module
//! docs of [`super`]). Decoders return `None` for anything malformed, never panic.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::{chunk_offset, MAX_CHUNK};
use crate::chunk::{ChunkId, MAX_DISK_CHUNK_SHIFT, MIN_CHUNK_SHIFT};
use crate::error::Error;
use crate::store::Digest;

pub(super) const CHUNK_KEY_TAG: u8 = b'c';
pub(super) const SUMS_KEY_TAG: u8 = b's';
pub(super) const CHUNK_KEY_LEN: usize = 1 + 32 + 8;
/// A chunk entry of a 256 KiB chunk (shift 18, the only one there was before v3): `[2][size:
/// u32 LE][seq: u64 LE]`. Still written for shift 18, so that a binary that knows only v2 keeps
/// these entries after a rollback.
pub(super) const ENTRY_V2: u8 = 2;
pub(super) const ENTRY_V2_LEN: usize = 1 + 4 + 8;
/// A chunk entry of any other shift (12 ..= 17): `[3][size: u32 LE][seq: u64 LE][shift: u8]`.
/// A binary that knows only v2 drops these as undecodable (and punches their bytes), which is
/// safe: they are a cache.
pub(super) const ENTRY_V3: u8 = 3;
pub(super) const ENTRY_V3_LEN: usize = 1 + 4 + 8 + 1;
pub(super) const COUNTERS_VERSION: u8 = 1;
pub(super) const COUNTERS_LEN: usize = 1 + 4 * 8;
pub(super) const HOLD_KEY_TAG: u8 = b'h';
pub(super) const HOLD_VALUE_VERSION: u8 = 1;
/// A hold's value: version, boot id (16 bytes), the token's device and inode (u64 LE each).
pub(super) const HOLD_VALUE_LEN: usize = 1 + 16 + 8 + 8;
/// The longest token of a hold (`PATH_MAX`).
pub(super) const MAX_HOLD_TOKEN: usize = 4096;

const _: () = assert!(CHUNK_KEY_LEN == 41);
const _: () = assert!(ENTRY_V2_LEN == 13);
const _: () = assert!(ENTRY_V3_LEN == 14);
const _: () = assert!(COUNTERS_LEN == 33);
const _: () = assert!(HOLD_VALUE_LEN == 33);

/// An indexed chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) size: u32,
    pub(super) seq: u64,
}

pub(super) fn key_with(tag: u8, id: &ChunkId) -> [u8; CHUNK_KEY_LEN] {
    let mut key = [0u8; CHUNK_KEY_LEN];
    key[0] = tag;
    key[1..33].copy_from_slice(&id.blob.0);
    key[33..].copy_from_slice(&id.index.to_be_bytes());
    key
}

pub(super) fn chunk_key(id: &ChunkId) -> [u8; CHUNK_KEY_LEN] {
    key_with(CHUNK_KEY_TAG, id)
}

pub(super) fn sums_key(id: &ChunkId) -> [u8; CHUNK_KEY_LEN] {
    key_with(SUMS_KEY_TAG, id)
}

/// A chunk or crc32c key: its tag, blob and chunk index (the key has no shift: every indexed
/// chunk of a blob has the same one, kept in its entry). Any index whose chunk ends within
/// `u64` at the largest shift qualifies, hence at every shift.
pub(super) fn decode_key(key: &[u8]) -> Option<(u8, Digest, u64)> {
    let key: &[u8; CHUNK_KEY_LEN] = key.try_into().ok()?;
    matches!(key[0], CHUNK_KEY_TAG | SUMS_KEY_TAG).then_some(())?;
    let blob = Digest(key[1..33].try_into().ok()?);
    let index = u64::from_be_bytes(key[33..].try_into().ok()?);
    chunk_offset(index, MAX_DISK_CHUNK_SHIFT)?.checked_add(MAX_CHUNK)?;
    Some((key[0], blob, index))
}

/// A hold's key: tag, blob digest, the pin's nonce (u64 BE: two pins of one blob by one
/// token are two holds), then the token (an absolute path, at most [`MAX_HOLD_TOKEN`] bytes,
/// no NUL); `None` for a token that does not qualify.
pub(super) fn hold_key(blob: &Digest, nonce: u64, token: &Path) -> Option<Vec<u8>> {
    let t = token.as_os_str().as_bytes();
    (token.is_absolute() && t.len() <= MAX_HOLD_TOKEN && !t.contains(&0)).then_some(())?;
    let mut key = Vec::with_capacity(1 + 32 + 8 + t.len());
    key.push(HOLD_KEY_TAG);
    key.extend_from_slice(&blob.0);
    key.extend_from_slice(&nonce.to_be_bytes());
    key.extend_from_slice(t);
    Some(key)
}

/// A hold key: its blob, nonce and token.
pub(super) fn decode_hold_key(key: &[u8]) -> Option<(Digest, u64, PathBuf)> {
    let (&tag, rest) = key.split_first()?;
    (tag == HOLD_KEY_TAG && rest.len() > 40).then_some(())?;
    let blob = Digest(rest[..32].try_into().ok()?);
    let nonce = u64::from_be_bytes(rest[32..40].try_into().ok()?);
    let token = PathBuf::from(OsStr::from_bytes(&rest[40..]));
    (hold_key(&blob, nonce, &token)? == key).then_some((blob, nonce, token))
}

/// Which token a hold was taken by: a token path that exists again later is the same token
/// only in the same boot and as the same file (`hold.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TokenId {
    /// The first 16 bytes of the blake3 of `/proc/sys/kernel/random/boot_id`.
    pub(super) boot: [u8; 16],
    pub(super) dev: u64,
    pub(super) ino: u64,
}

pub(super) fn encode_hold_value(id: &TokenId) -> [u8; HOLD_VALUE_LEN] {
    let mut v = [0u8; HOLD_VALUE_LEN];
    v[0] = HOLD_VALUE_VERSION;
    v[1..17].copy_from_slice(&id.boot);
    v[17..25].copy_from_slice(&id.dev.to_le_bytes());
    v[25..].copy_from_slice(&id.ino.to_le_bytes());
    v
}

pub(super) fn decode_hold_value(v: &[u8]) -> Option<TokenId> {
    let v: &[u8; HOLD_VALUE_LEN] = v.try_into().ok()?;
    (v[0] == HOLD_VALUE_VERSION).then_some(())?;
    Some(TokenId {
        boot: v[1..17].try_into().ok()?,
        dev: u64::from_le_bytes(v[17..25].try_into().ok()?),
        ino: u64::from_le_bytes(v[25..].try_into().ok()?),
    })
}

/// Whether level 2 keeps chunks of `1 << shift` bytes.
pub(super) fn valid_shift(shift: u8) -> bool {
    (MIN_CHUNK_SHIFT..=MAX_DISK_CHUNK_SHIFT).contains(&shift)
}

/// The value of a chunk entry of a chunk of `1 << shift` bytes: v2 for shift 18, v3 otherwise
/// (see [`ENTRY_V2`], [`ENTRY_V3`]).
pub(super) fn encode_entry(entry: Entry, shift: u8) -> Vec<u8> {
    let mut v = Vec::with_capacity(ENTRY_V3_LEN);
    v.push(if shift == MAX_DISK_CHUNK_SHIFT {
        ENTRY_V2
    } else {
        ENTRY_V3
    });
    v.extend_from_slice(&entry.size.to_le_bytes());
    v.extend_from_slice(&entry.seq.to_le_bytes());
    if shift != MAX_DISK_CHUNK_SHIFT {
        v.push(shift);
    }
    v
}

/// A chunk entry and its chunk's shift: a v2 value is shift 18; a v3 value must name a shift
/// of 12 ..= 17 (shift 18 is always written as v2, so a v3 value of it is not one this code
/// wrote); the size is at most `1 << shift`.
pub(super) fn decode_entry(v: &[u8]) -> Option<(Entry, u8)> {
    let (&version, rest) = v.split_first()?;
    let shift = match (version, rest.len()) {
        (ENTRY_V2, 12) => MAX_DISK_CHUNK_SHIFT,
        (ENTRY_V3, 13) => rest[12],
        _ => return None,
    };
    (valid_shift(shift) && (shift == MAX_DISK_CHUNK_SHIFT) == (version == ENTRY_V2))
        .then_some(())?;
    let size = u32::from_le_bytes(rest[..4].try_into().ok()?);
    (u64::from(size) <= 1 << shift).then_some(())?;
    let seq = u64::from_le_bytes(rest[4..12].try_into().ok()?);
    Some((Entry { size, seq }, shift))
}

pub(super) fn encode_counters(c: &[u64; 4]) -> [u8; COUNTERS_LEN] {
    let mut v = [COUNTERS_VERSION; COUNTERS_LEN];
    for (slot, n) in v[1..].chunks_exact_mut(8).zip(c) {
        slot.copy_from_slice(&n.to_le_bytes());
    }
    v
}

pub(super) fn decode_counters(v: &[u8]) -> Option<[u64; 4]> {
    let v: &[u8; COUNTERS_LEN] = v.try_into().ok()?;
    let mut c = [0u64; 4];
    for (n, slot) in c.iter_mut().zip(v[1..].chunks_exact(8)) {
        *n = u64::from_le_bytes(slot.try_into().ok()?);
    }
    (v[0] == COUNTERS_VERSION).then_some(c)
}

pub(super) fn is_rocks_nospace(e: &rocksdb::Error) -> bool {
    let s = e.as_ref();
    s.contains("No space left") || s.contains("Disk quota") || s.contains("NoSpace")
}

pub(super) fn rocks_error(index_dir: &Path, what: &str, e: rocksdb::Error) -> Error {
    Error::Cache {
        path: index_dir.to_path_buf(),
        message: format!("{what}: {e}"),
        source: Some(Box::new(e)),
    }
}

/// Decoders of the index's keys and values, exposed for the fuzz target (`fuzz/`): they must
/// reject any malformed input without panicking.
#[doc(hidden)]
pub fn fuzz_decode_index(key: &[u8], value: &[u8]) {
    if let Some((tag, blob, index)) = decode_key(key) {
        for shift in MIN_CHUNK_SHIFT..=MAX_DISK_CHUNK_SHIFT {
            let id = ChunkId { blob, shift, index };
            assert!(chunk_offset(index, shift).is_some());
            assert_eq!(key_with(tag, &id)[..], key[..]);
        }
    }
    if let Some((entry, shift)) = decode_entry(value) {
        assert!(valid_shift(shift) && u64::from(entry.size) <= 1 << shift);
        assert_eq!(encode_entry(entry, shift)[..], value[..]);
    }
    // An entry built from the input: every size and shift the cache can write decodes back
    // to itself, as v2 exactly for shift 18.
    if let Some((&shift, rest)) = value.split_first() {
        let mut b = [0u8; 12];
        let n = rest.len().min(12);
        b[..n].copy_from_slice(&rest[..n]);
        let shift = MIN_CHUNK_SHIFT + shift % (MAX_DISK_CHUNK_SHIFT - MIN_CHUNK_SHIFT + 1);
        let size = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % ((1 << shift) + 1);
        let entry = Entry {
            size,
            seq: u64::from_le_bytes(b[4..].try_into().unwrap_or_default()),
        };
        let v = encode_entry(entry, shift);
        assert_eq!(v[0] == ENTRY_V2, shift == MAX_DISK_CHUNK_SHIFT);
        assert_eq!(decode_entry(&v), Some((entry, shift)));
    }
    if let Some(c) = decode_counters(value) {
        assert_eq!(encode_counters(&c)[..], value[..]);
    }
    if let Some((blob, nonce, token)) = decode_hold_key(key) {
        assert_eq!(hold_key(&blob, nonce, &token).as_deref(), Some(key));
    }
    if let Some(id) = decode_hold_value(value) {
        assert_eq!(encode_hold_value(&id)[..], value[..]);
    }
}
