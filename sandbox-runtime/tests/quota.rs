//! `quota::UpperFs` for real (root only): a btrfs image on a loop device, uppers limited by
//! qgroups, written directly and through a real overlayfs, reopened as after a daemon
//! restart, removed; and the latency of 200 creates.

use std::io::Write;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sandbox_runtime::quota::UpperFs;
use sandbox_runtime::Error;

const MIB: u64 = 1 << 20;

/// Whether this runs as root; otherwise a loud SKIP (and a failure under CI=true).
fn require_root(test: &str) -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    println!("\n*** SKIP: {test}: needs root ***\n");
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test} must run as root under CI"
    );
    false
}

/// Unmounts what the test mounted (overlays first, then the uppers' filesystem, whose loop
/// device then detaches by itself), even when the test fails; the tempdir goes after.
struct Guard {
    overlays: Vec<PathBuf>,
    uppers: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Guard {
    fn drop(&mut self) {
        use rustix::mount::{unmount, UnmountFlags};
        for o in self.overlays.iter().rev() {
            let _ = unmount(o, UnmountFlags::DETACH);
        }
        let _ = unmount(&self.uppers, UnmountFlags::DETACH);
    }
}

/// Write `max` bytes (1 MiB at a time) to a new file `path`, then fsync. Returns what was
/// written and the error that stopped it, if any.
fn fill(path: &Path, max: u64) -> (u64, Option<std::io::Error>) {
    let mut f = match std::fs::File::create(path) {
        Ok(f) => f,
        Err(e) => return (0, Some(e)),
    };
    let buf = vec![0x5au8; MIB as usize];
    let mut written = 0;
    while written < max {
        match f.write(&buf) {
            Ok(n) => written += n as u64,
            Err(e) => return (written, Some(e)),
        }
    }
    (written, f.sync_all().err())
}

fn is_quota_error(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EDQUOT) | Some(libc::ENOSPC))
}

fn syncfs(p: &Path) {
    let f = std::fs::File::open(p).unwrap();
    rustix::fs::syncfs(f.as_fd()).unwrap();
}

