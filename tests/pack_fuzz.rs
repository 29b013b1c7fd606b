//! Structural fuzzing of the pack readers: take a valid pack, overwrite a field of its header, trailer, footer, a
//! record header or a metadata block with an arbitrary value, then re-seal every checksum (header, record, footer and
//! trailer CRCs) so the damage gets past the CRCs (a plain bit flip rarely does) and reaches the structural checks.
//! Every reader must then answer with a value or an error that says what is wrong, never panic, and never allocate
//! more than a small multiple of the pack's size: a counting allocator measures the largest allocation made while a
//! reader runs.

#![allow(unsafe_code, reason = "a counting global allocator forwards to the system allocator")]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use capstore::capture::CaptureMeta;
use capstore::pack::{decode_footer, decode_pack, decode_record, decode_trailer, scan_bytes, IndexEntry, TRAILER_LEN};
use proptest::prelude::*;
use uuid::Uuid;

/// Tracks the largest single allocation made on this thread while [`measuring`] runs.
struct CountingAllocator;

thread_local! {
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded as is to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded as is to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn note(size: usize) {
    // try_with: the allocator also runs while thread-locals are torn down.
    let _ = MEASURING.try_with(|measuring| {
        if measuring.get() {
            let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
        }
    });
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Runs `read` and returns its result with the largest allocation it made.
fn measuring<T>(read: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|largest| largest.set(0));
    MEASURING.with(|measuring| measuring.set(true));
    let result = read();
    MEASURING.with(|measuring| measuring.set(false));
    (result, LARGEST.with(Cell::get))
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Where the fields of a valid pack are, so they can be overwritten and the checksums re-sealed.
struct PackLayout {
    footer_offset: usize,
    entries: Vec<IndexEntry>,
    /// Offset in the pack of each footer entry's length prefix.
    entry_starts: Vec<usize>,
}

fn layout_of(bytes: &[u8]) -> PackLayout {
    let (_, trailer, entries) = decode_pack(bytes).unwrap();
    let footer_offset = trailer.footer_offset as usize;
    let mut entry_starts = Vec::new();
    let mut at = footer_offset + 12;
    for _ in &entries {
        entry_starts.push(at);
        at += 4 + u32_at(bytes, at) as usize;
    }
    PackLayout { footer_offset, entries, entry_starts }
}

/// Recomputes every checksum over the (damaged) structure as the pack's own fields now describe it, where those
/// fields still point inside the pack.
fn reseal(bytes: &mut [u8], layout: &PackLayout) {
    let header_crc = crc32c::crc32c(&bytes[0..36]);
    bytes[36..40].copy_from_slice(&header_crc.to_le_bytes());
    for entry in &layout.entries {
        let at = entry.record_offset as usize;
        let meta_len = u32_at(bytes, at + 4) as usize;
        let payload_len = u32_at(bytes, at + 8) as usize;
        let end = at.checked_add(16 + meta_len + payload_len);
        if let Some(end) = end.filter(|end| *end <= layout.footer_offset) {
            let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes[at..at + 12]), &bytes[at + 16..end]);
            bytes[at + 12..at + 16].copy_from_slice(&crc.to_le_bytes());
        }
    }
    let trailer_at = bytes.len() - TRAILER_LEN;
    let footer_offset = u64_at(bytes, trailer_at + 8) as usize;
    let footer_len = u64_at(bytes, trailer_at + 16) as usize;
    if let Some(footer_end) = footer_offset.checked_add(footer_len).filter(|end| *end <= trailer_at) {
        let footer_crc = crc32c::crc32c(&bytes[footer_offset..footer_end]);
        bytes[trailer_at + 4..trailer_at + 8].copy_from_slice(&footer_crc.to_le_bytes());
    }
    let trailer_crc = crc32c::crc32c(&bytes[trailer_at + 4..]);
    bytes[trailer_at..trailer_at + 4].copy_from_slice(&trailer_crc.to_le_bytes());
}

/// A field to overwrite: `(region, index, field)` pick it, `value` is written little-endian in its width.
#[derive(Debug, Clone)]
struct Damage {
    region: u8,
    index: usize,
    field: usize,
    value: u64,
}

fn interesting_value() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        0u64..64,
        Just(u32::MAX as u64),
        Just(u64::MAX),
        Just(1 << 24),
        Just((1 << 24) + 1),
        Just(1 << 30),
        (1u64 << 20)..(1u64 << 32),
    ]
}

fn damage() -> impl Strategy<Value = Damage> {
    (0u8..5, 0usize..8, 0usize..8, interesting_value()).prop_map(|(region, index, field, value)| Damage {
        region,
        index,
        field,
        value,
    })
}

