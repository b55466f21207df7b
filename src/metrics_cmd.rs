//! `strata daemon --metrics ADDR`: the node's metrics at `GET /metrics` in Prometheus text
//! format (`ublk_daemon::node::metrics`: what each metric is, and that it is the same
//! snapshot `strata status --json` prints). HTTP/1.1 through hyper; no other path.

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use ublk_daemon::node::{metrics, Node};

/// Serve `listener` until the process ends.
pub async fn serve(node: Arc<Node>, listener: TcpListener) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("metrics: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let node = node.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let node = node.clone();
                async move { Ok::<_, Infallible>(answer(&node, &req).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!("metrics: connection from {peer}: {e}");
            }
        });
    }
}

async fn answer(node: &Node, req: &hyper::Request<Incoming>) -> hyper::Response<Full<Bytes>> {
    let reply = |status: u16, ctype: &str, body: String| {
        let mut r = hyper::Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
        if let Ok(v) = http::HeaderValue::from_str(ctype) {
            r.headers_mut().insert(http::header::CONTENT_TYPE, v);
        }
        r
    };
    if req.uri().path() != "/metrics" {
        return reply(
            404,
            "text/plain",
            "not found: the metrics are at /metrics\n".into(),
        );
    }
    if req.method() != http::Method::GET && req.method() != http::Method::HEAD {
        return reply(
            405,
            "text/plain",
            "method not allowed: GET /metrics\n".into(),
        );
    }
    let text = metrics::render(&node.status().await);
    reply(200, metrics::CONTENT_TYPE, text)
}
