//! A new sandbox's directory, made before its root is mounted: the record, the upper and work
//! directories, the `/etc` files it gets, the secrets' tmpfs.
//!
//! # Invariants
//! - **Off the async workers.** All of it is file system calls (the record's `fsync` among
//!   them), run on the blocking pool ([`prepare`]): a node's async workers are few (one per
//!   CPU) and answer every request of its API; a burst of creates that wrote and synced on
//!   them kept the node's status (and everything else) waiting behind the disk.
//! - **The record first.** The directory is new (an existing one is a conflict, never
//!   reused) and its record (state `creating`) is on disk before anything else is made in
//!   it: a node that dies meanwhile finds the record at its next start and removes the rest.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::manager::{random_hex, save_record, Record};
use crate::quota::UpperFs;
use crate::{Error, Result};

/// What [`prepare`] made.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// Where the root is to be mounted (`bundle/rootfs`).
    pub rootfs: PathBuf,
    /// The sandbox's own `/etc` files (`hostname`, `hosts`, `resolv.conf`, `machine-id`).
    pub etc: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// The secrets' tmpfs, if it has any.
    pub secrets: Option<PathBuf>,
}

/// Make sandbox `id`'s directory `dir` for `record` (see the module's invariants), on the
/// blocking pool.
pub(crate) async fn prepare(
    dir: &Path,
    id: &str,
    record: &Record,
    uppers: Option<Arc<UpperFs>>,
    secrets: &[(String, String)],
) -> Result<Prepared> {
    let (dir, id, record, secrets) = (
        dir.to_owned(),
        id.to_owned(),
        record.clone(),
        secrets.to_vec(),
    );
    tokio::task::spawn_blocking(move || {
        prepare_blocking(&dir, &id, &record, uppers.as_deref(), &secrets)
    })
    .await
    .map_err(|e| Error::Runtime(format!("prepare the sandbox's directory: {e}")))?
}

fn prepare_blocking(
    dir: &Path,
    id: &str,
    record: &Record,
    uppers: Option<&UpperFs>,
    secrets: &[(String, String)],
) -> Result<Prepared> {
    let mk = |p: &Path| {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(p)
            .map_err(|e| Error::io(format!("create {}", p.display()), e))
    };
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(Error::Conflict(format!(
                "{} exists already (leftovers of another sandbox {id}?)",
                dir.display(),
            )))
        }
        Err(e) => return Err(Error::io(format!("create {}", dir.display()), e)),
    }
    save_record(dir, record)?;
    let rootfs = dir.join("bundle/rootfs");
    let etc = dir.join("etc");
    for d in [&rootfs, &etc] {
        mk(d)?;
    }
    let (upper, work) = match uppers {
        Some(u) => u.create(id, record.limits.disk)?,
        None => {
            let (upper, work) = (dir.join("upper"), dir.join("work"));
            mk(&upper)?;
            mk(&work)?;
            (upper, work)
        }
    };
    // The overlay's root takes the upper's mode: the root of a system is 0755.
    std::fs::set_permissions(&upper, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(|e| Error::io(format!("chmod {}", upper.display()), e))?;
    let write = |name: &str, text: String| {
        let p = etc.join(name);
        std::fs::write(&p, text).map_err(|e| Error::io(format!("write {}", p.display()), e))
    };
    write("hostname", format!("{id}\n"))?;
    write(
        "hosts",
        format!(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{id}\n"
        ),
    )?;
    write("resolv.conf", String::new())?;
    // Its own identity: a fresh machine id (systemd's format: 32 lowercase hex digits).
    write("machine-id", format!("{}\n", random_hex(16)))?;
    let secrets = if secrets.is_empty() {
        None
    } else {
        let s = dir.join("secrets");
        mk(&s)?;
        mount_secrets(&s, secrets)?;
        Some(s)
    };
    Ok(Prepared {
        rootfs,
        etc,
        upper,
        work,
        secrets,
    })
}

/// Write `bytes` to `path` (atomically, synced) on the blocking pool.
pub(crate) async fn write_file(path: PathBuf, bytes: Vec<u8>) -> Result<()> {
    tokio::task::spawn_blocking(move || {
        fs_cache::write_atomic(&path, &bytes)
            .map_err(|e| Error::io(format!("write {}", path.display()), e))
    })
    .await
    .map_err(|e| Error::Runtime(format!("write a sandbox's file: {e}")))?
}

/// Mount a small tmpfs at `dir` and write one file per secret (mode 0400).
fn mount_secrets(dir: &Path, secrets: &[(String, String)]) -> Result<()> {
    let total: usize = secrets.iter().map(|(_, v)| v.len()).sum();
    if total > 512 << 10 {
        return Err(Error::Limit("secrets are more than 512 KiB in all".into()));
    }
    rustix::mount::mount(
        "strata-secrets",
        dir,
        "tmpfs",
        rustix::mount::MountFlags::NOSUID
            | rustix::mount::MountFlags::NODEV
            | rustix::mount::MountFlags::NOEXEC,
        c"size=1m,mode=0700",
    )
    .map_err(|e| Error::io(format!("mount a tmpfs on {}", dir.display()), e.into()))?;
    for (name, value) in secrets {
        let p = dir.join(name);
        std::fs::write(&p, value).map_err(|e| Error::io(format!("write {}", p.display()), e))?;
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o400))
            .map_err(|e| Error::io(format!("chmod {}", p.display()), e))?;
    }
    Ok(())
}
