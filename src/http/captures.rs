//! The capture endpoints: `POST /v1/captures`, `GET /v1/captures/{id}`, `GET /v1/captures`, and their parameters.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use uuid::Uuid;

use super::{ApiError, HttpState};
use crate::capture::{self, CaptureMeta};
use crate::catalog::query::{validate_cursor, ListQuery};
use crate::reader::ReadError;
use crate::spool::writer::AppendError;

/// How long `wait=published` waits by default, and at most.
const PUBLISH_WAIT_DEFAULT: Duration = Duration::from_secs(30);
const PUBLISH_WAIT_MAX: Duration = Duration::from_secs(300);
const PUBLISH_POLL: Duration = Duration::from_millis(100);
const LIST_LIMIT_DEFAULT: u64 = 100;
const LIST_LIMIT_MAX: u64 = 10_000;

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

pub(super) async fn post_capture(
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

pub(super) async fn get_capture(
    State(state): State<Arc<HttpState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
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

pub(super) async fn list_captures(
    State(state): State<Arc<HttpState>>,
    RawQuery(raw_query): RawQuery,
) -> Result<Response, ApiError> {
    let query = list_query(query_pairs(raw_query))?;
    let reader = state.reader.get().ok_or_else(|| ApiError::unavailable("the catalog is not connected yet"))?;
    let page = reader.catalog().list(&query).await.map_err(|error| ApiError::unavailable(error.to_string()))?;
    Ok(Json(page).into_response())
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
}
