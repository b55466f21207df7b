//! [`S3Backend`]: the [`Backend`] trait over any S3-compatible object store.
//!
//! # Key layout
//! A store URL `s3://BUCKET/PREFIX` keeps object `key` at `PREFIX/key` in `BUCKET` (at `key`
//! when there is no prefix). Listing asks S3 for `PREFIX/` + the list prefix and strips
//! `PREFIX/` back off; objects whose remainder is not a valid key (directory markers such as
//! `PREFIX/dir/`) are skipped. The backend displays as `s3://BUCKET/PREFIX`, and every error
//! names it together with the operation and the key.
//!
//! # Puts
//! The body stream is cut into parts of [`S3Config::part_size`] bytes (8 MiB by default, at
//! least 5 MiB, the S3 minimum). A body that fits in one part is a single `PutObject`. A larger
//! one is a multipart upload: `CreateMultipartUpload`, then `UploadPart` with at most
//! [`S3Config::concurrency`] parts in flight (so about `concurrency + 1` parts are held in
//! memory), then `CompleteMultipartUpload`, which publishes the object atomically. On any
//! failure (the body stream, a part, the completion) the upload is aborted before the error
//! is returned, and a put future dropped half-way aborts it from a spawned task, so no pending
//! upload is left behind. [`PutMode::Create`] sends `If-None-Match: *` on `PutObject` and on
//! `CompleteMultipartUpload`; `412 PreconditionFailed` and `409 ConditionalRequestConflict`
//! become [`Error::AlreadyExists`]. A multipart create first checks with a HEAD so that a
//! large body is not uploaded just to be refused.
//!
//! # Retries
//! The SDK's own retries are disabled; every request runs under [`RetryPolicy::run`] with
//! the backend's policy. Transient (retried): throttling codes (`SlowDown`, `Throttling`,
//! `ThrottlingException`, `RequestTimeout`, ...), HTTP 429 and 5xx except 501 (`NotImplemented`
//! will not change), timeouts, connection and I/O failures, responses that could not be read.
//! Permanent: every other 4xx (`RequestTimeTooSkewed` included), missing credentials, invalid
//! requests. `NoSuchKey`/`NoSuchBucket`/404 become [`Error::NotFound`].
//!
//! # Credentials
//! Only environment variables (`AWS_ACCESS_KEY_ID`, ...) and the shared profile files are
//! consulted, never instance metadata (IMDS), container endpoints or SSO. Without credentials
//! a request fails at once with a permanent error saying so.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::environment::credentials::EnvironmentVariableCredentialsProvider;
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::profile::ProfileFileCredentialsProvider;
use aws_config::provider_config::ProviderConfig;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{future, ProvideCredentials};
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, Region, RequestChecksumCalculation, ResponseChecksumValidation,
    SharedCredentialsProvider,
};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream as SdkBody;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;

use super::retry::{RetryContext, RetryPolicy};
use super::{clamp_range, validate_key, validate_prefix, Backend, ByteStream, ObjectMeta, PutMode};
use crate::error::{BoxError, Error, Result};

/// The smallest part S3 accepts for every part of a multipart upload but the last.
pub const MIN_PART_SIZE: usize = 5 << 20;
/// The default multipart part size.
pub const DEFAULT_PART_SIZE: usize = 8 << 20;
/// The most parts one multipart upload may have.
const MAX_PARTS: i32 = 10_000;

/// Error codes that mean "try again later" (besides any 429 or 5xx status).
const TRANSIENT_CODES: &str = "SlowDown Throttling ThrottlingException ThrottledException \
    RequestThrottled RequestThrottledException TooManyRequestsException RequestLimitExceeded \
    BandwidthLimitExceeded RequestTimeout RequestTimeoutException InternalError \
    ServiceUnavailable OperationAborted";

