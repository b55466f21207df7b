//! The node's sandboxes: create, exec, cp, ls, inspect, rm, idle timeouts, and finding them
//! again after a daemon restart. Warm pools are in `pool.rs`.
//!
//! ## Locking
//! The table of sandboxes is a short-held std mutex; a sandbox's lifecycle changes (create,
//! rm) hold its own async lock across the runtime calls, so an `rm` waits for a `create` of
//! the same sandbox to finish and never races it, while other sandboxes go on. Execs take no
//! lifecycle lock for their run, only to start.

use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use ublk_daemon::node::proto::{ErrorKind, Request as NodeRequest, ResponseLine};
use ublk_daemon::node::Node;

use crate::exec::Exec;
use crate::proto::{
    CopyRequest, CopyResult, CreateRequest, Direction, ExecRequest, Limits, Network, SandboxDetail,
    SandboxInfo, SandboxState,
};
use crate::runc::Runtime;
use crate::{cgroup, files, spec, Error, Result};

mod execs;

/// How a node's sandboxes are kept.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Records, bundles and uppers (local disk): `<dir>/<id>/…`.
    pub dir: PathBuf,
    /// The OCI runtime's binary (`runc`).
    pub runtime: PathBuf,
    /// The runtime's state directory (`--root`).
    pub runtime_root: PathBuf,
    /// The most sandboxes this node runs.
    pub max_sandboxes: usize,
    /// The size of the node's uppers filesystem (`crate::quota`: a btrfs image with one
    /// subvolume and quota group per sandbox, what makes `--disk` work); `None`: uppers are
    /// plain directories under `dir` and `--disk` is refused.
    pub uppers_size: Option<u64>,
    /// What creates the node admits (`crate::admission`).
    pub admission: crate::admission::Admission,
    /// The node's name in a cluster ([`valid_node_name`]): every id it makes starts with
    /// `<name>-`, so that a front routes any request by the id alone, and its sandboxes'
    /// cgroups live under `/strata-<name>` (several nodes share one machine in tests).
    pub node_name: Option<String>,
}

