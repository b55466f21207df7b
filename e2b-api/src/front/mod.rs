//! The cluster front (`strata api`): a stateless server speaking the same E2B API as a node,
//! in front of several nodes.
//!
//! - **Creates are placed** (`place.rs`): the template's resources and layer stack (learned
//!   from the nodes' status) make a [`placement::Request`]; this instance's
//!   [`placement::Placer`] (power-of-k + its local overlay + layer locality) picks a node of
//!   the watcher's snapshot that has the template; the create is sent there, and retried on
//!   another node (at most `max_attempts` in all) when the node refuses it (its edge
//!   admission: HTTP 429) or cannot be reached (a dead node: marked down until it answers a
//!   poll again). Any other answer is the client's.
//! - **Every later request is routed by the sandbox id** (`proxy.rs`): a node with
//!   `--node-name NAME` makes ids `NAME-…`, and the front maps names to URLs (learned by
//!   polling, or given as `--node NAME=URL`). The id comes from `E2b-Sandbox-Id` (envd), the
//!   Host `{port}-{id}.{domain}` (a sandbox's ports, envd by Host) or the path
//!   (`/sandboxes/{id}/…`). Bodies stream both ways (Connect streams, uploads, downloads);
//!   upgrades (WebSocket to a port) are joined byte for byte.
//! - **Signed file URLs** name no sandbox: the front asks every node which of its sandboxes
//!   signs the URL (`POST /strata/signed`, `crate::cluster`) and forwards to that node.
//! - **Lists are merged** (`list.rs`): `GET [/v2]/sandboxes` asks every live node for all of
//!   its matching sandboxes (the filters passed on, each node's pages followed), sorts them
//!   by start time then id as a node does, and pages the result with its own `x-next-token`
//!   (the id of the next page's first sandbox). `GET /sandboxes/metrics` asks each id's node;
//!   `GET /snapshots` concatenates; `DELETE /templates/{id}` goes to every node.
//! - **The watcher** (`watcher.rs`) polls every node's `GET /strata/node` every `poll`
//!   (concurrently, with a timeout) and publishes a [`placement::Snapshot`] of those that
//!   answered; the placer rebases on each.
//! - **A create counts in the overlay while in flight** (`placement::Placer::sent`): a node
//!   busy with a burst counts a create seconds after it was sent, and answers polls late (a
//!   slow node's last status is kept, as old as it is). So the front names itself on every
//!   create it forwards (`x-strata-front`, a random id per run), each node's status says how
//!   many creates of each front it counts, and the overlay drops exactly those; the others
//!   count until shown, or until a poll `settle` after their answer (a node that restarted),
//!   a refused or failed one at its answer.
//!
//! ## Invariants
//! - The front keeps nothing a restart loses: the snapshot is rebuilt by the first poll
//!   (the front serves only after it), ids route by their prefix, the nodes hold every
//!   sandbox's state. Two fronts serve the same sandboxes interchangeably.
//! - A create goes to at most `max_attempts` nodes, never twice to one node.
//! - The front checks `X-API-KEY` itself on the control plane (its keys file) and passes the
//!   key on: the nodes check it again (front and nodes share one keys file). envd requests
//!   are authenticated by the node (`X-Access-Token`, signatures).

mod list;
mod place;
mod proxy;
mod watcher;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::Method;
use hyper::body::Incoming;
use tokio::net::TcpListener;

use crate::http::{error, error_with, Response};
use crate::{Error, Result};

pub use watcher::NodeAddr;

