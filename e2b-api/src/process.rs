//! `process.Process`: commands in a sandbox through the runtime's exec path (with its output
//! caps). `Start` and `Connect` are server streams of `ProcessEvent`s (`start` with the pid,
//! `data` with stdout/stderr bytes, `keepalive`, `end` with the exit); the rest are unary.
//!
//! A process is named by its pid inside the sandbox (the runtime's `Exec::pid`; a sandbox
//! whose init predates that report gets pids this API hands out, from [`SYNTHETIC_PIDS`]) and
//! an optional tag. Signals go to the command's process group (`Exec::signal`); stdin, the
//! PTY and its size are the runtime's (`Exec::write_stdin`, `close_stdin`, `resize`). A PTY
//! command's output arrives as `pty` data, the others' as `stdout`/`stderr`.

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

/// Where the pids this API hands out start (above any Linux pid: `pid_max` ≤ 2^22).
pub const SYNTHETIC_PIDS: u32 = 1 << 30;

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
    pub pty: bool,
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
            next: AtomicU32::new(SYNTHETIC_PIDS),
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
        // A `List` between the exec's start and here may have adopted it already.
        v.retain(|o| !Arc::ptr_eq(&o.exec, &p.exec));
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

    /// Take in the execs of the sandbox that other clients started (`strata sandbox exec`,
    /// the socket) or an earlier daemon did (the node keeps them across restarts, with their
    /// pids): they are listed, signalled and connected to like the API's own, and an ended
    /// one answers `Connect` with its end.
    fn adopt(&self, sandbox: &str, execs: Vec<Arc<sandbox_runtime::Exec>>) {
        let mut m = self.lock();
        let known = m.entry(sandbox.to_owned()).or_default();
        for e in execs {
            if known.iter().any(|p| Arc::ptr_eq(&p.exec, &e)) {
                continue;
            }
            let Some(pid) = e.pid().and_then(|p| u32::try_from(p).ok()) else {
                continue;
            };
            let mut args = e.args.clone();
            let cmd = if args.is_empty() {
                String::new()
            } else {
                args.remove(0)
            };
            known.push(Arc::new(Proc {
                pid,
                tag: e.tag.clone(),
                config: ProcessConfig {
                    cmd,
                    args,
                    envs: e
                        .env
                        .iter()
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                    cwd: e.cwd.clone(),
                },
                pty: e.pty,
                exec: e,
            }));
        }
    }
}

/// The sandbox's process `sel` names (its running execs taken in first).
fn find(ctx: &Ctx, sel: &Selector) -> RpcResult<Arc<Proc>> {
    sync(ctx);
    ctx.api.procs.find(&ctx.id, sel)
}

fn sync(ctx: &Ctx) {
    if let Ok(execs) = ctx.api.manager.execs(&ctx.id) {
        ctx.api.procs.adopt(&ctx.id, execs);
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
            Ok(r) => unary(send_signal(&ctx, r)),
            Err(e) => connect::unary_error(&e),
        },
        "SendInput" => match request_message::<InputRequest>(parts, body).await {
            Ok(r) => unary(send_input(&ctx, r).await),
            Err(e) => connect::unary_error(&e),
        },
        "CloseStdin" => match request_message::<WithSelector>(parts, body).await {
            Ok(r) => unary(close_stdin(&ctx, r).await),
            Err(e) => connect::unary_error(&e),
        },
        "Update" => match request_message::<UpdateRequest>(parts, body).await {
            Ok(r) => unary(update(&ctx, r)),
            Err(e) => connect::unary_error(&e),
        },
        "StreamInput" => {
            let r = stream_input(&ctx, connect::MessageReader::new(body)).await;
            let (tx, resp) = connect::stream_response();
            tokio::spawn(async move {
                match r {
                    Ok(()) => {
                        tx.send(&json!({})).await;
                        tx.end(None).await;
                    }
                    Err(e) => tx.end(Some(e)).await,
                }
            });
            resp
        }
        other => connect::unary_error(&RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{other}: no such procedure"),
        )),
    }
}

/// `ProcessInput`: `{"stdin": b64}` or `{"pty": b64}`.
#[derive(Debug, Default, Deserialize)]
struct Input {
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    pty: Option<String>,
}

impl Input {
    fn bytes(&self) -> RpcResult<Vec<u8>> {
        use base64::Engine as _;
        let b64 = self.stdin.as_deref().or(self.pty.as_deref()).unwrap_or("");
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(b64))
            .map_err(|e| RpcError::new(Code::InvalidArgument, format!("input is not base64: {e}")))
    }
}

