//! Test-only crash points: `CAPSTORE_FAILPOINTS=name[@n],...` makes the process SIGKILL itself the n-th time (default
//! the first) execution passes the named point. Crash tests use them to stop a real daemon at exactly the instants that
//! matter; with the variable unset every check is one relaxed load.
//!
//! Points: `after_append_before_ack`, `after_seal`, `after_intents_before_upload`, `mid_upload`,
//! `after_upload_before_rename`, `after_publish_before_delete`, `after_tombstones_before_commit` and
//! `after_deletion_commit` (a deletion's rows written, its `publishes` row not yet; committed, not yet answered);
//! compaction's `after_compacted_upload`, `after_switch_commit`, `during_object_deletion` and `during_row_purge`
//! (the first of a batch's three row-removal statements sent, the others not); retention's
//! `after_horizon_row_before_commit`, `after_horizon_commit` and `during_partition_drop` (the first partition of a
//! pass dropped, the others not); `capstore repartition`'s `repartition_after_a_rename` (one table swapped, the
//! others not).
//!
//! Error points make the caller fail instead, once: `fsync_fails` (an fsync of the open pack answers EIO, as a failed
//! writeback does; no device here can fail one for real) and `cut_fails` (the cut of a pack after that fails too).
//!
//! Stall points never return instead (the watchdog tests wedge a part with them): `stall_before_fsync` (blocks the
//! spool's syncer thread before an append's fsync), `stall_upload` (an upload that never answers, as a black-holed
//! bucket connection without timeouts would).
//!
//! Pause points hold their task for [`PAUSE`], once: a window in which a test acts between two steps. Retention's
//! `after_drop_check` (its check found nothing to remove first; the publish turn not taken yet) and
//! `before_partition_drop` (in the turn, checked again: the months are dropped next).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

pub const ENV: &str = "CAPSTORE_FAILPOINTS";

fn armed() -> &'static HashMap<String, (u64, AtomicU64)> {
    static ARMED: OnceLock<HashMap<String, (u64, AtomicU64)>> = OnceLock::new();
    ARMED.get_or_init(|| {
        let spec = std::env::var(ENV).unwrap_or_default();
        spec.split(',')
            .filter(|part| !part.trim().is_empty())
            .map(|part| {
                let (name, nth) = match part.trim().split_once('@') {
                    Some((name, nth)) => (name.to_string(), nth.parse().unwrap_or(1)),
                    None => (part.trim().to_string(), 1),
                };
                (name, (nth, AtomicU64::new(0)))
            })
            .collect()
    })
}

/// Die here (SIGKILL, no cleanup) if this point is armed and its count is reached.
pub fn hit(name: &str) {
    let Some((nth, passes)) = armed().get(name) else { return };
    if passes.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
        eprintln!("failpoint {name} reached: killing the process");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
        // SIGKILL cannot be caught; this is never reached.
        std::process::abort();
    }
}

/// Block this thread forever (a wedged disk, a lost lock) if this point is armed and its count is reached.
pub fn stall(name: &str) {
    let Some((nth, passes)) = armed().get(name) else { return };
    if passes.fetch_add(1, Ordering::SeqCst) + 1 >= *nth {
        eprintln!("failpoint {name} reached: stalling this thread");
        loop {
            std::thread::park();
        }
    }
}

/// Never finish (an await that hangs) if this point is armed and its count is reached.
pub async fn stall_async(name: &str) {
    let Some((nth, passes)) = armed().get(name) else { return };
    if passes.fetch_add(1, Ordering::SeqCst) + 1 >= *nth {
        eprintln!("failpoint {name} reached: this task hangs");
        std::future::pending::<()>().await;
    }
}

/// How long a pause point holds its task.
pub const PAUSE: Duration = Duration::from_secs(5);

/// Hold this task for [`PAUSE`] the n-th time execution passes `name` if it is armed.
pub async fn pause(name: &str) {
    let Some((nth, passes)) = armed().get(name) else { return };
    if passes.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
        eprintln!("failpoint {name} reached: pausing this task for {PAUSE:?}");
        tokio::time::sleep(PAUSE).await;
    }
}

/// True once, the n-th time execution passes `name` if it is armed: the caller fails there as the fault it stands for
/// would (the spool tests' `fsync_fails`, an fsync answering EIO once, as a failed writeback does).
pub fn fails(name: &str) -> bool {
    let Some((nth, passes)) = armed().get(name) else { return false };
    let failing = passes.fetch_add(1, Ordering::SeqCst) + 1 == *nth;
    if failing {
        eprintln!("failpoint {name} reached: failing here");
    }
    failing
}

/// Counts the passes of `name` from zero again, so that it fires once more: for a test that goes through several
/// scenarios in one process.
pub fn count_again(name: &str) {
    if let Some((_, passes)) = armed().get(name) {
        passes.store(0, Ordering::SeqCst);
    }
}

/// Whether `name` is armed at all (for points that need set-up before they can fire).
pub fn is_armed(name: &str) -> bool {
    armed().contains_key(name)
}
