//! Block payload checksum: XXH3-64 (see docs/adr/0002-block-checksum.md).
//!
//! The hash is `twox-hash`'s, which picks its widest vector path (AVX2, SSE2, NEON) when the
//! process starts rather than when it is built, so a binary built for baseline x86-64 still
//! hashes with AVX2 where the CPU has it. [`Checksum::copy_of`] copies and hashes in one pass
//! over memory: each piece is hashed right after it is copied, while it is still in the cache.
//!
//! It detects accidental corruption (bit flips, torn or misdirected writes, truncation). It is
//! not an authenticity check: the wire protocol's HMAC seal covers hostile peers.

use std::fmt;
use std::hash::Hasher as _;

use twox_hash::XxHash3_64;

/// Checksum of a block's payload, recorded at commit and verified on every read.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Checksum(pub u64);

impl Checksum {
    pub fn of(bytes: &[u8]) -> Self {
        Self(XxHash3_64::oneshot(bytes))
    }

    /// Copies `src` into the front of `dst` and returns the checksum of the copied bytes (what
    /// [`Self::of`] of `dst[..src.len()]` gives), in one pass: each [`COPY_PIECE_BYTES`] piece
    /// is hashed in the destination right after it is copied there, so damage in the copy is
    /// caught too. `None`, copying nothing, when `dst` is shorter than `src`.
    pub fn copy_of(dst: &mut [u8], src: &[u8]) -> Option<Self> {
        let dst = dst.get_mut(..src.len())?;
        if src.len() <= COPY_PIECE_BYTES {
            dst.copy_from_slice(src);
            return Some(Self::of(dst));
        }
        let mut hasher = ChecksumBuilder::default();
        for (to, from) in dst.chunks_mut(COPY_PIECE_BYTES).zip(src.chunks(COPY_PIECE_BYTES)) {
            to.copy_from_slice(from);
            hasher.update(to);
        }
        Some(hasher.finish())
    }

    /// Appends `src` to `out` and returns its checksum, in one pass as [`Self::copy_of`] does
    /// (nothing is zero-filled first).
    pub fn extend_of(out: &mut Vec<u8>, src: &[u8]) -> Self {
        out.reserve(src.len());
        let mut hasher = ChecksumBuilder::default();
        for piece in src.chunks(COPY_PIECE_BYTES) {
            let at = out.len();
            out.extend_from_slice(piece);
            hasher.update(out.get(at..).unwrap_or_default());
        }
        hasher.finish()
    }
}

/// The piece [`Checksum::copy_of`] copies before it hashes: small enough to be still in the
/// first-level cache (and its source in the second) when it is hashed.
pub const COPY_PIECE_BYTES: usize = 32 << 10;

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Checksum({:016x})", self.0)
    }
}

/// Incremental checksum for payloads that arrive in pieces; equal to [`Checksum::of`] of the
/// concatenation.
#[derive(Clone)]
pub struct ChecksumBuilder(XxHash3_64);

impl fmt::Debug for ChecksumBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ChecksumBuilder")
    }
}

impl Default for ChecksumBuilder {
    fn default() -> Self {
        Self(XxHash3_64::with_seed(0))
    }
}

impl ChecksumBuilder {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    pub fn finish(&self) -> Checksum {
        Checksum(self.0.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes that differ at every position, so a piece copied to the wrong place changes them.
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i.wrapping_mul(131) ^ (i >> 9)).to_le_bytes()[0]).collect()
    }

    #[test]
    fn the_hash_is_xxh3_64_as_published() {
        // Checksums already stored on disk and sent by older peers must keep verifying: these
        // are XXH3-64 (seed 0) values from the reference implementation's own tests.
        assert_eq!(Checksum::of(b"").0, 0x2D06_8005_38D3_94C2);
        assert_eq!(Checksum::of(b"a").0, 0xE6C6_32B6_1E96_4E1F);
        assert_eq!(Checksum::of(b"abc").0, 0x78AF_5F94_892F_3950);
    }

    #[test]
    fn copy_of_copies_and_hashes_like_of_at_every_piece_boundary() {
        for len in [0, 1, 240, 241, COPY_PIECE_BYTES - 1, COPY_PIECE_BYTES, COPY_PIECE_BYTES + 1]
            .into_iter()
            .chain([3 * COPY_PIECE_BYTES + 17, 1 << 20])
        {
            let src = pattern(len);
            let mut dst = vec![0xAA; len + 5];
            let sum = Checksum::copy_of(&mut dst, &src);
            assert_eq!(sum, Some(Checksum::of(&src)), "len {len}");
            assert_eq!(&dst[..len], &src[..], "len {len}");
            assert_eq!(&dst[len..], &[0xAA; 5], "len {len}: bytes past the copy changed");
        }
    }

    #[test]
    fn extend_of_appends_and_hashes_like_of() {
        for len in [0, 7, COPY_PIECE_BYTES, 2 * COPY_PIECE_BYTES + 3] {
            let src = pattern(len);
            let mut out = vec![1, 2, 3];
            assert_eq!(Checksum::extend_of(&mut out, &src), Checksum::of(&src), "len {len}");
            assert_eq!(&out[..3], &[1, 2, 3]);
            assert_eq!(&out[3..], &src[..], "len {len}");
        }
    }

    #[test]
    fn copy_of_refuses_a_short_destination_and_writes_nothing() {
        let src = pattern(100);
        let mut dst = vec![7u8; 99];
        assert_eq!(Checksum::copy_of(&mut dst, &src), None);
        assert!(dst.iter().all(|&b| b == 7));
    }

    #[test]
    fn the_builder_agrees_with_one_shot_whatever_the_pieces() {
        let src = pattern(200_000);
        for piece in [1, 63, 64, 4096, 65_536] {
            let mut b = ChecksumBuilder::default();
            src.chunks(piece).for_each(|c| b.update(c));
            assert_eq!(b.finish(), Checksum::of(&src), "pieces of {piece}");
        }
    }
}
