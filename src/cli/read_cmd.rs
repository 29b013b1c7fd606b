//! `capstore get|ls|tail|status|reconcile|verify`: reading captures back and looking at a running daemon.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use uuid::Uuid;

use capstore::bucket::Bucket;
use capstore::catalog::query::{CatalogReader, ListQuery};
use capstore::catalog::{CatalogClient, Tables};
use capstore::config::Config;
use capstore::exit_code;
use capstore::reader::Reader;
use capstore::spool::SpoolPaths;

async fn reader(config: &Config) -> anyhow::Result<Reader> {
    let client = CatalogClient::connect(&config.catalog).await?;
    let tables = Tables::new(&config.catalog.database, &config.catalog.table_prefix, config.catalog.cluster.as_deref());
    let catalog = CatalogReader::new(client, tables, &config.catalog_name);
    let bucket = Arc::new(Bucket::from_config(config)?);
    Ok(Reader::new(catalog, bucket, Some(SpoolPaths::new(&config.spool.dir))))
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
    let runtime = tokio::runtime::Runtime::new()?;
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
    /// One JSON object per line: capture_id, stream, captured_at_ns, size, labels, version.
    #[arg(long)]
    json: bool,
}

fn parse_time(text: &str) -> Result<u64, String> {
    if let Ok(ns) = text.parse::<u64>() {
        return Ok(ns);
    }
    humantime::parse_rfc3339_weak(text)
        .map(capstore::util::system_time_ns)
        .map_err(|_| format!("{text:?} is not an RFC 3339 time or a number of nanoseconds"))
}

pub fn ls(config: &Config, args: LsArgs) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let reader = reader(config).await?;
        let mut remaining = args.limit.unwrap_or(u64::MAX);
        let mut query = ListQuery {
            stream: args.stream.clone(),
            since_ns: args.since,
            until_ns: args.until,
            labels: args.labels.iter().cloned().collect::<BTreeMap<_, _>>(),
            limit: remaining.min(10_000),
            cursor: None,
        };
        let mut out = std::io::stdout().lock();
        if !args.json {
            writeln!(
                out,
                "{:<36}  {:<24}  {:<20}  {:>10}  {:>7}  labels",
                "capture_id", "stream", "captured_at", "size", "version"
            )?;
        }
        while remaining > 0 {
            query.limit = remaining.min(10_000);
            let page = reader.catalog().list(&query).await?;
            for capture in &page.captures {
                if args.json {
                    let line = serde_json::json!({
                        "capture_id": capture.capture_id,
                        "stream": capture.stream,
                        "captured_at_ns": capture.captured_at_ns,
                        "size": capture.payload_len,
                        "labels": capture.labels_map(),
                        "version": capture.version,
                    });
                    writeln!(out, "{line}")?;
                } else {
                    let labels: Vec<String> = capture.labels_map().iter().map(|(k, v)| format!("{k}={v}")).collect();
                    writeln!(
                        out,
                        "{:<36}  {:<24}  {:<20}  {:>10}  {:>7}  {}",
                        capture.capture_id,
                        capture.stream,
                        capstore::util::ns_to_rfc3339(capture.captured_at_ns),
                        capture.payload_len,
                        capture.version,
                        labels.join(",")
                    )?;
                }
            }
            remaining = remaining.saturating_sub(page.captures.len() as u64);
            match page.next_cursor {
                Some(cursor) => query.cursor = Some(cursor),
                None => break,
            }
        }
        Ok(exit_code::CLEAN)
    })
}

#[derive(Args)]
pub struct TailArgs {
    /// Print publishes after this version (0 = from the beginning).
    #[arg(long, default_value_t = 0)]
    after: u64,
    /// Keep polling for new publishes.
    #[arg(long)]
    follow: bool,
}

/// One JSON line per published capture, in version order: "everything after version N", exactly once.
pub fn tail(config: &Config, args: TailArgs) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let reader = reader(config).await?;
        let mut after = args.after;
        loop {
            let publishes = reader.catalog().publishes_after(after, 1000).await?;
            let mut out = std::io::stdout().lock();
            for publish in &publishes {
                for capture in reader.catalog().captures_of_version(publish.version).await? {
                    let line = serde_json::json!({
                        "version": publish.version,
                        "capture_id": capture.capture_id,
                        "stream": capture.stream,
                        "captured_at_ns": capture.captured_at_ns,
                        "size": capture.payload_len,
                        "labels": capture.labels_map(),
                    });
                    writeln!(out, "{line}")?;
                }
                after = publish.version;
            }
            out.flush()?;
            if !args.follow {
                return Ok(exit_code::CLEAN);
            }
            if publishes.is_empty() {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    })
}

/// `capstore status`: the daemon's last status snapshot, and whether that daemon is still alive.
pub fn status(config: &Config, json: bool) -> anyhow::Result<i32> {
    let path = config.spool.dir.join(capstore::pipeline::status::STATUS_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("no status at {} (has `capstore run` started on this spool?)", path.display()))?;
    let snapshot: serde_json::Value = serde_json::from_str(&text)?;
    let running = snapshot["pid"].as_u64().is_some_and(|pid| {
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        nix::sys::signal::kill(pid, None).is_ok() && capstore::spool::SpoolLock::acquire(&config.spool.dir).is_err()
    });
    if json {
        let mut snapshot = snapshot;
        snapshot["running"] = serde_json::Value::Bool(running);
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        println!("daemon {} (status of {})", if running { "RUNNING" } else { "NOT RUNNING" }, snapshot["updated_at"]);
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    }
    Ok(if running { exit_code::CLEAN } else { exit_code::FATAL })
}

