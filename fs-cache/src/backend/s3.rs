//! [`S3Backend`]: the [`Backend`] trait over any S3-compatible object store.
//!
//! # Key layout
//! A store URL `s3://BUCKET/PREFIX` keeps object `key` at `PREFIX/key` in `BUCKET` (at `key`
//! when there is no prefix). Listing asks S3 for `PREFIX/` + the list prefix and strips
//! `PREFIX/` back off; objects whose remainder is not a valid key (directory markers such as
//! `PREFIX/dir/`) are skipped. The backend displays as `s3://BUCKET/PREFIX`, and every error
//! names it together with the operation and the key.
//!
//! # Reads
//! `get` is a plain GET; `get_range` sends `Range: bytes=a-(b-1)`. S3 answers 416 for a start
//! at or past the end (and for any range of an empty object); a HEAD then decides between no
//! bytes (start == size) and [`Error::InvalidRange`]. A store that ignores `Range` and sends
//! the whole object is cut locally.
//!
//! # Puts
//! The body stream is cut into parts of [`S3Config::part_size`] bytes (8 MiB by default, at
//! least 5 MiB, the S3 minimum). A body that fits in one part is a single `PutObject`. A larger
//! one is a multipart upload: `CreateMultipartUpload`, then `UploadPart` with at most
//! [`S3Config::concurrency`] parts in flight (so about `concurrency + 1` parts are held in
//! memory), then `CompleteMultipartUpload`, which publishes the object atomically. On any
//! failure (the body stream, a part, the completion) the upload is aborted before the error
//! is returned, and a put future dropped half-way aborts it from a spawned task, so no pending
//! upload is left behind by a live process. One killed half-way (or dropped before the
//! create's answer brought it the upload's id) leaves its upload pending, its parts stored and
//! billed: `strata gc` aborts the uploads under the prefix begun more than a day before
//! ([`crate::gc`], `sweep_uploads` in `put.rs`). moto 5.2.1 reports every upload as begun on
//! 2010-11-10, so a gc against moto sweeps uploads still under way too. [`PutMode::Create`] sends `If-None-Match: *` on `PutObject` and on
//! `CompleteMultipartUpload`; `412 PreconditionFailed` and `409 ConditionalRequestConflict`
//! become [`Error::AlreadyExists`]. A multipart create first checks with a HEAD so that a
//! large body is not uploaded just to be refused. S3 does not say when it stored an object,
//! so the [`ObjectMeta`] a put returns has no `last_modified` (a `head` has it). A `200`
//! completion answer that the SDK cannot parse (moto 5.2.1's wrong root element) counts as
//! success when it carries an ETag and no `<Error>`.
//!
//! # Retries
//! The backend retries nothing itself (the SDK's own retries are disabled too): each operation
//! is one attempt, and the one layer of retries is the [`RetryingBackend`](super::RetryingBackend)
//! a [`Store`](crate::Store) puts around it ([`super::retry`]). Under it, the operations that
//! cannot be retried whole take its policy for each of their requests: a streaming put (the
//! `PutObject`, every `CreateMultipartUpload`, `UploadPart`, `CompleteMultipartUpload` and
//! `AbortMultipartUpload`, and the HEAD of a multipart create) and a listing (each page). Errors
//! are classified so that the wrapper knows what to retry. Transient: throttling codes
//! (`SlowDown`, `Throttling`, `ThrottlingException`, `RequestTimeout`, ...), HTTP 429 and 5xx
//! except 501 (`NotImplemented` will not change), timeouts, connection and I/O failures,
//! responses that could not be read (a body shorter than its `Content-Length` included).
//! Permanent: every other 4xx (`RequestTimeTooSkewed` included), missing credentials, invalid
//! requests. `NoSuchKey`/`NoSuchBucket`/404 become [`Error::NotFound`].
//!
//! # Credentials
//! Only environment variables (`AWS_ACCESS_KEY_ID`, ...) and the shared profile files are
//! consulted, never instance metadata (IMDS), container endpoints or SSO. Without credentials
//! a request fails at once with a permanent error saying so.

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::environment::credentials::EnvironmentVariableCredentialsProvider;
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::profile::{self, ProfileFileCredentialsProvider};
use aws_config::provider_config::ProviderConfig;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{future, ProvideCredentials};
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, Region, RequestChecksumCalculation, ResponseChecksumValidation,
    SharedCredentialsProvider,
};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use bytes::Bytes;

