//! Catalog reads with a pinned watermark, and garbage collection.
//!
//! A reader pins W = the highest committed version and sees a capture row only if its `(version, publish_id)` is in
//! `publishes` at or below W. A capture_id published more than once (a producer retry, or a re-post into another
//! stream: the newest version replaces the capture) is shown once, at its latest visible version, by every read:
//! `get`, and `list` (a stream's listing leaves out a capture whose newest version is elsewhere). `tail` is the log
//! of publishes and shows each version. A deletion is a row of its own at the version of the delete (a tombstone:
//! the capture's last row with an empty `pack_id`, see [`CaptureLocation::is_deletion`]), written to `by_version`
//! and `by_id` only, never to `captures`: there it would share the deleted row's sort key and replace it on a merge,
//! committed or not. Being the newest version, it hides the capture from every read pinned at or above it (`list`
//! meets it as a newer version of the id, as it meets a re-post into another stream), a reader pinned below it still
//! sees the capture, and `tail`, the log, shows it as a deletion entry at its version. A later post of the same id is
//! newer still and makes the capture visible again. Once no reader may be pinned below the deletion any more, the
//! rows it hides are removed and only the tombstone stays (see [`super::purge`]).
//!
//! A *retention horizon* (see [`super::publish::Publisher::publish_horizon`]) is a publish of its own that removes
//! every capture captured before its time at once: a reader pinned at or above its version sees none of them (a listing
//! starts at the horizon, `get` and multi-get answer "not found"), a reader pinned below it still does, and `tail`
//! shows it as an entry of its own (`expired_before_ns`) at its version, and a capture captured before it that is
//! published after it (a producer's late arrival, gone as it comes) as a deletion at its own version. Once no reader
//! may be pinned below it, the months below it are dropped from the tables (see [`super::purge`]). Horizons are few
//! (one per retention step), so a read fetches them with one primary-key read of `horizons`; whether each row's
//! publish is committed is asked of `publishes` once per reader and row, and kept ([`HorizonVerdicts`]).
//!
//! A reader's state (shared by its clones; the HTTP API keeps one for the daemon's life, and the readers of other
//! catalogs [`CatalogReader::for_catalog`] makes share it per catalog) is what it has learnt and may keep: whether
//! `by_time` is kept (once kept, it stays), whether the page setup must be read apart (tables older than schema 6), the
//! horizon verdicts (final, see [`HorizonVerdicts`]), and the last density sample of each listing, used again for
//! [`DENSITY_SAMPLE_REUSE`] (it only sizes a first window). Nothing it keeps decides what a read returns except the
//! verdicts, and those cannot change.
//!
//! A *move* (a compaction's switch-over, see [`super::publish::Publisher::publish_relocation`]) is likewise a row of
//! `by_version` and `by_id` only: the same capture (stream, time, labels, record) at a new place, in a publish of no
//! pack (`packs = 0`). `get` and multi-get return it as the newest row; `list` finds the capture's row in `captures`
//! and shows the move in its place ([`CatalogReader::newest_of`]); `tail` and exports by version skip it (it changes
//! where the bytes are, not what the catalog holds; see `LOG_ROW`).
//!
//! Reads never use `FINAL` and never rely on merges: duplicates from unmerged parts or a repeated copy collapse in the
//! query (`LIMIT 1 BY` after a sort by version, `argMax` by version, `max`), so what a read returns depends only on
//! committed rows.
//!
//! Listing pages through `(captured_at_ns, capture_id)` order with an opaque cursor that also pins W, so a listing
//! taken across many pages is one consistent snapshot.
//!
//! What each read costs (N = captures of the catalog, P = its publishes):
//! - the watermark: `max(version)` over the publishes at or above the `watermark` table's lower bound, O(1);
//! - `get`: one statement, beside the horizons: the versions holding the id (`by_id`), checked against `publishes` at
//!   exactly those versions, and the newest one's row from `by_version` at those versions: primary-key lookups,
//!   O(versions of the id);
//! - `captures_of_version`: `by_version` at one version, O(captures of that version); `tail_page`: the publishes
//!   after a position and one `by_version` range up to the version the page reaches, O(page) (a catching-up tail
//!   plans a few pages from one read of `publishes` and reads them at once, in `super::tail`);
//! - `list`: a setup statement on a first page (the watermark, the time bounds, the rows of `horizons`, and the
//!   density sample, taken at most once a minute by a reader; a later page has what its first window needs in its
//!   cursor, and reads the horizons beside that window, the setup only if it falls short; a first page of a short
//!   range with both ends reads the watermark and counts the range's rows instead, and then the range in one window
//!   (none if it counted no row), see [`CatalogReader::short_range_span`]; beside the first window, a reader checks
//!   the horizon rows it has no verdict on, and reads again should one presumed committed not be), then time
//!   windows of `captures` (across streams: of `by_time` where the server keeps it, see [`CatalogReader::list`]),
//!   each a primary-key range, visibility against the publishes at the versions of the window's rows, and beside
//!   each window, in parallel, a `by_id` lookup for the ids of the window's first rows (about the page's); the ids
//!   with a newer row (a re-post, a deletion, or a compaction's move: after compaction that is most ids) have their
//!   newest row read from `by_version` at its version (a candidate past the rows looked up is looked up after the
//!   window): about O(page) per page, one round trip for a later page whose first window fills it, one more once
//!   compacted. Every read is bounded by `catalog.read_max_memory` and the request timeout.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use uuid::Uuid;

use super::client::{sql_string_literal, sql_uuid_num, CatalogClient, CatalogError, ErrorKind};
use super::schema::{Tables, LABEL_PAIRS};

/// Where a published capture is and what it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, clickhouse::Row, serde::Deserialize)]
pub struct CaptureLocation {
    pub capture_id: String,
    pub stream: String,
    pub captured_at_ns: u64,
    pub pack_id: String,
    pub object_key: String,
    pub record_offset: u64,
    pub record_len: u64,
    pub payload_offset: u64,
    pub payload_len: u64,
    pub crc32c: u32,
    pub label_keys: Vec<String>,
    pub label_values: Vec<String>,
    pub content_type: String,
    pub version: u64,
}

/// The `pack_id` of a deletion row (a tombstone): the capture's last place, marked gone from its version on.
pub const DELETED_PACK_ID: &str = "";

impl CaptureLocation {
    /// True for a deletion (a tombstone row): the capture is gone from this version on, until it is posted again.
    pub fn is_deletion(&self) -> bool {
        self.pack_id == DELETED_PACK_ID
    }

    pub fn labels_map(&self) -> BTreeMap<String, String> {
        self.label_keys.iter().cloned().zip(self.label_values.iter().cloned()).collect()
    }

    /// The capture as an entry of the log of publishes: a line of `capstore tail`, an entry of `GET /v1/tail`.
    pub fn tail_entry(&self) -> TailEntry<'_> {
        if self.is_deletion() {
            return TailEntry::Deletion {
                capture_id: &self.capture_id,
                captured_at_ns: self.captured_at_ns,
                deleted: true,
                stream: &self.stream,
                version: self.version,
            };
        }
        TailEntry::Capture {
            capture_id: &self.capture_id,
            captured_at_ns: self.captured_at_ns,
            content_type: &self.content_type,
            labels: Labels { keys: &self.label_keys, values: &self.label_values },
            size: self.payload_len,
            stream: &self.stream,
            version: self.version,
        }
    }
}

/// An entry of the log of publishes, serialized straight from the row it is about: a catching-up `capstore tail`
/// prints a million of them a second, and a `serde_json::Value` per line cost most of that in allocation. The fields
/// are declared in alphabetical order, the order the log has always been written in (that of a JSON object built
/// as a `serde_json::Value`).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum TailEntry<'a> {
    /// A capture published at `version`.
    Capture {
        capture_id: &'a str,
        captured_at_ns: u64,
        content_type: &'a str,
        labels: Labels<'a>,
        size: u64,
        stream: &'a str,
        version: u64,
    },
    /// A capture gone from `version` on (deleted, or captured before a horizon and published after it).
    Deletion { capture_id: &'a str, captured_at_ns: u64, deleted: bool, stream: &'a str, version: u64 },
    /// A retention horizon: every capture captured before `expired_before_ns` is gone from `version` on.
    Horizon { expired_before_ns: u64, version: u64 },
}

impl std::fmt::Display for TailEntry<'_> {
    /// One line of JSON.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = serde_json::to_string(self).map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}

/// A capture's labels as a JSON object, keys in order, a repeated key once with its last value (as a map of them
/// would have it); written without building the map when the keys are in order already, as stored labels are.
#[derive(Debug)]
pub struct Labels<'a> {
    keys: &'a [String],
    values: &'a [String],
}

impl Serialize for Labels<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.keys.windows(2).all(|pair| pair[0] < pair[1]) {
            return serializer.collect_map(self.keys.iter().zip(self.values));
        }
        let sorted: BTreeMap<&String, &String> = self.keys.iter().zip(self.values).collect();
        serializer.collect_map(sorted)
    }
}

/// One committed publish.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, clickhouse::Row, serde::Deserialize)]
pub struct PublishRecord {
    pub version: u64,
    pub publish_id: String,
    pub holder: String,
    pub lease_term: u64,
    pub packs: u64,
    pub captures: u64,
    pub published_at_ms: u64,
}

/// One committed pack of the catalog's inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, clickhouse::Row, serde::Deserialize)]
pub struct PackRecord {
    pub pack_id: String,
    pub object_key: String,
    pub bytes: u64,
    pub sha256: String,
    pub records: u64,
    pub version: u64,
}

/// A committed pack as compaction plans with it.
#[derive(Debug, Clone, PartialEq, Eq, clickhouse::Row, serde::Deserialize)]
pub struct PackBrief {
    pub pack_id: String,
    pub object_key: String,
    pub bytes: u64,
    pub records: u64,
    pub first_captured_at_ns: u64,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct PackBriefRow {
    pack_id: String,
    object_key_v: String,
    bytes_v: u64,
    records_v: u64,
    first_v: u64,
}

impl From<PackBriefRow> for PackBrief {
    fn from(row: PackBriefRow) -> PackBrief {
        PackBrief {
            pack_id: row.pack_id,
            object_key: row.object_key_v,
            bytes: row.bytes_v,
            records: row.records_v,
            first_captured_at_ns: row.first_v,
        }
    }
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct IdRow {
    capture_id: String,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct ObjectKeyRow {
    object_key: String,
}

#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub stream: Option<String>,
    /// Inclusive lower bound of captured_at_ns.
    pub since_ns: Option<u64>,
    /// Exclusive upper bound of captured_at_ns.
    pub until_ns: Option<u64>,
    pub labels: BTreeMap<String, String>,
    pub limit: u64,
    /// From a previous page's `next_cursor`.
    pub cursor: Option<String>,
    /// Read at this watermark rather than the current one, when there is no cursor (which pins its own): so that
    /// two passes over one selection see the same captures.
    pub watermark: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub captures: Vec<CaptureLocation>,
    /// Present when more may follow.
    pub next_cursor: Option<String>,
    pub watermark: u64,
    /// The time window the next page starts with (carried in its cursor).
    #[serde(skip)]
    window_ns: u64,
    /// The time window this page started with.
    #[serde(skip)]
    first_window_ns: u64,
}

impl Page {
    /// The last page of a listing that read no window: it has no rows at all.
    fn empty(watermark: u64) -> Page {
        Page { captures: Vec::new(), next_cursor: None, watermark, window_ns: 0, first_window_ns: 0 }
    }

    /// The time window the next page starts with: [`NEXT_WINDOW_PAGES`] times the time this page's rows took.
    pub fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// The time window this page started with: its cursor's, or on a first page the one its setup sized.
    pub fn first_window_ns(&self) -> u64 {
        self.first_window_ns
    }

    /// The page cut after the last capture that keeps its JSON within about `max_bytes` (one capture at least), with
    /// the cursor of that capture, so the next page goes on right after it. Labels can make rows large: this bounds a
    /// response's size whatever its `limit`.
    pub fn cut_to_bytes(self, max_bytes: usize) -> Page {
        self.cut_by(max_bytes, |capture| serde_json::to_vec(capture).map_or(0, |row| row.len()) + 1)
    }

    /// The page cut after the last capture that keeps the sum of `size_of` within `max_bytes` (one capture at
    /// least), with the cursor of that capture.
    pub fn cut_by(mut self, max_bytes: usize, size_of: impl Fn(&CaptureLocation) -> usize) -> Page {
        let keep = keep_within(self.captures.iter().map(size_of), max_bytes);
        if keep < self.captures.len() {
            self.next_cursor = self.resume_after(keep);
            self.captures.truncate(keep);
        }
        self
    }

    /// A page as [`CatalogReader::list`] would answer it, its next cursor right after `frontier`.
    #[cfg(test)]
    pub(crate) fn for_test(captures: Vec<CaptureLocation>, frontier: Option<(u64, Uuid)>, watermark: u64) -> Page {
        let next_cursor = frontier.map(|(captured_at_ns, capture_id)| {
            Cursor { watermark, captured_at_ns, capture_id, window_ns: 1 }.encode()
        });
        Page { captures, next_cursor, watermark, window_ns: 1, first_window_ns: 1 }
    }

    /// Where the next page starts, as (captured_at_ns, capture_id): every capture of the selection at or before it
    /// is on this page or superseded. `None` on the last page.
    pub fn frontier(&self) -> Option<(u64, String)> {
        let cursor = Cursor::decode(self.next_cursor.as_deref()?).ok()?;
        Some((cursor.captured_at_ns, cursor.capture_id.to_string()))
    }

