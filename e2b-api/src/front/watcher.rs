//! The watcher: polls every node's `GET /strata/node` (concurrently, each with a timeout)
//! every `poll`, and publishes what answered as a [`Snapshot`] (node `i` of the front's list
//! is [`NodeId`]`(i)`), with the names and templates the nodes reported. A node that refuses
//! the connection (or answers something else than its status) is down: out of the snapshot
//! (so the placer does not choose it) until it answers again. A node that is only slow (busy
//! with a burst: its answer not whole within the timeout) keeps its last status. The names
//! learned stay (a sandbox of a dead node is then "unreachable", not "unknown").

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use placement::{LayerId, Limits, NodeId, NodeState, Resources, Snapshot};

use super::proxy::PollError;
use crate::cluster::{NodeStatus, TemplateSummary};

/// A node as given to the front: `[NAME=]URL`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAddr {
    /// Its name, if given (else learned from its status).
    pub name: Option<String>,
    /// Its API's base URL, `http://HOST:PORT` (no path).
    pub url: String,
}

impl std::str::FromStr for NodeAddr {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        let (name, url) = match s.split_once('=') {
            Some((n, u)) => (Some(n.to_owned()), u),
            None => (None, s),
        };
        if let Some(n) = &name {
            if !sandbox_runtime::valid_node_name(n) {
                return Err(crate::Error::BadRequest(format!(
                    "bad node name {n:?} (want [a-z0-9]{{1,16}})"
                )));
            }
        }
        let url = url.trim_end_matches('/');
        let uri: http::Uri = url
            .parse()
            .map_err(|e| crate::Error::BadRequest(format!("bad node URL {url:?}: {e}")))?;
        if uri.scheme_str() != Some("http")
            || uri.authority().is_none()
            || !matches!(uri.path(), "" | "/")
        {
            return Err(crate::Error::BadRequest(format!(
                "bad node URL {url:?} (want http://HOST:PORT)"
            )));
        }
        Ok(NodeAddr {
            name,
            url: url.to_owned(),
        })
    }
}

/// The identity of a layer reference in snapshots: FNV-1a of `KIND/NAME:VERSION`.
pub fn layer_id(reference: &str) -> LayerId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in reference.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    LayerId(h)
}

/// What the last poll saw.
#[derive(Debug)]
pub struct View {
    pub snapshot: Arc<Snapshot>,
    /// The last status of each node (index), `None` if it did not answer the last poll.
    pub status: Vec<Option<NodeStatus>>,
}

impl View {
    /// The nodes (indexes) that answered the last poll.
    pub fn alive(&self) -> impl Iterator<Item = usize> + '_ {
        self.status
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|_| i))
    }

    /// The template `name` as the first live node having it says (`base`: a node's default
    /// template, as a node resolves it), and every live node that has it.
    pub fn template(&self, name: &str) -> Option<(TemplateSummary, Vec<usize>)> {
        let mut found: Option<TemplateSummary> = None;
        let mut nodes = Vec::new();
        for (i, s) in self.status.iter().enumerate() {
            let Some(s) = s else { continue };
            let t =
                s.templates.iter().find(|t| t.name == name).or_else(|| {
                    (name == "base").then(|| s.templates.iter().find(|t| t.default))?
                });
            if let Some(t) = t {
                found.get_or_insert_with(|| t.clone());
                nodes.push(i);
            }
        }
        found.map(|t| (t, nodes))
    }
}

/// Polls the nodes and keeps the latest [`View`].
pub struct Watcher {
    nodes: Vec<NodeAddr>,
    key: String,
    client: super::proxy::Client,
    poll: Duration,
    epoch: Instant,
    view: RwLock<Arc<View>>,
    /// Node name → index (given, or learned; never forgotten while the front runs).
    names: RwLock<HashMap<String, usize>>,
    /// CPU time and when, per node, at the previous poll (for the CPU use rate).
    cpu: Mutex<Vec<Option<(u64, Instant)>>>,
    /// When each node's status in the view was asked for (its last fresh answer).
    asked: Mutex<Vec<Duration>>,
    /// Wakes the poll loop before its time (a create found no node with its template).
    wake: tokio::sync::Notify,
    /// Bumped at every poll.
    polls: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

impl Watcher {
    pub fn new(
        nodes: Vec<NodeAddr>,
        key: String,
        client: super::proxy::Client,
        poll: Duration,
        epoch: Instant,
    ) -> crate::Result<Arc<Watcher>> {
        let names = nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.name.clone().map(|name| (name, i)))
            .collect();
        let empty = Snapshot::new(Duration::ZERO, Vec::new())
            .map_err(|e| crate::Error::Runtime(e.to_string()))?;
        Ok(Arc::new(Watcher {
            cpu: Mutex::new(vec![None; nodes.len()]),
            asked: Mutex::new(vec![Duration::ZERO; nodes.len()]),
            view: RwLock::new(Arc::new(View {
                snapshot: Arc::new(empty),
                status: vec![None; nodes.len()],
            })),
            nodes,
            key,
            client,
            poll: poll.max(Duration::from_millis(10)),
            epoch,
            names: RwLock::new(names),
            wake: tokio::sync::Notify::new(),
            polls: tokio::sync::watch::channel(0).0,
        }))
    }

