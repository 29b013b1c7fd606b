//! The one way capstore talks to ClickHouse: a thin layer over the `clickhouse` crate that adds a timeout to every
//! request, old-server settings chosen from the detected version, and one classification of every failure.
//!
//! # Outcomes
//!
//! Every failed request becomes a [`CatalogError`] whose [`ErrorKind`] says what the caller may assume:
//!
//! - [`ErrorKind::DefinitelyFailed`]: the statement did nothing. The connection could not be made (refused, DNS, TLS
//!   handshake, connect timeout), or the server rejected the statement before executing it (parse, analysis,
//!   authentication and existence errors: see [`DEFINITELY_FAILED_CODES`]). Safe to retry blindly.
//! - [`ErrorKind::OutcomeUnknown`]: the statement may have run, wholly or in part. The request timed out, the
//!   connection broke after the request was sent, the server failed during execution (`Code: 159` timeout, memory,
//!   a bad block mid-INSERT, ...), or the failure is not one we recognise. An INSERT whose reply was lost can still
//!   commit, so the caller must read back before it decides anything.
//! - [`ErrorKind::LeaseLost`]: reserved for the lease layer (the fence refused a publishing statement). This module
//!   never produces it.
//!
//! [`classify`] is the only place that decides between them. [`CatalogError::is_data_rejection`] is the one place that
//! decides whether the server blamed the rows themselves (the indexer isolates such a pack instead of retrying it).
//!
//! # Server versions
//!
//! [`CatalogClient::connect`] reads the server's version (and which optional settings it has) and picks settings
//! from the answer. Servers older than [`MODERN_MAJOR`] (the tests run 18.16, 26.7 and 26.9; production runs 23-26)
//! get:
//! - no HTTP compression: `compress=1` returns an empty 200 reply on 18.16;
//! - no `RowBinaryWithNamesAndTypes` schema validation: the format does not exist there, so rows travel as plain
//!   `RowBinary` and a struct that does not match its table shows up as a decode error, not a schema message;
//! - one extra second of clock uncertainty ([`CatalogClient::clock_resolution_extra`]): `now()` has whole-second
//!   resolution and there is no `now64()`.
//!
//! # Asynchronous inserts
//!
//! Where the server has `async_insert` (21.11 on), every request says whether its inserts are asynchronous, so a
//! server profile that turns them on (26.x chDB does by default) changes nothing capstore relies on: by default they
//! are synchronous (`async_insert = 0`). With `catalog.async_insert` (refused with `catalog.cluster`) rows go with
//! `async_insert = 1, wait_for_async_insert = 1`: the server gathers the inserts of many clients into one part per
//! table, so a fleet sharing the tables makes parts at the server's flush rate instead of its publish rate, at the
//! cost of up to the flush delay per insert. The wait is what keeps the publish protocol sound: an insert is
//! acknowledged only once its rows are in a part every later read sees, so a publish's rows exist before the fenced
//! `publishes` row that makes them visible, and a lost reply leaves rows under a publish_id that is never committed,
//! as a plain insert does. Statements with a fence (`INSERT ... SELECT`) are never asynchronous. Quorum inserts
//! (`catalog.cluster`) are sequential (`insert_quorum_parallel = 0`), which servers do not combine with asynchronous
//! inserts. See [`insert_settings`].
//!
//! # Replicated catalogs
//!
//! With `catalog.cluster`, [`CatalogClient::connect`] counts the replicas of the connected server's shard in
//! `system.clusters` and sends every statement with `insert_quorum` = a majority of them (and `insert_quorum_timeout`
//! = the request timeout, `insert_quorum_parallel = 0` where the setting exists), and every deciding statement and
//! deciding read ([`CatalogClient::execute_deciding`], [`CatalogClient::fetch_all_deciding`]) with
//! `select_sequential_consistency = 1`. Why the fence stays sound: every lease row and every publish is acknowledged
//! only once a majority holds it, and a sequentially consistent read sees every acknowledged insert (a replica that
//! lacks one refuses the read), so the head a claim, a read-back or a fence reads is the head a single server would
//! show. An insert whose quorum timed out is an unknown outcome as on a single server; it may still be completed later
//! (when a replica fetches its part), and until then the server refuses every other quorum insert into that table,
//! so nothing is decided beside it. Ordinary reads are not sequentially consistent: a replica that lags answers a
//! listing without the newest publishes.
//!
//! # Failover
//!
//! `catalog.replica_urls` names the other replicas of `catalog.url`'s shard. Every request goes to the current
//! server; one that cannot be connected to has run nothing, so the request goes to the next server at once. A
//! request whose reply was lost is not sent again (its outcome is unknown and the caller's rule for that applies:
//! the publisher reads a publish back, sequentially consistent, before anything else is published, and the lease is
//! quarantined), but the next request goes to the next server, so a server that stalls is left as well. Switching
//! keeps the fence sound because the argument above holds for every replica alike: no decision depends on which one
//! answers. See [`Endpoints`].
//!
//! # Statements and databases
//!
//! The database is never set on the underlying client: every statement names its tables as `database.table`. That
//! way the same client runs the `CREATE DATABASE` that makes the catalog's database and everything after it, and
//! no request depends on a database that may not exist yet. [`CatalogClient::database`] gives the configured name.
//!
//! Every request carries `wait_end_of_query=1`, so an error raised while a result is streaming comes back as an
//! HTTP error instead of a 200 reply with `Code: N` appended to the body (which 18.16 otherwise does).
//!
//! Values go into SQL through [`sql_string_literal`] (server-side `{name:Type}` parameters do not exist on 18.16).
//! Every statement is sent verbatim: a `?` in it is a question mark, not a placeholder.
//!
//! # Labels
//!
//! 18.16 has no `Map` type, and it silently flattens an `Array(Tuple(String, String))` column named `labels` into two
//! columns `labels.1` and `labels.2` (`DESCRIBE` shows them; an INSERT naming `labels` fails with `Code: 16`). So
//! capture labels are stored as two parallel columns, `label_keys Array(String)` and `label_values Array(String)`
//! (same length, pair i is `label_keys[i] = label_values[i]`), carried as two `Vec<String>` fields in a row struct.
//! That layout means the same on every server version; the live tests round-trip it on 18.16. Keys are kept in the
//! order written (the capture layer sorts labels by key, so equal label sets have equal encodings); readers zip the
//! two vectors back into a map client-side.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clickhouse::{Compression, RowOwned, RowRead, RowWrite};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;

use super::read_limits::{ReadLimits, LIMIT_SETTINGS};
use crate::config::units::redact_url;
use crate::config::CatalogConfig;

/// Servers at or above this major version get compression and schema validation.
pub const MODERN_MAJOR: u32 = 23;

/// ClickHouse error codes raised before a statement starts executing: the statement did nothing.
///
/// Parse, analysis, name resolution, authentication, access and "already exists" errors, plus the concurrency limit
/// checked when a query is registered. Codes that can be raised while data is being written (data parse errors
/// inside a multi-block INSERT, memory and size limits, too many parts, quorum and replica errors, timeouts) are
/// deliberately absent: earlier blocks of the same INSERT may already have committed.
pub const DEFINITELY_FAILED_CODES: &[(u32, &str)] = &[
    (1, "UNSUPPORTED_METHOD"),
    (2, "UNSUPPORTED_PARAMETER"),
    (8, "THERE_IS_NO_COLUMN"),
    (10, "NOT_FOUND_COLUMN_IN_BLOCK"),
    (16, "NO_SUCH_COLUMN_IN_TABLE"),
    (34, "TOO_MANY_ARGUMENTS_FOR_FUNCTION"),
    (35, "TOO_FEW_ARGUMENTS_FOR_FUNCTION"),
    (42, "NUMBER_OF_ARGUMENTS_DOESNT_MATCH"),
    (43, "ILLEGAL_TYPE_OF_ARGUMENT"),
    (46, "UNKNOWN_FUNCTION"),
    (47, "UNKNOWN_IDENTIFIER"),
    (48, "NOT_IMPLEMENTED"),
    (50, "UNKNOWN_TYPE"),
    (51, "EMPTY_LIST_OF_COLUMNS_QUERIED"),
    (52, "COLUMN_QUERIED_MORE_THAN_ONCE"),
    (53, "TYPE_MISMATCH"),
    (57, "TABLE_ALREADY_EXISTS"),
    (60, "UNKNOWN_TABLE"),
    (62, "SYNTAX_ERROR"),
    (63, "UNKNOWN_AGGREGATE_FUNCTION"),
    (73, "UNKNOWN_FORMAT"),
    (80, "INCORRECT_QUERY"),
    (81, "UNKNOWN_DATABASE"),
    (82, "DATABASE_ALREADY_EXISTS"),
    (115, "UNKNOWN_SETTING"),
    (164, "READONLY"),
    (179, "MULTIPLE_EXPRESSIONS_FOR_ALIAS"),
    (184, "ILLEGAL_AGGREGATION"),
    (192, "UNKNOWN_USER"),
    (193, "WRONG_PASSWORD"),
    (194, "REQUIRED_PASSWORD"),
    (195, "IP_ADDRESS_NOT_ALLOWED"),
    (202, "TOO_MANY_SIMULTANEOUS_QUERIES"),
    (215, "NOT_AN_AGGREGATE"),
    (352, "AMBIGUOUS_COLUMN_NAME"),
    (386, "NO_COMMON_TYPE"),
    (452, "SETTING_CONSTRAINT_VIOLATION"),
    (497, "ACCESS_DENIED"),
    (516, "AUTHENTICATION_FAILED"),
];

