//! `strata daemon`, `strata mount`, `strata umount`, `strata status`: the node daemon and
//! the commands that talk to it over its socket (`<run-dir>/strata.sock`). `mount` and `warm`
//! start the daemon when none is running (same store, cache options and run directory); many
//! commands doing so at once start one daemon (`<run-dir>/start.lock`) and all use it.
//!
//! One daemon serves one store. A command given a store (`--store`, `STRATA_STORE`) refuses a
//! daemon serving another, naming both; a command left with the default store uses the
//! daemon's.

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fs_cache::Store;
use ublk_daemon::node::client::Client;
use ublk_daemon::node::proto::{
    ApiError, BlobBytes, ErrorKind, MountInfo, Pong, Request, Status, WarmInfo, MAX_READ_BLOB,
};
use ublk_daemon::node::{server, Node, NodeConfig};

use crate::cache_cmd::CacheOpts;

/// Where the daemon keeps its socket, state and mounts.
#[derive(clap::Args, Debug, Clone)]
pub struct NodeOpts {
    /// The daemon's run directory (socket, state, FUSE and layer mounts). One daemon runs on
    /// a run directory and serves one store: another store needs a run directory of its own.
    #[arg(long, env = "STRATA_RUN_DIR", default_value = "/run/strata")]
    pub run_dir: PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct DaemonArgs {
    #[command(flatten)]
    pub node: NodeOpts,
    /// FUSE worker threads.
    #[arg(long, default_value_t = 8)]
    pub fuse_threads: usize,
    /// Never read a layer's blob in FUSE passthrough mode (by default a layer whose blobs are
    /// wholly in the local cache when it is mounted reads them straight from the cache's
    /// files, without the daemon).
    #[arg(long)]
    pub no_passthrough: bool,
    /// Seconds of a layer's first reads on this node recorded as its access trace, when the
    /// store has none (stored beside the layer for other nodes, which replay it as prefetch
    /// when they mount the layer); 0: neither record nor replay traces.
    #[arg(
        long,
        env = "STRATA_TRACE_WINDOW",
        default_value_t = ublk_daemon::node::DEFAULT_TRACE_WINDOW.as_secs_f64()
    )]
    pub trace_window: f64,
    /// Keep at most this many MiB of mounted layers' meta images in memory (locked in the
    /// page cache while the layer is mounted), so that a read that finds them evicted does not
    /// wait for the disk for metadata and small inline files; 0: none.
    #[arg(
        long,
        env = "STRATA_META_PIN_MB",
        default_value_t = ublk_daemon::node::DEFAULT_META_PIN_BYTES >> 20
    )]
    pub meta_pin_mb: u64,
    /// Take over from the daemon running on this run directory (a planned upgrade): it
    /// stops serving without unmounting anything and exits, and this one resumes its mounts
    /// and FUSE connections (kept by the fd holder); readers wait, none fails.
    #[arg(long)]
    pub takeover: bool,
    /// Where the node's sandboxes keep their records, bundles and uppers (local disk)
    /// [default: $STRATA_HOME/sandboxes].
    #[arg(long, env = "STRATA_SANDBOX_DIR")]
    pub sandbox_dir: Option<PathBuf>,
    /// Keep the sandboxes' uppers in one preallocated filesystem of this size (a btrfs image
    /// in the sandbox directory, one quota group per sandbox): what `sandbox create --disk`
    /// needs. Without it, uppers are plain directories and `--disk` is refused.
    #[arg(long, env = "STRATA_UPPERS_SIZE", value_parser = crate::cache_cmd::parse_size)]
    pub uppers_size: Option<u64>,
    /// The node's name in a cluster behind `strata api` ([a-z0-9]{1,16}): every sandbox id
    /// it makes starts with `NAME-` (a front routes by it), its sandboxes' cgroups live
    /// under `/strata-NAME`.
    #[arg(long, env = "STRATA_NODE_NAME")]
    pub node_name: Option<String>,
    /// Admission: the memory limits of the node's sandboxes may reach this multiple of its
    /// memory (sandboxes without `--memory` reserve none).
    #[arg(long, env = "STRATA_MEM_OVERCOMMIT", default_value_t = 2.0)]
    pub mem_overcommit: f64,
    /// Admission: their `--cpus` may reach this multiple of its CPUs.
    #[arg(long, env = "STRATA_CPU_OVERCOMMIT", default_value_t = 16.0)]
    pub cpu_overcommit: f64,
    /// Admission: refuse creates while the node has less memory available than this
    /// [default: 5% of its memory, at least 512 MiB].
    #[arg(long, env = "STRATA_MIN_AVAILABLE", value_parser = crate::cache_cmd::parse_size)]
    pub min_available: Option<u64>,
    /// Serve the E2B-compatible HTTP API (control plane and envd) on this address
    /// (`127.0.0.1:3000`; port 0: a free one, written to <run-dir>/api.addr).
    #[arg(long, requires = "api_keys")]
    pub api: Option<std::net::SocketAddr>,
    /// The API's keys, one a line (`X-API-KEY`); needed with --api.
    #[arg(long)]
    pub api_keys: Option<PathBuf>,
    /// Serve the node's metrics in Prometheus text format at `GET /metrics` on this address
    /// (`127.0.0.1:9100`; port 0: a free one, written to <run-dir>/metrics.addr). The same
    /// numbers as `strata status --json`.
    #[arg(long, env = "STRATA_METRICS")]
    pub metrics: Option<std::net::SocketAddr>,
}

