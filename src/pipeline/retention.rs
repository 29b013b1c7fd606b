//! Retention: the captures older than their stream's policy keeps (`[[retention]]`) are deleted by the lease
//! holder, in the background, at a bounded rate.
//!
//! Every `lifecycle.retention_interval` a pass looks at each stream of the catalog (from `time_bounds`), takes the
//! first policy whose pattern matches it, and deletes the captures captured before `now - keep` through the same
//! [`Deleter`] the API uses: fenced, versioned publishes of up to 10,000 tombstones, which `tail` consumers see. A
//! pass deletes at most `lifecycle.retention_batch` captures; what is left waits for the next pass. Only while this
//! process holds the lease: a pass that finds no publish permit does nothing (a rival or a lost lease never deletes,
//! and the fence inside every publish makes sure of it).
//!
//! *Horizons*: when the policies end with a catch-all (`streams = "*"`) and the catalog's tables are partitioned by
//! month (a catalog created by schema 6 or newer, see [`crate::catalog::schema::partitioned`]), nothing captured before
//! `now - K` by the catalog server's clock (K, the longest keep of the policies up to the catch-all) is kept for any
//! stream, whatever its name, and retention publishes that as a *horizon* instead of a tombstone per capture: one
//! fenced, versioned publish, advanced in steps of [`HORIZON_STEP`], from whose version on no read returns a capture
//! captured before it (see [`crate::catalog::query`]); the compactor drops the months below it once readers are done
//! with them (see [`crate::catalog::purge`]). A stream whose policy keeps K is then left to the horizon (its captures
//! go within a step of their keep); one that keeps less is still deleted capture by capture above the horizon. Because
//! the horizon covers streams that do not exist yet, a late capture of a new stream captured before it is gone as it is
//! published: its keep (K at most) is over.
//!
//! State: per stream, the cut-off below which everything was deleted by the last pass that found nothing pending or
//! changed, so that a pass lists only what aged out since; every [`FULL_PASS_EVERY`]th pass (and the first after a
//! start) lists each stream from its first capture again, which finds late arrivals (a capture published with an
//! old `captured_at_ns`). Nothing here needs to survive a crash: a pass interrupted anywhere leaves every capture
//! either deleted by a committed publish or still there, and the next pass takes it up. Each deletion names the
//! watermark its listing was read at, so a capture posted again in between is not deleted on the strength of its
//! older row.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use super::deletion::Deleter;
use crate::catalog::publish::DELETION_MAX_IDS;
use crate::catalog::query::ListQuery;
use crate::config::Config;

pub struct Retention {
    /// The policies in order, compiled.
    policies: Vec<(globset::GlobMatcher, Duration)>,
    deleter: Arc<Deleter>,
    interval: Duration,
    batch: u64,
    /// Per stream, the cut-off everything before which is deleted (as far as the catalog showed at the time).
    done_before: HashMap<String, u64>,
    /// Passes done; every [`FULL_PASS_EVERY`]th starts each stream from its first capture again.
    passes: u64,
    /// The keep a horizon applies (see the module doc); `None` without a catch-all policy or partitioned tables.
    horizon_keep: Option<Duration>,
    /// The catalog's horizon as last seen or published (0 before the first look).
    horizon_before: u64,
}

/// A horizon moves in steps of this (and lags the keep by up to one): each step is a publish, an entry of `tail`.
pub const HORIZON_STEP: Duration = Duration::from_secs(3600);
/// A local clock further than this from the catalog server's is reported.
const CLOCK_DISAGREEMENT: Duration = Duration::from_secs(60);

/// Whether a policy's pattern matches every stream name.
fn is_catch_all(pattern: &str) -> bool {
    matches!(pattern, "*" | "**")
}

/// A pass in this many lists each stream from its first capture, not from where the last pass finished: captures
/// published since with an old `captured_at_ns` (a producer catching up on a backlog) are found within this many
/// intervals (an hour at the default interval).
const FULL_PASS_EVERY: u64 = 60;

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPass {
    pub deleted: u64,
    /// The pass stopped at `retention_batch`: more is due.
    pub more_due: bool,
}

impl Retention {
    /// `None` when the configuration has no policy. `partitioned`: the catalog's tables are partitioned by month, so
    /// that a horizon can drop whole months (see the module doc).
    pub fn from_config(config: &Config, deleter: Arc<Deleter>, partitioned: bool) -> Option<Retention> {
        if config.retention.is_empty() {
            return None;
        }
        let policies =
            config.retention.iter().filter_map(|policy| Some((policy.matcher().ok()?, policy.keep.0))).collect();
        Some(Retention {
            policies,
            deleter,
            interval: config.lifecycle.retention_interval.0,
            batch: config.lifecycle.retention_batch,
            done_before: HashMap::new(),
            passes: 0,
            horizon_keep: partitioned.then(|| horizon_keep(&config.retention)).flatten(),
            horizon_before: 0,
        })
    }

