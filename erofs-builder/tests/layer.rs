//! Lazy layers (meta image + data blob, chunk-based files): build from a generated tree,
//! then check with the kernel (file-backed mount(2) with `device=BLOB`), `fsck.erofs
//! --device=BLOB`, and our reader; exact blob layout and dedupe on a small tree;
//! determinism. Needs root for the tree (prints SKIPPED otherwise; fails under CI=true).

mod common;

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{
    compare_image, compare_trees, fsck, make_tree, mount_erofs, require_root, run, write, EXACT,
    FSCK15_EXTRACT,
};
use erofs_builder::layer::CHUNK_SIZE;
use erofs_builder::{build_layer, Image, LayerOptions, LayerStats};

const MANY: usize = 500;
const BIG: u64 = 5 << 30;
const BIG_MARK: u64 = (3 << 30) + 5;

struct Fixture {
    dir: tempfile::TempDir,
    src: PathBuf,
    meta: PathBuf,
    blob: PathBuf,
    stats: LayerStats,
}

/// Files that exercise chunks: several chunks with a tail, repeated chunks, a zero chunk
/// written out, a 5 GiB sparse file with 4 bytes of data, an exact chunk, small files.
fn add_layer_files(d: &Path) {
    std::fs::create_dir(d).unwrap();
    let a = common::bytes(10, CHUNK_SIZE as usize);
    let b = common::bytes(11, CHUNK_SIZE as usize);
    write(
        &d.join("multi"),
        &common::bytes(12, 4 * CHUNK_SIZE as usize + 1000),
    );
    write(&d.join("repeat"), &[&a[..], &b, &a, &a].concat());
    write(&d.join("exact_chunk"), &a);
    write(
        &d.join("zero_middle"),
        &[&b[..], &vec![0u8; CHUNK_SIZE as usize], b"tail"].concat(),
    );
    let f = File::create(d.join("sparse5g")).unwrap();
    f.set_len(BIG).unwrap();
    f.write_all_at(b"EROF", BIG_MARK).unwrap();
    write(&d.join("empty"), b"");
    write(&d.join("s1"), b"abc");
    write(&d.join("s2"), &common::bytes(13, 5000));
    write(&d.join("s3_same_as_s1"), b"abc");
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        make_tree(&src, true, MANY);
        add_layer_files(&src.join("chunks"));
        // Keep the build time make_tree set (adding "chunks" touched the root), and give some
        // chunk files that time too, so chunk-based inodes come in both forms.
        for name in ["multi", "repeat", "s1", "sparse5g"] {
            common::set_mtime(&src.join("chunks").join(name), 1_700_000_000, 0);
        }
        common::set_mtime(&src, 1_700_000_000, 0);
        let (meta, blob) = (dir.path().join("meta.erofs"), dir.path().join("blob"));
        let stats = build_layer(&src, &meta, &blob, &LayerOptions::default()).unwrap();
        eprintln!("built layer: {stats:?}");
        Fixture {
            dir,
            src,
            meta,
            blob,
            stats,
        }
    })
}

fn blake3_of(p: &Path) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update_reader(File::open(p).unwrap()).unwrap();
    *h.finalize().as_bytes()
}

#[test]
fn layer_meta_and_blob_are_consistent() {
    if !require_root("layer_meta_and_blob_are_consistent") {
        return;
    }
    let f = fixture();
    let s = &f.stats;
    assert_eq!(s.blob_bytes, std::fs::metadata(&f.blob).unwrap().len());
    assert_eq!(
        s.meta.image_bytes,
        std::fs::metadata(&f.meta).unwrap().len()
    );
    assert_eq!(s.blob_blake3, blake3_of(&f.blob));
    let img = Image::open(&f.meta).unwrap();
    let dt = img.device_table();
    assert_eq!(dt.len(), 1);
    assert_eq!(dt[0].tag, s.blob_blake3_hex().into_bytes());
    assert_eq!(u64::from(dt[0].blocks) * 4096, s.blob_bytes);
    assert_eq!(u64::from(dt[0].mapped_blkaddr) * 4096, s.meta.image_bytes);
    // No file data in the meta image: it is far smaller than the data.
    assert!(s.meta.image_bytes < 4 << 20, "meta {}", s.meta.image_bytes);
    // The 5 GiB sparse file costs one chunk in the blob, not 5 GiB.
    assert!(s.blob_bytes < 16 << 20, "blob {}", s.blob_bytes);
    let alloc = std::fs::metadata(&f.blob).unwrap().blocks() * 512;
    assert!(alloc <= s.blob_bytes, "blob allocates {alloc}");
    // Chunk-based inodes in both forms (compact: i_u holds the chunk format).
    for (path, extended) in [
        ("chunks/multi", false),
        ("chunks/s2", true),
        ("chunks/sparse5g", true),
    ] {
        let ino = img.lookup(path).unwrap();
        assert_eq!(
            ino.datalayout,
            erofs_builder::ondisk::DATALAYOUT_CHUNK_BASED
        );
        assert_eq!(ino.extended, extended, "{path}");
    }
    assert_eq!(img.lookup("chunks/empty").unwrap().datalayout, 0);
}

