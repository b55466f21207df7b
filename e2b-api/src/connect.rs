//! The Connect protocol with its JSON codec (connectrpc.com/docs/protocol): unary calls,
//! server streams and client streams, over HTTP/1.1 or HTTP/2.
//!
//! An envelope is 1 flag byte, a 4-byte big-endian length and the message. Flags: `0x01`
//! compressed (refused: nothing here negotiates compression), `0x02` end of stream (the
//! server's last envelope: `{}` or `{"error": …}`).

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::http::{response, Body, Response};
use crate::Error;

pub const FLAG_COMPRESSED: u8 = 0x01;
pub const FLAG_END: u8 = 0x02;

/// The largest envelope accepted from a client.
pub const MAX_ENVELOPE: usize = crate::MAX_JSON_BODY;

/// Connect's error codes (the subset envd answers with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the protocol's table).
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Internal => 500,
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// A Connect error: a code and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.name(), "message": self.message })
    }
}

impl From<Error> for RpcError {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::BadRequest(_) => Code::InvalidArgument,
            Error::Unauthenticated(_) => Code::Unauthenticated,
            Error::NotFound(_) => Code::NotFound,
            Error::Conflict(_) => Code::FailedPrecondition,
            Error::Unsupported(_) => Code::Unimplemented,
            Error::Limit(_) => Code::ResourceExhausted,
            Error::Runtime(_) => Code::Internal,
            Error::Io { .. } => match e.status() {
                404 => Code::NotFound,
                409 => Code::AlreadyExists,
                400 => Code::InvalidArgument,
                403 => Code::PermissionDenied,
                507 => Code::ResourceExhausted,
                _ => Code::Internal,
            },
        };
        RpcError::new(code, e.to_string())
    }
}

pub type RpcResult<T> = std::result::Result<T, RpcError>;

/// Whether the content type is a Connect stream's (`application/connect+json`).
pub fn is_stream_content_type(ct: &str) -> bool {
    ct.split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/connect+json"))
}

/// One envelope.
pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + json.len());
    b.put_u8(flags);
    b.put_u32(json.len() as u32);
    b.put_slice(json);
    b.freeze()
}

/// A unary call's answer.
pub fn unary_ok(message: &impl Serialize) -> Response {
    match serde_json::to_vec(message) {
        Ok(b) => response(200, "application/json", b),
        Err(e) => unary_error(&RpcError::new(Code::Internal, e.to_string())),
    }
}

/// A unary call's error.
pub fn unary_error(e: &RpcError) -> Response {
    response(
        e.code.http_status(),
        "application/json",
        e.json().to_string(),
    )
}

/// Splits a byte stream into envelopes. Incomplete input waits for more; a malformed or
/// oversized envelope is an error.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: BytesMut,
}

impl Decoder {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole envelope: its flags and message.
    pub fn next(&mut self) -> RpcResult<Option<(u8, Bytes)>> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_ENVELOPE {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("an envelope of {len} bytes is larger than {MAX_ENVELOPE}"),
            ));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(RpcError::new(
                Code::Unimplemented,
                "compressed envelopes are not supported",
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let mut whole = self.buf.split_to(5 + len);
        let msg = whole.split_off(5).freeze();
        Ok(Some((flags, msg)))
    }

    /// Bytes left over that do not make an envelope.
    pub fn leftover(&self) -> usize {
        self.buf.len()
    }
}

/// How much of a request body left unread [`crate::http::drain_in_background`] (and so
/// [`MessageReader::drain_in_background`]) reads before it gives up on the connection.
pub const DRAIN_BYTES: usize = 1 << 20;
/// How long it waits for the body's end.
pub const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(60);

/// Reads a client stream's messages one at a time.
#[derive(Debug)]
pub struct MessageReader {
    body: Incoming,
    decoder: Decoder,
    done: bool,
}

impl MessageReader {
    pub fn new(body: Incoming) -> Self {
        Self {
            body,
            decoder: Decoder::default(),
            done: false,
        }
    }

