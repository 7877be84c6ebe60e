//! The `gpucache serve` configuration: a TOML file, checked in full before anything starts.
//!
//! Owns the file's shape (every section and key, with defaults), its validation, and turning it
//! into a running store ([`ServeConfig::open_store`]). Every table refuses keys it does not know,
//! and every error names the key path it is about (`listen.native: ...`), so a typo is an error
//! that says where it is rather than a silently ignored setting. The reference for operators is
//! `docs/OPERATIONS.md`.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use crate::auth::{KeyFileError, TenantAuth, TenantKeys};
use crate::server::CLOCK_SKEW_MAX_DEFAULT;
use gpucache_dataplane::caller::{Caller, Right, Rights};
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::identity::{IdentityError, TenantId};
use gpucache_dataplane::limits::{LimitsError, ResourceLimits};
use gpucache_dataplane::store::Store;
use gpucache_storage::MemoryStore;
use gpucache_storage::file::engine::{EngineChoice, EngineConfig};
use gpucache_storage::file::{Durability, FileStoreConfig, FileStoreError};
use gpucache_storage::host::pool::POOL_BYTES_MAX;
use gpucache_storage::host::segment::SEGMENT_BYTES_MIN;
use gpucache_wire::SealAlgorithm;
use gpucache_wire::staging::StagingLimits;

/// Largest configuration file read; a bigger one is surely not a configuration file.
pub const CONFIG_BYTES_MAX: u64 = 1 << 20;
/// Deepest io_uring queue accepted (the engine clamps to the same bound).
pub const QUEUE_DEPTH_MAX: u32 = 4096;
/// Most client connections: each one is a thread (ADR 0011).
pub const CONNECTIONS_MAX_LIMIT: u32 = 16_384;
/// Widest HELLO clock window accepted: one hour.
pub const CLOCK_SKEW_MAX_LIMIT_MS: u64 = 3_600_000;
/// Longest Unix socket path: `sun_path` holds 108 bytes with the terminating NUL.
pub const SOCKET_PATH_BYTES_MAX: usize = 107;
/// The local socket's name inside `store.root` when `listen.local` is not set.
pub const LOCAL_SOCKET_NAME: &str = "gpucache.sock";
/// Default `listen.shm_mapped_bytes_max`: 16 GiB of client segments mapped at once.
pub const SHM_MAPPED_BYTES_MAX_DEFAULT: u64 = 16 << 30;
/// Mode of the local socket after binding: the service's user and group may connect.
pub const LOCAL_SOCKET_MODE: u32 = 0o660;
/// Default `nixl.slot_bytes`: the largest block that moves over NIXL.
pub const NIXL_SLOT_BYTES_DEFAULT: u64 = 4 << 20;
/// Default `nixl.pool_bytes`: 64 slots of the default size.
pub const NIXL_POOL_BYTES_DEFAULT: u64 = 256 << 20;
/// Smallest `nixl.slot_bytes`: one page.
pub const NIXL_SLOT_BYTES_MIN: u64 = 4096;
/// Largest `nixl.slot_bytes`.
pub const NIXL_SLOT_BYTES_MAX: u64 = 1 << 30;
/// Most slots `nixl.pool_bytes / nixl.slot_bytes` may give (the staging pool's table bound).
pub const NIXL_SLOTS_MAX: u64 = 65_536;
/// Longest `nixl.agent` name.
pub const NIXL_AGENT_BYTES_MAX: usize = 128;

/// Why a configuration was refused. Display starts with the key path it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: larger than {bytes_max} bytes; not a configuration file")]
    TooLarge { path: PathBuf, bytes_max: u64 },
    /// The TOML is malformed, a key is unknown, or a value has the wrong type or spelling.
    #[error("{}", parse_display(.key, .message, *.line, *.column))]
    Parse { key: String, message: String, line: usize, column: usize },
    #[error("{key}: {source}")]
    Limits { key: String, source: LimitsError },
    #[error("{key}: {value} is outside {min}..={max}")]
    OutOfRange { key: &'static str, value: u64, min: u64, max: u64 },
    #[error(
        "{key}: {addr} is not a loopback address; set listen.allow_remote = true to accept \
         connections from other hosts"
    )]
    NotLoopback { key: &'static str, addr: SocketAddr },
    #[error("{key}: {addr} is already used by {other}")]
    AddressReused { key: &'static str, other: &'static str, addr: SocketAddr },
    #[error("tenants: at least one tenant is required")]
    NoTenants,
    #[error("tenants: {configured} tenants configured, limits.tenants_max is {max}")]
    TooManyTenants { configured: usize, max: u32 },
    #[error("{key}: {source}")]
    TenantName { key: String, source: IdentityError },
    #[error("{key}: tenant {name} is already defined by tenants[{first}]")]
    DuplicateTenant { key: String, name: String, first: usize },
    #[error("{key}: a tenant needs at least one right (read, write or admin)")]
    NoRights { key: String },
    #[error("listen.resp_tenant: {name} is not one of the configured tenants ({known})")]
    UnknownRespTenant { name: String, known: String },
    /// A tenant's key file is missing, open to others, or has a bad line (the error names the
    /// file and the line).
    #[error("{key}: {source}")]
    KeyFile { key: String, source: KeyFileError },
    #[error(
        "{key}: tenant {name} has no secret_file and listen.native {addr} is not loopback; \
         give it a secret_file, or set listen.allow_open_tenants = true to trust every peer \
         to name its own tenant"
    )]
    OpenTenant { key: String, name: String, addr: SocketAddr },
    #[error("{key}: {name:?} is not a seal algorithm (\"blake3\" or \"hmac-sha256\")")]
    SealAlgorithm { key: String, name: String },
    #[error("store.root: cannot open the file store at {root}: {source}")]
    OpenFileStore { root: PathBuf, source: FileStoreError },
    /// `listen.local` names a socket that cannot be bound: too long for `sun_path`, or in a
    /// directory that does not exist.
    #[error("listen.local: {path}: {why}")]
    LocalSocket { path: PathBuf, why: String },
    /// `nixl.agent` is empty, too long, or has characters other than letters, digits, `-`,
    /// `_` and `.`.
    #[error("nixl.agent: {name:?} {why}")]
    NixlAgentName { name: String, why: String },
    /// A `[dpu]` key (or a `[[dpu.reactors]]` entry) that cannot describe an agent.
    #[error("{key}: {why}")]
    Dpu { key: String, why: String },
    /// The DPU agent (or the store it fronts) did not start: a native backend failed closed,
    /// a core could not be pinned under `dpu.pin = "required"`, the state dir is unwritable.
    #[error("{key}: {source}")]
    DpuStart { key: &'static str, source: gpucache_dpu::DpuError },
    /// `dpu.backend` names a native backend this binary was built without.
    #[error(
        "dpu.backend: {backend} backend unavailable: built without the {backend} feature \
         (cargo build -p gpucache-cli --features {backend})"
    )]
    DpuNotBuilt { backend: &'static str },
    /// `nixl.pool_bytes` is not a whole number of `nixl.slot_bytes` slots.
    #[error(
        "nixl.pool_bytes: {pool_bytes} is not a multiple of nixl.slot_bytes ({slot_bytes}); \
         the pool is carved into whole slots"
    )]
    NixlPoolNotWhole { pool_bytes: u64, slot_bytes: u64 },
}

