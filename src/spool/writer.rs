//! The spool writer: one thread owns the `.open` pack and turns queued appends into durable records (group commit).
//!
//! States of the writer thread: `idle` (no open pack), `open` (a `.open` pack with records), `closed` (after
//! [`SpoolWriter::close`] or when every handle is dropped: the syncer has answered every append and the open pack is
//! sealed).
//!
//! One batch: take every append waiting in the queue (bounded by count and bytes), append each record to the pack, hand
//! the bytes to the kernel, and pass the batch's acknowledgements with the pack's [`SyncPoint`] to the syncer thread.
//! The syncer fdatasyncs (once for every batch waiting on the same file) and only then acknowledges. So batch N+1 is
//! written while batch N is fsynced, and the pack's SHA-256 is computed meanwhile on a third thread
//! ([`crate::pack`]'s hasher). An append is never acknowledged before the fsync that covers it; an append refused
//! before it is written (quota, size, an invalid capture) is not in the spool. One refused because a write, fsync or
//! seal after it failed may still be (its bytes reached the disk whole): it is then published as a retry of it would
//! be, and the catalog shows the capture once.
//!
//! A failed fsync poisons the pack (the syncer answers that batch and every later one of the pack with an error).
//! After a failed fsync the kernel may show bytes the disk does not hold, so nothing is appended after them and no seal
//! covers them: whoever meets the failure first cuts the pack to what the fsyncs before made durable (every record
//! acknowledged in it) and leaves it open for the sealer. That is the writer at its next batch, which goes on in a new
//! pack, or the sealer, when the pack was handed over for sealing (for its age, or full) before the writer saw it: its
//! seal fails at the poison, or its own fsync fails. The sealer makes the cut (and, should it fail, tries it again
//! before each try to seal the pack, which it does not seal before the cut has gone through). A failed write (a full
//! disk) is fsynced (a failure there is a failed fsync, as above) and recovered from disk like a restart would, and
//! the pack goes on.
//!
//! Seal: when the pack reaches `pack_max_bytes` or `pack_max_records`, when its first record is `pack_max_age` old
//! (linger), on [`SpoolWriter::seal`], and at close. The writer moves on to a new pack at once; a sealer thread waits
//! for the old pack's hash, writes footer and trailer, fsyncs, and renames `.open` -> `.sealed` with a directory fsync.
//!
//! A seal that fails (a full disk, an I/O error) leaves the pack `.open`: its records acknowledged by earlier fsyncs
//! are on disk, the appends waiting on the seal are answered with an error. The sealer keeps such packs *left open*
//! and seals them again after [`SEAL_RETRY`] (doubling up to [`SEAL_RETRY_MAX`]), as a start's recovery would ([`super::unsealed::seal_left_open`]), until
//! that goes through, so acknowledged captures never wait for a restart to be published. So does an open pack whose
//! recovery after a failed write failed. Meanwhile the uploader takes no sealed pack newer than a pack left open
//! ([`crate::pipeline`]), so packs are still published in the order the spool made them. What is still left open at
//! close is sealed by the next start.
//!
//! Quotas: before each append the writer checks `spool.max_bytes` (bytes under `packs/`) and
//! `spool.min_free_bytes` (free space on the filesystem). Both readings are refreshed at most every
//! [`QUOTA_REFRESH`], so refused appends resume by themselves once the uploader frees space or the disk grows.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::{oneshot, Notify};
use uuid::Uuid;

use super::index::SpoolIndex;
use super::{list_packs, PackState, SpoolPaths};
use crate::config::SpoolConfig;
use crate::durable;
use crate::pack::{CaptureMeta, PackError, PackSummary, PackWriter, SyncPoint};
use crate::telemetry::{Busy, Latency, Liveness};

/// How stale the quota readings may get.
pub const QUOTA_REFRESH: Duration = Duration::from_millis(250);
/// Queue bound: producers wait (async) once this many appends are queued.
const QUEUE_CAPACITY: usize = 4096;
/// Upper bound of one batch, so an fsync is never delayed behind an unbounded amount of writing.
const BATCH_MAX_RECORDS: usize = 4096;
const BATCH_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Batches written but not yet handed to the syncer wait here; the writer blocks when it is full.
const SYNC_QUEUE_CAPACITY: usize = 16;
/// Packs handed to the sealer and not yet sealed, beyond the one being sealed; the syncer blocks when it is full.
/// Each holds an open file and a hashing thread.
const SEALS_IN_FLIGHT: usize = 2;
/// How soon the sealer tries again to seal a pack whose seal failed; the wait doubles after each failed try, up to
/// [`SEAL_RETRY_MAX`] (each try reads the whole pack again).
pub const SEAL_RETRY: Duration = Duration::from_secs(1);
pub const SEAL_RETRY_MAX: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct WriterSettings {
    pub pack_max_bytes: u64,
    pub pack_max_records: u64,
    pub pack_max_age: Duration,
    pub max_capture_bytes: u64,
    /// 0 = no limit.
    pub max_bytes: u64,
    pub min_free_bytes: u64,
}

impl WriterSettings {
    pub fn from_config(config: &SpoolConfig) -> WriterSettings {
        WriterSettings {
            pack_max_bytes: config.pack_max_bytes.0,
            pack_max_records: config.pack_max_records,
            pack_max_age: config.pack_max_age.0,
            max_capture_bytes: config.max_capture_bytes.0,
            max_bytes: config.max_bytes.0,
            min_free_bytes: config.min_free_bytes.0,
        }
    }
}

/// Why an append was refused. Refused as too large, over quota or invalid, nothing of it is in the spool; refused
/// with an I/O error or as closed, its record may be (see the module's doc).
#[derive(Debug, Clone, thiserror::Error)]
pub enum AppendError {
    #[error("capture of {size} bytes exceeds spool.max_capture_bytes = {limit}")]
    TooLarge { size: u64, limit: u64 },
    #[error("spool full: {0}; retry later")]
    QuotaExceeded(String),
    #[error("invalid capture: {0}")]
    Invalid(String),
    #[error("spool write failed: {0}")]
    Io(String),
    #[error("spool writer is closed")]
    Closed,
}

impl AppendError {
    /// Refusals that clear by themselves (the producer should retry later).
    pub fn is_temporary(&self) -> bool {
        matches!(self, AppendError::QuotaExceeded(_) | AppendError::Io(_))
    }
}

/// Proof of durability: the record is fsynced in this pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub capture_id: Uuid,
    pub pack_id: Uuid,
}

