//! The sandbox operations on the node's socket (an extension of `ublk_daemon::node::proto`:
//! the same envelope, `{"v": 1, "op": "sandbox_…", …}`).
//!
//! | op | fields | answer |
//! | --- | --- | --- |
//! | `sandbox_create` | [`CreateRequest`] | [`SandboxInfo`] |
//! | `sandbox_exec` | [`ExecRequest`] | events [`ExecEvent`], then [`ExecResult`] |
//! | `sandbox_attach` | `id`, `exec`, `stdout_from`?, `stderr_from`? | the same stream, replayed from those offsets |
//! | `sandbox_cp` | [`CopyRequest`] | [`CopyResult`] |
//! | `sandbox_ls` | — | `[SandboxInfo]` |
//! | `sandbox_inspect` | `id` | [`SandboxDetail`] |
//! | `sandbox_rm` | `id` | [`SandboxInfo`] (as it was) |
//! | `sandbox_pool_set` | `stack`, `size` | [`PoolInfo`] |
//! | `sandbox_pool_ls` | — | `[PoolInfo]` |
//! | `sandbox_run` | `stack`, and [`ExecRequest`]'s fields but `id` | like `sandbox_exec`, in a pool sandbox that is removed after |
//! | `sandbox_net` | `id`, `allow` (rules as text) | [`SandboxInfo`]; the sandbox's egress rules replaced at once |
//! | `sandbox_pause` | `id` | [`SandboxInfo`]; every process frozen (the runtime's freezer), memory kept |
//! | `sandbox_resume` | `id` | [`crate::ResumeResult`]: [`SandboxInfo`] and, for a suspended one, `prefetch` ([`crate::ResumeReport`]); prefetched, then thawed |
//! | `sandbox_suspend` | `id` | [`crate::SuspendReport`]: frozen, what was resident recorded, its memory reclaimed (memory before and after) |
//! | `sandbox_pack` | `id`, `name`, `strip`?, `no_default_strip`? | [`crate::PackResult`]: the upper packed into layer `name` (parents: the stack) |
//! | `sandbox_fork` | `id`, `count` | [`crate::ForkResult`]: a pack to `snapshot/fork-<id>:<ms>`, then `count` sandboxes from it |
//! | `sandbox_input` | `id`, `exec`, `data` (base64)?, `close`?, `signal`?, `pty`? | `{}`: bytes to an exec's open stdin (or its terminal), its stdin closed, a signal to its process group, its terminal resized |
//!
//! Output bytes travel base64-encoded in events (`{"stream": "stdout", "offset": N,
//! "data": "…"}`); `offset` is where the bytes start in that stream's captured output, so a
//! client that reattaches asks for what it has not seen.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Resource limits of one sandbox (each `None`: the node's default, or none).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// CPU, in thousandths of a CPU (`--cpus 1.5` → 1500).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    /// Memory, bytes (swap none beyond it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Processes and threads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// The upper's size, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<u64>,
    /// Its CPU class (`--class ls|be`).
    #[serde(default, skip_serializing_if = "CpuClass::is_default")]
    pub class: CpuClass,
}

/// A sandbox's CPU class. Best-effort sandboxes run under `SCHED_IDLE` (set on their init,
/// inherited by every process it starts) with the lowest CPU weight, so a latency-sensitive
/// neighbour takes the CPU whenever it wants it; latency-sensitive ones keep the defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuClass {
    /// Latency-sensitive (the default).
    #[default]
    Ls,
    /// Best-effort.
    Be,
}

impl CpuClass {
    fn is_default(&self) -> bool {
        *self == CpuClass::Ls
    }
}

impl Limits {
    /// The size of the sandbox's `/tmp` tmpfs (charged to its memory cgroup): a quarter of its
    /// memory, 64 MiB without a memory limit.
    pub fn tmp_bytes(&self) -> u64 {
        self.memory
            .map(|m| (m / 4).max(1 << 20))
            .unwrap_or(64 << 20)
    }
}

/// Network of a sandbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Network {
    /// Its own network namespace with loopback only.
    #[default]
    None,
    /// A veth with NAT whose egress is filtered to these destinations (`crate::net`).
    Allow(Vec<crate::net::Rule>),
}

