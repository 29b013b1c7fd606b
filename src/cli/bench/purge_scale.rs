//! `capstore bench purge-scale`: deleting the oldest captures of a stream in a large catalog, what a listing of that
//! stream costs before the deletion, after it and after their rows are removed, and the removal itself beside
//! ClickHouse deleting the same rows by their primary-key range, in the same run, on the same server.
//!
//! Each size gets a database of its own (`<catalog.database>_purge_<rows>`), loaded afresh every run like
//! `catalog-scale`'s (the purge changes it). The deletion goes through the [`Publisher`] (fenced publishes of 10,000
//! tombstones), the removal through [`RowPurge`] as the compactor runs it, with no grace. The baseline is
//! `ALTER TABLE ... DELETE` of the same rows of `captures` by (stream, time range), on a copy of the table.
//!
//! Then retention by horizon on the same catalog: a horizon at 2024-01-01 (the catalog's first two of three months,
//! about 78% of its captures) published through the [`Publisher`], the first page of a stream after it, and the
//! months below it dropped through [`RowPurge`] (the check for captures posted again across months that comes first
//! timed apart), beside ClickHouse deleting the same rows of a copy of `captures` by
//! their time range with a mutation (what removing them row by row costs at best), and beside the per-capture
//! deletion those captures would take, at the rate measured above.

use std::time::{Duration, Instant};

use uuid::Uuid;

use capstore::catalog::lease::LeaseKeeper;
use capstore::catalog::publish::{PublishError, Publisher, DELETION_MAX_IDS};
use capstore::catalog::purge::RowPurge;
use capstore::catalog::query::{CatalogReader, ListQuery};
use capstore::catalog::{CatalogClient, Tables};
use capstore::config::Config;

use super::catalog_scale::{load, ScaleRow, CATALOG};

pub struct PurgeScaleOptions {
    pub config: Config,
    pub rows: Vec<u64>,
    /// Captures deleted: the oldest of one stream.
    pub delete: u64,
}

const STREAM: &str = "sensor/7";
/// Where the retention horizon goes: 2024-01-01 UTC, the first two of the synthetic catalog's three months below it.
const HORIZON_NS: u64 = 1_704_067_200_000_000_000;
/// How long a mutation may take before the bench gives up on it.
const MUTATION_TIMEOUT: Duration = Duration::from_secs(3600);

