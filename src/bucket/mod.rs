//! The bucket: an object_store wrapper that turns `bucket.url` into a store, names pack objects, uploads sealed packs
//! with verification, and reads packs back with range reads.
//!
//! # Key layout
//!
//! ```text
//! <url path>/<bucket.prefix>/<catalog_name>/<yyyy>/<mm>/<dd>/<pack_id>.cpk
//! ```
//!
//! The date is the UTC day of the pack's first capture ([`PackSummary::first_captured_at_ns`], or `created_at_ns` for
//! a pack with no capture time). The key depends only on the pack, so a retried upload (after a crash, a timeout or an
//! outage) writes the same key, and the "already there" check below makes the retry a no-op. A path in the URL
//! (`s3://bucket/some/path`) becomes the first part of the prefix; empty parts are skipped.
//!
//! # Upload protocol ([`Bucket::upload_pack`])
//!
//! 1. Take one of `upload.concurrency` permits.
//! 2. A `file://` bucket gets the pack by [`local_dir::place_pack`] (a hard link of the sealed pack, or a staged
//!    in-kernel copy, fsynced either way). On other backends, a pack of at most `upload.part_size` bytes is read into
//!    memory and written with one `PutMode::Create` put. A larger pack is streamed from the file in part_size parts
//!    with a multipart upload: at most [`MULTIPART_PARTS_IN_FLIGHT`] parts are in flight, so memory stays near
//!    3 x part_size whatever the pack's size. A multipart upload cannot be conditional, so it HEADs the key first.
//! 3. An existing object (`AlreadyExists`, or found by that HEAD) is compared with the local file: same size and same
//!    last [`TRAILER_LEN`] bytes (the trailer holds the SHA-256 of every byte before it) means an earlier attempt
//!    already uploaded this pack: `already_present = true`. Anything else is [`BucketErrorKind::Conflict`]: permanent;
//!    the caller quarantines the pack and logs ERROR.
//! 4. A HEAD after the upload checks the object's size against the local file.
//!
//! The pack's SHA-256 and record count go into object metadata (`capstore-sha256`, `capstore-records`) on backends
//! that store it. What each backend does:
//!
//! | backend | `PutMode::Create` | metadata attributes |
//! | --- | --- | --- |
//! | `s3://` | `If-None-Match: *` -> `AlreadyExists` (tested live on SeaweedFS) | stored as `x-amz-meta-*` (tested) |
//! | `gs://`, `az://` | the provider's preconditions (object_store; not tested here) | stored (not tested here) |
//! | `memory://` | supported (tested) | stored (tested) |
//! | `file://` | [`local_dir`]: link(2) of the fsynced pack, atomic, `AlreadyExists` (tested) | not stored, so not sent |
//!
//! The multipart path is check-then-write on every backend: two writers of different bytes under one key racing
//! between the HEAD and completion could replace each other's object (the size check after upload catches only a
//! size difference). Keys hold the pack_id, which only the spool that wrote the pack uses, so this needs two
//! processes uploading different packs with the same id, which the spool's owner lock rules out.
//!
//! # Backends and settings ([`Bucket::from_config`])
//!
//! - `file:///abs/path`: a local directory (created if missing); the URL path is the root, not part of the keys.
//! - `s3://bucket[/path]`: `AWS_*` environment variables first (the usual credential chain; instance metadata when
//!   no keys are set), then `bucket.endpoint`, `region`, `allow_http`, `virtual_hosted_style`, `access_key_id`,
//!   `secret_access_key`, `session_token`, then `bucket.options` by object_store name (`aws_` prefix optional).
//! - `gs://bucket[/path]`, `az://container[/path]` (also `azure`, `abfs`, `abfss`): the provider's environment
//!   variables, then `bucket.options` (`bucket.endpoint` and `allow_http` apply to Azure; `allow_http` to GCS).
//! - `memory://[path]`: in-process, for tests.
//!
//! A key that does not apply to the backend (`bucket.region` on `gs://`, any option on `file://`) and an option name
//! the backend does not know are [`BucketErrorKind::Permanent`] errors naming the key. Secrets are handed to the
//! builders only; [`Bucket`]'s `Debug` never shows the store.
//!
//! # Retries
//!
//! Every operation runs under a bounded retry loop ([`RetryPolicy`]: exponential backoff with full jitter, 100 ms
//! doubling to 5 s, at most 8 attempts and 60 s by default) that retries only errors [`classify`] calls
//! [`BucketErrorKind::Transient`]. When the loop gives up the error is still `Transient`: a bucket outage is never a
//! pack's fault, so the caller retries later without counting it against the pack. Every step is idempotent (same
//! key, same bytes, compare on conflict), so retrying a whole upload is safe even when an earlier attempt's outcome is
//! unknown. Cloud backends also get object_store's own per-request retry ([`store_retry_config`]: a few quick
//! retries of 5xx and connection errors, 15 s budget) and timeouts (connect 5 s; a request 30 s plus one second per
//! MiB of part_size), so no single request hangs.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{
    Attribute, AttributeValue, Attributes, BackoffConfig, ClientOptions, ObjectStore, PutMode, PutMultipartOptions,
    PutOptions, PutPayload, RetryConfig, WriteMultipart,
};
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::Semaphore;

use crate::config::Config;
use crate::pack::{
    check_trailer_fits, decode_footer, decode_record, decode_trailer, CaptureMeta, IndexEntry, PackError, PackSummary,
    Trailer, FOOTER_HEADER_LEN, HEADER_LEN, PACK_EXTENSION, TRAILER_LEN,
};

pub mod local_dir;

