//! User recovery for the ublk frontend: the record a server leaves in its device directory,
//! and the decision the next server of that directory makes from it.
//!
//! - [`UblkRecord`] is `<dir>/strata-bd.ublk.json`: what reattaching needs (device id, the
//!   geometry the kernel granted, device size, the canonical directory, and a random tag the
//!   kernel also keeps for the device), with a blake3 checksum over its body.
//!   [`UblkRecord::encode`] and [`UblkRecord::parse`] are pure and never panic;
//!   [`UblkRecord::read`] and the crate-internal `write` (atomic) and `remove` touch the file.
//! - [`plan`] decides, from the record, the canonical directory, the device size, what the
//!   kernel reports about the recorded id and the [`Recovery`] mode, whether to reattach, add
//!   a new device, replace the old one, wait for it, or refuse ([`Plan`]). A plain function,
//!   tested in-process row by row.
//!
//! This is a submodule of `bd::ublk` (file `bd/recovery.rs`), which re-exports everything
//! public here and holds the kernel side: adding and querying devices
//! ([`UblkDeviceInfo`], [`DevState`]), START/END_USER_RECOVERY and the queues. The on-disk
//! format, the decision table and the invariants are in `ublk-daemon/docs/bd.md`.

use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use overlaybd::SECTOR;
use serde::{Deserialize, Serialize};

use super::{check_geometry, DevState, UblkDeviceInfo, MAX_DEV_ID, RECOVERY_FLAGS};
use crate::{Error, Result};

/// The recovery record's file name inside a device directory.
pub const RECORD_FILE: &str = "strata-bd.ublk.json";
/// The record version this code writes and reads.
pub const RECORD_VERSION: u32 = 1;
/// The largest record read (a record is a few hundred bytes; a path is at most 4 KiB).
const MAX_RECORD: u64 = 16 << 10;

/// What [`serve_ublk`](super::serve_ublk) does about the ublk device a previous server of the
/// same device directory left behind (named by its [`UblkRecord`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recovery {
    /// Reattach to the recorded device when it waits for a server; add a new device when there
    /// is none to reattach to (no record, the device is gone, or it is not this directory's).
    #[default]
    Auto,
    /// Reattach, or fail: never add a new device (`strata bd serve --ublk --recover`).
    Require,
    /// Never reattach: delete the recorded device if it is this directory's (requests the
    /// kernel holds for it fail with EIO) and add a new one (`--new-device`).
    Fresh,
}

