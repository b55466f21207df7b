//! Retries: [`RetryPolicy`] (exponential backoff, full jitter, an overall deadline, a timeout
//! per attempt) and [`RetryingBackend`], the one place it is applied.
//!
//! # One layer of retries
//! Backends retry nothing on their own ([`S3Backend`](super::S3Backend) disables the SDK's
//! retries too). A [`Store`](crate::Store) wraps its backend in a [`RetryingBackend`] under its
//! policy, and everything that goes through the store (blob and manifest operations, gc, the
//! chunk cache) gets that one layer. The chunk cache does not add its own: it runs over the
//! same backend under its own policy ([`Store::with_retry_policy`](crate::Store::with_retry_policy),
//! which replaces the store's policy rather than nesting another). So a read that keeps
//! failing makes exactly `max_attempts` backend requests (fewer if the deadline passes first),
//! whichever path it takes.
//!
//! An operation that is one request (a ranged read, a head, a delete, a put of a buffer) is
//! retried whole. Two are not, and the wrapper hands its policy down to the backend instead
//! ([`Backend::put_stream_retrying`], [`Backend::list_retrying`]): a streaming put, whose body
//! is consumed as it is sent (S3 retries each part and the completion), and a listing, whose
//! length grows with the store (S3 retries each page; the default retries the whole listing
//! without a per-attempt timeout).
//!
//! # Which errors, and what comes out
//! Only errors for which [`Error::is_transient`] holds (throttling, 5xx, timeouts, lost
//! connections) are retried. Each attempt has its own timeout, so a hung connection counts as a
//! transient failure instead of stalling the caller past the deadline. The error returned after
//! the last attempt is final: never transient (so that nobody retries it again), an
//! [`Error::Backend`] that says how many attempts were made (a transient error of another kind
//! is wrapped in one, keeping it as the source), or [`Error::DeadlineExceeded`] when the
//! deadline stopped the retries.

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use super::{Backend, ByteStream, ObjectMeta, PutMode};
use crate::error::{Error, Result};

/// How an operation is retried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first one included (at least 1).
    pub max_attempts: u32,
    /// The backoff cap before the first retry; it doubles on every retry.
    pub initial_backoff: Duration,
    /// The largest backoff cap.
    pub max_backoff: Duration,
    /// No attempt starts after this much time since the first one.
    pub deadline: Duration,
    /// One attempt that takes longer than this is abandoned as a transient timeout.
    pub attempt_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            deadline: Duration::from_secs(60),
            attempt_timeout: Duration::from_secs(30),
        }
    }
}

/// Why an attempt failed transiently (and was retried): what an operator sees in the retry
/// counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryCause {
    /// Throttling: HTTP 429, 503, or a throttling code (`SlowDown`, ...).
    Throttled,
    /// Another 5xx answer (500 `InternalError`, 502, 504, ...).
    ServerError,
    /// The attempt took longer than its timeout (a stalled connection or body).
    Timeout,
    /// The connection failed before an answer came (refused, reset before the headers).
    Connection,
    /// The answer's body broke off or came short (a reset or a cut mid-body, a body shorter
    /// than its `Content-Length` or than the range asked for).
    Body,
    /// Any other transient failure.
    Other,
}

impl RetryCause {
    /// Every cause, in the order of [`Self::name`]'s table.
    pub const ALL: [RetryCause; 6] = [
        RetryCause::Throttled,
        RetryCause::ServerError,
        RetryCause::Timeout,
        RetryCause::Connection,
        RetryCause::Body,
        RetryCause::Other,
    ];

    /// The cause's name in counters and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            RetryCause::Throttled => "throttled",
            RetryCause::ServerError => "server_error",
            RetryCause::Timeout => "timeout",
            RetryCause::Connection => "connection",
            RetryCause::Body => "body",
            RetryCause::Other => "other",
        }
    }

    /// The cause of a failed attempt: the tag a backend put on the error ([`Caused`]), else
    /// what its kind says (a local timeout is [`Self::Timeout`]).
    pub fn of(err: &Error) -> RetryCause {
        match err {
            Error::Shared(e) => RetryCause::of(e),
            Error::Backend {
                source: Some(s), ..
            } => s
                .downcast_ref::<Caused>()
                .map_or(RetryCause::Other, |c| c.cause),
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::TimedOut => {
                RetryCause::Timeout
            }
            _ => RetryCause::Other,
        }
    }
}

/// A backend's error tagged with why it failed (the source of an [`Error::Backend`]; it
/// displays as, and has as its source, the error it wraps).
#[derive(Debug)]
pub struct Caused {
    pub cause: RetryCause,
    pub error: Option<crate::error::BoxError>,
}

