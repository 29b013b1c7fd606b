//! Disk-full faults of the spool on a real small filesystem ([`common::small_fs`]): a seal that the full disk refuses
//! leaves the pack `.open`, and the spool's sealer seals it, whole, once space returns, without a restart; a start on
//! the full disk leaves such a pack to the sealer instead of failing.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use capstore::config::SpoolConfig;
use capstore::pack::{CaptureMeta, PackFile};
use capstore::spool::writer::{spawn_writer, SpoolWriter, WriterSettings, WriterThread};
use capstore::spool::{list_packs, PackState, Spool};
use common::small_fs::{Filler, SmallFilesystem};
use uuid::Uuid;

/// Captures in the pack whose seal fails: with their labels, its footer needs pages the full disk does not have.
const CAPTURES: usize = 40;

type Acked = BTreeMap<Uuid, (CaptureMeta, Vec<u8>)>;

fn capture(at: usize) -> (CaptureMeta, Vec<u8>) {
    let meta = CaptureMeta {
        capture_id: Uuid::now_v7(),
        stream: "disk/full".into(),
        captured_at_ns: 1_700_000_000_000_000_000 + at as u64,
        labels: BTreeMap::from([("note".to_string(), format!("{at:0>200}"))]),
        content_type: None,
        source_name: None,
    };
    let payload = (0..1000).map(|i| (i * 7 + at) as u8).collect();
    (meta, payload)
}

fn packs_in(spool: &Spool, state: PackState) -> Vec<Uuid> {
    let packs = list_packs(spool.paths()).unwrap();
    packs.into_iter().filter(|pack| pack.state == state).map(|pack| pack.pack_id).collect()
}

fn open_spool(filesystem: &SmallFilesystem) -> Spool {
    let config = SpoolConfig {
        dir: filesystem.path().join("spool"),
        min_free_bytes: capstore::config::ByteSize(0),
        ..Default::default()
    };
    Spool::open(&config).expect("a spool opens, full disk or not").0
}

fn start_writer(spool: &Spool) -> (SpoolWriter, WriterThread) {
    let settings = WriterSettings {
        pack_max_bytes: 64 << 20,
        pack_max_records: 100_000,
        pack_max_age: Duration::from_secs(3600),
        max_capture_bytes: 1 << 20,
        max_bytes: 0,
        min_free_bytes: 0,
    };
    spawn_writer(spool.paths().clone(), settings, spool.index())
}

/// [`CAPTURES`] acknowledged captures in one open pack (the first one ingested from the inbox file of
/// `source_name`, if given), then the disk filled and the pack's seal refused.
async fn a_seal_refused(
    filesystem: &SmallFilesystem,
    spool: &Spool,
    writer: &SpoolWriter,
    source_name: Option<String>,
) -> (Uuid, Acked, Filler) {
    let mut acked = BTreeMap::new();
    for at in 0..CAPTURES {
        let (mut meta, payload) = capture(at);
        if at == 0 {
            meta.source_name = source_name.clone();
        }
        let ack = writer.append(meta.clone(), payload.clone()).await.expect("appended before the disk is full");
        acked.insert(ack.capture_id, (meta, payload));
    }
    let [pack_id] = packs_in(spool, PackState::Open)[..] else { panic!("one open pack expected") };
    let filler = filesystem.fill();
    let refused = writer.seal().await;
    assert!(refused.is_err(), "the seal must fail on a full disk (filler of {} bytes): {refused:?}", filler.bytes);
    assert_eq!(writer.stats().seals_failed.load(Ordering::Relaxed), 1);
    assert_eq!(packs_in(spool, PackState::Open), vec![pack_id], "the pack whose seal failed stays open");
    assert!(packs_in(spool, PackState::Sealed).is_empty());
    // The uploader takes no sealed pack newer than this one from here on (see `oldest_left_open`).
    assert_eq!(spool.index().oldest_left_open(), Some(pack_id));
    (pack_id, acked, filler)
}

