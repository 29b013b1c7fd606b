//! Configuration: one TOML file, every key overridable from the environment, checked once by [`Config::validate`].
//!
//! Sources, later wins: built-in defaults -> the TOML file (`--config FILE`, else `CAPSTORE_CONFIG`, else none) ->
//! environment variables `CAPSTORE_<SECTION>_<KEY>` (top-level keys: `CAPSTORE_<KEY>`). Unknown keys are errors in
//! both the file and the environment, so a typo never silently falls back to a default.
//!
//! Secrets (`catalog.password`, `bucket.secret_access_key`, `bucket.session_token`) are [`Secret`] values: they print
//! as `"<redacted>"` in `Debug`, in `check-config` output and in logs. Each has a `*_file` twin that names a file
//! holding the secret (read at load time, surrounding whitespace trimmed), which is how container secrets arrive.
//!
//! Sizes are written like `"64MiB"` (or a plain integer of bytes), durations like `"15s"` or `"1m 30s"`.
//!
//! Files: this one holds the keys (structs and defaults) and loading; [`env`] the environment overrides, `validate`
//! every rule, [`units`] sizes, durations and secrets.

mod env;
pub mod units;
mod validate;

pub use env::CONFIG_PATH_ENV;
pub use units::{ByteSize, HumanDuration, Secret};
pub use validate::{is_catalog_name, read_token_file, MIN_TOKEN_LEN};

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use env::{apply_env_overrides, resolve_secret};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Name of the publisher domain: lease, versions and bucket keys are per catalog name.
    pub catalog_name: String,
    /// How long a SIGTERM may spend sealing, uploading and publishing before the process exits.
    pub shutdown_grace: HumanDuration,
    pub spool: SpoolConfig,
    pub bucket: BucketConfig,
    pub upload: UploadConfig,
    pub catalog: CatalogConfig,
    pub lease: LeaseConfig,
    pub http: HttpConfig,
    pub log: LogConfig,
    /// Retention policies (`[[retention]]`), tried in order: the first whose `streams` matches a stream applies
    /// (`streams = "*"` last is the default); captures of a stream no policy matches are kept.
    pub retention: Vec<RetentionPolicy>,
    pub lifecycle: LifecycleConfig,
}

/// How long the captures of matching streams are kept.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionPolicy {
    /// A glob over stream names: `*` matches any run of characters (across `/` too), `?` one, `[ab]` a class.
    pub streams: String,
    /// Captures older than this (by `captured_at_ns`) are deleted.
    pub keep: HumanDuration,
}

impl RetentionPolicy {
    /// The `streams` pattern, compiled (validation checks that it compiles).
    pub fn matcher(&self) -> Result<globset::GlobMatcher, globset::Error> {
        Ok(globset::Glob::new(&self.streams)?.compile_matcher())
    }
}

