//! Strata layers out: one layer → a layer tar ([`write_layer_tar`]), a stack → an OCI image
//! layout ([`write_layout`]) or one full EROFS image ([`write_flat_image`]). The mapping is in
//! the crate docs ("Export").

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Seek, Write};
use std::path::{Path, PathBuf};

use erofs_builder::{FileType, Image, Inode, Location};
use serde_json::json;

use crate::digest::{HashWriter, Sha256Digest};
use crate::tarw::{EntryType, Header, TarWriter};
use crate::{io_err, Error, Result};

/// Where a layer's file data is read from: device `device` (1 = the layer's data blob) at
/// byte `offset`.
pub trait LayerData: Send + Sync {
    /// Fills `buf` from `offset` of `device`.
    fn read_at(&self, device: u16, offset: u64, buf: &mut [u8]) -> Result<()>;
}

/// Data blobs as local files (device `i + 1` is `files[i]`).
#[derive(Debug)]
pub struct FileData(pub Vec<File>);

impl LayerData for FileData {
    fn read_at(&self, device: u16, offset: u64, buf: &mut [u8]) -> Result<()> {
        let f = usize::from(device)
            .checked_sub(1)
            .and_then(|i| self.0.get(i))
            .ok_or_else(|| Error::Unsupported(format!("no device {device}")))?;
        std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
            .map_err(io_err(format!("read device {device} at {offset}")))
    }
}

/// One Strata layer to export.
pub struct ExportLayer<'a> {
    /// Its name (`KIND/NAME:VERSION`), for history and messages.
    pub name: String,
    /// Its manifest's creation time (RFC 3339), for history.
    pub created: String,
    /// Its meta image.
    pub image: &'a Image,
    /// Its data.
    pub data: &'a dyn LayerData,
}

impl std::fmt::Debug for ExportLayer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportLayer")
            .field("name", &self.name)
            .finish()
    }
}

/// What [`write_layer_tar`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct LayerTarStats {
    /// Tar entries (the root and whiteouts included, PAX headers not).
    pub entries: u64,
    /// Regular files (first names).
    pub files: u64,
    /// Bytes of file data.
    pub file_bytes: u64,
    /// Hard link entries.
    pub hardlinks: u64,
    /// `.wh.NAME` entries.
    pub whiteouts: u64,
    /// `.wh..wh..opq` entries.
    pub opaque_dirs: u64,
    /// Sockets left out.
    pub skipped_sockets: u64,
}

const IO_CHUNK: usize = 2 << 20;

