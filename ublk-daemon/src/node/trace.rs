//! Access traces on the node: the first time this node mounts a layer, either replay the
//! layer's stored trace as prefetch or, if the store has none, record one.
//!
//! The recording starts when the layer's EROFS is mounted and lasts
//! [`super::NodeConfig::trace_window`]; it catches the demand reads of the layer's blobs by
//! whatever reads the layer meanwhile (the first sandboxes of any stack it is in). The trace is
//! then created beside the layer's meta image in the store (`fs_cache::trace`: create-only, so
//! the first node to finish keeps its trace, and a trace is never replaced by a later node's,
//! which would have seen warm caches); a damaged trace is replaced. A trace is per layer, not
//! per stack: a layer is mounted once per node and shared by every stack that uses it, and
//! what its first readers need (a base OS's shell, loader and libraries) is mostly the same
//! whatever is stacked on it.
//!
//! Nothing here changes what a read returns, and no failure is the mount's: a trace that
//! cannot be fetched, parsed, replayed or stored is logged and left.

use std::time::Duration;

use fs_cache::Digest;

use super::state::LayerState;
use super::Node;

impl Node {
    /// Start the trace work for layer `id`, just mounted (see the module docs). `local`: every
    /// blob of it is read in passthrough mode (nothing goes through the cache: nothing to
    /// record or prefetch).
    pub(super) fn trace_layer(&self, id: &str, layer: &LayerState, local: bool) {
        let window = self.config.trace_window;
        if window.is_zero() || local {
            return;
        }
        let blobs: Vec<Digest> = layer.blobs.iter().map(|b| b.digest).collect();
        let (cache, store) = (self.cache.clone(), self.store.clone());
        let (meta, id) = (layer.meta.digest, id.to_owned());
        // Recording starts before the lookup answers, so the first reads are in it.
        let rec = cache.record(blobs.clone());
        tokio::spawn(async move {
            let replace = match store.trace(&meta, &id).await {
                Ok(Some(t)) if t.blobs == blobs => {
                    drop(rec);
                    let entries = t.entries.len();
                    match cache.replay(t).await {
                        Ok(Ok(s)) => tracing::info!(
                            layer = %id,
                            entries,
                            chunks = s.chunks,
                            fetched = s.fetched,
                            skipped = s.skipped,
                            "replayed the layer's access trace"
                        ),
                        Ok(Err(e)) => {
                            tracing::warn!(layer = %id, error = %e, "trace replay stopped")
                        }
                        Err(e) => tracing::warn!(layer = %id, error = %e, "trace replay died"),
                    }
                    return;
                }
                Ok(Some(_)) => {
                    tracing::warn!(layer = %id, "the stored trace names other blobs; ignored");
                    return;
                }
                Ok(None) => false,
                Err(e) if e.kind() == fs_cache::ErrorKind::Corrupt => {
                    tracing::warn!(layer = %id, error = %e, "recording a new trace");
                    true
                }
                Err(e) => {
                    tracing::warn!(layer = %id, error = %e, "could not look up the layer's trace");
                    return;
                }
            };
            tokio::time::sleep(window).await;
            let trace = cache.finish_recording(rec);
            if trace.entries.is_empty() {
                tracing::debug!(layer = %id, "nothing read in the trace window: no trace");
                return;
            }
            let (entries, bytes) = (trace.entries.len(), trace.bytes());
            match store.put_trace(&meta, &trace, replace).await {
                Ok(_) => {
                    tracing::info!(layer = %id, entries, bytes, "stored the layer's access trace")
                }
                Err(e) if e.kind() == fs_cache::ErrorKind::AlreadyExists => {
                    tracing::debug!(layer = %id, "another node stored the layer's trace first")
                }
                Err(e) => tracing::warn!(layer = %id, error = %e, "could not store the trace"),
            }
        });
    }
}

/// The default [`super::NodeConfig::trace_window`].
pub const DEFAULT_TRACE_WINDOW: Duration = Duration::from_secs(15);
