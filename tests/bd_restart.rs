//! The OverlayBD image file (`strata bd serve --fuse`) survives kill -9 of its server.
//!
//! A device is served as an image file by a child `strata bd serve --fuse` (which starts the
//! fd holder, `strata fuse-holder`, in `<dir>/holder/`). A static region is written and
//! fsynced through the image; then an I/O child process (this test binary again) runs a
//! writer thread that keeps writing 64 KiB blocks with `O_DIRECT` (an fsync after every
//! fourth) into the rest, wrapping around with a new generation of contents each time, and a
//! reader thread that keeps reading and checking random blocks of the static region; both
//! keep the image open the whole time, and the child reports every acknowledged write. (The
//! I/O runs in a child because the test process starts the servers: a process with the image
//! open cannot exec while the server is dead, see `io_child`.) The server is killed with SIGKILL
//! `KILLS` times. After each kill: the image must still be mounted (the same FUSE device in
//! mountinfo), the writer and the reader must make no progress and see no error (their I/O
//! waits), and an open + write + fsync + read issued during the outage must not return; then
//! `strata bd serve --fuse` is started again and must report that it took the connection over
//! (`fuse_resumed`), and everything that waited completes. At the end: zero I/O errors, zero
//! wrong bytes, every acknowledged write present through the image and, after a clean stop
//! (SIGTERM: the mount is gone and the holder exits), in the reopened upper.
//!
//! Children, the holder and the mount are cleaned up by a Drop guard however the test ends.

mod common;

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ublk_daemon::bd::overlaybd::{Device, Upper};

const KILLS: usize = 5;
const BLOCK: usize = 64 << 10;
const SIZE: u64 = 64 << 20;
const BLOCKS: u64 = SIZE / BLOCK as u64;
/// Blocks 0..STATIC are written once before the kills and only read afterwards.
const STATIC: u64 = 128;
/// One block per outage, written by the thread started while the server is dead.
const OUTAGE: u64 = STATIC;
/// The writer's blocks: WRITER..BLOCKS, round and round.
const WRITER: u64 = STATIC + KILLS as u64;

/// Block `i`'s contents in generation `g` (the block number and generation in its first bytes).
fn pattern(i: u64, g: u64) -> Vec<u8> {
    let mut x = (i << 20 | g).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(BLOCK);
    v.extend_from_slice(&i.to_le_bytes());
    v.extend_from_slice(&g.to_le_bytes());
    while v.len() < BLOCK {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        v.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    v.truncate(BLOCK);
    v
}

/// An O_DIRECT buffer: a BLOCK-sized, 4 KiB-aligned window of a larger allocation.
struct Aligned(Vec<u8>, usize);
impl Aligned {
    fn new() -> Self {
        let raw = vec![0u8; BLOCK + 4096];
        let skew = raw.as_ptr().align_offset(4096);
        Aligned(raw, skew)
    }
    fn buf(&mut self) -> &mut [u8] {
        &mut self.0[self.1..self.1 + BLOCK]
    }
}

fn open_direct(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)
}

/// The device number `major:minor` of the newest mount at `path` (mountinfo; the mount itself
/// is never touched: with its server dead, a `stat` of it would wait).
fn mount_dev(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let path = path.to_str()?;
    text.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.get(4) == Some(&path)).then(|| f[2].to_owned())
    })
}