fn overlay_suffix(name: &[u8]) -> Option<&[u8]> {
    name.strip_prefix(b"trusted.overlay.")
        .or_else(|| name.strip_prefix(b"user.overlay."))
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn base_header(path: Vec<u8>, kind: EntryType, ino: &Inode) -> Header {
    let mut h = Header::new(path, kind);
    h.mode = u32::from(ino.mode) & 0o7777;
    h.uid = u64::from(ino.uid);
    h.gid = u64::from(ino.gid);
    h.mtime = ino.mtime;
    h.nsec = ino.mtime_nsec;
    h
}

/// Writes `layer` as a layer tar into `out` (the mapping of the crate docs); returns `out`.
pub fn write_layer_tar<W: Write>(layer: &ExportLayer<'_>, out: W) -> Result<(W, LayerTarStats)> {
    let img = layer.image;
    let mut tar = TarWriter::new(out);
    let mut stats = LayerTarStats::default();
    let mut links: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut buf = vec![0u8; IO_CHUNK];
    let werr = |e: std::io::Error| io_err(format!("write the tar of {}", layer.name))(e);
    // (path without a leading "./", inode); the root is "".
    let mut stack: Vec<(Vec<u8>, Inode)> = vec![(Vec::new(), img.root()?)];
    while let Some((path, ino)) = stack.pop() {
        let shown = if path.is_empty() {
            "/".to_string()
        } else {
            lossy(&path)
        };
        let name = path.rsplit(|&b| b == b'/').next().unwrap_or(&path);
        if name.starts_with(b".wh.") {
            return Err(Error::WhiteoutName {
                layer: layer.name.clone(),
                path: format!("/{}", lossy(&path)),
            });
        }
        let mut xattrs = img.xattrs(&ino)?;
        xattrs.sort();
        let mut opaque = false;
        let mut kept = Vec::with_capacity(xattrs.len());
        for (n, v) in xattrs {
            match overlay_suffix(&n) {
                None => kept.push((n, v)),
                Some(b"opaque") if v == b"y" && ino.file_type == FileType::Directory => {
                    opaque = true
                }
                Some(_) => {
                    return Err(Error::Unsupported(format!(
                        "layer {}: {shown} has the overlayfs xattr {}={:?}, which has no OCI \
                         equivalent",
                        layer.name,
                        lossy(&n),
                        lossy(&v)
                    )))
                }
            }
        }
        let tar_path = |suffix: &[u8]| -> Vec<u8> {
            let mut p = if path.is_empty() {
                b"./".to_vec()
            } else {
                path.clone()
            };
            p.extend_from_slice(suffix);
            p
        };
        match ino.file_type {
            FileType::Directory => {
                let mut h = base_header(
                    tar_path(if path.is_empty() { b"" } else { b"/" }),
                    EntryType::Dir,
                    &ino,
                );
                h.xattrs = kept;
                tar.append(&h).map_err(werr)?;
                stats.entries += 1;
                if opaque {
                    let mut o = Header::new(
                        tar_path(if path.is_empty() {
                            b".wh..wh..opq"
                        } else {
                            b"/.wh..wh..opq"
                        }),
                        EntryType::File,
                    );
                    o.mtime = ino.mtime;
                    o.nsec = ino.mtime_nsec;
                    tar.append(&o).map_err(werr)?;
                    stats.entries += 1;
                    stats.opaque_dirs += 1;
                }
                let mut children = img.read_dir(&ino)?;
                children.retain(|e| e.name != b"." && e.name != b"..");
                // Popped in name order.
                for e in children.into_iter().rev() {
                    let mut p = path.clone();
                    if !p.is_empty() {
                        p.push(b'/');
                    }
                    p.extend_from_slice(&e.name);
                    let child = img.inode(e.nid)?;
                    stack.push((p, child));
                }
            }
            FileType::CharDevice if ino.rdev == (0, 0) => {
                let (dir, base) = match path.iter().rposition(|&b| b == b'/') {
                    Some(i) => (&path[..=i], &path[i + 1..]),
                    None => (&path[..0], &path[..]),
                };
                let mut p = dir.to_vec();
                p.extend_from_slice(b".wh.");
                p.extend_from_slice(base);
                let h = base_header(p, EntryType::File, &ino);
                tar.append(&h).map_err(werr)?;
                stats.entries += 1;
                stats.whiteouts += 1;
            }
            FileType::Socket => stats.skipped_sockets += 1,
            ft => {
                if ino.nlink > 1 {
                    if let Some(first) = links.get(&ino.nid) {
                        let mut h = base_header(path.clone(), EntryType::Hardlink, &ino);
                        h.link = first.clone();
                        tar.append(&h).map_err(werr)?;
                        stats.entries += 1;
                        stats.hardlinks += 1;
                        continue;
                    }
                    links.insert(ino.nid, path.clone());
                }
                let kind = match ft {
                    FileType::Regular => EntryType::File,
                    FileType::Symlink => EntryType::Symlink,
                    FileType::CharDevice => EntryType::Char,
                    FileType::BlockDevice => EntryType::Block,
                    _ => EntryType::Fifo,
                };
                let mut h = base_header(path.clone(), kind, &ino);
                h.xattrs = kept;
                match kind {
                    EntryType::File => h.size = ino.size,
                    EntryType::Symlink => h.link = img.read_link(&ino)?,
                    EntryType::Char | EntryType::Block => h.dev = ino.rdev,
                    _ => {}
                }
                tar.append(&h).map_err(werr)?;
                stats.entries += 1;
                if kind == EntryType::File {
                    copy_data(layer, &ino, &mut tar, &mut buf)?;
                    stats.files += 1;
                    stats.file_bytes += ino.size;
                }
            }
        }
    }
    let out = tar.finish().map_err(werr)?;
    Ok((out, stats))
}

fn copy_data<W: Write>(
    layer: &ExportLayer<'_>,
    ino: &Inode,
    tar: &mut TarWriter<W>,
    buf: &mut [u8],
) -> Result<()> {
    let werr = |e: std::io::Error| io_err(format!("write the tar of {}", layer.name))(e);
    for ext in layer.image.data_map(ino)? {
        let mut done = 0u64;
        while done < ext.len {
            let n = (ext.len - done).min(buf.len() as u64) as usize;
            let b = &mut buf[..n];
            match ext.location {
                Location::Hole => {
                    tar.zeros(n as u64).map_err(werr)?;
                    done += n as u64;
                    continue;
                }
                Location::Image(_) => {
                    let k = layer.image.read_at_inode(ino, ext.file_offset + done, b)?;
                    if k != n {
                        return Err(erofs_builder::Error::Corrupt("short read".into()).into());
                    }
                }
                Location::Device { device, offset } => {
                    layer.data.read_at(device, offset + done, b)?
                }
                _ => {
                    return Err(Error::Unsupported(format!(
                        "layer {}: a data location this exporter does not know",
                        layer.name
                    )))
                }
            }
            tar.data(b).map_err(werr)?;
            done += n as u64;
        }
    }
    Ok(())
}

/// How layer tars are compressed in a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerCompression {
    /// gzip, level 6 (`application/vnd.oci.image.layer.v1.tar+gzip`).
    #[default]
    Gzip,
    /// zstd, level 3 (`application/vnd.oci.image.layer.v1.tar+zstd`).
    Zstd,
}

