//! The pipeline from sealed packs to published captures; [`crate::daemon`] runs it.
//!
//! - [`uploader`]: `.sealed` -> intent recorded in the catalog -> bucket -> `.uploaded`, only while the lease is held
//!   and nothing is owed (a mark only once reconciled in the lease's current tenure).
//! - [`indexer`]: `.uploaded` (the durable `pending_index`) -> fenced publish -> deleted.
//! - [`deletion`]: deletions asked for by id -> a fenced publish of tombstones (not of ids still in the spool).
//! - [`compaction`]: small published packs -> merged, packs holding deleted captures -> rewritten without them, and
//!   the replaced objects removed after the reader grace period; by the lease holder.
//! - [`retention`]: the captures older than their stream's policy keeps -> deleted, in batches, by the lease holder.
//! - [`reconcile`]: packs in the bucket that the catalog lacks (found by intents, or by a listing) -> published from
//!   their footers.
//! - [`status`]: the status board the daemon fills as it starts, its snapshot and `status.json`.
//!
//! Every stage is a round over the spool directory, so it holds no state a crash could lose: a restart at any instant
//! re-reads the directory and converges (I5, I7). A pack's life in this module:
//!
//! ```text
//! .sealed --intent, upload, HEAD verify--> .uploaded --publish committed (or already committed)--> deleted
//!    \--conflicting object in the bucket--> quarantine/packs      \--rejected max_index_attempts times--> quarantine
//! ```

pub mod compaction;
pub mod deletion;
pub mod indexer;
pub mod reconcile;
pub mod retention;
pub mod status;
pub mod uploader;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use uuid::Uuid;

use crate::bucket::Bucket;
use crate::catalog::intents::IntentLog;
use crate::catalog::lease::LeaseHandle;
use crate::catalog::publish::Publisher;
use crate::config::Config;
use crate::spool::SpoolPaths;
use crate::telemetry::{Latency, Liveness};

/// Counters of the pipeline, read by status and metrics.
#[derive(Debug)]
pub struct PipelineCounters {
    pub packs_uploaded: AtomicU64,
    pub bytes_uploaded: AtomicU64,
    pub packs_indexed: AtomicU64,
    pub captures_indexed: AtomicU64,
    pub publishes: AtomicU64,
    pub packs_quarantined: AtomicU64,
    pub packs_reconciled: AtomicU64,
    /// Captures deleted (asked for through the API, or by retention).
    pub captures_deleted: AtomicU64,
    /// Packs a compaction replaced (merged into a bigger one, or rewritten without their deleted captures).
    pub packs_compacted: AtomicU64,
    /// Bytes of captures a compaction copied into new packs.
    pub compaction_bytes_rewritten: AtomicU64,
    /// Objects of replaced packs removed from the bucket after the reader grace period.
    pub objects_removed: AtomicU64,
    /// Deleted captures whose catalog rows were removed after the reader grace period (see
    /// [`crate::catalog::purge`]).
    pub captures_purged: AtomicU64,
    /// Partitions of months below a retention horizon dropped from the catalog tables (see [`crate::catalog::purge`]).
    pub partitions_dropped: AtomicU64,
    /// Pack uploads that failed (the bucket unreachable or refusing); each is retried.
    pub upload_failures: AtomicU64,
    /// Busy while the daemon's loop runs a round; every pack uploaded, publish answered or reconcile step is progress.
    pub liveness: Liveness,
    /// One pack's upload and verification.
    pub upload_latency: Latency,
    /// One publish (its fenced statements and any read-back), sent to answered (committed, already committed, refused).
    pub publish_latency: Latency,
    /// Per published pack: from its first acknowledged capture (the pack's open, the time in its UUIDv7 id, or in its
    /// header when the id is ahead of the clock) to the publish that made it readable, which is the longest wait of any
    /// capture in the pack.
    pub ack_to_published_latency: Latency,
}

