//! The kernel side of the node: mount(2) calls, `/proc/self/mountinfo`, `/proc/filesystems`.
//!
//! Everything here is synchronous (system calls); the node runs it on blocking threads,
//! because a mount of a file inside our own FUSE mount makes the kernel call back into this
//! process.

use std::ffi::{CString, OsString};
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

use rustix::mount::{MountFlags, UnmountFlags};

use super::proto::{ApiError, ErrorKind};

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fstype: String,
    pub source: PathBuf,
    pub super_options: String,
}

/// Undo mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(field: &str) -> OsString {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            let digits = &b[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let v = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    OsString::from_vec(out)
}

/// A mountinfo field (octal escapes undone) as a string, for comparisons with UTF-8 paths.
pub(crate) fn unescape_field(field: &str) -> String {
    unescape(field).to_string_lossy().into_owned()
}

/// Parse mountinfo text; lines that do not parse are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fstype = r.next()?;
            let source = r.next()?;
            let super_options = r.next().unwrap_or("");
            Some(MountEntry {
                mount_point: PathBuf::from(unescape(mount_point)),
                fstype: fstype.to_owned(),
                source: PathBuf::from(unescape(source)),
                super_options: super_options.to_owned(),
            })
        })
        .collect()
}

/// The mountinfo parsers, exposed for the fuzz target (`fuzz/`): the entries of `text`, the
/// device number of the newest mount at `target`, and which entries [`is_ours`] claims for the
/// run directory `run_dir`. None may panic, whatever the text.
#[doc(hidden)]
pub fn fuzz_mountinfo(
    text: &str,
    target: &str,
    run_dir: &Path,
) -> (Vec<MountEntry>, Option<String>, Vec<bool>) {
    let entries = parse_mountinfo(text);
    let ours = entries.iter().map(|m| is_ours(m, run_dir)).collect();
    (entries, crate::fusemount::mount_dev_in(text, target), ours)
}

/// This process's mounts, in mount order.
pub fn mounts() -> io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&std::fs::read_to_string(
        "/proc/self/mountinfo",
    )?))
}

/// Whether `path` is a mount point (something is mounted there; a symlink is not followed,
/// a path that does not exist is not one).
///
/// One `statx` (`STATX_ATTR_MOUNT_ROOT`, Linux 5.8+, with the attributes cached for FUSE: a
/// busy or wedged server is not asked). `/proc/self/mountinfo` is read only on a kernel that
/// does not report the attribute, or for a mount that cannot be stat'ed (a FUSE mount whose
/// server died): it holds every mount of the namespace, and a node with a few hundred
/// sandboxes made each create read (and the kernel generate) some 100 KB of it, on the
/// async workers, until the node answered its status seconds late.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    use rustix::fs::{statx, AtFlags, StatxAttributes, StatxFlags, CWD};
    use rustix::io::Errno;
    let flags = AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT | AtFlags::STATX_DONT_SYNC;
    match statx(CWD, path, flags, StatxFlags::TYPE) {
        Ok(s) if s.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) => {
            Ok(s.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
        }
        Err(Errno::NOENT | Errno::NOTDIR) => Ok(false),
        Ok(_) | Err(_) => is_mount_point_in_mountinfo(path),
    }
}

/// [`is_mount_point`] by `/proc/self/mountinfo` alone.
pub fn is_mount_point_in_mountinfo(path: &Path) -> io::Result<bool> {
    Ok(mounts()?.iter().any(|m| m.mount_point == path))
}

/// Whether the running kernel has filesystem `fs` (`/proc/filesystems`). Modules that are
/// not loaded yet do not show; callers try `modprobe`-free paths only.
pub fn kernel_has(fs: &str) -> bool {
    std::fs::read_to_string("/proc/filesystems")
        .map(|t| t.lines().any(|l| l.split_whitespace().last() == Some(fs)))
        .unwrap_or(false)
}