    /// The cursor of the page that goes on after the first `kept` captures of this one (at least one): this page's
    /// own next cursor when all are kept.
    pub fn resume_after(&self, kept: usize) -> Option<String> {
        assert!(kept >= 1, "a page resumes after one capture at least");
        match self.captures.get(kept - 1) {
            Some(last) if kept < self.captures.len() => {
                Some(Cursor::after(self.watermark, last, self.window_ns).encode())
            }
            _ => self.next_cursor.clone(),
        }
    }
}

/// Check a cursor's syntax without a round trip, so a caller can reject a bad one as a usage error.
pub fn validate_cursor(text: &str) -> Result<(), String> {
    Cursor::decode(text).map(|_| ()).map_err(|error| error.message)
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct VersionRow {
    version: u64,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct BoundedMax {
    max_version: u64,
    rows: u64,
}

/// A stream and the time range its rows span ([`CatalogReader::streams`]).
#[derive(Debug, Clone, PartialEq, Eq, clickhouse::Row, serde::Deserialize)]
pub struct StreamBounds {
    pub stream: String,
    pub first_ns: u64,
    pub last_ns: u64,
}

/// What a page reads before its first window ([`CatalogReader::page_setup`]).
struct PageSetup {
    watermark: u64,
    /// The first and the last captured_at_ns of the rows the listing is of (see [`CatalogReader::time_bounds`]);
    /// None when there are none.
    bounds_opt: Option<(u64, u64)>,
    /// The horizons up to the watermark, known committed or, where [`PageSetup::horizons_unsure`], presumed so.
    horizons: Horizons,
    /// Whether a row of `horizons` up to the watermark has no verdict yet. It is then presumed committed (a row at
    /// or below the watermark is a horizon's commit but for an orphan of a failed publish), so that a page's setup
    /// never waits for a check of `publishes`: the first window reads the horizons beside it, as a later page does,
    /// checking the row, and the page is read again should the presumption be wrong ([`CatalogReader::list`]).
    horizons_unsure: bool,
    /// The rows of `horizons` the setup read (for that check).
    horizon_rows: Vec<HorizonRow>,
    /// Whether `by_time` is marked kept (read only when the listing may read it and it was not known kept).
    time_table_marked: bool,
    /// The rows a first page's window is sized by ([`CatalogReader::density_sample_sql`]): None on later pages,
    /// and where the count would not be of the listing's rows.
    sampled_rows_opt: Option<u64>,
}

/// Where a page reads its windows ([`CatalogReader::list`]): from `start` to `end`, the first `window` wide.
struct PageSpan<'a> {
    watermark: u64,
    /// `captures` or `by_time` ([`CatalogReader::listing_table`]).
    table: &'a str,
    start: u64,
    /// Exclusive: the end of the range asked for and, once `end_known`, of the rows the listing is of.
    end: u64,
    end_known: bool,
    window: u64,
}

/// What [`CatalogReader::short_range_span`] found.
enum ShortRange<'a> {
    /// The range is short: its first page reads it in this one window.
    Span(PageSpan<'a>),
    /// The range holds no row at all, committed or not: its page is empty, at this watermark.
    Empty { watermark: u64 },
    /// The range holds more than a first window: the page is read from its setup, at this watermark.
    Longer { watermark: u64 },
    /// Not a range this applies to: the page is read from its setup.
    NotBounded,
}

/// The time a stream's density sample counts rows in ([`CatalogReader::density_sample_sql`]), from the bounds
/// `time_bounds` gives: its last `(last - first + 1) / DENSITY_SAMPLE_FRACTION` ns and its last instant.
fn density_sample_span(first_ns: u64, last_ns: u64) -> u64 {
    (last_ns.saturating_add(1).saturating_sub(first_ns) / DENSITY_SAMPLE_FRACTION).saturating_add(1)
}

/// The rows of a density sample ([`CatalogReader::density_sample_sql`]), unless something made them not the
/// listing's (partitions of `captures` not by month, whose rows would not be the catalog's).
fn sampled_rows(rows: u64, not_the_listings: u64) -> Option<u64> {
    (not_the_listings == 0).then_some(rows)
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct TimeBounds {
    first_ns: u64,
    last_ns: u64,
    rows: u64,
}

/// The first window of a listing without a cursor is this fraction of the time a whole listing of its stream (or
/// catalog) covers, from its first capture (or the retention horizon) to its last: 1/64 for one stream, 1/1024
/// across streams (about a hundred times denser in the catalogs this is tuned on), or the range asked for when that
/// is shorter; then windows grow by [`WINDOW_GROWTH`] until the page is full (see [`CatalogReader::list`]). Each
/// window is a query of a few ms however few rows it holds, so the growth is steep: a page that starts far too narrow
/// (a sparse stream) costs a handful of queries, and one that fills at once reads at most that factor more rows than
/// it needed. The first window's time does not depend on the range asked for, so a `--since`/`--until` range takes
/// no bigger a bite of the stream than a whole listing's first page does (both trust the stream's first and last
/// time: a capture with a far-off time, from a bad clock, widens the first window of both).
const FIRST_WINDOW_FRACTION_ONE_STREAM: u64 = 64;
const FIRST_WINDOW_FRACTION_ALL_STREAMS: u64 = 1024;
/// A first page knows roughly how dense the rows it lists are: across streams, the catalog's rows over its whole
/// span (its month partitions' rows in `system.parts`, duplicates and rows below the horizon included); in one stream,
/// the stream's rows in the last [`DENSITY_SAMPLE_FRACTION`] of its span. Its first window is then at most what
/// holds this many pages at that density, so that it reads about the page, not 1/1024 of the catalog (10k rows at
/// 10M captures, 100k at 100M) or 1/64 of the stream (16k rows of a stream of 1M); a label filter's, at least
/// [`LABEL_FIRST_WINDOW_PAGES`].
const FIRST_WINDOW_PAGES: u64 = 4;
/// The part of a stream's span, at its end, whose rows a first page of the stream counts ([`FIRST_WINDOW_PAGES`]):
/// a count of one key column over a primary-key range, a sixteenth of the rows of the window it sizes. (The end,
/// since a retention horizon moves its start.)
const DENSITY_SAMPLE_FRACTION: u64 = 1024;
/// The fewest pages of rows, at the sampled density, a label filter's first window holds (up to what the window
/// after a fraction's would hold): a label on one capture in this many, or more often, fills a page from its first
/// window. The matches of a label are fewer than the rows by
/// a factor nothing here knows, so its window is not narrowed to [`FIRST_WINDOW_PAGES`] of rows; in one stream it is
/// otherwise the span's fraction, and at 1M captures (100 streams) 1/64 of a stream held about 150 rows, 20 matches of
/// a label on one capture in seven, so a page of 100 took two windows one after the other. Not wider: a window's
/// cost grows with its matches (each is sorted and checked against the publishes), and a granule's worth of rows
/// (8192) there took 41 ms on 18.16, against 45 for the two windows.
const LABEL_FIRST_WINDOW_PAGES: u64 = 16;
const WINDOW_GROWTH: u64 = 8;
/// A later page starts with a window of this many times the time the page before's rows took (its cursor carries
/// it): the density just read, with room for it to thin out, so that a later page is almost always one window (one
/// round trip: a window that falls short costs the read of the end of the rows and a wider window after it), and
/// reads about twice its rows. (It was half the window that filled the page before, which fell short every few pages
/// where the first window held under two pages.)
const NEXT_WINDOW_PAGES: u64 = 2;
/// The rows of a window `by_id` is asked about beside it ([`CatalogReader::newest_versions_of_first_rows`]): the
/// rows the page still needs, a fourth more and 16, for the rows before the page's last that are not its captures
/// (older versions of them, copies from unmerged parts, orphans). A page with more of those than the margin has its
/// last candidates asked about after the window, by id ([`CatalogReader::newest_versions_of`]).
const CHECKED_ROWS_MARGIN_FRACTION: u64 = 4;
const CHECKED_ROWS_MARGIN: u64 = 16;

/// The most captures a page may still need for its windows to count as reads of a few granules
/// ([`CatalogClient::fetch_few`]): a window sized to [`FIRST_WINDOW_PAGES`] of them reads a granule or two of each
/// part it meets, where a label filter does not widen it and the table is ordered by the listing's time (one stream
/// of `captures`, or `by_time`). On 18.16 such a window, of one granule, took 0.3-1.4 ms less on one thread than on
/// the server's two, in five rounds; its check in `by_id`, beside it, took the same either way and keeps the threads.
const FEW_ROWS_PAGE: u64 = 1000;

/// How long a first page's density sample ([`CatalogReader::density_sample_sql`]) is used again by the next first
/// pages of the same stream, or across streams, on one reader (the HTTP API's, a bench's): it only sizes a first
/// window, and a catalog's density changes over hours, not a minute. (About 1.5 ms of a first page's setup on 18.16.)
const DENSITY_SAMPLE_REUSE: Duration = Duration::from_secs(60);

/// The most density samples a reader keeps (of streams sampled within [`DENSITY_SAMPLE_REUSE`]).
const DENSITY_SAMPLES_KEPT: usize = 1024;

#[derive(clickhouse::Row, serde::Deserialize)]
struct NewestVersion {
    id: String,
    newest: u64,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct CommittedVersion {
    version: u64,
    publish_id: String,
}

/// Ids per multi-get statement: each appears three times in it (about 175 characters), well inside the server's
/// max_query_size of 256 KiB.
pub const MULTI_GET_BATCH: usize = 500;
/// Statements of [`MULTI_GET_BATCH`] ids a read of many ids runs at once (a multi-get, a page's candidates checked
/// after its window): a page of 10,000 is 20 batches.
const CONCURRENT_BATCHES: usize = 4;

/// The rows of `by_version` that are entries of the log of publishes (`tail`, exports by version): committed, and
/// not a move. A publish of packs (`packs > 0`) holds captures (`pack_id` set); a publish of none holds deletions
/// (`pack_id` empty), which are entries, or moves (a compaction's, `pack_id` set), which are not: a move changes
/// where a capture's bytes are, not what the catalog holds. So a row is an entry when its committed publish's
/// `packs > 0` equals its `pack_id != ''`.
const LOG_ROW: &str = "(version, publish_id, pack_id != '')";
const LOG_PUBLISH: &str = "packs > 0";

/// The columns of [`CaptureLocation`], read from `by_version` (whose rows are whole).
const LOCATION_COLUMNS: &str = "capture_id, stream, captured_at_ns, pack_id, object_key, record_offset, record_len, \
     payload_offset, payload_len, crc32c, label_keys, label_values, content_type, version";

/// Captures per [`CatalogReader::tail_page`], at most.
pub const TAIL_PAGE_MAX: u64 = 100_000;
/// Publishes a tail page reads first (more only when their captures do not fill the page).
const TAIL_PUBLISHES_FIRST: u64 = 1000;

/// A position in the log of publishes: every capture of the versions up to `version` has been read and, when
/// `after_id` is set, those of the next version up to that capture id (tail order within a version is by capture_id,
/// so a position depends only on which distinct ids a version holds, never on how its rows were inserted or merged).
/// Written `<version>` or `<version>:<capture_id>`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TailPosition {
    pub version: u64,
    pub after_id: Option<Uuid>,
}

impl TailPosition {
    /// Right after version `version`.
    pub fn after_version(version: u64) -> TailPosition {
        TailPosition { version, after_id: None }
    }

    /// Right after `capture`, a row of the log.
    fn after(capture: &CaptureLocation) -> TailPosition {
        TailPosition {
            version: capture.version.saturating_sub(1),
            after_id: Some(Uuid::parse_str(&capture.capture_id).unwrap_or_default()),
        }
    }

    pub fn parse(text: &str) -> Result<TailPosition, String> {
        let bad = || format!("{text:?} is not a tail position (a version, or <version>:<capture_id>)");
        let (version, after_id) = match text.split_once(':') {
            Some((version, id)) => (version, Some(Uuid::parse_str(id).map_err(|_| bad())?)),
            None => (text, None),
        };
        Ok(TailPosition { version: version.parse().map_err(|_| bad())?, after_id })
    }
}

impl std::fmt::Display for TailPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.after_id {
            None => write!(f, "{}", self.version),
            Some(id) => write!(f, "{}:{id}", self.version),
        }
    }
}

/// A page of the log as planned ([`CatalogReader::plan_tail`]): up to version `upto`, holding about
/// `counted_captures` (by its publishes' counts: an estimate, see there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailSpan {
    pub upto: u64,
    pub counted_captures: u64,
}

/// One page of the log of publishes ([`CatalogReader::tail_page`]).
#[derive(Debug, Clone)]
pub struct TailPage {
    pub captures: Vec<CaptureLocation>,
    /// The retention horizons published in the versions this page covers: (version, before_ns).
    pub horizons: Vec<(u64, u64)>,
    /// Where this page started.
    pub from: TailPosition,
    /// Where the next page starts.
    pub next: TailPosition,
}

impl TailPage {
    /// The empty page of a tail that has caught up at `position`.
    pub fn caught_up_at(position: TailPosition) -> TailPage {
        TailPage { captures: Vec::new(), horizons: Vec::new(), from: position, next: position }
    }

    /// True when the page holds nothing and the position did not move: nothing is published after it (up to the
    /// page's `through`).
    pub fn caught_up(&self) -> bool {
        self.captures.is_empty() && self.horizons.is_empty() && self.next == self.from
    }

    /// The page's entries of the log in order (by version; within one, by capture id): each capture's
    /// [`CaptureLocation::tail_entry`], each horizon's [`horizon_entry`].
    pub fn entries(&self) -> Vec<TailEntry<'_>> {
        let mut horizons = self.horizons.iter().peekable();
        let mut entries = Vec::with_capacity(self.captures.len() + self.horizons.len());
        for capture in &self.captures {
            while let Some((version, before)) = horizons.next_if(|(version, _)| *version < capture.version) {
                entries.push(horizon_entry(*version, *before));
            }
            entries.push(capture.tail_entry());
        }
        entries.extend(horizons.map(|(version, before)| horizon_entry(*version, *before)));
        entries
    }

    /// The page cut after the last capture that keeps the sum of `size_of` within `max_bytes` (one capture at
    /// least), with the position after it.
    pub fn cut_by(mut self, max_bytes: usize, size_of: impl Fn(&CaptureLocation) -> usize) -> TailPage {
        let keep = keep_within(self.captures.iter().map(size_of), max_bytes);
        if keep < self.captures.len() {
            self.captures.truncate(keep);
            let last = self.captures.last().expect("at least one capture is kept");
            self.next = TailPosition::after(last);
            // Horizons are publishes of no capture: those before the last capture kept are on this page.
            let last_version = last.version;
            self.horizons.retain(|(version, _)| *version < last_version);
        }
        self
    }
}

/// The committed retention horizons of a catalog up to some version, in version order ([`CatalogReader::horizons`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Horizons {
    /// (version, before_ns) of each committed horizon.
    committed: Vec<(u64, u64)>,
}

impl Horizons {
    #[cfg(test)]
    pub(crate) fn for_test(committed: Vec<(u64, u64)>) -> Horizons {
        Horizons { committed }
    }

    /// What a reader pinned at `watermark` no longer sees: every capture captured before this (0: none hidden).
    pub fn before_at(&self, watermark: u64) -> u64 {
        self.committed.iter().filter(|(version, _)| *version <= watermark).map(|(_, before)| *before).max().unwrap_or(0)
    }

    /// Whether `row` is hidden from a reader pinned at `watermark`.
    pub fn hides_at(&self, row: &CaptureLocation, watermark: u64) -> bool {
        row.captured_at_ns < self.before_at(watermark)
    }

    /// `row` as a reader pinned at `watermark` sees it: unchanged, or, captured before a horizon at or below the
    /// watermark, a deletion at the first such horizon's version, or at its own if published later (so that every
    /// read treats it as it treats a deleted capture: not found, and not looked for in the spool either).
    pub fn applied(&self, row: CaptureLocation, watermark: u64) -> CaptureLocation {
        let hidden_at = self
            .committed
            .iter()
            .find(|(version, before)| *version <= watermark && row.captured_at_ns < *before)
            .map(|(version, _)| *version);
        match hidden_at {
            // (A late arrival published after the horizon is gone from its own version on.)
            Some(version) if !row.is_deletion() => {
                CaptureLocation { pack_id: DELETED_PACK_ID.to_string(), version: version.max(row.version), ..row }
            }
            _ => row,
        }
    }

    /// Whether `row`, an entry of the log, is gone as it comes: captured before a horizon published before it.
    pub fn hides_in_log(&self, row: &CaptureLocation) -> bool {
        row.captured_at_ns < self.before_at(row.version.saturating_sub(1))
    }

