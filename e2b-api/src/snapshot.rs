//! Snapshots and forks (E2B's `POST /sandboxes/{id}/snapshots`, `GET /snapshots`,
//! `DELETE /templates/{id}`, `POST /sandboxes/{id}/fork`), on the runtime's `pack-diff`.
//!
//! A snapshot is a **filesystem** snapshot: the sandbox's upper packed into a layer on its
//! stack (residue stripped, checked for the sandbox's secrets, the sandbox frozen meanwhile
//! and thawed after), registered as a template whose only layer is that one (its parents come
//! along at create). Sandboxes created from it cold-boot from those files: no process,
//! memory or connection of the source carries over. A request that asks for a memory
//! snapshot (`memory: true`, the SDK's `mode="full"`) is refused with 400; an omitted
//! `memory` takes a filesystem snapshot (this node takes no other kind).
//!
//! A fork is a snapshot (a hidden template, not listed) and `count` (1–20, default 1)
//! creates from it, concurrently; each fork succeeds or fails on its own, as E2B reports it.
//! Forks get the source's metadata and `envVars`, and their own access tokens, uppers and
//! identities (machine id, SSH host keys).

use std::sync::Arc;

use hyper::body::Incoming;
use serde::{Deserialize, Serialize};

use crate::control::{created, start, NewSandbox};
use crate::http::{json, no_content, query_get, query_pairs, Response};
use crate::state::{random_token, Api, Template};
use crate::time::now_ms;
use crate::{Error, Result};

/// E2B's bounds on a fork's count.
const MAX_FORKS: u32 = 20;
/// A fork's default timeout (the spec's `SandboxForkRequest.timeout`).
const FORK_TIMEOUT_S: u64 = 15;

#[derive(Debug, Default, Deserialize)]
struct SnapshotRequest {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    memory: Option<bool>,
}

#[derive(Debug, Serialize)]
struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    snapshot_id: String,
    names: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
struct ForkRequest {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    count: Option<u32>,
}

#[derive(Debug, Serialize)]
struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    sandbox: Option<crate::control::Created>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<ForkError>,
}

#[derive(Debug, Serialize)]
struct ForkError {
    code: u16,
    message: String,
}

/// Pack sandbox `id` into a new layer and register template `name` for it.
async fn snapshot(api: &Arc<Api>, id: &str, name: &str, hidden: bool) -> Result<Template> {
    let source = api
        .meta(id)
        .ok_or_else(|| Error::NotFound(format!("sandbox {id} was not found")))?;
    if let Some(existing) = api.templates.list().into_iter().find(|t| t.name == name) {
        if existing.snapshot_of.is_none() {
            return Err(Error::Conflict(format!(
                "{name} is a template of this node, not a snapshot"
            )));
        }
    }
    let template = api.templates.resolve(&source.template_id).ok();
    let layer = format!("snapshot/e2b-{}:1", random_token(16).to_lowercase());
    api.manager
        .pack_diff(sandbox_runtime::PackRequest {
            id: id.to_owned(),
            name: layer.clone(),
            ..Default::default()
        })
        .await?;
    api.templates.set(Template {
        name: name.to_owned(),
        layers: vec![layer],
        cpu_millis: template.as_ref().and_then(|t| t.cpu_millis),
        memory: template.as_ref().and_then(|t| t.memory),
        default: false,
        pool: 0,
        snapshot_of: Some(id.to_owned()),
        hidden,
    })
}

