//! Versioned layers: `KIND/NAME:VERSION` names that resolve to manifests.
//!
//! # Layout in the backend
//! | key | what |
//! | --- | --- |
//! | `layers/<kind>/<name>/<version>.json` | the manifest (JSON, [`Manifest`]) |
//! | `layers/<kind>/<name>/<version>.removed` | the manifest of a removed version (a tombstone) |
//!
//! # Manifest schema, version 1
//! ```json
//! {
//!   "schema_version": 1,
//!   "layer": "base/debian:12.7",
//!   "meta": { "digest": "<blake3 hex>", "size": 1234 },
//!   "blobs": [ { "digest": "<blake3 hex>", "size": 56789,
//!                "compression": "zstd", "stored_size": 20480, "chunk_size": 65536 } ],
//!   "parents": [ "base/debian:12.6" ],
//!   "created": "2026-11-30T22:00:00Z",
//!   "source": "dir:/srv/rootfs",
//!   "builder": "strata 0.1.0",
//!   "built_by": { "sandbox": "sb-1", "node": "n1", "identity": "<machine id>",
//!                 "stack": [ "base/debian:12.6" ], "secret_names": [ "token" ] }
//! }
//! ```
//! `parents` is the stack the layer goes on, lowest first: a sandbox or mount of the layer
//! brings them along. `built_by` is present only on layers packed from a sandbox.
//! `meta` (the EROFS meta image) is absent for layers that have none (block layers). A blob's
//! `digest` and `size` are those of its plain bytes; `compression` and `stored_size` say how
//! it is stored when it is not plain (`"zstd"`: chunks as zstd frames,
//! [`crate::chunk::codec`]) and are absent for a plain blob, so manifests of plain layers are
//! unchanged. `chunk_size` is the chunk size of the blob's chunk table, absent when it is
//! 256 KiB (every blob before it existed). All three are informational: readers take how a
//! blob is stored, and its chunk size, from its chunk table.
//! Unknown fields are ignored; a `schema_version` newer than this code understands is
//! refused.
//!
//! # Invariants
//! - **Versions are immutable.** A manifest is written with an atomic create; pushing a
//!   different manifest under an existing version fails with [`Error::VersionExists`]. Pushing
//!   the same content again is a no-op ("the same" = same layer, meta, blobs and parents; the
//!   build time and source are informational). Removing a version leaves a tombstone, so the
//!   version can only ever come back with the content it had.
//! - **No dangling manifests.** A push checks that every blob it references is stored, before
//!   and after writing the manifest (the second check catches a concurrent gc; the manifest is
//!   then rolled back and the push fails).

use std::fmt;
use std::str::FromStr;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::backend::PutMode;
use crate::error::{Error, Result};
use crate::store::{Digest, Store};

/// The manifest schema this code writes and the newest it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// What a layer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    Base,
    Workspace,
    Toolkit,
    Snapshot,
}

impl LayerKind {
    pub const ALL: [LayerKind; 4] = [
        LayerKind::Base,
        LayerKind::Workspace,
        LayerKind::Toolkit,
        LayerKind::Snapshot,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::Base => "base",
            LayerKind::Workspace => "workspace",
            LayerKind::Toolkit => "toolkit",
            LayerKind::Snapshot => "snapshot",
        }
    }
}

/// A layer name: `KIND/NAME:VERSION`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerRef {
    pub kind: LayerKind,
    pub name: String,
    pub version: String,
}

fn valid_component(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+'))
}

impl FromStr for LayerRef {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| Error::InvalidLayerRef {
            reference: s.to_owned(),
            reason: reason.to_owned(),
        };
        let (kind, rest) = s.split_once('/').ok_or_else(|| bad("missing '/'"))?;
        let kind = LayerKind::ALL
            .into_iter()
            .find(|k| k.as_str() == kind)
            .ok_or_else(|| bad(&format!("unknown kind {kind:?}")))?;
        let (name, version) = rest
            .split_once(':')
            .ok_or_else(|| bad("missing ':VERSION'"))?;
        if !valid_component(name) {
            return Err(bad(
                "NAME must be 1-128 characters of [A-Za-z0-9._+-] starting with a letter or digit",
            ));
        }
        if !valid_component(version) {
            return Err(bad(
                "VERSION must be 1-128 characters of [A-Za-z0-9._+-] starting with a letter or digit",
            ));
        }
        Ok(LayerRef {
            kind,
            name: name.to_owned(),
            version: version.to_owned(),
        })
    }
}

