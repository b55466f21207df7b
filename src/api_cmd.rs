//! `strata api`: the cluster front (`e2b_api::front`), a stateless E2B API server in front
//! of several node daemons.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use e2b_api::front::{Front, FrontConfig, NodeAddr};

#[derive(clap::Args, Debug)]
pub struct ApiArgs {
    /// Where to listen (`127.0.0.1:3000`; port 0: any free one, printed and written to
    /// --addr-file).
    #[arg(long)]
    pub listen: SocketAddr,
    /// A node's E2B API, `[NAME=]http://HOST:PORT` (a node started with `strata daemon
    /// --api ADDR --node-name NAME`); repeat for each node. The name is learned from the
    /// node when not given.
    #[arg(long = "node", value_name = "[NAME=]URL")]
    pub nodes: Vec<String>,
    /// A file of nodes, one `[NAME=]URL` a line (blank lines and `#` comments ignored).
    #[arg(long)]
    pub nodes_file: Option<PathBuf>,
    /// The API keys, one a line: the nodes' keys file (the front checks the key, passes it
    /// on, and polls the nodes with the first one).
    #[arg(long)]
    pub api_keys: PathBuf,
    /// How often the watcher polls every node's status.
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    pub poll: Duration,
    /// Random choices of the power-of-k placement.
    #[arg(long, default_value_t = 2)]
    pub k: usize,
    /// The number of front instances serving the same nodes (each counts its own recent
    /// placements that many times on top of the shared, stale view).
    #[arg(long, default_value_t = 1)]
    pub fronts: u32,
    /// Nodes tried per create (a refusal or a dead node sends it to another).
    #[arg(long, default_value_t = 4)]
    pub max_attempts: u32,
    /// Write the address listened on to this file once serving.
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
}

pub async fn run(args: ApiArgs) -> Result<()> {
    let mut lines = args.nodes.clone();
    if let Some(f) = &args.nodes_file {
        let text = std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?;
        lines.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_owned),
        );
    }
    if lines.is_empty() {
        bail!("no node: give --node URL (repeated) or --nodes-file FILE");
    }
    let nodes = lines
        .iter()
        .map(|l| {
            l.parse::<NodeAddr>()
                .map_err(|e| anyhow!("--node {l}: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    if args.fronts == 0 {
        bail!("--fronts must be at least 1");
    }
    let seed = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let front = Front::start(FrontConfig {
        nodes,
        keys: args.api_keys.clone(),
        poll: args.poll,
        k: args.k,
        overlay_weight: f64::from(args.fronts),
        max_attempts: args.max_attempts,
        seed,
    })
    .await
    .map_err(|e| anyhow!("{e}"))?;
    let listener = e2b_api::front::bind(args.listen)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    let local = listener.local_addr()?;
    if let Some(f) = &args.addr_file {
        fs_cache::write_atomic(f, local.to_string().as_bytes())
            .with_context(|| format!("write {}", f.display()))?;
    }
    eprintln!(
        "strata api: e2b api on http://{local}, {} nodes",
        lines.len()
    );
    // Stateless: a signal's default action (the end) loses nothing.
    e2b_api::front::serve(front, listener).await;
    Ok(())
}