impl Caused {
    /// `error` tagged with `cause`, boxed as an [`Error::Backend`] source.
    pub fn boxed(
        cause: RetryCause,
        error: Option<crate::error::BoxError>,
    ) -> crate::error::BoxError {
        Box::new(Caused { cause, error })
    }
}

impl fmt::Display for Caused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.error {
            Some(e) => fmt::Display::fmt(e, f),
            None => f.write_str(self.cause.name()),
        }
    }
}

impl std::error::Error for Caused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error
            .as_ref()
            .map(|e| e.as_ref() as &(dyn std::error::Error + 'static))
    }
}

/// Retries made, by cause (see [`RetryingBackend::retry_stats`]).
#[derive(Debug, Default)]
pub struct RetryStats {
    counts: [AtomicU64; RetryCause::ALL.len()],
}

impl RetryStats {
    fn add(&self, cause: RetryCause) {
        let i = RetryCause::ALL
            .iter()
            .position(|c| *c == cause)
            .unwrap_or(5);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }

    /// `(cause, retries)` for every cause.
    pub fn snapshot(&self) -> Vec<(RetryCause, u64)> {
        RetryCause::ALL
            .iter()
            .zip(&self.counts)
            .map(|(c, n)| (*c, n.load(Ordering::Relaxed)))
            .collect()
    }
}

/// What is being retried, for error messages.
#[derive(Clone, Copy, Debug)]
pub struct RetryContext<'a> {
    pub backend: &'a str,
    pub op: &'static str,
    pub key: &'a str,
}

impl RetryPolicy {
    /// No retries: one attempt with the given timeout.
    pub fn none(attempt_timeout: Duration) -> Self {
        Self {
            max_attempts: 1,
            deadline: attempt_timeout,
            attempt_timeout,
            ..Self::default()
        }
    }

    /// The backoff cap before retry number `retry` (0-based): `initial * 2^retry`, capped.
    fn cap(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry.min(20)).unwrap_or(u32::MAX);
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }

    /// Run `op` until it succeeds, fails permanently, runs out of attempts or passes the
    /// deadline. `op` receives the attempt number, starting at 1. The error returned is final
    /// (see the module docs).
    pub async fn run<T, F, Fut>(&self, ctx: RetryContext<'_>, op: F) -> Result<T>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        self.run_with(ctx, Some(self.attempt_timeout), op).await
    }

    /// [`Self::run`] without the per-attempt timeout, for an operation whose length grows with
    /// its result (a whole listing); the deadline still stops retries.
    pub(crate) async fn run_untimed<T, F, Fut>(&self, ctx: RetryContext<'_>, op: F) -> Result<T>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        self.run_with(ctx, None, op).await
    }

    async fn run_with<T, F, Fut>(
        &self,
        ctx: RetryContext<'_>,
        attempt_timeout: Option<Duration>,
        mut op: F,
    ) -> Result<T>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let start = Instant::now();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let result = match attempt_timeout {
                None => op(attempt).await,
                Some(limit) => {
                    let remaining = self.deadline.saturating_sub(start.elapsed());
                    let timeout = limit.min(remaining.max(Duration::from_millis(1)));
                    match tokio::time::timeout(timeout, op(attempt)).await {
                        Ok(r) => r,
                        Err(_) => Err(Error::Backend {
                            backend: ctx.backend.to_owned(),
                            op: ctx.op,
                            key: ctx.key.to_owned(),
                            attempts: attempt,
                            message: format!("attempt timed out after {timeout:?}"),
                            transient: true,
                            source: Some(Caused::boxed(RetryCause::Timeout, None)),
                        }),
                    }
                }
            };
            let err = match result {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            if !err.is_transient() {
                return Err(final_error(ctx, err, attempt));
            }
            let backoff =
                Duration::from_secs_f64(self.cap(attempt - 1).as_secs_f64() * fastrand::f64());
            let elapsed = start.elapsed();
            if attempt >= self.max_attempts || elapsed + backoff >= self.deadline {
                if elapsed + backoff >= self.deadline && self.max_attempts > 1 {
                    return Err(Error::DeadlineExceeded {
                        backend: ctx.backend.to_owned(),
                        op: ctx.op,
                        key: ctx.key.to_owned(),
                        attempts: attempt,
                        elapsed,
                        last: err.to_string(),
                    });
                }
                return Err(final_error(ctx, err, attempt));
            }
            tracing::debug!(
                backend = ctx.backend,
                op = ctx.op,
                key = ctx.key,
                attempt,
                ?backoff,
                error = %err,
                "transient backend error, retrying"
            );
            tokio::time::sleep(backoff).await;
        }
    }
}

