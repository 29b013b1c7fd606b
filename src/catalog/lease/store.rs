//! The lease statements on the `lease` table: read the head, claim, renew, release, break, and the fence that every
//! publishing statement carries. Stateless apart from the client: the [`super::LeaseKeeper`] holds the state.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{holder_spool_id, Identity, LeaseTimings, DEADLINE_MARGIN};
use crate::catalog::client::{sql_string_literal, CatalogClient, CatalogError};
use crate::catalog::schema::Tables;

/// One lease_id at the head term.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, clickhouse::Row, serde::Deserialize)]
pub struct HeadEntry {
    pub term: u64,
    pub lease_id: String,
    pub holder: String,
    /// Minimum over this lease_id's rows at the head term.
    pub expires_at_ms: u64,
    pub rows: u64,
    pub server_now_ms: u64,
}

/// The head of the lease table as read at one instant.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Head {
    /// 0 when the table holds no lease for this catalog.
    pub term: u64,
    pub entries: Vec<HeadEntry>,
}

impl Head {
    fn server_now_ms(&self) -> u64 {
        self.entries.first().map_or(0, |entry| entry.server_now_ms)
    }

    pub fn is_live(&self) -> bool {
        self.entries.iter().any(|entry| entry.expires_at_ms > entry.server_now_ms)
    }

    /// Time until the latest expiry at the head (zero when not live).
    pub fn time_left(&self) -> Duration {
        let latest = self.entries.iter().map(|entry| entry.expires_at_ms).max().unwrap_or(0);
        Duration::from_millis(latest.saturating_sub(self.server_now_ms()))
    }

    pub fn holders(&self) -> String {
        let holders: Vec<&str> = self.entries.iter().map(|entry| entry.holder.as_str()).collect();
        if holders.is_empty() {
            "nobody".into()
        } else {
            holders.join(", ")
        }
    }

    /// The single lease_id of the head, if it has exactly one.
    fn sole_entry(&self) -> Option<&HeadEntry> {
        match self.entries.as_slice() {
            [only] => Some(only),
            _ => None,
        }
    }
}

/// The head term a claim followed: its term and lease_ids. Term 0 with no lease_ids: a claim over a catalog whose
/// lease rows were removed after rows were written into it, which follows holders no one can name (never a term
/// this process confirmed: terms start at 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowedTerm {
    pub term: u64,
    pub lease_ids: Vec<String>,
}

/// What a claim or renewal came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// `publish_not_before` is set after a same-spool takeover of a live head: see [`LeaseStore::claim`].
    /// `followed`: the term a claim's term follows (none for a renewal, and for the first claim of a catalog nothing
    /// was written into), whose publish attempts may still land (see [`crate::catalog::in_doubt`]).
    Held { term: u64, deadline: Instant, publish_not_before: Option<Instant>, followed: Option<FollowedTerm> },
    /// Another holder's live lease (or a contested term) stands in the way.
    Refused { holder: String, time_left: Duration },
    /// The head moved between our read and our insert; nothing of ours landed. Try again.
    Raced,
}

/// The lease statements of one catalog name.
#[derive(Clone)]
pub struct LeaseStore {
    client: CatalogClient,
    table: String,
    /// The `schema` table: a claim is refused while `capstore repartition` runs on the tables.
    schema_table: String,
    /// `publishes`, `packs` and `captures`: whether a catalog without lease rows has had a publisher
    /// ([`LeaseStore::claim`]).
    publishes_table: String,
    packs_table: String,
    captures_table: String,
    catalog: String,
    timings: LeaseTimings,
}

impl LeaseStore {
    pub fn new(client: CatalogClient, tables: &Tables, catalog: &str, timings: LeaseTimings) -> LeaseStore {
        LeaseStore {
            client,
            table: tables.lease.clone(),
            schema_table: tables.schema.clone(),
            publishes_table: tables.publishes.clone(),
            packs_table: tables.packs.clone(),
            captures_table: tables.captures.clone(),
            catalog: catalog.to_string(),
            timings,
        }
    }

