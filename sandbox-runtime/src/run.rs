//! Running one exec to its end: through the sandbox's init (`crate::agent`) or a `runc exec`
//! process; its output pumped into the exec's capped buffers, its timeout enforced, its end
//! classified (`ExitReason`).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::agent::{self, SpawnError};
use crate::cgroup;
use crate::exec::{self, Control, Exec, Signaller};
use crate::manager::Sandbox;
use crate::proto::{ExecResult, ExitReason, PtySize, SandboxState, Stream};
use crate::pty;

/// How an exec was started.
pub(crate) enum Started {
    /// By the sandbox's init: our ends of its pipes.
    Init {
        running: Arc<agent::Running>,
        init_pid: u32,
        io: InitIo,
    },
    /// By `runc exec`, which lives as long as the command.
    Runtime {
        child: tokio::process::Child,
        pid_file: PathBuf,
    },
    /// Not at all: why.
    Failed(String),
}

/// Our ends of an init-started command's stdio.
pub(crate) enum InitIo {
    Pipes {
        stdout: tokio::net::unix::pipe::Receiver,
        stderr: tokio::net::unix::pipe::Receiver,
        stdin: Option<tokio::net::unix::pipe::Sender>,
    },
    /// A terminal: the master carries output and input.
    Pty(Arc<OwnedFd>),
}

/// What `run` needs.
pub(crate) struct Job {
    pub sb: Arc<Sandbox>,
    pub exec: Arc<Exec>,
    pub started: Started,
    pub stdin: Option<Vec<u8>>,
    /// Keep stdin open for `Exec::write_stdin` after `stdin`'s bytes.
    pub stdin_open: bool,
    pub timeout: Option<Duration>,
    pub oom_before: u64,
    pub cgroups: BTreeMap<String, PathBuf>,
}

/// What `spawn_in_init` starts.
pub(crate) struct InitSpawn {
    pub init_pid: u32,
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// A pipe for stdin (else `/dev/null`), unless there is a terminal.
    pub with_stdin: bool,
    pub pty: Option<PtySize>,
}

/// Make the pipes (or the terminal) and ask the init to start the command (blocking: off
/// the async threads).
pub(crate) fn spawn_in_init(s: InitSpawn) -> Result<Started, SpawnError> {
    let io = |e: std::io::Error| SpawnError::Unreachable(e);
    let spawn = |stdio: [std::os::fd::BorrowedFd<'_>; 3], tty: bool| {
        agent::spawn(
            s.init_pid,
            &agent::Spawn {
                args: &s.args,
                env: &s.env,
                cwd: &s.cwd,
                uid: s.uid,
                gid: s.gid,
                tty,
            },
            stdio,
        )
    };
    if let Some(size) = s.pty {
        let (master, slave) = pty::open(size).map_err(io)?;
        let running = spawn([slave.as_fd(), slave.as_fd(), slave.as_fd()], true)?;
        // Only the command holds the slave now: its end (and its children's) hangs it up.
        drop(slave);
        return Ok(Started::Init {
            running: Arc::new(running),
            init_pid: s.init_pid,
            io: InitIo::Pty(Arc::new(master)),
        });
    }
    let (out_r, out_w) = agent::pipe().map_err(io)?;
    let (err_r, err_w) = agent::pipe().map_err(io)?;
    let (in_r, in_w) = if s.with_stdin {
        let (r, w) = agent::pipe().map_err(io)?;
        (r, Some(w))
    } else {
        let null = std::fs::File::open("/dev/null").map_err(io)?;
        (OwnedFd::from(null), None)
    };
    let running = spawn([in_r.as_fd(), out_w.as_fd(), err_w.as_fd()], false)?;
    // Only the command holds the write ends now: its end (and its children's) closes them.
    drop((in_r, out_w, err_w));
    let recv = |fd| tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(io);
    Ok(Started::Init {
        running: Arc::new(running),
        init_pid: s.init_pid,
        io: InitIo::Pipes {
            stdout: recv(out_r)?,
            stderr: recv(err_r)?,
            stdin: match in_w {
                Some(w) => Some(tokio::net::unix::pipe::Sender::from_owned_fd(w).map_err(io)?),
                None => None,
            },
        },
    })
}

