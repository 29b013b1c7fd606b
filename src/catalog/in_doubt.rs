//! The publish attempts whose rows may still land: kept so that the next attempt at their version sends them as the
//! same attempt, and kept in the spool so that a process started after a crash does too.
//!
//! Why: merges keep one row of `captures` per capture (of `packs` per pack): the highest version, and of rows of one
//! version the last one written. ClickHouse completes an insert it has received whatever became of its client, so the
//! rows of an attempt whose insert did not answer, or whose process died while it was sent, may land at any later
//! time. Had the next attempt at that version (the same: nothing was committed there) written its rows under another
//! publish_id, a merge after such a late landing could keep the orphan row over the committed one, and the capture
//! (the pack) would drop out of listings (the replay guard and the inventory). So the next attempt at that version
//! whose rows include every row of one of these is sent as that attempt: same publish_id, same rows (a row follows
//! from its pack's index, its version and its publish_id alone), which a late copy only repeats.
//!
//! States of an attempt here ([`AttemptsInDoubt`]):
//!
//! ```text
//!  (new) --attempt: recorded, the file written, before any row is sent--> sent
//!  sent --its first send's insert failed without running (DefinitelyFailed)--> (gone)
//!  sent --a later attempt at its version includes its rows--> sent, as that attempt, with the later attempt's rows
//!  sent --a later attempt at its version shares a capture or a pack without including all its rows--> the version
//!        is committed empty (the publisher's barrier), which clears every record; the later attempt takes the next
//!  every attempt --a commit (of any version: versions only go up, so its rows are committed or orphans for good)--> (gone)
//! ```
//!
//! An attempt whose insert answered stays too: its rows landed, and sending them again under the same publish_id is
//! harmless, while telling "answered" from "in flight" would cost a third write of the file per publish.
//!
//! Invariants: an attempt's record is in the file before its first row is sent, so a process killed at any instant
//! leaves every attempt whose rows may land recorded; the file holds exactly the list in memory after each step; an
//! attempt repeated with more rows has them all recorded, so an attempt after it repeats them all or takes a new
//! publish_id (else its commit would make the extra rows visible without their packs, if those did not land).
//!
//! The file is replaced by a rename but not fsynced: it matters to a process started after this one died (a crash, a
//! SIGKILL, the OOM killer), whose page cache is the same. After a power loss the host needs a boot before anything is
//! published again, by which time an insert it sent has long landed or failed. A file that cannot be read is ignored
//! with a warning; one that cannot be written leaves the attempts in memory only, with a warning.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use bytes::{Buf, BufMut};
use uuid::Uuid;

/// A row of a publish, by what it is about: `(pack_id, capture_id)` of a capture's row, `(pack_id, nil)` of a pack's.
pub type RowKey = (Uuid, Uuid);

/// What the file starts with; the number is its format's.
const MAGIC: &[u8] = b"capstore rows in doubt 1\n";

/// One attempt at a version whose rows may land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowsInDoubt {
    pub version: u64,
    pub publish_id: Uuid,
    pub rows: HashSet<RowKey>,
}

/// What [`AttemptsInDoubt::attempt`] decided for an attempt about to be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    pub publish_id: Uuid,
    /// Whether it repeats an attempt recorded earlier (by this process or one before it).
    repeat: bool,
}

/// The attempts in doubt of one publisher, optionally mirrored in a file (see the module doc).
pub struct AttemptsInDoubt {
    attempts: Mutex<Vec<RowsInDoubt>>,
    file: Option<PathBuf>,
    /// Whether the last write of the file failed (a full or failing spool disk): warned once, not at every publish.
    write_failing: AtomicBool,
}

impl AttemptsInDoubt {
    /// Kept in memory only (tools that hold no spool).
    pub fn in_memory() -> AttemptsInDoubt {
        AttemptsInDoubt { attempts: Mutex::new(Vec::new()), file: None, write_failing: AtomicBool::new(false) }
    }