    /// `row` as an entry of the log: itself, or, gone as it comes ([`Horizons::hides_in_log`]), a deletion at its
    /// own version (a consumer that had an earlier version of the capture learns it is gone; one that had none has
    /// nothing to remove).
    pub fn in_log(&self, row: CaptureLocation) -> CaptureLocation {
        if self.hides_in_log(&row) && !row.is_deletion() {
            return CaptureLocation { pack_id: DELETED_PACK_ID.to_string(), ..row };
        }
        row
    }

    /// The horizons published after `after` up to `through`, as entries of the log: (version, before_ns).
    pub fn published_in(&self, after: u64, through: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.committed.iter().copied().filter(move |(version, _)| *version > after && *version <= through)
    }
}

/// A retention horizon as an entry of the log of publishes (`capstore tail`, `GET /v1/tail`).
pub fn horizon_entry(version: u64, before_ns: u64) -> TailEntry<'static> {
    TailEntry::Horizon { expired_before_ns: before_ns, version }
}

/// A row of `horizons` as written, its publish committed or not (see [`CatalogReader::committed_horizons`]).
#[derive(Debug, clickhouse::Row, serde::Deserialize)]
struct HorizonRow {
    version: u64,
    before_ns: u64,
    publish_id: String,
}

/// Whether the publish of each horizon row a reader has met, by `(version, publish_id)`, is committed: the answers
/// that cannot change, kept so that a horizon is checked against `publishes` once per reader rather than by every
/// read. A committed publish stays committed (`publishes` is never dropped or purged), and a version is committed
/// once (I4), so a row whose version is committed under another publish_id never will be. A row whose version is
/// not committed yet gets no verdict, and is asked about again by the next read.
type HorizonVerdicts = HashMap<(u64, String), bool>;

/// The density samples a reader took of each stream (None: across streams) within [`DENSITY_SAMPLE_REUSE`], at
/// most [`DENSITY_SAMPLES_KEPT`] of them: the streams asked about come from requests, so what is kept is bounded.
#[derive(Debug, Default)]
struct DensitySamples {
    /// The sample of each stream (the rows counted, None where the count is not the listing's), and when it was
    /// taken.
    taken: HashMap<Option<String>, (Instant, Option<u64>)>,
}

impl DensitySamples {
    /// The sample of `stream` taken within [`DENSITY_SAMPLE_REUSE`] before `now`, if any.
    fn fresh(&self, stream: &Option<String>, now: Instant) -> Option<Option<u64>> {
        let (taken, rows) = self.taken.get(stream)?;
        (now.saturating_duration_since(*taken) < DENSITY_SAMPLE_REUSE).then_some(*rows)
    }

    /// Keeps the sample of `stream` taken at `now`, once the stale ones are gone, unless
    /// [`DENSITY_SAMPLES_KEPT`] fresh ones are kept already.
    fn keep(&mut self, stream: &Option<String>, rows: Option<u64>, now: Instant) {
        self.taken.retain(|_, (taken, _)| now.saturating_duration_since(*taken) < DENSITY_SAMPLE_REUSE);
        if self.taken.len() < DENSITY_SAMPLES_KEPT || self.taken.contains_key(stream) {
            self.taken.insert(stream.clone(), (now, rows));
        }
    }
}

fn verdict_of(verdicts: &HorizonVerdicts, row: &HorizonRow) -> Option<bool> {
    verdicts.get(&(row.version, row.publish_id.clone())).copied()
}

/// How many of `sizes`, from the first, add up to at most `max_bytes` (one at least, when there is one): where a
/// page is cut so that it stays within a byte budget.
pub fn keep_within(sizes: impl IntoIterator<Item = usize>, max_bytes: usize) -> usize {
    let mut total = 0;
    let mut keep = 0;
    for size in sizes {
        if keep > 0 && total + size > max_bytes {
            break;
        }
        total += size;
        keep += 1;
    }
    keep
}

/// Position after the last row of a page, with the pinned watermark and the time window the next page starts with:
/// `<W>.<captured_at_ns>.<capture_id>.<window_ns>` (a cursor of three parts, from an older build, starts afresh).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cursor {
    watermark: u64,
    captured_at_ns: u64,
    capture_id: Uuid,
    window_ns: u64,
}

impl Cursor {
    /// The position right after `capture`.
    fn after(watermark: u64, capture: &CaptureLocation, window_ns: u64) -> Cursor {
        Cursor {
            watermark,
            captured_at_ns: capture.captured_at_ns,
            capture_id: Uuid::parse_str(&capture.capture_id).unwrap_or_default(),
            window_ns,
        }
    }

    fn encode(&self) -> String {
        format!("{}.{}.{}.{}", self.watermark, self.captured_at_ns, self.capture_id, self.window_ns)
    }

    fn decode(text: &str) -> Result<Cursor, CatalogError> {
        let bad = || CatalogError::new(ErrorKind::DefinitelyFailed, format!("invalid cursor {text:?}"));
        let mut parts = text.splitn(4, '.');
        let watermark = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let captured_at_ns = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let capture_id = parts.next().and_then(|p| Uuid::parse_str(p).ok()).ok_or_else(bad)?;
        let window_ns = match parts.next() {
            None => 0,
            Some(part) => part.parse().map_err(|_| bad())?,
        };
        Ok(Cursor { watermark, captured_at_ns, capture_id, window_ns })
    }
}

/// A window's captures (`conditions`, visibility included), each as its newest visible row, in listing order:
/// those after the cursor's position (`after_cursor`, a condition on the newest rows; None on a first page), at most
/// `limit`. Each capture's newest row is found by sorting the window's rows by (capture_id, version descending) and
/// keeping the first of each id (`LIMIT 1 BY`); rows of one version are copies of one row (unmerged parts, a
/// replica's copy), and should two ever differ in time, the earliest is kept, as `tail` keeps it. On 18.16 that
/// takes about 0.6x the time and memory of an `argMax` of each column grouped by id (a window of 40,000 rows: 63 ms
/// and 42 MB against 105 ms and 68 MB). The cursor is applied to the newest rows only:
/// applied to every row, it would keep an older row of a capture whose newest row is before the cursor (a re-post
/// with an earlier time), which the check after the window would then drop, leaving the page short.
fn window_rows_sql(table: &str, conditions: &str, after_cursor: Option<&str>, limit: u64) -> String {
    let after_cursor = after_cursor.map(|condition| format!(" WHERE {condition}")).unwrap_or_default();
    format!(
        "SELECT {LOCATION_COLUMNS} FROM (SELECT {LOCATION_COLUMNS} FROM {table} WHERE {conditions} ORDER BY \
         capture_id, version DESC, captured_at_ns LIMIT 1 BY capture_id){after_cursor} ORDER BY captured_at_ns, capture_id LIMIT {limit}"
    )
}

#[derive(Clone)]
pub struct CatalogReader {
    client: CatalogClient,
    tables: Tables,
    catalog: String,
    /// Whether `by_time` was found kept: listings across streams read it from then on
    /// ([`CatalogReader::listing_table`]; shared by the clones).
    time_table_kept: Arc<AtomicBool>,
    /// Whether a page's setup is read in separate statements, since the server refused the one statement of
    /// [`CatalogReader::page_setup`] (tables older than schema 6 lack `horizons`; shared by the clones).
    setup_apart: Arc<AtomicBool>,
    /// What this reader has learnt of its catalog.
    known: CatalogKnowledge,
    /// What the readers of these tables made from one [`CatalogReader::new`] have learnt of each catalog, for
    /// [`CatalogReader::for_catalog`].
    known_catalogs: Arc<Mutex<KnownCatalogs>>,
}

/// What readers learn of one catalog that serves later reads (shared by the clones, and by the readers of the
/// catalog [`CatalogReader::for_catalog`] makes).
#[derive(Clone, Default)]
struct CatalogKnowledge {
    /// What is known of the horizon rows read.
    horizon_verdicts: Arc<Mutex<HorizonVerdicts>>,
    /// The last density sample of each stream (None: across streams) and when it was taken, for
    /// [`DENSITY_SAMPLE_REUSE`].
    density_samples: Arc<Mutex<DensitySamples>>,
}

impl CatalogKnowledge {
    /// The horizon verdicts, locked. (A panic while they were locked left them whole: each change is one insert.)
    fn verdicts(&self) -> MutexGuard<'_, HorizonVerdicts> {
        self.horizon_verdicts.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The density samples, locked (whole after a panic too: each change is one insert or retain).
    fn samples(&self) -> MutexGuard<'_, DensitySamples> {
        self.density_samples.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The most catalogs whose [`CatalogKnowledge`] the readers of one set of tables keep: every catalog of the largest
/// listing across catalogs (`fleet::MAX_CATALOGS`, which asserts it), and the first reader's own. The names come
/// from requests, so what is kept is bounded: past it, the least recently used is forgotten for each new one.
pub(super) const KNOWN_CATALOGS_KEPT: usize = 257;

/// What the readers made from one [`CatalogReader::new`] know of each catalog, at most [`KNOWN_CATALOGS_KEPT`].
struct KnownCatalogs {
    /// The catalog of the reader [`CatalogReader::new`] made: never forgotten.
    first: String,
    /// Each catalog's knowledge, and when a reader of it was last made.
    by_name: HashMap<String, (CatalogKnowledge, Instant)>,
}

impl KnownCatalogs {
    fn new(first: &str, known: CatalogKnowledge) -> KnownCatalogs {
        KnownCatalogs {
            first: first.to_string(),
            by_name: HashMap::from([(first.to_string(), (known, Instant::now()))]),
        }
    }

    /// The knowledge of `catalog`, used at `now` (kept from now on, in place of the least recently used past the
    /// bound).
    fn of(&mut self, catalog: &str, now: Instant) -> CatalogKnowledge {
        if self.by_name.len() >= KNOWN_CATALOGS_KEPT && !self.by_name.contains_key(catalog) {
            let least_recent = (self.by_name.iter())
                .filter(|(name, _)| **name != self.first)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(name, _)| name.clone());
            if let Some(name) = least_recent {
                self.by_name.remove(&name);
            }
        }
        let (known, used) =
            self.by_name.entry(catalog.to_string()).or_insert_with(|| (CatalogKnowledge::default(), now));
        *used = now;
        known.clone()
    }
}

impl CatalogReader {
    pub fn new(client: CatalogClient, tables: Tables, catalog: &str) -> CatalogReader {
        let known = CatalogKnowledge::default();
        CatalogReader {
            client,
            tables,
            catalog: catalog.to_string(),
            time_table_kept: Arc::default(),
            setup_apart: Arc::default(),
            known_catalogs: Arc::new(Mutex::new(KnownCatalogs::new(catalog, known.clone()))),
            known,
        }
    }

    /// Whether a listing reads `by_time` once the catalog keeps it: one across streams on a server that keeps it
    /// ([`super::schema::ensure_time_table`]; elsewhere the server reads `captures`' time-order projection, or the
    /// granules of every stream's window), unless a label filter can use `captures`' label index
    /// ([`super::schema::LABEL_FILTER_INDEX`], which `by_time` lacks). One stream is read from `captures` (ordered by
    /// stream, then time).
    fn may_read_time_table(&self, query: &ListQuery) -> bool {
        let server = self.client.server_version();
        let label_index = !query.labels.is_empty() && server.has_skip_indexes();
        query.stream.is_none() && server.keeps_time_table() && !label_index
    }

    /// What a page needs before its first window, in one statement: the watermark (unless `pinned`), the time
    /// bounds of the rows it lists from, the committed horizons, whether `by_time` is kept (when the listing may read
    /// it and it is not known kept yet), and for a first page the rows that size its first window
    /// ([`CatalogReader::density_sample_sql`]). Where the server refuses the statement (tables older than schema
    /// 6 lack `horizons`), they are read in separate statements from then on.
    async fn page_setup(&self, query: &ListQuery, pinned_opt: Option<u64>) -> Result<PageSetup, CatalogError> {
        let wants_sample = self.density_sample_sql(query).is_some();
        let reused = wants_sample.then(|| self.known.samples().fresh(&query.stream, Instant::now())).flatten();
        let mut setup = self.read_page_setup(query, pinned_opt, wants_sample && reused.is_none()).await?;
        match reused {
            Some(rows) => setup.sampled_rows_opt = rows,
            None if wants_sample => self.known.samples().keep(&query.stream, setup.sampled_rows_opt, Instant::now()),
            None => {}
        }
        Ok(setup)
    }

    /// [`CatalogReader::page_setup`] as read from the server, with the density sample where `with_sample` says.
    async fn read_page_setup(
        &self,
        query: &ListQuery,
        pinned_opt: Option<u64>,
        with_sample: bool,
    ) -> Result<PageSetup, CatalogError> {
        /// Arrays, since a value of a scalar subquery may come back Nullable where the server has that type, and an
        /// array cannot be.
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct SetupRow {
            /// [the highest version from the `watermark` table's version on, the publishes counted there]
            setup_watermark: Vec<u64>,
            /// [first_ns, last_ns, rows of `time_bounds` read]
            setup_bounds: Vec<u64>,
            /// The rows of `horizons`, committed or not, in no order
            setup_horizons: Vec<(u64, u64, String)>,
            /// [rows marking `by_time` kept]
            setup_time_table_marks: Vec<u64>,
            /// [rows of the density sample, and whether they are not the listing's]
            setup_sample: Vec<u64>,
        }
        let wants_mark = self.may_read_time_table(query) && !self.time_table_kept.load(Ordering::Relaxed);
        let sample_opt = self.density_sample_sql(query).filter(|_| with_sample);
        if self.setup_apart.load(Ordering::Relaxed) {
            return self.page_setup_apart(query, pinned_opt, wants_mark, with_sample).await;
        }
        let watermark = match pinned_opt {
            Some(watermark) => format!("[toUInt64({watermark}), toUInt64(1)]"),
            None => format!("(SELECT [max(version), count()] FROM {})", self.publishes_from_watermark()),
        };
        let marks = if wants_mark {
            format!("(SELECT [count()] FROM {})", super::schema::time_table_marks(&self.tables))
        } else {
            "[toUInt64(0)]".to_string()
        };
        let sample = match &sample_opt {
            Some(sample) => format!("({sample})"),
            None => "[toUInt64(0), toUInt64(1)]".to_string(),
        };
        // The watermark comes first: the server works the subqueries out from left to right, so the bounds and the
        // horizons read after it hold everything up to it, as when they were read after it in statements of their
        // own.
        let sql = format!(
            "SELECT {watermark} AS setup_watermark, (SELECT [minMerge(first_at), maxMerge(last_at), count()] FROM \
             {bounds}) AS setup_bounds, (SELECT groupArray((version, before_ns, publish_id)) FROM {horizons} WHERE \
             catalog = {catalog}) AS setup_horizons, {marks} AS setup_time_table_marks, {sample} AS setup_sample",
            bounds = self.time_bounds_of(query.stream.as_deref()),
            horizons = self.tables.horizons,
            catalog = self.catalog_literal(),
        );
        let row = match self.client.fetch_few::<SetupRow>(&sql).await {
            Ok(mut rows) => rows.pop().ok_or_else(|| {
                CatalogError::new(ErrorKind::DefinitelyFailed, "a page's setup read no row".to_string())
            })?,
            // Tables without `horizons`, or a user not let read `system.parts`: the separate statements do without
            // either. (Any other error, such as a timeout, is the listing's.)
            Err(error) if error.is_unknown_table() || error.is_access_denied() => {
                tracing::debug!(%error, "catalog: a page's setup is read in separate statements from now on");
                self.setup_apart.store(true, Ordering::Relaxed);
                return self.page_setup_apart(query, pinned_opt, wants_mark, with_sample).await;
            }
            Err(error) => return Err(error),
        };
        let ([highest, publishes_counted], [first_ns, last_ns, bound_rows], [marks], [rows_sampled, not_the_listings]) = (
            row.setup_watermark.as_slice(),
            row.setup_bounds.as_slice(),
            row.setup_time_table_marks.as_slice(),
            row.setup_sample.as_slice(),
        ) else {
            return Err(CatalogError::new(ErrorKind::DefinitelyFailed, "a page's setup read a row of another shape"));
        };
        let watermark = match (pinned_opt, *publishes_counted) {
            (Some(watermark), _) => watermark,
            (None, 1..) => *highest,
            // The `watermark` table names a version `publishes` lacks: everything read again, in order.
            (None, 0) => return self.page_setup_apart(query, None, wants_mark, with_sample).await,
        };
        let horizon_rows: Vec<HorizonRow> = (row.setup_horizons.into_iter())
            .map(|(version, before_ns, publish_id)| HorizonRow { version, before_ns, publish_id })
            .collect();
        let (horizons, horizons_unsure) = self.horizons_by_verdict(&horizon_rows, watermark, true);
        Ok(PageSetup {
            watermark,
            bounds_opt: (*bound_rows > 0).then_some((*first_ns, *last_ns)),
            horizons,
            horizons_unsure,
            horizon_rows,
            time_table_marked: *marks > 0,
            sampled_rows_opt: sampled_rows(*rows_sampled, *not_the_listings).filter(|_| sample_opt.is_some()),
        })
    }