/// Where an exec's input goes.
enum Sink {
    Pipe(tokio::net::unix::pipe::Sender),
    Child(tokio::process::ChildStdin),
    Pty(Arc<pty::Master>),
}

impl Sink {
    async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::Pipe(w) => w.write_all(data).await,
            Sink::Child(w) => w.write_all(data).await,
            Sink::Pty(m) => m.write_all(data).await,
        }
    }
}

/// Feed `first` and then, if `open`, what `Exec::write_stdin` sends, until closed. Installs
/// the channel in `control`.
fn feed_stdin(mut sink: Sink, first: Option<Vec<u8>>, open: bool, control: &mut Control) {
    let rx = if open {
        let (tx, rx) = tokio::sync::mpsc::channel::<Option<Vec<u8>>>(16);
        control.stdin = Some(tx);
        Some(rx)
    } else {
        None
    };
    tokio::spawn(async move {
        if let Some(b) = first {
            if sink.write(&b).await.is_err() {
                return;
            }
        }
        let Some(mut rx) = rx else {
            return;
        };
        while let Some(Some(b)) = rx.recv().await {
            if sink.write(&b).await.is_err() {
                return;
            }
        }
        // Closed: a pipe's reader sees EOF when the write end goes; a terminal's on ^D.
        if let Sink::Pty(m) = &sink {
            let _ = m.write_all(&[4]).await;
        }
    });
}

enum Ended {
    /// A wait status (the init's report: exact).
    Status(i32),
    /// The runtime's exit code (a death by signal N is 128 + N there).
    RuntimeCode(i32),
    /// No status: why.
    Lost(String),
}

/// Run `job` to its end and record the result.
pub(crate) async fn run(job: Job) {
    let Job {
        sb,
        exec,
        started,
        stdin,
        stdin_open,
        timeout,
        oom_before,
        cgroups,
    } = job;
    let mut timed_out = false;
    let mut pumps = Vec::new();
    let ended = match started {
        Started::Failed(message) => {
            finish(&sb, &exec, ExitReason::Failed, None, None, Some(message));
            return;
        }
        Started::Init {
            running,
            init_pid,
            io,
        } => {
            let mut control = Control {
                pid: Some(running.pid),
                signal: Some(Signaller::Init(running.clone())),
                ..Default::default()
            };
            match io {
                InitIo::Pipes {
                    stdout,
                    stderr,
                    stdin: w,
                } => {
                    if let Some(w) = w {
                        feed_stdin(Sink::Pipe(w), stdin, stdin_open, &mut control);
                    }
                    pumps.push(tokio::spawn(exec::pump(
                        exec.clone(),
                        Stream::Stdout,
                        stdout,
                    )));
                    pumps.push(tokio::spawn(exec::pump(
                        exec.clone(),
                        Stream::Stderr,
                        stderr,
                    )));
                }
                InitIo::Pty(fd) => match pty::Master::new(fd.clone()) {
                    Ok(m) => {
                        let m = Arc::new(m);
                        control.pty_master = Some(fd);
                        feed_stdin(Sink::Pty(m.clone()), stdin, true, &mut control);
                        let e = exec.clone();
                        pumps.push(tokio::spawn(async move { m.pump(e).await }));
                    }
                    Err(e) => tracing::warn!("exec {}: its terminal: {e}", exec.id),
                },
            }
            exec.set_control(control);
            let status = match timeout {
                Some(t) => match tokio::time::timeout(t, running.wait()).await {
                    Ok(s) => s,
                    Err(_) => {
                        timed_out = true;
                        let _ = running.kill(libc::SIGKILL);
                        if let Some(p) = agent::host_pid(init_pid, running.pid) {
                            kill_tree(p);
                        }
                        running.wait().await
                    }
                },
                None => running.wait().await,
            };
            match status {
                Ok(Some(s)) => Ended::Status(s),
                Ok(None) => Ended::Lost("the sandbox's init went away".into()),
                Err(e) => Ended::Lost(format!("waiting for the sandbox's init: {e}")),
            }
        }
        Started::Runtime {
            mut child,
            pid_file,
        } => {
            let mut control = Control {
                signal: Some(Signaller::HostPid(pid_file.clone())),
                ..Default::default()
            };
            if let Some(w) = child.stdin.take() {
                feed_stdin(Sink::Child(w), stdin, stdin_open, &mut control);
            }
            exec.set_control(control);
            if let Some(p) = child.stdout.take() {
                pumps.push(tokio::spawn(exec::pump(exec.clone(), Stream::Stdout, p)));
            }
            if let Some(p) = child.stderr.take() {
                pumps.push(tokio::spawn(exec::pump(exec.clone(), Stream::Stderr, p)));
            }
            let status = match timeout {
                Some(t) => match tokio::time::timeout(t, child.wait()).await {
                    Ok(s) => s,
                    Err(_) => {
                        timed_out = true;
                        if let Some(pid) = read_pid(&pid_file) {
                            kill_tree(pid);
                        }
                        child.wait().await
                    }
                },
                None => child.wait().await,
            };
            let _ = std::fs::remove_file(&pid_file);
            match status {
                Ok(s) => match s.code() {
                    Some(c) => Ended::RuntimeCode(c),
                    None => Ended::Lost(format!("the runtime died: {s}")),
                },
                Err(e) => Ended::Lost(format!("waiting for the runtime: {e}")),
            }
        }
    };
    // The pipes close when the command and everything it started that kept them are gone;
    // a daemonised child that keeps them open must not hold the result back for ever.
    for h in pumps {
        let _ = tokio::time::timeout(Duration::from_secs(2), h).await;
    }
    let oom = cgroup::oom_kills(&cgroups) > oom_before;
    let removed = sb.record().state != SandboxState::Running;
    let kill = libc::SIGKILL;
    let (reason, code, signal, message) = match ended {
        _ if timed_out => (ExitReason::Timeout, None, Some(kill), None),
        Ended::Status(s) if libc::WIFEXITED(s) => {
            (ExitReason::Exited, Some(libc::WEXITSTATUS(s)), None, None)
        }
        Ended::Status(s) => {
            let sig = libc::WTERMSIG(s);
            let reason = match sig {
                _ if sig == kill && oom => ExitReason::Oom,
                _ if removed => ExitReason::Killed,
                _ => ExitReason::Exited,
            };
            (reason, None, Some(sig), None)
        }
        Ended::RuntimeCode(137) if oom => (ExitReason::Oom, None, Some(kill), None),
        Ended::RuntimeCode(c) if removed && c > 128 => {
            (ExitReason::Killed, None, Some(c - 128), None)
        }
        // runc reports a command killed by signal N as 128 + N.
        Ended::RuntimeCode(c) if c > 128 && c <= 128 + 64 => {
            (ExitReason::Exited, Some(c), Some(c - 128), None)
        }
        Ended::RuntimeCode(c) => (ExitReason::Exited, Some(c), None, None),
        Ended::Lost(m) => (ExitReason::Killed, None, None, Some(m)),
    };
    finish(&sb, &exec, reason, code, signal, message);
}

