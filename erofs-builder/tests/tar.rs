//! Tar input: archives made by GNU tar (gnu and posix formats, xattrs, long names, hard
//! links, sparse files; plain, gzip and zstd) are built into images and layers, mounted by
//! the kernel and compared with what GNU tar extracts from the same archive; OCI whiteouts
//! hide lower files under overlayfs; hostile archives (made byte by byte here) are refused
//! with the right error and leave nothing behind. Mount tests need root (SKIPPED otherwise).

mod common;

use std::fs;
use std::io::Cursor;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    chmod, collect, compare_trees, fsck, mknod, mount_erofs, require_root, run, setx, skip,
    xattrs_of, EXACT,
};
use erofs_builder::{
    build_image_from, build_layer_from, BuildOptions, Error, Image, LayerOptions, Phase, Progress,
    Source,
};

// ---------------------------------------------------------------------------------------
// Archives from GNU tar
// ---------------------------------------------------------------------------------------

const SPARSE_SIZE: u64 = 64 << 20;

/// A tree with what tar can carry: every type but sockets, big ids, nanosecond mtimes,
/// xattrs (user, trusted, security.capability), long names and link targets, hard links,
/// a sparse file.
fn make_src(root: &Path) {
    let p = |rel: &str| root.join(rel);
    let w = |rel: &str, data: &[u8]| fs::write(p(rel), data).unwrap();
    w("empty", b"");
    w("small.txt", b"hello, tar\n");
    w("exact4k", &common::bytes(1, 4096));
    w("three_blocks_and_tail", &common::bytes(2, 3 * 4096 + 123));
    w("large", &common::bytes(4, (1 << 20) + 17));
    w("zeros", &vec![0u8; 3 * 4096 + 5]);
    {
        let f = fs::File::create(p("sparse")).unwrap();
        f.set_len(SPARSE_SIZE).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"data", 40 << 20).unwrap();
        // More segments than a GNU header holds (4): extension blocks.
        for i in 0..9u64 {
            let at = 7000 + i * (3 << 20);
            std::os::unix::fs::FileExt::write_all_at(&f, &common::bytes(9 + i, 5000), at).unwrap();
        }
    }
    w("setuid", b"#!/bin/sh\n");
    chmod(&p("setuid"), 0o4755);
    w("ro", b"read only");
    chmod(&p("ro"), 0o400);
    fs::create_dir(p("sticky")).unwrap();
    chmod(&p("sticky"), 0o1777);
    w("big_ids", b"ids");
    std::os::unix::fs::lchown(p("big_ids"), Some(3_000_000), Some(4_000_000)).unwrap();
    w(
        std::str::from_utf8(&[b'L'; 255]).unwrap(),
        b"a 255-byte name (GNU L / PAX path)",
    );
    let mut deep = p("deep");
    for i in 0..12 {
        deep.push(format!("directory-level-{i:02}"));
    }
    fs::create_dir_all(&deep).unwrap();
    fs::write(deep.join("bottom"), b"bottom").unwrap();
    std::os::unix::fs::symlink("small.txt", p("link")).unwrap();
    std::os::unix::fs::symlink("t".repeat(300), p("long_link")).unwrap();
    fs::create_dir(p("sub")).unwrap();
    w("hl_a", b"hard linked content");
    fs::hard_link(p("hl_a"), p("sub/hl_b")).unwrap();
    fs::hard_link(p("hl_a"), p("sub/hl_c")).unwrap();
    mknod(&p("null"), rustix::fs::FileType::CharacterDevice, 1, 3);
    mknod(&p("sda1"), rustix::fs::FileType::BlockDevice, 8, 1);
    mknod(&p("fifo"), rustix::fs::FileType::Fifo, 0, 0);
    setx(&p("small.txt"), "user.mime", b"text/plain");
    setx(&p("sub"), "trusted.overlay.opaque", b"y");
    setx(&p("large"), "user.big", &common::bytes(6, 1500));
    let mut cap = Vec::new();
    for v in [0x0200_0001u32, 1 << 10, 0, 0, 0] {
        cap.extend_from_slice(&v.to_le_bytes());
    }
    setx(&p("setuid"), "security.capability", &cap);
    // Nanosecond mtimes everywhere (children first), before 1970 for one.
    let mut all = Vec::new();
    collect(root, &mut all);
    all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for (i, path) in all.iter().enumerate() {
        common::set_mtime(
            path,
            1_600_000_000 + i as i64,
            (i as i64 * 7919) % 1_000_000_000,
        );
    }
    common::set_mtime(&p("small.txt"), -86_400, 5);
    common::set_mtime(root, 1_700_000_000, 0);
}

