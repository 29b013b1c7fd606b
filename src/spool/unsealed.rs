//! Sealing a pack left `.open`: by a process that died (at the next start, [`super::recovery`]), or by a seal that
//! failed during the run, a full disk say (the writer's sealer tries again, after a wait that doubles from 1 s to
//! 30 s, [`super::writer`]). A start whose recovery cannot seal a pack for an I/O error leaves it to that sealer too.
//!
//! Either way the pack is brought to what a clean seal would have made: every complete record whose checksum
//! verifies is kept, a torn tail (a record or a footer cut short) is cut, footer and trailer are written, the pack is
//! renamed `.sealed` with a directory fsync, and the spool index learns it. A pack with no complete record is
//! removed; one whose header is unreadable but that holds more than a header's bytes goes to quarantine (it is not
//! ours to delete). An I/O error leaves the pack as it was, to be tried again.

use std::fs;
use std::io;
use std::path::Path;

use uuid::Uuid;

use super::index::SpoolIndex;
use super::{PackState, SpoolPaths};
use crate::pack::{self, IndexEntry, PackError, PackWriter};

/// What [`seal_open_pack`] made of a pack.
#[derive(Debug)]
pub enum OpenPackSealed {
    /// Sealed with these records; `bytes_cut` of torn tail were cut.
    Sealed { entries: Vec<IndexEntry>, bytes_cut: u64 },
    /// It held no complete record and is removed.
    Removed { bytes_cut: u64 },
    /// Unreadable: moved to quarantine.
    Quarantined,
}

/// Seals the `.open` pack `pack_id` (see the module's doc).
pub fn seal_open_pack(paths: &SpoolPaths, index: &SpoolIndex, pack_id: Uuid) -> io::Result<OpenPackSealed> {
    let path = paths.pack_path(pack_id, PackState::Open);
    match PackWriter::recover(&path) {
        Ok((writer, recovered)) if recovered.records_kept == 0 => {
            drop(writer);
            paths.remove_unsealed(pack_id)?;
            index.forget(pack_id);
            tracing::info!(pack = %path.display(), bytes_cut = recovered.bytes_cut, "removed open pack with no complete record");
            Ok(OpenPackSealed::Removed { bytes_cut: recovered.bytes_cut })
        }
        Ok((writer, recovered)) => {
            debug_assert_eq!(writer.pack_id(), pack_id, "a pack's file is named by its header's pack_id");
            let summary = writer.finish().map_err(|error| io::Error::other(error.to_string()))?;
            paths.mark_sealed(pack_id)?;
            index.add_sealed(pack_id, &recovered.entries);
            tracing::info!(
                pack_id = %pack_id,
                records = summary.records,
                bytes_cut = recovered.bytes_cut,
                "sealed a pack left open"
            );
            Ok(OpenPackSealed::Sealed { entries: recovered.entries, bytes_cut: recovered.bytes_cut })
        }
        // The disk, not the bytes (EIO, EMFILE, ...): left as it is, to be tried again (by the sealer; at a start, a
        // pack that cannot even be read goes to quarantine after a few tries, see `super::recovery`). Quarantine
        // would keep acknowledged captures from being published until an operator acts.
        Err(error) if !error.is_data_error() => Err(io::Error::other(error.to_string())),
        Err(error) => {
            let length = fs::metadata(&path)?.len();
            if length <= pack::HEADER_LEN as u64 {
                // Torn while its header was being written: it never held a record.
                paths.remove_unsealed(pack_id)?;
                index.forget(pack_id);
                Ok(OpenPackSealed::Removed { bytes_cut: length })
            } else {
                quarantine_pack(paths, &path, &format!("unrecoverable open pack: {error}"))?;
                index.forget(pack_id);
                Ok(OpenPackSealed::Quarantined)
            }
        }
    }
}

/// What became of a pack left `.open` during a run, once [`seal_left_open`] got through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftOpenOutcome {
    /// Sealed, with every complete record it held.
    Sealed,
    /// It held no complete record and is gone, or it was unreadable and is in quarantine.
    Gone,
}

