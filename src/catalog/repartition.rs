//! `capstore repartition`: moving the tables of a catalog created before schema 6 onto tables partitioned by catalog
//! and month ([`super::schema::PARTITION_BY`]), so that retention horizons can drop whole months of them.
//!
//! ClickHouse cannot change how a table is partitioned, so `captures`, `by_version` and `by_id` are copied into new
//! tables on the server and swapped in, while nothing writes: the command refuses while any catalog of the tables
//! holds a live lease or a mutation of them (or of `by_time`, which is partitioned from the first and stays) is still
//! running (a row removal a daemon began before it stopped: its
//! rows would reach the copies, where no later removal finds them again), and marks the tables as being
//! repartitioned for its whole run (a `repartition` row in `schema`), which every daemon start and every reader
//! refuses with a message naming the command. `by_id` is
//! written from `by_version` (every row of `by_id` is a row of `by_version` by id), which gives each row its
//! `captured_at_ns`. States, each found again by a run that follows a crash:
//! - *unpartitioned*: the tables as an older capstore created them.
//! - *marked*: the mark is odd (a counter in `schema`, moved on by each start and end of a run), the catalog is
//!   stamped 6 (a capstore older than that is refused), and no lease can be claimed (the claim's statement requires
//!   an even mark); copies `<table>_partitioned` may exist, whole or in part: a run drops and writes them again.
//! - *copied*: every copy is whole and no lease was claimed or renewed since the mark (every catalog's head term is
//!   what it was before; else the run stops, drops its copies and closes the mark: a daemon that started in
//!   between may have written to the old tables). Then the views on
//!   `captures` are dropped and each table is renamed to `<table>_unpartitioned` and its copy to its name, one
//!   statement per table; a table whose name holds a partitioned table already is done.
//! - *done*: the views are created again on the new tables (the view into `by_id` made again if a capstore older
//!   than schema 6 made its own meanwhile) and the mark is closed. The old tables stay, for the operator to drop.
//!
//! Tables of a cluster (`catalog.cluster`) are refused: a replicated table keeps the ZooKeeper path of the name it
//! was created with, so a renamed one would collide with the next replica that creates the name.

use std::time::Duration;

use super::client::{sql_string_literal, CatalogClient, CatalogError};
use super::lease::server_now_ms_expr;
use super::schema::{
    by_id_view_writes_time, create_missing, create_time_table, created_object, ensure_schema, ensure_server_indexes,
    partitioned, repartition_under_way, stamp_at_least, SchemaError, Tables, CAPTURE_COLUMNS, REPARTITION_COMPONENT,
    STAMPED_BY_HORIZON,
};

/// How long one copy statement may run: it copies a whole table on the server (about 4 s per million rows here).
const COPY_TIMEOUT: Duration = Duration::from_secs(6 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum RepartitionError {
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("catalog.cluster is set: replicated tables cannot be renamed safely; create a new database instead")]
    Replicated,
    #[error("catalog {0} holds a live lease: stop every daemon of these tables first (see `capstore lease show`)")]
    LeaseLive(String),
    #[error(
        "mutations of these tables are still running ({0}): nothing was done; run `capstore repartition` again once \
         system.mutations shows them done (one that fails is retried by the server until it is killed)"
    )]
    MutationsRunning(String),
    #[error(
        "a lease was claimed in these tables while they were copied (catalog {0}): nothing was swapped; stop every \
         daemon of these tables and run `capstore repartition` again"
    )]
    ClaimedMeanwhile(String),
}

/// What a run found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RepartitionReport {
    /// The tables were partitioned already: nothing was done.
    pub already: bool,
    /// Rows copied into the new tables, per table.
    pub copied: Vec<(String, u64)>,
    /// The old tables, kept under these names.
    pub kept_as: Vec<String>,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct CatalogRow {
    catalog: String,
}