#[derive(clap::Args, Debug)]
pub struct MountArgs {
    /// Layers (KIND/NAME:VERSION), first lowest.
    #[arg(required = true, value_name = "REF")]
    pub layers: Vec<String>,
    /// An existing, empty directory.
    pub mountpoint: PathBuf,
    /// A writable upper directory (created if missing): the mount is an overlay whose writes
    /// land there.
    #[arg(long)]
    pub upper: Option<PathBuf>,
    /// overlayfs's work directory (default: UPPER.work next to the upper; same filesystem).
    #[arg(long, requires = "upper")]
    pub work: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeOpts,
}

#[derive(clap::Args, Debug)]
pub struct UmountArgs {
    pub mountpoint: PathBuf,
    #[command(flatten)]
    pub node: NodeOpts,
}

#[derive(clap::Args, Debug)]
pub struct WarmArgs {
    /// Layers (KIND/NAME:VERSION).
    #[arg(required = true, value_name = "REF")]
    pub layers: Vec<String>,
    #[command(flatten)]
    pub node: NodeOpts,
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub node: NodeOpts,
}

/// A store URL the daemon can use from any working directory.
pub fn absolute_url(url: &str) -> String {
    if url.contains("://") {
        return url.to_owned();
    }
    std::path::absolute(url)
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| url.to_owned())
}

/// An API error as one line a user can act on.
fn explain(e: ApiError) -> anyhow::Error {
    let hint = match e.kind {
        ErrorKind::UnknownLayer => " (see `strata layer ls`)",
        ErrorKind::BackendUnreachable => " (is the store's backend reachable?)",
        ErrorKind::NotRoot => " (run as root)",
        ErrorKind::KernelUnsupported => " (this kernel cannot serve lazy layers)",
        _ => "",
    };
    anyhow!("{}{hint}", e.message)
}

/// [`explain`], and where a layer was not found in a store the command did not name, which
/// store the daemon looked in.
fn explain_in(e: ApiError, pong: &Pong, store: &StoreArg) -> anyhow::Error {
    if e.kind == ErrorKind::UnknownLayer && !store.explicit && !same_store(&pong.store, &store.url)
    {
        return anyhow!(
            "{} (see `strata --store {} layer ls`: the strata daemon on {} serves that store, not the default {})",
            e.message,
            pong.store,
            pong.run_dir.display(),
            absolute_url(&store.url)
        );
    }
    explain(e)
}

