//! One ingest batch: stat the files, read them (bounded by bytes), append them together (they share the spool's
//! fsyncs), then unlink the acknowledged ones, each step on a blocking thread and every file access through
//! [`InboxRoot`] (never following a symlink).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use uuid::Uuid;

use super::beneath::{EntryKind, FileIdentity, ReadRefusal};
use super::{capture_id_from_name, source_key, IngestContext};
use crate::capture::{self, CaptureMeta};
use crate::spool::envelope::{is_envelope_name, parse_envelope, EnvelopeHeader, MAX_ENVELOPE_HEADER};
use crate::spool::writer::{Ack, AppendError};

/// Files of a batch are read together up to this many bytes (a larger file is read alone).
const READ_GROUP_BYTES: u64 = 4 << 20;

/// What happened to one inbox file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum FileOutcome {
    Ingested,
    Quarantined,
    /// Left in place: spool full or a transient error; look again soon.
    Deferred,
    /// Gone, not a regular file, captured already, or still being written: nothing to do now.
    Skipped,
}

pub(super) type BatchOutcomes = Vec<(PathBuf, FileOutcome)>;

/// One inbox file between its `stat` and its append (paths are relative to the inbox).
struct Candidate {
    relative: PathBuf,
    identity: FileIdentity,
    /// `<stream>/<name>`, UTF-8 (checked by the stat step).
    relative_text: String,
}

/// A file read and validated, ready to append.
struct Prepared {
    candidate: Candidate,
    meta: CaptureMeta,
    payload: Vec<u8>,
}

enum Rejection {
    Quarantine(String),
    Defer(String),
}

