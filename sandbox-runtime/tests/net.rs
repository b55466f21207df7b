//! `--net allow=…` for real: sandboxes' namespaces from `net::setup`, "the sandbox" emulated
//! by sockets opened inside its namespace, test hosts in their own namespaces behind their
//! own veths (`stn<k>`, 10.214.0.4k/30). Root, `ip` and `nft` needed. Everything made is
//! removed by a guard, even when a test fails; nothing leaves the machine (every address
//! tried is a test host's, a sandbox's or the host's own).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use sandbox_runtime::net::{self, SandboxNet};

/// How long a refused connection may take to fail (dropped SYNs time out).
const REFUSED: Duration = Duration::from_millis(600);

/// The tests share the host's table: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn ready(test: &str) -> Option<MutexGuard<'static, ()>> {
    let have = |p: &str| {
        Command::new(p)
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let why = if !rustix::process::geteuid().is_root() {
        Some("needs root")
    } else if !have("ip") || !have("nft") {
        Some("needs ip (iproute2) and nft (nftables)")
    } else {
        None
    };
    if let Some(why) = why {
        println!("\n*** SKIP: {test}: {why} ***\n");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test} must run under CI ({why})"
        );
        return None;
    }
    Some(SERIAL.lock().unwrap_or_else(|p| p.into_inner()))
}

