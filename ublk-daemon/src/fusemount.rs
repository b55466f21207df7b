//! The FUSE mount plumbing both frontends share: mount(2) with an open `/dev/fuse` descriptor
//! (no `fusermount`, no libfuse), and umount2.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

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

pub(crate) fn cstring(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::io(
            "use",
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains a NUL byte"),
        )
    })
}

/// umount2(`path`, `flags`).
pub(crate) fn umount(path: &Path, flags: libc::c_int) -> std::io::Result<()> {
    let c = cstring(path).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let rc = unsafe { libc::umount2(c.as_ptr(), flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
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
    let c_target = cstring(target)?;
    let c_opts = CString::new(opts).map_err(|_| Error::InvalidConfig("mount options".into()))?;
    let c_source = CString::new(how.name).map_err(|_| Error::InvalidConfig("mount name".into()))?;
    let c_type = CString::new(format!("fuse.{}", how.name))
        .map_err(|_| Error::InvalidConfig("mount name".into()))?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    if how.read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call; `data`
    // is the text option string the fuse filesystem expects.
    let rc = unsafe {
        libc::mount(
            c_source.as_ptr(),
            c_target.as_ptr(),
            c_type.as_ptr(),
            flags,
            c_opts.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(Error::io(
            "mount FUSE on",
            target,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Open `/dev/fuse`, mount it at `target` and answer the kernel's INIT with `fs` on `threads`
/// threads (each with its own cloned descriptor). A failure after mount(2) detaches the mount.
pub(crate) fn start<FS: fuser::Filesystem + Send + Sync + 'static>(
    target: &Path,
    max_read: u32,
    threads: usize,
    how: FuseMount,
    fs: FS,
) -> Result<fuser::BackgroundSession> {
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::fs::OpenOptionsExt;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/fuse")
        .map_err(|e| Error::io("open", "/dev/fuse", e))?;
    let dev: OwnedFd = dev.into();
    mount_fuse(target, dev.as_raw_fd(), max_read, how)?;
    // From here on, a failure must not leave the mount behind.
    let detach = |e: Error| {
        let _ = umount(target, libc::MNT_DETACH);
        e
    };
    let mut config = fuser::Config::default();
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(threads);
    config.clone_fd = true;
    // The kernel sent INIT when the mount was made; the handshake answers it.
    let session = fuser::Session::from_fd(fs, dev, fuser::SessionACL::All, config)
        .map_err(|e| detach(Error::io("FUSE handshake on", target, e)))?;
    session
        .spawn()
        .map_err(|e| detach(Error::io("start FUSE threads for", target, e)))
}

/// Unmount `target` and wait for `session`'s threads. If the mount is still in use, detach
/// it lazily (the threads serve the remaining users, then end) and return [`Error::Busy`]
/// saying `busy`.
pub(crate) fn stop(target: &Path, session: fuser::BackgroundSession, busy: &str) -> Result<()> {
    match umount(target, 0) {
        Ok(()) => session
            .join()
            .map_err(|e| Error::io("stop FUSE threads of", target, e)),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let detached = umount(target, libc::MNT_DETACH);
            // The threads stop on their own when the kernel drops the connection.
            drop(session);
            detached.map_err(|e| Error::io("umount2(MNT_DETACH)", target, e))?;
            Err(Error::Busy {
                path: target.to_path_buf(),
                what: busy.into(),
            })
        }
        Err(e) => {
            // Not mounted any more, or another failure: the threads end with the connection.
            drop(session);
            Err(Error::io("umount", target, e))
        }
    }
}
