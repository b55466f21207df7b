//! # bench: Strata's benchmark harness
//!
//! The benchmarks live in `benches/` (criterion, `harness = false`) and their figures, with the
//! machine they were taken on, in `README.md`. This library holds the small pieces they share:
//!
//! - [`S3Server`]: an S3-compatible server on 127.0.0.1 for one bench run. Either the endpoint
//!   named by [`S3_ENDPOINT_ENV`] (`STRATA_BENCH_S3_ENDPOINT`, e.g. `http://127.0.0.1:5000`), or
//!   a `moto_server` child process started on a free port. The child is killed when the
//!   [`S3Server`] is dropped, and it is also told by the kernel (`PR_SET_PDEATHSIG`) to die with
//!   the bench process, so a panicking or killed bench never leaves a server behind.
//! - [`create_bucket`]: an unsigned `PUT /BUCKET` (moto accepts unsigned requests).
//! - [`bench_dir`]: where a bench writes its test files: on a local disk, never tmpfs, so that
//!   "the file" is a real file on a real filesystem.
//! - [`aligned_offsets`], [`random_offsets`], [`random_regions`] and [`fill_pseudo_random`]:
//!   deterministic (seeded) test data and access patterns, so two runs read the same ranges of
//!   the same bytes.
//! - [`median`]: the middle of a few repeated measurements.
//! - [`size_label`]: `4096` → `"4KiB"`, used in benchmark ids.
//! - [`full_run`]: whether the bench was started by `cargo bench` (full sizes) or by
//!   `cargo test --benches` (a smoke run: small sizes, every step and every assertion of the
//!   full run, in seconds; `scripts/test.sh` runs every bench that way in CI).
//! - [`node::LocalNode`]: a node (store, caches, daemon) driven through the `strata` command
//!   line for scenario benches, removed with everything it made when dropped.
//! - [`fault_proxy::FaultProxy`]: a faulty HTTP proxy in front of the S3 test server, and
//!   [`campaign`]: the fault campaign's stage (layers mounted through a daemon whose store is
//!   reached through the proxy, byte-checking readers), shared with `tests/faults.rs`.
//! - [`measure::run`]: a command's wall time and peak anonymous and file-backed memory;
//!   [`measure::nydus_bins`]: where the nydus peer's binaries are.
//!
//! Nothing here is timed; it only sets the stage.

pub mod campaign;
pub mod fault_proxy;
pub mod measure;
pub mod node;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this is a full run. `cargo bench` passes `--bench` to every bench binary; `cargo
/// test --benches` does not, and a bench then makes a smoke run: the same steps and checks on
/// small sizes (each bench's docs say which). An explicit size in the environment wins either
/// way.
pub fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Environment variable naming an already running S3-compatible endpoint to benchmark against
/// (`http://HOST:PORT`, plain HTTP). When unset, [`S3Server::start`] starts `moto_server`.
pub const S3_ENDPOINT_ENV: &str = "STRATA_BENCH_S3_ENDPOINT";

/// How long a freshly started `moto_server` may take to answer its first request.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// An S3-compatible endpoint for the duration of a bench run (see the crate docs).
#[derive(Debug)]
pub struct S3Server {
    endpoint: String,
    /// The `moto_server` we started, if we started one; killed on drop.
    child: Option<Child>,
    /// Holds moto's log file, shown if the server dies during start-up.
    _log_dir: Option<tempfile::TempDir>,
}

impl S3Server {
    /// Whether [`S3Server::start`] has something to work with: [`S3_ENDPOINT_ENV`] is set, or
    /// `moto_server` is on `PATH`. Cheap: starts nothing.
    pub fn available() -> bool {
        std::env::var_os(S3_ENDPOINT_ENV).is_some() || find_on_path("moto_server").is_some()
    }

    /// The endpoint from [`S3_ENDPOINT_ENV`], or a new `moto_server` on a free port of
    /// 127.0.0.1. `Ok(None)` means neither is available (no variable, no `moto_server` on
    /// `PATH`): the caller should skip its S3 benchmarks and say so. An error means a server
    /// was expected but did not work.
    pub fn start() -> Result<Option<S3Server>, String> {
        if let Ok(endpoint) = std::env::var(S3_ENDPOINT_ENV) {
            let endpoint = endpoint.trim_end_matches('/').to_owned();
            http_request(&endpoint, "GET", "/")
                .map_err(|e| format!("{S3_ENDPOINT_ENV}={endpoint} does not answer: {e}"))?;
            return Ok(Some(S3Server {
                endpoint,
                child: None,
                _log_dir: None,
            }));
        }
        let Some(program) = find_on_path("moto_server") else {
            return Ok(None);
        };
        Self::spawn_moto(&program).map(Some)
    }

