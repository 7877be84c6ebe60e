//! The registration conformance suite over the DPU agent's slab ([`SlabMemory`], kind
//! `MemoryKind::DpuSlab`, host huge-page memory here): every rule of the contract holds for the
//! memory the agent's queues lease.

use gpucache_dpu::SlabMemory;
use gpucache_storage::host::pool::{HugePagePolicy, HugePagePool, Lock};

fn make() -> SlabMemory {
    let pool =
        HugePagePool::new(6, 64 << 10, HugePagePolicy::default().lock(Lock::Off)).expect("slab");
    SlabMemory::new(pool)
}

gpucache_dataplane::pool_conformance_suite!(make);