/// `tar -c` of `src` in `format`; returns the archive path.
fn gnu_tar(src: &Path, out: &Path, format: &str, xattrs: bool) -> PathBuf {
    let mut cmd = Command::new("tar");
    cmd.arg(format!("--format={format}"))
        .args(["-S", "--numeric-owner", "-C"])
        .arg(src);
    if xattrs {
        cmd.args(["--xattrs", "--xattrs-include=*"]);
    }
    cmd.arg("-cf").arg(out).arg(".");
    let (ok, text) = run(&mut cmd);
    assert!(ok, "tar -c failed: {text}");
    out.to_path_buf()
}

fn compress(tar: &Path, tool: &str) -> PathBuf {
    let (ok, text) = run(Command::new(tool).args(["-q", "-k", "-f"]).arg(tar));
    assert!(ok, "{tool} failed: {text}");
    let ext = if tool == "gzip" { "gz" } else { "zst" };
    PathBuf::from(format!("{}.{ext}", tar.display()))
}

/// What GNU tar itself extracts (the reference).
fn extract(tar: &Path, dst: &Path) {
    fs::create_dir(dst).unwrap();
    let (ok, text) = run(Command::new("tar")
        .args([
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            "-S",
            "-xpf",
        ])
        .arg(tar)
        .arg("-C")
        .arg(dst));
    assert!(ok, "tar -x failed: {text}");
}

fn only_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn gnu_tar_archives_build_images_the_kernel_mounts_like_their_extraction() {
    if !require_root("gnu_tar_archives_build_images_the_kernel_mounts_like_their_extraction") {
        return;
    }
    if !tool_present("zstd") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir(&src).unwrap();
    make_src(&src);
    let gnu = gnu_tar(&src, &dir.path().join("gnu.tar"), "gnu", false);
    let pax = gnu_tar(&src, &dir.path().join("pax.tar"), "posix", true);
    let cases = [
        ("gnu plain", gnu.clone(), gnu),
        ("posix gzip", compress(&pax, "gzip"), pax.clone()),
        ("posix zstd", compress(&pax, "zstd"), pax.clone()),
    ];
    for (what, archive, plain) in cases {
        let out = dir.path().join(format!("out-{}", what.replace(' ', "-")));
        fs::create_dir(&out).unwrap();
        let image = out.join("img.erofs");
        let progress = Progress::new();
        let mut opts = BuildOptions::default();
        opts.progress = Some(progress.clone());
        let stats = build_image_from(Source::tar_file(&archive).unwrap(), &image, &opts)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        // The spool leaves nothing; a 64 MiB sparse file does not balloon the image.
        assert_eq!(only_files(&out), ["img.erofs"], "{what}");
        let allocated = fs::metadata(&image).unwrap().blocks() * 512;
        assert!(
            allocated < 8 << 20,
            "{what}: {allocated} bytes allocated, {stats:?}"
        );
        let snap = progress.snapshot();
        assert_eq!(snap.phase, Phase::Done);
        assert_eq!((snap.files, snap.bytes), (stats.files, stats.data_bytes));
        assert_eq!(
            (snap.total_files, snap.total_bytes),
            (stats.files, stats.data_bytes)
        );
        assert!(
            snap.scanned_entries > 30 && snap.scanned_bytes > 1 << 20,
            "{snap:?}"
        );
        fsck(Path::new("fsck.erofs"), &image, &[], &[]);

        let reference = out.join("extracted");
        extract(&plain, &reference);
        let mnt = out.join("mnt");
        fs::create_dir(&mnt).unwrap();
        let _m = mount_erofs(&image, &[], &mnt);
        let n = compare_trees(&reference, &mnt, EXACT);
        assert!(n > 30, "{what}: compared {n}");
        // What the archive says, independently of the extraction.
        let md = fs::metadata(mnt.join("big_ids")).unwrap();
        assert_eq!((md.uid(), md.gid()), (3_000_000, 4_000_000), "{what}");
        assert_eq!(fs::metadata(mnt.join("sparse")).unwrap().len(), SPARSE_SIZE);
        let (hl, b) = (mnt.join("hl_a"), mnt.join("sub/hl_b"));
        assert_eq!(
            fs::metadata(hl).unwrap().ino(),
            fs::metadata(b).unwrap().ino()
        );
        if what != "gnu plain" {
            let m = fs::symlink_metadata(mnt.join("small.txt")).unwrap();
            assert_eq!((m.mtime(), m.mtime_nsec()), (-86_400, 5), "{what}");
            assert!(xattrs_of(&mnt.join("setuid")).contains_key(&b"security.capability"[..]));
            assert_eq!(
                xattrs_of(&mnt.join("sub")).get(&b"trusted.overlay.opaque"[..]),
                Some(&b"y".to_vec())
            );
        }
    }
    // Reproducible: the same archive gives the same bytes.
    let a = dir.path().join("a.erofs");
    let b = dir.path().join("b.erofs");
    for img in [&a, &b] {
        build_image_from(
            Source::tar_file(&pax).unwrap(),
            img,
            &BuildOptions::default(),
        )
        .unwrap();
    }
    assert!(
        fs::read(&a).unwrap() == fs::read(&b).unwrap(),
        "not reproducible"
    );
}

