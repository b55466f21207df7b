//! Full-image writer: directory tree → EROFS image (layout in `docs/format.md`).
//!
//! Three passes: **scan** (lstat every entry in sorted breadth-first order, merge hard links,
//! read xattrs and symlink targets; metadata only), **layout** (choose compact/extended
//! inodes, inline tails, nids and data block addresses), **write** (stream file data into the
//! data area, fill the metadata area, superblock and checksum last).

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use zerocopy::IntoBytes;

use crate::data::{copy_file, prefetched, write_nonzero, DataFile, Prefetch, PREFETCH_THREADS};
use crate::ondisk::{
    self, encode_dev, ft, xattr_align, Dirent, InodeCompact, InodeExtended, SuperBlock, XattrEntry,
    XattrIbodyHeader, BLKSZ_BITS, BLOCK_SIZE, DATALAYOUT_CHUNK_BASED, DATALAYOUT_FLAT_INLINE,
    DATALAYOUT_FLAT_PLAIN, DEVT_SLOT_SIZE, EROFS_MAGIC, ISLOT_SIZE, I_VERSION_EXTENDED, NAME_LEN,
    SUPER_OFFSET, XATTR_PREFIXES,
};
use crate::source::{create_spool, overlay_xattr, OverlayXattr, Phase, ProgressGuard};
use crate::{io_err, Error, Progress, Result, Source, TarOptions};

/// Options for [`build_image`]. `Default` gives a deterministic, checksummed image.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BuildOptions {
    /// Base time (seconds, nanoseconds) for compact inodes: an inode whose mtime equals it
    /// can use the 32-byte form. `None`: the source root directory's mtime.
    pub epoch: Option<(i64, u32)>,
    /// Volume uuid (default zero, for reproducible images).
    pub uuid: [u8; 16],
    /// Volume name (at most 16 bytes).
    pub volume_name: Vec<u8>,
    /// Copy extended attributes (default true). Names outside the EROFS prefixes
    /// (`user.`, `trusted.`, `security.`, `lustre.`, POSIX ACLs) are an error.
    pub xattrs: bool,
    /// Set the superblock checksum feature (default true).
    pub checksum: bool,
    /// fsync the image before renaming it into place (default true).
    pub fsync: bool,
    /// Limits and the spool directory for [`Source::Tar`] input.
    pub tar: TarOptions,
    /// Counters updated while building (see [`Progress`]); `None`: no reporting.
    pub progress: Option<Progress>,
    /// Entries of a [`Source::Dir`] or [`Source::OverlayUpper`] tree left out, with everything
    /// under them: paths relative to the source root (`etc/hostname`, no leading `/`). The
    /// root itself cannot be left out. Ignored for tar input.
    pub exclude: Option<std::sync::Arc<std::collections::HashSet<PathBuf>>>,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self {
            epoch: None,
            uuid: [0; 16],
            volume_name: Vec::new(),
            xattrs: true,
            checksum: true,
            fsync: true,
            tar: TarOptions::default(),
            progress: None,
            exclude: None,
        }
    }
}

/// What [`build_image`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BuildStats {
    /// Distinct inodes (hard links count once).
    pub inodes: u64,
    /// Regular files (distinct inodes).
    pub files: u64,
    /// Directories, the root included.
    pub dirs: u64,
    /// Symbolic links.
    pub symlinks: u64,
    /// Device, fifo and socket inodes.
    pub special: u64,
    /// Extra names of hard-linked inodes (names − inodes, over non-directories).
    pub hardlinks: u64,
    /// Sum of regular file sizes.
    pub data_bytes: u64,
    /// Inodes written in the 64-byte extended form.
    pub extended_inodes: u64,
    /// Bytes in the image file.
    pub image_bytes: u64,
    /// Layers: regular files whose data is inline in the meta image (flat-inline, see
    /// [`crate::LayerOptions::inline_max`]) rather than in a blob. 0 for full images.
    pub inline_files: u64,
    /// Their bytes.
    pub inline_bytes: u64,
}

/// One xattr as (EROFS name index, name suffix, value).
pub(crate) type Xattr = (u8, Vec<u8>, Vec<u8>);

#[derive(Debug)]
pub(crate) enum Kind {
    Reg,
    Dir {
        children: Vec<(Vec<u8>, usize)>,
        parent: usize,
    },
    Symlink(Vec<u8>),
    Special(u8),
}

/// One inode of the tree being written.
#[derive(Debug)]
pub(crate) struct Node {
    /// The source path (directory input), or the archive path (tar input; for messages).
    pub(crate) path: PathBuf,
    pub(crate) kind: Kind,
    mode: u16,
    uid: u32,
    gid: u32,
    mtime: i64,
    mtime_nsec: u32,
    pub(crate) size: u64,
    rdev: u32,
    pub(crate) nlink: u32,
    /// (name index, suffix, value), sorted.
    xattrs: Vec<Xattr>,
    /// Tar input: where the file's data starts in the spool (4 KiB aligned).
    pub(crate) spool: Option<u64>,
    // Layout results.
    extended: bool,
    inline: bool,
    /// Layer mode: a regular file with data, written chunk-based into the blob.
    chunked: bool,
    pos: u64,
    blkaddr: u32,
}

