//! The `strata` binary end to end on a real directory store.

use std::path::Path;
use std::process::{Command, Output};

fn strata(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .expect("run strata")
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "strata failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(out: Output) -> serde_json::Value {
    serde_json::from_str(&ok(out)).unwrap()
}

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
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .env("STRATA_HOME", &home)
            .arg("--store")
            .arg(&store)
            .args(args)
            .output()
            .unwrap()
    };
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
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .env("STRATA_HOME", tmp.path().join("home"))
            .arg("--store")
            .arg(&store)
            .args(args)
            .output()
            .unwrap()
    };
    let built = json(run(&[
        "--json",
        "layer",
        "build",
        src.to_str().unwrap(),
        "--name",
        "workspace/w:1",
        "--timestamp",
        "1700000000",
    ]));
    assert_eq!(built["outcome"], "created", "{built}");
    // Rebuilding the same tree is reproducible: the same version is accepted as unchanged.
    let again = json(run(&[
        "--json",
        "layer",
        "build",
        src.to_str().unwrap(),
        "--name",
        "workspace/w:1",
        "--timestamp",
        "1700000000",
    ]));
    assert_eq!(again["outcome"], "unchanged", "{again}");

    let m = json(run(&["--json", "layer", "inspect", "workspace/w:1"]));
    let meta = m["meta"]["digest"].as_str().unwrap().to_owned();
    let blob = m["blobs"][0]["digest"].as_str().unwrap().to_owned();
    assert_eq!(blob, built["blob_digest"].as_str().unwrap());
    let path = |d: &str| store.join("blobs").join(&d[..2]).join(d);
    // The blob is larger than one chunk, so its chunk table sits beside it.
    assert!(store
        .join("blobs")
        .join(&blob[..2])
        .join(format!("{blob}.chunks"))
        .exists());
    let img =
        erofs_builder::Image::open_with_devices(&path(&meta), &[path(&blob).as_path()]).unwrap();
    let f = img.lookup("/d/big").unwrap();
    assert_eq!(img.read_data(&f).unwrap(), big);
    let s = img.lookup("/small").unwrap();
    assert_eq!(img.read_data(&s).unwrap(), b"small file");
    // A byte range of the blob reads through the node cache.
    let part = run(&["blob", "cat", &blob, "--offset", "0", "--length", "4096"]);
    assert!(part.status.success());
    assert_eq!(part.stdout.len(), 4096);
}
