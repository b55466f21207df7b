//! `FaultyBackend`: a wrapper that injects faults into any backend, for reliability tests.
//!
//! It adds latency, fails operations (transiently or permanently, at a rate or for the next N
//! operations), and damages read bodies (truncates them, or flips one bit). Faults are drawn
//! from a seeded generator so a failing test can be replayed. The configuration can be changed
//! while the backend is in use (a test turns faults on, then off, and checks recovery), and the
//! wrapper counts requests and injected faults so tests can assert how many backend requests a
//! component made. Under a [`RetryingBackend`](super::RetryingBackend) (a store's backend),
//! every attempt is one counted request.

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};

use super::{Backend, ByteStream, ObjectMeta, PutMode, RetryPolicy};
use crate::error::{Error, Result};

/// Which faults to inject. The default injects none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultConfig {
    /// Added before every operation.
    pub latency: Duration,
    /// Probability (0..=1) that an operation fails.
    pub error_rate: f64,
    /// The next this-many operations fail, whatever the rate.
    pub fail_next: u32,
    /// Injected errors are permanent (not retried) instead of transient.
    pub permanent: bool,
    /// Probability that a successful read returns fewer bytes than it should.
    pub truncate_rate: f64,
    /// The next this-many successful (non-empty) reads return fewer bytes than they should.
    pub truncate_next: u32,
    /// Probability that a successful read returns a body with one bit flipped.
    pub bitflip_rate: f64,
    /// The next this-many successful reads return a body with one bit flipped.
    pub bitflip_next: u32,
}

/// What the wrapper saw and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    pub gets: u64,
    pub puts: u64,
    pub heads: u64,
    pub lists: u64,
    pub deletes: u64,
    /// Bytes returned by reads (after any damage).
    pub bytes_read: u64,
    pub injected_errors: u64,
    pub truncated: u64,
    pub flipped: u64,
}

struct State {
    config: FaultConfig,
    stats: FaultStats,
    rng: fastrand::Rng,
}

/// Wraps a backend and injects faults according to a [`FaultConfig`].
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    state: Mutex<State>,
}

impl fmt::Debug for FaultyBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyBackend")
            .field("inner", &self.inner)
            .finish()
    }
}

impl fmt::Display for FaultyBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.inner)
    }
}

#[derive(Clone, Copy)]
enum Op {
    Get,
    Put,
    Head,
    List,
    Delete,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::Put => "put",
            Op::Head => "head",
            Op::List => "list",
            Op::Delete => "delete",
        }
    }
}

