//! Small helpers shared by every module: wall-clock time in the forms the catalog and logs use, and the host name.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Nanoseconds since the Unix epoch (0 if the clock is before 1970, which no real host is).
pub fn now_ns() -> u64 {
    system_time_ns(SystemTime::now())
}

pub fn system_time_ns(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// `2026-11-30T07:15:16Z` for a time in nanoseconds since the epoch.
pub fn ns_to_rfc3339(ns: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_nanos(ns)).to_string()
}

/// How long ago a UUIDv7 (a pack id) was made, by the wall clock; `None` for other UUIDs or a time in the future.
pub fn age_of_uuid_v7(id: uuid::Uuid) -> Option<Duration> {
    let (seconds, nanos) = id.get_timestamp()?.to_unix();
    age_of(Duration::new(seconds, nanos))
}

/// How long ago `ns` (nanoseconds since the epoch) was, by the wall clock; `None` for 0 (unknown) or the future.
pub fn age_of_ns(ns: u64) -> Option<Duration> {
    (ns != 0).then(|| age_of(Duration::from_nanos(ns))).flatten()
}

/// How long ago the instant `since_epoch` after the epoch was; `None` for the future.
fn age_of(since_epoch: Duration) -> Option<Duration> {
    SystemTime::now().duration_since(UNIX_EPOCH + since_epoch).ok()
}

/// `ids` with each id once, at its first place: a list of ids asked for is answered once per id.
pub fn unique_ids(ids: &[uuid::Uuid]) -> Vec<uuid::Uuid> {
    let mut seen = std::collections::HashSet::new();
    ids.iter().copied().filter(|id| seen.insert(*id)).collect()
}

/// This machine's host name (`unknown-host` if the kernel will not say), for holder strings and the spool lock.
pub fn host_name() -> String {
    nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_else(|_| "unknown-host".into())
}
