//! Pack format: the immutable, self-describing file that holds many captures.
//!
//! `specs/pack-format.md` is the normative byte-by-byte description; this doc is its summary for readers of the code.
//! All integers are little-endian. Every byte of a pack is covered by a CRC32C, and every byte before the trailer is also
//! covered by the SHA-256 stored in the trailer.
//!
//! ```text
//! offset 0         header      40 bytes   magic "\x89CPK\r\n\x1a\n", major u16, minor u16, pack_id [16],
//!                                         created_at_ns u64, header_crc32c u32 (over bytes 0..36)
//! offset 40        record 0    16-byte record header: magic "CREC", meta_len u32, payload_len u32,
//!                  record 1    crc32c u32 (over header bytes 0..12, then metadata, then payload);
//!                  ...         then meta_len metadata bytes, then payload_len payload bytes
//! footer_offset    footer      magic "CFTR", entry_count u64, then one length-prefixed entry per record
//! end - 76         trailer     76 bytes   trailer_crc32c, footer_crc32c, footer_offset, footer_len, record_count,
//!                                         sha256 [32] of every byte before the trailer, major u16, minor u16,
//!                                         magic "\x89CPKEND\n" (the last 12 bytes keep this layout in every major)
//! ```
//!
//! Metadata block (in records and in footer entries alike): capture_id [16], captured_at_ns u64, stream (u32 length +
//! UTF-8), content_type (u8 presence 0/1 + string), source_name (u8 presence + string), label_count u32, then
//! (key, value) string pairs in strictly ascending byte order of the key. Bytes after the known fields of a
//! length-delimited block (metadata block, footer entry, footer) are skipped by readers: that is where a newer minor
//! version adds fields. Readers reject any major version other than [`FORMAT_MAJOR`].
//!
//! # States of a pack file
//!
//! - `<pack_id>.open`: being appended by one [`PackWriter`]. Header and records only, no footer or trailer. Bytes up to
//!   the last [`PackWriter::sync`] are durable; anything after may be torn. [`PackWriter::recover`] scans it from the
//!   start, keeps every complete record whose CRC verifies, and cuts the file at the first torn or corrupt record.
//! - sealed (`.sealed`, `.uploaded`, and in the bucket as `<pack_id>.cpk`): [`PackWriter::finish`] has written the
//!   footer and trailer and fsynced. Never modified again. Read with [`PackFile`] or the pure `decode_*` functions.
//!
//! Renaming between states is the spool's job; this module only reads and writes bytes.
//!
//! # Invariants
//!
//! - Records are contiguous: the first starts at [`HEADER_LEN`], each next one where the previous ended, and the last
//!   ends at `footer_offset`. Readers reject footers whose entries are out of order, overlapping, gapped or outside that
//!   region, disagree with the trailer's record count, or exceed the documented limits (`MAX_*`).
//! - A record never appears in a footer unless its bytes were written before the footer; the footer entry repeats the
//!   record's metadata and CRC, so listing a pack needs two range reads (trailer, footer) and reading one capture needs
//!   one range read (the record), which [`decode_record`] checks against its footer entry.
//! - The writer never issues a syscall per small record: records collect in a buffer that [`PackWriter::flush`]
//!   writes and whose [`SyncPoint`] fdatasyncs once (the group-commit point). Only a buffer past
//!   [`WRITE_BUFFER_FLUSH_BYTES`] or a large payload is written early, and even then without fsync.
//! - After any I/O error the writer is poisoned: the file's tail is unknown, so the only way on is `recover()`.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, IoSlice, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};

use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::hasher::BackgroundHasher;

/// File extension of a pack object in the bucket.
pub const PACK_EXTENSION: &str = "cpk";

/// Format major version written by this build; readers reject any other major.
pub const FORMAT_MAJOR: u16 = 1;
/// Format minor version written by this build; readers accept any minor of a known major.
pub const FORMAT_MINOR: u16 = 0;

pub const PACK_MAGIC: [u8; 8] = *b"\x89CPK\r\n\x1a\n";
pub const TRAILER_MAGIC: [u8; 8] = *b"\x89CPKEND\n";
pub const RECORD_MAGIC: [u8; 4] = *b"CREC";
pub const FOOTER_MAGIC: [u8; 4] = *b"CFTR";

/// Fixed header size at offset 0.
pub const HEADER_LEN: usize = 40;
/// Fixed record header size (magic, meta_len, payload_len, crc32c).
pub const RECORD_HEADER_LEN: usize = 16;
/// Fixed footer header size (magic, entry_count).
pub const FOOTER_HEADER_LEN: usize = 12;
/// Size of the fixed part of a footer entry, including its own u32 length prefix.
pub const FOOTER_ENTRY_FIXED_LEN: usize = 44;
/// Fixed trailer size at the end of a sealed pack.
pub const TRAILER_LEN: usize = 76;

/// Largest encoded metadata block of one record.
pub const MAX_METADATA_BYTES: u64 = 1 << 20;
/// Largest payload of one record (the record header stores it as u32).
pub const MAX_PAYLOAD_BYTES: u64 = u32::MAX as u64;
/// Most records in one pack.
pub const MAX_RECORDS: u64 = 1 << 24;
/// Largest footer.
pub const MAX_FOOTER_BYTES: u64 = 1 << 30;
pub const MAX_STREAM_BYTES: usize = 1024;
pub const MAX_LABELS: usize = 256;
pub const MAX_LABEL_KEY_BYTES: usize = 256;
pub const MAX_LABEL_VALUE_BYTES: usize = 4096;
pub const MAX_CONTENT_TYPE_BYTES: usize = 256;
pub const MAX_SOURCE_NAME_BYTES: usize = 1024;

/// The writer's buffer is written out (without fsync) before it would grow past this.
pub const WRITE_BUFFER_FLUSH_BYTES: usize = 1 << 20;
const READ_BUFFER_BYTES: usize = 1 << 20;
const SCAN_CHUNK_BYTES: usize = 64 << 10;

/// Metadata of one capture, stored in its record and repeated in the footer entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CaptureMeta {
    pub capture_id: Uuid,
    pub stream: String,
    pub captured_at_ns: u64,
    pub labels: BTreeMap<String, String>,
    pub content_type: Option<String>,
    /// Inbox file name the record came from, for exactly-once ingest.
    pub source_name: Option<String>,
}

/// One footer entry: where a record lives and what it holds. Offsets are from the start of the pack.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexEntry {
    pub meta: CaptureMeta,
    pub record_offset: u64,
    pub record_len: u64,
    pub payload_offset: u64,
    pub payload_len: u64,
    /// The record's CRC32C (over the first 12 bytes of its header, its metadata and its payload).
    pub crc32c: u32,
}

impl IndexEntry {
    /// Byte range of the whole record: the one range read that [`decode_record`] needs.
    pub fn record_range(&self) -> Range<u64> {
        self.record_offset..self.record_offset + self.record_len
    }

