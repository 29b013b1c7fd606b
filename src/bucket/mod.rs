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
//! # Upload protocol ([`Bucket::upload_pack`], in `upload.rs`)
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
//! The pack's SHA-256 and record count go into object metadata (`capstore-sha256`, `capstore-records`; on Azure,
//! whose metadata names must be C# identifiers, `capstore_sha256`, `capstore_records`) on backends that store it.
//! What each backend does:
//!
//! | backend | `PutMode::Create` | metadata attributes |
//! | --- | --- | --- |
//! | `s3://` | `If-None-Match: *` -> `AlreadyExists` (tested live on SeaweedFS) | stored as `x-amz-meta-*` (tested) |
//! | `az://` | `If-None-Match: *` -> `AlreadyExists` (tested live on Azurite) | stored, `_` names (tested) |
//! | `gs://` | the provider's preconditions (object_store; not tested here: no emulator takes its writes) | stored |
//! | `memory://` | supported (tested) | stored (tested) |
//! | `file://` | [`local_dir`]: link(2) of the fsynced pack, atomic, `AlreadyExists` (tested) | not stored, so not sent |
//!
//! The multipart path is check-then-write on every backend: two writers of different bytes under one key racing
//! between the HEAD and completion could replace each other's object (the size check after upload catches only a
//! size difference). Keys hold the pack_id, which only the spool that wrote the pack uses, so this needs two
//! processes uploading different packs with the same id, which the spool's owner lock rules out.
//!
//! # Backends and settings ([`Bucket::from_config`], built in `backends.rs`)
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
//! [`BucketErrorKind::Transient`]. Each retry logs at DEBUG only: the caller logs the outage ([`crate::retry`]). When
//! the loop gives up the error is still `Transient`: a bucket outage is never a pack's fault, so the caller retries
//! later without counting it against the pack. Every step is idempotent (same
//! key, same bytes, compare on conflict), so retrying a whole upload is safe even when an earlier attempt's outcome is
//! unknown. Cloud backends also get object_store's own per-request retry ([`store_retry_config`]: a few quick
//! retries of 5xx and connection errors, 15 s budget) and timeouts (connect 5 s; a request 30 s plus one second per
//! MiB of part_size), so no single request hangs.

mod backends;
mod error;
pub mod local_dir;
mod upload;

pub use backends::{longest_attempt, store_client_options, store_retry_config};
pub use error::{classify, BucketError, BucketErrorKind};
pub use upload::UploadOutcome;

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{Attribute, ObjectStore};
use tokio::sync::Semaphore;

use crate::config::Config;
use crate::pack::{
    check_trailer_fits, decode_footer, decode_header, decode_record, decode_trailer, CaptureMeta, IndexEntry,
    PackSummary, Trailer, FOOTER_HEADER_LEN, HEADER_LEN, PACK_EXTENSION, TRAILER_LEN,
};
use crate::retry::RetryPolicy;
use crate::telemetry::Liveness;
use error::permanent;

/// Parts of one multipart upload that may be in flight at once.
pub const MULTIPART_PARTS_IN_FLIGHT: usize = 2;
/// Ranges closer than this are read with one request: a GET costs more than a megabyte of transfer on every backend.
pub const COALESCE_GAP: u64 = 1 << 20;
/// The most one coalesced read fetches (a record larger than this is read alone, whole).
pub const COALESCE_MAX: u64 = 16 << 20;
/// Coalesced reads of one object in flight at once.
pub const COALESCED_READS_IN_FLIGHT: usize = 4;

/// `ranges` sorted and merged where they are less than [`COALESCE_GAP`] apart, each merged read at most
/// [`COALESCE_MAX`] long (unless one range alone is longer).
fn coalesce_ranges(ranges: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut sorted = ranges.to_vec();
    sorted.sort_by_key(|range| (range.start, range.end));
    let mut merged: Vec<Range<u64>> = Vec::new();
    for range in sorted {
        match merged.last_mut() {
            Some(last)
                if range.start <= last.end.saturating_add(COALESCE_GAP)
                    && range.end.max(last.end) - last.start <= COALESCE_MAX =>
            {
                last.end = last.end.max(range.end);
            }
            _ => merged.push(range),
        }
    }
    merged
}

