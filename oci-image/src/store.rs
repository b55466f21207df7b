//! The store side: pushing imported layers ([`push_stack`]) and opening a stack of stored
//! layers for export ([`resolve_stack`], [`StoredLayer`]): the meta image fetched whole and
//! verified, file data read through a [`ChunkCache`] (every 256 KiB chunk verified against
//! the blob's chunk table).

use std::sync::Arc;

use erofs_builder::Image;
use fs_cache::chunk::ChunkCache;
use fs_cache::{BlobRef, Digest, LayerRef, Manifest, Pushed, Store};

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
    /// Blob bytes.
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
) -> Result<Vec<PushedLayer>> {
    let names = layer_names(name, built.len())?;
    let mut manifests = Vec::new();
    for (i, b) in built.iter().enumerate() {
        let meta = store.put_blob_file(&b.meta).await?;
        let blob = store.put_blob_file(&b.blob).await?;
        if blob.digest.0 != b.stats.blob_blake3 {
            return Err(Error::Unsupported(format!(
                "the data blob of {} changed between build and upload",
                names[i]
            )));
        }
        let diff_ids: Vec<String> = b.diff_ids.iter().map(|d| d.to_string()).collect();
        let mut m = Manifest::new(
            names[i].clone(),
            Some(BlobRef {
                digest: meta.digest,
                size: meta.size,
            }),
            vec![BlobRef {
                digest: blob.digest,
                size: blob.size,
            }],
            format!(
                "{source} layer {}/{} diff_id {}",
                i + 1,
                built.len(),
                diff_ids.join(",")
            ),
        );
        m.parents = names[..i].to_vec();
        manifests.push((m, meta.size, blob.size, diff_ids));
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
/// `parents` (the stack beneath it), each layer once (first place kept).
pub async fn resolve_stack(store: &Store, refs: &[LayerRef]) -> Result<Vec<Manifest>> {
    let mut out: Vec<Manifest> = Vec::new();
    for r in refs {
        let m = store.manifest(r).await?;
        for p in &m.parents {
            if !out.iter().any(|o| &o.layer == p) {
                out.push(store.manifest(p).await?);
            }
        }
        if !out.iter().any(|o| o.layer == m.layer) {
            out.push(m);
        }
    }
    Ok(out)
}

/// A layer's data read through the chunk cache (device 1 = its blob). Blocking: call from a
/// thread outside the async runtime (e.g. `spawn_blocking`).
#[derive(Debug)]
pub struct CacheData {
    cache: ChunkCache,
    blob: Digest,
    rt: tokio::runtime::Handle,
}

/// Largest single read through the cache (it coalesces adjacent chunks into one request).
const READ_MAX: u64 = 4 << 20;

impl LayerData for CacheData {
    fn read_at(&self, device: u16, offset: u64, buf: &mut [u8]) -> Result<()> {
        if device != 1 {
            return Err(Error::Unsupported(format!(
                "chunk on device {device}; Strata layers have one blob (device 1)"
            )));
        }
        let mut done = 0usize;
        while done < buf.len() {
            let want = ((buf.len() - done) as u64).min(READ_MAX);
            let b = self
                .rt
                .block_on(self.cache.read(&self.blob, offset + done as u64, want))?;
            if b.is_empty() {
                return Err(erofs_builder::Error::Corrupt(format!(
                    "chunk index points past the end of blob {}",
                    self.blob
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
    /// layer's blob.
    pub async fn open(store: &Store, cache: &ChunkCache, manifest: Manifest) -> Result<Self> {
        let meta = manifest.meta.as_ref().ok_or_else(|| {
            Error::Unsupported(format!(
                "{} has no EROFS meta image (a block layer?)",
                manifest.layer
            ))
        })?;
        let bytes = store.get_blob(&meta.digest).await?;
        let image = Image::from_bytes(bytes.to_vec())?;
        let blob = match (manifest.blobs.as_slice(), image.device_table()) {
            ([b], [d]) if d.tag == b.digest.to_hex().as_bytes() => b.digest,
            ([], []) => Digest::of(b""),
            _ => {
                return Err(Error::Unsupported(format!(
                    "{}: the meta image's device table does not name the layer's one blob",
                    manifest.layer
                )))
            }
        };
        Ok(StoredLayer {
            manifest,
            image,
            data: CacheData {
                cache: cache.clone(),
                blob,
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
