//! Indexer: publish what is owed. `pending_index` is the set of `.uploaded` files, so it survives any crash.
//!
//! A round reads each owed pack's footer, groups packs oldest first into batches bounded by `catalog.batch_max_rows`
//! and `catalog.batch_max_bytes` (a single pack over the budget is published alone: a pack's rows become visible
//! together; a pack that posts an id of an earlier pack of its batch again starts the next batch), and publishes each
//! batch at the next version. On commit (or when the replay guard finds the batch already committed) the `.uploaded`
//! files are deleted: never before the catalog shows them published (I5).
//!
//! Packs are published in pack id order, the order the spool made them, so that a capture id posted again is
//! published above its earlier post. A batch the server rejects for a reason of its own (an error with a ClickHouse
//! code, as opposed to an unreachable server or a lost lease) is retried pack by pack, up to the first pack it
//! rejects; that pack and the ones after it wait for the next round, and a pack rejected
//! `catalog.max_index_attempts` times goes to quarantine with one ERROR line, so one bad pack blocks the rest for a
//! few rounds only.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use uuid::Uuid;

use super::{list_spool_packs, off_runtime, open_pack, Pipeline, RoundError};
use crate::catalog::publish::{PackDescriptor, PublishError, PublishOutcome};
use crate::spool::PackState;

/// Rough bytes one capture row costs in a publish request.
fn row_bytes(entry: &crate::pack::IndexEntry, object_key: &str) -> u64 {
    let labels: usize = entry.meta.labels.iter().map(|(key, value)| key.len() + value.len() + 8).sum();
    (160 + entry.meta.stream.len()
        + object_key.len()
        + labels
        + entry.meta.content_type.as_ref().map_or(0, String::len)) as u64
}

impl Pipeline {
    /// One indexing round; returns how many packs were published (or found already published) and deleted.
    pub async fn index_round(&self) -> Result<usize, RoundError> {
        if self.lease.permit().is_none() {
            return Err(RoundError::NoLease);
        }
        let owed: Vec<_> =
            list_spool_packs(&self.paths).await?.into_iter().filter(|pack| pack.state == PackState::Uploaded).collect();
        if owed.is_empty() {
            return Ok(0);
        }
        let mut descriptors = Vec::with_capacity(owed.len());
        for listing in owed {
            match open_pack(&listing.path).await? {
                Ok(pack) => {
                    let summary = pack.summary();
                    let object_key = self.bucket.pack_key(&summary).to_string();
                    descriptors.push(PackDescriptor { summary, object_key, entries: pack.entries().to_vec() });
                }
                Err(error) if error.is_data_error() => {
                    self.quarantine_pack(&listing.path, &format!("owed pack does not read back: {error}")).await;
                }
                Err(error) => return Err(RoundError::Spool(std::io::Error::other(error.to_string()))),
            }
        }
        let mut published = 0;
        for batch in self.batches(descriptors) {
            let (count, whole) = self.publish_or_isolate(batch).await?;
            published += count;
            if !whole {
                // A pack the catalog rejected stays owed, and the packs after it wait: the spool publishes in pack
                // order, so a capture id posted again is never published below its earlier post.
                break;
            }
        }
        Ok(published)
    }

    fn batches(&self, descriptors: Vec<PackDescriptor>) -> Vec<Vec<PackDescriptor>> {
        plan_batches(descriptors, self.config.catalog.batch_max_rows, self.config.catalog.batch_max_bytes.0)
    }

    /// Publish a batch; if the server rejects it for a reason of its own, publish its packs one by one, up to the
    /// first one it rejects (that one is counted towards quarantine). Returns the packs published and whether the
    /// whole batch was.
    async fn publish_or_isolate(&self, batch: Vec<PackDescriptor>) -> Result<(usize, bool), RoundError> {
        match self.publish_and_delete(&batch).await {
            Err(PublishError::Catalog(error)) if error.is_data_rejection() && batch.len() > 1 => {
                tracing::warn!(%error, packs = batch.len(), "publish rejected; publishing the batch pack by pack");
                let mut published = 0;
                for descriptor in batch {
                    match self.publish_single(descriptor).await? {
                        Some(count) => published += count,
                        None => return Ok((published, false)),
                    }
                }
                Ok((published, true))
            }
            Err(PublishError::Catalog(error)) if error.is_data_rejection() => {
                let descriptor = batch.into_iter().next().expect("a batch has a pack");
                self.count_rejection(&descriptor, &error.to_string()).await;
                Ok((0, false))
            }
            Err(error) => Err(error.into()),
            Ok(count) => Ok((count, true)),
        }
    }