/// The object metadata names of a pack's SHA-256 (hex) and record count on a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetadataNames {
    pub sha256: &'static str,
    pub records: &'static str,
}

impl MetadataNames {
    fn for_scheme(scheme: &str) -> MetadataNames {
        match scheme {
            // Azure refuses metadata names that are not C# identifiers (InvalidMetadata for a `-`).
            "az" => MetadataNames { sha256: "capstore_sha256", records: "capstore_records" },
            // Dashes elsewhere: proxies in front of S3-compatible stores may drop headers with underscores.
            _ => MetadataNames { sha256: "capstore-sha256", records: "capstore-records" },
        }
    }
}
/// The name part that marks a compacted pack's key (see [`Bucket::compacted_pack_key`]).
pub const COMPACTED_MARK: &str = "compacted";

/// A pack's id from its key, `<...>/<pack_id>.cpk` or `<...>/<pack_id>.compacted.cpk`, and whether it is compacted.
pub fn pack_of_key(key: &str) -> Option<(uuid::Uuid, bool)> {
    let name = key.rsplit('/').next()?;
    let stem = name.strip_suffix(&format!(".{PACK_EXTENSION}"))?;
    match stem.strip_suffix(&format!(".{COMPACTED_MARK}")) {
        Some(compacted) => Some((uuid::Uuid::parse_str(compacted).ok()?, true)),
        None => Some((uuid::Uuid::parse_str(stem).ok()?, false)),
    }
}

