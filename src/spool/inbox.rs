//! Inbox ingest: files dropped under `<spool>/inbox/<stream>/` become captures, exactly once.
//!
//! A producer writes a file elsewhere (or under a name starting with `.` or ending in `.tmp`, both ignored) and renames
//! it into `inbox/<stream>/<name>`. The stream is the subdirectory path. A name `<uuid>` or `<uuid>.<ext>` keeps that
//! capture_id; any other name gets a generated UUIDv7.
//!
//! Envelopes ([`super::envelope`]) carry labels, a content type and a capture time in front of the payload.
//!
//! Every field of the JSON object is optional. A plain file's captured_at_ns is its modification time.
//!
//! Exactly-once: each record carries the file's source key (`<stream>/<name>` plus inode, size and mtime, so a later
//! file reusing the name is a different source). The inbox file is unlinked only after its record is fsynced; if a crash
//! lands between the fsync and the unlink, recovery finds the key in a pack and removes the file instead of ingesting
//! it again.
//!
//! Bad input (an invalid stream name, a file over `spool.max_capture_bytes`, a malformed envelope) is moved to
//! `quarantine/inbox/` with one WARN line and a `.reason` file; it never blocks other files. A file refused for a full
//! spool stays where it is and is retried.
//!
//! Discovery: a recursive `notify` watcher reports files closed after writing and files renamed in; a periodic rescan
//! backs it up, so a missed event only delays a file.

use std::collections::{HashSet, VecDeque};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Semaphore};
use uuid::Uuid;

use super::envelope::{is_envelope_name, parse_envelope, EnvelopeHeader, MAX_ENVELOPE_HEADER};
use super::writer::{AppendError, SpoolWriter};
use super::SpoolPaths;
use crate::capture;
use crate::durable;
use crate::pack::CaptureMeta;

/// Bytes of payload in memory at once across all ingest tasks, from the read until the spool acknowledged the append
/// (a single larger file still goes, alone). This bounds the daemon's memory however large the inbox backlog is.
const READ_BUDGET_KIB: u32 = 16 * 1024;
/// How often the directories of unlinked inbox files are fsynced (one fsync per directory, not one per file).
const UNLINK_SYNC_INTERVAL: Duration = Duration::from_millis(50);
/// How soon to look again after the spool refused a file for lack of space.
const RETRY_AFTER_REFUSAL: Duration = Duration::from_secs(1);

/// Names producers use while writing; never ingested.
pub fn is_ignored_name(name: &str) -> bool {
    name.starts_with('.') || name.ends_with(durable::TEMP_SUFFIX)
}

/// Identity of one inbox file for exactly-once ingest.
pub fn source_key(relative_path: &str, metadata: &fs::Metadata) -> String {
    let mtime_ns = metadata.mtime() as i128 * 1_000_000_000 + metadata.mtime_nsec() as i128;
    format!("{relative_path}@{}:{}:{mtime_ns}", metadata.ino(), metadata.len())
}

/// The capture_id a file name asks for: `<uuid>` or `<uuid>.<ext>`.
pub fn capture_id_from_name(name: &str) -> Option<Uuid> {
    let stem = name.split_once('.').map_or(name, |(stem, _)| stem);
    Uuid::parse_str(stem).ok().filter(|_| stem.len() == 36)
}

/// Every ingestible file under the inbox (sorted). Hidden directories are skipped.
pub fn walk_inbox(inbox: &Path) -> io::Result<Vec<PathBuf>> {
    walk_inbox_limited(inbox, usize::MAX)
}