/// `sandbox_create`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateRequest {
    /// The stack, first lowest (`KIND/NAME:VERSION`).
    pub layers: Vec<String>,
    /// The id to give it (`[a-z0-9][a-z0-9_-]{0,62}`); default: a fresh one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    /// `KEY=VALUE` for every process.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// `NAME=VALUE`: a file `/run/secrets/NAME` on a tmpfs, never in the upper.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// Names of `secrets` also given to every exec as environment variables (`NAME=VALUE`;
    /// the value read from the secret's tmpfs file at each exec, never stored in the record).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_env: Vec<String>,
    #[serde(default)]
    pub net: Network,
    /// Remove the sandbox after this many seconds without an operation on it and without a
    /// running exec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// Take a ready sandbox of a warm pool of this stack (`sandbox_pool_set`) if there is one,
    /// instead of creating one. Only a request that asks for nothing a pooled sandbox was not
    /// made with (no id, limits, env, secrets, network or idle timeout) takes one; any other
    /// is created as usual. The sandbox taken leaves its pool and is refilled.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pooled: bool,
}

/// A sandbox's lifecycle state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Its root is being composed or its init started.
    Creating,
    Running,
    /// Frozen (`sandbox_pause`): its processes hold their memory and run nothing until
    /// `sandbox_resume`.
    Paused,
    /// Frozen and its memory reclaimed (`sandbox_suspend`), what it had resident recorded;
    /// `sandbox_resume` prefetches that, then thaws it.
    Suspended,
    /// Its init is gone (killed from outside, or the node rebooted); only `rm` is left.
    Stopped,
    /// Being removed.
    Removing,
}

/// A state's name on the wire (`running`, `suspended`, …).
pub fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Creating => "creating",
        SandboxState::Running => "running",
        SandboxState::Paused => "paused",
        SandboxState::Suspended => "suspended",
        SandboxState::Stopped => "stopped",
        SandboxState::Removing => "removing",
    }
}

/// One sandbox, as `ls` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxInfo {
    pub id: String,
    pub state: SandboxState,
    pub layers: Vec<String>,
    pub limits: Limits,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    /// The init's host pid, while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// The pool it is kept in, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// How long creating it took (compose + runtime), milliseconds.
    #[serde(default)]
    pub create_ms: u64,
    /// Its network.
    #[serde(default)]
    pub net: Network,
    /// Its address, with an allowlist network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<std::net::Ipv4Addr>,
}

/// `sandbox_inspect`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxDetail {
    #[serde(flatten)]
    pub info: SandboxInfo,
    /// The composed root on the host (the node's overlay mount).
    pub rootfs: PathBuf,
    pub upper: PathBuf,
    /// Bytes in the upper (allocated blocks).
    pub upper_bytes: u64,
    /// The sandbox's cgroups, by controller (`memory` → its directory).
    pub cgroups: std::collections::BTreeMap<String, PathBuf>,
    /// Its init's scheduling policy (`other`; `idle` for a best-effort sandbox).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sched_policy: Option<String>,
    /// Resident memory charged to it: anonymous and file-backed (page cache), bytes.
    pub memory_anon: u64,
    pub memory_file: u64,
    /// Processes in it now.
    pub pids: u64,
    /// Execs it runs or ran (the most recent, bounded).
    pub execs: Vec<ExecSummary>,
    /// Seconds since its last operation.
    pub idle_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
}

/// `sandbox_exec`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub id: String,
    /// The command and its arguments.
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// `uid[:gid]` or a user name of the sandbox's `/etc/passwd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Kill the command (and what it started) after this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Captured bytes per stream; past it output is dropped and counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output: Option<u64>,
    /// Bytes for the command's stdin (closed after them; none: /dev/null), base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Answer with the exec's id only, and let it run (attach later).
    #[serde(default)]
    pub detach: bool,
    /// Keep stdin open for `sandbox_input` after `stdin`'s bytes (if any), until closed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin_open: bool,
    /// Run under a pseudo-terminal of this size: stdin, stdout and stderr are its slave,
    /// the command leads its session with it as the controlling terminal, and everything it
    /// writes arrives as `stdout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// A name the caller gives the exec, to find it again (`Manager::execs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// A terminal's size in characters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// `sandbox_input`: what to do to a running exec; the fields present, in this order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRequest {
    pub id: String,
    pub exec: String,
    /// Bytes for its stdin (an exec started with `stdin_open` or a `pty`), base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// Close its stdin (end of input).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub close: bool,
    /// A signal to its process group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Resize its terminal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// One line of an exec's stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum ExecEvent {
    /// The exec has an id (always the first event).
    Started { exec: String, sandbox: String },
    /// Output bytes.
    Output {
        stream: Stream,
        offset: u64,
        /// base64
        data: String,
    },
}

