//! Deleting captures on request: `DELETE /v1/captures/{id}`, `POST /v1/captures/delete` and `capstore delete` (which
//! asks the running daemon). A deletion is a publish of tombstones ([`Publisher::publish_deletions`]), so only the
//! lease holder makes one, it is fenced and versioned, and `tail` consumers see it in order.
//!
//! An id whose capture this spool still holds in a pack not published yet (acknowledged, not yet visible) is
//! *pending*: it is left out of the deletion, because its pack would publish it after the tombstone and make it
//! visible again. The caller asks again once it is published (`wait=published` tells when). A dry run plans the same deletion and publishes nothing.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::PipelineCounters;
use crate::catalog::lease::LeaseHandle;
use crate::catalog::publish::{plan_deletions, DeletionReport, PublishError, Publisher};
use crate::catalog::query::CatalogReader;
use crate::reader::{LocalSpool, ReadError, Reader};
use crate::spool::index::SpoolIndex;

/// What a deletion request found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeletionAnswer {
    pub report: DeletionReport,
    /// Still in this spool, not published yet: not deleted.
    pub pending: Vec<Uuid>,
    pub dry_run: bool,
}

/// How long a deletion waits for the lease to allow a publish (held, with time left) before answering that it
/// cannot publish now.
pub const LEASE_WAIT: Duration = Duration::from_secs(10);
const LEASE_POLL: Duration = Duration::from_millis(100);

/// After a publish the lease refused (not held with time enough left, or a fence refusal, which a renewal clears),
/// whether to try it again: true after a [`LEASE_POLL`] pause; false at once when [`LEASE_WAIT`] from `started` is
/// over or the lease has ended ([`LeaseHandle::ended`]: its keeper stopped at the shutdown, or latched), since no
/// wait brings a permit back then. (The shutdown stops the keeper before the HTTP server, which lets requests in
/// flight finish: a deletion waiting on a lease that is not coming back must not hold the exit. Until the keeper
/// stops, through the drain, the lease is renewed, and a deletion may still be published.)
pub(super) async fn lease_may_allow_again(lease: &LeaseHandle, started: Instant) -> bool {
    if lease.ended() || started.elapsed() >= LEASE_WAIT {
        return false;
    }
    tokio::time::sleep(LEASE_POLL).await;
    true
}

pub struct Deleter {
    publisher: Arc<Publisher>,
    /// The catalog, and the spool for telling which ids it still holds unpublished.
    reader: Reader,
    spool_index: Arc<SpoolIndex>,
    counters: Arc<PipelineCounters>,
    lease: LeaseHandle,
}

impl Deleter {
    /// A deleter publishing through `pipeline`'s publisher, counting in its counters.
    pub fn for_pipeline(pipeline: &super::Pipeline, catalog: CatalogReader) -> Deleter {
        let spool = LocalSpool { paths: pipeline.paths.clone(), index_opt: Some(pipeline.spool_index.clone()) };
        Deleter {
            publisher: pipeline.publisher.clone(),
            reader: Reader::new(catalog, pipeline.bucket.clone(), Some(spool)),
            spool_index: pipeline.spool_index.clone(),
            counters: pipeline.counters.clone(),
            lease: pipeline.lease.clone(),
        }
    }

    /// Whether this deleter publishes nothing more: its lease has ended ([`LeaseHandle::ended`]).
    pub fn ended(&self) -> bool {
        self.lease.ended()
    }

    /// The catalog this deleter reads.
    pub fn catalog(&self) -> &CatalogReader {
        self.reader.catalog()
    }

