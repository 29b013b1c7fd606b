//! Pack format conformance: golden vector and property tests.
//!
//! The golden vector `tests/data/golden-v1.cpk` pins the v1 byte layout. If a change to the writer alters it, the
//! `golden_vector_*` tests fail. Only when the change is a deliberate format change (and `specs/pack-format.md` and the
//! version numbers say so) regenerate it with:
//!
//! ```text
//! CAPSTORE_REGENERATE_GOLDEN=1 cargo test --test pack_format golden_vector_is_reproduced
//! ```
//!
//! and commit the new file. A reader of an existing major must keep reading old golden files, so keep old vectors.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use capstore::pack::{
    decode_footer, decode_header, decode_pack, decode_record, decode_trailer, scan_bytes, CaptureMeta, IndexEntry,
    PackError, PackFile, PackWriter, FORMAT_MAJOR, FORMAT_MINOR, HEADER_LEN, PACK_MAGIC, RECORD_HEADER_LEN,
    TRAILER_LEN, TRAILER_MAGIC,
};
use proptest::prelude::*;
use uuid::Uuid;

const GOLDEN_PACK_ID: u128 = 0x0190_0000_0000_7000_8000_0000_0000_0001;
const GOLDEN_CREATED_AT_NS: u64 = 1_700_000_000_000_000_000;

fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1.cpk")
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(key, value)| (key.to_string(), value.to_string())).collect()
}

/// The three captures of the golden vector: labels, a content_type, an empty payload and source names.
fn golden_captures() -> Vec<(CaptureMeta, Vec<u8>)> {
    vec![
        (
            CaptureMeta {
                capture_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_00a1),
                stream: "cam/front".into(),
                captured_at_ns: GOLDEN_CREATED_AT_NS + 1_000,
                labels: labels(&[("site", "edge-7"), ("lens", "wide")]),
                content_type: Some("image/jpeg".into()),
                source_name: None,
            },
            b"\xff\xd8\xff\xe0golden jpeg bytes\xff\xd9".to_vec(),
        ),
        (
            CaptureMeta {
                capture_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_00a2),
                stream: "cam/front".into(),
                captured_at_ns: GOLDEN_CREATED_AT_NS + 2_000,
                labels: BTreeMap::new(),
                content_type: None,
                source_name: Some("0002.bin".into()),
            },
            Vec::new(),
        ),
        (
            CaptureMeta {
                capture_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_00a3),
                stream: "lidar/top".into(),
                captured_at_ns: GOLDEN_CREATED_AT_NS + 500,
                labels: labels(&[("site", "edge-7")]),
                content_type: None,
                source_name: Some("frame-0003.pcd".into()),
            },
            (0..=255u8).collect(),
        ),
    ]
}

/// The bytes of a pack of `captures` written to `path`.
fn write_pack(path: &Path, pack_id: Uuid, created_at_ns: u64, captures: &[(CaptureMeta, Vec<u8>)]) -> Vec<u8> {
    common::packs::write_pack(path, pack_id, created_at_ns, captures.to_vec());
    std::fs::read(path).unwrap()
}

fn record_bytes<'a>(pack_bytes: &'a [u8], entry: &IndexEntry) -> &'a [u8] {
    &pack_bytes[entry.record_offset as usize..(entry.record_offset + entry.record_len) as usize]
}

#[test]
fn golden_vector_is_reproduced_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let built = write_pack(
        &dir.path().join("golden.open"),
        Uuid::from_u128(GOLDEN_PACK_ID),
        GOLDEN_CREATED_AT_NS,
        &golden_captures(),
    );
    if std::env::var_os("CAPSTORE_REGENERATE_GOLDEN").is_some_and(|value| value == "1") {
        std::fs::create_dir_all(golden_path().parent().unwrap()).unwrap();
        std::fs::write(golden_path(), &built).unwrap();
        eprintln!("regenerated {}", golden_path().display());
    }
    let checked_in = std::fs::read(golden_path()).expect("tests/data/golden-v1.cpk is missing; see this file's doc");
    assert_eq!(
        built, checked_in,
        "the writer no longer produces the golden v1 bytes: a format change needs a version bump and a spec update"
    );
}

