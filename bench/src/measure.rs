//! A command's wall time and peak memory, anonymous and file-backed apart.
//!
//! `time -f %M` and `top` report one resident figure, which mixes what a process allocated
//! (anonymous memory) with pages of files it mapped (a blob hashed through `mmap` counts in
//! full). [`run`] samples `/proc/PID/status` (`RssAnon`, `RssFile`, `RssShmem`) while the
//! child runs and keeps the largest value of each: a peak that lasts less than the sampling
//! interval (2 ms) can be missed, which for builds that take seconds and grow their buffers
//! gradually is well below the noise. Only the direct child is sampled (none of the builders
//! measured here start helpers).
//!
//! Also here: where the peer tools are ([`nydus_bins`]) and the one way the benches build a
//! nydus image ([`nydus_create`]).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What [`run`] saw.
#[derive(Debug)]
pub struct Measured {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// From spawn to exit.
    pub seconds: f64,
    /// Peak `RssAnon`, bytes.
    pub peak_anon: u64,
    /// Peak `RssFile` (file-backed mappings), bytes.
    pub peak_file: u64,
    /// Peak `RssShmem`, bytes.
    pub peak_shmem: u64,
    /// How many samples were taken (0: the child exited before the first).
    pub samples: u64,
}

impl Measured {
    /// The stderr as text, for assertions.
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// `(RssAnon, RssFile, RssShmem)` of `pid` in bytes, or `None` once it has exited (or is a
/// zombie, whose status no longer lists them).
fn rss(pid: u32) -> Option<(u64, u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some((field("RssAnon:")?, field("RssFile:")?, field("RssShmem:")?))
}

/// Run `cmd` (its stdout and stderr captured) and measure it (see the module docs).
pub fn run(cmd: &mut Command) -> std::io::Result<Measured> {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let (mut anon, mut file, mut shmem, mut samples) = (0, 0, 0, 0);
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if let Some((a, f, s)) = rss(pid) {
            anon = anon.max(a);
            file = file.max(f);
            shmem = shmem.max(s);
            samples += 1;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let seconds = start.elapsed().as_secs_f64();
    Ok(Measured {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        seconds,
        peak_anon: anon,
        peak_file: file,
        peak_shmem: shmem,
        samples,
    })
}

/// Where `nydus-image` and `nydusd` are (`STRATA_PEERS_NYDUS_BIN`, then `~/.cargo/bin`, then
/// `PATH`), or why not.
pub fn nydus_bins() -> Result<(PathBuf, PathBuf), String> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("STRATA_PEERS_NYDUS_BIN") {
        dirs.push(d.into());
    }
    if let Some(h) = std::env::var_os("HOME") {
        dirs.push(Path::new(&h).join(".cargo/bin"));
    }
    if let Some(p) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&p));
    }
    let find = |name: &str| dirs.iter().map(|d| d.join(name)).find(|p| p.is_file());
    match (find("nydus-image"), find("nydusd")) {
        (Some(i), Some(d)) => Ok((i, d)),
        (i, d) => Err(format!(
            "{} not found in STRATA_PEERS_NYDUS_BIN, ~/.cargo/bin or PATH",
            [("nydus-image", i.is_none()), ("nydusd", d.is_none())]
                .iter()
                .filter(|x| x.1)
                .map(|x| x.0)
                .collect::<Vec<_>>()
                .join(" and ")
        )),
    }
}

/// `nydus-image create` of an image as every bench builds one (RAFS v6, 256 KiB chunks as
/// Strata's, `compressor`) into the blob directory `blobs` and the bootstrap `bootstrap`; the
/// caller adds options (a chunk dictionary) and the source tree last.
pub fn nydus_create(
    nydus_image: &Path,
    compressor: &str,
    blobs: &Path,
    bootstrap: &Path,
) -> Command {
    let mut c = Command::new(nydus_image);
    c.arg("create")
        .args(["--fs-version", "6", "--chunk-size", "0x40000"])
        .args(["--compressor", compressor, "--log-level", "warn"])
        .arg("--blob-dir")
        .arg(blobs)
        .arg("--bootstrap")
        .arg(bootstrap);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_that_allocates_shows_anonymous_memory_and_its_output() {
        // 64 MiB allocated and zeroed (so resident) by a child that then waits 0.3 s; python3
        // is installed by scripts/install-test-deps.sh.
        let m = run(Command::new("python3").args([
            "-c",
            "import time,sys; b = bytearray(64 << 20); time.sleep(0.3); print('done')",
        ]))
        .expect("run python3");
        assert!(m.status.success(), "{}", m.stderr_text());
        assert_eq!(m.stdout, b"done\n");
        assert!(m.samples > 10, "{} samples", m.samples);
        assert!(m.peak_anon >= 64 << 20, "peak anon {}", m.peak_anon);
        assert!(m.peak_file > 0, "the interpreter's own mapped files");
        assert!(m.seconds >= 0.3);
    }

    #[test]
    fn a_failing_command_reports_its_status_and_stderr() {
        let m = run(Command::new("sh").args(["-c", "echo oops >&2; exit 3"])).expect("run sh");
        assert_eq!(m.status.code(), Some(3));
        assert_eq!(m.stderr_text(), "oops\n");
        assert!(run(&mut Command::new("/nonexistent/strata-measure")).is_err());
    }
}
