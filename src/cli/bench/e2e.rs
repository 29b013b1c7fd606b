//! `capstore bench e2e`: end to end through a real daemon (captures/s, MB/s, ack -> listed latency, peak RSS), beside
//! `rclone copy` of the same captures as individual objects to the same bucket, in the same run.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use uuid::Uuid;

use capstore::capture::CaptureMeta;
use capstore::catalog::query::CatalogReader;

use super::deterministic_payload as expected_payload;

/// How long the daemon may take to start publishing (the lease's start wait included).
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// A throughput phase fails when no new publish arrives for this long.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A `capstore run` child tied to the bench: SIGTERMed when the bench exits however it exits (the kernel sends it
/// when the bench process dies), and when this value drops on an error path.
struct ChildDaemon {
    child: Option<Child>,
    log_path: PathBuf,
}

impl ChildDaemon {
    fn spawn(mut command: Command, log_path: PathBuf) -> anyhow::Result<ChildDaemon> {
        let bench_pid = std::process::id() as i32;
        // SAFETY: the closure runs in the forked child before exec and calls only async-signal-safe functions.
        #[allow(unsafe_code, reason = "pre_exec: only async-signal-safe calls between fork and exec")]
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM).map_err(std::io::Error::from)?;
                // The bench may have died between fork and prctl: then nobody would signal us.
                if nix::unistd::getppid().as_raw() != bench_pid {
                    return Err(std::io::Error::other("the bench is already gone"));
                }
                Ok(())
            });
        }
        let child = command.spawn().context("cannot start the `capstore run` child")?;
        Ok(ChildDaemon { child: Some(child), log_path })
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Until the child logs `needle`; an error naming the log (and the catalog it tried) if it exits or takes longer
    /// than `timeout`.
    async fn wait_for_log(
        &mut self,
        needle: &str,
        timeout: Duration,
        config: &capstore::config::Config,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            if std::fs::read_to_string(&self.log_path)?.contains(needle) {
                return Ok(());
            }
            let child = self.child.as_mut().expect("the child runs until stop");
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "the daemon exited ({status}) before it logged {needle:?}; its log {}:\n{}",
                    self.log_path.display(),
                    self.log_tail()
                );
            }
            anyhow::ensure!(
                started.elapsed() < timeout,
                "the daemon did not log {needle:?} within {timeout:?} (catalog.url = {}); its log {}:\n{}",
                config.catalog.url,
                self.log_path.display(),
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM (the daemon drains and releases its lease) and wait.
    fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM)?;
            child.wait()?;
        }
        Ok(())
    }
}

impl Drop for ChildDaemon {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// How the e2e bench hands captures to capstore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum E2eProducer {
    /// Files in the inbox of a `capstore run` child (the latency phase posts over its HTTP API).
    Inbox,
    /// Appends through the Rust library to a daemon in the bench's own process
    /// ([`capstore::daemon::run_in_process`]).
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
    /// `seconds` in units of `spool.pack_max_age`: below about 10, linger and the last publish dominate the figure.
    pub seconds_per_pack_max_age: f64,
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
    pub config: capstore::config::Config,
    /// The file the configuration came from (`--config`), handed to the `capstore run` child: the child also
    /// inherits the environment, so it runs with exactly the bench's configuration.
    pub config_path: Option<PathBuf>,
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
                E2eProducer::Inbox => {
                    run_inbox(config, options.config_path.as_deref(), &run_dir, &staging, &ids, capture_bytes).await?
                }
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
                seconds_per_pack_max_age: run.seconds / options.config.spool.pack_max_age.0.as_secs_f64(),
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

async fn follower_for(config: &capstore::config::Config) -> anyhow::Result<CatalogFollower> {
    let reader = capstore::catalog::connect_reader(config)
        .await
        .with_context(|| format!("the bench cannot reach the catalog at {}", config.catalog.url))?;
    Ok(CatalogFollower { reader, after_version: 0 })
}

/// The inbox producer against a `capstore run` child.
async fn run_inbox(
    config: capstore::config::Config,
    config_path: Option<&Path>,
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
    let mut command = Command::new(std::env::current_exe()?);
    if let Some(path) = config_path {
        command.arg("--config").arg(path);
    }
    command
        .arg("run")
        .env("CAPSTORE_SPOOL_DIR", &config.spool.dir)
        .env("CAPSTORE_CATALOG_NAME", &config.catalog_name)
        .env("CAPSTORE_HTTP_LISTEN", http_listen.to_string())
        // The bench waits for the start line, which is logged at info.
        .env("CAPSTORE_LOG_LEVEL", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path)?);
    let mut child = ChildDaemon::spawn(command, log_path)?;
    child.wait_for_log("capstore running", START_TIMEOUT, &config).await?;
    let mut follower = follower_for(&config).await?;

    let first_version = follower.after_version;
    let started = Instant::now();
    #[allow(clippy::disallowed_methods, reason = "the bench plays a producer, and producers rename into the inbox")]
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

    let peak_rss_mib = peak_rss_mib(child.pid())?;
    child.stop()?;
    Ok(E2eRun { seconds, latencies_ms, peak_rss_mib })
}

/// The library producer against a daemon in this process.
async fn run_library(config: capstore::config::Config, capture_bytes: u64, captures: u64) -> anyhow::Result<E2eRun> {
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let (writer_tx, writer_rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(capstore::daemon::run_in_process(config.clone(), shutdown_rx, writer_tx));
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
                    captured_at_ns: capstore::util::now_ns(),
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
    follower.wait_for(&mut HashSet::from([warm_up.to_string()]), START_TIMEOUT, |_, _| {}).await?;

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
    reader: CatalogReader,
    after_version: u64,
}

impl CatalogFollower {
    /// Until the publishes committed after `after_version` cover `expected` captures: the instant they are all listed,
    /// since a publish row is what makes its captures visible. Reads only the publishes table, so the throughput
    /// clock does not include reading every capture back (see [`Self::verify_listed`], run after it).
    async fn wait_for_published(&mut self, expected: u64, timeout: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut last_progress = Instant::now();
        let mut published = 0;
        while published < expected {
            anyhow::ensure!(
                started.elapsed() < timeout && last_progress.elapsed() < STALL_TIMEOUT,
                "{} of {expected} captures were not published: nothing new for {:?} ({:?} in all); see the daemon's log",
                expected - published,
                last_progress.elapsed(),
                started.elapsed(),
            );
            let publishes = self.reader.publishes_after(self.after_version, 1000).await?;
            for publish in &publishes {
                published += publish.captures;
                self.after_version = publish.version;
                last_progress = Instant::now();
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
