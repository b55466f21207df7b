//! Puts: a body that fits one part is a single `PutObject`; a larger one a multipart upload
//! whose parts go up [`super::S3Config::concurrency`] at a time, completed atomically, and
//! aborted on any failure or when the put is dropped half-way (the module docs of `s3.rs`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::SystemTime;

use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::primitives::ByteStream as SdkBody;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;

use super::{etag_of_unparsed_200, Inner, MAX_PARTS};
use crate::backend::retry::RetryPolicy;
use crate::backend::{ByteStream, ObjectMeta, PutMode};
use crate::error::{Error, Result};

impl Inner {
    pub(super) async fn put_single(
        &self,
        key: &str,
        body: Bytes,
        mode: PutMode,
        retry: Option<&RetryPolicy>,
    ) -> Result<ObjectMeta> {
        let full = self.object_key(key);
        let if_none_match = (mode == PutMode::Create).then(|| "*".to_owned());
        let out = self
            .call("put", key, retry, || {
                let req = self.client.put_object().bucket(&self.bucket).key(&full);
                req.content_length(body.len() as i64)
                    .set_if_none_match(if_none_match.clone())
                    .body(SdkBody::from(body.clone()))
                    .send()
            })
            .await?;
        Ok(self.written(key, body.len() as u64, out.e_tag()))
    }

