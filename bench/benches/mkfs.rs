//! Image build, `strata mkfs` (`erofs_builder::build_image`) and lazy layers
//! (`erofs_builder::build_layer`) against `mkfs.erofs`: a scenario harness, not a
//! micro-benchmark. Prints markdown tables.
//!
//! Each (tree × tool) build runs in **its own child process**, so that its peak RSS is its
//! own: the harness re-executes itself (`current_exe()`) with [`CHILD_ENV`] set, and that
//! child calls `build_image` (or `build_layer`) and exits; the peers are `mkfs.erofs OUT SRC`
//! and, chunked, `mkfs.erofs --chunksize=262144 --blobdev=BLOB OUT SRC`. The harness reaps
//! each child with `wait4`, which returns that child's own `rusage` (`ru_maxrss`, user and
//! system time); wall time runs from just before the spawn to `wait4`'s return.
//!
//! Before every build the previous image is deleted, then `sync` and
//! `echo 3 > /proc/sys/vm/drop_caches` (root): every build reads its source tree from the
//! disk. Runs are interleaved (run 1 of every tree × tool, then run 2, …), 3 runs, medians
//! reported. Tools:
//!
//! - `mkfs.erofs 1.5` (Debian 12's, on `PATH`) and `mkfs.erofs 1.8` (built by
//!   `scripts/build-erofs-utils.sh` into [`MKFS18_DEFAULT`], or [`MKFS18_ENV`]; skipped with
//!   a warning when absent): full image, no compression, defaults. They do not fsync.
//! - `strata fsync=false`: `BuildOptions { fsync: false, ..default }`: the same work as the
//!   peer (the headline row).
//! - `strata fsync=true`: `BuildOptions::default()` (what `strata mkfs` does): adds the
//!   `fsync` of the image.
//! - Chunked: both `mkfs.erofs` with `--chunksize=262144 --blobdev=BLOB` (meta image + blob),
//!   against `strata layer fsync=false`: `build_layer` with `fsync: false`: meta image + data
//!   blob in 256 KiB chunks, every chunk hashed (blake3) for dedupe, the whole blob hashed
//!   again for its device tag. Sizes are meta + blob.
//!
//! Ratios are against the reference peer of each group: `mkfs.erofs 1.8` when present (the
//! fairer peer: the current release), else 1.5; the "vs best" column divides by the fastest
//! peer of the group (the issue's goal: 0.7× of the best wall time).
//!
//! Trees: `/usr/lib/x86_64-linux-gnu` as is, and a tree of 100k+ mostly small files
//! ([`SMALL_ENV`], default `/var/tmp/strata-bench-mkfs/small-files`), created once if missing
//! by `cp -a` of the running Python installation (`sys.base_prefix`) and `/usr/share`. Images
//! go to `/var/tmp/strata-bench-mkfs/out` (override: `STRATA_BENCH_DIR`), on the local disk.
//! After the timed runs every last image is checked once with `fsck.erofs --extract` (1.8 when
//! present, with `--device=BLOB` for the chunked ones; reads and checks every inode and all
//! data; not timed).
//!
//! `cargo bench -p bench --bench mkfs`. Without `--bench` (as `cargo test --benches` runs it)
//! a quick smoke run on a tiny tree, without dropping caches.

use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Instant;

use bench::{fs_type, median};

/// Set (to anything) in the child that builds one image; its arguments are in [`SRC_ENV`],
/// [`OUT_ENV`] and [`FSYNC_ENV`].
const CHILD_ENV: &str = "STRATA_BENCH_MKFS_CHILD";
const SRC_ENV: &str = "STRATA_BENCH_MKFS_SRC";
const OUT_ENV: &str = "STRATA_BENCH_MKFS_OUT";
const FSYNC_ENV: &str = "STRATA_BENCH_MKFS_FSYNC";
/// Set in the child that builds a layer: the blob's path (the meta image is [`OUT_ENV`]).
const BLOB_ENV: &str = "STRATA_BENCH_MKFS_BLOB";
/// The directory holding the erofs-utils 1.8 binaries (`mkfs.erofs`, `fsck.erofs`).
const MKFS18_ENV: &str = "STRATA_EROFS_UTILS_DIR";
/// Where `scripts/build-erofs-utils.sh` installs them.
const MKFS18_DEFAULT: &str = "/usr/local/lib/strata/erofs-utils-1.8/bin";
/// The chunk size of layers (and of the chunked peer).
const CHUNK_SIZE: u64 = erofs_builder::layer::CHUNK_SIZE;
/// The small-files tree (created if missing).
const SMALL_ENV: &str = "STRATA_BENCH_MKFS_SMALL";
/// The line the child prints on success, followed by `key=value` pairs.
const RESULT_TAG: &str = "STRATA_BENCH_MKFS_RESULT";

