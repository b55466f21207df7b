//! `exec_output`: what keeping an exec's output with the sandbox's init (in files beside the
//! sandbox, `sandbox-runtime/src/exec.rs`) costs against the daemon holding the pipes, and
//! what a streaming reader sees across `kill -9` of the daemon.
//!
//! Runs, as root, on one node per binary (its own store with the Debian base layer built by
//! that binary, its own daemon):
//! 1. **Throughput**: `strata sandbox exec ID -- sh -c 'yes | head -c N'` (N: 1 GiB; the
//!    default 16 MiB cap keeps the first 16 MiB and counts the rest), the client's stdout
//!    to /dev/null; wall time → MiB/s of command output.
//! 2. **Create + exec**: `sandbox create` + `sandbox exec ID -- true` + `sandbox rm`, one after
//!    another, `STRATA_BENCH_CREATES` times; sandboxes per second.
//! 3. **Across kill -9**: a command prints a numbered line every 10 ms; a reader runs
//!    `strata sandbox attach` (again whenever it ends early) and notes when each new line
//!    arrives; the daemon is killed with SIGKILL and restarted `STRATA_BENCH_KILLS` times. The
//!    longest gap between two consecutive lines, and whether every line arrived and the exit
//!    status is exact.
//!
//! `STRATA_BIN` is the binary measured (default: `strata` beside the bench); set
//! `STRATA_BENCH_OLD_BIN` to a build of an earlier commit to measure it in the same run,
//! interleaved round by round (`bench/README.md` says how the figures were made). Smoke run
//! (`cargo test --bench exec_output`): 64 MiB, 4 creates, 1 kill, 1 round.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bench::node::LocalNode;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runnable() -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("not root".into());
    }
    let runc = Command::new("runc").arg("--version").output();
    if !runc.is_ok_and(|o| o.status.success()) {
        return Err("runc is not installed".into());
    }
    Ok(())
}

/// A node running `bin`, with the base layer built and one sandbox made.
fn node(bin: &std::path::Path, tag: &str) -> LocalNode {
    let target_tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let mut n = LocalNode::new(&target_tmp, &format!("exec-output-{tag}-"));
    n.bin = bin.to_owned();
    let tree = bench::node::debian_tree();
    n.ok(&[
        "layer",
        "build",
        &tree.to_string_lossy(),
        "--name",
        "base/debian:12",
    ]);
    n.start_daemon(&[]);
    n.ok(&[
        "sandbox",
        "create",
        "--layer",
        "base/debian:12",
        "--id",
        "out",
    ]);
    n
}

/// MiB/s of command output through `sandbox exec` (its stdout to /dev/null).
fn throughput(n: &LocalNode, bytes: u64) -> f64 {
    let script = format!("yes | head -c {bytes}");
    let t = Instant::now();
    let v = n.json(&["sandbox", "exec", "out", "--", "sh", "-c", &script]);
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout_bytes"], bytes, "every byte counted: {v}");
    bytes as f64 / (1 << 20) as f64 / secs
}

/// Sandboxes per second of create + exec + rm, one after another.
fn creates(n: &LocalNode, count: u64) -> f64 {
    let t = Instant::now();
    for i in 0..count {
        let id = format!("c{i}");
        n.ok(&[
            "sandbox",
            "create",
            "--layer",
            "base/debian:12",
            "--id",
            &id,
        ]);
        n.ok(&["sandbox", "exec", &id, "--", "true"]);
        n.ok(&["sandbox", "rm", &id]);
    }
    count as f64 / t.elapsed().as_secs_f64()
}

struct Gap {
    longest: Duration,
    lines: usize,
    wanted: usize,
    exit: Option<i32>,
}

