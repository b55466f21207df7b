//! The OCI runtime, driven through its command line (`runc` 1.1 here; any runtime with
//! runc's CLI — `run -d`, `exec`, `state`, `kill`, `pause`, `resume`, `delete` — fits).
//!
//! Every call runs the runtime as a child process: never inside the daemon's threads, and
//! nothing of a container is the daemon's child, so a daemon that dies leaves its sandboxes
//! running. A sandbox's init runs detached with `/dev/null` for stdio (a file or pipe of the
//! daemon's in a container would be reachable as `/proc/1/fd/*`); the runtime's own messages
//! go to its `--log` file, whose last error is what a failure reports.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::Deserialize;
use tokio::process::Command;

use crate::{Error, Result};

/// A runtime binary and its state directory.
#[derive(Clone, Debug)]
pub struct Runtime {
    pub binary: PathBuf,
    /// `--root`: where the runtime keeps its containers' state.
    pub root: PathBuf,
}

/// What `runc state` says about a container.
#[derive(Clone, Debug, Deserialize)]
pub struct State {
    pub id: String,
    /// `created`, `running`, `paused`, `stopped`.
    pub status: String,
    #[serde(default)]
    pub pid: u32,
}

impl Runtime {
    fn command(&self, log: Option<&Path>) -> Command {
        let mut c = Command::new(&self.binary);
        c.arg("--root").arg(&self.root);
        if let Some(l) = log {
            c.arg("--log").arg(l).arg("--log-format").arg("json");
        }
        c.stdin(Stdio::null()).kill_on_drop(false);
        c
    }

    /// Run `cmd`, returning stdout; a failure carries stderr (or the log's last error).
    async fn output(&self, mut cmd: Command, what: &str, log: Option<&Path>) -> Result<Vec<u8>> {
        let out = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .await
            .map_err(|e| {
                Error::Runtime(format!(
                    "run {} ({what}): {e}; is it installed?",
                    self.binary.display()
                ))
            })?;
        if out.status.success() {
            return Ok(out.stdout);
        }
        let mut said = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if let Some(l) = log.and_then(last_error) {
            said = l;
        }
        Err(Error::Runtime(format!(
            "{} {what} failed ({}): {said}",
            self.binary.display(),
            out.status
        )))
    }

    /// `run -d`: create and start the container of `bundle`; its init's host pid. `ctl`,
    /// the init's control socket (`crate::agent::bind_ctl`), is its descriptor 3
    /// (`--preserve-fds 1`).
    pub async fn run_detached(
        &self,
        id: &str,
        bundle: &Path,
        log: &Path,
        ctl: &std::os::fd::OwnedFd,
    ) -> Result<u32> {
        let pid_file = bundle.join("init.pid");
        let mut c = self.command(Some(log));
        c.arg("run")
            .arg("--detach")
            .arg("--no-new-keyring")
            .arg("--preserve-fds")
            .arg("1")
            .arg("--bundle")
            .arg(bundle)
            .arg("--pid-file")
            .arg(&pid_file)
            .arg(id);
        let raw = std::os::fd::AsRawFd::as_raw_fd(ctl);
        // SAFETY: between fork and exec the closure calls only dup2(2) and fcntl(2), which
        // are async-signal-safe, on a descriptor that `ctl` keeps open for the whole call.
        // dup2 leaves the new descriptor 3 without close-on-exec; when the socket already is
        // descriptor 3, dup2 does nothing, so its close-on-exec flag is cleared instead.
        // Either way runc (and through `--preserve-fds`, the init) gets it as 3.
        unsafe {
            c.pre_exec(move || {
                let r = if raw == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    libc::dup2(raw, 3)
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // Detached: the init inherits these, so they must be nothing of the daemon's.
        let out = c
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .map_err(|e| {
                Error::Runtime(format!(
                    "run {}: {e}; is it installed?",
                    self.binary.display()
                ))
            })?;
        if !out.success() {
            let said = last_error(log).unwrap_or_else(|| "no message".into());
            return Err(Error::Runtime(format!(
                "{} run {id} failed ({out}): {said}",
                self.binary.display()
            )));
        }
        let pid = std::fs::read_to_string(&pid_file)
            .map_err(|e| Error::io(format!("read {}", pid_file.display()), e))?;
        pid.trim()
            .parse()
            .map_err(|_| Error::Runtime(format!("{}: not a pid: {pid:?}", pid_file.display())))
    }

    /// The container's state; `None` if the runtime does not know it.
    pub async fn state(&self, id: &str) -> Result<Option<State>> {
        let mut c = self.command(None);
        c.arg("state").arg(id);
        match self.output(c, "state", None).await {
            Ok(out) => serde_json::from_slice(&out)
                .map(Some)
                .map_err(|e| Error::Runtime(format!("runc state {id}: {e}"))),
            Err(Error::Runtime(m)) if m.contains("does not exist") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Send `signal` to every process of the container.
    pub async fn kill_all(&self, id: &str, signal: &str) -> Result<()> {
        let mut c = self.command(None);
        c.arg("kill").arg("--all").arg(id).arg(signal);
        match self.output(c, "kill", None).await {
            Ok(_) => Ok(()),
            Err(Error::Runtime(m)) if m.contains("not running") || m.contains("does not exist") => {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Freeze every process of the container (the runtime's freezer cgroup).
    pub async fn pause(&self, id: &str) -> Result<()> {
        let mut c = self.command(None);
        c.arg("pause").arg(id);
        self.output(c, "pause", None).await.map(|_| ())
    }

    /// Thaw what `pause` froze.
    pub async fn resume(&self, id: &str) -> Result<()> {
        let mut c = self.command(None);
        c.arg("resume").arg(id);
        self.output(c, "resume", None).await.map(|_| ())
    }

    /// Forget the container (killing what is left of it).
    pub async fn delete(&self, id: &str) -> Result<()> {
        let mut c = self.command(None);
        c.arg("delete").arg("--force").arg(id);
        match self.output(c, "delete", None).await {
            Ok(_) => Ok(()),
            Err(Error::Runtime(m)) if m.contains("does not exist") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The `exec` command for `args` in container `id` (the caller sets up stdio and spawns).
    pub fn exec_command(&self, id: &str, opts: &ExecOptions<'_>) -> Command {
        let mut c = self.command(None);
        c.arg("exec").arg("--pid-file").arg(opts.pid_file);
        if let Some(cwd) = opts.cwd {
            c.arg("--cwd").arg(cwd);
        }
        for e in opts.env {
            c.arg("--env").arg(e);
        }
        if let Some((uid, gid)) = opts.user {
            c.arg("--user").arg(format!("{uid}:{gid}"));
        }
        // runc stops reading its own flags at the id: what follows is the command, as is.
        c.arg(id).args(opts.args);
        c
    }
}

/// How to run one exec.
#[derive(Debug)]
pub struct ExecOptions<'a> {
    pub args: &'a [String],
    pub env: &'a [String],
    pub cwd: Option<&'a str>,
    pub user: Option<(u32, u32)>,
    /// Where the runtime writes the command's host pid.
    pub pid_file: &'a Path,
}

/// The last `"level":"error"` message of a runtime's JSON log.
pub fn last_error(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().rev().find_map(|l| {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        (v.get("level")?.as_str()? == "error").then(|| v.get("msg")?.as_str().map(str::to_owned))?
    })
}

/// Whether the runtime binary is there (`runc --version` runs).
pub fn available(binary: &Path) -> bool {
    std::process::Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