/// What a new server needs to reattach to a device directory's ublk device, kept in
/// `<dir>/strata-bd.ublk.json` from the moment the device is added until it is deleted.
///
/// On disk: `{"record":{"version":1,"dev_id":N,"queues":Q,"depth":D,"max_io":B,"size":S,
/// "dir":"/abs/dir","tag":"<16 hex>"},"check":"<64 hex>"}`, where `check` is the blake3 of
/// the `record` object as this code serialises it (compact, fields in this order). Written
/// atomically (temporary file, fsync, rename, directory fsync). Anything else — truncated,
/// damaged, unknown fields, out-of-range values — is [`Error::BadDevice`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UblkRecord {
    /// N of `/dev/ublkbN`, at most [`MAX_DEV_ID`].
    pub dev_id: u32,
    /// Hardware queues the kernel gave the device.
    pub queues: u16,
    /// Tags per queue.
    pub depth: u16,
    /// Bytes per tag buffer (the kernel's `max_io_buf_bytes`).
    pub max_io: u32,
    /// Device size in bytes.
    pub size: u64,
    /// The device directory, canonical (absolute, no `.`/`..`, symlinks resolved): the record
    /// is honoured only there, so a copied directory never takes over the original's device.
    pub dir: PathBuf,
    /// A random non-zero value, also stored by the kernel in the device's `ublksrv_flags` (a
    /// field the driver keeps for the server and never interprets): proof that the device now
    /// at `dev_id` is the one this record describes, not a later device that reused the id.
    pub tag: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordBody {
    version: u32,
    dev_id: u32,
    queues: u16,
    depth: u16,
    max_io: u32,
    size: u64,
    dir: String,
    tag: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordFile {
    record: RecordBody,
    check: String,
}

/// The checksum of a record body: blake3 of its compact serialisation (field order fixed by
/// the struct, integers and strings only, so equal values always give equal bytes).
fn body_check(body: &RecordBody) -> std::result::Result<String, String> {
    let bytes = serde_json::to_vec(body).map_err(|e| e.to_string())?;
    Ok(fs_cache::Digest::of(&bytes).to_hex())
}

/// Whether `s` is `len` lowercase hex digits.
fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl UblkRecord {
    /// The record's bytes as written to disk. Fails only for a directory path that is not
    /// UTF-8 (JSON holds strings).
    pub fn encode(&self) -> std::result::Result<Vec<u8>, String> {
        let dir = self
            .dir
            .to_str()
            .ok_or_else(|| format!("device directory {:?} is not UTF-8", self.dir))?;
        let record = RecordBody {
            version: RECORD_VERSION,
            dev_id: self.dev_id,
            queues: self.queues,
            depth: self.depth,
            max_io: self.max_io,
            size: self.size,
            dir: dir.to_owned(),
            tag: format!("{:016x}", self.tag),
        };
        let check = body_check(&record)?;
        let mut out =
            serde_json::to_vec(&RecordFile { record, check }).map_err(|e| e.to_string())?;
        out.push(b'\n');
        Ok(out)
    }

    /// Parse and check a record's bytes. Every problem is an `Err` with the reason; nothing
    /// here panics on any input.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Self, String> {
        if bytes.len() as u64 > MAX_RECORD {
            return Err(format!(
                "{} bytes is too large for a ublk recovery record",
                bytes.len()
            ));
        }
        let file: RecordFile = serde_json::from_slice(bytes)
            .map_err(|e| format!("not a ublk recovery record: {e}"))?;
        if !is_hex(&file.check, 64) {
            return Err(format!("check {:?} is not 64 hex digits", file.check));
        }
        if body_check(&file.record)? != file.check {
            return Err("checksum mismatch: the record is damaged".into());
        }
        let b = file.record;
        if b.version != RECORD_VERSION {
            return Err(format!("unsupported record version {}", b.version));
        }
        if b.dev_id > MAX_DEV_ID {
            return Err(format!(
                "ublk device id {} is larger than {MAX_DEV_ID}",
                b.dev_id
            ));
        }
        check_geometry(b.queues, b.depth, b.max_io)?;
        if b.size == 0 || b.size % SECTOR != 0 {
            return Err(format!(
                "device size {} is not a positive multiple of 512",
                b.size
            ));
        }
        let dir = PathBuf::from(&b.dir);
        // Absolute, no NUL, only plain components, and nothing `components` would normalise
        // away (`/a/./b`, `//a`, a trailing `/`).
        let canonical_form = dir.is_absolute()
            && !b.dir.contains('\0')
            && dir
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
            && dir.components().collect::<PathBuf>().as_os_str() == dir.as_os_str();
        if !canonical_form {
            return Err(format!("dir {:?} is not a canonical absolute path", b.dir));
        }
        if !is_hex(&b.tag, 16) {
            return Err(format!("tag {:?} is not 16 hex digits", b.tag));
        }
        let tag = u64::from_str_radix(&b.tag, 16).map_err(|e| format!("tag: {e}"))?;
        if tag == 0 {
            return Err("tag is zero".into());
        }
        Ok(Self {
            dev_id: b.dev_id,
            queues: b.queues,
            depth: b.depth,
            max_io: b.max_io,
            size: b.size,
            dir,
            tag,
        })
    }

    /// Read `<dir>/strata-bd.ublk.json`: `None` if there is none, [`Error::BadDevice`] if it
    /// does not parse or check.
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(RECORD_FILE);
        let f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("open", &path, e)),
        };
        let mut bytes = Vec::new();
        f.take(MAX_RECORD + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io("read", &path, e))?;
        Self::parse(&bytes)
            .map(Some)
            .map_err(|reason| Error::BadDevice { path, reason })
    }

    /// Write it to `<dir>/strata-bd.ublk.json` atomically.
    pub(super) fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(RECORD_FILE);
        let body = self.encode().map_err(|reason| Error::BadDevice {
            path: path.clone(),
            reason,
        })?;
        fs_cache::write_atomic(&path, &body).map_err(|e| Error::io("write", &path, e))
    }

    /// Remove `<dir>/strata-bd.ublk.json` (nothing to do if it is gone). Not fsynced: a record
    /// that comes back after a crash names a deleted device, which [`plan`] recognises.
    pub(super) fn remove(dir: &Path) -> Result<()> {
        let path = dir.join(RECORD_FILE);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &path, e)),
        }
    }
}

