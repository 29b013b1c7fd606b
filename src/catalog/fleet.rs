//! Reading several catalogs of the same tables as one: a fleet of daemons, each publishing its own catalog name into
//! shared tables, listed together (`capstore ls --catalog a,b`, `--all-catalogs`, `GET /v1/captures?catalog=a,b`).
//!
//! Each catalog keeps its own versions and watermark, so a listing across catalogs is a merge: every catalog's page
//! is read with [`CatalogReader::list`] (the same query, each at its own pinned watermark), the pages are merged in
//! (captured_at_ns, capture_id) order and cut at the limit. The cursor carries one position per catalog: where its
//! next page starts, `start` at a pinned watermark for a catalog none of whose captures was shown yet, or `done`.
//! So paging across catalogs costs one page read per catalog per page, and every capture of every catalog is listed
//! once, as each catalog was at the watermark the listing started at.
//!
//! The set of catalogs is fixed by the first page (a catalog that first publishes later is not in its cursor).

use std::collections::BTreeMap;

use serde::Serialize;

use super::client::{CatalogError, ErrorKind};
use super::query::{CaptureLocation, CatalogReader, ListQuery, Page};

/// A capture of a listing across catalogs, with the catalog it belongs to.
#[derive(Debug, Clone, Serialize)]
pub struct FleetCapture {
    pub catalog: String,
    #[serde(flatten)]
    pub capture: CaptureLocation,
}

/// One page of a listing across catalogs.
#[derive(Debug, Clone, Serialize)]
pub struct FleetPage {
    pub captures: Vec<FleetCapture>,
    /// Present when more may follow.
    pub next_cursor: Option<String>,
    /// The watermark each catalog is read at.
    pub watermarks: BTreeMap<String, u64>,
}

/// Where one catalog of a listing goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Position {
    /// Nothing of it shown yet: its first page, at this watermark.
    Start(u64),
    /// The cursor of its next page.
    At(String),
    Done,
}

/// What a fleet cursor starts with, so it is never taken for a single catalog's (which starts with a digit).
const CURSOR_PREFIX: &str = "f";

fn encode_cursor(positions: &BTreeMap<String, Position>) -> String {
    let text: Vec<String> = positions
        .iter()
        .map(|(catalog, position)| match position {
            Position::Start(watermark) => format!("{catalog}=start:{watermark}"),
            Position::At(cursor) => format!("{catalog}=at:{cursor}"),
            Position::Done => format!("{catalog}=done"),
        })
        .collect();
    format!("{CURSOR_PREFIX}{}", hex::encode(text.join(";")))
}

fn decode_cursor(text: &str) -> Result<BTreeMap<String, Position>, String> {
    let bad = || format!("invalid cursor {text:?}: not one of a listing across catalogs");
    let bytes = text.strip_prefix(CURSOR_PREFIX).and_then(|hex_text| hex::decode(hex_text).ok()).ok_or_else(bad)?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    let mut positions = BTreeMap::new();
    for entry in text.split(';') {
        let (catalog, position) = entry.split_once('=').ok_or_else(bad)?;
        if !crate::config::is_catalog_name(catalog) {
            return Err(bad());
        }
        let position = match position.split_once(':') {
            Some(("start", watermark)) => Position::Start(watermark.parse().map_err(|_| bad())?),
            Some(("at", cursor)) => {
                super::query::validate_cursor(cursor)?;
                Position::At(cursor.to_string())
            }
            None if position == "done" => Position::Done,
            _ => return Err(bad()),
        };
        positions.insert(catalog.to_string(), position);
    }
    Ok(positions)
}

/// Check a fleet cursor's syntax without a round trip.
pub fn validate_cursor(text: &str) -> Result<(), String> {
    decode_cursor(text).map(|_| ())
}

