//! # e2b-api: the E2B protocol, spoken by the node
//!
//! The unmodified `e2b` Python SDK (pinned in the tests: 2.63.0) drives Strata sandboxes
//! through this crate: `strata daemon --api ADDR --api-keys FILE` serves, on one listener
//! (HTTP/1.1 and cleartext HTTP/2 with prior knowledge, chunked bodies both ways), for every
//! sandbox of the node:
//!
//! - **the control plane** (`control.rs`): `POST /sandboxes` and `/v2/sandboxes` (201),
//!   `GET /sandboxes/{id}`, `GET /sandboxes` and `/v2/sandboxes` (`x-next-token` paging,
//!   `state` and `metadata` filters), `DELETE /sandboxes/{id}` (204; 404),
//!   `POST /sandboxes/{id}/timeout` (204), `POST /sandboxes/{id}/pause` (204; 409),
//!   `POST [/v2]/sandboxes/{id}/connect` (200, 201 when it resumed one),
//!   `GET /sandboxes/{id}/metrics`; filesystem snapshots and forks on the runtime's
//!   `pack-diff` (`snapshot.rs`: `POST /sandboxes/{id}/snapshots`, `GET /snapshots`,
//!   `DELETE /templates/{id}`, `POST /sandboxes/{id}/fork`). Every request needs an `X-API-KEY` of the keys file;
//!   every error is JSON `{"code": <http status>, "message": "…"}` (the SDK parses nothing
//!   else).
//! - **envd, on the node** (no agent inside the sandbox): a request with an
//!   `E2b-Sandbox-Id` header is that sandbox's envd (`envd.rs`) and needs its
//!   `X-Access-Token` (the `envdAccessToken` its create answered). `GET /health`,
//!   `GET`/`POST /files` (`files.rs`), and the Connect services `process.Process`
//!   (`process.rs`) and `filesystem.Filesystem` (`filesystem.rs`) with the Connect protocol's
//!   JSON codec (`connect.rs`). A `/files` request without the header but with a
//!   `signature` is a signed URL: it goes to the sandbox whose token signs it.
//!
//! ## Formats
//! - Connect unary: `POST /<service>/<Method>`, `Content-Type: application/json`, one JSON
//!   message each way; an error is the HTTP status of its code and
//!   `{"code": "<snake_case code>", "message": "…"}`.
//! - Connect streams: `Content-Type: application/connect+json`; each message is an envelope
//!   of 1 flag byte, a 4-byte big-endian length and that many bytes of JSON. The server's
//!   last envelope has flag `0x02` and holds `{}` or `{"error": {"code", "message"}}`.
//!   Compressed envelopes (flag `0x01`) are refused: the SDK never sends them.
//! - Messages are proto3's JSON mapping: lowerCamelCase names, `bytes` as base64, `int64` as
//!   strings, enums by name, `google.protobuf.Timestamp` as RFC 3339; unknown fields ignored.
//! - Signed URLs (envd's v1): `signature = "v1_" + base64(sha256("path:op:user:token" [+
//!   ":expiry"]))` without padding, `op` = `read` | `write`, `signature_expiration` Unix
//!   seconds.
//! - State, in the state directory (`$STRATA_HOME/api`), every file written atomically:
//!   `templates.json` (name → layer stack and limits) and `sandboxes/<id>.json`, the API's
//!   side of each sandbox (template, access token, metadata, envVars, start and end times,
//!   auto-pause, paused), one file each so that creates on many connections never wait for
//!   each other's writes. The runtime's record stays the truth of whether a sandbox exists: a
//!   file whose sandbox is gone is removed when the API opens.
//!
//! ## Invariants
//! - Nothing from the network panics the daemon: every malformed request is a clear 4xx.
//! - Every sandbox path is resolved inside its root (`openat2(RESOLVE_IN_ROOT)` on the
//!   sandbox's `/proc/<init>/root`, `fs.rs`): a symlink planted in a sandbox never reaches
//!   the host.
//! - A sandbox is removed (or paused, with `autoPause`) at its end time; `set_timeout` moves
//!   that time from now.
//! - Request bodies are bounded ([`MAX_JSON_BODY`] for messages, [`MAX_UPLOAD`] per upload).

pub mod cluster;
mod connect;
mod control;
mod envd;
mod files;
mod filesystem;
pub mod front;
mod fs;
mod http;
mod ports;
mod process;
mod server;
mod snapshot;
mod state;
mod time;

pub use server::{serve, ApiConfig};
pub use state::{Api, Template, TemplateExtension, Templates};

/// The node's templates, kept in `state_dir` (the daemon opens them whether or not it
/// serves the API: `strata template` talks to it).
pub fn state_templates(state_dir: &std::path::Path) -> Result<std::sync::Arc<Templates>> {
    Templates::open(state_dir).map(std::sync::Arc::new)
}

