//! The appender of `.open` pack files.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, IoSlice, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::codec::{
    check_meta_limits, encode_footer, encode_header, encode_meta, encode_trailer, encoded_meta_len, footer_entry_len,
    record_header_bytes,
};
use super::hasher::BackgroundHasher;
use super::scan::{scan_stream, PositionedReader};
use super::*;

/// Appends records to a `.open` pack file. Small records collect in an in-memory buffer; [`PackWriter::flush`] hands
/// the buffer to the kernel and returns a [`SyncPoint`] whose fdatasync makes every record appended so far durable
/// (the group-commit point; [`PackWriter::sync`] does both at once). Records are not durable until that fsync
/// returns; dropping the writer without it or [`PackWriter::finish`] loses the unsynced tail (recovery handles the
/// rest).
///
/// The SHA-256 for the trailer is computed by a background hasher (`hasher.rs`) from the same reference-counted buffers that are
/// written, so hashing overlaps writing and fsyncing and large payloads are never copied.
pub struct PackWriter {
    path: PathBuf,
    file: Arc<File>,
    header: PackHeader,
    /// Bytes not yet handed to the kernel: `segments` (record heads and zero-copy payloads, in file order), then
    /// `pending` (small records, copied).
    segments: Vec<Bytes>,
    segments_len: u64,
    pending: BytesMut,
    /// Buffers already written whose bytes may still wait in the hashing queue, oldest first. The first one whose bytes
    /// are hashed becomes the next `pending`, so buffers are reused rather than freshly allocated (and page-faulted).
    spare_buffers: VecDeque<BytesMut>,
    /// Bytes handed to the kernel (file length as far as this writer knows).
    written_len: u64,
    /// Whether the file's directory entry is durable: false for a created file until a sync has fsynced its directory
    /// (shared with every [`SyncPoint`], so whichever sync runs first does it, even when the syncer skips the point
    /// that was handed out first).
    dir_synced: Arc<AtomicBool>,
    /// SHA-256 of every byte written so far (`written_len` bytes), once the hashing thread catches up.
    hasher: BackgroundHasher,
    entries: Vec<IndexEntry>,
    /// Size the footer will have, kept to enforce MAX_FOOTER_BYTES at append time.
    footer_len: u64,
    meta_scratch: Vec<u8>,
    max_payload_bytes: u64,
    /// Set by a failed write here or a failed fsync of a [`SyncPoint`], possibly on another thread.
    pub(super) poisoned: Arc<Mutex<Option<String>>>,
    /// What the fsyncs of this file made durable (shared with every [`SyncPoint`]).
    durability: Arc<Durability>,
}

/// What the fsyncs of one pack file made durable: the length the last successful one covered, and whether one
/// failed. After a failed fsync Linux may go on showing the bytes whose writeback failed from its cache, and reports
/// the failure to one fsync only, so the bytes past `durable_len` are not to be trusted from then on, whatever a read
/// shows ([`PackWriter::durable_len_after_failed_fsync`]).
#[derive(Debug, Default)]
pub struct Durability {
    durable_len: AtomicU64,
    fsync_failed: AtomicBool,
}

impl Durability {
    fn with_durable_len(len: u64) -> Arc<Durability> {
        Arc::new(Durability { durable_len: AtomicU64::new(len), fsync_failed: AtomicBool::new(false) })
    }

    /// Records what an fsync of the file's first `len` bytes came to.
    fn record(&self, synced: &io::Result<()>, len: u64) {
        if synced.is_ok() {
            self.durable_len.fetch_max(len, Ordering::AcqRel);
        } else {
            self.fsync_failed.store(true, Ordering::Release);
        }
    }

    /// Once an fsync of the file failed: the length the last successful one covered (0 if none did). The bytes
    /// after it are not to be trusted, whatever reading the file shows. None while no fsync failed.
    pub fn durable_len_after_failed_fsync(&self) -> Option<u64> {
        self.fsync_failed.load(Ordering::Acquire).then(|| self.durable_len.load(Ordering::Acquire))
    }
}

