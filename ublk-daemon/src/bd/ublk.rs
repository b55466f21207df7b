//! The ublk frontend: the device as `/dev/ublkbN`, served through the kernel's ublk driver
//! (`libublk`, io_uring), with several queues and user recovery.
//!
//! Setup and I/O are kept apart: [`serve_ublk`] adds (or reattaches to) the device and starts
//! one thread per queue; each queue thread runs one task per tag that fetches a request, hands
//! its descriptor to [`handle_io`] (the whole request logic, a plain function tested
//! in-process) and commits the result. [`handle_io`] maps:
//!
//! | ublk op | device | result |
//! | --- | --- | --- |
//! | `READ` | [`Device::read_at`] into the tag's buffer | bytes |
//! | `WRITE` | [`Device::write_at`] from the buffer; with `FUA`, then [`Device::flush`] | bytes |
//! | `FLUSH` | [`Device::flush`] | 0 |
//! | `DISCARD`, `WRITE_ZEROES` | [`Device::discard`] (with `FUA`, then [`Device::flush`]) | 0 |
//! | anything else | — | `-EOPNOTSUPP` |
//!
//! Errors are `-errno` from [`overlaybd::Error::errno`]; a request outside the device or
//! larger than the tag's buffer is `-EINVAL`. The device advertises a volatile write cache and
//! FUA (so the kernel sends `FLUSH` and `FUA` and waits for them) and discard/write-zeroes in
//! 4 KiB units.
//!
//! # User recovery
//!
//! Devices are added with `UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE`. When the
//! serving process dies, the kernel keeps `/dev/ublkbN`, requeues the requests the dead server
//! had fetched but not completed (REISSUE: they are sent again, not failed), holds every new
//! request, and moves the device to `UBLK_S_DEV_QUIESCED`. The next [`serve_ublk`] of the same
//! device directory reads the [`UblkRecord`] the first one wrote (`<dir>/strata-bd.ublk.json`:
//! device id, queues, depth, buffer size, device size, the directory, and a random tag that the
//! kernel also keeps for the device in `ublksrv_flags`), checks that the kernel's device with
//! that id is this directory's (same tag) and waits for a server, sends
//! `START_USER_RECOVERY`, starts the queues again with the same geometry, and the kernel's
//! `END_USER_RECOVERY` makes it live: the held and requeued requests are served by the new
//! process, against the upper it reopened. What decides between reattaching, adding a new
//! device and refusing is [`plan`], a plain function tested in-process; `docs/bd.md` has the
//! table and the invariants.
//!
//! Each queue thread blocks in the device call (a read that misses the chunk cache waits for
//! the fetch): other tags of that queue wait meanwhile, other queues do not.

use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkQueue};
use libublk::{sys, BufDesc, UblkError, UblkFlags};
use overlaybd::{Device, SECTOR};
use serde::{Deserialize, Serialize};

use super::OpenDevice;
use crate::{Error, Result};

/// The ublk driver's control device.
pub const UBLK_CONTROL: &str = "/dev/ublk-control";
/// The recovery record's file name inside a device directory.
pub const RECORD_FILE: &str = "strata-bd.ublk.json";
/// The record version this code writes and reads.
pub const RECORD_VERSION: u32 = 1;
/// The largest record read (a record is a few hundred bytes; a path is at most 4 KiB).
const MAX_RECORD: u64 = 16 << 10;
/// The largest ublk device id: ids are minor numbers (`UBLK_MINORS` = 2^20).
pub const MAX_DEV_ID: u32 = (1 << 20) - 1;
/// The flags every device is added with: kept across a server's death, in-flight I/O reissued.
const RECOVERY_FLAGS: u64 = (sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE) as u64;
/// How long a recorded device that is still LIVE is given to become QUIESCED (its old server
/// may still be exiting) before [`serve_ublk`] gives up with [`Error::Busy`].
const LIVE_WAIT: Duration = Duration::from_secs(10);
/// How long the device is given to go live once the queues run.
const START_WAIT: Duration = Duration::from_secs(30);

/// Whether this kernel has a ublk driver loaded (`/dev/ublk-control` exists).
pub fn ublk_available() -> bool {
    Path::new(UBLK_CONTROL).exists()
}

/// What [`serve_ublk`] does about the ublk device a previous server of the same device
/// directory left behind (named by its [`UblkRecord`]).
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

/// How a ublk device is made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct UblkConfig {
    /// Hardware queues (one thread each), 1..=64. A reattached device keeps its own.
    pub queues: u16,
    /// Requests in flight per queue, 1..=4096. A reattached device keeps its own.
    pub depth: u16,
    /// The largest request in bytes (the tag buffer size), 4 KiB..=16 MiB, a multiple of 4 KiB.
    /// A reattached device keeps its own.
    pub max_io: u32,
    /// What to do with a device left by a server that died.
    pub recovery: Recovery,
}

