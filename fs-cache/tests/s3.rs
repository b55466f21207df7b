//! S3-specific behaviour of `S3Backend` against a real S3 server (moto_server on 127.0.0.1, see
//! `common::moto`): multipart uploads, cleanup after failures, retries through a proxy that
//! answers 503 (under a `RetryingBackend`, as a store uses S3: one layer of retries, also
//! through a store and a chunk cache), not-found mapping, create-only puts, and URL parsing.
//! The semantics shared with every backend are in the conformance suite (`tests/backends.rs`).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use common::moto::{self, S3Server};
use fs_cache::backend::ByteStream;
use fs_cache::{
    open_backend, Backend, Error, PutMode, RetryPolicy, RetryingBackend, S3Backend, S3Config,
};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MIB: usize = 1 << 20;

/// A backend on a fresh bucket with `part_size` set, retried under `retry` (as a store retries
/// it); `None` without a server.
async fn backend_with(
    prefix: &str,
    part_size: usize,
    retry: RetryPolicy,
) -> Option<(RetryingBackend, String, &'static S3Server)> {
    let server = moto::s3_server()?;
    let bucket = moto::new_bucket(server).await;
    let b = connect(&server.endpoint, &bucket, prefix, part_size, retry).await;
    Some((b, bucket, server))
}

async fn connect(
    endpoint: &str,
    bucket: &str,
    prefix: &str,
    part_size: usize,
    retry: RetryPolicy,
) -> RetryingBackend {
    let url = format!("s3://{bucket}/{prefix}?endpoint={endpoint}&region=us-east-1");
    let mut config = S3Config::from_url(&url::Url::parse(&url).unwrap()).unwrap();
    config.part_size = part_size;
    let s3 = S3Backend::connect(config).await.unwrap();
    RetryingBackend::new(Arc::new(s3), retry)
}

fn fast_retries() -> RetryPolicy {
    RetryPolicy {
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(50),
        ..RetryPolicy::default()
    }
}

/// The pending multipart uploads of `bucket`.
async fn uploads(server: &S3Server, bucket: &str) -> Vec<aws_sdk_s3::types::MultipartUpload> {
    let out = moto::client(server)
        .list_multipart_uploads()
        .bucket(bucket)
        .send()
        .await
        .unwrap();
    out.uploads().to_vec()
}

async fn pending_uploads(server: &S3Server, bucket: &str) -> usize {
    uploads(server, bucket).await.len()
}

/// `data` as a stream of `piece`-sized buffers (zero-copy slices).
fn chunked(data: Bytes, piece: usize) -> ByteStream {
    let n = data.len().div_ceil(piece);
    futures::stream::iter(
        (0..n).map(move |i| Ok(data.slice(i * piece..((i + 1) * piece).min(data.len())))),
    )
    .boxed()
}