#[test]
fn golden_vector_reads_back() {
    let bytes = std::fs::read(golden_path()).unwrap();
    // Fixed positions the spec promises.
    assert_eq!(bytes[0..8], PACK_MAGIC);
    assert_eq!(bytes[bytes.len() - 8..], TRAILER_MAGIC);
    assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), FORMAT_MAJOR);
    assert_eq!(u16::from_le_bytes([bytes[10], bytes[11]]), FORMAT_MINOR);
    assert_eq!(bytes[HEADER_LEN..HEADER_LEN + 4], *b"CREC");

    let header = decode_header(&bytes[..HEADER_LEN]).unwrap();
    assert_eq!(header.pack_id, Uuid::from_u128(GOLDEN_PACK_ID));
    assert_eq!(header.created_at_ns, GOLDEN_CREATED_AT_NS);
    // Listing needs two range reads: the trailer, then the footer.
    let trailer = decode_trailer(&bytes[bytes.len() - TRAILER_LEN..]).unwrap();
    let footer = &bytes[trailer.footer_offset as usize..(trailer.footer_offset + trailer.footer_len) as usize];
    let entries = decode_footer(footer, &trailer).unwrap();
    let captures = golden_captures();
    assert_eq!(entries.len(), captures.len());
    assert_eq!(entries[0].record_offset, HEADER_LEN as u64);
    for (entry, (meta, payload)) in entries.iter().zip(&captures) {
        assert_eq!(&entry.meta, meta);
        assert_eq!(entry.payload_len, payload.len() as u64);
        // Reading one capture needs one range read: its record.
        let (decoded_meta, decoded_payload) = decode_record(record_bytes(&bytes, entry), entry).unwrap();
        assert_eq!(&decoded_meta, meta);
        assert_eq!(&decoded_payload, payload);
        assert_eq!(entry.payload_offset, entry.record_offset + entry.record_len - entry.payload_len);
        assert!(entry.payload_offset >= entry.record_offset + RECORD_HEADER_LEN as u64);
    }

    let dir = tempfile::tempdir().unwrap();
    let copy_path = dir.path().join("golden.cpk");
    std::fs::write(&copy_path, &bytes).unwrap();
    let pack = PackFile::open(&copy_path).unwrap();
    pack.verify().unwrap();
    let summary = pack.summary();
    assert_eq!(summary.records, 3);
    assert_eq!(summary.bytes, bytes.len() as u64);
    assert_eq!(summary.first_captured_at_ns, GOLDEN_CREATED_AT_NS + 500);
    assert_eq!(summary.last_captured_at_ns, GOLDEN_CREATED_AT_NS + 2_000);
    for (index, (meta, payload)) in captures.iter().enumerate() {
        assert_eq!(pack.find(meta.capture_id), Some(index));
        assert_eq!(pack.read_capture(index).unwrap(), (meta.clone(), payload.clone()));
    }
}

#[test]
fn unknown_major_version_is_rejected_everywhere() {
    let mut bytes = std::fs::read(golden_path()).unwrap();
    let trailer_start = bytes.len() - TRAILER_LEN;
    // Major 2 in both the header and the trailer; CRCs are not even reached.
    bytes[8..10].copy_from_slice(&2u16.to_le_bytes());
    bytes[trailer_start + 64..trailer_start + 66].copy_from_slice(&2u16.to_le_bytes());
    assert!(matches!(decode_header(&bytes), Err(PackError::UnsupportedVersion { major: 2, .. })));
    assert!(matches!(decode_trailer(&bytes[trailer_start..]), Err(PackError::UnsupportedVersion { major: 2, .. })));
    assert!(matches!(decode_pack(&bytes), Err(PackError::UnsupportedVersion { .. })));
    assert!(matches!(scan_bytes(&bytes), Err(PackError::UnsupportedVersion { .. })));
}

// -------------------------------------------------------------------------------------------------------------------
// Property tests

fn arb_meta() -> impl Strategy<Value = CaptureMeta> {
    (
        any::<u128>(),
        "[a-z]{1,10}(/[a-z0-9._-]{1,8}){0,3}",
        any::<u64>(),
        proptest::collection::btree_map("[a-z][a-z0-9_]{0,11}", "\\PC{0,12}", 0..5),
        proptest::option::of("[a-z]{1,8}/[a-z0-9.+-]{1,12}"),
        proptest::option::of("[A-Za-z0-9._-]{1,24}"),
    )
        .prop_map(|(id, stream, captured_at_ns, labels, content_type, source_name)| CaptureMeta {
            capture_id: Uuid::from_u128(id),
            stream,
            captured_at_ns,
            labels,
            content_type,
            source_name,
        })
}

fn arb_captures(max_records: usize, max_payload: usize) -> impl Strategy<Value = Vec<(CaptureMeta, Vec<u8>)>> {
    proptest::collection::vec((arb_meta(), proptest::collection::vec(any::<u8>(), 0..max_payload)), 0..max_records)
}

/// Builds a pack in memory by way of a temporary file, returning its bytes and footer entries.
fn build(captures: &[(CaptureMeta, Vec<u8>)]) -> (Vec<u8>, Vec<IndexEntry>) {
    let dir = tempfile::tempdir().unwrap();
    let bytes = write_pack(&dir.path().join("p.open"), Uuid::from_u128(77), 5, captures);
    let (_, _, entries) = decode_pack(&bytes).unwrap();
    (bytes, entries)
}

