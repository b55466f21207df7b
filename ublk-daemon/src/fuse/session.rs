//! A FUSE session on a `/dev/fuse` descriptor: the INIT handshake, worker threads, replies,
//! notifications, passthrough backing files.
//!
//! ## Threading model, and why it survives the process
//! Every worker reads the *same* descriptor (no `FUSE_DEV_IOC_CLONE`): the kernel keeps one
//! queue of requests being processed per open device file, and that file is also held by the
//! fd holder (`crate::holder`). When this process dies, the requests it had read but not
//! answered stay in that queue instead of being failed; the next server gets the same file
//! from the holder, resumes without a second INIT ([`Session::serve`] with the saved
//! [`Negotiated`] values) and asks the kernel to queue them again
//! ([`Channel::resend`], `FUSE_NOTIFY_RESEND`, Linux 6.9+).
//!
//! The descriptor is non-blocking. A worker reads until `EAGAIN`, then waits in its own epoll
//! set, where the device is registered `EPOLLEXCLUSIVE` (one worker woken per request) and a
//! stop eventfd is registered for all: [`Session::stop`] ends the workers without touching
//! the connection (a handover), unmounting ends them with `ENODEV`.

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use zerocopy::IntoBytes;

use super::abi::{self, init, InitIn, InitOut, NotifyInvalEntryOut, OutHeader};
use super::request::{self, Op, Request};

/// What the kernel and this server agreed at INIT. Saved (with the descriptor, in the fd
/// holder) before the first request is answered, so that a later server can resume the
/// connection exactly as it was negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Negotiated {
    /// The protocol minor version in use (the smaller of the kernel's and ours).
    pub minor: u32,
    /// The flags both sides agreed on (`flags | flags2 << 32`).
    pub flags: u64,
    /// The flags the kernel offered.
    pub kernel_flags: u64,
    pub max_readahead: u32,
    pub max_write: u32,
    pub max_pages: u16,
    pub max_background: u16,
    pub congestion_threshold: u16,
    /// Stacking depth for passthrough backing files (0: no passthrough).
    pub max_stack_depth: u32,
}

impl Negotiated {
    /// Whether backing files may be opened (`FUSE_PASSTHROUGH` agreed).
    pub fn passthrough(&self) -> bool {
        self.flags & init::PASSTHROUGH != 0 && self.max_stack_depth > 0
    }

    /// Whether the kernel queues unanswered requests again on `FUSE_NOTIFY_RESEND`.
    pub fn has_resend(&self) -> bool {
        self.kernel_flags & init::HAS_RESEND != 0
    }

    fn init_out(&self) -> InitOut {
        let reply_flags = self.flags | (self.kernel_flags & init::INIT_EXT);
        InitOut {
            major: abi::KERNEL_VERSION,
            minor: self.minor,
            max_readahead: self.max_readahead,
            flags: reply_flags as u32,
            max_background: self.max_background,
            congestion_threshold: self.congestion_threshold,
            max_write: self.max_write,
            time_gran: 1,
            max_pages: self.max_pages,
            map_alignment: 0,
            flags2: (reply_flags >> 32) as u32,
            max_stack_depth: self.max_stack_depth,
            unused: [0; 6],
        }
    }
}

/// What this server asks for at INIT.
#[derive(Clone, Copy, Debug)]
pub struct InitPolicy {
    /// The largest read the kernel may send (sets `max_pages`).
    pub max_read: u32,
    /// The largest write (at least 4 KiB).
    pub max_write: u32,
    /// Flags wanted, granted where the kernel offers them.
    pub want: u64,
    pub max_background: u16,
    pub congestion_threshold: u16,
}

impl InitPolicy {
    /// Agree with the kernel's INIT.
    pub fn negotiate(&self, i: &InitIn) -> Negotiated {
        let kernel_flags = request::init_flags(i);
        let flags = self.want & kernel_flags;
        let passthrough = flags & init::PASSTHROUGH != 0;
        Negotiated {
            minor: i.minor.min(abi::KERNEL_MINOR_VERSION),
            flags,
            kernel_flags,
            max_readahead: i.max_readahead,
            max_write: self.max_write.max(4096),
            max_pages: (self.max_read.div_ceil(4096)).clamp(1, u32::from(u16::MAX)) as u16,
            max_background: self.max_background,
            congestion_threshold: self.congestion_threshold,
            // Depth 1: backing files live on a plain filesystem, and this mount can itself
            // be the lower of one more stacking filesystem.
            max_stack_depth: u32::from(passthrough),
        }
    }
}

/// The most payload pieces one reply or notification carries: a struct, a name and its NUL;
/// or a read's bytes as the chunks they are in (a 16 MiB `max_read` spans at most 65 chunks
/// of 256 KiB).
pub(crate) const MAX_PAYLOAD_PARTS: usize = 72;

