//! The capture endpoints: `POST /v1/captures`, `GET /v1/captures/{id}`, `GET /v1/captures`, and their parameters.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use uuid::Uuid;

use super::{ApiError, HttpState};
use crate::capture::{self, CaptureMeta};
use crate::catalog::fleet;
use crate::catalog::query::{validate_cursor, ListQuery};
use crate::pipeline::PackPublished;
use crate::reader::ReadError;
use crate::spool::writer::{Ack, AppendError};

/// How long `wait=published` waits by default, and at most.
const PUBLISH_WAIT_DEFAULT: Duration = Duration::from_secs(30);
const PUBLISH_WAIT_MAX: Duration = Duration::from_secs(300);
const LIST_LIMIT_DEFAULT: u64 = 100;
const LIST_LIMIT_MAX: u64 = 10_000;
/// A listing page stops adding captures once its JSON passes this (the next page goes on from there).
const LIST_RESPONSE_MAX_BYTES: usize = 8 << 20;

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

/// The answer to a failed read. The details (paths, server messages) go to the log, never into the body.
pub(super) fn read_error(capture_id: Uuid, error: ReadError) -> ApiError {
    match error {
        ReadError::Catalog(error) => {
            tracing::debug!(%capture_id, %error, "read: catalog unavailable");
            ApiError::unavailable("the catalog is unavailable; retry later")
        }
        ReadError::Bucket(error) => {
            tracing::debug!(%capture_id, %error, "read: bucket unavailable");
            ApiError::unavailable("the bucket is unavailable; retry later")
        }
        ReadError::Spool(error) => {
            tracing::warn!(%capture_id, %error, "read: local spool read failed");
            ApiError::unavailable("the local spool could not be read; retry later")
        }
        error @ (ReadError::Pack { .. } | ReadError::WrongRecord { .. }) => {
            tracing::error!(%capture_id, %error, "read: a stored record failed its checks");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the capture's stored record failed its checks")
        }
    }
}

pub(super) fn parse_capture_id(field: &'static str, text: &str) -> Result<Uuid, ApiError> {
    let id = Uuid::parse_str(text).map_err(|_| ApiError::bad(field, format!("{field} = {text:?} is not a UUID")))?;
    if id.is_nil() {
        return Err(ApiError::bad(field, format!("{field} = {text:?}: the nil UUID is not a capture id")));
    }
    Ok(id)
}

/// The query string as ordered pairs (repeated keys such as `label` keep every value).
pub(super) fn query_pairs(raw_opt: Option<String>) -> Vec<(String, String)> {
    let raw = raw_opt.unwrap_or_default();
    form_urlencoded::parse(raw.as_bytes()).into_owned().collect()
}

