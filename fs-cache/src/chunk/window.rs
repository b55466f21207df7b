//! The fetch unit: how far a demand miss widens its backend request.
//!
//! A blob's chunk is its unit of verification and caching; on a store where a request costs
//! far more than its bytes (S3: tens of milliseconds to the first byte), fetching one small
//! chunk per miss turns a reader of many small files into one round trip per file. With a
//! fetch unit `U` larger than the blob's chunk size, a demand miss of chunk `i` also fetches
//! the other chunks of its `U`-aligned window (chunks `⌊i·c/U⌋·U/c ..` up to `U/c` of them,
//! `c` the chunk size) that no cache level holds, in the same request: the bytes and round
//! trips of a `U`-chunked blob, while each chunk is still verified, cached, evicted and
//! deduplicated on its own. A window never widens past the blob's last chunk, and a unit no
//! larger than the chunk size (0 included) widens nothing.
//!
//! **Widening only while it pays** ([`Yields`]). The chunks a window brings besides the
//! demanded ones (its *riders*) save a request each when read later and cost their bytes when
//! not. A reader of a directory's small files in build order reads most of them; a reader of
//! one file in ten (a sandbox's first command in a tree of many small files) reads one or two
//! in sixteen, and over S3 fetched 2.7× the bytes it read with every window widened. So each
//! blob keeps its *yield*: of the riders its demand misses' windows offered (the chunks no
//! level held), how many were then read. A miss widens while the yield is at least
//! `CacheConfig::fetch_unit_min_yield_pct` (by default [`DEFAULT_MIN_YIELD_PCT`]: widening
//! fetches at most twice the riders it uses; 0 widens always) or while too few riders were
//! offered to tell ([`MIN_EVIDENCE`]); otherwise it fetches only its own chunks. Windows that were not widened are still offered and tracked (*shadow*
//! windows: a later read of one of their chunks, then a miss, counts as used), so the yield
//! is measured in both modes and a reader whose pattern changes turns widening back on. The
//! counts halve every [`HALF_LIFE`] riders offered (recent behaviour weighs most); each blob
//! tracks its [`RECENT_WINDOWS`] latest windows, and at most [`MAX_BLOBS`] blobs are tracked
//! (beyond that, the tracker starts over).
//!
//! Invariants: a window is offered once while it is recent (a second miss in it does not
//! offer its riders again); a rider counts as used at most once; what is fetched for a
//! reader is never changed by the tracker, only what rides along.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Mutex;

use crate::store::Digest;

/// The most chunks one window spans (4 MiB of 4 KiB chunks; callers also bound the unit by
/// the largest request).
pub(super) const MAX_WINDOW_CHUNKS: u64 = 1024;

/// The chunks of one `unit`-aligned window of a blob of `count` chunks of `chunk_size`: at
/// most the blob's chunks, and [`MAX_WINDOW_CHUNKS`], whatever the unit; at least 1.
pub(super) fn window_chunks(chunk_size: u64, count: u64, unit: u64) -> u64 {
    if chunk_size == 0 {
        return 1;
    }
    (unit / chunk_size).clamp(1, count.clamp(1, MAX_WINDOW_CHUNKS))
}

/// The yield (riders used / offered, in percent) below which a miss stops widening, unless
/// configured otherwise.
pub const DEFAULT_MIN_YIELD_PCT: u8 = 50;
/// Riders a blob's windows offer before its yield decides (until then a miss widens).
pub(super) const MIN_EVIDENCE: u64 = 32;
/// The offered count at which a blob's two counts halve.
pub(super) const HALF_LIFE: u64 = 512;
/// Windows tracked per blob.
pub(super) const RECENT_WINDOWS: usize = 64;
/// Blobs tracked at once.
pub(super) const MAX_BLOBS: usize = 4096;

/// Per blob, whether widening a demand miss has paid lately (the module docs).
#[derive(Default)]
pub(super) struct Yields {
    blobs: Mutex<HashMap<Digest, BlobYield>>,
}

