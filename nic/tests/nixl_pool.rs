//! The registration conformance suite over NIXL-registered pool memory: a huge-page pool
//! registered with an agent's UCX backend as one DRAM descriptor ([`NixlSlots`]) keeps every
//! rule of the contract (bound slots first, quarantine on an unknown completion, nothing freed
//! by expiry, idle reports or late completions, only a fence or a drained attestation returns a
//! slot, region ids never reused).
//!
//! Needs `libnixl_capi.so`: without it each case skips with the typed reason, or fails when
//! `GPUCACHE_REQUIRE_NIXL=1` (CI).

use gpucache_nic::nixl::{BlockMem, NixlAgent, NixlBackend, NixlSlots};
use gpucache_storage::host::pool::{HugePagePolicy, HugePagePool, Lock};

const SLOTS: usize = 6;
const SLOT_BYTES: usize = 64 << 10;

fn ready() -> Result<(), String> {
    gpucache_nic::nixl::probe_or_skip().map(drop).map_err(|r| format!("NIXL unavailable: {r}"))
}

/// A fresh agent per pool: the registration handle keeps the agent alive as long as the slots.
fn make() -> NixlSlots {
    let mut agent = NixlAgent::new(&gpucache_nic::nixl::unique_agent_name("pool")).expect("agent");
    agent.enable(NixlBackend::Ucx).expect("UCX backend");
    let memory = HugePagePool::new(SLOTS, SLOT_BYTES, HugePagePolicy::default().lock(Lock::Off))
        .expect("host pool");
    NixlSlots::register(&agent, memory, BlockMem::Dram).expect("registration")
}

gpucache_dataplane::pool_conformance_suite!(make, skip_unless = ready);
