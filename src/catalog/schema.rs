//! The catalog's tables, created if missing and stamped with a schema version.
//!
//! Tables live in `catalog.database`, named `<table_prefix>_<name>`; every row carries `catalog` (the catalog name), so
//! many catalog names share one set of tables. The DDL is the common subset of ClickHouse 18.16 and current servers:
//! no `Map` (labels are two parallel columns `label_keys`, `label_values`: 18.16 splits an `Array(Tuple(..))` column
//! into sub-columns an INSERT cannot name), no `DateTime64` (times are UInt64 nanoseconds or milliseconds),
//! UUIDs as their 36-character text (the RowBinary UUID layout changed between server versions; text never did).
//!
//! | table | engine | why |
//! | --- | --- | --- |
//! | `captures` | ReplacingMergeTree(version) | one row per capture, ordered for listing a stream by time |
//! | `by_version` | ReplacingMergeTree | the same rows ordered by (version, publish_id, capture_id): tail, get |
//! | `by_id` | ReplacingMergeTree | (capture_id, version, publish_id) as 16-byte ids: the versions holding an id |
//! | `by_time` | ReplacingMergeTree(version) | the rows of `captures` in time order, on servers without projections ([`ensure_time_table`]) |
//! | `time_bounds` | AggregatingMergeTree | first and last captured_at_ns per stream: where a listing's windows start |
//! | `packs` | ReplacingMergeTree(version) | pack inventory and the replay guard |
//! | `publishes` | MergeTree | the commit log: a row is visible only if its (version, publish_id) is here |
//! | `watermark` | AggregatingMergeTree | max(version) per catalog: a lower bound that keeps the watermark O(1) |
//! | `intents` | MergeTree, monthly partitions | packs about to be uploaded, and marks: what a start reconciles |
//! | `intent_marks` | AggregatingMergeTree | the newest mark per catalog: where a start's read of `intents` begins |
//! | `retired_packs` | MergeTree | packs a compaction replaced, and when their objects were removed (see [`super::retired`]) |
//! | `horizons` | MergeTree | retention horizons: everything captured before one is gone from its version on (see [`super::query`]) |
//! | `lease` | MergeTree | the publisher lease; plain MergeTree so merges never change what a decision reads |
//! | `schema` | MergeTree | the schema version stamp |
//!
//! `by_version`, `by_id`, `by_time`, `time_bounds`, `watermark` and `intent_marks` are filled by materialized views on
//! the INSERTs into `captures` and `publishes` (the server writes them inside the same INSERT), so every writer indexes
//! what it writes, including a capstore of schema 1 that is still running while another upgrades the tables. They
//! answer *where to look*; what is visible is still decided by `publishes` alone, so an index row of a publish that
//! never committed is harmless, and a stale `watermark` only widens the range of `publishes` that is read.
//!
//! Newer servers keep indexes 18.16 cannot ([`Tables::server_indexes`], added to existing tables at a start by
//! [`ensure_server_indexes`]): `captures` in time order across streams ([`TIME_ORDER_PROJECTION`]), so that a listing
//! across streams reads the rows of its window, and a bloom filter of `by_id`'s ids ([`ID_FILTER_INDEX`]), so that a
//! lookup by id reads the granules that hold it, not one of every part, and a bloom filter of `captures`' labels
//! ([`LABEL_FILTER_INDEX`]), so that a listing by a rare label reads about its matches. Servers without projections
//! keep `by_time` instead of the first ([`ensure_time_table`]).
//!
//! With `catalog.cluster` set, every statement gets `ON CLUSTER <cluster>` and the engines become their Replicated
//! forms with the conventional `{shard}`/`{replica}` macros.
//!
//! Partitions: `captures`, `by_version`, `by_id` and `by_time` are partitioned by catalog and UTC month of
//! `captured_at_ns` ([`PARTITION_BY`]; a time past 2099 counts as December 2099), so that a retention horizon removes a
//! whole month of one catalog with `DROP PARTITION`, which costs the same at any size, instead of mutations that
//! rewrite data (see [`super::purge`]). The catalog is part of the key because the tables are shared: a month of one
//! catalog can go while another keeps it. ClickHouse cannot partition a table that exists, so catalogs created by an
//! older capstore keep their unpartitioned tables ([`partitioned`]; `by_time`, added later, is partitioned in every
//! catalog); they get no horizons, and retention removes their rows one capture at a time as before.
//!
//! Versioning: [`SCHEMA_VERSION`] is written once into `schema`. A catalog stamped with a newer version than this build
//! knows is refused (an older capstore must not write into tables it does not understand); an older stamp is upgraded
//! by the additive statements of newer versions. 1 -> 2 adds the index tables and their views, then copies the rows
//! written before the views existed (server-side `INSERT ... SELECT`; a row copied twice, by a crash before the stamp
//! or two daemons upgrading at once, is a duplicate every read already collapses), then stamps 2. 2 -> 3 adds
//! `intents` and `intent_marks` (see [`super::intents`]); a catalog without a mark yet is reconciled once by listing
//! the bucket, as every start did before. 3 -> 4 changes no table: from 4 on a row of `by_version` and `by_id` may be a
//! deletion (a tombstone, `pack_id` empty, see [`super::query`]), which a schema 3 reader would take for a capture in
//! an object with no name. A start stamps 3 ([`STAMPED_AT_START`]); the first deletion stamps 4, which from then on
//! keeps schema 3 capstores out (one already running is not stopped by it: upgrade every daemon and reader of the
//! tables before deleting). 4 -> 5 adds `retired_packs` (created at every start, like every table) and, in
//! `by_version` and `by_id`, *moves*: a compaction's rows giving a capture its new place (see
//! [`super::query`]), which a schema 4 reader would take for a re-post; the first compaction stamps 5. 5 -> 6 adds
//! `horizons` and, in a new catalog, the `captured_at_ns` of `by_id` and the partitions (an older catalog keeps its
//! tables until `capstore repartition` moves them, see [`super::repartition`]); the first horizon stamps 6, since a
//! schema 5 reader would show what a horizon hides.

use super::client::{sql_string_literal, CatalogClient, CatalogError, ErrorKind, ServerVersion};
use crate::config::CatalogConfig;

pub const SCHEMA_VERSION: u32 = 6;

/// How `captures`, `by_version`, `by_id` and `by_time` are partitioned: by catalog and the UTC month (`YYYYMM`) of
/// `captured_at_ns`, any time past 2099 in December 2099 (so that every time maps to a month in order: a partition
/// below a month boundary holds only rows captured before it).
pub const PARTITION_BY: &str =
    "(catalog, toYYYYMM(toDateTime(least(intDiv(captured_at_ns, 1000000000), 4102444799), 'UTC')))";

/// The catalog and month of a partition (of [`PARTITION_BY`]) as `system.parts` writes it: `('edge-7',202611)`
/// (catalog names are letters, digits, `.`, `_` and `-`: nothing to unescape).
pub fn parse_partition(text: &str) -> Option<(&str, u32)> {
    let inner = text.trim().strip_prefix('(')?.strip_suffix(')')?;
    let (catalog, month) = inner.rsplit_once(',')?;
    let catalog = catalog.trim().strip_prefix('\'')?.strip_suffix('\'')?;
    Some((catalog, month.trim().parse().ok()?))
}