/// `strata daemon`: run the node in the foreground until SIGTERM/SIGINT.
pub async fn daemon(args: DaemonArgs, url: &str, cache: &CacheOpts, home: &Path) -> Result<()> {
    let url = absolute_url(url);
    let config = cache.config(home, &url);
    if let Some(d) = &config.disk {
        std::fs::create_dir_all(&d.dir)
            .with_context(|| format!("create cache directory {}", d.dir.display()))?;
    }
    let backend = fs_cache::open_backend(&url).await?;
    let mut node_config = NodeConfig::new(args.node.run_dir.clone(), url.clone(), config);
    node_config.fuse_threads = args.fuse_threads.max(1);
    node_config.passthrough = !args.no_passthrough;
    node_config.trace_window = Duration::try_from_secs_f64(args.trace_window)
        .context("--trace-window: a number of seconds, 0 or more")?;
    node_config.meta_pin_bytes = args.meta_pin_mb.saturating_mul(1 << 20);
    // The holder is this very binary, run as `strata fuse-holder`.
    let exe = std::env::current_exe().context("find the strata binary (for its fd holder)")?;
    node_config.holder_command = vec![exe.into_os_string(), "fuse-holder".into()];
    if args.takeover {
        let sock = ublk_daemon::node::socket_path(&args.node.run_dir);
        let mut c = Client::connect(&sock)
            .with_context(|| format!("--takeover: no daemon answers on {}", sock.display()))?;
        let old: Pong = c.call(Request::Handover).map_err(explain)?;
        eprintln!("strata daemon: pid {} handed over; taking over", old.pid);
        // It exits right after its answer; its lock goes with it.
        node_config.lock_wait = Duration::from_secs(60);
    }
    let node = Node::start(node_config, Store::new(backend))
        .await
        .map_err(explain)?;
    // The node's sandboxes: found again (and reattached) before the socket answers.
    let sandbox_dir = args
        .sandbox_dir
        .clone()
        .unwrap_or_else(|| home.join("sandboxes"));
    let mut sandbox_config = sandbox_runtime::ManagerConfig::new(sandbox_dir, &args.node.run_dir);
    sandbox_config.uppers_size = args.uppers_size;
    sandbox_config.node_name = args.node_name.clone();
    sandbox_config.admission = sandbox_runtime::admission::Admission {
        mem_overcommit: args.mem_overcommit,
        cpu_overcommit: args.cpu_overcommit,
        min_available: args.min_available,
    };
    let manager = match sandbox_runtime::Manager::start(sandbox_config, node.clone()).await {
        Ok(m) => m,
        Err(e) => {
            let _ = node.shutdown().await;
            bail!("sandboxes: {e}");
        }
    };
    let api_dir = home.join("api");
    let templates = match e2b_api::state_templates(&api_dir) {
        Ok(t) => t,
        Err(e) => {
            let _ = node.shutdown().await;
            bail!("templates: {e}");
        }
    };
    let ext: server::SharedExtension = Some(std::sync::Arc::new(e2b_api::TemplateExtension {
        templates: templates.clone(),
        inner: std::sync::Arc::new(sandbox_runtime::SandboxExtension {
            manager: manager.clone(),
        }),
    }));
    if let (Some(addr), Some(keys)) = (args.api, &args.api_keys) {
        let started = async {
            let api = e2b_api::Api::open(manager.clone(), templates.clone(), &api_dir, keys)
                .map_err(|e| anyhow!("{e}"))?;
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listen on {addr}"))?;
            let local = listener.local_addr()?;
            let addr_file = args.node.run_dir.join("api.addr");
            fs_cache::write_atomic(&addr_file, local.to_string().as_bytes())
                .with_context(|| format!("write {}", addr_file.display()))?;
            eprintln!("strata daemon: e2b api on http://{local}");
            tokio::spawn(e2b_api::serve(api, listener));
            anyhow::Ok(())
        };
        if let Err(e) = started.await {
            let _ = node.shutdown().await;
            bail!("--api: {e:#}");
        }
    }
    if let Some(addr) = args.metrics {
        let started = async {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listen on {addr}"))?;
            let local = listener.local_addr()?;
            let addr_file = args.node.run_dir.join("metrics.addr");
            fs_cache::write_atomic(&addr_file, local.to_string().as_bytes())
                .with_context(|| format!("write {}", addr_file.display()))?;
            eprintln!("strata daemon: metrics on http://{local}/metrics");
            tokio::spawn(crate::metrics_cmd::serve(node.clone(), listener));
            anyhow::Ok(())
        };
        if let Err(e) = started.await {
            let _ = node.shutdown().await;
            bail!("--metrics: {e:#}");
        }
    }
    let listener = match server::bind(&node.socket_path()) {
        Ok(l) => l,
        Err(e) => {
            let _ = node.shutdown().await;
            bail!("listen on {}: {e}", node.socket_path().display());
        }
    };
    eprintln!(
        "strata daemon: pid {}, store {url}, socket {}",
        std::process::id(),
        node.socket_path().display()
    );
    server::serve_until_signal(node, listener, ext)
        .await
        .map_err(explain)
}

impl NodeOpts {
    /// The options as a command line without `--run-dir` gives them: `$STRATA_RUN_DIR`, else
    /// the default.
    fn from_env() -> Result<Self> {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            node: NodeOpts,
        }
        Ok(<Only as clap::Parser>::try_parse_from(["strata"])?.node)
    }
}

fn socket(node: &NodeOpts) -> PathBuf {
    ublk_daemon::node::socket_path(&node.run_dir)
}

/// A running daemon's client, whatever store it serves; `Ok(None)` if none answers.
pub(crate) fn connect_running_any(node: &NodeOpts) -> Result<Option<Client>> {
    Ok(ping(node, Some(START_TIMEOUT))?.map(|(c, _)| c))
}

