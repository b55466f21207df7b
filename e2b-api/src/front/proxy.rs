//! The front's HTTP client to the nodes (HTTP/1.1, pooled connections) and the forwarding
//! of one request to one node: the method, path, query, headers and body go as they came
//! (the body streamed, never buffered), the Host too (a node routes a sandbox's ports by
//! it); the answer comes back streamed. An upgrade (101, WebSocket to a sandbox's port)
//! joins the client's connection and the node's byte for byte.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

use super::Front;
use crate::cluster::{SignedAnswer, SignedQuery};
use crate::http::{error_with, Body, Response};
use crate::{Error, Result};

/// A request body to a node: a client's, streamed, or bytes the front holds.
pub type ReqBody = UnsyncBoxBody<Bytes, hyper::Error>;

pub type Client = hyper_util::client::legacy::Client<HttpConnector, ReqBody>;

/// How long a node may take to accept a connection (a dead node refuses at once; a node
/// whose machine is gone does not answer at all).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

pub fn client() -> Client {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build(http)
}

pub fn full(b: impl Into<Bytes>) -> ReqBody {
    Full::new(b.into())
        .map_err(|never: std::convert::Infallible| match never {})
        .boxed_unsync()
}

pub fn streamed(b: Incoming) -> ReqBody {
    b.boxed_unsync()
}

/// Headers that describe one hop, not the message (RFC 9110 §7.6.1), dropped when passing a
/// message on (`Connection` and `Upgrade` kept on an upgrade).
fn strip_hop_by_hop(h: &mut HeaderMap, upgrade: bool) {
    for name in [
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
    ] {
        h.remove(name);
    }
    if !upgrade {
        h.remove(http::header::CONNECTION);
        h.remove(http::header::UPGRADE);
    }
}

/// Send `req` to node `node`'s API (its URI's path and query kept).
pub async fn send(
    front: &Front,
    node: usize,
    req: hyper::Request<ReqBody>,
) -> std::result::Result<hyper::Response<Incoming>, hyper_util::client::legacy::Error> {
    front.client.request(req).await.inspect_err(|e| {
        if e.is_connect() {
            tracing::info!(
                "front: node {} does not answer ({e}): marked down",
                front.watcher.nodes()[node].url
            );
            front.watcher.mark_down(node);
        }
    })
}

/// The node's URI for `path_and_query`.
pub fn node_uri(front: &Front, node: usize, path_and_query: &str) -> Result<http::Uri> {
    let url = format!("{}{path_and_query}", front.watcher.nodes()[node].url);
    url.parse()
        .map_err(|e| Error::BadRequest(format!("bad request target {path_and_query:?}: {e}")))
}

/// Forward `req` to node `node` and its answer back.
pub async fn forward(front: &Front, node: usize, mut req: hyper::Request<Incoming>) -> Response {
    let upgrade = req.headers().contains_key(http::header::UPGRADE);
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let sandbox = crate::http::header(&parts, "e2b-sandbox-id").map(str::to_owned);
    // HTTP/2's authority is HTTP/1.1's Host: a node routes ports by it.
    if !parts.headers.contains_key(http::header::HOST) {
        if let Some(a) = parts.uri.authority() {
            if let Ok(v) = http::HeaderValue::from_str(a.as_str()) {
                parts.headers.insert(http::header::HOST, v);
            }
        }
    }
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/".to_owned(), |p| p.as_str().to_owned());
    parts.uri = match node_uri(front, node, &pq) {
        Ok(u) => u,
        Err(e) => return crate::http::error(&e),
    };
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers, upgrade);
    let out = hyper::Request::from_parts(parts, streamed(body));
    let mut resp = match send(front, node, out).await {
        Ok(r) => r,
        Err(e) => {
            let why = format!(
                "its node {} is unreachable: {e}",
                front.watcher.nodes()[node].url
            );
            return match sandbox {
                Some(id) => super::envd_unreachable(pq.split('?').next().unwrap_or(""), &id, &why),
                None => error_with(502, &why),
            };
        }
    };
    if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client) = client_upgrade {
            let backend = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                match (client.await, backend.await) {
                    (Ok(c), Ok(b)) => {
                        let (mut c, mut b) = (TokioIo::new(c), TokioIo::new(b));
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut b).await;
                    }
                    (c, b) => {
                        tracing::debug!("front: upgrade: client {:?}, node {:?}", c.err(), b.err())
                    }
                }
            });
        }
    } else {
        strip_hop_by_hop(resp.headers_mut(), false);
    }
    resp.map(Body::proxied)
}

