//! Compaction and erasure: the lease holder merges small published packs, rewrites packs that hold deleted
//! captures without them, and removes the objects they replace once readers are done with them.
//!
//! A pass (every `lifecycle.compaction_interval`, only while this process may publish):
//! 1. Finishes the jobs a crash left in the spool's `compaction/` directory (see below).
//! 2. Plans jobs. *Erasure*: every pack holding any version of a capture deleted since the last look is rewritten,
//!    whatever its size or age. *Expiry*: every pack whose captures all lie below the retention horizon (see
//!    [`crate::pipeline::retention`]) is retired (none of its captures is visible, so nothing is copied); a pack
//!    that straddles the horizon keeps its object until a later horizon passes it whole (a few seconds of captures
//!    for a pack the spool sealed, a day for a merged one), so that no pack is rewritten at every step of the
//!    horizon. *Merging*: committed packs smaller than
//!    `compaction_small_pack_bytes` created more than `compaction_min_age` ago are grouped by the UTC day of their
//!    first capture. While the day is open (it may still get packs), packs of one size tier (a factor of 4 apart)
//!    are merged once 4 of them are there, so each byte is rewritten about once per tier rather than once per
//!    pass; once the day is over, its small packs are merged into as few as fit. Jobs hold up to
//!    `spool.pack_max_bytes`, 1,000 packs and 20,000 captures. Retired packs are left out. A pass reads about
//!    `compaction_pass_bytes` of packs (one job at least; an erasure's size is known once its index is read).
//! 3. Runs each job: reads its source packs' index from the bucket, keeps the captures whose newest committed row
//!    is still in that pack (a deleted or superseded capture is not copied: that is the erasure), copies their
//!    records (CRC checked) into a new pack in the spool, uploads it under its compacted key (which reconcile
//!    never publishes), and switches the captures to it with one fenced publish
//!    ([`Publisher::publish_relocation`]) that also retires the sources. A job with nothing left to copy only
//!    retires its sources.
//! 4. Removes the objects of retired packs whose switch-over is older than `lifecycle.read_grace` (see
//!    [`crate::catalog::retired`]).
//! 5. With `lifecycle.purge`, drops the months wholly below a retention horizon whose publish is older than
//!    `read_grace` from the tables (partitioned tables only), and removes the catalog rows of deleted captures whose bytes are erased (every deletion
//!    up to the oldest one a pending erasure comes from) and whose deletion is older than `read_grace`, in batches
//!    of mutations, none while an earlier one is still running (see [`crate::catalog::purge`]). The rows go only
//!    after the erasure, because they are how erasure finds the packs a deleted capture was in.
//!
//! Readers see every capture byte-identical throughout: before the switch at its old place, from the switch's
//! version on at its new one, and a reader pinned below the switch keeps reading the old object for the grace
//! period. The spin model `specs/compaction.pml` checks that a reader sees each capture exactly once while its pack
//! moves.
//!
//! States of a job in the spool (`compaction/<new pack id>.json`, the sources, written durably first; then
//! `<new pack id>.cpk`, the new pack): *writing* (the pack file torn or missing: never uploaded, removed by the
//! next pass), *staged* (the pack complete: it may be in the bucket; the next pass uploads it again, which is
//! idempotent, and publishes the switch), *done* (switched, or found changed and its object deleted: files
//! removed, pack file first). The switch decides by the catalog alone: a capture whose newest row names the new
//! pack is switched; so a switch whose answer was lost (or whose process was killed) is found switched, and one
//! that can no longer be made (a capture deleted or posted again since) is dropped with its object, which no
//! committed row names. Invariants: no object is deleted while a committed row that a reader at or above the
//! current watermark could read names it; a new pack is named by the catalog only through its switch.
//!
//! Progress, kept in the spool (`compaction/progress.json`, written durably after each pass that moved it): the
//! version up to which deletions were read and the packs they name still to rewrite, the pack id below which small
//! packs were looked at (held back to the oldest pack of an open day left unmerged, and of a job a change undid),
//! the version up to which retired objects are removed, and the version up to which deleted rows are purged. So a
//! restart goes on where the last pass stopped instead of reading the catalog's history again. Each is a bound the
//! catalog's history only moves past, so a copy written before another holder compacted is still true; a copy whose
//! anchor (the publish at its highest version) the catalog does not hold, a catalog recreated or another one, is
//! dropped at the first pass, which then reads from the start (O(history), as after a lost spool). An orphan
//! compacted object whose spool was lost with its host stays in the bucket (`capstore reconcile` leaves every
//! compacted pack alone and counts them).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use uuid::Uuid;

use super::PipelineCounters;
use crate::bucket::{pack_of_key, Bucket, BucketErrorKind};
use crate::catalog::publish::{PackDescriptor, PublishError, Publisher, Relocation, RelocationOutcome, SourcePack};
use crate::catalog::purge::RowPurge;
use crate::catalog::query::{CatalogReader, PackBrief};
use crate::catalog::retired::RetiredPacks;
use crate::pack::{decode_record, IndexEntry, PackFile, PackWriter};