/// A kind for a failed mount(2): privileges, kernel support, a busy target, or other.
pub fn mount_error(what: &str, e: io::Error) -> ApiError {
    let kind = match e.raw_os_error() {
        Some(c) if c == rustix::io::Errno::PERM.raw_os_error() => ErrorKind::NotRoot,
        Some(c) if c == rustix::io::Errno::NODEV.raw_os_error() => ErrorKind::KernelUnsupported,
        Some(c) if c == rustix::io::Errno::BUSY.raw_os_error() => ErrorKind::MountpointInUse,
        _ => ErrorKind::Internal,
    };
    ApiError::new(kind, format!("{what}: {e}"))
}

fn cstring(s: String) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in options"))
}

/// A path usable inside a comma/colon separated mount option string.
pub fn option_path(p: &Path) -> Result<String, ApiError> {
    let s = p.to_str().ok_or_else(|| {
        ApiError::new(
            ErrorKind::BadRequest,
            format!(
                "{} is not UTF-8; mount options need UTF-8 paths",
                p.display()
            ),
        )
    })?;
    if s.contains([',', ':', '\\', '\n']) {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            format!(
                "{s:?} contains ',', ':', '\\\\' or a newline, which mount options cannot carry"
            ),
        ));
    }
    Ok(s.to_owned())
}

/// Whether the kernel's EROFS takes the `directio` option: 0 unknown, 1 yes, 2 no.
static EROFS_DIRECTIO: AtomicU8 = AtomicU8::new(0);

