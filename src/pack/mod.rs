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
//! Metadata block (in records and in footer entries alike): capture_id `[16]`, captured_at_ns u64, stream (u32 length +
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
//!
//! # Files
//!
//! - `codec.rs`: encode and decode of every block (metadata, header, trailer, footer, record), with the layout checks.
//! - `scan.rs`: the sequential scan from the start of a pack (recovery of `.open` files, full verification).
//! - `writer.rs`: [`PackWriter`], the appender of `.open` files, and its [`SyncPoint`]s.
//! - `sealed.rs`: [`PackFile`], a sealed pack on local disk.
//! - `hasher.rs`: the pack's SHA-256 on a thread of its own.

mod codec;
mod hasher;
mod scan;
mod sealed;
mod writer;

pub use codec::{
    check_meta_limits, check_trailer_fits, decode_footer, decode_header, decode_meta, decode_record, decode_trailer,
    encode_footer, encode_header, encode_meta, encode_trailer, encoded_meta_len, entry_from_location,
};
pub use scan::{scan_bytes, scan_file, ScanReport};
pub use sealed::{decode_pack, PackFile};
pub use writer::{Durability, PackWriter, SyncPoint};

use std::io;
use std::ops::Range;
use std::path::PathBuf;

use uuid::Uuid;

pub use crate::capture::CaptureMeta;

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

/// A pack file opened for reading, with its length. Something in its place that is not a regular file (a directory, a
/// FIFO someone made there) is an I/O error, not bad bytes, on every filesystem (a directory's length differs between
/// them), and is refused before it is opened (a FIFO's open would wait for a writer).
fn open_pack_file(path: &std::path::Path) -> Result<(std::fs::File, u64), PackError> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(PackError::Io(io::Error::other(format!("{} is not a regular file", path.display()))));
    }
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    Ok((file, len))
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

#[cfg(test)]
mod tests;
