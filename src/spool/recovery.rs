//! Start-time recovery: bring a spool left by a crashed (or cleanly stopped) process to a consistent state.
//!
//! Runs once, under the spool lock, before anything else touches the spool. Every step is idempotent, so a crash
//! during recovery is recovered by the next start.
//!
//! 1. Leftover temporary files of our own crash-safe writes are removed (in `quarantine/` too).
//! 2. Each `.open` pack is scanned: every complete record whose checksum verifies is kept, the torn tail is cut, footer
//!    and trailer are written and the pack is renamed `.sealed`. A pack with no valid record is removed; a pack whose
//!    header is unreadable but holds more than a header's worth of bytes is quarantined (it is not ours to delete).
//!    ([`super::unsealed`], which the writer's sealer also uses for a pack whose seal failed during a run.) A pack
//!    that cannot be sealed for an I/O error (a full disk) but can be read is indexed as left open (its records'
//!    source keys count for step 4), and the writer's sealer seals it once it runs.
//! 3. Each `.sealed` and `.uploaded` pack has its trailer and footer checked; a pack that fails goes to quarantine:
//!    at once for bad bytes, after a few tries over 0.75 s for an I/O error ([`READ_TRIES`]; an `.open` pack that
//!    cannot even be read likewise).
//! 4. Inbox exactly-once: an inbox file whose source key is already recorded in a pack was captured before the crash
//!    (its unlink was lost), so it is removed instead of being ingested twice; one that cannot be removed is recorded
//!    in the inbox ledger instead, and ledger entries of files now gone are dropped. A file or directory of the inbox
//!    that cannot be read never fails the start.

use std::collections::HashSet;
use std::io;
use std::time::Duration;

use serde::Serialize;

use super::inbox::ledger::InboxLedger;
use super::index::SpoolIndex;
use super::unsealed::{index_left_open, quarantine_pack, seal_open_pack, OpenPackSealed};
use super::{inbox, list_packs, PackListing, PackState, SpoolPaths};
use crate::pack::{self, PackError, PackFile};

#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct RecoveryReport {
    pub open_packs_sealed: u64,
    /// `.open` packs that could not be sealed for an I/O error (a full disk): indexed as left open, for the writer's
    /// sealer to seal once it runs.
    pub open_packs_left_open: u64,
    pub records_recovered: u64,
    pub bytes_cut: u64,
    pub empty_packs_removed: u64,
    pub packs_quarantined: u64,
    pub inbox_duplicates_removed: u64,
    pub temp_files_removed: u64,
}

impl RecoveryReport {
    pub fn is_clean(&self) -> bool {
        *self == RecoveryReport::default()
    }
}

/// Delete the temporary files a crash left in the directories of `quarantine/` (a `.reason` file being written when a
/// pack or an inbox file was quarantined; they would stay there for good). Quarantine is the operator's: a directory
/// of it that cannot be read is warned about and never fails the start.
fn remove_leftover_temp_files_of_quarantine(paths: &SpoolPaths) -> u64 {
    let mut removed = 0;
    let dirs = match std::fs::read_dir(&paths.quarantine) {
        Ok(entries) => entries.filter_map(Result::ok).filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir())),
        Err(error) if error.kind() == io::ErrorKind::NotFound => return 0,
        Err(error) => {
            tracing::warn!(dir = %paths.quarantine.display(), %error, "recovery: cannot read the quarantine");
            return 0;
        }
    };
    for dir in dirs {
        match paths.remove_leftover_temp_files(&dir.path()) {
            Ok(count) => removed += count,
            Err(error) => {
                tracing::warn!(dir = %dir.path().display(), %error, "recovery: cannot clean a quarantine directory")
            }
        }
    }
    removed
}

pub fn recover(paths: &SpoolPaths, inbox_ledger: &InboxLedger, index: &SpoolIndex) -> io::Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    report.temp_files_removed += paths.remove_leftover_temp_files(&paths.packs)?;
    report.temp_files_removed += paths.remove_leftover_temp_files(&paths.root)?;
    report.temp_files_removed += remove_leftover_temp_files_of_quarantine(paths);

    let mut source_keys = HashSet::new();
    // Packs that could not be read for an I/O error, with the error: tried again after the others (READ_TRIES).
    let mut unread: Vec<(PackListing, PackError)> = Vec::new();
    for listing in list_packs(paths)? {
        if listing.state == PackState::Open
            && !seal_open_pack_for_start(paths, index, &listing, &mut report, &mut source_keys)?
        {
            continue;
        }
        if let Err(error) = read_pack(paths, index, &listing, &mut report, &mut source_keys)? {
            unread.push((listing, error));
        }
    }
    let mut wait = READ_RETRY_FIRST;
    for _ in 1..READ_TRIES {
        if unread.is_empty() {
            break;
        }
        for (listing, error) in &unread {
            tracing::warn!(pack = %listing.path.display(), %error, "a pack could not be read; trying it again");
        }
        std::thread::sleep(wait);
        wait *= 2;
        let mut still_unread = Vec::new();
        for (listing, _) in unread {
            if let Err(error) = read_pack(paths, index, &listing, &mut report, &mut source_keys)? {
                still_unread.push((listing, error));
            }
        }
        unread = still_unread;
    }
    for (listing, error) in unread {
        let reason = format!("unreadable {} pack after {READ_TRIES} tries: {error}", listing.state.extension());
        quarantine_pack(paths, &listing.path, &reason)?;
        index.forget(listing.pack_id);
        report.packs_quarantined += 1;
    }
    report.inbox_duplicates_removed = inbox::remove_already_captured(paths, inbox_ledger, &source_keys)?;
    if !report.is_clean() {
        tracing::info!(
            open_packs_sealed = report.open_packs_sealed,
            open_packs_left_open = report.open_packs_left_open,
            records_recovered = report.records_recovered,
            bytes_cut = report.bytes_cut,
            empty_packs_removed = report.empty_packs_removed,
            packs_quarantined = report.packs_quarantined,
            inbox_duplicates_removed = report.inbox_duplicates_removed,
            temp_files_removed = report.temp_files_removed,
            "spool recovered"
        );
    }
    Ok(report)
}

