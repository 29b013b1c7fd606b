//! `GET /v1/tail`: the log of publishes over HTTP, page by page, with a long poll at its end.
//!
//! A consumer keeps one position (`after`, as `capstore tail --after` takes it) and asks again with each answer's
//! `next`: every published capture comes once, in version order, whatever the pages' sizes (a publish larger than a
//! page is split, see [`crate::catalog::query::TailPosition`]; an answer stops at about 8 MiB of JSON). When nothing follows the position, `wait_ms` holds
//! the request open until a publish lands (announced by this daemon's pipeline, or seen by a poll each second, for
//! publishes of another process) or the wait ends; it holds no read slot meanwhile.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::captures::{parse_u64, query_pairs};
use super::{ApiError, HttpState};
use crate::catalog::query::{TailPage, TailPosition};

const TAIL_LIMIT_DEFAULT: u64 = 1000;
const TAIL_LIMIT_MAX: u64 = 10_000;
const TAIL_WAIT_MAX: Duration = Duration::from_secs(60);
/// An answer stops adding entries once its JSON passes this (labels can make entries large); `next` goes on there.
const TAIL_RESPONSE_MAX_BYTES: usize = 8 << 20;
/// How often a long poll looks at the catalog without an announcement (publishes of another process).
const TAIL_POLL: Duration = Duration::from_secs(1);

struct TailParams {
    after: TailPosition,
    limit: u64,
    wait: Duration,
}

fn tail_params(pairs: Vec<(String, String)>) -> Result<TailParams, ApiError> {
    let mut params = TailParams { after: TailPosition::default(), limit: TAIL_LIMIT_DEFAULT, wait: Duration::ZERO };
    for (key, value) in pairs {
        match key.as_str() {
            "after" => params.after = TailPosition::parse(&value).map_err(|problem| ApiError::bad("after", problem))?,
            "limit" => {
                params.limit = parse_u64("limit", &value)?;
                if params.limit == 0 || params.limit > TAIL_LIMIT_MAX {
                    return Err(ApiError::bad("limit", format!("limit must be 1-{TAIL_LIMIT_MAX}")));
                }
            }
            "wait_ms" => {
                params.wait = Duration::from_millis(parse_u64("wait_ms", &value)?);
                if params.wait > TAIL_WAIT_MAX {
                    let max = TAIL_WAIT_MAX.as_millis();
                    return Err(ApiError::bad("wait_ms", format!("wait_ms must be at most {max}")));
                }
            }
            _ => return Err(ApiError::bad("query", format!("unknown parameter {key:?}"))),
        }
    }
    Ok(params)
}

/// 200 `{captures: [entry...], next, watermark}`; `next` is the position to ask with next time.
pub(super) async fn tail(
    State(state): State<Arc<HttpState>>,
    RawQuery(raw_query): RawQuery,
) -> Result<Response, ApiError> {
    let params = tail_params(query_pairs(raw_query))?;
    let reader = state.reader.get().ok_or_else(|| ApiError::unavailable("the catalog is not connected yet"))?;
    // Subscribed before the first read, so a publish between that read and the wait is not missed.
    let mut announcements = state.published.subscribe();
    let mut stop_rx = state.stop_rx.clone();
    let deadline = tokio::time::Instant::now() + params.wait;
    // The watermark of the last read (a read the busy server skipped answers with it).
    let mut last_watermark = None;
    loop {
        // A read slot only for the reads, none while waiting; past the first read, a busy server is no news.
        let read = match state.reads.try_acquire() {
            Ok(permit) => Some(permit),
            Err(_) if last_watermark.is_none() => {
                return Err(ApiError::busy("busy: http.max_concurrent_reads reads are running; retry shortly"))
            }
            Err(_) => None,
        };
        let page_opt = match read {
            Some(_permit) => {
                let unavailable = |error: crate::catalog::CatalogError| {
                    tracing::debug!(%error, "tail: catalog unavailable");
                    ApiError::unavailable("the catalog is unavailable; retry later")
                };
                let watermark = reader.catalog().watermark().await.map_err(unavailable)?;
                last_watermark = Some(watermark);
                let page = reader.catalog().tail_page(params.after, Some(watermark), params.limit).await;
                Some((page.map_err(unavailable)?.cut_by(TAIL_RESPONSE_MAX_BYTES, entry_bytes), watermark))
            }
            None => None,
        };
        let now = tokio::time::Instant::now();
        let done = now >= deadline || *stop_rx.borrow();
        match page_opt {
            Some((page, watermark)) if !page.caught_up() || done => return Ok(answer(&page, watermark)),
            None if done => {
                let page =
                    TailPage { captures: Vec::new(), horizons: Vec::new(), from: params.after, next: params.after };
                return Ok(answer(&page, last_watermark.unwrap_or_default()));
            }
            _ => {}
        }
        tokio::select! {
            _ = announcements.recv() => {}
            _ = tokio::time::sleep(TAIL_POLL.min(deadline - now)) => {}
            _ = stop_rx.changed() => {}
        }
    }
}

/// What a tail entry costs in the answer, about.
fn entry_bytes(capture: &crate::catalog::query::CaptureLocation) -> usize {
    serde_json::to_vec(&capture.tail_entry()).map_or(0, |line| line.len()) + 1
}

/// The answer of `GET /v1/tail`: the page's entries, where the next page starts, and the watermark read.
#[derive(serde::Serialize)]
struct TailAnswer<'a> {
    captures: Vec<crate::catalog::query::TailEntry<'a>>,
    next: String,
    watermark: u64,
}

fn answer(page: &TailPage, watermark: u64) -> Response {
    Json(TailAnswer { captures: page.entries(), next: page.next.to_string(), watermark }).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_parameters_name_the_bad_field() {
        let pairs = |query: &str| query_pairs(Some(query.to_string()));
        let id = uuid::Uuid::now_v7();
        let params = tail_params(pairs(&format!("after=12:{id}&limit=50&wait_ms=2000"))).unwrap();
        let after = TailPosition { version: 12, after_id: Some(id) };
        assert_eq!((params.after, params.limit, params.wait), (after, 50, Duration::from_secs(2)));
        for (query, field) in [
            ("after=x", "after"),
            ("after=3:7", "after"),
            ("limit=0", "limit"),
            ("limit=10001", "limit"),
            ("wait_ms=60001", "wait_ms"),
            ("wait_ms=-1", "wait_ms"),
            ("cursor=1", "query"),
        ] {
            let error = tail_params(pairs(query)).err().unwrap_or_else(|| panic!("{query} accepted"));
            assert_eq!(error.field_opt, Some(field), "{query}");
        }
    }
}
