//! # OverlayBD frontends: a layered block device as a FUSE image file or a ublk device
//!
//! An [`overlaybd::Device`] (sealed layers from the store + a local writable upper) is handed
//! to the kernel in one of two ways:
//!
//! - [`fuse`]: [`serve_fuse`] mounts a FUSE filesystem **directly over a regular file**, so
//!   that file *is* the device: `losetup`, `mkfs.ext4`, `e2fsck` or a file-backed mount use it
//!   like any disk image. Works on every kernel with FUSE (this machine has no ublk driver).
//! - [`ublk`]: [`serve_ublk`] exposes the device as `/dev/ublkbN` through the kernel's ublk
//!   driver (io_uring), with several queues and user recovery (`UBLK_F_USER_RECOVERY` +
//!   `UBLK_F_USER_RECOVERY_REISSUE`), so a daemon restarted after a crash reattaches to the
//!   same `/dev/ublkbN`: requests issued meanwhile wait, none fails.
//!
//! This module also manages a **device directory** (what `strata bd create|serve|commit` work
//! on): the upper's files (`data`, `log`, owned by [`overlaybd::Upper`]) plus
//!
//! ```text
//! <dir>/strata-bd.json   {"version":1,"size":N,"base":"KIND/NAME:VERSION"|null,"base_id":"<hex>"}
//! <dir>/strata-bd.lock   flock(LOCK_EX) held by whoever has the upper open (serve, commit)
//! <dir>/strata-bd.ublk.json  while a ublk device exists for it: what reattaching needs
//!                        (device id, queues, depth, size, the directory, a tag; ublk::UblkRecord)
//! ```
//!
//! `base` names the top stored layer the upper sits on (its parents come from the store's
//! manifests, see [`overlaybd::resolve_stack`]); `base_id` is that layer's id (all zeros: no
//! base), checked again against the upper's own record when the device is opened. Layers are
//! read lazily through the node's [`ChunkCache`]. Byte layouts of layers and uppers are in
//! `overlaybd/docs/format.md`; request mapping and recovery in `ublk-daemon/docs/bd.md`.
//!
//! # Invariants
//! - Only one process has a device directory's upper open at a time (the lock file); a second
//!   `serve` or a `commit` of a served device is [`Error::Busy`], never two writers.
//! - A write is acknowledged to the kernel only after [`overlaybd::Device::write_at`]
//!   returned; a flush (FUSE `fsync`/`flush`, ublk `FLUSH` or `FUA`) is acknowledged only after
//!   [`overlaybd::Device::flush`] returned, so it survives kill -9 of the daemon.
//! - Each kernel error number comes from [`overlaybd::Error::errno`] (or [`Error::errno`]).
//! - A ublk device of a directory is served only by the holder of its lock, and a new server
//!   reattaches only to the device its record names, in the directory the record names, with
//!   the tag the kernel keeps for that device ([`ublk::plan`]).

pub mod fuse;
pub mod ublk;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fs_cache::chunk::ChunkCache;
use fs_cache::{LayerRef, Store};
use overlaybd::{Device, PushedLayer, Upper};
use serde::{Deserialize, Serialize};

pub use crate::signal::StopSignal;
pub use fuse::{serve_fuse, serve_fuse_with, BdFuse, BdFuseConfig};
pub use overlaybd;
pub use ublk::{
    pending_ublk_device, serve_ublk, ublk_available, ublk_device_info, BdUblk, DevState, IoDesc,
    Plan, Recovery, UblkConfig, UblkDeviceInfo, UblkRecord,
};

use crate::{Error, Result};

/// The descriptor's file name inside a device directory.
pub const DESCRIPTOR_FILE: &str = "strata-bd.json";
/// The lock file's name inside a device directory.
pub const LOCK_FILE: &str = "strata-bd.lock";
/// The descriptor version this code writes and reads.
pub const DESCRIPTOR_VERSION: u32 = 1;
/// The largest descriptor read (it is a few hundred bytes).
const MAX_DESCRIPTOR: u64 = 64 << 10;