/// Packs of one job at most (their retirements are one INSERT, their ids one statement).
const SOURCES_PER_JOB: usize = 1000;
/// Captures of one job at most: its switch re-checks each inside the publish turn, which other publishes wait for.
const RECORDS_PER_JOB: u64 = 20_000;
/// Packs of one size tier merged together while their day is open (see [`Compactor::tier_of`]).
const TIER_FAN_IN: usize = 4;
/// Small packs read from the catalog per request while planning.
const SMALL_PACKS_PER_READ: u64 = 10_000;
/// Deletion publishes read per request while planning.
const DELETIONS_PER_READ: u64 = 1000;
/// Retired packs removed per catalog request.
const REMOVALS_PER_READ: u64 = 1000;
/// The compactor's progress in its staging directory (not a job: its stem is no pack id).
const PROGRESS_FILE: &str = "progress.json";
/// Batches of row removal a pass looks at most (one found purged already costs two reads and no mutation).
const PURGE_READS_PER_PASS: usize = 200;
/// How long row removal waits for a running mutation before it says so in the log.
const PURGE_PATIENCE: Duration = Duration::from_secs(3600);
/// Deleted captures whose rows a pass removes at most: about 29 M a day at the default interval.
const PURGE_CAPTURES_PER_PASS: u64 = 100_000;
/// Bytes of records read from the bucket at once while copying.
const COPY_CHUNK_BYTES: u64 = 16 << 20;

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CompactionPass {
    /// Packs replaced by a committed switch-over (merged, rewritten or retired).
    pub packs_replaced: u64,
    /// New packs switched to.
    pub packs_written: u64,
    /// Bytes of captures copied into new packs.
    pub bytes_rewritten: u64,
    /// Objects of retired packs removed from the bucket.
    pub objects_removed: u64,
    /// Deleted captures whose catalog rows removal was started for.
    pub captures_purged: u64,
    /// Partitions of months below the retention horizon dropped.
    pub partitions_dropped: u64,
    /// The pass stopped at `compaction_pass_bytes`: more is due.
    pub more_due: bool,
}

/// A planned job: packs of one day to replace by one new pack.
#[derive(Debug, Clone)]
struct Job {
    sources: Vec<PackBrief>,
}

/// The compactor's progress, as it works on it and as the spool keeps it (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Progress {
    /// The publish (version, publish_id) at [`Progress::highest_version`], which the catalog must hold (set when
    /// written to the spool).
    anchor: Option<(u64, String)>,
    /// Deletions published at or below this version are planned for.
    deletions_read_through: u64,
    /// Packs named by deletions, still to rewrite: pack id -> (key, a version every deletion naming it is above).
    to_erase: BTreeMap<Uuid, (String, u64)>,
    /// Every small pack with an id below this was planned for by an earlier pass.
    small_packs_from: String,
    /// Every retired pack at or below this version is removed (a lower bound that keeps the removal read short).
    removed_through: u64,
    /// The rows of every capture deleted at or below this version are removed (or being removed).
    purged_through: u64,
    /// Every pack with an id below this lies wholly below the retention horizon and was planned for, or holds a
    /// capture at or after it (absent in the progress of an older build).
    #[serde(default)]
    horizon_packs_from: String,
}

impl Progress {
    /// The highest catalog version the progress names.
    fn highest_version(&self) -> u64 {
        self.deletions_read_through.max(self.removed_through).max(self.purged_through)
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct StagedPlan {
    sources: Vec<SourcePack>,
    source_captures: Vec<Uuid>,
}

pub struct Compactor {
    publisher: Arc<Publisher>,
    catalog: CatalogReader,
    retired: RetiredPacks,
    bucket: Arc<Bucket>,
    counters: Arc<PipelineCounters>,
    staging: PathBuf,
    interval: Duration,
    small_pack_bytes: u64,
    min_age: Duration,
    pass_bytes: u64,
    target_bytes: u64,
    read_grace: Duration,
    /// Removes deleted captures' rows; `None` with `lifecycle.purge` off.
    purge: Option<RowPurge>,
    /// Since when row removal has waited for a mutation still running.
    purge_waiting_since: Option<std::time::Instant>,
    /// Where the work stands.
    progress: Progress,
    /// The progress last written to the spool (or read from it, not yet checked against the catalog).
    saved: Progress,
    /// The progress read from the spool was checked against the catalog (or there was none).
    progress_checked: bool,
    /// The last plan read a full page of packs below the horizon: more may be due at once.
    expiry_backlog: bool,
    /// (month, watermark) of the last check before a drop that found no capture posted again across months: until
    /// the horizon's month moves on, only captures published above that watermark can be found later.
    drop_checked: Option<(u32, u64)>,
}

impl Compactor {
    /// A compactor publishing through `pipeline`'s publisher, staging in its spool; `None` when
    /// `lifecycle.compaction` is off.
    pub fn for_pipeline(
        pipeline: &super::Pipeline,
        catalog: CatalogReader,
        retired: RetiredPacks,
        purge: RowPurge,
    ) -> Option<Compactor> {
        let lifecycle = &pipeline.config.lifecycle;
        if !lifecycle.compaction {
            return None;
        }
        let saved = match std::fs::read(pipeline.paths.compaction.join(PROGRESS_FILE)) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|error| {
                tracing::warn!(%error, "the compaction progress in the spool is unreadable; starting from the beginning");
                Progress::default()
            }),
            Err(_) => Progress::default(),
        };
        Some(Compactor {
            publisher: pipeline.publisher.clone(),
            catalog,
            retired,
            bucket: pipeline.bucket.clone(),
            counters: pipeline.counters.clone(),
            staging: pipeline.paths.compaction.clone(),
            interval: lifecycle.compaction_interval.0,
            small_pack_bytes: lifecycle.compaction_small_pack_bytes.0,
            min_age: lifecycle.compaction_min_age.0,
            pass_bytes: lifecycle.compaction_pass_bytes.0,
            target_bytes: pipeline.config.spool.pack_max_bytes.0,
            read_grace: lifecycle.read_grace.0,
            purge: lifecycle.purge.then_some(purge),
            purge_waiting_since: None,
            progress: saved.clone(),
            saved,
            progress_checked: false,
            expiry_backlog: false,
            drop_checked: None,
        })
    }

