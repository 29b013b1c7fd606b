//! Row removal: the catalog rows of deleted captures, removed from the tables once nothing may read them.
//!
//! A deletion only adds a row (a tombstone, see [`super::query`]): the deleted capture's rows stay in `captures`,
//! `by_version`, `by_id` (and `by_time`, see [`super::schema::ensure_time_table`]), hidden from every reader pinned at
//! or above the tombstone, and a listing still reads past them. Once the deletion is older than `lifecycle.read_grace`
//! (no reader may be pinned below it any more) and its bytes are erased (the compactor calls this only then), those
//! rows are removed with `ALTER ... DELETE`.
//!
//! States of a deleted capture X here, by its rows in `by_id`:
//! - *deleted*: X's newest row is a committed tombstone at version t, and rows below t remain (a post, moves,
//!   earlier tombstones);
//! - *purged*: only the tombstone at t remains (in `by_version` and `by_id`: `tail` still delivers the deletion and
//!   `get` still answers "deleted"); X has no row in `captures`, so listings never meet it again.
//!
//! A batch is a run of committed publishes of no pack (deletions and moves), in version order, each older than the
//! grace by the server's clock; it stops at the first one that is not (so a clock stepping back cannot skip one).
//! Its captures are the ids whose newest row in `by_id` (of any version, committed or not) is one of the batch's
//! tombstones and which still have a row at another version. Their rows below their own tombstone's version are
//! removed with one mutation per table, in the order `captures`, `by_time` (where the server keeps it, see
//! [`super::schema::ensure_time_table`]), `by_version`, `by_id`: the last is the one a batch
//! is found by, so a crash between the statements finds the same captures again and removes what is left.
//! Invariants: a row is removed only if a committed tombstone newer than it, the capture's newest row, hides it from
//! every reader pinned in the last `read_grace`; the tombstone itself is never removed, nor anything at or above
//! it: a capture posted again after its deletion is not touched (its newest row is no tombstone), and neither is a
//! row written after the statement was sent, or one a lagging replica had not shown the batch's read.
//!
//! Each statement names its ids as literals, with no subquery: ClickHouse 18.16 fails a mutation whose condition
//! nests subqueries, and newer servers refuse non-deterministic mutations on replicated tables. Mutations run in the
//! background on the server; a batch is not started while one on these tables is still running, so they never pile
//! up.
//!
//! *Months below a retention horizon* (see [`super::query`]) go whole, with `ALTER TABLE ... DROP PARTITION` on
//! tables partitioned by catalog and month ([`super::schema::PARTITION_BY`]): a metadata change that costs the same
//! at any size, where a mutation rewrites every part of the table (18.16 rewrites them all, whatever they hold). A
//! month of a catalog is dropped from `captures`, `by_version`, `by_id` and `by_time` once it lies wholly below a committed
//! horizon whose publish is older than `read_grace`: every row in it is hidden from every reader that may still be
//! reading, whatever its kind (a capture, a deletion, a move, an orphan), and a row published into it later (a late
//! arrival) is hidden from the start and dropped by the next pass. Partitions are found in `system.parts`, so a
//! pass that dropped some and died before the others drops the rest next time.
//!
//! *A drop takes no condition*, so no fence guards it, and no server bounds how long it runs (18.16 waits on a table
//! lock for good, 26.x for running merges to stop). So:
//! - the compactor drops in the publish turn, and checks the lease before each drop;
//! - a drop whose outcome is unknown keeps the turn until the server it went to runs it no longer
//!   ([`CatalogClient::execute_to_its_end`]): a drop that waited on a table lock past its client's timeout must not
//!   take the rows of a publish let in after it;
//! - a drop that may run without anyone waiting for it (one cut off by the shutdown's abort, one whose server could
//!   not say for a TTL, one of an earlier holder killed mid-drop) is found by its text in every server's
//!   `system.processes` before the next publish ([`wait_until_no_drop_runs`], from the publish turn: at start, after a
//!   takeover, after a drop of ours cut off or given up). A server that cannot say is passed over at start and after
//!   a takeover, with a WARN, and quarantines the lease after one of ours.
//!
//! Every read of the catalog's tables here, the checks before a drop among them, is sequentially consistent on a
//! replicated catalog ([`RowPurge::new`]): a replica that lags would answer without a committed post again that the
//! drop must not take. (`system.parts` and `system.mutations` are the replica's own: one that lags lists fewer months
//! to drop, which is safe.)
//!
//! A removal is not a publish: it takes no version and carries no fence. Only the lease holder runs it (the
//! compactor's passes need a publish permit), but a stale process that ran it anyway would remove only rows that a
//! committed tombstone already hides from every reader, and removing them twice is removing nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use super::client::{sql_string_literal, CatalogClient, CatalogError, UnendedError};
use super::lease::server_now_ms_expr;
use super::schema::{parse_partition, Tables};