/// What a device directory holds besides its upper.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Descriptor {
    pub version: u32,
    /// Device size in bytes (a multiple of 512).
    pub size: u64,
    /// The top stored layer the upper sits on.
    pub base: Option<LayerRef>,
    /// That layer's id, hex (64 zeros without a base).
    pub base_id: String,
}

impl Descriptor {
    /// Read and check `<dir>/strata-bd.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(DESCRIPTOR_FILE);
        let f = File::open(&path).map_err(|e| Error::io("open", &path, e))?;
        let len = f.metadata().map_err(|e| Error::io("stat", &path, e))?.len();
        let bad = |reason: String| Error::BadDevice {
            path: path.clone(),
            reason,
        };
        if len > MAX_DESCRIPTOR {
            return Err(bad(format!("{len} bytes is too large for a descriptor")));
        }
        let d: Descriptor = serde_json::from_reader(std::io::BufReader::new(f))
            .map_err(|e| bad(format!("not a device descriptor: {e}")))?;
        if d.version != DESCRIPTOR_VERSION {
            return Err(bad(format!("unsupported descriptor version {}", d.version)));
        }
        if d.size == 0 || d.size % overlaybd::SECTOR != 0 {
            return Err(bad(format!(
                "device size {} is not a positive multiple of 512",
                d.size
            )));
        }
        if d.base_id.len() != 64 || !d.base_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(format!("base_id {:?} is not 64 hex digits", d.base_id)));
        }
        Ok(d)
    }

    /// Write it to `<dir>/strata-bd.json` atomically (temporary file, fsync, rename).
    fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(DESCRIPTOR_FILE);
        let body = serde_json::to_vec_pretty(self).map_err(|e| Error::BadDevice {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        fs_cache::write_atomic(&path, &body).map_err(|e| Error::io("write", &path, e))
    }
}

/// Retries of a busy device lock, 10 ms apart (see `DirLock::acquire`).
const LOCK_RETRIES: u32 = 20;

/// An exclusive hold on a device directory (released when dropped).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    dir: PathBuf,
}

