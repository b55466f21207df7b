//! Tar input: an OCI/Docker layer tar stream → the writer's tree, file data in a spool.
//!
//! Our own parser (so that every limit is ours): 512-byte headers, POSIX ustar (name +
//! prefix), GNU (`L` long names, `K` long link targets, `S` sparse files with extension
//! blocks, base-256 numbers), PAX (`x` per entry, `g` global: `path`, `linkpath`, `size`,
//! `mtime` with a fraction, `uid`, `gid`, `SCHILY.xattr.NAME` raw values,
//! `LIBARCHIVE.xattr.NAME` with a %-encoded name and a base64 value, GNU sparse 0.0, 0.1 and
//! 1.0; `uname`, `gname`, `atime`, `ctime` and unknown keys are ignored; global headers only
//! contribute `mtime`, `uid`, `gid` and xattrs). The stream may be gzip (several members) or
//! zstd (several frames), detected from its first bytes. See `docs/format.md` ("Inputs")
//! for the rules; in short:
//!
//! * Names are normalised: leading `/` and `./`, empty and `.` components are dropped. A `..`
//!   component anywhere is refused (as GNU tar refuses to extract such members), as is a NUL
//!   in a name, a component over 255 bytes, or more than [`TarOptions::max_depth`]
//!   components.
//! * A later entry for the same path replaces the earlier one, as extraction would; a
//!   directory entry over an existing directory only updates its attributes (its children
//!   and opaque flag stay); a non-directory over a directory drops the directory's subtree.
//! * Directories implied by a path but missing from the archive get mode 0755, owner 0:0 and
//!   the build epoch ([`BuildOptions::epoch`], 0 when unset) as mtime.
//! * A parent that is a symlink (or any non-directory) in the archive is refused. A hard link
//!   must name a non-directory entry that is already in the tree; it becomes one inode.
//! * OCI whiteouts: `.wh.NAME` → a character device 0:0 named NAME (owner, permissions and
//!   mtime from the header); `.wh..wh..opq` → `trusted.overlay.opaque=y` on its directory
//!   (kept even with `xattrs: false`); other `.wh..wh.*` names (AUFS metadata) are ignored.
//! * The end: two zero blocks, one zero block then EOF, or EOF at a header boundary are all
//!   a clean end; EOF inside a header, data or padding is [`Error::Truncated`]. Nothing after
//!   the first zero block is parsed; a compressed stream is read on to its end (at most
//!   16 MiB more) so that the decompressor checks its trailer.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{BufReader, Cursor, ErrorKind, Read};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use crate::data::write_nonzero;
use crate::ondisk::{encode_dev, ft, NAME_LEN};
use crate::source::{ProgressGuard, TarOptions};
use crate::writer::{make_xattr, Kind, Node, Xattr};
use crate::{io_err, BuildOptions, Error, Result};

const BLOCK: usize = 512;
const S_IFREG: u16 = 0o100_000;
const S_IFDIR: u16 = 0o040_000;
const S_IFLNK: u16 = 0o120_000;
const S_IFCHR: u16 = 0o020_000;
const S_IFBLK: u16 = 0o060_000;
const S_IFIFO: u16 = 0o010_000;

/// Wraps `input` in the decompressor its first bytes call for; true if compressed.
fn decompress(mut input: Box<dyn Read + Send>) -> Result<(Box<dyn Read + Send>, bool)> {
    let mut head = [0u8; 6];
    let mut n = 0;
    while n < head.len() {
        match input.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read tar stream")(e)),
        }
    }
    let head = &head[..n];
    let stream = Cursor::new(head.to_vec()).chain(input);
    if head.starts_with(&[0x1f, 0x8b]) {
        let gz = flate2::read::MultiGzDecoder::new(BufReader::with_capacity(1 << 16, stream));
        Ok((Box::new(gz), true))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        let d = zstd::stream::read::Decoder::new(stream).map_err(io_err("start zstd"))?;
        Ok((Box::new(d), true))
    } else if head.starts_with(b"\xfd7zXZ\0") || head.starts_with(b"BZh") {
        Err(bad(
            0,
            b"",
            "xz and bzip2 compression are not supported (only gzip, zstd)",
        ))
    } else {
        Ok((Box::new(BufReader::with_capacity(1 << 16, stream)), false))
    }
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn bad(offset: u64, entry: &[u8], reason: impl Into<String>) -> Error {
    Error::BadArchive {
        offset,
        entry: lossy(entry),
        reason: reason.into(),
    }
}

fn unsafe_entry(entry: &[u8], reason: impl Into<String>) -> Error {
    Error::UnsafeEntry {
        entry: lossy(entry),
        reason: reason.into(),
    }
}

fn limit(entry: &[u8], what: &str, limit: u64) -> Error {
    Error::LimitExceeded {
        entry: lossy(entry),
        what: what.into(),
        limit,
    }
}

/// The decompressed stream with its position.
struct Stream {
    r: Box<dyn Read + Send>,
    pos: u64,
}

impl Stream {
    /// Reads until `buf` is full or EOF; returns the bytes read.
    fn fill(&mut self, buf: &mut [u8], entry: &[u8]) -> Result<usize> {
        let mut n = 0;
        while n < buf.len() {
            match self.r.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                    return Err(Error::Truncated {
                        offset: self.pos + n as u64,
                        entry: lossy(entry),
                    })
                }
                Err(e) if matches!(e.kind(), ErrorKind::InvalidData | ErrorKind::InvalidInput) => {
                    return Err(bad(
                        self.pos + n as u64,
                        entry,
                        format!("cannot decompress: {e}"),
                    ))
                }
                Err(e) => {
                    return Err(io_err(format!(
                        "read tar stream at byte {}",
                        self.pos + n as u64
                    ))(e))
                }
            }
        }
        self.pos += n as u64;
        Ok(n)
    }

    fn exact(&mut self, buf: &mut [u8], entry: &[u8]) -> Result<()> {
        if self.fill(buf, entry)? < buf.len() {
            return Err(Error::Truncated {
                offset: self.pos,
                entry: lossy(entry),
            });
        }
        Ok(())
    }

    fn skip(&mut self, mut n: u64, entry: &[u8]) -> Result<()> {
        let mut buf = [0u8; 8192];
        while n > 0 {
            let k = n.min(buf.len() as u64) as usize;
            self.exact(&mut buf[..k], entry)?;
            n -= k as u64;
        }
        Ok(())
    }
}

