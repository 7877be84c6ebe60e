//! What each tier of a tiered store answered during a replay: from a served store's own
//! `/metrics` before and after it, or from an in-process store's counters (with the cold tier's
//! share and latencies under `--store cold`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use gpucache_cold::ColdMiss;
use serde::Serialize;

/// Deadline for connecting to, writing to and reading from the metrics listener.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(10);
/// Largest scrape read.
const SCRAPE_BYTES_MAX: u64 = 16 << 20;

/// The tier counters of one scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct TierCounts {
    pub memory_hits: u64,
    pub file_hits: u64,
    pub promotions: u64,
}

/// What the tiers served between two scrapes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TierHits {
    pub memory_hits: u64,
    pub file_hits: u64,
    pub promotions: u64,
    /// Memory hits over the replay's block references.
    pub memory_ratio: f64,
    /// File hits over the replay's block references.
    pub file_ratio: f64,
    /// Under `--store cold`: what the cold tier below served, and how fast each tier answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cold: Option<ColdHits>,
}

impl TierCounts {
    /// What happened since `before`, as shares of `refs` block references.
    pub(super) fn since(&self, before: &Self, refs: u64) -> TierHits {
        let memory_hits = self.memory_hits.saturating_sub(before.memory_hits);
        let file_hits = self.file_hits.saturating_sub(before.file_hits);
        let share = |n: u64| crate::stats::share(n, refs);
        TierHits {
            memory_hits,
            file_hits,
            promotions: self.promotions.saturating_sub(before.promotions),
            memory_ratio: share(memory_hits),
            file_ratio: share(file_hits),
            cold: None,
        }
    }
}

/// Reads the tier counters out of a Prometheus text scrape; a scrape without them is not a
/// tiered store's.
pub(super) fn parse(text: &str) -> Result<TierCounts, String> {
    let value = |series: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("the scrape has no {series}: is the server's store tiered?"))
    };
    Ok(TierCounts {
        memory_hits: value(r#"gpucache_tier_hits_total{tier="memory"}"#)?,
        file_hits: value(r#"gpucache_tier_hits_total{tier="file"}"#)?,
        promotions: value("gpucache_tier_promotions_total")?,
    })
}

/// Scrapes `/metrics` at `addr`.
pub(super) fn scrape(addr: SocketAddr) -> Result<TierCounts, String> {
    let fail = |e: std::io::Error| format!("scrape http://{addr}/metrics: {e}");
    let mut s = TcpStream::connect_timeout(&addr, SCRAPE_DEADLINE).map_err(fail)?;
    s.set_read_timeout(Some(SCRAPE_DEADLINE)).map_err(fail)?;
    s.set_write_timeout(Some(SCRAPE_DEADLINE)).map_err(fail)?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
        .map_err(fail)?;
    let mut reply = String::new();
    s.take(SCRAPE_BYTES_MAX).read_to_string(&mut reply).map_err(fail)?;
    let (head, body) = reply.split_once("\r\n\r\n").ok_or("the metrics reply is not HTTP")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("scrape http://{addr}/metrics: {}", head.lines().next().unwrap_or("")));
    }
    parse(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_counters_are_read_and_differenced() {
        let scrape = |m: u64, f: u64, p: u64| {
            format!(
                "# TYPE gpucache_tier_hits counter\ngpucache_tier_hits_total{{tier=\"memory\"}} {m}\n\
                 gpucache_tier_hits_total{{tier=\"file\"}} {f}\ngpucache_tier_promotions_total {p}\n"
            )
        };
        let before = parse(&scrape(5, 1, 0)).unwrap_or_else(|e| panic!("{e}"));
        let after = parse(&scrape(45, 21, 7)).unwrap_or_else(|e| panic!("{e}"));
        let d = after.since(&before, 100);
        assert_eq!((d.memory_hits, d.file_hits, d.promotions), (40, 20, 7));
        assert!((d.memory_ratio - 0.4).abs() < 1e-12 && (d.file_ratio - 0.2).abs() < 1e-12);
        let e = parse("gpucache_ops_total 3\n").unwrap_err();
        assert!(e.contains("tiered"), "{e}");
    }
}

/// A latency distribution as reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Latency {
    pub samples: u64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub mean_us: Option<f64>,
    pub max_us: Option<f64>,
}

/// What the cold store's tiers did over one replay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ColdHits {
    /// Whether the object store was [`gpucache_cold::MemoryObjects`], a simulation in this process.
    pub simulated: bool,
    pub cold_hits: u64,
    /// Cold hits over the replay's block references.
    pub cold_ratio: f64,
    /// GETs served by the cold tier: the refill latency as the caller saw it.
    pub refill: Latency,
    pub memory_get: Latency,
    pub file_get: Latency,
    pub miss_get: Latency,
    /// File-tier evictions the sink took, refused (dropped) or could not read.
    pub demoted: u64,
    pub demote_refused: u64,
    pub demote_unreadable: u64,
    /// Cold hits copied into the upper tiers.
    pub refilled_up: u64,
    pub packs_stored: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub refill_misses: RefillMisses,
    /// Sink jobs that failed for good (their blocks never reached the object store).
    pub sink_jobs_failed: u64,
    pub sink_jobs_retried: u64,
}

/// The cold tier's refill misses by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RefillMisses {
    pub absent: u64,
    pub over_budget: u64,
    pub deadline: u64,
    pub degraded: u64,
    pub unavailable: u64,
    pub legacy_manifest: u64,
    pub mismatch: u64,
    pub corrupt: u64,
}

impl RefillMisses {
    pub(super) fn of(counts: &[u64; gpucache_cold::COLD_MISS_REASONS]) -> Self {
        let n = |m: ColdMiss| ColdMiss::ALL.iter().position(|x| *x == m).map_or(0, |i| counts[i]);
        Self {
            absent: n(ColdMiss::Absent),
            over_budget: n(ColdMiss::OverBudget),
            deadline: n(ColdMiss::Deadline),
            degraded: n(ColdMiss::Degraded),
            unavailable: n(ColdMiss::Unavailable),
            legacy_manifest: n(ColdMiss::Legacy),
            mismatch: n(ColdMiss::Mismatch),
            corrupt: n(ColdMiss::Corrupt),
        }
    }

    /// Misses other than the block not being in the cold tier at all.
    pub(super) fn faults(&self) -> u64 {
        self.over_budget
            + self.deadline
            + self.degraded
            + self.unavailable
            + self.legacy_manifest
            + self.mismatch
            + self.corrupt
    }
}