/// Like [`walk_inbox`], but stops after `limit` files (which ones is up to the directory order), so a huge backlog
/// is taken in slices instead of all at once.
pub fn walk_inbox_limited(inbox: &Path, limit: usize) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut dirs = vec![inbox.to_path_buf()];
    'walk: while let Some(dir) = dirs.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            if is_ignored_name(&name.to_string_lossy()) {
                continue;
            }
            let file_type = entry.file_type()?;
            if file_type.is_dir() {
                dirs.push(entry.path());
            } else if file_type.is_file() {
                files.push(entry.path());
                if files.len() >= limit {
                    break 'walk;
                }
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Recovery step: remove inbox files whose source key is already in a pack. Returns how many were removed.
pub fn remove_already_captured(paths: &SpoolPaths, source_keys: &HashSet<String>) -> io::Result<u64> {
    if source_keys.is_empty() {
        return Ok(0);
    }
    let mut removed = 0;
    for path in walk_inbox(&paths.inbox)? {
        let Ok(metadata) = fs::symlink_metadata(&path) else {
            continue;
        };
        let relative = relative_name(&paths.inbox, &path);
        if source_keys.contains(&source_key(&relative, &metadata)) {
            durable::remove_durable(&path)?;
            removed += 1;
            tracing::info!(file = %relative, "inbox file was already captured before the crash; removed");
        }
    }
    Ok(removed)
}

fn relative_name(inbox: &Path, path: &Path) -> String {
    path.strip_prefix(inbox).unwrap_or(path).to_string_lossy().into_owned()
}

/// Counters of the ingest loop, read by status and metrics.
#[derive(Debug, Default)]
pub struct IngestStats {
    pub files_ingested: AtomicU64,
    pub files_quarantined: AtomicU64,
    pub files_deferred: AtomicU64,
}

/// Inbox directories with unlinks not yet made durable. Ingest records every unlink here and fsyncs the directories
/// every `UNLINK_SYNC_INTERVAL`; the indexer calls [`UnlinkLog::sync`] before it deletes published packs, so a pack
/// never leaves the spool while the unlink of one of its sources could still be undone by a crash (recovery finds
/// such a source's key only in a pack that is still local).
#[derive(Debug, Default)]
pub struct UnlinkLog {
    dirty_dirs: std::sync::Mutex<HashSet<PathBuf>>,
}

impl UnlinkLog {
    fn record(&self, file: &Path) {
        if let Some(dir) = file.parent() {
            self.dirty_dirs.lock().unwrap_or_else(|p| p.into_inner()).insert(dir.to_path_buf());
        }
    }

    /// Make every recorded unlink durable.
    pub fn sync(&self) -> io::Result<()> {
        let dirs: Vec<PathBuf> = self.dirty_dirs.lock().unwrap_or_else(|p| p.into_inner()).drain().collect();
        for dir in dirs {
            match durable::fsync_dir(&dir) {
                Ok(()) => {}
                // The directory went away (a stream's directory removed by hand): nothing left to make durable.
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => {
                    self.dirty_dirs.lock().unwrap_or_else(|p| p.into_inner()).insert(dir);
                    return Err(error);
                }
            }
        }
        Ok(())
    }
}

/// What happened to one inbox file.
#[derive(Debug, Clone, PartialEq, Eq)]
enum FileOutcome {
    Ingested,
    Quarantined,
    /// Left in place: spool full or a transient error; look again soon.
    Deferred,
    /// Gone, not a regular file, or still being written: nothing to do.
    Skipped,
}

struct IngestContext {
    paths: SpoolPaths,
    unlinks: Arc<UnlinkLog>,
    writer: SpoolWriter,
    max_capture_bytes: u64,
    stats: Arc<IngestStats>,
    read_budget: Semaphore,
}

/// Runs until `shutdown_rx` turns true; then finishes the files in flight and returns.
///
/// States of the loop: a `backlog` of at most `BACKLOG_LIMIT` candidate paths (from events and rescans; it may hold
/// duplicates and files already gone, which cost one `stat`), up to `MAX_BATCHES_IN_FLIGHT` batches being ingested
/// (`in_flight` holds their paths, so no file is ever ingested by two batches at once), and `rescan_pending`: a
/// rescan was asked for (by the timer, an event overflow, a full backlog, a rescan that stopped at the limit, or a
/// deferral) and runs once the backlog is empty. So memory stays bounded however many files wait in the inbox, and a
/// burst of events never causes a rescan per event.
pub struct Ingestor {
    context: Arc<IngestContext>,
    rescan_interval: Duration,
}

/// Files stat'ed, read, appended and unlinked together: one hop to a blocking thread per step and batch, not per file.
const BATCH_FILES: usize = 64;
/// Batches ingested at once. Their appends wait on the spool's group commit together, which fills its batches.
const MAX_BATCHES_IN_FLIGHT: usize = 16;
/// Paths waiting in the backlog at most; beyond it, events are dropped for a rescan, and a rescan takes a slice.
const BACKLOG_LIMIT: usize = 16 * 1024;
/// Files of a batch are read together up to this many bytes (a larger file is read alone).
const READ_GROUP_BYTES: u64 = 4 << 20;

type BatchOutcomes = Vec<(PathBuf, FileOutcome)>;

impl Ingestor {
    pub fn new(paths: SpoolPaths, writer: SpoolWriter, max_capture_bytes: u64, rescan_interval: Duration) -> Ingestor {
        let context = IngestContext {
            paths,
            unlinks: Arc::default(),
            writer,
            max_capture_bytes,
            stats: Arc::new(IngestStats::default()),
            read_budget: Semaphore::new(READ_BUDGET_KIB as usize),
        };
        Ingestor { context: Arc::new(context), rescan_interval }
    }

    pub fn stats(&self) -> Arc<IngestStats> {
        self.context.stats.clone()
    }

    /// The log of unlinked inbox files whose removal may not be durable yet.
    pub fn unlinks(&self) -> Arc<UnlinkLog> {
        self.context.unlinks.clone()
    }

    pub async fn run(self, mut shutdown_rx: watch::Receiver<bool>) {
        let (events_tx, mut events_rx) = mpsc::channel::<Vec<PathBuf>>(1024);
        let rescan_now = Arc::new(tokio::sync::Notify::new());
        let _watcher = start_watcher(&self.context.paths.inbox, events_tx, rescan_now.clone());
        let mut batches: tokio::task::JoinSet<BatchOutcomes> = tokio::task::JoinSet::new();
        let mut backlog: VecDeque<PathBuf> = VecDeque::new();
        let mut in_flight: HashSet<PathBuf> = HashSet::new();
        let mut rescan_pending = true;
        let mut unlink_sync = tokio::time::interval(UNLINK_SYNC_INTERVAL);
        unlink_sync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut rescan = tokio::time::interval(self.rescan_interval);
        rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        rescan.reset();
        let retry = tokio::time::sleep(Duration::MAX / 4);
        tokio::pin!(retry);
        let mut retry_armed = false;
        loop {
            if *shutdown_rx.borrow() {
                break;
            }
            if backlog.is_empty() && rescan_pending {
                let (found, more) = self.walk(self.context.paths.inbox.clone()).await;
                backlog.extend(found);
                rescan_pending = more;
            }
            while batches.len() < MAX_BATCHES_IN_FLIGHT && !backlog.is_empty() {
                let batch = self.take_batch(&mut backlog, &mut in_flight);
                if !batch.is_empty() {
                    batches.spawn(ingest_batch(self.context.clone(), batch));
                }
            }
            tokio::select! {
                _ = shutdown_rx.changed() => break,
                _ = unlink_sync.tick() => self.sync_unlinks().await,
                Some(paths) = events_rx.recv() => {
                    for path in paths {
                        if backlog.len() >= BACKLOG_LIMIT {
                            // Found again by the rescan once the backlog is worked off.
                            rescan_pending = true;
                        } else if path.is_dir() {
                            // A directory appeared: files renamed into it before its watch existed would be missed.
                            let (found, more) = self.walk(path).await;
                            backlog.extend(found);
                            rescan_pending |= more;
                        } else {
                            backlog.push_back(path);
                        }
                    }
                }
                _ = rescan.tick() => rescan_pending = true,
                _ = rescan_now.notified() => rescan_pending = true,
                _ = &mut retry, if retry_armed => {
                    retry_armed = false;
                    rescan_pending = true;
                }
                Some(finished) = batches.join_next() => {
                    for (path, outcome) in finished.unwrap_or_default() {
                        in_flight.remove(&path);
                        if outcome == FileOutcome::Deferred {
                            // Files are being refused (a full spool): look again after a pause, not at once, or a
                            // large backlog of refused files would be walked in a busy loop.
                            rescan_pending = false;
                            if !retry_armed {
                                retry.as_mut().reset(tokio::time::Instant::now() + RETRY_AFTER_REFUSAL);
                                retry_armed = true;
                            }
                        }
                    }
                }
            }
        }
        // Let batches in flight finish: each file either lands (and is unlinked) or stays in the inbox.
        while batches.join_next().await.is_some() {}
        self.sync_unlinks().await;
    }

    /// Up to [`BATCH_FILES`] ingestible paths from the front of the backlog that no batch is working on.
    fn take_batch(&self, backlog: &mut VecDeque<PathBuf>, in_flight: &mut HashSet<PathBuf>) -> Vec<PathBuf> {
        let mut batch = Vec::with_capacity(BATCH_FILES);
        while batch.len() < BATCH_FILES {
            let Some(path) = backlog.pop_front() else { break };
            let name_ignored = path.file_name().is_none_or(|name| is_ignored_name(&name.to_string_lossy()));
            if name_ignored || !path.starts_with(&self.context.paths.inbox) || in_flight.contains(&path) {
                continue;
            }
            in_flight.insert(path.clone());
            batch.push(path);
        }
        batch
    }

    async fn sync_unlinks(&self) {
        let unlinks = self.context.unlinks.clone();
        if let Ok(Err(error)) = tokio::task::spawn_blocking(move || unlinks.sync()).await {
            tracing::warn!(%error, "cannot fsync inbox directories after unlinks");
        }
    }

    /// Up to `BACKLOG_LIMIT` files under `dir`, and whether there may be more.
    async fn walk(&self, dir: PathBuf) -> (Vec<PathBuf>, bool) {
        match tokio::task::spawn_blocking(move || walk_inbox_limited(&dir, BACKLOG_LIMIT)).await {
            Ok(Ok(files)) => {
                let more = files.len() >= BACKLOG_LIMIT;
                (files, more)
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "inbox rescan failed");
                (Vec::new(), true)
            }
            Err(_) => (Vec::new(), true),
        }
    }
}