impl std::str::FromStr for LayerCompression {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "gzip" => Ok(Self::Gzip),
            "zstd" => Ok(Self::Zstd),
            _ => Err(format!("{s:?}: gzip or zstd")),
        }
    }
}

/// Options of [`write_layout`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LayoutOptions {
    /// Layer compression.
    pub compression: LayerCompression,
    /// The tag (`org.opencontainers.image.ref.name`).
    pub tag: String,
    /// GOARCH of the config (default: this machine's).
    pub architecture: String,
}

impl LayoutOptions {
    /// Options with `tag`.
    pub fn new(tag: &str) -> Self {
        let architecture = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            "x86" => "386",
            "powerpc64" => "ppc64le",
            other => other,
        }
        .to_string();
        Self {
            compression: LayerCompression::Gzip,
            tag: tag.to_string(),
            architecture,
        }
    }

    /// With `c`.
    pub fn compression(mut self, c: LayerCompression) -> Self {
        self.compression = c;
        self
    }
}

/// What [`write_layout`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct LayoutStats {
    /// The manifest's digest.
    pub manifest: String,
    /// Per layer: (name, blob digest, blob bytes, diff_id, tar bytes, tar stats).
    pub layers: Vec<ExportedLayer>,
}

/// One exported layer.
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct ExportedLayer {
    /// The Strata layer.
    pub name: String,
    /// The compressed blob's digest.
    pub digest: String,
    /// Its size.
    pub size: u64,
    /// The uncompressed tar's digest.
    pub diff_id: String,
    /// The uncompressed tar's size.
    pub tar_bytes: u64,
    /// What the tar holds.
    pub tar: LayerTarStats,
}

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

/// Removes a directory tree when dropped unless disarmed.
struct RemoveDir(Option<PathBuf>);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

fn tmp_sibling(out: &Path, what: &str) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "image".into());
    out.with_file_name(format!(".{name}.{what}-{}", std::process::id()))
}

