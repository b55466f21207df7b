//! The API's state: its keys, the templates (name → layer stack), and its side of every
//! sandbox it created (template, access token, metadata, times), persisted in the state
//! directory so that a daemon restart keeps them. The reaper ends sandboxes at their end
//! time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use ublk_daemon::node::proto::{ApiError, ErrorKind, ResponseLine};
use ublk_daemon::node::server::Extension;

use crate::time::now_ms;
use crate::{Error, Result};

/// A template: the layer stack a sandbox of it is created on, and its limits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    /// First lowest (`KIND/NAME:VERSION`).
    pub layers: Vec<String>,
    /// CPUs (thousandths), memory (bytes) of each sandbox; `None`: the node's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// The template a create without one (the SDK's `base`) gets.
    #[serde(default)]
    pub default: bool,
    /// Ready sandboxes the runtime keeps of this template's stack (its warm pool): a create
    /// takes one when the template sets no limits and the create asks for no network.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pool: u32,
    /// The sandbox this template is a snapshot of (`crate::snapshot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_of: Option<String>,
    /// A fork's snapshot: not listed by `GET /snapshots`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hidden: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The node's templates, `<state dir>/templates.json`.
#[derive(Debug)]
pub struct Templates {
    path: PathBuf,
    map: Mutex<BTreeMap<String, Template>>,
}

fn valid_template_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-_./:".contains(&c))
}