/// The first step for an `.open` pack: seal it (its records' source keys into `source_keys`, step 4). True when it is
/// left to read (its seal failed for an I/O error, a full disk say: [`read_pack`] then indexes it as left open, and
/// the writer's sealer tries again once it runs, as after a seal that failed during a run; the packs after it wait
/// for it).
fn seal_open_pack_for_start(
    paths: &SpoolPaths,
    index: &SpoolIndex,
    listing: &PackListing,
    report: &mut RecoveryReport,
    source_keys: &mut HashSet<String>,
) -> io::Result<bool> {
    match seal_open_pack(paths, index, listing.pack_id) {
        Ok(OpenPackSealed::Sealed { entries, bytes_cut }) => {
            collect_source_keys(&entries, source_keys);
            report.open_packs_sealed += 1;
            report.records_recovered += entries.len() as u64;
            report.bytes_cut += bytes_cut;
            Ok(false)
        }
        Ok(OpenPackSealed::Removed { bytes_cut }) => {
            report.empty_packs_removed += 1;
            report.bytes_cut += bytes_cut;
            Ok(false)
        }
        Ok(OpenPackSealed::Quarantined) => {
            report.packs_quarantined += 1;
            Ok(false)
        }
        Err(error) => {
            tracing::error!(pack_id = %listing.pack_id, %error, "an open pack could not be sealed; it is tried again once the writer runs");
            Ok(true)
        }
    }
}

/// Reads a pack into the index and its records' source keys into `source_keys` (step 4): a sealed or uploaded pack's
/// footer, or the records a read-only scan finds in an open pack left open. Bad bytes send it to quarantine; an I/O
/// error is returned inside the Ok, for the start to try again.
fn read_pack(
    paths: &SpoolPaths,
    index: &SpoolIndex,
    listing: &PackListing,
    report: &mut RecoveryReport,
    source_keys: &mut HashSet<String>,
) -> io::Result<Result<(), PackError>> {
    let read = match listing.state {
        PackState::Open => index_left_open(paths, index, listing.pack_id).map(|entries| {
            collect_source_keys(&entries, source_keys);
            report.open_packs_left_open += 1;
        }),
        PackState::Sealed | PackState::Uploaded => PackFile::open(&listing.path).map(|pack| {
            collect_source_keys(pack.entries(), source_keys);
            index.add_sealed(listing.pack_id, pack.entries());
        }),
    };
    match read {
        Ok(()) => Ok(Ok(())),
        Err(error) if error.is_data_error() => {
            let reason = format!("unreadable {} pack: {error}", listing.state.extension());
            quarantine_pack(paths, &listing.path, &reason)?;
            index.forget(listing.pack_id);
            report.packs_quarantined += 1;
            Ok(Ok(()))
        }
        Err(error) => Ok(Err(error)),
    }
}

/// Tries a start gives a pack it cannot read for an I/O error (EMFILE, ENOMEM, EIO, not a regular file) before the
/// pack goes to quarantine: the packs that failed are tried again after the others, the wait doubling from
/// [`READ_RETRY_FIRST`] (0.75 s in all, however many they are). A passing shortage clears without parking
/// acknowledged captures, and a disk that keeps failing does not keep the daemon from starting (a start that failed
/// instead would be restarted every few seconds, with every other pack and all ingest stopped). The price of the
/// quarantine: the pack's captures are not read from the spool until an operator restores it, and its records' inbox
/// source keys are unknown, so an inbox file whose unlink a crash lost just before is captured again.
const READ_TRIES: u32 = 5;
const READ_RETRY_FIRST: Duration = Duration::from_millis(50);

fn collect_source_keys(entries: &[pack::IndexEntry], source_keys: &mut HashSet<String>) {
    source_keys.extend(entries.iter().filter_map(|entry| entry.meta.source_name.clone()));
}
