//! The spool: the only buffer between producers and the bucket, and the reason an acknowledgement means something.
//!
//! On-disk layout (every state change is an atomic rename followed by an fsync of the directory):
//!
//! ```text
//! <spool>/LOCK                      flock held for the process lifetime; text "pid host started_at"
//! <spool>/SPOOL_ID                  UUID created once; the publisher identity is "<spool id>@<host>:<pid>"
//! <spool>/inbox/<stream>/<name>     producers drop files here (write as .name or name.tmp, then rename in)
//! <spool>/packs/<pack_id>.open      the pack being appended (owned by the writer thread; more exist while the
//!                                   sealer thread seals earlier ones)
//! <spool>/packs/<pack_id>.sealed    complete and fsynced, waiting for upload
//! <spool>/packs/<pack_id>.uploaded  in the bucket and verified, owed to the catalog (this is pending_index)
//! <spool>/quarantine/...            anything unreadable, moved aside with a `.reason` file, never deleted silently
//! ```
//!
//! Pack life: `.open` -(seal)-> `.sealed` -(upload, verify)-> `.uploaded` -(publish committed)-> deleted.
//! Invariants:
//! - a capture is acknowledged only after the fsync that covers its record (group commit, [`writer`]);
//! - a spool file is deleted only after the catalog shows it published (I5);
//! - recovery keeps every complete record of a torn `.open` file and quarantines what it cannot read (I6);
//! - pack ids are UUIDv7, so sorting names sorts packs oldest first.

pub mod inbox;
pub mod lock;
pub mod recovery;
pub mod writer;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Serialize;
use uuid::Uuid;

use crate::config::SpoolConfig;
use crate::durable;
pub use lock::{LockError, SpoolLock};
pub use recovery::RecoveryReport;

pub const SPOOL_ID_FILE: &str = "SPOOL_ID";

/// The directories of one spool. Cheap to clone; no ownership implied (offline tools use it without the lock).
#[derive(Debug, Clone)]
pub struct SpoolPaths {
    pub root: PathBuf,
    pub inbox: PathBuf,
    pub packs: PathBuf,
    pub quarantine: PathBuf,
}

impl SpoolPaths {
    pub fn new(root: &Path) -> SpoolPaths {
        SpoolPaths {
            root: root.to_path_buf(),
            inbox: root.join("inbox"),
            packs: root.join("packs"),
            quarantine: root.join("quarantine"),
        }
    }

    pub fn pack_path(&self, pack_id: Uuid, state: PackState) -> PathBuf {
        self.packs.join(format!("{pack_id}.{}", state.extension()))
    }

    fn create_dirs(&self) -> io::Result<()> {
        for dir in [&self.root, &self.inbox, &self.packs, &self.quarantine] {
            fs::create_dir_all(dir)?;
        }
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

fn parse_pack_file_name(path: &Path) -> Option<(Uuid, PackState)> {
    let name = path.file_name()?.to_str()?;
    let (stem, extension) = name.rsplit_once('.')?;
    Some((Uuid::parse_str(stem).ok()?, PackState::from_extension(extension)?))
}

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error(transparent)]
    Locked(#[from] LockError),
    #[error(
        "spool {dir} is on a {fs_name} filesystem, where flock cannot be trusted; use a local disk or set \
         spool.allow_shared_filesystem = true"
    )]
    SharedFilesystem { dir: PathBuf, fs_name: &'static str },
    #[error("spool {dir}: {source}")]
    Io { dir: PathBuf, source: io::Error },
    #[error("spool {path}: invalid spool id {text:?}")]
    BadSpoolId { path: PathBuf, text: String },
}

/// An owned spool: the lock is held for as long as this value lives.
#[derive(Debug)]
pub struct Spool {
    paths: SpoolPaths,
    spool_id: Uuid,
    _lock: SpoolLock,
}

