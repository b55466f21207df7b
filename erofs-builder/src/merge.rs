//! A stack of layer tars merged into one tree ([`crate::Source::TarStack`]): what an
//! overlayfs mount of the layers would show, built before layout, so that a whole image
//! becomes one layer (`strata image import --flatten`) or one full image (`strata layer
//! export --erofs`).
//!
//! Each tar is read by [`crate::tar`] into its own arena tree (OCI whiteouts already turned
//! into character devices 0:0 and opaque flags, hostile entries refused), all of them spooling
//! file data into one spool. Layer `k` is then applied to the merge of layers `0..k`,
//! directory by directory, as overlayfs stacks an upper over a lower:
//!
//! * a whiteout (character device 0:0) removes the name beneath, whatever it was;
//! * an opaque directory hides everything beneath it: the merged directory keeps only the
//!   upper's children;
//! * a directory over a directory merges the two: the upper's attributes and xattrs win,
//!   unless the upper directory is only *implied* by a path (no entry of its own), in which
//!   case the lower's attributes stay;
//! * anything else replaces the name beneath, subtree and all (a directory over a file, a
//!   file over a directory).
//!
//! Hard links stay hard links (both names point at one arena inode); a name removed by a
//! higher layer leaves the other names. When every layer is applied, whiteouts that are left
//! (they had nothing beneath them) are dropped and opaque flags cleared: the result has no
//! layer below it, so it contains no overlay markers.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;

use crate::source::ProgressGuard;
use crate::tar::{flatten, read_tree, TInode, TKind};
use crate::writer::Node;
use crate::{io_err, BuildOptions, Error, Result};

/// Reads `inputs` (lowest layer first) and returns the merged tree's writer nodes.
pub(crate) fn read_tar_stack(
    inputs: Vec<Box<dyn Read + Send>>,
    spool: &File,
    opts: &BuildOptions,
    progress: &ProgressGuard<'_>,
) -> Result<Vec<Node>> {
    let mut merged: Vec<TInode> = Vec::new();
    let mut end = 0u64;
    for input in inputs {
        let (layer, e) = read_tree(input, spool, end, opts, progress)?;
        end = e;
        if merged.is_empty() {
            merged = layer;
        } else {
            apply(&mut merged, layer)?;
        }
    }
    if merged.is_empty() {
        return Err(Error::UnsupportedInput {
            path: "tar stack".into(),
            reason: "no layer given".into(),
        });
    }
    strip_markers(&mut merged);
    spool.set_len(end).map_err(io_err("size the tar spool"))?;
    Ok(flatten(merged))
}

fn children(inodes: &mut [TInode], i: usize) -> Result<&mut BTreeMap<Vec<u8>, usize>> {
    match &mut inodes[i].kind {
        TKind::Dir(c) => Ok(c),
        _ => Err(Error::Corrupt("merge: children of a non-directory".into())),
    }
}

/// Applies `layer` (an arena, root at 0) over `merged` (an arena, root at 0).
fn apply(merged: &mut Vec<TInode>, layer: Vec<TInode>) -> Result<()> {
    let base = merged.len();
    for mut t in layer {
        if let TKind::Dir(c) = &mut t.kind {
            for v in c.values_mut() {
                *v += base;
            }
        }
        merged.push(t);
    }
    // (directory in the merge, the upper's directory over it)
    let mut work = vec![(0usize, base)];
    while let Some((lower, upper)) = work.pop() {
        if !merged[upper].implied {
            let (lo, up) = merged.split_at_mut(upper);
            lo[lower].take_attributes(&mut up[0]);
        }
        let upper_children = std::mem::take(children(merged, upper)?);
        if merged[upper].opaque {
            children(merged, lower)?.clear();
        }
        for (name, u) in upper_children {
            if merged[u].is_whiteout() {
                children(merged, lower)?.remove(&name);
                continue;
            }
            let below = children(merged, lower)?.get(&name).copied();
            let both_dirs = below.is_some_and(|b| {
                matches!(merged[b].kind, TKind::Dir(_)) && matches!(merged[u].kind, TKind::Dir(_))
            });
            match below {
                Some(b) if both_dirs => work.push((b, u)),
                _ => {
                    children(merged, lower)?.insert(name, u);
                }
            }
        }
    }
    Ok(())
}

/// Drops whiteouts left in the tree and clears every opaque flag.
fn strip_markers(inodes: &mut [TInode]) {
    let mut work = vec![0usize];
    let mut seen = vec![false; inodes.len()];
    while let Some(d) = work.pop() {
        if std::mem::replace(&mut seen[d], true) {
            continue;
        }
        inodes[d].opaque = false;
        let TKind::Dir(c) = std::mem::replace(&mut inodes[d].kind, TKind::Reg) else {
            continue;
        };
        let kept: BTreeMap<Vec<u8>, usize> = c
            .into_iter()
            .filter(|(_, i)| !inodes[*i].is_whiteout())
            .collect();
        work.extend(
            kept.values()
                .copied()
                .filter(|&i| matches!(inodes[i].kind, TKind::Dir(_))),
        );
        inodes[d].kind = TKind::Dir(kept);
    }
}
