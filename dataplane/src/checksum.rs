//! Block payload checksum: XXH3-64 (see docs/adr/0002-block-checksum.md).
//!
//! It detects accidental corruption (bit flips, torn or misdirected writes, truncation). It is
//! not an authenticity check: the wire protocol's HMAC seal covers hostile peers.

use std::fmt;

/// Checksum of a block's payload, recorded at commit and verified on every read.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Checksum(pub u64);

impl Checksum {
    pub fn of(bytes: &[u8]) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64(bytes))
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Checksum({:016x})", self.0)
    }
}

/// Incremental checksum for payloads that arrive in pieces; equal to [`Checksum::of`] of the
/// concatenation.
#[derive(Clone)]
pub struct ChecksumBuilder(xxhash_rust::xxh3::Xxh3);

impl fmt::Debug for ChecksumBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ChecksumBuilder")
    }
}

impl Default for ChecksumBuilder {
    fn default() -> Self {
        Self(xxhash_rust::xxh3::Xxh3::new())
    }
}

impl ChecksumBuilder {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub fn finish(&self) -> Checksum {
        Checksum(self.0.digest())
    }
}
