//! Reading captures back: the catalog says where a capture is, one range read fetches its record, the CRC proves the
//! bytes. A capture whose pack is still in the local spool (not yet uploaded, or uploaded and owed) is read from there,
//! including captures not published yet.
//!
//! Local reads run on the blocking pool, never on the runtime's workers. With the spool's index
//! ([`crate::spool::index`], the daemon's case) a read opens only the pack that holds the capture: one positioned read
//! for a pack still being written, its footer and the record for a sealed one. Without it (an offline `capstore get`
//! on a stopped daemon's spool) every local pack is looked at.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt;

use uuid::Uuid;

use crate::bucket::{Bucket, BucketError, BucketErrorKind};
use crate::catalog::query::{CaptureLocation, CatalogReader, MULTI_GET_BATCH};
use crate::pack::{self, CaptureMeta, PackFile};
use crate::spool::index::{Candidate, RecordPlace, SpoolIndex};
use crate::spool::{list_packs, PackState, SpoolPaths};

/// The most ids one [`Reader::get_many`] call answers with one catalog statement.
pub const GET_MANY_MAX: usize = MULTI_GET_BATCH;
/// Bucket packs one [`Reader::get_many`] reads at once.
const PACKS_IN_FLIGHT: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Catalog(#[from] crate::catalog::CatalogError),
    #[error(transparent)]
    Bucket(#[from] crate::bucket::BucketError),
    #[error("pack {pack}: {source}")]
    Pack { pack: String, source: pack::PackError },
    #[error("spool: {0}")]
    Spool(#[from] std::io::Error),
    #[error("capture {capture_id}: the record at its catalog location belongs to {found}")]
    WrongRecord { capture_id: Uuid, found: Uuid },
}

impl ReadError {
    /// True for a failure of the record or its pack object alone (the object is gone or not a pack, the record
    /// fails its checks or is another capture's): retrying cannot help, and the other captures of a bulk read are
    /// still read. Anything else (the catalog, the bucket's service, the spool's disk) fails the whole read.
    pub fn is_the_records_own(&self) -> bool {
        match self {
            // (An i/o error reading a pack is the disk's or the network's, not the record's.)
            ReadError::Pack { source: pack::PackError::Io(_), .. } => false,
            ReadError::Pack { .. } | ReadError::WrongRecord { .. } => true,
            ReadError::Bucket(error) => matches!(error.kind, BucketErrorKind::NotFound | BucketErrorKind::InvalidPack),
            ReadError::Catalog(_) | ReadError::Spool(_) => false,
        }
    }
}

/// What a bulk read found for one id.
#[derive(Debug)]
pub enum Found {
    Capture(ReadCapture),
    /// Neither the catalog nor the spool knows the id.
    Unknown,
    /// A deletion, at this version: met by a read of the log of publishes (a version-range export); reads of ids
    /// asked for report it as [`Found::Unknown`] ([`Reader::read_asked`]).
    Deleted {
        version: u64,
    },
    /// The catalog places it in a record that cannot be read ([`ReadError::is_the_records_own`]): the reason, which
    /// names the pack's key (for the log and the CLI; never sent over HTTP).
    Unreadable(String),
}

/// Where a capture was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Spool,
    Bucket,
}

#[derive(Debug, Clone)]
pub struct ReadCapture {
    pub meta: CaptureMeta,
    pub payload: Vec<u8>,
    pub source: Source,
    /// Catalog version, when published.
    pub version: Option<u64>,
}

/// The local spool a reader may read from, and its index when the spool is live.
#[derive(Debug, Clone)]
pub struct LocalSpool {
    pub paths: SpoolPaths,
    pub index_opt: Option<Arc<SpoolIndex>>,
}

pub struct Reader {
    catalog: CatalogReader,
    bucket: Arc<Bucket>,
    spool_opt: Option<LocalSpool>,
}

impl Reader {
    pub fn new(catalog: CatalogReader, bucket: Arc<Bucket>, spool_opt: Option<LocalSpool>) -> Reader {
        Reader { catalog, bucket, spool_opt }
    }

    pub fn catalog(&self) -> &CatalogReader {
        &self.catalog
    }

    /// The capture's bytes, verified; `None` if neither the catalog nor the local spool knows it.
    pub async fn get(&self, capture_id: Uuid) -> Result<Option<ReadCapture>, ReadError> {
        match self.catalog.lookup(capture_id, None).await? {
            // Deleted: not looked for in the spool either, where its pack may linger a moment after its publish.
            Some(deletion) if deletion.is_deletion() => Ok(None),
            Some(location) => {
                let pack_id = Uuid::parse_str(&location.pack_id).ok();
                if let Some(found) = self.read_from_spool(capture_id, pack_id).await? {
                    return Ok(Some(ReadCapture { version: Some(location.version), ..found }));
                }
                self.read_from_bucket(capture_id, &location).await.map(Some)
            }
            None => self.read_from_spool(capture_id, None).await,
        }
    }

    /// Whether the local spool's pack `pack_id` holds `capture_id` (the record read and its id checked: the spool
    /// index alone knows fingerprints, which collide).
    pub async fn spool_holds(&self, capture_id: Uuid, pack_id: Uuid) -> Result<bool, ReadError> {
        Ok(self.read_from_spool(capture_id, Some(pack_id)).await?.is_some())
    }

    /// Several captures at once, in the order asked, each id once ([`Found::Unknown`] for an id neither the catalog
    /// nor the spool knows, [`Found::Unreadable`] for a damaged record or a lost pack object): one catalog statement for the whole list (at most [`GET_MANY_MAX`] ids), captures of local packs
    /// read from the spool, and each bucket pack's records fetched by one `get_ranges` call, which merges records
    /// less than 1 MiB apart into one ranged GET (object_store's default gap: a GET costs far more than a megabyte of
    /// transfer on every backend), [`PACKS_IN_FLIGHT`] packs at a time.
    pub async fn get_many(&self, ids: &[Uuid]) -> Result<Vec<(Uuid, Found)>, ReadError> {
        let unique = crate::util::unique_ids(ids);
        let mut locations = self.catalog.newest_rows(&unique).await?;
        let located = unique.into_iter().map(|id| (id, locations.remove(&id))).collect();
        self.read_asked(located).await
    }

    /// [`Reader::read_located`] of ids a caller asked for, located by [`CatalogReader::newest_rows`]: a deleted one
    /// is [`Found::Unknown`] to it (and not looked for in the spool, where its pack may linger a moment after its
    /// publish).
    pub async fn read_asked(
        &self,
        located: Vec<(Uuid, Option<CaptureLocation>)>,
    ) -> Result<Vec<(Uuid, Found)>, ReadError> {
        let found = self.read_located(located).await?;
        Ok(found
            .into_iter()
            .map(|(id, found)| match found {
                Found::Deleted { .. } => (id, Found::Unknown),
                found => (id, found),
            })
            .collect())
    }

    /// Captures whose catalog locations are known already (a listing page's, or `None` for ids the catalog does not
    /// know, which are looked for in the spool): read as [`Reader::get_many`] reads them, in the order given (an id
    /// given twice, as a version-range export gives a re-posted one, is read at each of its locations).
    pub async fn read_located(
        &self,
        located: Vec<(Uuid, Option<CaptureLocation>)>,
    ) -> Result<Vec<(Uuid, Found)>, ReadError> {
        let ids: Vec<Uuid> = located.iter().map(|(id, _)| *id).collect();
        let mut found: Vec<Option<Found>> = (0..located.len()).map(|_| None).collect();
        // Positions in `located`, per bucket pack.
        let mut from_bucket: BTreeMap<String, Vec<(usize, Uuid, CaptureLocation)>> = BTreeMap::new();
        for (position, (id, location)) in located.into_iter().enumerate() {
            if let Some(deletion) = location.as_ref().filter(|location| location.is_deletion()) {
                found[position] = Some(Found::Deleted { version: deletion.version });
                continue;
            }
            let pack_id = location.as_ref().and_then(|location| Uuid::parse_str(&location.pack_id).ok());
            if let Some(local) = self.read_from_spool(id, pack_id).await? {
                let version = location.map(|location| location.version);
                found[position] = Some(Found::Capture(ReadCapture { version, ..local }));
            } else if let Some(location) = location {
                from_bucket.entry(location.object_key.clone()).or_default().push((position, id, location));
            }
        }
        let packs: Vec<Result<Vec<(usize, Found)>, ReadError>> = futures::stream::iter(from_bucket)
            .map(|(key, records)| self.read_records_of_pack(key, records, true))
            .buffer_unordered(PACKS_IN_FLIGHT)
            .collect()
            .await;
        for pack in packs {
            for (position, read) in pack? {
                found[position] = Some(read);
            }
        }
        Ok(ids.into_iter().zip(found).map(|(id, read)| (id, read.unwrap_or(Found::Unknown))).collect())
    }

    /// The records of one bucket pack, fetched together; a failure of the pack object or of one record is that
    /// pack's or record's [`Found::Unreadable`], any other fails the read. With `follow_moves`, records of a pack
    /// that is gone from the bucket are read where compaction moved them (see [`Reader::read_moved`]).
    async fn read_records_of_pack(
        &self,
        key: String,
        records: Vec<(usize, Uuid, CaptureLocation)>,
        follow_moves: bool,
    ) -> Result<Vec<(usize, Found)>, ReadError> {
        let fetched: Result<Vec<_>, ReadError> = async {
            let ranges =
                records.iter().map(|(_, _, location)| record_range(location)).collect::<Result<Vec<_>, _>>()?;
            Ok(self.bucket.read_ranges(&key, &ranges).await?)
        }
        .await;
        let bytes = match fetched {
            Ok(bytes) => bytes,
            Err(ReadError::Bucket(error))
                if error.kind == BucketErrorKind::NotFound && !self.bucket.holds_objects().await? =>
            {
                return Err(ReadError::Bucket(BucketError {
                    kind: BucketErrorKind::Transient,
                    message: format!("{error}; the bucket lists no object under the catalog prefix: is it mounted, the right bucket, the right prefix?"),
                    source: None,
                }));
            }
            Err(error) => {
                let gone = matches!(&error, ReadError::Bucket(error) if error.kind == BucketErrorKind::NotFound);
                let reason = own_failure(error)?;
                if gone && follow_moves {
                    return self.read_moved(records, reason).await;
                }
                return Ok(records
                    .into_iter()
                    .map(|(position, _, _)| (position, Found::Unreadable(reason.clone())))
                    .collect());
            }
        };
        records
            .into_iter()
            .zip(bytes)
            .map(|((position, id, location), bytes)| match decode_located(id, &location, &bytes) {
                Ok(capture) => Ok((position, Found::Capture(capture))),
                Err(error) => Ok((position, Found::Unreadable(own_failure(error)?))),
            })
            .collect()
    }

    /// Records located in a pack that is gone from the bucket: compaction replaced it and its grace period is over
    /// (a version-range export, or a listing paged with a cursor older than `lifecycle.read_grace`). A record whose
    /// capture's newest committed row is the same record elsewhere (same CRC and length: a move) is read there,
    /// reported at the version it was asked at; any other (deleted, and so erased, or posted again) is
    /// [`Found::Unreadable`] with `reason`.
    async fn read_moved(
        &self,
        records: Vec<(usize, Uuid, CaptureLocation)>,
        reason: String,
    ) -> Result<Vec<(usize, Found)>, ReadError> {
        let ids: Vec<Uuid> = records.iter().map(|(_, id, _)| *id).collect();
        let newest = self.catalog.newest_rows(&crate::util::unique_ids(&ids)).await?;
        let mut moved: BTreeMap<String, Vec<(usize, Uuid, CaptureLocation)>> = BTreeMap::new();
        let mut found = Vec::new();
        for (position, id, old) in records {
            match newest.get(&id) {
                Some(new)
                    if !new.is_deletion()
                        && new.object_key != old.object_key
                        && (new.crc32c, new.record_len) == (old.crc32c, old.record_len) =>
                {
                    let at_new = CaptureLocation { version: old.version, ..new.clone() };
                    moved.entry(new.object_key.clone()).or_default().push((position, id, at_new));
                }
                _ => found.push((position, Found::Unreadable(reason.clone()))),
            }
        }
        for (key, records) in moved {
            found.extend(Box::pin(self.read_records_of_pack(key, records, false)).await?);
        }
        Ok(found)
    }

    async fn read_from_bucket(&self, capture_id: Uuid, location: &CaptureLocation) -> Result<ReadCapture, ReadError> {
        let bytes = self.bucket.read_range(&location.object_key, record_range(location)?).await?;
        decode_located(capture_id, location, &bytes)
    }

    /// Look in the local spool, off the runtime: only pack `pack_id_opt` when given (the catalog's location).
    async fn read_from_spool(
        &self,
        capture_id: Uuid,
        pack_id_opt: Option<Uuid>,
    ) -> Result<Option<ReadCapture>, ReadError> {
        let Some(spool) = self.spool_opt.clone() else { return Ok(None) };
        if let (Some(index), Some(pack_id)) = (&spool.index_opt, pack_id_opt) {
            // Most published captures are no longer local: answer that without leaving the runtime.
            if !index.holds_pack(pack_id) {
                return Ok(None);
            }
        }
        let read = tokio::task::spawn_blocking(move || match &spool.index_opt {
            Some(index) => read_indexed(&spool.paths, index, capture_id, pack_id_opt),
            None => read_by_scanning(&spool.paths, capture_id, pack_id_opt),
        });
        let found = read.await.map_err(std::io::Error::other)??;
        Ok(found.map(|(meta, payload)| ReadCapture { meta, payload, source: Source::Spool, version: None }))
    }
}

/// The reason, when `error` is the record's own ([`ReadError::is_the_records_own`]); the error itself otherwise.
fn own_failure(error: ReadError) -> Result<String, ReadError> {
    if error.is_the_records_own() {
        Ok(error.to_string())
    } else {
        Err(error)
    }
}

/// The bytes of the record the catalog places at `location`.
fn record_range(location: &CaptureLocation) -> Result<Range<u64>, ReadError> {
    let end = location.record_offset.checked_add(location.record_len).ok_or_else(|| ReadError::Pack {
        pack: location.object_key.clone(),
        source: pack::PackError::Invalid {
            what: "catalog location",
            reason: format!("offset {} + length {} overflows", location.record_offset, location.record_len),
        },
    })?;
    Ok(location.record_offset..end)
}

/// The capture in `bytes`, the record read at `location`, its CRC checked and its id the one asked for.
fn decode_located(capture_id: Uuid, location: &CaptureLocation, bytes: &[u8]) -> Result<ReadCapture, ReadError> {
    let pack_error = |source| ReadError::Pack { pack: location.object_key.clone(), source };
    let entry = pack::entry_from_location(
        bytes,
        location.record_offset,
        location.payload_offset,
        location.payload_len,
        location.crc32c,
    )
    .map_err(pack_error)?;
    let (meta, payload) = pack::decode_record(bytes, &entry).map_err(pack_error)?;
    if meta.capture_id != capture_id {
        return Err(ReadError::WrongRecord { capture_id, found: meta.capture_id });
    }
    Ok(ReadCapture { meta, payload, source: Source::Bucket, version: Some(location.version) })
}

/// A capture found in the local spool, or not.
type InSpool = Option<(CaptureMeta, Vec<u8>)>;

/// Blocking: the packs the index names (only `pack_id_opt` when given), newest first.
fn read_indexed(
    paths: &SpoolPaths,
    index: &SpoolIndex,
    capture_id: Uuid,
    pack_id_opt: Option<Uuid>,
) -> Result<InSpool, ReadError> {
    let candidates = index.candidates(capture_id);
    for Candidate { pack_id, place_opt } in candidates {
        if pack_id_opt.is_some_and(|wanted| wanted != pack_id) {
            continue;
        }
        // The pack may move on between the lookup and the read: try its states in the order it passes them.
        for state in PackState::ALL {
            let path = paths.pack_path(pack_id, state);
            let found = match place_opt {
                Some(place) => read_at_place(&path, &place),
                None if state == PackState::Open => continue,
                None => read_sealed_pack(&path, capture_id),
            };
            match found {
                Ok(Some((meta, payload))) if meta.capture_id == capture_id => return Ok(Some((meta, payload))),
                // A fingerprint that collided, or a record of another capture: look on.
                Ok(_) => break,
                Err(pack::PackError::Io(error)) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(ReadError::Pack { pack: pack_id.to_string(), source }),
            }
        }
    }
    Ok(None)
}

/// Blocking: every local pack (only `pack_id_opt` when given), newest first as the index is read (the last post of
/// an id posted again is in the newest pack), open ones by a read-only scan.
fn read_by_scanning(paths: &SpoolPaths, capture_id: Uuid, pack_id_opt: Option<Uuid>) -> Result<InSpool, ReadError> {
    if !paths.packs.is_dir() {
        return Ok(None);
    }
    for listing in list_packs(paths)?.into_iter().rev() {
        if pack_id_opt.is_some_and(|pack_id| pack_id != listing.pack_id) {
            continue;
        }
        let found = match listing.state {
            PackState::Open => read_open_pack(&listing.path, capture_id),
            PackState::Sealed | PackState::Uploaded => read_sealed_pack(&listing.path, capture_id),
        };
        match found {
            Ok(Some(found)) => return Ok(Some(found)),
            Ok(None) => {}
            // The pack moved on (uploaded, published and deleted) while we looked: not an error.
            Err(pack::PackError::Io(error)) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(ReadError::Pack { pack: listing.pack_id.to_string(), source }),
        }
    }
    Ok(None)
}

/// One positioned read of a record whose place the index knows.
fn read_at_place(path: &Path, place: &RecordPlace) -> Result<InSpool, pack::PackError> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path)?;
    let mut bytes = vec![0u8; place.record_len as usize];
    file.read_exact_at(&mut bytes, place.record_offset)?;
    let entry =
        pack::entry_from_location(&bytes, place.record_offset, place.payload_offset, place.payload_len, place.crc32c)?;
    pack::decode_record(&bytes, &entry).map(Some)
}

