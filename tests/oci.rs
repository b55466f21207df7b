//! OCI images in and out, judged by tools no one here wrote: `umoci unpack` of an exported
//! layout gives the stack's tree (compared entry by entry, every attribute and byte, with
//! the stack mounted by the kernel: EROFS layers under overlayfs), `skopeo inspect` accepts
//! it, `docker load` where a docker daemon runs, `fsck.erofs` (Debian's and 1.8) and the
//! kernel accept `--erofs`; import of an export is the same tree byte for byte; layouts made
//! by umoci and skopeo import; hostile layouts are refused and push nothing.

mod common;
#[path = "oci/tree.rs"]
mod tree;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use oci_image::tarw::{EntryType, Header, TarWriter};
use oci_image::Sha256Digest;
use serde_json::{json, Value};
use tree::{assert_same, Check};

const FSCK_18: &str = "/usr/local/lib/strata/erofs-utils-1.8/bin/fsck.erofs";

/// `strata` with its own home and store.
struct Strata {
    home: PathBuf,
    store: PathBuf,
}

impl Strata {
    fn new(dir: &Path) -> Self {
        let s = Strata {
            home: dir.join("home"),
            store: dir.join("store"),
        };
        std::fs::create_dir_all(&s.home).unwrap();
        s
    }

    fn run<S: AsRef<OsStr>>(&self, args: &[S]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .env("STRATA_HOME", &self.home)
            .arg("--store")
            .arg(&self.store)
            .args(args)
            .output()
            .expect("run strata")
    }

