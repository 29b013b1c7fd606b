//! Writing test packs with the real pack writer.

use std::path::Path;

use capstore::capture::CaptureMeta;
use capstore::pack::{IndexEntry, PackSummary, PackWriter};
use uuid::Uuid;

/// A pack written by [`write_pack`], with what went into it.
pub struct WrittenPack {
    pub summary: PackSummary,
    pub entries: Vec<IndexEntry>,
    pub captures: Vec<(CaptureMeta, Vec<u8>)>,
}

/// Writes `captures` into a new sealed pack at `path` (footer, trailer, fsync) and returns what it holds.
pub fn write_pack(
    path: &Path,
    pack_id: Uuid,
    created_at_ns: u64,
    captures: Vec<(CaptureMeta, Vec<u8>)>,
) -> WrittenPack {
    let mut writer = PackWriter::create(path, pack_id, created_at_ns).unwrap();
    for (meta, payload) in &captures {
        writer.append(meta, bytes::Bytes::copy_from_slice(payload)).unwrap();
    }
    let entries = writer.entries().to_vec();
    let summary = writer.finish().unwrap();
    WrittenPack { summary, entries, captures }
}
