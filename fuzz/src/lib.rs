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

pub mod frame;
pub mod logical_key;
pub mod physical_key;
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
];

#[cfg(test)]
mod tests;
