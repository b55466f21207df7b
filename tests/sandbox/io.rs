//! Driving running execs through the node socket (what the E2B API builds on): stdin kept
//! open and fed later, a pseudo-terminal with its size and a resize, signals to a process
//! group, tags, and pause/resume of a whole sandbox.

use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use ublk_daemon::node::client::Client;

use super::{ready, text, Node};

pub(super) fn client(node: &Node) -> Client {
    Client::connect(&ublk_daemon::node::socket_path(&node.run)).expect("the daemon's socket")
}

pub(super) fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// Start a detached exec; its id.
pub(super) fn start(node: &Node, req: Value) -> String {
    let mut req = req;
    req["op"] = "sandbox_exec".into();
    req["detach"] = true.into();
    let r: Value = client(node)
        .call_streaming(&req, |_| Ok(()))
        .unwrap_or_else(|e| panic!("{req}: {}", e.message));
    assert_eq!(r["running"], true, "{r}");
    r["exec"].as_str().expect("the exec's id").to_owned()
}

pub(super) fn input(node: &Node, req: Value) -> Result<Value, String> {
    let mut req = req;
    req["op"] = "sandbox_input".into();
    client(node)
        .call_streaming(&req, |_| Ok(()))
        .map_err(|e| e.message)
}

/// Follow exec `exec` to its end: (stdout, the result).
pub(super) fn attach(node: &Node, id: &str, exec: &str) -> (String, Value) {
    let mut out = Vec::new();
    let r: Value = client(node)
        .call_streaming(
            &json!({"op": "sandbox_attach", "id": id, "exec": exec}),
            |ev| {
                if ev["type"] == "output" && ev["stream"] == "stdout" {
                    out.extend(
                        base64::engine::general_purpose::STANDARD
                            .decode(ev["data"].as_str().unwrap_or_default())
                            .unwrap(),
                    );
                }
                Ok(())
            },
        )
        .unwrap_or_else(|e| panic!("attach {exec}: {}", e.message));
    (text(&out), r)
}

#[test]
fn running_execs_take_input_a_terminal_signals_and_a_pause() {
    if !ready("running_execs_take_input_a_terminal_signals_and_a_pause") {
        return;
    }
    let node = Node::new("io");
    let id = node.create("io-a", &[]);

    // stdin kept open: bytes written later reach the command; closing ends its input.
    let cat = start(
        &node,
        json!({"id": id, "args": ["sh", "-c", "cat; echo end"], "stdin_open": true,
               "stdin": b64("first\n"), "tag": "the-cat"}),
    );
    input(
        &node,
        json!({"id": id, "exec": cat, "data": b64("second\n")}),
    )
    .unwrap();
    input(&node, json!({"id": id, "exec": cat, "close": true})).unwrap();
    let (out, r) = attach(&node, &id, &cat);
    assert_eq!(out, "first\nsecond\nend\n");
    assert_eq!(r["exit_code"], 0);
    // Input to an exec that has ended, or one started without open stdin, is refused.
    assert!(input(&node, json!({"id": id, "exec": cat, "data": b64("x")})).is_err());
    let no_stdin = start(&node, json!({"id": id, "args": ["sleep", "0.2"]}));
    let e = input(&node, json!({"id": id, "exec": no_stdin, "data": b64("x")})).unwrap_err();
    assert!(e.contains("no open stdin"), "{e}");

    // A terminal: the command sees one of the asked size on all three streams, as its
    // controlling terminal; a resize reaches it; what it types back comes out as stdout.
    let script = "stty size; test -t 0 && test -t 1 && test -t 2 && echo tty; \
                  read line; stty size; echo got:$line; echo x > /dev/tty && echo ctty";
    let t = start(
        &node,
        json!({"id": id, "args": ["sh", "-c", script], "pty": {"cols": 100, "rows": 30}}),
    );
    std::thread::sleep(Duration::from_millis(300));
    input(
        &node,
        json!({"id": id, "exec": t, "pty": {"cols": 90, "rows": 20}}),
    )
    .unwrap();
    input(&node, json!({"id": id, "exec": t, "data": b64("hello\n")})).unwrap();
    let (out, r) = attach(&node, &id, &t);
    assert_eq!(r["exit_code"], 0, "{out}");
    let lines: Vec<&str> = out.lines().map(|l| l.trim_end_matches('\r')).collect();
    assert!(lines.contains(&"30 100"), "{out:?}");
    assert!(lines.contains(&"tty"), "{out:?}");
    assert!(lines.contains(&"20 90"), "{out:?}");
    assert!(lines.contains(&"got:hello"), "{out:?}");
    assert!(lines.contains(&"ctty"), "{out:?}");

    // A signal goes to the command's process group: both the shell and its child end.
    let group = start(
        &node,
        json!({"id": id, "args": ["sh", "-c", "sleep 60 & sleep 60; echo never"]}),
    );
    std::thread::sleep(Duration::from_millis(200));
    input(&node, json!({"id": id, "exec": group, "signal": 15})).unwrap();
    let (out, r) = attach(&node, &id, &group);
    assert_eq!(out, "");
    assert_eq!(r["signal"], 15, "{r}");
    assert_eq!(
        node.sh_ok(&id, "cat /proc/[0-9]*/comm | grep -c '^sleep$' || true")
            .trim(),
        "0"
    );
    let e = input(&node, json!({"id": id, "exec": group, "signal": 99})).unwrap_err();
    assert!(e.contains("ended") || e.contains("no signal"), "{e}");
    // Tags are kept with the exec.
    let d = node.json(&["sandbox", "inspect", &id]);
    assert!(d["execs"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["exec"] == cat));

    // Pause: nothing runs, no exec starts; resume: it goes on where it was.
    let ticker = start(
        &node,
        json!({"id": id, "args": ["sh", "-c", "i=0; while [ $i -lt 100 ]; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.05; done"]}),
    );
    std::thread::sleep(Duration::from_millis(300));
    let p = node.json(&["sandbox", "pause", &id]);
    assert_eq!(p["state"], "paused");
    let view = format!("/proc/{}/root/tmp/tick", p["pid"]);
    let before = std::fs::read_to_string(&view).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(std::fs::read_to_string(&view).unwrap(), before, "frozen");
    let o = node.sh(&id, "true");
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("paused"), "{}", text(&o.stderr));
    let again = node.cmd().args(["sandbox", "pause", &id]).output().unwrap();
    assert!(!again.status.success(), "a second pause is a conflict");
    let t0 = Instant::now();
    assert_eq!(node.json(&["sandbox", "resume", &id])["state"], "running");
    let (_, r) = attach(&node, &id, &ticker);
    assert_eq!(r["exit_code"], 0);
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(node.sh_ok(&id, "cat /tmp/tick").trim(), "100");
    // A paused sandbox is removed like any other.
    node.ok(&["sandbox", "pause", &id]);
    node.ok(&["sandbox", "rm", &id]);
    assert!(node.json(&["sandbox", "ls"]).as_array().unwrap().is_empty());
}
