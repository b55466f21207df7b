//! Starting execs in a sandbox and finding them again: through the sandbox's init
//! (`crate::agent`: the exec's files made first, `crate::exec`), or `runc exec` for a
//! sandbox without the init's socket; each run to its end by `crate::run`.

use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;

use super::{now_ms, resolve_user, Manager, Sandbox};
use crate::exec::{self, Exec};
use crate::proto::ExecRequest;
use crate::runc::ExecOptions;
use crate::{cgroup, spec, Error, Result};

impl Manager {
    /// Start `req.args` in sandbox `req.id`; the exec, already running.
    pub async fn exec(&self, req: ExecRequest) -> Result<Arc<Exec>> {
        let sb = self.get(&req.id)?;
        if req.args.is_empty() {
            return Err(Error::InvalidSpec("exec needs a command".into()));
        }
        for e in &req.env {
            if !e.contains('=') || e.starts_with('=') {
                return Err(Error::InvalidSpec(format!("--env {e:?} is not KEY=VALUE")));
            }
        }
        let max_output = req.max_output.unwrap_or(exec::DEFAULT_MAX_OUTPUT);
        if max_output > exec::MAX_MAX_OUTPUT {
            return Err(Error::Limit(format!(
                "--max-output {max_output} is more than {}",
                exec::MAX_MAX_OUTPUT
            )));
        }
        let stdin = match &req.stdin {
            Some(s) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(s)
                    .map_err(|e| Error::InvalidSpec(format!("stdin is not base64: {e}")))?,
            ),
            None => None,
        };
        if let Some(t) = &req.tag {
            if t.len() > 256 {
                return Err(Error::InvalidSpec(
                    "an exec's tag is at most 256 bytes".into(),
                ));
            }
        }
        let (started, exec) = {
            let _life = sb.lifecycle.lock().await;
            self.check_running(&sb)?;
            sb.touch();
            let user = match &req.user {
                Some(u) => Some(resolve_user(&sb.view(), u)?),
                None => None,
            };
            let n = self.next_exec.fetch_add(1, Ordering::Relaxed);
            let exec_id = format!("e{n}-{}", now_ms() % 1_000_000);
            let cgroups = sb.record().pid.map(cgroup::of_pid).unwrap_or_default();
            let mut key = [0u8; 8];
            rustix::rand::getrandom(&mut key, rustix::rand::GetRandomFlags::empty())
                .map_err(|e| Error::io("a random exec key", e.into()))?;
            let started_ms = now_ms();
            let meta = exec::ExecMeta {
                id: exec_id.clone(),
                key: u64::from_le_bytes(key),
                args: req.args.clone(),
                env: req.env.clone(),
                cwd: req.cwd.clone(),
                tag: req.tag.clone(),
                pty: req.pty.is_some(),
                max_output,
                started_ms,
                deadline_ms: req.timeout_ms.map(|t| started_ms + t),
                oom_before: cgroup::oom_kills(&cgroups),
                stdin_open: req.stdin_open || req.pty.is_some(),
            };
            let (dir, sandbox) = (sb.dir.join(exec::EXECS_DIR).join(&exec_id), sb.id.clone());
            let (exec, status) =
                tokio::task::spawn_blocking(move || Exec::create(dir, sandbox, meta))
                    .await
                    .map_err(|e| Error::Runtime(format!("exec task: {e}")))?
                    .map_err(|e| Error::io(format!("the files of exec {exec_id}"), e))?;
            let with_stdin = stdin.is_some() || req.stdin_open;
            let started = match self
                .start_with_init(&sb, &exec, status, &req, user, with_stdin)
                .await
            {
                Some(s) => s,
                None if req.pty.is_some() => {
                    exec.remove_files();
                    return Err(Error::Conflict(format!(
                        "sandbox {} was started without Strata's init socket: no terminals in it",
                        sb.id
                    )));
                }
                None => self.start_with_runtime(&sb, &exec, &req, user, with_stdin)?,
            };
            sb.running_execs.fetch_add(1, Ordering::SeqCst);
            sb.add_exec(exec.clone());
            (started, (exec, cgroups))
        };
        let (exec, cgroups) = exec;
        let oom_before = exec.meta().oom_before;
        tokio::spawn(crate::run::run(crate::run::Job {
            sb,
            exec: exec.clone(),
            started,
            stdin,
            stdin_open: req.stdin_open,
            deadline: req
                .timeout_ms
                .map(|t| tokio::time::Instant::now() + Duration::from_millis(t)),
            oom_before,
            cgroups,
        }));
        Ok(exec)
    }

    /// Start the exec through the sandbox's init (`crate::agent`); `None` if the sandbox has
    /// no init socket (it was made before it): the runtime starts it. An init that does not
    /// answer is a failed exec, never a fallback.
    async fn start_with_init(
        &self,
        sb: &Sandbox,
        exec: &Arc<Exec>,
        status: std::fs::File,
        req: &ExecRequest,
        user: Option<(u32, u32)>,
        with_stdin: bool,
    ) -> Option<crate::run::Started> {
        let init_pid = sb.record().pid?;
        let mut env: Vec<String> = spec::BASE_ENV.iter().map(|s| s.to_string()).collect();
        let record = sb.record();
        env.extend(record.env.iter().cloned());
        for n in &record.secret_env {
            match std::fs::read(sb.dir.join("secrets").join(n)) {
                Ok(v) => env.push(format!("{n}={}", String::from_utf8_lossy(&v))),
                Err(e) => tracing::warn!("sandbox {}: secret {n} for the env: {e}", sb.id),
            }
        }
        env.extend(req.env.iter().cloned());
        if req.pty.is_some() && !env.iter().any(|e| e.starts_with("TERM=")) {
            env.push("TERM=xterm-256color".to_owned());
        }
        let (uid, gid) = user.unwrap_or((0, 0));
        let spawn = crate::run::InitSpawn {
            dir: sb.dir.clone(),
            init_pid,
            exec: exec.clone(),
            status,
            args: req.args.clone(),
            env,
            cwd: req.cwd.clone().unwrap_or_else(|| "/".to_owned()),
            uid,
            gid,
            with_stdin,
            pty: req.pty,
        };
        let r = tokio::task::spawn_blocking(move || crate::run::spawn_in_init(spawn))
            .await
            .ok()?;
        match r {
            Ok(s) => Some(s),
            Err(crate::agent::SpawnError::NoSocket) => {
                tracing::debug!("sandbox {}: no init socket: runc exec", sb.id);
                None
            }
            Err(e) => Some(crate::run::Started::Failed(match e {
                crate::agent::SpawnError::Refused(errno) => format!(
                    "cannot start {}: {}",
                    req.args[0],
                    std::io::Error::from_raw_os_error(errno)
                ),
                e => format!("sandbox {}: {e}", sb.id),
            })),
        }
    }

    /// Start the exec with `runc exec` (a runtime process for its whole life).
    fn start_with_runtime(
        &self,
        sb: &Sandbox,
        exec: &Arc<Exec>,
        req: &ExecRequest,
        user: Option<(u32, u32)>,
        with_stdin: bool,
    ) -> Result<crate::run::Started> {
        let pid_file = sb.dir.join(format!("exec-{}.pid", exec.id));
        let mut cmd = self.runtime.exec_command(
            &sb.id,
            &ExecOptions {
                args: &req.args,
                env: &req.env,
                cwd: req.cwd.as_deref(),
                user,
                pid_file: &pid_file,
            },
        );
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(if with_stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            });
        let child = cmd
            .spawn()
            .map_err(|e| Error::Runtime(format!("start {}: {e}", self.runtime.binary.display())))?;
        Ok(crate::run::Started::Runtime { child, pid_file })
    }

    /// The execs of sandbox `id` that run, and the most recent that ended (bounded).
    pub fn execs(&self, id: &str) -> Result<Vec<Arc<Exec>>> {
        let sb = self.get(id)?;
        sb.touch();
        let all = sb.execs.lock().unwrap_or_else(|p| p.into_inner());
        Ok(all.iter().cloned().collect())
    }

    /// A running or finished exec of sandbox `id`.
    pub fn find_exec(&self, id: &str, exec: &str) -> Result<Arc<Exec>> {
        let sb = self.get(id)?;
        sb.touch();
        sb.find_exec(exec)
            .ok_or_else(|| Error::NotFound(format!("no exec {exec} in sandbox {id}")))
    }
}
