//! What a frozen sandbox has resident, recorded so that `resume` can bring it back.
//!
//! ## What is recorded (`<dir>/<id>/suspend.json`, [`Residency`])
//! - Per process of the sandbox (its memory cgroup's `cgroup.procs`): its pid and start time
//!   (`/proc/<pid>/stat` field 22: the pid names the same process only while it matches),
//!   and its anonymous regions (`/proc/<pid>/smaps` mappings without a file that hold
//!   anonymous or swapped pages: heap, stacks, `[anon:…]`, anonymous shared memory).
//! - Per file (deduplicated by device and inode): how to open it again
//!   ([`Source`]: a descriptor of a process, one of its mappings, or a path in the upper), the
//!   path the sandbox sees it at, its device, inode and size, and the runs of its pages that
//!   are in the page cache (`mincore(2)` on a read-only shared mapping of it in the daemon:
//!   nothing is read, no page is faulted in). The files are those the processes have open,
//!   those they have mapped (only the mapped window), and every regular file of the upper.
//! - File pages a process read and closed, of a file not in the upper, are not found: after
//!   a resume they are read again on demand (from level 2 of the chunk cache, local disk).
//!
//! ## Hostile processes
//! The sandbox is frozen while this runs, but what it left behind is its own: descriptors
//! are opened through `/proc/<pid>/fd/<n>` with `O_PATH` first and reopened read-only only
//! when they are regular files, non-empty, on a filesystem a sandbox's files live on
//! (overlayfs, EROFS, tmpfs, and the host filesystems an upper is on; never procfs, sysfs or
//! devices); the upper is walked without following symlinks. Everything is bounded
//! ([`Budget`]): files, runs, the bytes of files scanned, the entries of the upper walked.
//! Past a bound the record is marked `truncated` and the rest is left to demand reads.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use crate::manager::start_time;
use serde::{Deserialize, Serialize};

/// Pages are 4 KiB on every platform Strata runs on; checked at run time in [`page_size`].
const PAGE: u64 = 4096;

/// Bytes of a file mapped and scanned at once.
const WINDOW: u64 = 1 << 30;

/// One mapping of `/proc/<pid>/smaps`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    /// `rwxp` / `rwxs`.
    pub perms: String,
    /// File offset of `start`.
    pub offset: u64,
    /// `major:minor` in hex, as the kernel prints it.
    pub dev: String,
    pub inode: u64,
    /// The path (octal escapes as the kernel prints them), `[heap]`, `[anon:…]`, or empty.
    pub path: String,
    pub rss: u64,
    pub anonymous: u64,
    pub swap: u64,
}

impl Vma {
    /// A mapping of no file whose pages `process_madvise` may page out or in.
    pub fn is_anon(&self) -> bool {
        self.inode == 0
            && (self.path.is_empty()
                || self.path == "[heap]"
                || self.path == "[stack]"
                || self.path.starts_with("[anon:")
                || self.path.starts_with("[anon_shmem:")
                || self.path.starts_with("/dev/zero")
                || self.path.starts_with("/SYSV"))
    }
}

fn parse_header(line: &str) -> Option<Vma> {
    let mut it = line.splitn(6, ' ');
    let (s, e) = it.next()?.split_once('-')?;
    let start = u64::from_str_radix(s, 16).ok()?;
    let end = u64::from_str_radix(e, 16).ok()?;
    let perms = it.next()?;
    if perms.len() != 4 || end < start {
        return None;
    }
    let offset = u64::from_str_radix(it.next()?, 16).ok()?;
    let dev = it.next()?;
    if !dev.contains(':') {
        return None;
    }
    let inode = it.next()?.parse().ok()?;
    let path = it.next().map(str::trim_start).unwrap_or("");
    Some(Vma {
        start,
        end,
        perms: perms.to_owned(),
        offset,
        dev: dev.to_owned(),
        inode,
        path: path.to_owned(),
        ..Vma::default()
    })
}

