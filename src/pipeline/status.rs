//! The status snapshot: every lease field, spool counts per state, pipeline counters. `StatusBoard` collects the
//! daemon's parts as the start order brings them up; `status_file_loop` writes its snapshot once a second into
//! `<spool>/status.json` (atomically replaced, not fsynced: it is a view, not state), which `capstore status` prints,
//! and the HTTP API serves the same snapshot and its metrics.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::reconcile::ReconcileReport;
use super::PipelineCounters;
use crate::catalog::lease::{LeaseHandle, LeaseState};
use crate::config::Config;
use crate::spool::inbox::IngestStats;
use crate::spool::writer::WriterStats;
use crate::spool::{list_packs, PackState, RecoveryReport, SpoolPaths};

/// How often `status.json` is rewritten.
const STATUS_FILE_PERIOD: Duration = Duration::from_secs(1);

pub const STATUS_FILE: &str = "status.json";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StateCount {
    pub packs: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SpoolCounts {
    pub by_state: BTreeMap<String, StateCount>,
    pub total_bytes: u64,
    /// Age of the oldest pack not yet published (open, sealed or uploaded), in seconds.
    pub oldest_unpublished_age_seconds: f64,
    /// Packs in `quarantine/packs`, whenever they were moved there (at a start, or by a process before this one):
    /// they wait for an operator. None when that directory cannot be read (the rest is measured all the same).
    pub packs_in_quarantine: Option<u64>,
}

impl SpoolCounts {
    pub fn measure(paths: &SpoolPaths) -> std::io::Result<SpoolCounts> {
        let mut counts = SpoolCounts::default();
        for state in PackState::ALL {
            counts.by_state.insert(state.extension().to_string(), StateCount::default());
        }
        for pack in list_packs(paths)? {
            let entry = counts.by_state.entry(pack.state.extension().to_string()).or_default();
            entry.packs += 1;
            entry.bytes += pack.bytes;
            counts.total_bytes += pack.bytes;
            // Pack ids are UUIDv7: their timestamp is when the pack was opened, unless it is ahead of the clock (made
            // after the clock stepped back, see `spool::writer`); then the file's last write, a later time, stands in.
            let age = crate::util::age_of_uuid_v7(pack.pack_id)
                .or_else(|| pack.modified.elapsed().ok())
                .unwrap_or_default()
                .as_secs_f64();
            counts.oldest_unpublished_age_seconds = counts.oldest_unpublished_age_seconds.max(age);
        }
        counts.packs_in_quarantine = paths
            .quarantined_packs()
            .inspect_err(|error| tracing::debug!(%error, "cannot count the packs in quarantine"))
            .ok();
        Ok(counts)
    }
}

/// Write the snapshot (any serializable value) to `<spool>/status.json`.
pub fn write_status(spool_root: &Path, snapshot: &serde_json::Value) -> std::io::Result<()> {
    let path = spool_root.join(STATUS_FILE);
    let temp = crate::durable::temp_path_for(&path);
    let contents = serde_json::to_vec_pretty(snapshot).map_err(std::io::Error::other)?;
    std::io::Write::write_all(
        &mut crate::durable::new_file_options().write(true).create_new(true).open(&temp)?,
        &contents,
    )?;
    #[allow(
        clippy::disallowed_methods,
        reason = "status.json is a view, rewritten every second: a lost rename costs nothing"
    )]
    std::fs::rename(&temp, &path)
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
    /// Every renewal of the held lease (fenced statement and read-back), sent to answered.
    pub(crate) lease_renew_latency: crate::telemetry::Latency,
    pub(crate) pipeline_counters: OnceLock<Arc<PipelineCounters>>,
    reconcile: Mutex<Option<ReconcileReport>>,
    last_error: Mutex<Option<String>>,
    /// When this process started (its spool opened): a restart shows as a new value.
    pub(crate) started_at: std::time::SystemTime,
}

impl StatusBoard {
    /// The board of a daemon whose spool is open and whose writer and ingest run; the rest is set as it comes up.
    pub(crate) fn new(
        config: Arc<Config>,
        paths: SpoolPaths,
        spool_id: String,
        recovery: RecoveryReport,
        writer_stats: Arc<WriterStats>,
        ingest_stats: Arc<IngestStats>,
    ) -> StatusBoard {
        StatusBoard {
            config,
            paths,
            spool_id,
            recovery,
            writer_stats,
            ingest_stats,
            clickhouse_version: OnceLock::new(),
            lease: OnceLock::new(),
            lease_renew_latency: crate::telemetry::Latency::between(0.001, 60.0),
            pipeline_counters: OnceLock::new(),
            reconcile: Mutex::new(None),
            last_error: Mutex::new(None),
            started_at: std::time::SystemTime::now(),
        }
    }

    pub(crate) fn set_clickhouse_version(&self, version: String) {
        let _ = self.clickhouse_version.set(version);
    }

    pub(crate) fn set_lease(&self, lease: LeaseHandle) {
        let _ = self.lease.set(lease);
    }

    pub(crate) fn set_pipeline_counters(&self, counters: Arc<PipelineCounters>) {
        let _ = self.pipeline_counters.set(counters);
    }

    pub(crate) fn set_reconcile(&self, report: ReconcileReport) {
        *self.reconcile.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
    }

    /// The latest error of the daemon's own start-up (the lease keeps its own).
    pub(crate) fn set_last_error(&self, error: String) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The snapshot as JSON. Blocking: it lists the spool's packs (call it off the runtime).
    pub(crate) fn snapshot(&self) -> serde_json::Value {
        let lease = self.lease.get().map(|lease| lease.status());
        let ingest = &self.ingest_stats;
        serde_json::json!({
            "catalog": self.config.catalog_name,
            "spool": self.paths.root.display().to_string(),
            "spool_id": self.spool_id,
            "bucket": crate::config::units::redact_url(&self.config.bucket.url),
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

/// Rewrites `<spool>/status.json` every [`STATUS_FILE_PERIOD`] until aborted.
pub(crate) async fn status_file_loop(board: Arc<StatusBoard>) {
    loop {
        let writing = board.clone();
        let written = super::off_runtime(move || write_status(&writing.paths.root, &writing.snapshot())).await;
        if let Err(error) = written {
            tracing::debug!(%error, "cannot write status.json");
        }
        tokio::time::sleep(STATUS_FILE_PERIOD).await;
    }
}