/// Fully qualified table names of one catalog configuration, plus the DDL flavour.
#[derive(Debug, Clone)]
pub struct Tables {
    pub database: String,
    pub captures: String,
    pub by_version: String,
    pub by_id: String,
    pub by_time: String,
    pub time_bounds: String,
    pub packs: String,
    pub publishes: String,
    pub watermark: String,
    pub intents: String,
    pub intent_marks: String,
    pub retired_packs: String,
    pub horizons: String,
    pub lease: String,
    pub schema: String,
    cluster: Option<String>,
}

impl Tables {
    /// The tables `[catalog]` names.
    pub fn from_config(catalog: &CatalogConfig) -> Tables {
        Tables::new(&catalog.database, &catalog.table_prefix, catalog.cluster.as_deref())
    }

    /// `database` and `prefix` are identifiers checked by config validation.
    pub fn new(database: &str, prefix: &str, cluster: Option<&str>) -> Tables {
        let table = |name: &str| format!("{database}.{prefix}_{name}");
        Tables {
            database: database.to_string(),
            captures: table("captures"),
            by_version: table("by_version"),
            by_id: table("by_id"),
            by_time: table("by_time"),
            time_bounds: table("time_bounds"),
            packs: table("packs"),
            publishes: table("publishes"),
            watermark: table("watermark"),
            intents: table("intents"),
            intent_marks: table("intent_marks"),
            retired_packs: table("retired_packs"),
            horizons: table("horizons"),
            lease: table("lease"),
            schema: table("schema"),
            cluster: cluster.map(str::to_string),
        }
    }

    /// The names (in [`Tables::database`], without it) of every table and view the catalog may have: `by_time` and its
    /// view on some servers only ([`ensure_time_table`]; [`objects_present`] keeps those a server holds).
    pub fn objects(&self) -> Vec<String> {
        let prefix = format!("{}.", self.database);
        self.ddl()
            .iter()
            .chain(self.time_table_ddl().iter())
            .filter_map(|statement| created_object(statement).strip_prefix(&prefix).map(str::to_string))
            .collect()
    }

    /// The names (without the database, as SQL string literals, comma-separated: for `name IN (...)` in system
    /// tables) of the tables `capstore repartition` moves onto month partitions: `captures`, `by_version` and
    /// `by_id`.
    pub fn partitioned_names(&self) -> String {
        names_in_database(&[&self.captures, &self.by_version, &self.by_id])
    }

    /// The names of [`Tables::row_tables`], as [`Tables::partitioned_names`] gives them: the tables row removals and
    /// month drops take rows from.
    pub fn row_table_names(&self, server: &ServerVersion) -> String {
        names_in_database(&self.row_tables(server))
    }

    /// The tables holding a row per capture that `server` keeps, in the order a row removal goes through them
    /// (`by_id`, which a removal batch is found by, last; see [`super::purge`]): `captures`, `by_time` where the
    /// server keeps it ([`ensure_time_table`]), `by_version`, `by_id`.
    pub fn row_tables(&self, server: &ServerVersion) -> Vec<&String> {
        let by_time = server.keeps_time_table().then_some(&self.by_time);
        [Some(&self.captures), by_time, Some(&self.by_version), Some(&self.by_id)].into_iter().flatten().collect()
    }

    /// True with `catalog.cluster`: the tables are replicated.
    pub fn is_replicated(&self) -> bool {
        self.cluster.is_some()
    }

    pub(crate) fn on_cluster(&self) -> String {
        match &self.cluster {
            Some(cluster) => format!(" ON CLUSTER {cluster}"),
            None => String::new(),
        }
    }

    pub(crate) fn engine(&self, table: &str, engine: &str, arguments: &str) -> String {
        match &self.cluster {
            Some(_) => {
                let path = format!("'/clickhouse/tables/{{shard}}/{}'", table.replace('.', "/"));
                let replicated_arguments = if arguments.is_empty() {
                    format!("{path}, '{{replica}}'")
                } else {
                    format!("{path}, '{{replica}}', {arguments}")
                };
                format!("Replicated{engine}({replicated_arguments})")
            }
            None => format!("{engine}({arguments})"),
        }
    }

    /// Every DDL statement, in order (each `IF NOT EXISTS`: a start runs them all).
    pub fn ddl(&self) -> Vec<String> {
        self.ddl_for(true)
    }

