//! Pool slots registered with the real verbs endpoint (feature `verbs`).
//!
//! Here (no InfiniBand in the kernel) opening the endpoint must fail closed with the typed
//! reason, so no pool slot can be registered. On an RDMA host, `GPUCACHE_TEST_VERBS=1` runs the
//! registration conformance suite over `NicSlots<VerbsEndpoint, HugePagePool>`: every bind is
//! an `ibv_reg_mr` of one slot's own address and length (docs/HARDWARE.md, "RDMA verbs").
#![cfg(feature = "verbs")]

use gpucache_dataplane::registry::{MemoryKind, PoolMemory};
use gpucache_nic::rdma::{VerbsConfig, VerbsEndpoint};
use gpucache_nic::slots::NicSlots;
use gpucache_nic::{NicError, VerbsUnavailable};
use gpucache_storage::host::pool::{HugePagePolicy, HugePagePool, Tier};

const SLOTS: usize = 6;
const SLOT_BYTES: usize = 3000;
const OPT_IN: &str = "GPUCACHE_TEST_VERBS";

fn opted_in() -> bool {
    std::env::var_os(OPT_IN).is_some_and(|v| v == "1")
}

#[test]
fn without_an_rdma_device_the_verbs_pool_fails_closed() {
    if opted_in() {
        eprintln!("skipped: {OPT_IN}=1 says this host has RDMA; the conformance suite runs");
        return;
    }
    let e = VerbsConfig::default().open().expect_err(
        "an RDMA device is present: run with GPUCACHE_TEST_VERBS=1 to test pool registration",
    );
    match &e {
        NicError::VerbsUnavailable { reason } => assert!(
            matches!(
                reason,
                VerbsUnavailable::KernelWithoutInfiniband { errno: 38 }
                    | VerbsUnavailable::NoDeviceNodes
                    | VerbsUnavailable::NoDevice
                    | VerbsUnavailable::LibraryMissing
            ),
            "unexpected reason: {reason:?}"
        ),
        other => panic!("opening failed with an untyped reason: {other:?}"),
    }
    // The pool itself is fine; only the registration is unavailable.
    let pool = HugePagePool::new(SLOTS, SLOT_BYTES, HugePagePolicy::only(Tier::Plain)).unwrap();
    assert_eq!(pool.kind(), MemoryKind::Host);
}

fn ready() -> Result<(), String> {
    if opted_in() { Ok(()) } else { Err(format!("verbs pool tests are opt-in: {OPT_IN}=1")) }
}

fn on(tier: Tier) -> NicSlots<VerbsEndpoint, HugePagePool> {
    let endpoint = VerbsConfig::default().open().unwrap_or_else(|e| panic!("{OPT_IN}=1: {e}"));
    let memory = HugePagePool::new(SLOTS, SLOT_BYTES, HugePagePolicy::only(tier)).unwrap();
    let slots = NicSlots::on(endpoint, memory);
    assert_eq!(slots.kind(), MemoryKind::NicRegistered { transport: "verbs" });
    slots
}

mod plain {
    use super::*;

    fn make() -> NicSlots<VerbsEndpoint, HugePagePool> {
        on(Tier::Plain)
    }

    gpucache_dataplane::pool_conformance_suite!(make, skip_unless = ready);
}

mod transparent {
    use super::*;

    fn make() -> NicSlots<VerbsEndpoint, HugePagePool> {
        on(Tier::Transparent)
    }

    gpucache_dataplane::pool_conformance_suite!(make, skip_unless = ready);
}
