//! `sandbox suspend` / `resume` on the real Debian stack: a sandbox with a running process,
//! open files, a written upper and a detached exec is suspended (its memory reclaimed),
//! survives a daemon restart suspended, and resumes exactly as it was; a suspended sandbox
//! leaves a layer's page cache to a running neighbour (and drops it when no one runs it); with
//! a swap file of the test's own, anonymous memory goes out and comes back.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{ready, Node};

/// The base layer's biggest file (apt's package list, ~50 MB).
const BIG: &str =
    "/var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages";

/// Resident bytes of a host file (util-linux `fincore`).
fn resident(p: &Path) -> u64 {
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(p)
        .output()
        .unwrap();
    assert!(out.status.success(), "fincore {}: {:?}", p.display(), out);
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Drop a host file's pages from the page cache.
fn evict(p: &Path) {
    let f = std::fs::File::open(p).unwrap();
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
}

/// Where the node mounted the layer `reference` (its EROFS), from `status --json`.
fn layer_mnt(node: &Node, reference: &str) -> PathBuf {
    let s = node.json(&["status"]);
    let l = s["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| {
            l["refs"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x == reference))
        })
        .unwrap_or_else(|| panic!("no layer {reference} in {s}"));
    PathBuf::from(l["mnt"].as_str().unwrap())
}