    /// [`Tables::ddl`], its view into `by_id` writing `captured_at_ns` only with `by_id_time` (a `by_id` created
    /// before schema 6 lacks it, and current servers check a view's query against its target even when the view
    /// exists already).
    fn ddl_for(&self, by_id_time: bool) -> Vec<String> {
        let by_id_select = if by_id_time { BY_ID_SELECT } else { BY_ID_SELECT_WITHOUT_TIME };
        let on_cluster = self.on_cluster();
        let view = |target: &str, select: &str| self.view_ddl(target, select);
        vec![
            format!("CREATE DATABASE IF NOT EXISTS {}{on_cluster}", self.database),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} ({CAPTURE_COLUMNS_DDL}) ENGINE = {} \
                 PARTITION BY {PARTITION_BY} ORDER BY (catalog, stream, captured_at_ns, capture_id)",
                self.captures,
                self.engine(&self.captures, "ReplacingMergeTree", "version")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} ({CAPTURE_COLUMNS_DDL}) ENGINE = {} \
                 PARTITION BY {PARTITION_BY} ORDER BY (catalog, version, publish_id, capture_id)",
                self.by_version,
                self.engine(&self.by_version, "ReplacingMergeTree", "")
            ),
            view(&self.by_version, &format!("SELECT {CAPTURE_COLUMNS} FROM {}", self.captures)),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, capture_id FixedString(16), version UInt64, publish_id FixedString(16), \
                 captured_at_ns UInt64 DEFAULT {BY_ID_TIME_UNKNOWN}\
                 ) ENGINE = {} PARTITION BY {PARTITION_BY} ORDER BY (catalog, capture_id, version, publish_id) \
                 SETTINGS index_granularity = {BY_ID_INDEX_GRANULARITY}",
                self.by_id,
                self.engine(&self.by_id, "ReplacingMergeTree", "")
            ),
            view(&self.by_id, &format!("SELECT {by_id_select} FROM {}", self.captures)),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, stream String, first_at AggregateFunction(min, UInt64), \
                 last_at AggregateFunction(max, UInt64)\
                 ) ENGINE = {} ORDER BY (catalog, stream)",
                self.time_bounds,
                self.engine(&self.time_bounds, "AggregatingMergeTree", "")
            ),
            view(&self.time_bounds, &self.time_bounds_select()),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, pack_id String, object_key String, bytes UInt64, sha256 String, records UInt64, \
                 first_captured_at_ns UInt64, last_captured_at_ns UInt64, version UInt64, publish_id String\
                 ) ENGINE = {} ORDER BY (catalog, pack_id)",
                self.packs,
                self.engine(&self.packs, "ReplacingMergeTree", "version")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, version UInt64, publish_id String, holder String, lease_term UInt64, \
                 packs UInt64, captures UInt64, published_at_ms UInt64\
                 ) ENGINE = {} ORDER BY (catalog, version, publish_id)",
                self.publishes,
                self.engine(&self.publishes, "MergeTree", "")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, version AggregateFunction(max, UInt64)\
                 ) ENGINE = {} ORDER BY catalog",
                self.watermark,
                self.engine(&self.watermark, "AggregatingMergeTree", "")
            ),
            view(&self.watermark, &self.watermark_select()),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, intent_at_ms UInt64, kind String, pack_id String, object_key String, \
                 lease_term UInt64, holder String\
                 ) ENGINE = {} PARTITION BY toYYYYMM(toDateTime(intDiv(intent_at_ms, 1000))) \
                 ORDER BY (catalog, intent_at_ms, pack_id)",
                self.intents,
                self.engine(&self.intents, "MergeTree", "")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, marked_at_ms AggregateFunction(max, UInt64)\
                 ) ENGINE = {} ORDER BY catalog",
                self.intent_marks,
                self.engine(&self.intent_marks, "AggregatingMergeTree", "")
            ),
            view(
                &self.intent_marks,
                &format!(
                    "SELECT catalog, maxState(intent_at_ms) AS marked_at_ms FROM {} WHERE kind = 'mark' \
                     GROUP BY catalog",
                    self.intents
                ),
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, pack_id String, object_key String, version UInt64, publish_id String, \
                 removed_at_ms UInt64\
                 ) ENGINE = {} ORDER BY (catalog, version, pack_id)",
                self.retired_packs,
                self.engine(&self.retired_packs, "MergeTree", "")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, before_ns UInt64, version UInt64, publish_id String, written_at_ms UInt64\
                 ) ENGINE = {} ORDER BY (catalog, version, publish_id)",
                self.horizons,
                self.engine(&self.horizons, "MergeTree", "")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 catalog String, term UInt64, lease_id String, holder String, \
                 written_at_ms UInt64, expires_at_ms UInt64, kind String\
                 ) ENGINE = {} ORDER BY (catalog, term, lease_id)",
                self.lease,
                self.engine(&self.lease, "MergeTree", "")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {}{on_cluster} (\
                 component String, version UInt32, written_at_ms UInt64\
                 ) ENGINE = {} ORDER BY component",
                self.schema,
                self.engine(&self.schema, "MergeTree", "")
            ),
        ]
    }

    /// The materialized view `<target>_view` that writes `select`'s rows into `target`.
    fn view_ddl(&self, target: &str, select: &str) -> String {
        format!("CREATE MATERIALIZED VIEW IF NOT EXISTS {target}_view{} TO {target} AS {select}", self.on_cluster())
    }

    /// `by_time` and its view ([`ensure_time_table`]): `captures`' rows, in time order across streams. The same
    /// engine and the same key columns as `captures` (in another order), so that a merge keeps the same rows of both;
    /// granules of [`TIME_TABLE_GRANULE_ROWS`].
    fn time_table_ddl(&self) -> Vec<String> {
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {}{} ({CAPTURE_COLUMNS_DDL}) ENGINE = {} \
                 PARTITION BY {PARTITION_BY} ORDER BY (catalog, captured_at_ns, capture_id, stream) \
                 SETTINGS index_granularity = {TIME_TABLE_GRANULE_ROWS}",
                self.by_time,
                self.on_cluster(),
                self.engine(&self.by_time, "ReplacingMergeTree", "version")
            ),
            self.view_ddl(&self.by_time, &format!("SELECT {CAPTURE_COLUMNS} FROM {}", self.captures)),
        ]
    }

    /// The indexes the connected server can keep beyond the common DDL ([`ensure_server_indexes`]): none on 18.16.
    pub fn server_indexes(&self, server: &ServerVersion) -> Vec<ServerIndex> {
        let mut indexes = Vec::new();
        if server.has_replacing_projections() {
            indexes.push(self.server_index(
                &self.captures,
                "PROJECTION",
                TIME_ORDER_PROJECTION,
                "(SELECT * ORDER BY catalog, captured_at_ns, capture_id)",
                // A server refuses a projection on a ReplacingMergeTree without a merge mode.
                Some("deduplicate_merge_projection_mode = 'rebuild'".to_string()),
            ));
        }
        if server.has_skip_indexes() {
            indexes.push(self.server_index(
                &self.captures,
                "INDEX",
                LABEL_FILTER_INDEX,
                &format!("{LABEL_PAIRS} TYPE bloom_filter({LABEL_FILTER_FALSE_POSITIVES}) GRANULARITY 1"),
                None,
            ));
            indexes.push(self.server_index(
                &self.by_id,
                "INDEX",
                ID_FILTER_INDEX,
                &format!("capture_id TYPE bloom_filter({ID_FILTER_FALSE_POSITIVES}) GRANULARITY 1"),
                Some(format!(
                    "min_compress_block_size = {}, max_compress_block_size = {ID_LOOKUP_BLOCK_BYTES}",
                    ID_LOOKUP_BLOCK_BYTES / 2
                )),
            ));
        }
        indexes
    }

    /// The `kind` (`PROJECTION` or `INDEX`) `name` of `table`, as `definition` says after its name: `settings` of the
    /// table first, when it needs any, then the index, then its rows for the parts written before it.
    fn server_index(
        &self,
        table: &str,
        kind: &str,
        name: &str,
        definition: &str,
        settings: Option<String>,
    ) -> ServerIndex {
        let alter = format!("ALTER TABLE {table}{}", self.on_cluster());
        let statements = settings
            .map(|settings| format!("{alter} MODIFY SETTING {settings}"))
            .into_iter()
            .chain([
                format!("{alter} ADD {kind} IF NOT EXISTS {name} {definition}"),
                format!("{alter} MATERIALIZE {kind} {name}"),
            ])
            .collect();
        ServerIndex { table: table.to_string(), declared_as: format!("{kind} {name}"), statements }
    }

    fn time_bounds_select(&self) -> String {
        format!(
            "SELECT catalog, stream, minState(captured_at_ns) AS first_at, maxState(captured_at_ns) AS last_at \
             FROM {} GROUP BY catalog, stream",
            self.captures
        )
    }

    fn watermark_select(&self) -> String {
        format!("SELECT catalog, maxState(version) AS version FROM {} GROUP BY catalog", self.publishes)
    }

    /// The copies that fill the schema 2 tables with the rows written before their views existed. They run on the
    /// server capstore is connected to; with `catalog.cluster`, the replicated target tables carry the copy to the
    /// other replicas of that shard.
    fn backfill_to_2(&self) -> Vec<String> {
        vec![
            format!(
                "INSERT INTO {} ({CAPTURE_COLUMNS}) SELECT {CAPTURE_COLUMNS} FROM {}",
                self.by_version, self.captures
            ),
            format!("INSERT INTO {} ({BY_ID_COLUMNS}) SELECT {BY_ID_SELECT} FROM {}", self.by_id, self.captures),
            format!("INSERT INTO {} (catalog, version) {}", self.watermark, self.watermark_select()),
            self.time_bounds_copy(),
        ]
    }

    fn time_bounds_copy(&self) -> String {
        format!("INSERT INTO {} (catalog, stream, first_at, last_at) {}", self.time_bounds, self.time_bounds_select())
    }
}