impl Node {
    /// A node with one link and no layout yet (`spool`: where a tar entry's data starts).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        path: PathBuf,
        kind: Kind,
        mode: u16,
        (uid, gid): (u32, u32),
        (mtime, mtime_nsec): (i64, u32),
        size: u64,
        rdev: u32,
        xattrs: Vec<Xattr>,
        spool: Option<u64>,
    ) -> Self {
        Node {
            path,
            kind,
            mode,
            uid,
            gid,
            mtime,
            mtime_nsec,
            size,
            rdev,
            nlink: 1,
            xattrs,
            spool,
            extended: false,
            inline: false,
            chunked: false,
            pos: 0,
            blkaddr: 0,
        }
    }

    fn file_type(&self) -> u8 {
        match &self.kind {
            Kind::Reg => ft::REG,
            Kind::Dir { .. } => ft::DIR,
            Kind::Symlink(_) => ft::LNK,
            Kind::Special(t) => *t,
        }
    }

    fn inode_size(&self) -> u64 {
        if self.extended {
            64
        } else {
            32
        }
    }

    fn xattr_size(&self) -> u64 {
        if self.xattrs.is_empty() {
            0
        } else {
            12 + self
                .xattrs
                .iter()
                .map(|(_, n, v)| xattr_align(4 + n.len() + v.len()) as u64)
                .sum::<u64>()
        }
    }

    fn has_data(&self) -> bool {
        !matches!(self.kind, Kind::Special(_))
    }
}

/// Builds an EROFS image of the tree at `src_dir` into `out` (replaced atomically).
///
/// Regular files, directories, symlinks, hard links, devices, fifos and sockets are kept
/// with their mode (incl. setuid/setgid/sticky), uid, gid, mtime (ns) and xattrs.
/// The same as [`build_image_from`] with [`Source::Dir`].
pub fn build_image(src_dir: &Path, out: &Path, opts: &BuildOptions) -> Result<BuildStats> {
    build(Source::Dir(src_dir.to_path_buf()), out, opts, None)
}

/// Builds a full EROFS image of `source` (a directory, an overlay upper or a layer tar
/// stream, see [`Source`]) into `out` (replaced atomically; on error nothing is left).
pub fn build_image_from(source: Source, out: &Path, opts: &BuildOptions) -> Result<BuildStats> {
    build(source, out, opts, None)
}

/// The directory temporary files for `out` go to.
pub(crate) fn dir_of(out: &Path) -> PathBuf {
    match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The temporary name `out` is written under before the rename.
pub(crate) fn tmp_path(out: &Path) -> PathBuf {
    let file_name = out.file_name().unwrap_or(OsStr::new("image"));
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    out.with_file_name(tmp_name)
}

/// Builds the image at `out`; in layer mode (`blob` given) regular file data goes to the
/// blob (chunk-based inodes, device 1) and the image holds metadata only.
pub(crate) fn build(
    source: Source,
    out: &Path,
    opts: &BuildOptions,
    blob: Option<&mut crate::layer::BlobWriter>,
) -> Result<BuildStats> {
    if opts.volume_name.len() > 16 {
        return Err(Error::UnsupportedInput {
            path: out.to_path_buf(),
            reason: "volume name longer than 16 bytes".into(),
        });
    }
    let progress = ProgressGuard(opts.progress.as_ref());
    progress.phase(Phase::Scan);
    let (mut nodes, spool) = match source {
        Source::Dir(p) => (scan(&p, opts, false, &progress)?, None),
        Source::OverlayUpper(p) => (scan(&p, opts, true, &progress)?, None),
        Source::Tar(r) => {
            let dir = opts.tar.temp_dir.clone().unwrap_or_else(|| dir_of(out));
            let spool = create_spool(&dir)?;
            (
                crate::tar::read_tar(r, &spool, opts, &progress)?,
                Some(spool),
            )
        }
        Source::TarStack(layers) => {
            let dir = opts.tar.temp_dir.clone().unwrap_or_else(|| dir_of(out));
            let spool = create_spool(&dir)?;
            (
                crate::merge::read_tar_stack(layers, &spool, opts, &progress)?,
                Some(spool),
            )
        }
    };
    let (epoch, epoch_nsec) = opts.epoch.unwrap_or((nodes[0].mtime, nodes[0].mtime_nsec));
    let device_slots = blob.as_ref().map_or(0, |b| b.device_slots());
    let inline = blob
        .as_ref()
        .map_or((0, None), |b| (b.inline_max, b.inline_budget));
    let total_blocks = layout(&mut nodes, epoch, epoch_nsec, device_slots, inline)?;
    let regular = nodes.iter().filter(|n| matches!(n.kind, Kind::Reg));
    let (files, bytes) = regular.fold((0, 0), |(f, b), n| (f + 1, b + n.size));
    progress.totals(files, bytes);
    progress.phase(Phase::Write);

    let tmp = tmp_path(out);
    let w = Writing {
        nodes: &nodes,
        spool: spool.as_ref(),
        progress: &progress,
    };
    let result = write_image(&w, &tmp, opts, epoch, epoch_nsec, total_blocks, blob);
    let stats = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = std::fs::rename(&tmp, out) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(format!(
            "rename {} to {}",
            tmp.display(),
            out.display()
        ))(e));
    }
    Ok(stats)
}

// ---------------------------------------------------------------------------------------
// Scan
// ---------------------------------------------------------------------------------------