/// One tracked window: its first chunk and, one bit per chunk of the window, its riders not
/// read yet (at most [`MAX_WINDOW_CHUNKS`] bits: 128 bytes).
struct Window {
    start: u64,
    pending: Vec<u64>,
}

impl Window {
    /// Clear chunk `j`'s bit; whether it was set.
    fn take(&mut self, j: u64) -> bool {
        let k = j.wrapping_sub(self.start);
        let (word, bit) = ((k / 64) as usize, k % 64);
        match self.pending.get_mut(word) {
            Some(w) if *w & (1 << bit) != 0 => {
                *w &= !(1 << bit);
                true
            }
            _ => false,
        }
    }
}

#[derive(Default)]
struct BlobYield {
    offered: u64,
    used: u64,
    /// Chunks per window (the same for every miss of a blob under one configuration).
    per: u64,
    /// Windows offered lately, oldest first.
    recent: VecDeque<Window>,
}

impl BlobYield {
    fn widens(&self, min_pct: u8) -> bool {
        self.offered < MIN_EVIDENCE || self.used * 100 >= self.offered * u64::from(min_pct)
    }

    /// Chunks `chunks` are being read: each one still pending in a recent window counts as
    /// used (once). Only the windows the chunks fall in are looked at.
    fn read(&mut self, chunks: Range<u64>) {
        if self.per == 0 || self.recent.is_empty() {
            return;
        }
        let mut n = 0;
        let mut at = chunks.start;
        while at < chunks.end {
            let start = at - at % self.per;
            let end = start.saturating_add(self.per).min(chunks.end);
            if let Some(w) = self.recent.iter_mut().find(|w| w.start == start) {
                n += (at..end).filter(|&j| w.take(j)).count() as u64;
            }
            at = end;
        }
        // `used` never exceeds `offered`, halvings included (riders offered before a halving
        // are still pending at full weight).
        self.used = (self.used + n).min(self.offered);
    }
}

/// A blob's yield as counted now (riders offered and used, after halvings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Yield {
    pub offered: u64,
    /// Never more than `offered`.
    pub used: u64,
}

impl Yields {
    /// Chunks `chunks` of `blob` are being read: each one still waiting as a rider of a
    /// recent window counts as used (once).
    pub(super) fn touched(&self, blob: &Digest, chunks: Range<u64>) {
        let mut m = self.blobs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(y) = m.get_mut(blob) {
            y.read(chunks);
        }
    }

    /// A demand miss of `missing` (sorted) in `blob`, whose windows (`per` chunks each) would
    /// bring `riders` (sorted: chunks no level holds and none in flight, the missing ones left
    /// out): whether it widens, at a yield of at least `min_pct` percent. Missing chunks still
    /// pending in a recent window count as used (a concurrent reader's miss registered that
    /// window after this reader's [`Self::touched`]); then the riders of windows not recent
    /// already are offered (counted, then tracked), widened or not.
    pub(super) fn miss(
        &self,
        blob: &Digest,
        per: u64,
        missing: &[u64],
        riders: &[u64],
        min_pct: u8,
    ) -> bool {
        let per = per.clamp(1, MAX_WINDOW_CHUNKS);
        let mut m = self.blobs.lock().unwrap_or_else(|p| p.into_inner());
        if !m.contains_key(blob) && m.len() >= MAX_BLOBS {
            m.clear();
        }
        let y = m.entry(*blob).or_default();
        if y.per != per {
            // A new configuration (or the first miss): windows of another size do not compare.
            y.per = per;
            y.recent.clear();
        }
        for &i in missing {
            y.read(i..i.saturating_add(1));
        }
        let widens = y.widens(min_pct);
        let mut at = 0;
        while at < riders.len() {
            let start = riders[at] - riders[at] % per;
            let n = riders[at..]
                .iter()
                .take_while(|&&j| j - j % per == start)
                .count();
            if !y.recent.iter().any(|w| w.start == start) {
                let mut w = Window {
                    start,
                    pending: vec![0; per.div_ceil(64) as usize],
                };
                for &j in &riders[at..at + n] {
                    let k = j - start;
                    w.pending[(k / 64) as usize] |= 1 << (k % 64);
                }
                y.offered += n as u64;
                if y.recent.len() >= RECENT_WINDOWS {
                    y.recent.pop_front();
                }
                y.recent.push_back(w);
            }
            at += n;
        }
        if y.offered >= HALF_LIFE {
            y.offered /= 2;
            y.used /= 2;
        }
        widens
    }