/// Whether `name` is a valid node name: `[a-z0-9]{1,16}` (no `-`: a node's ids are
/// `<name>-…`, and the name is what comes before the first `-`).
pub fn valid_node_name(name: &str) -> bool {
    (1..=16).contains(&name.len())
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

impl ManagerConfig {
    /// Sandboxes under `dir`, the runtime's state under `<run_dir>/runc`, `runc` and
    /// `catatonit` from `PATH`.
    pub fn new(dir: PathBuf, run_dir: &Path) -> Self {
        Self {
            dir,
            runtime: find_in_path("runc").unwrap_or_else(|| "runc".into()),
            runtime_root: run_dir.join("runc"),
            max_sandboxes: 4096,
            uppers_size: None,
            admission: Default::default(),
            node_name: None,
        }
    }
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

/// Finished execs a sandbox remembers (for `attach` and `inspect`).
const KEPT_EXECS: usize = 64;

/// The record of one sandbox, `<dir>/<id>/sandbox.json` (`docs/sandbox.md`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub layers: Vec<String>,
    pub limits: Limits,
    pub env: Vec<String>,
    #[serde(default)]
    pub secret_names: Vec<String>,
    /// Secrets (by name) every exec also gets as environment variables.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_env: Vec<String>,
    #[serde(default)]
    pub net: Network,
    pub idle_timeout_s: Option<u64>,
    pub created_ms: u64,
    pub create_ms: u64,
    pub state: SandboxState,
    pub pid: Option<u32>,
    /// The init's start time (`/proc/<pid>/stat`'s 22nd field, clock ticks since boot): the
    /// pid names our init only while this matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_start: Option<u64>,
    #[serde(default)]
    pub pool: Option<String>,
    /// The network slot (`crate::net`), with an allowlist network.
    #[serde(default)]
    pub net_slot: Option<u32>,
    /// Its address there.
    #[serde(default)]
    pub addr: Option<std::net::Ipv4Addr>,
}

pub(crate) struct Sandbox {
    pub id: String,
    pub dir: PathBuf,
    record: Mutex<Record>,
    execs: Mutex<VecDeque<Arc<Exec>>>,
    last_active: Mutex<Instant>,
    pub(crate) running_execs: AtomicUsize,
    pub(crate) lifecycle: tokio::sync::Mutex<()>,
    /// Held while the record is written ([`Sandbox::set`]).
    saving: tokio::sync::Mutex<()>,
}

impl Sandbox {
    pub fn record(&self) -> Record {
        self.record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Change the record, and write it (synced, on the blocking pool). Writes go one at a
    /// time, each of the record as it is when its turn comes: the last one written is the
    /// latest.
    pub(crate) async fn set(&self, f: impl FnOnce(&mut Record)) -> Result<()> {
        f(&mut self.record.lock().unwrap_or_else(|p| p.into_inner()));
        let _turn = self.saving.lock().await;
        let (dir, r) = (self.dir.clone(), self.record());
        tokio::task::spawn_blocking(move || save_record(&dir, &r))
            .await
            .map_err(|e| Error::Runtime(format!("write a sandbox's record: {e}")))?
    }

    pub(crate) fn touch(&self) {
        *self.last_active.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle(&self) -> Duration {
        self.last_active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("bundle/rootfs")
    }

    /// The root as the sandbox's processes see it — its mount namespace, with its own
    /// `/tmp`, `/etc/hostname` and secrets — through its init's `/proc/<pid>/root`; the
    /// composed root if the init is gone.
    pub fn view(&self) -> PathBuf {
        match self.record().pid {
            Some(pid) if Path::new(&format!("/proc/{pid}/root")).exists() => {
                PathBuf::from(format!("/proc/{pid}/root"))
            }
            _ => self.rootfs(),
        }
    }

    pub(crate) fn info(&self) -> SandboxInfo {
        let r = self.record();
        SandboxInfo {
            id: r.id,
            state: r.state,
            layers: r.layers,
            limits: r.limits,
            created_ms: r.created_ms,
            pid: r.pid,
            pool: r.pool,
            create_ms: r.create_ms,
            net: r.net,
            addr: r.addr,
        }
    }

    fn find_exec(&self, exec: &str) -> Option<Arc<Exec>> {
        self.execs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|e| e.id == exec)
            .cloned()
    }

    /// Its execs, running and remembered.
    pub(crate) fn execs_snapshot(&self) -> Vec<Arc<Exec>> {
        let execs = self.execs.lock().unwrap_or_else(|p| p.into_inner());
        execs.iter().cloned().collect()
    }

    /// Forget ended exec `id` and remove its files (`crate::retention`); whether it was here.
    pub(crate) fn forget_exec(&self, id: &str) -> bool {
        let gone = {
            let mut execs = self.execs.lock().unwrap_or_else(|p| p.into_inner());
            match execs
                .iter()
                .position(|e| e.id == id && e.result().is_some())
            {
                Some(i) => execs.remove(i),
                None => None,
            }
        };
        gone.map(|e| e.remove_files()).is_some()
    }

    pub(crate) fn add_exec(&self, e: Arc<Exec>) {
        let mut execs = self.execs.lock().unwrap_or_else(|p| p.into_inner());
        execs.push_back(e);
        while execs.len() > KEPT_EXECS {
            match execs.iter().position(|x| x.result().is_some()) {
                Some(i) => {
                    if let Some(gone) = execs.remove(i) {
                        // A few small files on local disk.
                        gone.remove_files();
                    }
                }
                None => break,
            }
        }
    }
}

impl Record {
    /// The record in `bytes`, if they hold one for sandbox `id` (anything else — not JSON,
    /// another id, an invalid id — is `None`: the directory is treated as leftovers).
    pub fn parse(bytes: &[u8], id: &str) -> Option<Record> {
        let r: Record = serde_json::from_slice(bytes).ok()?;
        (r.id == id && valid_id(id)).then_some(r)
    }
}

pub(crate) fn save_record(dir: &Path, r: &Record) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(r).map_err(|e| Error::Spec(e.to_string()))?;
    let path = dir.join("sandbox.json");
    fs_cache::write_atomic(&path, &bytes)
        .map_err(|e| Error::io(format!("write {}", path.display()), e))
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether `id` is a valid sandbox id: `[a-z0-9][a-z0-9_-]{0,62}`.
pub fn valid_id(id: &str) -> bool {
    let b = id.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_')
}

fn fresh_id(prefix: &str) -> String {
    format!("{prefix}sb-{}", random_hex(6))
}

/// How many creates compose a root and start an init at once: twice the CPUs, or
/// `STRATA_CREATES_AT_ONCE`. The rest wait their turn (in order), counted by the node's
/// status from their arrival. Unbounded, a burst of 512 through two fronts onto four nodes
/// sharing 2 vCPUs made 22-27 sandboxes/s with half of them done only after 16-19 s; bounded
/// so, 31-37/s and half done after 6-7.5 s; one node and 32 clients: 24.5-25.3/s against
/// 19.8-21.1/s, p99 1.2 s against 2.0 s (`bench/README.md`, `e2b_cluster`).
fn creates_at_once() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::env::var("STRATA_CREATES_AT_ONCE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2 * cpus)
        .max(1)
}

/// How long a create's mount keeps its turn ([`creates_at_once`]) before giving it back. A
/// mount of active layers takes milliseconds; one that activates a layer waits for its meta
/// image from the store, and behind a stalled store it would keep the turn for the store's
/// whole deadline, so that the creates of stacks already here waited too.
const TURN_KEPT_WHILE_MOUNTING: Duration = Duration::from_secs(1);

/// `n` random bytes from the kernel, as hex.
pub(crate) fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(k) => filled += k,
            Err(rustix::io::Errno::INTR) => {}
            // No entropy source: the time and pid still make the id unlikely to repeat.
            Err(_) => {
                let seed = now_ms() ^ (u64::from(std::process::id()) << 32);
                for (i, x) in b.iter_mut().enumerate() {
                    *x = (seed >> ((i % 8) * 8)) as u8 ^ (i as u8).wrapping_mul(151);
                }
                break;
            }
        }
    }
    hex::encode(b)
}