/// How the lease holder applies retention.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LifecycleConfig {
    /// How often retention looks for captures to delete.
    pub retention_interval: HumanDuration,
    /// Captures deleted per look at most (each 10,000 one publish): the rate retention runs at.
    pub retention_batch: u64,
    /// Merge small published packs, rewrite packs holding deleted captures, and remove replaced objects.
    pub compaction: bool,
    /// How often the lease holder compacts (and removes objects whose grace period is over).
    pub compaction_interval: HumanDuration,
    /// Packs smaller than this are merged with the other small packs of their day.
    pub compaction_small_pack_bytes: ByteSize,
    /// A pack is merged only once it was created at least this long ago (deleted bytes are rewritten at any age).
    pub compaction_min_age: HumanDuration,
    /// Bytes of packs read per pass at most: the rate compaction runs at.
    pub compaction_pass_bytes: ByteSize,
    /// How long a replaced pack's object stays after its switch-over, for readers pinned at an older watermark (a
    /// listing paged with an older cursor, a pinned get) and reads in flight.
    pub read_grace: HumanDuration,
    /// Remove the catalog rows of deleted captures once their bytes are erased and `read_grace` has passed (with
    /// `compaction` on; each removal is an `ALTER ... DELETE` mutation on the server).
    pub purge: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpoolConfig {
    pub dir: PathBuf,
    /// Ingest refuses new captures once the spool holds this many bytes (0 = no limit).
    pub max_bytes: ByteSize,
    /// Ingest refuses new captures while the spool's filesystem has less than this free.
    pub min_free_bytes: ByteSize,
    /// Largest accepted capture payload; larger inbox files go to quarantine.
    pub max_capture_bytes: ByteSize,
    pub pack_max_bytes: ByteSize,
    pub pack_max_records: u64,
    /// Linger: an open pack with at least one record is sealed once it is this old.
    pub pack_max_age: HumanDuration,
    /// Permit a spool on NFS, CIFS, FUSE and similar, where flock cannot be trusted.
    pub allow_shared_filesystem: bool,
    /// Period of the inbox rescan that backs up the filesystem watcher.
    pub inbox_rescan_interval: HumanDuration,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BucketConfig {
    /// `file:///path`, `s3://bucket`, `gs://bucket`, `az://container`, or `memory://` (tests).
    pub url: String,
    /// Key prefix inside the bucket; packs go to `<prefix>/<catalog_name>/<yyyy>/<mm>/<dd>/<pack_id>.cpk`.
    pub prefix: String,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub allow_http: bool,
    /// S3: virtual-hosted-style requests (`bucket.host`) instead of path style (`host/bucket`).
    pub virtual_hosted_style: bool,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<Secret>,
    pub secret_access_key_file: Option<PathBuf>,
    pub session_token: Option<Secret>,
    pub session_token_file: Option<PathBuf>,
    /// Further object_store options passed through by name (for example `google_service_account`).
    pub options: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UploadConfig {
    pub batch_packs: u32,
    pub concurrency: u32,
    pub part_size: ByteSize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CatalogConfig {
    /// ClickHouse HTTP interface, `http://` or `https://`.
    pub url: String,
    /// With `cluster`: the HTTP interfaces of the other replicas of `url`'s shard, failed over to in order when the
    /// current server cannot be reached or loses a reply.
    pub replica_urls: Vec<String>,
    pub database: String,
    pub table_prefix: String,
    pub user: String,
    pub password: Option<Secret>,
    pub password_file: Option<PathBuf>,
    /// PEM file with the CA that signs the server's certificate (https only).
    pub ca_file: Option<PathBuf>,
    pub request_timeout: HumanDuration,
    /// The most memory the server may use for one read (ClickHouse `max_memory_usage`); a read over it fails with a
    /// clear error instead of starving the server. Reads are also stopped on the server after `request_timeout`.
    pub read_max_memory: ByteSize,
    /// Send rows as asynchronous inserts, awaiting their flush, where the server has them (not with `cluster`): a
    /// fleet sharing the tables makes far fewer parts. Off: inserts are synchronous whatever the server's profile.
    pub async_insert: bool,
    pub reconcile_on_start: bool,
    /// ClickHouse cluster name: DDL gets `ON CLUSTER` and Replicated engines.
    pub cluster: Option<String>,
    /// A pack whose rows fail to publish this many times for a reason of its own goes to quarantine.
    pub max_index_attempts: u32,
    pub batch_max_rows: u64,
    pub batch_max_bytes: ByteSize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeaseConfig {
    pub ttl: HumanDuration,
    /// Whole seconds: sent to ClickHouse as `max_execution_time` of every publishing statement.
    pub publish_timeout: HumanDuration,
    /// Largest difference between this host's clock rate/offset and the ClickHouse server's that the lease tolerates.
    pub clock_skew: HumanDuration,
    /// How long a start waits for a crashed predecessor's lease; unset means `ttl + publish_timeout + clock_skew`.
    pub start_wait: Option<HumanDuration>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    pub listen: String,
    /// File holding the bearer token every endpoint but `/healthz` and `/readyz` requires; mandatory when `listen`
    /// is beyond loopback.
    pub token_file: Option<PathBuf>,
    /// Browser origins (`https://tool.example:8443`) whose pages may call the API; a request carrying any other
    /// `Origin` header is refused. Empty: no web page may.
    pub allowed_origins: Vec<String>,
    /// `Host` header values accepted besides the listen address and the loopback names (DNS rebinding protection).
    /// Beyond loopback (where a token is required) an empty list accepts any host.
    pub allowed_hosts: Vec<String>,
    /// Open connections at most; more are closed at once.
    pub max_connections: u32,
    /// A request's headers must arrive within this, and a capture's body within it too.
    pub body_timeout: HumanDuration,
    /// Request bodies in memory at once, across all connections; past it a POST answers 503 with Retry-After.
    pub max_inflight_bytes: ByteSize,
    /// Capture reads (GET of a payload, listings) served at once; past it they answer 503 with Retry-After.
    pub max_concurrent_reads: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A tracing filter: `info`, `debug`, or directives like `capstore=debug,warn`.
    pub level: String,
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            catalog_name: "default".into(),
            shutdown_grace: HumanDuration::secs(30),
            spool: SpoolConfig::default(),
            bucket: BucketConfig::default(),
            upload: UploadConfig::default(),
            catalog: CatalogConfig::default(),
            lease: LeaseConfig::default(),
            http: HttpConfig::default(),
            log: LogConfig::default(),
            retention: Vec::new(),
            lifecycle: LifecycleConfig::default(),
        }
    }
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        LifecycleConfig {
            retention_interval: HumanDuration::secs(60),
            retention_batch: 100_000,
            compaction: true,
            compaction_interval: HumanDuration::secs(300),
            compaction_small_pack_bytes: ByteSize(16 * MIB),
            compaction_min_age: HumanDuration::secs(600),
            compaction_pass_bytes: ByteSize(1024 * MIB),
            read_grace: HumanDuration::secs(3600),
            purge: true,
        }
    }
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            dir: PathBuf::from("/var/lib/capstore/spool"),
            max_bytes: ByteSize(10 * GIB),
            min_free_bytes: ByteSize(GIB),
            max_capture_bytes: ByteSize(64 * MIB),
            pack_max_bytes: ByteSize(64 * MIB),
            pack_max_records: 100_000,
            pack_max_age: HumanDuration::secs(5),
            allow_shared_filesystem: false,
            inbox_rescan_interval: HumanDuration::secs(10),
        }
    }
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            url: "file:///var/lib/capstore/bucket".into(),
            prefix: "capstore".into(),
            endpoint: None,
            region: None,
            allow_http: false,
            virtual_hosted_style: false,
            access_key_id: None,
            secret_access_key: None,
            secret_access_key_file: None,
            session_token: None,
            session_token_file: None,
            options: BTreeMap::new(),
        }
    }
}