    /// [`CatalogReader::page_setup`] in separate statements (tables without `horizons`, whose absence this
    /// tolerates; the density sample is allowed to fail).
    async fn page_setup_apart(
        &self,
        query: &ListQuery,
        pinned_opt: Option<u64>,
        wants_mark: bool,
        with_sample: bool,
    ) -> Result<PageSetup, CatalogError> {
        let watermark = match pinned_opt {
            Some(watermark) => watermark,
            None => self.watermark().await?,
        };
        let mark = async {
            if !wants_mark {
                return Ok(false);
            }
            super::schema::time_table_kept(&self.client, &self.tables).await
        };
        let sample = async {
            let Some(sample) = self.density_sample_sql(query).filter(|_| with_sample) else { return Ok(None) };
            #[derive(clickhouse::Row, serde::Deserialize)]
            struct Sample {
                /// [rows of the density sample, and whether they are not the listing's]
                setup_sample: Vec<u64>,
            }
            let rows: Vec<Sample> = self.client.fetch_few(&format!("SELECT ({sample}) AS setup_sample")).await?;
            match rows.first().map(|row| row.setup_sample.as_slice()) {
                Some(&[rows, not_the_listings]) => Ok(sampled_rows(rows, not_the_listings)),
                _ => Err(CatalogError::new(ErrorKind::DefinitelyFailed, "the row count read a row of another shape")),
            }
        };
        let (bounds, horizons, mark, sample) =
            tokio::join!(self.time_bounds(query.stream.as_deref()), self.horizons(watermark), mark, sample);
        // The sample only sizes a first window: without it the window is sized from the span.
        let sampled_rows_opt = sample.unwrap_or_else(|error| {
            tracing::debug!(%error, "catalog: no row count for the first window");
            None
        });
        Ok(PageSetup {
            watermark,
            bounds_opt: bounds?,
            horizons: horizons?,
            horizons_unsure: false,
            horizon_rows: Vec::new(),
            time_table_marked: mark?,
            sampled_rows_opt,
        })
    }

    /// The table a listing reads its windows from (see [`CatalogReader::may_read_time_table`]): `by_time` once it is
    /// found kept (remembered; one still filling is asked about again by the next listing), else `captures`.
    fn listing_table(&self, query: &ListQuery, setup: &PageSetup) -> &str {
        if setup.time_table_marked && self.may_read_time_table(query) {
            self.time_table_kept.store(true, Ordering::Relaxed);
        }
        self.known_listing_table(query).unwrap_or(&self.tables.captures)
    }

    /// The table a listing reads its windows from, as far as this reader knows without a setup: None while the
    /// listing may read `by_time` and it is not known kept yet.
    fn known_listing_table(&self, query: &ListQuery) -> Option<&str> {
        if !self.may_read_time_table(query) {
            return Some(&self.tables.captures);
        }
        self.time_table_kept.load(Ordering::Relaxed).then_some(&self.tables.by_time)
    }

    /// The statement that counts the rows a first page's window is sized by ([`FIRST_WINDOW_PAGES`],
    /// [`LABEL_FIRST_WINDOW_PAGES`]), as `[rows, whether they are not the listing's]`: across streams,
    /// [`CatalogReader::partition_rows_sql`]; in one stream, its rows (duplicates included, a label filter's or
    /// not) in the last [`DENSITY_SAMPLE_FRACTION`] of the span its `time_bounds` give, [`density_sample_span`] ns.
    /// None on a later page, which has the window its cursor carries.
    fn density_sample_sql(&self, query: &ListQuery) -> Option<String> {
        if query.cursor.is_some() {
            return None;
        }
        let Some(stream) = &query.stream else { return Some(self.partition_rows_sql()) };
        // (`toUInt64` of the difference: unsigned minus is signed in ClickHouse, and a time past 2262 overflows it.)
        Some(format!(
            "SELECT [count(), toUInt64(0)] FROM {captures} WHERE catalog = {catalog} AND stream = {stream} AND \
             captured_at_ns >= (SELECT toUInt64(maxMerge(last_at) - intDiv(maxMerge(last_at) + 1 - \
             minMerge(first_at), {DENSITY_SAMPLE_FRACTION})) FROM {bounds})",
            captures = self.tables.captures,
            catalog = self.catalog_literal(),
            stream = sql_string_literal(stream),
            bounds = self.time_bounds_of(Some(stream)),
        ))
    }

    /// `[this catalog's rows in the month partitions of captures, partitions of captures not by month]`, from one
    /// read of `system.parts` (duplicates and rows below the horizon included). The partitions of
    /// [`super::schema::PARTITION_BY`] are written `('<catalog>',<YYYYMM>)` there (see
    /// [`super::schema::parse_partition`]); an older capstore's table has one of another kind.
    fn partition_rows_sql(&self) -> String {
        let (database, name) = self.tables.captures.split_once('.').unwrap_or(("", &self.tables.captures));
        let ours = format!("('{}',", self.catalog);
        format!(
            "SELECT [toUInt64(sumIf(rows, substring(partition, 1, {length}) = {ours})), \
             toUInt64(countIf(substring(partition, 1, 1) != '('))] FROM system.parts WHERE database = {} AND \
             table = {} AND active",
            sql_string_literal(database),
            sql_string_literal(name),
            length = ours.len(),
            ours = sql_string_literal(&ours),
        )
    }

    /// A reader of another catalog in the same tables (or of this one), which shares what this reader knows of the
    /// tables and what the readers made by this function knew of that catalog: a listing across catalogs on the
    /// HTTP API's reader makes one per catalog and request.
    pub fn for_catalog(&self, catalog: &str) -> CatalogReader {
        let known =
            (self.known_catalogs.lock().unwrap_or_else(|poisoned| poisoned.into_inner())).of(catalog, Instant::now());
        CatalogReader { catalog: catalog.to_string(), known, ..self.clone() }
    }

    /// The catalog this reader reads.
    pub fn catalog(&self) -> &str {
        &self.catalog
    }

    /// Every catalog name that has published in these tables (from `watermark`: one row per catalog and part).
    pub async fn catalog_names(&self) -> Result<Vec<String>, CatalogError> {
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct Name {
            catalog: String,
        }
        let rows: Vec<Name> = self
            .client
            .fetch_all(&format!("SELECT catalog FROM {} GROUP BY catalog ORDER BY catalog", self.tables.watermark))
            .await?;
        Ok(rows.into_iter().map(|row| row.catalog).collect())
    }

    fn catalog_literal(&self) -> String {
        sql_string_literal(&self.catalog)
    }

    /// The packs of this catalog that compactions retired.
    pub fn retired_packs(&self) -> super::retired::RetiredPacks {
        super::retired::RetiredPacks::new(self.client.clone(), self.tables.clone(), &self.catalog)
    }

    /// The highest committed version (0 before the first publish).
    ///
    /// `publishes` is read from the `watermark` table's version on, a lower bound (its view runs after the row's own
    /// insert, so it is never ahead of a committed row, and it may lag only where a view's insert failed). Should it
    /// ever name a version `publishes` lacks, the whole catalog is read instead: the answer never depends on it.
    pub async fn watermark(&self) -> Result<u64, CatalogError> {
        let rows: Vec<BoundedMax> = self
            .client
            .fetch_few(&format!(
                "SELECT max(version) AS max_version, count() AS rows FROM {}",
                self.publishes_from_watermark()
            ))
            .await?;
        // (Aliases are global in ClickHouse: `max(version) AS version` would capture the WHERE clause.)
        if let Some(BoundedMax { max_version, rows: 1.. }) = rows.first() {
            return Ok(*max_version);
        }
        self.watermark_of_every_publish().await
    }

    /// The publishes of this catalog from the `watermark` table's version on: `FROM` and `WHERE` of a read of them.
    fn publishes_from_watermark(&self) -> String {
        format!(
            "{publishes} WHERE catalog = {catalog} AND version >= (SELECT maxMerge(version) FROM {watermark} WHERE \
             catalog = {catalog})",
            publishes = self.tables.publishes,
            watermark = self.tables.watermark,
            catalog = self.catalog_literal(),
        )
    }

    /// The highest committed version, from every publish of the catalog (should `watermark` ever name a version
    /// `publishes` lacks).
    async fn watermark_of_every_publish(&self) -> Result<u64, CatalogError> {
        let catalog = self.catalog_literal();
        let rows: Vec<VersionRow> = self
            .client
            .fetch_all(&format!(
                "SELECT max(version) AS version FROM {} WHERE catalog = {catalog}",
                self.tables.publishes
            ))
            .await?;
        Ok(rows.first().map_or(0, |row| row.version))
    }

    fn visible(&self, watermark: u64) -> String {
        format!(
            "(version, publish_id) IN (SELECT version, publish_id FROM {} WHERE catalog = {} AND version <= {watermark})",
            self.tables.publishes,
            self.catalog_literal()
        )
    }

    /// The server's clock, in nanoseconds since the epoch (milliseconds apart where the server has them, whole
    /// seconds on 18.16): the clock a retention horizon is reckoned by, shared by every daemon of the tables and
    /// the one the lease trusts already.
    pub async fn server_now_ns(&self) -> Result<u64, CatalogError> {
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct Now {
            ms: u64,
        }
        let rows: Vec<Now> =
            self.client.fetch_all(&format!("SELECT {} AS ms", super::lease::server_now_ms_expr(&self.client))).await?;
        Ok(rows.first().map_or(0, |row| row.ms.saturating_mul(1_000_000)))
    }

    /// The committed retention horizons at versions up to `through`: one primary-key read of the few rows of
    /// `horizons` (none in tables older than schema 6), and, for a row this reader has not met yet, one of
    /// `publishes` at its version ([`CatalogReader::committed_horizons`]).
    pub async fn horizons(&self, through: u64) -> Result<Horizons, CatalogError> {
        let sql = format!(
            "SELECT version, before_ns, publish_id FROM {} WHERE catalog = {} AND version <= {through}",
            self.tables.horizons,
            self.catalog_literal(),
        );
        match self.client.fetch_few::<HorizonRow>(&sql).await {
            Ok(rows) => self.committed_horizons(&rows, through).await,
            Err(error) if error.is_unknown_table() => Ok(Horizons::default()),
            Err(error) => Err(error),
        }
    }

    /// The horizons of `rows` (as read from `horizons`, after the watermark that `through` is or bounds) whose
    /// publish is committed, at versions up to `through`, in version order. A row without a verdict yet
    /// ([`HorizonVerdicts`]) is looked up in `publishes` at its version, in one statement for all of them; on a
    /// catalog that keeps its horizons, that is once per horizon and reader, so a read of the horizons is a read of
    /// one small table. (The check used to be a subquery of every such read: about 2 ms of a first page on 18.16.)
    async fn committed_horizons(&self, rows: &[HorizonRow], through: u64) -> Result<Horizons, CatalogError> {
        let (known, unsure) = self.horizons_by_verdict(rows, through, false);
        if !unsure {
            return Ok(known);
        }
        let mut unknown: Vec<u64> = {
            let verdicts = self.known.verdicts();
            let unknown = rows.iter().filter(|row| row.version <= through && verdict_of(&verdicts, row).is_none());
            unknown.map(|row| row.version).collect()
        };
        unknown.sort_unstable();
        unknown.dedup();
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct Published {
            version: u64,
            publish_id: String,
        }
        let versions = unknown.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
        let published: Vec<Published> = self
            .client
            .fetch_few(&format!(
                "SELECT version, publish_id FROM {} WHERE catalog = {} AND version IN ({versions})",
                self.tables.publishes,
                self.catalog_literal(),
            ))
            .await?;
        let mut verdicts = self.known.verdicts();
        for row in rows.iter().filter(|row| unknown.binary_search(&row.version).is_ok()) {
            let at_its_version = published.iter().filter(|publish| publish.version == row.version);
            let mut committed_ids = at_its_version.map(|publish| publish.publish_id.as_str()).peekable();
            // No publish at its version yet: it may still be committed.
            if committed_ids.peek().is_none() {
                continue;
            }
            let committed = committed_ids.any(|publish_id| publish_id == row.publish_id);
            verdicts.insert((row.version, row.publish_id.clone()), committed);
        }
        drop(verdicts);
        Ok(self.horizons_by_verdict(rows, through, false).0)
    }

    /// The horizons of `rows` at versions up to `through` by what this reader knows, without asking the server: those
    /// known committed and, with `presume`, those without a verdict yet too (presumed committed); and whether a row
    /// there has no verdict yet.
    fn horizons_by_verdict(&self, rows: &[HorizonRow], through: u64, presume: bool) -> (Horizons, bool) {
        let verdicts = self.known.verdicts();
        let mut unsure = false;
        let mut committed = Vec::new();
        for row in rows.iter().filter(|row| row.version <= through) {
            let verdict = verdict_of(&verdicts, row);
            unsure |= verdict.is_none();
            if verdict.unwrap_or(presume) {
                committed.push((row.version, row.before_ns));
            }
        }
        committed.sort_unstable();
        committed.dedup();
        (Horizons { committed }, unsure)
    }

    /// The latest visible location of `capture_id` at watermark `watermark_opt` (default: now); `None` when the
    /// catalog does not know it or its latest row there is a deletion.
    pub async fn get(
        &self,
        capture_id: Uuid,
        watermark_opt: Option<u64>,
    ) -> Result<Option<CaptureLocation>, CatalogError> {
        Ok(self.lookup(capture_id, watermark_opt).await?.filter(|row| !row.is_deletion()))
    }