fn random_bytes(seed: u64, len: usize) -> Bytes {
    let mut buf = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut buf);
    Bytes::from(buf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_body_aborts_the_multipart_upload() {
    let Some((b, bucket, server)) = backend_with("p", 5 * MIB, fast_retries()).await else {
        return;
    };
    let body = common::suite::failing_stream(20 * MIB as u64, MIB);
    let err = b
        .put_stream("broken", body, PutMode::Overwrite)
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            Error::Backend {
                transient: false,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("the source broke") && msg.contains("broken"),
        "{msg}"
    );
    assert!(msg.contains(&bucket), "{msg}");
    assert_eq!(
        pending_uploads(server, &bucket).await,
        0,
        "multipart upload left behind"
    );
    assert!(matches!(
        b.head("broken").await,
        Err(Error::NotFound { .. })
    ));
    assert!(b.list("").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_put_aborts_the_multipart_upload() {
    let Some((b, bucket, server)) = backend_with("", 5 * MIB, fast_retries()).await else {
        return;
    };
    // 12 MiB, then a body that never ends: the put is stuck mid-upload until dropped. The
    // body tells when the put has read past the 12 MiB: past its first part, which it reads
    // before it creates the upload, so it holds the upload's id by then and can abort it.
    // (Cancelled between the server creating the upload and the id reaching the put, an
    // upload stays pending until a lifecycle rule on the bucket ends it: S3 gives no way to
    // tell it from another writer's upload of the same key.)
    let (drained, was_drained) = tokio::sync::oneshot::channel();
    let body = chunked(random_bytes(3, 12 * MIB), MIB)
        .chain(futures::stream::once(async move {
            let _ = drained.send(());
            futures::future::pending().await
        }))
        .boxed();
    let put = tokio::spawn(async move { b.put_stream("stuck", body, PutMode::Overwrite).await });
    tokio::time::timeout(Duration::from_secs(20), was_drained)
        .await
        .expect("the put reads its body")
        .unwrap();
    assert_eq!(pending_uploads(server, &bucket).await, 1);
    put.abort();
    assert!(put.await.unwrap_err().is_cancelled());
    let start = Instant::now();
    while pending_uploads(server, &bucket).await != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "upload not aborted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multipart_100mib_round_trip() {
    let Some((b, bucket, server)) = backend_with("big/blobs", 8 * MIB, fast_retries()).await else {
        return;
    };
    let size = 100 * MIB;
    let data = random_bytes(1, size);
    let start = Instant::now();
    // An odd piece size, so parts never line up with the buffers.
    let meta = b
        .put_stream("blob", chunked(data.clone(), 1_000_003), PutMode::Overwrite)
        .await
        .unwrap();
    let put_time = start.elapsed();
    assert_eq!(meta.size, size as u64);
    assert_eq!(meta.key, "blob");
    assert!(
        meta.etag.as_deref().is_some_and(|e| e.contains("-13")),
        "{meta:?}"
    );
    assert_eq!(b.head("blob").await.unwrap().size, size as u64);

    let start = Instant::now();
    let back = b.get("blob").await.unwrap();
    let get_time = start.elapsed();
    assert_eq!(back.len(), size);
    assert_eq!(blake3::hash(&back), blake3::hash(&data));
    let part = 8 * MIB as u64;
    for r in [
        part - 5..part + 5,
        2 * part - 1..2 * part + 1,
        3 * part..3 * part + 1,
        12 * part - 7..size as u64,
        size as u64 - 3..size as u64 + 100,
    ] {
        let got = b.get_range("blob", r.clone()).await.unwrap();
        let end = r.end.min(size as u64) as usize;
        assert_eq!(&got[..], &data[r.start as usize..end], "range {r:?}");
    }
    assert_eq!(pending_uploads(server, &bucket).await, 0);
    // The prefix is part of the real key, and listing strips it again.
    let raw = moto::client(server)
        .list_objects_v2()
        .bucket(&bucket)
        .send()
        .await
        .unwrap();
    let keys: Vec<_> = raw.contents().iter().filter_map(|o| o.key()).collect();
    assert_eq!(keys, ["big/blobs/blob"]);
    let listed = b.list("").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, "blob");
    eprintln!("100 MiB: put {put_time:?}, get {get_time:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listing_pages_past_1000_keys() {
    let Some((b, _, _)) = backend_with("p", 8 * MIB, fast_retries()).await else {
        return;
    };
    let b = Arc::new(b);
    let n = 1_234;
    futures::stream::iter(0..n)
        .map(|i| {
            let b = Arc::clone(&b);
            async move {
                b.put(&format!("k/{i:05}"), Bytes::from(vec![1; i % 3]))
                    .await
            }
        })
        .buffer_unordered(32)
        .for_each(|r| async move {
            r.unwrap();
        })
        .await;
    b.put("other", Bytes::new()).await.unwrap();
    let listed = b.list("k/").await.unwrap();
    assert_eq!(listed.len(), n);
    assert!(listed.windows(2).all(|w| w[0].key < w[1].key));
    assert_eq!(listed[7].key, "k/00007");
    assert_eq!(listed[7].size, 1);
    assert_eq!(b.list("").await.unwrap().len(), n + 1);
}

/// A proxy in front of `upstream` that answers the first `fail_first` connections, and then
/// every `every`-th one (0: none), with `503 SlowDown` and `Connection: close`; it forwards
/// the others.
struct SlowDownProxy {
    endpoint: String,
    refused: Arc<AtomicU64>,
}

async fn slow_down_proxy(upstream: &str, fail_first: u64, every: u64) -> SlowDownProxy {
    let up = url::Url::parse(upstream).unwrap();
    let up = format!(
        "{}:{}",
        up.host_str().unwrap(),
        up.port_or_known_default().unwrap()
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let refused = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&refused);
    tokio::spawn(async move {
        let mut seen = 0u64;
        while let Ok((conn, _)) = listener.accept().await {
            seen += 1;
            if seen <= fail_first || (every > 0 && seen % every == 0) {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(answer_503(conn));
            } else {
                let up = up.clone();
                tokio::spawn(async move {
                    let mut conn = conn;
                    if let Ok(mut upstream) = TcpStream::connect(&up).await {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
                    }
                });
            }
        }
    });
    SlowDownProxy { endpoint, refused }
}

/// Read one request (head and body), answer `503 Slow Down`, close.
async fn answer_503(mut conn: TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    let expect_continue = header("expect:").is_some_and(|v| v == "100-continue");
    let length: usize = header("content-length:")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut have = buf.len() - head_end;
    while !expect_continue && have < length {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => have += n,
        }
    }
    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
                <Message>Please reduce your request rate.</Message>\
                <RequestId>strata-test-proxy</RequestId></Error>";
    let response = format!(
        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(response.as_bytes()).await;
    let _ = conn.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transient_503s_are_retried() {
    let Some(server) = moto::s3_server() else {
        return;
    };
    if !server.endpoint.starts_with("http://") {
        eprintln!("SKIPPED: the 503 proxy needs a plain-http S3 endpoint");
        return;
    }
    for (op, fails, every) in [("put", 3, 0), ("get", 3, 0), ("multipart", 2, 3)] {
        let (direct, bucket, _) = backend_with("r", 5 * MIB, fast_retries()).await.unwrap();
        let data = random_bytes(9, if op == "multipart" { 23 * MIB } else { 1000 });
        if op == "get" {
            direct.put("k", data.clone()).await.unwrap();
        }
        let proxy = slow_down_proxy(&server.endpoint, fails, every).await;
        let b = connect(&proxy.endpoint, &bucket, "r", 5 * MIB, fast_retries()).await;
        if op != "get" {
            let body = chunked(data.clone(), MIB);
            b.put_stream("k", body, PutMode::Overwrite).await.unwrap();
        }
        assert_eq!(b.get("k").await.unwrap(), data, "{op}");
        let refused = proxy.refused.load(Ordering::SeqCst);
        assert!(refused >= fails, "{op}: {refused} refused");
        if every == 0 {
            assert_eq!(refused, fails, "{op}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn endless_503s_hit_the_deadline_with_a_clear_error() {
    let Some(server) = moto::s3_server() else {
        return;
    };
    if !server.endpoint.starts_with("http://") {
        return;
    }
    let proxy = slow_down_proxy(&server.endpoint, u64::MAX, 0).await;
    let retry = RetryPolicy {
        max_attempts: 1000,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(100),
        deadline: Duration::from_secs(1),
        attempt_timeout: Duration::from_secs(1),
    };
    let bucket = moto::new_bucket(server).await;
    let b = connect(&proxy.endpoint, &bucket, "pre", 5 * MIB, retry).await;
    for op in ["get", "put"] {
        let start = Instant::now();
        let err = match op {
            "get" => b.get("some/key").await.unwrap_err(),
            _ => b
                .put("some/key", Bytes::from_static(b"x"))
                .await
                .unwrap_err(),
        };
        let elapsed = start.elapsed();
        let msg = err.to_string();
        assert!(
            matches!(err, Error::DeadlineExceeded { .. } | Error::Backend { .. }),
            "{op}: {msg}"
        );
        assert!(
            msg.contains(&bucket) && msg.contains("some/key"),
            "{op}: {msg}"
        );
        // The last error is the 503, or the final attempt cut short by the deadline.
        let last_is_503 = msg.contains("HTTP 503 SlowDown");
        assert!(last_is_503 || msg.contains("timed out"), "{op}: {msg}");
        assert!(elapsed < Duration::from_secs(5), "{op}: took {elapsed:?}");
        eprintln!("{op}: {msg}");
    }
    assert!(proxy.refused.load(Ordering::SeqCst) > 4);
}

/// A proxy in front of `upstream` that forwards one request per connection (with
/// `Connection: close`, so that a switch applies to the very next request) until `refuse` is
/// set, and then answers every request with `503 SlowDown`, counting them in `refused`.
struct SwitchProxy {
    endpoint: String,
    refuse: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
}

async fn switch_proxy(upstream: &str) -> SwitchProxy {
    let up = url::Url::parse(upstream).unwrap();
    let up = format!(
        "{}:{}",
        up.host_str().unwrap(),
        up.port_or_known_default().unwrap()
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (refuse, refused) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let (switch, counter) = (Arc::clone(&refuse), Arc::clone(&refused));
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            if switch.load(Ordering::SeqCst) {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(answer_503(conn));
            } else {
                tokio::spawn(forward_one(conn, up.clone()));
            }
        }
    });
    SwitchProxy {
        endpoint,
        refuse,
        refused,
    }
}

/// Forward one request without a body (GET, HEAD) to `upstream` with `Connection: close`, and
/// its answer back.
async fn forward_one(mut conn: TcpStream, upstream: String) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end - 4]).into_owned();
    let mut request: String = head
        .split("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .map(|l| format!("{l}\r\n"))
        .collect();
    request.push_str("Connection: close\r\n\r\n");
    let Ok(mut up) = TcpStream::connect(&upstream).await else {
        return;
    };
    if up.write_all(request.as_bytes()).await.is_err() {
        return;
    }
    let _ = tokio::io::copy(&mut up, &mut conn).await;
    let _ = conn.shutdown().await;
}

/// The double-retry regression end to end: S3 behind a store and behind a chunk cache, every
/// request answered `503 SlowDown` (transient). Each read makes exactly its policy's attempts
/// (S3 does not retry underneath), and the error says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_reads_through_the_store_and_the_cache_are_retried_once_over() {
    use fs_cache::chunk::{CacheConfig, ChunkCache, CHUNK_SIZE};
    use fs_cache::{ErrorKind, Store};

    let Some(server) = moto::s3_server() else {
        return;
    };
    if !server.endpoint.starts_with("http://") {
        eprintln!("SKIPPED: the switch proxy needs a plain-http S3 endpoint");
        return;
    }
    let policy = |attempts| RetryPolicy {
        max_attempts: attempts,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        deadline: Duration::from_secs(60),
        attempt_timeout: Duration::from_secs(30),
    };
    let bucket = moto::new_bucket(server).await;
    let s3 = |endpoint: String| {
        let url = format!("s3://{bucket}/r?endpoint={endpoint}&region=us-east-1");
        async move { open_backend(&url).await.unwrap() }
    };
    let direct = Store::new(s3(server.endpoint.clone()).await);
    let data = random_bytes(4, 3 * CHUNK_SIZE as usize);
    let blob = direct.put_blob(data).await.unwrap().digest;

    let proxy = switch_proxy(&server.endpoint).await;
    let store = Store::with_retry(s3(proxy.endpoint.clone()).await, policy(4));
    let config = CacheConfig {
        readahead_bytes: 0,
        retry: policy(3),
        ..CacheConfig::default()
    };
    let cache = ChunkCache::open(store.clone(), config).await.unwrap();
    cache.register(&blob).await.unwrap();
    assert_eq!(proxy.refused.load(Ordering::SeqCst), 0);
    proxy.refuse.store(true, Ordering::SeqCst);

    for (path, attempts) in [("cache", 3), ("store", 4)] {
        let before = proxy.refused.load(Ordering::SeqCst);
        let err = match path {
            "cache" => cache.read(&blob, 10, 100).await.unwrap_err(),
            _ => store.get_blob(&blob).await.unwrap_err(),
        };
        let requests = proxy.refused.load(Ordering::SeqCst) - before;
        eprintln!("{path}: {requests} requests: {err}");
        assert_eq!(requests, attempts, "{path}: {err}");
        assert!(!err.is_transient(), "{path}: {err}");
        assert_eq!(err.kind(), ErrorKind::Backend, "{path}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("after {attempts} attempt(s)")),
            "{msg}"
        );
        assert!(msg.contains("HTTP 503 SlowDown"), "{msg}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_keys_and_buckets_are_not_found() {
    let Some((b, bucket, server)) = backend_with("p", 8 * MIB, fast_retries()).await else {
        return;
    };
    for err in [
        b.get("nope").await.unwrap_err(),
        b.get_range("nope", 0..10).await.unwrap_err(),
        b.get_range("nope", 5..5).await.unwrap_err(),
        b.head("nope").await.unwrap_err(),
    ] {
        assert!(matches!(err, Error::NotFound { .. }), "{err}");
        assert!(err.to_string().contains(&bucket) && err.to_string().contains("nope"));
    }
    b.delete("nope").await.unwrap();

    let url = moto::s3_url(server, "strata-no-such-bucket", "p");
    let missing = open_backend(&url).await.unwrap();
    for err in [
        missing.get("k").await.unwrap_err(),
        missing.get_range("k", 1..2).await.unwrap_err(),
        missing.head("k").await.unwrap_err(),
        missing
            .put("k", Bytes::from_static(b"x"))
            .await
            .unwrap_err(),
        missing.list("").await.unwrap_err(),
    ] {
        assert!(matches!(err, Error::NotFound { .. }), "{err}");
        assert!(err.to_string().contains("strata-no-such-bucket"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn create_refuses_an_existing_key() {
    let Some((b, bucket, server)) = backend_with("c", 5 * MIB, fast_retries()).await else {
        return;
    };
    let b = Arc::new(b);
    b.put_opts("one", Bytes::from_static(b"first"), PutMode::Create)
        .await
        .unwrap();
    let err = b
        .put_opts("one", Bytes::from_static(b"second"), PutMode::Create)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyExists { .. }), "{err}");
    assert!(err.to_string().contains(&bucket) && err.to_string().contains("one"));
    assert_eq!(&b.get("one").await.unwrap()[..], b"first");

    // Multipart: refused up front when the key is already there.
    let big = random_bytes(5, 11 * MIB);
    let err = b
        .put_stream("one", chunked(big.clone(), MIB), PutMode::Create)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyExists { .. }), "{err}");

    // Two multipart creates that both pass the up-front check (a barrier in their bodies
    // holds them until both have started); the second completes only after the first has
    // finished, so only `If-None-Match: *` on CompleteMultipartUpload can refuse it. (Truly
    // simultaneous completions are not tested: moto checks and completes without a lock.)
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let (first_done, first_done_rx) = tokio::sync::oneshot::channel::<()>();
    let body = |data: &Bytes, wait_for: Option<tokio::sync::oneshot::Receiver<()>>| {
        let barrier = Arc::clone(&barrier);
        let (head, tail) = (data.slice(..5 * MIB + 1), data.slice(5 * MIB + 1..));
        futures::stream::iter([Ok(head)])
            .chain(futures::stream::once(async move {
                barrier.wait().await;
                if let Some(rx) = wait_for {
                    let _ = rx.await;
                }
                Ok(tail)
            }))
            .boxed()
    };
    let (d1, d2) = (random_bytes(1, 6 * MIB + 1), random_bytes(2, 6 * MIB + 1));
    let (body1, body2) = (body(&d1, None), body(&d2, Some(first_done_rx)));
    let (r1, r2) = tokio::join!(
        async {
            let r = b.put_stream("race", body1, PutMode::Create).await;
            let _ = first_done.send(());
            r
        },
        b.put_stream("race", body2, PutMode::Create)
    );
    r1.unwrap();
    let err = r2.unwrap_err();
    assert!(matches!(err, Error::AlreadyExists { .. }), "{err}");
    assert_eq!(b.get("race").await.unwrap(), d1);
    assert_eq!(pending_uploads(server, &bucket).await, 0);
}

#[tokio::test]
async fn urls() {
    let parse = |s: &str| S3Config::from_url(&url::Url::parse(s).unwrap());
    let c = parse("s3://bucket").unwrap();
    assert_eq!((c.bucket.as_str(), c.prefix.as_str()), ("bucket", ""));
    assert_eq!(
        (c.endpoint.clone(), c.path_style, c.profile.clone()),
        (None, false, None)
    );
    assert_eq!(c.part_size, 8 * MIB);
    assert_eq!(c.concurrency, 4);
    assert_eq!(c.to_string(), "s3://bucket");
    assert_eq!(parse("s3://bucket/").unwrap().prefix, "");

    let c = parse("s3://my-bucket/a/b/?endpoint=http://127.0.0.1:9000&region=eu-west-1").unwrap();
    assert_eq!(c.prefix, "a/b");
    assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    assert_eq!(c.region, "eu-west-1");
    assert!(c.path_style);
    assert_eq!(c.to_string(), "s3://my-bucket/a/b");

    let c =
        parse("s3://b.example/p?endpoint=https://s3.local/&path_style=false&profile=dev").unwrap();
    assert!(!c.path_style);
    assert_eq!(c.endpoint.as_deref(), Some("https://s3.local"));
    assert_eq!(c.profile.as_deref(), Some("dev"));
    assert_eq!(parse("s3://bkt/my%20layers").unwrap().prefix, "my layers");

    for (url, needle) in [
        ("s3://", "bucket"),
        ("s3:///prefix", "bucket"),
        ("s3://bucket?bogus=1", "bogus"),
        ("s3://bucket?endpoint=ftp://h", "endpoint"),
        ("s3://bucket?endpoint=127.0.0.1:9000", "endpoint"),
        ("s3://bucket?path_style=maybe", "path_style"),
        ("s3://bucket?region=", "region"),
        ("s3://bucket?region=a&region=b", "region"),
        ("s3://bucket/a//b", "prefix"),
        ("s3://bucket/a/.strata-x", "prefix"),
        ("s3://Bad_Bucket", "bucket"),
        ("s3://user:secret@bucket", "user"),
        ("s3://bucket:9000", "port"),
    ] {
        let err = parse(url).unwrap_err();
        assert!(err.contains(needle), "{url}: {err}");
    }

    // Through open_backend: an invalid URL says what was expected; a good one connects
    // without a request.
    let err = open_backend("s3://bucket?bogus=1").await.unwrap_err();
    assert!(matches!(err, Error::InvalidUrl { .. }) && err.to_string().contains("bogus"));
    let b = open_backend("s3://bucket/pre?endpoint=http://127.0.0.1:9&region=us-east-1")
        .await
        .unwrap();
    assert_eq!(b.to_string(), "s3://bucket/pre");
    let mut small = parse("s3://bucket").unwrap();
    small.part_size = MIB;
    let err = S3Backend::connect(small).await.unwrap_err();
    assert!(err.to_string().contains("part_size"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_sweeps_multipart_uploads_left_by_a_dead_put() {
    let Some((b, bucket, server)) = backend_with("store", 5 * MIB, fast_retries()).await else {
        return;
    };
    // Two uploads as a killed put leaves them (one with a part stored), and one of another
    // tenant of the bucket, outside the backend's prefix.
    let client = moto::client(server);
    let mut ids = Vec::new();
    for key in [
        "store/blobs/ab/killed",
        "store/blobs/cd/killed-too",
        "other/upload",
    ] {
        let out = client
            .create_multipart_upload()
            .bucket(&bucket)
            .key(key)
            .send()
            .await
            .unwrap();
        ids.push(out.upload_id().unwrap().to_owned());
    }
    client
        .upload_part()
        .bucket(&bucket)
        .key("store/blobs/ab/killed")
        .upload_id(&ids[0])
        .part_number(1)
        .body(random_bytes(5, 5 * MIB).into())
        .send()
        .await
        .unwrap();
    assert_eq!(pending_uploads(server, &bucket).await, 3);

    // The threshold is against the start the server reports (moto reports a fixed date in
    // 2010 for every upload, so "begun an hour ago" cannot be staged; real S3 reports the
    // time of the create): not swept at that instant, swept a second after it.
    let begun = uploads(server, &bucket)
        .await
        .iter()
        .find(|u| u.upload_id() == Some(ids[0].as_str()))
        .and_then(|u| u.initiated())
        .map(|t| SystemTime::try_from(*t).unwrap())
        .expect("the server reports when an upload began");
    assert!(b.sweep_abandoned(begun, false).await.unwrap().is_empty());
    let later = begun + Duration::from_secs(1);
    // A dry run reports them and leaves them in place.
    let found = b.sweep_abandoned(later, true).await.unwrap();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].starts_with("multipart upload of blobs/ab/killed begun "),
        "{found:?}"
    );
    assert!(found[0].ends_with(&format!("(id {})", ids[0])), "{found:?}");
    assert!(
        found[1].starts_with("multipart upload of blobs/cd/killed-too "),
        "{found:?}"
    );
    assert_eq!(pending_uploads(server, &bucket).await, 3);
    // Swept: only the other tenant's upload is left.
    assert_eq!(b.sweep_abandoned(later, false).await.unwrap(), found);
    let left = uploads(server, &bucket).await;
    let keys: Vec<_> = left.iter().filter_map(|u| u.key()).collect();
    assert_eq!(keys, ["other/upload"]);
    assert!(b.sweep_abandoned(later, false).await.unwrap().is_empty());
}
