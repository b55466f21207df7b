//! A device: a stack of sealed layers, merged into one index at open, and an optional upper.

use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::extmap::{ExtentMap, FrozenMap, Target};
use crate::format::{LayerId, SealedInfo, SealedLayer, SECTOR};
use crate::source::LayerSource;
use crate::upper::Upper;

/// A layered block device. All methods take `&self` and may be called from many threads.
///
/// Reads may start and end anywhere inside the device. Writes that are not sector-aligned are
/// done as read-modify-write of the sectors they touch (not atomic against a concurrent write
/// of the same sector); discards zero their unaligned edges with writes.
#[derive(Debug)]
pub struct Device {
    layers: Vec<SealedLayer>,
    merged: FrozenMap,
    upper: Option<Upper>,
    size: u64,
}

impl Device {
    /// Open a stack: `layers[0]` is the base, each next layer sits on the one before (its
    /// parent id must be that layer's id), and `upper`, if any, sits on the last layer. The
    /// device size is the upper's, else the top layer's (0 for an empty stack).
    pub fn open(layers: Vec<Arc<dyn LayerSource>>, upper: Option<Upper>) -> Result<Self> {
        let sealed = layers
            .into_iter()
            .map(SealedLayer::open)
            .collect::<Result<Vec<_>>>()?;
        Self::from_layers(sealed, upper)
    }

    /// [`Device::open`] with layers already parsed.
    pub fn from_layers(layers: Vec<SealedLayer>, upper: Option<Upper>) -> Result<Self> {
        let mut below = LayerId::NONE;
        for l in &layers {
            if l.parent_id() != below {
                return Err(Error::ParentMismatch {
                    what: format!("layer {} ({})", l.id(), l.source().describe()),
                    expected: l.parent_id().to_string(),
                    found: below.to_string(),
                });
            }
            below = l.id();
        }
        if let Some(u) = &upper {
            if u.parent_id() != below {
                return Err(Error::ParentMismatch {
                    what: format!("upper {}", u.dir().display()),
                    expected: u.parent_id().to_string(),
                    found: below.to_string(),
                });
            }
        }
        // Merge bottom first: each layer's extents overwrite what they cover below.
        let mut map = ExtentMap::new();
        for (i, l) in layers.iter().enumerate() {
            for e in l.extents() {
                let target = match e.file_offset {
                    Some(offset) => Target::Data {
                        layer: i as u32,
                        offset,
                    },
                    None => Target::Zero,
                };
                map.insert(e.device_offset, e.length, target);
            }
        }
        let size = match (&upper, layers.last()) {
            (Some(u), _) => u.device_size(),
            (None, Some(l)) => l.device_size(),
            (None, None) => 0,
        };
        Ok(Self {
            merged: map.freeze(),
            layers,
            upper,
            size,
        })
    }

    /// The device size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The sealed layers, base first.
    pub fn layers(&self) -> &[SealedLayer] {
        &self.layers
    }

    /// The id of the top sealed layer (`LayerId::NONE` without layers).
    pub fn top_id(&self) -> LayerId {
        self.layers.last().map_or(LayerId::NONE, |l| l.id())
    }

    pub fn upper(&self) -> Option<&Upper> {
        self.upper.as_ref()
    }

    /// Segments in the merged index of the sealed layers.
    pub fn merged_segments(&self) -> usize {
        self.merged.len()
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<u64> {
        offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or(Error::OutOfRange {
                offset,
                len,
                size: self.size,
            })
    }

    /// Fill `buf` with the device's bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = self.check_range(offset, buf.len() as u64)?;
        let Some(u) = &self.upper else {
            return self.read_lower(offset, buf);
        };
        let mut segs = Vec::new();
        u.lookup(offset, end, &mut segs);
        let mut pos = offset;
        for s in &segs {
            if s.start > pos {
                self.read_lower(
                    pos,
                    &mut buf[(pos - offset) as usize..(s.start - offset) as usize],
                )?;
            }
            let dst = &mut buf[(s.start - offset) as usize..(s.end() - offset) as usize];
            match s.target {
                Target::Zero => dst.fill(0),
                Target::Data { offset: at, .. } => u.read_data(dst, at)?,
            }
            pos = s.end();
        }
        if pos < end {
            self.read_lower(pos, &mut buf[(pos - offset) as usize..])?;
        }
        Ok(())
    }

    /// Read from the merged sealed layers (zeros where none maps).
    fn read_lower(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        let mut pos = offset;
        for s in self.merged.range(offset, end) {
            buf[(pos - offset) as usize..(s.start - offset) as usize].fill(0);
            let dst = &mut buf[(s.start - offset) as usize..(s.end() - offset) as usize];
            match s.target {
                Target::Zero => dst.fill(0),
                Target::Data { layer, offset: at } => {
                    // `layer` was set from an index into `layers` at merge time.
                    let l = &self.layers[layer as usize];
                    l.source().read_exact_at(dst, at)?;
                }
            }
            pos = s.end();
        }
        buf[(pos - offset) as usize..].fill(0);
        Ok(())
    }

    fn upper_or_ro(&self) -> Result<&Upper> {
        self.upper.as_ref().ok_or(Error::ReadOnly)
    }

    /// Write `data` at `offset` into the upper (durable after [`flush`](Self::flush)).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let upper = self.upper_or_ro()?;
        let end = self.check_range(offset, data.len() as u64)?;
        if offset % SECTOR == 0 && end % SECTOR == 0 {
            return upper.write_at(offset, data);
        }
        // Read-modify-write of the sectors the write touches.
        let lo = offset / SECTOR * SECTOR;
        let hi = end.div_ceil(SECTOR) * SECTOR;
        // Only the partially written first and last sectors need their old bytes, and a write
        // inside one sector needs that sector once.
        let mut buf = vec![0u8; (hi - lo) as usize];
        let head_read = offset != lo;
        if head_read {
            self.read_at(lo, &mut buf[..SECTOR as usize])?;
        }
        let tail = hi - SECTOR;
        if end != hi && !(head_read && tail == lo) {
            let t0 = (tail - lo) as usize;
            self.read_at(tail, &mut buf[t0..])?;
        }
        buf[(offset - lo) as usize..(end - lo) as usize].copy_from_slice(data);
        upper.write_at(lo, &buf)
    }

    /// Make `offset..offset+len` read as zeros.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let upper = self.upper_or_ro()?;
        let end = self.check_range(offset, len)?;
        let lo = offset.div_ceil(SECTOR) * SECTOR;
        let hi = end / SECTOR * SECTOR;
        if lo >= hi {
            return self.write_at(offset, &vec![0u8; len as usize]);
        }
        if lo > offset {
            self.write_at(offset, &vec![0u8; (lo - offset) as usize])?;
        }
        if end > hi {
            self.write_at(hi, &vec![0u8; (end - hi) as usize])?;
        }
        upper.discard(lo, hi - lo)
    }

    /// Make every acknowledged write and discard durable. A no-op without an upper.
    pub fn flush(&self) -> Result<()> {
        match &self.upper {
            Some(u) => u.flush(),
            None => Ok(()),
        }
    }

    /// Seal the upper into a sealed layer file at `out` (see [`Upper::seal`]).
    pub fn commit(&self, out: impl AsRef<Path>) -> Result<SealedInfo> {
        self.upper_or_ro()?.seal(out)
    }
}

// The frontends share one device between I/O threads.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<Device>();
};