fn parse_display(key: &str, message: &str, line: usize, column: usize) -> String {
    if key.is_empty() {
        format!("line {line}, column {column}: {message}")
    } else {
        format!("{key}: {message} (line {line}, column {column})")
    }
}

impl ConfigError {
    /// The key path the error is about (`listen.native`, `tenants[1].name`), when it is about
    /// one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Read { .. } | Self::TooLarge { .. } => None,
            Self::Parse { key, .. } => Some(key).filter(|k| !k.is_empty()).map(String::as_str),
            Self::Limits { key, .. }
            | Self::TenantName { key, .. }
            | Self::DuplicateTenant { key, .. }
            | Self::NoRights { key }
            | Self::KeyFile { key, .. }
            | Self::OpenTenant { key, .. }
            | Self::SealAlgorithm { key, .. } => Some(key),
            Self::OutOfRange { key, .. }
            | Self::NotLoopback { key, .. }
            | Self::AddressReused { key, .. } => Some(key),
            Self::NoTenants | Self::TooManyTenants { .. } => Some("tenants"),
            Self::UnknownRespTenant { .. } => Some("listen.resp_tenant"),
            Self::OpenFileStore { .. } => Some("store.root"),
            Self::LocalSocket { .. } => Some("listen.local"),
            Self::NixlAgentName { .. } => Some("nixl.agent"),
            Self::NixlPoolNotWhole { .. } => Some("nixl.pool_bytes"),
            Self::Dpu { key, .. } => Some(key),
            Self::DpuStart { key, .. } => Some(key),
            Self::DpuNotBuilt { .. } => Some("dpu.backend"),
        }
    }
}

/// The whole `gpucache serve` configuration. Every section may be left out (its defaults
/// apply); every key inside a section may be left out except a tenant's `name` and `rights`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    pub store: StoreSection,
    pub limits: LimitsSection,
    pub listen: ListenSection,
    pub tenants: Vec<TenantConfig>,
    pub nixl: NixlSection,
    pub dpu: DpuSection,
}

impl Default for ServeConfig {
    /// A FileStore under `./gpucache-data`, loopback listeners on 7470-7472, and one tenant
    /// `default` that may read and write.
    fn default() -> Self {
        Self {
            store: StoreSection::default(),
            limits: LimitsSection::default(),
            listen: ListenSection::default(),
            tenants: vec![TenantConfig {
                name: "default".to_owned(),
                rights: vec![RightName::Read, RightName::Write],
                secret_file: None,
                seal_algorithms: None,
            }],
            nixl: NixlSection::default(),
            dpu: DpuSection::default(),
        }
    }
}

/// Which store backs the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StoreKind {
    /// Block files under `root`; survives restarts.
    File,
    /// Host memory; empty at every start.
    Memory,
    /// The DPU agent (`[dpu]`) in-process, its reactors running every call against a file
    /// store under `root` (the `[store]` file keys apply to it).
    Dpu,
}

/// `store.engine`: the FileStore's I/O engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineName {
    Auto,
    Uring,
    Psync,
}

impl From<EngineName> for EngineChoice {
    fn from(e: EngineName) -> Self {
        match e {
            EngineName::Auto => EngineChoice::Auto,
            EngineName::Uring => EngineChoice::Uring,
            EngineName::Psync => EngineChoice::Psync,
        }
    }
}

/// `store.durability`: when a PUT is acknowledged (ADR 0009).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DurabilityName {
    PerBlock,
    GroupCommit,
    None,
}

impl From<DurabilityName> for Durability {
    fn from(d: DurabilityName) -> Self {
        match d {
            DurabilityName::PerBlock => Durability::PerBlock,
            DurabilityName::GroupCommit => Durability::GroupCommit,
            DurabilityName::None => Durability::None,
        }
    }
}

