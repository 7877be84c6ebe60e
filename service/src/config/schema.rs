//! The file's shape: every section and key, each with its one default.
//!
//! A default is stated once, here or in the library the value is handed to (the FileStore's
//! engine settings, the server's connection and clock defaults, the staging limits, the DPU
//! agent's lease and deadline), and the sections' `Default` impls read it from there. The
//! example file and `docs/OPERATIONS.md` are checked against these impls by the tests.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::de::{byte_count, parse_error, socket_addr, tagged};
use super::error::ConfigError;
use crate::bounds::ConnectionBounds;
use crate::server::ServerConfig;
use gpucache_dataplane::caller::{Caller, Right, Rights};
use gpucache_dataplane::identity::{IdentityError, TenantId};
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dpu::{DpuStoreConfig, SlabConfig};
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::{EngineChoice, EngineConfig};
use gpucache_storage::file::{Durability, FileStoreConfig, Layout};
use gpucache_storage::tiered::{
    MemoryTier, TierMemory, WRITE_BACK_DIRTY_AGE_DEFAULT_MS, WRITE_BACK_DIRTY_BYTES_DEFAULT,
    WriteBackWindow, WriteMode,
};
use gpucache_wire::SealAlgorithm;
use gpucache_wire::staging::StagingLimits;

/// Default `store.root`.
pub const STORE_ROOT_DEFAULT: &str = "./gpucache-data";
/// Default `listen.native`.
pub const NATIVE_ADDR_DEFAULT: SocketAddr = loopback(7470);
/// Default `listen.resp`.
pub const RESP_ADDR_DEFAULT: SocketAddr = loopback(7471);
/// Default `listen.metrics`.
pub const METRICS_ADDR_DEFAULT: SocketAddr = loopback(7472);
/// The tenant of the embedded default, and the one client commands act as unless told.
pub const TENANT_DEFAULT: &str = "default";
/// The local socket's name inside `store.root` when `listen.local` is not set.
pub const LOCAL_SOCKET_NAME: &str = "gpucache.sock";
/// Default `nixl.slot_bytes`: the largest block that moves over NIXL.
pub const NIXL_SLOT_BYTES_DEFAULT: u64 = 4 << 20;
/// Default `nixl.pool_bytes`: 64 slots of the default size.
pub const NIXL_POOL_BYTES_DEFAULT: u64 = 256 << 20;
/// Default `dpu.state_dir`.
pub const DPU_STATE_DIR_DEFAULT: &str = "./gpucache-dpu";
/// Default `dpu.queue_depth`: submissions one queue holds outstanding.
pub const DPU_QUEUE_DEPTH_DEFAULT: u32 = 64;
/// Default `dpu.slab_slots`: calls in flight across the agent.
pub const DPU_SLAB_SLOTS_DEFAULT: u32 = 64;
/// Default `dpu.slab_slot_bytes`: the largest block the agent carries.
pub const DPU_SLOT_BYTES_DEFAULT: u64 = 4 << 20;

const fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

/// Milliseconds of a library default, as the file spells durations.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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
    pub cluster: ClusterSection,
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
                name: TENANT_DEFAULT.to_owned(),
                rights: vec![RightName::Read, RightName::Write],
                secret_file: None,
                seal_algorithms: None,
                cold_retention_s: None,
            }],
            nixl: NixlSection::default(),
            dpu: DpuSection::default(),
            cluster: ClusterSection::default(),
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
    /// A memory tier over a file store under `root` (`[[store.tiers]]`; the `[store]` file keys
    /// apply to the file tier).
    Tiered,
}

/// One `[[store.tiers]]` section of a tiered store, the memory tier first: its `kind` and the
/// keys of that kind only. A key of another kind's tier is refused when the file is read, as an
/// unknown field of this tier.
#[allow(clippy::large_enum_variant)] // read once, at most three of them: the size is nothing
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierSection {
    Memory(MemoryTierSection),
    File(FileTierSection),
    S3(S3TierSection),
}

