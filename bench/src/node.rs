//! A node for scenario benches, driven through the `strata` command line: its own store,
//! home (caches) and run directory under one temporary directory, a daemon started in the
//! background, and everything it made removed when it is dropped (also on a panic): the
//! sandboxes, the daemon (SIGTERM, then SIGKILL) and its fd holder, containers left behind,
//! mounts under its directory, the directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `strata` binary to bench: `STRATA_BIN`, or `strata` beside the bench executable
/// (`target/release/deps/<bench>-HASH` → `target/release/strata`, after `cargo build
/// --release --bin strata` with the same `CARGO_TARGET_DIR`).
pub fn strata_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("the bench's own path");
    let candidates: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(3)
        .map(|d| d.join("strata"))
        .collect();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "no strata binary beside the bench ({}): build it first with \
                 `cargo build --release --bin strata` (same CARGO_TARGET_DIR), or set STRATA_BIN",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// The Debian tree: `STRATA_BENCH_DEBIAN`, or the one `scripts/debian-base.sh` builds once and
/// caches.
pub fn debian_tree() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_BENCH_DEBIAN") {
        return p.into();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/debian-base.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/debian-base.sh");
    assert!(out.status.success(), "scripts/debian-base.sh failed");
    PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or("")
            .trim(),
    )
}

/// See the module docs.
#[derive(Debug)]
pub struct LocalNode {
    pub dir: tempfile::TempDir,
    pub bin: PathBuf,
    /// The store URL its commands use (default: `<dir>/store`, a POSIX store; or one several
    /// nodes share: [`LocalNode::share_store`]).
    pub store: String,
    daemon: Option<Child>,
}

impl LocalNode {
    /// A node under a fresh directory `prefix…` of [`crate::bench_dir`]; no daemon yet.
    pub fn new(target_tmp: &Path, prefix: &str) -> Self {
        let dir = crate::bench_tempdir(target_tmp, prefix, "the bench directory");
        let store = dir.path().join("store").to_string_lossy().into_owned();
        Self {
            dir,
            bin: strata_bin(),
            store,
            daemon: None,
        }
    }

    /// `strata` with this node's store, home and run directory.
    pub fn cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.env("STRATA_HOME", self.dir.path().join("home"))
            .env("STRATA_RUN_DIR", self.dir.path().join("run"))
            .env_remove("STRATA_STORE")
            .arg("--store")
            .arg(&self.store);
        c
    }

    /// Use `store` (another node's, say) instead of this node's own.
    pub fn share_store(&mut self, store: &str) {
        self.store = store.to_owned();
    }

    /// The daemon's process id, while it runs.
    pub fn daemon_pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(Child::id)
    }

    /// `strata ARGS`, which must succeed; its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cmd().args(args).output().expect("run strata");
        assert!(
            out.status.success(),
            "strata {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `strata --json ARGS`, parsed.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let text = self.ok(&all);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("strata {args:?}: {e}: {text}"))
    }

    /// Start `strata daemon EXTRA…` in the background (its log: `daemon.log`) and wait until
    /// its socket answers.
    pub fn start_daemon(&mut self, extra: &[&std::ffi::OsStr]) {
        let log = std::fs::File::create(self.dir.path().join("daemon.log")).expect("the log");
        let mut c = self.cmd();
        c.arg("daemon")
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        self.daemon = Some(c.spawn().expect("start the daemon"));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self
            .cmd()
            .args(["sandbox", "ls"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            assert!(Instant::now() < deadline, "no daemon answered within 60 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stop the daemon [`Self::start_daemon`] started, if any: SIGTERM (a clean stop), then
    /// SIGKILL after 10 s.
    pub fn stop_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            if let Some(pid) = rustix::process::Pid::from_raw(d.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while d.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = d.kill();
            let _ = d.wait();
        }
    }

    fn sandbox_ids(&self) -> Vec<String> {
        let out = self
            .cmd()
            .args(["--json", "sandbox", "ls"])
            .stderr(Stdio::null())
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default();
        serde_json::from_slice::<serde_json::Value>(&out)
            .ok()
            .and_then(|v| {
                v.as_array().map(|a| {
                    a.iter()
                        .filter_map(|s| s["id"].as_str().map(str::to_owned))
                        .collect()
                })
            })
            .unwrap_or_default()
    }
}

impl Drop for LocalNode {
    fn drop(&mut self) {
        for id in self.sandbox_ids() {
            let _ = self
                .cmd()
                .args(["sandbox", "rm", &id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        self.stop_daemon();
        // Containers left behind (a daemon stopped while sandboxes ran keeps them).
        let runc_root = self.dir.path().join("run/runc");
        for e in std::fs::read_dir(&runc_root)
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&runc_root)
                .args(["delete", "--force"])
                .arg(e.file_name())
                .stderr(Stdio::null())
                .status();
        }
        let run = self.dir.path().join("run").to_string_lossy().into_owned();
        kill_fuse_holders(&[run]);
        unmount_under(self.dir.path());
    }
}

/// SIGKILLs every `strata fuse-holder` whose command line names one of `runs` (a run
/// directory): what a test or bench node leaves behind when it is torn down after a failure.
pub fn kill_fuse_holders(runs: &[String]) {
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.contains(&&b"fuse-holder"[..]) && runs.iter().any(|r| args.contains(&r.as_bytes()))
        {
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
    }
}

/// Lazily unmounts every mount point under `root`, deepest first.
pub fn unmount_under(root: &std::path::Path) {
    if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
        let root = root.to_string_lossy().into_owned();
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
}
