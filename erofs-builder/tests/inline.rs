//! Layers with small files inline in the meta image (`LayerOptions::inline_max`): a regular
//! file of at most `inline_max` bytes (and under 4096) whose inode, xattrs and data fit one
//! block is flat-inline in the meta image, every other file chunk-based as before. Built from
//! the varied test tree plus files around the limits, with a tails blob; checked with the
//! kernel (`device=MAIN,device=TAILS`), `fsck.erofs` (1.5, and 1.8 from
//! `scripts/build-erofs-utils.sh`, extraction compared) and our reader; which files went
//! where; determinism; the blobs shrink by what moved. Needs root for the tree and mounts
//! (prints SKIPPED otherwise; fails under CI=true).

mod common;
#[path = "common/tools.rs"]
mod tools;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{compare_image, compare_trees, fsck, make_tree, mount_erofs, require_root, write};
use common::{regular_files, EXACT, FSCK15_EXTRACT};
use erofs_builder::ondisk::{DATALAYOUT_CHUNK_BASED, DATALAYOUT_FLAT_INLINE};
use erofs_builder::{build_layer, Image, LayerOptions, LayerStats, Location, TailsBlob};

const MANY: usize = 200;
const T16K: u32 = 16 << 10;

struct Built {
    meta: PathBuf,
    blob: PathBuf,
    tails: PathBuf,
    stats: LayerStats,
}

impl Built {
    fn devices(&self) -> [&Path; 2] {
        [&self.blob, &self.tails]
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    src: PathBuf,
    /// inline_max 0 (none), 4095 (every file that fits), 1024; no budget.
    none: Built,
    all: Built,
    k1: Built,
}

/// Files around the limits besides `make_tree`'s: 1, 1024, 1025, 4000, 4095 and 4096 bytes,
/// an empty file, a 4000-byte file whose xattrs leave no room for its data in the inode's
/// block, and a directory of 300 small files (inodes and data fill several meta blocks).
fn add_inline_files(d: &Path) {
    std::fs::create_dir(d).unwrap();
    for n in [1usize, 1024, 1025, 4000, 4095, 4096] {
        write(&d.join(format!("size{n}")), &common::bytes(n as u64, n));
    }
    write(&d.join("empty"), b"");
    let crowded = d.join("crowded");
    write(&crowded, &common::bytes(7, 4000));
    for i in 0..4 {
        common::setx(&crowded, &format!("user.pad{i}"), &[b'x'; 200]);
    }
    std::fs::create_dir(d.join("many")).unwrap();
    for i in 0..300u64 {
        let size = 1 + (i as usize * 997) % 3000;
        write(
            &d.join(format!("many/f{i:03}")),
            &common::bytes(300 + i, size),
        );
    }
}

fn build(src: &Path, out: &Path, name: &str, inline_max: u64, budget: Option<u64>) -> Built {
    let meta = out.join(format!("{name}.meta"));
    let blob = out.join(format!("{name}.blob"));
    let tails = out.join(format!("{name}.tails"));
    let mut opts = LayerOptions::default();
    opts.build.fsync = false;
    opts.tails = Some(TailsBlob::new(&tails, T16K));
    opts.inline_max = inline_max;
    opts.inline_budget = budget;
    let stats = build_layer(src, &meta, &blob, &opts).unwrap();
    Built {
        meta,
        blob,
        tails,
        stats,
    }
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        make_tree(&src, true, MANY);
        add_inline_files(&src.join("limits"));
        common::set_mtime(&src, 1_700_000_000, 0);
        let none = build(&src, dir.path(), "none", 0, None);
        let all = build(&src, dir.path(), "all", 4095, Some(u64::MAX));
        let k1 = build(&src, dir.path(), "k1", 1024, Some(u64::MAX));
        Fixture {
            _dir: dir,
            src,
            none,
            all,
            k1,
        }
    })
}

