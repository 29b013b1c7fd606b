//! `capstore bench fleet`: N virtual daemons in one process against one ClickHouse, each with its own lease keeper
//! (claim, renewal every ttl/6) and publisher on a catalog name of its own, publishing a steady trickle of captures
//! into one set of shared tables; beside the same statements as plain inserts (no lease, no fence, no read-back, no
//! views) into copies of the same tables, at the same pace, in the same run.
//!
//! What a fleet costs the server is parts: every INSERT makes one in each table it writes (and in each table a view
//! of it writes), and the server refuses inserts into a table with too many active parts ("too many parts"). So the
//! bench samples the active parts of every table and the merges running, and counts refusals, beside the latencies.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use uuid::Uuid;

use capstore::catalog::lease::LeaseKeeper;
use capstore::catalog::publish::{PublishError, PublishOutcome, Publisher};
use capstore::catalog::{CatalogClient, CatalogError, Tables};
use capstore::config::Config;

use super::catalog::synthetic_pack;

/// ClickHouse's "too many parts" refusal (`parts_to_throw_insert`).
const TOO_MANY_PARTS: u32 = 252;
/// Dropping a database of many thousand parts takes longer than a request.
const SCRATCH_DDL_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the parts and merges of the tables are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);

pub struct FleetBenchOptions {
    pub config: Config,
    pub daemons: Vec<usize>,
    /// How long each fleet size runs (and its baseline as long again).
    pub duration: Duration,
    /// Each virtual daemon publishes once per interval (a daemon's `spool.pack_max_age` under a trickle).
    pub interval: Duration,
    pub captures_per_publish: u64,
}

/// One fleet size: capstore's figures, then the plain-insert baseline's.
#[derive(Debug, Clone, Serialize)]
pub struct FleetBenchRow {
    pub daemons: usize,
    pub seconds: f64,
    pub capstore: LoadFigures,
    pub baseline: LoadFigures,
}

/// What one load did to the server and how long its statements took.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadFigures {
    /// Publishes (capstore) or publish-equivalents (the baseline's three inserts) that committed.
    pub publishes: u64,
    pub publishes_per_s: f64,
    /// INSERT statements the server ran per second (its `InsertQuery` event, views' inserts not counted).
    pub server_inserts_per_s: f64,
    pub publish_p50_ms: f64,
    pub publish_p99_ms: f64,
    /// capstore only: lease renewals and their latency.
    pub renewals: u64,
    pub renew_p50_ms: f64,
    pub renew_p99_ms: f64,
    /// The most active parts one table had at a sample, and which table.
    pub max_active_parts: u64,
    pub max_active_parts_table: String,
    /// Active parts of all the tables at the end.
    pub final_active_parts: u64,
    pub max_merges_running: u64,
    /// Every sample: seconds into the load, the active parts of all tables, of the table with most, merges running.
    pub parts_over_time: Vec<(f64, u64, u64, u64)>,
    /// Inserts refused with "too many parts".
    pub too_many_parts: u64,
    /// Other failed publishes (each retried at the next tick).
    pub failed: u64,
}

pub async fn fleet(options: &FleetBenchOptions) -> anyhow::Result<Vec<FleetBenchRow>> {
    // The baseline's copies (`CREATE TABLE ... AS`) and the scratch drops are single-server statements.
    anyhow::ensure!(
        options.config.catalog.cluster.is_none(),
        "capstore bench fleet measures one server: unset catalog.cluster"
    );
    let mut rows = Vec::new();
    for &daemons in &options.daemons {
        let database = format!("{}_fleet", options.config.catalog.database);
        let mut config = options.config.clone();
        config.catalog.database = database.clone();
        let scratch = CatalogClient::connect(&config.catalog).await?;
        scratch.execute_with_timeout(&format!("DROP DATABASE IF EXISTS {database}"), SCRATCH_DDL_TIMEOUT).await?;
        let (client, tables) = capstore::catalog::connect(&config).await?;
        let plain = PlainTables::create(&client, &tables).await?;
        eprintln!("fleet of {daemons}: capstore for {:?}", options.duration);
        let capstore = run_fleet(&client, &tables, &config, daemons, options).await?;
        // Dropped before the baseline starts, so that the merges capstore's load left behind do not run on the
        // server's cores under the baseline's inserts.
        client.execute_with_timeout(&format!("DROP DATABASE IF EXISTS {database}"), SCRATCH_DDL_TIMEOUT).await?;
        eprintln!("fleet of {daemons}: plain inserts for {:?}", options.duration);
        let baseline = run_baseline(&scratch, &plain, &config, daemons, options).await?;
        let row = FleetBenchRow { daemons, seconds: options.duration.as_secs_f64(), capstore, baseline };
        // On stderr as each size ends, so a later failure does not take the earlier figures with it.
        eprintln!("{}", serde_json::to_string(&row)?);
        rows.push(row);
    }
    Ok(rows)
}

