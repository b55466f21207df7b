// THROW-AWAY: decomposes the cost of a level-2 hit. Not to be committed.
use fs_cache::chunk::disk::{DiskCache, DiskCacheConfig};
use fs_cache::chunk::ChunkId;
use fs_cache::Digest;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

fn per<F: FnMut()>(name: &str, n: u32, mut f: F) {
    for _ in 0..n / 10 {
        f();
    }
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    println!(
        "{name:70} {:8.2} µs",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
}

fn main() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let chunk = 256usize << 10;
    let mut data = vec![0u8; 64 << 20];
    bench::fill_pseudo_random(&mut data, 1);
    let path = dir.path().join("f");
    std::fs::write(&path, &data).unwrap();
    let file = File::open(&path).unwrap();
    let mut buf = vec![0u8; chunk];
    for off in (0..data.len()).step_by(chunk) {
        file.read_exact_at(&mut buf, off as u64).unwrap();
    }
    let n = 3000;
    let mut i = 0u64;
    let mut b4 = vec![0u8; 4096];
    per(
        "plain: pread 4 KiB of the 64 MiB file, reused buffer",
        20000,
        || {
            file.read_exact_at(&mut b4, (i * 7919 % 16384) * 4096)
                .unwrap();
            i += 1;
        },
    );
    per("plain: pread 256 KiB, reused buffer", n, || {
        file.read_exact_at(&mut buf, (i % 256) * chunk as u64)
            .unwrap();
        i += 1;
    });
    per("blake3 (Digest::of) of 256 KiB", n, || {
        std::hint::black_box(Digest::of(&data[(i % 256) as usize * chunk..][..chunk]));
        i += 1;
    });
    let mut big = vec![0u8; 1 << 20];
    per(
        "memcpy 1 MiB (as BytesMut::extend of 4-5 chunks)",
        n,
        || {
            big.copy_from_slice(&data[(i % 60) as usize * chunk..][..1 << 20]);
            std::hint::black_box(&big);
            i += 1;
        },
    );

    let dc = Arc::new(
        DiskCache::open(DiskCacheConfig {
            dir: dir.path().join("l2"),
            capacity: 128 << 20,
        })
        .unwrap(),
    );
    let blob = Digest::of(b"blob");
    let id = move |k: u64| ChunkId {
        blob,
        index: k % 256,
    };
    for k in 0..256u64 {
        dc.put(&id(k), &data[k as usize * chunk..][..chunk])
            .unwrap();
    }
    for k in 0..256u64 {
        dc.get(&id(k)).unwrap().unwrap();
    }
    let hex = blob.to_hex();
    let cpath = |k: u64| {
        dir.path()
            .join("l2/chunks")
            .join(&hex[..2])
            .join(format!("{hex}.{}", k % 256))
    };
    per("chunk file: open + fstat + pread 4 KiB + close", n, || {
        let f = File::open(cpath(i)).unwrap();
        std::hint::black_box(f.metadata().unwrap().len());
        f.read_exact_at(&mut b4, 8192).unwrap();
        i += 1;
    });
    per(
        "chunk file: open + fstat + pread 256 KiB (reused buf) + close",
        n,
        || {
            let f = File::open(cpath(i)).unwrap();
            std::hint::black_box(f.metadata().unwrap().len());
            f.read_exact_at(&mut buf, 0).unwrap();
            i += 1;
        },
    );
    per("DiskCache::get (whole chunk, fresh Vec), inline", n, || {
        std::hint::black_box(dc.get(&id(i)).unwrap());
        i += 1;
    });
    per("DiskCache::get + verify (blake3), inline", n, || {
        let d = dc.get(&id(i)).unwrap().unwrap();
        std::hint::black_box(Digest::of(&d));
        i += 1;
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    per("spawn_blocking(no-op) round trip, from block_on", n, || {
        rt.block_on(async { tokio::task::spawn_blocking(|| ()).await.unwrap() })
    });
    per(
        "spawn_blocking(DiskCache::get) + verify (= the l2 4 KiB path)",
        n,
        || {
            let dc = dc.clone();
            let k = i;
            i += 1;
            let d = rt.block_on(async {
                tokio::task::spawn_blocking(move || dc.get(&id(k)).unwrap().unwrap())
                    .await
                    .unwrap()
            });
            std::hint::black_box(Digest::of(&d));
        },
    );
    per("spawn_blocking(DiskCache::get), no verify", n, || {
        let dc = dc.clone();
        let k = i;
        i += 1;
        std::hint::black_box(rt.block_on(async {
            tokio::task::spawn_blocking(move || dc.get(&id(k)).unwrap().unwrap())
                .await
                .unwrap()
        }));
    });
}
