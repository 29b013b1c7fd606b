//! The status snapshot: every lease field, spool counts per state, pipeline counters. The supervisor refreshes it once
//! a second into `<spool>/status.json` (atomically replaced, not fsynced: it is a view, not state), which
//! `capstore status` prints.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::spool::{list_packs, PackState, SpoolPaths};

pub const STATUS_FILE: &str = "status.json";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StateCount {
    pub packs: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SpoolCounts {
    pub by_state: BTreeMap<String, StateCount>,
    pub total_bytes: u64,
    /// Age of the oldest pack not yet published (open, sealed or uploaded), in seconds.
    pub oldest_unpublished_age_seconds: f64,
}

impl SpoolCounts {
    pub fn measure(paths: &SpoolPaths) -> std::io::Result<SpoolCounts> {
        let mut counts = SpoolCounts::default();
        let now = SystemTime::now();
        for state in PackState::ALL {
            counts.by_state.insert(state.extension().to_string(), StateCount::default());
        }
        for pack in list_packs(paths)? {
            let entry = counts.by_state.entry(pack.state.extension().to_string()).or_default();
            entry.packs += 1;
            entry.bytes += pack.bytes;
            counts.total_bytes += pack.bytes;
            // Pack ids are UUIDv7: their timestamp is when the pack was opened.
            let opened_ms =
                pack.pack_id.get_timestamp().map(|ts| ts.to_unix()).map_or(0.0, |(s, n)| s as f64 + n as f64 / 1e9);
            let now_s = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            counts.oldest_unpublished_age_seconds = counts.oldest_unpublished_age_seconds.max(now_s - opened_ms);
        }
        Ok(counts)
    }
}

/// Write the snapshot (any serializable value) to `<spool>/status.json`.
pub fn write_status(spool_root: &Path, snapshot: &serde_json::Value) -> std::io::Result<()> {
    let path = spool_root.join(STATUS_FILE);
    let temp = crate::durable::temp_path_for(&path);
    std::fs::write(&temp, serde_json::to_vec_pretty(snapshot).map_err(std::io::Error::other)?)?;
    std::fs::rename(&temp, &path)
}
