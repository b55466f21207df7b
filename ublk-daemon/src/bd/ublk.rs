//! The ublk frontend: the device as `/dev/ublkbN`, served through the kernel's ublk driver
//! (`libublk`, io_uring), with several queues and user recovery.
//!
//! Setup and I/O are kept apart: [`serve_ublk`] adds (or recovers) the device and starts one
//! thread per queue; each queue thread runs one task per tag that fetches a request, hands its
//! descriptor to [`handle_io`] (the whole request logic, a plain function tested in-process)
//! and commits the result. [`handle_io`] maps:
//!
//! | ublk op | device | result |
//! | --- | --- | --- |
//! | `READ` | [`Device::read_at`] into the tag's buffer | bytes |
//! | `WRITE` | [`Device::write_at`] from the buffer; with `FUA`, then [`Device::flush`] | bytes |
//! | `FLUSH` | [`Device::flush`] | 0 |
//! | `DISCARD`, `WRITE_ZEROES` | [`Device::discard`] | 0 |
//! | anything else | — | `-EOPNOTSUPP` |
//!
//! Errors are `-errno` from [`overlaybd::Error::errno`]; a request larger than the tag's
//! buffer is `-EINVAL`. The device advertises a volatile write cache and FUA (so the kernel
//! sends `FLUSH` and `FUA` and waits for them) and discard/write-zeroes in 4 KiB units.
//!
//! **User recovery.** Devices are added with `UBLK_F_USER_RECOVERY`: when the daemon dies, the
//! kernel keeps `/dev/ublkbN` and queues its requests instead of failing them; a new daemon
//! calls [`serve_ublk`] with [`UblkConfig::recover`] set to the device id, reopens the same
//! upper (whose log drops any unflushed tail), and the queued requests are served. Requests
//! acknowledged before the crash were acknowledged after the device call returned, so nothing
//! acknowledged is lost; a flush acknowledged before it is durable.
//!
//! Each queue thread blocks in the device call (a read that misses the chunk cache waits for
//! the fetch): other tags of that queue wait meanwhile, other queues do not.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkQueue};
use libublk::{sys, BufDesc, UblkError, UblkFlags};
use overlaybd::{Device, SECTOR};

use crate::{Error, Result};

/// The ublk driver's control device.
pub const UBLK_CONTROL: &str = "/dev/ublk-control";

/// Whether this kernel has a ublk driver loaded (`/dev/ublk-control` exists).
pub fn ublk_available() -> bool {
    Path::new(UBLK_CONTROL).exists()
}

/// How a ublk device is made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct UblkConfig {
    /// Hardware queues (one thread each), 1..=64.
    pub queues: u16,
    /// Requests in flight per queue, 1..=4096.
    pub depth: u16,
    /// The largest request in bytes (the tag buffer size), 4 KiB..=16 MiB, a multiple of 4 KiB.
    pub max_io: u32,
    /// Reattach to the existing device with this id (left by a daemon that died) instead of
    /// adding a new one.
    pub recover: Option<u32>,
}

impl Default for UblkConfig {
    /// 2 queues of depth 64, 512 KiB requests, a new device.
    fn default() -> Self {
        Self {
            queues: 2,
            depth: 64,
            max_io: 512 << 10,
            recover: None,
        }
    }
}

impl UblkConfig {
    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if !(1..=64).contains(&self.queues) {
            return bad(format!("queues must be 1..=64, got {}", self.queues));
        }
        if !(1..=4096).contains(&self.depth) {
            return bad(format!("depth must be 1..=4096, got {}", self.depth));
        }
        if !(4096..=(16 << 20)).contains(&self.max_io) || self.max_io % 4096 != 0 {
            return bad(format!(
                "max_io must be a multiple of 4096 in 4096..=16777216, got {}",
                self.max_io
            ));
        }
        Ok(())
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

fn ublk_err(op: &'static str, e: UblkError) -> Error {
    let errno = match &e {
        UblkError::IOError(io) => io.raw_os_error().unwrap_or(libc::EIO),
        UblkError::OtherError(n) | UblkError::UringIOError(n) => n.abs(),
        _ => libc::EIO,
    };
    Error::Ublk {
        op,
        errno,
        reason: e.to_string(),
    }
}

/// A live ublk device. [`BdUblk::stop`] (or dropping it) stops the queues, flushes the device
/// and deletes `/dev/ublkbN`.
pub struct BdUblk {
    ctrl: Arc<UblkCtrl>,
    device: Arc<Device>,
    dev_id: u32,
    thread: Option<JoinHandle<Result<()>>>,
}

impl std::fmt::Debug for BdUblk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BdUblk")
            .field("dev_id", &self.dev_id)
            .finish()
    }
}

/// Add a ublk device for `device` (or, with [`UblkConfig::recover`], reattach to the one a
/// dead daemon left) and serve it until [`BdUblk::stop`]. Returns once `/dev/ublkbN` is live.
/// Needs root and the ublk driver.
pub fn serve_ublk(device: Arc<Device>, cfg: &UblkConfig) -> Result<BdUblk> {
    cfg.check()?;
    if !ublk_available() {
        return Err(Error::io(
            "open",
            UBLK_CONTROL,
            std::io::Error::from_raw_os_error(libc::ENOENT),
        ));
    }
    let (id, dev_flags) = match cfg.recover {
        Some(id) => {
            let id = i32::try_from(id)
                .map_err(|_| Error::InvalidConfig(format!("ublk device id {id} is too large")))?;
            let old = UblkCtrl::new_simple(id).map_err(|e| ublk_err("open ublk device", e))?;
            let old_size = old
                .get_target_from_json()
                .map(|t| t.dev_size)
                .map_err(|e| ublk_err("read ublk device json", e))?;
            if old_size != device.size() {
                return Err(Error::InvalidConfig(format!(
                    "ublk device {id} has {old_size} bytes, the device {}",
                    device.size()
                )));
            }
            old.start_user_recover()
                .map_err(|e| ublk_err("start user recovery", e))?;
            (id, UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        }
        None => (-1, UblkFlags::UBLK_DEV_F_ADD_DEV),
    };
    let ctrl = UblkCtrlBuilder::default()
        .name("strata-bd")
        .id(id)
        .nr_queues(cfg.queues)
        .depth(cfg.depth)
        .io_buf_bytes(cfg.max_io)
        .ctrl_flags(u64::from(sys::UBLK_F_USER_RECOVERY))
        .dev_flags(dev_flags)
        .build()
        .map_err(|e| ublk_err("add ublk device", e))?;
    let ctrl = Arc::new(ctrl);
    let dev_id = ctrl.dev_info().dev_id;
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let size = device.size();
    let thread = {
        let ctrl = ctrl.clone();
        let device = device.clone();
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
        device,
        dev_id,
        thread: Some(thread),
    };
    if started_rx.recv_timeout(Duration::from_secs(30)).is_err() {
        // The control thread ended (or hung) before the device went live.
        let why = served.shutdown().err();
        return Err(why.unwrap_or(Error::Ublk {
            op: "start ublk device",
            errno: libc::EIO,
            reason: "the device did not go live within 30 s".into(),
        }));
    }
    Ok(served)
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
        &self.device
    }

    /// Stop the queues, flush the device and delete `/dev/ublkbN`.
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
        let flushed = self.device.flush();
        let deleted = self.ctrl.del_dev();
        flushed?;
        killed.map_err(|e| ublk_err("stop ublk device", e))?;
        ran?;
        deleted.map_err(|e| ublk_err("delete ublk device", e))?;
        Ok(())
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
}
