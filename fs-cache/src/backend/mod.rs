//! The `Backend` trait: the narrow interface to where blobs live.
//!
//! A backend stores immutable-by-convention objects under `/`-separated keys and offers five
//! operations: ranged read, streaming put, head, list by prefix, delete. Conveniences (`get`,
//! `put`) are default methods; behaviours such as retries and fault injection are wrappers
//! ([`RetryingBackend`], [`FaultyBackend`]) rather than flags inside implementations. No
//! backend retries on its own: a [`crate::Store`] applies the one layer of retries
//! ([`retry`]).
//!
//! # Semantics every backend keeps (checked by `tests/conformance.rs`)
//! - **Keys** pass [`validate_key`]: non-empty, at most 1,024 bytes, no leading, trailing or
//!   doubled `/`, no `.` or `..` segment, no control characters, and no segment starting with
//!   `.strata-` (reserved for the POSIX backend's temporary files).
//! - **Ranged reads**: `get_range(key, a..b)` returns the bytes `a..min(b, size)`. A range that
//!   starts exactly at the end (or is empty) returns no bytes; one that starts past the end is
//!   [`Error::InvalidRange`]. A missing key is [`Error::NotFound`], never a generic error.
//! - **Puts are atomic**: a reader sees the old object or the new one, never a mix or a torn
//!   object. Concurrent puts of one key: the last writer wins. [`PutMode::Create`] refuses an
//!   existing key with [`Error::AlreadyExists`]. A body stream that fails leaves nothing behind
//!   (no partial object, no pending multipart upload).
//! - **List** returns every object whose key starts with the prefix (a string prefix, not a
//!   directory), sorted by key, however many there are.
//! - **Delete** is idempotent: deleting a missing key succeeds.
//! - **Abandoned puts** (what a put leaves when its process dies half-way: a POSIX temporary
//!   file, an S3 multipart upload) are found and removed by `sweep_abandoned`, never listed.

use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;

use crate::error::{Error, Result};
use retry::RetryContext;

pub mod fault;
pub mod memory;
pub mod posix;
pub mod retry;
pub mod s3;

pub use fault::{FaultConfig, FaultStats, FaultyBackend};
pub use memory::MemoryBackend;
pub use posix::PosixBackend;
pub use retry::{RetryPolicy, RetryingBackend};
pub use s3::{S3Backend, S3Config};

/// A body for a streaming put: a sequence of byte buffers, any of which may fail.
pub type ByteStream = BoxStream<'static, std::io::Result<Bytes>>;

/// Whether a put may replace an existing object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PutMode {
    /// Replace whatever is there (last writer wins).
    #[default]
    Overwrite,
    /// Fail with [`Error::AlreadyExists`] if the key exists (an atomic create).
    Create,
}

/// What a backend knows about one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: String,
    pub size: u64,
    /// An opaque version tag that changes when the object is replaced (S3 ETag; POSIX: derived
    /// from inode, size and mtime).
    pub etag: Option<String>,
    pub last_modified: Option<SystemTime>,
}