    pub fn timings(&self) -> LeaseTimings {
        self.timings
    }

    fn catalog_literal(&self) -> String {
        sql_string_literal(&self.catalog)
    }

    /// Server time in milliseconds, as an SQL expression for this server version.
    fn server_now_ms(&self) -> &'static str {
        server_now_ms_expr(&self.client)
    }

    pub async fn read_head(&self) -> Result<Head, CatalogError> {
        let catalog = self.catalog_literal();
        let sql = format!(
            "SELECT term, lease_id, holder, min(expires_at_ms) AS expires_at_ms, count() AS rows, \
             max({now}) AS server_now_ms FROM {table} \
             WHERE catalog = {catalog} AND term = (SELECT max(term) FROM {table} WHERE catalog = {catalog}) \
             GROUP BY term, lease_id, holder ORDER BY lease_id",
            now = self.server_now_ms(),
            table = self.table,
        );
        let entries: Vec<HeadEntry> = self.client.fetch_few_deciding(&sql).await?;
        Ok(Head { term: entries.first().map_or(0, |entry| entry.term), entries })
    }

    async fn read_term(&self, term: u64) -> Result<Vec<HeadEntry>, CatalogError> {
        let sql = format!(
            "SELECT term, lease_id, holder, min(expires_at_ms) AS expires_at_ms, count() AS rows, \
             max({now}) AS server_now_ms FROM {table} WHERE catalog = {catalog} AND term = {term} \
             GROUP BY term, lease_id, holder ORDER BY lease_id",
            now = self.server_now_ms(),
            table = self.table,
            catalog = self.catalog_literal(),
        );
        self.client.fetch_few_deciding(&sql).await
    }

    /// Whether any publish, or any attempt at one, has landed a row in the catalog: in `publishes`, `packs` or
    /// `captures` (an attempt inserts into `captures` first, then `packs`, then commits). Each is keyed by catalog
    /// first, so this reads a granule of each.
    async fn catalog_written(&self) -> Result<bool, CatalogError> {
        let catalog = self.catalog_literal();
        let sql = format!(
            "SELECT count() FROM (SELECT 1 FROM {publishes} WHERE catalog = {catalog} LIMIT 1 \
             UNION ALL SELECT 1 FROM {packs} WHERE catalog = {catalog} LIMIT 1 \
             UNION ALL SELECT 1 FROM {captures} WHERE catalog = {catalog} LIMIT 1)",
            publishes = self.publishes_table,
            packs = self.packs_table,
            captures = self.captures_table,
        );
        let found: Vec<u64> = self.client.fetch_few_deciding(&sql).await?;
        Ok(found.first().is_some_and(|rows| *rows > 0))
    }

    /// Claim the lease at head+1 (see the module doc). `identity` decides same-spool takeover.
    pub async fn claim(&self, lease_id: &str, identity: &Identity) -> Result<ClaimOutcome, CatalogError> {
        let head = self.read_head().await?;
        // No lease row, but rows written: the lease rows were removed (a truncated or dropped lease table), and the
        // holders before may have publish attempts that still land. Best effort: an attempt none of whose rows has
        // landed yet cannot be seen, and a holder whose lease rows were removed while it lived may publish until its
        // own local deadline (as after `lease break --force`). Asked before the claim, so that a failed read leaves
        // nothing of ours behind.
        let written_without_lease = head.entries.is_empty() && self.catalog_written().await?;
        // Over a live head of our spool: a dead predecessor's (a takeover), a claim of this process's own that went
        // unanswered at start (the retry has a fresh lease_id, and the claim it follows may itself have been a
        // takeover), or this process's own lease after a local loss.
        let over_live_head = head.is_live();
        if over_live_head {
            let ours = head.sole_entry().is_some_and(|entry| entry.lease_id == lease_id);
            // Every lease_id at the head our spool's, contested ones too: a start's retry may land beside its own
            // unanswered claim, and neither holds.
            let takeover = head.entries.iter().all(|entry| holder_spool_id(&entry.holder) == Some(identity.spool_id));
            if !ours && !takeover {
                return Ok(ClaimOutcome::Refused { holder: head.holders(), time_left: head.time_left() });
            }
        }
        // Not while the tables are being repartitioned (their mark's newest version is odd): a daemon that started
        // just before the run began must not publish into tables that are being copied and swapped.
        let condition = format!(
            "(SELECT max(term) FROM {table} WHERE catalog = {catalog}) = {term} AND \
             (SELECT max(version) % 2 FROM {schema} WHERE component = {repartition}) = 0",
            table = self.table,
            catalog = self.catalog_literal(),
            term = head.term,
            schema = self.schema_table,
            repartition = sql_string_literal(super::super::schema::REPARTITION_COMPONENT),
        );
        let mut outcome =
            self.insert_and_read_back(head.term + 1, lease_id, &identity.holder(), "claim", &condition).await?;
        if let ClaimOutcome::Held { followed, .. } = &mut outcome {
            *followed = (!head.entries.is_empty() || written_without_lease).then(|| FollowedTerm {
                term: head.term,
                lease_ids: head.entries.iter().map(|entry| entry.lease_id.clone()).collect(),
            });
        }
        match outcome {
            // Same-spool takeover: the predecessor is dead, but a publish of its can pass its fence right up to the
            // moment our claim row lands, and then run on the server for up to max_execution_time. So we hold the
            // lease at once (no rival can take it) but publish nothing until publish_timeout + clock skew after our
            // claim is known to have landed, i.e. after its read-back returned (specs/takeover.pml, EMB_REPLY; counting
            // from when the claim was sent is too short: EMB_SENT is refuted). Every claim over a live head of our
            // spool waits the same, whoever wrote that head: after a start's unanswered takeover claim, the head its
            // retry follows is that claim, and the predecessor's publish may still run (START_KEEPS_ID with
            // OWN_HEAD_AT_ONCE, the code before, is refuted).
            ClaimOutcome::Held { term, deadline, followed, .. } if over_live_head => {
                let embargo = self.timings.fence_margin() + DEADLINE_MARGIN;
                tracing::info!(term, ?embargo, "claimed over a live head of this spool: publishing after an embargo");
                let publish_not_before = Some(Instant::now() + embargo);
                Ok(ClaimOutcome::Held { term, deadline, publish_not_before, followed })
            }
            other => Ok(other),
        }
    }

    /// Renew our lease at `term` + 1; refused if our term is no longer the live head.
    pub async fn renew(&self, lease_id: &str, identity: &Identity, term: u64) -> Result<ClaimOutcome, CatalogError> {
        let catalog = self.catalog_literal();
        let condition = format!(
            "(SELECT max(term) FROM {table} WHERE catalog = {catalog}) = {term} AND \
             (SELECT min(expires_at_ms) FROM {table} WHERE catalog = {catalog} AND term = {term} AND lease_id = {id}) \
             > {now}",
            table = self.table,
            id = sql_string_literal(lease_id),
            now = self.server_now_ms(),
        );
        self.insert_and_read_back(term + 1, lease_id, &identity.holder(), "renew", &condition).await
    }

    async fn insert_and_read_back(
        &self,
        term: u64,
        lease_id: &str,
        holder: &str,
        kind: &str,
        condition: &str,
    ) -> Result<ClaimOutcome, CatalogError> {
        let sql = self.lease_row_sql(term, lease_id, holder, kind, self.timings.ttl, Some(condition));
        // The deadline counts from before the request left: the server stamped the expiry no earlier than this.
        let sent_at = Instant::now();
        self.client.execute_deciding(&sql, self.timings.statement_cap()).await?;
        let entries = self.read_term(term).await?;
        let ours = entries.iter().any(|entry| entry.lease_id == lease_id);
        match (entries.len(), ours) {
            (1, true) => Ok(ClaimOutcome::Held {
                term,
                deadline: sent_at + self.timings.local_lifetime(),
                publish_not_before: None,
                followed: None,
            }),
            (0, _) => {
                // Our condition failed: somebody moved the head. Name them if they hold it now.
                let head = self.read_head().await?;
                let someone_else = head.is_live() && !head.entries.iter().any(|entry| entry.lease_id == lease_id);
                if someone_else {
                    Ok(ClaimOutcome::Refused { holder: head.holders(), time_left: head.time_left() })
                } else {
                    Ok(ClaimOutcome::Raced)
                }
            }
            _ => {
                let contested = Head { term, entries };
                let others: Vec<String> = contested
                    .entries
                    .iter()
                    .filter(|entry| entry.lease_id != lease_id)
                    .map(|entry| entry.holder.clone())
                    .collect();
                Ok(ClaimOutcome::Refused {
                    holder: format!("{} (contested term {term})", others.join(", ")),
                    time_left: contested.time_left(),
                })
            }
        }
    }

    /// Tombstone at our own term: ends our lease without touching any later term.
    pub async fn release(&self, lease_id: &str, identity: &Identity, term: u64) -> Result<(), CatalogError> {
        self.write_tombstone(term, lease_id, &identity.holder(), "release").await
    }

    async fn write_tombstone(&self, term: u64, lease_id: &str, holder: &str, kind: &str) -> Result<(), CatalogError> {
        let sql = self.lease_row_sql(term, lease_id, holder, kind, Duration::ZERO, None);
        self.client.execute_deciding(&sql, self.timings.statement_cap()).await
    }

    /// The one shape of every lease statement: a row stamped with server time, living `lifetime` (zero for a
    /// tombstone), written only if `condition_opt` holds when the statement runs.
    fn lease_row_sql(
        &self,
        term: u64,
        lease_id: &str,
        holder: &str,
        kind: &str,
        lifetime: Duration,
        condition_opt: Option<&str>,
    ) -> String {
        format!(
            "INSERT INTO {table} (catalog, term, lease_id, holder, written_at_ms, expires_at_ms, kind) \
             SELECT {catalog}, {term}, {id}, {holder}, {now}, {now} + {lifetime_ms}, {kind} FROM system.one{condition}",
            table = self.table,
            catalog = self.catalog_literal(),
            id = sql_string_literal(lease_id),
            holder = sql_string_literal(holder),
            now = self.server_now_ms(),
            lifetime_ms = lifetime.as_millis(),
            kind = sql_string_literal(kind),
            condition = condition_opt.map(|condition| format!(" WHERE {condition}")).unwrap_or_default(),
        )
    }

    /// Operator action (`capstore lease break --force`): tombstone every lease_id at the head. Returns the head as it
    /// was before the break.
    pub async fn break_head(&self) -> Result<Head, CatalogError> {
        let head = self.read_head().await?;
        for entry in &head.entries {
            self.write_tombstone(entry.term, &entry.lease_id, &entry.holder, "break").await?;
        }
        Ok(head)
    }

    /// The fence for `lease_id`, as SQL for the WHERE clause of a publishing statement.
    pub fn fence_condition(&self, lease_id: &str) -> String {
        fence_condition(&self.table, &self.catalog, lease_id, self.server_now_ms(), self.timings.fence_margin())
    }

    /// Delete lease rows below the head term (`capstore gc`). Decisions read only the head, so this changes none.
    pub async fn gc(&self) -> Result<u64, CatalogError> {
        let head = self.read_head().await?;
        if head.term <= 1 {
            return Ok(0);
        }
        self.delete_below(head.term).await?;
        Ok(head.term - 1)
    }

    /// The holder's trim of its catalog's lease history (see [`super::LeaseKeeper`]): delete the rows below
    /// `head_term`, the term its renewal has just landed at, unless a mutation of the lease table is still running
    /// (then nothing is sent and the answer is false). Terms only grow, so every row below it is below any head to
    /// come, and no decision reads it.
    pub async fn trim_below(&self, head_term: u64) -> Result<bool, CatalogError> {
        #[derive(serde::Deserialize, clickhouse::Row)]
        struct Unfinished {
            unfinished: u64,
        }
        let (database, table) = self.table.split_once('.').unwrap_or(("", self.table.as_str()));
        let running: Vec<Unfinished> = self
            .client
            .fetch_all(&format!(
                "SELECT count() AS unfinished FROM system.mutations WHERE database = {} AND table = {} AND is_done = 0",
                sql_string_literal(database),
                sql_string_literal(table),
            ))
            .await?;
        if running.first().is_some_and(|row| row.unfinished > 0) {
            return Ok(false);
        }
        self.delete_below(head_term).await?;
        Ok(true)
    }

    async fn delete_below(&self, term: u64) -> Result<(), CatalogError> {
        self.client
            .execute(&format!(
                "ALTER TABLE {} DELETE WHERE catalog = {} AND term < {term}",
                self.table,
                self.catalog_literal(),
            ))
            .await
    }
}

