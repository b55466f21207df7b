//! # sandbox-runtime: sandboxes on lazily mounted layer stacks
//!
//! A sandbox is a **stack + an upper + a bundle**: its root is an overlay the node daemon
//! composes (`ublk_daemon::node`: every layer mounted once per node and shared, the
//! sandbox's own upper on local disk), its `config.json` is generated with `oci-spec`
//! ([`spec`]), and a standard OCI runtime (`runc`, [`runc`]) runs it. The node daemon owns
//! its sandboxes ([`Manager`]): a client that exits or disconnects changes nothing, and a
//! daemon that restarts (kill -9, upgrade) finds them again from their records.
//!
//! ## On disk (`<dir>` = the manager's sandbox directory, on local disk)
//! ```text
//! <dir>/<id>/sandbox.json    the record (Record): stack, limits, env, state; written
//!                            atomically before any change is acknowledged
//! <dir>/<id>/bundle/         config.json (spec.rs) + rootfs/ (the node's overlay mount)
//! <dir>/<id>/upper, work     the overlay's upper and work directories
//! <dir>/<id>/etc/            hostname, hosts, resolv.conf, machine-id (bound read-only over
//!                            /etc's)
//! <dir>/<id>/pack/           a pack in progress (`pack`): the stack's lower view, the build
//! <dir>/<id>/suspend.json  while suspended: what it had resident (`resident::Residency`)
//! <dir>/<id>/secrets/        a 1 MiB tmpfs, one file per secret, bound at /run/secrets
//! <dir>/<id>/ctl             the init's control socket (bound here, listened on by the init)
//! <dir>/<id>/execs/<exec>/   an exec's record, output, status and result (`exec`)
//! <run-dir>/runc/            runc's state (--root)
//! ```
//! ## Invariants
//! - A sandbox's record exists before its root is mounted and is removed last: a daemon that
//!   dies at any point finds every sandbox, or the leftovers of one, and `rm` finishes it.
//! - Nothing of the node is in a sandbox's mount namespace (runc pivots into the overlay);
//!   the sandbox reaches the host only through the daemon's operations.
//! - Kept exec output never exceeds the exec's cap; past it, output is read, counted and
//!   dropped, so a writer can fill neither memory nor disk. It is kept in files beside the
//!   sandbox (`<dir>/<id>/execs/<exec>/`, `exec`), written by the sandbox's init, so execs
//!   outlive the daemon (`reattach`).
//! - The init (PID 1) is out of the sandbox's reach: non-dumpable, its control socket only
//!   on the host (`agent`), and the daemon never waits on it without a deadline.
//! - Paths given to `cp` resolve inside the sandbox's root (`openat2(RESOLVE_IN_ROOT)`): a
//!   symlink inside never reaches the host.

pub mod admission;
pub mod agent;
mod bundle;
pub mod cgroup;
pub mod exec;
mod ext;
pub mod files;
mod manager;
pub mod net;
pub mod pack;
mod pool;
pub mod proto;
pub mod pty;
pub mod qos;
pub mod quota;
mod reattach;
pub mod resident;
mod retention;
mod run;
pub mod runc;
pub mod spec;
mod suspend;

use ublk_daemon::node::proto::{ApiError, ErrorKind};

pub use exec::{Exec, ExecUpdate};
pub use ext::SandboxExtension;
pub use manager::{valid_id, valid_node_name, Manager, ManagerConfig, Record};
pub use pack::{ForkResult, PackRequest, PackResult};
pub use proto::Limits;
pub use suspend::{swap_present, ResumeReport, ResumeResult, SuspendReport};

/// What can go wrong with a sandbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No sandbox, exec or pool of that name.
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed or names something impossible.
    #[error("{0}")]
    InvalidSpec(String),
    /// The sandbox exists already, or its state does not allow the operation.
    #[error("{0}")]
    Conflict(String),
    /// A size or count limit refused the request.
    #[error("{0}")]
    Limit(String),
    /// The OCI runtime failed.
    #[error("{0}")]
    Runtime(String),
    /// The bundle's config could not be built.
    #[error("OCI config: {0}")]
    Spec(String),
    /// The node daemon refused to mount or unmount the stack.
    #[error("{0}")]
    Node(ApiError),
    /// The content refused the operation: a secret in what a pack would publish, an entry
    /// the upper cannot hold (redirect, metacopy), a tree too deep.
    #[error("{0}")]
    Refused(String),
    /// A local file operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        let kind = match &e {
            Error::NotFound(_) => ErrorKind::UnknownSandbox,
            Error::InvalidSpec(_) => ErrorKind::BadRequest,
            Error::Conflict(_) | Error::Refused(_) => ErrorKind::Conflict,
            Error::Limit(_) => ErrorKind::LimitExceeded,
            Error::Runtime(_) => ErrorKind::Runtime,
            Error::Node(a) => return a.clone(),
            Error::Spec(_) | Error::Io { .. } => ErrorKind::Internal,
        };
        ApiError::new(kind, e.to_string())
    }
}

/// The crate's result.
pub type Result<T> = std::result::Result<T, Error>;
