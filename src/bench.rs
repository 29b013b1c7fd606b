//! Benchmarks with a baseline measured in the same run (`capstore bench spool`).
//!
//! Spool append throughput: concurrent producers append captures of one size through the group-commit writer until
//! `total_bytes` are acknowledged; the baseline is `dd if=/dev/zero bs=1M count=N conv=fdatasync` writing the same number
//! of bytes into the same directory. Each size runs `repeats` times and the median is reported, because these machines
//! are shared and noisy.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use uuid::Uuid;

use crate::pack::CaptureMeta;
use crate::spool::writer::{spawn_writer, WriterSettings};
use crate::spool::SpoolPaths;

#[derive(Debug, Clone, Serialize)]
pub struct SpoolBenchRow {
    pub capture_bytes: u64,
    pub captures: u64,
    pub total_bytes: u64,
    pub spool_seconds: f64,
    pub spool_mb_per_s: f64,
    pub captures_per_s: f64,
    pub fsyncs: u64,
    pub dd_seconds: f64,
    pub dd_mb_per_s: f64,
    /// spool MB/s divided by dd MB/s.
    pub ratio_to_dd: f64,
}

pub struct SpoolBenchOptions {
    pub dir: PathBuf,
    pub capture_sizes: Vec<u64>,
    pub total_bytes: u64,
    pub producers: usize,
    pub repeats: usize,
}

pub async fn spool_append(options: &SpoolBenchOptions) -> std::io::Result<Vec<SpoolBenchRow>> {
    std::fs::create_dir_all(&options.dir)?;
    let mut rows = Vec::new();
    for &capture_bytes in &options.capture_sizes {
        let captures = (options.total_bytes / capture_bytes).max(1);
        let total_bytes = captures * capture_bytes;
        let mut spool_runs = Vec::new();
        let mut dd_runs = Vec::new();
        let mut fsyncs = 0;
        for _ in 0..options.repeats {
            // Alternate the two so drift in machine load hits both alike.
            dd_runs.push(run_dd(&options.dir, total_bytes)?);
            let (seconds, run_fsyncs) = run_spool(&options.dir, capture_bytes, captures, options.producers).await?;
            spool_runs.push(seconds);
            fsyncs = run_fsyncs;
        }
        let spool_seconds = median(&mut spool_runs);
        let dd_seconds = median(&mut dd_runs);
        let megabytes = total_bytes as f64 / 1e6;
        rows.push(SpoolBenchRow {
            capture_bytes,
            captures,
            total_bytes,
            spool_seconds,
            spool_mb_per_s: megabytes / spool_seconds,
            captures_per_s: captures as f64 / spool_seconds,
            fsyncs,
            dd_seconds,
            dd_mb_per_s: megabytes / dd_seconds,
            ratio_to_dd: dd_seconds / spool_seconds,
        });
    }
    Ok(rows)
}