#[test]
fn tar_layer_mounts_with_its_blob_device() {
    if !require_root("tar_layer_mounts_with_its_blob_device") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    fs::create_dir(&src).unwrap();
    make_src(&src);
    let pax = gnu_tar(&src, &dir.path().join("pax.tar"), "posix", true);
    let gz = compress(&pax, "gzip");
    let reference = dir.path().join("extracted");
    extract(&pax, &reference);
    // Every file in the blob, then small files inline in the meta image (their data copied
    // from the spool into their inode's block).
    for inline_max in [0, erofs_builder::layer::INLINE_MAX] {
        let out = dir.path().join(format!("out{inline_max}"));
        let spool_dir = dir.path().join(format!("spool{inline_max}"));
        fs::create_dir_all(&out).unwrap();
        fs::create_dir_all(&spool_dir).unwrap();
        let (meta, blob) = (out.join("meta.erofs"), out.join("blob"));
        let mut opts = LayerOptions::default();
        opts.build.tar.temp_dir = Some(spool_dir.clone());
        opts.inline_max = inline_max;
        let stats = build_layer_from(Source::tar_file(&gz).unwrap(), &meta, &blob, &opts).unwrap();
        assert_eq!(only_files(&out), ["blob", "meta.erofs"]);
        assert!(only_files(&spool_dir).is_empty());
        assert_eq!(stats.meta.inline_files > 0, inline_max > 0, "{stats:?}");
        // Holes stay holes in the blob: about 1 MiB of data, not 64 MiB.
        assert!(stats.blob_bytes < 4 << 20, "{stats:?}");
        fsck(Path::new("fsck.erofs"), &meta, &[&blob], &[]);
        let mnt = dir.path().join(format!("mnt{inline_max}"));
        fs::create_dir(&mnt).unwrap();
        let _m = mount_erofs(&meta, &[&blob], &mnt);
        assert!(compare_trees(&reference, &mnt, EXACT) > 30);
    }
}

fn tool_present(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
        || skip(&format!(
            "`{tool}` is not installed (apt-get install {tool})"
        ))
}

// ---------------------------------------------------------------------------------------
// Archives made byte by byte
// ---------------------------------------------------------------------------------------

/// A ustar header with a correct checksum (unless `bad_sum`).
fn header(name: &[u8], typeflag: u8, size: u64, link: &[u8]) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
    h[136..148].copy_from_slice(b"14000000000\0");
    h[156] = typeflag;
    h[157..157 + link.len()].copy_from_slice(link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    fix_checksum(&mut h);
    h
}

