//! Retries are one layer: a read that keeps failing reaches the backend exactly as many times
//! as the retry policy allows (not that squared), whether it comes from the store or from the
//! chunk cache, and the error it ends with is final. Backend calls are counted by the
//! fault-injecting wrapper under the store.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fs_cache::chunk::{CacheConfig, ChunkCache, CHUNK_SIZE};
use fs_cache::{
    Backend, Error, ErrorKind, FaultConfig, FaultyBackend, MemoryBackend, RetryPolicy, Store,
};

/// `attempts` attempts, quickly, and no deadline that could stop them first.
fn policy(attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts: attempts,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(2),
        deadline: Duration::from_secs(30),
        attempt_timeout: Duration::from_secs(30),
    }
}

/// Checks that `err` is the final error after `attempts` attempts of an injected fault.
fn assert_final(err: &Error, attempts: u32) {
    assert!(!err.is_transient(), "{err}");
    assert_eq!(err.kind(), ErrorKind::Backend, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("after {attempts} attempt(s)")),
        "{msg}"
    );
    assert!(msg.contains("injected transient fault"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_read_is_attempted_exactly_policy_many_times() {
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let faulty = Arc::new(FaultyBackend::new(mem, 3));
    let store = Store::with_retry(faulty.clone(), policy(4));
    let data: Vec<u8> = (0..3 * CHUNK_SIZE).map(|i| (i % 251) as u8).collect();
    let blob = store.put_blob(Bytes::from(data)).await.unwrap().digest;
    let config = CacheConfig {
        readahead_bytes: 0,
        disk_readahead_bytes: 0,
        retry: policy(3),
        ..CacheConfig::default()
    };
    let cache = ChunkCache::open(store.clone(), config).await.unwrap();
    cache.register(&blob).await.unwrap();

    // Every request fails, transiently: worth retrying, until the policy runs out.
    faulty.set(FaultConfig {
        error_rate: 1.0,
        ..FaultConfig::default()
    });

    // A direct store read: the store's policy, four attempts.
    faulty.reset_stats();
    let err = store.get_blob(&blob).await.unwrap_err();
    assert_final(&err, 4);
    let s = faulty.stats();
    eprintln!("store read: {} backend calls: {err}", s.gets);
    assert_eq!((s.gets, s.injected_errors), (4, 4));

    // A chunk cache read: the cache's policy replaces the store's, three attempts.
    faulty.reset_stats();
    let err = cache.read(&blob, 10, 100).await.unwrap_err();
    assert!(matches!(err, Error::Shared(_)), "{err:?}");
    assert_final(&err, 3);
    let s = faulty.stats();
    eprintln!("cache read: {} backend calls: {err}", s.gets);
    assert_eq!((s.gets, s.injected_errors), (3, 3));
    assert_eq!(cache.stats().backend_errors, 1);

    // Changing a store's policy replaces its retries; it does not nest them.
    faulty.reset_stats();
    let err = store
        .with_retry_policy(policy(2))
        .get_blob(&blob)
        .await
        .unwrap_err();
    assert_final(&err, 2);
    assert_eq!(faulty.stats().gets, 2);

    // Store operations other than reads go through the same single layer.
    faulty.reset_stats();
    let err = store.stat_blob(&blob).await.unwrap_err();
    assert_final(&err, 4);
    assert_eq!(faulty.stats().heads, 4);

    // A fault that stops before the policy runs out is absorbed, in as many calls as it took.
    faulty.set(FaultConfig {
        fail_next: 2,
        ..FaultConfig::default()
    });
    faulty.reset_stats();
    let before = cache.stats().backend_requests;
    let got = cache.read(&blob, CHUNK_SIZE, 100).await.unwrap();
    assert_eq!(got.len(), 100);
    assert_eq!(faulty.stats().gets, 3);
    assert_eq!(
        cache.stats().backend_requests - before,
        1,
        "one request, three attempts"
    );

    // A permanent fault is not retried at all.
    faulty.set(FaultConfig {
        error_rate: 1.0,
        permanent: true,
        ..FaultConfig::default()
    });
    faulty.reset_stats();
    let err = cache.read(&blob, 2 * CHUNK_SIZE, 100).await.unwrap_err();
    assert!(!err.is_transient(), "{err}");
    assert_eq!(faulty.stats().gets, 1);
}
