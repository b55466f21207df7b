//! The FUSE mount plumbing both frontends share: mount(2) with an open `/dev/fuse` descriptor
//! (no `fusermount`, no libfuse), and umount2.

use std::ffi::CString;
use std::path::Path;

use rustix::mount::{MountFlags, UnmountFlags};

use crate::{Error, Result};

/// What a FUSE mount's root is, and how it is mounted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FuseMount {
    /// The `source` and filesystem subtype (`fuse.<name>`) shown in /proc/mounts.
    pub name: &'static str,
    /// The root is a regular file (mounted over a file) rather than a directory.
    pub file_root: bool,
    /// Mounted read-only.
    pub read_only: bool,
}

/// umount2(`path`, `flags`).
pub(crate) fn umount(path: &Path, flags: UnmountFlags) -> std::io::Result<()> {
    rustix::mount::unmount(path, flags).map_err(std::io::Error::from)
}

/// mount(2) a FUSE filesystem at `target`, served through the `/dev/fuse` descriptor `fd`,
/// with reads of up to `max_read` bytes.
pub(crate) fn mount_fuse(
    target: &Path,
    fd: libc::c_int,
    max_read: u32,
    how: FuseMount,
) -> Result<()> {
    // SAFETY: geteuid/getegid have no preconditions and cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let rootmode = if how.file_root { "100000" } else { "40000" };
    let opts = format!(
        "fd={fd},rootmode={rootmode},user_id={uid},group_id={gid},allow_other,\
         default_permissions,max_read={max_read}"
    );
    let opts = CString::new(opts).map_err(|_| Error::InvalidConfig("mount options".into()))?;
    let mut flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOATIME;
    if how.read_only {
        flags |= MountFlags::RDONLY;
    }
    rustix::mount::mount(
        how.name,
        target,
        format!("fuse.{}", how.name),
        flags,
        Some(opts.as_c_str()),
    )
    .map_err(|e| Error::io("mount FUSE on", target, e.into()))?;
    Ok(())
}

/// Open `/dev/fuse` (non-blocking: the session's workers wait in epoll).
pub(crate) fn open_dev() -> Result<std::os::fd::OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open("/dev/fuse")
        .map_err(|e| Error::io("open", "/dev/fuse", e))?;
    Ok(dev.into())
}

/// The device number `major:minor` of the newest mount at `target` (from
/// `/proc/self/mountinfo`, without touching the mount: a FUSE mount whose INIT is not answered
/// yet would block a `stat`).
pub(crate) fn mount_dev(target: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mount_dev_in(&text, target.to_str()?)
}

/// The device number of the newest mount at `target` in mountinfo `text`.
pub(crate) fn mount_dev_in(text: &str, target: &str) -> Option<String> {
    text.lines().rev().find_map(|l| {
        let mut f = l.split(' ');
        let dev = f.nth(2)?;
        let _root = f.next()?;
        let mp = f.next()?;
        (crate::node::sys::unescape_field(mp) == target).then(|| dev.to_owned())
    })
}

/// Unmount `target` and wait for our session's workers (they end with the connection). If
/// the mount is still in use, detach it lazily (the workers serve the remaining users, then
/// end) and return [`Error::Busy`] saying `busy`.
pub(crate) fn stop_session(
    target: &Path,
    mut session: crate::fuse::Session,
    busy: &str,
) -> Result<()> {
    match unmount_retrying(target) {
        Ok(()) => {
            session.join();
            Ok(())
        }
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let detached = umount(target, UnmountFlags::DETACH);
            // The workers stop on their own when the kernel drops the connection.
            std::thread::spawn(move || session.join());
            detached.map_err(|e| Error::io("umount2(MNT_DETACH)", target, e))?;
            Err(Error::Busy {
                path: target.to_path_buf(),
                what: busy.into(),
            })
        }
        Err(e) => {
            session.stop();
            Err(Error::io("umount", target, e))
        }
    }
}

/// umount2(`target`), retried a few times on `EBUSY`: a mount can be busy for a moment only
/// (a child another thread of this process is spawning holds copies of its descriptors
/// until it execs).
fn unmount_retrying(target: &Path) -> std::io::Result<()> {
    let mut tries = 0;
    loop {
        match umount(target, UnmountFlags::empty()) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 5 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}