    fn ok<S: AsRef<OsStr>>(&self, args: &[S]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "strata {:?} failed: {}\n{}",
            args.iter()
                .map(|a| a.as_ref().to_owned())
                .collect::<Vec<_>>(),
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn json<S: AsRef<OsStr>>(&self, args: &[S]) -> Value {
        let mut a: Vec<&OsStr> = vec![OsStr::new("--json")];
        a.extend(args.iter().map(|s| s.as_ref()));
        serde_json::from_str(&self.ok(&a)).unwrap()
    }

    /// Runs a command that must fail; returns its standard error.
    fn fails<S: AsRef<OsStr>>(&self, args: &[S]) -> String {
        let out = self.run(args);
        assert!(
            !out.status.success(),
            "strata {:?} should have failed: {}",
            args.iter()
                .map(|a| a.as_ref().to_owned())
                .collect::<Vec<_>>(),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    fn layers(&self) -> Vec<String> {
        self.json(&["layer", "ls"])
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["layer"].as_str().unwrap().to_owned())
            .collect()
    }

    /// The blob's plain bytes in a file: `strata blob get` decodes (and verifies) a blob the
    /// store keeps compressed, chunk by chunk, which is how layers are stored by default; the
    /// kernel mounts plain images only.
    fn blob(&self, digest: &str) -> PathBuf {
        let dir = self.home.join("plain-blobs");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(digest);
        if !path.exists() {
            self.ok(&[
                OsStr::new("blob"),
                OsStr::new("get"),
                OsStr::new(digest),
                OsStr::new("-o"),
                path.as_os_str(),
            ]);
        }
        path
    }

    /// Mounts the stack `layers` (lowest first) with the kernel: each layer's meta image
    /// file-backed with `device=` its blobs (its own, then those a deduped layer points into),
    /// then overlayfs over them (one layer: as is).
    fn mount_stack(&self, layers: &[&str], at: &Path) -> Mounts {
        let mut m = Mounts(Vec::new(), None);
        let mut roots = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            let man = self.json(&["layer", "inspect", l]);
            let meta = self.blob(man["meta"]["digest"].as_str().unwrap());
            let blobs: Vec<PathBuf> = man["blobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| self.blob(b["digest"].as_str().unwrap()))
                .collect();
            let dir = at.join(format!("l{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            ublk_daemon::node::sys::mount_erofs(&meta, &blobs, &dir)
                .unwrap_or_else(|e| panic!("mount {l}: {e}"));
            m.0.push(dir.clone());
            roots.push(dir);
        }
        if roots.len() == 1 {
            m.1 = roots.pop();
            return m;
        }
        roots.reverse();
        let merged = at.join("merged");
        std::fs::create_dir_all(&merged).unwrap();
        ublk_daemon::node::sys::mount_overlay(&roots, None, &merged).unwrap();
        m.0.push(merged.clone());
        m.1 = Some(merged);
        m
    }
}

/// Mounts, unmounted in reverse order when dropped (even when a test fails); `.1` is the
/// stack's root.
struct Mounts(Vec<PathBuf>, Option<PathBuf>);

impl Mounts {
    fn root(&self) -> &Path {
        self.1.as_deref().unwrap()
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for p in self.0.iter().rev() {
            if rustix::mount::unmount(p, rustix::mount::UnmountFlags::empty()).is_err() {
                let _ = rustix::mount::unmount(p, rustix::mount::UnmountFlags::DETACH);
            }
        }
    }
}

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn have(tool: &str, test: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!(
            "\n*** SKIPPED {test}: {tool} is not installed (scripts/install-test-deps.sh) ***\n"
        );
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test} needs {tool} under CI"
        );
    }
    found
}

fn p(s: &Path) -> &str {
    s.to_str().unwrap()
}

fn write(p: &Path, data: &[u8]) {
    if let Some(d) = p.parent() {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(p, data).unwrap();
}

fn setx(p: &Path, name: &str, value: &[u8]) {
    rustix::fs::lsetxattr(p, name, value, rustix::fs::XattrFlags::empty())
        .unwrap_or_else(|e| panic!("setxattr {name} on {p:?}: {e}"));
}

fn mtime(p: &Path, sec: i64, nsec: i64) {
    let t = rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        p,
        &rustix::fs::Timestamps {
            last_access: t,
            last_modification: t,
        },
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

fn mknod(p: &Path, ft: rustix::fs::FileType, major: u32, minor: u32) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        p,
        ft,
        rustix::fs::Mode::from_raw_mode(0o640),
        rustix::fs::makedev(major, minor),
    )
    .unwrap();
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Every attribute a layer carries: all file types, hard links across directories,
/// xattrs (user, trusted, security.capability, an ACL), a sparse file, big ids, long and
/// non-UTF-8 names, a long symlink, nanosecond and pre-1970 mtimes. Needs root.
fn make_lower(root: &Path) {
    let j = |r: &str| root.join(r);
    write(&j("empty"), b"");
    write(&j("small.txt"), b"hello, oci\n");
    write(&j("three_blocks_and_tail"), &bytes(1, 3 * 4096 + 123));
    write(&j("large"), &bytes(2, (1 << 20) + 17));
    {
        let f = std::fs::File::create(j("sparse")).unwrap();
        f.set_len(3 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &bytes(3, 10_000), 1 << 20).unwrap();
    }
    write(&j("setuid"), b"#!/bin/sh\n");
    std::fs::set_permissions(
        j("setuid"),
        std::os::unix::fs::PermissionsExt::from_mode(0o4755),
    )
    .unwrap();
    let mut cap = Vec::new();
    for v in [0x0200_0001u32, 1 << 10, 0, 0, 0] {
        cap.extend_from_slice(&v.to_le_bytes());
    }
    setx(&j("setuid"), "security.capability", &cap);
    setx(&j("small.txt"), "user.mime", b"text/plain");
    setx(&j("small.txt"), "trusted.note", b"\0binary\xff");
    write(&j("owned"), b"ids");
    std::os::unix::fs::lchown(j("owned"), Some(70_000), Some(2_200_000)).unwrap();
    write(
        &root.join(OsStr::from_bytes(b"\xff\xfe-not-utf8")),
        b"bytes",
    );
    write(&j(&"L".repeat(200)), b"long name");
    let deep = "deep/".repeat(30);
    write(&j(&format!("{deep}bottom")), b"bottom");
    std::os::unix::fs::symlink("small.txt", j("link")).unwrap();
    std::os::unix::fs::symlink("x".repeat(300), j("long_link")).unwrap();
    std::os::unix::fs::lchown(j("link"), Some(123), Some(456)).unwrap();
    write(&j("hl_a"), b"hard linked");
    std::fs::create_dir_all(j("sub")).unwrap();
    std::fs::hard_link(j("hl_a"), j("sub/hl_b")).unwrap();
    std::fs::hard_link(j("hl_a"), j("sub/hl_c")).unwrap();
    mknod(&j("null"), rustix::fs::FileType::CharacterDevice, 1, 3);
    mknod(&j("sda1"), rustix::fs::FileType::BlockDevice, 8, 1);
    mknod(
        &j("bigdev"),
        rustix::fs::FileType::BlockDevice,
        259,
        0x12345,
    );
    mknod(&j("fifo"), rustix::fs::FileType::Fifo, 0, 0);
    std::fs::create_dir_all(j("sticky")).unwrap();
    std::fs::set_permissions(
        j("sticky"),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    // A default ACL (system.posix_acl_default): user::rwx, group::r-x, other::r-x.
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perm) in [(1u16, 7u16), (4, 5), (0x20, 5)] {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&perm.to_le_bytes());
        acl.extend_from_slice(&u32::MAX.to_le_bytes());
    }
    std::fs::create_dir_all(j("acl_dir")).unwrap();
    setx(&j("acl_dir"), "system.posix_acl_default", &acl);
    for d in [
        "gone/file",
        "gone_dir/a/b",
        "opq/old1",
        "opq/old2/x",
        "keep/k",
    ] {
        write(&j(d), d.as_bytes());
    }
    setx(&j("keep"), "user.dir", b"kept");
    let mut all = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                stack.push(p.clone());
            }
            all.push(p);
        }
    }
    all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for (i, f) in all.iter().enumerate() {
        let ns = if i % 3 == 0 {
            0
        } else {
            (i as i64 * 7919) % 1_000_000_000
        };
        mtime(f, 1_600_000_000 + i as i64, ns);
    }
    mtime(&j("small.txt"), -86_400, 5);
    mtime(root, 1_700_000_000, 0);
}

