//! One command run in a sandbox: its kept output, its end, and the clients that follow it.
//!
//! Output lives in files beside the sandbox on the host, one directory per exec
//! (`<sandbox dir>/execs/<exec id>/`), nothing of it visible inside the sandbox:
//!
//! | file | what |
//! | --- | --- |
//! | `exec.json` | [`ExecMeta`]: the command, its key (the init's name for it), its deadline, what its end is classified against (written once, at the start) |
//! | `stdout`, `stderr` | what it wrote, up to its cap per stream; past the cap output is read, counted and dropped |
//! | `status` | `<wait status> <stdout total> <stderr total> <pid>`, written by the sandbox's init once the command has ended and its pipes are drained ([`Status`]) |
//! | `timed-out` | present once the daemon killed it for its timeout |
//! | `result.json` | the [`ExecResult`], once the daemon has classified its end |
//!
//! For a command started through the sandbox's init (`crate::agent`), the init holds its
//! pipes and writes the two output files (the daemon hands it their descriptors): a daemon
//! that dies, restarts or hands over loses nothing, the command never sees `EPIPE`, and its
//! status lands in `status` even if it ends while no daemon runs. The next daemon finds the
//! directory ([`Exec::load`]) and attaches again by the key (`crate::reattach`). A `runc
//! exec` (a sandbox older than the init's socket) is pumped into the same files by the
//! daemon ([`Exec::push`]).
//!
//! Every follower (the client that started it, clients that reattach, on any daemon) reads
//! from byte offsets of the kept output, so a reattached client gets what it missed. A watch
//! channel wakes followers when the files grow ([`Exec::refresh`]) or the exec ends.
//!
//! Bounds, all on the node's disk, never in the daemon's memory: per exec its two caps
//! (`max_output`, at most [`MAX_MAX_OUTPUT`]); per sandbox the last 64 execs (older ended
//! ones go with their files); per node, what ended execs keep (`crate::retention`).
//!
//! While it runs, an exec can be driven ([`Exec::write_stdin`], [`Exec::close_stdin`],
//! [`Exec::signal`], [`Exec::resize`]) through its [`Control`], which the code that started
//! it (`crate::run`) installs.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};
use ublk_daemon::node::proto::ResponseLine;

use crate::proto::{ExecEvent, ExecResult, ExecSummary, PtySize, Stream};
use crate::{Error, Result};

/// The default cap on kept output per stream.
pub const DEFAULT_MAX_OUTPUT: u64 = 16 << 20;

/// The largest cap a request may ask for.
pub const MAX_MAX_OUTPUT: u64 = 256 << 20;

/// Bytes per output event (before base64).
const EVENT_BYTES: usize = 64 << 10;

/// The directory of a sandbox's execs, in its directory.
pub const EXECS_DIR: &str = "execs";

/// What is known of an exec when it starts: `exec.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecMeta {
    pub id: String,
    /// The init's name for it (a random number), for an attach after a restart.
    pub key: u64,
    pub args: Vec<String>,
    /// The environment the request added (not the sandbox's, not its secrets).
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub pty: bool,
    pub max_output: u64,
    /// Wall-clock start, ms since the epoch.
    pub started_ms: u64,
    /// When its timeout kills it, ms since the epoch.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// The sandbox's OOM-kill count before it started (an end by SIGKILL after a new one is
    /// an OOM).
    #[serde(default)]
    pub oom_before: u64,
    /// Whether its stdin takes later input.
    #[serde(default)]
    pub stdin_open: bool,
}

#[derive(Debug, Default)]
struct ExecState {
    /// Bytes kept in each file.
    kept: [u64; 2],
    /// Everything written to each stream, kept or not, as known so far.
    total: [u64; 2],
    result: Option<ExecResult>,
}

/// A running or finished exec.
#[derive(Debug)]
pub struct Exec {
    pub id: String,
    pub sandbox: String,
    pub args: Vec<String>,
    /// The environment the request added.
    pub env: Vec<String>,
    pub cwd: Option<String>,
    pub started: Instant,
    pub max_output: u64,
    /// The caller's name for it.
    pub tag: Option<String>,
    /// Whether it runs under a pseudo-terminal (its output is all `stdout`).
    pub pty: bool,
    /// Its directory (module docs).
    pub dir: PathBuf,
    /// As written at its start (never changed after).
    meta: ExecMeta,
    files: [File; 2],
    state: Mutex<ExecState>,
    /// Bumped on every change.
    changed: watch::Sender<u64>,
    control: Mutex<Control>,
}