/// Processes whose command line contains `needle` (and "fuse-holder").
fn holders(needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("fuse-holder") && cmd.contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// Kills the servers and the fd holder and detaches the image, however the test ends (the
/// holder first: with it gone, any I/O still waiting on the image fails instead of hanging).
struct Cleanup<'a> {
    tmp: PathBuf,
    image: PathBuf,
    children: Arc<Mutex<Vec<Child>>>,
    servers: &'a Mutex<Vec<Child>>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let mut all: Vec<Child> = self
            .children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        all.extend(
            self.servers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .drain(..),
        );
        // Kill everything before waiting for anything: a process killed while its request
        // waits on the image for a server ends only once the holder is gone too (the kernel
        // waits out a request already sent, and the FLUSH of each file closed at exit).
        for c in &mut all {
            let _ = c.kill();
        }
        let _ = Command::new("pkill")
            .arg("-KILL")
            .arg("-f")
            .arg(self.tmp.as_os_str())
            .status();
        for mut c in all {
            let _ = c.wait();
        }
        std::thread::sleep(Duration::from_millis(100));
        while mount_dev(&self.image).is_some() {
            if let Err(e) = rustix::mount::unmount(&self.image, rustix::mount::UnmountFlags::DETACH)
            {
                eprintln!("cleanup: detach {}: {e}", self.image.display());
                break;
            }
        }
    }
}

/// Start `strata bd serve DIR --fuse IMAGE --json` and wait for its JSON line.
fn serve(
    tmp: &Path,
    dir: &Path,
    image: &Path,
    n: usize,
    children: &Mutex<Vec<Child>>,
) -> serde_json::Value {
    let log = std::fs::File::create(tmp.join(format!("serve{n}.log"))).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .env("STRATA_HOME", tmp.join("home"))
        .env("STRATA_LOG", "info")
        .arg("--store")
        .arg(tmp.join("store"))
        .arg("--json")
        .args(["bd", "serve"])
        .arg(dir)
        .arg("--fuse")
        .arg(image)
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    children.lock().unwrap().push(child);
    // The JSON object (pretty-printed) once it serves; the pipe stays open after it. Read on
    // a thread, so that a server that never comes up fails the test instead of hanging it.
    let pid = children.lock().unwrap().last().map(Child::id).unwrap_or(0);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let first = serde_json::Deserializer::from_reader(stdout)
            .into_iter::<serde_json::Value>()
            .next();
        let _ = tx.send(first);
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Some(Ok(v))) => v,
        other => {
            let log =
                std::fs::read_to_string(tmp.join(format!("serve{n}.log"))).unwrap_or_default();
            panic!(
                "server {n} did not come up: {other:?}\n{log}\nits threads:\n{}",
                threads_of(pid)
            )
        }
    }
}

/// Where each thread of `pid` waits in the kernel (for a server that hangs).
fn threads_of(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("(no process {pid})");
    };
    for t in tasks.flatten() {
        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
        out.push_str(&format!(
            "{} {} {}\n{}",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan"),
            read("stack")
        ));
    }
    out
}

/// The environment variable that makes this test binary the I/O child (its value: the image).
const IO_CHILD: &str = "STRATA_BD_RESTART_IO";

