//! Reconcile: packs in the bucket that the catalog lacks are published from their footers.
//!
//! Two ways to find them, one way to resolve them:
//! - **Intents** (once per lease tenure, at start and in the uploader's gate; a mark waits for it): the packs recorded
//!   in the catalog's `intents` since the newest mark (see [`crate::catalog::intents`]): a few rounds' worth, however
//!   large the bucket.
//!   This is what repairs a crash between upload and publish whose spool was lost with it.
//! - **Listing** (`capstore reconcile`, optionally by UTC day of the key; and once at start when the catalog has no
//!   mark yet, i.e. it was written before intents existed, if `catalog.reconcile_on_start`): every object under the
//!   catalog prefix, streamed and checked against the catalog 2,000 at a time, so memory stays bounded whatever the
//!   bucket holds.
//!
//! Resolving a candidate: published already (the replay guard's query) -> skipped; still in the local spool -> left to
//! the uploader and indexer; else it is *missing*. The missing packs of the whole source are published in pack id
//! order (up to [`PUBLISH_ORDER_WINDOW`] at a time), as the spool that made them would have: no object at its key (an
//! intent whose upload never landed) -> nothing to publish; otherwise the pack is read and checked as a stranger's
//! (footer bounded, header pack id against the key, SHA-256, every capture against the capture rules) and published.
//! Objects that are not valid packs, and packs whose rows the server rejects, are reported (WARN, with the reason) and
//! skipped, never retried in a loop.
//!
//! No periodic background listing: what it would find beyond the intents is a dead holder's upload that landed after
//! the next holder reconciled (its own spool still owes and publishes it) or packs copied into the bucket by hand,
//! both rare enough for the explicit repair, while a periodic listing costs requests in proportion to the bucket.
//!
//! State: which lease tenure this process has reconciled under. A tenure begins whenever the lease becomes held from
//! any other state (a start, a claim after a quarantine or after a local loss), never on renewal; a pack moved to
//! quarantine ends the reconciled state too (its bucket copy, if any, is found by the next reconcile). The uploader
//! runs [`Pipeline::ensure_reconciled`] before each round, and writes a mark only under a reconciled tenure; an
//! unfinished reconcile (the bucket or catalog away, a shutdown) does not hold uploads back, only the mark.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use serde::Serialize;
use uuid::Uuid;

use super::{Pipeline, RoundError};
use crate::bucket::{BucketError, BucketErrorKind, DayRange};
use crate::catalog::intents::Intent;
use crate::catalog::lease::PublishPermit;
use crate::catalog::publish::{PackDescriptor, PublishError, PublishOutcome};
use crate::pack::PackSummary;

