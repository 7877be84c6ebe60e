//! Prometheus series of an engine-facing executor (`gpucache_executor::Executor`),
//! registered into the same registry as the store's metrics ([`crate::metered::Metrics`]).
//!
//! Everything is read at scrape time from the executor's own snapshots: its pressure snapshot
//! (queued jobs and payload bytes per kind, running jobs, undelivered results, the oldest job's
//! age), its health snapshot (state and outage count; reading it never takes the recovery probe),
//! its quarantined operations (the unproven native retirement) and its cumulative counters. A
//! scrape never calls the store, and no series carries a request id or an object key: the labels
//! name only the deployment (model, engine role, data-parallel and tensor-parallel rank), plus the
//! job kind or the health state where a family has one series each. Durations are in seconds
//! (the executor counts whole milliseconds). The series disappear when the executor is dropped.

use std::fmt;
use std::sync::{Arc, Weak};

use gpucache_executor::{Executor, HealthState, OperationKind};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// Who the executor's series belong to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ExecutorLabels {
    pub model: String,
    pub role: String,
    pub dp_rank: u32,
    pub tp_rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    model: String,
    role: String,
    dp_rank: u32,
    tp_rank: u32,
    kind: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StateLabels {
    model: String,
    role: String,
    dp_rank: u32,
    tp_rank: u32,
    state: &'static str,
}

/// The `state` label of each [`HealthState`], in the order the series are written.
pub const HEALTH_STATES: [&str; 3] = ["healthy", "cooling_down", "probing"];

fn health_state_label(state: HealthState) -> &'static str {
    match state {
        HealthState::Healthy => HEALTH_STATES[0],
        HealthState::CoolingDown { .. } => HEALTH_STATES[1],
        HealthState::Probing { .. } => HEALTH_STATES[2],
    }
}

/// Whole milliseconds as the seconds a Prometheus series carries.
fn seconds(ms: u64) -> f64 {
    // Exact below 2^53 ms (about 285,000 years).
    ms as f64 / 1000.0
}

/// The scrape-time view of one executor.
#[derive(Debug)]
struct ExecutorSeries {
    executor: Weak<Executor>,
    labels: ExecutorLabels,
}

/// Registers `executor`'s series into `registry` (the service's or the engine's, shared with the
/// store metrics). The registry holds only a weak reference: it never keeps an executor alive.
pub fn register_executor(
    registry: &mut Registry,
    executor: &Arc<Executor>,
    labels: ExecutorLabels,
) {
    registry.register_collector(Box::new(ExecutorSeries {
        executor: Arc::downgrade(executor),
        labels,
    }));
}

impl ExecutorSeries {
    fn kind(&self, kind: &'static str) -> KindLabels {
        let l = &self.labels;
        KindLabels {
            model: l.model.clone(),
            role: l.role.clone(),
            dp_rank: l.dp_rank,
            tp_rank: l.tp_rank,
            kind,
        }
    }

    fn gauge<N>(&self, e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: N) -> fmt::Result
    where
        ConstGauge<N>: EncodeMetric,
    {
        let g = ConstGauge::new(v);
        let mut family = e.encode_descriptor(name, help, None, g.metric_type())?;
        g.encode(family.encode_family(&self.labels)?)
    }

    fn counter(
        &self,
        e: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        v: u64,
    ) -> fmt::Result {
        let c = ConstCounter::new(v);
        let mut family = e.encode_descriptor(name, help, None, c.metric_type())?;
        c.encode(family.encode_family(&self.labels)?)
    }