fn finish(
    sb: &Sandbox,
    exec: &Exec,
    reason: ExitReason,
    exit_code: Option<i32>,
    signal: Option<i32>,
    message: Option<String>,
) {
    exec.clear_control();
    let (stdout_bytes, stderr_bytes, truncated) = exec.totals();
    exec.finish(ExecResult {
        exec: exec.id.clone(),
        sandbox: sb.id.clone(),
        reason,
        exit_code,
        signal,
        stdout_bytes,
        stderr_bytes,
        truncated,
        duration_ms: exec.started.elapsed().as_millis() as u64,
        message,
    });
    sb.running_execs.fetch_sub(1, Ordering::SeqCst);
    sb.touch();
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// SIGKILL `pid` and every process descended from it (a few rounds, for forks in flight).
fn kill_tree(pid: i32) {
    for _ in 0..3 {
        let mut parent_of: HashMap<i32, Vec<i32>> = HashMap::new();
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                    continue;
                };
                // pid (comm) state ppid …: comm may hold anything, so parse after the last ')'.
                let ppid = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .and_then(|s| s.parse::<i32>().ok());
                if let Some(pp) = ppid {
                    parent_of.entry(pp).or_default().push(p);
                }
            }
        }
        let mut todo = vec![pid];
        let mut all = Vec::new();
        while let Some(p) = todo.pop() {
            all.push(p);
            if let Some(kids) = parent_of.get(&p) {
                todo.extend(kids);
            }
        }
        for p in all {
            if let Some(p) = rustix::process::Pid::from_raw(p) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
    }
}
