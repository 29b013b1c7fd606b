//! The HTTP API of `capstore run` (default `127.0.0.1:9464`, `http.listen`).
//!
//! It serves from the moment ingest is up, before the catalog connects: writes work at once, catalog reads answer 503
//! until the catalog is connected. On shutdown intake stops first (a POST then gets 503), the server stops last.
//!
//! | Endpoint | Answers |
//! |---|---|
//! | `POST /v1/captures?stream=S[&id=UUID][&label=k=v ...][&content_type=T][&captured_at_ns=N][&wait=published][&timeout_ms=N]`, payload as body | 201 `{capture_id, pack_id}` once the record is fsynced (with `wait=published`: once the catalog shows it, plus `version`); 202 when `wait=published` timed out (durable, not yet published); 400 bad parameter (JSON names the `field`); 413 larger than `spool.max_capture_bytes`; 503 spool full or spool I/O error (with `Retry-After: 1`) or shutting down |
//! | `GET /v1/captures/{id}` | 200 the payload (`content-type` of the capture, `x-capstore-stream`, `x-capstore-captured-at-ns`, `x-capstore-version` when published); 400 bad id; 404 unknown; 503 catalog not connected or unreachable; 500 a record that fails its checks |
//! | `GET /v1/captures?stream=&since=&until=&label=k=v&limit=&cursor=` | 200 `{captures, next_cursor, watermark}` (`since`/`until`: ns or RFC 3339; `limit` default 100, at most 10000); 400 bad parameter; 503 catalog not connected or unreachable |
//! | `GET /status` | 200 the status snapshot (the same JSON as `<spool>/status.json`) |
//! | `GET /metrics` | 200 Prometheus/OpenMetrics text |
//! | `GET /healthz` | 200 while the process runs |
//! | `GET /readyz` | 200 while intake is open and the lease is not latched (`failed`); else 503 |
//!
//! Auth: when `http.token_file` is set, every endpoint except `/healthz` and `/readyz` requires
//! `Authorization: Bearer <token>` (the file's content, surrounding whitespace trimmed); anything else gets 401. The
//! token is never logged. Errors are JSON `{"error": message, "field": name-or-null}`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, RawQuery, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use uuid::Uuid;

use crate::capture::{self, CaptureMeta};
use crate::catalog::lease::LeaseState;
use crate::catalog::query::{validate_cursor, ListQuery};
use crate::config::HttpConfig;
use crate::pipeline::status::SpoolCounts;
use crate::pipeline::supervisor::StatusBoard;
use crate::reader::{ReadError, Reader};
use crate::spool::writer::{AppendError, SpoolWriter};

/// How long `wait=published` waits by default, and at most.
const PUBLISH_WAIT_DEFAULT: Duration = Duration::from_secs(30);
const PUBLISH_WAIT_MAX: Duration = Duration::from_secs(300);
const PUBLISH_POLL: Duration = Duration::from_millis(100);
const LIST_LIMIT_DEFAULT: u64 = 100;
const LIST_LIMIT_MAX: u64 = 10_000;
/// Requests still running this long after the stop are cut off.
const STOP_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen on http.listen = {listen}: {source}")]
    Bind { listen: String, source: std::io::Error },
    #[error("cannot read http.token_file {path}: {reason}")]
    TokenFile { path: String, reason: String },
}

/// What the handlers share. The reader appears once the catalog is connected.
pub(crate) struct HttpState {
    board: Arc<StatusBoard>,
    writer: SpoolWriter,
    max_capture_bytes: u64,
    token_opt: Option<String>,
    reader: OnceLock<Reader>,
    intake_open: AtomicBool,
    stop_rx: watch::Receiver<bool>,
}

impl HttpState {
    pub(crate) fn set_reader(&self, reader: Reader) {
        let _ = self.reader.set(reader);
    }

    /// From now on a POST answers 503 and /readyz is not ready.
    pub(crate) fn close_intake(&self) {
        self.intake_open.store(false, Ordering::SeqCst);
    }
}

