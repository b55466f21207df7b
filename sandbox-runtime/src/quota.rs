//! # Sandbox uppers on one node-wide filesystem, each bounded by `--disk`
//!
//! Every sandbox's overlay upper and work directory live in **one btrfs filesystem per
//! node**, in a **subvolume per sandbox** with a **qgroup limit** of its `--disk`. A sandbox
//! that writes past its limit gets `EDQUOT` inside; neither the node's own disk nor the other
//! sandboxes see anything of it.
//!
//! ## On disk (`<dir>` = the manager's sandbox directory, on local disk)
//! ```text
//! <dir>/uppers.img           the filesystem's image, preallocated to its full size
//! <dir>/uppers/              its mount (a loop device, LO_FLAGS_AUTOCLEAR, direct I/O)
//! <dir>/uppers/<id>/         a btrfs subvolume per sandbox; its qgroup 0/<subvolid> carries
//!                            the limit (max referenced = max exclusive = --disk)
//! <dir>/uppers/<id>/upper    the overlay's upperdir (0755: it is the sandbox's /)
//! <dir>/uppers/<id>/work     the overlay's workdir (same subvolume: overlayfs renames
//!                            between the two, which btrfs refuses across subvolumes)
//! ```
//! The mapping sandbox → quota needs no bookkeeping: the subvolume *is* the sandbox's
//! directory, its id is read back from it (`BTRFS_IOC_INO_LOOKUP`), and a fresh subvolume
//! always has a fresh id (btrfs never reuses one), so a removed sandbox's charges can never
//! leak into a new one of the same name.
//!
//! ## Why not ext4 (or XFS) project quotas, why not a filesystem per sandbox
//! - A loop filesystem per sandbox costs a `mkfs` (a fork+exec), a loop device, a mount and a
//!   journal thread per sandbox, wastes a journal's worth of space each, and a sparse image per
//!   sandbox overcommits the node's disk. Too slow and too heavy at hundreds per second.
//! - ext4 project quotas were the first design (one ext4 image, `-O quota,project`, a project
//!   id per sandbox). They need the kernel's quota format `CONFIG_QFMT_V2`, which the node
//!   kernel here (6.18, `CONFIG_QUOTA=y` but no `QFMT_V2`) does not have: mounting with
//!   `prjquota` fails ("The kernel was not built with CONFIG_QUOTA and CONFIG_QFMT_V2"), and
//!   `CONFIG_XFS_QUOTA` is off too. btrfs qgroups are built into btrfs itself: nothing beyond
//!   `CONFIG_BTRFS_FS` is needed, so they work on this kernel and on distribution kernels.
//! - btrfs gives what the project-quota design wanted and a little more: creating a subvolume
//!   is one ioctl (no project-id allocator, no `quotactl` on a device path); the limit counts
//!   metadata too, so a flood of empty files is bounded as well (ext4 would need a separate
//!   inode limit); deleting a subvolume is one ioctl whatever its size (the space is freed in
//!   the background by btrfs's cleaner).
//! - Simple quotas (`BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA`, Linux ≥ 6.7) are enabled when the
//!   kernel has them (they account at allocation time, no backref walks at commit); older
//!   kernels get full qgroups, which are cheap here too as uppers never share extents.
//!
//! ## The image's lifecycle
//! - Made once by the first [`UpperFs::open`]: `mkfs.btrfs -m single -d single` (no point
//!   duplicating metadata on an image that is itself a file on a disk) into
//!   `uppers.img.tmp`, then **preallocated** (`fallocate`) to its full size and renamed into
//!   place, so a half-made image is never used. Preallocated, not sparse: a sparse image
//!   would let the sandboxes, all within their limits, fill the node's disk before the image
//!   fills; preallocated, the node's disk loses exactly `size` up front and never more.
//!   (Hence `nodiscard`: btrfs would otherwise turn on async discard by itself on a loop
//!   device, punching the reservation back out as files are deleted.)
//! - Attached with `LOOP_CONFIGURE` (`LO_FLAGS_AUTOCLEAR`, direct I/O when the host
//!   filesystem takes it, so the page cache holds the uppers once, not twice) and mounted
//!   `noatime,nodiscard` at `<dir>/uppers`. Autoclear: the loop device detaches by itself when the
//!   filesystem is unmounted, so there is nothing to leak.
//! - A daemon restart finds `<dir>/uppers` mounted already (`/proc/self/mountinfo`, and the
//!   loop device's `backing_file` is checked to be this image) and reuses it, quotas and all:
//!   they live in the filesystem.
//! - After a reboot the loop device is gone; `open` attaches and mounts the image again
//!   (btrfs replays its log tree on mount; there is no fsck step: `btrfs check --repair` is
//!   not something to run unattended). If the mount fails the error says so; the uppers only
//!   hold sandboxes that a reboot has stopped anyway, so deleting `uppers.img` is the way out.
//! - The size is only used when the image is made; a later `open` with another size uses the
//!   image as it is (growing it would be `btrfs filesystem resize` after growing the file).
//!
//! ## Limits and accounting
//! - The limit is enforced when data and metadata are *reserved* (at `write(2)`, before
//!   writeback), so `EDQUOT` arrives at ≈ the limit, a few hundred KiB early at most.
//! - [`UpperFs::usage`] is the qgroup's `referenced` bytes (sysfs) — as of btrfs's last
//!   transaction commit (every 30 s, or a `sync`) — plus the data still reserved for dirty
//!   pages, so it is about current without forcing a commit.
//! - Limits are not reservations: the sum of the sandboxes' limits may exceed the image, and
//!   then a full image gives `ENOSPC` to all of them. The manager decides whether to allow
//!   that ([`UpperFs::capacity`]).
//!
//! ## Costs measured (this machine: 2 cores, host ext4 on a virtio disk, kernel 6.18)
//! - [`UpperFs::open`] the first time (`mkfs.btrfs` + preallocating 512 MiB + loop + mount +
//!   enabling quotas): 80–180 ms, once per node; `mkfs.btrfs` alone ≈ 0.1 s whatever the
//!   size (it writes a few MiB), `fallocate` of 20 GiB on ext4 ≈ 50 ms. Reopening a mounted
//!   one: ≈ 0.2 ms.
//! - [`UpperFs::create`] (subvolume + qgroup limit + two directories), 200 in a row
//!   (`tests/quota.rs`, debug build, four runs): 25–53 ms in all, mean 120–270 µs, p50
//!   ≈ 95–135 µs, p99 1.5–4.6 ms (a transaction commit now and then). [`UpperFs::remove`]
//!   of those 200 (empty): 6–10 ms in all.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, Result};

