//! `strata daemon`, `strata mount`, `strata umount`, `strata status`: the node daemon and
//! the commands that talk to it over its socket (`<run-dir>/strata.sock`). `mount` starts the
//! daemon when none is running (same store, cache options and run directory).

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fs_cache::Store;
use ublk_daemon::node::client::Client;
use ublk_daemon::node::proto::{ApiError, ErrorKind, MountInfo, Pong, Request, Status, WarmInfo};
use ublk_daemon::node::{server, Node, NodeConfig};

use crate::cache_cmd::CacheOpts;

/// Where the daemon keeps its socket, state and mounts.
#[derive(clap::Args, Debug, Clone)]
pub struct NodeOpts {
    /// The daemon's run directory (socket, state, FUSE and layer mounts).
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
    /// Take over from the daemon running on this run directory (a planned upgrade): it
    /// stops serving without unmounting anything and exits, and this one resumes its mounts
    /// and FUSE connections (kept by the fd holder); readers wait, none fails.
    #[arg(long)]
    pub takeover: bool,
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

/// `strata daemon`: run the node in the foreground until SIGTERM/SIGINT.
pub async fn daemon(args: DaemonArgs, url: &str, cache: &CacheOpts, home: &Path) -> Result<()> {
    let url = absolute_url(url);
    let config = cache.config(home);
    if let Some(d) = &config.disk {
        std::fs::create_dir_all(&d.dir)
            .with_context(|| format!("create cache directory {}", d.dir.display()))?;
    }
    let backend = fs_cache::open_backend(&url).await?;
    let mut node_config = NodeConfig::new(args.node.run_dir.clone(), url.clone(), config);
    node_config.fuse_threads = args.fuse_threads.max(1);
    node_config.passthrough = !args.no_passthrough;
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
    server::serve_until_signal(node, listener)
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

fn same_store(a: &str, b: &str) -> bool {
    let canon = |u: &str| {
        if u.contains("://") {
            u.to_owned()
        } else {
            std::fs::canonicalize(u)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|_| u.to_owned())
        }
    };
    canon(a) == canon(b)
}

/// A client of the daemon on `node.run_dir`, started (detached, logging to
/// `<run-dir>/daemon.log`) if none runs; the daemon must serve the store `url`.
fn connect_or_start(node: &NodeOpts, url: &str, cache: &CacheOpts) -> Result<Client> {
    let url = absolute_url(url);
    if let Some(mut c) = connect(node)? {
        let pong: Pong = c.call(Request::Ping).map_err(explain)?;
        if !same_store(&pong.store, &url) {
            bail!(
                "the strata daemon on {} (pid {}) serves store {}, not {url}; stop it or use another --run-dir",
                node.run_dir.display(),
                pong.pid,
                pong.store
            );
        }
        return Ok(c);
    }
    if !rustix::process::geteuid().is_root() {
        bail!("no strata daemon is running and only root can start one (it mounts filesystems); run as root");
    }
    std::fs::create_dir_all(&node.run_dir)
        .with_context(|| format!("create {}", node.run_dir.display()))?;
    let log_path = node.run_dir.join("daemon.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let exe = std::env::current_exe().context("find the strata executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--store").arg(&url);
    if let Some(d) = &cache.cache_dir {
        cmd.arg("--cache-dir").arg(std::path::absolute(d)?);
    }
    cmd.arg("--cache-memory")
        .arg(cache.cache_memory.to_string())
        .arg("--cache-disk")
        .arg(cache.cache_disk.to_string())
        .arg("daemon")
        .arg("--run-dir")
        .arg(std::path::absolute(&node.run_dir)?)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: a Ctrl-C meant for this command does not stop the daemon.
        .process_group(0);
    let mut child = cmd.spawn().context("start the strata daemon")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(mut c) = connect(node)? {
            if c.call::<Pong>(Request::Ping).is_ok() {
                return Ok(c);
            }
        }
        if let Some(status) = child.try_wait()? {
            let mut text = String::new();
            if let Ok(mut f) = std::fs::File::open(&log_path) {
                use std::io::Seek;
                let _ = f.seek(std::io::SeekFrom::Start(log_start));
                let _ = f.take(4096).read_to_string(&mut text);
            }
            let last = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            bail!(
                "the strata daemon did not start ({status}): {}",
                last.trim_start_matches("strata: ")
            );
        }
        if Instant::now() > deadline {
            bail!(
                "the strata daemon (pid {}) did not answer on {} within 60 s; see {}",
                child.id(),
                socket(node).display(),
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).with_context(|| format!("resolve {}", p.display()))
}

/// `strata mount REF... MOUNTPOINT`.
pub fn mount(args: MountArgs, url: &str, cache: &CacheOpts, json: bool) -> Result<()> {
    let mountpoint = absolute(&args.mountpoint)?;
    let mut client = connect_or_start(&args.node, url, cache)?;
    let info: MountInfo = client
        .call(Request::Mount {
            layers: args.layers,
            mountpoint,
            upper: args.upper.as_deref().map(absolute).transpose()?,
            work: args.work.as_deref().map(absolute).transpose()?,
        })
        .map_err(explain)?;
    if json {
        crate::print_json(&info)
    } else {
        println!("{}", info.mountpoint.display());
        Ok(())
    }
}

/// `strata warm REF...`.
pub fn warm(args: WarmArgs, url: &str, cache: &CacheOpts, json: bool) -> Result<()> {
    let mut client = connect_or_start(&args.node, url, cache)?;
    // A large layer over a slow backend takes as long as it takes.
    client
        .set_read_timeout(None)
        .context("talking to the strata daemon")?;
    let mut all = Vec::new();
    for layer in args.layers {
        let info: WarmInfo = client.call(Request::Warm { layer }).map_err(explain)?;
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
pub fn umount(args: UmountArgs, json: bool) -> Result<()> {
    let Some(mut client) = connect(&args.node)? else {
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

/// `strata status`.
pub fn status(args: StatusArgs, json: bool) -> Result<()> {
    let Some(mut client) = connect(&args.node)? else {
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
            &l.id[..l.id.len().min(16)],
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
    Ok(())
}

/// The cache counters of a daemon running on `$STRATA_RUN_DIR` (default `/run/strata`), if
/// one runs: while it does, it holds the cache open, so `strata cache stats` asks it.
pub fn running_daemon_cache_stats() -> Option<fs_cache::chunk::CacheStats> {
    let node = NodeOpts::from_env().ok()?;
    let mut client = connect(&node).ok()??;
    client.call::<Status>(Request::Stats).ok().map(|s| s.cache)
}