/// The node's sandboxes (see the module docs).
pub struct Manager {
    config: ManagerConfig,
    pub(crate) node: Arc<Node>,
    pub(crate) runtime: Runtime,
    /// Expanded stacks (`pack::expand_stack`): a layer → the layers under it.
    pub(crate) stacks: Mutex<HashMap<String, Vec<String>>>,
    sandboxes: Mutex<HashMap<String, Arc<Sandbox>>>,
    pub(crate) next_exec: AtomicU64,
    pub(crate) pools: crate::pool::Pools,
    /// The uppers filesystem, if configured.
    uppers: Option<Arc<crate::quota::UpperFs>>,
    /// Network slots in use.
    slots: Mutex<std::collections::BTreeSet<u32>>,
    /// Creates composing a root and starting its init at once ([`creates_at_once`]).
    composing: tokio::sync::Semaphore,
    /// The init binary the bundles bind (`agent::install_init`).
    init: PathBuf,
    /// Whether the kernel has core scheduling (`crate::qos`).
    core_sched: bool,
}

/// Network slots the manager hands out (`crate::net` has more; the rest are the tests').
const NET_SLOTS: u32 = 16_000;

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager")
            .field("dir", &self.config.dir)
            .finish_non_exhaustive()
    }
}

impl Manager {
    /// Open the node's sandboxes: every record under `config.dir` is read and its container
    /// looked up; running ones are reattached, stopped ones kept for `rm`, half-created or
    /// half-removed ones removed. Starts the idle-timeout reaper and the pools.
    pub async fn start(config: ManagerConfig, node: Arc<Node>) -> Result<Arc<Self>> {
        if let Some(n) = &config.node_name {
            if !valid_node_name(n) {
                return Err(Error::InvalidSpec(format!(
                    "bad node name {n:?} (want [a-z0-9]{{1,16}})"
                )));
            }
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&config.dir)
            .map_err(|e| Error::io(format!("create {}", config.dir.display()), e))?;
        let runtime = Runtime {
            binary: config.runtime.clone(),
            root: config.runtime_root.clone(),
        };
        let init = crate::agent::install_init(&config.dir)
            .map_err(|e| Error::io(format!("install the init in {}", config.dir.display()), e))?;
        let uppers = match config.uppers_size {
            Some(size) => {
                let dir = config.dir.clone();
                Some(Arc::new(
                    tokio::task::spawn_blocking(move || crate::quota::UpperFs::open(&dir, size))
                        .await
                        .map_err(|e| Error::Runtime(format!("open the uppers: {e}")))??,
                ))
            }
            None => None,
        };
        let m = Arc::new(Self {
            pools: crate::pool::Pools::load(&config.dir),
            config,
            node,
            runtime,
            stacks: Mutex::new(HashMap::new()),
            sandboxes: Mutex::new(HashMap::new()),
            next_exec: AtomicU64::new(1),
            uppers,
            slots: Mutex::new(Default::default()),
            composing: tokio::sync::Semaphore::new(creates_at_once()),
            init,
            core_sched: crate::qos::core_sched_available(),
        });
        if !m.core_sched {
            tracing::warn!(
                "core scheduling (PR_SCHED_CORE) is not in this kernel: best-effort sandboxes \
                 run under SCHED_IDLE with the lowest CPU weight, but may share a core's SMT \
                 siblings with latency-sensitive ones"
            );
        }
        let mut leftovers = Vec::new();
        let entries = std::fs::read_dir(&m.config.dir)
            .map_err(|e| Error::io(format!("read {}", m.config.dir.display()), e))?;
        for entry in entries.flatten() {
            let dir = entry.path();
            let Some(id) = dir.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
                continue;
            };
            if !valid_id(&id) || !dir.is_dir() || (id == "uppers" && m.uppers.is_some()) {
                continue;
            }
            let record = std::fs::read(dir.join("sandbox.json"))
                .ok()
                .and_then(|b| Record::parse(&b, &id));
            let Some(mut record) = record else {
                tracing::warn!(
                    "{}: no readable record; removing its leftovers",
                    dir.display()
                );
                leftovers.push((id, dir, None));
                continue;
            };
            if let Some(slot) = record.net_slot {
                m.slots
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(slot);
            }
            let state = m.runtime.state(&id).await.ok().flatten();
            match (record.state, state.as_ref().map(|s| s.status.as_str())) {
                (
                    SandboxState::Running | SandboxState::Paused | SandboxState::Suspended,
                    Some(s @ ("running" | "paused")),
                ) => {
                    // Suspended stays suspended while frozen: its residency record is kept.
                    record.state = match (record.state, s) {
                        (SandboxState::Suspended, "paused") => SandboxState::Suspended,
                        (_, "paused") => SandboxState::Paused,
                        _ => SandboxState::Running,
                    };
                    record.pid = state.map(|s| s.pid);
                }
                (
                    SandboxState::Running
                    | SandboxState::Paused
                    | SandboxState::Suspended
                    | SandboxState::Stopped,
                    _,
                ) => {
                    record.state = SandboxState::Stopped;
                    record.pid = None;
                }
                (SandboxState::Creating | SandboxState::Removing, _) => {
                    leftovers.push((id, dir, record.net_slot));
                    continue;
                }
            }
            let _ = save_record(&dir, &record);
            tracing::info!("sandbox {id}: {:?}, reattached", record.state);
            let sb = Arc::new(Sandbox {
                id: id.clone(),
                dir,
                record: Mutex::new(record),
                execs: Mutex::new(VecDeque::new()),
                last_active: Mutex::new(Instant::now()),
                running_execs: AtomicUsize::new(0),
                lifecycle: tokio::sync::Mutex::new(()),
                saving: tokio::sync::Mutex::new(()),
            });
            m.sandboxes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, sb.clone());
            let top = crate::reattach::execs(&sb).await;
            m.next_exec.fetch_max(top + 1, Ordering::Relaxed);
        }
        for (id, dir, slot) in leftovers {
            if let Err(e) = m.teardown(&id, &dir, slot).await {
                tracing::warn!("sandbox {id}: removing its leftovers: {e}");
            }
        }
        m.pools.adopt(&m);
        let weak = Arc::downgrade(&m);
        tokio::spawn(async move {
            for tick in 0u64.. {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let Some(m) = weak.upgrade() else { return };
                m.reap_idle().await;
                m.pools.refill(&m);
                if tick % 10 == 0 {
                    let all = m.all();
                    // Removing files: off the async threads.
                    tokio::task::spawn_blocking(move || {
                        crate::retention::trim(&all, crate::retention::budget())
                    });
                }
            }
        });
        Ok(m)
    }

    /// The runtime this manager drives.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    fn run_dir(&self) -> PathBuf {
        self.node.config().run_dir.clone()
    }

    /// Replace the egress allowlist of sandbox `id` (created with one), atomically.
    pub async fn set_net(&self, id: &str, allow: Vec<crate::net::Rule>) -> Result<SandboxInfo> {
        let sb = self.get(id)?;
        let _life = sb.lifecycle.lock().await;
        self.check_running(&sb)?;
        sb.touch();
        let r = sb.record();
        let (Network::Allow(_), Some(slot), Some(addr)) = (&r.net, r.net_slot, r.addr) else {
            return Err(Error::Conflict(format!(
                "sandbox {id} has no network of its own (create it with --net allow=…)"
            )));
        };
        let (gateway, _) = crate::net::slot_addrs(slot)?;
        let net = crate::net::SandboxNet {
            id: id.to_owned(),
            slot,
            netns: crate::net::netns_path(&self.run_dir(), id),
            host_if: crate::net::host_if(slot),
            sandbox_addr: addr,
            gateway,
        };
        let (run_dir, rules) = (self.run_dir(), allow.clone());
        tokio::task::spawn_blocking(move || crate::net::update(&run_dir, &net, &rules))
            .await
            .map_err(|e| Error::Runtime(format!("network task: {e}")))??;
        sb.set(|r| r.net = Network::Allow(allow)).await?;
        Ok(sb.info())
    }

    /// Whether any sandbox exists (a daemon stop must then leave the mounts in place).
    pub fn has_sandboxes(&self) -> bool {
        !self
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    pub(crate) fn get(&self, id: &str) -> Result<Arc<Sandbox>> {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("no sandbox {id} on this node")))
    }

    /// Create a sandbox and start its init; the sandbox's info.
    pub async fn create(&self, req: CreateRequest) -> Result<SandboxInfo> {
        self.create_in_pool(req, None).await
    }

    pub(crate) async fn create_in_pool(
        &self,
        req: CreateRequest,
        pool: Option<String>,
    ) -> Result<SandboxInfo> {
        let t0 = Instant::now();
        if req.layers.is_empty() {
            return Err(Error::InvalidSpec(
                "a sandbox needs at least one layer".into(),
            ));
        }
        for e in &req.env {
            if !e.contains('=') || e.starts_with('=') || e.contains('\0') {
                return Err(Error::InvalidSpec(format!("--env {e:?} is not KEY=VALUE")));
            }
        }
        let mut secrets = Vec::new();
        for s in &req.secrets {
            let (name, value) = s
                .split_once('=')
                .ok_or_else(|| Error::InvalidSpec(format!("--secret {s:?} is not NAME=VALUE")))?;
            if name.is_empty()
                || name.len() > 128
                || !name
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.')
                || name.starts_with('.')
            {
                return Err(Error::InvalidSpec(format!("bad secret name {name:?}")));
            }
            secrets.push((name.to_owned(), value.to_owned()));
        }
        for n in &req.secret_env {
            let env_name = !n.is_empty()
                && !n.starts_with(|c: char| c.is_ascii_digit())
                && n.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_');
            if !env_name || !secrets.iter().any(|(s, _)| s == n) {
                return Err(Error::InvalidSpec(format!(
                    "--secret-env {n:?}: not the name of a --secret that is a valid \
                     environment variable name"
                )));
            }
        }
        let id = match req.id.clone() {
            Some(id) if valid_id(&id) => id,
            Some(id) => {
                return Err(Error::InvalidSpec(format!(
                    "bad sandbox id {id:?} (want [a-z0-9][a-z0-9_-]{{0,62}})"
                )))
            }
            None => fresh_id(&self.id_prefix()),
        };
        if req.limits.disk.is_some() && self.uppers.is_none() {
            return Err(Error::InvalidSpec(
                "--disk needs the node's uppers filesystem: start the daemon with --uppers-size SIZE".into(),
            ));
        }
        // A layer's parents come along: `--layer snapshot/x:1` alone is its whole stack.
        let layers = self.expand_stack(&req.layers).await?;
        let dir = self.config.dir.join(&id);
        let (net_slot, addr) = match &req.net {
            Network::None => (None, None),
            Network::Allow(_) => {
                let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
                // Another node on this machine may hold a slot this one does not know:
                // its veth (`sx<n>`) exists then (`net::setup` would refuse the slot).
                let slot = (0..NET_SLOTS)
                    .find(|s| !slots.contains(s) && !crate::net::slot_taken(*s))
                    .ok_or_else(|| Error::Limit("no network slot left on this node".into()))?;
                slots.insert(slot);
                (Some(slot), Some(crate::net::slot_addrs(slot)?.1))
            }
        };
        let record = Record {
            id: id.clone(),
            layers,
            limits: req.limits.clone(),
            env: req.env.clone(),
            secret_names: secrets.iter().map(|(n, _)| n.clone()).collect(),
            secret_env: req.secret_env.clone(),
            net: req.net.clone(),
            idle_timeout_s: req.idle_timeout_s,
            created_ms: now_ms(),
            create_ms: 0,
            state: SandboxState::Creating,
            pid: None,
            init_start: None,
            pool,
            net_slot,
            addr,
        };
        let sb = Arc::new(Sandbox {
            id: id.clone(),
            dir: dir.clone(),
            record: Mutex::new(record.clone()),
            execs: Mutex::new(VecDeque::new()),
            last_active: Mutex::new(Instant::now()),
            running_execs: AtomicUsize::new(0),
            lifecycle: tokio::sync::Mutex::new(()),
            saving: tokio::sync::Mutex::new(()),
        });
        let _life = sb.lifecycle.lock().await;
        let mem = crate::admission::meminfo();
        {
            let mut all = self.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
            let refusal = if all.contains_key(&id) {
                Some(Error::Conflict(format!("a sandbox {id} exists already")))
            } else if all.len() >= self.config.max_sandboxes {
                Some(Error::Limit(format!(
                    "this node runs {} sandboxes, its limit",
                    all.len()
                )))
            } else {
                let live: Vec<crate::Limits> = all.values().map(|s| s.record().limits).collect();
                self.config
                    .admission
                    .check(&live, &record.limits, self.config.uppers_size, mem)
                    .err()
            };
            if let Some(e) = refusal {
                if let Some(s) = net_slot {
                    self.slots
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&s);
                }
                return Err(e);
            }
            all.insert(id.clone(), sb.clone());
        }
        let composed = {
            let turn = self.composing.acquire().await.ok();
            self.compose_and_start(&sb, &record, &secrets, turn).await
        };
        match composed {
            Ok(pid) => {
                let create_ms = t0.elapsed().as_millis() as u64;
                let started = start_time(pid);
                sb.set(|r| {
                    r.state = SandboxState::Running;
                    r.pid = Some(pid);
                    r.init_start = started;
                    r.create_ms = create_ms;
                })
                .await?;
                // The keys are made by an exec, which takes the lifecycle lock itself.
                drop(_life);
                self.new_host_keys(&sb).await;
                Ok(sb.info())
            }
            Err(e) => {
                if let Err(t) = self.teardown(&id, &dir, net_slot).await {
                    tracing::warn!("sandbox {id}: cleaning up after a failed create: {t}");
                }
                self.sandboxes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                Err(e)
            }
        }
    }

    /// Compose `sb`'s root and start its init, holding `turn` (a permit of
    /// [`Manager::composing`]) throughout, except while a mount waits on the store: a mount
    /// still running after [`TURN_KEPT_WHILE_MOUNTING`] gives its turn back (it is waiting for
    /// a layer's activation, not using the node) and takes a new one when it is done.
    async fn compose_and_start(
        &self,
        sb: &Sandbox,
        record: &Record,
        secrets: &[(String, String)],
        turn: Option<tokio::sync::SemaphorePermit<'_>>,
    ) -> Result<u32> {
        let dir = &sb.dir;
        let crate::bundle::Prepared {
            rootfs,
            etc,
            upper,
            work,
            secrets: secrets_dir,
        } = crate::bundle::prepare(&sb.dir, &sb.id, record, self.uppers.clone(), secrets).await?;
        let mount = self.node.handle(NodeRequest::Mount {
            layers: record.layers.clone(),
            mountpoint: rootfs.clone(),
            upper: Some(upper),
            work: Some(work),
        });
        tokio::pin!(mount);
        let (mounted, _turn) = tokio::select! {
            r = &mut mount => (r, turn),
            () = tokio::time::sleep(TURN_KEPT_WHILE_MOUNTING) => {
                drop(turn);
                tracing::debug!("sandbox {}: its mount waits on the store; turn given back", sb.id);
                let r = mount.await;
                (r, self.composing.acquire().await.ok())
            }
        };
        mounted.map_err(Error::Node)?;
        let netns = match (&record.net, record.net_slot) {
            (Network::Allow(rules), Some(slot)) => {
                let (run_dir, id, rules) = (self.run_dir(), sb.id.clone(), rules.clone());
                let net = tokio::task::spawn_blocking(move || {
                    crate::net::setup(&run_dir, &id, slot, &rules)
                })
                .await
                .map_err(|e| Error::Runtime(format!("network task: {e}")))??;
                Some(net.netns)
            }
            _ => None,
        };
        let config = spec::build(&spec::SpecInput {
            id: &sb.id,
            rootfs: &rootfs,
            init: &self.init,
            env: &record.env,
            limits: &record.limits,
            etc_dir: &etc,
            secrets_dir: secrets_dir.as_deref(),
            netns: netns.as_deref(),
            cgroup_parent: &spec::cgroup_parent(self.config.node_name.as_deref()),
        })?;
        let bundle = dir.join("bundle");
        let bytes = serde_json::to_vec(&config).map_err(|e| Error::Spec(e.to_string()))?;
        let cfg = bundle.join("config.json");
        crate::bundle::write_file(cfg, bytes).await?;
        let ctl = crate::agent::bind_ctl(dir)
            .map_err(|e| Error::io(format!("bind {}", dir.join(crate::agent::CTL).display()), e))?;
        let pid = self
            .runtime
            .run_detached(&sb.id, &bundle, &dir.join("runc.log"), &ctl)
            .await?;
        // Only the init holds the socket now.
        drop(ctl);
        // The init has started nothing yet: what it starts inherits its class.
        crate::qos::apply(pid, record.limits.class, self.core_sched)
            .and_then(|()| match record.limits.class {
                crate::proto::CpuClass::Be => crate::qos::make_idle_group(pid),
                crate::proto::CpuClass::Ls => Ok(()),
            })
            .map_err(|e| Error::Runtime(format!("the CPU class of init {pid}: {e}")))?;
        Ok(pid)
    }

    /// Remove everything of sandbox `id` under `dir`: its processes and container, its root
    /// mount, its secrets, its upper and record. Each step tolerates what is already gone.
    async fn teardown(&self, id: &str, dir: &Path, net_slot: Option<u32>) -> Result<()> {
        // One runtime process to kill, one to delete: the init's end is watched in /proc
        // (the pid namespace dies with it), not by polling the runtime (a process each).
        let record = Record::parse(
            &std::fs::read(dir.join("sandbox.json")).unwrap_or_default(),
            id,
        );
        let pid = record.as_ref().and_then(|r| r.pid);
        // SIGKILL to the init ends its PID namespace, every process of the sandbox with it
        // (none can leave it: no setns, no CAP_SYS_ADMIN): no runtime process for that, when
        // the pid is still provably our init. Otherwise the runtime's kill.
        let ours = match (pid, record.as_ref().and_then(|r| r.init_start)) {
            (Some(p), Some(t)) => start_time(p) == Some(t),
            _ => false,
        };
        let killed = ours
            && pid
                .and_then(|p| rustix::process::Pid::from_raw(p as i32))
                .is_some_and(|p| {
                    rustix::process::kill_process(p, rustix::process::Signal::KILL).is_ok()
                });
        if !killed {
            self.runtime.kill_all(id, "KILL").await.ok();
        }
        for _ in 0..250 {
            let gone = match pid {
                Some(p) => pid_gone(p),
                None => !matches!(
                    self.runtime.state(id).await,
                    Ok(Some(ref s)) if s.status == "running" || s.status == "paused"
                ),
            };
            if gone {
                break;
            }
            tokio::time::sleep(Duration::from_millis(if pid.is_some() { 2 } else { 20 })).await;
        }
        self.runtime.delete(id).await?;
        if let Some(slot) = net_slot {
            let (run_dir, i) = (self.run_dir(), id.to_owned());
            tokio::task::spawn_blocking(move || crate::net::teardown(&run_dir, &i, slot))
                .await
                .map_err(|e| Error::Runtime(format!("network task: {e}")))??;
            self.slots
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&slot);
        }
        let rootfs = dir.join("bundle/rootfs");
        match self
            .node
            .handle(NodeRequest::Umount {
                mountpoint: rootfs.clone(),
            })
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind == ErrorKind::NotMounted => {}
            Err(e) => return Err(Error::Node(e)),
        }
        self.drop_pack_view(dir).await?;
        let secrets = dir.join("secrets");
        if secrets.exists() {
            let _ = rustix::mount::unmount(&secrets, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(u) = &self.uppers {
            u.remove(id)?;
        }
        let dir = dir.to_owned();
        tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("remove {}", dir.display()), e)),
        })
        .await
        .map_err(|e| Error::Runtime(format!("remove task: {e}")))?
    }

    /// Remove sandbox `id`; its info as it was.
    pub async fn remove(&self, id: &str) -> Result<SandboxInfo> {
        let sb = self.get(id)?;
        let _life = sb.lifecycle.lock().await;
        if !self
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(id)
        {
            return Err(Error::NotFound(format!("no sandbox {id} on this node")));
        }
        let info = sb.info();
        if matches!(info.state, SandboxState::Paused | SandboxState::Suspended) {
            // Thawed first, so that the kill reaches every process at once.
            let _ = self.runtime.resume(id).await;
        }
        sb.set(|r| r.state = SandboxState::Removing).await?;
        self.teardown(id, &sb.dir, sb.record().net_slot).await?;
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.pools.forget(id);
        Ok(info)
    }

    /// Freeze every process of sandbox `id` (memory and files kept, nothing runs; execs'
    /// timeouts still count). A paused sandbox takes no execs until `resume`.
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo> {
        let sb = self.get(id)?;
        let _life = sb.lifecycle.lock().await;
        self.check_running(&sb)?;
        self.runtime.pause(id).await?;
        sb.set(|r| r.state = SandboxState::Paused).await?;
        Ok(sb.info())
    }

    /// How this node keeps its sandboxes.
    pub fn config(&self) -> &ManagerConfig {
        &self.config
    }

    /// The storage node under the sandboxes (layers, cache).
    pub fn node(&self) -> &Arc<Node> {
        &self.node
    }

    /// What every id this node makes starts with: `<name>-` for a named node, else nothing.
    pub fn id_prefix(&self) -> String {
        self.config
            .node_name
            .as_ref()
            .map_or_else(String::new, |n| format!("{n}-"))
    }

    /// One sandbox, as `ls` shows it (a map lookup).
    pub fn info(&self, id: &str) -> Result<SandboxInfo> {
        Ok(self.get(id)?.info())
    }

    /// The sandboxes now (a snapshot: the table's lock is not held after).
    pub(crate) fn all(&self) -> Vec<Arc<Sandbox>> {
        self.sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Every sandbox, by id.
    pub fn list(&self) -> Vec<SandboxInfo> {
        let all = self.all();
        let mut v: Vec<SandboxInfo> = all.iter().map(|s| s.info()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// SSH host keys of its own for a sandbox whose stack has an SSH server but no host keys
    /// (`pack-diff` strips them: each sandbox of a packed layer makes its own), with the
    /// stack's `ssh-keygen -A`. Nothing for any other stack (three confined lookups). A
    /// failure is logged: the sandbox runs, its SSH server would not start.
    async fn new_host_keys(&self, sb: &Sandbox) {
        let root = sb.rootfs();
        let wants = crate::files::exists(&root, "/etc/ssh/sshd_config")
            && crate::files::exists(&root, "/usr/bin/ssh-keygen")
            && !["ed25519", "ecdsa", "rsa"]
                .iter()
                .any(|t| crate::files::exists(&root, &format!("/etc/ssh/ssh_host_{t}_key")));
        if !wants {
            return;
        }
        let req = ExecRequest {
            id: sb.id.clone(),
            args: vec!["/usr/bin/ssh-keygen".into(), "-A".into()],
            timeout_ms: Some(60_000),
            ..ExecRequest::default()
        };
        match self.exec(req).await {
            Ok(e) => {
                let r = e.wait().await;
                if r.exit_code != Some(0) {
                    tracing::warn!("sandbox {}: ssh-keygen -A: {r:?}", sb.id);
                }
            }
            Err(e) => tracing::warn!("sandbox {}: ssh-keygen -A: {e}", sb.id),
        }
    }

    /// Where sandbox `sb`'s upper directory is.
    pub(crate) fn upper_of(&self, sb: &Sandbox) -> PathBuf {
        match &self.uppers {
            Some(u) => u.root().join(&sb.id).join("upper"),
            None => sb.dir.join("upper"),
        }
    }

    /// One sandbox in detail.
    pub async fn inspect(&self, id: &str) -> Result<SandboxDetail> {
        let sb = self.get(id)?;
        let info = sb.info();
        let cgroups = info.pid.map(cgroup::of_pid).unwrap_or_default();
        let mem = cgroup::memory(&cgroups);
        let upper = self.upper_of(&sb);
        let upper_bytes = match &self.uppers {
            Some(u) => u.usage(&sb.id).unwrap_or(0),
            None => {
                let u = upper.clone();
                tokio::task::spawn_blocking(move || du(&u))
                    .await
                    .unwrap_or(0)
            }
        };
        let execs = sb
            .execs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|e| e.summary())
            .collect();
        Ok(SandboxDetail {
            rootfs: sb.rootfs(),
            upper,
            upper_bytes,
            pids: cgroup::pids(&cgroups),
            sched_policy: info.pid.and_then(crate::qos::policy).map(str::to_owned),
            cgroups,
            memory_anon: mem.anon,
            memory_file: mem.file,
            execs,
            idle_s: sb.idle().as_secs(),
            idle_timeout_s: sb.record().idle_timeout_s,
            info,
        })
    }

    /// Copy between the host and sandbox `req.id` (see [`files`]).
    pub async fn copy(&self, req: CopyRequest) -> Result<CopyResult> {
        let sb = self.get(&req.id)?;
        self.check_running(&sb)?;
        sb.touch();
        if !req.host.is_absolute() {
            return Err(Error::InvalidSpec(format!(
                "the host path {} must be absolute",
                req.host.display()
            )));
        }
        let max = req.max_bytes.unwrap_or(files::DEFAULT_MAX_COPY);
        let root = sb.view();
        let r = tokio::task::spawn_blocking(move || match req.direction {
            Direction::In => files::copy_in(&root, &req.host, &req.path, max),
            Direction::Out => files::copy_out(&root, &req.path, &req.host, max),
        })
        .await
        .map_err(|e| Error::Runtime(format!("copy task: {e}")))?;
        sb.touch();
        r
    }

    pub(crate) fn check_running(&self, sb: &Sandbox) -> Result<()> {
        match sb.record().state {
            SandboxState::Running => Ok(()),
            s => Err(Error::Conflict(format!(
                "sandbox {} is {}",
                sb.id,
                crate::proto::state_name(s)
            ))),
        }
    }

    /// Remove sandboxes idle past their timeout.
    async fn reap_idle(&self) {
        let all = self.all();
        for sb in all {
            let Some(t) = sb.record().idle_timeout_s else {
                continue;
            };
            if matches!(
                sb.record().state,
                SandboxState::Paused | SandboxState::Suspended
            ) {
                // Paused on purpose: it waits for its resume.
                continue;
            }
            if sb.running_execs.load(Ordering::SeqCst) == 0 && sb.idle() >= Duration::from_secs(t) {
                tracing::info!("sandbox {}: idle for {t} s, removing", sb.id);
                if let Err(e) = self.remove(&sb.id).await {
                    tracing::warn!("sandbox {}: idle removal: {e}", sb.id);
                }
            }
        }
    }
}

/// Process `pid`'s start time (clock ticks after boot), if it runs.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid …: comm may hold anything; starttime is the 22nd field, the
    // 20th after the closing parenthesis.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Whether process `pid` has ended (gone, or a zombie waiting for its parent).
pub(crate) fn pid_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X"),
    }
}

