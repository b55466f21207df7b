//! Layers with a tails blob (`LayerOptions::tails`): the main blob (device 1) holds only
//! whole 256 KiB chunks, the tails blob (device 2, chunk size T) every partial chunk. Built
//! from the varied test tree at T = 64 KiB and 16 KiB, then checked with the kernel
//! (file-backed mount(2) with `device=MAIN,device=TAILS`, and flat `meta ‖ main ‖ tails`),
//! `fsck.erofs --device=` (1.5, and 1.8 from `scripts/build-erofs-utils.sh`) and our
//! reader; the main blob's shape; determinism; a rebuild with a few small files changed,
//! deduped against the previous version's two blobs. Needs root for the tree and mounts
//! (prints SKIPPED otherwise; fails under CI=true).

mod common;
#[path = "common/tools.rs"]
mod tools;

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use common::{compare_image, compare_trees, fsck, make_tree, mount_erofs, require_root, write};
use common::{regular_files, EXACT, FSCK15_EXTRACT};
use erofs_builder::layer::{CHUNK_SIZE, MAX_DICT_DEVICES};
use erofs_builder::{
    build_layer, ChunkDictionary, Error, Image, LayerOptions, LayerStats, Location, TailsBlob,
};

const MANY: usize = 300;
const BIG: u64 = 5 << 30;
const T64K: u32 = 64 << 10;
const T16K: u32 = 16 << 10;

/// One built layer: its three files and stats.
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
    dir: tempfile::TempDir,
    src: PathBuf,
    /// Built with T = 64 KiB and T = 16 KiB.
    t64: Built,
    t16: Built,
}

/// Files around the chunk boundaries besides `make_tree`'s: exactly 256 KiB, 256 KiB + 1,
/// several chunks with a tail, a repeated chunk, a zero chunk in the middle, a 5 GiB sparse
/// file, identical small files, and a directory of small files big enough for a run.
fn add_tails_files(d: &Path) {
    std::fs::create_dir(d).unwrap();
    let cs = CHUNK_SIZE as usize;
    let a = common::bytes(10, cs);
    write(&d.join("exact_chunk"), &a);
    write(&d.join("chunk_plus_one"), &common::bytes(11, cs + 1));
    write(&d.join("multi"), &common::bytes(12, 4 * cs + 70_000));
    write(&d.join("repeat"), &[&a[..], &a, b"end"].concat());
    write(
        &d.join("zero_middle"),
        &[&common::bytes(13, cs)[..], &vec![0u8; cs], b"tail"].concat(),
    );
    let f = File::create(d.join("sparse5g")).unwrap();
    f.set_len(BIG).unwrap();
    f.write_all_at(b"EROF", (3 << 30) + 5).unwrap();
    write(&d.join("s1"), b"abc");
    write(&d.join("s1_again"), b"abc");
    write(&d.join("big_tail"), &common::bytes(14, 200_000));
    std::fs::create_dir(d.join("run")).unwrap();
    for i in 0..40u64 {
        let size = 1000 + (i as usize * 7919) % 30_000;
        write(
            &d.join(format!("run/f{i:02}")),
            &common::bytes(100 + i, size),
        );
    }
}

fn build(src: &Path, out: &Path, name: &str, t: u32, dict: Option<&Arc<ChunkDictionary>>) -> Built {
    let meta = out.join(format!("{name}.meta"));
    let blob = out.join(format!("{name}.blob"));
    let tails = out.join(format!("{name}.tails"));
    let mut opts = LayerOptions::default();
    opts.build.fsync = false;
    opts.tails = Some(TailsBlob::new(&tails, t));
    opts.dictionary = dict.cloned();
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
        add_tails_files(&src.join("chunks"));
        common::set_mtime(&src, 1_700_000_000, 0);
        let t64 = build(&src, dir.path(), "t64", T64K, None);
        let t16 = build(&src, dir.path(), "t16", T16K, None);
        Fixture { dir, src, t64, t16 }
    })
}

