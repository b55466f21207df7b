//! The FUSE image file: a FUSE filesystem mounted **over a regular file**, whose root inode is
//! that file, of the device's size. `losetup FILE`, `mkfs.ext4 FILE`, `e2fsck FILE` and
//! file-backed mounts use it as a disk image.
//!
//! ```text
//! FILE   -rw------- root root  size = device size   (inode 1, the mount's root)
//! ```
//!
//! Why over a file and not a directory with `disk.img` inside: the user names the image path
//! (`strata bd serve DIR --fuse FILE`), there is no directory to list, and the kernel sends no
//! LOOKUP at all. The mount is made with mount(2) (`rootmode=100000`, `/dev/fuse` opened
//! here, no libfuse), `allow_other,default_permissions`, nosuid, nodev, and served by
//! Strata's own FUSE core ([`crate::fuse`]).
//!
//! Request mapping (each answered only after the device call returned):
//!
//! | FUSE | device |
//! | --- | --- |
//! | READ | [`Device::read_at`] (clamped at the end of the device) |
//! | WRITE | [`Device::write_at`]; past the end: the part inside, or `ENOSPC` |
//! | FALLOCATE `PUNCH_HOLE`, `ZERO_RANGE` | [`Device::discard`] (reads zeros afterwards) |
//! | FALLOCATE 0 / `KEEP_SIZE` inside the device | nothing (every byte is already backed) |
//! | FSYNC, FLUSH (close) | [`Device::flush`] |
//! | SETATTR size ≠ device size | `EINVAL` (a device does not change size) |
//!
//! The file is opened with `FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES`: the kernel keeps
//! no page cache of it (a loop device above sees the device, never stale pages; an fsync has
//! no dirty pages to write back first), and writes from several threads reach the daemon in
//! parallel. Requests are served by `threads` workers on one `/dev/fuse` descriptor
//! ([`crate::fuse::Session`]); requests up to `max_io` bytes (the kernel caps them at
//! `fs.fuse.max_pages_limit` pages, 1 MiB by default).
//!
//! ## Surviving the server (the fd holder)
//! Given a [`HolderClient`], [`serve_fuse_with`] hands the connection to the fd holder
//! (`crate::holder`) once mounted, under the entry [`holder_entry`] (`bd:<canonical device
//! directory>`), with a [`SavedImage`] record; the INIT values are added to it before INIT is
//! answered. If the server then dies (kill -9, a crash), the holder keeps the connection: the
//! image file stays mounted and every request on it waits in the kernel. The next server of
//! the same directory finds the connection with [`kept_connection`] (the record must name the
//! same image path, the device's size, and the mount mountinfo shows there now) and resumes it
//! with [`resume_fuse`]: no second INIT, and the requests the dead server had read but not
//! answered are queued again (`FUSE_NOTIFY_RESEND`). A clean stop ([`BdFuse::unmount`])
//! unmounts and drops the holder's entry.
//!
//! Nothing the handlers do depends on an earlier server: there is one inode (the root), file
//! handles are all 0, and the device is the state.

use std::fs::OpenOptions;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use overlaybd::Device;
use serde::{Deserialize, Serialize};
use zerocopy::IntoBytes;

use crate::blobfs::clean_stale_mount;
use crate::fuse::abi::{self, fattr, fopen, init as flag, Attr, AttrOut, OpenOut};
use crate::fuse::{Handler, InitPolicy, Negotiated, Op, Reply, Request, Session};
use crate::fusemount::{self, umount, FuseMount};
use crate::holder::HolderClient;
use crate::{Error, Result};

/// `fallocate(2)` mode bits (linux/falloc.h).
const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
const FALLOC_FL_ZERO_RANGE: u32 = 0x10;

/// Attributes never change behind the kernel's back (the size is fixed).
const TTL: Duration = Duration::from_secs(3600);

/// The prefix of the fd holder's entry names for image files.
pub const HOLDER_ENTRY_PREFIX: &str = "bd:";

