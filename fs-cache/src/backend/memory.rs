//! An in-memory backend: one more real implementation of the trait, for unit tests and
//! experiments. It passes the same conformance suite as the POSIX and S3 backends.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;

use super::{clamp_range, validate_key, validate_prefix, Backend, ByteStream, ObjectMeta, PutMode};
use crate::error::{Error, Result};

#[derive(Clone, Debug)]
struct Object {
    data: Bytes,
    etag: u64,
    modified: SystemTime,
}

/// Objects held in a sorted map behind a lock.
#[derive(Debug, Default)]
pub struct MemoryBackend {
    objects: RwLock<BTreeMap<String, Object>>,
    next_etag: AtomicU64,
}

impl MemoryBackend {
    pub fn new() -> Self {
        Self::default()
    }

    fn meta(key: &str, o: &Object) -> ObjectMeta {
        ObjectMeta {
            key: key.to_owned(),
            size: o.data.len() as u64,
            etag: Some(format!("mem-{}", o.etag)),
            last_modified: Some(o.modified),
        }
    }

    fn not_found(&self, key: &str) -> Error {
        Error::NotFound {
            backend: self.to_string(),
            key: key.to_owned(),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Object>> {
        // A panic while holding the lock cannot leave the map half-updated (every update is a
        // single insert or remove), so a poisoned lock is still consistent.
        self.objects.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Object>> {
        self.objects.write().unwrap_or_else(|p| p.into_inner())
    }
}

impl fmt::Display for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("memory://")
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        validate_key(key)?;
        let map = self.read();
        let o = map.get(key).ok_or_else(|| self.not_found(key))?;
        let r = clamp_range(self, key, range, o.data.len() as u64)?;
        Ok(o.data.slice(r.start as usize..r.end as usize))
    }

    async fn put_stream(
        &self,
        key: &str,
        mut body: ByteStream,
        mode: PutMode,
    ) -> Result<ObjectMeta> {
        validate_key(key)?;
        let mut buf = BytesMut::new();
        while let Some(part) = body.next().await {
            let part = part.map_err(|e| Error::io("read put body for", key, e))?;
            buf.extend_from_slice(&part);
        }
        let object = Object {
            data: buf.freeze(),
            etag: self.next_etag.fetch_add(1, Ordering::Relaxed),
            modified: SystemTime::now(),
        };
        let meta = Self::meta(key, &object);
        let mut map = self.write();
        if mode == PutMode::Create && map.contains_key(key) {
            return Err(Error::AlreadyExists {
                backend: self.to_string(),
                key: key.to_owned(),
            });
        }
        map.insert(key.to_owned(), object);
        Ok(meta)
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        let map = self.read();
        let o = map.get(key).ok_or_else(|| self.not_found(key))?;
        Ok(Self::meta(key, o))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        validate_prefix(prefix)?;
        let map = self.read();
        Ok(map
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, o)| Self::meta(k, o))
            .collect())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        self.write().remove(key);
        Ok(())
    }

    /// None: a put here is one insertion under the lock, done or not done.
    async fn sweep_abandoned(&self, _before: SystemTime, _dry_run: bool) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
}
