//! Garbage collection: remove blobs that no manifest references.
//!
//! # Safety against concurrent pushes
//! A push uploads its blobs first and its manifest last, so for a while a new blob is stored
//! but referenced by nothing. gc therefore never removes a blob that was uploaded, or whose lease
//! was renewed (a push that found the blob already stored renews it, see [`crate::store`]), within
//! the grace period (default one hour). gc reads every manifest before deciding and reads the
//! manifest list again just before deleting; it aborts, deleting nothing, if any manifest cannot
//! be read or parsed. Sidecars (`blobs/xx/<d>.<suffix>`) go with their blob. Objects under
//! `blobs/` that are not named by a digest are reported and left alone.
//!
//! # Abandoned puts
//! A put whose process died half-way leaves what no listing shows and nothing else removes:
//! a POSIX temporary file, an S3 multipart upload (whose parts are stored, and billed, until
//! aborted). gc sweeps those begun or last written more than `abandoned_after` ago (default
//! a day: far longer than any put takes, so a live one is never cut off;
//! [`crate::Backend::sweep_abandoned`]).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

use crate::error::Result;
use crate::layer::LayerRef;
use crate::store::{blob_of_key, Digest, Store};

/// How gc runs.
#[derive(Clone, Copy, Debug)]
pub struct GcOptions {
    /// Blobs uploaded or leased more recently than this are kept.
    pub grace: Duration,
    /// Report what would be removed, remove nothing.
    pub dry_run: bool,
    /// Leftovers of puts begun (or last written) longer ago than this are swept (module
    /// docs).
    pub abandoned_after: Duration,
}

/// [`GcOptions::abandoned_after`] by default: a day.
pub const DEFAULT_ABANDONED_AFTER: Duration = Duration::from_secs(24 * 3600);

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(3600),
            dry_run: false,
            abandoned_after: DEFAULT_ABANDONED_AFTER,
        }
    }
}

/// What gc found and did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GcReport {
    pub manifests: usize,
    pub blobs: usize,
    pub referenced: usize,
    pub kept_recent: usize,
    /// Blobs removed (or, in a dry run, that would be).
    pub removed: Vec<String>,
    pub removed_bytes: u64,
    pub removed_objects: usize,
    pub expired_leases: usize,
    /// Keys under `blobs/` that are not blobs; left alone.
    pub unrecognised: Vec<String>,
    /// Leftovers of puts that never finished, swept (or, in a dry run, that would be).
    pub abandoned_puts: Vec<String>,
    pub dry_run: bool,
}

async fn referenced(store: &Store) -> Result<(HashSet<Digest>, HashSet<LayerRef>)> {
    let layers = store.list_layers().await?;
    let manifests: Vec<_> = futures::stream::iter(layers.iter().cloned())
        .map(|l| async move { store.manifest(&l).await })
        .buffered(16)
        .try_collect()
        .await?;
    let digests = manifests
        .iter()
        .flat_map(|m| m.all_blobs().map(|b| b.digest))
        .collect();
    Ok((digests, layers.into_iter().collect()))
}

fn is_recent(now: SystemTime, t: Option<SystemTime>, grace: Duration) -> bool {
    match t {
        // A time in the future (clock skew) counts as recent.
        Some(t) => now.duration_since(t).map_or(true, |age| age < grace),
        // Unknown age: keep.
        None => true,
    }
}

/// Collect unreferenced blobs older than the grace period.
pub async fn collect(store: &Store, opts: GcOptions) -> Result<GcReport> {
    let backend = store.backend();
    let now = SystemTime::now();
    let mut report = GcReport {
        dry_run: opts.dry_run,
        ..Default::default()
    };

    // Objects first, references second: a blob uploaded after this listing is not a candidate.
    let objects = backend.list("blobs/").await?;
    let mut by_blob: HashMap<Digest, Vec<crate::backend::ObjectMeta>> = HashMap::new();
    for o in objects {
        match blob_of_key(&o.key) {
            Some(d) => by_blob.entry(d).or_default().push(o),
            None => report.unrecognised.push(o.key),
        }
    }
    let leases: HashMap<String, Option<SystemTime>> = backend
        .list("leases/")
        .await?
        .into_iter()
        .map(|m| (m.key, m.last_modified))
        .collect();
    let (refs, layers) = referenced(store).await?;
    report.manifests = layers.len();

    let mut candidates = Vec::new();
    for (d, objs) in by_blob {
        let blob_key = crate::store::blob_key(&d);
        let Some(main) = objs.iter().find(|o| o.key == blob_key) else {
            // Sidecars whose blob is gone: collect them once they are old.
            if objs
                .iter()
                .all(|o| !is_recent(now, o.last_modified, opts.grace))
            {
                candidates.push((d, objs));
            }
            continue;
        };
        report.blobs += 1;
        if refs.contains(&d) {
            report.referenced += 1;
            continue;
        }
        let lease = leases.get(&crate::store::lease_key(&d)).copied().flatten();
        if is_recent(now, main.last_modified, opts.grace)
            || (lease.is_some() && is_recent(now, lease, opts.grace))
        {
            report.kept_recent += 1;
            continue;
        }
        candidates.push((d, objs));
    }

    // Look again for manifests pushed while we were deciding.
    if !candidates.is_empty() {
        let (late_refs, _) = referenced(store).await?;
        candidates.retain(|(d, _)| !late_refs.contains(d));
    }
    candidates.sort_by_key(|(d, _)| *d);

    for (d, objs) in &candidates {
        report.removed.push(d.to_hex());
        report.removed_objects += objs.len();
        report.removed_bytes += objs.iter().map(|o| o.size).sum::<u64>();
        if opts.dry_run {
            continue;
        }
        // Sidecars first, the blob last: an interrupted gc leaves at worst a blob without its
        // sidecars, still recognisably a blob, which the next run collects.
        let blob_key = crate::store::blob_key(d);
        for o in objs.iter().filter(|o| o.key != blob_key) {
            backend.delete(&o.key).await?;
        }
        // Only a blob gc saw is deleted: a candidate of old sidecars alone may have its blob
        // being stored right now (its table is written first).
        if objs.iter().any(|o| o.key == blob_key) {
            backend.delete(&blob_key).await?;
            backend.delete(&crate::store::lease_key(d)).await?;
        }
    }

    for (key, when) in &leases {
        if !is_recent(now, *when, opts.grace) {
            report.expired_leases += 1;
            if !opts.dry_run {
                backend.delete(key).await?;
            }
        }
    }

    if let Some(before) = now.checked_sub(opts.abandoned_after) {
        report.abandoned_puts = backend.sweep_abandoned(before, opts.dry_run).await?;
    }
    Ok(report)
}
