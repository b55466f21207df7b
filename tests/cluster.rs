//! The cluster on one machine: several node daemons (each with its own home, cache, run
//! directory, runc root, cgroup parent and node name; one shared POSIX store) behind one or
//! two fronts (`strata api`), driven by the unmodified `e2b` Python SDK (`tests/e2b/`).
//! Every test runs as root, cleans up however it ends (sandboxes, daemons, fronts, mounts,
//! cgroup parents), and says SKIPPED loudly — failing under `CI=true` — where runc, the base
//! or the SDK is missing.
//!
//! The burst's size is `STRATA_CLUSTER_SANDBOXES` (default 512, the issue's; about 2 minutes
//! on 2 vCPUs, both tests side by side).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BASE: &str = "base/debian:12";
const API_KEY: &str = "strata-cluster-key-0123456789";
/// Each sandbox's memory limit (its template's): what placement balances besides the count.
const SANDBOX_MEMORY: u64 = 64 << 20;

fn strata_bin() -> &'static str {
    env!("CARGO_BIN_EXE_strata")
}

fn wait_for_file(path: &Path, child: &mut Child, what: &str, log: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.trim().is_empty() {
                return s.trim().to_owned();
            }
        }
        if let Some(s) = child.try_wait().unwrap() {
            panic!(
                "{what} exited ({s}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not up within 60 s: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET path` with the cluster's API key: the status and the body.
fn http_get(addr: &str, path: &str) -> (u16, String) {
    common::api_get(addr, path, API_KEY)
}

struct NodeProc {
    name: String,
    home: PathBuf,
    run: PathBuf,
    log: PathBuf,
    addr: String,
    daemon: Option<Child>,
}

struct FrontProc {
    listen: String,
    addr: String,
    log: PathBuf,
    child: Option<Child>,
}

/// Nodes and fronts on one machine; everything removed on drop.
struct Cluster {
    tmp: tempfile::TempDir,
    store: PathBuf,
    keys: PathBuf,
    nodes: Vec<NodeProc>,
    fronts: Vec<FrontProc>,
}

impl Cluster {
    /// `nodes` node daemons named `<prefix>0…` (one template `base`: the Debian base, each
    /// sandbox limited to [`SANDBOX_MEMORY`]) and `fronts` fronts in front of all of them.
    fn start(prefix: &str, nodes: usize, fronts: usize) -> Cluster {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("strata-cluster-{prefix}"))
            .tempdir_in("/var/tmp")
            .unwrap();
        let keys = tmp.path().join("keys");
        std::fs::write(&keys, format!("{API_KEY}\n")).unwrap();
        let mut c = Cluster {
            store: tmp.path().join("store"),
            keys,
            tmp,
            nodes: Vec::new(),
            fronts: Vec::new(),
        };
        // One shared store: the layer is built once, every node reads it.
        let out = c
            .cmd(
                &c.tmp.path().join("build-home"),
                &c.tmp.path().join("build-run"),
            )
            .args(["layer", "build"])
            .arg(common::debian_root().unwrap())
            .args(["--name", BASE])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for i in 0..nodes {
            let name = format!("{prefix}{i}");
            let dir = c.tmp.path().join(&name);
            c.nodes.push(NodeProc {
                home: dir.join("home"),
                run: dir.join("run"),
                log: dir.join("daemon.log"),
                name,
                addr: String::new(),
                daemon: None,
            });
            std::fs::create_dir_all(&dir).unwrap();
            c.spawn_node(i);
            c.node_ok(
                i,
                &[
                    "template",
                    "set",
                    "base",
                    "--layer",
                    BASE,
                    "--memory",
                    &SANDBOX_MEMORY.to_string(),
                ],
            );
        }
        for i in 0..fronts {
            c.fronts.push(FrontProc {
                listen: "127.0.0.1:0".into(),
                addr: String::new(),
                log: c.tmp.path().join(format!("front{i}.log")),
                child: None,
            });
            c.spawn_front(i);
        }
        c
    }

    fn cmd(&self, home: &Path, run: &Path) -> Command {
        let mut c = Command::new(strata_bin());
        c.env("STRATA_HOME", home)
            .env("STRATA_RUN_DIR", run)
            .env_remove("STRATA_STORE")
            .env_remove("STRATA_UPPERS_SIZE")
            .env_remove("STRATA_NODE_NAME")
            .arg("--store")
            .arg(&self.store);
        c
    }

    fn node_cmd(&self, i: usize) -> Command {
        self.cmd(&self.nodes[i].home, &self.nodes[i].run)
    }

    fn node_ok(&self, i: usize, args: &[&str]) -> String {
        let out = self.node_cmd(i).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "node {i}: strata {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn spawn_node(&mut self, i: usize) {
        let n = &self.nodes[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&n.log)
            .unwrap();
        let addr_file = n.run.join("api.addr");
        let _ = std::fs::remove_file(&addr_file);
        // A restart listens where it did (the fronts know the node by its URL).
        let listen = if n.addr.is_empty() {
            "127.0.0.1:0".to_owned()
        } else {
            n.addr.clone()
        };
        let mut c = self.node_cmd(i);
        c.arg("daemon")
            .args(["--api", &listen, "--api-keys"])
            .arg(&self.keys)
            .args(["--node-name", &n.name])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let mut child = c.spawn().unwrap();
        let addr = wait_for_file(&addr_file, &mut child, "a node daemon", &n.log);
        let n = &mut self.nodes[i];
        n.addr = addr;
        n.daemon = Some(child);
    }

    fn spawn_front(&mut self, i: usize) {
        let f = &self.fronts[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&f.log)
            .unwrap();
        let addr_file = self.tmp.path().join(format!("front{i}.addr"));
        let _ = std::fs::remove_file(&addr_file);
        let mut c = Command::new(strata_bin());
        c.arg("api")
            .args(["--listen", &f.listen, "--api-keys"])
            .arg(&self.keys)
            .args(["--fronts", &self.fronts.len().to_string()])
            .arg("--addr-file")
            .arg(&addr_file)
            .env("STRATA_LOG", "info,e2b_api::front=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        for n in &self.nodes {
            c.args(["--node", &format!("http://{}", n.addr)]);
        }
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let mut child = c.spawn().unwrap();
        let addr = wait_for_file(&addr_file, &mut child, "a front", &f.log);
        let f = &mut self.fronts[i];
        // A restart listens where it did.
        f.listen = addr.clone();
        f.addr = addr;
        f.child = Some(child);
    }

    /// SIGKILL front `i` and wait for its end.
    fn kill_front(&mut self, i: usize) {
        if let Some(mut c) = self.fronts[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Wait for node `i`'s daemon (killed by someone else) to end.
    fn reap_node(&mut self, i: usize) {
        if let Some(mut d) = self.nodes[i].daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }

    fn front_urls(&self) -> String {
        self.fronts
            .iter()
            .map(|f| format!("http://{}", f.addr))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Run `tests/e2b/<script> args` against the fronts; its output (must end in ALL OK).
    fn python(&self, script: &str, args: &[&str]) -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/e2b")
            .join(script);
        // `strata` for the scripts that call the node's CLI: tries every node's socket.
        let wrapper = self.tmp.path().join("strata-any-node");
        let mut sh = String::from("#!/bin/sh\n");
        for n in &self.nodes {
            sh.push_str(&format!(
                "STRATA_HOME={} STRATA_RUN_DIR={} {} --store {} \"$@\" 2>/dev/null && exit 0\n",
                n.home.display(),
                n.run.display(),
                strata_bin(),
                self.store.display()
            ));
        }
        sh.push_str("exit 1\n");
        std::fs::write(&wrapper, sh).unwrap();
        std::fs::set_permissions(
            &wrapper,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let url = format!("http://{}", self.fronts[0].addr);
        let t0 = Instant::now();
        let out = Command::new(common::E2B_PYTHON)
            .args(["-X", "faulthandler"])
            .arg(&path)
            .args(args)
            .env("STRATA_TEST_DIR", self.tmp.path())
            .env("STRATA_BIN", &wrapper)
            .env("E2B_API_URL", &url)
            .env("E2B_SANDBOX_URL", &url)
            .env("E2B_API_KEY", API_KEY)
            .env("STRATA_TEMPLATE", "base")
            .env("STRATA_FRONTS", self.front_urls())
            .env_remove("E2B_DEBUG")
            .env_remove("E2B_DOMAIN")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        println!(
            "{script} {args:?} ({:.1} s):\n{stdout}",
            t0.elapsed().as_secs_f64()
        );
        if !common::script_passed(script, out.status, &stdout, &stderr) {
            let mut logs = String::new();
            for f in &self.fronts {
                let l = std::fs::read_to_string(&f.log).unwrap_or_default();
                logs.push_str(&format!("--- front {} ---\n{}\n", f.addr, tail(&l)));
            }
            for n in &self.nodes {
                let l = std::fs::read_to_string(&n.log).unwrap_or_default();
                logs.push_str(&format!("--- node {} ---\n{}\n", n.name, tail(&l)));
            }
            panic!(
                "{script} {args:?} failed ({}):\n{stdout}\n{stderr}\n{logs}",
                out.status
            );
        }
        stdout
    }

    /// Each node's status (`GET /strata/node`).
    fn statuses(&self) -> Vec<serde_json::Value> {
        self.nodes
            .iter()
            .map(|n| {
                let (code, body) = http_get(&n.addr, "/strata/node");
                assert_eq!(code, 200, "{}: {body}", n.name);
                serde_json::from_str(&body).unwrap()
            })
            .collect()
    }

    fn ids(&self, i: usize) -> Vec<String> {
        let out = self
            .node_cmd(i)
            .args(["--json", "sandbox", "ls"])
            .stderr(Stdio::null())
            .output();
        let Ok(out) = out else { return vec![] };
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn tail(s: &str) -> &str {
    let cut = s.len().saturating_sub(6000);
    let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    &s[cut..]
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.fronts.len() {
            self.kill_front(i);
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i].daemon.is_none() {
                // Killed by the test: bring it back to remove its sandboxes.
                let restart =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.spawn_node(i)));
                if restart.is_err() {
                    eprintln!("cluster: node {i} did not restart for the cleanup");
                }
            }
            let ids = self.ids(i);
            if !ids.is_empty() {
                let _ = self
                    .node_cmd(i)
                    .args(["sandbox", "rm"])
                    .args(&ids)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            if let Some(mut d) = self.nodes[i].daemon.take() {
                if let Some(pid) = rustix::process::Pid::from_raw(d.id() as i32) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                }
                let deadline = Instant::now() + Duration::from_secs(20);
                while d.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = d.kill();
                let _ = d.wait();
            }
            let n = &self.nodes[i];
            let runc_root = n.run.join("runc");
            if let Ok(rd) = std::fs::read_dir(&runc_root) {
                for e in rd.flatten() {
                    let _ = Command::new("runc")
                        .arg("--root")
                        .arg(&runc_root)
                        .args(["delete", "--force"])
                        .arg(e.file_name())
                        .stderr(Stdio::null())
                        .status();
                }
            }
            // The node's cgroup parent, in every hierarchy (empty once its sandboxes are gone).
            for (_, dir) in sandbox_runtime::cgroup::of_path(&format!("/strata-{}", n.name)) {
                let _ = std::fs::remove_dir(dir);
            }
        }
        // The fd holders the daemons started (`strata fuse-holder --run-dir RUN`).
        let runs: Vec<String> = self
            .nodes
            .iter()
            .map(|n| n.run.to_string_lossy().into_owned())
            .collect();
        bench::node::kill_fuse_holders(&runs);
        bench::node::unmount_under(self.tmp.path());
        for n in &self.nodes {
            let _ = ublk_daemon::node::sys::detach_stale(&n.run);
        }
    }
}

/// The bound on max / mean of a burst's placement, by count and by reserved memory: losing
/// the in-flight overlay places 1.27 and 1.51 (bench/README.md, "Placement"); a node whose
/// status answers seconds late (each poll read all of mountinfo, until 2026-12-07) placed
/// 1.14-1.20, its stale count drawing both fronts' creates.
const BURST_BALANCE: f64 = 1.15;

/// max / mean of `xs`.
fn max_over_mean(xs: &[f64]) -> f64 {
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    xs.iter().cloned().fold(0.0, f64::max) / mean
}

#[test]
fn two_nodes_behind_a_front_serve_the_sdk_flows() {
    if !common::e2b_ready("two_nodes_behind_a_front_serve_the_sdk_flows") {
        return;
    }
    let c = Cluster::start("f", 2, 1);
    // Every envd feature (commands, PTYs, files, watches, signed URLs, a port by Host)
    // through the front, on whichever node each sandbox lands.
    c.python("sync_flow.py", &[]);
    c.python("async_flow.py", &[]);
    c.python("protocol.py", &[]);
    // A front restarted while a command streams through it: the SDK reconnects by pid
    // through the restarted front and loses nothing the node kept.
    let mut c = c;
    c.python("front_restart.py", &["start"]);
    c.kill_front(0);
    c.spawn_front(0);
    c.python("front_restart.py", &["end"]);
    for i in 0..2 {
        assert!(c.ids(i).is_empty(), "the flows leave no sandbox behind");
    }
    // Ids name their node; the front answers for a name it does not know.
    let (code, body) = http_get(&c.fronts[0].addr, "/sandboxes/zz-inothere");
    assert_eq!(code, 404, "{body}");
}

fn burst_size() -> usize {
    std::env::var("STRATA_CLUSTER_SANDBOXES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512)
}

#[test]
fn a_burst_through_two_fronts_outlives_a_node_and_a_front() {
    if !common::e2b_ready("a_burst_through_two_fronts_outlives_a_node_and_a_front") {
        return;
    }
    let n = burst_size();
    let mut c = Cluster::start("b", 4, 2);
    let dir = c.tmp.path().to_owned();
    let first = dir.join("first.json");
    let second = dir.join("second.json");

    // 1. The burst, all nodes up: balanced by count and by memory.
    c.python(
        "cluster.py",
        &["burst", &n.to_string(), first.to_str().unwrap()],
    );
    let st = c.statuses();
    let counts: Vec<f64> = st
        .iter()
        .map(|s| s["sandboxes"].as_f64().unwrap())
        .collect();
    let mem: Vec<f64> = st
        .iter()
        .map(|s| s["reserved"]["mem_bytes"].as_f64().unwrap())
        .collect();
    println!("placement: sandboxes {counts:?}, reserved memory {mem:?}");
    for f in &c.fronts {
        let l = std::fs::read_to_string(&f.log).unwrap_or_default();
        let sent: Vec<usize> = (0..c.nodes.len())
            .map(|i| l.matches(&format!(" sent to node {i}\n")).count())
            .collect();
        println!(
            "front {}: polls kept {}, down {}, creates retried {}, sent by node {sent:?}",
            f.addr,
            l.matches("last status kept").count(),
            l.matches(": down:").count(),
            l.matches("trying another node").count()
        );
    }
    assert_eq!(counts.iter().sum::<f64>() as usize, n, "{counts:?}");
    // With the overlay and statuses that answer within the poll's timeout: 1.00-1.01 on
    // 2 vCPUs (no poll kept). A node that answers late is seen stale by both fronts.
    assert!(
        max_over_mean(&counts) <= BURST_BALANCE,
        "by count: {counts:?}"
    );
    assert!(max_over_mean(&mem) <= BURST_BALANCE, "by memory: {mem:?}");
    c.python("cluster.py", &["reach", first.to_str().unwrap()]);

    // 2. A second burst; the least loaded node is killed (SIGKILL) after a quarter of it:
    //    its creates go elsewhere and the burst completes. It comes back with its sandboxes.
    //    (Least loaded: the fronts send it the first creates of the burst, so some are in
    //    flight when it dies; the most loaded node got none before the kill in a CI run.)
    let m = (n / 2).max(8);
    let victim = (0..counts.len())
        .min_by(|&a, &b| counts[a].total_cmp(&counts[b]))
        .unwrap_or(0);
    let pid = c.nodes[victim].daemon.as_ref().unwrap().id();
    c.python(
        "cluster.py",
        &[
            "burst",
            &m.to_string(),
            second.to_str().unwrap(),
            &pid.to_string(),
            &(m / 4).to_string(),
        ],
    );
    c.reap_node(victim);
    let retried: usize = c
        .fronts
        .iter()
        .map(|f| {
            std::fs::read_to_string(&f.log)
                .unwrap_or_default()
                .matches("trying another node")
                .count()
        })
        .sum();
    println!("creates retried on another node after the kill: {retried}");
    assert!(
        retried > 0,
        "the killed node's creates in flight went elsewhere"
    );
    c.spawn_node(victim);

    // 3. A front killed and restarted (on its address): nothing lost; every sandbox of both
    //    bursts is listed and reachable through either front.
    c.kill_front(1);
    c.spawn_front(1);
    let mut all: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(&first).unwrap()).unwrap();
    let more: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(&second).unwrap()).unwrap();
    all.extend(more);
    let both = dir.join("both.json");
    std::fs::write(&both, serde_json::to_string(&all).unwrap()).unwrap();
    c.python("cluster.py", &["list", both.to_str().unwrap()]);
    c.python("cluster.py", &["reach", both.to_str().unwrap()]);
    // More only if the killed node finished a create but died before it answered (the
    // front then made it elsewhere): that one is the node's, not the client's.
    let total: usize = (0..c.nodes.len()).map(|i| c.ids(i).len()).sum();
    assert!(
        total >= n + m,
        "{total} sandboxes on the nodes, {} created",
        n + m
    );
    println!("{} sandboxes on the nodes for {} created", total, n + m);
}
