//! The in-process overlaybd device against a plain file and a qcow2 backing chain of the same
//! depth and content (measured with `qemu-img bench` in the same run): a scenario harness, not
//! a micro-benchmark. Prints markdown tables.
//!
//! Set-up (not timed): a device of `STRATA_BENCH_BD_SIZE` bytes (default 256 MiB). Layer 0
//! writes the whole device with pseudo-random bytes; each further layer overwrites 5% of it
//! in random 4–64 KiB extents (4 KiB-aligned) filled with a one-byte pattern. Each layer is
//! written through an `Upper` and sealed (`Upper::seal`). The qcow2 chain gets exactly the same
//! content: `q0.qcow2` is `qemu-img convert` of the raw image after layer 0, and every further
//! `qN.qcow2` is created on `q(N-1).qcow2` with `qemu-img create -b`, then written with the same
//! extents and patterns by `qemu-io -c "write -P …"` (64 KiB clusters, qemu's defaults).
//! After each measured depth, `qemu-img compare` checks the chain against the plain raw file,
//! and the overlaybd device is compared with it byte for byte.
//!
//! Measured at depths 1, 5 and 20, all warm (every file was just written or read; a full pass
//! precedes the timed ones; 7 timed runs, interleaved across the peers; rates are medians, and each ratio is the median of the per-run ratios to `plain pread`):
//! - **4 KiB reads, QD1**: 65,536 reads (a full pass at 256 MiB) at offsets `k * 4 KiB * 7919
//!   mod size`: the pattern `qemu-img bench -S` produces, a permutation of the device's 4 KiB
//!   blocks, so that all three peers read the same offsets in the same order.
//! - **sequential 1 MiB reads, QD1**: the whole device.
//!
//! Peers: `plain pread` (the raw image, `FileExt::read_exact_at` into one buffer), the
//! overlaybd `Device` over `FileSource` layers (`read_at`, one thread), `qemu-img bench -f raw`
//! on the same raw file and `qemu-img bench -f qcow2` on the top of the chain (`-t writeback
//! -d 1 -i io_uring`, or `-i threads` where io_uring fails; its own "Run completed in" time).
//!
//! `cargo bench -p bench --bench overlaybd`. Without `--bench` (as `cargo test --benches` runs
//! it) a quick smoke run on a 16 MiB device, depths 1 and 3.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use bench::{fill_pseudo_random, fs_type, median};
use overlaybd::{Device, FileSource, LayerId, LayerSource, Upper};

const BLOCK: u64 = 4096;
const STRIDE: u64 = BLOCK * 7919;
const SEQ: u64 = 1 << 20;

struct Config {
    raw: PathBuf,
    size: u64,
    depths: Vec<usize>,
    runs: usize,
    /// Passes over the device per `qemu-img bench` run, (4 KiB, sequential): qemu-img
    /// reports its time in milliseconds, so one pass of a 256 MiB device at 8 GB/s (32 ms)
    /// would be quantised to ±3 %; a full run reads enough for about half a second or more.
    qemu_passes: (u64, u64),
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let mut cfg = if full {
        Config {
            raw: PathBuf::new(),
            size: std::env::var("STRATA_BENCH_BD_SIZE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(256 << 20),
            depths: vec![1, 5, 20],
            runs: 7,
            qemu_passes: (4, 16),
        }
    } else {
        Config {
            raw: PathBuf::new(),
            size: 16 << 20,
            depths: vec![1, 3],
            runs: 1,
            qemu_passes: (1, 1),
        }
    };
    assert!(
        cfg.size % SEQ == 0,
        "the device size must be a multiple of 1 MiB"
    );
    let tmp = bench::bench_tempdir(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "strata-bench-overlaybd",
        "the overlaybd bench directory",
    );
    let dir = tmp.path();
    println!(
        "bench directory: {} ({})",
        dir.display(),
        fs_type(dir).unwrap_or_default()
    );
    let qemu = Command::new("qemu-img").arg("--version").output().is_ok()
        && Command::new("qemu-io").arg("--version").output().is_ok();
    if !qemu {
        println!("\n*** SKIPPED qcow2 peer: qemu-img/qemu-io not found (apt-get install qemu-utils) ***\n");
    }
    let mut rows = Vec::new();
    let max_depth = *cfg.depths.iter().max().unwrap_or(&1);
    let raw = dir.join("device.raw");
    cfg.raw = raw.clone();
    let mut layers: Vec<PathBuf> = Vec::new();
    let mut parent = LayerId::NONE;
    let mut rng = fastrand::Rng::with_seed(2026);
    let t0 = Instant::now();
    for depth in 1..=max_depth {
        let i = depth - 1;
        let upper = Upper::create(dir.join(format!("upper{i}")), cfg.size, parent).unwrap();
        let mut writes: Vec<(u64, u64, u8)> = Vec::new();
        if i == 0 {
            let mut buf = vec![0u8; SEQ as usize];
            let out = File::create(&raw).unwrap();
            for k in 0..cfg.size / SEQ {
                fill_pseudo_random(&mut buf, k);
                upper.write_at(k * SEQ, &buf).unwrap();
                out.write_all_at(&buf, k * SEQ).unwrap();
            }
        } else {
            let out = File::options().write(true).open(&raw).unwrap();
            let mut written = 0;
            while written < cfg.size / 20 {
                let len = rng.u64(1..=16) * BLOCK;
                let off = rng.u64(0..(cfg.size - len) / BLOCK) * BLOCK;
                let pat = rng.u8(1..=255);
                let buf = vec![pat; len as usize];
                upper.write_at(off, &buf).unwrap();
                out.write_all_at(&buf, off).unwrap();
                writes.push((off, len, pat));
                written += len;
            }
        }
        let info = upper.seal(dir.join(format!("layer{i}.bd"))).unwrap();
        std::fs::remove_dir_all(upper.dir()).unwrap();
        parent = info.id;
        layers.push(info.path);
        if qemu {
            qcow2_layer(dir, &raw, i, &writes);
        }
        if cfg.depths.contains(&depth) {
            println!("depth {depth}: built in {:.1?} so far", t0.elapsed());
            rows.push(measure(&cfg, dir, &raw, &layers, qemu));
        }
    }
    print_tables(&cfg, &rows, qemu);
}

fn qcow2(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("q{i}.qcow2"))
}

