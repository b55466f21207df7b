//! A small, deterministic tar writer: POSIX ustar headers, with a PAX extended header (`x`)
//! before an entry whenever ustar cannot hold something exactly: a name or link target over
//! 100 bytes (`path`, `linkpath`), an mtime that is negative, too large or has nanoseconds
//! (`mtime=S.NNNNNNNNN`), ids over 2^21 - 1 (`uid`, `gid`), a size over 8 GiB - 1 (`size`),
//! and every xattr (`SCHILY.xattr.NAME`, raw value bytes). Nothing else varies: uname and
//! gname are empty, the PAX header's own fields are zero. The archive ends with two zero
//! blocks.

use std::io::{self, Write};

const BLOCK: usize = 512;

/// The type of a tar entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryType {
    /// Regular file (`0`).
    File,
    /// Hard link to an earlier entry (`1`).
    Hardlink,
    /// Symbolic link (`2`).
    Symlink,
    /// Character device (`3`).
    Char,
    /// Block device (`4`).
    Block,
    /// Directory (`5`).
    Dir,
    /// Fifo (`6`).
    Fifo,
}

impl EntryType {
    fn flag(self) -> u8 {
        match self {
            EntryType::File => b'0',
            EntryType::Hardlink => b'1',
            EntryType::Symlink => b'2',
            EntryType::Char => b'3',
            EntryType::Block => b'4',
            EntryType::Dir => b'5',
            EntryType::Fifo => b'6',
        }
    }
}

/// One entry's header.
#[derive(Debug, Clone)]
pub struct Header {
    /// The name (directories conventionally end with `/`).
    pub path: Vec<u8>,
    /// The type.
    pub kind: EntryType,
    /// Permission bits (07777).
    pub mode: u32,
    /// Owner.
    pub uid: u64,
    /// Group.
    pub gid: u64,
    /// Modification time, seconds.
    pub mtime: i64,
    /// Modification time, nanoseconds.
    pub nsec: u32,
    /// Data bytes that follow (regular files only).
    pub size: u64,
    /// Link target (symlinks, hard links).
    pub link: Vec<u8>,
    /// Device numbers (devices).
    pub dev: (u32, u32),
    /// Extended attributes (full name, value), written in this order.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Header {
    /// A header of `kind` for `path` with everything else zero.
    pub fn new(path: impl Into<Vec<u8>>, kind: EntryType) -> Self {
        Header {
            path: path.into(),
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 0,
            nsec: 0,
            size: 0,
            link: Vec::new(),
            dev: (0, 0),
            xattrs: Vec::new(),
        }
    }
}

/// Writes a tar stream to `W`.
#[derive(Debug)]
pub struct TarWriter<W> {
    w: W,
    /// Data bytes still owed by the current entry.
    owed: u64,
    /// Padding after the current entry's data.
    pad: usize,
}

/// Puts `v` in octal into `f` (width-1 digits and a NUL); zeros if it does not fit (a PAX
/// record then holds the value).
fn put_octal(f: &mut [u8], v: u64) {
    let digits = f.len() - 1;
    let s = format!("{v:0digits$o}");
    if s.len() > digits {
        f[..digits].fill(b'0');
    } else {
        f[..digits].copy_from_slice(s.as_bytes());
    }
    f[digits] = 0;
}

fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    // "%d %s=%s\n", where the length counts itself.
    let rest = 1 + key.len() + 1 + value.len() + 1;
    let mut len = rest + 1;
    while len.to_string().len() + rest != len {
        len = len.to_string().len() + rest;
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// The ustar header block of `e` with type `flag`, `size` and `mtime` (already clamped to
/// what the fields hold; a PAX record carries the exact values).
fn ustar_block(e: &Header, flag: u8, size: u64, mtime: u64) -> [u8; BLOCK] {
    let (name, mode, link, dev) = (&e.path, e.mode, &e.link, e.dev);
    let max_id = 0o7777777;
    let ids = (e.uid.min(max_id), e.gid.min(max_id));
    let mut h = [0u8; BLOCK];
    let n = name.len().min(100);
    h[..n].copy_from_slice(&name[..n]);
    put_octal(&mut h[100..108], u64::from(mode & 0o7777));
    put_octal(&mut h[108..116], ids.0);
    put_octal(&mut h[116..124], ids.1);
    put_octal(&mut h[124..136], size);
    put_octal(&mut h[136..148], mtime);
    h[156] = flag;
    let l = link.len().min(100);
    h[157..157 + l].copy_from_slice(&link[..l]);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    put_octal(&mut h[329..337], u64::from(dev.0));
    put_octal(&mut h[337..345], u64::from(dev.1));
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let s = format!("{sum:06o}");
    h[148..154].copy_from_slice(s.as_bytes());
    h[154] = 0;
    h[155] = b' ';
    h
}

impl<W: Write> TarWriter<W> {
    /// A writer over `w`.
    pub fn new(w: W) -> Self {
        TarWriter { w, owed: 0, pad: 0 }
    }

    fn close_entry(&mut self) -> io::Result<()> {
        if self.owed != 0 {
            return Err(io::Error::other("tar entry data short"));
        }
        if self.pad > 0 {
            self.w.write_all(&[0u8; BLOCK][..self.pad])?;
            self.pad = 0;
        }
        Ok(())
    }

    /// Starts an entry; for a regular file, exactly `h.size` bytes must follow through
    /// [`TarWriter::data`].
    pub fn append(&mut self, h: &Header) -> io::Result<()> {
        self.close_entry()?;
        let size = if h.kind == EntryType::File { h.size } else { 0 };
        let mut pax = Vec::new();
        if h.path.len() > 100 {
            pax_record(&mut pax, b"path", &h.path);
        }
        if h.link.len() > 100 {
            pax_record(&mut pax, b"linkpath", &h.link);
        }
        let max_id = 0o7777777;
        if h.uid > max_id {
            pax_record(&mut pax, b"uid", h.uid.to_string().as_bytes());
        }
        if h.gid > max_id {
            pax_record(&mut pax, b"gid", h.gid.to_string().as_bytes());
        }
        if size > 0o77777777777 {
            pax_record(&mut pax, b"size", size.to_string().as_bytes());
        }
        let mtime_ok = (0..=0o77777777777).contains(&h.mtime);
        if !mtime_ok || h.nsec != 0 {
            let v = if h.nsec == 0 {
                h.mtime.to_string()
            } else if h.mtime >= 0 {
                format!("{}.{:09}", h.mtime, h.nsec)
            } else {
                // -S.F means -(S + F): the time h.mtime + nsec is -(|mtime| - nsec).
                let whole = -(h.mtime + 1);
                format!("-{}.{:09}", whole, 1_000_000_000 - h.nsec)
            };
            pax_record(&mut pax, b"mtime", v.as_bytes());
        }
        for (n, v) in &h.xattrs {
            let mut k = b"SCHILY.xattr.".to_vec();
            k.extend_from_slice(n);
            pax_record(&mut pax, &k, v);
        }
        if !pax.is_empty() {
            let block = ustar_block(
                &Header::new(&b"././@PaxHeader"[..], EntryType::File),
                b'x',
                pax.len() as u64,
                0,
            );
            self.w.write_all(&block)?;
            self.w.write_all(&pax)?;
            let pad = pax.len().next_multiple_of(BLOCK) - pax.len();
            self.w.write_all(&[0u8; BLOCK][..pad])?;
        }
        let mtime = if mtime_ok { h.mtime as u64 } else { 0 };
        let block = ustar_block(h, h.kind.flag(), size.min(0o77777777777), mtime);
        self.w.write_all(&block)?;
        self.owed = size;
        self.pad = ((size.next_multiple_of(BLOCK as u64)) - size) as usize;
        Ok(())
    }

    /// Writes data of the current entry.
    pub fn data(&mut self, buf: &[u8]) -> io::Result<()> {
        if buf.len() as u64 > self.owed {
            return Err(io::Error::other("more tar entry data than its size"));
        }
        self.w.write_all(buf)?;
        self.owed -= buf.len() as u64;
        Ok(())
    }

    /// Writes `n` zero bytes of data of the current entry (a hole).
    pub fn zeros(&mut self, mut n: u64) -> io::Result<()> {
        let z = [0u8; 64 << 10];
        while n > 0 {
            let k = n.min(z.len() as u64) as usize;
            self.data(&z[..k])?;
            n -= k as u64;
        }
        Ok(())
    }

    /// Ends the archive (two zero blocks) and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.close_entry()?;
        self.w.write_all(&[0u8; 2 * BLOCK])?;
        self.w.flush()?;
        Ok(self.w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_lengths_count_themselves() {
        for n in [0usize, 1, 5, 90, 95, 96, 97, 98, 990, 995, 996, 1000] {
            let mut v = Vec::new();
            pax_record(&mut v, b"path", &vec![b'a'; n]);
            let sp = v.iter().position(|&b| b == b' ').unwrap();
            let len: usize = std::str::from_utf8(&v[..sp]).unwrap().parse().unwrap();
            assert_eq!(len, v.len(), "{n}");
        }
    }
}