impl fmt::Display for LayerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.kind.as_str(), self.name, self.version)
    }
}

impl Serialize for LayerRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LayerRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl LayerRef {
    fn base_key(&self) -> String {
        format!(
            "layers/{}/{}/{}",
            self.kind.as_str(),
            self.name,
            self.version
        )
    }

    /// The key of this version's manifest.
    pub fn manifest_key(&self) -> String {
        format!("{}.json", self.base_key())
    }

    /// The key of this version's tombstone.
    pub fn tombstone_key(&self) -> String {
        format!("{}.removed", self.base_key())
    }

    /// The layer a manifest key names, if it is one.
    pub fn from_manifest_key(key: &str) -> Option<Self> {
        let rest = key.strip_prefix("layers/")?.strip_suffix(".json")?;
        let mut parts = rest.split('/');
        let (kind, name, version) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        format!("{kind}/{name}:{version}").parse().ok()
    }
}

/// A blob a manifest references.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    pub digest: Digest,
    /// Bytes of the plain blob.
    pub size: u64,
    /// How the blob is stored, when not plain (`"zstd"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<String>,
    /// Bytes of the stored object, when not plain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_size: Option<u64>,
    /// The chunk size of the blob's chunk table, when not 256 KiB
    /// ([`crate::chunk::CHUNK_SIZE`]). Informational: readers take the chunk size from the
    /// table ([`Store::chunk_table`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<u64>,
}

impl BlobRef {
    /// A blob stored plain.
    pub fn plain(digest: Digest, size: u64) -> Self {
        Self {
            digest,
            size,
            compression: None,
            stored_size: None,
            chunk_size: None,
        }
    }

    /// Bytes of the stored object.
    pub fn stored_bytes(&self) -> u64 {
        self.stored_size.unwrap_or(self.size)
    }
}

/// A layer's manifest (schema in the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema_version: u32,
    pub layer: LayerRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<BlobRef>,
    #[serde(default)]
    pub blobs: Vec<BlobRef>,
    #[serde(default)]
    pub parents: Vec<LayerRef>,
    pub created: String,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub builder: String,
    /// The sandbox a layer was packed from (`strata pack-diff`); informational, like
    /// `source`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub built_by: Option<BuiltBy>,
}

/// Provenance of a layer packed from a sandbox's upper: who built it, on what. A sandbox
/// started from the layer gets none of this (no secret of the builder; names only here).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuiltBy {
    /// The builder sandbox's id.
    pub sandbox: String,
    /// The node (host name) it ran on.
    #[serde(default)]
    pub node: String,
    /// The builder's identity: its machine id (`/etc/machine-id` inside it).
    #[serde(default)]
    pub identity: String,
    /// The stack it ran on, lowest first (also the layer's `parents`).
    #[serde(default)]
    pub stack: Vec<LayerRef>,
    /// Names of the secrets it was given (never their values); the packed files were
    /// checked not to contain them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_names: Vec<String>,
}