    /// The publish at exactly `version` (`None` for version 0 or one the catalog does not hold).
    async fn publish_at(&self, version: u64) -> anyhow::Result<Option<(u64, String)>> {
        if version == 0 {
            return Ok(None);
        }
        let publishes = self.catalog.publishes_after(version - 1, 1).await?;
        Ok(publishes.into_iter().find(|publish| publish.version == version).map(|p| (p.version, p.publish_id)))
    }

    /// Drop the progress read from the spool unless the catalog holds its anchor publish.
    async fn check_progress(&mut self) -> anyhow::Result<()> {
        if self.progress_checked {
            return Ok(());
        }
        let highest = self.saved.highest_version();
        let holds = match self.saved.anchor.clone() {
            Some((version, publish_id)) => {
                self.publish_at(version).await?.is_some_and(|(_, found)| found == publish_id)
            }
            None => highest == 0,
        };
        if !holds {
            tracing::info!(
                version = highest,
                "the compaction progress in the spool is not of this catalog; reading the catalog from the start"
            );
            (self.progress, self.saved) = (Progress::default(), Progress::default());
        }
        self.progress_checked = true;
        Ok(())
    }

    /// Write the progress to the spool if it moved since the last write.
    async fn save_progress(&mut self) -> anyhow::Result<()> {
        let mut progress = self.progress.clone();
        let highest = progress.highest_version();
        progress.anchor = self.saved.anchor.clone().filter(|(version, _)| *version == highest);
        if progress.anchor.is_none() {
            progress.anchor = self.publish_at(highest).await?;
        }
        if progress == self.saved {
            return Ok(());
        }
        let (path, bytes) = (self.staging.join(PROGRESS_FILE), serde_json::to_vec(&progress)?);
        blocking(move || crate::durable::write_file_durable(&path, &bytes)).await?;
        self.saved = progress;
        Ok(())
    }

    /// One pass; see the module doc.
    pub async fn pass(&mut self, stopping: &tokio::sync::watch::Receiver<bool>) -> anyhow::Result<CompactionPass> {
        let mut pass = CompactionPass::default();
        self.check_progress().await?;
        // Removals first: a job that keeps failing must not hold back the removal of what earlier jobs replaced.
        self.remove_due_objects(&mut pass).await?;
        self.finish_staged_jobs(&mut pass).await?;
        let (jobs, mut small_packs_next, mut horizon_packs_next) = self.plan().await?;
        let mut budget = self.pass_bytes;
        let (mut all_planned, mut ran_one) = (true, false);
        for job in jobs {
            let bytes: u64 = job.sources.iter().map(|source| source.bytes).sum();
            if *stopping.borrow() || (ran_one && (budget == 0 || bytes > budget)) {
                all_planned = false;
                pass.more_due = !*stopping.borrow();
                break;
            }
            // (An erasure's pack size is known once its index is read: it is charged then.) A job that fails (a
            // damaged source record, the bucket away) is tried again by the next pass; the others go on.
            let (read, replaced) = match self.compact(&job, &mut pass).await {
                Ok(done) => done,
                Err(error) if error.downcast_ref::<PublishError>().is_some() => return Err(error),
                Err(error) => {
                    tracing::warn!(error = %format!("{error:#}"), packs = job.sources.len(), "a compaction job failed; the next pass tries it again");
                    (0, false)
                }
            };
            ran_one = true;
            budget = budget.saturating_sub(read.max(bytes));
            if replaced {
                for source in &job.sources {
                    if let Ok(id) = Uuid::parse_str(&source.pack_id) {
                        self.progress.to_erase.remove(&id);
                    }
                }
            } else if let Some(first) = job.sources.iter().map(|source| &source.pack_id).min() {
                // Changed under the copy (or failed): planned again from the catalog by the next pass.
                small_packs_next = small_packs_next.min(first.clone());
                horizon_packs_next = horizon_packs_next.min(first.clone());
            }
        }
        if all_planned {
            self.progress.small_packs_from = small_packs_next;
            self.progress.horizon_packs_from = horizon_packs_next;
            pass.more_due |= self.expiry_backlog;
        }
        // A purge that fails (a statement refused, the catalog away) is tried again by the next pass.
        if let Err(error) = self.purge_rows(&mut pass, stopping).await {
            tracing::warn!(error = %format!("{error:#}"), "removing deleted captures' rows failed; the next pass tries again");
        }
        self.save_progress().await?;
        if pass != CompactionPass::default() {
            tracing::info!(
                packs_replaced = pass.packs_replaced,
                packs_written = pass.packs_written,
                bytes_rewritten = pass.bytes_rewritten,
                objects_removed = pass.objects_removed,
                captures_purged = pass.captures_purged,
                partitions_dropped = pass.partitions_dropped,
                "compaction pass"
            );
        }
        Ok(pass)
    }

