//! `capstore bench ...` and the hidden `capstore debug ...` helpers used by crash tests.

use std::io::Write;
use std::path::PathBuf;

use clap::Subcommand;

use capstore::bench::{catalog_publish, e2e, spool_append, CatalogBenchOptions, E2eBenchOptions, SpoolBenchOptions};
use capstore::config::{ByteSize, Config};
use capstore::exit_code;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Spool append throughput with group commit, beside `dd ... conv=fdatasync` of the same bytes.
    Spool {
        /// Directory on the disk to measure (a scratch subdirectory is created and removed).
        #[arg(long, default_value = "./capstore-bench")]
        dir: PathBuf,
        /// Bytes written per capture size and run.
        #[arg(long, default_value = "256MiB")]
        total: ByteSize,
        /// Capture sizes to measure.
        #[arg(long, value_delimiter = ',', default_value = "1KiB,64KiB,4MiB")]
        sizes: Vec<ByteSize>,
        /// Concurrent producers.
        #[arg(long, default_value_t = 256)]
        producers: usize,
        /// Runs per size; the median is reported.
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        #[arg(long)]
        json: bool,
    },
    /// End to end through a real daemon (captures/s, MB/s, ack -> listed latency, peak RSS), beside `rclone copy` of
    /// the same captures as individual files. Bucket and catalog come from the config.
    E2e {
        /// Scratch directory (spool and staged files).
        #[arg(long, default_value = "./capstore-bench")]
        dir: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "4KiB,1MiB")]
        sizes: Vec<ByteSize>,
        /// How captures reach capstore: files in the inbox of a `capstore run` child, or appends through the Rust
        /// library to a daemon in this process.
        #[arg(long, value_delimiter = ',', default_value = "inbox,library")]
        producers: Vec<capstore::bench::E2eProducer>,
        /// Bytes per capture size.
        #[arg(long, default_value = "1GiB")]
        total: ByteSize,
        /// At most this many captures per size.
        #[arg(long, default_value_t = 20_000)]
        max_captures: u64,
        /// rclone destination: a directory, or a remote such as `:s3:bucket/prefix`.
        #[arg(long)]
        rclone_destination: String,
        /// Extra rclone arguments (e.g. --s3-endpoint=...), repeatable.
        #[arg(long = "rclone-arg", allow_hyphen_values = true)]
        rclone_args: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Catalog publish throughput (rows/s) beside clickhouse-client bulk-inserting the same rows, same server.
    /// The catalog comes from the config (catalog.url etc.); use a scratch database.
    Catalog {
        /// The server's native-protocol port, for the clickhouse-client baseline.
        #[arg(long, default_value_t = 9000)]
        native_port: u16,
        #[arg(long, value_delimiter = ',', default_value = "1000,10000,100000")]
        rows: Vec<u64>,
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum DebugCommand {
    /// Own the spool, take the catalog's publisher lease (with the start wait) and keep renewing it until killed;
    /// prints "HELD <term> <holder>" once held.
    HoldLease,
    /// Append a deterministic stream of captures to the spool, printing "ACK <capture_id> <len>" after each fsync.
    AppendStream {
        /// Stop after this many captures (default: run until killed).
        #[arg(long)]
        max: Option<u64>,
        /// Concurrent appenders, so batches form as in production.
        #[arg(long, default_value_t = 8)]
        producers: usize,
    },
}

pub fn run(config: &Config, command: BenchCommand) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
    let (dir, total, sizes, producers, repeats, json) = match command {
        BenchCommand::Spool { dir, total, sizes, producers, repeats, json } => {
            (dir, total, sizes, producers, repeats, json)
        }
        BenchCommand::E2e { dir, sizes, producers, total, max_captures, rclone_destination, rclone_args, json } => {
            let options = E2eBenchOptions {
                config: config.clone(),
                dir,
                capture_sizes: sizes.iter().map(|s| s.0).collect(),
                producers,
                total_bytes: total.0,
                max_captures,
                rclone_destination,
                rclone_args,
            };
            let results = runtime.block_on(e2e(&options))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&results)?);
                return Ok(exit_code::CLEAN);
            }
            println!(
                "{:>8}  {:>8}  {:>8}  {:>10}  {:>8}  {:>18}  {:>9}  {:>8}  {:>11}  {:>11}",
                "producer",
                "capture",
                "count",
                "captures/s",
                "MB/s",
                "ack->listed p50 ms",
                "p99 ms",
                "RSS MiB",
                "rclone c/s",
                "rclone MB/s"
            );
            for row in results {
                println!(
                    "{:>8}  {:>8}  {:>8}  {:>10.0}  {:>8.1}  {:>18.0}  {:>9.0}  {:>8.1}  {:>11.0}  {:>11.1}",
                    format!("{:?}", row.producer).to_lowercase(),
                    ByteSize(row.capture_bytes).to_string(),
                    row.captures,
                    row.captures_per_s,
                    row.mb_per_s,
                    row.latency_p50_ms,
                    row.latency_p99_ms,
                    row.peak_rss_mib,
                    row.rclone_captures_per_s,
                    row.rclone_mb_per_s
                );
            }
            return Ok(exit_code::CLEAN);
        }
        BenchCommand::Catalog { native_port, rows, repeats, json } => {
            let options =
                CatalogBenchOptions { config: config.clone(), native_port, batch_rows: rows, repeats: repeats.max(1) };
            let results = runtime.block_on(catalog_publish(&options))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&results)?);
                return Ok(exit_code::CLEAN);
            }
            println!("{:>8}  {:>12}  {:>14}  {:>8}", "rows", "capstore r/s", "ch-client r/s", "ratio");
            for row in results {
                println!(
                    "{:>8}  {:>12.0}  {:>14.0}  {:>7.0}%",
                    row.rows,
                    row.publish_rows_per_s,
                    row.client_rows_per_s,
                    row.ratio_to_client * 100.0
                );
            }
            return Ok(exit_code::CLEAN);
        }
    };
    let options = SpoolBenchOptions {
        dir,
        capture_sizes: sizes.iter().map(|s| s.0).collect(),
        total_bytes: total.0,
        producers,
        repeats: repeats.max(1),
    };
    let rows = runtime.block_on(spool_append(&options))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(exit_code::CLEAN);
    }
    println!(
        "{:>10}  {:>9}  {:>10}  {:>12}  {:>8}  {:>10}  {:>8}",
        "capture", "captures", "spool MB/s", "captures/s", "fsyncs", "dd MB/s", "vs dd"
    );
    for row in rows {
        println!(
            "{:>10}  {:>9}  {:>10.1}  {:>12.0}  {:>8}  {:>10.1}  {:>7.0}%",
            ByteSize(row.capture_bytes).to_string(),
            row.captures,
            row.spool_mb_per_s,
            row.captures_per_s,
            row.fsyncs,
            row.dd_mb_per_s,
            row.ratio_to_dd * 100.0
        );
    }
    Ok(exit_code::CLEAN)
}

