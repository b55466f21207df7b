//! `filesystem.Filesystem`: Stat, MakeDir, Move, ListDir, Remove (unary), WatchDir (a server
//! stream) and the polling trio CreateWatcher / GetWatcherEvents / RemoveWatcher. Paths are
//! resolved in the sandbox's root (`fs.rs`); relative ones under the user's home.
//!
//! Watches are inotify watches on directories opened confined in the sandbox's root (the
//! watch is added through `/proc/self/fd/N` of that descriptor, so the kernel never resolves
//! a sandbox path itself). A recursive watch adds every directory below, and new ones as
//! they appear. Event names are relative to the watched directory.

use std::collections::{HashMap, VecDeque};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use rustix::fs::inotify;
use serde::Deserialize;
use serde_json::json;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::connect::{self, Code, RpcError, RpcResult};
use crate::envd::{request_message, Ctx};
use crate::fs::{absolute, Root};
use crate::http::Response;
use crate::state::random_token;
use crate::Error;

/// Events a polled watcher keeps between two `GetWatcherEvents` (older ones are dropped).
const MAX_PENDING: usize = 10_000;
/// Directories one recursive watch covers at most.
const MAX_WATCHED_DIRS: usize = 8192;
/// Watchers per sandbox.
const MAX_WATCHERS: usize = 64;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
    #[serde(default)]
    recursive: bool,
    /// Watches: each event carries the entry's info (when it still exists).
    #[serde(default)]
    include_entry: bool,
    /// Watches on network mounts: accepted (a sandbox has none; its mounts are all local).
    #[serde(default)]
    allow_network_mounts: bool,
}

#[derive(Debug, Default, Deserialize)]
struct MoveRequest {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherRequest {
    #[serde(default)]
    watcher_id: String,
}

fn unary(r: RpcResult<serde_json::Value>) -> Response {
    match r {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => connect::unary_error(&e),
    }
}

fn not_found(e: Error, abs: &str) -> RpcError {
    match &e {
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            RpcError::new(Code::NotFound, format!("path '{abs}' does not exist"))
        }
        _ => RpcError::from(e),
    }
}

/// Serve `filesystem.Filesystem/<method>`.
pub async fn handle(
    ctx: Ctx,
    method: &str,
    parts: &http::request::Parts,
    body: Incoming,
) -> Response {
    match method {
        "Stat" | "ListDir" | "MakeDir" | "Remove" => {
            let req = match request_message::<PathRequest>(parts, body).await {
                Ok(r) => r,
                Err(e) => return connect::unary_error(&e),
            };
            let m = method.to_owned();
            unary(blocking(move || path_op(&ctx, &m, req)).await)
        }
        "Move" => {
            let req = match request_message::<MoveRequest>(parts, body).await {
                Ok(r) => r,
                Err(e) => return connect::unary_error(&e),
            };
            unary(blocking(move || move_op(&ctx, req)).await)
        }
        "WatchDir" => match request_message::<PathRequest>(parts, body).await {
            Ok(r) => watch_dir(ctx, r).await,
            Err(e) => connect::stream_error(e),
        },
        "CreateWatcher" => match request_message::<PathRequest>(parts, body).await {
            Ok(r) => unary(create_watcher(&ctx, r).await),
            Err(e) => connect::unary_error(&e),
        },
        "GetWatcherEvents" => match request_message::<WatcherRequest>(parts, body).await {
            Ok(r) => unary(ctx.api.watchers.drain(&ctx.id, &r.watcher_id)),
            Err(e) => connect::unary_error(&e),
        },
        "RemoveWatcher" => match request_message::<WatcherRequest>(parts, body).await {
            Ok(r) => unary(ctx.api.watchers.remove(&ctx.id, &r.watcher_id)),
            Err(e) => connect::unary_error(&e),
        },
        other => connect::unary_error(&RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other}: no such procedure"),
        )),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> RpcResult<T> + Send + 'static,
) -> RpcResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RpcError::new(Code::Internal, format!("filesystem task: {e}")))?
}