impl Default for PipelineCounters {
    fn default() -> PipelineCounters {
        PipelineCounters {
            packs_uploaded: AtomicU64::default(),
            bytes_uploaded: AtomicU64::default(),
            packs_indexed: AtomicU64::default(),
            captures_indexed: AtomicU64::default(),
            publishes: AtomicU64::default(),
            packs_quarantined: AtomicU64::default(),
            packs_reconciled: AtomicU64::default(),
            captures_deleted: AtomicU64::default(),
            packs_compacted: AtomicU64::default(),
            compaction_bytes_rewritten: AtomicU64::default(),
            objects_removed: AtomicU64::default(),
            captures_purged: AtomicU64::default(),
            partitions_dropped: AtomicU64::default(),
            upload_failures: AtomicU64::default(),
            liveness: Liveness::default(),
            upload_latency: Latency::between(0.001, 300.0),
            publish_latency: Latency::between(0.001, 60.0),
            ack_to_published_latency: Latency::between(0.01, 3600.0),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct PipelineCounts {
    pub packs_uploaded: u64,
    pub bytes_uploaded: u64,
    pub packs_indexed: u64,
    pub captures_indexed: u64,
    pub publishes: u64,
    pub packs_quarantined: u64,
    pub packs_reconciled: u64,
    pub captures_deleted: u64,
    pub packs_compacted: u64,
    pub compaction_bytes_rewritten: u64,
    pub objects_removed: u64,
    pub captures_purged: u64,
    pub partitions_dropped: u64,
    pub upload_failures: u64,
}

impl PipelineCounters {
    pub fn snapshot(&self) -> PipelineCounts {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        PipelineCounts {
            packs_uploaded: load(&self.packs_uploaded),
            bytes_uploaded: load(&self.bytes_uploaded),
            packs_indexed: load(&self.packs_indexed),
            captures_indexed: load(&self.captures_indexed),
            publishes: load(&self.publishes),
            packs_quarantined: load(&self.packs_quarantined),
            packs_reconciled: load(&self.packs_reconciled),
            captures_deleted: load(&self.captures_deleted),
            packs_compacted: load(&self.packs_compacted),
            compaction_bytes_rewritten: load(&self.compaction_bytes_rewritten),
            objects_removed: load(&self.objects_removed),
            captures_purged: load(&self.captures_purged),
            partitions_dropped: load(&self.partitions_dropped),
            upload_failures: load(&self.upload_failures),
        }
    }
}

/// A pack just published (or found published by the replay guard, when `version` is unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackPublished {
    pub pack_id: Uuid,
    pub version: Option<u64>,
}

/// Announces every pack the indexer publishes, so a waiter (HTTP `wait=published`) learns it from this process
/// instead of polling the catalog: one broadcast for every waiter. A waiter that falls behind (the channel keeps the
/// last [`PUBLISHED_BACKLOG`] announcements) asks the catalog once instead.
#[derive(Debug)]
pub struct PublishedPacks {
    announcements_tx: tokio::sync::broadcast::Sender<PackPublished>,
}

/// Announcements kept for slow waiters.
pub const PUBLISHED_BACKLOG: usize = 4096;

impl Default for PublishedPacks {
    fn default() -> Self {
        let (announcements_tx, _) = tokio::sync::broadcast::channel(PUBLISHED_BACKLOG);
        PublishedPacks { announcements_tx }
    }
}

impl PublishedPacks {
    /// Listen for announcements from now on (subscribe before appending, so the pack's publish cannot be missed).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<PackPublished> {
        self.announcements_tx.subscribe()
    }

    fn announce(&self, pack_id: Uuid, version: Option<u64>) {
        // No receiver is no error: nobody waits.
        let _ = self.announcements_tx.send(PackPublished { pack_id, version });
    }
}

/// Why a round stopped early. None of these is a pack's fault.
#[derive(Debug, thiserror::Error)]
pub enum RoundError {
    #[error("the lease is not held")]
    NoLease,
    #[error("bucket: {0}")]
    Bucket(#[from] crate::bucket::BucketError),
    #[error("catalog: {0}")]
    Publish(crate::catalog::publish::PublishError),
    #[error("catalog: {0}")]
    Catalog(#[from] crate::catalog::CatalogError),
    #[error("catalog: {0}")]
    Intents(#[from] crate::catalog::intents::IntentError),
    #[error("spool: {0}")]
    Spool(#[from] std::io::Error),
    #[error("stopped: the process is shutting down")]
    Stopped,
}

impl From<crate::catalog::publish::PublishError> for RoundError {
    /// A publish that found the lease gone partway (its permit too short by then, or its watermark read past the
    /// lease's deadline) ends the round as one that found it gone at the start: no failure, the keeper is on it.
    fn from(error: crate::catalog::publish::PublishError) -> RoundError {
        match error {
            crate::catalog::publish::PublishError::NoLease => RoundError::NoLease,
            other => RoundError::Publish(other),
        }
    }
}

/// Runs spool work that blocks (directory listings, pack reads, renames and unlinks with their fsyncs) on the blocking
/// pool, so the runtime's workers, which the lease keeper and the HTTP server share, never wait on the disk.
pub(crate) async fn off_runtime<T, F>(work: F) -> std::io::Result<T>
where
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work).await.map_err(std::io::Error::other)?
}

/// Every pack file in the spool, listed off the runtime.
async fn list_spool_packs(paths: &SpoolPaths) -> std::io::Result<Vec<crate::spool::PackListing>> {
    let paths = paths.clone();
    off_runtime(move || crate::spool::list_packs(&paths)).await
}

/// Opens a sealed pack off the runtime (three small reads).
async fn open_pack(path: &Path) -> std::io::Result<Result<crate::pack::PackFile, crate::pack::PackError>> {
    let path = path.to_path_buf();
    off_runtime(move || Ok(crate::pack::PackFile::open(&path))).await
}

/// What the stages share.
pub struct Pipeline {
    pub config: Arc<Config>,
    pub paths: SpoolPaths,
    pub bucket: Arc<Bucket>,
    pub publisher: Arc<Publisher>,
    pub lease: LeaseHandle,
    pub counters: Arc<PipelineCounters>,
    /// Inbox unlinks to make durable before published packs leave the spool (none in offline tools).
    pub inbox_unlinks: Option<Arc<crate::spool::inbox::UnlinkLog>>,
    /// Where published packs are announced (the daemon shares it with its HTTP API).
    pub published: Arc<PublishedPacks>,
    /// The spool's index of local captures: packs that leave the spool are forgotten there.
    pub spool_index: Arc<crate::spool::index::SpoolIndex>,
    /// Publish failures per pack for reasons of the pack's own (the server rejected its rows).
    index_attempts: Mutex<HashMap<Uuid, u32>>,
    /// Where upload rounds record their packs before sending them, and reconcile reads them back.
    intents: IntentLog,
    /// The lease tenure ([`crate::catalog::lease::PublishPermit::tenure`]) this process last reconciled under (see
    /// [`reconcile`]); cleared when a pack leaves the spool for quarantine.
    reconciled_tenure: Mutex<Option<u64>>,
    /// True once the process is stopping: long work (a reconcile) ends between two packs (none in offline tools).
    pub stopping: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Pipeline {
    pub fn new(
        config: Arc<Config>,
        paths: SpoolPaths,
        bucket: Arc<Bucket>,
        publisher: Arc<Publisher>,
        lease: LeaseHandle,
    ) -> Pipeline {
        Pipeline {
            config,
            paths,
            bucket,
            intents: publisher.intent_log(),
            publisher,
            lease,
            counters: Arc::default(),
            inbox_unlinks: None,
            published: Arc::default(),
            spool_index: Arc::default(),
            index_attempts: Mutex::default(),
            reconciled_tenure: Mutex::default(),
            stopping: None,
        }
    }

    /// `Err(Stopped)` once the process is stopping: long work checks it between two units that each complete (and
    /// each such step is progress for the watchdog).
    fn unless_stopping(&self) -> Result<(), RoundError> {
        self.counters.liveness.progress();
        match &self.stopping {
            Some(stopping) if *stopping.borrow() => Err(RoundError::Stopped),
            _ => Ok(()),
        }
    }

    /// Move a pack file to quarantine with one ERROR line: an operator must look at it.
    async fn quarantine_pack(&self, path: &Path, reason: &str) {
        if let Some(pack_id) = crate::spool::layout::pack_id_of_path(path) {
            self.spool_index.forget(pack_id);
        }
        // The pack may be in the bucket already (uploaded, or an upload that landed although it seemed to fail) with
        // an intent: reconcile again before the next mark, which finds it there now that the spool no longer has it.
        *self.reconciled_tenure.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let (paths, file, why) = (self.paths.clone(), path.to_path_buf(), reason.to_string());
        match off_runtime(move || paths.quarantine("packs", &file, &why)).await {
            Ok(moved) => {
                self.counters.packs_quarantined.fetch_add(1, Ordering::Relaxed);
                tracing::error!(pack = %path.display(), quarantined_as = %moved.display(), reason, "pack quarantined");
            }
            Err(error) => tracing::error!(pack = %path.display(), reason, %error, "pack could not be quarantined"),
        }
    }
}

/// Background work of the lease holder done in passes (retention, compaction), run by [`run_passes`].
pub trait LeaseHolderPasses: Send {
    /// What the work is, for the log line of a failed pass.
    const WHAT: &'static str;
    /// The pause between passes.
    fn interval(&self) -> std::time::Duration;
    /// One pass; `true` when it stopped at its budget with more due.
    fn pass_once(
        &mut self,
        stopping: &tokio::sync::watch::Receiver<bool>,
    ) -> impl std::future::Future<Output = anyhow::Result<bool>> + Send;
}

/// A pass every interval until `stopping`, only while this process may publish (a rival or a lost lease does
/// nothing here, and the fence inside every publish makes sure of it); a pass with more due runs again at once.
/// Errors (the catalog or the bucket away, the lease lost in the middle) are logged and the pass is tried again at
/// the next interval.
pub async fn run_passes<T: LeaseHolderPasses>(
    mut work: T,
    lease: LeaseHandle,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let mut pause = work.interval();
        if lease.permit().is_some() {
            match work.pass_once(&stopping).await {
                Ok(true) => pause = std::time::Duration::ZERO,
                Ok(false) => {}
                Err(error) => tracing::warn!(
                    error = %format!("{error:#}"),
                    "{} pass failed; trying again at the next interval",
                    T::WHAT
                ),
            }
        }
        if *stopping.borrow() {
            return;
        }
        if tokio::time::timeout(pause, stopping.changed()).await.is_ok() {
            return;
        }
    }
}
