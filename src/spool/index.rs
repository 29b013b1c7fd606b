//! Which local pack holds a capture: an in-memory index of every record in `packs/`, so that a read by capture id
//! opens only the pack that holds it, instead of scanning (and checksumming) every pack in the spool.
//!
//! Per pack the index keeps the fingerprints of its captures (the low 64 bits of the capture id: the random part of a
//! UUIDv4 or v7). For a pack still being written it also keeps each record's place, so a read needs one positioned
//! read and no scan; once the pack is sealed only the sorted fingerprints stay (8 bytes a capture) and a read opens
//! the pack's footer. A fingerprint can collide, so every hit is confirmed against the record itself.
//!
//! States of a pack in the index: `open` (fingerprints with places, appended by the writer) -> `sealed` (sorted
//! fingerprints; marked by the sealer, or loaded by recovery) -> gone (forgotten when the pipeline deletes or
//! quarantines the pack). An open pack whose seal failed is also *left open* (re-indexed from the disk, and marked)
//! until it is sealed or gone. Maintained by the writer, recovery and the pipeline; read by the reader.
//!
//! Memory: 8 bytes per capture in sealed packs, 44 in open ones: a spool full of 1 KiB captures (10 GiB, 10M
//! captures) costs about 80 MiB; a spool that keeps up with its bucket holds a few packs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::RwLock;

use uuid::Uuid;

use crate::pack::IndexEntry;

/// Where a record sits in its pack: what a positioned read and [`crate::pack::entry_from_location`] need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordPlace {
    pub record_offset: u64,
    pub record_len: u64,
    pub payload_offset: u64,
    pub payload_len: u64,
    pub crc32c: u32,
}

impl RecordPlace {
    pub fn of(entry: &IndexEntry) -> RecordPlace {
        RecordPlace {
            record_offset: entry.record_offset,
            record_len: entry.record_len,
            payload_offset: entry.payload_offset,
            payload_len: entry.payload_len,
            crc32c: entry.crc32c,
        }
    }
}

#[derive(Debug)]
enum PackIds {
    Open(Vec<(u64, RecordPlace)>),
    /// Sorted.
    Sealed(Vec<u64>),
}

/// A pack that may hold the capture, and the record's place when the pack is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub pack_id: Uuid,
    pub place_opt: Option<RecordPlace>,
}

#[derive(Debug, Default)]
pub struct SpoolIndex {
    packs: RwLock<BTreeMap<Uuid, PackIds>>,
    /// Open packs whose seal failed (or that recovery could not seal), until they are sealed or gone: the uploader
    /// takes no sealed pack newer than the oldest of them (see [`super::writer`]).
    left_open: RwLock<BTreeSet<Uuid>>,
}

fn fingerprint(capture_id: Uuid) -> u64 {
    capture_id.as_u64_pair().1
}

impl SpoolIndex {
    /// A record appended to the open pack `pack_id`.
    pub fn add_open(&self, pack_id: Uuid, entry: &IndexEntry) {
        let mut packs = self.write();
        let ids = packs.entry(pack_id).or_insert_with(|| PackIds::Open(Vec::new()));
        if let PackIds::Open(records) = ids {
            records.push((fingerprint(entry.meta.capture_id), RecordPlace::of(entry)));
        }
    }

    /// The open pack `pack_id` holds exactly `entries` (after recovering it from a write error).
    pub fn replace_open(&self, pack_id: Uuid, entries: &[IndexEntry]) {
        let records =
            entries.iter().map(|entry| (fingerprint(entry.meta.capture_id), RecordPlace::of(entry))).collect();
        self.write().insert(pack_id, PackIds::Open(records));
    }

    /// The pack is sealed: keep its fingerprints only, sorted.
    pub fn mark_sealed(&self, pack_id: Uuid) {
        self.left_open_set().remove(&pack_id);
        let mut packs = self.write();
        if let Some(PackIds::Open(records)) = packs.get(&pack_id) {
            let mut sorted: Vec<u64> = records.iter().map(|(fingerprint, _)| *fingerprint).collect();
            sorted.sort_unstable();
            packs.insert(pack_id, PackIds::Sealed(sorted));
        }
    }

    /// A sealed pack found in the spool (at start).
    pub fn add_sealed(&self, pack_id: Uuid, entries: &[IndexEntry]) {
        let mut sorted: Vec<u64> = entries.iter().map(|entry| fingerprint(entry.meta.capture_id)).collect();
        sorted.sort_unstable();
        self.left_open_set().remove(&pack_id);
        self.write().insert(pack_id, PackIds::Sealed(sorted));
    }

    /// The pack left the spool (published and deleted, quarantined, or removed empty).
    pub fn forget(&self, pack_id: Uuid) {
        self.left_open_set().remove(&pack_id);
        self.write().remove(&pack_id);
    }

    /// The open pack `pack_id` is left open by a failed seal, until it is sealed or forgotten.
    pub fn mark_left_open(&self, pack_id: Uuid) {
        self.left_open_set().insert(pack_id);
    }

    /// The oldest pack left open by a failed seal ([`SpoolIndex::mark_left_open`]).
    pub fn oldest_left_open(&self) -> Option<Uuid> {
        self.left_open.read().unwrap_or_else(|poisoned| poisoned.into_inner()).first().copied()
    }

    /// Every pack left open by a failed seal, oldest first (at a start: those recovery could not seal).
    pub fn left_open_packs(&self) -> Vec<Uuid> {
        self.left_open.read().unwrap_or_else(|poisoned| poisoned.into_inner()).iter().copied().collect()
    }

