//! Starting commands through a sandbox's own init (`init/strata-init.c`): no OCI runtime
//! process per exec.
//!
//! The init is the sandbox's PID 1, set up by runc like any container process (namespaces,
//! cgroups, capabilities, seccomp, rlimits), so what it forks inherits exactly that. It
//! listens on `/dev/.strata/ctl` inside the sandbox and serves only peers outside the
//! sandbox's PID namespace; the daemon reaches it through `/proc/<init>/root/dev/.strata/ctl`.
//! One connection starts one command: a spawn message with the command's three stdio
//! descriptors (SCM_RIGHTS), then `P` (its pid) or `E` (an errno), later `X` (its wait
//! status). The wire format is in the C file's header.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;

use rustix::net::{
    AddressFamily, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The init binary, built static from `init/strata-init.c` by `build.rs`.
pub const INIT_BINARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/strata-init"));

/// The largest spawn message the init takes.
const MAX_MSG: usize = 256 * 1024;

/// Write the init binary to `<dir>/.strata-init` (0755, atomically, only if it differs);
/// its path, for the bundles to bind.
pub fn install_init(dir: &std::path::Path) -> io::Result<PathBuf> {
    let path = dir.join(".strata-init");
    if std::fs::read(&path).ok().as_deref() != Some(INIT_BINARY) {
        fs_cache::write_atomic(&path, INIT_BINARY)?;
    }
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    Ok(path)
}

/// Where the daemon reaches the init of the sandbox whose init has host pid `init_pid`.
pub fn ctl_path(init_pid: u32) -> PathBuf {
    PathBuf::from(format!("/proc/{init_pid}/root/dev/.strata/ctl"))
}

/// What to start.
#[derive(Debug)]
pub struct Spawn<'a> {
    pub args: &'a [String],
    /// The whole environment (the sandbox's and the exec's).
    pub env: &'a [String],
    pub cwd: &'a str,
    pub uid: u32,
    pub gid: u32,
    /// stdin is a terminal's slave: make it the controlling terminal of the command's
    /// session.
    pub tty: bool,
}

/// Spawn flag: stdin is the command's controlling terminal.
const SPAWN_TTY: u32 = 1;

/// Why a spawn did not happen.
#[derive(Debug)]
pub enum SpawnError {
    /// No init of ours answers (an older sandbox's init, or it is gone): use the runtime.
    Unreachable(io::Error),
    /// The init could not start the command (the errno: ENOENT for a missing binary, …).
    Refused(i32),
    /// The request cannot be sent (too large, a NUL inside).
    Invalid(String),
}

/// A command the init started.
#[derive(Debug)]
pub struct Running {
    fd: AsyncFd<OwnedFd>,
    /// Its pid inside the sandbox.
    pub pid: i32,
}

fn encode(s: &Spawn<'_>) -> Result<Vec<u8>, SpawnError> {
    let mut m = vec![b'S', 0, 0, 0];
    let flags = if s.tty { SPAWN_TTY } else { 0 };
    for v in [s.uid, s.gid, s.args.len() as u32, s.env.len() as u32, flags] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    for part in std::iter::once(s.cwd)
        .chain(s.args.iter().map(String::as_str))
        .chain(s.env.iter().map(String::as_str))
    {
        if part.contains('\0') {
            return Err(SpawnError::Invalid(format!("{part:?} holds a NUL byte")));
        }
        m.extend_from_slice(part.as_bytes());
        m.push(0);
    }
    if m.len() > MAX_MSG {
        return Err(SpawnError::Invalid(format!(
            "the command and its environment are {} bytes, more than {MAX_MSG}",
            m.len()
        )));
    }
    Ok(m)
}

fn reply(fd: BorrowedFd<'_>, flags: RecvFlags) -> io::Result<Option<(u8, i32)>> {
    let mut b = [0u8; 8];
    let (n, _) = rustix::net::recv(fd, &mut b, flags).map_err(io::Error::from)?;
    if n == 0 {
        return Ok(None);
    }
    if n != 8 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {n}-byte message from the sandbox's init"),
        ));
    }
    Ok(Some((b[0], i32::from_le_bytes([b[4], b[5], b[6], b[7]]))))
}