const RUNS: usize = 3;
const SMALL_MIN_ENTRIES: u64 = 100_000;

/// Which `mkfs.erofs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    /// Debian 12's erofs-utils 1.5, `mkfs.erofs` on `PATH`.
    V15,
    /// erofs-utils 1.8 from [`MKFS18_DEFAULT`] (or [`MKFS18_ENV`]).
    V18,
}

impl Peer {
    fn dir18() -> PathBuf {
        std::env::var_os(MKFS18_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(MKFS18_DEFAULT))
    }

    /// The path of one of its binaries (`mkfs.erofs`, `fsck.erofs`).
    fn bin(self, name: &str) -> PathBuf {
        match self {
            Peer::V15 => PathBuf::from(name),
            Peer::V18 => Self::dir18().join(name),
        }
    }

    /// `mkfs.erofs -V`'s first line, if it runs and is this version.
    fn version(self) -> Option<String> {
        let o = Command::new(self.bin("mkfs.erofs"))
            .arg("-V")
            .output()
            .ok()?;
        let text =
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
        let line = text.lines().next()?.trim().to_owned();
        let want = match self {
            Peer::V15 => " 1.5",
            Peer::V18 => " 1.8",
        };
        line.contains(want).then_some(line)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tool {
    Mkfs { peer: Peer, chunked: bool },
    Strata { fsync: bool },
    StrataLayer,
}

impl Tool {
    fn is_peer(self) -> bool {
        matches!(self, Tool::Mkfs { .. })
    }

    fn chunked(self) -> bool {
        matches!(self, Tool::Mkfs { chunked: true, .. } | Tool::StrataLayer)
    }

    fn label(self) -> &'static str {
        match self {
            Tool::Mkfs {
                peer: Peer::V15,
                chunked: false,
            } => "mkfs.erofs 1.5",
            Tool::Mkfs {
                peer: Peer::V18,
                chunked: false,
            } => "mkfs.erofs 1.8",
            Tool::Mkfs {
                peer: Peer::V15,
                chunked: true,
            } => "mkfs.erofs 1.5 --chunksize --blobdev",
            Tool::Mkfs {
                peer: Peer::V18,
                chunked: true,
            } => "mkfs.erofs 1.8 --chunksize --blobdev",
            Tool::Strata { fsync: false } => "strata fsync=false",
            Tool::Strata { fsync: true } => "strata fsync=true",
            Tool::StrataLayer => "strata layer fsync=false",
        }
    }

    fn file_tag(self) -> &'static str {
        match self {
            Tool::Mkfs {
                peer: Peer::V15,
                chunked: false,
            } => "peer15",
            Tool::Mkfs {
                peer: Peer::V18,
                chunked: false,
            } => "peer18",
            Tool::Mkfs {
                peer: Peer::V15,
                chunked: true,
            } => "peer15-chunked",
            Tool::Mkfs {
                peer: Peer::V18,
                chunked: true,
            } => "peer18-chunked",
            Tool::Strata { fsync: false } => "strata-nofsync",
            Tool::Strata { fsync: true } => "strata-fsync",
            Tool::StrataLayer => "strata-layer",
        }
    }

    /// The image (or meta image) and, for chunked tools, the blob.
    fn outputs(self, out_dir: &Path, tree: &str) -> (PathBuf, Option<PathBuf>) {
        let base = format!("{tree}-{}", self.file_tag());
        let blob = self.chunked().then(|| out_dir.join(format!("{base}.blob")));
        (out_dir.join(format!("{base}.erofs")), blob)
    }
}

