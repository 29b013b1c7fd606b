//! Uploading a sealed pack: `PutMode::Create` (or a durable link on `file://`), multipart streaming for large packs,
//! the compare of an object already at the key, and the HEAD that verifies the size. The protocol is in the module
//! doc of [`crate::bucket`].

use std::path::Path as FsPath;

use bytes::{Bytes, BytesMut};
use object_store::path::Path;
use object_store::{
    Attribute, AttributeValue, Attributes, PutMode, PutMultipartOptions, PutOptions, PutPayload, WriteMultipart,
};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use super::error::{BucketError, BucketErrorKind};
use super::{local_dir, Bucket, MULTIPART_PARTS_IN_FLIGHT};
use crate::pack::{PackSummary, FOOTER_HEADER_LEN, HEADER_LEN, TRAILER_LEN};

/// The result of a successful [`Bucket::upload_pack`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadOutcome {
    pub key: String,
    /// The object was already there with the same size and trailer (an earlier attempt uploaded it).
    pub already_present: bool,
}

impl Bucket {
    /// Uploads a sealed pack to its key, verifies it, and says whether it was already there. See the module doc.
    pub async fn upload_pack(&self, local_path: &FsPath, summary: &PackSummary) -> Result<UploadOutcome, BucketError> {
        self.upload_pack_to(local_path, summary, self.pack_key(summary)).await
    }

    /// [`Bucket::upload_pack`] to `key` (a compacted pack's, see [`Bucket::compacted_pack_key`]).
    pub async fn upload_pack_to(
        &self,
        local_path: &FsPath,
        summary: &PackSummary,
        key: Path,
    ) -> Result<UploadOutcome, BucketError> {
        let _permit = self
            .upload_permits
            .acquire()
            .await
            .map_err(|_| BucketError::new(BucketErrorKind::Permanent, "upload permits closed"))?;
        let local = LocalPack::open(local_path).await?;
        if local.size != summary.bytes {
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!("{} is {} bytes but its summary says {}", local_path.display(), local.size, summary.bytes),
            ));
        }
        let attributes = self.pack_attributes(summary);
        let outcome = self
            .with_retries("upload pack", &key, || self.upload_once(local_path, &local, &key, attributes.clone()))
            .await?;
        tracing::debug!(key = %key, bytes = local.size, already_present = outcome.already_present, "pack uploaded");
        Ok(outcome)
    }

    async fn upload_once(
        &self,
        local_path: &FsPath,
        local: &LocalPack,
        key: &Path,
        attributes: Attributes,
    ) -> Result<UploadOutcome, BucketError> {
        if let Some(local_dir) = &self.local_dir {
            let (local_dir, key_owned, pack) = (local_dir.clone(), key.clone(), local_path.to_path_buf());
            let placed = tokio::task::spawn_blocking(move || local_dir::place_pack(&local_dir, &key_owned, &pack))
                .await
                .map_err(|error| BucketError::new(BucketErrorKind::Transient, format!("place {key}: {error}")))?
                .map_err(|error| {
                    BucketError::local_io(format_args!("place {} at {key}", local_path.display()), error)
                })?;
            if placed == local_dir::Placed::AlreadyExists {
                return self.compare_existing(key, local, None).await;
            }
        } else if local.size <= self.part_size {
            let contents = tokio::fs::read(local_path)
                .await
                .map_err(|error| BucketError::local_io(format_args!("read {}", local_path.display()), error))?;
            let options = PutOptions { mode: PutMode::Create, attributes, ..Default::default() };
            match self.store.put_opts(key, PutPayload::from(contents), options).await {
                Ok(_) => {}
                Err(object_store::Error::AlreadyExists { .. }) => return self.compare_existing(key, local, None).await,
                Err(error) => return Err(BucketError::from_store(format_args!("put {key}"), error)),
            }
        } else {
            match self.store.head(key).await {
                Ok(meta) => return self.compare_existing(key, local, Some(meta.size)).await,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(error) => return Err(BucketError::from_store(format_args!("head {key}"), error)),
            }
            self.put_multipart(local_path, key, attributes).await?;
        }
        let meta =
            self.store.head(key).await.map_err(|error| BucketError::from_store(format_args!("head {key}"), error))?;
        if meta.size != local.size {
            return Err(BucketError::new(
                BucketErrorKind::Conflict,
                format!("{key} is {} bytes after upload, the pack is {}", meta.size, local.size),
            ));
        }
        Ok(UploadOutcome { key: key.to_string(), already_present: false })
    }

    async fn put_multipart(&self, local_path: &FsPath, key: &Path, attributes: Attributes) -> Result<(), BucketError> {
        let options = PutMultipartOptions { attributes, ..Default::default() };
        let upload = self
            .store
            .put_multipart_opts(key, options)
            .await
            .map_err(|error| BucketError::from_store(format_args!("start multipart upload of {key}"), error))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, self.part_size as usize);
        let streamed = async {
            let mut file = tokio::fs::File::open(local_path)
                .await
                .map_err(|error| BucketError::local_io(format_args!("open {}", local_path.display()), error))?;
            loop {
                writer
                    .wait_for_capacity(MULTIPART_PARTS_IN_FLIGHT)
                    .await
                    .map_err(|error| BucketError::from_store(format_args!("upload part of {key}"), error))?;
                self.liveness.progress();
                let part = read_up_to(&mut file, self.part_size as usize)
                    .await
                    .map_err(|error| BucketError::local_io(format_args!("read {}", local_path.display()), error))?;
                if part.is_empty() {
                    return Ok(());
                }
                writer.put(part);
            }
        }
        .await;
        if let Err(error) = streamed {
            // Best effort: a dangling upload costs storage until the bucket's lifecycle rule removes it.
            if let Err(abort_error) = writer.abort().await {
                tracing::warn!(key = %key, error = %abort_error, "multipart abort failed");
            }
            return Err(error);
        }
        writer
            .finish()
            .await
            .map_err(|error| BucketError::from_store(format_args!("complete multipart upload of {key}"), error))?;
        Ok(())
    }

    /// An object already sits at `key`: the same pack (size and trailer equal) or a conflict.
    async fn compare_existing(
        &self,
        key: &Path,
        local: &LocalPack,
        size_opt: Option<u64>,
    ) -> Result<UploadOutcome, BucketError> {
        let remote_size = match size_opt {
            Some(size) => size,
            None => {
                self.store
                    .head(key)
                    .await
                    .map_err(|error| BucketError::from_store(format_args!("head {key}"), error))?
                    .size
            }
        };
        if remote_size != local.size {
            return Err(BucketError::new(
                BucketErrorKind::Conflict,
                format!("{key} already exists with {remote_size} bytes, the pack has {}", local.size),
            ));
        }
        let trailer_range = remote_size - TRAILER_LEN as u64..remote_size;
        let remote_trailer = self
            .store
            .get_range(key, trailer_range)
            .await
            .map_err(|error| BucketError::from_store(format_args!("read trailer of {key}"), error))?;
        if remote_trailer.as_ref() != local.trailer.as_slice() {
            return Err(BucketError::new(
                BucketErrorKind::Conflict,
                format!("{key} already exists with the same size but a different trailer (sha-256)"),
            ));
        }
        Ok(UploadOutcome { key: key.to_string(), already_present: true })
    }

    fn pack_attributes(&self, summary: &PackSummary) -> Attributes {
        let mut attributes = Attributes::new();
        if !self.supports_metadata {
            return attributes;
        }
        let names = self.metadata_names();
        attributes.insert(Attribute::Metadata(names.sha256.into()), AttributeValue::from(summary.sha256_hex.clone()));
        attributes.insert(Attribute::Metadata(names.records.into()), AttributeValue::from(summary.records.to_string()));
        attributes
    }
}