    /// `blob`'s counts now.
    pub(super) fn get(&self, blob: &Digest) -> Yield {
        let m = self.blobs.lock().unwrap_or_else(|p| p.into_inner());
        m.get(blob).map_or_else(Yield::default, |y| Yield {
            offered: y.offered,
            used: y.used,
        })
    }
}

/// `missing` (sorted chunk indexes) with, for each, the other chunks of its `unit`-aligned
/// window among `0..count` for which `cached` is false; sorted, each index once.
pub(super) fn widen(
    missing: &[u64],
    chunk_size: u64,
    count: u64,
    unit: u64,
    cached: impl Fn(u64) -> bool,
) -> Vec<u64> {
    if unit <= chunk_size || chunk_size == 0 || missing.is_empty() {
        return missing.to_vec();
    }
    let per = window_chunks(chunk_size, count, unit);
    let mut out: Vec<u64> = Vec::new();
    let mut done: Option<Range<u64>> = None;
    for &i in missing {
        let start = i - i % per;
        let window = start..start.saturating_add(per).min(count);
        if done.as_ref().is_some_and(|d| d.start == window.start) {
            continue;
        }
        for j in window.clone() {
            if j == i || missing.binary_search(&j).is_ok() || !cached(j) {
                out.push(j);
            }
        }
        done = Some(window);
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// `chunks` (sorted, each once) with the chunks of the gaps between them filled, smallest gaps
/// first, as long as at most `budget` chunks are added and no gap is longer than `max_gap`
/// chunks: a replayed trace's chunks in fewer requests (adjacent chunks are one request), for
/// at most `budget` chunks it did not list. (A gap longer than a request's window saves no
/// request; callers pass the fetch unit's window less one.)
pub(super) fn fill_gaps(chunks: &[u64], budget: u64, max_gap: u64) -> Vec<u64> {
    let mut gaps: Vec<(u64, usize)> = chunks
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[1] > w[0] + 1 && w[1] - w[0] - 1 <= max_gap)
        .map(|(k, w)| (w[1] - w[0] - 1, k))
        .collect();
    gaps.sort_unstable();
    let mut left = budget;
    let mut fill = vec![false; chunks.len()];
    for (len, k) in gaps {
        if len > left {
            break;
        }
        left -= len;
        fill[k] = true;
    }
    let mut out = Vec::with_capacity(chunks.len());
    for (k, &c) in chunks.iter().enumerate() {
        out.push(c);
        if fill[k] {
            out.extend(c + 1..chunks[k + 1]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{fill_gaps, widen, Yields, HALF_LIFE, MIN_EVIDENCE, RECENT_WINDOWS};
    use crate::store::Digest;

    const K: u64 = 1024;

    #[test]
    fn a_unit_no_larger_than_the_chunk_widens_nothing() {
        for unit in [0, 64 * K, 32 * K] {
            assert_eq!(widen(&[3, 9], 64 * K, 100, unit, |_| false), vec![3, 9]);
        }
    }

    #[test]
    fn a_miss_brings_its_aligned_window_less_what_is_cached() {
        // 64 KiB chunks, a 256 KiB unit: windows of four chunks.
        assert_eq!(
            widen(&[5], 64 * K, 100, 256 * K, |_| false),
            vec![4, 5, 6, 7]
        );
        assert_eq!(widen(&[5], 64 * K, 100, 256 * K, |j| j == 6), vec![4, 5, 7]);
        // Two misses in one window, one in the next; the blob ends at chunk 9.
        assert_eq!(
            widen(&[4, 6, 9], 64 * K, 10, 256 * K, |j| j == 5),
            vec![4, 6, 7, 8, 9]
        );
        // A missing chunk is kept even if `cached` (a race) says otherwise.
        assert_eq!(widen(&[1], 16 * K, 4, 256 * K, |_| true), vec![1]);
    }

    #[test]
    fn a_huge_unit_is_bounded_by_the_blob() {
        assert_eq!(
            widen(&[2], 64 * K, 4, u64::MAX, |_| false),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            widen(&[u64::MAX - 1], 4 * K, u64::MAX, u64::MAX, |_| true).len(),
            1
        );
    }

    #[test]
    fn a_unit_that_is_not_a_multiple_rounds_down() {
        // 64 KiB chunks, a 200 KiB unit: windows of three chunks.
        assert_eq!(widen(&[4], 64 * K, 100, 200 * K, |_| false), vec![3, 4, 5]);
    }

    #[test]
    fn gaps_fill_smallest_first_within_the_budget() {
        assert_eq!(fill_gaps(&[], 10, 100), Vec::<u64>::new());
        assert_eq!(fill_gaps(&[7], 10, 100), vec![7]);
        // Gaps of 1 (after 2), 3 (after 4) and 2 (after 10).
        let chunks = [1, 2, 4, 8, 11];
        assert_eq!(fill_gaps(&chunks, 0, 100), chunks.to_vec());
        assert_eq!(fill_gaps(&chunks, 1, 100), vec![1, 2, 3, 4, 8, 11]);
        // 1 + 2 = 3 fits a budget of 4; the gap of 3 then does not.
        assert_eq!(fill_gaps(&chunks, 4, 100), vec![1, 2, 3, 4, 8, 9, 10, 11]);
        assert_eq!(fill_gaps(&chunks, 6, 100), (1..=11).collect::<Vec<_>>());
        // No gap longer than two: the gap of three stays, whatever the budget.
        assert_eq!(fill_gaps(&chunks, 100, 2), vec![1, 2, 3, 4, 8, 9, 10, 11]);
    }

    fn blob(n: u8) -> Digest {
        Digest::of(&[n])
    }

    #[test]
    fn a_blob_whose_riders_go_unread_stops_widening_and_starts_again_when_read() {
        let (y, b) = (Yields::default(), blob(1));
        // Windows of 16 chunks, one chunk read in each: 15 riders offered, none read.
        let mut widened = 0;
        for w in 0..8u64 {
            let riders: Vec<u64> = (w * 16 + 1..w * 16 + 16).collect();
            y.touched(&b, w * 16..w * 16 + 1);
            widened += u64::from(y.miss(&b, 16, &[w * 16], &riders, 50));
        }
        // Widening until MIN_EVIDENCE riders were offered (0, 15, 30 before each miss).
        assert_eq!(widened, MIN_EVIDENCE.div_ceil(15));
        assert_eq!((y.get(&b).offered, y.get(&b).used), (120, 0));
        // Another blob is not affected.
        assert!(y.miss(&blob(2), 16, &[0], &[1, 2], 50));
        // A second miss in a recent window is not offered again; its chunk counts as used
        // once, however often it is touched.
        y.touched(&b, 5..6);
        y.touched(&b, 5..6);
        assert!(!y.miss(&b, 16, &[5], &[1, 2, 3, 4, 6], 50));
        assert_eq!((y.get(&b).offered, y.get(&b).used), (120, 1));
        // A reader of whole windows: every rider read, yield rises to one half, widening again.
        let mut w = 8;
        loop {
            let riders: Vec<u64> = (w * 16 + 1..w * 16 + 16).collect();
            y.touched(&b, w * 16..w * 16 + 1);
            if y.miss(&b, 16, &[w * 16], &riders, 50) {
                break;
            }
            y.touched(&b, w * 16 + 1..w * 16 + 16);
            w += 1;
            assert!(w < 30, "never widened again: {:?}", y.get(&b));
        }
        let got = y.get(&b);
        assert!(got.used * 2 >= got.offered - 15, "{got:?}");
    }

    #[test]
    fn a_minimum_yield_of_zero_always_widens() {
        let (y, b) = (Yields::default(), blob(4));
        for w in 0..100u64 {
            assert!(y.miss(&b, 16, &[w * 16], &[w * 16 + 1], 0));
        }
        // And of 100 widens only once every rider offered was read.
        let (y, b) = (Yields::default(), blob(5));
        for w in 0..40u64 {
            y.miss(&b, 4, &[w * 4], &[w * 4 + 1], 100);
        }
        assert!(!y.miss(&b, 4, &[1001], &[1000], 100));
        y.touched(&b, 0..2000);
        assert!(y.miss(&b, 4, &[2001], &[2000], 100));
    }

    #[test]
    fn a_concurrent_readers_miss_counts_its_chunk_as_a_rider_read() {
        let (y, b) = (Yields::default(), blob(6));
        // Readers of chunks 3 and 5 of one window both looked (touched) before either miss
        // was noted: nothing is tracked yet.
        y.touched(&b, 3..4);
        y.touched(&b, 5..6);
        // The miss of 3 offers the window's other 15 chunks, 5 among them.
        let riders: Vec<u64> = (0..16).filter(|&j| j != 3).collect();
        y.miss(&b, 16, &[3], &riders, 50);
        assert_eq!((y.get(&b).offered, y.get(&b).used), (15, 0));
        // The miss of 5 then counts it as read, and offers nothing again.
        let rest: Vec<u64> = (0..16).filter(|&j| j != 3 && j != 5).collect();
        y.miss(&b, 16, &[5], &rest, 50);
        assert_eq!((y.get(&b).offered, y.get(&b).used), (15, 1));
        // Once only.
        y.miss(&b, 16, &[5], &rest, 50);
        y.touched(&b, 5..6);
        assert_eq!(y.get(&b).used, 1);
    }

    #[test]
    fn used_never_exceeds_offered_across_a_halving() {
        let (y, b) = (Yields::default(), blob(7));
        // 40 windows of 16 riders each (640 offered, halved once at 512), none read yet.
        for w in 0..40u64 {
            let riders: Vec<u64> = (w * 17 + 1..w * 17 + 17).collect();
            y.miss(&b, 17, &[w * 17], &riders, 50);
        }
        let before = y.get(&b);
        assert!(before.offered < 512, "{before:?}");
        // Every rider then read: used is capped at offered.
        y.touched(&b, 0..40 * 17);
        let after = y.get(&b);
        assert_eq!(after.used, after.offered, "{after:?}");
    }

    #[test]
    fn counts_halve_and_windows_are_bounded() {
        let (y, b) = (Yields::default(), blob(3));
        for w in 0..(HALF_LIFE / 4 + 1) {
            y.miss(
                &b,
                8,
                &[w * 8],
                &[w * 8 + 1, w * 8 + 2, w * 8 + 3, w * 8 + 4],
                50,
            );
        }
        let got = y.get(&b);
        assert!(got.offered < HALF_LIFE, "{got:?}");
        // Only the RECENT_WINDOWS latest windows are tracked: a rider of the first is not
        // counted when read.
        y.touched(&b, 1..2);
        assert_eq!(y.get(&b).used, 0);
        let last = (HALF_LIFE / 4) * 8 + 1;
        y.touched(&b, last..last + 1);
        assert_eq!(y.get(&b).used, 1);
        let m = y.blobs.lock().unwrap();
        assert_eq!(m[&b].recent.len(), RECENT_WINDOWS);
    }
}
