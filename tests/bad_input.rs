//! Bad input from every way in, against one real daemon (ClickHouse, an S3 bucket with a secret key, an HTTP token):
//! every bad HTTP request and inbox file gets a clear refusal naming the field or the file, the daemon stays up, the
//! good captures sent between the bad ones are all published and read back byte-identical, and no secret appears in
//! the log, `/status`, `check-config` or an error body. The CLI and configuration cases run the binary directly.

#![allow(clippy::disallowed_methods, reason = "the test plays producers, which rename files into the inbox")]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::daemon::{Daemon, DaemonEnv};
use reqwest::StatusCode;
use serde_json::Value;
use uuid::Uuid;

const TOKEN: &str = "bad-input-token-0123456789";

struct Setup {
    _dir: tempfile::TempDir,
    env: DaemonEnv,
    daemon: Option<Daemon>,
    base: String,
    secret_key: String,
}

impl Setup {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn inbox(&self, stream: &str) -> std::path::PathBuf {
        let dir = Path::new(self.env.get("CAPSTORE_SPOOL_DIR").unwrap()).join("inbox").join(stream);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}

async fn start() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let s3 = common::s3::shared_s3();
    s3.start();
    let token_path = dir.path().join("token");
    std::fs::write(&token_path, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token_path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let port = common::free_port(false);
    let env = DaemonEnv::live("badinput", dir.path())
        .set("CAPSTORE_BUCKET_URL", format!("s3://{}", s3.bucket))
        .set("CAPSTORE_BUCKET_ENDPOINT", s3.endpoint())
        .set("CAPSTORE_BUCKET_REGION", "us-east-1")
        .set("CAPSTORE_BUCKET_ALLOW_HTTP", "true")
        .set("CAPSTORE_BUCKET_ACCESS_KEY_ID", s3.access_key.clone())
        .set("CAPSTORE_BUCKET_SECRET_ACCESS_KEY", s3.secret_key.clone())
        .set("CAPSTORE_BUCKET_PREFIX", format!("bad{}", rand::random::<u32>()))
        .set("CAPSTORE_HTTP_LISTEN", format!("127.0.0.1:{port}"))
        .set("CAPSTORE_HTTP_TOKEN_FILE", token_path.display().to_string())
        .set("CAPSTORE_SPOOL_MAX_CAPTURE_BYTES", "64KiB")
        .set("CAPSTORE_SPOOL_INBOX_RESCAN_INTERVAL", "200ms")
        .set("CAPSTORE_LOG_LEVEL", "debug");
    let daemon = env.start(dir.path().join("daemon.log"));
    let secret_key = s3.secret_key.clone();
    Setup { _dir: dir, env, daemon: Some(daemon), base: format!("http://127.0.0.1:{port}"), secret_key }
}

async fn json(response: reqwest::Response) -> Value {
    let bytes = response.bytes().await.unwrap();
    serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
}

/// One bad HTTP request: what it sends and what it must get.
struct BadRequest {
    what: &'static str,
    method: reqwest::Method,
    path: String,
    body: Vec<u8>,
    headers: Vec<(&'static str, String)>,
    authorized: bool,
    status: StatusCode,
    field: Option<&'static str>,
}

fn bad(
    what: &'static str,
    method: reqwest::Method,
    path: &str,
    status: StatusCode,
    field: Option<&'static str>,
) -> BadRequest {
    BadRequest {
        what,
        method,
        path: path.to_string(),
        body: b"x".to_vec(),
        headers: Vec::new(),
        authorized: true,
        status,
        field,
    }
}

fn bad_requests() -> Vec<BadRequest> {
    use reqwest::Method;
    let too_many_labels: String = (0..65).map(|n| format!("&label=k{n}=v")).collect();
    let mut requests = vec![
        bad(
            "hidden stream segment",
            Method::POST,
            "/v1/captures?stream=cam/.x",
            StatusCode::BAD_REQUEST,
            Some("stream"),
        ),
        bad("no stream", Method::POST, "/v1/captures", StatusCode::BAD_REQUEST, Some("stream")),
        bad(
            "label without =",
            Method::POST,
            "/v1/captures?stream=s&label=novalue",
            StatusCode::BAD_REQUEST,
            Some("label"),
        ),
        bad(
            "bad label key",
            Method::POST,
            "/v1/captures?stream=s&label=a%20b=1",
            StatusCode::BAD_REQUEST,
            Some("label"),
        ),
        bad(
            "the nil id",
            Method::POST,
            &format!("/v1/captures?stream=s&id={}", Uuid::nil()),
            StatusCode::BAD_REQUEST,
            Some("id"),
        ),
        bad("an id that is no UUID", Method::POST, "/v1/captures?stream=s&id=42", StatusCode::BAD_REQUEST, Some("id")),
        bad(
            "control character in the content type",
            Method::POST,
            "/v1/captures?stream=s&content_type=a%0Ab",
            StatusCode::BAD_REQUEST,
            Some("content_type"),
        ),
        bad(
            "negative time",
            Method::POST,
            "/v1/captures?stream=s&captured_at_ns=-1",
            StatusCode::BAD_REQUEST,
            Some("captured_at_ns"),
        ),
        bad("unknown wait", Method::POST, "/v1/captures?stream=s&wait=forever", StatusCode::BAD_REQUEST, Some("wait")),
        bad(
            "unknown parameter",
            Method::POST,
            "/v1/captures?stream=s&colour=red",
            StatusCode::BAD_REQUEST,
            Some("query"),
        ),
        bad(
            "65 labels",
            Method::POST,
            &format!("/v1/captures?stream=s{too_many_labels}"),
            StatusCode::BAD_REQUEST,
            Some("label"),
        ),
        bad(
            "a GET of the nil id",
            Method::GET,
            &format!("/v1/captures/{}", Uuid::nil()),
            StatusCode::BAD_REQUEST,
            Some("id"),
        ),
        bad(
            "a GET of no UUID",
            Method::GET,
            "/v1/captures/..%2F..%2Fetc%2Fpasswd",
            StatusCode::BAD_REQUEST,
            Some("id"),
        ),
        bad(
            "a bad disposition",
            Method::GET,
            &format!("/v1/captures/{}?disposition=run", Uuid::now_v7()),
            StatusCode::BAD_REQUEST,
            Some("disposition"),
        ),
        bad(
            "a listing with 65 labels",
            Method::GET,
            &format!("/v1/captures?stream=s{too_many_labels}"),
            StatusCode::BAD_REQUEST,
            Some("label"),
        ),
        bad("a bad cursor", Method::GET, "/v1/captures?cursor=x.y.z", StatusCode::BAD_REQUEST, Some("cursor")),
        bad("limit 0", Method::GET, "/v1/captures?limit=0", StatusCode::BAD_REQUEST, Some("limit")),
        bad("a bad time", Method::GET, "/v1/captures?since=yesterday", StatusCode::BAD_REQUEST, Some("since")),
    ];
    let mut big = bad(
        "over max_capture_bytes",
        Method::POST,
        "/v1/captures?stream=s",
        StatusCode::PAYLOAD_TOO_LARGE,
        Some("spool.max_capture_bytes"),
    );
    big.body = vec![7; 64 * 1024 + 1];
    requests.push(big);
    let mut web_page = bad(
        "a web page's request",
        Method::POST,
        "/v1/captures?stream=s&content_type=text/html",
        StatusCode::FORBIDDEN,
        Some("Origin"),
    );
    web_page.headers.push(("origin", "https://evil.example".into()));
    requests.push(web_page);
    let mut rebinding = bad("a rebinding host", Method::GET, "/v1/captures", StatusCode::FORBIDDEN, Some("Host"));
    rebinding.headers.push(("host", "rebind.attacker.example:9464".into()));
    requests.push(rebinding);
    let mut anonymous = bad("no token", Method::GET, "/status", StatusCode::UNAUTHORIZED, None);
    anonymous.authorized = false;
    requests.push(anonymous);
    let mut wrong_token = bad("a wrong token", Method::GET, "/status", StatusCode::UNAUTHORIZED, None);
    wrong_token.authorized = false;
    wrong_token.headers.push(("authorization", "Bearer not-the-token-0123456789".into()));
    requests.push(wrong_token);
    requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_in_refuses_bad_input_clearly_loses_no_good_capture_and_leaks_no_secret() {
    let mut setup = start().await;
    setup.daemon.as_mut().unwrap().wait_for_log_async("capstore running", Duration::from_secs(60)).await;
    let client = reqwest::Client::new();
    let mut good: BTreeMap<Uuid, Vec<u8>> = BTreeMap::new();
    let mut error_bodies = String::new();

    // HTTP: each bad request refused as it should be, a good capture after each.
    for (n, request) in bad_requests().into_iter().enumerate() {
        let mut builder = client.request(request.method.clone(), setup.url(&request.path)).body(request.body.clone());
        if request.authorized {
            builder = builder.bearer_auth(TOKEN);
        }
        for (name, value) in &request.headers {
            builder = builder.header(*name, value);
        }
        let response = builder.send().await.unwrap_or_else(|error| panic!("{}: {error}", request.what));
        assert_eq!(response.status(), request.status, "{}: {}", request.what, request.path);
        let body = json(response).await;
        error_bodies.push_str(&body.to_string());
        if let Some(field) = request.field {
            assert_eq!(body["field"], field, "{}: {body}", request.what);
        }
        assert!(body["error"].as_str().is_some_and(|message| !message.is_empty()), "{}: {body}", request.what);

        let capture_id = Uuid::now_v7();
        let payload: Vec<u8> = format!("good capture {n} between bad requests").into_bytes();
        let url = setup.url(&format!("/v1/captures?stream=good/http&id={capture_id}"));
        let response = client.post(url).bearer_auth(TOKEN).body(payload.clone()).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "the daemon stays up after {}", request.what);
        good.insert(capture_id, payload);
    }

    // Inbox: bad files quarantined (or, when not regular files, skipped) with a reason naming the problem, good files
    // between them captured.
    let bad_stream = setup.inbox("bad stream");
    std::fs::write(bad_stream.join("f"), b"x").unwrap();
    let stream = setup.inbox("good/inbox");
    let drop_file = |name: &str, contents: &[u8]| {
        std::fs::write(stream.join(format!(".{name}")), contents).unwrap();
        std::fs::rename(stream.join(format!(".{name}")), stream.join(name)).unwrap();
    };
    drop_file("big", &vec![1; 64 * 1024 + 1]);
    drop_file("broken.capenv", b"capenv1 {not json}\npayload");
    drop_file("unknown-field.capenv", b"capenv1 {\"colour\":\"red\"}\npayload");
    drop_file("bad-label.capenv", b"capenv1 {\"labels\":{\"a b\":\"1\"}}\npayload");
    std::os::unix::fs::symlink("/etc/hostname", stream.join("link-to-etc")).unwrap();
    for n in 0..5 {
        let capture_id = Uuid::now_v7();
        let payload = format!("good inbox capture {n}").into_bytes();
        drop_file(&capture_id.to_string(), &payload);
        good.insert(capture_id, payload);
    }
    let quarantine = Path::new(setup.env.get("CAPSTORE_SPOOL_DIR").unwrap()).join("quarantine").join("inbox");
    let reasons = || -> Vec<String> {
        std::fs::read_dir(&quarantine)
            .map(|entries| {
                entries
                    .map(|entry| entry.unwrap().path())
                    .filter(|path| path.extension().is_some_and(|extension| extension == "reason"))
                    .map(|path| std::fs::read_to_string(path).unwrap())
                    .collect()
            })
            .unwrap_or_default()
    };
    let started = Instant::now();
    while reasons().len() < 5 {
        assert!(started.elapsed() < Duration::from_secs(30), "bad inbox files not quarantined: {:?}", reasons());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reasons = reasons();
    for expected in ["bad stream", "max_capture_bytes", "envelope header is not valid", "colour", "a b"] {
        assert!(reasons.iter().any(|reason| reason.contains(expected)), "no reason names {expected:?}: {reasons:?}");
    }
    assert!(stream.join("link-to-etc").exists(), "a symlink is skipped, not followed or removed");

    // Every good capture is published and reads back byte-identical.
    let started = Instant::now();
    for (capture_id, payload) in &good {
        loop {
            let response =
                client.get(setup.url(&format!("/v1/captures/{capture_id}"))).bearer_auth(TOKEN).send().await.unwrap();
            if response.status() == StatusCode::OK && response.headers().contains_key("x-capstore-version") {
                assert_eq!(&response.bytes().await.unwrap()[..], &payload[..], "{capture_id}");
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(60), "{capture_id} was not published");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // No secret anywhere an operator or a client looks.
    let status = client.get(setup.url("/status")).bearer_auth(TOKEN).send().await.unwrap().text().await.unwrap();
    let check_config = setup.env.command().arg("check-config").output().unwrap();
    assert!(check_config.status.success(), "{}", String::from_utf8_lossy(&check_config.stderr));
    let printed = String::from_utf8_lossy(&check_config.stdout).into_owned();
    assert!(printed.contains("secret_access_key = \"<redacted>\""), "{printed}");
    let health = client.get(setup.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK, "the daemon is still up");
    let (code, _, log) = setup.daemon.take().expect("the daemon runs").terminate();
    assert_eq!(code, 0, "{log}");
    for secret in [TOKEN, setup.secret_key.as_str()] {
        assert!(!log.contains(secret), "a secret is in the log");
        assert!(!status.contains(secret), "a secret is in /status");
        assert!(!printed.contains(secret), "a secret is in check-config");
        assert!(!error_bodies.contains(secret), "a secret is in an error body");
    }
    assert!(!error_bodies.contains(setup.env.get("CAPSTORE_SPOOL_DIR").unwrap()), "an error body names a spool path");
}

#[test]
fn cli_and_config_refuse_bad_input_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let env = DaemonEnv::offline(&dir.path().join("spool"));
    let run = |env: &DaemonEnv, args: &[&str]| {
        let output = env.command().args(args).output().unwrap();
        (output.status.code().unwrap_or(-1), String::from_utf8_lossy(&output.stderr).into_owned())
    };
    for (args, named) in [
        (vec!["get", "not-a-uuid"], "not-a-uuid"),
        (vec!["ls", "--since", "yesterday"], "yesterday"),
        (vec!["ls", "--label", "novalue"], "key=value"),
        (vec!["put", "--stream", "../up", "/dev/null"], "--stream"),
        (vec!["tail", "--after", "-1"], "-1"),
    ] {
        let (code, stderr) = run(&env, &args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?} does not name {named:?}: {stderr}");
    }
    for (key, value, named) in [
        ("CAPSTORE_HTTP_LISTEN", "0.0.0.0:9464", "http.token_file"),
        ("CAPSTORE_SPOOL_PACK_MAX_BYTES", "lots", "lots"),
        ("CAPSTORE_CATALOG_TABLE_PREFIX", "x; DROP TABLE y", "catalog.table_prefix"),
        ("CAPSTORE_BUCKET_URL", "ftp://example", "bucket.url"),
        ("CAPSTORE_HTTP_MAX_INFLIGHT_BYTES", "1KiB", "http.max_inflight_bytes"),
    ] {
        let (code, stderr) = run(&env.clone().set(key, value), &["check-config"]);
        assert_eq!(code, 2, "{key}={value}: {stderr}");
        assert!(stderr.contains(named), "{key}={value} does not name {named:?}: {stderr}");
        let (code, _) = run(&env.clone().set(key, value), &["run"]);
        assert_eq!(code, 2, "{key}={value}: the daemon refuses to start");
    }
}
