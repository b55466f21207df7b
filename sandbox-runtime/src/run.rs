//! Running one exec to its end: through the sandbox's init (`crate::agent`), which keeps its
//! output in the exec's files, or a `runc exec` process, whose output the daemon pumps into
//! them; its timeout enforced, its end classified (`ExitReason`) and recorded.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
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
    /// By the sandbox's init (or found running there by a later daemon): the connection
    /// that drives it. The init keeps its output.
    Init {
        running: Arc<agent::Running>,
        init_pid: u32,
    },
    /// By `runc exec`, which lives as long as the command.
    Runtime {
        child: tokio::process::Child,
        pid_file: PathBuf,
    },
    /// Not at all: why.
    Failed(String),
    /// Started by an earlier daemon and no longer running: its status file says how it
    /// ended, if the init wrote one; else why it is lost.
    Ended(String),
}

/// What `run` needs.
pub(crate) struct Job {
    pub sb: Arc<Sandbox>,
    pub exec: Arc<Exec>,
    pub started: Started,
    pub stdin: Option<Vec<u8>>,
    /// Keep stdin open for `Exec::write_stdin` after `stdin`'s bytes.
    pub stdin_open: bool,
    /// When its timeout kills it.
    pub deadline: Option<tokio::time::Instant>,
    pub oom_before: u64,
    pub cgroups: BTreeMap<String, PathBuf>,
}

/// What `spawn_in_init` starts.
pub(crate) struct InitSpawn {
    pub dir: PathBuf,
    pub init_pid: u32,
    pub exec: Arc<Exec>,
    pub status: std::fs::File,
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// A pipe for stdin that later input goes to (else `/dev/null`), unless a terminal.
    pub with_stdin: bool,
    pub pty: Option<PtySize>,
}

/// Ask the init to start the command, its output kept in the exec's files (blocking: off
/// the async threads).
pub(crate) fn spawn_in_init(s: InitSpawn) -> Result<Started, SpawnError> {
    let io = |e: std::io::Error| SpawnError::Unresponsive(e.to_string());
    let spawn = agent::Spawn {
        args: &s.args,
        env: &s.env,
        cwd: &s.cwd,
        uid: s.uid,
        gid: s.gid,
        cap: s.exec.max_output,
        key: s.exec.meta().key,
        stdin_pipe: s.with_stdin && s.pty.is_none(),
    };
    let (out, err) = (s.exec.file(Stream::Stdout), s.exec.file(Stream::Stderr));
    let running = match s.pty {
        Some(size) => {
            let (master, slave) = pty::open(size).map_err(io)?;
            // The init keeps the master; only the command keeps the slave.
            let fds = agent::SpawnFds {
                stdin: slave.as_fd(),
                stdout: out.as_fd(),
                stderr: err.as_fd(),
                status: s.status.as_fd(),
                master: Some(master.as_fd()),
            };
            agent::spawn(&s.dir, s.init_pid, &spawn, &fds)?
        }
        None => {
            let null = std::fs::File::open("/dev/null").map_err(io)?;
            let fds = agent::SpawnFds {
                stdin: null.as_fd(),
                stdout: out.as_fd(),
                stderr: err.as_fd(),
                status: s.status.as_fd(),
                master: None,
            };
            agent::spawn(&s.dir, s.init_pid, &spawn, &fds)?
        }
    };
    // Known before the exec is handed back (the E2B API names processes by it).
    s.exec.control().pid = Some(running.pid);
    Ok(Started::Init {
        running: Arc::new(running),
        init_pid: s.init_pid,
    })
}

/// Where an exec's input goes.
enum Sink {
    /// Through the descriptor the init handed over (`tty`: a terminal's master).
    Init(Arc<agent::Running>, bool),
    Child(tokio::process::ChildStdin),
}