/// `uid[:gid]`, or a name of the sandbox's `/etc/passwd`.
fn resolve_user(rootfs: &Path, user: &str) -> Result<(u32, u32)> {
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    if let Ok(uid) = u.parse::<u32>() {
        let gid = match g {
            Some(g) => g
                .parse()
                .map_err(|_| Error::InvalidSpec(format!("bad gid in --user {user:?}")))?,
            None => uid,
        };
        return Ok((uid, gid));
    }
    let passwd = files::read_small(rootfs, "/etc/passwd", 4 << 20)?;
    for line in String::from_utf8_lossy(&passwd).lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() >= 4 && f[0] == u {
            let uid = f[2]
                .parse()
                .map_err(|_| Error::InvalidSpec(format!("/etc/passwd has a bad uid for {u:?}")))?;
            let gid = match g {
                Some(g) => g
                    .parse()
                    .map_err(|_| Error::InvalidSpec(format!("bad gid in --user {user:?}")))?,
                None => f[3].parse().map_err(|_| {
                    Error::InvalidSpec(format!("/etc/passwd has a bad gid for {u:?}"))
                })?,
            };
            return Ok((uid, gid));
        }
    }
    Err(Error::InvalidSpec(format!(
        "no user {u:?} in the sandbox's /etc/passwd"
    )))
}

