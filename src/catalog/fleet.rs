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
    /// The watermark each catalog still being read is read at (the one of its first page).
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

/// The most catalogs one listing reads: each page reads a page of every one of them.
pub const MAX_CATALOGS: usize = 256;
// What a reader keeps of each catalog serves every catalog of a listing, beside the reader's own.
const _: () = assert!(super::query::KNOWN_CATALOGS_KEPT > MAX_CATALOGS);
/// Catalog pages read at once for one page of a listing.
const CONCURRENT_READS: usize = 4;

/// What a fleet cursor starts with, so it is never taken for a single catalog's (which starts with a digit). The
/// text is URL-safe as it is: `~` and `:` are in neither catalog names nor a catalog's cursor.
const CURSOR_PREFIX: &str = "f~";

fn encode_cursor(positions: &BTreeMap<String, Position>) -> String {
    let entries: Vec<String> = positions
        .iter()
        .map(|(catalog, position)| match position {
            Position::Start(watermark) => format!("{catalog}:start:{watermark}"),
            Position::At(cursor) => format!("{catalog}:at:{cursor}"),
            Position::Done => format!("{catalog}:done"),
        })
        .collect();
    format!("{CURSOR_PREFIX}{}", entries.join("~"))
}

fn decode_cursor(text: &str) -> Result<BTreeMap<String, Position>, String> {
    let bad = || format!("invalid cursor {text:?}: not one of a listing across catalogs");
    let entries = text.strip_prefix(CURSOR_PREFIX).ok_or_else(bad)?;
    let mut positions = BTreeMap::new();
    for entry in entries.split('~') {
        let (catalog, position) = entry.split_once(':').ok_or_else(bad)?;
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
        if positions.insert(catalog.to_string(), position).is_some() {
            return Err(bad());
        }
    }
    if positions.len() > MAX_CATALOGS {
        return Err(format!("invalid cursor: more than {MAX_CATALOGS} catalogs"));
    }
    Ok(positions)
}

/// Check a fleet cursor's syntax without a round trip.
pub fn validate_cursor(text: &str) -> Result<(), String> {
    decode_cursor(text).map(|_| ())
}

/// The catalogs a fleet cursor lists (the selection of its first page).
pub fn cursor_catalogs(text: &str) -> Result<Vec<String>, String> {
    decode_cursor(text).map(|positions| positions.into_keys().collect())
}

/// Why a selection of catalogs cannot be listed ([`check_selection`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    #[error("at most {MAX_CATALOGS} catalogs in one listing, not {0}: name them with catalog=")]
    TooMany(usize),
    #[error("{0}")]
    Cursor(String),
}

/// Check that `catalogs` is a selection a listing can take, and that `cursor` (if any) belongs to it.
pub fn check_selection(catalogs: &[String], cursor: Option<&str>) -> Result<(), SelectionError> {
    let selected: std::collections::BTreeSet<&String> = catalogs.iter().collect();
    if selected.len() > MAX_CATALOGS {
        return Err(SelectionError::TooMany(selected.len()));
    }
    if let Some(cursor) = cursor {
        let positions = decode_cursor(cursor).map_err(SelectionError::Cursor)?;
        if !positions.keys().eq(selected.iter().copied()) {
            return Err(SelectionError::Cursor(format!(
                "the cursor is of a listing of the catalogs {:?}, not of {:?}",
                positions.keys().collect::<Vec<_>>(),
                selected
            )));
        }
    }
    Ok(())
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
    check_selection(catalogs, query.cursor.as_deref()).map_err(|error| invalid(error.to_string()))?;
    let mut positions: BTreeMap<String, Position> = match &query.cursor {
        Some(cursor) => decode_cursor(cursor).map_err(invalid)?,
        None => catalogs.iter().map(|catalog| (catalog.clone(), Position::Start(0))).collect(),
    };

    // Every catalog still going reads one page: as many captures as the whole page may hold.
    let mut reads = Vec::new();
    for (catalog, position) in &positions {
        let mut catalog_query = ListQuery { cursor: None, watermark: None, ..query.clone() };
        match position {
            Position::Done => continue,
            Position::Start(watermark) if query.cursor.is_some() => catalog_query.watermark = Some(*watermark),
            Position::Start(_) => {}
            Position::At(cursor) => catalog_query.cursor = Some(cursor.clone()),
        }
        let (catalog_reader, catalog) = (reader.for_catalog(catalog), catalog.clone());
        reads.push(async move { catalog_reader.list(&catalog_query).await.map(|page| (catalog, page)) });
    }
    use futures::{StreamExt, TryStreamExt};
    let pages: Vec<(String, Page)> = futures::stream::iter(reads).buffered(CONCURRENT_READS).try_collect().await?;

    let (captures, watermarks) =
        merge(&pages, &mut positions, query.limit.clamp(1, 100_000) as usize, max_bytes, size_of);
    let next_cursor = positions.values().any(|position| *position != Position::Done).then(|| encode_cursor(&positions));
    Ok(FleetPage { captures, next_cursor, watermarks })
}

