//! The content-addressed blob store.
//!
//! # Layout in the backend
//! | key | what |
//! | --- | --- |
//! | `blobs/<d[0..2]>/<d>` | the blob whose blake3 digest is `d` (64 lowercase hex) |
//! | `blobs/<d[0..2]>/<d>.<suffix>` | a sidecar of blob `d`; it lives and dies with the blob |
//! | `blobs/<d[0..2]>/<d>.chunks` | the chunk table of blob `d` ([`crate::chunk::table`]), written right after the blob; blobs of at most one chunk have none (their one chunk digest is the blob digest) |
//! | `leases/<d>` | a note that blob `d` was (re)announced by a push; protects it from gc for the grace period |
//!
//! # Invariants
//! - A blob is immutable: its key is its digest. Putting a digest that exists uploads nothing
//!   (it only refreshes the blob's lease, see [`crate::gc`]).
//! - Nothing unverified is stored: bytes are hashed while they are uploaded, and an upload whose
//!   bytes do not hash to the digest announced for them (a file that changed under us) is
//!   aborted, leaving no object.
//! - Whole-blob reads are verified against the digest. Ranged reads are verified per chunk by
//!   the chunk cache, which owns the chunk tables.
//!
//! # Retries
//! A store retries its backend's operations under one [`RetryPolicy`] (the default unless
//! [`Store::with_retry`] says otherwise), through a [`RetryingBackend`]: the one layer of
//! retries on every path through the store, [`Store::backend`] included (see
//! [`crate::backend::retry`]). Give it a plain backend, not another store's
//! [`Store::backend`], which already retries.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::backend::{file_stream, Backend, ObjectMeta, PutMode, RetryPolicy, RetryingBackend};
use crate::chunk::table::{ChunkTable, ChunkTableBuilder};
use crate::chunk::CHUNK_SIZE;
use crate::error::{Error, Result};

/// A blake3 digest: the name of a blob.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Digest(*blake3::hash(data).as_bytes())
    }

    /// Hash a whole file (memory-mapped, on all cores for large files).
    pub fn of_file(path: &Path) -> Result<(Self, u64)> {
        let mut hasher = blake3::Hasher::new();
        hasher
            .update_mmap_rayon(path)
            .map_err(|e| Error::io("hash", path, e))?;
        Ok((Digest(*hasher.finalize().as_bytes()), hasher.count()))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl FromStr for Digest {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let ok = s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !ok {
            return Err(Error::InvalidDigest(s.to_owned()));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| Error::InvalidDigest(s.to_owned()))?;
        Ok(Digest(out))
    }
}

impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Files up to this size are read whole and hashed once; larger ones are streamed.
const SMALL_FILE: u64 = 4 << 20;

/// The outcome of a blob put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutBlob {
    pub digest: Digest,
    pub size: u64,
    /// The blob was already stored; nothing was uploaded.
    pub existed: bool,
}

/// A content-addressed store over any backend.
#[derive(Clone, Debug)]
pub struct Store {
    /// `retrying`, as the trait object [`Store::backend`] hands out.
    backend: Arc<dyn Backend>,
    retrying: Arc<RetryingBackend>,
}

/// The key of blob `d`.
pub fn blob_key(d: &Digest) -> String {
    let hex = d.to_hex();
    format!("blobs/{}/{}", &hex[..2], hex)
}

/// The key of a sidecar object of blob `d` (`suffix` such as `chunks`).
pub fn sidecar_key(d: &Digest, suffix: &str) -> String {
    format!("{}.{}", blob_key(d), suffix)
}

/// The suffix of a blob's chunk-table sidecar.
pub const CHUNKS_SUFFIX: &str = "chunks";

/// The key of the lease of blob `d`.
pub fn lease_key(d: &Digest) -> String {
    format!("leases/{d}")
}