impl Templates {
    pub fn open(state_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(state_dir)
            .map_err(|e| Error::io(format!("create {}", state_dir.display()), e))?;
        let path = state_dir.join("templates.json");
        let map = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                tracing::warn!("{}: unreadable ({e}); no templates", path.display());
                BTreeMap::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(Error::io(format!("read {}", path.display()), e)),
        };
        Ok(Self {
            path,
            map: Mutex::new(map),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Template>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn save(&self, map: &BTreeMap<String, Template>) -> Result<()> {
        let b = serde_json::to_vec_pretty(map).map_err(|e| Error::Runtime(e.to_string()))?;
        fs_cache::write_atomic(&self.path, &b)
            .map_err(|e| Error::io(format!("write {}", self.path.display()), e))
    }

    /// Add or replace a template (the default one, if `t.default`; the first one is the
    /// default too).
    /// The template and the pool size it had before (0: none).
    pub fn set(&self, t: Template) -> Result<Template> {
        self.set_with_previous(t).map(|(t, _)| t)
    }

    fn set_with_previous(&self, mut t: Template) -> Result<(Template, u32)> {
        if !valid_template_name(&t.name) {
            return Err(Error::BadRequest(format!(
                "bad template name {:?} (letters, digits, -_./:)",
                t.name
            )));
        }
        if t.layers.is_empty() {
            return Err(Error::BadRequest(
                "a template needs at least one layer".into(),
            ));
        }
        let mut map = self.lock();
        let previous_pool = map.get(&t.name).map_or(0, |o| o.pool);
        if map.values().all(|o| !o.default || o.name == t.name) && !t.default {
            t.default = map.get(&t.name).is_some_and(|o| o.default) || map.is_empty();
        }
        if t.default {
            for o in map.values_mut() {
                o.default = false;
            }
        }
        map.insert(t.name.clone(), t.clone());
        self.save(&map)?;
        Ok((t, previous_pool))
    }

    pub fn remove(&self, name: &str) -> Result<Template> {
        let mut map = self.lock();
        let t = map
            .remove(name)
            .ok_or_else(|| Error::NotFound(format!("no template {name}")))?;
        self.save(&map)?;
        Ok(t)
    }

    pub fn list(&self) -> Vec<Template> {
        self.lock().values().cloned().collect()
    }

    /// The template `name` names: itself, or for `base` (the SDK's default) the default one.
    pub fn resolve(&self, name: &str) -> Result<Template> {
        let map = self.lock();
        if let Some(t) = map.get(name) {
            return Ok(t.clone());
        }
        if name == "base" {
            if let Some(t) = map.values().find(|t| t.default) {
                return Ok(t.clone());
            }
        }
        Err(Error::NotFound(format!(
            "template '{name}' not found (strata template set {name} --layer …)"
        )))
    }
}

/// The API's side of one sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxMeta {
    pub template_id: String,
    /// The template's name as asked (an alias of the id here).
    pub alias: String,
    pub access_token: String,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    pub started_ms: u64,
    pub end_ms: u64,
    #[serde(default)]
    pub auto_pause: bool,
    /// Frozen by `pause` (or at its end with `auto_pause`).
    #[serde(default)]
    pub paused: bool,
    #[serde(default)]
    pub cpu_count: u32,
    #[serde(default)]
    pub memory_mb: u64,
}

/// One sandbox's meta and the lock that orders the writes of its file.
#[derive(Debug)]
struct Entry {
    meta: SandboxMeta,
    write: Arc<Mutex<()>>,
}

/// The API's state (see the module docs).
#[derive(Debug)]
pub struct Api {
    pub manager: Arc<sandbox_runtime::Manager>,
    pub templates: Arc<Templates>,
    keys: Vec<String>,
    /// `<state dir>/sandboxes/`: one `<id>.json` per sandbox.
    dir: PathBuf,
    sandboxes: Mutex<BTreeMap<String, Entry>>,
    pub procs: crate::process::Procs,
    pub watchers: crate::filesystem::Watchers,
    /// Creates received and not yet answered by the runtime, with what each reserves: the
    /// node's status counts those the runtime does not have yet (`crate::cluster`), so that
    /// a front sees every create it sent as soon as it arrives, queued or not.
    pub pending: Mutex<Pending>,
    /// The layers the storage node had registered when the status last asked it in time.
    pub last_layers: Mutex<Vec<String>>,
}

/// Creates received, not answered yet, and whence the creates came (one lock: a node's
/// status reads both at one instant).
#[derive(Debug, Default)]
pub struct Pending {
    pub creates: BTreeMap<String, crate::cluster::Amount>,
    /// Per front (its `x-strata-front`), the creates from it counted so far, the most
    /// recently seen front last.
    pub fronts: Vec<(String, u64)>,
}

impl Api {
    /// Open the state in `state_dir` with the API keys in `keys` (one a line; blank lines and
    /// `#` comments ignored); sandboxes the node no longer has are forgotten.
    pub fn open(
        manager: Arc<sandbox_runtime::Manager>,
        templates: Arc<Templates>,
        state_dir: &Path,
        keys: &Path,
    ) -> Result<Arc<Self>> {
        let key_list = read_keys(keys)?;
        let dir = state_dir.join("sandboxes");
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let live: std::collections::BTreeSet<String> =
            manager.list().into_iter().map(|s| s.id).collect();
        let mut sandboxes = BTreeMap::new();
        let entries =
            std::fs::read_dir(&dir).map_err(|e| Error::io(format!("read {}", dir.display()), e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".json") else {
                // A temporary file of a write that did not finish.
                let _ = std::fs::remove_file(e.path());
                continue;
            };
            let meta = std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<SandboxMeta>(&b).ok());
            match meta {
                Some(meta) if live.contains(id) => {
                    sandboxes.insert(
                        id.to_owned(),
                        Entry {
                            meta,
                            write: Default::default(),
                        },
                    );
                }
                _ => {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(Arc::new(Self {
            manager,
            templates,
            keys: key_list,
            dir,
            sandboxes: Mutex::new(sandboxes),
            procs: Default::default(),
            watchers: Default::default(),
            pending: Default::default(),
            last_layers: Default::default(),
        }))
    }

    /// Whether `key` is one of the API keys (compared in constant time).
    pub fn key_ok(&self, key: &str) -> bool {
        key_in(&self.keys, key)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Write sandbox `id`'s file with its meta as it is now. Writers of one sandbox take its
    /// lock in turn and each writes the latest meta, so the last rename holds the latest.
    fn persist(&self, id: &str) -> Result<()> {
        let Some(write) = self.lock().get(id).map(|e| e.write.clone()) else {
            return Ok(());
        };
        let _w = write.lock().unwrap_or_else(|p| p.into_inner());
        let Some(meta) = self.meta(id) else {
            return Ok(());
        };
        let b = serde_json::to_vec_pretty(&meta).map_err(|e| Error::Runtime(e.to_string()))?;
        let path = self.dir.join(format!("{id}.json"));
        fs_cache::write_atomic(&path, &b)
            .map_err(|e| Error::io(format!("write {}", path.display()), e))
    }

    /// The sandbox's init pid (host), while it runs.
    pub fn init_pid(&self, id: &str) -> Result<u32> {
        let info = self
            .manager
            .info(id)
            .map_err(|_| Error::NotFound(format!("sandbox {id} was not found")))?;
        match (info.state, info.pid) {
            (sandbox_runtime::proto::SandboxState::Running, Some(pid)) => Ok(pid),
            _ => Err(Error::Conflict(format!("sandbox {id} is not running"))),
        }
    }

    /// The sandbox's root as its processes see it (`/proc/<init>/root`).
    pub fn view(&self, id: &str) -> Result<PathBuf> {
        Ok(PathBuf::from(format!("/proc/{}/root", self.init_pid(id)?)))
    }

    pub fn meta(&self, id: &str) -> Option<SandboxMeta> {
        self.lock().get(id).map(|e| e.meta.clone())
    }

    pub fn all_meta(&self) -> BTreeMap<String, SandboxMeta> {
        self.lock()
            .iter()
            .map(|(id, e)| (id.clone(), e.meta.clone()))
            .collect()
    }

    /// Know sandbox `id` (in memory: its first `update_meta` writes it).
    pub fn remember(&self, id: &str, meta: SandboxMeta) {
        self.lock().insert(
            id.to_owned(),
            Entry {
                meta,
                write: Default::default(),
            },
        );
    }

    /// Change a sandbox's meta; `NotFound` if the API does not know it.
    pub fn update_meta(&self, id: &str, f: impl FnOnce(&mut SandboxMeta)) -> Result<SandboxMeta> {
        let m = {
            let mut all = self.lock();
            let e = all
                .get_mut(id)
                .ok_or_else(|| Error::NotFound(format!("sandbox {id} was not found")))?;
            f(&mut e.meta);
            e.meta.clone()
        };
        // A synced write: not on an async worker, which every request of the node shares.
        off_worker(|| self.persist(id))?;
        Ok(m)
    }

    pub fn forget(&self, id: &str) {
        let entry = self.lock().remove(id);
        self.procs.forget(id);
        self.watchers.forget(id);
        if let Some(e) = entry {
            let _w = e.write.lock().unwrap_or_else(|p| p.into_inner());
            match std::fs::remove_file(self.dir.join(format!("{id}.json"))) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!("e2b api: forgetting sandbox {id}: {e}"),
            }
        }
    }

    /// Remove a sandbox: the runtime's and the API's sides.
    pub async fn kill(&self, id: &str) -> Result<()> {
        let known = self.meta(id).is_some();
        let r = self.manager.remove(id).await;
        self.forget(id);
        match r {
            Ok(_) => Ok(()),
            Err(sandbox_runtime::Error::NotFound(m)) if !known => Err(Error::NotFound(m)),
            Err(sandbox_runtime::Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// End sandboxes past their end time, every second, while the API lives.
    pub fn start_reaper(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let Some(api) = weak.upgrade() else { return };
                let now = now_ms();
                let due: Vec<(String, SandboxMeta)> = api
                    .all_meta()
                    .into_iter()
                    .filter(|(_, m)| m.end_ms <= now && !m.paused)
                    .collect();
                for (id, m) in due {
                    if m.auto_pause {
                        match crate::control::pause_sandbox(&api, &id).await {
                            Ok(()) => {
                                tracing::info!("sandbox {id}: timeout reached, paused");
                                continue;
                            }
                            Err(e) => {
                                tracing::warn!("sandbox {id}: auto-pause failed ({e}); removing")
                            }
                        }
                    }
                    tracing::info!("sandbox {id}: timeout reached, removing");
                    if let Err(e) = api.kill(&id).await {
                        tracing::warn!("sandbox {id}: removal at its timeout: {e}");
                    }
                }
                // Sandboxes removed behind the API's back (`strata sandbox rm`).
                // Not those being created: the API knows them before the runtime does. The
                // records first, the pending creates second, the runtime's list last: a
                // create records its sandbox after marking it pending and ends pending once
                // the runtime lists it, so a recorded sandbox is in one of the two later reads.
                // (Records read last once removed a create that started between the reads.)
                let known: Vec<String> = api.all_meta().into_keys().collect();
                let pending = api
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .creates
                    .clone();
                let live: std::collections::BTreeSet<String> =
                    api.manager.list().into_iter().map(|s| s.id).collect();
                let gone: Vec<String> = known
                    .into_iter()
                    .filter(|id| !live.contains(id) && !pending.contains_key(id))
                    .collect();
                for id in gone {
                    api.forget(&id);
                }
            }
        });
    }
}

/// The API keys in `path`: one a line, blank lines and `#` comments ignored; none is an
/// error.
pub fn read_keys(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("read the API keys {}", path.display()), e))?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if keys.is_empty() {
        return Err(Error::BadRequest(format!(
            "{} holds no API key",
            path.display()
        )));
    }
    Ok(keys)
}

/// Whether `key` is one of `keys` (compared in constant time).
pub(crate) fn key_in(keys: &[String], key: &str) -> bool {
    keys.iter().any(|k| ct_eq(k.as_bytes(), key.as_bytes()))
}

/// Equality that takes the same time wherever the inputs differ.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Random lowercase letters and digits (from the kernel's CSPRNG).
pub fn random_token(len: usize) -> String {
    use std::io::Read;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(len);
    let mut f = std::fs::File::open("/dev/urandom").ok();
    while out.len() < len {
        let mut raw = [0u8; 64];
        match f.as_mut().map(|f| f.read_exact(&mut raw)) {
            Some(Ok(())) => {}
            // No /dev/urandom: the clock and the pid (ids stay unique, tokens weaker).
            _ => {
                let seed = crate::time::now_ms() ^ (u64::from(std::process::id()) << 40);
                for (i, b) in raw.iter_mut().enumerate() {
                    *b = (seed.rotate_left(i as u32 * 7) ^ (i as u64 * 0x9e37_79b9)) as u8;
                }
            }
        }
        // 252 = 7 * 36: bytes below it map without bias; the rest are dropped.
        for b in raw {
            if b < 252 && out.len() < len {
                out.push(ALPHABET[(b % 36) as usize] as char);
            }
        }
    }
    out
}

/// The template operations on the node's socket (`template_set`, `template_ls`,
/// `template_rm`), in front of the sandbox extension.
pub struct TemplateExtension {
    pub templates: Arc<Templates>,
    pub inner: Arc<dyn Extension>,
}

impl std::fmt::Debug for TemplateExtension {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TemplateExtension")
            .field("templates", &self.templates)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
#[serde(tag = "op")]
enum TemplateRequest {
    #[serde(rename = "template_set")]
    Set {
        #[serde(flatten)]
        template: Template,
    },
    #[serde(rename = "template_ls")]
    Ls {},
    #[serde(rename = "template_rm")]
    Rm { name: String },
}

impl TemplateExtension {
    /// `template_set`: the template, then its stack's warm pool (`sandbox_pool_set` of the
    /// sandbox extension) when it has one or had one.
    fn set_with_pool(
        &self,
        template: Template,
        v: Option<serde_json::Value>,
    ) -> mpsc::Receiver<ResponseLine> {
        let (tx, rx) = mpsc::channel(1);
        let (t, previous) = match self.templates.set_with_previous(template) {
            Ok(x) => x,
            Err(e) => {
                let _ = tx.try_send(ResponseLine::failure(ApiError::new(
                    ErrorKind::BadRequest,
                    e.to_string(),
                )));
                return rx;
            }
        };
        let answer = serde_json::to_value(&t).unwrap_or_default();
        if t.pool == 0 && previous == 0 {
            let _ = tx.try_send(ResponseLine::success(answer));
            return rx;
        }
        let mut pool = serde_json::json!({
            "op": "sandbox_pool_set",
            "stack": t.layers.join(","),
            "size": t.pool,
        });
        if let Some(v) = v {
            pool["v"] = v;
        }
        let mut lines = self.inner.handle(pool);
        tokio::spawn(async move {
            let mut last = None;
            while let Some(l) = lines.recv().await {
                last = Some(l);
            }
            let line = match last {
                Some(l) if l.ok => ResponseLine::success(answer),
                Some(l) => l,
                None => ResponseLine::failure(ApiError::new(
                    ErrorKind::Internal,
                    "the pool of the template's stack: no answer",
                )),
            };
            let _ = tx.send(line).await;
        });
        rx
    }
}

impl Extension for TemplateExtension {
    fn claims(&self, op: &str) -> bool {
        op.starts_with("template_") || self.inner.claims(op)
    }

