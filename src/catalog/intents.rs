//! Upload intents: the catalog's record of packs that may be in the bucket without being published, so that a start
//! finds them without listing the bucket.
//!
//! Before an upload round sends its packs, it records one `pack` row per pack in `intents`, with the pack's key. A pack
//! that is uploaded and then never published (its process died with its spool) is therefore named in the catalog, and
//! the next holder of the lease publishes it from the bucket (see `pipeline::reconcile`). Quickwit stages splits in
//! its metastore before uploading them for the same reason.
//!
//! What keeps this bounded is the *mark*: a `mark` row says "every intent older than me is resolved" (its pack is
//! published, or it was never uploaded, or it is re-recorded by a newer intent). A holder reads only the intents at or
//! after the newest mark, which `intent_marks` (a view keeping `max` per catalog) gives in one primary-key read.
//!
//! States and invariants:
//! - Every intent and mark row lands only inside the fence (`throwIf` makes a refused fence an error, so a statement
//!   that answers OK has landed), within `publish_timeout` (the lease the fence promises): the intents of other
//!   processes all land before this process's lease began, except a same-spool predecessor's, whose packs are in this
//!   spool.
//! - An upload round writes a mark (in the same statement as its intents, so at the same instant) only when its
//!   process has reconciled the intents since the last mark in its current tenure of the lease, nothing is owed, and
//!   every sealed pack of the spool is in the round: then every older intent is published, was never uploaded, or names a pack of
//!   this round. Times never go below the newest mark (`greatest(now, mark)`), so a server clock stepping back cannot
//!   hide an intent behind a mark.
//! - Reads are inclusive (`intent_at_ms >= mark`): on servers with whole-second clocks, rows of the mark's second are
//!   read again, which costs a few rows and misses none.
//! - Reads are sequentially consistent on a replicated catalog: a replica failed over to that lacks the newest
//!   intents must not let a start miss a pack and mark past it.

use uuid::Uuid;

use super::client::{sql_string_literal, CatalogClient, CatalogError};
use super::lease::{server_now_ms_expr, PublishPermit};
use super::schema::Tables;

/// The ClickHouse error code of `throwIf`: the fence refused an intent statement.
const FENCE_REFUSED_CODE: u32 = 395;

/// Intents read per request while reconciling.
pub const INTENTS_PER_READ: u64 = 1000;

/// One intended pack.
#[derive(Debug, Clone, PartialEq, Eq, clickhouse::Row, serde::Deserialize)]
pub struct Intent {
    pub intent_at_ms: u64,
    pub pack_id: String,
    pub object_key: String,
}

