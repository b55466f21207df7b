//! `pack-diff`: a sandbox's upper → a new lazy EROFS layer whose parents are the sandbox's
//! stack; and `fork`: a pack to a snapshot layer, then N sandboxes from it.
//!
//! # The steps of a pack
//! 1. The sandbox's stack is mounted on its own, read-only, at `<dir>/<id>/pack/lower`
//!    (the node's mount of the same layers: shared, nothing fetched twice).
//! 2. A running sandbox is frozen (the runtime's freezer) for a consistent view; a paused or
//!    stopped one is packed as it is. The walk ([`diff`]) decides every upper entry —
//!    stripped as residue ([`residue`]), dropped as unchanged, packed — and scans what is
//!    packed for the builder's secrets ([`secrets`]); then `erofs_builder` builds the layer
//!    from the upper, leaving out what the walk excluded. The sandbox is thawed as soon as
//!    the build has read the upper (before the upload); the result says how long it was
//!    frozen.
//! 3. The meta image and the blob are pushed, then the manifest with `parents` = the stack
//!    and `built_by` = the sandbox, its node, its machine id, its stack and the names of its
//!    secrets. A secret found anywhere in what would be packed refuses the pack, naming
//!    every file; nothing is pushed.
//!
//! # Invariants
//! - Packing costs in proportion to the upper: the lower is only looked up for the entries
//!   the upper has (and read only for files whose every attribute already matches).
//! - The parents plus the new layer, stacked, show exactly the tree the sandbox showed
//!   (every attribute, bytes, xattrs, whiteouts, opaque directories), minus the stripped
//!   residue and the mtimes of directories dropped as unchanged.
//! - Nothing is left behind: the lower view is unmounted and `<dir>/<id>/pack` removed,
//!   whatever failed; a sandbox frozen by the pack is thawed on every path.

pub mod diff;
pub mod residue;
pub mod secrets;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use fs_cache::{BuiltBy, LayerRef, Manifest};
use serde::{Deserialize, Serialize};
use ublk_daemon::node::proto::{ApiError, ErrorKind, Request as NodeRequest};

use crate::manager::{now_ms, Manager};
use crate::proto::{CreateRequest, SandboxInfo, SandboxState};
use crate::{Error, Result};

/// Most layers a stack expands to (a cycle or a hostile manifest chain stops here).
const MAX_STACK: usize = 64;
/// Most sandboxes one fork makes.
pub const MAX_FORK: u32 = 64;

/// `sandbox_pack`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackRequest {
    pub id: String,
    /// The new layer, `KIND/NAME:VERSION`.
    pub name: String,
    /// Extra residue rules (gitignore syntax), after the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strip: Option<String>,
    /// Leave the default rules out (only `strip` applies).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_default_strip: bool,
}

/// What a pack did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackResult {
    pub layer: String,
    /// The stack under it, lowest first (its manifest's `parents`).
    pub parents: Vec<String>,
    /// `created`, or `exists` when the same content was pushed before under that name.
    pub outcome: String,
    /// How long the sandbox was frozen for the pack (none: it was not running).
    pub frozen_ms: Option<u64>,
    pub walk_ms: u64,
    pub build_ms: u64,
    pub push_ms: u64,
    pub total_ms: u64,
    pub upper_entries: u64,
    pub packed_entries: u64,
    pub packed_files: u64,
    pub packed_bytes: u64,
    pub meta_bytes: u64,
    /// Bytes of the layer's own data blobs: the main blob and its tails blob.
    pub blob_bytes: u64,
    pub whiteouts: u64,
    pub opaque_dirs: u64,
    /// Whiteouts of names the stack does not have (dropped).
    pub noop_whiteouts: u64,
    pub stripped_count: u64,
    /// The first 1000 stripped paths.
    pub stripped: Vec<diff::Stripped>,
    pub unchanged_count: u64,
    /// The first 1000 entries dropped as identical to the stack's.
    pub unchanged: Vec<String>,
    /// Names that look like OCI whiteouts (`.wh.*`): packed as plain files, refused by an
    /// OCI export.
    pub disguised_whiteouts: Vec<String>,
}

/// `sandbox_fork`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkResult {
    pub pack: PackResult,
    pub sandboxes: Vec<SandboxInfo>,
}

fn node_err(e: ApiError) -> Error {
    Error::Node(e)
}

fn store_err(what: &str, e: &fs_cache::Error) -> Error {
    Error::Node(ApiError::from_store(what, e))
}