fn write_blob(dir: &Path, bytes: &[u8]) -> Result<(Sha256Digest, u64)> {
    let d = Sha256Digest::of(bytes);
    let p = dir.join(d.hex());
    std::fs::write(&p, bytes).map_err(io_err(format!("write {}", p.display())))?;
    Ok((d, bytes.len() as u64))
}

/// Writes the layers (lowest first) as an OCI image layout at `out`: a directory, or a tar
/// of one when `out` ends in `.tar`. `out` must not exist (a directory may exist if empty).
/// The layout appears atomically.
pub fn write_layout(
    layers: &[ExportLayer<'_>],
    out: &Path,
    opts: &LayoutOptions,
) -> Result<LayoutStats> {
    if layers.is_empty() {
        return Err(Error::Unsupported("no layers to export".into()));
    }
    let as_tar = out.extension().is_some_and(|e| e == "tar");
    match std::fs::symlink_metadata(out) {
        Ok(m) if !as_tar && m.is_dir() => {
            let mut rd =
                std::fs::read_dir(out).map_err(io_err(format!("read {}", out.display())))?;
            if rd.next().is_some() {
                return Err(Error::Unsupported(format!(
                    "{} exists and is not empty",
                    out.display()
                )));
            }
        }
        Ok(_) => {
            return Err(Error::Unsupported(format!("{} exists", out.display())));
        }
        Err(_) => {}
    }
    let tmp = tmp_sibling(out, "layout");
    let _ = std::fs::remove_dir_all(&tmp);
    let guard = RemoveDir(Some(tmp.clone()));
    let blobs = tmp.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(io_err(format!("create {}", blobs.display())))?;
    let mut exported = Vec::new();
    let mut descs = Vec::new();
    let media = match opts.compression {
        LayerCompression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
        LayerCompression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
    };
    for (i, l) in layers.iter().enumerate() {
        let part = blobs.join(format!(".layer-{i}"));
        let f = File::create(&part).map_err(io_err(format!("create {}", part.display())))?;
        let outer = HashWriter::new(BufWriter::with_capacity(1 << 20, f));
        let (outer, plain, stats) = compress_layer(l, outer, opts.compression)?;
        let digest = outer.hash.finish();
        let size = outer.hash.bytes;
        let mut f = outer.into_inner();
        f.flush().map_err(io_err("write a layer blob"))?;
        drop(f);
        std::fs::rename(&part, blobs.join(digest.hex())).map_err(io_err("rename a layer blob"))?;
        let diff_id = plain.finish();
        descs.push(json!({"mediaType": media, "digest": digest.to_string(), "size": size}));
        exported.push(ExportedLayer {
            name: l.name.clone(),
            digest: digest.to_string(),
            size,
            diff_id: diff_id.to_string(),
            tar_bytes: plain.bytes,
            tar: stats,
        });
    }
    let top = &layers[layers.len() - 1];
    let config = json!({
        "created": top.created,
        "architecture": opts.architecture,
        "os": "linux",
        "config": {},
        "rootfs": {
            "type": "layers",
            "diff_ids": exported.iter().map(|e| e.diff_id.clone()).collect::<Vec<_>>(),
        },
        "history": layers.iter().map(|l| json!({
            "created": l.created,
            "created_by": format!("strata layer {}", l.name),
            "comment": "exported by strata layer export",
        })).collect::<Vec<_>>(),
    });
    let to_bytes = |v: &serde_json::Value| serde_json::to_vec(v).unwrap_or_default();
    let (cd, cs) = write_blob(&blobs, &to_bytes(&config))?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cd.to_string(), "size": cs},
        "layers": descs,
    });
    let (md, ms) = write_blob(&blobs, &to_bytes(&manifest))?;
    let index = json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{
            "mediaType": OCI_MANIFEST,
            "digest": md.to_string(),
            "size": ms,
            "annotations": {"org.opencontainers.image.ref.name": opts.tag},
            "platform": {"architecture": opts.architecture, "os": "linux"},
        }],
    });
    let wr = |name: &str, b: &[u8]| -> Result<()> {
        std::fs::write(tmp.join(name), b).map_err(io_err(format!("write {name}")))
    };
    wr("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    wr("index.json", &to_bytes(&index))?;
    if as_tar {
        tar_layout(&tmp, out)?;
    } else {
        std::fs::rename(&tmp, out).map_err(io_err(format!("rename to {}", out.display())))?;
        let mut guard = guard;
        guard.0 = None;
    }
    Ok(LayoutStats {
        manifest: md.to_string(),
        layers: exported,
    })
}