/// Where an [`S3Backend`] keeps its objects and how it talks to S3.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix without leading or trailing `/` (empty: keys live at the bucket root).
    pub prefix: String,
    /// An `http(s)://host:port` endpoint for S3-compatible stores; `None` means AWS.
    pub endpoint: Option<String>,
    pub region: String,
    /// Path-style addressing (`endpoint/bucket/key`) instead of virtual hosts.
    pub path_style: bool,
    /// The AWS profile to read credentials from.
    pub profile: Option<String>,
    /// Multipart part size in bytes (at least [`MIN_PART_SIZE`]).
    pub part_size: usize,
    /// Multipart parts uploaded at once.
    pub concurrency: usize,
    pub retry: RetryPolicy,
}

impl S3Config {
    /// Defaults for `bucket`: no prefix, AWS endpoint, region from the environment.
    pub fn new(bucket: impl Into<String>) -> Self {
        let region = ["AWS_REGION", "AWS_DEFAULT_REGION"]
            .iter()
            .filter_map(|v| std::env::var(v).ok())
            .find(|r| !r.trim().is_empty())
            .unwrap_or_else(|| "us-east-1".to_owned());
        Self {
            bucket: bucket.into(),
            prefix: String::new(),
            endpoint: None,
            region,
            path_style: false,
            profile: None,
            part_size: DEFAULT_PART_SIZE,
            concurrency: 4,
            retry: RetryPolicy::default(),
        }
    }

    /// Parse `s3://bucket/prefix?endpoint=URL&region=R&path_style=BOOL&profile=NAME`.
    pub fn from_url(url: &url::Url) -> std::result::Result<Self, String> {
        if url.scheme() != "s3" {
            return Err(format!("not an s3:// URL (scheme {:?})", url.scheme()));
        }
        let bucket = url.host_str().unwrap_or_default();
        if bucket.is_empty() {
            return Err("missing bucket name in s3://BUCKET/prefix".to_owned());
        }
        check_bucket(bucket)?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(
                "credentials do not belong in the URL; use the environment or an AWS profile"
                    .to_owned(),
            );
        }
        if url.port().is_some() {
            return Err(
                "a port belongs in the endpoint parameter, not after the bucket".to_owned(),
            );
        }
        if url.fragment().is_some() {
            return Err("unexpected '#' fragment".to_owned());
        }
        let mut config = S3Config::new(bucket);
        let path = percent_decode(url.path())?;
        let path = path.strip_prefix('/').unwrap_or(&path);
        let prefix = path.strip_suffix('/').unwrap_or(path);
        if !prefix.is_empty() {
            validate_key(prefix).map_err(|e| format!("invalid prefix {prefix:?}: {e}"))?;
        }
        config.prefix = prefix.to_owned();

        let mut seen: Vec<String> = Vec::new();
        let mut path_style = None;
        for (name, value) in url.query_pairs() {
            if seen.iter().any(|s| *s == name) {
                return Err(format!("query parameter {name:?} given twice"));
            }
            seen.push(name.to_string());
            match &*name {
                "endpoint" => config.endpoint = Some(check_endpoint(&value)?),
                "region" => {
                    let ok = !value.is_empty()
                        && value.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
                    if !ok {
                        return Err(format!("invalid region {value:?}"));
                    }
                    config.region = value.into_owned();
                }
                "path_style" => {
                    path_style = Some(match &*value {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        v => return Err(format!("path_style must be true or false, not {v:?}")),
                    })
                }
                "profile" => {
                    if value.is_empty() {
                        return Err("empty profile name".to_owned());
                    }
                    config.profile = Some(value.into_owned());
                }
                other => {
                    return Err(format!(
                        "unknown query parameter {other:?} (known: endpoint, region, path_style, profile)"
                    ))
                }
            }
        }
        config.path_style = path_style.unwrap_or(config.endpoint.is_some());
        Ok(config)
    }

    fn check(&self) -> std::result::Result<(), String> {
        check_bucket(&self.bucket)?;
        if !self.prefix.is_empty() {
            validate_key(&self.prefix).map_err(|e| format!("invalid prefix: {e}"))?;
        }
        if self.part_size < MIN_PART_SIZE {
            return Err(format!(
                "part_size {} is below the S3 minimum of {MIN_PART_SIZE} bytes (5 MiB)",
                self.part_size
            ));
        }
        if self.concurrency == 0 {
            return Err("concurrency must be at least 1".to_owned());
        }
        Ok(())
    }
}