/// How an image-file mount is made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BdFuseConfig {
    /// Threads reading requests from the kernel, 1..=64.
    pub threads: usize,
    /// The largest read or write request, 4 KiB..=16 MiB.
    pub max_io: u32,
    /// `FOPEN_DIRECT_IO` (default on): no page cache for the image file.
    pub direct_io: bool,
}

impl Default for BdFuseConfig {
    /// 4 threads, 1 MiB requests, direct I/O.
    fn default() -> Self {
        Self {
            threads: 4,
            max_io: 1 << 20,
            direct_io: true,
        }
    }
}

impl BdFuseConfig {
    fn check(&self) -> Result<()> {
        if !(1..=64).contains(&self.threads) {
            return Err(Error::InvalidConfig(format!(
                "threads must be 1..=64, got {}",
                self.threads
            )));
        }
        if !(4096..=(16 << 20)).contains(&self.max_io) {
            return Err(Error::InvalidConfig(format!(
                "max_io must be 4096..=16777216, got {}",
                self.max_io
            )));
        }
        Ok(())
    }

    /// What the image file asks for at INIT: reads and writes of up to `max_io` bytes
    /// (`FUSE_BIG_WRITES`, `FUSE_MAX_PAGES`), asynchronous reads, 128 background requests.
    fn policy(&self) -> InitPolicy {
        InitPolicy {
            max_read: self.max_io,
            max_write: self.max_io,
            want: flag::ASYNC_READ | flag::BIG_WRITES | flag::MAX_PAGES,
            max_background: 128,
            congestion_threshold: 96,
        }
    }
}

/// What the fd holder keeps beside an image file's connection (JSON): enough for the next
/// server of the same device directory to check that the connection is the mount it finds,
/// and to resume it without INIT.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedImage {
    /// The image file (canonical path) the connection is mounted over.
    pub path: PathBuf,
    /// The device's size (the kernel caches it as the file's size).
    pub size: u64,
    /// The mount's device number `major:minor` (mountinfo), once mounted.
    #[serde(default)]
    pub dev: Option<String>,
    /// The file's times as the kernel was told them, seconds and nanoseconds since the epoch.
    #[serde(default)]
    pub mtime: Option<(u64, u32)>,
    /// The INIT values, once agreed (saved before INIT is answered).
    #[serde(default)]
    pub negotiated: Option<Negotiated>,
}

impl SavedImage {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// `None` for anything that is not such a record.
    pub fn from_json(s: &str) -> Option<Self> {
        serde_json::from_str(s).ok()
    }
}

/// The fd holder's entry name for the image file of the device in `dir`:
/// `bd:<canonical dir>`.
pub fn holder_entry(dir: &Path) -> Result<String> {
    let dir = dir
        .canonicalize()
        .map_err(|e| Error::io("canonicalize", dir, e))?;
    Ok(format!("{HOLDER_ENTRY_PREFIX}{}", dir.to_string_lossy()))
}

/// Where the fd holder of the device in `dir` runs (its socket, lock and log):
/// `<canonical dir>/holder`.
pub fn holder_run_dir(dir: &Path) -> Result<PathBuf> {
    let dir = dir
        .canonicalize()
        .map_err(|e| Error::io("canonicalize", dir, e))?;
    Ok(dir.join("holder"))
}

/// The canonical path of the image file `file` without touching the file itself: a mount over
/// it whose server is gone but whose connection is kept would make any `stat` of it wait.
fn image_path(file: &Path) -> Result<PathBuf> {
    let bad = || {
        Error::InvalidConfig(format!(
            "{} does not name a file (the image is mounted over a file)",
            file.display()
        ))
    };
    let name = file.file_name().ok_or_else(bad)?;
    let parent = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = parent
        .canonicalize()
        .map_err(|e| Error::io("canonicalize", parent, e))?;
    Ok(parent.join(name))
}

/// The canonical directory of `device`'s upper: what names its holder entry.
fn device_dir(device: &Device) -> Result<&Path> {
    device.upper().map(|u| u.dir()).ok_or_else(|| {
        Error::InvalidConfig(
            "a device without an upper has no directory to name its fd-holder entry".into(),
        )
    })
}