/// The largest footer read from a bucket (a pack of 100,000 captures with modest labels has a 30 MiB one).
pub const MAX_REMOTE_FOOTER_BYTES: u64 = 256 << 20;

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
    /// `<url path>/<bucket.prefix>`: where `capstore check-config --online` writes its probe object, outside every
    /// catalog's prefix so that no listing ever finds one.
    probe_prefix: Path,
    part_size: u64,
    upload_permits: Arc<Semaphore>,
    retry_policy: RetryPolicy,
    /// Told of every request attempt that ends and every multipart part sent (the pipeline's watchdog liveness).
    liveness: Liveness,
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
        let opened = backends::open_store(config)?;
        let catalog_prefix = join_prefix(&[&opened.url_prefix, &config.bucket.prefix, &config.catalog_name])?;
        let probe_prefix = join_prefix(&[&opened.url_prefix, &config.bucket.prefix])?;
        let concurrency = config.upload.concurrency.max(1) as usize;
        Ok(Bucket {
            store: opened.store,
            local_dir: opened.local_dir,
            scheme: opened.scheme,
            supports_metadata: opened.scheme != "file",
            catalog_prefix,
            probe_prefix,
            part_size: config.upload.part_size.0.max(1),
            upload_permits: Arc::new(Semaphore::new(concurrency)),
            retry_policy: RetryPolicy::default(),
            liveness: Liveness::default(),
        })
    }

    /// Report progress to `liveness`: each request attempt that ends (answered or failed) and each part sent.
    pub fn with_liveness(mut self, liveness: Liveness) -> Self {
        self.liveness = liveness;
        self
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

    /// The metadata names uploads use on this backend.
    pub fn metadata_names(&self) -> MetadataNames {
        MetadataNames::for_scheme(self.scheme)
    }

    /// `<url path>/<bucket.prefix>/<catalog_name>`: every pack of this catalog lives below it.
    pub fn catalog_prefix(&self) -> Path {
        self.catalog_prefix.clone()
    }

    /// `<catalog prefix>/<yyyy>/<mm>/<dd>/<pack_id>.cpk`, the UTC day of the first capture.
    pub fn pack_key(&self, summary: &PackSummary) -> Path {
        self.dated_key(summary, format!("{}.{PACK_EXTENSION}", summary.pack_id))
    }

    fn dated_key(&self, summary: &PackSummary, file_name: String) -> Path {
        let day_ns =
            if summary.first_captured_at_ns != 0 { summary.first_captured_at_ns } else { summary.created_at_ns };
        let (year, month, day) = utc_date(day_ns);
        self.catalog_prefix.child(year).child(month).child(day).child(file_name)
    }

    /// `<catalog prefix>/<yyyy>/<mm>/<dd>/<pack_id>.compacted.cpk`: a pack a compaction wrote (see
    /// [`crate::pipeline::compaction`]). Named apart so that reconcile never publishes one as new captures: its
    /// captures are published already, and only the compaction's own switch-over may point at it.
    pub fn compacted_pack_key(&self, summary: &PackSummary) -> Path {
        self.dated_key(summary, format!("{}.{COMPACTED_MARK}.{PACK_EXTENSION}", summary.pack_id))
    }

    /// Delete the object at `key`; one that is gone already counts as deleted (S3 answers OK, Azure and local
    /// directories NotFound).
    pub async fn delete_object(&self, key: &str) -> Result<(), BucketError> {
        let path = parse_key(key)?;
        let path_ref = &path;
        self.with_retries("delete", &path, || async move {
            match self.store.delete(path_ref).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(error) => Err(BucketError::from_store(format_args!("delete {key}"), error)),
            }
        })
        .await
    }

    /// Prove the bucket takes what uploads need: create a probe object with `PutMode::Create`, read it back, create
    /// it again (which must be refused as already existing: uploads rely on that to never replace a pack), delete it
    /// (a delete of an object already gone, NotFound on Azure and OK on S3, counts as deleted). Returns the probe's
    /// key; on failure, which step failed and why.
    pub async fn probe_conditional_create(&self) -> Result<String, (&'static str, BucketError)> {
        use object_store::{PutMode, PutOptions, PutPayload};
        let key = self.probe_prefix.child(format!(".capstore-probe-{}", uuid::Uuid::new_v4()));
        let create = || PutOptions { mode: PutMode::Create, ..PutOptions::default() };
        let body = Bytes::from_static(b"capstore check-config probe\n");
        let store_error = |what: &str, error| BucketError::from_store(format_args!("{what} {key}"), error);
        self.store
            .put_opts(&key, PutPayload::from(body.clone()), create())
            .await
            .map_err(|error| ("create", store_error("create", error)))?;
        let read_back = async { self.store.get(&key).await?.bytes().await };
        let read = match read_back.await {
            Ok(bytes) if bytes == body => Ok(()),
            Ok(_) => Err(BucketError::new(BucketErrorKind::Permanent, format!("{key} reads back different bytes"))),
            Err(error) => Err(store_error("read", error)),
        };
        let conditional = match self.store.put_opts(&key, PutPayload::from(body), create()).await {
            Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
            Ok(_) => Err(BucketError::new(
                BucketErrorKind::Permanent,
                "a second create of the same key succeeded: this store does not support conditional create \
                 (If-None-Match), which uploads need so as never to replace a pack",
            )),
            Err(error) => Err(store_error("create again", error)),
        };
        // Always delete, whatever failed after the create.
        let deleted = match self.store.delete(&key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(error) => Err(("delete", store_error("delete", error))),
        };
        read.map_err(|error| ("read back", error))?;
        conditional.map_err(|error| ("conditional create", error))?;
        deleted?;
        Ok(key.to_string())
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

    /// Several ranges of the object at `key`, in the order given, in few requests: ranges less than
    /// [`COALESCE_GAP`] apart are read as one, up to [`COALESCE_MAX`] per read (so one read stays well inside the
    /// request timeout and bounds what is in flight), [`COALESCED_READS_IN_FLIGHT`] reads at a time.
    pub async fn read_ranges(&self, key: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>, BucketError> {
        let merged = coalesce_ranges(ranges);
        let reads: Vec<Result<Bytes, BucketError>> = futures::stream::iter(merged.iter().cloned())
            .map(|range| self.read_range(key, range))
            .buffered(COALESCED_READS_IN_FLIGHT)
            .collect()
            .await;
        let reads = reads.into_iter().collect::<Result<Vec<Bytes>, BucketError>>()?;
        ranges
            .iter()
            .map(|range| {
                let at = merged.partition_point(|read| read.start <= range.start).saturating_sub(1);
                let (read, bytes) = (&merged[at], &reads[at]);
                let (start, end) = ((range.start - read.start) as usize, (range.end - read.start) as usize);
                bytes.get(start..end).map(|slice| bytes.slice_ref(slice)).ok_or_else(|| {
                    BucketError::new(BucketErrorKind::Transient, format!("{key}: a short read of bytes {read:?}"))
                })
            })
            .collect()
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
        if trailer.footer_len > MAX_REMOTE_FOOTER_BYTES {
            // A footer is read whole into memory: bound what a crafted object can cost.
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!(
                    "{key} is not a valid pack: its footer is {} bytes, over the {MAX_REMOTE_FOOTER_BYTES} read from a bucket",
                    trailer.footer_len
                ),
            ));
        }
        let footer_range = trailer.footer_offset..trailer.footer_offset + trailer.footer_len;
        let footer_bytes = self.read_range(key, footer_range).await?;
        let entries = decode_footer(&footer_bytes, &trailer).map_err(|error| BucketError::invalid_pack(key, error))?;
        Ok(RemotePack { key: key.to_string(), size, trailer, entries })
    }

    /// The whole-pack checks reconcile makes before it publishes a pack it did not write: the header names the pack
    /// id the key does, and the SHA-256 of every byte before the trailer (streamed, a chunk at a time) is the one the
    /// trailer records. Either failing is [`BucketErrorKind::InvalidPack`].
    pub async fn verify_pack(&self, remote: &RemotePack, expected_pack_id: uuid::Uuid) -> Result<(), BucketError> {
        use futures::StreamExt;
        use sha2::{Digest, Sha256};
        let key = &remote.key;
        let header_bytes = self.read_range(key, 0..HEADER_LEN as u64).await?;
        let header = decode_header(&header_bytes).map_err(|error| BucketError::invalid_pack(key, error))?;
        if header.pack_id != expected_pack_id {
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!(
                    "{key} is not a valid pack: its header says pack {}, its name {expected_pack_id}",
                    header.pack_id
                ),
            ));
        }
        let hashed_len = remote.trailer.footer_offset + remote.trailer.footer_len;
        let path = parse_key(key)?;
        let options = object_store::GetOptions { range: Some((0..hashed_len).into()), ..Default::default() };
        let result = self
            .store
            .get_opts(&path, options)
            .await
            .map_err(|error| BucketError::from_store(format_args!("read {key}"), error))?;
        let mut chunks = result.into_stream();
        let mut hasher = Sha256::new();
        while let Some(chunk) = chunks.next().await {
            hasher.update(chunk.map_err(|error| BucketError::from_store(format_args!("read {key}"), error))?);
        }
        let computed: [u8; 32] = hasher.finalize().into();
        if computed != remote.trailer.sha256 {
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!("{key} is not a valid pack: its SHA-256 differs from the one its trailer records"),
            ));
        }
        Ok(())
    }

    /// Reads one capture with one range read; its CRC and metadata are checked against `entry`.
    pub async fn read_capture(&self, key: &str, entry: &IndexEntry) -> Result<(CaptureMeta, Vec<u8>), BucketError> {
        let record_bytes = self.read_range(key, entry.record_range()).await?;
        decode_record(&record_bytes, entry).map_err(|error| BucketError::invalid_pack(key, error))
    }

    /// True when the store lists at least one object under the catalog prefix: a pack that reads as not found in a
    /// bucket that holds others is gone; in one that lists nothing, the bucket (or its mount, or the prefix) is
    /// what is missing.
    pub async fn holds_objects(&self) -> Result<bool, BucketError> {
        Ok(self.list_objects(None).next().await.transpose()?.is_some())
    }

    /// Every object under the catalog prefix as (key, size), packs or not, as the store lists them (in no promised
    /// order), so reconcile can find what the catalog lacks with bounded memory. With `days`, only the prefixes of
    /// those UTC days (a pack's key is dated by its first capture).
    pub fn list_objects(
        &self,
        days: Option<DayRange>,
    ) -> futures::stream::BoxStream<'_, Result<(String, u64), BucketError>> {
        let prefixes: Vec<Path> = match days {
            None => vec![self.catalog_prefix.clone()],
            Some(days) => {
                days.days().map(|(year, month, day)| self.catalog_prefix.child(year).child(month).child(day)).collect()
            }
        };
        let store = self.store.clone();
        futures::stream::iter(prefixes)
            .map(move |prefix| {
                let listed = store.list(Some(&prefix));
                listed
                    .map_ok(|meta| (meta.location.to_string(), meta.size))
                    .map_err(move |error| BucketError::from_store(format_args!("list {prefix}"), error))
            })
            .flatten()
            .boxed()
    }

    /// Runs `operation` until it succeeds, fails with a non-transient error, or the retry policy is spent. Each
    /// retry is logged at DEBUG: the caller decides what an operation that gave up means (see [`crate::retry`]).
    async fn with_retries<T, F, Fut>(&self, what: &str, key: &Path, mut operation: F) -> Result<T, BucketError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, BucketError>>,
    {
        let mut backoff = self.retry_policy.start();
        loop {
            let outcome = operation().await;
            // An attempt that ended, even failed, is a bounded step that finished (see `backends::longest_attempt`).
            self.liveness.progress();
            let error = match outcome {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            if !error.is_transient() {
                return Err(error);
            }
            let Some(delay) = backoff.next_delay() else { return Err(error) };
            tracing::debug!(
                operation = what,
                key = %key,
                attempt = backoff.failures(),
                backoff_ms = delay.as_millis() as u64,
                error = %error,
                "bucket operation failed, retrying"
            );
            tokio::time::sleep(delay).await;
        }
    }
}

