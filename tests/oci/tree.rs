//! A tree comparison for the OCI tests: every entry's type, permission bits, owner, mtime
//! (seconds and nanoseconds), size, bytes, symlink target, device number, xattrs and
//! hard-link group, between two directory trees.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What to compare.
#[derive(Debug, Clone, Copy)]
pub struct Check {
    /// Compare mtimes' nanoseconds (tools that write ustar/PAX at second precision lose
    /// them; then mtimes are compared to the nearest second).
    pub nsec: bool,
    /// Compare the root directory's own attributes.
    pub root: bool,
}

impl Check {
    pub const EXACT: Check = Check {
        nsec: true,
        root: true,
    };
}

#[derive(Debug, PartialEq, Eq, Clone)]
struct Entry {
    kind: char,
    perm: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, i64),
    size: u64,
    rdev: (u32, u32),
    target: Option<Vec<u8>>,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    links: Vec<PathBuf>,
}

pub fn xattrs(p: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut names = vec![0u8; 1 << 16];
    let n = match rustix::fs::llistxattr(p, &mut names[..]) {
        Ok(n) => n,
        Err(_) => return out,
    };
    for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let mut v = vec![0u8; 1 << 16];
        if let Ok(k) = rustix::fs::lgetxattr(p, OsStr::from_bytes(name), &mut v[..]) {
            v.truncate(k);
            out.insert(name.to_vec(), v);
        }
    }
    out
}

fn walk(root: &Path) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    let mut inodes: HashMap<(u64, u64), Vec<PathBuf>> = HashMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let p = root.join(&rel);
        let m = std::fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("lstat {p:?}: {e}"));
        let ft = m.file_type();
        let kind = if ft.is_dir() {
            'd'
        } else if ft.is_file() {
            'f'
        } else if ft.is_symlink() {
            'l'
        } else if ft.is_char_device() {
            'c'
        } else if ft.is_block_device() {
            'b'
        } else if ft.is_fifo() {
            'p'
        } else {
            's'
        };
        if ft.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(rel.join(e.unwrap().file_name()));
            }
        } else if m.nlink() > 1 {
            inodes
                .entry((m.dev(), m.ino()))
                .or_default()
                .push(rel.clone());
        }
        let dev = m.rdev();
        out.insert(
            rel,
            Entry {
                kind,
                perm: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
                mtime: (m.mtime(), m.mtime_nsec()),
                size: if ft.is_dir() { 0 } else { m.len() },
                rdev: if ft.is_char_device() || ft.is_block_device() {
                    (rustix::fs::major(dev), rustix::fs::minor(dev))
                } else {
                    (0, 0)
                },
                target: ft.is_symlink().then(|| {
                    std::fs::read_link(&p)
                        .unwrap()
                        .as_os_str()
                        .as_bytes()
                        .to_vec()
                }),
                xattrs: xattrs(&p),
                links: Vec::new(),
            },
        );
    }
    for mut group in inodes.into_values() {
        group.sort();
        for p in &group {
            if let Some(e) = out.get_mut(p) {
                e.links = group.clone();
            }
        }
    }
    out
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    let (mut fa, mut fb) = (File::open(a).unwrap(), File::open(b).unwrap());
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = read_full(&mut fa, &mut ba);
        let m = read_full(&mut fb, &mut bb);
        if n != m || ba[..n] != bb[..m] {
            return false;
        }
        if n == 0 {
            return true;
        }
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

/// The differences between the trees `a` and `b` (empty when they are the same), each a
/// line naming the path and the attribute. Also returns the number of entries compared.
pub fn diff(a: &Path, b: &Path, c: Check) -> (Vec<String>, usize) {
    let (ta, tb) = (walk(a), walk(b));
    let mut out = Vec::new();
    for (p, ea) in &ta {
        let Some(eb) = tb.get(p) else {
            out.push(format!("{p:?}: only in {}", a.display()));
            continue;
        };
        if p.as_os_str().is_empty() && !c.root {
            continue;
        }
        let (mut ea, mut eb) = (ea.clone(), eb.clone());
        if !c.nsec {
            // To the nearest second, as Go's archive/tar rounds a time it writes without
            // a fraction.
            for e in [&mut ea, &mut eb] {
                e.mtime = (e.mtime.0 + i64::from(e.mtime.1 >= 500_000_000), 0);
            }
        }
        if ea != eb {
            out.push(format!("{p:?}: {ea:?} != {eb:?}"));
            continue;
        }
        if ea.kind == 'f' && !same_bytes(&a.join(p), &b.join(p)) {
            out.push(format!("{p:?}: contents differ"));
        }
    }
    for p in tb.keys() {
        if !ta.contains_key(p) {
            out.push(format!("{p:?}: only in {}", b.display()));
        }
    }
    (out, ta.len())
}

/// Panics with the first differences unless the trees are the same.
pub fn assert_same(a: &Path, b: &Path, c: Check, what: &str) {
    let (d, n) = diff(a, b, c);
    assert!(
        d.is_empty(),
        "{what}: {} of {n} entries differ between {} and {}:\n{}",
        d.len(),
        a.display(),
        b.display(),
        d.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
    );
    eprintln!("{what}: {n} entries identical");
}
