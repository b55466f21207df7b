//! `process.Process`: commands in a sandbox through the runtime's exec path (with its output
//! caps). `Start` and `Connect` are server streams of `ProcessEvent`s (`start` with the pid,
//! `data` with stdout/stderr bytes, `keepalive`, `end` with the exit); the rest are unary.
//!
//! A process is named by a pid this API hands out (unique on the node while it runs) and an
//! optional tag. Signals reach the command and everything it started: each exec carries a
//! marker variable (`STRATA_E2B_PROCESS`), and the processes of the sandbox's cgroup whose
//! environment holds it are signalled from the host.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::connect::{self, Code, RpcError, RpcResult, StreamSender};
use crate::envd::{request_message, Ctx};
use crate::http::Response;
use crate::Error;

/// The environment variable that marks an exec's processes.
pub const MARKER: &str = "STRATA_E2B_PROCESS";

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessConfig {
    #[serde(default)]
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct PtySize {
    #[serde(default)]
    cols: u32,
    #[serde(default)]
    rows: u32,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct Pty {
    #[serde(default)]
    size: Option<PtySize>,
}

#[derive(Debug, Default, Deserialize)]
struct StartRequest {
    #[serde(default)]
    process: Option<ProcessConfig>,
    #[serde(default)]
    pty: Option<Pty>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: Option<bool>,
}

/// `ProcessSelector`: `{"pid": N}` or `{"tag": "…"}`.
#[derive(Debug, Default, Deserialize)]
struct Selector {
    #[serde(default)]
    pid: Option<u32>,
    #[serde(default)]
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct WithSelector {
    #[serde(default)]
    process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
struct SignalRequest {
    #[serde(default)]
    process: Option<Selector>,
    #[serde(default)]
    signal: Option<serde_json::Value>,
}

/// One process the API started.
#[derive(Debug)]
pub struct Proc {
    pub pid: u32,
    pub tag: Option<String>,
    pub config: ProcessConfig,
    pub exec: Arc<sandbox_runtime::Exec>,
    marker: String,
}

/// The processes of every sandbox, by sandbox.
#[derive(Debug)]
pub struct Procs {
    next: AtomicU32,
    map: Mutex<HashMap<String, Vec<Arc<Proc>>>>,
}

impl Default for Procs {
    fn default() -> Self {
        Self {
            next: AtomicU32::new(1000),
            map: Mutex::new(HashMap::new()),
        }
    }
}

/// Finished processes a sandbox remembers (for a late `Connect`).
const KEPT_FINISHED: usize = 64;

impl Procs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Arc<Proc>>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, sandbox: &str, p: Arc<Proc>) {
        let mut m = self.lock();
        let v = m.entry(sandbox.to_owned()).or_default();
        v.push(p);
        while v.iter().filter(|p| p.exec.result().is_some()).count() > KEPT_FINISHED {
            if let Some(i) = v.iter().position(|p| p.exec.result().is_some()) {
                v.remove(i);
            }
        }
    }

    fn find(&self, sandbox: &str, sel: &Selector) -> RpcResult<Arc<Proc>> {
        let m = self.lock();
        let all = m.get(sandbox).map(Vec::as_slice).unwrap_or(&[]);
        let found = match (sel.pid, &sel.tag) {
            (Some(pid), _) => all.iter().rev().find(|p| p.pid == pid),
            (None, Some(tag)) => all
                .iter()
                .rev()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()) && p.exec.result().is_none()),
            (None, None) => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "a process selector needs a pid or a tag",
                ))
            }
        };
        found.cloned().ok_or_else(|| {
            RpcError::new(
                Code::NotFound,
                match (sel.pid, &sel.tag) {
                    (Some(pid), _) => format!("process with pid {pid} not found"),
                    (_, Some(t)) => format!("process with tag {t} not found"),
                    _ => "process not found".into(),
                },
            )
        })
    }

    fn running(&self, sandbox: &str) -> Vec<Arc<Proc>> {
        self.lock()
            .get(sandbox)
            .map(|v| {
                v.iter()
                    .filter(|p| p.exec.result().is_none())
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn forget(&self, sandbox: &str) {
        self.lock().remove(sandbox);
    }
}

fn selector(s: Option<Selector>) -> RpcResult<Selector> {
    s.ok_or_else(|| RpcError::new(Code::InvalidArgument, "no process selector"))
}

/// Serve `process.Process/<method>`.
pub async fn handle(
    ctx: Ctx,
    method: &str,
    parts: &http::request::Parts,
    body: Incoming,
) -> Response {
    match method {
        "Start" => match request_message::<StartRequest>(parts, body).await {
            Ok(r) => start(ctx, r).await,
            Err(e) => connect::stream_error(e),
        },
        "Connect" => match request_message::<WithSelector>(parts, body).await {
            Ok(r) => reconnect(ctx, r).await,
            Err(e) => connect::stream_error(e),
        },
        "List" => unary(list(&ctx)),
        "SendSignal" => match request_message::<SignalRequest>(parts, body).await {
            Ok(r) => unary(send_signal(&ctx, r).await),
            Err(e) => connect::unary_error(&e),
        },
        "SendInput" | "CloseStdin" | "Update" => {
            // Parsed first, so a malformed request is still a clear invalid_argument.
            match request_message::<serde_json::Value>(parts, body).await {
                Ok(_) => connect::unary_error(&no_interactive(method)),
                Err(e) => connect::unary_error(&e),
            }
        }
        "StreamInput" => {
            let mut reader = connect::MessageReader::new(body);
            let first = reader.next_json::<serde_json::Value>().await;
            let e = match first {
                Err(e) => e,
                Ok(_) => no_interactive(method),
            };
            let (tx, resp) = connect::stream_response();
            tokio::spawn(tx.end(Some(e)));
            resp
        }
        other => connect::unary_error(&RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{other}: no such procedure"),
        )),
    }
}

fn no_interactive(method: &str) -> RpcError {
    RpcError::new(
        Code::Unimplemented,
        format!(
            "process.Process/{method}: this node's runtime has no stdin, PTY or resize for a running command yet"
        ),
    )
}

fn unary(r: RpcResult<serde_json::Value>) -> Response {
    match r {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => connect::unary_error(&e),
    }
}

fn list(ctx: &Ctx) -> RpcResult<serde_json::Value> {
    let processes: Vec<serde_json::Value> = ctx
        .api
        .procs
        .running(&ctx.id)
        .iter()
        .map(|p| {
            let mut info = json!({ "config": p.config, "pid": p.pid });
            if let Some(t) = &p.tag {
                info["tag"] = json!(t);
            }
            info
        })
        .collect();
    Ok(json!({ "processes": processes }))
}

async fn start(ctx: Ctx, req: StartRequest) -> Response {
    match start_exec(&ctx, req).await {
        Ok(p) => stream_events(ctx, p, [0, 0]),
        Err(e) => connect::stream_error(e),
    }
}

async fn start_exec(ctx: &Ctx, req: StartRequest) -> RpcResult<Arc<Proc>> {
    let config = req
        .process
        .ok_or_else(|| RpcError::new(Code::InvalidArgument, "StartRequest has no process"))?;
    if config.cmd.is_empty() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "the process has no cmd",
        ));
    }
    if let Some(pty) = &req.pty {
        let size = pty.size.clone().unwrap_or_default();
        return Err(RpcError::new(
            Code::Unimplemented,
            format!(
                "a PTY ({}x{}) needs the runtime's terminal support, which this node does not have yet",
                size.cols, size.rows
            ),
        ));
    }
    if req.stdin == Some(true) {
        return Err(no_interactive("Start with stdin"));
    }
    let root = ctx.root().map_err(RpcError::from)?;
    let (user, _) = ctx.user(&root).map_err(RpcError::from)?;
    let cwd = match config.cwd.as_deref() {
        Some(c) if !c.is_empty() => crate::fs::absolute(c, &user.home).map_err(RpcError::from)?,
        _ => user.home.clone(),
    };
    let pid = ctx.api.procs.next.fetch_add(1, Ordering::Relaxed);
    let marker = format!("{}-{pid}", ctx.id);
    let mut env: Vec<String> = vec![
        format!("HOME={}", user.home),
        format!("USER={}", user.name),
        format!("LOGNAME={}", user.name),
    ];
    for (k, v) in &config.envs {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("bad environment variable {k:?}"),
            ));
        }
        env.push(format!("{k}={v}"));
    }
    env.push(format!("{MARKER}={marker}"));
    let mut args = vec![config.cmd.clone()];
    args.extend(config.args.iter().cloned());
    let exec = ctx
        .api
        .manager
        .exec(sandbox_runtime::proto::ExecRequest {
            id: ctx.id.clone(),
            args,
            env,
            cwd: Some(cwd),
            user: (user.uid != 0).then(|| format!("{}:{}", user.uid, user.gid)),
            ..Default::default()
        })
        .await
        .map_err(|e| RpcError::from(Error::from(e)))?;
    let p = Arc::new(Proc {
        pid,
        tag: req.tag,
        config,
        exec,
        marker,
    });
    ctx.api.procs.add(&ctx.id, p.clone());
    Ok(p)
}

