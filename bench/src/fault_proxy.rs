//! A faulty HTTP proxy on 127.0.0.1, for the fault campaign (`tests/faults.rs`) and the soak
//! (`benches/fault_soak.rs`): it stands between the `strata` daemon and an S3 test server
//! (moto) and, under a [`FaultPlan`] and a seed, misbehaves the way networks and object stores
//! do in production. Test support only: nothing in Strata's production paths uses it.
//!
//! # What it does to a request
//! Requests are forwarded one connection each (HTTP/1.1, hyper on both sides) and their
//! answers relayed, except the requests in the plan's scope (by default ranged `GET`s: the
//! chunk cache's reads; puts, listings and whole-object gets pass untouched). For those, in
//! order:
//! 1. **Permanent faults**, by object key: [`FaultPlan::not_found`] keys answer `404
//!    NoSuchKey`, [`FaultPlan::forbidden`] keys `403 AccessDenied`; [`FaultPlan::corrupt`]
//!    (a key and an object offset) flips the byte at the offset in every answer covering it.
//! 2. **Latency**: `latency` plus a uniform `0..jitter`.
//! 3. **One transient fault or none**, drawn from the seeded generator with the plan's rates:
//!    a reset before the headers (the connection is closed with `SO_LINGER` 0, so the client
//!    gets an RST), `500 InternalError`, `503 SlowDown`, `503 ServiceUnavailable`, a reset in
//!    the middle of the body, a truncated body (a correct `Content-Length`, then a clean close
//!    half-way), a stalled body (half sent, then nothing for [`FaultPlan::stall_for`], longer
//!    than the client's request deadline), or a flipped byte. A flip is transient: a range
//!    inside one already flipped is never flipped again, so the cache's refetch of the chunk
//!    gets good bytes.
//!
//! Every injected fault is counted by kind ([`FaultProxy::injected`]). The plan can be
//! changed or ended ([`FaultProxy::end_plan`]) at any time; requests already being answered
//! finish under the plan they started with.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does (see the module docs). [`FaultPlan::default`] does nothing.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    /// Rates (0..1) of the transient faults; at most one per request.
    pub reset_before_headers: f64,
    pub status_500: f64,
    pub slow_down: f64,
    pub status_503: f64,
    pub reset_mid_body: f64,
    pub truncate: f64,
    pub stall: f64,
    pub flip: f64,
    /// How long a stalled body stalls (then the connection is closed).
    pub stall_for: Duration,
    /// Added to every request in scope, plus a uniform `0..jitter`.
    pub latency: Duration,
    pub jitter: Duration,
    /// Object keys (a suffix of the request path) that answer 404.
    pub not_found: Vec<String>,
    /// Object keys (a suffix of the request path) that answer 403.
    pub forbidden: Vec<String>,
    /// (key suffix, object offset): the byte at the offset is flipped in every answer.
    pub corrupt: Vec<(String, u64)>,
    /// Also apply the plan to GETs without a `Range` header.
    pub whole_gets: bool,
}

impl FaultPlan {
    /// Every transient fault at `rate` each (a stall at a fifth of it: each costs the client a
    /// request deadline), stalls of `stall_for`, and `latency` ± `jitter`.
    pub fn transient(rate: f64, stall_for: Duration, latency: Duration, jitter: Duration) -> Self {
        Self {
            reset_before_headers: rate,
            status_500: rate,
            slow_down: rate,
            status_503: rate,
            reset_mid_body: rate,
            truncate: rate,
            stall: rate / 5.0,
            flip: rate,
            stall_for,
            latency,
            jitter,
            ..Self::default()
        }
    }
}

/// Kinds of injected faults, as [`FaultProxy::injected`] names them.
pub const FAULT_KINDS: [&str; 11] = [
    "reset_before_headers",
    "status_500",
    "slow_down",
    "status_503",
    "reset_mid_body",
    "truncate",
    "stall",
    "flip",
    "not_found",
    "forbidden",
    "corrupt",
];

struct Shared {
    plan: Mutex<Arc<FaultPlan>>,
    rng: Mutex<fastrand::Rng>,
    injected: Mutex<BTreeMap<&'static str, u64>>,
    /// Ranges (key, object range) already flipped by a transient flip.
    flipped: Mutex<Vec<(String, Range<u64>)>>,
    upstream: SocketAddr,
    requests: Mutex<u64>,
}

impl Shared {
    fn count(&self, kind: &'static str) {
        *lock(&self.injected).entry(kind).or_default() += 1;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The proxy: its own runtime on its own threads, so that blocking tests and benches can
/// use it. Stops when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .finish()
    }
}