    /// Kept in `file` too, starting from what it holds (what a process before this one left there).
    pub fn kept_in(file: PathBuf) -> AttemptsInDoubt {
        let attempts = match std::fs::read(&file) {
            Ok(bytes) => match decode(&bytes) {
                Ok(attempts) => {
                    if !attempts.is_empty() {
                        let versions: Vec<u64> = attempts.iter().map(|attempt| attempt.version).collect();
                        tracing::info!(?versions, "publish attempts of an earlier process may still land");
                    }
                    attempts
                }
                Err(error) => {
                    tracing::warn!(file = %file.display(), %error, "ignoring a damaged record of publish attempts in doubt");
                    Vec::new()
                }
            },
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(error) => {
                tracing::warn!(file = %file.display(), %error, "cannot read the record of publish attempts in doubt");
                Vec::new()
            }
        };
        AttemptsInDoubt { attempts: Mutex::new(attempts), file: Some(file), write_failing: AtomicBool::new(false) }
    }

    /// The attempt at `version` writing `rows`, recorded (in the file too) before the caller sends any row: under the
    /// publish_id of the attempt in doubt whose rows these include, or a new one. `None` when these share a capture
    /// or a pack with an attempt in doubt (or two) without including all its rows: they can be sent as no attempt at
    /// this version, since a late landing of the other's rows could win a merge over them (the caller commits the
    /// version empty first, see [`super::publish`]).
    pub async fn attempt(&self, version: u64, rows: &HashSet<RowKey>) -> Option<Attempt> {
        let (attempt, bytes) = {
            let mut attempts = self.lock();
            let publish_id = match attempt_to_repeat(&mut attempts, version, rows) {
                Ok(Some(publish_id)) => {
                    tracing::info!(version, %publish_id, "sending again the attempt whose rows are in doubt");
                    publish_id
                }
                Ok(None) => Uuid::now_v7(),
                Err(shared) => {
                    tracing::warn!(
                        version,
                        attempts = shared,
                        "rows of earlier attempts at this version are in doubt and this attempt does not repeat them \
                         all: the version is committed empty, and this attempt goes to the next one"
                    );
                    return None;
                }
            };
            let repeat = attempts.iter().any(|attempt| attempt.publish_id == publish_id);
            // An attempt of no rows (a compaction's switch that only retires packs) has nothing that could land.
            if !repeat && !rows.is_empty() {
                attempts.push(RowsInDoubt { version, publish_id, rows: rows.clone() });
            }
            (Attempt { publish_id, repeat }, self.contents(&attempts))
        };
        self.write(bytes).await;
        Some(attempt)
    }

    /// The insert of `attempt` failed without running: its rows cannot land, unless an earlier send of its
    /// publish_id's may (a repeat keeps them all in doubt).
    pub async fn ruled_out(&self, attempt: &Attempt) {
        if attempt.repeat {
            return;
        }
        let bytes = {
            let mut attempts = self.lock();
            attempts.retain(|recorded| recorded.publish_id != attempt.publish_id);
            self.contents(&attempts)
        };
        self.write(bytes).await;
    }

    /// A publish committed: every attempt recorded is of its version or below, committed or an orphan for good.
    pub async fn committed(&self) {
        let had = {
            let mut attempts = self.lock();
            let had = !attempts.is_empty();
            attempts.clear();
            had
        };
        if had {
            self.write(self.contents(&[])).await;
        }
    }

    /// The attempts recorded now (for tests and the log).
    pub fn recorded(&self) -> Vec<RowsInDoubt> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RowsInDoubt>> {
        self.attempts.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// What the file is to hold with `attempts`: `None` without a file; no bytes (no file) without attempts.
    fn contents(&self, attempts: &[RowsInDoubt]) -> Option<Vec<u8>> {
        self.file.as_ref()?;
        Some(if attempts.is_empty() { Vec::new() } else { encode(attempts) })
    }

    /// Replace the file with `contents` (see [`AttemptsInDoubt::contents`]).
    async fn write(&self, contents: Option<Vec<u8>>) {
        let (Some(file), Some(bytes)) = (self.file.clone(), contents) else { return };
        let written = tokio::task::spawn_blocking(move || replace_file(&file, &bytes)).await;
        match written.unwrap_or_else(|joined| Err(std::io::Error::other(joined))) {
            Ok(()) => {
                if self.write_failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("the publish attempts in doubt are recorded in the spool again");
                }
            }
            Err(error) => {
                if !self.write_failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        %error,
                        "cannot record the publish attempts in doubt in the spool (warned once until it can): a \
                         process started after this one dies would not know them"
                    );
                }
            }
        }
    }
}

