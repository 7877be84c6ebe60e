//! Admission of the asynchronous L3 path: the scheduler-side owner of storage preparation.
//!
//! Holds the operation and Host-block credits (a [`CreditPool`] from the contract's
//! `gpucache_dataplane::credits`, re-exported here), the storage tickets and the leases
//! that attach requests to them ([`lease`]), soft deadlines and Ready holds driven by ticks on an
//! injected clock ([`controller`]), the bounded non-owning backup-candidate queue ([`backup`]) and
//! the pressure gate with hysteresis ([`gate`]). It is pure logic: no threads, no sleeps, no
//! storage calls. It must not touch the executor's queues and workers, backend health, owner
//! agreement or metrics registration; those read its outcomes and counters.

pub mod backup;
mod config;
pub mod controller;
pub mod gate;
pub mod lease;
mod sync;

#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(all(test, not(loom)))]
mod tests;

pub use backup::{BackupDrops, BackupQueue, CandidateId, DropReason, Offer, PendingPut};
pub use config::{AdmissionConfig, ConfigError};
pub use controller::{
    AdmissionController, AdmissionCounters, AdmissionError, Bypass, Completion, GetStart,
    NativeRetirement, OperationId, Prepare, Resolved, TickReport,
};
pub use gate::{
    AdmissionGate, GateChange, GateState, Observation, PressureSnapshot, PressureWatermarks,
    Watermark, WatermarkError,
};
pub use gpucache_dataplane::credits::{
    CreditBound, CreditClass, CreditGrant, CreditKind, CreditPool, CreditRefusal, CreditUsage,
    Credits,
};
pub use lease::{LocalReason, RequestKey, StorageLease, TicketId, WaitOutcome, WaitPhase};