impl Manifest {
    /// A new manifest stamped with the current time and this builder.
    pub fn new(
        layer: LayerRef,
        meta: Option<BlobRef>,
        blobs: Vec<BlobRef>,
        source: String,
    ) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            layer,
            meta,
            blobs,
            parents: Vec::new(),
            created: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            source,
            builder: concat!("strata ", env!("CARGO_PKG_VERSION")).to_owned(),
            built_by: None,
        }
    }

    /// Every blob this layer needs: the meta image first, then the data blobs.
    pub fn all_blobs(&self) -> impl Iterator<Item = &BlobRef> {
        self.meta.iter().chain(self.blobs.iter())
    }

    /// Total bytes of the referenced blobs.
    pub fn total_size(&self) -> u64 {
        self.all_blobs().map(|b| b.size).sum()
    }

    /// Whether two manifests describe the same layer content (blobs compared by digest and
    /// size: how a blob is stored does not change the content).
    pub fn same_content(&self, other: &Manifest) -> bool {
        let content = |b: &BlobRef| (b.digest, b.size);
        self.layer == other.layer
            && self.meta.as_ref().map(content) == other.meta.as_ref().map(content)
            && self
                .blobs
                .iter()
                .map(content)
                .eq(other.blobs.iter().map(content))
            && self.parents == other.parents
    }

    /// Parse and check a manifest read from `key`.
    pub fn parse(expected: &LayerRef, bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::BadManifest {
            layer: expected.to_string(),
            reason,
        };
        #[derive(Deserialize)]
        struct Version {
            schema_version: u32,
        }
        let v: Version = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if v.schema_version == 0 || v.schema_version > SCHEMA_VERSION {
            return Err(bad(format!(
                "schema_version {} is not supported (this strata reads 1..={SCHEMA_VERSION})",
                v.schema_version
            )));
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if m.layer != *expected {
            return Err(bad(format!("it names layer {}", m.layer)));
        }
        Ok(m)
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// Outcome of a push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushed {
    /// The version was created.
    Created,
    /// The same content was already pushed under this version; nothing changed.
    Unchanged,
}

/// One of a built layer's own data blobs, to store with [`Store::put_built_layer`]: the file,
/// the blake3 digest its builder computed, and the chunk size its chunk table gets (256 KiB
/// for the main blob, device 1; the builder's tail chunk size for a tails blob, device 2).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BlobFile {
    pub path: std::path::PathBuf,
    pub digest: Digest,
    pub chunk_size: u64,
}

impl BlobFile {
    pub fn new(path: impl Into<std::path::PathBuf>, digest: Digest, chunk_size: u64) -> Self {
        Self {
            path: path.into(),
            digest,
            chunk_size,
        }
    }
}

impl Store {
    /// Stores a built layer's files: the meta image (256 KiB chunks), then its own data
    /// blobs in device order, each at its chunk size (its chunk table stored before it where
    /// the store needs that), all with `compression`. A data blob whose digest is not the
    /// one its builder computed (the file changed between the build and the upload) fails
    /// with [`Error::DigestMismatch`]: a manifest listing it would point the meta image's
    /// chunk indexes at other bytes. Returns the puts of the meta image and of the blobs, in
    /// the order given.
    pub async fn put_built_layer(
        &self,
        meta: &std::path::Path,
        blobs: &[BlobFile],
        compression: crate::Compression,
    ) -> Result<(crate::PutBlob, Vec<crate::PutBlob>)> {
        let meta = self
            .put_blob_file_opts(meta, &crate::store::PutOptions::new(compression))
            .await?;
        let mut puts = Vec::with_capacity(blobs.len());
        for b in blobs {
            let opts = crate::store::PutOptions::new(compression).with_chunk_size(b.chunk_size);
            let put = self.put_blob_file_opts(&b.path, &opts).await?;
            if put.digest != b.digest {
                return Err(Error::DigestMismatch {
                    blob: b.path.display().to_string(),
                    expected: b.digest.to_hex(),
                    actual: put.digest.to_hex(),
                });
            }
            puts.push(put);
        }
        Ok((meta, puts))
    }
}