fn scan(
    root: &Path,
    opts: &BuildOptions,
    upper: bool,
    progress: &ProgressGuard<'_>,
) -> Result<Vec<Node>> {
    let meta =
        std::fs::symlink_metadata(root).map_err(io_err(format!("lstat {}", root.display())))?;
    if !meta.is_dir() {
        return Err(Error::UnsupportedInput {
            path: root.to_path_buf(),
            reason: "the source root is not a directory".into(),
        });
    }
    let mut nodes = vec![new_node(root, &meta, opts, upper)?];
    nodes[0].kind = Kind::Dir {
        children: Vec::new(),
        parent: 0,
    };
    let mut links: HashMap<(u64, u64), usize> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([0usize]);
    while let Some(dir) = queue.pop_front() {
        let dir_path = nodes[dir].path.clone();
        let mut names: Vec<std::ffi::OsString> = Vec::new();
        let rd = std::fs::read_dir(&dir_path)
            .map_err(io_err(format!("readdir {}", dir_path.display())))?;
        for entry in rd {
            let entry = entry.map_err(io_err(format!("readdir {}", dir_path.display())))?;
            names.push(entry.file_name());
        }
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        let mut children = Vec::with_capacity(names.len());
        let mut subdirs = 0u32;
        for name in names {
            let path = dir_path.join(&name);
            if let (Some(ex), Ok(rel)) = (&opts.exclude, path.strip_prefix(root)) {
                if ex.contains(rel) {
                    continue;
                }
            }
            if name.len() > NAME_LEN {
                return Err(Error::UnsupportedInput {
                    path,
                    reason: "name longer than 255 bytes".into(),
                });
            }
            let meta = std::fs::symlink_metadata(&path)
                .map_err(io_err(format!("lstat {}", path.display())))?;
            let key = (meta.dev(), meta.ino());
            if !meta.is_dir() && meta.nlink() > 1 {
                if let Some(&idx) = links.get(&key) {
                    nodes[idx].nlink = nodes[idx]
                        .nlink
                        .checked_add(1)
                        .ok_or_else(|| Error::TooLarge("link count".into()))?;
                    children.push((name.as_bytes().to_vec(), idx));
                    continue;
                }
            }
            progress.scanned(1, if meta.is_file() { meta.len() } else { 0 });
            let mut node = new_node(&path, &meta, opts, upper)?;
            let idx = nodes.len();
            if meta.is_dir() {
                node.kind = Kind::Dir {
                    children: Vec::new(),
                    parent: dir,
                };
                subdirs = subdirs
                    .checked_add(1)
                    .ok_or_else(|| Error::TooLarge("subdirectories".into()))?;
                queue.push_back(idx);
            } else if meta.nlink() > 1 {
                links.insert(key, idx);
            }
            nodes.push(node);
            children.push((name.as_bytes().to_vec(), idx));
        }
        nodes[dir].nlink = 2u32.saturating_add(subdirs);
        if let Kind::Dir { children: c, .. } = &mut nodes[dir].kind {
            *c = children;
        }
    }
    Ok(nodes)
}

fn new_node(
    path: &Path,
    meta: &std::fs::Metadata,
    opts: &BuildOptions,
    upper: bool,
) -> Result<Node> {
    let ftype = meta.file_type();
    let unsupported = |reason: &str| Error::UnsupportedInput {
        path: path.to_path_buf(),
        reason: reason.into(),
    };
    let mut size = 0;
    let mut rdev = 0;
    let kind = if ftype.is_dir() {
        Kind::Dir {
            children: Vec::new(),
            parent: 0,
        }
    } else if ftype.is_file() {
        size = meta.len();
        Kind::Reg
    } else if ftype.is_symlink() {
        let target =
            std::fs::read_link(path).map_err(io_err(format!("readlink {}", path.display())))?;
        let target = target.into_os_string().into_vec();
        if target.is_empty() || target.len() >= BLOCK_SIZE as usize {
            return Err(unsupported(
                "symlink target empty or longer than 4095 bytes",
            ));
        }
        size = target.len() as u64;
        Kind::Symlink(target)
    } else if ftype.is_char_device() || ftype.is_block_device() {
        let dev = meta.rdev();
        let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
        if major > 0xfff || minor > 0xf_ffff {
            return Err(unsupported("device number does not fit 32 bits"));
        }
        rdev = encode_dev(major, minor);
        Kind::Special(if ftype.is_char_device() {
            ft::CHR
        } else {
            ft::BLK
        })
    } else if ftype.is_fifo() {
        Kind::Special(ft::FIFO)
    } else if ftype.is_socket() {
        Kind::Special(ft::SOCK)
    } else {
        return Err(unsupported("unknown file type"));
    };
    let mode = u16::try_from(meta.mode()).map_err(|_| unsupported("mode does not fit 16 bits"))?;
    let xattrs = if opts.xattrs {
        read_xattrs(path, upper)?
    } else {
        Vec::new()
    };
    let mtime_nsec = u32::try_from(meta.mtime_nsec()).map_err(|_| unsupported("bad mtime nsec"))?;
    Ok(Node::new(
        path.to_path_buf(),
        kind,
        mode,
        (meta.uid(), meta.gid()),
        (meta.mtime(), mtime_nsec),
        size,
        rdev,
        xattrs,
        None,
    ))
}

trait IntoVec {
    fn into_vec(self) -> Vec<u8>;
}
impl IntoVec for std::ffi::OsString {
    fn into_vec(self) -> Vec<u8> {
        std::os::unix::ffi::OsStringExt::into_vec(self)
    }
}