fn padding(size: u64) -> u64 {
    size.next_multiple_of(BLOCK as u64) - size
}

/// A NUL-terminated header field.
fn cstr(b: &[u8]) -> &[u8] {
    b.iter().position(|&c| c == 0).map_or(b, |n| &b[..n])
}

/// A numeric header field: octal ASCII (leading spaces, NUL/space terminated) or GNU
/// base-256 (first byte 0x80 positive, 0xff negative). `None` if malformed or too large.
fn number(f: &[u8]) -> Option<i128> {
    if f.first().is_some_and(|&b| b & 0x80 != 0) {
        let neg = f[0] == 0xff;
        let mut v: i128 = if neg { -1 } else { i128::from(f[0] & 0x7f) };
        for &b in &f[1..] {
            v = v.checked_mul(256)?.checked_add(i128::from(b))?;
            if v.unsigned_abs() > u128::from(u64::MAX) {
                return None;
            }
        }
        return Some(v);
    }
    let mut i = 0;
    while i < f.len() && f[i] == b' ' {
        i += 1;
    }
    let mut v: i128 = 0;
    while i < f.len() && (b'0'..=b'7').contains(&f[i]) {
        v = v * 8 + i128::from(f[i] - b'0');
        if v > i128::from(u64::MAX) {
            return None;
        }
        i += 1;
    }
    if f[i..].iter().all(|&b| b == 0 || b == b' ') {
        Some(v)
    } else {
        None
    }
}

fn unsigned(f: &[u8], what: &str, off: u64, entry: &[u8]) -> Result<u64> {
    number(f)
        .and_then(|v| u64::try_from(v).ok())
        .ok_or_else(|| bad(off, entry, format!("bad {what} field")))
}

fn checksum_ok(h: &[u8; BLOCK]) -> bool {
    let Some(stored) = number(&h[148..156]) else {
        return false;
    };
    let (mut u, mut s) = (0i128, 0i128);
    for (i, &b) in h.iter().enumerate() {
        let b = if (148..156).contains(&i) { b' ' } else { b };
        u += i128::from(b);
        s += i128::from(b as i8);
    }
    stored == u || stored == s
}

/// One archive member after its extended headers were applied.
#[derive(Default)]
struct Entry {
    path: Vec<u8>,
    link: Vec<u8>,
    typeflag: u8,
    mode: u16,
    uid: u64,
    gid: u64,
    mtime: i64,
    nsec: u32,
    /// Data bytes in the archive.
    size: u64,
    devmajor: u64,
    devminor: u64,
    /// Full xattr names, in record order (a later one wins).
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    sparse: Option<Sparse>,
}

#[derive(Default)]
struct Sparse {
    real_size: Option<u64>,
    /// (offset, length) segments, if already known (GNU `S`, PAX 0.0 / 0.1).
    map: Vec<(u64, u64)>,
    /// PAX sparse 1.0: the map is at the start of the data.
    map_in_data: bool,
}

/// PAX records as (key, value), strictly parsed (`"%d %s=%s\n"`).
fn parse_pax(data: &[u8], off: u64, entry: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        if rest.iter().all(|&b| b == 0) {
            break;
        }
        let sp = rest
            .iter()
            .take(20)
            .position(|&b| b == b' ')
            .ok_or_else(|| bad(off, entry, "PAX record without a length"))?;
        let len: usize = std::str::from_utf8(&rest[..sp])
            .ok()
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad(off, entry, "bad PAX record length"))?;
        if len <= sp + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err(bad(off, entry, "bad PAX record length"));
        }
        let rec = &rest[sp + 1..len - 1];
        let eq = rec
            .iter()
            .position(|&b| b == b'=')
            .ok_or_else(|| bad(off, entry, "PAX record without '='"))?;
        out.push((rec[..eq].to_vec(), rec[eq + 1..].to_vec()));
        rest = &rest[len..];
    }
    Ok(out)
}

fn pax_u64(v: &[u8], key: &str, off: u64, entry: &[u8]) -> Result<u64> {
    std::str::from_utf8(v)
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(off, entry, format!("bad PAX {key} value")))
}

/// A PAX time: `-?SECONDS(.FRACTION)?`, fraction truncated to nanoseconds.
fn pax_time(v: &[u8]) -> Option<(i64, u32)> {
    let s = std::str::from_utf8(v).ok()?;
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s),
    };
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let sec: i64 = int.parse().ok()?;
    let mut nsec = 0u32;
    for (i, b) in frac.bytes().take(9).enumerate() {
        nsec += u32::from(b - b'0') * 10u32.pow(8 - i as u32);
    }
    if !neg {
        return Some((sec, nsec));
    }
    if nsec == 0 {
        Some((sec.checked_neg()?, 0))
    } else {
        Some((sec.checked_neg()?.checked_sub(1)?, 1_000_000_000 - nsec))
    }
}

fn percent_decode(s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' {
            let h = std::str::from_utf8(s.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(s[i]);
            i += 1;
        }
    }
    Some(out)
}

