//! Discovery and failure without a GPU: these run everywhere, CI included. On a machine with
//! no CUDA they prove that nothing panics and the reason is typed; on a GPU machine they check
//! the device description instead.

use gpucache_dataplane::registry::{LocalEpochs, MemoryKind, PoolMemory, RegisteredPool};
use gpucache_gpu::error::DriverCode;
use gpucache_gpu::probe::NO_DRIVER_HINT;
use gpucache_gpu::{GpuDevice, GpuError, GpuSlots, GpuUnavailable, probe};
use std::num::NonZeroUsize;

#[test]
fn probe_answers_devices_or_a_typed_reason_and_never_panics() {
    let first = probe();
    match &first {
        Ok(devices) => {
            assert!(!devices.is_empty(), "Ok means at least one device");
            for (i, d) in devices.iter().enumerate() {
                assert_eq!(d.ordinal as usize, i);
                assert!(d.memory_bytes > 0, "{d:?}");
                assert!(d.compute_capability.0 >= 3, "{d:?}");
                assert!(!d.name.is_empty(), "{d:?}");
            }
        }
        Err(GpuUnavailable::NoDriverLibrary { hint }) => {
            assert_eq!(*hint, NO_DRIVER_HINT);
            eprintln!("no GPU here, as expected without libcuda: {}", first.clone().unwrap_err());
        }
        Err(other) => eprintln!("no GPU here: {other}"),
    }
    if let Err(why) = &first {
        assert!(!gpucache_gpu::gpu_required(), "GPUCACHE_REQUIRE_GPU=1 but no usable GPU: {why}");
    }
    // The driver is loaded once; the answer does not change.
    assert_eq!(probe(), first);
}

#[test]
fn opening_a_device_fails_closed() {
    match probe() {
        Err(why) => {
            assert_eq!(GpuDevice::open(0).map(|_| ()), Err(GpuError::Unavailable(why)));
        }
        Ok(devices) => {
            let past = u32::try_from(devices.len()).expect("few devices");
            assert_eq!(
                GpuDevice::open(past).map(|_| ()),
                Err(GpuError::Unavailable(GpuUnavailable::NoSuchDevice {
                    ordinal: past,
                    count: past
                }))
            );
            // One real device: its slots are GPU memory of that ordinal under the pool contract.
            let device = GpuDevice::open(0).expect("device 0");
            let n = |v| NonZeroUsize::new(v).expect("nonzero");
            let slots = GpuSlots::new(device, n(4), n(4096)).expect("allocation");
            assert_eq!(slots.kind(), MemoryKind::Gpu { device: 0 });
            assert_eq!(slots.slot_ptr(3).expect("in range") - slots.base_ptr(), 3 * 4096);
            assert_eq!(slots.slot_ptr(4), Err(GpuError::SlotOutOfRange { slot: 4, slot_count: 4 }));
            let mut pool = RegisteredPool::new(slots, Box::new(LocalEpochs));
            let owner = gpucache_dataplane::testing::fixture::tenant(0);
            let leases = pool.checkout(&owner, 4, None).expect("four slots");
            assert!(pool.slot_bytes_mut(&leases[0]).is_none(), "device memory has no host view");
        }
    }
}

#[test]
fn error_messages_carry_the_numbers() {
    let code = DriverCode { code: 2, name: "CUDA_ERROR_OUT_OF_MEMORY".into() };
    let cases: Vec<(String, &str)> = vec![
        (
            GpuUnavailable::NoDriverLibrary { hint: "install it" }.to_string(),
            "the CUDA driver library cannot be loaded (libcuda.so.1 or libcuda.so): install it",
        ),
        (GpuUnavailable::NoDevice.to_string(), "the CUDA driver reports no device"),
        (
            GpuUnavailable::InitFailed {
                code: DriverCode { code: 100, name: "CUDA_ERROR_NO_DEVICE".into() },
            }
            .to_string(),
            "cuInit failed: CUresult 100 (CUDA_ERROR_NO_DEVICE)",
        ),
        (
            GpuUnavailable::NoSuchDevice { ordinal: 3, count: 1 }.to_string(),
            "device 3 does not exist; the driver reports 1 devices",
        ),
        (
            GpuError::Driver { call: "cuMemAlloc", code: code.clone() }.to_string(),
            "cuMemAlloc failed: CUresult 2 (CUDA_ERROR_OUT_OF_MEMORY)",
        ),
        (
            GpuError::Limit { what: "slot count", requested: 70000, max: 65536 }.to_string(),
            "slot count of 70000 exceeds its limit 65536",
        ),
        (
            GpuError::InFlightFull { in_flight: 64, max: 64 }.to_string(),
            "64 copies are in flight on this stream, in_flight_max is 64",
        ),
        (
            GpuError::TransferTooLong { len: 10, slot_bytes: 8 }.to_string(),
            "a transfer of 10 bytes does not fit a 8-byte slot",
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, want);
    }
}