fn read_xattrs(path: &Path, upper: bool) -> Result<Vec<Xattr>> {
    let ctx = || format!("list xattrs of {}", path.display());
    let names = loop {
        let n = match rustix::fs::llistxattr_query(path) {
            Ok(n) => n,
            Err(e) if e == rustix::io::Errno::NOTSUP => return Ok(Vec::new()),
            Err(e) => return Err(io_err(ctx())(e.into())),
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; n];
        match rustix::fs::llistxattr(path, &mut buf[..]) {
            Ok(m) => {
                buf.truncate(m);
                break buf;
            }
            Err(e) if e == rustix::io::Errno::RANGE => continue,
            Err(e) => return Err(io_err(ctx())(e.into())),
        }
    };
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        if upper {
            match overlay_xattr(name) {
                OverlayXattr::Keep => {}
                OverlayXattr::Drop => continue,
                OverlayXattr::Refuse => {
                    return Err(Error::UnsupportedInput {
                        path: path.to_path_buf(),
                        reason: format!(
                            "overlayfs xattr {:?}: the upper does not hold the data or \
                             directory contents (mount the overlay with redirect_dir=off \
                             and metacopy=off)",
                            String::from_utf8_lossy(name)
                        ),
                    })
                }
            }
        }
        let value = read_xattr_value(path, name)?;
        out.push(make_xattr(path, name, value)?);
    }
    out.sort();
    Ok(out)
}

/// Checks one xattr (full name) and splits it into the writer's form.
pub(crate) fn make_xattr(path: &Path, name: &[u8], value: Vec<u8>) -> Result<Xattr> {
    let Some((index, suffix)) = split_xattr_name(name) else {
        return Err(Error::UnsupportedInput {
            path: path.to_path_buf(),
            reason: format!(
                "xattr {:?} has no EROFS name index",
                String::from_utf8_lossy(name)
            ),
        });
    };
    if value.len() > usize::from(u16::MAX) || suffix.len() > NAME_LEN {
        return Err(Error::UnsupportedInput {
            path: path.to_path_buf(),
            reason: format!("xattr {:?} too large", String::from_utf8_lossy(name)),
        });
    }
    Ok((index, suffix.to_vec(), value))
}

fn read_xattr_value(path: &Path, name: &[u8]) -> Result<Vec<u8>> {
    let ctx = || {
        format!(
            "get xattr {:?} of {}",
            String::from_utf8_lossy(name),
            path.display()
        )
    };
    let cname = std::ffi::OsStr::from_bytes(name);
    loop {
        let n = rustix::fs::lgetxattr_query(path, cname).map_err(|e| io_err(ctx())(e.into()))?;
        let mut buf = vec![0u8; n];
        match rustix::fs::lgetxattr(path, cname, &mut buf[..]) {
            Ok(m) => {
                buf.truncate(m);
                return Ok(buf);
            }
            Err(e) if e == rustix::io::Errno::RANGE => continue,
            Err(e) => return Err(io_err(ctx())(e.into())),
        }
    }
}

/// Splits a full xattr name into (EROFS name index, suffix).
pub(crate) fn split_xattr_name(name: &[u8]) -> Option<(u8, &[u8])> {
    for (index, prefix, whole) in XATTR_PREFIXES {
        let p = prefix.as_bytes();
        if whole {
            if name == p {
                return Some((index, &[]));
            }
        } else if name.len() > p.len() && name.starts_with(p) {
            return Some((index, &name[p.len()..]));
        }
    }
    None
}

// ---------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------

/// The entries of a directory as (name, node) including `.` and `..`, sorted by name bytes.
fn dir_entries(nodes: &[Node], idx: usize) -> Vec<(&[u8], usize)> {
    let Kind::Dir { children, parent } = &nodes[idx].kind else {
        return Vec::new();
    };
    let mut v: Vec<(&[u8], usize)> = Vec::with_capacity(children.len() + 2);
    v.push((b".", idx));
    v.push((b"..", *parent));
    v.extend(children.iter().map(|(n, i)| (n.as_slice(), *i)));
    v.sort_by(|a, b| a.0.cmp(b.0));
    v
}

/// Serialises directory data: blocks of dirents + names (see `docs/format.md`).
/// `nid_of` maps a node index to its nid (anything during layout: sizes do not depend on it).
fn pack_dir(nodes: &[Node], entries: &[(&[u8], usize)], nid_of: impl Fn(usize) -> u64) -> Vec<u8> {
    let bs = BLOCK_SIZE as usize;
    let mut out = Vec::new();
    let mut i = 0;
    while i < entries.len() {
        // Take entries greedily while they fit one block.
        let mut used = 0;
        let mut j = i;
        while j < entries.len() && used + 12 + entries[j].0.len() <= bs {
            used += 12 + entries[j].0.len();
            j += 1;
        }
        let block_start = out.len();
        let mut nameoff = 12 * (j - i);
        for &(name, node) in &entries[i..j] {
            let d = Dirent {
                nid: nid_of(node).into(),
                nameoff: (nameoff as u16).into(),
                file_type: nodes[node].file_type(),
                reserved: 0,
            };
            out.extend_from_slice(d.as_bytes());
            nameoff += name.len();
        }
        for &(name, _) in &entries[i..j] {
            out.extend_from_slice(name);
        }
        if j < entries.len() {
            // Not the last block: pad with zeros to the block size.
            out.resize(block_start + bs, 0);
        }
        i = j;
    }
    out
}

fn dir_size(nodes: &[Node], idx: usize) -> u64 {
    // Sizes do not depend on nids: pack with placeholders (the same code writes the data).
    pack_dir(nodes, &dir_entries(nodes, idx), |_| 0).len() as u64
}

/// Places inode records (inode + xattrs + inline tail) in the metadata area: 32-byte
/// aligned, and a record of at most one block never crosses a block boundary. When a record
/// does not fit what is left of the current block, that remainder is kept (up to
/// `MAX_OPEN` of them, oldest dropped first) and later records that fit go there first-fit,
/// instead of leaving the gap as padding. Deterministic: a pure function of the record
/// sizes in order.
#[derive(Debug)]
struct MetaAllocator {
    /// End of the space handed out so far.
    frontier: u64,
    /// Cursors into partially used blocks below the frontier block, oldest first.
    open: Vec<u64>,
}

