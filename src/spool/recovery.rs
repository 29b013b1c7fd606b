//! Start-time recovery: bring a spool left by a crashed (or cleanly stopped) process to a consistent state.
//!
//! Runs once, under the spool lock, before anything else touches the spool. Every step is idempotent, so a crash
//! during recovery is recovered by the next start.
//!
//! 1. Leftover temporary files of our own crash-safe writes are removed.
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
use super::{inbox, list_packs, PackState, SpoolPaths};
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

pub fn recover(paths: &SpoolPaths, inbox_ledger: &InboxLedger, index: &SpoolIndex) -> io::Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    report.temp_files_removed += paths.remove_leftover_temp_files(&paths.packs)?;
    report.temp_files_removed += paths.remove_leftover_temp_files(&paths.root)?;

    let mut source_keys = HashSet::new();
    for listing in list_packs(paths)? {
        match listing.state {
            PackState::Open => recover_open_pack(paths, index, listing.pack_id, &mut report, &mut source_keys)?,
            PackState::Sealed | PackState::Uploaded => match read_with_retries(|| PackFile::open(&listing.path)) {
                Ok(pack_file) => {
                    collect_source_keys(pack_file.entries(), &mut source_keys);
                    index.add_sealed(listing.pack_id, pack_file.entries());
                }
                Err(error) => {
                    let reason = format!("unreadable {} pack: {error}", listing.state.extension());
                    quarantine_pack(paths, &listing.path, &reason)?;
                    report.packs_quarantined += 1;
                }
            },
        }
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

fn recover_open_pack(
    paths: &SpoolPaths,
    index: &SpoolIndex,
    pack_id: uuid::Uuid,
    report: &mut RecoveryReport,
    source_keys: &mut HashSet<String>,
) -> io::Result<()> {
    let sealed = match seal_open_pack(paths, index, pack_id) {
        Ok(sealed) => sealed,
        // The disk, not the bytes (a full disk, EIO): the writer's sealer tries again once it runs, as after a seal
        // that failed during a run. The start goes on; the packs after it wait for it.
        Err(error) => {
            // Its records' source keys keep the inbox exactly-once (step 4). A pack that cannot even be read goes
            // to quarantine, as a sealed one does.
            let entries = match read_with_retries(|| index_left_open(paths, index, pack_id)) {
                Ok(entries) => entries,
                Err(read_error) => {
                    let path = paths.pack_path(pack_id, PackState::Open);
                    let reason = format!("unreadable open pack: {read_error} (its seal failed: {error})");
                    quarantine_pack(paths, &path, &reason)?;
                    index.forget(pack_id);
                    report.packs_quarantined += 1;
                    return Ok(());
                }
            };
            tracing::error!(%pack_id, "an open pack could not be sealed; it is tried again once the writer runs");
            collect_source_keys(&entries, source_keys);
            report.open_packs_left_open += 1;
            return Ok(());
        }
    };
    match sealed {
        OpenPackSealed::Sealed { entries, bytes_cut } => {
            collect_source_keys(&entries, source_keys);
            report.open_packs_sealed += 1;
            report.records_recovered += entries.len() as u64;
            report.bytes_cut += bytes_cut;
        }
        OpenPackSealed::Removed { bytes_cut } => {
            report.empty_packs_removed += 1;
            report.bytes_cut += bytes_cut;
        }
        OpenPackSealed::Quarantined => report.packs_quarantined += 1,
    }
    Ok(())
}

/// Tries a start gives a pack it cannot read for an I/O error (EMFILE, ENOMEM, EIO, not a regular file) before the
/// pack goes to quarantine, the wait doubling from [`READ_RETRY_FIRST`] (0.75 s in all): a passing shortage clears
/// without parking acknowledged captures, and a disk that keeps failing does not keep the daemon from starting (a
/// start that failed instead would be restarted every few seconds, with every other pack and all ingest stopped).
const READ_TRIES: u32 = 5;
const READ_RETRY_FIRST: Duration = Duration::from_millis(50);

/// `read`, tried again while it fails for an I/O error ([`READ_TRIES`]); bad bytes are answered at once.
fn read_with_retries<T>(mut read: impl FnMut() -> Result<T, PackError>) -> Result<T, PackError> {
    let mut wait = READ_RETRY_FIRST;
    for _ in 1..READ_TRIES {
        match read() {
            Err(error) if !error.is_data_error() => {
                tracing::warn!(%error, "a pack could not be read; trying again");
                std::thread::sleep(wait);
                wait *= 2;
            }
            answer => return answer,
        }
    }
    read()
}

fn collect_source_keys(entries: &[pack::IndexEntry], source_keys: &mut HashSet<String>) {
    source_keys.extend(entries.iter().filter_map(|entry| entry.meta.source_name.clone()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io_error() -> PackError {
        PackError::Io(io::Error::from_raw_os_error(24)) // EMFILE
    }

    #[test]
    fn a_read_is_tried_again_while_it_fails_for_an_i_o_error_and_not_for_bad_bytes() {
        let mut tries = 0;
        let answer = read_with_retries(|| {
            tries += 1;
            if tries < 3 {
                Err(io_error())
            } else {
                Ok(tries)
            }
        });
        assert_eq!(answer.unwrap(), 3, "a passing shortage clears");

        let mut tries = 0;
        let answer: Result<(), _> = read_with_retries(|| {
            tries += 1;
            Err(io_error())
        });
        assert!(matches!(answer, Err(PackError::Io(_))));
        assert_eq!(tries, READ_TRIES, "a disk that keeps failing is given up on");

        let mut tries = 0;
        let answer: Result<(), _> = read_with_retries(|| {
            tries += 1;
            Err(PackError::BadMagic { what: "header", offset: 0 })
        });
        assert!(answer.unwrap_err().is_data_error());
        assert_eq!(tries, 1, "bad bytes are answered at once");
    }
}