/// Parts of one multipart upload that may be in flight at once.
pub const MULTIPART_PARTS_IN_FLIGHT: usize = 2;
/// Object metadata key holding the pack's SHA-256 (hex).
pub const METADATA_SHA256: &str = "capstore-sha256";
/// Object metadata key holding the pack's record count.
pub const METADATA_RECORDS: &str = "capstore-records";

const MIB: u64 = 1024 * 1024;

/// What a caller does with a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketErrorKind {
    /// The bucket is unreachable, slow or failing: retry later; never the pack's fault.
    Transient,
    /// A different object already sits at the pack's key: permanent; quarantine the pack.
    Conflict,
    /// The object (or local file) is not a valid pack: the reason is in the message.
    InvalidPack,
    /// No object at the key.
    NotFound,
    /// Configuration, credentials, permissions or an unsupported operation: an operator must act.
    Permanent,
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BucketError {
    pub kind: BucketErrorKind,
    /// Lowercase, self-contained (it includes the cause's text), never a secret.
    pub message: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl BucketError {
    fn new(kind: BucketErrorKind, message: impl Into<String>) -> Self {
        BucketError { kind, message: message.into(), source: None }
    }

    fn from_store(context: impl fmt::Display, error: object_store::Error) -> Self {
        BucketError { kind: classify(&error), message: format!("{context}: {error}"), source: Some(Box::new(error)) }
    }

    fn invalid_pack(key: &str, error: PackError) -> Self {
        BucketError {
            kind: BucketErrorKind::InvalidPack,
            message: format!("{key} is not a valid pack: {error}"),
            source: Some(Box::new(error)),
        }
    }

    fn local_io(context: impl fmt::Display, error: std::io::Error) -> Self {
        // A local disk failing (the spool's, or a file:// bucket's) is not the pack's fault: retry later. Only a
        // refusal an operator must fix is permanent.
        BucketError {
            kind: if io_refused_for_good(&error) { BucketErrorKind::Permanent } else { BucketErrorKind::Transient },
            message: format!("{context}: {error}"),
            source: Some(Box::new(error)),
        }
    }

    pub fn is_transient(&self) -> bool {
        self.kind == BucketErrorKind::Transient
    }
}

/// The one place object_store errors are sorted into kinds.
///
/// `Generic` errors are transient unless they carry a 4xx HTTP status other than 408 and 429 (a request the server
/// will refuse again) or a local permission error: connection failures, timeouts and 5xx all land there, and when in
/// doubt, retrying later loses nothing. object_store does not expose the status of a `Generic` error as a type, so it
/// is read from the text of the error chain (`... status code: 400 Bad Request ...`).
pub fn classify(error: &object_store::Error) -> BucketErrorKind {
    use object_store::Error as E;
    match error {
        E::NotFound { .. } => BucketErrorKind::NotFound,
        E::AlreadyExists { .. } | E::Precondition { .. } => BucketErrorKind::Conflict,
        E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::UnknownConfigurationKey { .. }
        | E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented
        | E::NotModified { .. } => BucketErrorKind::Permanent,
        E::JoinError { .. } => BucketErrorKind::Transient,
        E::Generic { source, .. } => classify_generic(source.as_ref()),
        _ => BucketErrorKind::Transient,
    }
}

fn classify_generic(source: &(dyn std::error::Error + 'static)) -> BucketErrorKind {
    let mut current_opt: Option<&(dyn std::error::Error + 'static)> = Some(source);
    while let Some(current) = current_opt {
        if current.downcast_ref::<std::io::Error>().is_some_and(io_refused_for_good) {
            return BucketErrorKind::Permanent;
        }
        if let Some(status) = http_status_in(&current.to_string()) {
            let refused_for_good = (400..500).contains(&status) && status != 408 && status != 429;
            return if refused_for_good { BucketErrorKind::Permanent } else { BucketErrorKind::Transient };
        }
        current_opt = current.source();
    }
    BucketErrorKind::Transient
}

/// A local I/O error an operator must fix (permissions, a read-only filesystem): retrying will not help.
fn io_refused_for_good(error: &std::io::Error) -> bool {
    matches!(error.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem)
}

/// The status in object_store's "status code: 400 Bad Request" error text, if any.
fn http_status_in(text: &str) -> Option<u16> {
    let (_, after) = text.split_once("status code: ")?;
    let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
    if digits.len() != 3 {
        return None;
    }
    digits.parse().ok()
}

/// Bounded exponential backoff with full jitter for transient errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    /// No new attempt starts once this much time has passed since the first.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_attempts: 8,
            max_elapsed: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The sleep before retry number `retry` (1 = the first retry): uniform in `0..=min(max, initial * 2^(retry-1))`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let doubling = 1u32.checked_shl(retry.saturating_sub(1)).unwrap_or(u32::MAX);
        let ceiling = self.initial_backoff.saturating_mul(doubling).min(self.max_backoff);
        let ceiling_ms = ceiling.as_millis() as u64;
        Duration::from_millis(rand::rng().random_range(0..=ceiling_ms))
    }
}

/// The result of a successful [`Bucket::upload_pack`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadOutcome {
    pub key: String,
    /// The object was already there with the same size and trailer (an earlier attempt uploaded it).
    pub already_present: bool,
}

/// A pack's index as read from the bucket with two range reads.
#[derive(Debug, Clone)]
pub struct RemotePack {
    pub key: String,
    pub size: u64,
    pub trailer: Trailer,
    pub entries: Vec<IndexEntry>,
}

/// A bucket: one object store, the key prefix of one catalog, and the upload limits.
pub struct Bucket {
    store: Arc<dyn ObjectStore>,
    /// The same store when `bucket.url` is `file://`: uploads go through [`local_dir`], which fsyncs.
    local_dir: Option<Arc<object_store::local::LocalFileSystem>>,
    /// `file`, `s3`, `gs`, `az` or `memory`: for logs and the metadata decision.
    scheme: &'static str,
    supports_metadata: bool,
    catalog_prefix: Path,
    part_size: u64,
    upload_permits: Arc<Semaphore>,
    retry_policy: RetryPolicy,
}

