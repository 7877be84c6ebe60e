//! Device discovery. The first call loads the driver library, once per process; every call
//! answers a typed reason instead of panicking when there is no CUDA.
//!
//! cudarc's run-time loader panics when `libcuda.so` is missing, so the library's presence is
//! checked before any cudarc call, and `cuInit` runs inside `catch_unwind` as a second guard
//! (a library that loads but lacks a symbol also panics there).

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::error::{DriverCode, GpuUnavailable};

/// What [`GpuUnavailable::NoDriverLibrary`] tells the operator.
pub const NO_DRIVER_HINT: &str = "install the NVIDIA driver (it ships libcuda.so.1) or put its \
    folder on LD_LIBRARY_PATH; no GPU path runs without it";

/// One device as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    pub memory_bytes: u64,
    /// Compute capability (major, minor): (9, 0) on Hopper.
    pub compute_capability: (u32, u32),
}

/// Loads and initialises the driver once; later calls return the first answer.
pub fn driver_ready() -> Result<(), GpuUnavailable> {
    static READY: OnceLock<Result<(), GpuUnavailable>> = OnceLock::new();
    READY.get_or_init(load_driver).clone()
}

fn load_driver() -> Result<(), GpuUnavailable> {
    // SAFETY: only tries to open the candidate library names and drops what it opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuUnavailable::NoDriverLibrary { hint: NO_DRIVER_HINT });
    }
    match std::panic::catch_unwind(result::init) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(GpuUnavailable::InitFailed { code: e.into() }),
        Err(panic) => {
            let detail = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "no message".to_owned());
            Err(GpuUnavailable::LoaderPanicked { detail })
        }
    }
}

fn query(
    ordinal: u32,
    call: &'static str,
) -> impl FnOnce(cudarc::driver::DriverError) -> GpuUnavailable {
    move |e| GpuUnavailable::QueryFailed { ordinal, call, code: DriverCode::from(e) }
}

/// Number of devices the driver reports (after [`driver_ready`]).
pub(crate) fn device_count() -> Result<u32, GpuUnavailable> {
    driver_ready()?;
    let count = result::device::get_count().map_err(query(0, "cuDeviceGetCount"))?;
    Ok(u32::try_from(count).unwrap_or(0))
}

/// Every device the driver reports, or why there is none to use.
pub fn probe() -> Result<Vec<DeviceInfo>, GpuUnavailable> {
    let count = device_count()?;
    if count == 0 {
        return Err(GpuUnavailable::NoDevice);
    }
    (0..count).map(|ordinal| describe_handle(ordinal, handle_of(ordinal, count)?)).collect()
}

/// One device's description.
pub fn describe(ordinal: u32) -> Result<DeviceInfo, GpuUnavailable> {
    describe_handle(ordinal, device_handle(ordinal)?)
}

/// The driver's handle of device `ordinal`, refused when the driver reports fewer devices.
pub(crate) fn device_handle(ordinal: u32) -> Result<sys::CUdevice, GpuUnavailable> {
    handle_of(ordinal, device_count()?)
}

fn handle_of(ordinal: u32, count: u32) -> Result<sys::CUdevice, GpuUnavailable> {
    let missing = GpuUnavailable::NoSuchDevice { ordinal, count };
    let index = i32::try_from(ordinal).ok().filter(|_| ordinal < count).ok_or(missing)?;
    result::device::get(index).map_err(query(ordinal, "cuDeviceGet"))
}

fn describe_handle(ordinal: u32, dev: sys::CUdevice) -> Result<DeviceInfo, GpuUnavailable> {
    let name = result::device::get_name(dev).map_err(query(ordinal, "cuDeviceGetName"))?;
    // SAFETY: `dev` is a handle the driver just returned for an existing ordinal.
    let memory =
        unsafe { result::device::total_mem(dev) }.map_err(query(ordinal, "cuDeviceTotalMem"))?;
    use sys::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
    };
    // SAFETY: as above; the attributes are plain integers.
    let major = unsafe { result::device::get_attribute(dev, MAJOR) }
        .map_err(query(ordinal, "cuDeviceGetAttribute"))?;
    // SAFETY: as above.
    let minor = unsafe { result::device::get_attribute(dev, MINOR) }
        .map_err(query(ordinal, "cuDeviceGetAttribute"))?;
    Ok(DeviceInfo {
        ordinal,
        name,
        memory_bytes: memory as u64,
        compute_capability: (u32::try_from(major).unwrap_or(0), u32::try_from(minor).unwrap_or(0)),
    })
}
