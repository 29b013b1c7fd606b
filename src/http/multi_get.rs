//! `POST /v1/captures/multi-get`: many captures in one request, as a tar stream.
//!
//! The body is JSON, `{"ids": ["<capture id>", ...]}` (at most [`MULTI_GET_MAX_IDS`]; an id asked twice is answered
//! once). The answer is `application/x-tar`, streamed: one file per capture found, named by its id and holding its
//! bytes (CRC-checked, as every read), then `manifest.jsonl`, one JSON line per requested id in the order asked:
//! `capture_id`, `stream`, `captured_at_ns`, `labels`, `content_type`, `size`, `crc32c`, `version` and `source` for a
//! capture found, `capture_id` and `"error": "not found"` for one that is not. Tar because every platform reads it
//! (`tar -x`, Python's `tarfile`, Go's `archive/tar`) and it streams: the daemon holds only the batch being read.
//!
//! The ids are read in batches of [`GET_MANY_MAX`] ([`crate::reader::Reader::get_many`]): one catalog statement per
//! batch, local packs from the spool, each bucket pack's records with one coalesced ranged read. A failure before the
//! first byte (the catalog away, too many reads running) is an ordinary error answer; after it the stream is cut, so
//! the tar is visibly incomplete (no end-of-archive blocks) rather than silently short.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use futures::channel::mpsc;
use futures::SinkExt;
use uuid::Uuid;

use super::{ApiError, HttpState};
use crate::reader::{ReadCapture, GET_MANY_MAX};

/// Ids one request may ask for.
pub const MULTI_GET_MAX_IDS: usize = 10_000;
/// The request body's limit: 10,000 ids in JSON are about 400 KB.
const BODY_LIMIT: usize = 1 << 20;
const TAR_BLOCK: usize = 512;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MultiGetRequest {
    ids: Vec<String>,
}

type Chunk = Result<Bytes, std::io::Error>;

pub(super) async fn multi_get(State(state): State<Arc<HttpState>>, request: Request) -> Result<Response, ApiError> {
    let body = axum::body::to_bytes(request.into_body(), BODY_LIMIT)
        .await
        .map_err(|_| ApiError::bad("ids", format!("the request body must be JSON of at most {BODY_LIMIT} bytes")))?;
    let parsed: MultiGetRequest = serde_json::from_slice(&body)
        .map_err(|error| ApiError::bad("ids", format!("expected {{\"ids\": [capture ids]}}: {error}")))?;
    if parsed.ids.len() > MULTI_GET_MAX_IDS {
        return Err(ApiError::bad("ids", format!("{} ids; at most {MULTI_GET_MAX_IDS} per request", parsed.ids.len())));
    }
    let mut ids = Vec::with_capacity(parsed.ids.len());
    for text in &parsed.ids {
        ids.push(super::captures::parse_capture_id("ids", text)?);
    }
    if state.reader.get().is_none() {
        return Err(ApiError::unavailable("the catalog is not connected yet"));
    }
    let (tx, rx) = mpsc::channel::<Chunk>(4);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(stream_tar(state, ids, tx, started_tx));
    started_rx.await.map_err(|_| ApiError::unavailable("the read ended early; retry"))??;
    let mut response = Response::new(Body::from_stream(rx));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-tar"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CONTENT_DISPOSITION, HeaderValue::from_static("attachment; filename=\"captures.tar\""));
    Ok(response)
}

