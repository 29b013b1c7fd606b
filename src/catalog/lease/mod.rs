//! The publisher lease: one process at a time publishes into a catalog name.
//!
//! # Table protocol ([`LeaseStore`], in `store.rs`)
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
//!   A claim reports the term it follows: unless that is the term this process last knew it held, someone else's
//!   publish attempts may still land, and an empty commit is owed before any row is written
//!   ([`LeaseHandle::owes_empty_commit`], see [`crate::catalog::in_doubt`]).
//! - Renew: the same insert at our term + 1, conditional on our term still being the head and still live.
//! - Release: a tombstone at our own term (never head+1, which could revoke a successor). None while a commit of ours
//!   is unanswered (cut off by the drain's timeout, or still running): it may have passed its fence and may still run
//!   on the server, and the lease left to expire outlives it. No permit and no commit after the release decides.
//! - Fence ([`fence_condition`]): inside every publishing statement, the head has exactly one lease_id, it is ours, and
//!   its expiry is more than `publish_timeout + clock_skew` away. An empty table fails the fence.
//! - Same-spool takeover: the holder is `<spool id>@<host>:<pid>`. A process that holds the spool's flock knows every
//!   earlier process of that spool is dead, so it may claim over a live head whose every lease_id is its own spool's
//!   at once; the fence keeps any late statement of the predecessor (old lease_id) from landing, and an embargo of
//!   `publish_timeout + clock_skew + 0.1 s` after the claim's read-back lets one that passed its fence before end.
//!   Every claim over a live head of our spool takes it: a start whose claim went unanswered claims again with a fresh
//!   lease_id, and the row of the first, if it landed, is such a head.
//!
//! # Keeper states ([`LeaseKeeper`], [`LeaseState`], in `keeper.rs`)
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

mod keeper;
mod store;

pub use keeper::{CommitInFlight, LeaseHandle, LeaseKeeper, RunningLease, StartError};
pub use store::{fence_condition, server_now_ms_expr, ClaimOutcome, FollowedTerm, Head, HeadEntry, LeaseStore};

use std::time::{Duration, Instant};

use serde::Serialize;
use uuid::Uuid;

use super::client::CatalogClient;

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
    /// This process, publishing for the spool `spool_id`.
    pub fn of_this_process(spool_id: Uuid) -> Identity {
        Identity { spool_id, host: crate::util::host_name(), pid: std::process::id() }
    }

    pub fn holder(&self) -> String {
        format!("{}@{}:{}", self.spool_id, self.host, self.pid)
    }
}

/// The spool id part of a holder string, if it has one.
pub fn holder_spool_id(holder: &str) -> Option<Uuid> {
    holder.split_once('@').and_then(|(spool_id, _)| Uuid::parse_str(spool_id).ok())
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

impl LeaseState {
    /// The name status, metrics and the systemd status line show (the same as its JSON form).
    pub fn name(self) -> &'static str {
        match self {
            LeaseState::None => "none",
            LeaseState::Held => "held",
            LeaseState::Quarantined => "quarantined",
            LeaseState::Reacquiring => "reacquiring",
            LeaseState::Failed => "failed",
            LeaseState::Released => "released",
        }
    }
}

/// The right to publish (or upload) now: held, with enough time left for one publishing statement.
#[derive(Debug, Clone)]
pub struct PublishPermit {
    pub lease_id: String,
    /// Which tenure of this process the permit belongs to: bumped every time the lease becomes held after not being
    /// held (a start, a claim after a quarantine, or after a plain local loss, which keeps the lease_id), never by a
    /// renewal. Work that must be redone per acquisition (reconcile) keys on it.
    pub tenure: u64,
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
    /// Whether the newest lease statement got an answer from the catalog.
    pub catalog_reachable: bool,
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
}