impl Tables {
    /// The copies of rows of `captures` whose publish the index tables lack entirely (a view inserts a whole block or
    /// nothing, so a publish is indexed completely or not at all).
    fn catch_up_to_2(&self) -> Vec<String> {
        vec![
            format!(
                "INSERT INTO {by_version} ({CAPTURE_COLUMNS}) SELECT {CAPTURE_COLUMNS} FROM {captures} \
                 WHERE (catalog, version, publish_id) NOT IN (SELECT DISTINCT catalog, version, publish_id FROM {by_version})",
                by_version = self.by_version,
                captures = self.captures
            ),
            format!(
                // The filter in a subquery of its own: the outer SELECT's aliases are named like the columns.
                "INSERT INTO {by_id} ({BY_ID_COLUMNS}) SELECT {BY_ID_SELECT} FROM (SELECT {CAPTURE_COLUMNS} \
                 FROM {captures} WHERE (catalog, version, publish_id) NOT IN \
                 (SELECT DISTINCT catalog, version, UUIDNumToString(publish_id) FROM {by_id}))",
                by_id = self.by_id,
                captures = self.captures
            ),
            // Bounds merge by min and max: copying them all again is idempotent.
            self.time_bounds_copy(),
        ]
    }
}

/// The columns of `captures` and `by_version`, in order.
const CAPTURE_COLUMNS_DDL: &str = "catalog String, stream String, captured_at_ns UInt64, capture_id String, \
     pack_id String, object_key String, record_offset UInt64, record_len UInt64, \
     payload_offset UInt64, payload_len UInt64, crc32c UInt32, \
     label_keys Array(String), label_values Array(String), content_type String, \
     version UInt64, publish_id String";
pub(super) const CAPTURE_COLUMNS: &str =
    "catalog, stream, captured_at_ns, capture_id, pack_id, object_key, record_offset, \
     record_len, payload_offset, payload_len, crc32c, label_keys, label_values, content_type, version, publish_id";
const BY_ID_COLUMNS: &str = "catalog, capture_id, version, publish_id, captured_at_ns";
/// Rows per `by_id` index mark: its reads are lookups of ids scattered over the whole table (a page's ids, one id of a
/// `get`), each costing a granule; at the default 8,192 rows, a page of 100 ids read 2.8 M rows (119 ms at 10 M
/// captures), at 256 it reads 92 k (29 ms). Its rows are 36 bytes, so the finer index stays small.
const BY_ID_INDEX_GRANULARITY: u32 = 256;
/// `by_id` keeps the ids as their 16 bytes: a third of the text's size on disk, and this table is all ids. (Every id
/// capstore writes is a UUID's text, so the conversion cannot fail.)
const BY_ID_SELECT: &str = "catalog, UUIDStringToNum(capture_id) AS capture_id, version, \
     UUIDStringToNum(publish_id) AS publish_id, captured_at_ns";
/// What `by_id.captured_at_ns` holds in a row written without it (by a capstore older than schema 6): the top
/// month, which no horizon drops, so that such a row outlives the rows it indexes rather than the other way round.
const BY_ID_TIME_UNKNOWN: u64 = u64::MAX;
/// [`BY_ID_SELECT`] of a `by_id` created before schema 6.
const BY_ID_SELECT_WITHOUT_TIME: &str = "catalog, UUIDStringToNum(capture_id) AS capture_id, version, \
     UUIDStringToNum(publish_id) AS publish_id";

/// How long one backfill statement of an upgrade may run: it copies every row of the catalog tables on the server.
const BACKFILL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error(
        "catalog schema in {database} is version {found}, newer than this capstore understands ({SCHEMA_VERSION}); \
         upgrade capstore"
    )]
    TooNew { database: String, found: u32 },
    #[error(
        "catalog schema in {database} is version {found}; this capstore reads version {SCHEMA_VERSION}: start the \
         daemon (capstore run) once, which upgrades it (or wait for the upgrade under way to finish)"
    )]
    NotUpgraded { database: String, found: u32 },
    #[error(
        "the catalog tables in {database} are being repartitioned (or a run of `capstore repartition` stopped half \
         way): wait for it, or run it again"
    )]
    Repartitioning { database: String },
}

/// The component of `capstore repartition`'s mark in `schema` (see [`super::repartition`]): a counter, odd while a run
/// is under way (a run writes the next odd number when it starts and the next even one when it is done).
pub const REPARTITION_COMPONENT: &str = "repartition";

/// Whether a run of `capstore repartition` is under way, or stopped half way (its mark in `schema`).
pub async fn repartition_under_way(client: &CatalogClient, tables: &Tables) -> Result<bool, CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Mark {
        version: u32,
    }
    let rows: Result<Vec<Mark>, CatalogError> = client
        .fetch_all(&format!(
            "SELECT max(version) AS version FROM {} WHERE component = {}",
            tables.schema,
            sql_string_literal(REPARTITION_COMPONENT)
        ))
        .await;
    match rows {
        Ok(rows) => Ok(rows.first().is_some_and(|row| row.version % 2 == 1)),
        // No tables yet: nothing to repartition.
        Err(error) if error.is_unknown_table() => Ok(false),
        Err(error) => Err(error),
    }
}

/// [`repartition_under_way`] as the refusal a start or a reader gives.
async fn refuse_while_repartitioning(client: &CatalogClient, tables: &Tables) -> Result<(), SchemaError> {
    if repartition_under_way(client, tables).await? {
        return Err(SchemaError::Repartitioning { database: tables.database.clone() });
    }
    Ok(())
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct SchemaStamp {
    version: u32,
}

async fn stamped_version(client: &CatalogClient, tables: &Tables) -> Result<u32, CatalogError> {
    let stamps: Vec<SchemaStamp> = client
        .fetch_all(&format!("SELECT max(version) AS version FROM {} WHERE component = 'catalog'", tables.schema))
        .await?;
    Ok(stamps.first().map_or(0, |stamp| stamp.version))
}

/// The schema version stamped in the catalog and whether a run of `capstore repartition` is under way (see
/// [`repartition_under_way`]), in one statement: a reader checks both before every command.
async fn stamp_and_repartition_mark(client: &CatalogClient, tables: &Tables) -> Result<(u32, bool), CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Marks {
        stamp: u32,
        repartition: u32,
    }
    let rows: Vec<Marks> = client
        .fetch_all(&format!(
            "SELECT maxIf(version, component = 'catalog') AS stamp, maxIf(version, component = {repartition}) AS \
             repartition FROM {schema} WHERE component IN ('catalog', {repartition})",
            schema = tables.schema,
            repartition = sql_string_literal(REPARTITION_COMPONENT)
        ))
        .await?;
    Ok(rows.first().map_or((0, false), |row| (row.stamp, row.repartition % 2 == 1)))
}

/// The database and its tables and views that exist on the connected server, by the names the DDL gives them
/// (`database`, `database.table`).
async fn present_objects(
    client: &CatalogClient,
    tables: &Tables,
) -> Result<std::collections::HashSet<String>, CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Name {
        object: String,
    }
    let database = sql_string_literal(&tables.database);
    let names: Vec<Name> = client
        .fetch_all(&format!(
            "SELECT name AS object FROM system.databases WHERE name = {database} \
             UNION ALL SELECT concat(database, '.', name) AS object FROM system.tables WHERE database = {database}"
        ))
        .await?;
    Ok(names.into_iter().map(|row| row.object).collect())
}