pub(super) fn parse_u64(field: &'static str, text: &str) -> Result<u64, ApiError> {
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
            "id" => capture_id_opt = Some(parse_capture_id("id", &value)?),
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
    request: Request,
) -> Result<Response, ApiError> {
    let params = post_params(query_pairs(raw_query))?;
    if !state.intake_open.load(Ordering::SeqCst) {
        return Err(append_error(AppendError::Closed));
    }
    // The body's memory is reserved before it is read: its declared length, or the largest capture when undeclared
    // (a body over the largest capture is refused while reading, once it passes the limit, so the client can read the
    // 413 instead of meeting a reset connection).
    let declared_len = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok())
        .unwrap_or(state.max_capture_bytes)
        .min(state.max_capture_bytes);
    let budget_kib = u32::try_from(declared_len.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    let Ok(_body_budget) = state.inflight_kib.try_acquire_many(budget_kib) else {
        return Err(ApiError::busy("busy: request bodies in flight are at http.max_inflight_bytes; retry shortly"));
    };
    let body_limit = usize::try_from(state.max_capture_bytes).unwrap_or(usize::MAX);
    let payload =
        match tokio::time::timeout(state.body_timeout, axum::body::to_bytes(request.into_body(), body_limit)).await {
            Err(_elapsed) => {
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("the body did not arrive within http.body_timeout = {:?}", state.body_timeout),
                ))
            }
            // The only way reading a bounded body fails besides the connection: it is over the limit.
            Ok(Err(error)) if is_length_limit(&error) => {
                return Err(append_error(AppendError::TooLarge {
                    size: state.max_capture_bytes + 1,
                    limit: state.max_capture_bytes,
                }))
            }
            Ok(Err(error)) => return Err(ApiError::bad("body", format!("the body could not be read: {error}"))),
            Ok(Ok(payload)) => payload,
        };
    // Listen before appending, so the announcement of this capture's pack cannot be missed.
    let mut announcements = params.wait_published.then(|| state.published.subscribe());
    let stream = params.meta.stream.clone();
    let ack = state.writer.append(params.meta, payload).await.map_err(|error| {
        tracing::debug!(%error, %stream, "http append refused");
        append_error(error)
    })?;
    drop(_body_budget);
    let capture_id = ack.capture_id.to_string();
    let pack_id = ack.pack_id.to_string();
    let Some(announcements) = announcements.as_mut() else {
        let body = serde_json::json!({ "capture_id": capture_id, "pack_id": pack_id });
        return Ok((StatusCode::CREATED, Json(body)).into_response());
    };
    match wait_published(&state, announcements, ack, params.wait_timeout).await {
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

fn is_length_limit(error: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if current.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = current.source();
    }
    false
}

/// Until the pack holding the capture is announced as published; its version, or `None` at the timeout or when the
/// server stops. A waiter that missed announcements (it fell behind) asks the catalog once per miss.
async fn wait_published(
    state: &HttpState,
    announcements: &mut tokio::sync::broadcast::Receiver<PackPublished>,
    ack: Ack,
    timeout: Duration,
) -> Option<u64> {
    use tokio::sync::broadcast::error::RecvError;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut stop_rx = state.stop_rx.clone();
    loop {
        let announcement = tokio::select! {
            announcement = announcements.recv() => announcement,
            _ = tokio::time::sleep_until(deadline) => return None,
            _ = stop_rx.changed() => return None,
        };
        match announcement {
            Ok(PackPublished { pack_id, version: Some(version) }) if pack_id == ack.pack_id => return Some(version),
            // Published by an earlier attempt (the replay guard): the catalog has the version.
            Ok(PackPublished { pack_id, version: None }) if pack_id == ack.pack_id => {
                return published_version(state, ack.capture_id).await
            }
            Ok(_) => {}
            Err(RecvError::Lagged(_)) => {
                if let Some(version) = published_version(state, ack.capture_id).await {
                    return Some(version);
                }
            }
            Err(RecvError::Closed) => return None,
        }
    }
}

/// The capture's published version, from the catalog.
async fn published_version(state: &HttpState, capture_id: Uuid) -> Option<u64> {
    let reader = state.reader.get()?;
    match reader.catalog().get(capture_id, None).await {
        Ok(location) => location.map(|location| location.version),
        Err(error) => {
            tracing::debug!(%error, %capture_id, "catalog read while waiting for a publish failed");
            None
        }
    }
}

