//! Prometheus metrics for a store: [`MeteredStore`] wraps any [`Store`], counts and times every
//! call by operation and outcome, and [`Metrics`] encodes them (with gauges read from
//! [`Store::stats`] at scrape time) in the Prometheus or OpenMetrics text format.
//!
//! The wrapper observes and never decides: every call goes to the inner store unchanged, and its
//! answer comes back unchanged. A batch call goes to the inner store as the same batch call, and
//! each of its answers is counted exactly as the single-key call that answers the same would be
//! (so the series read the same whether a client batches or not). Serving the text over HTTP is
//! the CLI's job, not this module's.

use std::fmt;
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{Refusal, RequestId, ResourceLimits};
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchGet, BatchPut, Committed, Get, GetTo, GotOne, Implementation,
    Invalidate, Located, Lookup, MissReason, Put, Reclaimed, Reservation, Reserve, Retirement,
    Store, StoreError, StoreStats,
};

/// Upper bounds of the latency buckets, in seconds: 1-2.5-5 steps from 10 µs to 10 s.
pub const LATENCY_BUCKETS_SECONDS: [f64; 19] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Which text exposition format to encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpositionFormat {
    /// The Prometheus text format, version 0.0.4 (what `promtool check metrics` reads).
    Prometheus,
    /// OpenMetrics 1.0 text, ending in `# EOF` (what Prometheus asks for first).
    OpenMetrics,
}

impl ExpositionFormat {
    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Prometheus => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// A store call, as labelled in the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Lookup,
    Get,
    Reserve,
    Write,
    Commit,
    Abort,
    Invalidate,
    Put,
    ExpireLeases,
    AttestDrained,
    BumpEpoch,
    ReclaimFenced,
}

impl Op {
    pub const ALL: [Op; 12] = [
        Op::Lookup,
        Op::Get,
        Op::Reserve,
        Op::Write,
        Op::Commit,
        Op::Abort,
        Op::Invalidate,
        Op::Put,
        Op::ExpireLeases,
        Op::AttestDrained,
        Op::BumpEpoch,
        Op::ReclaimFenced,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Lookup => "lookup",
            Op::Get => "get",
            Op::Reserve => "reserve",
            Op::Write => "write",
            Op::Commit => "commit",
            Op::Abort => "abort",
            Op::Invalidate => "invalidate",
            Op::Put => "put",
            Op::ExpireLeases => "expire_leases",
            Op::AttestDrained => "attest_drained",
            Op::BumpEpoch => "bump_epoch",
            Op::ReclaimFenced => "reclaim_fenced",
        }
    }

    /// The outcomes this call can end with; each gets a series from the start so that rates
    /// over a fresh process are defined.
    fn outcomes(self) -> &'static [Outcome] {
        use Outcome::*;
        match self {
            Op::Lookup => &[Hit, PrefixHit, Miss, Error],
            Op::Get => &[Hit, Miss, Error],
            Op::Reserve => &[Reserved, AlreadyCommitted, Busy, Refused, Error],
            Op::Put => &[Committed, AlreadyCommitted, Busy, Refused, Error],
            Op::Commit => &[Committed, Error],
            Op::Abort => &[Released, Quarantined, Error],
            Op::Invalidate => &[Removed, Absent, Busy, Error],
            Op::Write
            | Op::ExpireLeases
            | Op::AttestDrained
            | Op::BumpEpoch
            | Op::ReclaimFenced => &[Ok, Error],
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How a store call ended, as labelled in the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Hit,
    PrefixHit,
    Miss,
    Reserved,
    Committed,
    AlreadyCommitted,
    Busy,
    Refused,
    Released,
    Quarantined,
    Removed,
    Absent,
    Ok,
    Error,
}

impl Outcome {
    const COUNT: usize = 14;

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hit => "hit",
            Outcome::PrefixHit => "prefix_hit",
            Outcome::Miss => "miss",
            Outcome::Reserved => "reserved",
            Outcome::Committed => "committed",
            Outcome::AlreadyCommitted => "already_committed",
            Outcome::Busy => "busy",
            Outcome::Refused => "refused",
            Outcome::Released => "released",
            Outcome::Quarantined => "quarantined",
            Outcome::Removed => "removed",
            Outcome::Absent => "absent",
            Outcome::Ok => "ok",
            Outcome::Error => "error",
        }
    }
}

// The per-op counter rows are indexed by outcome.
const _: () = assert!(Outcome::Error as usize + 1 == Outcome::COUNT);

/// The label of a refusal reason: one fixed string per [`Refusal`] variant.
pub fn refusal_reason(refusal: &Refusal) -> &'static str {
    match refusal {
        Refusal::ObjectTooLarge { .. } => "object_too_large",
        Refusal::InflightRequests { .. } => "inflight_requests",
        Refusal::Registrations { .. } => "registrations",
        Refusal::Tenants { .. } => "tenants",
        Refusal::RetainedBytes { .. } => "retained_bytes",
        Refusal::TenantRetainedBytes { .. } => "tenant_retained_bytes",
        Refusal::TenantInflightBytes { .. } => "tenant_inflight_bytes",
        Refusal::IdempotencyTable { .. } => "idempotency_table",
        Refusal::DiskFull { .. } => "disk_full",
        // A variant added later shows up here until it gets its own label.
        _ => "other",
    }
}

/// Every reason [`refusal_reason`] can return except the catch-all.
pub const REFUSAL_REASONS: [&str; 9] = [
    "object_too_large",
    "inflight_requests",
    "registrations",
    "tenants",
    "retained_bytes",
    "tenant_retained_bytes",
    "tenant_inflight_bytes",
    "idempotency_table",
    "disk_full",
];