/// A writer that hands 1 MiB pieces to another thread (see [`compress_layer`]).
struct ChanWriter {
    tx: std::sync::mpsc::SyncSender<Vec<u8>>,
    buf: Vec<u8>,
}

const PIECE: usize = 1 << 20;

impl ChanWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let piece = std::mem::replace(&mut self.buf, Vec::with_capacity(PIECE));
        self.tx
            .send(piece)
            .map_err(|_| std::io::Error::other("the compressor stopped"))
    }
}

impl Write for ChanWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = b.len().min(PIECE - self.buf.len());
        self.buf.extend_from_slice(&b[..n]);
        if self.buf.len() == PIECE {
            self.send()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

type Blob = HashWriter<BufWriter<File>>;

/// Uncompressed bytes per gzip member.
const GZIP_MEMBER: usize = 8 << 20;

/// One gzip member (level 6, mtime 0) of `data`.
fn gzip_member(data: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut enc = flate2::GzBuilder::new().mtime(0).write(
        Vec::with_capacity(data.len() / 3),
        flate2::Compression::new(6),
    );
    enc.write_all(data)?;
    enc.finish()
}

/// gzip as a sequence of members, one per [`GZIP_MEMBER`] bytes of input, two compressed at
/// a time on two threads and written in order. The member boundaries depend only on the
/// input, so the output is deterministic; every gzip reader (RFC 1952, Go's, `gzip -d`)
/// reads concatenated members as one stream.
fn gzip_members(rx: std::sync::mpsc::Receiver<Vec<u8>>, mut out: Blob) -> std::io::Result<Blob> {
    let mut pieces = rx.into_iter().peekable();
    let mut next_block = || -> Option<Vec<u8>> {
        pieces.peek()?;
        let mut block = Vec::with_capacity(GZIP_MEMBER);
        while block.len() < GZIP_MEMBER {
            match pieces.next() {
                Some(p) => block.extend_from_slice(&p),
                None => break,
            }
        }
        Some(block)
    };
    let mut wrote = false;
    while let Some(a) = next_block() {
        let b = next_block();
        let (ca, cb) = std::thread::scope(|s| {
            let other = b.as_ref().map(|b| s.spawn(move || gzip_member(b)));
            let ca = gzip_member(&a);
            let cb = other.map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("a gzip thread panicked")))
            });
            (ca, cb)
        });
        out.write_all(&ca?)?;
        if let Some(cb) = cb {
            out.write_all(&cb?)?;
        }
        wrote = true;
    }
    if !wrote {
        out.write_all(&gzip_member(b"")?)?;
    }
    Ok(out)
}

/// Writes layer `l`'s tar compressed into `out`: this thread walks the layer, reads its
/// data and hashes the tar (the diff_id); another compresses (gzip: two members at a time,
/// see [`gzip_members`]) and hashes the blob. Returns the blob writer, the tar's hash and the tar's stats.
fn compress_layer(
    l: &ExportLayer<'_>,
    out: Blob,
    c: LayerCompression,
) -> Result<(Blob, crate::digest::Hashing, LayerTarStats)> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(2 * GZIP_MEMBER / PIECE);
    std::thread::scope(|s| {
        let compressor = s.spawn(move || -> std::io::Result<Blob> {
            match c {
                LayerCompression::Gzip => gzip_members(rx, out),
                LayerCompression::Zstd => {
                    let mut enc = zstd::stream::write::Encoder::new(out, 3)?;
                    for piece in rx {
                        enc.write_all(&piece)?;
                    }
                    enc.finish()
                }
            }
        });
        let chan = ChanWriter {
            tx,
            buf: Vec::with_capacity(PIECE),
        };
        let produced = write_layer_tar(l, HashWriter::new(chan));
        // Dropping the sender (with the writer) ends the compressor's loop.
        let produced = produced.map(|(w, stats)| (w.hash.clone(), stats));
        let compressed = compressor
            .join()
            .map_err(|_| Error::Unsupported("the compressor thread panicked".into()))?
            .map_err(io_err(format!("compress the tar of {}", l.name)));
        match (produced, compressed) {
            (Ok((plain, stats)), Ok(blob)) => Ok((blob, plain, stats)),
            // The compressor's own error explains a "compressor stopped" on this side.
            (Err(_), Err(e)) | (Ok(_), Err(e)) => Err(e),
            (Err(e), Ok(_)) => Err(e),
        }
    })
}

