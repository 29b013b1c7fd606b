//! Reconcile: packs under this catalog's bucket prefix that the catalog lacks are published from their footers.
//!
//! This is how a lost spool (or a crash between upload and publish with the spool gone) is repaired: the bucket holds
//! self-describing packs, so two range reads (trailer, footer) give everything a publish needs. A pack found this way
//! is checked as a stranger's: its footer is bounded, its header must name the pack id its key does, its SHA-256 must
//! match, and every capture must follow the capture rules. Objects that are not valid packs are reported (WARN, with
//! the reason) and skipped, never indexed. Packs still present in the local spool
//! are left to the uploader and indexer.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use serde::Serialize;
use uuid::Uuid;

use super::{Pipeline, RoundError};
use crate::bucket::BucketError;
use crate::catalog::publish::{PackDescriptor, PublishOutcome};
use crate::pack::{PackSummary, PACK_EXTENSION};
use crate::spool::list_packs;

#[derive(Debug, Default, Clone, Serialize)]
pub struct ReconcileReport {
    pub objects_listed: u64,
    pub already_published: u64,
    pub published: u64,
    pub invalid: Vec<String>,
}

impl Pipeline {
    /// Publish every pack in the bucket that the catalog lacks. `progress(done, total)` is called as packs are examined.
    pub async fn reconcile(&self, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<ReconcileReport, RoundError> {
        let mut report = ReconcileReport::default();
        let objects = self.bucket.list_pack_keys().await?;
        report.objects_listed = objects.len() as u64;
        let local: HashSet<Uuid> = list_packs(&self.paths)?.iter().map(|pack| pack.pack_id).collect();
        let mut candidates = Vec::new();
        for (key, _size) in objects {
            match pack_id_of_key(&key) {
                Some(pack_id) if local.contains(&pack_id) => {}
                Some(pack_id) => candidates.push((pack_id, key)),
                None => {
                    tracing::warn!(%key, "object under the catalog prefix is not named like a pack; skipped");
                    report.invalid.push(key);
                }
            }
        }
        let total = candidates.len() as u64;
        for (chunk_index, chunk) in candidates.chunks(500).enumerate() {
            let pack_ids: Vec<Uuid> = chunk.iter().map(|(pack_id, _)| *pack_id).collect();
            let committed = self.publisher.committed_packs(&pack_ids).await?;
            for (offset, (pack_id, key)) in chunk.iter().enumerate() {
                progress((chunk_index * 500 + offset) as u64, total);
                if committed.contains(pack_id) {
                    report.already_published += 1;
                    continue;
                }
                let remote = match self.read_verified(key, *pack_id).await {
                    Ok(remote) => remote,
                    Err(error) if error.kind == crate::bucket::BucketErrorKind::InvalidPack => {
                        tracing::warn!(%key, %error, "object under the catalog prefix is not a valid pack; skipped");
                        report.invalid.push(key.clone());
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
                match self.publisher.publish_batch(std::slice::from_ref(&descriptor)).await? {
                    PublishOutcome::Committed { version, .. } => {
                        report.published += 1;
                        self.counters.packs_reconciled.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(%key, version, captures = descriptor.entries.len(), "reconciled pack published");
                    }
                    PublishOutcome::AlreadyPublished => report.already_published += 1,
                }
            }
        }
        progress(total, total);
        Ok(report)
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

/// `<...>/<pack_id>.cpk` -> pack_id.
fn pack_id_of_key(key: &str) -> Option<Uuid> {
    let name = key.rsplit('/').next()?;
    let stem = name.strip_suffix(&format!(".{PACK_EXTENSION}"))?;
    Uuid::parse_str(stem).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_ids_come_from_object_names() {
        let id = Uuid::now_v7();
        assert_eq!(pack_id_of_key(&format!("capstore/edge/2026/11/30/{id}.cpk")), Some(id));
        assert_eq!(pack_id_of_key("capstore/edge/2026/11/30/notes.txt"), None);
        assert_eq!(pack_id_of_key(&format!("x/{id}.cpk.tmp")), None);
    }
}