    /// The next message; `None` at the end of the body.
    pub async fn next(&mut self) -> RpcResult<Option<Bytes>> {
        loop {
            if let Some((flags, msg)) = self.decoder.next()? {
                if flags & FLAG_END != 0 {
                    continue;
                }
                return Ok(Some(msg));
            }
            if self.done {
                if self.decoder.leftover() != 0 {
                    return Err(RpcError::new(
                        Code::InvalidArgument,
                        "the request ends inside an envelope",
                    ));
                }
                return Ok(None);
            }
            match self.body.frame().await {
                None => self.done = true,
                Some(Err(e)) => {
                    return Err(RpcError::new(
                        Code::Canceled,
                        format!("reading the request: {e}"),
                    ))
                }
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.decoder.push(&data);
                    }
                }
            }
        }
    }

    /// Read the rest of the body in the background, throwing it away (at most
    /// [`DRAIN_BYTES`] for at most [`DRAIN_TIME`]), for a request whose one message is all
    /// the server needs. Dropped unread instead, the body's end (its chunked terminator, late
    /// when a proxy forwards the body in pieces) would stay in the socket, and HTTP/1.1 closes
    /// a connection with input unread by a reset, which throws away the unsent tail of the
    /// answer: a long server stream to a slow reader arrives cut short.
    pub fn drain_in_background(self) {
        if !self.done {
            crate::http::drain_in_background(self.body);
        }
    }

    /// The next message decoded as `T`.
    pub async fn next_json<T: serde::de::DeserializeOwned>(&mut self) -> RpcResult<Option<T>> {
        match self.next().await? {
            None => Ok(None),
            Some(m) => serde_json::from_slice(&m)
                .map(Some)
                .map_err(|e| RpcError::new(Code::InvalidArgument, format!("bad message: {e}"))),
        }
    }
}

/// The sending half of a server stream.
#[derive(Clone, Debug)]
pub struct StreamSender {
    tx: mpsc::Sender<Bytes>,
}

impl StreamSender {
    /// Send one message; false if the client went away.
    pub async fn send(&self, message: &impl Serialize) -> bool {
        let Ok(b) = serde_json::to_vec(message) else {
            return false;
        };
        self.tx.send(envelope(0, &b)).await.is_ok()
    }

    /// End the stream, with an error or without.
    pub async fn end(self, error: Option<RpcError>) {
        let end = match error {
            None => serde_json::json!({}),
            Some(e) => serde_json::json!({ "error": e.json() }),
        };
        let _ = self
            .tx
            .send(envelope(FLAG_END, end.to_string().as_bytes()))
            .await;
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// A streamed answer (200, `application/connect+json`) and its sender.
pub fn stream_response() -> (StreamSender, Response) {
    let (tx, body) = Body::channel(32);
    let mut r = hyper::Response::new(body);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/connect+json"),
    );
    (StreamSender { tx }, r)
}

/// A stream that fails at once (its error in the end envelope).
pub fn stream_error(e: RpcError) -> Response {
    let end = serde_json::json!({ "error": e.json() }).to_string();
    response(
        200,
        "application/connect+json",
        envelope(FLAG_END, end.as_bytes()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_in_pieces() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&envelope(0, b"{\"a\":1}"));
        wire.extend_from_slice(&envelope(FLAG_END, b"{}"));
        let mut d = Decoder::default();
        let mut got = Vec::new();
        for b in &wire {
            d.push(&[*b]);
            while let Some(m) = d.next().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].0, &got[0].1[..]), (0, &b"{\"a\":1}"[..]));
        assert_eq!(got[1].0, FLAG_END);
        assert_eq!(d.leftover(), 0);
    }

    #[test]
    fn hostile_envelopes_are_errors() {
        let mut d = Decoder::default();
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next().unwrap_err().code, Code::ResourceExhausted);
        let mut d = Decoder::default();
        d.push(&envelope(FLAG_COMPRESSED, b"x"));
        assert_eq!(d.next().unwrap_err().code, Code::Unimplemented);
        let mut d = Decoder::default();
        d.push(&[0, 0, 0]);
        assert_eq!(d.next().unwrap(), None);
    }
}