fn blake3_of(p: &Path) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update_reader(File::open(p).unwrap()).unwrap();
    *h.finalize().as_bytes()
}

/// The blake3 of each `chunk_size` chunk of `blob` (what a store's chunk table holds).
fn chunk_digests(blob: &Path, chunk_size: u64) -> Vec<[u8; 32]> {
    std::fs::read(blob)
        .unwrap()
        .chunks(chunk_size as usize)
        .map(|c| *blake3::hash(c).as_bytes())
        .collect()
}

#[test]
fn kernel_mounts_meta_blob_and_tails_and_every_file_matches() {
    if !require_root("kernel_mounts_meta_blob_and_tails_and_every_file_matches") {
        return;
    }
    let f = fixture();
    for b in [&f.t64, &f.t16] {
        let mnt = tempfile::tempdir().unwrap();
        {
            let _guard = mount_erofs(&b.meta, &b.devices(), mnt.path());
            let n = compare_trees(&f.src, mnt.path(), EXACT);
            assert!(n > MANY, "compared {n} entries");
            let big = File::open(mnt.path().join("chunks/sparse5g")).unwrap();
            assert_eq!(big.metadata().unwrap().len(), BIG);
        }
        // meta ‖ main ‖ tails is a valid single-file image (mapped_blkaddr chains them).
        let flat = f.dir.path().join("flat.erofs");
        {
            let mut out = File::create(&flat).unwrap();
            for p in [&b.meta, &b.blob, &b.tails] {
                std::io::copy(&mut File::open(p).unwrap(), &mut out).unwrap();
            }
        }
        let _guard = mount_erofs(&flat, &[], mnt.path());
        assert!(compare_trees(&f.src, mnt.path(), EXACT) > MANY);
    }
}

#[test]
fn fsck_erofs_accepts_layers_with_tails() {
    if !require_root("fsck_erofs_accepts_layers_with_tails") {
        return;
    }
    let f = fixture();
    for b in [&f.t64, &f.t16] {
        fsck(Path::new("fsck.erofs"), &b.meta, &b.devices(), &[]);
    }
    // erofs-utils 1.8 (stricter) too.
    if let Some(t) = tools::require("fsck_erofs_accepts_layers_with_tails (1.8)") {
        for b in [&f.t64, &f.t16] {
            fsck(&t.fsck, &b.meta, &b.devices(), &[]);
        }
    }
    // fsck.erofs 1.5 --extract drops hole chunks, so extraction is compared without holes.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    make_tree(&src, true, MANY);
    std::fs::remove_file(src.join("sparse")).unwrap();
    add_tails_files(&src.join("chunks"));
    std::fs::remove_file(src.join("chunks/sparse5g")).unwrap();
    std::fs::remove_file(src.join("chunks/zero_middle")).unwrap();
    let b = build(&src, dir.path(), "x", T16K, None);
    assert_eq!(b.stats.hole_chunks, 0);
    let dst = dir.path().join("x");
    let extract = [format!("--extract={}", dst.display())];
    fsck(Path::new("fsck.erofs"), &b.meta, &b.devices(), &extract);
    assert!(compare_trees(&src, &dst, FSCK15_EXTRACT) > MANY);
}

#[test]
fn our_reader_reads_layers_with_tails() {
    if !require_root("our_reader_reads_layers_with_tails") {
        return;
    }
    let f = fixture();
    for b in [&f.t64, &f.t16] {
        let img = Image::open_with_devices(&b.meta, &b.devices()).unwrap();
        assert!(compare_image(&f.src, &img, true) > MANY);
        assert!(Image::open_with_devices(&b.meta, &[&b.blob]).is_err());
    }
}

