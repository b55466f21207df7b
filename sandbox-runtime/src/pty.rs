//! Pseudo-terminals for execs that ask for one (`ExecRequest::pty`).
//!
//! The daemon opens the pair on the host's devpts: the slave becomes the command's stdin,
//! stdout and stderr (sent to the sandbox's init with the spawn, which makes it the
//! controlling terminal of the command's new session); the master stays with the daemon,
//! which reads everything the command writes from it (one stream, reported as `stdout`),
//! writes the caller's input to it and resizes it. The master is non-blocking and driven by
//! tokio's reactor; once every holder of the slave has closed it, reading the master fails
//! with `EIO`, which is the end of output.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::pty::OpenptFlags;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::exec::Exec;
use crate::proto::{PtySize, Stream};

/// A new pair sized `size`: (master, slave), both close-on-exec.
pub fn open(size: PtySize) -> io::Result<(OwnedFd, OwnedFd)> {
    let master =
        rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    resize(&master, size)?;
    rustix::io::ioctl_fionbio(&master, true)?;
    Ok((master, slave))
}

/// Set the terminal's size (the command gets `SIGWINCH`).
pub fn resize(master: &impl AsFd, size: PtySize) -> io::Result<()> {
    let ws = rustix::termios::Winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(master, ws).map_err(io::Error::from)
}

/// The daemon's end of a terminal, registered with tokio.
#[derive(Debug)]
pub struct Master(AsyncFd<Arc<OwnedFd>>);

impl Master {
    pub fn new(fd: Arc<OwnedFd>) -> io::Result<Self> {
        // SAFETY: the AsyncFd owns the Arc, and every other holder of the Arc only resizes
        // through it: the descriptor stays open and names the same terminal for as long as
        // the AsyncFd lives.
        let fd =
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE | Interest::WRITABLE) }
                .map_err(io::Error::from)?;
        Ok(Self(fd))
    }

    /// Read what the command writes into `exec` (as stdout) until the terminal hangs up.
    pub async fn pump(&self, exec: Arc<Exec>) {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let Ok(mut guard) = self.0.readable().await else {
                return;
            };
            match guard.try_io(|fd| {
                rustix::io::read(fd.get_ref().as_fd(), &mut buf).map_err(io::Error::from)
            }) {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(n)) => exec.push(Stream::Stdout, &buf[..n]),
                Err(_would_block) => continue,
            }
        }
    }

    /// Write all of `data` (the command's input), waiting while the terminal's buffer is
    /// full.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.0.writable().await?;
            match guard
                .try_io(|fd| rustix::io::write(fd.get_ref().as_fd(), data).map_err(io::Error::from))
            {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_terminal_carries_output_input_and_its_size() {
        let (master, slave) = open(PtySize {
            cols: 100,
            rows: 30,
        })
        .unwrap();
        let ws = rustix::termios::tcgetwinsize(&slave).unwrap();
        assert_eq!((ws.ws_col, ws.ws_row), (100, 30));
        resize(&master, PtySize { cols: 80, rows: 24 }).unwrap();
        assert_eq!(rustix::termios::tcgetwinsize(&slave).unwrap().ws_col, 80);
        let m = Master::new(Arc::new(master)).unwrap();
        // Input typed at the terminal reaches its reader (canonical mode: on a newline).
        m.write_all(b"typed\n").await.unwrap();
        let mut got = [0u8; 16];
        let n = rustix::io::read(&slave, &mut got).unwrap();
        assert_eq!(&got[..n], b"typed\n");
        // What the command writes arrives on the master; a hangup ends the pump.
        rustix::io::write(&slave, b"out").unwrap();
        let exec = Exec::new("e".into(), "s".into(), vec![], 1 << 20);
        drop(slave);
        m.pump(exec.clone()).await;
        let (out, _, _) = exec.totals();
        // The echo of the typed line comes first, then "out" (with \r\n translation).
        assert!(out >= 3, "{out} bytes");
    }
}
