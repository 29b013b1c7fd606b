//! What the daemon's parts report about themselves to the operator: liveness for the systemd watchdog, latency
//! histograms for Prometheus.
//!
//! Liveness of a long-running part (the spool writer, the lease keeper, the pipeline loop): a part is *idle* (no work in hand: healthy however long it lasts), or *busy* with one or more pieces of work. A busy
//! part proves it is alive by progress: a piece of work finishing or a step inside one ([`Liveness::progress`]). It is
//! *stalled* once it has been busy for longer than the limit without any progress; the watchdog then stops pinging,
//! so the service manager restarts the process. A timer alone proves nothing: a part that waits on a wedged disk or a
//! lost lock must stop the pings, an idle daemon must not.
//!
//! Invariant: `busy` counts the [`Busy`] guards alive; `last_progress_ms` is the newest of the last progress and the
//! moment `busy` rose from zero, so a part that has just picked up work is never stalled already.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::{exponential_buckets_range, Histogram};

#[derive(Debug, Default)]
struct Shared {
    busy: AtomicU64,
    last_progress_ms: AtomicU64,
}

/// A cheap, cloneable liveness record; every clone is the same record.
#[derive(Debug, Clone, Default)]
pub struct Liveness {
    shared: Arc<Shared>,
}

/// One piece of work in hand, until dropped. Dropping is no progress (a cancelled wait proves nothing about the part):
/// the part calls [`Liveness::progress`] when it actually moves.
#[must_use = "the work counts as in hand only while the guard lives"]
pub struct Busy {
    liveness: Liveness,
}

/// Milliseconds on a process-wide monotonic clock.
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Liveness {
    /// Work begins; it ends when the guard drops. Beginning is no progress for work already in hand (new requests
    /// queueing behind a wedged one must not make it look alive); only picking up work when idle starts the clock.
    pub fn busy(&self) -> Busy {
        // Fresh before the count rises, so a check in between never sees busy with an idle-era timestamp; and again
        // after, for the caller that raced another guard's drop to zero.
        if self.shared.busy.load(Ordering::Acquire) == 0 {
            self.progress();
        }
        if self.shared.busy.fetch_add(1, Ordering::AcqRel) == 0 {
            self.progress();
        }
        Busy { liveness: self.clone() }
    }

    /// The work moved (a step of it finished).
    pub fn progress(&self) {
        self.shared.last_progress_ms.fetch_max(now_ms(), Ordering::AcqRel);
    }

    /// How long the part has been busy without progress, if longer than `limit`.
    pub fn stalled_for(&self, limit: Duration) -> Option<Duration> {
        if self.shared.busy.load(Ordering::Acquire) == 0 {
            return None;
        }
        let since =
            Duration::from_millis(now_ms().saturating_sub(self.shared.last_progress_ms.load(Ordering::Acquire)));
        (since > limit).then_some(since)
    }
}

impl Busy {
    /// The work this guard stands for moved.
    pub fn progress(&self) {
        self.liveness.progress();
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.liveness.shared.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A latency histogram in seconds (Prometheus buckets from `min` to `max`, spaced by a constant factor); clones share
/// the counts.
#[derive(Debug, Clone)]
pub struct Latency {
    histogram: Histogram,
}

impl Latency {
    /// 16 buckets from `min` to `max` seconds.
    pub fn between(min: f64, max: f64) -> Latency {
        Latency { histogram: Histogram::new(exponential_buckets_range(min, max, 16)) }
    }

    pub fn observe(&self, elapsed: Duration) {
        self.histogram.observe(elapsed.as_secs_f64());
    }

    pub fn histogram(&self) -> &Histogram {
        &self.histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_is_never_stalled_and_busy_without_progress_is() {
        let liveness = Liveness::default();
        assert_eq!(liveness.stalled_for(Duration::ZERO), None, "idle");
        let busy = liveness.busy();
        std::thread::sleep(Duration::from_millis(20));
        assert!(liveness.stalled_for(Duration::from_millis(5)).is_some(), "busy for 20 ms without progress");
        assert_eq!(liveness.stalled_for(Duration::from_secs(60)), None, "within the limit");
        liveness.progress();
        assert_eq!(liveness.stalled_for(Duration::from_millis(15)), None, "progress just now");
        drop(busy);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(liveness.stalled_for(Duration::ZERO), None, "idle again");
    }

    #[test]
    fn cancelled_work_is_no_progress() {
        let liveness = Liveness::default();
        let _stuck = liveness.busy();
        std::thread::sleep(Duration::from_millis(20));
        // Requests that queue behind the stuck one and give up prove nothing.
        for _ in 0..3 {
            drop(liveness.busy());
        }
        assert!(liveness.stalled_for(Duration::from_millis(15)).is_some());
    }

    #[test]
    fn work_picked_up_after_a_long_idle_starts_fresh() {
        let liveness = Liveness::default();
        drop(liveness.busy());
        std::thread::sleep(Duration::from_millis(20));
        let _first = liveness.busy();
        let _second = liveness.busy();
        assert_eq!(liveness.stalled_for(Duration::from_millis(15)), None);
    }
}