/// Forward interesting events; when they come faster than ingest takes them (the channel is full, or the kernel's
/// inotify queue overflowed), ask for a rescan instead, so nothing is lost and memory stays bounded.
fn start_watcher(
    inbox: &Path,
    events_tx: mpsc::Sender<Vec<PathBuf>>,
    rescan_now: Arc<tokio::sync::Notify>,
) -> Option<notify::RecommendedWatcher> {
    use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind};
    use notify::{EventKind, RecursiveMode, Watcher};
    let handler = move |result: notify::Result<notify::Event>| {
        let event = match result {
            Ok(event) if !event.need_rescan() => event,
            _ => {
                rescan_now.notify_one();
                return;
            }
        };
        let interesting = matches!(
            event.kind,
            EventKind::Access(AccessKind::Close(AccessMode::Write))
                | EventKind::Modify(ModifyKind::Name(_))
                | EventKind::Create(CreateKind::Folder)
        );
        if interesting && events_tx.try_send(event.paths).is_err() {
            rescan_now.notify_one();
        }
    };
    let watcher = notify::recommended_watcher(handler).and_then(|mut watcher| {
        watcher.watch(inbox, RecursiveMode::Recursive)?;
        Ok(watcher)
    });
    match watcher {
        Ok(watcher) => Some(watcher),
        Err(error) => {
            tracing::warn!(%error, "inbox watcher unavailable; relying on periodic rescans");
            None
        }
    }
}

