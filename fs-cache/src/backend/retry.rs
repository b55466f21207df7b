//! Retries with exponential backoff, full jitter and an overall deadline.
//!
//! Only errors for which [`Error::is_transient`] holds (throttling, 5xx, timeouts, lost
//! connections) are retried. Each attempt also has its own timeout, so a hung connection counts
//! as a transient failure instead of stalling the caller past the deadline.

use std::future::Future;
use std::time::{Duration, Instant};

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
    /// deadline. `op` receives the attempt number, starting at 1.
    pub async fn run<T, F, Fut>(&self, ctx: RetryContext<'_>, mut op: F) -> Result<T>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let start = Instant::now();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let remaining = self.deadline.saturating_sub(start.elapsed());
            let timeout = self
                .attempt_timeout
                .min(remaining.max(Duration::from_millis(1)));
            let result = match tokio::time::timeout(timeout, op(attempt)).await {
                Ok(r) => r,
                Err(_) => Err(Error::Backend {
                    backend: ctx.backend.to_owned(),
                    op: ctx.op,
                    key: ctx.key.to_owned(),
                    attempts: attempt,
                    message: format!("attempt timed out after {timeout:?}"),
                    transient: true,
                    source: None,
                }),
            };
            let err = match result {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            if !err.is_transient() {
                return Err(with_attempts(err, attempt));
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
                return Err(with_attempts(err, attempt));
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

fn with_attempts(err: Error, n: u32) -> Error {
    match err {
        Error::Backend {
            backend,
            op,
            key,
            message,
            transient,
            source,
            ..
        } => Error::Backend {
            backend,
            op,
            key,
            attempts: n,
            message,
            transient,
            source,
        },
        other => other,
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
}