/// Reads the batches and sends the tar. `started` learns, after the first batch, whether the answer can begin.
async fn stream_tar(
    state: Arc<HttpState>,
    ids: Vec<Uuid>,
    mut tx: mpsc::Sender<Chunk>,
    started: tokio::sync::oneshot::Sender<Result<(), ApiError>>,
) {
    let Some(reader) = state.reader.get() else { return };
    let Ok(_permit) = state.reads.try_acquire() else {
        let _ = started.send(Err(ApiError::busy("busy: http.max_concurrent_reads reads are running; retry shortly")));
        return;
    };
    let mut seen = HashSet::new();
    let unique: Vec<Uuid> = ids.iter().copied().filter(|id| seen.insert(*id)).collect();
    let mut manifest: HashMap<Uuid, serde_json::Value> = HashMap::with_capacity(unique.len());
    let mut started = Some(started);
    for batch in unique.chunks(GET_MANY_MAX) {
        let read = match reader.get_many(batch).await {
            Ok(read) => read,
            Err(error) => {
                match started.take() {
                    Some(started) => {
                        let _ = started.send(Err(super::captures::read_error(batch[0], error)));
                    }
                    None => {
                        tracing::warn!(%error, "multi-get cut short");
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
        for (id, capture) in read {
            let line = match capture {
                Some(capture) => {
                    let line = manifest_line(id, &capture);
                    for chunk in tar_file(&id.to_string(), capture.meta.captured_at_ns, capture.payload.into()) {
                        if tx.send(Ok(chunk)).await.is_err() {
                            return;
                        }
                    }
                    line
                }
                None => serde_json::json!({"capture_id": id, "error": "not found"}),
            };
            manifest.insert(id, line);
        }
    }
    if let Some(started) = started.take() {
        let _ = started.send(Ok(()));
    }
    let mut text = String::new();
    for id in &ids {
        if let Some(line) = manifest.get(id) {
            text.push_str(&line.to_string());
            text.push('\n');
        }
    }
    for chunk in tar_file("manifest.jsonl", crate::util::now_ns(), Bytes::from(text)) {
        if tx.send(Ok(chunk)).await.is_err() {
            return;
        }
    }
    // End of archive: two zero blocks.
    let _ = tx.send(Ok(Bytes::from(vec![0u8; 2 * TAR_BLOCK]))).await;
}

fn manifest_line(id: Uuid, capture: &ReadCapture) -> serde_json::Value {
    serde_json::json!({
        "capture_id": id,
        "stream": capture.meta.stream,
        "captured_at_ns": capture.meta.captured_at_ns,
        "labels": capture.meta.labels,
        "content_type": capture.meta.content_type,
        "size": capture.payload.len(),
        "crc32c": crc32c::crc32c(&capture.payload),
        "version": capture.version,
        "source": capture.source,
    })
}

/// One regular file in ustar framing: the header block, the bytes (not copied), zero padding to a whole block.
fn tar_file(name: &str, modified_ns: u64, bytes: Bytes) -> [Bytes; 3] {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(bytes.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(modified_ns / 1_000_000_000);
    // Names are capture ids or `manifest.jsonl`: short ASCII, always accepted.
    let _ = header.set_path(name);
    header.set_cksum();
    let padding = (TAR_BLOCK - bytes.len() % TAR_BLOCK) % TAR_BLOCK;
    [Bytes::copy_from_slice(header.as_bytes()), bytes, Bytes::from(vec![0u8; padding])]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tar_files_read_back_with_the_tar_crate() {
        let mut archive_bytes = Vec::new();
        for (name, payload) in [("a", vec![1u8; 700]), ("b", Vec::new()), ("manifest.jsonl", b"{}\n".to_vec())] {
            for chunk in tar_file(name, 1_700_000_000_000_000_000, Bytes::from(payload)) {
                archive_bytes.extend_from_slice(&chunk);
            }
        }
        archive_bytes.extend_from_slice(&[0u8; 2 * TAR_BLOCK]);
        let mut archive = tar::Archive::new(archive_bytes.as_slice());
        let entries: Vec<(String, usize, u64)> = archive
            .entries()
            .unwrap()
            .map(|entry| {
                let mut entry = entry.unwrap();
                let name = entry.path().unwrap().display().to_string();
                let mtime = entry.header().mtime().unwrap();
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
                (name, bytes.len(), mtime)
            })
            .collect();
        assert_eq!(
            entries,
            [
                ("a".into(), 700, 1_700_000_000),
                ("b".into(), 0, 1_700_000_000),
                ("manifest.jsonl".into(), 3, 1_700_000_000)
            ]
        );
    }
}
