//! `capstore delete`: delete captures by id, or by stream, time range and labels.
//!
//! Only the lease holder publishes, so this command asks the running daemon (`POST /v1/captures/delete` at
//! `http.listen`, with the `http.token_file` token): each request is one fenced, versioned publish of up to
//! [`DELETE_BATCH`] ids. A query is listed from the catalog at one pinned watermark and deleted page by page, each
//! request naming that watermark: the captures it deletes are those the selection held when it started (a capture
//! published later, or posted again since, is not touched: the latter is reported as changed).
//!
//! Before deleting it counts what would go (`--dry-run` stops there) and, on a terminal, asks for confirmation;
//! elsewhere it needs `--yes`. Exit 0 when everything selected is deleted (or was already), 1 when an id was not
//! found, changed, or is still in the spool unpublished (pending: delete it again once it is published), 2 for a
//! usage error.

use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use uuid::Uuid;

use capstore::catalog::query::{CatalogReader, ListQuery};
use capstore::config::Config;
use capstore::exit_code;

/// Ids per deletion request (and per listing page of a query): one publish each.
const DELETE_BATCH: usize = 10_000;

#[derive(Args)]
pub struct DeleteArgs {
    /// A capture id to delete; repeatable.
    #[arg(long = "id", value_name = "ID", conflicts_with_all = ["ids", "stream"])]
    id: Vec<Uuid>,
    /// Delete the capture ids in this file (one per line).
    #[arg(long, value_name = "FILE", conflicts_with = "stream")]
    ids: Option<PathBuf>,
    /// Delete the published captures of this stream (with --since, --until and --label to narrow it).
    #[arg(long, required_unless_present_any = ["id", "ids"])]
    stream: Option<String>,
    /// Captured at or after: RFC 3339, a date (YYYY-MM-DD) or nanoseconds since the epoch.
    #[arg(long, value_parser = super::read_cmd::parse_time, requires = "stream")]
    since: Option<u64>,
    /// Captured before: RFC 3339, a date or nanoseconds since the epoch.
    #[arg(long, value_parser = super::read_cmd::parse_time, requires = "stream")]
    until: Option<u64>,
    /// Only captures with this label; repeatable (all must match).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = capstore::capture::parse_label, requires = "stream")]
    labels: Vec<(String, String)>,
    /// Count what would be deleted, delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Delete without asking (needed when standard input is not a terminal).
    #[arg(long, short = 'y')]
    yes: bool,
    /// Print the outcome as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Totals over every request of one `capstore delete`.
#[derive(Debug, Default, serde::Serialize)]
struct Totals {
    deleted: u64,
    already_deleted: u64,
    not_found: Vec<Uuid>,
    /// Posted again since the listing the deletion was planned on: not deleted.
    changed: Vec<Uuid>,
    pending: Vec<Uuid>,
    first_version: Option<u64>,
    last_version: Option<u64>,
    dry_run: bool,
}

#[derive(serde::Deserialize)]
struct Answer {
    deleted: Vec<Uuid>,
    already_deleted: Vec<Uuid>,
    not_found: Vec<Uuid>,
    changed: Vec<Uuid>,
    pending: Vec<Uuid>,
    version: Option<u64>,
}

impl Totals {
    fn add(&mut self, answer: Answer) {
        self.deleted += answer.deleted.len() as u64;
        self.already_deleted += answer.already_deleted.len() as u64;
        self.not_found.extend(answer.not_found);
        self.changed.extend(answer.changed);
        self.pending.extend(answer.pending);
        if let Some(version) = answer.version {
            self.first_version.get_or_insert(version);
            self.last_version = Some(version);
        }
    }
}

pub fn delete(config: &Config, args: DeleteArgs) -> anyhow::Result<i32> {
    if let Some(stream) = &args.stream {
        if let Err(problem) = capstore::capture::validate_stream(stream) {
            eprintln!("capstore delete: --stream {stream:?}: {problem}");
            return Ok(exit_code::CONFIG_OR_USAGE);
        }
    }
    let ids = match &args.ids {
        Some(path) => match super::read_ids_file(path, "delete")? {
            Ok(ids) => Some(ids),
            Err(code) => return Ok(code),
        },
        None if !args.id.is_empty() => Some(capstore::util::unique_ids(&args.id)),
        None => None,
    };
    let on_terminal = std::io::stdin().is_terminal();
    if !args.dry_run && !args.yes && !on_terminal {
        eprintln!(
            "capstore delete: standard input is not a terminal, so nobody can confirm: add --yes to delete \
             (or --dry-run to count what would be deleted)"
        );
        return Ok(exit_code::CONFIG_OR_USAGE);
    }
    let daemon = Daemon::from_config(config)?;
    let runtime = super::runtime()?;
    runtime.block_on(async {
        let catalog = match &ids {
            Some(_) => None,
            None => Some(capstore::catalog::connect_reader(config).await?),
        };
        let query = ListQuery {
            stream: args.stream.clone(),
            since_ns: args.since,
            until_ns: args.until,
            labels: args.labels.iter().cloned().collect::<BTreeMap<_, _>>(),
            limit: DELETE_BATCH as u64,
            ..ListQuery::default()
        };
        // What would go: a dry run of the ids, or a count of the listing (both at this moment).
        let (plan, watermark) = match (&ids, &catalog) {
            (Some(ids), _) => {
                let mut plan = Totals { dry_run: true, ..Totals::default() };
                for batch in ids.chunks(DELETE_BATCH) {
                    plan.add(daemon.delete(batch, None, true).await?);
                }
                (plan, None)
            }
            (None, Some(catalog)) => {
                let (count, watermark) = count_listed(catalog, &query).await?;
                (Totals { deleted: count, dry_run: true, ..Totals::default() }, Some(watermark))
            }
            (None, None) => unreachable!("a query has a catalog reader"),
        };
        let count = plan.deleted;
        if args.dry_run || count == 0 {
            return report(&Totals { dry_run: args.dry_run, ..plan }, args.json);
        }
        if !args.yes {
            let what = match &args.stream {
                Some(stream) => format!(
                    "{count} captures of stream {stream:?} (as published through version {})",
                    watermark.unwrap_or_default()
                ),
                None => format!("{count} captures"),
            };
            eprint!("capstore delete: delete {what} from catalog {}? [y/N] ", config.catalog_name);
            std::io::stderr().flush()?;
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line)?;
            if !matches!(line.trim(), "y" | "Y" | "yes") {
                eprintln!("capstore delete: nothing deleted");
                return Ok(exit_code::FATAL);
            }
        }
        let bar = super::progress(Some(count), "delete");
        let mut totals = Totals::default();
        match (&ids, &catalog) {
            (Some(ids), _) => {
                for batch in ids.chunks(DELETE_BATCH) {
                    totals.add(daemon.delete(batch, None, false).await?);
                    bar.set_position(totals.deleted);
                }
            }
            (None, Some(catalog)) => {
                // At the watermark it was counted at: what is published since is not deleted, and the deletions
                // published meanwhile do not move the listing.
                let mut query = ListQuery { watermark, ..query.clone() };
                loop {
                    let page = catalog.list(&query).await?;
                    let batch: Vec<Uuid> =
                        page.captures.iter().filter_map(|capture| Uuid::parse_str(&capture.capture_id).ok()).collect();
                    if !batch.is_empty() {
                        totals.add(daemon.delete(&batch, Some(page.watermark), false).await?);
                        bar.set_position(totals.deleted);
                    }
                    match page.next_cursor {
                        Some(next) => query.cursor = Some(next),
                        None => break,
                    }
                }
            }
            (None, None) => unreachable!("a query has a catalog reader"),
        }
        bar.finish_and_clear();
        report(&totals, args.json)
    })
}

