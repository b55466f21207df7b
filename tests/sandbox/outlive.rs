//! Execs outlive the daemon: commands streaming output across `kill -9` of the daemon and a
//! `--takeover` keep every byte, never see SIGPIPE, and their exact exit status is served by
//! the next daemon — one of them ending while no daemon runs at all.

use std::time::Duration;

use super::{ready, text, Node};

/// Lines each streaming command writes, one per stream every 50 ms.
const LINES: usize = 120;

fn kill9(node: &Node) {
    let pid = node.daemon_pid().expect("a daemon runs");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    // Gone before the next one starts.
    for _ in 0..200 {
        if rustix::process::test_kill_process(rustix::process::Pid::from_raw(pid).unwrap()).is_err()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Start `script` detached in `id`; its exec id.
fn start(node: &Node, id: &str, script: &str) -> String {
    node.ok(&["sandbox", "exec", id, "--detach", "--", "sh", "-c", script])
        .trim()
        .to_owned()
}

#[test]
fn eight_streaming_execs_lose_nothing_across_three_kill9_and_a_takeover() {
    if !ready("eight_streaming_execs_lose_nothing_across_three_kill9_and_a_takeover") {
        return;
    }
    let node = Node::new("outlive");
    let id = node.create("outlive", &[]);

    // Seven long commands; the seventh writes through `tee`, which a closed pipe would kill.
    let mut execs = Vec::new();
    for k in 0..7usize {
        let body = format!(
            "i=0; while [ $i -lt {LINES} ]; do echo \"c{k} out $i\"; echo \"c{k} err $i\" >&2; \
             echo $i > /tmp/c{k}.last; i=$((i+1)); sleep 0.05; done"
        );
        let script = if k == 6 {
            format!("({body}) | tee /tmp/c6.tee; exit {}", 10 + k)
        } else {
            format!("{body}; exit {}", 10 + k)
        };
        execs.push((k, start(&node, &id, &script), LINES));
    }
    std::thread::sleep(Duration::from_millis(700));
    // The eighth ends while no daemon runs.
    let short = 20;
    let e = start(
        &node,
        &id,
        &format!(
            "i=0; while [ $i -lt {short} ]; do echo \"c7 out $i\"; echo \"c7 err $i\" >&2; \
             echo $i > /tmp/c7.last; i=$((i+1)); sleep 0.05; done; exit 17"
        ),
    );
    execs.push((7, e, short));
    kill9(&node);
    std::thread::sleep(Duration::from_millis(1500));
    node.start_daemon();
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(700));
        kill9(&node);
        std::thread::sleep(Duration::from_millis(300));
        node.start_daemon();
    }
    std::thread::sleep(Duration::from_millis(700));
    node.start_daemon_with(&["--takeover"]);
    // Every exec, through the daemon that took over: every line of both streams in order,
    // the exact status.
    for (k, e, lines) in &execs {
        let r = node.json_any(&["sandbox", "attach", &id, e]);
        let want =
            |what: &str| -> String { (0..*lines).map(|i| format!("c{k} {what} {i}\n")).collect() };
        assert_eq!(r["reason"], "exited", "exec {k}: {r}");
        assert_eq!(r["exit_code"], 10 + *k as u64, "exec {k}: {r}");
        assert_eq!(
            r["stdout"].as_str().unwrap(),
            want("out"),
            "exec {k}'s stdout"
        );
        assert_eq!(
            r["stderr"].as_str().unwrap(),
            want("err"),
            "exec {k}'s stderr"
        );
        // It wrote all its lines (none died of SIGPIPE).
        assert_eq!(
            node.sh_ok(&id, &format!("cat /tmp/c{k}.last")),
            format!("{}\n", lines - 1)
        );
    }
    assert_eq!(
        node.sh_ok(&id, "wc -l < /tmp/c6.tee"),
        format!("{LINES}\n"),
        "tee did not write every line"
    );
    // What the daemon that took over lists: the same execs, with their pids.
    let d = node.json(&["sandbox", "inspect", &id]);
    for (_, e, _) in &execs {
        assert!(
            d["execs"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x["exec"] == *e),
            "{e} not listed: {d}"
        );
    }
    println!("{}", text(node.ok(&["sandbox", "ls"]).as_bytes()));
}

