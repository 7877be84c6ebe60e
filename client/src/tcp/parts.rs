//! How a large PUT is split for striping ([`Stripe`], [`split`]): the parts' bounds and
//! the configuration knob. The striped PUT itself is in `stripe`.

use std::ops::Range;

/// Most parts (connections, and threads of the call) one value is striped over; the pool
/// keeps as many idle connections per (tenant, rights).
pub const STRIPE_PARTS_MAX: usize = 8;
/// Smallest part: a value is split into no more parts than keep each at least this large.
pub const STRIPE_PART_BYTES_MIN: usize = 256 << 10;
/// Default of [`Stripe::threshold_bytes`]: values from 1 MiB up are striped when striping is
/// on.
pub const STRIPE_THRESHOLD_DEFAULT: usize = 1 << 20;
/// Default of [`Stripe::parts`]: 1, striping off. On the 2-CPU machine it was measured on
/// (docs/PERFORMANCE.md, "One client's 1-4 MiB network path, and striping a large PUT"),
/// striping a 1-4 MiB PUT over 2 or 4 connections was not faster than one connection: the
/// server and the client compete for the same two cores, and the memory store copies each
/// WRITE and hashes the committed block under its lock.
pub const STRIPE_PARTS_DEFAULT: usize = 1;

/// How one client stripes a large PUT over its pooled connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stripe {
    /// A value of at least this many bytes is striped (when `parts` is above 1).
    pub threshold_bytes: usize,
    /// Parts a striped value is split into, at most [`STRIPE_PARTS_MAX`]; 1 turns striping
    /// off.
    pub parts: usize,
}

impl Default for Stripe {
    fn default() -> Self {
        Self { threshold_bytes: STRIPE_THRESHOLD_DEFAULT, parts: STRIPE_PARTS_DEFAULT }
    }
}

impl Stripe {
    /// Striping over `parts` connections for values of at least `threshold_bytes`.
    pub fn new(threshold_bytes: usize, parts: usize) -> Self {
        Self { threshold_bytes, parts }
    }

    /// The parts a value of `len` bytes is sent in, when it is striped at all.
    pub fn plan(&self, len: usize) -> Option<Vec<Range<usize>>> {
        if len < self.threshold_bytes.max(1) {
            return None;
        }
        let parts = split(len, self.parts, STRIPE_PART_BYTES_MIN);
        (parts.len() > 1).then_some(parts)
    }
}

/// Splits `0..len` into at most `parts` (and at most [`STRIPE_PARTS_MAX`]) contiguous ranges of
/// at least `part_min` bytes each (one range when `len` is smaller), in order, disjoint, their
/// lengths differing by at most one byte, covering `0..len` exactly.
pub fn split(len: usize, parts: usize, part_min: usize) -> Vec<Range<usize>> {
    let by_size = (len / part_min.max(1)).max(1);
    let n = parts.clamp(1, STRIPE_PARTS_MAX).min(by_size);
    let (base, extra) = (len / n, len % n);
    let mut at = 0;
    (0..n)
        .map(|i| {
            let size = base + usize::from(i < extra);
            let range = at..at + size;
            at += size;
            range
        })
        .collect()
}

/// Whether `parts` are contiguous from 0 and end at `len`.
pub(super) fn covers(parts: &[Range<usize>], len: usize) -> bool {
    let mut at = 0;
    for p in parts {
        if p.start != at || p.end < p.start {
            return false;
        }
        at = p.end;
    }
    at == len && !parts.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_value_is_one_part_and_a_large_one_is_split() {
        assert_eq!(split(100, 4, STRIPE_PART_BYTES_MIN), vec![0..100]);
        assert_eq!(split(1 << 20, 4, 256 << 10).len(), 4);
        assert_eq!(split((1 << 20) - 1, 4, 256 << 10).len(), 3);
        assert_eq!(split(64 << 20, 100, 1).len(), STRIPE_PARTS_MAX);
        assert_eq!(split(0, 4, 1), vec![0..0]);
    }

    #[test]
    fn the_plan_stripes_only_from_the_threshold_and_with_more_than_one_part() {
        let on = Stripe::new(1 << 20, 4);
        assert_eq!(on.plan((1 << 20) - 1), None);
        assert_eq!(on.plan(1 << 20).map(|p| p.len()), Some(4));
        assert_eq!(Stripe::new(1 << 20, 1).plan(4 << 20), None);
        assert_eq!(Stripe::default().plan(64 << 20), None, "off by default");
    }

    #[test]
    fn covers_refuses_gaps_overlaps_and_short_ends() {
        assert!(covers(&[0..3, 3..7], 7));
        assert!(!covers(&[0..3, 4..7], 7));
        assert!(!covers(&[0..4, 3..7], 7));
        assert!(!covers(&[0..3, 3..6], 7));
        assert!(!covers(&[], 0));
    }

    /// For every length, part count and minimum part size in a range: the parts are in
    /// order, disjoint and cover the value exactly, within the bounds, and putting the parts'
    /// bytes back where they say gives the value again.
    #[test]
    fn parts_reassemble_the_value() {
        for len in (0usize..3_000).step_by(7).chain([4 << 20, (4 << 20) + 3]) {
            let value: Vec<u8> =
                (0..len).map(|i| (i.wrapping_mul(31) ^ (i >> 8)).to_le_bytes()[0]).collect();
            for parts in 0usize..12 {
                for part_min in [1usize, 2, 100, 1_000, 256 << 10] {
                    let ranges = split(len, parts, part_min);
                    assert!(covers(&ranges, len), "{len} {parts} {part_min}: {ranges:?}");
                    assert!(ranges.len() <= STRIPE_PARTS_MAX.min(parts.max(1)));
                    if ranges.len() > 1 {
                        assert!(ranges.iter().all(|r| r.len() >= part_min), "{ranges:?}");
                    }
                    let lens = ranges.iter().map(Range::len);
                    let spread = lens.clone().max().unwrap_or(0) - lens.min().unwrap_or(0);
                    assert!(spread <= 1, "{ranges:?}");
                    let mut back = vec![0u8; len];
                    for r in &ranges {
                        back[r.clone()].copy_from_slice(&value[r.clone()]);
                    }
                    assert!(back == value);
                }
            }
        }
    }
}