use super::retry::{Caused, RetryCause, RetryContext, RetryPolicy};
use super::{clamp_range, validate_key, validate_prefix, Backend, ByteStream, ObjectMeta, PutMode};
use crate::error::{BoxError, Error, Result};

mod put;

use put::PartReader;

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
        if !url.username().is_empty() || url.password().is_some() || url.port().is_some() {
            return Err(
                "no user, password or port after s3://: credentials come from the \
                        environment or a profile, the server from endpoint="
                    .to_owned(),
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
    let mut out = Vec::with_capacity(s.len());
    let mut rest = s.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        rest = tail;
        if b != b'%' {
            out.push(b);
            continue;
        }
        let hex = rest.get(..2).and_then(|h| std::str::from_utf8(h).ok());
        let byte = hex.and_then(|h| u8::from_str_radix(h, 16).ok());
        out.push(byte.ok_or_else(|| format!("bad percent escape in {s:?}"))?);
        rest = &rest[2..];
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
            }),
        })
    }
}

/// Environment variables, then the shared profile files (the named profile first when one is
/// given: an explicit choice beats ambient variables).
fn credentials_provider(profile: Option<&str>, region: &str) -> SharedCredentialsProvider {
    let files = profile_credentials(profile, region).build();
    let env = EnvironmentVariableCredentialsProvider::new();
    let chain = if profile.is_some() {
        CredentialsProviderChain::first_try("Profile", files).or_else("Environment", env)
    } else {
        CredentialsProviderChain::first_try("Environment", env).or_else("Profile", files)
    };
    SharedCredentialsProvider::new(chain)
}

/// The profile-file provider, with the `credential_source`s that would reach instance
/// metadata or a container endpoint refused.
fn profile_credentials(profile: Option<&str>, region: &str) -> profile::credentials::Builder {
    let conf = ProviderConfig::without_region().with_region(Some(Region::new(region.to_owned())));
    let builder = ProfileFileCredentialsProvider::builder()
        .configure(&conf)
        .with_custom_provider("Ec2InstanceMetadata", Refuse("Ec2InstanceMetadata"))
        .with_custom_provider("EcsContainer", Refuse("EcsContainer"));
    match profile {
        Some(name) => builder.profile_name(name),
        None => builder,
    }
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
            // Credential failures surface as dispatch failures; a provider error wrapping a
            // configuration error is permanent.
            let mut cause = d
                .as_connector_error()
                .map(|c| c as &(dyn std::error::Error + 'static));
            while let Some(e) = cause {
                let permanent = e.downcast_ref::<CredentialsError>().is_some_and(|ce| {
                    !matches!(
                        ce,
                        CredentialsError::ProviderTimedOut(_) | CredentialsError::ProviderError(_)
                    )
                });
                if permanent {
                    return Class::Permanent;
                }
                cause = e.source();
            }
            Class::Transient
        }
        _ => Class::Permanent,
    }
}

/// Why a transient SDK error failed, for the retry counters ([`RetryCause`]).
fn cause<E: ProvideErrorMetadata>(err: &SdkError<E>) -> RetryCause {
    match err {
        SdkError::ServiceError(e) => {
            let status = e.raw().status().as_u16();
            let throttling = e.err().code().is_some_and(|c| {
                c != "InternalError"
                    && c != "ServiceUnavailable"
                    && TRANSIENT_CODES.split_whitespace().any(|t| t == c)
            });
            if throttling || status == 429 || status == 503 {
                RetryCause::Throttled
            } else if status >= 500 {
                RetryCause::ServerError
            } else {
                RetryCause::Other
            }
        }
        SdkError::TimeoutError(_) => RetryCause::Timeout,
        SdkError::ResponseError(_) => RetryCause::Body,
        SdkError::DispatchFailure(d) if d.is_timeout() => RetryCause::Timeout,
        SdkError::DispatchFailure(_) => RetryCause::Connection,
        _ => RetryCause::Other,
    }
}

