//! Counters of the chunk cache that an operator scrapes beside [`super::CacheStats`]'s plain
//! ones: bytes read and fetched per blob, backend errors by kind, and the latency of backend
//! requests. Kept apart from `cache.rs` so that the read path only calls one method each.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::error::{Error, ErrorKind};
use crate::store::Digest;

/// Buckets of the log2 latency histograms: bucket `i` counts durations < 2^i µs (the last
/// one everything longer).
pub const LATENCY_BUCKETS: usize = 32;

/// Bytes of one blob read by callers and fetched from the backend, since the cache opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlobStats {
    pub bytes_read: u64,
    pub bytes_fetched: u64,
}

#[derive(Default)]
struct BlobCounters {
    read: AtomicU64,
    fetched: AtomicU64,
}

/// The name of an error kind in counters and metrics labels.
pub fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::NotFound => "not_found",
        ErrorKind::AlreadyExists => "already_exists",
        ErrorKind::InvalidInput => "invalid_input",
        ErrorKind::Corrupt => "corrupt",
        ErrorKind::Transient => "transient",
        ErrorKind::Backend => "backend",
        ErrorKind::Io => "io",
    }
}

/// Every kind [`kind_name`] names, so that each shows up (at 0) before it first happens.
const KINDS: [ErrorKind; 7] = [
    ErrorKind::NotFound,
    ErrorKind::AlreadyExists,
    ErrorKind::InvalidInput,
    ErrorKind::Corrupt,
    ErrorKind::Transient,
    ErrorKind::Backend,
    ErrorKind::Io,
];

/// The log2 bucket of `d` (see [`LATENCY_BUCKETS`]).
pub fn latency_bucket(d: Duration) -> usize {
    let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
    (64 - us.leading_zeros() as usize).min(LATENCY_BUCKETS - 1)
}

#[derive(Default)]
pub(crate) struct Extra {
    /// Every read and fetch counts here: a blob's counters are found under a shared lock
    /// (the write lock only the first time a blob is seen), so concurrent FUSE requests do not
    /// queue on one mutex.
    blobs: RwLock<HashMap<Digest, Arc<BlobCounters>>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    fetch_latency: [AtomicU64; LATENCY_BUCKETS],
    fetch_sum_us: AtomicU64,
}

impl Extra {
    fn blob(&self, d: &Digest) -> Arc<BlobCounters> {
        if let Some(c) = self.blobs.read().unwrap_or_else(|p| p.into_inner()).get(d) {
            return c.clone();
        }
        let mut m = self.blobs.write().unwrap_or_else(|p| p.into_inner());
        m.entry(*d).or_default().clone()
    }

    pub(crate) fn read(&self, d: &Digest, n: u64) {
        self.blob(d).read.fetch_add(n, Ordering::Relaxed);
    }

    /// One backend request of `d` that returned `n` bytes after `took` (all its attempts).
    pub(crate) fn fetched(&self, d: &Digest, n: u64, took: Duration) {
        self.blob(d).fetched.fetch_add(n, Ordering::Relaxed);
        self.fetch_latency[latency_bucket(took)].fetch_add(1, Ordering::Relaxed);
        let us = took.as_micros().min(u128::from(u64::MAX)) as u64;
        self.fetch_sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// A backend request that failed for good.
    pub(crate) fn error(&self, e: &Error) {
        let mut m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(kind_name(e.kind())).or_default() += 1;
    }

    pub(crate) fn blob_stats(&self) -> HashMap<Digest, BlobStats> {
        let m = self.blobs.read().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .map(|(d, c)| {
                let s = BlobStats {
                    bytes_read: c.read.load(Ordering::Relaxed),
                    bytes_fetched: c.fetched.load(Ordering::Relaxed),
                };
                (*d, s)
            })
            .collect()
    }

    /// Errors by kind, every kind listed, on top of `base` (a stats file's).
    pub(crate) fn errors(&self, base: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
        let m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        KINDS
            .iter()
            .map(|k| {
                let name = kind_name(*k);
                let now = m.get(name).copied().unwrap_or(0);
                let was = base.get(name).copied().unwrap_or(0);
                (name.to_owned(), was.saturating_add(now))
            })
            .collect()
    }

    pub(crate) fn fetch_sum_us(&self, base: u64) -> u64 {
        base.saturating_add(self.fetch_sum_us.load(Ordering::Relaxed))
    }

    pub(crate) fn fetch_latency(&self, base: &[u64]) -> Vec<u64> {
        self.fetch_latency
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let was = base.get(i).copied().unwrap_or(0);
                was.saturating_add(c.load(Ordering::Relaxed))
            })
            .collect()
    }
}

/// Retries by cause name, every cause listed, on top of `base` (a stats file's).
pub(crate) fn retries(
    now: &[(crate::backend::retry::RetryCause, u64)],
    base: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    now.iter()
        .map(|(c, n)| {
            let was = base.get(c.name()).copied().unwrap_or(0);
            (c.name().to_owned(), was.saturating_add(*n))
        })
        .collect()
}
