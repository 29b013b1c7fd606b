//! `capstore bench spool|catalog|catalog-scale|purge-scale|e2e|fleet`: throughput and latency beside a baseline measured in the same run. One file per
//! benchmark; this one holds the commands and their tables.

mod catalog;
mod catalog_scale;
mod e2e;
mod fleet;
mod purge_scale;
mod spool;

use std::path::{Path, PathBuf};

use clap::Subcommand;
use uuid::Uuid;

use capstore::config::{ByteSize, Config};
use capstore::exit_code;
use catalog::{catalog_publish, CatalogBenchOptions};
use catalog_scale::{catalog_scale, CatalogScaleOptions};
use e2e::{e2e, E2eBenchOptions};
use fleet::{fleet, FleetBenchOptions};
use purge_scale::{purge_scale, PurgeScaleOptions};
use spool::{spool_append, SpoolBenchOptions};

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
        producers: Vec<e2e::E2eProducer>,
        /// Bytes per capture size. With the defaults a 4 KiB run lasts several seconds even through the library, so
        /// the linger (`spool.pack_max_age`) and the last publish do not dominate the figure; the table prints the
        /// run's length beside its rate.
        #[arg(long, default_value = "4GiB")]
        total: ByteSize,
        /// At most this many captures per size.
        #[arg(long, default_value_t = 500_000)]
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
    /// Catalog reads at 1M, 10M and 100M captures (get, pages by stream and across streams at depth, a label, a time
    /// window, tail, tail catch-up, publish p50), each beside ClickHouse answering the same question by primary key.
    /// Loads each size on the server into `<catalog.database>_scale_<rows>` once (kept for later runs).
    CatalogScale {
        #[arg(long, value_delimiter = ',', default_value = "1000000,10000000,100000000")]
        rows: Vec<u64>,
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Captures the tail catch-up reads from version 0.
        #[arg(long, default_value_t = 2_000_000)]
        catch_up: u64,
        /// Publishes timed into the big catalog and into an empty one.
        #[arg(long, default_value_t = 20)]
        publishes: usize,
        #[arg(long)]
        json: bool,
    },
    /// A fleet of N virtual daemons (each its own lease keeper and publisher on its own catalog name, publishing a
    /// trickle of captures) on one ClickHouse: publishes/s, server inserts/s, publish and renewal p50/p99, the most
    /// active parts of a table, merges, "too many parts" refusals; beside the same statements as plain inserts into
    /// copies of the tables. The catalog comes from the config; the bench uses `<catalog.database>_fleet`.
    Fleet {
        #[arg(long, value_delimiter = ',', default_value = "10,50,200")]
        daemons: Vec<usize>,
        /// How long each fleet size runs (its baseline as long again).
        #[arg(long, default_value = "60s")]
        duration: capstore::config::HumanDuration,
        /// Each daemon publishes once per interval.
        #[arg(long, default_value = "5s")]
        interval: capstore::config::HumanDuration,
        #[arg(long, default_value_t = 20)]
        captures_per_publish: u64,
        #[arg(long)]
        json: bool,
    },
    /// Deleting the oldest captures of a stream in a catalog of 1M and 10M captures: listing that stream before,
    /// after the deletion and after the rows' removal, and the removal beside ClickHouse deleting the same rows by
    /// key range. Loads each size afresh into `<catalog.database>_purge_<rows>` (dropped at the end).
    PurgeScale {
        #[arg(long, value_delimiter = ',', default_value = "1000000,10000000")]
        rows: Vec<u64>,
        /// Captures deleted (the oldest of one stream; a stream holds a hundredth of the catalog).
        #[arg(long, default_value_t = 5000)]
        delete: u64,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(config: &Config, config_path: Option<&Path>, command: BenchCommand) -> anyhow::Result<i32> {
    let runtime = crate::cli::runtime()?;
    let (dir, total, sizes, producers, repeats, json) = match command {
        BenchCommand::Spool { dir, total, sizes, producers, repeats, json } => {
            (dir, total, sizes, producers, repeats, json)
        }
        BenchCommand::E2e { dir, sizes, producers, total, max_captures, rclone_destination, rclone_args, json } => {
            let options = E2eBenchOptions {
                config: config.clone(),
                config_path: config_path.map(Path::to_path_buf),
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
                "{:>8}  {:>8}  {:>8}  {:>9}  {:>10}  {:>8}  {:>18}  {:>9}  {:>8}  {:>11}  {:>11}",
                "producer",
                "capture",
                "count",
                "seconds",
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
                    "{:>8}  {:>8}  {:>8}  {:>9.1}  {:>10.0}  {:>8.1}  {:>18.0}  {:>9.0}  {:>8.1}  {:>11.0}  {:>11.1}",
                    format!("{:?}", row.producer).to_lowercase(),
                    ByteSize(row.capture_bytes).to_string(),
                    row.captures,
                    row.seconds,
                    row.captures_per_s,
                    row.mb_per_s,
                    row.latency_p50_ms,
                    row.latency_p99_ms,
                    row.peak_rss_mib,
                    row.rclone_captures_per_s,
                    row.rclone_mb_per_s
                );
                if row.seconds_per_pack_max_age < 10.0 {
                    println!(
                        "          note: the run lasted {:.1} x spool.pack_max_age: the linger and the last publish weigh on \
                         this figure; raise --total or --max-captures",
                        row.seconds_per_pack_max_age
                    );
                }
            }
            return Ok(exit_code::CLEAN);
        }
        BenchCommand::CatalogScale { rows, repeats, catch_up, publishes, json } => {
            let options =
                CatalogScaleOptions { config: config.clone(), rows, repeats, catch_up_captures: catch_up, publishes };
            let results = runtime.block_on(catalog_scale(&options))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&results)?);
                return Ok(exit_code::CLEAN);
            }
            print_scale_rows(results);
            return Ok(exit_code::CLEAN);
        }
        BenchCommand::PurgeScale { rows, delete, json } => {
            let results = runtime.block_on(purge_scale(&PurgeScaleOptions { config: config.clone(), rows, delete }))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&results)?);
                return Ok(exit_code::CLEAN);
            }
            print_scale_rows(results);
            return Ok(exit_code::CLEAN);
        }
        BenchCommand::Fleet { daemons, duration, interval, captures_per_publish, json } => {
            let options = FleetBenchOptions {
                config: config.clone(),
                daemons,
                duration: duration.0,
                interval: interval.0,
                captures_per_publish: captures_per_publish.max(1),
            };
            let results = runtime.block_on(fleet(&options))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&results)?);
                return Ok(exit_code::CLEAN);
            }
            println!(
                "{:>7}  {:<9}  {:>10}  {:>9}  {:>8}  {:>8}  {:>8}  {:>8}  {:>9}  {:>6}  {:>13}  {:>6}",
                "daemons",
                "load",
                "publish/s",
                "insert/s",
                "pub p50",
                "pub p99",
                "renew50",
                "renew99",
                "max parts",
                "merges",
                "too many parts",
                "failed"
            );
            for row in results {
                for (load, figures) in [("capstore", &row.capstore), ("plain", &row.baseline)] {
                    println!(
                        "{:>7}  {:<9}  {:>10.1}  {:>9.1}  {:>6.0}ms  {:>6.0}ms  {:>6.0}ms  {:>6.0}ms  {:>9}  {:>6}  {:>13}  {:>6}",
                        row.daemons,
                        load,
                        figures.publishes_per_s,
                        figures.server_inserts_per_s,
                        figures.publish_p50_ms,
                        figures.publish_p99_ms,
                        figures.renew_p50_ms,
                        figures.renew_p99_ms,
                        figures.max_active_parts,
                        figures.max_merges_running,
                        figures.too_many_parts,
                        figures.failed
                    );
                }
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

/// The table of `catalog-scale` and `purge-scale`.
fn print_scale_rows(results: Vec<catalog_scale::ScaleRow>) {
    println!("{:>10}  {:<60}  {:>12}  {:>12}  {:>6}  {:>10}", "rows", "read", "capstore", "ideal", "ratio", "peak MiB");
    for row in results {
        let or_dash = |value: Option<f64>, digits: usize| value.map_or("-".into(), |v| format!("{v:.digits$}"));
        println!(
            "{:>10}  {:<60}  {:>12.1}  {:>12}  {:>6}  {:>10}",
            row.rows,
            row.read,
            row.capstore_ms,
            or_dash(row.ideal_ms, 1),
            or_dash(row.ratio, 2),
            or_dash(row.peak_memory_mib, 1)
        );
    }
    println!("(ms unless the read says otherwise; ratio = capstore / ideal)");
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A payload derived from the capture id, so a check can recompute the bytes instead of remembering them. The crash
/// tests' `expected_payload` (tests/common) is the same function: the crash tests fail at once if the two differ.
pub fn deterministic_payload(capture_id: Uuid, len: usize) -> Vec<u8> {
    let seed = capture_id.as_bytes();
    (0..len).map(|i| seed[i % 16].wrapping_add((i / 16) as u8)).collect()
}