/// What [`serve_ublk`](super::serve_ublk) does, decided by [`plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Add a new device; `why` says why no recorded device is reattached (`None`: no record).
    Add { why: Option<String> },
    /// Reattach to the recorded device (it is this directory's and waits for a server; its
    /// geometry matches the record's).
    Reattach(UblkRecord),
    /// Delete this device (this directory's, but not reattachable or not wanted), then add a
    /// new one.
    Replace { dev_id: u32, why: String },
    /// The device is this directory's but still LIVE: its old server may still be exiting.
    /// Ask again shortly.
    WaitLive { dev_id: u32, pid: i32 },
}

/// Decide what to do for the device directory `here` (canonical) with a device of `size`
/// bytes, given its record (`None`: none) and what the kernel reports about the recorded id
/// (`None`: no such device; ignored when the record is another directory's). `Err` is a
/// refusal, with the reason.
pub fn plan(
    record: Option<&UblkRecord>,
    here: &Path,
    size: u64,
    kernel: Option<&UblkDeviceInfo>,
    mode: Recovery,
) -> std::result::Result<Plan, String> {
    let new = |why: String| match mode {
        Recovery::Require => Err(format!("no ublk device to reattach: {why}")),
        Recovery::Auto | Recovery::Fresh => Ok(Plan::Add { why: Some(why) }),
    };
    let Some(rec) = record else {
        return match mode {
            Recovery::Require => Err("no ublk device to reattach: none was recorded".into()),
            Recovery::Auto | Recovery::Fresh => Ok(Plan::Add { why: None }),
        };
    };
    let id = rec.dev_id;
    if rec.dir != here {
        return new(format!(
            "the ublk record names {} (this is a copy of that device directory?); device {id} \
             is left alone",
            rec.dir.display()
        ));
    }
    let Some(k) = kernel else {
        return new(format!("ublk device {id} no longer exists"));
    };
    if k.dev_id != id || k.tag != rec.tag {
        return new(format!(
            "ublk device {id} is not the recorded one (tag {:#x}, recorded {:#x}): the id was \
             reused",
            k.tag, rec.tag
        ));
    }
    // The device is this directory's.
    if mode == Recovery::Fresh {
        return Ok(Plan::Replace {
            dev_id: id,
            why: "a new device was asked for".into(),
        });
    }
    match k.state {
        DevState::Quiesced => {
            if (k.queues, k.depth, k.max_io) != (rec.queues, rec.depth, rec.max_io) {
                return Err(format!(
                    "ublk device {id} has {} queues x {} tags of {} bytes, the record {} x {} of \
                     {}",
                    k.queues, k.depth, k.max_io, rec.queues, rec.depth, rec.max_io
                ));
            }
            if k.size != size || rec.size != size {
                return Err(format!(
                    "ublk device {id} has {} bytes (recorded {}), the device directory {size}",
                    k.size, rec.size
                ));
            }
            if k.flags & RECOVERY_FLAGS != RECOVERY_FLAGS {
                return Err(format!(
                    "ublk device {id} lacks user recovery (flags {:#x})",
                    k.flags
                ));
            }
            Ok(Plan::Reattach(rec.clone()))
        }
        DevState::Live => Ok(Plan::WaitLive {
            dev_id: id,
            pid: k.pid,
        }),
        DevState::Dead => match mode {
            Recovery::Require => Err(format!(
                "ublk device {id} is stopped (never started, or taken down): it cannot be \
                 reattached"
            )),
            Recovery::Auto | Recovery::Fresh => Ok(Plan::Replace {
                dev_id: id,
                why: format!("ublk device {id} is stopped and cannot be reattached"),
            }),
        },
        DevState::FailIo | DevState::Other(_) => Err(format!(
            "ublk device {id} is in state {:?}, which cannot be reattached; serve with a new \
             device to replace it",
            k.state
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libublk::sys;

    fn record() -> UblkRecord {
        UblkRecord {
            dev_id: 7,
            queues: 2,
            depth: 64,
            max_io: 512 << 10,
            size: 96 << 20,
            dir: PathBuf::from("/var/lib/strata/bd/vm-1"),
            tag: 0x0123_4567_89ab_cdef,
        }
    }

    /// A record body with any values, with a correct checksum.
    fn encode_body(body: RecordBody) -> Vec<u8> {
        let check = body_check(&body).unwrap();
        serde_json::to_vec(&RecordFile {
            record: body,
            check,
        })
        .unwrap()
    }

    fn body() -> RecordBody {
        let r = record();
        RecordBody {
            version: RECORD_VERSION,
            dev_id: r.dev_id,
            queues: r.queues,
            depth: r.depth,
            max_io: r.max_io,
            size: r.size,
            dir: r.dir.to_str().unwrap().to_owned(),
            tag: format!("{:016x}", r.tag),
        }
    }

    #[test]
    fn record_round_trip() {
        let r = record();
        let bytes = r.encode().unwrap();
        assert_eq!(UblkRecord::parse(&bytes).unwrap(), r);
        assert_eq!(
            bytes,
            encode_body(body())
                .into_iter()
                .chain([b'\n'])
                .collect::<Vec<_>>()
        );
        // Limits are inclusive.
        let edge = UblkRecord {
            dev_id: MAX_DEV_ID,
            queues: 64,
            depth: 4096,
            max_io: 16 << 20,
            size: 512,
            dir: PathBuf::from("/"),
            tag: u64::MAX,
        };
        assert_eq!(UblkRecord::parse(&edge.encode().unwrap()).unwrap(), edge);
        // A path that is not UTF-8 cannot be recorded.
        use std::os::unix::ffi::OsStrExt;
        let bad = UblkRecord {
            dir: PathBuf::from(std::ffi::OsStr::from_bytes(b"/x/\xff")),
            ..record()
        };
        assert!(bad.encode().is_err());
    }

    /// Every truncation of a record is an error (only the final newline may go).
    #[test]
    fn truncated_records_are_errors() {
        let bytes = record().encode().unwrap();
        for len in 0..bytes.len() - 1 {
            let r = UblkRecord::parse(&bytes[..len]);
            assert!(r.is_err(), "a record cut to {len} bytes parsed: {r:?}");
        }
        assert_eq!(
            UblkRecord::parse(&bytes[..bytes.len() - 1]).unwrap(),
            record()
        );
    }

    /// Every single-byte change is an error, or changes nothing the record says (whitespace);
    /// none panics. Garbage of every short length is an error.
    #[test]
    fn damaged_records_are_errors() {
        let good = record();
        let bytes = good.encode().unwrap();
        let mut errors = 0;
        for i in 0..bytes.len() {
            for v in [
                bytes[i] ^ 1,
                bytes[i] ^ 0x80,
                b'0',
                b'9',
                b'"',
                b'}',
                b' ',
                0,
            ] {
                if v == bytes[i] {
                    continue;
                }
                let mut b = bytes.clone();
                b[i] = v;
                match UblkRecord::parse(&b) {
                    Ok(r) => assert_eq!(r, good, "byte {i} = {v:#x} changed the record"),
                    Err(_) => errors += 1,
                }
            }
        }
        assert!(errors > bytes.len() * 6, "{errors} errors");
        let mut rng = fastrand::Rng::with_seed(3);
        for len in 0..600 {
            let mut junk = vec![0u8; len];
            rng.fill(&mut junk);
            assert!(UblkRecord::parse(&junk).is_err());
        }
        let huge = vec![b' '; MAX_RECORD as usize + 1];
        assert!(UblkRecord::parse(&huge).unwrap_err().contains("too large"));
    }

    /// Values out of range are refused even with a correct checksum.
    #[test]
    fn record_values_are_validated() {
        type Change = fn(&mut RecordBody);
        let cases: Vec<(&str, Change)> = vec![
            ("version", |b| b.version = 2),
            ("larger than", |b| b.dev_id = MAX_DEV_ID + 1),
            ("larger than", |b| b.dev_id = u32::MAX),
            ("queues", |b| b.queues = 0),
            ("queues", |b| b.queues = 65),
            ("depth", |b| b.depth = 0),
            ("depth", |b| b.depth = 4097),
            ("max_io", |b| b.max_io = 4095),
            ("max_io", |b| b.max_io = 6000),
            ("max_io", |b| b.max_io = 32 << 20),
            ("size", |b| b.size = 0),
            ("size", |b| b.size = 1000),
            ("dir", |b| b.dir = "relative/dir".into()),
            ("dir", |b| b.dir = "".into()),
            ("dir", |b| b.dir = "/a/../b".into()),
            ("dir", |b| b.dir = "/a/./b".into()),
            ("dir", |b| b.dir = "/a/b/".into()),
            ("dir", |b| b.dir = "//a".into()),
            ("dir", |b| b.dir = "/a\0b".into()),
            ("tag", |b| b.tag = "0000000000000000".into()),
            ("tag", |b| b.tag = "0123456789ABCDEF".into()),
            ("tag", |b| b.tag = "+123456789abcdef".into()),
            ("tag", |b| b.tag = "123".into()),
            ("tag", |b| b.tag = "0123456789abcdef0".into()),
        ];
        for (want, change) in cases {
            let mut b = body();
            change(&mut b);
            let err = UblkRecord::parse(&encode_body(b)).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
        // Unknown fields, a missing field, a bad check, a number out of its type's range.
        let ok = String::from_utf8(encode_body(body())).unwrap();
        for bad in [
            ok.replacen("\"tag\"", "\"extra\":1,\"tag\"", 1),
            ok.replacen("},\"check\"", ",\"more\":true},\"check\"", 1),
            ok.replacen("\"queues\":2,", "", 1),
            ok.replacen("\"queues\":2", "\"queues\":70000", 1),
            ok.replacen("\"queues\":2", "\"queues\":-1", 1),
            ok.replacen("\"queues\":2", "\"queues\":\"2\"", 1),
            format!("{}]", &ok[..ok.len() - 1]),
            format!("{ok}{ok}"),
            format!("[{ok}]"),
        ] {
            assert!(UblkRecord::parse(bad.as_bytes()).is_err(), "{bad}");
        }
        let check_at = ok.find("\"check\":\"").unwrap() + 9;
        let mut short = ok.clone();
        short.replace_range(check_at..check_at + 64, "abc");
        assert!(UblkRecord::parse(short.as_bytes())
            .unwrap_err()
            .contains("64 hex"));
        let mut other = ok.clone();
        other.replace_range(check_at..check_at + 64, &"0".repeat(64));
        assert!(UblkRecord::parse(other.as_bytes())
            .unwrap_err()
            .contains("checksum"));
    }

    /// The record in a device directory: written atomically, read back, absent is `None`,
    /// damage is [`Error::BadDevice`] naming the file.
    #[test]
    fn record_file_in_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(UblkRecord::read(dir.path()).unwrap(), None);
        let r = UblkRecord {
            dir: std::fs::canonicalize(dir.path()).unwrap(),
            ..record()
        };
        r.write(dir.path()).unwrap();
        assert_eq!(UblkRecord::read(dir.path()).unwrap(), Some(r.clone()));
        assert!(!dir.path().join(format!(".{RECORD_FILE}.tmp")).exists());
        let path = dir.path().join(RECORD_FILE);
        let bytes = std::fs::read(&path).unwrap();
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 2] {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            match UblkRecord::read(dir.path()) {
                Err(Error::BadDevice { path: p, reason }) => {
                    assert_eq!(p, path);
                    assert!(!reason.is_empty());
                }
                other => panic!("a record cut to {cut} bytes read as {other:?}"),
            }
        }
        std::fs::write(&path, vec![b' '; MAX_RECORD as usize * 4]).unwrap();
        let e = UblkRecord::read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        UblkRecord::remove(dir.path()).unwrap();
        UblkRecord::remove(dir.path()).unwrap();
        assert_eq!(UblkRecord::read(dir.path()).unwrap(), None);
    }

    fn kernel(rec: &UblkRecord, state: DevState) -> UblkDeviceInfo {
        UblkDeviceInfo {
            dev_id: rec.dev_id,
            state,
            queues: rec.queues,
            depth: rec.depth,
            max_io: rec.max_io,
            flags: RECOVERY_FLAGS | u64::from(sys::UBLK_F_CMD_IOCTL_ENCODE),
            tag: rec.tag,
            pid: 4242,
            size: rec.size,
        }
    }

    /// Every row of the decision between reattaching, adding, replacing and refusing.
    #[test]
    fn recovery_plan() {
        use Recovery::{Auto, Fresh, Require};
        let rec = record();
        let here = rec.dir.clone();
        let size = rec.size;
        let q = kernel(&rec, DevState::Quiesced);
        let p = |r: Option<&UblkRecord>, k: Option<&UblkDeviceInfo>, m| plan(r, &here, size, k, m);
        let adds = |got: std::result::Result<Plan, String>, why: &str| match got {
            Ok(Plan::Add { why: Some(w) }) => assert!(w.contains(why), "{w}"),
            other => panic!("expected a new device ({why}), got {other:?}"),
        };
        let refuses = |got: std::result::Result<Plan, String>, why: &str| match got {
            Err(e) => assert!(e.contains(why), "{e}"),
            other => panic!("expected a refusal ({why}), got {other:?}"),
        };

        // No record: a new device, unless reattaching is required.
        assert_eq!(p(None, None, Auto), Ok(Plan::Add { why: None }));
        assert_eq!(p(None, None, Fresh), Ok(Plan::Add { why: None }));
        refuses(p(None, None, Require), "none was recorded");
        // The record is another directory's (a copy): its device is never touched.
        let elsewhere = UblkRecord {
            dir: PathBuf::from("/elsewhere"),
            ..rec.clone()
        };
        for m in [Auto, Fresh] {
            adds(p(Some(&elsewhere), Some(&q), m), "names /elsewhere");
        }
        refuses(p(Some(&elsewhere), Some(&q), Require), "names /elsewhere");
        // The device is gone, or the id belongs to another device now.
        adds(p(Some(&rec), None, Auto), "no longer exists");
        refuses(p(Some(&rec), None, Require), "no longer exists");
        let reused = UblkDeviceInfo { tag: 99, ..q };
        for m in [Auto, Fresh] {
            adds(p(Some(&rec), Some(&reused), m), "reused");
        }
        refuses(p(Some(&rec), Some(&reused), Require), "reused");
        // Ours and waiting for a server: reattach (or replace, when asked).
        assert_eq!(
            p(Some(&rec), Some(&q), Auto),
            Ok(Plan::Reattach(rec.clone()))
        );
        assert_eq!(
            p(Some(&rec), Some(&q), Require),
            Ok(Plan::Reattach(rec.clone()))
        );
        assert!(matches!(
            p(Some(&rec), Some(&q), Fresh),
            Ok(Plan::Replace { dev_id: 7, .. })
        ));
        // Ours but not as recorded: refuse rather than serve the wrong geometry or size.
        for k in [
            UblkDeviceInfo { queues: 1, ..q },
            UblkDeviceInfo { depth: 128, ..q },
            UblkDeviceInfo { max_io: 4096, ..q },
        ] {
            refuses(p(Some(&rec), Some(&k), Auto), "queues");
        }
        refuses(
            p(Some(&rec), Some(&UblkDeviceInfo { size: 512, ..q }), Auto),
            "bytes",
        );
        refuses(plan(Some(&rec), &here, size * 2, Some(&q), Auto), "bytes");
        refuses(
            p(
                Some(&rec),
                Some(&UblkDeviceInfo {
                    flags: u64::from(sys::UBLK_F_USER_RECOVERY),
                    ..q
                }),
                Auto,
            ),
            "lacks user recovery",
        );
        // Still live: its old server may be exiting; wait.
        let live = kernel(&rec, DevState::Live);
        assert_eq!(
            p(Some(&rec), Some(&live), Auto),
            Ok(Plan::WaitLive {
                dev_id: 7,
                pid: 4242
            })
        );
        // Stopped (never started, or taken down): cannot be reattached; replaced.
        let dead = kernel(&rec, DevState::Dead);
        assert!(matches!(
            p(Some(&rec), Some(&dead), Auto),
            Ok(Plan::Replace { dev_id: 7, .. })
        ));
        refuses(p(Some(&rec), Some(&dead), Require), "stopped");
        // States we never put a device in.
        for s in [DevState::FailIo, DevState::Other(9)] {
            refuses(
                p(Some(&rec), Some(&kernel(&rec, s)), Auto),
                "cannot be reattached",
            );
            assert!(matches!(
                p(Some(&rec), Some(&kernel(&rec, s)), Fresh),
                Ok(Plan::Replace { .. })
            ));
        }
        assert_eq!(DevState::from_raw(0), DevState::Dead);
        assert_eq!(DevState::from_raw(1), DevState::Live);
        assert_eq!(DevState::from_raw(2), DevState::Quiesced);
        assert_eq!(DevState::from_raw(3), DevState::FailIo);
        assert_eq!(DevState::from_raw(77), DevState::Other(77));
    }
}