/// Every parser of bytes from the network on `data`: Connect envelopes (in pieces of
/// every size the input's first byte picks), query strings, times, paths, the headers of
/// uploads and every request message. None may panic; the fuzz target
/// (`fuzz/fuzz_targets/e2b_request.rs`) and the tests call it.
#[doc(hidden)]
pub fn fuzz_parse(data: &[u8]) {
    let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
    let mut d = connect::Decoder::default();
    for piece in data.chunks(step) {
        d.push(piece);
        while let Ok(Some((_, msg))) = d.next() {
            process::fuzz(&msg);
            filesystem::fuzz(&msg);
        }
    }
    process::fuzz(data);
    filesystem::fuzz(data);
    control::fuzz(data);
    cluster::fuzz(data);
    files::fuzz(data);
    envd::fuzz(data);
    if let Ok(s) = std::str::from_utf8(data) {
        let q = http::query_pairs(Some(s));
        if let Some(m) = http::query_get(&q, "metadata") {
            let _ = http::query_pairs(Some(&m));
        }
        let _ = time::parse_rfc3339_ms(s);
        if let Ok(a) = fs::absolute(s, "/root") {
            assert!(
                a.starts_with('/') && !a.split('/').any(|c| c == ".."),
                "{a}"
            );
        }
    }
}

/// The envd version the node reports at create (the SDK turns features on by it): 0.6.4,
/// every feature the SDK gates up to it being implemented — stdin (0.3.0), the default user
/// without `Authorization` (0.4.0), closing stdin (0.5.2), octet-stream uploads, streamed and
/// gzip (0.5.7), file metadata as `user.e2b.*` xattrs (0.6.2), entry info in watch events
/// (0.6.3), watches that allow network mounts (0.6.4: accepted; a sandbox has none).
pub const ENVD_VERSION: &str = "0.6.4";

/// The largest JSON request body (a Connect message, a control-plane request).
pub const MAX_JSON_BODY: usize = 4 << 20;

/// The largest upload (`POST /files`), per request.
pub const MAX_UPLOAD: u64 = 1 << 30;

/// What can go wrong in the API.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// No key, or not one of the keys; no or a wrong access token.
    #[error("{0}")]
    Unauthenticated(String),
    /// No such sandbox, template, process or file.
    #[error("{0}")]
    NotFound(String),
    /// The state does not allow it (already paused, exists already).
    #[error("{0}")]
    Conflict(String),
    /// Something the node does not do (yet).
    #[error("{0}")]
    Unsupported(String),
    /// A limit refused it.
    #[error("{0}")]
    Limit(String),
    /// The runtime failed.
    #[error("{0}")]
    Runtime(String),
    /// A local I/O error.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            Error::BadRequest(_) => 400,
            Error::Unauthenticated(_) => 401,
            Error::NotFound(_) => 404,
            Error::Conflict(_) => 409,
            Error::Unsupported(_) => 501,
            Error::Limit(_) => 429,
            Error::Runtime(_) => 500,
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => 404,
                std::io::ErrorKind::AlreadyExists => 409,
                std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => 400,
                std::io::ErrorKind::PermissionDenied => 403,
                _ if source.raw_os_error() == Some(libc::ENOSPC) => 507,
                _ if source.raw_os_error() == Some(libc::ENOTDIR) => 400,
                _ if source.raw_os_error() == Some(libc::EISDIR) => 400,
                _ if source.raw_os_error() == Some(libc::ENOTEMPTY) => 409,
                _ if source.raw_os_error() == Some(libc::ELOOP) => 400,
                _ if source.raw_os_error() == Some(libc::EXDEV) => 400,
                _ => 500,
            },
        }
    }
}

impl From<sandbox_runtime::Error> for Error {
    fn from(e: sandbox_runtime::Error) -> Self {
        use sandbox_runtime::Error as R;
        match e {
            R::NotFound(m) => Error::NotFound(m),
            R::InvalidSpec(m) => Error::BadRequest(m),
            R::Conflict(m) | R::Refused(m) => Error::Conflict(m),
            R::Limit(m) => Error::Limit(m),
            R::Io { context, source } => Error::Io { context, source },
            other => Error::Runtime(other.to_string()),
        }
    }
}

/// The crate's result.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    #[test]
    fn the_parsers_survive_hostile_input() {
        let mut inputs: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b"{\"process\":{\"cmd\":\"/bin/bash\",\"args\":[\"-c\",\"x\"]},\"pty\":{\"size\":{\"cols\":70000,\"rows\":0}}}".to_vec(),
            b"{\"process\":{\"pid\":1},\"signal\":\"SIGNAL_SIGKILL\"}".to_vec(),
            b"{\"input\":{\"stdin\":\"!!notbase64\"}}".to_vec(),
            b"path=%2F..%2F..%2Fetc&metadata=a%3D%25zz%26b".to_vec(),
            b"2026-02-30T25:61:61.9999999+99:99".to_vec(),
            b"Content-Disposition: form-data; name=\"file\"; filename*=utf-8''%2F%zz".to_vec(),
            vec![0, 0xff, 0xff, 0xff, 0xff, 1, 2],
        ];
        let mut env = vec![0u8];
        env.extend_from_slice(&(7u32).to_be_bytes());
        env.extend_from_slice(b"{\"a\":1}");
        inputs.push(env);
        for i in &inputs {
            super::fuzz_parse(i);
        }
        // Random bytes and random mutations of the seeds (a short fuzz run in every test run).
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        for _ in 0..20_000 {
            let mut b = inputs[rng.usize(..inputs.len())].clone();
            for _ in 0..rng.usize(0..8) {
                match rng.u8(0..3) {
                    0 if !b.is_empty() => {
                        let i = rng.usize(..b.len());
                        b[i] = rng.u8(..);
                    }
                    1 => b.insert(rng.usize(..=b.len()), rng.u8(..)),
                    _ => b.truncate(rng.usize(..=b.len())),
                }
            }
            super::fuzz_parse(&b);
        }
    }
}
