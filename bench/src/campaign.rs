//! The fault campaign's stage, shared by the CI test (`tests/faults.rs`) and the soak
//! (`benches/fault_soak.rs`): an S3 test server (moto) behind a [`FaultProxy`], a node
//! ([`LocalNode`]) whose store is reached through the proxy, with small caches (so that reads
//! keep reaching the backend) and its metrics on a loopback port; lazy layers built from
//! generated trees and each mounted through the daemon (kernel EROFS over its FUSE blob
//! files); readers that compare every byte they read with the source.
//!
//! Which chunks of its layer's blob each file needs is read from the layer's meta image
//! ([`erofs_builder::Image::data_map`]), so a test knows which reads a damaged chunk must
//! fail and which it must not touch.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fault_proxy::FaultProxy;
use crate::node::LocalNode;
use crate::S3Server;

/// The chunk size of layer blobs.
pub const CHUNK: u64 = 256 << 10;

/// One file of a mounted layer.
#[derive(Clone, Debug)]
pub struct FileInfo {
    /// Path inside the layer.
    pub rel: PathBuf,
    pub size: u64,
    /// Chunks of the layer's main blob (device 1) its data lies in; data in the layer's
    /// tails blob (small files, last partial chunks) is not counted: plans damage the main
    /// blob only.
    pub chunks: BTreeSet<u64>,
}

/// A layer built, pushed and mounted.
#[derive(Clone, Debug)]
pub struct Layer {
    pub name: String,
    pub src: PathBuf,
    pub mnt: PathBuf,
    /// The key suffix of its data blob (`blobs/xx/<hex>`).
    pub blob_key: String,
    pub files: Vec<FileInfo>,
}

/// How a read ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// The bytes differ from the source (must never happen).
    Wrong,
    /// The read failed with this errno.
    Failed(i32),
}

/// The stage (see the module docs). Dropping it stops the daemon, unmounts everything and
/// stops the proxy and the S3 server.
pub struct Campaign {
    // Dropped in this order: the node (daemon, mounts) before the servers it reads from.
    pub node: LocalNode,
    pub proxy: FaultProxy,
    _s3: S3Server,
    pub layers: Vec<Layer>,
    pub metrics_addr: String,
    pub daemon_pid: u32,
}

impl std::fmt::Debug for Campaign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Campaign")
            .field("layers", &self.layers.len())
            .field("metrics", &self.metrics_addr)
            .finish()
    }
}

/// How the stage is set up.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Layers to build, `files` files each.
    pub layers: usize,
    pub files: usize,
    pub seed: u64,
    /// The chunk cache's attempt timeout and retry deadline (`--backend-attempt-timeout`,
    /// `--backend-deadline`).
    pub attempt_timeout: Duration,
    pub deadline: Duration,
    /// `strata` to run (else [`crate::node::strata_bin`]).
    pub bin: Option<PathBuf>,
}

/// xorshift64*: file contents and sizes, reproducible from a seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A tree of `files` files: most small (packed tails), some of a few chunks, a few empty.
fn make_tree(dir: &Path, seed: u64, files: usize) {
    let mut rng = Rng(seed | 1);
    for i in 0..files {
        let size = match rng.below(10) {
            0 => 0,
            1 | 2 => rng.below(1 << 20) + CHUNK,
            3..=5 => rng.below(200 << 10),
            _ => rng.below(12 << 10),
        } as usize;
        let path = dir.join(format!("d{}/f{i:03}", i % 5));
        std::fs::create_dir_all(path.parent().unwrap_or(dir)).expect("make the source tree");
        let mut data = Vec::with_capacity(size + 8);
        while data.len() < size {
            data.extend_from_slice(&rng.next().to_le_bytes());
        }
        data.truncate(size);
        std::fs::write(path, data).expect("write a source file");
    }
}

