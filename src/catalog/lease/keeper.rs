//! The lease keeper: start wait, renewal every ttl/6 on a task of its own, quarantine, re-acquisition and the latch
//! (the states are drawn in the module doc of [`super`]), and the handle the pipeline and status read it through.
//!
//! # Lease history
//!
//! Every renewal is a row at a new term, one every ttl/6: 12 million a year at the default TTL. The head read, each
//! renewal and the fence of every publish find the head as `max(term)` over the catalog's rows, which costs in
//! proportion to them (on 18.16 the fence took 30 ms at a thousand rows, 0.1 s at a million, 0.7 s at ten million).
//! So the holder trims its catalog's history every [`TRIM_EVERY_TERMS`] terms: the rows below the term it has just
//! renewed at are deleted ([`LeaseStore::trim_below`]), on a task of its own so a slow server never delays a
//! renewal. No decision reads below the head, so the trim changes none; a process that is no longer the holder can
//! only delete rows below a term that was the head once, which every later head is above.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{watch, Notify};
use uuid::Uuid;

use super::{ClaimOutcome, FollowedTerm, Identity, LeaseState, LeaseStatus, LeaseStore, LeaseTimings, PublishPermit};
use crate::catalog::client::{CatalogClient, CatalogError, ErrorKind};
use crate::catalog::schema::Tables;
use crate::config::Config;
use crate::retry::{OutageLog, RetryPolicy};
use crate::telemetry::Liveness;

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
    /// Bumped each time the state becomes held from any other state (see [`PublishPermit::tenure`]).
    tenure: u64,
    /// The (lease_id, term) this process last knew it held (a claim's or a renewal's read-back): a claim that follows
    /// any other term follows a holder whose attempts may still land.
    confirmed: Option<(String, u64)>,
    /// The tenure of the newest claim that followed a term other than `confirmed`, until a commit of this process
    /// under that tenure or a later one (see [`LeaseHandle::owes_empty_commit`]). Kept through a lost tenure.
    empty_commit_owed_since: Option<u64>,
    /// Whether the newest lease statement got an answer from the catalog (false until the first one does).
    catalog_reachable: bool,
    /// Fenced commits sent without an answer yet: in flight, or cut off (a drain's timeout, a task aborted at
    /// shutdown) while the server may still run them. Never decreased for a cut one (see [`CommitInFlight`]).
    commits_unanswered: u64,
    /// Set once [`RunningLease::stop`] stops the keeper (in the release, which decides how to end the lease if held):
    /// no permit and no commit from then on. (A latch ends the keeper without it: the state is `failed` then.)
    releasing: bool,
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
    /// Busy while the keeper runs a step (a claim, a renewal, a release), each bounded by the statement cap.
    pub liveness: Liveness,
}

impl LeaseHandle {
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    pub fn timings(&self) -> LeaseTimings {
        self.store.timings()
    }

    pub fn state(&self) -> LeaseState {
        self.lock().state
    }

    /// Whether this process's lease is over for good: its keeper stopped (the shutdown: released, or being released,
    /// or not held when it stopped) or latched. No wait brings a permit back then.
    pub fn ended(&self) -> bool {
        let shared = self.lock();
        // (`released` comes after `releasing`.)
        shared.releasing || shared.state == LeaseState::Failed
    }

