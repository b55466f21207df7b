//! The blob mount: a FUSE filesystem whose root lists one read-only file per registered blob,
//! named by the blob's hex digest, of the blob's size, read through the chunk cache.
//!
//! ```text
//! <mountpoint>/                      dr-xr-xr-x root root  (inode 1)
//! <mountpoint>/<64 hex digits>       -r--r--r-- root root  size = blob size (inodes 3, 4, ...)
//! ```
//!
//! The mount is made with mount(2) directly (`/dev/fuse` opened here, `fd=` passed in the
//! options; no libfuse, no fusermount), `allow_other,default_permissions`, read-only, nosuid,
//! nodev. Requests are served by `threads` threads, each reading its own clone of the device
//! fd (`FUSE_DEV_IOC_CLONE`). Blob files are opened with `FOPEN_DIRECT_IO` (unless disabled)
//! so the kernel keeps no page-cache copy of them: the EROFS mount above keeps one copy of
//! what it reads, and the chunk cache keeps the chunks. See `docs/blobfs.md`.

mod fs;
mod table;

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fs_cache::chunk::ChunkCache;
use fs_cache::Digest;
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;

use crate::fuse::abi::init as flag;
use crate::fuse::{InitPolicy, Negotiated, Session};
use crate::fusemount::{self, umount, FuseMount};
use crate::holder::HolderClient;
use crate::{Error, Result};
use fs::{BlobFsImpl, Counters, Options};
use table::Table;

/// The largest request the kernel sends with the default `fs.fuse.max_pages_limit` (256
/// pages).
pub const DEFAULT_MAX_READ: u32 = 1 << 20;

/// The fd holder's entry name of the blob mount's connection.
pub const HOLDER_ENTRY: &str = "blobfs";

/// How a blob mount is made.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BlobFsConfig {
    /// An existing directory (a dead FUSE mount left there by a crashed daemon is detached).
    pub mountpoint: PathBuf,
    /// Threads reading requests from the kernel (all on one device descriptor), 1..=256.
    pub threads: usize,
    /// The largest read request the kernel may send, in bytes (4 KiB..=16 MiB; the kernel also
    /// caps it at `fs.fuse.max_pages_limit` pages).
    pub max_read: u32,
    /// Open blob files with `FOPEN_DIRECT_IO`, so the kernel keeps no page-cache copy of them
    /// (default). Turn off only to measure what it saves.
    pub direct_io: bool,
    /// Ask the kernel for FUSE passthrough at INIT ([`BlobFs::passthrough_available`] tells
    /// whether it agreed). Blobs switched with [`BlobFs::enable_passthrough`] are then opened
    /// in passthrough mode; the others are served through the cache. Off by default here; the
    /// node turns it on (`docs/blobfs.md`: it pays under an EROFS mounted with `directio`).
    pub passthrough: bool,
}

impl BlobFsConfig {
    /// Defaults: 8 threads, 1 MiB reads, direct I/O, no passthrough.
    pub fn new(mountpoint: impl Into<PathBuf>) -> Self {
        Self {
            mountpoint: mountpoint.into(),
            threads: 8,
            max_read: DEFAULT_MAX_READ,
            direct_io: true,
            passthrough: false,
        }
    }

    fn check(&self) -> Result<()> {
        if !(1..=256).contains(&self.threads) {
            return Err(Error::InvalidConfig(format!(
                "threads must be 1..=256, got {}",
                self.threads
            )));
        }
        if !(4096..=(16 << 20)).contains(&self.max_read) {
            return Err(Error::InvalidConfig(format!(
                "max_read must be 4096..=16777216, got {}",
                self.max_read
            )));
        }
        Ok(())
    }

