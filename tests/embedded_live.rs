//! The daemon embedded in a producer's process (`daemon::run_in_process`) against a real ClickHouse and a file://
//! bucket: appends through the library are acknowledged, published, read back byte-identical, and a shutdown request
//! stops the daemon cleanly with the lease released.

mod common;

use std::time::{Duration, Instant};

use capstore::capture::CaptureMeta;
use capstore::catalog::query::CatalogReader;
use capstore::daemon::run_in_process;
use capstore::spool::writer::AppendError;
use common::daemon::{expected_payload, DaemonEnv};
use uuid::Uuid;

fn meta(capture_id: Uuid) -> CaptureMeta {
    CaptureMeta {
        capture_id,
        stream: "embedded".into(),
        captured_at_ns: capstore::util::now_ns(),
        labels: Default::default(),
        content_type: None,
        source_name: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_appends_are_published_and_read_back_and_shutdown_is_clean() {
    let dir = tempfile::tempdir().unwrap();
    let config = DaemonEnv::live("embedded", dir.path()).config();

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let (writer_tx, writer_rx) = tokio::sync::oneshot::channel();
    let daemon = tokio::spawn(run_in_process(config.clone(), shutdown_rx, writer_tx));
    let writer = tokio::time::timeout(Duration::from_secs(30), writer_rx).await.unwrap().unwrap();

    // Mixed sizes: copied into the pack writer's buffer, and written straight from the producer's buffer.
    let mut appended = Vec::new();
    for size in [0usize, 100, 40 * 1024, 3 * 1024 * 1024] {
        let capture_id = Uuid::now_v7();
        let payload = expected_payload(capture_id, size);
        let ack = writer.append(meta(capture_id), payload.clone()).await.unwrap();
        assert_eq!(ack.capture_id, capture_id);
        appended.push((capture_id, payload));
    }
    // The library gets the capture rules HTTP and the inbox apply: a stream segment starting with '.' is refused.
    let mut hidden_stream = meta(Uuid::now_v7());
    hidden_stream.stream = "embedded/.hidden".into();
    let refused = writer.append(hidden_stream, b"x".to_vec()).await.unwrap_err();
    assert!(matches!(&refused, AppendError::Invalid(problem) if problem.contains(".hidden")), "{refused}");

    let (client, tables) = capstore::catalog::connect(&config).await.unwrap();
    let catalog = CatalogReader::new(client, tables, &config.catalog_name);
    let bucket = std::sync::Arc::new(capstore::bucket::Bucket::from_config(&config).unwrap());
    // No spool path: every read must come from the bucket through the catalog.
    let reader = capstore::reader::Reader::new(catalog, bucket, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    for (capture_id, payload) in &appended {
        let read = loop {
            if let Some(read) = reader.get(*capture_id).await.unwrap() {
                break read;
            }
            assert!(Instant::now() < deadline, "capture {capture_id} was not published");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(&read.payload, payload, "capture {capture_id} read back different bytes");
        assert!(read.version.is_some());
    }

    shutdown_tx.send(true).unwrap();
    let exit_code = tokio::time::timeout(Duration::from_secs(30), daemon).await.unwrap().unwrap().unwrap();
    assert_eq!(exit_code, capstore::exit_code::CLEAN);
    let refused = writer.append(meta(Uuid::now_v7()), b"late".to_vec()).await.unwrap_err();
    assert!(matches!(refused, AppendError::Closed), "an append after shutdown must be refused, got {refused}");
}