impl Store {
    async fn read_manifest_at(&self, layer: &LayerRef, key: &str) -> Result<Option<Manifest>> {
        match self.backend().get(key).await {
            Ok(bytes) => Ok(Some(Manifest::parse(layer, &bytes)?)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The manifest of `layer`.
    pub async fn manifest(&self, layer: &LayerRef) -> Result<Manifest> {
        self.read_manifest_at(layer, &layer.manifest_key())
            .await?
            .ok_or_else(|| Error::LayerNotFound(layer.to_string()))
    }

    async fn check_blobs(&self, m: &Manifest) -> Result<()> {
        // Owned items: a closure over borrowed ones makes the future Send for one lifetime
        // only, and callers spawn it.
        // The stored object is as long as the manifest says it is stored; a plain object of
        // the blob's size is accepted too (the blob was stored plain by another put).
        let blobs: Vec<(Digest, u64, u64)> = m
            .all_blobs()
            .map(|b| (b.digest, b.size, b.stored_bytes()))
            .collect();
        let missing = futures::stream::iter(blobs)
            .map(|(digest, size, stored)| async move {
                match self.stat_blob(&digest).await? {
                    Some(meta) if meta.size == stored || meta.size == size => Ok(None),
                    _ => Ok::<_, Error>(Some(digest)),
                }
            })
            .buffer_unordered(16)
            .try_filter_map(|x| async move { Ok(x) })
            .try_collect::<Vec<_>>()
            .await?;
        match missing.first() {
            None => Ok(()),
            Some(d) => Err(Error::MissingBlob {
                layer: m.layer.to_string(),
                blob: d.to_hex(),
            }),
        }
    }

    /// Push a manifest. Its blobs must already be stored.
    pub async fn push_manifest(&self, m: &Manifest) -> Result<Pushed> {
        if m.schema_version != SCHEMA_VERSION {
            return Err(Error::BadManifest {
                layer: m.layer.to_string(),
                reason: format!("this strata writes schema_version {SCHEMA_VERSION} only"),
            });
        }
        self.check_blobs(m).await?;
        let exists = |existing: &Manifest| Error::VersionExists {
            layer: m.layer.to_string(),
            existing: Digest::of(&existing.to_json()).to_hex()[..16].to_owned(),
        };
        if let Some(old) = self
            .read_manifest_at(&m.layer, &m.layer.tombstone_key())
            .await?
        {
            if !old.same_content(m) {
                return Err(exists(&old));
            }
        }
        match self
            .backend()
            .put_opts(
                &m.layer.manifest_key(),
                Bytes::from(m.to_json()),
                PutMode::Create,
            )
            .await
        {
            Ok(_) => {}
            Err(Error::AlreadyExists { .. }) => {
                let old = self.manifest(&m.layer).await?;
                return if old.same_content(m) {
                    Ok(Pushed::Unchanged)
                } else {
                    Err(exists(&old))
                };
            }
            Err(e) => return Err(e),
        }
        if let Err(e) = self.check_blobs(m).await {
            let _ = self.backend().delete(&m.layer.manifest_key()).await;
            return Err(e);
        }
        Ok(Pushed::Created)
    }

    /// Every pushed layer, sorted.
    pub async fn list_layers(&self) -> Result<Vec<LayerRef>> {
        let mut out: Vec<LayerRef> = self
            .backend()
            .list("layers/")
            .await?
            .iter()
            .filter_map(|m| LayerRef::from_manifest_key(&m.key))
            .collect();
        out.sort();
        Ok(out)
    }

    /// Every pushed layer with its manifest.
    pub async fn list_manifests(&self) -> Result<Vec<Manifest>> {
        let layers = self.list_layers().await?;
        futures::stream::iter(layers)
            .map(|l| async move { self.manifest(&l).await })
            .buffered(16)
            .try_collect()
            .await
    }

    /// Remove a layer version (its blobs stay until `gc`). The version keeps a tombstone.
    pub async fn remove_layer(&self, layer: &LayerRef) -> Result<Manifest> {
        let m = self.manifest(layer).await?;
        self.backend()
            .put(&layer.tombstone_key(), Bytes::from(m.to_json()))
            .await?;
        self.backend().delete(&layer.manifest_key()).await?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;
    use std::sync::Arc;

    #[test]
    fn refs() {
        let r: LayerRef = "toolkit/python-3.12:1.0.2".parse().unwrap();
        assert_eq!(r.kind, LayerKind::Toolkit);
        assert_eq!(r.to_string(), "toolkit/python-3.12:1.0.2");
        assert_eq!(
            LayerRef::from_manifest_key(&r.manifest_key()),
            Some(r.clone())
        );
        assert_eq!(LayerRef::from_manifest_key(&r.tombstone_key()), None);
        for bad in [
            "",
            "base",
            "base/x",
            "os/x:1",
            "base/:1",
            "base/x:",
            "base/../x:1",
            "base/x:1/2",
            "base/a/b:1",
            "base/.x:1",
            "base/x:.1",
            "Base/x:1",
        ] {
            let e = bad.parse::<LayerRef>().unwrap_err();
            assert!(e.to_string().contains("KIND/NAME:VERSION"), "{bad}: {e}");
        }
    }

    async fn store_with_blob() -> (Store, BlobRef) {
        let store = Store::new(Arc::new(MemoryBackend::new()));
        let p = store.put_blob(Bytes::from_static(b"meta")).await.unwrap();
        (store, p.blob_ref())
    }

    #[tokio::test]
    async fn versions_are_immutable() {
        let (store, meta) = store_with_blob().await;
        let r: LayerRef = "base/os:1".parse().unwrap();
        let m = Manifest::new(r.clone(), Some(meta.clone()), vec![], "test".into());
        assert_eq!(store.push_manifest(&m).await.unwrap(), Pushed::Created);
        // Same content, different build time: a no-op.
        let mut again = m.clone();
        again.created = "2030-01-01T00:00:00Z".into();
        assert_eq!(
            store.push_manifest(&again).await.unwrap(),
            Pushed::Unchanged
        );
        // Different content: refused.
        let other = store.put_blob(Bytes::from_static(b"data")).await.unwrap();
        let mut changed = m.clone();
        changed.blobs.push(other.blob_ref());
        let e = store.push_manifest(&changed).await.unwrap_err();
        assert!(matches!(e, Error::VersionExists { .. }), "{e}");
        assert_eq!(store.manifest(&r).await.unwrap(), m);
        assert_eq!(store.list_layers().await.unwrap(), vec![r.clone()]);

        // Removal leaves a tombstone: the version may come back only as it was.
        store.remove_layer(&r).await.unwrap();
        assert!(store.manifest(&r).await.unwrap_err().is_not_found());
        assert!(store.list_layers().await.unwrap().is_empty());
        assert!(matches!(
            store.push_manifest(&changed).await.unwrap_err(),
            Error::VersionExists { .. }
        ));
        assert_eq!(store.push_manifest(&m).await.unwrap(), Pushed::Created);
    }

    #[test]
    fn blob_chunk_size_is_optional_in_manifests() {
        let r: LayerRef = "base/os:3".parse().unwrap();
        let d = Digest::of(b"blob");
        // A manifest written before `chunk_size` existed: 256 KiB chunks, `None`.
        let old = format!(
            r#"{{"schema_version": 1, "layer": "base/os:3", "created": "",
                "blobs": [{{"digest": "{d}", "size": 7, "compression": "zstd", "stored_size": 5}}]}}"#
        );
        let m = Manifest::parse(&r, old.as_bytes()).unwrap();
        assert_eq!(m.blobs[0].chunk_size, None);
        assert_eq!(m.blobs[0].stored_bytes(), 5);
        // Absent when `None` (manifests of 256 KiB blobs are unchanged), kept when set.
        let json = String::from_utf8(m.to_json()).unwrap();
        assert!(!json.contains("chunk_size"), "{json}");
        let mut tails = m.clone();
        tails.blobs.push(BlobRef {
            chunk_size: Some(64 << 10),
            ..BlobRef::plain(Digest::of(b"tails"), 3)
        });
        let json = String::from_utf8(tails.to_json()).unwrap();
        assert!(json.contains(r#""chunk_size": 65536"#), "{json}");
        let back = Manifest::parse(&r, json.as_bytes()).unwrap();
        assert_eq!(back, tails);
        // Informational: the same content whatever it says.
        assert!(back.same_content(&tails));
        assert_eq!(BlobRef::plain(d, 7).chunk_size, None);
    }

    #[tokio::test]
    async fn missing_blobs_and_bad_manifests_are_refused() {
        let (store, _) = store_with_blob().await;
        let r: LayerRef = "workspace/w:2".parse().unwrap();
        let ghost = BlobRef::plain(Digest::of(b"never stored"), 12);
        let m = Manifest::new(r.clone(), None, vec![ghost], "test".into());
        let e = store.push_manifest(&m).await.unwrap_err();
        assert!(matches!(e, Error::MissingBlob { .. }), "{e}");
        assert!(store.list_layers().await.unwrap().is_empty());

        for bad in [
            &b"not json"[..],
            br#"{"schema_version": 2}"#,
            br#"{"schema_version": 1, "layer": "base/other:1", "created": ""}"#,
            br#"{"schema_version": 1, "layer": "workspace/w:2", "created": "", "blobs": [{"digest": "zz", "size": 1}]}"#,
        ] {
            store
                .backend()
                .put(&r.manifest_key(), Bytes::copy_from_slice(bad))
                .await
                .unwrap();
            let e = store.manifest(&r).await.unwrap_err();
            assert!(matches!(e, Error::BadManifest { .. }), "{e}");
        }
    }
}
