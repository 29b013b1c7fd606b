//! The HTTP API of `capstore run` (default `127.0.0.1:9464`, `http.listen`).
//!
//! It serves from the moment ingest is up, before the catalog connects: writes work at once, catalog reads answer 503
//! until the catalog is connected. On shutdown intake stops first (a POST then gets 503), the server stops last.
//!
//! | Endpoint | Answers |
//! |---|---|
//! | `POST /v1/captures?stream=S[&id=UUID][&label=k=v ...][&content_type=T][&captured_at_ns=N][&wait=published][&timeout_ms=N]`, payload as body | 201 `{capture_id, pack_id}` once the record is fsynced (with `wait=published`: once the catalog shows it, plus `version`); 202 when `wait=published` timed out (durable, not yet published); 400 bad parameter (JSON names the `field`); 408 body not received within `http.body_timeout`; 413 larger than `spool.max_capture_bytes`; 503 spool full, spool I/O error, request bodies in flight over `http.max_inflight_bytes` (all with `Retry-After: 1`), or shutting down |
//! | `GET /v1/captures/{id}[?disposition=inline]` | 200 the payload (`content-type` of the capture, `x-capstore-stream`, `x-capstore-captured-at-ns`, `x-capstore-labels` (form-encoded `k=v&...`) when it has labels, `x-capstore-version` when published; served as an attachment with `nosniff` and a `sandbox` CSP unless `disposition=inline`); 400 bad id; 404 unknown; 503 catalog not connected or unreachable, or `http.max_concurrent_reads` busy; 500 a record that fails its checks |
//! | `POST /v1/captures/multi-get`, body `{"ids": [...]}` (at most 10,000) | 200 `application/x-tar`, streamed: a file per capture found (named by its id) and `manifest.jsonl` last, one line per id asked, in order (metadata, `"error": "not found"`, or `"error": "unreadable"` for a damaged record or a lost pack object, whose reason goes to the log: the other captures still come); one catalog statement per 500 ids, bucket records of a pack fetched together ([`bulk`]); 400 naming `ids`; 503 as a GET |
//! | `DELETE /v1/captures/{id}[?dry_run=true]` | 200 `{deleted, already_deleted, not_found, pending, version, dry_run}` once the deletion is published (a versioned publish of this daemon: [`delete`]); from that version on no read returns the capture, `tail` shows the deletion; an id deleted before is `already_deleted` (idempotent); 404 unknown id; 409 still in the spool, not published yet (`Retry-After: 1`); 503 not holding the lease, the catalog away, or an unknown outcome (ask again) |
//! | `POST /v1/captures/delete`, body `{"ids": [...], "dry_run": false}` (at most 10,000) | 200 the same JSON, per id, as one publish; 400 naming `ids`; 503 as a DELETE |
//! | `GET /v1/export?stream=&since=&until=&label=k=v[&cursor=][&page_size=N]` or `?after_version=V[&through_version=M][&cursor=]` | 200 `application/x-tar`, streamed: everything the query selects (or what was published after version V, through M or the watermark, in version order), pages of `page_size` captures (default 5,000, at most 10,000) and at most 32 MiB of payload, each page's files then `manifest/<page>.jsonl` (a line per capture, and `{"resume": cursor}` while more follows: ask again with `cursor=` to resume the same snapshot); 400 bad parameter; 503 as a GET |
//! | `GET /v1/captures?stream=&since=&until=&label=k=v&limit=&cursor=` | 200 `{captures, next_cursor, watermark}` (`since`/`until`: ns or RFC 3339; `limit` default 100, at most 10000; at most 64 labels; a page is cut short at about 8 MiB of JSON, with a `next_cursor`); 400 bad parameter; 503 catalog not connected or unreachable, or busy |
//! | `GET /v1/tail?after=V[:ID][&limit=N][&wait_ms=T]` | 200 `{captures, next, watermark}`: the published captures after position `after` in version order (entries as `capstore tail` prints them), at most `limit` (default 1000, at most 10,000); ask again with `after=next`; when none follows, waits up to `wait_ms` (at most 60,000) for a publish ([`tail`]); 400 bad parameter; 503 as a GET |
//! | `GET /status` | 200 the status snapshot (the same JSON as `<spool>/status.json`) |
//! | `GET /metrics` | 200 Prometheus text (OpenMetrics when the `Accept` header asks for it) |
//! | `GET /healthz` | 200 while the process runs |
//! | `GET /readyz` | 200 while intake is open and the lease is not latched (`failed`); else 503 |
//!
//! Auth: when `http.token_file` is set, every endpoint except `/healthz` and `/readyz` requires
//! `Authorization: Bearer <token>` (the file's content, surrounding whitespace trimmed; the scheme in any case);
//! anything else gets 401. The token is never logged. A listen address beyond loopback requires a token (config
//! validation). Errors are JSON `{"error": message, "field": name-or-null}`; they never carry spool paths or server
//! internals (those go to the log).
//!
//! Browsers (`guard.rs`): a request whose `Origin` is not in `http.allowed_origins` gets 403, so no web page can post
//! or read captures through a user's browser; a `Host` that is neither the listen address, a loopback name, nor in
//! `http.allowed_hosts` gets 403, which defeats DNS rebinding (on loopback, where no token guards the API). Allowed
//! origins get CORS headers.
//!
//! Limits (`serve.rs`): at most `http.max_connections` open connections (more are closed at once), headers and bodies
//! each within `http.body_timeout`, request bodies in memory within `http.max_inflight_bytes`, at most
//! `http.max_concurrent_reads` reads at once. Every `wait=published` waiter listens to one announcement of published
//! packs ([`crate::pipeline::PublishedPacks`]); none polls the catalog.
//!
//! Files: this one holds the server's state, routes and errors; `serve.rs` the accept loop and its limits;
//! `guard.rs` the token, Origin and Host checks; `captures.rs` the capture endpoints and their parameters;
//! `bulk.rs` the tar answers of many captures (multi-get, export); `delete.rs` deletions; `tail.rs` the log of
//! publishes; `metrics.rs` the Prometheus text.