fn base64_decode(s: &[u8]) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let s = {
        let mut e = s.len();
        while e > 0 && s[e - 1] == b'=' {
            e -= 1;
        }
        &s[..e]
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in s {
        acc = (acc << 6) | val(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// The tree being assembled (an arena; index 0 is the root).
pub(crate) struct TInode {
    pub(crate) path: Vec<u8>,
    pub(crate) kind: TKind,
    /// Permission bits (incl. setuid/setgid/sticky).
    pub(crate) perm: u16,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) mtime: i64,
    pub(crate) nsec: u32,
    pub(crate) xattrs: Vec<Xattr>,
    pub(crate) size: u64,
    pub(crate) rdev: u32,
    pub(crate) spool: Option<u64>,
    pub(crate) opaque: bool,
    /// A directory implied by a path, not an entry of the archive: when layers are merged
    /// ([`crate::merge`]) it does not replace the attributes of the directory beneath.
    pub(crate) implied: bool,
}

impl TInode {
    /// Whether this is an overlay whiteout (a character device 0:0).
    pub(crate) fn is_whiteout(&self) -> bool {
        matches!(self.kind, TKind::Special(ft::CHR)) && self.rdev == 0
    }

    /// Takes the attributes (not the children, kind or opaque flag) of `other`.
    pub(crate) fn take_attributes(&mut self, other: &mut TInode) {
        self.perm = other.perm;
        self.uid = other.uid;
        self.gid = other.gid;
        self.mtime = other.mtime;
        self.nsec = other.nsec;
        self.xattrs = std::mem::take(&mut other.xattrs);
        self.implied = false;
    }
}

pub(crate) enum TKind {
    Dir(BTreeMap<Vec<u8>, usize>),
    Reg,
    Symlink(Vec<u8>),
    Special(u8),
}

struct Builder<'a> {
    inodes: Vec<TInode>,
    spool: &'a File,
    spool_end: u64,
    opts: &'a BuildOptions,
    buf: Vec<u8>,
}

impl<'a> Builder<'a> {
    fn tar(&self) -> &TarOptions {
        &self.opts.tar
    }

    fn implied_dir(&self, path: Vec<u8>) -> TInode {
        let (mtime, nsec) = self.opts.epoch.unwrap_or((0, 0));
        TInode {
            path,
            kind: TKind::Dir(BTreeMap::new()),
            perm: 0o755,
            uid: 0,
            gid: 0,
            mtime,
            nsec,
            xattrs: Vec::new(),
            size: 0,
            rdev: 0,
            spool: None,
            opaque: false,
            implied: true,
        }
    }

    /// Splits and checks a name (see the module docs).
    fn components(&self, raw: &[u8]) -> Result<Vec<Vec<u8>>> {
        if raw.contains(&0) {
            return Err(unsafe_entry(raw, "NUL byte in the name"));
        }
        let mut out = Vec::new();
        for c in raw.split(|&b| b == b'/') {
            match c {
                b"" | b"." => continue,
                b".." => return Err(unsafe_entry(raw, "`..` component in the name")),
                _ if c.len() > NAME_LEN => {
                    return Err(unsafe_entry(raw, "a component is longer than 255 bytes"))
                }
                _ => out.push(c.to_vec()),
            }
        }
        if out.len() > self.tar().max_depth {
            return Err(limit(raw, "path depth", self.tar().max_depth as u64));
        }
        Ok(out)
    }

    /// The children of `dir`, which callers know to be a directory.
    fn children(&mut self, dir: usize) -> Result<&mut BTreeMap<Vec<u8>, usize>> {
        match &mut self.inodes[dir].kind {
            TKind::Dir(c) => Ok(c),
            _ => Err(Error::Corrupt(
                "tar tree: children of a non-directory".into(),
            )),
        }
    }

    /// The directory holding `comps` (all but the last), creating implied directories.
    fn parent(&mut self, comps: &[Vec<u8>], raw: &[u8]) -> Result<usize> {
        let mut cur = 0;
        for (depth, c) in comps[..comps.len().saturating_sub(1)].iter().enumerate() {
            let next = self.children(cur)?.get(c).copied();
            cur = match next {
                Some(i) => match self.inodes[i].kind {
                    TKind::Dir(_) => i,
                    TKind::Symlink(_) => {
                        return Err(unsafe_entry(
                            raw,
                            format!(
                                "parent {:?} is a symlink",
                                lossy(&comps[..=depth].join(&b'/'))
                            ),
                        ))
                    }
                    _ => {
                        return Err(unsafe_entry(
                            raw,
                            format!(
                                "parent {:?} is not a directory",
                                lossy(&comps[..=depth].join(&b'/'))
                            ),
                        ))
                    }
                },
                None => {
                    let idx = self.inodes.len();
                    let d = self.implied_dir(comps[..=depth].join(&b'/'));
                    self.inodes.push(d);
                    self.children(cur)?.insert(c.clone(), idx);
                    idx
                }
            };
        }
        Ok(cur)
    }

    /// Finds an existing entry (for hard links) without creating anything.
    fn lookup(&self, comps: &[Vec<u8>], raw: &[u8]) -> Result<Option<usize>> {
        let mut cur = 0;
        for (depth, c) in comps.iter().enumerate() {
            let TKind::Dir(children) = &self.inodes[cur].kind else {
                let what = if matches!(self.inodes[cur].kind, TKind::Symlink(_)) {
                    "a symlink"
                } else {
                    "not a directory"
                };
                return Err(unsafe_entry(
                    raw,
                    format!(
                        "hard link target parent {:?} is {what}",
                        lossy(&comps[..depth].join(&b'/'))
                    ),
                ));
            };
            match children.get(c) {
                Some(&i) => cur = i,
                None => return Ok(None),
            }
        }
        Ok(Some(cur))
    }

    /// Places a new inode at `comps` (replacing what was there). A directory over a
    /// directory (the root included: empty `comps`) only updates its attributes.
    fn insert(&mut self, comps: &[Vec<u8>], raw: &[u8], inode: TInode) -> Result<()> {
        let (parent, name, old) = match comps.last() {
            None => (0, Vec::new(), Some(0)),
            Some(name) => {
                let parent = self.parent(comps, raw)?;
                let old = self.children(parent)?.get(name).copied();
                (parent, name.clone(), old)
            }
        };
        if let (Some(i), TKind::Dir(_)) = (old, &inode.kind) {
            if matches!(self.inodes[i].kind, TKind::Dir(_)) {
                // Directory over directory: attributes only.
                let mut inode = inode;
                self.inodes[i].take_attributes(&mut inode);
                return Ok(());
            }
        }
        if comps.is_empty() {
            return Err(unsafe_entry(raw, "the root must be a directory"));
        }
        let idx = self.inodes.len();
        self.inodes.push(inode);
        self.children(parent)?.insert(name, idx);
        Ok(())
    }

    /// Reserves `size` bytes of spool at a 4 KiB-aligned offset for the entry `raw`, within
    /// [`TarOptions::max_total_size`] (the spool's end, alignment included).
    fn alloc(&mut self, size: u64, raw: &[u8]) -> Result<u64> {
        let max = self.tar().max_total_size;
        let base = self
            .spool_end
            .checked_next_multiple_of(4096)
            .ok_or_else(|| limit(raw, "total size", max))?;
        self.spool_end = base
            .checked_add(size)
            .filter(|&end| end <= max)
            .ok_or_else(|| limit(raw, "total size", max))?;
        Ok(base)
    }

    /// Copies `len` bytes of the stream into the spool at `at` (zero blocks skipped).
    fn copy(&mut self, s: &mut Stream, mut len: u64, mut at: u64, raw: &[u8]) -> Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        let r = (|| {
            while len > 0 {
                let k = len.min(buf.len() as u64) as usize;
                s.exact(&mut buf[..k], raw)?;
                write_nonzero(self.spool, &buf[..k], at).map_err(io_err("write the tar spool"))?;
                len -= k as u64;
                at += k as u64;
            }
            Ok(())
        })();
        self.buf = buf;
        r
    }
}

