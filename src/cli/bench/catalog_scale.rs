//! `capstore bench catalog-scale`: the catalog's reads at 1M, 10M, 100M captures, each beside the ideal (ClickHouse
//! answering the same question by primary key on a table ordered for it), in the same run, on the same server.
//!
//! Each size gets a database of its own (`<catalog.database>_scale_<rows>`, kept for the next run: loading is the
//! slow part), filled on the server with `INSERT ... SELECT FROM numbers()` into the current schema's tables (the
//! materialized views index the rows as a daemon's publishes would be): 100 streams, 100 captures per publish and
//! pack, one label of 7 values, 60 days of capture times. Reads run in this process through the same
//! [`CatalogReader`] the CLI and HTTP API use, so the figures leave out process start; the ideal runs on the same
//! client. Peak server memory per read comes from `system.query_log` when the server logs queries.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use uuid::Uuid;

use capstore::catalog::client::sql_string_literal;
use capstore::catalog::lease::LeaseKeeper;
use capstore::catalog::publish::{PublishError, Publisher};
use capstore::catalog::query::{CatalogReader, ListQuery, TailPosition};
use capstore::catalog::tail::TailPages;
use capstore::catalog::{CatalogClient, Tables};
use capstore::config::Config;

use super::catalog::{publish_until_committed, synthetic_pack, synthetic_pack_at};
use super::median;
use crate::cli::read_cmd::TAIL_CAPTURES_PER_READ;

/// The catalog name every scale database holds.
pub(super) const CATALOG: &str = "main";
const STREAMS: u64 = 100;
const CAPTURES_PER_PUBLISH: u64 = 100;
const FIRST_NS: u64 = 1_700_000_000_000_000_000;
const SPAN_NS: u64 = 60 * 86_400 * 1_000_000_000;
/// How long a load statement may run on the server.
const LOAD_TIMEOUT: Duration = Duration::from_secs(4 * 3600);

pub struct CatalogScaleOptions {
    pub config: Config,
    pub rows: Vec<u64>,
    pub repeats: usize,
    /// Captures a tail catch-up reads (at most the catalog's size).
    pub catch_up_captures: u64,
    pub publishes: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    pub rows: u64,
    pub read: String,
    pub capstore_ms: f64,
    pub ideal_ms: Option<f64>,
    /// capstore_ms / ideal_ms.
    pub ratio: Option<f64>,
    /// The largest `memory_usage` of the read's queries in `system.query_log` (None when the server logs none).
    pub peak_memory_mib: Option<f64>,
}

pub async fn catalog_scale(options: &CatalogScaleOptions) -> anyhow::Result<Vec<ScaleRow>> {
    let mut results = Vec::new();
    for &rows in &options.rows {
        let mut config = options.config.clone();
        config.catalog.database = format!("{}_scale_{rows}", options.config.catalog.database);
        config.catalog_name = CATALOG.to_string();
        let (client, tables) = capstore::catalog::connect(&config).await?;
        load(&client, &tables, rows).await?;
        let reader = CatalogReader::new(client.clone(), tables.clone(), CATALOG);
        let mut bench = Bench { client: &client, rows, repeats: options.repeats.max(1), results: &mut results };
        reads(&mut bench, &reader, &tables, options.catch_up_captures.min(rows)).await?;
        publishes(&mut bench, &config, &tables, options.publishes).await?;
    }
    Ok(results)
}

