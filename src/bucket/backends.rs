//! Backends: `bucket.url` and the `[bucket]` keys turned into an object_store, with timeouts and per-request retries.
//! The keys each backend accepts are listed in the module doc of [`crate::bucket`].

use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;

use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use super::error::{permanent, BucketError, BucketErrorKind};
use crate::config::Config;

const MIB: u64 = 1024 * 1024;

/// The store `bucket.url` names, before the catalog's key prefix is applied.
pub(super) struct OpenedStore {
    pub(super) store: Arc<dyn ObjectStore>,
    /// The same store when `bucket.url` is `file://`: uploads go through [`super::local_dir`], which fsyncs.
    pub(super) local_dir: Option<Arc<object_store::local::LocalFileSystem>>,
    /// `file`, `s3`, `gs`, `az` or `memory`.
    pub(super) scheme: &'static str,
    /// The path part of the URL (`s3://bucket/some/path` -> `some/path`), the first part of every key.
    pub(super) url_prefix: String,
}

/// Builds the store named by `bucket.url` with the `[bucket]` options.
pub(super) fn open_store(config: &Config) -> Result<OpenedStore, BucketError> {
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
            crate::durable::create_dirs(root).map_err(|error| {
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
        other => return Err(permanent(format!("bucket.url scheme {other:?} is not one of file, s3, gs, az, memory"))),
    };
    Ok(OpenedStore { store, local_dir, scheme, url_prefix })
}

/// `bucket/some/path` -> (`bucket`, `some/path`).
fn split_bucket<'a>(url: &str, rest: &'a str) -> Result<(&'a str, &'a str), BucketError> {
    let (bucket_name, path) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket_name.is_empty() {
        return Err(permanent(format!("bucket.url {url:?} names no bucket")));
    }
    Ok((bucket_name, path))
}

/// object_store's per-request retry for cloud backends: a few quick retries, well inside [`crate::retry::RetryPolicy`]'s budget.
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
    ClientOptions::new().with_connect_timeout(Duration::from_secs(5)).with_timeout(request_timeout(part_size))
}

fn request_timeout(part_size: u64) -> Duration {
    Duration::from_secs(30 + part_size.div_ceil(MIB))
}

/// The longest one store call can take: object_store retries within its retry timeout, then one last request may
/// run for the whole request timeout. The watchdog needs a period above it.
pub fn longest_attempt(part_size: u64) -> Duration {
    let retry = store_retry_config();
    retry.retry_timeout + retry.backoff.max_backoff + request_timeout(part_size)
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
