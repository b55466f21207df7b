//! The store side: pushing imported layers ([`push_stack`]) and opening a stack of stored
//! layers for export ([`resolve_stack`], [`StoredLayer`]): the meta image fetched whole and
//! verified, file data read through a [`ChunkCache`] (every 256 KiB chunk verified against
//! the blob's chunk table).

use std::sync::Arc;

use erofs_builder::Image;
use fs_cache::chunk::ChunkCache;
use fs_cache::{Digest, LayerRef, Manifest, Pushed, Store};

use crate::export::{ExportLayer, LayerData};
use crate::import::BuiltLayer;
use crate::{Error, Result};

/// The names an image of `n` layers gets under `name` (crate docs, "Naming"), lowest first.
pub fn layer_names(name: &LayerRef, n: usize) -> Result<Vec<LayerRef>> {
    (0..n)
        .map(|i| {
            if i + 1 == n {
                return Ok(name.clone());
            }
            let s = format!(
                "{}/{}-{}:{}",
                name.kind.as_str(),
                name.name,
                i + 1,
                name.version
            );
            Ok(s.parse::<LayerRef>()?)
        })
        .collect()
}

/// One pushed layer.
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct PushedLayer {
    /// Its name.
    pub layer: String,
    /// Created, or unchanged (the same content was there).
    pub outcome: String,
    /// The stack beneath it.
    pub parents: Vec<String>,
    /// Meta image and blob sizes.
    pub meta_bytes: u64,
    /// Bytes of its data blobs (the main blob and its tails blob).
    pub blob_bytes: u64,
    /// The image layers' diff_ids it holds.
    pub diff_ids: Vec<String>,
}

/// Stores the built layers (meta images and blobs first, all of them) and pushes their
/// manifests lowest first, each naming the stack beneath it in `parents`.
pub async fn push_stack(
    store: &Store,
    built: &[BuiltLayer],
    name: &LayerRef,
    source: &str,
    compression: fs_cache::Compression,
) -> Result<Vec<PushedLayer>> {
    let names = layer_names(name, built.len())?;
    let mut manifests = Vec::new();
    for (i, b) in built.iter().enumerate() {
        let mut own = vec![fs_cache::BlobFile::new(
            &b.blob,
            fs_cache::Digest(b.stats.blob_blake3),
            fs_cache::chunk::CHUNK_SIZE,
        )];
        if let (Some(path), Some(t)) = (&b.tails, &b.stats.tails) {
            own.push(fs_cache::BlobFile::new(
                path,
                fs_cache::Digest(t.blake3),
                u64::from(t.chunk_size),
            ));
        }
        let (meta, own) = store.put_built_layer(&b.meta, &own, compression).await?;
        let diff_ids: Vec<String> = b.diff_ids.iter().map(|d| d.to_string()).collect();
        let mut m = Manifest::new(
            names[i].clone(),
            Some(meta.blob_ref()),
            own.iter().map(|p| p.blob_ref()).collect(),
            format!(
                "{source} layer {}/{} diff_id {}",
                i + 1,
                built.len(),
                diff_ids.join(",")
            ),
        );
        m.parents = names[..i].to_vec();
        manifests.push((m, meta.size, own.iter().map(|p| p.size).sum(), diff_ids));
    }
    let mut out = Vec::new();
    for (m, meta_bytes, blob_bytes, diff_ids) in manifests {
        let outcome = match store.push_manifest(&m).await? {
            Pushed::Created => "created",
            Pushed::Unchanged => "unchanged",
        };
        out.push(PushedLayer {
            layer: m.layer.to_string(),
            outcome: outcome.into(),
            parents: m.parents.iter().map(|p| p.to_string()).collect(),
            meta_bytes,
            blob_bytes,
            diff_ids,
        });
    }
    Ok(out)
}

/// The manifests of the stack `refs` name, lowest first: each REF preceded by its
/// `parents` (the stack beneath it, lowest first), each layer once (first place kept). A
/// parent's own parents are brought along too (a layer that names only its immediate parent
/// still exports whole); a cycle of parents is refused.
pub async fn resolve_stack(store: &Store, refs: &[LayerRef]) -> Result<Vec<Manifest>> {
    let mut out: Vec<Manifest> = Vec::new();
    for r in refs {
        // Depth first, parents before the layer; `path` holds the layers being expanded.
        let mut work: Vec<(LayerRef, bool)> = vec![(r.clone(), false)];
        let mut path: Vec<LayerRef> = Vec::new();
        let mut fetched: Vec<Manifest> = Vec::new();
        while let Some((l, expanded)) = work.pop() {
            if expanded {
                path.pop();
                if let Some(i) = fetched.iter().position(|m| m.layer == l) {
                    let m = fetched.swap_remove(i);
                    if !out.iter().any(|o| o.layer == m.layer) {
                        out.push(m);
                    }
                }
                continue;
            }
            if out.iter().any(|o| o.layer == l) {
                continue;
            }
            if path.contains(&l) || path.len() > 4096 {
                return Err(Error::Unsupported(format!(
                    "the parents of {r} form a cycle through {l}"
                )));
            }
            let m = store.manifest(&l).await?;
            path.push(l.clone());
            work.push((l, true));
            for p in m.parents.iter().rev() {
                work.push((p.clone(), false));
            }
            fetched.push(m);
        }
    }
    Ok(out)
}