/// A scan result must be a prefix of the complete records, each one byte-identical to what was written.
fn assert_scan_is_prefix(
    scanned: &[IndexEntry],
    written: &[IndexEntry],
    scanned_bytes: &[u8],
    captures: &[(CaptureMeta, Vec<u8>)],
) -> Result<(), TestCaseError> {
    prop_assert!(scanned.len() <= written.len());
    for (index, entry) in scanned.iter().enumerate() {
        prop_assert_eq!(entry, &written[index]);
        let (meta, payload) = decode_record(record_bytes(scanned_bytes, entry), entry)
            .map_err(|error| TestCaseError::fail(format!("scanned record {index} does not decode: {error}")))?;
        prop_assert_eq!(&meta, &captures[index].0);
        prop_assert_eq!(&payload, &captures[index].1);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_captures_round_trip(captures in arb_captures(8, 3000)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.open");
        let bytes = write_pack(&path, Uuid::from_u128(1), 2, &captures);
        let pack = PackFile::open(&path).unwrap();
        pack.verify().unwrap();
        prop_assert_eq!(pack.entries().len(), captures.len());
        prop_assert_eq!(pack.summary().bytes, bytes.len() as u64);
        for (index, (meta, payload)) in captures.iter().enumerate() {
            let (read_meta, read_payload) = pack.read_capture(index).unwrap();
            prop_assert_eq!(&read_meta, meta);
            prop_assert_eq!(&read_payload, payload);
        }
        let scan = scan_bytes(&bytes).unwrap();
        prop_assert_eq!(scan.entries.as_slice(), pack.entries());
        prop_assert_eq!(scan.valid_len, pack.trailer().footer_offset);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Every strict prefix of a pack: the sealed-pack readers refuse it, the scan returns a prefix of the records.
    #[test]
    fn truncation_at_every_offset_never_returns_wrong_bytes(
        captures in arb_captures(5, 200),
        recover_cut_seeds in proptest::collection::vec(any::<u32>(), 3),
    ) {
        let (bytes, entries) = build(&captures);
        for cut in 0..bytes.len() {
            let prefix = &bytes[..cut];
            prop_assert!(decode_pack(prefix).is_err(), "decode_pack accepted a {}-byte prefix", cut);
            match scan_bytes(prefix) {
                Err(error) => {
                    prop_assert!(cut < HEADER_LEN, "scan failed past the header at cut {}: {}", cut, error);
                }
                Ok(scan) => {
                    prop_assert!(cut >= HEADER_LEN);
                    assert_scan_is_prefix(&scan.entries, &entries, prefix, &captures)?;
                    let complete = entries.iter().filter(|entry| entry.record_offset + entry.record_len <= cut as u64).count();
                    // Every complete record before the cut is kept.
                    prop_assert_eq!(scan.entries.len(), complete);
                }
            }
        }
        // The file-based recovery on a few cut points: same answer, file cut at the last good record.
        let dir = tempfile::tempdir().unwrap();
        for seed in recover_cut_seeds {
            let cut = HEADER_LEN + seed as usize % (bytes.len() - HEADER_LEN);
            let path = dir.path().join(format!("cut-{cut}.open"));
            std::fs::write(&path, &bytes[..cut]).unwrap();
            let (writer, report) = PackWriter::recover(&path).unwrap();
            assert_scan_is_prefix(&report.entries, &entries, &bytes, &captures)?;
            let kept_end = report.entries.last().map_or(HEADER_LEN as u64, |entry| entry.record_offset + entry.record_len);
            prop_assert_eq!(writer.len_bytes(), kept_end);
            prop_assert_eq!(report.bytes_cut, cut as u64 - kept_end);
            prop_assert_eq!(std::fs::metadata(&path).unwrap().len(), kept_end);
            drop(writer);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// One to three flipped bits anywhere: no panic, no wrong payload, and a full verify always notices.
    #[test]
    fn flipped_bits_never_yield_wrong_bytes(
        captures in arb_captures(4, 300),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..4),
    ) {
        let (original, entries) = build(&captures);
        let mut damaged = original.clone();
        for (position, bit) in &flips {
            let flipped_at = position.index(original.len());
            damaged[flipped_at] ^= 1 << bit;
        }
        prop_assume!(damaged != original);

        // Sealed-pack path: whatever decodes must be exactly what was written.
        if let Ok((_, _, decoded_entries)) = decode_pack(&damaged) {
            prop_assert_eq!(&decoded_entries, &entries);
            for (index, entry) in decoded_entries.iter().enumerate() {
                if let Ok((meta, payload)) = decode_record(record_bytes(&damaged, entry), entry) {
                    prop_assert_eq!(&meta, &captures[index].0);
                    prop_assert_eq!(&payload, &captures[index].1);
                }
            }
        }
        // Records read with the trusted (undamaged) index: checksum error or the right bytes.
        for (index, entry) in entries.iter().enumerate() {
            match decode_record(record_bytes(&damaged, entry), entry) {
                Ok((meta, payload)) => {
                    prop_assert_eq!(&meta, &captures[index].0);
                    prop_assert_eq!(&payload, &captures[index].1);
                }
                Err(error) => prop_assert!(error.is_data_error(), "unexpected error kind: {}", error),
            }
        }
        // Recovery path: a prefix of the records, byte-identical.
        if let Ok(scan) = scan_bytes(&damaged) {
            assert_scan_is_prefix(&scan.entries, &entries, &damaged, &captures)?;
        }
        // Full offline check notices any damage.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("damaged.cpk");
        std::fs::write(&path, &damaged).unwrap();
        if let Ok(pack) = PackFile::open(&path) {
            prop_assert!(pack.verify().is_err(), "verify accepted a damaged pack");
        }
    }
}
