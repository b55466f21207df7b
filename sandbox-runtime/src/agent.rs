//! Starting commands through a sandbox's own init (`init/strata-init.c`): no OCI runtime
//! process per exec, and no exec that depends on the daemon's lifetime.
//!
//! The init is the sandbox's PID 1, set up by runc like any container process (namespaces,
//! cgroups, capabilities, seccomp, rlimits), so what it forks inherits exactly that. Its
//! control socket is bound by the daemon on the host, at `<sandbox dir>/ctl`, and handed to
//! the init as descriptor 3 ([`bind_ctl`]; runc's `--preserve-fds`): it has no path inside
//! the sandbox, and the init, which calls `listen` on it, is the only process the daemon's
//! connections reach — each connection checks that the peer is the sandbox's init
//! (`SO_PEERCRED`). One connection drives one command: a spawn ([`spawn`]) or, after a
//! daemon restart, an attach by the exec's key ([`attach`]); then `O` (the output files
//! grew), `X` (its wait status). The init keeps the command's pipes and copies its output
//! into the exec's files on the host (`crate::exec`), so a daemon that dies loses nothing.
//! The wire format is in the C file's header. Every answer the daemon waits for has a
//! deadline ([`ANSWER_WITHIN`]): an init that is stopped, hung or replaced makes the exec
//! fail with a clear error instead of holding the sandbox.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
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

/// How long the daemon waits for the init's answer to a spawn or an attach.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// The control socket's name in the sandbox's directory (on the host).
pub const CTL: &str = "ctl";

/// Bind the control socket of a sandbox whose directory is `dir` (not listening: the init
/// listens, so that a connection's peer credentials are the init's). The descriptor is for
/// the runtime to pass to the init as descriptor 3.
pub fn bind_ctl(dir: &Path) -> io::Result<OwnedFd> {
    let path = dir.join(CTL);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    with_short_path(dir, |short| {
        rustix::net::bind(&fd, &SocketAddrUnix::new(short.join(CTL))?)?;
        Ok(())
    })?;
    Ok(fd)
}

/// Whether the sandbox in `dir` was made with a control socket on the host (else it is
/// older than it: the runtime's `exec` is its only way in).
pub fn has_ctl(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join(CTL))
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
}

/// Run `f` with a short name of directory `dir` (`/proc/self/fd/N`): a socket address holds
/// at most 107 bytes, and sandbox directories may be deeper.
fn with_short_path<T>(dir: &Path, f: impl FnOnce(&Path) -> io::Result<T>) -> io::Result<T> {
    let d = rustix::fs::open(
        dir,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    f(&PathBuf::from(format!("/proc/self/fd/{}", d.as_raw_fd())))
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
    /// Bytes kept per stream.
    pub cap: u64,
    /// The daemon's name for the exec (for [`attach`]).
    pub key: u64,
    /// A pipe for stdin that later input goes to (else stdin is `stdin`, /dev/null).
    pub stdin_pipe: bool,
}

/// The descriptors a spawn hands to the init.
#[derive(Debug)]
pub struct SpawnFds<'a> {
    /// The command's stdin (/dev/null), or a terminal's slave.
    pub stdin: BorrowedFd<'a>,
    /// The files its stdout and stderr are kept in, and its status file.
    pub stdout: BorrowedFd<'a>,
    pub stderr: BorrowedFd<'a>,
    pub status: BorrowedFd<'a>,
    /// A terminal's master: output is read from it, input written to it.
    pub master: Option<BorrowedFd<'a>>,
}

const SPAWN_TTY: u32 = 1;
const SPAWN_STDIN: u32 = 2;

/// Why a spawn or an attach did not happen.
#[derive(Debug)]
pub enum SpawnError {
    /// The sandbox has no control socket (it is older than it): use the runtime.
    NoSocket,
    /// The init did not answer, or what answers is not the init: why.
    Unresponsive(String),
    /// The init could not start the command (the errno: ENOENT for a missing binary, …;
    /// ESRCH for an attach to a command it no longer has).
    Refused(i32),
    /// The request cannot be sent (too large, a NUL inside).
    Invalid(String),
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpawnError::NoSocket => write!(f, "the sandbox has no control socket"),
            SpawnError::Unresponsive(m) | SpawnError::Invalid(m) => f.write_str(m),
            SpawnError::Refused(e) => write!(f, "{}", io::Error::from_raw_os_error(*e)),
        }
    }
}

