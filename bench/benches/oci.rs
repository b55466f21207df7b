//! OCI export and import throughput (`oci_image`) against `umoci` on the same tree: a
//! scenario harness, not a micro-benchmark. Prints a markdown table.
//!
//! Setup (not timed): the tree ([`TREE_ENV`], default the cached debootstrap Debian root
//! `/var/cache/strata/debian-bookworm-minbase`, made by `scripts/debian-base.sh`) is built
//! once as a Strata layer into a local directory store under the bench directory.
//!
//! Timed, each run on its own fresh output, 3 runs interleaved, medians:
//!
//! - **export, ours**: `strata layer export --oci DIR` as a library call: the meta image
//!   fetched from the store and verified, every file read through a fresh memory-only chunk
//!   cache (every chunk verified), the layer tar written and gzip'd (level 6, as 8 MiB
//!   members compressed two at a time) or zstd'd (level 3), hashed twice (diff_id and blob
//!   digest), config, manifest, index.
//! - **export, umoci**: `umoci repack` of a bundle whose rootfs holds the same tree
//!   (prepared untimed by `umoci unpack` of an empty image and `cp -a`): umoci walks the
//!   rootfs against its mtree, writes the layer tar, gzips it (Go, parallel) and writes the
//!   blobs. The same work in the other direction: a tree to a gzip layer in a layout.
//! - **import, ours**: `strata image import DIR` as a library call on our gzip export: plan
//!   (every document checked), the layer read once (sha256 of the blob, gunzip, sha256 of
//!   the tar), built as a lazy layer (meta image + 256 KiB-chunk blob, every chunk hashed for
//!   dedupe), both stored in a fresh store, manifest pushed.
//! - **import, umoci**: `umoci unpack --image DIR:TAG BUNDLE` of the same layout: digest
//!   checks, gunzip, extraction of every file to a directory tree, mtree of the result.
//!
//! Throughput is the layer's uncompressed tar bytes over wall time, for every row (the same
//! tree, so the same bytes). Files are in the page cache (the tree is read once before the
//! runs); the bench directory is on the local disk (`bench::bench_dir`).
//!
//! `cargo bench -p bench --bench oci`. Without `--bench` (as `cargo test --benches` runs
//! it): a smoke run on a tiny tree, one run, without umoci if it is missing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use bench::median;
use fs_cache::{LayerRef, Manifest, PosixBackend, Store};
use oci_image::export::{LayerCompression, LayoutOptions};

/// The tree to export and import.
const TREE_ENV: &str = "STRATA_BENCH_OCI_TREE";
const TREE_DEFAULT: &str = "/var/cache/strata/debian-bookworm-minbase";
const RUNS: usize = 3;

fn store_at(dir: &Path) -> Store {
    std::fs::create_dir_all(dir).unwrap();
    Store::new(Arc::new(PosixBackend::open(dir).unwrap()))
}

/// Builds `tree` as the layer `base/bench:1` into `store`.
async fn build_layer(store: &Store, tree: &Path, work: &Path) -> LayerRef {
    let (meta, blob) = (work.join("meta"), work.join("blob"));
    let mut o = erofs_builder::LayerOptions::default();
    o.build.fsync = false;
    erofs_builder::build_layer(tree, &meta, &blob, &o).unwrap();
    let m = store.put_blob_file(&meta).await.unwrap();
    let b = store.put_blob_file(&blob).await.unwrap();
    let r: LayerRef = "base/bench:1".parse().unwrap();
    let man = Manifest::new(
        r.clone(),
        Some(m.blob_ref()),
        vec![b.blob_ref()],
        "bench".into(),
    );
    store.push_manifest(&man).await.unwrap();
    r
}