/// The ETag of a completed multipart upload whose `200` answer the SDK could not parse.
///
/// Some S3-compatible servers (moto 5.2.1: `CompleteMultipartUploadResponse` instead of
/// `CompleteMultipartUploadResult`, getmoto/moto#10055) send a root element the SDK refuses,
/// although the upload did complete. A `200` carrying an `<Error>` is a real failure.
fn etag_of_unparsed_200<E: ProvideErrorMetadata>(err: &SdkError<E>) -> Option<String> {
    let SdkError::ServiceError(e) = err else {
        return None;
    };
    if e.raw().status().as_u16() != 200 || e.err().code().is_some() {
        return None;
    }
    let body = std::str::from_utf8(e.raw().body().bytes()?).ok()?;
    if body.contains("<Error>") {
        return None;
    }
    let start = body.find("<ETag>")? + "<ETag>".len();
    let end = start + body[start..].find("</ETag>")?;
    Some(
        body[start..end]
            .replace("&quot;", "\"")
            .replace("&#34;", "\""),
    )
}

/// One-line description: HTTP status, code and message for service errors, the whole cause
/// chain otherwise (like [`aws_sdk_s3::error::DisplayErrorContext`], without its debug dump).
fn describe<E>(err: &SdkError<E>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let status = err.raw_response().map(|r| r.status().as_u16());
    let text = match (err, err.code(), status) {
        (SdkError::ServiceError(_), Some(code), Some(status)) => {
            let message = err.message().unwrap_or("(no message)");
            format!("HTTP {status} {code}: {message}")
        }
        (_, _, Some(status)) => format!("HTTP {status}: {}", cause_chain(err)),
        _ => cause_chain(err),
    };
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `err: its source: its source's source...`, skipping repeats.
fn cause_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cause = Some(err);
    while let Some(e) = cause {
        let text = e.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        cause = e.source();
    }
    parts.join(": ")
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
                source: Some(Caused::boxed(cause(&err), Some(Box::new(err)))),
            },
        }
    }

    /// One S3 request: one attempt, or under `retry` (lent by a [`super::RetryingBackend`]
    /// for the requests of an operation it cannot retry whole); `send` sends a fresh request
    /// per attempt.
    async fn call<T, E, Fut>(
        &self,
        op: &'static str,
        key: &str,
        retry: Option<&RetryPolicy>,
        mut send: impl FnMut() -> Fut,
    ) -> Result<T>
    where
        Fut: Future<Output = std::result::Result<T, SdkError<E>>>,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let Some(retry) = retry else {
            return send().await.map_err(|e| self.sdk_error(op, key, e));
        };
        retry
            .run(self.ctx(op, key), |_| {
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
        let req = self.client.get_object().bucket(&self.bucket).key(&full);
        let out = match req.set_range(header).send().await {
            Ok(out) => out,
            Err(e) if classify(&e) == Class::RangeNotSatisfiable => return Ok(None),
            Err(e) => return Err(self.sdk_error("get", key, e)),
        };
        let (expected, ranged) = (out.content_length(), out.content_range().is_some());
        let body = match out.body.collect().await {
            Ok(body) => body.into_bytes(),
            Err(e) => {
                let msg = format!("reading the response body failed: {e}");
                let src = Caused::boxed(RetryCause::Body, Some(Box::new(e)));
                return Err(self.failure("get", key, msg, true, Some(src)));
            }
        };
        if expected.is_some_and(|n| u64::try_from(n).ok() != Some(body.len() as u64)) {
            let msg = format!("short body: {} bytes, expected {expected:?}", body.len());
            let src = Caused::boxed(RetryCause::Body, None);
            return Err(self.failure("get", key, msg, true, Some(src)));
        }
        match (ranged, range) {
            // The store ignored the Range header and sent the whole object: cut it here.
            (false, Some(r)) => {
                let r = clamp_range(&self.name, key, r, body.len() as u64)?;
                Ok(Some(body.slice(r.start as usize..r.end as usize)))
            }
            _ => Ok(Some(body)),
        }
    }

    async fn head(&self, key: &str, retry: Option<&RetryPolicy>) -> Result<ObjectMeta> {
        let full = self.object_key(key);
        let out = self
            .call("head", key, retry, || {
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

    /// What a put returns: S3 does not say when it stored the object, so no time.
    fn written(&self, key: &str, size: u64, etag: Option<&str>) -> ObjectMeta {
        let etag = etag.map(str::to_owned);
        let (key, last_modified) = (key.to_owned(), None);
        ObjectMeta {
            key,
            size,
            etag,
            last_modified,
        }
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
        let meta = inner.head(key, None).await?;
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
        self.put_stream_with(key, body, mode, None).await
    }

    async fn put_stream_retrying(
        &self,
        key: &str,
        body: ByteStream,
        mode: PutMode,
        retry: &RetryPolicy,
    ) -> Result<ObjectMeta> {
        self.put_stream_with(key, body, mode, Some(retry)).await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta> {
        validate_key(key)?;
        self.inner.head(key, None).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        self.list_with(prefix, None).await
    }

    async fn list_retrying(&self, prefix: &str, retry: &RetryPolicy) -> Result<Vec<ObjectMeta>> {
        self.list_with(prefix, Some(retry)).await
    }

    /// Multipart uploads under the prefix (`put.rs`).
    async fn sweep_abandoned(&self, before: SystemTime, dry_run: bool) -> Result<Vec<String>> {
        self.inner.sweep_uploads(before, dry_run).await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        validate_key(key)?;
        let inner = &self.inner;
        let full = inner.object_key(key);
        inner
            .call("delete", key, None, || {
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

impl S3Backend {
    /// A streaming put, its requests retried under `retry` if given.
    async fn put_stream_with(
        &self,
        key: &str,
        body: ByteStream,
        mode: PutMode,
        retry: Option<&RetryPolicy>,
    ) -> Result<ObjectMeta> {
        validate_key(key)?;
        let inner = &self.inner;
        let mut parts = PartReader::new(body, inner.part_size);
        let (first, last) = parts
            .next_part()
            .await
            .map_err(|e| inner.body_error(key, e))?;
        if last {
            inner.put_single(key, first, mode, retry).await
        } else {
            inner
                .put_multipart(key, first, &mut parts, mode, retry)
                .await
        }
    }

    /// A listing, each page retried under `retry` if given.
    async fn list_with(
        &self,
        prefix: &str,
        retry: Option<&RetryPolicy>,
    ) -> Result<Vec<ObjectMeta>> {
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
                .call("list", prefix, retry, || {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_s3::config::http::HttpResponse;
    use aws_sdk_s3::error::{ConnectorError, ErrorMetadata};
    use aws_sdk_s3::operation::get_object::GetObjectError;
    use aws_sdk_s3::primitives::SdkBody as RawBody;

    fn parse(url: &str) -> std::result::Result<S3Config, String> {
        S3Config::from_url(&url::Url::parse(url).unwrap())
    }

    #[test]
    fn url_forms() {
        let c = parse("s3://bucket").unwrap();
        assert_eq!(
            (c.bucket.as_str(), c.prefix.as_str(), c.endpoint.as_deref()),
            ("bucket", "", None)
        );
        assert!(!c.path_style);
        assert_eq!((c.part_size, c.concurrency), (DEFAULT_PART_SIZE, 4));
        let c = parse("s3://b-1/x/y/?endpoint=http://127.0.0.1:9000/&region=eu-west-1&profile=p")
            .unwrap();
        assert_eq!(c.prefix, "x/y");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(
            (c.region.as_str(), c.profile.as_deref()),
            ("eu-west-1", Some("p"))
        );
        assert!(c.path_style, "an endpoint implies path-style by default");
        assert_eq!(c.to_string(), "s3://b-1/x/y");
        assert!(
            !parse("s3://bkt?endpoint=http://h:1&path_style=false")
                .unwrap()
                .path_style
        );
        assert!(parse("s3://bkt?path_style=true").unwrap().path_style);
        assert_eq!(parse("s3://bkt/a%2Fb%20c").unwrap().prefix, "a/b c");
        for (url, needle) in [
            ("s3://", "missing bucket"),
            ("s3://bucket?nope=1", "\"nope\""),
            ("s3://bucket?endpoint=ftp://x", "endpoint"),
            ("s3://bucket?endpoint=http://", "endpoint"),
            ("s3://bucket?path_style=yes", "path_style"),
            ("s3://bucket?profile=", "profile"),
            ("s3://bucket?region=us%20east", "region"),
            ("s3://bucket?profile=a&profile=b", "twice"),
            ("s3://bucket/a//b", "prefix"),
            ("s3://bucket/%ZZ", "percent"),
            ("s3://ab", "bucket"),
            ("s3://-bucket", "bucket"),
            ("s3://bucket:1", "port"),
            ("s3://u@bucket", "user"),
            ("s3://bucket#frag", "fragment"),
            ("file:///x", "s3://"),
        ] {
            let err = parse(url).unwrap_err();
            assert!(err.contains(needle), "{url}: {err}");
        }
    }

    #[test]
    fn config_checks() {
        let mut c = S3Config::new("bucket");
        assert!(c.check().is_ok());
        c.part_size = MIN_PART_SIZE - 1;
        assert!(c.check().unwrap_err().contains("part_size"));
        c.part_size = MIN_PART_SIZE;
        c.concurrency = 0;
        assert!(c.check().unwrap_err().contains("concurrency"));
    }

    fn service(status: u16, code: Option<&str>) -> SdkError<GetObjectError> {
        let mut meta = ErrorMetadata::builder().message("the message");
        if let Some(code) = code {
            meta = meta.code(code);
        }
        let raw = HttpResponse::new(status.try_into().unwrap(), RawBody::empty());
        SdkError::service_error(GetObjectError::generic(meta.build()), raw)
    }

    #[test]
    fn classification() {
        use Class::*;
        for (status, code, class) in [
            (503, Some("SlowDown"), Transient),
            (503, None, Transient),
            (500, Some("InternalError"), Transient),
            (502, None, Transient),
            (429, None, Transient),
            (400, Some("RequestTimeout"), Transient),
            (400, Some("Throttling"), Transient),
            (400, Some("ThrottlingException"), Transient),
            (403, Some("RequestTimeTooSkewed"), Permanent),
            (501, Some("NotImplemented"), Permanent),
            (403, Some("AccessDenied"), Permanent),
            (400, Some("InvalidArgument"), Permanent),
            (404, Some("NoSuchKey"), NotFound),
            (404, Some("NoSuchBucket"), NotFound),
            (404, None, NotFound),
            (404, Some("NoSuchUpload"), Permanent),
            (412, Some("PreconditionFailed"), Precondition),
            (409, Some("ConditionalRequestConflict"), Precondition),
            (409, Some("BucketAlreadyExists"), Permanent),
            (416, Some("InvalidRange"), RangeNotSatisfiable),
        ] {
            assert_eq!(classify(&service(status, code)), class, "{status} {code:?}");
        }
        let other = |e: SdkError<GetObjectError>| classify(&e);
        assert_eq!(other(SdkError::timeout_error("slow")), Transient);
        assert_eq!(
            other(SdkError::construction_failure("bad input")),
            Permanent
        );
        let io = ConnectorError::io("connection reset".into());
        assert_eq!(other(SdkError::dispatch_failure(io)), Transient);
        let user = ConnectorError::user("bad URI".into());
        assert_eq!(other(SdkError::dispatch_failure(user)), Permanent);
        let creds = CredentialsError::not_loaded("no credentials anywhere");
        let creds = ConnectorError::other(Box::new(creds), None);
        assert_eq!(other(SdkError::dispatch_failure(creds)), Permanent);
        let raw = HttpResponse::new(200.try_into().unwrap(), RawBody::empty());
        assert_eq!(other(SdkError::response_error("truncated", raw)), Transient);
    }

    #[test]
    fn transient_errors_carry_their_cause() {
        let b = backend();
        let of = |e: SdkError<GetObjectError>| RetryCause::of(&b.inner.sdk_error("get", "k", e));
        assert_eq!(of(service(503, Some("SlowDown"))), RetryCause::Throttled);
        assert_eq!(
            of(service(503, Some("ServiceUnavailable"))),
            RetryCause::Throttled
        );
        assert_eq!(of(service(429, None)), RetryCause::Throttled);
        assert_eq!(
            of(service(500, Some("InternalError"))),
            RetryCause::ServerError
        );
        assert_eq!(of(service(502, None)), RetryCause::ServerError);
        assert_eq!(of(SdkError::timeout_error("slow")), RetryCause::Timeout);
        let io = ConnectorError::io("connection reset".into());
        assert_eq!(of(SdkError::dispatch_failure(io)), RetryCause::Connection);
        let raw = HttpResponse::new(200.try_into().unwrap(), RawBody::empty());
        assert_eq!(of(SdkError::response_error("cut", raw)), RetryCause::Body);
        // The tag keeps the SDK error as the source's source.
        let err = b
            .inner
            .sdk_error("get", "k", service(500, Some("InternalError")));
        let src = std::error::Error::source(&err).unwrap();
        assert!(src.source().is_some());
    }

    fn backend() -> S3Backend {
        let mut config = S3Config::new("bucket");
        config.prefix = "pre".into();
        config.endpoint = Some("http://127.0.0.1:9".into());
        let creds = aws_sdk_s3::config::Credentials::new("a", "b", None, None, "test");
        S3Backend::with_credentials(config, SharedCredentialsProvider::new(creds)).unwrap()
    }

    #[test]
    fn errors_name_backend_op_and_key() {
        let b = backend();
        assert_eq!(b.to_string(), "s3://bucket/pre");
        assert_eq!(b.inner.object_key("a/b"), "pre/a/b");
        let err = b
            .inner
            .sdk_error("get", "a/b", service(503, Some("SlowDown")));
        assert!(err.is_transient());
        let msg = err.to_string();
        assert!(msg.contains("s3://bucket/pre: get a/b"), "{msg}");
        assert!(msg.contains("HTTP 503 SlowDown: the message"), "{msg}");
        assert!(std::error::Error::source(&err).is_some());
        let err = b
            .inner
            .sdk_error("get", "a/b", service(404, Some("NoSuchKey")));
        assert!(
            matches!(err, Error::NotFound { ref key, .. } if key == "a/b"),
            "{err}"
        );
        let err = b
            .inner
            .sdk_error("put", "a/b", service(412, Some("PreconditionFailed")));
        assert!(matches!(err, Error::AlreadyExists { .. }), "{err}");
        let err = b
            .inner
            .sdk_error("get", "a/b", service(403, Some("AccessDenied")));
        assert!(!err.is_transient() && err.to_string().contains("AccessDenied"));
    }

    #[test]
    fn completion_answers_with_a_foreign_root_still_count() {
        let answer = |status: u16, body: &'static str| {
            let raw = HttpResponse::new(status.try_into().unwrap(), RawBody::from(body));
            let err = GetObjectError::generic(ErrorMetadata::builder().build());
            etag_of_unparsed_200(&SdkError::service_error(err, raw))
        };
        let ok = "<CompleteMultipartUploadResponse><ETag>&quot;ab-2&quot;</ETag></CompleteMultipartUploadResponse>";
        assert_eq!(answer(200, ok).as_deref(), Some("\"ab-2\""));
        assert_eq!(answer(500, ok), None);
        assert_eq!(
            answer(200, "<Error><Code>InternalError</Code></Error>"),
            None
        );
        assert_eq!(answer(200, "<Other/>"), None);
    }

    #[tokio::test]
    async fn missing_credentials_fail_fast_and_permanently() {
        let dir = tempfile::tempdir().unwrap();
        let config_file = dir.path().join("config");
        std::fs::write(dir.path().join("credentials"), "").unwrap();
        std::fs::write(
            &config_file,
            "[profile imds]\nrole_arn = arn:aws:iam::123456789012:role/r\n\
             credential_source = Ec2InstanceMetadata\n[profile other]\nregion = us-east-1\n",
        )
        .unwrap();
        #[allow(deprecated)]
        let files = aws_config::profile::profile_file::ProfileFiles::builder()
            .with_file(
                aws_config::profile::profile_file::ProfileFileKind::Config,
                &config_file,
            )
            .with_file(
                aws_config::profile::profile_file::ProfileFileKind::Credentials,
                dir.path().join("credentials"),
            )
            .build();
        for (profile, needle) in [("imds", "not supported by Strata"), ("nobody", "nobody")] {
            let provider = profile_credentials(Some(profile), "us-east-1")
                .profile_files(files.clone())
                .build();
            let mut config = S3Config::new("bucket");
            config.endpoint = Some("http://127.0.0.1:9".into());
            let b = S3Backend::with_credentials(config, SharedCredentialsProvider::new(provider))
                .unwrap();
            let start = std::time::Instant::now();
            let err = b.head("k").await.unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(5), "{err}");
            assert!(
                matches!(
                    err,
                    Error::Backend {
                        transient: false,
                        attempts: 1,
                        ..
                    }
                ),
                "{err}"
            );
            assert!(err.to_string().contains(needle), "{profile}: {err}");
        }
    }
}