/// The error to return after `attempts` attempts: never transient, and a backend error says
/// how many attempts were made.
fn final_error(ctx: RetryContext<'_>, err: Error, attempts: u32) -> Error {
    match err {
        Error::Backend {
            backend,
            op,
            key,
            attempts: counted,
            message,
            source,
            ..
        } => Error::Backend {
            backend,
            op,
            key,
            attempts: attempts.max(counted),
            message,
            transient: false,
            source,
        },
        other if other.is_transient() => Error::Backend {
            backend: ctx.backend.to_owned(),
            op: ctx.op,
            key: ctx.key.to_owned(),
            attempts,
            message: other.to_string(),
            transient: false,
            source: Some(Box::new(other)),
        },
        other => other,
    }
}

/// A backend whose operations are retried under one [`RetryPolicy`] (see the module docs): the
/// only place retries happen. It displays as the backend it wraps.
#[derive(Clone)]
pub struct RetryingBackend {
    inner: Arc<dyn Backend>,
    name: String,
    policy: RetryPolicy,
    stats: Arc<RetryStats>,
}

impl fmt::Debug for RetryingBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryingBackend")
            .field("inner", &self.inner)
            .field("policy", &self.policy)
            .finish()
    }
}

impl fmt::Display for RetryingBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl RetryingBackend {
    /// Retry `inner`'s operations under `policy`. `inner` should not retry on its own (no
    /// backend of this crate does; a `RetryingBackend` does, so do not wrap one in another:
    /// take its [`Self::inner`] instead).
    pub fn new(inner: Arc<dyn Backend>, policy: RetryPolicy) -> Self {
        Self {
            name: inner.to_string(),
            inner,
            policy,
            stats: Arc::default(),
        }
    }

    /// The retries this wrapper made, by cause.
    pub fn retry_stats(&self) -> &Arc<RetryStats> {
        &self.stats
    }

    /// `policy.run` for one operation, counting each retry under the cause of the attempt
    /// before it (an attempt that left no error was abandoned at its timeout).
    async fn run<T, F, Fut>(&self, op: &'static str, key: &str, mut f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let last: Mutex<Option<RetryCause>> = Mutex::new(None);
        let take = || last.lock().map(|mut l| l.take()).unwrap_or(None);
        self.policy
            .run(self.ctx(op, key), |attempt| {
                if attempt > 1 {
                    self.stats.add(take().unwrap_or(RetryCause::Timeout));
                }
                let fut = f();
                let last = &last;
                async move {
                    let r = fut.await;
                    if let Err(e) = &r {
                        if let Ok(mut l) = last.lock() {
                            *l = Some(RetryCause::of(e));
                        }
                    }
                    r
                }
            })
            .await
    }

    /// The backend without retries.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    fn ctx<'a>(&'a self, op: &'static str, key: &'a str) -> RetryContext<'a> {
        RetryContext {
            backend: &self.name,
            op,
            key,
        }
    }

    /// Read exactly the bytes `range` of `key`, which the caller knows lie inside the object
    /// (the chunk cache reads ranges its chunk table vouches for). A shorter body counts as a
    /// transient failure (a connection cut mid-body that the backend did not notice) and is
    /// retried like any other.
    pub async fn get_range_exact(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        let want = range.end.saturating_sub(range.start);
        self.run("get", key, || {
            let range = range.clone();
            async move {
                let body = self.inner.get_range(key, range.clone()).await?;
                if body.len() as u64 != want {
                    return Err(Error::Backend {
                        backend: self.name.clone(),
                        op: "get",
                        key: key.to_owned(),
                        attempts: 1,
                        message: format!(
                            "short read: {} of {want} bytes at {}",
                            body.len(),
                            range.start
                        ),
                        transient: true,
                        source: Some(Caused::boxed(RetryCause::Body, None)),
                    });
                }
                Ok(body)
            }
        })
        .await
    }
}

