//! The registration conformance suite over GPU memory: device block slots ([`GpuSlots`]) and
//! page-locked staging slots ([`PinnedStaging`]) under `RegisteredPool` keep every rule of the
//! contract. Needs a GPU: without one each case skips with the typed reason (a failure when
//! `GPUCACHE_REQUIRE_GPU=1`, as `scripts/gpu-check.sh` sets).

use std::num::NonZeroUsize;

use gpucache_gpu::{GpuDevice, GpuSlots, PinnedStaging, probe};

const SLOTS: usize = 6;
const SLOT_BYTES: usize = 64 << 10;

fn ready() -> Result<(), String> {
    match probe() {
        Ok(_) => Ok(()),
        Err(why) => {
            assert!(
                !gpucache_gpu::gpu_required(),
                "GPUCACHE_REQUIRE_GPU=1 but no usable GPU: {why}"
            );
            Err(format!("no usable GPU: {why}"))
        }
    }
}

fn sizes() -> (NonZeroUsize, NonZeroUsize) {
    (NonZeroUsize::new(SLOTS).expect("nonzero"), NonZeroUsize::new(SLOT_BYTES).expect("nonzero"))
}

mod device {
    use super::*;

    fn make() -> GpuSlots {
        let (count, bytes) = sizes();
        GpuSlots::new(GpuDevice::open(0).expect("device 0"), count, bytes).expect("device slots")
    }

    gpucache_dataplane::pool_conformance_suite!(make, skip_unless = ready);
}

mod pinned {
    use super::*;

    fn make() -> PinnedStaging {
        let (count, bytes) = sizes();
        PinnedStaging::new(GpuDevice::open(0).expect("device 0"), count, bytes).expect("staging")
    }

    gpucache_dataplane::pool_conformance_suite!(make, skip_unless = ready);
}