#[test]
fn kernel_mounts_layer_with_blob_device_and_it_matches_the_source() {
    if !require_root("kernel_mounts_layer_with_blob_device_and_it_matches_the_source") {
        return;
    }
    let f = fixture();
    let mnt = tempfile::tempdir().unwrap();
    let _guard = mount_erofs(&f.meta, &[&f.blob], mnt.path());
    let n = compare_trees(&f.src, mnt.path(), EXACT);
    assert!(n > MANY, "compared {n} entries");
    let big = File::open(mnt.path().join("chunks/sparse5g")).unwrap();
    assert_eq!(big.metadata().unwrap().len(), BIG);
    let mut mark = [0u8; 4];
    big.read_exact_at(&mut mark, BIG_MARK).unwrap();
    assert_eq!(&mark, b"EROF");
}

#[test]
fn kernel_mounts_meta_and_blob_concatenated_without_device() {
    if !require_root("kernel_mounts_meta_and_blob_concatenated_without_device") {
        return;
    }
    // mapped_blkaddr = meta blocks: meta ‖ blob is a valid single-file image (flat
    // addressing), for the kernel and for our reader.
    let f = fixture();
    let flat = f.dir.path().join("flat.erofs");
    {
        let mut out = File::create(&flat).unwrap();
        std::io::copy(&mut File::open(&f.meta).unwrap(), &mut out).unwrap();
        std::io::copy(&mut File::open(&f.blob).unwrap(), &mut out).unwrap();
    }
    let img = Image::open(&flat).unwrap();
    let ino = img.lookup("chunks/repeat").unwrap();
    assert!(common::image_file_equal(
        &img,
        &ino,
        &f.src.join("chunks/repeat")
    ));
    let mnt = tempfile::tempdir().unwrap();
    let _guard = mount_erofs(&flat, &[], mnt.path());
    let n = compare_trees(&f.src, mnt.path(), EXACT);
    assert!(n > MANY, "compared {n} entries");
}

#[test]
fn fsck_erofs_accepts_layer_with_device() {
    if !require_root("fsck_erofs_accepts_layer_with_device") {
        return;
    }
    let f = fixture();
    fsck(Path::new("fsck.erofs"), &f.meta, &[&f.blob], &[]);
    // fsck.erofs 1.5 --extract drops hole chunks (NULL_ADDR) instead of seeking over them
    // (mkfs.erofs 1.5 never writes them), so extraction is compared on a tree without holes.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    make_tree(&src, true, MANY);
    std::fs::remove_file(src.join("sparse")).unwrap();
    add_layer_files(&src.join("chunks"));
    std::fs::remove_file(src.join("chunks/sparse5g")).unwrap();
    std::fs::remove_file(src.join("chunks/zero_middle")).unwrap();
    let (meta, blob) = (dir.path().join("meta"), dir.path().join("blob"));
    let stats = build_layer(&src, &meta, &blob, &LayerOptions::default()).unwrap();
    assert_eq!(stats.hole_chunks, 0);
    fsck(Path::new("fsck.erofs"), &meta, &[&blob], &[]);
    let dst = dir.path().join("x");
    fsck(
        Path::new("fsck.erofs"),
        &meta,
        &[&blob],
        &[format!("--extract={}", dst.display())],
    );
    let n = compare_trees(&src, &dst, FSCK15_EXTRACT);
    assert!(n > MANY, "compared {n} entries");
}

