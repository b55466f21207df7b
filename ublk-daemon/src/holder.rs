//! The fd holder: a second, minimal process that keeps the node's `/dev/fuse` connections
//! open while the daemon that serves them crashes, is killed or is upgraded.
//!
//! A FUSE connection lives as long as one descriptor of its device file is open. The daemon
//! hands every connection it opens to the holder (before mounting), with a small text of
//! metadata (what the connection is, and the INIT values agreed, saved before the first
//! request is answered); a daemon that starts asks the holder for what it holds and resumes
//! those connections instead of mounting anew (`crate::fuse::session`). The holder does
//! nothing else: it never reads a request, allocates only per message, and has no other
//! code path that could take it down with the daemon's bugs. It runs in its own session
//! (`setsid`), so a signal to the daemon's process group does not reach it.
//!
//! ## Protocol
//! `<run-dir>/holder.sock`, `SOCK_SEQPACKET`, mode 0600; one JSON object per message, the
//! descriptors as `SCM_RIGHTS` of that message. Every request gets one answer
//! `{"ok":true,…}` or `{"ok":false,"error":"…"}`:
//!
//! | request | descriptors | answer |
//! | --- | --- | --- |
//! | `{"op":"put","name":N,"meta":M}` | 1 | replaces entry `N` |
//! | `{"op":"meta","name":N,"meta":M}` | — | updates `N`'s metadata |
//! | `{"op":"list"}` | — | `{"entries":[{"name","meta"},…]}` with one descriptor each |
//! | `{"op":"drop","name":N}` | — | closes `N` |
//! | `{"op":"ping"}` | — | `{"pid":P}` |
//! | `{"op":"quit"}` | — | closes everything and exits |
//!
//! ## Invariants
//! - One holder per run directory (`flock` on `holder.lock`).
//! - An entry whose connection ends (the device reports `POLLERR`: unmounted or aborted) is
//!   closed and forgotten; nothing else removes an entry but `drop` and `quit`.
//! - The holder exits when it holds nothing and no daemon is connected (after the first one
//!   connected), or 60 s after its start if no daemon ever connects.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};

/// The most descriptors one holder keeps (and one `list` answer carries).
pub const MAX_ENTRIES: usize = 64;
const MAX_MESSAGE: usize = 256 << 10;
const IDLE_EXIT: Duration = Duration::from_secs(60);

/// The holder's socket in `run_dir`.
pub fn socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join("holder.sock")
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Req {
    Put { name: String, meta: String },
    Meta { name: String, meta: String },
    List,
    Drop { name: String },
    Ping,
    Quit,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Resp {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    entries: Vec<Listed>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pid: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Listed {
    name: String,
    meta: String,
}

/// One descriptor the holder keeps.
#[derive(Debug)]
pub struct Held {
    pub name: String,
    pub meta: String,
    pub fd: OwnedFd,
}

fn send(sock: BorrowedFd<'_>, body: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_ENTRIES))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    let n = rustix::net::sendmsg(
        sock,
        &[IoSlice::new(body)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if n != body.len() {
        return Err(io::Error::other("short send on the holder socket"));
    }
    Ok(())
}

/// Receive one message; `Ok(None)` at end of stream.
fn recv(sock: BorrowedFd<'_>) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_ENTRIES))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    if msg.bytes > buf.len() || msg.flags.contains(rustix::net::ReturnFlags::TRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message too long",
        ));
    }
    buf.truncate(msg.bytes);
    Ok(Some((buf, fds)))
}

/// A daemon's connection to the holder.
#[derive(Debug)]
pub struct HolderClient {
    /// One request and its answer at a time.
    sock: std::sync::Mutex<OwnedFd>,
    path: PathBuf,
}