fn sh(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Wait for `dev` to be operationally up (until the link watcher has run, it drops).
fn wait_up(dev: &str) {
    for _ in 0..500 {
        let o = Command::new("ip")
            .args(["-o", "link", "show", "dev", dev])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&o.stdout).contains(" state UP ") {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{dev} did not come up");
}

/// A listener answering every connection with `hello <addr>` and closing it.
struct Listener {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    fn start(l: TcpListener) -> Listener {
        l.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.set_nonblocking(false);
                        if let Ok(to) = c.local_addr() {
                            let _ = c.write_all(format!("hello {to}").as_bytes());
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Listener {
            stop,
            thread: Some(thread),
        }
    }

    /// The same over UDP: every datagram is answered with `hello <addr>`.
    fn udp(u: UdpSocket) -> Listener {
        let to = u.local_addr().unwrap();
        u.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while !s.load(Ordering::Relaxed) {
                if let Ok((_, from)) = u.recv_from(&mut buf) {
                    let _ = u.send_to(format!("hello {to}").as_bytes(), from);
                }
            }
        });
        Listener {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Everything a test made; dropping it removes all of it.
struct Guard {
    run_dir: tempfile::TempDir,
    sandboxes: Vec<(String, u32)>,
    host_links: Vec<String>,
    host_netns: Vec<PathBuf>,
    listeners: Vec<Listener>,
}

impl Guard {
    fn new() -> Guard {
        Guard {
            run_dir: tempfile::tempdir().unwrap(),
            sandboxes: Vec::new(),
            host_links: Vec::new(),
            host_netns: Vec::new(),
            listeners: Vec::new(),
        }
    }

    fn run_dir(&self) -> &Path {
        self.run_dir.path()
    }

    fn sandbox(&mut self, id: &str, slot: u32, rules: &str) -> SandboxNet {
        self.sandboxes.push((id.to_owned(), slot));
        let rules = net::parse_allowlist(rules).unwrap();
        net::setup(self.run_dir.path(), id, slot, &rules).unwrap()
    }

    /// Test host `k`: its own namespace, `stn<k>` (10.214.0.4k+1/30) on the host, the host at
    /// 10.214.0.4k+2 listening on `ports`; its address.
    fn test_host(&mut self, k: u8, ports: &[u16]) -> Ipv4Addr {
        let link = format!("stn{k}");
        let path = self.run_dir.path().join(format!("testhost{k}"));
        self.host_links.push(link.clone());
        self.host_netns.push(path.clone());
        net::create_netns(&path).unwrap();
        let (gw, addr) = (
            Ipv4Addr::new(10, 214, 0, 4 * k + 1),
            Ipv4Addr::new(10, 214, 0, 4 * k + 2),
        );
        let ns = path.to_str().unwrap();
        sh(
            "ip",
            &[
                "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ],
        );
        sh("ip", &["addr", "add", &format!("{gw}/30"), "dev", &link]);
        sh("ip", &["link", "set", &link, "up"]);
        let listeners = net::in_netns(&path, || {
            sh("ip", &["link", "set", "lo", "up"]);
            sh("ip", &["addr", "add", &format!("{addr}/30"), "dev", "eth0"]);
            sh("ip", &["link", "set", "eth0", "up"]);
            wait_up("eth0");
            ports
                .iter()
                .map(|p| {
                    let t = TcpListener::bind((addr, *p)).unwrap();
                    (t, UdpSocket::bind((addr, *p)).unwrap())
                })
                .collect::<Vec<_>>()
        })
        .unwrap();
        wait_up(&link);
        for (t, u) in listeners {
            self.listeners.push(Listener::start(t));
            self.listeners.push(Listener::udp(u));
        }
        addr
    }

    /// A listener inside sandbox `sb` on its own address; its port.
    fn listen_in(&mut self, sb: &SandboxNet) -> u16 {
        let l = net::in_netns(&sb.netns, || {
            TcpListener::bind((sb.sandbox_addr, 0)).unwrap()
        })
        .unwrap();
        let port = l.local_addr().unwrap().port();
        self.listeners.push(Listener::start(l));
        port
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.listeners.clear();
        for (id, slot) in &self.sandboxes {
            if let Err(e) = net::teardown(self.run_dir.path(), id, *slot) {
                eprintln!("teardown {id}: {e}");
            }
        }
        for l in &self.host_links {
            let _ = Command::new("ip").args(["link", "del", l]).output();
        }
        for p in &self.host_netns {
            let _ = net::remove_netns(p);
        }
        if let Err(e) = net::remove_table_if_unused() {
            eprintln!("remove table: {e}");
        }
    }
}

/// What a connection from inside `ns` to `addr:port` read, or why it failed.
fn connect_from(ns: &Path, addr: Ipv4Addr, port: u16) -> Result<String, String> {
    net::in_netns(ns, || {
        let to = SocketAddr::V4(SocketAddrV4::new(addr, port));
        let mut c = TcpStream::connect_timeout(&to, REFUSED).map_err(|e| e.to_string())?;
        c.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut s = String::new();
        c.read_to_string(&mut s).map_err(|e| e.to_string())?;
        Ok(s)
    })
    .map_err(|e| e.to_string())?
}

/// Whether a datagram from inside `ns` to `addr:port` is answered (three tries).
fn udp_answered(ns: &Path, addr: Ipv4Addr, port: u16) -> bool {
    net::in_netns(ns, || {
        let u = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        u.set_read_timeout(Some(REFUSED / 3)).unwrap();
        let mut buf = [0u8; 64];
        (0..3).any(|_| {
            let _ = u.send_to(b"hi", (addr, port));
            matches!(u.recv_from(&mut buf), Ok((n, _)) if buf[..n] == *format!("hello {addr}:{port}").as_bytes())
        })
    })
    .unwrap()
}

fn reaches(ns: &Path, addr: Ipv4Addr, port: u16) {
    match connect_from(ns, addr, port) {
        Ok(s) => assert_eq!(s, format!("hello {addr}:{port}")),
        Err(e) => {
            let dump = |p: &str, a: &[&str]| {
                let o = Command::new(p).args(a).output().unwrap();
                eprintln!("$ {p} {a:?}\n{}", String::from_utf8_lossy(&o.stdout));
            };
            dump("nft", &["list", "ruleset"]);
            dump("ip", &["-s", "addr"]);
            dump("ip", &["route"]);
            let _ = net::in_netns(ns, || {
                dump("ip", &["-s", "addr"]);
                dump("ip", &["route"]);
            });
            dump("cat", &["/proc/net/nf_conntrack"]);
            panic!("{} cannot reach {addr}:{port}: {e}", ns.display())
        }
    }
}

fn blocked(ns: &Path, addr: Ipv4Addr, port: u16) {
    if let Ok(s) = connect_from(ns, addr, port) {
        panic!("{} reached {addr}:{port} ({s:?})", ns.display());
    }
}

/// The host's IPv4 addresses (`ip -4 -o addr`), loopback's left out (inside a sandbox,
/// 127/8 is its own loopback).
fn host_addrs() -> Vec<Ipv4Addr> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.position(|x| x == "inet")?;
            w.next()?.split('/').next()?.parse().ok()
        })
        .filter(|a: &Ipv4Addr| !a.is_loopback())
        .collect()
}

#[test]
fn egress_reaches_exactly_the_allowlist() {
    let Some(_serial) = ready("egress_reaches_exactly_the_allowlist") else {
        return;
    };
    let mut g = Guard::new();
    let a = g.test_host(0, &[8080, 8081]);
    let b = g.test_host(1, &[8080]);
    // A broad rule and even the sandboxes' own block: neither opens what must stay shut.
    let sb = g.sandbox(
        "net-a",
        16000,
        &format!("{a}:8080/tcp,0.0.0.0/0,10.213.0.0/16"),
    );
    let other = g.sandbox("net-b", 16001, "0.0.0.0/0");
    assert_eq!(sb.host_if, "sx16000");
    assert_eq!(sb.gateway, Ipv4Addr::new(10, 213, 250, 1));
    assert_eq!(sb.sandbox_addr, Ipv4Addr::new(10, 213, 250, 2));
    assert_eq!(sb.netns, g.run_dir().join("netns/net-a"));

    // The listeners answer (from the host, unfiltered): what fails below is the filter.
    reaches(Path::new("/proc/self/ns/net"), a, 8081);
    reaches(Path::new("/proc/self/ns/net"), b, 8080);

    // (a) the listed host and port.
    reaches(&sb.netns, a, 8080);
    // (b) the same host on another port; a host not listed (a private address: 0.0.0.0/0
    // does not open it).
    blocked(&sb.netns, a, 8081);
    blocked(&sb.netns, b, 8080);
    // `/tcp` is TCP only.
    assert!(udp_answered(Path::new("/proc/self/ns/net"), a, 8080));
    assert!(!udp_answered(&sb.netns, a, 8080));

    // (c) the host: a listener on all its addresses, reached from the host itself but from
    // the sandbox at none of them (its gateway, the test hosts' gateways, every other).
    let on_host = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    let hp = on_host.local_addr().unwrap().port();
    g.listeners.push(Listener::start(on_host));
    let addrs = host_addrs();
    assert!(addrs.contains(&sb.gateway), "{addrs:?}");
    assert!(addrs.contains(&Ipv4Addr::new(10, 214, 0, 1)), "{addrs:?}");
    for h in &addrs {
        reaches(Path::new("/proc/self/ns/net"), *h, hp);
        blocked(&sb.netns, *h, hp);
    }
    println!("host addresses refused to the sandbox: {addrs:?}");

    // (d) another sandbox: reachable from itself and the host, never from the first.
    let port = g.listen_in(&other);
    reaches(&other.netns, other.sandbox_addr, port);
    reaches(Path::new("/proc/self/ns/net"), other.sandbox_addr, port);
    blocked(&sb.netns, other.sandbox_addr, port);
    // Nor the first from the second (its 0.0.0.0/0 included).
    let port = g.listen_in(&sb);
    blocked(&other.netns, sb.sandbox_addr, port);
    blocked(&other.netns, a, 8080);
}

#[test]
fn update_swaps_the_rules_atomically() {
    let Some(_serial) = ready("update_swaps_the_rules_atomically") else {
        return;
    };
    let mut g = Guard::new();
    let c = g.test_host(2, &[8080]);
    let d = g.test_host(3, &[8080]);
    let sb = g.sandbox("net-c", 16002, &format!("{c}:8080"));
    reaches(&sb.netns, c, 8080);
    blocked(&sb.netns, d, 8080);
    // A port without a protocol is TCP and UDP.
    assert!(udp_answered(&sb.netns, c, 8080));
    assert!(!udp_answered(&sb.netns, d, 8080));

    // (e) swapped: what was allowed no longer is, the new one is.
    let rules = net::parse_allowlist(&format!("{d}:8080/tcp")).unwrap();
    net::update(g.run_dir(), &sb, &rules).unwrap();
    blocked(&sb.netns, c, 8080);
    reaches(&sb.netns, d, 8080);

    // While rules are replaced over and over, a destination in every version never fails:
    // there is no moment with a half-written list.
    let both = net::parse_allowlist(&format!("{c}:8080/tcp,{d}:8080/tcp")).unwrap();
    let stop = AtomicBool::new(false);
    let (ok, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                match connect_from(&sb.netns, d, 8080) {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        });
        for i in 0..40 {
            let r = if i % 2 == 0 { &both } else { &rules };
            net::update(g.run_dir(), &sb, r).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    let (ok, failed) = (ok.into_inner(), failed.into_inner());
    println!("40 updates: {ok} connections during them, {failed} failed");
    assert!(ok > 0);
    assert_eq!(failed, 0);

    // A single address of the host is reachable when named (its gateway, this port only).
    let on_host = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    let hp = on_host.local_addr().unwrap().port();
    g.listeners.push(Listener::start(on_host));
    blocked(&sb.netns, sb.gateway, hp);
    let rules = net::parse_allowlist(&format!("{}:{hp}/tcp", sb.gateway)).unwrap();
    net::update(g.run_dir(), &sb, &rules).unwrap();
    reaches(&sb.netns, sb.gateway, hp);
    blocked(&sb.netns, Ipv4Addr::new(10, 214, 0, 9), hp);
    blocked(&sb.netns, d, 8080);
}

fn chain_exists(name: &str) -> bool {
    Command::new("nft")
        .args(["list", "chain", "inet", net::TABLE, name])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn link_exists(name: &str) -> bool {
    Command::new("ip")
        .args(["link", "show", "dev", name])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn teardown_leaves_nothing_and_is_idempotent() {
    let Some(_serial) = ready("teardown_leaves_nothing_and_is_idempotent") else {
        return;
    };
    let mut g = Guard::new();
    let e = g.test_host(4, &[8080]);
    let one = g.sandbox("net-d", 16003, "10.214.0.0/24:8080/tcp");
    let two = g.sandbox("net-e", 16004, "10.214.0.0/24:8080/tcp");
    reaches(&two.netns, e, 8080);
    assert!(link_exists("sx16003") && chain_exists("out_sx16003") && one.netns.exists());

    // The slot and the id are taken.
    let err = net::setup(g.run_dir(), "net-x", 16003, &[]).unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    let err = net::setup(g.run_dir(), "net-d", 16005, &[]).unwrap_err();
    assert!(err.to_string().contains("exists"), "{err}");
    assert!(!link_exists("sx16005") && !chain_exists("out_sx16005"));

    // (g) gone: veth, chains, map entries, namespace file; a second time is fine; and the
    // other sandbox is untouched.
    net::teardown(g.run_dir(), "net-d", 16003).unwrap();
    assert!(!link_exists("sx16003"));
    assert!(!chain_exists("out_sx16003") && !chain_exists("host_sx16003"));
    let table = Command::new("nft")
        .args(["list", "table", "inet", net::TABLE])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(!table.contains("sx16003"), "{table}");
    assert!(table.contains("\"sx16004\" : jump out_sx16004"), "{table}");
    assert!(!one.netns.exists());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(one.netns.to_str().unwrap()));
    net::teardown(g.run_dir(), "net-d", 16003).unwrap();
    net::teardown(g.run_dir(), "never-made", 16099).unwrap();
    reaches(&two.netns, e, 8080);
    // The update of a torn-down sandbox is refused.
    assert!(net::update(g.run_dir(), &one, &[]).is_err());
    // The slot is free again.
    let again = g.sandbox("net-f", 16003, &format!("{e}:8080"));
    reaches(&again.netns, e, 8080);
}