/// A layer's data read through the chunk cache (device `d` = the manifest's blob `d - 1`:
/// its own, then those a deduped layer points into). Blocking: call from a thread outside
/// the async runtime (e.g. `spawn_blocking`).
#[derive(Debug)]
pub struct CacheData {
    cache: ChunkCache,
    blobs: Vec<Digest>,
    rt: tokio::runtime::Handle,
}

/// Largest single read through the cache (it coalesces adjacent chunks into one request).
const READ_MAX: u64 = 4 << 20;

impl LayerData for CacheData {
    fn read_at(&self, device: u16, offset: u64, buf: &mut [u8]) -> Result<()> {
        let blob = usize::from(device)
            .checked_sub(1)
            .and_then(|i| self.blobs.get(i))
            .ok_or_else(|| {
                erofs_builder::Error::Corrupt(format!(
                    "chunk on device {device}, not in the layer's {} blob(s)",
                    self.blobs.len()
                ))
            })?;
        let mut done = 0usize;
        while done < buf.len() {
            let want = ((buf.len() - done) as u64).min(READ_MAX);
            let b = self
                .rt
                .block_on(self.cache.read(blob, offset + done as u64, want))?;
            if b.is_empty() {
                return Err(erofs_builder::Error::Corrupt(format!(
                    "chunk index points past the end of blob {blob}"
                ))
                .into());
            }
            buf[done..done + b.len()].copy_from_slice(&b);
            done += b.len();
        }
        Ok(())
    }
}

/// A stored layer opened for export.
#[derive(Debug)]
pub struct StoredLayer {
    /// Its manifest.
    pub manifest: Manifest,
    /// Its meta image.
    pub image: Image,
    /// Its data.
    pub data: CacheData,
}

impl StoredLayer {
    /// Fetches the meta image (verified whole) and checks that its device table names the
    /// layer's blobs, in order.
    pub async fn open(store: &Store, cache: &ChunkCache, manifest: Manifest) -> Result<Self> {
        let meta = manifest.meta.as_ref().ok_or_else(|| {
            Error::Unsupported(format!(
                "{} has no EROFS meta image (a block layer?)",
                manifest.layer
            ))
        })?;
        let bytes = store.get_blob(&meta.digest).await?;
        let image = Image::from_bytes(bytes.to_vec())?;
        let table = image.device_table();
        let named = table.len() == manifest.blobs.len()
            && table
                .iter()
                .zip(&manifest.blobs)
                .all(|(d, b)| d.tag == b.digest.to_hex().as_bytes());
        if !named {
            return Err(Error::Unsupported(format!(
                "{}: the meta image's device table does not name the layer's blobs",
                manifest.layer
            )));
        }
        let blobs = manifest.blobs.iter().map(|b| b.digest).collect();
        Ok(StoredLayer {
            manifest,
            image,
            data: CacheData {
                cache: cache.clone(),
                blobs,
                rt: tokio::runtime::Handle::current(),
            },
        })
    }

    /// The layer as [`export`](crate::export) takes it.
    pub fn as_export(&self) -> ExportLayer<'_> {
        ExportLayer {
            name: self.manifest.layer.to_string(),
            created: self.manifest.created.clone(),
            image: &self.image,
            data: &self.data,
        }
    }
}

/// Opens every layer of `manifests` (see [`StoredLayer::open`]).
pub async fn open_layers(
    store: &Store,
    cache: &ChunkCache,
    manifests: Vec<Manifest>,
) -> Result<Arc<Vec<StoredLayer>>> {
    let mut out = Vec::new();
    for m in manifests {
        out.push(StoredLayer::open(store, cache, m).await?);
    }
    Ok(Arc::new(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stacks_resolve_lowest_first_with_every_ancestor() {
        let store = Store::new(Arc::new(fs_cache::MemoryBackend::new()));
        let push = |name: &str, parents: &[&str]| {
            let mut m = Manifest::new(name.parse().unwrap(), None, vec![], "test".into());
            m.parents = parents.iter().map(|p| p.parse().unwrap()).collect();
            m
        };
        for m in [
            push("base/a:1", &[]),
            push("base/b:1", &["base/a:1"]),
            push("base/c:1", &["base/b:1"]),
            push("base/d:1", &["base/a:1", "base/b:1"]),
            push("base/x:1", &["base/y:1"]),
            push("base/y:1", &["base/x:1"]),
        ] {
            store.push_manifest(&m).await.unwrap();
        }
        let names = |v: Vec<Manifest>| -> Vec<String> {
            v.into_iter().map(|m| m.layer.to_string()).collect()
        };
        let r = |s: &str| -> LayerRef { s.parse().unwrap() };
        assert_eq!(
            names(resolve_stack(&store, &[r("base/c:1")]).await.unwrap()),
            ["base/a:1", "base/b:1", "base/c:1"]
        );
        assert_eq!(
            names(
                resolve_stack(&store, &[r("base/a:1"), r("base/d:1")])
                    .await
                    .unwrap()
            ),
            ["base/a:1", "base/b:1", "base/d:1"]
        );
        let e = resolve_stack(&store, &[r("base/x:1")]).await.unwrap_err();
        assert!(e.to_string().contains("cycle"), "{e}");
        assert!(resolve_stack(&store, &[r("base/nope:1")]).await.is_err());
    }
}