    /// The latest committed row of `capture_id` at watermark `watermark_opt` (default: now), a deletion included.
    pub async fn lookup(
        &self,
        capture_id: Uuid,
        watermark_opt: Option<u64>,
    ) -> Result<Option<CaptureLocation>, CatalogError> {
        let catalog = self.catalog_literal();
        let id_text = sql_string_literal(&capture_id.to_string());
        let id = sql_uuid_num(&capture_id.to_string());
        let pinned = watermark_opt.map(|watermark| format!(" AND version <= {watermark}")).unwrap_or_default();
        // One statement: the versions holding the id from `by_id`, checked against `publishes` at exactly those
        // versions, and the row of the newest (at or below a pinned watermark; without one the newest committed is
        // visible by definition) from `by_version` at those versions: primary-key lookups each, never a scan of the
        // catalog's history.
        let holding =
            format!("SELECT version FROM {} WHERE catalog = {catalog} AND capture_id = {id}", self.tables.by_id);
        let row_sql = format!(
            "SELECT {LOCATION_COLUMNS} FROM {by_version} WHERE catalog = {catalog} AND version IN ({holding}){pinned} \
             AND capture_id = {id_text} AND (version, publish_id) IN (SELECT version, publish_id FROM {publishes} \
             WHERE catalog = {catalog} AND version IN ({holding}){pinned} AND (version, publish_id) IN (SELECT \
             version, UUIDNumToString(publish_id) FROM {by_id} WHERE catalog = {catalog} AND capture_id = {id})) \
             ORDER BY version DESC LIMIT 1",
            by_version = self.tables.by_version,
            publishes = self.tables.publishes,
            by_id = self.tables.by_id,
        );
        let (rows, horizons) = tokio::join!(
            self.client.fetch_few::<CaptureLocation>(&row_sql),
            self.horizons(watermark_opt.unwrap_or(u64::MAX))
        );
        let watermark = watermark_opt.unwrap_or(u64::MAX);
        let horizons = horizons?;
        Ok(rows?.pop().map(|row| horizons.applied(row, watermark)))
    }

    /// The newest committed location of each of `ids`: [`CatalogReader::newest_rows`] less the deletions. Ids the
    /// catalog does not know, or whose newest row is a deletion, are absent from the answer.
    pub async fn get_many(&self, ids: &[Uuid]) -> Result<HashMap<Uuid, CaptureLocation>, CatalogError> {
        let mut newest = self.newest_rows(ids).await?;
        newest.retain(|_, location| !location.is_deletion());
        Ok(newest)
    }

    /// The newest committed row of each of `ids`, a deletion included, in one statement per [`MULTI_GET_BATCH`] ids:
    /// the versions `by_id` holds for them, their rows in `by_version`, kept where (version, publish_id) is
    /// committed. Primary-key reads throughout, whatever the catalog's history. Ids the catalog does not know are
    /// absent from the answer.
    /// A capture whose newest row was captured before a committed retention horizon is a deletion at that
    /// horizon's version ([`Horizons::applied`]).
    pub async fn newest_rows(&self, ids: &[Uuid]) -> Result<HashMap<Uuid, CaptureLocation>, CatalogError> {
        let (newest, horizons) = tokio::try_join!(self.newest_rows_at(ids, u64::MAX), self.horizons(u64::MAX))?;
        Ok(newest.into_iter().map(|(id, row)| (id, horizons.applied(row, u64::MAX))).collect())
    }

    /// [`CatalogReader::newest_rows`] with no horizon applied: the rows as committed.
    pub(crate) async fn newest_committed_rows(
        &self,
        ids: &[Uuid],
    ) -> Result<HashMap<Uuid, CaptureLocation>, CatalogError> {
        self.newest_rows_at(ids, u64::MAX).await
    }

    /// The newest committed row of each of `ids` as a reader pinned at `watermark` sees them, horizons not applied.
    /// Batches of [`MULTI_GET_BATCH`] ids, [`CONCURRENT_BATCHES`] at a time.
    async fn newest_rows_at(
        &self,
        ids: &[Uuid],
        watermark: u64,
    ) -> Result<HashMap<Uuid, CaptureLocation>, CatalogError> {
        use futures::{StreamExt, TryStreamExt};
        // (Batches owned, not borrowed: a closure over borrowed slices makes the future not `Send` for every
        // lifetime, which `tokio::spawn` of a caller needs.)
        let batches: Vec<Vec<Uuid>> = ids.chunks(MULTI_GET_BATCH).map(<[Uuid]>::to_vec).collect();
        let batches: Vec<Vec<CaptureLocation>> = futures::stream::iter(batches)
            .map(|batch| async move { self.committed_rows_of(&batch, watermark).await })
            .buffer_unordered(CONCURRENT_BATCHES)
            .try_collect()
            .await?;
        let mut newest: HashMap<Uuid, CaptureLocation> = HashMap::with_capacity(ids.len());
        for row in batches.into_iter().flatten() {
            let Ok(id) = Uuid::parse_str(&row.capture_id) else { continue };
            match newest.get(&id) {
                Some(kept) if kept.version >= row.version => {}
                _ => {
                    newest.insert(id, row);
                }
            }
        }
        Ok(newest)
    }

    /// The committed rows of `ids` at or below `watermark`, every version: the versions `by_id` holds for them, their
    /// rows in `by_version` at those versions, kept where (version, publish_id) is committed. One statement.
    async fn committed_rows_of(&self, ids: &[Uuid], watermark: u64) -> Result<Vec<CaptureLocation>, CatalogError> {
        let catalog = self.catalog_literal();
        let texts: Vec<String> = ids.iter().map(|id| sql_string_literal(&id.to_string())).collect();
        let nums: Vec<String> = ids.iter().map(|id| sql_uuid_num(&id.to_string())).collect();
        let written = format!(
            "SELECT version FROM {by_id} WHERE catalog = {catalog} AND capture_id IN ({nums}) AND version <= {watermark}",
            by_id = self.tables.by_id,
            nums = nums.join(", ")
        );
        self.client
            .fetch_all(&format!(
                "SELECT {LOCATION_COLUMNS} FROM {by_version} WHERE catalog = {catalog} AND version IN ({written}) AND \
                 capture_id IN ({texts}) AND (version, publish_id) IN (SELECT version, publish_id FROM {publishes} \
                 WHERE catalog = {catalog} AND version IN ({written}))",
                by_version = self.tables.by_version,
                publishes = self.tables.publishes,
                texts = texts.join(", "),
            ))
            .await
    }

    /// One page of captures by stream, time range and labels, in (captured_at_ns, capture_id) order.
    ///
    /// A page reads time windows of `captures` one after the other, from the cursor on, until it is full: each window
    /// is a primary-key range (exact with a stream; without one, exact in `by_time` or `captures`' time-order
    /// projection where the server has one of them, else one range per stream), and each next window is
    /// [`WINDOW_GROWTH`] times as wide, so sparse stretches cost a few empty reads. The next page starts with a
    /// window sized by the density this one read ([`NEXT_WINDOW_PAGES`]), which keeps a page's cost about its size
    /// however long the catalog's history.
    ///
    /// A first page reads its setup ([`CatalogReader::page_setup`]) before its first window. A later page has what
    /// its first window needs in its cursor (the watermark, where it starts, the window), so it reads that window at
    /// once, and the setup only when the window falls short (for the end of the rows, where the windows stop). Beside
    /// each window, in parallel, `by_id` is asked which of the ids of the window's first rows have a newer version
    /// ([`CatalogReader::newest_versions_of_first_rows`]). A later page whose first window fills it is one round trip
    /// (the window, `by_id` and the horizons, which its cursor's position is checked against, read side by side).
    pub async fn list(&self, query: &ListQuery) -> Result<Page, CatalogError> {
        let cursor = query.cursor.as_deref().map(Cursor::decode).transpose()?;
        let limit = query.limit.clamp(1, 100_000);
        if let Some(span) = cursor.as_ref().and_then(|cursor| self.later_page_span(query, cursor)) {
            return self.read_windows(query, cursor.as_ref(), span, limit, true).await;
        }
        let mut pinned_opt = cursor.as_ref().map(|cursor| cursor.watermark).or(query.watermark);
        if cursor.is_none() {
            match self.short_range_span(query, limit).await? {
                ShortRange::Span(span) => return self.read_windows(query, None, span, limit, true).await,
                ShortRange::Empty { watermark } => return Ok(Page::empty(watermark)),
                // Read from the setup at the watermark read already.
                ShortRange::Longer { watermark } => pinned_opt = Some(watermark),
                ShortRange::NotBounded => {}
            }
        }
        let mut setup = self.page_setup(query, pinned_opt).await?;
        let Some(span) = self.first_window_span(query, cursor.as_ref(), &setup, limit) else {
            return Ok(Page::empty(setup.watermark));
        };
        let presumed_start = span.start;
        let page = self.read_windows(query, cursor.as_ref(), span, limit, setup.horizons_unsure).await?;
        if !setup.horizons_unsure {
            return Ok(page);
        }
        // The horizons were presumed committed; the check beside the first window has them known now. Should one
        // not be (a rare orphan of a horizon's failed publish) and the windows have started too late for it, read
        // them again, from the horizons checked.
        let watermark = setup.watermark;
        setup.horizons = self.committed_horizons(&setup.horizon_rows, watermark).await?;
        match self.first_window_span(query, cursor.as_ref(), &setup, limit) {
            Some(span) if span.start < presumed_start => {
                self.read_windows(query, cursor.as_ref(), span, limit, false).await
            }
            _ => Ok(page),
        }
    }

    /// The page read in windows over `span` (see [`CatalogReader::list`]). With `check_horizon` (a later page, whose
    /// span starts where its cursor says, or a first page whose setup met a horizon row this reader has no verdict
    /// on), the horizons are read beside the first window; should one committed at the watermark be past the span's
    /// start (a cursor of a build before horizons, or one made up; a horizon the setup could not count), that
    /// window's rows are dropped and the windows start again at the horizon, as a page from the setup would.
    async fn read_windows(
        &self,
        query: &ListQuery,
        cursor: Option<&Cursor>,
        mut span: PageSpan<'_>,
        limit: u64,
        check_horizon: bool,
    ) -> Result<Page, CatalogError> {
        let watermark = span.watermark;

        let catalog = self.catalog_literal();
        let mut conditions = vec![format!("catalog = {catalog}"), format!("version <= {watermark}")];
        if let Some(stream) = &query.stream {
            conditions.push(format!("stream = {}", sql_string_literal(stream)));
        }
        for (key_text, value_text) in &query.labels {
            let (key, value) = (sql_string_literal(key_text), sql_string_literal(value_text));
            if self.client.server_version().has_skip_indexes() {
                // The same condition, as the label filter's expression has it: the server skips the granules
                // without the pair (see `LABEL_FILTER_INDEX`).
                let pair = sql_string_literal(&format!("{key_text}={value_text}"));
                conditions.push(format!("has({LABEL_PAIRS}, {pair})"));
            }
            conditions.push(format!("has(label_keys, {key}) AND label_values[indexOf(label_keys, {key})] = {value}"));
        }
        let after_cursor = cursor.map(|cursor| {
            format!(
                "captured_at_ns > {at} OR (captured_at_ns = {at} AND capture_id > {id})",
                at = cursor.captured_at_ns,
                id = sql_string_literal(&cursor.capture_id.to_string())
            )
        });
        // Whether a window of a small page reads a few granules (see `FEW_ROWS_PAGE`).
        let few_granules =
            query.labels.is_empty() && (query.stream.is_some() || span.table == self.tables.by_time.as_str());
        let (mut page_start, first_window_ns) = (span.start, span.window);
        let mut candidates: Vec<CaptureLocation> = Vec::new();
        let mut newest_written: HashMap<String, u64> = HashMap::new();
        let mut horizon_unchecked = check_horizon;
        while span.start < span.end && (candidates.len() as u64) < limit {
            let window_end = span.start.saturating_add(span.window).min(span.end);
            let needed = limit - candidates.len() as u64;
            let in_window = format!(
                "{} AND captured_at_ns >= {} AND captured_at_ns < {window_end}",
                conditions.join(" AND "),
                span.start
            );
            // Visibility against the publishes at the versions this window holds: a set of about the window's size,
            // not of the catalog's history.
            let visible = format!(
                "(version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND \
                 version IN (SELECT version FROM {table} WHERE {in_window}))",
                publishes = self.tables.publishes,
                table = span.table,
            );
            let sql =
                window_rows_sql(span.table, &format!("{in_window} AND {visible}"), after_cursor.as_deref(), needed);
            // The rows `by_id` is asked about: the window's first in listing order after the cursor, as many as the
            // page still needs and a margin (see `newest_versions_of_first_rows`).
            let first_rows = format!(
                "{in_window}{after_cursor} ORDER BY captured_at_ns, capture_id LIMIT {}",
                needed.saturating_add(needed / CHECKED_ROWS_MARGIN_FRACTION).saturating_add(CHECKED_ROWS_MARGIN),
                after_cursor = after_cursor.as_ref().map(|condition| format!(" AND ({condition})")).unwrap_or_default(),
            );
            let check_horizon = std::mem::take(&mut horizon_unchecked);
            let few = few_granules && needed <= FEW_ROWS_PAGE;
            let (rows, newest, horizon_ns) = tokio::try_join!(
                async {
                    match few {
                        true => self.client.fetch_few::<CaptureLocation>(&sql).await,
                        false => self.client.fetch_all::<CaptureLocation>(&sql).await,
                    }
                },
                self.newest_versions_of_first_rows(span.table, &first_rows, watermark),
                async {
                    match check_horizon {
                        true => self.horizons(watermark).await.map(|horizons| horizons.before_at(watermark)),
                        false => Ok(0),
                    }
                }
            )?;
            if horizon_ns > page_start {
                (span.start, page_start) = (horizon_ns, horizon_ns);
                continue;
            }
            let filled = rows.len() as u64 == needed;
            candidates.extend(rows);
            newest_written.extend(newest.into_iter().map(|row| (row.id, row.newest)));
            if filled {
                break;
            }
            span.start = window_end;
            span.window = span.window.saturating_mul(WINDOW_GROWTH);
            if !span.end_known {
                self.find_end(query, &mut span).await?;
            }
        }
        // The candidates past the rows `by_id` was asked about beside their window (more rows that are not the
        // page's than the margin: a publish's orphan copies, many older versions), asked about now, by id.
        let unanswered: Vec<&str> = candidates
            .iter()
            .map(|capture| capture.capture_id.as_str())
            .filter(|id| !newest_written.contains_key(*id))
            .collect();
        if !unanswered.is_empty() {
            let answers = self.newest_versions_of(&unanswered, watermark).await?;
            newest_written.extend(answers.into_iter().map(|row| (row.id, row.newest)));
        }
        let page_full = candidates.len() as u64 == limit;
        // The next page's window: the time this page's rows took, times NEXT_WINDOW_PAGES, and at least a
        // WINDOW_GROWTH-th of the window that filled it (rows at one instant took no time: the next window must
        // not shrink to nothing).
        let taken = match candidates.last() {
            Some(last) => last.captured_at_ns.saturating_sub(page_start).saturating_add(1),
            None => span.window,
        };
        let next_window = taken.saturating_mul(NEXT_WINDOW_PAGES).max(span.window / WINDOW_GROWTH).max(1);
        let next_cursor = match candidates.last() {
            Some(last) if page_full => Some(Cursor::after(watermark, last, next_window).encode()),
            _ => None,
        };
        // The cursor is the last candidate's, so a page shortened here still goes on where it should.
        let captures = self.newest_of(candidates, &newest_written, watermark, &query.labels).await?;
        Ok(Page { captures, next_cursor, watermark, window_ns: next_window, first_window_ns })
    }

