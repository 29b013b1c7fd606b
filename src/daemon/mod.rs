//! `capstore run`: the daemon, wiring every part in its start order and taking it down in one place.
//!
//! Start order: config (checked by the caller) -> signals -> spool lock -> spool recovery -> writer + inbox ingest
//! (READY=1 for systemd: from here on captures are accepted; [`systemd`] also sends status lines and watchdog pings) -> HTTP (a bind failure is fatal; its catalog reads
//! start working once the catalog is connected) -> bucket -> catalog connect + schema (retried with backoff:
//! ClickHouse being down delays publishing, never ingest) -> lease with the start wait -> owed packs -> reconcile
//! (by upload intents; by a listing once if the catalog has no intent mark and `catalog.reconcile_on_start`) -> the loop.
//!
//! States: `intake` (`Running::start` returned: captures are accepted and acknowledged), `publishing` (the lease is
//! held and the loop runs), `draining` (intake stopped: HTTP writes answer 503, the open pack is sealed, what fits in
//! `shutdown_grace` is uploaded and published), `stopped` (`Running::shutdown`: the lease released, HTTP stopped
//! last, the final status written). Every way out, fatal or not, passes through `Running::shutdown`.
//!
//! The loop: publish what is owed, then upload sealed packs (only while the lease is held and nothing is owed), then
//! wait for a new sealed pack, a lease state change (a re-acquired lease wakes it at once), the error backoff
//! ([`crate::retry`]) or shutdown. The lease renews on its own task, never delayed by the loop.
//!
//! Signals: the first SIGTERM/SIGINT (STOPPING=1 for systemd, and more stop time while the drain makes progress) stops
//! intake, seals the open pack, uploads and publishes what fits in
//! `shutdown_grace`, releases the lease (tombstone) and exits 0; a second signal exits at once with code 1 (still safe:
//! the spool is durable). SIGHUP is logged and ignored: configuration is read once, so apply changes with a restart.
//! A latch (another publisher holds the catalog for 2 x TTL) seals the open pack and exits 3; a spool owned by another
//! process exits 4 at once.

mod systemd;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::bucket::Bucket;
use crate::catalog::lease::{LeaseHandle, LeaseKeeper, LeaseState, RunningLease, StartError};
use crate::catalog::publish::Publisher;
use crate::catalog::purge::RowPurge;
use crate::catalog::query::CatalogReader;
use crate::catalog::retired::RetiredPacks;
use crate::catalog::{CatalogClient, Tables};
use crate::config::Config;
use crate::exit_code;
use crate::http::HttpServer;
use crate::pipeline::compaction::Compactor;
use crate::pipeline::deletion::Deleter;
use crate::pipeline::retention::Retention;
use crate::pipeline::status::{status_file_loop, write_status, StatusBoard};
use crate::pipeline::{off_runtime, Pipeline, PublishedPacks, RoundError};
use crate::reader::{LocalSpool, Reader};
use crate::retry::{OutageLog, RetryPolicy};
use crate::spool::inbox::{Ingestor, UnlinkLog};
use crate::spool::writer::{spawn_writer, SpoolWriter, WriterSettings, WriterThread};
use crate::spool::{Spool, SpoolError};
use systemd::{Phase, Systemd};