impl fmt::Debug for Bucket {
    // The store's own Debug may show credentials: never print it.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Bucket")
            .field("scheme", &self.scheme)
            .field("catalog_prefix", &self.catalog_prefix.as_ref())
            .field("part_size", &self.part_size)
            .finish_non_exhaustive()
    }
}

impl Bucket {
    /// Builds the store named by `bucket.url` with the `[bucket]` options and the key prefix of `catalog_name`.
    pub fn from_config(config: &Config) -> Result<Bucket, BucketError> {
        let bucket_config = &config.bucket;
        let url = bucket_config.url.as_str();
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(permanent(format!("bucket.url {url:?} is not a URL like s3://name or file:///path")));
        };
        let part_size = config.upload.part_size.0;
        let mut local_dir = None;
        let (store, scheme, url_prefix): (Arc<dyn ObjectStore>, &'static str, String) = match scheme {
            "file" => {
                let root = FsPath::new(rest);
                if !root.is_absolute() {
                    return Err(permanent(format!("bucket.url {url:?} must name an absolute path (file:///...)")));
                }
                reject_cloud_only_keys(config, "file")?;
                std::fs::create_dir_all(root).map_err(|error| {
                    permanent(format!("bucket.url: cannot create directory {}: {error}", root.display()))
                })?;
                let local = object_store::local::LocalFileSystem::new_with_prefix(root)
                    .map_err(|error| BucketError::from_store("bucket.url", error))?;
                let local = Arc::new(local);
                local_dir = Some(local.clone());
                (local, "file", String::new())
            }
            "memory" => {
                reject_cloud_only_keys(config, "memory")?;
                (Arc::new(object_store::memory::InMemory::new()), "memory", rest.to_string())
            }
            "s3" | "s3a" => {
                let (bucket_name, path) = split_bucket(url, rest)?;
                (Arc::new(build_s3(config, bucket_name, part_size)?), "s3", path.to_string())
            }
            "gs" => {
                let (bucket_name, path) = split_bucket(url, rest)?;
                (Arc::new(build_gcs(config, bucket_name, part_size)?), "gs", path.to_string())
            }
            "az" | "azure" | "abfs" | "abfss" => {
                let (_, path) = split_bucket(url, rest)?;
                (Arc::new(build_azure(config, part_size)?), "az", path.to_string())
            }
            other => {
                return Err(permanent(format!("bucket.url scheme {other:?} is not one of file, s3, gs, az, memory")))
            }
        };
        let catalog_prefix = join_prefix(&[&url_prefix, &bucket_config.prefix, &config.catalog_name])?;
        let concurrency = config.upload.concurrency.max(1) as usize;
        Ok(Bucket {
            store,
            local_dir,
            scheme,
            supports_metadata: scheme != "file",
            catalog_prefix,
            part_size: part_size.max(1),
            upload_permits: Arc::new(Semaphore::new(concurrency)),
            retry_policy: RetryPolicy::default(),
        })
    }

    /// Replaces the retry policy (tests use a short one).
    pub fn with_retry_policy(mut self, retry_policy: RetryPolicy) -> Self {
        self.retry_policy = retry_policy;
        self
    }

    /// The underlying store, for tools that need more than this module offers.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    pub fn scheme(&self) -> &'static str {
        self.scheme
    }

    /// Whether uploads carry the SHA-256 and record count as object metadata.
    pub fn supports_metadata(&self) -> bool {
        self.supports_metadata
    }

    /// `<url path>/<bucket.prefix>/<catalog_name>`: every pack of this catalog lives below it.
    pub fn catalog_prefix(&self) -> Path {
        self.catalog_prefix.clone()
    }

    /// `<catalog prefix>/<yyyy>/<mm>/<dd>/<pack_id>.cpk`, the UTC day of the first capture.
    pub fn pack_key(&self, summary: &PackSummary) -> Path {
        let day_ns =
            if summary.first_captured_at_ns != 0 { summary.first_captured_at_ns } else { summary.created_at_ns };
        let (year, month, day) = utc_date(day_ns);
        let file_name = format!("{}.{PACK_EXTENSION}", summary.pack_id);
        self.catalog_prefix.child(year).child(month).child(day).child(file_name)
    }

    /// Uploads a sealed pack to its key, verifies it, and says whether it was already there. See the module doc.
    pub async fn upload_pack(&self, local_path: &FsPath, summary: &PackSummary) -> Result<UploadOutcome, BucketError> {
        let _permit = self
            .upload_permits
            .acquire()
            .await
            .map_err(|_| BucketError::new(BucketErrorKind::Permanent, "upload permits closed"))?;
        let key = self.pack_key(summary);
        let local = LocalPack::open(local_path).await?;
        if local.size != summary.bytes {
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!("{} is {} bytes but its summary says {}", local_path.display(), local.size, summary.bytes),
            ));
        }
        let attributes = self.pack_attributes(summary);
        let outcome = self
            .with_retries("upload pack", &key, || self.upload_once(local_path, &local, &key, attributes.clone()))
            .await?;
        tracing::debug!(key = %key, bytes = local.size, already_present = outcome.already_present, "pack uploaded");
        Ok(outcome)
    }

    async fn upload_once(
        &self,
        local_path: &FsPath,
        local: &LocalPack,
        key: &Path,
        attributes: Attributes,
    ) -> Result<UploadOutcome, BucketError> {
        if let Some(local_dir) = &self.local_dir {
            let (local_dir, key_owned, pack) = (local_dir.clone(), key.clone(), local_path.to_path_buf());
            let placed = tokio::task::spawn_blocking(move || local_dir::place_pack(&local_dir, &key_owned, &pack))
                .await
                .map_err(|error| BucketError::new(BucketErrorKind::Transient, format!("place {key}: {error}")))?
                .map_err(|error| {
                    BucketError::local_io(format_args!("place {} at {key}", local_path.display()), error)
                })?;
            if placed == local_dir::Placed::AlreadyExists {
                return self.compare_existing(key, local, None).await;
            }
        } else if local.size <= self.part_size {
            let contents = tokio::fs::read(local_path)
                .await
                .map_err(|error| BucketError::local_io(format_args!("read {}", local_path.display()), error))?;
            let options = PutOptions { mode: PutMode::Create, attributes, ..Default::default() };
            match self.store.put_opts(key, PutPayload::from(contents), options).await {
                Ok(_) => {}
                Err(object_store::Error::AlreadyExists { .. }) => return self.compare_existing(key, local, None).await,
                Err(error) => return Err(BucketError::from_store(format_args!("put {key}"), error)),
            }
        } else {
            match self.store.head(key).await {
                Ok(meta) => return self.compare_existing(key, local, Some(meta.size)).await,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(error) => return Err(BucketError::from_store(format_args!("head {key}"), error)),
            }
            self.put_multipart(local_path, key, attributes).await?;
        }
        let meta =
            self.store.head(key).await.map_err(|error| BucketError::from_store(format_args!("head {key}"), error))?;
        if meta.size != local.size {
            return Err(BucketError::new(
                BucketErrorKind::Conflict,
                format!("{key} is {} bytes after upload, the pack is {}", meta.size, local.size),
            ));
        }
        Ok(UploadOutcome { key: key.to_string(), already_present: false })
    }

    async fn put_multipart(&self, local_path: &FsPath, key: &Path, attributes: Attributes) -> Result<(), BucketError> {
        let options = PutMultipartOptions { attributes, ..Default::default() };
        let upload = self
            .store
            .put_multipart_opts(key, options)
            .await
            .map_err(|error| BucketError::from_store(format_args!("start multipart upload of {key}"), error))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, self.part_size as usize);
        let streamed = async {
            let mut file = tokio::fs::File::open(local_path)
                .await
                .map_err(|error| BucketError::local_io(format_args!("open {}", local_path.display()), error))?;
            loop {
                writer
                    .wait_for_capacity(MULTIPART_PARTS_IN_FLIGHT)
                    .await
                    .map_err(|error| BucketError::from_store(format_args!("upload part of {key}"), error))?;
                let part = read_up_to(&mut file, self.part_size as usize)
                    .await
                    .map_err(|error| BucketError::local_io(format_args!("read {}", local_path.display()), error))?;
                if part.is_empty() {
                    return Ok(());
                }
                writer.put(part);
            }
        }
        .await;
        if let Err(error) = streamed {
            // Best effort: a dangling upload costs storage until the bucket's lifecycle rule removes it.
            if let Err(abort_error) = writer.abort().await {
                tracing::warn!(key = %key, error = %abort_error, "multipart abort failed");
            }
            return Err(error);
        }
        writer
            .finish()
            .await
            .map_err(|error| BucketError::from_store(format_args!("complete multipart upload of {key}"), error))?;
        Ok(())
    }

    /// An object already sits at `key`: the same pack (size and trailer equal) or a conflict.
    async fn compare_existing(
        &self,
        key: &Path,
        local: &LocalPack,
        size_opt: Option<u64>,
    ) -> Result<UploadOutcome, BucketError> {
        let remote_size = match size_opt {
            Some(size) => size,
            None => {
                self.store
                    .head(key)
                    .await
                    .map_err(|error| BucketError::from_store(format_args!("head {key}"), error))?
                    .size
            }
        };
        if remote_size != local.size {
            return Err(BucketError::new(
                BucketErrorKind::Conflict,
                format!("{key} already exists with {remote_size} bytes, the pack has {}", local.size),
            ));
        }
        let trailer_range = remote_size - TRAILER_LEN as u64..remote_size;
        let remote_trailer = self
            .store
            .get_range(key, trailer_range)
            .await
            .map_err(|error| BucketError::from_store(format_args!("read trailer of {key}"), error))?;
        if remote_trailer.as_ref() != local.trailer.as_slice() {
            return Err(BucketError::new(
                BucketErrorKind::Conflict,
                format!("{key} already exists with the same size but a different trailer (sha-256)"),
            ));
        }
        Ok(UploadOutcome { key: key.to_string(), already_present: true })
    }

    fn pack_attributes(&self, summary: &PackSummary) -> Attributes {
        let mut attributes = Attributes::new();
        if !self.supports_metadata {
            return attributes;
        }
        attributes
            .insert(Attribute::Metadata(METADATA_SHA256.into()), AttributeValue::from(summary.sha256_hex.clone()));
        attributes
            .insert(Attribute::Metadata(METADATA_RECORDS.into()), AttributeValue::from(summary.records.to_string()));
        attributes
    }

    /// Reads `range` of the object at `key`.
    pub async fn read_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, BucketError> {
        let path = parse_key(key)?;
        let (path_ref, range_ref) = (&path, &range);
        self.with_retries("read range", &path, || async move {
            self.store
                .get_range(path_ref, range_ref.clone())
                .await
                .map_err(|error| BucketError::from_store(format_args!("read {key} bytes {range_ref:?}"), error))
        })
        .await
    }

    /// The size of the object at `key`.
    pub async fn object_size(&self, key: &str) -> Result<u64, BucketError> {
        let path = parse_key(key)?;
        let path_ref = &path;
        self.with_retries("head", &path, || async move {
            self.store
                .head(path_ref)
                .await
                .map(|meta| meta.size)
                .map_err(|error| BucketError::from_store(format_args!("head {key}"), error))
        })
        .await
    }

    /// The user metadata stored with the object at `key` (empty where the backend keeps none, as `file://`).
    pub async fn object_metadata(&self, key: &str) -> Result<HashMap<String, String>, BucketError> {
        let path = parse_key(key)?;
        let options = object_store::GetOptions { head: true, ..Default::default() };
        let result = self
            .store
            .get_opts(&path, options)
            .await
            .map_err(|error| BucketError::from_store(format_args!("head {key}"), error))?;
        let mut metadata = HashMap::new();
        for (attribute, value) in result.attributes.iter() {
            if let Attribute::Metadata(name) = attribute {
                metadata.insert(name.to_string(), value.to_string());
            }
        }
        Ok(metadata)
    }

    /// Lists a pack from the bucket: HEAD for the size, then two range reads (trailer, footer), decoded and checked
    /// by the pack module. Anything that is not a valid pack gives [`BucketErrorKind::InvalidPack`] with the reason.
    pub async fn read_pack_index(&self, key: &str) -> Result<RemotePack, BucketError> {
        let size = self.object_size(key).await?;
        let minimum_size = (HEADER_LEN + FOOTER_HEADER_LEN + TRAILER_LEN) as u64;
        if size < minimum_size {
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!("{key} is not a valid pack: {size} bytes, smaller than the smallest pack ({minimum_size})"),
            ));
        }
        let trailer_bytes = self.read_range(key, size - TRAILER_LEN as u64..size).await?;
        let trailer = decode_trailer(&trailer_bytes).map_err(|error| BucketError::invalid_pack(key, error))?;
        check_trailer_fits(&trailer, size).map_err(|error| BucketError::invalid_pack(key, error))?;
        let footer_range = trailer.footer_offset..trailer.footer_offset + trailer.footer_len;
        let footer_bytes = self.read_range(key, footer_range).await?;
        let entries = decode_footer(&footer_bytes, &trailer).map_err(|error| BucketError::invalid_pack(key, error))?;
        Ok(RemotePack { key: key.to_string(), size, trailer, entries })
    }

    /// Reads one capture with one range read; its CRC and metadata are checked against `entry`.
    pub async fn read_capture(&self, key: &str, entry: &IndexEntry) -> Result<(CaptureMeta, Vec<u8>), BucketError> {
        let record_bytes = self.read_range(key, entry.record_range()).await?;
        decode_record(&record_bytes, entry).map_err(|error| BucketError::invalid_pack(key, error))
    }

    /// Every object under the catalog prefix as (key, size), packs or not, so reconcile can find what the catalog
    /// lacks. Sorted by key.
    pub async fn list_pack_keys(&self) -> Result<Vec<(String, u64)>, BucketError> {
        let prefix = self.catalog_prefix.clone();
        let prefix_ref = &prefix;
        let mut listed = self
            .with_retries("list", &prefix, || async move {
                self.store
                    .list(Some(prefix_ref))
                    .map_ok(|meta| (meta.location.to_string(), meta.size))
                    .try_collect::<Vec<_>>()
                    .await
                    .map_err(|error| BucketError::from_store(format_args!("list {prefix_ref}"), error))
            })
            .await?;
        listed.sort();
        Ok(listed)
    }

    /// Runs `operation` until it succeeds, fails with a non-transient error, or the retry policy is spent.
    async fn with_retries<T, F, Fut>(&self, what: &str, key: &Path, mut operation: F) -> Result<T, BucketError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, BucketError>>,
    {
        let started = Instant::now();
        let mut attempt = 1;
        loop {
            let error = match operation().await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            if !error.is_transient() || attempt >= self.retry_policy.max_attempts {
                return Err(error);
            }
            let backoff = self.retry_policy.backoff(attempt);
            if started.elapsed() + backoff > self.retry_policy.max_elapsed {
                return Err(error);
            }
            tracing::warn!(
                operation = what,
                key = %key,
                attempt,
                backoff_ms = backoff.as_millis() as u64,
                error = %error,
                "bucket operation failed, retrying"
            );
            tokio::time::sleep(backoff).await;
            attempt += 1;
        }
    }
}

