//! The publish attempts whose rows may still land, and the two ways a publisher keeps them from ever replacing a
//! committed row: repeating an attempt, and committing a version empty.
//!
//! Why: merges keep one row of `captures` per capture (of `packs` per pack): the highest version, and of rows of one
//! version the last one written. ClickHouse completes an insert it has received whatever became of its client, so the
//! rows of an attempt whose insert did not answer, or whose process died while it was sent, may land at any later
//! time. Had a later attempt at that version (the same: nothing was committed there) written rows of the same
//! captures under another publish_id, a merge after such a late landing could keep the orphan row over the committed
//! one, and the capture (the pack) would drop out of listings (the replay guard and the inventory).
//!
//! - **Within a process** a publisher keeps its attempts here ([`AttemptsInDoubt`]). The next attempt at
//!   their version whose rows include every row of one of them is sent as that attempt: same publish_id, same rows
//!   (a row follows from its pack's index, its version and its publish_id alone), which a late copy only repeats.
//!   One that shares captures or packs with one of them without including all its rows cannot be sent at that
//!   version: the publisher commits the version empty (no rows, a publish_id of its own) and sends it at the next,
//!   above every row in doubt.
//! - **Across processes** nothing is kept: a claim that follows a term this process did not know it held (another
//!   process's, whichever its spool: a restart, a takeover, a standby; or its own whose claim or renewal went
//!   unanswered) owes an empty commit, which the next publish of packs makes before it writes any row of
//!   `captures` or `packs` ([`crate::catalog::lease::LeaseHandle::owes_empty_commit`]), in that tenure or a later
//!   one. A deletion or a horizon commits at one above the watermark itself and writes only rows keyed by
//!   publish_id, so it pays the debt as well. Every attempt of an earlier holder is at a version at most one above
//!   the watermark read after the claim: its commits are fenced, and a version it read from the watermark was read
//!   before its local deadline, so before its lease expired on the server. So the rows of such attempts are orphans
//!   below every row written from then on. (The first claim of a catalog nothing was written into follows no term.
//!   A claim over a catalog whose lease rows were removed by hand follows holders no one can name, and owes the
//!   commit as well if a row of theirs has landed; that covers their attempts once their deadlines have passed.)
//!
//! States of an attempt here:
//!
//! ```text
//!  (sent) --its insert failed in a way that does not rule out it ran--> in doubt
//!  in doubt --a later attempt at its version includes its rows--> sent again as that attempt (same publish_id); if
//!        that send may have run too, in doubt with all its rows
//!  in doubt --a later attempt at its version shares a capture or a pack without including all its rows--> the
//!        version is committed empty, which ends every doubt; the later attempt takes the next
//!  in doubt --a commit (of any version: versions only go up, so its rows are committed or orphans for good)--> (gone)
//! ```
//!
//! An attempt whose insert answered and whose commit did not land is not in doubt: its rows landed already, before
//! any later attempt's. Invariant: an attempt repeated with more rows that may have run has them all in doubt, so an
//! attempt after it repeats them all or goes to the next version (else its commit would make the extra rows visible
//! without their packs, if those did not land).

use std::collections::HashSet;
use std::sync::Mutex;

use uuid::Uuid;

/// A row of a publish, by what it is about: `(pack_id, capture_id)` of a capture's row, `(pack_id, nil)` of a pack's.
pub type RowKey = (Uuid, Uuid);

/// One attempt at a version whose rows may land.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RowsInDoubt {
    version: u64,
    publish_id: Uuid,
    rows: HashSet<RowKey>,
}

/// The attempts in doubt of one publisher (see the module doc).
#[derive(Default)]
pub struct AttemptsInDoubt {
    attempts: Mutex<Vec<RowsInDoubt>>,
}

impl AttemptsInDoubt {
    /// The publish_id of an attempt at `version` writing `rows`: that of the attempt in doubt whose rows these
    /// include, or a new one. `None` when these share a capture or a pack with an attempt in doubt (or two) without
    /// including all its rows: they can be sent as no attempt at this version (the caller commits the version empty
    /// first).
    pub fn attempt(&self, version: u64, rows: &HashSet<RowKey>) -> Option<Uuid> {
        let attempts = self.lock();
        match attempt_to_repeat(&attempts, version, rows) {
            Ok(Some(at)) => {
                let publish_id = attempts[at].publish_id;
                tracing::info!(version, %publish_id, "sending again the attempt whose rows are in doubt");
                Some(publish_id)
            }
            Ok(None) => Some(Uuid::now_v7()),
            Err(shared) => {
                tracing::warn!(
                    version,
                    attempts = shared,
                    "rows of earlier attempts at this version are in doubt and this attempt does not repeat them all: \
                     it goes to the next version once this one is committed empty"
                );
                None
            }
        }
    }

    /// The insert of the attempt `publish_id`'s `rows` at `version` failed. Where it `may_have_run` (an error that
    /// does not rule it out), its rows are in doubt: a repeat's attempt has them all from then on (they include the
    /// earlier sends'). Where it did not, an earlier send of a repeat stays in doubt as it was.
    pub fn failed(&self, publish_id: Uuid, version: u64, rows: HashSet<RowKey>, may_have_run: bool) {
        // An attempt of no rows (a compaction's switch that only retires packs) has nothing that could land.
        if !may_have_run || rows.is_empty() {
            return;
        }
        let mut attempts = self.lock();
        match attempts.iter_mut().find(|recorded| recorded.publish_id == publish_id) {
            Some(recorded) => recorded.rows = rows,
            None => attempts.push(RowsInDoubt { version, publish_id, rows }),
        }
    }