/// The mappings of a `/proc/<pid>/smaps` text, with their `Rss`, `Anonymous` and `Swap`.
/// Lines that are neither a mapping's header nor one of its `Key: N kB` fields are skipped.
pub fn parse_smaps(text: &str) -> Vec<Vma> {
    let mut out: Vec<Vma> = Vec::new();
    for line in text.lines() {
        if let Some(v) = parse_header(line) {
            out.push(v);
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let kb = || {
            rest.trim()
                .strip_suffix("kB")
                .and_then(|n| n.trim().parse::<u64>().ok())
                .map_or(0, |n| n.saturating_mul(1024))
        };
        match key {
            "Rss" => cur.rss = kb(),
            "Anonymous" => cur.anonymous = kb(),
            "Swap" => cur.swap = kb(),
            _ => {}
        }
    }
    out
}

/// How a recorded file is opened again at resume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Descriptor `fd` of process `pid` (started at `start`).
    Fd { pid: u32, start: u64, fd: u32 },
    /// The mapping `vm_start..vm_end` of process `pid`.
    Map {
        pid: u32,
        start: u64,
        vm_start: u64,
        vm_end: u64,
    },
    /// A file of the upper, by its path relative to the upper's root.
    Upper { rel: PathBuf },
}

/// One file's resident pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    pub source: Source,
    /// Where the sandbox sees it (empty when unknown, ` (deleted)` when unlinked).
    pub path: String,
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    /// Runs of resident pages: `[offset, len]`, page-aligned, ascending.
    pub ranges: Vec<[u64; 2]>,
}

impl FileRecord {
    /// Bytes resident.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r[1]).sum()
    }

    /// Whether the file is one of the upper's (the sandbox's own).
    pub fn in_upper(&self) -> bool {
        matches!(self.source, Source::Upper { .. })
    }
}

/// One process's anonymous regions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub pid: u32,
    pub start: u64,
    /// `[start, end)` of each anonymous mapping with resident or swapped pages.
    pub anon: Vec<[u64; 2]>,
    /// Its anonymous bytes resident (`Anonymous`), and swapped out (`Swap`).
    pub anon_bytes: u64,
    pub swap_bytes: u64,
}

/// What a frozen sandbox had resident (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Residency {
    pub taken_ms: u64,
    pub processes: Vec<ProcessRecord>,
    pub files: Vec<FileRecord>,
    /// A bound was reached: not everything resident is recorded.
    pub truncated: bool,
}

impl Residency {
    /// A stored record (`suspend.json`), checked: runs that overflow or lie beyond their
    /// file's size and anonymous ranges that end before they start are dropped, so every use
    /// can add offsets and lengths freely.
    pub fn parse(bytes: &[u8]) -> Result<Residency, String> {
        let mut r: Residency = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        for f in &mut r.files {
            let size = f.size;
            f.ranges.retain(|[o, l]| {
                o.checked_add(*l)
                    .is_some_and(|end| end <= size.saturating_add(PAGE))
            });
        }
        for p in &mut r.processes {
            p.anon.retain(|[s, e]| s < e);
        }
        Ok(r)
    }

    /// Bytes of file pages recorded resident.
    pub fn file_bytes(&self) -> u64 {
        self.files.iter().map(FileRecord::bytes).sum()
    }

    /// Anonymous bytes the processes had resident.
    pub fn anon_bytes(&self) -> u64 {
        self.processes.iter().map(|p| p.anon_bytes).sum()
    }
}

/// The bounds of one recording.
#[derive(Clone, Debug)]
pub struct Budget {
    pub files: usize,
    pub runs: usize,
    /// Bytes of files mapped and scanned with `mincore`.
    pub scan_bytes: u64,
    /// Entries of the upper walked.
    pub upper_entries: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            files: 65_536,
            runs: 1 << 20,
            scan_bytes: 256 << 30,
            upper_entries: 200_000,
        }
    }
}

/// The page size, if it is the 4 KiB this module assumes.
pub fn page_size() -> std::io::Result<u64> {
    match rustix::param::page_size() as u64 {
        PAGE => Ok(PAGE),
        other => Err(std::io::Error::other(format!(
            "page size {other}: suspend assumes 4096"
        ))),
    }
}

