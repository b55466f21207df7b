//! Ranged-read throughput of the storage backends, against the physical limit in the same run.
//!
//! - `posix_ranged_read/{4KiB,256KiB,4MiB}`: `PosixBackend::get_range` of random, size-aligned
//!   ranges of a 256 MiB object on the local disk, one read at a time, on a tokio runtime.
//! - `std_fs_pread/{4KiB,256KiB,4MiB}`: the same ranges of the same file with
//!   `FileExt::read_exact_at` into one reused buffer: what the kernel can deliver from the page
//!   cache, i.e. the ceiling for the row above.
//! - `s3_ranged_read/{256KiB,4MiB}`: `S3Backend::get_range` of random aligned ranges of a
//!   64 MiB object on an S3-compatible server on 127.0.0.1 (`moto_server`, started here, or
//!   `STRATA_BENCH_S3_ENDPOINT`). Skipped, loudly, when no server is available.
//!
//! The page cache is warm for both local groups: the file was just written and is read once
//! through before measuring. Run one group with
//! `cargo bench -p bench --bench backend_read -- posix_ranged_read`.
//! Figures and their interpretation: `bench/README.md`.

use std::cell::OnceCell;
use std::fs::File;
use std::hint::black_box;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench::{aligned_offsets, bench_tempdir, fill_pseudo_random, fs_type, size_label, S3Server};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fs_cache::{Backend, PosixBackend};
use tokio::runtime::Runtime;

/// Size of the local test file.
const FILE_SIZE: u64 = 256 << 20;
/// Size of the S3 test object (moto keeps objects in memory; smaller keeps set-up short).
const S3_OBJECT_SIZE: u64 = 64 << 20;
const LOCAL_SIZES: [u64; 3] = [4 << 10, 256 << 10, 4 << 20];
const S3_SIZES: [u64; 2] = [256 << 10, 4 << 20];
/// Key of the test object in both backends.
const KEY: &str = "bench/ranged-read";
/// Random offsets per size; reads cycle through them.
const OFFSETS: usize = 4096;
const S3_BUCKET: &str = "strata-bench";

/// The 256 MiB object in a `PosixBackend` on the local disk, and the same file opened with
/// `std::fs`.
struct Local {
    backend: PosixBackend,
    file: File,
    _dir: tempfile::TempDir,
}

impl Local {
    fn new(rt: &Runtime) -> Local {
        let dir = bench_tempdir(
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            "strata-bench.",
            "a temporary directory for the test file",
        );
        let backend = PosixBackend::open(dir.path().join("store"))
            .expect("open PosixBackend")
            .keep_read_pages(true);
        let started = Instant::now();
        let mut data = vec![0u8; FILE_SIZE as usize];
        fill_pseudo_random(&mut data, 0x5354_5241_5441);
        let data = Bytes::from(data);
        rt.block_on(backend.put(KEY, data.clone()))
            .expect("write the test file through PosixBackend::put");
        let path: PathBuf = backend.root().join(KEY);
        let file = File::open(&path).expect("open the test file with std::fs");
        // Read it all once so both groups start from the same, warm page cache, and check that
        // the backend and std::fs see the same bytes.
        let mut buf = vec![0u8; 4 << 20];
        for off in (0..FILE_SIZE).step_by(buf.len()) {
            file.read_exact_at(&mut buf, off).expect("warm-up read");
            assert_eq!(buf[..], data[off as usize..off as usize + buf.len()]);
        }
        let via_backend = rt
            .block_on(backend.get_range(KEY, 12_345..12_345 + 100_000))
            .expect("PosixBackend::get_range");
        assert_eq!(via_backend, data.slice(12_345..12_345 + 100_000));
        eprintln!(
            "backend_read: {} MiB test file at {} ({} filesystem), written and read once in {:.1?}; page cache warm",
            FILE_SIZE >> 20,
            path.display(),
            fs_type(&path).unwrap_or_else(|| "unknown".into()),
            started.elapsed(),
        );
        Local {
            backend,
            file,
            _dir: dir,
        }
    }
}

/// The 64 MiB object in an `S3Backend` on 127.0.0.1.
struct S3 {
    // Declared before the server so that the client goes first on drop.
    backend: Arc<dyn Backend>,
    _server: S3Server,
}

