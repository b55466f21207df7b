//! The sandbox's init (PID 1) and the harness's commands, attacked from inside as root and as
//! an unprivileged user: ptrace attach and seize, `pidfd_getfd` of every descriptor,
//! `process_vm_readv`, `/proc/1/{mem,environ,fd}`, signals, limits and scheduling aimed at
//! it — all refused or without effect, with an exec right after each attempt still working.
//! An init the host stops makes execs fail in bounded time, and neither `rm` nor the
//! daemon's SIGTERM hangs on it.

use std::process::Stdio;
use std::time::{Duration, Instant};

use super::{ready, text, Node};

/// Each attempt on pid `target` as `name=result`, result `ok` or the errno; then a ptrace of
/// the sandbox's own child (which must keep working: debuggers are ordinary tools).
/// x86_64 system call numbers: ptrace 101, kill 62, pidfd_open 434, pidfd_getfd 438,
/// process_vm_readv 310, prlimit64 302, setpriority 141, sched_setaffinity 203,
/// sched_setscheduler 144.
const PROBE: &str = r#"
use strict;
my $t = $ARGV[0] + 0;
my @r;
sub res { my ($n, $v) = @_; push @r, "$n=" . ($v == -1 ? ($! + 0) : "ok"); }
res("attach", syscall(101, 16, $t, 0, 0));
res("seize", syscall(101, 0x4206, $t, 0, 0));
my $pfd = syscall(434, $t, 0);
my $got = 0;
if ($pfd >= 0) { for my $fd (0 .. 200) { $got++ if syscall(438, $pfd, $fd, 0) >= 0; } }
push @r, "getfd=$got";
my $buf = "\0" x 64;
my $local = pack("P Q", $buf, 64);
my $remote = pack("Q Q", 0x400000, 64);
res("vm_readv", syscall(310, $t, $local, 1, $remote, 1, 0));
for my $f ("mem", "environ", "maps") {
    if (open(my $h, "<", "/proc/$t/$f")) { my $n = sysread($h, my $b, 64); res($f, defined $n ? 0 : -1); }
    else { res($f, -1); }
}
res("fd0", defined(readlink("/proc/$t/fd/0")) ? 0 : -1);
res("root", defined(readlink("/proc/$t/root")) ? 0 : -1);
my $lim = pack("Q Q", 0, 0);
res("prlimit", syscall(302, $t, 7, $lim, 0));
res("setpriority", syscall(141, 0, $t, 19));
my $mask = pack("Q", 1);
res("affinity", syscall(203, $t, 8, $mask));
my $param = pack("i", 0);
res("scheduler", syscall(144, $t, 5, $param));
for my $s (19, 15, 9, 11, 2) { kill($s, $t); }
# The sandbox's own processes stay traceable.
my $child = fork();
if ($child == 0) { sleep 30; exit 0; }
my $own = syscall(101, 16, $child, 0, 0);
push @r, "own=" . ($own == -1 ? ($! + 0) : "ok");
kill(9, $child); waitpid($child, 0);
print join(" ", @r), "\n";
"#;

/// Run the probe against `target` in `id` as `user` (None: root); its results by name.
fn probe(node: &Node, id: &str, user: Option<&str>, target: &str) -> Vec<(String, String)> {
    let mut opts = vec!["--timeout", "60"];
    if let Some(u) = user {
        opts.extend(["--user", u]);
    }
    let script = format!("perl -e '{}' {target}", PROBE.replace('\'', "'\\''"));
    let o = node.exec(id, &opts, &script);
    let out = text(&o.stdout);
    assert!(
        out.contains("own="),
        "the probe did not finish ({}): {out}{}",
        o.status,
        text(&o.stderr)
    );
    out.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The host's view of a process: its state letter in `/proc/<pid>/stat`.
fn state(pid: u64) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = stat.rsplit_once(')').unwrap().1;
    rest.trim_start().chars().next().unwrap()
}