    /// Publish the horizon `now - K` (in whole [`HORIZON_STEP`]s, by the catalog server's clock) if the catalog's
    /// is below it. A horizon never moves back, so it is reckoned by the server's clock, not this host's: a host
    /// that boots with its clock years ahead would otherwise hide everything for good. A local clock far from the
    /// server's is reported.
    async fn advance_horizon(&mut self, local_now_ns: u64) -> anyhow::Result<()> {
        let Some(keep) = self.horizon_keep else { return Ok(()) };
        let now_ns = self.deleter.catalog().server_now_ns().await?;
        if now_ns.abs_diff(local_now_ns) > CLOCK_DISAGREEMENT.as_nanos() as u64 {
            tracing::warn!(
                local_now_ns,
                server_now_ns = now_ns,
                "this host's clock is far from the catalog server's; retention horizons follow the server's"
            );
        }
        let step = HORIZON_STEP.as_nanos() as u64;
        let target = now_ns.saturating_sub(u64::try_from(keep.as_nanos()).unwrap_or(u64::MAX)) / step * step;
        if target <= self.horizon_before {
            return Ok(());
        }
        self.horizon_before = self.deleter.catalog().horizons(u64::MAX).await?.before_at(u64::MAX);
        if target > self.horizon_before {
            self.deleter.expire_before(target).await?;
            self.horizon_before = target;
        }
        Ok(())
    }

    /// One pass over every stream, deleting at most `retention_batch` captures.
    pub async fn pass(&mut self, stopping: &tokio::sync::watch::Receiver<bool>) -> anyhow::Result<RetentionPass> {
        let now_ns = crate::util::now_ns();
        let mut pass = RetentionPass::default();
        self.advance_horizon(now_ns).await?;
        for stream in self.deleter.catalog().streams().await? {
            let Some(keep) = self.keep_of(&stream.stream) else { continue };
            if Some(keep) == self.horizon_keep || stream.last_ns < self.horizon_before {
                // Left to the horizon, or all of it below the horizon already.
                continue;
            }
            let cutoff = now_ns.saturating_sub(u64::try_from(keep.as_nanos()).unwrap_or(u64::MAX));
            let rescan = self.passes.is_multiple_of(FULL_PASS_EVERY);
            let done_before = if rescan { 0 } else { self.done_before.get(&stream.stream).copied().unwrap_or(0) };
            let since = done_before.max(stream.first_ns).max(self.horizon_before);
            if since >= cutoff {
                continue;
            }
            let mut query = ListQuery {
                stream: Some(stream.stream.clone()),
                since_ns: Some(since),
                until_ns: Some(cutoff),
                ..ListQuery::default()
            };
            let mut complete = true;
            loop {
                let budget = self.batch - pass.deleted;
                if budget == 0 || *stopping.borrow() {
                    pass.more_due = budget == 0;
                    return Ok(pass);
                }
                query.limit = budget.min(DELETION_MAX_IDS as u64);
                let page = self.deleter.catalog().list(&query).await?;
                let ids: Vec<Uuid> =
                    page.captures.iter().filter_map(|capture| Uuid::parse_str(&capture.capture_id).ok()).collect();
                if !ids.is_empty() {
                    // Only what the listing saw: a capture posted again since is left for the next pass to judge.
                    let answer = self.deleter.delete(&ids, Some(page.watermark), false).await?;
                    pass.deleted += answer.report.deleted.len() as u64;
                    complete &= answer.pending.is_empty() && answer.report.changed.is_empty();
                    if let Some(version) = answer.report.version {
                        tracing::info!(
                            stream = %stream.stream,
                            deleted = answer.report.deleted.len(),
                            version,
                            "retention deleted captures past their keep"
                        );
                    }
                }
                match page.next_cursor {
                    Some(cursor) => query.cursor = Some(cursor),
                    None => break,
                }
            }
            if complete {
                self.done_before.insert(stream.stream.clone(), cutoff);
            }
        }
        self.passes += 1;
        Ok(pass)
    }

    fn keep_of(&self, stream: &str) -> Option<Duration> {
        // (The first policy that matches applies.)
        self.policies.iter().find(|(matcher, _)| matcher.is_match(stream)).map(|(_, keep)| *keep)
    }
}

impl super::LeaseHolderPasses for Retention {
    const WHAT: &'static str = "retention";

    fn interval(&self) -> Duration {
        self.interval
    }

    async fn pass_once(&mut self, stopping: &tokio::sync::watch::Receiver<bool>) -> anyhow::Result<bool> {
        Ok(self.pass(stopping).await?.more_due)
    }
}

/// The keep a horizon applies: the longest of the policies up to the first catch-all, if there is one (a policy
/// after it never applies).
fn horizon_keep(policies: &[crate::config::RetentionPolicy]) -> Option<Duration> {
    let catch_all = policies.iter().position(|policy| is_catch_all(&policy.streams))?;
    policies[..=catch_all].iter().map(|policy| policy.keep.0).max()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{units::HumanDuration, RetentionPolicy};

    fn policy(streams: &str, days: u64) -> RetentionPolicy {
        RetentionPolicy { streams: streams.into(), keep: HumanDuration(Duration::from_secs(days * 86_400)) }
    }

    #[test]
    fn a_horizon_needs_a_catch_all_and_keeps_the_longest_keep_before_it() {
        let day = |days: u64| Some(Duration::from_secs(days * 86_400));
        assert_eq!(horizon_keep(&[policy("cam/*", 7)]), None, "no catch-all: a new stream could keep forever");
        assert_eq!(horizon_keep(&[policy("cam/*", 7), policy("*", 30)]), day(30));
        assert_eq!(horizon_keep(&[policy("audit/*", 365), policy("*", 30)]), day(365));
        assert_eq!(horizon_keep(&[policy("**", 10), policy("audit/*", 365)]), day(10), "unreachable after it");
        assert!(!is_catch_all("*/*") && !is_catch_all("cam*"));
    }
}