    /// A publish committed: every attempt recorded is of its version or below, committed or an orphan for good.
    pub fn committed(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RowsInDoubt>> {
        self.attempts.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Which attempt in doubt (its place in `attempts`) an attempt at `version` writing `rows` is to repeat: none
/// (`Ok(None)`) when it shares no capture and no pack with one, the one it shares with and includes every row of, or,
/// as `Err`, how many it shares with without including all of one's.
///
/// Shared is by what a merge replaces, not by row: a capture's rows in two packs (a post repeated into another pack)
/// are rows of one capture, which `captures` keeps one of.
fn attempt_to_repeat(attempts: &[RowsInDoubt], version: u64, rows: &HashSet<RowKey>) -> Result<Option<usize>, usize> {
    // Made only when an attempt at this version is in doubt: a publish's steady path has none.
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
        [at] if attempts[*at].rows.is_subset(rows) => Ok(Some(*at)),
        _ => Err(shared.len()),
    }
}

/// What the rows are about, as merges of `captures` and `packs` replace rows: the capture of a capture's row, the pack
/// of a pack's (a pack id and a capture id never coincide: both are UUIDv7s made apart).
fn merged_subjects(rows: &HashSet<RowKey>) -> HashSet<Uuid> {
    rows.iter().map(|(pack_id, capture_id)| if capture_id.is_nil() { *pack_id } else { *capture_id }).collect()
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
        let attempts = vec![
            RowsInDoubt { version: 7, publish_id: batch, rows: rows(&[(1, 0), (1, 11), (1, 12)]) },
            RowsInDoubt { version: 7, publish_id: switch, rows: rows(&[(9, 0), (9, 91)]) },
        ];
        // The same batch, or it with a pack more: the same attempt. The switch's own rows: the switch's.
        assert_eq!(attempt_to_repeat(&attempts, 7, &rows(&[(1, 0), (1, 11), (1, 12)])), Ok(Some(0)));
        assert_eq!(attempt_to_repeat(&attempts, 7, &rows(&[(1, 0), (1, 11), (1, 12), (2, 0)])), Ok(Some(0)));
        assert_eq!(attempt_to_repeat(&attempts, 7, &rows(&[(9, 0), (9, 91)])), Ok(Some(1)));
        // Nothing shared, or another version: a new attempt.
        assert_eq!(attempt_to_repeat(&attempts, 7, &rows(&[(3, 0), (3, 31)])), Ok(None));
        assert_eq!(attempt_to_repeat(&attempts, 8, &rows(&[(1, 0), (1, 11), (1, 12)])), Ok(None));
        // Part of one, or rows of both: it cannot repeat either.
        assert_eq!(attempt_to_repeat(&attempts, 7, &rows(&[(1, 0), (1, 11)])), Err(1));
        assert_eq!(attempt_to_repeat(&attempts, 7, &rows(&[(1, 0), (1, 11), (1, 12), (9, 0), (9, 91)])), Err(2));
        // A capture of one posted again into another pack: a row of the same capture.
        assert_eq!(attempt_to_repeat(&attempts, 7, &rows(&[(4, 0), (4, 91)])), Err(1));
    }

    #[test]
    fn the_rows_of_every_send_that_may_have_run_stay_in_doubt_until_a_commit() {
        let doubts = AttemptsInDoubt::default();
        let batch = rows(&[(1, 0), (1, 11), (1, 12)]);
        // A send that did not run leaves nothing in doubt.
        let ruled_out = doubts.attempt(7, &batch).unwrap();
        doubts.failed(ruled_out, 7, batch.clone(), false);
        assert!(doubts.lock().is_empty());
        let sent = doubts.attempt(7, &batch).unwrap();
        doubts.failed(sent, 7, batch.clone(), true);
        // Repeated with a pack more, which may have run too: the batch alone no longer repeats it.
        let mut bigger = batch.clone();
        bigger.insert(key(2, 0));
        let repeat = doubts.attempt(7, &bigger).unwrap();
        assert_eq!(repeat, sent, "the same attempt, with a pack more");
        doubts.failed(repeat, 7, bigger.clone(), true);
        assert_eq!(doubts.attempt(7, &batch), None);
        // A repeat that did not run leaves the earlier sends in doubt as they were.
        let again = doubts.attempt(7, &bigger.iter().copied().chain([key(3, 0)]).collect()).unwrap();
        doubts.failed(again, 7, HashSet::new(), false);
        assert_eq!(doubts.lock()[0].rows, bigger);
        // Nothing of no rows is in doubt; a commit clears every attempt.
        let switch = doubts.attempt(7, &HashSet::new()).unwrap();
        doubts.failed(switch, 7, HashSet::new(), true);
        assert_eq!(doubts.lock().len(), 1);
        doubts.committed();
        assert!(doubts.lock().is_empty());
        assert!(doubts.attempt(7, &batch).is_some_and(|fresh| fresh != sent));
    }
}