impl MetaAllocator {
    const MAX_OPEN: usize = 64;

    fn new(start: u64) -> Self {
        Self {
            frontier: start,
            open: Vec::new(),
        }
    }

    fn block_end(pos: u64) -> u64 {
        (pos / BLOCK_SIZE + 1) * BLOCK_SIZE
    }

    fn place(&mut self, rec: u64) -> u64 {
        if rec <= BLOCK_SIZE {
            let fits = |c: u64| {
                let p = c.next_multiple_of(ISLOT_SIZE);
                p + rec <= Self::block_end(c)
            };
            if let Some(i) = self.open.iter().position(|&c| fits(c)) {
                let p = self.open[i].next_multiple_of(ISLOT_SIZE);
                let end = p + rec;
                if Self::block_end(self.open[i]) - end.next_multiple_of(ISLOT_SIZE) >= ISLOT_SIZE
                    && end % BLOCK_SIZE != 0
                {
                    self.open[i] = end;
                } else {
                    self.open.remove(i);
                }
                return p;
            }
        }
        let mut p = self.frontier.next_multiple_of(ISLOT_SIZE);
        if rec <= BLOCK_SIZE && p % BLOCK_SIZE + rec > BLOCK_SIZE {
            // Keep the rest of this block for smaller records.
            if p % BLOCK_SIZE != 0 && BLOCK_SIZE - p % BLOCK_SIZE >= ISLOT_SIZE {
                if self.open.len() == Self::MAX_OPEN {
                    self.open.remove(0);
                }
                self.open.push(p);
            }
            p = p.next_multiple_of(BLOCK_SIZE);
        }
        self.frontier = p + rec;
        p
    }

    fn end(&self) -> u64 {
        self.frontier
    }
}

/// Assigns inode forms, inline tails, positions and block addresses; returns total blocks.
/// Layers (`device_slots > 0`): the regular files [`inline_files`] picks with `inline`
/// (`inline_max`, the budget: [`crate::LayerOptions`]) are flat-inline in the meta image;
/// every other regular file with data is chunk-based.
fn layout(
    nodes: &mut [Node],
    epoch: i64,
    epoch_nsec: u32,
    device_slots: usize,
    inline: (u64, Option<u64>),
) -> Result<u32> {
    for i in 0..nodes.len() {
        if matches!(nodes[i].kind, Kind::Dir { .. }) {
            nodes[i].size = dir_size(nodes, i);
        }
    }
    // Inode forms first: which files fit inline depends on their record's head.
    for n in nodes.iter_mut() {
        n.extended = n.uid > 0xffff
            || n.gid > 0xffff
            || n.size > u64::from(u32::MAX)
            || n.nlink > 0xffff
            || n.mtime != epoch
            || n.mtime_nsec != epoch_nsec;
        if n.xattr_size() > ondisk::xattr_ibody_size(u16::MAX) {
            return Err(Error::UnsupportedInput {
                path: n.path.clone(),
                reason: "xattrs too large for one inode".into(),
            });
        }
    }
    // Full images (no blob) pass `inline_max` 0: nothing is picked.
    let inline_file = inline_files(nodes, inline.0, inline.1);
    // Layer images keep their device table right after the superblock (one slot, or one
    // more per blob a chunk dictionary may make it point into).
    let meta_start = SUPER_OFFSET + 128 + device_slots as u64 * DEVT_SLOT_SIZE;
    let mut slots = MetaAllocator::new(meta_start);
    for (n, inline_file) in nodes.iter_mut().zip(inline_file) {
        let head = n.inode_size() + n.xattr_size();
        n.chunked = device_slots > 0 && matches!(n.kind, Kind::Reg) && n.size > 0 && !inline_file;
        if n.chunked {
            // Chunk indexes follow the inode and xattrs, 8-byte aligned.
            let chunks = n.size.div_ceil(crate::layer::CHUNK_SIZE);
            n.pos = slots.place(head.next_multiple_of(8) + 8 * chunks);
            continue;
        }
        let tail = if n.has_data() { n.size % BLOCK_SIZE } else { 0 };
        n.inline = tail != 0 && head + tail <= BLOCK_SIZE;
        let rec = head + if n.inline { tail } else { 0 };
        n.pos = slots.place(rec);
    }
    if nodes[0].pos / ISLOT_SIZE > u64::from(u16::MAX) {
        return Err(Error::TooLarge(
            "root inode does not fit a 16-bit nid".into(),
        ));
    }
    let mut next_block = slots.end().div_ceil(BLOCK_SIZE);
    for n in nodes.iter_mut() {
        if !n.has_data() || n.chunked {
            continue;
        }
        let blocks = if n.inline {
            n.size / BLOCK_SIZE
        } else {
            n.size.div_ceil(BLOCK_SIZE)
        };
        if blocks > 0 {
            n.blkaddr = u32::try_from(next_block)
                .map_err(|_| Error::TooLarge("more than 2^32 blocks".into()))?;
            next_block += blocks;
        }
    }
    u32::try_from(next_block).map_err(|_| Error::TooLarge("more than 2^32 blocks".into()))
}

