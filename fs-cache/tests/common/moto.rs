//! A local S3 server for tests.
//!
//! `STRATA_TEST_S3_ENDPOINT=http://host:port` points the tests at a running S3-compatible
//! server. Otherwise `moto_server` (from `pip install 'moto[server]'`) is started once per test
//! binary on a free port of 127.0.0.1 and killed with the test process (`PR_SET_PDEATHSIG`).
//! Without either, S3 tests are skipped with a loud `SKIPPED` line, except under `CI=true`,
//! where a missing server is a failure.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use fs_cache::Backend;

/// A reachable S3 endpoint.
#[derive(Debug)]
pub struct S3Server {
    /// `http://127.0.0.1:PORT` (or whatever `STRATA_TEST_S3_ENDPOINT` says).
    pub endpoint: String,
}

static SERVER: OnceLock<Option<S3Server>> = OnceLock::new();

/// The test S3 server, started on first use; `None` (after a `SKIPPED` line) if there is none.
pub fn s3_server() -> Option<&'static S3Server> {
    SERVER.get_or_init(start).as_ref()
}

fn start() -> Option<S3Server> {
    for (name, value) in [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
    ] {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    if let Ok(endpoint) = std::env::var("STRATA_TEST_S3_ENDPOINT") {
        if !endpoint.trim().is_empty() {
            let endpoint = endpoint.trim().trim_end_matches('/').to_owned();
            return Some(S3Server { endpoint });
        }
    }
    let port = free_port();
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("moto-server".into())
        .spawn(move || run_moto(port, tx))
        .expect("spawn the moto_server thread");
    let outcome = rx
        .recv()
        .unwrap_or_else(|_| Outcome::Broken("the moto_server thread died".into()));
    match outcome {
        Outcome::Ready => Some(S3Server {
            endpoint: format!("http://127.0.0.1:{port}"),
        }),
        Outcome::Missing(why) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!(
                    "CI=true but no S3 test server: {why}. Install it with \
                     `pip install 'moto[server]'` or set STRATA_TEST_S3_ENDPOINT"
                );
            }
            // Straight to the process's stderr, past the test harness's output capture.
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIPPED: no S3 test server (install moto[server]): {why} ***\n"
            );
            None
        }
        Outcome::Broken(why) => panic!("moto_server did not come up: {why}"),
    }
}

enum Outcome {
    Ready,
    /// Not installed (or not runnable): skip, unless in CI.
    Missing(String),
    /// Installed but not answering: always a failure.
    Broken(String),
}

/// Runs on a thread that lives as long as the process: `PR_SET_PDEATHSIG` fires when the
/// thread that spawned the child exits, so this thread must never return.
fn run_moto(port: u16, tx: mpsc::Sender<Outcome>) {
    let log = std::env::temp_dir().join(format!("strata-moto-{}.log", std::process::id()));
    let stderr = std::fs::File::create(&log)
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null());
    let mut cmd = Command::new("moto_server");
    cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which
    // is async-signal-safe; it touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let outcome = match cmd.spawn() {
        Err(e) => Outcome::Missing(format!("cannot run moto_server: {e}")),
        Ok(mut child) => {
            let deadline = Instant::now() + Duration::from_secs(20);
            let outcome = loop {
                if let Ok(Some(status)) = child.try_wait() {
                    let tail = std::fs::read_to_string(&log).unwrap_or_default();
                    let tail: String = tail
                        .lines()
                        .last()
                        .unwrap_or("")
                        .chars()
                        .take(300)
                        .collect();
                    break Outcome::Missing(format!("moto_server exited with {status}: {tail}"));
                }
                if answers_http(port) {
                    // The log only matters if the server does not come up.
                    let _ = std::fs::remove_file(&log);
                    break Outcome::Ready;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break Outcome::Broken(format!(
                        "no HTTP answer on 127.0.0.1:{port} within 20 s (log: {})",
                        log.display()
                    ));
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            let _ = tx.send(outcome);
            // Keep the child (and this thread) alive for the rest of the process.
            loop {
                std::thread::park();
            }
        }
    };
    let _ = tx.send(outcome);
    loop {
        std::thread::park();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a free port on 127.0.0.1")
}

fn answers_http(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut conn) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET / HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    let mut head = [0u8; 8];
    conn.write_all(request.as_bytes()).is_ok()
        && conn.read_exact(&mut head).is_ok()
        && head.starts_with(b"HTTP/1.")
}

/// An SDK client for the test server (path-style, test credentials), for test set-up and
/// for looking behind the backend's back.
pub fn client(server: &S3Server) -> aws_sdk_s3::Client {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| "test".to_owned());
    let creds = Credentials::new(
        var("AWS_ACCESS_KEY_ID"),
        var("AWS_SECRET_ACCESS_KEY"),
        None,
        None,
        "strata-tests",
    );
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(&server.endpoint)
        .force_path_style(true)
        .credentials_provider(creds)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

/// Create a bucket with a name no other test (or test process) uses.
pub async fn new_bucket(server: &S3Server) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "strata-test-{}-{}-{:08x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        fastrand::u32(..)
    );
    client(server)
        .create_bucket()
        .bucket(&name)
        .send()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "create bucket {name} on {}: {}",
                server.endpoint,
                aws_sdk_s3::error::DisplayErrorContext(e)
            )
        });
    name
}

/// The store URL of `bucket`/`prefix` on `server`.
pub fn s3_url(server: &S3Server, bucket: &str, prefix: &str) -> String {
    format!(
        "s3://{bucket}/{prefix}?endpoint={}&region=us-east-1",
        server.endpoint
    )
}

/// A connected S3 backend on a fresh bucket, keys under `prefix`; `None` if there is no test
/// server (see [`s3_server`]).
pub async fn s3_backend(prefix: &str) -> Option<Arc<dyn Backend>> {
    let server = s3_server()?;
    let bucket = new_bucket(server).await;
    let url = s3_url(server, &bucket, prefix);
    let backend = fs_cache::open_backend(&url)
        .await
        .unwrap_or_else(|e| panic!("open {url}: {e}"));
    Some(backend)
}