/// Counters of one image-file mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BdFuseStats {
    pub reads: u64,
    pub writes: u64,
    pub discards: u64,
    pub flushes: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    discards: AtomicU64,
    flushes: AtomicU64,
    errors: AtomicU64,
}

/// A live image-file mount. Unmounted (and the device flushed) by [`BdFuse::unmount`] or
/// when dropped.
pub struct BdFuse {
    path: PathBuf,
    device: Arc<Device>,
    counters: Arc<Counters>,
    negotiated: Negotiated,
    session: Option<Session>,
    /// The fd holder keeping the connection, and the entry's name.
    holder: Option<(Arc<HolderClient>, String)>,
    resumed: bool,
}

impl std::fmt::Debug for BdFuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BdFuse")
            .field("path", &self.path)
            .field("size", &self.device.size())
            .field("resumed", &self.resumed)
            .finish()
    }
}

/// [`serve_fuse_with`] with the default configuration and no fd holder.
pub fn serve_fuse(device: Arc<Device>, file: &Path) -> Result<BdFuse> {
    serve_fuse_with(device, file, &BdFuseConfig::default(), None)
}

/// Mount `device` over the regular file `file` (created empty if missing; a dead FUSE mount
/// left there by a crashed server is detached first). Needs root (mount(2), `/dev/fuse`).
///
/// With `holder`, the connection is handed to the fd holder once mounted, and the INIT values
/// are saved there before INIT is answered, so that the mount outlives this process
/// ([`resume_fuse`]). A connection the holder still keeps for this device directory is let go
/// first (its mount ends, and is detached): this mounts anew; see [`kept_connection`] for
/// taking it over instead.
pub fn serve_fuse_with(
    device: Arc<Device>,
    file: &Path,
    cfg: &BdFuseConfig,
    holder: Option<Arc<HolderClient>>,
) -> Result<BdFuse> {
    cfg.check()?;
    let holder = match holder {
        Some(h) => {
            let entry = holder_entry(device_dir(&device)?)?;
            // Before anything looks at the path: a kept connection without a server would
            // make that wait.
            abandon(&h, &entry, None);
            Some((h, entry))
        }
        None => None,
    };
    if clean_stale_mount(file)? {
        tracing::warn!(path = %file.display(), "detached a dead FUSE mount");
    }
    match std::fs::symlink_metadata(file) {
        Ok(md) if md.is_file() => {}
        Ok(_) => {
            return Err(Error::InvalidConfig(format!(
                "{} is not a regular file: the image is mounted over a file",
                file.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(file)
                .map_err(|e| Error::io("create", file, e))?;
        }
        Err(e) => return Err(Error::io("stat", file, e)),
    }
    let path = image_path(file)?;
    let started = SystemTime::now();
    let mut saved = SavedImage {
        path: path.clone(),
        size: device.size(),
        dev: None,
        mtime: Some(secs(started)),
        negotiated: None,
    };
    let dev = fusemount::open_dev()?;
    fusemount::mount_fuse(
        &path,
        std::os::fd::AsRawFd::as_raw_fd(&dev),
        cfg.max_io,
        FuseMount {
            name: "strata-bd",
            file_root: true,
            read_only: false,
        },
    )?;
    // From here on, a failure must not leave the mount (nor the holder's entry) behind.
    let undo = |e: Error| {
        let _ = umount(&path, rustix::mount::UnmountFlags::DETACH);
        if let Some((h, entry)) = &holder {
            let _ = h.drop_entry(entry);
        }
        e
    };
    saved.dev = fusemount::mount_dev(&path);
    // Handed over once mounted (an unmounted device reports POLLERR, which the holder takes
    // for a connection that ended) and before INIT is answered: no request is served before
    // the holder has the connection.
    if let Some((h, entry)) = &holder {
        h.put(entry, &saved.to_json(), dev.as_fd()).map_err(|e| {
            undo(Error::io(
                "hand the FUSE connection to the fd holder",
                &path,
                e,
            ))
        })?;
    }
    let negotiated = crate::fuse::handshake(&dev, &cfg.policy(), Duration::from_secs(30), |neg| {
        saved.negotiated = Some(*neg);
        match &holder {
            Some((h, entry)) => h.set_meta(entry, &saved.to_json()),
            None => Ok(()),
        }
    })
    .map_err(|e| undo(Error::io("FUSE handshake on", &path, e)))?;
    let kept_by = holder.clone();
    start(
        device,
        path.clone(),
        dev,
        negotiated,
        started,
        cfg,
        kept_by,
        false,
        &undo,
    )
}

/// Serve an image file whose connection `dev` an earlier server of the same device
/// initialised and the fd holder kept (`saved`: what was kept with it, from
/// [`kept_connection`]): no INIT, and the requests the earlier server read but never answered
/// are queued again (`FUSE_NOTIFY_RESEND`, where the kernel has it). The path is not touched
/// before the workers run.
pub fn resume_fuse(
    device: Arc<Device>,
    dev: OwnedFd,
    saved: &SavedImage,
    cfg: &BdFuseConfig,
    holder: Option<Arc<HolderClient>>,
) -> Result<BdFuse> {
    cfg.check()?;
    let negotiated = saved.negotiated.ok_or_else(|| {
        Error::InvalidConfig("the kept FUSE connection was never initialised".into())
    })?;
    if saved.size != device.size() {
        return Err(Error::InvalidConfig(format!(
            "the kept image file is {} bytes, the device {}",
            saved.size,
            device.size()
        )));
    }
    let holder = match holder {
        Some(h) => Some((h, holder_entry(device_dir(&device)?)?)),
        None => None,
    };
    let started = saved
        .mtime
        .map(|(s, ns)| SystemTime::UNIX_EPOCH + Duration::new(s, ns.min(999_999_999)))
        .unwrap_or_else(SystemTime::now);
    start(
        device,
        saved.path.clone(),
        dev,
        negotiated,
        started,
        cfg,
        holder,
        true,
        &|e| e,
    )
}

#[allow(clippy::too_many_arguments)]
fn start(
    device: Arc<Device>,
    path: PathBuf,
    dev: OwnedFd,
    negotiated: Negotiated,
    started: SystemTime,
    cfg: &BdFuseConfig,
    holder: Option<(Arc<HolderClient>, String)>,
    resumed: bool,
    undo: &dyn Fn(Error) -> Error,
) -> Result<BdFuse> {
    let counters = Arc::new(Counters::default());
    // The largest request the kernel may send on this connection (the one it agreed, which a
    // resumed connection keeps whatever this server's configuration says).
    let max_io = (u32::from(negotiated.max_pages) * 4096).max(negotiated.max_write);
    let fs = ImageFs {
        device: device.clone(),
        counters: counters.clone(),
        max_io,
        direct_io: cfg.direct_io,
        started,
    };
    let session = Session::serve(dev, negotiated, Arc::new(fs), cfg.threads, resumed)
        .map_err(|e| undo(Error::io("start FUSE threads for", &path, e)))?;
    Ok(BdFuse {
        path,
        device,
        counters,
        negotiated,
        session: Some(session),
        holder,
        resumed,
    })
}

/// What the fd holder keeps of an earlier server's image file for `device` (the entry
/// [`holder_entry`] of its directory), if it can be resumed over `file`: the connection was
/// initialised, the record names `file` and the device's size, and mountinfo shows that very
/// mount (same device number) at `file` now. A kept connection that cannot be resumed is let
/// go (the holder drops it, its mount ends and is detached) and `None` returned; so is
/// `None` when nothing is kept. `file` is not touched (a `stat` of a kept mount without a
/// server would wait). Other entries are left to the holder.
pub fn kept_connection(
    holder: &HolderClient,
    device: &Device,
    file: &Path,
) -> Result<Option<(OwnedFd, SavedImage)>> {
    let entry = holder_entry(device_dir(device)?)?;
    let path = image_path(file)?;
    let held = holder
        .list()
        .map_err(|e| Error::io("ask the fd holder what it keeps for", &path, e))?;
    let Some(kept) = held.into_iter().find(|h| h.name == entry) else {
        return Ok(None);
    };
    let saved = SavedImage::from_json(&kept.meta);
    let why = match &saved {
        None => format!("its record does not parse: {:?}", kept.meta),
        Some(s) if s.path != path => format!("it is mounted over {}", s.path.display()),
        Some(s) if s.negotiated.is_none() => "it was never initialised".into(),
        Some(s) if s.size != device.size() => {
            format!("it is {} bytes, the device {}", s.size, device.size())
        }
        Some(s) => {
            let live = fusemount::mount_dev(&path);
            if live.is_some() && live == s.dev {
                let saved = s.clone();
                return Ok(Some((kept.fd, saved)));
            }
            format!(
                "it (device {:?}) is not the mount at {} ({live:?})",
                s.dev,
                path.display()
            )
        }
    };
    tracing::warn!(
        "the fd holder keeps an image-file connection of this device that cannot be resumed \
         over {}: {why}; letting it go",
        path.display()
    );
    drop(kept.fd);
    abandon(holder, &entry, saved.as_ref());
    Ok(None)
}

/// The image file whose connection the fd holder of the device in `dir` keeps, if a holder
/// runs there and keeps one that is still mounted: the requests waiting on it must reach this
/// device before anything else serves it (`strata bd serve --ublk` refuses then).
pub fn kept_image(dir: &Path) -> Option<PathBuf> {
    let run_dir = holder_run_dir(dir).ok()?;
    if !crate::holder::socket_path(&run_dir).exists() {
        return None;
    }
    let entry = holder_entry(dir).ok()?;
    let holder = HolderClient::connect(&run_dir).ok()?;
    let kept = holder.list().ok()?.into_iter().find(|h| h.name == entry)?;
    let saved = SavedImage::from_json(&kept.meta)?;
    let live = fusemount::mount_dev(&saved.path);
    (live.is_some() && live == saved.dev).then_some(saved.path)
}

/// Let the holder's entry `entry` go, and detach the mount it served if it is still mounted
/// where its record (`saved`, or the holder's own) says: with the holder's copy closed the
/// connection ends (no server has it any more), and its mount is dead.
fn abandon(holder: &HolderClient, entry: &str, saved: Option<&SavedImage>) {
    let saved = match saved {
        Some(s) => Some(s.clone()),
        None => holder.list().ok().and_then(|held| {
            held.into_iter()
                .find(|h| h.name == entry)
                .and_then(|h| SavedImage::from_json(&h.meta))
        }),
    };
    if let Err(e) = holder.drop_entry(entry) {
        tracing::warn!(entry, error = %e, "asking the fd holder to let a connection go");
    }
    if let Some(s) = saved {
        let live = fusemount::mount_dev(&s.path);
        if live.is_some() && live == s.dev {
            match umount(&s.path, rustix::mount::UnmountFlags::DETACH) {
                Ok(()) => tracing::warn!(
                    path = %s.path.display(),
                    "detached the image file an earlier server left"
                ),
                Err(e) => tracing::warn!(
                    path = %s.path.display(),
                    error = %e,
                    "detaching the image file an earlier server left"
                ),
            }
        }
    }
}

impl BdFuse {
    /// The image file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device served.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Whether this server took over a connection an earlier one left ([`resume_fuse`]).
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// What the kernel agreed at INIT (on a resumed connection: with the earlier server).
    pub fn negotiated(&self) -> Negotiated {
        self.negotiated
    }

    /// Counters of this mount.
    pub fn stats(&self) -> BdFuseStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.counters;
        BdFuseStats {
            reads: g(&c.reads),
            writes: g(&c.writes),
            discards: g(&c.discards),
            flushes: g(&c.flushes),
            errors: g(&c.errors),
        }
    }

    /// Unmount, wait for the FUSE threads, flush the device, and let the fd holder (if any)
    /// close its copy of the connection. If the file is still in use (a loop device, an open
    /// descriptor), it is detached lazily and [`Error::Busy`] returned: the threads keep
    /// serving the remaining users until they let go.
    pub fn unmount(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        // Unmount first: once it succeeds no request can arrive any more, and the flush below
        // covers every write that was acknowledged.
        let unmounted = fusemount::stop_session(
            &self.path,
            session,
            "still in use (a loop device?); detached lazily",
        );
        let flushed = self.device.flush();
        if let Some((h, entry)) = self.holder.take() {
            if let Err(e) = h.drop_entry(&entry) {
                tracing::warn!(error = %e, "asking the fd holder to close the image file's connection");
            }
        }
        unmounted?;
        flushed.map_err(Error::from)
    }
}

impl Drop for BdFuse {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(path = %self.path.display(), error = %e, "unmounting image file");
        }
    }
}