/// What upload needs from the local file: its size and its last [`TRAILER_LEN`] bytes.
struct LocalPack {
    size: u64,
    trailer: Vec<u8>,
}

impl LocalPack {
    async fn open(path: &FsPath) -> Result<LocalPack, BucketError> {
        let context = || format!("read {}", path.display());
        let mut file = tokio::fs::File::open(path).await.map_err(|error| BucketError::local_io(context(), error))?;
        let size = file.metadata().await.map_err(|error| BucketError::local_io(context(), error))?.len();
        if size < (HEADER_LEN + FOOTER_HEADER_LEN + TRAILER_LEN) as u64 {
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!("{} is {size} bytes, too small to be a sealed pack", path.display()),
            ));
        }
        file.seek(std::io::SeekFrom::Start(size - TRAILER_LEN as u64))
            .await
            .map_err(|error| BucketError::local_io(context(), error))?;
        let mut trailer = vec![0u8; TRAILER_LEN];
        file.read_exact(&mut trailer).await.map_err(|error| BucketError::local_io(context(), error))?;
        Ok(LocalPack { size, trailer })
    }
}

/// Reads until `limit` bytes or end of file.
async fn read_up_to(file: &mut tokio::fs::File, limit: usize) -> std::io::Result<Bytes> {
    let mut buffer = BytesMut::zeroed(limit);
    let mut filled = 0;
    while filled < limit {
        let read = file.read(&mut buffer[filled..]).await?;
        if read == 0 {
            break;
        }
        filled += read;
    }
    buffer.truncate(filled);
    Ok(buffer.freeze())
}