/// `[store]`. The keys after `kind` apply to the file store only.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    pub kind: StoreKind,
    pub root: PathBuf,
    pub engine: EngineName,
    pub direct_io: bool,
    pub durability: DurabilityName,
    pub queue_depth: u32,
    pub group_commit_deadline_ms: u64,
}

impl Default for StoreSection {
    fn default() -> Self {
        let file = FileStoreConfig::new("./gpucache-data");
        Self {
            kind: StoreKind::File,
            root: file.root,
            engine: EngineName::Auto,
            direct_io: file.direct_io,
            durability: DurabilityName::PerBlock,
            queue_depth: file.engine_config.queue_depth,
            group_commit_deadline_ms: file.group_commit_deadline_ms,
        }
    }
}

/// `[limits]`: every [`ResourceLimits`] field, with its defaults. Byte limits take an integer
/// or a string with a binary unit (`"64MiB"`, `"4G"`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSection {
    #[serde(deserialize_with = "byte_count")]
    pub object_bytes_max: u64,
    pub inflight_requests_max: u32,
    pub registrations_max: u32,
    #[serde(deserialize_with = "byte_count")]
    pub tenant_inflight_bytes_max: u64,
    #[serde(deserialize_with = "byte_count")]
    pub retained_bytes_max: u64,
    #[serde(deserialize_with = "byte_count")]
    pub tenant_retained_bytes_max: u64,
    pub tenants_max: u32,
    pub idempotency_entries_max: u32,
    pub idempotency_ttl_ms: u64,
    pub write_lease_ms: u64,
}

impl From<ResourceLimits> for LimitsSection {
    fn from(l: ResourceLimits) -> Self {
        // Destructured so that a new limit fails to compile here until the file can set it.
        let ResourceLimits {
            object_bytes_max,
            inflight_requests_max,
            registrations_max,
            tenant_inflight_bytes_max,
            retained_bytes_max,
            tenant_retained_bytes_max,
            tenants_max,
            idempotency_entries_max,
            idempotency_ttl_ms,
            write_lease_ms,
        } = l;
        Self {
            object_bytes_max,
            inflight_requests_max,
            registrations_max,
            tenant_inflight_bytes_max,
            retained_bytes_max,
            tenant_retained_bytes_max,
            tenants_max,
            idempotency_entries_max,
            idempotency_ttl_ms,
            write_lease_ms,
        }
    }
}

impl From<&LimitsSection> for ResourceLimits {
    fn from(l: &LimitsSection) -> Self {
        ResourceLimits {
            object_bytes_max: l.object_bytes_max,
            inflight_requests_max: l.inflight_requests_max,
            registrations_max: l.registrations_max,
            tenant_inflight_bytes_max: l.tenant_inflight_bytes_max,
            retained_bytes_max: l.retained_bytes_max,
            tenant_retained_bytes_max: l.tenant_retained_bytes_max,
            tenants_max: l.tenants_max,
            idempotency_entries_max: l.idempotency_entries_max,
            idempotency_ttl_ms: l.idempotency_ttl_ms,
            write_lease_ms: l.write_lease_ms,
        }
    }
}

impl Default for LimitsSection {
    fn default() -> Self {
        ResourceLimits::default().into()
    }
}

/// `[listen]`: where the service accepts connections, and how many.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenSection {
    /// The native binary protocol.
    #[serde(deserialize_with = "socket_addr")]
    pub native: SocketAddr,
    /// The RESP (Redis protocol) subset.
    #[serde(deserialize_with = "socket_addr")]
    pub resp: SocketAddr,
    /// The tenant every RESP connection acts as (RESP clients do not name one); the first
    /// `[[tenants]]` entry when unset.
    pub resp_tenant: Option<String>,
    /// HTTP `/metrics` and `/healthz`.
    #[serde(deserialize_with = "socket_addr")]
    pub metrics: SocketAddr,
    /// Whether addresses other than loopback are allowed.
    pub allow_remote: bool,
    /// Client connections open at once, over both protocols.
    pub connections_max: u32,
    /// Whether tenants without a `secret_file` may be served on a native address that is not
    /// loopback (they are trusted on their word).
    pub allow_open_tenants: bool,
    /// How far a HELLO timestamp may be from the server's clock, in milliseconds.
    pub clock_skew_max_ms: u64,
    /// The Unix socket of the same-host shared-memory path (docs/adr/0013). Unset: `gpucache.sock`
    /// inside `store.root` for a file store, none for a memory store; `""`: none; otherwise
    /// the path (relative to the working directory).
    pub local: Option<PathBuf>,
    /// Bytes of client segments the server maps at once, over all local connections.
    #[serde(deserialize_with = "byte_count")]
    pub shm_mapped_bytes_max: u64,
}

impl Default for ListenSection {
    fn default() -> Self {
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Self {
            native: loopback(7470),
            resp: loopback(7471),
            resp_tenant: None,
            metrics: loopback(7472),
            allow_remote: false,
            connections_max: 256,
            allow_open_tenants: false,
            clock_skew_max_ms: u64::try_from(CLOCK_SKEW_MAX_DEFAULT.as_millis()).unwrap_or(0),
            local: None,
            shm_mapped_bytes_max: SHM_MAPPED_BYTES_MAX_DEFAULT,
        }
    }
}

