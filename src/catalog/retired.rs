//! Retired packs: the packs a compaction replaced, and the removal of their objects once readers are done with them.
//!
//! A compaction's switch-over publish ([`super::publish::Publisher::publish_relocation`]) writes one `retired_packs`
//! row per source pack, at its own version. States of a pack here:
//! - *retired*: a row with `removed_at_ms = 0` whose `(version, publish_id)` is committed. From that version on no
//!   capture's newest row names the pack; a reader pinned below it (a listing paged with an older cursor, a pinned
//!   `get`) may still read it, for `lifecycle.read_grace`.
//! - *removed*: a second row with the same pack, version and publish id and `removed_at_ms` set, written after its
//!   object was deleted from the bucket.
//!
//! A retired row whose publish never committed is an orphan that no read counts. Invariants: an object is deleted
//! only once its retirement is committed and older than the grace period by the server's clock (the publish's own
//! `published_at_ms`); deleting is idempotent (an object gone already counts as deleted), so a crash between a
//! delete and its removed row only deletes again.

use std::collections::HashSet;
use std::time::Duration;

use uuid::Uuid;

use super::client::{sql_string_literal, CatalogClient, CatalogError};
use super::lease::server_now_ms_expr;
use super::schema::Tables;

/// A row of `retired_packs`.
#[derive(clickhouse::Row, serde::Serialize)]
pub(super) struct RetiredPackRow {
    pub catalog: String,
    pub pack_id: String,
    pub object_key: String,
    pub version: u64,
    pub publish_id: String,
    pub removed_at_ms: u64,
}

/// A retired pack whose grace period is over and whose object is still to be removed.
#[derive(Debug, Clone, PartialEq, Eq, clickhouse::Row, serde::Deserialize)]
pub struct DuePack {
    pub pack_id: String,
    pub object_key: String,
    pub version: u64,
    pub publish_id: String,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct PackIdRow {
    pack_id: String,
}

#[derive(Clone)]
pub struct RetiredPacks {
    client: CatalogClient,
    tables: Tables,
    catalog: String,
}

impl RetiredPacks {
    pub fn new(client: CatalogClient, tables: Tables, catalog: &str) -> RetiredPacks {
        RetiredPacks { client, tables, catalog: catalog.to_string() }
    }

    fn committed(&self, versions_from: &str) -> String {
        format!(
            "(version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE catalog = {catalog} AND \
             version IN (SELECT version FROM {retired} WHERE {versions_from}))",
            publishes = self.tables.publishes,
            catalog = sql_string_literal(&self.catalog),
            retired = self.tables.retired_packs,
        )
    }

    /// The ids among `pack_ids` that a committed publish retired.
    pub async fn committed_among(&self, pack_ids: &[Uuid]) -> Result<HashSet<Uuid>, CatalogError> {
        if pack_ids.is_empty() {
            return Ok(HashSet::new());
        }
        let list: Vec<String> = pack_ids.iter().map(|id| sql_string_literal(&id.to_string())).collect();
        let filter = format!("catalog = {} AND pack_id IN ({})", sql_string_literal(&self.catalog), list.join(", "));
        self.pack_ids_where(&filter).await
    }

    /// Every pack of the catalog a committed publish retired (removed or not). O(retired packs).
    pub async fn all_committed(&self) -> Result<HashSet<Uuid>, CatalogError> {
        match self.pack_ids_where(&format!("catalog = {}", sql_string_literal(&self.catalog))).await {
            Err(error) if error.is_unknown_table() => Ok(HashSet::new()),
            answer => answer,
        }
    }

    async fn pack_ids_where(&self, filter: &str) -> Result<HashSet<Uuid>, CatalogError> {
        let rows: Vec<PackIdRow> = self
            .client
            .fetch_all(&format!(
                "SELECT DISTINCT pack_id FROM {retired} WHERE {filter} AND {committed}",
                retired = self.tables.retired_packs,
                committed = self.committed(filter),
            ))
            .await?;
        Ok(rows.iter().filter_map(|row| Uuid::parse_str(&row.pack_id).ok()).collect())
    }

    /// Retired packs at versions above `after_version` whose retirement committed at least `grace` ago (server
    /// time) and whose object is not removed yet, oldest first, at most `limit`.
    pub async fn due(&self, grace: Duration, after_version: u64, limit: u64) -> Result<Vec<DuePack>, CatalogError> {
        let catalog = sql_string_literal(&self.catalog);
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        let range = format!("catalog = {catalog} AND version > {after_version}");
        self.client
            .fetch_all(&format!(
                "SELECT pack_id, object_key, version, publish_id FROM {retired} WHERE {range} AND \
                 (version, publish_id) IN (SELECT version, publish_id FROM {publishes} WHERE {range} AND \
                 published_at_ms + {grace_ms} <= {now}) \
                 GROUP BY pack_id, object_key, version, publish_id HAVING max(removed_at_ms) = 0 \
                 ORDER BY version, pack_id LIMIT {limit}",
                retired = self.tables.retired_packs,
                publishes = self.tables.publishes,
                now = server_now_ms_expr(&self.client),
            ))
            .await
    }

    /// Record that the objects of `packs` are deleted from the bucket.
    pub async fn mark_removed(&self, packs: &[DuePack]) -> Result<(), CatalogError> {
        let now_ms = crate::util::now_ns() / 1_000_000;
        let rows: Vec<RetiredPackRow> = packs
            .iter()
            .map(|pack| RetiredPackRow {
                catalog: self.catalog.clone(),
                pack_id: pack.pack_id.clone(),
                object_key: pack.object_key.clone(),
                version: pack.version,
                publish_id: pack.publish_id.clone(),
                removed_at_ms: now_ms.max(1),
            })
            .collect();
        self.client.insert_rows(&self.tables.retired_packs, &rows).await
    }
}
