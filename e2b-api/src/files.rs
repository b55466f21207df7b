//! envd's `/files`: `GET` downloads a file (gzip when asked), `POST` uploads one or more —
//! `multipart/form-data` (field `file`, its filename the path when the query names none) or
//! a raw `application/octet-stream` body (optionally `Content-Encoding: gzip`). Bodies
//! stream both ways; nothing is held whole in memory. Signed URLs (`signature`,
//! `signature_expiration`) are checked here and routed by the token that signs them.

use std::io::{Read, Write};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::json;
use sha2::Digest;
use tokio::io::AsyncWriteExt;

use crate::envd::Ctx;
use crate::http::{error, header, query_get, query_pairs, Body, Response};
use crate::{Error, Result, MAX_UPLOAD};

const CHUNK: usize = 256 << 10;

/// envd's v1 signature of a file URL.
pub fn signature(path: &str, op: &str, user: &str, token: &str, expiration: Option<u64>) -> String {
    let raw = match expiration {
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The sandbox a signed `/files` request is for: the one whose token signs it (and the
/// signature has not expired).
pub fn signed_sandbox(
    api: &crate::Api,
    method: &http::Method,
    query: Option<&str>,
) -> Result<String> {
    let q = query_pairs(query);
    let sig = query_get(&q, "signature").unwrap_or_default();
    let path = query_get(&q, "path").unwrap_or_default();
    let user = query_get(&q, "username").unwrap_or_default();
    let op = if method == http::Method::GET {
        "read"
    } else {
        "write"
    };
    let expiration = match query_get(&q, "signature_expiration") {
        Some(e) => Some(
            e.parse::<u64>()
                .map_err(|_| Error::BadRequest(format!("bad signature_expiration {e:?}")))?,
        ),
        None => None,
    };
    if let Some(e) = expiration {
        if e.saturating_mul(1000) < crate::time::now_ms() {
            return Err(Error::Unauthenticated("the signature has expired".into()));
        }
    }
    for (id, m) in api.all_meta() {
        let want = signature(&path, op, &user, &m.access_token, expiration);
        if crate::state::ct_eq(want.as_bytes(), sig.as_bytes()) {
            return Ok(id);
        }
    }
    Err(Error::Unauthenticated(
        "invalid signature (no sandbox of this node signs it)".into(),
    ))
}

fn path_and_user(
    ctx: &Ctx,
    query: Option<&str>,
) -> Result<(crate::fs::Root, Option<String>, crate::fs::User)> {
    let q = query_pairs(query);
    let root = ctx.root()?;
    let (user, _) = ctx.user_named(&root, query_get(&q, "username").as_deref())?;
    Ok((root, query_get(&q, "path"), user))
}

/// `GET /files?path=…`: the file's bytes.
pub async fn download(ctx: &Ctx, parts: &http::request::Parts) -> Response {
    match download_inner(ctx, parts).await {
        Ok(r) => r,
        Err(e) => error(&e),
    }
}

async fn download_inner(ctx: &Ctx, parts: &http::request::Parts) -> Result<Response> {
    let (root, path, user) = path_and_user(ctx, parts.uri.query())?;
    let path = path
        .filter(|p| !p.is_empty())
        .ok_or_else(|| Error::BadRequest("no path to download".into()))?;
    let abs = crate::fs::absolute(&path, &user.home)?;
    let (mut file, size) = match root.open_file(&abs) {
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NotFound(format!("path '{abs}' does not exist")))
        }
        r => r?,
    };
    let gzip = header(parts, "accept-encoding").is_some_and(|v| {
        v.split(',')
            .any(|e| e.trim().split(';').next() == Some("gzip"))
    });
    let (tx, body) = Body::channel(4);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; CHUNK];
        let mut enc =
            gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        loop {
            let n = match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // The client sees a body cut short, as with any failed transfer.
                Err(_) => return,
            };
            let out = match enc.as_mut() {
                Some(enc) => {
                    if enc.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    std::mem::take(enc.get_mut())
                }
                None => buf[..n].to_vec(),
            };
            if !out.is_empty() && tx.blocking_send(Bytes::from(out)).is_err() {
                return;
            }
        }
        if let Some(enc) = enc {
            if let Ok(rest) = enc.finish() {
                let _ = tx.blocking_send(Bytes::from(rest));
            }
        }
    });
    let mut r = hyper::Response::new(body);
    let h = r.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/octet-stream"),
    );
    if gzip {
        h.insert(
            http::header::CONTENT_ENCODING,
            http::HeaderValue::from_static("gzip"),
        );
    } else if let Ok(v) = http::HeaderValue::from_str(&size.to_string()) {
        h.insert(http::header::CONTENT_LENGTH, v);
    }
    let name = abs
        .rsplit('/')
        .next()
        .unwrap_or("file")
        .replace(['"', '\\', '\r', '\n'], "_");
    if let Ok(v) = http::HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        h.insert(http::header::CONTENT_DISPOSITION, v);
    }
    Ok(r)
}

