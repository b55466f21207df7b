//! The HTTP plumbing every handler shares: the response body (whole, or a stream fed by a
//! channel), JSON answers and errors, bounded request bodies, query strings.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::mpsc;

use crate::{Error, Result};

/// A response body: bytes known up front, a stream of chunks from a channel (a Connect
/// stream, a file download; it ends when its sender is dropped), or the body of a response
/// proxied from a sandbox's port.
#[derive(Debug)]
pub struct Body(Inner);

#[derive(Debug)]
enum Inner {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
    Proxied(Incoming),
}

impl Body {
    pub fn full(b: impl Into<Bytes>) -> Body {
        let b = b.into();
        Body(Inner::Full((!b.is_empty()).then_some(b)))
    }

    pub fn empty() -> Body {
        Body(Inner::Full(None))
    }

    /// A streamed body and the sender that feeds it.
    pub fn channel(depth: usize) -> (mpsc::Sender<Bytes>, Body) {
        let (tx, rx) = mpsc::channel(depth);
        (tx, Body(Inner::Stream(rx)))
    }

    /// The body of a response from elsewhere, passed through as it comes.
    pub fn proxied(b: Incoming) -> Body {
        Body(Inner::Proxied(b))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    /// Only a proxied body fails (its origin went away mid-body): the client then sees the
    /// body cut short, never a truncation passed off as whole.
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, hyper::Error>>> {
        match &mut self.0 {
            Inner::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
            Inner::Proxied(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Inner::Full(b) => b.is_none(),
            Inner::Stream(_) => false,
            Inner::Proxied(b) => http_body::Body::is_end_stream(b),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Inner::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Inner::Stream(_) => SizeHint::default(),
            Inner::Proxied(b) => http_body::Body::size_hint(b),
        }
    }
}

pub type Response = hyper::Response<Body>;

/// A response with `status`, `content_type` and `body`.
pub fn response(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response {
    let mut r = hyper::Response::new(Body::full(body));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

/// `value` as a JSON answer.
pub fn json(status: u16, value: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(b) => response(status, "application/json", b),
        Err(e) => error(&Error::Runtime(format!("encode the answer: {e}"))),
    }
}

/// An empty answer (204).
pub fn no_content() -> Response {
    let mut r = hyper::Response::new(Body::empty());
    *r.status_mut() = hyper::StatusCode::NO_CONTENT;
    r
}

/// The E2B API's error shape: `{"code": <status>, "message": "…"}`.
pub fn error(e: &Error) -> Response {
    error_with(e.status(), &e.to_string())
}

pub fn error_with(status: u16, message: &str) -> Response {
    json(
        status,
        &serde_json::json!({ "code": status, "message": message }),
    )
}

/// Read and discard a request's body in the background (at most
/// [`crate::connect::DRAIN_BYTES`], for at most [`crate::connect::DRAIN_TIME`]), for a
/// response sent without reading it: an early refusal (a wrong key or token, no such
/// sandbox). hyper closes an HTTP/1.1 connection whose request body was dropped unread; a
/// client still writing that body (a process start's stream) then fails with EPIPE before it
/// reads the refusal, and reports "unavailable" instead of what it was told.
pub fn drain_in_background(mut body: Incoming) {
    if http_body::Body::is_end_stream(&body) {
        return;
    }
    tokio::spawn(async move {
        let mut left = crate::connect::DRAIN_BYTES;
        let _ = tokio::time::timeout(crate::connect::DRAIN_TIME, async {
            while let Some(Ok(f)) = body.frame().await {
                let n = f.data_ref().map_or(0, |d| d.len());
                match left.checked_sub(n) {
                    Some(l) => left = l,
                    None => return,
                }
            }
        })
        .await;
    });
}

/// The whole request body, at most `max` bytes (more: an error, never a truncation).
pub async fn read_body(body: Incoming, max: usize) -> Result<Bytes> {
    match http_body_util::Limited::new(body, max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(Error::Limit(format!(
                    "the request body is larger than {max} bytes"
                )))
            } else {
                Err(Error::BadRequest(format!("reading the request body: {e}")))
            }
        }
    }
}

/// A JSON request body as `T`; an empty body is `{}`.
pub async fn read_json<T: serde::de::DeserializeOwned>(body: Incoming) -> Result<T> {
    let b = read_body(body, crate::MAX_JSON_BODY).await?;
    parse_json(&b)
}

pub fn parse_json<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T> {
    let b: &[u8] = if b.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        b
    };
    serde_json::from_slice(b).map_err(|e| Error::BadRequest(format!("bad JSON body: {e}")))
}

/// The query's pairs, percent-decoded (`+` is a space).
pub fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    let Some(q) = query else { return vec![] };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (form_decode(k), form_decode(v)),
            None => (form_decode(p), String::new()),
        })
        .collect()
}

/// The first value of `name` in the query.
pub fn query_get(pairs: &[(String, String)], name: &str) -> Option<String> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

/// `application/x-www-form-urlencoded` decoding of one component (lossy on bad UTF-8).
pub fn form_decode(s: &str) -> String {
    percent_decode(&s.replace('+', " "))
}

/// Percent-decoding; a `%` not followed by two hex digits stays as it is.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A header's value as text, if present and printable.
pub fn header<'a>(req: &'a http::request::Parts, name: &str) -> Option<&'a str> {
    req.headers.get(name).and_then(|v| v.to_str().ok())
}

/// Accept connections on `listener` until the task is dropped, each served by `handle` as
/// HTTP/1.1 (keep-alive, upgrades joined) or h2c. `what` names the listener in logs. The
/// node's API and the cluster front both serve through this.
pub async fn serve_connections<F, Fut>(
    listener: tokio::net::TcpListener,
    what: &'static str,
    handle: F,
) where
    F: Fn(hyper::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response> + Send + 'static,
{
    use hyper_util::rt::{TokioExecutor, TokioIo};
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: wait a little rather than spin.
                tracing::warn!("{what}: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let response = handle(req);
                async move { Ok::<_, std::convert::Infallible>(response.await) }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder.http1().keep_alive(true);
            builder.http2().max_concurrent_streams(1000);
            if let Err(e) = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!("{what}: connection from {peer}: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode() {
        let q = query_pairs(Some("path=%2Ftmp%2Fa%20b&username=&x=1+2&bad=%zz&t=%4"));
        assert_eq!(query_get(&q, "path").as_deref(), Some("/tmp/a b"));
        assert_eq!(query_get(&q, "username").as_deref(), Some(""));
        assert_eq!(query_get(&q, "x").as_deref(), Some("1 2"));
        assert_eq!(query_get(&q, "bad").as_deref(), Some("%zz"));
        assert_eq!(query_get(&q, "t").as_deref(), Some("%4"));
        assert_eq!(query_get(&q, "none"), None);
        assert!(query_pairs(None).is_empty());
    }
}