fn run(node: &LocalNode, args: &[&std::ffi::OsStr]) -> Result<String, String> {
    let out = node
        .cmd()
        .args(args)
        .output()
        .map_err(|e| format!("run strata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "strata {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Campaign {
    /// [`Campaign::start`] for a test or bench named `what`: with no S3 test server it prints
    /// a loud SKIPPED line and returns `None` (a failure under `CI=true`); a stage that cannot
    /// be set is a panic.
    pub fn start_or_skip(target_tmp: &Path, setup: &Setup, what: &str) -> Option<Campaign> {
        match Campaign::start(target_tmp, setup) {
            Ok(Some(c)) => Some(c),
            Ok(None) => {
                eprintln!("\n*** SKIPPED {what}: no S3 test server (moto_server) ***\n");
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "{what}: CI=true but no S3 test server"
                );
                None
            }
            Err(e) => panic!("{what}: setting the stage: {e}"),
        }
    }

    /// Set the stage; `Ok(None)` when there is no S3 test server (the caller says SKIPPED).
    pub fn start(target_tmp: &Path, setup: &Setup) -> Result<Option<Campaign>, String> {
        for (name, value) in [
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
        ] {
            if std::env::var_os(name).is_none() {
                std::env::set_var(name, value);
            }
        }
        // The suite's server (scripts/test.sh sets STRATA_TEST_S3_ENDPOINT), else the
        // bench's (STRATA_BENCH_S3_ENDPOINT, or a moto_server of our own).
        let suite = std::env::var("STRATA_TEST_S3_ENDPOINT")
            .ok()
            .filter(|e| !e.trim().is_empty() && std::env::var_os(crate::S3_ENDPOINT_ENV).is_none());
        let s3 = match suite {
            Some(e) => S3Server {
                endpoint: e.trim().trim_end_matches('/').to_owned(),
                child: None,
                _log_dir: None,
            },
            None => match S3Server::start()? {
                Some(s) => s,
                None => return Ok(None),
            },
        };
        let bucket = format!("faults-{}-{:x}", std::process::id(), setup.seed);
        crate::create_bucket(s3.endpoint(), &bucket)?;
        let proxy = FaultProxy::start(s3.endpoint(), setup.seed)?;
        let mut node = LocalNode::new(target_tmp, "strata-faults-");
        if let Some(bin) = &setup.bin {
            node.bin = bin.clone();
        }
        node.store = format!(
            "s3://{bucket}/strata?endpoint={}&region=us-east-1",
            proxy.endpoint()
        );
        let dir = node.dir.path().to_owned();
        let mut layers = Vec::new();
        for i in 0..setup.layers {
            let src = dir.join(format!("src{i}"));
            make_tree(&src, setup.seed.wrapping_add(i as u64 * 7919), setup.files);
            let name = format!("base/faults{i}:1");
            run(
                &node,
                &[
                    "layer".as_ref(),
                    "build".as_ref(),
                    "--quiet".as_ref(),
                    // Each layer's data in its own blob, stored plain: the plan's bad chunks
                    // are a layer's, at their plain offsets in its stored object.
                    "--no-dedup".as_ref(),
                    "--compress".as_ref(),
                    "none".as_ref(),
                    src.as_os_str(),
                    "--name".as_ref(),
                    name.as_ref(),
                ],
            )?;
            layers.push((name, src));
        }
        let fmt = |d: Duration| format!("{}ms", d.as_millis());
        let (attempt, deadline) = (fmt(setup.attempt_timeout), fmt(setup.deadline));
        node.start_daemon(&[
            "--no-passthrough".as_ref(),
            "--metrics".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--cache-memory".as_ref(),
            "2MiB".as_ref(),
            "--cache-disk".as_ref(),
            "4MiB".as_ref(),
            "--backend-attempt-timeout".as_ref(),
            attempt.as_ref(),
            "--backend-deadline".as_ref(),
            deadline.as_ref(),
        ]);
        let metrics_addr = std::fs::read_to_string(dir.join("run/metrics.addr"))
            .map_err(|e| format!("the daemon's metrics.addr: {e}"))?
            .trim()
            .to_owned();
        let mut mounted = Vec::new();
        for (i, (name, src)) in layers.into_iter().enumerate() {
            let mnt = dir.join(format!("mnt{i}"));
            std::fs::create_dir_all(&mnt).map_err(|e| format!("mkdir: {e}"))?;
            run(&node, &["mount".as_ref(), name.as_ref(), mnt.as_os_str()])?;
            mounted.push((name, src, mnt));
        }
        let status = status_json(&node)?;
        let daemon_pid = status["pong"]["pid"].as_u64().unwrap_or(0) as u32;
        let mut out = Vec::new();
        for (name, src, mnt) in mounted {
            let info = status["layers"]
                .as_array()
                .and_then(|a| {
                    a.iter().find(|l| {
                        l["refs"]
                            .as_array()
                            .is_some_and(|r| r.iter().any(|x| x.as_str() == Some(&name)))
                    })
                })
                .ok_or_else(|| format!("{name} is not in strata status"))?;
            let id = info["id"].as_str().unwrap_or_default();
            let blob = info["blobs"][0][0].as_str().unwrap_or_default().to_owned();
            let meta = dir.join("run/layers").join(id).join("meta.erofs");
            let files = file_chunks(&meta)?;
            out.push(Layer {
                name,
                src,
                mnt,
                blob_key: format!("blobs/{}/{blob}", &blob[..2.min(blob.len())]),
                files,
            });
        }
        Ok(Some(Campaign {
            layers: out,
            metrics_addr,
            proxy,
            daemon_pid,
            node,
            _s3: s3,
        }))
    }

    /// `strata status --json`.
    pub fn status(&self) -> Result<serde_json::Value, String> {
        status_json(&self.node)
    }

    /// `GET /metrics`: every sample, `name{labels}` → value.
    pub fn scrape(&self) -> Result<BTreeMap<String, f64>, String> {
        let text = http_get(&self.metrics_addr, "/metrics")?;
        Ok(text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect())
    }

    /// Whether the daemon that started is still the one running.
    pub fn daemon_alive(&self) -> bool {
        Path::new(&format!("/proc/{}", self.daemon_pid)).exists()
            && self
                .status()
                .is_ok_and(|s| s["pong"]["pid"].as_u64() == Some(u64::from(self.daemon_pid)))
    }
}

fn status_json(node: &LocalNode) -> Result<serde_json::Value, String> {
    let text = run(node, &["--json".as_ref(), "status".as_ref()])?;
    serde_json::from_str(&text).map_err(|e| format!("strata status --json: {e}: {text}"))
}

/// A plain HTTP/1.0 GET on loopback; the body.
pub fn http_get(addr: &str, path: &str) -> Result<String, String> {
    let mut c = std::net::TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = c.set_read_timeout(Some(Duration::from_secs(30)));
    write!(c, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut all = String::new();
    c.read_to_string(&mut all).map_err(|e| e.to_string())?;
    let (head, body) = all.split_once("\r\n\r\n").ok_or("no HTTP header end")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(format!("GET {path}: {head}"));
    }
    Ok(body.to_owned())
}

/// Every regular file of the meta image and the blob chunks its data lies in.
fn file_chunks(meta: &Path) -> Result<Vec<FileInfo>, String> {
    use erofs_builder::{FileType, Image, Location};
    let img = Image::open(meta).map_err(|e| format!("open {}: {e}", meta.display()))?;
    let mut out = Vec::new();
    let mut stack = vec![(PathBuf::new(), img.root().map_err(|e| e.to_string())?)];
    while let Some((path, dir)) = stack.pop() {
        for e in img.read_dir(&dir).map_err(|e| e.to_string())? {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let name = String::from_utf8_lossy(&e.name).into_owned();
            let ino = img.inode(e.nid).map_err(|e| e.to_string())?;
            let rel = path.join(&name);
            match ino.file_type {
                FileType::Directory => stack.push((rel, ino)),
                FileType::Regular => {
                    let mut chunks = BTreeSet::new();
                    for x in img.data_map(&ino).map_err(|e| e.to_string())? {
                        // Device 1, the layer's main blob (the one the plans damage); the
                        // tails blob (device 2) is not faulted.
                        if let Location::Device { device: 1, offset } = x.location {
                            if x.len > 0 {
                                chunks.extend(offset / CHUNK..=(offset + x.len - 1) / CHUNK);
                            }
                        }
                    }
                    out.push(FileInfo {
                        rel,
                        size: ino.size,
                        chunks,
                    });
                }
                _ => {}
            }
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

/// Read `rel` under `mnt` and compare it with the source under `src`; drop its pages after,
/// so that the next read reaches the daemon again.
pub fn read_and_check(mnt: &Path, src: &Path, rel: &Path) -> (Outcome, Duration) {
    let started = Instant::now();
    let got = std::fs::File::open(mnt.join(rel)).and_then(|mut f| {
        let mut v = Vec::new();
        let r = f.read_to_end(&mut v);
        let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
        r.map(|_| v)
    });
    let took = started.elapsed();
    let outcome = match got {
        Ok(v) => match std::fs::read(src.join(rel)) {
            Ok(want) if want == v => Outcome::Ok,
            _ => Outcome::Wrong,
        },
        Err(e) => Outcome::Failed(e.raw_os_error().unwrap_or(-1)),
    };
    (outcome, took)
}

/// What concurrent readers saw.
#[derive(Debug, Default)]
pub struct Tally {
    pub ok: AtomicU64,
    pub wrong: AtomicU64,
    pub failed: AtomicU64,
    pub longest_us: AtomicU64,
    /// Failures by errno, and which (layer, file) failed.
    pub errnos: Mutex<BTreeMap<i32, u64>>,
    pub failed_files: Mutex<BTreeSet<(usize, usize)>>,
    /// The longest failing read.
    pub longest_failure_us: AtomicU64,
}

impl Tally {
    pub fn record(&self, at: (usize, usize), outcome: Outcome, took: Duration) {
        let us = took.as_micros() as u64;
        self.longest_us.fetch_max(us, Ordering::Relaxed);
        match outcome {
            Outcome::Ok => {
                self.ok.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Wrong => {
                self.wrong.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Failed(errno) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                self.longest_failure_us.fetch_max(us, Ordering::Relaxed);
                *self
                    .errnos
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(errno)
                    .or_default() += 1;
                self.failed_files
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(at);
            }
        }
    }
}

/// `n` reader threads reading random files of `targets` (layer index, file index) until
/// `stop` is set; what they saw goes to `tally`.
pub fn spawn_readers(
    campaign: &Campaign,
    targets: Arc<Vec<(usize, usize)>>,
    n: usize,
    seed: u64,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> Vec<std::thread::JoinHandle<()>> {
    let layers: Arc<Vec<Layer>> = Arc::new(campaign.layers.clone());
    (0..n)
        .map(|r| {
            let (layers, targets, stop, tally) =
                (layers.clone(), targets.clone(), stop.clone(), tally.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(seed.wrapping_mul(31).wrapping_add(r as u64) | 1);
                while !stop.load(Ordering::Relaxed) && !targets.is_empty() {
                    let (l, f) = targets[rng.below(targets.len() as u64) as usize];
                    let layer = &layers[l];
                    let (o, took) = read_and_check(&layer.mnt, &layer.src, &layer.files[f].rel);
                    tally.record((l, f), o, took);
                }
            })
        })
        .collect()
}