/// What the init says about a command it runs.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// Its output files grew (the next one comes after [`Running::ready`]).
    Output,
    /// It ended (its wait status); its output is all in the files.
    Ended(i32),
    /// The connection closed without an end: the init is gone.
    Closed,
}

/// A command the init runs, and the connection that drives it.
#[derive(Debug)]
pub struct Running {
    fd: AsyncFd<OwnedFd>,
    /// Its pid inside the sandbox.
    pub pid: i32,
    /// Where its input goes, as the init handed it over with `P`: the write end of its
    /// stdin pipe, or its terminal's master (also what resizes go to). Input never shares
    /// the connection with the control messages, so a command that does not read its stdin
    /// holds up nothing but the writer of that input.
    input: std::sync::Mutex<Option<Arc<AsyncFd<OwnedFd>>>>,
}

fn encode(s: &Spawn<'_>, tty: bool) -> Result<Vec<u8>, SpawnError> {
    let mut m = vec![b'S', 0, 0, 0];
    let flags = if tty { SPAWN_TTY } else { 0 } | if s.stdin_pipe { SPAWN_STDIN } else { 0 };
    for v in [s.uid, s.gid, s.args.len() as u32, s.env.len() as u32, flags] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    m.extend_from_slice(&s.cap.to_le_bytes());
    m.extend_from_slice(&s.key.to_le_bytes());
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

fn reply(fd: BorrowedFd<'_>, flags: RecvFlags) -> io::Result<Answer> {
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

/// Connect to the init of the sandbox in `dir` (host pid `init_pid`): the peer must be that
/// process, and its answers come within [`ANSWER_WITHIN`].
fn connect(dir: &Path, init_pid: u32) -> Result<OwnedFd, SpawnError> {
    if !has_ctl(dir) {
        return Err(SpawnError::NoSocket);
    }
    let gone = |e: io::Error| {
        SpawnError::Unresponsive(format!("the sandbox's init does not answer ({e})"))
    };
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| gone(e.into()))?;
    with_short_path(dir, |short| {
        rustix::net::connect(&fd, &SocketAddrUnix::new(short.join(CTL))?)?;
        Ok(())
    })
    .map_err(gone)?;
    let peer = rustix::net::sockopt::socket_peercred(&fd).map_err(|e| gone(e.into()))?;
    if peer.pid.as_raw_nonzero().get() as u32 != init_pid {
        return Err(SpawnError::Unresponsive(format!(
            "the sandbox's control socket is held by pid {}, not by its init ({init_pid})",
            peer.pid.as_raw_nonzero()
        )));
    }
    for timeout in [
        rustix::net::sockopt::Timeout::Recv,
        rustix::net::sockopt::Timeout::Send,
    ] {
        rustix::net::sockopt::set_socket_timeout(&fd, timeout, Some(ANSWER_WITHIN))
            .map_err(|e| gone(e.into()))?;
    }
    Ok(fd)
}

/// The init's answer to a spawn or attach: the command's pid, as a [`Running`].
/// An answer of the init (op, value); `None`: the connection closed.
type Answer = Option<(u8, i32)>;

/// One 8-byte answer and the descriptor it may carry.
fn reply_with_fd(fd: BorrowedFd<'_>) -> io::Result<(Answer, Option<OwnedFd>)> {
    let mut b = [0u8; 8];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [io::IoSliceMut::new(&mut b)];
    let r = rustix::net::recvmsg(fd, &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC)
        .map_err(io::Error::from)?;
    let mut passed = None;
    for m in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                passed.get_or_insert(f);
            }
        }
    }
    let n = r.bytes;
    if n == 0 {
        return Ok((None, passed));
    }
    if n != 8 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {n}-byte message from the sandbox's init"),
        ));
    }
    Ok((
        Some((b[0], i32::from_le_bytes([b[4], b[5], b[6], b[7]]))),
        passed,
    ))
}

