//! Sealed packs: decoding a whole pack in memory, and [`PackFile`], a sealed pack on local disk.

use std::fs::File;
use std::io::BufReader;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sha2::Digest;
use uuid::Uuid;

use super::codec::{check_trailer_fits, decode_footer, decode_header, decode_trailer, verify_record};
use super::scan::{scan_stream, PositionedReader};
use super::*;

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

pub(super) fn check_header_matches_trailer(header: &PackHeader, trailer: &Trailer) -> Result<(), PackError> {
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
        let (file, object_len) = open_pack_file(path)?;
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

    /// Index of the last record with this capture_id: an id posted twice into one pack is its last post, as the
    /// catalog publishes it.
    pub fn find(&self, capture_id: Uuid) -> Option<usize> {
        self.entries.iter().rposition(|entry| entry.meta.capture_id == capture_id)
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
