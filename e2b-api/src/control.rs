//! The control plane (E2B's OpenAPI `sandboxes` paths): create, get, list, kill, timeout,
//! pause, connect, metrics. Field names are the OpenAPI spec's (`templateID`, `sandboxID`,
//! `envdAccessToken`, …).

use std::collections::BTreeMap;
use std::sync::Arc;

use http::Method;
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};

use crate::http::{error, error_with, json, no_content, query_get, query_pairs, Response};
use crate::state::{random_token, Api, SandboxMeta};
use crate::time::{now_ms, parse_rfc3339_ms, rfc3339_ms};
use crate::{Error, Result, ENVD_VERSION};

/// The longest timeout a create or `set_timeout` may ask for (E2B's: 24 hours).
pub const MAX_TIMEOUT_S: u64 = 24 * 3600;

/// The `/v2` create's default; the old `/sandboxes` create defaults to 15 s as E2B's does.
const DEFAULT_TIMEOUT_V2_S: u64 = 300;
const DEFAULT_TIMEOUT_V1_S: u64 = 15;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(default)]
    pub timeout: Option<u64>,
    #[serde(default)]
    pub auto_pause: Option<bool>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    #[serde(default)]
    pub secure: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct TimeoutBody {
    timeout: Option<u64>,
}

/// A created or connected sandbox (`Sandbox` in the spec).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Created {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    alias: String,
    envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    traffic_access_token: Option<String>,
    domain: Option<String>,
}

/// `SandboxDetail` / `ListedSandbox` (the list omits the token).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Detail {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    alias: String,
    started_at: String,
    end_at: String,
    envd_version: &'static str,
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u64,
    state: &'static str,
    metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    domain: Option<String>,
}

/// The node's CPUs and memory (MiB): what a sandbox without limits may use.
fn node_resources() -> (u32, u64) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    (cpus, sandbox_runtime::admission::meminfo().0 >> 20)
}

fn client_id() -> String {
    "strata".to_owned()
}

fn detail(id: &str, m: &SandboxMeta, with_token: bool, disk_mb: u64) -> Detail {
    Detail {
        template_id: m.template_id.clone(),
        sandbox_id: id.to_owned(),
        client_id: client_id(),
        alias: m.alias.clone(),
        started_at: rfc3339_ms(m.started_ms),
        end_at: rfc3339_ms(m.end_ms),
        envd_version: ENVD_VERSION,
        cpu_count: m.cpu_count,
        memory_mb: m.memory_mb,
        disk_size_mb: disk_mb,
        state: if m.paused { "paused" } else { "running" },
        metadata: m.metadata.clone(),
        envd_access_token: with_token.then(|| m.access_token.clone()),
        domain: None,
    }
}

pub(crate) fn created(id: &str, m: &SandboxMeta) -> Created {
    Created {
        template_id: m.template_id.clone(),
        sandbox_id: id.to_owned(),
        client_id: client_id(),
        alias: m.alias.clone(),
        envd_version: ENVD_VERSION,
        envd_access_token: Some(m.access_token.clone()),
        traffic_access_token: None,
        domain: None,
    }
}

/// Serve a control-plane request (already authenticated).
pub async fn handle(
    api: &Arc<Api>,
    method: &Method,
    path: &str,
    query: Option<&str>,
    front: Option<String>,
    body: Incoming,
) -> Response {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let r = match (method, segs.as_slice()) {
        (&Method::POST, ["sandboxes"]) => create(api, body, DEFAULT_TIMEOUT_V1_S, front).await,
        (&Method::POST, ["v2", "sandboxes"]) => {
            create(api, body, DEFAULT_TIMEOUT_V2_S, front).await
        }
        (&Method::GET, ["sandboxes"] | ["v2", "sandboxes"]) => list(api, query),
        (&Method::GET, ["sandboxes", "metrics"]) => all_metrics(api, query).await,
        (&Method::GET, ["sandboxes", id]) => get(api, id),
        (&Method::DELETE, ["sandboxes", id]) => api.kill(id).await.map(|()| no_content()),
        (&Method::POST, ["sandboxes", id, "timeout"]) => set_timeout(api, id, body).await,
        (&Method::POST, ["sandboxes", id, "refreshes"]) => refresh(api, id, body).await,
        (&Method::POST, ["sandboxes", id, "pause"]) => pause(api, id).await,
        (&Method::POST, ["sandboxes", id, "resume"] | ["sandboxes", id, "connect"])
        | (&Method::POST, ["v2", "sandboxes", id, "connect"]) => connect(api, id, body).await,
        (&Method::GET, ["sandboxes", id, "metrics"]) => metrics(api, id).await,
        (&Method::POST, ["sandboxes", id, "snapshots"]) => {
            crate::snapshot::create(api, id, body).await
        }
        (&Method::POST, ["sandboxes", id, "fork"]) => crate::snapshot::fork(api, id, body).await,
        (&Method::GET, ["snapshots"]) => crate::snapshot::list(api, query),
        (&Method::DELETE, ["templates", id]) => crate::snapshot::delete_template(api, id).await,
        (_, ["sandboxes", ..] | ["v2", "sandboxes", ..]) => Err(Error::Unsupported(format!(
            "{method} {path} is not served by this node"
        ))),
        _ => return error_with(404, &format!("no route {method} {path}")),
    };
    r.unwrap_or_else(|e| error(&e))
}

