//! Suspend and resume: a sandbox that stays alive and costs almost nothing until it is
//! needed again, then is usable at once, with no replay of commands.
//!
//! ## Suspend (`Manager::suspend`)
//! 1. Freeze (the runtime's freezer: cgroup v1 `freezer`, v2 `cgroup.freeze`), unless paused.
//! 2. Record what is resident ([`crate::resident`]) into `<dir>/<id>/suspend.json`.
//! 3. Reclaim:
//!    - **file pages that are the sandbox's own**: `fadvise(DONTNEED)` on the upper's files and
//!      on open or mapped files of layers no *running* sandbox of the node also has in its
//!      stack (a layer is mounted once per node, so its page cache is shared: a neighbour's
//!      reads must not become misses because this one went to sleep; a file whose layer is
//!      unknown is kept);
//!    - **anonymous pages**, where the node has swap: `process_madvise(MADV_PAGEOUT)` on each
//!      process's anonymous mappings (only pages no other process maps);
//!    - **the rest of the cgroup's charge** (files read and closed, tmpfs pages to swap):
//!      `memory.force_empty` (v1) or `memory.reclaim` (v2), only when none of its layers is
//!      shared with a running sandbox — that reclaim cannot tell whose pages it takes.
//! 4. The state becomes `suspended` (the record is written last: a daemon that dies before it
//!    finds a paused sandbox; after it, a suspended one, still frozen, with its record).
//!
//! ## Resume (`Manager::resume` of a suspended sandbox)
//! 1. The layer chunks behind the recorded file pages are put in the chunk cache at prefetch
//!    priority (each path looked up top-down in the stack's meta images, `Image::data_map`).
//! 2. The recorded file pages are read back (4 threads, through the same process's descriptor
//!    or mapping, or the upper's path; a file that is gone or is another file now is skipped),
//!    and anonymous mappings with swapped pages get `process_madvise(MADV_WILLNEED)`.
//!    Pages read back are charged to the daemon's cgroup, not the sandbox's. Only processes
//!    in the sandbox's cgroup at resume are read from or advised, whatever the record names.
//! 3. Thaw; `running`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use erofs_builder::reader::{FileType, Image, Location};
use fs_cache::Digest;
use serde::{Deserialize, Serialize};

use crate::cgroup::{self, Memory};
use crate::manager::Sandbox;
use crate::proto::{SandboxInfo, SandboxState};
use crate::resident::{self, Budget, FileRecord, Residency};
use crate::{Error, Manager, Result};

/// What a suspend did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SuspendReport {
    pub info: SandboxInfo,
    /// The cgroup's memory before the freeze and after the reclaim.
    pub before: Memory,
    pub after: Memory,
    /// Freeze to the record written, milliseconds (freeze, record, reclaim).
    pub suspend_ms: u64,
    pub record_ms: u64,
    pub reclaim_ms: u64,
    /// What was recorded: files, their resident bytes, anonymous bytes.
    pub files: usize,
    pub file_bytes: u64,
    pub anon_bytes: u64,
    pub truncated: bool,
    /// Files whose pages were dropped (`fadvise`), and those kept for a running neighbour.
    pub files_dropped: usize,
    pub files_kept_shared: usize,
    /// Layers of its stack a running sandbox also has (their pages are kept).
    pub shared_layers: Vec<String>,
    /// Anonymous bytes `MADV_PAGEOUT` was applied to (0 without swap).
    pub pageout_bytes: u64,
    /// The cgroup-wide reclaim used (`memory.force_empty`, `memory.reclaim`), or why not.
    pub cgroup_reclaim: String,
    /// Whether the node has swap.
    pub swap: bool,
}

/// What a resume of a suspended sandbox did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeReport {
    /// Chunk prefetch, page read-back, thaw, milliseconds.
    pub chunks_ms: u64,
    pub pages_ms: u64,
    pub thaw_ms: u64,
    pub resume_ms: u64,
    /// Bytes of layer blobs asked of the chunk cache, and of file pages read back.
    pub chunk_bytes: u64,
    pub page_bytes: u64,
    /// Anonymous bytes `MADV_WILLNEED` was applied to (those with swapped pages).
    pub swapin_bytes: u64,
    /// Recorded files read back, and those skipped (gone, or another file now).
    pub files: usize,
    pub files_skipped: usize,
    /// Chunk prefetches that failed (the pages then come from demand reads).
    pub chunk_errors: usize,
}

