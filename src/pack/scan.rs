//! Sequential scan of a pack from its start: what recovery keeps of an `.open` file, and full verification.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::codec::{decode_header, decode_meta, footer_entry_len, u32_at};
use super::*;

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

pub(super) struct ScanState {
    pub(super) report: ScanReport,
    /// SHA-256 of bytes `0..valid_len`.
    pub(super) hasher: Sha256,
    pub(super) footer_len: u64,
}

enum RecordScan {
    Complete(IndexEntry),
    Stop(String),
}

/// Scans `total_len` bytes of a pack from offset 0. Fails only when the header is torn or invalid, or on I/O errors;
/// a torn or corrupt record ends the scan and is reported in `cut_reason`.
pub(super) fn scan_stream<R: Read>(reader: &mut R, total_len: u64) -> Result<ScanState, PackError> {
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
    let (file, total_len) = open_pack_file(path)?;
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, PositionedReader::new(&file, 0));
    Ok(scan_stream(&mut reader, total_len)?.report)
}

/// `Read` over a file by positioned reads, so concurrent users of the same `File` never share a cursor.
pub(super) struct PositionedReader<'a> {
    file: &'a File,
    offset: u64,
}

impl<'a> PositionedReader<'a> {
    pub(super) fn new(file: &'a File, offset: u64) -> Self {
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
