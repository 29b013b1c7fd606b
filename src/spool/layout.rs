//! The spool's directories and pack file states, and the only code that moves or removes a spool file.
//!
//! Every state change here is crash-safe (see [`crate::durable`]): a rename or an unlink followed by an fsync of the
//! directory, so after a crash a pack is wholly in its old state or wholly in its new one. The writer's sealer and
//! recovery call [`SpoolPaths::mark_sealed`]; the pipeline calls [`SpoolPaths::mark_uploaded`],
//! [`SpoolPaths::remove_published`] and [`SpoolPaths::quarantine`] (from blocking threads: each one fsyncs).
//!
//! ```text
//! <id>.open --mark_sealed--> <id>.sealed --mark_uploaded--> <id>.uploaded --remove_published--> (gone)
//!     \--remove_unsealed (no record)     any state, or an inbox file --quarantine--> quarantine/<subdir>/
//! ```

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Serialize;
use uuid::Uuid;

use crate::durable;

/// The directories of one spool. Cheap to clone; no ownership implied (offline tools use it without the lock).
#[derive(Debug, Clone)]
pub struct SpoolPaths {
    pub root: PathBuf,
    pub inbox: PathBuf,
    pub packs: PathBuf,
    pub quarantine: PathBuf,
    /// Compaction's staged jobs (see `crate::pipeline::compaction`).
    pub compaction: PathBuf,
}

impl SpoolPaths {
    pub fn new(root: &Path) -> SpoolPaths {
        SpoolPaths {
            root: root.to_path_buf(),
            inbox: root.join("inbox"),
            packs: root.join("packs"),
            quarantine: root.join("quarantine"),
            compaction: root.join("compaction"),
        }
    }

    pub fn pack_path(&self, pack_id: Uuid, state: PackState) -> PathBuf {
        self.packs.join(format!("{pack_id}.{}", state.extension()))
    }

    /// `.open` -> `.sealed`: the pack's footer and trailer are written and fsynced.
    pub fn mark_sealed(&self, pack_id: Uuid) -> io::Result<()> {
        durable::rename_durable(&self.pack_path(pack_id, PackState::Open), &self.pack_path(pack_id, PackState::Sealed))
    }

    /// `.sealed` -> `.uploaded`: the pack is in the bucket, verified, and owed to the catalog (pending_index).
    pub fn mark_uploaded(&self, pack_id: Uuid) -> io::Result<()> {
        let sealed = self.pack_path(pack_id, PackState::Sealed);
        durable::rename_durable(&sealed, &self.pack_path(pack_id, PackState::Uploaded))
    }

    /// Delete an `.uploaded` pack: the catalog shows it published (I5). Idempotent.
    pub fn remove_published(&self, pack_id: Uuid) -> io::Result<()> {
        durable::remove_durable(&self.pack_path(pack_id, PackState::Uploaded))
    }

    /// Delete an `.open` pack that holds no record (nothing in it was ever acknowledged). Idempotent.
    pub fn remove_unsealed(&self, pack_id: Uuid) -> io::Result<()> {
        durable::remove_durable(&self.pack_path(pack_id, PackState::Open))
    }

    /// Delete temporary files a crash left in `dir` (our own crash-safe writes name them `.<name>.<nonce>.tmp`).
    /// Returns how many were removed.
    pub(super) fn remove_leftover_temp_files(&self, dir: &Path) -> io::Result<u64> {
        let mut removed = 0;
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.ends_with(durable::TEMP_SUFFIX) && entry.file_type()?.is_file() {
                durable::remove_durable(&entry.path())?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Move the pack file `file` into `quarantine/<subdir>/` with a `.reason` file beside it; never overwrites an
    /// earlier quarantined file.
    pub fn quarantine(&self, subdir: &str, file: &Path, reason: &str) -> io::Result<PathBuf> {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "unnamed".into());
        let target = self.quarantine_slot(subdir, &name, reason)?;
        durable::rename_durable(file, &target)?;
        Ok(target)
    }

    /// How many packs `quarantine/packs/` holds: the entries beside which a `.reason` file says why they are there
    /// (a temporary file of a reason being written, or a note an operator left, is not a pack; none when the
    /// directory is missing).
    pub fn quarantined_packs(&self) -> io::Result<u64> {
        let entries = match std::fs::read_dir(self.quarantine.join("packs")) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(error) => return Err(error),
        };
        let mut names = std::collections::HashSet::new();
        for entry in entries {
            names.insert(entry?.file_name().to_string_lossy().into_owned());
        }
        let is_pack = |name: &&String| {
            !name.starts_with('.')
                && !name.ends_with(REASON_SUFFIX)
                && names.contains(&format!("{name}{REASON_SUFFIX}"))
        };
        Ok(names.iter().filter(is_pack).count() as u64)
    }

    /// A fresh place in `quarantine/<subdir>/` for a file called `name`, its `.reason` file already written: the
    /// caller moves the file there (inbox files are moved relative to the inbox's descriptor, see
    /// [`super::inbox`]).
    pub fn quarantine_slot(&self, subdir: &str, name: &str, reason: &str) -> io::Result<PathBuf> {
        let target_dir = self.quarantine.join(subdir);
        durable::create_dirs(&target_dir)?;
        // A time prefix keeps quarantined files unique and sorted by when they arrived.
        let target = target_dir.join(format!("{}-{name}", crate::util::now_ns()));
        durable::write_file_durable(&reason_path(&target), reason.as_bytes())?;
        Ok(target)
    }

