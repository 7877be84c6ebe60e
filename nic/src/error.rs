//! The crate's one error type. Expected transfer outcomes (a failed completion, an unknown
//! outcome that quarantined a region) are values in [`crate::transfer::TransferOutcome`], not
//! errors; `Err` is for calls that were refused before anything was handed to the NIC.

use gpucache_dataplane::registry::{PoolError, RegionId};

/// Why a NIC call was refused. Nothing was posted, so no buffer was handed to the NIC.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NicError {
    #[error("fault rates add up to {total_per_million} per million, the most is {max_per_million}")]
    FaultRatesTooHigh { total_per_million: u64, max_per_million: u64 },
    #[error("endpoint holds {registered} memory regions, its limit is {max}")]
    RegistrationsFull { registered: usize, max: usize },
    #[error("memory key {key:#x} is not registered on this endpoint")]
    UnknownKey { key: u32 },
    #[error("send queue holds {outstanding} work requests, its depth is {depth}")]
    QueueFull { outstanding: usize, depth: usize },
    #[error("region of {len_bytes} bytes refused, the most is {max_bytes}")]
    RegionTooLarge { len_bytes: u64, max_bytes: u64 },
    #[error("memory key space exhausted after {registered} registrations")]
    KeysExhausted { registered: u64 },
    #[error("region {region} is not lent and usable (quarantined, fenced or returned)")]
    LeaseNotUsable { region: RegionId },
    #[error("transfer of {len_bytes} bytes does not fit a slot of {slot_bytes} bytes")]
    TooLong { len_bytes: u64, slot_bytes: u64 },
    #[error("work request id space exhausted at {at}")]
    RequestIdsExhausted { at: u64 },
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error("RDMA verbs unavailable: {reason}")]
    VerbsUnavailable { reason: VerbsUnavailable },
    #[error("verbs call {call} failed: {detail}")]
    VerbsCall { call: &'static str, detail: String },
    #[error("connection setup failed while {step}: {detail}")]
    Connect { step: &'static str, detail: String },
    #[error("NIXL unavailable: {reason}")]
    NixlUnavailable { reason: NixlUnavailable },
    #[error("NIXL call {call} failed: {detail}")]
    NixlCall { call: &'static str, detail: String },
    #[error("NIXL agent knows {peers} peers, its limit is {max}")]
    NixlPeersFull { peers: usize, max: usize },
    #[error("NIXL peer {agent:?} has no loaded metadata (load it, or it was invalidated)")]
    NixlPeerUnknown { agent: String },
    #[error("{mem} memory is not supported here: {detail}")]
    NixlMemUnsupported { mem: &'static str, detail: &'static str },
    #[error("file descriptor {fd} cannot {op}: {detail}")]
    NixlFileAccess { fd: i32, op: &'static str, detail: String },
    #[error("file range {offset}+{len_bytes} is past the end ({limit_bytes} bytes)")]
    NixlFileRange { offset: u64, len_bytes: u64, limit_bytes: u64 },
}

/// Why NIXL cannot be used in this process. Each message says what to install or set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NixlUnavailable {
    #[error("built without the nixl feature (rebuild gpucache-nic with --features nixl)")]
    NotBuilt,
    #[error(
        "libnixl_capi.so cannot be loaded (pip install --no-deps nixl-cu12, then put the \
         wheel's .nixl_cu12.mesonpy.libs folder on LD_LIBRARY_PATH and set UCX_MODULES=^ib)"
    )]
    LibraryMissing,
    #[error("creating the NIXL agent failed: {detail}")]
    AgentCreate { detail: String },
    #[error("NIXL backend plugin {name} is not available (plugins found: {available})")]
    BackendMissing { name: String, available: String },
    #[error("creating the NIXL {name} backend failed: {detail}")]
    BackendCreate { name: String, detail: String },
}