/// `sandbox_resume`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeResult {
    #[serde(flatten)]
    pub info: SandboxInfo,
    /// Set when the sandbox was suspended (a paused one is only thawed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<ResumeReport>,
}

/// Whether the node has swap space now.
pub fn swap_present() -> bool {
    std::fs::read_to_string("/proc/swaps")
        .map(|s| s.lines().skip(1).any(|l| !l.trim().is_empty()))
        .unwrap_or(false)
}

fn record_path(sb: &Sandbox) -> PathBuf {
    sb.dir.join("suspend.json")
}

/// One layer of a stack, as prefetch and reclaim see it.
struct StackLayer {
    reference: String,
    image: Image,
    blobs: Vec<Digest>,
}

/// A sandbox's layers, top first, with their meta images (`None` where one cannot be read).
async fn open_stack(m: &Manager, sb: &Sandbox) -> Vec<StackLayer> {
    let status = m.node.status().await;
    let root = sb.rootfs();
    let Some(mount) = status.mounts.iter().find(|x| x.mountpoint == root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (reference, id) in mount.layers.iter().zip(&mount.layer_ids).rev() {
        let Some(info) = status.layers.iter().find(|l| &l.id == id) else {
            continue;
        };
        let blobs = info
            .blobs
            .iter()
            .filter_map(|(d, _)| d.parse().ok())
            .collect();
        let path = m.node.meta_image(id);
        match tokio::task::spawn_blocking(move || Image::open(&path)).await {
            Ok(Ok(image)) => out.push(StackLayer {
                reference: reference.clone(),
                image,
                blobs,
            }),
            Ok(Err(e)) => tracing::warn!("sandbox {}: meta image of {reference}: {e}", sb.id),
            Err(e) => tracing::warn!("sandbox {}: meta image task: {e}", sb.id),
        }
    }
    out
}

/// The layer (index in `stack`, top first) and inode a path of the merged root comes from,
/// when no higher layer hides it (a whiteout, or anything not a regular file, stops the
/// search). Opaque directories are not looked at: the answer only steers prefetch and
/// reclaim, never a read.
fn locate(stack: &[StackLayer], path: &str) -> Option<(usize, erofs_builder::reader::Inode)> {
    if !path.starts_with('/') || path.ends_with(" (deleted)") {
        return None;
    }
    for (i, l) in stack.iter().enumerate() {
        match l.image.lookup(path) {
            Ok(ino) if ino.file_type == FileType::Regular => return Some((i, ino)),
            Ok(_) => return None,
            Err(_) => continue,
        }
    }
    None
}

/// `process_madvise(2)` of `ranges` of process `pid` (still started at `start`): the bytes
/// advised.
fn advise(pid: u32, start: u64, ranges: &[[u64; 2]], advice: i32) -> std::io::Result<u64> {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return Ok(0);
    };
    let pidfd: OwnedFd = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())?;
    // The pidfd pins the process: if the start time matches now, it is the one recorded.
    if crate::manager::start_time(pid) != Some(start) {
        return Ok(0);
    }
    let mut done = 0u64;
    for batch in ranges.chunks(512) {
        let iov: Vec<libc::iovec> = batch
            .iter()
            .map(|r| libc::iovec {
                iov_base: r[0] as *mut libc::c_void,
                iov_len: (r[1] - r[0]) as usize,
            })
            .collect();
        // SAFETY: process_madvise reads `iov.len()` iovecs from `iov` (alive for the call);
        // the addresses are the target process's, never dereferenced here.
        let r = unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                pidfd.as_raw_fd(),
                iov.as_ptr(),
                iov.len(),
                advice,
                0u32,
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            // A mapping gone or not advisable ends this batch, not the suspend.
            if done == 0 && e.raw_os_error() == Some(libc::ENOSYS) {
                return Err(e);
            }
            continue;
        }
        done += r as u64;
    }
    Ok(done)
}