/// Overwrites the chosen field; returns false when the pick does not exist (too few records, say).
fn apply(bytes: &mut [u8], layout: &PackLayout, damage: &Damage) -> bool {
    let trailer_at = bytes.len() - TRAILER_LEN;
    let value = damage.value.to_le_bytes();
    let mut write = |at: usize, width: usize| {
        bytes[at..at + width].copy_from_slice(&value[..width]);
    };
    match damage.region {
        // Header: pack_id (16 bytes: first half), created_at_ns.
        0 => write(if damage.field.is_multiple_of(2) { 12 } else { 28 }, 8),
        // Trailer: footer_offset, footer_len, record_count.
        1 => write(trailer_at + [8, 16, 24][damage.field % 3], 8),
        // Footer: entry count, or one entry's length prefix / offsets / lengths / meta_len.
        2 => {
            if damage.field == 0 {
                write(layout.footer_offset + 4, 8);
            } else {
                let Some(&start) = layout.entry_starts.get(damage.index % layout.entry_starts.len().max(1)) else {
                    return false;
                };
                let (offset, width) = [(0, 4), (4, 8), (12, 8), (20, 8), (28, 8), (40, 4)][damage.field % 6];
                write(start + offset, width);
            }
        }
        // A record header: meta_len or payload_len.
        3 => {
            let Some(entry) = layout.entries.get(damage.index % layout.entries.len().max(1)) else { return false };
            write(entry.record_offset as usize + [4, 8][damage.field % 2], 4);
        }
        // A metadata block in a record: the stream's length, or the label count.
        _ => {
            let Some(entry) = layout.entries.get(damage.index % layout.entries.len().max(1)) else { return false };
            let meta_at = entry.record_offset as usize + 16;
            write(meta_at + 24, 4);
        }
    }
    true
}

fn captures() -> Vec<(CaptureMeta, Vec<u8>)> {
    (0..4u8)
        .map(|index| {
            let meta = CaptureMeta {
                capture_id: Uuid::from_u128(index as u128 + 1),
                stream: format!("fuzz/{index}"),
                captured_at_ns: 1_000 + index as u64,
                labels: [("k".to_string(), "v".repeat(index as usize)), ("z".to_string(), String::new())].into(),
                content_type: (index % 2 == 0).then(|| "application/x-test".to_string()),
                source_name: None,
            };
            (meta, vec![index; 100 * index as usize])
        })
        .collect()
}

fn valid_pack() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.sealed");
    common::packs::write_pack(&path, Uuid::from_u128(0xfeed), 5, captures());
    std::fs::read(&path).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn damaged_but_checksummed_packs_are_refused_cleanly_within_bounded_memory(damages in proptest::collection::vec(damage(), 1..4)) {
        let original = valid_pack();
        let layout = layout_of(&original);
        let mut bytes = original.clone();
        let mut applied = false;
        for damage in &damages {
            applied |= apply(&mut bytes, &layout, damage);
        }
        prop_assume!(applied);
        reseal(&mut bytes, &layout);
        // Each reader may allocate a few times the pack it reads, never what a forged length claims.
        let bound = 4 * bytes.len() + (64 << 10);

        let (decoded, largest) = measuring(|| decode_pack(&bytes));
        prop_assert!(largest <= bound, "decode_pack allocated {largest} bytes for a {}-byte pack", bytes.len());
        match &decoded {
            Ok((_, _, entries)) => {
                for entry in entries {
                    let range = entry.record_offset as usize..(entry.record_offset + entry.record_len) as usize;
                    let (read, largest) = measuring(|| decode_record(&bytes[range.clone()], entry));
                    prop_assert!(largest <= bound, "decode_record allocated {largest}");
                    if let Err(error) = read {
                        prop_assert!(!error.to_string().is_empty());
                    }
                }
            }
            Err(error) => prop_assert!(!error.to_string().is_empty()),
        }

        let (scanned, largest) = measuring(|| scan_bytes(&bytes));
        prop_assert!(largest <= bound, "scan_bytes allocated {largest} bytes for a {}-byte pack", bytes.len());
        if let Err(error) = scanned {
            prop_assert!(!error.to_string().is_empty());
        }

        // The footer decoder on its own, trusting a trailer that agrees with the damaged footer.
        let trailer_at = bytes.len() - TRAILER_LEN;
        if let Ok(trailer) = decode_trailer(&bytes[trailer_at..]) {
            let footer_range = trailer.footer_offset as usize..(trailer.footer_offset + trailer.footer_len) as usize;
            if footer_range.end <= trailer_at && footer_range.start <= footer_range.end {
                let (footer, largest) = measuring(|| decode_footer(&bytes[footer_range.clone()], &trailer));
                prop_assert!(largest <= bound, "decode_footer allocated {largest}");
                if let Err(error) = footer {
                    prop_assert!(!error.to_string().is_empty());
                }
            }
        }
    }
}

#[test]
fn the_fuzzer_reaches_the_structural_checks() {
    // A forged record count, checksums re-sealed: refused by the structure, not by a CRC.
    let original = valid_pack();
    let layout = layout_of(&original);
    let mut bytes = original.clone();
    assert!(apply(&mut bytes, &layout, &Damage { region: 1, index: 0, field: 2, value: 1 << 24 }));
    reseal(&mut bytes, &layout);
    let error = decode_pack(&bytes).unwrap_err().to_string();
    assert!(!error.contains("checksum"), "{error}");
    assert!(error.contains("entries") || error.contains("record"), "{error}");
    // And the unchanged pack still reads after a reseal.
    let mut untouched = original.clone();
    reseal(&mut untouched, &layout);
    assert_eq!(untouched, original);
}
