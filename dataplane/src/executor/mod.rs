//! The engine-facing asynchronous L3 executor: the part of the data plane that runs an
//! engine's QUERY, GET and PUT jobs against a store, off the scheduling thread, and reports
//! their completion facts back.
//!
//! This first part holds only its pure, self-contained pieces:
//! - [`health`]: the private backend-health monitor (cooldown after an outage, one recovery
//!   probe, health epochs so that a stale success cannot hide a newer outage);
//!
//! The bounded queues, the workers, admission credits and metrics registration come later and
//! build on these; nothing here starts a thread, calls a store or reads a wall clock.

pub mod health;
#[cfg(all(test, loom))]
mod loom_health;
mod sync;

pub use health::{
    Admission, BackendOutcome, Evidence, HealthMonitor, HealthSnapshot, HealthState, Rejected,
    ReportEffect,
};
