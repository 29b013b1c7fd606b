//! The spool writer: one thread owns the `.open` pack and turns queued appends into durable records (group commit).
//!
//! States of the writer thread: `idle` (no open pack), `open` (a `.open` pack with records, all of them fsynced
//! between batches), `closed` (after [`SpoolWriter::close`] or when every handle is dropped: the open pack is sealed).
//!
//! One batch: take every append waiting in the queue (bounded by count and bytes), append each record to the pack,
//! call `fdatasync` once, then acknowledge every append of the batch. An append is never acknowledged before the fsync
//! that covers it; an append that fails (quota, size, I/O) is answered with an error and is not in the spool.
//!
//! Seal: when the pack reaches `pack_max_bytes` or `pack_max_records`, when its first record is `pack_max_age` old
//! (linger), on [`SpoolWriter::seal`], and at close. Sealing writes footer and trailer, fsyncs, and renames
//! `.open` -> `.sealed` with a directory fsync.
//!
//! Quotas: before each append the writer checks `spool.max_bytes` (bytes under `packs/`) and
//! `spool.min_free_bytes` (free space on the filesystem). Both readings are refreshed at most every
//! [`QUOTA_REFRESH`], so refused appends resume by themselves once the uploader frees space or the disk grows.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::{oneshot, Notify};
use uuid::Uuid;

use super::pack::{CaptureMeta, PackError, PackSummary, PackWriter};
use super::{durable, list_packs, PackState, SpoolPaths};
use crate::config::SpoolConfig;

/// How stale the quota readings may get.
pub const QUOTA_REFRESH: Duration = Duration::from_millis(250);
/// Queue bound: producers wait (async) once this many appends are queued.
const QUEUE_CAPACITY: usize = 4096;
/// Upper bound of one batch, so an fsync is never delayed behind an unbounded amount of writing.
const BATCH_MAX_RECORDS: usize = 4096;
const BATCH_MAX_BYTES: u64 = 64 * 1024 * 1024;

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

/// Why an append was refused. Nothing of a refused append is in the spool.
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
#[derive(Debug, Default)]
pub struct WriterStats {
    pub records_appended: AtomicU64,
    pub bytes_appended: AtomicU64,
    pub fsyncs: AtomicU64,
    pub packs_sealed: AtomicU64,
    pub appends_refused: AtomicU64,
    /// Woken after every seal (one permit is kept if nobody waits), so the supervisor need not poll.
    pub sealed_notify: Notify,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct WriterCounters {
    pub records_appended: u64,
    pub bytes_appended: u64,
    pub fsyncs: u64,
    pub packs_sealed: u64,
    pub appends_refused: u64,
}

impl WriterStats {
    pub fn snapshot(&self) -> WriterCounters {
        WriterCounters {
            records_appended: self.records_appended.load(Ordering::Relaxed),
            bytes_appended: self.bytes_appended.load(Ordering::Relaxed),
            fsyncs: self.fsyncs.load(Ordering::Relaxed),
            packs_sealed: self.packs_sealed.load(Ordering::Relaxed),
            appends_refused: self.appends_refused.load(Ordering::Relaxed),
        }
    }
}

enum Request {
    Append { meta: CaptureMeta, payload: Vec<u8>, reply: oneshot::Sender<Result<Ack, AppendError>> },
    Seal { reply: oneshot::Sender<Result<Option<PackSummary>, AppendError>> },
    Close,
}

/// A cloneable handle to the writer thread.
#[derive(Clone)]
pub struct SpoolWriter {
    requests_tx: flume::Sender<Request>,
    stats: Arc<WriterStats>,
}

/// Joins the writer thread; returned by [`spawn_writer`].
pub struct WriterThread {
    thread: std::thread::JoinHandle<()>,
}

impl WriterThread {
    /// Wait for the writer to finish (after [`SpoolWriter::close`] or once every handle is dropped).
    pub fn join(self) {
        if self.thread.join().is_err() {
            tracing::error!("spool writer thread panicked");
        }
    }
}

pub fn spawn_writer(paths: SpoolPaths, settings: WriterSettings) -> (SpoolWriter, WriterThread) {
    let (requests_tx, requests_rx) = flume::bounded(QUEUE_CAPACITY);
    let stats = Arc::new(WriterStats::default());
    let mut state = WriterState::new(paths, settings, stats.clone());
    let thread = std::thread::Builder::new()
        .name("spool-writer".into())
        .spawn(move || state.run(requests_rx))
        .expect("spawning the spool writer thread");
    (SpoolWriter { requests_tx, stats }, WriterThread { thread })
}

impl SpoolWriter {
    /// Append one capture; resolves once it is fsynced (or refused).
    pub async fn append(&self, meta: CaptureMeta, payload: Vec<u8>) -> Result<Ack, AppendError> {
        let (reply, reply_rx) = oneshot::channel();
        self.requests_tx.send_async(Request::Append { meta, payload, reply }).await.map_err(|_| AppendError::Closed)?;
        reply_rx.await.map_err(|_| AppendError::Closed)?
    }

