//! `capstore run`: the supervisor.
//!
//! Start order: config (checked by the caller) -> signals -> spool lock -> spool recovery -> writer + inbox ingest
//! (READY=1 for systemd: from here on captures are accepted) -> bucket -> catalog connect + schema (retried with
//! backoff: ClickHouse being down delays publishing, never ingest) -> lease with the start wait -> owed packs ->
//! reconcile (when `catalog.reconcile_on_start`) -> the loop. The HTTP API ([`crate::http`]) serves from "ingest up" on
//! (a bind failure is fatal); its catalog reads start working once the catalog is connected. On the way out intake
//! stops first (HTTP writes answer 503) and the HTTP server stops last, after the drain.
//!
//! The loop: publish what is owed, then upload sealed packs (only while the lease is held and nothing is owed), then
//! wait for a new sealed pack, a lease state change (a re-acquired lease wakes it at once), the error backoff (capped)
//! or shutdown. The lease renews on its own task, never delayed by the loop.
//!
//! Signals: the first SIGTERM/SIGINT stops intake, seals the open pack, uploads and publishes what fits in
//! `shutdown_grace`, releases the lease (tombstone) and exits 0; a second signal exits at once with code 1 (still safe:
//! the spool is durable). SIGHUP is logged and ignored: configuration is read once, so apply changes with a restart.
//! A latch (another publisher holds the catalog for 2 x TTL) seals the open pack and exits 3; a spool owned by another
//! process exits 4 at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::reconcile::ReconcileReport;
use super::status::{write_status, SpoolCounts};
use super::{Pipeline, PipelineCounters, RoundError};
use crate::bucket::Bucket;
use crate::catalog::lease::{Identity, LeaseHandle, LeaseKeeper, LeaseState, LeaseStore, LeaseTimings, StartError};
use crate::catalog::publish::Publisher;
use crate::catalog::query::CatalogReader;
use crate::catalog::{CatalogClient, Tables};
use crate::config::Config;
use crate::exit_code;
use crate::http::HttpServer;
use crate::reader::Reader;
use crate::spool::inbox::{IngestStats, Ingestor};
use crate::spool::writer::{spawn_writer, SpoolWriter, WriterSettings, WriterStats};
use crate::spool::{RecoveryReport, Spool, SpoolError, SpoolPaths};

const IDLE_TICK: Duration = Duration::from_secs(1);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
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

impl SupervisorError {
    pub fn exit_code(&self) -> i32 {
        match self {
            SupervisorError::Spool(SpoolError::Locked(_)) => exit_code::SPOOL_OWNED,
            SupervisorError::Bucket(error) if error.kind == crate::bucket::BucketErrorKind::Permanent => {
                exit_code::CONFIG_OR_USAGE
            }
            _ => exit_code::FATAL,
        }
    }
}

/// Everything the status snapshot (and the HTTP API's /status and /metrics) reads; filled in as the start order
/// progresses.
pub(crate) struct StatusBoard {
    config: Arc<Config>,
    pub(crate) paths: SpoolPaths,
    spool_id: String,
    recovery: RecoveryReport,
    pub(crate) writer_stats: Arc<WriterStats>,
    pub(crate) ingest_stats: Arc<IngestStats>,
    clickhouse_version: OnceLock<String>,
    pub(crate) lease: OnceLock<LeaseHandle>,
    pub(crate) pipeline_counters: OnceLock<Arc<PipelineCounters>>,
    reconcile: Mutex<Option<ReconcileReport>>,
    last_error: Mutex<Option<String>>,
}