/// One inbox file between its `stat` and its append.
struct Candidate {
    path: PathBuf,
    metadata: fs::Metadata,
    relative: String,
}

/// A file read and validated, ready to append.
struct Prepared {
    path: PathBuf,
    meta: CaptureMeta,
    payload: Vec<u8>,
}

/// Ingest a batch of inbox files: stat them, then per read group (bounded by bytes and by the shared read budget, held
/// until the appends are answered) read them, append them all at once (they share the spool's fsyncs), and unlink
/// the ones acknowledged.
async fn ingest_batch(context: Arc<IngestContext>, paths: Vec<PathBuf>) -> BatchOutcomes {
    let stat_context = context.clone();
    let (candidates, mut outcomes) = match tokio::task::spawn_blocking(move || stat_all(&stat_context, paths)).await {
        Ok(stated) => stated,
        Err(_) => return Vec::new(),
    };
    for group in read_groups(candidates) {
        let group_bytes: u64 = group.iter().map(|candidate| candidate.metadata.len()).sum();
        let budget_kib = ((group_bytes / 1024) as u32).clamp(1, READ_BUDGET_KIB);
        let Ok(_budget) = context.read_budget.acquire_many(budget_kib).await else {
            outcomes.extend(group.into_iter().map(|candidate| (candidate.path, FileOutcome::Deferred)));
            continue;
        };
        let read_context = context.clone();
        let Ok((prepared, rejected)) = tokio::task::spawn_blocking(move || read_all(&read_context, group)).await else {
            continue;
        };
        outcomes.extend(rejected);
        let appends = prepared.into_iter().map(|file| {
            let writer = &context.writer;
            async move { (file.path, writer.append(file.meta, file.payload).await) }
        });
        let answered = futures::future::join_all(appends).await;
        let finish_context = context.clone();
        if let Ok(finished) = tokio::task::spawn_blocking(move || finish_all(&finish_context, answered)).await {
            outcomes.extend(finished);
        }
    }
    for (_, outcome) in &outcomes {
        let counter = match outcome {
            FileOutcome::Ingested => &context.stats.files_ingested,
            FileOutcome::Quarantined => &context.stats.files_quarantined,
            FileOutcome::Deferred => &context.stats.files_deferred,
            FileOutcome::Skipped => continue,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
    outcomes
}

/// Split candidates into groups of at most [`READ_GROUP_BYTES`] (a larger file forms a group of its own).
fn read_groups(candidates: Vec<Candidate>) -> Vec<Vec<Candidate>> {
    let mut groups: Vec<Vec<Candidate>> = Vec::new();
    let mut group_bytes = 0;
    for candidate in candidates {
        let len = candidate.metadata.len();
        if groups.is_empty() || group_bytes + len > READ_GROUP_BYTES {
            groups.push(Vec::new());
            group_bytes = 0;
        }
        group_bytes += len;
        groups.last_mut().expect("a group was just pushed").push(candidate);
    }
    groups
}

/// Blocking: stat each path and check what can be checked without reading. Returns the files to read and the
/// outcomes of the rest.
fn stat_all(context: &IngestContext, paths: Vec<PathBuf>) -> (Vec<Candidate>, BatchOutcomes) {
    let mut candidates = Vec::with_capacity(paths.len());
    let mut outcomes = Vec::new();
    for path in paths {
        match stat_one(context, &path) {
            Ok(Some((metadata, relative))) => candidates.push(Candidate { path, metadata, relative }),
            Ok(None) => outcomes.push((path, FileOutcome::Skipped)),
            Err(rejection) => {
                let outcome = reject(context, &path, rejection);
                outcomes.push((path, outcome));
            }
        }
    }
    (candidates, outcomes)
}

enum Rejection {
    Quarantine(String),
    Defer(String),
}

fn reject(context: &IngestContext, path: &Path, rejection: Rejection) -> FileOutcome {
    match rejection {
        Rejection::Quarantine(reason) => quarantine(context, path, &reason),
        Rejection::Defer(reason) => {
            tracing::debug!(file = %path.display(), reason, "inbox file deferred");
            FileOutcome::Deferred
        }
    }
}

/// `Ok(None)`: nothing to ingest (gone, or not a regular file).
fn stat_one(context: &IngestContext, path: &Path) -> Result<Option<(fs::Metadata, String)>, Rejection> {
    let metadata = match fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_file() => metadata,
        Ok(_) => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Rejection::Defer(e.to_string())),
    };
    let relative = relative_name(&context.paths.inbox, path);
    let Some((stream, name)) = relative.rsplit_once('/') else {
        return Err(Rejection::Quarantine("file is directly in inbox/; put it under inbox/<stream>/".into()));
    };
    capture::validate_stream(stream).map_err(Rejection::Quarantine)?;
    let header_allowance = if is_envelope_name(name) { MAX_ENVELOPE_HEADER as u64 } else { 0 };
    if metadata.len() > context.max_capture_bytes + header_allowance {
        return Err(Rejection::Quarantine(format!(
            "file is {} bytes, more than spool.max_capture_bytes = {}",
            metadata.len(),
            context.max_capture_bytes
        )));
    }
    Ok(Some((metadata, relative)))
}

