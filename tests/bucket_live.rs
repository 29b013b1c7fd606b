//! Bucket conformance: one suite run against `memory://`, `file://` and a real S3 server (SeaweedFS), plus an S3
//! outage test. Every behaviour of `capstore::bucket` that the uploader and readers rely on is checked on each backend.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use capstore::bucket::{Bucket, BucketErrorKind, DayRange};
use capstore::capture::CaptureMeta;
use capstore::config::{ByteSize, Config, Secret};
use capstore::retry::RetryPolicy;
use common::packs::WrittenPack;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use rand::RngCore;
use uuid::Uuid;

const MIB: u64 = 1024 * 1024;
const PART_SIZE: u64 = 5 * MIB;
/// 2023-11-14T22:13:20Z: every capture of the suite is on that UTC day.
const FIRST_CAPTURED_AT_NS: u64 = 1_700_000_000_000_000_000;

/// The S3 tests share one server and the outage test stops it: they take turns.
static S3_EXCLUSIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn capture(index: u64, payload: Vec<u8>) -> (CaptureMeta, Vec<u8>) {
    let mut labels = BTreeMap::new();
    labels.insert("site".to_string(), "edge-7".to_string());
    labels.insert("index".to_string(), index.to_string());
    let meta = CaptureMeta {
        capture_id: Uuid::now_v7(),
        stream: format!("cam/{}", index % 3),
        captured_at_ns: FIRST_CAPTURED_AT_NS + index * 1_000_000,
        labels,
        content_type: index.is_multiple_of(2).then(|| "application/octet-stream".to_string()),
        source_name: None,
    };
    (meta, payload)
}

fn write_pack(path: &Path, pack_id: Uuid, captures: Vec<(CaptureMeta, Vec<u8>)>) -> WrittenPack {
    common::packs::write_pack(path, pack_id, FIRST_CAPTURED_AT_NS + 10_000_000_000, captures)
}

fn small_captures() -> Vec<(CaptureMeta, Vec<u8>)> {
    (0..6u64)
        .map(|index| capture(index, format!("payload {index} ").repeat(1 + index as usize * 50).into_bytes()))
        .collect()
}

fn random_bytes(len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    rand::rng().fill_bytes(&mut bytes);
    bytes
}

fn base_config(catalog_name: &str) -> Config {
    let mut config = Config { catalog_name: catalog_name.to_string(), ..Default::default() };
    config.upload.part_size = ByteSize(PART_SIZE);
    config
}

fn s3_config(server: &common::s3::S3Server, catalog_name: &str) -> Config {
    let mut config = base_config(catalog_name);
    config.bucket.url = format!("s3://{}", server.bucket);
    config.bucket.endpoint = Some(server.endpoint());
    config.bucket.region = Some("us-east-1".into());
    config.bucket.allow_http = true;
    config.bucket.virtual_hosted_style = false;
    config.bucket.access_key_id = Some(server.access_key.clone());
    config.bucket.secret_access_key = Some(Secret::new(server.secret_key.clone()));
    config
}

fn unique_catalog_name(kind: &str) -> String {
    format!("{kind}-{}", Uuid::new_v4().simple())
}

async fn assert_reads_back(bucket: &Bucket, key: &str, pack: &WrittenPack) {
    let remote = bucket.read_pack_index(key).await.unwrap();
    assert_eq!(remote.key, key);
    assert_eq!(remote.size, pack.summary.bytes);
    assert_eq!(hex::encode(remote.trailer.sha256), pack.summary.sha256_hex);
    assert_eq!(remote.entries, pack.entries);
    for (entry, (meta, payload)) in remote.entries.iter().zip(&pack.captures) {
        let (read_meta, read_payload) = bucket.read_capture(key, entry).await.unwrap();
        assert_eq!(&read_meta, meta);
        assert!(read_payload == *payload, "payload of {} differs", meta.capture_id);
    }
}