fn sandbox_meta(api: &Api, id: &str) -> Result<SandboxMeta> {
    api.meta(id)
        .ok_or_else(|| Error::NotFound(format!("sandbox {id} was not found")))
}

/// `front`: the cluster front that forwarded it (its `x-strata-front`), if one did.
async fn create(
    api: &Arc<Api>,
    body: Incoming,
    default_timeout: u64,
    front: Option<String>,
) -> Result<Response> {
    let req: NewSandbox = crate::http::read_json(body).await?;
    // A task of its own: a client that goes away (its timeout, a closed connection) drops
    // this handler, and a create dropped halfway left a root mounted and a sandbox that never
    // ran. It is made whole, and lives to its timeout.
    let api = api.clone();
    let (id, meta) =
        tokio::spawn(async move { start(&api, req, default_timeout, front.as_deref()).await })
            .await
            .map_err(|e| Error::Runtime(format!("create task: {e}")))??;
    Ok(json(201, &created(&id, &meta)))
}

/// Create (or take from the template's pool) the sandbox `req` asks for; its id and the
/// API's record of it.
pub(crate) async fn start(
    api: &Arc<Api>,
    req: NewSandbox,
    default_timeout: u64,
    front: Option<&str>,
) -> Result<(String, SandboxMeta)> {
    let timeout = req.timeout.unwrap_or(default_timeout);
    if timeout == 0 || timeout > MAX_TIMEOUT_S {
        return Err(Error::BadRequest(format!(
            "timeout {timeout} s is not between 1 and {MAX_TIMEOUT_S}"
        )));
    }
    if req.secure == Some(false) {
        tracing::debug!("create: secure=false asked; every sandbox has an access token here");
    }
    let template = api.templates.resolve(&req.template_id)?;
    let env_vars = req.env_vars.unwrap_or_default();
    for k in env_vars.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(Error::BadRequest(format!("bad envVars name {k:?}")));
        }
    }
    let metadata = req.metadata.unwrap_or_default();
    if metadata.len() > 64 || metadata.iter().any(|(k, v)| k.len() + v.len() > 4096) {
        return Err(Error::BadRequest(
            "metadata: at most 64 entries of at most 4 KiB each".into(),
        ));
    }
    let net = match req.allow_internet_access {
        Some(true) => sandbox_runtime::proto::Network::Allow(vec!["0.0.0.0/0"
            .parse()
            .map_err(|e: sandbox_runtime::Error| Error::Runtime(e.to_string()))?]),
        _ => sandbox_runtime::proto::Network::None,
    };
    let (node_cpus, node_mem) = node_resources();
    let meta = SandboxMeta {
        template_id: template.name.clone(),
        alias: req.template_id.clone(),
        access_token: random_token(32),
        metadata,
        env_vars: env_vars.clone(),
        started_ms: now_ms(),
        end_ms: now_ms() + timeout * 1000,
        auto_pause: req.auto_pause.unwrap_or(false),
        paused: false,
        cpu_count: template
            .cpu_millis
            .map_or(node_cpus, |m| m.div_ceil(1000) as u32),
        memory_mb: template.memory.map_or(node_mem, |m| m >> 20),
    };
    let pooled = template.pool > 0
        && template.cpu_millis.is_none()
        && template.memory.is_none()
        && net == sandbox_runtime::proto::Network::None;
    let id = if pooled {
        // A ready sandbox of the template's pool (or a new one when it is empty), made
        // without the envVars: they go with every command instead (`process::start_exec`).
        let info = api
            .manager
            .create_or_take(sandbox_runtime::proto::CreateRequest {
                layers: template.layers.clone(),
                pooled: true,
                ..Default::default()
            })
            .await
            .map_err(|e| create_error(&template.name, e))?;
        // A pool's sandbox is live already: the status counts it from now on.
        if let Some(f) = front {
            let mut p = api.pending.lock().unwrap_or_else(|p| p.into_inner());
            crate::cluster::count_front(&mut p.fronts, f);
        }
        api.remember(&info.id, meta);
        info.id
    } else {
        let id = format!("{}i{}", api.manager.id_prefix(), random_token(19));
        // Pending (the reaper leaves it alone, the node's status counts it) before the API
        // knows it, and until the runtime has it or refused it; written once it runs.
        let _pending = Pending::new(
            api,
            &id,
            crate::cluster::Amount {
                cpu_millis: template.cpu_millis.unwrap_or(0),
                mem_bytes: template.memory.unwrap_or(0),
                disk_bytes: 0,
            },
            front,
        );
        api.remember(&id, meta);
        let r = api
            .manager
            .create(sandbox_runtime::proto::CreateRequest {
                layers: template.layers.clone(),
                id: Some(id.clone()),
                limits: sandbox_runtime::Limits {
                    cpu_millis: template.cpu_millis,
                    memory: template.memory,
                    ..Default::default()
                },
                env: env_vars.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                net,
                ..Default::default()
            })
            .await;
        if let Err(e) = r {
            api.forget(&id);
            return Err(create_error(&template.name, e));
        }
        id
    };
    let meta = api.update_meta(&id, |m| m.started_ms = now_ms())?;
    Ok((id, meta))
}

