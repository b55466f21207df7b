//! POSIX-backend specifics: the root cannot be escaped, temporary files never show.

use std::os::unix::fs::symlink;

use bytes::Bytes;
use fs_cache::{Backend, Error, PosixBackend, PutMode};
use futures::StreamExt;

#[tokio::test]
async fn symlinks_out_of_the_root_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"secret").unwrap();
    let root = dir.path().join("root");
    let b = PosixBackend::open(&root).unwrap();
    symlink(&outside, root.join("out")).unwrap();
    symlink("../outside/secret", root.join("secret-link")).unwrap();
    symlink("../outside", root.join("rel-out")).unwrap();

    for key in ["out/secret", "secret-link", "rel-out/secret"] {
        let e = b.get(key).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{key}: {e}");
        assert!(e.to_string().contains("outside the store root"), "{e}");
    }
    for key in ["out/new", "out/deeper/new", "rel-out/x"] {
        let e = b.put(key, Bytes::from_static(b"x")).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{key}: {e}");
    }
    // Nothing was written outside.
    let mut names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["secret"]);
    // Symlinks are not listed as objects, and a symlink inside the root stays usable.
    b.put("real/file", Bytes::from_static(b"data"))
        .await
        .unwrap();
    symlink("real", root.join("alias")).unwrap();
    assert_eq!(&b.get("alias/file").await.unwrap()[..], b"data");
    let keys: Vec<String> = b
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(keys, ["real/file"]);
}

#[tokio::test]
async fn temporary_files_are_invisible_and_cleaned_up() {
    let dir = tempfile::tempdir().unwrap();
    let b = PosixBackend::open(dir.path()).unwrap();
    // A put in flight: its temporary file exists but is not listed.
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(1);
    let body = futures::stream::poll_fn({
        let mut rx = rx;
        move |cx| rx.poll_recv(cx)
    })
    .boxed();
    let b2 = b.clone();
    let put = tokio::spawn(async move { b2.put_stream("d/obj", body, PutMode::Overwrite).await });
    tx.send(Ok(Bytes::from(vec![1u8; 1 << 20]))).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let on_disk: Vec<_> = std::fs::read_dir(dir.path().join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(on_disk.len(), 1);
    assert!(on_disk[0].starts_with(".strata-tmp."), "{on_disk:?}");
    assert!(b.list("").await.unwrap().is_empty());
    assert!(b.head("d/obj").await.unwrap_err().is_not_found());
    // The body fails: the temporary file goes away, no object appears.
    tx.send(Err(std::io::Error::other("gone"))).await.unwrap();
    drop(tx);
    put.await.unwrap().unwrap_err();
    assert_eq!(std::fs::read_dir(dir.path().join("d")).unwrap().count(), 0);
}

#[tokio::test]
async fn an_object_cannot_be_a_directory_and_vice_versa() {
    let dir = tempfile::tempdir().unwrap();
    let b = PosixBackend::open(dir.path()).unwrap();
    b.put("x", Bytes::from_static(b"file")).await.unwrap();
    let e = b
        .put("x/y", Bytes::from_static(b"below a file"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidKey { .. }), "{e}");
    b.put("d/y", Bytes::from_static(b"y")).await.unwrap();
    assert!(b.get("d").await.unwrap_err().is_not_found());
    assert!(b.put("d", Bytes::from_static(b"over a dir")).await.is_err());
    assert_eq!(&b.get("d/y").await.unwrap()[..], b"y");
}

#[tokio::test]
async fn file_urls_and_plain_paths_open_posix() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s");
    let a = fs_cache::open_backend(p.to_str().unwrap()).await.unwrap();
    a.put("k", Bytes::from_static(b"v")).await.unwrap();
    let url = format!("file://{}", p.display());
    let b = fs_cache::open_backend(&url).await.unwrap();
    assert_eq!(&b.get("k").await.unwrap()[..], b"v");
    assert!(b.to_string().starts_with("file://"));
}

/// Pages of `path` in `range` that are in the page cache (mincore(2)).
fn resident_pages(path: &std::path::Path, range: std::ops::Range<usize>) -> usize {
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a fresh read-only shared mapping of the whole file; unmapped below, and the
    // pointer is only handed to mincore.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let mut vec = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `p` maps `len` bytes; `vec` has one byte per page of them.
    let rc = unsafe { libc::mincore(p, len, vec.as_mut_ptr()) };
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(p, len) };
    assert_eq!(rc, 0);
    vec[range.start / 4096..range.end.div_ceil(4096)]
        .iter()
        .filter(|b| **b & 1 == 1)
        .count()
}

#[tokio::test]
async fn ranged_reads_leave_no_page_cache_copy_unless_asked() {
    // On the build's disk, not tmpfs (whose pages cannot be dropped).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let b = PosixBackend::open(dir.path()).unwrap();
    let data: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
        .collect();
    b.put("blobs/x", Bytes::from(data.clone())).await.unwrap();
    let path = dir.path().join("blobs/x");
    let cold = || {
        let f = std::fs::File::open(&path).unwrap();
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    };
    let range = (1 << 20)..(5 << 20);
    let keep = PosixBackend::open(dir.path())
        .unwrap()
        .keep_read_pages(true);
    for (backend, resident) in [(&b, 0), (&keep, 1024)] {
        cold();
        assert_eq!(resident_pages(&path, 0..8 << 20), 0, "starts uncached");
        let got = backend
            .get_range("blobs/x", range.start as u64..range.end as u64)
            .await
            .unwrap();
        assert!(got[..] == data[range.clone()]);
        assert_eq!(
            resident_pages(&path, range.clone()),
            resident,
            "pages in the page cache after the read"
        );
    }
}
