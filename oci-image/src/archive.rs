//! Where an image's files come from: a directory (an OCI layout) or an archive (a tar of a
//! layout, or a `docker save` archive), behind one [`Layout`] that hands out bounded JSON
//! documents and blob readers by name.
//!
//! * **Directory**: every name is opened relative to the layout's directory descriptor with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`: no component
//!   may be a symlink and nothing outside the layout can be reached; the opened file must be
//!   a regular file.
//! * **Archive**: indexed once (names → offset and size of the data in the tar), then read
//!   with positional reads. A gzip or zstd archive is first decompressed into an unnamed
//!   temporary file. The index parser is small and strict: header checksums, ustar
//!   `prefix/name`, GNU long names (`L`, `K`), PAX `path`, `linkpath` and `size` (other PAX
//!   keys and global headers are ignored), regular files, directories, symlinks and hard
//!   links; anything else is refused. Names are normalised (`./`, `/`, empty components
//!   dropped); a `..` component or a NUL is refused; a name given twice is refused (which
//!   one would count?). Symlink and hard link entries are kept as links: [`Layout::open`]
//!   refuses them unless links are allowed (docker save archives), and then follows one hop,
//!   by name inside the archive, to a regular entry.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{invalid, io_err, Result};

/// Most entries in an image archive.
const MAX_ENTRIES: usize = 1 << 20;
/// Largest long name or PAX header in an image archive.
const MAX_META: u64 = 1 << 20;

/// A normalised relative name (components joined by `/`); refuses `..`, NUL and, when
/// `strict`, absolute names.
pub fn normalize(name: &str, strict: bool) -> Result<String> {
    if name.contains('\0') {
        return Err(invalid(name, "NUL in a path"));
    }
    if strict && name.starts_with('/') {
        return Err(invalid(name, "absolute path"));
    }
    let mut out: Vec<&str> = Vec::new();
    for c in name.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(invalid(name, "`..` in a path (it would leave the layout)")),
            c => out.push(c),
        }
    }
    Ok(out.join("/"))
}

/// `target` resolved lexically from the directory `dir` of the archive; `None` if it climbs
/// above the archive's root.
fn resolve_link(dir: &str, target: &str) -> Option<String> {
    let mut out: Vec<&str> = dir.split('/').filter(|c| !c.is_empty()).collect();
    for c in target.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop()?;
            }
            c if c.contains('\0') => return None,
            c => out.push(c),
        }
    }
    Some(out.join("/"))
}

#[derive(Debug, Clone)]
enum Entry {
    File { offset: u64, size: u64 },
    Dir,
    Symlink(String),
    Hardlink(String),
}

/// An indexed image archive.
#[derive(Debug)]
pub struct Archive {
    file: Arc<File>,
    entries: HashMap<String, Entry>,
}

/// A reader of `len` bytes of a file from `pos` (positional reads).
#[derive(Debug)]
struct RangeReader {
    file: Arc<File>,
    pos: u64,
    end: u64,
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (self.end - self.pos).min(buf.len() as u64) as usize;
        if n == 0 {
            return Ok(0);
        }
        let k = self.file.read_at(&mut buf[..n], self.pos)?;
        if k == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        self.pos += k as u64;
        Ok(k)
    }
}

fn octal(f: &[u8]) -> Option<u64> {
    if f.first().is_some_and(|&b| b & 0x80 != 0) {
        // GNU base-256, positive only.
        if f[0] != 0x80 {
            return None;
        }
        let mut v: u64 = 0;
        for &b in &f[1..] {
            v = v.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(v);
    }
    let s: Vec<u8> = f
        .iter()
        .copied()
        .take_while(|&b| b != 0)
        .filter(|&b| b != b' ')
        .collect();
    if s.is_empty() {
        return Some(0);
    }
    let s = std::str::from_utf8(&s).ok()?;
    u64::from_str_radix(s, 8).ok()
}

fn cstr(b: &[u8]) -> &[u8] {
    b.iter().position(|&c| c == 0).map_or(b, |n| &b[..n])
}

fn pax_records(data: &[u8]) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() && rest[0] != 0 {
        let sp = rest.iter().take(20).position(|&b| b == b' ')?;
        let len: usize = std::str::from_utf8(&rest[..sp]).ok()?.parse().ok()?;
        if len <= sp + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return None;
        }
        let rec = std::str::from_utf8(&rest[sp + 1..len - 1]).ok()?;
        let (k, v) = rec.split_once('=')?;
        out.push((k.to_owned(), v.to_owned()));
        rest = &rest[len..];
    }
    Some(out)
}

