//! Publishing a batch of packs at catalog version V = watermark + 1 (within one tenure of the lease, the watermark is
//! this publisher's last commit and is not read again: [`Publisher::next_version`]).
//!
//! 1. A [`PublishPermit`] from the lease: held, with at least `publish_timeout + clock_skew` left.
//! 2. Replay guard: packs whose rows are already committed (their `(version, publish_id)` is in `publishes`) are
//!    reported as such and not published again.
//! 3. Descriptor rows (`captures`, `packs`) carrying `(V, publish_id)`; invisible until step 4 lands, harmless orphans if
//!    it never does (`capstore gc` removes them). Rows whose insert did not answer may still land after a later
//!    attempt's commit, so the next attempt at V that writes them all is sent as the same attempt, and one that
//!    shares captures with them without writing them all goes to V + 1 after V is committed empty; so does the
//!    first publish of a tenure that followed another process's lease (see [`super::in_doubt`]).
//! 4. The `publishes` row: `INSERT ... SELECT ... FROM system.one WHERE <fence> AND max(version) = V - 1`, with
//!    `max_execution_time = publish_timeout` and `wait_end_of_query = 1`. The version check reads only the
//!    publishes at or above V - 1 (a primary-key range, O(1) however long the history): their maximum is V - 1
//!    exactly when V - 1 is committed and nothing above it is, so versions stay gapless by construction.
//! 5. Read back `(V, publish_id)`: present means committed; absent means the fence or the version check refused it
//!    (the lease is re-checked); an unknown outcome at 4 or 5 quarantines the lease and leaves the batch *unresolved*:
//!    before anything else is published, the unresolved publish_id is read back again (and the replay guard sees it).
//!
//! A deletion ([`Publisher::publish_deletions`]) is published the same way: its rows are tombstones (the capture's
//! newest row with an empty `pack_id`, see [`crate::catalog::query::CaptureLocation::is_deletion`]) instead of pack
//! rows, and its `publishes` row counts them as its captures, with no pack. So a deletion is fenced, versioned and in
//! the log of publishes like any other change, and only the lease holder makes one.
//!
//! Invariants: versions per catalog are gapless and strictly increasing (I4: V is allocated only under the lease, and
//! the statement itself refuses unless `max(version) = V - 1`); no publishing statement lands without the fence (I3).
//! One publish at a time per process (the publish turn: the indexer, reconcile and an API deletion share the
//! publisher), so a version is never allocated twice here.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use uuid::Uuid;

use super::client::{sql_string_literal, CatalogClient, CatalogError, ErrorKind};
use super::in_doubt::{AttemptsInDoubt, RowKey};
use super::lease::{server_now_ms_expr, LeaseHandle, PublishPermit};
use super::query::{CaptureLocation, CatalogReader, DELETED_PACK_ID};
use super::schema::Tables;
use crate::pack::{IndexEntry, PackSummary};

/// One pack to publish: where it lives in the bucket and what it holds.
#[derive(Debug, Clone)]
pub struct PackDescriptor {
    pub summary: PackSummary,
    pub object_key: String,
    pub entries: Vec<IndexEntry>,
}

/// The captures a publish of `packs` indexes: each capture id once, as its last post. A producer may post an id again
/// before the pack holding its first post is published (a retry after a lost reply, or after a write error that left
/// the first record on disk). Both posts would be rows of one version, which no read can order, so a listing would
/// show the capture at each of its times (I2). The spool appends to one pack at a time and names packs by UUIDv7, so
/// pack id and then place in the pack is the order of the posts.
///
/// Within one pack the earlier post's record is left named by no row: a deletion still rewrites the pack (the last
/// post's row names it), and compaction copies only the record a row names. Across packs the daemon never asks for
/// this: its batches start anew at a pack that repeats an id (see the indexer), so each post has a row at its own
/// version and erasure finds every pack that holds one. For any other caller the earlier pack's post is dropped here
/// all the same, and only compaction's merging would ever erase its bytes.
fn last_posts<'a>(packs: &[&'a PackDescriptor]) -> Vec<(&'a PackDescriptor, &'a IndexEntry)> {
    let mut posts: Vec<(&PackDescriptor, &IndexEntry)> =
        packs.iter().flat_map(|pack| pack.entries.iter().map(move |entry| (*pack, entry))).collect();
    // A stable sort: within a pack the entries keep their order, the order of the posts.
    posts.sort_by_key(|(pack, _)| pack.summary.pack_id);
    let mut last_of: HashMap<Uuid, usize> = HashMap::with_capacity(posts.len());
    for (at, (_, entry)) in posts.iter().enumerate() {
        last_of.insert(entry.meta.capture_id, at);
    }
    if last_of.len() == posts.len() {
        return posts;
    }
    posts
        .into_iter()
        .enumerate()
        .filter(|(at, (_, entry))| last_of[&entry.meta.capture_id] == *at)
        .map(|(_, post)| post)
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Every pack of the batch is now visible at `version`.
    Committed { version: u64, publish_id: Uuid },
    /// Every pack of the batch was already published earlier (replay guard); nothing was written.
    AlreadyPublished,
}

/// What a deletion of a list of ids found and did ([`Publisher::publish_deletions`], [`plan_deletions`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeletionReport {
    /// Deleted by this deletion (or, for a plan, what it would delete).
    pub deleted: Vec<Uuid>,
    /// Deleted earlier: their newest committed row is a deletion already (deleting is idempotent).
    pub already_deleted: Vec<Uuid>,
    /// Not in the catalog.
    pub not_found: Vec<Uuid>,
    /// Posted again after the watermark the deletion was asked at (`unchanged_since`): not deleted.
    pub changed: Vec<Uuid>,
    /// The version the deletion was published at; `None` when nothing was to be deleted (and for a plan).
    pub version: Option<u64>,
}

