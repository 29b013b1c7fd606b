//! Start-time recovery: bring a spool left by a crashed (or cleanly stopped) process to a consistent state.
//!
//! Runs once, under the spool lock, before anything else touches the spool. Every step is idempotent, so a crash
//! during recovery is recovered by the next start.
//!
//! 1. Leftover temporary files of our own crash-safe writes are removed.
//! 2. Each `.open` pack is scanned: every complete record whose checksum verifies is kept, the torn tail is cut, footer
//!    and trailer are written and the pack is renamed `.sealed`. A pack with no valid record is removed; a pack whose
//!    header is unreadable but holds more than a header's worth of bytes is quarantined (it is not ours to delete).
//! 3. Each `.sealed` and `.uploaded` pack has its trailer and footer checked; a pack that fails goes to quarantine.
//! 4. Inbox exactly-once: an inbox file whose source key is already recorded in a pack was captured before the crash
//!    (its unlink was lost), so it is removed instead of being ingested twice; one that cannot be removed is recorded
//!    in the inbox ledger instead, and ledger entries of files now gone are dropped. A file or directory of the inbox
//!    that cannot be read never fails the start.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::Path;

use serde::Serialize;

use super::inbox::ledger::InboxLedger;
use super::index::SpoolIndex;
use super::{inbox, list_packs, PackState, SpoolPaths};
use crate::pack::{self, PackFile, PackWriter};