    /// The jobs due now (expiries, erasures, merges), and the pack ids the next pass reads small packs and packs
    /// below the horizon from.
    async fn plan(&mut self) -> anyhow::Result<(Vec<Job>, String, String)> {
        // Packs named by deletions since the last look.
        loop {
            let (deleted, through) =
                self.catalog.deleted_after(self.progress.deletions_read_through, DELETIONS_PER_READ).await?;
            for key in self.catalog.objects_holding(&deleted).await? {
                match pack_of_key(&key) {
                    Some((pack_id, _)) => {
                        self.progress.to_erase.entry(pack_id).or_insert((key, self.progress.deletions_read_through));
                    }
                    // Not a pack key capstore writes: nothing here can rewrite it, and the deleted rows naming it
                    // are removed all the same.
                    None => tracing::warn!(%key, "a deleted capture is in an object that is not a pack; not erased"),
                }
            }
            if through == self.progress.deletions_read_through {
                break;
            }
            self.progress.deletions_read_through = through;
        }
        let erase_ids: Vec<Uuid> = self.progress.to_erase.keys().copied().collect();
        for retired in self.retired_among(&erase_ids).await? {
            self.progress.to_erase.remove(&retired);
        }

        let (mut jobs, horizon_packs_next) = self.plan_expiry().await?;
        let expiring: std::collections::HashSet<String> =
            jobs.iter().flat_map(|job| job.sources.iter().map(|source| source.pack_id.clone())).collect();

        let until = uuid_v7_text_floor(crate::util::now_ns().saturating_sub(self.min_age.as_nanos() as u64));
        let mut small = Vec::new();
        let mut from = self.progress.small_packs_from.clone();
        loop {
            let page = self.catalog.small_packs(self.small_pack_bytes, &from, &until, SMALL_PACKS_PER_READ).await?;
            let Some(last) = page.last() else { break };
            from = format!("{}\u{0}", last.pack_id);
            let full = page.len() as u64 == SMALL_PACKS_PER_READ;
            small.extend(page.into_iter().filter(|pack| !expiring.contains(&pack.pack_id)));
            if !full {
                break;
            }
        }
        // Erasures: one job per pack (its size is whatever it is). A small pack named by a deletion is merged
        // instead, which erases as well.
        let small_ids: std::collections::HashSet<&str> = small.iter().map(|pack| pack.pack_id.as_str()).collect();
        for (pack_id, (key, _)) in &self.progress.to_erase {
            let pack_id_text = pack_id.to_string();
            if !small_ids.contains(pack_id_text.as_str()) && !expiring.contains(&pack_id_text) {
                let brief = PackBrief {
                    pack_id: pack_id.to_string(),
                    object_key: key.clone(),
                    bytes: 0,
                    records: 0,
                    first_captured_at_ns: 0,
                };
                jobs.push(Job { sources: vec![brief] });
            }
        }
        let must: std::collections::HashSet<String> = self.progress.to_erase.keys().map(Uuid::to_string).collect();
        let mut by_day: BTreeMap<u64, Vec<PackBrief>> = BTreeMap::new();
        for pack in small {
            by_day.entry(pack.first_captured_at_ns / NS_PER_DAY).or_default().push(pack);
        }
        // Where the next pass starts reading small packs: past everything planned here, except the packs left
        // unmerged in a day that may still get more (today's, mostly), which must be read again to be merged with
        // them. A day is over once its end is older than the minimum age.
        let now_ns = crate::util::now_ns();
        let mut next_from = until;
        for (day, packs) in by_day {
            let day_open = ((day + 1) * NS_PER_DAY).saturating_add(self.min_age.as_nanos() as u64) > now_ns;
            // Size tiers while the day is open (each byte is rewritten about once per tier, not once per pass);
            // once it is over, whatever is left small is merged into as few packs as fit.
            let mut tiers: BTreeMap<u32, Vec<PackBrief>> = BTreeMap::new();
            for pack in packs {
                let tier = if day_open { self.tier_of(pack.bytes) } else { 0 };
                tiers.entry(tier).or_default().push(pack);
            }
            for (_, packs) in tiers {
                let erasing = packs.iter().any(|pack| must.contains(&pack.pack_id));
                if day_open && packs.len() < TIER_FAN_IN && !erasing {
                    if let Some(first) = packs.first() {
                        next_from = next_from.min(first.pack_id.clone());
                    }
                    continue;
                }
                for group in self.groups_of(packs) {
                    if group.len() > 1 || group.iter().any(|pack| must.contains(&pack.pack_id)) {
                        jobs.push(Job { sources: group });
                    } else if let Some(alone) = group.first().filter(|_| day_open) {
                        next_from = next_from.min(alone.pack_id.clone());
                    }
                }
            }
        }
        Ok((jobs, next_from, horizon_packs_next))
    }