/// Smallest image `mkfs.btrfs` accepts with single profiles (it refuses below ~110 MiB).
pub const MIN_IMAGE_SIZE: u64 = 256 << 20;
/// Smallest `--disk`: a subvolume with its tree blocks and two directories needs a few
/// dozen KiB, and below a MiB a sandbox could not even copy up a small file.
pub const MIN_LIMIT: u64 = 1 << 20;

/// The node's filesystem of sandbox uppers: one btrfs image, a subvolume and qgroup per
/// sandbox. Dropping it leaves the filesystem mounted (for the next daemon); see
/// [`UpperFs::unmount`].
#[derive(Debug)]
pub struct UpperFs {
    image: PathBuf,
    mnt: PathBuf,
    /// The mount's root, kept open for the subvolume ioctls.
    root: File,
    /// `/sys/fs/btrfs/<fsid>`.
    sysfs: PathBuf,
    /// The loop device it is mounted from.
    device: PathBuf,
    capacity: u64,
}

impl UpperFs {
    /// Open the node's upper filesystem under `dir`: reuse `<dir>/uppers` if it is mounted
    /// already, else attach and mount `<dir>/uppers.img`, making it (of `size` bytes,
    /// preallocated) first if there is none.
    pub fn open(dir: &Path, size: u64) -> Result<UpperFs> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let dir = dir
            .canonicalize()
            .map_err(|e| Error::io(format!("resolve {}", dir.display()), e))?;
        let image = dir.join("uppers.img");
        let mnt = dir.join("uppers");
        match std::fs::create_dir(&mnt) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(format!("create {}", mnt.display()), e)),
        }
        let device = match mounted_at(&mnt)? {
            Some(m) => {
                if m.fstype != "btrfs" {
                    return Err(Error::Conflict(format!(
                        "{} is a {} mount of {}, not the uppers' btrfs",
                        mnt.display(),
                        m.fstype,
                        m.source
                    )));
                }
                let dev = PathBuf::from(&m.source);
                match loop_backing_file(&dev) {
                    Some(b) if b == image => {}
                    b => {
                        return Err(Error::Conflict(format!(
                            "{} is mounted from {} (backing file {:?}), not from {}",
                            mnt.display(),
                            m.source,
                            b,
                            image.display()
                        )))
                    }
                }
                dev
            }
            None => {
                if !image.exists() {
                    make_image(&image, size)?;
                }
                let (dev, loop_file) = attach_loop(&image)?;
                let r = rustix::mount::mount(
                    &dev,
                    &mnt,
                    "btrfs",
                    rustix::mount::MountFlags::NOATIME,
                    // btrfs turns on async discard by itself on a device that takes discards
                    // (a loop device does), which would punch the preallocation back out.
                    Some(c"nodiscard"),
                );
                // The mount holds the device now; with autoclear, closing our descriptor
                // after a failed mount detaches it.
                drop(loop_file);
                r.map_err(|e| {
                    Error::io(
                        format!(
                            "mount {} ({}) on {} (if the image is damaged, remove it: it only \
                             holds the uppers of sandboxes that are stopped)",
                            image.display(),
                            dev.display(),
                            mnt.display()
                        ),
                        e.into(),
                    )
                })?;
                dev
            }
        };
        let root = open_dir(&mnt)?;
        let info = fs_info(&root, &mnt)?;
        let sysfs = PathBuf::from(format!("/sys/fs/btrfs/{}", uuid(&info.fsid)));
        if !sysfs.join("qgroups").exists() {
            enable_quota(&root, &mnt)?;
        }
        let st = rustix::fs::fstatvfs(&root)
            .map_err(|e| Error::io(format!("statfs {}", mnt.display()), e.into()))?;
        Ok(UpperFs {
            image,
            mnt,
            root,
            sysfs,
            device,
            capacity: st.f_blocks * st.f_frsize,
        })
    }

    /// The mount of the uppers (`<dir>/uppers`).
    pub fn root(&self) -> &Path {
        &self.mnt
    }

    /// The image file (`<dir>/uppers.img`).
    pub fn image(&self) -> &Path {
        &self.image
    }

    /// The loop device the filesystem is mounted from.
    pub fn device(&self) -> &Path {
        &self.device
    }

    /// The filesystem's size, bytes (what all limits together share).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Make sandbox `id`'s upper and work directories (`<root>/<id>/upper`, `…/work`), in a
    /// fresh subvolume limited to `limit` bytes (data and metadata; `None`: only the
    /// filesystem's size). `Conflict` if `id` has one already.
    pub fn create(&self, id: &str, limit: Option<u64>) -> Result<(PathBuf, PathBuf)> {
        check_id(id)?;
        if let Some(l) = limit {
            if l < MIN_LIMIT {
                return Err(Error::InvalidSpec(format!(
                    "--disk {l} is below the minimum of {MIN_LIMIT} bytes"
                )));
            }
            if l > self.capacity {
                return Err(Error::Limit(format!(
                    "--disk {l} exceeds the node's upper filesystem ({} bytes)",
                    self.capacity
                )));
            }
        }
        let sub = self.mnt.join(id);
        let mut args = VolArgs::new(id)?;
        // SAFETY: `self.root` is an open directory on the btrfs mount; `args` is a valid,
        // initialised `btrfs_ioctl_vol_args` (size asserted) that lives across the call, and
        // the kernel only reads it.
        let r = unsafe { libc::ioctl(self.root.as_raw_fd(), BTRFS_IOC_SUBVOL_CREATE, &mut *args) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Err(Error::Conflict(format!(
                    "{} exists already (leftovers of another sandbox {id}?)",
                    sub.display()
                )));
            }
            return Err(Error::io(format!("create subvolume {}", sub.display()), e));
        }
        let made = (|| {
            let dir = open_dir(&sub)?;
            let subvol = subvol_id(&dir, &sub)?;
            if let Some(l) = limit {
                set_limit(&dir, subvol, Some(l), &sub)?;
            }
            let upper = sub.join("upper");
            let work = sub.join("work");
            for (d, mode) in [(&upper, 0o755), (&work, 0o700)] {
                std::fs::DirBuilder::new()
                    .mode(mode)
                    .create(d)
                    .map_err(|e| Error::io(format!("create {}", d.display()), e))?;
                // The mode exactly, whatever the umask.
                std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(mode))
                    .map_err(|e| Error::io(format!("chmod {}", d.display()), e))?;
            }
            std::fs::set_permissions(&sub, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .map_err(|e| Error::io(format!("chmod {}", sub.display()), e))?;
            Ok((upper, work))
        })();
        if made.is_err() {
            let _ = self.destroy(id);
        }
        made
    }

    /// Bytes charged to sandbox `id` (data and metadata): as of the last commit, plus data
    /// reserved for dirty pages since. `NotFound` if it has no upper.
    pub fn usage(&self, id: &str) -> Result<u64> {
        check_id(id)?;
        let sub = self.mnt.join(id);
        let dir = match File::open(&sub) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Error::NotFound(format!("sandbox {id} has no upper")))
            }
            Err(e) => return Err(Error::io(format!("open {}", sub.display()), e)),
        };
        let subvol = subvol_id(&dir, &sub)?;
        let q = self.sysfs.join(format!("qgroups/0_{subvol}"));
        let read = |name: &str, required: bool| -> Result<u64> {
            let p = q.join(name);
            match std::fs::read_to_string(&p) {
                Ok(s) => s.trim().parse().map_err(|_| {
                    Error::io(
                        format!("read {}", p.display()),
                        io::Error::new(io::ErrorKind::InvalidData, format!("{s:?}")),
                    )
                }),
                Err(e) if !required && e.kind() == io::ErrorKind::NotFound => Ok(0),
                Err(e) => Err(Error::io(format!("read {}", p.display()), e)),
            }
        };
        Ok(read("referenced", true)? + read("rsv_data", false)?)
    }

    /// Remove sandbox `id`'s upper and work directories and their quota. Idempotent. The
    /// overlay using them must be unmounted first. Deleting the subvolume is one ioctl
    /// whatever its size; btrfs's cleaner frees its space (and drops its qgroup) in the
    /// background, at the next commit (within 30 s) or after [`UpperFs::reclaim`].
    pub fn remove(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.destroy(id)
    }

    fn destroy(&self, id: &str) -> Result<()> {
        let sub = self.mnt.join(id);
        let dir = match File::open(&sub) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io(format!("open {}", sub.display()), e)),
        };
        let subvol = subvol_id(&dir, &sub)?;
        drop(dir);
        if subvol == BTRFS_FS_TREE_OBJECTID {
            // A plain directory (made by hand?): no subvolume, no quota.
            return std::fs::remove_dir_all(&sub)
                .map_err(|e| Error::io(format!("remove {}", sub.display()), e));
        }
        let mut args = VolArgs::new(id)?;
        // SAFETY: as in `create`: a directory on the mount and a valid `btrfs_ioctl_vol_args`.
        let r = unsafe { libc::ioctl(self.root.as_raw_fd(), BTRFS_IOC_SNAP_DESTROY, &mut *args) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOENT) {
                return Err(Error::io(format!("delete subvolume {}", sub.display()), e));
            }
        }
        // Its qgroup goes when the cleaner has dropped the subvolume (the kernel removes the
        // qgroups of dropped subvolumes itself, as seen on 6.18; deleting it now fails with
        // EBUSY while the subvolume's extents are still charged). Best effort, for kernels
        // where it is already free.
        let mut q = QgroupCreateArgs {
            create: 0,
            qgroupid: subvol,
        };
        // SAFETY: a directory on the mount and a valid `btrfs_ioctl_qgroup_create_args`
        // (size asserted) that outlives the call.
        let _ = unsafe { libc::ioctl(self.root.as_raw_fd(), BTRFS_IOC_QGROUP_CREATE, &mut q) };
        Ok(())
    }

    /// Commit the filesystem and wake btrfs's cleaner, which frees the space of removed
    /// uppers (otherwise it runs at the next periodic commit, within 30 s). A full sync of
    /// the uppers: for when space is short, not for every `remove`.
    pub fn reclaim(&self) -> Result<()> {
        // SAFETY: BTRFS_IOC_SYNC takes no argument; `self.root` is open on the mount.
        let r = unsafe { libc::ioctl(self.root.as_raw_fd(), BTRFS_IOC_SYNC) };
        if r < 0 {
            return Err(Error::io(
                format!("sync {}", self.mnt.display()),
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Unmount the filesystem (its loop device detaches by itself). Every overlay on it
    /// must be unmounted first (`EBUSY` otherwise). For tests and for decommissioning a
    /// node; a daemon that stops leaves it mounted.
    pub fn unmount(self) -> Result<()> {
        let UpperFs { mnt, root, .. } = self;
        drop(root);
        rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::empty())
            .map_err(|e| Error::io(format!("unmount {}", mnt.display()), e.into()))
    }
}

/// A default size for the image: half the space available on `dir`'s filesystem now, in
/// whole GiB, at least [`MIN_IMAGE_SIZE`].
pub fn default_size(dir: &Path) -> Result<u64> {
    let st = rustix::fs::statvfs(dir)
        .map_err(|e| Error::io(format!("statfs {}", dir.display()), e.into()))?;
    let half = st.f_bavail * st.f_frsize / 2;
    Ok((half & !((1 << 30) - 1)).max(MIN_IMAGE_SIZE))
}

/// Sandbox ids as the manager makes them: `[a-z0-9][a-z0-9_-]{0,62}`.
fn check_id(id: &str) -> Result<()> {
    let b = id.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidSpec(format!("bad sandbox id {id:?}")))
    }
}

