//! Cross-layer chunk dedup: what the store keeps and what a build uploads, with dedup (the
//! default of `strata layer build`) against `--no-dedup`, on the same trees in one run.
//!
//! A scenario harness (no criterion):
//!
//! ```sh
//! cargo build --release --bin strata
//! cargo bench -p bench --bench dedup
//! ```
//!
//! 1. **Toolkit versions**: a copy of a tree (`STRATA_DEDUP_TREE`; default the Debian minbase
//!    root's `usr`, [`bench::node::debian_tree`]; the smoke run takes its `usr/share/doc`) is
//!    built as `toolkit/t:1`, then nine times more (`toolkit/t:2` …), each version changing
//!    ~5% of the files (chosen by a hash of the path and the version; 16 bytes in the middle
//!    of each rewritten, sizes kept).
//! 2. **Workspaces**: 100 layers `workspace/task-N:1` (smoke: 5), each a common tree (the
//!    minbase root's `usr/share`; smoke: `usr/share/doc`) plus its own `task/` directory (50
//!    files of 8 KiB and one of 2 MiB, random).
//!
//! Each scenario is built twice, into two fresh local stores: with dedup and with
//! `--no-dedup` (zstd per chunk both times). Reported: the layers' file data, the bytes
//! under each store's `blobs/` (objects and chunk tables), the bytes the builds uploaded
//! (the JSON's `uploaded_bytes`), the chunks pointed at in earlier blobs, and the builds'
//! wall time. Every deduped layer is then read back through `strata layer export --erofs`
//! (the cache, every device) for one version and one workspace and compared with its tree.
//!
//! nydus 2.2 beside it where `nydus-image` is installed ([`bench::measure::nydus_bins`];
//! skipped loudly otherwise): every layer built with `nydus-image create --fs-version 6
//! --chunk-size 0x40000 --compressor zstd` into one shared blob directory, once without and
//! once with a chunk dictionary (`--chunk-dict bootstrap=` the previous layer's bootstrap,
//! which lists every chunk that layer uses, in whichever blob), as nydus dedups across
//! images; stored = the blob directory plus the bootstraps, uploaded = what each build added.
//!
//! Figures and the machine: `bench/README.md`, "dedup".

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use bench::node::LocalNode;

fn files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        let mut es: Vec<_> = rd.flatten().collect();
        es.sort_by_key(|e| e.file_name());
        for e in es {
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            if md.is_dir() {
                stack.push(e.path());
            } else if md.is_file() {
                out.push(e.path());
            }
        }
    }
    out
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

/// `len` deterministic pseudo-random bytes.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    bench::fill_pseudo_random(&mut b, seed);
    b
}

fn copy_tree(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .args(["-a", "--reflink=auto"])
        .arg(from)
        .arg(to)
        .status()
        .expect("run cp");
    assert!(st.success(), "cp -a {} {}", from.display(), to.display());
}

#[derive(Default)]
struct Side {
    seconds: f64,
    uploaded: u64,
    dedup_chunks: u64,
}

/// Build `tree` as `name` on `node` (`extra` flags); adds to `side`.
fn build(node: &LocalNode, tree: &Path, name: &str, extra: &[&str], side: &mut Side) {
    let mut args = vec![
        "layer",
        "build",
        tree.to_str().expect("UTF-8"),
        "--name",
        name,
    ];
    args.extend_from_slice(extra);
    let t = Instant::now();
    let v = node.json(&args);
    side.seconds += t.elapsed().as_secs_f64();
    side.uploaded += v["uploaded_bytes"].as_u64().expect("uploaded_bytes");
    side.dedup_chunks += v["dedup_chunks"].as_u64().unwrap_or(0);
}

/// nydus-image builds of a scenario's layers into one blob directory, with or without a chunk
/// dictionary (the previous layer's bootstrap).
struct Nydus {
    bin: PathBuf,
    dir: tempfile::TempDir,
    dict: bool,
    last: Option<PathBuf>,
    side: Side,
}

impl Nydus {
    fn new(bin: &Path, tmp: &Path, dict: bool) -> Self {
        let dir = bench::bench_tempdir(tmp, "dedup-nydus-", "the nydus directory");
        std::fs::create_dir_all(dir.path().join("blobs")).expect("the blob directory");
        Nydus {
            bin: bin.to_owned(),
            dir,
            dict,
            last: None,
            side: Side::default(),
        }
    }

    fn stored(&self) -> u64 {
        bench::du(self.dir.path())
    }