async fn reconnect(ctx: Ctx, req: WithSelector) -> Response {
    let p = match selector(req.process).and_then(|s| ctx.api.procs.find(&ctx.id, &s)) {
        Ok(p) => p,
        Err(e) => return connect::stream_error(e),
    };
    // From now on: what the command writes after the connect (as envd does).
    let (out, err, _) = p.exec.totals();
    stream_events(ctx, p, [out, err])
}

/// `ProcessEvent.EndEvent` of an exec's result.
fn end_event(r: &sandbox_runtime::proto::ExecResult) -> serde_json::Value {
    use sandbox_runtime::proto::ExitReason;
    let (code, exited, status) = match (r.exit_code, r.signal) {
        (Some(c), _) => (c, true, format!("exit status {c}")),
        (None, Some(s)) => (-1, false, format!("signal: {}", signal_name(s))),
        (None, None) => (-1, false, "unknown".to_owned()),
    };
    let mut end = json!({ "exitCode": code, "exited": exited, "status": status });
    let error = match r.reason {
        ExitReason::Exited => None,
        ExitReason::Timeout => Some("the command's timeout ran out: killed".to_owned()),
        ExitReason::Oom => Some("out of memory: killed".to_owned()),
        ExitReason::Killed => Some("killed (the sandbox was removed or its init died)".to_owned()),
        ExitReason::Failed => Some(
            r.message
                .clone()
                .unwrap_or_else(|| "failed to start".into()),
        ),
    };
    if let Some(e) = error {
        end["error"] = json!(e);
    }
    json!({ "event": { "end": end } })
}