/// Which attempt in doubt an attempt at `version` writing `rows` is to repeat: none (`Ok(None)`) when it shares no
/// capture and no pack with one, the one it shares with and includes every row of, or, as `Err`, how many it shares
/// with without including all of one's. The one repeated has every row of the repeat from then on.
///
/// Shared is by what a merge replaces, not by row: a capture's rows in two packs (a post repeated into another pack)
/// are rows of one capture, which `captures` keeps one of.
fn attempt_to_repeat(
    attempts: &mut [RowsInDoubt],
    version: u64,
    rows: &HashSet<RowKey>,
) -> Result<Option<Uuid>, usize> {
    // Made only when an attempt at this version is recorded: a publish's steady path has none.
    let subjects = std::cell::OnceCell::new();
    let shared: Vec<usize> = (0..attempts.len())
        .filter(|at| {
            let attempt = &attempts[*at];
            attempt.version == version
                && (!attempt.rows.is_disjoint(rows)
                    || !merged_subjects(&attempt.rows).is_disjoint(subjects.get_or_init(|| merged_subjects(rows))))
        })
        .collect();
    match shared.as_slice() {
        [] => Ok(None),
        [at] if attempts[*at].rows.is_subset(rows) => {
            attempts[*at].rows = rows.clone();
            Ok(Some(attempts[*at].publish_id))
        }
        _ => Err(shared.len()),
    }
}

/// What the rows are about, as merges of `captures` and `packs` replace rows: the capture of a capture's row, the pack
/// of a pack's (a pack id and a capture id never coincide: both are UUIDv7s made apart).
fn merged_subjects(rows: &HashSet<RowKey>) -> HashSet<Uuid> {
    rows.iter().map(|(pack_id, capture_id)| if capture_id.is_nil() { *pack_id } else { *capture_id }).collect()
}

/// Replace `file` with `bytes` through a rename; no bytes remove it.
fn replace_file(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if bytes.is_empty() {
        return match std::fs::remove_file(file) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(error),
            _ => Ok(()),
        };
    }
    let temp = crate::durable::temp_path_for(file);
    let written = crate::durable::new_file_options()
        .write(true)
        .create_new(true)
        .open(&temp)
        .and_then(|mut opened| std::io::Write::write_all(&mut opened, bytes));
    #[allow(clippy::disallowed_methods, reason = "not fsynced on purpose: see the module doc")]
    let replaced = written.and_then(|()| std::fs::rename(&temp, file));
    if replaced.is_err() {
        // Not left for the next start's recovery: on a full disk its bytes are what is short.
        let _ = std::fs::remove_file(&temp);
    }
    replaced
}

/// The file's bytes: [`MAGIC`], the number of attempts (u32), each attempt's version (u64), publish_id (16 bytes),
/// number of rows (u64) and rows (pack_id, capture_id: 32 bytes), then the CRC-32C of all that (u32); little-endian.
fn encode(attempts: &[RowsInDoubt]) -> Vec<u8> {
    let rows: usize = attempts.iter().map(|attempt| attempt.rows.len()).sum();
    let mut bytes = Vec::with_capacity(MAGIC.len() + 8 + attempts.len() * 32 + rows * 32);
    bytes.put_slice(MAGIC);
    bytes.put_u32_le(attempts.len() as u32);
    for attempt in attempts {
        bytes.put_u64_le(attempt.version);
        bytes.put_slice(attempt.publish_id.as_bytes());
        bytes.put_u64_le(attempt.rows.len() as u64);
        for (pack_id, capture_id) in &attempt.rows {
            bytes.put_slice(pack_id.as_bytes());
            bytes.put_slice(capture_id.as_bytes());
        }
    }
    let crc = crc32c::crc32c(&bytes);
    bytes.put_u32_le(crc);
    bytes
}