/// Changes made through an overlay over `lower` into `upper`: deletions (whiteouts), a
/// directory removed and made again (opaque), a copy-up with new data, a chmod, new files.
fn make_upper(lower: &Path, upper: &Path, work: &Path, merged: &Path) {
    for d in [upper, work, merged] {
        std::fs::create_dir_all(d).unwrap();
    }
    ublk_daemon::node::sys::mount_overlay(&[lower.to_path_buf()], Some((upper, work)), merged)
        .unwrap();
    let _m = Mounts(vec![merged.to_path_buf()], None);
    let j = |r: &str| merged.join(r);
    std::fs::remove_file(j("gone/file")).unwrap();
    std::fs::remove_dir_all(j("gone_dir")).unwrap();
    std::fs::remove_file(j("sub/hl_c")).unwrap();
    std::fs::remove_dir_all(j("opq")).unwrap();
    write(&j("opq/new"), b"in a new directory of the same name");
    write(&j("small.txt"), b"changed in the upper\n");
    std::fs::set_permissions(
        j("large"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    write(&j("keep/added"), &bytes(9, 300_000));
    std::os::unix::fs::symlink("keep/added", j("new_link")).unwrap();
    mtime(&j("keep/added"), 1_650_000_000, 123_456_789);
}

/// An OCI layout in `dir` with one layer per plain tar of `tars` (lowest first), gzip or
/// not, tagged `t`: for import tests that need a layer tar no exporter would write.
fn layout_from_tars(dir: &Path, tars: &[Vec<u8>], gzip: bool) -> Vec<Sha256Digest> {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |b: &[u8]| {
        let d = Sha256Digest::of(b);
        std::fs::write(blobs.join(d.hex()), b).unwrap();
        (d, b.len())
    };
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    for t in tars {
        diff_ids.push(Sha256Digest::of(t).to_string());
        let (data, mt) = if gzip {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut e, t).unwrap();
            (
                e.finish().unwrap(),
                "application/vnd.oci.image.layer.v1.tar+gzip",
            )
        } else {
            (t.clone(), "application/vnd.oci.image.layer.v1.tar")
        };
        let (d, n) = put(&data);
        layers.push(json!({"mediaType": mt, "digest": d.to_string(), "size": n}));
    }
    let config = json!({"architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": diff_ids}});
    let (cd, cn) = put(&serde_json::to_vec(&config).unwrap());
    let manifest = json!({"schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": cd.to_string(), "size": cn},
        "layers": layers});
    let (md, mn) = put(&serde_json::to_vec(&manifest).unwrap());
    let index = json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": md.to_string(), "size": mn,
        "annotations": {"org.opencontainers.image.ref.name": "t"}}]});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    vec![md, cd]
}

/// A plain tar of `entries` (name, type, data or link target).
fn tar_of(entries: &[(&str, EntryType, &[u8])]) -> Vec<u8> {
    let mut t = TarWriter::new(Vec::new());
    for (name, kind, data) in entries {
        let mut h = Header::new(name.as_bytes(), *kind);
        h.mode = if *kind == EntryType::Dir {
            0o755
        } else {
            0o644
        };
        match kind {
            EntryType::File => h.size = data.len() as u64,
            _ => h.link = data.to_vec(),
        }
        t.append(&h).unwrap();
        if *kind == EntryType::File {
            t.data(data).unwrap();
        }
    }
    t.finish().unwrap()
}