impl fmt::Display for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}", self.bucket)?;
        if !self.prefix.is_empty() {
            write!(f, "/{}", self.prefix)?;
        }
        Ok(())
    }
}

fn check_bucket(bucket: &str) -> std::result::Result<(), String> {
    let ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b))
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid bucket name {bucket:?} (3-63 lowercase letters, digits, '.', '-', '_')"
        ))
    }
}

fn check_endpoint(value: &str) -> std::result::Result<String, String> {
    let bad = |why: &str| format!("invalid endpoint {value:?}: {why}");
    let url = url::Url::parse(value).map_err(|e| bad(&e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad("must be an http:// or https:// URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("credentials do not belong in the endpoint"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("no query or fragment allowed"));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

fn percent_decode(s: &str) -> std::result::Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok());
            let byte = hex.and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(byte) = byte else {
                return Err(format!("bad percent escape in {s:?}"));
            };
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("prefix {s:?} is not UTF-8"))
}

/// The [`Backend`] over an S3 bucket (see the module docs).
#[derive(Clone, Debug)]
pub struct S3Backend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: aws_sdk_s3::Client,
    bucket: String,
    prefix: String,
    name: String,
    part_size: usize,
    concurrency: usize,
    retry: RetryPolicy,
}

impl fmt::Display for S3Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.inner.name)
    }
}

impl S3Backend {
    /// Build a client for `config`. Makes no request: a wrong endpoint or bucket shows up on
    /// first use.
    pub async fn connect(config: S3Config) -> Result<S3Backend> {
        let provider = credentials_provider(config.profile.as_deref(), &config.region);
        Self::with_credentials(config, provider)
    }

    fn with_credentials(config: S3Config, creds: SharedCredentialsProvider) -> Result<S3Backend> {
        config.check().map_err(|reason| Error::InvalidUrl {
            url: config.to_string(),
            reason,
        })?;
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(Duration::from_secs(10))
            .build();
        let mut builder = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(config.region.clone()))
            .credentials_provider(creds)
            .force_path_style(config.path_style)
            .retry_config(RetryConfig::disabled())
            .timeout_config(timeouts)
            // Plain payloads work with every S3-compatible store; content is verified above us.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
        if let Some(endpoint) = &config.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        Ok(S3Backend {
            inner: Arc::new(Inner {
                client: aws_sdk_s3::Client::from_conf(builder.build()),
                name: config.to_string(),
                bucket: config.bucket,
                prefix: config.prefix,
                part_size: config.part_size,
                concurrency: config.concurrency,
                retry: config.retry,
            }),
        })
    }
}

/// Environment variables, then the shared profile files (the named profile first when one is
/// given). Profile `credential_source`s that would reach instance metadata or a container
/// endpoint are refused.
fn credentials_provider(profile: Option<&str>, region: &str) -> SharedCredentialsProvider {
    let conf = ProviderConfig::without_region().with_region(Some(Region::new(region.to_owned())));
    let mut files = ProfileFileCredentialsProvider::builder()
        .configure(&conf)
        .with_custom_provider("Ec2InstanceMetadata", Refuse("Ec2InstanceMetadata"))
        .with_custom_provider("EcsContainer", Refuse("EcsContainer"));
    if let Some(name) = profile {
        files = files.profile_name(name);
    }
    let env = EnvironmentVariableCredentialsProvider::new();
    let chain = if profile.is_some() {
        CredentialsProviderChain::first_try("Profile", files.build()).or_else("Environment", env)
    } else {
        CredentialsProviderChain::first_try("Environment", env).or_else("Profile", files.build())
    };
    SharedCredentialsProvider::new(chain)
}