fn path_op(ctx: &Ctx, method: &str, req: PathRequest) -> RpcResult<serde_json::Value> {
    let root = ctx.root().map_err(RpcError::from)?;
    let (user, names) = ctx.user(&root).map_err(RpcError::from)?;
    let abs = absolute(&req.path, &user.home).map_err(RpcError::from)?;
    match method {
        "Stat" => {
            let e = root.stat(&abs, &names).map_err(|e| not_found(e, &abs))?;
            Ok(json!({ "entry": e }))
        }
        "ListDir" => {
            let depth = req.depth.unwrap_or(1).max(1);
            let entries = root
                .list(&abs, depth, &names)
                .map_err(|e| not_found(e, &abs))?;
            Ok(json!({ "entries": entries }))
        }
        "MakeDir" => match root.make_dir(&abs, &user) {
            Ok(_) => {
                let e = root.stat(&abs, &names).map_err(RpcError::from)?;
                Ok(json!({ "entry": e }))
            }
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(RpcError::new(
                    Code::AlreadyExists,
                    format!("directory '{abs}' already exists"),
                ))
            }
            Err(e) => Err(RpcError::from(e)),
        },
        _ => {
            root.remove(&abs).map_err(|e| not_found(e, &abs))?;
            Ok(json!({}))
        }
    }
}

fn move_op(ctx: &Ctx, req: MoveRequest) -> RpcResult<serde_json::Value> {
    let root = ctx.root().map_err(RpcError::from)?;
    let (user, names) = ctx.user(&root).map_err(RpcError::from)?;
    let from = absolute(&req.source, &user.home).map_err(RpcError::from)?;
    let to = absolute(&req.destination, &user.home).map_err(RpcError::from)?;
    root.rename(&from, &to, &user)
        .map_err(|e| not_found(e, &from))?;
    let e = root.stat(&to, &names).map_err(RpcError::from)?;
    Ok(json!({ "entry": e }))
}

/// One filesystem event, as `FilesystemEvent` in JSON.
fn event_json(name: &str, kind: &str) -> serde_json::Value {
    json!({ "name": name, "type": kind })
}

fn event_kind(flags: inotify::ReadFlags) -> Option<&'static str> {
    use inotify::ReadFlags as F;
    if flags.intersects(F::CREATE | F::MOVED_TO) {
        Some("EVENT_TYPE_CREATE")
    } else if flags.intersects(F::MODIFY | F::CLOSE_WRITE) {
        Some("EVENT_TYPE_WRITE")
    } else if flags.intersects(F::DELETE | F::DELETE_SELF) {
        Some("EVENT_TYPE_REMOVE")
    } else if flags.intersects(F::MOVED_FROM | F::MOVE_SELF) {
        Some("EVENT_TYPE_RENAME")
    } else if flags.contains(F::ATTRIB) {
        Some("EVENT_TYPE_CHMOD")
    } else {
        None
    }
}

/// An inotify instance over a directory of a sandbox (and, recursively, those below).
struct Watch {
    root: Root,
    fd: AsyncFd<OwnedFd>,
    /// Watch descriptor → the directory's path relative to the watched one (`""`: itself).
    dirs: HashMap<i32, String>,
    base: String,
    recursive: bool,
    include_entry: bool,
}

const WATCH_FLAGS: inotify::WatchFlags = inotify::WatchFlags::CREATE
    .union(inotify::WatchFlags::MODIFY)
    .union(inotify::WatchFlags::CLOSE_WRITE)
    .union(inotify::WatchFlags::DELETE)
    .union(inotify::WatchFlags::DELETE_SELF)
    .union(inotify::WatchFlags::MOVED_FROM)
    .union(inotify::WatchFlags::MOVED_TO)
    .union(inotify::WatchFlags::MOVE_SELF)
    .union(inotify::WatchFlags::ATTRIB)
    // Not DONT_FOLLOW: the path is `/proc/self/fd/N`, a magic link to the directory opened
    // confined; following it is the point.
    .union(inotify::WatchFlags::ONLYDIR);