    /// One gauge per health state, 1 for the executor's current state and 0 for the others.
    fn health_state(&self, e: &mut DescriptorEncoder<'_>, current: HealthState) -> fmt::Result {
        let mut family = e.encode_descriptor(
            "gpucache_executor_health_state",
            "Backend health: 1 for the current state (healthy, cooling_down after an outage, \
             probing), 0 for the others",
            None,
            ConstGauge::new(0u64).metric_type(),
        )?;
        let current = health_state_label(current);
        for state in HEALTH_STATES {
            let l = &self.labels;
            let labels = StateLabels {
                model: l.model.clone(),
                role: l.role.clone(),
                dp_rank: l.dp_rank,
                tp_rank: l.tp_rank,
                state,
            };
            ConstGauge::new(u64::from(state == current)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// One family with a series per job kind; `make` builds the metric of each value.
    fn per_kind<M: EncodeMetric>(
        &self,
        e: &mut DescriptorEncoder<'_>,
        (name, help): (&str, &str),
        values: [(&'static str, u64); 3],
        make: fn(u64) -> M,
    ) -> fmt::Result {
        let metric_type = make(0).metric_type();
        let mut family = e.encode_descriptor(name, help, None, metric_type)?;
        for (kind, v) in values {
            make(v).encode(family.encode_family(&self.kind(kind))?)?;
        }
        Ok(())
    }
}

impl Collector for ExecutorSeries {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let Some(executor) = self.executor.upgrade() else { return Ok(()) };
        let p = executor.pressure();
        let health = executor.health();
        let quarantined = executor.quarantined();
        let c = executor.counters();
        let e = &mut encoder;
        self.per_kind(
            e,
            ("gpucache_executor_queued_jobs", "Jobs waiting in each queue"),
            [("query", p.query.jobs), ("get", p.get.jobs), ("put", p.put.jobs)],
            ConstGauge::new,
        )?;
        self.per_kind(
            e,
            (
                "gpucache_executor_queued_payload_bytes",
                "Payload bytes of the jobs waiting in each queue",
            ),
            [
                ("query", p.query.payload_bytes),
                ("get", p.get.payload_bytes),
                ("put", p.put.payload_bytes),
            ],
            ConstGauge::new,
        )?;
        self.gauge(
            e,
            "gpucache_executor_running_jobs",
            "Jobs a worker is running",
            p.running_jobs,
        )?;
        self.gauge(
            e,
            "gpucache_executor_undelivered_results",
            "Finished results not yet polled (they still count against the operation limit)",
            p.undelivered_results,
        )?;
        self.gauge(
            e,
            "gpucache_executor_oldest_job_age_seconds",
            "Age of the oldest queued or running job, in seconds",
            seconds(p.oldest_job_age_ms),
        )?;
        self.health_state(e, health.state)?;
        self.counter(
            e,
            "gpucache_executor_outages",
            "Backend outages the executor has recorded",
            health.epoch,
        )?;
        self.gauge(
            e,
            "gpucache_executor_unretired_operations",
            "Operations whose native retirement is unproven (their Host ranges are quarantined)",
            quarantined.len() as u64,
        )?;
        self.gauge(
            e,
            "gpucache_executor_quarantined_bytes",
            "Host bytes quarantined by unretired operations",
            quarantined.iter().flat_map(|q| &q.ranges).map(|r| r.len).sum::<u64>(),
        )?;
        let kinds = |f: fn(&gpucache_executor::KindCounters) -> u64| {
            [
                ("query", f(c.of(OperationKind::Query))),
                ("get", f(c.of(OperationKind::Get))),
                ("put", f(c.of(OperationKind::Put))),
            ]
        };
        self.per_kind(
            e,
            ("gpucache_executor_completed_jobs", "Jobs a worker ran to the end, per kind"),
            kinds(|k| k.completed_jobs),
            ConstCounter::new,
        )?;
        self.per_kind(
            e,
            (
                "gpucache_executor_completed_payload_bytes",
                "Payload bytes of the jobs a worker ran to the end, per kind",
            ),
            kinds(|k| k.completed_payload_bytes),
            ConstCounter::new,
        )?;
        self.per_kind(
            e,
            (
                "gpucache_executor_queue_wait_seconds",
                "Seconds jobs waited in their queue before a worker took them, summed per kind",
            ),
            kinds(|k| k.queued_ms),
            |ms| ConstCounter::new(seconds(ms)),
        )?;
        self.per_kind(
            e,
            (
                "gpucache_executor_backend_seconds",
                "Seconds workers spent in store calls, summed per kind",
            ),
            kinds(|k| k.backend_ms),
            |ms| ConstCounter::new(seconds(ms)),
        )?;
        self.counter(e, "gpucache_executor_backend_calls", "Store calls made", c.backend_calls)?;
        self.counter(
            e,
            "gpucache_executor_query_keys_found",
            "QUERY keys found",
            c.query_keys_found,
        )?;
        self.counter(
            e,
            "gpucache_executor_get_keys_read",
            "GET keys read in full",
            c.get_keys_read,
        )?;
        self.counter(e, "gpucache_executor_get_bytes_read", "Bytes GET read", c.get_bytes_read)?;
        self.counter(
            e,
            "gpucache_executor_put_new_writes",
            "PUT keys newly written",
            c.put_new_writes,
        )?;
        self.counter(
            e,
            "gpucache_executor_put_new_bytes",
            "Bytes of new PUT writes",
            c.put_new_bytes,
        )?;
        self.counter(
            e,
            "gpucache_executor_put_already_stored",
            "PUT keys that succeeded because the object already existed (create-only)",
            c.put_already_stored,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_become_seconds_and_each_state_has_its_own_label() {
        assert_eq!(seconds(0), 0.0);
        assert_eq!(seconds(1_500), 1.5);
        assert_eq!(seconds(86_400_000), 86_400.0);
        let labels = [
            HealthState::Healthy,
            HealthState::CoolingDown { until_ms: 5 },
            HealthState::Probing { since_ms: 7 },
        ]
        .map(health_state_label);
        assert_eq!(labels, HEALTH_STATES);
    }
}