/// ClickHouse error codes that blame the data sent rather than the server, the schema or the connection: parse and
/// conversion failures, out-of-range values, oversized strings and arrays.
pub const BAD_DATA_CODES: &[u32] = &[6, 26, 27, 33, 38, 41, 53, 69, 70, 72, 117, 128, 131];

/// What a caller may assume about a failed statement. See the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Nothing happened: retry freely.
    DefinitelyFailed,
    /// The statement may have run, wholly or in part: read back before deciding.
    OutcomeUnknown,
    /// The lease fence refused the statement (produced by the lease layer only).
    LeaseLost,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::DefinitelyFailed => "definitely failed",
            ErrorKind::OutcomeUnknown => "outcome unknown",
            ErrorKind::LeaseLost => "lease lost",
        })
    }
}

/// A failed catalog request. `message` never contains the password.
#[derive(Debug, thiserror::Error)]
#[error("catalog {kind}: {message}")]
pub struct CatalogError {
    pub kind: ErrorKind,
    pub message: String,
    /// The ClickHouse error code, when the server sent one.
    pub server_code: Option<u32>,
    #[source]
    pub source: Option<clickhouse::error::Error>,
}

impl CatalogError {
    /// An error with a kind decided by the caller (the lease layer's `LeaseLost`, or a local precondition).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        CatalogError { kind, message: message.into(), server_code: None, source: None }
    }

    /// The server refused the rows themselves ([`BAD_DATA_CODES`]), which points at the data sent, not at the
    /// connection, the schema or the lease. Such errors reach the indexer only from descriptor inserts, whose partial
    /// landing is harmless (the rows stay invisible orphans), so the outcome kind does not matter there.
    pub fn is_data_rejection(&self) -> bool {
        self.server_code.is_some_and(|code| BAD_DATA_CODES.contains(&code))
    }

    /// The table a statement names does not exist, nor perhaps its database (ClickHouse's UNKNOWN_TABLE and
    /// UNKNOWN_DATABASE): tables of an older capstore lack the newer ones, which read-only tools read as empty.
    pub fn is_unknown_table(&self) -> bool {
        matches!(self.server_code, Some(60 | 81))
    }

    /// A constraint of the user's settings profile refused a setting the request carried, by name
    /// (SETTING_CONSTRAINT_VIOLATION, raised before the statement runs). (A read-only profile refuses every setting,
    /// with READONLY: that is not one setting's matter.)
    pub fn refuses_setting(&self, name: &str) -> bool {
        self.server_code == Some(SETTING_CONSTRAINT_VIOLATION) && self.message.contains(name)
    }

    /// The server refused the statement for the user's rights (ACCESS_DENIED).
    pub fn is_access_denied(&self) -> bool {
        self.server_code == Some(497)
    }

    /// The server could not be connected to: nothing was sent (another replica may be tried at once).
    pub fn is_unreachable(&self) -> bool {
        self.source.as_ref().is_some_and(is_connect_failure)
    }

    /// The server refused the connection: nothing listens there, so nothing sent to it before still runs (a server
    /// stopped or restarted since). A connect timeout is not this: the server may be alive beyond a cut network.
    pub fn is_refused(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = self.source.as_ref().map(|error| error as _);
        while let Some(error) = cause {
            if error
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
            {
                return true;
            }
            cause = error.source();
        }
        false
    }

    /// The request was sent and its reply did not come back (a broken connection or no reply in time): the
    /// statement may have run.
    pub fn reply_lost(&self) -> bool {
        use clickhouse::error::Error;
        match &self.source {
            Some(Error::TimedOut) => true,
            Some(network @ Error::Network(_)) => !is_connect_failure(network),
            _ => false,
        }
    }

    fn from_client(context: &str, error: clickhouse::error::Error) -> Self {
        CatalogError {
            kind: classify(&error),
            message: format!("{context}: {error}"),
            server_code: server_error_code(&error),
            source: Some(error),
        }
    }
}

/// Why [`CatalogClient::execute_to_its_end`] failed: the statement's error, and whether it may still run on the
/// server (whether it does could not be told).
#[derive(Debug, thiserror::Error)]
#[error("{error}{}", if *.may_still_run { " (it may still run on the server)" } else { "" })]
pub struct UnendedError {
    #[source]
    pub error: CatalogError,
    pub may_still_run: bool,
}

/// Decide what a failed request means. The one place capstore classifies ClickHouse failures.
///
/// A request timeout is passed in as `clickhouse::error::Error::TimedOut`.
pub fn classify(error: &clickhouse::error::Error) -> ErrorKind {
    use clickhouse::error::Error;
    match error {
        // Raised while building the request, before anything is sent.
        Error::InvalidParams(_) | Error::Unsupported(_) => ErrorKind::DefinitelyFailed,
        network @ Error::Network(_) if is_connect_failure(network) => ErrorKind::DefinitelyFailed,
        Error::Network(_) => ErrorKind::OutcomeUnknown,
        Error::BadResponse(text) => match parse_error_code(text) {
            Some(code) if is_definitely_failed_code(code) => ErrorKind::DefinitelyFailed,
            _ => ErrorKind::OutcomeUnknown,
        },
        _ => ErrorKind::OutcomeUnknown,
    }
}

/// A connection that could not be made (refused, DNS, TLS handshake, connect timeout): nothing was sent.
fn is_connect_failure(error: &clickhouse::error::Error) -> bool {
    match error {
        clickhouse::error::Error::Network(source) => source
            .downcast_ref::<hyper_util::client::legacy::Error>()
            .is_some_and(|hyper_error| hyper_error.is_connect()),
        _ => false,
    }
}

/// Whether a ClickHouse error code means "rejected before execution".
pub fn is_definitely_failed_code(code: u32) -> bool {
    DEFINITELY_FAILED_CODES.iter().any(|(listed, _)| *listed == code)
}

/// The `N` of a server error text that starts with `Code: N` (18.16: `Code: 62, e.displayText() = ...`; current
/// servers: `Code: 62. DB::Exception: ...`; an empty error body with an exception header: `Code: 62`).
pub fn parse_error_code(text: &str) -> Option<u32> {
    let rest = text.trim_start().strip_prefix("Code:")?.trim_start();
    let digits_end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..digits_end].parse().ok()
}

fn server_error_code(error: &clickhouse::error::Error) -> Option<u32> {
    match error {
        clickhouse::error::Error::BadResponse(text) => parse_error_code(text),
        _ => None,
    }
}

/// The 16 bytes `UUIDStringToNum(text)` makes of a capture or publish id (how `by_id` keeps ids), written as a
/// string literal when `text` is a UUID: 18.16 builds an `IN` list of literals as one constant set, where it
/// evaluates a function call per element (a page's 100 ids: 6.7 -> 4.7 ms at 10M captures). Other text (never
/// written by capstore) is left to the function.
pub fn sql_uuid_num(text: &str) -> String {
    use std::fmt::Write;
    let Ok(id) = uuid::Uuid::parse_str(text) else { return format!("UUIDStringToNum({})", sql_string_literal(text)) };
    let mut literal = String::with_capacity(2 + 4 * 16);
    literal.push('\'');
    for byte in id.as_bytes() {
        let _ = write!(literal, "\\x{byte:02x}");
    }
    literal.push('\'');
    literal
}