#[test]
fn the_init_is_out_of_reach_of_root_and_of_users_inside() {
    if !ready("the_init_is_out_of_reach_of_root_and_of_users_inside") {
        return;
    }
    let node = Node::new("initreach");
    let id = node.create("initreach", &[]);
    let init = node.json(&["sandbox", "inspect", &id])["pid"]
        .as_u64()
        .unwrap();
    // Its control socket has no path inside, and nothing of the host's is a Unix socket there.
    assert_eq!(
        node.sh_ok(&id, "test -e /dev/.strata && echo present || echo absent"),
        "absent\n"
    );
    for user in [None, Some("nobody")] {
        let who = user.unwrap_or("root");
        let r = probe(&node, &id, user, "1");
        let get = |k: &str| {
            r.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("{who}: no {k} in {r:?}"))
        };
        for k in [
            "attach",
            "seize",
            "vm_readv",
            "prlimit",
            "setpriority",
            "affinity",
            "scheduler",
        ] {
            assert_eq!(
                get(k),
                "1",
                "{who}: {k} on the init was not refused with EPERM: {r:?}"
            );
        }
        assert_eq!(
            get("getfd"),
            "0",
            "{who}: copied the init's descriptors: {r:?}"
        );
        for k in ["mem", "environ", "maps", "fd0", "root"] {
            assert_ne!(get(k), "ok", "{who}: read the init's /proc/1/{k}: {r:?}");
        }
        assert_eq!(get("own"), "ok", "{who}: cannot trace its own child: {r:?}");
        // After every attempt (SIGSTOP and SIGKILL among them): the init runs, and answers.
        assert_ne!(state(init), 'T', "{who}: the init is stopped");
        assert_eq!(
            node.sh_ok(&id, "echo still"),
            "still\n",
            "{who}: no exec after the probe"
        );
        assert_eq!(
            node.json(&["sandbox", "inspect", &id])["pid"].as_u64(),
            Some(init)
        );
    }
}

#[test]
fn the_harness_commands_are_out_of_reach_of_the_policy_user() {
    if !ready("the_harness_commands_are_out_of_reach_of_the_policy_user") {
        return;
    }
    let node = Node::new("harness");
    let id = node.create("harness", &[]);
    // The harness's command, as root: its pid inside, for the policy to aim at.
    node.sh_ok(
        &id,
        "nohup sh -c 'echo $$ > /tmp/harness.pid; exec sleep 300' > /dev/null 2>&1 & sleep 0.3; cat /tmp/harness.pid",
    );
    let target = node.sh_ok(&id, "cat /tmp/harness.pid").trim().to_owned();
    let r = probe(&node, &id, Some("nobody"), &target);
    let get = |k: &str| r.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    for k in [
        "attach",
        "seize",
        "vm_readv",
        "prlimit",
        "setpriority",
        "affinity",
        "scheduler",
    ] {
        assert_eq!(get(k), Some("1"), "{k} on root's command: {r:?}");
    }
    assert_eq!(get("getfd"), Some("0"), "{r:?}");
    for k in ["mem", "environ", "maps", "fd0", "root"] {
        assert_ne!(get(k), Some("ok"), "read root's /proc/PID/{k}: {r:?}");
    }
    assert_eq!(get("own"), Some("ok"), "{r:?}");
    // Its signals did not reach it: it still runs.
    assert_eq!(
        node.sh_ok(&id, &format!("kill -0 {target} && echo alive")),
        "alive\n"
    );
}

#[test]
fn a_stopped_init_fails_execs_in_bounded_time_and_rm_and_sigterm_still_finish() {
    if !ready("a_stopped_init_fails_execs_in_bounded_time_and_rm_and_sigterm_still_finish") {
        return;
    }
    let node = Node::new("stopinit");
    let stuck = node.create("stopinit-a", &[]);
    let fine = node.create("stopinit-b", &[]);
    let init = node.json(&["sandbox", "inspect", &stuck])["pid"]
        .as_u64()
        .unwrap();
    let pid = rustix::process::Pid::from_raw(init as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
    // An exec fails with a clear word within the init's answer deadline (5 s).
    let t = Instant::now();
    let o = node.exec(&stuck, &[], "echo never");
    let took = t.elapsed();
    assert!(!o.status.success(), "an exec ran on a stopped init");
    let said = text(&o.stderr);
    assert!(said.contains("did not answer"), "{said}");
    assert!(took < Duration::from_secs(20), "the exec took {took:?}");
    // The neighbour is not held up.
    assert_eq!(node.sh_ok(&fine, "echo fine"), "fine\n");
    // SIGTERM to the daemon returns, the sandboxes left running.
    let daemon = node.daemon_pid().unwrap();
    let dpid = rustix::process::Pid::from_raw(daemon).unwrap();
    rustix::process::kill_process(dpid, rustix::process::Signal::TERM).unwrap();
    let t = Instant::now();
    while rustix::process::test_kill_process(dpid).is_ok() {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the daemon did not stop within 15 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    node.start_daemon();
    // rm kills by cgroup, not by asking the init: it finishes.
    let t = Instant::now();
    let mut c = node.cmd();
    c.args(["sandbox", "rm", &stuck]).stdout(Stdio::null());
    let out = c.output().unwrap();
    assert!(out.status.success(), "rm: {}", text(&out.stderr));
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "rm took {:?}",
        t.elapsed()
    );
    // Gone (or a zombie its reaper has not seen yet: nothing of it runs).
    assert!(
        !std::path::Path::new(&format!("/proc/{init}")).exists() || state(init) == 'Z',
        "the init still runs after rm"
    );
    assert_eq!(node.sh_ok(&fine, "echo after"), "after\n");
}