mod bulk;
mod captures;
mod delete;
mod guard;
mod metrics;
mod serve;
mod tail;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::sync::{watch, Semaphore};

use crate::catalog::lease::LeaseState;
use crate::config::HttpConfig;
use crate::pipeline::status::StatusBoard;
use crate::pipeline::{off_runtime, PublishedPacks};
use crate::reader::Reader;
use crate::spool::writer::SpoolWriter;

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
    published: Arc<PublishedPacks>,
    max_capture_bytes: u64,
    body_timeout: Duration,
    guard: guard::Guard,
    reader: OnceLock<Reader>,
    /// Appears once this process publishes (connected, lease taken).
    deleter: OnceLock<Arc<crate::pipeline::deletion::Deleter>>,
    intake_open: AtomicBool,
    /// Request bodies in memory, in KiB (see `http.max_inflight_bytes`).
    inflight_kib: Semaphore,
    /// Reads served at once (see `http.max_concurrent_reads`).
    reads: Semaphore,
    stop_rx: watch::Receiver<bool>,
}

impl HttpState {
    pub(crate) fn set_reader(&self, reader: Reader) {
        let _ = self.reader.set(reader);
    }

    pub(crate) fn set_deleter(&self, deleter: Arc<crate::pipeline::deletion::Deleter>) {
        let _ = self.deleter.set(deleter);
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
        published: Arc<PublishedPacks>,
        max_capture_bytes: u64,
    ) -> Result<HttpServer, HttpError> {
        let token_opt = match &config.token_file {
            Some(path) => Some(
                crate::config::read_token_file(path)
                    .map_err(|reason| HttpError::TokenFile { path: path.display().to_string(), reason })?,
            ),
            None => None,
        };
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .map_err(|source| HttpError::Bind { listen: config.listen.clone(), source })?;
        let local_addr =
            listener.local_addr().map_err(|source| HttpError::Bind { listen: config.listen.clone(), source })?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let inflight_kib = usize::try_from(config.max_inflight_bytes.0.div_ceil(1024)).unwrap_or(usize::MAX).max(1);
        let state = Arc::new(HttpState {
            board,
            writer,
            published,
            max_capture_bytes,
            body_timeout: config.body_timeout.0,
            guard: guard::Guard::new(config, token_opt, local_addr),
            reader: OnceLock::new(),
            deleter: OnceLock::new(),
            intake_open: AtomicBool::new(true),
            inflight_kib: Semaphore::new(inflight_kib.min(Semaphore::MAX_PERMITS)),
            reads: Semaphore::new(config.max_concurrent_reads as usize),
            stop_rx: stop_rx.clone(),
        });
        let router = router(state.clone(), config);
        let limits =
            serve::Limits { max_connections: config.max_connections as usize, header_timeout: config.body_timeout.0 };
        let task = tokio::spawn(serve::serve(listener, router, limits, stop_rx));
        tracing::info!(listen = %local_addr, auth = state.guard.requires_token(), "http serving");
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

fn router(state: Arc<HttpState>, config: &HttpConfig) -> Router {
    let protected = Router::new()
        .route("/v1/captures", post(captures::post_capture).get(captures::list_captures))
        .route("/v1/captures/multi-get", post(bulk::multi_get))
        .route("/v1/export", get(bulk::export))
        .route("/v1/captures/delete", post(delete::delete_captures))
        .route("/v1/captures/{id}", get(captures::get_capture).delete(delete::delete_capture))
        .route("/v1/tail", get(tail::tail))
        .route("/status", get(status))
        .route("/metrics", get(metrics::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::require_token));
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(protected)
        .layer(middleware::from_fn_with_state(state.clone(), guard::check_origin_and_host))
        .with_state(state);
    match guard::cors_layer(config) {
        Some(cors) => router.layer(cors),
        None => router,
    }
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

    /// 503 with `Retry-After`: a limit of this server, which clears by itself.
    fn busy(message: impl Into<String>) -> ApiError {
        ApiError { retry_after: true, ..ApiError::unavailable(message) }
    }

    fn forbidden(field: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { field_opt: Some(field), ..ApiError::new(StatusCode::FORBIDDEN, message) }
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

async fn status(State(state): State<Arc<HttpState>>) -> Result<Json<serde_json::Value>, ApiError> {
    let board = state.board.clone();
    let snapshot = off_runtime(move || Ok(board.snapshot()))
        .await
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    Ok(Json(snapshot))
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