/// The interface to an object store.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug + fmt::Display {
    /// Read `range` of object `key` (see the module docs for the range rules).
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes>;

    /// [`Self::get_range`] on the caller's thread, for a backend whose reads wait on local
    /// I/O only (a POSIX mount); `None` (the default) when it cannot. No retries: a caller
    /// that gets an error here reads again through [`Self::get_range`] under its policy.
    fn get_range_now(&self, key: &str, range: Range<u64>) -> Option<Result<Bytes>> {
        let _ = (key, range);
        None
    }

    /// Store the bytes of `body` under `key`, atomically, honouring `mode`.
    async fn put_stream(&self, key: &str, body: ByteStream, mode: PutMode) -> Result<ObjectMeta>;

    /// Size, tag and modification time of `key`.
    async fn head(&self, key: &str) -> Result<ObjectMeta>;

    /// Every object whose key starts with `prefix`, sorted by key.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>>;

    /// Remove `key`; succeeds if it is already gone.
    async fn delete(&self, key: &str) -> Result<()>;

    /// What puts left behind when their process died half-way (a POSIX temporary file, an S3
    /// multipart upload never completed nor aborted), begun or last written before `before`:
    /// removed unless `dry_run`, each described in one line. A put that fails or is dropped
    /// cleans up after itself; only one whose process is gone leaves these, and they are
    /// never listed or read as objects, so nothing else would ever remove them.
    async fn sweep_abandoned(&self, before: SystemTime, dry_run: bool) -> Result<Vec<String>>;

    /// [`Self::put_stream`] with `retry` applied to each request the put makes, for
    /// [`RetryingBackend`], which cannot retry a streaming put whole: its body is consumed as
    /// it is sent. A backend that sends the body in pieces it holds (S3: the parts of a
    /// multipart upload) retries each piece; the default makes one attempt.
    async fn put_stream_retrying(
        &self,
        key: &str,
        body: ByteStream,
        mode: PutMode,
        retry: &RetryPolicy,
    ) -> Result<ObjectMeta> {
        let _ = retry;
        self.put_stream(key, body, mode).await
    }

    /// [`Self::list`] under `retry`, for [`RetryingBackend`]. The default retries the whole
    /// listing, without a per-attempt timeout (a listing lasts as long as there are objects to
    /// list); a backend that lists in pages (S3) retries each page instead.
    async fn list_retrying(&self, prefix: &str, retry: &RetryPolicy) -> Result<Vec<ObjectMeta>> {
        let name = self.to_string();
        let ctx = RetryContext {
            backend: &name,
            op: "list",
            key: prefix,
        };
        retry.run_untimed(ctx, |_| self.list(prefix)).await
    }

    /// Read a whole object.
    async fn get(&self, key: &str) -> Result<Bytes> {
        self.get_range(key, 0..u64::MAX).await
    }

    /// Store one buffer under `key`, replacing any existing object.
    async fn put(&self, key: &str, body: Bytes) -> Result<ObjectMeta> {
        self.put_opts(key, body, PutMode::Overwrite).await
    }

    /// Store one buffer under `key` with an explicit mode.
    async fn put_opts(&self, key: &str, body: Bytes, mode: PutMode) -> Result<ObjectMeta> {
        self.put_stream(
            key,
            futures::stream::once(async move { Ok(body) }).boxed(),
            mode,
        )
        .await
    }
}

/// Check that `key` is a valid object key (see the module docs).
pub fn validate_key(key: &str) -> Result<()> {
    let bad = |reason| {
        Err(Error::InvalidKey {
            key: key.to_owned(),
            reason,
        })
    };
    if key.is_empty() {
        return bad("empty key");
    }
    if key.len() > 1024 {
        return bad("longer than 1024 bytes");
    }
    if key.starts_with('/') {
        return bad("absolute key (leading '/')");
    }
    if key.ends_with('/') {
        return bad("trailing '/'");
    }
    if key.chars().any(|c| c.is_control()) {
        return bad("control character in key");
    }
    if key.contains('\\') {
        return bad("backslash in key");
    }
    for segment in key.split('/') {
        match segment {
            "" => return bad("empty path segment ('//')"),
            "." | ".." => return bad("'.' or '..' segment"),
            s if s.starts_with(".strata-") => {
                return bad("segment starts with reserved '.strata-'")
            }
            s if s.len() > 255 => return bad("path segment longer than 255 bytes"),
            _ => {}
        }
    }
    Ok(())
}

/// Check a list prefix: empty, or a key prefix that could not escape (no `..` segment etc.).
pub(crate) fn validate_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() {
        return Ok(());
    }
    // A prefix may end in '/' or in the middle of a segment; validate it as a key with a
    // placeholder completion.
    let probe = if prefix.ends_with('/') {
        format!("{prefix}x")
    } else {
        prefix.to_owned()
    };
    validate_key(&probe).map_err(|_| Error::InvalidKey {
        key: prefix.to_owned(),
        reason: "invalid list prefix",
    })
}

/// Clamp `range` to an object of `size` bytes, or report it as past the end.
pub(crate) fn clamp_range(
    backend: &dyn fmt::Display,
    key: &str,
    range: Range<u64>,
    size: u64,
) -> Result<Range<u64>> {
    if range.start > size {
        return Err(Error::InvalidRange {
            backend: backend.to_string(),
            key: key.to_owned(),
            start: range.start,
            end: range.end,
            size,
        });
    }
    let end = range.end.min(size).max(range.start);
    Ok(range.start..end)
}

