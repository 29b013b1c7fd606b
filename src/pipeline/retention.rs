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
    /// `None` when the configuration has no policy.
    pub fn from_config(config: &Config, deleter: Arc<Deleter>) -> Option<Retention> {
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
        })
    }

    /// One pass over every stream, deleting at most `retention_batch` captures.
    pub async fn pass(&mut self, stopping: &tokio::sync::watch::Receiver<bool>) -> anyhow::Result<RetentionPass> {
        let now_ns = crate::util::now_ns();
        let mut pass = RetentionPass::default();
        for stream in self.deleter.catalog().streams().await? {
            let Some(keep) = self.keep_of(&stream.stream) else { continue };
            let cutoff = now_ns.saturating_sub(u64::try_from(keep.as_nanos()).unwrap_or(u64::MAX));
            let rescan = self.passes.is_multiple_of(FULL_PASS_EVERY);
            let done_before = if rescan { 0 } else { self.done_before.get(&stream.stream).copied().unwrap_or(0) };
            let since = done_before.max(stream.first_ns);
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
