//! The writable upper: a local directory with an append-only data file and an index log
//! (byte layout and recovery rules in `docs/format.md`).
//!
//! # Concurrency
//! Appends (writes, discards, flushes) are serialised by one mutex, which also orders the map
//! updates exactly as the log orders the records. Reads take the map's read lock only long
//! enough to copy out the segments they need, then read the data file without any lock: data
//! bytes, once referenced, are never rewritten.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::error::{Error, Result};
use crate::extmap::{ExtentMap, Seg, Target};
use crate::format::{self, LayerId, SealedInfo, MAX_DEVICE_SIZE, MAX_EXTENT_LEN, SECTOR};

/// Magic at the start of an upper's log.
pub const UPPER_MAGIC: [u8; 8] = *b"STRBDUPL";
/// The upper format version.
pub const UPPER_VERSION: u32 = 1;
const DATA_FILE: &str = "data";
const LOG_FILE: &str = "log";

/// The log header, as stored.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RawLogHeader {
    pub magic: [u8; 8],
    pub version: U32,
    pub reserved0: U32,
    pub device_size: U64,
    pub parent_id: [u8; 32],
    pub reserved1: U32,
    pub crc: U32,
}
/// Size of the log header.
pub const LOG_HEADER_SIZE: usize = 64;
const _: () = assert!(std::mem::size_of::<RawLogHeader>() == LOG_HEADER_SIZE);

/// One log record, as stored.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RawRecord {
    pub device_offset: U64,
    pub data_offset: U64,
    pub length: U32,
    pub kind: U32,
    pub data_crc: U32,
    pub crc: U32,
}
/// Size of a log record.
pub const RECORD_SIZE: usize = 32;
const _: () = assert!(std::mem::size_of::<RawRecord>() == RECORD_SIZE);

const KIND_WRITE: u32 = 1;
const KIND_ZERO: u32 = 2;
const KIND_BARRIER: u32 = 3;

impl RawRecord {
    fn new(kind: u32, device_offset: u64, data_offset: u64, length: u64, data_crc: u32) -> Self {
        let mut r = RawRecord {
            device_offset: U64::new(device_offset),
            data_offset: U64::new(data_offset),
            length: U32::new(length as u32),
            kind: U32::new(kind),
            data_crc: U32::new(data_crc),
            crc: U32::new(0),
        };
        r.crc = U32::new(crc32c::crc32c(&r.as_bytes()[..RECORD_SIZE - 4]));
        r
    }
}

/// What opening an upper dropped from the unacknowledged tail of its log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Records (or a partial record) after the last flush that were dropped.
    pub dropped_records: u64,
    /// Log bytes cut off.
    pub dropped_log_bytes: u64,
}

#[derive(Debug)]
struct Appender {
    data_len: u64,
    log_len: u64,
}