/// The loop's wait when nothing moved and nothing woke it.
const IDLE_TICK: Duration = Duration::from_secs(1);
/// Backoff of the catalog connect, of failed pipeline rounds and of the drain.
const DEPENDENCY_RETRY: RetryPolicy = RetryPolicy::unbounded(Duration::from_millis(100), Duration::from_secs(5));

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Spool(#[from] SpoolError),
    #[error("bucket: {0}")]
    Bucket(#[from] crate::bucket::BucketError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("catalog: {0}")]
    Schema(#[from] crate::catalog::schema::SchemaError),
    #[error(transparent)]
    Http(#[from] crate::http::HttpError),
}

impl DaemonError {
    pub fn exit_code(&self) -> i32 {
        match self {
            DaemonError::Spool(SpoolError::Locked(_)) => exit_code::SPOOL_OWNED,
            DaemonError::Config(_) => exit_code::CONFIG_OR_USAGE,
            DaemonError::Bucket(error) if error.kind == crate::bucket::BucketErrorKind::Permanent => {
                exit_code::CONFIG_OR_USAGE
            }
            _ => exit_code::FATAL,
        }
    }
}

/// `capstore run`: run until a signal asks for shutdown; returns the exit code.
pub async fn run(config: Config) -> Result<i32, DaemonError> {
    // Signals first: a SIGTERM during recovery must still mean "stop cleanly".
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    spawn_signal_thread(shutdown_tx).map_err(DaemonError::Signals)?;
    run_until(config, shutdown_rx, None).await
}

/// The daemon inside the caller's process: the Rust library's way in for producers. Once ingest is up, `writer_tx`
/// receives a handle to the spool (an append through it is acknowledged once its record is fsynced, as an HTTP post
/// is); `shutdown_rx` turning true stops the daemon as SIGTERM does, after which appends answer `Closed`. Signals are
/// left to the caller.
pub async fn run_in_process(
    config: Config,
    shutdown_rx: watch::Receiver<bool>,
    writer_tx: tokio::sync::oneshot::Sender<SpoolWriter>,
) -> Result<i32, DaemonError> {
    run_until(config, shutdown_rx, Some(writer_tx)).await
}

async fn run_until(
    config: Config,
    mut shutdown_rx: watch::Receiver<bool>,
    writer_tx: Option<tokio::sync::oneshot::Sender<SpoolWriter>>,
) -> Result<i32, DaemonError> {
    // Every way in (the binary, the library) gets the same checks: nothing runs on a configuration that breaks a rule.
    config.validate()?;
    let mut running = Running::start(Arc::new(config), writer_tx).await?;
    let ended = running.publish_until_stopped(&mut shutdown_rx).await;
    running.shutdown().await;
    match &ended {
        Ok(code) => tracing::info!(exit_code = code, "stopped"),
        Err(error) => tracing::error!(%error, "stopped"),
    }
    ended
}

/// Intake: the inbox ingest task and the spool writer, stopped together.
struct Intake {
    ingest_stop_tx: watch::Sender<bool>,
    ingest_task: tokio::task::JoinHandle<()>,
    writer: SpoolWriter,
    writer_thread: WriterThread,
}

impl Intake {
    /// Stop taking inbox files, finish those in flight, then close the writer (it seals the open pack) and join it.
    async fn stop(self) {
        let _ = self.ingest_stop_tx.send(true);
        let _ = self.ingest_task.await;
        self.writer.close();
        drop(self.writer);
        let writer_thread = self.writer_thread;
        let _ = tokio::task::spawn_blocking(move || writer_thread.join()).await;
    }
}

/// A daemon from "ingest up" on: everything that must be stopped, in order, however the run ends.
struct Running {
    config: Arc<Config>,
    spool: Spool,
    board: Arc<StatusBoard>,
    /// A handle for the loop (it waits on seals); the intake's own handle is what closes the writer.
    writer: SpoolWriter,
    intake: Option<Intake>,
    http: Option<HttpServer>,
    /// Inbox unlinks the indexer makes durable before a published pack leaves the spool.
    inbox_unlinks: Arc<UnlinkLog>,
    /// Where the indexer announces published packs, for HTTP's `wait=published`.
    published: Arc<PublishedPacks>,
    status_task: tokio::task::JoinHandle<()>,
    systemd: Systemd,
    lease: Option<RunningLease>,
}

impl Running {
    /// Spool (lock, recovery), writer, ingest, status, READY=1, HTTP.
    async fn start(
        config: Arc<Config>,
        writer_tx: Option<tokio::sync::oneshot::Sender<SpoolWriter>>,
    ) -> Result<Running, DaemonError> {
        // Recovery reads every pack of the spool (and waits to try an unreadable one again): off the async threads,
        // which a library caller's runtime may have only one of.
        let spool_config = config.spool.clone();
        let (spool, recovery) =
            tokio::task::spawn_blocking(move || Spool::open(&spool_config)).await.unwrap_or_else(|stopped| {
                match stopped.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    Err(cancelled) => {
                        Err(SpoolError::Io { dir: config.spool.dir.clone(), source: std::io::Error::other(cancelled) })
                    }
                }
            })?;
        let paths = spool.paths().clone();
        let (writer, writer_thread) =
            spawn_writer(paths.clone(), WriterSettings::from_config(&config.spool), spool.index());
        let ingestor = Ingestor::new(
            paths.clone(),
            spool.inbox(),
            spool.inbox_ledger(),
            writer.clone(),
            config.spool.max_capture_bytes.0,
            config.spool.inbox_rescan_interval.0,
        );
        let inbox_unlinks = ingestor.unlinks();
        let board = Arc::new(StatusBoard::new(
            config.clone(),
            paths.clone(),
            spool.id().to_string(),
            recovery,
            writer.stats().clone(),
            ingestor.stats(),
        ));
        let (ingest_stop_tx, ingest_stop_rx) = watch::channel(false);
        let intake = Intake {
            ingest_stop_tx,
            ingest_task: tokio::spawn(ingestor.run(ingest_stop_rx)),
            writer: writer.clone(),
            writer_thread,
        };
        let status_task = tokio::spawn(status_file_loop(board.clone()));
        let systemd = Systemd::ready(board.clone());
        tracing::info!(spool = %paths.root.display(), spool_id = %spool.id(), "ingest ready");
        if let Some(writer_tx) = writer_tx {
            let _ = writer_tx.send(writer.clone());
        }
        let mut running = Running {
            config,
            spool,
            board,
            writer,
            intake: Some(intake),
            http: None,
            inbox_unlinks,
            published: Arc::default(),
            status_task,
            systemd,
            lease: None,
        };
        let max_capture_bytes = running.config.spool.max_capture_bytes.0;
        let (board, writer, published) = (running.board.clone(), running.writer.clone(), running.published.clone());
        match HttpServer::start(&running.config.http, board, writer, published, max_capture_bytes).await {
            Ok(http) => running.http = Some(http),
            Err(error) => {
                running.shutdown().await;
                return Err(error.into());
            }
        }
        Ok(running)
    }

    /// Connect, take the lease and publish until shutdown or a latch; drains before returning on shutdown.
    async fn publish_until_stopped(&mut self, shutdown_rx: &mut watch::Receiver<bool>) -> Result<i32, DaemonError> {
        let config = self.config.clone();
        let paths = self.spool.paths().clone();
        let bucket = Arc::new(Bucket::from_config(&config)?);
        let Some((client, tables)) = connect_until_ready(&config, &self.board, shutdown_rx).await? else {
            tracing::info!("shutdown before the catalog was reachable: sealing the open pack");
            return Ok(exit_code::CLEAN);
        };
        self.board.set_clickhouse_version(client.server_version().to_string());
        if let Some(http) = &self.http {
            let catalog = CatalogReader::new(client.clone(), tables.clone(), &config.catalog_name);
            let spool = LocalSpool { paths: paths.clone(), index_opt: Some(self.spool.index()) };
            http.state().set_reader(Reader::new(catalog, bucket.clone(), Some(spool)));
        }

        let renew_latency = self.board.lease_renew_latency.clone();
        let keeper = LeaseKeeper::for_catalog(&client, &tables, &config, self.spool.id())
            .observe_renewals(move |took| renew_latency.observe(took));
        self.board.set_lease(keeper.handle());
        let running_lease = match keeper.start(config.start_wait(), shutdown_rx).await {
            Ok(running_lease) => running_lease,
            Err(error @ StartError::Refused { .. }) => {
                tracing::error!(%error, "cannot publish: the catalog is held by another publisher");
                eprintln!("capstore: {error}");
                return Ok(exit_code::CATALOG_HELD);
            }
            Err(StartError::Shutdown) => return Ok(exit_code::CLEAN),
        };
        let lease = running_lease.handle().clone();
        self.lease = Some(running_lease);
        let publisher = Arc::new(Publisher::new(client.clone(), tables.clone(), &config.catalog_name, lease.clone()));
        // The pipeline's own bucket handle reports its request attempts as the pipeline's progress (HTTP reads, on the
        // other handle, must not vouch for a stuck pipeline).
        let counters = Arc::new(crate::pipeline::PipelineCounters::default());
        let pipeline_bucket = Arc::new(Bucket::from_config(&config)?.with_liveness(counters.liveness.clone()));
        let mut pipeline = Pipeline::new(config.clone(), paths.clone(), pipeline_bucket, publisher, lease.clone());
        pipeline.counters = counters;
        pipeline.inbox_unlinks = Some(self.inbox_unlinks.clone());
        pipeline.published = self.published.clone();
        pipeline.spool_index = self.spool.index();
        pipeline.stopping = Some(shutdown_rx.clone());
        let catalog_reader = CatalogReader::new(client.clone(), tables.clone(), &config.catalog_name);
        let deleter = Arc::new(Deleter::for_pipeline(&pipeline, catalog_reader.clone()));
        if let Some(http) = &self.http {
            http.state().set_deleter(deleter.clone());
        }
        // Whether a retention horizon can drop whole months (tables created by schema 6 or newer); unknown counts as
        // no, which only means per-capture retention.
        let partitioned = crate::catalog::schema::partitioned(&client, &tables).await.unwrap_or_else(|error| {
            tracing::warn!(%error, "cannot tell whether the catalog tables are partitioned; retention goes capture by capture");
            false
        });
        let retention = Retention::from_config(&config, deleter, partitioned).map(|retention| {
            let stopping = shutdown_rx.clone();
            let lease = lease.clone();
            tokio::spawn(crate::pipeline::run_passes(retention, lease, stopping))
        });
        let retired = RetiredPacks::new(client.clone(), tables.clone(), &config.catalog_name);
        let purge = RowPurge::new(client.clone(), tables.clone(), &config.catalog_name).partitioned(partitioned);
        let compaction = Compactor::for_pipeline(&pipeline, catalog_reader.clone(), retired, purge).map(|compactor| {
            let stopping = shutdown_rx.clone();
            let lease = lease.clone();
            tokio::spawn(crate::pipeline::run_passes(compactor, lease, stopping))
        });
        self.board.set_pipeline_counters(pipeline.counters.clone());
        self.systemd.set_phase(Phase::Publishing);
        tracing::info!(
            catalog = %config.catalog_name,
            bucket = %crate::config::units::redact_url(&config.bucket.url),
            spool = %paths.root.display(),
            clickhouse_version = %client.server_version(),
            lease_state = ?lease.state(),
            lease_term = lease.status().lease_term,
            "capstore running"
        );

        // Owed packs first, then reconcile, then the loop.
        match pipeline.index_round().await {
            // Not held with time enough, or a takeover's embargo: the loop publishes once it is.
            Ok(_) | Err(RoundError::NoLease) => {}
            Err(error) => tracing::warn!(%error, "publishing owed packs at start failed; the loop retries"),
        }
        // The uploader's gate would do it before the first upload; done here so status shows it from the start.
        if let Some(permit) = lease.permit() {
            match pipeline.ensure_reconciled(&permit).await {
                Ok(Some(report)) => self.board.set_reconcile(report),
                Ok(None) => {}
                Err(RoundError::Stopped) => tracing::info!("reconcile at start interrupted by the shutdown"),
                Err(error) => tracing::warn!(%error, "reconcile at start failed; the uploader retries it first"),
            }
        }

        if run_loop(&pipeline, &self.writer, &lease, shutdown_rx).await == LoopEnd::Latched {
            tracing::error!("lease latched: sealing the open pack and exiting");
            return Ok(exit_code::CATALOG_HELD);
        }
        // Each stops between two steps once it sees the shutdown; one in flight is given a moment to land (a publish
        // runs on a task of its own, which the abort does not cut).
        for mut lifecycle_task in [retention, compaction].into_iter().flatten() {
            if tokio::time::timeout(Duration::from_secs(5), &mut lifecycle_task).await.is_err() {
                lifecycle_task.abort();
            }
        }
        tracing::info!(grace = ?config.shutdown_grace.0, "shutting down: intake stopped, sealing the open pack");
        self.stop_intake().await;
        drain(&pipeline, config.shutdown_grace.0, &self.systemd).await;
        Ok(exit_code::CLEAN)
    }

    /// Stop accepting captures (HTTP writes answer 503 from here on) and seal the open pack. Idempotent.
    async fn stop_intake(&mut self) {
        self.systemd.stopping();
        if let Some(http) = &self.http {
            http.state().close_intake();
        }
        if let Some(intake) = self.intake.take() {
            intake.stop().await;
        }
    }

    /// The one way down: intake, then the lease (released if held), then HTTP, then the final status.
    async fn shutdown(mut self) {
        self.stop_intake().await;
        if let Some(lease) = self.lease.take() {
            lease.stop().await;
        }
        if let Some(http) = self.http.take() {
            http.stop().await;
        }
        self.status_task.abort();
        self.systemd.stop();
        let board = self.board.clone();
        let root = self.spool.paths().root.clone();
        if let Err(error) = off_runtime(move || write_status(&root, &board.snapshot())).await {
            tracing::debug!(%error, "cannot write the final status.json");
        }
        drop(self.spool);
    }
}

/// Connect and ensure the schema, retrying with capped backoff until it works or shutdown is requested. A schema
/// newer than this build is fatal (retrying cannot fix it).
async fn connect_until_ready(
    config: &Config,
    board: &StatusBoard,
    shutdown_rx: &mut watch::Receiver<bool>,
) -> Result<Option<(CatalogClient, Tables)>, DaemonError> {
    let mut backoff = DEPENDENCY_RETRY.start();
    let mut outage = OutageLog::new("catalog unreachable; ingest continues, publishing waits");
    loop {
        if *shutdown_rx.borrow() {
            return Ok(None);
        }
        match crate::catalog::connect(config).await {
            Ok(connected) => {
                outage.recovered();
                return Ok(Some(connected));
            }
            Err(error @ crate::catalog::schema::SchemaError::TooNew { .. }) => return Err(error.into()),
            Err(error) => {
                outage.failed(&error);
                board.set_last_error(error.to_string());
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay_unbounded()) => {}
            _ = shutdown_rx.changed() => {}
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum LoopEnd {
    Shutdown,
    Latched,
}

/// The steady state, until shutdown or a latch.
async fn run_loop(
    pipeline: &Pipeline,
    writer: &SpoolWriter,
    lease: &LeaseHandle,
    shutdown_rx: &mut watch::Receiver<bool>,
) -> LoopEnd {
    let mut lease_rx = lease.subscribe();
    let mut backoff = DEPENDENCY_RETRY.start();
    let mut publish_outage = OutageLog::new("publishing failed; backing off");
    let mut upload_outage = OutageLog::new("upload failed; backing off");
    loop {
        if *shutdown_rx.borrow() {
            return LoopEnd::Shutdown;
        }
        if lease.state() == LeaseState::Failed {
            return LoopEnd::Latched;
        }
        let mut moved = 0;
        let busy = pipeline.counters.liveness.busy();
        let mut failed = !count_round(pipeline.index_round().await, &mut publish_outage, &mut moved);
        if !failed {
            failed = !count_round(pipeline.upload_round().await, &mut upload_outage, &mut moved);
        }
        drop(busy);
        let pause = if failed {
            backoff.next_delay_unbounded()
        } else {
            backoff.reset();
            if moved > 0 {
                continue;
            }
            IDLE_TICK
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = writer.stats().sealed_notify.notified() => {}
            _ = lease_rx.changed() => {
                if *lease_rx.borrow_and_update() == LeaseState::Held {
                    backoff.reset();
                }
            }
            _ = shutdown_rx.changed() => {}
        }
    }
}

/// Adds a round's packs to `moved` and logs its outcome; false when the round failed (the loop backs off). A round
/// that did not run for want of the lease is no failure: the lease keeper is on it.
fn count_round(round: Result<usize, RoundError>, outage: &mut OutageLog, moved: &mut usize) -> bool {
    match round {
        Ok(count) => {
            *moved += count;
            outage.recovered();
            true
        }
        Err(RoundError::NoLease | RoundError::Stopped) => true,
        Err(error) => {
            outage.failed(&error);
            false
        }
    }
}

/// After a drain step that moved packs, systemd's stop timeout is extended by this much (never past the grace, plus
/// the lease release and HTTP stop that follow).
const DRAIN_PROGRESS_WINDOW: Duration = Duration::from_secs(10);
const AFTER_DRAIN: Duration = Duration::from_secs(5);

/// Upload and publish what fits in the shutdown grace; while that makes progress, systemd is told to wait.
async fn drain(pipeline: &Pipeline, grace: Duration, systemd: &Systemd) {
    let deadline = Instant::now() + grace;
    let work = async {
        let mut backoff = DEPENDENCY_RETRY.start();
        loop {
            let indexed = pipeline.index_round().await;
            let uploaded = pipeline.upload_round().await;
            let moved = matches!((&indexed, &uploaded), (Ok(published), Ok(uploaded)) if published + uploaded > 0);
            if moved {
                let left = deadline.saturating_duration_since(Instant::now());
                systemd.extend_stop_timeout(left.min(DRAIN_PROGRESS_WINDOW) + AFTER_DRAIN);
            }
            let paths = pipeline.paths.clone();
            let remaining = off_runtime(move || crate::spool::list_packs(&paths)).await.map_or(0, |packs| packs.len());
            if remaining == 0 {
                tracing::info!("spool drained");
                return;
            }
            if moved {
                backoff.reset();
            } else {
                tokio::time::sleep(backoff.next_delay_unbounded()).await;
            }
        }
    };
    if tokio::time::timeout_at(deadline.into(), work).await.is_err() {
        tracing::warn!(?grace, "shutdown grace over; what remains stays in the spool for the next start");
    }
}

/// First SIGTERM/SIGINT: ask for a graceful stop. Second: exit at once (the spool is durable, so this is safe).
fn spawn_signal_thread(shutdown_tx: watch::Sender<bool>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let stopping = Arc::new(AtomicBool::new(false));
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for signal in signals.forever() {
            if signal == SIGHUP {
                tracing::info!("SIGHUP ignored: configuration is read at start; restart to apply changes");
                continue;
            }
            if stopping.swap(true, Ordering::SeqCst) {
                tracing::warn!(signal, "second signal: exiting at once");
                std::process::exit(exit_code::FATAL);
            }
            tracing::info!(signal, "shutdown requested");
            let _ = shutdown_tx.send(true);
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::publish::PublishError;

    #[test]
    fn a_round_that_lost_the_lease_partway_is_no_failure_and_a_catalog_error_is() {
        let mut outage = OutageLog::new("test");
        let mut moved = 0;
        assert!(count_round(Err(PublishError::NoLease.into()), &mut outage, &mut moved));
        assert!(!count_round(Err(PublishError::NotCommitted.into()), &mut outage, &mut moved));
        assert!(count_round(Ok(3), &mut outage, &mut moved));
        assert_eq!(moved, 3);
    }
}
