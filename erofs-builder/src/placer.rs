//! Where chunks go in one blob file of a layer: a [`Placer`] owns the file and chooses the
//! start block of each chunk written to it (layout rules in the [`crate::layer`] docs).
//!
//! A layer has one placer per blob: the main blob's (its chunk size is the EROFS chunk,
//! 256 KiB) and, with [`crate::layer::TailsBlob`], the tails blob's (its own chunk size T).
//! The rules are the same for both, in units of the placer's chunk size:
//!
//! * a **full** EROFS chunk (256 KiB) starts at a chunk boundary; the space skipped to reach
//!   it becomes a gap (only the main placer gets full chunks);
//! * a **partial** EROFS chunk (under 256 KiB) goes into the current directory's run, else
//!   into the first remembered gap it fits (the newest [`Placer::MAX_GAPS`]), else at the end;
//! * [`Placer::begin_dir`] reserves a run of whole chunks, starting at a chunk boundary, for
//!   a directory whose partial chunks take at least half a chunk (at most
//!   [`crate::layer::TAIL_RUN_MIN_BLOCKS`] blocks); what a run does not use becomes a gap.
//!
//! Invariant: with only full chunks (the main blob of a layer with a tails blob), every
//! chunk is placed at the end, the blob has no gaps, and its length is a whole number of
//! chunks.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::data::write_nonzero;
use crate::layer::{CHUNK_BLKBITS, TAIL_RUN_MIN_BLOCKS};
use crate::ondisk::BLOCK_SIZE;
use crate::{io_err, Result};

/// Blocks in a full EROFS chunk (256 KiB).
const EROFS_CHUNK_BLOCKS: u64 = 1 << CHUNK_BLKBITS;

/// One blob file being written and the placement state of its chunks.
#[derive(Debug)]
pub(crate) struct Placer {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
    /// The blob's chunk size in blocks (a power of two, at most 64).
    pub(crate) chunk_blocks: u64,
    /// Blob length in blocks so far (the end of the last placed chunk or reserved run).
    pub(crate) blocks: u64,
    /// Gaps `[start, end)` (blocks) left free before later chunks, oldest first.
    pub(crate) gaps: Vec<(u64, u64)>,
    /// The current directory's run of partial chunks `[next, end)` (blocks), if it has one.
    run: Option<(u64, u64)>,
}

impl Placer {
    /// Gaps remembered (older ones are forgotten, their space stays zero).
    pub(crate) const MAX_GAPS: usize = 64;