impl Watch {
    fn new(root: Root, base: String, recursive: bool, include_entry: bool) -> crate::Result<Watch> {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
            .map_err(|e| Error::io("inotify_init", e.into()))?;
        // SAFETY: `fd` is an `OwnedFd` moved into the `AsyncFd`: it stays open, and its
        // `as_raw_fd` stays the same, until the `AsyncFd` is dropped. Called from the
        // handlers, on the runtime (its reactor is there).
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| {
            Error::io(
                "inotify on the reactor",
                std::io::Error::other(e.to_string()),
            )
        })?;
        let mut w = Watch {
            root,
            fd,
            dirs: HashMap::new(),
            base,
            recursive,
            include_entry,
        };
        w.add("")?;
        Ok(w)
    }

    fn abs(&self, rel: &str) -> String {
        match (self.base.as_str(), rel) {
            (b, "") => b.to_owned(),
            ("/", r) => format!("/{r}"),
            (b, r) => format!("{b}/{r}"),
        }
    }

    /// Watch directory `rel` (and below it, if recursive).
    fn add(&mut self, rel: &str) -> crate::Result<()> {
        let mut todo = vec![rel.to_owned()];
        while let Some(rel) = todo.pop() {
            if self.dirs.len() >= MAX_WATCHED_DIRS {
                return Err(Error::Limit(format!(
                    "a watch covers at most {MAX_WATCHED_DIRS} directories"
                )));
            }
            let abs = self.abs(&rel);
            let dir: OwnedFd = self.root.open_dir(&abs)?;
            let wd = inotify::add_watch(
                self.fd.get_ref(),
                format!("/proc/self/fd/{}", dir.as_raw_fd()),
                WATCH_FLAGS,
            )
            .map_err(|e| Error::io(format!("watch {abs}"), e.into()))?;
            self.dirs.insert(wd, rel.clone());
            if self.recursive {
                for e in rustix::fs::Dir::read_from(dir.as_fd())
                    .map_err(|e| Error::io(abs.clone(), e.into()))?
                {
                    let Ok(e) = e else { continue };
                    let n = e.file_name().to_string_lossy().into_owned();
                    if n == "." || n == ".." || e.file_type() != rustix::fs::FileType::Directory {
                        continue;
                    }
                    todo.push(if rel.is_empty() {
                        n
                    } else {
                        format!("{rel}/{n}")
                    });
                }
            }
        }
        Ok(())
    }

    /// Wait for events; the next batch, or `None` when the watched directory is gone.
    async fn next(&mut self) -> Option<Vec<serde_json::Value>> {
        loop {
            let mut guard = self.fd.readable().await.ok()?;
            let mut out = Vec::new();
            let mut new_dirs = Vec::new();
            let mut gone = false;
            {
                let mut buf = [MaybeUninit::<u8>::uninit(); 8192];
                let mut reader = inotify::Reader::new(self.fd.get_ref(), &mut buf);
                loop {
                    match reader.next() {
                        Ok(ev) => {
                            let flags = ev.events();
                            let Some(dir) = self.dirs.get(&ev.wd()).cloned() else {
                                continue;
                            };
                            if flags.contains(inotify::ReadFlags::IGNORED) {
                                self.dirs.remove(&ev.wd());
                                gone |= dir.is_empty();
                                continue;
                            }
                            let name = ev
                                .file_name()
                                .map(|n| n.to_string_lossy().into_owned())
                                .unwrap_or_default();
                            // The watched directory itself: reported once, by its parent's
                            // watch if there is one.
                            if name.is_empty() && !dir.is_empty() {
                                continue;
                            }
                            let rel = match (dir.as_str(), name.as_str()) {
                                ("", n) => n.to_owned(),
                                (d, "") => d.to_owned(),
                                (d, n) => format!("{d}/{n}"),
                            };
                            if self.recursive
                                && flags.contains(inotify::ReadFlags::ISDIR)
                                && flags.intersects(
                                    inotify::ReadFlags::CREATE | inotify::ReadFlags::MOVED_TO,
                                )
                            {
                                new_dirs.push(rel.clone());
                            }
                            if let Some(kind) = event_kind(flags) {
                                out.push((rel, kind));
                            }
                        }
                        Err(rustix::io::Errno::WOULDBLOCK) => {
                            guard.clear_ready();
                            break;
                        }
                        Err(rustix::io::Errno::INTR) => continue,
                        Err(_) => return None,
                    }
                }
            }
            for d in new_dirs {
                if let Err(e) = self.add(&d) {
                    tracing::debug!("watch {}: {e}", self.abs(&d));
                }
            }
            if !out.is_empty() {
                let names = self.include_entry.then(|| self.root.names());
                return Some(
                    out.into_iter()
                        .map(|(rel, kind)| {
                            let mut e = event_json(&rel, kind);
                            if let Some(names) = &names {
                                if kind != "EVENT_TYPE_REMOVE" {
                                    if let Ok(info) = self.root.stat(&self.abs(&rel), names) {
                                        e["entry"] = json!(info);
                                    }
                                }
                            }
                            e
                        })
                        .collect(),
                );
            }
            if gone {
                return None;
            }
        }
    }
}

