//! The one retry policy: capped exponential backoff with full jitter, and the one way an outage is logged.
//!
//! Every loop that waits for a dependency to come back (the bucket's per-operation retries, the daemon's catalog
//! connect, the lease claim at start, the pipeline's rounds, the shutdown drain) takes its sleeps from a [`Backoff`]
//! built from a [`RetryPolicy`]: the n-th retry sleeps a uniform random time in `0..=min(max_backoff,
//! initial_backoff * 2^(n-1))` ("full jitter"), so the ceiling grows to its cap and many daemons that lost the same
//! server do not come back in lockstep. A success resets the sequence.
//!
//! States of a [`Backoff`]: `fresh` (no failure since the last reset), `failing` (n failures, the ceiling at
//! `min(max, initial * 2^(n-1))`), `spent` (a bounded policy's attempts or time are used up: [`Backoff::next_delay`]
//! answers `None` and the caller gives up). [`RetryPolicy::unbounded`] is never spent.
//!
//! [`OutageLog`] keeps a failing dependency from flooding the log: one WARN when the outage starts, a reminder with the
//! attempt count at most every [`REMINDER_INTERVAL`], one INFO when it ends.

use std::fmt::Display;
use std::time::{Duration, Instant};

use rand::Rng;

/// How often a continuing outage is logged again.
pub const REMINDER_INTERVAL: Duration = Duration::from_secs(30);

/// Bounded exponential backoff with full jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    /// No new attempt starts once this much time has passed since the first failure.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    /// The policy of one bucket operation: 100 ms doubling to 5 s, at most 8 attempts and 60 s.
    fn default() -> Self {
        RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_attempts: 8,
            max_elapsed: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// Retry until the caller stops (a daemon waiting for its catalog): never spent.
    pub const fn unbounded(initial_backoff: Duration, max_backoff: Duration) -> RetryPolicy {
        RetryPolicy { initial_backoff, max_backoff, max_attempts: u32::MAX, max_elapsed: Duration::MAX }
    }

    /// The sleep before retry number `retry` (1 = the first retry): uniform in `0..=min(max, initial * 2^(retry-1))`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let doubling = 1u32.checked_shl(retry.saturating_sub(1)).unwrap_or(u32::MAX);
        let ceiling = self.initial_backoff.saturating_mul(doubling).min(self.max_backoff);
        let ceiling_ms = ceiling.as_millis() as u64;
        Duration::from_millis(rand::rng().random_range(0..=ceiling_ms))
    }

    pub fn start(&self) -> Backoff {
        Backoff { policy: *self, failures: 0, first_failure_at: None }
    }
}

/// One sequence of retries under a [`RetryPolicy`]. See the module doc for its states.
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: RetryPolicy,
    failures: u32,
    first_failure_at: Option<Instant>,
}

impl Backoff {
    /// Count a failure and say how long to sleep before the next attempt; `None` once the policy is spent.
    pub fn next_delay(&mut self) -> Option<Duration> {
        let first_failure_at = *self.first_failure_at.get_or_insert_with(Instant::now);
        self.failures = self.failures.saturating_add(1);
        if self.failures >= self.policy.max_attempts {
            return None;
        }
        let delay = self.policy.backoff(self.failures);
        let elapsed_after = first_failure_at.elapsed().saturating_add(delay);
        (elapsed_after <= self.policy.max_elapsed).then_some(delay)
    }

    /// [`Backoff::next_delay`] of a policy that is never spent.
    pub fn next_delay_unbounded(&mut self) -> Duration {
        debug_assert_eq!(self.policy.max_attempts, u32::MAX, "only for RetryPolicy::unbounded");
        self.next_delay().unwrap_or(self.policy.max_backoff)
    }

    /// A success: the next failure starts from the initial backoff again.
    pub fn reset(&mut self) {
        self.failures = 0;
        self.first_failure_at = None;
    }

    /// Failures since the last reset.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// The log lines of one dependency's outages (see the module doc). `what` names the dependency and the consequence,
/// for example "catalog unreachable; ingest continues, publishing waits".
#[derive(Debug)]
pub struct OutageLog {
    what: &'static str,
    started_at: Option<Instant>,
    last_logged_at: Option<Instant>,
    failures: u64,
}

impl OutageLog {
    pub const fn new(what: &'static str) -> OutageLog {
        OutageLog { what, started_at: None, last_logged_at: None, failures: 0 }
    }

