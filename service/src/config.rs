//! The `gpucache serve` configuration: a TOML file, checked in full before anything starts.
//!
//! - The schema ([`ServeConfig`] and its sections): every key, with its one default.
//! - [`ServeConfig::validate`]: the whole check, giving a [`ValidConfig`], the only value the
//!   service is built from (`crate::build`).
//! - [`ConfigError`]: every refusal names the key path it is about (`listen.native: ...`).
//!   Every table refuses keys it does not know, so a typo is an error that says where it is
//!   rather than a silently ignored setting.
//!
//! The reference for operators is `docs/OPERATIONS.md`; `gpucache.example.toml` spells out
//! every default, and the tests hold both to the `Default` impls here.

mod de;
mod error;
mod schema;
mod valid;

pub use error::ConfigError;
pub use schema::{
    ClusterSection, DPU_QUEUE_DEPTH_DEFAULT, DPU_SLAB_SLOTS_DEFAULT, DPU_SLOT_BYTES_DEFAULT,
    DPU_STATE_DIR_DEFAULT, DpuBackendName, DpuReactorConfig, DpuSection, DurabilityName,
    EngineName, Eviction, FileTierSection, LOCAL_SOCKET_NAME, LimitsSection, ListenSection,
    MEMORY_TIER_BYTES_MAX, MEMORY_TIER_BYTES_UNKNOWN_RAM, METRICS_ADDR_DEFAULT, MemoryTierSection,
    NATIVE_ADDR_DEFAULT, NIXL_POOL_BYTES_DEFAULT, NIXL_SLOT_BYTES_DEFAULT, NixlSection, PinName,
    RESP_ADDR_DEFAULT, RightName, S3TierSection, STORE_ROOT_DEFAULT, ServeConfig, StoreKind,
    StoreSection, TENANT_DEFAULT, TenantConfig, TierKind, TierMemoryName, TierSection,
    memory_tier_default_bytes,
};
pub use valid::{
    CLOCK_SKEW_MAX_LIMIT_MS, CLUSTER_TEXT_BYTES_MAX, CONFIG_BYTES_MAX, CONNECTIONS_MAX_LIMIT,
    DPU_CORE_MAX, DPU_SLOT_BYTES_MAX, DPU_SLOT_BYTES_MIN, NIXL_AGENT_BYTES_MAX,
    NIXL_SLOT_BYTES_MAX, NIXL_SLOT_BYTES_MIN, NIXL_SLOTS_MAX, QUEUE_DEPTH_MAX,
    SOCKET_PATH_BYTES_MAX, TIMEOUT_LIMIT_MS, ValidConfig,
};