pub async fn purge_scale(options: &PurgeScaleOptions) -> anyhow::Result<Vec<ScaleRow>> {
    let mut results = Vec::new();
    for &rows in &options.rows {
        let mut config = options.config.clone();
        config.catalog.database = format!("{}_purge_{rows}", options.config.catalog.database);
        config.catalog_name = CATALOG.to_string();
        let admin = CatalogClient::connect(&config.catalog).await?;
        admin.execute(&format!("DROP DATABASE IF EXISTS {}", config.catalog.database)).await?;
        let (client, tables) = capstore::catalog::connect(&config).await?;
        load(&client, &tables, rows).await?;
        let mut row = |read: String, capstore_ms: f64, ideal_ms: Option<f64>| {
            eprintln!("purge-scale: {rows} rows, {read}: {capstore_ms:.0} (ideal {ideal_ms:?})");
            results.push(ScaleRow {
                rows,
                read,
                capstore_ms,
                ideal_ms,
                ratio: ideal_ms.map(|ideal| capstore_ms / ideal),
                peak_memory_mib: None,
            });
        };
        let reader = CatalogReader::new(client.clone(), tables.clone(), CATALOG);
        let ideal_page = time(|| async {
            client
                .execute(&format!(
                    "SELECT * FROM {} WHERE catalog = '{CATALOG}' AND stream = '{STREAM}' ORDER BY captured_at_ns, \
                     capture_id LIMIT 100 FORMAT Null",
                    tables.captures
                ))
                .await
                .map_err(Into::into)
        })
        .await?;
        let (before, pages) = first_live_page(&reader).await?;
        row(format!("first 100 live of a stream, before ({pages} pages)"), before, Some(ideal_page));

        // The oldest `delete` captures of the stream, as a listing gives them.
        let mut doomed: Vec<Uuid> = Vec::new();
        let mut query = ListQuery { stream: Some(STREAM.into()), limit: 10_000, ..ListQuery::default() };
        while (doomed.len() as u64) < options.delete {
            let page = reader.list(&query).await?;
            doomed.extend(page.captures.iter().filter_map(|capture| Uuid::parse_str(&capture.capture_id).ok()));
            match page.next_cursor {
                Some(cursor) => query.cursor = Some(cursor),
                None => break,
            }
        }
        doomed.truncate(options.delete as usize);
        let deleted = doomed.len() as u64;
        let last_deleted = reader.get(*doomed.last().expect("a capture to delete"), None).await?.expect("listed");

        let keeper = LeaseKeeper::for_catalog(&client, &tables, &config, Uuid::new_v4());
        let (_shutdown_tx, mut shutdown_rx) = tokio::sync::watch::channel(false);

        let lease = keeper.start(config.start_wait(), &mut shutdown_rx).await?;
        let publisher = Publisher::new(client.clone(), tables.clone(), CATALOG, lease.handle().clone());
        let started = Instant::now();
        for chunk in doomed.chunks(DELETION_MAX_IDS) {
            loop {
                match publisher.publish_deletions(chunk, None).await {
                    Err(PublishError::NotCommitted | PublishError::NoLease) => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    other => {
                        let report = other?;
                        anyhow::ensure!(report.deleted.len() == chunk.len(), "deleted {}", report.deleted.len());
                        break;
                    }
                }
            }
        }
        let deleting_ms = started.elapsed().as_secs_f64() * 1000.0;
        lease.stop().await;
        row(format!("delete {deleted} (fenced publishes of {DELETION_MAX_IDS}), ms"), deleting_ms, None);
        let (after_delete, pages) = first_live_page(&reader).await?;
        row(format!("first 100 live, {deleted} deleted before them ({pages} pages)"), after_delete, Some(ideal_page));

        // The baseline's table: a copy of `captures` as it is now, the deleted rows still in it.
        let copy = format!("{}_copy", tables.captures);
        client.execute(&format!("DROP TABLE IF EXISTS {copy}")).await?;
        client.execute(&format!("CREATE TABLE {copy} AS {}", tables.captures)).await?;
        client
            .execute_with_timeout(&format!("INSERT INTO {copy} SELECT * FROM {}", tables.captures), MUTATION_TIMEOUT)
            .await?;

        let purge = RowPurge::new(client.clone(), tables.clone(), CATALOG);
        let started = Instant::now();
        let (mut through, mut purged, mut batches, mut finding) = (0, 0, 0, Duration::ZERO);
        loop {
            let looking = Instant::now();
            let Some(batch) = purge.next_batch(through, u64::MAX, Duration::ZERO).await? else { break };
            finding += looking.elapsed();
            purge.remove(&batch, || {}).await?;
            (through, purged, batches) = (batch.through, purged + batch.captures.len() as u64, batches + 1);
        }
        let sent_ms = started.elapsed().as_secs_f64() * 1000.0;
        anyhow::ensure!(purged == deleted, "{purged} captures purged of {deleted}");
        let done = mutations_done(&client, &tables, &tables.row_tables(client.server_version()), started).await?;
        let all_done_ms = started.elapsed().as_secs_f64() * 1000.0;
        row(format!("row removal of {deleted}: batches found ({batches}), ms"), finding.as_secs_f64() * 1000.0, None);
        row(format!("row removal of {deleted}: found and statements sent, ms"), sent_ms, None);

        // The baseline: ClickHouse deleting the same rows of the copy by their primary-key range.
        let started = Instant::now();
        client
            .execute(&format!(
                "ALTER TABLE {copy} DELETE WHERE catalog = '{CATALOG}' AND stream = '{STREAM}' AND captured_at_ns <= {}",
                last_deleted.captured_at_ns
            ))
            .await?;
        let ideal_ms = mutations_done(&client, &tables, &[&copy], started).await?[0];
        client.execute(&format!("DROP TABLE IF EXISTS {copy}")).await?;
        row("row removal: captures' mutation done, ms (ideal: by key range)".to_string(), done[0], Some(ideal_ms));
        row("row removal: every table's mutations done, ms".to_string(), all_done_ms, None);
        let (after_purge, pages) = first_live_page(&reader).await?;
        row(format!("first 100 live, after the row removal ({pages} pages)"), after_purge, Some(ideal_page));

        // Retention by horizon.
        let below = client
            .fetch_count(&format!("SELECT count() FROM {} WHERE captured_at_ns < {HORIZON_NS}", tables.captures))
            .await?;
        client.execute(&format!("DROP TABLE IF EXISTS {copy}")).await?;
        client.execute(&format!("CREATE TABLE {copy} AS {}", tables.captures)).await?;
        client
            .execute_with_timeout(&format!("INSERT INTO {copy} SELECT * FROM {}", tables.captures), MUTATION_TIMEOUT)
            .await?;
        let keeper = LeaseKeeper::for_catalog(&client, &tables, &config, Uuid::new_v4());
        let lease = keeper.start(config.start_wait(), &mut shutdown_rx).await?;
        let publisher = Publisher::new(client.clone(), tables.clone(), CATALOG, lease.handle().clone());
        let started = Instant::now();
        loop {
            match publisher.publish_horizon(HORIZON_NS).await {
                Err(PublishError::NotCommitted | PublishError::NoLease) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                other => {
                    anyhow::ensure!(other?.is_some(), "the horizon was published");
                    break;
                }
            }
        }
        row(format!("horizon over {below} captures: published, ms"), started.elapsed().as_secs_f64() * 1000.0, None);
        lease.stop().await;
        let ideal_after = time(|| async {
            client
                .execute(&format!(
                    "SELECT * FROM {} WHERE catalog = '{CATALOG}' AND stream = '{STREAM}' AND captured_at_ns >= \
                     {HORIZON_NS} ORDER BY captured_at_ns, capture_id LIMIT 100 FORMAT Null",
                    tables.captures
                ))
                .await
                .map_err(Into::into)
        })
        .await?;
        let (after_horizon, pages) = first_live_page(&reader).await?;
        row(format!("first 100 live, after the horizon ({pages} pages)"), after_horizon, Some(ideal_after));
        let purge = RowPurge::new(client.clone(), tables.clone(), CATALOG).partitioned(true);
        let (_, month) = purge.due_horizon(Duration::ZERO).await?;
        // The check a pass makes before it drops anything (it groups the whole `by_id`), timed apart from the drop.
        let started = Instant::now();
        anyhow::ensure!(purge.superseded_across(month, 0).await?.is_empty(), "no capture posted again across months");
        let check_ms = started.elapsed().as_secs_f64() * 1000.0;
        row("check before the drop: captures posted again across months, ms".to_string(), check_ms, None);
        let started = Instant::now();
        let (dropped, drops) =
            purge.drop_partitions(&purge.months_before(month).await?, Duration::from_secs(60), |_| true).await;
        drops?;
        let drop_ms = started.elapsed().as_secs_f64() * 1000.0;
        let left = client
            .fetch_count(&format!("SELECT count() FROM {} WHERE captured_at_ns < {HORIZON_NS}", tables.captures))
            .await?;
        anyhow::ensure!(dropped > 0 && left == 0, "{dropped} partitions dropped, {left} rows left below the horizon");
        let started = Instant::now();
        client
            .execute(&format!(
                "ALTER TABLE {copy} DELETE WHERE catalog = '{CATALOG}' AND captured_at_ns < {HORIZON_NS}"
            ))
            .await?;
        let mutation_ms = mutations_done(&client, &tables, &[&copy], started).await?[0];
        client.execute(&format!("DROP TABLE IF EXISTS {copy}")).await?;
        row(
            format!("the {below} captures below it dropped ({dropped} partitions, 3 tables), ms (vs: one mutation of captures by time range)"),
            drop_ms,
            Some(mutation_ms),
        );
        row(
            format!(
                "per-capture deletion of those {below}, ms (extrapolated from the {deleted} above; no row removal)"
            ),
            deleting_ms / deleted as f64 * below as f64,
            None,
        );
        let (after_drop, pages) = first_live_page(&reader).await?;
        row(format!("first 100 live, after the drop ({pages} pages)"), after_drop, Some(ideal_after));
        admin.execute(&format!("DROP DATABASE IF EXISTS {}", config.catalog.database)).await?;
    }
    Ok(results)
}