impl StatusBoard {
    pub(crate) fn snapshot(&self) -> serde_json::Value {
        let lease = self.lease.get().map(|lease| lease.status());
        let ingest = &self.ingest_stats;
        serde_json::json!({
            "catalog": self.config.catalog_name,
            "spool": self.paths.root.display().to_string(),
            "spool_id": self.spool_id,
            "bucket": self.config.bucket.url,
            "clickhouse_version": self.clickhouse_version.get(),
            "pid": std::process::id(),
            "updated_at": crate::util::now_rfc3339(),
            "lease_state": lease.as_ref().map_or(LeaseState::None, |l| l.lease_state),
            "lease_term": lease.as_ref().map_or(0, |l| l.lease_term),
            "holder": lease.as_ref().and_then(|l| l.holder.clone()),
            "quarantined_until": lease.as_ref().and_then(|l| l.quarantined_until.clone()),
            "lease_renewals": lease.as_ref().map_or(0, |l| l.lease_renewals),
            "lease_reacquisitions": lease.as_ref().map_or(0, |l| l.lease_reacquisitions),
            "lease_timeouts": lease.as_ref().map_or(0, |l| l.lease_timeouts),
            "failed": lease.as_ref().is_some_and(|l| l.failed),
            "last_error": lease.as_ref().and_then(|l| l.last_error.clone()).or_else(|| self.last_error.lock().ok()?.clone()),
            "spool_packs": SpoolCounts::measure(&self.paths).ok(),
            "writer": self.writer_stats.snapshot(),
            "ingest": {
                "files_ingested": ingest.files_ingested.load(Ordering::Relaxed),
                "files_quarantined": ingest.files_quarantined.load(Ordering::Relaxed),
                "files_deferred": ingest.files_deferred.load(Ordering::Relaxed),
            },
            "pipeline": self.pipeline_counters.get().map(|c| c.snapshot()),
            "recovery": self.recovery,
            "reconcile": *self.reconcile.lock().unwrap_or_else(|p| p.into_inner()),
        })
    }
}

/// `capstore run`: run until a signal asks for shutdown; returns the exit code.
pub async fn run(config: Config) -> Result<i32, SupervisorError> {
    // Signals first: a SIGTERM during recovery must still mean "stop cleanly".
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    spawn_signal_thread(shutdown_tx).map_err(SupervisorError::Signals)?;
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
) -> Result<i32, SupervisorError> {
    run_until(config, shutdown_rx, Some(writer_tx)).await
}