pub(super) async fn get_capture(
    State(state): State<Arc<HttpState>>,
    Path(id): Path<String>,
    RawQuery(raw_query): RawQuery,
) -> Result<Response, ApiError> {
    let capture_id = parse_capture_id("id", &id)?;
    let mut inline = false;
    for (key, value) in query_pairs(raw_query) {
        match (key.as_str(), value.as_str()) {
            ("disposition", "inline") => inline = true,
            ("disposition", "attachment") => inline = false,
            ("disposition", other) => {
                return Err(ApiError::bad("disposition", format!("disposition = {other:?}: inline or attachment")))
            }
            (other, _) => return Err(ApiError::bad("query", format!("unknown parameter {other:?}"))),
        }
    }
    let reader = state.reader.get().ok_or_else(|| ApiError::unavailable("the catalog is not connected yet"))?;
    let Ok(_read) = state.reads.try_acquire() else {
        return Err(ApiError::busy("busy: http.max_concurrent_reads reads are running; retry shortly"));
    };
    let capture = reader
        .get(capture_id)
        .await
        .map_err(|error| read_error(capture_id, error))?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("capture {capture_id} is unknown")))?;
    let content_type = capture.meta.content_type.as_deref().unwrap_or("application/octet-stream");
    let mut response = Response::new(Body::from(capture.payload));
    let headers = response.headers_mut();
    let content_type_value =
        HeaderValue::from_str(content_type).unwrap_or(HeaderValue::from_static("application/octet-stream"));
    headers.insert(header::CONTENT_TYPE, content_type_value);
    // A capture is a producer's bytes, not this server's page: never let a browser run or sniff it as one.
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static("sandbox; default-src 'none'"));
    if !inline {
        let disposition = format!("attachment; filename=\"{capture_id}\"");
        headers.insert(header::CONTENT_DISPOSITION, HeaderValue::from_str(&disposition).expect("an ASCII header"));
    }
    if let Ok(stream) = HeaderValue::from_str(&capture.meta.stream) {
        headers.insert("x-capstore-stream", stream);
    }
    headers.insert("x-capstore-captured-at-ns", HeaderValue::from(capture.meta.captured_at_ns));
    if !capture.meta.labels.is_empty() {
        // Form-encoded (`k=v&k2=v2`, as the POST's query takes them): ASCII, whatever the labels hold.
        let labels = form_urlencoded::Serializer::new(String::new()).extend_pairs(&capture.meta.labels).finish();
        if let Ok(labels) = HeaderValue::from_str(&labels) {
            headers.insert("x-capstore-labels", labels);
        }
    }
    if let Some(version) = capture.version {
        headers.insert("x-capstore-version", HeaderValue::from(version));
    }
    Ok(response)
}

