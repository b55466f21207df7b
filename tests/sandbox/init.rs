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
my ($t, $what) = ($ARGV[0] + 0, $ARGV[1]);
sub res { my ($v) = @_; print "$what=" . ($v == -1 ? ($! + 0) : "ok") . "\n"; }
sub readable { my ($f) = @_; open(my $h, "<", $f) or return -1; my $n = sysread($h, my $b, 64); return defined $n ? 0 : -1; }
if ($what eq "attach") { res(syscall(101, 16, $t, 0, 0)); }
elsif ($what eq "seize") { res(syscall(101, 0x4206, $t, 0, 0)); }
elsif ($what eq "getfd") {
    my $pfd = syscall(434, $t, 0);
    my $got = 0;
    if ($pfd >= 0) { for my $fd (0 .. 200) { $got++ if syscall(438, $pfd, $fd, 0) >= 0; } }
    print "getfd=$got\n";
}
elsif ($what eq "vm_readv") {
    my $buf = "\0" x 64;
    my ($local, $remote) = (pack("P Q", $buf, 64), pack("Q Q", 0x400000, 64));
    res(syscall(310, $t, $local, 1, $remote, 1, 0));
}
elsif ($what eq "mem" || $what eq "environ" || $what eq "maps") { res(readable("/proc/$t/$what")); }
elsif ($what eq "fd0") { res(defined(readlink("/proc/$t/fd/0")) ? 0 : -1); }
elsif ($what eq "root") { res(defined(readlink("/proc/$t/root")) ? 0 : -1); }
elsif ($what eq "prlimit") { my $l = pack("Q Q", 0, 0); res(syscall(302, $t, 7, $l, 0)); }
elsif ($what eq "setpriority") { res(syscall(141, 0, $t, 19)); }
elsif ($what eq "affinity") { my $m = pack("Q", 1); res(syscall(203, $t, 8, $m)); }
elsif ($what eq "scheduler") { my $p = pack("i", 0); res(syscall(144, $t, 5, $p)); }
elsif ($what =~ /^signal(\d+)$/) { kill($1, $t); sleep 0.2; print "$what=sent\n"; }
elsif ($what eq "own") {
    # The sandbox's own processes stay traceable.
    my $child = fork();
    if ($child == 0) { sleep 30; exit 0; }
    res(syscall(101, 16, $child, 0, 0));
    kill(9, $child); waitpid($child, 0);
}
"#;

/// The attempts, each its own exec.
const ATTEMPTS: &[&str] = &[
    "attach",
    "seize",
    "getfd",
    "vm_readv",
    "mem",
    "environ",
    "maps",
    "fd0",
    "root",
    "prlimit",
    "setpriority",
    "affinity",
    "scheduler",
    "signal19",
    "signal15",
    "signal9",
    "signal11",
    "own",
];

/// Run attempt `what` against `target` in `id` as `user` (None: root); its result (`ok` or
/// an errno; for signals `sent`). After it, an exec must still work.
fn attempt(node: &Node, id: &str, user: Option<&str>, target: &str, what: &str) -> String {
    let mut opts = vec!["--timeout", "60"];
    if let Some(u) = user {
        opts.extend(["--user", u]);
    }
    let script = format!("perl -e '{}' {target} {what}", PROBE.replace('\'', "'\\''"));
    let o = node.exec(id, &opts, &script);
    let out = text(&o.stdout);
    let result = out
        .trim()
        .strip_prefix(&format!("{what}="))
        .unwrap_or_else(|| panic!("{what}: no result ({}): {out}{}", o.status, text(&o.stderr)))
        .to_owned();
    assert_eq!(
        node.sh_ok(id, "echo still"),
        "still\n",
        "no exec right after {what}"
    );
    result
}

/// Every attempt against `target` as `user`: the refused ones refused, the reads failed,
/// the sandbox's own child traceable.
fn attack(node: &Node, id: &str, user: Option<&str>, target: &str) {
    let who = user.unwrap_or("root");
    for what in ATTEMPTS {
        let r = attempt(node, id, user, target, what);
        match *what {
            "getfd" => assert_eq!(r, "0", "{who}: copied descriptors of {target}"),
            "mem" | "environ" | "maps" | "fd0" | "root" => {
                assert_ne!(r, "ok", "{who}: read /proc/{target}/{what}")
            }
            "own" => assert_eq!(r, "ok", "{who}: cannot trace its own child"),
            w if w.starts_with("signal") => assert_eq!(r, "sent"),
            _ => assert_eq!(
                r, "1",
                "{who}: {what} on {target} was not refused with EPERM"
            ),
        }
    }
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
        attack(&node, &id, user, "1");
        // After every attempt (SIGSTOP and SIGKILL among them): the init runs, is the same
        // process, and answers.
        assert_ne!(state(init), 'T', "{who}: the init is stopped");
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
    attack(&node, &id, Some("nobody"), &target);
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