/// The catalog's tables and views (names without the database) that the connected server holds: what every replica
/// failed over to must hold as well ([`CatalogClient::require_objects`]). A catalog of an older schema may lack some
/// (such as `retired_packs`); those are not required.
pub async fn objects_present(client: &CatalogClient, tables: &Tables) -> Result<Vec<String>, CatalogError> {
    let present = present_objects(client, tables).await?;
    Ok(tables.objects().into_iter().filter(|name| present.contains(&format!("{}.{name}", tables.database))).collect())
}

/// The name a statement of [`Tables::ddl`] creates: the word after `IF NOT EXISTS`.
pub(super) fn created_object(statement: &str) -> &str {
    let after = statement.split_once(" IF NOT EXISTS ").map_or("", |(_, rest)| rest);
    after.split_whitespace().next().unwrap_or_default()
}

/// The schema version stamped in the catalog, or `None` when it has no tables yet (the daemon's first start creates
/// them). Reads only.
pub async fn installed_version(client: &CatalogClient, tables: &Tables) -> Result<Option<u32>, CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Exists {
        present: u8,
    }
    let exists: Vec<Exists> = client
        .fetch_all(&format!(
            "SELECT toUInt8(count() > 0) AS present FROM system.tables WHERE database = {} AND name = {}",
            sql_string_literal(&tables.database),
            sql_string_literal(tables.schema.rsplit('.').next().unwrap_or_default())
        ))
        .await?;
    if exists.first().is_none_or(|row| row.present == 0) {
        return Ok(None);
    }
    stamped_version(client, tables).await.map(Some)
}