impl FaultyBackend {
    /// Wrap `inner` with no faults configured; `seed` makes the injected faults repeatable.
    pub fn new(inner: Arc<dyn Backend>, seed: u64) -> Self {
        Self {
            inner,
            state: Mutex::new(State {
                config: FaultConfig::default(),
                stats: FaultStats::default(),
                rng: fastrand::Rng::with_seed(seed),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is plain counters and a config; a panic elsewhere cannot break it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replace the fault configuration.
    pub fn set(&self, config: FaultConfig) {
        self.lock().config = config;
    }

    /// Change the fault configuration in place.
    pub fn update(&self, f: impl FnOnce(&mut FaultConfig)) {
        f(&mut self.lock().config);
    }

    /// Counters so far.
    pub fn stats(&self) -> FaultStats {
        self.lock().stats
    }

    /// Zero the counters.
    pub fn reset_stats(&self) {
        self.lock().stats = FaultStats::default();
    }

    /// Count the operation, apply latency, and decide whether it fails.
    async fn before(&self, op: Op, key: &str) -> Result<()> {
        let (latency, fail, permanent) = {
            let mut s = self.lock();
            match op {
                Op::Get => s.stats.gets += 1,
                Op::Put => s.stats.puts += 1,
                Op::Head => s.stats.heads += 1,
                Op::List => s.stats.lists += 1,
                Op::Delete => s.stats.deletes += 1,
            }
            let fail = if s.config.fail_next > 0 {
                s.config.fail_next -= 1;
                true
            } else {
                let rate = s.config.error_rate;
                rate > 0.0 && s.rng.f64() < rate
            };
            if fail {
                s.stats.injected_errors += 1;
            }
            (s.config.latency, fail, s.config.permanent)
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if fail {
            return Err(Error::Backend {
                backend: self.inner.to_string(),
                op: op.name(),
                key: key.to_owned(),
                attempts: 1,
                message: format!(
                    "injected {} fault",
                    if permanent { "permanent" } else { "transient" }
                ),
                transient: !permanent,
                source: None,
            });
        }
        Ok(())
    }

    /// Possibly damage a read body.
    fn damage(&self, body: Bytes) -> Bytes {
        let mut s = self.lock();
        let len = body.len() as u64;
        s.stats.bytes_read += len;
        if body.is_empty() {
            return body;
        }
        let (t, b) = (s.config.truncate_rate, s.config.bitflip_rate);
        let truncate_now = if s.config.truncate_next > 0 {
            s.config.truncate_next -= 1;
            true
        } else {
            t > 0.0 && s.rng.f64() < t
        };
        if truncate_now {
            s.stats.truncated += 1;
            let keep = s.rng.usize(..body.len());
            s.stats.bytes_read -= (body.len() - keep) as u64;
            return body.slice(..keep);
        }
        let flip_now = if s.config.bitflip_next > 0 {
            s.config.bitflip_next -= 1;
            true
        } else {
            b > 0.0 && s.rng.f64() < b
        };
        if flip_now {
            s.stats.flipped += 1;
            let at = s.rng.usize(..body.len());
            let bit = s.rng.u8(..8);
            let mut damaged = BytesMut::from(&body[..]);
            damaged[at] ^= 1 << bit;
            return damaged.freeze();
        }
        body
    }
}

#[async_trait]
impl Backend for FaultyBackend {
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        self.before(Op::Get, key).await?;
        let body = self.inner.get_range(key, range).await?;
        Ok(self.damage(body))
    }

    async fn get(&self, key: &str) -> Result<Bytes> {
        self.before(Op::Get, key).await?;
        let body = self.inner.get(key).await?;
        Ok(self.damage(body))
    }

    /// Never on the caller's thread: every read goes through the faults.
    fn get_range_now(&self, _key: &str, _range: Range<u64>) -> Option<Result<Bytes>> {
        None
    }

    async fn put_stream(&self, key: &str, body: ByteStream, mode: PutMode) -> Result<ObjectMeta> {
        self.before(Op::Put, key).await?;
        self.inner.put_stream(key, body, mode).await
    }

    /// One fault decision for the whole put, then the inner backend's own per-request retries.
    async fn put_stream_retrying(
        &self,
        key: &str,
        body: ByteStream,
        mode: PutMode,
        retry: &RetryPolicy,
    ) -> Result<ObjectMeta> {
        self.before(Op::Put, key).await?;
        self.inner.put_stream_retrying(key, body, mode, retry).await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        self.before(Op::Head, key).await?;
        self.inner.head(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        self.before(Op::List, prefix).await?;
        self.inner.list(prefix).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.before(Op::Delete, key).await?;
        self.inner.delete(key).await
    }

    /// Faulted as a listing (it lists before it removes).
    async fn sweep_abandoned(
        &self,
        before: std::time::SystemTime,
        dry_run: bool,
    ) -> Result<Vec<String>> {
        self.before(Op::List, "").await?;
        self.inner.sweep_abandoned(before, dry_run).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;

    #[tokio::test]
    async fn injects_and_counts() {
        let mem = Arc::new(MemoryBackend::new());
        mem.put("k", Bytes::from(vec![7u8; 1000])).await.unwrap();
        let f = FaultyBackend::new(mem, 1);
        assert_eq!(f.get("k").await.unwrap().len(), 1000);

        f.update(|c| c.fail_next = 2);
        assert!(f.get("k").await.unwrap_err().is_transient());
        assert!(f.head("k").await.unwrap_err().is_transient());
        assert!(f.get("k").await.is_ok());

        f.set(FaultConfig {
            bitflip_rate: 1.0,
            ..Default::default()
        });
        let body = f.get("k").await.unwrap();
        assert_eq!(body.len(), 1000);
        let ones: u32 = body.iter().map(|b| (b ^ 7).count_ones()).sum();
        assert_eq!(ones, 1, "exactly one bit flipped");

        f.set(FaultConfig {
            truncate_rate: 1.0,
            ..Default::default()
        });
        assert!(f.get("k").await.unwrap().len() < 1000);

        f.set(FaultConfig {
            fail_next: 1,
            permanent: true,
            ..Default::default()
        });
        assert!(!f.get("k").await.unwrap_err().is_transient());

        let s = f.stats();
        assert_eq!((s.gets, s.heads, s.injected_errors), (6, 1, 3));
        assert_eq!((s.truncated, s.flipped), (1, 1));
    }
}