fn permanent(message: String) -> BucketError {
    BucketError::new(BucketErrorKind::Permanent, message)
}

fn parse_key(key: &str) -> Result<Path, BucketError> {
    Path::parse(key)
        .map_err(|error| BucketError::new(BucketErrorKind::Permanent, format!("invalid key {key:?}: {error}")))
}

/// `yyyy`, `mm`, `dd` of a time in nanoseconds since the epoch, in UTC.
fn utc_date(ns: u64) -> (String, String, String) {
    let rfc3339 = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_nanos(ns)).to_string();
    debug_assert_eq!(&rfc3339[4..5], "-");
    (rfc3339[0..4].to_string(), rfc3339[5..7].to_string(), rfc3339[8..10].to_string())
}

/// `bucket/some/path` -> (`bucket`, `some/path`).
fn split_bucket<'a>(url: &str, rest: &'a str) -> Result<(&'a str, &'a str), BucketError> {
    let (bucket_name, path) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket_name.is_empty() {
        return Err(permanent(format!("bucket.url {url:?} names no bucket")));
    }
    Ok((bucket_name, path))
}

/// Joins prefix pieces, each of which may hold several `/`-separated parts; empty parts are skipped.
fn join_prefix(pieces: &[&str]) -> Result<Path, BucketError> {
    let parts: Vec<&str> = pieces.iter().flat_map(|piece| piece.split('/')).filter(|part| !part.is_empty()).collect();
    let joined = parts.join("/");
    Path::parse(&joined)
        .map_err(|error| permanent(format!("bucket key prefix {joined:?} is not a valid object path: {error}")))
}