fn secs(t: SystemTime) -> (u64, u32) {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    (d.as_secs(), d.subsec_nanos())
}

/// The filesystem: one regular file, the root inode.
struct ImageFs {
    device: Arc<Device>,
    counters: Arc<Counters>,
    /// The largest read answered (the kernel sends none larger).
    max_io: u32,
    direct_io: bool,
    started: SystemTime,
}

thread_local! {
    /// The read buffer of each FUSE thread (`Device::read_at` fills every byte it is given).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl ImageFs {
    fn attr_out(&self) -> AttrOut {
        let size = self.device.size();
        let (t, ns) = secs(self.started);
        AttrOut {
            attr_valid: TTL.as_secs(),
            attr_valid_nsec: TTL.subsec_nanos(),
            dummy: 0,
            attr: Attr {
                ino: abi::ROOT_ID,
                size,
                blocks: size.div_ceil(512),
                atime: t,
                mtime: t,
                ctime: t,
                atimensec: ns,
                mtimensec: ns,
                ctimensec: ns,
                mode: abi::S_IFREG | 0o600,
                nlink: 1,
                uid: 0,
                gid: 0,
                rdev: 0,
                blksize: 4096,
                flags: 0,
            },
        }
    }

    fn failed(&self, op: &str, offset: u64, len: u64, e: &overlaybd::Error) -> i32 {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(op, offset, len, error = %e, "image file request failed");
        e.errno()
    }

    fn flush_device(&self, reply: Reply<'_>) {
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        match self.device.flush() {
            Ok(()) => reply.ok(&[]),
            Err(e) => reply.error(self.failed("flush", 0, 0, &e)),
        }
    }

    fn setattr(&self, a: &abi::SetattrIn, reply: Reply<'_>) {
        // A device has a fixed size; `O_TRUNC`/`truncate` to its own size is accepted.
        // Modes, owners and times are not stored (the attributes stay as they are).
        if a.valid & fattr::SIZE != 0 && a.size != self.device.size() {
            return reply.error(libc::EINVAL);
        }
        reply.ok(&[self.attr_out().as_bytes()])
    }

    fn open(&self, flags: u32, reply: Reply<'_>) {
        if flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 && self.device.upper().is_none()
        {
            return reply.error(libc::EROFS);
        }
        let open_flags = if self.direct_io {
            fopen::DIRECT_IO | fopen::PARALLEL_DIRECT_WRITES
        } else {
            fopen::KEEP_CACHE
        };
        let out = OpenOut {
            fh: 0,
            open_flags,
            backing_id: 0,
        };
        reply.ok(&[out.as_bytes()])
    }

    fn read(&self, offset: u64, size: u32, reply: Reply<'_>) {
        let dev_size = self.device.size();
        if offset >= dev_size || size == 0 {
            return reply.ok(&[]);
        }
        let len = u64::from(size.min(self.max_io)).min(dev_size - offset);
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        // One buffer per FUSE thread, grown to the largest request seen (at most `max_io`).
        READ_BUF.with_borrow_mut(|buf| {
            if buf.len() < len as usize {
                buf.resize(len as usize, 0);
            }
            let buf = &mut buf[..len as usize];
            match self.device.read_at(offset, buf) {
                Ok(()) => reply.ok(&[buf]),
                Err(e) => reply.error(self.failed("read", offset, len, &e)),
            }
        })
    }

    fn write(&self, offset: u64, data: &[u8], reply: Reply<'_>) {
        let dev_size = self.device.size();
        let written = |n: usize| abi::WriteOut {
            size: n as u32,
            padding: 0,
        };
        if data.is_empty() {
            return reply.ok(&[written(0).as_bytes()]);
        }
        if offset >= dev_size {
            return reply.error(libc::ENOSPC);
        }
        let n = (data.len() as u64).min(dev_size - offset) as usize;
        self.counters.writes.fetch_add(1, Ordering::Relaxed);
        match self.device.write_at(offset, &data[..n]) {
            Ok(()) => reply.ok(&[written(n).as_bytes()]),
            Err(e) => reply.error(self.failed("write", offset, n as u64, &e)),
        }
    }

    fn fallocate(&self, a: &abi::FallocateIn, reply: Reply<'_>) {
        let dev_size = self.device.size();
        let (offset, mode) = (a.offset, a.mode);
        let Some(end) = offset.checked_add(a.length) else {
            return reply.error(libc::EINVAL);
        };
        if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) != 0 {
            let known = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE;
            if mode & !known != 0 {
                return reply.error(libc::EOPNOTSUPP);
            }
            // Past the end there is nothing to zero; the device never grows.
            let end = end.min(dev_size);
            if offset >= end {
                return reply.ok(&[]);
            }
            self.counters.discards.fetch_add(1, Ordering::Relaxed);
            return match self.device.discard(offset, end - offset) {
                Ok(()) => reply.ok(&[]),
                Err(e) => reply.error(self.failed("discard", offset, end - offset, &e)),
            };
        }
        if mode & !FALLOC_FL_KEEP_SIZE != 0 {
            return reply.error(libc::EOPNOTSUPP);
        }
        // Plain allocation: every byte inside the device is already backed.
        if end > dev_size {
            return reply.error(libc::EFBIG);
        }
        reply.ok(&[])
    }
}

