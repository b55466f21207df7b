// THROW-AWAY: decomposes the cost of a level-2 hit. Not committed.
use fs_cache::chunk::disk::{DiskCache, DiskCacheConfig};
use fs_cache::chunk::ChunkId;
use fs_cache::Digest;
use std::fs::File;
use std::os::unix::fs::FileExt;
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
        "{name:60} {:8.2} µs",
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
    let n = 2000;
    let mut i = 0u64;
    per("pread 4 KiB, reused buffer", 20000, || {
        file.read_exact_at(&mut buf[..4096], (i % 256) * chunk as u64)
            .unwrap();
        i += 1;
    });
    per("pread 256 KiB, reused buffer", n, || {
        file.read_exact_at(&mut buf, (i % 256) * chunk as u64)
            .unwrap();
        i += 1;
    });
    per(
        "pread 256 KiB into fresh Vec::with_capacity (uninit)",
        n,
        || {
            let mut v: Vec<u8> = Vec::with_capacity(chunk);
            let n = rustix::io::pread(
                &file,
                rustix::buffer::spare_capacity(&mut v),
                (i % 256) * chunk as u64,
            )
            .unwrap();
            assert_eq!(n, chunk);
            std::hint::black_box(&v);
            i += 1;
        },
    );
    per("fresh Vec 256 KiB, touch every page, drop", n, || {
        let mut v: Vec<u8> = Vec::with_capacity(chunk);
        // SAFETY: throw-away
        unsafe { v.set_len(chunk) };
        for p in (0..chunk).step_by(4096) {
            v[p] = 1;
        }
        std::hint::black_box(&v);
    });
    per("open + fstat + close of a chunk-sized file", n, || {
        let f = File::open(&path).unwrap();
        std::hint::black_box(f.metadata().unwrap().len());
    });
    per("blake3 (Digest::of) of 256 KiB", n, || {
        std::hint::black_box(Digest::of(&data[(i % 256) as usize * chunk..][..chunk]));
        i += 1;
    });
    per("blake3 (Digest::of) of 4 KiB", 20000, || {
        std::hint::black_box(Digest::of(&data[..4096]));
    });
    per("memcpy 256 KiB (warm, reused dst)", n, || {
        buf.copy_from_slice(&data[(i % 256) as usize * chunk..][..chunk]);
        std::hint::black_box(&buf);
        i += 1;
    });

    // DiskCache::get on its own.
    let dc = DiskCache::open(DiskCacheConfig {
        dir: dir.path().join("l2"),
        capacity: 128 << 20,
    })
    .unwrap();
    let blob = Digest::of(b"blob");
    for k in 0..256u64 {
        dc.put(
            &ChunkId { blob, index: k },
            &data[k as usize * chunk..][..chunk],
        )
        .unwrap();
    }
    for k in 0..256u64 {
        dc.get(&ChunkId { blob, index: k }).unwrap().unwrap();
    }
    per("DiskCache::get (256 KiB chunk, page cache warm)", n, || {
        std::hint::black_box(
            dc.get(&ChunkId {
                blob,
                index: i % 256,
            })
            .unwrap(),
        );
        i += 1;
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    per("spawn_blocking(no-op) round trip from block_on", n, || {
        rt.block_on(async { tokio::task::spawn_blocking(|| ()).await.unwrap() })
    });
    per(
        "block_on(spawn_blocking(DiskCache::get + verify))",
        n,
        || {
            let dc = &dc;
            let id = ChunkId {
                blob,
                index: i % 256,
            };
            i += 1;
            std::thread::scope(|_| {});
            let d = rt
                .block_on(async { tokio::task::block_in_place(|| dc.get(&id).unwrap().unwrap()) });
            std::hint::black_box(Digest::of(&d));
        },
    );
}
