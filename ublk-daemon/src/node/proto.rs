//! The local API's wire format: newline-delimited JSON over `<run-dir>/strata.sock`.
//!
//! Every request is one line holding one JSON object, `{"v": 1, "op": "...", ...}`; the
//! daemon answers with one line, `{"v": 1, "ok": true, "result": {...}}` or
//! `{"v": 1, "ok": false, "error": {"kind": "...", "message": "..."}}`. A connection may carry
//! any number of request/response pairs, strictly in turn. A request line longer than
//! [`MAX_LINE`] bytes, a line that is not JSON, or a version other than [`VERSION`] gets an
//! error of kind `bad_request` and the connection is closed.
//!
//! Operations (field names as on the wire):
//!
//! | op | fields | result |
//! | --- | --- | --- |
//! | `ping` | — | [`Pong`] |
//! | `register` | `layer` | [`LayerInfo`] (the layer stays registered until `release`) |
//! | `release` | `layer` | [`LayerInfo`] (still mounted if a mount uses it) |
//! | `mount` | `layers` (first lowest), `mountpoint`, `upper`?, `work`? | [`MountInfo`] |
//! | `umount` | `mountpoint` | [`MountInfo`] (what was released) |
//! | `stats` | — | [`Status`] |
//! | `warm` | `layer` | [`WarmInfo`] (every chunk of the layer's blobs in the node's level 2) |
//! | `handover` | — | [`Pong`] of the daemon that stops serving (`strata daemon --takeover`) |
//! | `read_blob` | `blob` (hex), `offset`, `length` (≤ [`MAX_READ_BLOB`]) | [`BlobBytes`] through the node's cache |
//!
//! Adding an optional field or a new op keeps [`VERSION`]; changing the meaning of one bumps it.

use std::path::PathBuf;

use fs_cache::chunk::CacheStats;
use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;

/// The longest request line accepted (bytes, newline included).
pub const MAX_LINE: usize = 1 << 20;

/// The longest response line a client accepts: a `stats` answer of a node with 10,000 mounts
/// is a few MiB.
pub const MAX_RESPONSE_LINE: usize = 256 << 20;

/// A request, without its envelope.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Request {
    Ping,
    Register {
        layer: String,
    },
    Release {
        layer: String,
    },
    Mount {
        layers: Vec<String>,
        mountpoint: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        upper: Option<PathBuf>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        work: Option<PathBuf>,
    },
    Umount {
        mountpoint: PathBuf,
    },
    Stats,
    Warm {
        layer: String,
    },
    /// Stop serving without unmounting anything and exit, leaving the mounts and their FUSE
    /// connection (kept by the fd holder) to the daemon that asked.
    Handover,
    /// Bytes of a stored blob, read through the node's chunk cache (what `strata blob cat`
    /// uses while the daemon holds the cache).
    ReadBlob {
        blob: String,
        #[serde(default)]
        offset: u64,
        length: u64,
    },
}

/// The most bytes one `read_blob` answers (hex-encoded, it stays under [`MAX_LINE`]).
pub const MAX_READ_BLOB: u64 = 256 << 10;

/// `read_blob`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobBytes {
    /// The blob's size.
    pub size: u64,
    /// Where these bytes start.
    pub offset: u64,
    /// The bytes, hex-encoded (fewer than asked for only at the end of the blob).
    pub hex: String,
}

/// A request line: the version and the request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RequestLine {
    pub v: u32,
    #[serde(flatten)]
    pub request: Request,
}

/// A response line.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ResponseLine {
    pub v: u32,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
    /// One line of a streamed answer (`server::Extension`): more lines follow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<serde_json::Value>,
}

impl ResponseLine {
    /// The final line of a successful answer.
    pub fn success(result: serde_json::Value) -> Self {
        Self {
            v: VERSION,
            ok: true,
            result: Some(result),
            error: None,
            event: None,
        }
    }

    /// The final line of a failed answer.
    pub fn failure(e: ApiError) -> Self {
        Self {
            v: VERSION,
            ok: false,
            result: None,
            error: Some(e),
            event: None,
        }
    }

    /// A line of a streamed answer, more to come.
    pub fn event(event: serde_json::Value) -> Self {
        Self {
            v: VERSION,
            ok: true,
            result: None,
            error: None,
            event: Some(event),
        }
    }
}

