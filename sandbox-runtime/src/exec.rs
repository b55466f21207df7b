//! One command run in a sandbox: its captured output, its end, and the clients that follow
//! it.
//!
//! Output is read from the runtime's pipes as it comes and kept in memory up to the exec's
//! cap per stream; past the cap it is still read (the command never blocks on a full pipe)
//! but only counted. Every follower (the client that started it, clients that reattach)
//! reads from an offset of the captured bytes, so a reattached client gets what it missed.
//! A watch channel wakes followers when bytes arrive or the exec ends.
//!
//! While it runs, an exec can be driven ([`Exec::write_stdin`], [`Exec::close_stdin`],
//! [`Exec::signal`], [`Exec::resize`]) through its [`Control`], which the code that started it
//! (`crate::run`) installs: a channel to the task that owns its stdin, and how to signal it
//! (through the sandbox's init, or the host pid of a `runc exec`'s command).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use base64::Engine as _;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};
use ublk_daemon::node::proto::ResponseLine;

use crate::proto::{ExecEvent, ExecResult, ExecSummary, PtySize, Stream};
use crate::{Error, Result};

/// The default cap on captured output per stream.
pub const DEFAULT_MAX_OUTPUT: u64 = 16 << 20;

/// The largest cap a request may ask for.
pub const MAX_MAX_OUTPUT: u64 = 256 << 20;

/// Bytes per output event (before base64).
const EVENT_BYTES: usize = 64 << 10;

#[derive(Debug, Default)]
struct Captured {
    bytes: Vec<u8>,
    /// Everything the command wrote, captured or not.
    total: u64,
}

#[derive(Debug)]
struct ExecState {
    stdout: Captured,
    stderr: Captured,
    result: Option<ExecResult>,
}

/// A running or finished exec.
#[derive(Debug)]
pub struct Exec {
    pub id: String,
    pub sandbox: String,
    pub args: Vec<String>,
    pub started: Instant,
    pub max_output: u64,
    /// The caller's name for it.
    pub tag: Option<String>,
    /// Whether it runs under a pseudo-terminal (its output is all `stdout`).
    pub pty: bool,
    state: Mutex<ExecState>,
    /// Bumped on every change.
    changed: watch::Sender<u64>,
    control: Mutex<Control>,
}

/// How a running exec is driven; installed by whoever started it.
#[derive(Debug, Default)]
pub struct Control {
    /// Its pid inside the sandbox (the init's report), when known.
    pub pid: Option<i32>,
    /// Bytes for its stdin (`None`: close it), to the task that owns the write end.
    pub stdin: Option<mpsc::Sender<Option<Vec<u8>>>>,
    /// Where signals go.
    pub signal: Option<Signaller>,
    /// Its terminal's master, for resizes.
    pub pty_master: Option<Arc<OwnedFd>>,
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
        /// Where `data` starts in the stream's captured output.
        offset: u64,
        data: Vec<u8>,
    },
    End(ExecResult),
}

impl Exec {
    pub fn new(id: String, sandbox: String, args: Vec<String>, max_output: u64) -> Arc<Self> {
        Self::with_tag(id, sandbox, args, max_output, None, false)
    }

    pub fn with_tag(
        id: String,
        sandbox: String,
        args: Vec<String>,
        max_output: u64,
        tag: Option<String>,
        pty: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            sandbox,
            args,
            started: Instant::now(),
            max_output,
            tag,
            pty,
            control: Mutex::new(Control::default()),
            state: Mutex::new(ExecState {
                stdout: Captured::default(),
                stderr: Captured::default(),
                result: None,
            }),
            changed: watch::channel(0).0,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ExecState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Take in `data` written to `stream`.
    pub fn push(&self, stream: Stream, data: &[u8]) {
        {
            let mut s = self.lock();
            let c = match stream {
                Stream::Stdout => &mut s.stdout,
                Stream::Stderr => &mut s.stderr,
            };
            c.total += data.len() as u64;
            let room = self.max_output.saturating_sub(c.bytes.len() as u64) as usize;
            c.bytes.extend_from_slice(&data[..data.len().min(room)]);
        }
        self.bump();
    }

    /// Bytes written so far to each stream (captured or not), and whether any was dropped.
    pub fn totals(&self) -> (u64, u64, bool) {
        let s = self.lock();
        let dropped = s.stdout.total > s.stdout.bytes.len() as u64
            || s.stderr.total > s.stderr.bytes.len() as u64;
        (s.stdout.total, s.stderr.total, dropped)
    }

    /// Record the end (once).
    pub fn finish(&self, result: ExecResult) {
        {
            let mut s = self.lock();
            if s.result.is_none() {
                s.result = Some(result);
            }
        }
        self.bump();
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
            s.stdout.total > 0 || s.stderr.total > 0 || s.result.is_some()
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

    fn control(&self) -> std::sync::MutexGuard<'_, Control> {
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
        let master = self.control().pty_master.clone();
        let Some(master) = master else {
            return Err(Error::InvalidSpec(format!(
                "exec {} has no terminal",
                self.id
            )));
        };
        crate::pty::resize(&master, size)
            .map_err(|e| Error::io(format!("resize the terminal of exec {}", self.id), e))
    }

    /// Drop what drives it (its end): stdin's channel and the signaller.
    pub(crate) fn clear_control(&self) {
        let mut c = self.control();
        c.stdin = None;
        c.signal = None;
        c.pty_master = None;
    }

    /// Follow this exec from the given offsets: its output as it comes, in bounded pieces,
    /// then its end. Ends early when the receiver is dropped.
    pub fn updates(self: &Arc<Self>, mut from: [u64; 2]) -> mpsc::Receiver<ExecUpdate> {
        let (tx, rx) = mpsc::channel(16);
        let me = self.clone();
        tokio::spawn(async move {
            let mut changes = me.changed.subscribe();
            loop {
                changes.borrow_and_update();
                let (chunks, result) = {
                    let s = me.lock();
                    let mut chunks = Vec::new();
                    for (i, (stream, c)) in
                        [(Stream::Stdout, &s.stdout), (Stream::Stderr, &s.stderr)]
                            .into_iter()
                            .enumerate()
                    {
                        let start = (from[i] as usize).min(c.bytes.len());
                        for piece in c.bytes[start..].chunks(EVENT_BYTES) {
                            chunks.push((stream, from[i], piece.to_vec()));
                            from[i] += piece.len() as u64;
                        }
                    }
                    (chunks, s.result.clone())
                };
                for (stream, offset, data) in chunks {
                    let u = ExecUpdate::Output {
                        stream,
                        offset,
                        data,
                    };
                    if tx.send(u).await.is_err() {
                        return;
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

    #[test]
    fn output_past_the_cap_is_counted_not_kept() {
        let e = Exec::new("e".into(), "s".into(), vec![], 10);
        e.push(Stream::Stdout, b"0123456789abcdef");
        e.push(Stream::Stdout, b"more");
        e.push(Stream::Stderr, b"err");
        let (out, err, dropped) = e.totals();
        assert_eq!((out, err, dropped), (20, 3, true));
        assert_eq!(e.lock().stdout.bytes, b"0123456789");
    }

    #[tokio::test]
    async fn a_follower_from_an_offset_gets_the_rest_and_the_end() {
        let e = Exec::new("e".into(), "s".into(), vec![], 1 << 20);
        e.push(Stream::Stdout, b"hello world");
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
    }
}