/// object_store's per-request retry for cloud backends: a few quick retries, well inside [`RetryPolicy`]'s budget.
pub fn store_retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: 3,
        retry_timeout: Duration::from_secs(15),
    }
}

/// Connect timeout 5 s; a request may take 30 s plus one second per MiB of part_size (a part at >= 1 MiB/s).
pub fn store_client_options(part_size: u64) -> ClientOptions {
    let request_timeout = Duration::from_secs(30 + part_size.div_ceil(MIB));
    ClientOptions::new().with_connect_timeout(Duration::from_secs(5)).with_timeout(request_timeout)
}

/// `[bucket]` keys that only an S3 store understands, with their values' presence.
fn s3_only_keys(config: &Config) -> Vec<&'static str> {
    let bucket_config = &config.bucket;
    let mut present = Vec::new();
    if bucket_config.region.is_some() {
        present.push("bucket.region");
    }
    if bucket_config.virtual_hosted_style {
        present.push("bucket.virtual_hosted_style");
    }
    if bucket_config.access_key_id.is_some() {
        present.push("bucket.access_key_id");
    }
    if bucket_config.secret_access_key.is_some() {
        present.push("bucket.secret_access_key");
    }
    if bucket_config.session_token.is_some() {
        present.push("bucket.session_token");
    }
    present
}

fn reject_cloud_only_keys(config: &Config, scheme: &str) -> Result<(), BucketError> {
    let mut present = s3_only_keys(config);
    if config.bucket.endpoint.is_some() {
        present.push("bucket.endpoint");
    }
    if config.bucket.allow_http {
        present.push("bucket.allow_http");
    }
    if !config.bucket.options.is_empty() {
        present.push("bucket.options");
    }
    match present.first() {
        None => Ok(()),
        Some(key) => Err(permanent(format!("{key} does not apply to a {scheme}:// bucket"))),
    }
}

/// Parses every `bucket.options` key with `parse`, naming the first unknown one.
fn parse_options<K>(
    config: &Config,
    parse: impl Fn(&str) -> Result<K, object_store::Error>,
) -> Result<Vec<(K, String)>, BucketError> {
    config
        .bucket
        .options
        .iter()
        .map(|(name, value)| match parse(name) {
            Ok(key) => Ok((key, value.clone())),
            Err(_) => Err(permanent(format!("bucket.options.{name} is not an option of this bucket's backend"))),
        })
        .collect()
}

fn build_error(scheme: &str, error: object_store::Error) -> BucketError {
    // Builder errors name the bad key or value; they never contain secrets.
    BucketError {
        kind: BucketErrorKind::Permanent,
        message: format!("invalid {scheme} bucket settings: {error}"),
        source: Some(Box::new(error)),
    }
}

fn build_s3(config: &Config, bucket_name: &str, part_size: u64) -> Result<object_store::aws::AmazonS3, BucketError> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    let bucket_config = &config.bucket;
    let options = parse_options(config, |name| name.parse::<AmazonS3ConfigKey>())?;
    // AWS_* environment variables first (the usual credential chain), then the config file, then options by name.
    let mut builder = AmazonS3Builder::from_env()
        .with_client_options(store_client_options(part_size))
        .with_retry(store_retry_config())
        .with_bucket_name(bucket_name)
        .with_allow_http(bucket_config.allow_http)
        .with_virtual_hosted_style_request(bucket_config.virtual_hosted_style);
    if let Some(endpoint) = &bucket_config.endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    if let Some(region) = &bucket_config.region {
        builder = builder.with_region(region);
    }
    if let Some(access_key_id) = &bucket_config.access_key_id {
        builder = builder.with_access_key_id(access_key_id);
    }
    if let Some(secret_access_key) = &bucket_config.secret_access_key {
        builder = builder.with_secret_access_key(secret_access_key.expose());
    }
    if let Some(session_token) = &bucket_config.session_token {
        builder = builder.with_token(session_token.expose());
    }
    for (key, value) in options {
        builder = builder.with_config(key, value);
    }
    builder.build().map_err(|error| build_error("s3", error))
}