/// The running server; [`HttpServer::stop`] ends it.
pub(crate) struct HttpServer {
    state: Arc<HttpState>,
    local_addr: SocketAddr,
    stop_tx: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// Bind `http.listen` and serve. A bind failure is returned (the caller treats it as fatal).
    pub(crate) async fn start(
        config: &HttpConfig,
        board: Arc<StatusBoard>,
        writer: SpoolWriter,
        max_capture_bytes: u64,
    ) -> Result<HttpServer, HttpError> {
        let token_opt = match &config.token_file {
            Some(path) => Some(read_token(path)?),
            None => None,
        };
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .map_err(|source| HttpError::Bind { listen: config.listen.clone(), source })?;
        let local_addr =
            listener.local_addr().map_err(|source| HttpError::Bind { listen: config.listen.clone(), source })?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let state = Arc::new(HttpState {
            board,
            writer,
            max_capture_bytes,
            token_opt,
            reader: OnceLock::new(),
            intake_open: AtomicBool::new(true),
            stop_rx: stop_rx.clone(),
        });
        let router = router(state.clone());
        let mut shutdown_rx = stop_rx;
        let task = tokio::spawn(async move {
            let serving = axum::serve(listener, router).with_graceful_shutdown(async move {
                let _ = shutdown_rx.wait_for(|stop| *stop).await;
            });
            if let Err(error) = serving.await {
                tracing::error!(%error, "http server failed");
            }
        });
        tracing::info!(listen = %local_addr, auth = state.token_opt.is_some(), "http serving");
        Ok(HttpServer { state, local_addr, stop_tx, task })
    }

    pub(crate) fn state(&self) -> &Arc<HttpState> {
        &self.state
    }

    /// Stop accepting connections, let running requests finish (at most [`STOP_GRACE`]), then cut off the rest.
    pub(crate) async fn stop(self) {
        self.state.close_intake();
        let _ = self.stop_tx.send(true);
        let mut task = self.task;
        if tokio::time::timeout(STOP_GRACE, &mut task).await.is_err() {
            task.abort();
        }
        tracing::info!(listen = %self.local_addr, "http stopped");
    }
}

fn read_token(path: &std::path::Path) -> Result<String, HttpError> {
    let bad = |reason: String| HttpError::TokenFile { path: path.display().to_string(), reason };
    let text = std::fs::read_to_string(path).map_err(|error| bad(error.to_string()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(bad("the file is empty".into()));
    }
    Ok(token.to_string())
}

fn router(state: Arc<HttpState>) -> Router {
    // The limit sits one byte above the largest capture, so a payload of exactly max_capture_bytes passes and anything
    // larger is refused while reading, before it is buffered whole.
    let body_limit = usize::try_from(state.max_capture_bytes.saturating_add(1)).unwrap_or(usize::MAX);
    let protected = Router::new()
        .route("/v1/captures", post(post_capture).get(list_captures))
        .route("/v1/captures/{id}", get(get_capture))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
        .layer(DefaultBodyLimit::max(body_limit));
    Router::new().route("/healthz", get(healthz)).route("/readyz", get(readyz)).merge(protected).with_state(state)
}

/// An error answer: a status and `{"error", "field"}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    field_opt: Option<&'static str>,
    message: String,
    retry_after: bool,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, field_opt: None, message: message.into(), retry_after: false }
    }

    fn bad(field: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            field_opt: Some(field),
            message: message.into(),
            retry_after: false,
        }
    }

    fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(serde_json::json!({ "error": self.message, "field": self.field_opt }));
        let mut response = (self.status, body).into_response();
        if self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

fn append_error(error: AppendError) -> ApiError {
    match &error {
        AppendError::TooLarge { .. } => ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            field_opt: Some("spool.max_capture_bytes"),
            message: error.to_string(),
            retry_after: false,
        },
        AppendError::Invalid(_) => ApiError::new(StatusCode::BAD_REQUEST, error.to_string()),
        AppendError::Closed => ApiError::unavailable("shutting down: intake is closed"),
        AppendError::QuotaExceeded(_) | AppendError::Io(_) => {
            debug_assert!(error.is_temporary());
            ApiError { retry_after: true, ..ApiError::unavailable(error.to_string()) }
        }
    }
}

fn read_error(error: ReadError) -> ApiError {
    match error {
        ReadError::Catalog(_) | ReadError::Bucket(_) | ReadError::Spool(_) => ApiError::unavailable(error.to_string()),
        ReadError::Pack { .. } | ReadError::WrongRecord { .. } => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
        }
    }
}

fn token_matches(expected: &str, given: &str) -> bool {
    // Compare every byte, so the time taken does not tell how much of a guess was right.
    expected.len() == given.len() && expected.bytes().zip(given.bytes()).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
}