impl Default for UblkConfig {
    /// 2 queues of depth 64, 512 KiB requests, reattach when possible.
    fn default() -> Self {
        Self {
            queues: 2,
            depth: 64,
            max_io: 512 << 10,
            recovery: Recovery::Auto,
        }
    }
}

/// The geometry limits shared by [`UblkConfig`] and [`UblkRecord`].
fn check_geometry(queues: u16, depth: u16, max_io: u32) -> std::result::Result<(), String> {
    if !(1..=64).contains(&queues) {
        return Err(format!("queues must be 1..=64, got {queues}"));
    }
    if !(1..=4096).contains(&depth) {
        return Err(format!("depth must be 1..=4096, got {depth}"));
    }
    if !(4096..=(16 << 20)).contains(&max_io) || max_io % 4096 != 0 {
        return Err(format!(
            "max_io must be a multiple of 4096 in 4096..=16777216, got {max_io}"
        ));
    }
    Ok(())
}

impl UblkConfig {
    fn check(&self) -> Result<()> {
        check_geometry(self.queues, self.depth, self.max_io).map_err(Error::InvalidConfig)
    }
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
    fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(RECORD_FILE);
        let tmp = dir.join(format!(".{RECORD_FILE}.tmp"));
        let body = self.encode().map_err(|reason| Error::BadDevice {
            path: path.clone(),
            reason,
        })?;
        crate::write_atomic(&path, &tmp, &body).map_err(|e| Error::io("write", &path, e))
    }

    /// Remove `<dir>/strata-bd.ublk.json` (nothing to do if it is gone). Not fsynced: a record
    /// that comes back after a crash names a deleted device, which [`plan`] recognises.
    fn remove(dir: &Path) -> Result<()> {
        let path = dir.join(RECORD_FILE);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &path, e)),
        }
    }
}

/// A ublk device's state (`UBLK_S_DEV_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DevState {
    /// Added but never started, or stopped: no `/dev/ublkbN`.
    Dead,
    /// Served.
    Live,
    /// Its server died (or quiesced it); the kernel holds its requests for the next server.
    Quiesced,
    /// Its server died and its requests fail (`UBLK_F_USER_RECOVERY_FAIL_IO`; never ours).
    FailIo,
    /// A state this code does not know.
    Other(u16),
}

impl DevState {
    fn from_raw(s: u16) -> Self {
        match u32::from(s) {
            sys::UBLK_S_DEV_DEAD => DevState::Dead,
            sys::UBLK_S_DEV_LIVE => DevState::Live,
            sys::UBLK_S_DEV_QUIESCED => DevState::Quiesced,
            sys::UBLK_S_DEV_FAIL_IO => DevState::FailIo,
            _ => DevState::Other(s),
        }
    }
}

/// What the kernel reports about one ublk device (`GET_DEV_INFO` + `GET_PARAMS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UblkDeviceInfo {
    pub dev_id: u32,
    pub state: DevState,
    pub queues: u16,
    pub depth: u16,
    pub max_io: u32,
    /// `UBLK_F_*` as the driver granted them.
    pub flags: u64,
    /// `ublksrv_flags`: the tag of a device we added.
    pub tag: u64,
    /// The pid of the server that started (or last recovered) it; -1 once stopped.
    pub pid: i32,
    /// Capacity in bytes (0 before its parameters were set).
    pub size: u64,
}

/// Ask the kernel about ublk device `id`: `None` if there is no such device (or no driver).
pub fn ublk_device_info(id: u32) -> Result<Option<UblkDeviceInfo>> {
    if id > MAX_DEV_ID {
        return Err(Error::InvalidConfig(format!(
            "ublk device id {id} is larger than {MAX_DEV_ID}"
        )));
    }
    if !ublk_available() {
        return Ok(None);
    }
    // `new_simple` sends GET_DEV_INFO; it cannot panic here: the id is checked above.
    let ctrl = match UblkCtrl::new_simple(id as i32) {
        Ok(c) => c,
        Err(e) if ublk_errno(&e) == libc::ENODEV => return Ok(None),
        Err(e) => return Err(ublk_err("query ublk device", e)),
    };
    let d = ctrl.dev_info();
    let mut params = sys::ublk_params::default();
    ublk_ok("read ublk device parameters", ctrl.get_params(&mut params))?;
    let size = if params.types & sys::UBLK_PARAM_TYPE_BASIC != 0 {
        params.basic.dev_sectors.saturating_mul(SECTOR)
    } else {
        0
    };
    Ok(Some(UblkDeviceInfo {
        dev_id: d.dev_id,
        state: DevState::from_raw(d.state),
        queues: d.nr_hw_queues,
        depth: d.queue_depth,
        max_io: d.max_io_buf_bytes,
        flags: d.flags,
        tag: d.ublksrv_flags,
        pid: d.ublksrv_pid,
        size,
    }))
}