/// File-backed, read-only EROFS mount of `meta` at `target`, with `device=` blob files.
///
/// The mount asks for `directio` (Linux 6.13+): EROFS then reads its backing files with
/// direct I/O, so a blob file opened in FUSE passthrough mode is read straight from the
/// level-2 cache file into EROFS's page cache, with no second cached copy (`docs/daemon.md`).
/// A kernel that does not know the option refuses it with `EINVAL`; the mount is then made
/// without it, and later mounts do not ask again.
pub fn mount_erofs(meta: &Path, devices: &[PathBuf], target: &Path) -> Result<(), ApiError> {
    let mut options = devices
        .iter()
        .map(|d| option_path(d).map(|s| format!("device={s}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mount = |options: &[String]| -> io::Result<()> {
        let data = cstring(options.join(","))?;
        rustix::mount::mount(
            meta,
            target,
            "erofs",
            MountFlags::RDONLY | MountFlags::NODEV | MountFlags::NOSUID,
            (!options.is_empty()).then_some(data.as_c_str()),
        )
        .map_err(io::Error::from)
    };
    let result = with_directio(&EROFS_DIRECTIO, &mut options, mount);
    result.map_err(|e| {
        mount_error(
            &format!("mount -t erofs {} on {}", meta.display(), target.display()),
            e,
        )
    })
}

/// Whether this kernel's EROFS took the `directio` option at the last mount that asked
/// (`None`: no mount has told yet).
pub fn erofs_directio() -> Option<bool> {
    match EROFS_DIRECTIO.load(Ordering::Relaxed) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

/// `mount(options + directio)`, unless `known` says the kernel refuses it. Only an `EINVAL`
/// while it is unknown, followed by a mount without it that works, decides "no": an image
/// that is bad either way (also `EINVAL`) decides nothing.
fn with_directio(
    known: &AtomicU8,
    options: &mut Vec<String>,
    mount: impl Fn(&[String]) -> io::Result<()>,
) -> io::Result<()> {
    if known.load(Ordering::Relaxed) == 2 {
        return mount(options);
    }
    options.push("directio".to_owned());
    let result = mount(options);
    let einval = rustix::io::Errno::INVAL.raw_os_error();
    match &result {
        Ok(()) => known.store(1, Ordering::Relaxed),
        Err(e) if known.load(Ordering::Relaxed) == 0 && e.raw_os_error() == Some(einval) => {
            options.pop();
            let again = mount(options);
            if again.is_ok() {
                tracing::info!("this kernel's EROFS has no `directio` option: mounting without it");
                known.store(2, Ordering::Relaxed);
            }
            return again;
        }
        Err(_) => {}
    }
    result
}

/// A read-only bind mount of `source` at `target`.
pub fn bind_ro(source: &Path, target: &Path) -> Result<(), ApiError> {
    let what = format!("bind {} on {}", source.display(), target.display());
    rustix::mount::mount_bind(source, target).map_err(|e| mount_error(&what, e.into()))?;
    if let Err(e) = rustix::mount::mount_remount(target, MountFlags::BIND | MountFlags::RDONLY, c"")
    {
        let _ = rustix::mount::unmount(target, UnmountFlags::DETACH);
        return Err(mount_error(&format!("{what} (read-only)"), e.into()));
    }
    Ok(())
}

/// overlayfs at `target`: `lowers` top first, with an optional upper/work pair.
pub fn mount_overlay(
    lowers: &[PathBuf],
    upper: Option<(&Path, &Path)>,
    target: &Path,
) -> Result<(), ApiError> {
    let lower = lowers
        .iter()
        .map(|p| option_path(p))
        .collect::<Result<Vec<_>, _>>()?
        .join(":");
    let mut data = format!("lowerdir={lower}");
    let mut flags = MountFlags::empty();
    match upper {
        Some((u, w)) => {
            // No redirects and no metadata-only copy-ups: an upper holds plain entries only
            // (what pack_diff reads back as a layer).
            data.push_str(&format!(
                ",upperdir={},workdir={},redirect_dir=off,metacopy=off",
                option_path(u)?,
                option_path(w)?
            ));
        }
        None => flags |= MountFlags::RDONLY,
    }
    let page = 4096;
    if data.len() >= page {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            format!(
                "overlay options are {} bytes, more than the kernel takes ({page}); mount fewer layers",
                data.len()
            ),
        ));
    }
    let c = cstring(data).map_err(|e| mount_error("mount options", e))?;
    rustix::mount::mount("overlay", target, "overlay", flags, c.as_c_str()).map_err(|e| {
        mount_error(
            &format!("mount -t overlay on {}", target.display()),
            e.into(),
        )
    })
}

/// Whether this kernel's EROFS takes a file-backed device that lives on a stacked
/// filesystem (a superblock with a nonzero stacking depth), probed once with real mounts in
/// the scratch directory `scratch` (made, and removed again, here).
///
/// It matters because FUSE passthrough makes the blob mount stacked: at INIT the daemon
/// answers `max_stack_depth = 1`, and the kernel sets that as the FUSE superblock's depth.
/// Kernels with EROFS's stacking limit for file-backed mounts (Linux 6.19, and stable
/// releases it was backported to, such as this repository's 6.18.44 test machine) then
/// refuse every `device=` on the blob mount with `EINVAL` ("file-backed devices cannot be on
/// stacked fses"), whether that blob is read in passthrough mode or not. Such a kernel must
/// get a blob mount without passthrough.
///
/// The probe builds a one-file layer, mounts it with its blob as `device=` from a plain
/// directory (which must work: else the answer is an error), then from a read-only overlay
/// of that directory (depth 1, like the passthrough FUSE mount): `Ok(false)` if only the
/// second is refused with `EINVAL`. Every mount is undone before it returns.
pub fn erofs_takes_stacked_devices(scratch: &Path) -> Result<bool, ApiError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        ApiError::new(
            ErrorKind::Internal,
            format!("probe EROFS on a stacked filesystem: {what}: {e}"),
        )
    };
    let (plain, empty, stacked, mnt) = (
        scratch.join("plain"),
        scratch.join("empty"),
        scratch.join("stacked"),
        scratch.join("mnt"),
    );
    // A probe that died half-way leaves mounts behind: take them down first.
    let clear = || {
        for m in [&mnt, &stacked] {
            let _ = rustix::mount::unmount(m.as_path(), UnmountFlags::DETACH);
        }
        let _ = std::fs::remove_dir_all(scratch);
    };
    clear();
    let result = (|| {
        let src = scratch.join("src");
        for d in [&src, &plain, &empty, &stacked, &mnt] {
            std::fs::create_dir_all(d).map_err(|e| fail(&format!("create {}", d.display()), &e))?;
        }
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(src.join("f"), &data).map_err(|e| fail("write the probe file", &e))?;
        let meta = scratch.join("meta.erofs");
        erofs_builder::layer::build_layer(
            &src,
            &meta,
            &plain.join("blob"),
            &erofs_builder::layer::LayerOptions::default(),
        )
        .map_err(|e| fail("build the probe layer", &e))?;
        let mount = |device: &Path| -> io::Result<()> {
            let opts = cstring(format!(
                "device={}",
                option_path(device).map_err(io::Error::other)?
            ))?;
            rustix::mount::mount(
                &meta,
                &mnt,
                "erofs",
                MountFlags::RDONLY | MountFlags::NODEV | MountFlags::NOSUID,
                Some(opts.as_c_str()),
            )?;
            let read = std::fs::read(mnt.join("f"));
            let _ = rustix::mount::unmount(mnt.as_path(), UnmountFlags::DETACH);
            match read {
                Ok(got) if got == data => Ok(()),
                Ok(_) => Err(io::Error::other("the probe file reads back wrong")),
                Err(e) => Err(e),
            }
        };
        mount(&plain.join("blob")).map_err(|e| fail("mount with a plain device", &e))?;
        mount_overlay(&[plain.clone(), empty.clone()], None, &stacked)?;
        let on_stacked = mount(&stacked.join("blob"));
        let _ = rustix::mount::unmount(stacked.as_path(), UnmountFlags::DETACH);
        match on_stacked {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
            Err(e) => Err(fail("mount with a device on an overlay", &e)),
        }
    })();
    clear();
    result
}