impl Manager {
    /// The full stack of `layers`: each one's `parents` (recursively) before it, every
    /// layer once, lowest first. Manifests are immutable, so expansions are remembered.
    pub(crate) async fn expand_stack(&self, layers: &[String]) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        for l in layers {
            let r: LayerRef = l.parse().map_err(|e: fs_cache::Error| {
                Error::Node(ApiError::new(ErrorKind::UnknownLayer, e.to_string()))
            })?;
            let below = self.parents_of(&r).await?;
            for p in below.iter().chain(std::iter::once(&r.to_string())) {
                if !out.contains(p) {
                    out.push(p.clone());
                }
            }
            if out.len() > MAX_STACK {
                return Err(Error::InvalidSpec(format!(
                    "the stack of {l} has more than {MAX_STACK} layers"
                )));
            }
        }
        Ok(out)
    }

    /// Every layer under `r` (its parents' parents first), not `r` itself.
    async fn parents_of(&self, r: &LayerRef) -> Result<Vec<String>> {
        let key = r.to_string();
        if let Some(v) = self
            .stacks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(v.clone());
        }
        let mut out: Vec<String> = Vec::new();
        // Depth-first over `parents`; `seen` stops cycles.
        let mut seen = std::collections::HashSet::from([key.clone()]);
        let mut todo: Vec<(LayerRef, bool)> = vec![(r.clone(), false)];
        while let Some((l, expanded)) = todo.pop() {
            if expanded {
                let s = l.to_string();
                if s != key && !out.contains(&s) {
                    out.push(s);
                }
                continue;
            }
            let m = match self.node.store().manifest(&l).await {
                Ok(m) => m,
                // A layer that is not stored fails where it is mounted, with the node's
                // message; a missing parent is named here.
                Err(fs_cache::Error::NotFound { .. }) if l == *r => return Ok(Vec::new()),
                Err(e) => return Err(store_err(&format!("the manifest of {l}"), &e)),
            };
            todo.push((l.clone(), true));
            for p in m.parents.iter().rev() {
                if seen.insert(p.to_string()) {
                    todo.push((p.clone(), false));
                }
            }
            if seen.len() > MAX_STACK {
                return Err(Error::InvalidSpec(format!(
                    "the stack of {r} has more than {MAX_STACK} layers"
                )));
            }
        }
        self.stacks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, out.clone());
        Ok(out)
    }

    /// Remove layer `layer` from the store (a tombstone stays; its blobs go at a gc).
    pub async fn remove_layer(&self, layer: &str) -> Result<()> {
        let r: LayerRef = layer
            .parse()
            .map_err(|e: fs_cache::Error| Error::InvalidSpec(e.to_string()))?;
        self.node
            .store()
            .remove_layer(&r)
            .await
            .map(|_| ())
            .map_err(|e| store_err(&format!("remove {layer}"), &e))
    }

    /// Pack sandbox `req.id`'s upper into layer `req.name` (see the module docs).
    pub async fn pack_diff(&self, req: PackRequest) -> Result<PackResult> {
        let t0 = Instant::now();
        let layer: LayerRef = req
            .name
            .parse()
            .map_err(|e: fs_cache::Error| Error::InvalidSpec(e.to_string()))?;
        let rules = residue::Rules::new(!req.no_default_strip, req.strip.as_deref())?;
        let sb = self.get(&req.id)?;
        let _life = sb.lifecycle.lock().await;
        let record = sb.record();
        let freeze = match record.state {
            SandboxState::Running => true,
            SandboxState::Paused | SandboxState::Suspended | SandboxState::Stopped => false,
            s => {
                return Err(Error::Conflict(format!(
                    "sandbox {} is {s:?}: nothing to pack yet",
                    req.id
                )))
            }
        };
        let mut secret_values = Vec::new();
        for name in &record.secret_names {
            let p = sb.dir.join("secrets").join(name);
            let v = std::fs::read(&p).map_err(|e| {
                Error::Refused(format!(
                    "secret {name} of sandbox {} cannot be read ({e}), so the packed files \
                     cannot be checked for it",
                    req.id
                ))
            })?;
            secret_values.push((name.clone(), v));
        }
        let scanner = secrets::Scanner::new(&secret_values)?;
        let upper = self.upper_of(&sb);
        let work = sb.dir.join("pack");
        let lower = work.join("lower");
        let out = work.join("out");
        self.drop_pack_view(&sb.dir).await?;
        for d in [&lower, &out] {
            std::fs::create_dir_all(d)
                .map_err(|e| Error::io(format!("create {}", d.display()), e))?;
        }
        let mounted = self
            .node
            .handle(NodeRequest::Mount {
                layers: record.layers.clone(),
                mountpoint: lower.clone(),
                upper: None,
                work: None,
            })
            .await
            .map_err(node_err);
        let result = match mounted {
            Ok(_) => {
                let r = self
                    .frozen_build(&req.id, freeze, &upper, &lower, &out, rules, scanner)
                    .await;
                if let Err(e) = self
                    .node
                    .handle(NodeRequest::Umount {
                        mountpoint: lower.clone(),
                    })
                    .await
                {
                    tracing::warn!("pack of {}: unmounting its lower view: {e}", req.id);
                }
                r
            }
            Err(e) => Err(e),
        };
        let pushed = match result {
            Ok(built) => self.push(&sb.dir, &record, &layer, built, &out).await,
            Err(e) => Err(e),
        };
        self.drop_pack_view(&sb.dir).await?;
        let mut result = pushed?;
        result.total_ms = t0.elapsed().as_millis() as u64;
        Ok(result)
    }

    /// Freeze (if asked), walk, build, thaw.
    #[allow(clippy::too_many_arguments)]
    async fn frozen_build(
        &self,
        id: &str,
        freeze: bool,
        upper: &Path,
        lower: &Path,
        out: &Path,
        rules: residue::Rules,
        scanner: secrets::Scanner,
    ) -> Result<Built> {
        let t = Instant::now();
        if freeze {
            self.runtime.pause(id).await?;
        }
        let (u, l, o) = (upper.to_path_buf(), lower.to_path_buf(), out.to_path_buf());
        let built =
            tokio::task::spawn_blocking(move || walk_and_build(&u, &l, &o, &rules, &scanner))
                .await
                .map_err(|e| Error::Runtime(format!("pack task: {e}")));
        let frozen_ms = freeze.then(|| t.elapsed().as_millis() as u64);
        if freeze {
            // Thawed on every path; a failed thaw leaves the sandbox frozen and says so.
            if let Err(e) = self.runtime.resume(id).await {
                return Err(Error::Runtime(format!(
                    "sandbox {id} could not be thawed after its pack ({e}); `strata sandbox \
                     resume {id}` thaws it"
                )));
            }
        }
        let mut built = built??;
        built.frozen_ms = frozen_ms;
        Ok(built)
    }

    async fn push(
        &self,
        dir: &Path,
        record: &crate::Record,
        layer: &LayerRef,
        built: Built,
        out: &Path,
    ) -> Result<PackResult> {
        let t = Instant::now();
        let store = self.node.store();
        let mut own = vec![fs_cache::BlobFile::new(
            out.join("blob"),
            fs_cache::Digest(built.stats.blob_blake3),
            fs_cache::chunk::CHUNK_SIZE,
        )];
        if let Some(t) = &built.stats.tails {
            own.push(fs_cache::BlobFile::new(
                out.join("tails"),
                fs_cache::Digest(t.blake3),
                u64::from(t.chunk_size),
            ));
        }
        let (meta, own) = store
            .put_built_layer(
                &out.join("meta.erofs"),
                &own,
                fs_cache::Compression::default(),
            )
            .await
            .map_err(|e| store_err("store the layer's meta image and blobs", &e))?;
        let parents = record
            .layers
            .iter()
            .map(|l| l.parse::<LayerRef>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::InvalidSpec(e.to_string()))?;
        let mut m = Manifest::new(
            layer.clone(),
            Some(meta.blob_ref()),
            own.iter().map(|p| p.blob_ref()).collect(),
            format!("sandbox:{}", record.id),
        );
        m.parents = parents.clone();
        m.built_by = Some(BuiltBy {
            sandbox: record.id.clone(),
            node: rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned(),
            identity: std::fs::read_to_string(dir.join("etc/machine-id"))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default(),
            stack: parents,
            secret_names: record.secret_names.clone(),
        });
        let outcome = store
            .push_manifest(&m)
            .await
            .map_err(|e| store_err(&format!("push {layer}"), &e))?;
        let plan = built.plan;
        Ok(PackResult {
            layer: layer.to_string(),
            parents: record.layers.clone(),
            outcome: format!("{outcome:?}").to_lowercase(),
            frozen_ms: built.frozen_ms,
            walk_ms: built.walk_ms,
            build_ms: built.build_ms,
            push_ms: t.elapsed().as_millis() as u64,
            total_ms: 0,
            upper_entries: plan.upper_entries,
            packed_entries: plan.packed_entries,
            packed_files: plan.packed_files,
            packed_bytes: plan.packed_bytes,
            meta_bytes: meta.size,
            blob_bytes: own.iter().map(|p| p.size).sum(),
            whiteouts: plan.whiteouts,
            opaque_dirs: plan.opaque_dirs,
            noop_whiteouts: plan.noop_whiteouts,
            stripped_count: plan.stripped_count,
            stripped: plan.stripped,
            unchanged_count: plan.unchanged_count,
            unchanged: plan.unchanged,
            disguised_whiteouts: plan.disguised,
        })
    }

    /// Pack sandbox `id` to a snapshot layer (`snapshot/fork-<id>:<ms>`) and create `count`
    /// sandboxes from it, each with a fresh upper and identity and the source's limits,
    /// environment, network and idle timeout, but none of its secrets.
    pub async fn fork(self: Arc<Self>, id: String, count: u32) -> Result<ForkResult> {
        if count == 0 || count > MAX_FORK {
            return Err(Error::InvalidSpec(format!(
                "--count {count}: between 1 and {MAX_FORK}"
            )));
        }
        let id = id.as_str();
        let record = self.get(id)?.record();
        let name = format!("snapshot/fork-{id}:{}", now_ms());
        let pack = self
            .pack_diff(PackRequest {
                id: id.to_owned(),
                name: name.clone(),
                ..PackRequest::default()
            })
            .await?;
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..count {
            let m = self.clone();
            let req = CreateRequest {
                layers: vec![name.clone()],
                limits: record.limits.clone(),
                env: record.env.clone(),
                net: record.net.clone(),
                idle_timeout_s: record.idle_timeout_s,
                ..CreateRequest::default()
            };
            set.spawn(async move { m.create(req).await });
        }
        let mut sandboxes = Vec::new();
        let mut first_err = None;
        while let Some(r) = set.join_next().await {
            match r.map_err(|e| Error::Runtime(format!("fork task: {e}"))) {
                Ok(Ok(info)) => sandboxes.push(info),
                Ok(Err(e)) | Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            // All or nothing: the ones made are removed.
            for s in &sandboxes {
                let _ = self.remove(&s.id).await;
            }
            return Err(e);
        }
        sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(ForkResult { pack, sandboxes })
    }
}