fn open_watch(ctx: &Ctx, req: &PathRequest) -> RpcResult<Watch> {
    let root = ctx.root().map_err(RpcError::from)?;
    let (user, _) = ctx.user(&root).map_err(RpcError::from)?;
    let abs = absolute(&req.path, &user.home).map_err(RpcError::from)?;
    let _ = req.allow_network_mounts;
    Watch::new(root, abs.clone(), req.recursive, req.include_entry).map_err(|e| not_found(e, &abs))
}

async fn watch_dir(ctx: Ctx, req: PathRequest) -> Response {
    let mut w = match open_watch(&ctx, &req) {
        Ok(w) => w,
        Err(e) => return connect::stream_error(e),
    };
    let (tx, resp) = connect::stream_response();
    let keepalive = std::time::Duration::from_secs(ctx.keepalive_s.unwrap_or(50).clamp(1, 3600));
    tokio::spawn(async move {
        if !tx.send(&json!({ "start": {} })).await {
            return;
        }
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        loop {
            tokio::select! {
                batch = w.next() => match batch {
                    Some(evs) => {
                        for e in evs {
                            if !tx.send(&json!({ "filesystem": e })).await {
                                return;
                            }
                        }
                    }
                    None => {
                        tx.end(None).await;
                        return;
                    }
                },
                _ = ticker.tick() => {
                    if !tx.send(&json!({ "keepalive": {} })).await {
                        return;
                    }
                }
                () = tx.closed() => return,
            }
        }
    });
    resp
}

/// A polled watcher's buffered events.
#[derive(Debug)]
struct Polled {
    events: Arc<Mutex<VecDeque<serde_json::Value>>>,
    /// Dropping it stops the watcher's task.
    _stop: mpsc::Sender<()>,
}

/// The polled watchers (`CreateWatcher`), by sandbox and id.
#[derive(Debug, Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, HashMap<String, Polled>>>,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<String, Polled>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn drain(&self, sandbox: &str, id: &str) -> RpcResult<serde_json::Value> {
        let m = self.lock();
        let p = m
            .get(sandbox)
            .and_then(|w| w.get(id))
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher {id} not found")))?;
        let events: Vec<serde_json::Value> = p
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        Ok(json!({ "events": events }))
    }

    fn remove(&self, sandbox: &str, id: &str) -> RpcResult<serde_json::Value> {
        self.lock()
            .get_mut(sandbox)
            .and_then(|w| w.remove(id))
            .map(|_| json!({}))
            .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher {id} not found")))
    }

    pub fn forget(&self, sandbox: &str) {
        self.lock().remove(sandbox);
    }
}

async fn create_watcher(ctx: &Ctx, req: PathRequest) -> RpcResult<serde_json::Value> {
    if ctx
        .api
        .watchers
        .lock()
        .get(&ctx.id)
        .is_some_and(|w| w.len() >= MAX_WATCHERS)
    {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("a sandbox has at most {MAX_WATCHERS} watchers"),
        ));
    }
    let mut w = open_watch(ctx, &req)?;
    let id = random_token(16);
    let events: Arc<Mutex<VecDeque<serde_json::Value>>> = Default::default();
    let (stop_tx, mut stop_rx) = mpsc::channel::<()>(1);
    let buf = events.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                batch = w.next() => {
                    let Some(evs) = batch else { return };
                    let mut q = buf.lock().unwrap_or_else(|p| p.into_inner());
                    q.extend(evs);
                    while q.len() > MAX_PENDING {
                        q.pop_front();
                    }
                }
                _ = stop_rx.recv() => return,
            }
        }
    });
    ctx.api
        .watchers
        .lock()
        .entry(ctx.id.clone())
        .or_default()
        .insert(
            id.clone(),
            Polled {
                events,
                _stop: stop_tx,
            },
        );
    Ok(json!({ "watcherId": id }))
}

/// Every request message of this service, parsed from `data` (the fuzz target's entry).
pub(crate) fn fuzz(data: &[u8]) {
    if let Ok(r) = serde_json::from_slice::<PathRequest>(data) {
        let _ = absolute(&r.path, "/root");
    }
    let _ = serde_json::from_slice::<MoveRequest>(data);
    let _ = serde_json::from_slice::<WatcherRequest>(data);
}