fn read_sealed_pack(path: &Path, capture_id: Uuid) -> Result<InSpool, pack::PackError> {
    let pack = PackFile::open(path)?;
    match pack.find(capture_id) {
        Some(index) => pack.read_capture(index).map(Some),
        None => Ok(None),
    }
}

fn read_open_pack(path: &Path, capture_id: Uuid) -> Result<InSpool, pack::PackError> {
    use std::os::unix::fs::FileExt;
    let scan = pack::scan_file(path)?;
    // The last post of an id posted twice into the pack, as for a sealed pack.
    let Some(entry) = scan.entries.iter().rev().find(|entry| entry.meta.capture_id == capture_id) else {
        return Ok(None);
    };
    let file = std::fs::File::open(path)?;
    let mut bytes = vec![0u8; entry.record_len as usize];
    file.read_exact_at(&mut bytes, entry.record_offset)?;
    pack::decode_record(&bytes, entry).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{IndexEntry, PackWriter};

    fn meta(capture_id: Uuid) -> CaptureMeta {
        CaptureMeta {
            capture_id,
            stream: "s".into(),
            captured_at_ns: 1,
            labels: Default::default(),
            content_type: None,
            source_name: None,
        }
    }

    /// A spool directory with its packs directory (kept while the returned guard lives).
    fn empty_spool() -> (tempfile::TempDir, SpoolPaths) {
        let dir = tempfile::tempdir().unwrap();
        let paths = SpoolPaths::new(dir.path());
        std::fs::create_dir_all(&paths.packs).unwrap();
        (dir, paths)
    }

    /// A sealed pack of one capture in the spool at `paths`; returns its entries.
    fn sealed_pack(paths: &SpoolPaths, capture_id: Uuid, payload: &[u8]) -> (Uuid, Vec<IndexEntry>) {
        let pack_id = Uuid::now_v7();
        let mut writer = PackWriter::create(&paths.pack_path(pack_id, PackState::Sealed), pack_id, 1).unwrap();
        writer.append(&meta(capture_id), bytes::Bytes::copy_from_slice(payload)).unwrap();
        let entries = writer.entries().to_vec();
        writer.finish().unwrap();
        (pack_id, entries)
    }

    #[test]
    fn an_indexed_read_opens_only_the_pack_that_holds_the_capture() {
        let (_dir, paths) = empty_spool();
        let index = SpoolIndex::default();
        let (wanted, other) = (Uuid::now_v7(), Uuid::now_v7());
        let (damaged_pack, damaged_entries) = sealed_pack(&paths, other, b"other");
        index.add_sealed(damaged_pack, &damaged_entries);
        let (pack, entries) = sealed_pack(&paths, wanted, b"wanted");
        index.add_sealed(pack, &entries);
        // Ruin the other pack's trailer: any read that opens it fails.
        let damaged_path = paths.pack_path(damaged_pack, PackState::Sealed);
        let length = std::fs::metadata(&damaged_path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&damaged_path).unwrap().set_len(length - 1).unwrap();

        let (found_meta, payload) = read_indexed(&paths, &index, wanted, None).unwrap().unwrap();
        assert_eq!((found_meta.capture_id, payload.as_slice()), (wanted, &b"wanted"[..]));
        assert!(read_indexed(&paths, &index, Uuid::now_v7(), None).unwrap().is_none(), "an unknown id opens nothing");
        // The scan a reader without the index does opens every pack, the damaged one included.
        assert!(read_by_scanning(&paths, Uuid::now_v7(), None).is_err());
    }

    #[test]
    fn a_record_of_an_open_pack_is_read_at_its_place_even_after_the_pack_moved_on() {
        let (_dir, paths) = empty_spool();
        let index = SpoolIndex::default();
        let capture_id = Uuid::now_v7();
        let pack_id = Uuid::now_v7();
        let mut writer = PackWriter::create(&paths.pack_path(pack_id, PackState::Open), pack_id, 1).unwrap();
        let entry = writer.append(&meta(capture_id), bytes::Bytes::from_static(b"still open")).unwrap();
        writer.sync().unwrap();
        index.add_open(pack_id, &entry);
        assert_eq!(read_indexed(&paths, &index, capture_id, None).unwrap().unwrap().1, b"still open");
        writer.finish().unwrap();
        paths.mark_sealed(pack_id).unwrap();
        assert_eq!(read_indexed(&paths, &index, capture_id, Some(pack_id)).unwrap().unwrap().1, b"still open");
    }

    #[test]
    fn an_id_posted_again_reads_as_its_last_post_open_or_sealed_indexed_or_not() {
        let (_dir, paths) = empty_spool();
        let index = SpoolIndex::default();
        let (twice, other) = (Uuid::now_v7(), Uuid::now_v7());
        let pack_id = Uuid::now_v7();
        let mut writer = PackWriter::create(&paths.pack_path(pack_id, PackState::Open), pack_id, 1).unwrap();
        for (id, payload) in [(twice, &b"first"[..]), (other, b"other"), (twice, b"again")] {
            let entry = writer.append(&meta(id), bytes::Bytes::copy_from_slice(payload)).unwrap();
            index.add_open(pack_id, &entry);
        }
        writer.sync().unwrap();
        let payload_of = |read: Result<InSpool, _>| read.unwrap().unwrap().1;
        assert_eq!(payload_of(read_indexed(&paths, &index, twice, None)), b"again");
        assert_eq!(payload_of(read_by_scanning(&paths, twice, None)), b"again");
        let entries = writer.entries().to_vec();
        writer.finish().unwrap();
        paths.mark_sealed(pack_id).unwrap();
        let index = SpoolIndex::default();
        index.add_sealed(pack_id, &entries);
        assert_eq!(payload_of(read_indexed(&paths, &index, twice, None)), b"again");
        assert_eq!(payload_of(read_by_scanning(&paths, twice, None)), b"again");
        // Posted once more, into the next pack: that post is the capture now.
        let (newer_pack, newer_entries) = sealed_pack(&paths, twice, b"in the next pack");
        index.add_sealed(newer_pack, &newer_entries);
        assert_eq!(payload_of(read_indexed(&paths, &index, twice, None)), b"in the next pack");
        assert_eq!(payload_of(read_by_scanning(&paths, twice, None)), b"in the next pack");
    }
}
