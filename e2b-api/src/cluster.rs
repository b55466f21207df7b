//! What a node tells the cluster front (`crate::front`), on the node's API listener, under
//! `/strata/` (each request needs an `X-API-KEY` of the node's keys file):
//!
//! - `GET /strata/node` → [`NodeStatus`]: the node's name, its capacity, what its sandboxes
//!   reserve (the sum of their limits: what its edge admission counts; creates received but
//!   not yet admitted count too, from their arrival) and use (memory and
//!   CPU time of its parent cgroup), how many live, its admission limits, the layers it has
//!   registered (cached) and its templates. The front's watcher polls it.
//! - `POST /strata/signed` with [`SignedQuery`] → `{"sandboxID": …}`: which sandbox of this
//!   node signs a signed file URL (the URL names no sandbox: the front asks every node).
//!
//! The types are the wire format both sides share: a field added is optional (`serde`
//! default); a field's meaning never changes.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::Method;
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};

use crate::http::{error, json, Response};
use crate::state::Api;
use crate::{Error, Result};

/// An amount of CPU (thousandths of a core), memory and disk (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Amount {
    pub cpu_millis: u64,
    pub mem_bytes: u64,
    pub disk_bytes: u64,
}

/// A template as the front needs it: its stack (for layer locality) and what a sandbox of
/// it reserves (for placement).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSummary {
    pub name: String,
    pub layers: Vec<String>,
    #[serde(default)]
    pub cpu_millis: Option<u64>,
    #[serde(default)]
    pub memory: Option<u64>,
    #[serde(default)]
    pub default: bool,
}

/// `GET /strata/node`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// `strata daemon --node-name` (every sandbox id of the node starts with `<name>-`);
    /// empty: the node has none, and a front cannot route to it.
    pub name: String,
    /// CPUs (thousandths), `MemTotal`, the uppers filesystem's size (`u64::MAX`: no quotas).
    pub capacity: Amount,
    /// What the live sandboxes' limits reserve.
    pub reserved: Amount,
    /// Memory the node's sandboxes use now (their parent cgroup's charge), bytes.
    #[serde(default)]
    pub used_mem_bytes: u64,
    /// CPU time they used since the parent cgroup was made, microseconds (a front
    /// differentiates two polls).
    #[serde(default)]
    pub cpu_usage_us: u64,
    /// Live sandboxes (creating, running, paused, stopped) and creates received, not yet
    /// admitted.
    pub sandboxes: u32,
    pub max_sandboxes: u32,
    pub mem_overcommit: f64,
    pub cpu_overcommit: f64,
    /// `MemAvailable` (the edge also refuses below a floor of it).
    #[serde(default)]
    pub mem_available: u64,
    /// The layers the node has registered (`KIND/NAME:VERSION`), sorted.
    #[serde(default)]
    pub layers: Vec<String>,
    #[serde(default)]
    pub templates: Vec<TemplateSummary>,
    /// Per front instance (its [`FRONT_HEADER`]), how many of its creates this status counts
    /// (in `sandboxes`): a front knows from it which of its creates in flight the status
    /// shows. At most [`MAX_FRONTS_SEEN`] fronts, the newest.
    #[serde(default)]
    pub fronts_seen: BTreeMap<String, u64>,
}

/// The header a front names itself by on the creates it forwards (a random id per run).
pub const FRONT_HEADER: &str = "x-strata-front";

/// How long a status waits for the storage node's list of layers before it gives the last
/// one it had.
const LAYERS_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// How many fronts a node counts creates for (a front's restart is a new one).
pub const MAX_FRONTS_SEEN: usize = 64;

/// A create from `front` arrived (counted in the status from now on): `seen` is the node's
/// count per front, in the same lock as its pending creates.
pub(crate) fn count_front(seen: &mut Vec<(String, u64)>, front: &str) {
    match seen.iter().position(|(f, _)| f == front) {
        Some(i) => {
            let mut e = seen.remove(i);
            e.1 += 1;
            seen.push(e);
        }
        None => {
            if seen.len() >= MAX_FRONTS_SEEN {
                seen.remove(0);
            }
            seen.push((front.to_owned(), 1));
        }
    }
}

/// `POST /strata/signed`: the method and the query of a signed `/files` request.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SignedQuery {
    pub method: String,
    pub query: String,
}

/// The answer to [`SignedQuery`].
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SignedAnswer {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
}

/// Serve `/strata/…` (already authenticated).
pub async fn handle(api: &Arc<Api>, method: &Method, path: &str, body: Incoming) -> Response {
    let r = match (method, path) {
        (&Method::GET, "/strata/node") => status(api).await.map(|s| json(200, &s)),
        (&Method::POST, "/strata/signed") => signed(api, body).await,
        _ => Err(Error::NotFound(format!("no route {method} {path}"))),
    };
    r.unwrap_or_else(|e| error(&e))
}