/// The tools of one run: every peer that is installed, then strata's builds.
fn tools(peers: &[Peer]) -> Vec<Tool> {
    let mut v = Vec::new();
    for &peer in peers {
        v.push(Tool::Mkfs {
            peer,
            chunked: false,
        });
    }
    v.push(Tool::Strata { fsync: false });
    v.push(Tool::Strata { fsync: true });
    for &peer in peers {
        v.push(Tool::Mkfs {
            peer,
            chunked: true,
        });
    }
    v.push(Tool::StrataLayer);
    v
}

#[derive(Debug)]
struct Tree {
    name: String,
    path: PathBuf,
    entries: u64,
    files: u64,
    file_bytes: u64,
}

#[derive(Debug, Clone)]
struct Sample {
    wall_s: f64,
    maxrss_kib: u64,
    user_s: f64,
    sys_s: f64,
    /// The image, or for chunked tools the meta image.
    image_bytes: u64,
    image_alloc_bytes: u64,
    /// The blob of chunked tools (0 otherwise).
    blob_bytes: u64,
    blob_alloc_bytes: u64,
    load1: String,
    /// The strata child's own `VmHWM` just before it exits (a cross-check of `ru_maxrss`).
    self_hwm_kib: Option<u64>,
    /// The harness's own VmHWM when it spawned the child (see [`measure`]).
    floor_kib: u64,
}

impl Sample {
    fn total_bytes(&self) -> u64 {
        self.image_bytes + self.blob_bytes
    }

    /// Peak RSS: the strata child's own VmHWM (exact, read in the child just before it
    /// exits; `ru_maxrss` agrees when it is above the floor); for the peer `ru_maxrss`, which
    /// is exact when above the floor and marked otherwise.
    fn peak_kib(&self) -> u64 {
        self.self_hwm_kib.unwrap_or(self.maxrss_kib)
    }