fn fix_checksum(h: &mut [u8; 512]) {
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

/// One member: header, data, padding.
fn member(name: &[u8], typeflag: u8, data: &[u8], link: &[u8]) -> Vec<u8> {
    let mut v = header(name, typeflag, data.len() as u64, link).to_vec();
    v.extend_from_slice(data);
    v.resize(v.len().next_multiple_of(512), 0);
    v
}

fn pax(records: &[(&str, &[u8])]) -> Vec<u8> {
    member(b"PaxHeader", b'x', &pax_data(records), b"")
}

/// A global (`g`) PAX header.
fn pax_global(records: &[(&str, &[u8])]) -> Vec<u8> {
    member(b"GlobalHead", b'g', &pax_data(records), b"")
}

/// PAX records: `LEN KEY=VALUE\n`, LEN counting itself.
fn pax_data(records: &[(&str, &[u8])]) -> Vec<u8> {
    let mut data = Vec::new();
    for (k, v) in records {
        let body = k.len() + v.len() + 3;
        let mut len = body + 1;
        while len != body + len.to_string().len() {
            len = body + len.to_string().len();
        }
        data.extend_from_slice(format!("{len} {k}=").as_bytes());
        data.extend_from_slice(v);
        data.push(b'\n');
    }
    data
}

fn end(mut v: Vec<u8>) -> Vec<u8> {
    v.extend_from_slice(&[0u8; 1024]);
    v
}

fn build_bytes(bytes: Vec<u8>, opts: &BuildOptions) -> (tempfile::TempDir, Result<u64, Error>) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("img.erofs");
    let r = build_image_from(Source::Tar(Box::new(Cursor::new(bytes))), &out, opts);
    let r = r.map(|s| s.inodes);
    if r.is_err() {
        assert!(
            only_files(dir.path()).is_empty(),
            "left behind: {:?}",
            only_files(dir.path())
        );
    }
    (dir, r)
}

fn refused(bytes: Vec<u8>) -> Error {
    refused_with(bytes, &BuildOptions::default())
}

fn refused_with(bytes: Vec<u8>, opts: &BuildOptions) -> Error {
    match build_bytes(bytes, opts).1 {
        Ok(n) => panic!("accepted ({n} inodes)"),
        Err(e) => e,
    }
}