fn open_dir(p: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(p)
        .map_err(|e| Error::io(format!("open {}", p.display()), e))
}

fn run(cmd: &mut Command) -> Result<()> {
    let what = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| Error::io(format!("run {what}"), e))?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::io(
        format!("{what}: {}", out.status),
        io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
    ))
}

/// Make the image at `image` (via `image.tmp`, renamed into place when complete).
fn make_image(image: &Path, size: u64) -> Result<()> {
    if size < MIN_IMAGE_SIZE {
        return Err(Error::InvalidSpec(format!(
            "the uppers' image must be at least {MIN_IMAGE_SIZE} bytes, not {size}"
        )));
    }
    let size = size & !4095;
    let tmp = image.with_extension("img.tmp");
    let _ = std::fs::remove_file(&tmp);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
    let made = (|| {
        f.set_len(size)
            .map_err(|e| Error::io(format!("size {}", tmp.display()), e))?;
        run(Command::new("mkfs.btrfs")
            .args([
                "-q",
                "-f",
                "-K",
                "-m",
                "single",
                "-d",
                "single",
                "-L",
                "strata-uppers",
            ])
            .arg(&tmp))?;
        rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, size).map_err(|e| {
            Error::io(
                format!("preallocate {} bytes for {}", size, tmp.display()),
                e.into(),
            )
        })?;
        f.sync_all()
            .map_err(|e| Error::io(format!("sync {}", tmp.display()), e))?;
        std::fs::rename(&tmp, image)
            .map_err(|e| Error::io(format!("rename to {}", image.display()), e))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    made
}

// ---- mountinfo and sysfs ----

#[derive(Debug)]
struct MountEntry {
    fstype: String,
    source: String,
}

/// The topmost mount at `mnt` (canonical path), if any.
fn mounted_at(mnt: &Path) -> Result<Option<MountEntry>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| Error::io("read /proc/self/mountinfo", e))?;
    let want = mnt.as_os_str().as_bytes();
    let mut found = None;
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = left.split(' ').nth(4) else {
            continue;
        };
        if unescape(point) != want {
            continue;
        }
        let mut r = right.split(' ');
        let (Some(fstype), Some(source)) = (r.next(), r.next()) else {
            continue;
        };
        found = Some(MountEntry {
            fstype: fstype.to_owned(),
            source: String::from_utf8_lossy(&unescape(source)).into_owned(),
        });
    }
    Ok(found)
}