/// Blocking: read and validate each file of a group.
fn read_all(context: &IngestContext, group: Vec<Candidate>) -> (Vec<Prepared>, BatchOutcomes) {
    let mut prepared = Vec::with_capacity(group.len());
    let mut outcomes = Vec::new();
    for candidate in group {
        match read_one(&candidate) {
            Ok(Some((meta, payload))) => prepared.push(Prepared { path: candidate.path, meta, payload }),
            Ok(None) => outcomes.push((candidate.path, FileOutcome::Skipped)),
            Err(rejection) => {
                let outcome = reject(context, &candidate.path, rejection);
                outcomes.push((candidate.path, outcome));
            }
        }
    }
    (prepared, outcomes)
}

fn read_one(candidate: &Candidate) -> Result<Option<(CaptureMeta, Vec<u8>)>, Rejection> {
    let Candidate { path, metadata, relative } = candidate;
    let contents = match fs::read(path) {
        Ok(contents) => contents,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Rejection::Defer(e.to_string())),
    };
    if contents.len() as u64 != metadata.len() {
        // Still being written in place (the producer did not rename in); the next event or rescan sees it whole.
        return Err(Rejection::Defer("file changed while being read".into()));
    }
    let (stream, name) = relative.rsplit_once('/').expect("stat_one checked the stream directory");
    let (header, payload) = if is_envelope_name(name) {
        parse_envelope(contents).map_err(Rejection::Quarantine)?
    } else {
        (EnvelopeHeader::default(), contents)
    };
    let mtime_ns = (metadata.mtime() as u64).saturating_mul(1_000_000_000) + metadata.mtime_nsec() as u64;
    let meta = CaptureMeta {
        capture_id: capture_id_from_name(name).unwrap_or_else(Uuid::now_v7),
        stream: stream.to_string(),
        captured_at_ns: header.captured_at_ns.unwrap_or(mtime_ns),
        labels: header.labels,
        content_type: header.content_type,
        source_name: Some(source_key(relative, metadata)),
    };
    capture::validate_meta(&meta).map_err(Rejection::Quarantine)?;
    Ok(Some((meta, payload)))
}

