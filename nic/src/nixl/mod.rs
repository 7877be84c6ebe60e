//! NIXL (NVIDIA Inference Xfer Library) as a block transport, through the `nixl-sys` crate.
//!
//! `nixl-sys` is built in its stub mode: it needs no NIXL headers, and loads `libnixl_capi.so`
//! at run time (the `nixl-cu12` wheel ships it, with UCX and the UCX, POSIX and OBJ plugins).
//! Everything here is behind the off-by-default `nixl` feature except [`probe`], the
//! [`wire`] encoding of a block descriptor, and [`crate::NixlUnavailable`], so a build without
//! the feature still answers "NIXL unavailable: built without the nixl feature".
//!
//! The pieces, in the order a service uses them:
//!
//! 1. [`probe`] (or [`NixlAgent::new`], which checks the same) says whether NIXL can be used
//!    here and which plugins it found; every reason it cannot is a [`crate::NixlUnavailable`].
//! 2. [`NixlAgent`]: one per process, named; [`NixlAgent::enable`] creates the UCX backend (host
//!    to host over the network) and the POSIX backend (host memory to files) on request.
//! 3. [`NixlSlots`]: a [`gpucache_storage::host::pool::HugePagePool`] registered with the agent once,
//!    as one descriptor, and carved into the slots of a
//!    [`gpucache_dataplane::registry::RegisteredPool`]. [`NixlSlots::block`] describes a lent
//!    slot as a [`RemoteBlock`] for a peer.
//! 4. Metadata: [`NixlAgent::local_metadata`] after registering, carried to the peer over our
//!    control channel, and [`NixlAgent::load_peer`] there. Block descriptors travel the same way,
//!    encoded with [`RemoteBlock::encode`].
//! 5. [`NixlTransfers`]: READ or WRITE one block between a leased slot and a [`RemoteBlock`]
//!    or a [`NixlFile`] range, with a wall-clock deadline, mapped onto the registration contract
//!    (see [`xfer`]); [`NixlTransfers::fence`] is the only thing that returns a quarantined slot.
//!
//! 6. Between GPUCache nodes: [`NixlStaging`] is the server's staging memory behind the GPCW
//!    stage ops (it implements `gpucache_wire::staging::BlockStaging`), and
//!    [`NixlClient`] the client that READs and WRITEs it, a `Store` over both.
//!
//! Every table is bounded: [`PEERS_MAX`] loaded peers per agent, [`ABANDONED_MAX`] requests
//! with an unknown outcome waiting for a fence.

mod common;
pub mod wire;

#[cfg(feature = "nixl")]
mod agent;
#[cfg(feature = "nixl")]
pub mod client;
#[cfg(feature = "nixl")]
mod file;
#[cfg(feature = "nixl")]
mod memory;
#[cfg(feature = "nixl")]
pub mod service;
#[cfg(feature = "nixl")]
pub mod xfer;

#[cfg(feature = "nixl")]
pub use agent::{NixlAgent, NixlBackend};
#[cfg(feature = "nixl")]
pub use client::{NixlClient, NixlClientConfig, NixlClientCounters, NixlClientError};
#[cfg(feature = "nixl")]
pub use file::NixlFile;
#[cfg(feature = "nixl")]
pub use memory::{NixlSlots, NixlVramRegistration};
#[cfg(feature = "nixl")]
pub use service::{NixlStaging, NixlStagingConfig};
#[cfg(feature = "nixl")]
pub use xfer::{NixlCounters, NixlLimits, NixlOutcome, NixlTransfers};

pub use common::{ABANDONED_MAX, NixlProbe, PEERS_MAX, TRANSPORT};
pub use wire::{BlockMem, RemoteBlock, WireError};

use crate::error::NixlUnavailable;

/// Set to `1` where NIXL must be usable (CI): [`probe_or_skip`] then fails instead of
/// answering a reason to skip.
pub const REQUIRE_NIXL_ENV: &str = "GPUCACHE_REQUIRE_NIXL";

/// For tests and checks that need NIXL: [`probe`]'s answer, with the reason as the error to skip
/// on. Panics with that reason when [`REQUIRE_NIXL_ENV`] is `1`, so a host that must have NIXL
/// cannot pass by skipping.
pub fn probe_or_skip() -> Result<NixlProbe, NixlUnavailable> {
    let answer = probe();
    if let Err(reason) = &answer {
        assert!(
            std::env::var(REQUIRE_NIXL_ENV).as_deref() != Ok("1"),
            "{REQUIRE_NIXL_ENV}=1 but NIXL is unavailable: {reason}"
        );
    }
    answer
}

/// For tests and checks: whether NIXL can be used here. When not, prints the reason to skip on
/// (or panics, as [`probe_or_skip`] does, when [`REQUIRE_NIXL_ENV`] is `1`).
pub fn usable_or_skip() -> bool {
    match probe_or_skip() {
        Ok(_) => true,
        Err(reason) => {
            eprintln!("skipping: NIXL unavailable: {reason}");
            false
        }
    }
}

/// `prefix-<pid>-<n>`, a name no other agent of this process has had. Peers tell agents apart
/// by name, so every agent one process makes (a server's and a client's in one test, say)
/// needs its own.
pub fn unique_agent_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Waits until `listener` has a connection or `deadline` passes, asking `gone` between waits
/// (at most 100 ms apart) whether the process expected to connect has exited already; its
/// answer becomes the error. For the control connection a NIXL peer process opens to its
/// parent (the bench's peer, the tests' peers).
#[cfg(feature = "nixl")]
pub fn accept_before(
    listener: &std::net::TcpListener,
    deadline: std::time::Instant,
    mut gone: impl FnMut() -> Option<String>,
) -> Result<std::net::TcpStream, String> {
    use std::os::fd::AsRawFd;
    loop {
        if let Some(why) = gone() {
            return Err(format!("the peer exited ({why}) before connecting"));
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err("the peer did not connect in time".into());
        }
        let mut fd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let wait_ms = libc::c_int::try_from(left.as_millis().min(100)).unwrap_or(100);
        // SAFETY: poll(2) on one pollfd that lives on this stack frame for the whole call.
        if unsafe { libc::poll(&raw mut fd, 1, wait_ms) } > 0 {
            let (stream, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
            return Ok(stream);
        }
    }
}

/// Says whether NIXL can be used in this process and which plugins it offers. Creates and drops
/// a throwaway agent; never panics or aborts (the library is checked before any call that
/// would abort without it).
pub fn probe() -> Result<NixlProbe, NixlUnavailable> {
    built::probe()
}

// What answers `probe`: the library through `agent` with the feature, `unavailable` without
// it. Both offer the same functions.
#[cfg(feature = "nixl")]
use agent as built;
#[cfg(not(feature = "nixl"))]
use unavailable as built;

/// A build without the `nixl` feature: every question about NIXL is answered "not built".
#[cfg(not(feature = "nixl"))]
mod unavailable {
    use super::common::NixlProbe;
    use crate::error::NixlUnavailable;

    pub(super) fn probe() -> Result<NixlProbe, NixlUnavailable> {
        Err(NixlUnavailable::NotBuilt)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn without_the_feature_probe_says_not_built() {
            assert_eq!(crate::nixl::probe(), Err(crate::NixlUnavailable::NotBuilt));
        }
    }
}