/// The suite every backend must pass.
async fn conformance(bucket: &Bucket, scratch: &Path) {
    let prefix = bucket.catalog_prefix().to_string();
    let pack_id = Uuid::now_v7();

    // A small pack: one conditional put.
    let small = write_pack(&scratch.join("small.sealed"), pack_id, small_captures());
    let expected_key = format!("{prefix}/2023/11/14/{pack_id}.cpk");
    assert_eq!(bucket.pack_key(&small.summary).to_string(), expected_key);
    let outcome = bucket.upload_pack(&scratch.join("small.sealed"), &small.summary).await.unwrap();
    assert_eq!(outcome.key, expected_key);
    assert!(!outcome.already_present);
    assert_eq!(bucket.object_size(&outcome.key).await.unwrap(), small.summary.bytes);
    let metadata = bucket.object_metadata(&outcome.key).await.unwrap();
    if bucket.supports_metadata() {
        let names = bucket.metadata_names();
        assert_eq!(metadata.get(names.sha256), Some(&small.summary.sha256_hex), "{metadata:?}");
        assert_eq!(metadata.get(names.records), Some(&"6".to_string()), "{metadata:?}");
    } else {
        assert!(metadata.is_empty(), "{metadata:?}");
    }
    assert_reads_back(bucket, &outcome.key, &small).await;

    // A retried upload of the same pack finds it there.
    let again = bucket.upload_pack(&scratch.join("small.sealed"), &small.summary).await.unwrap();
    assert_eq!(again.key, expected_key);
    assert!(again.already_present);

    // The same pack_id and capture day with other bytes: same key, a conflict, whether the size differs or not.
    let mut same_size_captures = small.captures.clone();
    same_size_captures[3].1[0] ^= 0xff;
    let same_size = write_pack(&scratch.join("same-size.sealed"), pack_id, same_size_captures);
    assert_eq!(same_size.summary.bytes, small.summary.bytes);
    assert_eq!(bucket.pack_key(&same_size.summary).to_string(), expected_key);
    let error = bucket.upload_pack(&scratch.join("same-size.sealed"), &same_size.summary).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::Conflict, "{error}");
    let mut longer_captures = small.captures.clone();
    longer_captures[0].1.extend_from_slice(b"more");
    let longer = write_pack(&scratch.join("longer.sealed"), pack_id, longer_captures);
    let error = bucket.upload_pack(&scratch.join("longer.sealed"), &longer.summary).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::Conflict, "{error}");
    // The conflicts left the original untouched.
    assert_reads_back(bucket, &expected_key, &small).await;

    // A pack larger than part_size goes multipart and reads back identical.
    let large_id = Uuid::now_v7();
    let large_captures: Vec<_> = (0..3u64).map(|index| capture(index, random_bytes(4 * MIB as usize))).collect();
    let large = write_pack(&scratch.join("large.sealed"), large_id, large_captures);
    assert!(large.summary.bytes > 2 * PART_SIZE, "{} bytes", large.summary.bytes);
    let large_outcome = bucket.upload_pack(&scratch.join("large.sealed"), &large.summary).await.unwrap();
    assert!(!large_outcome.already_present);
    if bucket.scheme() == "s3" {
        // S3 gives a multipart object an ETag ending in "-<part count>": proof the parts path ran.
        let meta = bucket.store().head(&ObjectPath::from(large_outcome.key.as_str())).await.unwrap();
        let e_tag = meta.e_tag.unwrap_or_default();
        assert!(e_tag.trim_matches('"').ends_with("-3"), "e_tag {e_tag:?}");
    }
    if bucket.scheme() == "az" {
        // Azure commits a block upload as a list of blocks: one per part.
        let blocks = common::azurite::shared_azurite().committed_blocks(&large_outcome.key);
        assert_eq!(blocks, 3, "committed blocks of {}", large_outcome.key);
    }
    assert_eq!(bucket.object_size(&large_outcome.key).await.unwrap(), large.summary.bytes);
    if bucket.supports_metadata() {
        let metadata = bucket.object_metadata(&large_outcome.key).await.unwrap();
        assert_eq!(metadata.get(bucket.metadata_names().sha256), Some(&large.summary.sha256_hex), "{metadata:?}");
    }
    assert_reads_back(bucket, &large_outcome.key, &large).await;
    let large_again = bucket.upload_pack(&scratch.join("large.sealed"), &large.summary).await.unwrap();
    assert!(large_again.already_present);
    let mut large_conflict_captures = large.captures.clone();
    large_conflict_captures[2].1[7] ^= 0x01;
    let large_conflict = write_pack(&scratch.join("large-conflict.sealed"), large_id, large_conflict_captures);
    let error = bucket.upload_pack(&scratch.join("large-conflict.sealed"), &large_conflict.summary).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::Conflict, "{error}");

    // Objects under the prefix that are not packs: too small, and pack-sized garbage.
    let tiny_key = ObjectPath::from(format!("{prefix}/stray/tiny.cpk"));
    bucket.store().put(&tiny_key, b"not a pack".to_vec().into()).await.unwrap();
    let error = bucket.read_pack_index(tiny_key.as_ref()).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::InvalidPack, "{error}");
    let garbage_key = ObjectPath::from(format!("{prefix}/stray/garbage.cpk"));
    bucket.store().put(&garbage_key, random_bytes(4096).into()).await.unwrap();
    let error = bucket.read_pack_index(garbage_key.as_ref()).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::InvalidPack, "{error}");
    assert!(error.message.contains("trailer"), "{error}");

    let missing = format!("{prefix}/2023/11/14/{}.cpk", Uuid::now_v7());
    let error = bucket.read_pack_index(&missing).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::NotFound, "{error}");

    // Listing shows every object under the catalog prefix with its size, and nothing else.
    let mut listed: Vec<_> = bucket.list_objects(None).try_collect().await.unwrap();
    listed.sort();
    let mut expected = vec![
        (expected_key.clone(), small.summary.bytes),
        (large_outcome.key.clone(), large.summary.bytes),
        (tiny_key.to_string(), 10),
        (garbage_key.to_string(), 4096),
    ];
    expected.sort();
    assert_eq!(listed, expected);
    // A window of UTC days lists only the prefixes of those days.
    let day_ns = 1_700_000_000 * 1_000_000_000; // 2023-11-14T22:13:20Z
    let mut in_window: Vec<_> =
        bucket.list_objects(Some(DayRange::covering(day_ns, day_ns))).try_collect().await.unwrap();
    in_window.sort();
    let expected_in_window: Vec<_> = expected.iter().filter(|(key, _)| key.contains("/2023/11/14/")).cloned().collect();
    assert!(!expected_in_window.is_empty() && expected_in_window.len() < expected.len(), "{expected:?}");
    assert_eq!(in_window, expected_in_window);
    let next_day: Vec<_> = bucket
        .list_objects(Some(DayRange::covering(day_ns + 86_400 * 1_000_000_000, day_ns + 86_400 * 1_000_000_000)))
        .try_collect()
        .await
        .unwrap();
    assert!(next_day.iter().all(|(key, _)| key.contains("/2023/11/15/")), "{next_day:?}");
}

