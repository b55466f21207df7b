//! File bounds: where files' data runs end inside a blob.
//!
//! A blob is a concatenation of files' data (and, with dedup, of runs other layers share).
//! The cache itself sees only blob offsets, so a sequential reader's readahead used to run on
//! past the end of the file being read, into whatever the builder laid out next: on the
//! minbase root's largest file read from level 2, 8.3 MB (17% of the file) were read ahead
//! past its end and never used (`bench/README.md`, "peers").
//!
//! The node learns each mounted layer's run ends from its meta image
//! (`erofs_builder::reader::device_run_ends`) and hands them to the cache
//! ([`super::ChunkCache::add_file_bounds`]). A stream that is still inside the run it began in
//! (it is reading one file) then reads ahead at most to that run's end; one that began where
//! a file starts reads ahead from its first read on, since it can no longer overshoot; a
//! stream that has crossed a run end (a reader of consecutive files in layout order) reads
//! ahead as before.
//!
//! Invariants: each blob's ends are kept per layer (a layer learnt again replaces its own;
//! a layer taken down takes its own away, and no other's) and looked up as their union,
//! sorted and distinct. Ends change how far and how early readahead goes, never what a read
//! returns: a missing end means readahead as without bounds; an extra one (several layers
//! sharing a blob each add theirs) stops a stream's readahead there, and lets a stream that
//! starts right after it read ahead early, at most to the next end.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::store::Digest;

/// The most ends kept per blob (8 bytes each): beyond it, new ends are dropped.
const MAX_ENDS_PER_BLOB: usize = 4 << 20;

/// See the module docs.
#[derive(Default)]
pub(super) struct Bounds {
    ends: Mutex<HashMap<Digest, BlobBounds>>,
}

/// One blob's ends: each layer's own (sorted), and their union, which reads look up.
#[derive(Clone)]
struct BlobBounds {
    layers: Vec<(String, Arc<[u64]>)>,
    merged: Arc<[u64]>,
}

impl Bounds {
    /// Change `blob`'s per-layer ends with `f`, then rebuild their union. The union is built
    /// outside the lock every read takes (a large layer's ends take milliseconds to sort), and
    /// the change starts over if another one replaced the blob's ends meanwhile.
    fn update(&self, blob: Digest, f: impl Fn(&mut Vec<(String, Arc<[u64]>)>)) {
        loop {
            let old = super::cache::lock(&self.ends).get(&blob).cloned();
            let mut layers = old.as_ref().map(|o| o.layers.clone()).unwrap_or_default();
            f(&mut layers);
            let mut all: Vec<u64> = layers.iter().flat_map(|(_, e)| e.iter().copied()).collect();
            all.sort_unstable();
            all.dedup();
            all.truncate(MAX_ENDS_PER_BLOB);
            let mut map = super::cache::lock(&self.ends);
            let unchanged = match (&old, map.get(&blob)) {
                (Some(a), Some(b)) => Arc::ptr_eq(&a.merged, &b.merged),
                (None, None) => true,
                _ => false,
            };
            if unchanged {
                if layers.is_empty() {
                    map.remove(&blob);
                } else {
                    let merged = all.into();
                    map.insert(blob, BlobBounds { layers, merged });
                }
                return;
            }
        }
    }

    /// Set layer `layer`'s ends (any order) in `blob`, in place of any it had.
    pub(super) fn add(&self, blob: Digest, layer: &str, ends: &[u64]) {
        let mut own = ends.to_vec();
        own.sort_unstable();
        own.dedup();
        own.truncate(MAX_ENDS_PER_BLOB);
        let own: Arc<[u64]> = own.into();
        self.update(blob, |layers| {
            layers.retain(|(l, _)| l != layer);
            layers.push((layer.to_owned(), own.clone()));
        });
    }

    /// Forget layer `layer`'s ends in `blob`; other layers' stay.
    pub(super) fn forget(&self, blob: &Digest, layer: &str) {
        if super::cache::lock(&self.ends).contains_key(blob) {
            self.update(*blob, |layers| layers.retain(|(l, _)| l != layer));
        }
    }

    /// For a read of `blob` that ends at `at`: the run it is in, as (the end before it, 0 if
    /// none; its own end, the first end at or after `at`). `None` when no end is known at or
    /// after `at`.
    pub(super) fn around(&self, blob: &Digest, at: u64) -> Option<(u64, u64)> {
        let ends = super::cache::lock(&self.ends).get(blob)?.merged.clone();
        let k = ends.partition_point(|&e| e < at);
        let end = *ends.get(k)?;
        let before = k.checked_sub(1).map_or(0, |j| ends[j]);
        Some((before, end))
    }

    /// Blobs with ends, and ends in all (each blob's union).
    pub(super) fn counts(&self) -> (usize, usize) {
        let map = super::cache::lock(&self.ends);
        (map.len(), map.values().map(|e| e.merged.len()).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_finds_the_run_it_is_in() {
        let b = Bounds::default();
        let blob = Digest([7; 32]);
        assert_eq!(b.around(&blob, 10), None);
        b.add(blob, "l1", &[300, 100, 200]);
        assert_eq!(b.around(&blob, 1), Some((0, 100)));
        assert_eq!(
            b.around(&blob, 100),
            Some((0, 100)),
            "a read ending at a run's end"
        );
        assert_eq!(b.around(&blob, 101), Some((100, 200)));
        assert_eq!(b.around(&blob, 300), Some((200, 300)));
        assert_eq!(b.around(&blob, 301), None, "past every known end");
        // Another layer's ends for the same blob join them, each once.
        b.add(blob, "l2", &[150, 200]);
        assert_eq!(b.around(&blob, 120), Some((100, 150)));
        assert_eq!(b.around(&blob, 160), Some((150, 200)));
        assert_eq!(b.counts(), (1, 4));
        assert_eq!(b.around(&Digest([8; 32]), 1), None, "another blob");
        // The first layer goes: exactly the second's ends stay.
        b.forget(&blob, "l1");
        assert_eq!(b.around(&blob, 1), Some((0, 150)));
        assert_eq!(b.around(&blob, 160), Some((150, 200)));
        assert_eq!(b.around(&blob, 201), None);
        assert_eq!(b.counts(), (1, 2));
        // A layer learnt again replaces its ends.
        b.add(blob, "l2", &[50]);
        assert_eq!(b.around(&blob, 60), None);
        assert_eq!(b.counts(), (1, 1));
        // Forgetting a layer the blob does not have changes nothing; the last one's goes.
        b.forget(&blob, "l9");
        assert_eq!(b.counts(), (1, 1));
        b.forget(&blob, "l2");
        assert_eq!(b.around(&blob, 1), None);
        assert_eq!(b.counts(), (0, 0));
    }
}