impl TierSection {
    pub fn kind(&self) -> TierKind {
        match self {
            Self::Memory(_) => TierKind::Memory,
            Self::File(_) => TierKind::File,
            Self::S3(_) => TierKind::S3,
        }
    }

    /// The tier's `capacity`; the s3 tier has none (it holds what its bucket holds).
    pub fn capacity(&self) -> Option<u64> {
        match self {
            Self::Memory(t) => t.capacity,
            Self::File(t) => t.capacity,
            Self::S3(_) => None,
        }
    }

    /// The tier's `eviction`; the s3 tier has none.
    pub fn eviction(&self) -> Option<Eviction> {
        match self {
            Self::Memory(t) => t.eviction,
            Self::File(t) => t.eviction,
            Self::S3(_) => None,
        }
    }
}

impl<'de> Deserialize<'de> for TierSection {
    /// Tagged by `kind`, as `#[serde(tag = "kind")]` would read it, but keeping the position of
    /// an error: serde's tagged enums read the table whole and report a bad value at the whole
    /// `tiers` array, naming neither the tier nor the key (see `de::tagged`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Tier;
        impl<'de> serde::de::Visitor<'de> for Tier {
            type Value = TierSection;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a tier's table, with its `kind`")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<TierSection, A::Error> {
                let (kind, keys) = tagged(map, "kind")?;
                match kind {
                    TierKind::Memory => keys.read().map(TierSection::Memory),
                    TierKind::File => keys.read().map(TierSection::File),
                    TierKind::S3 => keys.read().map(TierSection::S3),
                }
            }
        }
        d.deserialize_map(Tier)
    }
}

/// `[[store.tiers]] kind = "memory"`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryTierSection {
    /// Bytes the tier holds at most (default: a quarter of the machine's RAM, at most 4 GiB).
    #[serde(default, deserialize_with = "super::de::optional_byte_count")]
    pub capacity: Option<u64>,
    /// The tier's eviction policy (default `"prefix"`); `"refuse"` is not a tier's choice.
    #[serde(default, deserialize_with = "eviction")]
    pub eviction: Option<Eviction>,
    /// Copy a block up when a GET finds it in the file tier (default true).
    #[serde(default)]
    pub promote: Option<bool>,
    /// How a PUT reaches the file tier, `"through"` (default) or `"back"`.
    #[serde(default, deserialize_with = "write_mode")]
    pub write: Option<WriteMode>,
    /// Write-back: payload bytes of acknowledged blocks without a file, at most (default
    /// 256 MiB); a PUT past it is written through.
    #[serde(default, deserialize_with = "super::de::optional_byte_count")]
    pub write_back_dirty_max: Option<u64>,
    /// Write-back: how long an acknowledged block waits for its file, at most (default 5 s).
    #[serde(default)]
    pub write_back_age_max_ms: Option<u64>,
    /// What holds the blocks, `"mapped"` (default), `"huge-pages"` or `"heap"`.
    #[serde(default)]
    pub memory: Option<TierMemoryName>,
}

/// `[[store.tiers]] kind = "file"`: the file store under `store.root` (the `[store]` file keys
/// apply to it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTierSection {
    /// Bytes the tier holds at most (default `limits.retained_bytes_max`).
    #[serde(default, deserialize_with = "super::de::optional_byte_count")]
    pub capacity: Option<u64>,
    /// The tier's eviction policy (default `"prefix"`); `"refuse"` is not a tier's choice.
    #[serde(default, deserialize_with = "eviction")]
    pub eviction: Option<Eviction>,
}

