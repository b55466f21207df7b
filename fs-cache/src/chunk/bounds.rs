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
//! Invariants: each blob's ends are sorted and distinct. Ends change how far and how early
//! readahead goes, never what a read returns: a missing end means readahead as without
//! bounds; an extra one (several layers sharing a blob each add theirs) stops a stream's
//! readahead there, and lets a stream that starts right after it read ahead early, at most
//! to the next end.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::store::Digest;

/// The most ends kept per blob (8 bytes each): beyond it, new ends are dropped.
const MAX_ENDS_PER_BLOB: usize = 4 << 20;

/// See the module docs.
#[derive(Default)]
pub(super) struct Bounds {
    ends: Mutex<HashMap<Digest, Arc<[u64]>>>,
}

impl Bounds {
    /// Add `ends` (any order) to `blob`'s. The merge runs outside the lock every read takes
    /// (a large layer's ends take milliseconds to sort), and starts over if another add
    /// replaced the blob's ends meanwhile.
    pub(super) fn add(&self, blob: Digest, ends: &[u64]) {
        loop {
            let old = super::cache::lock(&self.ends).get(&blob).cloned();
            let mut all: Vec<u64> = old.as_deref().map(<[u64]>::to_vec).unwrap_or_default();
            all.extend_from_slice(ends);
            all.sort_unstable();
            all.dedup();
            all.truncate(MAX_ENDS_PER_BLOB);
            let mut map = super::cache::lock(&self.ends);
            let now = map.get(&blob);
            let unchanged = match (&old, now) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            if unchanged {
                map.insert(blob, all.into());
                return;
            }
        }
    }

    /// Forget `blob`'s ends.
    pub(super) fn forget(&self, blob: &Digest) {
        super::cache::lock(&self.ends).remove(blob);
    }

    /// For a read of `blob` that ends at `at`: the run it is in, as (the end before it, 0 if
    /// none; its own end, the first end at or after `at`). `None` when no end is known at or
    /// after `at`.
    pub(super) fn around(&self, blob: &Digest, at: u64) -> Option<(u64, u64)> {
        let ends = super::cache::lock(&self.ends).get(blob)?.clone();
        let k = ends.partition_point(|&e| e < at);
        let end = *ends.get(k)?;
        let before = k.checked_sub(1).map_or(0, |j| ends[j]);
        Some((before, end))
    }

    /// Blobs with ends, and ends in all.
    pub(super) fn counts(&self) -> (usize, usize) {
        let map = super::cache::lock(&self.ends);
        (map.len(), map.values().map(|e| e.len()).sum())
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
        b.add(blob, &[300, 100, 200]);
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
        b.add(blob, &[150, 200]);
        assert_eq!(b.around(&blob, 120), Some((100, 150)));
        assert_eq!(b.around(&blob, 160), Some((150, 200)));
        assert_eq!(b.counts(), (1, 4));
        assert_eq!(b.around(&Digest([8; 32]), 1), None, "another blob");
        b.forget(&blob);
        assert_eq!(b.around(&blob, 1), None);
        assert_eq!(b.counts(), (0, 0));
    }
}
