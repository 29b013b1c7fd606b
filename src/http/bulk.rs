//! Many captures in one request, as a tar stream: `POST /v1/captures/multi-get` (a list of ids) and `GET /v1/export`
//! (everything a listing query selects). Tar because every platform reads it (`tar -x`, Python's `tarfile`, Go's
//! `archive/tar`) and it streams: the daemon holds only the page being read ([`crate::export`]).
//!
//! Multi-get: the body is JSON, `{"ids": ["<capture id>", ...]}` (at most [`MULTI_GET_MAX_IDS`]; an id asked twice is
//! answered once). The tar holds one file per capture found, named by its id (its bytes, CRC-checked as every read),
//! then `manifest.jsonl`: one line per id asked, in the order asked ([`crate::export::manifest_line`], or
//! `"error": "not found"`).
//!
//! Export: the listing's parameters (`stream`, `since`, `until`, `label`, and `cursor` to resume). Pages of
//! [`crate::export::EXPORT_PAGE`] captures (or 32 MiB): each page's files, then `manifest/<page>.jsonl` with a line per capture
//! and, when more follows, a last line `{"resume": "<cursor>"}`: a client that lost the stream asks again with
//! `cursor=` that token and gets the rest of the same snapshot.
//!
//! Both: a failure before the first byte (the catalog away, too many reads running) is an ordinary error answer; after
//! it the stream is cut, so the tar is visibly incomplete (no end-of-archive blocks) rather than silently short.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, Request, State};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use futures::channel::mpsc;
use futures::SinkExt;
use uuid::Uuid;

use super::{ApiError, HttpState};
use crate::catalog::query::TailPosition;
use crate::export::{tar_end, tar_file, tar_page, Export, Selection, EXPORT_PAGE_MAX};

/// Ids one multi-get may ask for.
pub const MULTI_GET_MAX_IDS: usize = 10_000;
/// The multi-get body's limit: 10,000 ids in JSON are about 400 KB.
const BODY_LIMIT: usize = 1 << 20;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MultiGetRequest {
    ids: Vec<String>,
}

type Chunk = Result<Bytes, std::io::Error>;
type Started = tokio::sync::oneshot::Sender<Result<(), ApiError>>;

/// A JSON request body of at most [`BODY_LIMIT`] bytes, received within `http.body_timeout`; `expected` shows the
/// shape in the error (which names the field `ids`: every such body is a list of ids).
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    state: &HttpState,
    request: Request,
    expected: &str,
) -> Result<T, ApiError> {
    let body = tokio::time::timeout(state.body_timeout, axum::body::to_bytes(request.into_body(), BODY_LIMIT))
        .await
        .map_err(|_| ApiError::new(axum::http::StatusCode::REQUEST_TIMEOUT, "the request body did not arrive in time"))?
        .map_err(|_| {
            ApiError::new(axum::http::StatusCode::PAYLOAD_TOO_LARGE, format!("the ids must fit in {BODY_LIMIT} bytes"))
        })?;
    serde_json::from_slice(&body).map_err(|error| ApiError::bad("ids", format!("expected {expected}: {error}")))
}

/// The ids of a request body, each a UUID, at most `max` of them.
pub(super) fn parse_ids(texts: &[String], max: usize) -> Result<Vec<Uuid>, ApiError> {
    if texts.len() > max {
        return Err(ApiError::bad("ids", format!("{} ids; at most {max} per request", texts.len())));
    }
    texts.iter().map(|text| super::captures::parse_capture_id("ids", text)).collect()
}

pub(super) async fn multi_get(State(state): State<Arc<HttpState>>, request: Request) -> Result<Response, ApiError> {
    let parsed: MultiGetRequest = json_body(&state, request, "{\"ids\": [capture ids]}").await?;
    let ids = parse_ids(&parsed.ids, MULTI_GET_MAX_IDS)?;
    let unique = crate::util::unique_ids(&ids);
    // (An id list's pages are the ids of one multi-get statement, whatever the page size.)
    let page_captures = crate::export::EXPORT_PAGE;
    stream_tar(state, Selection::Ids(unique), None, page_captures, Framing::OneManifest { asked: ids }).await
}

pub(super) async fn export(
    State(state): State<Arc<HttpState>>,
    RawQuery(raw_query): RawQuery,
) -> Result<Response, ApiError> {
    let mut pairs = super::captures::query_pairs(raw_query);
    let cursor = pairs.iter().position(|(key, _)| key == "cursor").map(|at| pairs.remove(at).1);
    if pairs.iter().any(|(key, _)| key == "limit") {
        return Err(ApiError::bad("limit", "an export has no limit: it pages through everything the query selects"));
    }
    let mut take = |name: &str| pairs.iter().position(|(key, _)| key == name).map(|at| pairs.remove(at).1);
    let page_captures = match take("page_size") {
        None => crate::export::EXPORT_PAGE,
        Some(text) => match super::captures::parse_u64("page_size", &text)? as usize {
            size @ 1..=EXPORT_PAGE_MAX => size,
            _ => return Err(ApiError::bad("page_size", format!("page_size must be 1-{EXPORT_PAGE_MAX}"))),
        },
    };
    let after_version = take("after_version");
    let through_version = take("through_version");
    let selection = match (after_version, through_version) {
        (None, None) => Selection::Query(super::captures::list_query(pairs)?),
        (None, Some(_)) => return Err(ApiError::bad("through_version", "through_version needs after_version")),
        (Some(after), through) => {
            if let Some((key, _)) = pairs.first() {
                return Err(ApiError::bad("query", format!("{key:?} does not go with after_version")));
            }
            let after = TailPosition::parse(&after).map_err(|problem| ApiError::bad("after_version", problem))?;
            let through = match through {
                Some(text) => Some(super::captures::parse_u64("through_version", &text)?),
                None => None,
            };
            Selection::Versions { after, through }
        }
    };
    // (The cursor is checked against the selection by `Export::new`.)
    stream_tar(state, selection, cursor, page_captures, Framing::PageManifests).await
}

