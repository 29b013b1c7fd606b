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
//!
//! Files: this one holds the server, its state and the token check; `captures` the capture endpoints and their
//! parameters; `metrics` the Prometheus text.

mod captures;
mod metrics;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::sync::watch;

use crate::catalog::lease::LeaseState;
use crate::config::HttpConfig;
use crate::pipeline::off_runtime;
use crate::pipeline::status::StatusBoard;
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
        .route("/v1/captures", post(captures::post_capture).get(captures::list_captures))
        .route("/v1/captures/{id}", get(captures::get_capture))
        .route("/status", get(status))
        .route("/metrics", get(metrics::metrics))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(token_matches("secret", "secret"));
        assert!(!token_matches("secret", "secreT"));
        assert!(!token_matches("secret", "secret2"));
    }
}