    fn peak_label(&self) -> String {
        let mib = self.peak_kib() as f64 / 1024.0;
        if self.self_hwm_kib.is_none() && self.maxrss_kib <= self.floor_kib {
            format!("≤ {mib:.1}")
        } else {
            format!("{mib:.1}")
        }
    }
}

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child_main();
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    let work = std::env::var_os("STRATA_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/strata-bench-mkfs"));
    let out_dir = work.join("out");
    std::fs::create_dir_all(&out_dir).expect("create the output directory");

    let (trees, runs, drop) = if full {
        let small = std::env::var_os(SMALL_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| work.join("small-files"));
        if !small.exists() {
            make_small_tree(&small);
        }
        let trees = vec![
            tree("x86_64-linux-gnu", Path::new("/usr/lib/x86_64-linux-gnu")),
            tree("small-files", &small),
        ];
        if trees[1].entries < SMALL_MIN_ENTRIES {
            eprintln!(
                "WARNING: {} has only {} entries (< {SMALL_MIN_ENTRIES})",
                small.display(),
                trees[1].entries
            );
        }
        (trees, RUNS, true)
    } else {
        let tiny = work.join("smoke-tree");
        make_tiny_tree(&tiny);
        (vec![tree("smoke", &tiny)], 1, false)
    };

    let mut peers = Vec::new();
    let mut versions = Vec::new();
    for peer in [Peer::V15, Peer::V18] {
        match peer.version() {
            Some(v) => {
                peers.push(peer);
                versions.push(format!("`{}` ({v})", peer.bin("mkfs.erofs").display()));
            }
            None => eprintln!(
                "WARNING: {} (erofs-utils {}) not found or not that version: its rows are skipped{}",
                peer.bin("mkfs.erofs").display(),
                if peer == Peer::V15 { "1.5" } else { "1.8" },
                if peer == Peer::V18 {
                    " (run scripts/build-erofs-utils.sh as root)"
                } else {
                    ""
                }
            ),
        }
    }
    assert!(!peers.is_empty(), "no mkfs.erofs to compare with");
    let tools = tools(&peers);
    // The reference peer: 1.8 when present.
    let reference = *peers.last().expect("a peer");

    println!("# mkfs: strata (erofs_builder::build_image / build_layer) vs mkfs.erofs\n");
    println!("Peers: {}.\n", versions.join(", "));
    print_context(&trees, &out_dir, drop);

    // samples[tree][tool] = runs
    let mut samples: Vec<Vec<Vec<Sample>>> = trees
        .iter()
        .map(|_| tools.iter().map(|_| Vec::new()).collect())
        .collect();
    let mut raw = String::new();
    writeln!(raw, "| run | tree | tool | wall (s) | peak RSS (MiB) | `ru_maxrss` (MiB) | floor (MiB) | user (s) | sys (s) | image (+ blob) bytes | load avg (1 min) before |").unwrap();
    writeln!(
        raw,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    .unwrap();
    let started = Instant::now();
    for run in 0..runs {
        for (t, tr) in trees.iter().enumerate() {
            for (k, &tool) in tools.iter().enumerate() {
                let (out, blob) = tool.outputs(&out_dir, &tr.name);
                let s = measure(tool, &tr.path, &out, blob.as_deref(), drop);
                writeln!(
                    raw,
                    "| {} | {} | {} | {:.2} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {} | {} |",
                    run + 1,
                    tr.name,
                    tool.label(),
                    s.wall_s,
                    s.peak_label(),
                    s.maxrss_kib as f64 / 1024.0,
                    s.floor_kib as f64 / 1024.0,
                    s.user_s,
                    s.sys_s,
                    if tool.chunked() {
                        format!("{} + {}", s.image_bytes, s.blob_bytes)
                    } else {
                        s.image_bytes.to_string()
                    },
                    s.load1
                )
                .unwrap();
                eprintln!(
                    "run {} {} {}: {:.2} s, {:.1} MiB",
                    run + 1,
                    tr.name,
                    tool.label(),
                    s.wall_s,
                    s.peak_kib() as f64 / 1024.0
                );
                samples[t][k].push(s);
            }
        }
    }
    let timed = started.elapsed();

    let cache = if drop {
        "cold-cache"
    } else {
        "warm-cache (smoke)"
    };
    for chunked in [false, true] {
        let group: Vec<usize> = (0..tools.len())
            .filter(|&k| tools[k].chunked() == chunked)
            .collect();
        let reference_k = group
            .iter()
            .copied()
            .find(|&k| {
                tools[k]
                    == Tool::Mkfs {
                        peer: reference,
                        chunked,
                    }
            })
            .expect("the reference peer is in every group");
        if chunked {
            println!("## Chunked: meta image + blob, medians of {runs} {cache} runs\n");
            println!("`mkfs.erofs --chunksize={CHUNK_SIZE} --blobdev=BLOB META SRC` vs `erofs_builder::build_layer` (what `strata layer build` runs before pushing; `fsync: false`). Sizes are meta + blob. Ratios: strata / {}; \"vs best\": strata / the fastest peer.\n", tools[reference_k].label());
        } else {
            println!("## Full image: medians of {runs} {cache} runs\n");
            println!(
                "Ratios: strata / {}; \"vs best\": strata / the fastest peer.\n",
                tools[reference_k].label()
            );
        }
        println!("| tree | tool | wall (s) | peak RSS (MiB) | user+sys (s) | size (MiB) | **wall ratio** | **RSS ratio** | **size ratio** | wall vs best peer |");
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        for (t, tr) in trees.iter().enumerate() {
            let med = |k: usize, f: &dyn Fn(&Sample) -> f64| {
                median(&samples[t][k].iter().map(f).collect::<Vec<_>>())
            };
            let ref_wall = med(reference_k, &|s| s.wall_s);
            let ref_rss = med(reference_k, &|s| s.peak_kib() as f64);
            let ref_size = med(reference_k, &|s| s.total_bytes() as f64);
            let best_wall = group
                .iter()
                .filter(|&&k| tools[k].is_peer())
                .map(|&k| med(k, &|s| s.wall_s))
                .fold(f64::INFINITY, f64::min);
            for &k in &group {
                let tool = tools[k];
                let wall = med(k, &|s| s.wall_s);
                let rss = med(k, &|s| s.peak_kib() as f64);
                let cpu = med(k, &|s| s.user_s + s.sys_s);
                let size = med(k, &|s| s.total_bytes() as f64);
                let ratios = format!(
                    "{:.2} | {:.2} | {:.3} | {:.2}",
                    wall / ref_wall,
                    rss / ref_rss,
                    size / ref_size,
                    wall / best_wall
                );
                let ratios = if tool.is_peer() {
                    ratios
                } else {
                    // Bold: strata's rows.
                    ratios
                        .split(" | ")
                        .map(|r| format!("**{r}**"))
                        .collect::<Vec<_>>()
                        .join(" | ")
                };
                println!(
                    "| {} | {} | {:.2} | {:.1} | {:.2} | {:.1} | {} |",
                    tr.name,
                    tool.label(),
                    wall,
                    rss / 1024.0,
                    cpu,
                    size / 1048576.0,
                    ratios
                );
            }
        }
        println!();
    }

    println!("## Every run\n");
    print!("{raw}");
    println!("\nTimed part: {:.0} s.\n", timed.as_secs_f64());

    println!("## Image details (last run)\n");
    println!("| tree | tool | image (meta) bytes | allocated | blob bytes | blob allocated | strata child's own VmHWM (MiB) |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (t, tr) in trees.iter().enumerate() {
        for (k, &tool) in tools.iter().enumerate() {
            let s = samples[t][k].last().expect("at least one run");
            println!(
                "| {} | {} | {} | {} | {} | {} | {} |",
                tr.name,
                tool.label(),
                s.image_bytes,
                s.image_alloc_bytes,
                s.blob_bytes,
                s.blob_alloc_bytes,
                s.self_hwm_kib
                    .map_or("–".to_owned(), |h| format!("{:.1}", h as f64 / 1024.0))
            );
        }
    }

    let checker = if peers.contains(&Peer::V18) {
        Peer::V18
    } else {
        Peer::V15
    };
    println!(
        "\n## `{} --extract` (not timed)\n",
        checker.bin("fsck.erofs").display()
    );
    println!("| tree | tool | result |");
    println!("| --- | --- | --- |");
    for tr in &trees {
        for &tool in &tools {
            let (out, blob) = tool.outputs(&out_dir, &tr.name);
            println!(
                "| {} | {} | {} |",
                tr.name,
                tool.label(),
                fsck(checker, &out, blob.as_deref())
            );
        }
    }
    println!(
        "\nHarness's own VmHWM at the end: {:.1} MiB (a `posix_spawn`ed child's `ru_maxrss` can include its parent's RSS up to its exec; this bounds that error).",
        vm_hwm_kib().unwrap_or(0) as f64 / 1024.0
    );
}