/// Blocking: act on the spool's answers. An acknowledged file is unlinked (its record is durable; a crash before the
/// unlink is durable is handled by recovery, which finds the source key in a pack; the directory fsync is batched,
/// see [`UnlinkLog`]).
fn finish_all(
    context: &IngestContext,
    answered: Vec<(PathBuf, Result<super::writer::Ack, AppendError>)>,
) -> BatchOutcomes {
    let mut outcomes = Vec::with_capacity(answered.len());
    for (path, answer) in answered {
        let outcome = match answer {
            Ok(_ack) => {
                match fs::remove_file(&path) {
                    Ok(()) => context.unlinks.record(&path),
                    Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                    Err(error) => {
                        tracing::warn!(file = %path.display(), %error, "captured inbox file could not be removed")
                    }
                }
                FileOutcome::Ingested
            }
            Err(error @ (AppendError::TooLarge { .. } | AppendError::Invalid(_))) => {
                quarantine(context, &path, &error.to_string())
            }
            Err(error) => {
                tracing::debug!(file = %path.display(), %error, "inbox file deferred");
                FileOutcome::Deferred
            }
        };
        outcomes.push((path, outcome));
    }
    outcomes
}

fn quarantine(context: &IngestContext, path: &Path, reason: &str) -> FileOutcome {
    let relative = relative_name(&context.paths.inbox, path);
    match context.paths.quarantine("inbox", path, reason) {
        Ok(moved) => {
            tracing::warn!(file = %relative, quarantined_as = %moved.display(), reason, "inbox file quarantined");
            FileOutcome::Quarantined
        }
        Err(error) => {
            tracing::warn!(file = %relative, reason, %error, "inbox file rejected but could not be quarantined");
            FileOutcome::Deferred
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_ignored_name(".partial"));
        assert!(is_ignored_name("x.tmp"));
        assert!(!is_ignored_name("x.bin"));
        let id = Uuid::now_v7();
        assert_eq!(capture_id_from_name(&id.to_string()), Some(id));
        assert_eq!(capture_id_from_name(&format!("{id}.json")), Some(id));
        assert_eq!(capture_id_from_name("frame-1.jpg"), None);
        assert_eq!(capture_id_from_name(&id.simple().to_string()), None);
    }

    #[test]
    fn a_limited_walk_takes_a_slice_and_skips_hidden_and_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let stream = dir.path().join("s");
        fs::create_dir_all(&stream).unwrap();
        for i in 0..10 {
            fs::write(stream.join(format!("f{i}")), b"x").unwrap();
        }
        fs::write(stream.join(".hidden"), b"x").unwrap();
        fs::write(stream.join("partial.tmp"), b"x").unwrap();
        assert_eq!(walk_inbox(dir.path()).unwrap().len(), 10);
        let slice = walk_inbox_limited(dir.path(), 4).unwrap();
        assert_eq!(slice.len(), 4);
        assert!(slice.iter().all(|path| path.file_name().unwrap().to_string_lossy().starts_with('f')));
    }
}
