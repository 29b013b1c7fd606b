//! `capstore lease show|break`, `gc`, `reconcile` and `verify`: operator views, interventions and repairs of the
//! catalog.

use std::sync::Arc;

use clap::Subcommand;

use capstore::bucket::Bucket;
use capstore::catalog::lease::{LeaseKeeper, LeaseStore, LeaseTimings, StartError};
use capstore::catalog::publish::Publisher;
use capstore::catalog::query::CatalogReader;
use capstore::catalog::{CatalogClient, Tables};
use capstore::config::Config;
use capstore::exit_code;
use capstore::pipeline::Pipeline;

#[derive(Subcommand)]
pub enum LeaseCommand {
    /// The head of the publisher lease: term, holder, time left, live or not.
    Show {
        #[arg(long)]
        json: bool,
    },
    /// Tombstone the head so a stuck lease frees at once. A live holder loses its lease (and re-claims it if it is
    /// still running); use only when the holder is known to be gone.
    Break {
        /// Required: breaking a lease is an operator decision.
        #[arg(long)]
        force: bool,
    },
}

/// The catalog with its tables created or upgraded (the lease and gc commands write into them).
async fn connect(config: &Config) -> anyhow::Result<(CatalogClient, Tables, LeaseStore)> {
    let (client, tables) = capstore::catalog::connect(config).await?;
    let timings = LeaseTimings::from_config(&config.lease, &client);
    let store = LeaseStore::new(client.clone(), &tables, &config.catalog_name, timings);
    Ok((client, tables, store))
}

pub fn lease(config: &Config, command: LeaseCommand) -> anyhow::Result<i32> {
    let runtime = crate::cli::runtime()?;
    runtime.block_on(async {
        let (_client, _tables, store) = connect(config).await?;
        match command {
            LeaseCommand::Show { json } => {
                let head = store.read_head().await?;
                if json {
                    let value = serde_json::json!({
                        "catalog": config.catalog_name,
                        "head_term": head.term,
                        "live": head.is_live(),
                        "expires_in_ms": head.time_left().as_millis() as u64,
                        "holders": head.entries,
                    });
                    println!("{}", serde_json::to_string_pretty(&value)?);
                } else if head.entries.is_empty() {
                    println!("catalog {}: no lease has ever been taken", config.catalog_name);
                } else {
                    println!(
                        "catalog {}: head term {}, {}, holder {}, expires in {:.1}s",
                        config.catalog_name,
                        head.term,
                        if head.is_live() { "LIVE" } else { "expired" },
                        head.holders(),
                        head.time_left().as_secs_f64()
                    );
                }
                Ok(exit_code::CLEAN)
            }
            LeaseCommand::Break { force } => {
                if !force {
                    eprintln!("capstore lease break: refusing without --force (a live holder would lose its lease)");
                    return Ok(exit_code::CONFIG_OR_USAGE);
                }
                let head = store.read_head().await?;
                if head.is_live() {
                    eprintln!(
                        "WARNING: the lease of catalog {} is LIVE (held by {}, {:.1}s left). Breaking it now; if that \
                         process is still running it will re-claim the lease. Its publishes fail the fence from now on, \
                         but one that passed it already may run for up to lease.publish_timeout: start no other \
                         publisher before that.",
                        config.catalog_name,
                        head.holders(),
                        head.time_left().as_secs_f64()
                    );
                }
                let broken = store.break_head().await?;
                println!("broke term {} held by {}", broken.term, broken.holders());
                Ok(exit_code::CLEAN)
            }
        }
    })
}

/// `capstore repartition`: see [`capstore::catalog::repartition`]. Exit 3 while a daemon holds a lease or a mutation
/// of the tables is still running.
pub fn repartition(config: &Config) -> anyhow::Result<i32> {
    use capstore::catalog::repartition::{repartition, RepartitionError};
    crate::cli::runtime()?.block_on(async {
        let client = capstore::catalog::CatalogClient::connect(&config.catalog).await?;
        let tables = capstore::catalog::Tables::from_config(&config.catalog);
        let bar = super::progress(None, "repartition");
        let result = repartition(&client, &tables, &|step| bar.set_message(step.to_string())).await;
        bar.finish_and_clear();
        match result {
            Ok(report) if report.already => {
                println!("the tables in {} are partitioned by month already", tables.database);
                Ok(exit_code::CLEAN)
            }
            Ok(report) => {
                println!("{}", serde_json::to_string_pretty(&report)?);
                eprintln!(
                    "capstore repartition: done; the old tables are kept as {} (drop them once satisfied)",
                    report.kept_as.join(", ")
                );
                Ok(exit_code::CLEAN)
            }
            Err(
                error @ (RepartitionError::LeaseLive(_)
                | RepartitionError::ClaimedMeanwhile(_)
                | RepartitionError::MutationsRunning(_)),
            ) => {
                eprintln!("capstore repartition: {error}");
                Ok(exit_code::CATALOG_HELD)
            }
            Err(error @ RepartitionError::Replicated) => {
                eprintln!("capstore repartition: {error}");
                Ok(exit_code::CONFIG_OR_USAGE)
            }
            Err(error) => Err(error.into()),
        }
    })
}