    /// The packs wholly below the catalog's retention horizon, not retired yet, as jobs that retire them (up to
    /// [`SOURCES_PER_JOB`] packs and [`RECORDS_PER_JOB`] captures each: a job reads each source's index and checks
    /// each capture, but copies nothing), and where the next look starts. Reads the packs from
    /// `horizon_packs_from` on; the next look starts at the lowest pack still holding a capture at or after the
    /// horizon. (A pack published long after it was made, with an id below that mark already, is left to the
    /// merging of small packs, which copies none of its hidden captures either.)
    async fn plan_expiry(&mut self) -> anyhow::Result<(Vec<Job>, String)> {
        self.expiry_backlog = false;
        let horizon = self.catalog.horizons(u64::MAX).await?.before_at(u64::MAX);
        if horizon == 0 {
            return Ok((Vec::new(), self.progress.horizon_packs_from.clone()));
        }
        // One read of packs per pass at most (a first horizon over a long history finds them by the million): a
        // full read leaves the rest to the next pass, which runs at once.
        let from = self.progress.horizon_packs_from.clone();
        let (below, lowest_above) = self.catalog.packs_below(horizon, &from, SMALL_PACKS_PER_READ).await?;
        self.expiry_backlog = below.len() as u64 == SMALL_PACKS_PER_READ;
        // The next look starts at the lowest pack not below yet, or past the last one planned here.
        let past_page = below.last().map(|last| format!("{}\u{0}", last.pack_id));
        let next_from = lowest_above.into_iter().chain(past_page).min().unwrap_or(from);
        let mut jobs = Vec::new();
        let (mut sources, mut records) = (Vec::new(), 0);
        for mut pack in below {
            if !sources.is_empty() && (sources.len() >= SOURCES_PER_JOB || records + pack.records > RECORDS_PER_JOB) {
                jobs.push(Job { sources: std::mem::take(&mut sources) });
                records = 0;
            }
            records += pack.records;
            // Nothing is copied: the pass's byte budget is not charged.
            pack.bytes = 0;
            sources.push(pack);
        }
        if !sources.is_empty() {
            jobs.push(Job { sources });
        }
        if !jobs.is_empty() {
            tracing::info!(jobs = jobs.len(), horizon, "packs below the retention horizon to retire");
        }
        Ok((jobs, next_from))
    }

    /// A pack's size tier: 0 below 1/256 of the small-pack size, then one more per factor of [`TIER_FAN_IN`].
    fn tier_of(&self, bytes: u64) -> u32 {
        let base = (self.small_pack_bytes / 256).max(1);
        let mut tier = 0;
        let mut bound = base;
        while bytes >= bound.saturating_mul(TIER_FAN_IN as u64) && tier < 16 {
            bound = bound.saturating_mul(TIER_FAN_IN as u64);
            tier += 1;
        }
        tier
    }

    /// `packs` (in id order) cut into jobs of up to `spool.pack_max_bytes`, [`SOURCES_PER_JOB`] packs and
    /// [`RECORDS_PER_JOB`] captures.
    fn groups_of(&self, packs: Vec<PackBrief>) -> Vec<Vec<PackBrief>> {
        let mut groups: Vec<Vec<PackBrief>> = vec![Vec::new()];
        let (mut bytes, mut records) = (0, 0);
        for pack in packs {
            let group = groups.last_mut().expect("one group at least");
            let full = bytes + pack.bytes > self.target_bytes
                || records + pack.records > RECORDS_PER_JOB
                || group.len() >= SOURCES_PER_JOB;
            if !group.is_empty() && full {
                groups.push(Vec::new());
                (bytes, records) = (0, 0);
            }
            bytes += pack.bytes;
            records += pack.records;
            groups.last_mut().expect("just pushed").push(pack);
        }
        groups
    }

    async fn retired_among(&self, ids: &[Uuid]) -> anyhow::Result<std::collections::HashSet<Uuid>> {
        let mut retired = std::collections::HashSet::new();
        for chunk in ids.chunks(SOURCES_PER_JOB) {
            retired.extend(self.retired.committed_among(chunk).await?);
        }
        Ok(retired)
    }

    /// Copy the live captures of `job`'s sources into a new pack and switch them to it (or only retire the
    /// sources when none is live). Returns the bytes of the source packs, and whether they are replaced now (false
    /// when a capture changed under the copy: the job is planned again).
    async fn compact(&self, job: &Job, pass: &mut CompactionPass) -> anyhow::Result<(u64, bool)> {
        let mut sources = Vec::new();
        let mut source_bytes = 0;
        let mut indexes = Vec::new();
        for brief in &job.sources {
            let Ok(pack_id) = Uuid::parse_str(&brief.pack_id) else { continue };
            match self.bucket.read_pack_index(&brief.object_key).await {
                Ok(remote) => {
                    source_bytes += remote.size;
                    indexes.push((pack_id, brief.object_key.clone(), remote.entries))
                }
                Err(error) if error.kind == BucketErrorKind::NotFound => {
                    // Only a pack no capture is left in can go missing (its retirement's removal): leave it out.
                    tracing::warn!(key = %brief.object_key, "a pack to compact is not in the bucket; left alone");
                    continue;
                }
                Err(error) => return Err(error.into()),
            }
            sources.push(SourcePack { pack_id, object_key: brief.object_key.clone() });
        }
        if sources.is_empty() {
            return Ok((source_bytes, true));
        }
        let source_captures = crate::util::unique_ids(
            &indexes
                .iter()
                .flat_map(|(_, _, entries)| entries.iter().map(|entry| entry.meta.capture_id))
                .collect::<Vec<_>>(),
        );
        let newest = self.catalog.newest_rows(&source_captures).await?;
        let live: Vec<(String, Vec<IndexEntry>)> = indexes
            .into_iter()
            .map(|(pack_id, key, entries)| {
                let pack_id = pack_id.to_string();
                let kept = entries
                    .into_iter()
                    .filter(|entry| {
                        newest.get(&entry.meta.capture_id).is_some_and(|row| {
                            row.pack_id == pack_id
                                && row.crc32c == entry.crc32c
                                && row.record_offset == entry.record_offset
                        })
                    })
                    .collect();
                (key, kept)
            })
            .collect();
        if live.iter().all(|(_, entries)| entries.is_empty()) {
            let relocation = Relocation { new_pack: None, sources, source_captures };
            let outcome = self.switch(relocation.clone()).await?;
            if let RelocationOutcome::Switched { version, .. } = outcome {
                tracing::info!(version, packs = relocation.sources.len(), "retired packs left with no capture");
                self.count_switch(&relocation, pass);
            }
            // Only their indexes were read: nothing is charged to the pass's byte budget.
            return Ok((0, !matches!(outcome, RelocationOutcome::Changed { .. })));
        }

        let new_pack_id = Uuid::now_v7();
        let (plan_path, pack_path) = self.staged_paths(new_pack_id);
        let plan = serde_json::to_vec(&StagedPlan { sources, source_captures })?;
        blocking(move || crate::durable::write_file_durable(&plan_path, &plan)).await?;
        let mut writer = {
            let pack_path = pack_path.clone();
            blocking(move || {
                PackWriter::create(&pack_path, new_pack_id, crate::util::now_ns()).map_err(std::io::Error::other)
            })
            .await?
        };
        for (key, entries) in &live {
            for chunk in chunks_of(entries, COPY_CHUNK_BYTES) {
                let ranges: Vec<_> = chunk.iter().map(IndexEntry::record_range).collect();
                let records = self.bucket.read_ranges(key, &ranges).await?;
                anyhow::ensure!(
                    records.len() == chunk.len(),
                    "{key}: {} records read of {}",
                    records.len(),
                    chunk.len()
                );
                let (chunk, key) = (chunk.to_vec(), key.clone());
                // Off the runtime: appends write the file.
                writer = tokio::task::spawn_blocking(move || -> anyhow::Result<PackWriter> {
                    for (entry, record) in chunk.iter().zip(records) {
                        let (meta, payload) = decode_record(&record, entry)
                            .map_err(|error| anyhow::anyhow!("{key}: capture {}: {error}", entry.meta.capture_id))?;
                        writer.append(&meta, Bytes::from(payload))?;
                    }
                    Ok(writer)
                })
                .await??;
            }
        }
        let summary = blocking(move || writer.finish().map_err(std::io::Error::other)).await?;
        tracing::debug!(pack_id = %new_pack_id, bytes = summary.bytes, "compacted pack written");
        let replaced = self.finish_staged_job(new_pack_id, pass).await?;
        Ok((source_bytes, replaced))
    }