/// The device descriptor, shared by the workers and the filesystem (replies, notifications,
/// backing files).
#[derive(Debug)]
pub struct Channel {
    dev: OwnedFd,
}

fn errno() -> io::Error {
    io::Error::last_os_error()
}

impl Channel {
    fn fd(&self) -> BorrowedFd<'_> {
        self.dev.as_fd()
    }

    /// Write one message: an [`OutHeader`] (`error` and `unique` as given) and `payload`, in
    /// one `writev` with no allocation (this runs once per answered request). At most
    /// [`MAX_PAYLOAD_PARTS`] payload pieces.
    fn send(&self, error: i32, unique: u64, payload: &[&[u8]]) -> io::Result<()> {
        if payload.len() > MAX_PAYLOAD_PARTS {
            return Err(io::Error::other("too many pieces for one FUSE message"));
        }
        let body: usize = payload.iter().map(|p| p.len()).sum();
        let want = std::mem::size_of::<OutHeader>() + body;
        let h = OutHeader {
            len: want as u32,
            error,
            unique,
        };
        let mut slices = [IoSlice::new(&[]); MAX_PAYLOAD_PARTS + 1];
        slices[0] = IoSlice::new(h.as_bytes());
        for (s, p) in slices[1..].iter_mut().zip(payload) {
            *s = IoSlice::new(p);
        }
        let n =
            rustix::io::writev(self.fd(), &slices[..=payload.len()]).map_err(io::Error::from)?;
        if n != want {
            return Err(io::Error::other(format!(
                "short write to /dev/fuse: {n} of {want} bytes"
            )));
        }
        Ok(())
    }

    /// Answer request `unique` with `error` (0 or a positive errno) and `payload`.
    pub fn reply(&self, unique: u64, error: i32, payload: &[&[u8]]) -> io::Result<()> {
        match self.send(-error, unique, payload) {
            // The request was interrupted and is gone: nothing to answer.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            other => other,
        }
    }

    /// A notification: `unique` 0, the code in `error`.
    fn notify(&self, code: i32, payload: &[&[u8]]) -> io::Result<()> {
        self.send(code, 0, payload)
    }

    /// Drop the kernel's cached dentry `name` in directory `parent`.
    pub fn inval_entry(&self, parent: u64, name: &[u8]) -> io::Result<()> {
        let out = NotifyInvalEntryOut {
            parent,
            namelen: name.len() as u32,
            flags: 0,
        };
        self.notify(abi::notify::INVAL_ENTRY, &[out.as_bytes(), name, &[0]])
    }

    /// Ask the kernel to queue again every request that was read but not answered
    /// (`FUSE_NOTIFY_RESEND`).
    pub fn resend(&self) -> io::Result<()> {
        self.notify(abi::notify::RESEND, &[])
    }

    /// Register `file` as a passthrough backing file; returns its backing id.
    pub fn backing_open(&self, file: BorrowedFd<'_>) -> io::Result<i32> {
        let map = abi::BackingMap {
            fd: file.as_raw_fd(),
            flags: 0,
            padding: 0,
        };
        // SAFETY: the device descriptor is open; `map` is a valid `struct fuse_backing_map`
        // that outlives the call, and the kernel only reads it.
        let rc = unsafe {
            libc::ioctl(
                self.dev.as_raw_fd(),
                abi::DEV_IOC_BACKING_OPEN as _,
                &map as *const abi::BackingMap,
            )
        };
        if rc < 0 {
            return Err(errno());
        }
        Ok(rc)
    }

    /// Close a backing id from [`Channel::backing_open`].
    pub fn backing_close(&self, id: i32) -> io::Result<()> {
        let id = id as u32;
        // SAFETY: as above; the argument is a `u32` that outlives the call.
        let rc = unsafe {
            libc::ioctl(
                self.dev.as_raw_fd(),
                abi::DEV_IOC_BACKING_CLOSE as _,
                &id as *const u32,
            )
        };
        if rc < 0 {
            return Err(errno());
        }
        Ok(())
    }
}

/// The answer to one request. Dropping it unanswered answers `EIO`.
#[derive(Debug)]
pub struct Reply<'a> {
    ch: &'a Arc<Channel>,
    unique: u64,
    done: bool,
}

