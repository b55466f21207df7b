//! The node daemon is killed under load and its mounts do not notice.
//!
//! A three-layer overlay stack with an upper is mounted with `strata mount`; 16 reader threads
//! read every file in a loop and compare every byte with the source (dropping the pages they
//! read, so that reads keep reaching the daemon); a child process keeps its working directory,
//! an open file and a shared mapping inside the mount; a writer thread writes files into the
//! upper through the mount. The daemon is `kill -9`ed at random moments and started again,
//! `KILLS` times, then upgraded once with `strata daemon --takeover`. Every reader must see
//! zero errors and zero wrong bytes, the child must keep working, and every write must be in
//! the upper. The longest time one read took (the stall a reader saw) is printed.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KILLS: usize = 50;
const READERS: usize = 16;

fn strata(home: &Path, store: &str, run_dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.env("STRATA_HOME", home)
        .env("STRATA_RUN_DIR", run_dir)
        .arg("--store")
        .arg(store);
    c
}

fn run_ok(mut c: Command) -> String {
    let out = c.output().expect("run strata");
    assert!(
        out.status.success(),
        "strata failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// xorshift64*: the test's file contents, reproducible from a seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// A tree of `files` files (some shared names across layers, so upper layers shadow lower
/// ones), sizes from a few bytes to 3 MiB.
fn make_tree(dir: &Path, seed: u64, files: usize) {
    let mut rng = Rng(seed);
    for i in 0..files {
        // Names 0..40 exist in every layer (shadowed); the others are the layer's own.
        let name = if i < 40 {
            format!("shared/f{i:03}")
        } else {
            format!("own{seed}/d{}/f{i:04}", i % 7)
        };
        let size = match rng.below(10) {
            0 => rng.below(3 << 20) as usize,
            1..=3 => rng.below(300 << 10) as usize,
            _ => rng.below(16 << 10) as usize,
        };
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, rng.bytes(size)).unwrap();
    }
}

/// Every file of the merged view (top layer wins) and the source file holding its bytes.
fn merged(layers: &[PathBuf]) -> Vec<(PathBuf, PathBuf)> {
    let mut map = std::collections::BTreeMap::new();
    for top in layers {
        let mut stack = vec![top.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    map.insert(p.strip_prefix(top).unwrap().to_owned(), p);
                }
            }
        }
    }
    map.into_iter().collect()
}

/// Kills whatever is left (daemon, holder, the child) and detaches every mount, however the
/// test ends.
struct Cleanup {
    run_dir: PathBuf,
    /// The store URL without its query: the daemons take the run directory from the
    /// environment, so their command lines name only the store (unique to the test: a bucket
    /// or a temporary path; `pkill` takes a regular expression, which the query's `?` would
    /// spoil).
    store: String,
    mountpoint: PathBuf,
    children: Arc<Mutex<Vec<Child>>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for mut c in self.children.lock().unwrap().drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = rustix::mount::unmount(&self.mountpoint, rustix::mount::UnmountFlags::DETACH);
        // The fd holder (its command line names the run directory) and every daemon of the
        // test (the restarted ones and the upgrade, which a failed assertion leaves running).
        for pattern in [self.run_dir.as_os_str(), std::ffi::OsStr::new(&self.store)] {
            let _ = Command::new("pkill")
                .arg("-KILL")
                .arg("-f")
                .arg(pattern)
                .status();
        }
        std::thread::sleep(Duration::from_millis(100));
        let _ = ublk_daemon::node::sys::detach_stale(&self.run_dir);
    }
}