/// `[[store.tiers]] kind = "s3"`: packs on an S3-compatible object store, below the file tier.
/// Credentials come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3TierSection {
    /// The bucket (required).
    pub bucket: String,
    /// The bucket's endpoint (`http://127.0.0.1:9000`); AWS itself when left out.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The region (default `"us-east-1"`).
    #[serde(default)]
    pub region: Option<String>,
    /// The folder of the tier's objects in the bucket (default `"gpucache"`).
    #[serde(default)]
    pub prefix: Option<String>,
    /// How long one object store call may take (default 10,000).
    #[serde(default)]
    pub request_timeout_ms: Option<u64>,
    /// How long blocks are kept after their pack is written; 0 (default) keeps them until
    /// reclaimed.
    #[serde(default)]
    pub retention_s: Option<u64>,
    /// Bytes one GET's refill may bring down (default 64 MiB).
    #[serde(default, deserialize_with = "super::de::optional_byte_count")]
    pub refill_bytes_max: Option<u64>,
    /// How long one GET's refill may take (default 2,000).
    #[serde(default)]
    pub refill_within_ms: Option<u64>,
    /// How long refills stay misses, calling nothing, after the store failed one (default
    /// 1,000).
    #[serde(default)]
    pub degrade_ms: Option<u64>,
    /// Jobs (open packs, queued and failed) the sink holds at most (default 1,024).
    #[serde(default)]
    pub queue_jobs_max: Option<usize>,
    /// Bytes the sink holds at most (default 1 GiB).
    #[serde(default, deserialize_with = "super::de::optional_byte_count")]
    pub queue_bytes_max: Option<u64>,
    /// A pack is sealed at this size (default 8 MiB).
    #[serde(default, deserialize_with = "super::de::optional_byte_count")]
    pub pack_bytes: Option<u64>,
    /// Pause between drain rounds (default 200).
    #[serde(default)]
    pub drain_interval_ms: Option<u64>,
    /// How long a pack may fill before a drain round seals it (default 1,000).
    #[serde(default)]
    pub pack_open_ms: Option<u64>,
    /// Pause between reclaims of expired packs; 0 reclaims never (default 600).
    #[serde(default)]
    pub reclaim_interval_s: Option<u64>,
}

/// `[[store.tiers]] memory`: what backs the memory tier's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TierMemoryName {
    Mapped,
    HugePages,
    Heap,
}

impl From<TierMemoryName> for TierMemory {
    fn from(m: TierMemoryName) -> Self {
        match m {
            TierMemoryName::Mapped => TierMemory::Mapped,
            TierMemoryName::HugePages => TierMemory::HugePages,
            TierMemoryName::Heap => TierMemory::Heap,
        }
    }
}

/// `[[store.tiers]] write`: a write mode's name.
fn write_mode<'de, D: Deserializer<'de>>(d: D) -> Result<Option<WriteMode>, D::Error> {
    let name = String::deserialize(d)?;
    name.parse().map(Some).map_err(serde::de::Error::custom)
}

/// What a tier keeps its blocks in: a `[[store.tiers]]` section's `kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TierKind {
    Memory,
    File,
    /// Packs on an S3-compatible object store, below the file tier.
    S3,
}

/// The memory tier's capacity when none is given: a quarter of the machine's memory, at most
/// this.
pub const MEMORY_TIER_BYTES_MAX: u64 = 4 << 30;

/// The memory tier's capacity when none is given and the machine does not say how much memory
/// it has.
pub const MEMORY_TIER_BYTES_UNKNOWN_RAM: u64 = 1 << 30;

/// A quarter of `MemTotal` in /proc/meminfo, at most [`MEMORY_TIER_BYTES_MAX`];
/// [`MEMORY_TIER_BYTES_UNKNOWN_RAM`] when the machine does not say.
pub fn memory_tier_default_bytes() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    });
    total.map_or(MEMORY_TIER_BYTES_UNKNOWN_RAM, |t| (t / 4).min(MEMORY_TIER_BYTES_MAX))
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

/// `store.layout`: where the file store keeps blocks (ADR 0026).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayoutName {
    Files,
    Log,
}

