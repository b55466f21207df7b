//! The conformance suite: every backend must pass every case (see `backend/mod.rs` for the
//! semantics it checks).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fs_cache::{Backend, Error, PutMode};
use futures::StreamExt;

/// Deterministic pseudo-random bytes: `len` bytes of stream `seed` starting at `offset`.
/// Byte `p` of a stream depends only on `p` and `seed`, so any range can be regenerated.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let word = |w: u64| {
        (w.wrapping_add(seed.wrapping_mul(0xD6E8_FEB8_6659_FD93)))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29)
            .to_le_bytes()
    };
    let mut out = Vec::with_capacity(len + 16);
    let first = offset / 8;
    let skip = (offset % 8) as usize;
    let mut w = first;
    while out.len() < len + skip {
        out.extend_from_slice(&word(w));
        w += 1;
    }
    out.drain(..skip);
    out.truncate(len);
    out
}

/// A body of `total` bytes of `pattern(seed)` in pieces of `piece` bytes.
pub fn pattern_stream(seed: u64, total: u64, piece: usize) -> fs_cache::backend::ByteStream {
    futures::stream::unfold(0u64, move |at| async move {
        if at >= total {
            return None;
        }
        let n = piece.min((total - at) as usize);
        Some((Ok(Bytes::from(pattern(seed, at, n))), at + n as u64))
    })
    .boxed()
}

/// A body that yields `good` bytes, then fails.
pub fn failing_stream(good: u64, piece: usize) -> fs_cache::backend::ByteStream {
    pattern_stream(7, good, piece)
        .chain(futures::stream::once(async {
            Err(std::io::Error::other("the source broke"))
        }))
        .boxed()
}

pub async fn roundtrip(b: Arc<dyn Backend>) {
    let meta = b
        .put("dir/obj", Bytes::from_static(b"hello world"))
        .await
        .unwrap();
    assert_eq!(meta.size, 11);
    assert_eq!(&b.get("dir/obj").await.unwrap()[..], b"hello world");
    let head = b.head("dir/obj").await.unwrap();
    assert_eq!(head.key, "dir/obj");
    assert_eq!(head.size, 11);
    assert!(head.etag.is_some());
    assert!(head.last_modified.is_some());
}

pub async fn empty_object(b: Arc<dyn Backend>) {
    b.put("empty", Bytes::new()).await.unwrap();
    assert_eq!(b.head("empty").await.unwrap().size, 0);
    assert!(b.get("empty").await.unwrap().is_empty());
    assert!(b.get_range("empty", 0..10).await.unwrap().is_empty());
    assert!(b.get_range("empty", 0..0).await.unwrap().is_empty());
    let e = b.get_range("empty", 1..2).await.unwrap_err();
    assert!(matches!(e, Error::InvalidRange { size: 0, .. }), "{e}");
}

pub async fn ranges(b: Arc<dyn Backend>) {
    let data = pattern(1, 0, 1000);
    b.put("r", Bytes::from(data.clone())).await.unwrap();
    for (range, expect) in [
        (0..10, 0..10),
        (990..1000, 990..1000),
        (990..2000, 990..1000),
        (0..u64::MAX, 0..1000),
        (1000..1010, 1000..1000),
        (500..500, 500..500),
        (123..456, 123..456),
    ] {
        let got = b.get_range("r", range.clone()).await.unwrap();
        assert_eq!(
            &got[..],
            &data[expect.start as usize..expect.end as usize],
            "range {range:?}"
        );
    }
    let e = b.get_range("r", 1001..1010).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidRange {
                start: 1001,
                size: 1000,
                ..
            }
        ),
        "{e}"
    );
}

pub async fn missing(b: Arc<dyn Backend>) {
    b.put("present", Bytes::from_static(b"x")).await.unwrap();
    for e in [
        b.get("absent").await.unwrap_err(),
        b.get_range("absent", 0..10).await.unwrap_err(),
        b.get_range("absent", 5..5).await.unwrap_err(),
        b.head("absent").await.unwrap_err(),
        b.get("no/such/dir/key").await.unwrap_err(),
        b.get("present/below").await.unwrap_err(),
    ] {
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        assert!(e.is_not_found());
        assert!(!e.is_transient());
        assert!(e.to_string().contains("not found"), "{e}");
    }
    // Delete is idempotent.
    b.delete("absent").await.unwrap();
    b.delete("present").await.unwrap();
    b.delete("present").await.unwrap();
    assert!(b.head("present").await.unwrap_err().is_not_found());
}