/// The child: build one image (`build_image`) or one layer (`build_layer`, when
/// [`BLOB_ENV`] is set) and print the result line.
fn child_main() {
    let src = PathBuf::from(std::env::var_os(SRC_ENV).expect("source"));
    let out = PathBuf::from(std::env::var_os(OUT_ENV).expect("output"));
    let fsync = std::env::var(FSYNC_ENV).expect("fsync flag") == "1";
    let blob = std::env::var_os(BLOB_ENV).map(PathBuf::from);
    let mut opts = erofs_builder::BuildOptions::default();
    opts.fsync = fsync;
    let t = Instant::now();
    let built = match &blob {
        None => erofs_builder::build_image(&src, &out, &opts).map(|s| (s, None)),
        Some(blob) => {
            let mut lopts = erofs_builder::LayerOptions::default();
            lopts.build = opts;
            erofs_builder::build_layer(&src, &out, blob, &lopts).map(|l| (l.meta.clone(), Some(l)))
        }
    };
    match built {
        Ok((stats, layer)) => {
            let layer = layer.map_or(String::new(), |l| {
                format!(
                    " blob_bytes={} chunks={} unique_chunks={} hole_chunks={} stored_bytes={}",
                    l.blob_bytes, l.chunks, l.unique_chunks, l.hole_chunks, l.stored_bytes
                )
            });
            println!(
                "{RESULT_TAG} build_s={:.3} inodes={} files={} dirs={} symlinks={} hardlinks={} data_bytes={} extended_inodes={} image_bytes={} vmhwm_kib={}{layer}",
                t.elapsed().as_secs_f64(),
                stats.inodes,
                stats.files,
                stats.dirs,
                stats.symlinks,
                stats.hardlinks,
                stats.data_bytes,
                stats.extended_inodes,
                stats.image_bytes,
                vm_hwm_kib().unwrap_or(0)
            );
        }
        Err(e) => {
            eprintln!("build failed: {e}");
            std::process::exit(1);
        }
    }
}

