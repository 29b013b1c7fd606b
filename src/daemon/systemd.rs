//! The systemd notification protocol (sd_notify(3)) for `Type=notify` units: readiness, status lines, stopping,
//! stop-timeout extensions during a drain, and the watchdog. Without `NOTIFY_SOCKET` every message is a no-op, so
//! the daemon runs the same outside systemd.
//!
//! The watchdog is enabled by `WATCHDOG_USEC` (and, when `WATCHDOG_PID` is set, only in the process it names, as
//! sd_watchdog_enabled(3) says). Every half of that period the supervisor task sends `WATCHDOG=1`, but only while
//! every watched part is healthy ([`crate::telemetry::Liveness`]): the spool writer (no append or seal left
//! unanswered), the lease keeper (no claim or renewal stuck) and the pipeline loop (no round without progress), each
//! allowed one full watchdog period for a single step. A part stalled longer stops the pings, and systemd restarts the
//! process; the supervisor runs on the async runtime, so a runtime whose threads are all blocked stops them as well.
//!
//! Progress is what a part reports when it moves: an append answered, a lease step done, a pack uploaded or
//! published, a reconcile step, a bucket request attempt ended or a multipart part sent. Each of those steps is
//! bounded (request timeouts), so a period above the longest one (checked at start, with a WARN) never restarts a
//! slow but healthy daemon. One exception: a publish waits while a server shows a month's drop of the catalog
//! running, which no server bounds (see [`crate::catalog::purge`]); a drop stuck that long restarts the daemon, whose
//! first publish waits for it again.
//!
//! States of the pinger: `watching` (pinging), `stalled` (a part named in the status line and one ERROR log; no
//! pings until it recovers). The status task reports the phase in `STATUS=`: `starting` (ingest up, catalog not yet),
//! `publishing`, `draining` (after `STOPPING=1`).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;

use crate::catalog::lease::LeaseState;
use crate::config::Config;
use crate::pipeline::off_runtime;
use crate::pipeline::status::{SpoolCounts, StatusBoard};
use crate::spool::PackState;
use crate::telemetry::Liveness;

/// How often `STATUS=` is refreshed (only sent when it changed).
const STATUS_PERIOD: Duration = Duration::from_secs(2);

/// What the daemon is doing, for the status line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Phase {
    Starting = 0,
    Publishing = 1,
    Draining = 2,
}

impl Phase {
    fn from_u8(value: u8) -> Phase {
        match value {
            1 => Phase::Publishing,
            2 => Phase::Draining,
            _ => Phase::Starting,
        }
    }
}

/// The daemon's side of the protocol: it sets the phase and sends the one-off messages; the supervisor task sends
/// the periodic ones.
pub(super) struct Systemd {
    phase: Arc<AtomicU8>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// `WATCHDOG_USEC` when the watchdog is meant for this process.
fn watchdog_period() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.trim().parse().ok().filter(|usec| *usec > 0)?;
    match std::env::var("WATCHDOG_PID") {
        Ok(pid) if pid.trim().parse::<u32>().ok() != Some(std::process::id()) => None,
        _ => Some(Duration::from_micros(usec)),
    }
}

fn notify(states: &[NotifyState]) {
    if let Err(error) = sd_notify::notify(false, states) {
        tracing::debug!(%error, "cannot notify systemd");
    }
}

/// The longest single step a watched part may take without progress in this configuration: a bucket call with its
/// retries, a catalog request, a publish.
fn longest_step(config: &Config) -> Duration {
    crate::bucket::longest_attempt(config.upload.part_size.0)
        .max(config.catalog.request_timeout.0)
        .max(config.lease.publish_timeout.0)
}

impl Systemd {
    /// `READY=1` (ingest is up: captures are accepted from now on) and start the watchdog pings and status lines.
    pub(super) fn ready(board: Arc<StatusBoard>) -> Systemd {
        notify(&[NotifyState::Ready]);
        let phase = Arc::new(AtomicU8::new(Phase::Starting as u8));
        let watchdog = watchdog_period();
        let mut tasks = vec![tokio::spawn(report_status(board.clone(), phase.clone(), watchdog))];
        if let Some(period) = watchdog {
            let step = longest_step(board.config());
            if period <= step {
                tracing::warn!(
                    watchdog = ?period,
                    longest_step = ?step,
                    "the watchdog period is not above the longest single step (a bucket call with its retries, a \
                     catalog request): a slow but healthy daemon may be restarted; raise WatchdogSec"
                );
            }
            tasks.push(tokio::spawn(ping_watchdog(board, period)));
        }
        Systemd { phase, tasks }
    }

    pub(super) fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    /// `STOPPING=1`, once, when a stop begins.
    pub(super) fn stopping(&self) {
        if self.phase.swap(Phase::Draining as u8, Ordering::Relaxed) != Phase::Draining as u8 {
            notify(&[NotifyState::Stopping, NotifyState::Status("draining: intake stopped, sealing the open pack")]);
        }
    }