/// Latencies and counts the tasks of one load collect.
#[derive(Default)]
struct Tally {
    publish: Vec<Duration>,
    renew: Vec<Duration>,
    too_many_parts: u64,
    failed: u64,
}

type SharedTally = Arc<Mutex<Tally>>;

fn note_failure(tally: &SharedTally, error: Option<&CatalogError>) {
    let mut tally = tally.lock().unwrap();
    if error.is_some_and(|error| error.server_code == Some(TOO_MANY_PARTS)) {
        tally.too_many_parts += 1;
    } else {
        tally.failed += 1;
    }
}

async fn run_fleet(
    client: &CatalogClient,
    tables: &Tables,
    config: &Config,
    daemons: usize,
    options: &FleetBenchOptions,
) -> anyhow::Result<LoadFigures> {
    let tally = SharedTally::default();
    let mut leases = Vec::new();
    let mut publishers = Vec::new();
    for index in 0..daemons {
        let mut daemon_config = config.clone();
        daemon_config.catalog_name = format!("fleet-{index}");
        let renewals = Arc::clone(&tally);
        let keeper = LeaseKeeper::for_catalog(client, tables, &daemon_config, Uuid::new_v4())
            .observe_renewals(move |took| renewals.lock().unwrap().renew.push(took));
        let (_never, mut shutdown_rx) = tokio::sync::watch::channel(false);
        let lease = keeper.start(daemon_config.start_wait(), &mut shutdown_rx).await?;
        publishers.push(Publisher::new(
            client.clone(),
            tables.clone(),
            &daemon_config.catalog_name,
            lease.handle().clone(),
        ));
        leases.push(lease);
    }
    // Renewals of the start are not part of the steady state.
    tally.lock().unwrap().renew.clear();
    let inserts_before = server_inserts(client).await?;
    let sampler = Sampler::start(client.clone(), tables.database.clone());
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + options.duration;
    let tasks = publishers.into_iter().enumerate().map(|(index, publisher)| {
        let tally = Arc::clone(&tally);
        let (interval, captures) = (options.interval, options.captures_per_publish);
        let first = tokio::time::Instant::now() + interval.mul_f64(index as f64 / daemons as f64);
        async move {
            let mut ticks = tokio::time::interval_at(first, interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                if ticks.tick().await >= deadline {
                    return;
                }
                let pack = synthetic_pack(captures);
                let sent = Instant::now();
                match publisher.publish_batch(std::slice::from_ref(&pack)).await {
                    Ok(PublishOutcome::Committed { .. }) => tally.lock().unwrap().publish.push(sent.elapsed()),
                    Ok(PublishOutcome::AlreadyPublished) => tally.lock().unwrap().failed += 1,
                    Err(PublishError::OutcomeUnknown(error) | PublishError::Catalog(error)) => {
                        note_failure(&tally, Some(&error))
                    }
                    Err(PublishError::NoLease | PublishError::NotCommitted) => note_failure(&tally, None),
                }
            }
        }
    });
    futures::future::join_all(tasks).await;
    let seconds = started.elapsed().as_secs_f64();
    let inserts = server_inserts(client).await? - inserts_before;
    let samples = sampler.stop().await;
    for lease in leases {
        lease.stop().await;
    }
    let final_parts = active_parts(client, &tables.database).await?.values().sum();
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    Ok(figures(tally, seconds, inserts, samples, final_parts))
}

/// Copies of the tables a baseline inserts into, with no views (`CREATE TABLE ... AS`), in a database of their own.
struct PlainTables {
    database: String,
    captures: String,
    packs: String,
    publishes: String,
    lease: String,
}