/// Connect to a running daemon; `Ok(None)` if none is running.
fn connect(node: &NodeOpts) -> Result<Option<Client>> {
    let path = socket(node);
    match Client::connect(&path) {
        Ok(c) => Ok(Some(c)),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => bail!(
            "{}: permission denied; the strata daemon's socket is root-only (run as root)",
            path.display()
        ),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(anyhow!("connect to {}: {e}", path.display())),
    }
}

/// The daemon's client and its `ping` answer, if one answers on `node.run_dir`; a daemon
/// that is shutting down counts as not answering. With `timeout`, so does one that accepts
/// the connection but does not answer within it (still starting, or stopping) or drops it;
/// without, those are errors.
fn ping(node: &NodeOpts, timeout: Option<Duration>) -> Result<Option<(Client, Pong)>> {
    let Some(mut c) = connect(node)? else {
        return Ok(None);
    };
    if let Some(t) = timeout {
        c.set_read_timeout(Some(t.max(Duration::from_millis(1))))
            .context("talking to the strata daemon")?;
    }
    match c.call::<Pong>(Request::Ping) {
        Ok(pong) => {
            if timeout.is_some() {
                c.set_read_timeout(Some(CALL_TIMEOUT))
                    .context("talking to the strata daemon")?;
            }
            Ok(Some((c, pong)))
        }
        Err(e)
            if e.kind == ErrorKind::ShuttingDown
                || (timeout.is_some() && e.kind == ErrorKind::Internal) =>
        {
            Ok(None)
        }
        Err(e) => Err(explain(e)),
    }
}

/// How long a request may take once sent (what `Client::connect` sets).
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a command waits for a daemon being started (by it or by anyone else) to answer.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The store a command names, and whether the user named it (`--store` or `STRATA_STORE`)
/// or it is the default (`$STRATA_HOME/store`).
#[derive(Debug, Clone)]
pub struct StoreArg {
    pub url: String,
    pub explicit: bool,
}

/// Undo `%XX` escapes; `None` if one is malformed or the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A path as the store opened at it sees it: absolute, `.` and trailing slashes gone,
/// symlinks resolved as far as it exists.
fn normal_path(p: &Path) -> PathBuf {
    use std::path::Component;
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_owned());
    if let Ok(real) = std::fs::canonicalize(&abs) {
        return real;
    }
    let mut lexical = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                lexical.pop();
            }
            other => lexical.push(other),
        }
    }
    // The longest existing ancestor, canonicalised, and the rest as written.
    let mut rest = Vec::new();
    let mut at = lexical.as_path();
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            return rest.iter().rev().fold(real, |p, c| p.join(c));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                at = parent;
            }
            _ => return lexical,
        }
    }
}

/// One spelling per store, for comparing the URL a command was given with the one a daemon
/// serves: a path and `file:///path` (or `file://localhost/path`) are the same directory;
/// `s3://` URLs are the same store when bucket, prefix and endpoint agree (region, profile
/// and path style do not change which objects they name). Anything else, or a URL that does
/// not parse, compares as written.
fn store_identity(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return format!("file://{}", normal_path(Path::new(url)).display());
    };
    match scheme {
        "file" => {
            let path = rest.strip_prefix("localhost").unwrap_or(rest);
            let path = path.split(['?', '#']).next().unwrap_or(path);
            match percent_decode(path) {
                Some(p) if p.starts_with('/') => {
                    format!("file://{}", normal_path(Path::new(&p)).display())
                }
                _ => url.to_owned(),
            }
        }
        "s3" => {
            let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
            let (bucket, prefix) = location.split_once('/').unwrap_or((location, ""));
            let Some(prefix) = percent_decode(prefix) else {
                return url.to_owned();
            };
            let prefix = prefix.trim_matches('/');
            let mut endpoint = String::new();
            for pair in query.split('&') {
                if let Some(("endpoint", v)) = pair.split_once('=') {
                    let Some(v) = percent_decode(&v.replace('+', " ")) else {
                        return url.to_owned();
                    };
                    endpoint = v.trim_end_matches('/').to_owned();
                }
            }
            format!("s3://{bucket}/{prefix}?endpoint={endpoint}")
        }
        _ => url.to_owned(),
    }
}

fn same_store(a: &str, b: &str) -> bool {
    a == b || store_identity(a) == store_identity(b)
}