impl S3 {
    fn new(rt: &Runtime) -> S3 {
        let started = Instant::now();
        let server = match S3Server::start() {
            Ok(Some(server)) => server,
            Ok(None) => panic!("no S3 server (S3Server::available() said there was one)"),
            Err(e) => panic!("S3 server for the benchmark: {e}"),
        };
        bench::create_bucket(server.endpoint(), S3_BUCKET).expect("create the bench bucket");
        let url = format!(
            "s3://{S3_BUCKET}/backend-read?endpoint={}&region=us-east-1",
            server.endpoint()
        );
        let backend = rt
            .block_on(fs_cache::open_backend(&url))
            .unwrap_or_else(|e| panic!("open_backend({url}): {e}"));
        let mut data = vec![0u8; S3_OBJECT_SIZE as usize];
        fill_pseudo_random(&mut data, 0x0053_3342);
        let data = Bytes::from(data);
        rt.block_on(backend.put(KEY, data.clone()))
            .expect("upload the S3 test object");
        let got = rt
            .block_on(backend.get_range(KEY, 1_000_000..1_300_000))
            .expect("S3 get_range");
        assert_eq!(got, data.slice(1_000_000..1_300_000));
        eprintln!(
            "backend_read: {} MiB object at {url} ({}), uploaded and checked in {:.1?}",
            S3_OBJECT_SIZE >> 20,
            if server.is_spawned() {
                "moto_server started by this bench"
            } else {
                "external endpoint from STRATA_BENCH_S3_ENDPOINT"
            },
            started.elapsed(),
        );
        S3 {
            backend,
            _server: server,
        }
    }
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("build the tokio runtime")
}

/// One `get_range` at a time through `backend`, cycling through random aligned ranges.
fn ranged_reads(
    b: &mut criterion::Bencher<'_>,
    rt: &Runtime,
    backend: &dyn Backend,
    offsets: &[u64],
    size: u64,
) {
    let mut i = 0;
    b.to_async(rt).iter(|| {
        let off = offsets[i % offsets.len()];
        i += 1;
        async move {
            let bytes = backend
                .get_range(KEY, off..off + size)
                .await
                .expect("get_range");
            assert_eq!(bytes.len() as u64, size);
            bytes
        }
    });
}

fn backend_read(c: &mut Criterion) {
    // The moto test server takes any credentials; a real endpoint brings its own.
    for (var, value) in [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
    ] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, value);
        }
    }
    let rt = runtime();
    // Fixtures are made on first use, so that running one group (a criterion filter) builds
    // only what that group needs.
    let local: OnceCell<Local> = OnceCell::new();
    let s3: OnceCell<S3> = OnceCell::new();

    let mut group = c.benchmark_group("posix_ranged_read");
    for size in LOCAL_SIZES {
        let offsets = aligned_offsets(FILE_SIZE, size, OFFSETS, size);
        group.throughput(Throughput::Bytes(size));
        group.bench_function(size_label(size), |b| {
            let local = local.get_or_init(|| Local::new(&rt));
            ranged_reads(b, &rt, &local.backend, &offsets, size);
        });
    }
    group.finish();

    let mut group = c.benchmark_group("std_fs_pread");
    for size in LOCAL_SIZES {
        let offsets = aligned_offsets(FILE_SIZE, size, OFFSETS, size);
        group.throughput(Throughput::Bytes(size));
        group.bench_function(size_label(size), |b| {
            let local = local.get_or_init(|| Local::new(&rt));
            let mut buf = vec![0u8; size as usize];
            let mut i = 0;
            b.iter(|| {
                let off = offsets[i % offsets.len()];
                i += 1;
                local
                    .file
                    .read_exact_at(&mut buf, off)
                    .expect("read_exact_at");
                black_box(&buf);
            });
        });
    }
    group.finish();

    if !S3Server::available() {
        eprintln!();
        eprintln!("==================================================================");
        eprintln!("SKIPPED s3_ranged_read: no `moto_server` on PATH and no");
        eprintln!(
            "{} set; install moto[server] to measure S3.",
            bench::S3_ENDPOINT_ENV
        );
        eprintln!("==================================================================");
        eprintln!();
        return;
    }
    let mut group = c.benchmark_group("s3_ranged_read");
    // Each read is an HTTP round trip through a Python server: fewer, longer samples.
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(8));
    for size in S3_SIZES {
        let offsets = aligned_offsets(S3_OBJECT_SIZE, size, OFFSETS, size);
        group.throughput(Throughput::Bytes(size));
        group.bench_function(size_label(size), |b| {
            let s3 = s3.get_or_init(|| S3::new(&rt));
            ranged_reads(b, &rt, s3.backend.as_ref(), &offsets, size);
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = backend_read
}
criterion_main!(benches);
