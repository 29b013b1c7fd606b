//! A failed fsync of the open pack. Linux reports a failed writeback to one fsync and may go on showing the lost
//! bytes from its cache, so after one the spool appends nothing more to that pack: it is cut to what the fsyncs before
//! made durable (every acknowledged record of it) and sealed as it is, and appends go on in a new pack.
//!
//! No device on these machines fails an fsync for real (no device-mapper), so the failpoint `fsync_fails` makes one
//! fsync answer EIO. This binary holds one test: the failpoint is armed for the whole process.

use std::collections::BTreeMap;
use std::time::Duration;

use capstore::config::SpoolConfig;
use capstore::pack::{CaptureMeta, PackFile};
use capstore::spool::writer::{spawn_writer, WriterSettings};
use capstore::spool::{list_packs, PackState, Spool};
use uuid::Uuid;

fn capture(at: u8) -> (CaptureMeta, Vec<u8>) {
    let meta = CaptureMeta {
        capture_id: Uuid::now_v7(),
        stream: "fsync/fails".into(),
        captured_at_ns: 1_700_000_000_000_000_000 + u64::from(at),
        labels: BTreeMap::new(),
        content_type: None,
        source_name: None,
    };
    (meta, vec![at; 3000])
}

#[tokio::test]
async fn after_a_failed_fsync_the_pack_is_cut_to_its_acknowledged_records_and_appends_go_on_in_a_new_pack() {
    // The third fsync of the run fails: that of the third append, each append being a batch of its own.
    std::env::set_var(capstore::failpoint::ENV, "fsync_fails@3");
    let dir = tempfile::tempdir().unwrap();
    let config = SpoolConfig { dir: dir.path().join("spool"), ..Default::default() };
    let (spool, _) = Spool::open(&config).unwrap();
    let settings = WriterSettings {
        pack_max_bytes: 64 << 20,
        pack_max_records: 100_000,
        pack_max_age: Duration::from_secs(3600),
        max_capture_bytes: 1 << 20,
        max_bytes: 0,
        min_free_bytes: 0,
    };
    let (writer, thread) = spawn_writer(spool.paths().clone(), settings, spool.index());

    let mut acked = BTreeMap::new();
    let mut pack_of = BTreeMap::new();
    let mut refused = Vec::new();
    for at in 0..5 {
        let (meta, payload) = capture(at);
        match writer.append(meta.clone(), payload.clone()).await {
            Ok(ack) => {
                pack_of.insert(at, ack.pack_id);
                acked.insert(ack.capture_id, (meta, payload));
            }
            Err(_) => refused.push(meta.capture_id),
        }
    }
    assert_eq!(refused.len(), 1, "the append whose fsync failed is refused, and only it");
    let (first, second) = (pack_of[&0], pack_of[&3]);
    assert_eq!(pack_of[&1], first);
    assert_ne!(second, first, "after the failed fsync appends go on in a new pack");
    assert_eq!(pack_of[&4], second);

    writer.close();
    tokio::task::spawn_blocking(move || thread.join()).await.unwrap();
    let packs = list_packs(spool.paths()).unwrap();
    assert!(packs.iter().all(|pack| pack.state == PackState::Sealed), "{packs:?}");
    let mut found = BTreeMap::new();
    for pack_id in [first, second] {
        let pack = PackFile::open(&spool.paths().pack_path(pack_id, PackState::Sealed)).unwrap();
        pack.verify().unwrap();
        assert_eq!(pack.entries().len(), 2, "pack {pack_id}: its acknowledged records and nothing else");
        for at in 0..pack.entries().len() {
            let (meta, payload) = pack.read_capture(at).unwrap();
            found.insert(meta.capture_id, (meta, payload));
        }
    }
    assert_eq!(found, acked, "every acknowledged capture, byte for byte, and not the refused one");
    assert!(!found.contains_key(&refused[0]));
}