/// A create in progress, in [`Api::pending`] until dropped.
struct Pending<'a> {
    api: &'a Api,
    id: String,
}

impl<'a> Pending<'a> {
    /// `from`: the front that sent the create, which the status then counts it for.
    fn new(api: &'a Api, id: &str, amount: crate::cluster::Amount, from: Option<&str>) -> Self {
        let mut p = api.pending.lock().unwrap_or_else(|p| p.into_inner());
        p.creates.insert(id.to_owned(), amount);
        if let Some(f) = from {
            crate::cluster::count_front(&mut p.fronts, f);
        }
        drop(p);
        Pending {
            api,
            id: id.to_owned(),
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.api
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .creates
            .remove(&self.id);
    }
}

/// The size of the filesystem a sandbox's writes land on (its root's: the overlay reports
/// its upper's), MiB.
fn create_error(template: &str, e: sandbox_runtime::Error) -> Error {
    match e {
        sandbox_runtime::Error::Node(a)
            if a.kind == ublk_daemon::node::proto::ErrorKind::UnknownLayer =>
        {
            Error::BadRequest(format!("template {template}: {}", a.message))
        }
        e => e.into(),
    }
}

fn disk_mb(api: &Api, id: &str) -> u64 {
    api.view(id)
        .ok()
        .and_then(|v| rustix::fs::statvfs(&v).ok())
        .map_or(0, |s| (s.f_blocks * s.f_frsize) >> 20)
}

fn get(api: &Api, id: &str) -> Result<Response> {
    let m = sandbox_meta(api, id)?;
    Ok(json(200, &detail(id, &m, true, disk_mb(api, id))))
}

/// `GET /v2/sandboxes?state=running,paused&metadata=k%3Dv&limit=N&nextToken=T`: sorted by
/// start, then id; `x-next-token` names the first of the next page.
fn list(api: &Api, query: Option<&str>) -> Result<Response> {
    let q = query_pairs(query);
    let states: Vec<String> = query_get(&q, "state")
        .map(|s| {
            s.split(',')
                .map(|x| x.trim().to_owned())
                .filter(|x| !x.is_empty())
                .collect()
        })
        .unwrap_or_default();
    for s in &states {
        if s != "running" && s != "paused" {
            return Err(Error::BadRequest(format!(
                "bad state {s:?} (running, paused)"
            )));
        }
    }
    // The SDK encodes `k=v&k2=v2` with each key and value percent-encoded once more.
    let wanted: Vec<(String, String)> = query_get(&q, "metadata")
        .map(|m| query_pairs(Some(&m)))
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            (
                crate::http::percent_decode(&k),
                crate::http::percent_decode(&v),
            )
        })
        .collect();
    let limit: usize = match query_get(&q, "limit") {
        Some(l) => l
            .parse()
            .ok()
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| Error::BadRequest(format!("bad limit {l:?} (1–1000)")))?,
        None => 100,
    };
    let started_after = match query_get(&q, "startedAfter") {
        Some(t) => Some(
            parse_rfc3339_ms(&t)
                .ok_or_else(|| Error::BadRequest(format!("bad startedAfter {t:?}")))?,
        ),
        None => None,
    };
    let template = query_get(&q, "template");
    let desc = query_get(&q, "order").as_deref() == Some("desc");
    let next = query_get(&q, "nextToken");
    let mut all: Vec<(String, SandboxMeta)> = api
        .all_meta()
        .into_iter()
        .filter(|(_, m)| {
            let state = if m.paused { "paused" } else { "running" };
            (states.is_empty() || states.iter().any(|s| s == state))
                && wanted
                    .iter()
                    .all(|(k, v)| m.metadata.get(k).is_some_and(|x| x == v))
                && started_after.is_none_or(|t| m.started_ms > t)
                && template
                    .as_ref()
                    .is_none_or(|t| *t == m.template_id || *t == m.alias)
        })
        .collect();
    all.sort_by(|a, b| (a.1.started_ms, &a.0).cmp(&(b.1.started_ms, &b.0)));
    if desc {
        all.reverse();
    }
    let start = match &next {
        Some(t) => all
            .iter()
            .position(|(id, _)| id == t)
            .ok_or_else(|| Error::BadRequest(format!("bad nextToken {t:?}")))?,
        None => 0,
    };
    let page: Vec<Detail> = all
        .iter()
        .skip(start)
        .take(limit)
        .map(|(id, m)| detail(id, m, false, disk_mb(api, id)))
        .collect();
    let mut r = json(200, &page);
    if let Some((id, _)) = all.get(start + limit) {
        if let Ok(v) = http::HeaderValue::from_str(id) {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

async fn set_timeout(api: &Api, id: &str, body: Incoming) -> Result<Response> {
    let b: TimeoutBody = crate::http::read_json(body).await?;
    let t = b
        .timeout
        .ok_or_else(|| Error::BadRequest("timeout is required".into()))?;
    if t > MAX_TIMEOUT_S {
        return Err(Error::BadRequest(format!(
            "timeout {t} s is more than {MAX_TIMEOUT_S}"
        )));
    }
    api.update_meta(id, |m| m.end_ms = now_ms() + t * 1000)?;
    Ok(no_content())
}

/// `refreshes`: keep it alive `duration` more seconds (never shortening its life).
async fn refresh(api: &Api, id: &str, body: Incoming) -> Result<Response> {
    #[derive(Deserialize, Default)]
    struct Refresh {
        duration: Option<u64>,
    }
    let b: Refresh = crate::http::read_json(body).await?;
    let d = b
        .duration
        .unwrap_or(DEFAULT_TIMEOUT_V2_S)
        .min(MAX_TIMEOUT_S);
    api.update_meta(id, |m| m.end_ms = m.end_ms.max(now_ms() + d * 1000))?;
    Ok(no_content())
}

/// Pause a sandbox as E2B means it: the runtime's suspend (frozen, what it had resident
/// recorded, its memory reclaimed; `connect` brings it back with a prefetch); `Conflict` if
/// it is paused already.
pub async fn pause_sandbox(api: &Api, id: &str) -> Result<()> {
    let m = sandbox_meta(api, id)?;
    if m.paused {
        return Err(Error::Conflict(format!("sandbox {id} is already paused")));
    }
    match api.manager.suspend(id).await {
        Ok(_) => {}
        Err(sandbox_runtime::Error::Conflict(m)) => return Err(Error::Conflict(m)),
        Err(e) => return Err(e.into()),
    }
    api.update_meta(id, |m| m.paused = true)?;
    Ok(())
}

async fn pause(api: &Api, id: &str) -> Result<Response> {
    pause_sandbox(api, id).await.map(|()| no_content())
}

async fn connect(api: &Api, id: &str, body: Incoming) -> Result<Response> {
    let b: TimeoutBody = crate::http::read_json(body).await?;
    let m = sandbox_meta(api, id)?;
    let t = b.timeout.unwrap_or(DEFAULT_TIMEOUT_V2_S).min(MAX_TIMEOUT_S);
    if m.paused {
        match api.manager.resume(id).await {
            Ok(_) => {}
            // Resumed behind the API's back: running, as the API is told now.
            Err(sandbox_runtime::Error::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let m = api.update_meta(id, |m| {
            m.paused = false;
            m.end_ms = now_ms() + t * 1000;
        })?;
        return Ok(json(201, &created(id, &m)));
    }
    // Connecting never shortens a running sandbox's life.
    let m = api.update_meta(id, |m| m.end_ms = m.end_ms.max(now_ms() + t * 1000))?;
    Ok(json(200, &created(id, &m)))
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Metric {
    timestamp: String,
    timestamp_unix: u64,
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

/// CPU time the sandbox's cgroup used, microseconds (`cpu.stat`, v2; `cpuacct.usage`, v1).
pub(crate) fn cpu_usage_us(cgroups: &BTreeMap<String, std::path::PathBuf>) -> Option<u64> {
    if let Some(dir) = cgroups.get("unified").or_else(|| cgroups.get("cpu")) {
        if let Ok(s) = std::fs::read_to_string(dir.join("cpu.stat")) {
            if let Some(v) = s
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse().ok())
            {
                return Some(v);
            }
        }
    }
    let dir = cgroups
        .get("cpuacct")
        .or_else(|| cgroups.get("cpu,cpuacct"))?;
    let ns: u64 = std::fs::read_to_string(dir.join("cpuacct.usage"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(ns / 1000)
}

async fn one_metric(api: &Api, id: &str) -> Result<Metric> {
    let m = sandbox_meta(api, id)?;
    let d = api.manager.inspect(id).await?;
    let now = now_ms();
    // Over 100 ms of wall time, the share of the sandbox's CPUs it used.
    let before = cpu_usage_us(&d.cgroups);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let after = cpu_usage_us(&d.cgroups);
    let cpu_used_pct = match (before, after) {
        (Some(b), Some(a)) if m.cpu_count > 0 => {
            (a.saturating_sub(b) as f64 / 1000.0) / (100.0 * f64::from(m.cpu_count)) * 100.0
        }
        _ => 0.0,
    };
    let disk_total = d.info.limits.disk.unwrap_or_else(|| disk_mb(api, id) << 20);
    Ok(Metric {
        timestamp: rfc3339_ms(now),
        timestamp_unix: now / 1000,
        cpu_count: m.cpu_count,
        cpu_used_pct: (cpu_used_pct * 100.0).round() / 100.0,
        mem_used: d.memory_anon + d.memory_file,
        mem_total: m.memory_mb << 20,
        mem_cache: d.memory_file,
        disk_used: d.upper_bytes,
        disk_total,
    })
}

async fn metrics(api: &Api, id: &str) -> Result<Response> {
    let m = one_metric(api, id).await?;
    Ok(json(200, &vec![m]))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest metric of each.
async fn all_metrics(api: &Api, query: Option<&str>) -> Result<Response> {
    let q = query_pairs(query);
    let ids: Vec<String> = query_get(&q, "sandbox_ids")
        .map(|s| s.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    let mut out = serde_json::Map::new();
    for id in ids.iter().take(100) {
        if let Ok(m) = one_metric(api, id).await {
            out.insert(id.clone(), serde_json::to_value(m).unwrap_or_default());
        }
    }
    Ok(json(200, &serde_json::json!({ "sandboxes": out })))
}

/// The control plane's request bodies, parsed from `data` (the fuzz target's entry).
pub(crate) fn fuzz(data: &[u8]) {
    let _ = serde_json::from_slice::<NewSandbox>(data);
    let _ = serde_json::from_slice::<TimeoutBody>(data);
}
