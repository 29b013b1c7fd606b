//! Unit tests of the pack format: every block's round trip and damage checks, the writer, recovery and sealed reads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::fs::OpenOptions;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::codec::put_string;
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
        content_type: if index.is_multiple_of(2) { Some("image/png".into()) } else { None },
        source_name: if index.is_multiple_of(3) { Some(format!("file-{index}")) } else { None },
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
    assert!(matches!(check_meta_limits(&meta), Err(PackError::Invalid { what: "stream", .. })));
    meta.stream = "s".repeat(MAX_STREAM_BYTES + 1);
    assert!(matches!(check_meta_limits(&meta), Err(PackError::Limit { what: "stream length", .. })));
    let mut labels_meta = sample_meta(1);
    for index in 0..=MAX_LABELS {
        labels_meta.labels.insert(format!("k{index}"), String::new());
    }
    assert!(matches!(check_meta_limits(&labels_meta), Err(PackError::Limit { what: "label count", .. })));
    let mut big_meta = sample_meta(1);
    big_meta.labels.clear();
    for index in 0..MAX_LABELS {
        big_meta.labels.insert(format!("k{index}"), "v".repeat(MAX_LABEL_VALUE_BYTES));
    }
    assert!(matches!(check_meta_limits(&big_meta), Err(PackError::Limit { what: "metadata bytes", .. })));
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
    let error = decode_footer(&overlapping_footer, &trailer_for(&overlapping_footer, footer_offset, 3)).unwrap_err();
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
    assert!(matches!(decode_footer(&flipped, &trailer_for(&good, footer_offset, 3)), Err(PackError::Checksum { .. })));

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