#[tokio::test]
async fn conformance_memory() {
    let scratch = tempfile::tempdir().unwrap();
    let mut config = base_config(&unique_catalog_name("memory"));
    config.bucket.url = "memory://".into();
    config.validate().unwrap();
    let bucket = Bucket::from_config(&config).unwrap();
    assert!(bucket.supports_metadata());
    conformance(&bucket, scratch.path()).await;
}

#[tokio::test]
async fn conformance_file() {
    let scratch = tempfile::tempdir().unwrap();
    let root = scratch.path().join("bucket");
    let mut config = base_config(&unique_catalog_name("file"));
    config.bucket.url = format!("file://{}", root.display());
    config.validate().unwrap();
    let bucket = Bucket::from_config(&config).unwrap();
    assert!(!bucket.supports_metadata());
    conformance(&bucket, scratch.path()).await;
    // No staging files or other leftovers beside the objects.
    let mut stack = vec![root];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                assert!(!path.to_string_lossy().contains('#'), "staging file left: {}", path.display());
            }
        }
    }
}

#[tokio::test]
async fn conformance_s3() {
    let server = common::s3::shared_s3();
    let _exclusive = S3_EXCLUSIVE.lock().await;
    server.start();
    let scratch = tempfile::tempdir().unwrap();
    let config = s3_config(server, &unique_catalog_name("s3"));
    config.validate().unwrap();
    let bucket = Bucket::from_config(&config).unwrap();
    assert!(bucket.supports_metadata());
    conformance(&bucket, scratch.path()).await;
}

