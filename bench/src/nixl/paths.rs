//! What every path reports ([`Point`], [`PathRun`]), the timed loop they share, the byte
//! pattern and checksum the checks use, and the memcpy path.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::plan::Plan;
use crate::stats::{gib_per_s, nanos, percentile_us};
use gpucache_service::units::narrow;

/// One path at one block size.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub size: u64,
    pub iterations: u32,
    /// Bytes moved over the sum of the timed iterations, in GiB/s (2^30 bytes per second).
    pub gib_s: Option<f64>,
    /// Median time of one block, microseconds.
    pub p50_us: Option<f64>,
    /// 99th percentile time of one block, microseconds.
    pub p99_us: Option<f64>,
    /// Whether the bytes were checked (checksum on both ends) and matched.
    pub verified: bool,
    pub error: Option<String>,
}

impl Point {
    pub fn failed(size: u64, error: String) -> Self {
        Self {
            size,
            iterations: 0,
            gib_s: None,
            p50_us: None,
            p99_us: None,
            verified: false,
            error: Some(error),
        }
    }

    /// The point of `size` from the durations of its timed iterations.
    pub fn from_samples(size: u64, samples: &mut [Duration], verified: bool) -> Self {
        samples.sort_unstable();
        let total: f64 = samples.iter().map(Duration::as_secs_f64).sum();
        let n = samples.len();
        let nanos: Vec<u64> = samples.iter().copied().map(nanos).collect();
        let at = |p| percentile_us(&nanos, p);
        let bytes = size.saturating_mul(u64::try_from(n).unwrap_or(u64::MAX));
        Self {
            size,
            iterations: u32::try_from(n).unwrap_or(u32::MAX),
            gib_s: (total > 0.0).then(|| gib_per_s(bytes, total)),
            p50_us: at(50.0),
            p99_us: at(99.0),
            verified,
            error: None,
        }
    }
}

/// One path over every size.
#[derive(Debug, Clone, Serialize)]
pub struct PathRun {
    pub name: String,
    pub note: String,
    pub points: Vec<Point>,
    /// Why the path did not run at all.
    pub error: Option<String>,
}

impl PathRun {
    pub fn new(name: &str, note: &str) -> Self {
        Self { name: name.into(), note: note.into(), points: Vec::new(), error: None }
    }

    pub fn failed(name: &str, error: String) -> Self {
        Self { name: name.into(), note: String::new(), points: Vec::new(), error: Some(error) }
    }

    pub fn point(&self, size: u64) -> Option<&Point> {
        self.points.iter().find(|p| p.size == size)
    }

    /// Ran at every size it tried, with the bytes checked.
    pub fn clean(&self) -> bool {
        self.error.is_none() && self.points.iter().all(|p| p.error.is_none() && p.verified)
    }
}

/// Runs `op` `warmup` times untimed and `iterations` times timed; the first error ends it.
pub(super) fn timed<F>(warmup: u32, iterations: u32, mut op: F) -> Result<Vec<Duration>, String>
where
    F: FnMut(u64) -> Result<(), String>,
{
    for i in 0..u64::from(warmup) {
        op(i)?;
    }
    let mut samples = Vec::with_capacity(narrow(u64::from(iterations)));
    for i in 0..u64::from(iterations) {
        let started = Instant::now();
        op(u64::from(warmup) + i)?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

/// Bytes that depend only on the seed and the position (the seed's generator stream, so a
/// shorter pattern is a prefix of a longer one).
pub(super) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    gpucache_dataplane::rng::SplitMix64::bytes(seed, len)
}

/// The block's checksum (the data plane's xxh3), compared at both ends once per size.
pub(super) fn checksum(bytes: &[u8]) -> u64 {
    gpucache_dataplane::checksum::Checksum::of(bytes).0
}

/// memcpy between two host buffers of the block's size, in this process: the machine's limit
/// for moving a block that is already in memory.
pub(super) fn memcpy(plan: &Plan) -> PathRun {
    let mut run = PathRun::new(
        "memcpy",
        "in process, one thread, copy_from_slice between two host buffers of the block size",
    );
    for &size in &plan.sizes {
        eprintln!("bench: {}: memcpy", gpucache_service::units::size_label(size));
        let len = narrow(size);
        let src = pattern(size, len);
        let mut dst = vec![0u8; len];
        let copy = |_: u64, dst: &mut Vec<u8>| {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut *dst);
        };
        copy(0, &mut dst);
        let verified = checksum(&dst) == checksum(&src);
        let samples = timed(plan.warmup, plan.iterations, |i| {
            copy(i, &mut dst);
            Ok(())
        });
        run.points.push(match samples {
            Ok(mut s) => Point::from_samples(size, &mut s, verified),
            Err(e) => Point::failed(size, e),
        });
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_summarise_samples() {
        let mut s: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let p = Point::from_samples(1 << 20, &mut s, true);
        assert_eq!(p.iterations, 100);
        assert_eq!(p.p50_us, Some(50.0));
        assert_eq!(p.p99_us, Some(99.0));
        let gib = p.gib_s.expect("rate");
        // 100 MiB over 5.05 ms.
        assert!((gib - 100.0 / 1024.0 / 5.05e-3).abs() < 1e-6, "{gib}");
    }

    #[test]
    fn patterns_are_prefix_stable_and_checksums_see_changes() {
        let a = pattern(7, 1000);
        assert_eq!(pattern(7, 10)[..], a[..10]);
        assert_ne!(pattern(8, 1000), a);
        let mut b = a.clone();
        b[999] ^= 1;
        assert_ne!(checksum(&a), checksum(&b));
        assert_ne!(checksum(&a[..999]), checksum(&a));
    }
}