/// The most ids one deletion takes: its tombstones are one INSERT and one version.
pub const DELETION_MAX_IDS: usize = 10_000;

/// What deleting `ids` would do now (with `unchanged_since`: only of captures whose newest committed row is at or
/// below that version), and the rows it would mark: each id's newest committed row (a capture, or a deletion
/// already). An id given twice counts once.
pub async fn plan_deletions(
    reader: &CatalogReader,
    ids: &[Uuid],
    unchanged_since: Option<u64>,
) -> Result<(DeletionReport, Vec<CaptureLocation>), CatalogError> {
    let unique = crate::util::unique_ids(ids);
    let mut newest = reader.newest_rows(&unique).await?;
    // A capture moved by compaction since `unchanged_since` is the same capture: not a change.
    let newer: Vec<u64> = match unchanged_since {
        Some(since) => newest.values().filter(|row| row.version > since).map(|row| row.version).collect(),
        None => Vec::new(),
    };
    let moves = reader.versions_without_packs(&newer).await?;
    let (mut report, mut targets) = (DeletionReport::default(), Vec::new());
    for id in unique {
        match newest.remove(&id) {
            None => report.not_found.push(id),
            Some(row) if row.is_deletion() => report.already_deleted.push(id),
            Some(row) if unchanged_since.is_some_and(|since| row.version > since) && !moves.contains(&row.version) => {
                report.changed.push(id)
            }
            Some(row) => {
                report.deleted.push(id);
                targets.push(row);
            }
        }
    }
    Ok((report, targets))
}

/// A compaction's switch-over ([`Publisher::publish_relocation`]): the captures copied into a new pack, and the
/// packs it replaces.
#[derive(Debug, Clone)]
pub struct Relocation {
    /// The new pack, uploaded already; `None` when no capture of the sources is left to move (every one deleted or
    /// superseded): then the sources are only retired.
    pub new_pack: Option<PackDescriptor>,
    /// The packs replaced: once the switch commits, no capture's newest row names them.
    pub sources: Vec<SourcePack>,
    /// Every capture the sources' records name (from their footers): the switch is refused if one of them still
    /// lives in a source and is not moved, so that retiring the sources can never leave a capture behind.
    pub source_captures: Vec<Uuid>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourcePack {
    pub pack_id: Uuid,
    pub object_key: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelocationOutcome {
    /// The new pack's captures are read from it from `version` on, and the sources are retired.
    Switched { version: u64, moved: usize },
    /// An earlier attempt switched them already (its outcome was lost): nothing was written.
    AlreadySwitched,
    /// Some captures of the new pack are no longer where the compaction copied them from (deleted or posted again
    /// since): nothing was written, and no committed row names the new pack, which can go.
    Changed { changed: Vec<Uuid> },
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("not publishing: the lease is not held with enough time left")]
    NoLease,
    #[error("publish refused by the fence or the version check (lost the lease or raced); the lease is re-checked")]
    NotCommitted,
    #[error("publish outcome unknown; lease quarantined: {0}")]
    OutcomeUnknown(CatalogError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

#[derive(clickhouse::Row, serde::Serialize)]
struct CaptureRow {
    catalog: String,
    stream: String,
    captured_at_ns: u64,
    capture_id: String,
    pack_id: String,
    object_key: String,
    record_offset: u64,
    record_len: u64,
    payload_offset: u64,
    payload_len: u64,
    crc32c: u32,
    label_keys: Vec<String>,
    label_values: Vec<String>,
    content_type: String,
    version: u64,
    publish_id: String,
}

#[derive(clickhouse::Row, serde::Serialize)]
struct PackRow {
    catalog: String,
    pack_id: String,
    object_key: String,
    bytes: u64,
    sha256: String,
    records: u64,
    first_captured_at_ns: u64,
    last_captured_at_ns: u64,
    version: u64,
    publish_id: String,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct VersionRow {
    version: u64,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct PackIdRow {
    pack_id: String,
}

/// A publish whose outcome is not known yet.
#[derive(Debug, Clone)]
struct Unresolved {
    version: u64,
    publish_id: Uuid,
    /// The lease id its fence named: it may still land until that lease id is over (the quarantine that follows an
    /// unknown outcome ends it, and the next claim takes a fresh one).
    lease_id: String,
}

pub struct Publisher {
    client: CatalogClient,
    tables: Tables,
    catalog: String,
    lease: LeaseHandle,
    unresolved: Mutex<Option<Unresolved>>,
    /// Held from a publish's version allocation to its read-back: one publish at a time.
    turn: tokio::sync::Mutex<()>,
    /// The schema version known stamped (see [`super::schema::stamp_at_least`]); 0 until a deletion or a
    /// compaction first needs one.
    stamped: std::sync::atomic::AtomicU32,
    /// `(tenure, version)` of this publisher's last commit: within one tenure of the lease nobody else publishes, so
    /// the next version follows from it without reading the watermark (see [`Publisher::next_version`]).
    last_commit: Mutex<Option<(u64, u64)>>,
    /// Whether `by_id` has `captured_at_ns` ([`super::schema::by_id_has_time`]), asked once.
    by_id_time: tokio::sync::OnceCell<bool>,
    /// The attempts whose rows may still land (see [`super::in_doubt`]): at one version, the one being tried (a
    /// batch of packs and a compaction's switch may take turns there); cleared by a commit.
    in_doubt: AttemptsInDoubt,
    /// Whether a month's drop may still run on a server, which no publish may run beside ([`Publisher::take_turn`]).
    drops: Mutex<DropsMayRun>,
}

/// Whether a month's drop (retention's, [`super::purge`]: no fence guards one) may still run on a server, as the
/// publish turn knows it. Changed only by a holder of the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DropsMayRun {
    /// Not asked since this process started, or since it took the lease over from another process (while it
    /// owes an empty commit, [`LeaseHandle::owes_empty_commit`]): a drop of the process before (killed mid-drop, or a
    /// holder that lost the lease during one) may still run. Asked before the next publish; where a server cannot
    /// say, it goes on, with a WARN.
    Unchecked,
    /// None runs, as far as the servers showed.
    No,
    /// One of this process's drops was cut off (the shutdown aborts a pass that does not end in time) or given up on
    /// (its server could not say for a TTL): asked before the next publish; where a server cannot say for a TTL, the
    /// lease is quarantined.
    Ours,
}

/// The publish turn held for statements no fence guards ([`Publisher::exclusive_turn`]): a month's drop.
pub struct ExclusiveTurn<'a> {
    _turn: tokio::sync::MutexGuard<'a, ()>,
    publisher: &'a Publisher,
}

impl ExclusiveTurn<'_> {
    /// Whether the lease is still held with time left: checked before each unfenced statement, as no fence refuses
    /// one of a holder that has lost the lease meanwhile.
    pub fn lease_held(&self) -> bool {
        self.publisher.lease.permit().is_some()
    }

    /// How long the server of an unfenced statement of unknown outcome may go unable to say whether it still runs
    /// before it is given up on ([`ExclusiveTurn::may_still_run`]): the lease's TTL.
    pub fn tell_within(&self) -> std::time::Duration {
        self.publisher.lease.timings().ttl
    }

    /// A drop may still run on the server, and whether it does could not be told: the lease is quarantined, as after
    /// a publish of unknown outcome (so a release writes no tombstone), and the next publish asks again first
    /// ([`Publisher::take_turn`]). Called before [`UnfencedInFlight::ended`].
    pub fn may_still_run(&self, what: &str) {
        self.publisher.lease.report_unknown_outcome(what);
        self.publisher.set_drops(DropsMayRun::Ours);
    }

    /// Drops are about to be sent in this turn (see [`UnfencedInFlight`]). None once the lease keeper has stopped.
    pub fn unfenced_sent(&self) -> Option<UnfencedInFlight<'_>> {
        let in_flight = self.publisher.lease.commit_sent()?;
        Some(UnfencedInFlight { in_flight: Some(in_flight), publisher: self.publisher })
    }
}

/// Drops sent in the publish turn, until they are known to have ended ([`UnfencedInFlight::ended`]). Meanwhile they
/// count as a commit in flight ([`LeaseHandle::commit_sent`]): a release writes no tombstone. Dropped before that (the
/// shutdown aborts a pass that does not end in time, and with it the turn), the next publish of this process waits
/// until no server runs one ([`Publisher::take_turn`]), and the release still writes no tombstone. It borrows the
/// turn, so the turn is given back after it.
pub struct UnfencedInFlight<'t> {
    in_flight: Option<super::lease::CommitInFlight>,
    publisher: &'t Publisher,
}

