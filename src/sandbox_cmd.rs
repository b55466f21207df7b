//! `strata sandbox …`: a client of the node daemon's sandbox operations
//! (`sandbox_runtime::proto`). The daemon owns every sandbox; these commands only ask.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use sandbox_runtime::proto::{
    parse_stack, CopyRequest, CpuClass, CreateRequest, Direction, ExecEvent, ExecRequest,
    ExecResult, ExitReason, InputRequest, Limits, Network, PoolInfo, PoolRequest, Request,
    RunRequest, SandboxDetail, SandboxInfo, Stream,
};
use ublk_daemon::node::client::Client;
use ublk_daemon::node::proto::ApiError;

use crate::cache_cmd::{parse_size, CacheOpts};
use crate::node_cmd::{self, NodeOpts, StoreArg};

#[derive(clap::Subcommand, Debug)]
pub enum SandboxCmd {
    /// Create a sandbox on a stack of layers and start it; prints its id.
    Create(CreateArgs),
    /// Run a command in a sandbox, streaming its output; exits with its status (124: timed
    /// out, 137: killed or out of memory).
    Exec(ExecArgs),
    /// Follow a running (or finished) exec again: what it wrote, then its end.
    Attach {
        id: String,
        exec: String,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Copy files or directories: `cp HOSTPATH ID:PATH` or `cp ID:PATH HOSTPATH`.
    Cp {
        src: String,
        dst: String,
        /// At most this much file data.
        #[arg(long, value_parser = parse_size)]
        max_bytes: Option<u64>,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// The node's sandboxes.
    Ls {
        #[command(flatten)]
        node: NodeOpts,
    },
    /// One sandbox: state, init pid, cgroups, memory, stack, upper, execs.
    Inspect {
        id: String,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Freeze every process of a sandbox (memory and files kept) until `resume`.
    Pause {
        id: String,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Freeze a sandbox, record what it has resident and reclaim its memory (page cache
    /// that is its own; anonymous memory where the node has swap) until `resume`.
    Suspend {
        id: String,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Thaw a paused sandbox; a suspended one gets what it had resident back first.
    Resume {
        id: String,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Send a signal (a number; default 15, SIGTERM) to a running exec's process group.
    Signal {
        id: String,
        exec: String,
        #[arg(long, default_value_t = 15)]
        signal: i32,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Remove sandboxes: processes, cgroups, upper, mounts (the shared layers stay).
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Replace the egress allowlist of a sandbox created with `--net allow=…`, atomically:
    /// `net ID allow=LIST`.
    Net {
        id: String,
        net: String,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Pack the sandbox (to a snapshot layer) and create COUNT sandboxes from it, each with
    /// its own fresh upper and identity; prints their ids.
    Fork {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// Warm pools of ready sandboxes.
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Run a command in a sandbox of STACK (`REF[,REF…]`) taken from its pool, then remove it.
    Run {
        stack: String,
        #[command(flatten)]
        exec: ExecOpts,
        #[arg(required = true, last = true)]
        command: Vec<String>,
        #[command(flatten)]
        node: NodeOpts,
    },
}

#[derive(clap::Subcommand, Debug)]
pub enum PoolCmd {
    /// Keep SIZE sandboxes of STACK (`REF[,REF…]`, first lowest) ready (0: no pool).
    Set {
        stack: String,
        #[arg(long)]
        size: u32,
        #[command(flatten)]
        node: NodeOpts,
    },
    /// The pools and how many sandboxes each has ready.
    Ls {
        #[command(flatten)]
        node: NodeOpts,
    },
}

#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    /// A layer of the stack (KIND/NAME:VERSION), first lowest; repeat.
    #[arg(long = "layer", required = true)]
    layers: Vec<String>,
    #[arg(long)]
    id: Option<String>,
    /// CPUs (fractions allowed: 0.5).
    #[arg(long)]
    cpus: Option<f64>,
    /// CPU class: `ls` (latency-sensitive, the default) or `be` (best-effort: SCHED_IDLE and
    /// the lowest CPU weight, so it never delays an `ls` sandbox).
    #[arg(long, value_parser = parse_class, default_value = "ls")]
    class: CpuClass,
    /// Memory limit (e.g. 512MiB).
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Process and thread limit.
    #[arg(long)]
    pids: Option<u64>,
    /// Size limit of the sandbox's upper (its writes).
    #[arg(long, value_parser = parse_size)]
    disk: Option<u64>,
    /// KEY=VALUE for every process; repeat.
    #[arg(long = "env")]
    env: Vec<String>,
    /// NAME=VALUE: the file /run/secrets/NAME, on a tmpfs outside the upper; repeat.
    #[arg(long = "secret")]
    secrets: Vec<String>,
    /// NAME of a --secret that every command also gets as the environment variable NAME
    /// (read from the secret's tmpfs at each exec; never stored in the record); repeat.
    #[arg(long = "secret-env")]
    secret_env: Vec<String>,
    /// `none`: loopback only; `allow=CIDR[:PORT[/tcp|udp]],…`: a veth with NAT whose egress
    /// reaches exactly those (private, link-local and the host's own ranges only if listed).
    #[arg(long, default_value = "none")]
    net: String,
    /// Remove the sandbox after this long without an operation (e.g. 10m).
    #[arg(long, value_parser = humantime::parse_duration)]
    idle_timeout: Option<Duration>,
    /// Take a ready sandbox of this stack's warm pool if there is one (only with no other
    /// option but --layer and --json).
    #[arg(long)]
    pooled: bool,
    #[command(flatten)]
    node: NodeOpts,
}

#[derive(clap::Args, Debug)]
pub struct ExecOpts {
    /// Kill the command after this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Captured bytes per stream; past it output is dropped and counted.
    #[arg(long, value_parser = parse_size)]
    max_output: Option<u64>,
    #[arg(long)]
    cwd: Option<String>,
    /// KEY=VALUE; repeat.
    #[arg(long = "env")]
    env: Vec<String>,
    /// uid[:gid] or a user name of the sandbox.
    #[arg(long)]
    user: Option<String>,
    /// A name for the exec (shown by `inspect`).
    #[arg(long)]
    tag: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    id: String,
    #[command(flatten)]
    opts: ExecOpts,
    /// Start it and print its exec id; follow it with `attach`.
    #[arg(long)]
    detach: bool,
    #[arg(required = true, last = true)]
    command: Vec<String>,
    #[command(flatten)]
    node: NodeOpts,
}

impl ExecOpts {
    fn request(&self, id: String, command: Vec<String>, detach: bool) -> Result<ExecRequest> {
        let timeout_ms = match self.timeout {
            Some(t) if !(t > 0.0 && t.is_finite()) => {
                bail!("--timeout must be a positive number of seconds")
            }
            Some(t) => Some((t * 1000.0).ceil() as u64),
            None => None,
        };
        Ok(ExecRequest {
            id,
            args: command,
            env: self.env.clone(),
            cwd: self.cwd.clone(),
            user: self.user.clone(),
            timeout_ms,
            max_output: self.max_output,
            stdin: None,
            detach,
            stdin_open: false,
            pty: None,
            tag: self.tag.clone(),
        })
    }
}

fn explain(e: ApiError) -> anyhow::Error {
    anyhow!("{}", e.message)
}

fn running(node: &NodeOpts) -> Result<Client> {
    node_cmd::connect_running_any(node)?.ok_or_else(|| {
        anyhow!(
            "no strata daemon runs on {} (create a sandbox first)",
            node.run_dir.display()
        )
    })
}

fn call<T: serde::de::DeserializeOwned>(c: &mut Client, r: &Request) -> Result<T> {
    c.call_streaming(&r.to_value(), |_| Ok(())).map_err(explain)
}

/// `strata sandbox …`.
pub fn run(cmd: SandboxCmd, store: &StoreArg, cache: &CacheOpts, json: bool) -> Result<()> {
    match cmd {
        SandboxCmd::Create(a) => create(a, store, cache, json),
        SandboxCmd::Exec(a) => {
            let mut c = running(&a.node)?;
            let detach = a.detach;
            let req = Request::SandboxExec(a.opts.request(a.id, a.command, detach)?);
            if detach {
                let v: serde_json::Value = call(&mut c, &req)?;
                if json {
                    crate::print_json(&v)?;
                } else {
                    println!("{}", v["exec"].as_str().unwrap_or_default());
                }
                return Ok(());
            }
            follow(&mut c, &req, json)
        }
        SandboxCmd::Attach { id, exec, node } => {
            let mut c = running(&node)?;
            let req = Request::SandboxAttach(sandbox_runtime::proto::AttachRequest {
                id,
                exec,
                stdout_from: 0,
                stderr_from: 0,
            });
            follow(&mut c, &req, json)
        }
        SandboxCmd::Run {
            stack,
            exec,
            command,
            node,
        } => {
            let mut c = running(&node)?;
            let req = Request::SandboxRun(RunRequest {
                stack,
                exec: exec.request(String::new(), command, false)?,
            });
            follow(&mut c, &req, json)
        }
        SandboxCmd::Cp {
            src,
            dst,
            max_bytes,
            node,
        } => {
            let (id, direction, host, path) = match (split_remote(&src), split_remote(&dst)) {
                (None, Some((id, p))) => (id, Direction::In, src.clone(), p),
                (Some((id, p)), None) => (id, Direction::Out, dst.clone(), p),
                (Some(_), Some(_)) => {
                    bail!("cp copies between the host and a sandbox, not between sandboxes")
                }
                (None, None) => bail!("one side of cp must be ID:PATH"),
            };
            let host = std::path::absolute(PathBuf::from(&host))
                .with_context(|| format!("resolve {host}"))?;
            let mut c = running(&node)?;
            let r: sandbox_runtime::proto::CopyResult = call(
                &mut c,
                &Request::SandboxCp(CopyRequest {
                    id,
                    direction,
                    host,
                    path,
                    max_bytes,
                }),
            )?;
            if json {
                crate::print_json(&r)?;
            } else {
                println!(
                    "{} files, {} directories, {} symlinks, {} bytes",
                    r.files, r.dirs, r.symlinks, r.bytes
                );
            }
            Ok(())
        }
        SandboxCmd::Ls { node } => {
            let mut c = running(&node)?;
            let v: Vec<SandboxInfo> = call(&mut c, &Request::SandboxLs {})?;
            if json {
                return crate::print_json(&v);
            }
            println!(
                "{:<20} {:<9} {:>8} {:<8} STACK",
                "ID", "STATE", "PID", "POOL"
            );
            for s in v {
                println!(
                    "{:<20} {:<9} {:>8} {:<8} {}",
                    s.id,
                    state_name(&s),
                    s.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                    s.pool.as_deref().map(|_| "yes").unwrap_or("-"),
                    s.layers.join(" ")
                );
            }
            Ok(())
        }
        SandboxCmd::Inspect { id, node } => {
            let mut c = running(&node)?;
            let d: SandboxDetail = call(&mut c, &Request::SandboxInspect { id })?;
            if json {
                return crate::print_json(&d);
            }
            println!("id:        {}", d.info.id);
            println!("state:     {}", state_name(&d.info));
            if let Some(p) = d.info.pid {
                println!("init pid:  {p}");
            }
            println!("stack:     {}", d.info.layers.join(" "));
            println!("rootfs:    {}", d.rootfs.display());
            println!("upper:     {} ({} bytes)", d.upper.display(), d.upper_bytes);
            println!("memory:    {} anon, {} file", d.memory_anon, d.memory_file);
            println!("pids:      {}", d.pids);
            if let Some(p) = &d.sched_policy {
                println!("sched:     {p}");
            }
            for (c, p) in &d.cgroups {
                println!("cgroup:    {c} {}", p.display());
            }
            for e in &d.execs {
                println!(
                    "exec:      {} {} {}",
                    e.exec,
                    if e.running { "running" } else { "done" },
                    e.args.join(" ")
                );
            }
            Ok(())
        }
        SandboxCmd::Pause { id, node } => pause(&node, Request::SandboxPause { id }, json),
        SandboxCmd::Suspend { id, node } => {
            let mut c = running(&node)?;
            let r: sandbox_runtime::SuspendReport = call(&mut c, &Request::SandboxSuspend { id })?;
            if json {
                return crate::print_json(&r);
            }
            let h = crate::human;
            println!(
                "{} suspended in {} ms (record {} ms, reclaim {} ms)",
                r.info.id, r.suspend_ms, r.record_ms, r.reclaim_ms
            );
            println!(
                "memory:   {} → {} (anon {} → {}, file {} → {}, swap {} → {}; swap on node: {})",
                h(r.before.usage),
                h(r.after.usage),
                h(r.before.anon),
                h(r.after.anon),
                h(r.before.file),
                h(r.after.file),
                h(r.before.swap),
                h(r.after.swap),
                if r.swap { "yes" } else { "no" }
            );
            println!(
                "recorded: {} files, {} resident{}; anon {}",
                r.files,
                h(r.file_bytes),
                if r.truncated { " (truncated)" } else { "" },
                h(r.anon_bytes)
            );
            println!(
                "reclaim:  {} files dropped, {} kept for running neighbours{}; paged out {}; {}",
                r.files_dropped,
                r.files_kept_shared,
                if r.shared_layers.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", r.shared_layers.join(", "))
                },
                h(r.pageout_bytes),
                r.cgroup_reclaim
            );
            Ok(())
        }
        SandboxCmd::Resume { id, node } => {
            let mut c = running(&node)?;
            let r: sandbox_runtime::ResumeResult = call(&mut c, &Request::SandboxResume { id })?;
            if json {
                return crate::print_json(&r);
            }
            println!("{} {}", r.info.id, state_name(&r.info));
            if let Some(p) = r.prefetch {
                let h = crate::human;
                println!(
                    "resumed in {} ms: chunks {} in {} ms ({} failed), pages {} of {} files \
                     in {} ms ({} skipped), swap-in {}, thaw {} ms",
                    p.resume_ms,
                    h(p.chunk_bytes),
                    p.chunks_ms,
                    p.chunk_errors,
                    h(p.page_bytes),
                    p.files,
                    p.pages_ms,
                    p.files_skipped,
                    h(p.swapin_bytes),
                    p.thaw_ms
                );
            }
            Ok(())
        }
        SandboxCmd::Signal {
            id,
            exec,
            signal,
            node,
        } => {
            let mut c = running(&node)?;
            let _: serde_json::Value = call(
                &mut c,
                &Request::SandboxInput(InputRequest {
                    id,
                    exec,
                    signal: Some(signal),
                    ..Default::default()
                }),
            )?;
            Ok(())
        }
        SandboxCmd::Rm { ids, node } => {
            let mut c = running(&node)?;
            let mut failed = 0;
            for id in ids {
                match call::<SandboxInfo>(&mut c, &Request::SandboxRm { id: id.clone() }) {
                    Ok(_) => {
                        if !json {
                            println!("{id}");
                        }
                    }
                    Err(e) => {
                        eprintln!("strata: rm {id}: {e:#}");
                        failed += 1;
                    }
                }
            }
            if failed > 0 {
                bail!("{failed} sandboxes not removed");
            }
            Ok(())
        }
        SandboxCmd::Pool(PoolCmd::Set { stack, size, node }) => {
            let mut c = running_or_start(&node, store, cache)?;
            let p: PoolInfo = call(
                &mut c,
                &Request::SandboxPoolSet(PoolRequest { stack, size }),
            )?;
            if json {
                crate::print_json(&p)
            } else {
                println!("{}: {} wanted, {} ready", p.stack, p.size, p.ready);
                Ok(())
            }
        }
        SandboxCmd::Net { id, net, node } => {
            let Network::Allow(allow) = parse_net(&net)? else {
                bail!("a sandbox's network cannot be taken away; give `allow=` with the new list");
            };
            let mut c = running(&node)?;
            let info: SandboxInfo = call(&mut c, &Request::SandboxNet { id, allow })?;
            if json {
                crate::print_json(&info)
            } else {
                println!("{}", info.id);
                Ok(())
            }
        }
        SandboxCmd::Fork { id, count, node } => {
            let mut c = running(&node)?;
            let f: sandbox_runtime::ForkResult = call(&mut c, &Request::SandboxFork { id, count })?;
            if json {
                return crate::print_json(&f);
            }
            eprintln!(
                "packed {} ({} files, {}; frozen {} ms)",
                f.pack.layer,
                f.pack.packed_files,
                crate::human(f.pack.packed_bytes),
                f.pack.frozen_ms.unwrap_or(0)
            );
            for s in f.sandboxes {
                println!("{}", s.id);
            }
            Ok(())
        }
        SandboxCmd::Pool(PoolCmd::Ls { node }) => {
            let mut c = running(&node)?;
            let v: Vec<PoolInfo> = call(&mut c, &Request::SandboxPoolLs {})?;
            if json {
                return crate::print_json(&v);
            }
            for p in v {
                println!("{}: {} wanted, {} ready", p.stack, p.size, p.ready);
            }
            Ok(())
        }
    }
}

fn parse_net(s: &str) -> Result<Network> {
    match s {
        "none" => Ok(Network::None),
        _ => match s.strip_prefix("allow=") {
            Some(list) => Ok(Network::Allow(
                sandbox_runtime::net::parse_allowlist(list).map_err(|e| anyhow!("--net: {e}"))?,
            )),
            None => bail!("--net {s}: want `none` or `allow=CIDR[:PORT[/PROTO]],…`"),
        },
    }
}

fn pause(node: &NodeOpts, r: Request, json: bool) -> Result<()> {
    let mut c = running(node)?;
    let info: SandboxInfo = call(&mut c, &r)?;
    if json {
        crate::print_json(&info)
    } else {
        println!("{} {}", info.id, state_name(&info));
        Ok(())
    }
}

fn state_name(s: &SandboxInfo) -> String {
    serde_json::to_value(s.state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn parse_class(s: &str) -> std::result::Result<CpuClass, String> {
    match s {
        "ls" => Ok(CpuClass::Ls),
        "be" => Ok(CpuClass::Be),
        _ => Err(format!("{s:?}: want ls or be")),
    }
}

fn split_remote(s: &str) -> Option<(String, String)> {
    let (id, path) = s.split_once(':')?;
    (!id.is_empty() && !id.contains('/')).then(|| (id.to_owned(), path.to_owned()))
}

fn running_or_start(node: &NodeOpts, store: &StoreArg, cache: &CacheOpts) -> Result<Client> {
    Ok(node_cmd::connect_or_start(node, store, cache)?.0)
}

fn create(a: CreateArgs, store: &StoreArg, cache: &CacheOpts, json: bool) -> Result<()> {
    let net = parse_net(&a.net)?;
    let cpu_millis = match a.cpus {
        Some(c) if !(c > 0.0 && c.is_finite()) => bail!("--cpus must be positive"),
        Some(c) => Some((c * 1000.0).round().max(1.0) as u64),
        None => None,
    };
    let req = Request::SandboxCreate(CreateRequest {
        layers: a.layers.iter().flat_map(|l| parse_stack(l)).collect(),
        id: a.id,
        limits: Limits {
            cpu_millis,
            memory: a.memory,
            pids: a.pids,
            disk: a.disk,
            class: a.class,
        },
        env: a.env,
        secrets: a.secrets,
        secret_env: a.secret_env,
        net,
        idle_timeout_s: a.idle_timeout.map(|d| d.as_secs().max(1)),
        pooled: a.pooled,
    });
    let mut c = running_or_start(&a.node, store, cache)?;
    let info: SandboxInfo = call(&mut c, &req)?;
    if json {
        crate::print_json(&info)
    } else {
        println!("{}", info.id);
        Ok(())
    }
}

/// Stream an exec's output to this process's stdout and stderr; exit with its status.
fn follow(c: &mut Client, req: &Request, json: bool) -> Result<()> {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let b64 = base64::engine::general_purpose::STANDARD;
    let r: ExecResult = c
        .call_streaming(&req.to_value(), |ev| {
            let Ok(ev) = serde_json::from_value::<ExecEvent>(ev) else {
                return Ok(());
            };
            if let ExecEvent::Output { stream, data, .. } = ev {
                let bytes = b64.decode(data).unwrap_or_default();
                let io = match (json, stream) {
                    (true, Stream::Stdout) => {
                        out.extend_from_slice(&bytes);
                        Ok(())
                    }
                    (true, Stream::Stderr) => {
                        err.extend_from_slice(&bytes);
                        Ok(())
                    }
                    (false, Stream::Stdout) => {
                        let mut o = std::io::stdout().lock();
                        o.write_all(&bytes).and_then(|()| o.flush())
                    }
                    (false, Stream::Stderr) => std::io::stderr().write_all(&bytes),
                };
                io.map_err(|e| {
                    ApiError::new(ublk_daemon::node::proto::ErrorKind::Internal, e.to_string())
                })?;
            }
            Ok(())
        })
        .map_err(explain)?;
    if json {
        let mut v = serde_json::to_value(&r)?;
        v["stdout"] = String::from_utf8_lossy(&out).into_owned().into();
        v["stderr"] = String::from_utf8_lossy(&err).into_owned().into();
        crate::print_json(&v)?;
    } else if r.truncated {
        eprintln!(
            "strata: output truncated: the command wrote {} bytes to stdout and {} to stderr, more than --max-output",
            r.stdout_bytes, r.stderr_bytes
        );
    }
    let code = match r.reason {
        ExitReason::Exited => r.exit_code.unwrap_or(0),
        ExitReason::Timeout => {
            if !json {
                eprintln!("strata: the command timed out and was killed");
            }
            124
        }
        ExitReason::Oom => {
            if !json {
                eprintln!("strata: the command was killed: the sandbox ran out of memory");
            }
            137
        }
        ExitReason::Killed => {
            if !json {
                eprintln!("strata: the command was killed from outside");
            }
            137
        }
        ExitReason::Failed => {
            if !json {
                eprintln!(
                    "strata: the command did not start: {}",
                    r.message.unwrap_or_default()
                );
            }
            125
        }
    };
    std::io::stdout().flush().ok();
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

/// `strata pack-diff`.
#[derive(clap::Args, Debug)]
pub struct PackArgs {
    /// The sandbox.
    id: String,
    /// The new layer, KIND/NAME:VERSION; its parents are the sandbox's stack.
    #[arg(long)]
    name: String,
    /// More residue rules (gitignore syntax), applied after the defaults.
    #[arg(long)]
    strip: Option<PathBuf>,
    /// Leave out the default residue rules (temporary files, package caches, histories,
    /// the runtime's files, machine id and SSH host keys).
    #[arg(long)]
    no_default_strip: bool,
    #[command(flatten)]
    node: NodeOpts,
}

/// Pack a sandbox's upper into a new layer.
pub fn pack(a: PackArgs, json: bool) -> Result<()> {
    let strip = match &a.strip {
        Some(p) => {
            Some(std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?)
        }
        None => None,
    };
    let mut c = running(&a.node)?;
    // A pack reads the whole upper: no read timeout.
    c.set_read_timeout(None).context("the daemon's socket")?;
    let r: sandbox_runtime::PackResult = call(
        &mut c,
        &Request::SandboxPack(sandbox_runtime::PackRequest {
            id: a.id,
            name: a.name,
            strip,
            no_default_strip: a.no_default_strip,
        }),
    )?;
    if json {
        return crate::print_json(&r);
    }
    for s in &r.stripped {
        println!(
            "stripped  {} ({}; {} entries, {})",
            s.path,
            s.rule,
            s.entries,
            crate::human(s.bytes)
        );
    }
    for d in &r.disguised_whiteouts {
        println!("warning   {d}: named like an OCI whiteout (packed as a plain file; an OCI export refuses it)");
    }
    println!(
        "{}: {}; {} files ({}) of {} upper entries packed, {} unchanged dropped, {} stripped; \
         meta {} + blob {}; frozen {}, {} ms in all",
        r.layer,
        r.outcome,
        r.packed_files,
        crate::human(r.packed_bytes),
        r.upper_entries,
        r.unchanged_count,
        r.stripped_count,
        crate::human(r.meta_bytes),
        crate::human(r.blob_bytes),
        r.frozen_ms
            .map_or("never".to_owned(), |ms| format!("{ms} ms")),
        r.total_ms
    );
    Ok(())
}