    /// The newest pack the index holds (open with records, sealed, uploaded or left open): a new pack's id must sort
    /// after it (see [`super::writer`]).
    pub fn newest_pack(&self) -> Option<Uuid> {
        let newest_indexed = self.read().keys().next_back().copied();
        let newest_left_open = self.left_open.read().unwrap_or_else(|poisoned| poisoned.into_inner()).last().copied();
        newest_indexed.max(newest_left_open)
    }

    pub fn holds_pack(&self, pack_id: Uuid) -> bool {
        self.read().contains_key(&pack_id)
    }

    /// Packs that may hold `capture_id`, newest first (a retried capture id lives in the newest pack).
    pub fn candidates(&self, capture_id: Uuid) -> Vec<Candidate> {
        let wanted = fingerprint(capture_id);
        let packs = self.read();
        let mut found = Vec::new();
        for (pack_id, ids) in packs.iter().rev() {
            match ids {
                PackIds::Open(records) => found.extend(
                    records
                        .iter()
                        .rev()
                        .filter(|(fingerprint, _)| *fingerprint == wanted)
                        .map(|(_, place)| Candidate { pack_id: *pack_id, place_opt: Some(*place) }),
                ),
                PackIds::Sealed(sorted) => {
                    if sorted.binary_search(&wanted).is_ok() {
                        found.push(Candidate { pack_id: *pack_id, place_opt: None });
                    }
                }
            }
        }
        found
    }

    /// Captures indexed (for status and tests).
    pub fn len(&self) -> usize {
        self.read()
            .values()
            .map(|ids| match ids {
                PackIds::Open(records) => records.len(),
                PackIds::Sealed(sorted) => sorted.len(),
            })
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<Uuid, PackIds>> {
        self.packs.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn left_open_set(&self) -> std::sync::RwLockWriteGuard<'_, BTreeSet<Uuid>> {
        self.left_open.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<Uuid, PackIds>> {
        self.packs.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::CaptureMeta;

    fn entry(capture_id: Uuid, offset: u64) -> IndexEntry {
        IndexEntry {
            meta: CaptureMeta {
                capture_id,
                stream: "s".into(),
                captured_at_ns: 0,
                labels: Default::default(),
                content_type: None,
                source_name: None,
            },
            record_offset: offset,
            record_len: 10,
            payload_offset: offset + 5,
            payload_len: 5,
            crc32c: 1,
        }
    }

    #[test]
    fn open_records_are_found_with_their_place_and_sealed_ones_by_pack() {
        let index = SpoolIndex::default();
        let (open_pack, sealed_pack) = (Uuid::now_v7(), Uuid::now_v7());
        let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        index.add_open(open_pack, &entry(a, 40));
        index.add_open(open_pack, &entry(b, 50));
        index.add_sealed(sealed_pack, &[entry(c, 40)]);
        let found = index.candidates(b);
        assert_eq!(found.len(), 1);
        assert_eq!((found[0].pack_id, found[0].place_opt.map(|p| p.record_offset)), (open_pack, Some(50)));
        assert_eq!(index.candidates(c), vec![Candidate { pack_id: sealed_pack, place_opt: None }]);
        assert!(index.candidates(Uuid::now_v7()).is_empty());

        index.mark_sealed(open_pack);
        assert_eq!(index.candidates(a), vec![Candidate { pack_id: open_pack, place_opt: None }]);
        assert_eq!(index.len(), 3);
        index.forget(open_pack);
        assert!(index.candidates(a).is_empty() && !index.holds_pack(open_pack));
        assert!(index.holds_pack(sealed_pack));
    }

    #[test]
    fn the_oldest_pack_left_open_is_kept_until_it_is_sealed_or_forgotten() {
        let index = SpoolIndex::default();
        let (older, newer, current) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        for pack_id in [older, newer, current] {
            index.add_open(pack_id, &entry(Uuid::now_v7(), 40));
        }
        assert_eq!(index.oldest_left_open(), None, "an open pack is not left open");
        index.mark_left_open(newer);
        index.mark_left_open(older);
        assert_eq!(index.oldest_left_open(), Some(older));
        assert_eq!(index.left_open_packs(), vec![older, newer]);
        index.mark_sealed(older);
        assert_eq!(index.oldest_left_open(), Some(newer));
        index.forget(newer);
        assert_eq!(index.oldest_left_open(), None);
        index.mark_left_open(current);
        index.add_sealed(current, &[entry(Uuid::now_v7(), 40)]);
        assert_eq!(index.left_open_packs(), Vec::<Uuid>::new());
    }

    #[test]
    fn the_newest_pack_is_the_highest_id_of_every_pack_held() {
        let index = SpoolIndex::default();
        assert_eq!(index.newest_pack(), None);
        let (sealed, open, left_open) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        index.add_sealed(sealed, &[entry(Uuid::now_v7(), 40)]);
        assert_eq!(index.newest_pack(), Some(sealed));
        index.add_open(open, &entry(Uuid::now_v7(), 40));
        assert_eq!(index.newest_pack(), Some(open));
        index.mark_left_open(left_open);
        assert_eq!(index.newest_pack(), Some(left_open), "a pack left open counts before it is re-indexed");
        index.forget(left_open);
        index.forget(open);
        assert_eq!(index.newest_pack(), Some(sealed));
    }

    #[test]
    fn a_retried_capture_id_is_found_newest_pack_first() {
        let index = SpoolIndex::default();
        let id = Uuid::now_v7();
        let (older, newer) = (Uuid::now_v7(), Uuid::now_v7());
        index.add_sealed(older, &[entry(id, 40)]);
        index.add_open(newer, &entry(id, 40));
        let packs: Vec<Uuid> = index.candidates(id).iter().map(|candidate| candidate.pack_id).collect();
        assert_eq!(packs, vec![newer, older]);
    }
}