impl FaultProxy {
    /// A proxy on a free port of 127.0.0.1 in front of `upstream` (`http://127.0.0.1:PORT`),
    /// its faults drawn from `seed`; no plan yet (everything passes).
    pub fn start(upstream: &str, seed: u64) -> Result<FaultProxy, String> {
        let host = upstream.trim_start_matches("http://").trim_end_matches('/');
        let upstream: SocketAddr = host
            .parse()
            .map_err(|e| format!("upstream {upstream:?} is not http://IP:PORT: {e}"))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .map_err(|e| format!("start the proxy's runtime: {e}"))?;
        let listener = runtime
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .map_err(|e| format!("bind 127.0.0.1:0: {e}"))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("the proxy's address: {e}"))?;
        let shared = Arc::new(Shared {
            plan: Mutex::new(Arc::new(FaultPlan::default())),
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
            injected: Mutex::default(),
            flipped: Mutex::default(),
            upstream,
            requests: Mutex::new(0),
        });
        runtime.spawn(accept_loop(listener, shared.clone()));
        Ok(FaultProxy {
            addr,
            shared,
            runtime: Some(runtime),
        })
    }

    /// `http://127.0.0.1:PORT`: the endpoint to give clients.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Follow `plan` from the next request on.
    pub fn set_plan(&self, plan: FaultPlan) {
        *lock(&self.shared.plan) = Arc::new(plan);
    }

    /// No more faults from the next request on.
    pub fn end_plan(&self) {
        self.set_plan(FaultPlan::default());
    }

    /// Faults injected so far, by kind (every kind of [`FAULT_KINDS`] listed).
    pub fn injected(&self) -> BTreeMap<&'static str, u64> {
        let m = lock(&self.shared.injected);
        FAULT_KINDS
            .iter()
            .map(|k| (*k, m.get(k).copied().unwrap_or(0)))
            .collect()
    }

    /// Requests forwarded or answered so far.
    pub fn requests(&self) -> u64 {
        *lock(&self.shared.requests)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            let reset = Arc::new(AtomicBool::new(false));
            let io = Resettable {
                inner: stream,
                reset: reset.clone(),
            };
            let svc = hyper::service::service_fn(move |req| {
                let (shared, reset) = (shared.clone(), reset.clone());
                async move { handle(shared, reset, req).await }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(io), svc)
                .await;
        });
    }
}

/// A connection that, once `reset` is set, is closed with an RST (`SO_LINGER` 0) when
/// dropped.
struct Resettable {
    inner: TcpStream,
    reset: Arc<AtomicBool>,
}

impl Drop for Resettable {
    fn drop(&mut self) {
        if self.reset.load(Ordering::Relaxed) {
            let _ = self.inner.set_zero_linger();
        }
    }
}

impl AsyncRead for Resettable {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Resettable {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// The error a service returns to make hyper drop the connection without an answer.
#[derive(Debug)]
struct Abort;

impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection aborted by the fault plan")
    }
}

impl std::error::Error for Abort {}

fn full(b: Bytes) -> Body {
    Full::new(b)
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// An S3 error answer.
fn s3_error(status: u16, code: &str) -> hyper::Response<Body> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
         <Message>injected by the fault proxy</Message><RequestId>fault</RequestId></Error>"
    );
    let mut r = hyper::Response::new(full(Bytes::from(body)));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/xml"),
    );
    r
}

