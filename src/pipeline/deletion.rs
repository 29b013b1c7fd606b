//! Deleting captures on request: `DELETE /v1/captures/{id}`, `POST /v1/captures/delete` and `capstore delete` (which
//! asks the running daemon). A deletion is a publish of tombstones ([`Publisher::publish_deletions`]), so only the
//! lease holder makes one, it is fenced and versioned, and `tail` consumers see it in order.
//!
//! An id whose capture this spool still holds (acknowledged, not yet published) is *pending*: it is left out of the
//! deletion, because its pack would publish it after the tombstone and make it visible again. The caller asks again
//! once it is published (`wait=published` tells when). A dry run plans the same deletion and publishes nothing.

use std::sync::Arc;

use uuid::Uuid;

use crate::catalog::publish::{plan_deletions, DeletionReport, PublishError, Publisher};
use crate::catalog::query::CatalogReader;
use crate::spool::index::SpoolIndex;

/// What a deletion request found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeletionAnswer {
    pub report: DeletionReport,
    /// Still in this spool, not published yet: not deleted.
    pub pending: Vec<Uuid>,
    pub dry_run: bool,
}

pub struct Deleter {
    publisher: Arc<Publisher>,
    catalog: CatalogReader,
    spool_index: Arc<SpoolIndex>,
}

impl Deleter {
    pub fn new(publisher: Arc<Publisher>, catalog: CatalogReader, spool_index: Arc<SpoolIndex>) -> Deleter {
        Deleter { publisher, catalog, spool_index }
    }

    /// Delete `ids` (at most [`crate::catalog::publish::DELETION_MAX_IDS`]) as one publish, or with `dry_run` say
    /// what that would delete.
    pub async fn delete(&self, ids: &[Uuid], dry_run: bool) -> Result<DeletionAnswer, PublishError> {
        let (pending, published): (Vec<Uuid>, Vec<Uuid>) =
            ids.iter().partition(|id| !self.spool_index.candidates(**id).is_empty());
        let report = if dry_run {
            plan_deletions(&self.catalog, &published).await?.0
        } else {
            self.publisher.publish_deletions(&published).await?
        };
        if let Some(version) = report.version {
            tracing::info!(version, deleted = report.deleted.len(), "captures deleted");
        }
        let mut pending = pending;
        let mut seen = std::collections::HashSet::new();
        pending.retain(|id| seen.insert(*id));
        Ok(DeletionAnswer { report, pending, dry_run })
    }
}
