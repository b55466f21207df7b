//! Pseudo-terminals for execs that ask for one (`ExecRequest::pty`).
//!
//! The daemon opens the pair on the host's devpts and hands both ends to the sandbox's init
//! with the spawn (`crate::agent`): the slave becomes the command's stdin, stdout and
//! stderr and the controlling terminal of its new session; the init keeps the master, copies
//! everything the command writes into the exec's stdout file (one stream), writes the
//! caller's input to it and resizes it (`W`), so that a terminal, like a pipe, outlives the
//! daemon. Once every holder of the slave has closed it, reading the master fails with `EIO`,
//! which is the end of output.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::pty::OpenptFlags;

use crate::proto::PtySize;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_carries_output_input_and_its_size() {
        let (master, slave) = open(PtySize {
            cols: 100,
            rows: 30,
        })
        .unwrap();
        let ws = rustix::termios::tcgetwinsize(&slave).unwrap();
        assert_eq!((ws.ws_col, ws.ws_row), (100, 30));
        resize(&master, PtySize { cols: 80, rows: 24 }).unwrap();
        assert_eq!(rustix::termios::tcgetwinsize(&slave).unwrap().ws_col, 80);
        // Input typed at the terminal reaches its reader (canonical mode: on a newline).
        rustix::io::write(&master, b"typed\n").unwrap();
        let mut got = [0u8; 16];
        let n = rustix::io::read(&slave, &mut got).unwrap();
        assert_eq!(&got[..n], b"typed\n");
        // What the command writes arrives on the master (after the echo of the typed line);
        // once every slave is closed, the master reads EIO: the end of output.
        rustix::io::write(&slave, b"out").unwrap();
        drop(slave);
        let mut all = Vec::new();
        let mut buf = [0u8; 256];
        loop {
            match rustix::io::read(&master, &mut buf) {
                Ok(0) | Err(rustix::io::Errno::IO) => break,
                Ok(n) => all.extend_from_slice(&buf[..n]),
                Err(rustix::io::Errno::AGAIN) => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(all.ends_with(b"out"), "{:?}", String::from_utf8_lossy(&all));
    }
}