/// Quote `value` as a ClickHouse string literal: `'...'` with backslash escapes, safe for any bytes of UTF-8.
pub fn sql_string_literal(value: &str) -> String {
    let mut quoted = String::with_capacity(value.len() + 2);
    quoted.push('\'');
    for character in value.chars() {
        match character {
            '\\' => quoted.push_str("\\\\"),
            '\'' => quoted.push_str("\\'"),
            '\0' => quoted.push_str("\\0"),
            '\n' => quoted.push_str("\\n"),
            '\r' => quoted.push_str("\\r"),
            '\t' => quoted.push_str("\\t"),
            other => quoted.push(other),
        }
    }
    quoted.push('\'');
    quoted
}

/// The server's `version()`: `18.16.1`, `24.3.2.23`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
    /// The fourth component of current versions; absent on 18.x.
    pub build: Option<u32>,
    /// The text as the server sent it.
    pub text: String,
}

impl ServerVersion {
    pub fn parse(text: &str) -> Option<ServerVersion> {
        let trimmed = text.trim();
        let mut parts = trimmed.split('.');
        let mut next_number = || -> Option<Option<u32>> {
            match parts.next() {
                None => Some(None),
                Some(part) => part.parse().ok().map(Some),
            }
        };
        let major = next_number()??;
        let minor = next_number()??;
        let patch = next_number()?.unwrap_or(0);
        let build = next_number()?;
        Some(ServerVersion { major, minor, patch, build, text: trimmed.to_string() })
    }

    /// Compression and `RowBinaryWithNamesAndTypes` validation are used from this version on.
    pub fn is_modern(&self) -> bool {
        self.major >= MODERN_MAJOR
    }

    /// Projections on a ReplacingMergeTree that survive its merges: `deduplicate_merge_projection_mode = 'rebuild'`
    /// (24.8 on; earlier servers either refuse such a projection or keep rows a merge removed in it).
    pub fn has_replacing_projections(&self) -> bool {
        (self.major, self.minor) >= (24, 8)
    }

    /// No time-order projection ([`ServerVersion::has_replacing_projections`]): the catalog keeps a time-ordered
    /// table instead (`by_time`, see `schema::ensure_time_table`).
    pub fn keeps_time_table(&self) -> bool {
        !self.has_replacing_projections()
    }

    /// Data skipping indexes, `bloom_filter` among them, `MATERIALIZE INDEX` and per-table compression block
    /// settings: taken from 21 on (18.16 has none of them; the tests run 26.x).
    pub fn has_skip_indexes(&self) -> bool {
        self.major >= 21
    }

    /// `now()` is the only server clock before 20.1 (`now64` arrived there): whole seconds.
    pub fn has_subsecond_clock(&self) -> bool {
        self.major >= 20
    }
}

impl fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A connected catalog client. Cheap to clone (the HTTP pools and the failover state are shared).
#[derive(Clone)]
pub struct CatalogClient {
    endpoints: Arc<Endpoints>,
    database: String,
    request_timeout: Duration,
    read_max_memory: u64,
    server_version: Arc<ServerVersion>,
    /// With `catalog.cluster`: the replicas (of the connected server's shard) every insert waits for.
    insert_quorum: Option<u64>,
    /// Whether the user's settings profile refused [`one_thread`] (a constraint on `max_threads`): reads of a few
    /// granules run with the profile's `max_threads` from then on (shared by the clones).
    one_thread_refused: Arc<AtomicBool>,
    /// What the user's settings profile lets a read set its time and memory limits to (shared by the clones).
    read_limits: ReadLimits,
    /// Every read sequentially consistent on a replicated catalog ([`CatalogClient::with_consistent_reads`]).
    consistent_reads: bool,
}

impl fmt::Debug for CatalogClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CatalogClient")
            .field("url", &self.endpoints.servers[self.endpoints.current()].shown_url)
            .field("database", &self.database)
            .field("request_timeout", &self.request_timeout)
            .field("server_version", &self.server_version.text)
            .finish_non_exhaustive()
    }
}

/// Errors of a replica that cannot serve what others can: behind the quorum (`REPLICA_IS_NOT_IN_QUORUM`, a
/// sequentially consistent read) or read-only (`TABLE_IS_READ_ONLY`, its ZooKeeper session lost). The next request
/// goes to the next server.
const REPLICA_CANNOT_SERVE: &[u32] = &[289, 242];

/// ClickHouse's error code for a query over its `max_memory_usage`.
const MEMORY_LIMIT_EXCEEDED: u32 = 241;

/// ClickHouse's error codes for a setting the user's profile does not let a request change: a read-only profile,
/// and a constraint.
const READONLY: u32 = 164;
const SETTING_CONSTRAINT_VIOLATION: u32 = 452;

/// What an error about a setting a read sends says to the operator.
const READ_SETTINGS_HINT: &str = "every read sets max_execution_time, timeout_overflow_mode and max_memory_usage \
     (catalog.request_timeout, catalog.read_max_memory), on 20.x and later readonly = 2 and \
     cancel_http_readonly_queries_on_client_close, and with catalog.cluster select_sequential_consistency: the catalog \
     user's settings profile must let a request change them";

/// What an error about a setting a lease claim or a publish sends says to the operator.
const DECIDING_SETTINGS_HINT: &str = "lease claims and publishes set max_execution_time to lease.publish_timeout and \
     timeout_overflow_mode, and with catalog.cluster select_sequential_consistency: the fence's timing rests on them, \
     so the catalog user's settings profile must let a request set them as configured";

/// The setting of a read of a few granules ([`CatalogClient::fetch_few`], [`CatalogClient::fetch_few_deciding`]):
/// one server thread. On 18.16 such reads took less time so (two cores, at 1M captures: the watermark 3.1 -> 2.2 ms, a
/// lookup by id 14.8 -> 12.1, a page's setup statement replayed 300 times 8.4 -> 6.8); 26.9 took the same time
/// either way.
fn one_thread() -> (&'static str, String) {
    ("max_threads", "1".to_string())
}

/// How long the pool keeps an idle connection: below the 3 s keep-alive of older servers, so the client never sends
/// a request on a connection the server is about to close.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often [`CatalogClient::execute_to_its_end`] asks whether a statement whose outcome is unknown still runs.
const STILL_RUNNING_POLL: Duration = Duration::from_millis(200);
/// How often it says that it is still waiting.
const STILL_RUNNING_WARN_EVERY: Duration = Duration::from_secs(30);