    fn build(&mut self, tree: &Path, n: usize) {
        let boot = self.dir.path().join(format!("bootstrap-{n}"));
        let before = self.stored();
        let blobs = self.dir.path().join("blobs");
        let mut cmd = bench::measure::nydus_create(&self.bin, "zstd", &blobs, &boot);
        if let (true, Some(last)) = (self.dict, &self.last) {
            cmd.arg("--chunk-dict")
                .arg(format!("bootstrap={}", last.display()));
        }
        let t = Instant::now();
        let out = cmd.arg(tree).output().expect("run nydus-image");
        self.side.seconds += t.elapsed().as_secs_f64();
        assert!(
            out.status.success(),
            "nydus-image create (dict {}): {}",
            self.dict,
            String::from_utf8_lossy(&out.stderr)
        );
        self.side.uploaded += self.stored().saturating_sub(before);
        self.last = Some(boot);
    }
}

/// The nydus row of a scenario: without and with the chunk dictionary.
fn report_nydus(what: &str, layers: usize, data: u64, plain: &Nydus, dict: &Nydus) {
    let (s_dict, s_plain) = (dict.stored(), plain.stored());
    println!(
        "| {what}, nydus-image | {layers} | {:.1} | {:.1} | {:.1} ({:.3}×) | {:.1} | {:.1} ({:.3}×) | | {:.1} | {:.1} |",
        mb(data),
        mb(s_plain),
        mb(s_dict),
        s_dict as f64 / s_plain as f64,
        mb(plain.side.uploaded),
        mb(dict.side.uploaded),
        dict.side.uploaded as f64 / plain.side.uploaded.max(1) as f64,
        plain.side.seconds,
        dict.side.seconds,
    );
}

/// `layer export --erofs` of `name` compared, file by file, with `tree`.
fn check_export(node: &LocalNode, name: &str, tree: &Path) {
    let out = node.dir.path().join("check.erofs");
    node.ok(&[
        "layer",
        "export",
        name,
        "--erofs",
        out.to_str().expect("UTF-8"),
    ]);
    let img = erofs_builder::Image::open(&out).expect("the exported image");
    let mut n = 0;
    for f in files(tree) {
        let rel = f.strip_prefix(tree).expect("under the tree");
        let ino = img
            .lookup(&format!("/{}", rel.display()))
            .unwrap_or_else(|e| panic!("{name}: {}: {e}", rel.display()));
        let data = img.read_data(&ino).expect("read from the export");
        assert!(
            data == std::fs::read(&f).expect("read the tree"),
            "{name}: {} differs",
            rel.display()
        );
        n += 1;
    }
    std::fs::remove_file(&out).ok();
    println!("  {name}: all {n} files read back exactly through the cache");
}

