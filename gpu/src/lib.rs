//! GPU buffers for GPUCache through cudarc, loaded at run time: device discovery that never
//! panics without CUDA, device buffers under the registration contract, pinned host staging and
//! H2D/D2H copies whose completion events map onto retirement facts.
//!
//! - [`probe`]: load the driver once, list devices, or say why there is no GPU.
//! - [`memory`]: a device's context, [`GpuSlots`] (device block slots) and [`PinnedStaging`]
//!   (page-locked host slots), both `PoolMemory` for `RegisteredPool`.
//! - [`retire`]: the event-to-retirement state machine over any [`CompletionEvent`]: deadline,
//!   quarantine of both slots on an unknown outcome, and the drain-proven fence.
//! - [`stream`]: copies of block slots on a CUDA stream, one event each.
//! - `nixl` (feature `nixl`): the device allocation registered with NIXL as VRAM.
//!
//! Owns device memory and streams. It must not own block identity or lifecycle: keys, stores
//! and publication stay with the data plane.
//!
//! It builds and its unit tests run everywhere; the device paths run only where a GPU is
//! (`scripts/gpu-check.sh`), and have not run on one yet. Without the driver every call is a
//! typed [`GpuUnavailable`], never a panic.

pub mod error;
pub mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod probe;
pub mod retire;
pub mod stream;

pub use error::{DriverCode, GpuError, GpuUnavailable};
pub use memory::{GpuDevice, GpuSlots, PinnedStaging};
#[cfg(feature = "nixl")]
pub use nixl::NixlGpuSlots;
pub use probe::{DeviceInfo, driver_ready, probe};
pub use retire::{CompletionEvent, EventStatus, RetireLimits, Retirement, TransferBook};
pub use stream::{CudaEvent, Direction, GpuStream};

/// Set to `1` to turn "no GPU here" from a skip into a failure (the GPU check script does).
pub const REQUIRE_GPU_ENV: &str = "GPUCACHE_REQUIRE_GPU";

/// Whether the environment demands a GPU.
pub fn gpu_required() -> bool {
    std::env::var(REQUIRE_GPU_ENV).is_ok_and(|v| v == "1")
}