/// mountinfo's octal escapes (`\040` for a space, …).
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The backing file of loop device `dev` (`/dev/loopN`), from sysfs.
fn loop_backing_file(dev: &Path) -> Option<PathBuf> {
    let name = dev.file_name()?.to_str()?;
    if !name.starts_with("loop") {
        return None;
    }
    let s = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(s.trim_end_matches('\n')))
}

fn uuid(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

// ---- loop devices ----

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

/// `struct loop_info64` (linux/loop.h).
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);

/// `struct loop_config` (linux/loop.h), for `LOOP_CONFIGURE`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

/// Attach `image` to a free loop device with autoclear (and direct I/O if the host
/// filesystem takes it). Returns the device and an open descriptor of it: the device
/// detaches when that is closed unless something (a mount) holds it.
fn attach_loop(image: &Path) -> Result<(PathBuf, File)> {
    let backing = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(image)
        .map_err(|e| Error::io(format!("open {}", image.display()), e))?;
    let ctl = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")
        .map_err(|e| Error::io("open /dev/loop-control", e))?;
    let mut name = [0u8; LO_NAME_SIZE];
    let bytes = image.as_os_str().as_bytes();
    let n = bytes.len().min(LO_NAME_SIZE - 1);
    name[..n].copy_from_slice(&bytes[..n]);
    let mut last = None;
    // Another process may take the free device between GET_FREE and CONFIGURE (EBUSY).
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number or -1.
        let nr = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if nr < 0 {
            return Err(Error::io("LOOP_CTL_GET_FREE", io::Error::last_os_error()));
        }
        let dev = PathBuf::from(format!("/dev/loop{nr}"));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&dev)
            .map_err(|e| Error::io(format!("open {}", dev.display()), e))?;
        for direct in [true, false] {
            let cfg = LoopConfig {
                fd: backing.as_raw_fd() as u32,
                block_size: if direct { 4096 } else { 0 },
                info: LoopInfo64 {
                    lo_device: 0,
                    lo_inode: 0,
                    lo_rdevice: 0,
                    lo_offset: 0,
                    lo_sizelimit: 0,
                    lo_number: 0,
                    lo_encrypt_type: 0,
                    lo_encrypt_key_size: 0,
                    lo_flags: LO_FLAGS_AUTOCLEAR | if direct { LO_FLAGS_DIRECT_IO } else { 0 },
                    lo_file_name: name,
                    lo_crypt_name: [0; LO_NAME_SIZE],
                    lo_encrypt_key: [0; 32],
                    lo_init: [0; 2],
                },
                reserved: [0; 8],
            };
            // SAFETY: `f` is an open loop device, `cfg` a valid `struct loop_config` (size
            // asserted) naming an open backing file; the kernel only reads it.
            let r = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CONFIGURE, &cfg) };
            if r == 0 {
                return Ok((dev, f));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Direct I/O refused (the host filesystem's alignment): buffered then.
                Some(libc::EINVAL) if direct => last = Some(e),
                Some(libc::EBUSY) => {
                    last = Some(e);
                    break;
                }
                _ => {
                    return Err(Error::io(
                        format!("LOOP_CONFIGURE {} on {}", image.display(), dev.display()),
                        e,
                    ))
                }
            }
        }
    }
    Err(Error::io(
        format!("attach {} to a loop device", image.display()),
        last.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EBUSY)),
    ))
}