    /// Byte range of the payload alone.
    pub fn payload_range(&self) -> Range<u64> {
        self.payload_offset..self.payload_offset + self.payload_len
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trailer {
    pub footer_offset: u64,
    pub footer_len: u64,
    pub footer_crc32c: u32,
    pub record_count: u64,
    /// SHA-256 of every byte before the trailer (header, records, footer).
    pub sha256: [u8; 32],
    /// Format version, repeated from the header so a bucket reader never needs the header.
    pub major: u16,
    pub minor: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackHeader {
    pub major: u16,
    pub minor: u16,
    pub pack_id: Uuid,
    pub created_at_ns: u64,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PackError {
    #[error("pack i/o: {0}")]
    Io(#[from] io::Error),
    #[error("bad {what} magic at offset {offset}")]
    BadMagic { what: &'static str, offset: u64 },
    #[error("unsupported pack format version {major}.{minor}: this build reads major {supported_major}")]
    UnsupportedVersion { major: u16, minor: u16, supported_major: u16 },
    #[error("{what} checksum mismatch at offset {offset}: stored {stored}, computed {computed}")]
    Checksum { what: &'static str, offset: u64, stored: String, computed: String },
    #[error("truncated {what} at offset {offset}: need {needed} bytes, have {available}")]
    Truncated { what: &'static str, offset: u64, needed: u64, available: u64 },
    #[error("{what} is {value}, over the limit of {max}")]
    Limit { what: &'static str, value: u64, max: u64 },
    #[error("corrupt pack at offset {offset}: {reason}")]
    Corrupt { offset: u64, reason: String },
    /// The caller passed something the format cannot hold (for example an empty stream name).
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    /// An earlier write or fsync failed, so the file's tail is unknown; reopen it with [`PackWriter::recover`].
    #[error("pack writer for {path} is unusable after an earlier failure: {reason}")]
    Poisoned { path: PathBuf, reason: String },
}

impl PackError {
    /// True when the bytes themselves are bad (quarantine the file), false for I/O trouble and caller mistakes.
    pub fn is_data_error(&self) -> bool {
        matches!(
            self,
            PackError::BadMagic { .. }
                | PackError::UnsupportedVersion { .. }
                | PackError::Checksum { .. }
                | PackError::Truncated { .. }
                | PackError::Limit { .. }
                | PackError::Corrupt { .. }
        )
    }
}

fn corrupt(offset: u64, reason: impl Into<String>) -> PackError {
    PackError::Corrupt { offset, reason: reason.into() }
}

fn crc_mismatch(what: &'static str, offset: u64, stored: u32, computed: u32) -> PackError {
    PackError::Checksum { what, offset, stored: format!("{stored:08x}"), computed: format!("{computed:08x}") }
}

fn check_version(major: u16, minor: u16) -> Result<(), PackError> {
    if major != FORMAT_MAJOR {
        return Err(PackError::UnsupportedVersion { major, minor, supported_major: FORMAT_MAJOR });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------------
// Little-endian field access

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2-byte slice"))
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4-byte slice"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8-byte slice"))
}

/// Sequential reader over a block whose length is already known to be complete (CRC-verified or length-checked), so
/// running off its end means the block is malformed: every error is `Corrupt`.
struct FieldReader<'a> {
    bytes: &'a [u8],
    position: usize,
    base_offset: u64,
}

impl<'a> FieldReader<'a> {
    fn new(bytes: &'a [u8], base_offset: u64) -> Self {
        FieldReader { bytes, position: 0, base_offset }
    }

    fn offset(&self) -> u64 {
        self.base_offset + self.position as u64
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.position
    }

    fn take(&mut self, len: usize, field: &str) -> Result<&'a [u8], PackError> {
        if self.remaining() < len {
            return Err(corrupt(
                self.offset(),
                format!("{field} needs {len} bytes, block has {} left", self.remaining()),
            ));
        }
        let slice = &self.bytes[self.position..self.position + len];
        self.position += len;
        Ok(slice)
    }

    fn u8(&mut self, field: &str) -> Result<u8, PackError> {
        Ok(self.take(1, field)?[0])
    }

    fn u32(&mut self, field: &str) -> Result<u32, PackError> {
        Ok(u32_at(self.take(4, field)?, 0))
    }

    fn u64(&mut self, field: &str) -> Result<u64, PackError> {
        Ok(u64_at(self.take(8, field)?, 0))
    }

    fn string(&mut self, field: &'static str, max_len: usize) -> Result<String, PackError> {
        let len = self.u32(field)? as usize;
        if len > max_len {
            return Err(PackError::Limit { what: field, value: len as u64, max: max_len as u64 });
        }
        let at = self.offset();
        let raw = self.take(len, field)?;
        String::from_utf8(raw.to_vec()).map_err(|_| corrupt(at, format!("{field} is not utf-8")))
    }

    fn optional_string(&mut self, field: &'static str, max_len: usize) -> Result<Option<String>, PackError> {
        let at = self.offset();
        match self.u8(field)? {
            0 => Ok(None),
            1 => Ok(Some(self.string(field, max_len)?)),
            other => Err(corrupt(at, format!("{field} presence byte is {other}, expected 0 or 1"))),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Metadata block

fn string_field_len(value: &str) -> u64 {
    4 + value.len() as u64
}

fn optional_field_len(value_opt: &Option<String>) -> u64 {
    1 + value_opt.as_deref().map_or(0, string_field_len)
}

/// Size of `meta` once encoded, without encoding it.
pub fn encoded_meta_len(meta: &CaptureMeta) -> u64 {
    let labels_len: u64 = meta.labels.iter().map(|(key, value)| string_field_len(key) + string_field_len(value)).sum();
    16 + 8
        + string_field_len(&meta.stream)
        + optional_field_len(&meta.content_type)
        + optional_field_len(&meta.source_name)
        + 4
        + labels_len
}

/// Checks `meta` against the documented limits. [`PackWriter::append`] and every decoder apply it.
pub fn validate_meta(meta: &CaptureMeta) -> Result<(), PackError> {
    fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), PackError> {
        if len > max {
            return Err(PackError::Limit { what, value: len as u64, max: max as u64 });
        }
        Ok(())
    }
    if meta.stream.is_empty() {
        return Err(PackError::Invalid { what: "stream", reason: "must not be empty".into() });
    }
    check_len("stream length", meta.stream.len(), MAX_STREAM_BYTES)?;
    check_len("label count", meta.labels.len(), MAX_LABELS)?;
    for (key, value) in &meta.labels {
        if key.is_empty() {
            return Err(PackError::Invalid { what: "label key", reason: "must not be empty".into() });
        }
        check_len("label key length", key.len(), MAX_LABEL_KEY_BYTES)?;
        check_len("label value length", value.len(), MAX_LABEL_VALUE_BYTES)?;
    }
    if let Some(content_type) = &meta.content_type {
        check_len("content_type length", content_type.len(), MAX_CONTENT_TYPE_BYTES)?;
    }
    if let Some(source_name) = &meta.source_name {
        check_len("source_name length", source_name.len(), MAX_SOURCE_NAME_BYTES)?;
    }
    let meta_len = encoded_meta_len(meta);
    if meta_len > MAX_METADATA_BYTES {
        return Err(PackError::Limit { what: "metadata bytes", value: meta_len, max: MAX_METADATA_BYTES });
    }
    Ok(())
}

fn put_string(out: &mut Vec<u8>, value: &str) {
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value.as_bytes());
}

fn put_optional_string(out: &mut Vec<u8>, value_opt: &Option<String>) {
    match value_opt {
        None => out.push(0),
        Some(value) => {
            out.push(1);
            put_string(out, value);
        }
    }
}

/// Appends the metadata block of `meta` to `out`. The caller validates first (lengths must fit in u32).
pub fn encode_meta(meta: &CaptureMeta, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(meta.capture_id.as_bytes());
    out.extend_from_slice(&meta.captured_at_ns.to_le_bytes());
    put_string(out, &meta.stream);
    put_optional_string(out, &meta.content_type);
    put_optional_string(out, &meta.source_name);
    out.extend_from_slice(&(meta.labels.len() as u32).to_le_bytes());
    // BTreeMap<String, _> iterates in byte order of the keys, which is the order the format requires.
    for (key, value) in &meta.labels {
        put_string(out, key);
        put_string(out, value);
    }
    debug_assert_eq!((out.len() - start) as u64, encoded_meta_len(meta));
}

/// Decodes a metadata block. `base_offset` is where the block starts in the pack (for error messages). Bytes after the
/// known fields are ignored (minor-version extension point).
pub fn decode_meta(bytes: &[u8], base_offset: u64) -> Result<CaptureMeta, PackError> {
    if bytes.len() as u64 > MAX_METADATA_BYTES {
        return Err(PackError::Limit { what: "metadata bytes", value: bytes.len() as u64, max: MAX_METADATA_BYTES });
    }
    let mut reader = FieldReader::new(bytes, base_offset);
    let capture_id = Uuid::from_bytes(reader.take(16, "capture_id")?.try_into().expect("16-byte slice"));
    let captured_at_ns = reader.u64("captured_at_ns")?;
    let stream = reader.string("stream length", MAX_STREAM_BYTES)?;
    let content_type = reader.optional_string("content_type length", MAX_CONTENT_TYPE_BYTES)?;
    let source_name = reader.optional_string("source_name length", MAX_SOURCE_NAME_BYTES)?;
    let label_count = reader.u32("label count")? as usize;
    if label_count > MAX_LABELS {
        return Err(PackError::Limit { what: "label count", value: label_count as u64, max: MAX_LABELS as u64 });
    }
    let mut labels = BTreeMap::new();
    let mut previous_key_opt: Option<String> = None;
    for _ in 0..label_count {
        let key_offset = reader.offset();
        let key = reader.string("label key length", MAX_LABEL_KEY_BYTES)?;
        let value = reader.string("label value length", MAX_LABEL_VALUE_BYTES)?;
        if let Some(previous_key) = &previous_key_opt {
            if previous_key.as_bytes() >= key.as_bytes() {
                return Err(corrupt(key_offset, "label keys are not in strictly ascending order"));
            }
        }
        previous_key_opt = Some(key.clone());
        labels.insert(key, value);
    }
    let meta = CaptureMeta { capture_id, stream, captured_at_ns, labels, content_type, source_name };
    validate_meta(&meta).map_err(|error| match error {
        PackError::Invalid { what, reason } => corrupt(base_offset, format!("{what} {reason}")),
        other => other,
    })?;
    Ok(meta)
}

// ---------------------------------------------------------------------------------------------------------------------
// Header

pub fn encode_header(header: &PackHeader) -> [u8; HEADER_LEN] {
    let mut bytes = [0u8; HEADER_LEN];
    bytes[0..8].copy_from_slice(&PACK_MAGIC);
    bytes[8..10].copy_from_slice(&header.major.to_le_bytes());
    bytes[10..12].copy_from_slice(&header.minor.to_le_bytes());
    bytes[12..28].copy_from_slice(header.pack_id.as_bytes());
    bytes[28..36].copy_from_slice(&header.created_at_ns.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[0..36]);
    bytes[36..40].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// Decodes the header from the first [`HEADER_LEN`] bytes of `bytes` (longer slices are fine).
pub fn decode_header(bytes: &[u8]) -> Result<PackHeader, PackError> {
    if bytes.len() < HEADER_LEN {
        return Err(PackError::Truncated {
            what: "header",
            offset: 0,
            needed: HEADER_LEN as u64,
            available: bytes.len() as u64,
        });
    }
    if bytes[0..8] != PACK_MAGIC {
        return Err(PackError::BadMagic { what: "pack header", offset: 0 });
    }
    // Magic, major and minor keep their place in every major version, so check the version before the CRC.
    let major = u16_at(bytes, 8);
    let minor = u16_at(bytes, 10);
    check_version(major, minor)?;
    let stored_crc = u32_at(bytes, 36);
    let computed_crc = crc32c::crc32c(&bytes[0..36]);
    if stored_crc != computed_crc {
        return Err(crc_mismatch("header", 0, stored_crc, computed_crc));
    }
    Ok(PackHeader {
        major,
        minor,
        pack_id: Uuid::from_bytes(bytes[12..28].try_into().expect("16-byte slice")),
        created_at_ns: u64_at(bytes, 28),
    })
}

// ---------------------------------------------------------------------------------------------------------------------
// Trailer

pub fn encode_trailer(trailer: &Trailer) -> [u8; TRAILER_LEN] {
    let mut bytes = [0u8; TRAILER_LEN];
    bytes[4..8].copy_from_slice(&trailer.footer_crc32c.to_le_bytes());
    bytes[8..16].copy_from_slice(&trailer.footer_offset.to_le_bytes());
    bytes[16..24].copy_from_slice(&trailer.footer_len.to_le_bytes());
    bytes[24..32].copy_from_slice(&trailer.record_count.to_le_bytes());
    bytes[32..64].copy_from_slice(&trailer.sha256);
    bytes[64..66].copy_from_slice(&trailer.major.to_le_bytes());
    bytes[66..68].copy_from_slice(&trailer.minor.to_le_bytes());
    bytes[68..76].copy_from_slice(&TRAILER_MAGIC);
    let crc = crc32c::crc32c(&bytes[4..]);
    bytes[0..4].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// Decodes exactly [`TRAILER_LEN`] bytes (the end of a sealed pack). Offsets in errors are trailer-relative; use
/// [`check_trailer_fits`] once the object's length is known.
pub fn decode_trailer(bytes: &[u8]) -> Result<Trailer, PackError> {
    if bytes.len() < TRAILER_LEN {
        return Err(PackError::Truncated {
            what: "trailer",
            offset: 0,
            needed: TRAILER_LEN as u64,
            available: bytes.len() as u64,
        });
    }
    if bytes.len() > TRAILER_LEN {
        return Err(PackError::Invalid {
            what: "trailer slice",
            reason: format!("{} bytes given, the trailer is exactly {TRAILER_LEN}", bytes.len()),
        });
    }
    if bytes[68..76] != TRAILER_MAGIC {
        return Err(PackError::BadMagic { what: "trailer", offset: 68 });
    }
    let major = u16_at(bytes, 64);
    let minor = u16_at(bytes, 66);
    check_version(major, minor)?;
    let stored_crc = u32_at(bytes, 0);
    let computed_crc = crc32c::crc32c(&bytes[4..]);
    if stored_crc != computed_crc {
        return Err(crc_mismatch("trailer", 0, stored_crc, computed_crc));
    }
    let trailer = Trailer {
        footer_crc32c: u32_at(bytes, 4),
        footer_offset: u64_at(bytes, 8),
        footer_len: u64_at(bytes, 16),
        record_count: u64_at(bytes, 24),
        sha256: bytes[32..64].try_into().expect("32-byte slice"),
        major,
        minor,
    };
    if trailer.record_count > MAX_RECORDS {
        return Err(PackError::Limit { what: "record count", value: trailer.record_count, max: MAX_RECORDS });
    }
    if trailer.footer_len > MAX_FOOTER_BYTES {
        return Err(PackError::Limit { what: "footer bytes", value: trailer.footer_len, max: MAX_FOOTER_BYTES });
    }
    if trailer.footer_len < FOOTER_HEADER_LEN as u64 {
        return Err(corrupt(16, format!("footer_len {} is shorter than a footer header", trailer.footer_len)));
    }
    if trailer.footer_offset < HEADER_LEN as u64 {
        return Err(corrupt(8, format!("footer_offset {} is inside the header", trailer.footer_offset)));
    }
    if trailer.footer_offset.checked_add(trailer.footer_len).is_none() {
        return Err(corrupt(8, "footer_offset + footer_len overflows"));
    }
    Ok(trailer)
}

/// Checks that the footer ends exactly where the trailer of an object of `object_len` bytes begins.
pub fn check_trailer_fits(trailer: &Trailer, object_len: u64) -> Result<(), PackError> {
    let footer_end = trailer.footer_offset + trailer.footer_len;
    let trailer_offset = object_len.checked_sub(TRAILER_LEN as u64);
    if trailer_offset != Some(footer_end) {
        return Err(corrupt(
            footer_end,
            format!("footer ends at {footer_end} but a {object_len}-byte pack's trailer starts at {trailer_offset:?}"),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------------
// Footer

fn footer_entry_len(meta_len: u64) -> u64 {
    FOOTER_ENTRY_FIXED_LEN as u64 + meta_len
}

pub fn encode_footer(entries: &[IndexEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FOOTER_HEADER_LEN + entries.len() * 128);
    out.extend_from_slice(&FOOTER_MAGIC);
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for entry in entries {
        let entry_start = out.len();
        out.extend_from_slice(&[0u8; 4]);
        out.extend_from_slice(&entry.record_offset.to_le_bytes());
        out.extend_from_slice(&entry.record_len.to_le_bytes());
        out.extend_from_slice(&entry.payload_offset.to_le_bytes());
        out.extend_from_slice(&entry.payload_len.to_le_bytes());
        out.extend_from_slice(&entry.crc32c.to_le_bytes());
        let meta_len_at = out.len();
        out.extend_from_slice(&[0u8; 4]);
        encode_meta(&entry.meta, &mut out);
        let meta_len = (out.len() - meta_len_at - 4) as u32;
        out[meta_len_at..meta_len_at + 4].copy_from_slice(&meta_len.to_le_bytes());
        let entry_len = (out.len() - entry_start - 4) as u32;
        out[entry_start..entry_start + 4].copy_from_slice(&entry_len.to_le_bytes());
    }
    out
}

/// Decodes and checks the footer: CRC, magic, count against the trailer, limits, and that the records are contiguous
/// from [`HEADER_LEN`] to `footer_offset` in footer order.
pub fn decode_footer(bytes: &[u8], trailer: &Trailer) -> Result<Vec<IndexEntry>, PackError> {
    let footer_offset = trailer.footer_offset;
    if (bytes.len() as u64) < trailer.footer_len {
        return Err(PackError::Truncated {
            what: "footer",
            offset: footer_offset,
            needed: trailer.footer_len,
            available: bytes.len() as u64,
        });
    }
    if bytes.len() as u64 > trailer.footer_len {
        return Err(PackError::Invalid {
            what: "footer slice",
            reason: format!("{} bytes given, the trailer says {}", bytes.len(), trailer.footer_len),
        });
    }
    let computed_crc = crc32c::crc32c(bytes);
    if computed_crc != trailer.footer_crc32c {
        return Err(crc_mismatch("footer", footer_offset, trailer.footer_crc32c, computed_crc));
    }
    let mut reader = FieldReader::new(bytes, footer_offset);
    if reader.take(4, "footer magic")? != FOOTER_MAGIC {
        return Err(PackError::BadMagic { what: "footer", offset: footer_offset });
    }
    let entry_count = reader.u64("footer entry count")?;
    if entry_count != trailer.record_count {
        return Err(corrupt(
            footer_offset + 4,
            format!("footer holds {entry_count} entries but the trailer says {}", trailer.record_count),
        ));
    }
    // The count is checked against MAX_RECORDS by decode_trailer; cap the allocation by what the bytes can hold.
    let capacity = (entry_count as usize).min(bytes.len() / FOOTER_ENTRY_FIXED_LEN);
    let mut entries = Vec::with_capacity(capacity);
    let mut expected_offset = HEADER_LEN as u64;
    for index in 0..entry_count {
        let entry_at = reader.offset();
        let entry_len = reader.u32("footer entry length")? as usize;
        let entry_bytes = reader.take(entry_len, "footer entry")?;
        let entry = decode_footer_entry(entry_bytes, entry_at + 4, index)?;
        if entry.record_offset < expected_offset {
            return Err(corrupt(
                entry_at,
                format!(
                    "record {index} at offset {} overlaps or precedes the previous record (expected {expected_offset})",
                    entry.record_offset
                ),
            ));
        }
        if entry.record_offset > expected_offset {
            return Err(corrupt(
                entry_at,
                format!("gap before record {index} at offset {} (expected {expected_offset})", entry.record_offset),
            ));
        }
        let record_end = entry.record_offset + entry.record_len;
        if record_end > footer_offset {
            return Err(corrupt(
                entry_at,
                format!("record {index} ends at {record_end}, past the data region ending at {footer_offset}"),
            ));
        }
        expected_offset = record_end;
        entries.push(entry);
    }
    if expected_offset != footer_offset {
        return Err(corrupt(
            footer_offset,
            format!("records end at {expected_offset} but the footer starts at {footer_offset}"),
        ));
    }
    // Bytes after the last entry are a minor-version extension point: skipped.
    Ok(entries)
}

fn decode_footer_entry(bytes: &[u8], base_offset: u64, index: u64) -> Result<IndexEntry, PackError> {
    let mut reader = FieldReader::new(bytes, base_offset);
    let record_offset = reader.u64("record_offset")?;
    let record_len = reader.u64("record_len")?;
    let payload_offset = reader.u64("payload_offset")?;
    let payload_len = reader.u64("payload_len")?;
    let crc32c = reader.u32("crc32c")?;
    let meta_len = reader.u32("meta_len")? as u64;
    if meta_len > MAX_METADATA_BYTES {
        return Err(PackError::Limit { what: "metadata bytes", value: meta_len, max: MAX_METADATA_BYTES });
    }
    if payload_len > MAX_PAYLOAD_BYTES {
        return Err(PackError::Limit { what: "payload bytes", value: payload_len, max: MAX_PAYLOAD_BYTES });
    }
    let meta_at = reader.offset();
    let meta = decode_meta(reader.take(meta_len as usize, "entry metadata")?, meta_at)?;
    // Bytes after the metadata are a minor-version extension point: skipped.
    let expected_record_len = RECORD_HEADER_LEN as u64 + meta_len + payload_len;
    if record_len != expected_record_len {
        return Err(corrupt(
            base_offset,
            format!(
                "record {index} length {record_len} disagrees with header + metadata + payload {expected_record_len}"
            ),
        ));
    }
    let expected_payload_offset = record_offset.checked_add(RECORD_HEADER_LEN as u64 + meta_len);
    if expected_payload_offset != Some(payload_offset) {
        return Err(corrupt(
            base_offset,
            format!("record {index} payload_offset {payload_offset} disagrees with its record layout"),
        ));
    }
    if record_offset.checked_add(record_len).is_none() {
        return Err(corrupt(base_offset, format!("record {index} extent overflows")));
    }
    Ok(IndexEntry { meta, record_offset, record_len, payload_offset, payload_len, crc32c })
}

// ---------------------------------------------------------------------------------------------------------------------
// Records

fn record_header_bytes(meta_len: u32, payload_len: u32, crc: u32) -> [u8; RECORD_HEADER_LEN] {
    let mut bytes = [0u8; RECORD_HEADER_LEN];
    bytes[0..4].copy_from_slice(&RECORD_MAGIC);
    bytes[4..8].copy_from_slice(&meta_len.to_le_bytes());
    bytes[8..12].copy_from_slice(&payload_len.to_le_bytes());
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// Verifies a whole record against its footer entry and returns its metadata and the payload's range in
/// `record_bytes`.
fn verify_record(record_bytes: &[u8], entry: &IndexEntry) -> Result<(CaptureMeta, Range<usize>), PackError> {
    let record_offset = entry.record_offset;
    if (record_bytes.len() as u64) < entry.record_len {
        return Err(PackError::Truncated {
            what: "record",
            offset: record_offset,
            needed: entry.record_len,
            available: record_bytes.len() as u64,
        });
    }
    if record_bytes.len() as u64 != entry.record_len {
        return Err(PackError::Invalid {
            what: "record slice",
            reason: format!("{} bytes given, the entry says {}", record_bytes.len(), entry.record_len),
        });
    }
    if record_bytes.len() < RECORD_HEADER_LEN {
        return Err(corrupt(record_offset, "record shorter than its header"));
    }
    if record_bytes[0..4] != RECORD_MAGIC {
        return Err(PackError::BadMagic { what: "record", offset: record_offset });
    }
    let meta_len = u32_at(record_bytes, 4) as usize;
    let payload_len = u32_at(record_bytes, 8) as usize;
    let stored_crc = u32_at(record_bytes, 12);
    if (RECORD_HEADER_LEN + meta_len + payload_len) as u64 != entry.record_len
        || payload_len as u64 != entry.payload_len
    {
        return Err(corrupt(record_offset, "record header lengths disagree with the footer entry"));
    }
    let meta_range = RECORD_HEADER_LEN..RECORD_HEADER_LEN + meta_len;
    let payload_range = meta_range.end..record_bytes.len();
    let computed_crc = crc32c::crc32c_append(crc32c::crc32c(&record_bytes[0..12]), &record_bytes[meta_range.start..]);
    if computed_crc != stored_crc {
        return Err(crc_mismatch("record", record_offset, stored_crc, computed_crc));
    }
    if stored_crc != entry.crc32c {
        return Err(crc_mismatch("footer entry record", record_offset, entry.crc32c, stored_crc));
    }
    if record_offset + meta_range.end as u64 != entry.payload_offset {
        return Err(corrupt(record_offset, "payload_offset disagrees with the record's metadata length"));
    }
    let meta = decode_meta(&record_bytes[meta_range], record_offset + RECORD_HEADER_LEN as u64)?;
    if meta != entry.meta {
        return Err(corrupt(record_offset, "record metadata disagrees with its footer entry"));
    }
    Ok((meta, payload_range))
}

/// Decodes one record (exactly the `entry.record_len` bytes at `entry.record_offset`), verifying its CRC and that its
/// metadata matches the footer entry.
pub fn decode_record(record_bytes: &[u8], entry: &IndexEntry) -> Result<(CaptureMeta, Vec<u8>), PackError> {
    let (meta, payload_range) = verify_record(record_bytes, entry)?;
    Ok((meta, record_bytes[payload_range].to_vec()))
}

/// The footer entry of a record known only by its place and CRC (as the catalog keeps it): the metadata is taken from
/// the record itself. Pass the result to [`decode_record`], which verifies the CRC, the lengths and the offsets.
pub fn entry_from_location(
    record_bytes: &[u8],
    record_offset: u64,
    payload_offset: u64,
    payload_len: u64,
    crc32c: u32,
) -> Result<IndexEntry, PackError> {
    if record_bytes.len() < RECORD_HEADER_LEN || record_bytes[0..4] != RECORD_MAGIC {
        return Err(PackError::BadMagic { what: "record", offset: record_offset });
    }
    let meta_len = u32_at(record_bytes, 4) as usize;
    let meta_bytes = record_bytes
        .get(RECORD_HEADER_LEN..RECORD_HEADER_LEN + meta_len)
        .ok_or_else(|| corrupt(record_offset, "record metadata runs past the record"))?;
    let meta = decode_meta(meta_bytes, record_offset + RECORD_HEADER_LEN as u64)?;
    Ok(IndexEntry { meta, record_offset, record_len: record_bytes.len() as u64, payload_offset, payload_len, crc32c })
}

// ---------------------------------------------------------------------------------------------------------------------
// Sequential scan (recovery of `.open` files and full verification)

/// What a scan of a pack from its start found.
#[derive(Debug, Clone)]
pub struct ScanReport {
    pub header: PackHeader,
    /// Every complete, CRC-verified record before the first torn or corrupt one.
    pub entries: Vec<IndexEntry>,
    /// End of the last good record (or of the header when there is none).
    pub valid_len: u64,
    pub total_len: u64,
    /// Why the scan stopped before `total_len`; `None` when every byte was a good record.
    pub cut_reason: Option<String>,
}

struct ScanState {
    report: ScanReport,
    /// SHA-256 of bytes `0..valid_len`.
    hasher: Sha256,
    footer_len: u64,
}

enum RecordScan {
    Complete(IndexEntry),
    Stop(String),
}

/// Scans `total_len` bytes of a pack from offset 0. Fails only when the header is torn or invalid, or on I/O errors;
/// a torn or corrupt record ends the scan and is reported in `cut_reason`.
fn scan_stream<R: Read>(reader: &mut R, total_len: u64) -> Result<ScanState, PackError> {
    if total_len < HEADER_LEN as u64 {
        return Err(PackError::Truncated {
            what: "header",
            offset: 0,
            needed: HEADER_LEN as u64,
            available: total_len,
        });
    }
    let mut header_bytes = [0u8; HEADER_LEN];
    reader.read_exact(&mut header_bytes)?;
    let header = decode_header(&header_bytes)?;
    let mut hasher = Sha256::new();
    hasher.update(header_bytes);
    let mut entries = Vec::new();
    let mut position = HEADER_LEN as u64;
    let mut footer_len = FOOTER_HEADER_LEN as u64;
    let mut chunk = Vec::new();
    let mut cut_reason = None;
    while position < total_len {
        if entries.len() as u64 >= MAX_RECORDS {
            cut_reason = Some(format!("record limit {MAX_RECORDS} reached at offset {position}"));
            break;
        }
        // Hash the record tentatively; the running hash takes it only if the record turns out good.
        let mut record_hasher = hasher.clone();
        match scan_one_record(reader, position, total_len, &mut record_hasher, &mut chunk)? {
            RecordScan::Stop(reason) => {
                cut_reason = Some(reason);
                break;
            }
            RecordScan::Complete(entry) => {
                let entry_footer_len =
                    footer_entry_len(entry.payload_offset - entry.record_offset - RECORD_HEADER_LEN as u64);
                if footer_len + entry_footer_len > MAX_FOOTER_BYTES {
                    cut_reason = Some(format!("footer limit {MAX_FOOTER_BYTES} reached at offset {position}"));
                    break;
                }
                footer_len += entry_footer_len;
                position += entry.record_len;
                hasher = record_hasher;
                entries.push(entry);
            }
        }
    }
    Ok(ScanState {
        report: ScanReport { header, entries, valid_len: position, total_len, cut_reason },
        hasher,
        footer_len,
    })
}

fn scan_one_record<R: Read>(
    reader: &mut R,
    record_offset: u64,
    total_len: u64,
    record_hasher: &mut Sha256,
    chunk: &mut Vec<u8>,
) -> Result<RecordScan, PackError> {
    let remaining = total_len - record_offset;
    if remaining < RECORD_HEADER_LEN as u64 {
        return Ok(RecordScan::Stop(format!(
            "torn record header at offset {record_offset}: {remaining} of {RECORD_HEADER_LEN} bytes"
        )));
    }
    let mut header = [0u8; RECORD_HEADER_LEN];
    reader.read_exact(&mut header)?;
    if header[0..4] != RECORD_MAGIC {
        let reason = if header[0..4] == FOOTER_MAGIC {
            format!("footer at offset {record_offset}: the pack was finished but not renamed")
        } else {
            format!("no record magic at offset {record_offset}")
        };
        return Ok(RecordScan::Stop(reason));
    }
    let meta_len = u32_at(&header, 4) as u64;
    let payload_len = u32_at(&header, 8) as u64;
    let stored_crc = u32_at(&header, 12);
    if meta_len > MAX_METADATA_BYTES {
        return Ok(RecordScan::Stop(format!(
            "record at offset {record_offset} claims {meta_len} metadata bytes, over the limit of {MAX_METADATA_BYTES}"
        )));
    }
    let body_len = meta_len + payload_len;
    if remaining - (RECORD_HEADER_LEN as u64) < body_len {
        return Ok(RecordScan::Stop(format!(
            "torn record at offset {record_offset}: needs {} bytes, {remaining} present",
            body_len + RECORD_HEADER_LEN as u64
        )));
    }
    let mut meta_bytes = vec![0u8; meta_len as usize];
    reader.read_exact(&mut meta_bytes)?;
    let mut crc = crc32c::crc32c_append(crc32c::crc32c(&header[0..12]), &meta_bytes);
    record_hasher.update(header);
    record_hasher.update(&meta_bytes);
    let mut payload_left = payload_len;
    if chunk.is_empty() && payload_left > 0 {
        chunk.resize(SCAN_CHUNK_BYTES, 0);
    }
    while payload_left > 0 {
        let step = payload_left.min(chunk.len() as u64) as usize;
        reader.read_exact(&mut chunk[..step])?;
        crc = crc32c::crc32c_append(crc, &chunk[..step]);
        record_hasher.update(&chunk[..step]);
        payload_left -= step as u64;
    }
    if crc != stored_crc {
        return Ok(RecordScan::Stop(format!(
            "record checksum mismatch at offset {record_offset}: stored {stored_crc:08x}, computed {crc:08x}"
        )));
    }
    let meta_offset = record_offset + RECORD_HEADER_LEN as u64;
    let meta = match decode_meta(&meta_bytes, meta_offset) {
        Ok(meta) => meta,
        Err(error) => {
            return Ok(RecordScan::Stop(format!("undecodable metadata in record at offset {record_offset}: {error}")))
        }
    };
    Ok(RecordScan::Complete(IndexEntry {
        meta,
        record_offset,
        record_len: RECORD_HEADER_LEN as u64 + body_len,
        payload_offset: meta_offset + meta_len,
        payload_len,
        crc32c: stored_crc,
    }))
}

/// Scans an in-memory pack (or a prefix of one) from the start, like recovery does, without changing anything.
pub fn scan_bytes(bytes: &[u8]) -> Result<ScanReport, PackError> {
    let mut reader = bytes;
    Ok(scan_stream(&mut reader, bytes.len() as u64)?.report)
}

/// Scans a pack file (typically `.open`) from the start without changing it: what [`PackWriter::recover`] would keep.
pub fn scan_file(path: &Path) -> Result<ScanReport, PackError> {
    let file = File::open(path)?;
    let total_len = file.metadata()?.len();
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, PositionedReader::new(&file, 0));
    Ok(scan_stream(&mut reader, total_len)?.report)
}

/// `Read` over a file by positioned reads, so concurrent users of the same `File` never share a cursor.
struct PositionedReader<'a> {
    file: &'a File,
    offset: u64,
}

impl<'a> PositionedReader<'a> {
    fn new(file: &'a File, offset: u64) -> Self {
        PositionedReader { file, offset }
    }
}

impl Read for PositionedReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read_len = self.file.read_at(buf, self.offset)?;
        self.offset += read_len as u64;
        Ok(read_len)
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// Writer

/// What [`PackWriter::recover`] kept and cut.
#[derive(Debug, Clone)]
pub struct RecoveryReport {
    pub records_kept: u64,
    pub bytes_cut: u64,
    pub entries: Vec<IndexEntry>,
    /// Why bytes were cut (torn record, checksum mismatch, ...); `None` when nothing was cut.
    pub cut_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PackSummary {
    pub pack_id: Uuid,
    pub bytes: u64,
    pub records: u64,
    pub sha256_hex: String,
    /// Earliest `captured_at_ns` of the pack's records (0 for an empty pack).
    pub first_captured_at_ns: u64,
    /// Latest `captured_at_ns` of the pack's records (0 for an empty pack).
    pub last_captured_at_ns: u64,
    pub created_at_ns: u64,
}

fn summarize(header: &PackHeader, trailer: &Trailer, entries: &[IndexEntry]) -> PackSummary {
    let first_captured_at_ns = entries.iter().map(|entry| entry.meta.captured_at_ns).min().unwrap_or(0);
    let last_captured_at_ns = entries.iter().map(|entry| entry.meta.captured_at_ns).max().unwrap_or(0);
    PackSummary {
        pack_id: header.pack_id,
        bytes: trailer.footer_offset + trailer.footer_len + TRAILER_LEN as u64,
        records: trailer.record_count,
        sha256_hex: hex::encode(trailer.sha256),
        first_captured_at_ns,
        last_captured_at_ns,
        created_at_ns: header.created_at_ns,
    }
}

/// Appends records to a `.open` pack file. Small records collect in an in-memory buffer; [`PackWriter::flush`] hands
/// the buffer to the kernel and returns a [`SyncPoint`] whose fdatasync makes every record appended so far durable
/// (the group-commit point; [`PackWriter::sync`] does both at once). Records are not durable until that fsync
/// returns; dropping the writer without it or [`PackWriter::finish`] loses the unsynced tail (recovery handles the
/// rest).
///
/// The SHA-256 for the trailer is computed by a [`BackgroundHasher`] from the same reference-counted buffers that are
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
    poisoned: Arc<Mutex<Option<String>>>,
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
    dir_synced: Arc<AtomicBool>,
    poisoned: Arc<Mutex<Option<String>>>,
}

impl SyncPoint {
    pub fn sync(&self) -> Result<(), PackError> {
        if let Some(reason) = self.poisoned.lock().expect("poison flag lock").clone() {
            // Linux reports a writeback error to one fsync only: once failed, a later "success" proves nothing.
            return Err(PackError::Poisoned { path: self.path.clone(), reason });
        }
        let synced = self.file.sync_data().and_then(|()| {
            if self.dir_synced.load(Ordering::Acquire) {
                return Ok(());
            }
            sync_parent_dir(&self.path).map(|()| self.dir_synced.store(true, Ordering::Release))
        });
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
        let file = OpenOptions::new().write(true).create_new(true).open(path)?;
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
            file.sync_all()?;
        }
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
        validate_meta(meta)?;
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

    fn unwritten_len(&self) -> u64 {
        self.segments_len + self.pending.len() as u64
    }

    pub fn entries(&self) -> &[IndexEntry] {
        &self.entries
    }
}

fn sync_parent_dir(path: &Path) -> io::Result<()> {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    File::open(parent)?.sync_all()
}

// ---------------------------------------------------------------------------------------------------------------------
// Reader of sealed packs

/// Decodes a whole sealed pack held in memory: header, trailer and footer, with every layout check [`PackFile::open`]
/// makes. Records are not read; use [`decode_record`] on `bytes[entry.record_range()]`.
pub fn decode_pack(bytes: &[u8]) -> Result<(PackHeader, Trailer, Vec<IndexEntry>), PackError> {
    let object_len = bytes.len() as u64;
    let minimum_len = (HEADER_LEN + FOOTER_HEADER_LEN + TRAILER_LEN) as u64;
    if object_len < minimum_len {
        return Err(PackError::Truncated { what: "pack", offset: 0, needed: minimum_len, available: object_len });
    }
    let header = decode_header(&bytes[..HEADER_LEN])?;
    let trailer = decode_trailer(&bytes[bytes.len() - TRAILER_LEN..])?;
    check_header_matches_trailer(&header, &trailer)?;
    check_trailer_fits(&trailer, object_len)?;
    let footer_range = trailer.footer_offset as usize..(trailer.footer_offset + trailer.footer_len) as usize;
    let entries = decode_footer(&bytes[footer_range], &trailer)?;
    Ok((header, trailer, entries))
}

fn check_header_matches_trailer(header: &PackHeader, trailer: &Trailer) -> Result<(), PackError> {
    if (header.major, header.minor) != (trailer.major, trailer.minor) {
        return Err(corrupt(
            0,
            format!(
                "header says version {}.{} but the trailer says {}.{}",
                header.major, header.minor, trailer.major, trailer.minor
            ),
        ));
    }
    Ok(())
}

/// A sealed pack on local disk.
#[derive(Debug)]
pub struct PackFile {
    path: PathBuf,
    file: File,
    header: PackHeader,
    trailer: Trailer,
    entries: Vec<IndexEntry>,
}

impl PackFile {
    /// Opens a sealed pack with three small reads: header, trailer, footer.
    pub fn open(path: &Path) -> Result<Self, PackError> {
        let file = File::open(path)?;
        let object_len = file.metadata()?.len();
        let minimum_len = (HEADER_LEN + FOOTER_HEADER_LEN + TRAILER_LEN) as u64;
        if object_len < minimum_len {
            return Err(PackError::Truncated { what: "pack", offset: 0, needed: minimum_len, available: object_len });
        }
        let mut header_bytes = [0u8; HEADER_LEN];
        file.read_exact_at(&mut header_bytes, 0)?;
        let header = decode_header(&header_bytes)?;
        let mut trailer_bytes = [0u8; TRAILER_LEN];
        file.read_exact_at(&mut trailer_bytes, object_len - TRAILER_LEN as u64)?;
        let trailer = decode_trailer(&trailer_bytes)?;
        check_header_matches_trailer(&header, &trailer)?;
        check_trailer_fits(&trailer, object_len)?;
        let mut footer_bytes = vec![0u8; trailer.footer_len as usize];
        file.read_exact_at(&mut footer_bytes, trailer.footer_offset)?;
        let entries = decode_footer(&footer_bytes, &trailer)?;
        Ok(PackFile { path: path.to_path_buf(), file, header, trailer, entries })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &PackHeader {
        &self.header
    }

    pub fn trailer(&self) -> &Trailer {
        &self.trailer
    }

    pub fn entries(&self) -> &[IndexEntry] {
        &self.entries
    }

    pub fn summary(&self) -> PackSummary {
        summarize(&self.header, &self.trailer, &self.entries)
    }

    /// Reads and verifies one capture with one positioned read of its record.
    pub fn read_capture(&self, index: usize) -> Result<(CaptureMeta, Vec<u8>), PackError> {
        let entry = self.entries.get(index).ok_or_else(|| PackError::Invalid {
            what: "capture index",
            reason: format!("{index} is out of range for a pack of {} records", self.entries.len()),
        })?;
        let mut record_bytes = vec![0u8; entry.record_len as usize];
        self.file.read_exact_at(&mut record_bytes, entry.record_offset)?;
        let (meta, payload_range) = verify_record(&record_bytes, entry)?;
        // Reuse the record's allocation for the payload rather than copying it.
        record_bytes.truncate(payload_range.end);
        record_bytes.drain(..payload_range.start);
        Ok((meta, record_bytes))
    }

    /// Index of the first record with this capture_id.
    pub fn find(&self, capture_id: Uuid) -> Option<usize> {
        self.entries.iter().position(|entry| entry.meta.capture_id == capture_id)
    }

    /// Full offline check in one sequential pass: header CRC, every record CRC, footer entries equal to the records,
    /// and the SHA-256 over everything before the trailer.
    pub fn verify(&self) -> Result<(), PackError> {
        let footer_offset = self.trailer.footer_offset;
        let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, PositionedReader::new(&self.file, 0));
        let scan = scan_stream(&mut reader, footer_offset)?;
        if let Some(reason) = scan.report.cut_reason {
            return Err(corrupt(scan.report.valid_len, reason));
        }
        if scan.report.header != self.header {
            return Err(corrupt(0, "header changed since the pack was opened"));
        }
        if scan.report.entries.len() != self.entries.len() {
            return Err(corrupt(
                footer_offset,
                format!(
                    "footer lists {} records, the data region holds {}",
                    self.entries.len(),
                    scan.report.entries.len()
                ),
            ));
        }
        for (index, (scanned, listed)) in scan.report.entries.iter().zip(&self.entries).enumerate() {
            if scanned != listed {
                return Err(corrupt(
                    listed.record_offset,
                    format!("footer entry {index} disagrees with the record it points at"),
                ));
            }
        }
        let mut hasher = scan.hasher;
        let mut footer_bytes = vec![0u8; self.trailer.footer_len as usize];
        self.file.read_exact_at(&mut footer_bytes, footer_offset)?;
        hasher.update(&footer_bytes);
        let computed: [u8; 32] = hasher.finalize().into();
        if computed != self.trailer.sha256 {
            return Err(PackError::Checksum {
                what: "pack sha-256",
                offset: 0,
                stored: hex::encode(self.trailer.sha256),
                computed: hex::encode(computed),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_meta(index: u8) -> CaptureMeta {
        let mut labels = BTreeMap::new();
        labels.insert("site".to_string(), "edge-7".to_string());
        labels.insert("b".to_string(), String::new());
        CaptureMeta {
            capture_id: Uuid::from_bytes([index; 16]),
            stream: format!("cam/{index}"),
            captured_at_ns: 1_000 + index as u64,
            labels,
            content_type: if index % 2 == 0 { Some("image/png".into()) } else { None },
            source_name: if index % 3 == 0 { Some(format!("file-{index}")) } else { None },
        }
    }

    fn write_pack(dir: &Path, records: &[(CaptureMeta, Vec<u8>)]) -> (PathBuf, PackSummary) {
        let path = dir.join("p.open");
        let mut writer = PackWriter::create(&path, Uuid::from_u128(7), 42).unwrap();
        for (meta, payload) in records {
            writer.append(meta, Bytes::copy_from_slice(payload)).unwrap();
        }
        let summary = writer.finish().unwrap();
        (path, summary)
    }

    fn sample_records(count: u8) -> Vec<(CaptureMeta, Vec<u8>)> {
        (0..count).map(|index| (sample_meta(index), vec![index; index as usize * 10])).collect()
    }

    #[test]
    fn meta_round_trips_and_length_is_predicted() {
        for index in 0..6 {
            let meta = sample_meta(index);
            let mut bytes = Vec::new();
            encode_meta(&meta, &mut bytes);
            assert_eq!(bytes.len() as u64, encoded_meta_len(&meta));
            assert_eq!(decode_meta(&bytes, 0).unwrap(), meta);
        }
    }

    #[test]
    fn meta_trailing_bytes_are_skipped_for_newer_minors() {
        let meta = sample_meta(2);
        let mut bytes = Vec::new();
        encode_meta(&meta, &mut bytes);
        bytes.extend_from_slice(b"future field");
        assert_eq!(decode_meta(&bytes, 0).unwrap(), meta);
    }

    #[test]
    fn meta_rejects_unsorted_labels_and_bad_presence_byte() {
        let mut meta = sample_meta(1);
        meta.labels.clear();
        let mut bytes = Vec::new();
        encode_meta(&meta, &mut bytes);
        // Replace the empty label list by two labels in descending order.
        bytes.truncate(bytes.len() - 4);
        bytes.extend_from_slice(&2u32.to_le_bytes());
        for key in ["z", "a"] {
            put_string(&mut bytes, key);
            put_string(&mut bytes, "v");
        }
        assert!(matches!(decode_meta(&bytes, 0), Err(PackError::Corrupt { .. })));

        let mut presence_bytes = Vec::new();
        encode_meta(&sample_meta(1), &mut presence_bytes);
        let content_type_presence_at = 16 + 8 + 4 + "cam/1".len();
        presence_bytes[content_type_presence_at] = 7;
        let error = decode_meta(&presence_bytes, 100).unwrap_err();
        assert!(error.to_string().contains("presence byte is 7"), "{error}");
    }

    #[test]
    fn validate_meta_enforces_limits() {
        let mut meta = sample_meta(1);
        meta.stream = String::new();
        assert!(matches!(validate_meta(&meta), Err(PackError::Invalid { what: "stream", .. })));
        meta.stream = "s".repeat(MAX_STREAM_BYTES + 1);
        assert!(matches!(validate_meta(&meta), Err(PackError::Limit { what: "stream length", .. })));
        let mut labels_meta = sample_meta(1);
        for index in 0..=MAX_LABELS {
            labels_meta.labels.insert(format!("k{index}"), String::new());
        }
        assert!(matches!(validate_meta(&labels_meta), Err(PackError::Limit { what: "label count", .. })));
        let mut big_meta = sample_meta(1);
        big_meta.labels.clear();
        for index in 0..MAX_LABELS {
            big_meta.labels.insert(format!("k{index}"), "v".repeat(MAX_LABEL_VALUE_BYTES));
        }
        assert!(matches!(validate_meta(&big_meta), Err(PackError::Limit { what: "metadata bytes", .. })));
    }

    #[test]
    fn header_round_trips_and_rejects_damage() {
        let header = PackHeader { major: FORMAT_MAJOR, minor: 3, pack_id: Uuid::from_u128(99), created_at_ns: 123 };
        let bytes = encode_header(&header);
        assert_eq!(decode_header(&bytes).unwrap(), header);
        assert!(matches!(decode_header(&bytes[..39]), Err(PackError::Truncated { .. })));
        let mut bad_magic = bytes;
        bad_magic[0] ^= 1;
        assert!(matches!(decode_header(&bad_magic), Err(PackError::BadMagic { .. })));
        let mut bad_crc = bytes;
        bad_crc[20] ^= 1;
        assert!(matches!(decode_header(&bad_crc), Err(PackError::Checksum { .. })));
        let future = encode_header(&PackHeader { major: 2, ..header });
        assert!(matches!(decode_header(&future), Err(PackError::UnsupportedVersion { major: 2, .. })));
    }

    #[test]
    fn trailer_round_trips_and_rejects_damage() {
        let trailer = Trailer {
            footer_offset: 100,
            footer_len: 50,
            footer_crc32c: 0xdead_beef,
            record_count: 2,
            sha256: [5; 32],
            major: FORMAT_MAJOR,
            minor: 0,
        };
        let bytes = encode_trailer(&trailer);
        assert_eq!(decode_trailer(&bytes).unwrap(), trailer);
        check_trailer_fits(&trailer, 150 + TRAILER_LEN as u64).unwrap();
        assert!(check_trailer_fits(&trailer, 151 + TRAILER_LEN as u64).is_err());
        assert!(matches!(decode_trailer(&bytes[1..]), Err(PackError::Truncated { .. })));
        let mut bad_crc = bytes;
        bad_crc[40] ^= 0x80;
        assert!(matches!(decode_trailer(&bad_crc), Err(PackError::Checksum { .. })));
        let future = encode_trailer(&Trailer { major: 9, ..trailer.clone() });
        assert!(matches!(decode_trailer(&future), Err(PackError::UnsupportedVersion { major: 9, .. })));
        let too_many = encode_trailer(&Trailer { record_count: MAX_RECORDS + 1, ..trailer.clone() });
        assert!(matches!(decode_trailer(&too_many), Err(PackError::Limit { what: "record count", .. })));
        let huge_footer = encode_trailer(&Trailer { footer_len: MAX_FOOTER_BYTES + 1, ..trailer });
        assert!(matches!(decode_trailer(&huge_footer), Err(PackError::Limit { what: "footer bytes", .. })));
    }

    /// Builds a trailer that is valid for `footer` so that the footer checks themselves are exercised.
    fn trailer_for(footer: &[u8], footer_offset: u64, record_count: u64) -> Trailer {
        Trailer {
            footer_offset,
            footer_len: footer.len() as u64,
            footer_crc32c: crc32c::crc32c(footer),
            record_count,
            sha256: [0; 32],
            major: FORMAT_MAJOR,
            minor: FORMAT_MINOR,
        }
    }

    fn sample_entries() -> (Vec<IndexEntry>, u64) {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_pack(dir.path(), &sample_records(3));
        let pack = PackFile::open(&path).unwrap();
        (pack.entries().to_vec(), pack.trailer().footer_offset)
    }

    #[test]
    fn footer_rejects_bad_layouts() {
        let (entries, footer_offset) = sample_entries();
        let good = encode_footer(&entries);
        assert_eq!(decode_footer(&good, &trailer_for(&good, footer_offset, 3)).unwrap(), entries);

        let count_mismatch = decode_footer(&good, &trailer_for(&good, footer_offset, 2)).unwrap_err();
        assert!(count_mismatch.to_string().contains("trailer says 2"), "{count_mismatch}");

        let mut swapped = entries.clone();
        swapped.swap(1, 2);
        let swapped_footer = encode_footer(&swapped);
        let error = decode_footer(&swapped_footer, &trailer_for(&swapped_footer, footer_offset, 3)).unwrap_err();
        assert!(error.to_string().contains("gap before record 1"), "{error}");

        let mut overlapping = entries.clone();
        overlapping[1].record_offset -= 1;
        overlapping[1].payload_offset -= 1;
        let overlapping_footer = encode_footer(&overlapping);
        let error =
            decode_footer(&overlapping_footer, &trailer_for(&overlapping_footer, footer_offset, 3)).unwrap_err();
        assert!(error.to_string().contains("overlaps"), "{error}");

        let outside = decode_footer(&good, &trailer_for(&good, footer_offset - 1, 3)).unwrap_err();
        assert!(outside.to_string().contains("past the data region"), "{outside}");

        let short_region = decode_footer(&good, &trailer_for(&good, footer_offset + 1, 3)).unwrap_err();
        assert!(short_region.to_string().contains("records end at"), "{short_region}");

        let mut bad_payload_offset = entries.clone();
        bad_payload_offset[0].payload_offset += 1;
        let bad_footer = encode_footer(&bad_payload_offset);
        assert!(decode_footer(&bad_footer, &trailer_for(&bad_footer, footer_offset, 3)).is_err());

        let mut flipped = good.clone();
        flipped[20] ^= 1;
        assert!(matches!(
            decode_footer(&flipped, &trailer_for(&good, footer_offset, 3)),
            Err(PackError::Checksum { .. })
        ));

        let mut extended = good.clone();
        extended.extend_from_slice(b"pack-level field of a newer minor");
        assert_eq!(decode_footer(&extended, &trailer_for(&extended, footer_offset, 3)).unwrap(), entries);
    }

    #[test]
    fn decode_record_checks_entry_agreement() {
        let dir = tempfile::tempdir().unwrap();
        let records = sample_records(3);
        let (path, _) = write_pack(dir.path(), &records);
        let bytes = std::fs::read(&path).unwrap();
        let (_, _, entries) = decode_pack(&bytes).unwrap();
        for (entry, (meta, payload)) in entries.iter().zip(&records) {
            let record = &bytes[entry.record_range().start as usize..entry.record_range().end as usize];
            let (decoded_meta, decoded_payload) = decode_record(record, entry).unwrap();
            assert_eq!(&decoded_meta, meta);
            assert_eq!(&decoded_payload, payload);
            assert_eq!(&bytes[entry.payload_range().start as usize..entry.payload_range().end as usize], payload);
        }
        let record = &bytes[entries[1].record_range().start as usize..entries[1].record_range().end as usize];
        let mut other_meta = entries[1].clone();
        other_meta.meta.captured_at_ns += 1;
        let error = decode_record(record, &other_meta).unwrap_err();
        assert!(error.to_string().contains("disagrees with its footer entry"), "{error}");
        let mut other_crc = entries[1].clone();
        other_crc.crc32c ^= 1;
        assert!(matches!(decode_record(record, &other_crc), Err(PackError::Checksum { .. })));
        assert!(matches!(decode_record(&record[1..], &entries[1]), Err(PackError::Truncated { .. })));
    }

    #[test]
    fn writer_round_trip_through_pack_file() {
        let dir = tempfile::tempdir().unwrap();
        let records = sample_records(5);
        let (path, summary) = write_pack(dir.path(), &records);
        let pack = PackFile::open(&path).unwrap();
        pack.verify().unwrap();
        assert_eq!(pack.summary(), summary);
        assert_eq!(summary.bytes, std::fs::metadata(&path).unwrap().len());
        assert_eq!(summary.records, 5);
        assert_eq!(summary.first_captured_at_ns, 1_000);
        assert_eq!(summary.last_captured_at_ns, 1_004);
        let file_sha: [u8; 32] =
            Sha256::digest(&std::fs::read(&path).unwrap()[..summary.bytes as usize - TRAILER_LEN]).into();
        assert_eq!(summary.sha256_hex, hex::encode(file_sha));
        for (index, (meta, payload)) in records.iter().enumerate() {
            assert_eq!(pack.find(meta.capture_id), Some(index));
            assert_eq!(&pack.read_capture(index).unwrap(), &(meta.clone(), payload.clone()));
        }
        assert!(pack.find(Uuid::from_u128(12345)).is_none());
        assert!(matches!(pack.read_capture(5), Err(PackError::Invalid { .. })));
    }

    #[test]
    fn empty_pack_is_valid() {
        let dir = tempfile::tempdir().unwrap();
        let (path, summary) = write_pack(dir.path(), &[]);
        assert_eq!(summary.records, 0);
        assert_eq!(summary.bytes, (HEADER_LEN + FOOTER_HEADER_LEN + TRAILER_LEN) as u64);
        let pack = PackFile::open(&path).unwrap();
        pack.verify().unwrap();
        assert!(pack.entries().is_empty());
    }

    #[test]
    fn append_rejects_over_limit_without_writing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.open");
        let mut writer = PackWriter::create(&path, Uuid::from_u128(1), 1).unwrap();
        writer.set_max_payload_bytes(10).unwrap();
        assert!(writer.set_max_payload_bytes(MAX_PAYLOAD_BYTES + 1).is_err());
        let before = writer.len_bytes();
        let error = writer.append(&sample_meta(1), Bytes::from_static(&[0; 11])).unwrap_err();
        assert!(matches!(error, PackError::Limit { what: "payload bytes", value: 11, max: 10 }));
        let mut bad_meta = sample_meta(1);
        bad_meta.stream.clear();
        assert!(writer.append(&bad_meta, Bytes::from_static(b"x")).is_err());
        assert_eq!(writer.len_bytes(), before);
        assert_eq!(writer.record_count(), 0);
        writer.append(&sample_meta(1), Bytes::from_static(&[0; 10])).unwrap();
        assert_eq!(writer.record_count(), 1);
    }

    #[test]
    fn large_payloads_are_written_directly_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let big_payload: Vec<u8> = (0..3 * WRITE_BUFFER_FLUSH_BYTES).map(|index| (index % 251) as u8).collect();
        let records = vec![
            (sample_meta(1), vec![1; 100]),
            (sample_meta(2), big_payload),
            (sample_meta(3), vec![3; WRITE_BUFFER_FLUSH_BYTES - 200]),
            (sample_meta(4), vec![4; 100]),
        ];
        let path = dir.path().join("p.open");
        let mut writer = PackWriter::create(&path, Uuid::from_u128(7), 42).unwrap();
        for (meta, payload) in &records {
            writer.append(meta, Bytes::copy_from_slice(payload)).unwrap();
            assert!(writer.unwritten_len() < WRITE_BUFFER_FLUSH_BYTES as u64);
        }
        writer.finish().unwrap();
        let pack = PackFile::open(&path).unwrap();
        pack.verify().unwrap();
        for (index, (meta, payload)) in records.iter().enumerate() {
            assert_eq!(&pack.read_capture(index).unwrap(), &(meta.clone(), payload.clone()));
        }
    }

    #[test]
    fn recover_keeps_synced_records_and_cuts_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.open");
        let records = sample_records(4);
        let mut writer = PackWriter::create(&path, Uuid::from_u128(7), 42).unwrap();
        for (meta, payload) in &records[..3] {
            writer.append(meta, Bytes::copy_from_slice(payload)).unwrap();
        }
        writer.sync().unwrap();
        let synced_len = writer.len_bytes();
        writer.append(&records[3].0, Bytes::copy_from_slice(&records[3].1)).unwrap();
        writer.sync().unwrap();
        drop(writer);
        // Tear the last record in half, as a crash during its write would.
        let full_len = std::fs::metadata(&path).unwrap().len();
        let torn_len = synced_len + (full_len - synced_len) / 2;
        OpenOptions::new().write(true).open(&path).unwrap().set_len(torn_len).unwrap();

        let (mut recovered, report) = PackWriter::recover(&path).unwrap();
        assert_eq!(report.records_kept, 3);
        assert_eq!(report.bytes_cut, torn_len - synced_len);
        assert!(report.cut_reason.as_deref().unwrap().contains("torn record"), "{report:?}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), synced_len);
        assert_eq!(recovered.len_bytes(), synced_len);
        assert_eq!(recovered.pack_id(), Uuid::from_u128(7));
        assert_eq!(recovered.created_at_ns(), 42);
        recovered.append(&records[3].0, Bytes::copy_from_slice(&records[3].1)).unwrap();
        let summary = recovered.finish().unwrap();

        // Same bytes as a clean run.
        let clean_dir = tempfile::tempdir().unwrap();
        let (clean_path, clean_summary) = write_pack(clean_dir.path(), &records);
        assert_eq!(summary, clean_summary);
        assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&clean_path).unwrap());
    }

    #[test]
    fn recover_of_finished_but_unrenamed_pack_drops_footer_and_reseals_identically() {
        let dir = tempfile::tempdir().unwrap();
        let records = sample_records(3);
        let (path, summary) = write_pack(dir.path(), &records);
        let original = std::fs::read(&path).unwrap();
        let (recovered, report) = PackWriter::recover(&path).unwrap();
        assert_eq!(report.records_kept, 3);
        assert!(report.cut_reason.as_deref().unwrap().contains("footer at offset"), "{report:?}");
        assert_eq!(recovered.finish().unwrap(), summary);
        assert_eq!(std::fs::read(&path).unwrap(), original);
    }

    #[test]
    fn recover_stops_at_corrupt_record_and_rejects_torn_header() {
        let dir = tempfile::tempdir().unwrap();
        let records = sample_records(3);
        let (path, _) = write_pack(dir.path(), &records);
        let entries = PackFile::open(&path).unwrap().entries().to_vec();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[entries[1].payload_offset as usize] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let (_, report) = PackWriter::recover(&path).unwrap();
        assert_eq!(report.records_kept, 1);
        assert_eq!(report.entries, entries[..1].to_vec());
        assert!(report.cut_reason.unwrap().contains("checksum mismatch"));

        std::fs::write(&path, &bytes[..HEADER_LEN - 1]).unwrap();
        assert!(matches!(PackWriter::recover(&path), Err(PackError::Truncated { what: "header", .. })));
        let mut bad_header = bytes[..HEADER_LEN].to_vec();
        bad_header[30] ^= 1;
        std::fs::write(&path, &bad_header).unwrap();
        assert!(matches!(PackWriter::recover(&path), Err(PackError::Checksum { .. })));
    }

    #[test]
    fn verify_detects_footer_that_lies_about_a_record() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_pack(dir.path(), &sample_records(2));
        let mut bytes = std::fs::read(&path).unwrap();
        let (header, trailer, mut entries) = decode_pack(&bytes).unwrap();
        // A footer that is self-consistent (valid CRCs) but names a different capture.
        // Same encoded length, so the record extents stay consistent; only the metadata differs.
        entries[0].meta.captured_at_ns += 1;
        let forged_footer = encode_footer(&entries);
        bytes.truncate(trailer.footer_offset as usize);
        bytes.extend_from_slice(&forged_footer);
        let forged_trailer = Trailer {
            footer_len: forged_footer.len() as u64,
            footer_crc32c: crc32c::crc32c(&forged_footer),
            sha256: Sha256::digest(&bytes).into(),
            ..trailer
        };
        bytes.extend_from_slice(&encode_trailer(&forged_trailer));
        std::fs::write(&path, &bytes).unwrap();
        let pack = PackFile::open(&path).unwrap();
        assert_eq!(pack.header(), &header);
        let error = pack.verify().unwrap_err();
        assert!(error.to_string().contains("footer entry 0 disagrees"), "{error}");
        assert!(pack.read_capture(0).is_err());
    }

    #[test]
    fn create_refuses_existing_file_and_poisoned_writer_refuses_work() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.open");
        let mut writer = PackWriter::create(&path, Uuid::from_u128(1), 1).unwrap();
        assert!(matches!(PackWriter::create(&path, Uuid::from_u128(1), 1), Err(PackError::Io(_))));
        writer.append(&sample_meta(1), Bytes::from_static(b"x")).unwrap();
        let point = writer.flush().unwrap();
        // As a failed fsync on the syncer thread would: the point and the writer share the poison.
        point.poisoned.lock().unwrap().replace("disk on fire".into());
        assert!(matches!(point.sync(), Err(PackError::Poisoned { .. })));
        assert!(matches!(writer.append(&sample_meta(2), Bytes::from_static(b"y")), Err(PackError::Poisoned { .. })));
        assert!(matches!(writer.sync(), Err(PackError::Poisoned { .. })));
        assert!(matches!(writer.finish(), Err(PackError::Poisoned { .. })));
    }

    #[test]
    fn error_messages_are_lowercase_and_name_the_field() {
        let error = PackError::Limit { what: "payload bytes", value: 5, max: 4 };
        assert_eq!(error.to_string(), "payload bytes is 5, over the limit of 4");
        assert!(error.is_data_error());
        let invalid = PackError::Invalid { what: "stream", reason: "must not be empty".into() };
        assert!(!invalid.is_data_error());
    }
}