/// A writable upper in a local directory.
#[derive(Debug)]
pub struct Upper {
    dir: PathBuf,
    data: File,
    log: File,
    device_size: u64,
    parent: LayerId,
    map: RwLock<ExtentMap>,
    append: Mutex<Appender>,
    recovery: Recovery,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section leaves its data consistent (or the files ahead of it, which
    // recovery handles).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn align_up(v: u64) -> u64 {
    v.div_ceil(SECTOR) * SECTOR
}

impl Upper {
    /// Create an empty upper in `dir` (created if missing) for a device of `device_size`
    /// bytes on top of the layer `parent` (`LayerId::NONE`: on nothing). The header is fsynced
    /// before this returns.
    pub fn create(dir: impl AsRef<Path>, device_size: u64, parent: LayerId) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        if device_size % SECTOR != 0 || device_size > MAX_DEVICE_SIZE {
            return Err(Error::Misaligned {
                what: "device size",
                value: device_size,
            });
        }
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
        let log_path = dir.join(LOG_FILE);
        let log = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&log_path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Error::AlreadyExists(dir.clone()),
                _ => Error::io("create", &log_path, e),
            })?;
        let data_path = dir.join(DATA_FILE);
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&data_path)
            .map_err(|e| Error::io("create", &data_path, e))?;
        let mut h = RawLogHeader {
            magic: UPPER_MAGIC,
            version: U32::new(UPPER_VERSION),
            reserved0: U32::new(0),
            device_size: U64::new(device_size),
            parent_id: parent.0,
            reserved1: U32::new(0),
            crc: U32::new(0),
        };
        h.crc = U32::new(crc32c::crc32c(&h.as_bytes()[..LOG_HEADER_SIZE - 4]));
        log.write_all_at(h.as_bytes(), 0)
            .map_err(|e| Error::io("write", &log_path, e))?;
        data.sync_all()
            .map_err(|e| Error::io("fsync", &data_path, e))?;
        log.sync_all()
            .map_err(|e| Error::io("fsync", &log_path, e))?;
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(Self {
            dir,
            data,
            log,
            device_size,
            parent,
            map: RwLock::new(ExtentMap::new()),
            append: Mutex::new(Appender {
                data_len: 0,
                log_len: LOG_HEADER_SIZE as u64,
            }),
            recovery: Recovery::default(),
        })
    }

    /// Open the upper in `dir`, replaying its log. A torn tail after the last flush is
    /// dropped (and the log truncated there, see [`Upper::recovered`]); damage before it is
    /// [`Error::Corrupt`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        let log_path = dir.join(LOG_FILE);
        let data_path = dir.join(DATA_FILE);
        let what = format!("upper log {}", log_path.display());
        let log = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&log_path)
            .map_err(|e| Error::io("open", &log_path, e))?;
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&data_path)
            .map_err(|e| Error::io("open", &data_path, e))?;
        let log_len = log
            .metadata()
            .map_err(|e| Error::io("stat", &log_path, e))?
            .len();
        let data_len = data
            .metadata()
            .map_err(|e| Error::io("stat", &data_path, e))?
            .len();
        let mut hb = [0u8; LOG_HEADER_SIZE];
        if log_len < LOG_HEADER_SIZE as u64 {
            return Err(Error::corrupt(
                &what,
                format!("{log_len} bytes is shorter than its header"),
            ));
        }
        log.read_exact_at(&mut hb, 0)
            .map_err(|e| Error::io("read", &log_path, e))?;
        let h = RawLogHeader::read_from_bytes(&hb[..])
            .map_err(|_| Error::corrupt(&what, "header does not parse"))?;
        if h.magic != UPPER_MAGIC {
            return Err(Error::corrupt(&what, "bad magic: not a strata upper"));
        }
        if h.crc.get() != crc32c::crc32c(&hb[..LOG_HEADER_SIZE - 4]) {
            return Err(Error::corrupt(&what, "header checksum mismatch"));
        }
        if h.version.get() != UPPER_VERSION {
            return Err(Error::Unsupported {
                what,
                reason: format!("upper version {}", h.version.get()),
            });
        }
        let device_size = h.device_size.get();
        if device_size % SECTOR != 0 || device_size > MAX_DEVICE_SIZE {
            return Err(Error::corrupt(
                &what,
                format!("bad device size {device_size}"),
            ));
        }
        // Read the records in pieces (never the whole log at once).
        let mut records: Vec<RawRecord> = Vec::new();
        let mut pos = LOG_HEADER_SIZE as u64;
        let mut buf = vec![0u8; 1 << 20];
        let mut partial = false;
        while pos < log_len {
            let n = (log_len - pos).min(buf.len() as u64) as usize;
            log.read_exact_at(&mut buf[..n], pos)
                .map_err(|e| Error::io("read", &log_path, e))?;
            let whole = n / RECORD_SIZE * RECORD_SIZE;
            for r in buf[..whole].chunks_exact(RECORD_SIZE) {
                records.push(
                    RawRecord::read_from_bytes(r)
                        .map_err(|_| Error::corrupt(&what, "record does not parse"))?,
                );
            }
            pos += whole as u64;
            if whole < n {
                partial = true; // a partial record at the very end
                break;
            }
        }
        // Each record's own checksum, computed once: it finds the last barrier and is
        // checked again by `check_record`.
        let crc_ok: Vec<bool> = records
            .iter()
            .map(|r| r.crc.get() == crc32c::crc32c(&r.as_bytes()[..RECORD_SIZE - 4]))
            .collect();
        let last_barrier = records
            .iter()
            .zip(&crc_ok)
            .rposition(|(r, &ok)| ok && r.kind.get() == KIND_BARRIER);
        let mut map = ExtentMap::new();
        let mut valid = 0usize;
        for (i, (r, &ok)) in records.iter().zip(&crc_ok).enumerate() {
            let trusted = last_barrier.is_some_and(|b| i <= b);
            match check_record(r, ok, device_size, data_len, &data, trusted) {
                Ok(()) => {}
                Err(reason) if trusted => {
                    return Err(Error::corrupt(
                        &what,
                        format!("record {i} (before the last flush): {reason}"),
                    ));
                }
                Err(_) => break,
            }
            let (dev, len) = (r.device_offset.get(), r.length.get() as u64);
            match r.kind.get() {
                KIND_WRITE => map.insert(
                    dev,
                    len,
                    Target::Data {
                        layer: 0,
                        offset: r.data_offset.get(),
                    },
                ),
                KIND_ZERO => map.insert(dev, len, Target::Zero),
                _ => {}
            }
            valid = i + 1;
        }
        let good_len = LOG_HEADER_SIZE as u64 + (valid * RECORD_SIZE) as u64;
        let recovery = Recovery {
            dropped_records: (records.len() - valid) as u64 + u64::from(partial),
            dropped_log_bytes: log_len - good_len,
        };
        if good_len < log_len {
            log.set_len(good_len)
                .map_err(|e| Error::io("truncate", &log_path, e))?;
            log.sync_all()
                .map_err(|e| Error::io("fsync", &log_path, e))?;
        }
        Ok(Self {
            dir,
            data,
            log,
            device_size,
            parent: LayerId(h.parent_id),
            map: RwLock::new(map),
            append: Mutex::new(Appender {
                data_len: align_up(data_len),
                log_len: good_len,
            }),
            recovery,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn device_size(&self) -> u64 {
        self.device_size
    }

    /// The id of the sealed layer this upper was created on (`LayerId::NONE`: none).
    pub fn parent_id(&self) -> LayerId {
        self.parent
    }

    /// What [`Upper::open`] dropped from the log's unacknowledged tail.
    pub fn recovered(&self) -> Recovery {
        self.recovery
    }

    /// Number of live extents in the map.
    pub fn extent_count(&self) -> usize {
        self.map.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub(crate) fn lookup(&self, lo: u64, hi: u64, out: &mut Vec<Seg>) {
        self.map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .lookup(lo, hi, out);
    }

    pub(crate) fn read_data(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.data
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io("read", self.dir.join(DATA_FILE), e))
    }

    fn check_io(&self, offset: u64, len: u64) -> Result<()> {
        for (what, value) in [("offset", offset), ("length", len)] {
            if value % SECTOR != 0 {
                return Err(Error::Misaligned { what, value });
            }
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.device_size => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                len,
                size: self.device_size,
            }),
        }
    }

    fn append_record(&self, a: &mut Appender, r: &RawRecord) -> Result<()> {
        self.log
            .write_all_at(r.as_bytes(), a.log_len)
            .map_err(|e| Error::io("write", self.dir.join(LOG_FILE), e))?;
        a.log_len += RECORD_SIZE as u64;
        Ok(())
    }

    /// Write `data` at device `offset` (both sector-aligned). Not durable until [`flush`](Self::flush).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_io(offset, data.len() as u64)?;
        // Checksum before taking the append lock: other writers need not wait for it.
        let crcs: Vec<u32> = data
            .chunks(MAX_EXTENT_LEN as usize)
            .map(crc32c::crc32c)
            .collect();
        let mut a = lock(&self.append);
        for (i, (piece, crc)) in data.chunks(MAX_EXTENT_LEN as usize).zip(crcs).enumerate() {
            let dev = offset + i as u64 * MAX_EXTENT_LEN;
            let at = a.data_len;
            self.data
                .write_all_at(piece, at)
                .map_err(|e| Error::io("write", self.dir.join(DATA_FILE), e))?;
            a.data_len += piece.len() as u64;
            let r = RawRecord::new(KIND_WRITE, dev, at, piece.len() as u64, crc);
            self.append_record(&mut a, &r)?;
            self.map.write().unwrap_or_else(|p| p.into_inner()).insert(
                dev,
                piece.len() as u64,
                Target::Data {
                    layer: 0,
                    offset: at,
                },
            );
        }
        Ok(())
    }

    /// Record that `offset..offset+len` (sector-aligned) reads as zeros.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.check_io(offset, len)?;
        let mut a = lock(&self.append);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_EXTENT_LEN);
            let r = RawRecord::new(KIND_ZERO, offset + done, 0, n, 0);
            self.append_record(&mut a, &r)?;
            self.map.write().unwrap_or_else(|p| p.into_inner()).insert(
                offset + done,
                n,
                Target::Zero,
            );
            done += n;
        }
        Ok(())
    }

    /// Make every write and discard before this call durable: fsync the data, append a
    /// barrier record, fsync the log.
    pub fn flush(&self) -> Result<()> {
        let mut a = lock(&self.append);
        self.data
            .sync_data()
            .map_err(|e| Error::io("fsync", self.dir.join(DATA_FILE), e))?;
        let r = RawRecord::new(KIND_BARRIER, 0, 0, 0, 0);
        self.append_record(&mut a, &r)?;
        self.log
            .sync_data()
            .map_err(|e| Error::io("fsync", self.dir.join(LOG_FILE), e))
    }

    /// Seal the upper's current content (nothing below it) into a sealed layer at `out`,
    /// with `parent` = this upper's parent. Only live bytes are copied; writes that arrive
    /// while sealing are not included.
    pub fn seal(&self, out: impl AsRef<Path>) -> Result<SealedInfo> {
        let segs: Vec<Seg> = self
            .map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .segments()
            .collect();
        format::write_layer(
            out.as_ref(),
            self.parent,
            self.device_size,
            &segs,
            |off, buf| self.read_data(buf, off),
        )
    }
}