pub(super) fn list_query(pairs: Vec<(String, String)>) -> Result<ListQuery, ApiError> {
    let mut query = ListQuery { limit: LIST_LIMIT_DEFAULT, ..Default::default() };
    for (key, value) in pairs {
        match key.as_str() {
            "stream" => {
                capture::validate_stream(&value).map_err(|problem| ApiError::bad("stream", problem))?;
                query.stream = Some(value);
            }
            "since" => query.since_ns = Some(parse_time("since", &value)?),
            "until" => query.until_ns = Some(parse_time("until", &value)?),
            "label" => {
                add_label(&mut query.labels, &value)?;
                if query.labels.len() > capture::MAX_LABELS {
                    return Err(ApiError::bad("label", format!("at most {} labels", capture::MAX_LABELS)));
                }
            }
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
    let (selection, pairs) = catalog_selection(query_pairs(raw_query))?;
    let reader = state.reader.get().ok_or_else(|| ApiError::unavailable("the catalog is not connected yet"))?;
    let unavailable = |error: crate::catalog::CatalogError| {
        tracing::debug!(%error, "list: catalog unavailable");
        ApiError::unavailable("the catalog is unavailable; retry later")
    };
    let Some(selection) = selection else {
        let query = list_query(pairs)?;
        let Ok(_read) = state.reads.try_acquire() else {
            return Err(ApiError::busy("busy: http.max_concurrent_reads reads are running; retry shortly"));
        };
        let page = reader.catalog().list(&query).await.map_err(unavailable)?;
        return Ok(Json(page.cut_to_bytes(LIST_RESPONSE_MAX_BYTES)).into_response());
    };
    // A cursor across catalogs is not a single catalog's: checked here, the rest as for one catalog.
    let (cursor, pairs): (Vec<_>, Vec<_>) = pairs.into_iter().partition(|(key, _)| key == "cursor");
    let mut query = list_query(pairs)?;
    if let Some((_, cursor)) = cursor.into_iter().last() {
        fleet::validate_cursor(&cursor).map_err(|problem| ApiError::bad("cursor", problem))?;
        query.cursor = Some(cursor);
    }
    let Ok(_read) = state.reads.try_acquire() else {
        return Err(ApiError::busy("busy: http.max_concurrent_reads reads are running; retry shortly"));
    };
    let every_catalog = matches!(selection, CatalogSelection::All);
    let catalogs = match (selection, &query.cursor) {
        // A listing of every catalog goes on with the catalogs of its first page.
        (CatalogSelection::All, Some(cursor)) => {
            fleet::cursor_catalogs(cursor).map_err(|problem| ApiError::bad("cursor", problem))?
        }
        (CatalogSelection::All, None) => reader.catalog().catalog_names().await.map_err(unavailable)?,
        (CatalogSelection::Named(catalogs), _) => catalogs,
    };
    fleet::check_selection(&catalogs, query.cursor.as_deref()).map_err(|error| match error {
        fleet::SelectionError::Cursor(problem) => ApiError::bad("cursor", problem),
        too_many if every_catalog => ApiError::bad("all_catalogs", too_many.to_string()),
        too_many => ApiError::bad("catalog", too_many.to_string()),
    })?;
    let size_of = |capture: &fleet::FleetCapture| serde_json::to_vec(capture).map_or(0, |row| row.len()) + 1;
    let page = fleet::list(reader.catalog(), &catalogs, &query, LIST_RESPONSE_MAX_BYTES, size_of)
        .await
        .map_err(unavailable)?;
    Ok(Json(page).into_response())
}

/// Which catalogs a listing reads besides the daemon's own: `catalog=a,b` (repeatable) or `all_catalogs=true`.
enum CatalogSelection {
    Named(Vec<String>),
    All,
}

type QueryPairs = Vec<(String, String)>;

/// The catalog selection of a listing's query, and the rest of its parameters.
fn catalog_selection(pairs: QueryPairs) -> Result<(Option<CatalogSelection>, QueryPairs), ApiError> {
    let (mut named, mut all, mut rest) = (Vec::new(), false, Vec::new());
    for (key, value) in pairs {
        match key.as_str() {
            "catalog" => {
                for name in value.split(',') {
                    if !crate::config::is_catalog_name(name) {
                        return Err(ApiError::bad("catalog", format!("{name:?} is not a catalog name")));
                    }
                    named.push(name.to_string());
                }
            }
            "all_catalogs" => {
                all = match value.as_str() {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    other => {
                        return Err(ApiError::bad("all_catalogs", format!("all_catalogs = {other:?}: true or false")))
                    }
                }
            }
            _ => rest.push((key, value)),
        }
    }
    let selection = match (all, named.is_empty()) {
        (true, false) => {
            return Err(ApiError::bad("all_catalogs", "give catalog= or all_catalogs=true, not both".to_string()))
        }
        (true, true) => Some(CatalogSelection::All),
        (false, false) => Some(CatalogSelection::Named(named)),
        (false, true) => None,
    };
    Ok((selection, rest))
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
        // Only a listing's catalog selection is taken out; the rest is left for `list_query`.
        let (selection, rest) = catalog_selection(pairs("catalog=a,b.c&catalog=d-e&limit=3")).unwrap();
        assert!(matches!(selection, Some(CatalogSelection::Named(names)) if names == ["a", "b.c", "d-e"]));
        assert_eq!(rest, vec![("limit".to_string(), "3".to_string())]);
        assert!(matches!(catalog_selection(pairs("all_catalogs=true")).unwrap().0, Some(CatalogSelection::All)));
        assert!(catalog_selection(pairs("stream=a")).unwrap().0.is_none());
        for (query, field) in [
            ("catalog=a/b", "catalog"),
            ("catalog=", "catalog"),
            ("all_catalogs=yes", "all_catalogs"),
            ("catalog=a&all_catalogs=true", "all_catalogs"),
        ] {
            assert_eq!(catalog_selection(pairs(query)).err().and_then(|error| error.field_opt), Some(field), "{query}");
        }
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
