//! Inbox ingest: files dropped under `<spool>/inbox/<stream>/` become captures, exactly once.
//!
//! A producer writes a file elsewhere (or under a name starting with `.` or ending in `.tmp`, both ignored) and renames
//! it into `inbox/<stream>/<name>`. The stream is the subdirectory path. A name `<uuid>` or `<uuid>.<ext>` keeps that
//! capture_id; any other name gets a generated UUIDv7. Envelopes ([`super::envelope`]) carry labels, a content type
//! and a capture time in front of the payload; a plain file's captured_at_ns is its modification time (the epoch if
//! that is before 1970).
//!
//! Nothing outside the inbox is ever read or deleted because of what a producer put in it: every listing, open,
//! check and unlink goes through the inbox's directory descriptor and never follows a symbolic link
//! ([`beneath::InboxRoot`]). A symlink, FIFO, socket or device in the inbox is skipped with one WARN (per file, until
//! it changes) and never opened; a directory that cannot be listed is skipped with one WARN, never fatal.
//!
//! Exactly-once: each record carries the file's source key (`<stream>/<name>` plus inode, size and mtime, so a later
//! file reusing the name is a different source). The inbox file is unlinked only after its record is fsynced; if a
//! crash lands between the fsync and the unlink, recovery finds the key in a pack and removes the file instead of
//! ingesting it again. A captured file that cannot be unlinked (a read-only stream directory) goes into the
//! [`ledger`], so it is never captured twice either, before or after a restart.
//!
//! Bad input (an invalid stream name, a file over `spool.max_capture_bytes`, a malformed envelope) is moved to
//! `quarantine/inbox/` with one WARN line and a `.reason` file; it never blocks other files. A file refused for a full
//! spool stays where it is and is retried.
//!
//! Discovery: a recursive `notify` watcher reports files closed after writing and files renamed in; a periodic rescan
//! backs it up, so a missed event only delays a file.

pub mod beneath;
mod ingest;
pub mod ledger;

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch, Semaphore};
use uuid::Uuid;

use super::writer::SpoolWriter;
use super::SpoolPaths;
use crate::durable;
use beneath::{EntryKind, FileIdentity, InboxRoot};
use ingest::{ingest_batch, BatchOutcomes, FileOutcome};
use ledger::InboxLedger;

/// Bytes of payload in memory at once across all ingest tasks, from the read until the spool acknowledged the append
/// (a single larger file still goes, alone). This bounds the daemon's memory however large the inbox backlog is.
const READ_BUDGET_KIB: u32 = 16 * 1024;
/// How often the directories of unlinked inbox files are fsynced (one fsync per directory, not one per file).
const UNLINK_SYNC_INTERVAL: Duration = Duration::from_millis(50);
/// How soon to look again after the spool refused a file for lack of space.
const RETRY_AFTER_REFUSAL: Duration = Duration::from_secs(1);
/// Files stat'ed, read, appended and unlinked together: one hop to a blocking thread per step and batch, not per file.
const BATCH_FILES: usize = 64;
/// Batches ingested at once. Their appends wait on the spool's group commit together, which fills its batches.
const MAX_BATCHES_IN_FLIGHT: usize = 16;
/// Paths waiting in the backlog at most; beyond it, events are dropped for a rescan, and a rescan takes a slice.
const BACKLOG_LIMIT: usize = 16 * 1024;
/// Entries remembered for warn-once (special files, unreadable directories); beyond it the oldest memory is dropped
/// and a file may be warned about once more.
const WARNED_LIMIT: usize = 4096;

/// Names producers use while writing; never ingested.
pub fn is_ignored_name(name: &str) -> bool {
    name.starts_with('.') || name.ends_with(durable::TEMP_SUFFIX)
}

fn is_ignored(name: &OsStr) -> bool {
    is_ignored_name(&name.to_string_lossy())
}

/// Identity of one inbox file for exactly-once ingest.
pub fn source_key(relative_path: &str, identity: &FileIdentity) -> String {
    format!("{relative_path}@{}:{}:{}", identity.ino, identity.len, identity.mtime_ns)
}

