//! A small seeded generator for everything in the workspace that must be reproducible from a
//! seed: the fault schedules of the simulated NIC and disk, the cluster crate's simulation of a
//! whole cluster, the conformance and crash tests, and the benchmark harnesses' keys and
//! payloads.
//!
//! [`SplitMix64`] is Steele, Lea and Flood's generator: one 64-bit state advanced by a fixed odd
//! increment and passed through a mixing function. It is fast, has no bad seeds (0 included),
//! and the same seed always yields the same stream on every platform. It is not
//! cryptographic; nothing that guards a secret may draw from it.
//!
//! Values drawn with [`SplitMix64::below`] are reduced with `%`, so a bound that does not divide
//! 2^64 is very slightly biased toward small values; schedules and test walks do not care, and
//! keeping the plain reduction keeps every recorded seed replaying the same walk.

/// The increment added to the state before every draw (2^64 divided by the golden ratio, made
/// odd).
pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The starting state that [`SplitMix64::mix`] folds its parts into.
const MIX_START: u64 = 0x005e_ed0f_f11e;

/// SplitMix64: a seeded stream of 64-bit values.
///
/// ```
/// use gpucache_dataplane::rng::SplitMix64;
///
/// let mut a = SplitMix64::new(7);
/// let mut b = SplitMix64::new(7);
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!(a.below(10) < 10);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is fixed by `seed`.
    #[must_use]
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// One seed made from several numbers (a test's seed and its case number, say): each part is
    /// folded into the state in turn and the state is stirred after each. The same parts in the
    /// same order always give the same seed; a different order or any changed part gives an
    /// unrelated one.
    #[must_use]
    pub fn mix(parts: &[u64]) -> u64 {
        let mut r = Self::new(MIX_START);
        for p in parts {
            r.state ^= *p;
            r.next_u64();
        }
        r.next_u64()
    }

    /// The next value of the stream.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        finalize(self.state)
    }

    /// Uniform in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        self.next_u64() % n
    }

    /// Uniform in `0..n` as an index; 0 when `n` is 0.
    pub fn index(&mut self, n: usize) -> usize {
        let n64 = u64::try_from(n).unwrap_or(u64::MAX);
        // Below `n`, so it fits a usize.
        usize::try_from(self.below(n64)).unwrap_or(0)
    }

    /// Uniform in `lo..=hi` (`lo` when `hi` < `lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        let Some(width) = hi.checked_sub(lo) else { return lo };
        match width.checked_add(1) {
            Some(span) => lo + self.below(span),
            // `lo..=hi` is every u64.
            None => self.next_u64(),
        }
    }

    /// Uniform in `0.0..1.0`: the top 53 bits of one draw fill an f64 mantissa exactly.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p` (never for `p` <= 0, always for `p` >= 1).
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Fills `buf` with the stream's bytes, one draw per 8 bytes in little-endian order. A shorter
    /// fill from the same seed is a prefix of a longer one.
    pub fn fill_bytes(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }

    /// `len` bytes of the stream of `seed`: [`fill_bytes`](Self::fill_bytes) on a fresh
    /// generator, so `bytes(s, n)` is a prefix of `bytes(s, m)` for `n` <= `m`.
    #[must_use]
    pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        Self::new(seed).fill_bytes(&mut out);
        out
    }
}

/// SplitMix64's output function: a bijective mix of one 64-bit word.
const fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first outputs for seed 0 and seed 1234567, as published with the reference
    /// implementation (Vigna's splitmix64.c): the stream is the standard one.
    #[test]
    fn stream_matches_the_reference_values() {
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
        let mut r = SplitMix64::new(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
    }

    #[test]
    fn same_seed_same_stream_other_seed_other_stream() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        let mut c = SplitMix64::new(8);
        let xs: Vec<u64> = (0..64).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..64).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..64).map(|_| c.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }

    #[test]
    fn bounded_draws_stay_in_bounds() {
        let mut r = SplitMix64::new(11);
        let mut seen = [false; 13];
        for _ in 0..2000 {
            let b = r.below(13);
            assert!(b < 13);
            seen[usize::try_from(b).unwrap()] = true;
            assert!(r.index(5) < 5);
            let v = r.range(10, 12);
            assert!((10..=12).contains(&v), "{v}");
            let u = r.unit();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
        assert!(seen.iter().all(|s| *s), "every value below 13 is drawn: {seen:?}");
        assert_eq!(r.below(0), 0);
        assert_eq!(r.index(0), 0);
        assert_eq!(r.range(5, 5), 5);
        assert_eq!(r.range(6, 5), 6);
        let _ = r.range(0, u64::MAX);
        assert!(!r.chance(0.0));
        assert!(r.chance(1.0));
    }

    #[test]
    fn fills_are_prefix_stable_and_follow_the_stream() {
        let long = SplitMix64::bytes(3, 100);
        for len in [0, 1, 7, 8, 9, 63, 64, 65, 99] {
            assert_eq!(SplitMix64::bytes(3, len)[..], long[..len], "{len}");
        }
        let mut r = SplitMix64::new(3);
        assert_eq!(long[..8], r.next_u64().to_le_bytes());
        assert_eq!(long[8..16], r.next_u64().to_le_bytes());
        assert_ne!(SplitMix64::bytes(4, 100), long);
    }

    #[test]
    fn mix_depends_on_every_part_and_its_place() {
        let base = SplitMix64::mix(&[1, 2, 3]);
        assert_eq!(base, SplitMix64::mix(&[1, 2, 3]));
        assert_ne!(base, SplitMix64::mix(&[1, 2, 4]));
        assert_ne!(base, SplitMix64::mix(&[3, 2, 1]));
        assert_ne!(base, SplitMix64::mix(&[1, 2]));
    }
}