/// Server time in milliseconds for this server: whole seconds on 18.x (no `now64`), milliseconds on current servers.
pub fn server_now_ms_expr(client: &CatalogClient) -> &'static str {
    if client.server_version().has_subsecond_clock() {
        "toUInt64(toUnixTimestamp64Milli(now64(3)))"
    } else {
        "(toUInt64(now()) * 1000)"
    }
}

/// The fence (see the module doc): true only while `lease_id` alone heads the lease of `catalog` with more than
/// `margin` left, at the instant the statement executes. One scalar subquery reads the head term's holders and
/// expiry together, so the three conditions are decided on one reading of the head (and the head is found once).
/// Over no rows the aggregates are (0, '', 0): no fence passes on an empty lease.
pub fn fence_condition(table: &str, catalog: &str, lease_id: &str, server_now_ms: &str, margin: Duration) -> String {
    let catalog = sql_string_literal(catalog);
    format!(
        "(SELECT (uniqExact(lease_id), any(lease_id), min(expires_at_ms) > {server_now_ms} + {margin_ms}) FROM {table} \
         WHERE catalog = {catalog} AND term = (SELECT max(term) FROM {table} WHERE catalog = {catalog})) = (1, {id}, 1)",
        id = sql_string_literal(lease_id),
        margin_ms = margin.as_millis(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_checks_single_holder_identity_and_margin() {
        let fence = fence_condition("db.t_lease", "edge-7", "abc", "NOW", Duration::from_millis(2500));
        assert!(fence.contains("(uniqExact(lease_id), any(lease_id), min(expires_at_ms) > NOW + 2500)"), "{fence}");
        assert!(fence.ends_with("= (1, 'abc', 1)"), "{fence}");
        assert_eq!(fence.matches("max(term)").count(), 1, "the head is found once: {fence}");
        assert!(fence.contains("catalog = 'edge-7'"), "{fence}");
    }

    #[test]
    fn head_liveness_and_time_left() {
        let entry = |lease_id: &str, expires_at_ms| HeadEntry {
            term: 4,
            lease_id: lease_id.into(),
            holder: format!("h-{lease_id}"),
            expires_at_ms,
            rows: 1,
            server_now_ms: 10_000,
        };
        let head = Head { term: 4, entries: vec![entry("a", 9_000), entry("b", 12_500)] };
        assert!(head.is_live());
        assert_eq!(head.time_left(), Duration::from_millis(2_500));
        assert_eq!(head.holders(), "h-a, h-b");
        let expired = Head { term: 4, entries: vec![entry("a", 10_000)] };
        assert!(!expired.is_live());
        assert!(!Head::default().is_live());
    }
}