impl Default for UploadConfig {
    fn default() -> Self {
        UploadConfig { batch_packs: 8, concurrency: 2, part_size: ByteSize(8 * MIB) }
    }
}

impl Default for CatalogConfig {
    fn default() -> Self {
        CatalogConfig {
            url: "http://127.0.0.1:8123".into(),
            replica_urls: Vec::new(),
            database: "capstore".into(),
            table_prefix: "capstore".into(),
            user: "default".into(),
            password: None,
            password_file: None,
            ca_file: None,
            request_timeout: HumanDuration::secs(10),
            read_max_memory: ByteSize(GIB),
            async_insert: false,
            reconcile_on_start: true,
            cluster: None,
            max_index_attempts: 5,
            batch_max_rows: 100_000,
            batch_max_bytes: ByteSize(64 * MIB),
        }
    }
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            ttl: HumanDuration::secs(15),
            publish_timeout: HumanDuration::secs(5),
            clock_skew: HumanDuration::secs(0),
            start_wait: None,
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:9464".into(),
            token_file: None,
            allowed_origins: Vec::new(),
            allowed_hosts: Vec::new(),
            max_connections: 256,
            body_timeout: HumanDuration::secs(60),
            max_inflight_bytes: ByteSize(256 * MIB),
            max_concurrent_reads: 32,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { level: "info".into(), format: LogFormat::Text }
    }
}

pub(crate) const KIB: u64 = 1024;
pub(crate) const MIB: u64 = 1024 * KIB;
pub(crate) const GIB: u64 = 1024 * MIB;

/// One problem found while loading or validating, naming the key and the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    pub key: String,
    pub problem: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.problem)
    }
}

/// Every problem found, so an operator can fix them all in one pass.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub problems: Vec<ConfigProblem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self.problems.iter().map(|p| p.to_string()).collect();
        write!(f, "invalid configuration: {}", lines.join("; "))
    }
}

impl ConfigError {
    pub(crate) fn one(key: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError { problems: vec![ConfigProblem { key: key.into(), problem: problem.into() }] }
    }
}