/// Ours: export `layer` to `out`; returns (seconds, tar bytes).
async fn export(store: &Store, layer: &LayerRef, out: &Path, c: LayerCompression) -> (f64, u64) {
    let started = Instant::now();
    let manifests = oci_image::store::resolve_stack(store, std::slice::from_ref(layer))
        .await
        .unwrap();
    let cache = fs_cache::chunk::ChunkCache::open(
        store.clone(),
        fs_cache::chunk::CacheConfig {
            memory_bytes: 64 << 20,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let layers = oci_image::store::open_layers(store, &cache, manifests)
        .await
        .unwrap();
    let out = out.to_path_buf();
    let stats = tokio::task::spawn_blocking(move || {
        let ex: Vec<_> = layers.iter().map(|l| l.as_export()).collect();
        oci_image::export::write_layout(&ex, &out, &LayoutOptions::new("1").compression(c))
    })
    .await
    .unwrap()
    .unwrap();
    (
        started.elapsed().as_secs_f64(),
        stats.layers.iter().map(|l| l.tar_bytes).sum(),
    )
}

/// Ours: import the layout `dir` into a fresh store at `store_dir`; returns seconds.
async fn import(dir: &Path, store_dir: &Path, work: &Path) -> f64 {
    let started = Instant::now();
    let store = store_at(store_dir);
    std::fs::create_dir_all(work).unwrap();
    let (d, w) = (dir.to_path_buf(), work.to_path_buf());
    let (plan_source, built) = tokio::task::spawn_blocking(move || {
        let plan = oci_image::open_image(&d, &oci_image::OpenOptions::default()).unwrap();
        let built =
            oci_image::import::build_layers(&plan, &oci_image::import::ImportOptions::new(&w))
                .unwrap();
        (plan.source.clone(), built)
    })
    .await
    .unwrap();
    let name: LayerRef = "base/imported:1".parse().unwrap();
    oci_image::store::push_stack(
        &store,
        &built,
        &name,
        &plan_source,
        fs_cache::Compression::default(),
    )
    .await
    .unwrap();
    started.elapsed().as_secs_f64()
}

fn sh(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn timed(cmd: &mut Command) -> f64 {
    let started = Instant::now();
    sh(cmd);
    started.elapsed().as_secs_f64()
}

/// umoci: a bundle of an empty image whose rootfs is a copy of `tree` (not timed), then
/// `umoci repack` (timed).
fn umoci_export(tree: &Path, dir: &Path) -> f64 {
    let layout = dir.join("layout");
    let bundle = dir.join("bundle");
    let img = format!("{}:1", layout.display());
    sh(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout));
    sh(Command::new("umoci").args(["new", "--image", &img]));
    sh(Command::new("umoci")
        .args(["unpack", "--image", &img])
        .arg(&bundle));
    sh(Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", tree.display()))
        .arg(bundle.join("rootfs")));
    timed(
        Command::new("umoci")
            .args(["repack", "--image", &img])
            .arg(&bundle),
    )
}

fn have_umoci() -> bool {
    Command::new("umoci")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn rate(bytes: u64, s: f64) -> String {
    format!("{:.0} MB/s", bytes as f64 / s / 1e6)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let base = bench::bench_dir(Path::new(env!("CARGO_TARGET_TMPDIR"))).join("oci");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let tree: PathBuf = if full {
        std::env::var_os(TREE_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(TREE_DEFAULT))
    } else {
        let t = base.join("tiny");
        std::fs::create_dir_all(t.join("d")).unwrap();
        std::fs::write(t.join("d/f"), vec![7u8; 300_000]).unwrap();
        std::fs::write(t.join("small"), b"small").unwrap();
        t
    };
    assert!(
        tree.is_dir(),
        "{} is not a directory: run scripts/debian-base.sh or set {TREE_ENV}",
        tree.display()
    );
    let runs = if full { RUNS } else { 1 };
    let umoci = have_umoci();
    if !umoci {
        eprintln!(
            "*** umoci is not installed: its rows are SKIPPED (scripts/install-test-deps.sh) ***"
        );
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Read the tree once (page cache) and build the layer.
    sh(Command::new("tar")
        .arg("-cf")
        .arg("/dev/null")
        .arg("-C")
        .arg(&tree)
        .arg("."));
    let store = store_at(&base.join("store"));
    let layer = rt.block_on(build_layer(&store, &tree, &base));
    let mut rows: Vec<(&str, Vec<f64>)> = vec![
        ("export, ours, gzip", vec![]),
        ("export, ours, zstd", vec![]),
        ("export, umoci repack (gzip)", vec![]),
        ("import, ours (gzip layout)", vec![]),
        ("import, umoci unpack (same layout)", vec![]),
    ];
    let mut tar_bytes = 0;
    for run in 0..runs {
        let d = base.join(format!("run{run}"));
        std::fs::create_dir_all(&d).unwrap();
        let (s, b) = rt.block_on(export(
            &store,
            &layer,
            &d.join("gz"),
            LayerCompression::Gzip,
        ));
        tar_bytes = b;
        rows[0].1.push(s);
        let (s, _) = rt.block_on(export(
            &store,
            &layer,
            &d.join("zst"),
            LayerCompression::Zstd,
        ));
        rows[1].1.push(s);
        if umoci {
            rows[2].1.push(umoci_export(&tree, &d.join("umoci-export")));
        }
        rows[3].1.push(rt.block_on(import(
            &d.join("gz"),
            &d.join("import-store"),
            &d.join("import-work"),
        )));
        if umoci {
            rows[4].1.push(timed(
                Command::new("umoci")
                    .args(["unpack", "--image"])
                    .arg(format!("{}:1", d.join("gz").display()))
                    .arg(d.join("umoci-bundle")),
            ));
        }
        // Keep the disk use to one run's worth.
        let _ = std::fs::remove_dir_all(&d);
    }
    let entries = walkdir_count(&tree);
    println!(
        "\nTree: {} ({entries} entries, layer tar {:.1} MB), {runs} run(s), medians\n",
        tree.display(),
        tar_bytes as f64 / 1e6
    );
    println!("| what | wall | throughput (tar bytes) | umoci's time / ours |");
    println!("| --- | ---: | ---: | ---: |");
    let med = |v: &[f64]| if v.is_empty() { f64::NAN } else { median(v) };
    let umoci_export_s = med(&rows[2].1);
    let umoci_import_s = med(&rows[4].1);
    for (i, (name, v)) in rows.iter().enumerate() {
        if v.is_empty() {
            println!("| {name} | SKIPPED | | |");
            continue;
        }
        let s = med(v);
        let peer = if i < 3 {
            umoci_export_s
        } else {
            umoci_import_s
        };
        let vs = if peer.is_nan() || i == 2 || i == 4 {
            String::new()
        } else {
            format!("{:.2}x", peer / s)
        };
        println!("| {name} | {s:.2} s | {} | {vs} |", rate(tar_bytes, s));
    }
    let _ = std::fs::remove_dir_all(&base);
}

fn walkdir_count(root: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            n += 1;
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    n
}