pub async fn overwrite(b: Arc<dyn Backend>) {
    let first = b.put("o", Bytes::from_static(b"first")).await.unwrap();
    let second = b.put("o", Bytes::from_static(b"second!")).await.unwrap();
    assert_eq!(&b.get("o").await.unwrap()[..], b"second!");
    let head = b.head("o").await.unwrap();
    assert_eq!(head.size, 7);
    assert_ne!(first.etag, head.etag);
    assert_eq!(second.size, 7);
}

pub async fn create_mode(b: Arc<dyn Backend>) {
    b.put_opts("c", Bytes::from_static(b"one"), PutMode::Create)
        .await
        .unwrap();
    let e = b
        .put_opts("c", Bytes::from_static(b"two"), PutMode::Create)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::AlreadyExists { .. }), "{e}");
    assert_eq!(&b.get("c").await.unwrap()[..], b"one");
    // Concurrent creates: exactly one wins.
    let results = futures::future::join_all((0..8u8).map(|i| {
        let b = b.clone();
        async move {
            b.put_opts("race", Bytes::from(vec![i; 100]), PutMode::Create)
                .await
        }
    }))
    .await;
    let winners: Vec<usize> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_ok())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for r in &results {
        if let Err(e) = r {
            assert!(matches!(e, Error::AlreadyExists { .. }), "{e}");
        }
    }
    assert_eq!(
        &b.get("race").await.unwrap()[..],
        &vec![winners[0] as u8; 100][..]
    );
}

pub async fn list_prefixes(b: Arc<dyn Backend>) {
    for k in ["a/1", "a/2", "a/b/3", "ab/4", "b", "a-z"] {
        b.put(k, Bytes::from(k.as_bytes().to_vec())).await.unwrap();
    }
    let keys = |v: Vec<fs_cache::ObjectMeta>| v.into_iter().map(|m| m.key).collect::<Vec<_>>();
    assert_eq!(keys(b.list("a/").await.unwrap()), ["a/1", "a/2", "a/b/3"]);
    assert_eq!(
        keys(b.list("a").await.unwrap()),
        ["a-z", "a/1", "a/2", "a/b/3", "ab/4"]
    );
    assert_eq!(keys(b.list("a/b").await.unwrap()), ["a/b/3"]);
    assert_eq!(
        keys(b.list("").await.unwrap()),
        ["a-z", "a/1", "a/2", "a/b/3", "ab/4", "b"]
    );
    assert!(b.list("zzz/").await.unwrap().is_empty());
    let sizes: Vec<u64> = b.list("a/").await.unwrap().iter().map(|m| m.size).collect();
    assert_eq!(sizes, [3, 3, 5]);
    assert!(matches!(
        b.list("../").await.unwrap_err(),
        Error::InvalidKey { .. }
    ));
}

pub async fn list_many(b: Arc<dyn Backend>) {
    const N: usize = 1100;
    futures::stream::iter(0..N)
        .map(|i| {
            let b = b.clone();
            async move {
                b.put(&format!("many/{i:05}"), Bytes::from(vec![1u8; i % 7]))
                    .await
            }
        })
        .buffer_unordered(32)
        .for_each(|r| async {
            r.unwrap();
        })
        .await;
    b.put("other/x", Bytes::new()).await.unwrap();
    let listed = b.list("many/").await.unwrap();
    assert_eq!(listed.len(), N);
    for (i, m) in listed.iter().enumerate() {
        assert_eq!(m.key, format!("many/{i:05}"));
        assert_eq!(m.size, (i % 7) as u64);
    }
}