impl std::fmt::Debug for PackWriter {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("PackWriter")
            .field("path", &self.path)
            .field("pack_id", &self.header.pack_id)
            .field("records", &self.entries.len())
            .field("len_bytes", &self.len_bytes())
            .field("poisoned", &self.poisoned_reason())
            .finish()
    }
}

/// Payloads at least this large are written (with writev) and hashed straight from the producer's buffer; smaller ones
/// are copied into the writer's buffer, which is cheaper than an extra segment each.
const ZERO_COPY_MIN_BYTES: usize = 16 << 10;
/// Written buffers waiting to be hashed before their reuse; beyond this many the oldest is let go.
const MAX_SPARE_BUFFERS: usize = 20;

/// The durability point of the bytes a [`PackWriter`] had written when it returned this: [`SyncPoint::sync`]
/// fdatasyncs the file (and, the first time, its directory). It may run on another thread while the writer goes on
/// appending; a failure poisons the writer, because after a failed fsync the file's tail is unknown.
#[derive(Debug, Clone)]
pub struct SyncPoint {
    path: PathBuf,
    file: Arc<File>,
    /// The file's length when this point was handed out: what its sync makes durable.
    len: u64,
    dir_synced: Arc<AtomicBool>,
    pub(super) poisoned: Arc<Mutex<Option<String>>>,
    durability: Arc<Durability>,
}

/// fdatasync, or the EIO of a failed writeback where the test failpoint `fsync_fails` says so.
fn fsync_data(file: &File) -> io::Result<()> {
    if crate::failpoint::fails("fsync_fails") {
        return Err(io::Error::from_raw_os_error(libc::EIO));
    }
    file.sync_data()
}

impl SyncPoint {
    pub fn sync(&self) -> Result<(), PackError> {
        if let Some(reason) = self.poisoned.lock().expect("poison flag lock").clone() {
            // Linux reports a writeback error to one fsync only: once failed, a later "success" proves nothing.
            return Err(PackError::Poisoned { path: self.path.clone(), reason });
        }
        let synced = fsync_data(&self.file).and_then(|()| {
            if self.dir_synced.load(Ordering::Acquire) {
                return Ok(());
            }
            crate::durable::fsync_parent_dir(&self.path).map(|()| self.dir_synced.store(true, Ordering::Release))
        });
        self.durability.record(&synced, self.len);
        if let Err(error) = synced {
            self.poisoned.lock().expect("poison flag lock").get_or_insert_with(|| error.to_string());
            return Err(PackError::Io(error));
        }
        Ok(())
    }

    /// True when both points belong to the same open file, so syncing the later one covers the earlier.
    pub fn same_file(&self, other: &SyncPoint) -> bool {
        Arc::ptr_eq(&self.file, &other.file)
    }
}

impl PackWriter {
    /// Creates a new pack file (`create_new`: an existing file is an error) and buffers its header.
    pub fn create(path: &Path, pack_id: Uuid, created_at_ns: u64) -> Result<Self, PackError> {
        let file = crate::durable::new_file_options().write(true).create_new(true).open(path)?;
        let header = PackHeader { major: FORMAT_MAJOR, minor: FORMAT_MINOR, pack_id, created_at_ns };
        let mut pending = BytesMut::with_capacity(WRITE_BUFFER_FLUSH_BYTES);
        pending.extend_from_slice(&encode_header(&header));
        Ok(PackWriter {
            path: path.to_path_buf(),
            file: Arc::new(file),
            header,
            segments: Vec::new(),
            segments_len: 0,
            pending,
            spare_buffers: VecDeque::new(),
            written_len: 0,
            dir_synced: Arc::new(AtomicBool::new(false)),
            hasher: BackgroundHasher::start(Sha256::new()),
            entries: Vec::new(),
            footer_len: FOOTER_HEADER_LEN as u64,
            meta_scratch: Vec::new(),
            max_payload_bytes: MAX_PAYLOAD_BYTES,
            poisoned: Arc::default(),
            durability: Arc::default(),
        })
    }

