//! The API socket: accept connections, check the peer is root (or the daemon's own user),
//! read one request line at a time, answer it; stop on SIGTERM/SIGINT.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::proto::{ApiError, ErrorKind, RequestLine, ResponseLine, MAX_LINE, VERSION};
use super::Node;

/// Bind the socket at `path` (replacing a stale one: the caller holds the run-dir lock),
/// mode 0600.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    // Created under a 0700 directory, then narrowed: no one else can connect in between.
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Serve `node` on `listener` until SIGTERM or SIGINT, then shut the node down.
pub async fn serve_until_signal(node: Arc<Node>, listener: UnixListener) -> Result<(), ApiError> {
    let stop = crate::signal::StopSignal::install()
        .map_err(|e| ApiError::new(ErrorKind::Internal, format!("catch SIGTERM/SIGINT: {e}")))?;
    tokio::select! {
        s = stop.wait() => {
            tracing::info!("{}: stopping", if s == libc::SIGINT { "SIGINT" } else { "SIGTERM" })
        }
        () = node.wait_handed_over() => {
            // Nothing is unmounted: the next daemon serves the mounts (it has bound its own
            // socket by the time it asked, or binds it when it starts).
            return Ok(());
        }
        () = serve(node.clone(), listener) => {}
    }
    let _ = std::fs::remove_file(node.socket_path());
    node.shutdown().await
}

/// Accept connections forever, one task per connection.
pub async fn serve(node: Arc<Node>, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let node = node.clone();
                tokio::spawn(async move {
                    if let Err(e) = connection(node, stream).await {
                        tracing::debug!("API connection: {e}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("accept on the API socket: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

async fn respond(w: &mut (impl AsyncWriteExt + Unpin), r: &ResponseLine) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    line.push(b'\n');
    w.write_all(&line).await?;
    w.flush().await
}

fn failure(e: ApiError) -> ResponseLine {
    ResponseLine {
        v: VERSION,
        ok: false,
        result: None,
        error: Some(e),
    }
}

async fn connection(node: Arc<Node>, stream: UnixStream) -> std::io::Result<()> {
    let me = rustix::process::geteuid().as_raw();
    let peer = stream.peer_cred()?;
    let (r, mut w) = stream.into_split();
    if peer.uid() != 0 && peer.uid() != me {
        let e = ApiError::new(
            ErrorKind::NotRoot,
            format!(
                "uid {} may not use the strata daemon (root only)",
                peer.uid()
            ),
        );
        return respond(&mut w, &failure(e)).await;
    }
    let mut reader = BufReader::new(r);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line)
            .await?;
        if n == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            let e = ApiError::new(
                ErrorKind::BadRequest,
                format!("request line longer than {MAX_LINE} bytes or not newline-terminated"),
            );
            return respond(&mut w, &failure(e)).await;
        }
        let request: RequestLine = match serde_json::from_slice(&line) {
            Ok(r) => r,
            Err(e) => {
                let e = ApiError::new(ErrorKind::BadRequest, format!("bad request: {e}"));
                return respond(&mut w, &failure(e)).await;
            }
        };
        if request.v != VERSION {
            let e = ApiError::new(
                ErrorKind::BadRequest,
                format!(
                    "protocol version {} not supported (this daemon speaks {VERSION}); use a matching strata",
                    request.v
                ),
            );
            return respond(&mut w, &failure(e)).await;
        }
        let handover = request.request == super::proto::Request::Handover;
        let response = match node.handle(request.request).await {
            Ok(result) => ResponseLine {
                v: VERSION,
                ok: true,
                result: Some(result),
                error: None,
            },
            Err(e) => failure(e),
        };
        let sent = respond(&mut w, &response).await;
        if handover && node.handed_over() {
            node.notify_handed_over();
        }
        sent?;
    }
}