    /// The drain made progress: ask for `window` more before systemd's stop timeout applies.
    pub(super) fn extend_stop_timeout(&self, window: Duration) {
        let usec = u32::try_from(window.as_micros()).unwrap_or(u32::MAX);
        notify(&[NotifyState::ExtendTimeoutUsec(usec)]);
    }

    pub(super) fn stop(self) {
        for task in self.tasks {
            task.abort();
        }
    }
}

/// The watched parts present so far (the lease keeper and the pipeline come up after the catalog connects).
fn watched_parts(board: &StatusBoard) -> Vec<(&'static str, Liveness)> {
    let mut parts = vec![("spool writer", board.writer_stats.liveness.clone())];
    if let Some(lease) = board.lease.get() {
        parts.push(("lease keeper", lease.liveness.clone()));
    }
    if let Some(counters) = board.pipeline_counters.get() {
        parts.push(("pipeline", counters.liveness.clone()));
    }
    parts
}

/// The parts stalled for longer than `limit`, named with how long.
fn stalled_parts(board: &StatusBoard, limit: Duration) -> Vec<String> {
    watched_parts(board)
        .into_iter()
        .filter_map(|(name, liveness)| {
            liveness.stalled_for(limit).map(|since| format!("{name} stalled for {}s", since.as_secs()))
        })
        .collect()
}

/// `WATCHDOG=1` every half period while no part is stalled for a whole period. A task of its own: nothing it does
/// blocks (the status line's spool listing runs elsewhere).
async fn ping_watchdog(board: Arc<StatusBoard>, period: Duration) {
    let mut ticks = tokio::time::interval(period / 2);
    let mut stalled_before = false;
    loop {
        ticks.tick().await;
        let stalled = stalled_parts(&board, period);
        match (stalled.is_empty(), stalled_before) {
            (true, _) => notify(&[NotifyState::Watchdog]),
            (false, false) => tracing::error!(
                stalled = %stalled.join(", "),
                "watchdog: a part is busy without progress; watchdog pings stop, so systemd restarts the process"
            ),
            (false, true) => {}
        }
        if stalled.is_empty() && stalled_before {
            tracing::warn!("watchdog: every part is moving again; pings resume");
        }
        stalled_before = !stalled.is_empty();
    }
}

/// `STATUS=` every [`STATUS_PERIOD`] when it changed.
async fn report_status(board: Arc<StatusBoard>, phase: Arc<AtomicU8>, watchdog: Option<Duration>) {
    let mut ticks = tokio::time::interval(STATUS_PERIOD);
    let mut last_status = String::new();
    loop {
        ticks.tick().await;
        let stalled = watchdog.map_or_else(Vec::new, |period| stalled_parts(&board, period));
        let status = status_line(&board, Phase::from_u8(phase.load(Ordering::Relaxed)), &stalled).await;
        if status != last_status {
            notify(&[NotifyState::Status(&status)]);
            last_status = status;
        }
    }
}

/// `publishing · lease held (term 3) · 2 packs owed · oldest unpublished 1.2s · last error: ...`
async fn status_line(board: &Arc<StatusBoard>, phase: Phase, stalled: &[String]) -> String {
    let measuring = board.clone();
    let spool = off_runtime(move || Ok(SpoolCounts::measure(&measuring.paths).unwrap_or_default())).await;
    let spool = spool.unwrap_or_default();
    let lease = board.lease.get().map(|lease| lease.status());
    let mut parts = vec![match phase {
        Phase::Starting => "starting: ingest up, connecting to the catalog".to_string(),
        Phase::Publishing => "publishing".to_string(),
        Phase::Draining => "draining".to_string(),
    }];
    if let Some(lease) = &lease {
        let state = match lease.lease_state {
            LeaseState::Held => format!("lease held (term {})", lease.lease_term),
            other => format!("lease {}", other.name()),
        };
        parts.push(state);
    }
    let owed: u64 = [PackState::Sealed, PackState::Uploaded]
        .iter()
        .filter_map(|state| spool.by_state.get(state.extension()))
        .map(|count| count.packs)
        .sum();
    parts.push(format!("{owed} packs owed"));
    parts.push(format!("oldest unpublished {:.1}s", spool.oldest_unpublished_age_seconds));
    parts.extend(stalled.iter().map(|stall| format!("watchdog: {stall}")));
    // The lease keeps the newest catalog error once it runs; before that, the connect loop's.
    let last_error = match lease {
        Some(lease) => lease.last_error,
        None => board.last_error(),
    };
    if let Some(error) = last_error {
        parts.push(format!("last error: {error}"));
    }
    parts.join(" · ")
}