/// Fill the scale database with `rows` captures unless it holds them already.
pub(super) async fn load(client: &CatalogClient, tables: &Tables, rows: u64) -> anyhow::Result<()> {
    // The synthetic streams only: the publish timing adds rows of its own.
    let have = client
        .fetch_count(&format!(
            "SELECT count() FROM {} WHERE catalog = '{CATALOG}' AND stream LIKE 'sensor/%'",
            tables.captures
        ))
        .await?;
    if have == rows {
        // Loaded by this bench as it loads now: row 0 has the id it would be given.
        let first_id = client
            .fetch_count(&format!(
                "SELECT count() FROM {} WHERE catalog = '{CATALOG}' AND stream = 'sensor/0' AND captured_at_ns = \
                 {FIRST_NS} AND capture_id = {}",
                tables.captures,
                synthetic_capture_id("toUInt64(0)", &format!("toUInt64({FIRST_NS})"))
            ))
            .await?;
        anyhow::ensure!(
            first_id == 1,
            "{} holds {rows} captures loaded by an older bench (random capture ids, not UUIDv7): drop the database first",
            tables.database
        );
        eprintln!("catalog-scale: {} already holds {rows} captures", tables.database);
        return Ok(());
    }
    anyhow::ensure!(have == 0, "{} holds {have} captures, not {rows}: drop the database first", tables.database);
    eprintln!("catalog-scale: loading {rows} captures into {} on the server", tables.database);
    let started = Instant::now();
    let step = SPAN_NS / rows;
    // In chunks, each left to merge before the next: one statement of 100M rows writes its blocks as parts faster
    // than the server merges them, and the unmerged parts take twice the disk of the merged table.
    let mut first = 0;
    while first < rows {
        let chunk = LOAD_CHUNK_ROWS.min(rows - first);
        for statement in load_statements(tables, first, chunk, step) {
            client.execute_with_timeout(&statement, LOAD_TIMEOUT).await?;
        }
        first += chunk;
        wait_for_merges(client, &tables.database).await?;
        eprintln!("catalog-scale: {first} of {rows} loaded ({:.0} s)", started.elapsed().as_secs_f64());
    }
    eprintln!("catalog-scale: loaded in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Rows loaded per statement (see [`load`]).
const LOAD_CHUNK_ROWS: u64 = 10_000_000;

/// The statements that load captures `first..first + count` of a catalog whose captures are `step` ns apart.
fn load_statements(tables: &Tables, first: u64, count: u64, step: u64) -> [String; 3] {
    let source = format!(
        "SELECT number, intDiv(number, {CAPTURES_PER_PUBLISH}) + 1 AS v, toUInt64({FIRST_NS} + number * {step}) AS at \
         FROM numbers({first}, {count})"
    );
    let (capture, pack, publish) = (synthetic_capture_id("number", "at"), synthetic_id("v", 5), synthetic_id("v", 3));
    [
        format!(
            "INSERT INTO {captures} (catalog, stream, captured_at_ns, capture_id, pack_id, object_key, record_offset, \
             record_len, payload_offset, payload_len, crc32c, label_keys, label_values, content_type, version, \
             publish_id) SELECT '{CATALOG}', concat('sensor/', toString(number % {STREAMS})), at, {capture}, {pack}, \
             concat('p/', {pack}, '.cpk'), (number % 100) * 4200 + 64, 4200, (number % 100) * 4200 + 200, 4000, \
             toUInt32(cityHash64(number) % 4294967296), ['site'], [concat('s', toString(number % 7))], '', v, \
             {publish} FROM ({source})",
            captures = tables.captures,
        ),
        format!(
            "INSERT INTO {packs} (catalog, pack_id, object_key, bytes, sha256, records, first_captured_at_ns, \
             last_captured_at_ns, version, publish_id) SELECT '{CATALOG}', {pack}, concat('p/', {pack}, '.cpk'), \
             420000, '', {CAPTURES_PER_PUBLISH}, at, at, v, {publish} FROM ({source}) \
             WHERE number % {CAPTURES_PER_PUBLISH} = 0",
            packs = tables.packs,
        ),
        // The publishes last: a reader sees a publish only with all of its rows.
        format!(
            "INSERT INTO {publishes} (catalog, version, publish_id, holder, lease_term, packs, captures, \
             published_at_ms) SELECT '{CATALOG}', v, {publish}, 'bench', 1, 1, {CAPTURES_PER_PUBLISH}, \
             intDiv(at, 1000000) FROM ({source}) WHERE number % {CAPTURES_PER_PUBLISH} = 0",
            publishes = tables.publishes,
        ),
    ]
}

/// Wait until no merge runs in `database` (polled every 2 s, for at most the load timeout). This lets the merges
/// a chunk started finish; it does not wait for ones not yet scheduled, and merged-away parts stay on disk for the
/// server's `old_parts_lifetime` (8 minutes by default): at 100M rows keep 50 GB free or lower that setting.
async fn wait_for_merges(client: &CatalogClient, database: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    let sql = format!("SELECT count() FROM system.merges WHERE database = {}", sql_string_literal(database));
    while client.fetch_count(&sql).await? > 0 {
        anyhow::ensure!(started.elapsed() < LOAD_TIMEOUT, "merges in {database} still running after {LOAD_TIMEOUT:?}");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Ok(())
}

/// A capture id as the daemon gives one at ingest, a UUIDv7's text, made on the server: the millisecond of `at_ns` (the
/// capture's time: a live producer's captures are taken in as they are made), then hashes of `number`
/// (deterministic, so a read can name row n). The ids of captures close in time are close in `by_id`'s order, as in
/// a real catalog; wholly random ids would make every lookup of a page's ids read a granule per id.
fn synthetic_capture_id(number: &str, at_ns: &str) -> String {
    // 12 hex digits for every millisecond from 2004 to 10889, the span the synthetic times lie in.
    let time = format!("lower(hex(intDiv({at_ns}, 1000000)))");
    // A hash with its top bit set has 16 hex digits (`hex` leaves out leading zero bytes).
    let random = |salt: u64| format!("lower(hex(bitOr(cityHash64({number}, {salt}), 9223372036854775808)))");
    let (first, second) = (random(1), random(2));
    format!(
        "concat(substring({time}, 1, 8), '-', substring({time}, 9, 4), '-7', substring({first}, 2, 3), '-8', \
         substring({first}, 5, 3), '-', substring({second}, 2, 12))"
    )
}

/// A UUID's text made on the server from two hashes of `expression` (deterministic, so a read can name row n).
fn synthetic_id(expression: &str, salt: u64) -> String {
    format!(
        "UUIDNumToString(toFixedString(concat(reinterpretAsString(cityHash64({expression}, {salt})), \
         reinterpretAsString(cityHash64({expression}, {}))), 16))",
        salt + 1
    )
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct Text {
    value: String,
}

struct Bench<'a> {
    client: &'a CatalogClient,
    rows: u64,
    repeats: usize,
    results: &'a mut Vec<ScaleRow>,
}

impl Bench<'_> {
    /// Times `read` (median of the repeats), then `ideal` (a statement whose rows are discarded), and records both
    /// with the peak memory of the read's queries.
    async fn measure<F, Fut>(&mut self, name: &str, ideal: Option<String>, mut read: F) -> anyhow::Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        // query_log has whole-second times: a fresh second keeps this read's queries apart from the last one's.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let since = self.server_seconds().await?;
        let mut runs = Vec::with_capacity(self.repeats);
        for _ in 0..self.repeats {
            let started = Instant::now();
            read().await?;
            runs.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        let capstore_ms = median(&mut runs);
        let peak_memory_mib = self.peak_memory_since(since).await;
        let ideal_ms = match ideal {
            Some(sql) => {
                let mut runs = Vec::with_capacity(self.repeats);
                for _ in 0..self.repeats {
                    let started = Instant::now();
                    self.client.execute(&sql).await?;
                    runs.push(started.elapsed().as_secs_f64() * 1000.0);
                }
                Some(median(&mut runs))
            }
            None => None,
        };
        eprintln!("catalog-scale: {} rows, {name}: {capstore_ms:.1} ms (ideal {ideal_ms:?})", self.rows);
        self.results.push(ScaleRow {
            rows: self.rows,
            read: name.to_string(),
            capstore_ms,
            ideal_ms,
            ratio: ideal_ms.map(|ideal| capstore_ms / ideal),
            peak_memory_mib,
        });
        Ok(())
    }

    async fn server_seconds(&self) -> anyhow::Result<u64> {
        Ok(self.client.fetch_count("SELECT toUInt64(now())").await?)
    }

    async fn peak_memory_since(&self, since: u64) -> Option<f64> {
        self.client.execute("SYSTEM FLUSH LOGS").await.ok()?;
        let peak = self
            .client
            .fetch_count(&format!(
                "SELECT max(memory_usage) FROM system.query_log WHERE event_time >= toDateTime({since}) AND \
                 toUInt8(type) = 2 AND query NOT LIKE '%system.query_log%' AND query NOT LIKE 'SYSTEM%'"
            ))
            .await
            .ok()?;
        (peak > 0).then(|| peak as f64 / (1024.0 * 1024.0))
    }
}

async fn reads(bench: &mut Bench<'_>, reader: &CatalogReader, tables: &Tables, catch_up: u64) -> anyhow::Result<()> {
    let rows = bench.rows;
    let captures = &tables.captures;
    let by_version = &tables.by_version;
    let watermark = reader.watermark().await?;
    let at = |row: u64| FIRST_NS + row * (SPAN_NS / rows);
    let deep = 1_000_000.min(rows / 2);
    let middle_row = rows / 2;
    let middle_ids: Vec<Text> = bench
        .client
        .fetch_all(&format!(
            "SELECT {} AS value",
            synthetic_capture_id(&format!("toUInt64({middle_row})"), &format!("toUInt64({})", at(middle_row)))
        ))
        .await?;
    let middle = Uuid::parse_str(&middle_ids[0].value)?;
    let middle_version = middle_row / CAPTURES_PER_PUBLISH + 1;
    let stream = "sensor/7";

    bench
        .measure(
            "watermark",
            Some(format!("SELECT max(version) FROM {} WHERE catalog = '{CATALOG}'", tables.publishes)),
            || async { reader.watermark().await.map(drop).map_err(Into::into) },
        )
        .await?;
    bench
        .measure(
            "get by id",
            Some(format!(
                "SELECT * FROM {by_version} WHERE catalog = '{CATALOG}' AND version = {middle_version} AND \
                 capture_id = '{middle}'"
            )),
            || async {
                anyhow::ensure!(reader.get(middle, None).await?.is_some(), "{middle} not found");
                Ok(())
            },
        )
        .await?;
    let pages: [(&str, Option<&str>, u64); 4] = [
        ("ls stream, first page", Some(stream), 0),
        ("ls stream, page after 1M rows", Some(stream), deep),
        ("ls all streams, first page", None, 0),
        ("ls all streams, page after 1M rows", None, deep),
    ];
    for (name, stream, from_row) in pages {
        let since = at(from_row);
        let ideal = match stream {
            Some(stream) => format!(
                "SELECT * FROM {captures} WHERE catalog = '{CATALOG}' AND stream = '{stream}' AND \
                 captured_at_ns >= {since} ORDER BY captured_at_ns LIMIT 100"
            ),
            // by_version is ordered by time across streams here (versions follow time), and the page is the two
            // versions from the first one on: a key range on any server (18.16 cannot stop a sort at a limit).
            None => {
                let first_version = from_row / CAPTURES_PER_PUBLISH + 1;
                format!(
                    "SELECT * FROM {by_version} WHERE catalog = '{CATALOG}' AND version >= {first_version} AND \
                     version < {} ORDER BY version LIMIT 100",
                    first_version + 2
                )
            }
        };
        let query = ListQuery {
            stream: stream.map(str::to_string),
            since_ns: (from_row > 0).then_some(since),
            limit: 100,
            ..Default::default()
        };
        bench.measure(name, Some(ideal), || page(reader, &query, 100)).await?;
        if from_row == 0 {
            continue;
        }
        // The page after that one, by its cursor, as a client paging through a listing reads it; its ideal is the
        // same primary-key read as the page before's, from that page's last row on.
        let before = reader.list(&query).await?;
        let last = before.captures.last().context("a page after 1M rows is empty")?;
        let next = ListQuery { cursor: before.next_cursor.clone(), ..query.clone() };
        anyhow::ensure!(next.cursor.is_some(), "{name}: no cursor after a full page");
        let ideal = match stream {
            Some(stream) => format!(
                "SELECT * FROM {captures} WHERE catalog = '{CATALOG}' AND stream = '{stream}' AND \
                 captured_at_ns > {} ORDER BY captured_at_ns LIMIT 100",
                last.captured_at_ns
            ),
            None => format!(
                "SELECT * FROM {by_version} WHERE catalog = '{CATALOG}' AND version >= {} AND version < {} ORDER BY \
                 version LIMIT 100",
                last.version,
                last.version + 2
            ),
        };
        let next_name = name.replace("page after 1M rows", "the next page, by its cursor");
        bench.measure(&next_name, Some(ideal), || page(reader, &next, 100)).await?;
    }
    let labelled = ListQuery {
        stream: Some(stream.to_string()),
        labels: BTreeMap::from([("site".to_string(), "s3".to_string())]),
        limit: 100,
        ..Default::default()
    };
    bench
        .measure(
            "ls stream with a label",
            Some(format!(
                "SELECT * FROM {captures} WHERE catalog = '{CATALOG}' AND stream = '{stream}' AND \
                 label_values[indexOf(label_keys, 'site')] = 's3' ORDER BY captured_at_ns LIMIT 100"
            )),
            || page(reader, &labelled, 100),
        )
        .await?;
    // A stream holds a capture every `STREAMS * SPAN_NS / rows` ns (518 s at 1M, 5 s at 100M): its 10 s are
    // empty at 1M, and hold two captures at 100M. The read's name says how many.
    let (window_start, window_end) = (at(middle_row), at(middle_row) + 10_000_000_000);
    let window = ListQuery {
        stream: Some(stream.to_string()),
        since_ns: Some(window_start),
        until_ns: Some(window_end),
        limit: 100_000,
        ..Default::default()
    };
    let in_range_sql = |since: u64, until: u64| {
        format!(
            "SELECT * FROM {captures} WHERE catalog = '{CATALOG}' AND stream = '{stream}' AND captured_at_ns >= \
             {since} AND captured_at_ns < {until} ORDER BY captured_at_ns"
        )
    };
    // (The load writes each capture once, at one version: its rows are what a listing shows.)
    let in_window =
        bench.client.fetch_count(&format!("SELECT count() FROM ({})", in_range_sql(window_start, window_end))).await?
            as usize;
    bench
        .measure(
            &format!("ls stream, a 10 s window ({in_window} captures)"),
            Some(in_range_sql(window_start, window_end)),
            || page(reader, &window, in_window),
        )
        .await?;
    // A range with both ends that holds a page: 100 captures of each stream (from the middle on, so at 20,000
    // captures or more).
    if middle_row + 100 * STREAMS <= rows {
        let range_end = at(middle_row + 100 * STREAMS);
        let range = ListQuery { until_ns: Some(range_end), limit: 100, ..window.clone() };
        bench
            .measure("ls stream, a range of 100 captures", Some(in_range_sql(window_start, range_end)), || {
                page(reader, &range, 100)
            })
            .await?;
    }
    // The captures of the last five publishes: 100 each when loaded, fewer where an earlier run's timed publishes
    // are among them (a claim's empty commit before them, and fewer of them than five with `--publishes`).
    let last_five = bench
        .client
        .fetch_count(&format!(
            "SELECT sum(captures) FROM (SELECT any(captures) AS captures FROM {} WHERE catalog = '{CATALOG}' AND \
             version > {} GROUP BY version)",
            tables.publishes,
            watermark - 5
        ))
        .await?;
    bench
        .measure(
            "tail after W-5",
            Some(format!("SELECT * FROM {by_version} WHERE catalog = '{CATALOG}' AND version > {}", watermark - 5)),
            || async {
                let from = TailPosition::after_version(watermark - 5);
                let page = reader.tail_page(from, None, TAIL_CAPTURES_PER_READ).await?;
                let read = page.captures.len() as u64;
                anyhow::ensure!(read == last_five, "tail read {read} captures of the last five publishes' {last_five}");
                Ok(())
            },
        )
        .await?;
    let catch_up_versions = catch_up / CAPTURES_PER_PUBLISH;
    let started = Instant::now();
    let mut read = 0u64;
    // Pages as `capstore tail` reads them (read ahead).
    let from = TailPosition::after_version(0);
    let mut pages = TailPages::new(reader.clone(), from, Some(catch_up_versions), TAIL_CAPTURES_PER_READ);
    loop {
        let page = pages.next_page().await?;
        read += page.captures.len() as u64;
        if page.next.version >= catch_up_versions {
            break;
        }
        anyhow::ensure!(!page.caught_up(), "tail stopped at {} of {catch_up_versions}", page.next);
    }
    let seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    bench
        .client
        .execute(&format!(
            "SELECT * FROM {by_version} WHERE catalog = '{CATALOG}' AND version <= {catch_up_versions} FORMAT TSV"
        ))
        .await?;
    let ideal_seconds = started.elapsed().as_secs_f64();
    eprintln!("catalog-scale: {rows} rows, tail catch-up: {read} captures in {seconds:.1} s");
    bench.results.push(ScaleRow {
        rows,
        read: format!("tail catch-up, captures/s ({read} captures)"),
        capstore_ms: read as f64 / seconds,
        ideal_ms: Some(read as f64 / ideal_seconds),
        ratio: Some(ideal_seconds / seconds),
        peak_memory_mib: None,
    });
    Ok(())
}

/// The deletion of 10,000 captures (one publish of tombstones) in a catalog of its own in the big tables, beside the
/// ideal: the server copying the same 10,000 rows (what the tombstones write, without the plan that finds them).
async fn deletion(bench: &mut Bench<'_>, tables: &Tables, catalog: &str, publisher: &Publisher) -> anyhow::Result<()> {
    const DELETED: u64 = 10_000;
    let mut ids = Vec::new();
    for _ in 0..DELETED / CAPTURES_PER_PUBLISH {
        let pack = synthetic_pack(CAPTURES_PER_PUBLISH);
        ids.extend(pack.entries.iter().map(|entry| entry.meta.capture_id));
        publish_until_committed(publisher, &pack).await?;
    }
    let started = Instant::now();
    let report = loop {
        match publisher.publish_deletions(&ids, None).await {
            Err(PublishError::NotCommitted | PublishError::NoLease) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => break other?,
        }
    };
    let capstore_ms = started.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(report.deleted.len() as u64 == DELETED, "deleted {}", report.deleted.len());
    let captures = &tables.captures;
    let started = Instant::now();
    bench
        .client
        .execute(&format!(
            "INSERT INTO {captures} SELECT catalog, stream, captured_at_ns, capture_id, '', '', 0, 0, 0, 0, 0, \
             label_keys, label_values, content_type, 0, publish_id FROM {captures} WHERE catalog = '{catalog}' \
             AND pack_id != '' LIMIT {DELETED}"
        ))
        .await?;
    let ideal_ms = started.elapsed().as_secs_f64() * 1000.0;
    bench.results.push(ScaleRow {
        rows: bench.rows,
        read: format!("delete {DELETED} captures, ms (ideal: the server copying their rows)"),
        capstore_ms,
        ideal_ms: Some(ideal_ms),
        ratio: Some(capstore_ms / ideal_ms),
        peak_memory_mib: None,
    });
    Ok(())
}

/// Reads one page and checks it holds `expected` captures.
async fn page(reader: &CatalogReader, query: &ListQuery, expected: usize) -> anyhow::Result<()> {
    let page = reader.list(query).await?;
    anyhow::ensure!(page.captures.len() == expected, "a page of {}, not {expected}", page.captures.len());
    Ok(())
}

/// Publish duration p50 (100 captures per publish) into the big catalog and into an empty catalog of the same
/// tables: the catalog's part of ack -> listed, with and without the history. The two catalogs' publishes take
/// turns (each first in every other round), so both meet the same server: measured one catalog after the other, the
/// first met the merges of the reads' and the load's parts and came out 1.4-1.8x the second in every run.
async fn publishes(bench: &mut Bench<'_>, config: &Config, tables: &Tables, count: usize) -> anyhow::Result<()> {
    let empty = format!("empty-{}", Uuid::new_v4().simple());
    let (_shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let mut publishers = Vec::new();
    for catalog in [CATALOG.to_string(), empty.clone()] {
        let mut config = config.clone();
        config.catalog_name = catalog.clone();
        let keeper = LeaseKeeper::for_catalog(bench.client, tables, &config, Uuid::new_v4());
        let lease = keeper.start(config.start_wait(), &mut shutdown_rx.clone()).await?;
        let publisher = Publisher::new(bench.client.clone(), tables.clone(), &catalog, lease.handle().clone());
        publishers.push((catalog, lease, publisher, Vec::with_capacity(count)));
    }
    for publish in 0..count.max(1) as u64 {
        // Captured after the synthetic history, a second apart, as a producer's captures come in now: at its
        // start they would make every later run's first pages read a few thousand captures of one instant.
        let captured_at_ns = FIRST_NS + SPAN_NS + publish * 1_000_000_000;
        let turns: [usize; 2] = if publish % 2 == 0 { [0, 1] } else { [1, 0] };
        for turn in turns {
            let pack = synthetic_pack_at(CAPTURES_PER_PUBLISH, captured_at_ns);
            let (_, _, publisher, runs) = &mut publishers[turn];
            let started = Instant::now();
            publish_until_committed(publisher, &pack).await?;
            runs.push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let mut p50 = Vec::new();
    for (catalog, lease, publisher, mut runs) in publishers {
        if catalog == empty {
            deletion(bench, tables, &empty, &publisher).await?;
        }
        lease.stop().await;
        p50.push(median(&mut runs));
    }
    bench.results.push(ScaleRow {
        rows: bench.rows,
        read: "publish p50 ms (ideal: into an empty catalog, same tables)".to_string(),
        capstore_ms: p50[0],
        ideal_ms: Some(p50[1]),
        ratio: Some(p50[0] / p50[1]),
        peak_memory_mib: None,
    });
    Ok(())
}