/// How the manifest is written: one at the end in the order asked (multi-get), or one per page (export).
enum Framing {
    OneManifest { asked: Vec<Uuid> },
    PageManifests,
}

async fn stream_tar(
    state: Arc<HttpState>,
    selection: Selection,
    resume: Option<String>,
    page_captures: usize,
    framing: Framing,
) -> Result<Response, ApiError> {
    if state.reader.get().is_none() {
        return Err(ApiError::unavailable("the catalog is not connected yet"));
    }
    let (tx, rx) = mpsc::channel::<Chunk>(4);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(send_pages(state, selection, resume, page_captures, framing, tx, started_tx));
    started_rx.await.map_err(|_| ApiError::unavailable("the read ended early; retry"))??;
    let mut response = Response::new(Body::from_stream(rx));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-tar"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CONTENT_DISPOSITION, HeaderValue::from_static("attachment; filename=\"captures.tar\""));
    Ok(response)
}

/// Reads the pages and sends the tar. `started` learns, after the first page, whether the answer can begin.
async fn send_pages(
    state: Arc<HttpState>,
    selection: Selection,
    resume: Option<String>,
    page_captures: usize,
    framing: Framing,
    tx: mpsc::Sender<Chunk>,
    started: Started,
) {
    let Some(reader) = state.reader.get() else { return };
    let mut tx = Paced { tx, within: state.body_timeout };
    let Ok(_permit) = state.reads.try_acquire() else {
        let _ = started.send(Err(ApiError::busy("busy: http.max_concurrent_reads reads are running; retry shortly")));
        return;
    };
    let mut export = match Export::new(reader, selection, resume) {
        Ok(export) => export.with_page_captures(page_captures),
        Err(problem) => {
            let _ = started.send(Err(ApiError::bad("cursor", problem)));
            return;
        }
    };
    let mut started = Some(started);
    let mut lines: HashMap<Uuid, serde_json::Value> = HashMap::new();
    let mut page_number = 0u64;
    loop {
        // A client that is gone (or stopped reading) ends the work: no more catalog or bucket reads for it.
        if tx.tx.is_closed() {
            return;
        }
        let page = match export.next_page().await {
            Ok(Some(page)) => page,
            Ok(None) => break,
            Err(error) => {
                match started.take() {
                    Some(started) => {
                        let _ = started.send(Err(super::captures::read_error(Uuid::nil(), error)));
                    }
                    None => {
                        tracing::warn!(%error, "tar answer cut short by a failed read");
                        let _ = tx.send(Err(std::io::Error::other("read failed"))).await;
                    }
                }
                return;
            }
        };
        if let Some(started) = started.take() {
            if started.send(Ok(())).is_err() {
                return;
            }
        }
        page_number += 1;
        let tar = tar_page(page);
        for (capture_id, reason) in &tar.unreadable {
            tracing::warn!(%capture_id, %reason, "tar answer: capture unreadable (listed so in its manifest)");
        }
        for chunk in tar.chunks.iter().cloned() {
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
        match framing {
            Framing::OneManifest { .. } => lines.extend(tar.lines),
            Framing::PageManifests => {
                for chunk in tar.manifest(page_number) {
                    if tx.send(Ok(chunk)).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
    if let Some(started) = started.take() {
        let _ = started.send(Ok(()));
    }
    if let Framing::OneManifest { asked } = &framing {
        let mut text = String::new();
        for id in asked {
            if let Some(line) = lines.get(id) {
                text.push_str(&line.to_string());
                text.push('\n');
            }
        }
        if !send_file(&mut tx, "manifest.jsonl", text).await {
            return;
        }
    }
    let _ = tx.send(Ok(tar_end())).await;
}

/// The sending side of a tar answer: a chunk the client does not take within `within` (the same bound a slow request
/// body gets) ends the answer, so a stalled reader cannot hold a read permit and a page for ever.
struct Paced {
    tx: mpsc::Sender<Chunk>,
    within: std::time::Duration,
}

impl Paced {
    /// Ok when the chunk was taken; Err when the client is gone or stalled.
    async fn send(&mut self, chunk: Chunk) -> Result<(), ()> {
        match tokio::time::timeout(self.within, self.tx.send(chunk)).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(()),
        }
    }
}

async fn send_file(tx: &mut Paced, name: &str, text: String) -> bool {
    for chunk in tar_file(name, crate::util::now_ns(), Bytes::from(text)) {
        if tx.send(Ok(chunk)).await.is_err() {
            return false;
        }
    }
    true
}