/// A layer's regular files to store inline in the meta image: those of 1..=`max` bytes whose
/// inode, xattrs and data fit one block (`size < BLOCK_SIZE`, so no data blocks), smallest
/// first (then in node order: deterministic), while their bytes add up to at most `budget`
/// (`None`: [`crate::layer::default_inline_budget`] of the files' bytes). Their data then
/// comes with the inode's block, from the node's local meta image, with no blob read.
fn inline_files(nodes: &[Node], max: u64, budget: Option<u64>) -> Vec<bool> {
    let mut out = vec![false; nodes.len()];
    if max == 0 {
        return out;
    }
    let regular = nodes.iter().filter(|n| matches!(n.kind, Kind::Reg));
    let budget = budget
        .unwrap_or_else(|| crate::layer::default_inline_budget(regular.map(|n| n.size).sum()));
    let mut candidates: Vec<(u64, usize)> = (nodes.iter().enumerate())
        .filter(|(_, n)| {
            matches!(n.kind, Kind::Reg)
                && (1..=max).contains(&n.size)
                && n.size < BLOCK_SIZE
                && n.inode_size() + n.xattr_size() + n.size <= BLOCK_SIZE
        })
        .map(|(i, n)| (n.size, i))
        .collect();
    candidates.sort_unstable();
    let mut used = 0u64;
    for (size, i) in candidates {
        used += size;
        if used > budget {
            break;
        }
        out[i] = true;
    }
    out
}

// ---------------------------------------------------------------------------------------
// Write
// ---------------------------------------------------------------------------------------

/// What the write pass reads from.
pub(crate) struct Writing<'a> {
    pub(crate) nodes: &'a [Node],
    /// The tar spool, when the source was a tar stream.
    pub(crate) spool: Option<&'a File>,
    pub(crate) progress: &'a ProgressGuard<'a>,
}