/// What [`probe_grants`] found.
#[derive(Debug)]
pub enum GrantsProbe {
    /// Every statement the daemon runs was accepted; `left_behind` names the probe objects a refused DROP (which the
    /// daemon never needs) left in the database.
    Granted { left_behind: Vec<String> },
    /// The database does not exist yet: the daemon's first start creates it; nothing could be probed.
    NoDatabase,
    /// A statement the daemon needs was refused: which grant, and the server's answer.
    Refused { grant: &'static str, error: CatalogError },
}

/// Prove the grants the daemon needs by using them on scratch tables and a view beside the catalog's tables, created
/// as the daemon creates its own (`ON CLUSTER` and replicated engines when `catalog.cluster` is set): create two
/// tables and a materialized view from one into the other, insert (through the view), select, `ALTER ... DELETE`;
/// then drop all three again. The names are fixed (`<prefix>_grants_probe`, `_copy`, `_view`), so a probe whose DROP
/// is refused leaves at most these behind.
/// Works the same on servers with and without SQL access control. Creates no database.
pub async fn probe_grants(client: &CatalogClient, tables: &Tables) -> Result<GrantsProbe, CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Exists {
        present: u8,
    }
    let databases: Vec<Exists> = client
        .fetch_all(&format!(
            "SELECT toUInt8(count() > 0) AS present FROM system.databases WHERE name = {}",
            sql_string_literal(&tables.database)
        ))
        .await?;
    if databases.first().is_none_or(|row| row.present == 0) {
        return Ok(GrantsProbe::NoDatabase);
    }
    let probe = format!("{}_grants_probe", tables.schema.trim_end_matches("_schema"));
    let (copy, view) = (format!("{probe}_copy"), format!("{probe}_view"));
    let on_cluster = tables.on_cluster();
    let names = [view.clone(), copy.clone(), probe.clone()];
    let drops: Vec<String> = names.iter().map(|name| format!("DROP TABLE IF EXISTS {name}{on_cluster}")).collect();
    // A probe left by an earlier run whose DROP was refused: start afresh if we may.
    for statement in &drops {
        let _ = client.execute(statement).await;
    }
    let create = |table: &str| {
        let engine = tables.engine(table, "MergeTree", "");
        format!("CREATE TABLE IF NOT EXISTS {table}{on_cluster} (id UInt64) ENGINE = {engine} ORDER BY id")
    };
    let steps: [(&'static str, String); 6] = [
        ("CREATE TABLE", create(&probe)),
        ("CREATE TABLE", create(&copy)),
        (
            "CREATE VIEW",
            format!("CREATE MATERIALIZED VIEW IF NOT EXISTS {view}{on_cluster} TO {copy} AS SELECT id FROM {probe}"),
        ),
        ("INSERT", format!("INSERT INTO {probe} (id) VALUES (1)")),
        ("SELECT", format!("SELECT count() FROM {copy}")),
        ("ALTER DELETE", format!("ALTER TABLE {copy}{on_cluster} DELETE WHERE id = 1")),
    ];
    let mut refused = None;
    for (grant, statement) in &steps {
        if let Err(error) = client.execute(statement).await {
            refused = Some((*grant, error));
            break;
        }
    }
    // Whatever happened (a create may have landed and then timed out), try to remove both.
    let mut left_behind = Vec::new();
    for (statement, name) in drops.iter().zip(&names) {
        if client.execute(statement).await.is_err() {
            left_behind.push(name.clone());
        }
    }
    Ok(match refused {
        Some((grant, error)) => GrantsProbe::Refused { grant, error },
        None => GrantsProbe::Granted { left_behind },
    })
}

/// The version a start stamps: 4 and 5 add only rows a schema 3 capstore would misread (deletions, moves), so they
/// are stamped by the first deletion and the first compaction ([`stamp_at_least`]), and schema 3 daemons sharing
/// the tables keep (re)starting until somebody deletes or compacts.
pub const STAMPED_AT_START: u32 = 3;

/// For a read-only connection, which creates and upgrades nothing: the catalog must be stamped with a schema version
/// this build reads as its own (3 to 6).
pub async fn check_schema(client: &CatalogClient, tables: &Tables) -> Result<(), SchemaError> {
    let (found, repartitioning) = stamp_and_repartition_mark(client, tables).await?;
    if repartitioning {
        return Err(SchemaError::Repartitioning { database: tables.database.clone() });
    }
    match found {
        STAMPED_AT_START..=SCHEMA_VERSION => Ok(()),
        found if found > SCHEMA_VERSION => Err(SchemaError::TooNew { database: tables.database.clone(), found }),
        found => Err(SchemaError::NotUpgraded { database: tables.database.clone(), found }),
    }
}

/// Create what is missing, then check and stamp the schema version. Idempotent; safe to run from every start.
///
/// When the connected server holds every object already, no DDL is sent: on a cluster an `ON CLUSTER` statement
/// waits for every replica to run it, so running them at every start would keep a daemon from starting while any
/// replica is down. When anything is missing, every statement is run (each `IF NOT EXISTS`, `ON CLUSTER` on a
/// cluster), so that every replica gets what it lacks.
pub async fn ensure_schema(client: &CatalogClient, tables: &Tables) -> Result<u32, SchemaError> {
    // Before any DDL: a repartition swaps tables, and one created here in between would stand in its way.
    refuse_while_repartitioning(client, tables).await?;
    create_missing(client, tables).await?;
    ensure_server_indexes(client, tables).await?;
    ensure_time_table(client, tables).await?;
    let found = stamped_version(client, tables).await?;
    if found > SCHEMA_VERSION {
        return Err(SchemaError::TooNew { database: tables.database.clone(), found });
    }
    if found < 2 {
        // Cheap when the tables were created just now (stamp 0): only a schema 1 catalog has rows to copy.
        tracing::info!(database = %tables.database, "upgrading the catalog schema from 1 to 2: indexing every capture by version and by id");
        for statement in tables.backfill_to_2() {
            client.execute_with_timeout(&statement, BACKFILL_TIMEOUT).await?;
        }
    }
    if found == 1 {
        // A schema 1 writer's INSERT that started before the views existed is indexed by neither them nor the copy
        // if its part lands after the copy read `captures`. Such an INSERT ends within that writer's request
        // timeout (taken to be no longer than ours), and only then can its publish commit: after that, copy what
        // the index tables still lack.
        let settle = client.request_timeout() * 3;
        tracing::info!(?settle, "catalog upgrade: waiting for writes in flight, then indexing what they added");
        tokio::time::sleep(settle).await;
        for statement in tables.catch_up_to_2() {
            client.execute_with_timeout(&statement, BACKFILL_TIMEOUT).await?;
        }
    }
    if found < STAMPED_AT_START {
        stamp(client, tables, STAMPED_AT_START).await?;
    }
    if found < STAMPED_BY_HORIZON && partitioned(client, tables).await? {
        // Partitioned tables are dropped month by month, and a capstore of schema 5 would write `by_id` rows with no
        // time (and no idea of horizons): from the first start on, it is kept out.
        stamp(client, tables, STAMPED_BY_HORIZON).await?;
        return Ok(STAMPED_BY_HORIZON);
    }
    Ok(found.max(STAMPED_AT_START))
}

/// Create the catalog's tables and views that the connected server lacks (see [`ensure_schema`]); a `by_id` created
/// before schema 6 keeps its view as it was ([`Tables::ddl_for`]).
pub(super) async fn create_missing(client: &CatalogClient, tables: &Tables) -> Result<(), CatalogError> {
    let present = present_objects(client, tables).await?;
    let by_id_time = !present.contains(&tables.by_id) || by_id_has_time(client, tables).await?;
    let ddl = tables.ddl_for(by_id_time);
    if !ddl.iter().all(|statement| present.contains(created_object(statement))) {
        for statement in &ddl {
            client.execute(statement).await?;
        }
    }
    Ok(())
}

/// The projection of `captures` in time order ([`Tables::server_indexes`]): ordered by (catalog, captured_at_ns,
/// capture_id), read by the server instead of the table when a query's range is one of time, not of a stream, so that
/// a listing across streams reads the rows of its window instead of a granule of every stream's. It costs a second
/// copy of `captures` on disk, written inside the same insert (no part more per publish), and nothing to a read: the
/// server reads whichever order has fewer marks to read. Kept where the server has projections on a
/// ReplacingMergeTree that survive its merges ([`ServerVersion::has_replacing_projections`]).
pub const TIME_ORDER_PROJECTION: &str = "by_time";

/// The bloom filter of `by_id`'s capture ids ([`Tables::server_indexes`]). `by_id` is partitioned by month of
/// capture, and an id may have a version in any month (a re-post with another time), so a lookup of an id probes
/// every part of the catalog, and without a filter reads a granule of each to find the id absent: a page of `ls`
/// checking its 100 ids read 200k rows at 10M captures. With it, the server skips the granules that do not hold any of
/// the ids asked for. Kept where the server has skip indexes ([`ServerVersion::has_skip_indexes`]).
pub const ID_FILTER_INDEX: &str = "id_filter";

/// The filter's false positives per id and granule: a page asks for 100 ids at once, and each granule that seems to
/// hold one of them is read, so at 1e-4 one granule in a hundred is read for nothing (at 1e-2, two in three were). It
/// costs about 2.4 bytes per row.
const ID_FILTER_FALSE_POSITIVES: f64 = 0.0001;

/// The largest compression block of `by_id`'s columns (the smallest: half of it) where the server takes it per
/// table, set with [`ID_FILTER_INDEX`] (for parts written from then on, merges included): a lookup decompresses a
/// whole block of each column to read the granule of 256 rows it wants, and the server's default is 64 KiB to 1 MiB.
/// With 4 to 8 KiB a page's lookup of 100 ids took 20 ms instead of 34 on 26.9 at 10M captures (both merged alike),
/// for 2% more bytes on disk (ids do not compress).
const ID_LOOKUP_BLOCK_BYTES: u32 = 8192;

/// The bloom filter of `captures`' labels as `key=value` pairs ([`LABEL_PAIRS`], [`Tables::server_indexes`]): a
/// listing by a label reads only the granules of its stream's window that may hold the label, so that a rare label
/// (a run id, an incident) costs about its matches, not the stream. A key or a value holding `=` can make two pairs
/// read alike: that only makes a granule be read for nothing, since the listing checks the label itself as well. Kept
/// where the server has skip indexes ([`ServerVersion::has_skip_indexes`]).
pub const LABEL_FILTER_INDEX: &str = "label_filter";

/// The expression [`LABEL_FILTER_INDEX`] indexes: a capture's labels as `key=value` strings. A read that wants the
/// index to apply says `has(<this>, 'key=value')`, written exactly so.
pub const LABEL_PAIRS: &str = "arrayMap((k, v) -> concat(k, '=', v), label_keys, label_values)";

/// The label filter's false positives per pair asked for and granule (a listing asks for a label or two).
const LABEL_FILTER_FALSE_POSITIVES: f64 = 0.01;

/// An index the connected server can keep beyond the common DDL (see [`Tables::server_indexes`]).
#[derive(Debug, Clone)]
pub struct ServerIndex {
    /// The table that holds it.
    pub table: String,
    /// How the table's `CREATE` statement declares it (`PROJECTION <name>`, `INDEX <name>`).
    pub declared_as: String,
    /// The statements that add it, then fill it for the parts written before it (a mutation, in the background).
    statements: Vec<String>,
}

/// Give the tables the indexes that the connected server can keep beyond the common DDL and that they lack (made
/// before this capstore, or on a server since upgraded): they are added to the table, and the rows written before
/// are indexed in the background. No stamp: an index changes no row any capstore reads, and only what the server
/// reads to answer.
///
/// [`ServerVersion::has_replacing_projections`]: super::client::ServerVersion::has_replacing_projections
/// [`ServerVersion::has_skip_indexes`]: super::client::ServerVersion::has_skip_indexes
pub(super) async fn ensure_server_indexes(client: &CatalogClient, tables: &Tables) -> Result<(), CatalogError> {
    for index in missing_server_indexes(client, tables).await? {
        tracing::info!(table = %index.table, index = %index.declared_as, "adding an index the server can keep");
        for statement in &index.statements {
            client.execute(statement).await?;
        }
    }
    Ok(())
}

/// The indexes of [`Tables::server_indexes`] that the tables lack.
pub async fn missing_server_indexes(client: &CatalogClient, tables: &Tables) -> Result<Vec<ServerIndex>, CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Created {
        name: String,
        create_table_query: String,
    }
    let indexes = tables.server_indexes(client.server_version());
    if indexes.is_empty() {
        return Ok(indexes);
    }
    // One read of the `CREATE` statements of the tables that hold them.
    let names: Vec<String> =
        indexes.iter().map(|index| sql_string_literal(index.table.rsplit('.').next().unwrap_or_default())).collect();
    let created: Vec<Created> = client
        .fetch_all(&format!(
            "SELECT name, create_table_query FROM system.tables WHERE database = {} AND name IN ({})",
            sql_string_literal(&tables.database),
            names.join(", ")
        ))
        .await?;
    let declares = |index: &ServerIndex| {
        let table = index.table.rsplit('.').next().unwrap_or_default();
        let declaration = format!("{} ", index.declared_as);
        created.iter().any(|row| row.name == table && row.create_table_query.contains(&declaration))
    };
    Ok(indexes.into_iter().filter(|index| !declares(index)).collect())
}

