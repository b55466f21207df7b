//! `pack-diff` and `fork` on the real Debian stack: an agent-like build session (a real
//! `.deb` made with `dpkg-deb` and installed with the sandbox's own `dpkg -i`, whose
//! maintainer script adds a system user; caches, histories, an apt download left behind;
//! copy-ups that change nothing), packed, then the parents + the new layer mounted on their
//! own and compared with the builder's tree attribute by attribute; secrets planted by the
//! builder refuse the pack; a paused sandbox packs and stays paused; a fork into 8.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;

use super::{ready, run_ok, Node, BASE, TOOLKIT, WORKSPACE};

/// One entry of a tree, every attribute a reader can see.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
    /// Directories' mtimes are kept apart (see `compare`).
    mtime: (i64, i64),
    size: u64,
    nlink: u64,
    target: Option<PathBuf>,
    digest: Option<String>,
    xattrs: Vec<(String, Vec<u8>)>,
}

fn xattrs(p: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names = vec![0u8; 64 << 10];
    let n = rustix::fs::llistxattr(p, &mut names[..]).unwrap_or(0);
    let mut out = Vec::new();
    for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name = String::from_utf8_lossy(name).into_owned();
        let mut v = vec![0u8; 64 << 10];
        let k = rustix::fs::lgetxattr(p, name.as_str(), &mut v[..]).unwrap_or(0);
        v.truncate(k);
        out.push((name, v));
    }
    out.sort();
    out
}

/// Every entry under `root` (not crossing mounts), by path from the root.
fn tree(root: &Path) -> BTreeMap<String, Entry> {
    let dev = std::fs::symlink_metadata(root).unwrap().dev();
    let mut out = BTreeMap::new();
    let mut todo = vec![PathBuf::from("/")];
    while let Some(rel) = todo.pop() {
        let p = root.join(rel.strip_prefix("/").unwrap());
        let m = std::fs::symlink_metadata(&p).unwrap();
        let ft = m.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_file() {
            "file"
        } else if ft.is_symlink() {
            "symlink"
        } else {
            "special"
        };
        let digest = ft.is_file().then(|| {
            blake3::hash(&std::fs::read(&p).unwrap())
                .to_hex()
                .to_string()
        });
        let target = ft.is_symlink().then(|| std::fs::read_link(&p).unwrap());
        out.insert(
            rel.display().to_string(),
            Entry {
                kind,
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                mtime: (m.mtime(), m.mtime_nsec()),
                size: if ft.is_dir() { 0 } else { m.size() },
                nlink: if ft.is_dir() { 0 } else { m.nlink() },
                target,
                digest,
                xattrs: xattrs(&p),
            },
        );
        if ft.is_dir() && m.dev() == dev {
            for e in std::fs::read_dir(&p).unwrap() {
                todo.push(rel.join(e.unwrap().file_name()));
            }
        }
    }
    out
}

/// `got` (the stack plus the packed layer) against `want` (the builder's tree): identical
/// but for the stripped paths (and what is under them) and the mtimes of directories the
/// pack dropped as unchanged. Returns how many entries were compared.
fn compare(
    want: &BTreeMap<String, Entry>,
    got: &BTreeMap<String, Entry>,
    r: &serde_json::Value,
) -> usize {
    let list = |k: &str| -> Vec<String> {
        r[k].as_array()
            .unwrap()
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| v["path"].as_str().unwrap().to_owned())
            })
            .collect()
    };
    let stripped = list("stripped");
    let unchanged = list("unchanged");
    let is_stripped = |p: &str| {
        stripped
            .iter()
            .any(|s| p == s || p.starts_with(&format!("{s}/")))
    };
    let mut diffs = Vec::new();
    let mut compared = 0;
    for (p, w) in want {
        if is_stripped(p) {
            continue;
        }
        compared += 1;
        match got.get(p) {
            None => diffs.push(format!("{p}: missing from the stack")),
            Some(g) => {
                let mut w = w.clone();
                if w.kind == "dir" && unchanged.contains(p) {
                    w.mtime = g.mtime;
                }
                if *g != w {
                    diffs.push(format!("{p}: builder {w:?}, stack {g:?}"));
                }
            }
        }
    }
    for p in got.keys() {
        if !want.contains_key(p) && !is_stripped(p) {
            diffs.push(format!("{p}: only in the stack"));
        }
    }
    assert!(
        diffs.is_empty(),
        "{} differences:\n{}",
        diffs.len(),
        diffs.join("\n")
    );
    compared
}