fn report(
    what: &str,
    layers: usize,
    data: u64,
    on: &LocalNode,
    off: &LocalNode,
    d: &Side,
    p: &Side,
) {
    let stored = |n: &LocalNode| bench::du(&Path::new(&n.store).join("blobs"));
    let (s_on, s_off) = (stored(on), stored(off));
    println!(
        "| {what} | {layers} | {:.1} | {:.1} | {:.1} ({:.3}×) | {:.1} | {:.1} ({:.3}×) | {} | {:.1} | {:.1} |",
        mb(data),
        mb(s_off),
        mb(s_on),
        s_on as f64 / s_off as f64,
        mb(p.uploaded),
        mb(d.uploaded),
        d.uploaded as f64 / p.uploaded as f64,
        d.dedup_chunks,
        p.seconds,
        d.seconds,
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let full = bench::full_run();
    let debian = bench::node::debian_tree();
    let tree = match std::env::var_os("STRATA_DEDUP_TREE") {
        Some(t) => PathBuf::from(t),
        None if full => debian.join("usr"),
        None => debian.join("usr/share/doc"),
    };
    let common = if full {
        debian.join("usr/share")
    } else {
        debian.join("usr/share/doc")
    };
    let (versions, workspaces) = if full { (10, 100) } else { (3, 5) };
    let target_tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let tmp = bench::bench_tempdir(target_tmp, "dedup-", "the bench directory");
    let nydus_bin = match bench::measure::nydus_bins() {
        Ok((image, _)) => Some(image),
        Err(why) => {
            println!(
                "\n!!!!!!!! dedup: the nydus-image rows are SKIPPED: {why}.\n!!!!!!!! Install \
                 nydus 2.2 with `cargo install --locked nydus-rs`, or set \
                 STRATA_PEERS_NYDUS_BIN.\n"
            );
            None
        }
    };
    let nydus_pair = |tmp: &Path| {
        nydus_bin
            .as_deref()
            .map(|b| (Nydus::new(b, tmp, false), Nydus::new(b, tmp, true)))
    };
    println!(
        "| scenario | layers | file data MB | stored, no dedup MB | stored, dedup MB | uploaded, no dedup MB | uploaded, dedup MB | chunks deduped | build s, no dedup | build s, dedup |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");

    // 1. Toolkit versions.
    let work = tmp.path().join("toolkit");
    copy_tree(&tree, &work);
    let all = files(&work);
    let size_of = |fs: &[PathBuf]| -> u64 {
        fs.iter()
            .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
            .sum()
    };
    let (on, off) = (
        LocalNode::new(tmp.path(), "on-"),
        LocalNode::new(tmp.path(), "off-"),
    );
    let (mut d, mut p) = (Side::default(), Side::default());
    let mut ny = nydus_pair(tmp.path());
    let mut data = 0;
    let mut changed_total = 0;
    for v in 1..=versions {
        if v > 1 {
            for f in &all {
                let h = blake3::hash(format!("{}:{v}", f.display()).as_bytes());
                if h.as_bytes()[0] % 20 != 0 {
                    continue;
                }
                let Ok(mut b) = std::fs::read(f) else {
                    continue;
                };
                if b.is_empty() {
                    continue;
                }
                let mid = b.len() / 2;
                let end = (mid + 16).min(b.len());
                b[mid..end].copy_from_slice(&bytes(u64::from(h.as_bytes()[1]) + v, end - mid));
                std::fs::write(f, &b).expect("rewrite a file of the copy");
                changed_total += 1;
            }
        }
        let name = format!("toolkit/t:{v}");
        build(&on, &work, &name, &[], &mut d);
        build(&off, &work, &name, &["--no-dedup"], &mut p);
        if let Some((plain, dict)) = &mut ny {
            plain.build(&work, v as usize);
            dict.build(&work, v as usize);
        }
        data += size_of(&all);
        if v == versions {
            check_export(&on, &name, &work);
        }
    }
    println!(
        "  ({} files in {}, {changed_total} rewritten over {} versions: {:.1}% a version)",
        all.len(),
        tree.display(),
        versions - 1,
        100.0 * changed_total as f64 / (all.len() as f64 * (versions - 1).max(1) as f64)
    );
    report(
        &format!("toolkit, {versions} versions"),
        versions as usize,
        data,
        &on,
        &off,
        &d,
        &p,
    );
    if let Some((plain, dict)) = &ny {
        report_nydus(
            &format!("toolkit, {versions} versions"),
            versions as usize,
            data,
            plain,
            dict,
        );
    }
    drop((on, off, ny));
    std::fs::remove_dir_all(&work).ok();

    // 2. Workspaces on a common tree.
    let work = tmp.path().join("ws");
    copy_tree(&common, &work);
    let base_data = size_of(&files(&work));
    let (on, off) = (
        LocalNode::new(tmp.path(), "won-"),
        LocalNode::new(tmp.path(), "woff-"),
    );
    let (mut d, mut p) = (Side::default(), Side::default());
    let mut ny = nydus_pair(tmp.path());
    let mut data = 0;
    for i in 0..workspaces {
        let task = work.join("task");
        std::fs::remove_dir_all(&task).ok();
        std::fs::create_dir_all(&task).expect("task dir");
        let mut own = 0;
        for j in 0..50u64 {
            let b = bytes(i * 1000 + j, 8192);
            own += b.len() as u64;
            std::fs::write(task.join(format!("f{j}")), b).expect("a task file");
        }
        let b = bytes(i * 1000 + 999, 2 << 20);
        own += b.len() as u64;
        std::fs::write(task.join("data.bin"), b).expect("a task file");
        let name = format!("workspace/task-{i}:1");
        build(&on, &work, &name, &[], &mut d);
        build(&off, &work, &name, &["--no-dedup"], &mut p);
        if let Some((plain, dict)) = &mut ny {
            plain.build(&work, i as usize);
            dict.build(&work, i as usize);
        }
        data += base_data + own;
        if i == workspaces - 1 {
            check_export(&on, &name, &work);
        }
    }
    report(
        &format!("{workspaces} workspaces on {}", common.display()),
        workspaces as usize,
        data,
        &on,
        &off,
        &d,
        &p,
    );
    if let Some((plain, dict)) = &ny {
        report_nydus(
            &format!("{workspaces} workspaces on {}", common.display()),
            workspaces as usize,
            data,
            plain,
            dict,
        );
    }
}