impl Spool {
    /// Take ownership of the spool and bring it to a consistent state: directories, filesystem check, lock, spool id,
    /// then recovery of whatever a crashed predecessor left. Nothing else may touch the spool before this returns.
    pub fn open(config: &SpoolConfig) -> Result<(Spool, RecoveryReport), SpoolError> {
        let paths = SpoolPaths::new(&config.dir);
        let io_error = |source| SpoolError::Io { dir: config.dir.clone(), source };
        paths.create_dirs().map_err(io_error)?;
        if !config.allow_shared_filesystem {
            if let Some(fs_name) = durable::shared_filesystem_name(&paths.root).map_err(io_error)? {
                return Err(SpoolError::SharedFilesystem { dir: paths.root.clone(), fs_name });
            }
        }
        let lock = SpoolLock::acquire(&paths.root)?;
        let spool_id = read_or_create_spool_id(&paths.root)?;
        let report = recovery::recover(&paths).map_err(io_error)?;
        Ok((Spool { paths, spool_id, _lock: lock }, report))
    }

    pub fn paths(&self) -> &SpoolPaths {
        &self.paths
    }

    pub fn id(&self) -> Uuid {
        self.spool_id
    }
}

fn read_or_create_spool_id(root: &Path) -> Result<Uuid, SpoolError> {
    let path = root.join(SPOOL_ID_FILE);
    match fs::read_to_string(&path) {
        Ok(text) => Uuid::parse_str(text.trim()).map_err(|_| SpoolError::BadSpoolId { path, text }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let spool_id = Uuid::new_v4();
            durable::write_file_durable(&path, format!("{spool_id}\n").as_bytes())
                .map_err(|source| SpoolError::Io { dir: root.to_path_buf(), source })?;
            Ok(spool_id)
        }
        Err(source) => Err(SpoolError::Io { dir: root.to_path_buf(), source }),
    }
}

/// Read the spool id without owning the spool (offline tools); `None` if the spool was never opened.
pub fn peek_spool_id(root: &Path) -> Option<Uuid> {
    let text = fs::read_to_string(root.join(SPOOL_ID_FILE)).ok()?;
    Uuid::parse_str(text.trim()).ok()
}

/// Move a file into `quarantine/<subdir>/` with a `.reason` file beside it; never overwrites an earlier quarantined file.
pub fn quarantine_file(paths: &SpoolPaths, subdir: &str, file: &Path, reason: &str) -> io::Result<PathBuf> {
    let target_dir = paths.quarantine.join(subdir);
    fs::create_dir_all(&target_dir)?;
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "unnamed".into());
    // A time prefix keeps quarantined files unique and sorted by when they arrived.
    let target = target_dir.join(format!("{}-{name}", crate::util::now_ns()));
    durable::write_file_durable(&target.with_file_name(format!("{}.reason", file_name(&target))), reason.as_bytes())?;
    durable::rename_durable(file, &target)?;
    Ok(target)
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spool_config(dir: &Path) -> SpoolConfig {
        SpoolConfig { dir: dir.to_path_buf(), ..SpoolConfig::default() }
    }

    #[test]
    fn the_spool_id_is_created_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = Spool::open(&spool_config(dir.path())).unwrap().0.id();
        let second = Spool::open(&spool_config(dir.path())).unwrap().0.id();
        assert_eq!(first, second);
        assert_eq!(peek_spool_id(dir.path()), Some(first));
    }

    #[test]
    fn a_second_open_of_a_live_spool_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _owner = Spool::open(&spool_config(dir.path())).unwrap();
        let error = Spool::open(&spool_config(dir.path())).unwrap_err();
        assert!(matches!(error, SpoolError::Locked(LockError::Held { .. })), "{error}");
    }

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
        let moved = quarantine_file(&paths, "inbox", &file, "no stream").unwrap();
        assert!(!file.exists());
        assert_eq!(fs::read(&moved).unwrap(), b"payload");
        let reason = fs::read_to_string(moved.with_file_name(format!("{}.reason", file_name(&moved)))).unwrap();
        assert_eq!(reason, "no stream");
    }
}
