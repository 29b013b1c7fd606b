//! Every rule of a configuration, checked at once so an operator can fix them all in one pass.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use super::{units, Config, ConfigError, ConfigProblem, HumanDuration, Secret, GIB, MIB};
use crate::pack;

impl Config {
    /// Check every rule; returns all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let mut bad = |key: &str, problem: String| problems.push(ConfigProblem { key: key.into(), problem });

        if !is_catalog_name(&self.catalog_name) {
            bad(
                "catalog_name",
                format!(
                    "{:?} must be 1-64 characters of letters, digits, '.', '_' or '-' (it is part of bucket keys)",
                    self.catalog_name
                ),
            );
        }
        if self.spool.dir.as_os_str().is_empty() {
            bad("spool.dir", "must not be empty".into());
        }
        if self.spool.max_capture_bytes.0 == 0 || self.spool.max_capture_bytes.0 > pack::MAX_PAYLOAD_BYTES {
            bad(
                "spool.max_capture_bytes",
                format!("must be between 1 byte and the pack format limit of {} bytes", pack::MAX_PAYLOAD_BYTES),
            );
        }
        if self.spool.pack_max_bytes.0 < MIB {
            bad("spool.pack_max_bytes", "must be at least 1MiB".into());
        }
        if self.spool.pack_max_records == 0 || self.spool.pack_max_records > pack::MAX_RECORDS {
            bad(
                "spool.pack_max_records",
                format!("must be between 1 and the pack format limit of {}", pack::MAX_RECORDS),
            );
        }
        if self.spool.pack_max_age.0.is_zero() {
            bad("spool.pack_max_age", "must be greater than 0s".into());
        }
        if self.spool.inbox_rescan_interval.0 < Duration::from_millis(100) {
            bad("spool.inbox_rescan_interval", "must be at least 100ms".into());
        }
        if let Err(problem) = check_bucket_url(&self.bucket.url) {
            bad("bucket.url", problem);
        }
        if self.bucket.prefix.starts_with('/') || self.bucket.prefix.ends_with('/') {
            bad("bucket.prefix", "must not start or end with '/'".into());
        }
        if self.upload.batch_packs == 0 || self.upload.batch_packs > 1000 {
            bad("upload.batch_packs", "must be between 1 and 1000".into());
        }
        if self.upload.concurrency == 0 || self.upload.concurrency > 64 {
            bad("upload.concurrency", "must be between 1 and 64".into());
        }
        if self.upload.part_size.0 < 5 * MIB || self.upload.part_size.0 > 5 * GIB {
            bad("upload.part_size", "must be between 5MiB and 5GiB (the S3 multipart limits)".into());
        }
        if !(self.catalog.url.starts_with("http://") || self.catalog.url.starts_with("https://")) {
            bad("catalog.url", format!("{:?} must start with http:// or https://", self.catalog.url));
        }
        for url in &self.catalog.replica_urls {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                bad(
                    "catalog.replica_urls",
                    format!("{:?} must start with http:// or https://", units::redact_url(url)),
                );
            }
            let same = |other: &String| other.trim_end_matches('/') == url.trim_end_matches('/');
            if same(&self.catalog.url) {
                bad("catalog.replica_urls", format!("{:?} is catalog.url itself", units::redact_url(url)));
            } else if self.catalog.replica_urls.iter().filter(|other| same(other)).count() > 1 {
                bad("catalog.replica_urls", format!("{:?} is listed twice", units::redact_url(url)));
            }
        }
        if !self.catalog.replica_urls.is_empty() && self.catalog.cluster.is_none() {
            bad(
                "catalog.replica_urls",
                "needs catalog.cluster: failing over to a server that does not replicate the same tables would split \
                 the catalog in two"
                    .into(),
            );
        }
        let all_urls = || std::iter::once(&self.catalog.url).chain(&self.catalog.replica_urls);
        if self.catalog.ca_file.is_some() && !all_urls().any(|url| url.starts_with("https://")) {
            bad("catalog.ca_file", "only applies to https:// catalog.url or catalog.replica_urls".into());
        }
        for (key, value) in
            [("catalog.database", &self.catalog.database), ("catalog.table_prefix", &self.catalog.table_prefix)]
        {
            if !is_identifier(value) {
                bad(
                    key,
                    format!("{value:?} must be an identifier: a letter or '_' followed by letters, digits or '_'"),
                );
            }
        }
        if let Some(cluster) = &self.catalog.cluster {
            if !is_identifier(cluster) {
                bad("catalog.cluster", format!("{cluster:?} must be an identifier"));
            }
            if self.catalog.async_insert {
                bad(
                    "catalog.async_insert",
                    "must be false with catalog.cluster: quorum inserts are sequential, and servers do not combine \
                     them with asynchronous inserts"
                        .into(),
                );
            }
        }
        if self.catalog.user.is_empty() {
            bad("catalog.user", "must not be empty".into());
        }
        if self.catalog.request_timeout.0.is_zero() {
            bad("catalog.request_timeout", "must be greater than 0s".into());
        }
        if self.catalog.max_index_attempts == 0 {
            bad("catalog.max_index_attempts", "must be at least 1".into());
        }
        if self.catalog.batch_max_rows == 0 {
            bad("catalog.batch_max_rows", "must be at least 1".into());
        }
        if self.catalog.read_max_memory.0 < 16 * MIB {
            bad("catalog.read_max_memory", "must be at least 16MiB".into());
        }
        if self.catalog.batch_max_bytes.0 < MIB {
            bad("catalog.batch_max_bytes", "must be at least 1MiB".into());
        }

        let lease = &self.lease;
        let margin = Duration::from_millis(100);
        if lease.ttl.0 <= lease.publish_timeout.0 + lease.clock_skew.0 + margin {
            bad(
                "lease.ttl",
                format!(
                    "{} must be greater than lease.publish_timeout + lease.clock_skew + 0.1s = {}",
                    lease.ttl,
                    HumanDuration(lease.publish_timeout.0 + lease.clock_skew.0 + margin)
                ),
            );
        }
        if lease.publish_timeout.0.subsec_nanos() != 0 || lease.publish_timeout.0.is_zero() {
            bad(
                "lease.publish_timeout",
                format!(
                    "{} must be a whole number of seconds, at least 1s (it is sent as max_execution_time)",
                    lease.publish_timeout
                ),
            );
        }
        if self.catalog.request_timeout.0 < lease.publish_timeout.0 * 2 {
            bad(
                "catalog.request_timeout",
                format!(
                    "{} must be at least 2 x lease.publish_timeout = {}",
                    self.catalog.request_timeout,
                    HumanDuration(lease.publish_timeout.0 * 2)
                ),
            );
        }
        if self.shutdown_grace.0.is_zero() {
            bad("shutdown_grace", "must be greater than 0s".into());
        }
        match self.http.listen.parse::<SocketAddr>() {
            Err(_) => bad("http.listen", format!("{:?} must be an address like 127.0.0.1:9464", self.http.listen)),
            // Beyond loopback anyone on the network could post and read captures: only with a token.
            Ok(address) if !address.ip().is_loopback() && self.http.token_file.is_none() => bad(
                "http.listen",
                format!(
                    "{} is reachable beyond this host, so http.token_file must be set (a bearer token every \
                     endpoint but /healthz and /readyz requires)",
                    self.http.listen
                ),
            ),
            Ok(_) => {}
        }
        let http = &self.http;
        for origin in &http.allowed_origins {
            let looks_like_origin = origin.split_once("://").is_some_and(|(scheme, rest)| {
                matches!(scheme, "http" | "https") && !rest.is_empty() && !rest.contains('/')
            });
            if !looks_like_origin {
                bad("http.allowed_origins", format!("{origin:?} must be an origin like https://tool.example:8443"));
            }
        }
        for host in &http.allowed_hosts {
            if host.is_empty() || host.contains(['/', ' ', ',']) {
                bad("http.allowed_hosts", format!("{host:?} must be a host name, optionally with :port"));
            }
        }
        if http.max_connections == 0 || http.max_connections > 65_536 {
            bad("http.max_connections", "must be between 1 and 65536".into());
        }
        if http.max_concurrent_reads == 0 || http.max_concurrent_reads > 4096 {
            bad("http.max_concurrent_reads", "must be between 1 and 4096".into());
        }
        if http.body_timeout.0 < Duration::from_secs(1) {
            bad("http.body_timeout", "must be at least 1s".into());
        }
        if http.max_inflight_bytes.0 < self.spool.max_capture_bytes.0 {
            bad(
                "http.max_inflight_bytes",
                format!(
                    "{} must be at least spool.max_capture_bytes = {}, or a largest capture could never be posted",
                    http.max_inflight_bytes, self.spool.max_capture_bytes
                ),
            );
        }
        if let Some(path) = &self.http.token_file {
            if let Err(problem) = read_token_file(path) {
                bad("http.token_file", problem);
            }
        }
        for (index, policy) in self.retention.iter().enumerate() {
            if let Err(error) = policy.matcher() {
                bad(&format!("retention[{index}].streams"), format!("{:?} is not a glob: {error}", policy.streams));
            }
            if policy.keep.0.is_zero() {
                bad(&format!("retention[{index}].keep"), "must be greater than 0s".into());
            }
        }
        if self.lifecycle.retention_interval.0 < Duration::from_secs(1) {
            bad("lifecycle.retention_interval", "must be at least 1s".into());
        }
        if self.lifecycle.retention_batch == 0 {
            bad("lifecycle.retention_batch", "must be at least 1".into());
        }
        if self.lifecycle.compaction_interval.0 < Duration::from_secs(1) {
            bad("lifecycle.compaction_interval", "must be at least 1s".into());
        }
        if self.lifecycle.compaction_pass_bytes.0 < self.spool.pack_max_bytes.0 {
            bad(
                "lifecycle.compaction_pass_bytes",
                format!(
                    "must be at least spool.pack_max_bytes ({}): a pass reads a pack at least",
                    self.spool.pack_max_bytes.0
                ),
            );
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            bad(
                "log.level",
                format!("{:?} is not a level (error, warn, info, debug, trace) or filter", self.log.level),
            );
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems })
        }
    }
}