impl Archive {
    /// Indexes the archive at `path` (decompressing a gzip or zstd one into an unnamed file
    /// in `temp_dir`).
    pub fn open(path: &Path, temp_dir: &Path) -> Result<Self> {
        let f = File::open(path).map_err(io_err(format!("open {}", path.display())))?;
        Self::from_reader(f, temp_dir)
    }

    /// Indexes an archive read from `r` (seekable: a plain archive is read in place).
    pub fn from_reader<R: Read + Seek + Send + 'static>(mut r: R, temp_dir: &Path) -> Result<Self> {
        let mut magic = [0u8; 4];
        let n = r.read(&mut magic).map_err(io_err("read the archive"))?;
        r.seek(SeekFrom::Start(0))
            .map_err(io_err("read the archive"))?;
        let gzip = n >= 2 && magic[..2] == [0x1f, 0x8b];
        let zstd = n >= 4 && magic == [0x28, 0xb5, 0x2f, 0xfd];
        let file = if gzip || zstd {
            let mut out = tempfile::tempfile_in(temp_dir).map_err(io_err(format!(
                "create a temporary file in {}",
                temp_dir.display()
            )))?;
            let mut dec: Box<dyn Read> = if gzip {
                Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(r)))
            } else {
                Box::new(
                    zstd::stream::read::Decoder::new(r).map_err(io_err("start zstd decoding"))?,
                )
            };
            std::io::copy(&mut dec, &mut out)
                .map_err(|e| invalid("archive", format!("cannot decompress: {e}")))?;
            out
        } else {
            let mut out = tempfile::tempfile_in(temp_dir).map_err(io_err(format!(
                "create a temporary file in {}",
                temp_dir.display()
            )))?;
            std::io::copy(&mut r, &mut out).map_err(io_err("copy the archive"))?;
            out
        };
        Self::index(file)
    }

    /// Indexes a plain tar file in place.
    pub fn from_plain_file(file: File) -> Result<Self> {
        Self::index(file)
    }

    fn index(file: File) -> Result<Self> {
        let len = file.metadata().map_err(io_err("stat the archive"))?.len();
        let mut entries = HashMap::new();
        let mut pos = 0u64;
        let mut long_name: Option<String> = None;
        let mut long_link: Option<String> = None;
        let mut pax: Vec<(String, String)> = Vec::new();
        let mut h = [0u8; 512];
        let bad = |pos: u64, r: &str| invalid("archive", format!("at byte {pos}: {r}"));
        loop {
            if pos + 512 > len {
                if pos == len {
                    break;
                }
                return Err(bad(pos, "truncated header"));
            }
            file.read_exact_at(&mut h, pos)
                .map_err(io_err("read the archive"))?;
            if h.iter().all(|&b| b == 0) {
                break;
            }
            let stored = octal(&h[148..156]).ok_or_else(|| bad(pos, "bad checksum field"))?;
            let sum: u64 = h
                .iter()
                .enumerate()
                .map(|(i, &b)| u64::from(if (148..156).contains(&i) { b' ' } else { b }))
                .sum();
            if stored != sum {
                return Err(bad(pos, "header checksum mismatch"));
            }
            let mut size = octal(&h[124..136]).ok_or_else(|| bad(pos, "bad size field"))?;
            let typeflag = h[156];
            let data = pos + 512;
            let meta = |size: u64| -> Result<Vec<u8>> {
                if size > MAX_META {
                    return Err(bad(pos, "extended header too large"));
                }
                let mut v = vec![0u8; size as usize];
                file.read_exact_at(&mut v, data)
                    .map_err(|_| bad(pos, "truncated extended header"))?;
                Ok(v)
            };
            let text = |v: Vec<u8>| -> Result<String> {
                String::from_utf8(cstr(&v).to_vec()).map_err(|_| bad(pos, "name is not UTF-8"))
            };
            let next = data
                .checked_add(size.next_multiple_of(512))
                .ok_or_else(|| bad(pos, "size overflow"))?;
            match typeflag {
                b'L' => {
                    long_name = Some(text(meta(size)?)?);
                    pos = next;
                    continue;
                }
                b'K' => {
                    long_link = Some(text(meta(size)?)?);
                    pos = next;
                    continue;
                }
                b'x' | b'X' => {
                    pax = pax_records(&meta(size)?).ok_or_else(|| bad(pos, "bad PAX record"))?;
                    pos = next;
                    continue;
                }
                b'g' => {
                    pos = next;
                    continue;
                }
                _ => {}
            }
            let mut name = match long_name.take() {
                Some(n) => n,
                None => {
                    let n = text(h[..100].to_vec())?;
                    if &h[257..263] == b"ustar\0" && h[345] != 0 {
                        format!("{}/{n}", text(h[345..500].to_vec())?)
                    } else {
                        n
                    }
                }
            };
            let mut link = match long_link.take() {
                Some(l) => l,
                None => text(h[157..257].to_vec())?,
            };
            for (k, v) in pax.drain(..) {
                match k.as_str() {
                    "path" => name = v,
                    "linkpath" => link = v,
                    "size" => size = v.parse().map_err(|_| bad(pos, "bad PAX size"))?,
                    _ => {}
                }
            }
            let next = data
                .checked_add(size.next_multiple_of(512))
                .ok_or_else(|| bad(pos, "size overflow"))?;
            let key = normalize(&name, false)?;
            let entry = match typeflag {
                b'0' | 0 | b'7' if name.ends_with('/') => Entry::Dir,
                b'0' | 0 | b'7' => {
                    if data + size > len {
                        return Err(bad(pos, "entry data runs past the end"));
                    }
                    Entry::File { offset: data, size }
                }
                b'5' => Entry::Dir,
                b'2' => Entry::Symlink(link),
                b'1' => Entry::Hardlink(normalize(&link, false)?),
                t => {
                    return Err(bad(
                        pos,
                        &format!("entry {name:?} of unsupported type {:?}", char::from(t)),
                    ))
                }
            };
            if entries.len() >= MAX_ENTRIES {
                return Err(bad(pos, "too many entries"));
            }
            match (entries.get(&key), &entry) {
                (Some(Entry::Dir), Entry::Dir) => {}
                (Some(_), _) => return Err(bad(pos, &format!("{name:?} appears twice"))),
                (None, _) => {
                    entries.insert(key, entry);
                }
            }
            pos = next;
        }
        Ok(Self {
            file: Arc::new(file),
            entries,
        })
    }
}