impl UnfencedInFlight<'_> {
    /// The drops have ended on the server, as far as it shows (or one was given up on:
    /// [`ExclusiveTurn::may_still_run`] first).
    pub fn ended(mut self) {
        if let Some(in_flight) = self.in_flight.take() {
            in_flight.answered();
        }
    }
}

impl Drop for UnfencedInFlight<'_> {
    fn drop(&mut self) {
        if self.in_flight.is_some() {
            self.publisher.set_drops(DropsMayRun::Ours);
        }
    }
}

impl Publisher {
    pub fn new(client: CatalogClient, tables: Tables, catalog: &str, lease: LeaseHandle) -> Publisher {
        Publisher {
            client,
            tables,
            catalog: catalog.to_string(),
            lease,
            unresolved: Mutex::new(None),
            turn: tokio::sync::Mutex::new(()),
            stamped: std::sync::atomic::AtomicU32::new(0),
            by_id_time: tokio::sync::OnceCell::new(),
            last_commit: Mutex::new(None),
            in_doubt: AttemptsInDoubt::default(),
            drops: Mutex::new(DropsMayRun::Unchecked),
        }
    }

    /// The publish turn, held, if the lease is held with time left and no publish of this process has an outcome
    /// still unknown: while the guard lives no publish is between its rows and its commit (each takes the turn for
    /// both, and only the holder publishes). A partition drop holds it so that it takes no committing publish's
    /// rows. None while the lease is not held, or a commit whose answer was lost may still be running.
    pub async fn exclusive_turn(&self) -> Option<ExclusiveTurn<'_>> {
        let turn = self.take_turn().await;
        let settled = self.unresolved.lock().unwrap_or_else(|p| p.into_inner()).is_none();
        (settled && self.lease.permit().is_some()).then_some(ExclusiveTurn { _turn: turn, publisher: self })
    }

    /// The publish turn, once no month's drop may still run on a server ([`DropsMayRun`]; a drop takes every row of
    /// its month, a publish's between its rows and its commit too, and no fence guards it). Where one may, this asks
    /// every server of the catalog until none runs one ([`super::purge::wait_until_no_drop_runs`]). (The state
    /// changes only after the answer: a wait cut off in turn leaves it to the next.)
    async fn take_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        let turn = self.turn.lock().await;
        let mut drops = *self.drops.lock().unwrap_or_else(|p| p.into_inner());
        if drops == DropsMayRun::No && self.lease.owes_empty_commit() {
            // The lease was taken over from another process (until this tenure's first commit): its drops may run.
            drops = DropsMayRun::Unchecked;
        }
        let tell_within = match drops {
            DropsMayRun::No => return turn,
            DropsMayRun::Unchecked => std::time::Duration::ZERO,
            DropsMayRun::Ours => self.lease.timings().ttl,
        };
        let none_runs =
            super::purge::wait_until_no_drop_runs(&self.client, &self.tables, &self.catalog, tell_within).await;
        match (none_runs, drops) {
            (true, _) => {}
            (false, DropsMayRun::Ours) => self.lease.report_unknown_outcome("a month's drop may still run"),
            (false, _) => tracing::warn!(
                "catalog: a server cannot say whether a month's drop of an earlier process still runs; publishing all \
                 the same"
            ),
        }
        self.set_drops(DropsMayRun::No);
        turn
    }

    fn set_drops(&self, state: DropsMayRun) {
        *self.drops.lock().unwrap_or_else(|p| p.into_inner()) = state;
    }

    /// The version a publish of `rows` under `permit` takes, and the publish_id of its attempt there. Where rows of
    /// another attempt may land at that version later (see [`super::in_doubt`]) the version is committed empty first
    /// (no rows, under a publish_id of its own), and these go to the next: while the lease owes an empty commit, and
    /// where these rows share captures or packs with an attempt of ours in doubt there without repeating it. A merge
    /// keeps the highest version, so a late landing of those rows can no longer win over these.
    async fn version_and_attempt(
        &self,
        permit: &PublishPermit,
        rows: &HashSet<RowKey>,
    ) -> Result<(u64, Uuid), PublishError> {
        loop {
            let version = self.next_version(permit).await?;
            let attempt = match self.lease.owes_empty_commit() {
                true => {
                    tracing::info!(
                        version,
                        "the lease followed a holder whose rows may still land: committing a version empty first"
                    );
                    None
                }
                false => self.in_doubt.attempt(version, rows),
            };
            match attempt {
                Some(publish_id) => return Ok((version, publish_id)),
                // The commit pays what the lease owes and ends every doubt: the next turn goes through.
                None => self.commit(permit, version, Uuid::now_v7(), 0, 0).await?,
            }
        }
    }

    /// The version a publish under `permit` takes: one above this publisher's last commit if that was under the
    /// same tenure of the lease as `permit`, else one above the watermark read now. While a tenure lasts the fence
    /// keeps every other process from publishing and this publisher publishes one at a time (the turn), so its last
    /// commit is the watermark. A guess can still be wrong (a second publisher on the same lease handle; a permit
    /// used after its tenure ended and the lease was claimed again, by which time another process may have
    /// published), and that cannot break gapless versions: the commit's own version check refuses it, and a refusal
    /// or an unknown outcome forgets the last commit, so the next publish reads the watermark.
    async fn next_version(&self, permit: &PublishPermit) -> Result<u64, PublishError> {
        let known = *self.last_commit.lock().unwrap_or_else(|p| p.into_inner());
        match known {
            Some((tenure, version)) if tenure == permit.tenure => Ok(version + 1),
            _ => {
                let watermark = self.watermark().await?;
                // Read while the lease was ours on the server (the local deadline comes first), so before any
                // successor's claim: rows sent at this version are at most one above the watermark that successor
                // reads, where it commits empty first (see `super::in_doubt`). A holder paused past its deadline
                // could otherwise read a successor's commits and send rows above them.
                if Instant::now() >= self.lease.deadline_for(permit) {
                    return Err(PublishError::NoLease);
                }
                Ok(watermark + 1)
            }
        }
    }

    fn remember_commit(&self, commit: Option<(u64, u64)>) {
        *self.last_commit.lock().unwrap_or_else(|p| p.into_inner()) = commit;
    }

    fn reader(&self) -> CatalogReader {
        CatalogReader::new(self.client.clone(), self.tables.clone(), &self.catalog)
    }

    fn catalog_literal(&self) -> String {
        sql_string_literal(&self.catalog)
    }

    /// The upload intents of this catalog, on the same connection.
    pub fn intent_log(&self) -> super::intents::IntentLog {
        super::intents::IntentLog::new(self.client.clone(), self.tables.clone(), &self.catalog)
    }

    /// The highest committed version (0 before the first publish).
    pub async fn watermark(&self) -> Result<u64, CatalogError> {
        self.reader().watermark().await
    }

    /// Whether `publish_id`, sent at `version`, landed (a primary-key lookup: a publish lands at its own version
    /// or not at all).
    pub async fn read_back(&self, version: u64, publish_id: Uuid) -> Result<Option<u64>, CatalogError> {
        let rows: Vec<VersionRow> = self
            .client
            .fetch_few_deciding(&format!(
                "SELECT version FROM {} WHERE catalog = {} AND version = {version} AND publish_id = {}",
                self.tables.publishes,
                self.catalog_literal(),
                sql_string_literal(&publish_id.to_string())
            ))
            .await?;
        Ok(rows.first().map(|row| row.version))
    }

    /// Pack ids among `pack_ids` whose rows are committed (the replay guard).
    pub async fn committed_packs(&self, pack_ids: &[Uuid]) -> Result<HashSet<Uuid>, CatalogError> {
        if pack_ids.is_empty() {
            return Ok(HashSet::new());
        }
        let list: Vec<String> = pack_ids.iter().map(|id| sql_string_literal(&id.to_string())).collect();
        let catalog = self.catalog_literal();
        let rows: Vec<PackIdRow> = self
            .client
            .fetch_all_deciding(&format!(
                "SELECT DISTINCT pack_id FROM {packs} WHERE catalog = {catalog} AND pack_id IN ({list}) AND \
                 (version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND \
                 version IN (SELECT version FROM {packs} WHERE catalog = {catalog} AND pack_id IN ({list})))",
                packs = self.tables.packs,
                publishes = self.tables.publishes,
                list = list.join(", "),
            ))
            .await?;
        Ok(rows.iter().filter_map(|row| Uuid::parse_str(&row.pack_id).ok()).collect())
    }

    /// Settle an earlier publish of unknown outcome, before publishing under `permit`. Returns its version if it
    /// committed. Refused (`NoLease`) while `permit` is of the lease id that publish was sent under: its statement
    /// could still land, so its read-back would not be final.
    async fn resolve_unresolved(&self, permit: &PublishPermit) -> Result<Option<u64>, PublishError> {
        let pending = self.unresolved.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some(pending) = pending else { return Ok(None) };
        if pending.lease_id == permit.lease_id {
            return Err(PublishError::NoLease);
        }
        let committed = self.read_back(pending.version, pending.publish_id).await?;
        match committed {
            Some(version) => {
                tracing::info!(version, publish_id = %pending.publish_id, "earlier publish of unknown outcome had committed")
            }
            None => {
                tracing::info!(version = pending.version, publish_id = %pending.publish_id, "earlier publish of unknown outcome had not committed")
            }
        }
        *self.unresolved.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(committed)
    }

    /// Publish `packs` as one version under the lease held now: each capture id once, its last post (see
    /// [`last_posts`]). See the module doc for the steps.
    pub async fn publish_batch(&self, packs: &[PackDescriptor]) -> Result<PublishOutcome, PublishError> {
        // The permit is taken in the turn: one taken before it might predate the quarantine of a publish that ran
        // meanwhile.
        let _turn = self.take_turn().await;
        let permit = self.lease.permit().ok_or(PublishError::NoLease)?;
        self.publish_in_turn(&permit, packs).await
    }

    /// [`Publisher::publish_batch`] with a permit taken earlier. Production code calls `publish_batch`; tests use this
    /// to play a holder that was paused with a permit in hand, which is exactly what the fence must defeat.
    pub async fn publish_with_permit(
        &self,
        permit: &PublishPermit,
        packs: &[PackDescriptor],
    ) -> Result<PublishOutcome, PublishError> {
        let _turn = self.take_turn().await;
        self.publish_in_turn(permit, packs).await
    }

    async fn publish_in_turn(
        &self,
        permit: &PublishPermit,
        packs: &[PackDescriptor],
    ) -> Result<PublishOutcome, PublishError> {
        // An unresolved publish is settled first: its statement can no longer land (the quarantine gave us a new
        // lease_id, which its fence does not name), so the read-back is final.
        self.resolve_unresolved(permit).await?;
        let pack_ids: Vec<Uuid> = packs.iter().map(|pack| pack.summary.pack_id).collect();
        let already = self.committed_packs(&pack_ids).await?;
        let fresh: Vec<&PackDescriptor> =
            packs.iter().filter(|pack| !already.contains(&pack.summary.pack_id)).collect();
        if fresh.is_empty() {
            return Ok(PublishOutcome::AlreadyPublished);
        }

        let captures = last_posts(&fresh);
        let rows: HashSet<RowKey> = captures
            .iter()
            .map(|(pack, entry)| (pack.summary.pack_id, entry.meta.capture_id))
            .chain(fresh.iter().map(|pack| (pack.summary.pack_id, Uuid::nil())))
            .collect();
        let (version, publish_id) = self.version_and_attempt(permit, &rows).await?;
        if let Err(error) = self.insert_descriptor_rows(&fresh, &captures, version, publish_id).await {
            self.in_doubt.failed(publish_id, version, rows, error.kind != ErrorKind::DefinitelyFailed);
            return Err(error.into());
        }
        self.commit(permit, version, publish_id, fresh.len(), captures.len()).await?;
        Ok(PublishOutcome::Committed { version, publish_id })
    }

    /// Delete the captures `ids` name, as one publish under the lease held now: a tombstone for each id whose newest
    /// committed row is a capture (an id deleted already, or unknown, is reported and left alone), and with
    /// `unchanged_since` only if that row's version is at or below it (a capture posted again since a listing at
    /// that watermark is reported as `changed`, not deleted). Nothing is published when nothing is to be deleted. At
    /// most [`DELETION_MAX_IDS`] ids.
    ///
    /// The plan is made inside the publish turn, after an unresolved publish is settled, so a retried deletion whose
    /// first attempt landed finds its ids deleted already instead of deleting them twice.
    pub async fn publish_deletions(
        &self,
        ids: &[Uuid],
        unchanged_since: Option<u64>,
    ) -> Result<DeletionReport, PublishError> {
        let _turn = self.take_turn().await;
        let permit = self.lease.permit().ok_or(PublishError::NoLease)?;
        self.delete_in_turn(&permit, ids, unchanged_since).await
    }

    /// [`Publisher::publish_deletions`] with a permit taken earlier (for tests, as [`Publisher::publish_with_permit`]).
    pub async fn delete_with_permit(
        &self,
        permit: &PublishPermit,
        ids: &[Uuid],
    ) -> Result<DeletionReport, PublishError> {
        let _turn = self.take_turn().await;
        self.delete_in_turn(permit, ids, None).await
    }

    async fn delete_in_turn(
        &self,
        permit: &PublishPermit,
        ids: &[Uuid],
        unchanged_since: Option<u64>,
    ) -> Result<DeletionReport, PublishError> {
        assert!(ids.len() <= DELETION_MAX_IDS, "callers bound a deletion to DELETION_MAX_IDS ids");
        self.resolve_unresolved(permit).await?;
        let (mut report, targets) = plan_deletions(&self.reader(), ids, unchanged_since).await?;
        if targets.is_empty() {
            return Ok(report);
        }
        let version = self.next_version(permit).await?;
        let publish_id = Uuid::now_v7();
        let publish_id_text = publish_id.to_string();
        let rows: Vec<CaptureRow> = targets
            .into_iter()
            .map(|target| CaptureRow {
                catalog: self.catalog.clone(),
                stream: target.stream,
                captured_at_ns: target.captured_at_ns,
                capture_id: target.capture_id,
                pack_id: DELETED_PACK_ID.to_string(),
                // Where the deleted bytes are: what erasure rewrites (see `crate::pipeline::compaction`).
                object_key: target.object_key,
                record_offset: 0,
                record_len: 0,
                payload_offset: 0,
                payload_len: 0,
                crc32c: 0,
                // The stream and time say where the capture was; labels and payload details are not kept.
                label_keys: Vec::new(),
                label_values: Vec::new(),
                content_type: String::new(),
                version,
                publish_id: publish_id_text.clone(),
            })
            .collect();
        self.stamp_at_least(super::schema::STAMPED_BY_DELETION).await?;
        self.insert_index_rows(&rows, version, &publish_id_text).await?;
        crate::failpoint::hit("after_tombstones_before_commit");
        self.commit(permit, version, publish_id, 0, rows.len()).await?;
        crate::failpoint::hit("after_deletion_commit");
        report.version = Some(version);
        Ok(report)
    }

    /// Publish a retention horizon: from its version on, no read returns a capture captured before `before_ns`
    /// (see [`crate::catalog::query`]), and once readers are done with it the months below it are dropped (see
    /// [`super::purge`]). One row in `horizons`, committed like any change: fenced, versioned, in the log of publishes
    /// (a publish of no pack and no capture), so only the lease holder makes one and `tail` consumers see it. Nothing
    /// is published when the catalog's horizon is at `before_ns` or above already (asked inside the publish turn, so
    /// a retried horizon whose first attempt landed is not published twice). Returns the version, if published.
    pub async fn publish_horizon(&self, before_ns: u64) -> Result<Option<u64>, PublishError> {
        let _turn = self.take_turn().await;
        let permit = self.lease.permit().ok_or(PublishError::NoLease)?;
        self.resolve_unresolved(&permit).await?;
        if self.reader().horizons(u64::MAX).await?.before_at(u64::MAX) >= before_ns {
            return Ok(None);
        }
        let version = self.next_version(&permit).await?;
        let publish_id = Uuid::now_v7();
        self.stamp_at_least(super::schema::STAMPED_BY_HORIZON).await?;
        self.client
            .execute(&format!(
                "INSERT INTO {horizons} (catalog, before_ns, version, publish_id, written_at_ms) \
                 SELECT {catalog}, {before_ns}, {version}, {publish_id}, {now}",
                horizons = self.tables.horizons,
                catalog = self.catalog_literal(),
                publish_id = sql_string_literal(&publish_id.to_string()),
                now = server_now_ms_expr(&self.client),
            ))
            .await?;
        crate::failpoint::hit("after_horizon_row_before_commit");
        self.commit(&permit, version, publish_id, 0, 0).await?;
        crate::failpoint::hit("after_horizon_commit");
        Ok(Some(version))
    }

    /// Switch the captures of `relocation.new_pack` to their new places and retire its sources, as one publish
    /// under the lease held now (a compaction's switch-over, see [`crate::pipeline::compaction`]). Each capture is
    /// moved only if its newest committed row is still the record the compaction copied (in a source, same CRC):
    /// planned inside the publish turn, so no deletion or publish of this process comes in between, and only the
    /// lease holder publishes. A move is a row of `by_version` and `by_id` only (like a deletion: in `captures` it
    /// would replace the capture's row on a merge, committed or not, and readers pinned below the move would lose
    /// it); the `packs` row of the new pack and a `retired_packs` row per source ride on the same version.
    pub async fn publish_relocation(&self, relocation: &Relocation) -> Result<RelocationOutcome, PublishError> {
        let _turn = self.take_turn().await;
        let permit = self.lease.permit().ok_or(PublishError::NoLease)?;
        self.resolve_unresolved(&permit).await?;
        let entries: &[IndexEntry] = relocation.new_pack.as_ref().map_or(&[], |pack| pack.entries.as_slice());
        let mut ids: Vec<Uuid> = entries.iter().map(|entry| entry.meta.capture_id).collect();
        ids.extend(&relocation.source_captures);
        let newest = self.reader().newest_rows(&crate::util::unique_ids(&ids)).await?;
        let new_pack_id = relocation.new_pack.as_ref().map(|pack| pack.summary.pack_id.to_string());
        let sources: HashSet<String> = relocation.sources.iter().map(|source| source.pack_id.to_string()).collect();
        let (mut switched, mut movable, mut changed) = (0, Vec::new(), Vec::new());
        for entry in entries {
            match newest.get(&entry.meta.capture_id) {
                Some(row) if Some(&row.pack_id) == new_pack_id.as_ref() => switched += 1,
                Some(row) if sources.contains(&row.pack_id) && row.crc32c == entry.crc32c => movable.push(entry),
                _ => changed.push(entry.meta.capture_id),
            }
        }
        // A capture of a source that lives there still and is not moved (the copy missed it): retiring the source
        // would lose it.
        let moving: HashSet<Uuid> = movable.iter().map(|entry| entry.meta.capture_id).collect();
        changed.extend(
            relocation
                .source_captures
                .iter()
                .filter(|id| !moving.contains(id) && newest.get(id).is_some_and(|row| sources.contains(&row.pack_id))),
        );
        changed = crate::util::unique_ids(&changed);
        if switched > 0 && movable.is_empty() {
            return Ok(RelocationOutcome::AlreadySwitched);
        }
        if !changed.is_empty() {
            // A switch that committed (its answer lost) and whose captures all changed since is found by its pack:
            // its object stays (readers pinned in between read it; a deletion since names it for erasure).
            if let Some(pack) = &relocation.new_pack {
                if switched > 0 || !self.committed_packs(&[pack.summary.pack_id]).await?.is_empty() {
                    return Ok(RelocationOutcome::AlreadySwitched);
                }
            }
            return Ok(RelocationOutcome::Changed { changed });
        }
        if relocation.new_pack.is_none() && self.retired(&relocation.sources).await? {
            return Ok(RelocationOutcome::AlreadySwitched);
        }

        // The new pack's row in `packs` is the one a late copy could replace (its moves go to `by_version` and
        // `by_id` only, whose rows differ by publish_id).
        let doubted: HashSet<RowKey> = relocation
            .new_pack
            .iter()
            .flat_map(|pack| {
                let id = pack.summary.pack_id;
                movable.iter().map(move |entry| (id, entry.meta.capture_id)).chain([(id, Uuid::nil())])
            })
            .collect();
        let (version, publish_id) = self.version_and_attempt(&permit, &doubted).await?;
        let publish_id_text = publish_id.to_string();
        self.stamp_at_least(super::schema::STAMPED_BY_COMPACTION).await?;
        if let Some(pack) = &relocation.new_pack {
            let rows: Vec<CaptureRow> =
                movable.iter().map(|entry| self.row_of_entry(pack, entry, version, &publish_id_text)).collect();
            let inserted = async {
                self.insert_index_rows(&rows, version, &publish_id_text).await?;
                self.client.insert_rows(&self.tables.packs, &[self.pack_row(pack, version, &publish_id_text)]).await
            };
            if let Err(error) = inserted.await {
                self.in_doubt.failed(publish_id, version, doubted, error.kind != ErrorKind::DefinitelyFailed);
                return Err(error.into());
            }
        }
        let retired: Vec<super::retired::RetiredPackRow> = relocation
            .sources
            .iter()
            .map(|source| super::retired::RetiredPackRow {
                catalog: self.catalog.clone(),
                pack_id: source.pack_id.to_string(),
                object_key: source.object_key.clone(),
                version,
                publish_id: publish_id_text.clone(),
                removed_at_ms: 0,
            })
            .collect();
        self.client.insert_rows(&self.tables.retired_packs, &retired).await?;
        // `packs` = 0: a publish that adds no capture (see `CatalogReader::tail_page`).
        self.commit(&permit, version, publish_id, 0, movable.len()).await?;
        Ok(RelocationOutcome::Switched { version, moved: movable.len() })
    }

    /// Whether every one of `sources` is retired by a committed publish.
    async fn retired(&self, sources: &[SourcePack]) -> Result<bool, CatalogError> {
        let ids: Vec<Uuid> = sources.iter().map(|source| source.pack_id).collect();
        let retired = super::retired::RetiredPacks::new(self.client.clone(), self.tables.clone(), &self.catalog)
            .committed_among(&ids)
            .await?;
        Ok(ids.iter().all(|id| retired.contains(id)))
    }

    /// Steps 4 and 5 of a publish whose rows are written: the fenced `publishes` row at `version`, and its read-back.
    async fn commit(
        &self,
        permit: &PublishPermit,
        version: u64,
        publish_id: Uuid,
        pack_count: usize,
        capture_count: usize,
    ) -> Result<(), PublishError> {
        let sql = format!(
            "INSERT INTO {publishes} (catalog, version, publish_id, holder, lease_term, packs, captures, published_at_ms) \
             SELECT {catalog}, {version}, {publish_id}, {holder}, {term}, {pack_count}, {capture_count}, {now} \
             FROM system.one WHERE {fence} AND \
             (SELECT max(version) FROM {publishes} WHERE catalog = {catalog} AND version >= {previous}) = {previous}",
            publishes = self.tables.publishes,
            catalog = self.catalog_literal(),
            publish_id = sql_string_literal(&publish_id.to_string()),
            holder = sql_string_literal(&permit.holder),
            term = permit.term,
            now = server_now_ms_expr(&self.client),
            fence = permit.fence,
            previous = version - 1,
        );
        let statement_cap = self.lease.timings().statement_cap();
        // Forgotten until this commit is known to have landed.
        self.remember_commit(None);
        let unknown = |error: CatalogError| {
            let lease_id = permit.lease_id.clone();
            *self.unresolved.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(Unresolved { version, publish_id, lease_id });
            self.lease.report_unknown_outcome(&error.to_string());
            PublishError::OutcomeUnknown(error)
        };
        let Some(in_flight) = self.lease.commit_sent() else { return Err(PublishError::NoLease) };
        let sent = match self.client.execute_deciding(&sql, statement_cap).await {
            Ok(()) => Ok(()),
            Err(error) if error.kind == ErrorKind::DefinitelyFailed => Err(PublishError::Catalog(error)),
            Err(error) => Err(unknown(error)),
        };
        in_flight.answered();
        sent?;
        match self.read_back(version, publish_id).await {
            Ok(Some(committed)) => {
                debug_assert_eq!(committed, version);
                self.remember_commit(Some((permit.tenure, version)));
                self.lease.note_commit(permit);
                self.in_doubt.committed();
                tracing::info!(version, %publish_id, packs = pack_count, captures = capture_count, "published");
                Ok(())
            }
            Ok(None) => {
                self.lease.report_fence_refused();
                Err(PublishError::NotCommitted)
            }
            Err(error) => Err(unknown(error)),
        }
    }

    async fn stamp_at_least(&self, version: u32) -> Result<(), CatalogError> {
        use std::sync::atomic::Ordering;
        if self.stamped.load(Ordering::Relaxed) < version {
            super::schema::stamp_at_least(&self.client, &self.tables, version).await?;
            self.stamped.fetch_max(version, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Rows that go into the index tables only (deletions and moves, see [`super::query`]): `by_version`, then its
    /// rows of this publish copied into `by_id` on the server (sequentially consistent: the copy may run on another
    /// replica than the insert). Either may be left an orphan by a failure before the commit, which no read sees.
    async fn insert_index_rows(&self, rows: &[CaptureRow], version: u64, publish_id: &str) -> Result<(), CatalogError> {
        self.client.insert_rows(&self.tables.by_version, rows).await?;
        let by_id_time =
            *self.by_id_time.get_or_try_init(|| super::schema::by_id_has_time(&self.client, &self.tables)).await?;
        let time = if by_id_time { ", captured_at_ns" } else { "" };
        self.client
            .execute_consistent(&format!(
                "INSERT INTO {by_id} (catalog, capture_id, version, publish_id{time}) SELECT catalog, \
                 UUIDStringToNum(capture_id), version, UUIDStringToNum(publish_id){time} FROM {by_version} \
                 WHERE catalog = {catalog} AND version = {version} AND publish_id = {publish_id}",
                by_id = self.tables.by_id,
                by_version = self.tables.by_version,
                catalog = self.catalog_literal(),
                publish_id = sql_string_literal(publish_id),
            ))
            .await
    }

    async fn insert_descriptor_rows(
        &self,
        packs: &[&PackDescriptor],
        captures: &[(&PackDescriptor, &IndexEntry)],
        version: u64,
        publish_id: Uuid,
    ) -> Result<(), CatalogError> {
        let publish_id_text = publish_id.to_string();
        let capture_rows: Vec<CaptureRow> =
            captures.iter().map(|(pack, entry)| self.row_of_entry(pack, entry, version, &publish_id_text)).collect();
        let pack_rows: Vec<PackRow> = packs.iter().map(|pack| self.pack_row(pack, version, &publish_id_text)).collect();
        self.client.insert_rows(&self.tables.captures, &capture_rows).await?;
        self.client.insert_rows(&self.tables.packs, &pack_rows).await
    }

    fn row_of_entry(&self, pack: &PackDescriptor, entry: &IndexEntry, version: u64, publish_id: &str) -> CaptureRow {
        CaptureRow {
            catalog: self.catalog.clone(),
            stream: entry.meta.stream.clone(),
            captured_at_ns: entry.meta.captured_at_ns,
            capture_id: entry.meta.capture_id.to_string(),
            pack_id: pack.summary.pack_id.to_string(),
            object_key: pack.object_key.clone(),
            record_offset: entry.record_offset,
            record_len: entry.record_len,
            payload_offset: entry.payload_offset,
            payload_len: entry.payload_len,
            crc32c: entry.crc32c,
            label_keys: entry.meta.labels.keys().cloned().collect(),
            label_values: entry.meta.labels.values().cloned().collect(),
            content_type: entry.meta.content_type.clone().unwrap_or_default(),
            version,
            publish_id: publish_id.to_string(),
        }
    }

    fn pack_row(&self, pack: &PackDescriptor, version: u64, publish_id: &str) -> PackRow {
        PackRow {
            catalog: self.catalog.clone(),
            pack_id: pack.summary.pack_id.to_string(),
            object_key: pack.object_key.clone(),
            bytes: pack.summary.bytes,
            sha256: pack.summary.sha256_hex.clone(),
            records: pack.summary.records,
            first_captured_at_ns: pack.summary.first_captured_at_ns,
            last_captured_at_ns: pack.summary.last_captured_at_ns,
            version,
            publish_id: publish_id.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::CaptureMeta;

    fn pack(pack_id: u128, ids: &[u128]) -> PackDescriptor {
        let entries = ids
            .iter()
            .enumerate()
            .map(|(at, id)| IndexEntry {
                meta: CaptureMeta {
                    capture_id: Uuid::from_u128(*id),
                    stream: "s".into(),
                    captured_at_ns: 1,
                    labels: Default::default(),
                    content_type: None,
                    source_name: None,
                },
                record_offset: at as u64 * 100,
                record_len: 100,
                payload_offset: at as u64 * 100 + 60,
                payload_len: 40,
                crc32c: 0,
            })
            .collect::<Vec<_>>();
        PackDescriptor {
            summary: PackSummary {
                pack_id: Uuid::from_u128(pack_id),
                bytes: 0,
                records: entries.len() as u64,
                sha256_hex: String::new(),
                first_captured_at_ns: 1,
                last_captured_at_ns: 1,
                created_at_ns: 1,
            },
            object_key: format!("k/{pack_id}"),
            entries,
        }
    }

    #[test]
    fn a_batch_indexes_each_id_once_as_its_last_post_by_pack_id_then_place() {
        // Given newer pack first, as no caller does but nothing forbids.
        let (newer, older) = (pack(2, &[30, 10, 40]), pack(1, &[10, 20, 10, 30]));
        let kept: Vec<(u128, u64)> = last_posts(&[&newer, &older])
            .iter()
            .map(|(pack, entry)| (pack.summary.pack_id.as_u128(), entry.record_offset))
            .collect();
        // 20 once in the older pack; 10 and 30 as posted last, in the newer pack; 40 once.
        assert_eq!(kept, [(1, 100), (2, 0), (2, 100), (2, 200)]);
        let unique = pack(3, &[1, 2, 3]);
        assert_eq!(last_posts(&[&unique]).len(), 3, "a batch without a repeated id indexes every entry");
    }
}