#[derive(clickhouse::Row, serde::Deserialize)]
struct MarkRow {
    marked_at_ms: u64,
    marks: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum IntentError {
    #[error("intents refused by the fence: the lease is not held with enough time left")]
    FenceRefused,
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

#[derive(Clone)]
pub struct IntentLog {
    client: CatalogClient,
    tables: Tables,
    catalog: String,
}

impl IntentLog {
    pub fn new(client: CatalogClient, tables: Tables, catalog: &str) -> IntentLog {
        IntentLog { client, tables, catalog: catalog.to_string() }
    }

    fn catalog_literal(&self) -> String {
        sql_string_literal(&self.catalog)
    }

    fn newest_mark_expr(&self) -> String {
        format!(
            "(SELECT maxMerge(marked_at_ms) FROM {} WHERE catalog = {})",
            self.tables.intent_marks,
            self.catalog_literal()
        )
    }

    /// The newest mark, or None when this catalog has none (it was created before intents, or never marked).
    pub async fn newest_mark(&self) -> Result<Option<u64>, CatalogError> {
        let rows: Vec<MarkRow> = self
            .client
            .fetch_few_deciding(&format!(
                "SELECT maxMerge(marked_at_ms) AS marked_at_ms, count() AS marks FROM {} WHERE catalog = {}",
                self.tables.intent_marks,
                self.catalog_literal()
            ))
            .await?;
        Ok(rows.first().filter(|row| row.marks > 0).map(|row| row.marked_at_ms))
    }

    /// Record `packs` (id, key) as about to be uploaded, and with `mark` a mark at the same instant. Lands only
    /// inside the fence of `permit`; an OK answer means every row landed. `statement_cap` is the lease's
    /// (`publish_timeout`): the fence promises only that much lease after it passes, so the rows must be in before
    /// the lease can pass to another holder (who reconciles from the newest mark).
    pub async fn record(
        &self,
        permit: &PublishPermit,
        packs: &[(Uuid, String)],
        mark: bool,
        statement_cap: std::time::Duration,
    ) -> Result<(), IntentError> {
        let mut entries: Vec<String> = packs
            .iter()
            .map(|(pack_id, key)| {
                format!("('pack', {}, {})", sql_string_literal(&pack_id.to_string()), sql_string_literal(key))
            })
            .collect();
        if mark {
            entries.push("('mark', '', '')".to_string());
        }
        if entries.is_empty() {
            return Ok(());
        }
        let sql = format!(
            "INSERT INTO {intents} (catalog, intent_at_ms, kind, pack_id, object_key, lease_term, holder) \
             SELECT {catalog}, greatest({now}, {mark}), tupleElement(entry, 1), tupleElement(entry, 2), \
             tupleElement(entry, 3), {term}, {holder} FROM system.one ARRAY JOIN [{entries}] AS entry \
             WHERE throwIf(NOT ({fence})) = 0",
            intents = self.tables.intents,
            catalog = self.catalog_literal(),
            now = server_now_ms_expr(&self.client),
            mark = self.newest_mark_expr(),
            term = permit.term,
            holder = sql_string_literal(&permit.holder),
            entries = entries.join(", "),
            fence = permit.fence,
        );
        // An unknown outcome needs no quarantine: intents that land late are harmless (the fence held when they
        // were checked, and no upload follows an error), and the round records its packs again.
        match self.client.execute_deciding(&sql, statement_cap).await {
            Ok(()) => Ok(()),
            Err(error) if error.server_code == Some(FENCE_REFUSED_CODE) => Err(IntentError::FenceRefused),
            Err(error) => Err(IntentError::Catalog(error)),
        }
    }

    /// Up to [`INTENTS_PER_READ`] pack intents at or after `since_ms`, after `after` (the last one of the previous
    /// read), in (time, pack id) order: a primary-key range.
    pub async fn read(&self, since_ms: u64, after: Option<&Intent>) -> Result<Vec<Intent>, CatalogError> {
        let after = match after {
            Some(last) => format!(
                " AND (intent_at_ms > {at} OR (intent_at_ms = {at} AND pack_id > {id}))",
                at = last.intent_at_ms,
                id = sql_string_literal(&last.pack_id)
            ),
            None => String::new(),
        };
        self.client
            .fetch_all_deciding(&format!(
                "SELECT intent_at_ms, pack_id, object_key FROM {intents} WHERE catalog = {catalog} \
                 AND intent_at_ms >= {since_ms}{after} AND kind = 'pack' ORDER BY intent_at_ms, pack_id \
                 LIMIT {INTENTS_PER_READ}",
                intents = self.tables.intents,
                catalog = self.catalog_literal(),
            ))
            .await
    }

    /// Remove the intents the newest mark has resolved (`capstore gc`). Returns the mark used, if any.
    pub async fn gc(&self) -> Result<Option<u64>, CatalogError> {
        let Some(mark) = self.newest_mark().await? else { return Ok(None) };
        self.client
            .execute(&format!(
                "ALTER TABLE {} DELETE WHERE catalog = {} AND intent_at_ms < {mark}",
                self.tables.intents,
                self.catalog_literal()
            ))
            .await?;
        Ok(Some(mark))
    }
}