/// The statement that drops `catalog`'s `month` from `table`.
fn drop_statement(tables: &Tables, catalog: &str, table: &str, month: u32) -> String {
    let (table_part, partition_part) = drop_statement_parts(tables, catalog);
    format!("{table_part}{table}{partition_part}{month})")
}

/// The text every [`drop_statement`] of `catalog` holds, before and after its table's name.
fn drop_statement_parts(tables: &Tables, catalog: &str) -> (String, String) {
    (format!("ALTER TABLE {}.", tables.database), format!(" DROP PARTITION ({}, ", sql_string_literal(catalog)))
}

/// Wait until no server of the catalog runs a drop of `catalog`'s months ([`drop_statement`], sent by any process),
/// as [`CatalogClient::wait_until_none_runs`] does: false once the servers have not been able to say for
/// `tell_within`. A publish waits for this where a drop may still run ([`super::publish::Publisher`]'s turn): no fence
/// guards one.
pub async fn wait_until_no_drop_runs(
    client: &CatalogClient,
    tables: &Tables,
    catalog: &str,
    tell_within: Duration,
) -> bool {
    let (table_part, partition_part) = drop_statement_parts(tables, catalog);
    // (This question's own text holds the second only with its quotes escaped, and names `system.processes`.)
    let condition = format!(
        "position(query, {}) > 0 AND position(query, {}) > 0 AND position(query, 'system.processes') = 0",
        sql_string_literal(&table_part),
        sql_string_literal(&partition_part)
    );
    client.wait_until_none_runs(&condition, tell_within).await
}

/// The mutations of `captures`, `by_version`, `by_id` or `by_time` (of any catalog sharing them) still running, each as
/// `table mutation_id`. A mutation that fails is retried by the server until it is killed (18.16 cannot kill one).
pub async fn unfinished_mutations(client: &CatalogClient, tables: &Tables) -> Result<Vec<String>, CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Unfinished {
        mutation: String,
    }
    let rows: Vec<Unfinished> = client
        .fetch_all(&format!(
            "SELECT concat(table, ' ', mutation_id) AS mutation FROM system.mutations WHERE database = {} AND \
             table IN ({}) AND is_done = 0 ORDER BY table, mutation_id",
            sql_string_literal(&tables.database),
            tables.row_table_names(client.server_version())
        ))
        .await?;
    Ok(rows.into_iter().map(|row| row.mutation).collect())
}

/// Publishes of no pack per batch at most (their versions are a literal list of the batch's statements).
const PUBLISHES_PER_BATCH: u64 = 5_000;
/// Captures per batch at most (a deletion publish holds up to 10,000, so a batch is one publish at least). Each
/// batch is one mutation per table, and a mutation rewrites every part holding one of its rows: the fewer batches,
/// the fewer rewrites (retention deletes old captures, which lie in the same few large parts). A statement names
/// each capture as a 40-character literal, plus about 40 characters per distinct tombstone version: 100,000 make
/// about 4 MB.
pub const CAPTURES_PER_BATCH: u64 = 100_000;
/// With replicated tables a mutation's command is a ZooKeeper node, 1 MB at most by default: 10,000 captures of as
/// many publishes make about 800 KB.
pub const CAPTURES_PER_REPLICATED_BATCH: u64 = 10_000;
/// The statements are larger than the server's default `max_query_size` (256 KiB).
const MAX_STATEMENT_BYTES: usize = 8 << 20;
/// How long a statement's answer may take: a server answers an `ALTER ... DELETE` once the mutation is made, but
/// clickhouse-local (chDB) only once it has run (measured: 47 s for 50,000 captures in a catalog of 10 M).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(600);