/// How `strata api` serves.
#[derive(Clone, Debug)]
pub struct FrontConfig {
    /// The nodes: their API's base URL (`http://127.0.0.1:3001`), with their name if known.
    pub nodes: Vec<NodeAddr>,
    /// The API keys (the nodes' keys file: the front passes the client's key on, and polls
    /// with the first one).
    pub keys: PathBuf,
    /// How often the watcher polls every node.
    pub poll: Duration,
    /// Random choices of the power-of-k policy.
    pub k: usize,
    /// How many times this instance's own recent placements count on top of the snapshot:
    /// the number of front instances (`placement::PlacerConfig::overlay_weight`).
    pub overlay_weight: f64,
    /// Nodes tried per create, the first included.
    pub max_attempts: u32,
    /// The placer's seed (each instance its own).
    pub seed: u64,
}

impl Default for FrontConfig {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            keys: PathBuf::new(),
            poll: Duration::from_millis(250),
            k: 2,
            overlay_weight: 1.0,
            max_attempts: 4,
            seed: 0,
        }
    }
}

/// One front instance.
pub struct Front {
    /// This run's name on the creates it forwards ([`crate::cluster::FRONT_HEADER`]).
    id: String,
    keys: Vec<String>,
    client: proxy::Client,
    watcher: Arc<watcher::Watcher>,
    /// This instance's placer (its overlay is its own).
    placer: Mutex<placement::Placer>,
    max_attempts: u32,
    /// The placer's time origin.
    epoch: Instant,
}

impl std::fmt::Debug for Front {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Front")
            .field("nodes", &self.watcher.nodes())
            .finish_non_exhaustive()
    }
}

impl Front {
    /// A front for `cfg`: reads the keys, polls every node once (so that it routes and
    /// places from its first request on) and starts the watcher.
    pub async fn start(cfg: FrontConfig) -> Result<Arc<Front>> {
        if cfg.nodes.is_empty() {
            return Err(Error::BadRequest("a front needs at least one node".into()));
        }
        let keys = crate::state::read_keys(&cfg.keys)?;
        let epoch = Instant::now();
        let client = proxy::client();
        let watcher = watcher::Watcher::new(
            cfg.nodes.clone(),
            keys[0].clone(),
            client.clone(),
            cfg.poll,
            epoch,
        )?;
        let snapshot = watcher.poll_once().await;
        let policy = placement::PolicyKind::PowerOfKOverlayLocality
            .build(&placement::PolicyParams {
                k: cfg.k,
                ..Default::default()
            })
            .map_err(|e| Error::BadRequest(e.to_string()))?;
        let placer = placement::Placer::new(
            policy,
            placement::PlacerConfig {
                overlay: true,
                overlay_weight: cfg.overlay_weight,
                // A create counts in the overlay until its node's answer (in flight, see
                // `place`), then until a poll sent `settle` after it: the node counts it
                // from its arrival (`crate::cluster`), so by its answer at the latest.
                settle: Duration::from_secs(1),
                // An unanswered create counts as long as the front waits for its answer.
                overlay_ttl: place::CREATE_TIMEOUT + Duration::from_secs(1),
                max_attempts: cfg.max_attempts,
                ..Default::default()
            },
            snapshot,
            cfg.seed,
        )
        .map_err(|e| Error::BadRequest(e.to_string()))?;
        let front = Arc::new(Front {
            id: crate::state::random_token(16),
            keys,
            client,
            watcher,
            placer: Mutex::new(placer),
            max_attempts: cfg.max_attempts.max(1),
            epoch,
        });
        let weak = Arc::downgrade(&front);
        front
            .watcher
            .clone()
            .spawn(move |snapshot| match weak.upgrade() {
                Some(f) => {
                    // What each node's status (the same poll's) counts of this front's
                    // creates: those in flight it shows leave the overlay.
                    let view = f.watcher.view();
                    let seen: Vec<(placement::NodeId, u64)> = view
                        .status
                        .iter()
                        .enumerate()
                        .filter_map(|(i, s)| {
                            let n = *s.as_ref()?.fronts_seen.get(&f.id)?;
                            Some((placement::NodeId(i as u32), n))
                        })
                        .collect();
                    f.placer().set_snapshot_seen(snapshot, &seen);
                    true
                }
                None => false,
            });
        Ok(front)
    }

