//! The node's metrics in Prometheus text format (`strata daemon --metrics ADDR`, `GET
//! /metrics`), encoded by `prometheus-client` from one [`Status`] snapshot: the very numbers
//! `strata status --json` prints, so the two never disagree.
//!
//! | metric | type | labels | from [`Status`] |
//! | --- | --- | --- | --- |
//! | `strata_cache_hits_total` | counter | `level`: `memory` (level 1), `staging` (level-2 readahead), `disk` (level 2) | `cache.hits_memory`, `cache.disk_readahead_hits`, `cache.hits_disk - cache.disk_readahead_hits` |
//! | `strata_cache_misses_total` | counter | | `cache.misses` |
//! | `strata_cache_fetch_unit_misses_total` | counter | `window`: `widened`, `narrowed` | `cache.fetch_unit_widened`, `cache.fetch_unit_narrowed` (misses in blobs of chunks smaller than the fetch unit) |
//! | `strata_cache_read_bytes_total`, `strata_cache_fetched_bytes_total` | counter | | `cache.bytes_read`, `cache.bytes_fetched` |
//! | `strata_layer_read_bytes_total`, `strata_layer_fetched_bytes_total` | counter | `layer` (id), `ref` | `layers[].bytes_read`, `layers[].bytes_fetched` |
//! | `strata_backend_requests_total` | counter | | `cache.backend_requests` |
//! | `strata_backend_errors_total` | counter | `kind` | `cache.backend_errors_by_kind` |
//! | `strata_backend_retries_total` | counter | `cause` | `cache.retries` |
//! | `strata_cache_verify_failures_total`, `strata_cache_corrupt_errors_total` | counter | | `cache.verify_failures`, `cache.corrupt_errors` |
//! | `strata_backend_fetch_duration_seconds` | histogram | | `cache.fetch_latency_us`, `cache.fetch_latency_sum_us` |
//! | `strata_cache_used_bytes`, `strata_cache_capacity_bytes` | gauge | `level`: `memory`, `disk` | `cache.memory_bytes`/`memory_capacity`, `cache.disk.bytes`/`capacity` |
//! | `strata_cache_evictions_total` | counter | `level` | `cache.evictions_memory`, `cache.disk.evictions` |
//! | `strata_cache_disk_full_total` | counter | | `cache.disk.enospc` |
//! | `strata_fuse_requests_in_flight` | gauge | | `node.fuse_requests_in_flight` |
//! | `strata_fuse_reads_total`, `strata_fuse_read_errors_total`, `strata_fuse_read_bytes_total` | counter | | `node.fuse_reads`, `node.fuse_read_errors`, `node.fuse_read_bytes` |
//! | `strata_daemon_rss_bytes`, `strata_daemon_uptime_seconds` | gauge | | `node.rss_bytes`, `node.uptime_seconds` |
//! | `strata_daemon_restarts_total`, `strata_daemon_takeovers_total` | counter | | `node.restarts`, `node.takeovers` |
//! | `strata_meta_pinned_bytes`, `strata_meta_pinned_layers` | gauge | | `node.meta_pinned_bytes`, `node.meta_pinned_layers` |
//!
//! Counters of the cache are cumulative across daemon runs when the cache keeps a stats file
//! (as `strata daemon` does); per-layer bytes count since this daemon started. Bytes per user
//! mount are not given: a layer's kernel mount is shared by every user mount of it, so the
//! node cannot tell through which one a read came.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::proto::Status;

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// `status` in Prometheus text format.
pub fn render(status: &Status) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(status.clone())));
    let mut out = String::new();
    // Writing to a String cannot fail; an encoder error would leave a partial text.
    if prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).is_err() {
        out.clear();
    }
    out
}

/// The resident memory of this process, from `/proc/self/status` (`VmRSS`).
pub fn rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[derive(Debug)]
struct Snapshot(Status);