/// A credential source Strata never uses (it would contact a metadata service).
#[derive(Debug)]
struct Refuse(&'static str);

impl ProvideCredentials for Refuse {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::ready(Err(CredentialsError::invalid_configuration(format!(
            "credential_source {} is not supported by Strata (no instance metadata); \
             use environment variables or static profile credentials",
            self.0
        ))))
    }
}

/// How an S3 failure is handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    NotFound,
    /// 412, or 409 `ConditionalRequestConflict`: a conditional write lost.
    Precondition,
    /// 416: the range starts at or past the end.
    RangeNotSatisfiable,
    Transient,
    Permanent,
}

fn classify_status(status: u16, code: Option<&str>) -> Class {
    match code {
        Some("NoSuchKey" | "NoSuchBucket" | "NotFound") => return Class::NotFound,
        Some("PreconditionFailed" | "ConditionalRequestConflict") => return Class::Precondition,
        Some("InvalidRange") => return Class::RangeNotSatisfiable,
        Some("NoSuchUpload" | "RequestTimeTooSkewed" | "NotImplemented") => {
            return Class::Permanent
        }
        Some(c) if TRANSIENT_CODES.split_whitespace().any(|t| t == c) => return Class::Transient,
        _ => {}
    }
    match status {
        404 => Class::NotFound,
        412 => Class::Precondition,
        416 => Class::RangeNotSatisfiable,
        429 => Class::Transient,
        501 => Class::Permanent,
        500..=599 => Class::Transient,
        _ => Class::Permanent,
    }
}