    /// Jobs a crash (or a failed switch) left staged: each is finished or dropped (see the module doc).
    async fn finish_staged_jobs(&self, pass: &mut CompactionPass) -> anyhow::Result<()> {
        let mut staged = Vec::new();
        for entry in std::fs::read_dir(&self.staging)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            let Some((stem, extension)) = name.rsplit_once('.') else { continue };
            let Ok(pack_id) = Uuid::parse_str(stem) else { continue };
            match extension {
                "json" => staged.push(pack_id),
                // A pack without its plan: the plan is written first and removed last, so it was never uploaded.
                "cpk" if !self.staged_paths(pack_id).0.exists() => {
                    crate::durable::remove_durable(&self.staged_paths(pack_id).1)?
                }
                _ => {}
            }
        }
        for pack_id in staged {
            self.finish_staged_job(pack_id, pass).await?;
        }
        Ok(())
    }

    /// Upload the staged pack `new_pack_id` (again: idempotent), switch to it, and remove its files; a pack that
    /// was never completed is only removed.
    async fn finish_staged_job(&self, new_pack_id: Uuid, pass: &mut CompactionPass) -> anyhow::Result<bool> {
        let (plan_path, pack_path) = self.staged_paths(new_pack_id);
        let plan: StagedPlan = serde_json::from_slice(&std::fs::read(&plan_path)?)?;
        let opened = {
            let pack_path = pack_path.clone();
            blocking(move || PackFile::open(&pack_path).map_err(std::io::Error::other)).await
        };
        let Ok(pack) = opened else {
            // Torn or missing: written no further than the spool.
            self.remove_staged(new_pack_id).await?;
            return Ok(false);
        };
        let summary = pack.summary();
        let key = self.bucket.compacted_pack_key(&summary);
        self.bucket.upload_pack_to(&pack_path, &summary, key.clone()).await?;
        crate::failpoint::hit("after_compacted_upload");
        let object_key = key.to_string();
        let new_pack = PackDescriptor { summary, object_key: object_key.clone(), entries: pack.entries().to_vec() };
        let relocation =
            Relocation { new_pack: Some(new_pack), sources: plan.sources, source_captures: plan.source_captures };
        let outcome = self.switch(relocation.clone()).await?;
        match &outcome {
            RelocationOutcome::Switched { version, moved } => {
                crate::failpoint::hit("after_switch_commit");
                let (version, moved) = (*version, *moved);
                tracing::info!(version, moved, packs = relocation.sources.len(), key = %object_key, "packs compacted");
                self.count_switch(&relocation, pass);
            }
            RelocationOutcome::AlreadySwitched => {}
            RelocationOutcome::Changed { changed } => {
                tracing::info!(
                    changed = changed.len(),
                    key = %object_key,
                    "captures changed while being compacted; the compacted pack is dropped, the next pass plans again"
                );
                self.bucket.delete_object(&object_key).await?;
            }
        }
        self.remove_staged(new_pack_id).await?;
        Ok(!matches!(outcome, RelocationOutcome::Changed { .. }))
    }

    /// The switch-over publish, on a task of its own: a pass cut short (the shutdown) must not cut a publish
    /// between its statement and its read-back.
    async fn switch(&self, relocation: Relocation) -> anyhow::Result<RelocationOutcome> {
        let publisher = self.publisher.clone();
        let outcome = tokio::spawn(async move { publisher.publish_relocation(&relocation).await })
            .await
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic.into_panic()))?;
        Ok(outcome)
    }

    fn count_switch(&self, relocation: &Relocation, pass: &mut CompactionPass) {
        let replaced = relocation.sources.len() as u64;
        pass.packs_replaced += replaced;
        self.counters.packs_compacted.fetch_add(replaced, Ordering::Relaxed);
        if let Some(pack) = &relocation.new_pack {
            let bytes: u64 = pack.entries.iter().map(|entry| entry.record_len).sum();
            pass.packs_written += 1;
            pass.bytes_rewritten += bytes;
            self.counters.compaction_bytes_rewritten.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Remove the objects of retired packs whose grace period is over, recording each removal.
    async fn remove_due_objects(&mut self, pass: &mut CompactionPass) -> anyhow::Result<()> {
        loop {
            let due = self.retired.due(self.read_grace, self.progress.removed_through, REMOVALS_PER_READ).await?;
            let Some(last) = due.last() else { return Ok(()) };
            let full = due.len() as u64 == REMOVALS_PER_READ;
            for pack in &due {
                self.bucket.delete_object(&pack.object_key).await?;
                crate::failpoint::hit("during_object_deletion");
                pass.objects_removed += 1;
                self.counters.objects_removed.fetch_add(1, Ordering::Relaxed);
            }
            self.retired.mark_removed(&due).await?;
            // Removed rows are never read as due again; a cut inside one version reads that version again.
            self.progress.removed_through = if full { last.version.saturating_sub(1) } else { last.version };
            if !full {
                return Ok(());
            }
        }
    }

    /// Remove the rows of deleted captures whose bytes are erased and whose deletion is older than the grace (see
    /// the module doc): batches of mutations, none started while one on the tables is still running (they would
    /// queue on the server, each rewriting the same parts). Batches found purged already (after a restart) cost two
    /// reads each and no mutation.
    async fn purge_rows(
        &mut self,
        pass: &mut CompactionPass,
        stopping: &tokio::sync::watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let Some(purge) = self.purge.clone() else { return Ok(()) };
        if purge.drops_months() {
            // A drop that fails (a partition larger than the server's max_partition_size_to_drop, say) must not hold
            // back the removal of deleted captures' rows below.
            if let Err(error) = self.drop_below_horizon(&purge, pass).await {
                tracing::error!(
                    error = %format!("{error:#}"),
                    "cannot drop the months below the retention horizon; the next pass tries again (see the \
                     server's log; a partition over max_partition_size_to_drop needs that setting raised)"
                );
            }
        }
        // Erased: every deletion up to the oldest one a pack still to rewrite comes from (a rewrite that keeps
        // failing, logged each pass, holds back the rows of later deletions too).
        let erased_through = self
            .progress
            .to_erase
            .values()
            .map(|(_, after)| *after)
            .min()
            .unwrap_or(self.progress.deletions_read_through);
        for _ in 0..PURGE_READS_PER_PASS {
            if self.progress.purged_through >= erased_through
                || *stopping.borrow()
                || pass.captures_purged >= PURGE_CAPTURES_PER_PASS
            {
                self.purge_waiting_since = None;
                return Ok(());
            }
            let Some(batch) = purge.next_batch(self.progress.purged_through, erased_through, self.read_grace).await?
            else {
                self.purge_waiting_since = None;
                return Ok(());
            };
            if !batch.captures.is_empty() {
                if purge.in_flight().await? {
                    let since = *self.purge_waiting_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() > PURGE_PATIENCE {
                        tracing::warn!(
                            waited = ?since.elapsed(),
                            "removing deleted captures' rows waits for a mutation of the catalog tables that is still \
                             running: see system.mutations (a mutation that fails is retried by the server forever)"
                        );
                    }
                    return Ok(());
                }
                self.purge_waiting_since = None;
                purge.remove(&batch, || crate::failpoint::hit("during_row_purge")).await?;
                tracing::info!(
                    captures = batch.captures.len(),
                    through_version = batch.through,
                    "removing deleted captures' rows"
                );
            }
            self.progress.purged_through = batch.through;
            pass.captures_purged += batch.captures.len() as u64;
            self.counters.captures_purged.fetch_add(batch.captures.len() as u64, Ordering::Relaxed);
        }
        // Out of reads with more to look at (catching up after a start): the next pass runs at once.
        pass.more_due = true;
        Ok(())
    }

    /// Drop the months wholly below the newest horizon that is older than the grace (see
    /// [`crate::catalog::purge`]). A capture whose newest row lies in such a month but that has an older row in a
    /// later one (posted again with an earlier time) first has its rows below the newest removed, and the drop
    /// waits for that removal's mutations: the older row would otherwise be the newest once the month is gone.
    async fn drop_below_horizon(&mut self, purge: &RowPurge, pass: &mut CompactionPass) -> anyhow::Result<()> {
        let (_, month) = purge.due_horizon(self.read_grace).await?;
        if month == 0 {
            return Ok(());
        }
        let partitions = purge.months_before(month).await?;
        if partitions.is_empty() || purge.in_flight().await? {
            return Ok(());
        }
        // Late arrivals below the horizon make months to drop again: the check that comes next pass after pass looks
        // only at what was published since the last one that found nothing.
        let published_after = self.drop_checked.filter(|(checked, _)| *checked == month).map_or(0, |(_, at)| at);
        let watermark = purge.watermark().await?;
        let superseded = purge.superseded_across(month, published_after).await?;
        if !superseded.is_empty() {
            return remove_superseded(purge, superseded).await;
        }
        // The drop in the publish turn, after a second check of what was published since the first: a publish between
        // its rows and its commit would otherwise lose its rows to the drop, and a capture it posts again with an
        // expired time would be back as its older row, in a month that stays. (A removal the second check calls for
        // runs after the turn: it takes only rows below a capture's newest, and may take minutes.)
        crate::failpoint::pause("after_drop_check").await;
        let Some(turn) = self.publisher.exclusive_turn().await else { return Ok(()) };
        let turn_watermark = purge.watermark().await?;
        if turn_watermark != watermark {
            let superseded = purge.superseded_across(month, watermark).await?;
            if !superseded.is_empty() {
                drop(turn);
                return remove_superseded(purge, superseded).await;
            }
        }
        crate::failpoint::pause("before_partition_drop").await;
        self.drop_checked = Some((month, turn_watermark));
        let Some(in_flight) = turn.unfenced_sent() else { return Ok(()) };
        let (dropped, drops) = purge
            .drop_partitions(&partitions, turn.tell_within(), |dropped| {
                if dropped == 1 {
                    crate::failpoint::hit("during_partition_drop");
                }
                turn.lease_held()
            })
            .await;
        // Each drop sent has ended on the server, as far as it shows (see `execute_to_its_end`), unless it could not
        // tell: then the lease is quarantined and the next publish asks again first.
        if let Err(error) = &drops {
            if error.may_still_run {
                turn.may_still_run(&format!("a month's drop: {error}"));
            }
        }
        in_flight.ended();
        drop(turn);
        pass.partitions_dropped += dropped;
        self.counters.partitions_dropped.fetch_add(dropped, Ordering::Relaxed);
        Ok(drops?)
    }

    fn staged_paths(&self, pack_id: Uuid) -> (PathBuf, PathBuf) {
        (self.staging.join(format!("{pack_id}.json")), self.staging.join(format!("{pack_id}.cpk")))
    }

    /// The pack file first, then the plan (see the module doc).
    async fn remove_staged(&self, pack_id: Uuid) -> anyhow::Result<()> {
        let (plan_path, pack_path) = self.staged_paths(pack_id);
        blocking(move || {
            crate::durable::remove_durable(&pack_path)?;
            crate::durable::remove_durable(&plan_path)
        })
        .await?;
        Ok(())
    }
}

/// Remove the rows below the newest of `superseded` ([`RowPurge::superseded_across`]); the months wait for it.
async fn remove_superseded(purge: &RowPurge, superseded: Vec<(String, u64)>) -> anyhow::Result<()> {
    tracing::info!(
        captures = superseded.len(),
        "removing the older rows of captures whose newest row is below the retention horizon"
    );
    purge.remove(&crate::catalog::purge::PurgeBatch { through: 0, captures: superseded }, || {}).await?;
    Ok(())
}

const NS_PER_DAY: u64 = 86_400 * 1_000_000_000;

/// The text every UUIDv7 made before `at_ns` sorts below (and none made at or after it does): its 48-bit
/// millisecond time as the first 12 hex digits, in the id's `8-4` layout.
fn uuid_v7_text_floor(at_ns: u64) -> String {
    let ms = at_ns / 1_000_000;
    format!("{:08x}-{:04x}", (ms >> 16) & 0xffff_ffff, ms & 0xffff)
}

/// `entries` in runs of about `max_bytes` of records (one at least).
fn chunks_of(entries: &[IndexEntry], max_bytes: u64) -> Vec<&[IndexEntry]> {
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (index, entry) in entries.iter().enumerate() {
        if index > start && bytes + entry.record_len > max_bytes {
            chunks.push(&entries[start..index]);
            (start, bytes) = (index, 0);
        }
        bytes += entry.record_len;
    }
    if start < entries.len() {
        chunks.push(&entries[start..]);
    }
    chunks
}

async fn blocking<T: Send + 'static>(work: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> anyhow::Result<T> {
    Ok(tokio::task::spawn_blocking(work).await??)
}