/// Allocated bytes under `dir` (not following symlinks, not crossing mounts).
fn du(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            total += m.blocks() * 512;
            if m.is_dir() {
                todo.push(e.path());
            }
        }
    }
    total
}

/// What the extension answers an exec with: the stream of its lines.
pub(crate) fn exec_stream(
    exec: Result<Arc<Exec>>,
    detach: bool,
) -> tokio::sync::mpsc::Receiver<ResponseLine> {
    match exec {
        Ok(e) if detach => {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let _ = tx.try_send(ResponseLine::success(serde_json::json!({
                "exec": e.id, "sandbox": e.sandbox, "running": true
            })));
            rx
        }
        Ok(e) => e.follow([0, 0]),
        Err(e) => {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let _ = tx.try_send(ResponseLine::failure(e.into()));
            rx
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked() {
        for ok in ["a", "sb-01", "x_y", "0abc"] {
            assert!(valid_id(ok), "{ok}");
        }
        for bad in ["", "-a", "A", "a/b", "..", "a b", &"x".repeat(64)] {
            assert!(!valid_id(bad), "{bad}");
        }
        assert!(valid_id(&fresh_id("")));
        assert!(valid_id(&fresh_id("n1-")));
        assert!(valid_node_name("n1") && !valid_node_name("n-1") && !valid_node_name(""));
    }

    #[test]
    fn start_times_tell_a_process_from_a_reused_pid() {
        let me = std::process::id();
        let t = start_time(me).expect("our own start time");
        assert_eq!(start_time(me), Some(t));
        // A process started later has a later (or equal, within a tick) start time.
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let c = start_time(child.id()).unwrap();
        assert!(c >= t);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(start_time(child.id()), None);
        assert_eq!(start_time(u32::MAX), None);
    }

    #[test]
    fn users_resolve_from_the_sandboxes_passwd() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n",
        )
        .unwrap();
        assert_eq!(resolve_user(d.path(), "nobody").unwrap(), (65534, 65534));
        assert_eq!(resolve_user(d.path(), "1000:5").unwrap(), (1000, 5));
        assert_eq!(resolve_user(d.path(), "42").unwrap(), (42, 42));
        assert!(resolve_user(d.path(), "mallory").is_err());
    }
}