impl From<LayoutName> for Layout {
    fn from(l: LayoutName) -> Self {
        match l {
            LayoutName::Files => Layout::Files,
            LayoutName::Log => Layout::Log,
        }
    }
}

/// `[store]`. The keys after `kind` apply to the file store only, but `preallocate`, which
/// applies to the memory store only, and `eviction`, which applies to both.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    pub kind: StoreKind,
    pub root: PathBuf,
    pub engine: EngineName,
    pub direct_io: bool,
    pub durability: DurabilityName,
    /// Unset: the block log, or a file per block under `direct_io` (see [`Self::layout`]).
    pub layout: Option<LayoutName>,
    pub queue_depth: u32,
    pub group_commit_deadline_ms: u64,
    /// `kind = "memory"`: map and fault in `limits.retained_bytes_max` of memory at start, so
    /// that no PUT faults a page in (or waits for the kernel to zero one).
    pub preallocate: bool,
    /// What a full store does: `"refuse"` (memory only) or the eviction policy it gives
    /// blocks up by. Unset: `"refuse"` for memory, `"fifo"` for file and dpu.
    #[serde(deserialize_with = "eviction")]
    pub eviction: Option<Eviction>,
    /// `kind = "tiered"`: the tiers, memory first then file; none means a memory tier of
    /// [`memory_tier_default_bytes`] over the file tier, both on `"prefix"`.
    pub tiers: Vec<TierSection>,
}

/// `store.eviction`: `"refuse"` or an eviction policy's name.
fn eviction<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Eviction>, D::Error> {
    let name = String::deserialize(d)?;
    if name == "refuse" {
        return Ok(Some(Eviction::Refuse));
    }
    name.parse()
        .map(|p| Some(Eviction::Policy(p)))
        .map_err(|e| serde::de::Error::custom(format!("{e}, or \"refuse\"")))
}

/// `store.eviction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// Refuse new blocks while full (the memory store's default).
    Refuse,
    /// Give committed blocks up in this policy's order.
    Policy(PolicyKind),
}

impl StoreSection {
    /// Where the file store keeps blocks, defaults applied: `store.layout`, else the block log,
    /// or a file per block under `direct_io` (which the log's records cannot use).
    pub fn layout(&self) -> LayoutName {
        self.layout.unwrap_or(if self.direct_io { LayoutName::Files } else { LayoutName::Log })
    }

    /// What the configured store does when full, defaults applied.
    /// For a tiered store this is the file tier's policy: its `[[store.tiers]]` section's,
    /// else `store.eviction`, else `"prefix"`.
    pub fn eviction(&self) -> Eviction {
        let tier = self.tier(TierKind::File).and_then(TierSection::eviction);
        match self.kind {
            StoreKind::Memory => self.eviction.unwrap_or(Eviction::Refuse),
            StoreKind::File | StoreKind::Dpu => {
                self.eviction.unwrap_or(Eviction::Policy(PolicyKind::Fifo))
            }
            StoreKind::Tiered => {
                tier.or(self.eviction).unwrap_or(Eviction::Policy(PolicyKind::Prefix))
            }
        }
    }

    /// The section of the tier of `kind`, when the configuration has one.
    pub fn tier(&self, kind: TierKind) -> Option<&TierSection> {
        self.tiers.iter().find(|t| t.kind() == kind)
    }

    /// The s3 tier's section, when the configuration has one.
    pub fn s3_tier(&self) -> Option<&S3TierSection> {
        self.tiers.iter().find_map(|t| match t {
            TierSection::S3(s3) => Some(s3),
            _ => None,
        })
    }

