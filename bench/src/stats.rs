//! The figures every harness reports, computed one way: rates (per second, GB/s, GiB/s),
//! shares and ratios, nearest-rank percentiles, the median and spread of repetitions, and the
//! table cells that show a figure (`-` where it is missing).
//!
//! Display only: the rounding of a `u64` count to `f64` does not matter to any figure here.

use std::time::Duration;

use serde::Serialize;

/// `count` (bytes, requests, puts) over `seconds`; 0 when no time passed.
#[allow(clippy::cast_precision_loss)]
pub fn per_second(count: u64, seconds: f64) -> f64 {
    if seconds > 0.0 { count as f64 / seconds } else { 0.0 }
}

/// GB/s: 10^9 bytes per second; 0 when no time passed.
pub fn gbps(bytes: u64, seconds: f64) -> f64 {
    per_second(bytes, seconds) / 1e9
}

/// GiB/s: 2^30 bytes per second; 0 when no time passed.
#[allow(clippy::cast_precision_loss)]
pub fn gib_per_s(bytes: u64, seconds: f64) -> f64 {
    per_second(bytes, seconds) / (1u64 << 30) as f64
}

/// `part / whole` (a hit ratio, a share of references); 0 when `whole` is 0.
#[allow(clippy::cast_precision_loss)]
pub fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 { 0.0 } else { part as f64 / whole as f64 }
}

/// `num / den` when `den` is positive: a ratio never divides by a rate that moved nothing.
pub fn ratio(num: f64, den: f64) -> Option<f64> {
    (den > 0.0).then(|| num / den)
}

/// A duration in whole nanoseconds (`u64::MAX` past 584 years).
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Durations as nanoseconds, sorted: what [`percentile`] reads.
pub fn sorted_nanos(durations: &[Duration]) -> Vec<u64> {
    let mut ns: Vec<u64> = durations.iter().copied().map(nanos).collect();
    ns.sort_unstable();
    ns
}

/// The nearest rank (1-based) of the `p` percentile (0 to 100) among `len` values: the smallest
/// rank with at least `p` % of the values at or below it, within 1 to `len`; `None` for none.
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub fn nearest_rank(len: u64, p: f64) -> Option<u64> {
    if len == 0 {
        return None;
    }
    // rank * 100 >= p * len, compared as the definition says (not as p / 100 * len, whose
    // rounding can land just above a whole rank and pick the next one).
    let need = p * len as f64;
    let mut rank = (need / 100.0).ceil().clamp(1.0, len as f64) as u64;
    while rank > 1 && (rank - 1) as f64 * 100.0 >= need {
        rank -= 1;
    }
    while rank < len && (rank as f64 * 100.0) < need {
        rank += 1;
    }
    Some(rank)
}

/// The nearest-rank `p` percentile (0 to 100) of `sorted` values; `None` when empty.
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    let rank = nearest_rank(sorted.len() as u64, p)?;
    sorted.get(usize::try_from(rank).ok()? - 1).copied()
}

/// [`percentile`] of sorted nanoseconds, in microseconds.
#[allow(clippy::cast_precision_loss)]
pub fn percentile_us(sorted_ns: &[u64], p: f64) -> Option<f64> {
    percentile(sorted_ns, p).map(|ns| ns as f64 / 1e3)
}

/// [`percentile`] of sorted nanoseconds, in milliseconds.
#[allow(clippy::cast_precision_loss)]
pub fn percentile_ms(sorted_ns: &[u64], p: f64) -> Option<f64> {
    percentile(sorted_ns, p).map(|ns| ns as f64 / 1e6)
}

/// Median, smallest and largest of some figures (repetitions of one measurement).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

/// The spread of `xs` (`None` when empty); the median of an even count is the mean of the two
/// middle figures.
pub fn spread(xs: &[f64]) -> Option<Spread> {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let (&min, &max) = (v.first()?, v.last()?);
    let n = v.len();
    let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    Some(Spread { median, min, max, n })
}

/// The median of `xs` (the mean of the middle two for an even count); `None` when empty.
pub fn median(xs: &[f64]) -> Option<f64> {
    spread(xs).map(|s| s.median)
}

/// A table cell: `-` where the figure is missing, else the figure as `show` writes it.
pub fn cell_with<T>(v: Option<T>, show: impl FnOnce(T) -> String) -> String {
    v.map_or_else(|| "-".to_owned(), show)
}

/// A table cell: `-` where the figure is missing, else the figure with `digits` decimals.
pub fn cell(v: Option<f64>, digits: usize) -> String {
    cell_with(v, |v| format!("{v:.digits$}"))
}

/// A table cell of a spread: `-`, the median alone for one figure, else `median (min-max)`,
/// each with `digits` decimals.
pub fn spread_cell(s: Option<Spread>, digits: usize) -> String {
    cell_with(s, |s| {
        if s.n == 1 {
            format!("{:.digits$}", s.median)
        } else {
            format!("{:.digits$} ({:.digits$}-{:.digits$})", s.median, s.min, s.max)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_over_the_time_given_and_zero_without_time() {
        assert!((gbps(2_000_000_000, 0.5) - 4.0).abs() < 1e-12);
        assert!((gib_per_s(3 << 30, 1.5) - 2.0).abs() < 1e-12);
        assert!((per_second(2_000_000, 0.5) - 4e6).abs() < 1e-6);
        assert_eq!((gbps(1, 0.0), gib_per_s(1, 0.0), per_second(1, -1.0)), (0.0, 0.0, 0.0));
        assert_eq!((share(1, 4), share(1, 0)), (0.25, 0.0));
        assert_eq!((ratio(3.0, 2.0), ratio(3.0, 0.0)), (Some(1.5), None));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        // 7 / 100 * 100 rounds to just above 7 in f64: still the 7th value.
        assert_eq!(percentile(&v, 7.0), Some(7));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&[7], 99.0), Some(7));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile_us(&[1_500], 50.0), Some(1.5));
        assert_eq!(percentile_ms(&[2_000_000], 50.0), Some(2.0));
    }

    #[test]
    fn the_rank_is_the_definitions_for_every_length_and_percentile() {
        for len in 1..=300u64 {
            for p in (0..=1000).map(|t| f64::from(t) / 10.0) {
                #[allow(clippy::cast_precision_loss)]
                let want = (1..=len).find(|&r| r as f64 * 100.0 >= p * len as f64).unwrap_or(len);
                assert_eq!(nearest_rank(len, p), Some(want), "len {len} p {p}");
            }
        }
        assert_eq!(nearest_rank(0, 50.0), None);
    }

    #[test]
    fn spreads_and_medians_take_the_middle() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        let s = spread(&[0.9, 1.0, 0.99]).expect("spread");
        assert_eq!((s.median, s.min, s.max, s.n), (0.99, 0.9, 1.0, 3));
        assert_eq!(spread_cell(Some(s), 3), "0.990 (0.900-1.000)");
        assert_eq!(spread_cell(spread(&[1.24]), 1), "1.2");
        assert_eq!(spread_cell(None, 1), "-");
    }

    #[test]
    fn cells_show_a_dash_for_a_missing_figure() {
        assert_eq!(cell(Some(1.23456), 2), "1.23");
        assert_eq!(cell(None, 2), "-");
        assert_eq!(cell_with(Some(3), |n| format!("{n}x")), "3x");
    }
}