/// The capture_id a file name asks for: `<uuid>` or `<uuid>.<ext>`.
pub fn capture_id_from_name(name: &str) -> Option<Uuid> {
    let stem = name.split_once('.').map_or(name, |(stem, _)| stem);
    Uuid::parse_str(stem).ok().filter(|_| stem.len() == 36)
}

/// Every ingestible regular file under `dir` (absolute paths, sorted): what ingest would look at, found the way it
/// finds files (no symlink followed, hidden and temporary names skipped). For tools and tests.
pub fn walk_inbox(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let root = match InboxRoot::open(dir) {
        Ok(root) => root,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    let walk = root.walk(Path::new(""), usize::MAX, is_ignored);
    Ok(walk.files.into_iter().map(|relative| dir.join(relative)).collect())
}

/// Recovery step: remove inbox files whose source key is already in a pack, record in the ledger those that cannot be
/// removed, and drop ledger entries whose file is gone. Never fails the start for one file or directory; returns how
/// many files were removed.
pub fn remove_already_captured(
    paths: &SpoolPaths,
    ledger: &InboxLedger,
    source_keys: &HashSet<String>,
) -> io::Result<u64> {
    let root = InboxRoot::open(&paths.inbox)?;
    let walk = root.walk(Path::new(""), usize::MAX, is_ignored);
    for (dir, error) in &walk.unreadable {
        // Ingest warns about it (once) as soon as it walks the inbox.
        tracing::debug!(dir = %dir.display(), %error, "inbox directory cannot be listed; skipped by recovery");
    }
    let mut present = HashSet::new();
    let mut removed = 0;
    for relative in walk.files {
        let (Some(text), Ok(Some((EntryKind::File, identity)))) = (relative.to_str(), root.stat(&relative)) else {
            continue;
        };
        let key = source_key(text, &identity);
        // Captured before the crash, or captured earlier but not removable then: try again now.
        if source_keys.contains(&key) || ledger.contains(&key) {
            match root.unlink(&relative, &identity) {
                Ok(true) => {
                    root.sync_dir(relative.parent().unwrap_or(Path::new("")))?;
                    removed += 1;
                    tracing::info!(file = %text, "inbox file was already captured before the crash; removed");
                    continue;
                }
                Ok(false) => continue,
                Err(error) => {
                    if ledger.record(&key)? {
                        tracing::warn!(file = %text, %error, "inbox file was captured but cannot be removed; it stays \
                                       listed in inbox-captured and is not captured again");
                    }
                }
            }
        }
        present.insert(key);
    }
    let pruned = ledger.prune(|key| present.contains(key))?;
    if pruned > 0 {
        tracing::info!(pruned, "inbox-captured: entries of files no longer in the inbox dropped");
    }
    Ok(removed)
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
#[derive(Debug)]
pub struct UnlinkLog {
    inbox: Arc<InboxRoot>,
    /// Directories relative to the inbox.
    dirty_dirs: Mutex<HashSet<PathBuf>>,
}

impl UnlinkLog {
    fn new(inbox: Arc<InboxRoot>) -> UnlinkLog {
        UnlinkLog { inbox, dirty_dirs: Mutex::default() }
    }

    fn record(&self, file: &Path) {
        let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
        self.dirty_dirs.lock().unwrap_or_else(|p| p.into_inner()).insert(dir);
    }

    /// Make every recorded unlink durable.
    pub fn sync(&self) -> io::Result<()> {
        let dirs: Vec<PathBuf> = self.dirty_dirs.lock().unwrap_or_else(|p| p.into_inner()).drain().collect();
        for dir in dirs {
            match self.inbox.sync_dir(&dir) {
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

/// What every ingest batch shares.
struct IngestContext {
    inbox: Arc<InboxRoot>,
    paths: SpoolPaths,
    ledger: Arc<InboxLedger>,
    unlinks: Arc<UnlinkLog>,
    writer: SpoolWriter,
    max_capture_bytes: u64,
    stats: Arc<IngestStats>,
    read_budget: Semaphore,
    /// Special files and unreadable directories already warned about, with the identity they had then.
    warned: Mutex<HashMap<PathBuf, FileIdentity>>,
}

impl IngestContext {
    /// True the first time `relative` is seen with this identity (and again after it changes).
    fn first_sighting(&self, relative: &Path, identity: &FileIdentity) -> bool {
        let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
        if warned.get(relative) == Some(identity) {
            return false;
        }
        if warned.len() >= WARNED_LIMIT {
            warned.clear();
        }
        warned.insert(relative.to_path_buf(), *identity);
        true
    }

    fn warn_special_once(&self, relative: &Path, identity: &FileIdentity) {
        if self.first_sighting(relative, identity) {
            tracing::warn!(
                file = %relative.display(),
                "inbox entry is not a regular file (a symlink, FIFO, socket or device): skipped, never opened"
            );
        }
    }

    fn warn_unreadable_dir_once(&self, relative: &Path, error: &io::Error) {
        let identity = match self.inbox.stat(relative) {
            Ok(Some((_, identity))) => identity,
            _ => FileIdentity { dev: 0, ino: 0, len: 0, mtime_ns: 0 },
        };
        if self.first_sighting(relative, &identity) {
            tracing::warn!(dir = %relative.display(), %error, "inbox directory cannot be listed; skipped until it changes");
        }
    }

    /// A captured file that cannot be unlinked: record it so it is never captured again, and say so once.
    fn keep_captured(&self, relative_text: &str, identity: &FileIdentity, error: &io::Error) {
        match self.ledger.record(&source_key(relative_text, identity)) {
            Ok(true) => tracing::warn!(
                file = relative_text,
                %error,
                "captured inbox file cannot be removed; listed in inbox-captured so it is not captured again"
            ),
            Ok(false) => {}
            Err(ledger_error) => tracing::error!(
                file = relative_text,
                %error,
                %ledger_error,
                "captured inbox file can neither be removed nor recorded; it may be captured again"
            ),
        }
    }

    fn quarantine(&self, relative: &Path, identity: &FileIdentity, reason: &str) -> FileOutcome {
        let name = relative.file_name().map_or_else(|| "unnamed".into(), |name| name.to_string_lossy().into_owned());
        let moved = self
            .paths
            .quarantine_slot("inbox", &name, reason)
            .and_then(|target| self.inbox.move_out(relative, identity, &target).map(|()| target));
        match moved {
            Ok(target) => {
                tracing::warn!(file = %relative.display(), quarantined_as = %target.display(), reason, "inbox file quarantined");
                FileOutcome::Quarantined
            }
            Err(error) => {
                tracing::warn!(file = %relative.display(), reason, %error, "inbox file rejected but could not be quarantined");
                FileOutcome::Deferred
            }
        }
    }
}

/// Runs until `shutdown_rx` turns true; then finishes the files in flight and returns.
///
/// States of the loop: a `backlog` of at most `BACKLOG_LIMIT` candidate paths, relative to the inbox (from events and
/// rescans; it may hold duplicates and files already gone, which cost one `stat`), up to `MAX_BATCHES_IN_FLIGHT`
/// batches being ingested (`in_flight` holds their paths, so no file is ever ingested by two batches at once), and
/// `rescan_pending`: a rescan was asked for (by the timer, an event overflow, a full backlog, a rescan that stopped at
/// the limit, or a deferral) and runs once the backlog is empty. So memory stays bounded however many files wait in
/// the inbox, and a burst of events never causes a rescan per event.
pub struct Ingestor {
    context: Arc<IngestContext>,
    rescan_interval: Duration,
}

impl Ingestor {
    pub fn new(
        paths: SpoolPaths,
        inbox: Arc<InboxRoot>,
        ledger: Arc<InboxLedger>,
        writer: SpoolWriter,
        max_capture_bytes: u64,
        rescan_interval: Duration,
    ) -> Ingestor {
        let context = IngestContext {
            unlinks: Arc::new(UnlinkLog::new(inbox.clone())),
            inbox,
            paths,
            ledger,
            writer,
            max_capture_bytes,
            stats: Arc::new(IngestStats::default()),
            read_budget: Semaphore::new(READ_BUDGET_KIB as usize),
            warned: Mutex::default(),
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
        let _watcher = start_watcher(self.context.inbox.path(), events_tx, rescan_now.clone());
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
                let (found, more) = self.walk(PathBuf::new()).await;
                backlog.extend(found);
                rescan_pending = more;
            }
            while batches.len() < MAX_BATCHES_IN_FLIGHT && !backlog.is_empty() {
                let batch = take_batch(&mut backlog, &mut in_flight);
                if !batch.is_empty() {
                    batches.spawn(ingest_batch(self.context.clone(), batch));
                }
            }
            tokio::select! {
                _ = shutdown_rx.changed() => break,
                _ = unlink_sync.tick() => self.sync_unlinks().await,
                Some(paths) = events_rx.recv() => {
                    for path in paths {
                        let Some(relative) = self.context.inbox.relative_of(&path) else { continue };
                        if backlog.len() >= BACKLOG_LIMIT {
                            // Found again by the rescan once the backlog is worked off.
                            rescan_pending = true;
                        } else if self.is_directory(&relative).await {
                            // A directory appeared: files renamed into it before its watch existed would be missed.
                            let (found, more) = self.walk(relative).await;
                            backlog.extend(found);
                            rescan_pending |= more;
                        } else {
                            backlog.push_back(relative);
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

    async fn sync_unlinks(&self) {
        let unlinks = self.context.unlinks.clone();
        if let Ok(Err(error)) = tokio::task::spawn_blocking(move || unlinks.sync()).await {
            tracing::warn!(%error, "cannot fsync inbox directories after unlinks");
        }
    }

    /// Whether `relative` is a directory, seen without following a symlink.
    async fn is_directory(&self, relative: &Path) -> bool {
        let (inbox, relative) = (self.context.inbox.clone(), relative.to_path_buf());
        let stat = tokio::task::spawn_blocking(move || inbox.stat(&relative)).await;
        matches!(stat, Ok(Ok(Some((EntryKind::Directory, _)))))
    }

    /// Up to `BACKLOG_LIMIT` files under `dir` (relative to the inbox), and whether there may be more. Special files
    /// and directories that cannot be listed are warned about once and skipped: they never make the walk fail, so a
    /// bad entry cannot stall ingest or cause a rescan loop.
    async fn walk(&self, dir: PathBuf) -> (Vec<PathBuf>, bool) {
        let context = self.context.clone();
        let walked = tokio::task::spawn_blocking(move || {
            let walk = context.inbox.walk(&dir, BACKLOG_LIMIT, is_ignored);
            for (unreadable, error) in &walk.unreadable {
                context.warn_unreadable_dir_once(unreadable, error);
            }
            for special in &walk.special {
                if let Ok(Some((_, identity))) = context.inbox.stat(special) {
                    context.warn_special_once(special, &identity);
                }
            }
            tracing::debug!(
                dir = %dir.display(),
                files = walk.files.len(),
                special = walk.special.len(),
                unreadable = walk.unreadable.len(),
                "inbox walked"
            );
            (walk.files, walk.truncated)
        })
        .await;
        walked.unwrap_or((Vec::new(), true))
    }
}

/// Up to [`BATCH_FILES`] ingestible paths from the front of the backlog that no batch is working on.
fn take_batch(backlog: &mut VecDeque<PathBuf>, in_flight: &mut HashSet<PathBuf>) -> Vec<PathBuf> {
    let mut batch = Vec::with_capacity(BATCH_FILES);
    while batch.len() < BATCH_FILES {
        let Some(path) = backlog.pop_front() else { break };
        let name_ignored = path.file_name().is_none_or(is_ignored);
        if name_ignored || in_flight.contains(&path) {
            continue;
        }
        in_flight.insert(path.clone());
        batch.push(path);
    }
    batch
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
    fn a_walk_skips_hidden_and_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let stream = dir.path().join("s");
        std::fs::create_dir_all(&stream).unwrap();
        for i in 0..10 {
            std::fs::write(stream.join(format!("f{i}")), b"x").unwrap();
        }
        std::fs::write(stream.join(".hidden"), b"x").unwrap();
        std::fs::write(stream.join("partial.tmp"), b"x").unwrap();
        let files = walk_inbox(dir.path()).unwrap();
        assert_eq!(files.len(), 10);
        assert!(files.iter().all(|path| path.file_name().unwrap().to_string_lossy().starts_with('f')));
        let slice = InboxRoot::open(dir.path()).unwrap().walk(Path::new(""), 4, is_ignored);
        assert_eq!(slice.files.len(), 4);
        assert!(slice.truncated);
    }
}
