//! The publisher lease: one process at a time publishes into a catalog name.
//!
//! # Table protocol ([`LeaseStore`])
//!
//! Rows `(catalog, term, lease_id, holder, written_at_ms, expires_at_ms, kind)` in a plain MergeTree, times stamped by
//! the server. The *head* is the set of rows at the highest term. The expiry of a `(term, lease_id)` is the minimum
//! over its rows, so a tombstone row (expiry = now) ends it. The head is *live* when one of its lease_ids has an expiry
//! in the future (server time).
//!
//! - Claim: read the head; if it is live and not ours (nor our own spool's, see below) the claim is refused, naming the
//!   holder and the time left. Otherwise `INSERT ... SELECT head+1 ... WHERE max(term) = head`, then read that term back:
//!   exactly our row means held, with the local deadline `sent + ttl - clock_skew - 0.1 s` on a monotonic clock started
//!   before the request was sent; more than one lease_id means contested (abandon; the term is live until its latest
//!   expiry).
//! - Renew: the same insert at our term + 1, conditional on our term still being the head and still live.
//! - Release: a tombstone at our own term (never head+1, which could revoke a successor).
//! - Fence ([`fence_condition`]): inside every publishing statement, the head has exactly one lease_id, it is ours, and
//!   its expiry is more than `publish_timeout + clock_skew` away. An empty table fails the fence.
//! - Same-spool takeover: the holder is `<spool id>@<host>:<pid>`. A process that holds the spool's flock knows every
//!   earlier process of that spool is dead, so it may claim over a live head held by its own spool id at once; the
//!   fence keeps any late statement of the predecessor (old lease_id) from landing.
//!
//! # Keeper states ([`LeaseKeeper`], [`LeaseState`])
//!
//! ```text
//!  none ──claim ok──► held ──renew every ttl/6──► held
//!   │                  │ unknown outcome (renew, claim or a publish) ──► quarantined ──one TTL──► reacquiring
//!   │                  │ refused / lost / deadline passed ──────────────────────────────────────► reacquiring
//!   └─refused──► reacquiring ──claim ok──► held          (any state) ──2 x TTL of refusals──► failed (latched)
//!                                                          held ──shutdown──► released (tombstone at own term)
//! ```
//!
//! Invariants: nothing is published or uploaded unless [`LeaseHandle::permit`] returns a permit, which needs state
//! `held` and at least `publish_timeout + clock_skew` left on the local deadline; a quarantine drops the lease locally
//! without a tombstone and claims again only after one TTL, with a fresh lease_id; any successful claim resets the
//! refusal clock; the latch logs exactly one ERROR line naming the holder.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use tokio::sync::{watch, Notify};
use uuid::Uuid;

use super::client::{sql_string_literal, CatalogClient, CatalogError, ErrorKind};
use super::schema::Tables;

/// Safety margin subtracted from every local deadline, on top of the clock skew.
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(100);

/// The lease timings in force.
///
/// `resolution_extra` is the server clock's resolution (1 s on ClickHouse 18.x, whose `now()` has whole seconds). It
/// is added to the configured skew wherever a server timestamp is compared with a local clock: the local deadline and
/// the fence margin. The local pre-check before a publish ([`LeaseHandle::permit`]) uses the configured skew only: it
/// exists to avoid sending a statement that is sure to fail, and the fence decides.
#[derive(Debug, Clone, Copy)]
pub struct LeaseTimings {
    pub ttl: Duration,
    pub publish_timeout: Duration,
    pub clock_skew: Duration,
    pub resolution_extra: Duration,
}

impl LeaseTimings {
    pub fn from_config(config: &crate::config::LeaseConfig, client: &CatalogClient) -> LeaseTimings {
        LeaseTimings {
            ttl: config.ttl.0,
            publish_timeout: config.publish_timeout.0,
            clock_skew: config.clock_skew.0,
            resolution_extra: client.clock_resolution_extra(),
        }
    }