/// Whether the view into `by_id` writes `captured_at_ns`: one made by a capstore older than schema 6 (say, one that
/// started on the tables while they were repartitioned) does not, and its rows go to `by_id`'s top partition.
pub(super) async fn by_id_view_writes_time(client: &CatalogClient, tables: &Tables) -> Result<bool, CatalogError> {
    let (database, table) = tables.by_id.split_once('.').unwrap_or_default();
    let views = client
        .fetch_count(&format!(
            "SELECT count() FROM system.tables WHERE database = {} AND name = {} AND \
             create_table_query LIKE '%captured_at_ns%'",
            sql_string_literal(database),
            sql_string_literal(&format!("{table}_view"))
        ))
        .await?;
    Ok(views > 0)
}

/// Whether `by_id` has its `captured_at_ns` column (created by schema 6 or newer, or repartitioned). An older one is
/// left as it is: adding the column in place breaks its view on 18.16 (which pushes the view's old columns only and
/// refuses a block without the new one), and only partitioned tables need it.
pub async fn by_id_has_time(client: &CatalogClient, tables: &Tables) -> Result<bool, CatalogError> {
    let (database, table) = tables.by_id.split_once('.').unwrap_or_default();
    let columns = client
        .fetch_count(&format!(
            "SELECT count() FROM system.columns WHERE database = {} AND table = {} AND name = 'captured_at_ns'",
            sql_string_literal(database),
            sql_string_literal(table)
        ))
        .await?;
    Ok(columns > 0)
}

/// Whether the catalog's `captures`, `by_version` and `by_id` are partitioned by [`PARTITION_BY`] (created by a
/// capstore of schema 6 or newer): only then can a retention horizon drop whole months of them.
pub async fn partitioned(client: &CatalogClient, tables: &Tables) -> Result<bool, CatalogError> {
    let partitioned = client
        .fetch_count(&format!(
            "SELECT count() FROM system.tables WHERE database = {} AND name IN ({}) AND \
             partition_key LIKE '%captured_at_ns%'",
            sql_string_literal(&tables.database),
            tables.partitioned_names()
        ))
        .await?;
    Ok(partitioned == 3)
}

/// `tables` by their names without the database, as SQL string literals, comma-separated.
fn names_in_database(tables: &[&String]) -> String {
    let names: Vec<String> =
        tables.iter().map(|table| sql_string_literal(table.rsplit('.').next().unwrap_or_default())).collect();
    names.join(", ")
}

/// Rows per granule of `by_time`: it is read a window of about a page at a time, twice per window (the rows and
/// their versions), and a granule is the least a read takes (a window's query at 10M captures on 18.16: about 7 ms
/// with 1024, 10 ms with the default 8192; its primary index is 8 times larger, about 10 MB of memory at 100M).
const TIME_TABLE_GRANULE_ROWS: u32 = 1024;

/// The component of `by_time`'s mark in `schema` ([`ensure_time_table`]): written once the table holds every row of
/// `captures`.
pub const TIME_TABLE_COMPONENT: &str = "by_time";

/// Keep `by_time`, `captures` in time order across streams, where the server cannot keep the time-order projection
/// ([`TIME_ORDER_PROJECTION`]; before 24.8, 18.16 here): so that a listing across streams reads the rows of its
/// window, not a granule of every stream's (at 10M captures in 100 streams, 120 ms where the window's rows take 3).
/// It is a second copy of `captures` (a view writes it inside each INSERT into `captures`, one part more per
/// publish), which row removals and month drops take rows from like the others ([`Tables::row_table_names`]).
/// States:
/// - *absent*: no table (created by an older capstore, or on a server with the projection): listings read
///   `captures`.
/// - *filling*: the table and its view exist, and the mark does not: the view writes what is inserted from now on,
///   and [`fill_time_table`] copies what was written before; then the mark is written. A crash leaves it filling,
///   and the next start copies again (a row copied twice is a duplicate every read collapses). Listings still read
///   `captures`.
/// - *kept*: the mark is written: listings across streams read `by_time` ([`time_table_kept`]). `capstore
///   repartition` drops the view while nothing writes and makes it again ([`create_time_table`]); a table or view
///   found missing otherwise (dropped by hand) is made again and filled again, with a warning: rows inserted
///   meanwhile were never written into it.
pub(super) async fn ensure_time_table(client: &CatalogClient, tables: &Tables) -> Result<(), CatalogError> {
    if !client.server_version().keeps_time_table() {
        return Ok(());
    }
    let (present, kept) = tokio::join!(present_objects(client, tables), time_table_kept(client, tables));
    let (present, kept) = (present?, kept?);
    let missing = tables.time_table_ddl().iter().any(|statement| !present.contains(created_object(statement)));
    if kept && !missing {
        return Ok(());
    }
    create_time_table(client, tables).await?;
    if kept {
        tracing::warn!(
            table = %tables.by_time,
            "catalog: the time-ordered table or its view was missing; copying every capture into it again"
        );
    }
    if !fill_time_table(client, tables).await? || kept {
        return Ok(());
    }
    client
        .execute(&format!(
            "INSERT INTO {} (component, version, written_at_ms) SELECT {}, 1, toUInt64(now()) * 1000",
            tables.schema,
            sql_string_literal(TIME_TABLE_COMPONENT)
        ))
        .await?;
    Ok(())
}

/// Make `by_time` and its view where they are missing.
pub(super) async fn create_time_table(client: &CatalogClient, tables: &Tables) -> Result<(), CatalogError> {
    for statement in tables.time_table_ddl() {
        client.execute(&statement).await?;
    }
    Ok(())
}

/// Copy every row of `captures` into `by_time` (whose view exists), on the server. An INSERT into `captures` that
/// began before the view existed (from a capstore that does not know it) writes no row into `by_time`: when
/// `captures` holds rows or an INSERT into it is running on this server, the copy waits three request timeouts
/// first, longer than such an INSERT is let run. With replicated tables this replica first fetches every part of
/// `captures` the others took; false (nothing copied, stays *filling*, a later start tries again) when it cannot
/// within that time (a replica down): a start does not fail for the sake of a faster listing.
async fn fill_time_table(client: &CatalogClient, tables: &Tables) -> Result<bool, CatalogError> {
    let settle = client.request_timeout() * 3;
    let rows = client.fetch_count(&format!("SELECT count() FROM {}", tables.captures)).await?;
    let inserting = client
        .fetch_count(&format!(
            "SELECT count() FROM system.processes WHERE query LIKE {}",
            sql_string_literal(&format!("INSERT INTO {}%", tables.captures))
        ))
        .await?;
    if rows > 0 || inserting > 0 {
        tracing::info!(?settle, rows, "catalog: adding the time-ordered table; waiting for inserts in flight");
        tokio::time::sleep(settle).await;
    }
    if tables.is_replicated() {
        let synced = client.execute_with_timeout(&format!("SYSTEM SYNC REPLICA {}", tables.captures), settle).await;
        if let Err(error) = synced {
            tracing::warn!(%error, "catalog: this replica has not fetched every part of captures; the time-ordered \
                table stays unfilled (listings across streams read captures) until a later start");
            return Ok(false);
        }
    }
    client
        .execute_with_timeout(
            &format!(
                "INSERT INTO {} ({CAPTURE_COLUMNS}) SELECT {CAPTURE_COLUMNS} FROM {}",
                tables.by_time, tables.captures
            ),
            BACKFILL_TIMEOUT,
        )
        .await?;
    Ok(true)
}

