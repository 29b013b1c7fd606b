//! Deleting captures: `DELETE /v1/captures/{id}` and `POST /v1/captures/delete` (a list of ids), each answered once
//! the deletion is published (or known to be needless), through [`crate::pipeline::deletion::Deleter`].
//!
//! Both answer `{deleted, already_deleted, not_found, changed, pending, version, dry_run}` (lists of ids; `version`
//! the deletion's, or null when nothing was to be deleted). A list may carry `unchanged_since`, the watermark of the
//! listing its ids come from: a capture posted again after it is `changed` and left alone. Deleting is idempotent: an id deleted earlier is
//! `already_deleted`, so a client that lost an answer (or got 503 for an unknown outcome) asks again. A single
//! `DELETE` of an unknown id is 404, of one still in the spool 409 with `Retry-After` (publish first: it would
//! otherwise reappear when its pack is published); a list reports those per id.

use std::sync::Arc;

use axum::extract::{Path, RawQuery, Request, State};
use axum::http::StatusCode;
use axum::Json;

use super::{ApiError, HttpState};
use crate::catalog::publish::{PublishError, DELETION_MAX_IDS};
use crate::pipeline::deletion::DeletionAnswer;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DeleteRequest {
    ids: Vec<String>,
    #[serde(default)]
    dry_run: bool,
    /// The watermark of the listing the ids come from: a capture posted again since is `changed`, not deleted.
    #[serde(default)]
    unchanged_since: Option<u64>,
}

pub(super) async fn delete_capture(
    State(state): State<Arc<HttpState>>,
    Path(id): Path<String>,
    RawQuery(raw_query): RawQuery,
) -> Result<Json<serde_json::Value>, ApiError> {
    let capture_id = super::captures::parse_capture_id("id", &id)?;
    let mut dry_run = false;
    for (key, value) in super::captures::query_pairs(raw_query) {
        match (key.as_str(), value.as_str()) {
            ("dry_run", "true" | "1") => dry_run = true,
            ("dry_run", "false" | "0") => dry_run = false,
            ("dry_run", other) => return Err(ApiError::bad("dry_run", format!("dry_run = {other:?}: true or false"))),
            (other, _) => return Err(ApiError::bad("query", format!("unknown parameter {other:?}"))),
        }
    }
    let answer = delete(&state, &[capture_id], None, dry_run).await?;
    if !answer.report.not_found.is_empty() {
        return Err(ApiError { field_opt: Some("id"), ..ApiError::new(StatusCode::NOT_FOUND, "no such capture") });
    }
    if !answer.pending.is_empty() {
        return Err(ApiError {
            field_opt: Some("id"),
            retry_after: true,
            ..ApiError::new(StatusCode::CONFLICT, "the capture is not published yet; delete it once it is")
        });
    }
    Ok(Json(answer_json(&answer)))
}

pub(super) async fn delete_captures(
    State(state): State<Arc<HttpState>>,
    request: Request,
) -> Result<Json<serde_json::Value>, ApiError> {
    let parsed: DeleteRequest =
        super::bulk::json_body(&state, request, "{\"ids\": [capture ids], \"dry_run\": false}").await?;
    let ids = super::bulk::parse_ids(&parsed.ids, DELETION_MAX_IDS)?;
    let answer = delete(&state, &ids, parsed.unchanged_since, parsed.dry_run).await?;
    Ok(Json(answer_json(&answer)))
}

async fn delete(
    state: &HttpState,
    ids: &[uuid::Uuid],
    unchanged_since: Option<u64>,
    dry_run: bool,
) -> Result<DeletionAnswer, ApiError> {
    let deleter = state.deleter.get().ok_or_else(|| {
        ApiError::busy("not publishing yet (the catalog is not connected or the lease not taken); retry shortly")
    })?;
    deleter.delete(ids, unchanged_since, dry_run).await.map_err(|error| match error {
        PublishError::NoLease | PublishError::NotCommitted if deleter.ended() => ApiError::busy(
            "this daemon is shutting down and takes no more deletions; retry once a publisher of the catalog runs",
        ),
        PublishError::NoLease | PublishError::NotCommitted => {
            ApiError::busy("this daemon does not hold the catalog's lease right now; retry shortly")
        }
        PublishError::OutcomeUnknown(error) => {
            tracing::warn!(%error, "deletion outcome unknown");
            ApiError::busy("the deletion's outcome is unknown; ask again (deleting is idempotent)")
        }
        PublishError::Catalog(error) => {
            tracing::warn!(%error, "deletion failed");
            ApiError::busy("the catalog is unavailable; retry later")
        }
    })
}

fn answer_json(answer: &DeletionAnswer) -> serde_json::Value {
    serde_json::json!({
        "deleted": answer.report.deleted,
        "already_deleted": answer.report.already_deleted,
        "not_found": answer.report.not_found,
        "changed": answer.report.changed,
        "pending": answer.pending,
        "version": answer.report.version,
        "dry_run": answer.dry_run,
    })
}
