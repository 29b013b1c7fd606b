//! Uploader: sealed packs to the bucket, oldest first, up to `upload.batch_packs` per round, `upload.concurrency` at once.
//!
//! Gate (I5 and the lease rule): a round runs only while the lease is held and nothing is owed; it first reconciles
//! under the lease's current tenure if it has not ([`Pipeline::ensure_reconciled`]), and each upload starts only while
//! that tenure holds. A pack uploaded while the lease is not held would be owed by a process that may never publish
//! it; a pack uploaded while another is owed would widen the window in which a crash leaves packs in the bucket that
//! only this spool knows about.
//!
//! Per round: open every pack of the round (a pack that does not read back goes to quarantine), record their intents
//! in the catalog (fenced; with a mark when the round holds every sealed pack of the spool: see
//! [`crate::catalog::intents`]), then upload each (the bucket module creates the object with `PutMode::Create`, treats
//! an identical existing object as uploaded, verifies the size with HEAD) and rename `.sealed` -> `.uploaded` with a
//! directory fsync. No intent, no upload: a lost spool can then always be repaired from the catalog. A conflicting
//! object under the same key is a permanent conflict: the pack goes to quarantine with an ERROR. Bucket outages end the
//! round without counting against any pack.
//!
//! A sealed pack newer than a pack whose seal failed waits until the spool's sealer has sealed that one: only packs
//! older than the oldest pack left open are taken ([`sealed_before`]).
//!
//! Packs become `.uploaded` in pack id order (the order the spool made them), and the indexer publishes them in that
//! order ([`super::indexer`]): a pack uploaded after an older one of its round failed stays `.sealed` (its object is in
//! the bucket, as after a crash before the rename) and is uploaded again, found identical, behind the older one. A
//! capture id posted again is then always published at a higher version than its earlier post, so the newest version
//! is the last post (I2).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use uuid::Uuid;

use super::{list_spool_packs, off_runtime, open_pack, Pipeline, RoundError};
use crate::bucket::BucketErrorKind;
use crate::catalog::intents::IntentError;
use crate::pack::PackFile;
use crate::spool::{PackListing, PackState};

/// The sealed packs older than the oldest pack left open by a failed seal: every sealed pack in a healthy spool, but
/// none made after such a pack until the spool's sealer has sealed it (see [`crate::spool::writer`]). So packs are
/// still uploaded, and published, in the order the spool made them. (Only packs left open by a failure count: the
/// open pack and those being sealed are always newer than every sealed pack, as a new pack's id sorts after every
/// pack the spool holds.)
fn sealed_before(sealed: Vec<PackListing>, oldest_left_open: Option<Uuid>) -> Vec<PackListing> {
    match oldest_left_open {
        Some(unsealed) => sealed.into_iter().filter(|pack| pack.pack_id < unsealed).collect(),
        None => sealed,
    }
}

impl Pipeline {
    /// One upload round; returns how many packs moved to `.uploaded`.
    pub async fn upload_round(&self) -> Result<usize, RoundError> {
        let Some(permit) = self.lease.permit() else { return Err(RoundError::NoLease) };
        match self.ensure_reconciled(&permit).await {
            // Stopping, or the bucket or catalog away: upload anyway (the packs get intents), write no mark.
            Ok(_) | Err(RoundError::Stopped) => {}
            Err(error) => tracing::debug!(%error, "reconcile not done; uploading without a mark"),
        }
        // Read before and after the listing: a pack whose seal failed before the listing ended is left open at the
        // second read (it leaves the set only once sealed, a second later at the soonest), and one that a retry
        // sealed during the listing (which may have missed it mid-rename) was left open at the first.
        let left_open_before = self.spool_index.oldest_left_open();
        let packs = list_spool_packs(&self.paths).await?;
        let oldest_left_open = [left_open_before, self.spool_index.oldest_left_open()].into_iter().flatten().min();
        if packs.iter().any(|pack| pack.state == PackState::Uploaded) {
            return Ok(0);
        }
        let sealed: Vec<PackListing> = packs.into_iter().filter(|pack| pack.state == PackState::Sealed).collect();
        let sealed_in_spool = sealed.len();
        let sealed = sealed_before(sealed, oldest_left_open);
        if sealed.len() < sealed_in_spool {
            tracing::debug!(
                held_back = sealed_in_spool - sealed.len(),
                oldest_left_open = ?oldest_left_open,
                "sealed packs wait for an older pack whose seal failed"
            );
        }
        let whole_spool = sealed.len() == sealed_in_spool && sealed.len() <= self.config.upload.batch_packs as usize;
        let mut round = Vec::new();
        for listing in sealed.into_iter().take(self.config.upload.batch_packs as usize) {
            match open_pack(&listing.path).await? {
                Ok(pack) => round.push((listing, pack)),
                Err(error) if error.is_data_error() => {
                    self.quarantine_pack(&listing.path, &format!("sealed pack does not read back: {error}")).await;
                }
                // Gone (moved on by another stage) or an I/O problem: try again next round.
                Err(error) => return Err(RoundError::Spool(std::io::Error::other(error.to_string()))),
            }
        }
        if round.is_empty() {
            return Ok(0);
        }
        let intents: Vec<_> = round
            .iter()
            .map(|(_, pack)| {
                let summary = pack.summary();
                (summary.pack_id, self.bucket.pack_key(&summary).to_string())
            })
            .collect();
        let mark = whole_spool && self.is_reconciled(&permit);
        let statement_cap = self.lease.timings().statement_cap();
        match self.intents.record(&permit, &intents, mark, statement_cap).await {
            Ok(()) => {}
            Err(IntentError::FenceRefused) => {
                self.lease.report_fence_refused();
                return Err(RoundError::Intents(IntentError::FenceRefused));
            }
            Err(error) => return Err(error.into()),
        }
        crate::failpoint::hit("after_intents_before_upload");
        let tenure = permit.tenure;
        let mut uploads = futures::stream::iter(round.into_iter().enumerate())
            .map(|(at, (listing, pack))| async move { (at, self.upload_one(listing, pack, tenure).await) })
            .buffer_unordered(self.config.upload.concurrency as usize);
        // Uploads finish in any order; packs become `.uploaded` in the round's (oldest first), each once every older
        // pack of the round has, so a slow upload holds back renames, never the other uploads.
        let mut finished = BTreeMap::new();
        let mut next_to_rename = 0;
        let mut uploaded = 0;
        let mut first_error = None;
        while let Some((at, result)) = uploads.next().await {
            finished.insert(at, result);
            while let Some(result) = finished.remove(&next_to_rename) {
                next_to_rename += 1;
                match result {
                    Ok(Some(pack_id)) if first_error.is_none() => {
                        crate::failpoint::hit("after_upload_before_rename");
                        let paths = self.paths.clone();
                        match off_runtime(move || paths.mark_uploaded(pack_id)).await {
                            Ok(()) => uploaded += 1,
                            Err(error) => first_error = Some(error.into()),
                        }
                    }
                    // Uploaded, but an older pack of the round was not: left `.sealed`, to be published after it.
                    Ok(Some(_)) | Ok(None) => {}
                    Err(error) => {
                        first_error.get_or_insert(error);
                    }
                }
            }
        }
        match first_error {
            Some(error) if uploaded == 0 => Err(error),
            _ => Ok(uploaded),
        }
    }