fn azure_config(server: &common::azurite::AzuriteServer, catalog_name: &str) -> Config {
    let mut config = base_config(catalog_name);
    config.bucket.url = format!("az://{}", server.container);
    config.bucket.endpoint = Some(server.endpoint());
    config.bucket.allow_http = true;
    config.bucket.options.insert("account_name".into(), common::azurite::ACCOUNT.into());
    config.bucket.options.insert("access_key".into(), common::azurite::ACCOUNT_KEY.into());
    config
}

#[tokio::test]
async fn conformance_azure() {
    let server = common::azurite::shared_azurite();
    let scratch = tempfile::tempdir().unwrap();
    let config = azure_config(server, &unique_catalog_name("azure"));
    config.validate().unwrap();
    let bucket = Bucket::from_config(&config).unwrap();
    assert_eq!(bucket.scheme(), "az");
    assert!(bucket.supports_metadata());
    conformance(&bucket, scratch.path()).await;
    // A delete of a blob that is not there: Azure answers NotFound where S3 answers OK; the probe that
    // `check-config --online` runs deletes through the same path and treats both as deleted.
    let missing = ObjectPath::from(format!("{}/never-written", bucket.catalog_prefix()));
    let error = bucket.store().delete(&missing).await.unwrap_err();
    assert!(matches!(error, object_store::Error::NotFound { .. }), "{error}");
    let probe_key = bucket.probe_conditional_create().await.unwrap();
    assert!(bucket.store().head(&ObjectPath::from(probe_key.as_str())).await.is_err(), "probe left behind");
}

/// `gs://` against fake-gcs-server: reads only (the emulator refuses object_store's uploads, see the harness). A pack
/// seeded through the emulator's own API is listed, its index read and verified, and every capture read back
/// identical; an upload fails with an error naming the object.
#[tokio::test]
async fn gcs_reads_of_a_seeded_pack_work_and_uploads_are_refused_by_the_emulator() {
    let server = common::gcs::shared_gcs();
    let scratch = tempfile::tempdir().unwrap();
    let mut config = base_config(&unique_catalog_name("gcs"));
    config.bucket.url = format!("gs://{}/reads", server.bucket);
    config.bucket.allow_http = true;
    config.bucket.options.insert("service_account_key".into(), server.service_account_key());
    config.validate().unwrap();
    let bucket = Bucket::from_config(&config).unwrap();
    assert_eq!(bucket.scheme(), "gs");
    let pack_id = Uuid::now_v7();
    let pack = write_pack(&scratch.path().join("seeded.sealed"), pack_id, small_captures());
    let key = bucket.pack_key(&pack.summary).to_string();
    assert!(key.starts_with(&format!("reads/capstore/{}/2023/11/14/", config.catalog_name)), "{key}");
    server.seed(&key, std::fs::read(scratch.path().join("seeded.sealed")).unwrap());

    let listed: Vec<_> = bucket.list_objects(None).try_collect().await.unwrap();
    assert_eq!(listed, vec![(key.clone(), pack.summary.bytes)]);
    assert_reads_back(&bucket, &key, &pack).await;
    let remote = bucket.read_pack_index(&key).await.unwrap();
    bucket.verify_pack(&remote, pack_id).await.unwrap();
    let missing = format!("{}/2023/11/14/{}.cpk", bucket.catalog_prefix(), Uuid::now_v7());
    assert_eq!(bucket.read_pack_index(&missing).await.unwrap_err().kind, BucketErrorKind::NotFound);

    let other = write_pack(&scratch.path().join("upload.sealed"), Uuid::now_v7(), small_captures());
    let error = bucket.upload_pack(&scratch.path().join("upload.sealed"), &other.summary).await.unwrap_err();
    assert!(error.message.contains(&other.summary.pack_id.to_string()), "{error}");
}

