//! Ports of a sandbox: HTTP (and upgrades such as WebSocket) to a port inside a sandbox,
//! routed by the Host name `{port}-{sandboxId}.{domain}` that E2B's `get_host()` builds (or by
//! `E2b-Sandbox-Id` with an `E2b-Sandbox-Port` other than envd's).
//!
//! The connection is made inside the sandbox's network namespace, to `127.0.0.1:port`: a
//! short-lived thread enters `/proc/<init>/ns/net` (`setns`), connects, and ends — a socket
//! keeps the namespace it was made in, and no thread of the daemon's pools ever changes its
//! own. The request goes over that connection with hyper's HTTP/1.1 client; an upgrade (101)
//! joins both upgraded connections byte for byte.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::http::{error_with, Body, Response};
use crate::state::Api;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `{port}-{id}.…` of a Host header: the port and the sandbox id.
pub fn parse_host(host: &str) -> Option<(u16, String)> {
    let first = host.split('.').next()?;
    if !host.contains('.') {
        return None;
    }
    let (port, id) = first.split_once('-')?;
    let port: u16 = port.parse().ok().filter(|p| *p > 0)?;
    sandbox_runtime::valid_id(id).then(|| (port, id.to_owned()))
}

/// Connect to `127.0.0.1:port` inside the network namespace of process `init`.
fn connect_in(init: u32, port: u16) -> std::io::Result<TcpStream> {
    let ns = std::fs::File::open(format!("/proc/{init}/ns/net"))?;
    std::thread::Builder::new()
        .name("sandbox-port".into())
        .spawn(move || {
            // This thread exists for this connection only: it ends in the sandbox's
            // namespace, which no other code runs in.
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )?;
            TcpStream::connect_timeout(
                &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                CONNECT_TIMEOUT,
            )
        })?
        .join()
        .map_err(|_| std::io::Error::other("the connecting thread panicked"))?
}

/// Proxy `req` to port `port` of sandbox `id`.
pub async fn proxy(
    api: &Arc<Api>,
    id: &str,
    port: u16,
    mut req: hyper::Request<Incoming>,
) -> Response {
    let Some(meta) = api.meta(id) else {
        return error_with(502, &format!("The sandbox {id} was not found"));
    };
    if meta.paused {
        return error_with(502, &format!("sandbox {id} is paused"));
    }
    let init = match api.init_pid(id) {
        Ok(p) => p,
        Err(e) => return error_with(502, &e.to_string()),
    };
    let stream = match tokio::task::spawn_blocking(move || connect_in(init, port)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return error_with(
                502,
                &format!("The sandbox {id} is running but port {port} is not open: {e}"),
            )
        }
        Err(e) => return error_with(500, &format!("connect task: {e}")),
    };
    let stream = match stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpStream::from_std(stream))
    {
        Ok(s) => s,
        Err(e) => return error_with(500, &format!("port {port}: {e}")),
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(x) => x,
        Err(e) => return error_with(502, &format!("port {port} of sandbox {id}: {e}")),
    };
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("sandbox port connection: {e}");
        }
    });
    let upgrade = req.headers().contains_key(http::header::UPGRADE);
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    // HTTP/1.1 to the sandbox whatever the client spoke; the path and query stay.
    *req.version_mut() = http::Version::HTTP_11;
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/".to_owned(), |p| p.as_str().to_owned());
    if let Ok(u) = pq.parse() {
        *req.uri_mut() = u;
    }
    if !req.headers().contains_key(http::header::HOST) {
        if let Ok(v) = http::HeaderValue::from_str(&format!("127.0.0.1:{port}")) {
            req.headers_mut().insert(http::header::HOST, v);
        }
    }
    let mut resp = match sender.send_request(req).await {
        Ok(r) => r,
        Err(e) => return error_with(502, &format!("port {port} of sandbox {id}: {e}")),
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
                    (c, b) => tracing::debug!(
                        "upgrade to a sandbox port: client {:?}, sandbox {:?}",
                        c.err(),
                        b.err()
                    ),
                }
            });
        }
    }
    resp.map(Body::proxied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_a_port_and_a_sandbox() {
        assert_eq!(
            parse_host("8080-iabc123.e2b.app"),
            Some((8080, "iabc123".to_owned()))
        );
        assert_eq!(
            parse_host("8080-iabc123.localhost:3000").map(|h| h.0),
            Some(8080)
        );
        for bad in [
            "127.0.0.1:3000",
            "localhost",
            "x-iabc.e2b.app",
            "0-iabc.d",
            "99999-a.d",
            "80-A.d",
        ] {
            assert_eq!(parse_host(bad), None, "{bad}");
        }
    }
}
