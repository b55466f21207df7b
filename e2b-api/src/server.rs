//! The listener: HTTP/1.1 and cleartext HTTP/2 (prior knowledge) on one port, one task per
//! connection, and the routing of each request — envd (by `E2b-Sandbox-Id`), a signed file
//! URL, or the control plane (by `X-API-KEY`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use hyper::body::Incoming;
use tokio::net::TcpListener;

use crate::http::{error, error_with, Response};
use crate::state::Api;
use crate::Error;

/// How `strata daemon --api` serves.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// Where to listen (`127.0.0.1:3000`; port 0: any free one, printed at start).
    pub addr: SocketAddr,
    /// The API keys, one a line.
    pub keys: PathBuf,
    /// The API's state (`templates.json`, `e2b-sandboxes.json`).
    pub state_dir: PathBuf,
}

/// Serve `api` on `listener` until the task is dropped.
pub async fn serve(api: Arc<Api>, listener: TcpListener) {
    api.start_reaper();
    crate::http::serve_connections(listener, "e2b api", move |req| {
        let api = api.clone();
        async move { route(&api, req).await }
    })
    .await;
}

/// Route one request.
async fn route(api: &Arc<Api>, req: hyper::Request<Incoming>) -> Response {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let sandbox = header("e2b-sandbox-id");
    let port = header("e2b-sandbox-port").and_then(|p| p.parse::<u16>().ok());
    match (sandbox, port) {
        (Some(id), Some(port)) if port.to_string() != crate::envd::ENVD_PORT => {
            return crate::ports::proxy(api, &id, port, req).await;
        }
        (Some(id), _) => return crate::envd::handle(api, &id, req).await,
        (None, _) => {}
    }
    // `{port}-{id}.{domain}`: a port of a sandbox (HTTP/1.1's Host, HTTP/2's authority).
    let host = header("host").or_else(|| req.uri().authority().map(|a| a.to_string()));
    if let Some((port, id)) = host.as_deref().and_then(crate::ports::parse_host) {
        if port.to_string() == crate::envd::ENVD_PORT {
            return crate::envd::handle(api, &id, req).await;
        }
        return crate::ports::proxy(api, &id, port, req).await;
    }
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    let method = req.method().clone();
    if path == "/files" && query.as_deref().is_some_and(|q| q.contains("signature=")) {
        return match crate::files::signed_sandbox(api, &method, query.as_deref()) {
            Ok(id) => crate::envd::handle_signed(api, &id, req).await,
            Err(e) => error(&e),
        };
    }
    if path == "/health" {
        return crate::http::json(200, &serde_json::json!({ "status": "ok" }));
    }
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if key.is_empty() {
        crate::http::drain_in_background(req.into_body());
        return error(&Error::Unauthenticated(
            "no X-API-KEY: every request of this API needs one".into(),
        ));
    }
    if !api.key_ok(key) {
        crate::http::drain_in_background(req.into_body());
        return error_with(401, "Invalid API key");
    }
    let front = header(crate::cluster::FRONT_HEADER).filter(|f| f.len() <= 64);
    let body = req.into_body();
    if path.starts_with("/strata/") {
        return crate::cluster::handle(api, &method, &path, body).await;
    }
    crate::control::handle(api, &method, &path, query.as_deref(), front, body).await
}