/// Seals a pack the writer left `.open` during a run ([`seal_open_pack`]). A pack whose rename to `.sealed` went
/// through before its directory fsync failed only has the fsync done again; one that is gone altogether (removed by
/// hand) is forgotten.
pub fn seal_left_open(paths: &SpoolPaths, index: &SpoolIndex, pack_id: Uuid) -> io::Result<LeftOpenOutcome> {
    if !paths.pack_path(pack_id, PackState::Open).exists() {
        if paths.pack_path(pack_id, PackState::Sealed).exists() {
            crate::durable::fsync_dir(&paths.packs)?;
            index.mark_sealed(pack_id);
            return Ok(LeftOpenOutcome::Sealed);
        }
        index.forget(pack_id);
        return Ok(LeftOpenOutcome::Gone);
    }
    match seal_open_pack(paths, index, pack_id)? {
        OpenPackSealed::Sealed { .. } => Ok(LeftOpenOutcome::Sealed),
        OpenPackSealed::Removed { .. } | OpenPackSealed::Quarantined => Ok(LeftOpenOutcome::Gone),
    }
}

/// Indexes a pack left `.open` as left open ([`SpoolIndex::mark_left_open`]: packs after it wait for it), with the
/// records a read-only scan finds in it (which a full disk allows): records a failed write cut short, whose appends
/// were refused, must not be found at their places. Returns those records, or the scan's error (the pack is then
/// indexed with none, and still waited for).
pub fn index_left_open(paths: &SpoolPaths, index: &SpoolIndex, pack_id: Uuid) -> Result<Vec<IndexEntry>, PackError> {
    index_left_open_within(paths, index, pack_id, u64::MAX)
}

/// [`index_left_open`] with only the records that end within `durable_len` bytes (a pack whose fsync failed, and
/// whose cut to what the fsyncs before made durable has not gone through yet).
pub fn index_left_open_within(
    paths: &SpoolPaths,
    index: &SpoolIndex,
    pack_id: Uuid,
    durable_len: u64,
) -> Result<Vec<IndexEntry>, PackError> {
    let scanned = pack::scan_file(&paths.pack_path(pack_id, PackState::Open)).map(|scan| {
        let mut entries = scan.entries;
        entries.retain(|entry| entry.record_range().end <= durable_len);
        entries
    });
    index.replace_open(pack_id, scanned.as_deref().unwrap_or_default());
    index.mark_left_open(pack_id);
    scanned
}

/// Moves a pack the spool cannot read to quarantine, with the reason beside it.
pub fn quarantine_pack(paths: &SpoolPaths, path: &Path, reason: &str) -> io::Result<()> {
    let moved = paths.quarantine("packs", path, reason)?;
    tracing::error!(pack = %path.display(), quarantined_as = %moved.display(), reason, "pack quarantined");
    Ok(())
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
    fn left_open(paths: &SpoolPaths, index: &SpoolIndex, records: usize) -> Uuid {
        let pack_id = Uuid::now_v7();
        let path = paths.pack_path(pack_id, PackState::Open);
        let mut writer = PackWriter::create(&path, pack_id, 1).unwrap();
        for at in 0..records {
            let meta = CaptureMeta {
                capture_id: Uuid::now_v7(),
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
        let pack = crate::pack::PackFile::open(&paths.pack_path(pack_id, PackState::Sealed)).unwrap();
        assert_eq!(pack.entries().len(), 3);
        assert!(!paths.pack_path(pack_id, PackState::Open).exists());
        assert_eq!(index.oldest_left_open(), None);
        assert!(index.holds_pack(pack_id));
    }

    #[test]
    fn a_pack_left_open_is_indexed_again_from_the_records_on_disk() {
        let (_dir, paths) = spool();
        let index = SpoolIndex::default();
        let pack_id = left_open(&paths, &index, 2);
        // A record the failed write cut short: indexed when appended, not on disk.
        let mut refused = pack::scan_file(&paths.pack_path(pack_id, PackState::Open)).unwrap().entries[0].clone();
        refused.meta.capture_id = Uuid::now_v7();
        refused.record_offset += 1 << 20;
        index.add_open(pack_id, &refused);
        assert_eq!(index.candidates(refused.meta.capture_id).len(), 1);
        index_left_open(&paths, &index, pack_id).unwrap();
        assert!(index.candidates(refused.meta.capture_id).is_empty());
        assert_eq!(index.len(), 2);
        assert_eq!(index.oldest_left_open(), Some(pack_id));
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
        assert_eq!(
            crate::pack::PackFile::open(&paths.pack_path(pack_id, PackState::Sealed)).unwrap().entries().len(),
            2
        );
        assert_eq!(index.oldest_left_open(), None);
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
        assert_eq!(index.oldest_left_open(), None);
    }
}
