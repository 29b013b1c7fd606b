//! `GET /metrics`: Prometheus/OpenMetrics text of every counter, gauge and latency histogram, sampled at the scrape.
//! Names are stable (`deploy/prometheus/capstore.rules.yml` and `deploy/grafana/capstore.json` query them; a test
//! checks both against a live scrape).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::{ApiError, HttpState};
use crate::catalog::lease::LeaseState;
use crate::pipeline::off_runtime;
use crate::pipeline::status::{SpoolCounts, StatusBoard};

pub(super) async fn metrics(
    State(state): State<Arc<HttpState>>,
    headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    let board = state.board.clone();
    let sample = off_runtime(move || Ok(MetricsSample::take(&board)))
        .await
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    let mut registry = Registry::default();
    registry.register_collector(Box::new(sample));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    // Prometheus asks for OpenMetrics in its Accept header; anything else (curl, promtool, older scrapers) gets the
    // classic text format.
    let wants_open_metrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(|value| value.contains("application/openmetrics-text"));
    if wants_open_metrics {
        let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
        return Ok(([(header::CONTENT_TYPE, content_type)], text).into_response());
    }
    let content_type = "text/plain; version=0.0.4; charset=utf-8";
    Ok(([(header::CONTENT_TYPE, content_type)], classic_text(&text)).into_response())
}

/// OpenMetrics text as the classic Prometheus text format: a counter family is named by its `_total` sample, and
/// there are no `# UNIT` or `# EOF` lines. The samples are the same in both.
fn classic_text(open_metrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut text = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "].into_iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters.contains(name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        text.push_str(descriptor.as_deref().unwrap_or(line));
        text.push('\n');
    }
    text
}

const LEASE_STATES: [LeaseState; 6] = [
    LeaseState::None,
    LeaseState::Held,
    LeaseState::Quarantined,
    LeaseState::Reacquiring,
    LeaseState::Failed,
    LeaseState::Released,
];

/// Every metric's value at one scrape; counters are monotonic since the process started.
#[derive(Debug)]
struct MetricsSample {
    counters: Vec<(&'static str, &'static str, u64)>,
    gauges: Vec<(&'static str, &'static str, i64)>,
    /// Gauges in seconds (the unit is appended to the name).
    seconds_gauges: Vec<(&'static str, &'static str, f64)>,
    /// Latency histograms in seconds (the unit is appended to the name).
    histograms: Vec<(&'static str, &'static str, Histogram)>,
    lease_state: LeaseState,
    spool: SpoolCounts,
}

