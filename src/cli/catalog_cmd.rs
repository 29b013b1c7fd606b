//! `capstore lease show|break` and `capstore gc`: operator views and interventions on the catalog.

use clap::Subcommand;

use capstore::catalog::lease::{LeaseStore, LeaseTimings};
use capstore::catalog::query::CatalogReader;
use capstore::catalog::{CatalogClient, Tables};
use capstore::config::Config;
use capstore::exit_code;

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

async fn connect(config: &Config) -> anyhow::Result<(CatalogClient, Tables, LeaseStore)> {
    let client = CatalogClient::connect(&config.catalog).await?;
    let tables = Tables::new(&config.catalog.database, &config.catalog.table_prefix, config.catalog.cluster.as_deref());
    let timings = LeaseTimings::from_config(&config.lease, &client);
    let store = LeaseStore::new(client.clone(), &tables, &config.catalog_name, timings);
    Ok((client, tables, store))
}

pub fn lease(config: &Config, command: LeaseCommand) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
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
                         process is still running it will re-claim the lease, and publishes in flight fail the fence.",
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

pub fn gc(config: &Config) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let (client, tables, store) = connect(config).await?;
        let reader = CatalogReader::new(client, tables, &config.catalog_name);
        let watermark = reader.gc_orphans().await?;
        let lease_terms = store.gc().await?;
        println!(
            "catalog {}: deleting orphan rows at or below version {watermark} and lease rows below the head \
             ({lease_terms} terms); ClickHouse applies the deletes in the background",
            config.catalog_name
        );
        Ok(exit_code::CLEAN)
    })
}