/// What [`serve_ublk`] does, decided by [`plan`].
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

/// One ublk I/O descriptor, as the driver hands it over (`struct ublksrv_io_desc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoDesc {
    /// `UBLK_IO_OP_*` in the low 8 bits, `UBLK_IO_F_*` above.
    pub op_flags: u32,
    /// First 512-byte sector.
    pub start_sector: u64,
    /// Number of 512-byte sectors.
    pub nr_sectors: u32,
}

impl IoDesc {
    /// The operation (`UBLK_IO_OP_*`).
    pub fn op(&self) -> u32 {
        self.op_flags & 0xff
    }

    /// Whether the request carries `FUA` (durable before completion).
    pub fn fua(&self) -> bool {
        self.op_flags & sys::UBLK_IO_F_FUA != 0
    }
}

impl From<&sys::ublksrv_io_desc> for IoDesc {
    fn from(d: &sys::ublksrv_io_desc) -> Self {
        Self {
            op_flags: d.op_flags,
            start_sector: d.start_sector,
            nr_sectors: d.nr_sectors,
        }
    }
}

/// Serve one request against `device`, with `buf` the tag's data buffer. Returns what the
/// driver expects: bytes transferred for reads and writes, 0 for flush and discard, `-errno`
/// on failure.
pub fn handle_io(device: &Device, iod: &IoDesc, buf: &mut [u8]) -> i32 {
    let fail = |e: overlaybd::Error| {
        tracing::warn!(op = iod.op(), sector = iod.start_sector, sectors = iod.nr_sectors,
            error = %e, "ublk request failed");
        -e.errno()
    };
    let Some(offset) = iod.start_sector.checked_mul(SECTOR) else {
        return -libc::EINVAL;
    };
    let len = u64::from(iod.nr_sectors) * SECTOR;
    // A forced-unit-access write or discard is durable before it completes.
    let fua = || if iod.fua() { device.flush() } else { Ok(()) };
    match iod.op() {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE => {
            let Some(data) = buf.get_mut(..len as usize) else {
                return -libc::EINVAL;
            };
            let done = if iod.op() == sys::UBLK_IO_OP_READ {
                device.read_at(offset, data)
            } else {
                device.write_at(offset, data).and_then(|()| fua())
            };
            match done {
                Ok(()) => len as i32,
                Err(e) => fail(e),
            }
        }
        sys::UBLK_IO_OP_FLUSH => match device.flush() {
            Ok(()) => 0,
            Err(e) => fail(e),
        },
        sys::UBLK_IO_OP_DISCARD | sys::UBLK_IO_OP_WRITE_ZEROES => {
            let done = device.discard(offset, len).and_then(|()| fua());
            match done {
                Ok(()) => 0,
                Err(e) => fail(e),
            }
        }
        _ => -libc::EOPNOTSUPP,
    }
}

/// The errno inside a libublk error.
fn ublk_errno(e: &UblkError) -> i32 {
    match e {
        UblkError::IOError(io) => io.raw_os_error().unwrap_or(libc::EIO),
        UblkError::OtherError(n) | UblkError::UringIOError(n) => n.abs(),
        _ => libc::EIO,
    }
}

fn ublk_err(op: &'static str, e: UblkError) -> Error {
    Error::Ublk {
        op,
        errno: ublk_errno(&e),
        reason: e.to_string(),
    }
}

/// A control command's result: libublk returns some refusals (`-EBUSY`) as `Ok(negative)`.
fn ublk_ok(op: &'static str, r: std::result::Result<i32, UblkError>) -> Result<i32> {
    match r {
        Ok(n) if n < 0 => Err(Error::Ublk {
            op,
            errno: -n,
            reason: std::io::Error::from_raw_os_error(-n).to_string(),
        }),
        Ok(n) => Ok(n),
        Err(e) => Err(ublk_err(op, e)),
    }
}

/// A random non-zero tag for a new device.
fn new_tag() -> Result<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into the local array `b`, which lives
    // across the call; no other memory is touched.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return Err(Error::io(
            "getrandom",
            "(ublk device tag)",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(u64::from_ne_bytes(b) | 1)
}

/// The device directory as the record names it: canonical and UTF-8.
fn canonical_dir(dir: &Path) -> Result<PathBuf> {
    let c = std::fs::canonicalize(dir).map_err(|e| Error::io("resolve", dir, e))?;
    if c.to_str().is_none() {
        return Err(Error::InvalidConfig(format!(
            "ublk recovery needs a UTF-8 device directory path, not {c:?}"
        )));
    }
    Ok(c)
}

/// A live ublk device. [`BdUblk::stop`] (or dropping it) stops the queues, flushes the device,
/// deletes `/dev/ublkbN` and removes the recovery record. It holds the device directory's lock
/// for as long as it serves.
pub struct BdUblk {
    ctrl: Arc<UblkCtrl>,
    open: OpenDevice,
    dir: PathBuf,
    dev_id: u32,
    recovered: bool,
    thread: Option<JoinHandle<Result<()>>>,
}

