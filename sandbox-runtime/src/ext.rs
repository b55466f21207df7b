//! The sandbox operations on the node's socket: `ublk_daemon::node::server::Extension`.

use std::sync::Arc;

use tokio::sync::mpsc;
use ublk_daemon::node::proto::{ApiError, ErrorKind, ResponseLine};
use ublk_daemon::node::server::Extension;

use crate::manager::{exec_stream, Manager};
use base64::Engine as _;

use crate::proto::{InputRequest, Request};

/// Serves [`crate::proto`]'s operations with a [`Manager`].
#[derive(Debug, Clone)]
pub struct SandboxExtension {
    pub manager: Arc<Manager>,
}

fn one(r: Result<serde_json::Value, ApiError>) -> mpsc::Receiver<ResponseLine> {
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(match r {
        Ok(v) => ResponseLine::success(v),
        Err(e) => ResponseLine::failure(e),
    });
    rx
}

fn value<T: serde::Serialize>(r: crate::Result<T>) -> Result<serde_json::Value, ApiError> {
    r.map_err(ApiError::from).and_then(|v| {
        serde_json::to_value(v).map_err(|e| ApiError::new(ErrorKind::Internal, e.to_string()))
    })
}

/// `sandbox_input`: each part present, in order (bytes, close, signal, resize).
async fn input(m: &Manager, r: InputRequest) -> crate::Result<serde_json::Value> {
    let e = m.find_exec(&r.id, &r.exec)?;
    if let Some(d) = &r.data {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(d)
            .map_err(|err| crate::Error::InvalidSpec(format!("data is not base64: {err}")))?;
        e.write_stdin(bytes).await?;
    }
    if r.close {
        e.close_stdin().await?;
    }
    if let Some(s) = r.signal {
        e.signal(s)?;
    }
    if let Some(size) = r.pty {
        e.resize(size)?;
    }
    Ok(serde_json::json!({}))
}

impl Extension for SandboxExtension {
    fn claims(&self, op: &str) -> bool {
        op.starts_with("sandbox_")
    }

    fn handle(&self, request: serde_json::Value) -> mpsc::Receiver<ResponseLine> {
        let request: Request = match serde_json::from_value(request) {
            Ok(r) => r,
            Err(e) => {
                return one(Err(ApiError::new(
                    ErrorKind::BadRequest,
                    format!("bad request: {e}"),
                )))
            }
        };
        let m = self.manager.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut lines = match request {
                Request::SandboxCreate(r) => one(value(m.create_or_take(r).await)),
                Request::SandboxExec(r) => {
                    let detach = r.detach;
                    exec_stream(m.exec(r).await, detach)
                }
                Request::SandboxRun(r) => {
                    let detach = r.exec.detach;
                    exec_stream(m.run(&r.stack, r.exec).await, detach)
                }
                Request::SandboxAttach(a) => match m.find_exec(&a.id, &a.exec) {
                    Ok(e) => e.follow([a.stdout_from, a.stderr_from]),
                    Err(e) => one(Err(e.into())),
                },
                Request::SandboxCp(r) => one(value(m.copy(r).await)),
                Request::SandboxLs {} => one(value(Ok(m.list()))),
                Request::SandboxInspect { id } => one(value(m.inspect(&id).await)),
                Request::SandboxRm { id } => one(value(m.remove(&id).await)),
                Request::SandboxPoolSet(p) => one(value(m.set_pool(&p.stack, p.size))),
                Request::SandboxPoolLs {} => one(value(Ok(m.pools()))),
                Request::SandboxNet { id, allow } => one(value(m.set_net(&id, allow).await)),
                Request::SandboxPause { id } => one(value(m.pause(&id).await)),
                Request::SandboxResume { id } => one(value(m.resume(&id).await)),
                Request::SandboxSuspend { id } => one(value(m.suspend(&id).await)),
                Request::SandboxInput(r) => one(value(input(&m, r).await)),
                Request::SandboxPack(r) => one(value(m.pack_diff(r).await)),
                Request::SandboxFork { id, count } => one(value(m.clone().fork(id, count).await)),
            };
            while let Some(l) = lines.recv().await {
                if tx.send(l).await.is_err() {
                    return;
                }
            }
        });
        rx
    }

    fn keeps_mounts(&self) -> bool {
        self.manager.has_sandboxes()
    }
}