/// The runs of resident pages of `fd` in `[from, to)` (`to` clamped to `size`), merged, at
/// most `budget.runs` in all and `budget.scan_bytes` scanned (both decremented).
pub fn resident_runs(
    fd: BorrowedFd<'_>,
    from: u64,
    to: u64,
    size: u64,
    budget: &mut Budget,
    out: &mut Vec<[u64; 2]>,
) -> std::io::Result<bool> {
    let from = from - from % PAGE;
    let to = to.min(size.div_ceil(PAGE) * PAGE);
    let mut off = from;
    let mut vec = Vec::new();
    while off < to {
        let len = (to - off).min(WINDOW);
        if budget.scan_bytes < len {
            return Ok(false);
        }
        budget.scan_bytes -= len;
        let pages = len.div_ceil(PAGE) as usize;
        vec.clear();
        vec.resize(pages, 0u8);
        // SAFETY: a fresh read-only shared mapping of `len` bytes of an open file (the kernel
        // picks the address; nothing else refers to it); it is only passed to mincore, which
        // writes one byte per page into `vec` (`pages` long), and unmapped below.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off as libc::off_t,
            );
            if p == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            let r = libc::mincore(p, len as usize, vec.as_mut_ptr());
            let err = std::io::Error::last_os_error();
            libc::munmap(p, len as usize);
            if r != 0 {
                return Err(err);
            }
        }
        for (i, b) in vec.iter().enumerate() {
            if b & 1 == 0 {
                continue;
            }
            let at = off + i as u64 * PAGE;
            match out.last_mut() {
                Some(last) if last[0] + last[1] == at => last[1] += PAGE,
                _ => {
                    if budget.runs == 0 {
                        return Ok(false);
                    }
                    budget.runs -= 1;
                    out.push([at, PAGE]);
                }
            }
        }
        off += len;
    }
    Ok(true)
}

/// Filesystems a sandbox's files may be read from here (`statfs` magic numbers).
fn allowed_fs(fd: BorrowedFd<'_>) -> bool {
    const OVERLAY: i64 = 0x794c_7630;
    const EROFS: i64 = 0xe0f5_e1e2;
    const TMPFS: i64 = 0x0102_1994;
    const EXT4: i64 = 0xef53;
    const BTRFS: i64 = 0x9123_683e;
    const XFS: i64 = 0x5846_5342;
    // `f_type` is i64 on x86_64 and narrower elsewhere.
    #[allow(clippy::unnecessary_cast)]
    rustix::fs::fstatfs(fd).is_ok_and(|s| {
        matches!(
            s.f_type as i64,
            OVERLAY | EROFS | TMPFS | EXT4 | BTRFS | XFS
        )
    })
}

/// Open what the magic link `link` (`/proc/<pid>/fd/<n>`, `/proc/<pid>/map_files/…`) names,
/// read-only, if it is a non-empty regular file on an allowed filesystem: the file, its
/// device, inode and size.
pub fn open_link(link: &Path) -> Option<(OwnedFd, u64, u64, u64)> {
    let opath = rustix::fs::open(link, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()).ok()?;
    let st = rustix::fs::fstat(&opath).ok()?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
        || st.st_size <= 0
    {
        return None;
    }
    let fd = rustix::fs::open(
        format!("/proc/self/fd/{}", opath.as_raw_fd()),
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK | OFlags::NOCTTY,
        Mode::empty(),
    )
    .ok()?;
    if !allowed_fs(fd.as_fd()) {
        return None;
    }
    Some((fd, st.st_dev, st.st_ino, st.st_size as u64))
}

