//! `strata layer build --order-from REF`: lay a new layer out in the order REF's recorded
//! access trace (`fs_cache::trace`) first read its files, so that what a sandbox's first
//! command reads together is stored together and fetched in few chunks.
//!
//! The trace names byte ranges of REF's blobs; REF's meta image says which file's data each
//! 4 KiB block holds (`Image::data_map`). A file's place is the position of the first trace
//! entry that touches any of its blocks; files the trace never touched keep the builder's
//! usual order after the traced ones. Paths are what a new version of the tree is expected
//! to keep: a file renamed since REF simply loses its early place.

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use erofs_builder::{FileType, Image, Location};
use fs_cache::layer::LayerRef;
use fs_cache::trace::TRACE_BLOCK;
use fs_cache::Store;

/// The regular files of `layer` its trace read, in first-read order (paths relative to the
/// root).
pub async fn trace_order(store: &Store, layer: &LayerRef) -> Result<Vec<PathBuf>> {
    let m = store
        .manifest(layer)
        .await
        .with_context(|| format!("--order-from {layer}"))?;
    let meta = m
        .meta
        .as_ref()
        .with_context(|| format!("--order-from {layer}: not a lazy EROFS layer"))?;
    let name = layer.to_string();
    let Some(trace) = store.trace(&meta.digest, &name).await? else {
        bail!(
            "--order-from {layer}: the layer has no access trace yet (a node records one the \
             first time it mounts the layer, for `strata daemon --trace-window` seconds)"
        );
    };
    let blobs: Vec<_> = m.blobs.iter().map(|b| b.digest).collect();
    if trace.blobs != blobs {
        bail!("--order-from {layer}: its trace names other blobs than its manifest");
    }
    let bytes = store
        .get_blob(&meta.digest)
        .await
        .with_context(|| format!("--order-from {layer}: fetch its meta image"))?;
    let img = Image::from_bytes(bytes.to_vec())
        .with_context(|| format!("--order-from {layer}: read its meta image"))?;
    Ok(order_files(&img, &trace))
}

/// The files of `img` in the order `trace` first touched their blocks.
fn order_files(img: &Image, trace: &fs_cache::trace::Trace) -> Vec<PathBuf> {
    // (device, block) → the position of the first entry touching it.
    let mut first: HashMap<(u16, u64), usize> = HashMap::new();
    for (pos, e) in trace.entries.iter().enumerate() {
        let r = e.bytes();
        for b in r.start / TRACE_BLOCK..r.end / TRACE_BLOCK {
            first.entry((e.blob + 1, b)).or_insert(pos);
        }
    }
    let mut placed: Vec<(usize, PathBuf)> = Vec::new();
    let Ok(root) = img.root() else {
        return Vec::new();
    };
    // Directories seen (a damaged image could list one inside itself).
    let mut dirs = std::collections::HashSet::from([root.nid]);
    let mut queue = std::collections::VecDeque::from([(root, PathBuf::new())]);
    while let Some((dir, rel)) = queue.pop_front() {
        let Ok(entries) = img.read_dir(&dir) else {
            continue;
        };
        for d in entries {
            if d.name == b"." || d.name == b".." {
                continue;
            }
            let Ok(ino) = img.inode(d.nid) else {
                continue;
            };
            let path = rel.join(std::ffi::OsStr::from_bytes(&d.name));
            match ino.file_type {
                FileType::Directory if dirs.insert(ino.nid) => queue.push_back((ino, path)),
                FileType::Regular => {
                    let Ok(map) = img.data_map(&ino) else {
                        continue;
                    };
                    let at = map
                        .iter()
                        .filter_map(|e| match e.location {
                            Location::Device { device, offset } => Some((device, offset, e.len)),
                            _ => None,
                        })
                        .flat_map(|(dev, off, len)| {
                            (off / TRACE_BLOCK..(off + len).div_ceil(TRACE_BLOCK))
                                .map(move |b| (dev, b))
                        })
                        .filter_map(|k| first.get(&k).copied())
                        .min();
                    if let Some(at) = at {
                        placed.push((at, path));
                    }
                }
                _ => {}
            }
        }
    }
    // Stable: files first touched by one entry keep the tree's order.
    placed.sort_by_key(|(at, _)| *at);
    placed.into_iter().map(|(_, p)| p).collect()
}