#[test]
fn our_reader_reads_layer_with_blob() {
    if !require_root("our_reader_reads_layer_with_blob") {
        return;
    }
    let f = fixture();
    let img = Image::open_with_devices(&f.meta, &[&f.blob]).unwrap();
    let n = compare_image(&f.src, &img, true);
    assert!(n > MANY, "compared {n} entries");
    // The device count must match, as for the kernel.
    assert!(Image::open_with_devices(&f.meta, &[]).is_err());
    assert!(Image::open_with_devices(&f.meta, &[&f.blob, &f.blob]).is_err());
}

#[test]
fn layer_build_is_deterministic() {
    if !require_root("layer_build_is_deterministic") {
        return;
    }
    let f = fixture();
    let out = tempfile::tempdir().unwrap();
    let (meta, blob) = (out.path().join("m"), out.path().join("b"));
    let stats = build_layer(&f.src, &meta, &blob, &LayerOptions::default()).unwrap();
    assert_eq!(stats, f.stats);
    assert!(std::fs::read(&meta).unwrap() == std::fs::read(&f.meta).unwrap());
    assert_eq!(blake3_of(&blob), blake3_of(&f.blob));
}

/// A small tree whose blob layout is known exactly.
#[test]
fn dedupe_holes_and_placement_give_the_expected_blob() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let cs = CHUNK_SIZE as usize;
    let (a, b) = (common::bytes(1, cs), common::bytes(2, cs));
    let t1 = common::bytes(3, 1000);
    write(&src.join("a_multi"), &[&a[..], &b, &t1].concat());
    write(&src.join("b_repeat"), &[&a[..], &b, &a, &a].concat());
    write(&src.join("c_small"), b"abc");
    write(&src.join("d_small_dup"), b"abc");
    write(&src.join("e_zero"), &[&vec![0u8; cs][..], b"abc"].concat());
    let sp = File::create(src.join("f_sparse")).unwrap();
    sp.set_len(1 << 30).unwrap();
    sp.write_all_at(b"data", (512 << 20) + 5).unwrap();
    write(&src.join("g_empty"), b"");

    let (meta, blob) = (dir.path().join("meta"), dir.path().join("blob"));
    let mut opts = LayerOptions::default();
    opts.tag = Some(b"my-tag".to_vec());
    let s = build_layer(&src, &meta, &blob, &opts).unwrap();
    // Blocks: A 0..64, B 64..128, tail of a_multi 128, "abc" 129, the sparse file's chunk
    // aligned at 192..256 (gap 130..192 left for later partial chunks).
    assert_eq!(s.unique_chunks, 5);
    assert_eq!(s.chunks, 3 + 4 + 1 + 1 + 1 + 1);
    assert_eq!(s.hole_chunks, 1 + 4095);
    assert_eq!(s.stored_bytes, (3 * 64 + 2) * 4096);
    assert_eq!(s.blob_bytes, 256 * 4096);
    assert_eq!(s.meta.files, 7);
    let bytes = std::fs::read(&blob).unwrap();
    assert_eq!(&bytes[..cs], &a[..]);
    assert_eq!(&bytes[cs..2 * cs], &b[..]);
    assert_eq!(&bytes[128 * 4096..128 * 4096 + 1000], &t1[..]);
    assert_eq!(&bytes[129 * 4096..129 * 4096 + 3], b"abc");
    assert_eq!(&bytes[192 * 4096 + 5..192 * 4096 + 9], b"data");

    let img = Image::open_with_devices(&meta, &[&blob]).unwrap();
    assert_eq!(img.device_table()[0].tag, b"my-tag");
    assert_eq!(compare_image(&src, &img, true), 7);
    // Where the files' runs in the blob end: b_repeat's A,B then A, A (cs, 2cs), a_multi's
    // A,B,tail (2cs + 1000), "abc" (block 129 + 3, three files), the sparse file's chunk.
    let cs64 = cs as u64;
    let ends = vec![cs64, 2 * cs64, 2 * cs64 + 1000, 129 * 4096 + 3, 256 * 4096];
    assert_eq!(
        erofs_builder::reader::device_run_ends(&img, usize::MAX),
        vec![ends.clone()]
    );
    // Bounded: a walk that stops early finds fewer ends, never others.
    let some = erofs_builder::reader::device_run_ends(&img, 2);
    assert!(some[0].len() < 5 && some[0].iter().all(|e| ends.contains(e)));
    // Without the blob (and not concatenated) the data is unreachable: an error, no panic.
    let alone = Image::open(&meta).unwrap();
    let ino = alone.lookup("a_multi").unwrap();
    assert!(alone.read_data(&ino).is_err());
}