impl MetricsSample {
    fn take(board: &StatusBoard) -> MetricsSample {
        let writer = board.writer_stats.snapshot();
        let ingest = &board.ingest_stats;
        let pipeline_opt = board.pipeline_counters.get().map(|counters| counters.snapshot());
        let pipeline = |pick: fn(&crate::pipeline::PipelineCounts) -> u64| pipeline_opt.as_ref().map_or(0, pick);
        let lease_opt = board.lease.get().map(|lease| lease.status());
        let lease = |pick: fn(&crate::catalog::lease::LeaseStatus) -> u64| lease_opt.as_ref().map_or(0, pick);
        let counters = vec![
            ("capstore_captures_appended", "captures appended to the spool (fsynced)", writer.records_appended),
            ("capstore_bytes_appended", "payload bytes appended to the spool", writer.bytes_appended),
            ("capstore_fsyncs", "spool fsyncs (one per group commit)", writer.fsyncs),
            ("capstore_packs_sealed", "packs sealed", writer.packs_sealed),
            ("capstore_appends_refused", "appends refused (quota, size, I/O, closed)", writer.appends_refused),
            (
                "capstore_seals_failed",
                "pack seals that failed (each is tried again until it goes through)",
                writer.seals_failed,
            ),
            ("capstore_inbox_files_ingested", "inbox files ingested", ingest.files_ingested.load(Ordering::Relaxed)),
            (
                "capstore_inbox_files_quarantined",
                "inbox files moved to quarantine",
                ingest.files_quarantined.load(Ordering::Relaxed),
            ),
            ("capstore_packs_uploaded", "packs uploaded and verified", pipeline(|p| p.packs_uploaded)),
            ("capstore_bytes_uploaded", "pack bytes uploaded", pipeline(|p| p.bytes_uploaded)),
            ("capstore_packs_indexed", "packs published to the catalog", pipeline(|p| p.packs_indexed)),
            ("capstore_captures_indexed", "captures published to the catalog", pipeline(|p| p.captures_indexed)),
            ("capstore_publishes", "catalog publishes (versions committed)", pipeline(|p| p.publishes)),
            ("capstore_captures_deleted", "captures deleted (API and retention)", pipeline(|p| p.captures_deleted)),
            ("capstore_packs_compacted", "packs replaced by compaction", pipeline(|p| p.packs_compacted)),
            (
                "capstore_compaction_rewritten_bytes",
                "bytes of captures copied into compacted packs",
                pipeline(|p| p.compaction_bytes_rewritten),
            ),
            (
                "capstore_objects_removed",
                "objects of replaced packs removed from the bucket",
                pipeline(|p| p.objects_removed),
            ),
            (
                "capstore_captures_purged",
                "deleted captures whose catalog rows were removed",
                pipeline(|p| p.captures_purged),
            ),
            (
                "capstore_partitions_dropped",
                "partitions of months below the retention horizon dropped from the catalog tables",
                pipeline(|p| p.partitions_dropped),
            ),
            ("capstore_packs_quarantined", "packs moved to quarantine", pipeline(|p| p.packs_quarantined)),
            ("capstore_upload_failures", "pack uploads that failed (each is retried)", pipeline(|p| p.upload_failures)),
            (
                "capstore_packs_reconciled",
                "packs published from the bucket by reconcile",
                pipeline(|p| p.packs_reconciled),
            ),
            ("capstore_lease_renewals", "lease renewals", lease(|l| l.lease_renewals)),
            ("capstore_lease_reacquisitions", "lease re-acquisitions", lease(|l| l.lease_reacquisitions)),
            ("capstore_lease_timeouts", "lease statements that timed out", lease(|l| l.lease_timeouts)),
        ];
        let lease_term = i64::try_from(lease(|l| l.lease_term)).unwrap_or(i64::MAX);
        let spool = SpoolCounts::measure(&board.paths).unwrap_or_default();
        let config = &board.config().spool;
        let as_i64 = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        let free_bytes = crate::durable::free_bytes(&board.paths.packs).map_or(-1, as_i64);
        let gauges = vec![
            ("capstore_lease_term", "current lease term", lease_term),
            (
                "capstore_catalog_reachable",
                "1 if the newest lease statement got an answer from the catalog",
                i64::from(lease_opt.as_ref().is_some_and(|l| l.catalog_reachable)),
            ),
            ("capstore_spool_total_bytes", "bytes of every pack in the spool", as_i64(spool.total_bytes)),
            (
                "capstore_packs_left_open",
                "packs whose seal failed, tried again until sealed (newer packs wait for them)",
                as_i64(writer.packs_left_open),
            ),
            (
                "capstore_packs_in_quarantine",
                "packs waiting for an operator in <spool>/quarantine/packs (-1 if it cannot be read)",
                spool.packs_in_quarantine.map_or(-1, as_i64),
            ),
            ("capstore_spool_max_bytes", "the spool quota (spool.max_bytes)", as_i64(config.max_bytes.0)),
            ("capstore_spool_free_bytes", "free bytes on the spool's filesystem (-1 if unknown)", free_bytes),
            (
                "capstore_spool_min_free_bytes",
                "the free-space floor (spool.min_free_bytes)",
                as_i64(config.min_free_bytes.0),
            ),
        ];
        let started_at =
            board.started_at.duration_since(std::time::UNIX_EPOCH).map_or(0.0, |since| since.as_secs_f64());
        let seconds_gauges = vec![
            (
                "capstore_oldest_unpublished_age",
                "age of the oldest pack not yet published (open, sealed or uploaded); 0 when none",
                spool.oldest_unpublished_age_seconds,
            ),
            ("capstore_start_time", "when this process started, in seconds since the Unix epoch", started_at),
        ];
        let mut histograms = vec![
            (
                "capstore_append_to_ack",
                "an append's request to its acknowledgement (fsynced) or refusal",
                board.writer_stats.append_latency.histogram().clone(),
            ),
            (
                "capstore_lease_renew_duration",
                "one renewal of the held lease (its fenced statement and read-back), sent to answered (whatever the answer)",
                board.lease_renew_latency.histogram().clone(),
            ),
        ];
        if let Some(counters) = board.pipeline_counters.get() {
            histograms.extend([
                ("capstore_upload_duration", "one pack's upload and verification", counters.upload_latency.histogram().clone()),
                (
                    "capstore_publish_duration",
                    "one publish (its fenced statements and read-back), sent to answered",
                    counters.publish_latency.histogram().clone(),
                ),
                (
                    "capstore_ack_to_published",
                    "per published pack, its first capture's acknowledgement to the publish (the longest wait in the pack)",
                    counters.ack_to_published_latency.histogram().clone(),
                ),
            ]);
        }
        MetricsSample {
            counters,
            gauges,
            seconds_gauges,
            histograms,
            lease_state: lease_opt.as_ref().map_or(LeaseState::None, |l| l.lease_state),
            spool,
        }
    }
}