/// How many captures the listing selects, and the watermark it was counted at.
async fn count_listed(catalog: &CatalogReader, query: &ListQuery) -> anyhow::Result<(u64, u64)> {
    let bar = super::progress(None, "counting");
    let (mut count, mut cursor) = (0u64, None);
    let watermark = loop {
        let page = catalog.list(&ListQuery { cursor: cursor.clone(), ..query.clone() }).await?;
        count += page.captures.len() as u64;
        bar.set_message(format!("{count} captures"));
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break page.watermark,
        }
    };
    bar.finish_and_clear();
    Ok((count, watermark))
}

fn report(totals: &Totals, json: bool) -> anyhow::Result<i32> {
    if json {
        println!("{}", serde_json::to_string(totals)?);
    } else {
        let verb = if totals.dry_run { "would delete" } else { "deleted" };
        let versions = match (totals.first_version, totals.last_version) {
            (Some(first), Some(last)) if first == last => format!(" at version {first}"),
            (Some(first), Some(last)) => format!(" at versions {first}-{last}"),
            _ => String::new(),
        };
        println!("{verb} {} captures{versions}; {} deleted already", totals.deleted, totals.already_deleted);
        for id in &totals.not_found {
            eprintln!("capstore delete: {id}: not found");
        }
        for id in &totals.changed {
            eprintln!("capstore delete: {id}: posted again since the selection was listed: not deleted");
        }
        for id in &totals.pending {
            eprintln!("capstore delete: {id}: not published yet (still in the spool): delete it again once it is");
        }
    }
    let complete = totals.not_found.is_empty() && totals.pending.is_empty() && totals.changed.is_empty();
    Ok(if complete { exit_code::CLEAN } else { exit_code::FATAL })
}