pub fn debug(config: &Config, command: DebugCommand) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
    match command {
        DebugCommand::AppendStream { max, producers } => runtime.block_on(append_stream(config, max, producers)),
        DebugCommand::HoldLease => runtime.block_on(hold_lease(config)),
    }
}

async fn hold_lease(config: &Config) -> anyhow::Result<i32> {
    use capstore::catalog::lease::{Identity, LeaseKeeper, LeaseStore, LeaseTimings, StartError};
    let (spool, _recovery) = capstore::spool::Spool::open(&config.spool)?;
    let (client, tables) = capstore::catalog::connect(config).await?;
    let identity = Identity { spool_id: spool.id(), host: capstore::spool::lock::host_name(), pid: std::process::id() };
    let timings = LeaseTimings::from_config(&config.lease, &client);
    let keeper = LeaseKeeper::new(
        LeaseStore::new(client, &tables, &config.catalog_name, timings),
        identity,
        &config.catalog_name,
    );
    let (_shutdown_tx, mut shutdown_rx) = tokio::sync::watch::channel(false);
    match keeper.acquire_at_start(config.start_wait(), &mut shutdown_rx).await {
        Ok(()) => {}
        Err(error @ StartError::Refused { .. }) => {
            eprintln!("capstore: {error}");
            return Ok(exit_code::CATALOG_HELD);
        }
        Err(error) => return Err(error.into()),
    }
    let status = keeper.handle().status();
    println!("HELD {} {}", status.lease_term, keeper.handle().identity().holder());
    std::io::stdout().flush()?;
    keeper.run(shutdown_rx).await;
    drop(spool);
    Ok(exit_code::CATALOG_HELD)
}

async fn append_stream(config: &Config, max: Option<u64>, producers: usize) -> anyhow::Result<i32> {
    use capstore::pack::CaptureMeta;
    use capstore::spool::writer::{spawn_writer, WriterSettings};
    let (spool, _recovery) = match capstore::spool::Spool::open(&config.spool) {
        Ok(opened) => opened,
        Err(error @ capstore::spool::SpoolError::Locked(_)) => {
            eprintln!("capstore: {error}");
            return Ok(exit_code::SPOOL_OWNED);
        }
        Err(error) => return Err(error.into()),
    };
    let (writer, thread) = spawn_writer(spool.paths().clone(), WriterSettings::from_config(&config.spool));
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stdout = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let mut tasks = Vec::new();
    for _ in 0..producers {
        let (writer, next, stdout) = (writer.clone(), next.clone(), stdout.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if max.is_some_and(|max| n >= max) {
                    return Ok::<(), anyhow::Error>(());
                }
                let capture_id = uuid::Uuid::now_v7();
                // Sizes cycle through empty, small and a few larger captures so packs seal on bytes too.
                let len = [0usize, 1, 100, 1000, 20_000, 300_000][(n % 6) as usize];
                let meta = CaptureMeta {
                    capture_id,
                    stream: "crash/test".into(),
                    captured_at_ns: capstore::util::now_ns(),
                    labels: [("n".to_string(), n.to_string())].into(),
                    content_type: None,
                    source_name: None,
                };
                writer.append(meta, capstore::bench::expected_payload(capture_id, len)).await?;
                let mut out = stdout.lock().expect("stdout lock");
                writeln!(out, "ACK {capture_id} {len}")?;
                out.flush()?;
            }
        }));
    }
    for task in tasks {
        task.await??;
    }
    writer.close();
    drop(writer);
    tokio::task::spawn_blocking(move || thread.join()).await?;
    drop(spool);
    Ok(exit_code::CLEAN)
}