fn daemon_pid(run_dir: &Path) -> Option<i32> {
    std::fs::read_to_string(run_dir.join("strata.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn alive(pid: i32) -> bool {
    rustix::process::Pid::from_raw(pid)
        .is_some_and(|p| rustix::process::test_kill_process(p).is_ok())
}

/// The daemon's command line, to start it again the same way.
fn cmdline(pid: i32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    raw.split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

fn wait_answering(home: &Path, store: &str, run_dir: &Path, not: i32, log: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(pid) = daemon_pid(run_dir).filter(|p| *p != not && alive(*p)) {
            let mut c = strata(home, store, run_dir);
            c.args(["--json", "status"]);
            if let Ok(out) = c.output() {
                let text = String::from_utf8_lossy(&out.stdout);
                let answered = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|v| v["pong"]["pid"].as_i64());
                if out.status.success() && answered == Some(i64::from(pid)) {
                    return pid;
                }
                if Instant::now() > deadline {
                    eprintln!("status: {}\n{text}", String::from_utf8_lossy(&out.stderr));
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no daemon answered within 60 s; its log:\n{}\nholder log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default(),
            std::fs::read_to_string(run_dir.join("holder.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

const CHILD: &str = r#"
import mmap, os, sys, time
mp, src_file, rel = sys.argv[1], sys.argv[2], sys.argv[3]
want = open(src_file, 'rb').read()
os.chdir(os.path.join(mp, os.path.dirname(rel)))
f = open(os.path.basename(rel), 'rb')
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
n = bad = 0
sys.stdout.write('ready\n'); sys.stdout.flush()
while not os.path.exists(sys.argv[4]):
    try:
        m.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if m[:] != want: bad += 1
        f.seek(0)
        if f.read() != want: bad += 1
        if os.path.basename(rel) not in os.listdir('.'): bad += 1
        n += 1
    except Exception as e:
        bad += 1
        sys.stderr.write('child: %r\n' % (e,))
        time.sleep(0.05)
print('done %d %d' % (n, bad))
"#;

#[test]
fn kill9_and_takeover_under_load_lose_nothing() {
    if !common::require_root("kill9_and_takeover_under_load_lose_nothing") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store").to_string_lossy().into_owned();
    scenario(tmp.path(), &store, "posix");
}

/// Make bucket `name` on the S3 test server at `endpoint` (`http://127.0.0.1:PORT`; moto
/// takes an unsigned `PUT /bucket`).
fn make_bucket(endpoint: &str, name: &str) {
    use std::io::{Read, Write};
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut c = std::net::TcpStream::connect(host).expect("connect to the S3 test server");
    write!(
        c,
        "PUT /{name} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "create bucket {name}: {answer}"
    );
}

#[test]
fn kill9_and_takeover_under_load_lose_nothing_over_s3() {
    if !common::require_root("kill9_and_takeover_under_load_lose_nothing_over_s3") {
        return;
    }
    let Ok(endpoint) = std::env::var("STRATA_TEST_S3_ENDPOINT") else {
        eprintln!(
            "SKIPPED kill9_and_takeover_under_load_lose_nothing_over_s3: STRATA_TEST_S3_ENDPOINT \
             is not set (scripts/test.sh starts moto and sets it)"
        );
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "scripts/test.sh sets STRATA_TEST_S3_ENDPOINT under CI"
        );
        return;
    };
    let bucket = format!("restart-{}", std::process::id());
    make_bucket(&endpoint, &bucket);
    let tmp = tempfile::tempdir().unwrap();
    let store = format!("s3://{bucket}/strata?endpoint={endpoint}&region=us-east-1");
    scenario(tmp.path(), &store, "s3");
}

fn scenario(tmp: &Path, store: &str, label: &str) {
    let store = store.to_owned();
    let (home, run_dir) = (tmp.join("home"), tmp.join("run"));
    let mp = tmp.join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let children = Arc::new(Mutex::new(Vec::new()));
    let _cleanup = Cleanup {
        run_dir: run_dir.clone(),
        store: store.split('?').next().unwrap_or_default().to_owned(),
        mountpoint: mp.clone(),
        children: children.clone(),
    };
    let names = ["base/os:1", "workspace/task:1", "toolkit/py:1"];
    let mut sources = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let src = tmp.join(format!("src{i}"));
        make_tree(&src, i as u64 + 1, 160);
        let mut c = strata(&home, &store, &run_dir);
        c.args(["layer", "build", "--quiet"])
            .arg(&src)
            .args(["--name", name]);
        run_ok(c);
        sources.push(src);
    }
    let files = Arc::new(merged(&sources));
    // One layer wholly in level 2 before its mount: read without the daemon (FUSE
    // passthrough, or a local device where the kernel refuses that), through every kill and
    // the takeover below.
    let mut c = strata(&home, &store, &run_dir);
    c.args(["warm", names[2]]);
    run_ok(c);
    let upper = tmp.join("upper");
    let mut c = strata(&home, &store, &run_dir);
    c.arg("mount")
        .args(names)
        .arg(&mp)
        .arg("--upper")
        .arg(&upper);
    run_ok(c);
    std::fs::create_dir_all(mp.join("written")).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (reads, errors, wrong, worst_us) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let mut threads = Vec::new();
    for r in 0..READERS {
        let (files, stop, reads, errors, wrong, worst_us, mp) = (
            files.clone(),
            stop.clone(),
            reads.clone(),
            errors.clone(),
            wrong.clone(),
            worst_us.clone(),
            mp.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let mut i = r * 7;
            while !stop.load(Ordering::Relaxed) {
                let (rel, src) = &files[i % files.len()];
                i += 1;
                let started = Instant::now();
                let got = std::fs::File::open(mp.join(rel)).and_then(|f| {
                    let mut v = Vec::new();
                    std::io::Read::read_to_end(&mut &f, &mut v)?;
                    // Drop the pages: the next read of this file reaches the daemon again.
                    let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
                    Ok(v)
                });
                let us = started.elapsed().as_micros() as u64;
                worst_us.fetch_max(us, Ordering::Relaxed);
                reads.fetch_add(1, Ordering::Relaxed);
                match got {
                    Ok(v) if v == std::fs::read(src).unwrap() => {}
                    Ok(_) => {
                        wrong.fetch_add(1, Ordering::Relaxed);
                        eprintln!("WRONG BYTES in {}", rel.display());
                    }
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        eprintln!("READ ERROR {}: {e}", rel.display());
                    }
                }
            }
        }));
    }
    // The writer: files into the upper, through the mount.
    let written = Arc::new(AtomicU64::new(0));
    let write_errors = Arc::new(AtomicU64::new(0));
    {
        let (stop, mp, written, write_errors) = (
            stop.clone(),
            mp.clone(),
            written.clone(),
            write_errors.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let body = format!("write {n}\n").repeat(100);
                let p = mp.join("written").join(format!("w{n}"));
                match std::fs::write(&p, &body).and_then(|()| std::fs::File::open(&p)?.sync_all()) {
                    Ok(()) => {
                        n += 1;
                        written.store(n, Ordering::Relaxed);
                    }
                    Err(e) => {
                        write_errors.fetch_add(1, Ordering::Relaxed);
                        eprintln!("WRITE ERROR {}: {e}", p.display());
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }));
    }
    // The child with a cwd, an open file and a mapping inside the mount.
    let (rel, src) = files
        .iter()
        .find(|(r, _)| std::fs::metadata(mp.join(r)).unwrap().len() > 100_000)
        .cloned()
        .expect("a file of more than 100 kB");
    let done_flag = tmp.join("child.stop");
    let mut child = Command::new("python3")
        .args(["-c", CHILD])
        .arg(&mp)
        .arg(&src)
        .arg(&rel)
        .arg(&done_flag)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut child_out = std::io::BufReader::new(child.stdout.take().unwrap());
    children.lock().unwrap().push(child);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut child_out, &mut line).unwrap();
    assert_eq!(line.trim(), "ready");

    // Kill the daemon at random moments and start it again the way it was started.
    let mut rng = Rng(0x5eed);
    let mut pid = daemon_pid(&run_dir).expect("the daemon runs");
    let args = cmdline(pid);
    let mut restarts = Vec::new();
    // The daemon we started last (the first one was started by `strata mount`): reaped after
    // each kill, or it stays a zombie that looks alive.
    let mut current: Option<Child> = None;
    for k in 0..KILLS {
        std::thread::sleep(Duration::from_millis(50 + rng.below(250)));
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        if let Some(mut c) = current.take() {
            let _ = c.wait();
        }
        while alive(pid) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Readers meanwhile wait in the kernel; give them a moment of outage too.
        std::thread::sleep(Duration::from_millis(rng.below(100)));
        let started = Instant::now();
        let log_path = tmp.join(format!("daemon{k}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let c = Command::new(&args[0])
            .args(&args[1..])
            .env("STRATA_HOME", &home)
            .env("STRATA_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        current = Some(c);
        pid = wait_answering(&home, &store, &run_dir, pid, &log_path);
        restarts.push(started.elapsed());
    }
    // A planned upgrade.
    let log = std::fs::File::create(tmp.join("takeover.log")).unwrap();
    let mut up = strata(&home, &store, &run_dir);
    up.args(["daemon", "--takeover"])
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    let mut upgraded = up.spawn().unwrap();
    let old = pid;
    pid = wait_answering(&home, &store, &run_dir, old, &tmp.join("takeover.log"));
    let mut old_child = current.take().expect("the last restarted daemon");
    let status = old_child.wait().unwrap();
    assert!(
        status.success(),
        "the old daemon exits 0 after a handover: {status}"
    );
    std::thread::sleep(Duration::from_millis(500));

    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    std::fs::write(&done_flag, b"").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut child_out, &mut line).unwrap();
    let parts: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap())
        .collect();
    restarts.sort();
    println!(
        "{label}: {KILLS} kill -9 + 1 takeover: {} reads by {READERS} readers, {} errors, {} wrong; \
         longest read {:.1} ms; restart to answering p50 {:.0} ms, max {:.0} ms; child {} \
         loops, {} bad; {} writes, {} write errors",
        reads.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        wrong.load(Ordering::Relaxed),
        worst_us.load(Ordering::Relaxed) as f64 / 1000.0,
        restarts[restarts.len() / 2].as_secs_f64() * 1000.0,
        restarts[restarts.len() - 1].as_secs_f64() * 1000.0,
        parts.first().copied().unwrap_or(0),
        parts.get(1).copied().unwrap_or(u64::MAX),
        written.load(Ordering::Relaxed),
        write_errors.load(Ordering::Relaxed),
    );
    if errors.load(Ordering::Relaxed) + wrong.load(Ordering::Relaxed) > 0 {
        // What the daemons said about it.
        for k in 0..KILLS {
            let log =
                std::fs::read_to_string(tmp.join(format!("daemon{k}.log"))).unwrap_or_default();
            for l in log
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            {
                eprintln!("daemon{k}: {l}");
            }
        }
    }
    assert_eq!(errors.load(Ordering::Relaxed), 0, "read errors");
    assert_eq!(wrong.load(Ordering::Relaxed), 0, "wrong bytes");
    assert_eq!(write_errors.load(Ordering::Relaxed), 0, "write errors");
    assert_eq!(parts.get(1), Some(&0), "the cwd/mmap child: {line}");
    assert!(parts[0] > 0, "the child made progress: {line}");
    // Every write is in the upper.
    let n = written.load(Ordering::Relaxed);
    assert!(n > 0);
    for i in 0..n {
        let body = std::fs::read_to_string(upper.join("written").join(format!("w{i}"))).unwrap();
        assert_eq!(body, format!("write {i}\n").repeat(100));
    }
    assert!(reads.load(Ordering::Relaxed) > 1000);

    // The warm layer is still read without the daemon after every restart.
    let mut c = strata(&home, &store, &run_dir);
    c.args(["--json", "status"]);
    let status: serde_json::Value = serde_json::from_str(&run_ok(c)).unwrap();
    let warm = status["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["refs"].to_string().contains(names[2]))
        .unwrap_or_else(|| panic!("{label}: no {} in {status}", names[2]));
    // Its main blob and its tails blob.
    assert_eq!(warm["passthrough_blobs"], 2, "{label}: {warm}");
    let token = Path::new(warm["mnt"].as_str().unwrap())
        .parent()
        .unwrap()
        .join("local-device");

    // A clean stop unmounts everything, and the holder goes with it.
    let mut c = strata(&home, &store, &run_dir);
    c.arg("umount").arg(&mp);
    run_ok(c);
    assert!(
        !token.exists(),
        "{label}: {} outlived the layer",
        token.display()
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let status = upgraded.wait().unwrap();
    assert!(
        status.success(),
        "the upgraded daemon stops cleanly: {status}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while run_dir.join("holder.sock").exists() {
        assert!(
            Instant::now() < deadline,
            "the daemon or its fd holder did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<_> = ublk_daemon::node::sys::mounts()
        .unwrap()
        .into_iter()
        .filter(|m| ublk_daemon::node::sys::is_ours(m, &run_dir))
        .collect();
    assert!(left.is_empty(), "mounts left: {left:?}");
}