/// `POST /files`: write the uploaded file(s); their entries.
pub async fn upload(ctx: &Ctx, parts: &http::request::Parts, body: Incoming) -> Response {
    match upload_inner(ctx, parts, body).await {
        Ok(v) => crate::http::json(200, &v),
        Err(e) => error(&e),
    }
}

fn entry(abs: &str, metadata: &std::collections::BTreeMap<String, String>) -> serde_json::Value {
    let mut e = json!({
        "name": abs.rsplit('/').next().unwrap_or(""),
        "type": "file",
        "path": abs,
    });
    if !metadata.is_empty() {
        e["metadata"] = json!(metadata);
    }
    e
}

/// The upload's `X-Metadata-<key>: value` headers (keys lowercased: header names are
/// case-insensitive), checked as the SDK checks them.
fn upload_metadata(
    parts: &http::request::Parts,
) -> Result<std::collections::BTreeMap<String, String>> {
    let mut m = std::collections::BTreeMap::new();
    for (name, value) in &parts.headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        let ok_key = !key.is_empty()
            && key.len() <= 200
            && key
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c));
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|c| (0x20..0x7f).contains(&c)) && v.len() <= 4096);
        match (ok_key, value) {
            (true, Some(v)) => {
                m.insert(key.to_owned(), v.to_owned());
            }
            _ => {
                return Err(Error::BadRequest(format!(
                    "bad metadata header {name}: a token key and a printable ASCII value"
                )))
            }
        }
    }
    if m.len() > 64 {
        return Err(Error::BadRequest("at most 64 metadata entries".into()));
    }
    Ok(m)
}

/// Writes a stream of chunks to a sandbox file, counting against [`MAX_UPLOAD`].
struct Sink {
    file: tokio::fs::File,
    written: u64,
    abs: String,
}

impl Sink {
    async fn write(&mut self, data: &[u8]) -> Result<()> {
        self.written += data.len() as u64;
        if self.written > MAX_UPLOAD {
            return Err(Error::Limit(format!(
                "the upload is larger than {MAX_UPLOAD} bytes"
            )));
        }
        self.file
            .write_all(data)
            .await
            .map_err(|e| Error::io(format!("write {}", self.abs), e))
    }

    async fn finish(
        mut self,
        metadata: &std::collections::BTreeMap<String, String>,
    ) -> Result<serde_json::Value> {
        self.file
            .flush()
            .await
            .map_err(|e| Error::io(format!("write {}", self.abs), e))?;
        crate::fs::set_metadata(&self.file, metadata)?;
        Ok(entry(&self.abs, metadata))
    }
}

fn open_sink(root: &crate::fs::Root, abs: &str, user: &crate::fs::User) -> Result<Sink> {
    let f = root.create_file(abs, user)?;
    Ok(Sink {
        file: tokio::fs::File::from_std(f),
        written: 0,
        abs: abs.to_owned(),
    })
}

async fn next_chunk(body: &mut Incoming) -> Result<Option<Bytes>> {
    loop {
        match body.frame().await {
            None => return Ok(None),
            Some(Err(e)) => return Err(Error::BadRequest(format!("reading the upload: {e}"))),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    return Ok(Some(d));
                }
            }
        }
    }
}