/// The label of a miss reason.
pub fn miss_reason(miss: &MissReason) -> &'static str {
    match miss {
        MissReason::Absent => "absent",
        MissReason::Incompatible => "incompatible",
        MissReason::NotReadable(_) => "not_readable",
        MissReason::Corrupt => "corrupt",
    }
}

const MISS_REASONS: [&str; 4] = ["absent", "incompatible", "not_readable", "corrupt"];

fn retirement_label(retirement: Retirement) -> &'static str {
    match retirement {
        Retirement::Retired => "retired",
        Retirement::Unknown => "unknown",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OpOutcomeLabels {
    op: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BytesLabels {
    op: &'static str,
    direction: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct MissLabels {
    op: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    op: &'static str,
    retirement: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VersionLabels {
    version: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CorruptLabels {
    phase: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StoreLabels {
    store: &'static str,
    implementation: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS_SECONDS)
}

/// Reads the watched store's stats on each scrape. Holds the store weakly: the store owns the
/// metrics (through its wrapper), so a strong reference here would keep both alive forever.
#[derive(Debug, Default)]
struct StoreGauges {
    store: RwLock<Option<Weak<dyn Store>>>,
}

impl StoreGauges {
    fn gauge(
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        value: u64,
    ) -> fmt::Result {
        let g = ConstGauge::new(value);
        g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
    }

    fn counter(
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        value: u64,
    ) -> fmt::Result {
        let c = ConstCounter::new(value);
        c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
    }
}

/// The configured resource limits as gauges (`gpucache_limit_*`), fixed for the registry's life,
/// so that a usage gauge can be divided by its limit: `gpucache_retained_bytes /
/// gpucache_limit_retained_bytes` is how full the store is.
pub fn register_limits(registry: &mut Registry, limits: &ResourceLimits) {
    let gauge = |v: u64| {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        g
    };
    registry.register(
        "gpucache_limit_retained_bytes",
        "limits.retained_bytes_max: bytes all blocks that are not absent may hold",
        gauge(limits.retained_bytes_max),
    );
    registry.register(
        "gpucache_limit_inflight_requests",
        "limits.inflight_requests_max: requests admitted and not yet finished",
        gauge(limits.inflight_requests_max.into()),
    );
    registry.register(
        "gpucache_limit_registrations",
        "limits.registrations_max: registered regions",
        gauge(limits.registrations_max.into()),
    );
    registry.register(
        "gpucache_limit_tenants",
        "limits.tenants_max: tenants holding resources at once",
        gauge(limits.tenants_max.into()),
    );
    registry.register(
        "gpucache_limit_object_bytes",
        "limits.object_bytes_max: the largest block",
        gauge(limits.object_bytes_max),
    );
}

/// Block staging's counters and slot gauges, read from the staging at every scrape
/// (`gpucache_staging_*`): what an operator watches for slots stuck in quarantine.
#[derive(Debug)]
pub struct StagingGauges {
    staging: Arc<dyn gpucache_wire::staging::BlockStaging>,
}

impl StagingGauges {
    /// Registers the staging's metrics into `registry`.
    pub fn register(
        registry: &mut Registry,
        staging: Arc<dyn gpucache_wire::staging::BlockStaging>,
    ) {
        registry.register_collector(Box::new(Self { staging }));
    }
}

impl Collector for StagingGauges {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let s = self.staging.stats();
        let e = &mut encoder;
        StoreGauges::counter(
            e,
            "gpucache_staging_staged",
            "Stages opened (GET and PUT)",
            s.staged,
        )?;
        StoreGauges::counter(
            e,
            "gpucache_staging_committed",
            "PUT stages stored through the store",
            s.committed,
        )?;
        StoreGauges::counter(
            e,
            "gpucache_staging_released",
            "Stages returned by RELEASE or a refused commit",
            s.released,
        )?;
        StoreGauges::counter(
            e,
            "gpucache_staging_quarantined",
            "Staging slots quarantined (lease expiry, a stage open at close)",
            s.quarantined,
        )?;
        StoreGauges::counter(
            e,
            "gpucache_staging_fenced",
            "Staging slots returned by fences",
            s.fenced,
        )?;
        StoreGauges::gauge(e, "gpucache_staging_open", "Stages open now", s.open)?;
        StoreGauges::gauge(
            e,
            "gpucache_staging_free_slots",
            "Staging slots free now",
            s.free_slots,
        )?;
        StoreGauges::gauge(
            e,
            "gpucache_staging_quarantined_slots",
            "Staging slots quarantined now (until a fence returns them)",
            s.quarantined_slots,
        )?;
        StoreGauges::gauge(
            e,
            "gpucache_staging_peers",
            "Peer agents whose metadata is loaded now",
            s.peers,
        )?;
        StoreGauges::gauge(
            e,
            "gpucache_staging_slot_bytes",
            "Bytes per staging slot: the largest block that can be staged",
            s.slot_bytes,
        )
    }
}

impl Collector for StoreGauges {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let store = self.store.read().unwrap_or_else(PoisonError::into_inner).clone();
        let Some(store) = store.and_then(|w| w.upgrade()) else {
            return Ok(());
        };
        let info = store.info();
        let StoreStats { usage, regions, committed_blocks, corrupt_dropped, evictions } =
            store.stats();
        let epoch = store.epoch();
        let e = &mut encoder;

        let labels = StoreLabels {
            store: info.name,
            implementation: match info.implementation {
                Implementation::Real => "real",
                Implementation::Simulated { .. } => "simulated",
            },
        };
        let g = ConstGauge::new(1u64);
        let mut family = e.encode_descriptor(
            "gpucache_store_info",
            "The store behind the service (always 1)",
            None,
            g.metric_type(),
        )?;
        g.encode(family.encode_family(&labels)?)?;

        Self::gauge(e, "gpucache_epoch", "Current fencing epoch", epoch.0)?;
        Self::gauge(
            e,
            "gpucache_retained_bytes",
            "Bytes held by blocks that are not absent (reserved, committed, quarantined)",
            usage.retained_bytes,
        )?;
        Self::gauge(
            e,
            "gpucache_inflight_requests",
            "Requests admitted and not yet finished",
            usage.inflight_requests.into(),
        )?;
        Self::gauge(
            e,
            "gpucache_registrations",
            "Registered regions: reservations, committed blocks and quarantined regions",
            usage.registrations.into(),
        )?;
        Self::gauge(
            e,
            "gpucache_tenants_active",
            "Tenants holding any resources",
            usage.tenants.into(),
        )?;
        Self::gauge(e, "gpucache_committed_blocks", "Readable blocks", committed_blocks)?;
        Self::gauge(
            e,
            "gpucache_quarantined_regions",
            "Regions quarantined until an attestation or an epoch fence",
            u64::try_from(regions.quarantined).unwrap_or(u64::MAX),
        )?;
        Self::gauge(
            e,
            "gpucache_quarantined_bytes",
            "Bytes held by quarantined regions",
            regions.quarantined_bytes,
        )?;
        Self::counter(e, "gpucache_evictions", "Committed blocks evicted to make room", evictions)?;
        let c = ConstCounter::new(0u64);
        let mut family = e.encode_descriptor(
            "gpucache_corrupt_dropped",
            "Damaged blocks dropped, by where they were found (open, get) and what was wrong",
            None,
            c.metric_type(),
        )?;
        for (phase, reason, n) in corrupt_dropped.iter() {
            let labels = CorruptLabels { phase: phase.name(), reason: reason.name() };
            ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The metrics of one store, and the registry that encodes them.
///
/// Series for every operation and its possible outcomes exist from the start at zero; recording
/// is one atomic add (plus a histogram update) on handles resolved at construction.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `[op][outcome]`, present for the outcomes the op can have.
    ops: Vec<[Option<Counter>; Outcome::COUNT]>,
    latency: Vec<Histogram>,
    get_bytes_out: Counter,
    put_bytes_in: Counter,
    write_bytes_in: Counter,
    refusals: Family<ReasonLabels, Counter>,
    misses: Family<MissLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    leases_expired: Counter,
    gauges: Arc<StoreGauges>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics in a registry of their own.
    pub fn new() -> Self {
        Self::with_registry(Registry::default())
    }

    /// Registers the store metrics into `registry` (which may already hold the caller's own
    /// metrics, e.g. the server's connection counts) and keeps it for encoding.
    pub fn with_registry(mut registry: Registry) -> Self {
        let ops_family = Family::<OpOutcomeLabels, Counter>::default();
        let latency_family = Family::<OpLabels, Histogram>::new_with_constructor(histogram as _);
        let bytes = Family::<BytesLabels, Counter>::default();
        let refusals = Family::<ReasonLabels, Counter>::default();
        let misses = Family::<MissLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let leases_expired = Counter::default();

        let ops = Op::ALL
            .iter()
            .map(|&op| {
                let mut row: [Option<Counter>; Outcome::COUNT] = Default::default();
                for &outcome in op.outcomes() {
                    let labels = OpOutcomeLabels { op: op.as_str(), outcome: outcome.as_str() };
                    row[outcome as usize] = Some(ops_family.get_or_create_owned(&labels));
                }
                row
            })
            .collect();
        let latency = Op::ALL
            .iter()
            .map(|op| latency_family.get_or_create_owned(&OpLabels { op: op.as_str() }))
            .collect();
        let bytes_counter = |op: Op, direction| {
            bytes.get_or_create_owned(&BytesLabels { op: op.as_str(), direction })
        };
        let get_bytes_out = bytes_counter(Op::Get, "out");
        let put_bytes_in = bytes_counter(Op::Put, "in");
        let write_bytes_in = bytes_counter(Op::Write, "in");
        for reason in REFUSAL_REASONS {
            let _ = refusals.get_or_create_owned(&ReasonLabels { reason });
        }
        for op in [Op::Lookup, Op::Get] {
            for reason in MISS_REASONS {
                let _ = misses.get_or_create_owned(&MissLabels { op: op.as_str(), reason });
            }
        }
        for op in Op::ALL {
            for retirement in [Retirement::Retired, Retirement::Unknown] {
                let retirement = retirement_label(retirement);
                let _ = errors.get_or_create_owned(&ErrorLabels { op: op.as_str(), retirement });
            }
        }

        registry.register(
            "gpucache_build",
            "Version of the gpucache build serving these metrics",
            Info::new(VersionLabels { version: env!("CARGO_PKG_VERSION") }),
        );
        registry.register("gpucache_ops", "Store calls by operation and outcome", ops_family);
        registry.register(
            "gpucache_op_seconds",
            "Store call latency by operation, in seconds",
            latency_family,
        );
        registry.register(
            "gpucache_bytes",
            "Payload bytes moved by operation: get out to callers, put and write in from them",
            bytes,
        );
        registry.register(
            "gpucache_refusals",
            "Admissions refused (reserve and put), by the limit that refused them",
            refusals.clone(),
        );
        registry.register(
            "gpucache_misses",
            "Lookups and gets that found nothing usable, by reason",
            misses.clone(),
        );
        registry.register(
            "gpucache_errors",
            "Failed store calls by operation and whether the caller's buffers are retired",
            errors.clone(),
        );
        registry.register(
            "gpucache_leases_expired",
            "Reservations quarantined because their write lease ran out",
            leases_expired.clone(),
        );
        let gauges = Arc::new(StoreGauges::default());
        registry.register_collector(Box::new(Arc::clone(&gauges)));

        Self {
            registry,
            ops,
            latency,
            get_bytes_out,
            put_bytes_in,
            write_bytes_in,
            refusals,
            misses,
            errors,
            leases_expired,
            gauges,
        }
    }

    /// Reads the gauges (retained bytes, epoch, quarantine...) from `store` at every scrape.
    /// The store is held weakly; once it is dropped the gauges are left out. Replaces any store
    /// watched before.
    pub fn watch_store(&self, store: Weak<dyn Store>) {
        *self.gauges.store.write().unwrap_or_else(PoisonError::into_inner) = Some(store);
    }

    /// The registry the metrics live in.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Encodes every metric, reading the store gauges now.
    pub fn encode(&self, format: ExpositionFormat) -> String {
        let mut text = String::with_capacity(16 << 10);
        let encoded = match format {
            ExpositionFormat::Prometheus => {
                prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
            }
            ExpositionFormat::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut text, &self.registry)
            }
        };
        // Writing into a String cannot fail; an error here means a metric refused to encode,
        // which is a bug in this module, not an operating condition.
        debug_assert!(encoded.is_ok(), "metrics failed to encode: {encoded:?}");
        text
    }

    fn record(&self, op: Op, outcome: Outcome, started: Instant) {
        if let Some(counter) = &self.ops[op.index()][outcome as usize] {
            counter.inc();
        } else {
            debug_assert!(false, "{} cannot end {}", op.as_str(), outcome.as_str());
        }
        self.latency[op.index()].observe(started.elapsed().as_secs_f64());
    }

    fn record_error(&self, op: Op, error: &StoreError, started: Instant) {
        self.record(op, Outcome::Error, started);
        let labels =
            ErrorLabels { op: op.as_str(), retirement: retirement_label(error.retirement()) };
        self.errors.get_or_create(&labels).inc();
    }

    fn record_miss(&self, op: Op, miss: &MissReason) {
        self.misses.get_or_create(&MissLabels { op: op.as_str(), reason: miss_reason(miss) }).inc();
    }

    fn record_refusal(&self, refusal: &Refusal) {
        self.refusals.get_or_create(&ReasonLabels { reason: refusal_reason(refusal) }).inc();
    }

    fn record_lookup(&self, result: Result<&Lookup, &StoreError>, started: Instant) {
        match result {
            Ok(Lookup::Hit { .. }) => self.record(Op::Lookup, Outcome::Hit, started),
            Ok(Lookup::PrefixHit { .. }) => self.record(Op::Lookup, Outcome::PrefixHit, started),
            Ok(Lookup::Miss(reason)) => {
                self.record(Op::Lookup, Outcome::Miss, started);
                self.record_miss(Op::Lookup, reason);
            }
            Err(e) => self.record_error(Op::Lookup, e, started),
        }
    }

    fn record_get(&self, result: &Result<Get, StoreError>, started: Instant) {
        match result {
            Ok(Get::Hit { len, .. }) => {
                self.record(Op::Get, Outcome::Hit, started);
                self.get_bytes_out.inc_by(*len);
            }
            Ok(Get::Miss(reason)) => {
                self.record(Op::Get, Outcome::Miss, started);
                self.record_miss(Op::Get, reason);
            }
            Err(e) => self.record_error(Op::Get, e, started),
        }
    }

    /// A PUT of `len` bytes.
    fn record_put(&self, result: &Result<Put, StoreError>, len: usize, started: Instant) {
        match result {
            Ok(Put::Committed(_)) => {
                self.record(Op::Put, Outcome::Committed, started);
                self.put_bytes_in.inc_by(len as u64);
            }
            Ok(Put::AlreadyCommitted) => self.record(Op::Put, Outcome::AlreadyCommitted, started),
            Ok(Put::Busy) => self.record(Op::Put, Outcome::Busy, started),
            Ok(Put::Refused(refusal)) => {
                self.record(Op::Put, Outcome::Refused, started);
                self.record_refusal(refusal);
            }
            Err(e) => self.record_error(Op::Put, e, started),
        }
    }

    fn record_invalidate(&self, result: &Result<Invalidate, StoreError>, started: Instant) {
        match result {
            Ok(Invalidate::Removed) => self.record(Op::Invalidate, Outcome::Removed, started),
            Ok(Invalidate::Absent) => self.record(Op::Invalidate, Outcome::Absent, started),
            Ok(Invalidate::Busy) => self.record(Op::Invalidate, Outcome::Busy, started),
            Err(e) => self.record_error(Op::Invalidate, e, started),
        }
    }

    /// Records a result whose success has only one outcome.
    fn record_plain<T>(&self, op: Op, result: &Result<T, StoreError>, started: Instant) {
        match result {
            Ok(_) => self.record(op, Outcome::Ok, started),
            Err(e) => self.record_error(op, e, started),
        }
    }
}

/// A store that records every call in [`Metrics`] and otherwise behaves exactly like `S`.
pub struct MeteredStore<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S: Store> fmt::Debug for MeteredStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeteredStore").field("inner", &self.inner.info().name).finish()
    }
}

impl<S: Store> MeteredStore<S> {
    /// Wraps `inner`. The gauges read no stats until [`Metrics::watch_store`] is given a store;
    /// [`MeteredStore::shared`] does both.
    pub fn new(inner: S, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }

    /// Wraps `inner` behind an `Arc` and has `metrics` read its stats at every scrape.
    pub fn shared(inner: S, metrics: Arc<Metrics>) -> Arc<Self>
    where
        S: 'static,
    {
        let store = Arc::new(Self::new(inner, metrics));
        let weak: Weak<dyn Store> = Arc::downgrade(&store) as Weak<dyn Store>;
        store.metrics.watch_store(weak);
        store
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Records each PUT of a batch, with its payload's length.
    fn record_puts(&self, answers: &BatchAnswers<Put>, items: &[BatchPut<'_>], started: Instant) {
        for (answer, item) in answers.iter().zip(items) {
            self.metrics.record_put(answer, item.src.len(), started);
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// A layer: the calls it does not count (info, epoch, stats, condition) are the inner store's.
impl<S: Store> gpucache_dataplane::store::StoreLayer for MeteredStore<S> {
    type Inner = S;

    fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: Store> gpucache_dataplane::store::Store for MeteredStore<S> {
    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        let started = Instant::now();
        let result = self.inner.lookup(caller, key);
        self.metrics.record_lookup(result.as_ref(), started);
        result
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let started = Instant::now();
        let result = self.inner.get_into(caller, key, dst);
        self.metrics.record_get(&result, started);
        result
    }

    /// Lends when the inner store does, recorded as a GET.
    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        capacity: usize,
        to: &mut dyn GetTo,
    ) -> Result<GotOne, StoreError> {
        let started = Instant::now();
        let result = self.inner.get_one(caller, key, capacity, to);
        self.metrics.record_get(&result.as_ref().map(|got| got.get).map_err(Clone::clone), started);
        result
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        let started = Instant::now();
        let result = self.inner.reserve(caller, key, len, request);
        let m = &self.metrics;
        match &result {
            Ok(Reserve::Reserved(_)) => m.record(Op::Reserve, Outcome::Reserved, started),
            Ok(Reserve::AlreadyCommitted) => {
                m.record(Op::Reserve, Outcome::AlreadyCommitted, started)
            }
            Ok(Reserve::Busy) => m.record(Op::Reserve, Outcome::Busy, started),
            Ok(Reserve::Refused(refusal)) => {
                m.record(Op::Reserve, Outcome::Refused, started);
                m.record_refusal(refusal);
            }
            Err(e) => m.record_error(Op::Reserve, e, started),
        }
        result
    }

    fn write(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        let started = Instant::now();
        let result = self.inner.write(caller, reservation, offset, src);
        self.metrics.record_plain(Op::Write, &result, started);
        if result.is_ok() {
            self.metrics.write_bytes_in.inc_by(src.len() as u64);
        }
        result
    }

    fn commit(&self, caller: &Caller, reservation: &Reservation) -> Result<Committed, StoreError> {
        let started = Instant::now();
        let result = self.inner.commit(caller, reservation);
        match &result {
            Ok(_) => self.metrics.record(Op::Commit, Outcome::Committed, started),
            Err(e) => self.metrics.record_error(Op::Commit, e, started),
        }
        result
    }

    fn abort(
        &self,
        caller: &Caller,
        reservation: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        let started = Instant::now();
        let result = self.inner.abort(caller, reservation, outcome);
        let m = &self.metrics;
        match &result {
            Ok(Abort::Released) => m.record(Op::Abort, Outcome::Released, started),
            Ok(Abort::Quarantined) => m.record(Op::Abort, Outcome::Quarantined, started),
            Err(e) => m.record_error(Op::Abort, e, started),
        }
        result
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let started = Instant::now();
        let result = self.inner.invalidate(caller, key);
        self.metrics.record_invalidate(&result, started);
        result
    }

    fn expire_leases(&self) -> Result<usize, StoreError> {
        let started = Instant::now();
        let result = self.inner.expire_leases();
        self.metrics.record_plain(Op::ExpireLeases, &result, started);
        if let Ok(n) = result {
            self.metrics.leases_expired.inc_by(u64::try_from(n).unwrap_or(u64::MAX));
        }
        result
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        let started = Instant::now();
        let result = self.inner.attest_drained(caller, region);
        self.metrics.record_plain(Op::AttestDrained, &result, started);
        result
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        let started = Instant::now();
        let result = self.inner.bump_epoch();
        self.metrics.record_plain(Op::BumpEpoch, &result, started);
        result
    }

    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        let started = Instant::now();
        let result = self.inner.reclaim_fenced(epoch);
        self.metrics.record_plain(Op::ReclaimFenced, &result, started);
        result
    }

    /// Delegates to the inner store's own `put` (which may be faster than reserve, write and
    /// commit), so one PUT is recorded once, as `put`.
    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        let started = Instant::now();
        let result = self.inner.put(caller, key, src, request);
        self.metrics.record_put(&result, src.len(), started);
        result
    }

    /// One batch call of the inner store's own, each answer counted exactly as its single-key
    /// call would be; every item's latency is the batch's (the time until its answer came).
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        let started = Instant::now();
        let answers = self.inner.lookup_batch(caller, keys);
        answers.iter().for_each(|a| self.metrics.record_lookup(a.as_ref(), started));
        answers
    }

    /// Counted as lookups.
    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        let started = Instant::now();
        let answers = self.inner.locate(caller, keys);
        for a in &answers {
            self.metrics.record_lookup(a.as_ref().map(|l| &l.lookup), started);
        }
        answers
    }

    /// As [`Self::lookup_batch`].
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let started = Instant::now();
        let answers = self.inner.get_batch(caller, items);
        answers.iter().for_each(|a| self.metrics.record_get(a, started));
        answers
    }

    /// As [`Self::lookup_batch`].
    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        let started = Instant::now();
        let answers = self.inner.put_batch(caller, items);
        self.record_puts(&answers, items, started);
        answers
    }

    /// As [`Self::put_batch`]; the inner store compares the checksums.
    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        let started = Instant::now();
        let answers = self.inner.put_batch_checked(caller, items, expected);
        self.record_puts(&answers, items, started);
        answers
    }

    /// As [`Self::lookup_batch`].
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        let started = Instant::now();
        let answers = self.inner.invalidate_batch(caller, keys);
        answers.iter().for_each(|a| self.metrics.record_invalidate(a, started));
        answers
    }
    gpucache_dataplane::forward_store!(reports, info, epoch, scope_keys);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpucache_dataplane::clock::ManualClock;
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::limits::ResourceLimits;
    use gpucache_dataplane::testing::fixture;

    use super::*;
    use gpucache_storage::MemoryStore;

    fn metered(limits: ResourceLimits) -> Arc<MeteredStore<Arc<MemoryStore>>> {
        let memory = Arc::new(MemoryStore::new(limits, Arc::new(ManualClock::default())).unwrap());
        MeteredStore::shared(memory, Arc::new(Metrics::new()))
    }

    fn assert_lines(text: &str, lines: &[&str]) {
        for line in lines {
            assert!(text.lines().any(|l| l == *line), "missing line {line:?} in:\n{text}");
        }
    }

    #[test]
    fn counts_hits_misses_refusals_and_corruption() {
        let limits = ResourceLimits { object_bytes_max: 1024, ..ResourceLimits::default() };
        let shared = metered(limits);
        // Through the wrapper itself: `Arc<S>`'s own Store impl does not forward `put`.
        let store: &MeteredStore<_> = &shared;
        let caller = fixture::caller(0);
        let k1 = fixture::key(0, &[1], KvDtype::F16, 16);
        let k2 = fixture::key(0, &[2], KvDtype::F16, 16);
        let payload = fixture::payload(1, 100);
        let mut dst = vec![0u8; 1024];

        assert!(matches!(store.put(&caller, &k1, &payload, None), Ok(Put::Committed(_))));
        assert_eq!(store.put(&caller, &k1, &payload, None), Ok(Put::AlreadyCommitted));
        assert!(matches!(store.get_into(&caller, &k1, &mut dst), Ok(Get::Hit { len: 100, .. })));
        assert_eq!(store.get_into(&caller, &k2, &mut dst), Ok(Get::Miss(MissReason::Absent)));
        assert!(matches!(
            store.put(&caller, &k2, &vec![0u8; 2048], None),
            Ok(Put::Refused(Refusal::ObjectTooLarge { .. }))
        ));
        assert!(store.inner().corrupt_for_test(&k1, 3));
        assert_eq!(store.get_into(&caller, &k1, &mut dst), Ok(Get::Miss(MissReason::Corrupt)));
        // Another tenant's key: an error that retired the caller's buffers.
        let other = fixture::key(1, &[1], KvDtype::F16, 16);
        assert!(matches!(store.lookup(&caller, &other), Err(StoreError::WrongTenant { .. })));
        assert_eq!(store.lookup(&caller, &k1), Ok(Lookup::Miss(MissReason::Absent)));

        for format in [ExpositionFormat::Prometheus, ExpositionFormat::OpenMetrics] {
            let text = store.metrics().encode(format);
            assert_lines(
                &text,
                &[
                    r#"gpucache_ops_total{op="put",outcome="committed"} 1"#,
                    r#"gpucache_ops_total{op="put",outcome="already_committed"} 1"#,
                    r#"gpucache_ops_total{op="put",outcome="refused"} 1"#,
                    r#"gpucache_ops_total{op="get",outcome="hit"} 1"#,
                    r#"gpucache_ops_total{op="get",outcome="miss"} 2"#,
                    r#"gpucache_ops_total{op="lookup",outcome="miss"} 1"#,
                    r#"gpucache_ops_total{op="lookup",outcome="error"} 1"#,
                    r#"gpucache_ops_total{op="reserve",outcome="reserved"} 0"#,
                    r#"gpucache_bytes_total{op="get",direction="out"} 100"#,
                    r#"gpucache_bytes_total{op="put",direction="in"} 100"#,
                    r#"gpucache_refusals_total{reason="object_too_large"} 1"#,
                    r#"gpucache_refusals_total{reason="disk_full"} 0"#,
                    r#"gpucache_misses_total{op="get",reason="absent"} 1"#,
                    r#"gpucache_misses_total{op="get",reason="corrupt"} 1"#,
                    r#"gpucache_misses_total{op="lookup",reason="absent"} 1"#,
                    r#"gpucache_errors_total{op="lookup",retirement="retired"} 1"#,
                    r#"gpucache_op_seconds_count{op="get"} 3"#,
                    r#"gpucache_op_seconds_count{op="put"} 3"#,
                    r#"gpucache_store_info{store="memory",implementation="real"} 1"#,
                    "gpucache_epoch 1",
                    "gpucache_committed_blocks 0",
                    "gpucache_retained_bytes 0",
                    r#"gpucache_corrupt_dropped_total{phase="get",reason="checksum"} 1"#,
                    r#"gpucache_corrupt_dropped_total{phase="open",reason="header"} 0"#,
                    "gpucache_evictions_total 0",
                    "gpucache_quarantined_regions 0",
                    &format!(r#"gpucache_build_info{{version="{}"}} 1"#, env!("CARGO_PKG_VERSION")),
                ],
            );
        }
        let text = store.metrics().encode(ExpositionFormat::Prometheus);
        assert_lines(&text, &[r#"gpucache_op_seconds_bucket{op="put",le="+Inf"} 3"#]);
        let open = store.metrics().encode(ExpositionFormat::OpenMetrics);
        assert!(open.ends_with("# EOF\n"), "OpenMetrics text must end in # EOF");
    }

    /// The series other than latencies, sorted: a batch must leave exactly these as the same
    /// calls one by one do (latency counts included; their sums and buckets are timing).
    fn counted(store: &MeteredStore<Arc<MemoryStore>>) -> Vec<String> {
        let text = store.metrics().encode(ExpositionFormat::Prometheus);
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| {
                !l.starts_with('#')
                    && !l.starts_with("gpucache_op_seconds_bucket")
                    && !l.starts_with("gpucache_op_seconds_sum")
            })
            .map(str::to_owned)
            .collect();
        lines.sort();
        lines
    }

    #[test]
    fn a_batch_counts_exactly_as_its_calls_one_by_one() {
        let limits = ResourceLimits { object_bytes_max: 1024, ..ResourceLimits::default() };
        let (batched, one_by_one) = (metered(limits.clone()), metered(limits));
        let caller = fixture::caller(0);
        let keys: Vec<_> = (0..6u8).map(|i| fixture::key(0, &[i], KvDtype::F16, 16)).collect();
        let other = fixture::key(1, &[1], KvDtype::F16, 16);
        let values: Vec<Vec<u8>> =
            (0..6usize).map(|i| fixture::payload(i as u64, 10 + 100 * i)).collect();
        let big = vec![7u8; 2048];
        // Puts: stored, refused (too large), the same key again, another tenant's key.
        let puts = [
            BatchPut { key: &keys[0], src: &values[0], request: None },
            BatchPut { key: &keys[1], src: &values[1], request: None },
            BatchPut { key: &keys[2], src: &big, request: None },
            BatchPut { key: &keys[0], src: &values[0], request: None },
            BatchPut { key: &other, src: &values[3], request: None },
        ];
        let reads: Vec<&PhysicalKey> = vec![&keys[0], &keys[1], &keys[2], &other, &keys[5]];
        let run_batched = |store: &MeteredStore<Arc<MemoryStore>>| {
            store.put_batch(&caller, &puts);
            store.lookup_batch(&caller, &reads);
            let mut bufs =
                [vec![0u8; 1024], vec![0u8; 8], vec![0u8; 1024], vec![0u8; 1024], vec![0u8; 1024]];
            let mut items: Vec<_> =
                reads.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
            store.get_batch(&caller, &mut items);
            store.invalidate_batch(&caller, &reads);
        };
        let run_one_by_one = |store: &MeteredStore<Arc<MemoryStore>>| {
            for p in &puts {
                let _ = store.put(&caller, p.key, p.src, p.request);
            }
            for key in &reads {
                let _ = store.lookup(&caller, key);
            }
            let mut bufs =
                [vec![0u8; 1024], vec![0u8; 8], vec![0u8; 1024], vec![0u8; 1024], vec![0u8; 1024]];
            for (key, dst) in reads.iter().zip(&mut bufs) {
                let _ = store.get_into(&caller, key, dst);
            }
            for key in &reads {
                let _ = store.invalidate(&caller, key);
            }
        };
        run_batched(&batched);
        run_one_by_one(&one_by_one);
        let (a, b) = (counted(&batched), counted(&one_by_one));
        assert_eq!(a, b);
        // And the run counted something of every kind it did.
        for line in [
            r#"gpucache_ops_total{op="put",outcome="committed"} 2"#,
            r#"gpucache_ops_total{op="put",outcome="refused"} 1"#,
            r#"gpucache_ops_total{op="put",outcome="already_committed"} 1"#,
            r#"gpucache_ops_total{op="get",outcome="hit"} 1"#,
            r#"gpucache_ops_total{op="invalidate",outcome="removed"} 2"#,
            r#"gpucache_op_seconds_count{op="lookup"} 5"#,
        ] {
            assert!(a.iter().any(|l| l == line), "missing {line:?} in:\n{}", a.join("\n"));
        }
        assert!(a.iter().any(|l| l.starts_with(r#"gpucache_errors_total{op="get",retirement="retired"} 2"#)), "{a:?}");
    }

    #[test]
    fn split_put_quarantine_and_gauges() {
        let store = metered(ResourceLimits::default());
        let caller = fixture::caller(0);
        let key = fixture::key(0, &[1, 2], KvDtype::F16, 16);
        let Ok(Reserve::Reserved(r)) = store.reserve(&caller, &key, 10, None) else {
            panic!("reserve failed")
        };
        store.write(&caller, &r, 0, &[7u8; 4]).unwrap();
        assert!(store.commit(&caller, &r).is_err(), "commit of a partly written block");
        let text = store.metrics().encode(ExpositionFormat::Prometheus);
        assert_lines(
            &text,
            &[
                r#"gpucache_ops_total{op="reserve",outcome="reserved"} 1"#,
                r#"gpucache_ops_total{op="write",outcome="ok"} 1"#,
                r#"gpucache_bytes_total{op="write",direction="in"} 4"#,
                r#"gpucache_ops_total{op="commit",outcome="error"} 1"#,
                r#"gpucache_errors_total{op="commit",retirement="retired"} 1"#,
                "gpucache_inflight_requests 1",
                "gpucache_retained_bytes 10",
                "gpucache_registrations 1",
            ],
        );
        assert_eq!(store.abort(&caller, r, Retirement::Unknown), Ok(Abort::Quarantined));
        let epoch = store.bump_epoch().unwrap();
        let text = store.metrics().encode(ExpositionFormat::Prometheus);
        assert_lines(
            &text,
            &[
                r#"gpucache_ops_total{op="abort",outcome="quarantined"} 1"#,
                r#"gpucache_ops_total{op="bump_epoch",outcome="ok"} 1"#,
                "gpucache_quarantined_regions 1",
                "gpucache_quarantined_bytes 10",
                &format!("gpucache_epoch {}", epoch.0),
            ],
        );
        assert_eq!(store.reclaim_fenced(epoch), Ok(1));
        let text = store.metrics().encode(ExpositionFormat::Prometheus);
        assert_lines(
            &text,
            &[
                r#"gpucache_ops_total{op="reclaim_fenced",outcome="ok"} 1"#,
                "gpucache_quarantined_regions 0",
                "gpucache_retained_bytes 0",
            ],
        );
    }

    #[test]
    fn gauges_disappear_with_the_store() {
        let metrics = Arc::new(Metrics::new());
        let memory =
            MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default())).unwrap();
        let store = MeteredStore::shared(memory, Arc::clone(&metrics));
        assert!(metrics.encode(ExpositionFormat::Prometheus).contains("gpucache_epoch 1"));
        drop(store);
        let text = metrics.encode(ExpositionFormat::Prometheus);
        assert!(!text.contains("gpucache_epoch"), "a dropped store still reports gauges");
        assert!(text.contains("gpucache_ops_total"), "counters outlive the store");
    }

    /// Staging that only reports fixed stats: enough to encode [`StagingGauges`].
    #[derive(Debug)]
    struct FixedStaging(gpucache_wire::staging::StagingStats);

    impl gpucache_wire::staging::BlockStaging for FixedStaging {
        fn attach(
            &self,
            _: &gpucache_wire::staging::StageOwner,
            _: &[u8],
        ) -> Result<Vec<u8>, gpucache_wire::staging::StagingError> {
            Err(self.refused())
        }

        fn slot_bytes(&self) -> u64 {
            self.0.slot_bytes
        }

        fn stage_get(
            &self,
            _: &gpucache_wire::staging::StageOwner,
            _: u64,
            _: &mut [&mut gpucache_wire::staging::FillSlot<'_>],
        ) -> Result<
            Vec<Result<gpucache_wire::staging::StagedGet, StoreError>>,
            gpucache_wire::staging::StagingError,
        > {
            Err(self.refused())
        }

        fn reserve_put(
            &self,
            _: &gpucache_wire::staging::StageOwner,
            _: u64,
            _: gpucache_wire::staging::PutIntent,
        ) -> Result<gpucache_wire::staging::StagedSlot, gpucache_wire::staging::StagingError>
        {
            Err(self.refused())
        }

        fn commit_put(
            &self,
            _: &gpucache_wire::staging::StageOwner,
            _: gpucache_wire::staging::StageId,
            _: &mut gpucache_wire::staging::StoreSlot<'_>,
        ) -> Result<Result<Put, StoreError>, gpucache_wire::staging::StagingError> {
            Err(self.refused())
        }

        fn release(
            &self,
            _: &gpucache_wire::staging::StageOwner,
            stages: &[gpucache_wire::staging::StageId],
        ) -> Vec<bool> {
            vec![false; stages.len()]
        }

        fn connection_closed(&self, _: u64) {}

        fn expire(&self, _: u64) -> usize {
            0
        }

        fn fence(&self) -> Result<usize, gpucache_wire::staging::StagingError> {
            Ok(0)
        }

        fn stats(&self) -> gpucache_wire::staging::StagingStats {
            self.0
        }

        fn registered(&self) -> bool {
            true
        }
    }

    impl FixedStaging {
        fn refused(&self) -> gpucache_wire::staging::StagingError {
            gpucache_wire::staging::StagingError::NotEnabled { reason: "fixed stats only".into() }
        }
    }

    #[test]
    fn staging_and_limit_gauges_encode_and_pass_promtool() {
        let stats = gpucache_wire::staging::StagingStats {
            staged: 9,
            committed: 4,
            released: 3,
            quarantined: 2,
            fenced: 1,
            open: 2,
            free_slots: 5,
            quarantined_slots: 1,
            peers: 3,
            slot_bytes: 1 << 20,
        };
        let mut registry = Registry::default();
        StagingGauges::register(&mut registry, Arc::new(FixedStaging(stats)));
        let limits = ResourceLimits {
            retained_bytes_max: 1 << 30,
            tenant_retained_bytes_max: 1 << 30,
            ..ResourceLimits::default()
        };
        register_limits(&mut registry, &limits);
        let metrics = Arc::new(Metrics::with_registry(registry));
        let memory = MemoryStore::new(limits.clone(), Arc::new(ManualClock::default())).unwrap();
        let _store = MeteredStore::shared(memory, Arc::clone(&metrics));
        let text = metrics.encode(ExpositionFormat::Prometheus);
        assert_lines(
            &text,
            &[
                "gpucache_staging_staged_total 9",
                "gpucache_staging_committed_total 4",
                "gpucache_staging_released_total 3",
                "gpucache_staging_quarantined_total 2",
                "gpucache_staging_fenced_total 1",
                "gpucache_staging_open 2",
                "gpucache_staging_free_slots 5",
                "gpucache_staging_quarantined_slots 1",
                "gpucache_staging_peers 3",
                "gpucache_staging_slot_bytes 1048576",
                "gpucache_limit_retained_bytes 1073741824",
                &format!("gpucache_limit_inflight_requests {}", limits.inflight_requests_max),
                &format!("gpucache_limit_registrations {}", limits.registrations_max),
                &format!("gpucache_limit_tenants {}", limits.tenants_max),
                &format!("gpucache_limit_object_bytes {}", limits.object_bytes_max),
                // Every op's error series exists before any call fails.
                r#"gpucache_errors_total{op="reclaim_fenced",retirement="unknown"} 0"#,
            ],
        );
        let Some((ok, printed)) = gpucache_dataplane::testing::process::promtool(
            &["check", "metrics"],
            std::path::Path::new("."),
            &text,
        ) else {
            return;
        };
        assert!(ok && printed.is_empty(), "promtool check metrics said:\n{printed}\n{text}");
    }

    #[test]
    fn every_refusal_variant_has_its_label() {
        let t = fixture::tenant(0);
        let refusals = [
            Refusal::ObjectTooLarge { bytes: 2, max: 1 },
            Refusal::InflightRequests { current: 1, max: 1 },
            Refusal::Registrations { current: 1, max: 1 },
            Refusal::Tenants { current: 1, max: 1 },
            Refusal::RetainedBytes { current: 1, requested: 1, max: 1 },
            Refusal::TenantRetainedBytes { tenant: t.clone(), current: 1, requested: 1, max: 1 },
            Refusal::TenantInflightBytes { tenant: t, current: 1, requested: 1, max: 1 },
            Refusal::IdempotencyTable { entries: 1, max: 1 },
            Refusal::DiskFull { free_bytes: 0, requested: 1 },
        ];
        let labels: Vec<&str> = refusals.iter().map(refusal_reason).collect();
        assert_eq!(labels, REFUSAL_REASONS);
    }
}