async fn require_token(State(state): State<Arc<HttpState>>, request: Request, next: Next) -> Response {
    if let Some(expected) = &state.token_opt {
        let given_opt = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        if !given_opt.is_some_and(|given| token_matches(expected, given.trim())) {
            let mut response =
                ApiError::new(StatusCode::UNAUTHORIZED, "a bearer token is required (Authorization: Bearer <token>)")
                    .into_response();
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    next.run(request).await
}

/// The query string as ordered pairs (repeated keys such as `label` keep every value).
fn query_pairs(raw_opt: Option<String>) -> Vec<(String, String)> {
    let raw = raw_opt.unwrap_or_default();
    form_urlencoded::parse(raw.as_bytes()).into_owned().collect()
}

fn parse_u64(field: &'static str, text: &str) -> Result<u64, ApiError> {
    text.parse().map_err(|_| ApiError::bad(field, format!("{field} = {text:?} is not a non-negative integer")))
}

/// Nanoseconds since the epoch, or an RFC 3339 time.
fn parse_time(field: &'static str, text: &str) -> Result<u64, ApiError> {
    if let Ok(ns) = text.parse::<u64>() {
        return Ok(ns);
    }
    humantime::parse_rfc3339_weak(text)
        .map(crate::util::system_time_ns)
        .map_err(|_| ApiError::bad(field, format!("{field} = {text:?} is not an RFC 3339 time or nanoseconds")))
}

fn add_label(labels: &mut BTreeMap<String, String>, text: &str) -> Result<(), ApiError> {
    let (key, value) = capture::parse_label(text).map_err(|problem| ApiError::bad("label", problem))?;
    if labels.insert(key.clone(), value).is_some() {
        return Err(ApiError::bad("label", format!("label {key:?} given twice")));
    }
    Ok(())
}

#[derive(Debug)]
struct PostParams {
    meta: CaptureMeta,
    wait_published: bool,
    wait_timeout: Duration,
}

fn post_params(pairs: Vec<(String, String)>) -> Result<PostParams, ApiError> {
    let mut stream_opt = None;
    let mut capture_id_opt = None;
    let mut labels = BTreeMap::new();
    let mut content_type_opt = None;
    let mut captured_at_ns_opt = None;
    let mut wait_published = false;
    let mut wait_timeout = PUBLISH_WAIT_DEFAULT;
    for (key, value) in pairs {
        match key.as_str() {
            "stream" => {
                capture::validate_stream(&value).map_err(|problem| ApiError::bad("stream", problem))?;
                stream_opt = Some(value);
            }
            "id" => {
                let id = Uuid::parse_str(&value)
                    .map_err(|_| ApiError::bad("id", format!("id = {value:?} is not a UUID")))?;
                capture_id_opt = Some(id);
            }
            "label" => add_label(&mut labels, &value)?,
            "content_type" => {
                capture::validate_content_type(&value).map_err(|problem| ApiError::bad("content_type", problem))?;
                content_type_opt = Some(value);
            }
            "captured_at_ns" => captured_at_ns_opt = Some(parse_u64("captured_at_ns", &value)?),
            "wait" => match value.as_str() {
                "published" => wait_published = true,
                "durable" => wait_published = false,
                _ => {
                    return Err(ApiError::bad(
                        "wait",
                        format!("wait = {value:?}: expected \"published\" or \"durable\""),
                    ))
                }
            },
            "timeout_ms" => {
                let millis = parse_u64("timeout_ms", &value)?;
                wait_timeout = Duration::from_millis(millis).min(PUBLISH_WAIT_MAX);
            }
            _ => return Err(ApiError::bad("query", format!("unknown parameter {key:?}"))),
        }
    }
    let stream = stream_opt.ok_or_else(|| ApiError::bad("stream", "the stream parameter is required"))?;
    capture::validate_labels(&labels).map_err(|problem| ApiError::bad("label", problem))?;
    let meta = CaptureMeta {
        capture_id: capture_id_opt.unwrap_or_else(Uuid::now_v7),
        stream,
        captured_at_ns: captured_at_ns_opt.unwrap_or_else(crate::util::now_ns),
        labels,
        content_type: content_type_opt,
        source_name: None,
    };
    debug_assert!(capture::validate_meta(&meta).is_ok());
    Ok(PostParams { meta, wait_published, wait_timeout })
}

async fn post_capture(
    State(state): State<Arc<HttpState>>,
    RawQuery(raw_query): RawQuery,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let params = post_params(query_pairs(raw_query))?;
    let payload = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            append_error(AppendError::TooLarge { size: state.max_capture_bytes + 1, limit: state.max_capture_bytes })
        } else {
            ApiError::new(rejection.status(), rejection.body_text())
        }
    })?;
    if !state.intake_open.load(Ordering::SeqCst) {
        return Err(append_error(AppendError::Closed));
    }
    let stream = params.meta.stream.clone();
    let ack = state.writer.append(params.meta, payload.to_vec()).await.map_err(|error| {
        tracing::debug!(%error, %stream, "http append refused");
        append_error(error)
    })?;
    let capture_id = ack.capture_id.to_string();
    let pack_id = ack.pack_id.to_string();
    if !params.wait_published {
        let body = serde_json::json!({ "capture_id": capture_id, "pack_id": pack_id });
        return Ok((StatusCode::CREATED, Json(body)).into_response());
    }
    match wait_published(&state, ack.capture_id, params.wait_timeout).await {
        Some(version) => {
            let body = serde_json::json!({ "capture_id": capture_id, "pack_id": pack_id, "version": version });
            Ok((StatusCode::CREATED, Json(body)).into_response())
        }
        None => {
            let body = serde_json::json!({ "capture_id": capture_id, "pack_id": pack_id, "published": false });
            Ok((StatusCode::ACCEPTED, Json(body)).into_response())
        }
    }
}