/// Counters of the writer, read by status and metrics.
#[derive(Debug)]
pub struct WriterStats {
    pub records_appended: AtomicU64,
    pub bytes_appended: AtomicU64,
    pub fsyncs: AtomicU64,
    pub packs_sealed: AtomicU64,
    pub appends_refused: AtomicU64,
    /// Seals that failed (each is tried again until it goes through).
    pub seals_failed: AtomicU64,
    /// Packs whose seal failed and that are not sealed yet (the uploader waits for them).
    pub packs_left_open: AtomicU64,
    /// Woken after every seal (one permit is kept if nobody waits), so the daemon's loop need not poll.
    pub sealed_notify: Notify,
    /// Busy from an append's or a seal's request until the writer answers it: a writer that answers none is wedged.
    pub liveness: Liveness,
    /// Time from an append's request to its acknowledgement (fsynced) or refusal.
    pub append_latency: Latency,
}

impl Default for WriterStats {
    fn default() -> WriterStats {
        WriterStats {
            records_appended: AtomicU64::default(),
            bytes_appended: AtomicU64::default(),
            fsyncs: AtomicU64::default(),
            packs_sealed: AtomicU64::default(),
            appends_refused: AtomicU64::default(),
            seals_failed: AtomicU64::default(),
            packs_left_open: AtomicU64::default(),
            sealed_notify: Notify::default(),
            liveness: Liveness::default(),
            append_latency: Latency::between(0.000_1, 10.0),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct WriterCounters {
    pub records_appended: u64,
    pub bytes_appended: u64,
    pub fsyncs: u64,
    pub packs_sealed: u64,
    pub appends_refused: u64,
    pub seals_failed: u64,
    pub packs_left_open: u64,
}

impl WriterStats {
    pub fn snapshot(&self) -> WriterCounters {
        WriterCounters {
            records_appended: self.records_appended.load(Ordering::Relaxed),
            bytes_appended: self.bytes_appended.load(Ordering::Relaxed),
            fsyncs: self.fsyncs.load(Ordering::Relaxed),
            packs_sealed: self.packs_sealed.load(Ordering::Relaxed),
            appends_refused: self.appends_refused.load(Ordering::Relaxed),
            seals_failed: self.seals_failed.load(Ordering::Relaxed),
            packs_left_open: self.packs_left_open.load(Ordering::Relaxed),
        }
    }
}

/// Where the writer answers one request. It keeps the writer's [`Liveness`] busy until the answer is sent, however
/// long the request waits in the queue and whether or not its caller still waits (an HTTP client that gave up must
/// not make a wedged writer look idle).
struct Reply<T> {
    tx: oneshot::Sender<T>,
    busy: Busy,
}

impl<T> Reply<T> {
    /// Answer the request: the writer moved (whatever the answer and whether the caller still listens).
    fn send(self, answer: T) -> Result<(), T> {
        self.busy.progress();
        self.tx.send(answer)
    }
}

type AckReply = Reply<Result<Ack, AppendError>>;

enum Request {
    Append { meta: CaptureMeta, payload: Bytes, reply: AckReply },
    Seal { reply: SealReply },
    Close,
}

/// A cloneable handle to the writer thread.
#[derive(Clone)]
pub struct SpoolWriter {
    requests_tx: flume::Sender<Request>,
    stats: Arc<WriterStats>,
}

/// Joins the writer thread (which joins the syncer); returned by [`spawn_writer`].
pub struct WriterThread {
    thread: std::thread::JoinHandle<()>,
}

type SealReply = Reply<Result<Option<PackSummary>, AppendError>>;

/// Work for the syncer thread, done in order. Each job carries the acknowledgements of every append since the previous
/// job; they are answered once the job's fsync has returned.
enum SyncJob {
    /// Make durable what was written up to `point`.
    Sync { point: SyncPoint, acks: Vec<(AckReply, Ack)> },
    /// Seal a pack the writer has moved on from: wait for its hash, write footer and trailer, fsync, rename `.open`
    /// -> `.sealed`, fsync the directory.
    Seal { pack: Box<OpenPack>, reason: &'static str, acks: Vec<(AckReply, Ack)>, reply: Option<SealReply> },
    /// The writer gave up a pack: one it could not recover after a failed write, one cut after a failed fsync, or
    /// an empty one it could not remove. The sealer seals (or removes) it once it can.
    LeftOpen { pack_id: Uuid, cut_to: Option<u64> },
}

impl WriterThread {
    /// Wait for the writer to finish (after [`SpoolWriter::close`] or once every handle is dropped).
    pub fn join(self) {
        if self.thread.join().is_err() {
            tracing::error!("spool writer thread panicked");
        }
    }
}

/// Starts the writer thread (and its syncer and sealer) on the spool at `paths`; `index` learns every record it
/// appends and every pack it seals.
pub fn spawn_writer(
    paths: SpoolPaths,
    settings: WriterSettings,
    index: Arc<SpoolIndex>,
) -> (SpoolWriter, WriterThread) {
    let (requests_tx, requests_rx) = flume::bounded(QUEUE_CAPACITY);
    let (sync_tx, sync_rx) = flume::bounded(SYNC_QUEUE_CAPACITY);
    let stats = Arc::new(WriterStats::default());
    // Packs recovery could not seal (a full disk at the start): counted from the start; the sealer tries them again.
    stats.packs_left_open.store(index.left_open_packs().len() as u64, Ordering::Relaxed);
    let syncer_stats = stats.clone();
    let syncer_paths = paths.clone();
    let syncer_index = index.clone();
    let syncer = std::thread::Builder::new()
        .name("spool-syncer".into())
        .spawn(move || run_syncer(sync_rx, &syncer_paths, &syncer_stats, &syncer_index))
        .expect("spawning the spool syncer thread");
    let mut state = WriterState::new(paths, settings, stats.clone(), sync_tx, index);
    let thread = std::thread::Builder::new()
        .name("spool-writer".into())
        .spawn(move || {
            state.run(requests_rx);
            // Every queued batch is answered before the thread ends; the seal above already made them durable.
            drop(state);
            if syncer.join().is_err() {
                tracing::error!("spool syncer thread panicked");
            }
        })
        .expect("spawning the spool writer thread");
    (SpoolWriter { requests_tx, stats }, WriterThread { thread })
}

impl SpoolWriter {
    /// Append one capture; resolves once it is fsynced (or refused). The payload is written from this buffer, not
    /// copied. The capture must follow the rules every way in applies ([`crate::capture::validate_meta`]): the inbox
    /// and HTTP check them first to name the offending file or parameter, the library gets them here.
    pub async fn append(&self, meta: CaptureMeta, payload: impl Into<Bytes>) -> Result<Ack, AppendError> {
        if let Err(problem) = crate::capture::validate_meta(&meta) {
            self.stats.appends_refused.fetch_add(1, Ordering::Relaxed);
            return Err(AppendError::Invalid(problem));
        }
        let started = Instant::now();
        let (tx, reply_rx) = oneshot::channel();
        let reply = Reply { tx, busy: self.stats.liveness.busy() };
        let payload = payload.into();
        self.requests_tx.send_async(Request::Append { meta, payload, reply }).await.map_err(|_| AppendError::Closed)?;
        let answer = reply_rx.await.map_err(|_| AppendError::Closed)?;
        self.stats.append_latency.observe(started.elapsed());
        answer
    }

    /// Seal the open pack now (if it has records); returns what was sealed.
    pub async fn seal(&self) -> Result<Option<PackSummary>, AppendError> {
        let (tx, reply_rx) = oneshot::channel();
        let reply = Reply { tx, busy: self.stats.liveness.busy() };
        self.requests_tx.send_async(Request::Seal { reply }).await.map_err(|_| AppendError::Closed)?;
        reply_rx.await.map_err(|_| AppendError::Closed)?
    }

    /// Stop accepting appends, finish what is queued, seal the open pack and end the thread.
    pub fn close(&self) {
        let _ = self.requests_tx.send(Request::Close);
    }

    pub fn stats(&self) -> &Arc<WriterStats> {
        &self.stats
    }
}

struct OpenPack {
    writer: PackWriter,
    path: PathBuf,
    first_append_at: Instant,
}

struct WriterState {
    paths: SpoolPaths,
    index: Arc<SpoolIndex>,
    settings: WriterSettings,
    stats: Arc<WriterStats>,
    sync_tx: flume::Sender<SyncJob>,
    open_pack: Option<OpenPack>,
    quota: QuotaReadings,
    /// Acknowledgements of this batch's appends so far, for the next sync or seal job.
    batch_acks: Vec<(AckReply, Ack)>,
    /// Set by any write failure during the current batch: none of its appends may be acknowledged, because the
    /// failure may have cost records appended before it.
    batch_io_failed: bool,
    /// The newest pack id this writer made, or found in `packs/` when it started: with the index's newest pack, what
    /// a new pack's id must sort after ([`new_pack_id`]; the index alone would not know the packs of a spool whose
    /// index a library caller made empty).
    newest_made: Option<Uuid>,
}

/// Cached quota readings: bytes under `packs/` and free bytes on the filesystem.
struct QuotaReadings {
    spool_bytes: u64,
    free_bytes: u64,
    read_at: Option<Instant>,
}

impl WriterState {
    fn new(
        paths: SpoolPaths,
        settings: WriterSettings,
        stats: Arc<WriterStats>,
        sync_tx: flume::Sender<SyncJob>,
        index: Arc<SpoolIndex>,
    ) -> WriterState {
        let newest_made = match list_packs(&paths) {
            Ok(packs) => packs.last().map(|pack| pack.pack_id),
            Err(error) => {
                tracing::warn!(%error, "cannot list the spool's packs: new pack ids are ordered by the index alone");
                None
            }
        };
        WriterState {
            paths,
            index,
            settings,
            stats,
            sync_tx,
            open_pack: None,
            quota: QuotaReadings { spool_bytes: 0, free_bytes: u64::MAX, read_at: None },
            batch_acks: Vec::new(),
            batch_io_failed: false,
            newest_made,
        }
    }

    fn run(&mut self, requests_rx: flume::Receiver<Request>) {
        loop {
            let received = match self.open_pack.as_ref() {
                Some(open) => requests_rx.recv_deadline(open.first_append_at + self.settings.pack_max_age),
                None => requests_rx.recv().map_err(|_| flume::RecvTimeoutError::Disconnected),
            };
            let first = match received {
                Ok(request) => request,
                Err(flume::RecvTimeoutError::Timeout) => {
                    self.seal("pack_max_age", None);
                    continue;
                }
                Err(flume::RecvTimeoutError::Disconnected) => break,
            };
            let mut batch = vec![first];
            let mut batch_bytes = 0u64;
            while batch.len() < BATCH_MAX_RECORDS && batch_bytes < BATCH_MAX_BYTES {
                match requests_rx.try_recv() {
                    Ok(request) => {
                        if let Request::Append { payload, .. } = &request {
                            batch_bytes += payload.len() as u64;
                        }
                        batch.push(request);
                    }
                    Err(_) => break,
                }
            }
            if !self.process_batch(batch) {
                break;
            }
        }
        self.seal("shutdown", None);
    }

    /// Returns false once a close request was seen.
    fn process_batch(&mut self, batch: Vec<Request>) -> bool {
        let mut keep_running = true;
        if let Some(reason) = self.open_pack.as_ref().and_then(|open| open.writer.poisoned_reason()) {
            tracing::error!(reason, "an fsync of the open pack failed");
            self.reset_after_io_error();
        }
        // The failure above belongs to earlier batches, which the syncer answered with errors.
        self.batch_io_failed = false;
        for request in batch {
            match request {
                Request::Append { meta, payload, reply } => match self.append_one(&meta, payload) {
                    Ok(ack) => self.batch_acks.push((reply, ack)),
                    Err(error) => {
                        self.stats.appends_refused.fetch_add(1, Ordering::Relaxed);
                        let _ = reply.send(Err(error));
                    }
                },
                Request::Seal { reply } => self.seal("requested", Some(reply)),
                Request::Close => keep_running = false,
            }
        }
        // A batch that fills the pack (or finds it old enough) rides on the seal's fsync instead of one of its own, so
        // its acknowledgements come once the pack is sealed.
        match self.due_seal_reason() {
            Some(reason) => self.seal(reason, None),
            None => self.hand_to_syncer(),
        }
        keep_running
    }

    /// Writes what the batch appended to the kernel and queues its acknowledgements for the syncer's fsync.
    fn hand_to_syncer(&mut self) {
        if self.batch_acks.is_empty() {
            return;
        }
        let acks = std::mem::take(&mut self.batch_acks);
        if self.batch_io_failed {
            answer(acks, &Err(AppendError::Io("an earlier write of this batch failed".into())));
            return;
        }
        let Some(open) = &mut self.open_pack else {
            refuse_orphaned(acks);
            return;
        };
        match open.writer.flush() {
            Ok(point) => self.send_to_syncer(SyncJob::Sync { point, acks }),
            Err(error) => {
                answer(acks, &Err(AppendError::Io(error.to_string())));
                self.reset_after_io_error();
            }
        }
    }

    fn send_to_syncer(&mut self, job: SyncJob) {
        if let Err(flume::SendError(job)) = self.sync_tx.send(job) {
            // Only if the syncer thread died (it panicked): nothing can be made durable any more.
            match job {
                SyncJob::Sync { acks, .. } => answer(acks, &Err(AppendError::Closed)),
                SyncJob::Seal { acks, reply, .. } => {
                    answer(acks, &Err(AppendError::Closed));
                    if let Some(reply) = reply {
                        let _ = reply.send(Err(AppendError::Closed));
                    }
                }
                SyncJob::LeftOpen { .. } => {}
            }
        }
    }

    fn append_one(&mut self, meta: &CaptureMeta, payload: Bytes) -> Result<Ack, AppendError> {
        let size = payload.len() as u64;
        if size > self.settings.max_capture_bytes {
            return Err(AppendError::TooLarge { size, limit: self.settings.max_capture_bytes });
        }
        self.check_quota(size)?;
        let pack_would_overflow = self.open_pack.as_ref().is_some_and(|open| {
            open.writer.record_count() > 0
                && (open.writer.len_bytes() + size > self.settings.pack_max_bytes
                    || open.writer.record_count() >= self.settings.pack_max_records)
        });
        if pack_would_overflow {
            // Records already appended in this batch become durable with the seal's fsync.
            self.seal("full", None);
        }
        if self.open_pack.is_none() {
            self.open_new_pack().map_err(|e| AppendError::Io(e.to_string()))?;
        }
        let open = self.open_pack.as_mut().expect("an open pack exists after open_new_pack");
        let before = open.writer.len_bytes();
        let appended = open.writer.append(meta, payload);
        let written = open.writer.len_bytes() - before;
        let pack_id = open.writer.pack_id();
        match appended {
            Ok(entry) => self.index.add_open(pack_id, &entry),
            Err(error @ (PackError::Io(_) | PackError::Poisoned { .. })) => {
                self.reset_after_io_error();
                return Err(AppendError::Io(error.to_string()));
            }
            Err(other) => return Err(AppendError::Invalid(other.to_string())),
        }
        self.quota.spool_bytes += written;
        self.quota.free_bytes = self.quota.free_bytes.saturating_sub(written);
        self.stats.records_appended.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_appended.fetch_add(size, Ordering::Relaxed);
        Ok(Ack { capture_id: meta.capture_id, pack_id })
    }

    fn check_quota(&mut self, size: u64) -> Result<(), AppendError> {
        let stale = self.quota.read_at.is_none_or(|at| at.elapsed() >= QUOTA_REFRESH);
        if stale {
            self.refresh_quota();
        }
        let settings = &self.settings;
        if settings.max_bytes > 0 && self.quota.spool_bytes + size > settings.max_bytes {
            return Err(AppendError::QuotaExceeded(format!(
                "spool holds {} bytes and spool.max_bytes is {}",
                self.quota.spool_bytes, settings.max_bytes
            )));
        }
        if self.quota.free_bytes < settings.min_free_bytes.saturating_add(size) {
            return Err(AppendError::QuotaExceeded(format!(
                "{} bytes free on the spool filesystem and spool.min_free_bytes is {}",
                self.quota.free_bytes, settings.min_free_bytes
            )));
        }
        Ok(())
    }

    fn refresh_quota(&mut self) {
        self.quota.read_at = Some(Instant::now());
        match list_packs(&self.paths) {
            Ok(packs) => self.quota.spool_bytes = packs.iter().map(|p| p.bytes).sum(),
            Err(error) => tracing::warn!(%error, "cannot measure spool size"),
        }
        if let Some(open) = &self.open_pack {
            // The open pack's unsynced buffer is not on disk yet but will be.
            let on_disk = std::fs::metadata(&open.path).map(|m| m.len()).unwrap_or(0);
            self.quota.spool_bytes += open.writer.len_bytes().saturating_sub(on_disk);
        }
        match durable::free_bytes(&self.paths.packs) {
            Ok(free) => self.quota.free_bytes = free,
            Err(error) => tracing::warn!(%error, "cannot measure free space"),
        }
    }

    fn open_new_pack(&mut self) -> Result<(), PackError> {
        let pack_id = new_pack_id(self.index.newest_pack().max(self.newest_made));
        self.newest_made = Some(pack_id);
        let path = self.paths.pack_path(pack_id, PackState::Open);
        // No directory fsync here: the pack's first SyncPoint fsyncs the directory before any of its records is
        // acknowledged, and doing it on this thread would stall writing.
        let writer = PackWriter::create(&path, pack_id, crate::util::now_ns())?;
        self.open_pack = Some(OpenPack { writer, path, first_append_at: Instant::now() });
        Ok(())
    }

    /// Why the open pack should be sealed now, if it should: it is full or old enough. The age is checked here as well
    /// as by the receive deadline, because under a steady stream of appends the deadline never passes without a request
    /// arriving.
    fn due_seal_reason(&self) -> Option<&'static str> {
        let open = self.open_pack.as_ref()?;
        if open.writer.len_bytes() >= self.settings.pack_max_bytes
            || open.writer.record_count() >= self.settings.pack_max_records
        {
            Some("full")
        } else if open.first_append_at.elapsed() >= self.settings.pack_max_age {
            Some("pack_max_age")
        } else {
            None
        }
    }

    /// Hands the open pack (if it has records) to the syncer to be sealed, with the acknowledgements waiting on it, and
    /// goes on without it: the next append opens a new pack. `reply` is answered once the pack is sealed.
    fn seal(&mut self, reason: &'static str, reply: Option<SealReply>) {
        let mut acks = std::mem::take(&mut self.batch_acks);
        if self.batch_io_failed {
            answer(std::mem::take(&mut acks), &Err(AppendError::Io("an earlier write of this batch failed".into())));
            self.batch_io_failed = false;
        }
        let pack = match self.open_pack.take() {
            Some(pack) if pack.writer.record_count() > 0 => pack,
            no_records => {
                refuse_orphaned(acks);
                let removed = match no_records {
                    Some(pack) => {
                        let pack_id = pack.writer.pack_id();
                        drop(pack.writer);
                        self.index.forget(pack_id);
                        let removed = self.paths.remove_unsealed(pack_id);
                        if removed.is_err() {
                            // The sealer removes it once it can (it holds no record).
                            self.send_to_syncer(SyncJob::LeftOpen { pack_id, cut_to: None });
                        }
                        removed.map_err(|e| AppendError::Io(e.to_string()))
                    }
                    None => Ok(()),
                };
                if let Some(reply) = reply {
                    let _ = reply.send(removed.map(|()| None));
                }
                return;
            }
        };
        self.send_to_syncer(SyncJob::Seal { pack: Box::new(pack), reason, acks, reply });
    }

    /// After a failed write the open pack's tail is unknown: recover it like a crash would, so every record that did
    /// reach the disk is kept and a torn tail is cut. Appends of the failed batch were answered with errors; any of
    /// them that survive here are duplicates the catalog shows once.
    ///
    /// After a failed fsync what the file shows cannot be trusted (the kernel may go on showing bytes whose
    /// writeback failed, and report the failure to no later fsync): the pack is cut to what the last successful
    /// fsync covered (every acknowledged record; the appends after it were answered with errors) and left open for
    /// the sealer, and appends go on in a new pack. Going on appending to it instead would acknowledge records after
    /// a stretch the disk may not hold, which a restart after a power loss would cut, and them with it.
    fn reset_after_io_error(&mut self) {
        self.batch_io_failed = true;
        // Force fresh quota readings: the error was likely a full disk.
        self.quota.read_at = None;
        let Some(open) = self.open_pack.take() else {
            return;
        };
        let pack_id = open.writer.pack_id();
        let durability = open.writer.durability();
        if durability.durable_len_after_failed_fsync().is_none() {
            // After a failed write: what the file holds is made durable (or its fsync fails) before recovery reads
            // it, since an fsync that failed earlier on this file may not report to a new descriptor.
            let _ = open.writer.sync_written();
        }
        if let Some(durable_len) = durability.durable_len_after_failed_fsync() {
            let durable: Vec<_> =
                open.writer.entries().iter().filter(|entry| entry.record_range().end <= durable_len).cloned().collect();
            drop(open.writer);
            // Records past the cut must not be found any more.
            self.index.replace_open(pack_id, &durable);
            self.send_to_syncer(SyncJob::LeftOpen { pack_id, cut_to: Some(durable_len) });
            return;
        }
        drop(open.writer);
        match PackWriter::recover(&open.path) {
            Ok((writer, recovered)) => {
                // Records cut by the recovery must not be found any more.
                self.index.replace_open(writer.pack_id(), &recovered.entries);
                self.open_pack = Some(OpenPack { writer, path: open.path, first_append_at: open.first_append_at })
            }
            Err(error) => {
                tracing::error!(
                    pack = %open.path.display(), %error,
                    "open pack unreadable after a write error; the sealer will seal or quarantine it"
                );
                self.send_to_syncer(SyncJob::LeftOpen { pack_id, cut_to: None });
            }
        }
    }
}

/// Cuts a pack whose fsync failed to `durable_len`, what the fsyncs before made durable, and makes the cut durable.
fn cut_after_failed_fsync(path: &std::path::Path, durable_len: u64) -> std::io::Result<()> {
    if crate::failpoint::fails("cut_fails") {
        return Err(std::io::Error::from_raw_os_error(libc::EIO));
    }
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    file.set_len(durable_len)?;
    file.sync_all()
}

/// A new pack's id: a UUIDv7 of the wall clock, unless that does not sort after `newest`, the newest pack the spool
/// still holds (the clock stepped back, across a restart say, or the packs were made by a clock ahead of it). Then it
/// is a UUIDv7 of the millisecond after `newest`'s. The spool reads a capture id from its newest pack, and uploads and
/// publishes packs in id order, so a pack made later must sort after every pack still waiting: else a capture posted
/// again after such a step would lose to its earlier post. Once the spool holds none of those packs, ids follow the
/// clock again.
fn new_pack_id(newest: Option<Uuid>) -> Uuid {
    let now = Uuid::now_v7();
    let Some(newest) = newest.filter(|newest| now <= *newest) else { return now };
    let Some(newest_ms) = newest.get_timestamp().map(|timestamp| {
        let (seconds, nanos) = timestamp.to_unix();
        seconds * 1000 + u64::from(nanos) / 1_000_000
    }) else {
        // Not a UUIDv7: no pack id of ours, so nothing to order against.
        return now;
    };
    let random: [u8; 10] = Uuid::new_v4().as_bytes()[..10].try_into().expect("ten of sixteen bytes");
    uuid::Builder::from_unix_timestamp_millis(newest_ms + 1, &random).into_uuid()
}

fn answer(acks: Vec<(AckReply, Ack)>, outcome: &Result<(), AppendError>) {
    for (reply, ack) in acks {
        let _ = reply.send(outcome.clone().map(|()| ack));
    }
}

/// Acknowledgements wait only for records of the open pack, and a seal takes them along. Any left without a pack have
/// no fsync to wait for, so they are refused, never acknowledged. Not expected to happen.
fn refuse_orphaned(acks: Vec<(AckReply, Ack)>) {
    if !acks.is_empty() {
        tracing::error!(appends = acks.len(), "appends without an open pack; answering them with an error");
        answer(acks, &Err(AppendError::Io("the open pack was lost".into())));
    }
}

/// The syncer thread: runs the writer's jobs in order and answers their acknowledgements after each fsync. Sync jobs
/// that queued up while an fsync ran share the next one when they are on the same file. Seals go on to a sealer
/// thread of their own: a seal waits for the pack's hash, and the next pack's batches must not wait behind it (their
/// producers would stall, and with them the next pack's writing and hashing). Ends, after the sealer has finished,
/// when the writer drops its sender.
fn run_syncer(jobs_rx: flume::Receiver<SyncJob>, paths: &SpoolPaths, stats: &WriterStats, index: &SpoolIndex) {
    let (seals_tx, seals_rx) = flume::bounded::<SealJob>(SEALS_IN_FLIGHT);
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("spool-sealer".into())
            .spawn_scoped(scope, || run_sealer(seals_rx, paths, stats, index))
            .expect("spawning the spool sealer thread");
        let mut waiting: Vec<(AckReply, Ack)> = Vec::new();
        while let Ok(first) = jobs_rx.recv() {
            let mut jobs = vec![first];
            jobs.extend(jobs_rx.try_iter());
            let mut jobs = jobs.into_iter().peekable();
            while let Some(job) = jobs.next() {
                match job {
                    SyncJob::Sync { point, acks } => {
                        waiting.extend(acks);
                        let covered_later = matches!(jobs.peek(), Some(SyncJob::Sync { point: next, .. }) if next.same_file(&point))
                            || matches!(jobs.peek(), Some(SyncJob::Seal { pack, .. }) if pack.writer.same_file(&point));
                        if covered_later {
                            // A later fsync of the same file covers this batch: it was written first.
                            continue;
                        }
                        crate::failpoint::stall("stall_before_fsync");
                        let synced = point.sync().map_err(|e| AppendError::Io(e.to_string()));
                        if synced.is_ok() {
                            stats.fsyncs.fetch_add(1, Ordering::Relaxed);
                            crate::failpoint::hit("after_append_before_ack");
                        }
                        answer(std::mem::take(&mut waiting), &synced);
                    }
                    SyncJob::Seal { pack, reason, acks, reply } => {
                        // Every batch of this pack still waiting is covered by the seal's fsync.
                        waiting.extend(acks);
                        let seal = SealJob::Seal { pack, reason, acks: std::mem::take(&mut waiting), reply };
                        if let Err(flume::SendError(SealJob::Seal { acks, .. })) = seals_tx.send(seal) {
                            // Only if the sealer panicked: the pack stays `.open` and is recovered at next start.
                            answer(acks, &Err(AppendError::Io("the spool sealer thread died".into())));
                        }
                    }
                    SyncJob::LeftOpen { pack_id, cut_to } => {
                        // (Should the sealer have panicked, the next start seals it.)
                        let _ = seals_tx.send(SealJob::LeftOpen { pack_id, cut_to });
                    }
                }
            }
        }
        drop(seals_tx);
    });
}

/// Work handed from the syncer to the sealer, in the order the writer left its packs.
enum SealJob {
    /// Seal a pack the writer moved on from, then answer the acknowledgements its fsync covers.
    Seal { pack: Box<OpenPack>, reason: &'static str, acks: Vec<(AckReply, Ack)>, reply: Option<SealReply> },
    /// A pack the writer gave up after a failed write or fsync ([`SyncJob::LeftOpen`]): left open until it can be
    /// sealed.
    LeftOpen { pack_id: Uuid, cut_to: Option<u64> },
}

/// The sealer thread: seals packs in the order the writer left them, answering each seal's acknowledgements after it.
/// A pack whose seal failed is left open and sealed again after a growing wait (see the module's doc).
fn run_sealer(seals_rx: flume::Receiver<SealJob>, paths: &SpoolPaths, stats: &WriterStats, index: &SpoolIndex) {
    // The packs left open are the index's (recovery's at a start, this thread's since); this keeps when to try them.
    let mut retries = SealRetries::default();
    retries.left_open(stats, index);
    loop {
        let received = match retries.next_try_at {
            Some(at) => seals_rx.recv_deadline(at),
            None => seals_rx.recv().map_err(|_| flume::RecvTimeoutError::Disconnected),
        };
        match received {
            Ok(SealJob::Seal { pack, reason, acks, reply }) => {
                let pack_id = pack.writer.pack_id();
                let durability = pack.writer.durability();
                let sealed = seal_pack(*pack, paths, stats, index);
                if let Err(error) = &sealed {
                    stats.seals_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(%error, reason, %pack_id, "sealing a pack failed; it is tried again until it is sealed");
                    // The seal's own fsync failed, or one of the pack's before it did (the pack was sealed for its
                    // age, or full, before the writer saw that): what reading it shows is not to be trusted.
                    let cut_to = durability.durable_len_after_failed_fsync();
                    retries.leave_open(paths, stats, index, pack_id, cut_to);
                } else if !acks.is_empty() {
                    crate::failpoint::hit("after_append_before_ack");
                }
                let sealed = sealed.map_err(|e| AppendError::Io(e.to_string()));
                answer(acks, &sealed.as_ref().map(|_| ()).map_err(Clone::clone));
                if let Some(reply) = reply {
                    let _ = reply.send(sealed.map(Some));
                }
            }
            Ok(SealJob::LeftOpen { pack_id, cut_to }) => retries.leave_open(paths, stats, index, pack_id, cut_to),
            Err(flume::RecvTimeoutError::Timeout) => {}
            Err(flume::RecvTimeoutError::Disconnected) => break,
        }
        if retries.next_try_at.is_some_and(|at| Instant::now() >= at) {
            retries.seal(paths, stats, index);
        }
    }
    if retries.next_try_at.is_some() {
        retries.seal(paths, stats, index);
    }
    let packs = index.left_open_packs();
    if !packs.is_empty() {
        tracing::error!(?packs, "packs still left open at close; the next start seals them");
    }
}

/// When to try the packs left open again ([`SpoolIndex::left_open_packs`]), and the cuts owed before they are.
#[derive(Default)]
struct SealRetries {
    next_try_at: Option<Instant>,
    /// The wait after the last failed try: [`SEAL_RETRY`], doubled by each failure up to [`SEAL_RETRY_MAX`].
    backoff: Duration,
    /// Packs left open after a failed fsync whose cut to their durable length (the value) has not gone through yet:
    /// no such pack is sealed before it has.
    cuts_owed: HashMap<Uuid, u64>,
}

impl SealRetries {
    /// Marks a pack left open, indexed from what the disk holds (a failed write may have cut records short). After a
    /// failed fsync (`cut_to`: what the fsyncs before made durable) it is cut there first; should that fail, the cut
    /// is owed, tried again before each try to seal it, and the records past it are not indexed.
    fn leave_open(
        &mut self,
        paths: &SpoolPaths,
        stats: &WriterStats,
        index: &SpoolIndex,
        pack_id: Uuid,
        cut_to: Option<u64>,
    ) {
        if let Some(durable_len) = cut_to {
            self.cuts_owed.insert(pack_id, durable_len);
            self.cut_owed(paths, pack_id);
        }
        let within = self.cuts_owed.get(&pack_id).copied().unwrap_or(u64::MAX);
        if let Err(error) = super::unsealed::index_left_open_within(paths, index, pack_id, within) {
            tracing::warn!(%error, %pack_id, "a pack left open could not be read to index it");
        }
        self.left_open(stats, index);
    }