impl Handler for ImageFs {
    fn handle(&self, req: &Request<'_>, reply: Reply<'_>) {
        // The root is the only inode.
        if req.header.nodeid != abi::ROOT_ID {
            return reply.error(libc::ENOENT);
        }
        match &req.op {
            Op::Getattr(_) => reply.ok(&[self.attr_out().as_bytes()]),
            Op::Setattr(a) => self.setattr(a, reply),
            Op::Open(o) => self.open(o.flags, reply),
            Op::Read(r) => self.read(r.offset, r.size, reply),
            Op::Write { arg, data } => self.write(arg.offset, data, reply),
            Op::Fallocate(a) => self.fallocate(a, reply),
            // close(2): make everything written through this descriptor durable as well.
            Op::Flush | Op::Fsync(_) => self.flush_device(reply),
            Op::Release(_) => reply.ok(&[]),
            Op::Statfs => reply.statfs(self.device.size().div_ceil(4096), 1),
            Op::Getxattr { .. } => reply.error(libc::ENODATA),
            Op::Listxattr { size } => reply.no_xattrs(*size),
            Op::Opendir(_) | Op::Readdir(_) | Op::Releasedir(_) | Op::Lookup { .. } => {
                reply.error(libc::ENOTDIR)
            }
            _ => reply.error(libc::ENOSYS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_image_round_trip_and_garbage() {
        let s = SavedImage {
            path: "/srv/vm/disk.img".into(),
            size: 96 << 20,
            dev: Some("0:77".into()),
            mtime: Some((1_700_000_000, 5)),
            negotiated: None,
        };
        assert_eq!(SavedImage::from_json(&s.to_json()), Some(s));
        for bad in ["", "{", "[]", "{\"path\":1}", "{\"size\":4096}", "null"] {
            assert_eq!(SavedImage::from_json(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn image_path_does_not_need_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let canon = dir.path().canonicalize().unwrap();
        let p = image_path(&dir.path().join("missing.img")).unwrap();
        assert_eq!(p, canon.join("missing.img"));
        assert!(image_path(Path::new("/")).is_err());
        assert!(image_path(&dir.path().join("nope/x.img")).is_err());
        assert_eq!(
            holder_entry(dir.path()).unwrap(),
            format!("bd:{}", canon.display())
        );
        assert_eq!(holder_run_dir(dir.path()).unwrap(), canon.join("holder"));
    }
}
