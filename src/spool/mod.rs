//! The spool: the only buffer between producers and the bucket, and the reason an acknowledgement means something.
//!
//! On-disk layout (every state change is an atomic rename followed by an fsync of the directory):
//!
//! ```text
//! <spool>/LOCK                      flock held for the process lifetime; text "pid host started_at"
//! <spool>/SPOOL_ID                  UUID created once; the publisher identity is "<spool id>@<host>:<pid>"
//! <spool>/inbox/<stream>/<name>     producers drop files here (write as .name or name.tmp, then rename in)
//! <spool>/packs/<pack_id>.open      the pack being appended (owned by the writer thread; more exist while the
//!                                   sealer thread seals earlier ones, or tries again to seal one whose seal
//!                                   failed)
//! <spool>/packs/<pack_id>.sealed    complete and fsynced, waiting for upload
//! <spool>/packs/<pack_id>.uploaded  in the bucket and verified, owed to the catalog (this is pending_index)
//! <spool>/quarantine/...            anything unreadable, moved aside with a `.reason` file, never deleted silently
//! ```
//!
//! Pack life: `.open` -(seal)-> `.sealed` -(upload, verify)-> `.uploaded` -(publish committed)-> deleted.
//! Invariants:
//! - a capture is acknowledged only after the fsync that covers its record (group commit, [`writer`]);
//! - a spool file is deleted only after the catalog shows it published (I5);
//! - recovery keeps every complete record of a torn `.open` file and quarantines what it cannot read (I6), after a
//!   few tries for an I/O error;
//! - pack ids are UUIDv7 and a new pack's sorts after every pack the spool holds, even when the wall clock stepped
//!   back ([`writer`]), so sorting names sorts packs oldest first.
//!
//! Files: this one opens a spool ([`Spool::open`]: directories, lock, spool id, recovery); [`layout`] names the paths
//! and states and is the only code that renames or deletes a spool file; [`index`] knows which pack holds which
//! capture; [`writer`] is the group-commit writer;
//! [`recovery`] repairs what a crash left; [`unsealed`] seals a pack left `.open` (by a crash or a failed seal); [`inbox`] ingests producers' files and [`envelope`] is their format and
//! `capstore put`; [`lock`] is the owner lock.

pub mod envelope;
pub mod inbox;
pub mod index;
pub mod layout;
pub mod lock;
pub mod recovery;
pub mod unsealed;
pub mod writer;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use uuid::Uuid;

use std::sync::Arc;

use crate::config::SpoolConfig;
use crate::durable;
use inbox::beneath::InboxRoot;
use inbox::ledger::InboxLedger;
use index::SpoolIndex;
pub use layout::{list_packs, PackListing, PackState, SpoolPaths};
pub use lock::{LockError, SpoolLock};
pub use recovery::RecoveryReport;

pub const SPOOL_ID_FILE: &str = "SPOOL_ID";

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
    inbox: Arc<InboxRoot>,
    inbox_ledger: Arc<InboxLedger>,
    index: Arc<SpoolIndex>,
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
        let inbox_ledger = Arc::new(InboxLedger::load(&paths.root).map_err(io_error)?);
        let index = Arc::new(SpoolIndex::default());
        let report = recovery::recover(&paths, &inbox_ledger, &index).map_err(io_error)?;
        let inbox = Arc::new(InboxRoot::open(&paths.inbox).map_err(io_error)?);
        Ok((Spool { paths, spool_id, inbox, inbox_ledger, index, _lock: lock }, report))
    }

    /// Which local pack holds which capture (see [`index`]), filled by recovery; hand it to the writer.
    pub fn index(&self) -> Arc<SpoolIndex> {
        self.index.clone()
    }

    /// The inbox, opened as a directory descriptor (see [`inbox::beneath`]).
    pub fn inbox(&self) -> Arc<InboxRoot> {
        self.inbox.clone()
    }

    /// Inbox files captured but not removable (see [`inbox::ledger`]); ingest skips them.
    pub fn inbox_ledger(&self) -> Arc<InboxLedger> {
        self.inbox_ledger.clone()
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
}