/// Writes the layout directory `dir` as a tar at `out` (via a temporary file).
fn tar_layout(dir: &Path, out: &Path) -> Result<()> {
    let tmp = tmp_sibling(out, "tar");
    let f = File::create(&tmp).map_err(io_err(format!("create {}", tmp.display())))?;
    let write = || -> std::io::Result<()> {
        let mut t = TarWriter::new(BufWriter::with_capacity(1 << 20, f));
        let file = |t: &mut TarWriter<_>, name: &str, p: &Path| -> std::io::Result<()> {
            let mut src = File::open(p)?;
            let mut h = Header::new(name, EntryType::File);
            h.size = src.metadata()?.len();
            t.append(&h)?;
            let mut b = vec![0u8; 1 << 20];
            loop {
                let n = std::io::Read::read(&mut src, &mut b)?;
                if n == 0 {
                    break;
                }
                t.data(&b[..n])?;
            }
            Ok(())
        };
        file(&mut t, "oci-layout", &dir.join("oci-layout"))?;
        file(&mut t, "index.json", &dir.join("index.json"))?;
        for d in ["blobs/", "blobs/sha256/"] {
            let mut h = Header::new(d, EntryType::Dir);
            h.mode = 0o755;
            t.append(&h)?;
        }
        let mut names: Vec<String> = std::fs::read_dir(dir.join("blobs/sha256"))?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<std::io::Result<_>>()?;
        names.sort();
        for n in names {
            file(
                &mut t,
                &format!("blobs/sha256/{n}"),
                &dir.join("blobs/sha256").join(&n),
            )?;
        }
        let mut w = t.finish()?;
        w.flush()?;
        w.get_ref().sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(format!("write {}", tmp.display()))(e));
    }
    std::fs::rename(&tmp, out).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(format!("rename to {}", out.display()))(e)
    })
}

/// Writes the whole stack (lowest first) as one full EROFS image at `out`: the layers'
/// tars, each in an unnamed temporary file in `temp_dir`, merged by
/// `erofs_builder::Source::TarStack` (whiteouts applied), file data inline.
pub fn write_flat_image(
    layers: &[ExportLayer<'_>],
    out: &Path,
    temp_dir: &Path,
) -> Result<erofs_builder::BuildStats> {
    let mut readers: Vec<Box<dyn std::io::Read + Send>> = Vec::new();
    for l in layers {
        let f = tempfile::tempfile_in(temp_dir).map_err(io_err(format!(
            "create a temporary file in {}",
            temp_dir.display()
        )))?;
        let (w, _) = write_layer_tar(l, BufWriter::with_capacity(1 << 20, f))?;
        let mut f = w
            .into_inner()
            .map_err(|e| io_err("write a layer tar")(e.into_error()))?;
        f.rewind().map_err(io_err("rewind a layer tar"))?;
        readers.push(Box::new(std::io::BufReader::with_capacity(1 << 20, f)));
    }
    let mut opts = erofs_builder::BuildOptions::default();
    opts.tar.temp_dir = Some(temp_dir.to_path_buf());
    Ok(erofs_builder::build_image_from(
        erofs_builder::Source::TarStack(readers),
        out,
        &opts,
    )?)
}