#[test]
fn our_reader_reads_a_mkfs_erofs_chunked_layer() {
    if !require_root("our_reader_reads_a_mkfs_erofs_chunked_layer") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    add_layer_files(&src.join("chunks"));
    // Drop the 5 GiB file: mkfs.erofs 1.5 would read all of it.
    std::fs::remove_file(src.join("chunks/sparse5g")).unwrap();
    let (meta, blob) = (dir.path().join("meta"), dir.path().join("blob"));
    let (ok, text) = run(Command::new("mkfs.erofs")
        .arg(format!("--chunksize={CHUNK_SIZE}"))
        .arg(format!("--blobdev={}", blob.display()))
        .arg(&meta)
        .arg(&src));
    assert!(ok, "mkfs.erofs failed:\n{text}");
    let img = Image::open_with_devices(&meta, &[&blob]).unwrap();
    assert_eq!(compare_image(&src, &img, false), 9);
}

#[test]
fn reader_never_panics_on_mutated_layers() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    let cs = CHUNK_SIZE as usize;
    write(&src.join("a"), &common::bytes(1, cs + 100));
    write(&src.join("d/b"), b"bbbb");
    let sp = File::create(src.join("d/sparse")).unwrap();
    sp.set_len(4 * CHUNK_SIZE).unwrap();
    sp.write_all_at(b"x", 2 * CHUNK_SIZE).unwrap();
    let (meta, blob) = (dir.path().join("meta"), dir.path().join("blob"));
    let mut opts = LayerOptions::default();
    opts.build.checksum = false;
    build_layer(&src, &meta, &blob, &opts).unwrap();
    // meta ‖ blob: flat addressing makes the chunk data reachable from one buffer.
    let mut base = std::fs::read(&meta).unwrap();
    base.extend_from_slice(&std::fs::read(&blob).unwrap());
    let img = Image::from_bytes(base.clone()).unwrap();
    assert_eq!(compare_image(&src, &img, false), 4);
    erofs_builder::reader::fuzz_read_all(&base);
    let mut rng = 0x0bad_5eed_1234_5678u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let meta_len = std::fs::metadata(&meta).unwrap().len() as usize;
    for _ in 0..3000 {
        let mut m = base.clone();
        for _ in 0..(1 + next() % 8) {
            let at = (next() as usize) % meta_len;
            m[at] = next() as u8;
        }
        erofs_builder::reader::fuzz_read_all(&m);
    }
    for cut in [1152, 1200, 1280, 4096, meta_len, base.len() - 1] {
        erofs_builder::reader::fuzz_read_all(&base[..cut.min(base.len())]);
    }
}

/// The blake3 of each 256 KiB chunk of `blob` (what a store's chunk table holds).
fn chunk_digests(blob: &Path) -> Vec<[u8; 32]> {
    std::fs::read(blob)
        .unwrap()
        .chunks(CHUNK_SIZE as usize)
        .map(|c| *blake3::hash(c).as_bytes())
        .collect()
}