/// A numbered line every 10 ms, followed by a reader across `kills` kill -9 of the daemon.
fn across_kills(n: &mut LocalNode, kills: u64) -> Gap {
    let wanted = (kills as usize + 1) * 150;
    let script = format!(
        "perl -e '$|=1; for my $i (0..{}) {{ print \"$i\\n\"; select(undef,undef,undef,0.01) }}'; exit 7",
        wanted - 1
    );
    let exec = n
        .ok(&[
            "sandbox", "exec", "out", "--detach", "--", "sh", "-c", &script,
        ])
        .trim()
        .to_owned();
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let exit: Arc<Mutex<Option<i32>>> = Arc::default();
    let reader = {
        let (arrivals, exit) = (arrivals.clone(), exit.clone());
        let mut cmd = n.cmd();
        cmd.args(["sandbox", "attach", "out", &exec]);
        let deadline = Instant::now() + Duration::from_secs(60 + kills * 10);
        std::thread::spawn(move || {
            while Instant::now() < deadline {
                let Ok(mut child) = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn() else {
                    return;
                };
                let out = child.stdout.take().expect("piped");
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    let Ok(i) = line.trim().parse::<usize>() else {
                        continue;
                    };
                    let mut a = arrivals.lock().unwrap();
                    // attach replays from the start: only lines not seen yet count.
                    if i == a.len() {
                        a.push(Instant::now());
                    }
                }
                let status = child.wait().ok().and_then(|s| s.code());
                if status == Some(7) {
                    *exit.lock().unwrap() = status;
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    for _ in 0..kills {
        std::thread::sleep(Duration::from_millis(700));
        if let Some(pid) = n
            .daemon_pid()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        std::thread::sleep(Duration::from_millis(50));
        n.start_daemon(&[]);
    }
    let _ = reader.join();
    let a = arrivals.lock().unwrap();
    let longest = a.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
    let exit = *exit.lock().unwrap();
    Gap {
        longest,
        lines: a.len(),
        wanted,
        exit,
    }
}

fn main() {
    if let Err(why) = runnable() {
        println!("\n*** SKIPPED exec_output: {why} ***\n");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "exec_output: {why} (scripts/install-test-deps.sh installs it under CI)"
        );
        return;
    }
    let full = bench::full_run();
    let yes = env_u64(
        "STRATA_BENCH_YES_BYTES",
        if full { 1 << 30 } else { 64 << 20 },
    );
    let count = env_u64("STRATA_BENCH_CREATES", if full { 40 } else { 4 });
    let kills = env_u64("STRATA_BENCH_KILLS", if full { 5 } else { 1 });
    let rounds = env_u64("STRATA_BENCH_ROUNDS", if full { 3 } else { 1 });
    let mut bins = vec![("this".to_owned(), bench::node::strata_bin())];
    match std::env::var_os("STRATA_BENCH_OLD_BIN") {
        Some(old) => bins.push(("old".to_owned(), PathBuf::from(old))),
        None => println!(
            "exec_output: no STRATA_BENCH_OLD_BIN: measuring {} alone",
            bins[0].1.display()
        ),
    }
    println!(
        "exec_output: yes | head -c {} MiB, {count} create+exec+rm, {kills} kill -9, {rounds} rounds",
        yes >> 20
    );
    let mut nodes: Vec<(String, LocalNode)> = bins
        .iter()
        .map(|(tag, bin)| (tag.clone(), node(bin, tag)))
        .collect();
    for round in 0..rounds {
        for (tag, n) in &nodes {
            let mibs = throughput(n, yes);
            let rate = creates(n, count);
            println!(
                "round {round} {tag:>4}: exec output {mibs:8.1} MiB/s   create+exec+rm {rate:6.2}/s"
            );
        }
    }
    for (tag, n) in &mut nodes {
        let g = across_kills(n, kills);
        println!(
            "{tag:>4}: across {kills} kill -9: longest gap {:.0} ms, {} of {} lines, exit {:?}",
            g.longest.as_secs_f64() * 1e3,
            g.lines,
            g.wanted,
            g.exit
        );
        if tag == "this" {
            assert_eq!(g.lines, g.wanted, "lines lost across the kills");
            assert_eq!(g.exit, Some(7), "the exit status across the kills");
        }
    }
}