/// The upper's root, opened once for the lookups of [`open_upper`].
pub fn open_upper_root(upper: &Path) -> Option<OwnedFd> {
    rustix::fs::open(
        upper,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()
}

/// Open a file of the upper (`rel` under its `root`) without following symlinks anywhere.
pub fn open_upper(root: &OwnedFd, rel: &Path) -> Option<(OwnedFd, u64, u64, u64)> {
    let fd = rustix::fs::openat2(
        root,
        rel,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::NOFOLLOW,
        Mode::empty(),
        rustix::fs::ResolveFlags::BENEATH | rustix::fs::ResolveFlags::NO_SYMLINKS,
    )
    .ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
        || st.st_size <= 0
    {
        return None;
    }
    Some((fd, st.st_dev, st.st_ino, st.st_size as u64))
}

/// Records files by device and inode, merging what several routes find of one file.
struct Files {
    by_key: HashMap<(u64, u64), usize>,
    list: Vec<FileRecord>,
    /// The upper's recorded files: path in the sandbox → inode and size.
    upper_paths: HashMap<String, (u64, u64)>,
}

impl Files {
    /// Whether `f`, which a process sees at `path`, is a file of the upper recorded already
    /// (overlayfs reports another device for it, but the upper's inode number and size).
    fn upper_has(&self, path: &str, f: &(OwnedFd, u64, u64, u64)) -> bool {
        self.upper_paths.get(path) == Some(&(f.2, f.3))
    }

    /// Add the resident runs of `fd` in `[from, to)`, found through `source`.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        source: Source,
        path: String,
        (fd, dev, ino, size): (OwnedFd, u64, u64, u64),
        from: u64,
        to: u64,
        budget: &mut Budget,
        truncated: &mut bool,
    ) {
        let mut runs = Vec::new();
        match resident_runs(fd.as_fd(), from, to, size, budget, &mut runs) {
            Ok(true) => {}
            Ok(false) => *truncated = true,
            Err(_) => return,
        }
        if runs.is_empty() {
            return;
        }
        if let Some(&i) = self.by_key.get(&(dev, ino)) {
            let f = &mut self.list[i];
            f.ranges.extend(runs);
            f.ranges = merge(std::mem::take(&mut f.ranges));
            return;
        }
        if self.list.len() >= budget.files {
            *truncated = true;
            return;
        }
        self.by_key.insert((dev, ino), self.list.len());
        if matches!(source, Source::Upper { .. }) {
            self.upper_paths.insert(path.clone(), (ino, size));
        }
        self.list.push(FileRecord {
            source,
            path,
            dev,
            ino,
            size,
            ranges: runs,
        });
    }
}

/// Sorted, overlapping or touching runs joined.
pub fn merge(mut r: Vec<[u64; 2]>) -> Vec<[u64; 2]> {
    r.sort_unstable();
    let mut out: Vec<[u64; 2]> = Vec::with_capacity(r.len());
    for [o, l] in r {
        match out.last_mut() {
            Some(last) if o <= last[0] + last[1] => {
                let end = (last[0] + last[1]).max(o + l);
                last[1] = end - last[0];
            }
            _ => out.push([o, l]),
        }
    }
    out
}