#[test]
fn input_a_terminal_and_signals_reach_a_running_exec_through_the_next_daemon() {
    if !ready("input_a_terminal_and_signals_reach_a_running_exec_through_the_next_daemon") {
        return;
    }
    use super::io::{attach, b64, input, start};
    use serde_json::json;
    let node = Node::new("outlive-io");
    let id = node.create("outlive-io", &[]);
    let cat = start(
        &node,
        json!({"id": id, "args": ["sh", "-c", "cat; echo end"], "stdin_open": true,
               "stdin": b64("first\n")}),
    );
    let script = "read line; stty size; echo got:$line";
    let tty = start(
        &node,
        json!({"id": id, "args": ["sh", "-c", script], "pty": {"cols": 100, "rows": 30}}),
    );
    let group = start(
        &node,
        json!({"id": id, "args": ["sh", "-c", "sleep 60 & sleep 60; echo never"]}),
    );
    std::thread::sleep(Duration::from_millis(300));
    kill9(&node);
    node.start_daemon();
    // Through the daemon that did not start them: more input and the end of it, a resize
    // and a line typed at the terminal, a signal to a process group.
    input(
        &node,
        json!({"id": id, "exec": cat, "data": b64("second\n")}),
    )
    .unwrap();
    input(&node, json!({"id": id, "exec": cat, "close": true})).unwrap();
    let (out, r) = attach(&node, &id, &cat);
    assert_eq!(out, "first\nsecond\nend\n");
    assert_eq!(r["exit_code"], 0, "{r}");
    input(
        &node,
        json!({"id": id, "exec": tty, "pty": {"cols": 90, "rows": 20}}),
    )
    .unwrap();
    input(
        &node,
        json!({"id": id, "exec": tty, "data": b64("hello\n")}),
    )
    .unwrap();
    let (out, r) = attach(&node, &id, &tty);
    assert_eq!(r["exit_code"], 0, "{out}");
    let lines: Vec<&str> = out.lines().map(|l| l.trim_end_matches('\r')).collect();
    assert!(lines.contains(&"20 90"), "{out:?}");
    assert!(lines.contains(&"got:hello"), "{out:?}");
    input(&node, json!({"id": id, "exec": group, "signal": 15})).unwrap();
    let (out, r) = attach(&node, &id, &group);
    assert_eq!(out, "");
    assert_eq!(r["signal"], 15, "{r}");
}

#[test]
fn what_ended_execs_keep_on_the_node_is_bounded() {
    if !ready("what_ended_execs_keep_on_the_node_is_bounded") {
        return;
    }
    let mut node = Node::new("outlive-budget");
    node.env
        .push(("STRATA_EXEC_OUTPUT_BUDGET", (250 * 1000).to_string()));
    let id = node.create("outlive-budget", &[]);
    let execs: Vec<String> = (0..5)
        .map(|_| {
            let e = start(&node, &id, "head -c 100000 /dev/zero");
            let r = node.json_any(&["sandbox", "attach", &id, &e]);
            assert_eq!(r["stdout_bytes"], 100000, "{r}");
            e
        })
        .collect();
    // The node trims every 10 s: the execs that ended first go, the last ones stay.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let attachable = |e: &str| {
        node.cmd()
            .args(["sandbox", "attach", &id, e])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap()
            .success()
    };
    while attachable(&execs[0]) {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing was trimmed in 30 s"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let kept: Vec<bool> = execs.iter().map(|e| attachable(e)).collect();
    assert_eq!(
        kept,
        [false, false, false, true, true],
        "which execs stayed"
    );
    let dir = node.home.join("sandboxes").join(&id).join("execs");
    for e in &execs[..3] {
        assert!(!dir.join(e).exists(), "{e}'s files are still there");
    }
}