#[derive(Debug, Default, Deserialize)]
struct InputRequest {
    #[serde(default)]
    process: Option<Selector>,
    #[serde(default)]
    input: Option<Input>,
}

#[derive(Debug, Default, Deserialize)]
struct UpdateRequest {
    #[serde(default)]
    process: Option<Selector>,
    #[serde(default)]
    pty: Option<Pty>,
}

/// A `StreamInputRequest`: `start` (the selector), `data` (input) or `keepalive`.
#[derive(Debug, Default, Deserialize)]
struct StreamInputEvent {
    #[serde(default)]
    start: Option<WithSelector>,
    #[serde(default)]
    data: Option<InputData>,
}

#[derive(Debug, Default, Deserialize)]
struct InputData {
    #[serde(default)]
    input: Option<Input>,
}

fn runtime(e: sandbox_runtime::Error) -> RpcError {
    match e {
        sandbox_runtime::Error::Conflict(m) => RpcError::new(Code::FailedPrecondition, m),
        e => RpcError::from(Error::from(e)),
    }
}

async fn send_input(ctx: &Ctx, req: InputRequest) -> RpcResult<serde_json::Value> {
    let p = find(ctx, &selector(req.process)?)?;
    let data = req.input.unwrap_or_default().bytes()?;
    p.exec.write_stdin(data).await.map_err(runtime)?;
    Ok(json!({}))
}

async fn close_stdin(ctx: &Ctx, req: WithSelector) -> RpcResult<serde_json::Value> {
    let p = find(ctx, &selector(req.process)?)?;
    if p.pty {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            "a PTY has no stdin to close (send Ctrl-D, 0x04)",
        ));
    }
    p.exec.close_stdin().await.map_err(runtime)?;
    Ok(json!({}))
}

fn update(ctx: &Ctx, req: UpdateRequest) -> RpcResult<serde_json::Value> {
    let p = find(ctx, &selector(req.process)?)?;
    if let Some(size) = req.pty.and_then(|p| p.size) {
        p.exec.resize(pty_size(&size)?).map_err(runtime)?;
    }
    Ok(json!({}))
}

/// A client stream of input: a `start` naming the process, then `data` in order.
async fn stream_input(ctx: &Ctx, mut reader: connect::MessageReader) -> RpcResult<()> {
    let mut target: Option<Arc<Proc>> = None;
    while let Some(ev) = reader.next_json::<StreamInputEvent>().await? {
        if let Some(start) = ev.start {
            target = Some(find(ctx, &selector(start.process)?)?);
        } else if let Some(data) = ev.data {
            let p = target.as_ref().ok_or_else(|| {
                RpcError::new(Code::InvalidArgument, "input before the start event")
            })?;
            let bytes = data.input.unwrap_or_default().bytes()?;
            p.exec.write_stdin(bytes).await.map_err(runtime)?;
        }
    }
    Ok(())
}

fn pty_size(s: &PtySize) -> RpcResult<sandbox_runtime::proto::PtySize> {
    let cols = u16::try_from(s.cols).ok().filter(|c| *c > 0);
    let rows = u16::try_from(s.rows).ok().filter(|r| *r > 0);
    match (cols, rows) {
        (Some(cols), Some(rows)) => Ok(sandbox_runtime::proto::PtySize { cols, rows }),
        _ => Err(RpcError::new(
            Code::InvalidArgument,
            format!("bad PTY size {}x{}", s.cols, s.rows),
        )),
    }
}

fn unary(r: RpcResult<serde_json::Value>) -> Response {
    match r {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => connect::unary_error(&e),
    }
}