/// One batch: the deleted captures whose rows go, and the version a next batch starts after.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PurgeBatch {
    /// The last version the batch looked at: the next batch starts after it.
    pub through: u64,
    /// Each deleted capture with rows left, and the version of its tombstone (its newest row).
    pub captures: Vec<(String, u64)>,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct CandidateRow {
    version: u64,
    captures: u64,
    due: u8,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct DeadRow {
    capture_id: String,
    version: u64,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct PartitionRow {
    table: String,
    partition: String,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct DueRow {
    before_ns: u64,
    month: u32,
}

#[derive(Clone)]
pub struct RowPurge {
    client: CatalogClient,
    tables: Tables,
    catalog: String,
    /// The tables are partitioned by month ([`super::schema::partitioned`]): months below a horizon can be dropped.
    partitioned: bool,
}

/// Bytes of a grouping past which [`RowPurge::superseded_across`] spills to disk (reads are capped at
/// `catalog.read_max_memory`, 1 GiB by default).
const SPILL_BYTES: u64 = 256 << 20;

/// The first nanosecond of the UTC month `YYYYMM` (0 for a month that is no date: none comes from a partition).
fn month_start_ns(month: u32) -> u64 {
    let first = format!("{:04}-{:02}-01T00:00:00Z", month / 100, month % 100);
    humantime::parse_rfc3339(&first)
        .ok()
        .and_then(|at| at.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |since| u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
}

impl RowPurge {
    /// Every read of it is sequentially consistent on a replicated catalog
    /// ([`CatalogClient::with_consistent_reads`]): what it finds is removed or dropped for good.
    pub fn new(client: CatalogClient, tables: Tables, catalog: &str) -> RowPurge {
        RowPurge { client: client.with_consistent_reads(), tables, catalog: catalog.to_string(), partitioned: false }
    }

    /// The highest committed version, read as every read of the purge is (see [`RowPurge::new`]).
    pub async fn watermark(&self) -> Result<u64, CatalogError> {
        super::query::CatalogReader::new(self.client.clone(), self.tables.clone(), &self.catalog).watermark().await
    }

    /// The same, for tables that are (or are not) partitioned by month.
    pub fn partitioned(mut self, partitioned: bool) -> RowPurge {
        self.partitioned = partitioned;
        self
    }

    /// Whether months below a horizon can be dropped from these tables.
    pub fn drops_months(&self) -> bool {
        self.partitioned
    }

    /// The newest committed retention horizon whose publish is older than `grace` (server time), as `before_ns`
    /// and the `YYYYMM` month it falls in (by [`super::schema::PARTITION_BY`]'s own expression); `(0, 0)` when
    /// there is none. Sequentially consistent on a cluster: what it allows is dropped.
    pub async fn due_horizon(&self, grace: Duration) -> Result<(u64, u32), CatalogError> {
        let catalog = sql_string_literal(&self.catalog);
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        let rows: Vec<DueRow> = self
            .client
            .fetch_all_deciding(&format!(
                "SELECT before_ns, toYYYYMM(toDateTime(least(intDiv(before_ns, 1000000000), 4102444799), 'UTC')) \
                 AS month FROM (SELECT max(before_ns) AS before_ns FROM {horizons} WHERE catalog = {catalog} AND \
                 (version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND \
                 published_at_ms + {grace_ms} <= {now} AND version IN (SELECT version FROM {horizons} WHERE \
                 catalog = {catalog})))",
                horizons = self.tables.horizons,
                publishes = self.tables.publishes,
                now = server_now_ms_expr(&self.client),
            ))
            .await?;
        Ok(rows.first().filter(|row| row.before_ns > 0).map_or((0, 0), |row| (row.before_ns, row.month)))
    }

    /// This catalog's partitions (table name, month) of months before `month` (`YYYYMM`, the month of a due horizon:
    /// the months before it lie wholly below the horizon) in the tables of a row per capture
    /// ([`Tables::row_table_names`]), from `system.parts`.
    pub async fn months_before(&self, month: u32) -> Result<Vec<(String, u32)>, CatalogError> {
        let parts: Vec<PartitionRow> = self
            .client
            .fetch_all(&format!(
                "SELECT DISTINCT table, partition FROM system.parts WHERE database = {} AND table IN ({}) AND active \
                 ORDER BY table, partition",
                sql_string_literal(&self.tables.database),
                self.tables.row_table_names(self.client.server_version())
            ))
            .await?;
        Ok(parts
            .iter()
            .filter_map(|part| {
                let (catalog, part_month) = parse_partition(&part.partition)?;
                (catalog == self.catalog && part_month < month).then(|| (part.table.clone(), part_month))
            })
            .collect())
    }

    /// The captures whose newest committed row lies in a month before `month` while an older row of theirs lies in
    /// it or after (a capture posted again with an earlier time, in another month), each with that newest row's
    /// version: dropping the months before `month` would leave the older row as the newest, and bring the capture
    /// back. Their rows below the newest are removed first ([`RowPurge::remove`]). One pass over the catalog's
    /// `by_id` grouped by id (spilling to disk past 256 MiB), whose few candidates are checked against their
    /// committed rows.
    ///
    /// With `published_after` (a watermark at which the same check for the same `month` found none), only the
    /// captures with a row above it are looked at, by primary key: a capture none of whose rows is newer than the
    /// last check is as that check found it (a removal takes only rows below a capture's newest, a drop only
    /// captures wholly below the month), so only a publish since can have made one of them.
    pub async fn superseded_across(
        &self,
        month: u32,
        published_after: u64,
    ) -> Result<Vec<(String, u64)>, CatalogError> {
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct Candidate {
            capture_id: String,
        }
        let cut_ns = month_start_ns(month);
        let catalog = sql_string_literal(&self.catalog);
        let since = match published_after {
            0 => String::new(),
            after => format!(
                " AND capture_id IN (SELECT UUIDStringToNum(capture_id) FROM {} WHERE catalog = {catalog} AND \
                 version > {after})",
                self.tables.by_version
            ),
        };
        let candidates: Vec<Candidate> = self
            .client
            .fetch_all_with_timeout(
                &format!(
                    "SELECT id_v AS capture_id FROM (SELECT UUIDNumToString(capture_id) AS id_v, \
                 min(captured_at_ns) AS first_v, max(captured_at_ns) AS last_v, \
                 argMax(captured_at_ns, version) AS newest_v FROM {by_id} WHERE catalog = {catalog}{since} \
                 GROUP BY capture_id) WHERE first_v < {cut_ns} AND last_v >= {cut_ns} AND newest_v < {cut_ns} \
                 SETTINGS max_bytes_before_external_group_by = {SPILL_BYTES}",
                    by_id = self.tables.by_id,
                ),
                STATEMENT_TIMEOUT,
            )
            .await?;
        let ids: Vec<uuid::Uuid> =
            candidates.iter().filter_map(|candidate| uuid::Uuid::parse_str(&candidate.capture_id).ok()).collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let reader = super::query::CatalogReader::new(self.client.clone(), self.tables.clone(), &self.catalog);
        let newest = reader.newest_committed_rows(&ids).await?;
        Ok(newest
            .into_values()
            .filter(|row| row.captured_at_ns < cut_ns)
            .map(|row| (row.capture_id, row.version))
            .collect())
    }

    /// Drop `partitions` ([`RowPurge::months_before`]), one statement each ([`drop_statement`]), each waited for to
    /// its end on the server when its outcome is unknown ([`CatalogClient::execute_to_its_end`], giving up after
    /// `tell_within`): no fence guards a drop. Returns how many were dropped, beside the error that stopped the rest
    /// (a drop whose outcome is unknown is not counted, though it may have run). `go_on(dropped)` runs before each
    /// drop, with how many were dropped so far: false stops the drops there (the lease lost meanwhile).
    pub async fn drop_partitions(
        &self,
        partitions: &[(String, u32)],
        tell_within: Duration,
        go_on: impl Fn(u64) -> bool,
    ) -> (u64, Result<(), UnendedError>) {
        let mut dropped = 0;
        for (table, month) in partitions {
            if !go_on(dropped) {
                break;
            }
            let sql = drop_statement(&self.tables, &self.catalog, table, *month);
            if let Err(error) = self.client.execute_to_its_end(&sql, tell_within).await {
                return (dropped, Err(error));
            }
            tracing::info!(%table, month, "dropped a month below the retention horizon");
            dropped += 1;
        }
        (dropped, Ok(()))
    }

    /// Captures per batch at most: fewer with replicated tables (see [`CAPTURES_PER_REPLICATED_BATCH`]).
    pub fn captures_per_batch(&self) -> u64 {
        if self.tables.is_replicated() {
            CAPTURES_PER_REPLICATED_BATCH
        } else {
            CAPTURES_PER_BATCH
        }
    }

    /// True while a mutation of `captures`, `by_version`, `by_id` or `by_time` (of any catalog sharing them) is still
    /// running.
    pub async fn in_flight(&self) -> Result<bool, CatalogError> {
        Ok(!unfinished_mutations(&self.client, &self.tables).await?.is_empty())
    }

    /// The next batch after version `after`, of publishes up to version `at_most` committed at least `grace` ago
    /// (server time); `None` when there is none. A batch may have no captures (its deletions purged already, or
    /// moves only): it still moves `through` on.
    pub async fn next_batch(
        &self,
        after: u64,
        at_most: u64,
        grace: Duration,
    ) -> Result<Option<PurgeBatch>, CatalogError> {
        let catalog = sql_string_literal(&self.catalog);
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        let candidates: Vec<CandidateRow> = self
            .client
            .fetch_all(&format!(
                "SELECT version, captures, toUInt8(published_at_ms + {grace_ms} <= {now}) AS due FROM {publishes} \
                 WHERE catalog = {catalog} AND version > {after} AND version <= {at_most} AND packs = 0 \
                 ORDER BY version LIMIT {PUBLISHES_PER_BATCH}",
                publishes = self.tables.publishes,
                now = server_now_ms_expr(&self.client),
            ))
            .await?;
        let mut versions = Vec::new();
        let mut captures = 0;
        for candidate in candidates.iter().take_while(|candidate| candidate.due == 1) {
            if !versions.is_empty() && captures + candidate.captures > self.captures_per_batch() {
                break;
            }
            captures += candidate.captures;
            versions.push(candidate.version);
        }
        let Some(&through) = versions.last() else { return Ok(None) };
        let list: Vec<String> = versions.iter().map(u64::to_string).collect();
        let tombstones = format!(
            "{by_version} WHERE catalog = {catalog} AND version IN ({list}) AND pack_id = ''",
            by_version = self.tables.by_version,
            list = list.join(", ")
        );
        let dead: Vec<DeadRow> = self
            .client
            .fetch_all(&format!(
                "SELECT id_v AS capture_id, newest_v AS version FROM (SELECT UUIDNumToString(capture_id) AS id_v, \
                 max(version) AS newest_v, uniqExact(version) AS versions_v FROM {by_id} WHERE catalog = {catalog} \
                 AND capture_id IN (SELECT UUIDStringToNum(capture_id) FROM {tombstones}) GROUP BY capture_id) \
                 WHERE versions_v > 1 AND (id_v, newest_v) IN (SELECT capture_id, version FROM {tombstones} AND \
                 (version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND \
                 version IN ({list}))) ORDER BY capture_id",
                by_id = self.tables.by_id,
                publishes = self.tables.publishes,
                list = list.join(", "),
            ))
            .await?;
        Ok(Some(PurgeBatch { through, captures: dead.into_iter().map(|row| (row.capture_id, row.version)).collect() }))
    }

    /// Remove the rows of `batch`'s captures below their tombstones: one mutation per table, `by_id` last (see the
    /// module doc). `between` runs after the first statement (a failpoint's place).
    pub async fn remove(&self, batch: &PurgeBatch, between: impl Fn()) -> Result<(), CatalogError> {
        if batch.captures.is_empty() {
            return Ok(());
        }
        // Each capture bounded by its own tombstone: a row of it at that version or newer is never named.
        let mut by_tombstone: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
        for (id, version) in &batch.captures {
            by_tombstone.entry(*version).or_default().push(id);
        }
        // Ids as plain text literals everywhere (`by_id`'s 16 bytes compared as text): a list of literals is one
        // element of the syntax tree where a list of calls is three per id, and the server analyses a mutation
        // again in the background with its own limits.
        let rows_below = |id_column: &str| {
            let groups: Vec<String> = by_tombstone
                .iter()
                .map(|(version, ids)| {
                    let ids: Vec<String> = ids.iter().map(|id| sql_string_literal(id)).collect();
                    format!("(version < {version} AND {id_column} IN ({}))", ids.join(", "))
                })
                .collect();
            format!("catalog = {} AND ({})", sql_string_literal(&self.catalog), groups.join(" OR "))
        };
        // `by_id` holds ids as 16 bytes: compared as text, like everywhere else.
        for (index, table) in self.tables.row_tables(self.client.server_version()).into_iter().enumerate() {
            let id_column = if table == &self.tables.by_id { "UUIDNumToString(capture_id)" } else { "capture_id" };
            let statement = format!("ALTER TABLE {table} DELETE WHERE {}", rows_below(id_column));
            self.client.execute_large(&statement, MAX_STATEMENT_BYTES, STATEMENT_TIMEOUT).await?;
            if index == 0 {
                between();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_month_starts_at_its_first_utc_midnight() {
        use super::month_start_ns;
        let second = 1_000_000_000;
        assert_eq!(month_start_ns(197001), 0);
        assert_eq!(month_start_ns(202401), 1_704_067_200 * second);
        assert_eq!(month_start_ns(202403), 1_709_251_200 * second, "after a leap February");
        assert_eq!(month_start_ns(210001), 4_102_444_800 * second);
    }

    #[test]
    fn a_drop_statement_holds_the_text_a_publish_looks_for() {
        use super::{drop_statement, drop_statement_parts};
        let tables = crate::catalog::Tables::from_config(&crate::config::CatalogConfig::default());
        let statement = drop_statement(&tables, "it's", "cs_captures", 202401);
        assert_eq!(statement, format!("ALTER TABLE {}.cs_captures DROP PARTITION ('it\\'s', 202401)", tables.database));
        let (table_part, partition_part) = drop_statement_parts(&tables, "it's");
        assert!(statement.contains(&table_part) && statement.contains(&partition_part), "{statement}");
    }
}
