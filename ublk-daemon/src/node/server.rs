//! The API socket: accept connections, check the peer is root (or the daemon's own user),
//! read one request line at a time, answer it; stop on SIGTERM/SIGINT.
//!
//! Another crate may serve more operations on the same socket through an [`Extension`] (the
//! sandbox runtime's `sandbox_*` ops, wired in by the `strata` binary): a request whose `op`
//! the extension claims is answered by a stream of lines, each `{"v": 1, "ok": true,
//! "event": {...}}`, ended by one ordinary response line (`result` or `error`). A client that
//! goes away mid-stream drops the stream; what the operation started goes on.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::proto::{ApiError, ErrorKind, RequestLine, ResponseLine, MAX_LINE, VERSION};
use super::Node;

/// Operations another crate serves on the node's socket (see the module docs).
pub trait Extension: Send + Sync + 'static {
    /// Whether `op` is one of this extension's operations.
    fn claims(&self, op: &str) -> bool;
    /// Answer `request` (the whole request object, `v` and `op` included): the lines to send,
    /// in order; the last one carries `result` or `error`, the ones before it `event`. The
    /// receiver is dropped when the client goes away.
    fn handle(&self, request: serde_json::Value) -> tokio::sync::mpsc::Receiver<ResponseLine>;
    /// Whether a stop (SIGTERM/SIGINT) must leave every mount in place for the next daemon,
    /// as a handover does, because the extension's users (running sandboxes) still need them.
    fn keeps_mounts(&self) -> bool;
}

/// The extension a server answers with, if any.
pub type SharedExtension = Option<Arc<dyn Extension>>;

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

/// Serve `node` (and `ext`'s operations) on `listener` until SIGTERM or SIGINT, then shut
/// the node down, unless `ext` keeps its mounts: then the daemon exits as after a handover,
/// and the next one resumes everything.
pub async fn serve_until_signal(
    node: Arc<Node>,
    listener: UnixListener,
    ext: SharedExtension,
) -> Result<(), ApiError> {
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
        () = serve_with(node.clone(), listener, ext.clone()) => {}
    }
    let _ = std::fs::remove_file(node.socket_path());
    if ext.as_ref().is_some_and(|e| e.keeps_mounts()) {
        // As for a takeover: nothing is unmounted, the fd holder keeps the FUSE connection,
        // and the next daemon on this run directory resumes it and adopts the mounts.
        match node.handover().await {
            Ok(_) => {
                tracing::info!("sandboxes are running: every mount stays for the next daemon");
                return Ok(());
            }
            Err(e) => {
                tracing::warn!("cannot leave the mounts to the next daemon ({e}): unmounting")
            }
        }
    }
    node.shutdown().await
}

/// Accept connections forever, one task per connection.
pub async fn serve(node: Arc<Node>, listener: UnixListener) {
    serve_with(node, listener, None).await
}

/// [`serve`], with `ext`'s operations.
pub async fn serve_with(node: Arc<Node>, listener: UnixListener, ext: SharedExtension) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let node = node.clone();
                let ext = ext.clone();
                tokio::spawn(async move {
                    if let Err(e) = connection(node, ext, stream).await {
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
    ResponseLine::failure(e)
}

async fn connection(
    node: Arc<Node>,
    ext: SharedExtension,
    stream: UnixStream,
) -> std::io::Result<()> {
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
        let value: serde_json::Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            Err(e) => {
                let e = ApiError::new(ErrorKind::BadRequest, format!("bad request: {e}"));
                return respond(&mut w, &failure(e)).await;
            }
        };
        if let Some(ext) = &ext {
            let op = value.get("op").and_then(|o| o.as_str()).unwrap_or("");
            let v = value.get("v").and_then(|v| v.as_u64());
            if v == Some(u64::from(VERSION)) && ext.claims(op) {
                let mut lines = ext.handle(value);
                let mut ended = false;
                while let Some(l) = lines.recv().await {
                    ended = l.event.is_none();
                    respond(&mut w, &l).await?;
                    if ended {
                        break;
                    }
                }
                if !ended {
                    let e =
                        ApiError::new(ErrorKind::Internal, "the operation ended without an answer");
                    respond(&mut w, &failure(e)).await?;
                }
                continue;
            }
        }
        let request: RequestLine = match serde_json::from_value(value) {
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
            Ok(result) => ResponseLine::success(result),
            Err(e) => failure(e),
        };
        let sent = respond(&mut w, &response).await;
        if handover && node.handed_over() {
            node.notify_handed_over();
        }
        sent?;
    }
}
