//! The engine-facing asynchronous L3 path: the executor that runs an engine's QUERY, GET and
//! PUT jobs against a store, off the scheduling thread, and reports their completion facts back,
//! and the scheduler-side admission that decides which of them to start. It is built on the
//! contract in `gpucache-dataplane` (keys, the [`Store`](gpucache_dataplane::Store) trait, the
//! clock, the credit pools) and holds no store of its own.
//!
//! - [`core`]: the [`Executor`] itself: bounded QUERY, GET and PUT queues with their own
//!   worker threads, the outstanding-operation limit, cancellation, `poll()` with the pressure
//!   snapshot, the store-result contract (exact-byte GETs, idempotent create-only PUTs,
//!   retirement) and quarantine after an unretired result. Its workers are the only threads
//!   that call the store.
//! - [`host`]: the one registered Host allocation jobs read from and write into.
//! - [`job`]: the values crossing the boundary: refusals, per-operation results, the pressure
//!   snapshot, counters and the close report.
//! - [`health`]: the private backend-health monitor (cooldown after an outage, one recovery
//!   probe, health epochs so that a stale success cannot hide a newer outage);
//! - [`agreement`]: the merge of every cache owner's completion reports for one operation into
//!   the one result all owners act on.
//! - [`admission`]: the scheduler-side owner of storage preparation: credits, storage tickets
//!   and leases, soft deadlines, Ready holds, backup candidates and the pressure gate.
//!
//! The executor reports facts; admission credits ([`admission`]), publication, negative
//! metadata and metrics registration belong to others. Time comes from an injected clock.
//! With the `testing` feature, its `testing` module holds the fixtures that start an executor
//! in other crates' tests.

pub mod admission;
pub mod agreement;
pub mod core;
// The core's tests run real threads against the std locks; loom builds leave them out.
#[cfg(all(test, not(loom)))]
mod core_tests;
pub mod health;
pub mod host;
pub mod job;
#[cfg(all(test, loom))]
mod loom_health;
mod sync;
#[cfg(feature = "testing")]
pub mod testing;

pub use self::core::{Executor, ExecutorConfig, ExecutorError};
pub use agreement::{
    AgreedCompletion, Agreement, AgreementLimits, CompletionRecord, OperationId, OperationKind,
    OwnerIndex, OwnerReport, Pressure, ProtocolError, RegisterRefusal, RoundOutcome, merge_records,
};
pub use health::{
    Admission, BackendOutcome, Evidence, HealthMonitor, HealthSnapshot, HealthState, Rejected,
    ReportEffect,
};
pub use host::{HostBuffer, HostBufferError, HostRange, RangeError};
pub use job::{
    CancelOutcome, CloseReport, Ending, ExecutorCounters, KeyFailure, KeyResult, KindCounters,
    OperationResult, Poll, PressureSnapshot, QuarantinedOperation, QueueLoad, SubmitRefusal,
};
