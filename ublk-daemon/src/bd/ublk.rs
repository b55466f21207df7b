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
//! The record ([`UblkRecord`]: format, parse/encode, checksum, file) and the decision
//! ([`plan`], [`Plan`], [`Recovery`]) are in the submodule `recovery` (file `bd/recovery.rs`),
//! re-exported here; this file is the kernel side: the configuration, [`ublk_device_info`],
//! adding, reattaching and deleting devices, the queues and [`handle_io`].
//!
//! Each queue thread blocks in the device call (a read that misses the chunk cache waits for
//! the fetch): other tags of that queue wait meanwhile, other queues do not.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkQueue};
use libublk::{sys, BufDesc, UblkError, UblkFlags};
use overlaybd::{Device, SECTOR};

use super::OpenDevice;
use crate::{Error, Result};

// The record and the recovery decision; a child module, so it sees the geometry check, the
// recovery flags and the kernel's device info here.
#[path = "recovery.rs"]
mod recovery;

pub use recovery::{plan, Plan, Recovery, UblkRecord, RECORD_FILE, RECORD_VERSION};

/// The ublk driver's control device.
pub const UBLK_CONTROL: &str = "/dev/ublk-control";
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
}