fn answer(fd: OwnedFd) -> Result<Running, SpawnError> {
    let unresponsive = |e: io::Error| SpawnError::Unresponsive(e.to_string());
    match reply_with_fd(fd.as_fd()) {
        Ok((Some((b'P', pid)), input)) => {
            rustix::io::ioctl_fionbio(&fd, true).map_err(|e| unresponsive(e.into()))?;
            // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays open and names
            // the same socket for as long as the AsyncFd lives.
            let fd = unsafe {
                AsyncFd::register_with_interest(fd, Interest::READABLE | Interest::WRITABLE)
            }
            .map_err(|e| unresponsive(io::Error::from(e)))?;
            let input = match input {
                Some(i) => {
                    rustix::io::ioctl_fionbio(&i, true).map_err(|e| unresponsive(e.into()))?;
                    // SAFETY: as above: the AsyncFd owns the descriptor for its whole life.
                    let i = unsafe { AsyncFd::register_with_interest(i, Interest::WRITABLE) }
                        .map_err(|e| unresponsive(io::Error::from(e)))?;
                    Some(Arc::new(i))
                }
                None => None,
            };
            Ok(Running {
                fd,
                pid,
                input: std::sync::Mutex::new(input),
            })
        }
        Ok((Some((b'E', errno)), _)) => Err(SpawnError::Refused(errno)),
        Ok(_) => Err(SpawnError::Unresponsive(
            "the sandbox's init closed the connection without an answer".into(),
        )),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(SpawnError::Unresponsive(format!(
                "the sandbox's init did not answer within {} s (stopped or hung?)",
                ANSWER_WITHIN.as_secs()
            )))
        }
        Err(e) => Err(SpawnError::Unresponsive(format!("the sandbox's init: {e}"))),
    }
}

/// Start `s` in the sandbox in `dir` whose init has host pid `init_pid`. Blocking (a
/// connect, a send, one short answer, each bounded): call it off the async threads.
pub fn spawn(
    dir: &Path,
    init_pid: u32,
    s: &Spawn<'_>,
    fds: &SpawnFds<'_>,
) -> Result<Running, SpawnError> {
    let msg = encode(s, fds.master.is_some())?;
    let fd = connect(dir, init_pid)?;
    let mut all = vec![fds.stdin, fds.stdout, fds.stderr, fds.status];
    all.extend(fds.master);
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(5))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if !anc.push(SendAncillaryMessage::ScmRights(&all)) {
        return Err(SpawnError::Invalid("no room for the descriptors".into()));
    }
    let iov = [io::IoSlice::new(&msg)];
    rustix::net::sendmsg(&fd, &iov, &mut anc, SendFlags::NOSIGNAL).map_err(|e| {
        SpawnError::Unresponsive(format!(
            "send to the sandbox's init: {}",
            io::Error::from(e)
        ))
    })?;
    answer(fd)
}