#[test]
fn hostile_archives_are_refused_and_leave_nothing() {
    let file = |name: &[u8]| member(name, b'0', b"x", b"");
    // Climbing out.
    for name in [&b"../x"[..], b"a/../../x", b"./a/../b", b"/../etc/passwd"] {
        let e = refused(end(file(name)));
        assert!(
            matches!(&e, Error::UnsafeEntry { reason, .. } if reason.contains("..")),
            "{}: {e}",
            String::from_utf8_lossy(name)
        );
    }
    // A hard link outside the layer, or to an entry not yet seen.
    let e = refused(end(member(b"h", b'1', b"", b"../../etc/passwd")));
    assert!(matches!(e, Error::UnsafeEntry { .. }), "{e}");
    let mut v = member(b"h", b'1', b"", b"later");
    v.extend(file(b"later"));
    let e = refused(end(v));
    assert!(
        matches!(&e, Error::UnsafeEntry { entry, reason } if entry == "h" && reason.contains("earlier")),
        "{e}"
    );
    // A hard link to a directory.
    let mut v = member(b"d/", b'5', b"", b"");
    v.extend(member(b"h", b'1', b"", b"d"));
    assert!(matches!(refused(end(v)), Error::UnsafeEntry { .. }));
    // Writing through a symlinked parent (the classic escape).
    let mut v = member(b"evil", b'2', b"", b"/etc");
    v.extend(file(b"evil/passwd"));
    let e = refused(end(v));
    assert!(
        matches!(&e, Error::UnsafeEntry { entry, reason } if entry == "evil/passwd" && reason.contains("symlink")),
        "{e}"
    );
    // A bad header checksum.
    let mut h = header(b"f", b'0', 0, b"");
    h[0] = b'g';
    let e = refused(end(h.to_vec()));
    assert!(
        matches!(&e, Error::BadArchive { reason, .. } if reason.contains("checksum")),
        "{e}"
    );
    // Truncated: inside a header, inside data, inside padding.
    let whole = end(member(b"f", b'0', &[7u8; 1000], b""));
    for cut in [300, 700, 1200] {
        let e = refused(whole[..cut].to_vec());
        assert!(matches!(e, Error::Truncated { .. }), "cut {cut}: {e}");
    }
    // Truncated compressed streams too.
    for tool in ["gzip", "zstd"] {
        if !tool_present(tool) {
            continue;
        }
        let mut z = compress_bytes(tool, &whole);
        z.truncate(z.len() - 8);
        let e = refused(z);
        assert!(
            matches!(e, Error::Truncated { .. } | Error::Io { .. }),
            "{tool}: {e}"
        );
    }
    // Absurd sizes: beyond the file size limit (base-256 size field), and past the stream.
    let mut h = header(b"huge", b'0', 0, b"");
    h[124..136].copy_from_slice(&[0x80, 0, 0, 0, 0x40, 0, 0, 0, 0, 0, 0, 0]);
    fix_checksum(&mut h);
    let e = refused(end(h.to_vec()));
    assert!(
        matches!(&e, Error::LimitExceeded { entry, .. } if entry == "huge"),
        "{e}"
    );
    let mut opts = BuildOptions::default();
    opts.tar.max_file_size = 1 << 20;
    let e = refused_with(end(member(b"f", b'0', &[1u8; (1 << 20) + 1], b"")), &opts);
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e}");
    let mut h = header(b"f", b'0', 1 << 30, b"").to_vec();
    h.extend_from_slice(&[1u8; 4096]);
    assert!(matches!(refused(h), Error::Truncated { .. }));
    let e = refused(end(header(b"PaxHeader", b'x', 1 << 30, b"").to_vec()));
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e}");
    // Names: NUL (through PAX), a component over 255 bytes, too deep.
    let mut v = pax(&[("path", b"a\0b")]);
    v.extend(file(b"x"));
    let e = refused(end(v));
    assert!(
        matches!(&e, Error::UnsafeEntry { reason, .. } if reason.contains("NUL")),
        "{e}"
    );
    let mut v = pax(&[("path", &[b'n'; 256])]);
    v.extend(file(b"x"));
    assert!(matches!(refused(end(v)), Error::UnsafeEntry { .. }));
    let mut opts = BuildOptions::default();
    opts.tar.max_depth = 8;
    let e = refused_with(end(file(b"1/2/3/4/5/6/7/8/9")), &opts);
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e}");
    // A malformed PAX record, an unknown entry type, unsupported compression.
    let mut v = member(b"PaxHeader", b'x', b"99 path=x\n", b"");
    v.extend(file(b"x"));
    assert!(matches!(refused(end(v)), Error::BadArchive { .. }));
    assert!(matches!(
        refused(end(member(b"q", b'Q', b"", b""))),
        Error::BadArchive { .. }
    ));
    assert!(matches!(
        refused(b"BZh91AY&SY".to_vec()),
        Error::BadArchive { .. }
    ));
    // An extended header with no entry after it.
    assert!(matches!(
        refused(end(pax(&[("path", b"x")]))),
        Error::BadArchive { .. }
    ));
}

/// `data` compressed by the `gzip` or `zstd` command.
fn compress_bytes(tool: &str, data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new(tool)
        .arg("-c")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    child.wait_with_output().unwrap().stdout
}