// ---- btrfs ioctls (linux/btrfs.h) ----

const BTRFS_IOCTL_MAGIC: libc::c_ulong = 0x94;
const BTRFS_FS_TREE_OBJECTID: u64 = 5;
const BTRFS_FIRST_FREE_OBJECTID: u64 = 256;
const BTRFS_QGROUP_LIMIT_MAX_RFER: u64 = 1;
const BTRFS_QGROUP_LIMIT_MAX_EXCL: u64 = 2;
const BTRFS_QUOTA_CTL_ENABLE: u64 = 1;
const BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA: u64 = 4;

const fn ioc(dir: libc::c_ulong, nr: libc::c_ulong, size: usize) -> libc::c_ulong {
    (dir << 30) | ((size as libc::c_ulong) << 16) | (BTRFS_IOCTL_MAGIC << 8) | nr
}
const IOC_W: libc::c_ulong = 1;
const IOC_R: libc::c_ulong = 2;

/// `struct btrfs_ioctl_vol_args`.
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}
const _: () = assert!(std::mem::size_of::<VolArgs>() == 4096);

impl VolArgs {
    fn new(name: &str) -> Result<Box<VolArgs>> {
        let c = CString::new(name).map_err(|_| Error::InvalidSpec(format!("bad name {name:?}")))?;
        let b = c.as_bytes();
        if b.len() >= 4088 {
            return Err(Error::InvalidSpec(format!("name {name:?} is too long")));
        }
        let mut a = Box::new(VolArgs {
            fd: 0,
            name: [0; 4088],
        });
        a.name[..b.len()].copy_from_slice(b);
        Ok(a)
    }
}