    /// Blocking form of [`SpoolWriter::append`], for callers outside an async runtime.
    pub fn append_blocking(&self, meta: CaptureMeta, payload: Vec<u8>) -> Result<Ack, AppendError> {
        let (reply, reply_rx) = oneshot::channel();
        self.requests_tx.send(Request::Append { meta, payload, reply }).map_err(|_| AppendError::Closed)?;
        reply_rx.blocking_recv().map_err(|_| AppendError::Closed)?
    }

    /// Seal the open pack now (if it has records); returns what was sealed.
    pub async fn seal(&self) -> Result<Option<PackSummary>, AppendError> {
        let (reply, reply_rx) = oneshot::channel();
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
    settings: WriterSettings,
    stats: Arc<WriterStats>,
    open_pack: Option<OpenPack>,
    quota: QuotaReadings,
    /// Set by any write, fsync or seal failure during the current batch: none of its appends may be acknowledged,
    /// because the failure may have cost records appended before it.
    batch_io_failed: bool,
}

/// Cached quota readings: bytes under `packs/` and free bytes on the filesystem.
struct QuotaReadings {
    spool_bytes: u64,
    free_bytes: u64,
    read_at: Option<Instant>,
}

impl WriterState {
    fn new(paths: SpoolPaths, settings: WriterSettings, stats: Arc<WriterStats>) -> WriterState {
        WriterState {
            paths,
            settings,
            stats,
            open_pack: None,
            quota: QuotaReadings { spool_bytes: 0, free_bytes: u64::MAX, read_at: None },
            batch_io_failed: false,
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
                    self.seal_logged("pack_max_age");
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
        self.seal_logged("shutdown");
    }

    /// Returns false once a close request was seen.
    fn process_batch(&mut self, batch: Vec<Request>) -> bool {
        let mut pending_acks: Vec<(oneshot::Sender<Result<Ack, AppendError>>, Ack)> = Vec::with_capacity(batch.len());
        let mut keep_running = true;
        self.batch_io_failed = false;
        for request in batch {
            match request {
                Request::Append { meta, payload, reply } => match self.append_one(&meta, &payload) {
                    Ok(ack) => pending_acks.push((reply, ack)),
                    Err(error) => {
                        self.stats.appends_refused.fetch_add(1, Ordering::Relaxed);
                        let _ = reply.send(Err(error));
                    }
                },
                Request::Seal { reply } => {
                    // Records appended earlier in this batch are made durable by the seal's own fsync.
                    let sealed = self.seal().map_err(|e| AppendError::Io(e.to_string()));
                    let failed = sealed.is_err();
                    Self::answer(&mut pending_acks, &sealed.as_ref().map(|_| ()).map_err(Clone::clone));
                    let _ = reply.send(sealed);
                    if failed {
                        self.reset_after_io_error();
                    }
                }
                Request::Close => keep_running = false,
            }
        }
        if pending_acks.is_empty() {
            return keep_running;
        }
        let mut synced = self.sync_open_pack();
        if synced.is_err() {
            self.reset_after_io_error();
        } else if self.batch_io_failed {
            synced = Err(AppendError::Io("an earlier write of this batch failed".into()));
        } else {
            crate::failpoint::hit("after_append_before_ack");
        }
        Self::answer(&mut pending_acks, &synced);
        self.seal_if_full();
        keep_running
    }

    fn answer(
        pending_acks: &mut Vec<(oneshot::Sender<Result<Ack, AppendError>>, Ack)>,
        outcome: &Result<(), AppendError>,
    ) {
        for (reply, ack) in pending_acks.drain(..) {
            let _ = reply.send(outcome.clone().map(|()| ack));
        }
    }

    fn append_one(&mut self, meta: &CaptureMeta, payload: &[u8]) -> Result<Ack, AppendError> {
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
            if let Err(error) = self.seal() {
                self.reset_after_io_error();
                return Err(AppendError::Io(error.to_string()));
            }
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
            Ok(_) => {}
            Err(PackError::Io(e)) => {
                self.reset_after_io_error();
                return Err(AppendError::Io(e.to_string()));
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
        let pack_id = Uuid::now_v7();
        let path = self.paths.pack_path(pack_id, PackState::Open);
        let writer = PackWriter::create(&path, pack_id, crate::util::now_ns())?;
        durable::fsync_dir(&self.paths.packs)?;
        self.open_pack = Some(OpenPack { writer, path, first_append_at: Instant::now() });
        Ok(())
    }

    fn sync_open_pack(&mut self) -> Result<(), AppendError> {
        let Some(open) = &mut self.open_pack else {
            return Ok(());
        };
        open.writer.sync().map_err(|e| AppendError::Io(e.to_string()))?;
        self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn seal_if_full(&mut self) {
        let full = self.open_pack.as_ref().is_some_and(|open| {
            open.writer.len_bytes() >= self.settings.pack_max_bytes
                || open.writer.record_count() >= self.settings.pack_max_records
        });
        if full {
            self.seal_logged("full");
        }
    }

    fn seal_logged(&mut self, reason: &str) {
        if let Err(error) = self.seal() {
            tracing::error!(%error, reason, "sealing the open pack failed; it will be recovered at next start");
            self.reset_after_io_error();
        }
    }

    /// Seal the open pack (if it has records): footer, trailer, fsync, rename to `.sealed`, directory fsync.
    fn seal(&mut self) -> Result<Option<PackSummary>, PackError> {
        let Some(open) = self.open_pack.take() else {
            return Ok(None);
        };
        if open.writer.record_count() == 0 {
            drop(open.writer);
            durable::remove_durable(&open.path)?;
            return Ok(None);
        }
        let pack_id = open.writer.pack_id();
        let summary = open.writer.finish()?;
        durable::rename_durable(&open.path, &self.paths.pack_path(pack_id, PackState::Sealed))?;
        crate::failpoint::hit("after_seal");
        self.stats.packs_sealed.fetch_add(1, Ordering::Relaxed);
        self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        self.stats.sealed_notify.notify_one();
        tracing::debug!(pack_id = %pack_id, records = summary.records, bytes = summary.bytes, "pack sealed");
        Ok(Some(summary))
    }

    /// After a failed write or fsync the open pack's tail is unknown: recover it like a crash would, so every record
    /// that did reach the disk is kept and a torn tail is cut. Appends of the failed batch were answered with errors;
    /// any of them that survive here are duplicates the catalog shows once.
    fn reset_after_io_error(&mut self) {
        self.batch_io_failed = true;
        // Force fresh quota readings: the error was likely a full disk.
        self.quota.read_at = None;
        let Some(open) = self.open_pack.take() else {
            return;
        };
        drop(open.writer);
        match PackWriter::recover(&open.path) {
            Ok((writer, _)) => {
                self.open_pack = Some(OpenPack { writer, path: open.path, first_append_at: open.first_append_at })
            }
            Err(error) => tracing::error!(
                pack = %open.path.display(), %error,
                "open pack unreadable after a write error; it will be recovered or quarantined at next start"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spool::pack::PackFile;
    use std::collections::BTreeMap;

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
        let (writer, thread) = spawn_writer(paths.clone(), settings());
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
    async fn packs_seal_on_record_and_byte_limits() {
        let (_dir, paths) = new_spool();
        let limits = WriterSettings { pack_max_records: 3, ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits);
        for _ in 0..7 {
            writer.append(meta("s"), vec![7; 10]).await.unwrap();
        }
        writer.close();
        thread.join();
        let counts: Vec<u64> = sealed_packs(&paths).iter().map(|p| p.entries().len() as u64).collect();
        assert_eq!(counts, vec![3, 3, 1]);

        let (_dir, paths) = new_spool();
        let limits = WriterSettings { pack_max_bytes: 1024 * 1024, ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits);
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
    async fn a_pack_seals_when_it_is_old_enough() {
        let (_dir, paths) = new_spool();
        let limits = WriterSettings { pack_max_age: Duration::from_millis(100), ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits);
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
    async fn oversized_captures_and_quota_are_refused_and_resume() {
        let (_dir, paths) = new_spool();
        let limits = WriterSettings { max_bytes: 64 * 1024, ..settings() };
        let (writer, thread) = spawn_writer(paths.clone(), limits);
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