impl HolderClient {
    /// Connect to the holder of `run_dir`, if one runs.
    pub fn connect(run_dir: &Path) -> io::Result<HolderClient> {
        let path = socket_path(run_dir);
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        rustix::net::connect(&sock, &SocketAddrUnix::new(&path)?)?;
        rustix::net::sockopt::set_socket_timeout(
            &sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_secs(10)),
        )?;
        Ok(HolderClient {
            sock: std::sync::Mutex::new(sock),
            path,
        })
    }

    /// Connect to the holder of `run_dir`, starting one with `command` (program and
    /// arguments; `--run-dir DIR` is appended) if none answers. The holder runs in its own
    /// session and writes to `<run-dir>/holder.log`.
    pub fn connect_or_spawn(run_dir: &Path, command: &[std::ffi::OsString]) -> io::Result<Self> {
        if let Ok(c) = Self::connect(run_dir) {
            if c.ping().is_ok() {
                return Ok(c);
            }
        }
        let (program, args) = command
            .split_first()
            .ok_or_else(|| io::Error::other("no fd-holder command configured"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(run_dir.join("holder.log"))?;
        let mut cmd = std::process::Command::new(program);
        cmd.args(args)
            .arg("--run-dir")
            .arg(run_dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log);
        // SAFETY: the closure runs in the forked child before exec and calls only setsid(2),
        // which is async-signal-safe.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                rustix::process::setsid()?;
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(c) = Self::connect(run_dir) {
                if c.ping().is_ok() {
                    // The holder outlives us; reap it if it exits while we run.
                    std::thread::spawn(move || child.wait());
                    return Ok(c);
                }
            }
            if let Some(status) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "the fd holder exited at start ({status}); see {}",
                    run_dir.join("holder.log").display()
                )));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the fd holder did not answer within 10 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn call(&self, req: &Req, fds: &[BorrowedFd<'_>]) -> io::Result<(Resp, Vec<OwnedFd>)> {
        let body = serde_json::to_vec(req).map_err(io::Error::other)?;
        // A panic while holding the lock cannot leave the socket half-used in a way a later
        // call would misread more than an I/O error would.
        let sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        send(sock.as_fd(), &body, fds)?;
        let (bytes, fds) = recv(sock.as_fd())?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the fd holder at {} closed the connection",
                    self.path.display()
                ),
            )
        })?;
        let resp: Resp = serde_json::from_slice(&bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if !resp.ok {
            return Err(io::Error::other(format!(
                "fd holder: {}",
                resp.error.as_deref().unwrap_or("failed")
            )));
        }
        Ok((resp, fds))
    }

    /// The holder's pid.
    pub fn ping(&self) -> io::Result<u32> {
        Ok(self.call(&Req::Ping, &[])?.0.pid.unwrap_or(0))
    }

    /// Keep (a duplicate of) `fd` as `name`, with `meta`.
    pub fn put(&self, name: &str, meta: &str, fd: BorrowedFd<'_>) -> io::Result<()> {
        let req = Req::Put {
            name: name.into(),
            meta: meta.into(),
        };
        self.call(&req, &[fd]).map(drop)
    }

    /// Replace `name`'s metadata.
    pub fn set_meta(&self, name: &str, meta: &str) -> io::Result<()> {
        let req = Req::Meta {
            name: name.into(),
            meta: meta.into(),
        };
        self.call(&req, &[]).map(drop)
    }

    /// Everything the holder keeps (duplicates of its descriptors; it keeps its own).
    pub fn list(&self) -> io::Result<Vec<Held>> {
        let (resp, fds) = self.call(&Req::List, &[])?;
        if fds.len() != resp.entries.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "fd holder listed {} entries with {} descriptors",
                    resp.entries.len(),
                    fds.len()
                ),
            ));
        }
        Ok(resp
            .entries
            .into_iter()
            .zip(fds)
            .map(|(l, fd)| Held {
                name: l.name,
                meta: l.meta,
                fd,
            })
            .collect())
    }

    /// Close `name` in the holder (its connection ends once no one else has it open).
    pub fn drop_entry(&self, name: &str) -> io::Result<()> {
        self.call(&Req::Drop { name: name.into() }, &[]).map(drop)
    }

    /// Close everything and make the holder exit.
    pub fn quit(&self) -> io::Result<()> {
        self.call(&Req::Quit, &[]).map(drop)
    }
}

