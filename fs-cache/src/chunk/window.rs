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

use std::ops::Range;

/// The most chunks one window spans (4 MiB of 4 KiB chunks; callers also bound the unit by
/// the largest request).
pub(super) const MAX_WINDOW_CHUNKS: u64 = 1024;

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
    // At most the blob's chunks, and MAX_WINDOW_CHUNKS, per window whatever the unit.
    let per = (unit / chunk_size).clamp(1, count.clamp(1, MAX_WINDOW_CHUNKS));
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

#[cfg(test)]
mod tests {
    use super::widen;

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
}