/// A real Debian package: a tool, a conffile, docs, and a postinst that adds a system user.
fn make_deb(dir: &Path) -> PathBuf {
    let root = dir.join("greet");
    for d in ["DEBIAN", "usr/bin", "etc/ssh", "usr/share/doc/greet"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let write = |p: &str, text: &str, mode: u32| {
        let f = root.join(p);
        std::fs::write(&f, text).unwrap();
        std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    };
    write(
        "DEBIAN/control",
        "Package: greet\nVersion: 1.0\nArchitecture: all\nMaintainer: Strata tests <t@localhost>\nDescription: a greeting\n",
        0o644,
    );
    write("DEBIAN/conffiles", "/etc/greet.conf\n", 0o644);
    write(
        "DEBIAN/postinst",
        "#!/bin/sh\nset -e\nuseradd --system --no-create-home greeter\n",
        0o755,
    );
    write(
        "usr/bin/greet",
        "#!/bin/sh\n. /etc/greet.conf\necho \"$GREETING\"\n",
        0o755,
    );
    write("etc/greet.conf", "GREETING='hello from greet'\n", 0o644);
    // An SSH server's configuration and a stand-in for its key generator (the base has no
    // OpenSSH): what the runtime must run for every sandbox of a stack without host keys.
    write("etc/ssh/sshd_config", "Port 22\n", 0o644);
    write(
        "usr/bin/ssh-keygen",
        "#!/bin/sh\n[ \"$1\" = -A ] || exit 2\nfor t in ed25519 rsa; do\n  od -An -N16 -tx1 /dev/urandom > /etc/ssh/ssh_host_${t}_key\ndone\n",
        0o755,
    );
    write("usr/share/doc/greet/README", "greet: says hello\n", 0o644);
    let deb = dir.join("greet_1.0_all.deb");
    let mut c = Command::new("dpkg-deb");
    c.args(["--root-owner-group", "--build"])
        .arg(&root)
        .arg(&deb);
    run_ok(c);
    deb
}

fn pack(node: &Node, id: &str, name: &str) -> serde_json::Value {
    node.json(&["pack-diff", id, "--name", name])
}

#[test]
fn a_build_session_packs_into_a_layer_that_stacks_back_to_the_same_tree() {
    if !ready("a_build_session_packs_into_a_layer_that_stacks_back_to_the_same_tree") {
        return;
    }
    let node = Node::new("pack");
    let secret = "s3cr3t-REFERENCE-answer-42";
    let id = node.create(
        "builder",
        &[
            "--secret",
            &format!("answer={secret}"),
            "--secret-env",
            "answer",
        ],
    );
    assert_eq!(node.sh_ok(&id, "echo \"$answer\""), format!("{secret}\n"));
    let deb = make_deb(node.tmp.path());
    node.ok(&[
        "sandbox",
        "cp",
        deb.to_str().unwrap(),
        &format!("{id}:/root/greet.deb"),
    ]);
    // The session: install, configure, compile-like output, and the residue of all that.
    node.sh_ok(
        &id,
        "set -e
         dpkg -i /root/greet.deb
         mkdir -p /srv/app/lib /var/cache/apt/archives/partial /root/.cache/pip/wheels
         mv /root/greet.deb /var/cache/apt/archives/greet_1.0_all.deb
         echo 'Package: greet' > /var/lib/apt/lists/local_Packages
         echo built > /srv/app/lib/out.o
         printf '\\000\\001binary' > /srv/app/blob.bin
         ln -s lib/out.o /srv/app/link
         ln /srv/app/lib/out.o /srv/app/hardlink.o
         mkfifo /srv/app/fifo
         echo wheel > /root/.cache/pip/wheels/w.whl
         mkdir -p /srv/app/__pycache__ && echo pyc > /srv/app/__pycache__/m.pyc
         echo 'dpkg -i greet.deb' > /root/.bash_history
         echo swap > /srv/app/.notes.swp
         echo tmp > /var/tmp/scratch
         rm /etc/issue.net
         rm -r /usr/share/doc/debconf
         mkdir -p /opt/fresh && rm -rf /opt && mkdir -p /opt/only && echo o > /opt/only/f
         mv /etc/motd /etc/motd.x && mv /etc/motd.x /etc/motd
         chmod 600 /etc/debian_version && chmod 644 /etc/debian_version
         touch /srv/.wh.sneaky",
    );
    assert_eq!(node.sh_ok(&id, "greet"), "hello from greet\n");
    // As an SSH server's installation would: host keys of the builder's own.
    node.sh_ok(&id, "ssh-keygen -A");
    let builder_key = node.sh_ok(&id, "cat /etc/ssh/ssh_host_ed25519_key");
    let inspect = node.json(&["sandbox", "inspect", &id]);
    let builder_root = PathBuf::from(inspect["rootfs"].as_str().unwrap());
    let builder_id = node.sh_ok(&id, "cat /etc/machine-id");

    // A secret in a packed file refuses the pack, naming the file; nothing is pushed.
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("key={secret};"));
    node.sh_ok(
        &id,
        &format!(
            "echo {b64} > /srv/app/config.b64; cp /run/secrets/answer /srv/app/raw; \
             echo \"token=$answer\" > /srv/app/from-env"
        ),
    );
    let out = node
        .cmd()
        .args(["pack-diff", &id, "--name", "toolkit/greet:1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a pack with the secret inside succeeded"
    );
    for f in ["/srv/app/config.b64", "/srv/app/raw", "/srv/app/from-env"] {
        assert!(err.contains(f), "the refusal does not name {f}: {err}");
    }
    let layers = node.ok(&["layer", "ls"]);
    assert!(!layers.contains("toolkit/greet"), "{layers}");
    node.sh_ok(&id, "rm /srv/app/config.b64 /srv/app/raw /srv/app/from-env");

    // Packed while running: frozen for the pack, thawed after.
    let want = tree(&builder_root);
    let r = pack(&node, &id, "toolkit/greet:1");
    assert!(r["frozen_ms"].as_u64().is_some(), "{r}");
    assert_eq!(
        r["parents"],
        serde_json::json!([BASE, WORKSPACE, TOOLKIT]),
        "{r}"
    );
    assert_eq!(node.sh_ok(&id, "echo thawed"), "thawed\n");
    let stripped: Vec<&str> = r["stripped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["path"].as_str().unwrap())
        .collect();
    for p in [
        "/var/cache/apt/archives/greet_1.0_all.deb",
        "/var/lib/apt/lists/local_Packages",
        "/root/.cache",
        "/srv/app/__pycache__",
        "/root/.bash_history",
        "/srv/app/.notes.swp",
        "/var/tmp/scratch",
        "/etc/machine-id",
        "/run/secrets",
        "/etc/ssh/ssh_host_ed25519_key",
        "/etc/ssh/ssh_host_rsa_key",
    ] {
        assert!(stripped.contains(&p), "{p} not stripped: {stripped:?}");
    }
    let unchanged: Vec<&str> = r["unchanged"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    for p in ["/etc/motd", "/etc/debian_version"] {
        assert!(
            unchanged.contains(&p),
            "{p} not dropped as unchanged: {unchanged:?}"
        );
    }
    assert_eq!(
        r["disguised_whiteouts"],
        serde_json::json!(["/srv/.wh.sneaky"])
    );
    assert!(r["whiteouts"].as_u64().unwrap() >= 2, "{r}");
    assert!(r["opaque_dirs"].as_u64().unwrap() >= 1, "{r}");
    let m: serde_json::Value =
        serde_json::from_str(&node.ok(&["--json", "layer", "inspect", "toolkit/greet:1"])).unwrap();
    let text = m.to_string();
    assert!(text.contains(&format!("\"sandbox\":\"{id}\"")), "{text}");
    assert!(text.contains(builder_id.trim()), "{text}");
    assert!(text.contains("\"answer\""), "the secret's name: {text}");
    assert!(
        !text.contains(secret),
        "the secret's value is in the manifest"
    );

    // The parents + the new layer, mounted on their own, are the builder's tree.
    let mnt = node.tmp.path().join("stack");
    std::fs::create_dir(&mnt).unwrap();
    node.ok(&[
        "mount",
        BASE,
        WORKSPACE,
        TOOLKIT,
        "toolkit/greet:1",
        mnt.to_str().unwrap(),
    ]);
    let got = tree(&mnt);
    node.ok(&["umount", mnt.to_str().unwrap()]);
    let n = compare(&want, &got, &r);
    assert!(n > 5000, "compared only {n} entries");
    // What was stripped is not in the layer (the stack never had these).
    for p in [
        "/root/.bash_history",
        "/var/tmp/scratch",
        "/srv/app/__pycache__",
        "/srv/app/.notes.swp",
        "/var/cache/apt/archives/greet_1.0_all.deb",
        "/var/lib/apt/lists/local_Packages",
        "/etc/machine-id",
        "/run/secrets",
        "/etc/ssh/ssh_host_ed25519_key",
    ] {
        assert!(!got.contains_key(p), "{p} is in the packed stack");
        assert!(want.contains_key(p), "{p} was not in the builder's tree");
    }

    // The `.wh.` name pack-diff reported makes an OCI export of the layer refuse, naming it.
    let oci = node.tmp.path().join("oci");
    let out = node
        .cmd()
        .args(["layer", "export", "toolkit/greet:1", "--oci"])
        .arg(&oci)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the export of a disguised whiteout succeeded"
    );
    assert!(
        err.contains("/srv/.wh.sneaky") || err.contains("srv/.wh.sneaky"),
        "{err}"
    );

    // A sandbox from the new layer alone has its whole stack, its own identity, no secret.
    let user = node
        .ok(&[
            "sandbox",
            "create",
            "--layer",
            "toolkit/greet:1",
            "--id",
            "user",
        ])
        .trim()
        .to_owned();
    assert_eq!(node.sh_ok(&user, "greet"), "hello from greet\n");
    assert_eq!(
        node.sh_ok(&user, "id -u greeter >/dev/null && echo yes"),
        "yes\n"
    );
    assert_eq!(node.sh_ok(&user, "cat /work/TASK"), "make the tests pass\n");
    assert_eq!(
        node.sh_ok(&user, "echo \"[$answer]\""),
        "[]\n",
        "the builder's env secret"
    );
    assert_eq!(
        node.sh_ok(
            &user,
            "test -e /run/secrets/answer || echo none; ls /srv/app"
        ),
        "none\nblob.bin\nfifo\nhardlink.o\nlib\nlink\n"
    );
    let user_key = node.sh_ok(&user, "cat /etc/ssh/ssh_host_ed25519_key");
    assert_eq!(user_key.trim().len(), 47, "{user_key:?}");
    assert_ne!(
        user_key, builder_key,
        "the builder's host key reached a sandbox of its layer"
    );
    let user_id = node.sh_ok(&user, "cat /etc/machine-id");
    assert_ne!(user_id, builder_id);
    assert_eq!(user_id.trim().len(), 32);
    let info = node.json(&["sandbox", "inspect", &user]);
    assert_eq!(
        info["layers"],
        serde_json::json!([BASE, WORKSPACE, TOOLKIT, "toolkit/greet:1"])
    );

    // A paused sandbox is packed as it is and stays paused.
    node.ok(&["sandbox", "pause", &id]);
    let r2 = pack(&node, &id, "toolkit/greet:2");
    assert!(r2["frozen_ms"].is_null(), "{r2}");
    let state = node.json(&["sandbox", "inspect", &id]);
    assert_eq!(state["state"], "paused");
    node.ok(&["sandbox", "resume", &id]);
}

#[test]
fn a_fork_makes_eight_sandboxes_with_their_own_upper_and_identity() {
    if !ready("a_fork_makes_eight_sandboxes_with_their_own_upper_and_identity") {
        return;
    }
    let node = Node::new("fork");
    let id = node.create("origin", &["--env", "ROLE=worker"]);
    node.sh_ok(&id, "mkdir -p /srv/state && echo 41 > /srv/state/n");
    let f = node.json(&["sandbox", "fork", &id, "--count", "8"]);
    let forks: Vec<String> = f["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(forks.len(), 8, "{f}");
    let layer = f["pack"]["layer"].as_str().unwrap();
    assert!(
        layer.starts_with(&format!("snapshot/fork-{id}:")),
        "{layer}"
    );
    let mut ids = std::collections::HashSet::new();
    for (i, s) in forks.iter().enumerate() {
        assert_eq!(
            node.sh_ok(s, "cat /srv/state/n; echo $ROLE"),
            "41\nworker\n"
        );
        node.sh_ok(s, &format!("echo {i} > /srv/state/n"));
        assert!(
            ids.insert(node.sh_ok(s, "cat /etc/machine-id")),
            "a machine id repeats"
        );
    }
    for (i, s) in forks.iter().enumerate() {
        assert_eq!(node.sh_ok(s, "cat /srv/state/n"), format!("{i}\n"));
    }
    assert_eq!(node.sh_ok(&id, "cat /srv/state/n"), "41\n");
    assert!(!ids.contains(&node.sh_ok(&id, "cat /etc/machine-id")));
}
