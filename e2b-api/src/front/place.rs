//! A create, placed: the template (from the nodes' status) → a [`placement::Request`] → this
//! instance's placer picks a live node that has the template → the create is sent there;
//! a refusal (429, the node's edge admission) or a node that does not answer (connection
//! refused or broken: a dead node) sends it to another node, at most `max_attempts` in all.
//! A node killed while it creates leaves at most a half-made sandbox, which its next start
//! removes (`Manager::start`: a record still `creating` is leftovers), so the retry makes no
//! double.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use placement::{Layer, NodeId, Refusal, RefusalReason, Request, Resources};

use super::proxy;
use super::Front;
use crate::http::{error, error_with, Body, Response};
use crate::Error;

/// What the front needs of a create's body (the node parses the rest).
#[derive(Debug, Default, serde::Deserialize)]
struct NewSandbox {
    #[serde(default, rename = "templateID")]
    template_id: Option<String>,
}

/// A create that has waited this long for its node's answer is the client's to retry: it
/// may have happened.
pub(crate) const CREATE_TIMEOUT: Duration = Duration::from_secs(300);

/// Which limit a refusal's message names (the node's `admission` wording).
fn reason_of(message: &str) -> RefusalReason {
    let m = message.to_ascii_lowercase();
    if m.contains("cpu") {
        RefusalReason::Cpu
    } else if m.contains("disk") {
        RefusalReason::Disk
    } else if m.contains("sandboxes") {
        RefusalReason::Sandboxes
    } else {
        RefusalReason::Memory
    }
}

pub async fn create(front: &Arc<Front>, req: hyper::Request<Incoming>) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match crate::http::read_body(body, crate::MAX_JSON_BODY).await {
        Ok(b) => b,
        Err(e) => return error(&e),
    };
    let asked: NewSandbox = match crate::http::parse_json(&bytes) {
        Ok(a) => a,
        Err(e) => return error(&e),
    };
    let template = asked.template_id.unwrap_or_else(|| "base".to_owned());
    let mut view = front.watcher.view();
    if view.template(&template).is_none() {
        // A template made since the last poll (a snapshot of a sandbox, say): poll now.
        front.watcher.refresh(Duration::from_secs(3)).await;
        view = front.watcher.view();
    }
    let Some((t, having)) = view.template(&template) else {
        return if view.alive().next().is_none() {
            error_with(503, "no node of this cluster answers")
        } else {
            error(&Error::NotFound(format!(
                "template '{template}' not found on any node of this cluster"
            )))
        };
    };
    // Nodes without the template: never chosen.
    let mut excluded: Vec<NodeId> = view
        .alive()
        .filter(|n| !having.contains(n))
        .map(|n| NodeId(n as u32))
        .collect();
    let layers: Vec<Layer> = t
        .layers
        .iter()
        .map(|l| Layer {
            id: super::watcher::layer_id(l),
            // Sizes are not in the status: every layer weighs the same.
            bytes: 1,
        })
        .collect();
    let request = Request {
        resources: Resources {
            cpu_millis: t.cpu_millis.unwrap_or(0),
            mem_bytes: t.memory.unwrap_or(0),
            disk_bytes: 0,
        },
        layers: &layers,
    };
    let mut last: Option<Response> = None;
    for _ in 0..front.max_attempts {
        // Chosen and counted in the overlay at once: the creates of a burst arrive together,
        // and each must see the ones chosen before it (not only those answered).
        // In flight until the node answers: a busy node may count it only seconds later,
        // and no snapshot before its answer can be known to show it.
        let (node, ticket) = {
            let mut placer = front.placer();
            let now = front.now();
            match placer.choose(&request, now, &excluded) {
                Ok(n) => (n, placer.sent(n, &request, now)),
                Err(_) => break,
            }
        };
        let answered = |admitted: bool| front.placer().answered(ticket, front.now(), admitted);
        let n = node.0 as usize;
        tracing::debug!("front: create {ticket:?} sent to node {n}");
        let out = match forward_create(front, n, &parts, bytes.clone()) {
            Ok(r) => r,
            Err(e) => {
                answered(false);
                return error(&e);
            }
        };
        let answer = tokio::time::timeout(CREATE_TIMEOUT, proxy::send(front, n, out)).await;
        excluded.push(node);
        match answer {
            Ok(Ok(resp)) if resp.status() == http::StatusCode::TOO_MANY_REQUESTS => {
                answered(false);
                let (p, b) = resp.into_parts();
                let b = crate::http::read_body(b, crate::MAX_JSON_BODY)
                    .await
                    .unwrap_or_default();
                let message = String::from_utf8_lossy(&b).into_owned();
                tracing::debug!(
                    "front: {} refused a create: {message}",
                    front.watcher.nodes()[n].url
                );
                front.placer().refused(
                    &Refusal {
                        node,
                        reason: reason_of(&message),
                        need: 0,
                        free: 0,
                    },
                    front.now(),
                );
                last = Some(hyper::Response::from_parts(p, Body::full(b)));
            }
            Ok(Ok(resp)) => {
                // Any other answer is the node's last word on this create: admitted (2xx)
                // it counts there; a client error (a bad request, say) made nothing.
                answered(resp.status().is_success());
                return resp.map(Body::proxied);
            }
            Ok(Err(e)) => {
                answered(false);
                tracing::info!(
                    "front: create on {} failed ({e}); trying another node",
                    front.watcher.nodes()[n].url
                );
                front.watcher.mark_down(n);
                front.placer().refused(
                    &Refusal {
                        node,
                        reason: RefusalReason::Sandboxes,
                        need: 1,
                        free: 0,
                    },
                    front.now(),
                );
                last = Some(error_with(
                    502,
                    &format!("node {} is unreachable: {e}", front.watcher.nodes()[n].url),
                ));
            }
            Err(_) => {
                // It may yet happen: it stays in flight until the overlay's TTL.
                return error_with(
                    504,
                    &format!(
                        "node {} did not answer the create within {} s",
                        front.watcher.nodes()[n].url,
                        CREATE_TIMEOUT.as_secs()
                    ),
                );
            }
        }
    }
    last.unwrap_or_else(|| {
        error_with(
            503,
            &format!("no node of this cluster can take a sandbox of template '{template}' now"),
        )
    })
}

/// The create as the node gets it: same method, path, headers, the body the front read.
fn forward_create(
    front: &Front,
    node: usize,
    parts: &http::request::Parts,
    body: Bytes,
) -> crate::Result<hyper::Request<proxy::ReqBody>> {
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/".to_owned(), |p| p.as_str().to_owned());
    let mut b = hyper::Request::builder()
        .method(parts.method.clone())
        .uri(proxy::node_uri(front, node, &pq)?);
    for (k, v) in &parts.headers {
        if !matches!(
            k.as_str(),
            "host" | "content-length" | "transfer-encoding" | "connection" | "keep-alive"
        ) {
            b = b.header(k, v);
        }
    }
    b = b.header(crate::cluster::FRONT_HEADER, &front.id);
    b.body(proxy::full(body))
        .map_err(|e| Error::BadRequest(format!("create: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_their_limit() {
        assert_eq!(
            reason_of(
                r#"{"code":429,"message":"node reserved CPU (x16): this sandbox needs 1000, 0 is left"}"#
            ),
            RefusalReason::Cpu
        );
        assert_eq!(
            reason_of("this node runs 4096 sandboxes, its limit"),
            RefusalReason::Sandboxes
        );
        assert_eq!(
            reason_of("node memory: 1 bytes available"),
            RefusalReason::Memory
        );
    }
}
