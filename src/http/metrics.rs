//! `GET /metrics`: Prometheus/OpenMetrics text of every counter and gauge, sampled at the scrape.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::{ApiError, HttpState};
use crate::catalog::lease::LeaseState;
use crate::pipeline::off_runtime;
use crate::pipeline::status::{SpoolCounts, StatusBoard};

pub(super) async fn metrics(State(state): State<Arc<HttpState>>) -> Result<Response, ApiError> {
    let board = state.board.clone();
    let sample = off_runtime(move || Ok(MetricsSample::take(&board)))
        .await
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    let mut registry = Registry::default();
    registry.register_collector(Box::new(sample));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .map_err(|error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    Ok(([(header::CONTENT_TYPE, content_type)], text).into_response())
}

const LEASE_STATES: [LeaseState; 6] = [
    LeaseState::None,
    LeaseState::Held,
    LeaseState::Quarantined,
    LeaseState::Reacquiring,
    LeaseState::Failed,
    LeaseState::Released,
];

fn lease_state_name(state: LeaseState) -> String {
    serde_json::to_value(state).ok().and_then(|value| value.as_str().map(str::to_string)).unwrap_or_default()
}

/// Every metric's value at one scrape; counters are monotonic since the process started.
#[derive(Debug)]
struct MetricsSample {
    counters: Vec<(&'static str, &'static str, u64)>,
    gauges: Vec<(&'static str, &'static str, i64)>,
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
            ("capstore_packs_quarantined", "packs moved to quarantine", pipeline(|p| p.packs_quarantined)),
            ("capstore_lease_renewals", "lease renewals", lease(|l| l.lease_renewals)),
            ("capstore_lease_reacquisitions", "lease re-acquisitions", lease(|l| l.lease_reacquisitions)),
            ("capstore_lease_timeouts", "lease statements that timed out", lease(|l| l.lease_timeouts)),
        ];
        let lease_term = i64::try_from(lease(|l| l.lease_term)).unwrap_or(i64::MAX);
        MetricsSample {
            counters,
            gauges: vec![("capstore_lease_term", "current lease term", lease_term)],
            lease_state: lease_opt.as_ref().map_or(LeaseState::None, |l| l.lease_state),
            spool: SpoolCounts::measure(&board.paths).unwrap_or_default(),
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
        let mut family = encoder.encode_descriptor(
            "capstore_lease_state",
            "1 for the lease's current state, 0 for the others",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for state in LEASE_STATES {
            let gauge = ConstGauge::new(i64::from(state == self.lease_state));
            gauge.encode(family.encode_family(&[("state", lease_state_name(state))])?)?;
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