async fn signed(api: &Arc<Api>, body: Incoming) -> Result<Response> {
    let q: SignedQuery = crate::http::read_json(body).await?;
    let method = Method::from_bytes(q.method.as_bytes())
        .map_err(|_| Error::BadRequest(format!("bad method {:?}", q.method)))?;
    let id = crate::files::signed_sandbox(api, &method, Some(&q.query))?;
    Ok(json(200, &SignedAnswer { sandbox_id: id }))
}

/// The node's status now.
pub async fn status(api: &Arc<Api>) -> Result<NodeStatus> {
    let manager = &api.manager;
    let config = manager.config();
    let (total, available) = sandbox_runtime::admission::meminfo();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    // The pending creates first, the live sandboxes second: a create that ends between the
    // two reads is then in the second (counted once), never in neither.
    let (pending, fronts_seen): (Vec<(String, Amount)>, BTreeMap<String, u64>) = {
        let p = api.pending.lock().unwrap_or_else(|p| p.into_inner());
        (
            p.creates.iter().map(|(id, a)| (id.clone(), *a)).collect(),
            p.fronts.iter().cloned().collect(),
        )
    };
    let live = manager.list();
    let mut reserved = Amount::default();
    for s in &live {
        reserved.cpu_millis += s.limits.cpu_millis.unwrap_or(0);
        reserved.mem_bytes += s.limits.memory.unwrap_or(0);
        reserved.disk_bytes += s.limits.disk.unwrap_or(0);
    }
    // Creates received that the runtime has not admitted yet (queued behind others): what
    // the front sent here counts from its arrival.
    let mut count = live.len();
    for (id, a) in &pending {
        if live.binary_search_by(|s| s.id.as_str().cmp(id)).is_err() {
            count += 1;
            reserved.cpu_millis += a.cpu_millis;
            reserved.mem_bytes += a.mem_bytes;
            reserved.disk_bytes += a.disk_bytes;
        }
    }
    let parent = sandbox_runtime::spec::cgroup_parent(config.node_name.as_deref());
    let (used_mem_bytes, cpu_usage_us) = tokio::task::spawn_blocking(move || {
        let dirs = sandbox_runtime::cgroup::of_path(&parent);
        let mem = sandbox_runtime::cgroup::memory(&dirs);
        (mem.usage, crate::control::cpu_usage_us(&dirs).unwrap_or(0))
    })
    .await
    .map_err(|e| Error::Runtime(format!("status task: {e}")))?;
    // The storage node's lock is held by the mounts of a burst's creates, queued behind one
    // another: the status does not wait for it (a front would take a late answer for a dead
    // node's, and place on counts seconds old), it gives the layers it last saw.
    let layers = match tokio::time::timeout(LAYERS_WAIT, manager.node().status()).await {
        Ok(node_status) => {
            let mut layers: Vec<String> = node_status
                .layers
                .into_iter()
                .flat_map(|l| l.refs)
                .collect();
            layers.sort();
            layers.dedup();
            *api.last_layers.lock().unwrap_or_else(|p| p.into_inner()) = layers.clone();
            layers
        }
        Err(_) => api
            .last_layers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
    };
    let templates = api
        .templates
        .list()
        .into_iter()
        .filter(|t| !t.hidden)
        .map(|t| TemplateSummary {
            name: t.name,
            layers: t.layers,
            cpu_millis: t.cpu_millis,
            memory: t.memory,
            default: t.default,
        })
        .collect();
    Ok(NodeStatus {
        name: config.node_name.clone().unwrap_or_default(),
        capacity: Amount {
            cpu_millis: cpus * 1000,
            mem_bytes: total,
            disk_bytes: config.uppers_size.unwrap_or(u64::MAX),
        },
        reserved,
        used_mem_bytes,
        cpu_usage_us,
        sandboxes: u32::try_from(count).unwrap_or(u32::MAX),
        fronts_seen,
        max_sandboxes: u32::try_from(config.max_sandboxes).unwrap_or(u32::MAX),
        mem_overcommit: config.admission.mem_overcommit,
        cpu_overcommit: config.admission.cpu_overcommit,
        mem_available: available,
        layers,
        templates,
    })
}

/// The node's answers as the front parses them (the fuzz target's entry).
pub(crate) fn fuzz(data: &[u8]) {
    let _ = serde_json::from_slice::<NodeStatus>(data);
    let _ = serde_json::from_slice::<SignedQuery>(data);
    let _ = serde_json::from_slice::<SignedAnswer>(data);
}