#[test]
fn lenient_cases_are_accepted_as_documented() {
    // Leading "/" and "./" are dropped; no end-of-archive blocks is a clean end; a later
    // entry replaces an earlier one; implied directories get 0755 root 0:0 and the epoch.
    let mut v = member(b"/abs/file", b'0', b"one", b"");
    v.extend(member(b"./abs/file", b'0', b"second", b""));
    v.extend(member(b"other", b'0', b"x", b""));
    v.extend(member(b"other", b'5', b"", b""));
    v.extend(member(b".wh..wh.plnk", b'0', b"", b""));
    let mut opts = BuildOptions::default();
    opts.epoch = Some((1_234, 5));
    let (dir, r) = build_bytes(v, &opts);
    assert_eq!(r.unwrap(), 4, "root, abs, abs/file, other");
    let img = Image::open(&dir.path().join("img.erofs")).unwrap();
    let f = img.lookup("abs/file").unwrap();
    assert_eq!(img.read_data(&f).unwrap(), b"second");
    let d = img.lookup("abs").unwrap();
    assert_eq!(
        (d.mode, d.uid, d.gid, d.mtime, d.mtime_nsec),
        (0o40755, 0, 0, 1_234, 5)
    );
    assert_eq!(img.lookup("other").unwrap().mode & 0o170000, 0o040000);
    assert!(img.lookup(".wh..wh.plnk").is_err());
}

#[test]
fn pax_records_are_applied() {
    let mut v = member(b"GlobalHead", b'g', b"11 mtime=7\n", b"");
    let long = format!("{}/file", "d".repeat(200));
    v.extend(pax(&[
        ("path", long.as_bytes()),
        ("mtime", b"-1.25"),
        ("uid", b"5000000"),
        ("gid", b"7"),
        ("uname", b"ignored"),
        ("SCHILY.xattr.user.raw", b"r\0w"),
        ("LIBARCHIVE.xattr.user.a%3Db", b"aGVsbG8="),
    ]));
    v.extend(member(b"short", b'0', b"x", b""));
    // GNU sparse 0.1: a 1 MiB file with 3 bytes at 0 and 6 at the end.
    v.extend(pax(&[
        ("GNU.sparse.size", b"1048576"),
        ("GNU.sparse.map", b"0,3,1048570,6"),
        ("GNU.sparse.name", b"sp"),
    ]));
    v.extend(member(b"GNUSparseFile.1/sp", b'0', b"abcXXXXXX", b""));
    v.extend(member(b"plain", b'0', b"p", b""));
    let (dir, r) = build_bytes(end(v), &BuildOptions::default());
    r.unwrap();
    let img = Image::open(&dir.path().join("img.erofs")).unwrap();
    let f = img.lookup(&long).unwrap();
    assert_eq!(
        (f.uid, f.gid, f.mtime, f.mtime_nsec),
        (5_000_000, 7, -2, 750_000_000)
    );
    let mut x = img.xattrs(&f).unwrap();
    x.sort();
    assert_eq!(
        x,
        vec![
            (b"user.a=b".to_vec(), b"hello".to_vec()),
            (b"user.raw".to_vec(), b"r\0w".to_vec())
        ]
    );
    let sp = img.lookup("sp").unwrap();
    let data = img.read_data(&sp).unwrap();
    assert_eq!(data.len(), 1 << 20);
    assert_eq!(&data[..3], b"abc");
    assert_eq!(&data[(1 << 20) - 6..], b"XXXXXX");
    assert!(data[3..(1 << 20) - 6].iter().all(|&b| b == 0));
    // The global header's mtime applies to entries without their own.
    assert_eq!(img.lookup("plain").unwrap().mtime, 7);
}