impl DirLock {
    /// Take the directory's lock without waiting; [`Error::Busy`] if another process has it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io("open", &path, e))?;
        // A lock just released can still be held for a moment by a child that another thread
        // of this process is spawning (the child holds copies of every descriptor until its
        // exec closes them): a few short retries before calling the device busy.
        let mut tries = 0;
        loop {
            // SAFETY: flock on a valid, open descriptor; no memory is passed.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(Error::io("flock", &path, e));
            }
            tries += 1;
            if tries > LOCK_RETRIES {
                return Err(Error::Busy {
                    path: dir.to_owned(),
                    what: "another process has this device open (strata bd serve?)".into(),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Ok(Self {
            _file: file,
            dir: dir.to_owned(),
        })
    }

    /// The device directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The sealed layers of `base` (base first) read lazily through `cache`, and the top's id.
async fn base_stack(
    store: &Store,
    cache: &ChunkCache,
    base: Option<&LayerRef>,
) -> Result<Vec<Arc<dyn overlaybd::LayerSource>>> {
    match base {
        Some(b) => Ok(overlaybd::resolve_stack(store, cache, b).await?),
        None => Ok(Vec::new()),
    }
}

/// Create a device directory at `dir` (created if missing; it must not hold a device yet):
/// an empty upper of `size` bytes (default: the base's size) on top of `base`.
pub async fn create(
    dir: &Path,
    size: Option<u64>,
    base: Option<&LayerRef>,
    store: &Store,
    cache: &ChunkCache,
) -> Result<Descriptor> {
    if dir.join(DESCRIPTOR_FILE).exists() {
        return Err(Error::BadDevice {
            path: dir.to_owned(),
            reason: "already holds a device".into(),
        });
    }
    let layers = base_stack(store, cache, base).await?;
    // Opening the stack checks that it chains and gives the top's id and size.
    let stack = Device::open(layers, None)?;
    let size = match (size, base) {
        (Some(s), _) => s,
        (None, Some(_)) => stack.size(),
        (None, None) => {
            return Err(Error::InvalidConfig(
                "a device without a base needs a size".into(),
            ))
        }
    };
    if size == 0 || size % overlaybd::SECTOR != 0 {
        return Err(Error::InvalidConfig(format!(
            "device size {size} is not a positive multiple of 512"
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let _lock = DirLock::acquire(dir)?;
    let top = stack.top_id();
    Upper::create(dir, size, top)?;
    let d = Descriptor {
        version: DESCRIPTOR_VERSION,
        size,
        base: base.cloned(),
        base_id: top.to_hex(),
    };
    d.write(dir)?;
    Ok(d)
}

/// An opened device directory: the device and the lock that keeps other processes off it.
#[derive(Debug)]
pub struct OpenDevice {
    pub device: Arc<Device>,
    pub descriptor: Descriptor,
    lock: DirLock,
}

impl OpenDevice {
    /// The device directory.
    pub fn dir(&self) -> &Path {
        self.lock.dir()
    }
}

/// Open the device in `dir`: lock it, resolve its base from the store (lazily, through
/// `cache`), replay the upper's log (a torn tail after the last flush is dropped), and check
/// that the stack chains.
pub async fn open(dir: &Path, store: &Store, cache: &ChunkCache) -> Result<OpenDevice> {
    let lock = DirLock::acquire(dir)?;
    let descriptor = Descriptor::read(dir)?;
    let layers = base_stack(store, cache, descriptor.base.as_ref()).await?;
    let upper = Upper::open(dir)?;
    let device = Device::open(layers, Some(upper))?;
    if device.top_id().to_hex() != descriptor.base_id {
        return Err(Error::BadDevice {
            path: dir.to_owned(),
            reason: format!(
                "its base {} now resolves to layer {}, not {}",
                descriptor
                    .base
                    .as_ref()
                    .map_or_else(|| "(none)".into(), |b| b.to_string()),
                device.top_id(),
                descriptor.base_id
            ),
        });
    }
    Ok(OpenDevice {
        device: Arc::new(device),
        descriptor,
        lock,
    })
}

/// Seal what `device`'s upper holds into a layer and push it as `name` on top of `base`
/// (the manifest records `base` as its parent). The sealed file is written in `scratch` and
/// removed afterwards.
pub async fn commit_device(
    device: &Device,
    base: Option<&LayerRef>,
    scratch: &Path,
    store: &Store,
    name: &LayerRef,
) -> Result<PushedLayer> {
    device.flush()?;
    let file = scratch.join(format!(".commit-{}.layer", std::process::id()));
    let sealed = device.commit(&file);
    let pushed = match sealed {
        Ok(_) => overlaybd::push_layer(store, &file, name, base)
            .await
            .map_err(Error::from),
        Err(e) => Err(e.into()),
    };
    let _ = std::fs::remove_file(&file);
    pushed
}

/// `strata bd commit`: lock the device in `dir` (it must not be served), replay its upper,
/// seal it and push it as `name` on top of the device's base. Needs no chunk cache: only the
/// upper's bytes are read, and the base's id is checked against the store by
/// [`overlaybd::push_layer`].
pub async fn commit(dir: &Path, store: &Store, name: &LayerRef) -> Result<PushedLayer> {
    let _lock = DirLock::acquire(dir)?;
    let descriptor = Descriptor::read(dir)?;
    let upper = Upper::open(dir)?;
    if upper.parent_id().to_hex() != descriptor.base_id {
        return Err(Error::BadDevice {
            path: dir.to_owned(),
            reason: format!(
                "the upper sits on layer {}, the descriptor names {}",
                upper.parent_id(),
                descriptor.base_id
            ),
        });
    }
    let file = dir.join(format!(".commit-{}.layer", std::process::id()));
    upper.flush()?;
    let sealed = upper.seal(&file);
    let pushed = match sealed {
        Ok(_) => overlaybd::push_layer(store, &file, name, descriptor.base.as_ref())
            .await
            .map_err(Error::from),
        Err(e) => Err(e.into()),
    };
    let _ = std::fs::remove_file(&file);
    pushed
}
