//! Helpers of the `strata` binary's end-to-end tests (`tests/cli.rs`, `tests/cli_node.rs`):
//! running it, reading its output, and a guard that stops its daemons and detaches their
//! mounts also when a test fails.

use std::path::Path;
use std::process::{Command, Output};

pub fn strata(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .expect("run strata")
}

/// `strata --store <store>` with `STRATA_HOME=<home>`.
pub fn strata_cmd(home: &Path, store: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.env("STRATA_HOME", home).arg("--store").arg(store);
    c
}

pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "strata failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn json(out: Output) -> serde_json::Value {
    serde_json::from_str(&ok(out)).unwrap()
}

pub fn pid_alive(pid: i32) -> bool {
    // A zombie (dead, not yet reaped by whoever adopted it) counts as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

pub fn wait_gone(pid: i32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while pid_alive(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "pid {pid} did not exit"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Stops every daemon on `run_dir` (the child it holds, and one started by `strata mount`,
/// found by its pid file) and detaches whatever is still mounted from it, also on failure.
pub struct DaemonGuard {
    pub run_dir: std::path::PathBuf,
    pub child: Option<std::process::Child>,
    pub mountpoints: Vec<std::path::PathBuf>,
}

impl DaemonGuard {
    pub fn pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.run_dir.join("strata.pid")).ok()?;
        let pid: i32 = text.trim().parse().ok()?;
        pid_alive(pid).then_some(pid)
    }

    pub fn signal(pid: i32, sig: rustix::process::Signal) {
        if let Some(p) = rustix::process::Pid::from_raw(pid) {
            let _ = rustix::process::kill_process(p, sig);
        }
    }
}

impl Drop for DaemonGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(pid) = self.pid() {
            Self::signal(pid, rustix::process::Signal::KILL);
            wait_gone(pid);
        }
        for m in &self.mountpoints {
            let _ = rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH);
        }
        let _ = ublk_daemon::node::sys::detach_stale(&self.run_dir);
    }
}

pub fn ours_mounted(run_dir: &Path, mp: &Path) -> Vec<String> {
    ublk_daemon::node::sys::mounts()
        .unwrap()
        .into_iter()
        .filter(|m| ublk_daemon::node::sys::is_ours(m, run_dir) || m.mount_point == mp)
        .map(|m| format!("{} {}", m.fstype, m.mount_point.display()))
        .collect()
}

/// What is mounted from `run_dir` or at a path under `under`.
pub fn mounted_from(run_dir: &Path, under: &Path) -> Vec<String> {
    ublk_daemon::node::sys::mounts()
        .unwrap()
        .into_iter()
        .filter(|m| ublk_daemon::node::sys::is_ours(m, run_dir) || m.mount_point.starts_with(under))
        .map(|m| format!("{} {}", m.fstype, m.mount_point.display()))
        .collect()
}

/// A small layer `base/conc:1` in `store`, built with `strata layer build`.
pub fn build_small_layer(tmp: &Path, home: &Path, store: &Path, name: &str) {
    let src = tmp.join(format!("src-{}", name.replace(['/', ':'], "-")));
    std::fs::create_dir_all(src.join("etc")).unwrap();
    std::fs::write(src.join("etc/hostname"), b"sandbox\n").unwrap();
    std::fs::write(src.join("data.bin"), vec![5u8; 300_000]).unwrap();
    ok(strata_cmd(home, store)
        .args(["layer", "build", src.to_str().unwrap(), "--name", name])
        .output()
        .unwrap());
}

/// Stop the daemon on the guard's run directory with SIGTERM (it unmounts everything) and
/// wait for it to exit.
pub fn stop_daemon(guard: &DaemonGuard) {
    let pid = guard.pid().expect("a running daemon");
    DaemonGuard::signal(pid, rustix::process::Signal::TERM);
    wait_gone(pid);
}

/// Compare every regular file under `src` with its copy under `dst`; the count.
pub fn same_files(src: &Path, dst: &Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let (s, d) = (e.path(), dst.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            n += same_files(&s, &d);
        } else {
            assert!(
                std::fs::read(&s).unwrap() == std::fs::read(&d).unwrap(),
                "{} differs",
                d.display()
            );
            n += 1;
        }
    }
    n
}
