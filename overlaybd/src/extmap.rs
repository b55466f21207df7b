//! Maps from device ranges to where their bytes are: the upper's live map (a `BTreeMap`, for
//! inserts) and the merged, frozen index of a stack of sealed layers (a sorted `Vec`, for
//! binary search). Both hold non-overlapping segments; lookups are O(log n).

use std::collections::BTreeMap;

/// Where the bytes of a segment are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// The range reads as zeros (a discard, or a zero extent of a layer).
    Zero,
    /// The bytes are in source `layer` (a layer number; the upper uses 0) at `offset`.
    Data { layer: u32, offset: u64 },
}

impl Target {
    /// The target of the part of a segment `by` bytes into it.
    fn advance(self, by: u64) -> Self {
        match self {
            Target::Zero => Target::Zero,
            Target::Data { layer, offset } => Target::Data {
                layer,
                offset: offset + by,
            },
        }
    }

    /// Whether a segment with target `next` starting `len` bytes after one with this target
    /// continues it (so the two can be one segment).
    fn continues(self, len: u64, next: Target) -> bool {
        match (self, next) {
            (Target::Zero, Target::Zero) => true,
            (
                Target::Data { layer, offset },
                Target::Data {
                    layer: l2,
                    offset: o2,
                },
            ) => layer == l2 && offset.checked_add(len) == Some(o2),
            _ => false,
        }
    }
}

/// One segment: device range `start..start+len` → `target`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seg {
    pub start: u64,
    pub len: u64,
    pub target: Target,
}

impl Seg {
    pub fn end(&self) -> u64 {
        self.start + self.len
    }

    /// The part of this segment inside `lo..hi` (which must overlap it).
    fn clip(&self, lo: u64, hi: u64) -> Seg {
        let s = self.start.max(lo);
        let e = self.end().min(hi);
        Seg {
            start: s,
            len: e - s,
            target: self.target.advance(s - self.start),
        }
    }
}

/// A mutable map of non-overlapping segments; an insert overwrites what it overlaps.
#[derive(Debug, Default, Clone)]
pub(crate) struct ExtentMap {
    /// start → (len, target); segments never overlap and never have len 0.
    map: BTreeMap<u64, (u64, Target)>,
}

impl ExtentMap {
    pub fn new() -> Self {
        Self::default()
    }

    /// Map `start..start+len` to `target`, replacing whatever mapped any part of it. Adjacent
    /// segments that continue each other are joined.
    pub fn insert(&mut self, start: u64, len: u64, target: Target) {
        if len == 0 {
            return;
        }
        let end = start + len;
        // A segment that starts before `start` and reaches into the new range: cut it.
        if let Some((&s, &(l, t))) = self.map.range(..start).next_back() {
            if s + l > start {
                self.map.insert(s, (start - s, t));
                if s + l > end {
                    self.map.insert(end, (s + l - end, t.advance(end - s)));
                }
            }
        }
        // Segments that start inside the new range: remove, keeping a tail past `end`.
        let inside: Vec<u64> = self.map.range(start..end).map(|(&s, _)| s).collect();
        for s in inside {
            if let Some((l, t)) = self.map.remove(&s) {
                if s + l > end {
                    self.map.insert(end, (s + l - end, t.advance(end - s)));
                }
            }
        }
        // Join with the neighbours where they continue each other.
        let (mut start, mut len) = (start, len);
        let mut target = target;
        if let Some((&s, &(l, t))) = self.map.range(..start).next_back() {
            if s + l == start && t.continues(l, target) {
                self.map.remove(&s);
                start = s;
                len += l;
                target = t;
            }
        }
        if let Some(&(l, t)) = self.map.get(&end) {
            if target.continues(len, t) {
                self.map.remove(&end);
                len += l;
            }
        }
        self.map.insert(start, (len, target));
    }