fn measure(tool: Tool, src: &Path, out: &Path, blob: Option<&Path>, drop: bool) -> Sample {
    // Not timed: remove the previous image (and blob), write back dirty pages, drop caches.
    let _ = std::fs::remove_file(out);
    if let Some(b) = blob {
        let _ = std::fs::remove_file(b);
    }
    if drop {
        drop_caches();
    }
    let log_path = out.with_extension("log");
    let log = File::create(&log_path).expect("create the log");
    let mut cmd = match tool {
        Tool::Mkfs { peer, chunked } => {
            let mut c = Command::new(peer.bin("mkfs.erofs"));
            if chunked {
                let blob = blob.expect("chunked tools have a blob");
                // mkfs.erofs 1.8 opens --blobdev without O_CREAT: give it an empty file.
                File::create(blob).expect("create the blob file");
                c.arg(format!("--chunksize={CHUNK_SIZE}"))
                    .arg(format!("--blobdev={}", blob.display()));
            }
            c.arg(out).arg(src);
            c
        }
        Tool::Strata { fsync } => {
            let mut c = Command::new(std::env::current_exe().expect("current_exe"));
            c.env(CHILD_ENV, "1")
                .env(SRC_ENV, src)
                .env(OUT_ENV, out)
                .env(FSYNC_ENV, if fsync { "1" } else { "0" });
            c
        }
        Tool::StrataLayer => {
            let mut c = Command::new(std::env::current_exe().expect("current_exe"));
            c.env(CHILD_ENV, "1")
                .env(SRC_ENV, src)
                .env(OUT_ENV, out)
                .env(BLOB_ENV, blob.expect("layers have a blob"))
                .env(FSYNC_ENV, "0");
            c
        }
    };
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup the log"))
        .stderr(log);
    let load1 = load_avg();
    // A `posix_spawn`ed (vfork-like) child's `ru_maxrss` is max(its own peak, the parent's
    // VmHWM when it execs). Reset our VmHWM to our current RSS so that floor stays small,
    // and record it: a figure at or below it is only an upper bound.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let floor_kib = vm_hwm_kib().unwrap_or(0);
    let t0 = Instant::now();
    // Reaped by `wait4` below (which gives its rusage), not by `Child::wait`.
    let pid = cmd.spawn().expect("spawn the build").id();
    let (status, ru) = wait4(pid);
    let wall_s = t0.elapsed().as_secs_f64();
    if !status.success() {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        panic!(
            "{} on {} failed ({status}):\n{text}",
            tool.label(),
            src.display()
        );
    }
    let meta = std::fs::metadata(out).expect("the image exists");
    let (blob_bytes, blob_alloc_bytes) = blob.map_or((0, 0), |b| {
        let m = std::fs::metadata(b).expect("the blob exists");
        (m.len(), m.blocks() * 512)
    });
    let self_hwm_kib = match tool {
        Tool::Mkfs { .. } => None,
        Tool::Strata { .. } | Tool::StrataLayer => {
            // Our own child's log is one line (the peer's can be megabytes: not read).
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let line = text
                .lines()
                .find(|l| l.starts_with(RESULT_TAG))
                .expect("result line");
            let image_bytes: u64 = field(line, "image_bytes").expect("image_bytes");
            assert_eq!(
                image_bytes,
                meta.len(),
                "BuildStats::image_bytes vs file size"
            );
            if tool == Tool::StrataLayer {
                assert_eq!(
                    field(line, "blob_bytes"),
                    Some(blob_bytes),
                    "LayerStats::blob_bytes vs file size"
                );
            }
            field(line, "vmhwm_kib")
        }
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Sample {
        wall_s,
        maxrss_kib: ru.ru_maxrss as u64,
        user_s: tv(ru.ru_utime),
        sys_s: tv(ru.ru_stime),
        image_bytes: meta.len(),
        image_alloc_bytes: meta.blocks() * 512,
        blob_bytes,
        blob_alloc_bytes,
        load1,
        self_hwm_kib,
        floor_kib,
    }
}

fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// Reaps `pid` with `wait4`: its exit status and its own resource usage.
fn wait4(pid: u32) -> (ExitStatus, libc::rusage) {
    let pid = pid as libc::pid_t;
    // SAFETY: `rusage` is plain old data; all-zero bytes are a valid value of it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: `status` and `ru` are valid, writable and outlive the call; `pid` is our
        // own child, not yet reaped (its `Child` is never waited on).
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == pid {
            return (ExitStatus::from_raw(status), ru);
        }
        let err = std::io::Error::last_os_error();
        assert_eq!(err.kind(), std::io::ErrorKind::Interrupted, "wait4: {err}");
    }
}