#[async_trait]
impl Backend for RetryingBackend {
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        self.run("get", key, || self.inner.get_range(key, range.clone()))
            .await
    }

    /// The inner backend's, once: a caller that gets an error reads again through
    /// [`Self::get_range`], under the retries.
    fn get_range_now(&self, key: &str, range: Range<u64>) -> Option<Result<Bytes>> {
        self.inner.get_range_now(key, range)
    }

    async fn get(&self, key: &str) -> Result<Bytes> {
        self.run("get", key, || self.inner.get(key)).await
    }

    /// Not retried whole (the body is consumed as it is sent): the backend retries each of
    /// its requests under this policy ([`Backend::put_stream_retrying`]).
    async fn put_stream(&self, key: &str, body: ByteStream, mode: PutMode) -> Result<ObjectMeta> {
        self.inner
            .put_stream_retrying(key, body, mode, &self.policy)
            .await
    }

    async fn put_opts(&self, key: &str, body: Bytes, mode: PutMode) -> Result<ObjectMeta> {
        self.run("put", key, || self.inner.put_opts(key, body.clone(), mode))
            .await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        self.run("head", key, || self.inner.head(key)).await
    }

    /// Retried by the backend, page by page where it lists in pages
    /// ([`Backend::list_retrying`]).
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        self.inner.list_retrying(prefix, &self.policy).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.run("delete", key, || self.inner.delete(key)).await
    }

    /// Retried whole (a sweep only removes what is still there), without a per-attempt
    /// timeout: like a listing, it walks everything the store holds.
    async fn sweep_abandoned(&self, before: SystemTime, dry_run: bool) -> Result<Vec<String>> {
        (self.policy)
            .run_untimed(self.ctx("sweep", ""), |_| {
                self.inner.sweep_abandoned(before, dry_run)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn transient() -> Error {
        Error::Backend {
            backend: "t".into(),
            op: "get",
            key: "k".into(),
            attempts: 1,
            message: "503".into(),
            transient: true,
            source: None,
        }
    }

    const CTX: RetryContext<'static> = RetryContext {
        backend: "t",
        op: "get",
        key: "k",
    };

    #[tokio::test]
    async fn retries_transient_then_succeeds() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(1),
            ..RetryPolicy::default()
        };
        let v = policy
            .run(CTX, |_| async {
                if calls.fetch_add(1, Ordering::SeqCst) < 3 {
                    Err(transient())
                } else {
                    Ok(7)
                }
            })
            .await
            .unwrap();
        assert_eq!(v, 7);
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn permanent_errors_are_not_retried() {
        let calls = AtomicU32::new(0);
        let err = RetryPolicy::default()
            .run(CTX, |_| async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(Error::NotFound {
                    backend: "t".into(),
                    key: "k".into(),
                })
            })
            .await
            .unwrap_err();
        assert!(err.is_not_found());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn deadline_bounds_total_time() {
        let policy = RetryPolicy {
            max_attempts: 1000,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(20),
            deadline: Duration::from_millis(200),
            attempt_timeout: Duration::from_millis(50),
        };
        let start = Instant::now();
        let err = policy
            .run(CTX, |_| async { Err::<(), _>(transient()) })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::DeadlineExceeded { .. }), "{err}");
        assert!(start.elapsed() < Duration::from_millis(400));
        assert!(err.to_string().contains("get k"), "{err}");
    }

    #[tokio::test]
    async fn hung_attempts_time_out_and_are_retried() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(1),
            attempt_timeout: Duration::from_millis(30),
            ..RetryPolicy::default()
        };
        let v = policy
            .run(CTX, |n| {
                calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 1 {
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    }
                    Ok(n)
                }
            })
            .await
            .unwrap();
        assert_eq!(v, 2);
    }

    #[tokio::test]
    async fn the_error_after_the_last_attempt_is_final_and_counts_them() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(1),
            ..RetryPolicy::default()
        };
        let err = policy
            .run(CTX, |_| async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(transient())
            })
            .await
            .unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert!(!err.is_transient(), "{err}");
        assert_eq!(err.kind(), crate::ErrorKind::Backend);
        assert!(matches!(err, Error::Backend { attempts: 3, .. }), "{err:?}");
        assert!(err.to_string().contains("after 3 attempt(s)"), "{err}");

        // A transient error of another kind is wrapped, keeping it as the source.
        let err = policy
            .run(CTX, |_| async {
                Err::<(), _>(Error::io(
                    "read",
                    "/x",
                    std::io::Error::from(std::io::ErrorKind::TimedOut),
                ))
            })
            .await
            .unwrap_err();
        assert!(!err.is_transient(), "{err}");
        assert!(err
            .to_string()
            .contains("get k failed after 3 attempt(s): read /x"));
        assert!(std::error::Error::source(&err).is_some());

        // So is the one attempt of a policy without retries.
        let err = RetryPolicy::none(Duration::from_secs(1))
            .run(CTX, |_| async { Err::<(), _>(transient()) })
            .await
            .unwrap_err();
        assert!(!err.is_transient() && err.to_string().contains("after 1 attempt(s)"));
    }

    #[tokio::test]
    async fn retries_are_counted_by_cause() {
        use crate::backend::MemoryBackend;
        let mem = Arc::new(MemoryBackend::new());
        mem.put("k", Bytes::from_static(b"hello")).await.unwrap();
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(1),
            attempt_timeout: Duration::from_millis(50),
            ..RetryPolicy::default()
        };
        let b = RetryingBackend::new(mem, policy);
        let count = |cause: RetryCause| {
            b.retry_stats()
                .snapshot()
                .into_iter()
                .find(|(c, _)| *c == cause)
                .map_or(0, |(_, n)| n)
        };
        let tagged = |cause| Error::Backend {
            backend: "t".into(),
            op: "get",
            key: "k".into(),
            attempts: 1,
            message: "m".into(),
            transient: true,
            source: Some(Caused::boxed(cause, None)),
        };
        // Two throttled attempts, one that hangs past its timeout, then one that works.
        let calls = AtomicU32::new(0);
        let v = b
            .run("get", "k", || {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    match n {
                        0 | 1 => Err(tagged(RetryCause::Throttled)),
                        2 => {
                            tokio::time::sleep(Duration::from_secs(10)).await;
                            Ok(0)
                        }
                        _ => Ok(n),
                    }
                }
            })
            .await
            .unwrap();
        assert_eq!(v, 3);
        assert_eq!(count(RetryCause::Throttled), 2);
        assert_eq!(count(RetryCause::Timeout), 1);
        // A short body of an exact read is a body retry; an untagged error is `other`.
        let _ = b.get_range_exact("k", 0..9).await.unwrap_err();
        assert_eq!(count(RetryCause::Body), 7);
        let calls = AtomicU32::new(0);
        b.run("get", "k", || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Err(transient())
                } else {
                    Ok(())
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(count(RetryCause::Other), 1);
        assert_eq!(count(RetryCause::Connection), 0);
        assert_eq!(
            RetryCause::of(&tagged(RetryCause::Connection)),
            RetryCause::Connection
        );
    }

    #[tokio::test]
    async fn the_wrapper_retries_each_operation_once_over() {
        use crate::backend::{FaultConfig, FaultyBackend, MemoryBackend};
        let mem = Arc::new(MemoryBackend::new());
        mem.put("k", Bytes::from_static(b"hello")).await.unwrap();
        let faulty = Arc::new(FaultyBackend::new(mem, 1));
        let policy = RetryPolicy {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(1),
            ..RetryPolicy::default()
        };
        let b = RetryingBackend::new(faulty.clone(), policy);
        assert_eq!(b.to_string(), faulty.to_string());

        // Transient faults that stop in time are absorbed...
        faulty.update(|c| c.fail_next = 3);
        assert_eq!(&b.get("k").await.unwrap()[..], b"hello");
        assert_eq!(faulty.stats().gets, 4);
        // ...and a short body is retried by an exact read.
        faulty.reset_stats();
        faulty.set(FaultConfig {
            truncate_rate: 1.0,
            ..FaultConfig::default()
        });
        let err = b.get_range_exact("k", 0..5).await.unwrap_err();
        assert!(err.to_string().contains("short read"), "{err}");
        assert_eq!(faulty.stats().gets, 4);

        // Faults that go on: every operation gives up after exactly four attempts.
        faulty.set(FaultConfig {
            error_rate: 1.0,
            ..FaultConfig::default()
        });
        faulty.reset_stats();
        let errors = [
            b.get("k").await.unwrap_err(),
            b.get_range("k", 0..2).await.unwrap_err(),
            b.head("k").await.unwrap_err(),
            b.put("k", Bytes::from_static(b"x")).await.unwrap_err(),
            b.list("").await.unwrap_err(),
            b.delete("k").await.unwrap_err(),
        ];
        for err in &errors {
            assert!(!err.is_transient(), "{err}");
            assert!(err.to_string().contains("after 4 attempt(s)"), "{err}");
        }
        let s = faulty.stats();
        assert_eq!(
            (s.gets, s.heads, s.puts, s.lists, s.deletes),
            (8, 4, 4, 4, 4)
        );

        // A streaming put cannot be replayed: one attempt (a backend that sends its body in
        // pieces retries each of them, see S3).
        faulty.reset_stats();
        let body = futures::stream::once(async { Ok(Bytes::from_static(b"x")) });
        let err = b
            .put_stream("k", Box::pin(body), PutMode::Overwrite)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("injected"), "{err}");
        assert_eq!(faulty.stats().puts, 1);
    }
}