/// One daemon serves one store: a command given a store explicitly refuses a daemon that
/// serves another. A command left with the default store uses whatever the daemon serves.
fn check_store(node: &NodeOpts, pong: &Pong, store: &StoreArg) -> Result<()> {
    if !store.explicit || same_store(&pong.store, &store.url) {
        return Ok(());
    }
    bail!(
        "the strata daemon on {} (pid {}) serves store {}, not {}: one daemon serves one store; \
         use that store, or give this one a daemon of its own with --run-dir DIR (or STRATA_RUN_DIR)",
        node.run_dir.display(),
        pong.pid,
        pong.store,
        absolute_url(&store.url)
    )
}

/// The running daemon, checked against `store`; `Ok(None)` if none runs.
fn connect_running(node: &NodeOpts, store: &StoreArg) -> Result<Option<(Client, Pong)>> {
    let Some((c, pong)) = ping(node, None)? else {
        return Ok(None);
    };
    check_store(node, &pong, store)?;
    Ok(Some((c, pong)))
}

/// The pid holding the run directory's lock (`strata.pid`, flocked by a running or starting
/// daemon), read from `/proc/locks` without touching the lock; `None` if no one holds it (or
/// it cannot be told).
fn run_dir_lock_holder(run_dir: &Path) -> Option<i64> {
    let path = run_dir.join("strata.pid");
    let st = rustix::fs::stat(&path).ok()?;
    let dev = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(st.st_dev),
        rustix::fs::minor(st.st_dev),
        st.st_ino
    );
    let ino = format!(":{}", st.st_ino);
    let written: Option<i64> = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|line| {
        // "3: FLOCK  ADVISORY  WRITE 4242 00:1a:12345 0 EOF"; a waiter's line has "->"
        // after the number.
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] != "FLOCK" {
            return None;
        }
        let pid: Option<i64> = f[4].parse().ok();
        // Where stat(2) and the lock table name the device differently (btrfs subvolumes,
        // overlayfs), the inode and the pid the daemon wrote must agree.
        let ours = f[5] == dev || (f[5].ends_with(&ino) && pid.is_some() && pid == written);
        ours.then(|| pid.unwrap_or(0))
    })
}