    /// Follow state changes (the daemon's loop wakes on a re-acquired lease, and exits on `failed`).
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state_tx.subscribe()
    }

    /// A permit if the lease is held with at least `publish_timeout + clock_skew` left on the local deadline.
    pub fn permit(&self) -> Option<PublishPermit> {
        let shared = self.lock();
        let deadline = shared.deadline?;
        let now = Instant::now();
        let enough_left = deadline.saturating_duration_since(now) >= self.store.timings().permit_margin();
        let embargoed = shared.publish_not_before.is_some_and(|not_before| now < not_before);
        let held = shared.state == LeaseState::Held && !shared.releasing;
        (held && enough_left && !embargoed).then(|| PublishPermit {
            lease_id: shared.lease_id.clone(),
            tenure: shared.tenure,
            term: shared.term,
            holder: self.identity.holder(),
            deadline,
            fence: self.store.fence_condition(&shared.lease_id),
        })
    }

    /// Whether the next publish must commit its version empty before it writes any row: the lease was claimed after
    /// a term this process did not know it held (another process's, or its own whose claim or renewal went
    /// unanswered), and that holder's publish attempts may still land (see [`crate::catalog::in_doubt`]). Every
    /// attempt of such a holder is at a version at most one above the watermark read after the claim.
    pub fn owes_empty_commit(&self) -> bool {
        self.lock().empty_commit_owed_since.is_some()
    }

    /// A publish of this process committed under `permit`: at one above the true watermark of its moment, so
    /// whatever a holder before that permit's tenure may still land is below every row written from now on. (A
    /// commit of an older tenure whose answer came late says nothing of a holder after it.)
    pub fn note_commit(&self, permit: &PublishPermit) {
        let mut shared = self.lock();
        if shared.empty_commit_owed_since.is_some_and(|tenure| permit.tenure >= tenure) {
            shared.empty_commit_owed_since = None;
        }
    }

    /// A fenced commit is about to be sent, or None once the keeper has stopped (a publish on a task of its own
    /// may have taken its permit before). Until [`CommitInFlight::answered`] the release writes no tombstone (see
    /// [`LeaseKeeper`]'s release): the commit may pass its fence and run for `publish_timeout` on the server. A
    /// guard dropped unanswered keeps that so for the rest of the process.
    pub fn commit_sent(&self) -> Option<CommitInFlight> {
        let mut shared = self.lock();
        if shared.releasing {
            return None;
        }
        shared.commits_unanswered += 1;
        Some(CommitInFlight { shared: Arc::clone(&self.shared), answered: false })
    }

    /// The local deadline of the lease now if `permit` is of the tenure held now (renewals within a tenure form an
    /// unbroken chain on the server); the permit's own otherwise.
    pub fn deadline_for(&self, permit: &PublishPermit) -> Instant {
        let shared = self.lock();
        let current =
            shared.state == LeaseState::Held && shared.tenure == permit.tenure && shared.lease_id == permit.lease_id;
        match (current, shared.deadline) {
            (true, Some(deadline)) => deadline.max(permit.deadline),
            _ => permit.deadline,
        }
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
            catalog_reachable: shared.catalog_reachable,
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
        let ttl = self.store.timings().ttl;
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

/// A fenced commit sent and not yet answered ([`LeaseHandle::commit_sent`]).
pub struct CommitInFlight {
    shared: Arc<Mutex<Shared>>,
    answered: bool,
}

impl CommitInFlight {
    /// The commit's statement got an answer: it runs no longer. Called after the quarantine when the answer was no
    /// answer (a timeout, a reset connection), as the server may still run it then: no release follows a
    /// quarantine.
    pub fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for CommitInFlight {
    fn drop(&mut self) {
        if self.answered {
            let mut shared = self.shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            shared.commits_unanswered -= 1;
        }
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
    /// Told how long each renewal took ([`LeaseKeeper::observe_renewals`]).
    renewal_observer: Option<RenewalObserver>,
    /// Requests that definitely failed (ClickHouse unreachable): one WARN, then reminders.
    unreachable: Mutex<OutageLog>,
    /// Trim the lease history once the head is this many terms above the last trim (see the module doc).
    trim_every_terms: u64,
    /// The term the last trim was sent at (0: none yet, so the first renewal at or above `trim_every_terms` trims).
    trimmed_at_term: std::sync::atomic::AtomicU64,
}

/// The keeper's task after a successful start: renewing until [`RunningLease::stop`] (or a latch).
pub struct RunningLease {
    handle: LeaseHandle,
    stop_tx: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningLease {
    pub fn handle(&self) -> &LeaseHandle {
        &self.handle
    }

    /// Release the lease (a tombstone at our own term, if held) and wait for the keeper's task to end.
    pub async fn stop(self) {
        let _ = self.stop_tx.send(true);
        if let Err(error) = self.task.await {
            tracing::error!(%error, "the lease keeper task failed");
        }
    }

    /// Wait until the keeper ends by itself: only a latch ends it without [`RunningLease::stop`].
    pub async fn until_latched(self) {
        let _stop_tx = self.stop_tx;
        let _ = self.task.await;
    }
}

/// Called with the duration of every renewal of the held lease (its fenced statement and read-back), whatever its
/// outcome.
pub type RenewalObserver = Box<dyn Fn(Duration) + Send + Sync>;

/// How many terms of history the holder lets its catalog's lease rows grow by before it trims them (about 42 minutes
/// of renewals at the default TTL of 15 s).
pub const TRIM_EVERY_TERMS: u64 = 1000;

const UNREACHABLE_RETRY: RetryPolicy = RetryPolicy::unbounded(Duration::from_millis(100), Duration::from_secs(5));

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
            confirmed: None,
            empty_commit_owed_since: None,
            tenure: 0,
            catalog_reachable: false,
            commits_unanswered: 0,
            releasing: false,
        };
        let (state_tx, _) = watch::channel(LeaseState::None);
        let handle = LeaseHandle {
            shared: Arc::new(Mutex::new(shared)),
            store,
            identity,
            state_tx: Arc::new(state_tx),
            keeper_wake: Arc::new(Notify::new()),
            liveness: Liveness::default(),
        };
        LeaseKeeper {
            handle,
            catalog: catalog.to_string(),
            renewal_observer: None,
            unreachable: Mutex::new(OutageLog::new("catalog unreachable: the lease cannot be claimed or renewed")),
            trim_every_terms: TRIM_EVERY_TERMS,
            trimmed_at_term: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Trim the lease history every `terms` terms instead of [`TRIM_EVERY_TERMS`] (tests).
    pub fn trim_history_every(mut self, terms: u64) -> LeaseKeeper {
        self.trim_every_terms = terms.max(1);
        self
    }

    /// The keeper of `catalog_name`'s lease for this process, which owns the spool `spool_id`.
    pub fn for_catalog(client: &CatalogClient, tables: &Tables, config: &Config, spool_id: Uuid) -> LeaseKeeper {
        let timings = LeaseTimings::from_config(&config.lease, client);
        let store = LeaseStore::new(client.clone(), tables, &config.catalog_name, timings);
        LeaseKeeper::new(store, Identity::of_this_process(spool_id), &config.catalog_name)
    }

    /// Take the lease within `start_wait` ([`LeaseKeeper::acquire_at_start`]), then keep it on a task of its own.
    pub async fn start(
        self,
        start_wait: Duration,
        shutdown_rx: &mut watch::Receiver<bool>,
    ) -> Result<RunningLease, StartError> {
        self.acquire_at_start(start_wait, shutdown_rx).await?;
        let handle = self.handle();
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(self.run(stop_rx));
        Ok(RunningLease { handle, stop_tx, task })
    }

    pub fn handle(&self) -> LeaseHandle {
        self.handle.clone()
    }

    /// Tell `observer` how long each renewal takes (a latency histogram, a benchmark's samples).
    pub fn observe_renewals(mut self, observer: impl Fn(Duration) + Send + Sync + 'static) -> LeaseKeeper {
        self.renewal_observer = Some(Box::new(observer));
        self
    }

    fn timings(&self) -> LeaseTimings {
        self.handle.store.timings()
    }

    /// Start: wait up to `start_wait` for a crashed predecessor's lease, retrying every ttl/10 (50-500 ms). ClickHouse
    /// being unreachable is not a refusal: that is retried with backoff until `shutdown_rx` says stop.
    pub async fn acquire_at_start(
        &self,
        start_wait: Duration,
        shutdown_rx: &mut watch::Receiver<bool>,
    ) -> Result<(), StartError> {
        let started = Instant::now();
        let mut unreachable_backoff = UNREACHABLE_RETRY.start();
        loop {
            if *shutdown_rx.borrow() {
                return Err(StartError::Shutdown);
            }
            let lease_id = self.handle.lock().lease_id.clone();
            let pause = match self.handle.store.claim(&lease_id, &self.handle.identity).await {
                Ok(ClaimOutcome::Held { term, deadline, publish_not_before, followed }) => {
                    self.apply_held(term, deadline, publish_not_before, followed.as_ref(), None);
                    return Ok(());
                }
                Ok(ClaimOutcome::Refused { holder, time_left }) => {
                    self.reachable();
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
                    if error.kind != ErrorKind::DefinitelyFailed {
                        // The claim may land later. With a fresh lease_id a read-back can only find the row of the
                        // claim it was sent for (one that found ours would count the deadline from the wrong send),
                        // and a landed row of the old one is our spool's: claimed over as a takeover, embargo and all.
                        self.handle.lock().lease_id = Uuid::new_v4().to_string();
                    }
                    self.unreachable_failed(&error);
                    unreachable_backoff.next_delay_unbounded()
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
            let busy = self.handle.liveness.busy();
            let pause = self.step().await;
            busy.progress();
            drop(busy);
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
                let started = Instant::now();
                let outcome = self.handle.store.renew(&lease_id, &self.handle.identity, term).await;
                if let Some(observe) = &self.renewal_observer {
                    observe(started.elapsed());
                }
                let renewed_at = match &outcome {
                    Ok(ClaimOutcome::Held { term, .. }) => Some(*term),
                    _ => None,
                };
                let pause = self.apply(outcome, epoch, true);
                if let Some(term) = renewed_at {
                    self.trim_history(term);
                }
                pause
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
            Ok(ClaimOutcome::Held { term, deadline, publish_not_before, followed }) => {
                self.apply_held(term, deadline, publish_not_before, followed.as_ref(), Some(renewing));
                timings.renew_interval()
            }
            Ok(ClaimOutcome::Refused { holder, .. }) => {
                self.reachable();
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
                self.unreachable_failed(&error);
                let expired = self.handle.lock().deadline.is_some_and(|deadline| Instant::now() >= deadline);
                if expired {
                    self.lose_locally("lease deadline passed without a successful renewal");
                }
                // The lease protocol sets this pace (a renewal must land within the TTL), not a backoff.
                timings.renew_interval() / 2
            }
            Err(error) => {
                let mut shared = self.handle.lock();
                // No answer in time: not reachable, as far as anyone watching can tell.
                shared.catalog_reachable = false;
                self.handle.quarantine_locked(&mut shared, &error.to_string());
                Duration::ZERO
            }
        }
    }

    /// Send a trim of the rows below `term` (just renewed at) if the history has grown by `trim_every_terms` since the
    /// last one. Fire and forget: a failed or skipped trim is tried again `trim_every_terms` later.
    fn trim_history(&self, term: u64) {
        use std::sync::atomic::Ordering;
        let last = self.trimmed_at_term.load(Ordering::Relaxed);
        if term < last.saturating_add(self.trim_every_terms) {
            return;
        }
        self.trimmed_at_term.store(term, Ordering::Relaxed);
        let store = self.handle.store.clone();
        tokio::spawn(async move {
            match store.trim_below(term).await {
                Ok(true) => tracing::debug!(below_term = term, "lease history trimmed"),
                Ok(false) => {
                    tracing::debug!(term, "lease history not trimmed: a mutation of the lease table is running")
                }
                Err(error) => tracing::warn!(%error, term, "lease history trim failed; trying again later"),
            }
        });
    }

    /// A request definitely failed: ClickHouse is unreachable (or refuses us); nothing happened.
    fn unreachable_failed(&self, error: &CatalogError) {
        let mut shared = self.handle.lock();
        shared.last_error = Some(error.to_string());
        shared.catalog_reachable = false;
        drop(shared);
        self.unreachable.lock().unwrap_or_else(|p| p.into_inner()).failed(error);
    }

    /// A request got an answer.
    fn reachable(&self) {
        self.handle.lock().catalog_reachable = true;
        self.unreachable.lock().unwrap_or_else(|p| p.into_inner()).recovered();
    }

    fn apply_held(
        &self,
        term: u64,
        deadline: Instant,
        publish_not_before: Option<Instant>,
        followed: Option<&FollowedTerm>,
        renewing: Option<bool>,
    ) {
        self.reachable();
        let mut shared = self.handle.lock();
        let was = shared.state;
        if publish_not_before.is_some() {
            shared.publish_not_before = publish_not_before;
        }
        if let Some(followed) = followed {
            // Term 0 (holders no one can name, see FollowedTerm) is never known.
            let known = followed.term > 0
                && shared.confirmed.as_ref().is_some_and(|(lease_id, confirmed_term)| {
                    *confirmed_term == followed.term && followed.lease_ids.iter().all(|id| id == lease_id)
                });
            if !known {
                // A claim begins a tenure (claims are made only when not held): the one numbered next.
                let tenure = if was == LeaseState::Held { shared.tenure } else { shared.tenure + 1 };
                shared.empty_commit_owed_since = Some(tenure);
            }
        }
        shared.confirmed = Some((shared.lease_id.clone(), term));
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
            shared.tenure += 1;
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

    /// Clean shutdown: tombstone at our own term if we hold the lease, unless a commit of ours went unanswered (the
    /// drain's timeout cut it, or a compaction's publish still runs). That commit may have passed its fence and may
    /// run for `publish_timeout` on the server; left to expire, the lease ends no earlier than it does, as the fence
    /// asks for more than that left (specs/lease_safety.pml: REL_CUT holds, REL_AT_ONCE is refuted). (A month's drop
    /// cut off counts too, though nothing bounds it: a successor waits for it before its first publish, see
    /// [`crate::catalog::purge`].) The decision and the end of permits and commits are one step, so no commit starts
    /// after it.
    async fn release(&self) {
        let (lease_id, term, commits_unanswered) = {
            let mut shared = self.handle.lock();
            // No permit and no commit from here on, held or not: the keeper ends (see `LeaseHandle::ended`).
            shared.releasing = true;
            if shared.state != LeaseState::Held {
                return;
            }
            (shared.lease_id.clone(), shared.term, shared.commits_unanswered)
        };
        if commits_unanswered > 0 {
            tracing::info!(term, commits_unanswered, "lease left to expire: a commit of ours may still be running");
        } else {
            match self.handle.store.release(&lease_id, &self.handle.identity, term).await {
                Ok(()) => tracing::info!(term, "lease released"),
                // A lost release only means a successor waits out the TTL (or takes over at once if it is our spool).
                Err(error) => tracing::warn!(%error, term, "lease release failed; it will expire by itself"),
            }
        }
        let mut shared = self.handle.lock();
        shared.state = LeaseState::Released;
        shared.deadline = None;
        self.handle.publish_state(&shared);
    }
}