fn write_image(
    w: &Writing<'_>,
    tmp: &Path,
    opts: &BuildOptions,
    epoch: i64,
    epoch_nsec: u32,
    total_blocks: u32,
    mut blob: Option<&mut crate::layer::BlobWriter>,
) -> Result<BuildStats> {
    let nodes = w.nodes;
    let ctx = || format!("write {}", tmp.display());
    let out = OpenOptions::new()
        .write(true)
        .read(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(tmp)
        .map_err(io_err(ctx()))?;
    // One record (inode + xattrs + inline tail) at a time; gaps stay zero (never written).
    let mut rec: Vec<u8> = Vec::with_capacity(BLOCK_SIZE as usize);
    let nid_of = |i: usize| nodes[i].pos / ISLOT_SIZE;
    let mut stats = BuildStats::default();
    let mut copy_buf = vec![0u8; 1 << 20];

    // Files laid out first (a layer's `LayerOptions::first`), in that order.
    let early = match blob.as_deref() {
        Some(b) if !b.first.is_empty() => first_nodes(nodes, &b.first),
        _ => Vec::new(),
    };
    // Small regular files are read ahead by a few threads (cold small-file reads are
    // latency-bound); the writer consumes them in the order it writes them (the early files,
    // then node order), so the image is unchanged.
    let is_early: HashSet<usize> = early.iter().copied().collect();
    let jobs: Vec<usize> = early
        .iter()
        .copied()
        .filter(|&i| prefetched(&nodes[i]))
        .chain(
            nodes
                .iter()
                .enumerate()
                .filter(|(i, n)| prefetched(n) && !is_early.contains(i))
                .map(|(i, _)| i),
        )
        .collect();
    let prefetch = Prefetch::new(nodes, &jobs);
    std::thread::scope(|s| {
        let _stop = prefetch.stop_guard();
        for _ in 0..PREFETCH_THREADS.min(jobs.len()) {
            s.spawn(|| prefetch.reader());
        }
        write_nodes(
            w,
            &out,
            tmp,
            &mut blob,
            &mut stats,
            &mut rec,
            &mut copy_buf,
            &prefetch,
            &early,
        )
    })?;
    stats.inodes = nodes.len() as u64;
    w.progress.phase(Phase::Finish);

    let mut volume_name = [0u8; 16];
    volume_name[..opts.volume_name.len()].copy_from_slice(&opts.volume_name);
    let mut sb = SuperBlock {
        magic: EROFS_MAGIC.into(),
        feature_compat: if opts.checksum {
            ondisk::FEATURE_COMPAT_SB_CHKSUM
        } else {
            0
        }
        .into(),
        blkszbits: BLKSZ_BITS,
        root_nid: (nid_of(0) as u16).into(),
        inos: stats.inodes.into(),
        build_time: (epoch as u64).into(),
        build_time_nsec: epoch_nsec.into(),
        blocks: total_blocks.into(),
        uuid: opts.uuid,
        volume_name,
        ..Default::default()
    };
    stats.image_bytes = u64::from(total_blocks) * BLOCK_SIZE;
    out.set_len(stats.image_bytes).map_err(io_err(ctx()))?;
    if let Some(blob) = blob {
        // The blob is complete: its size and digest (the default tag) are known now.
        let slots = blob.finish(total_blocks)?;
        sb.feature_incompat =
            (ondisk::FEATURE_INCOMPAT_CHUNKED_FILE | ondisk::FEATURE_INCOMPAT_DEVICE_TABLE).into();
        sb.extra_devices = (slots.len() as u16).into();
        sb.devt_slotoff = (((SUPER_OFFSET + 128) / DEVT_SLOT_SIZE) as u16).into();
        for (i, slot) in slots.iter().enumerate() {
            out.write_all_at(
                slot.as_bytes(),
                SUPER_OFFSET + 128 + i as u64 * DEVT_SLOT_SIZE,
            )
            .map_err(io_err(ctx()))?;
        }
    }
    // The checksum covers the rest of block 0 (first inodes included): read it back.
    let mut block0 = vec![0u8; (BLOCK_SIZE - SUPER_OFFSET) as usize];
    out.read_exact_at(&mut block0, SUPER_OFFSET)
        .map_err(io_err(ctx()))?;
    block0[..128].copy_from_slice(sb.as_bytes());
    if opts.checksum {
        sb.checksum = ondisk::sb_crc32c(&block0).into();
    }
    out.write_all_at(sb.as_bytes(), SUPER_OFFSET)
        .map_err(io_err(ctx()))?;
    if opts.fsync {
        out.sync_all().map_err(io_err(ctx()))?;
    }
    Ok(stats)
}

/// The per-node loop of [`write_image`]: inodes, xattrs, inline tails and data.
#[allow(clippy::too_many_arguments)]
fn write_nodes(
    w: &Writing<'_>,
    out: &File,
    tmp: &Path,
    blob: &mut Option<&mut crate::layer::BlobWriter>,
    stats: &mut BuildStats,
    rec: &mut Vec<u8>,
    copy_buf: &mut [u8],
    prefetch: &Prefetch<'_>,
    early: &[usize],
) -> Result<()> {
    let nodes = w.nodes;
    // The early files' data first, their tails packed together; their chunk indexes are
    // kept for their inodes.
    let mut early_idx: HashMap<usize, Vec<u8>> = HashMap::new();
    if let (Some(b), false) = (blob.as_deref_mut(), early.is_empty()) {
        b.begin_dir(
            early
                .iter()
                .map(|&i| crate::layer::tail_blocks(nodes[i].size))
                .sum(),
        );
        for &i in early {
            let mut idx = Vec::new();
            if prefetched(&nodes[i]) {
                b.add_bytes(&prefetch.take(i)?, &mut idx, w.progress)?;
            } else {
                b.add_file(&DataFile::open(&nodes[i], w.spool)?, &mut idx, w.progress)?;
            }
            early_idx.insert(i, idx);
        }
    }
    let ctx = || format!("write {}", tmp.display());
    let nid_of = |i: usize| nodes[i].pos / ISLOT_SIZE;
    // Each chunked file's directory (a hard link's first), and each directory's tail blocks:
    // the blob packs a directory's tails together (`BlobWriter::begin_dir`).
    let mut dir_of = vec![usize::MAX; if blob.is_some() { nodes.len() } else { 0 }];
    let mut dir_tails = vec![0u64; dir_of.len()];
    if blob.is_some() {
        for (d, n) in nodes.iter().enumerate() {
            if let Kind::Dir { children, .. } = &n.kind {
                for &(_, c) in children {
                    let child = &nodes[c];
                    if child.chunked && dir_of[c] == usize::MAX && !early_idx.contains_key(&c) {
                        dir_of[c] = d;
                        dir_tails[d] += crate::layer::tail_blocks(child.size);
                    }
                }
            }
        }
    }
    let mut current_dir = usize::MAX;
    for (i, n) in nodes.iter().enumerate() {
        let layout_bits = if n.chunked {
            DATALAYOUT_CHUNK_BASED
        } else if n.inline {
            DATALAYOUT_FLAT_INLINE
        } else {
            DATALAYOUT_FLAT_PLAIN
        };
        let i_format = (layout_bits << 1) | if n.extended { I_VERSION_EXTENDED } else { 0 };
        let icount = if n.xattrs.is_empty() {
            0
        } else {
            (1 + (n.xattr_size() - 12) / 4) as u16
        };
        let i_u = if matches!(n.kind, Kind::Special(ft::CHR | ft::BLK)) {
            n.rdev
        } else if n.chunked {
            u32::from(crate::layer::CHUNK_FORMAT)
        } else {
            n.blkaddr
        };
        let ino = u32::try_from(i + 1).unwrap_or(u32::MAX);
        rec.clear();
        if n.extended {
            let inode = InodeExtended {
                i_format: i_format.into(),
                i_xattr_icount: icount.into(),
                i_mode: n.mode.into(),
                i_size: n.size.into(),
                i_u: i_u.into(),
                i_ino: ino.into(),
                i_uid: n.uid.into(),
                i_gid: n.gid.into(),
                i_mtime: (n.mtime as u64).into(),
                i_mtime_nsec: n.mtime_nsec.into(),
                i_nlink: n.nlink.into(),
                ..Default::default()
            };
            rec.extend_from_slice(inode.as_bytes());
            stats.extended_inodes += 1;
        } else {
            let inode = InodeCompact {
                i_format: i_format.into(),
                i_xattr_icount: icount.into(),
                i_mode: n.mode.into(),
                i_nlink: (n.nlink as u16).into(),
                i_size: (n.size as u32).into(),
                i_u: i_u.into(),
                i_ino: ino.into(),
                i_uid: (n.uid as u16).into(),
                i_gid: (n.gid as u16).into(),
                ..Default::default()
            };
            rec.extend_from_slice(inode.as_bytes());
        }
        if !n.xattrs.is_empty() {
            rec.extend_from_slice(XattrIbodyHeader::default().as_bytes());
            for (index, suffix, value) in &n.xattrs {
                let e = XattrEntry {
                    e_name_len: suffix.len() as u8,
                    e_name_index: *index,
                    e_value_size: (value.len() as u16).into(),
                };
                let start = rec.len();
                rec.extend_from_slice(e.as_bytes());
                rec.extend_from_slice(suffix);
                rec.extend_from_slice(value);
                rec.resize(start + xattr_align(4 + suffix.len() + value.len()), 0);
            }
        }
        let tail_len = if n.inline {
            (n.size % BLOCK_SIZE) as usize
        } else {
            0
        };
        let tail_start = rec.len();
        rec.resize(tail_start + tail_len, 0);
        let tail_slot = tail_start..;
        let data_off = u64::from(n.blkaddr) * BLOCK_SIZE;
        let in_blocks = n.size - tail_len as u64;
        if !matches!(n.kind, Kind::Dir { .. }) {
            stats.hardlinks += u64::from(n.nlink.saturating_sub(1));
        }
        match &n.kind {
            Kind::Reg if n.chunked => {
                stats.files += 1;
                stats.data_bytes += n.size;
                let blob = blob
                    .as_deref_mut()
                    .ok_or_else(|| Error::Corrupt("chunked inode without a blob".into()))?;
                if let Some(idx) = early_idx.remove(&i) {
                    rec.resize(rec.len().next_multiple_of(8), 0);
                    rec.extend_from_slice(&idx);
                    w.progress.wrote(1, 0);
                } else {
                    if let Some(&d) = dir_of.get(i).filter(|&&d| d != current_dir) {
                        current_dir = d;
                        blob.begin_dir(dir_tails.get(d).copied().unwrap_or(0));
                    }
                    rec.resize(rec.len().next_multiple_of(8), 0);
                    if prefetched(n) {
                        blob.add_bytes(&prefetch.take(i)?, rec, w.progress)?;
                    } else {
                        let data = DataFile::open(n, w.spool)?;
                        blob.add_file(&data, rec, w.progress)?;
                    }
                    w.progress.wrote(1, 0);
                }
            }
            Kind::Reg => {
                stats.files += 1;
                stats.data_bytes += n.size;
                if blob.is_some() && n.size > 0 {
                    stats.inline_files += 1;
                    stats.inline_bytes += n.size;
                }
                if prefetched(n) {
                    let data = prefetch.take(i)?;
                    let split = in_blocks as usize;
                    write_nonzero(out, &data[..split], data_off).map_err(io_err(ctx()))?;
                    rec[tail_slot].copy_from_slice(&data[split..]);
                    w.progress.wrote(1, n.size);
                } else {
                    let data = DataFile::open(n, w.spool)?;
                    copy_file(
                        &data,
                        out,
                        data_off,
                        in_blocks,
                        &mut rec[tail_slot],
                        copy_buf,
                        tmp,
                    )?;
                    w.progress.wrote(1, n.size);
                }
            }
            Kind::Dir { .. } => {
                stats.dirs += 1;
                let data = pack_dir(nodes, &dir_entries(nodes, i), nid_of);
                debug_assert_eq!(data.len() as u64, n.size);
                let split = in_blocks as usize;
                out.write_all_at(&data[..split], data_off)
                    .map_err(io_err(ctx()))?;
                rec[tail_slot].copy_from_slice(&data[split..]);
            }
            Kind::Symlink(target) => {
                stats.symlinks += 1;
                if n.inline {
                    rec[tail_slot].copy_from_slice(target);
                } else {
                    out.write_all_at(target, data_off).map_err(io_err(ctx()))?;
                }
            }
            Kind::Special(_) => {
                stats.special += 1;
            }
        }
        debug_assert!(
            n.chunked || rec.len() as u64 == n.inode_size() + n.xattr_size() + tail_len as u64
        );
        out.write_all_at(rec, n.pos).map_err(io_err(ctx()))?;
    }
    Ok(())
}

/// The chunk-based regular files named by `paths` (relative to the root, `a/b/c`; a leading
/// `/` is ignored), each once, in that order; paths that name nothing of the kind are skipped.
fn first_nodes(nodes: &[Node], paths: &[PathBuf]) -> Vec<usize> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    'paths: for p in paths {
        let mut at = 0usize;
        for comp in p.components() {
            let std::path::Component::Normal(name) = comp else {
                continue;
            };
            let Some(Kind::Dir { children, .. }) = nodes.get(at).map(|n| &n.kind) else {
                continue 'paths;
            };
            match children
                .iter()
                .find(|(n, _)| n.as_slice() == name.as_bytes())
            {
                Some(&(_, c)) => at = c,
                None => continue 'paths,
            }
        }
        if nodes[at].chunked && seen.insert(at) {
            out.push(at);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_allocator_never_overlaps_or_crosses_blocks() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut a = MetaAllocator::new(SUPER_OFFSET + 128);
        let mut placed: Vec<(u64, u64)> = Vec::new();
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let rec = match x % 10 {
                0 => 32 + x % 9000,        // may cross: big xattrs, no tail
                1..=4 => 32 + x % 64,      // bare inodes
                _ => 64 + (x >> 8) % 4033, // inode + tail
            };
            let p = a.place(rec);
            assert_eq!(p % ISLOT_SIZE, 0);
            assert!(p >= SUPER_OFFSET + 128);
            if rec <= BLOCK_SIZE {
                assert!(
                    p % BLOCK_SIZE + rec <= BLOCK_SIZE,
                    "{p} + {rec} crosses a block"
                );
            }
            placed.push((p, p + rec));
        }
        placed.sort();
        for w in placed.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlap {:?} {:?}", w[0], w[1]);
        }
        assert!(placed.last().unwrap().1 <= a.end());
    }

    #[test]
    fn xattr_names_map_to_indexes() {
        assert_eq!(split_xattr_name(b"user.foo"), Some((1, &b"foo"[..])));
        assert_eq!(
            split_xattr_name(b"security.capability"),
            Some((6, &b"capability"[..]))
        );
        assert_eq!(
            split_xattr_name(b"system.posix_acl_access"),
            Some((2, &b""[..]))
        );
        assert_eq!(
            split_xattr_name(b"trusted.overlay.opaque"),
            Some((4, &b"overlay.opaque"[..]))
        );
        assert_eq!(split_xattr_name(b"user."), None);
        assert_eq!(split_xattr_name(b"system.nfs4_acl"), None);
    }
}