/// Check one record whose own checksum matched iff `crc_ok`; `trusted` (before the last
/// barrier) skips the data checksum.
fn check_record(
    r: &RawRecord,
    crc_ok: bool,
    device_size: u64,
    data_len: u64,
    data: &File,
    trusted: bool,
) -> Result<(), String> {
    if !crc_ok {
        return Err("record checksum mismatch".into());
    }
    let (dev, doff, len) = (
        r.device_offset.get(),
        r.data_offset.get(),
        r.length.get() as u64,
    );
    let kind = r.kind.get();
    if kind == KIND_BARRIER {
        return Ok(());
    }
    if kind != KIND_WRITE && kind != KIND_ZERO {
        return Err(format!("unknown record kind {kind}"));
    }
    if len == 0 || len % SECTOR != 0 || len > MAX_EXTENT_LEN || dev % SECTOR != 0 {
        return Err(format!("bad extent {dev}+{len}"));
    }
    if dev.checked_add(len).is_none_or(|e| e > device_size) {
        return Err(format!(
            "extent {dev}+{len} past the device ({device_size} bytes)"
        ));
    }
    if kind == KIND_WRITE {
        if doff.checked_add(len).is_none_or(|e| e > data_len) {
            return Err(format!(
                "data {doff}+{len} past the data file ({data_len} bytes)"
            ));
        }
        if !trusted {
            let mut buf = vec![0u8; len.min(1 << 20) as usize];
            let (mut crc, mut done) = (0u32, 0u64);
            while done < len {
                let n = (len - done).min(buf.len() as u64) as usize;
                data.read_exact_at(&mut buf[..n], doff + done)
                    .map_err(|e| e.to_string())?;
                crc = crc32c::crc32c_append(crc, &buf[..n]);
                done += n as u64;
            }
            if crc != r.data_crc.get() {
                return Err("data checksum mismatch (write never completed)".into());
            }
        }
    }
    Ok(())
}
