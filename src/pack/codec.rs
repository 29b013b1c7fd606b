//! Encode and decode of every block of a pack, with the layout checks every reader applies.

use std::collections::BTreeMap;
use std::ops::Range;

use uuid::Uuid;

use super::*;

// ---------------------------------------------------------------------------------------------------------------------
// Little-endian field access

pub(super) fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2-byte slice"))
}

pub(super) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4-byte slice"))
}

pub(super) fn u64_at(bytes: &[u8], at: usize) -> u64 {
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
pub fn check_meta_limits(meta: &CaptureMeta) -> Result<(), PackError> {
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

pub(super) fn put_string(out: &mut Vec<u8>, value: &str) {
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
    check_meta_limits(&meta).map_err(|error| match error {
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

pub(super) fn footer_entry_len(meta_len: u64) -> u64 {
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

pub(super) fn record_header_bytes(meta_len: u32, payload_len: u32, crc: u32) -> [u8; RECORD_HEADER_LEN] {
    let mut bytes = [0u8; RECORD_HEADER_LEN];
    bytes[0..4].copy_from_slice(&RECORD_MAGIC);
    bytes[4..8].copy_from_slice(&meta_len.to_le_bytes());
    bytes[8..12].copy_from_slice(&payload_len.to_le_bytes());
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    bytes
}

/// Verifies a whole record against its footer entry and returns its metadata and the payload's range in
/// `record_bytes`.
pub(super) fn verify_record(record_bytes: &[u8], entry: &IndexEntry) -> Result<(CaptureMeta, Range<usize>), PackError> {
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
