//! Waiting for SIGTERM/SIGINT: `strata daemon` and `strata bd serve` run until one arrives,
//! then shut down cleanly (one set of handlers for the whole process).
//!
//! The handler only stores to a static atomic (async-signal-safe); waiters poll it. Polling
//! every 100 ms keeps this free of self-pipes and of tokio's `signal` feature.

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use crate::{Error, Result};

/// The last stop signal received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signo: libc::c_int) {
    RECEIVED.store(signo, Ordering::SeqCst);
}

/// SIGTERM and SIGINT handlers installed by [`StopSignal::install`].
#[derive(Debug)]
pub struct StopSignal(());

impl StopSignal {
    /// Install the handlers (for the rest of the process's life).
    pub fn install() -> Result<Self> {
        for sig in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: a zeroed sigaction is a valid value to fill in; the handler is an
            // `extern "C" fn(c_int)` that only does an atomic store (async-signal-safe), and
            // the pointers passed to sigemptyset/sigaction point at that local value.
            let rc = unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut())
            };
            if rc != 0 {
                return Err(Error::io(
                    "install a handler for",
                    format!("signal {sig}"),
                    std::io::Error::last_os_error(),
                ));
            }
        }
        Ok(Self(()))
    }

    /// The signal received so far, if any.
    pub fn received(&self) -> Option<i32> {
        match RECEIVED.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }

    /// Wait (asynchronously) until a stop signal arrives; returns it.
    pub async fn wait(&self) -> i32 {
        loop {
            if let Some(s) = self.received() {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGTERM sent to this process is caught (the process survives) and reported.
    #[test]
    fn sigterm_is_caught_and_reported() {
        let stop = StopSignal::install().unwrap();
        assert_eq!(stop.received(), None);
        // SAFETY: raise has no memory preconditions; SIGTERM has our handler installed above.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let got =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), stop.wait()).await });
        assert_eq!(got.ok(), Some(libc::SIGTERM));
    }
}