async fn run_until(
    config: Config,
    mut shutdown_rx: watch::Receiver<bool>,
    writer_tx: Option<tokio::sync::oneshot::Sender<SpoolWriter>>,
) -> Result<i32, SupervisorError> {
    let config = Arc::new(config);

    let (spool, recovery) = Spool::open(&config.spool)?;
    let paths = spool.paths().clone();
    let (writer, writer_thread) = spawn_writer(paths.clone(), WriterSettings::from_config(&config.spool));
    let ingestor = Ingestor::new(
        paths.clone(),
        writer.clone(),
        config.spool.max_capture_bytes.0,
        config.spool.inbox_rescan_interval.0,
    );
    let inbox_unlinks = ingestor.unlinks();
    let board = Arc::new(StatusBoard {
        config: config.clone(),
        paths: paths.clone(),
        spool_id: spool.id().to_string(),
        recovery: recovery.clone(),
        writer_stats: writer.stats().clone(),
        ingest_stats: ingestor.stats(),
        clickhouse_version: OnceLock::new(),
        lease: OnceLock::new(),
        pipeline_counters: OnceLock::new(),
        reconcile: Mutex::new(None),
        last_error: Mutex::new(None),
    });
    let (ingest_stop_tx, ingest_stop_rx) = watch::channel(false);
    let ingest_task = tokio::spawn(ingestor.run(ingest_stop_rx));
    let status_task = tokio::spawn(status_loop(board.clone()));
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    tracing::info!(spool = %paths.root.display(), spool_id = %spool.id(), "ingest ready");
    if let Some(writer_tx) = writer_tx {
        let _ = writer_tx.send(writer.clone());
    }

    // HTTP serves from here on: writes at once, catalog reads once the catalog is connected.
    let http_result =
        HttpServer::start(&config.http, board.clone(), writer.clone(), config.spool.max_capture_bytes.0).await;
    let http_state_opt = http_result.as_ref().ok().map(|http| http.state().clone());
    let stop_intake = |writer: SpoolWriter| async move {
        if let Some(http_state) = http_state_opt {
            http_state.close_intake();
        }
        let _ = ingest_stop_tx.send(true);
        let _ = ingest_task.await;
        writer.close();
        drop(writer);
        let _ = tokio::task::spawn_blocking(move || writer_thread.join()).await;
    };
    let http = match http_result {
        Ok(http) => http,
        Err(error) => {
            stop_intake(writer).await;
            status_task.abort();
            return Err(error.into());
        }
    };

    let bucket = match Bucket::from_config(&config) {
        Ok(bucket) => Arc::new(bucket),
        Err(error) => {
            stop_intake(writer).await;
            http.stop().await;
            return Err(error.into());
        }
    };
    let Some((client, tables)) = connect_until_ready(&config, &board, &mut shutdown_rx).await? else {
        tracing::info!("shutdown before the catalog was reachable: sealing the open pack");
        stop_intake(writer).await;
        http.stop().await;
        status_task.abort();
        return Ok(exit_code::CLEAN);
    };
    let _ = board.clickhouse_version.set(client.server_version().to_string());
    http.state().set_reader(Reader::new(
        CatalogReader::new(client.clone(), tables.clone(), &config.catalog_name),
        bucket.clone(),
        Some(paths.clone()),
    ));

    let identity = Identity { spool_id: spool.id(), host: crate::spool::lock::host_name(), pid: std::process::id() };
    let timings = LeaseTimings::from_config(&config.lease, &client);
    let keeper = LeaseKeeper::new(
        LeaseStore::new(client.clone(), &tables, &config.catalog_name, timings),
        identity,
        &config.catalog_name,
    );
    let lease = keeper.handle();
    let _ = board.lease.set(lease.clone());
    match keeper.acquire_at_start(config.start_wait(), &mut shutdown_rx).await {
        Ok(()) => {}
        Err(error @ StartError::Refused { .. }) => {
            tracing::error!(%error, "cannot publish: the catalog is held by another publisher");
            eprintln!("capstore: {error}");
            stop_intake(writer).await;
            http.stop().await;
            status_task.abort();
            return Ok(exit_code::CATALOG_HELD);
        }
        Err(StartError::Shutdown) => {
            stop_intake(writer).await;
            http.stop().await;
            status_task.abort();
            return Ok(exit_code::CLEAN);
        }
    }
    let (keeper_stop_tx, keeper_stop_rx) = watch::channel(false);
    let keeper_task = tokio::spawn(keeper.run(keeper_stop_rx));
    let publisher = Arc::new(Publisher::new(client.clone(), tables.clone(), &config.catalog_name, lease.clone()));
    let mut pipeline = Pipeline::new(config.clone(), paths.clone(), bucket, publisher, lease.clone());
    pipeline.inbox_unlinks = Some(inbox_unlinks);
    let _ = board.pipeline_counters.set(pipeline.counters.clone());
    tracing::info!(
        catalog = %config.catalog_name,
        bucket = %config.bucket.url,
        spool = %paths.root.display(),
        clickhouse_version = %client.server_version(),
        lease_state = ?lease.state(),
        lease_term = lease.status().lease_term,
        "capstore running"
    );

    // Owed packs first, then reconcile, then the loop.
    if let Err(error) = pipeline.index_round().await {
        tracing::warn!(%error, "publishing owed packs at start failed; the loop retries");
    }
    if config.catalog.reconcile_on_start {
        match pipeline.reconcile(&|_, _| {}).await {
            Ok(report) => {
                if report.published > 0 || !report.invalid.is_empty() {
                    tracing::info!(published = report.published, invalid = report.invalid.len(), "reconcile done");
                }
                *board.reconcile.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
            }
            Err(error) => tracing::warn!(%error, "reconcile at start failed; run `capstore reconcile` later"),
        }
    }

    let latched = run_loop(&pipeline, &writer, &lease, &mut shutdown_rx).await;
    if latched {
        tracing::error!("lease latched: sealing the open pack and exiting");
        stop_intake(writer).await;
        let _ = keeper_stop_tx.send(true);
        let _ = keeper_task.await;
        http.stop().await;
        status_task.abort();
        write_status(&paths.root, &board.snapshot()).ok();
        return Ok(exit_code::CATALOG_HELD);
    }

    tracing::info!(grace = ?config.shutdown_grace.0, "shutting down: intake stopped, sealing the open pack");
    stop_intake(writer).await;
    drain(&pipeline, config.shutdown_grace.0).await;
    let _ = keeper_stop_tx.send(true);
    let _ = keeper_task.await;
    http.stop().await;
    status_task.abort();
    write_status(&paths.root, &board.snapshot()).ok();
    tracing::info!(lease_state = ?lease.state(), "stopped cleanly");
    drop(spool);
    Ok(exit_code::CLEAN)
}

