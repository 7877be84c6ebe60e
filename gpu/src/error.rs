//! The crate's errors: why no GPU can be used at all ([`GpuUnavailable`]) and why one call on a
//! working GPU failed ([`GpuError`]). Both carry the driver's result code and the numbers.

use gpucache_dataplane::registry::{PoolError, RegionId};

/// The driver's result code of a failed call, with its name when the driver can say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverCode {
    pub code: u32,
    pub name: String,
}

impl std::fmt::Display for DriverCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CUresult {} ({})", self.code, self.name)
    }
}

impl From<cudarc::driver::DriverError> for DriverCode {
    fn from(e: cudarc::driver::DriverError) -> Self {
        // `error_name` asks the driver, which is loaded whenever a DriverError exists.
        let name = e
            .error_name()
            .map_or_else(|_| "unnamed".to_owned(), |n| n.to_string_lossy().into_owned());
        Self { code: e.0 as u32, name }
    }
}

/// Why this process cannot use a GPU. Probing never panics; it answers one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuUnavailable {
    #[error("the CUDA driver library cannot be loaded (libcuda.so.1 or libcuda.so): {hint}")]
    NoDriverLibrary { hint: &'static str },
    #[error("cuInit failed: {code}")]
    InitFailed { code: DriverCode },
    #[error("loading the CUDA driver panicked: {detail}")]
    LoaderPanicked { detail: String },
    #[error("the CUDA driver reports no device")]
    NoDevice,
    #[error("device {ordinal} does not exist; the driver reports {count} devices")]
    NoSuchDevice { ordinal: u32, count: u32 },
    #[error("querying device {ordinal} failed in {call}: {code}")]
    QueryFailed { ordinal: u32, call: &'static str, code: DriverCode },
}

/// Why a GPU call was refused or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    #[error(transparent)]
    Unavailable(#[from] GpuUnavailable),
    #[error("{call} failed: {code}")]
    Driver { call: &'static str, code: DriverCode },
    #[error("{what} of {requested} exceeds its limit {max}")]
    Limit { what: &'static str, requested: u64, max: u64 },
    #[error("slot {slot} is out of range: the allocation has {slot_count} slots")]
    SlotOutOfRange { slot: usize, slot_count: usize },
    #[error("a transfer of {len} bytes does not fit a {slot_bytes}-byte slot")]
    TransferTooLong { len: usize, slot_bytes: usize },
    #[error("{in_flight} copies are in flight on this stream, in_flight_max is {max}")]
    InFlightFull { in_flight: usize, max: usize },
    #[error(
        "region {region} is not lent (released, quarantined or fenced): no transfer may touch it"
    )]
    NotLent { region: RegionId },
    #[error("transfer {transfer} is not in flight on this stream")]
    UnknownTransfer { transfer: u64 },
    #[error("the stream did not drain within {waited_ms} ms: no fence, quarantined slots stay so")]
    DrainDeadline { waited_ms: u64 },
    #[error(
        "the device context did not drain within {deadline_ms} ms (waited {waited_ms} ms): \
         memory a copy may still use stays allocated"
    )]
    ContextDrainDeadline { waited_ms: u64, deadline_ms: u64 },
    #[error("the context's drain could not be started on a thread of its own: {detail}")]
    DrainThread { detail: String },
    #[error(
        "staging lease for region {region} is on device {staging_device}, the slots on {device}"
    )]
    DeviceMismatch { region: RegionId, device: u32, staging_device: u32 },
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// NIXL refused (unavailable, registration failed); only with the `nixl` feature.
    #[cfg(feature = "nixl")]
    #[error(transparent)]
    Nixl(gpucache_nic::NicError),
}

pub(crate) fn driver(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver { call, code: e.into() }
}