impl CatalogClient {
    /// Build the client, detect the server version and choose settings for it.
    ///
    /// Fails with `DefinitelyFailed` when the server cannot be reached or refuses the credentials, and with
    /// `OutcomeUnknown` when `SELECT version()` times out (harmless either way: it changes nothing).
    pub async fn connect(config: &CatalogConfig) -> Result<CatalogClient, CatalogError> {
        let request_timeout = config.request_timeout.0;
        if request_timeout.is_zero() {
            return Err(CatalogError::new(
                ErrorKind::DefinitelyFailed,
                "catalog.request_timeout must be more than zero",
            ));
        }
        let urls: Vec<&String> = std::iter::once(&config.url).chain(&config.replica_urls).collect();
        let mut clients = Vec::with_capacity(urls.len());
        for url in &urls {
            let mut client = build_http_client(url, config.ca_file.as_deref(), request_timeout)?
                .with_url(url.trim_end_matches('/'))
                .with_user(config.user.clone())
                .with_product_info("capstore", env!("CARGO_PKG_VERSION"))
                .with_compression(Compression::None)
                .with_validation(false)
                .with_setting("wait_end_of_query", "1");
            if let Some(password) = &config.password {
                client = client.with_password(password.expose());
            }
            clients.push(client);
        }

        // The first server that answers decides the settings: the replicas of a shard run one release. Its version
        // and which of the settings below it has come in one statement (a round trip every command waits for).
        let sql = format!(
            // A row beside the settings found, so that the version comes back when none is (an aggregate would
            // give no row at all under a profile's `empty_result_for_aggregation_by_empty_set`).
            "SELECT version() AS version, name FROM (SELECT name FROM system.settings WHERE name IN ({}) \
             UNION ALL SELECT '' AS name)",
            OPTIONAL_SETTINGS.iter().map(|name| sql_string_literal(name)).collect::<Vec<_>>().join(", ")
        );
        let mut answered = None;
        for (index, client) in clients.iter().enumerate() {
            let version = run_with_timeout(
                request_timeout,
                "read the server's version",
                client.query_raw(&sql).fetch_all::<ServerFact>(),
            )
            .await;
            match version {
                Ok(found) => {
                    answered = Some((index, found));
                    break;
                }
                Err(error) if error.is_unreachable() && index + 1 < clients.len() => {
                    tracing::warn!(url = %redact_url(urls[index]), %error, "catalog server unreachable, trying the next replica");
                }
                Err(error) => return Err(error),
            }
        }
        let Some((current, facts)) = answered else {
            unreachable!("the last server's error is returned above");
        };
        let version_text = facts.first().map(|fact| fact.version.clone()).unwrap_or_default();
        let server_version = ServerVersion::parse(&version_text).ok_or_else(|| {
            CatalogError::new(ErrorKind::DefinitelyFailed, format!("cannot parse the server version {version_text:?}"))
        })?;
        // Settings for every server, chosen from the one that answered.
        let present: std::collections::HashSet<String> =
            facts.into_iter().map(|fact| fact.name).filter(|name| !name.is_empty()).collect();
        let mut settings: Vec<(&'static str, String)> = Vec::new();
        // A publish's rows span as many months (partitions) as its captures' times do, which producers choose (a
        // backfill, a bad clock): a server's limit (100 by default where it has one) would refuse that pack on
        // every attempt, and with it every upload after it.
        if present.contains("max_partitions_per_insert_block") {
            settings.push(("max_partitions_per_insert_block", "0".to_string()));
        }
        let (insert_quorum, shard) = match &config.cluster {
            Some(cluster) => {
                let shard = local_shard(&clients[current], cluster, request_timeout).await?.ok_or_else(|| {
                    CatalogError::new(
                        ErrorKind::DefinitelyFailed,
                        format!(
                            "catalog.cluster: the server at {} is not a replica of a cluster named {cluster:?} (see \
                             system.clusters and remote_servers in its configuration)",
                            redact_url(urls[current])
                        ),
                    )
                })?;
                let quorum = shard.replicas.len() as u64 / 2 + 1;
                let wait_ms = u64::try_from(request_timeout.as_millis()).unwrap_or(u64::MAX);
                // One quorum insert at a time per table (the only way before 20.10): an insert whose quorum timed
                // out can still be completed later, when a replica fetches its part, and until then every later
                // quorum insert into that table is refused, so no publish can be decided beside it.
                settings.push(("insert_quorum", quorum.to_string()));
                settings.push(("insert_quorum_timeout", wait_ms.to_string()));
                if present.contains("insert_quorum_parallel") {
                    settings.push(("insert_quorum_parallel", "0".to_string()));
                }
                (Some(quorum), Some((cluster.clone(), shard)))
            }
            None => (None, None),
        };
        let has_async_insert = present.contains("async_insert") && present.contains("wait_for_async_insert");
        let insert_settings = insert_settings(has_async_insert, config.async_insert, insert_quorum.is_some());
        let async_insert = insert_settings.contains(&("async_insert", "1"));
        settings.extend(insert_settings.into_iter().map(|(name, value)| (name, value.to_string())));
        let servers: Vec<Endpoint> = clients
            .into_iter()
            .zip(&urls)
            .enumerate()
            .map(|(index, (mut client, url))| {
                if server_version.is_modern() {
                    client = client.with_compression(Compression::Lz4).with_validation(true);
                }
                for (name, value) in &settings {
                    client = client.with_setting(*name, value.clone());
                }
                Endpoint {
                    client,
                    shown_url: redact_url(url),
                    // The server that answered was checked above.
                    checked: tokio::sync::OnceCell::new_with((index == current).then_some(true)),
                    check_failed_at: std::sync::Mutex::new(None),
                }
            })
            .collect();
        tracing::info!(url = %servers[current].shown_url, server_version = %server_version, ?insert_quorum, async_insert, replicas = servers.len(), "catalog connected");
        Ok(CatalogClient {
            endpoints: Arc::new(Endpoints {
                servers,
                current: AtomicUsize::new(current),
                shard,
                required_objects: std::sync::OnceLock::new(),
                request_timeout,
            }),
            database: config.database.clone(),
            request_timeout,
            read_max_memory: config.read_max_memory.0,
            server_version: Arc::new(server_version),
            insert_quorum,
            one_thread_refused: Arc::default(),
            consistent_reads: false,
            read_limits: ReadLimits::default(),
        })
    }

    pub fn server_version(&self) -> &ServerVersion {
        &self.server_version
    }

    /// Extra uncertainty of server timestamps to add to the configured clock skew: 1 s where the server clock has
    /// whole-second resolution (18.x and anything before 20.1), else zero.
    pub fn clock_resolution_extra(&self) -> Duration {
        if self.server_version.has_subsecond_clock() {
            Duration::ZERO
        } else {
            Duration::from_secs(1)
        }
    }

    /// The configured catalog database (not set on requests; statements name `database.table`).
    pub fn database(&self) -> &str {
        &self.database
    }

    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Run DDL or a statement whose outcome decides nothing. `sql` is sent verbatim.
    pub async fn execute(&self, sql: &str) -> Result<(), CatalogError> {
        self.execute_with(sql, &[], self.request_timeout).await
    }

    /// [`CatalogClient::execute`] for a statement that no fence guards and that nothing may run beside once the
    /// caller goes on (a month's `DROP PARTITION`, see [`super::purge`]). Where its outcome is unknown (a timeout while
    /// it waits on a table lock or for merges to stop, a broken connection, a proxy's error) it may still run on the
    /// server, so this waits, from a moment after (the server may not have taken it in yet), until the server it was
    /// sent to no longer runs it (its query_id, see [`CatalogClient::wait_until_none_runs`]), and returns the error
    /// then. No server bounds a partition's `ALTER` (18.16 waits on a table lock for good, 26.x for running merges
    /// to stop), so while the server shows it running this waits, and says so every 30 s. Once the server has not
    /// been able to say for `tell_within`, it gives up, and says the statement may still run.
    pub async fn execute_to_its_end(&self, sql: &str, tell_within: Duration) -> Result<(), UnendedError> {
        let query_id = uuid::Uuid::new_v4().to_string();
        let sent = self
            .request_naming_server("execute", self.request_timeout, |client| {
                client.query_raw(sql).with_setting("query_id", query_id.clone()).execute()
            })
            .await;
        let (error, index) = match sent {
            Ok(()) => return Ok(()),
            Err((error, Some(index))) if error.kind == ErrorKind::OutcomeUnknown => (error, index),
            Err((error, _)) => return Err(UnendedError { error, may_still_run: false }),
        };
        let url = &self.endpoints.servers[index].shown_url;
        tracing::warn!(%url, query_id, %error, "catalog: waiting for a statement whose outcome is unknown to end on the server");
        tokio::time::sleep(STILL_RUNNING_POLL).await;
        let condition = format!("query_id = {}", sql_string_literal(&query_id));
        let ended = self.wait_on(&[index], &condition, tell_within).await;
        Err(UnendedError { error, may_still_run: !ended })
    }

    /// Wait until no server of the catalog (`catalog.url` and `catalog.replica_urls`) runs a statement that
    /// `processes_where` (a condition on `system.processes`) finds: none there, or the server refuses connections (a
    /// server that is down runs nothing). Asks at once, then each [`STILL_RUNNING_POLL`]. False once the servers have
    /// not been able to say for `tell_within` (stalled or cut off, or the user may not read `system.processes`);
    /// with zero, as soon as one cannot say while none shows one running.
    ///
    /// What it cannot see: a request held up on its way before a server took it in, and a server other than those
    /// named. Each URL must name one server, not a load balancer.
    pub async fn wait_until_none_runs(&self, processes_where: &str, tell_within: Duration) -> bool {
        let every_server: Vec<usize> = (0..self.endpoints.servers.len()).collect();
        self.wait_on(&every_server, processes_where, tell_within).await
    }

    async fn wait_on(&self, servers: &[usize], processes_where: &str, tell_within: Duration) -> bool {
        let running = format!("SELECT count() FROM system.processes WHERE {processes_where}");
        let mut told_at = Instant::now();
        let mut warned_at = Instant::now();
        loop {
            let mut still_running = false;
            let mut cannot_tell = None;
            for &index in servers {
                let server = &self.endpoints.servers[index];
                let asked = run_with_timeout(
                    self.request_timeout,
                    "ask whether a statement still runs",
                    server.client.query_raw(&running).fetch_one::<u64>(),
                )
                .await;
                match asked {
                    Ok(0) => {}
                    Err(asking) if asking.is_refused() => {}
                    Ok(_) => still_running = true,
                    Err(asking) => cannot_tell = Some((&server.shown_url, asking)),
                }
            }
            match cannot_tell {
                // Known to run somewhere: wait, whatever another server could not say.
                _ if still_running => told_at = Instant::now(),
                None => return true,
                Some((url, error)) if told_at.elapsed() >= tell_within => {
                    tracing::warn!(%url, processes_where, %error, "catalog: cannot tell whether a statement still runs; given up");
                    return false;
                }
                Some(_) => {}
            }
            if warned_at.elapsed() >= STILL_RUNNING_WARN_EVERY {
                warned_at = Instant::now();
                tracing::warn!(processes_where, "catalog: still waiting for a statement to end on the server");
            }
            tokio::time::sleep(STILL_RUNNING_POLL).await;
        }
    }

    /// [`CatalogClient::execute`] for a long server-side statement (a schema upgrade's copy) that may take longer than
    /// `catalog.request_timeout`.
    /// The server stops it at the same time (so a retry after a timeout never runs beside the first attempt).
    pub async fn execute_with_timeout(&self, sql: &str, timeout: Duration) -> Result<(), CatalogError> {
        let settings = [
            ("max_execution_time", timeout.as_secs().max(1).to_string()),
            ("timeout_overflow_mode", "throw".to_string()),
        ];
        self.execute_with(sql, &settings, timeout + Duration::from_secs(5)).await
    }

    /// [`CatalogClient::execute`] for a statement longer than the server's default `max_query_size` (256 KiB), up
    /// to `max_bytes`, and with more syntax tree elements than its default 50,000 (a long list of ids): an element
    /// takes a byte of text at least, so the statement's length bounds both. The answer may take up to `timeout`
    /// (a server that runs a mutation before it answers).
    pub async fn execute_large(&self, sql: &str, max_bytes: usize, timeout: Duration) -> Result<(), CatalogError> {
        let limit = max_bytes.max(sql.len() + 1).to_string();
        let settings = [
            ("max_query_size", limit.clone()),
            ("max_ast_elements", limit.clone()),
            ("max_expanded_ast_elements", limit),
        ];
        self.execute_with(sql, &settings, timeout.max(self.request_timeout)).await
    }

    /// Run a deciding statement (a fenced publish or lease claim): the server stops it after
    /// `max_execution_time` (whole seconds, rounded up) and answers only once it has finished; sequentially
    /// consistent on a replicated catalog. `sql` is sent verbatim.
    pub async fn execute_deciding(&self, sql: &str, max_execution_time: Duration) -> Result<(), CatalogError> {
        debug_assert!(max_execution_time.subsec_nanos() == 0, "max_execution_time is sent in whole seconds");
        let whole_seconds = max_execution_time.as_secs_f64().ceil().max(1.0) as u64;
        let mut settings =
            vec![("max_execution_time", whole_seconds.to_string()), ("timeout_overflow_mode", "throw".to_string())];
        settings.extend(self.sequential_consistency());
        self.execute_with(sql, &settings, self.request_timeout)
            .await
            .map_err(|error| with_settings_hint(error, DECIDING_SETTINGS_HINT))
    }

    /// [`CatalogClient::execute`] for a statement that reads what this process has just written (a server-side copy
    /// of rows inserted a moment ago): sequentially consistent on a replicated catalog, so a replica failed over to
    /// that lacks those rows refuses it instead of copying nothing.
    pub async fn execute_consistent(&self, sql: &str) -> Result<(), CatalogError> {
        let settings: Vec<_> = self.sequential_consistency().into_iter().collect();
        self.execute_with(sql, &settings, self.request_timeout).await
    }

    async fn execute_with(
        &self,
        sql: &str,
        settings: &[(&'static str, String)],
        timeout: Duration,
    ) -> Result<(), CatalogError> {
        self.request("execute", timeout, |client| with_settings(client.query_raw(sql), settings).execute()).await
    }

    /// With a replicated catalog, a read with this setting sees every row a quorum insert has acknowledged (or fails
    /// on a replica that does not have them yet). What a decision reads (the lease head, the fence inside a
    /// publish, a read-back) must not come from a replica that lags: it could let a second publisher in.
    fn sequential_consistency(&self) -> Option<(&'static str, String)> {
        self.insert_quorum.map(|_| ("select_sequential_consistency", "1".to_string()))
    }

    /// This client with every read sequentially consistent on a replicated catalog, for a user whose every read
    /// decides what is removed (retention's drops and row removal, see [`super::purge`]): a replica that lags
    /// refuses them, where it would answer without what a quorum insert put in.
    pub fn with_consistent_reads(&self) -> CatalogClient {
        CatalogClient { consistent_reads: true, ..self.clone() }
    }

    /// [`CatalogClient::fetch_all`] for a read a decision rests on (the lease head, a read-back, the replay guard):
    /// sequentially consistent on a replicated catalog.
    pub async fn fetch_all_deciding<T>(&self, sql: &str) -> Result<Vec<T>, CatalogError>
    where
        T: RowOwned + RowRead,
    {
        self.fetch_all_with(sql, self.sequential_consistency().as_slice(), self.request_timeout).await
    }

    /// [`CatalogClient::fetch_all_deciding`] for a read of a few granules (the lease head, the read-back of a
    /// publish): on one server thread, as [`CatalogClient::fetch_few`].
    pub async fn fetch_few_deciding<T>(&self, sql: &str) -> Result<Vec<T>, CatalogError>
    where
        T: RowOwned + RowRead,
    {
        self.fetch_few_with(sql, self.sequential_consistency().as_slice()).await
    }

    /// Read every row of a SELECT. `sql` is sent verbatim; columns map to the row's fields by position.
    ///
    /// Every read is bounded on the server as well: it stops after `catalog.request_timeout` (when this client gives
    /// up; servers from 20.x on also cancel a read whose client has gone) and at `catalog.read_max_memory`, so a read
    /// that grows with the catalog fails with an error naming the limit instead of running on or starving the server.
    pub async fn fetch_all<T>(&self, sql: &str) -> Result<Vec<T>, CatalogError>
    where
        T: RowOwned + RowRead,
    {
        self.fetch_all_with(sql, &[], self.request_timeout).await
    }

    /// [`CatalogClient::fetch_all`] for a read of a few granules whatever the catalog holds (a page's setup, the
    /// watermark, the horizons, a lookup by id, a small page's window): on one server thread ([`one_thread`]). Not
    /// for a read whose rows read grow with what it looks for (a window of a label filter or of a big page, its
    /// check in `by_id`, a page of the log, a list of ids): on a server of many cores those gain from its threads.
    pub async fn fetch_few<T>(&self, sql: &str) -> Result<Vec<T>, CatalogError>
    where
        T: RowOwned + RowRead,
    {
        self.fetch_few_with(sql, &[]).await
    }

    /// A read of a few granules with `settings` and [`one_thread`], unless the user's settings profile refuses that
    /// (a constraint on `max_threads`, which the server checks before it runs anything): then the read is sent again
    /// without it, and so are the reads after it. The setting only makes those reads faster.
    async fn fetch_few_with<T>(&self, sql: &str, settings: &[(&'static str, String)]) -> Result<Vec<T>, CatalogError>
    where
        T: RowOwned + RowRead,
    {
        if !self.one_thread_refused.load(Ordering::Relaxed) {
            let with_one_thread: Vec<_> = settings.iter().cloned().chain([one_thread()]).collect();
            match self.fetch_all_with(sql, &with_one_thread, self.request_timeout).await {
                Err(error) if error.refuses_setting(one_thread().0) => {
                    if !self.one_thread_refused.swap(true, Ordering::Relaxed) {
                        tracing::info!(
                            %error,
                            "catalog: the user's settings profile does not let reads set max_threads; small reads \
                             run with the profile's from now on"
                        );
                    }
                }
                answer => return answer,
            }
        }
        self.fetch_all_with(sql, settings, self.request_timeout).await
    }

    /// The limits a read stopped on the server after `timeout` asks for, as configured (whole seconds, rounded up).
    fn configured_read_limits(&self, timeout: Duration) -> [(&'static str, u64); 2] {
        let whole_seconds = timeout.as_secs_f64().ceil().max(1.0) as u64;
        [("max_execution_time", whole_seconds), ("max_memory_usage", self.read_max_memory)]
    }

    /// What reads do about the bounds the user's settings profile set their time and memory limits, one line each
    /// (see [`super::read_limits`]); empty while every read sends the configured limits.
    pub fn read_limit_bounds(&self) -> Vec<String> {
        self.read_limits.described(self.configured_read_limits(self.request_timeout))
    }

    /// The limit settings the user's settings profile allows a read no value of (see [`super::read_limits`]).
    pub fn read_limits_fixed_by_profile(&self) -> Vec<&'static str> {
        self.read_limits.fixed()
    }

    /// Whether the reads of a few granules still run on one server thread: false once the user's settings profile
    /// refused `max_threads` ([`CatalogClient::fetch_few`]).
    pub fn small_reads_on_one_thread(&self) -> bool {
        !self.one_thread_refused.load(Ordering::Relaxed)
    }

    /// The one number `sql` (a `SELECT count()` or the like) answers; 0 for none (a scalar subquery is Nullable on
    /// current servers).
    pub async fn fetch_count(&self, sql: &str) -> Result<u64, CatalogError> {
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct Count {
            value: u64,
        }
        let rows: Vec<Count> = self.fetch_all(&format!("SELECT toUInt64(ifNull(({sql}), 0)) AS value")).await?;
        Ok(rows.first().map_or(0, |row| row.value))
    }

    /// [`CatalogClient::fetch_all`] for a background read that goes over a whole catalog table (the lifecycle's
    /// checks before a drop), stopped on the server after `timeout` rather than `catalog.request_timeout`; the
    /// memory cap is the same.
    pub async fn fetch_all_with_timeout<T>(&self, sql: &str, timeout: Duration) -> Result<Vec<T>, CatalogError>
    where
        T: RowOwned + RowRead,
    {
        self.fetch_all_with(sql, &[], timeout.max(self.request_timeout)).await
    }

    async fn fetch_all_with<T>(
        &self,
        sql: &str,
        extra: &[(&'static str, String)],
        timeout: Duration,
    ) -> Result<Vec<T>, CatalogError>
    where
        T: RowOwned + RowRead,
    {
        let ours = self.configured_read_limits(timeout);
        // Each refusal teaches one bound; a third would be a bound not applied as read, and is an error.
        let mut tries_left = LIMIT_SETTINGS.len();
        loop {
            let mut settings = self.read_limits.settings(ours);
            settings.push(("timeout_overflow_mode", "throw".to_string()));
            if self.server_version.major >= 20 {
                // The server cancels on close only a query it knows to be read-only: a POST is not, unless it says so
                // (readonly = 2 still lets a request carry settings such as these).
                settings.push(("readonly", "2".to_string()));
                settings.push(("cancel_http_readonly_queries_on_client_close", "1".to_string()));
            }
            settings.extend_from_slice(extra);
            if self.consistent_reads && !extra.iter().any(|(name, _)| *name == "select_sequential_consistency") {
                settings.extend(self.sequential_consistency());
            }
            let settings = &settings;
            let answer = self
                .request("fetch", timeout, |client| with_settings(client.query_raw(sql), settings).fetch_all::<T>())
                .await;
            match answer {
                // A constraint refused one of the limits (before anything ran): send the read again within it.
                Err(error)
                    if tries_left > 0
                        && error.server_code == Some(SETTING_CONSTRAINT_VIOLATION)
                        && self.read_limits.learn(&error.message, ours) =>
                {
                    tries_left -= 1
                }
                answer => return answer.map_err(explained_read_error),
            }
        }
    }

    /// Insert `rows` in one INSERT statement. `table` is SQL text (`database.table`) from validated configuration,
    /// never from input; it may contain only identifier characters, dots and backquotes.
    ///
    /// One request carries every row, so the server commits the rows as one block (at most
    /// `max_insert_block_size`, about a million rows, per block): a failure is all-or-nothing for batches below that.
    pub async fn insert_rows<T>(&self, table: &str, rows: &[T]) -> Result<(), CatalogError>
    where
        T: RowOwned + RowWrite,
    {
        let table_is_plain =
            !table.is_empty() && table.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '`'));
        if !table_is_plain {
            return Err(CatalogError::new(
                ErrorKind::DefinitelyFailed,
                format!("refusing to insert into {table:?}: not a plain table name"),
            ));
        }
        if rows.is_empty() {
            return Ok(());
        }
        self.request("insert", self.request_timeout, |client| async move {
            let mut insert = client.insert_unescaped::<T>(table).await?.with_setting("wait_end_of_query", "1");
            for row in rows {
                insert.write(row).await?;
            }
            insert.end().await
        })
        .await
    }

    /// Send one request, failing over between the replicas of `catalog.url` and `catalog.replica_urls`.
    ///
    /// It goes to the current server. A server that cannot be connected to has run nothing, so the request is sent
    /// to the next one at once, and the one that answers becomes current. A request whose reply was lost (the
    /// connection broke after sending, or no reply in time) is not sent again: its error goes back to the caller,
    /// whose unknown-outcome rule applies as on a single server (a publish is read back, sequentially consistent,
    /// before anything else is published), and the next request goes to the next server.
    async fn request<T, Fut>(
        &self,
        context: &str,
        timeout: Duration,
        send: impl Fn(clickhouse::Client) -> Fut,
    ) -> Result<T, CatalogError>
    where
        Fut: std::future::Future<Output = clickhouse::error::Result<T>>,
    {
        self.request_naming_server(context, timeout, send).await.map_err(|(error, _)| error)
    }

    /// [`CatalogClient::request`], whose error comes with the server the request was sent to (None if it was sent to
    /// none).
    async fn request_naming_server<T, Fut>(
        &self,
        context: &str,
        timeout: Duration,
        send: impl Fn(clickhouse::Client) -> Fut,
    ) -> Result<T, (CatalogError, Option<usize>)>
    where
        Fut: std::future::Future<Output = clickhouse::error::Result<T>>,
    {
        let endpoints = &self.endpoints;
        let first = endpoints.current();
        let count = endpoints.servers.len();
        let mut last_error = None;
        for attempt in 0..count {
            let index = (first + attempt) % count;
            let server = &endpoints.servers[index];
            if server.checked.get().is_none() && endpoints.recently_failed_check(index) {
                continue;
            }
            match endpoints.check(index).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(error) => {
                    // Not checked now (unreachable, stalled, lacking tables): it stays unchecked, the next is tried,
                    // and nothing was sent, whatever the check's own failure was.
                    tracing::warn!(url = %server.shown_url, %error, "catalog replica cannot be checked, trying the next");
                    last_error = Some(CatalogError::new(
                        ErrorKind::DefinitelyFailed,
                        format!("not sent: {} could not be checked as a replica: {error}", server.shown_url),
                    ));
                    continue;
                }
            }
            match run_with_timeout(timeout, context, send(server.client.clone())).await {
                Ok(value) => {
                    if index != first {
                        endpoints.switch(first, index, "answered after a failover");
                    }
                    return Ok(value);
                }
                Err(error) if error.is_unreachable() && count > 1 => {
                    tracing::warn!(url = %server.shown_url, %error, "catalog server unreachable, trying the next replica");
                    last_error = Some(error);
                }
                Err(error) => {
                    if count > 1 && error.reply_lost() {
                        endpoints.switch(first, (index + 1) % count, "the last reply was lost");
                    } else if count > 1 && error.server_code.is_some_and(|code| REPLICA_CANNOT_SERVE.contains(&code)) {
                        endpoints.switch(first, (index + 1) % count, "the replica cannot serve (behind or read-only)");
                    }
                    return Err((error, Some(index)));
                }
            }
        }
        let error = last_error.unwrap_or_else(|| {
            CatalogError::new(
                ErrorKind::DefinitelyFailed,
                "no server of catalog.url and catalog.replica_urls is a replica of the same shard with the catalog's \
                 tables (see the error log)",
            )
        });
        Err((error, None))
    }

    /// Every server failed over to must hold these tables and views of `database` (the catalog's, views included:
    /// a replica without the views would take inserts and index nothing). Set once the schema is known.
    pub fn require_objects(&self, database: &str, names: Vec<String>) {
        let _ = self.endpoints.required_objects.set((database.to_string(), names));
    }
}

/// The servers of `catalog.url` and `catalog.replica_urls` and the one requests go to first.
///
/// States: `current` names the server that answered last (or the one after a server whose reply was lost); every
/// server but the first to answer at connect is `checked` once, when a request first goes to it: a replica of the
/// same shard of `catalog.cluster` (the same replicas in `system.clusters`: a server of other tables would split the
/// catalog; one that differs is skipped for good, until a restart) that holds every table and view of the catalog the
/// first server holds ([`CatalogClient::require_objects`]; one that lacks some, or cannot be reached, is passed over
/// for a request timeout and checked again). Invariant: only checked servers are sent statements.
struct Endpoints {
    servers: Vec<Endpoint>,
    current: AtomicUsize,
    /// `catalog.cluster` and the shard of the first server to answer.
    shard: Option<(String, Shard)>,
    /// The catalog's database and the tables and views a server must hold.
    required_objects: std::sync::OnceLock<(String, Vec<String>)>,
    request_timeout: Duration,
}

struct Endpoint {
    client: clickhouse::Client,
    /// The URL with its password redacted, for logs.
    shown_url: String,
    /// Whether the server is a replica of the shard; unset until it has answered the check.
    checked: tokio::sync::OnceCell<bool>,
    /// When its check last failed (see [`Endpoints::recently_failed_check`]).
    check_failed_at: std::sync::Mutex<Option<Instant>>,
}

impl Endpoints {
    fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// Make `to` current unless another request has moved on from `from` already.
    fn switch(&self, from: usize, to: usize, why: &str) {
        if self.current.compare_exchange(from, to, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            tracing::warn!(from = %self.servers[from].shown_url, to = %self.servers[to].shown_url, why, "catalog failover");
        }
    }

    /// Whether server `index` may be sent statements (see the type's doc); an unreachable server stays unchecked.
    async fn check(&self, index: usize) -> Result<bool, CatalogError> {
        let server = &self.servers[index];
        let checked = server
            .checked
            .get_or_try_init(|| async {
                let Some((cluster, expected)) = &self.shard else { return Ok(true) };
                let shard = local_shard(&server.client, cluster, self.request_timeout).await?;
                if shard.as_ref() != Some(expected) {
                    tracing::error!(url = %server.shown_url, cluster, expected = ?expected.replicas, found = ?shard.map(|shard| shard.replicas),
                        "catalog.replica_urls: this server is not a replica of the shard of the first server; it is never used");
                    return Ok(false);
                }
                if let Some((database, required)) = self.required_objects.get() {
                    let sql = format!("SELECT name FROM system.tables WHERE database = {}", sql_string_literal(database));
                    let present: Vec<String> = run_with_timeout(
                        self.request_timeout,
                        "list the catalog's tables",
                        server.client.query_raw(&sql).fetch_all::<String>(),
                    )
                    .await?;
                    let missing: Vec<&String> = required.iter().filter(|name| !present.contains(name)).collect();
                    if !missing.is_empty() {
                        // Not cached: a replica may still be running the ON CLUSTER statements queued for it.
                        return Err(CatalogError::new(
                            ErrorKind::DefinitelyFailed,
                            format!("the replica lacks tables or views of the catalog: {missing:?}"),
                        ));
                    }
                }
                Ok(true)
            })
            .await;
        match checked {
            Ok(checked) => Ok(*checked),
            Err(error) => {
                *server.check_failed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                Err(error)
            }
        }
    }

    /// A server whose check failed within the last request timeout is passed over without checking it again, so
    /// requests do not queue behind a stalled server.
    fn recently_failed_check(&self, index: usize) -> bool {
        let failed_at = *self.servers[index].check_failed_at.lock().unwrap_or_else(|p| p.into_inner());
        failed_at.is_some_and(|at| at.elapsed() < self.request_timeout)
    }
}

/// A read's error with what the operator can do about it: the configuration key of the limit it hit, or the
/// settings every read sends where the user's profile refused one.
fn explained_read_error(mut error: CatalogError) -> CatalogError {
    if error.server_code == Some(MEMORY_LIMIT_EXCEEDED) {
        error.message = format!("{} (the limit is catalog.read_max_memory)", error.message);
    }
    with_settings_hint(error, READ_SETTINGS_HINT)
}

/// `error` with `hint` (which settings the statement sends, and why) where the user's profile refused one.
fn with_settings_hint(mut error: CatalogError, hint: &str) -> CatalogError {
    if matches!(error.server_code, Some(SETTING_CONSTRAINT_VIOLATION | READONLY)) {
        error.message = format!("{} ({hint})", error.message);
    }
    error
}

fn with_settings(mut query: clickhouse::query::Query, settings: &[(&'static str, String)]) -> clickhouse::query::Query {
    for (name, value) in settings {
        query = query.with_setting(*name, value.clone());
    }
    query
}

/// The connected server's shard of `cluster` in `system.clusters`: its number and its replicas (`host:port`,
/// sorted); `None` when the server is not a replica of a cluster of that name.
#[derive(Debug, PartialEq, Eq)]
struct Shard {
    number: u64,
    replicas: Vec<String>,
}

async fn local_shard(
    client: &clickhouse::Client,
    cluster: &str,
    request_timeout: Duration,
) -> Result<Option<Shard>, CatalogError> {
    let cluster_literal = sql_string_literal(cluster);
    let sql = format!(
        "SELECT toUInt64(shard_num) AS shard, concat(host_name, ':', toString(port)) AS replica FROM system.clusters \
         WHERE cluster = {cluster_literal} AND shard_num IN \
         (SELECT shard_num FROM system.clusters WHERE cluster = {cluster_literal} AND is_local = 1) \
         ORDER BY replica"
    );
    let rows = run_with_timeout(
        request_timeout,
        "find the server's shard of catalog.cluster",
        client.query_raw(&sql).fetch_all::<(u64, String)>(),
    )
    .await?;
    let number = rows.first().map(|(number, _)| *number);
    Ok(number.map(|number| Shard { number, replicas: rows.into_iter().map(|(_, replica)| replica).collect() }))
}

/// What [`CatalogClient::connect`] reads of the server first: its version, beside each of [`OPTIONAL_SETTINGS`] it
/// has (and beside an empty name).
#[derive(clickhouse::Row, serde::Deserialize)]
struct ServerFact {
    version: String,
    name: String,
}

/// The settings capstore sets where the server has them (newer releases), looked up in `system.settings` at connect.
const OPTIONAL_SETTINGS: [&str; 4] =
    ["async_insert", "wait_for_async_insert", "insert_quorum_parallel", "max_partitions_per_insert_block"];

/// The insert settings every request carries (see the module doc, "Asynchronous inserts"): nothing on a server
/// without asynchronous inserts (18.16 refuses settings it does not know); there, asynchronous with the flush awaited
/// when `wanted` and the catalog is not replicated, and synchronous otherwise, sent explicitly so a server profile
/// that turns them on changes nothing.
pub fn insert_settings(
    server_has_async_insert: bool,
    wanted: bool,
    replicated: bool,
) -> Vec<(&'static str, &'static str)> {
    if !server_has_async_insert {
        Vec::new()
    } else if wanted && !replicated {
        vec![("async_insert", "1"), ("wait_for_async_insert", "1")]
    } else {
        vec![("async_insert", "0")]
    }
}

/// Run one whole request (send, wait, read the body) under `timeout`; a timeout is `OutcomeUnknown`.
async fn run_with_timeout<T>(
    timeout: Duration,
    context: &str,
    request: impl std::future::Future<Output = clickhouse::error::Result<T>>,
) -> Result<T, CatalogError> {
    match tokio::time::timeout(timeout, request).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(CatalogError::from_client(context, error)),
        Err(_elapsed) => {
            let mut error = CatalogError::from_client(context, clickhouse::error::Error::TimedOut);
            error.message = format!("{context}: no complete reply within {timeout:?}");
            Err(error)
        }
    }
}

/// The hyper client under the crate: our own so https can use a custom CA, and so connecting has its own timeout
/// (a connect timeout is a connect error, hence `DefinitelyFailed`, instead of an unknown whole-request timeout).
fn build_http_client(
    url: &str,
    ca_file: Option<&Path>,
    request_timeout: Duration,
) -> Result<clickhouse::Client, CatalogError> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(request_timeout / 2));
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    let mut builder = HyperClient::builder(TokioExecutor::new());
    builder.pool_idle_timeout(POOL_IDLE_TIMEOUT);

    if !url.starts_with("https://") {
        if ca_file.is_some() {
            tracing::warn!(url = %redact_url(url), "catalog.ca_file is ignored for a plain http url");
        }
        return Ok(clickhouse::Client::with_http_client(builder.build(connector)));
    }
    connector.enforce_http(false);
    let tls_config = tls_client_config(ca_file)?;
    let https_connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls_config)
        .https_only()
        .enable_http1()
        .wrap_connector(connector);
    Ok(clickhouse::Client::with_http_client(builder.build(https_connector)))
}

/// Trust exactly the CA in `ca_file` when given (a private CA), else the system's roots.
fn tls_client_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, CatalogError> {
    let config_error = |message: String| CatalogError::new(ErrorKind::DefinitelyFailed, message);
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let pem = std::fs::read(path)
                .map_err(|error| config_error(format!("cannot read catalog.ca_file {}: {error}", path.display())))?;
            let certificates: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
                .collect::<Result<_, _>>()
                .map_err(|error| config_error(format!("catalog.ca_file {}: {error}", path.display())))?;
            if certificates.is_empty() {
                return Err(config_error(format!("catalog.ca_file {} holds no PEM certificate", path.display())));
            }
            for certificate in certificates {
                roots
                    .add(certificate)
                    .map_err(|error| config_error(format!("catalog.ca_file {}: {error}", path.display())))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _ignored) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                return Err(config_error("no system CA certificates found for https; set catalog.ca_file".into()));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| config_error(format!("tls setup: {error}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clickhouse::error::Error;

    fn kind_of_text(text: &str) -> ErrorKind {
        classify(&Error::BadResponse(text.to_string()))
    }

    #[test]
    fn a_uuid_is_written_as_the_bytes_uuid_string_to_num_makes_of_it() {
        assert_eq!(
            sql_uuid_num("018bcfe5-6800-756e-8807-a01230c0daee"),
            r"'\x01\x8b\xcf\xe5\x68\x00\x75\x6e\x88\x07\xa0\x12\x30\xc0\xda\xee'"
        );
        assert_eq!(sql_uuid_num("orphan"), "UUIDStringToNum('orphan')");
    }

    #[test]
    fn rejected_before_execution_is_definitely_failed() {
        for text in [
            // Texts as 18.16.1 sends them.
            "Code: 62, e.displayText() = DB::Exception: Syntax error: failed at position 1: SELEC 1., e.what() = DB::Exception",
            "Code: 60, e.displayText() = DB::Exception: Table default.nope doesn't exist., e.what() = DB::Exception",
            "Code: 81, e.displayText() = DB::Exception: Database nope doesn't exist, e.what() = DB::Exception",
            "Code: 47, e.displayText() = DB::Exception: Unknown identifier: nope, e.what() = DB::Exception",
            "Code: 43, e.displayText() = DB::Exception: Illegal types UInt8 and String of arguments of function plus, e.what() = DB::Exception",
            "Code: 193, e.displayText() = DB::Exception: Wrong password for user default, e.what() = DB::Exception",
            "Code: 192, e.displayText() = DB::Exception: Unknown user nobody, e.what() = DB::Exception",
            "Code: 115, e.displayText() = DB::Exception: Unknown setting nosuch_setting, e.what() = DB::Exception",
            // Current servers.
            "Code: 53. DB::Exception: Type mismatch in IN or VALUES section. (TYPE_MISMATCH) (version 24.3.2.23)",
            "Code: 516. DB::Exception: default: Authentication failed. (AUTHENTICATION_FAILED)",
            "Code: 452. DB::Exception: Setting max_threads should not be changed. (SETTING_CONSTRAINT_VIOLATION) (version 26.9.2.1)",
            // Only the exception-code header, empty body.
            "Code: 62",
        ] {
            assert_eq!(kind_of_text(text), ErrorKind::DefinitelyFailed, "{text}");
        }
    }

    #[test]
    fn execution_time_errors_and_strangers_are_outcome_unknown() {
        for text in [
            "Code: 159, e.displayText() = DB::Exception: Timeout exceeded: elapsed 3.000000118 seconds, maximum: 1, e.what() = DB::Exception",
            "Code: 241. DB::Exception: Memory limit (total) exceeded. (MEMORY_LIMIT_EXCEEDED)",
            "Code: 252. DB::Exception: Too many parts (300). (TOO_MANY_PARTS)",
            "Code: 27. DB::Exception: Cannot parse input: expected ',' (CANNOT_PARSE_INPUT_ASSERTION_FAILED)",
            "Code: 394. DB::Exception: Query was cancelled. (QUERY_WAS_CANCELLED)",
            "Code: 999999",
            "502 Bad Gateway",
            "<html>proxy error: Code: 62</html>",
            "",
            "Code: ",
        ] {
            assert_eq!(kind_of_text(text), ErrorKind::OutcomeUnknown, "{text:?}");
        }
    }

    #[test]
    fn local_failures_are_classified_by_when_they_happen() {
        assert_eq!(classify(&Error::TimedOut), ErrorKind::OutcomeUnknown);
        assert_eq!(classify(&Error::NotEnoughData), ErrorKind::OutcomeUnknown);
        assert_eq!(classify(&Error::InvalidParams("bad url".into())), ErrorKind::DefinitelyFailed);
        // A network error that is not a hyper connect error (here: any other error type) is unknown.
        let other_network = Error::Network(Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset)));
        assert_eq!(classify(&other_network), ErrorKind::OutcomeUnknown);
    }

    #[test]
    fn error_codes_parse_from_the_start_only() {
        assert_eq!(parse_error_code("Code: 62, e.displayText()"), Some(62));
        assert_eq!(parse_error_code("  Code: 516. DB::Exception"), Some(516));
        assert_eq!(parse_error_code("Code: 159"), Some(159));
        assert_eq!(parse_error_code("Code: x"), None);
        assert_eq!(parse_error_code("error Code: 62"), None);
    }

    #[test]
    fn the_definitely_failed_list_has_no_execution_time_codes() {
        for execution_time_code in [159, 241, 252, 27, 209, 210, 394, 285, 286, 242] {
            assert!(!is_definitely_failed_code(execution_time_code));
        }
        let codes: Vec<u32> = DEFINITELY_FAILED_CODES.iter().map(|(c, _)| *c).collect();
        assert!(codes.windows(2).all(|pair| pair[0] < pair[1]), "codes are sorted and unique");
    }

    #[test]
    fn inserts_are_asynchronous_only_where_the_server_has_them_wanted_and_unreplicated() {
        let asynchronous = vec![("async_insert", "1"), ("wait_for_async_insert", "1")];
        let synchronous = vec![("async_insert", "0")];
        assert_eq!(insert_settings(true, true, false), asynchronous);
        assert_eq!(insert_settings(true, false, false), synchronous);
        assert_eq!(insert_settings(true, true, true), synchronous, "quorum inserts stay synchronous");
        assert_eq!(insert_settings(true, false, true), synchronous);
        for (wanted, replicated) in [(true, false), (false, false), (true, true)] {
            assert!(insert_settings(false, wanted, replicated).is_empty(), "18.16 refuses settings it lacks");
        }
    }

    #[test]
    fn versions_parse_old_and_new() {
        let old = ServerVersion::parse("18.16.1\n").unwrap();
        assert_eq!((old.major, old.minor, old.patch, old.build), (18, 16, 1, None));
        assert!(!old.is_modern() && !old.has_subsecond_clock());
        let new = ServerVersion::parse("24.3.2.23").unwrap();
        assert_eq!((new.major, new.minor, new.patch, new.build), (24, 3, 2, Some(23)));
        assert!(new.is_modern() && new.has_subsecond_clock());
        assert!(ServerVersion::parse("banana").is_none());
        assert!(ServerVersion::parse("18").is_none());
    }

    #[test]
    fn string_literals_escape_everything_that_could_end_them() {
        assert_eq!(sql_string_literal("plain"), "'plain'");
        assert_eq!(sql_string_literal("it's"), r"'it\'s'");
        assert_eq!(sql_string_literal(r"a\'b"), r"'a\\\'b'");
        assert_eq!(sql_string_literal("a\nb\0"), r"'a\nb\0'");
        assert_eq!(sql_string_literal("ünï"), "'ünï'");
    }
}