/// Run the holder for `run_dir` until it has nothing left to hold (see the module docs).
/// Returns when it exits normally; an error if it cannot start (another holder runs, the
/// socket cannot be bound).
pub fn run(run_dir: &Path) -> io::Result<()> {
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(run_dir.join("holder.lock"))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
        |e| {
            io::Error::other(format!(
                "another fd holder runs on {}: {e}",
                run_dir.display()
            ))
        },
    )?;
    let path = socket_path(run_dir);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::bind(&listener, &SocketAddrUnix::new(&path)?)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    rustix::net::listen(&listener, 16)?;
    let me = rustix::process::geteuid();
    eprintln!(
        "strata fd holder {}: holding for {}",
        std::process::id(),
        run_dir.display()
    );

    let started = Instant::now();
    let mut ever_connected = false;
    let mut clients: Vec<OwnedFd> = Vec::new();
    let mut entries: Vec<Held> = Vec::new();
    loop {
        if ever_connected && clients.is_empty() && entries.is_empty() {
            eprintln!("strata fd holder: nothing left to hold; exiting");
            break;
        }
        if !ever_connected && started.elapsed() > IDLE_EXIT {
            eprintln!("strata fd holder: no daemon connected; exiting");
            break;
        }
        let mut pfds: Vec<PollFd<'_>> = Vec::with_capacity(1 + clients.len() + entries.len());
        pfds.push(PollFd::new(&listener, PollFlags::IN));
        for c in &clients {
            pfds.push(PollFd::new(c, PollFlags::IN));
        }
        for e in &entries {
            // No IN: the holder never reads requests; it is told only of errors and hangups.
            pfds.push(PollFd::new(&e.fd, PollFlags::empty()));
        }
        let timeout = rustix::time::Timespec {
            tv_sec: 5,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut pfds, Some(&timeout)) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let revents: Vec<PollFlags> = pfds.iter().map(PollFd::revents).collect();
        drop(pfds);
        let listener_ev = revents.first().copied().unwrap_or_else(PollFlags::empty);
        let rest = revents.get(1..).unwrap_or_default();
        let (client_ev, entry_ev) = rest.split_at(clients.len().min(rest.len()));

        // Connections that ended: close them.
        let mut i = entries.len();
        while i > 0 {
            i -= 1;
            if entry_ev
                .get(i)
                .is_some_and(|f| f.intersects(PollFlags::ERR | PollFlags::HUP))
            {
                let e = entries.remove(i);
                eprintln!("strata fd holder: connection {} ended; closed", e.name);
            }
        }
        let mut quit = false;
        let mut i = clients.len();
        while i > 0 {
            i -= 1;
            let ev = client_ev.get(i).copied().unwrap_or_else(PollFlags::empty);
            if ev.is_empty() {
                continue;
            }
            match serve_one(clients[i].as_fd(), &mut entries) {
                Ok(Some(true)) => quit = true,
                Ok(Some(false)) => {}
                Ok(None) | Err(_) => {
                    clients.remove(i);
                }
            }
        }
        if quit {
            eprintln!("strata fd holder: told to quit");
            break;
        }
        if listener_ev.contains(PollFlags::IN) {
            if let Ok(c) = rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
                // Root (or the holder's own user) only, like the daemon's socket.
                let allowed = rustix::net::sockopt::socket_peercred(&c)
                    .map(|cred| cred.uid.is_root() || cred.uid == me)
                    .unwrap_or(false);
                if allowed {
                    ever_connected = true;
                    clients.push(c);
                }
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// Serve one request from `client`: `Ok(None)` when it hung up, `Ok(Some(quit))` otherwise.
fn serve_one(client: BorrowedFd<'_>, entries: &mut Vec<Held>) -> io::Result<Option<bool>> {
    let Some((bytes, mut fds)) = recv(client)? else {
        return Ok(None);
    };
    let fail = |msg: String| Resp {
        ok: false,
        error: Some(msg),
        ..Resp::default()
    };
    let ok = Resp {
        ok: true,
        ..Resp::default()
    };
    let mut quit = false;
    let mut out_fds: Vec<BorrowedFd<'_>> = Vec::new();
    let resp = match serde_json::from_slice::<Req>(&bytes) {
        Err(e) => fail(format!("bad request: {e}")),
        Ok(Req::Put { name, meta }) => match (fds.pop(), fds.is_empty()) {
            (Some(fd), true) => {
                entries.retain(|e| e.name != name);
                if entries.len() >= MAX_ENTRIES {
                    fail(format!(
                        "the holder keeps at most {MAX_ENTRIES} descriptors"
                    ))
                } else {
                    entries.push(Held { name, meta, fd });
                    ok
                }
            }
            _ => fail("put takes exactly one descriptor".into()),
        },
        Ok(Req::Meta { name, meta }) => match entries.iter_mut().find(|e| e.name == name) {
            Some(e) => {
                e.meta = meta;
                ok
            }
            None => fail(format!("no entry {name}")),
        },
        Ok(Req::List) => {
            out_fds = entries.iter().map(|e| e.fd.as_fd()).collect();
            Resp {
                ok: true,
                entries: entries
                    .iter()
                    .map(|e| Listed {
                        name: e.name.clone(),
                        meta: e.meta.clone(),
                    })
                    .collect(),
                ..Resp::default()
            }
        }
        Ok(Req::Drop { name }) => {
            entries.retain(|e| e.name != name);
            ok
        }
        Ok(Req::Ping) => Resp {
            ok: true,
            pid: Some(std::process::id()),
            ..Resp::default()
        },
        Ok(Req::Quit) => {
            quit = true;
            ok
        }
    };
    let body = serde_json::to_vec(&resp).map_err(io::Error::other)?;
    send(client, &body, &out_fds)?;
    drop(out_fds);
    if quit {
        entries.clear();
    }
    Ok(Some(quit))
}