    fn handle(&self, request: serde_json::Value) -> mpsc::Receiver<ResponseLine> {
        let is_template = request
            .get("op")
            .and_then(|o| o.as_str())
            .is_some_and(|o| o.starts_with("template_"));
        if !is_template {
            return self.inner.handle(request);
        }
        let mut request = request;
        let v = request.get("v").cloned();
        if let Some(o) = request.as_object_mut() {
            o.remove("v");
        }
        if let Ok(TemplateRequest::Set { template }) =
            serde_json::from_value::<TemplateRequest>(request.clone())
        {
            return self.set_with_pool(template, v);
        }
        let to_api = |e: Error| match e {
            Error::NotFound(m) | Error::BadRequest(m) => ApiError::new(ErrorKind::BadRequest, m),
            e => ApiError::new(ErrorKind::Internal, e.to_string()),
        };
        let answer: std::result::Result<serde_json::Value, ApiError> =
            match serde_json::from_value::<TemplateRequest>(request) {
                Err(e) => Err(ApiError::new(
                    ErrorKind::BadRequest,
                    format!("bad request: {e}"),
                )),
                Ok(TemplateRequest::Set { template }) => self
                    .templates
                    .set(template)
                    .map(|t| serde_json::to_value(t).unwrap_or_default())
                    .map_err(to_api),
                Ok(TemplateRequest::Ls {}) => {
                    Ok(serde_json::to_value(self.templates.list()).unwrap_or_default())
                }
                Ok(TemplateRequest::Rm { name }) => self
                    .templates
                    .remove(&name)
                    .map(|t| serde_json::to_value(t).unwrap_or_default())
                    .map_err(to_api),
            };
        let (tx, rx) = mpsc::channel(1);
        let _ = tx.try_send(match answer {
            Ok(v) => ResponseLine::success(v),
            Err(e) => ResponseLine::failure(e),
        });
        rx
    }

