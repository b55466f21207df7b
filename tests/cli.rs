//! The `strata` binary end to end on a real directory store: blobs, layers, images, tar
//! input, gc (the node daemon's commands: `tests/cli_node.rs`).

mod common;

use std::path::Path;
use std::process::Command;

use common::cli::{json, ok, strata, strata_cmd};

#[test]
fn put_verify_get_layers_and_gc() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("sub/deeper")).unwrap();
    std::fs::write(src.join("a.txt"), b"alpha").unwrap();
    std::fs::write(src.join("sub/b.bin"), vec![0xABu8; 3 << 20]).unwrap();
    std::fs::write(src.join("sub/deeper/dup.txt"), b"alpha").unwrap();
    std::fs::write(src.join("empty"), b"").unwrap();
    std::os::unix::fs::symlink("a.txt", src.join("link")).unwrap();

    let put = json(strata(
        &store,
        &["--json", "blob", "put", "--verify", src.to_str().unwrap()],
    ));
    assert_eq!(put["files"], 4, "symlinks are not files: {put}");
    assert_eq!(
        put["unique_blobs"], 3,
        "the duplicate is stored once: {put}"
    );
    assert_eq!(put["verified"], 3);
    let entries = put["entries"].as_array().unwrap();
    let digest_of = |name: &str| {
        entries
            .iter()
            .find(|e| e["path"].as_str().unwrap().ends_with(name))
            .unwrap()["digest"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let big = digest_of("b.bin");
    assert_eq!(big, blake3::hash(&vec![0xABu8; 3 << 20]).to_hex().as_str());

    // Human output of a second put: nothing new is uploaded.
    let again = ok(strata(&store, &["blob", "put", src.to_str().unwrap()]));
    assert!(again.contains("0 uploaded"), "{again}");

    let out = tmp.path().join("out.bin");
    ok(strata(
        &store,
        &["blob", "get", &big, "-o", out.to_str().unwrap()],
    ));
    assert_eq!(std::fs::read(&out).unwrap(), vec![0xABu8; 3 << 20]);
    let listed = json(strata(&store, &["--json", "blob", "ls"]));
    assert_eq!(listed.as_array().unwrap().len(), 3);

    // Publish a layer that references two of the blobs.
    let manifest = serde_json::json!({
        "schema_version": 1,
        "layer": "workspace/demo:1",
        "meta": {"digest": digest_of("a.txt"), "size": 5},
        "blobs": [{"digest": big, "size": 3u64 << 20}],
        "created": "2026-11-30T00:00:00Z",
        "source": "test",
    });
    let mpath = tmp.path().join("m.json");
    std::fs::write(&mpath, manifest.to_string()).unwrap();
    let pushed = json(strata(
        &store,
        &["--json", "layer", "push", mpath.to_str().unwrap()],
    ));
    assert_eq!(pushed["outcome"], "created");
    let ls = json(strata(&store, &["--json", "layer", "ls"]));
    assert_eq!(ls[0]["layer"], "workspace/demo:1");
    assert_eq!(ls[0]["size"], 5 + (3u64 << 20));
    let inspect = json(strata(
        &store,
        &["--json", "layer", "inspect", "workspace/demo:1"],
    ));
    assert_eq!(inspect["blobs"][0]["digest"], big.as_str());

    // A different manifest under the same version is refused.
    let mut changed = manifest.clone();
    changed["blobs"] = serde_json::json!([]);
    std::fs::write(&mpath, changed.to_string()).unwrap();
    let out = strata(&store, &["layer", "push", mpath.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists"));

    // gc with no grace removes only the unreferenced blob (the empty file's).
    let report = json(strata(&store, &["--json", "gc", "--grace", "0s"]));
    assert_eq!(report["removed"].as_array().unwrap().len(), 1, "{report}");
    assert_eq!(report["referenced"], 2);
    // After rm, both go.
    ok(strata(&store, &["layer", "rm", "workspace/demo:1"]));
    let report = json(strata(&store, &["--json", "gc", "--grace", "0s"]));
    assert_eq!(report["removed"].as_array().unwrap().len(), 2, "{report}");
    assert_eq!(
        json(strata(&store, &["--json", "layer", "ls"])),
        serde_json::json!([])
    );
}

#[test]
fn errors_are_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let cases: [(&[&str], &str); 4] = [
        (
            &["layer", "inspect", "base/nope:1"],
            "layer not found: base/nope:1",
        ),
        (&["layer", "inspect", "nope"], "expected KIND/NAME:VERSION"),
        (&["blob", "get", "abc"], "expected 64 lowercase hex"),
        (&["blob", "get", &"0".repeat(64)], "not found"),
    ];
    for (args, want) in cases {
        let out = strata(&store, args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["--store", "s3://", "layer", "ls"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("expected a path, file:///path, or s3://"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn cat_reads_through_the_node_cache_and_stats_count_it() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let home = tmp.path().join("home");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let file = tmp.path().join("big");
    std::fs::write(&file, &data).unwrap();
    let run = |args: &[&str]| strata_cmd(&home, &store).args(args).output().unwrap();
    let put: serde_json::Value =
        serde_json::from_str(&ok(run(&["--json", "blob", "put", file.to_str().unwrap()]))).unwrap();
    let digest = put["entries"][0]["digest"].as_str().unwrap().to_owned();

    let out = tmp.path().join("part");
    ok(run(&[
        "blob",
        "cat",
        &digest,
        "--offset",
        "1000000",
        "--length",
        "300000",
        "-o",
        out.to_str().unwrap(),
    ]));
    assert_eq!(std::fs::read(&out).unwrap(), &data[1_000_000..1_300_000]);
    let stats: serde_json::Value =
        serde_json::from_str(&ok(run(&["--json", "cache", "stats"]))).unwrap();
    for key in [
        "hits",
        "misses",
        "bytes_read",
        "bytes_fetched",
        "backend_requests",
        "evictions",
        "verify_failures",
    ] {
        assert!(stats[key].is_u64(), "{key} missing: {stats}");
    }
    assert_eq!(stats["bytes_read"], 300_000);
    // 300,000 bytes at 1,000,000 span chunks 3 and 4: two chunks fetched, in one request.
    assert_eq!(stats["misses"], 2, "{stats}");
    assert_eq!(stats["backend_requests"], 1, "{stats}");
    assert_eq!(stats["disk"]["chunks"], 2, "{stats}");

    // Again: served from the node's disk cache, nothing fetched; counters are cumulative.
    ok(run(&[
        "blob",
        "cat",
        &digest,
        "--offset",
        "1000000",
        "--length",
        "300000",
        "-o",
        out.to_str().unwrap(),
    ]));
    let stats: serde_json::Value =
        serde_json::from_str(&ok(run(&["--json", "cache", "stats"]))).unwrap();
    assert_eq!(stats["bytes_read"], 600_000);
    assert_eq!(stats["backend_requests"], 1, "{stats}");
    assert_eq!(stats["hits_disk"], 2, "{stats}");

    // The whole blob, to stdout.
    let whole = run(&["blob", "cat", &digest]);
    assert!(whole.status.success());
    assert_eq!(whole.stdout, data);
}

#[test]
fn mkfs_builds_an_image_that_fsck_and_the_reader_accept() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    std::fs::write(src.join("d/f.txt"), b"hello erofs").unwrap();
    std::fs::write(src.join("big"), vec![7u8; 100_000]).unwrap();
    std::os::unix::fs::symlink("d/f.txt", src.join("link")).unwrap();
    let image = tmp.path().join("out.erofs");
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["--json", "mkfs"])
        .arg(&image)
        .arg(&src)
        .args(["--timestamp", "1700000000"])
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
    assert_eq!(report["files"], 2, "{report}");
    assert_eq!(report["data_bytes"], 100_011, "{report}");

    match Command::new("fsck.erofs").arg(&image).status() {
        Ok(status) => assert!(status.success(), "fsck.erofs rejected the image"),
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("fsck.erofs is required under CI: {e}")
        }
        Err(_) => eprintln!("*** SKIPPED fsck.erofs check: fsck.erofs not installed ***"),
    }
    let img = erofs_builder::Image::open(&image).unwrap();
    let f = img.lookup("/d/f.txt").unwrap();
    assert_eq!(img.read_data(&f).unwrap(), b"hello erofs");
    let l = img.lookup("/link").unwrap();
    assert_eq!(img.read_link(&l).unwrap(), b"d/f.txt");

    // Same tree, same timestamp: the same bytes.
    let again = tmp.path().join("again.erofs");
    ok(Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("mkfs")
        .arg(&again)
        .arg(&src)
        .args(["--timestamp", "1700000000"])
        .output()
        .unwrap());
    assert_eq!(
        std::fs::read(&image).unwrap(),
        std::fs::read(&again).unwrap()
    );
}

#[test]
fn layer_build_pushes_a_lazy_layer_that_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    let big: Vec<u8> = (0..700_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(src.join("d/big"), &big).unwrap();
    std::fs::write(src.join("small"), b"small file").unwrap();
    let home = tmp.path().join("home");
    let run = |args: &[&str]| strata_cmd(&home, &store).args(args).output().unwrap();
    let build = [
        "--json",
        "layer",
        "build",
        src.to_str().unwrap(),
        "--name",
        "workspace/w:1",
        "--timestamp",
        "1700000000",
    ];
    let built = json(run(&build));
    assert_eq!(built["outcome"], "created", "{built}");
    // Rebuilding the same tree is reproducible: the same version is accepted as unchanged.
    let again = json(run(&build));
    assert_eq!(again["outcome"], "unchanged", "{again}");

    let m = json(run(&["--json", "layer", "inspect", "workspace/w:1"]));
    let meta = m["meta"]["digest"].as_str().unwrap().to_owned();
    let blob = m["blobs"][0]["digest"].as_str().unwrap().to_owned();
    assert_eq!(blob, built["blob_digest"].as_str().unwrap());
    // By default a layer has a tails blob (device 2, 16 KiB chunks): "small" and the last
    // 700,000 - 2 × 262,144 bytes of "d/big" are there; the main blob holds two whole chunks.
    let tails = m["blobs"][1]["digest"].as_str().unwrap().to_owned();
    assert_eq!(m["blobs"].as_array().unwrap().len(), 2, "{m}");
    assert_eq!(m["blobs"][1]["chunk_size"], 16384, "{m}");
    assert!(m["blobs"][0].get("chunk_size").is_none(), "{m}");
    assert_eq!(m["blobs"][0]["size"], 2 * 262_144, "{m}");
    assert_eq!(built["tails"]["digest"].as_str(), Some(tails.as_str()));
    assert_eq!(built["tails"]["chunk_size"], 16384, "{built}");
    let path = |d: &str| store.join("blobs").join(&d[..2]).join(d);
    // Stored compressed by default (zstd per chunk): the manifest says so, the stored object
    // is smaller than the blob, and its chunk table sits beside it.
    assert_eq!(m["blobs"][0]["compression"], "zstd", "{m}");
    let stored = m["blobs"][0]["stored_size"].as_u64().unwrap();
    assert_eq!(std::fs::metadata(path(&blob)).unwrap().len(), stored);
    assert!(stored < m["blobs"][0]["size"].as_u64().unwrap());
    assert_eq!(built["blob_stored_bytes"].as_u64(), Some(stored));
    assert!(store
        .join("blobs")
        .join(&blob[..2])
        .join(format!("{blob}.chunks"))
        .exists());
    // `blob get` writes the plain bytes (decoded and verified): the image reads from them.
    let (meta_file, blob_file, tails_file) = (
        tmp.path().join("meta.out"),
        tmp.path().join("blob.out"),
        tmp.path().join("tails.out"),
    );
    ok(run(&[
        "blob",
        "get",
        &meta,
        "-o",
        meta_file.to_str().unwrap(),
    ]));
    ok(run(&[
        "blob",
        "get",
        &blob,
        "-o",
        blob_file.to_str().unwrap(),
    ]));
    ok(run(&[
        "blob",
        "get",
        &tails,
        "-o",
        tails_file.to_str().unwrap(),
    ]));
    assert_eq!(
        std::fs::metadata(&blob_file).unwrap().len(),
        m["blobs"][0]["size"].as_u64().unwrap()
    );
    // The tails blob's chunk table is at 16 KiB: a table is stored before its blob.
    assert!(store
        .join("blobs")
        .join(&tails[..2])
        .join(format!("{tails}.chunks"))
        .exists());
    let img = erofs_builder::Image::open_with_devices(
        &meta_file,
        &[blob_file.as_path(), tails_file.as_path()],
    )
    .unwrap();
    let f = img.lookup("/d/big").unwrap();
    assert_eq!(img.read_data(&f).unwrap(), big);
    let s = img.lookup("/small").unwrap();
    assert_eq!(img.read_data(&s).unwrap(), b"small file");
    // `blob get` to stdout too.
    let whole = run(&["blob", "get", &blob]);
    assert!(whole.status.success());
    assert_eq!(whole.stdout, std::fs::read(&blob_file).unwrap());
    // A byte range of the blob reads through the node cache.
    let part = run(&["blob", "cat", &blob, "--offset", "0", "--length", "4096"]);
    assert!(part.status.success());
    assert_eq!(part.stdout, std::fs::read(&blob_file).unwrap()[..4096]);

    // `--compress none`: the stored objects are the plain meta image and blob (the tree with
    // one more file, so that the blob is new); `--tail-chunk-size 0`: one data blob, as
    // layers built before tails blobs existed.
    std::fs::write(src.join("d/more"), vec![b'm'; 300_000]).unwrap();
    let plain = json(run(&[
        "--json",
        "layer",
        "build",
        src.to_str().unwrap(),
        "--name",
        "workspace/w:2",
        "--timestamp",
        "1700000001",
        "--compress",
        "none",
        "--no-dedup",
        "--tail-chunk-size",
        "0",
    ]));
    assert_eq!(plain["compression"], "none", "{plain}");
    let m2 = json(run(&["--json", "layer", "inspect", "workspace/w:2"]));
    assert_eq!(m2["blobs"].as_array().unwrap().len(), 1, "{m2}");
    assert!(plain["tails"].is_null(), "{plain}");
    assert!(m2["blobs"][0].get("compression").is_none(), "{m2}");
    let (meta2, blob2) = (
        m2["meta"]["digest"].as_str().unwrap().to_owned(),
        m2["blobs"][0]["digest"].as_str().unwrap().to_owned(),
    );
    assert_eq!(
        std::fs::metadata(path(&blob2)).unwrap().len(),
        m2["blobs"][0]["size"].as_u64().unwrap()
    );
    let img =
        erofs_builder::Image::open_with_devices(&path(&meta2), &[path(&blob2).as_path()]).unwrap();
    assert_eq!(img.read_data(&img.lookup("/d/big").unwrap()).unwrap(), big);
    let bad = run(&[
        "layer",
        "build",
        src.to_str().unwrap(),
        "--name",
        "workspace/w:3",
        "--compress",
        "lz4",
    ]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("zstd"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    for size in ["3000", "262144", "2048"] {
        let bad = run(&[
            "layer",
            "build",
            src.to_str().unwrap(),
            "--name",
            "workspace/w:3",
            "--tail-chunk-size",
            size,
        ]);
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success(), "{size}");
        assert!(err.contains("power of two"), "{size}: {err}");
    }
    let none = json(run(&["--json", "layer", "ls"]));
    assert!(
        !none.to_string().contains("workspace/w:3"),
        "a refused build pushed nothing: {none}"
    );
}

#[test]
fn tar_input_from_a_file_and_stdin_and_chunk_size_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::write(src.join("etc/hostname"), b"sandbox\n").unwrap();
    std::fs::write(src.join("data.bin"), vec![3u8; 300_000]).unwrap();
    // An OCI whiteout: hides `gone` of a lower layer.
    std::fs::write(src.join(".wh.gone"), b"").unwrap();
    let tar = tmp.path().join("layer.tar");
    let made = Command::new("tar")
        .args(["--format=posix", "-C"])
        .arg(&src)
        .args(["-cf"])
        .arg(&tar)
        .arg(".")
        .status()
        .expect("GNU tar");
    assert!(made.success());
    let store = tmp.path().join("store");
    let home = tmp.path().join("home");
    let run = |args: &[&str], stdin: Option<&Path>| {
        let mut c = strata_cmd(&home, &store);
        c.args(args);
        if let Some(p) = stdin {
            c.stdin(std::fs::File::open(p).unwrap());
        }
        c.output().unwrap()
    };
    // A full image from the tar file.
    let image = tmp.path().join("full.erofs");
    let report = json(run(
        &[
            "--json",
            "mkfs",
            image.to_str().unwrap(),
            tar.to_str().unwrap(),
            "--tar",
        ],
        None,
    ));
    assert_eq!(report["data_bytes"], 300_008, "{report}");
    let img = erofs_builder::Image::open(&image).unwrap();
    let h = img.lookup("/etc/hostname").unwrap();
    assert_eq!(img.read_data(&h).unwrap(), b"sandbox\n");
    let wh = img.lookup("/gone").unwrap();
    assert_eq!(wh.file_type, erofs_builder::FileType::CharDevice);
    assert_eq!(wh.rdev, (0, 0));
    assert!(img.lookup("/.wh.gone").is_err());

    // A layer from standard input; the manifest says where it came from.
    let built = json(run(
        &[
            "--json",
            "layer",
            "build",
            "-",
            "--tar",
            "--name",
            "toolkit/t:1",
        ],
        Some(&tar),
    ));
    assert_eq!(built["outcome"], "created", "{built}");
    let m = json(run(&["--json", "layer", "inspect", "toolkit/t:1"], None));
    assert_eq!(m["source"], "tar:-", "{m}");

    // Chunk sizes other than the cache's are refused with a reason; 262144 is fine.
    let bad = run(
        &[
            "mkfs",
            tmp.path().join("m").to_str().unwrap(),
            src.to_str().unwrap(),
            "--blobdev",
            tmp.path().join("b").to_str().unwrap(),
            "--chunk-size",
            "65536",
        ],
        None,
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("262144"));
    ok(run(
        &[
            "mkfs",
            tmp.path().join("m").to_str().unwrap(),
            src.to_str().unwrap(),
            "--blobdev",
            tmp.path().join("b").to_str().unwrap(),
            "--chunk-size",
            "262144",
            "--quiet",
        ],
        None,
    ));
    // A hostile archive is refused, nothing is written.
    let evil = tmp.path().join("evil.tar");
    std::fs::write(&evil, b"not a tar at all, and far too short").unwrap();
    let out = tmp.path().join("evil.erofs");
    let refused = run(
        &[
            "mkfs",
            out.to_str().unwrap(),
            evil.to_str().unwrap(),
            "--tar",
        ],
        None,
    );
    assert!(!refused.status.success());
    assert!(!out.exists());
}
