//! What the agent, the registered slots, the transfers and the staging service all name: the
//! bounds of their tables, the transport name, and what a probe found. Defined below all of
//! them, and present with or without the `nixl` feature.

/// Most peers whose metadata one agent holds at a time.
pub const PEERS_MAX: usize = 256;
/// Most requests with an unknown outcome kept (with their quarantined slots) until a fence;
/// when full, new transfers are refused until `NixlTransfers::fence`.
pub const ABANDONED_MAX: usize = 1024;
/// The transport name NIXL-registered pools report in `MemoryKind::NicRegistered`.
pub const TRANSPORT: &str = "nixl";

/// What `probe` found: NIXL can be used here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlProbe {
    /// Backend plugins NIXL can load (for the wheel: UCX, POSIX, OBJ and friends).
    pub plugins: Vec<String>,
}