#[test]
fn global_pax_records_merge_later_wins_and_entries_override() {
    // Many global records and entries (merged as read, not re-applied per entry).
    let mut v = Vec::new();
    for i in 0..200u32 {
        let recs: Vec<(String, Vec<u8>)> = (0..20u32)
            .map(|j| ("mtime".to_owned(), format!("{}", i * 20 + j).into_bytes()))
            .collect();
        let recs: Vec<(&str, &[u8])> = recs.iter().map(|(k, v)| (k.as_str(), &v[..])).collect();
        v.extend(pax_global(&recs));
        v.extend(member(format!("f{i:03}").as_bytes(), b'0', b"", b""));
    }
    // A later global header replaces what an earlier one set (SCHILY and LIBARCHIVE spellings
    // of one name: the later record wins); an entry's own records replace the global ones.
    v.extend(pax_global(&[
        ("uid", b"11"),
        ("mtime", b"7"),
        ("SCHILY.xattr.user.g", b"one"),
        ("SCHILY.xattr.user.o", b"schily"),
        ("LIBARCHIVE.xattr.user.o", b"bGli"),
    ]));
    v.extend(pax_global(&[
        ("mtime", b"9"),
        ("SCHILY.xattr.user.g", b"two"),
    ]));
    v.extend(member(b"a", b'0', b"", b""));
    v.extend(pax(&[("mtime", b"3"), ("SCHILY.xattr.user.g", b"own")]));
    v.extend(member(b"b", b'0', b"", b""));
    let (dir, r) = build_bytes(end(v), &BuildOptions::default());
    assert_eq!(r.unwrap(), 203, "root and 202 files");
    let img = Image::open(&dir.path().join("img.erofs")).unwrap();
    assert_eq!(img.lookup("f000").unwrap().mtime, 19);
    assert_eq!(img.lookup("f199").unwrap().mtime, 3999);
    assert!(img.xattrs(&img.lookup("f199").unwrap()).unwrap().is_empty());
    let xattrs = |name: &str| {
        let mut x = img.xattrs(&img.lookup(name).unwrap()).unwrap();
        x.sort();
        x
    };
    let (a, b) = (img.lookup("a").unwrap(), img.lookup("b").unwrap());
    assert_eq!((a.uid, a.mtime, b.uid, b.mtime), (11, 9, 11, 3));
    assert_eq!(
        xattrs("a"),
        vec![
            (b"user.g".to_vec(), b"two".to_vec()),
            (b"user.o".to_vec(), b"lib".to_vec())
        ]
    );
    assert_eq!(
        xattrs("b"),
        vec![
            (b"user.g".to_vec(), b"own".to_vec()),
            (b"user.o".to_vec(), b"lib".to_vec())
        ]
    );
}

#[test]
fn total_size_limit_refuses_huge_sparse_entries_and_leaves_nothing() {
    // Each entry: ~1 KiB of archive declaring a 1 GiB file that is all hole.
    let mut v = Vec::new();
    for i in 0..3 {
        v.extend(pax(&[
            ("GNU.sparse.size", b"1073741824"),
            ("GNU.sparse.name", format!("huge{i}").as_bytes()),
        ]));
        v.extend(member(
            format!("GNUSparseFile.0/huge{i}").as_bytes(),
            b'0',
            b"",
            b"",
        ));
    }
    let mut opts = BuildOptions::default();
    opts.tar.max_total_size = (5 << 30) / 2;
    let e = refused_with(end(v), &opts);
    assert!(
        matches!(&e, Error::LimitExceeded { entry, what, limit }
            if entry == "huge2" && what == "total size" && *limit == (5 << 30) / 2),
        "{e}"
    );
}

#[test]
fn whiteouts_become_overlay_whiteouts_that_hide_lower_files() {
    let mut v = member(b"dir/", b'5', b"", b"");
    v.extend(member(b"dir/.wh..wh..opq", b'0', b"", b""));
    v.extend(member(b"dir/kept", b'0', b"new", b""));
    v.extend(member(b".wh.gone", b'0', b"", b""));
    v.extend(member(b"plain", b'0', b"p", b""));
    let (dir, r) = build_bytes(end(v), &BuildOptions::default());
    r.unwrap();
    let image = dir.path().join("img.erofs");
    // Through our reader: a char device 0:0, an opaque directory.
    let img = Image::open(&image).unwrap();
    let w = img.lookup("gone").unwrap();
    assert_eq!((w.mode & 0o170000, w.rdev), (0o020000, (0, 0)));
    let d = img.lookup("dir").unwrap();
    assert_eq!(
        img.xattrs(&d).unwrap(),
        vec![(b"trusted.overlay.opaque".to_vec(), b"y".to_vec())]
    );
    if !require_root("whiteouts_become_overlay_whiteouts_that_hide_lower_files") {
        return;
    }
    fsck(Path::new("fsck.erofs"), &image, &[], &[]);
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    for d in ["layer", "lower", "lower/dir", "upper", "work", "merged"] {
        fs::create_dir(p(d)).unwrap();
    }
    fs::write(p("lower/gone"), b"lower").unwrap();
    fs::write(p("lower/dir/old"), b"lower").unwrap();
    fs::write(p("lower/stays"), b"lower").unwrap();
    let _layer = mount_erofs(&image, &[], &p("layer"));
    assert!(fs::symlink_metadata(p("layer/gone"))
        .unwrap()
        .file_type()
        .is_char_device());
    let data = format!(
        "lowerdir={}:{},upperdir={},workdir={}",
        p("layer").display(),
        p("lower").display(),
        p("upper").display(),
        p("work").display()
    );
    let _ovl = common::mount_overlay(&data, &p("merged"));
    assert!(!p("merged/gone").exists(), "whiteout did not hide");
    assert!(!p("merged/dir/old").exists(), "opaque dir did not hide");
    assert_eq!(fs::read(p("merged/dir/kept")).unwrap(), b"new");
    assert_eq!(fs::read(p("merged/stays")).unwrap(), b"lower");
    assert_eq!(fs::read(p("merged/plain")).unwrap(), b"p");
}