/// Go's `syscall.Signal.String()` words for the common signals.
fn signal_name(s: i32) -> String {
    match s {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        11 => "segmentation fault".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// Stream `p`'s events from `from` (stdout, stderr offsets): `start`, `data`…, `end`.
fn stream_events(ctx: Ctx, p: Arc<Proc>, from: [u64; 2]) -> Response {
    let (tx, resp) = connect::stream_response();
    tokio::spawn(async move {
        let ok = tx
            .send(&json!({ "event": { "start": { "pid": p.pid } } }))
            .await;
        if !ok {
            return;
        }
        let r = follow(&tx, &p, from, ctx.keepalive_s).await;
        tx.end(r.err()).await;
    });
    resp
}

async fn follow(
    tx: &StreamSender,
    p: &Proc,
    from: [u64; 2],
    keepalive_s: Option<u64>,
) -> RpcResult<()> {
    let mut lines = p.exec.follow(from);
    let period = Duration::from_secs(keepalive_s.unwrap_or(50).clamp(1, 3600));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    loop {
        let line = tokio::select! {
            l = lines.recv() => l,
            _ = ticker.tick() => {
                if !tx.send(&json!({ "event": { "keepalive": {} } })).await {
                    return Ok(());
                }
                continue;
            }
            () = tx.closed() => return Ok(()),
        };
        let Some(line) = line else {
            return Err(RpcError::new(
                Code::Internal,
                "the exec's stream ended without its result",
            ));
        };
        if let Some(ev) = line.event {
            if ev.get("type").and_then(|t| t.as_str()) != Some("output") {
                continue;
            }
            let stream = match ev.get("stream").and_then(|s| s.as_str()) {
                Some("stderr") => "stderr",
                _ => "stdout",
            };
            // The runtime's base64 is proto3 JSON's `bytes` already.
            let data = ev.get("data").cloned().unwrap_or_else(|| json!(""));
            if !tx
                .send(&json!({ "event": { "data": { stream: data } } }))
                .await
            {
                return Ok(());
            }
            continue;
        }
        if !line.ok {
            let msg = line
                .error
                .map(|e| e.message)
                .unwrap_or_else(|| "the exec failed".into());
            return Err(RpcError::new(Code::Internal, msg));
        }
        let result: sandbox_runtime::proto::ExecResult =
            serde_json::from_value(line.result.unwrap_or_default())
                .map_err(|e| RpcError::new(Code::Internal, format!("the exec's result: {e}")))?;
        tx.send(&end_event(&result)).await;
        return Ok(());
    }
}

/// A `Signal` of the request: its name (`SIGNAL_SIGKILL`) or number.
fn parse_signal(v: Option<&serde_json::Value>) -> RpcResult<i32> {
    match v {
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" => Ok(libc::SIGKILL),
            "SIGNAL_SIGTERM" => Ok(libc::SIGTERM),
            other => Err(RpcError::new(
                Code::InvalidArgument,
                format!("unknown signal {other}"),
            )),
        },
        Some(serde_json::Value::Number(n)) => match n.as_i64() {
            Some(9) => Ok(libc::SIGKILL),
            Some(15) => Ok(libc::SIGTERM),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!("unknown signal {n}"),
            )),
        },
        _ => Err(RpcError::new(Code::InvalidArgument, "no signal")),
    }
}