    pub(super) async fn put_multipart(
        self: &Arc<Self>,
        key: &str,
        first: Bytes,
        parts: &mut PartReader,
        mode: PutMode,
        retry: Option<&RetryPolicy>,
    ) -> Result<ObjectMeta> {
        if mode == PutMode::Create {
            match self.head(key, retry).await {
                Ok(_) => {
                    let (backend, key) = (self.name.clone(), key.to_owned());
                    return Err(Error::AlreadyExists { backend, key });
                }
                Err(Error::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let full = self.object_key(key);
        let out = self
            .call("put", key, retry, || {
                let req = self.client.create_multipart_upload();
                req.bucket(&self.bucket).key(&full).send()
            })
            .await?;
        let Some(upload_id) = out.upload_id().map(str::to_owned) else {
            let msg = "CreateMultipartUpload returned no upload id".to_owned();
            return Err(self.fail("put", key, msg, None));
        };
        let retry = retry.cloned();
        let mut guard = AbortOnDrop(Some((
            Arc::clone(self),
            key.to_owned(),
            upload_id.clone(),
            retry.clone(),
        )));
        let result = self
            .upload_parts(key, &upload_id, first, parts, retry.as_ref())
            .await;
        let result = match result {
            Ok((done, total)) => {
                let r = retry.as_ref();
                self.complete(key, &upload_id, done, total, mode, r).await
            }
            Err(e) => Err(e),
        };
        if result.is_err() {
            self.abort(key, &upload_id, retry.as_ref()).await;
        }
        guard.0 = None;
        result
    }

    /// Upload `first` and the rest of `parts`, at most `concurrency` at once; returns the
    /// completed parts in order and the total size.
    async fn upload_parts(
        self: &Arc<Self>,
        key: &str,
        upload_id: &str,
        first: Bytes,
        parts: &mut PartReader,
        retry: Option<&RetryPolicy>,
    ) -> Result<(Vec<CompletedPart>, u64)> {
        let mut tasks = tokio::task::JoinSet::new();
        let mut done = Vec::new();
        let (mut total, mut number, mut last) = (0u64, 0i32, false);
        let mut next = Some(first);
        let result: Result<()> = async {
            while let Some(part) = next.take() {
                number += 1;
                if number > MAX_PARTS {
                    let size = self.part_size;
                    let msg =
                        format!("more than {MAX_PARTS} parts of {size} bytes; raise part_size");
                    return Err(self.fail("put", key, msg, None));
                }
                total += part.len() as u64;
                let (inner, k, id) = (Arc::clone(self), key.to_owned(), upload_id.to_owned());
                let retry = retry.cloned();
                tasks.spawn(async move {
                    inner
                        .upload_part(&k, &id, number, part, retry.as_ref())
                        .await
                });
                while tasks.len() >= self.concurrency {
                    done.push(self.joined(key, tasks.join_next().await)?);
                }
                if last {
                    break;
                }
                let (part, is_last) = parts
                    .next_part()
                    .await
                    .map_err(|e| self.body_error(key, e))?;
                last = is_last;
                next = Some(part).filter(|p| !p.is_empty());
            }
            while !tasks.is_empty() {
                done.push(self.joined(key, tasks.join_next().await)?);
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            tasks.shutdown().await;
            return Err(e);
        }
        done.sort_by_key(|p: &CompletedPart| p.part_number());
        Ok((done, total))
    }

    fn joined(
        &self,
        key: &str,
        res: Option<std::result::Result<Result<CompletedPart>, tokio::task::JoinError>>,
    ) -> Result<CompletedPart> {
        match res {
            Some(Ok(part)) => part,
            Some(Err(e)) => Err(self.fail("put", key, format!("part upload task: {e}"), None)),
            None => Err(self.fail("put", key, "no part upload running".to_owned(), None)),
        }
    }

    pub(super) fn body_error(&self, key: &str, e: std::io::Error) -> Error {
        self.fail(
            "put",
            key,
            format!("the body stream failed: {e}"),
            Some(Box::new(e)),
        )
    }

    async fn upload_part(
        &self,
        key: &str,
        upload_id: &str,
        number: i32,
        body: Bytes,
        retry: Option<&RetryPolicy>,
    ) -> Result<CompletedPart> {
        let full = self.object_key(key);
        let out = self
            .call("upload part of", key, retry, || {
                let req = self.client.upload_part().bucket(&self.bucket).key(&full);
                req.upload_id(upload_id)
                    .part_number(number)
                    .content_length(body.len() as i64)
                    .body(SdkBody::from(body.clone()))
                    .send()
            })
            .await?;
        let Some(etag) = out.e_tag() else {
            let msg = format!("part {number}: no ETag in the response");
            return Err(self.fail("upload part of", key, msg, None));
        };
        Ok(CompletedPart::builder()
            .part_number(number)
            .e_tag(etag)
            .build())
    }

    async fn complete(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        total: u64,
        mode: PutMode,
        retry: Option<&RetryPolicy>,
    ) -> Result<ObjectMeta> {
        let full = self.object_key(key);
        let if_none_match = (mode == PutMode::Create).then(|| "*".to_owned());
        let upload = CompletedMultipartUpload::builder()
            .set_parts(Some(parts))
            .build();
        let result = self
            .call("put", key, retry, || {
                let req = self.client.complete_multipart_upload().bucket(&self.bucket);
                let req = req
                    .key(&full)
                    .upload_id(upload_id)
                    .multipart_upload(upload.clone())
                    .set_if_none_match(if_none_match.clone());
                async move {
                    match req.send().await {
                        Ok(out) => Ok(out.e_tag().map(str::to_owned)),
                        Err(e) => etag_of_unparsed_200(&e).map(Some).ok_or(e),
                    }
                }
            })
            .await;
        match result {
            Ok(etag) => Ok(self.written(key, total, etag.as_deref())),
            // A retry after a lost response finds the upload already completed.
            Err(e @ Error::Backend { attempts: 2.., .. })
                if e.to_string().contains("NoSuchUpload") =>
            {
                match self.head(key, retry).await {
                    Ok(meta) if meta.size == total => Ok(meta),
                    _ => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Abort a multipart upload, best effort (failures are logged).
    async fn abort(&self, key: &str, upload_id: &str, retry: Option<&RetryPolicy>) {
        if let Err(e) = self.try_abort(key, upload_id, retry).await {
            tracing::warn!(error = %e, upload_id, "could not abort a multipart upload; it stays pending");
        }
    }

    /// Abort a multipart upload (of `key`, relative to the prefix); one already gone is not
    /// an error.
    async fn try_abort(
        &self,
        key: &str,
        upload_id: &str,
        retry: Option<&RetryPolicy>,
    ) -> Result<()> {
        let full = self.object_key(key);
        self.call("abort multipart upload of", key, retry, || {
            let req = self.client.abort_multipart_upload().bucket(&self.bucket);
            let req = req.key(&full).upload_id(upload_id);
            async move {
                match req.send().await {
                    Err(e) if e.code() == Some("NoSuchUpload") => Ok(None),
                    other => other.map(Some),
                }
            }
        })
        .await
        .map(|_| ())
    }

    /// The multipart uploads under the prefix begun before `before`, aborted unless
    /// `dry_run` ([`crate::Backend::sweep_abandoned`]): a put's upload that its process never
    /// completed or aborted (killed half-way; or dropped between the server creating the
    /// upload and the id reaching it). One whose start S3 does not give is left alone.
    pub(super) async fn sweep_uploads(
        &self,
        before: SystemTime,
        dry_run: bool,
    ) -> Result<Vec<String>> {
        let prefix = self.object_key("");
        let mut out = Vec::new();
        let (mut key_marker, mut id_marker) = (None::<String>, None::<String>);
        loop {
            let page = self
                .call("list multipart uploads under", &prefix, None, || {
                    let mut req = self.client.list_multipart_uploads().bucket(&self.bucket);
                    if !prefix.is_empty() {
                        req = req.prefix(&prefix);
                    }
                    if let Some(k) = &key_marker {
                        req = req.key_marker(k);
                    }
                    if let Some(u) = &id_marker {
                        req = req.upload_id_marker(u);
                    }
                    req.send()
                })
                .await?;
            for upload in page.uploads() {
                let (Some(full), Some(id)) = (upload.key(), upload.upload_id()) else {
                    continue;
                };
                let begun = upload
                    .initiated()
                    .and_then(|t| SystemTime::try_from(*t).ok());
                let Some(begun) = begun.filter(|&t| t < before) else {
                    continue;
                };
                let key = full.strip_prefix(&prefix).unwrap_or(full);
                if !dry_run {
                    self.try_abort(key, id, None).await?;
                }
                let when = humantime::format_rfc3339_seconds(begun);
                out.push(format!("multipart upload of {key} begun {when} (id {id})"));
            }
            key_marker = page.next_key_marker().map(str::to_owned);
            id_marker = page.next_upload_id_marker().map(str::to_owned);
            if page.is_truncated() != Some(true) || (key_marker.is_none() && id_marker.is_none()) {
                break;
            }
        }
        out.sort();
        Ok(out)
    }
}

/// Aborts the multipart upload from a spawned task if the put future is dropped half-way.
struct AbortOnDrop(Option<(Arc<Inner>, String, String, Option<RetryPolicy>)>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        let Some((inner, key, upload_id, retry)) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move { inner.abort(&key, &upload_id, retry.as_ref()).await });
            }
            Err(_) => tracing::warn!(
                backend = %inner.name, key, upload_id,
                "put cancelled outside a runtime; multipart upload left pending"
            ),
        }
    }
}

/// Cuts a body stream into parts of exactly `part_size` bytes (the last one shorter),
/// without copying when a chunk already holds a whole part.
pub(super) struct PartReader {
    body: ByteStream,
    chunks: VecDeque<Bytes>,
    len: usize,
    part_size: usize,
    eof: bool,
}

impl PartReader {
    pub(super) fn new(body: ByteStream, part_size: usize) -> Self {
        Self {
            body,
            chunks: VecDeque::new(),
            len: 0,
            part_size,
            eof: false,
        }
    }

    /// The next part, and whether it is the last one. Reads one byte past the part so that a
    /// body ending exactly on a part boundary is known to end there.
    pub(super) async fn next_part(&mut self) -> std::io::Result<(Bytes, bool)> {
        while !self.eof && self.len <= self.part_size {
            match self.body.next().await {
                Some(Ok(chunk)) if chunk.is_empty() => {}
                Some(Ok(chunk)) => {
                    self.len += chunk.len();
                    self.chunks.push_back(chunk);
                }
                Some(Err(e)) => return Err(e),
                None => self.eof = true,
            }
        }
        let part = self.take(self.len.min(self.part_size));
        Ok((part, self.eof && self.len == 0))
    }

    fn take(&mut self, n: usize) -> Bytes {
        if let Some(front) = self.chunks.front_mut() {
            if front.len() >= n {
                let part = front.split_to(n);
                if front.is_empty() {
                    self.chunks.pop_front();
                }
                self.len -= n;
                return part;
            }
        }
        let mut out = BytesMut::with_capacity(n);
        while out.len() < n {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            let want = n - out.len();
            if front.len() <= want {
                out.extend_from_slice(front);
                self.chunks.pop_front();
            } else {
                out.extend_from_slice(&front.split_to(want));
            }
        }
        self.len -= out.len();
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn parts_are_cut_exactly() {
        for (total, piece) in [(0, 1), (10, 3), (12, 4), (13, 100), (25, 5)] {
            let data: Vec<u8> = (0..total as u8).collect();
            let chunks: Vec<_> = data
                .chunks(piece)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            let mut reader = PartReader::new(futures::stream::iter(chunks).boxed(), 4);
            let mut got = Vec::new();
            loop {
                let (part, last) = reader.next_part().await.unwrap();
                assert!(
                    part.len() == 4 || last,
                    "{total}/{piece}: short part before the end"
                );
                got.extend_from_slice(&part);
                if last {
                    break;
                }
            }
            assert_eq!(got, data, "{total}/{piece}");
        }
    }
}