/// Record what the (frozen) processes `pids` and the upper at `upper` have resident.
pub fn record(pids: &[u32], upper: &Path, mut budget: Budget) -> Residency {
    let mut files = Files {
        by_key: HashMap::new(),
        list: Vec::new(),
        upper_paths: HashMap::new(),
    };
    // The upper first, walked without following symlinks: every file the sandbox wrote.
    let mut truncated = false;
    let root = open_upper_root(upper);
    let mut stack = vec![PathBuf::new()];
    let mut seen = 0usize;
    while let Some(rel) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(upper.join(&rel)) else {
            continue;
        };
        for e in rd.flatten() {
            seen += 1;
            if seen > budget.upper_entries {
                truncated = true;
                stack.clear();
                break;
            }
            let Ok(ft) = e.file_type() else { continue };
            let r = rel.join(e.file_name());
            if ft.is_dir() {
                stack.push(r);
            } else if ft.is_file() {
                if let Some(f) = root.as_ref().and_then(|root| open_upper(root, &r)) {
                    let path = format!("/{}", r.display());
                    files.add(
                        Source::Upper { rel: r },
                        path,
                        f,
                        0,
                        u64::MAX,
                        &mut budget,
                        &mut truncated,
                    );
                }
            }
        }
    }
    let mut processes = Vec::new();
    for &pid in pids {
        let Some(start) = start_time(pid) else {
            continue;
        };
        let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
        let vmas = parse_smaps(&smaps);
        let mut p = ProcessRecord {
            pid,
            start,
            anon: Vec::new(),
            anon_bytes: 0,
            swap_bytes: 0,
        };
        for v in &vmas {
            p.anon_bytes += v.anonymous;
            p.swap_bytes += v.swap;
            if v.is_anon() && v.anonymous + v.swap > 0 {
                p.anon.push([v.start, v.end]);
            }
            if v.inode == 0 || !v.path.starts_with('/') || v.rss == 0 {
                continue;
            }
            let link = format!("/proc/{pid}/map_files/{:x}-{:x}", v.start, v.end);
            if let Some(f) = open_link(Path::new(&link)).filter(|f| !files.upper_has(&v.path, f)) {
                let len = v.end - v.start;
                files.add(
                    Source::Map {
                        pid,
                        start,
                        vm_start: v.start,
                        vm_end: v.end,
                    },
                    v.path.clone(),
                    f,
                    v.offset,
                    v.offset.saturating_add(len),
                    &mut budget,
                    &mut truncated,
                );
            }
        }
        processes.push(p);
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for e in fds.flatten() {
            let Some(n) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let link = e.path();
            let path = std::fs::read_link(&link)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            if let Some(f) = open_link(&link).filter(|f| !files.upper_has(&path, f)) {
                files.add(
                    Source::Fd { pid, start, fd: n },
                    path,
                    f,
                    0,
                    u64::MAX,
                    &mut budget,
                    &mut truncated,
                );
            }
        }
    }
    Residency {
        taken_ms: crate::manager::now_ms(),
        processes,
        files: files.list,
        truncated,
    }
}