/// `[nixl]`: block staging over NIXL between GPUCache nodes (docs/adr/0018, PROTOCOL.md
/// section 11). Off by default; when `enabled`, `gpucache serve` registers a staging pool of
/// `pool_bytes` with a NIXL agent and answers the stage ops, or refuses to start with the
/// reason NIXL cannot run (never serving without it).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NixlSection {
    pub enabled: bool,
    /// The agent's name, unique among the agents that exchange metadata; `gpucache-<pid>`
    /// when unset.
    pub agent: Option<String>,
    /// Bytes of host memory registered for staging (a whole number of slots).
    #[serde(deserialize_with = "byte_count")]
    pub pool_bytes: u64,
    /// Bytes per slot: the largest block that moves over NIXL.
    #[serde(deserialize_with = "byte_count")]
    pub slot_bytes: u64,
    /// How long a stage's slot is lent; past it the slot is quarantined until a fence.
    pub stage_lease_ms: u64,
    /// Open stages of one connection.
    pub per_connection_max: u32,
    /// Open stages of the whole server.
    pub staged_max: u32,
}

impl Default for NixlSection {
    fn default() -> Self {
        let limits = StagingLimits::default();
        Self {
            enabled: false,
            agent: None,
            pool_bytes: NIXL_POOL_BYTES_DEFAULT,
            slot_bytes: NIXL_SLOT_BYTES_DEFAULT,
            stage_lease_ms: limits.stage_lease_ms,
            per_connection_max: u32::try_from(limits.per_connection_max).unwrap_or(u32::MAX),
            staged_max: u32::try_from(limits.staged_max).unwrap_or(u32::MAX),
        }
    }
}

impl NixlSection {
    /// Slots of the staging pool.
    pub fn slots(&self) -> u64 {
        self.pool_bytes / self.slot_bytes.max(1)
    }

    /// The agent's name: `agent`, or `gpucache-<pid>`.
    pub fn agent_name(&self) -> String {
        self.agent.clone().unwrap_or_else(|| format!("gpucache-{}", std::process::id()))
    }

    /// The stage limits the server enforces.
    pub fn limits(&self) -> StagingLimits {
        StagingLimits {
            per_connection_max: usize::try_from(self.per_connection_max).unwrap_or(usize::MAX),
            staged_max: usize::try_from(self.staged_max).unwrap_or(usize::MAX),
            stage_lease_ms: self.stage_lease_ms,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        in_range("nixl.slot_bytes", self.slot_bytes, NIXL_SLOT_BYTES_MIN, NIXL_SLOT_BYTES_MAX)?;
        in_range("nixl.pool_bytes", self.pool_bytes, self.slot_bytes, POOL_BYTES_MAX)?;
        if !self.pool_bytes.is_multiple_of(self.slot_bytes) {
            return Err(ConfigError::NixlPoolNotWhole {
                pool_bytes: self.pool_bytes,
                slot_bytes: self.slot_bytes,
            });
        }
        in_range("nixl.pool_bytes / nixl.slot_bytes", self.slots(), 1, NIXL_SLOTS_MAX)?;
        in_range("nixl.stage_lease_ms", self.stage_lease_ms, 1, CLOCK_SKEW_MAX_LIMIT_MS)?;
        in_range("nixl.per_connection_max", self.per_connection_max.into(), 1, NIXL_SLOTS_MAX)?;
        in_range(
            "nixl.staged_max",
            self.staged_max.into(),
            self.per_connection_max.into(),
            NIXL_SLOTS_MAX,
        )?;
        if let Some(name) = &self.agent {
            let refuse = |why: String| ConfigError::NixlAgentName { name: name.clone(), why };
            if name.is_empty() {
                return Err(refuse("is empty".into()));
            }
            if name.len() > NIXL_AGENT_BYTES_MAX {
                return Err(refuse(format!("is longer than {NIXL_AGENT_BYTES_MAX} bytes")));
            }
            if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
                return Err(refuse("may hold only letters, digits, '-', '_' and '.'".into()));
            }
        }
        Ok(())
    }
}

/// Default `dpu.state_dir`.
pub const DPU_STATE_DIR_DEFAULT: &str = "./gpucache-dpu";
/// Default `dpu.queue_depth`: submissions one queue holds outstanding.
pub const DPU_QUEUE_DEPTH_DEFAULT: u32 = 64;
/// Default `dpu.slab_slots`: calls in flight across the agent.
pub const DPU_SLAB_SLOTS_DEFAULT: u32 = 64;
/// Default `dpu.slab_lease_ms`.
pub const DPU_SLAB_LEASE_MS_DEFAULT: u64 = 60_000;
/// Default `dpu.op_deadline_ms`.
pub const DPU_OP_DEADLINE_MS_DEFAULT: u64 = 30_000;
/// Default `dpu.slab_slot_bytes`: the largest block the agent carries.
pub const DPU_SLOT_BYTES_DEFAULT: u64 = 4 << 20;
/// Smallest `dpu.slab_slot_bytes`: one page.
pub const DPU_SLOT_BYTES_MIN: u64 = 4096;
/// Largest `dpu.slab_slot_bytes`.
pub const DPU_SLOT_BYTES_MAX: u64 = 1 << 30;
/// Highest core id `[[dpu.reactors]] core` may name (the kernel's `CPU_SETSIZE` less one).
pub const DPU_CORE_MAX: u64 = 1023;

/// `dpu.backend`: what moves the agent's queue bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum DpuBackendName {
    /// Host threads with io_uring: runs anywhere io_uring does; never offload.
    #[serde(rename = "io_uring")]
    IoUring,
    /// SPDK NVMe queues; fails closed at start in this build (no binding).
    #[serde(rename = "spdk")]
    Spdk,
    /// DOCA queues on a BlueField; fails closed at start in this build (no binding).
    #[serde(rename = "doca")]
    Doca,
}

impl DpuBackendName {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IoUring => "io_uring",
            Self::Spdk => "spdk",
            Self::Doca => "doca",
        }
    }
}