fn stream_index(s: Stream) -> usize {
    match s {
        Stream::Stdout => 0,
        Stream::Stderr => 1,
    }
}

/// Write `bytes` as `dir/name`, renamed into place (not synced: the files it describes are
/// not either, and a node that crashes loses its sandboxes anyway).
fn put(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(name))
}

/// What the init writes in an exec's `status` file once the command has ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    /// The wait status (exact: a death by signal is a signal).
    pub wait: i32,
    /// Bytes written to each stream, kept or not.
    pub stdout: u64,
    pub stderr: u64,
    /// Its pid inside the sandbox.
    pub pid: i32,
}

impl Status {
    /// `<wait status> <stdout total> <stderr total> <pid>`; anything else (empty: not
    /// written yet) is `None`.
    pub fn parse(bytes: &[u8]) -> Option<Status> {
        let s = std::str::from_utf8(bytes).ok()?;
        let mut it = s.split_whitespace();
        let st = Status {
            wait: it.next()?.parse().ok()?,
            stdout: it.next()?.parse().ok()?,
            stderr: it.next()?.parse().ok()?,
            pid: it.next()?.parse().ok()?,
        };
        it.next().is_none().then_some(st)
    }

    /// The status file of the exec in `dir`, once written.
    pub fn read(dir: &Path) -> Option<Status> {
        Status::parse(&std::fs::read(dir.join("status")).ok()?)
    }
}

impl ExecMeta {
    /// An `exec.json` (written by a daemon of this node; a bad one is an error, never a
    /// panic, and its exec is dropped at load).
    pub fn parse(bytes: &[u8]) -> std::io::Result<Self> {
        Ok(serde_json::from_slice(bytes)?)
    }
}

/// How a running exec is driven; installed by whoever started it.
#[derive(Debug, Default)]
pub struct Control {
    /// Its pid inside the sandbox (the init's report), when known.
    pub pid: Option<i32>,
    /// Bytes for its stdin (`None`: close it), to the task that owns the write end.
    pub stdin: Option<mpsc::Sender<Option<Vec<u8>>>>,
    /// Where signals (and, with a terminal, resizes) go.
    pub signal: Option<Signaller>,
}

/// Where an exec's signals go.
#[derive(Debug)]
pub enum Signaller {
    /// Through the sandbox's init, to the command's process group.
    Init(Arc<crate::agent::Running>),
    /// A host pid (a `runc exec`'s command), read when the signal is sent.
    HostPid(std::path::PathBuf),
}

/// What a follower of an exec receives: new output, then the end (last).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecUpdate {
    Output {
        stream: Stream,
        /// Where `data` starts in the stream's kept output.
        offset: u64,
        data: Vec<u8>,
    },
    End(ExecResult),
}