#[tokio::test]
async fn s3_outage_is_transient_and_the_upload_succeeds_after_restart() {
    let server = common::s3::shared_s3();
    let _exclusive = S3_EXCLUSIVE.lock().await;
    server.start();
    let scratch = tempfile::tempdir().unwrap();
    let config = s3_config(server, &unique_catalog_name("outage"));
    let short_retries = RetryPolicy {
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(400),
        max_attempts: 4,
        max_elapsed: Duration::from_secs(3),
    };
    let bucket = Bucket::from_config(&config).unwrap().with_retry_policy(short_retries);
    let pack_path = scratch.path().join("pack.sealed");
    let pack = write_pack(&pack_path, Uuid::now_v7(), small_captures());

    server.stop();
    let started = Instant::now();
    let attempt = tokio::time::timeout(Duration::from_secs(30), bucket.upload_pack(&pack_path, &pack.summary)).await;
    let error = attempt.expect("an upload during an outage returns instead of hanging").unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::Transient, "{error}");
    assert!(error.is_transient());
    let reading =
        tokio::time::timeout(Duration::from_secs(30), bucket.list_objects(None).try_collect::<Vec<_>>()).await;
    assert_eq!(reading.expect("a listing during an outage returns").unwrap_err().kind, BucketErrorKind::Transient);
    let outage_elapsed = started.elapsed();

    server.start();
    let outcome = bucket.upload_pack(&pack_path, &pack.summary).await.unwrap();
    assert!(!outcome.already_present, "nothing was written during the outage");
    assert_reads_back(&bucket, &outcome.key, &pack).await;
    assert!(outage_elapsed < Duration::from_secs(30), "{outage_elapsed:?}");
}

#[tokio::test]
async fn a_pack_is_verified_whole_before_reconcile_trusts_it() {
    let scratch = tempfile::tempdir().unwrap();
    let mut config = base_config(&unique_catalog_name("verify"));
    config.bucket.url = "memory://".into();
    let bucket = Bucket::from_config(&config).unwrap();
    let pack_id = Uuid::now_v7();
    let pack_path = scratch.path().join("pack.sealed");
    let pack = write_pack(&pack_path, pack_id, small_captures());
    let key = bucket.upload_pack(&pack_path, &pack.summary).await.unwrap().key;
    let remote = bucket.read_pack_index(&key).await.unwrap();
    bucket.verify_pack(&remote, pack_id).await.unwrap();

    // The same bytes under another pack's name: the header gives it away.
    let error = bucket.verify_pack(&remote, Uuid::now_v7()).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::InvalidPack, "{error}");
    assert!(error.message.contains("header"), "{error}");

    // One payload byte changed, the CRCs of the footer and trailer intact: only the SHA-256 notices.
    let mut bytes = std::fs::read(&pack_path).unwrap();
    bytes[pack.entries[3].payload_offset as usize] ^= 0x40;
    let tampered_key = object_store::path::Path::from(format!("{}/tampered.cpk", bucket.catalog_prefix()));
    bucket.store().put(&tampered_key, bytes.into()).await.unwrap();
    let tampered = bucket.read_pack_index(tampered_key.as_ref()).await.unwrap();
    let error = bucket.verify_pack(&tampered, pack_id).await.unwrap_err();
    assert_eq!(error.kind, BucketErrorKind::InvalidPack, "{error}");
    assert!(error.message.contains("SHA-256"), "{error}");
}