/// `dpu.pin`: what to do when a reactor's core cannot be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PinName {
    /// Run that reactor unpinned and report it (`pinned=` leaves its core out).
    BestEffort,
    /// Refuse to start.
    Required,
}

/// One `[[dpu.reactors]]` entry: a reactor thread and the core it is pinned to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpuReactorConfig {
    pub id: u16,
    /// The core to pin to; unset runs the reactor unpinned.
    #[serde(default)]
    pub core: Option<u64>,
}

/// `[dpu]`: the DPU agent `store.kind = "dpu"` runs in-process (docs/OPERATIONS.md). Ignored
/// for other store kinds, but still checked.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpuSection {
    /// Holds the agent's persisted epoch (bumped at every start) and its queue files.
    pub state_dir: PathBuf,
    pub backend: DpuBackendName,
    /// The reactors, each with its core; one unpinned reactor when the list is left out.
    pub reactors: Vec<DpuReactorConfig>,
    /// Queues each reactor owns (a key's queue is chosen by a stable hash of the key).
    pub queues_per_reactor: u32,
    /// Submissions one queue holds outstanding at most.
    pub queue_depth: u32,
    /// Slots of the agent's slab; every call in flight holds one.
    pub slab_slots: u32,
    /// Bytes per slab slot: the largest block the agent carries (larger PUTs are refused as
    /// too large, larger blocks read as misses).
    #[serde(deserialize_with = "byte_count")]
    pub slab_slot_bytes: u64,
    /// How long one call may hold its slab slot before the slot is quarantined.
    pub slab_lease_ms: u64,
    pub pin: PinName,
    /// Longest one call waits for its reactor's completion.
    pub op_deadline_ms: u64,
    /// `backend = "spdk"`: the NVMe controller's PCI address.
    pub spdk_pci_addr: Option<String>,
    /// `backend = "doca"`: the BlueField's RDMA device name.
    pub doca_device: Option<String>,
}

impl Default for DpuSection {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from(DPU_STATE_DIR_DEFAULT),
            backend: DpuBackendName::IoUring,
            reactors: vec![DpuReactorConfig { id: 0, core: None }],
            queues_per_reactor: 1,
            queue_depth: DPU_QUEUE_DEPTH_DEFAULT,
            slab_slots: DPU_SLAB_SLOTS_DEFAULT,
            slab_slot_bytes: DPU_SLOT_BYTES_DEFAULT,
            slab_lease_ms: DPU_SLAB_LEASE_MS_DEFAULT,
            pin: PinName::BestEffort,
            op_deadline_ms: DPU_OP_DEADLINE_MS_DEFAULT,
            spdk_pci_addr: None,
            doca_device: None,
        }
    }
}