impl Reply<'_> {
    /// Answer with `errno`.
    pub fn error(mut self, errno: i32) {
        self.send(errno, &[]);
    }

    /// Answer with `payload` (the opcode's reply struct, or data).
    pub fn ok(mut self, payload: &[&[u8]]) {
        self.send(0, payload);
    }

    /// Answer LISTXATTR for a file without extended attributes: the size of an empty list
    /// (`size` 0), or the empty list.
    pub fn no_xattrs(self, size: u32) {
        if size == 0 {
            self.ok(&[abi::GetxattrOut::default().as_bytes()])
        } else {
            self.ok(&[])
        }
    }

    /// Answer STATFS for a read-mostly filesystem of 4 KiB blocks: `blocks` in use, `files`
    /// inodes, nothing free.
    pub fn statfs(self, blocks: u64, files: u64) {
        let out = abi::StatfsOut {
            blocks,
            files,
            bsize: 4096,
            namelen: 255,
            frsize: 4096,
            ..Default::default()
        };
        self.ok(&[out.as_bytes()])
    }

    /// The channel (to open backing files while answering an OPEN).
    pub fn channel(&self) -> &Arc<Channel> {
        self.ch
    }

    fn send(&mut self, errno: i32, payload: &[&[u8]]) {
        self.done = true;
        if let Err(e) = self.ch.reply(self.unique, errno, payload) {
            if e.raw_os_error() != Some(libc::ENODEV) {
                tracing::warn!(unique = self.unique, error = %e, "FUSE reply failed");
            }
        }
    }
}

impl Drop for Reply<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.send(libc::EIO, &[]);
        }
    }
}

/// A filesystem served by a [`Session`]. Called on the worker threads; INIT, FORGET and
/// INTERRUPT never reach it.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, req: &Request<'_>, reply: Reply<'_>);
}

fn read_dev(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    rustix::io::read(fd, buf).map_err(io::Error::from)
}

/// Wait up to `timeout` for the device to be readable.
fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut pfd = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let n = rustix::event::poll(&mut pfd, Some(&ts)).map_err(io::Error::from)?;
    Ok(n > 0)
}

/// Answer the kernel's INIT on a freshly mounted connection: agree on `policy`, call `save`
/// with the result (an error there fails the INIT and the mount), then reply. Waits up to
/// `timeout` for the INIT.
pub fn handshake(
    dev: &OwnedFd,
    policy: &InitPolicy,
    timeout: Duration,
    save: impl FnOnce(&Negotiated) -> io::Result<()>,
) -> io::Result<Negotiated> {
    let ch = Channel {
        dev: dev.try_clone()?,
    };
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !wait_readable(dev.as_fd(), left)? {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no FUSE INIT from the kernel",
            ));
        }
        let n = match read_dev(dev.as_fd(), &mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) => continue,
            Err(e) => return Err(e),
        };
        let req = request::parse(&buf[..n])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let unique = req.header.unique;
        let Op::Init(i) = req.op else {
            ch.reply(unique, libc::EIO, &[])?;
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("FUSE request {} before INIT", req.header.opcode),
            ));
        };
        if i.major > abi::KERNEL_VERSION {
            // The kernel offers a newer major: answer with ours, and it sends INIT again.
            let out = InitOut {
                major: abi::KERNEL_VERSION,
                minor: abi::KERNEL_MINOR_VERSION,
                ..Default::default()
            };
            ch.reply(unique, 0, &[out.as_bytes()])?;
            continue;
        }
        if i.major < abi::KERNEL_VERSION || i.minor < abi::MIN_MINOR_VERSION {
            ch.reply(unique, libc::EPROTO, &[])?;
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "FUSE protocol {}.{} is older than 7.{}",
                    i.major,
                    i.minor,
                    abi::MIN_MINOR_VERSION
                ),
            ));
        }
        let neg = policy.negotiate(&i);
        if let Err(e) = save(&neg) {
            ch.reply(unique, libc::EIO, &[])?;
            return Err(e);
        }
        ch.reply(unique, 0, &[neg.init_out().as_bytes()])?;
        return Ok(neg);
    }
}

/// Running workers on one connection.
#[derive(Debug)]
pub struct Session {
    ch: Arc<Channel>,
    stop_fd: Arc<OwnedFd>,
    stopping: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Session {
    /// Serve an initialised connection (`neg`, from [`handshake`] or saved by an earlier
    /// server) with `threads` workers. With `resend`, requests an earlier server read but did
    /// not answer are queued again first (where the kernel can).
    pub fn serve<H: Handler>(
        dev: OwnedFd,
        neg: Negotiated,
        handler: Arc<H>,
        threads: usize,
        resend: bool,
    ) -> io::Result<Session> {
        set_nonblocking(dev.as_fd())?;
        let ch = Arc::new(Channel { dev });
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(errno());
        }
        // SAFETY: `efd` is a new descriptor owned by nobody else.
        let stop_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let stopping = Arc::new(AtomicBool::new(false));
        let buf_len = abi::MIN_READ_BUFFER.max(neg.max_write as usize + 4096);
        let mut session = Session {
            ch: ch.clone(),
            stop_fd: stop_fd.clone(),
            stopping: stopping.clone(),
            threads: Vec::with_capacity(threads),
        };
        for n in 0..threads.max(1) {
            let worker = Worker {
                ch: ch.clone(),
                stop_fd: stop_fd.clone(),
                stopping: stopping.clone(),
                handler: handler.clone(),
                neg,
            };
            let t = std::thread::Builder::new()
                .name(format!("strata-fuse-{n}"))
                .spawn(move || worker.run(buf_len));
            match t {
                Ok(t) => session.threads.push(t),
                Err(e) => {
                    session.stop();
                    return Err(e);
                }
            }
        }
        if resend && neg.has_resend() {
            if let Err(e) = ch.resend() {
                tracing::warn!(error = %e, "FUSE_NOTIFY_RESEND failed");
            }
        }
        Ok(session)
    }