fn decode(bytes: &[u8]) -> Result<Vec<RowsInDoubt>, String> {
    let body_len = bytes.len().checked_sub(4).ok_or("shorter than its checksum")?;
    let (body, mut crc) = bytes.split_at(body_len);
    if crc32c::crc32c(body) != crc.get_u32_le() {
        return Err("checksum mismatch (a torn write?)".into());
    }
    let mut body = body.strip_prefix(MAGIC).ok_or("not a record of publish attempts (or of another format)")?;
    let truncated = || "truncated".to_string();
    let count = body.try_get_u32_le().map_err(|_| truncated())?;
    let mut attempts = Vec::new();
    for _ in 0..count {
        let version = body.try_get_u64_le().map_err(|_| truncated())?;
        let publish_id = take_uuid(&mut body).ok_or_else(truncated)?;
        let rows = body.try_get_u64_le().map_err(|_| truncated())?;
        if rows > (body.len() / 32) as u64 {
            return Err(truncated());
        }
        let rows = (0..rows)
            .map(|_| Some((take_uuid(&mut body)?, take_uuid(&mut body)?)))
            .collect::<Option<HashSet<RowKey>>>()
            .ok_or_else(truncated)?;
        attempts.push(RowsInDoubt { version, publish_id, rows });
    }
    if !body.is_empty() {
        return Err(format!("{} bytes after the last attempt", body.len()));
    }
    Ok(attempts)
}