    /// Cuts `pack_id` if a cut is owed: false if that failed (the pack must not be sealed yet).
    fn cut_owed(&mut self, paths: &SpoolPaths, pack_id: Uuid) -> bool {
        let Some(&durable_len) = self.cuts_owed.get(&pack_id) else { return true };
        let path = paths.pack_path(pack_id, PackState::Open);
        match cut_after_failed_fsync(&path, durable_len) {
            Ok(()) => {
                tracing::error!(
                    pack = %path.display(), durable_len,
                    "an fsync of the pack failed: cut to what the fsyncs before made durable, left open to be sealed"
                );
                self.cuts_owed.remove(&pack_id);
                true
            }
            Err(error) => {
                tracing::error!(
                    pack = %path.display(), durable_len, %error,
                    "an fsync of the pack failed and cutting it failed too; it is not sealed before the cut goes \
                     through"
                );
                false
            }
        }
    }

    /// The index's packs left open changed: count them, and try them after [`SEAL_RETRY`] unless a try is due.
    fn left_open(&mut self, stats: &WriterStats, index: &SpoolIndex) {
        let count = index.left_open_packs().len();
        stats.packs_left_open.store(count as u64, Ordering::Relaxed);
        if count > 0 && self.next_try_at.is_none() {
            self.backoff = SEAL_RETRY;
            self.next_try_at = Some(Instant::now() + SEAL_RETRY);
        }
    }