/// The milliseconds until the stream's first 100 live captures are listed, paging as a client does, and the pages.
async fn first_live_page(reader: &CatalogReader) -> anyhow::Result<(f64, u64)> {
    let started = Instant::now();
    let mut query = ListQuery { stream: Some(STREAM.into()), limit: 100, ..ListQuery::default() };
    let (mut listed, mut pages) = (0, 0);
    while listed < 100 {
        let page = reader.list(&query).await?;
        listed += page.captures.len();
        pages += 1;
        match page.next_cursor {
            Some(cursor) => query.cursor = Some(cursor),
            None => break,
        }
    }
    Ok((started.elapsed().as_secs_f64() * 1000.0, pages))
}

async fn time<F, Fut>(mut run: F) -> anyhow::Result<f64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut runs = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        run().await?;
        runs.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(super::median(&mut runs))
}

/// Waits until no mutation of each of `tables` is running; the milliseconds from `started` each took to get there.
async fn mutations_done(
    client: &CatalogClient,
    all: &Tables,
    tables: &[&String],
    started: Instant,
) -> anyhow::Result<Vec<f64>> {
    let mut done = vec![None; tables.len()];
    while done.iter().any(Option::is_none) {
        anyhow::ensure!(started.elapsed() < MUTATION_TIMEOUT, "mutations still running after {MUTATION_TIMEOUT:?}");
        for (index, table) in tables.iter().enumerate() {
            if done[index].is_some() {
                continue;
            }
            let name = table.rsplit('.').next().unwrap_or_default();
            let unfinished = client
                .fetch_count(&format!(
                    "SELECT count() FROM system.mutations WHERE database = '{}' AND table = '{name}' AND is_done = 0",
                    all.database
                ))
                .await?;
            if unfinished == 0 {
                done[index] = Some(started.elapsed().as_secs_f64() * 1000.0);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(done.into_iter().map(|ms| ms.unwrap_or_default()).collect())
}
