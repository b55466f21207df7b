//! Warm pools (the FnCall backend): `pool set STACK --size N` keeps N sandboxes of a stack
//! created and idle; `run STACK -- CMD` takes one, runs the command, and removes the sandbox
//! after; the pool is refilled in the background.
//!
//! The wanted sizes are kept in `<dir>/pools.json`; the ready sandboxes are ordinary
//! sandboxes whose record names their pool, so a restarted daemon finds them again.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::manager::Manager;
use crate::proto::{parse_stack, CreateRequest, ExecRequest, PoolInfo, SandboxInfo, SandboxState};
use crate::{Error, Result};

/// Sandboxes one pool creates at a time.
const CREATING_PER_POOL: u32 = 4;

/// The largest pool.
pub const MAX_POOL: u32 = 1024;

#[derive(Default)]
struct Inner {
    wanted: BTreeMap<String, u32>,
    ready: HashMap<String, VecDeque<String>>,
    creating: HashMap<String, u32>,
}

pub(crate) struct Pools {
    path: PathBuf,
    inner: Mutex<Inner>,
}

impl Pools {
    pub fn load(dir: &Path) -> Self {
        let path = dir.join("pools.json");
        let wanted = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        Self {
            path,
            inner: Mutex::new(Inner {
                wanted,
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Count the running sandboxes that belong to pools as ready.
    pub fn adopt(&self, m: &Manager) {
        let mut inner = self.lock();
        for s in m.list() {
            if let (Some(p), SandboxState::Running) = (s.pool, s.state) {
                inner.ready.entry(p).or_default().push_back(s.id);
            }
        }
    }

    /// Forget sandbox `id` (it was removed).
    pub fn forget(&self, id: &str) {
        for q in self.lock().ready.values_mut() {
            q.retain(|x| x != id);
        }
    }

    fn take(&self, stack: &str) -> Option<String> {
        self.lock().ready.get_mut(stack)?.pop_front()
    }

    /// A ready sandbox of a pool whose stack is `layers`.
    fn take_layers(&self, layers: &[String]) -> Option<String> {
        let mut inner = self.lock();
        inner
            .ready
            .iter_mut()
            .filter(|(stack, _)| parse_stack(stack) == layers)
            .find_map(|(_, q)| q.pop_front())
    }

    pub fn list(&self) -> Vec<PoolInfo> {
        let inner = self.lock();
        inner
            .wanted
            .iter()
            .map(|(stack, size)| PoolInfo {
                stack: stack.clone(),
                size: *size,
                ready: inner.ready.get(stack).map_or(0, |q| q.len() as u32),
            })
            .collect()
    }

    /// Start creating what each pool lacks (at most [`CREATING_PER_POOL`] at a time).
    pub fn refill(&self, m: &Arc<Manager>) {
        let mut starts = Vec::new();
        {
            let mut inner = self.lock();
            let wanted: Vec<(String, u32)> =
                inner.wanted.iter().map(|(k, v)| (k.clone(), *v)).collect();
            for (stack, size) in wanted {
                let ready = inner.ready.get(&stack).map_or(0, |q| q.len() as u32);
                let creating = inner.creating.entry(stack.clone()).or_default();
                let lacking = size.saturating_sub(ready + *creating);
                let n = lacking.min(CREATING_PER_POOL.saturating_sub(*creating));
                *creating += n;
                for _ in 0..n {
                    starts.push(stack.clone());
                }
            }
        }
        for stack in starts {
            let m = m.clone();
            tokio::spawn(async move {
                let req = CreateRequest {
                    layers: parse_stack(&stack),
                    ..CreateRequest::default()
                };
                let r = m.create_in_pool(req, Some(stack.clone())).await;
                let mut inner = m.pools.lock();
                if let Some(c) = inner.creating.get_mut(&stack) {
                    *c = c.saturating_sub(1);
                }
                match r {
                    Ok(info) => inner.ready.entry(stack).or_default().push_back(info.id),
                    // Retried on the next tick; a stack that cannot be created says so in
                    // the log once a second, not in a busy loop.
                    Err(e) => tracing::warn!("pool {stack}: creating a sandbox: {e}"),
                }
            });
        }
    }

    /// Set a pool's size (0 removes it); surplus ready sandboxes are removed.
    pub fn set(&self, m: &Arc<Manager>, stack: &str, size: u32) -> Result<PoolInfo> {
        if parse_stack(stack).is_empty() {
            return Err(Error::InvalidSpec(
                "a pool needs a stack (REF[,REF…])".into(),
            ));
        }
        if size > MAX_POOL {
            return Err(Error::Limit(format!(
                "a pool holds at most {MAX_POOL} sandboxes"
            )));
        }
        let (surplus, bytes) = {
            let mut inner = self.lock();
            if size == 0 {
                inner.wanted.remove(stack);
            } else {
                inner.wanted.insert(stack.to_owned(), size);
            }
            let q = inner.ready.entry(stack.to_owned()).or_default();
            let mut surplus = Vec::new();
            while q.len() as u32 > size {
                surplus.extend(q.pop_back());
            }
            (
                surplus,
                serde_json::to_vec_pretty(&inner.wanted).unwrap_or_default(),
            )
        };
        fs_cache::write_atomic(&self.path, &bytes)
            .map_err(|e| Error::io(format!("write {}", self.path.display()), e))?;
        for id in surplus {
            let m = m.clone();
            tokio::spawn(async move {
                let _ = m.remove(&id).await;
            });
        }
        self.refill(m);
        Ok(self
            .list()
            .into_iter()
            .find(|p| p.stack == stack)
            .unwrap_or(PoolInfo {
                stack: stack.to_owned(),
                size,
                ready: 0,
            }))
    }
}

/// The longest a pool's refill waits for the taken sandbox's first output.
const REFILL_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

impl Manager {
    /// Run `req` in a sandbox of `stack` taken from its pool (created on the spot when the
    /// pool is empty or there is none); the sandbox is removed when the command ends.
    pub async fn run(
        self: &Arc<Self>,
        stack: &str,
        mut req: ExecRequest,
    ) -> Result<Arc<crate::exec::Exec>> {
        let id = match self.pools.take(stack) {
            Some(id) => id,
            None => {
                let layers = parse_stack(stack);
                self.create(CreateRequest {
                    layers,
                    ..CreateRequest::default()
                })
                .await?
                .id
            }
        };
        req.id = id.clone();
        let exec = match self.exec(req).await {
            Ok(e) => e,
            Err(e) => {
                self.pools.refill(self);
                let _ = self.remove(&id).await;
                return Err(e);
            }
        };
        // The replacement's runtime start costs tens of ms of CPU: begin it once the taken
        // sandbox's command has answered (or after REFILL_AFTER), not in its way.
        let (m, e) = (self.clone(), exec.clone());
        tokio::spawn(async move {
            e.first_activity(REFILL_AFTER).await;
            m.pools.refill(&m);
        });
        let (m, e) = (self.clone(), exec.clone());
        tokio::spawn(async move {
            e.wait().await;
            if let Err(err) = m.remove(&id).await {
                tracing::warn!("sandbox {id}: removing after run: {err}");
            }
        });
        Ok(exec)
    }

    /// `sandbox_create`: a pooled sandbox when the request asks for one and for nothing a
    /// pooled one lacks (`CreateRequest::pooled`), else a new one.
    pub async fn create_or_take(self: &Arc<Self>, req: CreateRequest) -> Result<SandboxInfo> {
        let plain = CreateRequest {
            layers: req.layers.clone(),
            pooled: true,
            ..CreateRequest::default()
        };
        if req.pooled && req == plain {
            while let Some(id) = self.pools.take_layers(&req.layers) {
                // Removed meanwhile (an idle timeout, an rm by id): the next one.
                let Ok(sb) = self.get(&id) else { continue };
                if sb.set(|r| r.pool = None).await.is_err() {
                    continue;
                }
                sb.touch();
                let m = self.clone();
                tokio::spawn(async move {
                    // Out of the way of the caller's first command.
                    tokio::time::sleep(REFILL_AFTER).await;
                    m.pools.refill(&m);
                });
                return Ok(sb.info());
            }
        }
        self.create(req).await
    }

    /// `pool set`.
    pub fn set_pool(self: &Arc<Self>, stack: &str, size: u32) -> Result<PoolInfo> {
        self.pools.set(self, stack, size)
    }

    /// `pool ls`.
    pub fn pools(&self) -> Vec<PoolInfo> {
        self.pools.list()
    }
}