/// An image's files: a directory or an indexed archive.
#[derive(Debug)]
pub enum Layout {
    /// A directory, opened once.
    Dir {
        /// The directory (an `O_PATH` descriptor).
        fd: Arc<rustix::fd::OwnedFd>,
        /// Its path, for messages.
        path: PathBuf,
    },
    /// An archive.
    Archive(Archive),
}

impl Layout {
    /// Opens `path`: a directory, or an archive (indexed, decompressed into `temp_dir` if
    /// compressed).
    pub fn open(path: &Path, temp_dir: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(io_err(format!("stat {}", path.display())))?;
        if meta.is_dir() {
            let fd = rustix::fs::open(
                path,
                rustix::fs::OFlags::PATH
                    | rustix::fs::OFlags::DIRECTORY
                    | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| io_err(format!("open {}", path.display()))(e.into()))?;
            return Ok(Layout::Dir {
                fd: Arc::new(fd),
                path: path.to_path_buf(),
            });
        }
        let f = File::open(path).map_err(io_err(format!("open {}", path.display())))?;
        let mut magic = [0u8; 4];
        let n = f.read_at(&mut magic, 0).unwrap_or(0);
        let compressed =
            (n >= 2 && magic[..2] == [0x1f, 0x8b]) || (n >= 4 && magic == [0x28, 0xb5, 0x2f, 0xfd]);
        Ok(Layout::Archive(if compressed {
            Archive::from_reader(f, temp_dir)?
        } else {
            Archive::from_plain_file(f)?
        }))
    }

    /// Whether a regular file (or, in an archive, any entry) `name` exists.
    pub fn exists(&self, name: &str) -> bool {
        match self {
            Layout::Dir { fd, .. } => open_beneath(fd, name).is_ok(),
            Layout::Archive(a) => normalize(name, true)
                .map(|k| a.entries.contains_key(&k))
                .unwrap_or(false),
        }
    }