/// Candidates resolved per catalog query. The pack ids of a listing are scattered over the whole `packs` table, so
/// each query reads most of its granules whatever its size: fewer, larger queries are faster (2,000 ids keep the
/// statement, which names them twice, under the server's 256 KiB max_query_size).
const CANDIDATES_PER_CHECK: usize = 2000;
/// Missing packs held before they are published: a reconcile publishes the packs the catalog lacks in pack id order
/// (the order a spool made and would have published them, so that a capture id posted again is published above its
/// earlier post) across its whole source, a listing in key order (capture day first) or the intents, up to this many
/// at a time: about 11 MB, and far more than a lost spool leaves (100 GB of 64 MiB packs is 1,600).
const PUBLISH_ORDER_WINDOW: usize = 100_000;
/// Keys of invalid objects kept in a report (all are counted and logged).
const INVALID_KEYS_KEPT: usize = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReconcileSource {
    Intents,
    Listing,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReconcileReport {
    pub source: ReconcileSource,
    /// Intents read (source = intents) or objects listed (source = listing).
    pub examined: u64,
    pub already_published: u64,
    pub published: u64,
    /// Packs still in this spool: the uploader and indexer publish them.
    pub local: u64,
    /// Intents whose upload never landed.
    pub not_uploaded: u64,
    /// Packs a compaction wrote (listing only): never published by reconcile.
    pub compacted: u64,
    pub invalid_count: u64,
    /// The first [`INVALID_KEYS_KEPT`] invalid keys.
    pub invalid: Vec<String>,
}

impl ReconcileReport {
    fn new(source: ReconcileSource) -> ReconcileReport {
        ReconcileReport {
            source,
            examined: 0,
            already_published: 0,
            published: 0,
            local: 0,
            not_uploaded: 0,
            compacted: 0,
            invalid_count: 0,
            invalid: Vec::new(),
        }
    }

    fn add_invalid(&mut self, key: String) {
        self.invalid_count += 1;
        if self.invalid.len() < INVALID_KEYS_KEPT {
            self.invalid.push(key);
        }
    }
}

impl Pipeline {
    /// Reconcile once per lease tenure: by intents, or by a listing when the catalog has never been marked and
    /// `catalog.reconcile_on_start` asks for it. Returns the report when it ran now.
    pub async fn ensure_reconciled(&self, permit: &PublishPermit) -> Result<Option<ReconcileReport>, RoundError> {
        if self.is_reconciled(permit) {
            return Ok(None);
        }
        let mark = self.intents.newest_mark().await?;
        let report = match mark {
            None if self.config.catalog.reconcile_on_start => {
                tracing::info!("the catalog has no upload intents marked yet: reconciling by listing the bucket once");
                self.reconcile_listing(None, &|_| {}).await?
            }
            _ => self.reconcile_intents(mark.unwrap_or(0)).await?,
        };
        if report.published > 0 || report.invalid_count > 0 {
            tracing::info!(
                source = ?report.source,
                examined = report.examined,
                published = report.published,
                invalid = report.invalid_count,
                "reconcile done"
            );
        } else {
            tracing::debug!(source = ?report.source, examined = report.examined, "reconcile done");
        }
        *self.reconciled_tenure.lock().unwrap_or_else(|p| p.into_inner()) = Some(permit.tenure);
        Ok(Some(report))
    }

    /// Whether this process has reconciled under the tenure of `permit`.
    pub(super) fn is_reconciled(&self, permit: &PublishPermit) -> bool {
        *self.reconciled_tenure.lock().unwrap_or_else(|p| p.into_inner()) == Some(permit.tenure)
    }

    /// Publish the packs recorded in `intents` at or after `since_ms` that the catalog lacks.
    async fn reconcile_intents(&self, since_ms: u64) -> Result<ReconcileReport, RoundError> {
        let mut report = ReconcileReport::new(ReconcileSource::Intents);
        let local = self.local_pack_ids().await?;
        let mut seen = HashSet::new();
        let mut missing = Vec::new();
        let mut last: Option<Intent> = None;
        loop {
            let intents = self.intents.read(since_ms, last.as_ref()).await?;
            report.examined += intents.len() as u64;
            let mut candidates = Vec::new();
            for intent in &intents {
                let Ok(pack_id) = Uuid::parse_str(&intent.pack_id) else { continue };
                if seen.insert(pack_id) {
                    candidates.push((pack_id, intent.object_key.clone()));
                }
            }
            missing.extend(self.missing(candidates, &local, &mut report).await?);
            if missing.len() >= PUBLISH_ORDER_WINDOW {
                self.publish_in_pack_order(std::mem::take(&mut missing), &mut report, &|_| {}).await?;
            }
            if (intents.len() as u64) < crate::catalog::intents::INTENTS_PER_READ {
                self.publish_in_pack_order(missing, &mut report, &|_| {}).await?;
                return Ok(report);
            }
            last = intents.last().cloned();
        }
    }

    /// Publish every pack under the catalog prefix (of the days of `days`, if given) that the catalog lacks, reading
    /// the listing as it streams. `progress` sees the report after each slice.
    pub async fn reconcile_listing(
        &self,
        days: Option<DayRange>,
        progress: &(dyn Fn(&ReconcileReport) + Sync),
    ) -> Result<ReconcileReport, RoundError> {
        let mut report = ReconcileReport::new(ReconcileSource::Listing);
        let mut missing = Vec::new();
        let listed = self.list_missing(days, &mut missing, &mut report, progress).await;
        if let Err(error) = listed {
            // What the listing found before it failed (the bucket or the catalog away) is published still, in order
            // among itself, so that a long listing tried again makes progress; not when the process is stopping.
            if !matches!(error, RoundError::Stopped) {
                if let Err(publish_error) = self.publish_in_pack_order(missing, &mut report, progress).await {
                    tracing::warn!(%publish_error, "packs the listing found before it failed are not published");
                }
            }
            return Err(error);
        }
        self.publish_in_pack_order(missing, &mut report, progress).await?;
        Ok(report)
    }

    /// The listing's packs that the catalog lacks, into `missing` (those past [`PUBLISH_ORDER_WINDOW`] published).
    async fn list_missing(
        &self,
        days: Option<DayRange>,
        missing: &mut Vec<(Uuid, String)>,
        report: &mut ReconcileReport,
        progress: &(dyn Fn(&ReconcileReport) + Sync),
    ) -> Result<(), RoundError> {
        use futures::StreamExt;
        let local = self.local_pack_ids().await?;
        let mut listing = self.bucket.list_objects(days).chunks(CANDIDATES_PER_CHECK);
        while let Some(slice) = listing.next().await {
            self.unless_stopping()?;
            let mut candidates = Vec::with_capacity(slice.len());
            for object in slice {
                let (key, _size) = object?;
                report.examined += 1;
                match crate::bucket::pack_of_key(&key) {
                    Some((pack_id, false)) => candidates.push((pack_id, key)),
                    // A compaction's pack: its captures are published already, and only its own switch-over may
                    // name it (see `super::compaction`).
                    Some((_, true)) => report.compacted += 1,
                    None => {
                        tracing::warn!(%key, "object under the catalog prefix is not named like a pack; skipped");
                        report.add_invalid(key);
                    }
                }
            }
            missing.extend(self.missing(candidates, &local, report).await?);
            if missing.len() >= PUBLISH_ORDER_WINDOW {
                self.publish_in_pack_order(std::mem::take(missing), report, progress).await?;
            }
            progress(report);
        }
        Ok(())
    }

    async fn local_pack_ids(&self) -> Result<HashSet<Uuid>, RoundError> {
        Ok(super::list_spool_packs(&self.paths).await?.iter().map(|pack| pack.pack_id).collect())
    }

    /// The candidate packs (id, key) that are neither in the local spool (the uploader and indexer publish those) nor
    /// published already; see the module doc.
    async fn missing(
        &self,
        candidates: Vec<(Uuid, String)>,
        local: &HashSet<Uuid>,
        report: &mut ReconcileReport,
    ) -> Result<Vec<(Uuid, String)>, RoundError> {
        let (local_ones, candidates): (Vec<_>, Vec<_>) =
            candidates.into_iter().partition(|(pack_id, _)| local.contains(pack_id));
        report.local += local_ones.len() as u64;
        let mut missing = Vec::new();
        for slice in candidates.chunks(CANDIDATES_PER_CHECK) {
            let pack_ids: Vec<Uuid> = slice.iter().map(|(pack_id, _)| *pack_id).collect();
            let committed = self.publisher.committed_packs(&pack_ids).await?;
            let (published, unpublished): (Vec<_>, Vec<_>) =
                slice.iter().cloned().partition(|(pack_id, _)| committed.contains(pack_id));
            report.already_published += published.len() as u64;
            missing.extend(unpublished);
        }
        Ok(missing)
    }

    /// Publish `missing` packs (see [`Pipeline::missing`]) in pack id order ([`PUBLISH_ORDER_WINDOW`]), each read and
    /// checked as a stranger's first.
    async fn publish_in_pack_order(
        &self,
        mut missing: Vec<(Uuid, String)>,
        report: &mut ReconcileReport,
        progress: &(dyn Fn(&ReconcileReport) + Sync),
    ) -> Result<(), RoundError> {
        missing.sort_by_key(|(pack_id, _)| *pack_id);
        for (pack_id, key) in &missing {
            // Between two packs, never inside a publish: a publish is given up only through its own outcome.
            self.unless_stopping()?;
            let remote = match self.read_verified(key, *pack_id).await {
                Ok(remote) => remote,
                Err(error) if error.kind == BucketErrorKind::NotFound => {
                    report.not_uploaded += 1;
                    continue;
                }
                Err(error) if error.kind == BucketErrorKind::InvalidPack => {
                    tracing::warn!(%key, %error, "object under the catalog prefix is not a valid pack; skipped");
                    report.add_invalid(key.clone());
                    continue;
                }
                Err(error) => return Err(RoundError::Bucket(error)),
            };
            let summary = PackSummary {
                pack_id: *pack_id,
                bytes: remote.size,
                records: remote.entries.len() as u64,
                sha256_hex: hex::encode(remote.trailer.sha256),
                first_captured_at_ns: remote.entries.iter().map(|e| e.meta.captured_at_ns).min().unwrap_or(0),
                last_captured_at_ns: remote.entries.iter().map(|e| e.meta.captured_at_ns).max().unwrap_or(0),
                created_at_ns: 0,
            };
            let descriptor = PackDescriptor { summary, object_key: key.clone(), entries: remote.entries };
            // A fence refusal (a renewal running late: on 18.16's whole-second clock now and then) or a moment
            // without enough lease left is waited out here, as a deletion waits it out: `capstore reconcile`
            // has no loop of its own to try again later.
            let started = std::time::Instant::now();
            let outcome = loop {
                let attempt = self.publisher.publish_batch(std::slice::from_ref(&descriptor)).await;
                if matches!(attempt, Err(PublishError::NoLease | PublishError::NotCommitted)) {
                    self.unless_stopping()?;
                    if super::deletion::lease_may_allow_again(&self.lease, started).await {
                        continue;
                    }
                }
                break attempt;
            };
            match outcome {
                Ok(PublishOutcome::Committed { version, .. }) => {
                    report.published += 1;
                    self.counters.packs_reconciled.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(%key, version, captures = descriptor.entries.len(), "reconciled pack published");
                    progress(report);
                }
                Ok(PublishOutcome::AlreadyPublished) => report.already_published += 1,
                // The server refuses the pack's rows (as the indexer's quarantine does after its attempts): a
                // pack no retry can publish must not stop every later reconcile, and with it every mark.
                Err(PublishError::Catalog(error)) if error.is_data_rejection() => {
                    tracing::warn!(%key, %error, "the catalog rejects the rows of a pack in the bucket; skipped");
                    report.add_invalid(key.clone());
                }
                Err(error) => return Err(error.into()),
            }
        }
        Ok(())
    }
}

impl Pipeline {
    /// A pack of the bucket read and checked as if a stranger wrote it: trailer and footer (bounded), the header's
    /// pack id against the key, the SHA-256 of the whole pack, and every capture against the rules every way in
    /// applies.
    async fn read_verified(&self, key: &str, pack_id: Uuid) -> Result<crate::bucket::RemotePack, BucketError> {
        let remote = self.bucket.read_pack_index(key).await?;
        self.bucket.verify_pack(&remote, pack_id).await?;
        for entry in &remote.entries {
            if let Err(problem) = crate::capture::validate_meta(&entry.meta) {
                return Err(BucketError {
                    kind: crate::bucket::BucketErrorKind::InvalidPack,
                    message: format!("{key} is not a valid pack: capture {}: {problem}", entry.meta.capture_id),
                    source: None,
                });
            }
        }
        Ok(remote)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_ids_come_from_object_names() {
        use crate::bucket::pack_of_key;
        let id = Uuid::now_v7();
        assert_eq!(pack_of_key(&format!("capstore/edge/2026/11/30/{id}.cpk")), Some((id, false)));
        assert_eq!(pack_of_key(&format!("capstore/edge/2026/11/30/{id}.compacted.cpk")), Some((id, true)));
        assert_eq!(pack_of_key("capstore/edge/2026/11/30/notes.txt"), None);
        assert_eq!(pack_of_key(&format!("x/{id}.cpk.tmp")), None);
        assert_eq!(pack_of_key(&format!("x/{id}.other.cpk")), None);
    }
}
