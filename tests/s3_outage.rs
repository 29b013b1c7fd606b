//! The S3 harness can simulate an outage: stop, fail fast, restart on the same ports and data.
//! Its own test binary, so stopping the shared server cannot disturb other tests.

mod common;

use std::time::Duration;

use object_store::{path::Path, ClientOptions, ObjectStore, PutPayload, RetryConfig};

#[tokio::test]
async fn objects_survive_a_stop_and_start_and_requests_fail_during_the_outage() {
    let s3 = common::s3::shared_s3();
    let store = s3
        .builder()
        .with_retry(RetryConfig { max_retries: 0, ..Default::default() })
        .with_client_options(
            ClientOptions::new()
                // Client options replace the builder's, so allow_http is set again here.
                .with_allow_http(true)
                .with_timeout(Duration::from_secs(2)),
        )
        .build()
        .unwrap();
    let key = Path::from("outage/before");
    store.put(&key, PutPayload::from_static(b"before the outage")).await.unwrap();

    s3.stop();
    assert!(!s3.is_running());
    let during = store.put(&Path::from("outage/during"), PutPayload::from_static(b"x")).await;
    assert!(during.is_err(), "a put succeeded while S3 was stopped");

    s3.start();
    assert!(s3.is_running());
    let read = store.get(&key).await.unwrap().bytes().await.unwrap();
    assert_eq!(&read[..], b"before the outage");
}