#[test]
fn kernel_mounts_layers_with_inline_files_and_every_file_matches() {
    if !require_root("kernel_mounts_layers_with_inline_files_and_every_file_matches") {
        return;
    }
    let f = fixture();
    for b in [&f.all, &f.k1] {
        let mnt = tempfile::tempdir().unwrap();
        let _guard = mount_erofs(&b.meta, &b.devices(), mnt.path());
        let n = compare_trees(&f.src, mnt.path(), EXACT);
        assert!(n > MANY + 300, "compared {n} entries");
    }
}

#[test]
fn fsck_erofs_and_our_reader_accept_layers_with_inline_files() {
    if !require_root("fsck_erofs_and_our_reader_accept_layers_with_inline_files") {
        return;
    }
    let f = fixture();
    for b in [&f.all, &f.k1] {
        fsck(Path::new("fsck.erofs"), &b.meta, &b.devices(), &[]);
        let img = Image::open_with_devices(&b.meta, &b.devices()).unwrap();
        assert!(compare_image(&f.src, &img, true) > MANY + 300);
    }
    if let Some(t) =
        tools::require("fsck_erofs_and_our_reader_accept_layers_with_inline_files (1.8)")
    {
        for b in [&f.all, &f.k1] {
            fsck(&t.fsck, &b.meta, &b.devices(), &[]);
        }
    }
    // Extraction by fsck.erofs 1.5 (holes dropped: compared without them).
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("x");
    let extract = [format!("--extract={}", dst.display())];
    fsck(
        Path::new("fsck.erofs"),
        &f.all.meta,
        &f.all.devices(),
        &extract,
    );
    assert!(compare_trees(&f.src.join("limits"), &dst.join("limits"), FSCK15_EXTRACT) > 300);
}

/// Which files are inline: at most `inline_max` bytes, under 4096, fitting the inode's block;
/// their data is in the meta image only; the counts and the blobs follow.
#[test]
fn small_files_are_inline_and_the_rest_stay_in_the_blobs() {
    if !require_root("small_files_are_inline_and_the_rest_stay_in_the_blobs") {
        return;
    }
    let f = fixture();
    for (b, max) in [(&f.none, 0u64), (&f.all, 4095), (&f.k1, 1024)] {
        let img = Image::open_with_devices(&b.meta, &b.devices()).unwrap();
        let mut inline = 0u64;
        let mut inline_nids = std::collections::HashSet::new();
        for (path, ino) in regular_files(&img) {
            if ino.size == 0 {
                assert!(img.data_map(&ino).unwrap().is_empty(), "{path}");
                continue;
            }
            let map = img.data_map(&ino).unwrap();
            if ino.datalayout == DATALAYOUT_FLAT_INLINE {
                // Hard links name one inode: counted once, as the stats count inodes.
                if inline_nids.insert(ino.nid) {
                    inline += 1;
                }
                assert!(
                    ino.size <= max && ino.size < 4096,
                    "{path}: {} bytes inline",
                    ino.size
                );
                assert_eq!(map.len(), 1, "{path}");
                assert!(matches!(map[0].location, Location::Image(_)), "{path}");
                assert_eq!((map[0].file_offset, map[0].len), (0, ino.size), "{path}");
            } else {
                assert_eq!(ino.datalayout, DATALAYOUT_CHUNK_BASED, "{path}");
                assert!(
                    map.iter()
                        .all(|e| !matches!(e.location, Location::Image(_))),
                    "{path}: a chunk-based file's data in the meta image"
                );
                // A file within the limit is chunk-based only when inode (at most 64 bytes),
                // xattrs (bounded above by their names and values) and data overflow a block.
                if ino.size <= max.min(4095) {
                    let xattrs: u64 = (img.xattrs(&ino).unwrap().iter())
                        .map(|(n, v)| (4 + n.len() + v.len() + 3) as u64)
                        .sum();
                    assert!(
                        64 + 12 + xattrs + ino.size > 4096,
                        "{path} ({} bytes, {xattrs} of xattrs) not inline",
                        ino.size
                    );
                }
            }
        }
        assert_eq!(b.stats.meta.inline_files, inline, "inline_max {max}");
        match max {
            0 => assert_eq!(inline, 0),
            // 4095: size1 .. size4000 and all of many/ (not size4095, whose 32-byte inode
            // leaves 4064 bytes, nor size4096, crowded or empty).
            4095 => assert!(inline >= 4 + 300, "{inline}"),
            _ => assert!(inline >= 2, "{inline}"),
        }
    }
    // The data that moved is out of the tails blob; the main blob holds the same chunks.
    assert!(
        f.all.stats.tails.as_ref().unwrap().stored_bytes
            < f.k1.stats.tails.as_ref().unwrap().stored_bytes
    );
    assert!(
        f.k1.stats.tails.as_ref().unwrap().stored_bytes
            < f.none.stats.tails.as_ref().unwrap().stored_bytes
    );
    assert_eq!(f.all.stats.chunks, f.none.stats.chunks);
    assert!(f.all.stats.meta.image_bytes > f.none.stats.meta.image_bytes);
}

