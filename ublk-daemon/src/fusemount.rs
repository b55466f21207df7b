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