/// What the blocking half of a pack produced.
struct Built {
    plan: diff::Plan,
    stats: erofs_builder::LayerStats,
    frozen_ms: Option<u64>,
    walk_ms: u64,
    build_ms: u64,
}

fn walk_and_build(
    upper: &Path,
    lower: &Path,
    out: &Path,
    rules: &residue::Rules,
    scanner: &secrets::Scanner,
) -> Result<Built> {
    let t = Instant::now();
    let mut plan = diff::plan(upper, lower, rules, scanner)?;
    let walk_ms = t.elapsed().as_millis() as u64;
    if !plan.secrets.is_empty() {
        let files: Vec<String> = plan
            .secrets
            .iter()
            .map(|h| format!("{} ({} {})", h.path, h.secret, h.how))
            .collect();
        return Err(Error::Refused(format!(
            "a secret given to the sandbox is in {} packed file(s): {}; nothing was packed",
            files.len(),
            files.join(", ")
        )));
    }
    let t = Instant::now();
    let mut opts = erofs_builder::LayerOptions::default();
    opts.build.exclude = Some(Arc::new(std::mem::take(&mut plan.exclude)));
    opts.tails = Some(erofs_builder::TailsBlob::new(
        out.join("tails"),
        erofs_builder::layer::DEFAULT_TAIL_CHUNK_SIZE,
    ));
    let stats = erofs_builder::build_layer_from(
        erofs_builder::Source::OverlayUpper(upper.to_path_buf()),
        &out.join("meta.erofs"),
        &out.join("blob"),
        &opts,
    )
    .map_err(|e| Error::Refused(format!("building the layer: {e}")))?;
    Ok(Built {
        plan,
        stats,
        frozen_ms: None,
        walk_ms,
        build_ms: t.elapsed().as_millis() as u64,
    })
}

impl Manager {
    /// Remove a pack's working directory `<dir>/pack`, its lower view unmounted first (left
    /// there by a daemon that died in a pack).
    pub(crate) async fn drop_pack_view(&self, dir: &Path) -> Result<()> {
        let work = dir.join("pack");
        let lower = work.join("lower");
        if ublk_daemon::node::sys::is_mount_point(&lower).unwrap_or(false) {
            match self
                .node
                .handle(NodeRequest::Umount {
                    mountpoint: lower.clone(),
                })
                .await
            {
                Ok(_) => {}
                Err(e) if e.kind == ErrorKind::NotMounted => {
                    // Not the node's: detached.
                    let _ = rustix::mount::unmount(&lower, rustix::mount::UnmountFlags::DETACH);
                }
                Err(e) => return Err(Error::Node(e)),
            }
        }
        match std::fs::remove_dir_all(&work) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("remove {}", work.display()), e)),
        }
    }
}