#[test]
fn a_layer_deduped_against_stored_blobs_points_into_them_and_reads_exactly() {
    if !require_root("a_layer_deduped_against_stored_blobs_points_into_them_and_reads_exactly") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Version 1: multi-chunk files, small files.
    let v1 = dir.path().join("v1");
    std::fs::create_dir(&v1).unwrap();
    for i in 0..6u64 {
        write(
            &v1.join(format!("big{i}")),
            &common::bytes(100 + i, 3 * CHUNK_SIZE as usize + 777),
        );
    }
    write(&v1.join("small"), b"v1 small");
    // Many small files (packed tails): 80 of 5000 bytes, 2 blocks each, about 2.5 chunks.
    std::fs::create_dir(v1.join("many")).unwrap();
    for i in 0..80u64 {
        write(
            &v1.join(format!("many/s{i:02}")),
            &common::bytes(2000 + i, 5000),
        );
    }
    let (m1, b1) = (dir.path().join("m1"), dir.path().join("b1"));
    let s1 = build_layer(&v1, &m1, &b1, &LayerOptions::default()).unwrap();
    // An unrelated blob in the dictionary too (nothing of it is used).
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    write(
        &other.join("x"),
        &common::bytes(999, 2 * CHUNK_SIZE as usize),
    );
    let (mo, bo) = (dir.path().join("mo"), dir.path().join("bo"));
    let so = build_layer(&other, &mo, &bo, &LayerOptions::default()).unwrap();
    // Version 2: one chunk of big2 changed, small changed (same size), a new file last.
    let v2 = dir.path().join("v2");
    std::fs::create_dir(&v2).unwrap();
    for i in 0..6u64 {
        let mut data = common::bytes(100 + i, 3 * CHUNK_SIZE as usize + 777);
        if i == 2 {
            data[CHUNK_SIZE as usize + 5] ^= 0xff;
        }
        write(&v2.join(format!("big{i}")), &data);
    }
    write(
        &v2.join("new"),
        &common::bytes(500, 2 * CHUNK_SIZE as usize),
    );
    write(&v2.join("small"), b"v2 small");
    // The small files again, one changed (same size): the packed chunks not holding it are
    // pointed at in v1's blob by the second pass.
    std::fs::create_dir(v2.join("many")).unwrap();
    for i in 0..80u64 {
        let mut d = common::bytes(2000 + i, 5000);
        if i == 70 {
            d[10] ^= 1;
        }
        write(&v2.join(format!("many/s{i:02}")), &d);
    }
    write(
        &v2.join("many/zz_new"),
        &common::bytes(500, 2 * CHUNK_SIZE as usize),
    );
    let mut dict = erofs_builder::ChunkDictionary::new();
    assert_eq!(
        dict.add_blob(
            so.blob_blake3_hex().as_bytes(),
            so.blob_bytes,
            CHUNK_SIZE,
            &chunk_digests(&bo)
        ),
        Some(0)
    );
    assert_eq!(
        dict.add_blob(
            s1.blob_blake3_hex().as_bytes(),
            s1.blob_bytes,
            CHUNK_SIZE,
            &chunk_digests(&b1)
        ),
        Some(1)
    );
    // Not a layer blob: refused.
    assert_eq!(dict.add_blob(b"x", 4097, CHUNK_SIZE, &[[0; 32]; 2]), None);
    assert_eq!(dict.add_blob(b"x", 4096, CHUNK_SIZE, &[]), None);
    let mut opts = LayerOptions::default();
    opts.dictionary = Some(std::sync::Arc::new(dict));
    let (m2, b2) = (dir.path().join("m2"), dir.path().join("b2"));
    let s2 = build_layer(&v2, &m2, &b2, &opts).unwrap();
    // 6 files × 3 full chunks, one changed: 17 point into v1's blob; so do the tails in
    // v1's packed chunks that v2 packs the same way (all but those sharing a chunk with
    // `small` or `s70`); the new file's 2 chunks, the changed ones and the rest are stored.
    assert!(s2.dict_chunks >= 17 + 30, "{s2:?}");
    assert!(s2.dict_chunks < 17 + 80, "{s2:?}");
    assert_eq!(s2.devices, vec![1], "only v1's blob is a device");
    assert!(
        s2.stored_bytes <= 4 * CHUNK_SIZE + 40 * 8192,
        "the tails pointed at are not stored: {s2:?}"
    );
    // Without the dictionary: everything stored.
    let (mn, bn) = (dir.path().join("mn"), dir.path().join("bn"));
    let sn = build_layer(&v2, &mn, &bn, &LayerOptions::default()).unwrap();
    assert!(
        sn.stored_bytes > s2.stored_bytes + 17 * CHUNK_SIZE,
        "{sn:?}"
    );
    let img = Image::open(&m2).unwrap();
    let dt = img.device_table();
    assert_eq!(dt.len(), 2);
    assert_eq!(dt[1].tag, s1.blob_blake3_hex().into_bytes());
    assert_eq!(u64::from(dt[1].blocks) * 4096, s1.blob_bytes);
    // The kernel, fsck.erofs and our reader, with both devices in table order.
    let mnt = tempfile::tempdir().unwrap();
    {
        let _guard = mount_erofs(&m2, &[&b2, &b1], mnt.path());
        let n = compare_trees(&v2, mnt.path(), EXACT);
        assert_eq!(n, 90, "compared {n} entries");
    }
    fsck(Path::new("fsck.erofs"), &m2, &[&b2, &b1], &[]);
    let reader = Image::open_with_devices(&m2, &[&b2, &b1]).unwrap();
    compare_image(&v2, &reader, true);
    assert!(Image::open_with_devices(&m2, &[&b2]).is_err());
    // Deterministic given the same dictionary.
    let (m3, b3) = (dir.path().join("m3"), dir.path().join("b3"));
    let s3 = build_layer(&v2, &m3, &b3, &opts).unwrap();
    assert_eq!(s3, s2);
    assert!(std::fs::read(&m3).unwrap() == std::fs::read(&m2).unwrap());
}