fn classify<E: ProvideErrorMetadata>(err: &SdkError<E>) -> Class {
    match err {
        SdkError::ServiceError(e) => classify_status(e.raw().status().as_u16(), e.err().code()),
        SdkError::TimeoutError(_) => Class::Transient,
        SdkError::ResponseError(e) => match classify_status(e.raw().status().as_u16(), None) {
            // A success or client-error status whose body could not be read: the
            // connection broke mid-response.
            Class::Permanent => Class::Transient,
            other => other,
        },
        SdkError::DispatchFailure(d) => {
            if d.is_user() {
                return Class::Permanent;
            }
            // Identity resolution failures surface as dispatch failures.
            let mut cause = d
                .as_connector_error()
                .map(|c| c as &(dyn std::error::Error + 'static));
            while let Some(e) = cause {
                if let Some(ce) = e.downcast_ref::<CredentialsError>() {
                    return match ce {
                        CredentialsError::ProviderTimedOut(_)
                        | CredentialsError::ProviderError(_) => Class::Transient,
                        _ => Class::Permanent,
                    };
                }
                cause = e.source();
            }
            Class::Transient
        }
        _ => Class::Permanent,
    }
}

/// One-line description: HTTP status, code and message for service errors, the full cause
/// chain otherwise.
fn describe<E>(err: &SdkError<E>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let text = match err {
        SdkError::ServiceError(e) => format!(
            "HTTP {} {}: {}",
            e.raw().status().as_u16(),
            e.err().code().unwrap_or("(no error code)"),
            e.err().message().unwrap_or("(no message)")
        ),
        SdkError::ResponseError(e) => format!(
            "HTTP {}, unreadable response: {}",
            e.raw().status().as_u16(),
            DisplayErrorContext(err)
        ),
        _ => DisplayErrorContext(err).to_string(),
    };
    text.replace(['\n', '\r'], " ")
}

impl Inner {
    fn ctx<'a>(&'a self, op: &'static str, key: &'a str) -> RetryContext<'a> {
        RetryContext {
            backend: &self.name,
            op,
            key,
        }
    }

    fn object_key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }

    /// A permanent failure that is not an SDK error.
    fn fail(&self, op: &'static str, key: &str, msg: String, src: Option<BoxError>) -> Error {
        self.failure(op, key, msg, false, src)
    }

    fn failure(
        &self,
        op: &'static str,
        key: &str,
        msg: String,
        transient: bool,
        src: Option<BoxError>,
    ) -> Error {
        Error::Backend {
            backend: self.name.clone(),
            op,
            key: key.to_owned(),
            attempts: 1,
            message: msg,
            transient,
            source: src,
        }
    }

    /// Map an SDK error: 404s to [`Error::NotFound`], failed preconditions (only create-puts
    /// send one) to [`Error::AlreadyExists`], the rest to [`Error::Backend`].
    fn sdk_error<E>(&self, op: &'static str, key: &str, err: SdkError<E>) -> Error
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let (backend, key) = (self.name.clone(), key.to_owned());
        match classify(&err) {
            Class::NotFound => Error::NotFound { backend, key },
            Class::Precondition => Error::AlreadyExists { backend, key },
            class => Error::Backend {
                backend,
                op,
                key,
                attempts: 1,
                message: describe(&err),
                transient: class == Class::Transient,
                source: Some(Box::new(err)),
            },
        }
    }

    /// One S3 request under the retry policy; `send` sends a fresh request per attempt.
    async fn call<T, E, Fut>(
        &self,
        op: &'static str,
        key: &str,
        mut send: impl FnMut() -> Fut,
    ) -> Result<T>
    where
        Fut: Future<Output = std::result::Result<T, SdkError<E>>>,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let ctx = self.ctx(op, key);
        self.retry
            .run(ctx, |_| {
                let sent = send();
                async move { sent.await.map_err(|e| self.sdk_error(op, key, e)) }
            })
            .await
    }

    /// GET the object, ranged if `range` is given; `None` if S3 answered 416.
    async fn get_object(&self, key: &str, range: Option<Range<u64>>) -> Result<Option<Bytes>> {
        let full = self.object_key(key);
        let header = range.as_ref().map(|r| match r.end {
            u64::MAX => format!("bytes={}-", r.start),
            end => format!("bytes={}-{}", r.start, end - 1),
        });
        let got = self
            .retry
            .run(self.ctx("get", key), |_| {
                let req = self.client.get_object().bucket(&self.bucket).key(&full);
                let req = req.set_range(header.clone());
                async move {
                    let out = match req.send().await {
                        Ok(out) => out,
                        Err(e) if classify(&e) == Class::RangeNotSatisfiable => return Ok(None),
                        Err(e) => return Err(self.sdk_error("get", key, e)),
                    };
                    let (expected, ranged) = (out.content_length(), out.content_range().is_some());
                    let body = match out.body.collect().await {
                        Ok(body) => body.into_bytes(),
                        Err(e) => {
                            let msg = format!("reading the response body failed: {e}");
                            return Err(self.failure("get", key, msg, true, Some(Box::new(e))));
                        }
                    };
                    if expected.is_some_and(|n| u64::try_from(n).ok() != Some(body.len() as u64)) {
                        let msg =
                            format!("short body: {} bytes, expected {expected:?}", body.len());
                        return Err(self.failure("get", key, msg, true, None));
                    }
                    Ok(Some((body, ranged)))
                }
            })
            .await?;
        match (got, range) {
            (None, _) => Ok(None),
            // The store ignored the Range header and sent the whole object: cut it here.
            (Some((body, false)), Some(r)) => {
                let r = clamp_range(&self.name, key, r, body.len() as u64)?;
                Ok(Some(body.slice(r.start as usize..r.end as usize)))
            }
            (Some((body, _)), _) => Ok(Some(body)),
        }
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        let full = self.object_key(key);
        let out = self
            .call("head", key, || {
                self.client
                    .head_object()
                    .bucket(&self.bucket)
                    .key(&full)
                    .send()
            })
            .await?;
        Ok(ObjectMeta {
            key: key.to_owned(),
            size: u64::try_from(out.content_length().unwrap_or(0)).unwrap_or(0),
            etag: out.e_tag().map(str::to_owned),
            last_modified: out
                .last_modified()
                .and_then(|t| SystemTime::try_from(*t).ok()),
        })
    }

    /// Metadata for a just-written object: from a HEAD if it still shows our ETag.
    async fn written(&self, key: &str, size: u64, etag: Option<&str>) -> ObjectMeta {
        match self.head(key).await {
            Ok(meta) if etag.is_some() && meta.etag.as_deref() == etag => meta,
            _ => ObjectMeta {
                key: key.to_owned(),
                size,
                etag: etag.map(str::to_owned),
                last_modified: None,
            },
        }
    }

    async fn put_single(&self, key: &str, body: Bytes, mode: PutMode) -> Result<ObjectMeta> {
        let full = self.object_key(key);
        let if_none_match = (mode == PutMode::Create).then(|| "*".to_owned());
        let out = self
            .call("put", key, || {
                let req = self.client.put_object().bucket(&self.bucket).key(&full);
                req.content_length(body.len() as i64)
                    .set_if_none_match(if_none_match.clone())
                    .body(SdkBody::from(body.clone()))
                    .send()
            })
            .await?;
        Ok(self.written(key, body.len() as u64, out.e_tag()).await)
    }

    async fn put_multipart(
        self: &Arc<Self>,
        key: &str,
        first: Bytes,
        parts: &mut PartReader,
        mode: PutMode,
    ) -> Result<ObjectMeta> {
        if mode == PutMode::Create {
            match self.head(key).await {
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
            .call("put", key, || {
                let req = self.client.create_multipart_upload();
                req.bucket(&self.bucket).key(&full).send()
            })
            .await?;
        let Some(upload_id) = out.upload_id().map(str::to_owned) else {
            let msg = "CreateMultipartUpload returned no upload id".to_owned();
            return Err(self.fail("put", key, msg, None));
        };
        let mut guard = AbortOnDrop(Some((Arc::clone(self), key.to_owned(), upload_id.clone())));
        let result = self.upload_parts(key, &upload_id, first, parts).await;
        let result = match result {
            Ok((done, total)) => self.complete(key, &upload_id, done, total, mode).await,
            Err(e) => Err(e),
        };
        guard.0 = None;
        if result.is_err() {
            self.abort(key, &upload_id).await;
        }
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
                tasks.spawn(async move { inner.upload_part(&k, &id, number, part).await });
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

    fn body_error(&self, key: &str, e: std::io::Error) -> Error {
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
    ) -> Result<CompletedPart> {
        let full = self.object_key(key);
        let out = self
            .call("upload part of", key, || {
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
    ) -> Result<ObjectMeta> {
        let full = self.object_key(key);
        let if_none_match = (mode == PutMode::Create).then(|| "*".to_owned());
        let upload = CompletedMultipartUpload::builder()
            .set_parts(Some(parts))
            .build();
        let result = self
            .call("put", key, || {
                let req = self.client.complete_multipart_upload().bucket(&self.bucket);
                req.key(&full)
                    .upload_id(upload_id)
                    .multipart_upload(upload.clone())
                    .set_if_none_match(if_none_match.clone())
                    .send()
            })
            .await;
        match result {
            Ok(out) => Ok(self.written(key, total, out.e_tag()).await),
            // A retry after a lost response finds the upload already completed.
            Err(e @ Error::Backend { attempts: 2.., .. })
                if e.to_string().contains("NoSuchUpload") =>
            {
                match self.head(key).await {
                    Ok(meta) if meta.size == total => Ok(meta),
                    _ => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Abort a multipart upload, best effort (failures are logged).
    async fn abort(&self, key: &str, upload_id: &str) {
        let full = self.object_key(key);
        let res = self
            .call("abort multipart upload of", key, || {
                let req = self.client.abort_multipart_upload().bucket(&self.bucket);
                let req = req.key(&full).upload_id(upload_id);
                async move {
                    match req.send().await {
                        Err(e) if e.code() == Some("NoSuchUpload") => Ok(None),
                        other => other.map(Some),
                    }
                }
            })
            .await;
        if let Err(e) = res {
            tracing::warn!(error = %e, upload_id, "could not abort a multipart upload; it stays pending");
        }
    }
}

/// Aborts the multipart upload from a spawned task if the put future is dropped half-way.
struct AbortOnDrop(Option<(Arc<Inner>, String, String)>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        let Some((inner, key, upload_id)) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move { inner.abort(&key, &upload_id).await });
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
struct PartReader {
    body: ByteStream,
    chunks: VecDeque<Bytes>,
    len: usize,
    part_size: usize,
    eof: bool,
}

impl PartReader {
    fn new(body: ByteStream, part_size: usize) -> Self {
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
    async fn next_part(&mut self) -> std::io::Result<(Bytes, bool)> {
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

#[async_trait]
impl Backend for S3Backend {
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        validate_key(key)?;
        let inner = &self.inner;
        if range.start < range.end {
            if let Some(bytes) = inner.get_object(key, Some(range.clone())).await? {
                return Ok(bytes);
            }
        }
        // An empty range, or S3 said 416: the size decides between "no bytes" and an error.
        let meta = inner.head(key).await?;
        let clamped = clamp_range(&inner.name, key, range, meta.size)?;
        if clamped.is_empty() {
            return Ok(Bytes::new());
        }
        // The object grew between the GET and the HEAD: read again.
        Ok(inner
            .get_object(key, Some(clamped))
            .await?
            .unwrap_or_default())
    }

    async fn get(&self, key: &str) -> Result<Bytes> {
        validate_key(key)?;
        Ok(self.inner.get_object(key, None).await?.unwrap_or_default())
    }

    async fn put_stream(&self, key: &str, body: ByteStream, mode: PutMode) -> Result<ObjectMeta> {
        validate_key(key)?;
        let inner = &self.inner;
        let mut parts = PartReader::new(body, inner.part_size);
        let (first, last) = parts
            .next_part()
            .await
            .map_err(|e| inner.body_error(key, e))?;
        if last {
            inner.put_single(key, first, mode).await
        } else {
            inner.put_multipart(key, first, &mut parts, mode).await
        }
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        self.inner.head(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        validate_prefix(prefix)?;
        let inner = &self.inner;
        let strip = match inner.prefix.as_str() {
            "" => String::new(),
            p => format!("{p}/"),
        };
        let full = format!("{strip}{prefix}");
        let (mut out, mut token) = (Vec::new(), None::<String>);
        loop {
            let page = inner
                .call("list", prefix, || {
                    let req = inner.client.list_objects_v2().bucket(&inner.bucket);
                    req.prefix(&full)
                        .set_continuation_token(token.clone())
                        .send()
                })
                .await?;
            for obj in page.contents() {
                let Some(key) = obj.key().and_then(|k| k.strip_prefix(&strip)) else {
                    continue;
                };
                if validate_key(key).is_err() {
                    tracing::debug!(backend = %inner.name, key, "list: skipping a non-Strata key");
                    continue;
                }
                out.push(ObjectMeta {
                    key: key.to_owned(),
                    size: u64::try_from(obj.size().unwrap_or(0)).unwrap_or(0),
                    etag: obj.e_tag().map(str::to_owned),
                    last_modified: obj
                        .last_modified()
                        .and_then(|t| SystemTime::try_from(*t).ok()),
                });
            }
            token = page.next_continuation_token().map(str::to_owned);
            if page.is_truncated() != Some(true) || token.is_none() {
                break;
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let inner = &self.inner;
        let full = inner.object_key(key);
        inner
            .call("delete", key, || {
                let req = inner
                    .client
                    .delete_object()
                    .bucket(&inner.bucket)
                    .key(&full);
                async move {
                    match req.send().await {
                        // Some stores answer NoSuchKey; a missing bucket stays an error.
                        Err(e) if e.code() == Some("NoSuchKey") => Ok(None),
                        other => other.map(Some),
                    }
                }
            })
            .await
            .map(drop)
    }
}
