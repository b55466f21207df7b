//! The content-addressed blob store.
//!
//! # Layout in the backend
//! | key | what |
//! | --- | --- |
//! | `blobs/<d[0..2]>/<d>` | the blob whose blake3 digest is `d` (64 lowercase hex): its plain bytes, or, for a compressed blob, its chunks each stored as a zstd frame or plain, in order ([`crate::chunk::codec`]) |
//! | `blobs/<d[0..2]>/<d>.<suffix>` | a sidecar of blob `d`; it lives and dies with the blob |
//! | `blobs/<d[0..2]>/<d>.chunks` | the chunk table of blob `d` ([`crate::chunk::table`]). A plain blob of 256 KiB chunks has its table written right after the blob (version 1); such blobs of at most one chunk have none (their one chunk digest is the blob digest). A compressed blob's (version 2, with each chunk's stored range) and the table of a blob of any other chunk size (version 1 or 2) are written **before** the blob, and every such blob has one |
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
//! - **Only a blob of 256 KiB chunks can lack a table.** A blob stored with another chunk size
//!   ([`PutOptions::chunk_size`]) has its table stored, and stored **before** the blob object,
//!   whatever its size (even empty) and encoding. So [`Store::chunk_table`]'s fallback for a
//!   blob without a table (256 KiB chunks: legacy blobs, and small plain ones, are 256 KiB by
//!   construction) never describes a blob stored with another chunk size. A put that finds
//!   the blob already stored keeps it and its table as they are, whatever their chunk size,
//!   and says which ([`PutBlob::chunk_size`]).
//!
//! # Compressed blobs
//! A blob's name is the digest of its **plain** bytes, however it is stored: a layer's meta
//! image names its data blob (EROFS device tag) and the node serves it (FUSE file name,
//! level 2) by that name, as plain bytes. [`Store::put_blob_file_opts`] and
//! [`Store::put_blob_opts`] with [`Compression::Zstd`] store each chunk that shrinks as a zstd
//! frame; a blob in which none shrinks is stored plain, as if no compression was asked for.
//! [`PutBlob::stored_size`] says what was stored, and a layer's manifest records it
//! ([`crate::BlobRef`]). Readers do not need the manifest: the chunk table says how the blob is
//! stored. Whole reads ([`Store::get_blob`], [`Store::read_blob_to`]) decode and verify every
//! chunk and the blob digest.
//!
//! The stored object is plain exactly when its size is the blob's size (a compressed chunk is
//! shorter than its plain bytes, [`crate::chunk::table`]). That makes a table and an object
//! that do not belong together (two puts of the same blob in different encodings racing each
//! other, or a stale table of an interrupted put) detectable: [`Store::chunk_table`] checks a
//! version-2 table's stored size against the object's, and reads a plain object as plain; a
//! put that finds the blob stored checks the pair the same way and stores it again if it does
//! not hold together. Any other mismatch (an object cut short, a plain table over a
//! compressed object) never serves a wrong byte: every chunk is verified against its plain
//! digest, and the chunks that fail are [`Error::Corrupt`] (or a short read).
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
use crate::chunk::codec::{encode_chunks, EncodedChunk};
use crate::chunk::table::{check_chunk_size, ChunkTable, ChunkTableBuilder, StoredChunk};
use crate::chunk::{Compression, CHUNK_SIZE};
use crate::error::{Error, Result};