#[test]
fn a_layer_with_inline_files_builds_the_same_bytes_twice() {
    if !require_root("a_layer_with_inline_files_builds_the_same_bytes_twice") {
        return;
    }
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let again = build(&f.src, dir.path(), "again", 4095, Some(u64::MAX));
    for (a, b) in [
        (&f.all.meta, &again.meta),
        (&f.all.blob, &again.blob),
        (&f.all.tails, &again.tails),
    ] {
        assert!(
            std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
            "{} differs",
            a.display()
        );
    }
}

/// A budget: the smallest files that fit are inline, up to the budget's bytes; by default
/// 1/16 of the files' bytes (at most 8 MiB).
#[test]
fn a_budget_inlines_the_smallest_files_first() {
    if !require_root("a_budget_inlines_the_smallest_files_first") {
        return;
    }
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let limited = build(&f.src, dir.path(), "limited", 4095, Some(100_000));
    let default = build(&f.src, dir.path(), "default", 4095, None);
    let total = f.none.stats.meta.data_bytes;
    let want = erofs_builder::layer::default_inline_budget(total);
    for (b, budget) in [(&limited, 100_000), (&default, want)] {
        let s = &b.stats.meta;
        assert!(
            s.inline_bytes <= budget,
            "{} inline bytes over {budget}",
            s.inline_bytes
        );
        assert!(
            s.inline_files > 0 && s.inline_files < f.all.stats.meta.inline_files,
            "{s:?}"
        );
        // Every inline file is at most as large as every file left out that would have fit.
        let img = Image::open_with_devices(&b.meta, &b.devices()).unwrap();
        let all = Image::open_with_devices(&f.all.meta, &f.all.devices()).unwrap();
        let inline_in = |img: &Image| -> std::collections::BTreeMap<String, u64> {
            (regular_files(img).into_iter())
                .filter(|(_, i)| i.datalayout == DATALAYOUT_FLAT_INLINE)
                .map(|(p, i)| (p, i.size))
                .collect()
        };
        let (got, could) = (inline_in(&img), inline_in(&all));
        let largest_in = got.values().max().copied().unwrap();
        let smallest_out = (could.iter())
            .filter(|(p, _)| !got.contains_key(*p))
            .map(|(_, &s)| s)
            .min()
            .unwrap();
        assert!(
            largest_in <= smallest_out,
            "{largest_in} inline, {smallest_out} not"
        );
        let mnt = tempfile::tempdir().unwrap();
        let _guard = mount_erofs(&b.meta, &b.devices(), mnt.path());
        assert!(compare_trees(&f.src, mnt.path(), EXACT) > MANY + 300);
    }
}