/// `POST /sandboxes/{id}/snapshots`.
pub async fn create(api: &Arc<Api>, id: &str, body: Incoming) -> Result<Response> {
    let req: SnapshotRequest = crate::http::read_json(body).await?;
    if req.memory == Some(true) {
        return Err(Error::BadRequest(
            "this node takes filesystem snapshots only (mode=\"filesystem\"): sandboxes \
             created from one start from its files, without the source's processes"
                .into(),
        ));
    }
    let name = match &req.name {
        Some(n) if !n.is_empty() => n.clone(),
        _ => format!("snap-{}", random_token(16).to_lowercase()),
    };
    let t = snapshot(api, id, &name, false).await?;
    Ok(json(
        201,
        &SnapshotInfo {
            snapshot_id: t.name.clone(),
            names: req.name.into_iter().filter(|n| !n.is_empty()).collect(),
        },
    ))
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`: by name; `x-next-token` names the
/// first of the next page.
pub fn list(api: &Api, query: Option<&str>) -> Result<Response> {
    let q = query_pairs(query);
    let of = query_get(&q, "sandboxID");
    let name = query_get(&q, "name");
    let limit: usize = match query_get(&q, "limit") {
        Some(l) => l
            .parse()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| Error::BadRequest(format!("bad limit {l:?} (1..1000)")))?,
        None => 100,
    };
    let next = query_get(&q, "nextToken");
    let all: Vec<Template> = api
        .templates
        .list()
        .into_iter()
        .filter(|t| {
            !t.hidden
                && t.snapshot_of.is_some()
                && of
                    .as_ref()
                    .is_none_or(|s| t.snapshot_of.as_ref() == Some(s))
                && name.as_ref().is_none_or(|n| *n == t.name)
        })
        .collect();
    let start = match &next {
        Some(tok) => all
            .iter()
            .position(|t| t.name == *tok)
            .ok_or_else(|| Error::BadRequest(format!("bad nextToken {tok:?}")))?,
        None => 0,
    };
    let page: Vec<SnapshotInfo> = all
        .iter()
        .skip(start)
        .take(limit)
        .map(|t| SnapshotInfo {
            snapshot_id: t.name.clone(),
            names: if t.name.starts_with("snap-") {
                Vec::new()
            } else {
                vec![t.name.clone()]
            },
        })
        .collect();
    let mut r = json(200, &page);
    if let Some(t) = all.get(start + limit) {
        if let Ok(v) = http::HeaderValue::from_str(&t.name) {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

/// `DELETE /templates/{id}`: a template (a snapshot's too) is forgotten; a snapshot's layer
/// is removed from the store (its blobs go at the store's next gc).
pub async fn delete_template(api: &Arc<Api>, id: &str) -> Result<Response> {
    let t = api.templates.remove(id)?;
    if t.snapshot_of.is_some() {
        for l in &t.layers {
            if api.templates.list().iter().any(|o| o.layers.contains(l)) {
                continue;
            }
            if let Err(e) = api.manager.remove_layer(l).await {
                tracing::warn!("snapshot {id}: removing layer {l}: {e}");
            }
        }
    }
    Ok(no_content())
}

/// `POST /sandboxes/{id}/fork`.
pub async fn fork(api: &Arc<Api>, id: &str, body: Incoming) -> Result<Response> {
    let req: ForkRequest = crate::http::read_json(body).await?;
    let count = req.count.unwrap_or(1);
    if count == 0 || count > MAX_FORKS {
        return Err(Error::BadRequest(format!(
            "count {count} is not between 1 and {MAX_FORKS}"
        )));
    }
    let source = api
        .meta(id)
        .ok_or_else(|| Error::NotFound(format!("sandbox {id} was not found")))?;
    let name = format!("fork-{id}-{}", now_ms());
    snapshot(api, id, &name, true).await?;
    let mut set = tokio::task::JoinSet::new();
    for i in 0..count {
        let api = api.clone();
        let req = NewSandbox {
            template_id: name.clone(),
            timeout: Some(req.timeout.unwrap_or(FORK_TIMEOUT_S)),
            auto_pause: Some(source.auto_pause),
            metadata: Some(source.metadata.clone()),
            env_vars: Some(source.env_vars.clone()),
            ..NewSandbox::default()
        };
        set.spawn(async move { (i, start(&api, req, FORK_TIMEOUT_S, None).await) });
    }
    let mut results: Vec<(u32, ForkResult)> = Vec::new();
    while let Some(r) = set.join_next().await {
        let (i, r) = r.map_err(|e| Error::Runtime(format!("fork task: {e}")))?;
        results.push((
            i,
            match r {
                Ok((sid, meta)) => ForkResult {
                    sandbox: Some(created(&sid, &meta)),
                    error: None,
                },
                Err(e) => ForkResult {
                    sandbox: None,
                    error: Some(ForkError {
                        code: e.status(),
                        message: e.to_string(),
                    }),
                },
            },
        ));
    }
    results.sort_by_key(|(i, _)| *i);
    let body: Vec<ForkResult> = results.into_iter().map(|(_, r)| r).collect();
    Ok(json(201, &body))
}