fn build_gcs(
    config: &Config,
    bucket_name: &str,
    part_size: u64,
) -> Result<object_store::gcp::GoogleCloudStorage, BucketError> {
    use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
    reject_keys(&s3_only_keys(config), "gs")?;
    if config.bucket.endpoint.is_some() {
        return Err(permanent("bucket.endpoint does not apply to a gs:// bucket".into()));
    }
    let options = parse_options(config, |name| name.parse::<GoogleConfigKey>())?;
    let mut builder = GoogleCloudStorageBuilder::from_env()
        .with_client_options(store_client_options(part_size).with_allow_http(config.bucket.allow_http))
        .with_retry(store_retry_config())
        .with_bucket_name(bucket_name);
    for (key, value) in options {
        builder = builder.with_config(key, value);
    }
    builder.build().map_err(|error| build_error("gs", error))
}

fn build_azure(config: &Config, part_size: u64) -> Result<object_store::azure::MicrosoftAzure, BucketError> {
    use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
    reject_keys(&s3_only_keys(config), "az")?;
    let options = parse_options(config, |name| name.parse::<AzureConfigKey>())?;
    let mut builder = MicrosoftAzureBuilder::from_env()
        .with_client_options(store_client_options(part_size))
        .with_retry(store_retry_config())
        .with_url(config.bucket.url.clone())
        .with_allow_http(config.bucket.allow_http);
    if let Some(endpoint) = &config.bucket.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    for (key, value) in options {
        builder = builder.with_config(key, value);
    }
    builder.build().map_err(|error| build_error("az", error))
}