    fn keeps_mounts(&self) -> bool {
        self.inner.keeps_mounts()
    }
}

/// Run `f` (file system calls that wait for the disk: a synced write) without holding up an
/// async worker: on a multi-threaded runtime the worker's other tasks move to another thread
/// meanwhile (`block_in_place`); elsewhere (a current-thread runtime, a blocking thread, no
/// runtime) it runs as is.
pub(crate) fn off_worker<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_persist_and_the_first_is_the_default() {
        let d = tempfile::tempdir().unwrap();
        let t = Templates::open(d.path()).unwrap();
        let mk = |name: &str, default| Template {
            name: name.into(),
            layers: vec!["base/debian:12".into()],
            default,
            ..Default::default()
        };
        assert!(t.set(mk("py", false)).unwrap().default);
        assert!(!t.set(mk("node", false)).unwrap().default);
        assert_eq!(t.resolve("base").unwrap().name, "py");
        t.set(mk("node", true)).unwrap();
        let again = Templates::open(d.path()).unwrap();
        assert_eq!(again.resolve("base").unwrap().name, "node");
        assert!(!again.resolve("py").unwrap().default);
        assert!(again.resolve("nope").is_err());
        assert!(again.set(mk("bad name", false)).is_err());
        again.remove("node").unwrap();
        assert!(again.resolve("base").is_err());
    }

    #[test]
    fn tokens_are_random_and_of_the_alphabet() {
        let a = random_token(32);
        assert_eq!(a.len(), 32);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        assert_ne!(a, random_token(32));
        assert!(ct_eq(b"abc", b"abc") && !ct_eq(b"abc", b"abd") && !ct_eq(b"a", b"ab"));
    }
}