/// Connect and ensure the schema, retrying with capped backoff until it works or shutdown is requested. A schema
/// newer than this build is fatal (retrying cannot fix it).
async fn connect_until_ready(
    config: &Config,
    board: &StatusBoard,
    shutdown_rx: &mut watch::Receiver<bool>,
) -> Result<Option<(CatalogClient, Tables)>, SupervisorError> {
    let mut backoff = BACKOFF_FIRST;
    loop {
        if *shutdown_rx.borrow() {
            return Ok(None);
        }
        match crate::catalog::connect(config).await {
            Ok(connected) => return Ok(Some(connected)),
            Err(error @ crate::catalog::schema::SchemaError::TooNew { .. }) => return Err(error.into()),
            Err(error) => {
                tracing::warn!(%error, retry_in = ?backoff, "catalog unreachable; ingest continues, publishing waits");
                *board.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.to_string());
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown_rx.changed() => {}
        }
        backoff = (backoff * 2).min(BACKOFF_CAP);
    }
}

/// The steady state. Returns true when the lease latched.
async fn run_loop(
    pipeline: &Pipeline,
    writer: &SpoolWriter,
    lease: &LeaseHandle,
    shutdown_rx: &mut watch::Receiver<bool>,
) -> bool {
    let mut lease_rx = lease.subscribe();
    let mut backoff = BACKOFF_FIRST;
    loop {
        if *shutdown_rx.borrow() {
            return false;
        }
        if lease.state() == LeaseState::Failed {
            return true;
        }
        let mut failed = false;
        let mut moved = 0;
        match pipeline.index_round().await {
            Ok(count) => moved += count,
            Err(RoundError::NoLease) => {}
            Err(error) => {
                tracing::warn!(%error, "publishing failed; backing off");
                failed = true;
            }
        }
        if !failed {
            match pipeline.upload_round().await {
                Ok(count) => moved += count,
                Err(RoundError::NoLease) => {}
                Err(error) => {
                    tracing::warn!(%error, "upload failed; backing off");
                    failed = true;
                }
            }
        }
        let pause = if failed {
            let pause = backoff;
            backoff = (backoff * 2).min(BACKOFF_CAP);
            pause
        } else {
            backoff = BACKOFF_FIRST;
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
                    backoff = BACKOFF_FIRST;
                }
            }
            _ = shutdown_rx.changed() => {}
        }
    }
}

/// Upload and publish what fits in the shutdown grace.
async fn drain(pipeline: &Pipeline, grace: Duration) {
    let deadline = Instant::now() + grace;
    let work = async {
        let mut backoff = BACKOFF_FIRST;
        loop {
            let indexed = pipeline.index_round().await;
            let uploaded = pipeline.upload_round().await;
            let remaining = crate::spool::list_packs(&pipeline.paths).map(|packs| packs.len()).unwrap_or(0);
            if remaining == 0 {
                tracing::info!("spool drained");
                return;
            }
            match (indexed, uploaded) {
                (Ok(a), Ok(b)) if a + b > 0 => backoff = BACKOFF_FIRST,
                _ => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_CAP);
                }
            }
        }
    };
    if tokio::time::timeout_at(deadline.into(), work).await.is_err() {
        tracing::warn!(?grace, "shutdown grace over; what remains stays in the spool for the next start");
    }
}

async fn status_loop(board: Arc<StatusBoard>) {
    loop {
        if let Err(error) = write_status(&board.paths.root, &board.snapshot()) {
            tracing::debug!(%error, "cannot write status.json");
        }
        tokio::time::sleep(IDLE_TICK).await;
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