/// Poll the catalog until it shows `capture_id`; its version, or `None` at the timeout or when the server stops.
async fn wait_published(state: &HttpState, capture_id: Uuid, timeout: Duration) -> Option<u64> {
    let deadline = Instant::now() + timeout;
    let mut stop_rx = state.stop_rx.clone();
    loop {
        if let Some(reader) = state.reader.get() {
            match reader.catalog().get(capture_id, None).await {
                Ok(Some(location)) => return Some(location.version),
                Ok(None) => {}
                Err(error) => tracing::debug!(%error, %capture_id, "catalog read while waiting for publish failed"),
            }
        }
        let now = Instant::now();
        if now >= deadline || *stop_rx.borrow() {
            return None;
        }
        tokio::select! {
            _ = tokio::time::sleep(PUBLISH_POLL.min(deadline - now)) => {}
            _ = stop_rx.changed() => return None,
        }
    }
}

async fn get_capture(State(state): State<Arc<HttpState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let capture_id = Uuid::parse_str(&id).map_err(|_| ApiError::bad("id", format!("id = {id:?} is not a UUID")))?;
    let reader = state.reader.get().ok_or_else(|| ApiError::unavailable("the catalog is not connected yet"))?;
    let capture = reader
        .get(capture_id)
        .await
        .map_err(read_error)?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("capture {capture_id} is unknown")))?;
    let content_type = capture.meta.content_type.as_deref().unwrap_or("application/octet-stream");
    let mut response = Response::new(Body::from(capture.payload));
    let headers = response.headers_mut();
    let content_type_value =
        HeaderValue::from_str(content_type).unwrap_or(HeaderValue::from_static("application/octet-stream"));
    headers.insert(header::CONTENT_TYPE, content_type_value);
    if let Ok(stream) = HeaderValue::from_str(&capture.meta.stream) {
        headers.insert("x-capstore-stream", stream);
    }
    headers.insert("x-capstore-captured-at-ns", HeaderValue::from(capture.meta.captured_at_ns));
    if let Some(version) = capture.version {
        headers.insert("x-capstore-version", HeaderValue::from(version));
    }
    Ok(response)
}

fn list_query(pairs: Vec<(String, String)>) -> Result<ListQuery, ApiError> {
    let mut query = ListQuery { limit: LIST_LIMIT_DEFAULT, ..Default::default() };
    for (key, value) in pairs {
        match key.as_str() {
            "stream" => {
                capture::validate_stream(&value).map_err(|problem| ApiError::bad("stream", problem))?;
                query.stream = Some(value);
            }
            "since" => query.since_ns = Some(parse_time("since", &value)?),
            "until" => query.until_ns = Some(parse_time("until", &value)?),
            "label" => add_label(&mut query.labels, &value)?,
            "limit" => {
                let limit = parse_u64("limit", &value)?;
                if limit == 0 || limit > LIST_LIMIT_MAX {
                    return Err(ApiError::bad("limit", format!("limit must be 1-{LIST_LIMIT_MAX}")));
                }
                query.limit = limit;
            }
            "cursor" => {
                validate_cursor(&value).map_err(|problem| ApiError::bad("cursor", problem))?;
                query.cursor = Some(value);
            }
            _ => return Err(ApiError::bad("query", format!("unknown parameter {key:?}"))),
        }
    }
    Ok(query)
}