fn fsck_both(image: &Path, test: &str) {
    sh(Command::new("fsck.erofs").arg(image));
    if Path::new(FSCK_18).exists() {
        sh(Command::new(FSCK_18).arg(image));
    } else {
        eprintln!(
            "\n*** SKIPPED {test}: fsck.erofs 1.8 missing (scripts/build-erofs-utils.sh) ***\n"
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"));
    }
}

fn docker_load(layout_tar: &Path, test: &str) {
    let daemon = Command::new("docker")
        .arg("info")
        .output()
        .is_ok_and(|o| o.status.success());
    if !daemon {
        eprintln!(
            "\n*** SKIPPED {test}: docker load (no docker daemon running here; not started \
             by the tests) ***\n"
        );
        return;
    }
    let out = sh(Command::new("docker").arg("load").arg("-i").arg(layout_tar));
    eprintln!("docker load: {out}");
}

/// The whole round on the synthetic stack: export → umoci/skopeo/docker, determinism,
/// import of the export, --flatten, --erofs.
#[test]
fn synthetic_stack_export_import_and_flatten() {
    if !common::require_root("synthetic_stack_export_import_and_flatten")
        || !have("umoci", "synthetic_stack_export_import_and_flatten")
        || !have("skopeo", "synthetic_stack_export_import_and_flatten")
    {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let s = Strata::new(t);
    let (lower, upper) = (t.join("lower"), t.join("upper"));
    std::fs::create_dir_all(&lower).unwrap();
    make_lower(&lower);
    make_upper(&lower, &upper, &t.join("work"), &t.join("ovl"));
    s.ok(&["layer", "build", p(&lower), "--name", "base/syn-lower:1"]);
    s.ok(&[
        "layer",
        "build",
        "--upper",
        p(&upper),
        "--name",
        "base/syn:1",
        "--parent",
        "base/syn-lower:1",
    ]);
    let stack = s.mount_stack(&["base/syn-lower:1", "base/syn:1"], &t.join("stack"));
    assert!(!stack.root().join("gone/file").exists() && stack.root().join("opq/new").exists());

    // Export (the parent comes along) and let umoci unpack it.
    let oci = t.join("oci");
    let ex = s.json(&[
        "layer",
        "export",
        "base/syn:1",
        "--oci",
        p(&oci),
        "--tag",
        "syn",
    ]);
    let layers = ex["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "{ex}");
    assert!(layers[1]["tar"]["whiteouts"].as_u64().unwrap() >= 3, "{ex}");
    assert_eq!(layers[1]["tar"]["opaque_dirs"], 1, "{ex}");
    let bundle = t.join("bundle");
    sh(Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:syn", oci.display()))
        .arg(&bundle));
    assert_same(
        stack.root(),
        &bundle.join("rootfs"),
        Check::EXACT,
        "umoci unpack vs stack",
    );
    let inspect: Value = serde_json::from_str(&sh(Command::new("skopeo")
        .arg("inspect")
        .arg(format!("oci:{}:syn", oci.display()))))
    .unwrap();
    assert_eq!(inspect["Layers"].as_array().unwrap().len(), 2, "{inspect}");
    assert_eq!(inspect["Os"], "linux");

    // Deterministic: the same layers export to the same bytes; .tar and zstd too.
    let again = t.join("oci-again.tar");
    s.ok(&[
        "layer",
        "export",
        "base/syn-lower:1",
        "base/syn:1",
        "--oci",
        p(&again),
        "--tag",
        "syn",
    ]);
    let unpacked = t.join("again");
    std::fs::create_dir_all(&unpacked).unwrap();
    sh(Command::new("tar")
        .arg("-xf")
        .arg(&again)
        .arg("-C")
        .arg(&unpacked));
    let (d, _) = tree::diff(
        &oci,
        &unpacked,
        Check {
            nsec: false,
            root: false,
        },
    );
    let content: Vec<_> = d
        .iter()
        .filter(|l| l.contains("contents") || l.contains("only"))
        .collect();
    assert!(content.is_empty(), "exports differ: {content:?}");
    sh(Command::new("skopeo")
        .arg("inspect")
        .arg(format!("oci-archive:{}:syn", again.display())));
    docker_load(&again, "synthetic_stack_export_import_and_flatten");
    // zstd layers (Debian's umoci 0.4.7 reads gzip only: skopeo and our import judge them).
    let zst = t.join("oci-zstd");
    s.ok(&[
        "layer",
        "export",
        "base/syn:1",
        "--oci",
        p(&zst),
        "--compression",
        "zstd",
        "--tag",
        "z",
    ]);
    sh(Command::new("skopeo")
        .arg("inspect")
        .arg(format!("oci:{}:z", zst.display())));
    s.ok(&["image", "import", p(&zst), "--name", "workspace/z:1"]);
    let z = s.mount_stack(&["workspace/z-1:1", "workspace/z:1"], &t.join("z"));
    assert_same(
        stack.root(),
        z.root(),
        Check::EXACT,
        "import of the zstd export vs stack",
    );

    // Round trip: import(export(stack)) is the same stack, tree and layer tars.
    let im = s.json(&["image", "import", p(&oci), "--name", "workspace/rt:2"]);
    let pushed = im["layers"].as_array().unwrap();
    assert_eq!(pushed[0]["layer"], "workspace/rt-1:2", "{im}");
    assert_eq!(pushed[1]["layer"], "workspace/rt:2");
    assert_eq!(pushed[1]["parents"], json!(["workspace/rt-1:2"]));
    let rt = s.mount_stack(&["workspace/rt-1:2", "workspace/rt:2"], &t.join("rt"));
    assert_same(
        stack.root(),
        rt.root(),
        Check::EXACT,
        "import(export(stack)) vs stack",
    );
    let oci2 = t.join("oci2");
    let ex2 = s.json(&["layer", "export", "workspace/rt:2", "--oci", p(&oci2)]);
    for i in 0..2 {
        assert_eq!(
            ex["layers"][i]["diff_id"], ex2["layers"][i]["diff_id"],
            "layer {i}"
        );
    }
    // Importing the same image again changes nothing.
    let im2 = s.json(&["image", "import", p(&oci), "--name", "workspace/rt:2"]);
    assert_eq!(im2["layers"][1]["outcome"], "unchanged", "{im2}");

    // --flatten: one layer that is the whole stack.
    let fl = s.json(&[
        "image",
        "import",
        p(&oci),
        "--name",
        "snapshot/flat:1",
        "--flatten",
    ]);
    assert_eq!(fl["layers"].as_array().unwrap().len(), 1, "{fl}");
    assert_eq!(fl["layers"][0]["parents"], json!([]));
    let flat = s.mount_stack(&["snapshot/flat:1"], &t.join("flat"));
    assert_same(
        stack.root(),
        flat.root(),
        Check::EXACT,
        "import --flatten vs stack",
    );

    // --erofs: one full image, fsck-clean, mounted by the kernel.
    let img = t.join("stack.erofs");
    s.ok(&["layer", "export", "base/syn:1", "--erofs", p(&img)]);
    fsck_both(&img, "synthetic_stack_export_import_and_flatten");
    let mnt = t.join("erofs-mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    ublk_daemon::node::sys::mount_erofs(&img, &[], &mnt).unwrap();
    let _m = Mounts(vec![mnt.clone()], None);
    assert_same(stack.root(), &mnt, Check::EXACT, "--erofs vs stack");
}

/// The cached debootstrap Debian root as one layer: umoci gives back the tree, the round
/// trip and --erofs give the same tree.
#[test]
fn debian_root_export_import() {
    if !common::require_root("debian_root_export_import")
        || !have("umoci", "debian_root_export_import")
    {
        return;
    }
    let Some(deb) = common::debian_root() else {
        eprintln!("\n*** SKIPPED debian_root_export_import: no Debian root (scripts/debian-base.sh failed) ***\n");
        assert!(std::env::var("CI").as_deref() != Ok("true"));
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let s = Strata::new(t);
    s.ok(&["layer", "build", p(deb), "--name", "base/debian:12"]);
    let layer = s.mount_stack(&["base/debian:12"], &t.join("layer"));
    assert_same(deb, layer.root(), Check::EXACT, "layer vs Debian root");
    let oci = t.join("deb.tar");
    s.ok(&["layer", "export", "base/debian:12", "--oci", p(&oci)]);
    let bundle = t.join("bundle");
    let layout = t.join("deb-layout");
    std::fs::create_dir_all(&layout).unwrap();
    sh(Command::new("tar")
        .arg("-xf")
        .arg(&oci)
        .arg("-C")
        .arg(&layout));
    sh(Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:12", layout.display()))
        .arg(&bundle));
    assert_same(
        deb,
        &bundle.join("rootfs"),
        Check::EXACT,
        "umoci unpack vs Debian root",
    );
    s.ok(&["image", "import", p(&oci), "--name", "base/debian-rt:12"]);
    let rt = s.mount_stack(&["base/debian-rt:12"], &t.join("rt"));
    assert_same(
        deb,
        rt.root(),
        Check::EXACT,
        "import(export) vs Debian root",
    );
    let img = t.join("deb.erofs");
    s.ok(&["layer", "export", "base/debian:12", "--erofs", p(&img)]);
    fsck_both(&img, "debian_root_export_import");
    let mnt = t.join("erofs-mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    ublk_daemon::node::sys::mount_erofs(&img, &[], &mnt).unwrap();
    let _m = Mounts(vec![mnt.clone()], None);
    assert_same(deb, &mnt, Check::EXACT, "--erofs vs Debian root");
}

/// Layouts written by umoci (init/new/unpack/repack: two layers, the second deleting a
/// file) and copied by skopeo (to a layout and to a docker-archive) import to the tree.
#[test]
fn layouts_made_by_umoci_and_skopeo_import() {
    if !common::require_root("layouts_made_by_umoci_and_skopeo_import")
        || !have("umoci", "layouts_made_by_umoci_and_skopeo_import")
        || !have("skopeo", "layouts_made_by_umoci_and_skopeo_import")
    {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let s = Strata::new(t);
    let l = t.join("umoci");
    let b = t.join("bundle");
    sh(Command::new("umoci").args(["init", "--layout"]).arg(&l));
    let img = format!("{}:t", l.display());
    sh(Command::new("umoci").args(["new", "--image", &img]));
    sh(Command::new("umoci")
        .args(["unpack", "--image", &img])
        .arg(&b));
    let root = b.join("rootfs");
    make_lower(&root);
    sh(Command::new("umoci")
        .args(["repack", "--refresh-bundle", "--image", &img])
        .arg(&b));
    std::fs::remove_file(root.join("gone/file")).unwrap();
    std::fs::remove_dir_all(root.join("opq")).unwrap();
    write(&root.join("opq/new"), b"new");
    sh(Command::new("umoci")
        .args(["repack", "--image", &img])
        .arg(&b));
    // umoci writes layer tars at one-second mtime precision and its own root entry.
    let loose = Check {
        nsec: false,
        root: false,
    };
    let im = s.json(&[
        "image",
        "import",
        p(&l),
        "--ref",
        "t",
        "--name",
        "toolkit/u:1",
    ]);
    let names: Vec<&str> = im["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["layer"].as_str().unwrap())
        .collect();
    assert!(names.len() >= 2, "{im}");
    let m = s.mount_stack(&names, &t.join("u"));
    assert_same(
        &root,
        m.root(),
        loose,
        "import of umoci's layout vs its tree",
    );

    let sk = t.join("skopeo");
    sh(Command::new("skopeo")
        .arg("copy")
        .arg(format!("oci:{}:t", l.display()))
        .arg(format!("oci:{}:copied", sk.display())));
    s.ok(&[
        "image",
        "import",
        p(&sk),
        "--name",
        "toolkit/sk:1",
        "--flatten",
    ]);
    let m2 = s.mount_stack(&["toolkit/sk:1"], &t.join("sk"));
    assert_same(
        &root,
        m2.root(),
        loose,
        "import of skopeo's layout vs the tree",
    );

    let da = t.join("docker.tar");
    sh(Command::new("skopeo")
        .arg("copy")
        .arg(format!("oci:{}:t", l.display()))
        .arg(format!("docker-archive:{}:strata/test:v1", da.display())));
    let dim = s.json(&["image", "import", p(&da), "--name", "toolkit/dk:1"]);
    assert!(
        dim["source"].as_str().unwrap().starts_with("docker-save:"),
        "{dim}"
    );
    let names: Vec<&str> = dim["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["layer"].as_str().unwrap())
        .collect();
    let m3 = s.mount_stack(&names, &t.join("dk"));
    assert_same(
        &root,
        m3.root(),
        loose,
        "import of a docker-archive vs the tree",
    );
}

/// Old-format `docker save` archives (`<id>/layer.tar`, a symlinked duplicate layer) and
/// flattening of whiteouts across layers, on hand-made layer tars.
#[test]
fn docker_save_and_flatten_semantics() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let s = Strata::new(t);
    use EntryType::{Dir, File};
    let l0 = tar_of(&[
        ("etc/", Dir, b""),
        ("etc/passwd", File, b"root:x:0:0"),
        ("etc/old", File, b"old"),
        ("var/cache/", Dir, b""),
        ("var/cache/a", File, b"a"),
    ]);
    let l1 = tar_of(&[
        ("etc/.wh.old", File, b""),
        ("var/cache/.wh..wh..opq", File, b""),
        ("var/cache/b", File, b"b"),
    ]);
    let oci = t.join("oci");
    layout_from_tars(&oci, &[l0.clone(), l1.clone()], true);
    s.ok(&[
        "image",
        "import",
        p(&oci),
        "--name",
        "base/f:1",
        "--flatten",
    ]);
    let out = t.join("flat.erofs");
    s.ok(&["layer", "export", "base/f:1", "--erofs", p(&out)]);
    // Our own reader of the flattened image (no root needed).
    let img = erofs_builder::Image::open(&out).unwrap();
    assert!(img.lookup("etc/passwd").is_ok());
    assert!(img.lookup("etc/old").is_err(), "whited out below");
    assert!(
        img.lookup("var/cache/a").is_err(),
        "hidden by the opaque dir"
    );
    assert!(img.lookup("var/cache/b").is_ok());
    let xs = img.xattrs(&img.lookup("var/cache").unwrap()).unwrap();
    assert!(xs.is_empty(), "no overlay markers left: {xs:?}");

    // docker save, old format: manifest.json, <id>.json, <id>/layer.tar; the second image
    // layer is the first one again, stored as a relative symlink.
    let config = json!({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers",
        "diff_ids": [Sha256Digest::of(&l0).to_string(), Sha256Digest::of(&l1).to_string(),
                     Sha256Digest::of(&l0).to_string()]}});
    let cbytes = serde_json::to_vec(&config).unwrap();
    let cid = Sha256Digest::of(&cbytes).hex();
    let manifest = json!([{"Config": format!("{cid}.json"), "RepoTags": ["x/y:1"],
        "Layers": ["a/layer.tar", "b/layer.tar", "c/layer.tar"]}]);
    let mut w = TarWriter::new(Vec::new());
    let file = |w: &mut TarWriter<Vec<u8>>, name: &str, data: &[u8]| {
        let mut h = Header::new(name, EntryType::File);
        h.size = data.len() as u64;
        w.append(&h).unwrap();
        w.data(data).unwrap();
    };
    file(
        &mut w,
        "manifest.json",
        &serde_json::to_vec(&manifest).unwrap(),
    );
    file(&mut w, &format!("{cid}.json"), &cbytes);
    file(&mut w, "a/layer.tar", &l0);
    file(&mut w, "b/layer.tar", &l1);
    let mut h = Header::new("c/layer.tar", EntryType::Symlink);
    h.link = b"../a/layer.tar".to_vec();
    w.append(&h).unwrap();
    let archive = t.join("save.tar");
    std::fs::write(&archive, w.finish().unwrap()).unwrap();
    let im = s.json(&["image", "import", p(&archive), "--name", "base/ds:1"]);
    let names: Vec<String> = im["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["layer"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["base/ds-1:1", "base/ds-2:1", "base/ds:1"], "{im}");
    assert_eq!(
        im["layers"][2]["parents"],
        json!(["base/ds-1:1", "base/ds-2:1"])
    );
    // A wrong diff_id in the config is refused.
    let bad = json!({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers",
        "diff_ids": [Sha256Digest::of(&l1).to_string()]}});
    let dir = t.join("save-bad");
    write(
        &dir.join("manifest.json"),
        &serde_json::to_vec(&json!([{"Config": "c.json",
        "Layers": ["a/layer.tar"]}]))
        .unwrap(),
    );
    write(&dir.join("c.json"), &serde_json::to_vec(&bad).unwrap());
    write(&dir.join("a/layer.tar"), &l0);
    let e = s.fails(&["image", "import", p(&dir), "--name", "base/bad:1"]);
    assert!(e.contains("diff_id"), "{e}");
}

/// (what, the layer tar's entries, the error expected).
type Trick<'a> = (&'a str, &'a [(&'a str, EntryType, &'a [u8])], &'a str);

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_vec(&v).unwrap()).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    sh(Command::new("cp").arg("-a").arg(from).arg(to));
}

/// Hostile layouts are refused with a clear error, and nothing is pushed.
#[test]
fn hostile_layouts_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let s = Strata::new(t);
    let layer = tar_of(&[
        ("a/", EntryType::Dir, b""),
        ("a/f", EntryType::File, b"data"),
    ]);
    let good = t.join("good");
    let [manifest, config] = layout_from_tars(&good, std::slice::from_ref(&layer), true)[..] else {
        unreachable!()
    };
    s.ok(&["image", "import", p(&good), "--name", "base/good:1"]);
    let before = s.layers();
    let index = |d: &Path| d.join("index.json");
    let blob = |d: &Path, x: &Sha256Digest| d.join(x.blob_path());
    let layer_digest = {
        let m: Value =
            serde_json::from_slice(&std::fs::read(blob(&good, &manifest)).unwrap()).unwrap();
        Sha256Digest::parse(m["layers"][0]["digest"].as_str().unwrap(), "").unwrap()
    };
    let mut n = 0;
    let mut case = |what: &str, expect: &str, f: &dyn Fn(&Path)| {
        n += 1;
        let d = t.join(format!("case{n}"));
        copy_dir(&good, &d);
        f(&d);
        let e = s.fails(&[
            "image",
            "import",
            p(&d),
            "--name",
            &format!("base/bad{n}:1"),
        ]);
        assert!(e.contains(expect), "{what}: expected {expect:?} in: {e}");
        eprintln!("{what}: refused: {}", e.trim());
    };
    case(
        "a flipped byte in the layer blob",
        "digest mismatch",
        &|d| {
            let p = blob(d, &layer_digest);
            let mut b = std::fs::read(&p).unwrap();
            let k = b.len() - 5;
            b[k] ^= 0x40;
            std::fs::write(&p, b).unwrap();
        },
    );
    // (oci-spec's descriptor parser already refuses this one; either way it never
    // becomes a path.)
    case("a traversal in a digest", "Invalid encoded value", &|d| {
        edit_json(&index(d), |v| {
            v["manifests"][0]["digest"] = json!("sha256:../../../../../../etc/passwd");
        })
    });
    case(
        "an upper-case digest",
        "non-hexadecimal character in digest",
        &|d| {
            edit_json(&index(d), |v| {
                let s = v["manifests"][0]["digest"].as_str().unwrap().to_uppercase();
                v["manifests"][0]["digest"] = json!(s.replace("SHA256", "sha256"));
            })
        },
    );
    case("another digest algorithm", "only sha256", &|d| {
        edit_json(&index(d), |v| {
            v["manifests"][0]["digest"] = json!(format!("sha512:{}", "0".repeat(128)));
        })
    });
    case("a wrong manifest size", "size mismatch", &|d| {
        edit_json(&index(d), |v| {
            let n = v["manifests"][0]["size"].as_u64().unwrap();
            v["manifests"][0]["size"] = json!(n + 1);
        })
    });
    case("a symlinked blob", "symlink", &|d| {
        let p = blob(d, &config);
        std::fs::rename(&p, d.join("elsewhere")).unwrap();
        std::os::unix::fs::symlink("../../elsewhere", &p).unwrap();
    });
    case("a symlinked blobs directory", "symlink", &|d| {
        std::fs::rename(d.join("blobs"), d.join("real-blobs")).unwrap();
        std::os::unix::fs::symlink("real-blobs", d.join("blobs")).unwrap();
    });
    case("an oversized index.json", "limit", &|d| {
        let mut b = std::fs::read(index(d)).unwrap();
        b.resize(5 << 20, b' ');
        std::fs::write(index(d), b).unwrap();
    });
    case("an unknown layout version", "imageLayoutVersion", &|d| {
        std::fs::write(d.join("oci-layout"), br#"{"imageLayoutVersion":"2.0.0"}"#).unwrap();
    });
    case("several platforms, none linux/amd64", "--platform", &|d| {
        edit_json(&index(d), |v| {
            let m = v["manifests"][0].clone();
            let mut a = m.clone();
            a["platform"] = json!({"os": "linux", "architecture": "arm64"});
            let mut b = m;
            b["platform"] = json!({"os": "linux", "architecture": "s390x"});
            v["manifests"] = json!([a, b]);
        })
    });
    case(
        "a layer media type that is not a layer",
        "media type",
        &|d| {
            let mp = blob(d, &manifest);
            let mut m: Value = serde_json::from_slice(&std::fs::read(&mp).unwrap()).unwrap();
            m["layers"][0]["mediaType"] = json!("application/vnd.oci.image.config.v1+json");
            let bytes = serde_json::to_vec(&m).unwrap();
            let md = Sha256Digest::of(&bytes);
            std::fs::write(blob(d, &md), &bytes).unwrap();
            edit_json(&index(d), |v| {
                v["manifests"][0]["digest"] = json!(md.to_string());
                v["manifests"][0]["size"] = json!(bytes.len());
            })
        },
    );
    // Layer tars no exporter writes: a `.wh.` trick and a `..` climb, each in a layout
    // whose digests are all right.
    let tricks: [Trick<'_>; 3] = [
        (
            "a whiteout of `..`",
            &[("a/.wh...", EntryType::File, b"")],
            "whiteout of an invalid name",
        ),
        (
            "a `..` entry",
            &[("../escape", EntryType::File, b"x")],
            "`..`",
        ),
        (
            "a whiteout through a symlinked parent",
            &[
                ("l", EntryType::Symlink, b"/etc"),
                ("l/.wh.passwd", EntryType::File, b""),
            ],
            "symlink",
        ),
    ];
    for (i, (what, entries, expect)) in tricks.iter().enumerate() {
        let d = t.join(format!("trick{i}"));
        layout_from_tars(&d, &[tar_of(entries)], false);
        let e = s.fails(&[
            "image",
            "import",
            p(&d),
            "--name",
            &format!("base/trick{i}:1"),
        ]);
        assert!(e.contains(expect), "{what}: expected {expect:?} in: {e}");
        eprintln!("{what}: refused: {}", e.trim());
    }
    // An archive with a `..` name.
    let mut w = TarWriter::new(Vec::new());
    let mut h = Header::new("../oci-layout", EntryType::File);
    h.size = 2;
    w.append(&h).unwrap();
    w.data(b"{}").unwrap();
    std::fs::write(t.join("evil.tar"), w.finish().unwrap()).unwrap();
    let e = s.fails(&[
        "image",
        "import",
        p(&t.join("evil.tar")),
        "--name",
        "base/evil:1",
    ]);
    assert!(e.contains("`..`"), "{e}");
    assert_eq!(s.layers(), before, "nothing pushed by a refused import");
}

/// A plain file named like a whiteout in a Strata layer makes export refuse, naming it.
#[test]
fn whiteout_named_files_are_not_exported() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let s = Strata::new(t);
    for (i, name) in [".wh.secret", "dir/.wh..wh..opq"].iter().enumerate() {
        let src = t.join(format!("src{i}"));
        write(&src.join("ok"), b"fine");
        write(&src.join(name), b"not a whiteout");
        let layer = format!("workspace/wh{i}:1");
        s.ok(&["layer", "build", p(&src), "--name", &layer]);
        let out = t.join(format!("out{i}"));
        let e = s.fails(&["layer", "export", &layer, "--oci", p(&out)]);
        assert!(
            e.contains(&format!("\"/{name}\"")) && e.contains("whiteout"),
            "{e}"
        );
        assert!(!out.exists(), "nothing written");
        let e = s.fails(&["layer", "export", &layer, "--erofs", p(&t.join("x.erofs"))]);
        assert!(e.contains(name), "{e}");
    }
}