/// Unmount `target`; if it is busy and `lazy`, detach it instead (MNT_DETACH).
pub fn unmount(target: &Path, lazy: bool) -> Result<(), ApiError> {
    unmount_or_detach(target, lazy).map(|_| ())
}

/// [`unmount`], saying whether the mount had to be detached (it may still be in use, and
/// its filesystem alive, after this returns).
pub fn unmount_or_detach(target: &Path, lazy: bool) -> Result<bool, ApiError> {
    match rustix::mount::unmount(target, UnmountFlags::empty()) {
        Ok(()) => Ok(false),
        Err(rustix::io::Errno::BUSY) if lazy => {
            rustix::mount::unmount(target, UnmountFlags::DETACH)
                .map(|()| true)
                .map_err(|e| mount_error(&format!("umount -l {}", target.display()), e.into()))
        }
        Err(rustix::io::Errno::BUSY) => Err(ApiError::new(
            ErrorKind::MountpointInUse,
            format!(
                "{} is busy (open files or a working directory inside it)",
                target.display()
            ),
        )),
        Err(e) => Err(mount_error(
            &format!("umount {}", target.display()),
            e.into(),
        )),
    }
}

/// Check that `path` can take a new mount: an existing, empty directory that is not already
/// a mount point. Returns its canonical form.
pub fn check_mountpoint(path: &Path) -> Result<PathBuf, ApiError> {
    let in_use = |why: String| ApiError::new(ErrorKind::MountpointInUse, why);
    let canon = std::fs::canonicalize(path)
        .map_err(|e| in_use(format!("mountpoint {}: {e}", path.display())))?;
    if !canon.is_dir() {
        return Err(in_use(format!(
            "mountpoint {} is not a directory",
            path.display()
        )));
    }
    let mut entries = std::fs::read_dir(&canon)
        .map_err(|e| in_use(format!("mountpoint {}: {e}", path.display())))?;
    if entries.next().is_some() {
        return Err(in_use(format!(
            "mountpoint {} is not empty",
            path.display()
        )));
    }
    if is_mount_point(&canon).map_err(|e| in_use(format!("read mountinfo: {e}")))? {
        return Err(in_use(format!(
            "mountpoint {} is already a mount point",
            path.display()
        )));
    }
    Ok(canon)
}

