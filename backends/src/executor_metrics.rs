//! Prometheus series of an engine-facing executor (`gpucache_dataplane::executor::Executor`),
//! registered into the same registry as the store's metrics ([`crate::metered::Metrics`]).
//!
//! Everything is read at scrape time from the executor's own snapshots: its pressure snapshot
//! (queued jobs and payload bytes per kind, running jobs, undelivered results, the oldest job's
//! age), its health snapshot (state and epoch; reading it never takes the recovery probe), its
//! quarantined operations (the unproven native retirement) and its cumulative counters. A scrape
//! never calls the store, and no series carries a request id or an object key: the labels name
//! only the deployment (model, engine role, data-parallel and tensor-parallel rank). The series
//! disappear when the executor is dropped.

use std::fmt;
use std::sync::{Arc, Weak};

use gpucache_dataplane::executor::{Executor, HealthState, OperationKind};
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

    fn gauge(&self, e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> fmt::Result {
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
            "gpucache_executor_oldest_job_age_ms",
            "Age of the oldest queued or running job, in milliseconds",
            p.oldest_job_age_ms,
        )?;
        let state = match health.state {
            HealthState::Healthy => 0,
            HealthState::CoolingDown { .. } => 1,
            HealthState::Probing { .. } => 2,
        };
        self.gauge(
            e,
            "gpucache_executor_health_state",
            "Backend health: 0 healthy, 1 cooling down after an outage, 2 probing",
            state,
        )?;
        self.gauge(e, "gpucache_executor_health_epoch", "Outages recorded so far", health.epoch)?;
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
            quarantined.iter().flat_map(|q| &q.ranges).map(|r| r.len).sum(),
        )?;
        let kinds = |f: fn(&gpucache_dataplane::executor::KindCounters) -> u64| {
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
                "gpucache_executor_queue_ms",
                "Cumulative milliseconds jobs waited in their queue before a worker took them",
            ),
            kinds(|k| k.queued_ms),
            ConstCounter::new,
        )?;
        self.per_kind(
            e,
            (
                "gpucache_executor_backend_ms",
                "Cumulative milliseconds workers spent in store calls",
            ),
            kinds(|k| k.backend_ms),
            ConstCounter::new,
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