/// The main blob holds whole 256 KiB chunks only, each used; every partial chunk is in the
/// tails blob; the device table and the stats describe both files.
#[test]
fn the_main_blob_holds_only_whole_chunks_and_the_tails_blob_the_rest() {
    if !require_root("the_main_blob_holds_only_whole_chunks_and_the_tails_blob_the_rest") {
        return;
    }
    let f = fixture();
    for (b, t) in [(&f.t64, T64K), (&f.t16, T16K)] {
        let s = &b.stats;
        let ts = s.tails.as_ref().expect("tails stats");
        assert_eq!(ts.chunk_size, t);
        assert_eq!(s.blob_bytes, std::fs::metadata(&b.blob).unwrap().len());
        assert_eq!(ts.bytes, std::fs::metadata(&b.tails).unwrap().len());
        assert_eq!(s.blob_blake3, blake3_of(&b.blob));
        assert_eq!(ts.blake3, blake3_of(&b.tails));
        assert_eq!(s.blob_bytes % CHUNK_SIZE, 0, "{s:?}");
        assert_eq!(s.stored_bytes, s.blob_bytes, "no padding in the main blob");
        assert!(ts.bytes % 4096 == 0, "{ts:?}");
        assert!(ts.stored_bytes <= ts.bytes);
        assert!(s.devices.is_empty() && s.dict_chunks == 0);
        let img = Image::open_with_devices(&b.meta, &b.devices()).unwrap();
        let dt = img.device_table();
        assert_eq!(dt.len(), 2);
        assert_eq!(dt[0].tag, s.blob_blake3_hex().into_bytes());
        assert_eq!(dt[1].tag, ts.blake3_hex().into_bytes());
        assert_eq!(u64::from(dt[0].blocks) * 4096, s.blob_bytes);
        assert_eq!(u64::from(dt[1].blocks) * 4096, ts.bytes);
        assert_eq!(
            u64::from(dt[1].mapped_blkaddr),
            u64::from(dt[0].mapped_blkaddr) + u64::from(dt[0].blocks)
        );
        let mut main_chunks = BTreeSet::new();
        let (mut main_idx, mut tail_idx) = (0u64, 0u64);
        for (path, ino) in regular_files(&img) {
            for e in img.data_map(&ino).unwrap() {
                match e.location {
                    Location::Device { device: 1, offset } => {
                        assert!(
                            offset % CHUNK_SIZE == 0 && e.len % CHUNK_SIZE == 0,
                            "{path}"
                        );
                        for c in 0..e.len / CHUNK_SIZE {
                            main_chunks.insert(offset / CHUNK_SIZE + c);
                        }
                        main_idx += e.len / CHUNK_SIZE;
                    }
                    Location::Device { device: 2, offset } => {
                        assert!(e.len < CHUNK_SIZE, "{path}: a full chunk in the tails blob");
                        assert_eq!(e.file_offset + e.len, ino.size, "{path}: not its tail");
                        assert!(offset + e.len <= ts.bytes);
                        tail_idx += 1;
                    }
                    Location::Hole => {}
                    other => panic!("{path}: {other:?}"),
                }
            }
        }
        assert_eq!(
            main_chunks,
            (0..s.blob_bytes / CHUNK_SIZE).collect(),
            "every main chunk is a file chunk"
        );
        // Indexes per name (`files` lists each hard link), stats per inode.
        assert!(main_idx >= s.chunks && tail_idx >= ts.chunks, "{s:?}");
        // Identical chunks are stored once, in both blobs.
        assert!(s.unique_chunks < s.chunks, "{s:?}");
        assert!(ts.unique_chunks < ts.chunks, "{ts:?}");
        let small = img.lookup("chunks/s1").unwrap();
        let again = img.lookup("chunks/s1_again").unwrap();
        assert_eq!(img.data_map(&small).unwrap(), img.data_map(&again).unwrap());
    }
}