/// Test payload derived from the capture id, so a crash test can check bytes without remembering them.
pub fn expected_payload(capture_id: Uuid, len: usize) -> Vec<u8> {
    let seed = capture_id.as_bytes();
    (0..len).map(|i| seed[i % 16].wrapping_add((i / 16) as u8)).collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn run_dd(dir: &Path, total_bytes: u64) -> std::io::Result<f64> {
    let target = dir.join("dd-baseline.bin");
    let megabytes = total_bytes.div_ceil(1024 * 1024);
    let started = Instant::now();
    let status = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", target.display()))
        .arg("bs=1M")
        .arg(format!("count={megabytes}"))
        .arg("conv=fdatasync")
        .stderr(std::process::Stdio::null())
        .status()?;
    let seconds = started.elapsed().as_secs_f64();
    std::fs::remove_file(&target)?;
    if !status.success() {
        return Err(std::io::Error::other(format!("dd failed: {status}")));
    }
    // dd wrote whole MiB; scale to the bytes the spool wrote so MB/s compare like for like.
    Ok(seconds * total_bytes as f64 / (megabytes * 1024 * 1024) as f64)
}

async fn run_spool(dir: &Path, capture_bytes: u64, captures: u64, producers: usize) -> std::io::Result<(f64, u64)> {
    let spool_dir = dir.join(format!("spool-bench-{}", Uuid::now_v7()));
    let paths = SpoolPaths::new(&spool_dir);
    for sub in [&paths.root, &paths.packs] {
        std::fs::create_dir_all(sub)?;
    }
    let settings = WriterSettings {
        pack_max_bytes: 64 * 1024 * 1024,
        pack_max_records: 1_000_000,
        pack_max_age: Duration::from_secs(3600),
        max_capture_bytes: capture_bytes.max(1),
        max_bytes: 0,
        min_free_bytes: 0,
    };
    let (writer, thread) = spawn_writer(paths, settings);
    // Incompressible, non-constant payload so checksums do real work. Every producer hands over the same immutable
    // buffer (a reference count, not a copy), as dd writes the same buffer again and again: the run measures the
    // spool's own work (checksums, the copy into the page cache, fsyncs), not the producers' allocations.
    let payload = bytes::Bytes::from(
        (0..capture_bytes).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect::<Vec<u8>>(),
    );
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..producers {
        let writer = writer.clone();
        let payload = payload.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < captures {
                let meta = CaptureMeta {
                    capture_id: Uuid::now_v7(),
                    stream: "bench".into(),
                    captured_at_ns: crate::util::now_ns(),
                    labels: BTreeMap::new(),
                    content_type: None,
                    source_name: None,
                };
                writer.append(meta, payload.clone()).await.map_err(std::io::Error::other)?;
            }
            Ok::<(), std::io::Error>(())
        }));
    }
    for task in tasks {
        task.await.map_err(std::io::Error::other)??;
    }
    let fsyncs = writer.stats().snapshot().fsyncs;
    writer.close();
    drop(writer);
    tokio::task::spawn_blocking(move || thread.join()).await.map_err(std::io::Error::other)?;
    let seconds = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&spool_dir)?;
    Ok((seconds, fsyncs))
}

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
    pub config: crate::config::Config,
    /// Native-protocol port of the same server, for the clickhouse-client baseline.
    pub native_port: u16,
    pub batch_rows: Vec<u64>,
    pub repeats: usize,
}