/// Start `s` in the sandbox whose init has host pid `init_pid`, with `stdio` as its stdin,
/// stdout and stderr. Blocking (a connect, a send, one short answer): call it off the
/// async threads.
pub fn spawn(
    init_pid: u32,
    s: &Spawn<'_>,
    stdio: [BorrowedFd<'_>; 3],
) -> Result<Running, SpawnError> {
    let msg = encode(s)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| SpawnError::Unreachable(e.into()))?;
    let addr =
        SocketAddrUnix::new(ctl_path(init_pid)).map_err(|e| SpawnError::Unreachable(e.into()))?;
    rustix::net::connect(&fd, &addr).map_err(|e| SpawnError::Unreachable(e.into()))?;
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if !anc.push(SendAncillaryMessage::ScmRights(&stdio)) {
        return Err(SpawnError::Invalid("no room for three descriptors".into()));
    }
    let iov = [io::IoSlice::new(&msg)];
    rustix::net::sendmsg(&fd, &iov, &mut anc, SendFlags::NOSIGNAL)
        .map_err(|e| SpawnError::Unreachable(e.into()))?;
    match reply(fd.as_fd(), RecvFlags::empty()) {
        Ok(Some((b'P', pid))) => {
            rustix::io::ioctl_fionbio(&fd, true).map_err(|e| SpawnError::Unreachable(e.into()))?;
            // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays open and names
            // the same socket for as long as the AsyncFd lives.
            let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| SpawnError::Unreachable(io::Error::from(e)))?;
            Ok(Running { fd, pid })
        }
        Ok(Some((b'E', errno))) => Err(SpawnError::Refused(errno)),
        // Closed without a word: a refusal by peer check (we are inside?) or a bad message.
        Ok(_) => Err(SpawnError::Unreachable(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "the sandbox's init closed the connection",
        ))),
        Err(e) => Err(SpawnError::Unreachable(e)),
    }
}

impl Running {
    /// Wait for the command's end: its wait status (`None`: the init went away first).
    pub async fn wait(&self) -> io::Result<Option<i32>> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| reply(fd.get_ref().as_fd(), RecvFlags::DONTWAIT)) {
                Ok(Ok(Some((b'X', status)))) => return Ok(Some(status)),
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => return Ok(None),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Send `signal` to the command's process group.
    pub fn kill(&self, signal: i32) -> io::Result<()> {
        let mut m = vec![b'K', 0, 0, 0];
        m.extend_from_slice(&signal.to_le_bytes());
        rustix::net::send(
            self.fd.get_ref(),
            &m,
            SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        )
        .map(|_| ())
        .map_err(io::Error::from)
    }
}

/// The host pid of the process with pid `ns_pid` in the PID namespace of host process
/// `init_pid` (from `/proc/*/status`'s `NSpid`), if it still runs.
pub fn host_pid(init_pid: u32, ns_pid: i32) -> Option<i32> {
    let ns = std::fs::read_link(format!("/proc/{init_pid}/ns/pid")).ok()?;
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{p}/status")) else {
            continue;
        };
        let last = status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|v| v.split_whitespace().last()?.parse::<i32>().ok());
        if last == Some(ns_pid)
            && std::fs::read_link(format!("/proc/{p}/ns/pid"))
                .ok()
                .as_ref()
                == Some(&ns)
        {
            return Some(p);
        }
    }
    None
}

/// A pipe: (read end, write end), both close-on-exec.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_messages_are_as_the_init_reads_them() {
        let args = ["sh".to_owned(), "-c".to_owned(), "echo hi".to_owned()];
        let env = ["A=1".to_owned()];
        let m = encode(&Spawn {
            args: &args,
            env: &env,
            cwd: "/w",
            uid: 65534,
            gid: 7,
            tty: true,
        })
        .unwrap();
        assert_eq!(&m[..4], b"S\0\0\0");
        assert_eq!(u32::from_le_bytes(m[4..8].try_into().unwrap()), 65534);
        assert_eq!(u32::from_le_bytes(m[8..12].try_into().unwrap()), 7);
        assert_eq!(u32::from_le_bytes(m[12..16].try_into().unwrap()), 3);
        assert_eq!(u32::from_le_bytes(m[16..20].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(m[20..24].try_into().unwrap()), SPAWN_TTY);
        assert_eq!(&m[24..], b"/w\0sh\0-c\0echo hi\0A=1\0");
        let bad = ["a\0b".to_owned()];
        assert!(matches!(
            encode(&Spawn {
                args: &bad,
                env: &[],
                cwd: "/",
                uid: 0,
                gid: 0,
                tty: false,
            }),
            Err(SpawnError::Invalid(_))
        ));
        assert!(!INIT_BINARY.is_empty());
    }
}