    /// Delete `ids` (at most [`crate::catalog::publish::DELETION_MAX_IDS`]) as one publish, or with `dry_run` say
    /// what that would delete; with `unchanged_since` (the watermark of the listing the ids come from) a capture
    /// posted again since is left alone. A fence refusal or a lease without enough time left (which a renewal
    /// clears, and on 18.16's whole-second times happens now and then) is retried for up to [`LEASE_WAIT`], unless
    /// the lease has ended ([`Deleter::ended`]: the refusal is answered at once then).
    ///
    /// The work runs on a task of its own: a caller that goes away (an HTTP client hanging up, the shutdown) must
    /// not cut a publish between its statement and its read-back, whose outcome would then be known to nobody.
    pub async fn delete(
        self: &Arc<Self>,
        ids: &[Uuid],
        unchanged_since: Option<u64>,
        dry_run: bool,
    ) -> Result<DeletionAnswer, PublishError> {
        let (deleter, ids) = (self.clone(), ids.to_vec());
        tokio::spawn(async move { deleter.delete_now(&ids, unchanged_since, dry_run).await })
            .await
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic.into_panic()))
    }

    async fn delete_now(
        &self,
        ids: &[Uuid],
        unchanged_since: Option<u64>,
        dry_run: bool,
    ) -> Result<DeletionAnswer, PublishError> {
        let pending = self.pending(ids).await?;
        let pending_set: HashSet<Uuid> = pending.iter().copied().collect();
        let published: Vec<Uuid> = ids.iter().copied().filter(|id| !pending_set.contains(id)).collect();
        if published.is_empty() {
            return Ok(DeletionAnswer { report: DeletionReport::default(), pending, dry_run });
        }
        let started = Instant::now();
        let mut waited = false;
        let report = loop {
            let attempt = if dry_run {
                plan_deletions(self.reader.catalog(), &published, unchanged_since)
                    .await
                    .map(|(report, _)| report)
                    .map_err(PublishError::from)
            } else {
                self.publisher.publish_deletions(&published, unchanged_since).await
            };
            let refused = matches!(attempt, Err(PublishError::NoLease | PublishError::NotCommitted));
            if refused && lease_may_allow_again(&self.lease, started).await {
                if !waited {
                    tracing::info!(ids = published.len(), "deletion waits for the lease to allow a publish");
                    waited = true;
                }
                continue;
            }
            break attempt?;
        };
        if let Some(version) = report.version {
            self.counters.captures_deleted.fetch_add(report.deleted.len() as u64, Ordering::Relaxed);
            self.counters.publishes.fetch_add(1, Ordering::Relaxed);
            tracing::info!(version, deleted = report.deleted.len(), "captures deleted");
        }
        Ok(DeletionAnswer { report, pending, dry_run })
    }

    /// Publish a retention horizon at `before_ns` ([`Publisher::publish_horizon`]) unless the catalog's is there
    /// already; retried like a deletion while the lease does not allow a publish, and run on a task of its own for
    /// the same reason. Returns the version, if published.
    pub async fn expire_before(self: &Arc<Self>, before_ns: u64) -> Result<Option<u64>, PublishError> {
        let deleter = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            loop {
                match deleter.publisher.publish_horizon(before_ns).await {
                    Err(PublishError::NoLease | PublishError::NotCommitted)
                        if lease_may_allow_again(&deleter.lease, started).await => {}
                    Ok(Some(version)) => {
                        deleter.counters.publishes.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(version, before_ns, "retention horizon published");
                        return Ok(Some(version));
                    }
                    other => return other,
                }
            }
        })
        .await
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic.into_panic()))
    }

    /// The ids this spool holds in a pack the catalog has not published (in the order given, each once). A pack
    /// published a moment ago may still be in the spool: one replay-guard lookup of those packs tells.
    async fn pending(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, PublishError> {
        let mut in_spool: Vec<(Uuid, Vec<Uuid>)> = Vec::new();
        for id in crate::util::unique_ids(ids) {
            let packs: Vec<Uuid> = self.spool_index.candidates(id).iter().map(|candidate| candidate.pack_id).collect();
            if !packs.is_empty() {
                in_spool.push((id, packs));
            }
        }
        if in_spool.is_empty() {
            return Ok(Vec::new());
        }
        let mut packs: Vec<Uuid> = in_spool.iter().flat_map(|(_, packs)| packs.iter().copied()).collect();
        packs.sort();
        packs.dedup();
        let published = self.publisher.committed_packs(&packs).await?;
        let mut pending = Vec::new();
        for (id, packs) in in_spool {
            for pack in packs.into_iter().filter(|pack| !published.contains(pack)) {
                // The index matched a fingerprint: the record tells whether it is this capture.
                match self.reader.spool_holds(id, pack).await {
                    Ok(true) => {
                        pending.push(id);
                        break;
                    }
                    Ok(false) => {}
                    Err(error) => return Err(PublishError::Catalog(spool_read_failed(error))),
                }
            }
        }
        Ok(pending)
    }
}

/// A spool read that failed while telling pending ids apart, as the error a deletion answers with (the deletion
/// is not made: it would be unsafe to delete what may still be published).
fn spool_read_failed(error: ReadError) -> crate::catalog::CatalogError {
    tracing::warn!(%error, "deletion: cannot read the spool to tell which ids are still unpublished");
    crate::catalog::CatalogError::new(
        crate::catalog::ErrorKind::DefinitelyFailed,
        format!("spool read failed: {error}"),
    )
}