    pub fn effective_skew(&self) -> Duration {
        self.clock_skew + self.resolution_extra
    }

    /// How long a lease we just claimed is ours for sure, counted from before the request was sent.
    pub fn local_lifetime(&self) -> Duration {
        self.ttl.saturating_sub(self.effective_skew() + DEADLINE_MARGIN)
    }

    pub fn renew_interval(&self) -> Duration {
        self.ttl / 6
    }

    /// Start-wait retry period: ttl/10 clamped to 50-500 ms.
    pub fn start_retry_interval(&self) -> Duration {
        (self.ttl / 10).clamp(Duration::from_millis(50), Duration::from_millis(500))
    }

    /// The fence's margin: a publishing statement lands only while the lease has more than this left (server time).
    pub fn fence_margin(&self) -> Duration {
        self.publish_timeout + self.effective_skew()
    }

    /// Time a publish needs left on the local deadline before it is attempted.
    pub fn permit_margin(&self) -> Duration {
        self.publish_timeout + self.clock_skew
    }

    /// `max_execution_time` of every deciding lease or publish statement (whole seconds by validation).
    pub fn statement_cap(&self) -> Duration {
        self.publish_timeout
    }
}

/// Who we are in the lease table: `<spool id>@<host>:<pid>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub spool_id: Uuid,
    pub host: String,
    pub pid: u32,
}

impl Identity {
    pub fn holder(&self) -> String {
        format!("{}@{}:{}", self.spool_id, self.host, self.pid)
    }
}

/// The spool id part of a holder string, if it has one.
pub fn holder_spool_id(holder: &str) -> Option<Uuid> {
    holder.split_once('@').and_then(|(spool_id, _)| Uuid::parse_str(spool_id).ok())
}

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

/// What a claim or renewal came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// `publish_not_before` is set after a same-spool takeover of a live head: see [`LeaseStore::claim`].
    Held { term: u64, deadline: Instant, publish_not_before: Option<Instant> },
    /// Another holder's live lease (or a contested term) stands in the way.
    Refused { holder: String, time_left: Duration },
    /// The head moved between our read and our insert; nothing of ours landed. Try again.
    Raced,
}

/// The lease statements. Stateless apart from the client: the [`LeaseKeeper`] holds the state.
#[derive(Clone)]
pub struct LeaseStore {
    client: CatalogClient,
    table: String,
    catalog: String,
    timings: LeaseTimings,
}

impl LeaseStore {
    pub fn new(client: CatalogClient, tables: &Tables, catalog: &str, timings: LeaseTimings) -> LeaseStore {
        LeaseStore { client, table: tables.lease.clone(), catalog: catalog.to_string(), timings }
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
        let entries: Vec<HeadEntry> = self.client.fetch_all(&sql).await?;
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
        self.client.fetch_all(&sql).await
    }