pub async fn large_streamed(b: Arc<dyn Backend>) {
    const SIZE: u64 = 100 << 20;
    let meta = b
        .put_stream("big", pattern_stream(3, SIZE, 1 << 20), PutMode::Overwrite)
        .await
        .unwrap();
    assert_eq!(meta.size, SIZE);
    assert_eq!(b.head("big").await.unwrap().size, SIZE);
    for (start, len) in [
        (0u64, 4096usize),
        ((8 << 20) - 100, 200),
        ((16 << 20) - 1, 2),
        (SIZE - 10, 10),
        (SIZE / 2, 3 << 20),
    ] {
        let got = b.get_range("big", start..start + len as u64).await.unwrap();
        assert_eq!(got.len(), len);
        assert!(got[..] == pattern(3, start, len)[..], "range at {start}");
    }
    let all = b.get("big").await.unwrap();
    assert_eq!(all.len() as u64, SIZE);
    let mut expect = blake3::Hasher::new();
    let mut at = 0;
    while at < SIZE {
        let n = (1u64 << 20).min(SIZE - at);
        expect.update(&pattern(3, at, n as usize));
        at += n;
    }
    assert_eq!(blake3::hash(&all), expect.finalize());
}

pub async fn failed_put_leaves_nothing(b: Arc<dyn Backend>) {
    let e = b
        .put_stream(
            "broken",
            failing_stream(3 << 20, 1 << 20),
            PutMode::Overwrite,
        )
        .await
        .unwrap_err();
    assert!(!e.to_string().is_empty());
    assert!(b.head("broken").await.unwrap_err().is_not_found());
    // A failed overwrite keeps the old object.
    b.put("kept", Bytes::from_static(b"old")).await.unwrap();
    b.put_stream(
        "kept",
        failing_stream(1 << 20, 256 << 10),
        PutMode::Overwrite,
    )
    .await
    .unwrap_err();
    assert_eq!(&b.get("kept").await.unwrap()[..], b"old");
    let keys: Vec<String> = b
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(keys, ["kept"]);
}

pub async fn concurrent_puts(b: Arc<dyn Backend>) {
    const SIZE: u64 = 10 << 20;
    const WRITERS: u8 = 4;
    let uniform = |data: &[u8]| data.iter().all(|&x| x == data[0]);
    b.put("same", Bytes::from(vec![200u8; SIZE as usize]))
        .await
        .unwrap();
    let writers = (0..WRITERS).map(|w| {
        let b = b.clone();
        async move {
            let body = futures::stream::iter(0..10)
                .then(move |_| async move {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok(Bytes::from(vec![w; (SIZE / 10) as usize]))
                })
                .boxed();
            b.put_stream("same", body, PutMode::Overwrite)
                .await
                .unwrap();
        }
    });
    let reader = {
        let b = b.clone();
        async move {
            // The property is wholeness: an error the backend marks transient (moto once
            // answered a GET racing multipart completions with an HTTP 500) is what the
            // store's retry layer absorbs, not a torn read; a few are tolerated, and said.
            let mut transient = 0;
            for _ in 0..10 {
                let got = match b.get("same").await {
                    Ok(g) => g,
                    Err(e) if e.is_transient() && transient < 3 => {
                        transient += 1;
                        println!("concurrent_puts: transient error from the backend: {e}");
                        continue;
                    }
                    Err(e) => panic!("get during concurrent puts: {e}"),
                };
                assert_eq!(got.len() as u64, SIZE, "a reader saw a torn object");
                assert!(uniform(&got), "a reader saw a mix of writers");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    futures::future::join(futures::future::join_all(writers), reader).await;
    let last = b.get("same").await.unwrap();
    assert_eq!(last.len() as u64, SIZE);
    assert!(uniform(&last), "the final object mixes writers");
    assert!(
        last[0] < WRITERS,
        "the final object is none of the writers'"
    );
}

pub async fn invalid_keys(b: Arc<dyn Backend>) {
    for key in ["../escape", "/abs", "a//b", "a/../../b", ""] {
        let e = b.get(key).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{key}: {e}");
        let e = b.put(key, Bytes::from_static(b"x")).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{key}: {e}");
        let e = b.delete(key).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{key}: {e}");
    }
}
