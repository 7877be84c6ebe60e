//! The engine-facing asynchronous L3 executor: the part of the data plane that runs an
//! engine's QUERY, GET and PUT jobs against a store, off the scheduling thread, and reports
//! their completion facts back.
//!
//! This first part holds only its pure, self-contained pieces:
//! - [`health`]: the private backend-health monitor (cooldown after an outage, one recovery
//!   probe, health epochs so that a stale success cannot hide a newer outage);
//! - [`agreement`]: the merge of every cache owner's completion reports for one operation into
//!   the one result all owners act on.
//!
//! The bounded queues, the workers, admission credits and metrics registration come later and
//! build on these; nothing here starts a thread, calls a store or reads a wall clock.

pub mod agreement;
pub mod health;
#[cfg(all(test, loom))]
mod loom_health;
mod sync;

pub use agreement::{
    AgreedCompletion, Agreement, AgreementLimits, CompletionRecord, OperationId, OperationKind,
    OwnerIndex, OwnerReport, Pressure, ProtocolError, RegisterRefusal, RoundOutcome, merge_records,
};
pub use health::{
    Admission, BackendOutcome, Evidence, HealthMonitor, HealthSnapshot, HealthState, Rejected,
    ReportEffect,
};