/// Publish batches of capture rows through the fenced publish (descriptor rows + fenced publishes row + read-back),
/// beside `clickhouse-client` inserting the same rows as TSV into a table of the same schema, in the same run.
pub async fn catalog_publish(options: &CatalogBenchOptions) -> anyhow::Result<Vec<CatalogBenchRow>> {
    use crate::catalog::lease::{Identity, LeaseKeeper, LeaseStore, LeaseTimings};
    use crate::catalog::publish::{PackDescriptor, PublishOutcome, Publisher};
    use crate::pack::{IndexEntry, PackSummary};

    let config = &options.config;
    let (client, tables) = crate::catalog::connect(config).await?;
    let baseline_table = format!("{}.bench_client_captures", tables.database);
    client.execute(&format!("DROP TABLE IF EXISTS {baseline_table}")).await?;
    client.execute(&format!("CREATE TABLE {baseline_table} AS {}", tables.captures)).await?;
    let identity = Identity { spool_id: Uuid::new_v4(), host: "bench".into(), pid: std::process::id() };
    let timings = LeaseTimings::from_config(&config.lease, &client);
    let keeper = LeaseKeeper::new(
        LeaseStore::new(client.clone(), &tables, &config.catalog_name, timings),
        identity,
        &config.catalog_name,
    );
    let (shutdown_tx, mut shutdown_rx) = tokio::sync::watch::channel(false);
    keeper.acquire_at_start(config.start_wait(), &mut shutdown_rx).await?;
    let handle = keeper.handle();
    let keeper_task = tokio::spawn(keeper.run(shutdown_rx));
    let publisher = Publisher::new(client.clone(), tables.clone(), &config.catalog_name, handle);

    let mut results = Vec::new();
    for &rows in &options.batch_rows {
        let mut publish_runs = Vec::new();
        let mut client_runs = Vec::new();
        for _ in 0..options.repeats {
            let pack_id = Uuid::now_v7();
            let object_key = format!("bench/{pack_id}.cpk");
            let entries: Vec<IndexEntry> = (0..rows)
                .map(|n| IndexEntry {
                    meta: CaptureMeta {
                        capture_id: Uuid::now_v7(),
                        stream: "bench/stream".into(),
                        captured_at_ns: 1_700_000_000_000_000_000 + n,
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
            let tsv = baseline_tsv(&config.catalog_name, &object_key, pack_id, &entries);
            let started = Instant::now();
            let status = run_clickhouse_client(options.native_port, &baseline_table, &tsv)?;
            client_runs.push(started.elapsed().as_secs_f64());
            anyhow::ensure!(status.success(), "clickhouse-client failed: {status}");

            let pack = PackDescriptor {
                summary: PackSummary {
                    pack_id,
                    bytes: 40 + rows * 1100,
                    records: rows,
                    sha256_hex: "00".repeat(32),
                    first_captured_at_ns: 0,
                    last_captured_at_ns: 0,
                    created_at_ns: 0,
                },
                object_key,
                entries,
            };
            let started = Instant::now();
            loop {
                match publisher.publish_batch(std::slice::from_ref(&pack)).await {
                    Ok(PublishOutcome::Committed { .. }) => break,
                    Ok(other) => anyhow::bail!("unexpected publish outcome {other:?}"),
                    Err(error) => {
                        tracing::warn!(%error, "publish failed during the benchmark; retrying");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
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
    shutdown_tx.send(true).ok();
    keeper_task.await.ok();
    client.execute(&format!("DROP TABLE IF EXISTS {baseline_table}")).await?;
    Ok(results)
}

fn baseline_tsv(catalog: &str, object_key: &str, pack_id: Uuid, entries: &[crate::pack::IndexEntry]) -> Vec<u8> {
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

/// How the e2e bench hands captures to capstore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum E2eProducer {
    /// Files in the inbox of a `capstore run` child (the latency phase posts over its HTTP API).
    Inbox,
    /// Appends through the Rust library to a daemon in the bench's own process
    /// ([`crate::daemon::run_in_process`]).
    Library,
}

/// One row of `capstore bench e2e`.
#[derive(Debug, Clone, Serialize)]
pub struct E2eBenchRow {
    pub producer: E2eProducer,
    pub capture_bytes: u64,
    pub captures: u64,
    /// Throughput phase: from handing over the first capture until the catalog lists the last one.
    pub seconds: f64,
    pub captures_per_s: f64,
    pub mb_per_s: f64,
    /// Latency phase: captures handed over one every 20 ms, well below capacity; from the acknowledgement (the record
    /// is fsynced) until the catalog lists the capture, milliseconds.
    pub latency_captures: u64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    /// Peak resident set (VmHWM) over both phases, MiB: of the daemon child for `inbox`; of the bench process, which
    /// is the daemon too, for `library`.
    pub peak_rss_mib: f64,
    pub rclone_seconds: f64,
    pub rclone_captures_per_s: f64,
    pub rclone_mb_per_s: f64,
}

pub struct E2eBenchOptions {
    pub config: crate::config::Config,
    /// Scratch directory for the spool and the staged files (same filesystem, so dropping is a rename).
    pub dir: PathBuf,
    pub capture_sizes: Vec<u64>,
    pub producers: Vec<E2eProducer>,
    pub total_bytes: u64,
    pub max_captures: u64,
    /// rclone destination for the same files, e.g. `/path/to/dir` or `:s3:bucket/prefix` (with `rclone_args`).
    pub rclone_destination: String,
    pub rclone_args: Vec<String>,
}

/// Captures handed over in the latency phase, and their pace.
const LATENCY_CAPTURES: u64 = 200;
const LATENCY_INTERVAL: Duration = Duration::from_millis(20);
/// Concurrent appends of the library producer.
const LIBRARY_PRODUCERS: usize = 256;

/// What one producer run measured.
struct E2eRun {
    seconds: f64,
    latencies_ms: Vec<f64>,
    peak_rss_mib: f64,
}

/// End to end through a real daemon, beside `rclone copy` of the same files as individual objects to the same bucket,
/// in the same run.
///
/// Throughput: `inbox` drops the staged files into the inbox all at once (their directory is renamed in as the stream
/// directory, so the drop costs the producer nothing, as rclone's sources cost it nothing); `library` appends the same
/// number of captures of the same size from memory with [`LIBRARY_PRODUCERS`] concurrent producers. The clock runs
/// until the catalog lists every capture: until the committed publishes (the rows that make captures visible) cover
/// them all. Then, untimed, every capture id is read back from the catalog, so a capture lost or listed twice fails
/// the run. Latency: then captures are handed over at a steady pace (HTTP posts for `inbox`, appends for `library`),
/// each timed from its acknowledgement until the catalog lists it.
pub async fn e2e(options: &E2eBenchOptions) -> anyhow::Result<Vec<E2eBenchRow>> {
    let mut rows = Vec::new();
    for &capture_bytes in &options.capture_sizes {
        let captures = (options.total_bytes / capture_bytes).clamp(1, options.max_captures);
        let run_dir = options.dir.join(format!("e2e-{}", Uuid::now_v7()));
        let staging = run_dir.join("staging").join("bench");
        std::fs::create_dir_all(&staging)?;
        let ids: Vec<Uuid> = (0..captures).map(|_| Uuid::now_v7()).collect();
        for id in &ids {
            std::fs::write(staging.join(id.to_string()), expected_payload(*id, capture_bytes as usize))?;
        }

        // Baseline first: rclone copies the same files as individual objects.
        let rclone_target = format!("{}/rclone-{}", options.rclone_destination.trim_end_matches('/'), Uuid::now_v7());
        let started = Instant::now();
        let status = Command::new("rclone")
            .arg("copy")
            .arg(&staging)
            .arg(&rclone_target)
            .args(&options.rclone_args)
            .arg("--transfers=4")
            .status()?;
        anyhow::ensure!(status.success(), "rclone failed: {status}");
        let rclone_seconds = started.elapsed().as_secs_f64();
        // Repeated runs must not fill the disk or the bucket with baseline copies.
        let purged = Command::new("rclone").arg("purge").arg(&rclone_target).args(&options.rclone_args).status()?;
        if !purged.success() {
            tracing::warn!(target = rclone_target, "rclone purge of the baseline copy failed");
        }

        for &producer in &options.producers {
            let mut config = options.config.clone();
            config.spool.dir = run_dir.join(format!("spool-{producer:?}"));
            config.catalog_name = format!("bench-{}", rand::random::<u32>());
            let run = match producer {
                E2eProducer::Inbox => run_inbox(config, &run_dir, &staging, &ids, capture_bytes).await?,
                E2eProducer::Library => run_library(config, capture_bytes, captures).await?,
            };
            let mut latencies = run.latencies_ms;
            latencies.sort_by(f64::total_cmp);
            let percentile =
                |p: f64| latencies.get(((latencies.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0.0);
            let megabytes = (captures * capture_bytes) as f64 / 1e6;
            rows.push(E2eBenchRow {
                producer,
                capture_bytes,
                captures,
                seconds: run.seconds,
                captures_per_s: captures as f64 / run.seconds,
                mb_per_s: megabytes / run.seconds,
                latency_captures: latencies.len() as u64,
                latency_p50_ms: percentile(0.5),
                latency_p99_ms: percentile(0.99),
                peak_rss_mib: run.peak_rss_mib,
                rclone_seconds,
                rclone_captures_per_s: captures as f64 / rclone_seconds,
                rclone_mb_per_s: megabytes / rclone_seconds,
            });
        }
        std::fs::remove_dir_all(&run_dir).ok();
    }
    Ok(rows)
}

async fn follower_for(config: &crate::config::Config) -> anyhow::Result<CatalogFollower> {
    let client = crate::catalog::CatalogClient::connect(&config.catalog).await?;
    let tables = crate::catalog::Tables::new(
        &config.catalog.database,
        &config.catalog.table_prefix,
        config.catalog.cluster.as_deref(),
    );
    let reader = crate::catalog::query::CatalogReader::new(client, tables, &config.catalog_name);
    Ok(CatalogFollower { reader, after_version: 0 })
}

/// The inbox producer against a `capstore run` child.
async fn run_inbox(
    config: crate::config::Config,
    run_dir: &Path,
    staging: &Path,
    ids: &[Uuid],
    capture_bytes: u64,
) -> anyhow::Result<E2eRun> {
    let http_listen = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
        probe.local_addr()?
    };
    let log_path = run_dir.join("daemon.log");
    let mut child = Command::new(std::env::current_exe()?)
        .arg("run")
        .env("CAPSTORE_SPOOL_DIR", &config.spool.dir)
        .env("CAPSTORE_CATALOG_NAME", &config.catalog_name)
        .env("CAPSTORE_HTTP_LISTEN", http_listen.to_string())
        // The bench waits for the start line, which is logged at info.
        .env("CAPSTORE_LOG_LEVEL", "info")
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()?;
    let daemon_pid = child.id();
    let wait_started = Instant::now();
    while !std::fs::read_to_string(&log_path)?.contains("capstore running") {
        anyhow::ensure!(
            wait_started.elapsed() < Duration::from_secs(60),
            "the daemon did not start: see {}",
            log_path.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut follower = follower_for(&config).await?;

    let first_version = follower.after_version;
    let started = Instant::now();
    std::fs::rename(staging, config.spool.dir.join("inbox").join("bench"))?;
    follower.wait_for_published(ids.len() as u64, Duration::from_secs(1800)).await?;
    let seconds = started.elapsed().as_secs_f64();
    follower.verify_listed(first_version, ids).await?;

    let payload = bytes::Bytes::from(expected_payload(Uuid::now_v7(), capture_bytes as usize));
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let latencies_ms = latency_phase(&mut follower, |capture_id| {
        let request =
            axum::http::Request::post(format!("http://{http_listen}/v1/captures?stream=latency&id={capture_id}"))
                .body(http_body_util::Full::new(payload.clone()));
        let client = client.clone();
        async move {
            let response = client.request(request?).await?;
            anyhow::ensure!(
                response.status() == axum::http::StatusCode::CREATED,
                "POST answered {}",
                response.status()
            );
            Ok(())
        }
    })
    .await?;

    let peak_rss_mib = peak_rss_mib(daemon_pid)?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon_pid as i32), nix::sys::signal::Signal::SIGTERM)?;
    child.wait()?;
    Ok(E2eRun { seconds, latencies_ms, peak_rss_mib })
}

/// The library producer against a daemon in this process.
async fn run_library(config: crate::config::Config, capture_bytes: u64, captures: u64) -> anyhow::Result<E2eRun> {
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let (writer_tx, writer_rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(crate::daemon::run_in_process(config.clone(), shutdown_rx, writer_tx));
    let writer = writer_rx.await?;
    let mut follower = follower_for(&config).await?;
    // Incompressible, non-constant payload; every producer hands over the same immutable buffer (see the spool bench).
    let payload = bytes::Bytes::from(expected_payload(Uuid::now_v7(), capture_bytes as usize));
    let append = {
        let (writer, payload) = (writer.clone(), payload.clone());
        move |capture_id: Uuid| {
            let writer = writer.clone();
            let payload = payload.clone();
            async move {
                let meta = CaptureMeta {
                    capture_id,
                    stream: "bench".into(),
                    captured_at_ns: crate::util::now_ns(),
                    labels: BTreeMap::new(),
                    content_type: None,
                    source_name: None,
                };
                writer.append(meta, payload).await.map(|_| ()).map_err(anyhow::Error::from)
            }
        }
    };
    // Warm up until one capture is listed: the clock starts with the pipeline up (lease held), as for the child.
    let warm_up = Uuid::now_v7();
    append(warm_up).await?;
    follower.wait_for(&mut HashSet::from([warm_up.to_string()]), Duration::from_secs(120), |_, _| {}).await?;

    let ids: Arc<Vec<Uuid>> = Arc::new((0..captures).map(|_| Uuid::now_v7()).collect());
    let first_version = follower.after_version;
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut producers = tokio::task::JoinSet::new();
    for _ in 0..LIBRARY_PRODUCERS {
        let (ids, next, append) = (ids.clone(), next.clone(), append.clone());
        producers.spawn(async move {
            loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&capture_id) = ids.get(index) else { return Ok::<(), anyhow::Error>(()) };
                append(capture_id).await?;
            }
        });
    }
    let producing = async {
        while let Some(produced) = producers.join_next().await {
            produced??;
        }
        Ok::<(), anyhow::Error>(())
    };
    let (produced, followed) =
        tokio::join!(producing, follower.wait_for_published(captures, Duration::from_secs(1800)));
    produced?;
    followed?;
    let seconds = started.elapsed().as_secs_f64();
    follower.verify_listed(first_version, &ids).await?;

    let latencies_ms = latency_phase(&mut follower, |capture_id| {
        let append = &append;
        async move { append(Uuid::parse_str(&capture_id)?).await }
    })
    .await?;
    let peak_rss_mib = peak_rss_mib(std::process::id())?;
    let _ = shutdown_tx.send(true);
    drop(writer);
    daemon.await??;
    Ok(E2eRun { seconds, latencies_ms, peak_rss_mib })
}

/// Hands over [`LATENCY_CAPTURES`] captures through `submit` (which resolves on the acknowledgement), one every
/// [`LATENCY_INTERVAL`], while following the catalog; returns each capture's ack -> listed time in milliseconds.
async fn latency_phase<F, Fut>(follower: &mut CatalogFollower, submit: F) -> anyhow::Result<Vec<f64>>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let ids: Vec<String> = (0..LATENCY_CAPTURES).map(|_| Uuid::now_v7().to_string()).collect();
    let mut waiting: HashSet<String> = ids.iter().cloned().collect();
    let mut listed_at = HashMap::new();
    let following = follower.wait_for(&mut waiting, Duration::from_secs(300), |capture_id, at| {
        listed_at.insert(capture_id.to_string(), at);
    });
    let submitting = async {
        let mut acked_at = HashMap::new();
        let mut ticks = tokio::time::interval(LATENCY_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for capture_id in &ids {
            ticks.tick().await;
            submit(capture_id.clone()).await?;
            acked_at.insert(capture_id.clone(), Instant::now());
        }
        Ok::<_, anyhow::Error>(acked_at)
    };
    let (acked_at, followed) = tokio::join!(submitting, following);
    let (acked_at, ()) = (acked_at?, followed?);
    Ok(ids.iter().map(|id| listed_at[id].saturating_duration_since(acked_at[id]).as_secs_f64() * 1000.0).collect())
}

fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    let kib = std::fs::read_to_string(format!("/proc/{pid}/status"))?
        .lines()
        .find_map(|line| {
            line.strip_prefix("VmHWM:").map(|rest| rest.trim().trim_end_matches(" kB").trim().parse::<f64>())
        })
        .transpose()?
        .unwrap_or(0.0);
    Ok(kib / 1024.0)
}

/// Follows the catalog by version, as a consumer tailing "everything after version N" does.
struct CatalogFollower {
    reader: crate::catalog::query::CatalogReader,
    after_version: u64,
}

impl CatalogFollower {
    /// Until the publishes committed after `after_version` cover `expected` captures: the instant they are all listed,
    /// since a publish row is what makes its captures visible. Reads only the publishes table, so the throughput
    /// clock does not include reading every capture back (see [`Self::verify_listed`], run after it).
    async fn wait_for_published(&mut self, expected: u64, timeout: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut published = 0;
        while published < expected {
            anyhow::ensure!(
                started.elapsed() < timeout,
                "{} captures were not published in {timeout:?}",
                expected - published
            );
            let publishes = self.reader.publishes_after(self.after_version, 1000).await?;
            for publish in &publishes {
                published += publish.captures;
                self.after_version = publish.version;
            }
            if publishes.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        anyhow::ensure!(published == expected, "{published} captures were published for {expected} produced");
        Ok(())
    }

    /// Every one of `ids` is listed in a version after `first_version` (read back from the catalog, untimed).
    async fn verify_listed(&mut self, first_version: u64, ids: &[Uuid]) -> anyhow::Result<()> {
        let last_version = self.after_version;
        self.after_version = first_version;
        let mut waiting: HashSet<String> = ids.iter().map(Uuid::to_string).collect();
        self.wait_for(&mut waiting, Duration::from_secs(60), |_, _| {}).await?;
        self.after_version = self.after_version.max(last_version);
        Ok(())
    }

    /// Until every id in `waiting` is listed; `on_listed` gets each one with the instant it was seen.
    async fn wait_for(
        &mut self,
        waiting: &mut std::collections::HashSet<String>,
        timeout: Duration,
        mut on_listed: impl FnMut(&str, Instant),
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        while !waiting.is_empty() {
            anyhow::ensure!(started.elapsed() < timeout, "{} captures were not listed in {timeout:?}", waiting.len());
            let publishes = self.reader.publishes_after(self.after_version, 1000).await?;
            for publish in &publishes {
                let listed = self.reader.captures_of_version(publish.version).await?;
                let now = Instant::now();
                for capture in listed {
                    if waiting.remove(&capture.capture_id) {
                        on_listed(&capture.capture_id, now);
                    }
                }
                self.after_version = publish.version;
            }
            if publishes.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }
}