    fn placer(&self) -> std::sync::MutexGuard<'_, placement::Placer> {
        self.placer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> placement::Time {
        self.epoch.elapsed()
    }

    /// The node (index) a sandbox id names, or the answer to give.
    fn node_of(&self, id: &str) -> std::result::Result<usize, Error> {
        let name = id.split_once('-').map_or("", |(n, _)| n);
        self.watcher
            .node_named(name)
            .ok_or_else(|| Error::NotFound(format!("sandbox {id} was not found")))
    }
}

/// Serve `front` on `listener` until the task is dropped.
pub async fn serve(front: Arc<Front>, listener: TcpListener) {
    crate::http::serve_connections(listener, "front", move |req| {
        let front = front.clone();
        async move { route(&front, req).await }
    })
    .await;
}

/// Where a front listens, given as an address.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("listen on {addr}"), e))
}

/// envd's answer for a sandbox the front cannot reach: what a node answers for one it does
/// not have (a Connect `unavailable` to an RPC, else a 502), which the SDK raises as "sandbox
/// not found".
pub(crate) fn envd_unreachable(path: &str, id: &str, why: &str) -> Response {
    let msg = format!("The sandbox {id} was not found ({why})");
    let is_rpc = path.matches('/').count() == 2 && path.get(1..).is_some_and(|p| p.contains('.'));
    if is_rpc {
        crate::connect::unary_error(&crate::connect::RpcError::new(
            crate::connect::Code::Unavailable,
            msg,
        ))
    } else {
        error_with(502, &msg)
    }
}

async fn route(front: &Arc<Front>, req: hyper::Request<Incoming>) -> Response {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    // envd (and a port) by header, then by Host.
    let by_host = header("host")
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .as_deref()
        .and_then(crate::ports::parse_host)
        .map(|(_, id)| id);
    if let Some(id) = header("e2b-sandbox-id").or(by_host) {
        return match front.node_of(&id) {
            Ok(n) => proxy::forward(front, n, req).await,
            Err(_) => envd_unreachable(
                req.uri().path(),
                &id,
                "no node of this cluster has its name",
            ),
        };
    }
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    let method = req.method().clone();
    if path == "/files" && query.as_deref().is_some_and(|q| q.contains("signature=")) {
        return match proxy::signed_node(front, &method, query.as_deref().unwrap_or("")).await {
            Ok(n) => proxy::forward(front, n, req).await,
            Err(e) => error(&e),
        };
    }
    if path == "/health" {
        return crate::http::json(200, &serde_json::json!({ "status": "ok" }));
    }
    let key = header("x-api-key").unwrap_or_default();
    if key.is_empty() {
        return error(&Error::Unauthenticated(
            "no X-API-KEY: every request of this API needs one".into(),
        ));
    }
    if !crate::state::key_in(&front.keys, &key) {
        return error_with(401, "Invalid API key");
    }
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (&method, segs.as_slice()) {
        (&Method::POST, ["sandboxes"] | ["v2", "sandboxes"]) => place::create(front, req).await,
        (&Method::GET, ["sandboxes"] | ["v2", "sandboxes"]) => {
            list::sandboxes(front, &path, query.as_deref(), &key).await
        }
        (&Method::GET, ["sandboxes", "metrics"]) => {
            list::metrics(front, query.as_deref(), &key).await
        }
        (&Method::GET, ["snapshots"]) => {
            list::snapshots(front, &path, query.as_deref(), &key).await
        }
        (&Method::DELETE, ["templates", _]) => list::delete_template(front, &path, &key).await,
        (_, ["sandboxes", id, ..] | ["v2", "sandboxes", id, ..]) => match front.node_of(id) {
            Ok(n) => proxy::forward(front, n, req).await,
            Err(e) => error(&e),
        },
        _ => error_with(404, &format!("no route {method} {path}")),
    }
}