    fn policy(&self) -> InitPolicy {
        let mut want = flag::ASYNC_READ
            | flag::BIG_WRITES
            | flag::MAX_PAGES
            // Many reads in flight at once (EROFS submits its reads asynchronously), and
            // direct I/O from an asynchronous reader stays asynchronous: a large read becomes
            // `max_pages` requests in flight at once instead of one at a time.
            | flag::ASYNC_DIO
            | flag::PARALLEL_DIROPS;
        if self.passthrough {
            want |= flag::PASSTHROUGH;
        }
        InitPolicy {
            max_read: self.max_read,
            max_write: 4096,
            want,
            max_background: 256,
            congestion_threshold: 192,
        }
    }
}

/// What the fd holder keeps beside the blob mount's connection (JSON): enough for a later
/// daemon to check that the connection is the mount it finds, and to resume it without INIT.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedConnection {
    /// Where the connection is mounted.
    pub mountpoint: PathBuf,
    /// The mount's device number `major:minor` (mountinfo), once mounted.
    #[serde(default)]
    pub dev: Option<String>,
    /// The INIT values, once agreed (saved before INIT is answered).
    #[serde(default)]
    pub negotiated: Option<Negotiated>,
}

impl SavedConnection {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(s: &str) -> Option<Self> {
        serde_json::from_str(s).ok()
    }
}

/// Counters of one mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlobFsStats {
    /// Read requests served (successful or not).
    pub reads: u64,
    /// Bytes returned by reads.
    pub read_bytes: u64,
    /// Reads answered with EIO.
    pub read_errors: u64,
    /// The most reads served at the same time so far.
    pub max_concurrent_reads: u64,
    /// Reads being served now.
    pub in_flight: u64,
}

/// A live blob mount. Unmounted by [`BlobFs::unmount`] or when dropped, unless handed over
/// ([`BlobFs::hand_over`]).
pub struct BlobFs {
    mountpoint: PathBuf,
    cache: Arc<ChunkCache>,
    table: Arc<Table>,
    negotiated: Negotiated,
    counters: Arc<Counters>,
    session: Option<Session>,
    holder: Option<Arc<HolderClient>>,
    /// This mount's FUSE connection directory (`/sys/fs/fuse/connections/<N>`), which exists
    /// for as long as the kernel may read through the mount, even after this process is gone:
    /// the token of every passthrough pin's hold.
    connection: Option<PathBuf>,
}

impl std::fmt::Debug for BlobFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobFs")
            .field("mountpoint", &self.mountpoint)
            .field("blobs", &self.table.totals().0)
            .finish()
    }
}

fn check_runtime(rt: &Handle) -> Result<()> {
    if rt.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
        // FUSE threads block on the runtime: a current-thread runtime would only make
        // progress while its own thread happens to be inside `block_on`.
        return Err(Error::InvalidConfig(
            "the runtime must be a multi-threaded tokio runtime".into(),
        ));
    }
    Ok(())
}

/// The FUSE connection directory of device `maj:min` (named `major << 20 | minor`), if
/// fusectl is mounted and shows it. Found without touching the mount itself (a mount whose
/// server is not answering yet would block a `stat`).
fn fuse_connection(dev: &str) -> Option<PathBuf> {
    let (maj, min) = dev.split_once(':')?;
    let n = (maj.parse::<u64>().ok()? << 20) | min.parse::<u64>().ok()?;
    let dir = Path::new("/sys/fs/fuse/connections").join(n.to_string());
    if !dir.is_dir() {
        tracing::warn!(
            dir = %dir.display(),
            "no FUSE connection directory (is fusectl mounted?): no passthrough"
        );
        return None;
    }
    Some(dir)
}

