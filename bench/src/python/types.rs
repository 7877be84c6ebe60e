//! The types the Python bench's report and its Rust rows share: a batch shape, where a row's
//! pool lives, and what one measurement gave.

use serde::Serialize;

use crate::service::load::PhaseStats;
use gpucache_service::units::size_label;

/// One batch shape: `items` values of `size` bytes per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct Point {
    pub items: usize,
    pub size: u64,
}

impl Point {
    pub(crate) fn label(self) -> String {
        format!("{}x{}", self.items, size_label(self.size))
    }
}

/// Where a row's pool lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buffers {
    /// Plain host memory of the client process.
    Host,
    /// Inside the segment shared with the server (same-host path only).
    Segment,
}

/// What one measurement of one row gave.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Measurement {
    pub put: Option<PhaseStats>,
    pub get: Option<PhaseStats>,
    /// Values compared byte for byte after the GET phase, and how many differed.
    pub verified: u64,
    pub mismatches: u64,
    /// The same-host path's counters at the end (items served in place and bounced).
    pub direct_items: Option<u64>,
    pub bounced_items: Option<u64>,
    /// Python rows: microseconds per call of the binding's argument handling (the driver's
    /// `layer_cost`: a call of this shape refused at its size check, before any I/O).
    pub layer_us: Option<f64>,
}
