//! Local files replaced atomically.
//!
//! [`write_atomic`] (one buffer) and [`AtomicFile`] (written as the caller goes) put the new
//! content in a temporary file in the destination's directory, fsync it, rename it over the
//! destination and fsync the directory: a reader sees the old file or the new one, never a
//! partial one, and after a crash the new file is either wholly there or not at all.
//!
//! The temporary file is `.NAME.tmp-PID-N` (`NAME` cut to 200 bytes), created exclusively: `N`
//! counts up within the process, the pid keeps processes apart, and a name that a crashed
//! process left behind is skipped rather than reused. A write that fails, and an
//! [`AtomicFile`] dropped without [`AtomicFile::commit`], remove the temporary file and leave
//! the destination as it was. Errors are the operating system's, as they came (so that callers
//! keep the errno): the caller names the file in its own message.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The longest part of the destination's name kept in a temporary name (`NAME_MAX` is 255).
const NAME_KEPT: usize = 200;
/// Temporary names tried before giving up (each taken one was left by another writer).
const NAME_TRIES: u32 = 64;

/// Numbers temporary names within this process.
static NEXT_TMP: AtomicU64 = AtomicU64::new(0);

/// Replace `path` with `bytes` atomically (see the module docs).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = AtomicFile::create(path)?;
    file.file_mut().write_all(bytes)?;
    file.commit()
}

/// A file being written under a temporary name, that replaces its destination when committed
/// (see the module docs): for content written piece by piece.
#[derive(Debug)]
pub struct AtomicFile {
    file: File,
    tmp: PathBuf,
    path: PathBuf,
    committed: bool,
}

impl AtomicFile {
    /// Create the temporary file that will replace `path`. Fails if `path` names no file
    /// (`/`, `..`), or if its directory does not exist or cannot be written.
    pub fn create(path: &Path) -> io::Result<AtomicFile> {
        let name = path.file_name().ok_or_else(|| {
            let msg = format!("{} does not name a file", path.display());
            io::Error::new(io::ErrorKind::InvalidInput, msg)
        })?;
        let kept = &name.as_bytes()[..name.len().min(NAME_KEPT)];
        for _ in 0..NAME_TRIES {
            let n = NEXT_TMP.fetch_add(1, Ordering::Relaxed);
            let mut tmp_name = OsString::from(".");
            tmp_name.push(std::ffi::OsStr::from_bytes(kept));
            tmp_name.push(format!(".tmp-{}-{n}", std::process::id()));
            let tmp = path.with_file_name(tmp_name);
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(file) => {
                    return Ok(AtomicFile {
                        file,
                        tmp,
                        path: path.to_owned(),
                        committed: false,
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("no free temporary name for {}", path.display()),
        ))
    }

    /// The temporary file, to write to.
    pub fn file_mut(&mut self) -> &mut File {
        &mut self.file
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// Where the content is written until the commit (for messages).
    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// The file it replaces.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// fsync the content, rename it over the destination, fsync the directory. An error
    /// before the rename removes the temporary file and leaves the destination as it was; an
    /// error from the directory's fsync (the one step after the rename) leaves the new file in
    /// place, but perhaps not yet durable.
    pub fn commit(mut self) -> io::Result<()> {
        self.file.sync_all()?;
        std::fs::rename(&self.tmp, &self.path)?;
        self.committed = true;
        File::open(dir_of(&self.path))?.sync_all()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The directory `path` is in.
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn writes_and_replaces_leaving_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"one").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        write_atomic(&path, b"two, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two, longer");
        write_atomic(&path, b"").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"");
        assert_eq!(names(dir.path()), ["state.json"]);

        // A name as long as a name can be still gets a temporary name.
        let long = dir.path().join("n".repeat(255));
        write_atomic(&long, b"x").unwrap();
        assert_eq!(std::fs::read(&long).unwrap(), b"x");
    }

    #[test]
    fn streamed_writes_commit_or_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("layer");
        std::fs::write(&path, b"old").unwrap();

        // Two writers of one file at once: distinct temporary files; the last commit wins.
        let mut a = AtomicFile::create(&path).unwrap();
        let mut b = AtomicFile::create(&path).unwrap();
        assert_ne!(a.temp_path(), b.temp_path());
        assert_eq!(a.temp_path().parent(), Some(dir.path()));
        assert_eq!(a.path(), path);
        a.file_mut().write_all(b"from a").unwrap();
        b.file_mut().write_all(b"from b").unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"old",
            "nothing before a commit"
        );
        a.commit().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"from a");
        b.commit().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"from b");

        // A writer that gives up (an error, a panic, an early return) leaves nothing behind.
        let mut c = AtomicFile::create(&path).unwrap();
        c.file_mut().write_all(b"half").unwrap();
        let tmp = c.temp_path().to_owned();
        assert!(tmp.exists());
        drop(c);
        assert!(!tmp.exists());
        assert_eq!(std::fs::read(&path).unwrap(), b"from b");
        assert_eq!(names(dir.path()), ["layer"]);
    }

    #[test]
    fn bad_destinations_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        for path in [Path::new("/"), &dir.path().join("..")] {
            let err = write_atomic(path, b"x").unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{path:?}: {err}");
        }
        let err = write_atomic(&dir.path().join("missing/f"), b"x").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        // A directory in the way: the rename fails and the temporary file goes.
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/keep"), b"").unwrap();
        assert!(write_atomic(&dir.path().join("d"), b"x").is_err());
        assert_eq!(names(dir.path()), ["d"]);
    }

    #[test]
    fn a_relative_path_is_in_the_current_directory() {
        assert_eq!(dir_of(Path::new("f")), Path::new("."));
        assert_eq!(dir_of(Path::new("a/f")), Path::new("a"));
        assert_eq!(dir_of(Path::new("/f")), Path::new("/"));
    }
}