impl std::fmt::Debug for BdUblk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BdUblk")
            .field("dev_id", &self.dev_id)
            .field("dir", &self.dir)
            .field("recovered", &self.recovered)
            .finish()
    }
}

/// Serve the opened device directory `dev` as `/dev/ublkbN` until [`BdUblk::stop`]: reattach
/// to the ublk device a dead server of this directory left (per [`UblkConfig::recovery`] and
/// [`plan`]), or add a new one and record it. Returns once `/dev/ublkbN` is live. Needs root
/// and the ublk driver.
pub fn serve_ublk(dev: OpenDevice, cfg: &UblkConfig) -> Result<BdUblk> {
    cfg.check()?;
    if !ublk_available() {
        return Err(Error::io(
            "open",
            UBLK_CONTROL,
            std::io::Error::from_raw_os_error(libc::ENOENT),
        ));
    }
    let here = canonical_dir(dev.dir())?;
    let size = dev.device.size();
    let record = match UblkRecord::read(&here) {
        Ok(r) => r,
        Err(e) if cfg.recovery == Recovery::Fresh => {
            tracing::warn!(error = %e, "ignoring an unreadable ublk record for a new device");
            None
        }
        Err(e) => return Err(e),
    };
    let deadline = Instant::now() + LIVE_WAIT;
    let (ctrl, recovered) = loop {
        let kernel = match &record {
            Some(r) if r.dir == here => ublk_device_info(r.dev_id)?,
            _ => None,
        };
        let decided = plan(record.as_ref(), &here, size, kernel.as_ref(), cfg.recovery).map_err(
            |reason| Error::BadDevice {
                path: here.clone(),
                reason,
            },
        )?;
        match decided {
            Plan::WaitLive { dev_id, pid } => {
                if Instant::now() >= deadline {
                    return Err(Error::Busy {
                        path: here,
                        what: format!(
                            "ublk device {dev_id} is still live, served by pid {pid}: another \
                             server runs it, or its old server has not finished exiting"
                        ),
                    });
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Plan::Reattach(rec) => break (reattach(&rec)?, true),
            Plan::Replace { dev_id, why } => {
                tracing::warn!(dev_id, reason = %why, "deleting this directory's old ublk device");
                delete_device(dev_id)?;
                break (add(cfg, size, &here)?, false);
            }
            Plan::Add { why } => {
                if let Some(why) = why {
                    tracing::info!(reason = %why, "adding a new ublk device");
                }
                break (add(cfg, size, &here)?, false);
            }
        }
    };
    start(ctrl, dev, here, recovered)
}

/// Delete ublk device `id` without waiting for its users to let go (a filesystem still
/// mounted on it must not make this hang); gone already is fine.
fn delete_device(id: u32) -> Result<()> {
    let old = match UblkCtrl::new_simple(id as i32) {
        Ok(c) => c,
        Err(e) if ublk_errno(&e) == libc::ENODEV => return Ok(()),
        Err(e) => return Err(ublk_err("open ublk device", e)),
    };
    ublk_ok("delete ublk device", old.del_dev_async()).map(|_| ())
}

/// Add a new device with user recovery and a fresh tag, and record it before it is started: a
/// crash from here on leaves a record naming the device (which [`plan`] replaces when it never
/// went live, and reattaches when it did).
fn add(cfg: &UblkConfig, size: u64, here: &Path) -> Result<Arc<UblkCtrl>> {
    let tag = new_tag()?;
    let ctrl = UblkCtrlBuilder::default()
        .name("strata-bd")
        .id(-1)
        .nr_queues(cfg.queues)
        .depth(cfg.depth)
        .io_buf_bytes(cfg.max_io)
        .ctrl_flags(RECOVERY_FLAGS)
        .ctrl_target_flags(tag)
        .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
        .build()
        .map_err(|e| ublk_err("add ublk device", e))?;
    let info = ctrl.dev_info();
    if info.flags & RECOVERY_FLAGS != RECOVERY_FLAGS {
        tracing::warn!(
            dev_id = info.dev_id,
            flags = info.flags,
            "this ublk driver does not keep devices for recovery: /dev/ublkb{} goes away if \
             this process dies",
            info.dev_id
        );
    }
    let rec = UblkRecord {
        dev_id: info.dev_id,
        queues: info.nr_hw_queues,
        depth: info.queue_depth,
        max_io: info.max_io_buf_bytes,
        size,
        dir: here.to_owned(),
        tag,
    };
    // On failure `ctrl` is dropped, which deletes the device it added.
    rec.write(here)?;
    Ok(Arc::new(ctrl))
}

/// Take over the recorded device: START_USER_RECOVERY (the kernel waits until the dead
/// server's `/dev/ublkcN` is closed, libublk retries EBUSY for up to 30 s), then a control for
/// the same id and geometry whose start sends END_USER_RECOVERY.
fn reattach(rec: &UblkRecord) -> Result<Arc<UblkCtrl>> {
    let id = rec.dev_id as i32;
    {
        let old = UblkCtrl::new_simple(id).map_err(|e| ublk_err("open ublk device", e))?;
        ublk_ok("start user recovery", old.start_user_recover())?;
    }
    let ctrl = UblkCtrlBuilder::default()
        .name("strata-bd")
        .id(id)
        .nr_queues(rec.queues)
        .depth(rec.depth)
        .io_buf_bytes(rec.max_io)
        .ctrl_flags(RECOVERY_FLAGS)
        .ctrl_target_flags(rec.tag)
        .dev_flags(UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        .build()
        .map_err(|e| ublk_err("reopen ublk device", e))?;
    let info = ctrl.dev_info();
    if (info.nr_hw_queues, info.queue_depth, info.ublksrv_flags) != (rec.queues, rec.depth, rec.tag)
    {
        return Err(Error::BadDevice {
            path: rec.dir.clone(),
            reason: format!("ublk device {id} changed while it was being reattached"),
        });
    }
    tracing::info!(dev_id = id, "reattaching to ublk device");
    Ok(Arc::new(ctrl))
}

/// Run the device's control thread (queues, then START_DEV or END_USER_RECOVERY) and wait
/// until `/dev/ublkbN` is live.
fn start(ctrl: Arc<UblkCtrl>, open: OpenDevice, dir: PathBuf, recovered: bool) -> Result<BdUblk> {
    let dev_id = ctrl.dev_info().dev_id;
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let device = open.device.clone();
    let size = device.size();
    let thread = {
        let ctrl = ctrl.clone();
        std::thread::Builder::new()
            .name(format!("ublk{dev_id}-ctrl"))
            .spawn(move || {
                ctrl.run_target(
                    |dev: &mut UblkDev| {
                        set_params(dev, size);
                        Ok(())
                    },
                    move |qid, dev| serve_queue(qid, dev, &device),
                    move |_ctrl: &UblkCtrl| {
                        let _ = started_tx.send(());
                    },
                )
                .map(|_| ())
                .map_err(|e| ublk_err("run ublk device", e))
            })
            .map_err(|e| Error::io("spawn ublk thread for", format!("ublk{dev_id}"), e))?
    };
    let mut served = BdUblk {
        ctrl,
        open,
        dir,
        dev_id,
        recovered,
        thread: Some(thread),
    };
    if started_rx.recv_timeout(START_WAIT).is_err() {
        // The control thread ended (or hung) before the device went live.
        let why = served.shutdown().err();
        return Err(why.unwrap_or(Error::Ublk {
            op: "start ublk device",
            errno: libc::EIO,
            reason: format!(
                "the device did not go live within {} s",
                START_WAIT.as_secs()
            ),
        }));
    }
    Ok(served)
}

/// Whether the ublk device recorded in `dev`'s directory still exists in the kernel and is
/// this directory's (LIVE, or QUIESCED waiting for its server): then no other frontend may
/// serve the upper, or the requests the kernel holds would later land on a changed device.
/// Returns its id.
pub fn pending_ublk_device(dev: &OpenDevice) -> Result<Option<u32>> {
    // Not `canonical_dir`: a directory whose path is not UTF-8 has no record of its own (one
    // cannot be written for it), and must still be servable over FUSE.
    let here = std::fs::canonicalize(dev.dir()).map_err(|e| Error::io("resolve", dev.dir(), e))?;
    let Some(rec) = UblkRecord::read(&here)? else {
        return Ok(None);
    };
    if rec.dir != here {
        return Ok(None);
    }
    Ok(match ublk_device_info(rec.dev_id)? {
        Some(k) if k.tag == rec.tag && matches!(k.state, DevState::Live | DevState::Quiesced) => {
            Some(rec.dev_id)
        }
        _ => None,
    })
}

/// Basic parameters (size, 512-byte logical / 4 KiB physical blocks, volatile cache + FUA) and
/// discard / write-zeroes in 4 KiB units.
fn set_params(dev: &mut UblkDev, size: u64) {
    dev.set_default_params(size);
    let max_sectors = dev.dev_info.max_io_buf_bytes >> 9;
    let p = &mut dev.tgt.params;
    p.basic.attrs |= sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
    p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
    p.discard.discard_granularity = 4096;
    p.discard.max_discard_sectors = max_sectors;
    p.discard.max_write_zeroes_sectors = max_sectors;
    p.discard.max_discard_segments = 1;
}

/// One queue: a task per tag on a single-threaded executor, driven by the queue's io_uring.
fn serve_queue(qid: u16, dev: &UblkDev, device: &Arc<Device>) {
    let q = match UblkQueue::new(qid, dev) {
        Ok(q) => std::rc::Rc::new(q),
        Err(e) => {
            tracing::error!(qid, error = %e, "creating a ublk queue failed");
            return;
        }
    };
    let exe = std::rc::Rc::new(smol::LocalExecutor::new());
    let mut tasks = Vec::new();
    for tag in 0..dev.dev_info.queue_depth {
        let q = q.clone();
        let device = device.clone();
        tasks.push(exe.spawn(async move {
            match tag_loop(&q, tag, &device).await {
                Ok(()) | Err(UblkError::QueueIsDown) => {}
                Err(e) => tracing::error!(qid, tag, error = %e, "ublk tag loop failed"),
            }
        }));
    }
    let driver = exe.clone();
    smol::block_on(exe.run(async move {
        let run_ops = || while driver.try_tick() {};
        let done = || tasks.iter().all(|t| t.is_finished());
        if let Err(e) = libublk::wait_and_handle_io_events(&q, Some(20), run_ops, done).await {
            tracing::error!(qid, error = %e, "ublk queue event loop failed");
        }
    }));
}

/// Fetch, serve and commit requests of one tag until the queue goes down.
async fn tag_loop(q: &UblkQueue<'_>, tag: u16, device: &Device) -> Result<(), UblkError> {
    let mut buf = IoBuf::<u8>::new(q.dev.dev_info.max_io_buf_bytes as usize);
    q.submit_io_prep_cmd(tag, BufDesc::Slice(buf.as_slice()), 0, Some(&buf))
        .await?;
    loop {
        let iod = IoDesc::from(q.get_iod(tag));
        let res = handle_io(device, &iod, buf.as_mut_slice());
        q.submit_io_commit_cmd(tag, BufDesc::Slice(buf.as_slice()), res)
            .await?;
    }
}

impl BdUblk {
    /// The device id N (of `/dev/ublkbN`).
    pub fn dev_id(&self) -> u32 {
        self.dev_id
    }

    /// `/dev/ublkbN`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.dev_id))
    }

    /// The device served.
    pub fn device(&self) -> &Arc<Device> {
        &self.open.device
    }

    /// The device directory (canonical).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether this server reattached to a device a dead server left (rather than adding one).
    pub fn recovered(&self) -> bool {
        self.recovered
    }

    /// Stop the queues, flush the device, delete `/dev/ublkbN` and remove the record.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        // Stopping ends the queues (their commands come back aborted), then run_target returns.
        let killed = self.ctrl.kill_dev();
        let ran = thread.join().unwrap_or_else(|_| {
            Err(Error::Ublk {
                op: "run ublk device",
                errno: libc::EIO,
                reason: "the control thread panicked".into(),
            })
        });
        // No request is in flight any more: this covers every acknowledged write.
        let flushed = self.open.device.flush();
        let deleted = self.ctrl.del_dev();
        // The record goes only with the device: while the device exists, it names it.
        let unrecorded = match &deleted {
            Ok(_) => UblkRecord::remove(&self.dir),
            Err(_) => Ok(()),
        };
        flushed?;
        killed.map_err(|e| ublk_err("stop ublk device", e))?;
        ran?;
        deleted.map_err(|e| ublk_err("delete ublk device", e))?;
        unrecorded
    }
}

impl Drop for BdUblk {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(dev_id = self.dev_id, error = %e, "stopping ublk device");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use overlaybd::{LayerId, Upper};

    const SIZE: u64 = 4 << 20;

    fn device(dir: &Path) -> Device {
        let upper = Upper::create(dir.join("upper"), SIZE, LayerId::NONE).unwrap();
        Device::open(Vec::new(), Some(upper)).unwrap()
    }

    fn iod(op: u32, flags: u32, sector: u64, sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: op | flags,
            start_sector: sector,
            nr_sectors: sectors,
        }
    }

    /// Random requests against the device and a plain byte array: every read returns what the
    /// array holds, results are what the driver expects, and the content survives a reopen
    /// after a final FLUSH.
    #[test]
    fn requests_match_a_model() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path());
        let mut model = vec![0u8; SIZE as usize];
        let mut rng = fastrand::Rng::with_seed(6);
        let mut buf = vec![0u8; 256 << 10];
        let sectors = (SIZE / SECTOR) as u32;
        for round in 0..600 {
            let n = rng.u32(1..=(buf.len() as u32 / 512));
            let start = u64::from(rng.u32(0..=(sectors - n)));
            let (lo, hi) = (
                (start * SECTOR) as usize,
                (start * SECTOR) as usize + n as usize * 512,
            );
            match rng.u32(0..10) {
                0..=3 => {
                    rng.fill(&mut buf[..hi - lo]);
                    let fua = if round % 7 == 0 {
                        sys::UBLK_IO_F_FUA
                    } else {
                        0
                    };
                    let r = handle_io(&dev, &iod(sys::UBLK_IO_OP_WRITE, fua, start, n), &mut buf);
                    assert_eq!(r, (hi - lo) as i32);
                    model[lo..hi].copy_from_slice(&buf[..hi - lo]);
                }
                4 => {
                    let op = if rng.bool() {
                        sys::UBLK_IO_OP_DISCARD
                    } else {
                        sys::UBLK_IO_OP_WRITE_ZEROES
                    };
                    assert_eq!(handle_io(&dev, &iod(op, 0, start, n), &mut buf), 0);
                    model[lo..hi].fill(0);
                }
                5 => assert_eq!(
                    handle_io(&dev, &iod(sys::UBLK_IO_OP_FLUSH, 0, 0, 0), &mut buf),
                    0
                ),
                _ => {
                    buf.fill(0xAA);
                    let r = handle_io(&dev, &iod(sys::UBLK_IO_OP_READ, 0, start, n), &mut buf);
                    assert_eq!(r, (hi - lo) as i32);
                    assert!(
                        buf[..hi - lo] == model[lo..hi],
                        "round {round}: read differs"
                    );
                }
            }
        }
        assert_eq!(
            handle_io(&dev, &iod(sys::UBLK_IO_OP_FLUSH, 0, 0, 0), &mut buf),
            0
        );
        drop(dev);
        let upper = Upper::open(dir.path().join("upper")).unwrap();
        let dev = Device::open(Vec::new(), Some(upper)).unwrap();
        let mut all = vec![0u8; SIZE as usize];
        dev.read_at(0, &mut all).unwrap();
        assert!(all == model, "content after reopen differs from the model");
    }

    /// Bad requests get the errno the driver passes on, and change nothing.
    #[test]
    fn bad_requests_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path());
        let mut buf = vec![0u8; 8192];
        let last = SIZE / SECTOR;
        // Past the end of the device.
        let r = handle_io(&dev, &iod(sys::UBLK_IO_OP_WRITE, 0, last - 1, 2), &mut buf);
        assert_eq!(r, -libc::EINVAL);
        let r = handle_io(&dev, &iod(sys::UBLK_IO_OP_READ, 0, last, 1), &mut buf);
        assert_eq!(r, -libc::EINVAL);
        let r = handle_io(&dev, &iod(sys::UBLK_IO_OP_DISCARD, 0, last, 8), &mut buf);
        assert_eq!(r, -libc::EINVAL);
        // A sector number whose byte offset overflows.
        let r = handle_io(
            &dev,
            &iod(sys::UBLK_IO_OP_READ, 0, u64::MAX / 2, 1),
            &mut buf,
        );
        assert_eq!(r, -libc::EINVAL);
        // Larger than the tag's buffer.
        let r = handle_io(&dev, &iod(sys::UBLK_IO_OP_READ, 0, 0, 17), &mut buf);
        assert_eq!(r, -libc::EINVAL);
        // Unknown and zoned operations.
        for op in [
            sys::UBLK_IO_OP_WRITE_SAME,
            sys::UBLK_IO_OP_ZONE_APPEND,
            0xff,
        ] {
            assert_eq!(
                handle_io(&dev, &iod(op, 0, 0, 1), &mut buf),
                -libc::EOPNOTSUPP
            );
        }
        assert_eq!(dev.upper().unwrap().extent_count(), 0);
        // A device without an upper is read-only.
        let ro = Device::open(Vec::new(), None).unwrap();
        let r = handle_io(&ro, &iod(sys::UBLK_IO_OP_WRITE, 0, 0, 1), &mut buf);
        assert!(r < 0, "a write to a read-only device succeeded: {r}");
    }

    #[test]
    fn config_is_checked() {
        let mut c = UblkConfig::default();
        assert!(c.check().is_ok());
        c.queues = 0;
        assert!(matches!(c.check(), Err(Error::InvalidConfig(_))));
        c = UblkConfig {
            max_io: 5000,
            ..UblkConfig::default()
        };
        assert!(matches!(c.check(), Err(Error::InvalidConfig(_))));
    }

    /// The kernel's descriptor converts field for field; the op and FUA come from `op_flags`.
    #[test]
    fn io_desc_from_the_kernels() {
        let k = sys::ublksrv_io_desc {
            op_flags: sys::UBLK_IO_OP_WRITE | sys::UBLK_IO_F_FUA | sys::UBLK_IO_F_META,
            nr_sectors: 9,
            start_sector: 1 << 40,
            ..Default::default()
        };
        let d = IoDesc::from(&k);
        assert_eq!(d.op(), sys::UBLK_IO_OP_WRITE);
        assert!(d.fua());
        assert_eq!((d.start_sector, d.nr_sectors), (1 << 40, 9));
        let plain = IoDesc::from(&sys::ublksrv_io_desc {
            op_flags: sys::UBLK_IO_OP_DISCARD,
            ..Default::default()
        });
        assert_eq!(plain.op(), sys::UBLK_IO_OP_DISCARD);
        assert!(!plain.fua());
    }

    /// What user recovery does to the upper, request by request: a server serves requests,
    /// some of them still in flight when it is killed (done, not done, or torn half-way: data
    /// appended, log record cut); nothing is flushed. The next server reopens the upper and the
    /// kernel reissues the in-flight requests (`UBLK_F_USER_RECOVERY_REISSUE`). Before the
    /// reissue the device holds every acknowledged request plus the in-flight ones that got
    /// through; after it, exactly what the requests say, as if there had been no crash.
    #[test]
    fn reissued_requests_after_a_kill_match_a_model() {
        for seed in 0..6u64 {
            let dir = tempfile::tempdir().unwrap();
            let dev = device(dir.path());
            let mut rng = fastrand::Rng::with_seed(100 + seed);
            let mut model = vec![0u8; SIZE as usize];
            let mut buf = vec![0u8; 64 << 10];
            let sectors = (SIZE / SECTOR) as u32;
            let random_write = |rng: &mut fastrand::Rng| {
                let n = rng.u32(1..=(64 << 10) / 512);
                let start = u64::from(rng.u32(0..=(sectors - n)));
                let mut data = vec![0u8; n as usize * 512];
                rng.fill(&mut data);
                (iod(sys::UBLK_IO_OP_WRITE, 0, start, n), data)
            };
            // Acknowledged requests: their results went back to the kernel.
            for _ in 0..200 {
                match rng.u32(0..8) {
                    0 => assert_eq!(
                        handle_io(&dev, &iod(sys::UBLK_IO_OP_FLUSH, 0, 0, 0), &mut buf),
                        0
                    ),
                    1 => {
                        let n = rng.u32(1..=64);
                        let start = u64::from(rng.u32(0..=(sectors - n)));
                        let d = iod(sys::UBLK_IO_OP_DISCARD, 0, start, n);
                        assert_eq!(handle_io(&dev, &d, &mut buf), 0);
                        let lo = (start * SECTOR) as usize;
                        model[lo..lo + n as usize * 512].fill(0);
                    }
                    _ => {
                        let (d, data) = random_write(&mut rng);
                        buf[..data.len()].copy_from_slice(&data);
                        assert_eq!(handle_io(&dev, &d, &mut buf), data.len() as i32);
                        let lo = (d.start_sector * SECTOR) as usize;
                        model[lo..lo + data.len()].copy_from_slice(&data);
                    }
                }
            }
            // In flight at the kill: some reached the device, the last one maybe torn.
            let inflight: Vec<(IoDesc, Vec<u8>)> = (0..4).map(|_| random_write(&mut rng)).collect();
            let applied = rng.usize(0..=inflight.len());
            let torn = applied > 0 && seed % 2 == 0;
            let mut seen = model.clone();
            for (i, (d, data)) in inflight[..applied].iter().enumerate() {
                buf[..data.len()].copy_from_slice(data);
                assert_eq!(handle_io(&dev, d, &mut buf), data.len() as i32);
                if !(torn && i == applied - 1) {
                    let lo = (d.start_sector * SECTOR) as usize;
                    seen[lo..lo + data.len()].copy_from_slice(data);
                }
            }
            drop(dev); // SIGKILL: no flush, the files keep what was written
            if torn {
                let log = dir.path().join("upper").join("log");
                let f = std::fs::OpenOptions::new().write(true).open(&log).unwrap();
                let len = f.metadata().unwrap().len();
                f.set_len(len - 7).unwrap();
            }
            // The new server.
            let upper = Upper::open(dir.path().join("upper")).unwrap();
            assert_eq!(upper.recovered().dropped_records, u64::from(torn));
            let dev = Device::open(Vec::new(), Some(upper)).unwrap();
            let mut all = vec![0u8; SIZE as usize];
            dev.read_at(0, &mut all).unwrap();
            assert!(all == seen, "seed {seed}: acknowledged requests lost");
            // The kernel reissues everything that was in flight, in order.
            for (d, data) in &inflight {
                buf[..data.len()].copy_from_slice(data);
                assert_eq!(handle_io(&dev, d, &mut buf), data.len() as i32);
                let lo = (d.start_sector * SECTOR) as usize;
                model[lo..lo + data.len()].copy_from_slice(data);
            }
            let r = handle_io(&dev, &iod(sys::UBLK_IO_OP_READ, 0, 0, 128), &mut buf);
            assert_eq!(r, 128 * 512);
            assert!(buf[..128 * 512] == model[..128 * 512]);
            dev.read_at(0, &mut all).unwrap();
            assert!(
                all == model,
                "seed {seed}: the device differs after the reissue"
            );
        }
    }

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
