//! Admission of the asynchronous L3 path: the scheduler-side owner of storage preparation.
//!
//! Owns the operation and Host-block credits ([`credits`]), the storage tickets and the leases
//! that attach requests to them ([`lease`]), soft deadlines and Ready holds driven by ticks on an
//! injected clock ([`controller`]), the bounded non-owning backup-candidate queue ([`backup`]) and
//! the pressure gate with hysteresis ([`gate`]). It is pure logic: no threads, no sleeps, no
//! storage calls. It must not touch the executor's queues and workers, backend health, owner
//! agreement or metrics registration; those read its outcomes and counters.

pub mod backup;
pub mod controller;
pub mod credits;
pub mod gate;
pub mod lease;
mod sync;

#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(all(test, not(loom)))]
mod tests;

use std::num::NonZeroUsize;

pub use backup::{BackupDrops, BackupQueue, CandidateId, DropReason, Offer, PendingPut};
pub use controller::{
    AdmissionController, AdmissionCounters, AdmissionError, Bypass, Completion, GetStart,
    NativeRetirement, OperationId, Prepare, Resolved, TickReport,
};
pub use credits::{
    CreditBound, CreditClass, CreditGrant, CreditKind, CreditPool, CreditRefusal, CreditUsage,
    Credits,
};
pub use gate::{
    AdmissionGate, GateChange, GateState, Observation, PressureSnapshot, PressureWatermarks,
    Watermark, WatermarkError,
};
pub use lease::{LocalReason, RequestKey, StorageLease, TicketId, WaitOutcome, WaitPhase};

/// The read-only scheduling contract: credits, deadlines, the candidate bound and watermarks.
/// Units are last in each name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Operation and Host-block budgets; backups may hold half of each, rounded down.
    pub credits: Credits,
    /// How long a request may wait on QUERY and GET together, counted from the query's issue.
    pub soft_deadline_ms: u64,
    /// How long a completed read's blocks are held for ordinary admission.
    pub ready_hold_ms: u64,
    /// Backup candidates queued at once; the oldest is dropped beyond it.
    pub backup_candidates_max: NonZeroUsize,
    pub watermarks: PressureWatermarks,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            credits: Credits::new(256, 16_384),
            soft_deadline_ms: 200,
            ready_hold_ms: 1_000,
            backup_candidates_max: NonZeroUsize::new(4_096).unwrap_or(NonZeroUsize::MIN),
            watermarks: PressureWatermarks::default(),
        }
    }
}

/// A configuration the controller cannot run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{name} is zero")]
    ZeroDuration { name: &'static str },
    #[error(transparent)]
    Watermark(WatermarkError),
}

impl AdmissionConfig {
    /// Durations must be nonzero (a zero deadline would end every wait at its first tick) and
    /// every watermark pair must give hysteresis. Zero credit budgets are allowed: they disable
    /// reads or backups, which the outcomes then say.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, value) in
            [("soft_deadline_ms", self.soft_deadline_ms), ("ready_hold_ms", self.ready_hold_ms)]
        {
            if value == 0 {
                return Err(ConfigError::ZeroDuration { name });
            }
        }
        self.watermarks.validate().map_err(ConfigError::Watermark)
    }
}