fn list(ctx: &Ctx) -> RpcResult<serde_json::Value> {
    sync(ctx);
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
    let pty = match &req.pty {
        Some(p) => Some(pty_size(
            &p.size.clone().unwrap_or(PtySize { cols: 80, rows: 24 }),
        )?),
        None => None,
    };
    let root = ctx.root().map_err(RpcError::from)?;
    let (user, _) = ctx.user(&root).map_err(RpcError::from)?;
    let cwd = match config.cwd.as_deref() {
        Some(c) if !c.is_empty() => crate::fs::absolute(c, &user.home).map_err(RpcError::from)?,
        _ => user.home.clone(),
    };
    let mut env: Vec<String> = vec![
        format!("HOME={}", user.home),
        format!("USER={}", user.name),
        format!("LOGNAME={}", user.name),
    ];
    if pty.is_some() {
        env.push("TERM=xterm-256color".into());
    }
    // The create's envVars (a pooled sandbox was made without them), then the command's own.
    if let Some(m) = ctx.api.meta(&ctx.id) {
        env.extend(m.env_vars.iter().map(|(k, v)| format!("{k}={v}")));
    }
    for (k, v) in &config.envs {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("bad environment variable {k:?}"),
            ));
        }
        env.push(format!("{k}={v}"));
    }
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
            // The protocol's default: stdin open (the SDK asks for it closed unless told).
            stdin_open: pty.is_some() || req.stdin.unwrap_or(true),
            pty,
            tag: req.tag.clone(),
            ..Default::default()
        })
        .await
        .map_err(|e| RpcError::from(Error::from(e)))?;
    let pid = match exec.pid().and_then(|p| u32::try_from(p).ok()) {
        Some(p) => p,
        None => ctx.api.procs.next.fetch_add(1, Ordering::Relaxed),
    };
    let p = Arc::new(Proc {
        pid,
        tag: req.tag,
        config,
        exec,
        pty: pty.is_some(),
    });
    ctx.api.procs.add(&ctx.id, p.clone());
    Ok(p)
}

async fn reconnect(ctx: Ctx, req: WithSelector) -> Response {
    let p = match selector(req.process).and_then(|s| find(&ctx, &s)) {
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
    use base64::Engine as _;
    use sandbox_runtime::ExecUpdate;
    let mut updates = p.exec.updates(from);
    let period = Duration::from_secs(keepalive_s.unwrap_or(50).clamp(1, 3600));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    loop {
        let update = tokio::select! {
            u = updates.recv() => u,
            _ = ticker.tick() => {
                if !tx.send(&json!({ "event": { "keepalive": {} } })).await {
                    return Ok(());
                }
                continue;
            }
            () = tx.closed() => return Ok(()),
        };
        match update {
            None => {
                return Err(RpcError::new(
                    Code::Internal,
                    "the exec's stream ended without its result",
                ))
            }
            Some(ExecUpdate::Output { stream, data, .. }) => {
                let field = match (p.pty, stream) {
                    (true, _) => "pty",
                    (false, sandbox_runtime::proto::Stream::Stdout) => "stdout",
                    (false, sandbox_runtime::proto::Stream::Stderr) => "stderr",
                };
                let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
                if !tx
                    .send(&json!({ "event": { "data": { field: b64 } } }))
                    .await
                {
                    return Ok(());
                }
            }
            Some(ExecUpdate::End(result)) => {
                tx.send(&end_event(&result)).await;
                return Ok(());
            }
        }
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

fn send_signal(ctx: &Ctx, req: SignalRequest) -> RpcResult<serde_json::Value> {
    let sig = parse_signal(req.signal.as_ref())?;
    let p = find(ctx, &selector(req.process)?)?;
    if p.exec.result().is_some() {
        return Err(RpcError::new(
            Code::NotFound,
            format!("process with pid {} not found (it has ended)", p.pid),
        ));
    }
    match p.exec.signal(sig) {
        Ok(()) => Ok(json!({})),
        // Ended between the check and the signal.
        Err(sandbox_runtime::Error::Conflict(m)) if p.exec.result().is_some() => {
            Err(RpcError::new(Code::NotFound, m))
        }
        Err(e) => Err(runtime(e)),
    }
}

/// Every request message of this service, parsed from `data` (the fuzz target's entry).
pub(crate) fn fuzz(data: &[u8]) {
    let _ = serde_json::from_slice::<StartRequest>(data).map(|r| {
        if let Some(p) = r.pty.and_then(|p| p.size) {
            let _ = pty_size(&p);
        }
    });
    let _ = serde_json::from_slice::<WithSelector>(data);
    let _ = serde_json::from_slice::<SignalRequest>(data).map(|r| parse_signal(r.signal.as_ref()));
    let _ =
        serde_json::from_slice::<InputRequest>(data).map(|r| r.input.unwrap_or_default().bytes());
    let _ = serde_json::from_slice::<UpdateRequest>(data);
    let _ = serde_json::from_slice::<StreamInputEvent>(data)
        .map(|e| e.data.and_then(|d| d.input).map(|i| i.bytes()));
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