    /// Seals them oldest first, as a start's recovery would; stops at the first that still fails (the disk that
    /// failed it fails the rest), and tries again after the next wait.
    fn seal(&mut self, paths: &SpoolPaths, stats: &WriterStats, index: &SpoolIndex) {
        for pack_id in index.left_open_packs() {
            let sealed = match self.cut_owed(paths, pack_id) {
                true => super::unsealed::seal_left_open(paths, index, pack_id),
                false => Err(std::io::Error::other("its cut after a failed fsync has not gone through")),
            };
            match sealed {
                Ok(outcome) => {
                    stats.packs_left_open.store(index.left_open_packs().len() as u64, Ordering::Relaxed);
                    if outcome == super::unsealed::LeftOpenOutcome::Sealed {
                        stats.packs_sealed.fetch_add(1, Ordering::Relaxed);
                        stats.sealed_notify.notify_one();
                        tracing::info!(%pack_id, "a pack whose seal failed is sealed now");
                    } else {
                        tracing::warn!(%pack_id, "a pack whose seal failed held no record, or went to quarantine");
                    }
                }
                Err(error) => {
                    self.backoff = (self.backoff * 2).min(SEAL_RETRY_MAX);
                    let next_try_in_s = self.backoff.as_secs();
                    tracing::warn!(%error, %pack_id, next_try_in_s, "a pack whose seal failed still cannot be sealed");
                    break;
                }
            }
        }
        self.next_try_at = index.oldest_left_open().map(|_| Instant::now() + self.backoff);
    }
}

/// Footer, trailer, fsync, rename `.open` -> `.sealed`, directory fsync; then the index learns it, before the daemon
/// is woken (the uploader takes no pack the index still shows unsealed).
fn seal_pack(
    pack: OpenPack,
    paths: &SpoolPaths,
    stats: &WriterStats,
    index: &SpoolIndex,
) -> Result<PackSummary, PackError> {
    #[cfg(test)]
    tests::seal_gate::wait(&paths.root);
    let pack_id = pack.writer.pack_id();
    let summary = pack.writer.finish()?;
    paths.mark_sealed(pack_id)?;
    index.mark_sealed(pack_id);
    crate::failpoint::hit("after_seal");
    stats.packs_sealed.fetch_add(1, Ordering::Relaxed);
    stats.fsyncs.fetch_add(1, Ordering::Relaxed);
    stats.sealed_notify.notify_one();
    tracing::debug!(pack_id = %pack_id, records = summary.records, bytes = summary.bytes, "pack sealed");
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::PackFile;
    use std::collections::BTreeMap;

    /// Holds back the sealer of one spool (by root directory) until the test opens the gate.
    pub(super) mod seal_gate {
        use std::collections::HashMap;
        use std::path::{Path, PathBuf};
        use std::sync::Mutex;

        static CLOSED: Mutex<Option<HashMap<PathBuf, flume::Receiver<()>>>> = Mutex::new(None);

        /// Closes the gate of the spool at `root`; dropping the returned sender opens it.
        pub fn close(root: &Path) -> flume::Sender<()> {
            let (open_tx, open_rx) = flume::bounded(0);
            CLOSED.lock().unwrap().get_or_insert_with(HashMap::new).insert(root.to_path_buf(), open_rx);
            open_tx
        }

        pub fn wait(root: &Path) {
            let gate = CLOSED.lock().unwrap().as_ref().and_then(|closed| closed.get(root).cloned());
            if let Some(open_rx) = gate {
                // Returns once the test drops its sender.
                let _ = open_rx.recv();
            }
        }
    }

    fn uuid_v7_at_ms(ms: u64) -> Uuid {
        uuid::Builder::from_unix_timestamp_millis(ms, &[0xff; 10]).into_uuid()
    }

    #[test]
    fn a_new_pack_id_follows_the_clock_and_sorts_after_every_pack_the_spool_holds() {
        let before = Uuid::now_v7();
        let id = new_pack_id(None);
        assert!(id > before && id.get_version_num() == 7);
        // The spool's newest pack is older than now: the clock's id (below one of a minute ahead).
        let now_ms = crate::util::now_ns() / 1_000_000;
        let id = new_pack_id(Some(before));
        assert!(id > before && id < uuid_v7_at_ms(now_ms + 60_000), "{id}");
        // A pack made by a clock an hour ahead, with the largest random bits: the new id is of its next millisecond.
        let ahead = uuid_v7_at_ms(now_ms + 3_600_000);
        let id = new_pack_id(Some(ahead));
        assert!(id > ahead && id.get_version_num() == 7, "{id} after {ahead}");
        let (seconds, nanos) = id.get_timestamp().unwrap().to_unix();
        assert_eq!(seconds * 1000 + u64::from(nanos) / 1_000_000, now_ms + 3_600_001);
        // Not a UUIDv7 (no pack of ours): the clock's id.
        let id = new_pack_id(Some(Uuid::from_u128(u128::MAX)));
        assert!(id.get_version_num() == 7 && id > before);
    }

    fn settings() -> WriterSettings {
        WriterSettings {
            pack_max_bytes: 1024 * 1024,
            pack_max_records: 1000,
            pack_max_age: Duration::from_secs(3600),
            max_capture_bytes: 256 * 1024,
            max_bytes: 0,
            min_free_bytes: 0,
        }
    }

    fn meta(stream: &str) -> CaptureMeta {
        CaptureMeta {
            capture_id: Uuid::now_v7(),
            stream: stream.into(),
            captured_at_ns: crate::util::now_ns(),
            labels: BTreeMap::new(),
            content_type: None,
            source_name: None,
        }
    }

    fn new_spool() -> (tempfile::TempDir, SpoolPaths) {
        let dir = tempfile::tempdir().unwrap();
        let paths = SpoolPaths::new(dir.path());
        paths.create_dirs().unwrap();
        (dir, paths)
    }

    fn sealed_packs(paths: &SpoolPaths) -> Vec<PackFile> {
        list_packs(paths)
            .unwrap()
            .into_iter()
            .filter(|p| p.state == PackState::Sealed)
            .map(|p| PackFile::open(&p.path).unwrap())
            .collect()
    }

    #[tokio::test]
    async fn concurrent_appends_share_fsyncs_and_all_land_in_the_pack() {
        let (_dir, paths) = new_spool();
        let (writer, thread) = spawn_writer(paths.clone(), settings(), Arc::default());
        let mut tasks = Vec::new();
        for i in 0..200u32 {
            let writer = writer.clone();
            tasks.push(tokio::spawn(async move {
                let meta = meta("s");
                let id = meta.capture_id;
                let ack = writer.append(meta, i.to_le_bytes().to_vec()).await.unwrap();
                assert_eq!(ack.capture_id, id);
                (id, i)
            }));
        }
        let mut expected = Vec::new();
        for task in tasks {
            expected.push(task.await.unwrap());
        }
        let fsyncs = writer.stats().snapshot().fsyncs;
        assert!(fsyncs < 200, "group commit should batch fsyncs, got {fsyncs} for 200 appends");
        writer.close();
        thread.join();
        let packs = sealed_packs(&paths);
        assert_eq!(packs.len(), 1);
        for (id, i) in expected {
            let index = packs[0].find(id).unwrap();
            assert_eq!(packs[0].read_capture(index).unwrap().1, i.to_le_bytes());
        }
    }

    #[tokio::test]
    async fn the_next_pack_is_acknowledged_while_the_previous_one_is_still_sealing() {
        let (_dir, paths) = new_spool();
        let gate = seal_gate::close(&paths.root);
        let limits = WriterSettings { pack_max_records: 2, ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits, Arc::default());
        writer.append(meta("s"), vec![1; 10]).await.unwrap();
        // The second record fills the pack: its acknowledgement waits for the seal, which the gate holds back.
        let filling = tokio::spawn({
            let writer = writer.clone();
            async move { writer.append(meta("s"), vec![2; 10]).await }
        });
        while writer.stats().snapshot().records_appended < 2 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let next_pack = tokio::time::timeout(Duration::from_secs(30), writer.append(meta("s"), vec![3; 10]))
            .await
            .expect("an append to the next pack waited for the previous pack's seal")
            .unwrap();
        assert!(!filling.is_finished(), "the filling append was acknowledged before its pack was sealed");
        assert!(sealed_packs(&paths).is_empty());
        drop(gate);
        let filled = filling.await.unwrap().unwrap();
        assert_ne!(filled.pack_id, next_pack.pack_id);
        writer.close();
        thread.join();
        let packs = sealed_packs(&paths);
        assert_eq!(packs.len(), 2);
        assert_eq!(packs.iter().map(|pack| pack.entries().len()).sum::<usize>(), 3);
    }

    #[tokio::test]
    async fn packs_seal_on_record_and_byte_limits() {
        let (_dir, paths) = new_spool();
        let limits = WriterSettings { pack_max_records: 3, ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits, Arc::default());
        for _ in 0..7 {
            writer.append(meta("s"), vec![7; 10]).await.unwrap();
        }
        writer.close();
        thread.join();
        let counts: Vec<u64> = sealed_packs(&paths).iter().map(|p| p.entries().len() as u64).collect();
        assert_eq!(counts, vec![3, 3, 1]);

        let (_dir, paths) = new_spool();
        let limits = WriterSettings { pack_max_bytes: 1024 * 1024, ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits, Arc::default());
        for _ in 0..5 {
            writer.append(meta("s"), vec![1; 250 * 1024]).await.unwrap();
        }
        writer.close();
        thread.join();
        let packs = sealed_packs(&paths);
        assert!(packs.len() >= 2, "five 250 KiB captures must not fit one 1 MiB pack");
        assert!(packs.iter().all(|p| p.summary().bytes <= 1024 * 1024 + 64 * 1024));
    }

    #[tokio::test]
    async fn a_seal_is_answered_once_the_pack_is_sealed_on_disk_with_every_acknowledged_record() {
        let (_dir, paths) = new_spool();
        let (writer, thread) = spawn_writer(paths.clone(), settings(), Arc::default());
        let mut acked = Vec::new();
        for size in [10usize, 20 * 1024, 200 * 1024 - 100] {
            let meta = meta("s");
            acked.push((meta.capture_id, size));
            // Mixed sizes take both paths: copied into the buffer, and written from the producer's buffer.
            writer.append(meta, vec![size as u8; size]).await.unwrap();
        }
        let summary = writer.seal().await.unwrap().expect("the pack had records");
        assert_eq!(summary.records, 3);
        let packs = sealed_packs(&paths);
        assert_eq!(packs.len(), 1, "the seal was answered before the pack was sealed");
        packs[0].verify().unwrap();
        for (id, size) in acked {
            let index = packs[0].find(id).unwrap();
            assert_eq!(packs[0].read_capture(index).unwrap().1, vec![size as u8; size]);
        }
        assert_eq!(writer.seal().await.unwrap(), None, "nothing is open after a seal");
        writer.close();
        thread.join();
    }

    #[tokio::test]
    async fn a_pack_seals_when_it_is_old_enough() {
        let (_dir, paths) = new_spool();
        let limits = WriterSettings { pack_max_age: Duration::from_millis(100), ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits, Arc::default());
        writer.append(meta("s"), b"x".to_vec()).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while sealed_packs(&paths).is_empty() {
            assert!(Instant::now() < deadline, "pack was not sealed by age");
            writer.stats().sealed_notify.notified().await;
        }
        writer.close();
        thread.join();
    }

    #[tokio::test]
    async fn a_pack_seals_by_age_under_a_steady_stream_of_appends() {
        let (_dir, paths) = new_spool();
        let limits = WriterSettings { pack_max_age: Duration::from_millis(200), ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits, Arc::default());
        let started = Instant::now();
        // Appends every 20 ms never leave the writer idle until the deadline; the pack must seal all the same.
        while writer.stats().snapshot().packs_sealed == 0 {
            assert!(started.elapsed() < Duration::from_secs(10), "no pack was sealed by age under steady appends");
            writer.append(meta("s"), b"x".to_vec()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        writer.close();
        thread.join();
    }

    #[tokio::test]
    async fn appends_that_break_the_capture_rules_are_refused_naming_the_rule() {
        let (_dir, paths) = new_spool();
        let (writer, thread) = spawn_writer(paths.clone(), settings(), Arc::default());
        let mut bad_stream = meta("s");
        bad_stream.stream = "cam/.hidden".into();
        let mut too_many_labels = meta("s");
        too_many_labels.labels = (0..=crate::capture::MAX_LABELS).map(|n| (format!("k{n}"), String::new())).collect();
        let mut control_in_content_type = meta("s");
        control_in_content_type.content_type = Some("text/plain\n".into());
        for (bad, rule) in
            [(bad_stream, "segment"), (too_many_labels, "labels"), (control_in_content_type, "content type")]
        {
            let error = writer.append(bad, b"x".to_vec()).await.unwrap_err();
            assert!(matches!(&error, AppendError::Invalid(problem) if problem.contains(rule)), "{error}");
        }
        assert_eq!(writer.stats().snapshot().appends_refused, 3);
        assert_eq!(writer.stats().snapshot().records_appended, 0, "nothing of a refused append is in the spool");
        writer.append(meta("cam/ok"), b"x".to_vec()).await.unwrap();
        writer.close();
        thread.join();
    }

    #[tokio::test]
    async fn oversized_captures_and_quota_are_refused_and_resume() {
        let (_dir, paths) = new_spool();
        let limits = WriterSettings { max_bytes: 64 * 1024, ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits, Arc::default());
        let error = writer.append(meta("s"), vec![0; 300 * 1024]).await.unwrap_err();
        assert!(matches!(error, AppendError::TooLarge { .. }), "{error}");
        writer.append(meta("s"), vec![0; 40 * 1024]).await.unwrap();
        let error = writer.append(meta("s"), vec![0; 40 * 1024]).await.unwrap_err();
        assert!(matches!(error, AppendError::QuotaExceeded(_)), "{error}");
        // Space returns (here: the sealed pack is removed, as the indexer would after publishing).
        writer.seal().await.unwrap().unwrap();
        for pack in list_packs(&paths).unwrap() {
            std::fs::remove_file(pack.path).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match writer.append(meta("s"), vec![0; 40 * 1024]).await {
                Ok(_) => break,
                Err(AppendError::QuotaExceeded(_)) if Instant::now() < deadline => {
                    tokio::time::sleep(QUOTA_REFRESH / 2).await
                }
                Err(other) => panic!("append did not resume: {other}"),
            }
        }
        writer.close();
        thread.join();
    }
}