async fn upload_inner(
    ctx: &Ctx,
    parts: &http::request::Parts,
    mut body: Incoming,
) -> Result<Vec<serde_json::Value>> {
    let (root, path, user) = path_and_user(ctx, parts.uri.query())?;
    let metadata = upload_metadata(parts)?;
    let ct = header(parts, "content-type").unwrap_or("").to_owned();
    let mime = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let gzip = match header(parts, "content-encoding").map(|v| v.trim().to_ascii_lowercase()) {
        None => false,
        Some(e) if e == "identity" || e.is_empty() => false,
        Some(e) if e == "gzip" => true,
        Some(e) => {
            return Err(Error::BadRequest(format!(
                "unsupported Content-Encoding {e}"
            )))
        }
    };
    if mime == "multipart/form-data" {
        if gzip {
            return Err(Error::BadRequest(
                "a gzip Content-Encoding is for octet-stream uploads only".into(),
            ));
        }
        let boundary = multipart_boundary(&ct)
            .ok_or_else(|| Error::BadRequest("multipart/form-data without a boundary".into()))?;
        return upload_multipart(&root, path, &user, &boundary, &metadata, &mut body).await;
    }
    if mime != "application/octet-stream" && !mime.is_empty() {
        return Err(Error::BadRequest(format!(
            "unsupported Content-Type {mime} (multipart/form-data or application/octet-stream)"
        )));
    }
    let path = path
        .filter(|p| !p.is_empty())
        .ok_or_else(|| Error::BadRequest("an octet-stream upload needs a path".into()))?;
    let abs = crate::fs::absolute(&path, &user.home)?;
    let mut sink = open_sink(&root, &abs, &user)?;
    let mut gz = gzip.then(|| flate2::write::GzDecoder::new(Vec::new()));
    while let Some(chunk) = next_chunk(&mut body).await? {
        match gz.as_mut() {
            Some(d) => {
                d.write_all(&chunk)
                    .map_err(|e| Error::BadRequest(format!("bad gzip body: {e}")))?;
                let out = std::mem::take(d.get_mut());
                sink.write(&out).await?;
            }
            None => sink.write(&chunk).await?,
        }
    }
    if let Some(d) = gz {
        let rest = d
            .finish()
            .map_err(|e| Error::BadRequest(format!("bad gzip body: {e}")))?;
        sink.write(&rest).await?;
    }
    Ok(vec![sink.finish(&metadata).await?])
}

fn multipart_boundary(ct: &str) -> Option<String> {
    ct.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_owned())
            .filter(|b| !b.is_empty() && b.len() <= 200)
    })
}

/// A part's headers: its form name and filename.
fn part_names(headers: &[u8]) -> (Option<String>, Option<String>) {
    let text = String::from_utf8_lossy(headers);
    let mut name = None;
    let mut filename = None;
    for line in text.split("\r\n") {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        if !k.trim().eq_ignore_ascii_case("content-disposition") {
            continue;
        }
        for p in v.split(';').skip(1) {
            let Some((pk, pv)) = p.trim().split_once('=') else {
                continue;
            };
            let pv = pv.trim();
            let pv = pv
                .strip_prefix('"')
                .and_then(|x| x.strip_suffix('"'))
                .unwrap_or(pv)
                .replace("\\\"", "\"");
            match pk.trim().to_ascii_lowercase().as_str() {
                "name" => name = Some(pv),
                "filename" => filename = Some(pv),
                "filename*" => {
                    // RFC 5987: charset'lang'percent-encoded
                    let enc = pv.splitn(3, '\'').nth(2).unwrap_or(&pv).to_owned();
                    filename = Some(crate::http::percent_decode(&enc));
                }
                _ => {}
            }
        }
    }
    (name, filename)
}

/// The multipart parser's position.
#[derive(Debug, PartialEq, Eq)]
enum Part {
    /// Before the first delimiter.
    Preamble,
    /// In a part's headers.
    Headers,
    /// In a part's body.
    Body,
    /// After the closing delimiter.
    Done,
}

