//! gc on a real POSIX store: what it keeps, what it removes, and that it is safe while a push is
//! under way.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use fs_cache::backend::posix::set_mtime;
use fs_cache::gc::{collect, GcOptions};
use fs_cache::store::{blob_key, lease_key, sidecar_key};
use fs_cache::{BlobRef, Manifest, PosixBackend, Store};

const HOUR: Duration = Duration::from_secs(3600);

fn age(b: &PosixBackend, key: &str, by: Duration) {
    set_mtime(b, key, SystemTime::now() - by).unwrap();
}

async fn put(store: &Store, data: &'static [u8]) -> BlobRef {
    let p = store.put_blob(Bytes::from_static(data)).await.unwrap();
    p.blob_ref()
}

#[tokio::test]
async fn keeps_referenced_and_recent_removes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let posix = PosixBackend::open(dir.path()).unwrap();
    let store = Store::new(Arc::new(posix.clone()));

    let meta = put(&store, b"meta image").await;
    let data = put(&store, b"data blob").await;
    let orphan_old = put(&store, b"orphan, old").await;
    let orphan_new = put(&store, b"orphan, new (a push in progress)").await;
    let removed_layer_blob = put(&store, b"blob of a removed layer").await;
    // A sidecar of the old orphan goes with it.
    let side = sidecar_key(&orphan_old.digest, "chunks");
    store
        .backend()
        .put(&side, Bytes::from_static(b"table"))
        .await
        .unwrap();
    // Junk under blobs/ is reported and left alone.
    store
        .backend()
        .put("blobs/zz/not-a-digest", Bytes::new())
        .await
        .unwrap();

    let keep = Manifest::new(
        "base/os:1".parse().unwrap(),
        Some(meta.clone()),
        vec![data.clone()],
        "test".into(),
    );
    store.push_manifest(&keep).await.unwrap();
    let gone = Manifest::new(
        "snapshot/s:1".parse().unwrap(),
        None,
        vec![removed_layer_blob.clone()],
        "test".into(),
    );
    store.push_manifest(&gone).await.unwrap();
    store.remove_layer(&gone.layer).await.unwrap();

    for b in [&meta, &data, &orphan_old, &removed_layer_blob] {
        age(&posix, &blob_key(&b.digest), 2 * HOUR);
    }
    age(&posix, &side, 2 * HOUR);

    let dry = collect(
        &store,
        GcOptions {
            grace: HOUR,
            dry_run: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(dry.removed.len(), 2, "{dry:?}");
    assert!(store.stat_blob(&orphan_old.digest).await.unwrap().is_some());

    let report = collect(
        &store,
        GcOptions {
            grace: HOUR,
            dry_run: false,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut expect = vec![
        orphan_old.digest.to_hex(),
        removed_layer_blob.digest.to_hex(),
    ];
    expect.sort();
    assert_eq!(report.removed, expect);
    assert_eq!(
        report.removed_objects, 3,
        "blob + its sidecar, and a blob (small blobs have no chunk table)"
    );
    assert_eq!(report.referenced, 2);
    assert_eq!(report.kept_recent, 1);
    assert_eq!(report.unrecognised, ["blobs/zz/not-a-digest"]);

    for b in [&meta, &data, &orphan_new] {
        assert!(store.stat_blob(&b.digest).await.unwrap().is_some());
    }
    for b in [&orphan_old, &removed_layer_blob] {
        assert!(store.stat_blob(&b.digest).await.unwrap().is_none());
    }
    assert!(store
        .backend()
        .head(&side)
        .await
        .unwrap_err()
        .is_not_found());
    // The surviving layer still reads, verified.
    let m = store.manifest(&keep.layer).await.unwrap();
    for b in m.all_blobs() {
        store.get_blob(&b.digest).await.unwrap();
    }
}

#[tokio::test]
async fn a_push_reusing_an_old_unreferenced_blob_is_protected_by_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let posix = PosixBackend::open(dir.path()).unwrap();
    let store = Store::new(Arc::new(posix.clone()));
    let b = put(&store, b"shared chunk").await;
    age(&posix, &blob_key(&b.digest), 3 * HOUR);

    // A new push finds the blob already stored: nothing is uploaded, but the lease is renewed.
    let again = store
        .put_blob(Bytes::from_static(b"shared chunk"))
        .await
        .unwrap();
    assert!(again.existed);
    assert!(store.backend().head(&lease_key(&b.digest)).await.is_ok());

    // gc runs before the push's manifest lands: the blob survives.
    let report = collect(&store, GcOptions::default()).await.unwrap();
    assert!(report.removed.is_empty(), "{report:?}");
    let m = Manifest::new(
        "toolkit/t:1".parse().unwrap(),
        None,
        vec![b.clone()],
        "t".into(),
    );
    store.push_manifest(&m).await.unwrap();

    // Once the lease is old too (and the blob unreferenced), it goes, and so does the lease.
    store.remove_layer(&m.layer).await.unwrap();
    age(&posix, &lease_key(&b.digest), 2 * HOUR);
    let report = collect(&store, GcOptions::default()).await.unwrap();
    assert_eq!(report.removed, [b.digest.to_hex()]);
    assert_eq!(report.expired_leases, 1);
    assert!(store.backend().list("leases/").await.unwrap().is_empty());
}

#[tokio::test]
async fn unreadable_manifest_aborts_gc_without_deleting() {
    let dir = tempfile::tempdir().unwrap();
    let posix = PosixBackend::open(dir.path()).unwrap();
    let store = Store::new(Arc::new(posix.clone()));
    let b = put(&store, b"blob").await;
    age(&posix, &blob_key(&b.digest), 2 * HOUR);
    store
        .backend()
        .put("layers/base/x/1.json", Bytes::from_static(b"{ not json"))
        .await
        .unwrap();
    let e = collect(&store, GcOptions::default()).await.unwrap_err();
    assert!(e.to_string().contains("base/x:1"), "{e}");
    assert!(store.stat_blob(&b.digest).await.unwrap().is_some());
}

/// A file beside a key's target, named as the POSIX backend names its temporary files, last
/// written `by` ago.
fn temp_file(dir: &std::path::Path, rel: &str, by: Duration) {
    let path = dir.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let f = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &f, b"half a put").unwrap();
    f.set_modified(SystemTime::now() - by).unwrap();
}

#[tokio::test]
async fn sweeps_temporary_files_of_puts_whose_process_died() {
    let dir = tempfile::tempdir().unwrap();
    let posix = PosixBackend::open(dir.path()).unwrap();
    let store = Store::new(Arc::new(posix.clone()));
    let kept = put(&store, b"a blob").await;
    let manifest = Manifest::new(
        "base/os:1".parse().unwrap(),
        None,
        vec![kept.clone()],
        "test".into(),
    );
    store.push_manifest(&manifest).await.unwrap();
    // Two days old (a put killed half-way), deep and at the root; one written a minute ago
    // (a put under way); an old file that only looks alike.
    temp_file(dir.path(), "blobs/ab/.strata-tmp.killed", 48 * HOUR);
    temp_file(dir.path(), ".strata-tmp.at-root", 48 * HOUR);
    temp_file(
        dir.path(),
        "blobs/cd/.strata-tmp.live",
        Duration::from_secs(60),
    );
    temp_file(dir.path(), "blobs/cd/strata-tmp.not-ours", 48 * HOUR);

    let dry = collect(
        &store,
        GcOptions {
            dry_run: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        dry.abandoned_puts,
        [
            "temporary file .strata-tmp.at-root (10 bytes)",
            "temporary file blobs/ab/.strata-tmp.killed (10 bytes)",
        ]
    );
    assert!(dir.path().join("blobs/ab/.strata-tmp.killed").exists());

    let report = collect(&store, GcOptions::default()).await.unwrap();
    assert_eq!(report.abandoned_puts, dry.abandoned_puts);
    assert!(!dir.path().join("blobs/ab/.strata-tmp.killed").exists());
    assert!(!dir.path().join(".strata-tmp.at-root").exists());
    assert!(dir.path().join("blobs/cd/.strata-tmp.live").exists());
    assert!(dir.path().join("blobs/cd/strata-tmp.not-ours").exists());
    assert_eq!(
        store.get_blob(&kept.digest).await.unwrap(),
        Bytes::from_static(b"a blob")
    );

    // A shorter threshold takes the live one too; nothing is left to sweep after.
    let report = collect(
        &store,
        GcOptions {
            abandoned_after: Duration::from_secs(1),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        report.abandoned_puts,
        ["temporary file blobs/cd/.strata-tmp.live (10 bytes)"]
    );
    let again = collect(&store, GcOptions::default()).await.unwrap();
    assert!(again.abandoned_puts.is_empty(), "{again:?}");
}