fn state(node: &Node, id: &str) -> String {
    node.json(&["sandbox", "inspect", id])["state"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn suspend_and_resume_keep_everything_and_reclaim_memory() {
    if !ready("suspend_and_resume_keep_everything_and_reclaim_memory") {
        return;
    }
    let node = Node::new("suspend");
    let id = node.create("susp-a", &[]);
    // State of every kind: a process with an open upper file and 32 MiB of its own memory,
    // a counter that runs while thawed (replaced by a rename, so that a reader never sees
    // the empty file between a truncate and its write: that race failed this test in CI), an
    // upper file, layer files read.
    node.sh_ok(
        &id,
        "head -c 33554432 /dev/urandom > /root/big && md5sum /root/big > /root/big.md5 && \
         cat /work/src/fs-cache/*.rs /work/src/fs-cache/*/*.rs > /dev/null && \
         nohup perl -e 'open(my $f, \"<\", \"/root/big\") or die; my $x = \"s\" x (32<<20); \
           $SIG{USR1} = sub { open(my $o, \">\", \"/root/alive\"); print $o length($x), \"\\n\"; \
           close $o }; while (1) { sleep 1 }' > /dev/null 2>&1 & \
         echo $! > /root/perl.pid; \
         nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /root/counter.new; \
           mv /root/counter.new /root/counter; sleep 0.05; done' \
           > /dev/null 2>&1 & sleep 0.5; echo ok",
    );
    let perl_pid = node.sh_ok(&id, "cat /root/perl.pid").trim().to_owned();
    let upper = PathBuf::from(
        node.json(&["sandbox", "inspect", &id])["upper"]
            .as_str()
            .unwrap(),
    );
    assert!(
        resident(&upper.join("root/big")) > 16 << 20,
        "the upper file is cached"
    );

    let r = node.json(&["sandbox", "suspend", &id]);
    assert_eq!(r["info"]["state"], "suspended", "{r}");
    let (before, after) = (&r["before"], &r["after"]);
    let b_file = before["file"].as_u64().unwrap();
    let a_file = after["file"].as_u64().unwrap();
    assert!(b_file > 32 << 20, "{r}");
    assert!(a_file * 4 < b_file, "the page cache is reclaimed: {r}");
    assert!(
        after["usage"].as_u64().unwrap() < before["usage"].as_u64().unwrap(),
        "{r}"
    );
    assert!(r["anon_bytes"].as_u64().unwrap() >= 32 << 20, "{r}");
    assert!(r["file_bytes"].as_u64().unwrap() > 0, "{r}");
    assert!(r["shared_layers"].as_array().unwrap().is_empty(), "{r}");
    assert!(
        r["cgroup_reclaim"].as_str().unwrap().starts_with("memory."),
        "{r}"
    );
    assert!(
        resident(&upper.join("root/big")) < 4 << 20,
        "the upper's pages are dropped"
    );
    println!("suspend: {r}");

    // Suspended: nothing runs, no exec is taken, `ls` says so, a second suspend is refused.
    let c1 = std::fs::read_to_string(upper.join("root/counter")).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        std::fs::read_to_string(upper.join("root/counter")).unwrap(),
        c1
    );
    let refused = node.sh(&id, "true");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("suspended"));
    let again = node
        .cmd()
        .args(["sandbox", "suspend", &id])
        .output()
        .unwrap();
    assert!(!again.status.success());
    let ls = node.ok(&["sandbox", "ls"]);
    assert!(
        ls.lines()
            .any(|l| l.starts_with(&id) && l.contains("suspended")),
        "{ls}"
    );

    // A daemon restart while suspended: still suspended, the record kept.
    let pid = node.daemon_pid().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    node.start_daemon();
    assert_eq!(state(&node, &id), "suspended");

    let r = node.json(&["sandbox", "resume", &id]);
    assert_eq!(r["state"], "running", "{r}");
    let p = &r["prefetch"];
    assert!(p["page_bytes"].as_u64().unwrap() > 0, "{r}");
    assert!(p["files"].as_u64().unwrap() > 0, "{r}");
    assert!(
        p["chunk_bytes"].as_u64().unwrap() > 0,
        "layer chunks prefetched: {r}"
    );
    println!("resume: {r}");
    // Exactly as it was: the same process with its open file and its memory, the counter
    // going again, the upper intact, the detached exec reattached to its end.
    let script = format!(
        "kill -USR1 {perl_pid} && sleep 1.5 && cat /root/alive && \
         readlink /proc/{perl_pid}/fd/3 && md5sum -c --quiet /root/big.md5 && echo same"
    );
    assert_eq!(
        node.sh_ok(&id, &script),
        format!("{}\n/root/big\nsame\n", 32 << 20)
    );
    let c2: u64 = node.sh_ok(&id, "cat /root/counter").trim().parse().unwrap();
    assert!(
        c2 > c1.trim().parse::<u64>().unwrap(),
        "the counter runs again"
    );
    // An exec running across a suspend and resume is reattached to its end.
    let exec = node
        .ok(&[
            "sandbox",
            "exec",
            &id,
            "--detach",
            "--",
            "sh",
            "-c",
            "for i in $(seq 1 40); do echo line$i; sleep 0.05; done",
        ])
        .trim()
        .to_owned();
    std::thread::sleep(Duration::from_millis(300));
    node.json(&["sandbox", "suspend", &id]);
    std::thread::sleep(Duration::from_millis(500));
    node.ok(&["sandbox", "resume", &id]);
    let attached = node.ok(&["sandbox", "attach", &id, &exec]);
    let want: String = (1..=40).map(|i| format!("line{i}\n")).collect();
    assert_eq!(attached, want);
    // A paused sandbox suspends too, and resume of a running one is refused.
    node.ok(&["sandbox", "pause", &id]);
    let r = node.json(&["sandbox", "suspend", &id]);
    assert_eq!(r["info"]["state"], "suspended");
    node.ok(&["sandbox", "resume", &id]);
    assert!(!node
        .cmd()
        .args(["sandbox", "resume", &id])
        .output()
        .unwrap()
        .status
        .success());
}