/// Upload every `file` part of a multipart body, streaming each to its file.
async fn upload_multipart(
    root: &crate::fs::Root,
    path: Option<String>,
    user: &crate::fs::User,
    boundary: &str,
    metadata: &std::collections::BTreeMap<String, String>,
    body: &mut Incoming,
) -> Result<Vec<serde_json::Value>> {
    let first = format!("--{boundary}");
    let delim = format!("\r\n--{boundary}");
    let mut buf: Vec<u8> = Vec::new();
    let mut state = Part::Preamble;
    let mut sink: Option<Sink> = None;
    let mut skipping = false;
    let mut out = Vec::new();
    let mut eof = false;
    let find = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).position(|w| w == needle);
    loop {
        let mut progressed = true;
        while progressed {
            progressed = false;
            match state {
                Part::Preamble => {
                    if let Some(i) = find(&buf, first.as_bytes()) {
                        buf.drain(..i + first.len());
                        state = Part::Headers;
                        progressed = true;
                    } else if buf.len() > 64 << 10 {
                        return Err(Error::BadRequest("no multipart delimiter".into()));
                    }
                }
                Part::Headers => {
                    // After a delimiter: `--` ends the body, CRLF starts a part.
                    if buf.len() >= 2 && &buf[..2] == b"--" {
                        state = Part::Done;
                        progressed = true;
                        continue;
                    }
                    if let Some(i) = find(&buf, b"\r\n\r\n") {
                        let headers: Vec<u8> = buf.drain(..i + 4).collect();
                        let (name, filename) = part_names(&headers);
                        skipping = name.as_deref() != Some("file");
                        if !skipping {
                            let target =
                                match (&path, filename) {
                                    (Some(p), _) if !p.is_empty() && out.is_empty() => p.clone(),
                                    (_, Some(f)) if !f.is_empty() => f,
                                    _ => return Err(Error::BadRequest(
                                        "a file part needs a path (the query's, or its filename)"
                                            .into(),
                                    )),
                                };
                            let abs = crate::fs::absolute(&target, &user.home)?;
                            sink = Some(open_sink(root, &abs, user)?);
                        }
                        state = Part::Body;
                        progressed = true;
                    } else if buf.len() > 16 << 10 {
                        return Err(Error::BadRequest(
                            "a multipart part's headers are too long".into(),
                        ));
                    }
                }
                Part::Body => {
                    if let Some(i) = find(&buf, delim.as_bytes()) {
                        if let Some(s) = sink.as_mut() {
                            s.write(&buf[..i]).await?;
                        }
                        buf.drain(..i + delim.len());
                        if let Some(s) = sink.take() {
                            out.push(s.finish(metadata).await?);
                        }
                        state = Part::Headers;
                        progressed = true;
                    } else if buf.len() > delim.len() {
                        // Everything but what could be the start of a delimiter.
                        let keep = delim.len() - 1;
                        let n = buf.len() - keep;
                        if let Some(s) = sink.as_mut() {
                            if !skipping {
                                s.write(&buf[..n]).await?;
                            }
                        }
                        buf.drain(..n);
                    }
                }
                Part::Done => {}
            }
        }
        if state == Part::Done {
            break;
        }
        if eof {
            return Err(Error::BadRequest("the multipart body ends early".into()));
        }
        match next_chunk(body).await? {
            Some(c) => buf.extend_from_slice(&c),
            None => eof = true,
        }
    }
    if out.is_empty() {
        return Err(Error::BadRequest("no `file` part in the upload".into()));
    }
    Ok(out)
}

/// The upload's header parsers on `data` (the fuzz target's entry).
pub(crate) fn fuzz(data: &[u8]) {
    let _ = part_names(data);
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = multipart_boundary(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_match_the_sdks() {
        // sha256("/a:read::tok") in standard base64 without padding.
        let s = signature("/a", "read", "", "tok", None);
        assert!(s.starts_with("v1_") && !s.ends_with('='));
        assert_eq!(s.len(), 3 + 43);
        assert_ne!(s, signature("/a", "write", "", "tok", None));
        assert_ne!(s, signature("/a", "read", "", "tok", Some(1)));
    }

    #[test]
    fn multipart_headers_parse() {
        let (n, f) = part_names(
            b"Content-Disposition: form-data; name=\"file\"; filename=\"/tmp/a b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\n",
        );
        assert_eq!(
            (n.as_deref(), f.as_deref()),
            (Some("file"), Some("/tmp/a b.txt"))
        );
        assert_eq!(
            multipart_boundary("multipart/form-data; boundary=\"abc\"").as_deref(),
            Some("abc")
        );
        assert_eq!(multipart_boundary("multipart/form-data"), None);
    }
}