    fn spawn_moto(program: &Path) -> Result<S3Server, String> {
        let port = free_port().map_err(|e| format!("find a free port on 127.0.0.1: {e}"))?;
        let log_dir = tempfile::tempdir().map_err(|e| format!("create a log directory: {e}"))?;
        let log_path = log_dir.path().join("moto.log");
        let log = std::fs::File::create(&log_path)
            .map_err(|e| format!("create {}: {e}", log_path.display()))?;
        let log2 = log
            .try_clone()
            .map_err(|e| format!("dup {}: {e}", log_path.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        die_with_this_thread(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| format!("start {}: {e}", program.display()))?;
        // From here on the child is killed on every path out, including the errors below.
        let mut server = S3Server {
            endpoint: format!("http://127.0.0.1:{port}"),
            child: Some(child),
            _log_dir: Some(log_dir),
        };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if http_request(&server.endpoint, "GET", "/").is_ok() {
                return Ok(server);
            }
            let exited = server
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!(
                    "moto_server exited during start-up ({status}):\n{log}"
                ));
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!(
                    "moto_server did not answer on {} within {STARTUP_TIMEOUT:?}:\n{log}",
                    server.endpoint
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:PORT`, without a trailing `/`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether this run started its own `moto_server` (rather than using [`S3_ENDPOINT_ENV`]).
    pub fn is_spawned(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Ask the kernel to SIGKILL the child started by `cmd` when the thread that starts it exits
/// (for a bench, the main thread: i.e. when the bench process ends, however it ends).
fn die_with_this_thread(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: `getpid` has no preconditions and cannot fail.
    let parent = unsafe { libc::getpid() };
    let hook = move || -> std::io::Result<()> {
        // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no memory of ours;
        // it is async-signal-safe, as required between fork and exec.
        if unsafe {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            )
        } != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        // The parent may have died before prctl took effect; then no signal would ever come.
        // (An OS error code, not a message: nothing may allocate between fork and exec.)
        // SAFETY: getppid has no preconditions and is async-signal-safe.
        if unsafe { libc::getppid() } != parent {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before exec and only calls the
    // async-signal-safe functions prctl and getppid; it allocates nothing (its errors are raw OS
    // error codes) and takes no locks.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// The first executable file called `name` in a `PATH` directory.
fn find_on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One plain-HTTP request with an empty body, returning the status code and the body.
fn http_request(endpoint: &str, method: &str, path: &str) -> std::io::Result<(u16, String)> {
    let bad = |why: &str| std::io::Error::other(format!("endpoint {endpoint:?}: {why}"));
    let authority = endpoint
        .strip_prefix("http://")
        .ok_or_else(|| bad("expected http://HOST:PORT (plain HTTP)"))?
        .split('/')
        .next()
        .unwrap_or_default();
    let addr = authority
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| bad("host does not resolve"))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    stream.set_write_timeout(Some(Duration::from_secs(30)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let response = String::from_utf8_lossy(&response);
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| bad("no HTTP status line in the response"))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Create `bucket` on the S3 endpoint with an unsigned `PUT /BUCKET`. A bucket that already
/// exists and is ours (a reused external endpoint) is fine.
pub fn create_bucket(endpoint: &str, bucket: &str) -> Result<(), String> {
    let (status, body) = http_request(endpoint, "PUT", &format!("/{bucket}"))
        .map_err(|e| format!("create bucket {bucket} on {endpoint}: {e}"))?;
    match status {
        200 => Ok(()),
        409 if body.contains("BucketAlreadyOwnedByYou") => Ok(()),
        _ => Err(format!(
            "create bucket {bucket} on {endpoint}: HTTP {status}: {}",
            body.chars().take(500).collect::<String>()
        )),
    }
}

/// The directory a bench should write its test files under: `STRATA_BENCH_DIR` if set, else
/// the system temporary directory unless that is memory-backed (tmpfs, ramfs), else the
/// build's own temporary directory (`target_tmp`, which lives beside the build on disk).
pub fn bench_dir(target_tmp: &Path) -> PathBuf {
    if let Some(dir) = std::env::var_os("STRATA_BENCH_DIR") {
        return PathBuf::from(dir);
    }
    let tmp = std::env::temp_dir();
    if fs_type(&tmp).is_some_and(|t| t == "tmpfs" || t == "ramfs") {
        target_tmp.to_owned()
    } else {
        tmp
    }
}

/// A fresh temporary directory named `prefix*` under [`bench_dir`] (created if missing),
/// removed when dropped. Panics with `what` in the message: benchmarks have no caller to
/// report to.
pub fn bench_tempdir(target_tmp: &Path, prefix: &str, what: &str) -> tempfile::TempDir {
    let parent = bench_dir(target_tmp);
    std::fs::create_dir_all(&parent).expect("create the bench directory");
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&parent)
        .unwrap_or_else(|e| panic!("create {what}: {e}"))
}

/// The name of the filesystem `path` lives on (`ext4`, `xfs`, `tmpfs`, ...), or its magic
/// number in hex if it is not one this function knows; `None` if `statfs` fails.
pub fn fs_type(path: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statfs` is plain old data; all-zero bytes are a valid value of it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a NUL-terminated string and `st` a valid, writable statfs that
    // outlives the call.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // f_type's integer type differs between targets
    let magic = st.f_type as u64;
    Some(
        match magic {
            0xEF53 => "ext4",
            0x5846_5342 => "xfs",
            0x9123_683E => "btrfs",
            0x0102_1994 => "tmpfs",
            0x8584_58f6 => "ramfs",
            0x6969 => "nfs",
            0x6573_5546 => "fuse",
            0x794C_7630 => "overlayfs",
            0x2FC1_2FC1 => "zfs",
            other => return Some(format!("0x{other:x}")),
        }
        .to_owned(),
    )
}

/// `count` offsets of `block`-aligned blocks that fit in a file of `file_size` bytes, spread
/// uniformly at random (deterministically from `seed`).
///
/// # Panics
/// If `block` is zero or larger than `file_size`.
pub fn aligned_offsets(file_size: u64, block: u64, count: usize, seed: u64) -> Vec<u64> {
    assert!(
        block > 0 && block <= file_size,
        "block {block} vs file {file_size}"
    );
    let slots = file_size / block;
    let mut rng = SplitMix64(seed);
    (0..count).map(|_| (rng.next() % slots) * block).collect()
}

/// `count` offsets of `align`-aligned ranges of `len` bytes that fit in a file of `file_size`
/// bytes, spread uniformly at random (deterministically from `seed`). Unlike
/// [`aligned_offsets`] the ranges need not be aligned to their own size: a 128 KiB range at a
/// 4 KiB-aligned offset may straddle a 256 KiB chunk boundary, as a page-aligned read would.
///
/// # Panics
/// If `align` is zero, or `len` is larger than `file_size`.
pub fn random_offsets(file_size: u64, len: u64, align: u64, count: usize, seed: u64) -> Vec<u64> {
    assert!(
        align > 0 && len <= file_size,
        "align {align}, len {len} vs file {file_size}"
    );
    let slots = (file_size - len) / align + 1;
    let mut rng = SplitMix64(seed);
    (0..count).map(|_| (rng.next() % slots) * align).collect()
}

/// Cut `0..file_size` into consecutive regions whose lengths are random multiples of `align`
/// in `min..=max` (the last one may be shorter), and return a random `fraction` of them
/// (rounded to the nearest count, at least one), in random order. The regions never overlap,
/// so the bytes returned add up to about `fraction × file_size`.
///
/// # Panics
/// If `align` is zero, `min` is zero, `min > max`, or `fraction` is not in `0.0..=1.0`.
pub fn random_regions(
    file_size: u64,
    min: u64,
    max: u64,
    align: u64,
    fraction: f64,
    seed: u64,
) -> Vec<std::ops::Range<u64>> {
    assert!(
        align > 0 && min > 0 && min <= max,
        "regions {min}..={max} by {align}"
    );
    assert!((0.0..=1.0).contains(&fraction), "fraction {fraction}");
    let mut rng = SplitMix64(seed);
    let (lo, hi) = (min.div_ceil(align), max / align);
    let mut regions = Vec::new();
    let mut at = 0;
    while at < file_size {
        let len = (lo + rng.next() % (hi - lo + 1)) * align;
        let end = (at + len).min(file_size);
        regions.push(at..end);
        at = end;
    }
    // Fisher-Yates, then keep a prefix.
    for i in (1..regions.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        regions.swap(i, j);
    }
    let keep = ((regions.len() as f64 * fraction).round() as usize).clamp(1, regions.len());
    regions.truncate(keep);
    regions
}

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Bytes of the regular files under `dir` (symlinks not followed, not counted).
pub fn du(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_dir() {
                stack.push(e.path());
            } else if md.is_file() {
                total += md.len();
            }
        }
    }
    total
}

/// Fill `buf` with deterministic pseudo-random bytes (incompressible, unlike zeros, should a
/// layer below ever compress or deduplicate).
pub fn fill_pseudo_random(buf: &mut [u8], seed: u64) {
    let mut rng = SplitMix64(seed);
    let mut chunks = buf.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&rng.next().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = rng.next().to_le_bytes();
    rest.copy_from_slice(&last[..rest.len()]);
}

/// `4096` → `"4KiB"`, `4 << 20` → `"4MiB"`; sizes that are not a whole number of KiB stay in
/// bytes.
pub fn size_label(bytes: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    match bytes {
        b if b >= GIB && b % GIB == 0 => format!("{}GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{}MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{}KiB", b / KIB),
        b => format!("{b}B"),
    }
}

/// SplitMix64: tiny, fast, good enough to scatter offsets and fill test files.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(size_label(4096), "4KiB");
        assert_eq!(size_label(256 << 10), "256KiB");
        assert_eq!(size_label(4 << 20), "4MiB");
        assert_eq!(size_label(1 << 30), "1GiB");
        assert_eq!(size_label(1000), "1000B");
    }

    #[test]
    fn offsets_are_aligned_in_bounds_and_deterministic() {
        let offs = aligned_offsets(1 << 20, 4096, 1000, 7);
        assert!(offs.iter().all(|o| o % 4096 == 0 && o + 4096 <= 1 << 20));
        assert_eq!(offs, aligned_offsets(1 << 20, 4096, 1000, 7));
        assert!(offs.iter().any(|&o| o != offs[0]));
    }

    #[test]
    fn random_offsets_fit_and_are_aligned() {
        let offs = random_offsets(1 << 20, 128 << 10, 4096, 1000, 3);
        assert!(offs
            .iter()
            .all(|o| o % 4096 == 0 && o + (128 << 10) <= 1 << 20));
        // Not aligned to their own size: some of them straddle a 128 KiB boundary.
        assert!(offs.iter().any(|o| o % (128 << 10) != 0));
        assert_eq!(random_offsets(4096, 4096, 4096, 3, 1), vec![0, 0, 0]);
    }

    #[test]
    fn random_regions_are_disjoint_and_sized() {
        let total = 32 << 20;
        let r = random_regions(total, 4096, 64 << 10, 4096, 0.1, 9);
        let bytes: u64 = r.iter().map(|r| r.end - r.start).sum();
        assert!(r.iter().all(|r| r.start % 4096 == 0 && r.end <= total));
        assert!(r
            .iter()
            .all(|r| (4096..=64 << 10).contains(&(r.end - r.start))));
        let mut sorted = r.clone();
        sorted.sort_by_key(|r| r.start);
        assert!(sorted.windows(2).all(|w| w[0].end <= w[1].start));
        // About a tenth of the bytes (a tenth of the regions, of random sizes).
        assert!(bytes > total / 20 && bytes < total / 5, "{bytes}");
        assert_eq!(r, random_regions(total, 4096, 64 << 10, 4096, 0.1, 9));
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn fill_is_deterministic_for_odd_lengths() {
        let (mut a, mut b) = (vec![0u8; 1001], vec![0u8; 1001]);
        fill_pseudo_random(&mut a, 1);
        fill_pseudo_random(&mut b, 1);
        assert_eq!(a, b);
        assert!(a.iter().filter(|&&x| x == 0).count() < 50);
    }

    #[test]
    fn bad_endpoints_are_refused() {
        assert!(http_request("https://127.0.0.1:1", "GET", "/").is_err());
        assert!(create_bucket("127.0.0.1:1", "b").is_err());
    }
}
