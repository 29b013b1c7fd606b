//! Reading captures back: the catalog says where a capture is, one range read fetches its record, the CRC proves the
//! bytes. A capture whose pack is still in the local spool (not yet uploaded, or uploaded and owed) is read from there,
//! including captures not published yet.

use std::path::Path;
use std::sync::Arc;

use uuid::Uuid;

use crate::bucket::Bucket;
use crate::catalog::query::{CaptureLocation, CatalogReader};
use crate::pack::{self, CaptureMeta, PackFile};
use crate::spool::{list_packs, PackState, SpoolPaths};

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

pub struct Reader {
    catalog: CatalogReader,
    bucket: Arc<Bucket>,
    spool_opt: Option<SpoolPaths>,
}

impl Reader {
    pub fn new(catalog: CatalogReader, bucket: Arc<Bucket>, spool_opt: Option<SpoolPaths>) -> Reader {
        Reader { catalog, bucket, spool_opt }
    }

    pub fn catalog(&self) -> &CatalogReader {
        &self.catalog
    }

    /// The capture's bytes, verified; `None` if neither the catalog nor the local spool knows it.
    pub async fn get(&self, capture_id: Uuid) -> Result<Option<ReadCapture>, ReadError> {
        match self.catalog.get(capture_id, None).await? {
            Some(location) => {
                if let Some(found) = self.read_from_spool(capture_id, Some(&location.pack_id))? {
                    return Ok(Some(ReadCapture { version: Some(location.version), ..found }));
                }
                self.read_from_bucket(capture_id, &location).await.map(Some)
            }
            None => self.read_from_spool(capture_id, None),
        }
    }

    async fn read_from_bucket(&self, capture_id: Uuid, location: &CaptureLocation) -> Result<ReadCapture, ReadError> {
        let range = location.record_offset..location.record_offset + location.record_len;
        let bytes = self.bucket.read_range(&location.object_key, range).await?;
        let pack_error = |source| ReadError::Pack { pack: location.object_key.clone(), source };
        let entry = pack::entry_from_location(
            &bytes,
            location.record_offset,
            location.payload_offset,
            location.payload_len,
            location.crc32c,
        )
        .map_err(pack_error)?;
        let (meta, payload) = pack::decode_record(&bytes, &entry).map_err(pack_error)?;
        if meta.capture_id != capture_id {
            return Err(ReadError::WrongRecord { capture_id, found: meta.capture_id });
        }
        Ok(ReadCapture { meta, payload, source: Source::Bucket, version: Some(location.version) })
    }

    /// Look in the local spool: only pack `pack_id` when given, else every pack (open ones by a read-only scan).
    fn read_from_spool(&self, capture_id: Uuid, pack_id_opt: Option<&str>) -> Result<Option<ReadCapture>, ReadError> {
        let Some(paths) = &self.spool_opt else { return Ok(None) };
        if !paths.packs.is_dir() {
            return Ok(None);
        }
        for listing in list_packs(paths)? {
            if pack_id_opt.is_some_and(|pack_id| pack_id != listing.pack_id.to_string()) {
                continue;
            }
            let found = match listing.state {
                PackState::Open => read_open_pack(&listing.path, capture_id),
                PackState::Sealed | PackState::Uploaded => read_sealed_pack(&listing.path, capture_id),
            };
            match found {
                Ok(Some((meta, payload))) => {
                    return Ok(Some(ReadCapture { meta, payload, source: Source::Spool, version: None }))
                }
                Ok(None) => {}
                // The pack moved on (uploaded, published and deleted) while we looked: not an error.
                Err(pack::PackError::Io(error)) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(ReadError::Pack { pack: listing.path.display().to_string(), source }),
            }
        }
        Ok(None)
    }
}

fn read_sealed_pack(path: &Path, capture_id: Uuid) -> Result<Option<(CaptureMeta, Vec<u8>)>, pack::PackError> {
    let pack = PackFile::open(path)?;
    match pack.find(capture_id) {
        Some(index) => pack.read_capture(index).map(Some),
        None => Ok(None),
    }
}

fn read_open_pack(path: &Path, capture_id: Uuid) -> Result<Option<(CaptureMeta, Vec<u8>)>, pack::PackError> {
    use std::os::unix::fs::FileExt;
    let scan = pack::scan_file(path)?;
    let Some(entry) = scan.entries.iter().find(|entry| entry.meta.capture_id == capture_id) else { return Ok(None) };
    let file = std::fs::File::open(path)?;
    let mut bytes = vec![0u8; entry.record_len as usize];
    file.read_exact_at(&mut bytes, entry.record_offset)?;
    pack::decode_record(&bytes, entry).map(Some)
}
