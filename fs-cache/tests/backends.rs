//! Runs the conformance suite (`common/suite.rs`) against every backend: memory, POSIX, the
//! fault wrapper (with no faults configured), the retry wrapper (as a store uses a backend)
//! and S3 against a real S3-compatible server on 127.0.0.1 (`moto_server`, started by
//! `common::moto`).

mod common;

use std::sync::Arc;

use fs_cache::{Backend, FaultyBackend, MemoryBackend, PosixBackend, RetryPolicy, RetryingBackend};

async fn memory() -> Option<(Arc<dyn Backend>, Option<tempfile::TempDir>)> {
    Some((Arc::new(MemoryBackend::new()), None))
}

async fn posix() -> Option<(Arc<dyn Backend>, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let b = PosixBackend::open(dir.path().join("store")).unwrap();
    Some((Arc::new(b), Some(dir)))
}

async fn faulty() -> Option<(Arc<dyn Backend>, Option<tempfile::TempDir>)> {
    let inner: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    Some((Arc::new(FaultyBackend::new(inner, 42)), None))
}

async fn retrying() -> Option<(Arc<dyn Backend>, Option<tempfile::TempDir>)> {
    let inner: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let b = RetryingBackend::new(inner, RetryPolicy::default());
    Some((Arc::new(b), None))
}

async fn s3() -> Option<(Arc<dyn Backend>, Option<tempfile::TempDir>)> {
    common::moto::s3_backend("conformance")
        .await
        .map(|b| (b, None))
}

macro_rules! suite {
    ($backend:ident: $($case:ident),* $(,)?) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let Some((backend, _guard)) = super::$backend().await else {
                        return; // the constructor printed why it was skipped
                    };
                    super::common::suite::$case(backend).await;
                }
            )*
        }
    };
}

macro_rules! all_cases {
    ($($backend:ident),*) => {
        $(
            suite!($backend: roundtrip, empty_object, ranges, missing, overwrite, create_mode,
                list_prefixes, list_many, large_streamed, failed_put_leaves_nothing,
                concurrent_puts, invalid_keys);
        )*
    };
}

all_cases!(memory, posix, faulty, retrying, s3);