/// `struct btrfs_ioctl_ino_lookup_args`.
#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}
const _: () = assert!(std::mem::size_of::<InoLookupArgs>() == 4096);

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}
const _: () = assert!(std::mem::size_of::<QuotaCtlArgs>() == 16);

/// `struct btrfs_qgroup_limit`.
#[repr(C)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_qgroup_limit_args`.
#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}
const _: () = assert!(std::mem::size_of::<QgroupLimitArgs>() == 48);

/// `struct btrfs_ioctl_qgroup_create_args`.
#[repr(C)]
struct QgroupCreateArgs {
    create: u64,
    qgroupid: u64,
}
const _: () = assert!(std::mem::size_of::<QgroupCreateArgs>() == 16);

/// `struct btrfs_ioctl_fs_info_args`.
#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    nodesize: u32,
    sectorsize: u32,
    clone_alignment: u32,
    csum_type: u16,
    csum_size: u16,
    flags: u64,
    generation: u64,
    metadata_uuid: [u8; 16],
    reserved: [u8; 944],
}
const _: () = assert!(std::mem::size_of::<FsInfoArgs>() == 1024);

const BTRFS_IOC_SYNC: libc::c_ulong = ioc(0, 8, 0);
const BTRFS_IOC_SUBVOL_CREATE: libc::c_ulong = ioc(IOC_W, 14, std::mem::size_of::<VolArgs>());
const BTRFS_IOC_SNAP_DESTROY: libc::c_ulong = ioc(IOC_W, 15, std::mem::size_of::<VolArgs>());
const BTRFS_IOC_INO_LOOKUP: libc::c_ulong =
    ioc(IOC_W | IOC_R, 18, std::mem::size_of::<InoLookupArgs>());