/// Open a recorded file again: through the same process (if it is still the same one) or
/// the upper (its root from [`open_upper_root`]); `None` when it is gone or is not the file
/// recorded.
pub fn reopen(f: &FileRecord, upper: Option<&OwnedFd>) -> Option<OwnedFd> {
    let got = match &f.source {
        Source::Fd { pid, start, fd } => {
            if start_time(*pid) != Some(*start) {
                return None;
            }
            open_link(Path::new(&format!("/proc/{pid}/fd/{fd}")))
        }
        Source::Map {
            pid,
            start,
            vm_start,
            vm_end,
        } => {
            if start_time(*pid) != Some(*start) {
                return None;
            }
            open_link(Path::new(&format!(
                "/proc/{pid}/map_files/{vm_start:x}-{vm_end:x}"
            )))
        }
        Source::Upper { rel } => open_upper(upper?, rel),
    }?;
    let (fd, dev, ino, _) = got;
    (dev == f.dev && ino == f.ino).then_some(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c6a00000-55d0c6a21000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                   8 kB
Anonymous:             8 kB
Swap:                  4 kB
VmFlags: rd wr mr mw me ac
7f1c2a000000-7f1c2a021000 r-xp 00002000 00:1f 1234                       /usr/lib/x86_64-linux-gnu/libc so.6
Rss:                 120 kB
Anonymous:             0 kB
7ffd1000-7ffd2000 rw-p 00000000 00:00 0 
Rss:                   4 kB
Anonymous:             4 kB
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
Rss:                   0 kB
";

    #[test]
    fn smaps_parse_with_their_fields() {
        let v = parse_smaps(SMAPS);
        assert_eq!(v.len(), 4);
        assert_eq!(v[0].path, "[heap]");
        assert_eq!((v[0].rss, v[0].anonymous, v[0].swap), (8192, 8192, 4096));
        assert!(v[0].is_anon());
        assert_eq!(v[1].path, "/usr/lib/x86_64-linux-gnu/libc so.6");
        assert_eq!(
            (v[1].offset, v[1].inode, v[1].rss),
            (0x2000, 1234, 120 * 1024)
        );
        assert!(!v[1].is_anon());
        assert_eq!(v[2].path, "");
        assert!(v[2].is_anon());
        assert!(!v[3].is_anon(), "[vsyscall] cannot be advised");
        // Garbage is skipped, never a panic.
        assert!(parse_smaps("x-y z\n:::\n-\n0-1 rw-p zz 00:00 0\n").is_empty());
        assert!(parse_smaps("2-1 rw-p 0 00:00 0\n").is_empty());
    }

    #[test]
    fn stored_records_are_checked() {
        assert!(Residency::parse(b"{").is_err());
        let r = Residency {
            files: vec![FileRecord {
                source: Source::Upper { rel: "a".into() },
                path: "/a".into(),
                dev: 1,
                ino: 2,
                size: 8192,
                ranges: vec![[0, 4096], [u64::MAX, 2], [4096, 1 << 40]],
            }],
            processes: vec![ProcessRecord {
                pid: 1,
                start: 1,
                anon: vec![[10, 5], [0, 4096]],
                anon_bytes: 0,
                swap_bytes: 0,
            }],
            ..Residency::default()
        };
        let back = Residency::parse(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(back.files[0].ranges, vec![[0, 4096]]);
        assert_eq!(back.processes[0].anon, vec![[0, 4096]]);
    }

    #[test]
    fn runs_merge() {
        assert_eq!(
            merge(vec![[8192, 4096], [0, 4096], [4096, 4096], [20480, 4096]]),
            vec![[0, 12288], [20480, 4096]]
        );
        assert_eq!(merge(vec![[0, 8192], [4096, 4096]]), vec![[0, 8192]]);
    }

    #[test]
    fn resident_pages_of_a_file_are_found_and_bounded() {
        page_size().unwrap();
        // Not /tmp, which may be a tmpfs (its pages cannot be dropped).
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; 64 << 10]).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        // Dirty pages are not dropped.
        f.sync_all().unwrap();
        // Written just now: all 16 pages are in the page cache.
        let mut b = Budget::default();
        let mut runs = Vec::new();
        assert!(resident_runs(f.as_fd(), 0, u64::MAX, 64 << 10, &mut b, &mut runs).unwrap());
        assert_eq!(runs, vec![[0, 64 << 10]]);
        // Dropped: none.
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        let mut runs = Vec::new();
        let mut b = Budget::default();
        resident_runs(f.as_fd(), 0, u64::MAX, 64 << 10, &mut b, &mut runs).unwrap();
        let left: u64 = runs.iter().map(|r| r[1]).sum();
        assert!(
            left < 64 << 10,
            "fadvise(DONTNEED) dropped nothing: {runs:?}"
        );
        // A scan budget smaller than the file stops the scan.
        let mut b = Budget {
            scan_bytes: 4096,
            ..Budget::default()
        };
        assert!(!resident_runs(f.as_fd(), 0, u64::MAX, 64 << 10, &mut b, &mut Vec::new()).unwrap());
    }

    #[test]
    fn this_process_records_itself() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/w"), vec![1u8; 8192]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).unwrap();
        let open = std::fs::File::open(dir.path().join("d/w")).unwrap();
        let r = record(&[std::process::id()], dir.path(), Budget::default());
        assert_eq!(r.processes.len(), 1);
        assert!(!r.processes[0].anon.is_empty(), "a process has a heap");
        let w = r
            .files
            .iter()
            .find(|f| f.path.ends_with("/d/w"))
            .expect("the open (and upper) file is recorded");
        assert_eq!(w.bytes(), 8192);
        assert!(
            !r.files
                .iter()
                .any(|f| f.path.contains("passwd") && f.in_upper()),
            "a symlink in the upper is not followed"
        );
        // Opened again, it is the same file.
        assert!(reopen(w, open_upper_root(dir.path()).as_ref()).is_some());
        drop(open);
    }
}