/// Once space is back: the pack is sealed by `writer`'s sealer, whole (every acknowledged capture, with its metadata
/// and bytes, and nothing else).
fn sealed_once_space_returns(spool: &Spool, writer: &SpoolWriter, pack_id: Uuid, acked: &Acked, filler: Filler) {
    filler.remove();
    let started = Instant::now();
    // (Counted once the pack is renamed and the index knows it.)
    while writer.stats().packs_sealed.load(Ordering::Relaxed) == 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "the pack was never sealed once space returned");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(packs_in(spool, PackState::Sealed), vec![pack_id]);
    assert!(packs_in(spool, PackState::Open).is_empty());
    assert_eq!(spool.index().oldest_left_open(), None, "the index knows the pack is sealed");
    assert_eq!(writer.stats().packs_left_open.load(Ordering::Relaxed), 0);
    let pack = PackFile::open(&spool.paths().pack_path(pack_id, PackState::Sealed)).unwrap();
    pack.verify().unwrap();
    assert_eq!(pack.entries().len(), acked.len());
    for at in 0..pack.entries().len() {
        let (meta, payload) = pack.read_capture(at).unwrap();
        let (acked_meta, acked_payload) = &acked[&meta.capture_id];
        assert_eq!(&meta, acked_meta);
        assert_eq!(&payload, acked_payload);
    }
}

async fn close(writer: SpoolWriter, thread: WriterThread) {
    writer.close();
    tokio::task::spawn_blocking(move || thread.join()).await.unwrap();
}

#[tokio::test]
async fn a_seal_refused_by_a_full_disk_is_done_once_space_returns_without_a_restart() {
    let filesystem = SmallFilesystem::mount(8);
    let spool = open_spool(&filesystem);
    let (writer, thread) = start_writer(&spool);
    let (pack_id, acked, filler) = a_seal_refused(&filesystem, &spool, &writer, None).await;
    assert_eq!(writer.stats().packs_left_open.load(Ordering::Relaxed), 1);
    sealed_once_space_returns(&spool, &writer, pack_id, &acked, filler);

    // The writer goes on in a new pack.
    let (meta, payload) = capture(CAPTURES);
    let ack = writer.append(meta, payload).await.unwrap();
    assert_ne!(ack.pack_id, pack_id);
    close(writer, thread).await;
    assert_eq!(packs_in(&spool, PackState::Sealed).len(), 2);
}

#[tokio::test]
async fn a_start_on_a_full_disk_leaves_the_pack_to_the_sealer_which_seals_it_once_space_returns() {
    let filesystem = SmallFilesystem::mount(8);
    let spool = open_spool(&filesystem);
    // The first capture came from an inbox file whose removal was lost (a crash between append and unlink).
    let inbox_file = spool.paths().inbox.join("disk/full/reading.bin");
    std::fs::create_dir_all(inbox_file.parent().unwrap()).unwrap();
    std::fs::write(&inbox_file, b"reading").unwrap();
    let stat = std::fs::metadata(&inbox_file).unwrap();
    let mtime_ns = i128::from(stat.mtime()) * 1_000_000_000 + i128::from(stat.mtime_nsec());
    let source_key = format!("disk/full/reading.bin@{}:{}:{mtime_ns}", stat.ino(), stat.len());
    let (writer, thread) = start_writer(&spool);
    let (pack_id, acked, filler) = a_seal_refused(&filesystem, &spool, &writer, Some(source_key)).await;
    // Stopped while the disk is still full: the close's last try fails too, and the pack stays open.
    close(writer, thread).await;
    drop(spool);
    assert!(filesystem.path().join("spool/packs").join(format!("{pack_id}.open")).exists());

    // A start on the full disk: recovery cannot seal the pack, and leaves it to the new writer's sealer.
    let spool = open_spool(&filesystem);
    assert_eq!(spool.index().left_open_packs(), vec![pack_id]);
    assert!(!inbox_file.exists(), "the inbox file its record came from is captured once, not ingested again");
    let (writer, thread) = start_writer(&spool);
    assert_eq!(writer.stats().packs_left_open.load(Ordering::Relaxed), 1);
    sealed_once_space_returns(&spool, &writer, pack_id, &acked, filler);
    close(writer, thread).await;
}