/// What is missing when RDMA verbs cannot be used on this machine. Each message names what to
/// install or enable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsUnavailable {
    #[error("built without the verbs feature (rebuild gpucache-nic with --features verbs)")]
    NotBuilt,
    #[error(
        "libibverbs.so.1 cannot be loaded (install rdma-core: apt-get install libibverbs1 ibverbs-providers)"
    )]
    LibraryMissing,
    #[error(
        "the kernel has no InfiniBand support (ibv_get_device_list: errno {errno}); enable \
         CONFIG_INFINIBAND and load ib_uverbs plus a NIC driver (mlx5_ib) or soft RoCE (rdma_rxe)"
    )]
    KernelWithoutInfiniband { errno: i32 },
    #[error(
        "no /dev/infiniband device nodes; load ib_uverbs (modprobe ib_uverbs) and give this \
         process access to /dev/infiniband/uverbs*"
    )]
    NoDeviceNodes,
    #[error(
        "no RDMA device found; install an RDMA NIC with its provider (ibverbs-providers) or add \
         a soft RoCE device (rdma link add rxe0 type rxe netdev IFACE)"
    )]
    NoDevice,
    #[error("RDMA device {name:?} not found; present: {present}")]
    DeviceNotFound { name: String, present: String },
    #[error("device list failed with errno {errno}; check rdma-core and /dev/infiniband")]
    DeviceListFailed { errno: i32 },
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_dataplane::registry::RegistryError;

    #[test]
    fn every_variant_displays_its_numbers() {
        let cases = [
            (
                NicError::FaultRatesTooHigh {
                    total_per_million: 1_200_000,
                    max_per_million: 1_000_000,
                },
                "fault rates add up to 1200000 per million, the most is 1000000",
            ),
            (
                NicError::RegistrationsFull { registered: 8, max: 8 },
                "endpoint holds 8 memory regions, its limit is 8",
            ),
            (
                NicError::UnknownKey { key: 0x12 },
                "memory key 0x12 is not registered on this endpoint",
            ),
            (
                NicError::QueueFull { outstanding: 4, depth: 4 },
                "send queue holds 4 work requests, its depth is 4",
            ),
            (
                NicError::RegionTooLarge { len_bytes: 9, max_bytes: 8 },
                "region of 9 bytes refused, the most is 8",
            ),
            (
                NicError::KeysExhausted { registered: 7 },
                "memory key space exhausted after 7 registrations",
            ),
            (
                NicError::LeaseNotUsable { region: RegionId(3) },
                "region r3 is not lent and usable (quarantined, fenced or returned)",
            ),
            (
                NicError::TooLong { len_bytes: 10, slot_bytes: 8 },
                "transfer of 10 bytes does not fit a slot of 8 bytes",
            ),
            (NicError::RequestIdsExhausted { at: 9 }, "work request id space exhausted at 9"),
            (
                NicError::Pool(PoolError::Registry(RegistryError::Unknown(RegionId(5)))),
                "region r5 is not registered",
            ),
            (
                NicError::VerbsCall { call: "ibv_reg_mr", detail: "ENOMEM".into() },
                "verbs call ibv_reg_mr failed: ENOMEM",
            ),
            (
                NicError::Connect {
                    step: "reading the peer's endpoint",
                    detail: "timed out".into(),
                },
                "connection setup failed while reading the peer's endpoint: timed out",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }

    #[test]
    fn every_unavailable_reason_names_what_to_install_or_enable() {
        let cases = [
            (VerbsUnavailable::NotBuilt, "--features verbs"),
            (VerbsUnavailable::LibraryMissing, "install rdma-core"),
            (
                VerbsUnavailable::KernelWithoutInfiniband { errno: 38 },
                "errno 38); enable CONFIG_INFINIBAND",
            ),
            (VerbsUnavailable::NoDeviceNodes, "modprobe ib_uverbs"),
            (VerbsUnavailable::NoDevice, "rdma link add rxe0"),
            (
                VerbsUnavailable::DeviceNotFound {
                    name: "mlx5_9".into(),
                    present: "mlx5_0".into(),
                },
                "RDMA device \"mlx5_9\" not found; present: mlx5_0",
            ),
            (VerbsUnavailable::DeviceListFailed { errno: 5 }, "errno 5; check rdma-core"),
        ];
        for (reason, want) in cases {
            let shown = NicError::VerbsUnavailable { reason }.to_string();
            assert!(shown.starts_with("RDMA verbs unavailable: "), "{shown}");
            assert!(shown.contains(want), "{shown} lacks {want}");
        }
    }

    #[test]
    fn every_nixl_reason_names_what_to_do() {
        let cases = [
            (NixlUnavailable::NotBuilt, "--features nixl"),
            (NixlUnavailable::LibraryMissing, "LD_LIBRARY_PATH and set UCX_MODULES=^ib"),
            (
                NixlUnavailable::AgentCreate { detail: "backend error".into() },
                "creating the NIXL agent failed: backend error",
            ),
            (
                NixlUnavailable::BackendMissing { name: "GDS".into(), available: "UCX".into() },
                "plugin GDS is not available (plugins found: UCX)",
            ),
            (
                NixlUnavailable::BackendCreate { name: "UCX".into(), detail: "x".into() },
                "creating the NIXL UCX backend failed: x",
            ),
        ];
        for (reason, want) in cases {
            let shown = NicError::NixlUnavailable { reason }.to_string();
            assert!(shown.starts_with("NIXL unavailable: "), "{shown}");
            assert!(shown.contains(want), "{shown} lacks {want}");
        }
    }

    #[test]
    fn nixl_errors_display_their_numbers() {
        let cases = [
            (
                NicError::NixlCall { call: "postXferReq", detail: "backend error".into() },
                "NIXL call postXferReq failed: backend error",
            ),
            (
                NicError::NixlPeersFull { peers: 4, max: 4 },
                "NIXL agent knows 4 peers, its limit is 4",
            ),
            (
                NicError::NixlPeerUnknown { agent: "b".into() },
                "NIXL peer \"b\" has no loaded metadata (load it, or it was invalidated)",
            ),
            (
                NicError::NixlMemUnsupported { mem: "VRAM", detail: "no GPU" },
                "VRAM memory is not supported here: no GPU",
            ),
            (
                NicError::NixlFileAccess { fd: 7, op: "write", detail: "opened read-only".into() },
                "file descriptor 7 cannot write: opened read-only",
            ),
            (
                NicError::NixlFileRange { offset: 8, len_bytes: 4, limit_bytes: 10 },
                "file range 8+4 is past the end (10 bytes)",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }
}