fn take_uuid(bytes: &mut &[u8]) -> Option<Uuid> {
    let (head, rest) = bytes.split_first_chunk::<16>()?;
    *bytes = rest;
    Some(Uuid::from_bytes(*head))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pack: u128, capture: u128) -> RowKey {
        (Uuid::from_u128(pack), Uuid::from_u128(capture))
    }

    fn rows(keys: &[(u128, u128)]) -> HashSet<RowKey> {
        keys.iter().map(|(pack, capture)| key(*pack, *capture)).collect()
    }

    #[test]
    fn an_attempt_repeats_the_one_in_doubt_whose_rows_it_includes() {
        let (batch, switch) = (Uuid::from_u128(100), Uuid::from_u128(200));
        let mut attempts = vec![
            RowsInDoubt { version: 7, publish_id: batch, rows: rows(&[(1, 0), (1, 11), (1, 12)]) },
            RowsInDoubt { version: 7, publish_id: switch, rows: rows(&[(9, 0), (9, 91)]) },
        ];
        // The same batch, or it with a pack more: the same attempt. The switch's own rows: the switch's.
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(1, 0), (1, 11), (1, 12)])), Ok(Some(batch)));
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(1, 0), (1, 11), (1, 12), (2, 0)])), Ok(Some(batch)));
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(9, 0), (9, 91)])), Ok(Some(switch)));
        // Nothing shared, or another version: a new attempt.
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(3, 0), (3, 31)])), Ok(None));
        assert_eq!(attempt_to_repeat(&mut attempts, 8, &rows(&[(1, 0), (1, 11), (1, 12)])), Ok(None));
        // The batch repeated with a pack more has that pack's rows in doubt too: the batch alone no longer
        // repeats it.
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(1, 0), (1, 11), (1, 12)])), Err(1));
        // Part of one, or rows of both: it cannot repeat either.
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(1, 0), (1, 11)])), Err(1));
        // A capture of one posted again into another pack: a row of the same capture.
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(4, 0), (4, 91)])), Err(1));
        assert_eq!(attempt_to_repeat(&mut attempts, 7, &rows(&[(1, 0), (1, 11), (1, 12), (9, 0), (9, 91)])), Err(2));
    }

    #[tokio::test]
    async fn a_process_started_after_another_died_repeats_its_attempts() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rows-in-doubt");
        let batch = rows(&[(1, 0), (1, 11), (1, 12)]);
        let first = AttemptsInDoubt::kept_in(file.clone());
        let sent = first.attempt(7, &batch).await.unwrap().publish_id;
        // The process dies with the insert in flight; the next one reads what it left.
        drop(first);
        let next = AttemptsInDoubt::kept_in(file.clone());
        assert_eq!(next.recorded(), vec![RowsInDoubt { version: 7, publish_id: sent, rows: batch.clone() }]);
        let mut bigger = batch.clone();
        bigger.insert(key(2, 0));
        let repeat = next.attempt(7, &bigger).await.unwrap();
        assert_eq!(repeat.publish_id, sent, "the same attempt, with a pack more");
        assert_eq!(AttemptsInDoubt::kept_in(file.clone()).recorded()[0].rows, bigger, "recorded with its new rows");
        // A repeat whose insert failed without running leaves the earlier sends in doubt, with every row either
        // may have; a new attempt whose insert failed so leaves nothing to repeat.
        next.ruled_out(&repeat).await;
        assert_eq!(AttemptsInDoubt::kept_in(file.clone()).recorded()[0].rows, bigger);
        let other = next.attempt(7, &rows(&[(5, 0)])).await.unwrap();
        next.ruled_out(&other).await;
        assert_eq!(AttemptsInDoubt::kept_in(file.clone()).recorded().len(), 1);
        // Rows shared without all of them: no attempt at this version, and nothing recorded, however often asked.
        for _ in 0..3 {
            assert_eq!(next.attempt(7, &rows(&[(1, 0), (1, 11)])).await, None);
        }
        assert_eq!(next.recorded().len(), 1);
        // No rows: nothing recorded.
        assert!(next.attempt(7, &HashSet::new()).await.is_some());
        assert_eq!(next.recorded().len(), 1);
        next.committed().await;
        assert!(!file.exists(), "nothing in doubt: no file");
        assert!(AttemptsInDoubt::kept_in(file.clone()).recorded().is_empty());
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[tokio::test]
    async fn a_record_that_cannot_be_written_leaves_the_attempts_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let doubts = AttemptsInDoubt::kept_in(dir.path().join("gone").join("rows-in-doubt"));
        let batch = rows(&[(1, 0), (1, 11)]);
        let sent = doubts.attempt(4, &batch).await.unwrap().publish_id;
        assert!(doubts.write_failing.load(Ordering::Relaxed));
        assert_eq!(doubts.attempt(4, &batch).await.unwrap().publish_id, sent, "still repeated within the process");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn a_damaged_record_is_refused_whole() {
        let attempts = vec![
            RowsInDoubt { version: 3, publish_id: Uuid::from_u128(5), rows: rows(&[(1, 0), (1, 2)]) },
            RowsInDoubt { version: 3, publish_id: Uuid::from_u128(6), rows: HashSet::new() },
        ];
        let bytes = encode(&attempts);
        assert_eq!(decode(&bytes).unwrap(), attempts);
        for cut in [0, 3, MAGIC.len(), bytes.len() - 40, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = bytes.clone();
        flipped[MAGIC.len() + 6] ^= 1;
        assert!(decode(&flipped).unwrap_err().contains("checksum"));
        // A well-formed body that claims more rows than it holds.
        let mut lying = bytes[..MAGIC.len() + 4 + 8 + 16].to_vec();
        lying.put_u64_le(u64::MAX);
        let crc = crc32c::crc32c(&lying);
        lying.put_u32_le(crc);
        assert_eq!(decode(&lying).unwrap_err(), "truncated");
        // A damaged file is ignored at a start.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rows-in-doubt"), &flipped).unwrap();
        assert!(AttemptsInDoubt::kept_in(dir.path().join("rows-in-doubt")).recorded().is_empty());
    }
}