/// One page of the captures of `catalogs` matching `query` (its `cursor`, if any, from an earlier [`FleetPage`] of
/// the same catalogs), merged in (captured_at_ns, capture_id) order, at most `query.limit`, and cut so that the sum of
/// `size_of` stays within `max_bytes` (one capture at least).
pub async fn list(
    reader: &CatalogReader,
    catalogs: &[String],
    query: &ListQuery,
    max_bytes: usize,
    size_of: impl Fn(&FleetCapture) -> usize,
) -> Result<FleetPage, CatalogError> {
    let invalid = |message: String| CatalogError::new(ErrorKind::DefinitelyFailed, message);
    let mut positions: BTreeMap<String, Position> = match &query.cursor {
        Some(cursor) => {
            let positions = decode_cursor(cursor).map_err(invalid)?;
            if !positions.keys().eq(catalogs.iter().collect::<std::collections::BTreeSet<_>>()) {
                return Err(invalid(format!(
                    "the cursor is of a listing of the catalogs {:?}, not of {catalogs:?}",
                    positions.keys().collect::<Vec<_>>()
                )));
            }
            positions
        }
        None => catalogs.iter().map(|catalog| (catalog.clone(), Position::Start(0))).collect(),
    };

    // Every catalog still going reads one page: as many captures as the whole page may hold.
    let reads = positions.iter().filter(|(_, position)| **position != Position::Done).map(|(catalog, position)| {
        let mut catalog_query = ListQuery { cursor: None, watermark: None, ..query.clone() };
        match position {
            Position::Start(watermark) if query.cursor.is_some() => catalog_query.watermark = Some(*watermark),
            Position::Start(_) => {}
            Position::At(cursor) => catalog_query.cursor = Some(cursor.clone()),
            Position::Done => unreachable!("filtered out"),
        }
        let catalog_reader = reader.for_catalog(catalog);
        async move { catalog_reader.list(&catalog_query).await.map(|page| (catalog.clone(), page)) }
    });
    let pages: Vec<(String, Page)> = futures::future::try_join_all(reads).await?;

    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (page_index, (_, page)) in pages.iter().enumerate() {
        merged.extend((0..page.captures.len()).map(|capture_index| (page_index, capture_index)));
    }
    let order = |&(page, capture): &(usize, usize)| {
        let capture = &pages[page].1.captures[capture];
        (capture.captured_at_ns, capture.capture_id.clone())
    };
    merged.sort_by_key(order);
    // A catalog with more to come has shown everything up to its frontier only: nothing after the nearest frontier
    // may be shown yet, or a capture of that catalog would come out of order on the next page.
    if let Some(frontier) = pages.iter().filter_map(|(_, page)| page.frontier()).min() {
        merged.retain(|position| order(position) <= frontier);
    }
    merged.truncate(query.limit.clamp(1, 100_000) as usize);
    let mut captures: Vec<FleetCapture> = merged
        .iter()
        .map(|&(page, capture)| FleetCapture {
            catalog: pages[page].0.clone(),
            capture: pages[page].1.captures[capture].clone(),
        })
        .collect();
    let keep = super::query::keep_within(captures.iter().map(&size_of), max_bytes);
    captures.truncate(keep);
    merged.truncate(keep);

    let mut watermarks = BTreeMap::new();
    for (page_index, (catalog, page)) in pages.iter().enumerate() {
        watermarks.insert(catalog.clone(), page.watermark);
        let shown = merged.iter().filter(|(page, _)| *page == page_index).count();
        let next = if page.captures.is_empty() {
            // Nothing visible up to its next cursor (or at all): on from there.
            page.next_cursor.clone().map_or(Position::Done, Position::At)
        } else if shown == 0 {
            // Nothing of it on this page: it starts again where it was, at the same watermark.
            match positions.get(catalog) {
                Some(Position::At(cursor)) => Position::At(cursor.clone()),
                _ => Position::Start(page.watermark),
            }
        } else {
            match page.resume_after(shown) {
                Some(cursor) => Position::At(cursor),
                None => Position::Done,
            }
        };
        positions.insert(catalog.clone(), next);
    }
    let next_cursor = positions.values().any(|position| *position != Position::Done).then(|| encode_cursor(&positions));
    Ok(FleetPage { captures, next_cursor, watermarks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_what_they_did_not_write() {
        let positions: BTreeMap<String, Position> = [
            ("edge-7".to_string(), Position::At("12.1700000000.0192d3a4-0000-7000-8000-000000000001.64".to_string())),
            ("edge.8".to_string(), Position::Start(40)),
            ("edge_9".to_string(), Position::Done),
        ]
        .into_iter()
        .collect();
        let text = encode_cursor(&positions);
        assert!(text.starts_with(CURSOR_PREFIX) && text.chars().all(|c| c.is_ascii_alphanumeric()), "{text}");
        assert_eq!(decode_cursor(&text).unwrap(), positions);
        for bad in [
            "12.1.0192d3a4-0000-7000-8000-000000000001.1".to_string(),
            "fzz".to_string(),
            format!("{CURSOR_PREFIX}{}", hex::encode("a b=done")),
            format!("{CURSOR_PREFIX}{}", hex::encode("a=at:nonsense")),
            format!("{CURSOR_PREFIX}{}", hex::encode("a=start:x")),
            format!("{CURSOR_PREFIX}{}", hex::encode("a=later")),
        ] {
            assert!(validate_cursor(&bad).is_err(), "{bad}");
        }
    }
}
