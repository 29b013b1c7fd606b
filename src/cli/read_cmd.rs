//! `capstore get|ls|tail`: reading captures back.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use uuid::Uuid;

use capstore::bucket::Bucket;
use capstore::catalog::fleet;
use capstore::catalog::query::{CaptureLocation, ListQuery, TailPosition};
use capstore::catalog::tail::TailPages;
use capstore::config::Config;
use capstore::exit_code;
use capstore::reader::{LocalSpool, Reader};
use capstore::spool::SpoolPaths;

async fn reader(config: &Config) -> anyhow::Result<Reader> {
    let catalog = capstore::catalog::connect_reader(config).await?;
    let bucket = Arc::new(Bucket::from_config(config)?);
    Ok(Reader::new(catalog, bucket, Some(LocalSpool { paths: SpoolPaths::new(&config.spool.dir), index_opt: None })))
}

#[derive(Args)]
pub struct GetArgs {
    /// Capture id.
    id: Uuid,
    /// Write the payload here instead of standard output.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

pub fn get(config: &Config, args: GetArgs) -> anyhow::Result<i32> {
    let runtime = crate::cli::runtime()?;
    let found = runtime.block_on(async { reader(config).await?.get(args.id).await.map_err(anyhow::Error::from) })?;
    let Some(capture) = found else {
        eprintln!(
            "capstore get: capture {} not found in catalog {} nor in the local spool",
            args.id, config.catalog_name
        );
        return Ok(exit_code::FATAL);
    };
    match &args.output {
        Some(path) => {
            std::fs::write(path, &capture.payload).with_context(|| format!("cannot write {}", path.display()))?
        }
        None => std::io::stdout().lock().write_all(&capture.payload)?,
    }
    Ok(exit_code::CLEAN)
}

#[derive(Args)]
pub struct LsArgs {
    #[arg(long)]
    stream: Option<String>,
    /// Captured at or after: RFC 3339 (2026-11-30T07:00:00Z) or nanoseconds since the epoch.
    #[arg(long, value_parser = parse_time)]
    since: Option<u64>,
    /// Captured before: RFC 3339 or nanoseconds since the epoch.
    #[arg(long, value_parser = parse_time)]
    until: Option<u64>,
    /// Only captures with this label; repeatable (all must match).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = capstore::capture::parse_label)]
    labels: Vec<(String, String)>,
    /// At most this many captures (all of them when not given).
    #[arg(long)]
    limit: Option<u64>,
    /// One JSON object per line: capture_id, stream, captured_at_ns, size, labels, version (and catalog, with
    /// --catalog or --all-catalogs).
    #[arg(long)]
    json: bool,
    /// List these catalogs of the same tables together (comma separated) instead of catalog_name's, merged in time
    /// order; every capture shows its catalog.
    #[arg(long = "catalog", value_name = "NAME,...", value_delimiter = ',', value_parser = parse_catalog_name)]
    catalogs: Vec<String>,
    /// List every catalog that has published into the tables, as --catalog does.
    #[arg(long, conflicts_with = "catalogs")]
    all_catalogs: bool,
}

fn parse_catalog_name(text: &str) -> Result<String, String> {
    if capstore::config::is_catalog_name(text) {
        Ok(text.to_string())
    } else {
        Err(format!("{text:?} is not a catalog name (letters, digits, '.', '_', '-'; at most 64)"))
    }
}

/// RFC 3339 (`2026-11-30T07:00:00Z`), a UTC date (`2026-11-30`, its midnight) or nanoseconds since the epoch.
pub(super) fn parse_time(text: &str) -> Result<u64, String> {
    if let Ok(ns) = text.parse::<u64>() {
        return Ok(ns);
    }
    let is_date = text.len() == 10 && text.as_bytes().get(4) == Some(&b'-') && text.as_bytes().get(7) == Some(&b'-');
    let full = if is_date { format!("{text}T00:00:00Z") } else { text.to_string() };
    humantime::parse_rfc3339_weak(&full)
        .map(capstore::util::system_time_ns)
        .map_err(|_| format!("{text:?} is not an RFC 3339 time, a date (YYYY-MM-DD) or a number of nanoseconds"))
}

pub fn ls(config: &Config, args: LsArgs) -> anyhow::Result<i32> {
    let runtime = crate::cli::runtime()?;
    runtime.block_on(async {
        let reader = reader(config).await?;
        let catalogs = match (args.all_catalogs, args.catalogs.is_empty()) {
            (true, _) => Some(reader.catalog().catalog_names().await?),
            (false, false) => Some(args.catalogs.clone()),
            (false, true) => None,
        };
        let mut remaining = args.limit.unwrap_or(u64::MAX);
        let mut query = ListQuery {
            stream: args.stream.clone(),
            since_ns: args.since,
            until_ns: args.until,
            labels: args.labels.iter().cloned().collect::<BTreeMap<_, _>>(),
            limit: remaining.min(10_000),
            ..ListQuery::default()
        };
        let mut out = std::io::stdout().lock();
        if !args.json {
            let catalog_column = if catalogs.is_some() { format!("{:<20}  ", "catalog") } else { String::new() };
            writeln!(
                out,
                "{catalog_column}{:<36}  {:<24}  {:<20}  {:>10}  {:>7}  labels",
                "capture_id", "stream", "captured_at", "size", "version"
            )?;
        }
        while remaining > 0 {
            query.limit = remaining.min(10_000);
            let (captures, next_cursor): (Vec<(Option<String>, CaptureLocation)>, _) = match &catalogs {
                None => {
                    let page = reader.catalog().list(&query).await?;
                    (page.captures.into_iter().map(|capture| (None, capture)).collect(), page.next_cursor)
                }
                Some(catalogs) => {
                    let page = fleet::list(reader.catalog(), catalogs, &query, usize::MAX, |_| 1).await?;
                    let captures = page.captures.into_iter().map(|c| (Some(c.catalog), c.capture)).collect();
                    (captures, page.next_cursor)
                }
            };
            for (catalog, capture) in &captures {
                write_listed(&mut out, args.json, catalog.as_deref(), capture)?;
            }
            remaining = remaining.saturating_sub(captures.len() as u64);
            match next_cursor {
                Some(cursor) => query.cursor = Some(cursor),
                None => break,
            }
        }
        Ok(exit_code::CLEAN)
    })
}

/// One line of `capstore ls`: a JSON object, or a row of the table.
fn write_listed(
    out: &mut impl Write,
    json: bool,
    catalog: Option<&str>,
    capture: &CaptureLocation,
) -> std::io::Result<()> {
    if json {
        let mut line = serde_json::json!({
            "capture_id": capture.capture_id,
            "stream": capture.stream,
            "captured_at_ns": capture.captured_at_ns,
            "size": capture.payload_len,
            "labels": capture.labels_map(),
            "version": capture.version,
        });
        if let Some(catalog) = catalog {
            line["catalog"] = catalog.into();
        }
        return writeln!(out, "{line}");
    }
    let labels: Vec<String> =
        capture.labels_map().iter().map(|(key, value)| format!("{}={}", printable(key), printable(value))).collect();
    let catalog_column = catalog.map(|catalog| format!("{catalog:<20}  ")).unwrap_or_default();
    writeln!(
        out,
        "{catalog_column}{:<36}  {:<24}  {:<20}  {:>10}  {:>7}  {}",
        capture.capture_id,
        printable(&capture.stream),
        capstore::util::ns_to_rfc3339(capture.captured_at_ns),
        capture.payload_len,
        capture.version,
        labels.join(",")
    )
}

#[derive(Args)]
pub struct TailArgs {
    /// Print publishes after this version (0 = from the beginning), or after a `<version>:<capture_id>` position (the next version's captures up to that id, in id order, are skipped).
    #[arg(long, default_value = "0", value_parser = TailPosition::parse)]
    after: TailPosition,
    /// Keep polling for new publishes.
    #[arg(long)]
    follow: bool,
}

/// One JSON line per published capture, in version order: "everything after version N", exactly once.
pub fn tail(config: &Config, args: TailArgs) -> anyhow::Result<i32> {
    let runtime = crate::cli::runtime()?;
    runtime.block_on(async {
        let reader = reader(config).await?;
        // Without --follow: everything committed when the command started, however many reads that takes.
        let end_opt = if args.follow { None } else { Some(reader.catalog().watermark().await?) };
        // Read ahead: a tail catching up on a long history has a few pages in flight at once.
        let mut pages = TailPages::new(reader.catalog().clone(), args.after, end_opt, TAIL_CAPTURES_PER_READ);
        loop {
            let page = pages.next_page().await?;
            // Buffered: stdout is line-buffered, and a catching-up tail prints millions of lines.
            let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
            for entry in page.entries() {
                serde_json::to_writer(&mut out, &entry)?;
                out.write_all(b"\n")?;
            }
            out.flush()?;
            match (page.caught_up(), end_opt) {
                (true, Some(_)) => return Ok(exit_code::CLEAN),
                (true, None) => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
                (false, _) => {}
            }
        }
    })
}

/// Captures per catalog read of a catching-up tail.
pub(crate) const TAIL_CAPTURES_PER_READ: u64 = 20_000;

/// `text` with control characters escaped (`\u{1b}`, `\n`), so a label value cannot drive the terminal it is
/// printed on (escape sequences that move the cursor, retitle the window, or hide lines).
fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

#[cfg(test)]
mod tests {

    #[test]
    fn control_characters_are_escaped_for_the_terminal() {
        assert_eq!(super::printable("plain ü"), "plain ü");
        assert_eq!(super::printable("\u{1b}]0;pwned\u{7}x\ny"), "\\u{1b}]0;pwned\\u{7}x\\ny");
    }
}
