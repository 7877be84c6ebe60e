//! One row of the trace bench's report: what the table, the JSON and the chart read.

use super::offline::Outcome;
use super::replay::Replay;

/// One row of the report.
#[derive(Debug, Clone)]
pub struct Row {
    pub trace: String,
    pub capacity: String,
    pub capacity_blocks: Option<u64>,
    /// The policy name, `server` for a replay against `--addr`, None for an offline-only row.
    pub policy: Option<String>,
    pub replay: Option<Replay>,
    pub belady: Option<Outcome>,
    pub lru_offline: Option<Outcome>,
    /// Hit ratio over the best replay among [`BEST_OF`](super::BEST_OF) at the same point.
    pub vs_best: Option<f64>,
    /// With --addr and --metrics against a tiered store: what each tier served.
    pub tiers: Option<super::tiers::TierHits>,
}