/// `capstore reconcile`: publish packs the bucket holds and the catalog lacks. Needs the spool (for the publisher
/// identity) and the lease, so run it while the daemon is stopped (the daemon also reconciles at start).
pub fn reconcile(config: &Config) -> anyhow::Result<i32> {
    use capstore::catalog::lease::{Identity, LeaseKeeper, LeaseStore, LeaseTimings, StartError};
    use capstore::catalog::publish::Publisher;
    use capstore::pipeline::Pipeline;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let (spool, _recovery) = match capstore::spool::Spool::open(&config.spool) {
            Ok(opened) => opened,
            Err(error @ capstore::spool::SpoolError::Locked(_)) => {
                eprintln!("capstore reconcile: {error}; stop the daemon first (it also reconciles at start)");
                return Ok(exit_code::SPOOL_OWNED);
            }
            Err(error) => return Err(error.into()),
        };
        let (client, tables) = capstore::catalog::connect(config).await?;
        let identity =
            Identity { spool_id: spool.id(), host: capstore::spool::lock::host_name(), pid: std::process::id() };
        let timings = LeaseTimings::from_config(&config.lease, &client);
        let keeper = LeaseKeeper::new(
            LeaseStore::new(client.clone(), &tables, &config.catalog_name, timings),
            identity,
            &config.catalog_name,
        );
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        match keeper.acquire_at_start(config.start_wait(), &mut stop_rx).await {
            Ok(()) => {}
            Err(error @ StartError::Refused { .. }) => {
                eprintln!("capstore reconcile: {error}");
                return Ok(exit_code::CATALOG_HELD);
            }
            Err(error) => return Err(error.into()),
        }
        let lease = keeper.handle();
        let keeper_task = tokio::spawn(keeper.run(stop_rx));
        let publisher = Arc::new(Publisher::new(client, tables, &config.catalog_name, lease.clone()));
        let bucket = Arc::new(Bucket::from_config(config)?);
        let pipeline = Pipeline::new(Arc::new(config.clone()), spool.paths().clone(), bucket, publisher, lease);
        let on_terminal = std::io::stderr().is_terminal();
        let progress = move |done: u64, total: u64| {
            if on_terminal {
                eprint!("\rreconcile: {done}/{total} packs examined");
            }
        };
        let result = pipeline.reconcile(&progress).await;
        if on_terminal {
            eprintln!();
        }
        let _ = stop_tx.send(true);
        let _ = keeper_task.await;
        let report = result?;
        println!("{}", serde_json::to_string_pretty(&report)?);
        Ok(if report.invalid.is_empty() { exit_code::CLEAN } else { exit_code::FATAL })
    })
}

/// `capstore verify`: every pack the catalog shows as published is in the bucket, reads back as a pack, and has the
/// size, SHA-256 and record count the catalog recorded. Exit 1 on any problem.
pub fn verify(config: &Config, json: bool) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let client = CatalogClient::connect(&config.catalog).await?;
        let tables =
            Tables::new(&config.catalog.database, &config.catalog.table_prefix, config.catalog.cluster.as_deref());
        let catalog = CatalogReader::new(client, tables, &config.catalog_name);
        let bucket = Bucket::from_config(config)?;
        let packs = catalog.committed_packs().await?;
        let on_terminal = std::io::stderr().is_terminal();
        let mut problems = Vec::new();
        for (index, pack) in packs.iter().enumerate() {
            if on_terminal {
                eprint!("\rverify: {}/{} packs", index + 1, packs.len());
            }
            let problem = match bucket.read_pack_index(&pack.object_key).await {
                Err(error) => Some(error.to_string()),
                Ok(remote) if remote.size != pack.bytes => {
                    Some(format!("size {} in the bucket, {} in the catalog", remote.size, pack.bytes))
                }
                Ok(remote) if hex::encode(remote.trailer.sha256) != pack.sha256 => {
                    Some("SHA-256 differs from the catalog".into())
                }
                Ok(remote) if remote.entries.len() as u64 != pack.records => {
                    Some("record count differs from the catalog".into())
                }
                Ok(_) => None,
            };
            if let Some(problem) = problem {
                problems.push(
                    serde_json::json!({"pack_id": pack.pack_id, "object_key": pack.object_key, "problem": problem}),
                );
            }
        }
        if on_terminal {
            eprintln!();
        }
        if json {
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({"checked_packs": packs.len(), "problems": problems}))?
            );
        } else {
            for problem in &problems {
                println!("BAD  {}: {}", problem["object_key"], problem["problem"]);
            }
            println!("checked {} published packs: {} bad", packs.len(), problems.len());
        }
        Ok(if problems.is_empty() { exit_code::CLEAN } else { exit_code::FATAL })
    })
}