/// `LayerOptions::first`: the named files' data comes first, their tails packed together, so
/// the chunks they occupy are few and at the blob's start; the layer still reads exactly
/// (kernel, fsck.erofs) and the other files are laid out as before.
#[test]
fn files_laid_out_first_occupy_the_first_chunks_and_the_layer_reads_exactly() {
    if !require_root("files_laid_out_first_occupy_the_first_chunks_and_the_layer_reads_exactly") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let mut x = 0x2545_f491u32;
    let mut bytes = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    };
    let mut files = Vec::new();
    for d in 0..10 {
        std::fs::create_dir_all(src.join(format!("d{d}"))).unwrap();
        for i in 0..50 {
            let rel = format!("d{d}/f{i:02}");
            write(&src.join(&rel), &bytes(3000 + (i * 331 + d * 97) % 17000));
            files.push(rel);
        }
    }
    write(
        &src.join("d5/big"),
        &bytes((CHUNK_SIZE * 3 + 5000) as usize),
    );
    // Every 10th small file, the big one, and names that are not files with data.
    let mut first: Vec<PathBuf> = files.iter().step_by(10).map(PathBuf::from).collect();
    first.push("d5/big".into());
    first.extend(["nope", "d3", "/d1/missing"].map(PathBuf::from));
    let chunks_of = |img: &Image, rels: &[PathBuf]| -> std::collections::BTreeSet<u64> {
        let mut out = std::collections::BTreeSet::new();
        for r in rels {
            let Ok(ino) = img.lookup(&r.to_string_lossy()) else {
                continue;
            };
            if ino.file_type != erofs_builder::FileType::Regular {
                continue;
            }
            for e in img.data_map(&ino).unwrap() {
                if let erofs_builder::Location::Device { device: 1, offset } = e.location {
                    for c in offset / CHUNK_SIZE..=(offset + e.len - 1) / CHUNK_SIZE {
                        out.insert(c);
                    }
                }
            }
        }
        out
    };
    let small: Vec<PathBuf> = first[..50].to_vec();
    let build = |name: &str, first: Vec<PathBuf>| {
        let (meta, blob) = (
            dir.path().join(format!("{name}.meta")),
            dir.path().join(format!("{name}.blob")),
        );
        let mut opts = LayerOptions::default();
        opts.first = first;
        build_layer(&src, &meta, &blob, &opts).unwrap();
        let img = Image::open_with_devices(&meta, &[&blob]).unwrap();
        (meta, blob, img)
    };
    let (_, _, plain) = build("plain", Vec::new());
    let (meta, blob, ordered) = build("ordered", first.clone());
    // The 50 early small files (3-20 KB each) fill the first chunks, in one run.
    let tail_bytes: u64 = small
        .iter()
        .map(|r| {
            std::fs::metadata(src.join(r))
                .unwrap()
                .len()
                .next_multiple_of(4096)
        })
        .sum();
    let run_chunks = tail_bytes.div_ceil(CHUNK_SIZE);
    let got = chunks_of(&ordered, &small);
    assert_eq!(
        got,
        (0..run_chunks).collect(),
        "the early small files fill the first {run_chunks} chunks"
    );
    let before = chunks_of(&plain, &small);
    assert!(
        before.len() as u64 > 2 * run_chunks,
        "without the order they spread over {} chunks",
        before.len()
    );
    // The big file's tail is in the run, its three full chunks right after it.
    let big = chunks_of(&ordered, &[PathBuf::from("d5/big")]);
    let full: Vec<u64> = big.range(run_chunks..).copied().collect();
    assert_eq!(
        full,
        (run_chunks..run_chunks + 3).collect::<Vec<_>>(),
        "{big:?}"
    );
    assert_eq!(big.len(), 4, "{big:?}");
    let n = compare_image(&src, &ordered, true);
    assert!(n > 500, "compared {n} entries");
    let mnt = tempfile::tempdir().unwrap();
    let _guard = mount_erofs(&meta, &[&blob], mnt.path());
    assert!(compare_trees(&src, mnt.path(), EXACT) > 500);
    fsck(Path::new("fsck.erofs"), &meta, &[&blob], &[]);
}