/// Run `cmd` to success and return its stdout. A failure is retried twice (qemu-img bench has
/// been seen to die without a word under heavy load on this shared machine), then fatal.
fn run(cmd: &mut Command) -> String {
    let mut last = String::new();
    for attempt in 0..3 {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        if out.status.success() {
            return String::from_utf8_lossy(&out.stdout).into_owned();
        }
        last = format!(
            "{cmd:?}: {} (attempt {}): {}{}",
            out.status,
            attempt + 1,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{last}");
    }
    panic!("{last}");
}

/// Make `q{i}.qcow2`: the raw image itself for layer 0, else the same writes on `q{i-1}`.
fn qcow2_layer(dir: &Path, raw: &Path, i: usize, writes: &[(u64, u64, u8)]) {
    let q = qcow2(dir, i);
    if i == 0 {
        run(Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(raw)
            .arg(&q));
        return;
    }
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(qcow2(dir, i - 1))
        .arg(&q));
    for batch in writes.chunks(500) {
        let mut cmd = Command::new("qemu-io");
        cmd.args(["-f", "qcow2"]);
        for (off, len, pat) in batch {
            cmd.arg("-c").arg(format!("write -q -P {pat} {off} {len}"));
        }
        run(cmd.arg(&q));
    }
}

struct Row {
    depth: usize,
    segments: usize,
    peers: Vec<Peer>,
}

struct Peer {
    name: &'static str,
    iops: f64,
    iops_ratio: f64,
    mibs: f64,
    mibs_ratio: f64,
}

fn stride_offsets(size: u64) -> impl Iterator<Item = u64> {
    let n = size / BLOCK;
    (0..n.min(65536)).map(move |k| (k * STRIDE) % size)
}

fn timed(mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// qemu's fastest AIO engine for warm (page-cache) reads that works here: `io_uring` (about
/// 10x `threads` at QD1 on this machine), else `threads`.
fn qemu_aio(fmt: &str, image: &Path) -> &'static str {
    let ok = Command::new("qemu-img")
        .args([
            "bench",
            "-f",
            fmt,
            "-t",
            "writeback",
            "-i",
            "io_uring",
            "-c",
            "1",
        ])
        .arg(image)
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        "io_uring"
    } else {
        "threads"
    }
}