    /// The memory tier of a tiered store, defaults applied.
    pub fn memory_tier(&self) -> MemoryTier {
        let unset = MemoryTierSection::default();
        let section = match self.tier(TierKind::Memory) {
            Some(TierSection::Memory(m)) => m,
            _ => &unset,
        };
        MemoryTier {
            capacity_bytes: section.capacity.unwrap_or_else(memory_tier_default_bytes),
            policy: match section.eviction {
                Some(Eviction::Policy(p)) => p,
                _ => PolicyKind::Prefix,
            },
            promote: section.promote.unwrap_or(true),
            write: section.write.unwrap_or_default(),
            window: WriteBackWindow {
                dirty_bytes_max: section
                    .write_back_dirty_max
                    .unwrap_or(WRITE_BACK_DIRTY_BYTES_DEFAULT),
                dirty_age_max_ms: section
                    .write_back_age_max_ms
                    .unwrap_or(WRITE_BACK_DIRTY_AGE_DEFAULT_MS),
            },
            backing: section.memory.map(TierMemory::from).unwrap_or_default(),
        }
    }
}

impl Default for StoreSection {
    fn default() -> Self {
        let file = FileStoreConfig::new(STORE_ROOT_DEFAULT);
        Self {
            kind: StoreKind::Tiered,
            root: file.root,
            engine: EngineName::Auto,
            direct_io: file.direct_io,
            durability: DurabilityName::PerBlock,
            layout: None,
            queue_depth: file.engine_config.queue_depth,
            group_commit_deadline_ms: file.group_commit_deadline_ms,
            preallocate: false,
            eviction: None,
            tiers: Vec::new(),
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
    /// Client connections open at once, on each client listener.
    pub connections_max: u32,
    /// Client connections one IP address may hold open at once, over both client listeners.
    pub connections_per_peer_max: u32,
    /// Request-body bytes buffered at once over every client connection (charged before they
    /// are buffered); a request past it is refused and its connection closed.
    #[serde(deserialize_with = "byte_count")]
    pub inflight_body_bytes_max: u64,
    /// The share of `inflight_body_bytes_max` the connections of one IP address may hold.
    #[serde(deserialize_with = "byte_count")]
    pub peer_inflight_body_bytes_max: u64,
    /// Once a request's first byte arrived, the whole request must within this long, in
    /// milliseconds, or the connection is closed.
    pub body_timeout_ms: u64,
    /// A connection that must authenticate (native HELLO, RESP AUTH for a tenant with keys)
    /// and has not within this long, in milliseconds, is closed.
    pub hello_timeout_ms: u64,
    /// A connection with no complete request for this long, in milliseconds, is closed.
    pub idle_timeout_ms: u64,
    /// A response the client does not take whole within this long, in milliseconds, closes the
    /// connection.
    pub write_timeout_ms: u64,
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
        // The native listener's own defaults; the RESP listener is given the same bound.
        let server = ServerConfig::new(NATIVE_ADDR_DEFAULT, Vec::new());
        let bounds = ConnectionBounds::default();
        Self {
            native: NATIVE_ADDR_DEFAULT,
            resp: RESP_ADDR_DEFAULT,
            resp_tenant: None,
            metrics: METRICS_ADDR_DEFAULT,
            allow_remote: false,
            connections_max: server.connections_max,
            connections_per_peer_max: bounds.connections_per_peer_max,
            inflight_body_bytes_max: bounds.inflight_body_bytes_max,
            peer_inflight_body_bytes_max: bounds.peer_inflight_body_bytes_max,
            body_timeout_ms: millis(bounds.body_timeout),
            hello_timeout_ms: millis(bounds.hello_timeout),
            idle_timeout_ms: millis(server.idle_timeout),
            write_timeout_ms: millis(server.write_timeout),
            allow_open_tenants: false,
            clock_skew_max_ms: millis(server.clock_skew_max),
            local: None,
            shm_mapped_bytes_max: server.shm_mapped_bytes_max,
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
}

/// `[cluster]`: this server as a node of a cluster on etcd (docs/OPERATIONS.md, "Running a
/// cluster"). Off while `etcd` is empty: the server runs alone.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// etcd client URLs, every member of the etcd cluster (`http://127.0.0.1:2379`).
    pub etcd: Vec<String>,
    /// The cluster's name: its records sit under `/gpucache/<name>/` in etcd.
    pub name: String,
    /// This node's number, unique in the cluster (at least 1).
    pub node: u64,
    /// Where clients reach this node's native listener; `listen.native` when unset.
    pub advertise: Option<String>,
    /// The fault domain the node fails with (a rack, a host, a power feed).
    pub fault_domain: String,
    /// Seconds the registration lasts without a renewal.
    pub lease_ttl_s: u64,
    /// How often the node reads the view and checks its lease.
    pub poll_ms: u64,
    /// How long one etcd call may take.
    pub request_timeout_ms: u64,
    /// Admitted keys the node remembers (so that a view that moves one drops its block).
    pub held_keys_max: u64,
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            etcd: Vec::new(),
            name: "gpucache".to_owned(),
            node: 0,
            advertise: None,
            fault_domain: "default".to_owned(),
            lease_ttl_s: gpucache_cluster::LEASE_TTL_S_DEFAULT,
            poll_ms: gpucache_cluster::POLL_MS_DEFAULT,
            request_timeout_ms: gpucache_cluster::REQUEST_TIMEOUT_MS_DEFAULT,
            held_keys_max: gpucache_dataplane::shard::HELD_KEYS_MAX_DEFAULT as u64,
        }
    }
}