/// Reads a GNU sparse 1.0 map from the start of the data; returns (map, bytes consumed).
fn read_map_in_data(
    s: &mut Stream,
    max: u64,
    size: u64,
    raw: &[u8],
) -> Result<(Vec<(u64, u64)>, u64)> {
    let mut block = [0u8; BLOCK];
    let mut pos = BLOCK;
    let mut used = 0u64;
    let mut next_number = |s: &mut Stream| -> Result<u64> {
        let mut v: u64 = 0;
        let mut digits = 0;
        loop {
            if pos == BLOCK {
                if used + BLOCK as u64 > size {
                    return Err(bad(s.pos, raw, "sparse map runs past the entry's data"));
                }
                s.exact(&mut block, raw)?;
                used += BLOCK as u64;
                pos = 0;
            }
            let b = block[pos];
            pos += 1;
            match b {
                b'0'..=b'9' if digits < 20 => {
                    v = v
                        .checked_mul(10)
                        .and_then(|v| v.checked_add(u64::from(b - b'0')))
                        .ok_or_else(|| bad(s.pos, raw, "sparse map number too large"))?;
                    digits += 1;
                }
                b'\n' if digits > 0 => return Ok(v),
                _ => return Err(bad(s.pos, raw, "bad sparse map")),
            }
        }
    };
    let n = next_number(s)?;
    if n > max {
        return Err(limit(raw, "sparse segments", max));
    }
    let mut map = Vec::new();
    for _ in 0..n {
        let off = next_number(s)?;
        let len = next_number(s)?;
        map.push((off, len));
    }
    Ok((map, used))
}

/// Checks a sparse map against the real size and the stored data size.
fn check_map(map: &[(u64, u64)], real: u64, data: u64, off: u64, raw: &[u8]) -> Result<()> {
    let mut end = 0u64;
    let mut total = 0u64;
    for &(o, l) in map {
        let e = o
            .checked_add(l)
            .filter(|&e| o >= end && e <= real)
            .ok_or_else(|| bad(off, raw, "sparse map out of order or past the file size"))?;
        end = e;
        total += l;
    }
    if total != data {
        return Err(bad(
            off,
            raw,
            "sparse map does not match the stored data size",
        ));
    }
    Ok(())
}

/// Reads the whole tar stream into a tree, file data into `spool`; returns the writer's
/// nodes (breadth-first, sorted, root first) with spool offsets.
pub(crate) fn read_tar(
    input: Box<dyn Read + Send>,
    spool: &File,
    opts: &BuildOptions,
    progress: &ProgressGuard<'_>,
) -> Result<Vec<Node>> {
    let (inodes, end) = read_tree(input, spool, 0, opts, progress)?;
    spool.set_len(end).map_err(io_err("size the tar spool"))?;
    Ok(flatten(inodes))
}