fn reject_keys(present: &[&str], scheme: &str) -> Result<(), BucketError> {
    match present.first() {
        None => Ok(()),
        Some(key) => Err(permanent(format!("{key} does not apply to a {scheme}:// bucket (use bucket.options)"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn config_with(url: &str) -> Config {
        let mut config = Config { catalog_name: "edge-7".into(), ..Default::default() };
        config.bucket.url = url.into();
        config
    }

    fn summary(first_captured_at_ns: u64, created_at_ns: u64) -> PackSummary {
        PackSummary {
            pack_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0001),
            bytes: 200,
            records: 1,
            sha256_hex: "00".repeat(32),
            first_captured_at_ns,
            last_captured_at_ns: first_captured_at_ns,
            created_at_ns,
        }
    }

    const NS_PER_SECOND: u64 = 1_000_000_000;

    #[test]
    fn pack_key_uses_the_utc_day_of_the_first_capture() {
        let bucket = Bucket::from_config(&config_with("memory://")).unwrap();
        // 2024-02-29T23:59:59.999999999Z: the last nanosecond of a leap day stays on that day.
        let leap_day_end_ns = 1_709_251_199 * NS_PER_SECOND + 999_999_999;
        let key = bucket.pack_key(&summary(leap_day_end_ns, 1_800_000_000 * NS_PER_SECOND));
        assert_eq!(key.as_ref(), "capstore/edge-7/2024/02/29/01900000-0000-7000-8000-000000000001.cpk");
        // One nanosecond later is the next UTC day.
        let key = bucket.pack_key(&summary(leap_day_end_ns + 1, 0));
        assert!(key.as_ref().starts_with("capstore/edge-7/2024/03/01/"), "{key}");
    }

    #[test]
    fn pack_key_falls_back_to_created_at_when_no_capture_time() {
        let bucket = Bucket::from_config(&config_with("memory://")).unwrap();
        let key = bucket.pack_key(&summary(0, 1_700_000_000 * NS_PER_SECOND));
        assert!(key.as_ref().starts_with("capstore/edge-7/2023/11/14/"), "{key}");
        let epoch_key = bucket.pack_key(&summary(0, 0));
        assert!(epoch_key.as_ref().starts_with("capstore/edge-7/1970/01/01/"), "{epoch_key}");
    }

    #[test]
    fn pack_key_is_deterministic() {
        let bucket = Bucket::from_config(&config_with("memory://")).unwrap();
        let pack = summary(1_700_000_000 * NS_PER_SECOND, 0);
        assert_eq!(bucket.pack_key(&pack), bucket.pack_key(&pack));
    }

    #[test]
    fn a_url_path_and_the_prefix_join_into_the_catalog_prefix() {
        let mut config = config_with("s3://my-bucket/deep/path/");
        config.bucket.prefix = "captures/v1".into();
        config.bucket.region = Some("us-east-1".into());
        let bucket = Bucket::from_config(&config).unwrap();
        assert_eq!(bucket.catalog_prefix().as_ref(), "deep/path/captures/v1/edge-7");
        config.bucket.prefix = String::new();
        config.bucket.url = "memory://".into();
        config.bucket.region = None;
        assert_eq!(Bucket::from_config(&config).unwrap().catalog_prefix().as_ref(), "edge-7");
    }

    #[test]
    fn s3_options_pass_through_by_name_and_unknown_ones_are_named() {
        let mut config = config_with("s3://my-bucket");
        config.bucket.region = Some("eu-west-1".into());
        config.bucket.options.insert("unsigned_payload".into(), "true".into());
        config.bucket.options.insert("aws_checksum_algorithm".into(), "sha256".into());
        Bucket::from_config(&config).unwrap();

        config.bucket.options.insert("no_such_option".into(), "1".into());
        let error = Bucket::from_config(&config).unwrap_err();
        assert_eq!(error.kind, BucketErrorKind::Permanent);
        assert!(error.message.contains("bucket.options.no_such_option"), "{error}");
    }

    #[test]
    fn a_bad_option_value_is_a_permanent_error_naming_it() {
        let mut config = config_with("s3://my-bucket");
        config.bucket.region = Some("eu-west-1".into());
        config.bucket.options.insert("checksum_algorithm".into(), "md7".into());
        let error = Bucket::from_config(&config).unwrap_err();
        assert_eq!(error.kind, BucketErrorKind::Permanent);
        assert!(error.message.contains("md7"), "{error}");
    }

    #[test]
    fn s3_only_keys_are_rejected_for_other_backends() {
        let mut config = config_with("memory://");
        config.bucket.region = Some("eu-west-1".into());
        let error = Bucket::from_config(&config).unwrap_err();
        assert!(error.message.contains("bucket.region"), "{error}");

        let mut config = config_with("gs://my-bucket");
        config.bucket.access_key_id = Some("AKIA".into());
        let error = Bucket::from_config(&config).unwrap_err();
        assert!(error.message.contains("bucket.access_key_id") && error.message.contains("gs://"), "{error}");

        let mut config = config_with("az://container");
        config.bucket.options.insert("bogus".into(), "1".into());
        let error = Bucket::from_config(&config).unwrap_err();
        assert!(error.message.contains("bucket.options.bogus"), "{error}");
    }

    #[test]
    fn secrets_never_appear_in_errors_or_debug() {
        let mut config = config_with("s3://my-bucket");
        config.bucket.region = Some("eu-west-1".into());
        config.bucket.access_key_id = Some("AKIAEXAMPLE".into());
        config.bucket.secret_access_key = Some(crate::config::Secret::new("hunter2-secret"));
        config.bucket.session_token = Some(crate::config::Secret::new("token-secret"));
        let bucket = Bucket::from_config(&config).unwrap();
        let shown = format!("{bucket:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("token-secret"), "{shown}");

        config.bucket.options.insert("checksum_algorithm".into(), "md7".into());
        let error = Bucket::from_config(&config).unwrap_err();
        let shown = format!("{error} {error:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("token-secret"), "{shown}");
    }

    #[test]
    fn bad_urls_are_permanent_errors() {
        for url in ["ftp://x", "s3://", "file://relative/path", "no-scheme"] {
            let error = Bucket::from_config(&config_with(url)).unwrap_err();
            assert_eq!(error.kind, BucketErrorKind::Permanent, "{url}: {error}");
        }
    }

    #[test]
    fn file_urls_create_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("a/b");
        let bucket = Bucket::from_config(&config_with(&format!("file://{}", root.display()))).unwrap();
        assert!(root.is_dir());
        assert!(!bucket.supports_metadata());
        assert_eq!(bucket.catalog_prefix().as_ref(), "capstore/edge-7");
    }

    fn generic(text: &str) -> object_store::Error {
        object_store::Error::Generic { store: "S3", source: text.to_string().into() }
    }

    #[test]
    fn classify_sorts_every_kind_of_error() {
        use object_store::Error as E;
        let boxed = || -> Box<dyn std::error::Error + Send + Sync> { "x".into() };
        let cases: Vec<(E, BucketErrorKind)> = vec![
            (E::NotFound { path: "k".into(), source: boxed() }, BucketErrorKind::NotFound),
            (E::AlreadyExists { path: "k".into(), source: boxed() }, BucketErrorKind::Conflict),
            (E::Precondition { path: "k".into(), source: boxed() }, BucketErrorKind::Conflict),
            (E::PermissionDenied { path: "k".into(), source: boxed() }, BucketErrorKind::Permanent),
            (E::Unauthenticated { path: "k".into(), source: boxed() }, BucketErrorKind::Permanent),
            (E::NotImplemented, BucketErrorKind::Permanent),
            (E::NotSupported { source: boxed() }, BucketErrorKind::Permanent),
            (E::UnknownConfigurationKey { store: "S3", key: "k".into() }, BucketErrorKind::Permanent),
            (generic("Error performing PUT http://h/b/k in 2s - error sending request"), BucketErrorKind::Transient),
            (
                generic("Error performing GET http://h/b/k in 1ms - Server returned non-2xx status code: 503 Service Unavailable: "),
                BucketErrorKind::Transient,
            ),
            (
                generic("Error performing PUT http://h/b/k in 1ms - Server returned non-2xx status code: 400 Bad Request: "),
                BucketErrorKind::Permanent,
            ),
            (generic("... status code: 429 Too Many Requests"), BucketErrorKind::Transient),
            (generic("... status code: 408 Request Timeout"), BucketErrorKind::Transient),
            (
                E::Generic {
                    store: "LocalFileSystem",
                    source: Box::new(std::io::Error::from(std::io::ErrorKind::PermissionDenied)),
                },
                BucketErrorKind::Permanent,
            ),
            (
                E::Generic { store: "LocalFileSystem", source: Box::new(std::io::Error::from(std::io::ErrorKind::StorageFull)) },
                BucketErrorKind::Transient,
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(classify(&error), expected, "{error}");
        }
    }

    #[test]
    fn backoff_is_bounded_full_jitter() {
        let policy = RetryPolicy::default();
        for retry in 1..40 {
            let ceiling = policy.initial_backoff.saturating_mul(1u32.checked_shl(retry - 1).unwrap_or(u32::MAX));
            let ceiling = ceiling.min(policy.max_backoff);
            for _ in 0..20 {
                assert!(policy.backoff(retry) <= ceiling);
            }
        }
        // Full jitter: the sleeps spread over the whole range, not just near the ceiling.
        let sleeps: Vec<Duration> = (0..200).map(|_| policy.backoff(10)).collect();
        assert!(sleeps.iter().any(|sleep| *sleep < Duration::from_secs(1)));
        assert!(sleeps.iter().any(|sleep| *sleep > Duration::from_secs(4)));
    }
}