impl DpuSection {
    fn validate(&self) -> Result<(), ConfigError> {
        let refuse = |key: String, why: String| Err(ConfigError::Dpu { key, why });
        let reactors_max = gpucache_dpu::REACTORS_MAX as u64;
        in_range("dpu.reactors (entries)", self.reactors.len() as u64, 1, reactors_max)?;
        let mut ids = std::collections::BTreeMap::new();
        for (i, r) in self.reactors.iter().enumerate() {
            if let Some(first) = ids.insert(r.id, i) {
                return refuse(
                    format!("dpu.reactors[{i}].id"),
                    format!("reactor {} is already defined by dpu.reactors[{first}]", r.id),
                );
            }
            if let Some(core) = r.core
                && core > DPU_CORE_MAX
            {
                return refuse(
                    format!("dpu.reactors[{i}].core"),
                    format!("{core} is outside 0..={DPU_CORE_MAX}"),
                );
            }
        }
        let queues_max = (gpucache_dpu::QUEUES_MAX / self.reactors.len()) as u64;
        in_range("dpu.queues_per_reactor", self.queues_per_reactor.into(), 1, queues_max)?;
        in_range(
            "dpu.queue_depth",
            self.queue_depth.into(),
            1,
            gpucache_dpu::QUEUE_DEPTH_MAX as u64,
        )?;
        in_range("dpu.slab_slots", self.slab_slots.into(), 1, gpucache_dpu::SLAB_SLOTS_MAX as u64)?;
        in_range(
            "dpu.slab_slot_bytes",
            self.slab_slot_bytes,
            DPU_SLOT_BYTES_MIN,
            DPU_SLOT_BYTES_MAX,
        )?;
        let slab_bytes = u64::from(self.slab_slots).saturating_mul(self.slab_slot_bytes);
        in_range("dpu.slab_slots * dpu.slab_slot_bytes", slab_bytes, 1, POOL_BYTES_MAX)?;
        in_range("dpu.slab_lease_ms", self.slab_lease_ms, 1, CLOCK_SKEW_MAX_LIMIT_MS)?;
        in_range("dpu.op_deadline_ms", self.op_deadline_ms, 1, CLOCK_SKEW_MAX_LIMIT_MS)?;
        if self.state_dir.as_os_str().is_empty() {
            return refuse("dpu.state_dir".into(), "is empty".into());
        }
        let native = [
            ("dpu.spdk_pci_addr", &self.spdk_pci_addr, DpuBackendName::Spdk),
            ("dpu.doca_device", &self.doca_device, DpuBackendName::Doca),
        ];
        for (key, value, wants) in native {
            match value {
                Some(v) if self.backend != wants => {
                    return refuse(
                        key.into(),
                        format!(
                            "{v:?} is set but dpu.backend is {:?}; it applies to {:?} only",
                            self.backend.as_str(),
                            wants.as_str()
                        ),
                    );
                }
                Some(v) if v.is_empty() => return refuse(key.into(), "is empty".into()),
                None if self.backend == wants => {
                    return refuse(
                        key.into(),
                        format!("required when dpu.backend = {:?}", wants.as_str()),
                    );
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// A right as spelt in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RightName {
    Read,
    Write,
    Admin,
}

impl From<RightName> for Right {
    fn from(r: RightName) -> Self {
        match r {
            RightName::Read => Right::Read,
            RightName::Write => Right::Write,
            RightName::Admin => Right::Admin,
        }
    }
}

/// One `[[tenants]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    pub rights: Vec<RightName>,
    /// The tenant's key file (`<key-id> <hex secret> [not-after]` per line, mode 0600). A
    /// tenant with one must authenticate and seal every frame; one without is open.
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// The seal algorithms the tenant's sessions may use (`"blake3"`, `"hmac-sha256"`); both
    /// when unset.
    #[serde(default)]
    pub seal_algorithms: Option<Vec<String>>,
}

impl TenantConfig {
    pub fn rights(&self) -> Rights {
        let has = |r| self.rights.contains(&r);
        Rights {
            read: has(RightName::Read),
            write: has(RightName::Write),
            admin: has(RightName::Admin),
        }
    }

    /// The seal algorithms the tenant accepts; the name that is not one otherwise.
    pub fn accepted_seals(&self) -> Result<Vec<SealAlgorithm>, String> {
        match &self.seal_algorithms {
            None => Ok(SealAlgorithm::ALL.to_vec()),
            Some(names) if names.is_empty() => Err(String::new()),
            Some(names) => {
                names.iter().map(|n| SealAlgorithm::from_name(n).ok_or_else(|| n.clone())).collect()
            }
        }
    }

    /// The caller this tenant's connections act as.
    pub fn caller(&self) -> Result<Caller, IdentityError> {
        Ok(Caller::new(TenantId::parse(&self.name)?, self.rights()))
    }
}

impl ServeConfig {
    /// Parses and validates a configuration.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates the file at `path`. Relative paths inside it (the store root,
    /// secret files) are taken relative to the working directory, not to the file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let read_err = |source| ConfigError::Read { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(read_err)?;
        let mut text = String::new();
        file.take(CONFIG_BYTES_MAX + 1).read_to_string(&mut text).map_err(read_err)?;
        if text.len() as u64 > CONFIG_BYTES_MAX {
            return Err(ConfigError::TooLarge {
                path: path.to_owned(),
                bytes_max: CONFIG_BYTES_MAX,
            });
        }
        Self::from_toml_str(&text)
    }

    /// Checks everything that can be checked without starting the service: limits, ranges,
    /// addresses, tenants, and that secret files exist.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.limits().validate().map_err(|source| {
            let name = match &source {
                LimitsError::Zero { name } => *name,
                LimitsError::Inconsistent { smaller, .. } => *smaller,
                _ => "",
            };
            ConfigError::Limits { key: join("limits", name), source }
        })?;
        let s = &self.store;
        in_range("store.queue_depth", s.queue_depth.into(), 1, QUEUE_DEPTH_MAX.into())?;
        in_range("store.group_commit_deadline_ms", s.group_commit_deadline_ms, 1, u64::MAX)?;
        let l = &self.listen;
        in_range(
            "listen.connections_max",
            l.connections_max.into(),
            1,
            CONNECTIONS_MAX_LIMIT.into(),
        )?;
        in_range("listen.clock_skew_max_ms", l.clock_skew_max_ms, 1, CLOCK_SKEW_MAX_LIMIT_MS)?;
        in_range(
            "listen.shm_mapped_bytes_max",
            l.shm_mapped_bytes_max,
            SEGMENT_BYTES_MIN,
            u64::MAX,
        )?;
        self.validate_listen()?;
        self.validate_local()?;
        self.nixl.validate()?;
        self.dpu.validate()?;
        self.validate_tenants()?;
        self.resp_tenant().map(|_| ())
    }

    fn validate_listen(&self) -> Result<(), ConfigError> {
        let l = &self.listen;
        let addrs =
            [("listen.native", l.native), ("listen.resp", l.resp), ("listen.metrics", l.metrics)];
        for (i, &(key, addr)) in addrs.iter().enumerate() {
            if !l.allow_remote && !addr.ip().to_canonical().is_loopback() {
                return Err(ConfigError::NotLoopback { key, addr });
            }
            // Port 0 asks the kernel for a fresh port each time, so it never collides.
            if addr.port() != 0
                && let Some(&(other, _)) = addrs[..i].iter().find(|(_, a)| *a == addr)
            {
                return Err(ConfigError::AddressReused { key, other, addr });
            }
        }
        Ok(())
    }

    /// The local socket must fit `sun_path` once made absolute (as the server binds it), and its
    /// directory must exist, unless it is the file store's root, which the service creates.
    fn validate_local(&self) -> Result<(), ConfigError> {
        let Some(path) = self.local_socket() else { return Ok(()) };
        let refuse = |why: String| ConfigError::LocalSocket { path: path.clone(), why };
        let absolute = match std::env::current_dir() {
            Ok(cwd) if path.is_relative() => cwd.join(&path),
            _ => path.clone(),
        };
        let len = absolute.as_os_str().len();
        if len > SOCKET_PATH_BYTES_MAX {
            return Err(refuse(format!(
                "{len} bytes as an absolute path ({}); a Unix socket path holds at most \
                 {SOCKET_PATH_BYTES_MAX}",
                absolute.display()
            )));
        }
        if path.file_name().is_none() {
            return Err(refuse("names no file".into()));
        }
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let store_creates = matches!(self.store.kind, StoreKind::File | StoreKind::Dpu)
            && parent.components().eq(self.store.root.components());
        if !store_creates && !parent.is_dir() {
            return Err(refuse(format!(
                "its directory {} does not exist (only store.root of a file store is created \
                 at start)",
                parent.display()
            )));
        }
        Ok(())
    }

    /// The Unix socket of the same-host path, when there is one: `listen.local`, or
    /// `gpucache.sock` inside `store.root` for a file store when the key is unset.
    pub fn local_socket(&self) -> Option<PathBuf> {
        match &self.listen.local {
            Some(p) if p.as_os_str().is_empty() => None,
            Some(p) => Some(p.clone()),
            None => match self.store.kind {
                StoreKind::File | StoreKind::Dpu => Some(self.store.root.join(LOCAL_SOCKET_NAME)),
                StoreKind::Memory => None,
            },
        }
    }

    fn validate_tenants(&self) -> Result<(), ConfigError> {
        if self.tenants.is_empty() {
            return Err(ConfigError::NoTenants);
        }
        let max = self.limits.tenants_max;
        if self.tenants.len() > usize::try_from(max).unwrap_or(usize::MAX) {
            return Err(ConfigError::TooManyTenants { configured: self.tenants.len(), max });
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let key = |leaf: &str| format!("tenants[{i}].{leaf}");
            TenantId::parse(&t.name)
                .map_err(|source| ConfigError::TenantName { key: key("name"), source })?;
            if let Some(&first) = seen.get(t.name.as_str()) {
                return Err(ConfigError::DuplicateTenant {
                    key: key("name"),
                    name: t.name.clone(),
                    first,
                });
            }
            seen.insert(&t.name, i);
            if t.rights.is_empty() {
                return Err(ConfigError::NoRights { key: key("rights") });
            }
            t.accepted_seals()
                .map_err(|name| ConfigError::SealAlgorithm { key: key("seal_algorithms"), name })?;
            match &t.secret_file {
                Some(path) => {
                    TenantKeys::load(path).map_err(|source| ConfigError::KeyFile {
                        key: key("secret_file"),
                        source,
                    })?;
                }
                None => {
                    let addr = self.listen.native;
                    if !addr.ip().to_canonical().is_loopback() && !self.listen.allow_open_tenants {
                        return Err(ConfigError::OpenTenant {
                            key: key("secret_file"),
                            name: t.name.clone(),
                            addr,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The store's resource limits.
    pub fn limits(&self) -> ResourceLimits {
        (&self.limits).into()
    }

    /// The FileStore this configuration describes (used when `store.kind = "file"`).
    pub fn file_store_config(&self) -> FileStoreConfig {
        let s = &self.store;
        let mut config = FileStoreConfig::new(s.root.clone());
        config.engine = s.engine.into();
        config.engine_config =
            EngineConfig { queue_depth: s.queue_depth, ..EngineConfig::default() };
        config.direct_io = s.direct_io;
        config.durability = s.durability.into();
        config.limits = self.limits();
        config.group_commit_deadline_ms = s.group_commit_deadline_ms;
        config
    }

    /// The `[[tenants]]` entry RESP connections act as: `listen.resp_tenant`, or the first entry.
    fn resp_tenant(&self) -> Result<(usize, &TenantConfig), ConfigError> {
        let found = match &self.listen.resp_tenant {
            None => self.tenants.first().map(|t| (0, t)),
            Some(name) => self.tenants.iter().enumerate().find(|(_, t)| &t.name == name),
        };
        found.ok_or_else(|| match &self.listen.resp_tenant {
            Some(name) => ConfigError::UnknownRespTenant {
                name: name.clone(),
                known: self.tenants.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", "),
            },
            None => ConfigError::NoTenants,
        })
    }

    /// The caller every RESP connection acts as, with that tenant's configured rights.
    pub fn resp_caller(&self) -> Result<Caller, ConfigError> {
        let (i, tenant) = self.resp_tenant()?;
        tenant
            .caller()
            .map_err(|source| ConfigError::TenantName { key: format!("tenants[{i}].name"), source })
    }

    /// The callers the configured tenants act as, in file order.
    pub fn callers(&self) -> Result<Vec<Caller>, ConfigError> {
        self.tenants
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.caller().map_err(|source| ConfigError::TenantName {
                    key: format!("tenants[{i}].name"),
                    source,
                })
            })
            .collect()
    }

    /// The authentication of every tenant with a `secret_file`, keys loaded (and re-read by the
    /// server when the files change).
    pub fn tenant_auth(&self) -> Result<HashMap<TenantId, TenantAuth>, ConfigError> {
        let mut out = HashMap::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let Some(path) = &t.secret_file else { continue };
            let key = |leaf: &str| format!("tenants[{i}].{leaf}");
            let keys = TenantKeys::load(path)
                .map_err(|source| ConfigError::KeyFile { key: key("secret_file"), source })?;
            let accepted = t
                .accepted_seals()
                .map_err(|name| ConfigError::SealAlgorithm { key: key("seal_algorithms"), name })?;
            let tenant = TenantId::parse(&t.name)
                .map_err(|source| ConfigError::TenantName { key: key("name"), source })?;
            out.insert(tenant, TenantAuth { keys: std::sync::Arc::new(keys), accepted });
        }
        Ok(out)
    }

    /// Validates, then opens the configured store.
    pub fn open_store(&self, clock: Arc<dyn Clock>) -> Result<Arc<dyn Store>, ConfigError> {
        self.open(clock).map(|opened| opened.store)
    }

    /// [`Self::open_store`], keeping the DPU store by its type as well (for the agent's offload
    /// report) when `store.kind = "dpu"`.
    pub fn open(&self, clock: Arc<dyn Clock>) -> Result<OpenedStore, ConfigError> {
        self.validate()?;
        let store: Arc<dyn Store> = match self.store.kind {
            StoreKind::Memory => {
                let store = MemoryStore::new(self.limits(), clock)
                    .map_err(|source| ConfigError::Limits { key: "limits".to_owned(), source })?;
                Arc::new(store)
            }
            StoreKind::File => {
                let store = self.file_store_config().open(clock).map_err(|source| {
                    ConfigError::OpenFileStore { root: self.store.root.clone(), source }
                })?;
                let io_engine = Some(IoEngineReport {
                    engine: store.engine_name(),
                    reason: store.engine_reason().to_owned(),
                });
                return Ok(OpenedStore { store: Arc::new(store), dpu: None, io_engine });
            }
            StoreKind::Dpu => {
                let dpu = crate::dpu::open(self, clock)?;
                return Ok(OpenedStore {
                    store: Arc::clone(&dpu) as Arc<dyn Store>,
                    dpu: Some(dpu),
                    io_engine: None,
                });
            }
        };
        Ok(OpenedStore { store, dpu: None, io_engine: None })
    }
}

/// The store a configuration opened.
pub struct OpenedStore {
    pub store: Arc<dyn Store>,
    /// The same store by its type when it is the DPU agent's.
    pub dpu: Option<Arc<gpucache_dpu::DpuStore>>,
    /// The file I/O engine a FileStore runs on, and why (none for other kinds).
    pub io_engine: Option<IoEngineReport>,
}

/// Which I/O engine a FileStore chose, in the operator's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoEngineReport {
    /// "uring" or "psync".
    pub engine: &'static str,
    /// "configured", "probed", or why io_uring could not run.
    pub reason: String,
}

impl std::fmt::Debug for OpenedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpenedStore({})", self.store.info().name)
    }
}