/// Reads one tar stream into an arena tree (index 0: the root), file data into `spool` from
/// `spool_start` on (4 KiB aligned); returns the arena and the end of the spool used.
pub(crate) fn read_tree(
    input: Box<dyn Read + Send>,
    spool: &File,
    spool_start: u64,
    opts: &BuildOptions,
    progress: &ProgressGuard<'_>,
) -> Result<(Vec<TInode>, u64)> {
    let (r, compressed) = decompress(input)?;
    let mut s = Stream { r, pos: 0 };
    let mut b = Builder {
        inodes: Vec::new(),
        spool,
        spool_end: spool_start,
        opts,
        buf: vec![0u8; 1 << 20],
    };
    let root = b.implied_dir(Vec::new());
    b.inodes.push(root);
    let tar = opts.tar.clone();
    let mut global = Globals::default();
    let mut local: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    // Bytes (key + value) of the pending `x` records and of every `g` record so far.
    let (mut local_held, mut global_held) = (0u64, 0u64);
    let mut long_name: Option<Vec<u8>> = None;
    let mut long_link: Option<Vec<u8>> = None;
    let mut h = [0u8; BLOCK];
    let mut reported = 0u64;
    loop {
        let off = s.pos;
        let pending = !local.is_empty() || long_name.is_some() || long_link.is_some();
        let n = s.fill(&mut h, b"")?;
        if n == 0 || h.iter().all(|&x| x == 0) {
            if pending {
                return Err(bad(off, b"", "extended header without a following entry"));
            }
            if n != 0 && n != BLOCK {
                return Err(Error::Truncated {
                    offset: s.pos,
                    entry: String::new(),
                });
            }
            break;
        }
        if n < BLOCK {
            return Err(Error::Truncated {
                offset: s.pos,
                entry: String::new(),
            });
        }
        let hname = cstr(&h[..100]).to_vec();
        if !checksum_ok(&h) {
            return Err(bad(off, &hname, "header checksum mismatch"));
        }
        let typeflag = h[156];
        let size = unsigned(&h[124..136], "size", off, &hname)?;
        // Extended headers: read their data (bounded) and go on to the next header.
        if matches!(typeflag, b'L' | b'K' | b'x' | b'X' | b'g') {
            if size > tar.max_meta_size {
                return Err(limit(&hname, "extended header size", tar.max_meta_size));
            }
            let mut data = vec![0u8; size as usize];
            s.exact(&mut data, &hname)?;
            s.skip(padding(size), &hname)?;
            let held = |recs: &[(Vec<u8>, Vec<u8>)]| -> u64 {
                recs.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum()
            };
            match typeflag {
                b'L' => long_name = Some(cstr(&data).to_vec()),
                b'K' => long_link = Some(cstr(&data).to_vec()),
                b'g' => {
                    let recs = parse_pax(&data, off, &hname)?;
                    global_held += held(&recs);
                    global.merge(recs, off, &hname)?;
                }
                _ => {
                    let recs = parse_pax(&data, off, &hname)?;
                    local_held += held(&recs);
                    local.extend(recs);
                }
            }
            if local_held + global_held > tar.max_meta_size.saturating_mul(4) {
                return Err(limit(&hname, "extended header size", tar.max_meta_size));
            }
            continue;
        }
        let mut e = Entry {
            typeflag,
            size,
            ..Default::default()
        };
        let ustar = &h[257..263] == b"ustar\0";
        let gnu = &h[257..265] == b"ustar  \0";
        e.path = match long_name.take() {
            Some(n) => n,
            None if ustar && h[345] != 0 => {
                let mut p = cstr(&h[345..500]).to_vec();
                p.push(b'/');
                p.extend_from_slice(&hname);
                p
            }
            None => hname.clone(),
        };
        e.link = long_link
            .take()
            .unwrap_or_else(|| cstr(&h[157..257]).to_vec());
        e.mode = (unsigned(&h[100..108], "mode", off, &hname)? & 0o7777) as u16;
        e.uid = unsigned(&h[108..116], "uid", off, &hname)?;
        e.gid = unsigned(&h[116..124], "gid", off, &hname)?;
        e.mtime = number(&h[136..148])
            .and_then(|v| i64::try_from(v).ok())
            .ok_or_else(|| bad(off, &hname, "bad mtime field"))?;
        if ustar || gnu {
            e.devmajor = unsigned(&h[329..337], "devmajor", off, &hname)?;
            e.devminor = unsigned(&h[337..345], "devminor", off, &hname)?;
        }
        if typeflag == b'S' {
            let mut sp = Sparse {
                real_size: Some(unsigned(&h[483..495], "realsize", off, &hname)?),
                ..Default::default()
            };
            let push = |f: &[u8], sp: &mut Sparse| -> Result<bool> {
                if f[..12].iter().all(|&x| x == 0) {
                    return Ok(false);
                }
                let o = unsigned(&f[..12], "sparse offset", off, &hname)?;
                let l = unsigned(&f[12..24], "sparse length", off, &hname)?;
                if sp.map.len() as u64 >= tar.max_sparse_segments {
                    return Err(limit(&hname, "sparse segments", tar.max_sparse_segments));
                }
                sp.map.push((o, l));
                Ok(true)
            };
            for i in 0..4 {
                if !push(&h[386 + 24 * i..410 + 24 * i], &mut sp)? {
                    break;
                }
            }
            let mut extended = h[482] != 0;
            let mut x = [0u8; BLOCK];
            while extended {
                s.exact(&mut x, &hname)?;
                for i in 0..21 {
                    if !push(&x[24 * i..24 * i + 24], &mut sp)? {
                        break;
                    }
                }
                extended = x[504] != 0;
            }
            e.sparse = Some(sp);
        }
        global.apply(&mut e, b.opts.xattrs);
        apply_pax(&mut e, &local, off, &hname, &tar)?;
        local.clear();
        local_held = 0;
        add_entry(&mut b, &mut s, e, off)?;
        progress.scanned(1, s.pos - reported);
        reported = s.pos;
    }
    if compressed {
        // Let the decompressor see its end (gzip CRC and length, complete zstd frames), so
        // that a damaged or cut download is an error even past the end-of-archive block
        // (up to 16 MiB of trailing padding is read, no more).
        let mut buf = [0u8; 8192];
        let stop = s.pos.saturating_add(16 << 20);
        while s.pos < stop && s.fill(&mut buf, b"")? > 0 {}
    }
    Ok((b.inodes, b.spool_end))
}

/// The xattr a `SCHILY.xattr.NAME` or `LIBARCHIVE.xattr.NAME` record sets, if it is one.
fn pax_xattr(key: &[u8], v: &[u8], off: u64, raw: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
    if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
        return Ok(Some((name.to_vec(), v.to_vec())));
    }
    let Some(name) = key.strip_prefix(b"LIBARCHIVE.xattr.") else {
        return Ok(None);
    };
    let name = percent_decode(name).ok_or_else(|| bad(off, raw, "bad LIBARCHIVE.xattr name"))?;
    let value = base64_decode(v).ok_or_else(|| bad(off, raw, "bad LIBARCHIVE.xattr value"))?;
    Ok(Some((name, value)))
}