fn parse_key(key: &str) -> Result<Path, BucketError> {
    Path::parse(key)
        .map_err(|error| BucketError::new(BucketErrorKind::Permanent, format!("invalid key {key:?}: {error}")))
}

/// Whole UTC days, `first` to `last` inclusive, as days since the epoch: a window of `capstore reconcile`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DayRange {
    pub first: u64,
    pub last: u64,
}

impl DayRange {
    const NS_PER_DAY: u64 = 86_400 * 1_000_000_000;

    /// The days holding `since_ns` to `until_ns` (inclusive).
    pub fn covering(since_ns: u64, until_ns: u64) -> DayRange {
        DayRange { first: since_ns / Self::NS_PER_DAY, last: until_ns / Self::NS_PER_DAY }
    }

    /// `yyyy`, `mm`, `dd` of each day, in order.
    pub fn days(&self) -> impl Iterator<Item = (String, String, String)> {
        (self.first..=self.last).map(|day| utc_date(day * Self::NS_PER_DAY))
    }
}

/// `yyyy`, `mm`, `dd` of a time in nanoseconds since the epoch, in UTC.
fn utc_date(ns: u64) -> (String, String, String) {
    let rfc3339 = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_nanos(ns)).to_string();
    debug_assert_eq!(&rfc3339[4..5], "-");
    (rfc3339[0..4].to_string(), rfc3339[5..7].to_string(), rfc3339[8..10].to_string())
}