fn in_range(key: &'static str, value: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange { key, value, min, max })
    }
}

fn join(section: &str, leaf: &str) -> String {
    match (section.is_empty(), leaf.is_empty()) {
        (true, _) => leaf.to_owned(),
        (_, true) => section.to_owned(),
        _ => format!("{section}.{leaf}"),
    }
}

/// A TOML error with the key path it is about. The toml crate knows the path but does not
/// expose it, so it is recovered from the error's position: the last table header above it
/// (counting `[[tenants]]` entries) and the key on its line, or the field the message names.
fn parse_error(text: &str, error: &toml::de::Error) -> ConfigError {
    let message = error.message().trim_end().to_owned();
    let start = error.span().map_or(0, |s| s.start).min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_index = text[..line_start].matches('\n').count();
    let column = text[line_start..start].chars().count() + 1;

    let mut section = String::new();
    let mut arrays: HashMap<String, usize> = HashMap::new();
    let mut error_line_is_header = false;
    for (i, raw) in text.lines().take(line_index + 1).enumerate() {
        let line = raw.trim_start();
        let header = if let Some(rest) = line.strip_prefix("[[") {
            rest.split("]]").next().map(|name| {
                let name = name.trim().to_owned();
                let n = arrays.entry(name.clone()).or_default();
                *n += 1;
                format!("{name}[{}]", *n - 1)
            })
        } else if let Some(rest) = line.strip_prefix('[') {
            rest.split(']').next().map(|name| name.trim().to_owned())
        } else {
            None
        };
        if let Some(h) = header {
            section = h;
            error_line_is_header = i == line_index;
        } else if i == line_index {
            error_line_is_header = false;
        }
    }

    let named = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.split('`').next());
    let leaf = if error_line_is_header {
        // An unknown section is named by its own header; a missing field by the message.
        match named {
            Some(field) if message.starts_with("missing") => field.to_owned(),
            _ => {
                let key = section.rsplit('.').next().unwrap_or_default().to_owned();
                section = section[..section.len() - key.len()].trim_end_matches('.').to_owned();
                key
            }
        }
    } else {
        let line = &text[line_start..];
        let line = line.split('\n').next().unwrap_or_default();
        match (named, line.find('=')) {
            (Some(field), _) => field.to_owned(),
            (None, Some(eq)) => line[..eq].trim().trim_matches('"').to_owned(),
            (None, None) => String::new(),
        }
    };
    ConfigError::Parse { key: join(&section, &leaf), message, line: line_index + 1, column }
}

/// Deserializes a byte count from an integer or a string with a binary unit.
fn byte_count<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    struct ByteCount;
    impl Visitor<'_> for ByteCount {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a byte count: an integer, or a string such as \"64MiB\" or \"4G\"")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom(format!("{v} is negative")))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            parse_bytes(v).map_err(E::custom)
        }
    }
    d.deserialize_any(ByteCount)
}

/// Deserializes `IP:port`. Host names are refused rather than resolved: what the service binds
/// must not depend on a resolver at start time.
fn socket_addr<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(|_| {
        de::Error::custom(format!(
            "{text:?} is not IP:port (such as \"127.0.0.1:7470\" or \"[::1]:7470\"); \
             host names are not resolved"
        ))
    })
}

/// `4096`, `"64K"`, `"64KiB"`, `"1M"`, `"4GiB"`, `"1T"`: binary units, as fio reads them.
fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("{text:?} is not a byte count"))?;
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        other => return Err(format!("{text:?}: unknown unit {other:?} (use K, M, G or T)")),
    };
    n.checked_mul(1 << shift).ok_or_else(|| format!("{text:?} does not fit in 64 bits"))
}