#[test]
fn tails_builds_are_deterministic() {
    if !require_root("tails_builds_are_deterministic") {
        return;
    }
    let f = fixture();
    let out = tempfile::tempdir().unwrap();
    let b = build(&f.src, out.path(), "again", T64K, None);
    assert_eq!(b.stats, f.t64.stats);
    assert!(std::fs::read(&b.meta).unwrap() == std::fs::read(&f.t64.meta).unwrap());
    assert_eq!(blake3_of(&b.blob), blake3_of(&f.t64.blob));
    assert_eq!(blake3_of(&b.tails), blake3_of(&f.t64.tails));
    // Another T is another layout.
    assert_ne!(f.t16.stats.tails, f.t64.stats.tails);
}

/// Without any partial chunk the tails blob is one zero block (a valid device), and so is
/// the main blob without any whole chunk (only small files); both mount.
#[test]
fn a_tails_blob_is_never_empty_and_an_empty_main_blob_mounts() {
    if !require_root("a_tails_blob_is_never_empty_and_an_empty_main_blob_mounts") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole");
    std::fs::create_dir(&whole).unwrap();
    write(
        &whole.join("two_chunks"),
        &common::bytes(1, 2 * CHUNK_SIZE as usize),
    );
    write(&whole.join("empty"), b"");
    let small = dir.path().join("small");
    std::fs::create_dir(&small).unwrap();
    write(&small.join("a"), b"small");
    write(&small.join("b"), &common::bytes(2, 100_000));
    let w = build(&whole, dir.path(), "whole", T64K, None);
    let ts = w.stats.tails.clone().unwrap();
    assert_eq!(ts.bytes, 4096);
    assert_eq!((ts.chunks, ts.unique_chunks, ts.stored_bytes), (0, 0, 0));
    assert_eq!(std::fs::read(&w.tails).unwrap(), vec![0u8; 4096]);
    assert_eq!(ts.blake3, *blake3::hash(&[0u8; 4096]).as_bytes());
    assert_eq!(w.stats.blob_bytes, 2 * CHUNK_SIZE);
    let s = build(&small, dir.path(), "small", T16K, None);
    assert_eq!(s.stats.blob_bytes, 4096);
    assert_eq!(s.stats.chunks, 0);
    assert_eq!(std::fs::read(&s.blob).unwrap(), vec![0u8; 4096]);
    assert_eq!(s.stats.blob_blake3, *blake3::hash(&[0u8; 4096]).as_bytes());
    assert_eq!(s.stats.tails.as_ref().unwrap().chunks, 2);
    for (b, src) in [(&w, &whole), (&s, &small)] {
        let mnt = tempfile::tempdir().unwrap();
        let _guard = mount_erofs(&b.meta, &b.devices(), mnt.path());
        assert_eq!(compare_trees(src, mnt.path(), EXACT), 2);
    }
}

#[test]
fn bad_tails_options_are_refused_and_nothing_is_left_behind() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    write(&src.join("f"), b"data");
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let (meta, blob) = (out.join("meta"), out.join("blob"));
    for (path, t) in [
        (out.join("tails"), 3 << 12),
        (out.join("tails"), 2048),
        (out.join("tails"), 256 << 10),
        (out.join("tails"), 0),
        (blob.clone(), T64K),
    ] {
        let mut opts = LayerOptions::default();
        opts.tails = Some(TailsBlob::new(path, t));
        let e = build_layer(&src, &meta, &blob, &opts).unwrap_err();
        assert!(matches!(e, Error::UnsupportedInput { .. }), "{e}");
    }
    // A build that fails midway (the source is gone) removes its temporary files.
    let mut opts = LayerOptions::default();
    opts.tails = Some(TailsBlob::new(out.join("tails"), T64K));
    assert!(build_layer(&dir.path().join("missing"), &meta, &blob, &opts).is_err());
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
}

