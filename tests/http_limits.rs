//! The HTTP API's limits against a real daemon: a client that trickles its headers or its body is cut off, open
//! connections are bounded, request bodies in memory are bounded (503 past the budget), reads are bounded, and a
//! `wait=published` waiter learns of its publish without polling the catalog.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::clickhouse::shared_server;
use common::daemon::{Daemon, DaemonEnv};
use common::proxy::FaultProxy;
use reqwest::StatusCode;

struct Running {
    _dir: tempfile::TempDir,
    daemon: Daemon,
    port: u16,
}

impl Running {
    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        // A bound on every read of the test, never an assertion about speed.
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        stream
    }
}

async fn start(extra: &[(&str, String)]) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port(false);
    let env = DaemonEnv::live("limits", dir.path()).set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"));
    let env = extra.iter().fold(env, |env, (key, value)| env.set(key, value.clone()));
    let mut daemon = env.start(dir.path().join("daemon.log"));
    daemon.wait_for_log_async("http serving", Duration::from_secs(30)).await;
    Running { _dir: dir, daemon, port }
}

/// What the server sends until it closes the connection: `Ok(bytes)` if it closed (or reset) it, `Err` if the
/// test's own read bound ran out first.
fn read_until_closed(stream: &mut TcpStream) -> Result<Vec<u8>, std::io::Error> {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return Ok(received),
            Ok(read) => received.extend_from_slice(&buffer[..read]),
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return Ok(received),
            Err(error) => return Err(error),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_and_open_connections_are_bounded() {
    let running =
        start(&[("CAPSTORE_HTTP_BODY_TIMEOUT", "1s".into()), ("CAPSTORE_HTTP_MAX_CONNECTIONS", "4".into())]).await;
    let port = running.port;

    // Headers that never end: the server closes the connection.
    let mut slow_headers = running.connect();
    slow_headers
        .write_all(format!("POST /v1/captures?stream=s HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n").as_bytes())
        .unwrap();
    let closed = tokio::task::spawn_blocking(move || read_until_closed(&mut slow_headers)).await.unwrap();
    assert!(closed.is_ok(), "a client trickling its headers was never cut off");

    // A body that never arrives whole: 408.
    let mut slow_body = running.connect();
    let head = format!("POST /v1/captures?stream=s HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 1000\r\n\r\n");
    slow_body.write_all(head.as_bytes()).unwrap();
    slow_body.write_all(&[1u8; 10]).unwrap();
    let answer = tokio::task::spawn_blocking(move || read_until_closed(&mut slow_body)).await.unwrap().unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("http.body_timeout"), "{answer}");

    // Four connections are open (each answered once and kept alive); a fifth is closed without an answer.
    let mut open = Vec::new();
    for _ in 0..4 {
        let mut stream = running.connect();
        stream.write_all(format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes()).unwrap();
        let mut first = [0u8; 12];
        stream.read_exact(&mut first).unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        open.push(stream);
    }
    let mut fifth = running.connect();
    let _ = fifth.write_all(format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes());
    let refused = tokio::task::spawn_blocking(move || read_until_closed(&mut fifth)).await.unwrap().unwrap();
    assert!(refused.is_empty(), "the fifth connection was served: {}", String::from_utf8_lossy(&refused));
    drop(open);
    // Once the others are gone, connections are served again.
    let client = reqwest::Client::new();
    let started = Instant::now();
    while client.get(running.url("/healthz")).send().await.map(|r| r.status()).ok() != Some(StatusCode::OK) {
        assert!(started.elapsed() < Duration::from_secs(20), "not served again:\n{}", running.daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_beyond_the_byte_budget_get_503_and_the_budget_comes_back() {
    let running = start(&[
        ("CAPSTORE_SPOOL_MAX_CAPTURE_BYTES", "64KiB".into()),
        ("CAPSTORE_HTTP_MAX_INFLIGHT_BYTES", "64KiB".into()),
        ("CAPSTORE_HTTP_BODY_TIMEOUT", "30s".into()),
    ])
    .await;
    let port = running.port;
    // A large body on its way holds the whole budget.
    let mut holding = running.connect();
    let head =
        format!("POST /v1/captures?stream=s HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 65536\r\n\r\n");
    holding.write_all(head.as_bytes()).unwrap();
    holding.write_all(&[2u8; 1000]).unwrap();
    let client = reqwest::Client::new();
    let started = Instant::now();
    let refused = loop {
        let response = client.post(running.url("/v1/captures?stream=s")).body("small").send().await.unwrap();
        // The large request may not have reached its handler yet: until it has, small posts pass.
        if response.status() == StatusCode::SERVICE_UNAVAILABLE {
            break response;
        }
        assert_eq!(response.status(), StatusCode::CREATED);
        assert!(started.elapsed() < Duration::from_secs(20), "the budget never ran out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: serde_json::Value = serde_json::from_slice(&refused.bytes().await.unwrap()).unwrap();
    assert!(body["error"].as_str().unwrap().contains("http.max_inflight_bytes"), "{body}");
    // The large body arrives: its capture is taken, and the budget returns.
    holding.write_all(&vec![2u8; 65536 - 1000]).unwrap();
    let mut answer = [0u8; 12];
    holding.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 201");
    let response = client.post(running.url("/v1/captures?stream=s")).body("small").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_waiters_do_not_poll_the_catalog_and_reads_are_bounded() {
    let proxy = FaultProxy::start(shared_server().http_addr);
    let running = start(&[
        ("CAPSTORE_CATALOG_URL", proxy.url()),
        // Long enough that a waiter polling every 100 ms would ask many times before the publish.
        ("CAPSTORE_SPOOL_PACK_MAX_AGE", "1500ms".into()),
        ("CAPSTORE_HTTP_MAX_CONCURRENT_READS", "1".into()),
    ])
    .await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    while client.get(running.url("/v1/captures?limit=1")).send().await.unwrap().status() != StatusCode::OK {
        assert!(started.elapsed() < Duration::from_secs(30), "the catalog never connected:\n{}", running.daemon.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let capture_id = uuid::Uuid::now_v7();
    // A read names the id as an SQL literal (quoted, or quoted and percent-encoded); the rows of the publish do not.
    let asked = [format!("'{capture_id}'"), format!("%27{capture_id}%27")]
        .map(|pattern| proxy.count_requests_containing(&pattern));
    let url = running.url(&format!("/v1/captures?stream=waiting&id={capture_id}&wait=published"));
    let response = client.post(url).body("wait for me").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED, "{}", running.daemon.log());
    let body: serde_json::Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert!(body["version"].as_u64().is_some(), "{body}");
    // No catalog read asked about the capture while it was awaited (a waiter polling every 100 ms would have, about
    // 15 times, before the publish after the 1.5 s linger).
    let reads: u64 = asked.iter().map(|counter| counter.load(std::sync::atomic::Ordering::SeqCst)).sum();
    assert_eq!(reads, 0, "{reads} catalog reads named the capture while it was awaited");
    // Control: a read of the capture is seen by the counters.
    let response = client.get(running.url(&format!("/v1/captures/{capture_id}"))).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let reads: u64 = asked.iter().map(|counter| counter.load(std::sync::atomic::Ordering::SeqCst)).sum();
    assert!(reads >= 1, "the counters miss catalog reads, so the check above proves nothing");

    // One read at a time: of two reads sent together to a slow catalog, one is served and the other told to retry.
    proxy.delay(Duration::from_millis(500));
    let read = |path: String| {
        let (client, url) = (client.clone(), running.url(&path));
        tokio::spawn(async move {
            let response = client.get(url).send().await.unwrap();
            (response.status(), response.headers().get("retry-after").cloned())
        })
    };
    let first = read(format!("/v1/captures/{capture_id}"));
    let second = read("/v1/captures?limit=1".into());
    let mut answers = vec![first.await.unwrap(), second.await.unwrap()];
    answers.sort_by_key(|(status, _)| status.as_u16());
    proxy.pass();
    assert_eq!(answers[0].0, StatusCode::OK, "{answers:?}");
    assert_eq!(answers[1].0, StatusCode::SERVICE_UNAVAILABLE, "{answers:?}");
    assert_eq!(answers[1].1.as_ref().map(|value| value.to_str().unwrap()), Some("1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captures_are_served_so_that_a_browser_never_runs_them() {
    let running = start(&[]).await;
    let client = reqwest::Client::new();
    let capture_id = uuid::Uuid::now_v7();
    let url = running.url(&format!("/v1/captures?stream=web&id={capture_id}&content_type=text/html&wait=published"));
    let response = client.post(url).body("<script>alert(1)</script>").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED, "{}", running.daemon.log());
    let response = client.get(running.url(&format!("/v1/captures/{capture_id}"))).send().await.unwrap();
    let headers = response.headers();
    assert_eq!(headers["content-type"], "text/html");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert!(headers["content-security-policy"].to_str().unwrap().starts_with("sandbox"));
    assert_eq!(headers["content-disposition"], format!("attachment; filename=\"{capture_id}\""));
    let inline =
        client.get(running.url(&format!("/v1/captures/{capture_id}?disposition=inline"))).send().await.unwrap();
    assert!(!inline.headers().contains_key("content-disposition"));
    assert!(inline.headers()["content-security-policy"].to_str().unwrap().starts_with("sandbox"), "sandboxed still");
    // A page on another origin cannot even ask.
    let from_page = client
        .get(running.url(&format!("/v1/captures/{capture_id}")))
        .header("origin", "https://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(from_page.status(), StatusCode::FORBIDDEN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_whose_client_goes_away_stops_and_frees_its_read_slot() {
    let proxy = FaultProxy::start(shared_server().http_addr);
    let running = start(&[
        ("CAPSTORE_CATALOG_URL", proxy.url()),
        ("CAPSTORE_HTTP_MAX_CONCURRENT_READS", "1".into()),
        ("CAPSTORE_SPOOL_PACK_MAX_AGE", "100ms".into()),
    ])
    .await;
    let client = reqwest::Client::new();
    let posts = (0..200).map(|n| {
        let url = running.url("/v1/captures?stream=gone/away&wait=published");
        let client = client.clone();
        async move { client.post(url).body(format!("capture {n}")).send().await.unwrap().status() }
    });
    assert!(futures::future::join_all(posts).await.iter().all(|status| *status == StatusCode::CREATED));
    // Each page of one capture is a catalog read of at least 300 ms: the whole export would take a minute or more.
    proxy.delay(Duration::from_millis(300));
    let mut export = client.get(running.url("/v1/export?stream=gone/away&page_size=1")).send().await.unwrap();
    assert_eq!(export.status(), StatusCode::OK);
    assert!(export.chunk().await.unwrap().is_some(), "the export began");
    let busy = client.get(running.url("/v1/captures?limit=1")).send().await.unwrap().status();
    assert_eq!(busy, StatusCode::SERVICE_UNAVAILABLE, "the export holds the one read slot");
    drop(export);
    // The client is gone: the export stops after the page in hand and gives its slot back, long before its end.
    let started = Instant::now();
    loop {
        let status = client.get(running.url("/v1/captures?limit=1")).send().await.unwrap().status();
        if status == StatusCode::OK {
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(started.elapsed() < Duration::from_secs(20), "the export went on without its client");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.pass();
}