/// `VmSwap` of `/proc/<pid>/status`, bytes.
fn vm_swap(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let l = s.lines().find(|l| l.starts_with("VmSwap:"))?;
            let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb * 1024)
        })
        .unwrap_or(0)
}

/// What [`reclaim`] did.
#[derive(Default)]
struct Reclaimed {
    dropped: usize,
    kept: usize,
    pageout: u64,
    cgroup: String,
}

/// Step 3 of a suspend (module docs). `shared`: indexes in `stack` of layers a running
/// sandbox also has.
fn reclaim(
    res: &Residency,
    stack: &[StackLayer],
    shared: &BTreeSet<usize>,
    upper: &Path,
    cgroups: &BTreeMap<String, PathBuf>,
    swap: bool,
) -> Reclaimed {
    let mut out = Reclaimed::default();
    let upper = resident::open_upper_root(upper);
    for f in &res.files {
        let private = f.in_upper()
            || shared.is_empty()
            || locate(stack, &f.path).is_some_and(|(i, _)| !shared.contains(&i));
        if !private {
            out.kept += 1;
            continue;
        }
        let Some(fd) = resident::reopen(f, upper.as_ref()) else {
            continue;
        };
        if f.in_upper() {
            // Dirty pages are not dropped: written back first.
            let _ = rustix::fs::fdatasync(&fd);
        }
        for [o, l] in &f.ranges {
            let _ = rustix::fs::fadvise(
                &fd,
                *o,
                std::num::NonZeroU64::new(*l),
                rustix::fs::Advice::DontNeed,
            );
        }
        out.dropped += 1;
    }
    if swap {
        for p in &res.processes {
            match advise(p.pid, p.start, &p.anon, libc::MADV_PAGEOUT) {
                Ok(n) => out.pageout += n,
                Err(e) => tracing::warn!("process_madvise(MADV_PAGEOUT) of {}: {e}", p.pid),
            }
        }
    }
    out.cgroup = if shared.is_empty() {
        match cgroup::reclaim(cgroups) {
            Ok(how) => how.to_owned(),
            Err(e) => format!("failed: {e}"),
        }
    } else {
        "skipped: layers shared with a running sandbox".to_owned()
    };
    out
}

/// Read the recorded pages of `files` back (4 threads): bytes read, files read, skipped.
fn read_back(files: &[FileRecord], upper: &Path) -> (u64, usize, usize) {
    let upper = resident::open_upper_root(upper);
    let upper = upper.as_ref();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let totals = std::sync::Mutex::new((0u64, 0usize, 0usize));
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut buf = vec![0u8; 1 << 20];
                let (mut bytes, mut ok, mut skipped) = (0u64, 0usize, 0usize);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(f) = files.get(i) else { break };
                    let Some(fd) = resident::reopen(f, upper) else {
                        skipped += 1;
                        continue;
                    };
                    for [o, l] in &f.ranges {
                        let (mut at, end) = (*o, o + l);
                        while at < end {
                            let n = ((end - at) as usize).min(buf.len());
                            match rustix::io::pread(fd.as_fd(), &mut buf[..n], at) {
                                Ok(0) | Err(_) => break,
                                Ok(got) => {
                                    at += got as u64;
                                    bytes += got as u64;
                                }
                            }
                        }
                    }
                    ok += 1;
                }
                let mut t = totals.lock().unwrap_or_else(|p| p.into_inner());
                t.0 += bytes;
                t.1 += ok;
                t.2 += skipped;
            });
        }
    });
    totals.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// The blob ranges behind the recorded pages of files of the stack's layers.