/// What upload needs from the local file: its size and its last [`TRAILER_LEN`] bytes.
struct LocalPack {
    size: u64,
    trailer: Vec<u8>,
}

impl LocalPack {
    async fn open(path: &FsPath) -> Result<LocalPack, BucketError> {
        let context = || format!("read {}", path.display());
        let mut file = tokio::fs::File::open(path).await.map_err(|error| BucketError::local_io(context(), error))?;
        let size = file.metadata().await.map_err(|error| BucketError::local_io(context(), error))?.len();
        if size < (HEADER_LEN + FOOTER_HEADER_LEN + TRAILER_LEN) as u64 {
            return Err(BucketError::new(
                BucketErrorKind::InvalidPack,
                format!("{} is {size} bytes, too small to be a sealed pack", path.display()),
            ));
        }
        file.seek(std::io::SeekFrom::Start(size - TRAILER_LEN as u64))
            .await
            .map_err(|error| BucketError::local_io(context(), error))?;
        let mut trailer = vec![0u8; TRAILER_LEN];
        file.read_exact(&mut trailer).await.map_err(|error| BucketError::local_io(context(), error))?;
        Ok(LocalPack { size, trailer })
    }
}

/// Reads until `limit` bytes or end of file.
async fn read_up_to(file: &mut tokio::fs::File, limit: usize) -> std::io::Result<Bytes> {
    let mut buffer = BytesMut::zeroed(limit);
    let mut filled = 0;
    while filled < limit {
        let read = file.read(&mut buffer[filled..]).await?;
        if read == 0 {
            break;
        }
        filled += read;
    }
    buffer.truncate(filled);
    Ok(buffer.freeze())
}