    /// The spool's directories, where missing: 0750, the inbox 0770 (producers of the spool's group write there).
    pub(super) fn create_dirs(&self) -> io::Result<()> {
        for dir in [&self.root, &self.packs, &self.quarantine, &self.compaction] {
            durable::create_dirs(dir)?;
        }
        durable::create_dirs_with_mode(&self.inbox, durable::INBOX_DIR_MODE)?;
        durable::fsync_dir(&self.root)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PackState {
    Open,
    Sealed,
    Uploaded,
}

impl PackState {
    pub const ALL: [PackState; 3] = [PackState::Open, PackState::Sealed, PackState::Uploaded];

    pub fn extension(self) -> &'static str {
        match self {
            PackState::Open => "open",
            PackState::Sealed => "sealed",
            PackState::Uploaded => "uploaded",
        }
    }

    fn from_extension(extension: &str) -> Option<PackState> {
        PackState::ALL.into_iter().find(|state| state.extension() == extension)
    }
}

/// One pack file found in `packs/`.
#[derive(Debug, Clone, Serialize)]
pub struct PackListing {
    pub pack_id: Uuid,
    pub state: PackState,
    #[serde(skip)]
    pub path: PathBuf,
    pub bytes: u64,
    #[serde(skip)]
    pub modified: SystemTime,
}

/// Every pack file in `packs/`, oldest first (pack ids are time-ordered). Files that are not packs are skipped.
pub fn list_packs(paths: &SpoolPaths) -> io::Result<Vec<PackListing>> {
    let mut packs = Vec::new();
    for entry in fs::read_dir(&paths.packs)? {
        let entry = entry?;
        let path = entry.path();
        let Some((pack_id, state)) = parse_pack_file_name(&path) else {
            continue;
        };
        let metadata = match entry.metadata() {
            Ok(metadata) => metadata,
            // Deleted between listing and stat: another stage moved it on.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        packs.push(PackListing {
            pack_id,
            state,
            path,
            bytes: metadata.len(),
            modified: metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        });
    }
    packs.sort_by_key(|listing| (listing.pack_id, listing.state));
    Ok(packs)
}

/// The pack id a pack file's name carries.
pub fn pack_id_of_path(path: &Path) -> Option<Uuid> {
    parse_pack_file_name(path).map(|(pack_id, _)| pack_id)
}

fn parse_pack_file_name(path: &Path) -> Option<(Uuid, PackState)> {
    let name = path.file_name()?.to_str()?;
    let (stem, extension) = name.rsplit_once('.')?;
    Some((Uuid::parse_str(stem).ok()?, PackState::from_extension(extension)?))
}

/// `<quarantined file>.reason`.
pub fn reason_path(quarantined: &Path) -> PathBuf {
    let name = quarantined.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    quarantined.with_file_name(format!("{name}{REASON_SUFFIX}"))
}

/// The end of the name of a quarantined file's reason ([`reason_path`]).
const REASON_SUFFIX: &str = ".reason";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_file_names_parse_and_others_are_skipped() {
        let id = Uuid::now_v7();
        assert_eq!(parse_pack_file_name(Path::new(&format!("{id}.sealed"))), Some((id, PackState::Sealed)));
        assert_eq!(parse_pack_file_name(Path::new(&format!("{id}.bak"))), None);
        assert_eq!(parse_pack_file_name(Path::new("notes.sealed")), None);
    }

    #[test]
    fn quarantine_keeps_the_file_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let paths = SpoolPaths::new(dir.path());
        paths.create_dirs().unwrap();
        let file = paths.inbox.join("bad");
        fs::write(&file, b"payload").unwrap();
        let moved = paths.quarantine("inbox", &file, "no stream").unwrap();
        assert!(!file.exists());
        assert_eq!(fs::read(&moved).unwrap(), b"payload");
        let reason = fs::read_to_string(reason_path(&moved)).unwrap();
        assert_eq!(reason, "no stream");
    }

    #[test]
    fn quarantined_packs_are_counted_without_their_reasons_and_inbox_files() {
        let dir = tempfile::tempdir().unwrap();
        let paths = SpoolPaths::new(dir.path());
        paths.create_dirs().unwrap();
        assert_eq!(paths.quarantined_packs().unwrap(), 0, "no quarantine/packs yet");
        for name in ["a.sealed", "b.open", "inbox-file"] {
            let file = paths.root.join(name);
            fs::write(&file, b"bytes").unwrap();
            let subdir = if name == "inbox-file" { "inbox" } else { "packs" };
            paths.quarantine(subdir, &file, "damaged").unwrap();
        }
        // Neither a reason's temporary file (a crash while one was written) nor a note of an operator is a pack.
        let quarantined = paths.quarantine.join("packs");
        fs::write(quarantined.join(".1-c.sealed.reason.x.tmp"), b"half").unwrap();
        fs::write(quarantined.join("NOTES"), b"looked at a.sealed").unwrap();
        fs::create_dir(quarantined.join("handled")).unwrap();
        assert_eq!(paths.quarantined_packs().unwrap(), 2);
        // An operator takes one out, with its reason.
        let taken = fs::read_dir(&quarantined)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .find(|path| path.to_string_lossy().ends_with("-a.sealed"))
            .unwrap();
        let handled = quarantined.join("handled");
        durable::rename_durable(&reason_path(&taken), &handled.join("a.sealed.reason")).unwrap();
        durable::rename_durable(&taken, &handled.join("a.sealed")).unwrap();
        assert_eq!(paths.quarantined_packs().unwrap(), 1);
    }
}