fn free_bytes(p: &Path) -> u64 {
    let st = rustix::fs::statvfs(p).unwrap();
    st.f_bavail * st.f_frsize
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

#[test]
fn uppers_bounded_by_disk() {
    if !require_root("uppers_bounded_by_disk") {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("strata-quota-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let dir = tmp.path().canonicalize().unwrap();
    let mut guard = Guard {
        overlays: Vec::new(),
        uppers: dir.join("uppers"),
        _dir: tmp,
    };

    let t = Instant::now();
    let fs = UpperFs::open(&dir, 512 * MIB).unwrap();
    println!(
        "open (mkfs.btrfs + preallocate 512 MiB + loop + mount + quota): {:?}",
        t.elapsed()
    );
    assert_eq!(fs.root(), dir.join("uppers"));
    assert!(fs.capacity() > 400 * MIB && fs.capacity() <= 512 * MIB);
    println!(
        "device {}, capacity {} MiB",
        fs.device().display(),
        mib(fs.capacity())
    );

    // Refusals, before anything is made.
    assert!(matches!(
        fs.create("Bad/id", None),
        Err(Error::InvalidSpec(_))
    ));
    assert!(matches!(
        fs.create("x", Some(1000)),
        Err(Error::InvalidSpec(_))
    ));
    assert!(matches!(
        fs.create("x", Some(1 << 40)),
        Err(Error::Limit(_))
    ));
    assert!(matches!(fs.usage("x"), Err(Error::NotFound(_))));

    let (a_upper, a_work) = fs.create("a", Some(8 * MIB)).unwrap();
    let (b_upper, b_work) = fs.create("b", Some(16 * MIB)).unwrap();
    assert_eq!(a_upper, dir.join("uppers/a/upper"));
    assert_eq!(a_work, dir.join("uppers/a/work"));
    assert!(b_upper.is_dir() && b_work.is_dir());
    assert!(matches!(fs.create("a", None), Err(Error::Conflict(_))));

    // Directly into the upper: stopped at about the limit.
    let (wa, ea) = fill(&a_upper.join("big"), 64 * MIB);
    println!("a (8 MiB): wrote {:.2} MiB, then {:?}", mib(wa), ea);
    let ea = ea.expect("a wrote past its limit");
    assert!(is_quota_error(&ea), "{ea}");
    assert!((6 * MIB..=8 * MIB).contains(&wa), "{wa}");
    // The other upper is unaffected.
    let (wb, eb) = fill(&b_upper.join("data"), 12 * MIB);
    assert!(eb.is_none(), "{eb:?}");
    assert_eq!(wb, 12 * MIB);
    syncfs(fs.root());
    let (ua, ub) = (fs.usage("a").unwrap(), fs.usage("b").unwrap());
    println!("usage: a {:.2} MiB, b {:.2} MiB", mib(ua), mib(ub));
    assert!((12 * MIB..=13 * MIB).contains(&ub), "{ub}");
    assert!(ua >= wa.saturating_sub(MIB) && ua <= 8 * MIB, "{ua}");

    // A real overlay: lower = a small tempdir, upper/work = an UpperFs pair.
    let lower = dir.join("lower");
    std::fs::create_dir(&lower).unwrap();
    std::fs::write(lower.join("hello"), vec![b'h'; 64 << 10]).unwrap();
    let (c_upper, c_work) = fs.create("c", Some(8 * MIB)).unwrap();
    let merged = dir.join("merged");
    std::fs::create_dir(&merged).unwrap();
    let data = format!(
        "lowerdir={},upperdir={},workdir={},redirect_dir=off,metacopy=off",
        lower.display(),
        c_upper.display(),
        c_work.display()
    );
    rustix::mount::mount(
        "overlay",
        &merged,
        "overlay",
        rustix::mount::MountFlags::empty(),
        Some(std::ffi::CString::new(data).unwrap().as_c_str()),
    )
    .unwrap();
    guard.overlays.push(merged.clone());
    // Copy-up of a lower file.
    std::fs::OpenOptions::new()
        .append(true)
        .open(merged.join("hello"))
        .unwrap()
        .write_all(b"world")
        .unwrap();
    assert_eq!(
        std::fs::metadata(c_upper.join("hello")).unwrap().len(),
        (64 << 10) + 5
    );
    assert_eq!(
        std::fs::metadata(lower.join("hello")).unwrap().len(),
        64 << 10
    );
    // A rename inside the overlay (work → upper moves) and a whiteout.
    std::fs::create_dir(merged.join("d")).unwrap();
    std::fs::rename(merged.join("d"), merged.join("e")).unwrap();
    std::fs::remove_file(merged.join("hello")).unwrap();
    assert!(!merged.join("hello").exists() && lower.join("hello").exists());
    let (wc, ec) = fill(&merged.join("big"), 20 * MIB);
    println!(
        "overlay on c (8 MiB): wrote {:.2} MiB, then {:?}",
        mib(wc),
        ec
    );
    let ec = ec.expect("the overlay wrote past the limit");
    assert!(is_quota_error(&ec), "{ec}");
    assert!((6 * MIB..=8 * MIB).contains(&wc), "{wc}");

    // A daemon restart: drop without unmounting, open again: the same mount, same quotas.
    let device = fs.device().to_owned();
    drop(fs);
    let t = Instant::now();
    let fs = UpperFs::open(&dir, 512 * MIB).unwrap();
    println!("reopen (reuse the mount): {:?}", t.elapsed());
    assert_eq!(fs.device(), device);
    let ub2 = fs.usage("b").unwrap();
    assert!(ub2.abs_diff(ub) < MIB, "{ub} → {ub2}");
    let (wa2, ea2) = fill(&a_upper.join("more"), 4 * MIB);
    assert!(ea2.as_ref().is_some_and(is_quota_error), "{wa2} {ea2:?}");
    assert!(wa2 <= MIB, "{wa2}");

    // remove frees the usage (btrfs's cleaner frees the space in the background).
    syncfs(fs.root());
    let before = free_bytes(fs.root());
    fs.remove("a").unwrap();
    fs.remove("a").unwrap();
    assert!(!dir.join("uppers/a").exists());
    assert!(matches!(fs.usage("a"), Err(Error::NotFound(_))));
    let t = Instant::now();
    let freed = loop {
        fs.reclaim().unwrap();
        let f = free_bytes(fs.root()).saturating_sub(before);
        if f >= 6 * MIB || t.elapsed() > Duration::from_secs(20) {
            break f;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    println!(
        "remove a: {:.2} MiB free again after {:?}",
        mib(freed),
        t.elapsed()
    );
    assert!(freed >= 6 * MIB, "{freed}");
    // The name is free for a new sandbox, with a fresh quota.
    let (a2, _) = fs.create("a", Some(8 * MIB)).unwrap();
    syncfs(fs.root());
    assert!(fs.usage("a").unwrap() < MIB);
    let (w, e) = fill(&a2.join("x"), 4 * MIB);
    assert!(e.is_none() && w == 4 * MIB, "{w} {e:?}");

    rustix::mount::unmount(&merged, rustix::mount::UnmountFlags::empty()).unwrap();
    guard.overlays.clear();
    for id in ["a", "b", "c"] {
        fs.remove(id).unwrap();
    }

    // Latency of 200 creates (and removes).
    let mut lat = Vec::new();
    let t = Instant::now();
    for i in 0..200 {
        let t = Instant::now();
        fs.create(&format!("s{i}"), Some(64 * MIB)).unwrap();
        lat.push(t.elapsed());
    }
    let total = t.elapsed();
    lat.sort();
    println!(
        "create x200: total {:?}, mean {:?}, p50 {:?}, p99 {:?}, max {:?}",
        total,
        total / 200,
        lat[100],
        lat[198],
        lat[199]
    );
    let t = Instant::now();
    for i in 0..200 {
        fs.remove(&format!("s{i}")).unwrap();
    }
    println!("remove x200: total {:?}", t.elapsed());

    fs.unmount().unwrap();
    assert!(!std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .contains(&*dir.to_string_lossy()));
}
