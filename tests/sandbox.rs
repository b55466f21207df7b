//! Sandboxes end to end, through the `strata` command line and a real node daemon: a real
//! Debian base layer (`scripts/debian-base.sh`), a workspace and a toolkit layer made from
//! real trees, runc, kernel EROFS and overlayfs. Every test runs as root, cleans up however it
//! ends, and says SKIPPED loudly (failing under `CI=true`) where runc or the base is missing.

mod common;
#[path = "sandbox/init.rs"]
mod init;
#[path = "sandbox/io.rs"]
mod io;
#[path = "sandbox/outlive.rs"]
mod outlive;
#[path = "sandbox/pack.rs"]
mod pack;
#[path = "sandbox/qos.rs"]
mod qos;
#[path = "sandbox/suspend.rs"]
mod suspend;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The shared store with the three layers, built once per test binary.
struct Layers {
    _dir: tempfile::TempDir,
    store: PathBuf,
    /// The workspace tree, as built into `workspace/task:1`.
    workspace: PathBuf,
}

const BASE: &str = "base/debian:12";
const WORKSPACE: &str = "workspace/task:1";
const TOOLKIT: &str = "toolkit/tool:1";

fn strata_bin() -> &'static str {
    env!("CARGO_BIN_EXE_strata")
}

/// Whether sandboxes can run here: root, runc, the Debian base. Otherwise a loud
/// SKIPPED line (and a failure under CI, which installs all of them).
fn ready(test: &str) -> bool {
    if !common::require_root(test) {
        return false;
    }
    let missing: Vec<&str> = ["runc"]
        .into_iter()
        .filter(|b| {
            !Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {b}"))
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    let why = if !missing.is_empty() {
        Some(format!("{} not installed", missing.join(", ")))
    } else if layers().is_none() {
        Some("no Debian base root (scripts/debian-base.sh failed)".to_owned())
    } else {
        None
    };
    if let Some(why) = why {
        println!("\n*** SKIPPED {test}: {why} ***\n");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: {why} (scripts/install-test-deps.sh installs it under CI)"
        );
        return false;
    }
    true
}

/// At most the first 2,000 characters of `b` (a failure message stays readable).
fn head(b: &[u8]) -> String {
    String::from_utf8_lossy(b).chars().take(2000).collect()
}

fn run_ok(mut c: Command) -> String {
    let out = c.output().expect("run strata");
    assert!(
        out.status.success(),
        "{c:?} failed ({}): {}{}",
        out.status,
        head(&out.stderr),
        head(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The layers' directory: `/var/tmp/strata-sandbox-layers-<pid>-XXXXXX`.
const LAYERS_PREFIX: &str = "strata-sandbox-layers-";
static LAYERS_DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_layers() {
    if let Some(d) = LAYERS_DIR.get() {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Remove the layers' directories of test binaries that died without exiting (killed).
fn sweep_stale_layers() {
    let Ok(rd) = std::fs::read_dir("/var/tmp") else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(LAYERS_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn layers() -> Option<&'static Layers> {
    static L: OnceLock<Option<Layers>> = OnceLock::new();
    L.get_or_init(|| {
        let base = common::debian_root()?;
        sweep_stale_layers();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{LAYERS_PREFIX}{}-", std::process::id()))
            .tempdir_in("/var/tmp")
            .unwrap();
        // A static is never dropped: the directory goes when the test binary exits.
        let _ = LAYERS_DIR.set(dir.path().to_owned());
        // SAFETY: `remove_layers` is an `extern "C" fn()` that only reads a static set
        // before this call; atexit(3) runs it once at exit(3), on the exiting thread.
        unsafe { libc::atexit(remove_layers) };
        let store = dir.path().join("store");
        // The workspace: a real source tree (this repository's storage core) and a task.
        let workspace = dir.path().join("workspace");
        for (crate_dir, name) in [
            ("fs-cache/src", "fs-cache"),
            ("erofs-builder/src", "erofs-builder"),
        ] {
            let to = workspace.join("work/src").join(name);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            let status = Command::new("cp")
                .arg("-a")
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(crate_dir))
                .arg(&to)
                .status()
                .unwrap();
            assert!(status.success());
        }
        std::fs::write(workspace.join("work/TASK"), "make the tests pass\n").unwrap();
        // The toolkit: a real tree with symlinks (the host's timezone database) and a tool.
        let toolkit = dir.path().join("toolkit");
        std::fs::create_dir_all(toolkit.join("opt/tool/bin")).unwrap();
        let status = Command::new("cp")
            .args(["-a", "/usr/share/zoneinfo"])
            .arg(toolkit.join("opt/tool/zoneinfo"))
            .status()
            .unwrap();
        assert!(status.success());
        std::fs::write(
            toolkit.join("opt/tool/bin/tool"),
            "#!/bin/sh\necho \"tool: $*\"\n",
        )
        .unwrap();
        Command::new("chmod")
            .args(["755"])
            .arg(toolkit.join("opt/tool/bin/tool"))
            .status()
            .unwrap();
        for (tree, name) in [
            (base, BASE),
            (workspace.as_path(), WORKSPACE),
            (toolkit.as_path(), TOOLKIT),
        ] {
            let mut c = Command::new(strata_bin());
            c.env("STRATA_HOME", dir.path().join("home"))
                .arg("--store")
                .arg(&store)
                .args(["layer", "build"])
                .arg(tree)
                .arg("--name")
                .arg(name);
            run_ok(c);
        }
        Some(Layers {
            _dir: dir,
            store,
            workspace,
        })
    })
    .as_ref()
}

/// One node: its own home (cache), run directory and daemon, the shared store. Removes every
/// sandbox, stops the daemon and detaches what is left, however the test ends.
struct Node {
    tmp: tempfile::TempDir,
    home: PathBuf,
    run: PathBuf,
    store: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Node {
    fn new(name: &str) -> Node {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("strata-sb-{name}"))
            .tempdir_in("/var/tmp")
            .unwrap();
        Node {
            home: tmp.path().join("home"),
            run: tmp.path().join("run"),
            store: layers().unwrap().store.clone(),
            tmp,
            env: Vec::new(),
        }
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(strata_bin());
        c.env("STRATA_HOME", &self.home)
            .env("STRATA_RUN_DIR", &self.run)
            .env_remove("STRATA_STORE")
            .env_remove("STRATA_UPPERS_SIZE")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .arg("--store")
            .arg(&self.store);
        c
    }

    fn ok(&self, args: &[&str]) -> String {
        let mut c = self.cmd();
        c.args(args);
        run_ok(c)
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        serde_json::from_str(&self.ok(&all)).unwrap()
    }

    /// `--json ARGS`, whatever the exit status (an exec's is its command's); the answer.
    fn json_any(&self, args: &[&str]) -> serde_json::Value {
        let out = self.cmd().arg("--json").args(args).output().unwrap();
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: {e}: {}{}", text(&out.stdout), text(&out.stderr)))
    }

    /// `create` with the three-layer stack and `extra` options; the id.
    fn create(&self, id: &str, extra: &[&str]) -> String {
        let mut args = vec![
            "sandbox", "create", "--layer", BASE, "--layer", WORKSPACE, "--layer", TOOLKIT, "--id",
            id,
        ];
        args.extend_from_slice(extra);
        self.ok(&args).trim().to_owned()
    }

    /// `exec ID -- sh -c SCRIPT`: the whole output.
    fn sh(&self, id: &str, script: &str) -> Output {
        self.exec(id, &[], script)
    }

    fn exec(&self, id: &str, opts: &[&str], script: &str) -> Output {
        let mut c = self.cmd();
        c.args(["sandbox", "exec", id])
            .args(opts)
            .args(["--", "sh", "-c", script]);
        c.output().unwrap()
    }

    /// `sh`, which must succeed; its stdout.
    fn sh_ok(&self, id: &str, script: &str) -> String {
        let out = self.sh(id, script);
        assert!(
            out.status.success(),
            "{script}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn daemon_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.run.join("strata.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Start a daemon in the background (as `strata mount` would) and wait until it answers.
    fn start_daemon(&self) {
        self.start_daemon_with(&[]);
    }

    /// `start_daemon` with `extra` daemon arguments (`--takeover`: wait until the new daemon
    /// is the one that answers).
    fn start_daemon_with(&self, extra: &[&str]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.tmp.path().join("daemon.log"))
            .unwrap();
        let mut c = self.cmd();
        c.arg("daemon")
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        let mut child = c.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut l = self.cmd();
            l.args(["sandbox", "ls"])
                .stderr(Stdio::null())
                .stdout(Stdio::null());
            let ours =
                !extra.contains(&"--takeover") || self.daemon_pid() == Some(child.id() as i32);
            if ours && l.status().unwrap().success() {
                break;
            }
            if let Some(s) = child.try_wait().unwrap() {
                panic!(
                    "the daemon exited ({s}): {}",
                    std::fs::read_to_string(self.tmp.path().join("daemon.log")).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "no daemon answered within 60 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Reaped in the background: the daemon outlives this handle.
        std::thread::spawn(move || child.wait());
    }

    fn ids(&self) -> Vec<String> {
        let mut c = self.cmd();
        c.args(["--json", "sandbox", "ls"]).stderr(Stdio::null());
        let Ok(out) = c.output() else {
            return vec![];
        };
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

impl Drop for Node {
    fn drop(&mut self) {
        for id in self.ids() {
            let mut c = self.cmd();
            c.args(["sandbox", "rm", &id])
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let _ = c.status();
        }
        if let Some(pid) = self.daemon_pid().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            for _ in 0..100 {
                if rustix::process::test_kill_process(pid).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Whatever is left: containers of this node, its processes, its mounts.
        let runc_root = self.run.join("runc");
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
        let _ = Command::new("pkill")
            .arg("-KILL")
            .arg("-f")
            .arg(self.run.as_os_str())
            .status();
        std::thread::sleep(Duration::from_millis(100));
        if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
            let root = self.tmp.path().to_string_lossy().into_owned();
            let mut mps: Vec<&str> = mi
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|m| m.starts_with(&root))
                .collect();
            mps.sort_by_key(|m| std::cmp::Reverse(m.len()));
            for m in mps {
                let _ = rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH);
            }
        }
        let _ = ublk_daemon::node::sys::detach_stale(&self.run);
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn create_exec_cp_rm_on_a_three_layer_stack() {
    if !ready("create_exec_cp_rm_on_a_three_layer_stack") {
        return;
    }
    let node = Node::new("basic");
    let t0 = Instant::now();
    let id = node.create(
        "basic-a",
        &["--env", "TASK_ID=42", "--secret", "TOKEN=s3cr3t"],
    );
    println!("first create (daemon start included): {:?}", t0.elapsed());
    assert_eq!(id, "basic-a");

    // Every layer is there, the upper takes writes, the env and the secret reach the process.
    let out = node.sh_ok(
        &id,
        "cat /etc/debian_version; cat /work/TASK; /opt/tool/bin/tool x; \
         test -L /opt/tool/zoneinfo/UTC -o -f /opt/tool/zoneinfo/UTC && echo zoneinfo; \
         echo \"$TASK_ID\"; cat /run/secrets/TOKEN; echo; hostname; \
         echo scratch > /root/note; cat /root/note",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("12."), "{out}");
    assert_eq!(
        &lines[1..],
        [
            "make the tests pass",
            "tool: x",
            "zoneinfo",
            "42",
            "s3cr3t",
            "basic-a",
            "scratch"
        ],
        "{out}"
    );
    // The secret is on a tmpfs, never in the upper.
    let upper = PathBuf::from(
        node.json(&["sandbox", "inspect", &id])["upper"]
            .as_str()
            .unwrap(),
    );
    assert!(upper.join("root/note").is_file());
    let grep = Command::new("grep")
        .args(["-r", "-l", "s3cr3t"])
        .arg(&upper)
        .output()
        .unwrap();
    assert!(
        grep.stdout.is_empty(),
        "the secret is in the upper: {}",
        text(&grep.stdout)
    );

    // Exit status, stderr kept apart, cwd, user.
    let o = node.sh(&id, "echo out; echo err >&2; exit 7");
    assert_eq!(o.status.code(), Some(7));
    assert_eq!(text(&o.stdout), "out\n");
    assert_eq!(text(&o.stderr), "err\n");
    let o = node.exec(
        &id,
        &["--cwd", "/work", "--user", "nobody"],
        "pwd; id -u; id -g",
    );
    assert_eq!(
        text(&o.stdout),
        "/work\n65534\n65534\n",
        "{}",
        text(&o.stderr)
    );
    let o = node.exec(&id, &["--env", "X=y z"], "echo \"$X\"");
    assert_eq!(text(&o.stdout), "y z\n");
    let json = node.json_any(&["sandbox", "exec", &id, "--", "sh", "-c", "echo j; exit 3"]);
    assert_eq!(json["exit_code"], 3);
    assert_eq!(json["stdout"], "j\n");
    assert_eq!(json["reason"], "exited");

    // cp in (a file and a tree), cp out, both confined.
    let host = node.tmp.path().join("host");
    std::fs::create_dir_all(host.join("tree/sub")).unwrap();
    std::fs::write(host.join("tree/sub/a.txt"), "A\n").unwrap();
    std::os::unix::fs::symlink("/etc/shadow", host.join("tree/link")).unwrap();
    std::fs::write(host.join("one.txt"), "one\n").unwrap();
    node.ok(&[
        "sandbox",
        "cp",
        host.join("one.txt").to_str().unwrap(),
        &format!("{id}:/root/one.txt"),
    ]);
    node.ok(&[
        "sandbox",
        "cp",
        host.join("tree").to_str().unwrap(),
        &format!("{id}:/root"),
    ]);
    assert_eq!(
        node.sh_ok(
            &id,
            "cat /root/one.txt /root/tree/sub/a.txt; readlink /root/tree/link"
        ),
        "one\nA\n/etc/shadow\n"
    );
    let back = node.tmp.path().join("back");
    node.ok(&[
        "sandbox",
        "cp",
        &format!("{id}:/work/src"),
        back.to_str().unwrap(),
    ]);
    let ws = &layers().unwrap().workspace;
    for f in ["fs-cache/lib.rs", "erofs-builder/writer.rs"] {
        assert_eq!(
            std::fs::read(back.join(f)).unwrap(),
            std::fs::read(ws.join("work/src").join(f)).unwrap(),
            "{f}"
        );
    }
    // A symlink inside pointing at a host path resolves inside the sandbox: to nothing, or
    // to the sandbox's own file (its /etc/hostname is the runtime's, not the base's).
    let host_only = host.join("one.txt");
    node.sh_ok(
        &id,
        &format!(
            "ln -s {} /root/hostlink; ln -s /../../../../etc /root/escape",
            host_only.display()
        ),
    );
    let e = node
        .cmd()
        .args(["sandbox", "cp", &format!("{id}:/root/hostlink")])
        .arg(node.tmp.path().join("h1"))
        .output()
        .unwrap();
    assert!(!e.status.success(), "a symlink to a host path was followed");
    let e = node
        .cmd()
        .args(["sandbox", "cp", &format!("{id}:/root/escape/hostname")])
        .arg(node.tmp.path().join("h"))
        .output()
        .unwrap();
    assert!(e.status.success(), "{}", text(&e.stderr));
    assert_eq!(
        std::fs::read_to_string(node.tmp.path().join("h")).unwrap(),
        "basic-a\n"
    );
    // cp sees what the sandbox sees: its own /tmp.
    node.sh_ok(&id, "echo in-tmp > /tmp/t");
    node.ok(&[
        "sandbox",
        "cp",
        &format!("{id}:/tmp/t"),
        node.tmp.path().join("t").to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read_to_string(node.tmp.path().join("t")).unwrap(),
        "in-tmp\n"
    );

    // inspect: state, init pid, cgroups, memory, the upper's size.
    let d = node.json(&["sandbox", "inspect", &id]);
    assert_eq!(d["state"], "running");
    let pid = d["pid"].as_u64().unwrap();
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    let mem_cg = PathBuf::from(
        d["cgroups"]["memory"]
            .as_str()
            .or(d["cgroups"]["unified"].as_str())
            .unwrap(),
    );
    assert!(mem_cg.is_dir(), "{}", mem_cg.display());
    assert!(d["upper_bytes"].as_u64().unwrap() > 0);
    assert!(
        d["memory_file"].as_u64().unwrap() + d["memory_anon"].as_u64().unwrap() > 0,
        "{d}"
    );
    assert!(!d["execs"].as_array().unwrap().is_empty());

    // A second sandbox shares the layer mounts: still three layers on the node.
    let id2 = node.create("basic-b", &[]);
    let status = node.json(&["status"]);
    assert_eq!(status["layers"].as_array().unwrap().len(), 3, "{status}");
    assert_eq!(
        node.sh_ok(&id2, "cat /root/note 2>/dev/null || echo none"),
        "none\n"
    );

    // rm releases everything of the sandbox, and only of it.
    let dir = upper.parent().unwrap().to_owned();
    node.ok(&["sandbox", "rm", &id]);
    assert!(!dir.exists(), "{} is left", dir.display());
    assert!(!mem_cg.exists(), "cgroup {} is left", mem_cg.display());
    // Killed; reaped by whoever adopted the orphan (the machine's init), soon.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            Instant::now() < deadline,
            "the sandbox's init {pid} is still there"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(node.ids(), vec![id2.clone()]);
    assert_eq!(node.sh_ok(&id2, "cat /work/TASK"), "make the tests pass\n");
    let e = node
        .cmd()
        .args(["sandbox", "exec", &id, "--", "true"])
        .output()
        .unwrap();
    assert!(!e.status.success());
    assert!(
        text(&e.stderr).contains("no sandbox basic-a"),
        "{}",
        text(&e.stderr)
    );
    node.ok(&["sandbox", "rm", &id2]);
    let status = node.json(&["status"]);
    assert!(status["mounts"].as_array().unwrap().is_empty(), "{status}");
}

#[test]
fn output_is_capped_and_timeouts_kill_what_the_command_started() {
    if !ready("output_is_capped_and_timeouts_kill_what_the_command_started") {
        return;
    }
    let node = Node::new("cap");
    let id = node.create("cap-a", &[]);
    // `yes` forever: a 1 MiB cap, killed after 2 s; the daemon kept 1 MiB, counted the rest.
    let t = Instant::now();
    let v = node.json_any(&[
        "sandbox",
        "exec",
        &id,
        "--timeout",
        "2",
        "--max-output",
        "1MiB",
        "--",
        "yes",
    ]);
    assert!(t.elapsed() < Duration::from_secs(20));
    assert_eq!(v["reason"], "timeout", "{v}");
    assert_eq!(v["truncated"], true);
    assert_eq!(v["stdout"].as_str().unwrap().len(), 1 << 20);
    assert!(
        v["stdout_bytes"].as_u64().unwrap() > 4 << 20,
        "{}",
        v["stdout_bytes"]
    );
    // A timeout kills the command's children too.
    let o = node.exec(
        &id,
        &["--timeout", "1"],
        "sleep 300 & sleep 300; echo never",
    );
    assert_eq!(o.status.code(), Some(124));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        node.sh_ok(
            &id,
            "cat /proc/[0-9]*/comm 2>/dev/null | grep -c sleep || true"
        )
        .trim(),
        "0"
    );
}

#[test]
fn execs_run_concurrently_and_a_client_can_reattach() {
    if !ready("execs_run_concurrently_and_a_client_can_reattach") {
        return;
    }
    let node = Node::new("attach");
    let id = node.create("attach-a", &[]);
    // Four at once: each sleeps 1 s, all done in well under 4 s.
    let t = Instant::now();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let mut c = node.cmd();
            c.args([
                "sandbox",
                "exec",
                &id,
                "--",
                "sh",
                "-c",
                &format!("sleep 1; echo {i}"),
            ]);
            std::thread::spawn(move || c.output().unwrap())
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(text(&h.join().unwrap().stdout), format!("{i}\n"));
    }
    assert!(
        t.elapsed() < Duration::from_millis(3500),
        "{:?}",
        t.elapsed()
    );

    // A client that goes away changes nothing: the exec runs on, and attach replays it.
    let script = "for i in 1 2 3 4 5; do echo line$i; sleep 0.2; done; exit 5";
    let mut follower = node
        .cmd()
        .args(["sandbox", "exec", &id, "--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    follower.kill().unwrap();
    let _ = follower.wait();
    let d = node.json(&["sandbox", "inspect", &id]);
    let exec = d["execs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["args"][2] == script)
        .expect("the exec is listed")["exec"]
        .as_str()
        .unwrap()
        .to_owned();
    let o = node
        .cmd()
        .args(["sandbox", "attach", &id, &exec])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(5));
    assert_eq!(text(&o.stdout), "line1\nline2\nline3\nline4\nline5\n");
    // --detach answers at once with the id.
    let e = node.ok(&[
        "sandbox",
        "exec",
        &id,
        "--detach",
        "--",
        "sh",
        "-c",
        "sleep 0.5; echo late",
    ]);
    let o = node
        .cmd()
        .args(["sandbox", "attach", &id, e.trim()])
        .output()
        .unwrap();
    assert_eq!(text(&o.stdout), "late\n");
}

#[test]
fn limits_hold_and_a_neighbour_keeps_answering() {
    if !ready("limits_hold_and_a_neighbour_keeps_answering") {
        return;
    }
    let node = Node::new("limits");
    let hog = node.create(
        "limits-hog",
        &["--memory", "64MiB", "--pids", "64", "--cpus", "0.5"],
    );
    let calm = node.create("limits-calm", &[]);
    // A fork bomb fills its own pids limit and no more; the neighbour answers meanwhile.
    let mut bomb = node.cmd();
    bomb.args([
        "sandbox",
        "exec",
        &hog,
        "--timeout",
        "4",
        "--",
        "perl",
        "-e",
        "1 while 1 + fork",
    ]);
    let bomb = std::thread::spawn(move || bomb.output().unwrap());
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    assert_eq!(node.sh_ok(&calm, "echo alive"), "alive\n");
    let answered = t.elapsed();
    let d = node.json(&["sandbox", "inspect", &hog]);
    assert!(d["pids"].as_u64().unwrap() <= 64, "{}", d["pids"]);
    let b = bomb.join().unwrap();
    assert_eq!(b.status.code(), Some(124), "{}", text(&b.stderr));
    println!("neighbour answered in {answered:?} during the fork bomb");
    assert!(answered < Duration::from_secs(10));
    // The bomb's processes are gone, reaped by the sandbox's init.
    std::thread::sleep(Duration::from_millis(500));
    let d = node.json(&["sandbox", "inspect", &hog]);
    assert!(d["pids"].as_u64().unwrap() < 8, "{d}");

    // A memory hog is killed by its own limit, and says so.
    let v = node.json_any(&[
        "sandbox",
        "exec",
        &hog,
        "--",
        "perl",
        "-e",
        "$x = 'a' x (256 * 1024 * 1024); print length $x",
    ]);
    assert_eq!(v["reason"], "oom", "{v}");
    assert_eq!(node.sh_ok(&calm, "echo alive"), "alive\n");
    // The CPU limit: 0.5 CPU for a busy loop of 1 s wall is ≈ 0.5 s of CPU.
    let v = node.json_any(&[
        "sandbox",
        "exec",
        &hog,
        "--timeout",
        "1",
        "--",
        "sh",
        "-c",
        "while :; do :; done",
    ]);
    assert_eq!(v["reason"], "timeout");
    let cpu_cg = PathBuf::from(
        d["cgroups"]["cpu"]
            .as_str()
            .or(d["cgroups"]["unified"].as_str())
            .unwrap(),
    );
    let quota = std::fs::read_to_string(cpu_cg.join("cpu.cfs_quota_us"))
        .or_else(|_| std::fs::read_to_string(cpu_cg.join("cpu.max")))
        .unwrap();
    assert!(quota.starts_with("50000"), "{quota}");
}

/// DSec's incidents, each from inside a sandbox as root.
#[test]
fn a_hostile_root_inside_reaches_nothing_of_the_node() {
    if !ready("a_hostile_root_inside_reaches_nothing_of_the_node") {
        return;
    }
    let node = Node::new("hostile");
    let a = node.create("hostile-a", &[]);
    let b = node.create("hostile-b", &[]);
    let d_b = node.json(&["sandbox", "inspect", &b]);
    let b_upper = d_b["upper"].as_str().unwrap().to_owned();
    // (1) The daemon's socket, its run directory, the cache, other uppers, the layer mounts:
    // none of their paths exists inside, and no Unix socket of the host is listed.
    let paths = [
        node.run.join("strata.sock"),
        node.run.clone(),
        node.home.join("cache"),
        PathBuf::from(&b_upper),
        node.run.join("blobs"),
        node.run.join("layers"),
    ];
    for p in &paths {
        let o = node.sh(
            &a,
            &format!("test -e '{}' && echo present || echo absent", p.display()),
        );
        assert_eq!(text(&o.stdout), "absent\n", "{} is reachable", p.display());
    }
    let mounts = node.sh_ok(&a, "cat /proc/self/mountinfo");
    for fs in [" - fuse", " - erofs"] {
        assert!(
            !mounts.contains(fs),
            "{fs} in the sandbox's mounts:\n{mounts}"
        );
    }
    // The init's control socket lives on the host (bound in the host's network namespace):
    // the sandbox lists no Unix socket at all.
    let unix = node.sh_ok(&a, "tail -n +2 /proc/net/unix");
    assert_eq!(unix, "", "Unix sockets listed inside: {unix}");

    // (2) Extent-swap and clone ioctls fail with EPERM; overwriting /bin/bash changes only
    // this sandbox's upper.
    let probe = r#"open(my $s, "<", "/etc/passwd") or die; open(my $d, ">", "/root/x") or die;
        open(my $l, "<", "/bin/bash") or die;
        my @r;
        for my $c (0x40049409, 0x4020940d, 0xc0189436, 0xc0c0586d, 0xc028660f, 0x40086602) {
            my $arg = pack("Q4", fileno($s), 0, 0, 0);
            my $ok = ioctl($c == 0x40086602 ? $l : $d, $c, $arg);
            push @r, $ok ? "ok" : ($! + 0);
        }
        print join(",", @r), "\n";"#;
    let o = node.exec(
        &a,
        &[],
        &format!("perl -e '{}'", probe.replace('\'', "'\\''")),
    );
    assert_eq!(
        text(&o.stdout),
        "1,1,1,1,1,1\n",
        "ioctls not all EPERM: {}",
        text(&o.stderr)
    );
    let base = common::debian_root().unwrap();
    let host_bash = std::fs::read(base.join("usr/bin/bash")).unwrap();
    node.sh_ok(&a, "cp /bin/true /bin/bash && echo replaced");
    assert_eq!(
        node.sh_ok(&a, "cmp -s /bin/true /bin/bash && echo same"),
        "same\n"
    );
    assert_eq!(std::fs::read(base.join("usr/bin/bash")).unwrap(), host_bash);
    assert_eq!(node.sh_ok(&b, "bash -c 'echo bash works'"), "bash works\n");
    // No capability beyond the default set: CAP_SYS_ADMIN (21) and CAP_NET_RAW (13) absent.
    let caps = node.sh_ok(&a, "grep CapEff /proc/self/status");
    let eff = u64::from_str_radix(caps.split_whitespace().nth(1).unwrap(), 16).unwrap();
    assert_eq!(eff & (1 << 21 | 1 << 13), 0, "{caps}");
    let o = node.sh(&a, "mount -t tmpfs none /mnt 2>&1; echo rc=$?");
    assert!(!text(&o.stdout).ends_with("rc=0\n"), "{}", text(&o.stdout));

    // The init's control socket has no path inside (it was /dev/.strata/ctl once): a process
    // inside, root or not, has nothing to connect to (tests/sandbox/init.rs attacks the
    // init itself).
    let probe = r#"use Socket; socket(my $s, AF_UNIX, SOCK_SEQPACKET, 0) or die "socket: $!";
        if (!connect($s, pack_sockaddr_un("/dev/.strata/ctl"))) { print "refused\n"; exit }
        # Accepted connections wait for a request; refused ones are closed at once.
        $SIG{ALRM} = sub { print "accepted\n"; exit }; alarm 3;
        my $n = sysread($s, my $b, 8);
        print((defined $n && $n == 0) || $!{ECONNRESET} ? "closed\n" : "answered\n");"#;
    let o = node.exec(
        &b,
        &[],
        &format!("perl -e '{}'", probe.replace('\'', "'\\''")),
    );
    assert_eq!(text(&o.stdout), "refused\n", "{}", text(&o.stderr));
    let o = node.exec(
        &b,
        &["--user", "nobody"],
        &format!("perl -e '{}'", probe.replace('\'', "'\\''")),
    );
    assert_eq!(text(&o.stdout), "refused\n", "{}", text(&o.stderr));
    assert_eq!(
        node.sh_ok(&b, "test -e /root/pwned && echo ran || echo nothing"),
        "nothing\n"
    );

    // (3) `grep -r /` terminates; the kernel's page and memory views read as nothing.
    let t = Instant::now();
    let o = node.exec(
        &a,
        &["--timeout", "300", "--max-output", "64KiB"],
        "grep -r -s -I -l zzz-strata-nowhere / ; echo done",
    );
    assert!(
        text(&o.stdout).ends_with("done\n"),
        "grep did not finish: {}",
        text(&o.stderr)
    );
    println!("grep -r / took {:?}", t.elapsed());
    assert_eq!(
        node.sh_ok(&a, "for f in /proc/kpagecgroup /proc/kpageflags /proc/kcore /proc/kallsyms; do if [ -e $f ]; then wc -c < $f; else echo 0; fi; done; ls /sys/firmware | wc -l"),
        "0\n0\n0\n0\n0\n"
    );

    // (4) A scan of the host's and the neighbour's ports finds nothing: loopback only. The
    // probe works: b reaches its own listener.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    node.sh_ok(
        &b,
        &format!(
            "nohup perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(LocalAddr => \"0.0.0.0:{port}\", \
             Listen => 5, ReuseAddr => 1) or die; while ($c = $s->accept) {{ print $c \"hi\\n\"; close $c }}' \
             > /dev/null 2>&1 & sleep 0.5"
        ),
    );
    let probe = |sb: &str, ip: &str| {
        let o = node.sh(
            sb,
            &format!(
                "perl -MIO::Socket::INET -e 'print IO::Socket::INET->new(PeerAddr => \"{ip}:{port}\", \
                 Timeout => 2) ? \"open\\n\" : \"closed\\n\"'"
            ),
        );
        text(&o.stdout)
    };
    assert_eq!(probe(&b, "127.0.0.1"), "open\n", "the probe does not work");
    let host_ips = Command::new("hostname").arg("-I").output().unwrap();
    let mut targets = vec!["127.0.0.1".to_owned()];
    targets.extend(
        text(&host_ips.stdout)
            .split_whitespace()
            .filter(|a| !a.contains(':'))
            .map(str::to_owned),
    );
    for ip in &targets {
        assert_eq!(probe(&a, ip), "closed\n", "{ip}:{port} reachable from a");
    }
    drop(listener);
    let ifaces = node.sh_ok(
        &a,
        "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '",
    );
    assert_eq!(ifaces, "lo\n");
}

#[test]
fn sandboxes_survive_kill9_of_the_daemon() {
    if !ready("sandboxes_survive_kill9_of_the_daemon") {
        return;
    }
    let node = Node::new("kill9");
    let id = node.create("kill9-a", &[]);
    let pid_before = node.json(&["sandbox", "inspect", &id])["pid"]
        .as_u64()
        .unwrap();
    // A reader inside that keeps reading lazily served files, across the kill.
    node.sh_ok(
        &id,
        "echo kept > /root/state; \
         nohup sh -c 'while :; do cat /work/src/*/*.rs > /dev/null || echo FAIL >> /root/fails; \
         test -f /root/stop && exit; done' > /dev/null 2>&1 & echo started",
    );
    for round in 0..3 {
        let pid = node.daemon_pid().unwrap();
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        node.start_daemon();
        let d = node.json(&["sandbox", "inspect", &id]);
        assert_eq!(d["state"], "running", "round {round}: {d}");
        assert_eq!(d["pid"].as_u64(), Some(pid_before));
        assert_eq!(node.sh_ok(&id, "cat /root/state"), "kept\n");
    }
    // SIGTERM with a sandbox running leaves its mounts to the next daemon, too.
    let pid = node.daemon_pid().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    node.start_daemon();
    node.sh_ok(&id, "touch /root/stop");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        node.sh_ok(&id, "cat /root/fails 2>/dev/null | wc -l"),
        "0\n"
    );
}

#[test]
fn a_pool_keeps_sandboxes_ready_and_run_discards_them() {
    if !ready("a_pool_keeps_sandboxes_ready_and_run_discards_them") {
        return;
    }
    let node = Node::new("pool");
    let stack = format!("{BASE},{WORKSPACE},{TOOLKIT}");
    node.ok(&["sandbox", "pool", "set", &stack, "--size", "2"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while node.json(&["sandbox", "pool", "ls"])[0]["ready"] != 2 {
        assert!(Instant::now() < deadline, "the pool never filled");
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = node.ids();
    assert_eq!(before.len(), 2);
    let v = node.json(&[
        "sandbox",
        "run",
        &stack,
        "--",
        "sh",
        "-c",
        "echo hi > /root/mark; cat /root/mark /work/TASK",
    ]);
    assert_eq!(v["stdout"], "hi\nmake the tests pass\n");
    let used = v["sandbox"].as_str().unwrap().to_owned();
    assert!(before.contains(&used), "run did not take a pooled sandbox");
    // The used one is removed; the pool is refilled with fresh ones.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ids = node.ids();
        if !ids.contains(&used)
            && ids.len() == 2
            && node.json(&["sandbox", "pool", "ls"])[0]["ready"] == 2
        {
            break;
        }
        assert!(Instant::now() < deadline, "not refilled: {ids:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for id in node.ids() {
        assert_eq!(
            node.sh_ok(&id, "cat /root/mark 2>/dev/null || echo clean"),
            "clean\n"
        );
    }
    // create --pooled takes a ready one (kept: it left the pool), and the pool refills.
    let ready = node.ids();
    let took = node
        .ok(&[
            "sandbox", "create", "--pooled", "--layer", BASE, "--layer", WORKSPACE, "--layer",
            TOOLKIT,
        ])
        .trim()
        .to_owned();
    assert!(ready.contains(&took), "{took} is not one of {ready:?}");
    assert_eq!(node.sh_ok(&took, "cat /work/TASK"), "make the tests pass\n");
    let deadline = Instant::now() + Duration::from_secs(60);
    while node.ids().len() != 3 || node.json(&["sandbox", "pool", "ls"])[0]["ready"] != 2 {
        assert!(Instant::now() < deadline, "not refilled after a take");
        std::thread::sleep(Duration::from_millis(50));
    }
    // With an option a pooled sandbox lacks, a new one is made.
    let own = node
        .ok(&[
            "sandbox", "create", "--pooled", "--layer", BASE, "--layer", WORKSPACE, "--layer",
            TOOLKIT, "--env", "X=1",
        ])
        .trim()
        .to_owned();
    assert!(!node.ids().is_empty() && !ready.contains(&own));
    assert_eq!(node.sh_ok(&own, "echo $X"), "1\n");
    node.ok(&["sandbox", "rm", &took, &own]);

    node.ok(&["sandbox", "pool", "set", &stack, "--size", "0"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node.ids().is_empty() {
        assert!(
            Instant::now() < deadline,
            "pool sandboxes left after size 0"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_idle_sandbox_is_removed_after_its_timeout() {
    if !ready("an_idle_sandbox_is_removed_after_its_timeout") {
        return;
    }
    let node = Node::new("idle");
    let id = node.create("idle-a", &["--idle-timeout", "2s"]);
    let kept = node.create("idle-b", &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.ids().contains(&id) {
        assert!(Instant::now() < deadline, "idle sandbox not removed");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(node.ids(), vec![kept]);
}

#[test]
fn bad_requests_get_clear_errors() {
    if !ready("bad_requests_get_clear_errors") {
        return;
    }
    let node = Node::new("bad");
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "sandbox",
                "create",
                "--layer",
                "base/nope:1",
                "--id",
                "bad-a",
            ],
            "layer",
        ),
        (
            &["sandbox", "create", "--layer", BASE, "--id", "Bad/Id"],
            "bad sandbox id",
        ),
        (
            &[
                "sandbox", "create", "--layer", BASE, "--env", "NOEQUALS", "--id", "bad-b",
            ],
            "KEY=VALUE",
        ),
        (
            &[
                "sandbox", "create", "--layer", BASE, "--secret", "../x=1", "--id", "bad-c",
            ],
            "secret name",
        ),
    ];
    for (args, want) in cases {
        let o = node.cmd().args(*args).output().unwrap();
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(
            text(&o.stderr).contains(want),
            "{args:?}: {}",
            text(&o.stderr)
        );
    }
    assert!(
        node.ids().is_empty(),
        "a failed create left {:?}",
        node.ids()
    );
    let id = node.create("bad-ok", &[]);
    let o = node
        .cmd()
        .args(["sandbox", "create", "--layer", BASE, "--id", &id])
        .output()
        .unwrap();
    assert!(
        text(&o.stderr).contains("exists already"),
        "{}",
        text(&o.stderr)
    );
    let o = node
        .cmd()
        .args(["sandbox", "exec", &id, "--", "/no/such/binary"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).to_lowercase().contains("no such file")
            || text(&o.stderr).contains("not found"),
        "{}",
        text(&o.stderr)
    );
    // The sandbox is fine after all that.
    assert_eq!(node.sh_ok(&id, "echo fine"), "fine\n");
}

/// A test host in a network namespace of its own, behind its own veth, with TCP listeners.
struct TestHost {
    ns: String,
    veth: String,
    listeners: Vec<std::process::Child>,
}

impl TestHost {
    /// `10.214.200.2` in namespace `strata-th-<pid>`, listening on `ports`.
    fn new(ports: &[u16]) -> TestHost {
        let n = std::process::id() % 10_000;
        let ns = format!("strata-th-{n}");
        let veth = format!("stt{n}");
        let sh = |cmd: &str| {
            let o = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
            assert!(o.status.success(), "{cmd}: {}", text(&o.stderr));
        };
        let _ = Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &veth])
            .stderr(Stdio::null())
            .status();
        let host = TestHost {
            ns: ns.clone(),
            veth: veth.clone(),
            listeners: Vec::new(),
        };
        sh(&format!(
            "ip netns add {ns} && ip link add {veth} type veth peer name eth0 netns {ns} && \
             ip addr add 10.214.200.1/30 dev {veth} && ip link set {veth} up && \
             ip -n {ns} addr add 10.214.200.2/30 dev eth0 && ip -n {ns} link set eth0 up && \
             ip -n {ns} link set lo up && ip -n {ns} route add default via 10.214.200.1"
        ));
        let mut host = host;
        for p in ports {
            let child = Command::new("ip")
                .args(["netns", "exec", &ns, "python3", "-c"])
                .arg(format!(
                    "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                     s.bind(('10.214.200.2', {p})); s.listen(16)\nwhile True:\n    c,_=s.accept(); c.sendall(b'port {p}\\n'); c.close()"
                ))
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            host.listeners.push(child);
        }
        // Listening (seen from the host) before anyone connects.
        let deadline = Instant::now() + Duration::from_secs(10);
        for p in ports {
            while std::net::TcpStream::connect_timeout(
                &format!("10.214.200.2:{p}").parse().unwrap(),
                Duration::from_millis(200),
            )
            .is_err()
            {
                assert!(
                    Instant::now() < deadline,
                    "test host port {p} not listening"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        host
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        for c in &mut self.listeners {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.ns])
            .stderr(Stdio::null())
            .status();
    }
}

/// What a TCP connection from inside sandbox `id` to `target` gets: the first line, or
/// `closed`.
fn connect_from(node: &Node, id: &str, target: &str) -> String {
    let o = node.sh(
        id,
        &format!(
            "perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(PeerAddr => \"{target}\", Timeout => 2); \
             print $s ? scalar(<$s>) : \"closed\\n\"'"
        ),
    );
    text(&o.stdout)
}

#[test]
fn an_allowlist_reaches_exactly_what_it_lists() {
    if !ready("an_allowlist_reaches_exactly_what_it_lists") {
        return;
    }
    let node = Node::new("net");
    let th = TestHost::new(&[8080, 8081]);
    let id = node.create("net-a", &["--net", "allow=10.214.200.2:8080/tcp"]);
    let none = node.create("net-b", &[]);
    assert_eq!(connect_from(&node, &id, "10.214.200.2:8080"), "port 8080\n");
    assert_eq!(connect_from(&node, &id, "10.214.200.2:8081"), "closed\n");
    assert_eq!(connect_from(&node, &none, "10.214.200.2:8080"), "closed\n");
    // The host, at the test host's gateway and at the sandbox's own gateway: closed.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let info = node.json(&["sandbox", "inspect", &id]);
    let addr: std::net::Ipv4Addr = info["addr"].as_str().unwrap().parse().unwrap();
    let gw = std::net::Ipv4Addr::from(u32::from(addr) - 1);
    for ip in ["10.214.200.1".to_owned(), gw.to_string()] {
        assert_eq!(
            connect_from(&node, &id, &format!("{ip}:{port}")),
            "closed\n",
            "host {ip} reachable"
        );
    }
    // Replaced at once: 8081 now, 8080 no more.
    node.ok(&["sandbox", "net", &id, "allow=10.214.200.2:8081/tcp"]);
    assert_eq!(connect_from(&node, &id, "10.214.200.2:8081"), "port 8081\n");
    assert_eq!(connect_from(&node, &id, "10.214.200.2:8080"), "closed\n");
    let veth = format!(
        "sx{}",
        (u32::from(addr) - u32::from(std::net::Ipv4Addr::new(10, 213, 0, 0))) / 4
    );
    node.ok(&["sandbox", "rm", &id]);
    let link = Command::new("ip")
        .args(["link", "show", &veth])
        .output()
        .unwrap();
    assert!(!link.status.success(), "{veth} left after rm");
    drop(th);
}

#[test]
fn disk_limits_bound_the_upper() {
    if !ready("disk_limits_bound_the_upper") {
        return;
    }
    let mut node = Node::new("disk");
    node.env.push(("STRATA_UPPERS_SIZE", "1GiB".to_owned()));
    let small = node.create("disk-a", &["--disk", "8MiB"]);
    let big = node.create("disk-b", &[]);
    let o = node.sh(
        &small,
        "dd if=/dev/zero of=/root/fill bs=1M count=32 2>&1; echo rc=$?",
    );
    let out = text(&o.stdout);
    assert!(
        out.contains("quota exceeded") || out.contains("No space"),
        "{out}"
    );
    assert!(!out.ends_with("rc=0\n"), "{out}");
    let used = node.json(&["sandbox", "inspect", &small])["upper_bytes"]
        .as_u64()
        .unwrap();
    assert!(used <= 9 << 20, "{used} bytes in an 8 MiB upper");
    node.sh_ok(
        &big,
        "dd if=/dev/zero of=/root/fill bs=1M count=32 2>/dev/null && sync && echo ok",
    );
    // The small one still works (it can delete and write again).
    assert_eq!(
        node.sh_ok(&small, "rm /root/fill; echo again > /root/x; cat /root/x"),
        "again\n"
    );
}