async fn send_signal(ctx: &Ctx, req: SignalRequest) -> RpcResult<serde_json::Value> {
    let sig = parse_signal(req.signal.as_ref())?;
    let p = ctx.api.procs.find(&ctx.id, &selector(req.process)?)?;
    if p.exec.result().is_some() {
        return Err(RpcError::new(
            Code::NotFound,
            format!("process with pid {} not found (it has ended)", p.pid),
        ));
    }
    let init = ctx.api.init_pid(&ctx.id).map_err(RpcError::from)?;
    let marker = format!("{MARKER}={}", p.marker);
    let n = tokio::task::spawn_blocking(move || signal_marked(init, &marker, sig))
        .await
        .map_err(|e| RpcError::new(Code::Internal, format!("signal task: {e}")))?;
    if n == 0 && p.exec.result().is_none() {
        // Started, not yet visible (or just gone): one more look.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let marker = format!("{MARKER}={}", p.marker);
        tokio::task::spawn_blocking(move || signal_marked(init, &marker, sig))
            .await
            .map_err(|e| RpcError::new(Code::Internal, format!("signal task: {e}")))?;
    }
    Ok(json!({}))
}

/// Signal every process in `init`'s cgroup (the sandbox's) whose environment has `marker`;
/// how many were.
fn signal_marked(init: u32, marker: &str, sig: i32) -> usize {
    let Ok(cgroup) = std::fs::read(format!("/proc/{init}/cgroup")) else {
        return 0;
    };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut n = 0;
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid as u32 == init {
            continue;
        }
        if std::fs::read(format!("/proc/{pid}/cgroup")).ok().as_deref() != Some(&cgroup[..]) {
            continue;
        }
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|v| v == marker.as_bytes()) {
            if let (Some(p), Some(s)) = (
                rustix::process::Pid::from_raw(pid),
                rustix::process::Signal::from_named_raw(sig),
            ) {
                if rustix::process::kill_process(p, s).is_ok() {
                    n += 1;
                }
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_parse_by_name_or_number() {
        assert_eq!(parse_signal(Some(&json!("SIGNAL_SIGKILL"))).unwrap(), 9);
        assert_eq!(parse_signal(Some(&json!(15))).unwrap(), 15);
        assert!(parse_signal(Some(&json!("SIGNAL_UNSPECIFIED"))).is_err());
        assert!(parse_signal(None).is_err());
    }

    #[test]
    fn ends_read_as_envd_writes_them() {
        use sandbox_runtime::proto::{ExecResult, ExitReason};
        let mut r = ExecResult {
            exec: "e".into(),
            sandbox: "s".into(),
            reason: ExitReason::Exited,
            exit_code: Some(3),
            signal: None,
            stdout_bytes: 0,
            stderr_bytes: 0,
            truncated: false,
            duration_ms: 1,
            message: None,
        };
        let e = end_event(&r);
        assert_eq!(e["event"]["end"]["exitCode"], 3);
        assert_eq!(e["event"]["end"]["status"], "exit status 3");
        assert!(e["event"]["end"].get("error").is_none());
        r.exit_code = None;
        r.signal = Some(9);
        r.reason = ExitReason::Timeout;
        let e = end_event(&r);
        assert_eq!(e["event"]["end"]["status"], "signal: killed");
        assert_eq!(e["event"]["end"]["exited"], false);
        assert!(e["event"]["end"]["error"].is_string());
    }
}
