//! The control plane's requests that concern every node: the merged sandbox list (with
//! paging of its own), metrics of several sandboxes, snapshots, template deletion.

use std::sync::Arc;

use http::Method;

use super::proxy::call;
use super::Front;
use crate::http::{error, error_with, json, no_content, query_get, query_pairs, Response};
use crate::{Error, Result};

/// Query parameters the front pages and orders by itself (the rest are filters, passed on).
const OWN: [&str; 3] = ["limit", "nextToken", "order"];

/// `s` percent-encoded for a query component (unreserved characters kept).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Every sandbox of node `node` that `filters` (a query string) match, following its pages.
async fn node_list(
    front: &Front,
    node: usize,
    path: &str,
    filters: &str,
    key: &str,
) -> Result<Vec<serde_json::Value>> {
    let mut all = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let mut q = format!(
            "limit=1000{}{filters}",
            if filters.is_empty() { "" } else { "&" }
        );
        if let Some(t) = &next {
            q.push_str(&format!("&nextToken={}", encode(t)));
        }
        let (status, headers, body) =
            call(front, node, Method::GET, &format!("{path}?{q}"), key, None).await?;
        if status == 400 {
            return Err(Error::BadRequest(
                String::from_utf8_lossy(&body).into_owned(),
            ));
        }
        if status != 200 {
            return Err(Error::Runtime(format!(
                "node {}: {status}: {}",
                front.watcher.nodes()[node].url,
                String::from_utf8_lossy(&body)
            )));
        }
        let page: Vec<serde_json::Value> = serde_json::from_slice(&body)
            .map_err(|e| Error::Runtime(format!("a node's list: {e}")))?;
        all.extend(page);
        match headers.get("x-next-token").and_then(|v| v.to_str().ok()) {
            Some(t) => next = Some(t.to_owned()),
            None => return Ok(all),
        }
    }
}

/// `GET [/v2]/sandboxes`: every live node's matching sandboxes, sorted by start then id (as
/// a node sorts), paged here (`limit`, `nextToken` = the id of the next page's first).
pub async fn sandboxes(front: &Arc<Front>, path: &str, query: Option<&str>, key: &str) -> Response {
    let q = query_pairs(query);
    let limit: usize = match query_get(&q, "limit") {
        Some(l) => match l.parse().ok().filter(|l| (1..=1000).contains(l)) {
            Some(l) => l,
            None => return error(&Error::BadRequest(format!("bad limit {l:?} (1–1000)"))),
        },
        None => 100,
    };
    let desc = query_get(&q, "order").as_deref() == Some("desc");
    let next = query_get(&q, "nextToken");
    let filters: Vec<String> = q
        .iter()
        .filter(|(k, _)| !OWN.contains(&k.as_str()))
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect();
    let filters = filters.join("&");
    let view = front.watcher.view();
    let lists = futures::future::join_all(
        view.alive()
            .map(|n| node_list(front, n, path, &filters, key)),
    )
    .await;
    let mut all = Vec::new();
    for l in lists {
        match l {
            Ok(l) => all.extend(l),
            // A filter a node refuses is refused by all: its answer is the client's.
            Err(Error::BadRequest(m)) => return crate::http::response(400, "application/json", m),
            Err(e) => tracing::warn!("front: list: {e}"),
        }
    }
    let key_of = |v: &serde_json::Value| {
        (
            v["startedAt"].as_str().unwrap_or("").to_owned(),
            v["sandboxID"].as_str().unwrap_or("").to_owned(),
        )
    };
    all.sort_by_key(key_of);
    if desc {
        all.reverse();
    }
    let start = match &next {
        Some(t) => match all.iter().position(|v| v["sandboxID"].as_str() == Some(t)) {
            Some(p) => p,
            None => return error(&Error::BadRequest(format!("bad nextToken {t:?}"))),
        },
        None => 0,
    };
    let page: Vec<&serde_json::Value> = all.iter().skip(start).take(limit).collect();
    let mut r = json(200, &page);
    if let Some(id) = all.get(start + limit).and_then(|v| v["sandboxID"].as_str()) {
        if let Ok(v) = http::HeaderValue::from_str(id) {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    r
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: each id's node asked for its own.
pub async fn metrics(front: &Arc<Front>, query: Option<&str>, key: &str) -> Response {
    let q = query_pairs(query);
    let ids: Vec<String> = query_get(&q, "sandbox_ids")
        .map(|s| s.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    let mut by_node: std::collections::BTreeMap<usize, Vec<String>> = Default::default();
    for id in ids.into_iter().take(100) {
        if let Ok(n) = front.node_of(&id) {
            by_node.entry(n).or_default().push(id);
        }
    }
    let answers = futures::future::join_all(by_node.into_iter().map(|(n, ids)| async move {
        let pq = format!("/sandboxes/metrics?sandbox_ids={}", encode(&ids.join(",")));
        call(front, n, Method::GET, &pq, key, None).await
    }))
    .await;
    let mut out = serde_json::Map::new();
    for a in answers.into_iter().flatten() {
        if a.0 != 200 {
            continue;
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&a.2) {
            if let Some(m) = v["sandboxes"].as_object() {
                out.extend(m.clone());
            }
        }
    }
    json(200, &serde_json::json!({ "sandboxes": out }))
}

/// `GET /snapshots`: every live node's, concatenated.
pub async fn snapshots(front: &Arc<Front>, path: &str, query: Option<&str>, key: &str) -> Response {
    let pq = match query {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    let view = front.watcher.view();
    let answers = futures::future::join_all(
        view.alive()
            .map(|n| call(front, n, Method::GET, &pq, key, None)),
    )
    .await;
    let mut all: Vec<serde_json::Value> = Vec::new();
    for a in answers {
        match a {
            Ok((200, _, b)) => {
                if let Ok(serde_json::Value::Array(v)) = serde_json::from_slice(&b) {
                    all.extend(v);
                }
            }
            Ok((status, _, b)) => return crate::http::response(status, "application/json", b),
            Err(e) => tracing::warn!("front: snapshots: {e}"),
        }
    }
    json(200, &all)
}

/// `DELETE /templates/{id}`: on every live node that has it (204 if one did, 404 if none).
pub async fn delete_template(front: &Arc<Front>, path: &str, key: &str) -> Response {
    let view = front.watcher.view();
    let answers = futures::future::join_all(
        view.alive()
            .map(|n| call(front, n, Method::DELETE, path, key, None)),
    )
    .await;
    let mut other = None;
    let mut deleted = false;
    for a in answers {
        match a {
            Ok((204, _, _)) => deleted = true,
            Ok((404, _, _)) => {}
            Ok((status, _, b)) => other = Some((status, b)),
            Err(e) => tracing::warn!("front: delete template: {e}"),
        }
    }
    match (deleted, other) {
        (true, _) => no_content(),
        (false, Some((status, b))) => crate::http::response(status, "application/json", b),
        (false, None) => error_with(404, &format!("{path}: no node has this template")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn query_components_are_encoded() {
        assert_eq!(super::encode("a=b&c d/é"), "a%3Db%26c%20d%2F%C3%A9");
        assert_eq!(super::encode("n1-ixyz_9.~"), "n1-ixyz_9.~");
    }
}