impl Collector for MetricsSample {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, value) in &self.counters {
            let counter = ConstCounter::new(*value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        for (name, help, value) in &self.gauges {
            let gauge = ConstGauge::new(*value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        for (name, help, value) in &self.seconds_gauges {
            let gauge = ConstGauge::new(*value);
            gauge.encode(encoder.encode_descriptor(name, help, Some(&Unit::Seconds), gauge.metric_type())?)?;
        }
        for (name, help, histogram) in &self.histograms {
            histogram.encode(encoder.encode_descriptor(
                name,
                help,
                Some(&Unit::Seconds),
                histogram.metric_type(),
            )?)?;
        }
        let mut family = encoder.encode_descriptor(
            "capstore_lease_state",
            "1 for the lease's current state, 0 for the others",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for state in LEASE_STATES {
            let gauge = ConstGauge::new(i64::from(state == self.lease_state));
            gauge.encode(family.encode_family(&[("state", state.name())])?)?;
        }
        let by_state: Vec<(&String, i64, i64)> = self
            .spool
            .by_state
            .iter()
            .map(|(state, count)| {
                (state, i64::try_from(count.packs).unwrap_or(i64::MAX), i64::try_from(count.bytes).unwrap_or(i64::MAX))
            })
            .collect();
        let mut packs_family = encoder.encode_descriptor(
            "capstore_spool_packs",
            "packs in the spool per state",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (state, packs, _) in &by_state {
            ConstGauge::new(*packs).encode(packs_family.encode_family(&[("state", state.as_str())])?)?;
        }
        let mut bytes_family = encoder.encode_descriptor(
            "capstore_spool_bytes",
            "bytes in the spool per pack state",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (state, _, bytes) in &by_state {
            ConstGauge::new(*bytes).encode(bytes_family.encode_family(&[("state", state.as_str())])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_text_names_counter_families_by_their_total_sample_and_drops_openmetrics_only_lines() {
        // The encoder's real output for the shapes /metrics uses: a counter, a gauge, a histogram with a unit.
        let mut registry = Registry::default();
        let counter = prometheus_client::metrics::counter::Counter::<u64>::default();
        counter.inc_by(3);
        registry.register("a_things", "things", counter);
        let gauge = prometheus_client::metrics::gauge::Gauge::<i64>::default();
        gauge.set(1);
        registry.register("c_level", "level", gauge);
        let histogram = Histogram::new([0.1, 1.0]);
        histogram.observe(0.5);
        registry.register_with_unit("b_wait", "wait", Unit::Seconds, histogram);
        let mut open_metrics = String::new();
        prometheus_client::encoding::text::encode(&mut open_metrics, &registry).unwrap();
        assert!(
            open_metrics.contains("# TYPE a_things counter\n") && open_metrics.ends_with("# EOF\n"),
            "{open_metrics}"
        );

        let classic = classic_text(&open_metrics);
        let lines: Vec<&str> = classic.lines().collect();
        for expected in [
            "# HELP a_things_total things.",
            "# TYPE a_things_total counter",
            "a_things_total 3",
            "# TYPE c_level gauge",
            "c_level 1",
            "# TYPE b_wait_seconds histogram",
            "b_wait_seconds_bucket{le=\"1.0\"} 1",
            "b_wait_seconds_count 1",
        ] {
            assert!(lines.contains(&expected), "{expected:?} missing from:\n{classic}");
        }
        assert!(!classic.contains("# EOF") && !classic.contains("# UNIT"), "{classic}");
    }
}