/// What kind of failure an error is: the command line maps each to a message a user can act
/// on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request is malformed (not JSON, unknown op, wrong version, bad field).
    BadRequest,
    /// No such layer in the store, or the reference is not `KIND/NAME:VERSION`.
    UnknownLayer,
    /// The layer is stored but cannot be served (no meta image, unreadable blobs).
    BadLayer,
    /// The store's backend cannot be reached or keeps failing.
    BackendUnreachable,
    /// The mountpoint is already a mount, is not an empty directory, or does not exist.
    MountpointInUse,
    /// No mount of ours at that path.
    NotMounted,
    /// The caller or the daemon lacks privileges (mount(2) needs root).
    NotRoot,
    /// The kernel lacks a filesystem we need (erofs, fuse, overlay).
    KernelUnsupported,
    /// The daemon is shutting down.
    ShuttingDown,
    /// No sandbox (or exec, or pool) of that id on this node.
    UnknownSandbox,
    /// A sandbox of that id exists already, or the sandbox is not in a state that allows the
    /// operation (stopped, being removed).
    Conflict,
    /// A limit refused the request (sizes, counts, the node's capacity).
    LimitExceeded,
    /// The OCI runtime failed; the message has its words.
    Runtime,
    /// Anything else (a local I/O error, a failed mount(2)); the message says what.
    Internal,
}

impl ErrorKind {
    /// The wire name (`unknown_layer`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::UnknownLayer => "unknown_layer",
            ErrorKind::BadLayer => "bad_layer",
            ErrorKind::BackendUnreachable => "backend_unreachable",
            ErrorKind::MountpointInUse => "mountpoint_in_use",
            ErrorKind::NotMounted => "not_mounted",
            ErrorKind::NotRoot => "not_root",
            ErrorKind::KernelUnsupported => "kernel_unsupported",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::UnknownSandbox => "unknown_sandbox",
            ErrorKind::Conflict => "conflict",
            ErrorKind::LimitExceeded => "limit_exceeded",
            ErrorKind::Runtime => "runtime",
            ErrorKind::Internal => "internal",
        }
    }
}

/// An error as the API reports it: a kind and a message that says what failed and where.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// Classify a storage error: unknown layers, unreachable backends, bad layers.
    pub fn from_store(context: &str, e: &fs_cache::Error) -> Self {
        use fs_cache::{Error as E, ErrorKind as K};
        // The layer itself is unknown (or misnamed); any other missing or damaged object
        // makes a known layer unservable. `kind()` sees through shared errors; so does this.
        let mut root = e;
        while let E::Shared(inner) = root {
            root = inner;
        }
        let kind = match (root, e.kind()) {
            (E::LayerNotFound(_) | E::InvalidLayerRef { .. }, _) => ErrorKind::UnknownLayer,
            (_, K::Transient | K::Backend) => ErrorKind::BackendUnreachable,
            (_, K::NotFound | K::Corrupt) => ErrorKind::BadLayer,
            (_, K::InvalidInput) => ErrorKind::BadRequest,
            _ => ErrorKind::Internal,
        };
        Self::new(kind, format!("{context}: {e}"))
    }
}

/// `ping`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    pub version: u32,
    pub pid: u32,
    /// The store URL the daemon serves.
    pub store: String,
    pub run_dir: PathBuf,
}

/// `warm`'s answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WarmInfo {
    /// The reference, as given.
    pub layer: String,
    /// The layer's node-local id (its meta image digest).
    pub id: String,
    /// Bytes of its data blobs.
    pub bytes: u64,
    /// How many data blobs it has.
    #[serde(default)]
    pub blobs: usize,
    /// Bytes the cache fetched from the backend while warming (other reads running at the
    /// same time count too).
    pub fetched: u64,
    pub seconds: f64,
    /// Every chunk of every blob is in level 2 (not so when level 2 is too small).
    pub local: bool,
    /// The layer's EROFS is mounted now (a mount keeps the way it reads its blobs until the
    /// layer is mounted again).
    pub mounted: bool,
    /// Its blobs that the current mount reads in passthrough mode (0 when not mounted).
    #[serde(default)]
    pub passthrough_now: u32,
    /// Its next mount would read every blob in passthrough mode (as things stand now: level
    /// 2 may evict chunks before then).
    #[serde(default)]
    pub passthrough_next: bool,
    /// Why not, when `passthrough_next` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_passthrough_because: Option<String>,
}

