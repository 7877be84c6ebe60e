//! The device slots registered with NIXL as VRAM (feature `nixl`). Fails closed: without a GPU
//! the slots cannot be built; without NIXL no agent can be made. On a machine with both, a lent
//! slot is described as a VRAM block on the GPU's ordinal at the slot's device address.

use std::num::NonZeroUsize;

use gpucache_dataplane::registry::{LocalEpochs, MemoryKind, PoolMemory, RegisteredPool};
use gpucache_dataplane::testing::fixture::tenant;
use gpucache_gpu::{GpuDevice, GpuError, GpuSlots, NixlGpuSlots, gpu_required, probe};
use gpucache_nic::NicError;
use gpucache_nic::nixl::wire::BlockMem;
use gpucache_nic::nixl::{NixlAgent, REQUIRE_NIXL_ENV};

#[test]
fn vram_registration_fails_closed_or_describes_vram_blocks() {
    let gpu = match probe() {
        Err(why) => {
            assert_eq!(GpuDevice::open(0).map(|_| ()), Err(GpuError::Unavailable(why.clone())));
            assert!(!gpu_required(), "a GPU is required here but none is usable: {why}");
            eprintln!("SKIP VRAM registration: no usable GPU ({why})");
            return;
        }
        Ok(_) => GpuDevice::open(0).expect("device 0"),
    };
    let agent = match NixlAgent::new("gpucache-gpu-test") {
        Err(e) => {
            assert!(matches!(e, NicError::NixlUnavailable { .. }), "{e}");
            let as_gpu = GpuError::from(e.clone());
            assert_eq!(as_gpu.to_string(), e.to_string());
            assert!(
                std::env::var(REQUIRE_NIXL_ENV).as_deref() != Ok("1"),
                "{REQUIRE_NIXL_ENV}=1 but no NIXL agent can be made: {e}"
            );
            eprintln!("SKIP VRAM registration: {e}");
            return;
        }
        Ok(agent) => agent,
    };
    let n = |v| NonZeroUsize::new(v).expect("nonzero");
    let slots = GpuSlots::new(gpu, n(4), n(1 << 20)).expect("slots");
    let base = slots.base_ptr();
    let memory = NixlGpuSlots::register(&agent, slots).expect("VRAM registration");
    assert!(memory.registration().registered());
    assert_eq!(memory.kind(), MemoryKind::Gpu { device: 0 });
    let mut pool = RegisteredPool::new(memory, Box::new(LocalEpochs));
    let leases = pool.checkout(&tenant(0), 2, None).expect("slots");
    let block = NixlGpuSlots::block(&pool, &leases[1], 4096).expect("described");
    assert_eq!(block.mem, BlockMem::Vram);
    assert_eq!(block.dev_id, 0);
    assert_eq!(block.addr, base + (1 << 20) * leases[1].slot as u64);
    assert!(matches!(
        NixlGpuSlots::block(&pool, &leases[1], (1 << 20) + 1),
        Err(GpuError::TransferTooLong { .. })
    ));
}