#[test]
fn a_suspended_sandbox_leaves_a_shared_layer_cache_to_its_neighbours() {
    if !ready("a_suspended_sandbox_leaves_a_shared_layer_cache_to_its_neighbours") {
        return;
    }
    let node = Node::new("suspend-shared");
    let a = node.create("shared-a", &[]);
    let b = node.create("shared-b", &[]);
    let big = layer_mnt(&node, super::BASE).join(BIG.trim_start_matches('/'));
    let size = std::fs::metadata(&big).unwrap().len();
    // A reads the layer's file first (its pages are charged to A), then B reads it too.
    evict(&big);
    let read = format!("cat {BIG} > /dev/null && echo 'private' > /root/mine && sync && echo ok");
    node.sh_ok(&a, &read);
    node.sh_ok(&b, &format!("cat {BIG} > /dev/null && echo ok"));
    assert!(resident(&big) * 10 >= size * 9, "read twice, it is cached");
    let r = node.json(&["sandbox", "suspend", &a]);
    assert!(
        r["shared_layers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l == super::BASE),
        "{r}"
    );
    assert!(
        r["cgroup_reclaim"].as_str().unwrap().starts_with("skipped"),
        "{r}"
    );
    assert!(
        resident(&big) * 10 >= size * 9,
        "B's layer pages stayed: {} of {size}: {r}",
        resident(&big)
    );
    node.ok(&["sandbox", "resume", &a]);
    // With B paused no running sandbox reads the layer: A's suspend takes its pages.
    node.sh_ok(&a, &read);
    node.ok(&["sandbox", "pause", &b]);
    let r = node.json(&["sandbox", "suspend", &a]);
    assert!(r["shared_layers"].as_array().unwrap().is_empty(), "{r}");
    assert!(
        resident(&big) * 2 < size,
        "no running neighbour: the pages went ({} of {size}): {r}",
        resident(&big)
    );
    node.ok(&["sandbox", "resume", &a]);
    node.ok(&["sandbox", "resume", &b]);
    assert_eq!(node.sh_ok(&a, "cat /root/mine"), "private\n");
}

/// A swap file of the test's own, removed however the test ends.
struct Swap(PathBuf);

impl Swap {
    fn add() -> Result<Swap, String> {
        let p = PathBuf::from(format!("/var/tmp/strata-test-swap-{}", std::process::id()));
        let sh = |c: &str| {
            let out = Command::new("sh").arg("-c").arg(c).output().unwrap();
            if out.status.success() {
                Ok(())
            } else {
                Err(format!("{c}: {}", String::from_utf8_lossy(&out.stderr)))
            }
        };
        let path = p.display();
        let swap = Swap(p.clone());
        sh(&format!(
            "dd if=/dev/zero of={path} bs=1M count=1024 status=none && chmod 600 {path} && \
             mkswap {path} > /dev/null"
        ))?;
        sh(&format!("swapon {path}"))?;
        Ok(swap)
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.0).status();
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn with_swap_anonymous_memory_goes_out_and_comes_back() {
    if !ready("with_swap_anonymous_memory_goes_out_and_comes_back") {
        return;
    }
    let swap = match Swap::add() {
        Ok(s) => s,
        Err(e) => {
            // The kernel or the filesystem refuses swap files: said loudly, not a pass.
            println!("\n*** SKIPPED with_swap_anonymous_memory_goes_out_and_comes_back: {e} ***\n");
            return;
        }
    };
    let node = Node::new("suspend-swap");
    let id = node.create("swap-a", &["--memory", "1GiB"]);
    node.sh_ok(
        &id,
        "nohup perl -e 'my $x = \"w\" x (96<<20); \
           $SIG{USR1} = sub { open(my $o, \">\", \"/root/alive\"); \
           print $o length($x), \" \", ($x =~ tr/w//), \"\\n\"; close $o }; \
           while (1) { sleep 1 }' > /dev/null 2>&1 & echo $! > /root/perl.pid; sleep 1; echo ok",
    );
    let r = node.json(&["sandbox", "suspend", &id]);
    println!("suspend with swap: {r}");
    let (before, after) = (&r["before"], &r["after"]);
    assert_eq!(r["swap"], true);
    let b_anon = before["anon"].as_u64().unwrap();
    assert!(b_anon >= 96 << 20, "{r}");
    assert!(
        after["anon"].as_u64().unwrap() * 10 <= b_anon,
        "anonymous memory went to swap: {r}"
    );
    assert!(after["swap"].as_u64().unwrap() >= 64 << 20, "{r}");
    assert!(
        after["usage"].as_u64().unwrap() * 10 <= before["usage"].as_u64().unwrap(),
        "resident memory after is at most 10% of before: {r}"
    );
    let r = node.json(&["sandbox", "resume", &id]);
    println!("resume with swap: {r}");
    assert!(
        r["prefetch"]["swapin_bytes"].as_u64().unwrap() >= 96 << 20,
        "{r}"
    );
    let pid = node.sh_ok(&id, "cat /root/perl.pid").trim().to_owned();
    let n = 96u64 << 20;
    assert_eq!(
        node.sh_ok(
            &id,
            &format!("kill -USR1 {pid} && sleep 1.5 && cat /root/alive")
        ),
        format!("{n} {n}\n")
    );
    drop(node);
    drop(swap);
}