/// stdout or stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Why an exec has its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitReason {
    /// It exited (or was killed by a signal from inside the sandbox).
    Exited,
    /// Its timeout ran out: it was killed.
    Timeout,
    /// The kernel's OOM killer killed it (the sandbox's memory limit).
    Oom,
    /// Killed from outside (the sandbox was removed, or its init died).
    Killed,
    /// The runtime could not start it.
    Failed,
}

/// An exec's end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    pub exec: String,
    pub sandbox: String,
    pub reason: ExitReason,
    /// The exit code, if it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that ended it, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Bytes it wrote to each stream, captured or not.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// Whether some output was dropped (past `max_output`).
    pub truncated: bool,
    /// From start to exit, milliseconds.
    pub duration_ms: u64,
    /// The runtime's words, when it failed to start the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// An exec in `inspect`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecSummary {
    pub exec: String,
    pub args: Vec<String>,
    pub running: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ExecResult>,
}

/// `sandbox_attach`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachRequest {
    pub id: String,
    pub exec: String,
    #[serde(default)]
    pub stdout_from: u64,
    #[serde(default)]
    pub stderr_from: u64,
}

/// Which way `cp` copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// From the host into the sandbox.
    In,
    /// From the sandbox to the host.
    Out,
}

/// `sandbox_cp`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyRequest {
    pub id: String,
    pub direction: Direction,
    /// An absolute host path.
    pub host: PathBuf,
    /// A path in the sandbox (resolved inside its root).
    pub path: String,
    /// At most this many bytes of file data (default [`crate::files::DEFAULT_MAX_COPY`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// `sandbox_cp`'s answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyResult {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub bytes: u64,
}

/// A warm pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolInfo {
    /// The stack, as given (`REF[,REF…]`, first lowest).
    pub stack: String,
    /// How many ready sandboxes it keeps.
    pub size: u32,
    /// How many are ready now.
    pub ready: u32,
}

/// `sandbox_pool_set`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRequest {
    pub stack: String,
    pub size: u32,
}

/// `sandbox_run`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    pub stack: String,
    #[serde(flatten)]
    pub exec: ExecRequest,
}

/// The requests, by op.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Request {
    SandboxCreate(CreateRequest),
    SandboxExec(ExecRequest),
    SandboxAttach(AttachRequest),
    SandboxCp(CopyRequest),
    SandboxLs {},
    SandboxInspect {
        id: String,
    },
    SandboxRm {
        id: String,
    },
    SandboxPoolSet(PoolRequest),
    SandboxPoolLs {},
    SandboxRun(RunRequest),
    /// Replace the egress allowlist of a sandbox created with one (atomically).
    SandboxNet {
        id: String,
        allow: Vec<crate::net::Rule>,
    },
    SandboxPause {
        id: String,
    },
    SandboxResume {
        id: String,
    },
    /// Freeze, record what is resident, reclaim (`crate::suspend`).
    SandboxSuspend {
        id: String,
    },
    SandboxInput(InputRequest),
    /// Pack a sandbox's upper into a new layer (`crate::pack`).
    SandboxPack(crate::pack::PackRequest),
    /// Pack to a snapshot layer and create `count` sandboxes from it.
    SandboxFork {
        id: String,
        count: u32,
    },
}

impl Request {
    /// The request as a request object (`v` is added by the client).
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Split a stack given as `REF[,REF…]`.
pub fn parse_stack(stack: &str) -> Vec<String> {
    stack
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_with_their_op() {
        let r = Request::SandboxExec(ExecRequest {
            id: "a".into(),
            args: vec!["true".into()],
            ..Default::default()
        });
        let v = r.to_value();
        assert_eq!(v["op"], "sandbox_exec");
        assert_eq!(serde_json::from_value::<Request>(v).unwrap(), r);
        let ls: Request = serde_json::from_str(r#"{"op":"sandbox_ls","v":1}"#).unwrap();
        assert_eq!(ls, Request::SandboxLs {});
        assert!(serde_json::from_str::<Request>(r#"{"op":"sandbox_exec"}"#).is_err());
    }
}