/// Whether `by_time` holds every row of `captures` (its mark is written, see [`ensure_time_table`]).
pub async fn time_table_kept(client: &CatalogClient, tables: &Tables) -> Result<bool, CatalogError> {
    let marks = client.fetch_count(&format!("SELECT count() FROM {}", time_table_marks(tables))).await?;
    Ok(marks > 0)
}

/// The rows of `schema` marking `by_time` kept: `FROM` and `WHERE` of a read of them.
pub(super) fn time_table_marks(tables: &Tables) -> String {
    format!("{} WHERE component = {}", tables.schema, sql_string_literal(TIME_TABLE_COMPONENT))
}

/// The schema a deletion needs stamped before its rows are written (see the module doc).
pub const STAMPED_BY_DELETION: u32 = 4;
/// The schema a compaction needs stamped before its rows are written (see the module doc).
pub const STAMPED_BY_COMPACTION: u32 = 5;
/// The schema a retention horizon needs stamped before it is written (see the module doc).
pub const STAMPED_BY_HORIZON: u32 = 6;

/// Stamp `version` unless it (or a newer one) is stamped already: before the first rows that a capstore of an older
/// schema would misread are written, so that from then on such a capstore refuses the catalog. Idempotent.
pub async fn stamp_at_least(client: &CatalogClient, tables: &Tables, version: u32) -> Result<(), CatalogError> {
    if stamped_version(client, tables).await? < version {
        stamp(client, tables, version).await?;
    }
    Ok(())
}

async fn stamp(client: &CatalogClient, tables: &Tables, version: u32) -> Result<(), CatalogError> {
    client
        .execute(&format!(
            "INSERT INTO {} (component, version, written_at_ms) SELECT {}, {version}, toUInt64(now()) * 1000",
            tables.schema,
            sql_string_literal("catalog")
        ))
        .await?;
    tracing::info!(database = %tables.database, schema_version = version, "catalog schema stamped");
    Ok(())
}

impl SchemaError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            SchemaError::Catalog(error) => error.kind,
            SchemaError::TooNew { .. } | SchemaError::NotUpgraded { .. } | SchemaError::Repartitioning { .. } => {
                ErrorKind::DefinitelyFailed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_of_system_parts_are_read_as_catalog_and_month() {
        assert_eq!(parse_partition("('edge-7',202611)"), Some(("edge-7", 202611)));
        assert_eq!(parse_partition("('a.b_c', 197001)"), Some(("a.b_c", 197001)));
        for other in ["tuple()", "202611", "('x')", "(x,202611)", "('x',)", ""] {
            assert_eq!(parse_partition(other), None, "{other}");
        }
    }

    #[test]
    fn the_time_table_is_partitioned_ordered_by_time_and_replicated_with_the_others() {
        let single = Tables::new("capstore", "cs", None).time_table_ddl().join("\n");
        assert!(single.contains("CREATE TABLE IF NOT EXISTS capstore.cs_by_time ("), "{single}");
        assert!(single.contains(&format!("ENGINE = ReplacingMergeTree(version) PARTITION BY {PARTITION_BY}")));
        assert!(
            single.contains("ORDER BY (catalog, captured_at_ns, capture_id, stream) SETTINGS index_granularity = 1024")
        );
        assert!(single.contains(
            "CREATE MATERIALIZED VIEW IF NOT EXISTS capstore.cs_by_time_view TO capstore.cs_by_time AS SELECT"
        ));
        assert!(single.contains("FROM capstore.cs_captures"));
        let replicated = Tables::new("capstore", "cs", Some("main")).time_table_ddl().join("\n");
        assert!(replicated.contains("cs_by_time ON CLUSTER main ("), "{replicated}");
        assert!(replicated.contains("ReplicatedReplacingMergeTree("), "{replicated}");
        assert!(replicated.contains("cs_by_time_view ON CLUSTER main TO"), "{replicated}");
    }

    #[test]
    fn single_server_ddl_uses_plain_engines() {
        let tables = Tables::new("capstore", "cs", None);
        let ddl = tables.ddl().join("\n");
        assert!(ddl.contains("CREATE TABLE IF NOT EXISTS capstore.cs_captures ("));
        assert!(ddl.contains(&format!(
            "ENGINE = ReplacingMergeTree(version) PARTITION BY {PARTITION_BY} \
             ORDER BY (catalog, stream, captured_at_ns, capture_id)"
        )));
        for table in [&tables.captures, &tables.by_version, &tables.by_id] {
            let create =
                tables.ddl().into_iter().find(|statement| created_object(statement) == table.as_str()).unwrap();
            assert!(create.contains(&format!("PARTITION BY {PARTITION_BY}")), "{create}");
        }
        assert!(
            ddl.contains("capstore.cs_lease (")
                && ddl.contains("ENGINE = MergeTree() ORDER BY (catalog, term, lease_id)")
        );
        assert!(!ddl.contains("ON CLUSTER") && !ddl.contains("Replicated"));
    }

    #[test]
    fn every_ddl_statement_names_the_object_it_creates() {
        for cluster in [None, Some("main")] {
            let tables = Tables::new("capstore", "cs", cluster);
            let ddl = tables.ddl();
            let created: Vec<&str> = ddl.iter().map(|statement| created_object(statement)).collect();
            assert_eq!(created[0], "capstore");
            assert!(created.contains(&tables.captures.as_str()) && created.contains(&"capstore.cs_by_version_view"));
            assert!(created[1..].iter().all(|name| name.starts_with("capstore.cs_")), "{created:?}");
            let unique: std::collections::HashSet<&&str> = created.iter().collect();
            assert_eq!(unique.len(), ddl.len(), "{created:?}");
            let objects = tables.objects();
            assert_eq!(
                objects.len(),
                ddl.len() + 1,
                "every table and view and by_time's, not the database: {objects:?}"
            );
            assert!(objects.contains(&"cs_by_time".to_string()) && objects.contains(&"cs_by_time_view".to_string()));
            assert!(objects.contains(&"cs_captures".to_string()) && objects.contains(&"cs_watermark_view".to_string()));
        }
    }

    #[test]
    fn cluster_ddl_adds_on_cluster_and_replicated_engines() {
        let tables = Tables::new("capstore", "cs", Some("main"));
        let ddl = tables.ddl();
        assert!(ddl.iter().all(|statement| statement.contains(" ON CLUSTER main")), "{ddl:#?}");
        let joined = ddl.join("\n");
        assert!(joined.contains(
            "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/capstore/cs_captures', '{replica}', version)"
        ));
        assert!(joined
            .contains("ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/capstore/cs_lease', '{replica}')"));
    }
}