/// A blake3 digest: the name of a blob.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Digest(*blake3::hash(data).as_bytes())
    }

    /// Hash a whole file: read in 8 MiB pieces by a second thread while the previous piece is
    /// hashed on all cores, so that the process holds 16 MiB of it, not the whole file
    /// (a mapping would count every page of the file as resident).
    pub fn of_file(path: &Path) -> Result<(Self, u64)> {
        let (d, size, _) = hash_file(path, None)?;
        Ok((d, size))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

/// [`Digest::of_file`], also feeding `chunks` (if any) in the same pass (its whole chunks
/// hashed in parallel too); returns the builder fed with the file's bytes.
fn hash_file(
    path: &Path,
    mut chunks: Option<ChunkTableBuilder>,
) -> Result<(Digest, u64, Option<ChunkTableBuilder>)> {
    const PIECE: usize = 8 << 20;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("hash", path, e))?;
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<(Vec<u8>, usize)>(1);
    let (empty_tx, empty_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
    for _ in 0..2 {
        let _ = empty_tx.send(vec![0u8; PIECE]);
    }
    let mut hasher = blake3::Hasher::new();
    let read = std::thread::scope(|s| {
        let reader = s.spawn(move || -> std::io::Result<()> {
            use std::io::Read;
            while let Ok(mut buf) = empty_rx.recv() {
                let mut n = 0;
                while n < buf.len() {
                    match f.read(&mut buf[n..]) {
                        Ok(0) => break,
                        Ok(k) => n += k,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                let last = n < buf.len();
                if full_tx.send((buf, n)).is_err() || last {
                    return Ok(());
                }
            }
            Ok(())
        });
        while let Ok((buf, n)) = full_rx.recv() {
            if n >= 128 << 10 {
                hasher.update_rayon(&buf[..n]);
            } else {
                hasher.update(&buf[..n]);
            }
            if let Some(b) = chunks.as_mut() {
                b.update_par(&buf[..n]);
            }
            // The reader may be done: what it sent is still received to the end.
            let _ = empty_tx.send(buf);
        }
        drop(empty_tx);
        reader.join()
    });
    match read {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(Error::io("hash", path, e)),
        Err(_) => {
            return Err(Error::io(
                "hash",
                path,
                std::io::Error::other("the reading thread panicked"),
            ))
        }
    }
    Ok((
        Digest(*hasher.finalize().as_bytes()),
        hasher.count(),
        chunks,
    ))
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
    /// Bytes of the (plain) blob.
    pub size: u64,
    /// Bytes of the stored object: `size` when it is stored plain, fewer when compressed
    /// (what is stored, which for a blob already stored may be another encoding than asked).
    pub stored_size: u64,
    /// The blob was already stored; nothing was uploaded.
    pub existed: bool,
    /// The chunk size of the blob's stored chunk table (or 256 KiB for a blob stored without
    /// one): the size asked for, except for a blob that was already stored, which keeps the
    /// chunk size it was stored with.
    pub chunk_size: u64,
}

impl PutBlob {
    /// Whether the stored object is compressed (chunks as zstd frames).
    pub fn is_compressed(&self) -> bool {
        self.stored_size < self.size
    }

    /// The manifest's reference to this blob (with how it is stored, and its chunk size when
    /// it is not 256 KiB).
    pub fn blob_ref(&self) -> crate::layer::BlobRef {
        crate::layer::BlobRef {
            digest: self.digest,
            size: self.size,
            compression: self.is_compressed().then(|| "zstd".to_owned()),
            stored_size: self.is_compressed().then_some(self.stored_size),
            chunk_size: (self.chunk_size != CHUNK_SIZE).then_some(self.chunk_size),
        }
    }
}

/// How [`Store::put_blob_opts`] and [`Store::put_blob_file_opts`] store a blob.
///
/// ```
/// use fs_cache::store::PutOptions;
/// use fs_cache::Compression;
/// let opts = PutOptions::new(Compression::default()).with_chunk_size(64 << 10);
/// assert_eq!(opts.chunk_size, 64 << 10);
/// assert_eq!(PutOptions::default().compression, Compression::None);
/// ```
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutOptions {
    /// How the chunks are stored. The default is [`Compression::None`], as
    /// [`Store::put_blob`] and [`Store::put_blob_file`] store.
    pub compression: Compression,
    /// The chunk size of the blob's table: a power of two in 4 KiB..=64 MiB
    /// ([`crate::chunk::table::is_valid_chunk_size`]; Strata's own blobs use 4 KiB..=256 KiB),
    /// checked by the put. The default is [`CHUNK_SIZE`] (256 KiB).
    pub chunk_size: u64,
}

impl Default for PutOptions {
    fn default() -> Self {
        Self::new(Compression::None)
    }
}

impl PutOptions {
    /// Store as `compression` says, in chunks of [`CHUNK_SIZE`].
    pub fn new(compression: Compression) -> Self {
        Self {
            compression,
            chunk_size: CHUNK_SIZE,
        }
    }

    /// The same options with chunks of `chunk_size` bytes (checked by the put).
    pub fn with_chunk_size(mut self, chunk_size: u64) -> Self {
        self.chunk_size = chunk_size;
        self
    }

    /// Whether the table must be stored before the blob, even for a plain blob of one chunk
    /// (see the module docs): any chunk size but the default.
    fn table_first(&self) -> bool {
        self.chunk_size != CHUNK_SIZE
    }
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

    /// Store `data` under its digest, plain (a no-op, bar the lease, if it is already stored).
    pub async fn put_blob(&self, data: Bytes) -> Result<PutBlob> {
        self.put_blob_with(data, Compression::None).await
    }

    /// Store `data` under its digest, stored as `compression` says, in chunks of
    /// [`CHUNK_SIZE`] (a no-op, bar the lease, if it is already stored, in whatever encoding).
    pub async fn put_blob_with(&self, data: Bytes, compression: Compression) -> Result<PutBlob> {
        self.put_blob_opts(data, &PutOptions::new(compression))
            .await
    }

    /// Store `data` under its digest as `opts` say: its chunks as `opts.compression` says, in
    /// a table of `opts.chunk_size` (stored before the blob when that is not 256 KiB, see the
    /// module docs). If the blob is already stored, nothing is uploaded (bar the lease) and
    /// the result says how it is stored, whatever encoding and chunk size it was stored with.
    /// A chunk size a table cannot have is refused before anything is stored.
    pub async fn put_blob_opts(&self, data: Bytes, opts: &PutOptions) -> Result<PutBlob> {
        check_chunk_size(opts.chunk_size)?;
        let cs = opts.chunk_size;
        let digest = Digest::of(&data);
        let size = data.len() as u64;
        if let Some(put) = self.existing(&digest, size).await? {
            return Ok(put);
        }
        // The chunk digests, when compression computed them and nothing shrank.
        let mut plain_digests = None;
        if let Compression::Zstd { level } = opts.compression {
            let d = data.clone();
            let encoded =
                tokio::task::spawn_blocking(move || encode_chunks(level, &d, cs as usize))
                    .await
                    .map_err(|e| {
                        Error::io("compress", blob_key(&digest), std::io::Error::other(e))
                    })?;
            if encoded.iter().any(|(_, f)| f.is_some()) {
                let mut object = Vec::new();
                let mut stored = Vec::with_capacity(encoded.len());
                let mut digests = Vec::with_capacity(encoded.len());
                for (i, (chunk_digest, frame)) in encoded.iter().enumerate() {
                    let start = i * cs as usize;
                    let end = (start + cs as usize).min(data.len());
                    let bytes = frame.as_deref().unwrap_or(&data[start..end]);
                    stored.push(StoredChunk {
                        offset: object.len() as u64,
                        len: bytes.len() as u32,
                        zstd: frame.is_some(),
                    });
                    digests.push(*chunk_digest);
                    object.extend_from_slice(bytes);
                }
                let table = ChunkTable {
                    blob: digest,
                    blob_size: size,
                    chunk_size: cs,
                    digests,
                    stored: Some(stored),
                };
                // The table first: a stored compressed blob always has its table.
                self.put_chunk_table(&table).await?;
                let stored_size = object.len() as u64;
                self.backend
                    .put(&blob_key(&digest), Bytes::from(object))
                    .await?;
                return Ok(PutBlob {
                    digest,
                    size,
                    stored_size,
                    existed: false,
                    chunk_size: cs,
                });
            }
            // Nothing shrank: stored plain.
            plain_digests = Some(encoded.into_iter().map(|(d, _)| d).collect::<Vec<_>>());
        }
        if opts.table_first() {
            // Another chunk size than 256 KiB: the table first, always (module docs).
            let table = match plain_digests {
                Some(digests) => ChunkTable {
                    blob: digest,
                    blob_size: size,
                    chunk_size: cs,
                    digests,
                    stored: None,
                },
                None => ChunkTable::for_bytes_with(digest, &data, cs)?,
            };
            self.put_chunk_table(&table).await?;
            self.backend.put(&blob_key(&digest), data).await?;
        } else {
            // A single-chunk blob needs no table: its one chunk digest is the blob digest.
            let table = (size > CHUNK_SIZE).then(|| ChunkTable::for_bytes(digest, &data));
            self.backend.put(&blob_key(&digest), data).await?;
            if let Some(table) = table {
                self.put_chunk_table(&table).await?;
            }
        }
        Ok(PutBlob {
            digest,
            size,
            stored_size: size,
            existed: false,
            chunk_size: cs,
        })
    }

    /// If blob `d` (`size` plain bytes) is stored, and its object and table belong together,
    /// renew its lease and say what is stored (with the chunk size of its table). `None` when
    /// it is not stored, or when the pair does not hold together (it is then stored again by
    /// the caller).
    async fn existing(&self, d: &Digest, size: u64) -> Result<Option<PutBlob>> {
        let Some(meta) = self.stat_blob(d).await? else {
            return Ok(None);
        };
        let table_key = sidecar_key(d, CHUNKS_SUFFIX);
        let chunk_size = if meta.size == size {
            // A plain object, sound whatever its table (a stale version-2 table over it is
            // read as plain). Only the table's chunk size is wanted: its header is read.
            match self
                .backend
                .get_range(&table_key, 0..ChunkTable::HEADER_BYTES)
                .await
            {
                Ok(header) => ChunkTable::peek_chunk_size(d, &header).unwrap_or_else(|e| {
                    tracing::warn!(blob = %d, error = %e, "a stored plain blob's chunk table has an unreadable header; its chunk size is reported as 256 KiB, and readers will refuse the table");
                    CHUNK_SIZE
                }),
                // No table: 256 KiB chunks (module docs).
                Err(e) if e.is_not_found() => CHUNK_SIZE,
                Err(e) => return Err(e),
            }
        } else {
            // A compressed object is shorter than the blob and needs its version-2 table with
            // that stored size.
            let table = match self.backend.get(&table_key).await {
                Ok(bytes) => ChunkTable::decode(d, &bytes).ok().filter(|t| {
                    t.is_compressed() && t.blob_size == size && t.stored_size() == meta.size
                }),
                Err(e) if e.is_not_found() => None,
                Err(e) => return Err(e),
            };
            let Some(table) = table else {
                tracing::warn!(blob = %d, stored = meta.size, size, "stored blob does not match its chunk table; storing it again");
                return Ok(None);
            };
            table.chunk_size
        };
        self.renew_lease(d).await?;
        Ok(Some(PutBlob {
            digest: *d,
            size,
            stored_size: meta.size,
            existed: true,
            chunk_size,
        }))
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

    /// The chunk table of blob `d`. A plain blob of at most one chunk has no stored table: its
    /// one chunk digest is the blob's digest. A larger plain blob stored without one (an
    /// interrupted writer) is read whole once, verified, and its table is built and stored. A
    /// version-2 (compressed) table is checked against the stored object's size: a plain
    /// object under a stale compressed table is read as plain.
    ///
    /// Without a stored table the chunks are 256 KiB ([`CHUNK_SIZE`]): only blobs of 256 KiB
    /// chunks are ever stored without one (a blob of another chunk size has its table stored
    /// before the blob object, see the module docs), so this fallback never describes a blob
    /// stored with another chunk size.
    pub async fn chunk_table(&self, d: &Digest) -> Result<ChunkTable> {
        match self.backend.get(&sidecar_key(d, CHUNKS_SUFFIX)).await {
            Ok(bytes) => self.reconcile(ChunkTable::decode(d, &bytes)?).await,
            Err(e) if e.is_not_found() => {
                let size = self.backend.head(&blob_key(d)).await?.size;
                if size <= CHUNK_SIZE {
                    return Ok(ChunkTable {
                        blob: *d,
                        blob_size: size,
                        chunk_size: CHUNK_SIZE,
                        digests: if size == 0 { Vec::new() } else { vec![*d] },
                        stored: None,
                    });
                }
                let data = self.get_plain_blob(d).await?;
                let table = ChunkTable::for_bytes(*d, &data);
                self.put_chunk_table(&table).await?;
                Ok(table)
            }
            Err(e) => Err(e),
        }
    }

    /// A version-2 table checked against its stored object's size (see the module docs): a
    /// plain object (as long as the blob) under it is read as plain. An object of yet another
    /// size (cut short, or stored by another writer) keeps the table: each chunk is verified as
    /// it is read, so the chunks it damaged fail and the others are served.
    async fn reconcile(&self, mut table: ChunkTable) -> Result<ChunkTable> {
        if table.stored.is_some() {
            let d = table.blob;
            let object = self.backend.head(&blob_key(&d)).await?.size;
            if object == table.blob_size {
                table.stored = None;
            } else if object != table.stored_size() {
                tracing::warn!(blob = %d, object, stored = table.stored_size(), "the stored object is not as long as its chunk table says; put the blob again to repair it");
            }
        }
        Ok(table)
    }

    /// Store the file at `path` under its digest, plain, streaming it. The file is hashed
    /// first (to learn its name), then hashed again while it is uploaded; if the two differ the
    /// upload is aborted and nothing is stored.
    pub async fn put_blob_file(&self, path: &Path) -> Result<PutBlob> {
        self.put_blob_file_with(path, Compression::None).await
    }

    /// Store the file at `path` under its digest, stored as `compression` says, in chunks of
    /// [`CHUNK_SIZE`] ([`Store::put_blob_file_opts`]).
    pub async fn put_blob_file_with(
        &self,
        path: &Path,
        compression: Compression,
    ) -> Result<PutBlob> {
        self.put_blob_file_opts(path, &PutOptions::new(compression))
            .await
    }

    /// Store the file at `path` under its digest as `opts` say (see [`Store::put_blob_opts`];
    /// files up to 4 MiB are read whole and stored by it). Plain: as [`Store::put_blob_file`];
    /// with a chunk size other than 256 KiB the chunk table is built in the pass that hashes
    /// the file (to learn its name) and stored before the blob. Compressed: the file is hashed
    /// (to learn its name), then read again, its chunks hashed and compressed in parallel on
    /// all cores into a temporary file beside it; the table is stored, then that file (hashed
    /// again on its way out). A file that changed between two reads fails the put, and
    /// nothing is stored under a name its bytes do not have. A table stored first may stay
    /// behind; it is still right (it was built from bytes that hash to the blob's name), and
    /// the next put of the blob that stores a table replaces it. (A later put at 256 KiB of a
    /// blob of at most one chunk stores none: the blob then keeps the stale table's chunk
    /// size, while that put reports 256 KiB.)
    pub async fn put_blob_file_opts(&self, path: &Path, opts: &PutOptions) -> Result<PutBlob> {
        check_chunk_size(opts.chunk_size)?;
        let cs = opts.chunk_size;
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
            return self.put_blob_opts(data, opts).await;
        }
        let level = match opts.compression {
            Compression::Zstd { level } => Some(level),
            Compression::None => None,
        };
        // A plain blob whose table goes first: its table from the pass that names it.
        let chunks = if opts.table_first() && level.is_none() {
            Some(ChunkTableBuilder::with_chunk_size(cs)?)
        } else {
            None
        };
        let owned = path.to_owned();
        let (digest, size, chunks) = tokio::task::spawn_blocking(move || hash_file(&owned, chunks))
            .await
            .map_err(|e| Error::io("hash", path, std::io::Error::other(e)))??;
        if let Some(put) = self.existing(&digest, size).await? {
            return Ok(put);
        }
        // The table to store before the plain blob (`Some` exactly when `table_first`).
        let mut first = chunks.map(|b| b.finish(digest));
        if let Some(level) = level {
            let owned = path.to_owned();
            let spool = tokio::task::spawn_blocking(move || {
                spool_compressed(&owned, level, digest, size, cs)
            })
            .await
            .map_err(|e| Error::io("compress", path, std::io::Error::other(e)))??;
            if spool.table.is_compressed() {
                // The table first: a stored compressed blob always has its table.
                self.put_chunk_table(&spool.table).await?;
                let stored_size = spool.table.stored_size();
                self.upload_checked(
                    spool.file.path(),
                    &digest,
                    spool.stored_digest,
                    stored_size,
                    false,
                )
                .await?;
                return Ok(PutBlob {
                    digest,
                    size,
                    stored_size,
                    existed: false,
                    chunk_size: cs,
                });
            }
            // Nothing shrank: stored plain, and the spool's (version-1) table is the plain
            // blob's (its bytes hashed to `digest`).
            if opts.table_first() {
                first = Some(spool.table);
            }
        }
        if let Some(table) = first {
            // Another chunk size than 256 KiB: the table first, always (module docs). It was
            // built from bytes that hashed to `digest`, and the upload checks that they still
            // do, so it is this blob's.
            self.put_chunk_table(&table).await?;
            self.upload_checked(path, &digest, digest, size, false)
                .await?;
        } else {
            let table = self
                .upload_checked(path, &digest, digest, size, true)
                .await?;
            if size > CHUNK_SIZE {
                // The upload checked that the bytes hash to `digest`, so the table built from
                // them on the way out is this blob's.
                self.put_chunk_table(&table.finish(digest)).await?;
            }
        }
        Ok(PutBlob {
            digest,
            size,
            stored_size: size,
            existed: false,
            chunk_size: cs,
        })
    }

    /// Stream the file at `path` into blob `digest`'s key, hashing it (whole and per chunk)
    /// on the way out: if it does not hash to `expect` (`size` bytes), the body fails and the
    /// backend discards the object. Returns the chunk digests of what was uploaded (if
    /// `chunks`: the bytes are the plain blob).
    async fn upload_checked(
        &self,
        path: &Path,
        digest: &Digest,
        expect: Digest,
        size: u64,
        chunks: bool,
    ) -> Result<ChunkTableBuilder> {
        let hashers = Arc::new(Mutex::new((
            blake3::Hasher::new(),
            ChunkTableBuilder::new(),
        )));
        let feed = hashers.clone();
        let display = path.display().to_string();
        let end = hashers.clone();
        let body = file_stream(path, 8 << 20)?
            .map(move |item| {
                if let Ok(buf) = &item {
                    let mut h = feed.lock().unwrap_or_else(|p| p.into_inner());
                    h.0.update(buf);
                    if chunks {
                        h.1.update(buf);
                    }
                }
                item
            })
            .chain(futures::stream::once(async move {
                let h = end.lock().unwrap_or_else(|p| p.into_inner());
                if h.0.count() == size && Digest(*h.0.finalize().as_bytes()) == expect {
                    // An empty buffer ends the stream after a successful check.
                    Ok(Bytes::new())
                } else {
                    Err(std::io::Error::other(format!(
                        "{display} changed while it was uploaded"
                    )))
                }
            }))
            .boxed();
        self.backend
            .put_stream(&blob_key(digest), body, PutMode::Overwrite)
            .await?;
        let builder = std::mem::take(&mut hashers.lock().unwrap_or_else(|p| p.into_inner()).1);
        Ok(builder)
    }

    /// Read a whole blob and verify it against its digest (a compressed blob is decoded chunk
    /// by chunk, each chunk verified, then the whole).
    pub async fn get_blob(&self, d: &Digest) -> Result<Bytes> {
        let data = self.backend.get(&blob_key(d)).await?;
        let actual = Digest::of(&data);
        if actual == *d {
            return Ok(data);
        }
        // Not the plain bytes: a compressed blob (its table says so), or damage.
        let table = match self.backend.get(&sidecar_key(d, CHUNKS_SUFFIX)).await {
            Ok(bytes) => ChunkTable::decode(d, &bytes).ok(),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e),
        };
        let Some(table) = table.filter(|t| t.is_compressed()) else {
            return Err(Error::DigestMismatch {
                blob: d.to_hex(),
                expected: d.to_hex(),
                actual: actual.to_hex(),
            });
        };
        if data.len() as u64 != table.stored_size() {
            return Err(Error::DigestMismatch {
                blob: d.to_hex(),
                expected: d.to_hex(),
                actual: format!(
                    "a stored object of {} bytes where its table says {}",
                    data.len(),
                    table.stored_size()
                ),
            });
        }
        let d2 = *d;
        tokio::task::spawn_blocking(move || -> Result<Bytes> {
            let mut out = Vec::with_capacity(table.blob_size as usize);
            let mut hasher = blake3::Hasher::new();
            decode_into(&table, 0, &data, &mut |plain| {
                hasher.update(plain);
                out.extend_from_slice(plain);
                Ok(())
            })?;
            check_whole(&d2, &hasher)?;
            Ok(Bytes::from(out))
        })
        .await
        .map_err(|e| Error::io("decompress", blob_key(d), std::io::Error::other(e)))?
    }

    /// A whole plain blob, verified (no compressed fallback: used to rebuild a lost table).
    async fn get_plain_blob(&self, d: &Digest) -> Result<Bytes> {
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

    /// Stream blob `d`'s plain bytes into `out` in ranged reads of about `piece` bytes,
    /// verifying the digest at the end (and, for a compressed blob, every chunk as it is
    /// decoded). Memory stays bounded by `piece` (plus a chunk) whatever the blob's size. On a
    /// mismatch the caller must discard what was written.
    pub async fn read_blob_to(
        &self,
        d: &Digest,
        out: &mut (dyn std::io::Write + Send),
        piece: u64,
    ) -> Result<u64> {
        let key = blob_key(d);
        let table = match self.backend.get(&sidecar_key(d, CHUNKS_SUFFIX)).await {
            Ok(bytes) => Some(self.reconcile(ChunkTable::decode(d, &bytes)?).await?),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e),
        };
        let mut hasher = blake3::Hasher::new();
        let mut write = |plain: &[u8]| -> Result<()> {
            hasher.update(plain);
            out.write_all(plain)
                .map_err(|e| Error::io("write blob", d.to_hex(), e))
        };
        let size = match table.filter(|t| t.stored.is_some()) {
            Some(table) => {
                // Runs of whole chunks of about `piece` plain bytes, one request each.
                let per_run = (piece / table.chunk_size).max(1);
                let mut first = 0u64;
                while first < table.chunk_count() {
                    let last = (first + per_run).min(table.chunk_count()) - 1;
                    let span = table.stored_range(first).start..table.stored_range(last).end;
                    let buf = self.backend.get_range(&key, span.clone()).await?;
                    if buf.len() as u64 != span.end - span.start {
                        return Err(short_read(d, buf.len(), &span));
                    }
                    decode_into(&table, first, &buf, &mut write)?;
                    first = last + 1;
                }
                table.blob_size
            }
            None => {
                let size = self.backend.head(&key).await?.size;
                let mut at = 0u64;
                while at < size {
                    let end = (at + piece.max(1)).min(size);
                    let buf = self.backend.get_range(&key, at..end).await?;
                    if buf.len() as u64 != end - at {
                        return Err(short_read(d, buf.len(), &(at..end)));
                    }
                    write(&buf)?;
                    at = end;
                }
                size
            }
        };
        check_whole(d, &hasher)?;
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

/// The bytes of plain blob [`spool_compressed`] reads and compresses at a time (whole chunks;
/// one chunk if a chunk is larger).
const SPOOL_PIECE: usize = 8 << 20;

/// A compressed blob spooled to a temporary file: its table and the blake3 of the stored
/// bytes (checked again as they are uploaded).
struct Spool {
    file: tempfile::NamedTempFile,
    table: ChunkTable,
    stored_digest: Digest,
}

/// Read `path` in pieces of whole chunks of `chunk_size` (about [`SPOOL_PIECE`] bytes), hash
/// and compress each piece's chunks in parallel, and write the stored form to a temporary file
/// beside `path`. The plain bytes must hash to `digest` (`size` bytes): a file that changed
/// since it was hashed is refused. The table is version 2 if any chunk shrank, else version 1
/// (the plain blob's).
fn spool_compressed(
    path: &Path,
    level: i32,
    digest: Digest,
    size: u64,
    chunk_size: u64,
) -> Result<Spool> {
    use std::io::Write;
    let cs = chunk_size as usize;
    // Whole chunks, at least one: two pieces are held at once (one read ahead).
    let piece_len = (SPOOL_PIECE / cs).max(1) * cs;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file = tempfile::Builder::new()
        .prefix(".strata-zstd-")
        .tempfile_in(dir)
        .map_err(|e| Error::io("create a spool in", dir, e))?;
    let mut src = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut out = std::io::BufWriter::with_capacity(4 << 20, file.as_file());
    let mut plain_hash = blake3::Hasher::new();
    let mut stored_hash = blake3::Hasher::new();
    let mut digests = Vec::new();
    let mut stored = Vec::new();
    let mut at = 0u64;
    let mut buf = vec![0u8; piece_len];
    // The next piece is read while this one is compressed.
    let mut n = read_full(&mut src, &mut buf).map_err(|e| Error::io("read", path, e))?;
    loop {
        let piece = &buf[..n];
        let (encoded, next) = rayon::join(
            || {
                plain_hash.update_rayon(piece);
                encode_chunks(level, piece, cs)
            },
            || -> std::io::Result<(Vec<u8>, usize)> {
                if n < piece_len {
                    return Ok((Vec::new(), 0));
                }
                let mut next = vec![0u8; piece_len];
                let k = read_full(&mut src, &mut next)?;
                Ok((next, k))
            },
        );
        let encoded: Vec<EncodedChunk> = encoded;
        for (i, (chunk_digest, frame)) in encoded.iter().enumerate() {
            let start = i * cs;
            let end = (start + cs).min(piece.len());
            let bytes = frame.as_deref().unwrap_or(&piece[start..end]);
            out.write_all(bytes)
                .map_err(|e| Error::io("write", file.path(), e))?;
            stored_hash.update(bytes);
            stored.push(StoredChunk {
                offset: at,
                len: bytes.len() as u32,
                zstd: frame.is_some(),
            });
            at += bytes.len() as u64;
            digests.push(*chunk_digest);
        }
        if n < piece_len {
            break;
        }
        let (next, k) = next.map_err(|e| Error::io("read", path, e))?;
        buf = next;
        n = k;
    }
    out.flush()
        .map_err(|e| Error::io("write", file.path(), e))?;
    drop(out);
    if plain_hash.count() != size || Digest(*plain_hash.finalize().as_bytes()) != digest {
        return Err(Error::io(
            "compress",
            path,
            std::io::Error::other("the file changed while it was stored"),
        ));
    }
    let compressed = stored.iter().any(|c| c.zstd);
    Ok(Spool {
        file,
        table: ChunkTable {
            blob: digest,
            blob_size: size,
            chunk_size,
            digests,
            stored: compressed.then_some(stored),
        },
        stored_digest: Digest(*stored_hash.finalize().as_bytes()),
    })
}

/// Read until `buf` is full or the file ends; the bytes read.
fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Decode the stored bytes `stored` of chunks `first..` of a compressed blob (as many as they
/// hold, whole), verify each chunk, and hand each one's plain bytes to `sink` in order.
fn decode_into(
    table: &ChunkTable,
    first: u64,
    stored: &[u8],
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let base = table.stored_range(first).start;
    let mut i = first;
    while i < table.chunk_count() {
        let sr = table.stored_range(i);
        let (a, b) = ((sr.start - base) as usize, (sr.end - base) as usize);
        let Some(bytes) = stored.get(a..b) else { break };
        let plain = table.open_chunk(i, bytes).map_err(|fault| {
            tracing::warn!(blob = %table.blob, chunk = i, %fault, "stored chunk failed its check");
            Error::Corrupt {
                blob: table.blob.to_hex(),
                chunk: i,
            }
        })?;
        sink(&plain)?;
        i += 1;
    }
    Ok(())
}

fn check_whole(d: &Digest, hasher: &blake3::Hasher) -> Result<()> {
    let actual = Digest(*hasher.finalize().as_bytes());
    if actual != *d {
        return Err(Error::DigestMismatch {
            blob: d.to_hex(),
            expected: d.to_hex(),
            actual: actual.to_hex(),
        });
    }
    Ok(())
}

fn short_read(d: &Digest, got: usize, span: &std::ops::Range<u64>) -> Error {
    Error::DigestMismatch {
        blob: d.to_hex(),
        expected: d.to_hex(),
        actual: format!(
            "a short read ({got} of {} bytes at {})",
            span.end - span.start,
            span.start
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;

    #[test]
    fn a_file_hashes_as_its_bytes_do() {
        let dir = tempfile::tempdir().unwrap();
        for len in [
            0usize,
            1,
            128 << 10,
            (8 << 20) - 1,
            8 << 20,
            (17 << 20) + 12345,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let p = dir.path().join(format!("f{len}"));
            std::fs::write(&p, &data).unwrap();
            assert_eq!(
                Digest::of_file(&p).unwrap(),
                (Digest::of(&data), len as u64)
            );
        }
        assert!(Digest::of_file(&dir.path().join("missing")).is_err());
    }

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