    /// Where a later page reads, from its cursor alone: at the cursor's watermark, from its position on, in its
    /// window, up to the end of the range asked for (the end of the rows is found only if the window falls short).
    /// None where the cursor does not have it all: one of an older build (no window), or a listing that may read
    /// `by_time` while this reader does not know yet whether the catalog keeps it.
    fn later_page_span(&self, query: &ListQuery, cursor: &Cursor) -> Option<PageSpan<'_>> {
        if cursor.window_ns == 0 {
            return None;
        }
        let table = self.known_listing_table(query)?;
        // (The horizons are not known here: a cursor's position is at or after those committed up to its watermark
        // when a page of this build made it, and `read_windows` checks it against them beside the first window.)
        Some(PageSpan {
            watermark: cursor.watermark,
            table,
            start: cursor.captured_at_ns.max(query.since_ns.unwrap_or(0)),
            end: query.until_ns.unwrap_or(u64::MAX),
            end_known: false,
            window: cursor.window_ns,
        })
    }

    /// Where the first page of a short range (both ends given, and no more rows between them than
    /// [`FIRST_WINDOW_PAGES`] pages: `ls --since T --until T+10s`) reads, without the page's setup: the whole range in
    /// one window, at the watermark, the horizons read beside it (as a later page reads them). One statement reads
    /// the watermark (unless pinned) and counts the range's rows up to one more than that (duplicates included; the
    /// count stops once it has found that many, however many the range holds). A short range is so read in the time
    /// of one small read and one window, not the setup's five small reads and then the window, and a range without
    /// rows (a quiet stream's 10 s) in the time of the one small read: [`ShortRange::Empty`].
    ///
    /// [`ShortRange::Longer`] (the page is read from its setup, at that watermark) for a range holding more;
    /// [`ShortRange::NotBounded`] for a range open at either end, a label filter (whose matches may be rare in many
    /// rows), a listing that may read `by_time` while this reader does not know yet whether the catalog keeps it,
    /// and where the `watermark` table names a version `publishes` lacks (the setup reads every publish then).
    async fn short_range_span(&self, query: &ListQuery, limit: u64) -> Result<ShortRange<'_>, CatalogError> {
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct RangeRow {
            /// [the highest version from the `watermark` table's version on, the publishes counted there]
            range_watermark: Vec<u64>,
            /// [rows of the range, counted up to one more than a short range holds]
            range_rows: Vec<u64>,
        }
        let (Some(since), Some(until)) = (query.since_ns, query.until_ns) else { return Ok(ShortRange::NotBounded) };
        if since >= until || !query.labels.is_empty() {
            return Ok(ShortRange::NotBounded);
        }
        let Some(table) = self.known_listing_table(query) else { return Ok(ShortRange::NotBounded) };
        let watermark = match query.watermark {
            Some(watermark) => format!("[toUInt64({watermark}), toUInt64(1)]"),
            None => format!("(SELECT [max(version), count()] FROM {})", self.publishes_from_watermark()),
        };
        let stream = match &query.stream {
            Some(stream) => format!(" AND stream = {}", sql_string_literal(stream)),
            None => String::new(),
        };
        let short = limit.saturating_mul(FIRST_WINDOW_PAGES);
        // The watermark first, as in the setup (see there).
        let sql = format!(
            "SELECT {watermark} AS range_watermark, (SELECT [count()] FROM (SELECT 1 FROM {table} WHERE catalog = \
             {catalog}{stream} AND captured_at_ns >= {since} AND captured_at_ns < {until} LIMIT {over})) AS range_rows",
            catalog = self.catalog_literal(),
            over = short.saturating_add(1),
        );
        let rows: Vec<RangeRow> = self.client.fetch_few(&sql).await?;
        let Some(RangeRow { range_watermark, range_rows }) = rows.into_iter().next() else {
            return Err(CatalogError::new(ErrorKind::DefinitelyFailed, "a range's count read no row"));
        };
        let (watermark, range_rows) = match (range_watermark.as_slice(), range_rows.as_slice()) {
            ([_, 0], _) => return Ok(ShortRange::NotBounded),
            ([watermark, _], [rows]) => (*watermark, *rows),
            _ => {
                return Err(CatalogError::new(
                    ErrorKind::DefinitelyFailed,
                    "a range's count read a row of another shape",
                ))
            }
        };
        if range_rows > short {
            return Ok(ShortRange::Longer { watermark });
        }
        // Every row a listing shows is a row of its table in its range (a deletion or a move is never one there: a
        // deletion hides the capture's row, a move is shown in its place), and the rows of a publish committed at
        // or below the watermark were in the tables before its commit, so before the count, which the server works
        // out after the watermark (from left to right, as the setup's bounds rely on: see `page_setup`).
        if range_rows == 0 {
            return Ok(ShortRange::Empty { watermark });
        }
        let span = PageSpan { watermark, table, start: since, end: until, end_known: true, window: until - since };
        Ok(ShortRange::Span(span))
    }

    /// Where a page reads, from its setup: from the first row it lists (after the horizon, the range's start and
    /// the cursor), to the end of the rows or of the range asked for, starting with the cursor's window or, on a
    /// first page, one sized as [`FIRST_WINDOW_FRACTION_ONE_STREAM`] and [`FIRST_WINDOW_PAGES`] say. None when the
    /// listing has no rows at all.
    fn first_window_span(
        &self,
        query: &ListQuery,
        cursor: Option<&Cursor>,
        setup: &PageSetup,
        limit: u64,
    ) -> Option<PageSpan<'_>> {
        let table = self.listing_table(query, setup);
        let (first_ns, last_ns) = setup.bounds_opt?;
        // Nothing captured before the horizon is listed: the windows start there.
        let listed_from = first_ns.max(setup.horizons.before_at(setup.watermark));
        let mut start = listed_from.max(query.since_ns.unwrap_or(0));
        if let Some(cursor) = cursor {
            start = start.max(cursor.captured_at_ns);
        }
        let end = last_ns.saturating_add(1).min(query.until_ns.unwrap_or(u64::MAX));
        let window = cursor.map(|cursor| cursor.window_ns).filter(|window| *window > 0).unwrap_or_else(|| {
            let fraction = if query.stream.is_some() {
                FIRST_WINDOW_FRACTION_ONE_STREAM
            } else {
                FIRST_WINDOW_FRACTION_ALL_STREAMS
            };
            // A fraction of the time a whole listing of the stream (or catalog) covers, not of the range asked
            // for: a short `--since`/`--until` range (a 10 s window) is then read in one statement rather than
            // in several growing ones, and no first window is wider than a whole listing's first window.
            let whole = last_ns.saturating_add(1).saturating_sub(listed_from);
            let mut first = whole / fraction;
            if let Some(rows) = setup.sampled_rows_opt.filter(|rows| *rows > 0) {
                let sampled_ns = match query.stream {
                    Some(_) => density_sample_span(first_ns, last_ns),
                    None => whole,
                };
                // The time that holds `wanted` rows at the sampled density.
                let holding = |wanted: u64| {
                    u64::try_from(u128::from(sampled_ns) * u128::from(wanted) / u128::from(rows)).unwrap_or(u64::MAX)
                };
                // (Across streams a label filter's window is not kept at 1/1024 of the span: that is 100k rows of
                // a catalog of 100M captures. It is set by the pages below.)
                if query.labels.is_empty() || query.stream.is_none() {
                    first = first.min(holding(limit * FIRST_WINDOW_PAGES));
                }
                // Widened no further than the window after a fraction's would have grown to: the density is
                // sampled at the end, and a stream sparser there than before would widen it to the whole history.
                if !query.labels.is_empty() {
                    let grown = (whole / fraction).saturating_mul(WINDOW_GROWTH);
                    first = first.max(holding(limit * LABEL_FIRST_WINDOW_PAGES).min(grown));
                }
            }
            first.max(1)
        });
        Some(PageSpan { watermark: setup.watermark, table, start, end, end_known: true, window })
    }

    /// Bound a later page's windows by the end of the rows it lists, once its first window fell short: from the
    /// setup at its watermark (the end of no rows at all stops the windows where they are).
    async fn find_end(&self, query: &ListQuery, span: &mut PageSpan<'_>) -> Result<(), CatalogError> {
        let setup = self.page_setup(query, Some(span.watermark)).await?;
        span.end = match setup.bounds_opt {
            Some((_, last_ns)) => span.end.min(last_ns.saturating_add(1)),
            None => span.start,
        };
        span.end_known = true;
        Ok(())
    }

    /// The first and the last captured_at_ns of the catalog's rows (of `stream`, when given), from `time_bounds`:
    /// bounds of every row ever written, committed or not. `None` when there are none.
    async fn time_bounds(&self, stream: Option<&str>) -> Result<Option<(u64, u64)>, CatalogError> {
        let rows: Vec<TimeBounds> = self
            .client
            .fetch_few(&format!(
                "SELECT minMerge(first_at) AS first_ns, maxMerge(last_at) AS last_ns, count() AS rows FROM {}",
                self.time_bounds_of(stream)
            ))
            .await?;
        Ok(rows.first().filter(|row| row.rows > 0).map(|row| (row.first_ns, row.last_ns)))
    }

    /// The rows of `time_bounds` of this catalog (of `stream`, when given): `FROM` and `WHERE` of a read of them.
    fn time_bounds_of(&self, stream: Option<&str>) -> String {
        let stream_condition = stream.map(|s| format!(" AND stream = {}", sql_string_literal(s))).unwrap_or_default();
        format!("{} WHERE catalog = {}{stream_condition}", self.tables.time_bounds, self.catalog_literal())
    }

    /// Every stream of the catalog with the first and the last captured_at_ns of its rows (from `time_bounds`: rows
    /// ever written, committed or not, deleted or not), in stream order.
    pub async fn streams(&self) -> Result<Vec<StreamBounds>, CatalogError> {
        self.client
            .fetch_all(&format!(
                "SELECT stream, minMerge(first_at) AS first_ns, maxMerge(last_at) AS last_ns FROM {} \
                 WHERE catalog = {} GROUP BY stream ORDER BY stream",
                self.tables.time_bounds,
                self.catalog_literal(),
            ))
            .await
    }

    /// Each of `candidates` as its newest visible version: a capture whose id has a newer version than the candidate
    /// is listed as that version if it is a move of the capture to another place (a compaction's, written to the
    /// index tables only: same stream and time, and still carrying `labels`), and left out otherwise (a re-post into
    /// another stream or with other labels or another time is listed where its own row is, and a deletion is not
    /// listed), so that `list` returns what `get` returns. `newest_written` holds the newest version `by_id` has of
    /// each candidate's id ([`CatalogReader::newest_versions_of_first_rows`] and
    /// [`CatalogReader::newest_versions_of`], of every version written, committed or not): an id with nothing newer
    /// than its candidate cannot be superseded, and until compaction has moved them that is almost every id. Only the
    /// ids with a newer row are read from `by_version` at their newest committed version (a newer row may be an
    /// orphan, which must not hide the capture).
    async fn newest_of(
        &self,
        candidates: Vec<CaptureLocation>,
        newest_written: &HashMap<String, u64>,
        watermark: u64,
        labels: &BTreeMap<String, String>,
    ) -> Result<Vec<CaptureLocation>, CatalogError> {
        let suspects: Vec<Uuid> = candidates
            .iter()
            .filter(|capture| newest_written.get(&capture.capture_id).is_some_and(|newest| *newest > capture.version))
            .filter_map(|capture| Uuid::parse_str(&capture.capture_id).ok())
            .collect();
        let (newest, horizons) = match suspects.is_empty() {
            true => (HashMap::new(), Horizons::default()),
            false => tokio::try_join!(self.newest_rows_at(&suspects, watermark), self.horizons(watermark))?,
        };
        Ok(candidates
            .into_iter()
            .filter_map(|capture| {
                // Looked up, not taken: a page whose windows each hold a row of one id (posted again at times further
                // apart than a window) has a candidate of it from each, and every one of them is checked.
                let Some(newer) = Uuid::parse_str(&capture.capture_id).ok().and_then(|id| newest.get(&id)) else {
                    return Some(capture);
                };
                // A newer row captured before a horizon is gone, and the capture with it.
                let moved = !newer.is_deletion()
                    && !horizons.hides_at(newer, watermark)
                    && newer.stream == capture.stream
                    && newer.captured_at_ns == capture.captured_at_ns
                    && labels.iter().all(|(key, value)| newer.labels_map().get(key) == Some(value));
                match newer.version.cmp(&capture.version) {
                    std::cmp::Ordering::Greater if moved => Some(newer.clone()),
                    std::cmp::Ordering::Greater => None,
                    _ => Some(capture),
                }
            })
            .collect())
    }

    /// The newest version `by_id` holds at or below `watermark` (committed or not) of each id of a window's first
    /// rows (`first_rows`: a condition on `table`, an order and a limit): an id whose newest is above its listed
    /// row's version may be superseded ([`CatalogReader::newest_of`]). A primary-key read of `by_id` for those ids.
    /// Read beside the window, not after it, so it cannot ask about exactly the page's ids: it asks about the first
    /// rows of the window in listing order, as many as the page needs and a margin ([`CHECKED_ROWS_MARGIN_FRACTION`])
    /// for the rows that are not the page's (older versions, copies, orphans). A window holds a few pages, and `by_id`
    /// is ordered by id, so in one stream of many the read covers every stream's ids of the time the rows span: it
    /// grows with that time, not with the rows asked about, and all of a window's ids cost several times the page's
    /// (on 26.9, 460 ms for the 12,500 ids of a stream's window of 100 streams). A candidate whose id is not answered
    /// (past the rows asked about) is asked about after the window, by id ([`CatalogReader::newest_versions_of`]). Every id asked about that `by_id` holds at or
    /// below the watermark is answered, not only those with more than one version there: a purge's row removal may
    /// have taken the listed row's version out of `by_id` (a mutation of its own) while `captures` still holds it, and
    /// the newer row must still hide it.
    async fn newest_versions_of_first_rows(
        &self,
        table: &str,
        first_rows: &str,
        watermark: u64,
    ) -> Result<Vec<NewestVersion>, CatalogError> {
        let ids = format!("SELECT UUIDStringToNum(capture_id) FROM {table} WHERE {first_rows}");
        self.client.fetch_all(&self.newest_versions_sql(&ids, watermark)).await
    }

    /// [`CatalogReader::newest_versions_of_first_rows`] for the candidates it did not answer, by their ids:
    /// [`MULTI_GET_BATCH`] literal ids a statement, [`CONCURRENT_BATCHES`] at a time.
    async fn newest_versions_of(&self, ids: &[&str], watermark: u64) -> Result<Vec<NewestVersion>, CatalogError> {
        use futures::{StreamExt, TryStreamExt};
        let batches: Vec<String> = ids
            .chunks(MULTI_GET_BATCH)
            .map(|batch| batch.iter().map(|id| sql_uuid_num(id)).collect::<Vec<_>>().join(", "))
            .collect();
        let answers: Vec<Vec<NewestVersion>> = futures::stream::iter(batches)
            .map(|ids| async move { self.client.fetch_all(&self.newest_versions_sql(&ids, watermark)).await })
            .buffer_unordered(CONCURRENT_BATCHES)
            .try_collect()
            .await?;
        Ok(answers.into_iter().flatten().collect())
    }

    /// The newest version `by_id` holds at or below `watermark` of each of `ids` (a subquery or a list of
    /// `FixedString(16)` values): `id, newest`.
    fn newest_versions_sql(&self, ids: &str, watermark: u64) -> String {
        // (`id_num` in the inner query: an alias named like the column would capture the WHERE clause.)
        format!(
            "SELECT UUIDNumToString(id_num) AS id, newest FROM (SELECT capture_id AS id_num, max(version) AS newest \
             FROM {by_id} WHERE catalog = {catalog} AND capture_id IN ({ids}) AND version <= {watermark} GROUP BY \
             capture_id)",
            by_id = self.tables.by_id,
            catalog = self.catalog_literal(),
        )
    }

    /// Committed publishes after version `after`, up to the watermark, in version order (for tailing consumers).
    ///
    /// Versions are gapless (I4), so the first `limit` after `after` are those up to `after + limit`: a key range of
    /// `limit` versions, not every publish after `after` (a server without read-in-order, 18.16, reads all it
    /// sorts).
    pub async fn publishes_after(&self, after: u64, limit: u64) -> Result<Vec<PublishRecord>, CatalogError> {
        let limit = limit.clamp(1, 100_000);
        let sql = format!(
            "SELECT version, publish_id, holder, lease_term, packs, captures, published_at_ms FROM {} \
             WHERE catalog = {} AND version > {after} AND version <= {} ORDER BY version LIMIT {limit}",
            self.tables.publishes,
            self.catalog_literal(),
            after.saturating_add(limit),
        );
        self.client.fetch_few(&sql).await
    }

    /// The next captures of the log of publishes after `from`, in tail order ((version, capture_id), each version as
    /// published), at most `limit` of them and none above `through` when given; and the
    /// position after them. Whole versions or part of one: a publish of 100,000 captures is read in pages too.
    ///
    /// Two statements, each bounded by the page: the publishes after `from.version` (at most `limit`; a horizon, a
    /// compaction's switch or an empty version holds no capture) give the last version the page can reach by their
    /// capture counts, then one primary-key range of `by_version` up to it (inside the first version, the ids after
    /// the position), visible against just those publishes. An empty page with `next == from` means caught up.
    pub async fn tail_page(
        &self,
        from: TailPosition,
        through: Option<u64>,
        limit: u64,
    ) -> Result<TailPage, CatalogError> {
        match self.plan_tail(from, through, limit, 1).await?.first() {
            Some(&span) => self.tail_span(from, span, limit).await,
            None => Ok(TailPage::caught_up_at(from)),
        }
    }

    /// Up to `pages` consecutive pages of the log after `from`, by the capture counts of the publishes after it: a
    /// page ends at the first version where its counts reach `limit` (or alone at a version of more captures), the
    /// last at the last version read. Empty when nothing is published after `from` (up to `through`). One read of
    /// `publishes` (more only while their counts fall short).
    pub(super) async fn plan_tail(
        &self,
        from: TailPosition,
        through: Option<u64>,
        limit: u64,
        pages: u64,
    ) -> Result<Vec<TailSpan>, CatalogError> {
        let limit = limit.clamp(1, TAIL_PAGE_MAX);
        let wanted = limit.saturating_mul(pages.max(1));
        // As many publishes as the pages can reach: most hold many captures, so read a few first and more only while
        // their counts fall short. (A compaction's publish counts its moves, which are no entries, and one that only
        // retires packs counts none: a page over such versions is short or empty, and its `next` still moves on.)
        let most = wanted.min(TAIL_PAGE_MAX);
        let mut asked = most.min(TAIL_PUBLISHES_FIRST);
        let publishes = loop {
            let mut publishes = self.publishes_after(from.version, asked).await?;
            if let Some(end) = through {
                publishes.retain(|publish| publish.version <= end);
            }
            let counted: u64 = publishes.iter().map(|publish| publish.captures).sum();
            // Fewer than asked: the log (or `through`) ends within them.
            if (publishes.len() as u64) < asked || counted >= wanted || asked >= most {
                break publishes;
            }
            asked = asked.saturating_mul(8).min(most);
        };
        // Where the counts reach each page (an estimate: the first version may be partly read).
        let mut spans = Vec::new();
        let mut counted = 0;
        for publish in &publishes {
            counted += publish.captures;
            if counted >= limit {
                spans.push(TailSpan { upto: publish.version, counted_captures: counted });
                counted = 0;
                if spans.len() as u64 == pages.max(1) {
                    return Ok(spans);
                }
            }
        }
        if let Some(last) = publishes.last().filter(|last| spans.last().map(|span| span.upto) != Some(last.version)) {
            spans.push(TailSpan { upto: last.version, counted_captures: counted });
        }
        Ok(spans)
    }

    /// The page of the log from `from` up to version `span.upto` (see [`CatalogReader::plan_tail`]), at most `limit`
    /// captures: one primary-key range of `by_version` (inside the first version, the ids after the position),
    /// visible against the publishes of just those versions. Its `next` is right after `span.upto`, or after its
    /// last capture when `limit` cut it short.
    ///
    /// A span planned to hold no more than a page is read as the server finds it and put in order here: a server
    /// without read-in-order (18.16) sorts a page of 20,000 rows in about as long as it takes to read them, and the
    /// rows mostly come in order already (each part is). A bigger span, which a page cuts, is sorted by the server.
    pub(super) async fn tail_span(
        &self,
        from: TailPosition,
        span: TailSpan,
        limit: u64,
    ) -> Result<TailPage, CatalogError> {
        let limit = limit.clamp(1, TAIL_PAGE_MAX);
        let (after, upto) = (from.version, span.upto);
        let inside_first = match from.after_id {
            Some(id) => format!(" AND (version > {} OR capture_id > '{id}')", after + 1),
            None => String::new(),
        };
        let entries = format!(
            "SELECT {LOCATION_COLUMNS} FROM {by_version} WHERE catalog = {catalog} AND version > {after} AND \
             version <= {upto}{inside_first} AND {LOG_ROW} IN (SELECT version, publish_id, {LOG_PUBLISH} FROM \
             {publishes} WHERE catalog = {catalog} AND version > {after} AND version <= {upto})",
            by_version = self.tables.by_version,
            publishes = self.tables.publishes,
            catalog = self.catalog_literal(),
        );
        // One entry more than a page, if the span holds it: then the page is cut after its last entry, and only then
        // (a span of exactly a page is read whole, and the next page starts after it).
        let one_more = limit + 1;
        let captures = async {
            if span.counted_captures <= limit {
                // Room for rows written twice: a span of more rows than that is sorted by the server after all.
                let rows_read = limit.saturating_mul(2);
                let mut rows: Vec<CaptureLocation> =
                    self.client.fetch_all(&format!("{entries} LIMIT {}", rows_read + 1)).await?;
                if rows.len() as u64 <= rows_read {
                    // What `ORDER BY version, capture_id LIMIT 1 BY version, capture_id` makes of them.
                    rows.sort_by(|a, b| (a.version, &a.capture_id).cmp(&(b.version, &b.capture_id)));
                    rows.dedup_by(|later, kept| later.version == kept.version && later.capture_id == kept.capture_id);
                    rows.truncate(usize::try_from(one_more).unwrap_or(usize::MAX));
                    return Ok(rows);
                }
            }
            let sql = format!("{entries} ORDER BY version, capture_id LIMIT 1 BY version, capture_id LIMIT {one_more}");
            self.client.fetch_all::<CaptureLocation>(&sql).await
        };
        let (mut captures, horizons) = tokio::try_join!(captures, self.horizons(upto))?;
        let cut = captures.len() as u64 > limit;
        captures.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        let next = match captures.last() {
            Some(last) if cut => TailPosition::after(last),
            _ => TailPosition::after_version(upto),
        };
        let captures = captures.into_iter().map(|capture| horizons.in_log(capture)).collect();
        // A horizon holds no capture, so no position is inside one: those up to `next` are on this page.
        let horizons = horizons.published_in(from.version, next.version).collect();
        Ok(TailPage { captures, horizons, from, next })
    }

    /// The captures published at exactly `version`, in (captured_at_ns, capture_id) order.
    pub async fn captures_of_version(&self, version: u64) -> Result<Vec<CaptureLocation>, CatalogError> {
        self.captures_of_versions(version.saturating_sub(1), version).await
    }

    /// The captures published at the versions above `after` up to `through`, in (version, captured_at_ns,
    /// capture_id) order: one primary-key range of `by_version`. Callers size the range by the publishes' capture
    /// counts, so that a tail catching up on a long history reads it in few queries of bounded size.
    pub async fn captures_of_versions(&self, after: u64, through: u64) -> Result<Vec<CaptureLocation>, CatalogError> {
        let sql = format!(
            "SELECT {LOCATION_COLUMNS} FROM {by_version} WHERE catalog = {catalog} AND \
             version > {after} AND version <= {through} AND {LOG_ROW} IN (SELECT version, publish_id, \
             {LOG_PUBLISH} FROM {publishes} WHERE catalog = {catalog} AND version > {after} AND version <= {through}) \
             ORDER BY version, captured_at_ns, capture_id LIMIT 1 BY version, capture_id",
            by_version = self.tables.by_version,
            publishes = self.tables.publishes,
            catalog = self.catalog_literal(),
        );
        let (captures, horizons) =
            tokio::try_join!(self.client.fetch_all::<CaptureLocation>(&sql), self.horizons(through))?;
        Ok(captures.into_iter().map(|capture| horizons.in_log(capture)).collect())
    }

    /// Every committed pack, in version order.
    pub async fn committed_packs(&self) -> Result<Vec<PackRecord>, CatalogError> {
        let sql = format!(
            "SELECT pack_id, argMax(object_key, version) AS object_key_v, argMax(bytes, version) AS bytes_v, \
             argMax(sha256, version) AS sha256_v, argMax(records, version) AS records_v, max(version) AS version_v \
             FROM {packs} WHERE catalog = {catalog} AND {visible} GROUP BY pack_id ORDER BY version_v, pack_id",
            packs = self.tables.packs,
            catalog = self.catalog_literal(),
            visible = self.visible(u64::MAX),
        );
        let sql = format!(
            "SELECT pack_id, object_key_v AS object_key, bytes_v AS bytes, sha256_v AS sha256, records_v AS records, \
             version_v AS version FROM ({sql})"
        );
        self.client.fetch_all(&sql).await
    }

    /// Committed packs smaller than `below_bytes` with ids in `from_id..until_id` (text order, which for the UUIDv7
    /// ids capstore gives packs is the order they were created in: a primary-key range of `packs`), at most
    /// `limit`, in id order, less the packs a compaction retired (or tried to: a pack whose retirement never
    /// committed is only merged later than it could be).
    pub async fn small_packs(
        &self,
        below_bytes: u64,
        from_id: &str,
        until_id: &str,
        limit: u64,
    ) -> Result<Vec<PackBrief>, CatalogError> {
        let catalog = self.catalog_literal();
        let range = format!(
            "catalog = {catalog} AND pack_id >= {from} AND pack_id < {until}",
            from = sql_string_literal(from_id),
            until = sql_string_literal(until_id)
        );
        self.client
            .fetch_all(&format!(
                "SELECT pack_id, any(object_key) AS object_key_v, any(bytes) AS bytes_v, any(records) AS records_v, \
                 any(first_captured_at_ns) AS first_v FROM {packs} WHERE {range} AND bytes < {below_bytes} AND \
                 records > 0 AND (version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE \
                 catalog = {catalog} AND version IN (SELECT version FROM {packs} WHERE {range})) AND pack_id NOT IN \
                 (SELECT pack_id FROM {retired} WHERE catalog = {catalog} AND pack_id >= {from}) \
                 GROUP BY pack_id ORDER BY pack_id LIMIT {limit}",
                packs = self.tables.packs,
                publishes = self.tables.publishes,
                retired = self.tables.retired_packs,
                from = sql_string_literal(from_id),
            ))
            .await
            .map(|rows: Vec<PackBriefRow>| rows.into_iter().map(PackBrief::from).collect())
    }

    /// Committed packs with ids from `from_id` on whose every capture was captured before `before_ns` (a retention
    /// horizon: no capture of theirs is visible any more), at most `limit`, in id order, less the packs a compaction
    /// retired; and the lowest id from `from_id` on of a pack (committed or not) holding a capture at or after it,
    /// where the next look must start (such a pack may fall wholly below a later horizon).
    pub async fn packs_below(
        &self,
        before_ns: u64,
        from_id: &str,
        limit: u64,
    ) -> Result<(Vec<PackBrief>, Option<String>), CatalogError> {
        #[derive(clickhouse::Row, serde::Deserialize)]
        struct Lowest {
            pack_id_v: String,
            rows: u64,
        }
        let catalog = self.catalog_literal();
        let from = sql_string_literal(from_id);
        let range = format!("catalog = {catalog} AND pack_id >= {from}");
        let below_sql = format!(
            "SELECT pack_id, any(object_key) AS object_key_v, any(bytes) AS bytes_v, any(records) AS records_v, \
             any(first_captured_at_ns) AS first_v FROM {packs} WHERE {range} AND last_captured_at_ns < {before_ns} \
             AND (version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND \
             version IN (SELECT version FROM {packs} WHERE {range} AND last_captured_at_ns < {before_ns})) AND \
             pack_id NOT IN (SELECT pack_id FROM {retired} WHERE catalog = {catalog} AND pack_id >= {from}) \
             GROUP BY pack_id ORDER BY pack_id LIMIT {limit}",
            packs = self.tables.packs,
            publishes = self.tables.publishes,
            retired = self.tables.retired_packs,
        );
        let lowest_sql = format!(
            "SELECT min(pack_id) AS pack_id_v, count() AS rows FROM {packs} WHERE {range} AND \
             last_captured_at_ns >= {before_ns}",
            packs = self.tables.packs,
        );
        let (below, lowest) = tokio::try_join!(
            self.client.fetch_all::<PackBriefRow>(&below_sql),
            self.client.fetch_all::<Lowest>(&lowest_sql)
        )?;
        let briefs = below.into_iter().map(PackBrief::from).collect();
        Ok((briefs, lowest.into_iter().find(|row| row.rows > 0).map(|row| row.pack_id_v)))
    }

    /// Which of `versions` are committed publishes of no pack (deletions, compactions' moves, horizons and empty
    /// versions).
    pub async fn versions_without_packs(
        &self,
        versions: &[u64],
    ) -> Result<std::collections::HashSet<u64>, CatalogError> {
        let mut versions = versions.to_vec();
        versions.sort_unstable();
        versions.dedup();
        if versions.is_empty() {
            return Ok(Default::default());
        }
        let list: Vec<String> = versions.iter().map(u64::to_string).collect();
        let rows: Vec<CommittedVersion> = self
            .client
            .fetch_all(&format!(
                "SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND version IN ({list}) AND \
                 packs = 0",
                publishes = self.tables.publishes,
                catalog = self.catalog_literal(),
                list = list.join(", "),
            ))
            .await?;
        Ok(rows.into_iter().map(|row| row.version).collect())
    }

    /// The captures deleted by the committed publishes after version `after`, of the first `limit` publishes
    /// without packs (deletions and compactions) there, and the last version read (`after` when there are none):
    /// whose bytes erasure removes.
    pub async fn deleted_after(&self, after: u64, limit: u64) -> Result<(Vec<Uuid>, u64), CatalogError> {
        let catalog = self.catalog_literal();
        let versions: Vec<CommittedVersion> = self
            .client
            .fetch_all(&format!(
                "SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND version > {after} AND \
                 packs = 0 ORDER BY version LIMIT {limit}",
                publishes = self.tables.publishes,
            ))
            .await?;
        let Some(through) = versions.last().map(|row| row.version) else { return Ok((Vec::new(), after)) };
        let pairs: Vec<String> =
            versions.iter().map(|row| format!("({}, {})", row.version, sql_string_literal(&row.publish_id))).collect();
        let rows: Vec<IdRow> = self
            .client
            .fetch_all(&format!(
                "SELECT DISTINCT capture_id FROM {by_version} WHERE catalog = {catalog} AND version > {after} AND \
                 version <= {through} AND (version, publish_id) IN ({pairs}) AND pack_id = ''",
                by_version = self.tables.by_version,
                pairs = pairs.join(", "),
            ))
            .await?;
        Ok((rows.iter().filter_map(|row| Uuid::parse_str(&row.capture_id).ok()).collect(), through))
    }

    /// The objects any committed version of `ids` was published in (not only the newest: a capture posted again
    /// left its older bytes where they were), in one statement per [`MULTI_GET_BATCH`] ids.
    pub async fn objects_holding(&self, ids: &[Uuid]) -> Result<std::collections::BTreeSet<String>, CatalogError> {
        let catalog = self.catalog_literal();
        let mut objects = std::collections::BTreeSet::new();
        for batch in ids.chunks(MULTI_GET_BATCH) {
            let texts: Vec<String> = batch.iter().map(|id| sql_string_literal(&id.to_string())).collect();
            let nums: Vec<String> = batch.iter().map(|id| sql_uuid_num(&id.to_string())).collect();
            let written = format!(
                "SELECT version FROM {by_id} WHERE catalog = {catalog} AND capture_id IN ({nums})",
                by_id = self.tables.by_id,
                nums = nums.join(", ")
            );
            let rows: Vec<ObjectKeyRow> = self
                .client
                .fetch_all(&format!(
                    "SELECT DISTINCT object_key FROM {by_version} WHERE catalog = {catalog} AND version IN ({written}) \
                     AND capture_id IN ({texts}) AND pack_id != '' AND (version, publish_id) IN (SELECT version, \
                     publish_id FROM {publishes} WHERE catalog = {catalog} AND version IN ({written}))",
                    by_version = self.tables.by_version,
                    publishes = self.tables.publishes,
                    texts = texts.join(", "),
                ))
                .await?;
            objects.extend(rows.into_iter().map(|row| row.object_key));
        }
        Ok(objects)
    }

    /// Remove orphan descriptor rows (never committed) below the watermark. Returns the watermark used.
    pub async fn gc_orphans(&self) -> Result<u64, CatalogError> {
        let watermark = self.watermark().await?;
        let tables = &self.tables;
        // `by_id` holds publish ids as 16 bytes: compared as text, like everywhere else.
        let mut orphans_in = tables.row_tables(self.client.server_version());
        orphans_in.extend([&tables.packs, &tables.retired_packs]);
        for table in orphans_in {
            let publish_id = if table == &tables.by_id { "UUIDNumToString(publish_id)" } else { "publish_id" };
            let removed = self
                .client
                .execute(&format!(
                    "ALTER TABLE {table} DELETE WHERE catalog = {catalog} AND version <= {watermark} AND \
                     (version, {publish_id}) NOT IN (SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog})",
                    catalog = self.catalog_literal(),
                    publishes = tables.publishes,
                ))
                .await;
            match removed {
                // Tables of a capstore older than `retired_packs`: nothing was retired.
                Err(error) if table == &tables.retired_packs && error.is_unknown_table() => {}
                other => other?,
            }
        }
        Ok(watermark)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_over_the_byte_budget_is_cut_with_a_cursor_at_its_last_capture() {
        let capture = |n: u64| CaptureLocation {
            capture_id: Uuid::from_u128(n as u128 + 1).to_string(),
            stream: "s".into(),
            captured_at_ns: n,
            pack_id: String::new(),
            object_key: String::new(),
            record_offset: 0,
            record_len: 0,
            payload_offset: 0,
            payload_len: 0,
            crc32c: 0,
            label_keys: vec!["k".into()],
            label_values: vec!["v".repeat(1000)],
            content_type: String::new(),
            version: 1,
        };
        let page = Page {
            captures: (0..10).map(capture).collect(),
            next_cursor: None,
            watermark: 7,
            window_ns: 5,
            first_window_ns: 5,
        };
        let row_bytes = serde_json::to_vec(&page.captures[0]).unwrap().len() + 1;
        let cut = page.clone().cut_to_bytes(row_bytes * 3 + row_bytes / 2);
        assert_eq!(cut.captures.len(), 3);
        let cursor = Cursor::decode(cut.next_cursor.as_deref().unwrap()).unwrap();
        assert_eq!((cursor.watermark, cursor.captured_at_ns), (7, 2));
        assert_eq!(page.clone().cut_to_bytes(usize::MAX).captures.len(), 10, "within the budget: untouched");
        assert_eq!(page.cut_to_bytes(1).captures.len(), 1, "one capture at least");
    }

    #[test]
    fn a_tail_entry_is_written_as_the_json_object_of_its_fields_in_key_order() {
        // The log's lines were written as `serde_json::Value` objects: keys in order, labels a map of them (a
        // repeated key once, with its last value). A consumer comparing lines must see the same bytes.
        let mut capture = tail_row(9, 1);
        capture.pack_id = "p".into();
        capture.content_type = "text/plain".into();
        capture.label_keys = vec!["site".into(), "a\"b".into(), "site".into()];
        capture.label_values = vec!["x".into(), "\u{1b}".into(), "y".into()];
        let as_map = |row: &CaptureLocation| {
            serde_json::json!({
                "version": row.version, "capture_id": row.capture_id, "stream": row.stream,
                "captured_at_ns": row.captured_at_ns, "size": row.payload_len, "labels": row.labels_map(),
                "content_type": row.content_type,
            })
            .to_string()
        };
        assert_eq!(capture.tail_entry().to_string(), as_map(&capture));
        capture.label_keys = vec!["a".into(), "b".into()];
        capture.label_values = vec!["1".into(), "2".into()];
        assert_eq!(capture.tail_entry().to_string(), as_map(&capture), "keys in order: written as they are");
        let deletion = tail_row(10, 1);
        let expected = serde_json::json!({
            "version": 10, "capture_id": deletion.capture_id, "stream": "s", "captured_at_ns": 0, "deleted": true,
        });
        assert_eq!(deletion.tail_entry().to_string(), expected.to_string());
        let expected = serde_json::json!({ "version": 11, "expired_before_ns": 5 });
        assert_eq!(horizon_entry(11, 5).to_string(), expected.to_string());
    }

    /// A row of the log: capture `id` at `version`, 10 bytes, stream `s`, captured at 0.
    fn tail_row(version: u64, id: u128) -> CaptureLocation {
        CaptureLocation {
            capture_id: Uuid::from_u128(id).to_string(),
            stream: "s".into(),
            captured_at_ns: 0,
            pack_id: String::new(),
            object_key: String::new(),
            record_offset: 0,
            record_len: 0,
            payload_offset: 0,
            payload_len: 10,
            crc32c: 0,
            label_keys: Vec::new(),
            label_values: Vec::new(),
            content_type: String::new(),
            version,
        }
    }

    #[test]
    fn a_tail_page_cut_short_goes_on_after_its_last_capture() {
        let row = tail_row;
        let from = TailPosition { version: 4, after_id: Some(Uuid::from_u128(3)) };
        let page = TailPage {
            captures: vec![row(5, 4), row(6, 1), row(6, 2), row(7, 1)],
            horizons: vec![(5, 100), (8, 200)],
            from,
            next: TailPosition::after_version(7),
        };
        let cut = page.clone().cut_by(25, |capture| capture.payload_len as usize);
        assert_eq!(
            (cut.captures.len(), cut.next),
            (2, TailPosition { version: 5, after_id: Some(Uuid::from_u128(1)) })
        );
        assert_eq!(page.clone().cut_by(1, |_| 100).captures.len(), 1, "one capture at least");
        assert_eq!(page.cut_by(usize::MAX, |_| 1).next, TailPosition::after_version(7), "within the budget: untouched");
        let id = Uuid::now_v7();
        for text in ["7".to_string(), format!("6:{id}"), "0".to_string()] {
            assert_eq!(TailPosition::parse(&text).unwrap().to_string(), text);
        }
        for bad in ["", "x", "1:", "1:2", "-1", "1:2:3"] {
            assert!(TailPosition::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn horizons_hide_by_the_reader_s_watermark_and_in_the_log_by_the_row_s_version() {
        let row = |version: u64, captured_at_ns: u64| CaptureLocation {
            captured_at_ns,
            pack_id: "p".into(),
            ..tail_row(version, 1)
        };
        let horizons = Horizons::for_test(vec![(5, 100), (9, 300)]);
        assert_eq!((horizons.before_at(4), horizons.before_at(5), horizons.before_at(u64::MAX)), (0, 100, 300));
        assert!(!horizons.hides_at(&row(1, 50), 4), "a reader pinned below the horizon still sees it");
        assert!(horizons.hides_at(&row(1, 50), 5) && !horizons.hides_at(&row(1, 100), 5));
        assert!(!horizons.hides_in_log(&row(3, 50)), "published before the horizon: in the log at its version");
        assert!(horizons.in_log(row(6, 50)).is_deletion(), "gone as it comes: a deletion at its own version");
        assert_eq!(horizons.in_log(row(6, 50)).version, 6);
        assert!(horizons.hides_in_log(&row(6, 50)), "published after it, captured before it: gone as it comes");
        assert!(!horizons.hides_in_log(&row(6, 150)) && horizons.hides_in_log(&row(10, 150)));
        assert_eq!(horizons.published_in(5, 9).collect::<Vec<_>>(), vec![(9, 300)]);
        let hidden = horizons.applied(row(1, 150), u64::MAX);
        assert!(hidden.is_deletion() && hidden.version == 9, "a deletion at the horizon that hides it: {hidden:?}");
        assert_eq!(horizons.applied(row(1, 150), 8), row(1, 150), "not at a watermark below that horizon");
        assert_eq!(horizons.applied(row(12, 350), u64::MAX), row(12, 350));
        let page = TailPage {
            captures: vec![row(4, 200), row(7, 400)],
            horizons: vec![(5, 100), (9, 300)],
            from: TailPosition::after_version(3),
            next: TailPosition::after_version(9),
        };
        let versions: Vec<u64> = page
            .entries()
            .iter()
            .map(|entry| serde_json::to_value(entry).unwrap()["version"].as_u64().unwrap())
            .collect();
        assert_eq!(versions, vec![4, 5, 7, 9], "entries in version order");
        assert_eq!(serde_json::to_value(&page.entries()[1]).unwrap()["expired_before_ns"], 100);
    }

    #[test]
    fn density_samples_are_used_again_for_a_minute_and_at_most_so_many_are_kept() {
        let start = Instant::now();
        let mut samples = DensitySamples::default();
        let stream = |n: usize| Some(format!("s/{n}"));
        samples.keep(&None, Some(7), start);
        assert_eq!(samples.fresh(&None, start + Duration::from_secs(59)), Some(Some(7)));
        assert_eq!(samples.fresh(&None, start + DENSITY_SAMPLE_REUSE), None, "a stale sample used");
        assert_eq!(samples.fresh(&stream(0), start), None);
        // Streams from requests: no more than DENSITY_SAMPLES_KEPT fresh samples, and a kept one is renewed.
        for n in 0..DENSITY_SAMPLES_KEPT + 10 {
            samples.keep(&stream(n), Some(n as u64), start);
        }
        assert_eq!(samples.taken.len(), DENSITY_SAMPLES_KEPT);
        assert_eq!(samples.fresh(&stream(DENSITY_SAMPLES_KEPT + 5), start), None);
        samples.keep(&None, None, start + Duration::from_secs(1));
        assert_eq!(samples.fresh(&None, start + Duration::from_secs(1)), Some(None));
        // Once they are stale, they make room.
        let later = start + DENSITY_SAMPLE_REUSE;
        samples.keep(&stream(99_999), Some(1), later);
        assert_eq!(samples.taken.len(), 2, "stale samples kept");
        assert_eq!(samples.fresh(&stream(99_999), later), Some(Some(1)));
    }

    #[test]
    fn known_catalogs_are_bounded_and_forget_the_least_recently_used_but_never_the_first() {
        let start = Instant::now();
        let first = CatalogKnowledge::default();
        let mut known = KnownCatalogs::new("first", first.clone());
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let kept_a = known.of("a", at(1));
        for n in 0..KNOWN_CATALOGS_KEPT as u64 - 2 {
            known.of(&format!("c{n}"), at(2 + n));
        }
        assert_eq!(known.by_name.len(), KNOWN_CATALOGS_KEPT);
        // "a" used again: the least recently used is now c0, which goes for the next new one.
        assert!(Arc::ptr_eq(&known.of("a", at(1000)).horizon_verdicts, &kept_a.horizon_verdicts));
        known.of("new", at(1001));
        assert_eq!(known.by_name.len(), KNOWN_CATALOGS_KEPT);
        assert!(!known.by_name.contains_key("c0") && known.by_name.contains_key("a"));
        // The first reader's catalog, used longest ago, is never the one forgotten.
        for n in 0..10u64 {
            known.of(&format!("more{n}"), at(2000 + n));
        }
        assert!(Arc::ptr_eq(&known.of("first", at(3000)).horizon_verdicts, &first.horizon_verdicts));
        assert_eq!(known.by_name.len(), KNOWN_CATALOGS_KEPT);
    }

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        let cursor = Cursor { watermark: 7, captured_at_ns: 123, capture_id: Uuid::now_v7(), window_ns: 9 };
        assert_eq!(Cursor::decode(&cursor.encode()).unwrap(), cursor);
        let older = format!("7.123.{}", cursor.capture_id);
        assert_eq!(Cursor::decode(&older).unwrap().window_ns, 0, "a cursor of an older build starts afresh");
        assert!(Cursor::decode(&format!("{older}.x")).is_err());
        assert!(Cursor::decode("7.x.y").is_err());
        assert!(Cursor::decode("").is_err());
    }
}