/// Seconds per pass over the device: `passes` passes in one `qemu-img bench` run (its offsets
/// wrap at the end of the image, so every pass reads the same blocks in the same order).
fn qemu_bench(fmt: &str, image: &Path, size: u64, seq: bool, passes: u64) -> f64 {
    let (count, s, step) = if seq {
        (size / SEQ, SEQ, SEQ)
    } else {
        ((size / BLOCK).min(65536), BLOCK, STRIDE)
    };
    let count = count * passes;
    let aio = qemu_aio(fmt, image);
    let out = run(Command::new("qemu-img")
        .args(["bench", "-f", fmt, "-t", "writeback", "-i", aio, "-d", "1"])
        .args([
            "-c",
            &count.to_string(),
            "-s",
            &s.to_string(),
            "-S",
            &step.to_string(),
        ])
        .arg(image));
    out.lines()
        .find_map(|l| l.strip_prefix("Run completed in "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|secs| secs / passes as f64)
        .unwrap_or_else(|| panic!("unexpected qemu-img bench output: {out}"))
}

fn measure(cfg: &Config, dir: &Path, raw: &Path, layers: &[PathBuf], qemu: bool) -> Row {
    let size = cfg.size;
    let srcs: Vec<Arc<dyn LayerSource>> = layers
        .iter()
        .map(|p| Arc::new(FileSource::open(p).unwrap()) as Arc<dyn LayerSource>)
        .collect();
    let dev = Device::open(srcs, None).unwrap();
    let plain = File::open(raw).unwrap();
    // Correctness first (not timed): the device reads exactly the raw image.
    let (mut a, mut b) = (vec![0u8; SEQ as usize], vec![0u8; SEQ as usize]);
    for k in 0..size / SEQ {
        dev.read_at(k * SEQ, &mut a).unwrap();
        plain.read_exact_at(&mut b, k * SEQ).unwrap();
        assert!(a == b, "device differs from the raw image in MiB {k}");
    }
    let n_rand = stride_offsets(size).count() as f64;
    let mut buf4 = vec![0u8; BLOCK as usize];
    let top = qcow2(dir, layers.len() - 1);
    if qemu {
        run(Command::new("qemu-img")
            .args(["compare", "-q", "-f", "qcow2", "-F", "raw"])
            .arg(&top)
            .arg(raw));
    }
    let names: &[&'static str] = if qemu {
        &[
            "plain pread",
            "overlaybd Device",
            "qemu-img bench raw",
            "qemu-img bench qcow2 chain",
        ]
    } else {
        &["plain pread", "overlaybd Device"]
    };
    // Interleaved: run r of every peer, then run r+1; run 0 warms and is not counted.
    let mut times = vec![(Vec::new(), Vec::new()); names.len()];
    for r in 0..=cfg.runs {
        for (p, name) in names.iter().enumerate() {
            let (rand, seq) = match *name {
                "plain pread" => (
                    timed(|| {
                        for off in stride_offsets(size) {
                            plain.read_exact_at(&mut buf4, off).unwrap();
                        }
                    }),
                    timed(|| {
                        for k in 0..size / SEQ {
                            plain.read_exact_at(&mut a, k * SEQ).unwrap();
                        }
                    }),
                ),
                "overlaybd Device" => (
                    timed(|| {
                        for off in stride_offsets(size) {
                            dev.read_at(off, &mut buf4).unwrap();
                        }
                    }),
                    timed(|| {
                        for k in 0..size / SEQ {
                            dev.read_at(k * SEQ, &mut a).unwrap();
                        }
                    }),
                ),
                "qemu-img bench raw" => (
                    qemu_bench("raw", raw, size, false, cfg.qemu_passes.0),
                    qemu_bench("raw", raw, size, true, cfg.qemu_passes.1),
                ),
                _ => (
                    qemu_bench("qcow2", &top, size, false, cfg.qemu_passes.0),
                    qemu_bench("qcow2", &top, size, true, cfg.qemu_passes.1),
                ),
            };
            if r > 0 {
                times[p].0.push(rand);
                times[p].1.push(seq);
            }
        }
    }
    let mib = size as f64 / (1 << 20) as f64;
    // Ratios: the median over runs of (plain's time / the peer's time) in the same run, which
    // cancels load that drifts between runs on a shared machine.
    let ratio = |peer: &[f64], plain: &[f64]| {
        median(
            &plain
                .iter()
                .zip(peer)
                .map(|(p, x)| p / x)
                .collect::<Vec<_>>(),
        )
    };
    Row {
        depth: layers.len(),
        segments: dev.merged_segments(),
        peers: names
            .iter()
            .zip(&times)
            .map(|(n, (r, s))| Peer {
                name: n,
                iops: n_rand / median(r),
                iops_ratio: ratio(r, &times[0].0),
                mibs: mib / median(s),
                mibs_ratio: ratio(s, &times[0].1),
            })
            .collect(),
    }
}

fn print_tables(cfg: &Config, rows: &[Row], qemu: bool) {
    println!(
        "\n### overlaybd: device of {} MiB, warm, QD1{}\n",
        cfg.size >> 20,
        if qemu {
            format!(", qemu-img bench -i {}", qemu_aio("raw", &cfg.raw))
        } else {
            " (qcow2 peer SKIPPED)".to_owned()
        }
    );
    println!(
        "| depth | merged segments | peer | 4 KiB reads/s | × plain | seq 1 MiB MiB/s | × plain |"
    );
    println!("| ---: | ---: | --- | ---: | ---: | ---: | ---: |");
    for r in rows {
        for p in &r.peers {
            println!(
                "| {} | {} | {} | {:.0} | {:.2} | {:.0} | {:.2} |",
                r.depth, r.segments, p.name, p.iops, p.iops_ratio, p.mibs, p.mibs_ratio
            );
        }
    }
}