/// Joins prefix pieces, each of which may hold several `/`-separated parts; empty parts are skipped.
fn join_prefix(pieces: &[&str]) -> Result<Path, BucketError> {
    let parts: Vec<&str> = pieces.iter().flat_map(|piece| piece.split('/')).filter(|part| !part.is_empty()).collect();
    let joined = parts.join("/");
    Path::parse(&joined)
        .map_err(|error| permanent(format!("bucket key prefix {joined:?} is not a valid object path: {error}")))
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
    fn a_day_range_covers_whole_utc_days_across_months() {
        // 2024-02-28T12:00:00Z to 2024-03-01T00:00:00Z: the leap day is in, the first of March too (its midnight).
        let days = DayRange::covering(1_709_121_600 * NS_PER_SECOND, 1_709_251_200 * NS_PER_SECOND);
        let listed: Vec<String> = days.days().map(|(y, m, d)| format!("{y}/{m}/{d}")).collect();
        assert_eq!(listed, ["2024/02/28", "2024/02/29", "2024/03/01"]);
        assert_eq!(DayRange::covering(0, 0).days().count(), 1);
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
    fn ranges_coalesce_across_small_gaps_up_to_the_cap() {
        let mib = 1 << 20;
        let merged = coalesce_ranges(&[10..20, 0..5, 30..40]);
        assert_eq!(merged.len(), 1);
        assert_eq!((merged[0].start, merged[0].end), (0, 40));
        // A gap of more than COALESCE_GAP splits; a merged read never passes COALESCE_MAX.
        assert_eq!(coalesce_ranges(&[0..10, (10 + 2 * mib)..(11 + 2 * mib)]).len(), 2);
        let many: Vec<Range<u64>> = (0..40).map(|i| (i * mib)..((i + 1) * mib)).collect();
        let merged = coalesce_ranges(&many);
        assert!(merged.iter().all(|read| read.end - read.start <= COALESCE_MAX), "{merged:?}");
        assert_eq!(merged.first().unwrap().start, 0);
        assert_eq!(merged.last().unwrap().end, 40 * mib);
        assert_eq!(merged.len(), 3);
        // One range larger than the cap is read alone, whole.
        let whole = 0..(20 * mib);
        assert_eq!(coalesce_ranges(std::slice::from_ref(&whole)), [whole]);
    }

    #[test]
    fn gs_urls_and_options_are_parsed_and_wrong_ones_named() {
        // No emulator takes object_store's GCS uploads, so this and the live read test are what gs:// has.
        let mut config = config_with("gs://my-bucket/some/path");
        config.bucket.options.insert(
            "service_account_key".into(),
            r#"{"disable_oauth": true, "client_email": "", "private_key": "", "private_key_id": ""}"#.into(),
        );
        let bucket = Bucket::from_config(&config).unwrap();
        assert_eq!(bucket.scheme(), "gs");
        assert_eq!(bucket.catalog_prefix().to_string(), format!("some/path/capstore/{}", config.catalog_name));
        assert_eq!(bucket.metadata_names().sha256, "capstore-sha256");

        config.bucket.endpoint = Some("http://127.0.0.1:1".into());
        let error = Bucket::from_config(&config).unwrap_err();
        assert!(error.message.contains("bucket.endpoint") && error.message.contains("gs://"), "{error}");
        config.bucket.endpoint = None;
        config.bucket.options.insert("no_such_gcs_option".into(), "1".into());
        let error = Bucket::from_config(&config).unwrap_err();
        assert!(error.message.contains("bucket.options.no_such_gcs_option"), "{error}");
        let error = Bucket::from_config(&config_with("gs://")).unwrap_err();
        assert_eq!(error.kind, BucketErrorKind::Permanent, "{error}");
    }

    #[test]
    fn azure_metadata_names_are_identifiers() {
        let mut config = config_with("az://container");
        config.bucket.options.insert("account_name".into(), "devstoreaccount1".into());
        config.bucket.options.insert("access_key".into(), "a2V5".into());
        let names = Bucket::from_config(&config).unwrap().metadata_names();
        for name in [names.sha256, names.records] {
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "{name}");
        }
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
}