    /// Creates (truncates) the blob file at `path`, whose chunks are `chunk_blocks` blocks.
    pub(crate) fn create(path: &Path, chunk_blocks: u64) -> Result<Self> {
        debug_assert!(chunk_blocks.is_power_of_two() && chunk_blocks <= EROFS_CHUNK_BLOCKS);
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(path)
            .map_err(io_err(format!("create {}", path.display())))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            chunk_blocks,
            blocks: 0,
            gaps: Vec::new(),
            run: None,
        })
    }

    /// The least partial-chunk blocks of a directory that get it a run: half a chunk, at
    /// most [`TAIL_RUN_MIN_BLOCKS`] (so 32 blocks for 256 KiB chunks, as always).
    fn run_min_blocks(&self) -> u64 {
        TAIL_RUN_MIN_BLOCKS.min(self.chunk_blocks / 2).max(1)
    }

    /// The writer reaches the files of another directory, whose partial chunks take
    /// `tail_blocks` blocks: a run of whole chunks for them if that is enough; the previous
    /// run's rest becomes a gap.
    pub(crate) fn begin_dir(&mut self, tail_blocks: u64) {
        if let Some((next, end)) = self.run.take() {
            if end > next {
                self.add_gap(next, end);
            }
        }
        if tail_blocks >= self.run_min_blocks() {
            let start = self.blocks.next_multiple_of(self.chunk_blocks);
            if start > self.blocks {
                self.add_gap(self.blocks, start);
            }
            let end = start + tail_blocks.next_multiple_of(self.chunk_blocks);
            self.blocks = end;
            self.run = Some((start, end));
        }
    }

    fn add_gap(&mut self, start: u64, end: u64) {
        if self.gaps.len() == Self::MAX_GAPS {
            self.gaps.remove(0);
        }
        self.gaps.push((start, end));
    }

    /// Chooses the start block of a new EROFS chunk of `blocks` blocks (see the module docs).
    pub(crate) fn place(&mut self, blocks: u64) -> u64 {
        if blocks >= EROFS_CHUNK_BLOCKS {
            let start = self.blocks.next_multiple_of(self.chunk_blocks);
            if start > self.blocks {
                self.add_gap(self.blocks, start);
            }
            self.blocks = start + blocks;
            return start;
        }
        if let Some((next, end)) = &mut self.run {
            if *end - *next >= blocks {
                let start = *next;
                *next += blocks;
                return start;
            }
        }
        if let Some(i) = self.gaps.iter().position(|&(s, e)| e - s >= blocks) {
            let start = self.gaps[i].0;
            self.gaps[i].0 += blocks;
            if self.gaps[i].0 == self.gaps[i].1 {
                self.gaps.remove(i);
            }
            return start;
        }
        let start = self.blocks;
        self.blocks += blocks;
        start
    }

    /// Writes a chunk's bytes at block `start` (all-zero blocks are left unwritten).
    pub(crate) fn write(&self, data: &[u8], start: u64) -> Result<()> {
        write_nonzero(&self.file, data, start * BLOCK_SIZE)
            .map_err(io_err(format!("write {}", self.path.display())))
    }

    /// Completes the file: its length (at least `min_blocks` blocks), fsync if asked, and
    /// its blake3 digest.
    pub(crate) fn finish(&mut self, min_blocks: u64, fsync: bool) -> Result<[u8; 32]> {
        self.blocks = self.blocks.max(min_blocks);
        let ctx = || format!("write {}", self.path.display());
        self.file
            .set_len(self.blocks * BLOCK_SIZE)
            .map_err(io_err(ctx()))?;
        if fsync {
            self.file.sync_all().map_err(io_err(ctx()))?;
        }
        // Read back in 1 MiB pieces (an mmap would count the whole blob as resident).
        let mut h = blake3::Hasher::new();
        let mut off = 0u64;
        let len = self.blocks * BLOCK_SIZE;
        let mut buf = vec![0u8; 1 << 20];
        while off < len {
            let n = (len - off).min(buf.len() as u64) as usize;
            self.file
                .read_exact_at(&mut buf[..n], off)
                .map_err(io_err(format!("hash {}", self.path.display())))?;
            h.update_rayon(&buf[..n]);
            off += n as u64;
        }
        Ok(*h.finalize().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = EROFS_CHUNK_BLOCKS;

    #[test]
    fn full_chunks_are_aligned_and_partial_ones_fill_gaps() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Placer::create(&dir.path().join("b"), C).unwrap();
        assert_eq!(w.place(3), 0);
        assert_eq!(w.place(C), C);
        assert_eq!(w.gaps, vec![(3, C)]);
        assert_eq!(w.place(60), 3);
        assert_eq!(w.place(2), 2 * C);
        assert_eq!(w.place(1), 63);
        assert!(w.gaps.is_empty());
        assert_eq!(w.place(C), 3 * C);
        assert_eq!(w.gaps, vec![(2 * C + 2, 3 * C)]);
    }

    #[test]
    fn only_full_chunks_leave_no_gap() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Placer::create(&dir.path().join("b"), C).unwrap();
        for i in 0..5 {
            assert_eq!(w.place(C), i * C);
        }
        assert!(w.gaps.is_empty());
        assert_eq!(w.blocks, 5 * C);
    }

    #[test]
    fn small_chunk_runs_start_at_their_chunk_boundary() {
        // 64 KiB chunks (16 blocks): a directory with 8 or more tail blocks gets a run.
        let dir = tempfile::tempdir().unwrap();
        let mut w = Placer::create(&dir.path().join("t"), 16).unwrap();
        w.begin_dir(5); // too little for a run: packed at the end
        assert_eq!(w.place(5), 0);
        w.begin_dir(20); // a run of 2 chunks at block 16; 5..16 is a gap
        assert_eq!(w.gaps, vec![(5, 16)]);
        assert_eq!(w.place(12), 16);
        assert_eq!(w.place(8), 28);
        assert_eq!(w.blocks, 48);
        w.begin_dir(0); // the run's rest (36..48) becomes a gap
        assert_eq!(w.gaps, vec![(5, 16), (36, 48)]);
        assert_eq!(w.place(40), 48, "a tail larger than a chunk fits no gap");
        assert_eq!(w.place(11), 5);
        assert_eq!(w.place(3), 36);
    }
}
