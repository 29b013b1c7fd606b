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

/// A sealed pack of `captures` (id, payload) in `stream` at `captured_at_ns`, left in the spool at `paths` as a spool
/// leaves one while the catalog or the bucket is away: the daemon started on the spool uploads and publishes it.
pub fn seal_into_spool(
    paths: &capstore::spool::SpoolPaths,
    stream: &str,
    captured_at_ns: u64,
    captures: &[(Uuid, &[u8])],
) -> PackSummary {
    let captures = captures
        .iter()
        .map(|(capture_id, payload)| {
            let meta = CaptureMeta {
                capture_id: *capture_id,
                stream: stream.into(),
                captured_at_ns,
                labels: Default::default(),
                content_type: None,
                source_name: None,
            };
            (meta, payload.to_vec())
        })
        .collect();
    std::fs::create_dir_all(&paths.packs).unwrap();
    let pack_id = Uuid::now_v7();
    let path = paths.pack_path(pack_id, capstore::spool::PackState::Sealed);
    write_pack(&path, pack_id, capstore::util::now_ns(), captures).summary
}