pub fn gc(config: &Config) -> anyhow::Result<i32> {
    let runtime = crate::cli::runtime()?;
    runtime.block_on(async {
        let (client, tables, store) = connect(config).await?;
        let intents = capstore::catalog::intents::IntentLog::new(client.clone(), tables.clone(), &config.catalog_name);
        let reader = CatalogReader::new(client, tables, &config.catalog_name);
        let bar = super::progress(Some(3), "gc");
        bar.set_message("orphan capture rows");
        let watermark = reader.gc_orphans().await?;
        bar.inc(1);
        bar.set_message("lease rows");
        let lease_terms = store.gc().await?;
        bar.inc(1);
        bar.set_message("upload intents");
        let intents_below = match intents.gc().await? {
            Some(mark) => format!("upload intents before the newest mark ({mark} ms)"),
            None => "no upload intents (no mark yet)".to_string(),
        };
        bar.finish_and_clear();
        println!(
            "catalog {}: deleting orphan rows at or below version {watermark}, lease rows below the head \
             ({lease_terms} terms) and {intents_below}; ClickHouse applies the deletes in the background",
            config.catalog_name
        );
        Ok(exit_code::CLEAN)
    })
}

#[derive(clap::Args)]
pub struct ReconcileArgs {
    /// Only packs whose key is dated on or after this UTC day (a key is dated by the pack's first capture): RFC 3339,
    /// a date (YYYY-MM-DD) or nanoseconds since the epoch. Without it, the whole catalog prefix is listed.
    #[arg(long, value_parser = super::read_cmd::parse_time)]
    since: Option<u64>,
    /// With --since: only packs dated on or before this UTC day (default: today).
    #[arg(long, value_parser = super::read_cmd::parse_time, requires = "since")]
    until: Option<u64>,
}

/// Days a windowed reconcile may list (one listing request per day prefix).
const MAX_RECONCILE_DAYS: u64 = 3660;

/// `capstore reconcile`: publish packs the bucket holds and the catalog lacks, streaming the listing (bounded memory)
/// with progress on a terminal. Needs the spool (for the publisher identity) and the lease, so run it while the daemon
/// is stopped (the daemon reconciles by intents at every start).
pub fn reconcile(config: &Config, args: ReconcileArgs) -> anyhow::Result<i32> {
    let days = match args.since {
        None => None,
        Some(since) => {
            let until = args.until.unwrap_or_else(|| capstore::util::system_time_ns(std::time::SystemTime::now()));
            if until < since {
                eprintln!("capstore reconcile: --until is before --since");
                return Ok(exit_code::CONFIG_OR_USAGE);
            }
            let days = capstore::bucket::DayRange::covering(since, until);
            if days.last - days.first >= MAX_RECONCILE_DAYS {
                eprintln!(
                    "capstore reconcile: --since to --until spans more than {MAX_RECONCILE_DAYS} days; leave both out \
                     to list the whole catalog prefix"
                );
                return Ok(exit_code::CONFIG_OR_USAGE);
            }
            Some(days)
        }
    };
    super::runtime()?.block_on(async {
        let spool = match super::own_spool(config, "stop the daemon first (it also reconciles at start)")? {
            Ok(spool) => spool,
            Err(exit_code) => return Ok(exit_code),
        };
        let (client, tables) = capstore::catalog::connect(config).await?;
        let keeper = LeaseKeeper::for_catalog(&client, &tables, config, spool.id());
        let (_stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let lease = match keeper.start(config.start_wait(), &mut stop_rx).await {
            Ok(lease) => lease,
            Err(error @ StartError::Refused { .. }) => {
                eprintln!("capstore reconcile: {error}");
                return Ok(exit_code::CATALOG_HELD);
            }
            Err(error) => return Err(error.into()),
        };
        let publisher = Arc::new(Publisher::new(client, tables, &config.catalog_name, lease.handle().clone()));
        let bucket = Arc::new(Bucket::from_config(config)?);
        let pipeline =
            Pipeline::new(Arc::new(config.clone()), spool.paths().clone(), bucket, publisher, lease.handle().clone());
        let bar = super::progress(None, "reconcile");
        let progress = |report: &capstore::pipeline::reconcile::ReconcileReport| {
            bar.set_message(format!(
                "{} objects listed, {} already published, {} published, {} invalid",
                report.examined, report.already_published, report.published, report.invalid_count
            ));
        };
        let result = pipeline.reconcile_listing(days, &progress).await;
        bar.finish_and_clear();
        lease.stop().await;
        let report = result?;
        println!("{}", serde_json::to_string_pretty(&report)?);
        Ok(if report.invalid_count == 0 { exit_code::CLEAN } else { exit_code::FATAL })
    })
}

/// `capstore verify`: every pack the catalog shows as published is in the bucket, reads back as a pack, and has the
/// size, SHA-256 and record count the catalog recorded. Exit 1 on any problem.
pub fn verify(config: &Config, json: bool) -> anyhow::Result<i32> {
    super::runtime()?.block_on(async {
        let catalog = capstore::catalog::connect_reader(config).await?;
        let bucket = Bucket::from_config(config)?;
        // A retired pack (replaced by compaction) may be gone from the bucket after its grace period.
        let retired = catalog.retired_packs().all_committed().await?;
        let mut packs = catalog.committed_packs().await?;
        packs.retain(|pack| uuid::Uuid::parse_str(&pack.pack_id).is_ok_and(|id| !retired.contains(&id)));
        let bar = super::progress(Some(packs.len() as u64), "verify");
        let mut problems = Vec::new();
        for pack in &packs {
            bar.inc(1);
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
        bar.finish_and_clear();
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
