//! Cross-layer chunk dedup for `strata layer build`: the chunk dictionary a new layer is
//! built against, from what the store already holds.
//!
//! Which blobs, in this order, until the dictionary is full (at most
//! [`erofs_builder::layer::MAX_DICT_DEVICES`] blobs, one fewer for a layer with a tails
//! blob, and [`erofs_builder::layer::MAX_DICT_CHUNKS`] chunks): the data blobs of the layers given with `--dedup-from` (in the order given), then
//! of the other versions of the same `KIND/NAME` (its lineage, newest first), then of the
//! other layers of the same kind (newest first). Each blob's chunk digests come from its
//! chunk table (`blobs/xx/<digest>.chunks`), which the store wrote with it, at that table's
//! chunk size: a layer's main blob (256 KiB) and its tails blob (16 KiB by default) are both
//! in the dictionary, and a chunk matches only a chunk of its own size.
//!
//! Invariants: a layer built against a dictionary lists, after its own blobs (device 1, and
//! the tails blob on device 2), exactly the
//! dictionary blobs its meta image points into, in device-table order, so the node mounts it
//! with `device=` in that order and gc keeps those blobs while the layer exists (gc marks
//! every blob of every manifest). A blob that disappears between the dictionary and the push
//! fails the push (`push_manifest` checks every blob present): never a dangling layer.

use anyhow::{Context, Result};
use fs_cache::layer::{BlobRef, LayerRef, Manifest};
use fs_cache::Store;

/// The dictionary and, per dictionary blob (its index), the blob's reference in its layer's
/// manifest (what the new manifest lists).
pub struct Dictionary {
    pub dict: std::sync::Arc<erofs_builder::ChunkDictionary>,
    pub blobs: Vec<BlobRef>,
}

/// The dictionary for building `layer`, `from` first; `tails`: the layer gets a tails blob
/// (device 2), which leaves one device fewer for the dictionary.
pub async fn dictionary(
    store: &Store,
    layer: &LayerRef,
    from: &[LayerRef],
    tails: bool,
) -> Result<Dictionary> {
    let max_blobs = if tails {
        erofs_builder::layer::MAX_DICT_DEVICES_WITH_TAILS
    } else {
        erofs_builder::layer::MAX_DICT_DEVICES
    };
    let mut candidates: Vec<Manifest> = Vec::new();
    for l in from {
        candidates.push(
            store
                .manifest(l)
                .await
                .with_context(|| format!("--dedup-from {l}"))?,
        );
    }
    let mut all = store
        .list_manifests()
        .await
        .context("list the store's layers for dedup")?;
    all.retain(|m| m.layer.kind == layer.kind && m.layer != *layer && !from.contains(&m.layer));
    // Newest first; the lineage (same name) before the rest of the kind.
    all.sort_by(|a, b| b.created.cmp(&a.created));
    let (lineage, kind): (Vec<_>, Vec<_>) =
        all.into_iter().partition(|m| m.layer.name == layer.name);
    candidates.extend(lineage);
    candidates.extend(kind);
    let mut dict = erofs_builder::ChunkDictionary::new();
    let mut blobs: Vec<BlobRef> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    'layers: for m in &candidates {
        for b in &m.blobs {
            if blobs.len() >= max_blobs || dict.chunks() >= erofs_builder::layer::MAX_DICT_CHUNKS {
                break 'layers;
            }
            if !seen.insert(b.digest) {
                continue;
            }
            let table = match store.chunk_table(&b.digest).await {
                Ok(t) => t,
                Err(e) => {
                    // Dedup is an optimisation: a blob whose table cannot be read is left out.
                    tracing::warn!("dedup: the chunk table of {} ({}): {e}", b.digest, m.layer);
                    continue;
                }
            };
            let digests: Vec<[u8; 32]> = table.digests.iter().map(|x| x.0).collect();
            if dict
                .add_blob(
                    b.digest.to_hex().as_bytes(),
                    b.size,
                    table.chunk_size,
                    &digests,
                )
                .is_some()
            {
                blobs.push(b.clone());
            }
        }
    }
    Ok(Dictionary {
        dict: std::sync::Arc::new(dict),
        blobs,
    })
}