impl Exec {
    /// A new exec's directory `dir` (its files created empty, `exec.json` written): the
    /// exec, and its status file for the init. Blocking: off the async threads.
    pub fn create(
        dir: PathBuf,
        sandbox: String,
        meta: ExecMeta,
    ) -> std::io::Result<(Arc<Self>, File)> {
        std::fs::create_dir_all(&dir)?;
        let open = |name: &str| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join(name))
        };
        let files = [open("stdout")?, open("stderr")?];
        let status = open("status")?;
        put(&dir, "exec.json", &serde_json::to_vec(&meta)?)?;
        let e = Self::with(dir, sandbox, meta, files, ExecState::default());
        Ok((e, status))
    }

    /// The exec in directory `dir`, as a daemon that did not start it finds it (its result
    /// read back if it has one). Blocking.
    pub fn load(dir: PathBuf, sandbox: String) -> std::io::Result<Arc<Self>> {
        let meta = ExecMeta::parse(&std::fs::read(dir.join("exec.json"))?)?;
        let open = |name: &str| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.join(name))
        };
        let files = [open("stdout")?, open("stderr")?];
        let kept = [files[0].metadata()?.len(), files[1].metadata()?.len()];
        let result: Option<ExecResult> = std::fs::read(dir.join("result.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let total = match &result {
            Some(r) => [r.stdout_bytes, r.stderr_bytes],
            None => kept,
        };
        // A running one's pid comes with the attach; an ended one's is in its status file.
        let pid = Status::read(&dir).map(|s| s.pid);
        let e = Self::with(
            dir,
            sandbox,
            meta,
            files,
            ExecState {
                kept,
                total,
                result,
            },
        );
        e.control().pid = pid;
        Ok(e)
    }

    fn with(
        dir: PathBuf,
        sandbox: String,
        meta: ExecMeta,
        files: [File; 2],
        state: ExecState,
    ) -> Arc<Self> {
        let age = crate::manager::now_ms().saturating_sub(meta.started_ms);
        let started = Instant::now()
            .checked_sub(Duration::from_millis(age))
            .unwrap_or_else(Instant::now);
        Arc::new(Self {
            id: meta.id.clone(),
            sandbox,
            args: meta.args.clone(),
            env: meta.env.clone(),
            cwd: meta.cwd.clone(),
            started,
            max_output: meta.max_output,
            tag: meta.tag.clone(),
            pty: meta.pty,
            dir,
            meta,
            files,
            state: Mutex::new(state),
            control: Mutex::new(Control::default()),
            changed: watch::channel(0).0,
        })
    }

    /// The file `stream` is kept in, for the init to write.
    pub fn file(&self, stream: Stream) -> &File {
        &self.files[stream_index(stream)]
    }

    pub fn meta(&self) -> &ExecMeta {
        &self.meta
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ExecState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Take in `data` written to `stream` (output the daemon reads itself: a `runc exec`).
    pub fn push(&self, stream: Stream, data: &[u8]) {
        {
            let mut s = self.lock();
            let i = stream_index(stream);
            s.total[i] += data.len() as u64;
            let room = self.max_output.saturating_sub(s.kept[i]) as usize;
            let keep = &data[..data.len().min(room)];
            if !keep.is_empty() {
                match (&self.files[i]).write_all(keep) {
                    Ok(()) => s.kept[i] += keep.len() as u64,
                    Err(e) => tracing::warn!("exec {}: keep its output: {e}", self.id),
                }
            }
        }
        self.bump();
    }

    /// Take in what the files hold now (the init wrote more).
    pub fn refresh(&self) {
        let sizes = [0, 1].map(|i| self.files[i].metadata().map(|m| m.len()).unwrap_or(0));
        let grew = {
            let mut s = self.lock();
            let mut grew = false;
            for (i, size) in sizes.into_iter().enumerate() {
                if size > s.kept[i] {
                    s.kept[i] = size;
                    grew = true;
                }
                s.total[i] = s.total[i].max(s.kept[i]);
            }
            grew
        };
        if grew {
            self.bump();
        }
    }

    /// The totals the init counted (kept or not), from its status file.
    pub fn set_totals(&self, out: u64, err: u64) {
        let mut s = self.lock();
        s.total = [out.max(s.kept[0]), err.max(s.kept[1])];
    }

    /// Bytes written so far to each stream (kept or not), and whether any was dropped.
    pub fn totals(&self) -> (u64, u64, bool) {
        let s = self.lock();
        let dropped = s.total[0] > s.kept[0] || s.total[1] > s.kept[1];
        (s.total[0], s.total[1], dropped)
    }

    /// Bytes kept so far in each stream.
    pub fn kept(&self) -> [u64; 2] {
        self.lock().kept
    }

    /// Record the end (once), in memory and as `result.json`.
    pub fn finish(&self, result: ExecResult) {
        let first = {
            let mut s = self.lock();
            let first = s.result.is_none();
            if first {
                s.result = Some(result.clone());
            }
            first
        };
        if first {
            let written = serde_json::to_vec(&result)
                .map_err(std::io::Error::from)
                .and_then(|b| put(&self.dir, "result.json", &b));
            if let Err(e) = written {
                tracing::warn!("exec {}: write its result: {e}", self.id);
            }
        }
        self.bump();
    }

    /// Remove its directory (it has ended and is no longer remembered).
    pub fn remove_files(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Wait until the exec has ended; its result.
    pub async fn wait(&self) -> ExecResult {
        let mut changes = self.changed.subscribe();
        loop {
            if let Some(r) = self.result() {
                return r;
            }
            if changes.changed().await.is_err() {
                // The sender lives as long as `self`: not reached, but never spin.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Wait until the exec has written something or ended, at most `limit`.
    pub async fn first_activity(&self, limit: std::time::Duration) {
        let mut changes = self.changed.subscribe();
        let active = |me: &Self| {
            let s = me.lock();
            s.total[0] > 0 || s.total[1] > 0 || s.result.is_some()
        };
        let _ = tokio::time::timeout(limit, async {
            while !active(self) {
                if changes.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }

    pub fn result(&self) -> Option<ExecResult> {
        self.lock().result.clone()
    }

    pub fn summary(&self) -> ExecSummary {
        let result = self.result();
        ExecSummary {
            exec: self.id.clone(),
            args: self.args.clone(),
            running: result.is_none(),
            result,
        }
    }

    pub(crate) fn control(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Install how the exec is driven (by the code that started it).
    pub fn set_control(&self, c: Control) {
        *self.control() = c;
    }

    /// Its pid inside the sandbox, when its start reported one.
    pub fn pid(&self) -> Option<i32> {
        self.control().pid
    }

    fn not_running(&self, what: &str) -> Error {
        Error::Conflict(format!("exec {} {what}", self.id))
    }

    /// Write `data` to its stdin (started with `stdin_open` or a pty); waits while the
    /// command does not read.
    pub async fn write_stdin(&self, data: Vec<u8>) -> Result<()> {
        let tx = self.control().stdin.clone();
        match tx {
            Some(tx) if self.result().is_none() => tx
                .send(Some(data))
                .await
                .map_err(|_| self.not_running("has closed its stdin")),
            Some(_) => Err(self.not_running("has ended")),
            None => Err(self.not_running("has no open stdin")),
        }
    }

    /// Close its stdin (its reader sees the end of input). Closing twice is not an error.
    pub async fn close_stdin(&self) -> Result<()> {
        let tx = self.control().stdin.take();
        if let Some(tx) = tx {
            let _ = tx.send(None).await;
        }
        Ok(())
    }

    /// Send `signal` to the command's process group.
    pub fn signal(&self, signal: i32) -> Result<()> {
        if self.result().is_some() {
            return Err(self.not_running("has ended"));
        }
        if !(1..=64).contains(&signal) {
            return Err(Error::InvalidSpec(format!("no signal {signal}")));
        }
        let c = self.control();
        match &c.signal {
            Some(Signaller::Init(r)) => r
                .kill(signal)
                .map_err(|e| Error::io(format!("signal exec {}", self.id), e)),
            Some(Signaller::HostPid(file)) => {
                let pid = std::fs::read_to_string(file)
                    .ok()
                    .and_then(|s| s.trim().parse::<i32>().ok())
                    .and_then(rustix::process::Pid::from_raw)
                    .ok_or_else(|| self.not_running("has no pid yet"))?;
                // SAFETY: kill(2) touches no memory of ours; any pid and signal number is
                // a valid argument (the kernel checks them).
                let r = unsafe { libc::kill(-pid.as_raw_nonzero().get(), signal) };
                if r < 0 {
                    // Not a group leader (runc exec's command): the process itself.
                    // SAFETY: as above.
                    let r = unsafe { libc::kill(pid.as_raw_nonzero().get(), signal) };
                    if r < 0 {
                        return Err(Error::io(
                            format!("signal exec {}", self.id),
                            std::io::Error::last_os_error(),
                        ));
                    }
                }
                Ok(())
            }
            None => Err(self.not_running("cannot be signalled")),
        }
    }

    /// Resize its terminal.
    pub fn resize(&self, size: PtySize) -> Result<()> {
        let init = match &self.control().signal {
            Some(Signaller::Init(r)) if self.pty => r.clone(),
            _ => {
                return Err(Error::InvalidSpec(format!(
                    "exec {} has no terminal",
                    self.id
                )))
            }
        };
        init.resize(size.rows, size.cols)
            .map_err(|e| Error::io(format!("resize the terminal of exec {}", self.id), e))
    }

    /// Drop what drives it (its end): stdin's channel and the signaller.
    pub(crate) fn clear_control(&self) {
        let mut c = self.control();
        c.stdin = None;
        c.signal = None;
    }

    /// Follow this exec from the given offsets: its output as it comes, in bounded pieces,
    /// then its end. Ends early when the receiver is dropped.
    pub fn updates(self: &Arc<Self>, mut from: [u64; 2]) -> mpsc::Receiver<ExecUpdate> {
        let (tx, rx) = mpsc::channel(16);
        let me = self.clone();
        tokio::spawn(async move {
            let mut changes = me.changed.subscribe();
            let mut buf = vec![0u8; EVENT_BYTES];
            loop {
                changes.borrow_and_update();
                // Read together: once the result is there, the files hold everything.
                let (kept, result) = {
                    let s = me.lock();
                    (s.kept, s.result.clone())
                };
                for (i, stream) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
                    while from[i] < kept[i] {
                        let want = ((kept[i] - from[i]) as usize).min(EVENT_BYTES);
                        // A page-cache read of what was just written: local and short.
                        let n = match me.files[i].read_at(&mut buf[..want], from[i]) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let u = ExecUpdate::Output {
                            stream,
                            offset: from[i],
                            data: buf[..n].to_vec(),
                        };
                        from[i] += n as u64;
                        if tx.send(u).await.is_err() {
                            return;
                        }
                    }
                }
                if let Some(r) = result {
                    let _ = tx.send(ExecUpdate::End(r)).await;
                    return;
                }
                tokio::select! {
                    c = changes.changed() => if c.is_err() { return },
                    () = tx.closed() => return,
                }
            }
        });
        rx
    }

    /// Stream this exec to a client from the given offsets: a `started` event, output
    /// events, and the result as the final line. Ends early when the client goes away.
    pub fn follow(self: &Arc<Self>, from: [u64; 2]) -> mpsc::Receiver<ResponseLine> {
        let (tx, rx) = mpsc::channel(16);
        let me = self.clone();
        tokio::spawn(async move {
            let started = ExecEvent::Started {
                exec: me.id.clone(),
                sandbox: me.sandbox.clone(),
            };
            if tx
                .send(ResponseLine::event(
                    serde_json::to_value(started).unwrap_or_default(),
                ))
                .await
                .is_err()
            {
                return;
            }
            let mut updates = me.updates(from);
            loop {
                let line = tokio::select! {
                    u = updates.recv() => match u {
                        Some(ExecUpdate::Output { stream, offset, data }) => {
                            let ev = ExecEvent::Output {
                                stream,
                                offset,
                                data: base64::engine::general_purpose::STANDARD.encode(&data),
                            };
                            ResponseLine::event(serde_json::to_value(ev).unwrap_or_default())
                        }
                        Some(ExecUpdate::End(r)) => {
                            ResponseLine::success(serde_json::to_value(r).unwrap_or_default())
                        }
                        None => return,
                    },
                    () = tx.closed() => return,
                };
                let last = line.event.is_none();
                if tx.send(line).await.is_err() || last {
                    return;
                }
            }
        });
        rx
    }
}

/// Read `pipe` into `exec`'s `stream` until it closes.
pub async fn pump(exec: Arc<Exec>, stream: Stream, mut pipe: impl tokio::io::AsyncRead + Unpin) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => exec.push(stream, &buf[..n]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::ExitReason;

    fn exec_in(dir: &Path, cap: u64) -> Arc<Exec> {
        let meta = ExecMeta {
            id: "e".into(),
            key: 7,
            args: vec!["true".into()],
            max_output: cap,
            started_ms: crate::manager::now_ms(),
            ..ExecMeta::default()
        };
        Exec::create(dir.join("e"), "s".into(), meta).unwrap().0
    }

    #[test]
    fn output_past_the_cap_is_counted_not_kept() {
        let d = tempfile::tempdir().unwrap();
        let e = exec_in(d.path(), 10);
        e.push(Stream::Stdout, b"0123456789abcdef");
        e.push(Stream::Stdout, b"more");
        e.push(Stream::Stderr, b"err");
        let (out, err, dropped) = e.totals();
        assert_eq!((out, err, dropped), (20, 3, true));
        assert_eq!(std::fs::read(e.dir.join("stdout")).unwrap(), b"0123456789");
    }

    #[tokio::test]
    async fn a_follower_from_an_offset_gets_the_rest_and_the_end_and_so_does_a_later_daemon() {
        let d = tempfile::tempdir().unwrap();
        let e = exec_in(d.path(), 1 << 20);
        // As the init writes it: into the file, then a refresh.
        std::fs::OpenOptions::new()
            .append(true)
            .open(e.dir.join("stdout"))
            .unwrap()
            .write_all(b"hello world")
            .unwrap();
        e.refresh();
        let mut rx = e.follow([6, 0]);
        let first = rx.recv().await.unwrap();
        assert!(first.event.unwrap()["type"] == "started");
        let out = rx.recv().await.unwrap().event.unwrap();
        assert_eq!(out["offset"], 6);
        let data = base64::engine::general_purpose::STANDARD
            .decode(out["data"].as_str().unwrap())
            .unwrap();
        assert_eq!(data, b"world");
        e.finish(ExecResult {
            exec: "e".into(),
            sandbox: "s".into(),
            reason: ExitReason::Exited,
            exit_code: Some(0),
            signal: None,
            stdout_bytes: 11,
            stderr_bytes: 0,
            truncated: false,
            duration_ms: 1,
            message: None,
        });
        let end = rx.recv().await.unwrap();
        assert!(end.event.is_none() && end.ok);
        assert_eq!(end.result.unwrap()["exit_code"], 0);
        // A daemon that did not start it finds the same output and end in its directory.
        let again = Exec::load(e.dir.clone(), "s".into()).unwrap();
        assert_eq!(again.kept(), [11, 0]);
        assert_eq!(again.result().unwrap().exit_code, Some(0));
        assert_eq!(again.meta().key, 7);
    }
}