/// Ingest a batch of inbox files (relative paths): stat them, then per read group (bounded by bytes and by the
/// shared read budget, held until the appends are answered) read them, append them all at once, and unlink the ones
/// acknowledged.
pub(super) async fn ingest_batch(context: Arc<IngestContext>, paths: Vec<PathBuf>) -> BatchOutcomes {
    let stat_context = context.clone();
    let (candidates, mut outcomes) = match tokio::task::spawn_blocking(move || stat_all(&stat_context, paths)).await {
        Ok(stated) => stated,
        Err(_) => return Vec::new(),
    };
    for group in read_groups(candidates) {
        let group_bytes: u64 = group.iter().map(|candidate| candidate.identity.len).sum();
        let budget_kib = ((group_bytes / 1024) as u32).clamp(1, super::READ_BUDGET_KIB);
        let Ok(_budget) = context.read_budget.acquire_many(budget_kib).await else {
            outcomes.extend(group.into_iter().map(|candidate| (candidate.relative, FileOutcome::Deferred)));
            continue;
        };
        let read_context = context.clone();
        let Ok((prepared, rejected)) = tokio::task::spawn_blocking(move || read_all(&read_context, group)).await else {
            continue;
        };
        outcomes.extend(rejected);
        let appends = prepared.into_iter().map(|file| {
            let writer = &context.writer;
            async move { (file.candidate, writer.append(file.meta, file.payload).await) }
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
        let len = candidate.identity.len;
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
    for relative in paths {
        match stat_one(context, &relative) {
            Ok(Some(candidate)) => candidates.push(candidate),
            Ok(None) => outcomes.push((relative, FileOutcome::Skipped)),
            Err((identity, rejection)) => {
                let outcome = reject(context, &relative, &identity, rejection);
                outcomes.push((relative, outcome));
            }
        }
    }
    (candidates, outcomes)
}

/// `Ok(None)`: nothing to ingest (gone, not a regular file, or captured already but not removable).
fn stat_one(context: &IngestContext, relative: &Path) -> Result<Option<Candidate>, (FileIdentity, Rejection)> {
    let unknown = FileIdentity { dev: 0, ino: 0, len: 0, mtime_ns: 0 };
    let identity = match context.inbox.stat(relative) {
        Ok(Some((EntryKind::File, identity))) => identity,
        Ok(Some((EntryKind::Special, identity))) => {
            context.warn_special_once(relative, &identity);
            return Ok(None);
        }
        Ok(Some((EntryKind::Directory, _))) | Ok(None) => return Ok(None),
        Err(error) => return Err((unknown, Rejection::Defer(error.to_string()))),
    };
    let Some(relative_text) = relative.to_str().map(str::to_string) else {
        return Err((identity, Rejection::Quarantine("the file's path is not UTF-8".into())));
    };
    if context.ledger.contains(&source_key(&relative_text, &identity)) {
        return Ok(None);
    }
    let Some((stream, name)) = relative_text.rsplit_once('/') else {
        return Err((
            identity,
            Rejection::Quarantine("file is directly in inbox/; put it under inbox/<stream>/".into()),
        ));
    };
    capture::validate_stream(stream).map_err(|problem| (identity, Rejection::Quarantine(problem)))?;
    let header_allowance = if is_envelope_name(name) { MAX_ENVELOPE_HEADER as u64 } else { 0 };
    if identity.len > context.max_capture_bytes + header_allowance {
        let problem = format!(
            "file is {} bytes, more than spool.max_capture_bytes = {}",
            identity.len, context.max_capture_bytes
        );
        return Err((identity, Rejection::Quarantine(problem)));
    }
    Ok(Some(Candidate { relative: relative.to_path_buf(), identity, relative_text }))
}

fn reject(context: &IngestContext, relative: &Path, identity: &FileIdentity, rejection: Rejection) -> FileOutcome {
    match rejection {
        Rejection::Quarantine(reason) => context.quarantine(relative, identity, &reason),
        Rejection::Defer(reason) => {
            tracing::debug!(file = %relative.display(), reason, "inbox file deferred");
            FileOutcome::Deferred
        }
    }
}

/// Blocking: read and validate each file of a group.
fn read_all(context: &IngestContext, group: Vec<Candidate>) -> (Vec<Prepared>, BatchOutcomes) {
    let mut prepared = Vec::with_capacity(group.len());
    let mut outcomes = Vec::new();
    for candidate in group {
        match read_one(context, &candidate) {
            Ok(Some((meta, payload))) => prepared.push(Prepared { candidate, meta, payload }),
            Ok(None) => outcomes.push((candidate.relative, FileOutcome::Skipped)),
            Err(rejection) => {
                let outcome = reject(context, &candidate.relative, &candidate.identity, rejection);
                outcomes.push((candidate.relative, outcome));
            }
        }
    }
    (prepared, outcomes)
}

fn read_one(context: &IngestContext, candidate: &Candidate) -> Result<Option<(CaptureMeta, Vec<u8>)>, Rejection> {
    let contents = match context.inbox.read(&candidate.relative, &candidate.identity) {
        Ok(contents) => contents,
        Err(ReadRefusal::Gone) => return Ok(None),
        Err(ReadRefusal::NotRegular) => {
            context.warn_special_once(&candidate.relative, &candidate.identity);
            return Ok(None);
        }
        Err(ReadRefusal::Changed) => return Err(Rejection::Defer("file changed while being read".into())),
        Err(ReadRefusal::Io(error)) => return Err(Rejection::Defer(error.to_string())),
    };
    let (stream, name) = candidate.relative_text.rsplit_once('/').expect("stat_one checked the stream directory");
    let (header, payload) = if is_envelope_name(name) {
        parse_envelope(contents).map_err(Rejection::Quarantine)?
    } else {
        (EnvelopeHeader::default(), contents)
    };
    let meta = CaptureMeta {
        capture_id: capture_id_from_name(name).unwrap_or_else(Uuid::now_v7),
        stream: stream.to_string(),
        // A modification time before 1970 (a clock reset, a crafted file) counts as the epoch.
        captured_at_ns: header.captured_at_ns.unwrap_or(u64::try_from(candidate.identity.mtime_ns).unwrap_or(0)),
        labels: header.labels,
        content_type: header.content_type,
        source_name: Some(source_key(&candidate.relative_text, &candidate.identity)),
    };
    capture::validate_meta(&meta).map_err(Rejection::Quarantine)?;
    Ok(Some((meta, payload)))
}

/// Blocking: act on the spool's answers. An acknowledged file is unlinked (its record is durable; a crash before the
/// unlink is durable is handled by recovery, which finds the source key in a pack; the directory fsync is batched,
/// see [`super::UnlinkLog`]). A file that cannot be unlinked is recorded in the ledger instead, so it is never
/// captured again.
fn finish_all(context: &IngestContext, answered: Vec<(Candidate, Result<Ack, AppendError>)>) -> BatchOutcomes {
    let mut outcomes = Vec::with_capacity(answered.len());
    for (candidate, answer) in answered {
        let outcome = match answer {
            Ok(_ack) => {
                match context.inbox.unlink(&candidate.relative, &candidate.identity) {
                    Ok(_) => context.unlinks.record(&candidate.relative),
                    Err(error) => context.keep_captured(&candidate.relative_text, &candidate.identity, &error),
                }
                FileOutcome::Ingested
            }
            Err(error @ (AppendError::TooLarge { .. } | AppendError::Invalid(_))) => {
                context.quarantine(&candidate.relative, &candidate.identity, &error.to_string())
            }
            Err(error) => {
                tracing::debug!(file = %candidate.relative.display(), %error, "inbox file deferred");
                FileOutcome::Deferred
            }
        };
        outcomes.push((candidate.relative, outcome));
    }
    outcomes
}