/// `bytes=a-b` → `a..b+1`.
fn parse_range(v: &str) -> Option<Range<u64>> {
    let (a, b) = v.strip_prefix("bytes=")?.split_once('-')?;
    let a: u64 = a.trim().parse().ok()?;
    let b: u64 = b.trim().parse().ok()?;
    (b >= a).then(|| a..b + 1)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BodyFault {
    None,
    ResetMid,
    Truncate,
    Stall,
}

async fn handle(
    shared: Arc<Shared>,
    reset: Arc<AtomicBool>,
    req: hyper::Request<Incoming>,
) -> Result<hyper::Response<Body>, Abort> {
    *lock(&shared.requests) += 1;
    let plan = lock(&shared.plan).clone();
    let path = req.uri().path().to_owned();
    let range = req
        .headers()
        .get(http::header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_range);
    let in_scope = req.method() == http::Method::GET && (range.is_some() || plan.whole_gets);
    let mut flip_at: Vec<u64> = Vec::new();
    let mut body_fault = BodyFault::None;
    let mut transient_flip = false;
    if in_scope {
        let covers = |off: u64| range.as_ref().is_none_or(|r| r.contains(&off));
        if plan.not_found.iter().any(|k| path.ends_with(k.as_str())) {
            shared.count("not_found");
            return Ok(s3_error(404, "NoSuchKey"));
        }
        if plan.forbidden.iter().any(|k| path.ends_with(k.as_str())) {
            shared.count("forbidden");
            return Ok(s3_error(403, "AccessDenied"));
        }
        for (k, off) in &plan.corrupt {
            if path.ends_with(k.as_str()) && covers(*off) {
                shared.count("corrupt");
                flip_at.push(*off);
            }
        }
        let (delay, draw) = {
            let mut rng = lock(&shared.rng);
            let jitter = plan.jitter.as_micros() as u64;
            let extra = if jitter > 0 { rng.u64(0..jitter) } else { 0 };
            (plan.latency + Duration::from_micros(extra), rng.f64())
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let mut at = 0.0;
        let mut hit = |rate: f64| {
            let h = draw >= at && draw < at + rate;
            at += rate;
            h
        };
        if hit(plan.reset_before_headers) {
            shared.count("reset_before_headers");
            reset.store(true, Ordering::Relaxed);
            return Err(Abort);
        } else if hit(plan.status_500) {
            shared.count("status_500");
            return Ok(s3_error(500, "InternalError"));
        } else if hit(plan.slow_down) {
            shared.count("slow_down");
            return Ok(s3_error(503, "SlowDown"));
        } else if hit(plan.status_503) {
            shared.count("status_503");
            return Ok(s3_error(503, "ServiceUnavailable"));
        } else if hit(plan.reset_mid_body) {
            body_fault = BodyFault::ResetMid;
        } else if hit(plan.truncate) {
            body_fault = BodyFault::Truncate;
        } else if hit(plan.stall) {
            body_fault = BodyFault::Stall;
        } else if hit(plan.flip) {
            transient_flip = true;
        }
    }

    // Forward.
    let upstream = match forward(&shared, req).await {
        Ok(r) => r,
        Err(e) => return Ok(s3_error(502, &format!("ProxyUpstream: {e}"))),
    };
    let (mut parts, body) = upstream.into_parts();
    let ok =
        parts.status == hyper::StatusCode::OK || parts.status == hyper::StatusCode::PARTIAL_CONTENT;
    if !in_scope || !ok {
        return Ok(hyper::Response::from_parts(
            parts,
            body.map_err(std::io::Error::other).boxed_unsync(),
        ));
    }
    let mut data = match body.collect().await {
        Ok(b) => b.to_bytes().to_vec(),
        Err(e) => return Ok(s3_error(502, &format!("ProxyUpstreamBody: {e}"))),
    };
    // Where the answer starts in the object.
    let start = parts
        .headers
        .get(http::header::CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes "))
        .and_then(|v| v.split_once('-'))
        .and_then(|(a, _)| a.parse::<u64>().ok())
        .unwrap_or(0);
    for off in flip_at {
        if let Some(b) = off
            .checked_sub(start)
            .and_then(|i| data.get_mut(i as usize))
        {
            *b ^= 0x5a;
        }
    }
    if transient_flip && !data.is_empty() {
        let here = start..start + data.len() as u64;
        let mut flipped = lock(&shared.flipped);
        let again = flipped
            .iter()
            .any(|(k, r)| *k == path && r.start <= here.start && here.end <= r.end);
        if !again {
            let i = lock(&shared.rng).usize(0..data.len());
            data[i] ^= 0xa5;
            flipped.push((path.clone(), here));
            shared.count("flip");
        }
    }
    let data = Bytes::from(data);
    let body = match body_fault {
        BodyFault::None => full(data),
        fault => {
            shared.count(match fault {
                BodyFault::ResetMid => "reset_mid_body",
                BodyFault::Truncate => "truncate",
                _ => "stall",
            });
            if fault == BodyFault::ResetMid {
                reset.store(true, Ordering::Relaxed);
            }
            let half = data.slice(..data.len() / 2);
            let stall = plan.stall_for;
            let frames = futures::stream::unfold(0u8, move |step| {
                let half = half.clone();
                async move {
                    match step {
                        0 => Some((Ok(Frame::data(half)), 1)),
                        1 => {
                            // Pending for a while lets hyper send the headers and the first
                            // half; only then does the body stall or break off.
                            let pause = if fault == BodyFault::Stall {
                                stall
                            } else {
                                Duration::from_millis(30)
                            };
                            tokio::time::sleep(pause).await;
                            // Ending the body short of its Content-Length makes hyper close
                            // the connection (with an RST if `reset` is set).
                            Some((Err(std::io::Error::other("cut by the fault plan")), 2))
                        }
                        _ => None,
                    }
                }
            });
            StreamBody::new(frames).boxed_unsync()
        }
    };
    parts.headers.remove(http::header::TRANSFER_ENCODING);
    Ok(hyper::Response::from_parts(parts, body))
}

/// Send `req` to the upstream server on a new connection.
async fn forward(
    shared: &Shared,
    req: hyper::Request<Incoming>,
) -> Result<hyper::Response<Incoming>, String> {
    let stream = TcpStream::connect(shared.upstream)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    sender
        .send_request(req)
        .await
        .map_err(|e| format!("send: {e}"))
}