/// A registered layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerInfo {
    /// The layer's node-local id: its meta image digest.
    pub id: String,
    /// The references it was registered or mounted under.
    pub refs: Vec<String>,
    pub meta_bytes: u64,
    /// Data blobs: digest and size.
    pub blobs: Vec<(String, u64)>,
    /// Explicit registrations (`register` minus `release`).
    pub pins: u32,
    /// User mounts that use it.
    pub users: u32,
    /// Its blobs that its current EROFS mount reads in FUSE passthrough mode, straight from
    /// the level-2 cache (those that were wholly in level 2 when the layer was mounted).
    #[serde(default)]
    pub passthrough_blobs: u32,
    /// Where its EROFS is mounted (while `pins + users > 0`).
    pub mnt: PathBuf,
    /// Bytes of its data blobs read through the cache, and fetched from the backend, since
    /// the daemon started (a blob two layers share counts for both).
    #[serde(default)]
    pub bytes_read: u64,
    #[serde(default)]
    pub bytes_fetched: u64,
    /// Whether its meta image is kept in memory (`NodeConfig::meta_pin_bytes`).
    #[serde(default)]
    pub meta_pinned: bool,
}

/// A user mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountInfo {
    pub mountpoint: PathBuf,
    /// Layer references, first lowest.
    pub layers: Vec<String>,
    /// Layer ids, in the same order.
    pub layer_ids: Vec<String>,
    /// `bind` (one layer, no upper) or `overlay`.
    pub kind: String,
    pub upper: Option<PathBuf>,
    pub work: Option<PathBuf>,
}

/// `stats`'s answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub pong: Pong,
    pub layers: Vec<LayerInfo>,
    pub mounts: Vec<MountInfo>,
    pub cache: CacheStats,
    /// Blob files served by the FUSE mount: digest and size.
    pub blob_files: Vec<(String, u64)>,
    /// The daemon's own counters.
    #[serde(default)]
    pub node: NodeStats,
}

/// The daemon process's counters (part of [`Status`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStats {
    /// Resident memory of the daemon process (`VmRSS`).
    pub rss_bytes: u64,
    /// Since this process started serving.
    pub uptime_seconds: f64,
    /// FUSE read requests of the blob mount being served now.
    pub fuse_requests_in_flight: u64,
    /// FUSE read requests of the blob mount served, bytes they returned, and those answered
    /// with EIO (since this process started).
    pub fuse_reads: u64,
    pub fuse_read_bytes: u64,
    pub fuse_read_errors: u64,
    /// Starts of a daemon on this run directory that found an earlier daemon's state (a
    /// crash, an upgrade or a stop and start), counted over the run directory's life.
    pub restarts: u64,
    /// Those of them that took over the earlier daemon's FUSE connection and mounts.
    pub takeovers: u64,
    /// Bytes of mounted layers' meta images kept in memory, and how many images
    /// (`NodeConfig::meta_pin_bytes`).
    #[serde(default)]
    pub meta_pinned_bytes: u64,
    #[serde(default)]
    pub meta_pinned_layers: u64,
    /// Blobs whose file bounds the cache knows (readahead stops at a file's end), and the
    /// run ends it holds for them.
    #[serde(default)]
    pub file_bounds_blobs: u64,
    #[serde(default)]
    pub file_bounds_ends: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        let line = RequestLine {
            v: VERSION,
            request: Request::Mount {
                layers: vec!["base/os:1".into()],
                mountpoint: "/mnt/x".into(),
                upper: None,
                work: None,
            },
        };
        let text = serde_json::to_string(&line).unwrap();
        assert_eq!(
            text,
            r#"{"v":1,"op":"mount","layers":["base/os:1"],"mountpoint":"/mnt/x"}"#
        );
        let back: RequestLine = serde_json::from_str(&text).unwrap();
        assert_eq!(back.request, line.request);
        let ping: RequestLine = serde_json::from_str(r#"{"v":1,"op":"ping"}"#).unwrap();
        assert_eq!(ping.request, Request::Ping);
        assert!(serde_json::from_str::<RequestLine>(r#"{"v":1,"op":"format_disk"}"#).is_err());
        assert!(serde_json::from_str::<RequestLine>(r#"{"op":"ping"}"#).is_err());
        let err = ResponseLine::failure(ApiError::new(
            ErrorKind::UnknownLayer,
            "layer not found: base/x:1",
        ));
        assert_eq!(
            serde_json::to_string(&err).unwrap(),
            r#"{"v":1,"ok":false,"error":{"kind":"unknown_layer","message":"layer not found: base/x:1"}}"#
        );
        assert_eq!(
            serde_json::to_value(ErrorKind::MountpointInUse).unwrap(),
            ErrorKind::MountpointInUse.as_str()
        );
    }
}