    pub fn nodes(&self) -> &[NodeAddr] {
        &self.nodes
    }

    pub fn view(&self) -> Arc<View> {
        self.view.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The node named `name`.
    pub fn node_named(&self, name: &str) -> Option<usize> {
        self.names
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .copied()
    }

    /// The node is down (a request to it failed to connect): out of the view until it
    /// answers a poll again.
    pub fn mark_down(&self, node: usize) {
        let mut v = self.view.write().unwrap_or_else(|p| p.into_inner());
        if v.status.get(node).is_some_and(Option::is_some) {
            let mut status = v.status.clone();
            status[node] = None;
            let (nodes, times): (Vec<NodeState>, Vec<Duration>) = v
                .snapshot
                .nodes()
                .iter()
                .enumerate()
                .filter(|(_, n)| n.id != NodeId(node as u32))
                .map(|(p, n)| (n.clone(), v.snapshot.taken_at_of(p)))
                .unzip();
            if let Ok(s) = Snapshot::new_per_node(nodes, times) {
                *v = Arc::new(View {
                    snapshot: Arc::new(s),
                    status,
                });
            }
        }
    }

    /// Poll now and wait for that poll (at most `within`).
    pub async fn refresh(&self, within: Duration) {
        let mut rx = self.polls.subscribe();
        let seen = *rx.borrow_and_update();
        self.wake.notify_one();
        let _ = tokio::time::timeout(within, async {
            while *rx.borrow_and_update() == seen {
                if rx.changed().await.is_err() {
                    break;
                }
            }
        })
        .await;
    }

    /// Poll every node once; publish and return the snapshot.
    pub async fn poll_once(&self) -> Arc<Snapshot> {
        let taken = self.epoch.elapsed();
        // A node busy with a burst can take seconds to answer; the round waits for it (its
        // status, late, is still the truest there is).
        let timeout = self.poll.max(Duration::from_secs(3));
        let previous = self.view();
        let answers = futures::future::join_all(self.nodes.iter().enumerate().map(|(i, n)| {
            let uri = format!("{}/strata/node", n.url);
            let previous = &previous;
            async move {
                let r = tokio::time::timeout(
                    timeout,
                    super::proxy::get_json::<NodeStatus>(&self.client, &uri, &self.key),
                )
                .await;
                let why = match r {
                    Ok(Ok(s)) => return (Some(s), true),
                    Ok(Err(PollError::Down(e))) => {
                        tracing::debug!("front: poll {}: down: {e}", n.url);
                        return (None, false);
                    }
                    Ok(Err(PollError::Slow(e))) => e,
                    Err(_) => "timed out".to_owned(),
                };
                // A node busy with a burst answers late: it is still there, as it was.
                tracing::debug!("front: poll {}: {why}; its last status kept", n.url);
                (previous.status.get(i).cloned().flatten(), false)
            }
        }))
        .await;
        let now = Instant::now();
        let mut nodes = Vec::new();
        let mut status = Vec::with_capacity(answers.len());
        // Each node's state is as old as its last fresh answer: a node's kept status does not
        // show what this instance placed there since, so the overlay keeps those (by node).
        let mut times = Vec::new();
        {
            let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
            let mut names = self.names.write().unwrap_or_else(|p| p.into_inner());
            let mut cpu = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
            for (i, (s, fresh)) in answers.into_iter().enumerate() {
                let Some(s) = s else {
                    status.push(None);
                    continue;
                };
                if s.name.is_empty() {
                    tracing::warn!(
                        "front: node {} has no name (strata daemon --node-name): not used",
                        self.nodes[i].url
                    );
                    status.push(None);
                    continue;
                }
                if let Some(given) = &self.nodes[i].name {
                    if *given != s.name {
                        tracing::warn!(
                            "front: node {} is named {:?}, not {given:?}: not used",
                            self.nodes[i].url,
                            s.name
                        );
                        status.push(None);
                        continue;
                    }
                }
                match names.get(&s.name) {
                    Some(&j) if j != i => {
                        tracing::warn!(
                            "front: nodes {} and {} are both named {:?}: {} not used",
                            self.nodes[j].url,
                            self.nodes[i].url,
                            s.name,
                            self.nodes[i].url
                        );
                        status.push(None);
                        continue;
                    }
                    Some(_) => {}
                    None => {
                        names.insert(s.name.clone(), i);
                    }
                }
                let cpu_millis = match cpu[i] {
                    Some((before, at)) if fresh && s.cpu_usage_us >= before => {
                        let wall_us = now.duration_since(at).as_micros().max(1) as u64;
                        (s.cpu_usage_us - before).saturating_mul(1000) / wall_us
                    }
                    _ => previous
                        .snapshot
                        .position(NodeId(i as u32))
                        .map_or(0, |p| previous.snapshot.nodes()[p].used.cpu_millis),
                };
                if fresh {
                    cpu[i] = Some((s.cpu_usage_us, now));
                    asked[i] = taken;
                }
                times.push(asked[i]);
                let mut layers: Vec<LayerId> = s.layers.iter().map(|l| layer_id(l)).collect();
                layers.sort();
                layers.dedup();
                nodes.push(NodeState {
                    id: NodeId(i as u32),
                    capacity: Resources {
                        cpu_millis: s.capacity.cpu_millis,
                        mem_bytes: s.capacity.mem_bytes,
                        disk_bytes: s.capacity.disk_bytes,
                    },
                    reserved: Resources {
                        cpu_millis: s.reserved.cpu_millis,
                        mem_bytes: s.reserved.mem_bytes,
                        disk_bytes: s.reserved.disk_bytes,
                    },
                    used: Resources {
                        cpu_millis,
                        mem_bytes: s.used_mem_bytes,
                        disk_bytes: 0,
                    },
                    sandboxes: s.sandboxes,
                    limits: Limits {
                        cpu_overcommit: s.cpu_overcommit,
                        mem_overcommit: s.mem_overcommit,
                        max_sandboxes: s.max_sandboxes,
                        disk_overcommit: 1.0,
                    },
                    layers: layers.into(),
                });
                status.push(Some(s));
            }
        }
        // Ids are unique (one per index) and layer lists sorted: this does not fail; if it
        // did, the previous view stays.
        let snapshot = match Snapshot::new_per_node(nodes, times) {
            Ok(s) => {
                let s = Arc::new(s);
                *self.view.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(View {
                    snapshot: s.clone(),
                    status,
                });
                s
            }
            Err(e) => {
                tracing::warn!("front: snapshot: {e}");
                self.view().snapshot.clone()
            }
        };
        if tracing::enabled!(tracing::Level::TRACE) {
            let seen: Vec<String> = snapshot
                .nodes()
                .iter()
                .enumerate()
                .map(|(p, n)| {
                    format!(
                        "{}: {} sandboxes as of {:?}",
                        n.id.0,
                        n.sandboxes,
                        snapshot.taken_at_of(p)
                    )
                })
                .collect();
            tracing::trace!("front: poll at {taken:?}: {}", seen.join(", "));
        }
        self.polls.send_modify(|n| *n += 1);
        snapshot
    }

    /// Poll every `poll` (or when woken) in a task, handing each snapshot to `publish`;
    /// stops when `publish` returns false (the front is gone).
    pub fn spawn(self: Arc<Self>, mut publish: impl FnMut(Arc<Snapshot>) -> bool + Send + 'static) {
        let weak = Arc::downgrade(&self);
        drop(self);
        tokio::spawn(async move {
            loop {
                let Some(w) = weak.upgrade() else { return };
                let _ = tokio::time::timeout(w.poll, w.wake.notified()).await;
                let snapshot = w.poll_once().await;
                drop(w);
                if !publish(snapshot) {
                    return;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_parse() {
        let a: NodeAddr = "n1=http://127.0.0.1:3001/".parse().unwrap();
        assert_eq!(a.name.as_deref(), Some("n1"));
        assert_eq!(a.url, "http://127.0.0.1:3001");
        let b: NodeAddr = "http://10.0.0.2:3000".parse().unwrap();
        assert_eq!(b.name, None);
        for bad in [
            "n-1=http://127.0.0.1:1",
            "https://x:1",
            "http://x:1/path",
            "127.0.0.1:3000",
            "",
        ] {
            assert!(bad.parse::<NodeAddr>().is_err(), "{bad}");
        }
        assert_ne!(layer_id("base/debian:12"), layer_id("base/debian:13"));
    }
}