impl BlobFs {
    /// Mount an (initially empty) blob filesystem at `cfg.mountpoint`. Reads run
    /// [`ChunkCache::read`] on `rt`, which must be a multi-threaded runtime (FUSE threads call
    /// `rt.block_on`). With `holder`, the connection is handed to the fd holder before it is
    /// mounted, and the INIT values are saved there before INIT is answered, so that the
    /// mount outlives this process ([`BlobFs::resume`]). Needs root (mount(2), `/dev/fuse`).
    pub fn mount(
        cfg: BlobFsConfig,
        cache: Arc<ChunkCache>,
        rt: Handle,
        holder: Option<Arc<HolderClient>>,
    ) -> Result<BlobFs> {
        cfg.check()?;
        check_runtime(&rt)?;
        if clean_stale_mount(&cfg.mountpoint)? {
            tracing::warn!(path = %cfg.mountpoint.display(), "detached a dead FUSE mount");
        }
        let mountpoint = cfg
            .mountpoint
            .canonicalize()
            .map_err(|e| Error::io("canonicalize", &cfg.mountpoint, e))?;
        if !mountpoint.is_dir() {
            return Err(Error::io(
                "mount on",
                &mountpoint,
                std::io::Error::from_raw_os_error(libc::ENOTDIR),
            ));
        }
        let dev = fusemount::open_dev()?;
        let mut saved = SavedConnection {
            mountpoint: mountpoint.clone(),
            dev: None,
            negotiated: None,
        };
        let how = FuseMount {
            name: "strata-blobfs",
            file_root: false,
            read_only: true,
        };
        fusemount::mount_fuse(
            &mountpoint,
            std::os::fd::AsRawFd::as_raw_fd(&dev),
            cfg.max_read,
            how,
        )?;
        // From here on, a failure must not leave the mount (nor the holder's entry) behind.
        let undo = |e: Error| {
            let _ = umount(&mountpoint, rustix::mount::UnmountFlags::DETACH);
            if let Some(h) = &holder {
                let _ = h.drop_entry(HOLDER_ENTRY);
            }
            e
        };
        saved.dev = fusemount::mount_dev(&mountpoint);
        // Handed to the holder once mounted (an unmounted device reports POLLERR, which the
        // holder takes for a connection that ended) and before INIT is answered: no request
        // is served before the holder has the connection. A crash before this leaves a mount
        // nobody can have used yet, which the next daemon detaches.
        if let Some(h) = &holder {
            h.put(HOLDER_ENTRY, &saved.to_json(), dev.as_fd())
                .map_err(|e| {
                    undo(Error::io(
                        "hand the FUSE connection to the fd holder",
                        &mountpoint,
                        e,
                    ))
                })?;
        }
        let negotiated =
            crate::fuse::handshake(&dev, &cfg.policy(), Duration::from_secs(30), |neg| {
                saved.negotiated = Some(*neg);
                match &holder {
                    Some(h) => h.set_meta(HOLDER_ENTRY, &saved.to_json()),
                    None => Ok(()),
                }
            })
            .map_err(|e| undo(Error::io("FUSE handshake on", &mountpoint, e)))?;
        let fs = Self::new(mountpoint.clone(), cache, negotiated, holder.clone());
        let fs = fs
            .start(rt, dev, false, &cfg, saved.dev.as_deref())
            .map_err(undo)?;
        raise_bdi_readahead(&fs.mountpoint, cfg.max_read);
        Ok(fs)
    }

    /// Resume serving a blob mount whose connection `dev` an earlier process initialised and
    /// the fd holder kept (`saved` is what was kept with it), listing `blobs` before the first
    /// request is read: the kernel's EROFS mounts keep reading the files they have open. The
    /// requests the earlier process read but never answered are queued again
    /// (`FUSE_NOTIFY_RESEND`, where the kernel has it).
    pub fn resume(
        cfg: BlobFsConfig,
        cache: Arc<ChunkCache>,
        rt: Handle,
        holder: Option<Arc<HolderClient>>,
        dev: OwnedFd,
        saved: &SavedConnection,
        blobs: &[(Digest, u64)],
    ) -> Result<BlobFs> {
        cfg.check()?;
        check_runtime(&rt)?;
        let negotiated = saved.negotiated.ok_or_else(|| {
            Error::InvalidConfig("the kept FUSE connection was never initialised".into())
        })?;
        let fs = Self::new(saved.mountpoint.clone(), cache, negotiated, holder);
        for (d, size) in blobs {
            fs.table
                .add(*d, *size)
                .map_err(|other| Error::InodeCollision(d.to_hex(), other.to_hex()))?;
        }
        fs.start(rt, dev, true, &cfg, saved.dev.as_deref())
    }

