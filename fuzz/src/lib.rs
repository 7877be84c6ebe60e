//! The bodies of the fuzz targets, as plain functions over bytes, one module per target.
//!
//! Each libFuzzer binary in `fuzz_targets/` is one line that calls its module's `run`, so the
//! code libFuzzer drives is the code that [`TARGETS`] lists and that this crate's tests replay
//! over every checked-in seed (`seeds/<target>/`) on the stable toolchain, without cargo-fuzz.
//! Every `run` refuses nothing silently that it should accept: it answers [`Outcome::Accepted`]
//! only when the decoder took the input and every check on what it decoded passed, and it
//! panics when a check fails.
//!
//! [`seeds`] builds the seed inputs through the crates' own encoders; the `seeds` example writes
//! them to `seeds/`.

pub mod block_header;
pub mod frame;
pub mod logical_key;
pub mod mooncake_wire;
pub mod nixl_descriptor;
pub mod physical_key;
pub mod resp_request;
pub mod seeds;

/// What one input did. libFuzzer ignores it; the seed replay requires every seed to be
/// accepted, so that a seed the decoder has come to refuse is noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The decoder accepted the input and every check on the result passed.
    Accepted,
    /// The decoder refused the input (which is allowed for any input).
    Refused,
}

/// One fuzz target: its name (the cargo-fuzz binary and the folder under `seeds/`) and its
/// body.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]) -> Outcome,
}

/// Every target, in the order of the `[[bin]]` entries of `fuzz/Cargo.toml`.
pub const TARGETS: &[Target] = &[
    Target { name: "logical_key", run: logical_key::run },
    Target { name: "physical_key", run: physical_key::run },
    Target { name: "frame", run: frame::run },
    Target { name: "resp_request", run: resp_request::run },
    Target { name: "nixl_descriptor", run: nixl_descriptor::run },
    Target { name: "block_header", run: block_header::run },
    Target { name: "mooncake_wire", run: mooncake_wire::run },
];

/// `bytes` cut into pieces of pseudo-random sizes (mostly 1 to 17 bytes, sometimes up to
/// 4 KiB), the same pieces for the same seed: how the stream decoders are fed, so that every
/// place a read can end is tried.
#[derive(Debug, Clone)]
pub struct Chunks<'a> {
    state: u64,
    rest: &'a [u8],
}

impl<'a> Chunks<'a> {
    pub fn new(seed: u8, bytes: &'a [u8]) -> Self {
        Self { state: u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, rest: bytes }
    }
}

impl<'a> Iterator for Chunks<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.rest.is_empty() {
            return None;
        }
        // xorshift64
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let s = self.state;
        let size = if s.is_multiple_of(8) { 1 + (s >> 8) % 4096 } else { 1 + (s >> 8) % 17 };
        let size = usize::try_from(size).unwrap_or(1).min(self.rest.len());
        let (chunk, rest) = self.rest.split_at(size);
        self.rest = rest;
        Some(chunk)
    }
}

#[cfg(test)]
mod tests;
