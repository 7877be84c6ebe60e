//! The admission configuration and its check, below the controller that runs with it.

use std::num::NonZeroUsize;

use super::gate::{PressureWatermarks, WatermarkError};
use gpucache_dataplane::credits::Credits;

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