    fn new(
        mountpoint: PathBuf,
        cache: Arc<ChunkCache>,
        negotiated: Negotiated,
        holder: Option<Arc<HolderClient>>,
    ) -> BlobFs {
        BlobFs {
            mountpoint,
            cache,
            table: Arc::new(Table::default()),
            negotiated,
            counters: Arc::new(Counters::default()),
            session: None,
            holder,
            connection: None,
        }
    }

    fn start(
        mut self,
        rt: Handle,
        dev: OwnedFd,
        resend: bool,
        cfg: &BlobFsConfig,
        devno: Option<&str>,
    ) -> Result<BlobFs> {
        let handler = Arc::new(BlobFsImpl {
            table: self.table.clone(),
            cache: self.cache.clone(),
            rt,
            opts: Options {
                max_read: cfg.max_read,
                direct_io: cfg.direct_io,
            },
            negotiated: self.negotiated,
            counters: self.counters.clone(),
            started: SystemTime::now(),
        });
        let session = Session::serve(dev, self.negotiated, handler, cfg.threads, resend)
            .map_err(|e| Error::io("start FUSE threads for", &self.mountpoint, e))?;
        self.session = Some(session);
        if self.negotiated.passthrough() {
            self.connection = devno.and_then(fuse_connection);
        }
        Ok(self)
    }

    /// Serve `blob`: load its chunk table (through the cache) and list `<mount>/<hex>`.
    /// Idempotent. Returns the file's path.
    pub async fn add_blob(&self, blob: Digest) -> Result<PathBuf> {
        let table = self.cache.register(&blob).await?;
        let e = self
            .table
            .add(blob, table.blob_size)
            .map_err(|other| Error::InodeCollision(blob.to_hex(), other.to_hex()))?;
        Ok(self.mountpoint.join(&e.name))
    }

    /// Stop listing `blob`. Handles already open keep reading until released (an EROFS mount
    /// over the file keeps working until it is unmounted).
    pub fn remove_blob(&self, blob: &Digest) -> Result<()> {
        let e = self
            .table
            .remove(blob)
            .ok_or_else(|| Error::UnknownBlob(blob.to_hex()))?;
        // No new passthrough opens (open handles keep their backing file and pin).
        e.local().take();
        // Drop the kernel's cached dentry so the name disappears at once. ENOENT (nothing
        // cached) is expected.
        if let Some(s) = &self.session {
            if let Err(err) = s
                .channel()
                .inval_entry(crate::fuse::abi::ROOT_ID, e.name.as_bytes())
            {
                if err.raw_os_error() != Some(libc::ENOENT) {
                    tracing::debug!(blob = %e.name, error = %err, "invalidating a dentry failed");
                }
            }
        }
        Ok(())
    }
    /// The listed blobs and their sizes, in the order they were added.
    pub fn blobs(&self) -> Vec<(Digest, u64)> {
        self.table
            .listed_after(0)
            .iter()
            .map(|e| (e.digest, e.size))
            .collect()
    }

    /// Where the blob files are.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The path of `blob`'s file (whether or not it is listed).
    pub fn blob_path(&self, blob: &Digest) -> PathBuf {
        self.mountpoint.join(blob.to_hex())
    }