type Labels = Vec<(&'static str, String)>;

fn series(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    values: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    if let [(labels, v)] = values {
        if labels.is_empty() {
            return value(kind, *v, m);
        }
    }
    for (labels, v) in values {
        value(kind, *v, m.encode_family(labels)?)?;
    }
    Ok(())
}

fn value(
    kind: MetricType,
    v: f64,
    e: prometheus_client::encoding::MetricEncoder,
) -> Result<(), std::fmt::Error> {
    match kind {
        MetricType::Counter => ConstCounter::new(v as u64).encode(e),
        // Whole numbers (bytes, requests) print as integers.
        _ if v.fract() == 0.0 && v.abs() < 9.0e15 => ConstGauge::new(v as i64).encode(e),
        _ => ConstGauge::new(v).encode(e),
    }
}

fn one(v: u64) -> Vec<(Labels, f64)> {
    vec![(Vec::new(), v as f64)]
}

fn by(label: &'static str, values: &[(&str, u64)]) -> Vec<(Labels, f64)> {
    values
        .iter()
        .map(|(k, v)| (vec![(label, (*k).to_owned())], *v as f64))
        .collect()
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use MetricType::{Counter, Gauge};
        let s = &self.0;
        let c = &s.cache;
        let n = &s.node;
        let staging = c.disk_readahead_hits;
        series(
            &mut enc,
            "strata_cache_hits",
            "Chunk lookups served from the node's cache, by level",
            Counter,
            &by(
                "level",
                &[
                    ("memory", c.hits_memory),
                    ("staging", staging),
                    ("disk", c.hits_disk.saturating_sub(staging)),
                ],
            ),
        )?;
        series(
            &mut enc,
            "strata_cache_fetch_unit_misses",
            "Demand misses in blobs of chunks smaller than the fetch unit: widened to their window, or not (its riders went unread lately)",
            Counter,
            &by(
                "window",
                &[
                    ("widened", c.fetch_unit_widened),
                    ("narrowed", c.fetch_unit_narrowed),
                ],
            ),
        )?;
        let plain: [(&str, &str, u64); 6] = [
            (
                "strata_cache_misses",
                "Chunk lookups that needed the backend (demand reads)",
                c.misses,
            ),
            (
                "strata_cache_read_bytes",
                "Bytes returned by the chunk cache",
                c.bytes_read,
            ),
            (
                "strata_cache_fetched_bytes",
                "Bytes received from the backend",
                c.bytes_fetched,
            ),
            (
                "strata_backend_requests",
                "Backend requests of the chunk cache (each counted once whatever its attempts)",
                c.backend_requests,
            ),
            (
                "strata_cache_verify_failures",
                "Chunks whose bytes did not match their digest (backend or local disk)",
                c.verify_failures,
            ),
            (
                "strata_cache_corrupt_errors",
                "Reads failed because a chunk stayed corrupt after its refetch",
                c.corrupt_errors,
            ),
        ];
        for (name, help, v) in plain {
            series(&mut enc, name, help, Counter, &one(v))?;
        }
        let layer = |f: fn(&super::proto::LayerInfo) -> u64| -> Vec<(Labels, f64)> {
            s.layers
                .iter()
                .map(|l| {
                    let labels = vec![("layer", l.id.clone()), ("ref", l.refs.join(","))];
                    (labels, f(l) as f64)
                })
                .collect()
        };
        series(
            &mut enc,
            "strata_layer_read_bytes",
            "Bytes of a layer's data blobs read through the cache since the daemon started",
            Counter,
            &layer(|l| l.bytes_read),
        )?;
        series(
            &mut enc,
            "strata_layer_fetched_bytes",
            "Bytes of a layer's data blobs fetched from the backend since the daemon started",
            Counter,
            &layer(|l| l.bytes_fetched),
        )?;
        let errors: Vec<(&str, u64)> = c
            .backend_errors_by_kind
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        series(
            &mut enc,
            "strata_backend_errors",
            "Backend requests of the chunk cache that failed for good, by error kind",
            Counter,
            &by("kind", &errors),
        )?;
        let retries: Vec<(&str, u64)> = c.retries.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        series(
            &mut enc,
            "strata_backend_retries",
            "Retries of the chunk cache's backend requests, by the cause of the failed attempt",
            Counter,
            &by("cause", &retries),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "strata_backend_fetch_duration_seconds",
                "Duration of the chunk cache's backend requests, all attempts included",
                None,
                MetricType::Histogram,
            )?;
            let last = c.fetch_latency_us.len().saturating_sub(1);
            let buckets: Vec<(f64, u64)> = c
                .fetch_latency_us
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let upper = if i == last {
                        f64::INFINITY
                    } else {
                        (1u64 << i) as f64 / 1e6
                    };
                    (upper, *n)
                })
                .collect();
            let count = c.fetch_latency_us.iter().sum();
            let sum = c.fetch_latency_sum_us as f64 / 1e6;
            m.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        let disk = c.disk.unwrap_or_default();
        series(
            &mut enc,
            "strata_cache_used_bytes",
            "Bytes held by each cache level",
            Gauge,
            &by("level", &[("memory", c.memory_bytes), ("disk", disk.bytes)]),
        )?;
        series(
            &mut enc,
            "strata_cache_capacity_bytes",
            "Configured capacity of each cache level",
            Gauge,
            &by(
                "level",
                &[("memory", c.memory_capacity), ("disk", disk.capacity)],
            ),
        )?;
        series(
            &mut enc,
            "strata_cache_evictions",
            "Chunks evicted from each cache level",
            Counter,
            &by(
                "level",
                &[("memory", c.evictions_memory), ("disk", disk.evictions)],
            ),
        )?;
        series(
            &mut enc,
            "strata_cache_disk_full",
            "Times level 2 found its disk full (ENOSPC, or its reserve reached)",
            Counter,
            &one(disk.enospc),
        )?;
        series(
            &mut enc,
            "strata_fuse_requests_in_flight",
            "FUSE read requests of the blob mount being served now",
            Gauge,
            &one(n.fuse_requests_in_flight),
        )?;
        let fuse: [(&str, &str, u64); 3] = [
            (
                "strata_fuse_reads",
                "FUSE read requests of the blob mount served",
                n.fuse_reads,
            ),
            (
                "strata_fuse_read_errors",
                "FUSE read requests answered with EIO",
                n.fuse_read_errors,
            ),
            (
                "strata_fuse_read_bytes",
                "Bytes returned by FUSE reads of the blob mount",
                n.fuse_read_bytes,
            ),
        ];
        for (name, help, v) in fuse {
            series(&mut enc, name, help, Counter, &one(v))?;
        }
        series(
            &mut enc,
            "strata_daemon_rss_bytes",
            "Resident memory of the daemon process",
            Gauge,
            &one(n.rss_bytes),
        )?;
        series(
            &mut enc,
            "strata_daemon_uptime_seconds",
            "Seconds since this daemon process started serving",
            Gauge,
            &[(Vec::new(), n.uptime_seconds)],
        )?;
        series(
            &mut enc,
            "strata_daemon_restarts",
            "Daemon starts on this run directory that found an earlier daemon's state",
            Counter,
            &one(n.restarts),
        )?;
        series(
            &mut enc,
            "strata_daemon_takeovers",
            "Restarts that took over the earlier daemon's FUSE connection and mounts",
            Counter,
            &one(n.takeovers),
        )?;
        series(
            &mut enc,
            "strata_meta_pinned_bytes",
            "Bytes of mounted layers' meta images kept in memory",
            Gauge,
            &one(n.meta_pinned_bytes),
        )?;
        series(
            &mut enc,
            "strata_meta_pinned_layers",
            "Mounted layers whose meta image is kept in memory",
            Gauge,
            &one(n.meta_pinned_layers),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::proto::{LayerInfo, NodeStats, Pong};
    use fs_cache::chunk::CacheStats;

    #[test]
    fn renders_every_number_of_the_status() {
        let mut cache = CacheStats {
            hits_memory: 5,
            hits_disk: 7,
            disk_readahead_hits: 3,
            misses: 11,
            bytes_read: 1234,
            bytes_fetched: 999,
            backend_requests: 4,
            verify_failures: 2,
            corrupt_errors: 1,
            fetch_unit_widened: 12,
            fetch_unit_narrowed: 13,
            fetch_latency_us: vec![0; 32],
            fetch_latency_sum_us: 1_500_000,
            ..CacheStats::default()
        };
        cache.fetch_latency_us[3] = 2;
        cache.fetch_latency_us[31] = 1;
        cache.retries.insert("throttled".into(), 6);
        cache.backend_errors_by_kind.insert("not_found".into(), 9);
        let status = Status {
            pong: Pong {
                version: 1,
                pid: 1,
                store: "s".into(),
                run_dir: "/r".into(),
            },
            layers: vec![LayerInfo {
                id: "abc".into(),
                refs: vec!["base/os:1".into()],
                meta_bytes: 1,
                blobs: Vec::new(),
                pins: 1,
                users: 0,
                passthrough_blobs: 0,
                mnt: "/m".into(),
                bytes_read: 77,
                bytes_fetched: 66,
                meta_pinned: true,
            }],
            mounts: Vec::new(),
            cache,
            blob_files: Vec::new(),
            node: NodeStats {
                rss_bytes: 4096,
                fuse_requests_in_flight: 2,
                restarts: 3,
                takeovers: 1,
                meta_pinned_bytes: 8192,
                meta_pinned_layers: 1,
                ..NodeStats::default()
            },
        };
        let text = render(&status);
        for line in [
            "strata_cache_hits_total{level=\"memory\"} 5",
            "strata_cache_hits_total{level=\"staging\"} 3",
            "strata_cache_hits_total{level=\"disk\"} 4",
            "strata_cache_misses_total 11",
            "strata_cache_fetch_unit_misses_total{window=\"widened\"} 12",
            "strata_cache_fetch_unit_misses_total{window=\"narrowed\"} 13",
            "strata_cache_read_bytes_total 1234",
            "strata_cache_fetched_bytes_total 999",
            "strata_layer_read_bytes_total{layer=\"abc\",ref=\"base/os:1\"} 77",
            "strata_layer_fetched_bytes_total{layer=\"abc\",ref=\"base/os:1\"} 66",
            "strata_backend_requests_total 4",
            "strata_backend_errors_total{kind=\"not_found\"} 9",
            "strata_backend_retries_total{cause=\"throttled\"} 6",
            "strata_cache_verify_failures_total 2",
            "strata_cache_corrupt_errors_total 1",
            "strata_backend_fetch_duration_seconds_bucket{le=\"4e-06\"} 0",
            "strata_backend_fetch_duration_seconds_bucket{le=\"8e-06\"} 2",
            "strata_backend_fetch_duration_seconds_bucket{le=\"0.001024\"} 2",
            "strata_backend_fetch_duration_seconds_bucket{le=\"+Inf\"} 3",
            "strata_backend_fetch_duration_seconds_count 3",
            "strata_backend_fetch_duration_seconds_sum 1.5",
            "strata_fuse_requests_in_flight 2",
            "strata_daemon_rss_bytes 4096",
            "strata_daemon_restarts_total 3",
            "strata_daemon_takeovers_total 1",
            "strata_meta_pinned_bytes 8192",
            "strata_meta_pinned_layers 1",
            "# TYPE strata_backend_fetch_duration_seconds histogram",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in:\n{text}"
            );
        }
        // Each family is described once.
        assert_eq!(
            text.matches("# TYPE strata_cache_hits_total counter")
                .count(),
            1
        );
    }

    #[test]
    fn rss_is_read() {
        assert!(rss_bytes().is_some_and(|b| b > 0));
    }
}