    /// Reopens a torn `.open` file: scans from the start, keeps every complete record whose CRC verifies, truncates the
    /// file at the end of the last good record (set_len + fsync), and returns a writer positioned there plus what was
    /// kept. A file whose header is torn or corrupt returns an error (the caller quarantines or removes it).
    pub fn recover(path: &Path) -> Result<(Self, RecoveryReport), PackError> {
        let mut file = OpenOptions::new().read(true).write(true).open(path)?;
        let total_len = file.metadata()?.len();
        let scan = {
            let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, PositionedReader::new(&file, 0));
            scan_stream(&mut reader, total_len)?
        };
        let valid_len = scan.report.valid_len;
        let bytes_cut = total_len - valid_len;
        if bytes_cut > 0 {
            file.set_len(valid_len)?;
        }
        // Whatever the file holds is made durable before anything is appended after it: so the writer knows what a
        // later failed fsync leaves durable (see `Durability`).
        file.sync_all()?;
        file.seek(SeekFrom::Start(valid_len))?;
        let report = RecoveryReport {
            records_kept: scan.report.entries.len() as u64,
            bytes_cut,
            entries: scan.report.entries.clone(),
            cut_reason: scan.report.cut_reason,
        };
        let writer = PackWriter {
            path: path.to_path_buf(),
            file: Arc::new(file),
            header: scan.report.header,
            segments: Vec::new(),
            segments_len: 0,
            pending: BytesMut::with_capacity(WRITE_BUFFER_FLUSH_BYTES),
            spare_buffers: VecDeque::new(),
            written_len: valid_len,
            dir_synced: Arc::new(AtomicBool::new(true)),
            hasher: BackgroundHasher::start(scan.hasher),
            entries: scan.report.entries,
            footer_len: scan.footer_len,
            meta_scratch: Vec::new(),
            max_payload_bytes: MAX_PAYLOAD_BYTES,
            poisoned: Arc::default(),
            durability: Durability::with_durable_len(valid_len),
        };
        Ok((writer, report))
    }

    /// Lowers the largest payload [`PackWriter::append`] accepts (default and ceiling: [`MAX_PAYLOAD_BYTES`]).
    pub fn set_max_payload_bytes(&mut self, max_payload_bytes: u64) -> Result<(), PackError> {
        if max_payload_bytes > MAX_PAYLOAD_BYTES {
            return Err(PackError::Limit {
                what: "configured max payload bytes",
                value: max_payload_bytes,
                max: MAX_PAYLOAD_BYTES,
            });
        }
        self.max_payload_bytes = max_payload_bytes;
        Ok(())
    }

    /// Why the writer is unusable, if it is: an earlier write here or fsync of one of its [`SyncPoint`]s failed.
    pub fn poisoned_reason(&self) -> Option<String> {
        self.poisoned.lock().expect("poison flag lock").clone()
    }

    fn check_usable(&self) -> Result<(), PackError> {
        match self.poisoned_reason() {
            None => Ok(()),
            Some(reason) => Err(PackError::Poisoned { path: self.path.clone(), reason }),
        }
    }

    fn poison(&mut self, error: io::Error) -> PackError {
        self.poisoned.lock().expect("poison flag lock").get_or_insert_with(|| error.to_string());
        PackError::Io(error)
    }

    /// Hands every unwritten byte (the queued segments, then `pending`) to the kernel, in order, and queues them for
    /// hashing.
    fn write_pending(&mut self) -> Result<(), PackError> {
        if !self.pending.is_empty() {
            self.segments.push(self.pending.split().freeze());
            if self.pending.capacity() < WRITE_BUFFER_FLUSH_BYTES / 4 {
                // Little room left: switch to a buffer whose bytes are hashed; this one waits for its own.
                let next = self.take_spare_buffer();
                let written = std::mem::replace(&mut self.pending, next);
                self.spare_buffers.push_back(written);
                if self.spare_buffers.len() > MAX_SPARE_BUFFERS {
                    self.spare_buffers.pop_front();
                }
            }
        }
        // One writev() per MiB, as `dd bs=1M` writes: on the machines measured, a single 4 MiB write() copied into
        // the page cache at half the speed of four 1 MiB writes. Each group is queued for hashing first, so the
        // hashing thread works on it (while it is still in cache) as this one copies it into the page cache.
        let segments = std::mem::take(&mut self.segments);
        self.segments_len = 0;
        let mut group: Vec<Bytes> = Vec::new();
        let mut group_len = 0;
        for segment in &segments {
            for piece in segment.chunks(WRITE_BUFFER_FLUSH_BYTES) {
                if group_len + piece.len() > WRITE_BUFFER_FLUSH_BYTES && !group.is_empty() {
                    self.write_group(std::mem::take(&mut group))?;
                    group_len = 0;
                }
                group_len += piece.len();
                group.push(segment.slice_ref(piece));
            }
        }
        if !group.is_empty() {
            self.write_group(group)?;
        }
        Ok(())
    }

    fn write_group(&mut self, group: Vec<Bytes>) -> Result<(), PackError> {
        let group_len: usize = group.iter().map(Bytes::len).sum();
        self.hasher.update(group.clone());
        let mut slices: Vec<IoSlice> = group.iter().map(|piece| IoSlice::new(piece)).collect();
        let mut remaining = &mut slices[..];
        while !remaining.is_empty() {
            match (&*self.file).write_vectored(remaining) {
                Ok(0) => return Err(self.poison(io::ErrorKind::WriteZero.into())),
                Ok(written) => IoSlice::advance_slices(&mut remaining, written),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(self.poison(error)),
            }
        }
        self.written_len += group_len as u64;
        Ok(())
    }

    fn take_spare_buffer(&mut self) -> BytesMut {
        let reusable = self.spare_buffers.iter_mut().position(|buffer| buffer.try_reclaim(WRITE_BUFFER_FLUSH_BYTES));
        match reusable {
            Some(index) => self.spare_buffers.remove(index).expect("the index was just found"),
            None => BytesMut::with_capacity(WRITE_BUFFER_FLUSH_BYTES),
        }
    }

    /// Appends one record after validating it against the limits. Not durable until the next sync.
    pub fn append(&mut self, meta: &CaptureMeta, payload: Bytes) -> Result<IndexEntry, PackError> {
        self.check_usable()?;
        check_meta_limits(meta)?;
        let payload_len = payload.len() as u64;
        if payload_len > self.max_payload_bytes {
            return Err(PackError::Limit { what: "payload bytes", value: payload_len, max: self.max_payload_bytes });
        }
        if self.entries.len() as u64 >= MAX_RECORDS {
            return Err(PackError::Limit {
                what: "record count",
                value: self.entries.len() as u64 + 1,
                max: MAX_RECORDS,
            });
        }
        let meta_len = encoded_meta_len(meta);
        let entry_footer_len = footer_entry_len(meta_len);
        if self.footer_len + entry_footer_len > MAX_FOOTER_BYTES {
            return Err(PackError::Limit {
                what: "footer bytes",
                value: self.footer_len + entry_footer_len,
                max: MAX_FOOTER_BYTES,
            });
        }

        self.meta_scratch.clear();
        encode_meta(meta, &mut self.meta_scratch);
        debug_assert_eq!(self.meta_scratch.len() as u64, meta_len);
        let record_offset = self.len_bytes();
        let record_len = RECORD_HEADER_LEN as u64 + meta_len + payload_len;
        let unsealed_header = record_header_bytes(meta_len as u32, payload_len as u32, 0);
        let crc = crc32c::crc32c_append(
            crc32c::crc32c_append(crc32c::crc32c(&unsealed_header[0..12]), &self.meta_scratch),
            &payload,
        );
        let record_header = record_header_bytes(meta_len as u32, payload_len as u32, crc);

        self.pending.extend_from_slice(&record_header);
        self.pending.extend_from_slice(&self.meta_scratch);
        if payload.len() >= ZERO_COPY_MIN_BYTES {
            let buffered = self.pending.split().freeze();
            self.segments_len += (buffered.len() + payload.len()) as u64;
            self.segments.push(buffered);
            self.segments.push(payload);
        } else {
            self.pending.extend_from_slice(&payload);
        }
        if self.unwritten_len() >= WRITE_BUFFER_FLUSH_BYTES as u64 {
            self.write_pending()?;
        }
        self.footer_len += entry_footer_len;

        let entry = IndexEntry {
            meta: meta.clone(),
            record_offset,
            record_len,
            payload_offset: record_offset + RECORD_HEADER_LEN as u64 + meta_len,
            payload_len,
            crc32c: crc,
        };
        debug_assert_eq!(self.len_bytes(), record_offset + record_len);
        self.entries.push(entry.clone());
        Ok(entry)
    }

    /// Hands every appended byte to the kernel (no fsync) and returns the point whose sync makes them durable.
    pub fn flush(&mut self) -> Result<SyncPoint, PackError> {
        self.check_usable()?;
        self.write_pending()?;
        let point = SyncPoint {
            path: self.path.clone(),
            file: self.file.clone(),
            dir_synced: self.dir_synced.clone(),
            poisoned: self.poisoned.clone(),
            len: self.written_len,
            durability: self.durability.clone(),
        };
        Ok(point)
    }

    /// True when `point` was returned by this writer (so a sync at seal covers it).
    pub fn same_file(&self, point: &SyncPoint) -> bool {
        Arc::ptr_eq(&self.file, &point.file)
    }

    /// The group-commit point on this thread: flush, then fdatasync. Every record appended before this call is durable
    /// when it returns. On error the writer is poisoned.
    pub fn sync(&mut self) -> Result<(), PackError> {
        self.flush()?.sync()
    }

    /// Writes footer and trailer and fsyncs. Consumes the writer; renaming the file is the caller's job.
    pub fn finish(mut self) -> Result<PackSummary, PackError> {
        self.check_usable()?;
        let footer = encode_footer(&self.entries);
        debug_assert_eq!(footer.len() as u64, self.footer_len);
        let footer_offset = self.len_bytes();
        let footer_len = footer.len() as u64;
        let footer_crc32c = crc32c::crc32c(&footer);
        self.pending.extend_from_slice(&footer);
        // Every byte before the trailer is now written, hence queued for hashing.
        self.write_pending()?;
        let sha256 = match self.hasher.finish() {
            Ok(state) => state.finalize().into(),
            Err(error) => return Err(self.poison(error)),
        };
        let trailer = Trailer {
            footer_offset,
            footer_len,
            footer_crc32c,
            record_count: self.entries.len() as u64,
            sha256,
            major: self.header.major,
            minor: self.header.minor,
        };
        self.pending.extend_from_slice(&encode_trailer(&trailer));
        self.sync()?;
        Ok(summarize(&self.header, &trailer, &self.entries))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &PackHeader {
        &self.header
    }

    pub fn pack_id(&self) -> Uuid {
        self.header.pack_id
    }

    pub fn created_at_ns(&self) -> u64 {
        self.header.created_at_ns
    }

    pub fn record_count(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Bytes of the pack so far, including the unsynced buffer (the footer and trailer are not counted).
    pub fn len_bytes(&self) -> u64 {
        self.written_len + self.unwritten_len()
    }

    pub(super) fn unwritten_len(&self) -> u64 {
        self.segments_len + self.pending.len() as u64
    }

    pub fn entries(&self) -> &[IndexEntry] {
        &self.entries
    }

    /// fdatasyncs what was handed to the kernel so far, whatever became of earlier fsyncs (a write error poisons the
    /// writer, and its sync points then fsync nothing): after a failed write, before the pack is read back. Records
    /// the outcome in [`Durability`] like any fsync of the file.
    pub fn sync_written(&self) -> io::Result<()> {
        let synced = fsync_data(&self.file);
        self.durability.record(&synced, self.written_len);
        synced
    }

    /// What the fsyncs of this file made durable: kept by whoever hands the writer on (a seal consumes it) and must
    /// know, should that fail, whether an fsync failed ([`Durability::durable_len_after_failed_fsync`]).
    pub fn durability(&self) -> Arc<Durability> {
        self.durability.clone()
    }
}