fn chunk_ranges(res: &Residency, stack: &[StackLayer]) -> HashMap<Digest, Vec<Range<u64>>> {
    let mut out: HashMap<Digest, Vec<Range<u64>>> = HashMap::new();
    for f in res.files.iter().filter(|f| !f.in_upper()) {
        let Some((i, ino)) = locate(stack, &f.path) else {
            continue;
        };
        let l = &stack[i];
        let Ok(map) = l.image.data_map(&ino) else {
            continue;
        };
        for [o, len] in &f.ranges {
            let (o, end) = (*o, o + len);
            for e in &map {
                let (s, t) = (o.max(e.file_offset), end.min(e.file_offset + e.len));
                if s >= t {
                    continue;
                }
                if let Location::Device { device, offset } = e.location {
                    let Some(blob) = l.blobs.get(usize::from(device).wrapping_sub(1)) else {
                        continue;
                    };
                    let at = offset + (s - e.file_offset);
                    out.entry(*blob).or_default().push(at..at + (t - s));
                }
            }
        }
    }
    out
}

impl Manager {
    /// Indexes (in `stack`) of the layers another running sandbox also has.
    fn shared_with_running(&self, sb: &Sandbox, stack: &[StackLayer]) -> BTreeSet<usize> {
        let mut others = BTreeSet::new();
        for o in self.all() {
            if o.id == sb.id {
                continue;
            }
            let r = o.record();
            if matches!(r.state, SandboxState::Running | SandboxState::Creating) {
                others.extend(r.layers);
            }
        }
        stack
            .iter()
            .enumerate()
            .filter(|(_, l)| others.contains(&l.reference))
            .map(|(i, _)| i)
            .collect()
    }

    /// Suspend sandbox `id` (running or paused; see the module docs).
    pub async fn suspend(&self, id: &str) -> Result<SuspendReport> {
        let sb = self.get(id)?;
        let _life = sb.lifecycle.lock().await;
        let r = sb.record();
        let was_paused = match r.state {
            SandboxState::Running => false,
            SandboxState::Paused => true,
            SandboxState::Suspended => {
                return Err(Error::Conflict(format!(
                    "sandbox {id} is suspended already"
                )))
            }
            s => {
                return Err(Error::Conflict(format!(
                    "sandbox {id} is {}",
                    crate::proto::state_name(s)
                )))
            }
        };
        let pid = r
            .pid
            .ok_or_else(|| Error::Conflict(format!("sandbox {id} has no init")))?;
        let cgroups = cgroup::of_pid(pid);
        let before = cgroup::memory(&cgroups);
        let t0 = Instant::now();
        if !was_paused {
            self.runtime.pause(id).await?;
        }
        let stack = Arc::new(open_stack(self, &sb).await);
        let shared = self.shared_with_running(&sb, &stack);
        let shared_layers = shared.iter().map(|&i| stack[i].reference.clone()).collect();
        let upper = self.upper_of(&sb);
        let swap = swap_present();
        let job = {
            let (stack, cgroups) = (stack.clone(), cgroups.clone());
            move || {
                let t = Instant::now();
                let pids = cgroup::procs(&cgroups);
                let res = resident::record(&pids, &upper, Budget::default());
                let record_ms = t.elapsed().as_millis() as u64;
                let t = Instant::now();
                let rec = reclaim(&res, &stack, &shared, &upper, &cgroups, swap);
                (res, rec, record_ms, t.elapsed().as_millis() as u64)
            }
        };
        let done = tokio::task::spawn_blocking(job)
            .await
            .map_err(|e| Error::Runtime(format!("suspend task: {e}")));
        let saved = async {
            let (res, rec, record_ms, reclaim_ms) = done?;
            let bytes = serde_json::to_vec(&res).map_err(|e| Error::Spec(e.to_string()))?;
            crate::bundle::write_file(record_path(&sb), bytes).await?;
            sb.set(|r| r.state = SandboxState::Suspended).await?;
            Ok((res, rec, record_ms, reclaim_ms))
        }
        .await;
        let (res, rec, record_ms, reclaim_ms) = match saved {
            Ok(v) => v,
            Err(e) => {
                if !was_paused {
                    let _ = self.runtime.resume(id).await;
                }
                return Err(e);
            }
        };
        let suspend_ms = t0.elapsed().as_millis() as u64;
        let after = cgroup::memory(&cgroups);
        tracing::info!(
            "sandbox {id}: suspended in {suspend_ms} ms, {} → {} bytes charged",
            before.usage,
            after.usage
        );
        Ok(SuspendReport {
            info: sb.info(),
            before,
            after,
            suspend_ms,
            record_ms,
            reclaim_ms,
            files: res.files.len(),
            file_bytes: res.file_bytes(),
            anon_bytes: res.anon_bytes(),
            truncated: res.truncated,
            files_dropped: rec.dropped,
            files_kept_shared: rec.kept,
            shared_layers,
            pageout_bytes: rec.pageout,
            cgroup_reclaim: rec.cgroup,
            swap,
        })
    }