/// Repartition the tables of `tables` (see the module doc). `progress` is told each step.
pub async fn repartition(
    client: &CatalogClient,
    tables: &Tables,
    progress: &dyn Fn(&str),
) -> Result<RepartitionReport, RepartitionError> {
    if tables.is_replicated() {
        return Err(RepartitionError::Replicated);
    }
    // Created (a first start) or upgraded as far as a start does: `by_id` has its time column.
    if !repartition_under_way(client, tables).await? {
        ensure_schema(client, tables).await?;
        if partitioned(client, tables).await? {
            return Ok(RepartitionReport { already: true, ..RepartitionReport::default() });
        }
    }
    // Heads first: a claim after this read, live now or later, changes them.
    let heads_before = lease_heads(client, tables).await?;
    if let Some(catalog) = live_leases(client, tables).await?.into_iter().next() {
        return Err(RepartitionError::LeaseLive(catalog));
    }
    // A row removal still running (a purge a daemon began before it stopped) would leave in the copies rows it was
    // to remove, which no later purge finds again: they go first.
    let running = super::purge::unfinished_mutations(client, tables).await?;
    if !running.is_empty() {
        return Err(RepartitionError::MutationsRunning(running.join(", ")));
    }
    set_mark(client, tables, true).await?;
    // From here on a capstore of schema 5 (which would write `by_id` rows with no time) is kept out.
    stamp_at_least(client, tables, STAMPED_BY_HORIZON).await?;
    let mut report = RepartitionReport::default();
    let names = [&tables.captures, &tables.by_version, &tables.by_id];
    // Copies, `by_version` before `by_id` (which is written from it).
    for table in names {
        if is_partitioned(client, table).await? {
            continue;
        }
        let copy = format!("{table}_partitioned");
        progress(&format!("copying {table} into {copy}"));
        client.execute(&format!("DROP TABLE IF EXISTS {copy}")).await?;
        client.execute(&create_statement(tables, table, &copy)).await?;
        client.execute_with_timeout(&copy_statement(tables, table, &copy), COPY_TIMEOUT).await?;
        report.copied.push((table.clone(), client.fetch_count(&format!("SELECT count() FROM {copy}")).await?));
    }
    let heads_after = lease_heads(client, tables).await?;
    if let Some((catalog, _)) = heads_after.iter().find(|head| !heads_before.contains(head)) {
        for table in names {
            client.execute(&format!("DROP TABLE IF EXISTS {table}_partitioned")).await?;
        }
        set_mark(client, tables, false).await?;
        return Err(RepartitionError::ClaimedMeanwhile(catalog.clone()));
    }
    progress("swapping the tables");
    for target in [&tables.by_version, &tables.by_id, &tables.time_bounds, &tables.by_time] {
        client.execute(&format!("DROP TABLE IF EXISTS {target}_view")).await?;
    }
    for table in names {
        if is_partitioned(client, table).await? {
            continue;
        }
        let kept = format!("{table}_unpartitioned");
        client.execute(&format!("RENAME TABLE {table} TO {kept}, {table}_partitioned TO {table}")).await?;
        crate::failpoint::hit("repartition_after_a_rename");
        report.kept_as.push(kept);
    }
    create_missing(client, tables).await?;
    if !by_id_view_writes_time(client, tables).await? {
        // Made meanwhile by a capstore older than this (it creates what it finds missing before it reads the
        // stamp): made again, while nothing writes.
        client.execute(&format!("DROP TABLE IF EXISTS {}_view", tables.by_id)).await?;
        create_missing(client, tables).await?;
    }
    // The new tables are made with the common DDL: the server's own indexes take an ALTER. `by_time` (partitioned
    // from the first, and holding every row already) gets its view on the new `captures` again.
    ensure_server_indexes(client, tables).await?;
    if client.server_version().keeps_time_table() {
        create_time_table(client, tables).await?;
    }
    set_mark(client, tables, false).await?;
    progress("done");
    Ok(report)
}

/// The `CREATE TABLE` of `table` as this capstore creates it (partitioned), named `name`.
fn create_statement(tables: &Tables, table: &str, name: &str) -> String {
    let create = tables
        .ddl()
        .into_iter()
        .find(|statement| created_object(statement) == table)
        .expect("every catalog table has its DDL");
    create.replacen(&format!(" IF NOT EXISTS {table} "), &format!(" IF NOT EXISTS {name} "), 1)
}

/// Copy every row of `table` into `copy`; `by_id`'s from `by_version`, with their times.
fn copy_statement(tables: &Tables, table: &str, copy: &str) -> String {
    if table == tables.by_id {
        format!(
            "INSERT INTO {copy} (catalog, capture_id, version, publish_id, captured_at_ns) SELECT catalog, \
             UUIDStringToNum(capture_id), version, UUIDStringToNum(publish_id), captured_at_ns FROM {}",
            tables.by_version
        )
    } else {
        format!("INSERT INTO {copy} ({CAPTURE_COLUMNS}) SELECT {CAPTURE_COLUMNS} FROM {table}")
    }
}

async fn is_partitioned(client: &CatalogClient, table: &str) -> Result<bool, CatalogError> {
    let (database, name) = table.split_once('.').unwrap_or_default();
    client
        .fetch_count(&format!(
            "SELECT count() FROM system.tables WHERE database = {} AND name = {} AND \
             partition_key LIKE '%captured_at_ns%'",
            sql_string_literal(database),
            sql_string_literal(name)
        ))
        .await
        .map(|tables| tables > 0)
}

/// Move the mark (a counter, odd while a run is under way) on to the next number that says `under_way`, unless it
/// says so already (a run that follows a crash goes on under the same number).
async fn set_mark(client: &CatalogClient, tables: &Tables, under_way: bool) -> Result<(), CatalogError> {
    let component = sql_string_literal(REPARTITION_COMPONENT);
    let newest = client
        .fetch_count(&format!("SELECT max(version) FROM {} WHERE component = {component}", tables.schema))
        .await?;
    if (newest % 2 == 1) == under_way {
        return Ok(());
    }
    client
        .execute(&format!(
            "INSERT INTO {} (component, version, written_at_ms) SELECT {component}, {}, {}",
            tables.schema,
            newest + 1,
            server_now_ms_expr(client)
        ))
        .await
}

/// The catalogs whose head lease is live now (server time).
async fn live_leases(client: &CatalogClient, tables: &Tables) -> Result<Vec<String>, CatalogError> {
    client
        .fetch_all::<CatalogRow>(&format!(
            "SELECT catalog FROM (SELECT catalog, term, min(expires_at_ms) AS expiry FROM {lease} WHERE \
             (catalog, term) IN (SELECT catalog, max(term) FROM {lease} GROUP BY catalog) GROUP BY catalog, term) \
             WHERE expiry > {now}",
            lease = tables.lease,
            now = server_now_ms_expr(client),
        ))
        .await
        .map(|rows| rows.into_iter().map(|row| row.catalog).collect())
}

/// Each catalog's head term (every claim and renewal writes a new one): a claim made meanwhile changes them.
async fn lease_heads(client: &CatalogClient, tables: &Tables) -> Result<Vec<(String, u64)>, CatalogError> {
    #[derive(clickhouse::Row, serde::Deserialize)]
    struct Head {
        catalog: String,
        head: u64,
    }
    let heads: Vec<Head> = client
        .fetch_all(&format!(
            "SELECT catalog, max(term) AS head FROM {} GROUP BY catalog ORDER BY catalog",
            tables.lease
        ))
        .await?;
    Ok(heads.into_iter().map(|head| (head.catalog, head.head)).collect())
}