async fn list_captures(
    State(state): State<Arc<HttpState>>,
    RawQuery(raw_query): RawQuery,
) -> Result<Response, ApiError> {
    let query = list_query(query_pairs(raw_query))?;
    let reader = state.reader.get().ok_or_else(|| ApiError::unavailable("the catalog is not connected yet"))?;
    let page = reader.catalog().list(&query).await.map_err(|error| ApiError::unavailable(error.to_string()))?;
    Ok(Json(page).into_response())
}

async fn status(State(state): State<Arc<HttpState>>) -> Json<serde_json::Value> {
    Json(state.board.snapshot())
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<Arc<HttpState>>) -> Response {
    let lease_failed = state.board.lease.get().is_some_and(|lease| lease.state() == LeaseState::Failed);
    if !state.intake_open.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: intake is closed\n").into_response();
    }
    if lease_failed {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: the lease latched (another publisher holds it)\n")
            .into_response();
    }
    (StatusCode::OK, "ready\n").into_response()
}

async fn metrics(State(state): State<Arc<HttpState>>) -> Result<Response, ApiError> {
    let sample = MetricsSample::take(&state.board);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(sample));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    Ok(([(header::CONTENT_TYPE, content_type)], text).into_response())
}

const LEASE_STATES: [LeaseState; 6] = [
    LeaseState::None,
    LeaseState::Held,
    LeaseState::Quarantined,
    LeaseState::Reacquiring,
    LeaseState::Failed,
    LeaseState::Released,
];

fn lease_state_name(state: LeaseState) -> String {
    serde_json::to_value(state).ok().and_then(|value| value.as_str().map(str::to_string)).unwrap_or_default()
}

/// Every metric's value at one scrape; counters are monotonic since the process started.
#[derive(Debug)]
struct MetricsSample {
    counters: Vec<(&'static str, &'static str, u64)>,
    gauges: Vec<(&'static str, &'static str, i64)>,
    lease_state: LeaseState,
    spool: SpoolCounts,
}

impl MetricsSample {
    fn take(board: &StatusBoard) -> MetricsSample {
        let writer = board.writer_stats.snapshot();
        let ingest = &board.ingest_stats;
        let pipeline_opt = board.pipeline_counters.get().map(|counters| counters.snapshot());
        let pipeline = |pick: fn(&crate::pipeline::PipelineCounts) -> u64| pipeline_opt.as_ref().map_or(0, pick);
        let lease_opt = board.lease.get().map(|lease| lease.status());
        let lease = |pick: fn(&crate::catalog::lease::LeaseStatus) -> u64| lease_opt.as_ref().map_or(0, pick);
        let counters = vec![
            ("capstore_captures_appended", "captures appended to the spool (fsynced)", writer.records_appended),
            ("capstore_bytes_appended", "payload bytes appended to the spool", writer.bytes_appended),
            ("capstore_fsyncs", "spool fsyncs (one per group commit)", writer.fsyncs),
            ("capstore_packs_sealed", "packs sealed", writer.packs_sealed),
            ("capstore_appends_refused", "appends refused (quota, size, I/O, closed)", writer.appends_refused),
            ("capstore_inbox_files_ingested", "inbox files ingested", ingest.files_ingested.load(Ordering::Relaxed)),
            (
                "capstore_inbox_files_quarantined",
                "inbox files moved to quarantine",
                ingest.files_quarantined.load(Ordering::Relaxed),
            ),
            ("capstore_packs_uploaded", "packs uploaded and verified", pipeline(|p| p.packs_uploaded)),
            ("capstore_bytes_uploaded", "pack bytes uploaded", pipeline(|p| p.bytes_uploaded)),
            ("capstore_packs_indexed", "packs published to the catalog", pipeline(|p| p.packs_indexed)),
            ("capstore_captures_indexed", "captures published to the catalog", pipeline(|p| p.captures_indexed)),
            ("capstore_publishes", "catalog publishes (versions committed)", pipeline(|p| p.publishes)),
            ("capstore_packs_quarantined", "packs moved to quarantine", pipeline(|p| p.packs_quarantined)),
            ("capstore_lease_renewals", "lease renewals", lease(|l| l.lease_renewals)),
            ("capstore_lease_reacquisitions", "lease re-acquisitions", lease(|l| l.lease_reacquisitions)),
            ("capstore_lease_timeouts", "lease statements that timed out", lease(|l| l.lease_timeouts)),
        ];
        let lease_term = i64::try_from(lease(|l| l.lease_term)).unwrap_or(i64::MAX);
        MetricsSample {
            counters,
            gauges: vec![("capstore_lease_term", "current lease term", lease_term)],
            lease_state: lease_opt.as_ref().map_or(LeaseState::None, |l| l.lease_state),
            spool: SpoolCounts::measure(&board.paths).unwrap_or_default(),
        }
    }
}