#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct RecoveryReport {
    pub open_packs_sealed: u64,
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
            PackState::Open => {
                recover_open_pack(paths, index, listing.pack_id, &listing.path, &mut report, &mut source_keys)?
            }
            PackState::Sealed | PackState::Uploaded => match PackFile::open(&listing.path) {
                Ok(pack_file) => {
                    collect_source_keys(pack_file.entries(), &mut source_keys);
                    index.add_sealed(listing.pack_id, pack_file.entries());
                }
                Err(error) => {
                    let reason = format!("unreadable {} pack: {error}", listing.state.extension());
                    quarantine_pack(paths, &listing.path, &reason, &mut report)?;
                }
            },
        }
    }
    report.inbox_duplicates_removed = inbox::remove_already_captured(paths, inbox_ledger, &source_keys)?;
    if !report.is_clean() {
        tracing::info!(
            open_packs_sealed = report.open_packs_sealed,
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

/// What became of a pack left `.open` during a run, once [`seal_left_open`] got through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftOpenOutcome {
    /// Sealed, with every complete record it held.
    Sealed,
    /// It held no complete record and is gone, or it was unreadable and is in quarantine.
    Gone,
}

/// Seals a pack the writer left `.open` during a run (its seal failed, or its recovery after a write error did), the
/// way a start's recovery would (step 2 above), and tells the index. An error (the disk still full, say) leaves it
/// as it was, to be tried again. A pack whose rename to `.sealed` went through before its directory fsync failed only
/// has the fsync done again.
pub fn seal_left_open(paths: &SpoolPaths, index: &SpoolIndex, pack_id: uuid::Uuid) -> io::Result<LeftOpenOutcome> {
    let path = paths.pack_path(pack_id, PackState::Open);
    if !path.exists() && paths.pack_path(pack_id, PackState::Sealed).exists() {
        crate::durable::fsync_dir(&paths.packs)?;
        index.mark_sealed(pack_id);
        return Ok(LeftOpenOutcome::Sealed);
    }
    if !path.exists() {
        // Neither `.open` nor `.sealed`: not ours any more (removed by hand); nothing to seal.
        index.forget(pack_id);
        return Ok(LeftOpenOutcome::Gone);
    }
    let mut report = RecoveryReport::default();
    recover_open_pack(paths, index, pack_id, &path, &mut report, &mut HashSet::new())?;
    if report.open_packs_sealed == 1 {
        return Ok(LeftOpenOutcome::Sealed);
    }
    index.forget(pack_id);
    Ok(LeftOpenOutcome::Gone)
}

fn recover_open_pack(
    paths: &SpoolPaths,
    index: &SpoolIndex,
    pack_id: uuid::Uuid,
    path: &Path,
    report: &mut RecoveryReport,
    source_keys: &mut HashSet<String>,
) -> io::Result<()> {
    match PackWriter::recover(path) {
        Ok((writer, recovered)) if recovered.records_kept == 0 => {
            drop(writer);
            paths.remove_unsealed(pack_id)?;
            report.empty_packs_removed += 1;
            report.bytes_cut += recovered.bytes_cut;
            tracing::info!(pack = %path.display(), bytes_cut = recovered.bytes_cut, "removed open pack with no complete record");
        }
        Ok((writer, recovered)) => {
            debug_assert_eq!(writer.pack_id(), pack_id, "a pack's file is named by its header's pack_id");
            let summary = writer.finish().map_err(pack_io_error)?;
            paths.mark_sealed(pack_id)?;
            collect_source_keys(&recovered.entries, source_keys);
            index.add_sealed(pack_id, &recovered.entries);
            report.open_packs_sealed += 1;
            report.records_recovered += recovered.records_kept;
            report.bytes_cut += recovered.bytes_cut;
            tracing::info!(
                pack_id = %pack_id,
                records = summary.records,
                bytes_cut = recovered.bytes_cut,
                "sealed open pack left by previous process"
            );
        }
        Err(error) => {
            let length = fs::metadata(path)?.len();
            if length <= pack::HEADER_LEN as u64 {
                // Torn while its header was being written: it never held a record.
                paths.remove_unsealed(pack_id)?;
                report.empty_packs_removed += 1;
                report.bytes_cut += length;
            } else {
                quarantine_pack(paths, path, &format!("unrecoverable open pack: {error}"), report)?;
            }
        }
    }
    Ok(())
}

fn quarantine_pack(paths: &SpoolPaths, path: &Path, reason: &str, report: &mut RecoveryReport) -> io::Result<()> {
    let moved = paths.quarantine("packs", path, reason)?;
    report.packs_quarantined += 1;
    tracing::error!(pack = %path.display(), quarantined_as = %moved.display(), reason, "pack quarantined");
    Ok(())
}

fn collect_source_keys(entries: &[pack::IndexEntry], source_keys: &mut HashSet<String>) {
    source_keys.extend(entries.iter().filter_map(|entry| entry.meta.source_name.clone()));
}

fn pack_io_error(error: pack::PackError) -> io::Error {
    io::Error::other(error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::CaptureMeta;

    fn spool() -> (tempfile::TempDir, SpoolPaths) {
        let dir = tempfile::tempdir().unwrap();
        let paths = SpoolPaths::new(dir.path());
        paths.create_dirs().unwrap();
        (dir, paths)
    }

    /// An `.open` pack of `records` captures, as a writer whose seal failed leaves it (a torn footer included).
    fn left_open(paths: &SpoolPaths, index: &SpoolIndex, records: usize) -> uuid::Uuid {
        let pack_id = uuid::Uuid::now_v7();
        let path = paths.pack_path(pack_id, PackState::Open);
        let mut writer = PackWriter::create(&path, pack_id, 1).unwrap();
        for at in 0..records {
            let meta = CaptureMeta {
                capture_id: uuid::Uuid::now_v7(),
                stream: "s".into(),
                captured_at_ns: at as u64,
                labels: Default::default(),
                content_type: None,
                source_name: None,
            };
            let entry = writer.append(&meta, bytes::Bytes::from(vec![at as u8; 100])).unwrap();
            index.add_open(pack_id, &entry);
        }
        writer.flush().unwrap().sync().unwrap();
        drop(writer);
        let mut file = fs::OpenOptions::new().append(true).open(&path).unwrap();
        std::io::Write::write_all(&mut file, b"torn footer").unwrap();
        pack_id
    }

    #[test]
    fn a_pack_left_open_is_sealed_whole_as_a_start_would_seal_it() {
        let (_dir, paths) = spool();
        let index = SpoolIndex::default();
        let pack_id = left_open(&paths, &index, 3);
        assert_eq!(seal_left_open(&paths, &index, pack_id).unwrap(), LeftOpenOutcome::Sealed);
        let pack = PackFile::open(&paths.pack_path(pack_id, PackState::Sealed)).unwrap();
        assert_eq!(pack.entries().len(), 3);
        assert!(!paths.pack_path(pack_id, PackState::Open).exists());
        assert_eq!(index.oldest_unsealed(), None);
        assert!(index.holds_pack(pack_id));
    }

    #[test]
    fn a_pack_renamed_before_its_directory_fsync_failed_is_only_marked_sealed() {
        let (_dir, paths) = spool();
        let index = SpoolIndex::default();
        let pack_id = left_open(&paths, &index, 2);
        let (writer, _) = PackWriter::recover(&paths.pack_path(pack_id, PackState::Open)).unwrap();
        writer.finish().unwrap();
        #[allow(
            clippy::disallowed_methods,
            reason = "the rename without its directory fsync is what this test is about"
        )]
        fs::rename(paths.pack_path(pack_id, PackState::Open), paths.pack_path(pack_id, PackState::Sealed)).unwrap();
        assert_eq!(seal_left_open(&paths, &index, pack_id).unwrap(), LeftOpenOutcome::Sealed);
        assert_eq!(PackFile::open(&paths.pack_path(pack_id, PackState::Sealed)).unwrap().entries().len(), 2);
        assert_eq!(index.oldest_unsealed(), None);
    }

    #[test]
    fn a_pack_left_open_without_a_record_or_removed_is_forgotten() {
        let (_dir, paths) = spool();
        let index = SpoolIndex::default();
        let empty = left_open(&paths, &index, 0);
        assert_eq!(seal_left_open(&paths, &index, empty).unwrap(), LeftOpenOutcome::Gone);
        assert!(!paths.pack_path(empty, PackState::Open).exists());
        let removed = left_open(&paths, &index, 1);
        fs::remove_file(paths.pack_path(removed, PackState::Open)).unwrap();
        assert_eq!(seal_left_open(&paths, &index, removed).unwrap(), LeftOpenOutcome::Gone);
        assert!(!index.holds_pack(removed));
        assert_eq!(index.oldest_unsealed(), None);
    }
}
