//! Commit → push to a store → resolve the stack → read lazily through the chunk cache.

mod common;

use std::sync::Arc;

use common::*;
use fs_cache::chunk::{CacheConfig, ChunkCache};
use fs_cache::{Backend, LayerRef, MemoryBackend, PosixBackend, Store};
use overlaybd::{push_layer, resolve_stack, BlobSource, Device, Error, LayerSource, Upper};

fn round_trip(backend: Arc<dyn Backend>) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(77);
    // 3 layers of a 3 MiB device: several 256 KiB chunks per layer blob.
    let (files, model) = build_stack(dir.path(), &mut rng, 3 << 20, 3, 80);
    let store = Store::new(backend);
    let names: Vec<LayerRef> = (0..files.len())
        .map(|i| format!("snapshot/vm-disk:{i}").parse().unwrap())
        .collect();
    rt.block_on(async {
        for (i, f) in files.iter().enumerate() {
            let parent = i.checked_sub(1).map(|p| &names[p]);
            let pushed = push_layer(&store, f, &names[i], parent).await.unwrap();
            assert!(pushed.manifest.meta.is_none());
            assert_eq!(pushed.blob.size, std::fs::metadata(f).unwrap().len());
        }
        // Wrong parent, or a missing one: refused before anything is published.
        let other: LayerRef = "snapshot/other:1".parse().unwrap();
        let err = push_layer(&store, &files[2], &other, Some(&names[0]))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::ParentMismatch { .. }), "{err}");
        let err = push_layer(&store, &files[2], &other, None)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::BadLayer { .. }), "{err}");
        assert!(store.manifest(&other).await.is_err());
    });
    let cache = rt
        .block_on(ChunkCache::open(store.clone(), CacheConfig::default()))
        .unwrap();
    let stack = rt
        .block_on(resolve_stack(&store, &cache, names.last().unwrap()))
        .unwrap();
    assert_eq!(stack.len(), 3);
    // Reads from a plain thread (Handle::block_on) …
    let dev = Device::open(stack.clone(), None).unwrap();
    check_device(&mut rng, &dev, &model);
    // … from inside the runtime: its block_on thread, and every worker at once
    // (block_in_place) …
    let dev = Arc::new(dev);
    let m2 = model.clone();
    let (store2, top2) = (store.clone(), names.last().unwrap().clone());
    rt.block_on(async move {
        // A fresh cache, so that these reads really fetch from the backend.
        let cache = ChunkCache::open(store2.clone(), CacheConfig::default())
            .await
            .unwrap();
        let stack = resolve_stack(&store2, &cache, &top2).await.unwrap();
        let d2 = Arc::new(Device::open(stack, None).unwrap());
        let mut buf = vec![0u8; 100_000];
        d2.read_at(12345, &mut buf).unwrap();
        assert_eq!(buf, m2[12345..112345]);
        let tasks: Vec<_> = (0..8u64)
            .map(|i| {
                let (d, m) = (d2.clone(), m2.clone());
                tokio::spawn(async move {
                    let off = i * 300_000 + 7;
                    let mut buf = vec![0u8; 200_000];
                    d.read_at(off, &mut buf).unwrap();
                    assert!(buf == m[off as usize..off as usize + 200_000]);
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    // … and from a current-thread runtime (a helper thread; the cache's runtime is `rt`).
    let local = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let d3 = dev.clone();
    local.block_on(async move {
        let mut buf = vec![0u8; 4096];
        d3.read_at(1 << 20, &mut buf).unwrap();
    });
    // A writable upper on the stored stack, committed and pushed as the next version.
    let udir = dir.path().join("upper");
    let upper = Upper::create(&udir, dev.size(), dev.top_id()).unwrap();
    let mut model2 = model.clone();
    random_ops(&mut rng, &upper, &mut model2, 40);
    let dev2 = Device::open(stack, Some(upper)).unwrap();
    check_device(&mut rng, &dev2, &model2);
    let sealed = dev2.commit(dir.path().join("next.bd")).unwrap();
    let next: LayerRef = "snapshot/vm-disk:3".parse().unwrap();
    rt.block_on(push_layer(&store, &sealed.path, &next, names.last()))
        .unwrap();
    let stack = rt.block_on(resolve_stack(&store, &cache, &next)).unwrap();
    let dev3 = Device::open(stack, None).unwrap();
    check_device(&mut rng, &dev3, &model2);
    assert_eq!(dev3.top_id(), sealed.id);
}

#[test]
fn posix_store_round_trip() {
    let root = tempfile::tempdir().unwrap();
    round_trip(Arc::new(PosixBackend::open(root.path()).unwrap()));
}

#[test]
fn memory_store_round_trip() {
    round_trip(Arc::new(MemoryBackend::new()));
}

#[test]
fn corrupt_stored_blob_is_never_served() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(5);
    let (files, _) = build_stack(dir.path(), &mut rng, 2 << 20, 1, 60);
    let backend = Arc::new(PosixBackend::open(root.path()).unwrap());
    let store = Store::new(backend);
    let name: LayerRef = "base/disk:1".parse().unwrap();
    let pushed = rt
        .block_on(push_layer(&store, &files[0], &name, None))
        .unwrap();
    // Damage the stored blob's first byte behind the store's back.
    let key = fs_cache::store::blob_key(&pushed.blob.digest);
    let path = root.path().join(&key);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let cache = rt
        .block_on(ChunkCache::open(store.clone(), CacheConfig::default()))
        .unwrap();
    let src = rt
        .block_on(BlobSource::open(cache, pushed.blob.digest))
        .unwrap();
    let mut buf = vec![0u8; 512];
    let err = src.read_exact_at(&mut buf, 0).unwrap_err();
    assert!(matches!(err, Error::Store(_)), "{err}");
}