    /// One more failure: WARN if it starts an outage or the last line is [`REMINDER_INTERVAL`] old, else DEBUG.
    pub fn failed(&mut self, error: &dyn Display) {
        let now = Instant::now();
        self.failures += 1;
        let started_at = *self.started_at.get_or_insert(now);
        let reminder_due = self.last_logged_at.is_none_or(|at| now.duration_since(at) >= REMINDER_INTERVAL);
        if !reminder_due {
            tracing::debug!(error = %error, failures = self.failures, "{}", self.what);
            return;
        }
        self.last_logged_at = Some(now);
        if self.failures == 1 {
            tracing::warn!(error = %error, "{}", self.what);
        } else {
            let down_for_s = now.duration_since(started_at).as_secs();
            tracing::warn!(error = %error, failures = self.failures, down_for_s, "{} (still)", self.what);
        }
    }

    /// The dependency answered again: one INFO line if an outage was running.
    pub fn recovered(&mut self) {
        if let Some(started_at) = self.started_at.take() {
            let down_for_ms = started_at.elapsed().as_millis() as u64;
            tracing::info!(failures = self.failures, down_for_ms, "recovered: {}", self.what);
        }
        self.last_logged_at = None;
        self.failures = 0;
    }

    /// Whether an outage is running (a failure since the last recovery).
    pub fn is_failing(&self) -> bool {
        self.started_at.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_full_jitter() {
        let policy = RetryPolicy::default();
        for retry in 1..40 {
            let ceiling = policy.initial_backoff.saturating_mul(1u32.checked_shl(retry - 1).unwrap_or(u32::MAX));
            let ceiling = ceiling.min(policy.max_backoff);
            for _ in 0..20 {
                assert!(policy.backoff(retry) <= ceiling);
            }
        }
        // Full jitter: the sleeps spread over the whole range, not just near the ceiling.
        let sleeps: Vec<Duration> = (0..200).map(|_| policy.backoff(10)).collect();
        assert!(sleeps.iter().any(|sleep| *sleep < Duration::from_secs(1)));
        assert!(sleeps.iter().any(|sleep| *sleep > Duration::from_secs(4)));
    }

    #[test]
    fn a_bounded_backoff_is_spent_after_its_attempts_and_a_reset_starts_over() {
        let policy = RetryPolicy { max_attempts: 3, ..RetryPolicy::default() };
        let mut backoff = policy.start();
        assert!(backoff.next_delay().is_some());
        assert!(backoff.next_delay().is_some());
        assert_eq!(backoff.next_delay(), None, "the third failure is the last attempt");
        backoff.reset();
        assert_eq!(backoff.failures(), 0);
        let first = backoff.next_delay().unwrap();
        assert!(first <= policy.initial_backoff, "after a reset the ceiling starts low again: {first:?}");
    }

    #[test]
    fn a_bounded_backoff_is_spent_when_the_next_sleep_would_pass_max_elapsed() {
        let policy = RetryPolicy {
            initial_backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(10),
            max_attempts: 100,
            max_elapsed: Duration::ZERO,
        };
        let mut backoff = policy.start();
        // Any sleep above zero passes a zero budget; full jitter may draw zero, so try until it does not.
        assert!((0..100).any(|_| backoff.next_delay().is_none()));
    }

    #[test]
    fn an_unbounded_backoff_grows_to_its_cap_and_is_never_spent() {
        let policy = RetryPolicy::unbounded(Duration::from_millis(100), Duration::from_secs(5));
        let mut backoff = policy.start();
        let late: Vec<Duration> = (0..200).map(|_| backoff.next_delay_unbounded()).collect();
        assert!(late.iter().all(|delay| *delay <= Duration::from_secs(5)));
        assert!(late[100..].iter().any(|delay| *delay > Duration::from_secs(2)), "the ceiling reached the cap");
    }

    #[test]
    fn an_outage_log_warns_once_then_reminds_and_reports_recovery() {
        let mut log = OutageLog::new("test dependency down");
        assert!(!log.is_failing());
        log.failed(&"refused");
        let first_line_at = log.last_logged_at;
        for _ in 0..100 {
            log.failed(&"refused");
        }
        assert_eq!(log.last_logged_at, first_line_at, "no new WARN line within the reminder interval");
        assert_eq!(log.failures, 101);
        assert!(log.is_failing());
        log.recovered();
        assert!(!log.is_failing());
        assert_eq!(log.failures, 0);
    }
}