/// The I/O child: a writer and a reader on the image, both keeping it open, and outage
/// clients on demand. Reports on stdout, one line each: `ack I G` (block I now holds
/// generation G: the write returned), `fsync`, `read`, `wrong I`, `error MSG`, `outage K ok` /
/// `outage K error MSG`, and at the end `worst US` and `done`. Commands on stdin: `outage K`,
/// `stop`.
///
/// It runs in its own process because the test process starts the servers: a process that
/// has the image open cannot exec while the server is dead (every descriptor closed at exec,
/// close-on-exec ones included, sends the kernel's FLUSH, which waits for a server).
fn io_child(image: &Path) -> ! {
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let say = {
        let out = out.clone();
        move |line: String| {
            use std::io::Write;
            let mut o = out.lock().unwrap();
            let _ = writeln!(o, "{line}");
            let _ = o.flush();
        }
    };
    let say = Arc::new(say);
    // The harness printed `test NAME ... ` without a newline before this.
    say(String::new());
    let stop = Arc::new(AtomicBool::new(false));
    let worst = Arc::new(AtomicU64::new(0));
    let timed = {
        let (worst, say) = (worst.clone(), say.clone());
        move |f: &mut dyn FnMut() -> std::io::Result<()>| -> bool {
            let t = Instant::now();
            let r = f();
            worst.fetch_max(t.elapsed().as_micros() as u64, Ordering::SeqCst);
            match r {
                Ok(()) => true,
                Err(e) => {
                    say(format!("error {e}"));
                    false
                }
            }
        }
    };
    let timed = Arc::new(timed);
    let writer = {
        let (stop, say, timed, image) =
            (stop.clone(), say.clone(), timed.clone(), image.to_owned());
        std::thread::spawn(move || {
            let f = open_direct(&image).unwrap();
            let mut b = Aligned::new();
            let span = BLOCKS - WRITER;
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let (i, g) = (WRITER + n % span, n / span + 1);
                b.buf().copy_from_slice(&pattern(i, g));
                if !timed(&mut || f.write_all_at(b.buf(), i * BLOCK as u64)) {
                    return;
                }
                say(format!("ack {i} {g}"));
                if n % 4 == 3 {
                    if !timed(&mut || f.sync_all()) {
                        return;
                    }
                    say("fsync".into());
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let reader = {
        let (stop, say, timed, image) =
            (stop.clone(), say.clone(), timed.clone(), image.to_owned());
        std::thread::spawn(move || {
            let f = std::fs::File::open(&image).unwrap();
            let mut buf = vec![0u8; BLOCK];
            let mut rng = 7u64;
            while !stop.load(Ordering::SeqCst) {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let i = (rng >> 33) % STATIC;
                if !timed(&mut || f.read_exact_at(&mut buf, i * BLOCK as u64)) {
                    return;
                }
                if buf != pattern(i, 0) {
                    say(format!("wrong {i}"));
                }
                say("read".into());
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let mut outages = Vec::new();
    for line in std::io::stdin().lines() {
        let line = line.unwrap_or_default();
        if let Some(k) = line.strip_prefix("outage ") {
            let k: u64 = k.trim().parse().unwrap();
            let (say, image) = (say.clone(), image.to_owned());
            outages.push(std::thread::spawn(move || {
                let r = (|| -> std::io::Result<()> {
                    let f = open_direct(&image)?;
                    let mut b = Aligned::new();
                    let i = OUTAGE + k;
                    b.buf().copy_from_slice(&pattern(i, 9));
                    f.write_all_at(b.buf(), i * BLOCK as u64)?;
                    f.sync_all()?;
                    b.buf().fill(0);
                    f.read_exact_at(b.buf(), 0)?;
                    if b.buf() != &pattern(0, 0)[..] {
                        return Err(std::io::Error::other("read block 0 back wrong"));
                    }
                    Ok(())
                })();
                match r {
                    Ok(()) => say(format!("outage {k} ok")),
                    Err(e) => say(format!("outage {k} error {e}")),
                }
            }));
        } else if line == "stop" {
            break;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let _ = writer.join();
    let _ = reader.join();
    for o in outages {
        let _ = o.join();
    }
    say(format!("worst {}", worst.load(Ordering::SeqCst)));
    say("done".into());
    std::process::exit(0)
}

/// What the parent learns from the I/O child's reports.
#[derive(Default)]
struct Seen {
    writes: AtomicU64,
    fsyncs: AtomicU64,
    reads: AtomicU64,
    wrong: AtomicU64,
    errors: Mutex<Vec<String>>,
    outages: Mutex<Vec<(u64, Result<(), String>)>>,
    worst_us: AtomicU64,
    done: AtomicBool,
}

impl Seen {
    fn progress(&self) -> (u64, u64, u64) {
        (
            self.writes.load(Ordering::SeqCst),
            self.fsyncs.load(Ordering::SeqCst),
            self.reads.load(Ordering::SeqCst),
        )
    }
    fn errors(&self) -> Vec<String> {
        self.errors.lock().unwrap().clone()
    }
    fn outage(&self, k: u64) -> Option<Result<(), String>> {
        let o = self.outages.lock().unwrap();
        o.iter().find(|(n, _)| *n == k).map(|(_, r)| r.clone())
    }
}

#[test]
fn image_file_survives_kill9_of_its_server() {
    if let Some(image) = std::env::var_os(IO_CHILD) {
        io_child(Path::new(&image));
    }
    if !common::require_root("image_file_survives_kill9_of_its_server") {
        return;
    }
    let tmpdir = tempfile::tempdir().unwrap();
    let tmp = tmpdir.path().to_owned();
    let dir = tmp.join("dev");
    let image = tmp.join("disk.img");
    let children = Arc::new(Mutex::new(Vec::new()));
    let servers = Mutex::new(Vec::new());
    let _cleanup = Cleanup {
        tmp: tmp.clone(),
        image: image.clone(),
        children: children.clone(),
        servers: &servers,
    };
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .env("STRATA_HOME", tmp.join("home"))
        .arg("--store")
        .arg(tmp.join("store"))
        .args(["bd", "create"])
        .arg(&dir)
        .args(["--size", &SIZE.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    let first = serve(&tmp, &dir, &image, 0, &servers);
    assert_eq!(first["fuse_resumed"], false, "{first}");
    assert_eq!(first["image"], image.to_str().unwrap(), "{first}");
    let devno = mount_dev(&image).expect("the image file is mounted");
    assert_eq!(holders(dir.to_str().unwrap()).len(), 1, "one fd holder");

    // The static region, written and fsynced before anything is killed (from this process,
    // with the server alive; nothing here has the image open afterwards).
    {
        let f = open_direct(&image).unwrap();
        let mut b = Aligned::new();
        for i in 0..STATIC {
            b.buf().copy_from_slice(&pattern(i, 0));
            f.write_all_at(b.buf(), i * BLOCK as u64).unwrap();
        }
        f.sync_all().unwrap();
    }

    let mut io = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "image_file_survives_kill9_of_its_server",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IO_CHILD, &image)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut commands = io.stdin.take().unwrap();
    let io_out = io.stdout.take().unwrap();
    children.lock().unwrap().push(io);
    let seen = Arc::new(Seen::default());
    // The generation of each block acknowledged last (u64::MAX: never written).
    let acked: Arc<Vec<AtomicU64>> =
        Arc::new((0..BLOCKS).map(|_| AtomicU64::new(u64::MAX)).collect());
    let listener = {
        let (seen, acked) = (seen.clone(), acked.clone());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(io_out).lines() {
                let Ok(line) = line else { break };
                let w: Vec<&str> = line.split(' ').collect();
                match w.as_slice() {
                    ["ack", i, g] => {
                        let (i, g): (usize, u64) = (i.parse().unwrap(), g.parse().unwrap());
                        acked[i].store(g, Ordering::SeqCst);
                        seen.writes.fetch_add(1, Ordering::SeqCst);
                    }
                    ["fsync"] => {
                        seen.fsyncs.fetch_add(1, Ordering::SeqCst);
                    }
                    ["read"] => {
                        seen.reads.fetch_add(1, Ordering::SeqCst);
                    }
                    ["wrong", _] => {
                        seen.wrong.fetch_add(1, Ordering::SeqCst);
                        eprintln!("I/O child: {line}");
                    }
                    ["error", ..] => {
                        eprintln!("I/O child: {line}");
                        seen.errors.lock().unwrap().push(line.clone());
                    }
                    ["outage", k, "ok"] => {
                        let k = k.parse().unwrap();
                        seen.outages.lock().unwrap().push((k, Ok(())));
                    }
                    ["outage", k, "error", ..] => {
                        let k = k.parse().unwrap();
                        seen.outages.lock().unwrap().push((k, Err(line.clone())));
                    }
                    ["worst", us] => seen.worst_us.store(us.parse().unwrap(), Ordering::SeqCst),
                    ["done"] => seen.done.store(true, Ordering::SeqCst),
                    // The test harness's own lines.
                    _ => {}
                }
            }
        })
    };
    let command = |commands: &mut std::process::ChildStdin, c: &str| {
        use std::io::Write;
        writeln!(commands, "{c}").unwrap();
        commands.flush().unwrap();
    };
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            assert_eq!(seen.errors(), Vec::<String>::new(), "I/O errors");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let progressed = |since: (u64, u64, u64)| {
        let now = seen.progress();
        now.0 >= since.0 + 100 && now.1 > since.1 && now.2 >= since.2 + 100
    };
    let start = seen.progress();
    wait_for("the writer and the reader to get going", &|| {
        progressed(start)
    });

    let mut restart_ms = Vec::new();
    for k in 0..KILLS {
        // At a moment unrelated to the I/O: requests are often in flight in the server.
        std::thread::sleep(Duration::from_millis(
            (std::process::id() as u64 * 31 + k as u64 * 17) % 50,
        ));
        let mut server: Child = servers.lock().unwrap().pop().unwrap();
        server.kill().unwrap();
        server.wait().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // The mount stays, and what was in flight waits.
        assert_eq!(
            mount_dev(&image).as_deref(),
            Some(devno.as_str()),
            "kill {k}: the image file is no longer mounted"
        );
        let before = seen.progress();
        // A client that arrives during the outage: open, write, fsync, read.
        command(&mut commands, &format!("outage {k}"));
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(
            seen.progress(),
            before,
            "kill {k}: I/O completed with no server"
        );
        assert_eq!(
            seen.outage(k as u64),
            None,
            "kill {k}: the outage client did not wait"
        );
        assert_eq!(seen.errors(), Vec::<String>::new(), "kill {k}: I/O errors");

        let t = Instant::now();
        let v = serve(&tmp, &dir, &image, k + 1, &servers);
        restart_ms.push(t.elapsed().as_millis());
        assert_eq!(v["fuse_resumed"], true, "kill {k}: not taken over: {v}");
        assert_eq!(mount_dev(&image).as_deref(), Some(devno.as_str()));
        wait_for("the outage client", &|| seen.outage(k as u64).is_some());
        assert_eq!(seen.outage(k as u64), Some(Ok(())), "kill {k}");
        let since = seen.progress();
        wait_for("I/O to go on after the restart", &|| progressed(since));
    }
    command(&mut commands, "stop");
    wait_for("the I/O child to stop", &|| {
        seen.done.load(Ordering::SeqCst)
    });
    listener.join().unwrap();
    let (writes, fsyncs, reads) = seen.progress();
    let (errors, wrong) = (seen.errors(), seen.wrong.load(Ordering::SeqCst));
    eprintln!(
        "bd image file, {KILLS} x kill -9: {writes} writes ({fsyncs} fsyncs), {reads} reads, \
         {} errors, {wrong} wrong; longest single I/O {} ms; restart to serving {restart_ms:?} ms",
        errors.len(),
        seen.worst_us.load(Ordering::SeqCst) / 1000
    );
    assert_eq!((errors, wrong), (Vec::<String>::new(), 0));

    // Every acknowledged write, through the image.
    let check = |read: &dyn Fn(u64, &mut [u8])| {
        let mut buf = vec![0u8; BLOCK];
        for i in 0..BLOCKS {
            let want = if i < STATIC {
                pattern(i, 0)
            } else if i < WRITER {
                pattern(i, 9)
            } else {
                match acked[i as usize].load(Ordering::SeqCst) {
                    u64::MAX => vec![0u8; BLOCK],
                    g => pattern(i, g),
                }
            };
            read(i, &mut buf);
            assert!(
                buf == want,
                "block {i} does not hold its last acknowledged write"
            );
        }
    };
    {
        let f = std::fs::File::open(&image).unwrap();
        check(&|i, buf| f.read_exact_at(buf, i * BLOCK as u64).unwrap());
    }

    // A clean stop: unmounted, and the holder lets go and exits.
    let mut server: Child = servers.lock().unwrap().pop().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&server),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let status = server.wait().unwrap();
    assert!(status.success(), "the server's clean stop failed: {status}");
    assert_eq!(mount_dev(&image), None, "the image file is still mounted");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !holders(dir.to_str().unwrap()).is_empty() {
        assert!(Instant::now() < deadline, "the fd holder did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }

    // And in the upper, reopened.
    let device = Device::open(Vec::new(), Some(Upper::open(&dir).unwrap())).unwrap();
    check(&|i, buf| device.read_at(i * BLOCK as u64, buf).unwrap());
}

/// A kept connection that cannot be resumed (the next server serves another image path) is
/// let go: its mount is detached, the new image file is mounted anew and shows the device's
/// data. While it is kept, `strata bd serve --ublk` refuses the directory.
#[test]
fn kept_image_file_for_another_path_is_let_go() {
    if !common::require_root("kept_image_file_for_another_path_is_let_go") {
        return;
    }
    let tmpdir = tempfile::tempdir().unwrap();
    let tmp = tmpdir.path().to_owned();
    let dir = tmp.join("dev");
    let (old, new) = (tmp.join("old.img"), tmp.join("new.img"));
    let children = Arc::new(Mutex::new(Vec::new()));
    let servers = Mutex::new(Vec::new());
    let _cleanup = Cleanup {
        tmp: tmp.clone(),
        image: old.clone(),
        children: children.clone(),
        servers: &servers,
    };
    let _cleanup_new = Cleanup {
        tmp: tmp.clone(),
        image: new.clone(),
        children: children.clone(),
        servers: &servers,
    };
    let strata = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
        c.env("STRATA_HOME", tmp.join("home"))
            .arg("--store")
            .arg(tmp.join("store"));
        c
    };
    let out = strata()
        .args(["bd", "create"])
        .arg(&dir)
        .args(["--size", "8MiB"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v = serve(&tmp, &dir, &old, 0, &servers);
    assert_eq!(v["fuse_resumed"], false, "{v}");
    {
        let f = open_direct(&old).unwrap();
        let mut b = Aligned::new();
        b.buf().copy_from_slice(&pattern(3, 1));
        f.write_all_at(b.buf(), 3 * BLOCK as u64).unwrap();
        f.sync_all().unwrap();
    }
    let mut server: Child = servers.lock().unwrap().pop().unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    let devno = mount_dev(&old).expect("the image file stays mounted");

    let out = strata()
        .args(["bd", "serve"])
        .arg(&dir)
        .arg("--ublk")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "--ublk served a device whose image file waits"
    );
    assert!(
        err.contains("old.img") && err.contains("--fuse"),
        "unexpected refusal: {err}"
    );
    assert_eq!(mount_dev(&old).as_deref(), Some(devno.as_str()));

    let v = serve(&tmp, &dir, &new, 1, &servers);
    assert_eq!(v["fuse_resumed"], false, "{v}");
    assert_eq!(mount_dev(&old), None, "the old image file was not detached");
    let f = std::fs::File::open(&new).unwrap();
    let mut buf = vec![0u8; BLOCK];
    f.read_exact_at(&mut buf, 3 * BLOCK as u64).unwrap();
    assert!(
        buf == pattern(3, 1),
        "the device's data is not in the new image file"
    );
    drop(f);

    let mut server: Child = servers.lock().unwrap().pop().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&server),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    assert!(server.wait().unwrap().success());
    assert_eq!(mount_dev(&new), None);
    let deadline = Instant::now() + Duration::from_secs(15);
    while !holders(dir.to_str().unwrap()).is_empty() {
        assert!(Instant::now() < deadline, "the fd holder did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}