    /// Uploads one pack; returns its id when its object is in the bucket (and the pack may become `.uploaded`), none
    /// when it went to quarantine.
    async fn upload_one(&self, listing: PackListing, pack: PackFile, tenure: u64) -> Result<Option<Uuid>, RoundError> {
        // Each upload starts only under the tenure that recorded its intent: after a loss, a successor may have
        // reconciled already and found no object; an upload sent now would be one it never sees.
        if self.lease.permit().is_none_or(|permit| permit.tenure != tenure) {
            return Err(RoundError::NoLease);
        }
        let summary = pack.summary();
        crate::failpoint::stall_async("stall_upload").await;
        let started = std::time::Instant::now();
        let upload = self.bucket.upload_pack(&listing.path, &summary);
        tokio::pin!(upload);
        let outcome = if crate::failpoint::is_armed("mid_upload") {
            // Start the upload (one poll sends the first request or spawns the first write), then die with it in flight.
            let first_poll = futures::poll!(&mut upload);
            crate::failpoint::hit("mid_upload");
            match first_poll {
                std::task::Poll::Ready(outcome) => outcome,
                std::task::Poll::Pending => upload.await,
            }
        } else {
            upload.await
        };
        self.counters.liveness.progress();
        match outcome {
            Ok(uploaded) => {
                self.counters.upload_latency.observe(started.elapsed());
                self.counters.packs_uploaded.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes_uploaded.fetch_add(summary.bytes, Ordering::Relaxed);
                tracing::debug!(
                    pack_id = %summary.pack_id,
                    key = %uploaded.key,
                    already_present = uploaded.already_present,
                    "pack uploaded"
                );
                Ok(Some(summary.pack_id))
            }
            Err(error) if error.kind == BucketErrorKind::Conflict => {
                self.quarantine_pack(
                    &listing.path,
                    &format!("a different object already exists in the bucket: {error}"),
                )
                .await;
                Ok(None)
            }
            Err(error) => {
                self.counters.upload_failures.fetch_add(1, Ordering::Relaxed);
                Err(RoundError::Bucket(error))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(pack_id: Uuid) -> PackListing {
        PackListing {
            pack_id,
            state: PackState::Sealed,
            path: Default::default(),
            bytes: 0,
            modified: std::time::SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn sealed_packs_newer_than_the_oldest_pack_left_open_wait() {
        let ids: Vec<Uuid> = (0..4).map(|_| Uuid::now_v7()).collect();
        let ids_of = |packs: Vec<PackListing>| packs.into_iter().map(|pack| pack.pack_id).collect::<Vec<_>>();
        let sealed = || [ids[0], ids[2], ids[3]].map(listing).to_vec();
        // A healthy spool: no pack left open.
        assert_eq!(ids_of(sealed_before(sealed(), None)), [ids[0], ids[2], ids[3]]);
        // The seal of ids[1] failed: what was sealed after it waits.
        assert_eq!(ids_of(sealed_before(sealed(), Some(ids[1]))), [ids[0]]);
    }
}
