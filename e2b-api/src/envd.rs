//! envd, implemented on the node: a request with `E2b-Sandbox-Id` is that sandbox's envd.
//! The access token (`X-Access-Token`) is checked first; then `GET /health`, `/files`, and
//! the Connect services by path (`/<package>.<Service>/<Method>`).

use std::sync::Arc;

use base64::Engine as _;
use http::Method;
use hyper::body::Incoming;

use crate::connect::{self, Code, RpcError};
use crate::fs::{Names, Root, User};
use crate::http::{error, error_with, header, no_content, Response};
use crate::state::Api;
use crate::{Error, Result};

/// The envd port the SDK names in `E2b-Sandbox-Port`; other ports are the sandbox's own
/// services (not proxied by this node).
pub const ENVD_PORT: &str = "49983";

/// What a handler knows of the sandbox and the caller.
#[derive(Debug)]
pub struct Ctx {
    pub api: Arc<Api>,
    pub id: String,
    /// The user named by `Authorization: Basic base64(user:)`; `None`: the default (root).
    pub user_name: Option<String>,
    /// `Keepalive-Ping-Interval` (seconds) for streams.
    pub keepalive_s: Option<u64>,
}

impl Ctx {
    /// The sandbox's root, confined.
    pub fn root(&self) -> Result<Root> {
        let view = self.api.view(&self.id)?;
        Root::open(&view)
    }

    /// The caller's user (and the names of the sandbox's users).
    pub fn user(&self, root: &Root) -> Result<(User, Names)> {
        let names = root.names();
        let user = match self.user_name.as_deref() {
            None | Some("") => User::root(),
            Some(u) => names.lookup(u)?,
        };
        Ok((user, names))
    }

    /// `user` of a request, else the caller's.
    pub fn user_named(&self, root: &Root, name: Option<&str>) -> Result<(User, Names)> {
        match name {
            Some(n) if !n.is_empty() => {
                let names = root.names();
                Ok((names.lookup(n)?, names))
            }
            _ => self.user(root),
        }
    }
}

/// The user of a Basic `Authorization` header (`base64("user:")`).
fn basic_user(value: &str) -> Option<String> {
    let b64 = value
        .strip_prefix("Basic ")
        .or_else(|| value.strip_prefix("basic "))?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    Some(s.split_once(':').map_or(s.as_str(), |(u, _)| u).to_owned())
}

/// Serve one envd request for sandbox `id`.
pub async fn handle(api: &Arc<Api>, id: &str, req: hyper::Request<Incoming>) -> Response {
    serve(api, id, req, false).await
}

/// Serve a signed `/files` request for sandbox `id` (its signature is its authorization).
pub async fn handle_signed(api: &Arc<Api>, id: &str, req: hyper::Request<Incoming>) -> Response {
    serve(api, id, req, true).await
}

async fn serve(api: &Arc<Api>, id: &str, req: hyper::Request<Incoming>, signed: bool) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    let is_rpc = path.matches('/').count() == 2 && path.get(1..).is_some_and(|p| p.contains('.'));
    // A refusal before the body is read: the body is drained meanwhile, so that the client
    // gets to read the refusal (`crate::http::drain_in_background`).
    let refuse = |body: Incoming, r: Response| {
        crate::http::drain_in_background(body);
        r
    };
    let unavailable = |msg: String| {
        if is_rpc {
            connect::unary_error(&RpcError::new(Code::Unavailable, msg))
        } else {
            error_with(502, &msg)
        }
    };
    let Some(meta) = api.meta(id) else {
        // What E2B's proxy answers for a sandbox it does not have: the SDK's
        // "sandbox was not found" (`SandboxNotRunningException`).
        let msg = format!("The sandbox {id} was not found");
        return refuse(body, unavailable(msg));
    };
    if let Some(port) = header(&parts, "e2b-sandbox-port") {
        if port != ENVD_PORT {
            let msg = format!(
                "port {port} of sandbox {id}: this node proxies only envd (port is not open)"
            );
            return refuse(body, error_with(502, &msg));
        }
    }
    let token = header(&parts, "x-access-token").unwrap_or("");
    if !signed && !crate::state::ct_eq(token.as_bytes(), meta.access_token.as_bytes()) {
        let e = Error::Unauthenticated("invalid or missing X-Access-Token".into());
        return refuse(
            body,
            if is_rpc {
                connect::unary_error(&RpcError::from(e))
            } else {
                error(&e)
            },
        );
    }
    if meta.paused {
        let msg = format!("sandbox {id} is paused (connect to resume it)");
        return refuse(body, unavailable(msg));
    }
    let ctx = Ctx {
        api: api.clone(),
        id: id.to_owned(),
        user_name: header(&parts, "authorization").and_then(basic_user),
        keepalive_s: header(&parts, "keepalive-ping-interval")
            .and_then(|v| v.trim().parse().ok())
            .filter(|s| *s > 0),
    };
    if signed && path != "/files" {
        return refuse(body, error_with(401, "a signature authorizes /files only"));
    }
    match (&parts.method, path.as_str()) {
        (&Method::GET, "/health") => no_content(),
        (&Method::GET, "/files") => crate::files::download(&ctx, &parts).await,
        (&Method::POST, "/files") => crate::files::upload(&ctx, &parts, body).await,
        (&Method::POST, p) if p.starts_with("/process.Process/") => {
            crate::process::handle(ctx, &p["/process.Process/".len()..], &parts, body).await
        }
        (&Method::POST, p) if p.starts_with("/filesystem.Filesystem/") => {
            crate::filesystem::handle(ctx, &p["/filesystem.Filesystem/".len()..], &parts, body)
                .await
        }
        (m, p) if is_rpc => connect::unary_error(&RpcError::new(
            Code::Unimplemented,
            format!("{m} {p}: no such procedure"),
        )),
        (m, p) => error_with(404, &format!("no route {m} {p}")),
    }
}

/// Decode a unary or single-message stream request into `T`, by its content type.
pub async fn request_message<T: serde::de::DeserializeOwned>(
    parts: &http::request::Parts,
    body: Incoming,
) -> std::result::Result<T, RpcError> {
    let ct = header(parts, "content-type").unwrap_or("");
    if connect::is_stream_content_type(ct) {
        let mut r = connect::MessageReader::new(body);
        let m: Option<T> = r.next_json().await?;
        r.drain_in_background();
        m.ok_or_else(|| RpcError::new(Code::InvalidArgument, "the stream has no request message"))
    } else {
        let b = crate::http::read_body(body, crate::MAX_JSON_BODY)
            .await
            .map_err(RpcError::from)?;
        crate::http::parse_json(&b).map_err(RpcError::from)
    }
}

pub(crate) fn fuzz(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = basic_user(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_users_parse() {
        // base64("user:") and base64("root:")
        assert_eq!(basic_user("Basic dXNlcjo=").as_deref(), Some("user"));
        assert_eq!(basic_user("Basic cm9vdDo=").as_deref(), Some("root"));
        assert_eq!(basic_user("Bearer x"), None);
        assert_eq!(basic_user("Basic !!!"), None);
    }
}