    /// Thaw a paused sandbox, or resume a suspended one (prefetch first; module docs).
    pub async fn resume(&self, id: &str) -> Result<ResumeResult> {
        let sb = self.get(id)?;
        let _life = sb.lifecycle.lock().await;
        let prefetch = match sb.record().state {
            SandboxState::Paused => None,
            SandboxState::Suspended => Some(self.prefetch(&sb).await),
            _ => return Err(Error::Conflict(format!("sandbox {id} is not paused"))),
        };
        let t = Instant::now();
        self.runtime.resume(id).await?;
        sb.set(|r| r.state = SandboxState::Running).await?;
        sb.touch();
        let _ = std::fs::remove_file(record_path(&sb));
        let prefetch = prefetch.map(|mut p| {
            p.thaw_ms = t.elapsed().as_millis() as u64;
            p.resume_ms = p.chunks_ms + p.pages_ms + p.thaw_ms;
            p
        });
        Ok(ResumeResult {
            info: sb.info(),
            prefetch,
        })
    }

    /// Steps 1 and 2 of a resume. A record that cannot be read means no prefetch: the pages
    /// come back on demand.
    async fn prefetch(&self, sb: &Sandbox) -> ResumeReport {
        let mut rep = ResumeReport::default();
        let res = match std::fs::read(record_path(sb))
            .map_err(|e| e.to_string())
            .and_then(|b| Residency::parse(&b))
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("sandbox {}: no residency record ({e}); no prefetch", sb.id);
                return rep;
            }
        };
        // Only the sandbox's own processes are read from or advised, whatever the record says.
        let mut res = res;
        let procs: BTreeSet<u32> = sb
            .record()
            .pid
            .map(|p| cgroup::procs(&cgroup::of_pid(p)).into_iter().collect())
            .unwrap_or_default();
        res.processes.retain(|p| procs.contains(&p.pid));
        res.files.retain(|f| match f.source {
            resident::Source::Fd { pid, .. } | resident::Source::Map { pid, .. } => {
                procs.contains(&pid)
            }
            resident::Source::Upper { .. } => true,
        });
        let t = Instant::now();
        let stack = open_stack(self, sb).await;
        let ranges = chunk_ranges(&res, &stack);
        drop(stack);
        let mut handles = Vec::new();
        for (blob, mut r) in ranges {
            r.sort_by_key(|x| x.start);
            rep.chunk_bytes += r.iter().map(|x| x.end - x.start).sum::<u64>();
            handles.push(self.node.cache().prefetch(blob, r));
        }
        for h in handles {
            match tokio::time::timeout(Duration::from_secs(60), h).await {
                Ok(Ok(Ok(()))) => {}
                _ => rep.chunk_errors += 1,
            }
        }
        rep.chunks_ms = t.elapsed().as_millis() as u64;
        let t = Instant::now();
        let upper = self.upper_of(sb);
        let job = move || {
            let (bytes, files, skipped) = read_back(&res.files, &upper);
            let mut swapin = 0;
            // Swapped out by the reclaim (after the record was taken): `VmSwap` now.
            for p in res.processes.iter().filter(|p| vm_swap(p.pid) > 0) {
                swapin += advise(p.pid, p.start, &p.anon, libc::MADV_WILLNEED).unwrap_or(0);
            }
            (bytes, files, skipped, swapin)
        };
        if let Ok((bytes, files, skipped, swapin)) = tokio::task::spawn_blocking(job).await {
            rep.page_bytes = bytes;
            rep.files = files;
            rep.files_skipped = skipped;
            rep.swapin_bytes = swapin;
        }
        rep.pages_ms = t.elapsed().as_millis() as u64;
        rep
    }
}