    /// If every chunk of `blob` is in the cache's level 2, pin them there
    /// ([`ChunkCache::pin_local`]: the level-2 blob file is then exactly the blob), check them
    /// once against their crc32c, and from then on open the blob file in FUSE passthrough mode
    /// with that file as the backing file: reads of handles opened later never reach this
    /// process. Handles already open (an EROFS mount made before) keep reading through the
    /// cache. Returns `false` (and changes nothing) when a chunk is not in level 2.
    /// The pin is also *held* in level 2's index by this mount's FUSE connection directory
    /// (`BlobPin::hold`): if this process dies while the kernel can still read the file, the
    /// next process that opens the cache keeps the chunks pinned until that connection is
    /// gone. Without fusectl (no connection directory) passthrough is refused (`false`).
    /// Needs [`BlobFs::passthrough_available`].
    pub async fn enable_passthrough(&self, blob: &Digest) -> Result<bool> {
        if !self.passthrough_available() {
            return Err(Error::InvalidConfig(
                "FUSE passthrough was not configured, the kernel refused it, or fusectl is \
                 not mounted"
                    .into(),
            ));
        }
        let e = self
            .table
            .listed(blob)
            .ok_or_else(|| Error::UnknownBlob(blob.to_hex()))?;
        if e.local().is_some() {
            return Ok(true);
        }
        // Without a connection directory to hold the pin by, a crash could leave the kernel
        // reading chunks that the next daemon evicts: no passthrough then.
        let Some(token) = self.connection.clone() else {
            return Ok(false);
        };
        let Some(pin) = self.cache.pin_local_held(blob, token).await? else {
            return Ok(false);
        };
        *e.local() = Some(Arc::new(pin));
        Ok(true)
    }

    /// Stop opening `blob` in passthrough mode (handles already open keep their backing file,
    /// and the chunks stay pinned until the last of them is released). Returns whether it was
    /// on.
    pub fn disable_passthrough(&self, blob: &Digest) -> Result<bool> {
        let e = self
            .table
            .listed(blob)
            .ok_or_else(|| Error::UnknownBlob(blob.to_hex()))?;
        let was = e.local().take().is_some();
        Ok(was)
    }

    /// Whether `blob` is listed and new opens of its file are passthrough opens
    /// ([`BlobFs::enable_passthrough`]).
    pub fn passthrough_enabled(&self, blob: &Digest) -> bool {
        self.table.listed(blob).is_some_and(|e| e.local().is_some())
    }

    /// Bytes of level 2 pinned for listed blobs in passthrough mode.
    pub fn passthrough_bytes(&self) -> u64 {
        self.table
            .listed_after(0)
            .iter()
            .filter_map(|e| e.local().as_ref().map(|p| p.len()))
            .sum()
    }

    /// Whether blobs can be opened in passthrough mode: the kernel accepted FUSE passthrough
    /// at INIT (only asked for when configured), and this mount's FUSE connection directory
    /// is there to hold pins by (fusectl mounted).
    pub fn passthrough_available(&self) -> bool {
        self.negotiated.passthrough() && self.connection.is_some()
    }

    /// Counters of this mount.
    pub fn stats(&self) -> BlobFsStats {
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        BlobFsStats {
            reads: g(&self.counters.reads),
            read_bytes: g(&self.counters.read_bytes),
            read_errors: g(&self.counters.read_errors),
            max_concurrent_reads: g(&self.counters.max_in_flight),
            in_flight: g(&self.counters.in_flight),
        }
    }

    /// Unmount and wait for the FUSE threads to finish. If something still uses the mount (a
    /// kernel EROFS mount over one of its files, an open file), returns [`Error::Busy`] after
    /// detaching it lazily: the mount point is free at once, existing users keep being served
    /// by the FUSE threads until they let go, and then the threads end.
    pub fn unmount(mut self) -> Result<()> {
        self.shutdown()
    }

    /// Stop serving without unmounting (a planned handover to the next daemon): the workers
    /// finish the requests they are serving and end; the connection stays with the fd holder,
    /// and requests wait in the kernel until [`BlobFs::resume`] in the next process.
    pub fn hand_over(mut self) {
        if let Some(mut s) = self.session.take() {
            s.stop();
        }
        self.holder = None;
    }

    /// What the kernel agreed at INIT.
    pub fn negotiated(&self) -> Negotiated {
        self.negotiated
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let r = fusemount::stop_session(&self.mountpoint, session, "still in use; detached lazily");
        // The connection is over (or detached and ending with its last user): the holder
        // need not keep it.
        if let Some(h) = self.holder.take() {
            if let Err(e) = h.drop_entry(HOLDER_ENTRY) {
                tracing::warn!(error = %e, "asking the fd holder to close the blob mount's connection");
            }
        }
        r
    }
}