/// Small-file trees: `dirs` directories of small files (sizes 200..40,000 bytes) and a few
/// larger files with tails; `changed` small files (by index) get one byte flipped.
fn small_tree(root: &Path, changed: &[usize]) -> usize {
    let mut n = 0;
    for d in 0..12 {
        std::fs::create_dir_all(root.join(format!("d{d:02}"))).unwrap();
        for i in 0..(20 + d * 3) {
            let size = 200 + ((n * 7919 + d * 131) % 40_000);
            let mut data = common::bytes(1000 + n as u64, size);
            if changed.contains(&n) {
                data[size / 2] ^= 0x5a;
            }
            write(&root.join(format!("d{d:02}/f{i:03}")), &data);
            n += 1;
        }
        let big = common::bytes(50 + d as u64, CHUNK_SIZE as usize + 70_000 + d * 1000);
        write(&root.join(format!("d{d:02}/big")), &big);
    }
    n
}

/// A rebuild of a small-file layer with 5% of its small files changed (same sizes), deduped
/// against the previous version's main blob (256 KiB table) and tails blob (T table): the
/// tails blob's T chunks that hold no changed file are pointed at, tails spanning several
/// of them included; the layer mounts and matches. Without a tails blob the same rebuild
/// stores far more.
#[test]
fn a_rebuild_with_5_percent_of_small_files_changed_reuses_the_previous_tails_blob() {
    if !require_root(
        "a_rebuild_with_5_percent_of_small_files_changed_reuses_the_previous_tails_blob",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (v1, v2) = (dir.path().join("v1"), dir.path().join("v2"));
    let n = small_tree(&v1, &[]);
    let changed: Vec<usize> = (0..n).filter(|i| i % 20 == 7).collect();
    assert_eq!(small_tree(&v2, &changed), n);
    // The same rebuild without tails blobs (v1's blob in the dictionary), for comparison.
    let plain = {
        let out = dir.path().join("plain");
        std::fs::create_dir(&out).unwrap();
        let mut opts = LayerOptions::default();
        opts.build.fsync = false;
        let s1 = build_layer(&v1, &out.join("m1"), &out.join("b1"), &opts).unwrap();
        let mut dict = ChunkDictionary::new();
        let digests = chunk_digests(&out.join("b1"), CHUNK_SIZE);
        let tag = s1.blob_blake3_hex();
        dict.add_blob(tag.as_bytes(), s1.blob_bytes, CHUNK_SIZE, &digests)
            .unwrap();
        opts.dictionary = Some(Arc::new(dict));
        build_layer(&v2, &out.join("m2"), &out.join("b2"), &opts).unwrap()
    };
    eprintln!("without tails: v2 {plain:?}");
    for t in [T64K, T16K] {
        let out = dir.path().join(format!("t{t}"));
        std::fs::create_dir(&out).unwrap();
        let b1 = build(&v1, &out, "v1", t, None);
        let s1 = &b1.stats;
        let t1 = s1.tails.clone().unwrap();
        let mut dict = ChunkDictionary::new();
        let main_digests = chunk_digests(&b1.blob, CHUNK_SIZE);
        let tag = s1.blob_blake3_hex();
        assert_eq!(
            dict.add_blob(tag.as_bytes(), s1.blob_bytes, CHUNK_SIZE, &main_digests),
            Some(0)
        );
        let tails_digests = chunk_digests(&b1.tails, u64::from(t));
        let tag = t1.blake3_hex();
        assert_eq!(
            dict.add_blob(tag.as_bytes(), t1.bytes, u64::from(t), &tails_digests),
            Some(1)
        );
        // A tails table does not fit a 256 KiB size (and the other way round).
        assert_eq!(
            dict.add_blob(b"x", t1.bytes, CHUNK_SIZE, &tails_digests),
            None
        );
        let dict = Arc::new(dict);
        let b2 = build(&v2, &out, "v2", t, Some(&dict));
        let s2 = &b2.stats;
        let t2 = s2.tails.clone().unwrap();
        eprintln!("T = {t}: v1 {s1:?}\nv2 {s2:?}");
        // The big files' full chunks are all in v1's main blob.
        assert_eq!((s2.blob_bytes, s2.chunks), (4096, 0), "{s2:?}");
        // Most tails point into v1's tails blob: at most a fifth of v1's bytes stored again.
        assert!(
            t2.stored_bytes * 5 < t1.stored_bytes,
            "T = {t}: {t2:?} vs {t1:?}"
        );
        assert!(t2.chunks * 3 < t1.chunks, "{t2:?} vs {t1:?}");
        assert!(s2.dict_chunks >= 12 + t1.chunks * 2 / 3, "{s2:?}");
        assert_eq!(
            BTreeSet::from_iter(s2.devices.iter().copied()),
            BTreeSet::from([0, 1])
        );
        let dict_paths = [&b1.blob, &b1.tails];
        let mut devices: Vec<&Path> = vec![&b2.blob, &b2.tails];
        devices.extend(s2.devices.iter().map(|&i| dict_paths[i].as_path()));
        let img = Image::open_with_devices(&b2.meta, &devices).unwrap();
        let dt = img.device_table();
        assert_eq!(dt.len(), 4);
        assert_eq!(dt[1].tag, t2.blake3_hex().into_bytes());
        // Some tail longer than T points into v1's tails blob (a span of several T chunks).
        let old_tails = 3 + s2.devices.iter().position(|&i| i == 1).unwrap() as u16;
        let spans = regular_files(&img)
            .iter()
            .flat_map(|(_, ino)| img.data_map(ino).unwrap())
            .filter(|e| {
                matches!(e.location, Location::Device { device, .. } if device == old_tails)
                    && e.len > u64::from(t)
            })
            .count();
        assert!(
            spans > 10,
            "tails spanning several T chunks remapped: {spans}"
        );
        assert_eq!(compare_image(&v2, &img, true), n + 12 + 12);
        let mnt = tempfile::tempdir().unwrap();
        {
            let _guard = mount_erofs(&b2.meta, &devices, mnt.path());
            assert_eq!(compare_trees(&v2, mnt.path(), EXACT), n + 12 + 12);
        }
        fsck(Path::new("fsck.erofs"), &b2.meta, &devices, &[]);
        // Deterministic given the same dictionary.
        let again = build(&v2, &out, "v2again", t, Some(&dict));
        assert_eq!(again.stats, *s2);
        assert!(std::fs::read(&again.meta).unwrap() == std::fs::read(&b2.meta).unwrap());
        assert_eq!(blake3_of(&again.tails), blake3_of(&b2.tails));
    }
}

/// With a tails blob (device 2) a layer points into at most 30 dictionary blobs, so the
/// device table stays at 32 slots; without one, 31.
#[test]
fn with_tails_the_31st_dictionary_blob_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let data = common::bytes(7, CHUNK_SIZE as usize + 5000);
    write(&src.join("f"), &data);
    let mut dict = ChunkDictionary::new();
    for i in 0..MAX_DICT_DEVICES - 1 {
        let tag = format!("unrelated-{i}");
        assert!(dict
            .add_blob(tag.as_bytes(), 4096, 4096, &[[i as u8 + 1; 32]])
            .is_some());
    }
    let digest = *blake3::hash(&data[..CHUNK_SIZE as usize]).as_bytes();
    assert_eq!(
        dict.add_blob(b"last", CHUNK_SIZE, CHUNK_SIZE, &[digest]),
        Some(MAX_DICT_DEVICES - 1)
    );
    let dict = Arc::new(dict);
    let plain = {
        let mut opts = LayerOptions::default();
        opts.dictionary = Some(dict.clone());
        build_layer(&src, &dir.path().join("m"), &dir.path().join("b"), &opts).unwrap()
    };
    assert_eq!(plain.devices, vec![MAX_DICT_DEVICES - 1]);
    assert_eq!(plain.dict_chunks, 1);
    let b = build(&src, dir.path(), "t", T64K, Some(&dict));
    assert!(b.stats.devices.is_empty(), "{:?}", b.stats);
    assert_eq!(b.stats.blob_bytes, CHUNK_SIZE);
    let img = Image::open(&b.meta).unwrap();
    assert_eq!(img.device_table().len(), 2);
}