impl super::LeaseHolderPasses for Compactor {
    const WHAT: &'static str = "compaction";

    fn interval(&self) -> Duration {
        self.interval
    }

    async fn pass_once(&mut self, stopping: &tokio::sync::watch::Receiver<bool>) -> anyhow::Result<bool> {
        Ok(self.pass(stopping).await?.more_due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_v7_floor_sorts_between_ids_made_before_and_after() {
        let at_ns = 1_764_000_000_123_000_000;
        let before = Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, 1_764_000_000, 122_000_000));
        let after = Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, 1_764_000_000, 123_000_000));
        let floor = uuid_v7_text_floor(at_ns);
        assert!(before.to_string() < floor, "{before} < {floor}");
        assert!(after.to_string() >= floor, "{after} >= {floor}");
    }

    #[test]
    fn copies_are_cut_into_bounded_chunks() {
        let entry = |len: u64| IndexEntry {
            record_offset: 0,
            record_len: len,
            payload_offset: 0,
            payload_len: 0,
            crc32c: 0,
            meta: crate::capture::CaptureMeta {
                capture_id: Uuid::now_v7(),
                stream: "s".into(),
                captured_at_ns: 1,
                labels: Default::default(),
                content_type: None,
                source_name: None,
            },
        };
        let entries: Vec<IndexEntry> = [4, 4, 4, 20, 1].into_iter().map(entry).collect();
        let sizes: Vec<usize> = chunks_of(&entries, 8).iter().map(|chunk| chunk.len()).collect();
        assert_eq!(sizes, vec![2, 1, 1, 1]);
        assert!(chunks_of(&[], 8).is_empty());
    }
}