impl PlainTables {
    async fn create(client: &CatalogClient, tables: &Tables) -> anyhow::Result<PlainTables> {
        let database = format!("{}_plain", tables.database);
        client.execute_with_timeout(&format!("DROP DATABASE IF EXISTS {database}"), SCRATCH_DDL_TIMEOUT).await?;
        client.execute(&format!("CREATE DATABASE {database}")).await?;
        let copy = |table: &str| format!("{database}.{}", table.rsplit('.').next().unwrap_or(table));
        for table in [&tables.captures, &tables.packs, &tables.publishes, &tables.lease] {
            client.execute(&format!("CREATE TABLE {} AS {table}", copy(table))).await?;
        }
        Ok(PlainTables {
            captures: copy(&tables.captures),
            packs: copy(&tables.packs),
            publishes: copy(&tables.publishes),
            lease: copy(&tables.lease),
            database,
        })
    }
}

/// The same statements a fleet's publishes and renewals make, as plain inserts of the same rows into copies of the
/// tables with no views: one INSERT into each of `captures`, `packs` and `publishes` per publish, and one into
/// `lease` per renewal (ttl/6), at the same pace. They go over HTTP from this process: a `clickhouse-client` process
/// per statement would cost more CPU than the server at these rates.
async fn run_baseline(
    client: &CatalogClient,
    plain: &PlainTables,
    config: &Config,
    daemons: usize,
    options: &FleetBenchOptions,
) -> anyhow::Result<LoadFigures> {
    let database = plain.database.clone();
    let (captures, packs, publishes, lease) =
        (plain.captures.clone(), plain.packs.clone(), plain.publishes.clone(), plain.lease.clone());
    let tally = SharedTally::default();
    let inserts_before = server_inserts(client).await?;
    let sampler = Sampler::start(client.clone(), database.clone());
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + options.duration;
    let renew_interval = config.lease.ttl.0 / 6;
    let mut tasks = Vec::new();
    for index in 0..daemons {
        let (client, tally) = (client.clone(), Arc::clone(&tally));
        let (captures, packs, publishes, lease) = (captures.clone(), packs.clone(), publishes.clone(), lease.clone());
        let (interval, rows) = (options.interval, options.captures_per_publish);
        let offset = |period: Duration| tokio::time::Instant::now() + period.mul_f64(index as f64 / daemons as f64);
        let (first_publish, first_renewal) = (offset(interval), offset(renew_interval));
        let catalog = format!("fleet-{index}");
        tasks.push(tokio::spawn(async move {
            let mut publish_ticks = tokio::time::interval_at(first_publish, interval);
            let mut renew_ticks = tokio::time::interval_at(first_renewal, renew_interval);
            publish_ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            renew_ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut version = 0u64;
            loop {
                tokio::select! {
                    tick = publish_ticks.tick() => {
                        if tick >= deadline {
                            return;
                        }
                        version += 1;
                        let pack = synthetic_pack(rows);
                        let publish_id = Uuid::now_v7();
                        let statements = [
                            format!("INSERT INTO {captures} FORMAT TSV\n{}", String::from_utf8_lossy(&super::catalog::baseline_tsv(
                                &catalog, &pack.object_key, pack.summary.pack_id, &pack.entries))),
                            format!("INSERT INTO {packs} FORMAT TSV\n{catalog}\t{}\t{}\t{}\t{}\t{rows}\t0\t0\t{version}\t{publish_id}\n",
                                pack.summary.pack_id, pack.object_key, pack.summary.bytes, pack.summary.sha256_hex),
                            format!("INSERT INTO {publishes} FORMAT TSV\n{catalog}\t{version}\t{publish_id}\tbench\t1\t1\t{rows}\t0\n"),
                        ];
                        let sent = Instant::now();
                        let mut outcome = Ok(());
                        for statement in &statements {
                            outcome = client.execute(statement).await;
                            if outcome.is_err() {
                                break;
                            }
                        }
                        match outcome {
                            Ok(()) => tally.lock().unwrap().publish.push(sent.elapsed()),
                            Err(error) => note_failure(&tally, Some(&error)),
                        }
                    }
                    tick = renew_ticks.tick() => {
                        if tick >= deadline {
                            return;
                        }
                        let statement = format!(
                            "INSERT INTO {lease} FORMAT TSV\n{catalog}\t1\t{}\tbench\t0\t0\trenew\n", Uuid::now_v7());
                        let sent = Instant::now();
                        match client.execute(&statement).await {
                            Ok(()) => tally.lock().unwrap().renew.push(sent.elapsed()),
                            Err(error) => note_failure(&tally, Some(&error)),
                        }
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let inserts = server_inserts(client).await? - inserts_before;
    let samples = sampler.stop().await;
    let final_parts = active_parts(client, &database).await?.values().sum();
    client.execute_with_timeout(&format!("DROP DATABASE IF EXISTS {database}"), SCRATCH_DDL_TIMEOUT).await?;
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    Ok(figures(tally, seconds, inserts, samples, final_parts))
}

fn figures(mut tally: Tally, seconds: f64, inserts: u64, samples: Samples, final_parts: u64) -> LoadFigures {
    let (publish_p50_ms, publish_p99_ms) = percentiles_ms(&mut tally.publish);
    let (renew_p50_ms, renew_p99_ms) = percentiles_ms(&mut tally.renew);
    LoadFigures {
        publishes: tally.publish.len() as u64,
        publishes_per_s: tally.publish.len() as f64 / seconds,
        server_inserts_per_s: inserts as f64 / seconds,
        publish_p50_ms,
        publish_p99_ms,
        renewals: tally.renew.len() as u64,
        renew_p50_ms,
        renew_p99_ms,
        max_active_parts: samples.max_active_parts,
        max_active_parts_table: samples.max_active_parts_table,
        final_active_parts: final_parts,
        max_merges_running: samples.max_merges,
        parts_over_time: samples.series,
        too_many_parts: tally.too_many_parts,
        failed: tally.failed,
    }
}

/// The 50th and 99th percentiles in milliseconds (0 without samples).
fn percentiles_ms(samples: &mut [Duration]) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort();
    let at = |fraction: f64| {
        let index = ((samples.len() as f64 * fraction).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[index].as_secs_f64() * 1000.0
    };
    (at(0.50), at(0.99))
}

async fn server_inserts(client: &CatalogClient) -> Result<u64, CatalogError> {
    let rows: Vec<u64> =
        client.fetch_all("SELECT toUInt64(sum(value)) FROM system.events WHERE event = 'InsertQuery'").await?;
    Ok(rows.first().copied().unwrap_or(0))
}

async fn active_parts(client: &CatalogClient, database: &str) -> Result<BTreeMap<String, u64>, CatalogError> {
    let rows: Vec<(String, u64)> = client
        .fetch_all(&format!(
            "SELECT table, count() FROM system.parts WHERE database = {} AND active GROUP BY table",
            capstore::catalog::client::sql_string_literal(database)
        ))
        .await?;
    Ok(rows.into_iter().collect())
}

#[derive(Default)]
struct Samples {
    max_active_parts: u64,
    max_active_parts_table: String,
    max_merges: u64,
    series: Vec<(f64, u64, u64, u64)>,
}

/// Samples the active parts of every table of a database and the merges running there, every [`SAMPLE_EVERY`].
struct Sampler {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Samples>,
}

impl Sampler {
    fn start(client: CatalogClient, database: String) -> Sampler {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut samples = Samples::default();
            let merges_sql = format!(
                "SELECT count() FROM system.merges WHERE database = {}",
                capstore::catalog::client::sql_string_literal(&database)
            );
            let started = Instant::now();
            loop {
                let (mut total, mut most, mut merging) = (0, 0, 0);
                if let Ok(parts) = active_parts(&client, &database).await {
                    total = parts.values().sum();
                    if let Some((table, count)) = parts.into_iter().max_by_key(|(_, count)| *count) {
                        most = count;
                        if count > samples.max_active_parts {
                            (samples.max_active_parts, samples.max_active_parts_table) = (count, table);
                        }
                    }
                }
                if let Ok(merges) = client.fetch_all::<u64>(&merges_sql).await {
                    merging = merges.first().copied().unwrap_or(0);
                    samples.max_merges = samples.max_merges.max(merging);
                }
                samples.series.push((started.elapsed().as_secs_f64(), total, most, merging));
                tokio::select! {
                    _ = stopped.changed() => return samples,
                    _ = tokio::time::sleep(SAMPLE_EVERY) => {}
                }
            }
        });
        Sampler { stop, task }
    }

    async fn stop(self) -> Samples {
        self.stop.send_replace(true);
        self.task.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_samples_at_the_rank() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(percentiles_ms(&mut samples), (50.0, 99.0));
        assert_eq!(percentiles_ms(&mut [Duration::from_millis(7)]), (7.0, 7.0));
        assert_eq!(percentiles_ms(&mut []), (0.0, 0.0));
    }
}