/// Whether a mount was made from this node's run directory: an EROFS mount of a meta image
/// under it (or a bind of one), an overlay whose lower layers are under it, or any mount
/// point under it (the FUSE blob mount, layer mounts).
pub fn is_ours(m: &MountEntry, run_dir: &Path) -> bool {
    let layers = run_dir.join("layers");
    m.mount_point.starts_with(run_dir)
        || (m.fstype == "erofs" && m.source.starts_with(&layers))
        || (m.fstype == "overlay"
            && m.super_options.split(',').any(|o| {
                o.strip_prefix("lowerdir=")
                    .is_some_and(|l| l.split(':').any(|d| Path::new(d).starts_with(&layers)))
            }))
}

/// Detach every mount [`is_ours`] (newest first); returns the mount points detached.
pub fn detach_stale(run_dir: &Path) -> io::Result<Vec<PathBuf>> {
    detach_ours_except(run_dir, |_| false)
}

/// Detach every mount [`is_ours`] that `keep` does not keep (newest first); returns the
/// mount points detached.
pub fn detach_ours_except(
    run_dir: &Path,
    keep: impl Fn(&MountEntry) -> bool,
) -> io::Result<Vec<PathBuf>> {
    let mut done = Vec::new();
    // Detaching one mount can reveal or remove others; re-read until none is left.
    for _ in 0..64 {
        let ours: Vec<MountEntry> = mounts()?
            .into_iter()
            .filter(|m| is_ours(m, run_dir) && !keep(m))
            .collect();
        let Some(m) = ours.last() else {
            return Ok(done);
        };
        match rustix::mount::unmount(&m.mount_point, UnmountFlags::DETACH) {
            Ok(()) => done.push(m.mount_point.clone()),
            Err(e) => {
                return Err(io::Error::new(
                    io::Error::from(e).kind(),
                    format!("detach {}: {e}", m.mount_point.display()),
                ))
            }
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake mount(2) that refuses `directio` (as kernels before 6.13 do) and/or every image
    /// (a corrupt one), recording what it was asked.
    fn fake(
        knows_directio: bool,
        image_ok: bool,
        calls: &std::cell::RefCell<Vec<Vec<String>>>,
    ) -> impl Fn(&[String]) -> io::Result<()> + '_ {
        move |options: &[String]| {
            calls.borrow_mut().push(options.to_vec());
            let einval = io::Error::from_raw_os_error(rustix::io::Errno::INVAL.raw_os_error());
            if !image_ok || (!knows_directio && options.iter().any(|o| o == "directio")) {
                return Err(einval);
            }
            Ok(())
        }
    }

    #[test]
    fn directio_is_asked_for_and_dropped_only_when_the_kernel_refuses_it() {
        let calls = std::cell::RefCell::new(Vec::new());
        let opts = || vec!["device=/b".to_owned()];
        // A kernel with `directio`: asked once, remembered.
        let known = AtomicU8::new(0);
        with_directio(&known, &mut opts(), fake(true, true, &calls)).unwrap();
        assert_eq!(known.load(Ordering::Relaxed), 1);
        assert_eq!(calls.take(), [vec!["device=/b", "directio"]]);
        // A bad image on such a kernel: an error, and still "yes".
        assert!(with_directio(&known, &mut opts(), fake(true, false, &calls)).is_err());
        assert_eq!(known.load(Ordering::Relaxed), 1);
        assert_eq!(
            calls.take().len(),
            1,
            "no retry once directio is known to work"
        );
        // An older kernel: EINVAL, then a mount without it works: "no", not asked again.
        let known = AtomicU8::new(0);
        with_directio(&known, &mut opts(), fake(false, true, &calls)).unwrap();
        assert_eq!(known.load(Ordering::Relaxed), 2);
        with_directio(&known, &mut opts(), fake(false, true, &calls)).unwrap();
        assert_eq!(
            calls.take(),
            [
                vec!["device=/b", "directio"],
                vec!["device=/b"],
                vec!["device=/b"]
            ]
        );
        // A bad image before anything is known: both attempts fail, nothing is decided.
        let known = AtomicU8::new(0);
        assert!(with_directio(&known, &mut opts(), fake(false, false, &calls)).is_err());
        assert_eq!(known.load(Ordering::Relaxed), 0);
        assert_eq!(calls.take().len(), 2);
    }

    #[test]
    fn mountinfo_lines() {
        let text = "22 1 0:21 / /proc rw,nosuid - proc proc rw\n\
            90 30 0:50 / /run/strata/blobs rw,nosuid shared:5 - fuse.strata strata rw,user_id=0\n\
            91 30 0:51 / /mnt/with\\040space ro - erofs /run/strata/layers/ab/meta.erofs ro,device=/run/strata/blobs/cd\n\
            92 30 0:52 / /mnt/ov rw - overlay overlay rw,lowerdir=/run/strata/layers/b/mnt:/run/strata/layers/a/mnt,upperdir=/u\n\
            garbage\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 4);
        assert_eq!(m[2].mount_point, Path::new("/mnt/with space"));
        assert_eq!(m[2].fstype, "erofs");
        let run = Path::new("/run/strata");
        assert!(!is_ours(&m[0], run));
        assert!(is_ours(&m[1], run));
        assert!(is_ours(&m[2], run));
        assert!(is_ours(&m[3], run));
        assert!(!is_ours(&m[3], Path::new("/run/other")));
        assert_eq!(unescape("a\\134b\\"), OsString::from("a\\b\\"));
    }

    #[test]
    fn option_paths() {
        assert!(option_path(Path::new("/a/b")).is_ok());
        for bad in ["/a,b", "/a:b", "/a\\b"] {
            assert_eq!(
                option_path(Path::new(bad)).unwrap_err().kind,
                ErrorKind::BadRequest
            );
        }
    }

    #[test]
    fn mount_points_by_statx_agree_with_mountinfo() {
        // The one-syscall path is the one taken (Linux 5.8+; Strata needs 6.12's EROFS).
        let root = rustix::fs::statx(
            rustix::fs::CWD,
            "/",
            rustix::fs::AtFlags::empty(),
            rustix::fs::StatxFlags::TYPE,
        )
        .unwrap();
        assert!(root
            .stx_attributes_mask
            .contains(rustix::fs::StatxAttributes::MOUNT_ROOT));
        // Every mount of this namespace, and a directory that is none (under a tempdir).
        let mut checked = 0;
        for m in mounts().unwrap() {
            // A mount that another test removed meanwhile is out of mountinfo, too.
            let by_statx = is_mount_point(&m.mount_point).unwrap();
            assert!(
                by_statx || !is_mount_point_in_mountinfo(&m.mount_point).unwrap(),
                "{} is in mountinfo",
                m.mount_point.display()
            );
            checked += 1;
        }
        assert!(checked > 0, "no mount point of this namespace was checked");
        let t = tempfile::tempdir().unwrap();
        let sub = t.path().join("d");
        std::fs::create_dir(&sub).unwrap();
        for p in [&sub, &t.path().join("missing"), &sub.join("missing/deeper")] {
            assert!(!is_mount_point(p).unwrap(), "{}", p.display());
            assert!(!is_mount_point_in_mountinfo(p).unwrap(), "{}", p.display());
        }
        let link = t.path().join("to-root");
        std::os::unix::fs::symlink("/", &link).unwrap();
        assert!(
            !is_mount_point(&link).unwrap(),
            "a symlink to / is not followed"
        );
    }
}