impl Collector for MetricsSample {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, value) in &self.counters {
            let counter = ConstCounter::new(*value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        for (name, help, value) in &self.gauges {
            let gauge = ConstGauge::new(*value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let mut family = encoder.encode_descriptor(
            "capstore_lease_state",
            "1 for the lease's current state, 0 for the others",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for state in LEASE_STATES {
            let gauge = ConstGauge::new(i64::from(state == self.lease_state));
            gauge.encode(family.encode_family(&[("state", lease_state_name(state))])?)?;
        }
        let by_state: Vec<(&String, i64, i64)> = self
            .spool
            .by_state
            .iter()
            .map(|(state, count)| {
                (state, i64::try_from(count.packs).unwrap_or(i64::MAX), i64::try_from(count.bytes).unwrap_or(i64::MAX))
            })
            .collect();
        let mut packs_family = encoder.encode_descriptor(
            "capstore_spool_packs",
            "packs in the spool per state",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (state, packs, _) in &by_state {
            ConstGauge::new(*packs).encode(packs_family.encode_family(&[("state", state.as_str())])?)?;
        }
        let mut bytes_family = encoder.encode_descriptor(
            "capstore_spool_bytes",
            "bytes in the spool per pack state",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (state, _, bytes) in &by_state {
            ConstGauge::new(*bytes).encode(bytes_family.encode_family(&[("state", state.as_str())])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(query: &str) -> Vec<(String, String)> {
        query_pairs(Some(query.to_string()))
    }

    #[test]
    fn post_parameters() {
        let params =
            post_params(pairs("stream=cam/1&label=site=berlin&label=k=a%3Db&wait=published&timeout_ms=50")).unwrap();
        assert_eq!(params.meta.stream, "cam/1");
        assert_eq!(params.meta.labels.get("k").map(String::as_str), Some("a=b"));
        assert!(params.wait_published);
        assert_eq!(params.wait_timeout, Duration::from_millis(50));
        for (query, field) in [
            ("", "stream"),
            ("stream=.bad", "stream"),
            ("stream=a&label=novalue", "label"),
            ("stream=a&label=k=1&label=k=2", "label"),
            ("stream=a&id=nope", "id"),
            ("stream=a&captured_at_ns=-1", "captured_at_ns"),
            ("stream=a&wait=forever", "wait"),
            ("stream=a&colour=red", "query"),
        ] {
            let error = post_params(pairs(query)).unwrap_err();
            assert_eq!((error.status, error.field_opt), (StatusCode::BAD_REQUEST, Some(field)), "{query}");
        }
    }

    #[test]
    fn list_parameters() {
        let query = list_query(pairs("stream=a&since=2026-11-30T07:00:00Z&until=5&limit=7")).unwrap();
        assert_eq!(query.since_ns, Some(1_796_022_000_000_000_000));
        assert_eq!((query.until_ns, query.limit), (Some(5), 7));
        assert_eq!(list_query(pairs("since=yesterday")).unwrap_err().field_opt, Some("since"));
        assert_eq!(list_query(pairs("limit=0")).unwrap_err().field_opt, Some("limit"));
        assert_eq!(list_query(pairs("cursor=x")).unwrap_err().field_opt, Some("cursor"));
    }

    #[test]
    fn append_errors_map_to_statuses() {
        let quota = append_error(AppendError::QuotaExceeded("full".into()));
        assert_eq!((quota.status, quota.retry_after), (StatusCode::SERVICE_UNAVAILABLE, true));
        let large = append_error(AppendError::TooLarge { size: 2, limit: 1 });
        assert_eq!((large.status, large.field_opt), (StatusCode::PAYLOAD_TOO_LARGE, Some("spool.max_capture_bytes")));
        assert_eq!(append_error(AppendError::Closed).status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn token_comparison() {
        assert!(token_matches("secret", "secret"));
        assert!(!token_matches("secret", "secreT"));
        assert!(!token_matches("secret", "secret2"));
    }
}