fn is_identifier(value: &str) -> bool {
    let mut chars = value.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && value.len() <= 64
}

/// Catalog names appear in bucket keys and SQL literals: keep them to a safe alphabet.
pub fn is_catalog_name(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 64
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        && value != "."
        && value != ".."
}

fn check_bucket_url(url: &str) -> Result<(), String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!("{url:?} must be a URL like file:///var/lib/capstore/bucket or s3://name"));
    };
    match scheme {
        "file" if rest.starts_with('/') => Ok(()),
        "file" => Err(format!("{url:?} must name an absolute path (file:///...)")),
        "s3" | "s3a" | "gs" | "az" | "azure" | "abfs" | "abfss" if !rest.trim_matches('/').is_empty() => Ok(()),
        "s3" | "s3a" | "gs" | "az" | "azure" | "abfs" | "abfss" => Err(format!("{url:?} names no bucket")),
        "memory" => Ok(()),
        other => Err(format!("scheme {other:?} is not one of file, s3, gs, az, memory")),
    }
}

/// The shortest bearer token accepted: 16 characters (about 96 bits in base64) resist guessing over the network.
pub const MIN_TOKEN_LEN: usize = 16;

/// Reads the HTTP bearer token from `path`: surrounding whitespace trimmed, at least [`MIN_TOKEN_LEN`] characters
/// of printable ASCII, and the file must not be readable by every user of the host.
pub fn read_token_file(path: &Path) -> Result<Secret, String> {
    use std::os::unix::fs::PermissionsExt;
    let metadata = std::fs::metadata(path).map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    let mode = metadata.permissions().mode();
    if mode & 0o007 != 0 {
        return Err(format!(
            "{} is readable by every user (mode {:o}); make it 0600 or 0640 (chmod o-rwx)",
            path.display(),
            mode & 0o777
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    let token = text.trim();
    if token.len() < MIN_TOKEN_LEN || !token.chars().all(|c| c.is_ascii_graphic()) {
        return Err(format!(
            "{} must hold a token of at least {MIN_TOKEN_LEN} printable ASCII characters without spaces (for example \
             `openssl rand -base64 24`)",
            path.display()
        ));
    }
    Ok(Secret::new(token))
}