/// A stream that reads `path` sequentially in buffers of `buf_size` bytes, one blocking read
/// ahead of its consumer.
pub fn file_stream(path: &Path, buf_size: usize) -> Result<ByteStream> {
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let state = Some((Arc::new(file), Arc::new(path.to_owned())));
    Ok(futures::stream::unfold(state, move |state| async move {
        let (file, path) = state?;
        let (f, p) = (file.clone(), path.clone());
        let read = tokio::task::spawn_blocking(move || read_full(&f, &p, buf_size)).await;
        match read {
            Ok(Ok(buf)) if buf.is_empty() => None,
            Ok(Ok(buf)) => {
                let more = buf.len() == buf_size;
                Some((Ok(buf), more.then_some((file, path))))
            }
            Ok(Err(e)) => Some((Err(e), None)),
            Err(e) => Some((Err(std::io::Error::other(e)), None)),
        }
    })
    .boxed())
}

/// Read up to `n` bytes from the file's current position (fewer only at the end).
fn read_full(mut file: &std::fs::File, path: &Path, n: usize) -> std::io::Result<Bytes> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(k) => filled += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("read {}: {e}", path.display()),
                ))
            }
        }
    }
    buf.truncate(filled);
    Ok(Bytes::from(buf))
}

/// Open the backend a store URL names.
///
/// - a plain path, or `file:///path`: [`PosixBackend`] rooted there (created if missing);
/// - `s3://bucket/prefix?endpoint=http://127.0.0.1:9000&region=us-east-1`: [`S3Backend`];
/// - `memory://`: a fresh, empty [`MemoryBackend`] (tests and experiments).
pub async fn open_backend(url: &str) -> Result<Arc<dyn Backend>> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    if url.is_empty() {
        return Err(invalid("empty"));
    }
    let Some((scheme, _)) = url.split_once("://") else {
        return Ok(Arc::new(PosixBackend::open(url)?));
    };
    match scheme {
        "file" => {
            let parsed = url::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
            if parsed
                .host_str()
                .is_some_and(|h| !h.is_empty() && h != "localhost")
            {
                return Err(invalid(
                    "file URLs take no host (use file:///absolute/path)",
                ));
            }
            let path = parsed
                .to_file_path()
                .map_err(|()| invalid("not an absolute file path"))?;
            Ok(Arc::new(PosixBackend::open(path)?))
        }
        "s3" => {
            let parsed = url::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
            let config = S3Config::from_url(&parsed).map_err(|reason| invalid(&reason))?;
            Ok(Arc::new(S3Backend::connect(config).await?))
        }
        "memory" => Ok(Arc::new(MemoryBackend::new())),
        other => Err(invalid(&format!("unknown scheme {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        for ok in ["a", "a/b", "blobs/ab/abcdef", "x.y/z-1_2", "a/.hidden"] {
            validate_key(ok).unwrap();
        }
        for bad in [
            "",
            "/a",
            "a/",
            "a//b",
            "../a",
            "a/../b",
            "a/./b",
            ".",
            "..",
            "a\0b",
            "a\\b",
            "a/.strata-tmp.1",
            "a\nb",
        ] {
            assert!(
                matches!(validate_key(bad), Err(Error::InvalidKey { .. })),
                "{bad:?} accepted"
            );
        }
        assert!(validate_key(&"a".repeat(1025)).is_err());
        assert!(validate_key(&"a".repeat(256)).is_err());
    }

    #[test]
    fn prefixes() {
        for ok in ["", "a", "a/", "blobs/ab"] {
            validate_prefix(ok).unwrap();
        }
        for bad in ["/", "../", "a//", "/a"] {
            assert!(validate_prefix(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn clamping() {
        let b = "test";
        assert_eq!(clamp_range(&b, "k", 0..10, 5).unwrap(), 0..5);
        assert_eq!(clamp_range(&b, "k", 5..10, 5).unwrap(), 5..5);
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 3..2;
        assert_eq!(clamp_range(&b, "k", backwards, 5).unwrap(), 3..3);
        assert!(matches!(
            clamp_range(&b, "k", 6..10, 5),
            Err(Error::InvalidRange { size: 5, .. })
        ));
    }

    #[tokio::test]
    async fn bad_urls_say_what_was_expected() {
        for url in [
            "",
            "ftp://x/y",
            "s3://",
            "file://host/x",
            "s3://bucket?bogus=1",
        ] {
            let err = open_backend(url).await.unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {msg}");
            assert!(msg.contains("expected"), "{msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
    }
}