/// The last non-empty line a daemon wrote to its log since `from`.
fn log_tail(log_path: &Path, from: u64) -> String {
    use std::io::Seek;
    let mut bytes = Vec::new();
    if let Ok(mut f) = std::fs::File::open(log_path) {
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if f.seek(std::io::SeekFrom::Start(
            from.max(len.saturating_sub(64 << 10)),
        ))
        .is_ok()
        {
            let _ = f.read_to_end(&mut bytes);
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim_start_matches("strata: ")
        .to_owned()
}

/// A client of the daemon on `node.run_dir`, started (detached, logging to
/// `<run-dir>/daemon.log`) if none runs.
///
/// Many commands may find no daemon at once: they take `<run-dir>/start.lock` in turn, and
/// only the holder starts one; the others use it as soon as it answers. A daemon that is
/// starting (or stopping) without a client's help holds the run directory's lock: it is
/// waited for, not raced. Everything is bounded by [`START_TIMEOUT`].
pub(crate) fn connect_or_start(
    node: &NodeOpts,
    store: &StoreArg,
    cache: &CacheOpts,
) -> Result<(Client, Pong)> {
    if let Some(found) = connect_running(node, store)? {
        return Ok(found);
    }
    if !rustix::process::geteuid().is_root() {
        bail!("no strata daemon is running and only root can start one (it mounts filesystems); run as root");
    }
    let deadline = Instant::now() + START_TIMEOUT;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&node.run_dir)
        .with_context(|| format!("create {}", node.run_dir.display()))?;
    let log_path = node.run_dir.join("daemon.log");
    let lock_path = node.run_dir.join("start.lock");
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_path)
        .with_context(|| format!("open {}", lock_path.display()))?;
    loop {
        match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => break,
            Err(rustix::io::Errno::WOULDBLOCK) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => bail!("lock {}: {e}", lock_path.display()),
        }
        // Another command is starting the daemon: use it as soon as it answers.
        if let Some((c, pong)) = ping(
            node,
            Some(deadline.saturating_duration_since(Instant::now())),
        )? {
            check_store(node, &pong, store)?;
            return Ok((c, pong));
        }
        if Instant::now() > deadline {
            bail!(
                "another strata command has been starting the daemon on {} for {} s and it does not answer on {}; see {}",
                node.run_dir.display(),
                START_TIMEOUT.as_secs(),
                socket(node).display(),
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Held until this returns (the file closes): no other command starts a daemon meanwhile.
    let (c, pong) = start_locked(node, store, cache, &log_path, deadline)?;
    drop(lock);
    check_store(node, &pong, store)?;
    Ok((c, pong))
}

/// [`connect_or_start`] with the start lock held: ping; if nothing answers and no daemon holds
/// the run directory, start one; wait for whichever daemon that is to answer.
fn start_locked(
    node: &NodeOpts,
    store: &StoreArg,
    cache: &CacheOpts,
    log_path: &Path,
    deadline: Instant,
) -> Result<(Client, Pong)> {
    let mut child: Option<(std::process::Child, u64)> = None;
    let mut spawned = 0;
    let mut waited_for: Option<i64> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(found) = ping(node, Some(left))? {
            return Ok(found);
        }
        if let Some((c, from)) = &mut child {
            if let Some(status) = c.try_wait().context("wait for the strata daemon")? {
                let said = log_tail(log_path, *from);
                child = None;
                match run_dir_lock_holder(&node.run_dir) {
                    // Lost the run directory to a daemon started otherwise: wait for it.
                    Some(pid) => waited_for = Some(pid),
                    // The same, where the lock table cannot tell (the daemon says so).
                    None if said.contains("another strata daemon") => {}
                    None => bail!("the strata daemon did not start ({status}): {said}"),
                }
            }
        }
        if Instant::now() > deadline {
            let (sock, secs, log) = (socket(node), START_TIMEOUT.as_secs(), log_path.display());
            let sock = sock.display();
            match (&child, waited_for) {
                (Some((c, _)), _) => bail!(
                    "the strata daemon this command started (pid {}) did not answer on {sock} within {secs} s; see {log}",
                    c.id()
                ),
                (None, Some(pid)) => bail!(
                    "the strata daemon holding {} (pid {pid}) did not answer on {sock} within {secs} s (if a strata command started it, see {log})",
                    node.run_dir.join("strata.pid").display()
                ),
                (None, None) => bail!("no strata daemon answered on {sock} within {secs} s; see {log}"),
            }
        }
        if child.is_none() {
            match run_dir_lock_holder(&node.run_dir) {
                Some(pid) => waited_for = Some(pid),
                // Bounded: a daemon that took the run directory and went away again, twice.
                None if spawned < 3 => {
                    child = Some(spawn_daemon(node, store, cache, log_path)?);
                    spawned += 1;
                }
                None => {}
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Start `strata daemon` detached, with this command's store, cache options and run
/// directory, its output appended to `log_path`; the child and where its output starts.
fn spawn_daemon(
    node: &NodeOpts,
    store: &StoreArg,
    cache: &CacheOpts,
    log_path: &Path,
) -> Result<(std::process::Child, u64)> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let exe = std::env::current_exe().context("find the strata executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--store").arg(absolute_url(&store.url));
    if let Some(d) = &cache.cache_dir {
        cmd.arg("--cache-dir").arg(absolute(d)?);
    }
    cmd.arg("--cache-memory")
        .arg(cache.cache_memory.to_string())
        .arg("--cache-disk")
        .arg(cache.cache_disk.to_string())
        .arg("daemon")
        .arg("--run-dir")
        .arg(absolute(&node.run_dir)?)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: a Ctrl-C meant for this command does not stop the daemon.
        .process_group(0);
    let child = cmd.spawn().context("start the strata daemon")?;
    Ok((child, log_start))
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).with_context(|| format!("resolve {}", p.display()))
}

/// `strata mount REF... MOUNTPOINT`.
pub fn mount(args: MountArgs, store: &StoreArg, cache: &CacheOpts, json: bool) -> Result<()> {
    let mountpoint = absolute(&args.mountpoint)?;
    let upper = args.upper.as_deref().map(absolute).transpose()?;
    let work = args.work.as_deref().map(absolute).transpose()?;
    let (mut client, pong) = connect_or_start(&args.node, store, cache)?;
    let info: MountInfo = client
        .call(Request::Mount {
            layers: args.layers,
            mountpoint,
            upper,
            work,
        })
        .map_err(|e| explain_in(e, &pong, store))?;
    if json {
        crate::print_json(&info)
    } else {
        println!("{}", info.mountpoint.display());
        Ok(())
    }
}

/// `strata warm REF...`.
pub fn warm(args: WarmArgs, store: &StoreArg, cache: &CacheOpts, json: bool) -> Result<()> {
    let (mut client, pong) = connect_or_start(&args.node, store, cache)?;
    // A large layer over a slow backend takes as long as it takes.
    client
        .set_read_timeout(None)
        .context("talking to the strata daemon")?;
    let mut all = Vec::new();
    for layer in args.layers {
        let info: WarmInfo = client
            .call(Request::Warm { layer })
            .map_err(|e| explain_in(e, &pong, store))?;
        if !json {
            let why = info.no_passthrough_because.as_deref().unwrap_or("");
            let next = match (info.mounted, info.passthrough_next) {
                _ if !info.local => format!("NOT wholly in the local cache: {why}"),
                (true, _) if info.passthrough_now as usize == info.blobs => {
                    "mounted now, read from local disk directly (passthrough)".to_owned()
                }
                (true, true) => "mounted now, read through the cache (from local disk); \
                                 passthrough from its next mount"
                    .to_owned(),
                (true, false) => format!(
                    "mounted now, read through the cache (from local disk); no passthrough: {why}"
                ),
                (false, true) => {
                    "its next mount reads it from local disk directly (passthrough)".to_owned()
                }
                (false, false) => format!("its next mount reads it through the cache: {why}"),
            };
            println!(
                "{}: {} of data, {} fetched in {:.1} s; {next}",
                info.layer,
                crate::human(info.bytes),
                crate::human(info.fetched),
                info.seconds
            );
        }
        all.push(info);
    }
    if json {
        crate::print_json(&all)?;
    }
    Ok(())
}

/// `strata umount MOUNTPOINT`.
pub fn umount(args: UmountArgs, store: &StoreArg, json: bool) -> Result<()> {
    let Some((mut client, _)) = connect_running(&args.node, store)? else {
        bail!(
            "no strata daemon runs on {}, so {} is not a strata mount",
            args.node.run_dir.display(),
            args.mountpoint.display()
        );
    };
    let info: MountInfo = client
        .call(Request::Umount {
            mountpoint: absolute(&args.mountpoint)?,
        })
        .map_err(explain)?;
    if json {
        crate::print_json(&info)
    } else {
        println!("unmounted {}", info.mountpoint.display());
        Ok(())
    }
}

/// The first 16 characters of a layer id, for display. An id comes from the daemon, which
/// read it from its state file: a damaged file can hold any string, so this cuts at a
/// character boundary, never inside one.
fn short_id(id: &str) -> &str {
    id.char_indices().nth(16).map_or(id, |(at, _)| &id[..at])
}

/// `strata status`.
pub fn status(args: StatusArgs, store: &StoreArg, json: bool) -> Result<()> {
    let Some((mut client, _)) = connect_running(&args.node, store)? else {
        if json {
            return crate::print_json(&serde_json::json!({"running": false}));
        }
        println!("no strata daemon runs on {}", args.node.run_dir.display());
        return Ok(());
    };
    let s: Status = client.call(Request::Stats).map_err(explain)?;
    if json {
        let mut v = serde_json::to_value(&s)?;
        v["running"] = serde_json::json!(true);
        return crate::print_json(&v);
    }
    println!(
        "daemon: pid {}, store {}, run dir {}",
        s.pong.pid,
        s.pong.store,
        s.pong.run_dir.display()
    );
    println!("layers:");
    for l in &s.layers {
        let data: u64 = l.blobs.iter().map(|b| b.1).sum();
        println!(
            "  {}  {}  meta {}  data {}  pins {}  mounts {}{}",
            short_id(&l.id),
            l.refs.join(","),
            crate::human(l.meta_bytes),
            crate::human(data),
            l.pins,
            l.users,
            if l.passthrough_blobs > 0 {
                format!("  passthrough {}/{}", l.passthrough_blobs, l.blobs.len())
            } else {
                String::new()
            }
        );
    }
    println!("mounts:");
    for m in &s.mounts {
        println!(
            "  {}  {}  {}{}",
            m.mountpoint.display(),
            m.kind,
            m.layers.join(" < "),
            m.upper
                .as_ref()
                .map(|u| format!(" < upper {}", u.display()))
                .unwrap_or_default()
        );
    }
    println!("cache:");
    crate::cache_cmd::print_stats(&s.cache);
    let n = &s.node;
    println!(
        "daemon          rss {}, up {:.0} s, FUSE reads {} ({} failed, {} in flight), restarts {} (takeovers {})",
        crate::human(n.rss_bytes),
        n.uptime_seconds,
        n.fuse_reads,
        n.fuse_read_errors,
        n.fuse_requests_in_flight,
        n.restarts,
        n.takeovers
    );
    Ok(())
}

/// The cache counters of a daemon running on `$STRATA_RUN_DIR` (default `/run/strata`), if
/// one runs: while it does, it holds the cache open, so `strata cache stats` asks it.
/// `strata blob cat` while a daemon runs (it holds the node cache): the bytes come through
/// its cache, `read_blob` by `read_blob`. `Ok(None)` when no daemon runs on `$STRATA_RUN_DIR`
/// (the caller then opens the cache itself).
pub fn cat_through_daemon(
    store: &StoreArg,
    digest: &str,
    offset: u64,
    length: Option<u64>,
    out: &mut dyn std::io::Write,
) -> Result<Option<u64>> {
    let node = NodeOpts::from_env()?;
    let Some((mut c, pong)) = connect_running(&node, store)? else {
        return Ok(None);
    };
    let mut at = offset;
    let mut end = length.map(|l| offset.saturating_add(l));
    loop {
        let want = end.map_or(MAX_READ_BLOB, |e| e.saturating_sub(at).min(MAX_READ_BLOB));
        if want == 0 {
            break;
        }
        let got: BlobBytes = c
            .call(Request::ReadBlob {
                blob: digest.to_owned(),
                offset: at,
                length: want,
            })
            .map_err(|e| explain_in(e, &pong, store))?;
        let bytes = hex_decode(&got.hex)
            .ok_or_else(|| anyhow!("the daemon's read_blob answer is not hex"))?;
        end = Some(end.unwrap_or(got.size).min(got.size));
        out.write_all(&bytes).context("write output")?;
        at += bytes.len() as u64;
        if bytes.is_empty() {
            break;
        }
    }
    out.flush().context("write output")?;
    Ok(Some(at - offset))
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

pub fn running_daemon_cache_stats() -> Option<fs_cache::chunk::CacheStats> {
    let node = NodeOpts::from_env().ok()?;
    let mut client = connect(&node).ok()??;
    client.call::<Status>(Request::Stats).ok().map(|s| s.cache)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_ids_cut_at_characters() {
        let hex = "0123456789abcdef0123456789abcdef";
        assert_eq!(short_id(hex), "0123456789abcdef");
        assert_eq!(short_id("abc"), "abc");
        assert_eq!(short_id(""), "");
        // A multi-byte character across byte 16 (a corrupt state file): no panic.
        let odd = "0123456789abcdeé0123";
        assert!(!odd.is_char_boundary(16));
        assert_eq!(short_id(odd), "0123456789abcdeé");
        assert_eq!(short_id("ééééééééééééééééé"), "éééééééééééééééé");
        assert_eq!(short_id("ééé"), "ééé");
    }

    #[test]
    fn one_spelling_per_store() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("store");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, tmp.path().join("link")).unwrap();
        let r = real.to_str().unwrap();
        let t = tmp.path().to_str().unwrap();
        let same = [
            format!("{r}/"),
            format!("{r}//"),
            format!("file://{r}"),
            format!("file://localhost{r}/"),
            format!("file://{t}/st%6Fre"),
            format!("{t}/link"),
            format!("{t}/./store/../store"),
            format!("{t}/link/sub/.."),
        ];
        for s in &same {
            assert!(same_store(r, s), "{r} vs {s}");
            assert!(same_store(s, r), "{s} vs {r}");
        }
        // Not created yet: compared as written, made absolute and lexically clean.
        assert!(same_store(&format!("{t}/new/"), &format!("file://{t}/new")));
        assert!(same_store(&format!("{t}/link/new"), &format!("{r}/new")));
        for other in [
            format!("{t}/other"),
            format!("{r}/sub"),
            format!("file://{t}"),
            "memory://".to_owned(),
            "s3://bucket/store".to_owned(),
        ] {
            assert!(!same_store(r, &other), "{r} vs {other}");
        }

        let s3 = "s3://bkt/pre/fix?endpoint=http://127.0.0.1:9000&region=us-east-1";
        for s in [
            "s3://bkt/pre/fix/?endpoint=http://127.0.0.1:9000/",
            "s3://bkt/pre/fix?region=eu-west-1&endpoint=http%3A%2F%2F127.0.0.1%3A9000",
            "s3://bkt/pre%2Ffix?endpoint=http://127.0.0.1:9000&path_style=true",
        ] {
            assert!(same_store(s3, s), "{s3} vs {s}");
        }
        for s in [
            "s3://bkt/pre?endpoint=http://127.0.0.1:9000",
            "s3://other/pre/fix?endpoint=http://127.0.0.1:9000",
            "s3://bkt/pre/fix?endpoint=http://127.0.0.1:9001",
            "s3://bkt/pre/fix",
            "file:///bkt/pre/fix",
        ] {
            assert!(!same_store(s3, s), "{s3} vs {s}");
        }
        assert!(same_store("s3://bkt", "s3://bkt/"));
        // Malformed URLs compare as written, without a panic.
        for bad in [
            "file://%zz",
            "s3://b/%",
            "file://",
            "s3://",
            "x://y",
            "%",
            "",
        ] {
            let _ = store_identity(bad);
            assert!(same_store(bad, bad));
        }
    }
}