/// The running daemon's HTTP API, as this configuration names it.
struct Daemon {
    client: reqwest::Client,
    url: String,
    token: Option<String>,
}

impl Daemon {
    fn from_config(config: &Config) -> anyhow::Result<Daemon> {
        let listen: std::net::SocketAddr = config
            .http
            .listen
            .parse()
            .with_context(|| format!("http.listen = {:?} is not an address", config.http.listen))?;
        // A daemon listening on every address is reached on loopback.
        let host = match listen.ip() {
            ip if ip.is_unspecified() && ip.is_ipv4() => std::net::IpAddr::from([127, 0, 0, 1]),
            ip if ip.is_unspecified() => std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let token = match &config.http.token_file {
            Some(path) => Some(
                capstore::config::read_token_file(path)
                    .map_err(|reason| anyhow::anyhow!("http.token_file: {reason}"))?
                    .expose()
                    .to_string(),
            ),
            None => None,
        };
        let url = format!("http://{}/v1/captures/delete", std::net::SocketAddr::new(host, listen.port()));
        Ok(Daemon { client: reqwest::Client::new(), url, token })
    }

    /// One deletion request; a 503 (not holding the lease yet, the catalog away, an unknown outcome) is asked again
    /// after its `Retry-After`, for up to a minute: deleting is idempotent.
    async fn delete(&self, ids: &[Uuid], unchanged_since: Option<u64>, dry_run: bool) -> anyhow::Result<Answer> {
        let body = serde_json::json!({ "ids": ids, "dry_run": dry_run, "unchanged_since": unchanged_since });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let mut request = self.client.post(&self.url).json(&body);
            if let Some(token) = &self.token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.with_context(|| {
                format!("capstore delete asks the running daemon to publish the deletion: cannot reach {}", self.url)
            })?;
            let status = response.status();
            if status.is_success() {
                return response.json().await.context("the daemon's answer is not a deletion report");
            }
            let text = response.text().await.unwrap_or_default();
            let message = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|error| error["error"].as_str().map(str::to_string))
                .unwrap_or(text);
            if status == reqwest::StatusCode::SERVICE_UNAVAILABLE && std::time::Instant::now() < deadline {
                tracing::info!(%message, "the daemon cannot delete right now; asking again");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                continue;
            }
            anyhow::bail!("the daemon refused the deletion ({status}): {message}");
        }
    }
}
