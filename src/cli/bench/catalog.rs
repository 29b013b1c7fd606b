//! `capstore bench catalog`: fenced publishes of capture rows beside `clickhouse-client` inserting the same rows as
//! TSV into a table of the same schema, on the same server, in the same run.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;
use uuid::Uuid;

use capstore::capture::CaptureMeta;
use capstore::catalog::lease::LeaseKeeper;
use capstore::catalog::publish::{PackDescriptor, PublishOutcome, Publisher};
use capstore::pack::{IndexEntry, PackSummary};

use super::median;

/// One row of `capstore bench catalog`.
#[derive(Debug, Clone, Serialize)]
pub struct CatalogBenchRow {
    pub rows: u64,
    pub publish_seconds: f64,
    pub publish_rows_per_s: f64,
    pub client_seconds: f64,
    pub client_rows_per_s: f64,
    /// capstore rows/s divided by clickhouse-client rows/s.
    pub ratio_to_client: f64,
}

pub struct CatalogBenchOptions {
    pub config: capstore::config::Config,
    /// Native-protocol port of the same server, for the clickhouse-client baseline.
    pub native_port: u16,
    pub batch_rows: Vec<u64>,
    pub repeats: usize,
}

/// Publish batches of capture rows through the fenced publish (descriptor rows + fenced publishes row + read-back),
/// beside `clickhouse-client` inserting the same rows as TSV into a table of the same schema, in the same run.
pub async fn catalog_publish(options: &CatalogBenchOptions) -> anyhow::Result<Vec<CatalogBenchRow>> {
    let config = &options.config;
    let (client, tables) = capstore::catalog::connect(config).await?;
    let baseline_table = format!("{}.bench_client_captures", tables.database);
    client.execute(&format!("DROP TABLE IF EXISTS {baseline_table}")).await?;
    client.execute(&format!("CREATE TABLE {baseline_table} AS {}", tables.captures)).await?;
    // A spool id of its own: the bench is a publisher of its own, never a takeover of a daemon's lease.
    let keeper = LeaseKeeper::for_catalog(&client, &tables, config, Uuid::new_v4());
    let (_shutdown_tx, mut shutdown_rx) = tokio::sync::watch::channel(false);
    let lease = keeper.start(config.start_wait(), &mut shutdown_rx).await?;
    let publisher = Publisher::new(client.clone(), tables.clone(), &config.catalog_name, lease.handle().clone());

    let mut results = Vec::new();
    for &rows in &options.batch_rows {
        let mut publish_runs = Vec::new();
        let mut client_runs = Vec::new();
        for _ in 0..options.repeats {
            let pack = synthetic_pack(rows);
            let tsv = baseline_tsv(&config.catalog_name, &pack.object_key, pack.summary.pack_id, &pack.entries);
            let started = Instant::now();
            let status = run_clickhouse_client(options.native_port, &baseline_table, &tsv)?;
            client_runs.push(started.elapsed().as_secs_f64());
            anyhow::ensure!(status.success(), "clickhouse-client failed: {status}");

            let started = Instant::now();
            publish_until_committed(&publisher, &pack).await?;
            publish_runs.push(started.elapsed().as_secs_f64());
        }
        let publish_seconds = median(&mut publish_runs);
        let client_seconds = median(&mut client_runs);
        results.push(CatalogBenchRow {
            rows,
            publish_seconds,
            publish_rows_per_s: rows as f64 / publish_seconds,
            client_seconds,
            client_rows_per_s: rows as f64 / client_seconds,
            ratio_to_client: client_seconds / publish_seconds,
        });
    }
    lease.stop().await;
    client.execute(&format!("DROP TABLE IF EXISTS {baseline_table}")).await?;
    Ok(results)
}

/// One pack of `rows` synthetic capture rows in one stream, with one label.
pub(super) fn synthetic_pack(rows: u64) -> PackDescriptor {
    synthetic_pack_at(rows, 1_700_000_000_000_000_000)
}

/// [`synthetic_pack`] whose captures are `first_captured_at_ns` and the next `rows - 1` ns.
pub(super) fn synthetic_pack_at(rows: u64, first_captured_at_ns: u64) -> PackDescriptor {
    let pack_id = Uuid::now_v7();
    let entries: Vec<IndexEntry> = (0..rows)
        .map(|n| IndexEntry {
            meta: CaptureMeta {
                capture_id: Uuid::now_v7(),
                stream: "bench/stream".into(),
                captured_at_ns: first_captured_at_ns + n,
                labels: BTreeMap::from([("site".to_string(), "berlin".to_string())]),
                content_type: None,
                source_name: None,
            },
            record_offset: 40 + n * 1100,
            record_len: 1100,
            payload_offset: 40 + n * 1100 + 76,
            payload_len: 1024,
            crc32c: n as u32,
        })
        .collect();
    PackDescriptor {
        summary: PackSummary {
            pack_id,
            bytes: 40 + rows * 1100,
            records: rows,
            sha256_hex: "00".repeat(32),
            first_captured_at_ns: 0,
            last_captured_at_ns: 0,
            created_at_ns: 0,
        },
        object_key: format!("bench/{pack_id}.cpk"),
        entries,
    }
}

/// Publish `pack`, retrying what fails (a benchmark rides out a slow renewal); an unexpected outcome is an error.
pub(super) async fn publish_until_committed(publisher: &Publisher, pack: &PackDescriptor) -> anyhow::Result<()> {
    loop {
        match publisher.publish_batch(std::slice::from_ref(pack)).await {
            Ok(PublishOutcome::Committed { .. }) => return Ok(()),
            Ok(other) => anyhow::bail!("unexpected publish outcome {other:?}"),
            Err(error) => {
                tracing::warn!(%error, "publish failed during the benchmark; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

pub(super) fn baseline_tsv(catalog: &str, object_key: &str, pack_id: Uuid, entries: &[IndexEntry]) -> Vec<u8> {
    use std::fmt::Write as _;
    let mut tsv = String::with_capacity(entries.len() * 200);
    for entry in entries {
        let keys: Vec<String> = entry.meta.labels.keys().map(|k| format!("'{k}'")).collect();
        let values: Vec<String> = entry.meta.labels.values().map(|v| format!("'{v}'")).collect();
        let _ = writeln!(
            tsv,
            "{catalog}\t{}\t{}\t{}\t{pack_id}\t{object_key}\t{}\t{}\t{}\t{}\t{}\t[{}]\t[{}]\t\t1\t{}",
            entry.meta.stream,
            entry.meta.captured_at_ns,
            entry.meta.capture_id,
            entry.record_offset,
            entry.record_len,
            entry.payload_offset,
            entry.payload_len,
            entry.crc32c,
            keys.join(","),
            values.join(","),
            pack_id
        );
    }
    tsv.into_bytes()
}

fn run_clickhouse_client(port: u16, table: &str, tsv: &[u8]) -> std::io::Result<std::process::ExitStatus> {
    use std::io::Write as _;
    let mut child = Command::new("clickhouse-client")
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--query"])
        .arg(format!("INSERT INTO {table} FORMAT TSV"))
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().expect("piped stdin").write_all(tsv)?;
    child.wait()
}