/// The blob a key under `blobs/` belongs to (itself or as a sidecar), if it is one.
pub fn blob_of_key(key: &str) -> Option<Digest> {
    let rest = key.strip_prefix("blobs/")?;
    let (shard, name) = rest.split_once('/')?;
    let hex = name.get(..64)?;
    let tail = &name[64..];
    if !(tail.is_empty() || tail.starts_with('.')) || !hex.starts_with(shard) || shard.len() != 2 {
        return None;
    }
    hex.parse().ok()
}

impl Store {
    /// A store over `backend`, retried under [`RetryPolicy::default`].
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self::with_retry(backend, RetryPolicy::default())
    }

    /// A store over `backend`, retried under `policy`.
    pub fn with_retry(backend: Arc<dyn Backend>, policy: RetryPolicy) -> Self {
        let retrying = Arc::new(RetryingBackend::new(backend, policy));
        Self {
            backend: retrying.clone(),
            retrying,
        }
    }

    /// The same store (the same backend) retried under `policy` instead of this store's
    /// policy: the retries are replaced, not nested.
    pub fn with_retry_policy(&self, policy: RetryPolicy) -> Self {
        Self::with_retry(self.retrying.inner().clone(), policy)
    }

    /// The store's backend, under the store's retries.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The backend under the store's retries, with its extra read (exact ranges).
    pub(crate) fn retrying(&self) -> &RetryingBackend {
        &self.retrying
    }

    /// How the store retries its backend.
    pub fn retry_policy(&self) -> &RetryPolicy {
        self.retrying.policy()
    }

    /// Metadata of blob `d`, or `None` if it is not stored.
    pub async fn stat_blob(&self, d: &Digest) -> Result<Option<ObjectMeta>> {
        match self.backend.head(&blob_key(d)).await {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Refresh the lease of an existing blob (see [`crate::gc`]).
    async fn renew_lease(&self, d: &Digest) -> Result<()> {
        let note = format!(
            "{{\"blob\":\"{d}\",\"renewed\":\"{}\"}}\n",
            humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        );
        self.backend.put(&lease_key(d), Bytes::from(note)).await?;
        Ok(())
    }

    /// Store `data` under its digest (a no-op, bar the lease, if it is already stored).
    pub async fn put_blob(&self, data: Bytes) -> Result<PutBlob> {
        let digest = Digest::of(&data);
        let size = data.len() as u64;
        if self.stat_blob(&digest).await?.is_some() {
            self.renew_lease(&digest).await?;
            return Ok(PutBlob {
                digest,
                size,
                existed: true,
            });
        }
        // A single-chunk blob needs no table: its one chunk digest is the blob digest.
        let table = (size > CHUNK_SIZE).then(|| ChunkTable::for_bytes(digest, &data));
        self.backend.put(&blob_key(&digest), data).await?;
        if let Some(table) = table {
            self.put_chunk_table(&table).await?;
        }
        Ok(PutBlob {
            digest,
            size,
            existed: false,
        })
    }

    /// Store a blob's chunk table beside it.
    async fn put_chunk_table(&self, table: &ChunkTable) -> Result<()> {
        self.backend
            .put(
                &sidecar_key(&table.blob, CHUNKS_SUFFIX),
                Bytes::from(table.encode()),
            )
            .await?;
        Ok(())
    }

    /// The chunk table of blob `d`. A blob of at most one chunk has no stored table: its one
    /// chunk digest is the blob's digest. A larger blob stored without one (an interrupted
    /// writer) is read whole once, verified, and its table is built and stored.
    pub async fn chunk_table(&self, d: &Digest) -> Result<ChunkTable> {
        match self.backend.get(&sidecar_key(d, CHUNKS_SUFFIX)).await {
            Ok(bytes) => ChunkTable::decode(d, &bytes),
            Err(e) if e.is_not_found() => {
                let size = self.backend.head(&blob_key(d)).await?.size;
                if size <= CHUNK_SIZE {
                    return Ok(ChunkTable {
                        blob: *d,
                        blob_size: size,
                        chunk_size: CHUNK_SIZE,
                        digests: if size == 0 { Vec::new() } else { vec![*d] },
                    });
                }
                let data = self.get_blob(d).await?;
                let table = ChunkTable::for_bytes(*d, &data);
                self.put_chunk_table(&table).await?;
                Ok(table)
            }
            Err(e) => Err(e),
        }
    }

    /// Store the file at `path` under its digest, streaming it. The file is hashed first (to
    /// learn its name), then hashed again while it is uploaded; if the two differ the upload is
    /// aborted and nothing is stored.
    pub async fn put_blob_file(&self, path: &Path) -> Result<PutBlob> {
        let owned = path.to_owned();
        // Small files: one read, one hash, one put.
        let small = tokio::task::spawn_blocking(move || -> Result<Option<Bytes>> {
            use std::io::Read;
            let mut f = std::fs::File::open(&owned).map_err(|e| Error::io("open", &owned, e))?;
            let len = f
                .metadata()
                .map_err(|e| Error::io("stat", &owned, e))?
                .len();
            if len > SMALL_FILE {
                return Ok(None);
            }
            let mut buf = Vec::with_capacity(len as usize);
            f.read_to_end(&mut buf)
                .map_err(|e| Error::io("read", &owned, e))?;
            Ok(Some(Bytes::from(buf)))
        })
        .await
        .map_err(|e| Error::io("read", path, std::io::Error::other(e)))??;
        if let Some(data) = small {
            return self.put_blob(data).await;
        }
        let owned = path.to_owned();
        let (digest, size) = tokio::task::spawn_blocking(move || Digest::of_file(&owned))
            .await
            .map_err(|e| Error::io("hash", path, std::io::Error::other(e)))??;
        if self.stat_blob(&digest).await?.is_some() {
            self.renew_lease(&digest).await?;
            return Ok(PutBlob {
                digest,
                size,
                existed: true,
            });
        }
        // Hash again (whole and per chunk) as the bytes go out.
        let hashers = Arc::new(Mutex::new((
            blake3::Hasher::new(),
            ChunkTableBuilder::new(),
        )));
        let feed = hashers.clone();
        let display = path.display().to_string();
        let body = file_stream(path, 8 << 20)?
            .map(move |item| {
                if let Ok(buf) = &item {
                    let mut h = feed.lock().unwrap_or_else(|p| p.into_inner());
                    h.0.update(buf);
                    h.1.update(buf);
                }
                item
            })
            .chain(futures::stream::once({
                let hashers = hashers.clone();
                async move {
                    let h = hashers.lock().unwrap_or_else(|p| p.into_inner());
                    if h.0.count() == size && Digest(*h.0.finalize().as_bytes()) == digest {
                        // An empty buffer ends the stream after a successful check.
                        Ok(Bytes::new())
                    } else {
                        Err(std::io::Error::other(format!(
                            "{display} changed while it was uploaded"
                        )))
                    }
                }
            }))
            .boxed();
        self.backend
            .put_stream(&blob_key(&digest), body, PutMode::Overwrite)
            .await?;
        let builder = std::mem::take(&mut hashers.lock().unwrap_or_else(|p| p.into_inner()).1);
        if size > CHUNK_SIZE {
            self.put_chunk_table(&builder.finish(digest)).await?;
        }
        Ok(PutBlob {
            digest,
            size,
            existed: false,
        })
    }

    /// Read a whole blob and verify it against its digest.
    pub async fn get_blob(&self, d: &Digest) -> Result<Bytes> {
        let data = self.backend.get(&blob_key(d)).await?;
        let actual = Digest::of(&data);
        if actual != *d {
            return Err(Error::DigestMismatch {
                blob: d.to_hex(),
                expected: d.to_hex(),
                actual: actual.to_hex(),
            });
        }
        Ok(data)
    }

    /// Stream blob `d` into `out` in ranged reads of `piece` bytes, verifying the digest at the
    /// end. Memory stays bounded by `piece` whatever the blob's size. On a mismatch the caller
    /// must discard what was written.
    pub async fn read_blob_to(
        &self,
        d: &Digest,
        out: &mut (dyn std::io::Write + Send),
        piece: u64,
    ) -> Result<u64> {
        let key = blob_key(d);
        let size = self.backend.head(&key).await?.size;
        let mut hasher = blake3::Hasher::new();
        let mut at = 0u64;
        while at < size {
            let end = (at + piece.max(1)).min(size);
            let buf = self.backend.get_range(&key, at..end).await?;
            if buf.len() as u64 != end - at {
                return Err(Error::DigestMismatch {
                    blob: d.to_hex(),
                    expected: d.to_hex(),
                    actual: format!("a short read ({} of {} bytes at {at})", buf.len(), end - at),
                });
            }
            hasher.update(&buf);
            out.write_all(&buf)
                .map_err(|e| Error::io("write blob", d.to_hex(), e))?;
            at = end;
        }
        let actual = Digest(*hasher.finalize().as_bytes());
        if actual != *d {
            return Err(Error::DigestMismatch {
                blob: d.to_hex(),
                expected: d.to_hex(),
                actual: actual.to_hex(),
            });
        }
        Ok(size)
    }

    /// Every stored blob (sidecars excluded).
    pub async fn list_blobs(&self) -> Result<Vec<(Digest, ObjectMeta)>> {
        Ok(self
            .backend
            .list("blobs/")
            .await?
            .into_iter()
            .filter_map(|m| {
                let d = blob_of_key(&m.key)?;
                (m.key == blob_key(&d)).then_some((d, m))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;

    #[test]
    fn digest_parsing() {
        let d = Digest::of(b"hello");
        assert_eq!(d.to_hex().parse::<Digest>().unwrap(), d);
        for bad in ["", "xyz", &d.to_hex().to_uppercase(), &d.to_hex()[1..]] {
            assert!(bad.parse::<Digest>().is_err(), "{bad}");
        }
        let key = blob_key(&d);
        assert_eq!(blob_of_key(&key), Some(d));
        assert_eq!(blob_of_key(&sidecar_key(&d, "chunks")), Some(d));
        assert_eq!(blob_of_key(&format!("{key}x")), None);
        assert_eq!(blob_of_key(&format!("blobs/zz/{d}")), None);
        assert_eq!(blob_of_key("blobs/ab"), None);
    }

    #[tokio::test]
    async fn put_is_idempotent_and_reads_verify() {
        let mem = Arc::new(MemoryBackend::new());
        let store = Store::new(mem.clone());
        let a = store.put_blob(Bytes::from_static(b"abc")).await.unwrap();
        assert!(!a.existed);
        let b = store.put_blob(Bytes::from_static(b"abc")).await.unwrap();
        assert!(b.existed);
        assert_eq!(a.digest, b.digest);
        assert_eq!(&store.get_blob(&a.digest).await.unwrap()[..], b"abc");
        assert!(mem.head(&lease_key(&a.digest)).await.is_ok());

        // Corrupt the stored bytes behind the store's back: the read must refuse them.
        mem.put(&blob_key(&a.digest), Bytes::from_static(b"abd"))
            .await
            .unwrap();
        let err = store.get_blob(&a.digest).await.unwrap_err();
        assert!(matches!(err, Error::DigestMismatch { .. }), "{err}");
    }

    #[tokio::test]
    async fn file_put_streams_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let store = Store::new(Arc::new(MemoryBackend::new()));
        let put = store.put_blob_file(&path).await.unwrap();
        assert_eq!(put.digest, Digest::of(&data));
        assert_eq!(put.size, data.len() as u64);
        assert_eq!(store.get_blob(&put.digest).await.unwrap(), data);
        assert_eq!(store.list_blobs().await.unwrap().len(), 1);
    }
}