/// `Source::TarStack`: layers merged as overlayfs would stack them (see `docs/format.md`).
#[test]
fn tar_stack_merges_with_overlay_semantics() {
    let mut dir_entry = header(b"etc/", b'5', 0, b"");
    dir_entry[100..108].copy_from_slice(b"0000700\0");
    fix_checksum(&mut dir_entry);
    let lower = end([
        dir_entry.to_vec(),
        member(b"etc/passwd", b'0', b"root", b""),
        member(b"etc/shadow", b'0', b"secret", b""),
        member(b"etc/hosts", b'1', b"", b"etc/passwd"),
        member(b"var/cache/a", b'0', b"a", b""),
        member(b"var/cache/sub/b", b'0', b"b", b""),
        member(b"file-then-dir", b'0', b"f", b""),
        member(b"dir-then-file/x", b'0', b"x", b""),
    ]
    .concat());
    let upper = end([
        // etc/ only implied here: its 0700 mode from below stays.
        member(b"etc/.wh.passwd", b'0', b"", b""),
        member(b"etc/new", b'0', b"new", b""),
        member(b"var/cache/.wh..wh..opq", b'0', b"", b""),
        member(b"var/cache/c", b'0', b"c", b""),
        member(b"file-then-dir/y", b'0', b"y", b""),
        member(b"dir-then-file", b'0', b"now a file", b""),
        member(b".wh.nothing-below", b'0', b"", b""),
    ]
    .concat());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("img.erofs");
    let src = Source::TarStack(vec![
        Box::new(Cursor::new(lower)) as Box<dyn std::io::Read + Send>,
        Box::new(Cursor::new(upper)),
    ]);
    build_image_from(src, &out, &BuildOptions::default()).unwrap();
    let img = Image::open(&out).unwrap();
    let etc = img.lookup("etc").unwrap();
    assert_eq!(
        etc.mode & 0o7777,
        0o700,
        "an implied directory keeps the lower's mode"
    );
    assert!(img.lookup("etc/passwd").is_err(), "whited out");
    let hosts = img.lookup("etc/hosts").unwrap();
    assert_eq!(
        hosts.nlink, 1,
        "the other name of the hard link stays, alone"
    );
    assert_eq!(img.read_data(&hosts).unwrap(), b"root");
    assert_eq!(
        img.read_data(&img.lookup("etc/new").unwrap()).unwrap(),
        b"new"
    );
    assert!(img.lookup("var/cache/a").is_err() && img.lookup("var/cache/sub").is_err());
    assert_eq!(
        img.read_data(&img.lookup("var/cache/c").unwrap()).unwrap(),
        b"c"
    );
    assert!(img
        .xattrs(&img.lookup("var/cache").unwrap())
        .unwrap()
        .is_empty());
    assert_eq!(
        img.lookup("file-then-dir").unwrap().file_type,
        erofs_builder::FileType::Directory
    );
    let f = img.lookup("dir-then-file").unwrap();
    assert_eq!(img.read_data(&f).unwrap(), b"now a file");
    assert!(img.lookup("nothing-below").is_err(), "no whiteout is left");
}