    /// Publish one pack; None when the server rejected it.
    async fn publish_single(&self, descriptor: PackDescriptor) -> Result<Option<usize>, RoundError> {
        match self.publish_and_delete(std::slice::from_ref(&descriptor)).await {
            Ok(count) => Ok(Some(count)),
            Err(PublishError::Catalog(error)) if error.is_data_rejection() => {
                self.count_rejection(&descriptor, &error.to_string()).await;
                Ok(None)
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn count_rejection(&self, descriptor: &PackDescriptor, reason: &str) {
        let pack_id = descriptor.summary.pack_id;
        let attempts = {
            let mut attempts = self.index_attempts.lock().unwrap_or_else(|p| p.into_inner());
            let count = attempts.entry(pack_id).or_insert(0);
            *count += 1;
            *count
        };
        if attempts >= self.config.catalog.max_index_attempts {
            self.index_attempts.lock().unwrap_or_else(|p| p.into_inner()).remove(&pack_id);
            self.quarantine_pack(
                &self.paths.pack_path(pack_id, PackState::Uploaded),
                &format!("catalog rejected the pack's rows {attempts} times: {reason}"),
            )
            .await;
        } else {
            tracing::warn!(%pack_id, attempts, reason, "catalog rejected a pack's rows");
        }
    }

    async fn publish_and_delete(&self, batch: &[PackDescriptor]) -> Result<usize, PublishError> {
        let started = std::time::Instant::now();
        let outcome = self.publisher.publish_batch(batch).await;
        self.counters.publish_latency.observe(started.elapsed());
        self.counters.liveness.progress();
        let outcome = outcome?;
        crate::failpoint::hit("after_publish_before_delete");
        let version = match outcome {
            PublishOutcome::Committed { version, .. } => {
                self.counters.publishes.fetch_add(1, Ordering::Relaxed);
                Some(version)
            }
            PublishOutcome::AlreadyPublished => None,
        };
        for descriptor in batch {
            self.published.announce(descriptor.summary.pack_id, version);
            if version.is_some() {
                // (The header's creation time where the id is ahead of the clock: made after it stepped back.)
                let waited = crate::util::age_of_uuid_v7(descriptor.summary.pack_id)
                    .or_else(|| crate::util::age_of_ns(descriptor.summary.created_at_ns));
                if let Some(waited) = waited {
                    self.counters.ack_to_published_latency.observe(waited);
                }
            }
        }
        if !self.inbox_unlinks_durable().await {
            // Keep the packs: the replay guard makes the next round a no-op for them, and it retries the delete.
            return Ok(0);
        }
        for descriptor in batch {
            let (paths, pack_id) = (self.paths.clone(), descriptor.summary.pack_id);
            self.spool_index.forget(pack_id);
            if let Err(error) = off_runtime(move || paths.remove_published(pack_id)).await {
                // Still owed locally; the replay guard makes the next round a no-op for it.
                tracing::warn!(%pack_id, %error, "published pack could not be removed from the spool");
            }
            self.index_attempts.lock().unwrap_or_else(|p| p.into_inner()).remove(&descriptor.summary.pack_id);
            self.counters.packs_indexed.fetch_add(1, Ordering::Relaxed);
            // Captures, not records: an id posted twice into one pack is one row (see `Publisher::publish_batch`).
            let ids: HashSet<Uuid> = descriptor.entries.iter().map(|entry| entry.meta.capture_id).collect();
            self.counters.captures_indexed.fetch_add(ids.len() as u64, Ordering::Relaxed);
        }
        Ok(batch.len())
    }
}

impl Pipeline {
    /// A pack may leave the spool only once the unlinks of its inbox sources are durable (see `UnlinkLog`).
    async fn inbox_unlinks_durable(&self) -> bool {
        let Some(unlinks) = self.inbox_unlinks.clone() else { return true };
        match tokio::task::spawn_blocking(move || unlinks.sync()).await {
            Ok(Ok(())) => true,
            Ok(Err(error)) => {
                tracing::warn!(%error, "cannot fsync inbox directories; published packs stay in the spool for now");
                false
            }
            Err(_) => false,
        }
    }
}

/// Groups owed packs, oldest first, into publish batches of at most `max_rows` capture rows and about `max_bytes` of
/// request. A pack is never split (its rows become visible together), so a pack over either budget is a batch alone.
fn plan_batches(descriptors: Vec<PackDescriptor>, max_rows: u64, max_bytes: u64) -> Vec<Vec<PackDescriptor>> {
    let mut batches: Vec<Vec<PackDescriptor>> = Vec::new();
    let (mut rows, mut bytes) = (0u64, 0u64);
    let mut ids_in_batch: HashSet<Uuid> = HashSet::new();
    for descriptor in descriptors {
        let pack_rows = descriptor.entries.len() as u64;
        let pack_bytes: u64 = descriptor.entries.iter().map(|entry| row_bytes(entry, &descriptor.object_key)).sum();
        let fits = rows + pack_rows <= max_rows && bytes + pack_bytes <= max_bytes;
        // A pack that posts an id of an earlier pack of the batch again starts a batch of its own: each post then
        // has a row at its own version, the last post the newest. In one version the publish would keep only the
        // last post's row (see `Publisher::publish_batch`), and erasure, which finds the packs a deleted capture is
        // in through its rows, would never rewrite the pack of the earlier one.
        let repeats = descriptor.entries.iter().any(|entry| ids_in_batch.contains(&entry.meta.capture_id));
        if batches.is_empty() || !fits || repeats {
            batches.push(Vec::new());
            (rows, bytes) = (0, 0);
            ids_in_batch.clear();
        }
        rows += pack_rows;
        bytes += pack_bytes;
        ids_in_batch.extend(descriptor.entries.iter().map(|entry| entry.meta.capture_id));
        batches.last_mut().expect("a batch was started").push(descriptor);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::CaptureMeta;
    use crate::pack::{IndexEntry, PackSummary};

    fn pack(records: u64) -> PackDescriptor {
        let pack_id = uuid::Uuid::now_v7();
        let entries = (0..records)
            .map(|n| IndexEntry {
                meta: CaptureMeta {
                    capture_id: uuid::Uuid::now_v7(),
                    stream: "s".into(),
                    captured_at_ns: n,
                    labels: Default::default(),
                    content_type: None,
                    source_name: None,
                },
                record_offset: 40 + n * 100,
                record_len: 100,
                payload_offset: 40 + n * 100 + 60,
                payload_len: 40,
                crc32c: 0,
            })
            .collect();
        let summary = PackSummary {
            pack_id,
            bytes: 0,
            records,
            sha256_hex: String::new(),
            first_captured_at_ns: 0,
            last_captured_at_ns: 0,
            created_at_ns: 0,
        };
        PackDescriptor { summary, object_key: format!("k/{pack_id}.cpk"), entries }
    }

    fn shape(batches: &[Vec<PackDescriptor>]) -> Vec<Vec<usize>> {
        batches.iter().map(|batch| batch.iter().map(|pack| pack.entries.len()).collect()).collect()
    }

    #[test]
    fn packs_fill_batches_up_to_the_row_budget_in_order() {
        let batches = plan_batches(vec![pack(3), pack(3), pack(3), pack(1)], 6, u64::MAX);
        assert_eq!(shape(&batches), vec![vec![3, 3], vec![3, 1]]);
    }

    #[test]
    fn a_pack_over_the_budget_is_a_batch_alone_and_never_split() {
        let batches = plan_batches(vec![pack(2), pack(10), pack(2)], 5, u64::MAX);
        assert_eq!(shape(&batches), vec![vec![2], vec![10], vec![2]]);
    }

    #[test]
    fn the_byte_budget_bounds_a_batch_too() {
        let one_row = row_bytes(&pack(1).entries[0], &pack(1).object_key);
        let batches = plan_batches(vec![pack(1), pack(1), pack(1)], u64::MAX, one_row * 2);
        assert_eq!(shape(&batches), vec![vec![1, 1], vec![1]]);
        assert!(plan_batches(Vec::new(), 1, 1).is_empty());
    }

    #[test]
    fn a_pack_that_posts_an_id_of_its_batch_again_starts_the_next_batch() {
        let (first, second, third, fourth) = (pack(3), pack(2), pack(2), pack(1));
        let mut second = second;
        second.entries[1].meta.capture_id = first.entries[2].meta.capture_id;
        let mut fourth = fourth;
        // An id twice within one pack is the publish's to sort out (it keeps the last): no split for it.
        fourth.entries.push(fourth.entries[0].clone());
        let batches = plan_batches(vec![first, second, third, fourth], u64::MAX, u64::MAX);
        assert_eq!(shape(&batches), vec![vec![3], vec![2, 2, 2]]);
    }
}