impl Drop for BlobFs {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(path = %self.mountpoint.display(), error = %e, "unmounting blob mount");
        }
    }
}

/// If `path` is a dead FUSE mount (its server is gone: `stat` fails with ENOTCONN), detach it
/// with `umount2(MNT_DETACH)` and return `true`; otherwise leave it and return `false`.
pub fn clean_stale_mount(path: &Path) -> Result<bool> {
    match rustix::fs::stat(path) {
        Err(rustix::io::Errno::NOTCONN) => {
            umount(path, rustix::mount::UnmountFlags::DETACH)
                .map_err(|e| Error::io("umount2(MNT_DETACH)", path, e))?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// `struct fs_sysfs_path` of `FS_IOC_GETFSSYSFSPATH` (Linux 6.10+): the filesystem's
/// directory under `/sys/fs/`, e.g. `erofs/erofs-776`.
#[repr(C)]
struct FsSysfsPath {
    len: u8,
    name: [u8; 128],
}
const _: () = assert!(std::mem::size_of::<FsSysfsPath>() == 129);
/// `_IOR(0x15, 1, struct fs_sysfs_path)`.
const FS_IOC_GETFSSYSFSPATH: libc::c_ulong = (2 << 30) | (129 << 16) | (0x15 << 8) | 1;

/// The name under `/sys/fs/` of the filesystem mounted at `mountpoint`, where it has one.
fn sysfs_name(mountpoint: &Path) -> Option<String> {
    let dir = std::fs::File::open(mountpoint).ok()?;
    let mut out = FsSysfsPath {
        len: 0,
        name: [0; 128],
    };
    // SAFETY: `dir` is an open descriptor and `out` a writable `struct fs_sysfs_path` that
    // outlives the call; the kernel writes at most its 129 bytes.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&dir),
            FS_IOC_GETFSSYSFSPATH as _,
            &mut out,
        )
    };
    let len = usize::from(out.len).min(out.name.len());
    (rc == 0).then(|| String::from_utf8_lossy(&out.name[..len]).into_owned())
}

/// The `/sys/class/bdi/` entry of the filesystem mounted at `mountpoint`. Block-device and
/// FUSE filesystems name their bdi after the device number; a file-backed EROFS mount has its
/// own, `erofs-N`, the same name as its `/sys/fs/erofs/` directory, which
/// `FS_IOC_GETFSSYSFSPATH` returns.
pub fn mount_bdi(mountpoint: &Path) -> Result<PathBuf> {
    if let Some(name) = sysfs_name(mountpoint) {
        let last = name.rsplit('/').next().unwrap_or_default();
        let bdi = Path::new("/sys/class/bdi").join(last);
        if !last.is_empty() && bdi.is_dir() {
            return Ok(bdi);
        }
    }
    let st = rustix::fs::stat(mountpoint)
        .map_err(|e| Error::io("stat", mountpoint, std::io::Error::from(e)))?;
    let (major, minor) = (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev));
    Ok(PathBuf::from(format!("/sys/class/bdi/{major}:{minor}")))
}

/// Set the readahead window of the filesystem mounted at `mountpoint` (its bdi's
/// `read_ahead_kb`, see [`mount_bdi`]), in bytes rounded down to KiB. Needs root.
pub fn set_mount_readahead(mountpoint: &Path, bytes: u64) -> Result<()> {
    let path = mount_bdi(mountpoint)?.join("read_ahead_kb");
    std::fs::write(&path, format!("{}", bytes / 1024)).map_err(|e| Error::io("write", &path, e))
}

/// Raise the blob mount's readahead window to `max_read` (the kernel caps the one negotiated
/// at INIT at its default, 128 KiB). Matters only when `direct_io` is off; failures are
/// harmless.
fn raise_bdi_readahead(mountpoint: &Path, max_read: u32) {
    if let Err(e) = set_mount_readahead(mountpoint, u64::from(max_read.max(128 << 10))) {
        tracing::debug!(error = %e, "could not raise the FUSE mount's readahead");
    }
}