    /// The segments overlapping `lo..hi`, clipped to it, in order, appended to `out`.
    pub fn lookup(&self, lo: u64, hi: u64, out: &mut Vec<Seg>) {
        if lo >= hi {
            return;
        }
        let clipped = |(&start, &(len, target)): (&u64, &(u64, Target))| {
            Seg { start, len, target }.clip(lo, hi)
        };
        // The segment that starts before `lo` but reaches into it, then those inside.
        let before = (self.map.range(..lo).next_back()).filter(|(&s, &(l, _))| s + l > lo);
        out.extend(
            before
                .into_iter()
                .chain(self.map.range(lo..hi))
                .map(clipped),
        );
    }

    /// Every segment, in order.
    pub fn segments(&self) -> impl Iterator<Item = Seg> + '_ {
        self.map
            .iter()
            .map(|(&start, &(len, target))| Seg { start, len, target })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Freeze into a sorted vector for binary search.
    pub fn freeze(&self) -> FrozenMap {
        FrozenMap {
            segs: self.segments().collect(),
        }
    }
}

/// A sorted, non-overlapping, immutable segment list.
#[derive(Debug, Default, Clone)]
pub(crate) struct FrozenMap {
    segs: Vec<Seg>,
}

impl FrozenMap {
    /// The segments overlapping `lo..hi`, clipped to it, in order (no allocation).
    pub fn range(&self, lo: u64, hi: u64) -> impl Iterator<Item = Seg> + '_ {
        let first = self.segs.partition_point(|s| s.end() <= lo);
        self.segs[first..]
            .iter()
            .take_while(move |s| s.start < hi && lo < hi)
            .map(move |s| s.clip(lo, hi))
    }

    /// The segments overlapping `lo..hi`, clipped to it, in order, appended to `out`.
    #[cfg(test)]
    pub fn lookup(&self, lo: u64, hi: u64, out: &mut Vec<Seg>) {
        out.extend(self.range(lo, hi));
    }

    pub fn len(&self) -> usize {
        self.segs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(layer: u32, offset: u64) -> Target {
        Target::Data { layer, offset }
    }

    /// A byte-level model: for each device byte, the (layer, offset) or zero it maps to.
    fn model_check(map: &ExtentMap, model: &[Option<Target>]) {
        let mut out = Vec::new();
        map.lookup(0, model.len() as u64, &mut out);
        let mut seen = vec![None; model.len()];
        let mut prev_end = 0;
        for s in &out {
            assert!(s.start >= prev_end, "overlap or unsorted: {out:?}");
            prev_end = s.end();
            for i in 0..s.len {
                seen[(s.start + i) as usize] = Some(s.target.advance(i));
            }
        }
        assert_eq!(seen, model);
        let frozen = map.freeze();
        let mut out2 = Vec::new();
        frozen.lookup(0, model.len() as u64, &mut out2);
        assert_eq!(out, out2);
    }

    #[test]
    fn random_inserts_match_a_byte_model() {
        let mut rng = fastrand::Rng::with_seed(7);
        let size = 300u64;
        let mut map = ExtentMap::new();
        let mut model: Vec<Option<Target>> = vec![None; size as usize];
        for round in 0..2000u64 {
            let start = rng.u64(0..size);
            let len = rng.u64(1..=(size - start).min(40));
            let target = if rng.u8(0..4) == 0 {
                Target::Zero
            } else {
                data(rng.u32(0..3), rng.u64(0..1000) + round)
            };
            map.insert(start, len, target);
            for i in 0..len {
                model[(start + i) as usize] = Some(target.advance(i));
            }
            model_check(&map, &model);
            // Clipped lookups agree with the whole one.
            let lo = rng.u64(0..size);
            let hi = rng.u64(lo..=size);
            let mut part = Vec::new();
            map.lookup(lo, hi, &mut part);
            assert!(part
                .iter()
                .all(|s| s.start >= lo && s.end() <= hi && s.len > 0));
        }
    }

    #[test]
    fn contiguous_inserts_join() {
        let mut map = ExtentMap::new();
        for i in 0..100 {
            map.insert(i * 8, 8, data(0, 1000 + i * 8));
        }
        assert_eq!(map.len(), 1);
        map.insert(800, 8, Target::Zero);
        map.insert(808, 8, Target::Zero);
        assert_eq!(map.len(), 2);
    }
}