impl ClusterSection {
    /// Whether the server is a node of a cluster.
    pub fn enabled(&self) -> bool {
        !self.etcd.is_empty()
    }
}

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
            slab_lease_ms: SlabConfig::default().lease_ms,
            pin: PinName::BestEffort,
            op_deadline_ms: millis(DpuStoreConfig::default().op_deadline),
            spdk_pci_addr: None,
            doca_device: None,
        }
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
    /// With an s3 tier: how long this tenant's packs are kept (0: until reclaimed); the tier's
    /// `retention_s` when unset.
    #[serde(default)]
    pub cold_retention_s: Option<u64>,
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
    /// Parses a configuration without checking it (see `validate`): a malformed file, an
    /// unknown key or a value of the wrong type is refused here, naming its key path.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| parse_error(text, &e))
    }

    /// The store's resource limits.
    pub fn limits(&self) -> ResourceLimits {
        (&self.limits).into()
    }

    /// The FileStore this configuration describes (used when `store.kind` is `"file"` or
    /// `"dpu"`).
    pub fn file_store_config(&self) -> FileStoreConfig {
        let s = &self.store;
        let mut config = FileStoreConfig::new(s.root.clone());
        config.engine = s.engine.into();
        config.engine_config =
            EngineConfig { queue_depth: s.queue_depth, ..EngineConfig::default() };
        config.direct_io = s.direct_io;
        config.durability = s.durability.into();
        config.layout = s.layout().into();
        config.limits = self.limits();
        if s.kind == StoreKind::Tiered
            && let Some(capacity) = s.tier(TierKind::File).and_then(TierSection::capacity)
        {
            let l = &mut config.limits;
            l.retained_bytes_max = capacity;
            l.tenant_retained_bytes_max = l.tenant_retained_bytes_max.min(capacity);
        }
        config.group_commit_deadline_ms = s.group_commit_deadline_ms;
        if let Eviction::Policy(policy) = s.eviction() {
            config.policy = policy;
        }
        config
    }

    /// The Unix socket of the same-host path, when there is one: `listen.local`, or
    /// `gpucache.sock` inside `store.root` for a file store when the key is unset.
    pub fn local_socket(&self) -> Option<PathBuf> {
        match &self.listen.local {
            Some(p) if p.as_os_str().is_empty() => None,
            Some(p) => Some(p.clone()),
            None => match self.store.kind {
                StoreKind::File | StoreKind::Dpu | StoreKind::Tiered => {
                    Some(self.store.root.join(LOCAL_SOCKET_NAME))
                }
                StoreKind::Memory => None,
            },
        }
    }
}