fn pax_mtime(v: &[u8], off: u64, raw: &[u8]) -> Result<(i64, u32)> {
    pax_time(v).ok_or_else(|| bad(off, raw, "bad PAX mtime"))
}

/// What the global (`g`) PAX records read so far set: mtime, uid, gid and xattrs (the
/// other keys are ignored). Records are merged as they are read (a later one replaces what
/// an earlier one set, which is what applying them all in order gives), so each entry costs
/// O(distinct names), not O(records).
#[derive(Default)]
struct Globals {
    mtime: Option<(i64, u32)>,
    uid: Option<u64>,
    gid: Option<u64>,
    /// By decoded xattr name.
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Globals {
    /// Merges the records of one `g` header (at `off`, named `raw`).
    fn merge(&mut self, recs: Vec<(Vec<u8>, Vec<u8>)>, off: u64, raw: &[u8]) -> Result<()> {
        for (k, v) in recs {
            match k.as_slice() {
                b"mtime" => self.mtime = Some(pax_mtime(&v, off, raw)?),
                b"uid" => self.uid = Some(pax_u64(&v, "uid", off, raw)?),
                b"gid" => self.gid = Some(pax_u64(&v, "gid", off, raw)?),
                key => {
                    if let Some((name, value)) = pax_xattr(key, &v, off, raw)? {
                        self.xattrs.insert(name, value);
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets what the global records set on `e` (before its own `x` records are applied);
    /// the xattrs only if they are kept.
    fn apply(&self, e: &mut Entry, xattrs: bool) {
        if let Some(t) = self.mtime {
            (e.mtime, e.nsec) = t;
        }
        if let Some(uid) = self.uid {
            e.uid = uid;
        }
        if let Some(gid) = self.gid {
            e.gid = gid;
        }
        if xattrs {
            e.xattrs
                .extend(self.xattrs.iter().map(|(n, v)| (n.clone(), v.clone())));
        }
    }
}

/// Applies an entry's own (`x`) PAX records.
fn apply_pax(
    e: &mut Entry,
    recs: &[(Vec<u8>, Vec<u8>)],
    off: u64,
    raw: &[u8],
    tar: &TarOptions,
) -> Result<()> {
    let mut sparse_offsets: Vec<u64> = Vec::new();
    for (k, v) in recs {
        let key = k.as_slice();
        if let Some(x) = pax_xattr(key, v, off, raw)? {
            e.xattrs.push(x);
            continue;
        }
        match key {
            b"mtime" => (e.mtime, e.nsec) = pax_mtime(v, off, raw)?,
            b"uid" => e.uid = pax_u64(v, "uid", off, raw)?,
            b"gid" => e.gid = pax_u64(v, "gid", off, raw)?,
            b"path" => e.path = v.clone(),
            b"linkpath" => e.link = v.clone(),
            b"size" => e.size = pax_u64(v, "size", off, raw)?,
            b"GNU.sparse.major" | b"GNU.sparse.minor" => {
                let sp = e.sparse.get_or_insert_with(Sparse::default);
                if key == b"GNU.sparse.major" {
                    sp.map_in_data = pax_u64(v, "GNU.sparse.major", off, raw)? == 1;
                }
            }
            b"GNU.sparse.name" => e.path = v.clone(),
            b"GNU.sparse.realsize" | b"GNU.sparse.size" => {
                e.sparse.get_or_insert_with(Sparse::default).real_size =
                    Some(pax_u64(v, "GNU.sparse.size", off, raw)?)
            }
            b"GNU.sparse.offset" => sparse_offsets.push(pax_u64(v, "GNU.sparse.offset", off, raw)?),
            b"GNU.sparse.numbytes" => {
                let o = sparse_offsets
                    .pop()
                    .ok_or_else(|| bad(off, raw, "GNU.sparse.numbytes without an offset"))?;
                let l = pax_u64(v, "GNU.sparse.numbytes", off, raw)?;
                e.sparse
                    .get_or_insert_with(Sparse::default)
                    .map
                    .push((o, l));
            }
            b"GNU.sparse.map" => {
                let sp = e.sparse.get_or_insert_with(Sparse::default);
                let nums = v
                    .split(|&b| b == b',')
                    .map(|n| pax_u64(n, "GNU.sparse.map", off, raw))
                    .collect::<Result<Vec<u64>>>()?;
                if nums.len() % 2 != 0 {
                    return Err(bad(off, raw, "odd GNU.sparse.map"));
                }
                sp.map = nums.chunks(2).map(|c| (c[0], c[1])).collect();
            }
            _ => {}
        }
        if let Some(sp) = &e.sparse {
            if sp.map.len() as u64 > tar.max_sparse_segments {
                return Err(limit(raw, "sparse segments", tar.max_sparse_segments));
            }
        }
    }
    Ok(())
}

fn xattrs_of(b: &Builder<'_>, e: &mut Entry) -> Result<Vec<Xattr>> {
    if !b.opts.xattrs {
        return Ok(Vec::new());
    }
    let path = os_path(&e.path);
    let mut by_name: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for (n, v) in std::mem::take(&mut e.xattrs) {
        by_name.insert(n, v);
    }
    let mut out = Vec::with_capacity(by_name.len());
    for (n, v) in by_name {
        if n.contains(&0) {
            return Err(unsafe_entry(&e.path, "NUL byte in an xattr name"));
        }
        out.push(make_xattr(&path, &n, v)?);
    }
    out.sort();
    Ok(out)
}

fn os_path(b: &[u8]) -> PathBuf {
    PathBuf::from(std::ffi::OsStr::from_bytes(b))
}

/// Adds one member to the tree and consumes its data (into the spool or skipped).
fn add_entry(b: &mut Builder<'_>, s: &mut Stream, mut e: Entry, off: u64) -> Result<()> {
    let raw = e.path.clone();
    let (max_file_size, max_sparse_segments) = (b.tar().max_file_size, b.tar().max_sparse_segments);
    let skip_all = |s: &mut Stream, size: u64| -> Result<()> {
        s.skip(size, &raw)?;
        s.skip(padding(size), &raw)
    };
    let comps = b.components(&raw)?;
    let uid = u32::try_from(e.uid).map_err(|_| Error::UnsupportedInput {
        path: os_path(&raw),
        reason: "uid does not fit 32 bits".into(),
    })?;
    let gid = u32::try_from(e.gid).map_err(|_| Error::UnsupportedInput {
        path: os_path(&raw),
        reason: "gid does not fit 32 bits".into(),
    })?;
    let last = comps.last().cloned().unwrap_or_default();
    // OCI whiteouts.
    if last == b".wh..wh..opq" {
        let parent = b.parent(&comps, &raw)?;
        b.inodes[parent].opaque = true;
        return skip_all(s, e.size);
    }
    if last.starts_with(b".wh..wh.") {
        return skip_all(s, e.size);
    }
    let mut comps = comps;
    let mut typeflag = e.typeflag;
    let mut whiteout = false;
    if let Some(name) = last.strip_prefix(b".wh.") {
        if name.is_empty() || name == b"." || name == b".." {
            return Err(unsafe_entry(&raw, "whiteout of an invalid name"));
        }
        let name = name.to_vec();
        if let Some(l) = comps.last_mut() {
            *l = name;
        }
        typeflag = b'3';
        whiteout = true;
    }
    let old_style_dir = matches!(typeflag, b'0' | 0) && raw.ends_with(b"/");
    if comps.is_empty() && !matches!(typeflag, b'5' | b'D') && !old_style_dir {
        return Err(unsafe_entry(&raw, "the root must be a directory"));
    }
    let xattrs = xattrs_of(b, &mut e)?;
    let mut inode = TInode {
        path: comps.join(&b'/'),
        kind: TKind::Reg,
        perm: e.mode,
        uid,
        gid,
        mtime: e.mtime,
        nsec: e.nsec,
        xattrs,
        size: 0,
        rdev: 0,
        spool: None,
        opaque: false,
        implied: false,
    };
    match typeflag {
        _ if whiteout => {
            inode.kind = TKind::Special(ft::CHR);
            b.insert(&comps, &raw, inode)?;
            skip_all(s, e.size)
        }
        b'0' | 0 | b'7' | b'S' if raw.ends_with(b"/") && e.sparse.is_none() => {
            inode.kind = TKind::Dir(BTreeMap::new());
            b.insert(&comps, &raw, inode)?;
            skip_all(s, e.size)
        }
        b'0' | 0 | b'7' | b'S' => {
            let Some(sp) = e.sparse.take() else {
                if e.size > max_file_size {
                    return Err(limit(&raw, "file size", max_file_size));
                }
                let base = b.alloc(e.size, &raw)?;
                b.copy(s, e.size, base, &raw)?;
                s.skip(padding(e.size), &raw)?;
                inode.size = e.size;
                inode.spool = Some(base);
                return b.insert(&comps, &raw, inode);
            };
            let real = sp
                .real_size
                .ok_or_else(|| bad(off, &raw, "sparse file without a real size"))?;
            if real > max_file_size {
                return Err(limit(&raw, "file size", max_file_size));
            }
            let (map, map_bytes) = if sp.map_in_data {
                read_map_in_data(s, max_sparse_segments, e.size, &raw)?
            } else {
                (sp.map, 0)
            };
            check_map(&map, real, e.size - map_bytes, off, &raw)?;
            let base = b.alloc(real, &raw)?;
            for (o, l) in map {
                b.copy(s, l, base + o, &raw)?;
            }
            s.skip(padding(e.size), &raw)?;
            inode.size = real;
            inode.spool = Some(base);
            b.insert(&comps, &raw, inode)
        }
        b'1' => {
            skip_all(s, e.size)?;
            let target = b.components(&e.link)?;
            let found = b.lookup(&target, &raw)?.ok_or_else(|| {
                unsafe_entry(
                    &raw,
                    format!(
                        "hard link target {:?} is not an earlier entry",
                        lossy(&e.link)
                    ),
                )
            })?;
            if matches!(b.inodes[found].kind, TKind::Dir(_)) {
                return Err(unsafe_entry(&raw, "hard link to a directory"));
            }
            if comps == target {
                return Ok(());
            }
            let parent = b.parent(&comps, &raw)?;
            let name = comps.last().cloned().unwrap_or_default();
            b.children(parent)?.insert(name, found);
            Ok(())
        }
        b'2' => {
            skip_all(s, e.size)?;
            if e.link.is_empty() || e.link.len() >= 4096 || e.link.contains(&0) {
                return Err(Error::UnsupportedInput {
                    path: os_path(&raw),
                    reason: "symlink target empty, longer than 4095 bytes or with a NUL".into(),
                });
            }
            inode.size = e.link.len() as u64;
            inode.kind = TKind::Symlink(e.link);
            b.insert(&comps, &raw, inode)
        }
        b'3' | b'4' => {
            skip_all(s, e.size)?;
            if e.devmajor > 0xfff || e.devminor > 0xf_ffff {
                return Err(Error::UnsupportedInput {
                    path: os_path(&raw),
                    reason: "device number does not fit 32 bits".into(),
                });
            }
            inode.rdev = encode_dev(e.devmajor as u32, e.devminor as u32);
            inode.kind = TKind::Special(if typeflag == b'3' { ft::CHR } else { ft::BLK });
            b.insert(&comps, &raw, inode)
        }
        b'6' => {
            skip_all(s, e.size)?;
            inode.kind = TKind::Special(ft::FIFO);
            b.insert(&comps, &raw, inode)
        }
        b'5' | b'D' => {
            skip_all(s, e.size)?;
            inode.kind = TKind::Dir(BTreeMap::new());
            b.insert(&comps, &raw, inode)
        }
        b'V' => skip_all(s, e.size),
        t => Err(bad(
            off,
            &raw,
            format!("unsupported entry type {:?}", char::from(t)),
        )),
    }
}

/// Turns the arena into the writer's nodes: breadth first from the root, children in name
/// order, each inode once (hard links counted in `nlink`), unreachable inodes dropped.
pub(crate) fn flatten(mut inodes: Vec<TInode>) -> Vec<Node> {
    let mut map = vec![usize::MAX; inodes.len()];
    let mut nodes = Vec::new();
    let make = |t: &mut TInode, parent: usize| -> Node {
        let (kind, type_bits) = match &mut t.kind {
            TKind::Dir(_) => (
                Kind::Dir {
                    children: Vec::new(),
                    parent,
                },
                S_IFDIR,
            ),
            TKind::Reg => (Kind::Reg, S_IFREG),
            TKind::Symlink(target) => (Kind::Symlink(std::mem::take(target)), S_IFLNK),
            TKind::Special(f) => (
                Kind::Special(*f),
                match *f {
                    ft::CHR => S_IFCHR,
                    ft::BLK => S_IFBLK,
                    _ => S_IFIFO,
                },
            ),
        };
        let mut xattrs = std::mem::take(&mut t.xattrs);
        if t.opaque {
            let x: Xattr = (
                crate::ondisk::xattr_index::TRUSTED,
                b"overlay.opaque".to_vec(),
                b"y".to_vec(),
            );
            xattrs.retain(|(i, n, _)| (*i, n.as_slice()) != (x.0, x.1.as_slice()));
            xattrs.push(x);
            xattrs.sort();
        }
        Node::new(
            PathBuf::from(std::ffi::OsString::from_vec(std::mem::take(&mut t.path))),
            kind,
            type_bits | t.perm,
            (t.uid, t.gid),
            (t.mtime, t.nsec),
            t.size,
            t.rdev,
            xattrs,
            t.spool,
        )
    };
    nodes.push(make(&mut inodes[0], 0));
    map[0] = 0;
    let mut queue = VecDeque::from([0usize]);
    while let Some(t) = queue.pop_front() {
        let dir_node = map[t];
        let TKind::Dir(children) = std::mem::replace(&mut inodes[t].kind, TKind::Reg) else {
            continue;
        };
        let mut list = Vec::with_capacity(children.len());
        let mut subdirs = 0u32;
        for (name, c) in children {
            if map[c] != usize::MAX {
                let n: &mut Node = &mut nodes[map[c]];
                n.nlink = n.nlink.saturating_add(1);
                list.push((name, map[c]));
                continue;
            }
            let is_dir = matches!(inodes[c].kind, TKind::Dir(_));
            let node = make(&mut inodes[c], dir_node);
            map[c] = nodes.len();
            list.push((name, nodes.len()));
            nodes.push(node);
            if is_dir {
                subdirs = subdirs.saturating_add(1);
                queue.push_back(c);
            }
        }
        nodes[dir_node].nlink = 2u32.saturating_add(subdirs);
        if let Kind::Dir { children, .. } = &mut nodes[dir_node].kind {
            *children = list;
        }
    }
    nodes
}

/// Parses `data` as a tar stream with its data spooled into a file in `temp_dir`, and
/// returns the number of inodes the tree would have. For the `tar_input` fuzz target.
pub fn fuzz_read_tar(data: &[u8], temp_dir: &Path) -> Result<usize> {
    let spool = crate::source::create_spool(temp_dir)?;
    let opts = BuildOptions {
        tar: TarOptions {
            max_file_size: 1 << 30,
            ..TarOptions::default()
        },
        ..BuildOptions::default()
    };
    let nodes = read_tar(
        Box::new(Cursor::new(data.to_vec())),
        &spool,
        &opts,
        &ProgressGuard(None),
    )?;
    Ok(nodes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_octal_and_base256() {
        assert_eq!(number(b"0000644\0"), Some(0o644));
        assert_eq!(number(b"  644 \0"), Some(0o644));
        assert_eq!(number(b"\0\0\0\0"), Some(0));
        assert_eq!(number(b"64x\0"), None);
        assert_eq!(
            number(&[0x80, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]),
            Some(1 << 32)
        );
        assert_eq!(number(&[0xff; 8]), Some(-1));
        assert_eq!(
            number(&[0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            None
        );
    }

    #[test]
    fn pax_times_and_records() {
        assert_eq!(
            pax_time(b"1700000000.123456789"),
            Some((1_700_000_000, 123_456_789))
        );
        assert_eq!(pax_time(b"5.1"), Some((5, 100_000_000)));
        assert_eq!(pax_time(b"-1.5"), Some((-2, 500_000_000)));
        assert_eq!(pax_time(b"-3"), Some((-3, 0)));
        assert_eq!(pax_time(b"1.2345678901"), Some((1, 234_567_890)));
        assert_eq!(pax_time(b"x"), None);
        assert_eq!(pax_time(b".5"), None);
        let r = parse_pax(b"12 path=a/b\n6 x=y\n", 0, b"").unwrap();
        assert_eq!(
            r,
            vec![
                (b"path".to_vec(), b"a/b".to_vec()),
                (b"x".to_vec(), b"y".to_vec())
            ]
        );
        assert!(parse_pax(b"13 path=a/b\n", 0, b"").is_err());
        assert!(parse_pax(b"99999999999999999999999 a=b\n", 0, b"").is_err());
        assert!(parse_pax(b"5 ab\n", 0, b"").is_err());
    }

    #[test]
    fn decoders() {
        assert_eq!(base64_decode(b"aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode(b"aGVsbG8").unwrap(), b"hello");
        assert!(base64_decode(b"a*").is_none());
        assert_eq!(percent_decode(b"user.a%3Db").unwrap(), b"user.a=b");
        assert!(percent_decode(b"%zz").is_none());
        assert!(percent_decode(b"%4").is_none());
    }
}