impl Config {
    /// Load from an explicit path, else `CAPSTORE_CONFIG`, else defaults; then apply the process environment.
    pub fn load(path_opt: Option<&Path>) -> Result<Config, ConfigError> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        let path_opt: Option<PathBuf> =
            path_opt.map(Path::to_path_buf).or_else(|| std::env::var_os(CONFIG_PATH_ENV).map(PathBuf::from));
        let text = match &path_opt {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| ConfigError::one("--config", format!("cannot read {}: {e}", path.display())))?,
            None => String::new(),
        };
        Config::from_sources(&text, &env)
    }

    /// Build from TOML text and environment pairs (the testable core of [`Config::load`]); resolves `*_file` secrets.
    pub fn from_sources(toml_text: &str, env: &[(String, String)]) -> Result<Config, ConfigError> {
        let mut table: toml::Table = toml::from_str(toml_text)
            .map_err(|e| ConfigError::one("config file", e.message().to_string() + &span_hint(toml_text, e.span())))?;
        let mut problems = Vec::new();
        apply_env_overrides(&mut table, env, &mut problems);
        if !problems.is_empty() {
            return Err(ConfigError { problems });
        }
        let mut config: Config = Config::deserialize(toml::Value::Table(table))
            .map_err(|e| ConfigError::one("config", e.message().to_string()))?;
        config.resolve_secret_files(&mut problems);
        if !problems.is_empty() {
            return Err(ConfigError { problems });
        }
        Ok(config)
    }

    fn resolve_secret_files(&mut self, problems: &mut Vec<ConfigProblem>) {
        resolve_secret(&mut self.catalog.password, &self.catalog.password_file, "catalog.password", problems);
        resolve_secret(
            &mut self.bucket.secret_access_key,
            &self.bucket.secret_access_key_file,
            "bucket.secret_access_key",
            problems,
        );
        resolve_secret(
            &mut self.bucket.session_token,
            &self.bucket.session_token_file,
            "bucket.session_token",
            problems,
        );
    }

    /// `lease.start_wait`, or its default `ttl + publish_timeout + clock_skew`.
    pub fn start_wait(&self) -> Duration {
        match &self.lease.start_wait {
            Some(wait) => wait.0,
            None => self.lease.ttl.0 + self.lease.publish_timeout.0 + self.lease.clock_skew.0,
        }
    }

    /// The effective configuration as TOML, secrets redacted, `start_wait` resolved.
    pub fn to_redacted_toml(&self) -> String {
        let mut shown = self.clone();
        shown.lease.start_wait = Some(HumanDuration(self.start_wait()));
        shown.catalog.url = units::redact_url(&self.catalog.url);
        shown.catalog.replica_urls = self.catalog.replica_urls.iter().map(|url| units::redact_url(url)).collect();
        shown.bucket.url = units::redact_url(&self.bucket.url);
        shown.bucket.endpoint = self.bucket.endpoint.as_deref().map(units::redact_url);
        for (name, value) in shown.bucket.options.iter_mut() {
            if units::is_secret_option(name) {
                *value = "<redacted>".into();
            }
        }
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# cannot render configuration: {e}\n"))
    }
}

