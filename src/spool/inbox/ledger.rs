//! The ledger of inbox files that were captured but could not be removed (a read-only or foreign-owned stream
//! directory, say): `<spool>/inbox-captured`, one source key per line.
//!
//! Exactly-once ingest normally rests on the unlink: a captured file leaves the inbox. When the unlink is refused, the
//! file stays, and without a record of it every rescan (and every restart, once its pack has left the spool) would
//! capture it again. So its source key (path, inode, size, mtime: a later file under the same name is a different
//! source) is appended here and fsynced before the capture's pack can leave the spool, ingest skips every key listed,
//! and one WARN names the file. At each start, entries whose file is gone (the operator removed it, or fixed the
//! permissions and the next unlink worked) are dropped by rewriting the file crash-safely.
//!
//! States of an entry: `listed` (the file is in the inbox and skipped) -> `pruned` (the file is gone; the entry is
//! dropped at the next start). The ledger only grows with files that cannot be removed, so it stays small.

use std::collections::HashSet;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::durable;

pub const LEDGER_FILE: &str = "inbox-captured";

#[derive(Debug)]
pub struct InboxLedger {
    path: PathBuf,
    keys: Mutex<HashSet<String>>,
}

impl InboxLedger {
    /// Loads the ledger of the spool at `root` (empty when there is none).
    pub fn load(root: &Path) -> io::Result<InboxLedger> {
        let path = root.join(LEDGER_FILE);
        let keys = match std::fs::read_to_string(&path) {
            Ok(text) => text.lines().filter(|line| !line.is_empty()).map(str::to_string).collect(),
            Err(error) if error.kind() == io::ErrorKind::NotFound => HashSet::new(),
            Err(error) => return Err(error),
        };
        Ok(InboxLedger { path, keys: Mutex::new(keys) })
    }

    pub fn contains(&self, source_key: &str) -> bool {
        self.lock().contains(source_key)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Records a captured file that stays in the inbox; durable when this returns. Returns false if it was listed.
    pub fn record(&self, source_key: &str) -> io::Result<bool> {
        debug_assert!(!source_key.contains('\n'), "source keys are one line");
        let mut keys = self.lock();
        if keys.contains(source_key) {
            return Ok(false);
        }
        let mut file = durable::new_file_options().create(true).append(true).open(&self.path)?;
        file.write_all(format!("{source_key}\n").as_bytes())?;
        file.sync_all()?;
        // The first append creates the file: its directory entry must be durable too.
        durable::fsync_parent_dir(&self.path)?;
        keys.insert(source_key.to_string());
        Ok(true)
    }

    /// Keeps only the entries `still_there` says are in the inbox, rewriting the file crash-safely if any went.
    pub fn prune(&self, still_there: impl Fn(&str) -> bool) -> io::Result<usize> {
        let mut keys = self.lock();
        let before = keys.len();
        keys.retain(|key| still_there(key));
        let dropped = before - keys.len();
        if dropped > 0 {
            let mut sorted: Vec<&String> = keys.iter().collect();
            sorted.sort();
            let text: String = sorted.iter().map(|key| format!("{key}\n")).collect();
            durable::write_file_durable(&self.path, text.as_bytes())?;
        }
        Ok(dropped)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.keys.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_keys_survive_a_reload_and_pruning_drops_gone_files() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = InboxLedger::load(dir.path()).unwrap();
        assert!(ledger.is_empty());
        assert!(ledger.record("s/a@1:2:3").unwrap());
        assert!(!ledger.record("s/a@1:2:3").unwrap(), "recorded once");
        assert!(ledger.record("s/b@4:5:6").unwrap());
        let reloaded = InboxLedger::load(dir.path()).unwrap();
        assert!(reloaded.contains("s/a@1:2:3") && reloaded.contains("s/b@4:5:6"));
        assert_eq!(reloaded.prune(|key| key.starts_with("s/b")).unwrap(), 1);
        let pruned = InboxLedger::load(dir.path()).unwrap();
        assert_eq!(pruned.len(), 1);
        assert!(pruned.contains("s/b@4:5:6") && !pruned.contains("s/a@1:2:3"));
    }
}