    pub fn channel(&self) -> &Arc<Channel> {
        &self.ch
    }

    /// Stop the workers (each finishes the request it is serving) and wait for them. The
    /// connection stays up: requests wait in the kernel for the next server.
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        let _ = rustix::io::write(self.stop_fd.as_fd(), &one.to_ne_bytes());
        self.join();
    }

    /// Wait for the workers to end (they end when the connection does).
    pub fn join(&mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    let fl = rustix::fs::fcntl_getfl(fd).map_err(io::Error::from)?;
    rustix::fs::fcntl_setfl(fd, fl | rustix::fs::OFlags::NONBLOCK).map_err(io::Error::from)
}

struct Worker<H> {
    ch: Arc<Channel>,
    stop_fd: Arc<OwnedFd>,
    stopping: Arc<AtomicBool>,
    handler: Arc<H>,
    neg: Negotiated,
}

impl<H: Handler> Worker<H> {
    fn epoll(&self) -> io::Result<OwnedFd> {
        // SAFETY: no memory preconditions; the result is checked.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(errno());
        }
        // SAFETY: `ep` is a new descriptor owned by nobody else.
        let ep = unsafe { OwnedFd::from_raw_fd(ep) };
        let add = |fd: i32, events: u32| {
            let mut ev = libc::epoll_event {
                events,
                u64: fd as u64,
            };
            // SAFETY: both descriptors are open; `ev` is valid for the call.
            let rc = unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
            if rc < 0 {
                Err(errno())
            } else {
                Ok(())
            }
        };
        add(
            self.ch.dev.as_raw_fd(),
            (libc::EPOLLIN | libc::EPOLLEXCLUSIVE) as u32,
        )?;
        add(self.stop_fd.as_raw_fd(), libc::EPOLLIN as u32)?;
        Ok(ep)
    }

    fn run(self, buf_len: usize) {
        let ep = match self.epoll() {
            Ok(ep) => ep,
            Err(e) => {
                tracing::error!(error = %e, "FUSE worker: epoll setup failed");
                return;
            }
        };
        let mut buf = vec![0u8; buf_len];
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 2];
        while !self.stopping.load(Ordering::SeqCst) {
            match read_dev(self.ch.fd(), &mut buf) {
                Ok(n) => self.dispatch(&buf[..n]),
                Err(e) => match e.raw_os_error() {
                    Some(libc::EAGAIN) => {
                        // SAFETY: `ep` is open and `events` is a writable array of 2.
                        let rc =
                            unsafe { libc::epoll_wait(ep.as_raw_fd(), events.as_mut_ptr(), 2, -1) };
                        if rc < 0 && errno().raw_os_error() != Some(libc::EINTR) {
                            tracing::error!(error = %errno(), "FUSE worker: epoll_wait");
                            return;
                        }
                    }
                    // Interrupted, or a request that was interrupted while being read.
                    Some(libc::EINTR | libc::ENOENT) => {}
                    // The connection is gone (unmounted or aborted).
                    Some(libc::ENODEV) => return,
                    _ => {
                        tracing::error!(error = %e, "FUSE worker: reading /dev/fuse");
                        return;
                    }
                },
            }
        }
    }

    fn dispatch(&self, bytes: &[u8]) {
        let req = match request::parse(bytes) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "malformed FUSE request");
                if let Ok((h, _)) = <abi::InHeader as zerocopy::FromBytes>::read_from_prefix(bytes)
                {
                    let _ = self.ch.reply(h.unique, libc::EIO, &[]);
                }
                return;
            }
        };
        if req.op.no_reply() {
            return;
        }
        let reply = Reply {
            ch: &self.ch,
            unique: req.header.unique,
            done: false,
        };
        match req.op {
            // An INIT sent again (resent after a crash between save and reply): answer it as
            // it was agreed.
            Op::Init(_) => reply.ok(&[self.neg.init_out().as_bytes()]),
            Op::Destroy => reply.ok(&[]),
            Op::Other(_) => reply.error(libc::ENOSYS),
            _ => self.handler.handle(&req, reply),
        }
    }
}