fn drop_caches() {
    // SAFETY: `sync` has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3\n")
        .expect("drop caches (echo 3 > /proc/sys/vm/drop_caches needs root)");
}

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

fn vm_hwm_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

fn fsck(checker: Peer, image: &Path, blob: Option<&Path>) -> String {
    let t = Instant::now();
    let mut cmd = Command::new(checker.bin("fsck.erofs"));
    if let Some(b) = blob {
        cmd.arg(format!("--device={}", b.display()));
    }
    match cmd
        .arg("--extract")
        .arg(image)
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => format!("ok ({:.1} s)", t.elapsed().as_secs_f64()),
        Ok(o) => format!(
            "**FAILED** ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .take(3)
                .collect::<Vec<_>>()
                .join(" / ")
        ),
        Err(e) => format!("not run: {e}"),
    }
}

/// Counts a tree: (entries including the root, regular files, bytes in regular files).
fn count(path: &Path) -> (u64, u64, u64) {
    let mut entries = 1;
    let mut files = 0;
    let mut bytes = 0;
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("readdir").flatten() {
            entries += 1;
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                files += 1;
                bytes += e.metadata().map_or(0, |m| m.len());
            }
        }
    }
    (entries, files, bytes)
}

fn tree(name: &str, path: &Path) -> Tree {
    let (entries, files, file_bytes) = count(path);
    Tree {
        name: name.into(),
        path: path.into(),
        entries,
        files,
        file_bytes,
    }
}

fn make_small_tree(dest: &Path) {
    let python = Command::new("python3")
        .args(["-c", "import sys; print(sys.base_prefix)"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    std::fs::create_dir_all(dest).expect("create the small-files tree");
    let mut sources: Vec<(PathBuf, String)> = Vec::new();
    if let Some(p) = python {
        let name = format!(
            "python-{}",
            p.file_name().map_or("3".into(), |n| n.to_string_lossy())
        );
        sources.push((p, name));
    }
    sources.push((PathBuf::from("/usr/share"), "share".into()));
    for (src, name) in sources {
        eprintln!(
            "copying {} to {}",
            src.display(),
            dest.join(&name).display()
        );
        let ok = Command::new("cp")
            .arg("-a")
            .arg(&src)
            .arg(dest.join(&name))
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "cp -a {} failed", src.display());
    }
}

fn make_tiny_tree(dest: &Path) {
    let _ = std::fs::remove_dir_all(dest);
    for d in 0..3 {
        let dir = dest.join(format!("d{d}"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for f in 0..20u32 {
            let data = vec![b'a' + (f % 26) as u8; (f as usize) * 777];
            std::fs::write(dir.join(format!("f{f}")), data).expect("write");
        }
        std::os::unix::fs::symlink("f1", dir.join("link")).expect("symlink");
    }
}

fn print_context(trees: &[Tree], out_dir: &Path, drop: bool) {
    let uname = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "kernel {uname}, {nproc} CPUs, load average before: {}; images in {} ({}); caches dropped before every build: {drop}\n",
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        out_dir.display(),
        fs_type(out_dir).unwrap_or_default(),
    );
    println!("| tree | path | entries | regular files | bytes in files | filesystem |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for t in trees {
        println!(
            "| {} | `{}` | {} | {} | {:.1} MiB | {} |",
            t.name,
            t.path.display(),
            t.entries,
            t.files,
            t.file_bytes as f64 / 1048576.0,
            fs_type(&t.path).unwrap_or_default()
        );
    }
    println!();
}
