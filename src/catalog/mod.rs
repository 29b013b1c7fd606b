//! The ClickHouse catalog: the tables that map every capture to its pack, the publisher lease and the publishes
//! watermark (design document, sections 6 and 7).
//!
//! - [`client`]: the only way the catalog talks to ClickHouse; classifies every failure once.
//! - [`read_limits`]: the time and memory limits of reads, within what the user's settings profile lets them set.
//! - [`schema`]: table names, DDL (single server or cluster), schema version stamp.
//! - [`lease`]: the lease statements and the fence ([`lease::LeaseStore`]), and the keeper task (renew, quarantine,
//!   latch, start wait: [`lease::LeaseKeeper`]).
//! - [`intents`]: the packs about to be uploaded, recorded before the upload, so a start reconciles without a listing.
//! - [`in_doubt`]: the publish attempts whose rows may still land, and how a publish keeps them below its rows.
//! - [`publish`]: publishing a batch of packs at version watermark + 1 behind the fence, with read-back.
//! - [`query`]: reads with a pinned watermark, tailing by version, garbage collection.
//! - [`tail`]: the log of publishes read a few pages ahead, for a tail catching up on a long history.
//! - [`fleet`]: listings across the catalogs of a fleet of daemons sharing the tables.
//! - [`retired`]: the packs a compaction replaced, and the removal of their objects after the reader grace period.
//! - [`purge`]: the removal of deleted captures' rows from the tables, once readers are done with them.
//! - [`repartition`]: moving tables created before schema 6 onto tables partitioned by month (an offline step).

pub mod client;
pub mod fleet;
pub mod in_doubt;
pub mod intents;
pub mod lease;
pub mod publish;
pub mod purge;
pub mod query;
pub mod read_limits;
pub mod repartition;
pub mod retired;
pub mod schema;
pub mod tail;

pub use client::{CatalogClient, CatalogError, ErrorKind};
pub use schema::Tables;

use crate::config::Config;

/// Connect to the catalog of `config` and make sure its tables exist at a schema version we understand.
pub async fn connect(config: &Config) -> Result<(CatalogClient, Tables), schema::SchemaError> {
    let client = CatalogClient::connect(&config.catalog).await?;
    let tables = Tables::from_config(&config.catalog);
    schema::ensure_schema(&client, &tables).await?;
    // ensure_schema leaves every object this server keeps in place: every replica must hold them too.
    client.require_objects(&tables.database, schema::objects_present(&client, &tables).await?);
    Ok((client, tables))
}

/// Connect to the catalog of `config` for reading only: nothing is created or stamped, and a catalog at another
/// schema version is refused with a message saying what to do.
pub async fn connect_reader(config: &Config) -> Result<query::CatalogReader, schema::SchemaError> {
    let client = CatalogClient::connect(&config.catalog).await?;
    let tables = Tables::from_config(&config.catalog);
    // Independent reads, each a round trip that every command would otherwise wait for in turn.
    let (checked, present) =
        tokio::join!(schema::check_schema(&client, &tables), schema::objects_present(&client, &tables));
    checked?;
    client.require_objects(&tables.database, present?);
    Ok(query::CatalogReader::new(client, tables, &config.catalog_name))
}
