//! Native offload backends (SPDK, DOCA), each behind its cargo feature. This build carries no
//! binding to either library: construction checks what the real backend would need, and always
//! fails closed with [`DpuError::NativeUnavailable`] naming everything missing, so a
//! configuration that asks for offload never silently runs on host threads.

// What is missing is part of the error, so `NativeMissing` is defined beside it.
#[cfg(any(feature = "spdk", feature = "doca"))]
use crate::error::{DpuError, NativeMissing};

#[cfg(any(feature = "spdk", feature = "doca"))]
fn library_loads(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else { return false };
    // SAFETY: `c` is a NUL-terminated name; dlopen either fails (null) or returns a handle
    // that is closed right below and never used otherwise.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if h.is_null() {
        return false;
    }
    // SAFETY: `h` is a handle dlopen returned and nothing else uses it.
    unsafe { libc::dlclose(h) };
    true
}

#[cfg(any(feature = "spdk", feature = "doca"))]
fn hugepages_free() -> bool {
    std::fs::read_to_string("/proc/meminfo").ok().is_some_and(|m| {
        m.lines().any(|l| {
            l.strip_prefix("HugePages_Free:")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .is_some_and(|n| n > 0)
        })
    })
}

#[cfg(any(feature = "spdk", feature = "doca"))]
fn fail(backend: &'static str, libs: &[&str], device: Option<String>) -> DpuError {
    let mut missing: Vec<NativeMissing> = libs
        .iter()
        .filter(|l| !library_loads(l))
        .map(|l| NativeMissing::Library { name: (*l).to_string() })
        .collect();
    if let Some(what) = device {
        missing.push(NativeMissing::Device { what });
    }
    if !hugepages_free() {
        missing.push(NativeMissing::HugePages);
    }
    missing.push(NativeMissing::Binding { backend });
    DpuError::NativeUnavailable { backend, missing }
}

#[cfg(feature = "spdk")]
pub(crate) mod spdk {
    //! SPDK NVMe queues (fail closed).
    use super::*;

    /// An NVMe controller for SPDK to drive from user space.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct SpdkConfig {
        /// PCI address of the controller, e.g. `0000:3b:00.0`.
        pub pci_addr: String,
    }

    pub(crate) fn open(config: &SpdkConfig) -> DpuError {
        let dev = std::path::Path::new("/sys/bus/pci/devices").join(&config.pci_addr);
        let device = (!dev.exists()).then(|| format!("NVMe controller {}", config.pci_addr));
        fail("spdk", &["libspdk_nvme.so", "libspdk_env_dpdk.so"], device)
    }
}

#[cfg(feature = "doca")]
pub(crate) mod doca {
    //! DOCA queues on a BlueField (fail closed).
    use super::*;

    /// A BlueField device for DOCA.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct DocaConfig {
        /// The RDMA device name of the BlueField function, e.g. `mlx5_0`.
        pub device: String,
    }

    pub(crate) fn open(config: &DocaConfig) -> DpuError {
        let dev = std::path::Path::new("/sys/class/infiniband").join(&config.device);
        let device = (!dev.exists()).then(|| format!("BlueField {}", config.device));
        fail("doca", &["libdoca_common.so", "libdoca_dma.so"], device)
    }
}