fn span_hint(text: &str, span_opt: Option<std::ops::Range<usize>>) -> String {
    match span_opt {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!(" (line {line})")
        }
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::env::KEYS;
    use super::*;

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_sources(text, &env)
    }

    fn problem_keys(error: ConfigError) -> Vec<String> {
        error.problems.into_iter().map(|p| p.key).collect()
    }

    #[test]
    fn defaults_are_valid() {
        let config = load("", &[]).unwrap();
        config.validate().unwrap();
        assert_eq!(config.start_wait(), Duration::from_secs(20));
    }

    #[test]
    fn the_example_config_loads_and_validates() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/capstore.toml")).unwrap();
        let config = load(&text, &[]).unwrap();
        config.validate().unwrap();
        assert_eq!(config.catalog_name, "edge-7");
    }

    #[test]
    fn sizes_and_durations_parse_in_human_form() {
        let config = load(
            "shutdown_grace = \"1m 30s\"\n[spool]\npack_max_bytes = \"8MiB\"\nmax_bytes = 1048576\npack_max_age = \"250ms\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(config.shutdown_grace.0, Duration::from_secs(90));
        assert_eq!(config.spool.pack_max_bytes.0, 8 * MIB);
        assert_eq!(config.spool.max_bytes.0, MIB);
        assert_eq!(config.spool.pack_max_age.0, Duration::from_millis(250));
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let error = load("[spool]\npack_max_byte = \"8MiB\"\n", &[]).unwrap_err();
        assert!(error.to_string().contains("pack_max_byte"), "{error}");
        let error = load("[spoool]\n", &[]).unwrap_err();
        assert!(error.to_string().contains("spoool"), "{error}");
    }

    #[test]
    fn a_bad_size_names_the_value() {
        let error = load("[spool]\npack_max_bytes = \"lots\"\n", &[]).unwrap_err();
        assert!(error.to_string().contains("lots"), "{error}");
    }

    #[test]
    fn environment_overrides_every_kind_of_key() {
        let config = load(
            "[catalog]\nurl = \"http://10.0.0.1:8123\"\n",
            &[
                ("CAPSTORE_CATALOG_URL", "http://127.0.0.1:18123"),
                ("CAPSTORE_CATALOG_NAME", "edge-9"),
                ("CAPSTORE_SPOOL_PACK_MAX_RECORDS", "42"),
                ("CAPSTORE_SPOOL_ALLOW_SHARED_FILESYSTEM", "true"),
                ("CAPSTORE_LEASE_TTL", "30s"),
                ("CAPSTORE_CONFIG", "ignored.toml"),
                ("OTHER_VAR", "x"),
            ],
        )
        .unwrap();
        assert_eq!(config.catalog.url, "http://127.0.0.1:18123");
        assert_eq!(config.catalog_name, "edge-9");
        assert_eq!(config.spool.pack_max_records, 42);
        assert!(config.spool.allow_shared_filesystem);
        assert_eq!(config.lease.ttl.0, Duration::from_secs(30));
    }

    #[test]
    fn unknown_or_malformed_environment_overrides_are_errors() {
        let error = load("", &[("CAPSTORE_SPOOL_DIRR", "/x"), ("CAPSTORE_UPLOAD_CONCURRENCY", "many")]).unwrap_err();
        assert_eq!(problem_keys(error), vec!["CAPSTORE_SPOOL_DIRR", "CAPSTORE_UPLOAD_CONCURRENCY"]);
    }

    #[test]
    fn every_key_has_an_environment_name_and_the_list_matches_the_structs() {
        let rendered: toml::Table = toml::from_str(&Config::default().to_redacted_toml()).unwrap();
        for (section, value) in &rendered {
            match value {
                toml::Value::Table(inner) => {
                    for key in inner.keys() {
                        assert!(
                            KEYS.iter().any(|(s, k, _)| s == section && k == key),
                            "{section}.{key} missing from KEYS"
                        );
                    }
                }
                _ => assert!(KEYS.iter().any(|(s, k, _)| s.is_empty() && k == section), "{section} missing"),
            }
        }
    }

    #[test]
    fn lease_rules_name_the_key_and_the_rule() {
        let config = load(
            "[lease]\nttl = \"5s\"\npublish_timeout = \"4500ms\"\nclock_skew = \"1s\"\n[catalog]\nrequest_timeout = \"5s\"\n",
            &[],
        )
        .unwrap();
        let error = config.validate().unwrap_err();
        let text = error.to_string();
        assert!(text.contains("lease.ttl") && text.contains("publish_timeout + lease.clock_skew + 0.1s"), "{text}");
        assert!(text.contains("lease.publish_timeout") && text.contains("whole number of seconds"), "{text}");
        assert!(text.contains("catalog.request_timeout") && text.contains("2 x lease.publish_timeout"), "{text}");
    }

    #[test]
    fn the_lease_rule_boundary_is_strict() {
        let ok = load("[lease]\nttl = \"3s\"\npublish_timeout = \"1s\"\nclock_skew = \"1899ms\"\n", &[]).unwrap();
        ok.validate().unwrap();
        let bad = load("[lease]\nttl = \"3s\"\npublish_timeout = \"1s\"\nclock_skew = \"1900ms\"\n", &[]).unwrap();
        assert_eq!(problem_keys(bad.validate().unwrap_err()), vec!["lease.ttl"]);
    }

    #[test]
    fn start_wait_defaults_to_ttl_plus_publish_timeout_plus_skew() {
        let config = load("[lease]\nttl = \"3s\"\npublish_timeout = \"1s\"\nclock_skew = \"500ms\"\n", &[]).unwrap();
        assert_eq!(config.start_wait(), Duration::from_millis(4500));
        let config = load("[lease]\nstart_wait = \"0s\"\n", &[]).unwrap();
        assert_eq!(config.start_wait(), Duration::ZERO);
    }

    #[test]
    fn replica_urls_need_a_cluster_and_distinct_http_urls() {
        let env = [("CAPSTORE_CATALOG_REPLICA_URLS", "http://b:8123, http://c:8123")];
        let config = load("[catalog]\nurl = \"http://a:8123\"\ncluster = \"main\"\n", &env).unwrap();
        assert_eq!(config.catalog.replica_urls, ["http://b:8123", "http://c:8123"]);
        config.validate().unwrap();
        for (toml, why) in [
            ("[catalog]\nreplica_urls = [\"http://b:8123\"]\n", "no cluster"),
            ("[catalog]\ncluster = \"main\"\nreplica_urls = [\"ftp://b\"]\n", "not http"),
            (
                "[catalog]\ncluster = \"main\"\nurl = \"http://a:8123\"\nreplica_urls = [\"http://a:8123/\"]\n",
                "url itself",
            ),
            ("[catalog]\ncluster = \"main\"\nreplica_urls = [\"http://b:8123\", \"http://b:8123\"]\n", "twice"),
        ] {
            let problems = load(toml, &[]).unwrap().validate().unwrap_err();
            assert!(problem_keys(problems).iter().any(|key| key == "catalog.replica_urls"), "{why}");
        }
    }

    #[test]
    fn async_insert_is_off_by_default_and_refused_with_a_cluster() {
        assert!(!load("", &[]).unwrap().catalog.async_insert);
        let config = load("", &[("CAPSTORE_CATALOG_ASYNC_INSERT", "true")]).unwrap();
        assert!(config.catalog.async_insert);
        config.validate().unwrap();
        let problems =
            load("[catalog]\nasync_insert = true\ncluster = \"main\"\n", &[]).unwrap().validate().unwrap_err();
        assert_eq!(problem_keys(problems), ["catalog.async_insert"]);
    }

    #[test]
    fn validate_reports_every_problem_at_once() {
        let config = load(
            "catalog_name = \"bad name\"\n[bucket]\nurl = \"ftp://x\"\n[upload]\nconcurrency = 0\n[http]\nlisten = \"nowhere\"\n",
            &[],
        )
        .unwrap();
        let keys = problem_keys(config.validate().unwrap_err());
        assert_eq!(keys, vec!["catalog_name", "bucket.url", "upload.concurrency", "http.listen"]);
    }

    #[test]
    fn retention_policies_match_in_order_and_bad_ones_name_their_index() {
        let text =
            "[[retention]]\nstreams = \"cam/*\"\nkeep = \"30d\"\n[[retention]]\nstreams = \"*\"\nkeep = \"90d\"\n";
        let config = load(text, &[("CAPSTORE_LIFECYCLE_RETENTION_INTERVAL", "5m")]).unwrap();
        config.validate().unwrap();
        assert_eq!(config.lifecycle.retention_interval.0, Duration::from_secs(300));
        let first =
            |stream: &str| config.retention.iter().position(|policy| policy.matcher().unwrap().is_match(stream));
        assert_eq!((first("cam/front/1"), first("mic/1")), (Some(0), Some(1)));
        let bad =
            load("[[retention]]\nstreams = \"[cam\"\nkeep = \"0s\"\n[lifecycle]\nretention_batch = 0\n", &[]).unwrap();
        let keys = problem_keys(bad.validate().unwrap_err());
        assert_eq!(keys, vec!["retention[0].streams", "retention[0].keep", "lifecycle.retention_batch"]);
        let unknown = load("[[retention]]\nstreams = \"*\"\nkeep = \"1d\"\nkept = \"2d\"\n", &[]).unwrap_err();
        assert!(unknown.problems[0].problem.contains("kept"), "{unknown:?}");
    }

    #[test]
    fn secrets_come_from_files_and_are_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let secret_path = dir.path().join("password");
        std::fs::write(&secret_path, "hunter2\n").unwrap();
        let text = format!("[catalog]\npassword_file = {:?}\n", secret_path.to_str().unwrap());
        let config = load(&text, &[("CAPSTORE_BUCKET_SECRET_ACCESS_KEY", "s3cr3t")]).unwrap();
        assert_eq!(config.catalog.password.as_ref().unwrap().expose(), "hunter2");
        assert_eq!(config.bucket.secret_access_key.as_ref().unwrap().expose(), "s3cr3t");
        let shown = format!("{}{:?}", config.to_redacted_toml(), config);
        assert!(!shown.contains("hunter2") && !shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }

    #[test]
    fn a_listen_address_beyond_loopback_needs_a_token_file_with_a_strong_token() {
        use std::os::unix::fs::PermissionsExt;
        for loopback in ["127.0.0.1:9464", "[::1]:9464"] {
            load("", &[("CAPSTORE_HTTP_LISTEN", loopback)]).unwrap().validate().unwrap();
        }
        let error = load("", &[("CAPSTORE_HTTP_LISTEN", "0.0.0.0:9464")]).unwrap().validate().unwrap_err();
        assert!(error.to_string().contains("http.token_file"), "{error}");
        assert_eq!(problem_keys(error), vec!["http.listen"]);

        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        let with_token = |text: &str, mode: u32| {
            std::fs::write(&token, text).unwrap();
            std::fs::set_permissions(&token, std::fs::Permissions::from_mode(mode)).unwrap();
            let env = [("CAPSTORE_HTTP_LISTEN", "0.0.0.0:9464"), ("CAPSTORE_HTTP_TOKEN_FILE", token.to_str().unwrap())];
            load("", &env).unwrap().validate()
        };
        with_token("0123456789abcdef-long-enough\n", 0o600).unwrap();
        let short = with_token("short", 0o600).unwrap_err();
        assert!(short.to_string().contains("at least 16"), "{short}");
        let world_readable = with_token("0123456789abcdef-long-enough", 0o644).unwrap_err();
        assert!(world_readable.to_string().contains("readable by every user"), "{world_readable}");
        assert_eq!(problem_keys(world_readable), vec!["http.token_file"]);
    }

    #[test]
    fn secret_options_and_url_passwords_are_redacted_when_printed() {
        let config = load(
            "[catalog]\nurl = \"https://capstore:pa55word@ch.example:8443/\"\n[bucket]\nurl = \"gs://b\"\n\
             endpoint = \"http://minio:miniosecret@10.0.0.9:9000\"\n\
             [bucket.options]\ngoogle_service_account_key = \"{private json}\"\naws_access_key_id = \"AKIAPUBLIC\"\n\
             azure_storage_sas_token = \"sv=2020&sig=abc\"\n",
            &[],
        )
        .unwrap();
        let shown = config.to_redacted_toml();
        for secret in ["pa55word", "miniosecret", "private json", "sig=abc"] {
            assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
        }
        assert!(
            shown.contains("https://capstore:<redacted>@ch.example:8443/") && shown.contains("AKIAPUBLIC"),
            "{shown}"
        );
        assert_eq!(units::redact_url("http://127.0.0.1:8123"), "http://127.0.0.1:8123");
        assert_eq!(units::redact_url("s3://bucket/path"), "s3://bucket/path");
    }

    #[test]
    fn a_secret_and_its_file_together_are_an_error() {
        let error = load("[catalog]\npassword = \"a\"\npassword_file = \"/nonexistent\"\n", &[]).unwrap_err();
        assert_eq!(problem_keys(error), vec!["catalog.password_file"]);
    }

    #[test]
    fn the_rendered_config_reads_back_to_the_same_values() {
        let config = load("[spool]\npack_max_bytes = \"3MiB\"\n[lease]\nclock_skew = \"1500ms\"\n", &[]).unwrap();
        let again = load(&config.to_redacted_toml(), &[]).unwrap();
        assert_eq!(again.spool.pack_max_bytes, config.spool.pack_max_bytes);
        assert_eq!(again.lease.clock_skew, config.lease.clock_skew);
        assert_eq!(again.start_wait(), config.start_wait());
    }
}