/// A small request of the front's own to a node (`key` as `X-API-KEY`): its status and
/// whole body (at most [`crate::MAX_JSON_BODY`]).
pub async fn call(
    front: &Front,
    node: usize,
    method: Method,
    path_and_query: &str,
    key: &str,
    body: Option<Bytes>,
) -> Result<(u16, HeaderMap, Bytes)> {
    let uri = node_uri(front, node, path_and_query)?;
    let req = request(method, uri, key, body)?;
    let resp = send(front, node, req)
        .await
        .map_err(|e| Error::Runtime(format!("node {}: {e}", front.watcher.nodes()[node].url)))?;
    let (parts, body) = resp.into_parts();
    let bytes = crate::http::read_body(body, crate::MAX_JSON_BODY).await?;
    Ok((parts.status.as_u16(), parts.headers, bytes))
}

fn request(
    method: Method,
    uri: http::Uri,
    key: &str,
    body: Option<Bytes>,
) -> Result<hyper::Request<ReqBody>> {
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(uri)
        .header("x-api-key", key);
    if body.is_some() {
        b = b.header(http::header::CONTENT_TYPE, "application/json");
    }
    b.body(full(body.unwrap_or_default()))
        .map_err(|e| Error::BadRequest(format!("request: {e}")))
}

/// Why a poll got no status: the node is down (no connection, or an answer that is not a
/// status), or only slow (its answer did not come whole).
#[derive(Debug)]
pub enum PollError {
    Down(String),
    Slow(String),
}

/// `GET uri` as JSON (the watcher's poll).
pub async fn get_json<T: serde::de::DeserializeOwned>(
    client: &Client,
    uri: &str,
    key: &str,
) -> std::result::Result<T, PollError> {
    let uri: http::Uri = uri
        .parse()
        .map_err(|e| PollError::Down(format!("{uri}: {e}")))?;
    let req = request(Method::GET, uri, key, None).map_err(|e| PollError::Down(e.to_string()))?;
    let resp = client.request(req).await.map_err(|e| {
        if e.is_connect() {
            PollError::Down(e.to_string())
        } else {
            PollError::Slow(e.to_string())
        }
    })?;
    let status = resp.status();
    let bytes = crate::http::read_body(resp.into_body(), crate::MAX_JSON_BODY)
        .await
        .map_err(|e| PollError::Slow(e.to_string()))?;
    if !status.is_success() {
        return Err(PollError::Down(format!(
            "{status}: {}",
            String::from_utf8_lossy(&bytes)
        )));
    }
    serde_json::from_slice(&bytes).map_err(|e| PollError::Down(format!("bad answer: {e}")))
}

/// The node one of whose sandboxes signs a signed `/files` URL (every live node asked at
/// once; the first that knows it).
pub async fn signed_node(front: &Front, method: &Method, query: &str) -> Result<usize> {
    let body = serde_json::to_vec(&SignedQuery {
        method: method.as_str().to_owned(),
        query: query.to_owned(),
    })
    .map_err(|e| Error::Runtime(e.to_string()))?;
    let body = Bytes::from(body);
    let key = front.keys[0].clone();
    let view = front.watcher.view();
    let asks = view.alive().map(|n| {
        let (body, key) = (body.clone(), key.clone());
        async move {
            let r = call(front, n, Method::POST, "/strata/signed", &key, Some(body)).await;
            match r {
                Ok((200, _, b)) => serde_json::from_slice::<SignedAnswer>(&b)
                    .ok()
                    .map(|a| (n, a.sandbox_id)),
                _ => None,
            }
        }
    });
    let answers = futures::future::join_all(asks).await;
    answers
        .into_iter()
        .flatten()
        .next()
        .map(|(n, _)| n)
        .ok_or_else(|| {
            Error::Unauthenticated("invalid signature (no sandbox of this cluster signs it)".into())
        })
}