const BTRFS_IOC_FS_INFO: libc::c_ulong = ioc(IOC_R, 31, std::mem::size_of::<FsInfoArgs>());
const BTRFS_IOC_QUOTA_CTL: libc::c_ulong =
    ioc(IOC_W | IOC_R, 40, std::mem::size_of::<QuotaCtlArgs>());
const BTRFS_IOC_QGROUP_CREATE: libc::c_ulong =
    ioc(IOC_W, 42, std::mem::size_of::<QgroupCreateArgs>());
// `_IOR` in the header although the kernel reads it: kept as the kernel defines it.
const BTRFS_IOC_QGROUP_LIMIT: libc::c_ulong =
    ioc(IOC_R, 43, std::mem::size_of::<QgroupLimitArgs>());

/// The id of the subvolume `dir` (an open directory at `path`) is in.
fn subvol_id(dir: &File, path: &Path) -> Result<u64> {
    let mut a = Box::new(InoLookupArgs {
        treeid: 0,
        objectid: BTRFS_FIRST_FREE_OBJECTID,
        name: [0; 4080],
    });
    // SAFETY: `dir` is open on btrfs; `a` is a valid `btrfs_ioctl_ino_lookup_args` (size
    // asserted) the kernel reads and fills, and it outlives the call.
    let r = unsafe { libc::ioctl(dir.as_raw_fd(), BTRFS_IOC_INO_LOOKUP, &mut *a) };
    if r < 0 {
        return Err(Error::io(
            format!("look up the subvolume of {}", path.display()),
            io::Error::last_os_error(),
        ));
    }
    Ok(a.treeid)
}