/// Drive again a command the init runs, by the key it was spawned with (a daemon that
/// started after it). `Refused(ESRCH)`: the init has no such command (it has ended).
pub fn attach(dir: &Path, init_pid: u32, key: u64) -> Result<Running, SpawnError> {
    let fd = connect(dir, init_pid)?;
    let mut m = vec![b'A', 0, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(&key.to_le_bytes());
    rustix::net::send(&fd, &m, SendFlags::NOSIGNAL).map_err(|e| {
        SpawnError::Unresponsive(format!(
            "send to the sandbox's init: {}",
            io::Error::from(e)
        ))
    })?;
    answer(fd)
}

impl Running {
    /// The next thing the init says about the command.
    pub async fn next(&self) -> io::Result<Event> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| reply(fd.get_ref().as_fd(), RecvFlags::DONTWAIT)) {
                Ok(Ok(Some((b'X', status)))) => return Ok(Event::Ended(status)),
                Ok(Ok(Some((b'O', _)))) => return Ok(Event::Output),
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => return Ok(Event::Closed),
                Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionReset => {
                    return Ok(Event::Closed)
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Send one message, waiting while the socket is full (the init reads no input while
    /// the command's stdin is full: back-pressure).
    async fn send(&self, m: &[u8]) -> io::Result<()> {
        loop {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| {
                rustix::net::send(fd.get_ref(), m, SendFlags::NOSIGNAL | SendFlags::DONTWAIT)
                    .map_err(io::Error::from)
            }) {
                Ok(r) => return r.map(|_| ()),
                Err(_would_block) => continue,
            }
        }
    }

    /// The daemon has taken the last output report: the next growth sends another.
    pub async fn ready(&self) -> io::Result<()> {
        self.send(&[b'R', 0, 0, 0]).await
    }

    fn input_fd(&self) -> Option<Arc<AsyncFd<OwnedFd>>> {
        self.input.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Bytes for the command's stdin (or its terminal), waiting while it does not read.
    pub async fn input(&self, mut data: &[u8]) -> io::Result<()> {
        let Some(fd) = self.input_fd() else {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the command's stdin is closed",
            ));
        };
        while !data.is_empty() {
            let mut guard = fd.writable().await?;
            match guard.try_io(|f| rustix::io::write(f.get_ref(), data).map_err(io::Error::from)) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    /// Close the command's stdin: a pipe's reader sees its end once both the daemon's and the
    /// init's write ends are closed; a terminal gets ^D.
    pub async fn close_stdin(&self, tty: bool) -> io::Result<()> {
        if tty {
            return self.input(&[4]).await;
        }
        self.input.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.send(&[b'C', 0, 0, 0]).await
    }

    /// Resize the command's terminal (it gets `SIGWINCH`).
    pub fn resize(&self, rows: u16, cols: u16) -> io::Result<()> {
        let fd = self.input_fd().ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "the command has no terminal")
        })?;
        crate::pty::resize(fd.get_ref(), crate::proto::PtySize { cols, rows })
    }

    /// Send `signal` to the command's process group.
    pub fn kill(&self, signal: i32) -> io::Result<()> {
        let mut m = vec![b'K', 0, 0, 0];
        m.extend_from_slice(&signal.to_le_bytes());
        self.send_now(&m)
    }

    /// Send a short control message without waiting (a full socket is an error: only `R`
    /// and `C`, one at a time, and `K` travel this way).
    fn send_now(&self, m: &[u8]) -> io::Result<()> {
        rustix::net::send(
            self.fd.get_ref(),
            m,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_messages_are_as_the_init_reads_them() {
        let args = ["sh".to_owned(), "-c".to_owned(), "echo hi".to_owned()];
        let env = ["A=1".to_owned()];
        fn spawn<'a>(args: &'a [String], env: &'a [String], stdin_pipe: bool) -> Spawn<'a> {
            Spawn {
                args,
                env,
                cwd: "/w",
                uid: 65534,
                gid: 7,
                cap: 16 << 20,
                key: 0x0102_0304_0506_0708,
                stdin_pipe,
            }
        }
        let m = encode(&spawn(&args, &env, true), true).unwrap();
        assert_eq!(&m[..4], b"S\0\0\0");
        let u32_at = |o: usize| u32::from_le_bytes(m[o..o + 4].try_into().unwrap());
        assert_eq!(u32_at(4), 65534);
        assert_eq!(u32_at(8), 7);
        assert_eq!(u32_at(12), 3);
        assert_eq!(u32_at(16), 1);
        assert_eq!(u32_at(20), SPAWN_TTY | SPAWN_STDIN);
        assert_eq!(u64::from_le_bytes(m[24..32].try_into().unwrap()), 16 << 20);
        assert_eq!(
            u64::from_le_bytes(m[32..40].try_into().unwrap()),
            0x0102_0304_0506_0708
        );
        assert_eq!(&m[40..], b"/w\0sh\0-c\0echo hi\0A=1\0");
        assert_eq!(
            u32::from_le_bytes(
                encode(&spawn(&args, &env, false), false).unwrap()[20..24]
                    .try_into()
                    .unwrap()
            ),
            0
        );
        let bad = ["a\0b".to_owned()];
        assert!(matches!(
            encode(&spawn(&bad, &env, false), false),
            Err(SpawnError::Invalid(_))
        ));
        assert!(!INIT_BINARY.is_empty());
    }
}
