//! The bench in a build without the `nixl` feature: the run stops at the probe, and the peer
//! role says NIXL was not built.

use super::plan::{NixlBenchArgs, Plan};

/// Never reached in such a build (`run` returns at the probe); answers the same reason.
pub(super) fn run_inner(_args: &NixlBenchArgs, _plan: &Plan) -> Result<bool, String> {
    Err(not_built())
}

pub(super) fn peer_main(_port: u16, _slot_bytes: usize) -> Result<(), String> {
    Err(not_built())
}

fn not_built() -> String {
    format!("NIXL unavailable: {}", gpucache_nic::NixlUnavailable::NotBuilt)
}
