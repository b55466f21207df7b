//! Sealed layers in the store: push one as a versioned layer, and resolve a stored stack.
//!
//! A block layer's manifest has no meta image and exactly one data blob, the sealed layer
//! file; `source` is `overlaybd:<layer id hex>` and `parents` names the layer below (when it
//! has a name). The layer ids inside the files remain the authority: a resolved stack is
//! checked again by [`crate::Device::open`].

use std::path::Path;
use std::sync::Arc;

use fs_cache::chunk::ChunkCache;
use fs_cache::{BlobRef, LayerRef, Manifest, Pushed, Store};

use crate::error::{Error, Result};
use zerocopy::FromBytes;

use crate::format::{LayerId, RawTrailer, SealedLayer, LAYER_MAGIC, TRAILER_SIZE};
use crate::source::{BlobSource, FileSource, LayerSource};

/// The deepest stack [`resolve_stack`] follows (a guard against manifest cycles).
pub const MAX_STACK_DEPTH: usize = 256;

/// Prefix of a block layer manifest's `source`.
pub const SOURCE_PREFIX: &str = "overlaybd:";

/// What [`push_layer`] stored.
#[derive(Clone, Debug)]
pub struct PushedLayer {
    /// The pushed file's layer id (also in the manifest's `source`).
    pub id: LayerId,
    pub manifest: Manifest,
    pub pushed: Pushed,
    pub blob: BlobRef,
}

/// Store the sealed layer at `file` as a blob and publish it as `name`, on top of `parent`.
/// The file is checked first; when `parent` is given its stored layer id must be the file's
/// parent id (and a file with a parent id needs a `parent`).
pub async fn push_layer(
    store: &Store,
    file: &Path,
    name: &LayerRef,
    parent: Option<&LayerRef>,
) -> Result<PushedLayer> {
    let layer = SealedLayer::open(Arc::new(FileSource::open(file)?))?;
    match parent {
        Some(p) => {
            let below = stored_layer_id(store, p).await?;
            if below != layer.parent_id() {
                return Err(Error::ParentMismatch {
                    what: format!("layer {}", file.display()),
                    expected: layer.parent_id().to_string(),
                    found: format!("{below} ({p})"),
                });
            }
        }
        None if !layer.parent_id().is_none() => {
            return Err(Error::BadLayer {
                layer: name.to_string(),
                reason: format!(
                    "the file sits on layer {}, but no parent layer was named",
                    layer.parent_id()
                ),
            });
        }
        None => {}
    }
    let put = store.put_blob_file(file).await?;
    let blob = put.blob_ref();
    let mut manifest = Manifest::new(
        name.clone(),
        None,
        vec![blob.clone()],
        format!("{SOURCE_PREFIX}{}", layer.id().to_hex()),
    );
    manifest.parents = parent.into_iter().cloned().collect();
    let pushed = store.push_manifest(&manifest).await?;
    Ok(PushedLayer {
        id: layer.id(),
        manifest,
        pushed,
        blob,
    })
}

/// The blob of a block layer's manifest.
fn block_blob(m: &Manifest) -> Result<&BlobRef> {
    let bad = |reason: &str| Error::BadLayer {
        layer: m.layer.to_string(),
        reason: reason.to_owned(),
    };
    if m.meta.is_some() || m.blobs.len() != 1 {
        return Err(bad(
            "not a block layer: it has a meta image or not exactly one blob",
        ));
    }
    if m.parents.len() > 1 {
        return Err(bad("a block layer has at most one parent"));
    }
    Ok(&m.blobs[0])
}

/// The layer id in a stored block layer's trailer (its last 128 bytes, read from the backend;
/// a consistency check only: opening the stack later verifies every byte it reads).
async fn stored_layer_id(store: &Store, layer: &LayerRef) -> Result<LayerId> {
    let m = store.manifest(layer).await?;
    let blob = block_blob(&m)?;
    let bad = |reason: &str| Error::BadLayer {
        layer: layer.to_string(),
        reason: reason.to_owned(),
    };
    let trailer = TRAILER_SIZE as u64;
    if blob.size < trailer {
        return Err(bad("its blob is shorter than a layer trailer"));
    }
    let key = fs_cache::store::blob_key(&blob.digest);
    let tail = store
        .backend()
        .get_range(&key, blob.size - trailer..blob.size)
        .await?;
    let t = RawTrailer::read_from_bytes(&tail[..])
        .map_err(|_| bad("its blob's trailer could not be read"))?;
    if t.magic != LAYER_MAGIC {
        return Err(bad("its blob is not a strata block layer"));
    }
    Ok(LayerId(t.layer_id))
}

/// The stack under (and including) `top`, base first, each layer read lazily through `cache`.
pub async fn resolve_stack(
    store: &Store,
    cache: &ChunkCache,
    top: &LayerRef,
) -> Result<Vec<Arc<dyn LayerSource>>> {
    let mut chain: Vec<Arc<dyn LayerSource>> = Vec::new();
    let mut next = Some(top.clone());
    while let Some(layer) = next.take() {
        if chain.len() >= MAX_STACK_DEPTH {
            return Err(Error::BadLayer {
                layer: top.to_string(),
                reason: format!("its parent chain is deeper than {MAX_STACK_DEPTH} layers"),
            });
        }
        let m = store.manifest(&layer).await?;
        let blob = block_blob(&m)?;
        chain.push(Arc::new(
            BlobSource::open(cache.clone(), blob.digest).await?,
        ));
        next = m.parents.first().cloned();
    }
    chain.reverse();
    Ok(chain)
}