/// One page of the listing from one page of each catalog still going: at most `limit` captures in (captured_at_ns,
/// capture_id) order, none past the nearest frontier, within `max_bytes`; `positions` become where each catalog goes
/// on. Returns the captures and the watermark of each catalog read.
fn merge(
    pages: &[(String, Page)],
    positions: &mut BTreeMap<String, Position>,
    limit: usize,
    max_bytes: usize,
    size_of: impl Fn(&FleetCapture) -> usize,
) -> (Vec<FleetCapture>, BTreeMap<String, u64>) {
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
    merged.truncate(limit);
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
    (captures, watermarks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture(at: u64, id: u128) -> CaptureLocation {
        CaptureLocation {
            capture_id: uuid::Uuid::from_u128(id).to_string(),
            stream: "s".into(),
            captured_at_ns: at,
            pack_id: "p".into(),
            object_key: "k".into(),
            record_offset: 0,
            record_len: 0,
            payload_offset: 0,
            payload_len: 0,
            crc32c: 0,
            label_keys: vec![],
            label_values: vec![],
            content_type: String::new(),
            version: 1,
        }
    }

    fn shown(captures: &[FleetCapture]) -> Vec<(String, u64)> {
        captures.iter().map(|c| (c.catalog.clone(), c.capture.captured_at_ns)).collect()
    }

    fn starts(names: &[&str]) -> BTreeMap<String, Position> {
        names.iter().map(|name| (name.to_string(), Position::Start(0))).collect()
    }

    #[test]
    fn nothing_past_the_nearest_frontier_is_shown_and_each_catalog_goes_on_after_what_it_showed() {
        // a's page was shortened (superseded candidates up to t=50 dropped): it has more after t=50.
        let a = Page::for_test(vec![capture(20, 1), capture(40, 2)], Some((50, uuid::Uuid::from_u128(3))), 7);
        let b = Page::for_test(vec![capture(10, 4), capture(60, 5), capture(70, 6)], None, 9);
        let pages = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
        let mut positions = starts(&["a", "b"]);
        let (captures, watermarks) = merge(&pages, &mut positions, 5, usize::MAX, |_| 1);
        assert_eq!(shown(&captures), [("b".into(), 10), ("a".into(), 20), ("a".into(), 40)]);
        assert_eq!(watermarks, BTreeMap::from([("a".to_string(), 7), ("b".to_string(), 9)]));
        assert_eq!(positions["a"], Position::At(a.next_cursor.clone().unwrap()), "a goes on after its frontier");
        assert_eq!(positions["b"], Position::At(b.resume_after(1).unwrap()), "b goes on after t=10");
    }

    #[test]
    fn a_catalog_with_nothing_visible_moves_on_and_one_cut_off_keeps_its_place() {
        // a: every candidate up to t=30 superseded; b: cut off by the byte bound after one capture.
        let a = Page::for_test(vec![], Some((30, uuid::Uuid::from_u128(9))), 3);
        let b = Page::for_test(vec![capture(5, 1), capture(6, 2)], None, 4);
        let c = Page::for_test(vec![capture(7, 3)], None, 5);
        let pages = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone()), ("c".to_string(), c)];
        let mut positions = starts(&["a", "b", "c"]);
        let (captures, _) = merge(&pages, &mut positions, 10, 1, |_| 1);
        assert_eq!(shown(&captures), [("b".into(), 5)]);
        assert_eq!(positions["a"], Position::At(a.next_cursor.clone().unwrap()));
        assert_eq!(positions["b"], Position::At(b.resume_after(1).unwrap()));
        assert_eq!(positions["c"], Position::Start(5), "c starts again, at the watermark it was read at");

        // Everything shown: every catalog is done.
        let pages = vec![("b".to_string(), Page::for_test(vec![capture(8, 5)], None, 4))];
        let mut positions = starts(&["b"]);
        let (captures, _) = merge(&pages, &mut positions, 10, usize::MAX, |_| 1);
        assert_eq!(captures.len(), 1);
        assert_eq!(positions["b"], Position::Done);
    }

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
        // URL-safe as it is (RFC 3986 unreserved characters and ':').
        assert!(text.chars().all(|c| c.is_ascii_alphanumeric() || "-._~:".contains(c)), "{text}");
        assert_eq!(decode_cursor(&text).unwrap(), positions);
        assert_eq!(cursor_catalogs(&text).unwrap(), ["edge-7", "edge.8", "edge_9"]);
        for bad in [
            "12.1.0192d3a4-0000-7000-8000-000000000001.1",
            "f~",
            "f~a b:done",
            "f~a:at:nonsense",
            "f~a:start:x",
            "f~a:later",
            "f~a:done~a:done",
        ] {
            assert!(validate_cursor(bad).is_err(), "{bad}");
        }
        let names = |list: &[&str]| list.iter().map(|name| name.to_string()).collect::<Vec<_>>();
        assert!(check_selection(&names(&["edge_9", "edge-7", "edge.8"]), Some(&text)).is_ok());
        let foreign = check_selection(&names(&["edge-7", "edge.8"]), Some(&text)).unwrap_err();
        assert!(
            matches!(&foreign, SelectionError::Cursor(message) if message.contains("the cursor is of")),
            "{foreign}"
        );
        let many: Vec<String> = (0..=MAX_CATALOGS).map(|n| format!("c{n}")).collect();
        assert_eq!(check_selection(&many, None), Err(SelectionError::TooMany(MAX_CATALOGS + 1)));
    }
}