fn set_limit(dir: &File, subvol: u64, limit: Option<u64>, path: &Path) -> Result<()> {
    let l = limit.unwrap_or(0);
    let mut a = QgroupLimitArgs {
        qgroupid: subvol,
        lim: QgroupLimit {
            flags: if limit.is_some() {
                BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL
            } else {
                0
            },
            max_rfer: l,
            max_excl: l,
            rsv_rfer: 0,
            rsv_excl: 0,
        },
    };
    // SAFETY: `dir` is open on btrfs; `a` is a valid `btrfs_ioctl_qgroup_limit_args` (size
    // asserted) that outlives the call.
    let r = unsafe { libc::ioctl(dir.as_raw_fd(), BTRFS_IOC_QGROUP_LIMIT, &mut a) };
    if r < 0 {
        return Err(Error::io(
            format!("limit {} to {l} bytes", path.display()),
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn fs_info(root: &File, path: &Path) -> Result<Box<FsInfoArgs>> {
    // SAFETY: all-zero is a valid `FsInfoArgs` (integers and byte arrays only).
    let mut a: Box<FsInfoArgs> = Box::new(unsafe { std::mem::zeroed() });
    // SAFETY: `root` is open on btrfs; `a` is a valid `btrfs_ioctl_fs_info_args` (size
    // asserted) the kernel fills, and it outlives the call.
    let r = unsafe { libc::ioctl(root.as_raw_fd(), BTRFS_IOC_FS_INFO, &mut *a) };
    if r < 0 {
        return Err(Error::io(
            format!("BTRFS_IOC_FS_INFO on {}", path.display()),
            io::Error::last_os_error(),
        ));
    }
    Ok(a)
}

/// Enable simple quotas, or full qgroups on kernels without them (before 6.7).
fn enable_quota(root: &File, path: &Path) -> Result<()> {
    let mut last = None;
    for cmd in [BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, BTRFS_QUOTA_CTL_ENABLE] {
        let mut a = QuotaCtlArgs { cmd, status: 0 };
        // SAFETY: `root` is open on btrfs; `a` is a valid `btrfs_ioctl_quota_ctl_args` (size
        // asserted) that outlives the call.
        let r = unsafe { libc::ioctl(root.as_raw_fd(), BTRFS_IOC_QUOTA_CTL, &mut a) };
        if r == 0 {
            return Ok(());
        }
        last = Some(io::Error::last_os_error());
    }
    Err(Error::io(
        format!("enable quotas on {}", path.display()),
        last.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EINVAL)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(check_id("a").is_ok());
        assert!(check_id("sb-1_x").is_ok());
        for bad in ["", "-a", "A", "a/b", "..", ".", "a b", &"a".repeat(64)] {
            assert!(
                matches!(check_id(bad), Err(Error::InvalidSpec(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape(r"/a\040b"), b"/a b");
        assert_eq!(unescape(r"/a\134"), b"/a\\");
        assert_eq!(unescape("/plain"), b"/plain");
    }

    #[test]
    fn uuid_format() {
        let b: [u8; 16] = std::array::from_fn(|i| i as u8);
        assert_eq!(uuid(&b), "00010203-0405-0607-0809-0a0b0c0d0e0f");
    }

    #[test]
    fn ioctl_numbers() {
        // Values from linux/btrfs.h and linux/loop.h as compiled by C.
        assert_eq!(BTRFS_IOC_SYNC, 0x9408);
        assert_eq!(BTRFS_IOC_SUBVOL_CREATE, 0x5000_940e);
        assert_eq!(BTRFS_IOC_SNAP_DESTROY, 0x5000_940f);
        assert_eq!(BTRFS_IOC_INO_LOOKUP, 0xd000_9412);
        assert_eq!(BTRFS_IOC_FS_INFO, 0x8400_941f);
        assert_eq!(BTRFS_IOC_QUOTA_CTL, 0xc010_9428);
        assert_eq!(BTRFS_IOC_QGROUP_CREATE, 0x4010_942a);
        assert_eq!(BTRFS_IOC_QGROUP_LIMIT, 0x8030_942b);
    }
}