    /// Opens the regular file `name` (relative, normalised; no `..`). `follow_links`: in an
    /// archive, a symlink or hard link entry is followed once, by name inside the archive
    /// (docker save); otherwise it is refused. Returns the reader and the file's size.
    pub fn open_file(&self, name: &str, follow_links: bool) -> Result<(Box<dyn Read + Send>, u64)> {
        let key = normalize(name, true)?;
        match self {
            Layout::Dir { fd, path } => {
                let f = open_beneath(fd, &key).map_err(|e| match e.raw_os_error() {
                    Some(c) if c == rustix::io::Errno::LOOP.raw_os_error() => invalid(
                        name,
                        "a symlink in the layout (symlinks are refused in image layouts)",
                    ),
                    Some(c) if c == rustix::io::Errno::XDEV.raw_os_error() => {
                        invalid(name, "the path leaves the layout")
                    }
                    _ => io_err(format!("open {} in {}", key, path.display()))(e),
                })?;
                let meta = f
                    .metadata()
                    .map_err(io_err(format!("stat {key} in {}", path.display())))?;
                if !meta.is_file() {
                    return Err(invalid(name, "not a regular file"));
                }
                Ok((Box::new(BufReader::with_capacity(1 << 20, f)), meta.len()))
            }
            Layout::Archive(a) => {
                let mut cur = key.clone();
                for hop in 0..2 {
                    let entry = a
                        .entries
                        .get(&cur)
                        .ok_or_else(|| invalid(name, "not in the archive"))?;
                    match entry {
                        Entry::File { offset, size } => {
                            let r = RangeReader {
                                file: a.file.clone(),
                                pos: *offset,
                                end: offset + size,
                            };
                            return Ok((Box::new(BufReader::with_capacity(1 << 20, r)), *size));
                        }
                        Entry::Dir => return Err(invalid(name, "a directory, not a file")),
                        Entry::Symlink(_) | Entry::Hardlink(_) if !follow_links || hop > 0 => {
                            return Err(invalid(
                                name,
                                "a symlink or hard link entry (refused in image layouts)",
                            ))
                        }
                        Entry::Symlink(target) => {
                            if target.starts_with('/') {
                                return Err(invalid(name, "an absolute symlink"));
                            }
                            let dir = cur.rsplit_once('/').map_or("", |(d, _)| d);
                            cur = resolve_link(dir, target).ok_or_else(|| {
                                invalid(name, "a symlink that leaves the archive")
                            })?;
                        }
                        Entry::Hardlink(target) => cur = target.clone(),
                    }
                }
                Err(invalid(name, "link to a link"))
            }
        }
    }

    /// Reads the whole file `name`, at most `limit` bytes (a larger file is refused).
    pub fn read_limited(&self, name: &str, limit: u64) -> Result<Vec<u8>> {
        let (r, size) = self.open_file(name, false)?;
        if size > limit {
            return Err(invalid(
                name,
                format!("{size} bytes, more than the {limit}-byte limit for JSON documents"),
            ));
        }
        let mut v = Vec::with_capacity(size as usize);
        r.take(limit + 1)
            .read_to_end(&mut v)
            .map_err(io_err(format!("read {name}")))?;
        if v.len() as u64 > limit {
            return Err(invalid(name, "larger than the JSON document limit"));
        }
        Ok(v)
    }
}

fn open_beneath(dir: &rustix::fd::OwnedFd, name: &str) -> std::io::Result<File> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    if name.is_empty() {
        return Err(std::io::ErrorKind::NotFound.into());
    }
    let fd = rustix::fs::openat2(
        dir,
        name,
        // NONBLOCK: a fifo planted in the layout must not hang the open (the file is then
        // refused as not regular).
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(std::io::Error::from)?;
    Ok(File::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalised_and_traversal_refused() {
        assert_eq!(
            normalize("./blobs//sha256/x", true).unwrap(),
            "blobs/sha256/x"
        );
        assert!(normalize("blobs/../../etc/passwd", true).is_err());
        assert!(normalize("/etc/passwd", true).is_err());
        assert_eq!(normalize("/etc/passwd", false).unwrap(), "etc/passwd");
        assert!(normalize("a\0b", false).is_err());
        assert_eq!(resolve_link("c", "../a/layer.tar").unwrap(), "a/layer.tar");
        assert!(resolve_link("c", "../../etc/passwd").is_none());
    }

    #[test]
    fn directory_symlinks_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("blobs/sha256")).unwrap();
        std::fs::write(d.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink("../../secret", d.path().join("blobs/sha256/aa")).unwrap();
        std::os::unix::fs::symlink("/etc", d.path().join("blobs/etc")).unwrap();
        let l = Layout::open(d.path(), d.path()).unwrap();
        let e = l.open_file("blobs/sha256/aa", false).err().unwrap();
        assert!(e.to_string().contains("symlink"), "{e}");
        let e = l.open_file("blobs/etc/passwd", false).err().unwrap();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert!(l.open_file("secret", false).is_ok());
    }
}