impl Sink {
    async fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::Init(r, _) => r.input(data).await,
            Sink::Child(w) => w.write_all(data).await,
        }
    }

    async fn close(self) {
        match self {
            Sink::Init(r, tty) => {
                let _ = r.close_stdin(tty).await;
            }
            // A pipe's reader sees EOF when the write end goes.
            Sink::Child(w) => drop(w),
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
        if let Some(mut rx) = rx {
            while let Some(Some(b)) = rx.recv().await {
                if sink.write(&b).await.is_err() {
                    return;
                }
            }
        }
        sink.close().await;
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
        deadline,
        oom_before,
        cgroups,
    } = job;
    // A later daemon's run of an exec its predecessor had already timed out.
    let mut timed_out = exec.dir.join("timed-out").exists();
    let mut pumps = Vec::new();
    let ended = match started {
        Started::Failed(message) => {
            finish(&sb, &exec, ExitReason::Failed, None, None, Some(message));
            return;
        }
        Started::Ended(why) => match final_status(&exec) {
            Some(s) => Ended::Status(s),
            None => Ended::Lost(why),
        },
        Started::Init { running, init_pid } => {
            let mut control = Control {
                pid: Some(running.pid),
                signal: Some(Signaller::Init(running.clone())),
                ..Default::default()
            };
            if stdin.is_some() || stdin_open || exec.pty {
                feed_stdin(
                    Sink::Init(running.clone(), exec.pty),
                    stdin,
                    stdin_open || exec.pty,
                    &mut control,
                );
            }
            exec.set_control(control);
            exec.refresh();
            // After a timeout kill, how long the init has to report the end: one that does
            // not (stopped, hung) leaves no exec waiting for ever.
            let mut grace: Option<tokio::time::Instant> = None;
            loop {
                let armed = if timed_out { grace } else { deadline };
                let timer = async move {
                    match armed {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                };
                let event = tokio::select! {
                    e = running.next() => e,
                    () = timer => {
                        if timed_out {
                            break Ended::Lost(format!(
                                "killed for its timeout; the sandbox's init did not report its \
                                 end within {} s",
                                agent::ANSWER_WITHIN.as_secs()
                            ));
                        }
                        timed_out = true;
                        grace = Some(tokio::time::Instant::now() + agent::ANSWER_WITHIN);
                        let _ = std::fs::write(exec.dir.join("timed-out"), b"");
                        let _ = running.kill(libc::SIGKILL);
                        if let Some(p) = agent::host_pid(init_pid, running.pid) {
                            kill_tree(p);
                        }
                        continue;
                    }
                };
                match event {
                    Ok(agent::Event::Output) => {
                        exec.refresh();
                        let _ = running.ready().await;
                    }
                    Ok(agent::Event::Ended(s)) => {
                        final_status(&exec);
                        break Ended::Status(s);
                    }
                    Ok(agent::Event::Closed) | Err(_) => {
                        // The init wrote the status before it went, or it died with its
                        // sandbox, or another daemon (a takeover) attached to the command:
                        // the init gives a command's connection up only for that.
                        if let Some(s) = final_status(&exec) {
                            break Ended::Status(s);
                        }
                        if init_lives_on(&sb, init_pid).await {
                            tracing::debug!("exec {}: followed by another daemon now", exec.id);
                            exec.clear_control();
                            return;
                        }
                        break match final_status(&exec) {
                            Some(s) => Ended::Status(s),
                            None => Ended::Lost("the sandbox's init went away".into()),
                        };
                    }
                }
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
            let status = match deadline {
                Some(t) => match tokio::time::timeout_at(t, child.wait()).await {
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
        Ended::Lost(m) if timed_out => (ExitReason::Timeout, None, Some(kill), Some(m)),
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

/// Whether the sandbox's init still runs a second after it dropped a command's connection
/// (a dying init drops its connections before it is gone from `/proc`), and the sandbox is
/// not being removed.
async fn init_lives_on(sb: &Sandbox, init_pid: u32) -> bool {
    for _ in 0..10 {
        if sb.record().state == SandboxState::Removing || crate::manager::pid_gone(init_pid) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    true
}

/// Take in an init-kept exec's final files and status file: its wait status, if written.
fn final_status(exec: &Exec) -> Option<i32> {
    exec.refresh();
    let s = exec::Status::read(&exec.dir)?;
    exec.set_totals(s.stdout, s.stderr);
    Some(s.wait)
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