    /// Claim the lease at head+1 (see the module doc). `identity` decides same-spool takeover.
    pub async fn claim(&self, lease_id: &str, identity: &Identity) -> Result<ClaimOutcome, CatalogError> {
        let head = self.read_head().await?;
        let mut takeover = false;
        if head.is_live() {
            let sole = head.sole_entry();
            let ours = sole.is_some_and(|entry| entry.lease_id == lease_id);
            takeover = !ours && sole.is_some_and(|entry| holder_spool_id(&entry.holder) == Some(identity.spool_id));
            if !ours && !takeover {
                return Ok(ClaimOutcome::Refused { holder: head.holders(), time_left: head.time_left() });
            }
        }
        let condition = format!(
            "(SELECT max(term) FROM {} WHERE catalog = {}) = {}",
            self.table,
            self.catalog_literal(),
            head.term
        );
        let outcome =
            self.insert_and_read_back(head.term + 1, lease_id, &identity.holder(), "claim", &condition).await?;
        match outcome {
            // Same-spool takeover: the predecessor is dead, but a publish of its can pass its fence right up to the
            // moment our claim row lands, and then run on the server for up to max_execution_time. So we hold the
            // lease at once (no rival can take it) but publish nothing until publish_timeout + clock skew after our
            // claim is known to have landed, i.e. after its read-back returned (specs/takeover.pml, EMB_REPLY; counting
            // from when the claim was sent is too short: EMB_SENT is refuted).
            ClaimOutcome::Held { term, deadline, .. } if takeover => {
                let embargo = self.timings.fence_margin() + DEADLINE_MARGIN;
                tracing::info!(term, ?embargo, "took over the lease of this spool's previous process");
                Ok(ClaimOutcome::Held { term, deadline, publish_not_before: Some(Instant::now() + embargo) })
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
        self.client
            .execute(&format!(
                "ALTER TABLE {} DELETE WHERE catalog = {} AND term < {}",
                self.table,
                self.catalog_literal(),
                head.term
            ))
            .await?;
        Ok(head.term - 1)
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
/// `margin` left, at the instant the statement executes.
pub fn fence_condition(table: &str, catalog: &str, lease_id: &str, server_now_ms: &str, margin: Duration) -> String {
    let catalog = sql_string_literal(catalog);
    let head_term = format!("(SELECT max(term) FROM {table} WHERE catalog = {catalog})");
    format!(
        "(SELECT uniqExact(lease_id) FROM {table} WHERE catalog = {catalog} AND term = {head_term}) = 1 AND \
         (SELECT any(lease_id) FROM {table} WHERE catalog = {catalog} AND term = {head_term}) = {id} AND \
         (SELECT min(expires_at_ms) FROM {table} WHERE catalog = {catalog} AND term = {head_term}) > {server_now_ms} + {margin_ms}",
        id = sql_string_literal(lease_id),
        margin_ms = margin.as_millis(),
    )
}

/// `lease_state` in status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    None,
    Held,
    Quarantined,
    Reacquiring,
    Failed,
    Released,
}

/// The right to publish (or upload) now: held, with enough time left for one publishing statement.
#[derive(Debug, Clone)]
pub struct PublishPermit {
    pub lease_id: String,
    pub term: u64,
    pub holder: String,
    pub deadline: Instant,
    /// The fence to put inside the publishing statement.
    pub fence: String,
}

/// The lease fields of the status snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseStatus {
    pub lease_state: LeaseState,
    pub lease_term: u64,
    /// Our holder string while we hold the lease; else the holder that refused us last, if any.
    pub holder: Option<String>,
    /// Wall-clock end of the current quarantine (RFC 3339), if quarantined.
    pub quarantined_until: Option<String>,
    pub lease_renewals: u64,
    pub lease_reacquisitions: u64,
    pub lease_timeouts: u64,
    pub failed: bool,
    pub last_error: Option<String>,
}

struct Shared {
    state: LeaseState,
    lease_id: String,
    term: u64,
    deadline: Option<Instant>,
    quarantined_until: Option<(Instant, SystemTime)>,
    /// Bumped by every quarantine, so a request that started before it cannot overwrite it with a stale success.
    epoch: u64,
    refused_since: Option<Instant>,
    last_refusal_holder: Option<String>,
    renewals: u64,
    reacquisitions: u64,
    timeouts: u64,
    last_error: Option<String>,
    /// True once the lease has been held at least once (a later claim is a re-acquisition).
    ever_held: bool,
    /// No permit before this instant (after a same-spool takeover).
    publish_not_before: Option<Instant>,
}

/// Cheap handle to the lease state, shared by the keeper, the uploader, the indexer and status.
#[derive(Clone)]
pub struct LeaseHandle {
    shared: Arc<Mutex<Shared>>,
    store: LeaseStore,
    identity: Identity,
    state_tx: Arc<watch::Sender<LeaseState>>,
    /// Wakes the keeper at once (a quarantine or a lost fence).
    keeper_wake: Arc<Notify>,
}

impl LeaseHandle {
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    pub fn timings(&self) -> LeaseTimings {
        self.store.timings
    }

    pub fn state(&self) -> LeaseState {
        self.lock().state
    }

    /// Follow state changes (the supervisor wakes on a re-acquired lease, and exits on `failed`).
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state_tx.subscribe()
    }

    /// A permit if the lease is held with at least `publish_timeout + clock_skew` left on the local deadline.
    pub fn permit(&self) -> Option<PublishPermit> {
        let shared = self.lock();
        let deadline = shared.deadline?;
        let now = Instant::now();
        let enough_left = deadline.saturating_duration_since(now) >= self.store.timings.permit_margin();
        let embargoed = shared.publish_not_before.is_some_and(|not_before| now < not_before);
        (shared.state == LeaseState::Held && enough_left && !embargoed).then(|| PublishPermit {
            lease_id: shared.lease_id.clone(),
            term: shared.term,
            holder: self.identity.holder(),
            deadline,
            fence: self.store.fence_condition(&shared.lease_id),
        })
    }

    /// A publishing statement's outcome is unknown: quarantine (no tombstone, nothing published for one TTL).
    pub fn report_unknown_outcome(&self, what: &str) {
        let mut shared = self.lock();
        self.quarantine_locked(&mut shared, what);
        drop(shared);
        self.keeper_wake.notify_one();
    }

    /// A fenced statement did not land. Either the lease is gone (the keeper's immediate renewal will find out and
    /// move to `reacquiring`) or too little of it was left for the fence's margin (the renewal restores it).
    pub fn report_fence_refused(&self) {
        let mut shared = self.lock();
        shared.last_error = Some("a fenced statement was refused: renewing the lease now".into());
        tracing::info!(term = shared.term, "fence refused a publish; renewing the lease now");
        drop(shared);
        self.keeper_wake.notify_one();
    }

    pub fn status(&self) -> LeaseStatus {
        let shared = self.lock();
        LeaseStatus {
            lease_state: shared.state,
            lease_term: shared.term,
            holder: if shared.state == LeaseState::Held {
                Some(self.identity.holder())
            } else {
                shared.last_refusal_holder.clone()
            },
            quarantined_until: shared
                .quarantined_until
                .map(|(_, wall)| humantime::format_rfc3339_millis(wall).to_string()),
            lease_renewals: shared.renewals,
            lease_reacquisitions: shared.reacquisitions,
            lease_timeouts: shared.timeouts,
            failed: shared.state == LeaseState::Failed,
            last_error: shared.last_error.clone(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish_state(&self, shared: &Shared) {
        self.state_tx.send_if_modified(|state| {
            let changed = *state != shared.state;
            *state = shared.state;
            changed
        });
    }

    fn quarantine_locked(&self, shared: &mut Shared, what: &str) {
        if matches!(shared.state, LeaseState::Failed | LeaseState::Released) {
            return;
        }
        let ttl = self.store.timings.ttl;
        shared.state = LeaseState::Quarantined;
        shared.deadline = None;
        shared.epoch += 1;
        shared.timeouts += 1;
        shared.quarantined_until = Some((Instant::now() + ttl, SystemTime::now() + ttl));
        shared.last_error = Some(format!("outcome unknown: {what}"));
        tracing::warn!(term = shared.term, what, quarantine = ?ttl, "lease quarantined: outcome unknown");
        self.publish_state(shared);
    }
}

/// Why a start could not take the lease.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("catalog {catalog} is held by {holder} (for another {time_left:?}); waited {waited:?} (lease.start_wait)")]
    Refused { catalog: String, holder: String, time_left: Duration, waited: Duration },
    #[error("shutdown requested while waiting for the lease")]
    Shutdown,
}

/// Owns the lease lifecycle: start wait, renewal every ttl/6 on its own task, quarantine, re-acquisition, latch.
pub struct LeaseKeeper {
    handle: LeaseHandle,
    catalog: String,
}

impl LeaseKeeper {
    pub fn new(store: LeaseStore, identity: Identity, catalog: &str) -> LeaseKeeper {
        let shared = Shared {
            state: LeaseState::None,
            lease_id: Uuid::new_v4().to_string(),
            term: 0,
            deadline: None,
            quarantined_until: None,
            epoch: 0,
            refused_since: None,
            last_refusal_holder: None,
            renewals: 0,
            reacquisitions: 0,
            timeouts: 0,
            last_error: None,
            ever_held: false,
            publish_not_before: None,
        };
        let (state_tx, _) = watch::channel(LeaseState::None);
        let handle = LeaseHandle {
            shared: Arc::new(Mutex::new(shared)),
            store,
            identity,
            state_tx: Arc::new(state_tx),
            keeper_wake: Arc::new(Notify::new()),
        };
        LeaseKeeper { handle, catalog: catalog.to_string() }
    }

    pub fn handle(&self) -> LeaseHandle {
        self.handle.clone()
    }

    fn timings(&self) -> LeaseTimings {
        self.handle.store.timings
    }

    /// Start: wait up to `start_wait` for a crashed predecessor's lease, retrying every ttl/10 (50-500 ms). ClickHouse
    /// being unreachable is not a refusal: that is retried with backoff until `shutdown_rx` says stop.
    pub async fn acquire_at_start(
        &self,
        start_wait: Duration,
        shutdown_rx: &mut watch::Receiver<bool>,
    ) -> Result<(), StartError> {
        let started = Instant::now();
        let mut unreachable_backoff = Duration::from_millis(100);
        loop {
            if *shutdown_rx.borrow() {
                return Err(StartError::Shutdown);
            }
            let lease_id = self.handle.lock().lease_id.clone();
            let pause = match self.handle.store.claim(&lease_id, &self.handle.identity).await {
                Ok(ClaimOutcome::Held { term, deadline, publish_not_before }) => {
                    self.apply_held(term, deadline, publish_not_before, None);
                    return Ok(());
                }
                Ok(ClaimOutcome::Refused { holder, time_left }) => {
                    let waited = started.elapsed();
                    self.note_refusal(&holder);
                    if waited >= start_wait {
                        return Err(StartError::Refused { catalog: self.catalog.clone(), holder, time_left, waited });
                    }
                    tracing::info!(%holder, ?time_left, ?waited, "waiting for the lease of a previous holder");
                    self.timings().start_retry_interval().min(start_wait - waited)
                }
                Ok(ClaimOutcome::Raced) => self.timings().start_retry_interval(),
                Err(error) => {
                    // An unknown claim outcome is harmless here: we keep our lease_id, so a landed row is ours.
                    tracing::warn!(%error, retry_in = ?unreachable_backoff, "catalog unreachable while claiming the lease");
                    self.handle.lock().last_error = Some(error.to_string());
                    let pause = unreachable_backoff;
                    unreachable_backoff = (unreachable_backoff * 2).min(Duration::from_secs(5));
                    pause
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = shutdown_rx.changed() => {}
            }
        }
    }

    /// The keeper loop: renew, recover, latch. Returns when shut down (after releasing) or latched.
    pub async fn run(self, mut shutdown_rx: watch::Receiver<bool>) {
        loop {
            if *shutdown_rx.borrow() {
                self.release().await;
                return;
            }
            let pause = self.step().await;
            if self.handle.state() == LeaseState::Failed {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.handle.keeper_wake.notified() => {}
                _ = shutdown_rx.changed() => {}
            }
        }
    }

    /// One action for the current state; returns how long to wait before the next.
    async fn step(&self) -> Duration {
        let timings = self.timings();
        let (state, lease_id, term, epoch, quarantine_end) = {
            let shared = self.handle.lock();
            (shared.state, shared.lease_id.clone(), shared.term, shared.epoch, shared.quarantined_until.map(|q| q.0))
        };
        match state {
            LeaseState::Held => {
                let outcome = self.handle.store.renew(&lease_id, &self.handle.identity, term).await;
                self.apply(outcome, epoch, true)
            }
            LeaseState::Quarantined => {
                let end = quarantine_end.unwrap_or_else(Instant::now);
                if Instant::now() < end {
                    return end - Instant::now();
                }
                let mut shared = self.handle.lock();
                if shared.epoch == epoch {
                    shared.lease_id = Uuid::new_v4().to_string();
                    shared.state = LeaseState::Reacquiring;
                    shared.quarantined_until = None;
                    tracing::info!("quarantine over: claiming the lease with a fresh lease_id");
                    self.handle.publish_state(&shared);
                }
                Duration::ZERO
            }
            LeaseState::None | LeaseState::Reacquiring => {
                let outcome = self.handle.store.claim(&lease_id, &self.handle.identity).await;
                self.apply(outcome, epoch, false)
            }
            LeaseState::Failed | LeaseState::Released => timings.renew_interval(),
        }
    }

    fn apply(&self, outcome: Result<ClaimOutcome, CatalogError>, epoch: u64, renewing: bool) -> Duration {
        let timings = self.timings();
        if self.handle.lock().epoch != epoch {
            // A quarantine happened while this request was in flight; its result no longer counts.
            return Duration::ZERO;
        }
        match outcome {
            Ok(ClaimOutcome::Held { term, deadline, publish_not_before }) => {
                self.apply_held(term, deadline, publish_not_before, Some(renewing));
                timings.renew_interval()
            }
            Ok(ClaimOutcome::Refused { holder, .. }) => {
                self.lose_locally(&format!("lease refused: held by {holder}"));
                self.note_refusal(&holder);
                self.check_latch(&holder);
                timings.renew_interval()
            }
            Ok(ClaimOutcome::Raced) => {
                if renewing {
                    self.lose_locally("lease renewal raced: the head moved");
                }
                timings.start_retry_interval()
            }
            Err(error) if error.kind == ErrorKind::DefinitelyFailed => {
                let mut shared = self.handle.lock();
                shared.last_error = Some(error.to_string());
                let expired = shared.deadline.is_some_and(|deadline| Instant::now() >= deadline);
                drop(shared);
                if expired {
                    self.lose_locally("lease deadline passed without a successful renewal");
                }
                tracing::warn!(%error, "lease request failed; retrying");
                timings.renew_interval() / 2
            }
            Err(error) => {
                let mut shared = self.handle.lock();
                self.handle.quarantine_locked(&mut shared, &error.to_string());
                Duration::ZERO
            }
        }
    }

    fn apply_held(&self, term: u64, deadline: Instant, publish_not_before: Option<Instant>, renewing: Option<bool>) {
        let mut shared = self.handle.lock();
        let was = shared.state;
        if publish_not_before.is_some() {
            shared.publish_not_before = publish_not_before;
        }
        shared.term = term;
        shared.deadline = Some(deadline);
        shared.state = LeaseState::Held;
        shared.refused_since = None;
        match renewing {
            Some(true) => shared.renewals += 1,
            _ if shared.ever_held && was != LeaseState::Held => shared.reacquisitions += 1,
            _ => {}
        }
        shared.ever_held = true;
        if was != LeaseState::Held {
            tracing::info!(term, holder = %self.handle.identity.holder(), from = ?was, "lease held");
        }
        self.handle.publish_state(&shared);
    }

    fn lose_locally(&self, why: &str) {
        let mut shared = self.handle.lock();
        if shared.state == LeaseState::Held {
            tracing::warn!(term = shared.term, why, "lease lost");
            shared.state = LeaseState::Reacquiring;
            shared.deadline = None;
            self.handle.publish_state(&shared);
        } else if shared.state == LeaseState::None {
            shared.state = LeaseState::Reacquiring;
            self.handle.publish_state(&shared);
        }
        shared.last_error = Some(why.to_string());
    }

    fn note_refusal(&self, holder: &str) {
        let mut shared = self.handle.lock();
        shared.refused_since.get_or_insert_with(Instant::now);
        shared.last_refusal_holder = Some(holder.to_string());
        shared.last_error = Some(format!("lease held by {holder}"));
    }

    /// Latch after 2 x TTL of continuous refusals: one ERROR line, state `failed`.
    fn check_latch(&self, holder: &str) {
        let mut shared = self.handle.lock();
        let refused_for = shared.refused_since.map_or(Duration::ZERO, |since| since.elapsed());
        if refused_for >= self.timings().ttl * 2 && shared.state != LeaseState::Failed {
            shared.state = LeaseState::Failed;
            shared.deadline = None;
            tracing::error!(
                catalog = %self.catalog,
                %holder,
                refused_for = ?refused_for,
                "publisher lease latched: another publisher holds this catalog; stopping publishing"
            );
            self.handle.publish_state(&shared);
        }
    }

    /// Clean shutdown: tombstone at our own term if we hold the lease.
    async fn release(&self) {
        let (state, lease_id, term) = {
            let shared = self.handle.lock();
            (shared.state, shared.lease_id.clone(), shared.term)
        };
        if state != LeaseState::Held {
            return;
        }
        match self.handle.store.release(&lease_id, &self.handle.identity, term).await {
            Ok(()) => tracing::info!(term, "lease released"),
            // A lost release only means a successor waits out the TTL (or takes over at once if it is our spool).
            Err(error) => tracing::warn!(%error, term, "lease release failed; it will expire by itself"),
        }
        let mut shared = self.handle.lock();
        shared.state = LeaseState::Released;
        shared.deadline = None;
        self.handle.publish_state(&shared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_strings_carry_the_spool_id() {
        let identity = Identity { spool_id: Uuid::now_v7(), host: "edge-1".into(), pid: 42 };
        assert_eq!(identity.holder(), format!("{}@edge-1:42", identity.spool_id));
        assert_eq!(holder_spool_id(&identity.holder()), Some(identity.spool_id));
        assert_eq!(holder_spool_id("rival"), None);
    }

    #[test]
    fn timings() {
        let timings = LeaseTimings {
            ttl: Duration::from_secs(3),
            publish_timeout: Duration::from_secs(1),
            clock_skew: Duration::ZERO,
            resolution_extra: Duration::from_secs(1),
        };
        assert_eq!(timings.renew_interval(), Duration::from_millis(500));
        assert_eq!(timings.start_retry_interval(), Duration::from_millis(300));
        assert_eq!(timings.fence_margin(), Duration::from_secs(2));
        assert_eq!(timings.permit_margin(), Duration::from_secs(1));
        assert_eq!(timings.local_lifetime(), Duration::from_millis(1900));
        let long = LeaseTimings { ttl: Duration::from_secs(60), ..timings };
        assert_eq!(long.start_retry_interval(), Duration::from_millis(500));
        let short = LeaseTimings { ttl: Duration::from_millis(300), ..timings };
        assert_eq!(short.start_retry_interval(), Duration::from_millis(50));
    }

    #[test]
    fn the_fence_checks_single_holder_identity_and_margin() {
        let fence = fence_condition("db.t_lease", "edge-7", "abc", "NOW", Duration::from_millis(2500));
        assert!(fence.contains("uniqExact(lease_id)") && fence.contains(") = 1 AND"), "{fence}");
        assert!(fence.contains("= 'abc'"), "{fence}");
        assert!(fence.contains("> NOW + 2500"), "{fence}");
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
