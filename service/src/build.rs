//! From a [`ValidConfig`] to a running [`Service`], in one step: [`ValidConfig::build`].
//!
//! What it builds, in order: a check that every configured TCP port is free (before the disk is
//! touched), the block staging `[nixl]` asks for, the store (`[store]`, with the DPU agent in
//! front when `kind = "dpu"`), the metrics registry with the agent's offload report, the
//! staging gauges and the limits, the readiness checks, the metered store, then the native
//! listener with its same-host Unix socket (mode [`LOCAL_SOCKET_MODE`]), the RESP listener and
//! the HTTP endpoint. No executor is started: the service calls its store directly. A store
//! root that the build created is removed again when a later step fails.
//!
//! Threads the build starts (listeners, the NIXL agent's, the DPU reactors) inherit the
//! caller's signal mask, so `serve` blocks its stop signals before it builds.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpucache_cluster::{Coordinator, EtcdConfig, NodeConfig, NodeEvents, Registration};
use gpucache_cold::{
    ColdConfig, ColdLayerConfig, ColdSink, ColdTier, ColdTiered, RefillBudget, S3Config, S3Objects,
    SinkLimits,
};
use gpucache_dataplane::clock::{Clock, MonotonicClock, UnixClock};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::limits::LimitsError;
use gpucache_dataplane::registry::LocalEpochs;
use gpucache_dataplane::shard::NodeId;
use gpucache_dataplane::store::Store;
use gpucache_dpu::{DpuStore, DpuStoreConfig};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::FileStoreError;
use gpucache_storage::host::arena::PayloadArena;
use gpucache_storage::memory::MemoryOptions;
use gpucache_storage::tiered::{TieredError, TieredStore, WriteMode};
use gpucache_wire::staging::BlockStaging;
use prometheus_client::registry::Registry;

use crate::bounds::{ConnectionBounds, Guard, GuardGauges, Refusals, fix_malloc_mmap_threshold};
use crate::cluster::{ClusterNode, FencedStore};
use crate::cold_metrics::ColdSeries;
use crate::config::{
    ClusterSection, Eviction, S3TierSection, StoreKind, TenantConfig, ValidConfig,
};
use crate::dpu::{self, DpuStartError};
use crate::fills::Fills;
use crate::http::MetricsServer;
use crate::metered::{MeteredStore, Metrics, StagingGauges, register_limits};
use crate::ready::{Check, Probe};
use crate::resp::{RespConfig, RespLimits, RespServer};
use crate::server::{Server, ServerConfig};
use crate::tier_metrics::TierSeries;

/// Mode of the local socket after binding: the service's user and group may connect.
pub const LOCAL_SOCKET_MODE: u32 = 0o660;

/// How long a cold pack may fill before a drain round seals it, unless configured otherwise.
pub const PACK_OPEN_MS_DEFAULT: u64 = 1_000;

/// How long the stop gives the cold tier's sink to store what it holds.
pub const COLD_CLOSE_WITHIN: Duration = Duration::from_secs(10);

/// The cold tier the s3 section describes, opened on its bucket (listed, every manifest read
/// and checked) with each tenant's `cold_retention_s` recorded; its refill budget.
fn open_cold_tier(
    section: &S3TierSection,
    tenants: &[TenantConfig],
) -> Result<(ColdTier, gpucache_cold::OpenReport, RefillBudget), StoreOpenError> {
    let bucket = section.bucket.clone();
    let failed = |source| StoreOpenError::Cold { bucket: bucket.clone(), source };
    let mut s3 = S3Config::new(bucket.clone());
    s3.endpoint = section.endpoint.clone();
    if let Some(region) = &section.region {
        s3.region = region.clone();
    }
    if let Some(ms) = section.request_timeout_ms {
        s3.request_timeout_ms = ms;
    }
    let objects = Arc::new(S3Objects::open(&s3).map_err(failed)?);
    let defaults = ColdConfig::default();
    let refill = RefillBudget {
        bytes_max: section.refill_bytes_max.unwrap_or(defaults.refill.bytes_max),
        within: section.refill_within_ms.map_or(defaults.refill.within, Duration::from_millis),
    };
    let config = ColdConfig {
        prefix: section.prefix.clone().unwrap_or(defaults.prefix),
        retention_s: section.retention_s.unwrap_or(defaults.retention_s),
        degrade_ms: section.degrade_ms.unwrap_or(defaults.degrade_ms),
        refill,
        ..defaults
    };
    let (tier, report) = ColdTier::open(objects, config, Arc::new(UnixClock)).map_err(failed)?;
    for t in tenants {
        if let (Some(retention_s), Ok(tenant)) = (t.cold_retention_s, TenantId::parse(&t.name)) {
            tier.record_retention(&tenant, retention_s);
        }
    }
    Ok((tier, report, refill))
}

/// Opens the s3 tier `section` describes below `upper`: the bucket is listed (every manifest
/// read and checked) before the service starts, so an unreachable or unreadable bucket stops
/// the start with its reason.
fn open_cold(
    section: &S3TierSection,
    tenants: &[TenantConfig],
    upper: Arc<TieredStore>,
) -> Result<ColdTiered, StoreOpenError> {
    let bucket = section.bucket.clone();
    let failed = |source| StoreOpenError::Cold { bucket: bucket.clone(), source };
    let (tier, report, refill) = open_cold_tier(section, tenants)?;
    tracing::info!(
        bucket = %bucket,
        manifests = report.manifests,
        blocks = report.blocks,
        legacy_manifests = report.legacy,
        damaged_manifests = report.damaged,
        retired_tenants = report.retired_tenants,
        "cold tier opened"
    );
    let sink_defaults = SinkLimits::default();
    let limits = SinkLimits {
        jobs_max: section.queue_jobs_max.unwrap_or(sink_defaults.jobs_max),
        bytes_max: section.queue_bytes_max.unwrap_or(sink_defaults.bytes_max),
        pack_bytes_target: section.pack_bytes.unwrap_or(sink_defaults.pack_bytes_target),
        pack_open_ms_max: section.pack_open_ms.unwrap_or(PACK_OPEN_MS_DEFAULT),
        ..sink_defaults
    };
    let layer_defaults = ColdLayerConfig::default();
    let layer = ColdLayerConfig {
        refill,
        drain_interval_ms: section.drain_interval_ms.unwrap_or(layer_defaults.drain_interval_ms),
        reclaim_interval_s: section.reclaim_interval_s.unwrap_or(layer_defaults.reclaim_interval_s),
    };
    ColdTiered::new(upper, Arc::new(tier), Arc::new(ColdSink::new(limits)), layer)
        .map_err(|e| failed(gpucache_cold::ColdError::Config(format!("drain thread: {e}"))))
}

/// Why the configured store did not open. Display starts with the key it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreOpenError {
    #[error("store.root: cannot open the file store at {root}: {source}")]
    FileStore { root: PathBuf, source: FileStoreError },
    #[error("limits: {source}")]
    Memory { source: LimitsError },
    /// `store.preallocate`: the kernel refused the mapping.
    #[error("store.preallocate: cannot map {bytes} bytes for the memory store: {source}")]
    Preallocate { bytes: u64, source: std::io::Error },
    /// `[[store.tiers]] memory`: the kernel refused the memory tier's mapping.
    #[error("store.tiers: cannot map {bytes} bytes for the memory tier: {source}")]
    TierMapping { bytes: u64, source: std::io::Error },
    /// `[[store.tiers]] kind = "s3"`: the bucket could not be reached or read at start (the
    /// service does not start without the cold tier it was told to run).
    #[error("store.tiers: the s3 tier (bucket {bucket}): {source}")]
    Cold { bucket: String, source: gpucache_cold::ColdError },
    /// The DPU agent did not start (before the file store behind it is opened).
    #[error(transparent)]
    Dpu(#[from] DpuStartError),
    /// `[[store.tiers]] write = "back"`: the thread that writes waiting blocks did not start.
    #[error("store.tiers: cannot start the write-back flusher: {source}")]
    Flusher { source: std::io::Error },
}

impl StoreOpenError {
    /// The key path the error is about.
    pub fn key(&self) -> &'static str {
        match self {
            Self::FileStore { .. } => "store.root",
            Self::Memory { .. } => "limits",
            Self::Preallocate { .. } => "store.preallocate",
            Self::TierMapping { .. } | Self::Cold { .. } | Self::Flusher { .. } => "store.tiers",
            Self::Dpu(e) => e.key(),
        }
    }
}

/// Why a validated configuration did not become a running service. Display says which step
/// failed and why (the words `gpucache serve` logs after its own name).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A configured TCP port is taken; found before the store is opened.
    #[error("listen: {listener} {addr}: {source}")]
    PortInUse { listener: &'static str, addr: SocketAddr, source: io::Error },
    /// `[nixl] enabled = true` and NIXL cannot run here: the service never starts without the
    /// staging it was told to offer.
    #[error("nixl.enabled: {0}")]
    Staging(String),
    #[error("store: {0}")]
    Store(#[from] StoreOpenError),
    #[error("native listener {addr}{}: {source}", local_words(.local.as_deref()))]
    Native { addr: SocketAddr, local: Option<PathBuf>, source: io::Error },
    #[error("local socket {}: chmod {LOCAL_SOCKET_MODE:o}: {source}", .path.display())]
    LocalSocketMode { path: PathBuf, source: io::Error },
    #[error("RESP key namespace: {0}")]
    RespNamespace(String),
    #[error("RESP listener {addr}: {source}")]
    Resp { addr: SocketAddr, source: io::Error },
    #[error("metrics listener {addr}: {source}")]
    Metrics { addr: SocketAddr, source: io::Error },
    /// `[cluster]` is configured and the node could not register (etcd unreachable, a view it
    /// cannot read, a refused change).
    #[error("cluster: {0}")]
    Cluster(#[from] gpucache_cluster::ClusterError),
}

fn local_words(local: Option<&Path>) -> String {
    local.map(|p| format!(" or local socket {}", p.display())).unwrap_or_default()
}

/// The store a configuration opened.
pub struct OpenedStore {
    pub store: Arc<dyn Store>,
    /// The same store by its type when it is the DPU agent's.
    pub dpu: Option<Arc<DpuStore>>,
    /// The file I/O engine a FileStore runs on, and why (none for other kinds).
    pub io_engine: Option<IoEngineReport>,
    /// The same store by its type when it is a tiered one.
    pub tiered: Option<Arc<TieredStore>>,
    /// The cold tier's layer, when the tiered store has an s3 tier.
    pub cold: Option<Arc<ColdTiered>>,
}

impl std::fmt::Debug for OpenedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpenedStore({})", self.store.info().name)
    }
}

/// Which I/O engine a FileStore chose, in the operator's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoEngineReport {
    /// "uring" or "psync".
    pub engine: &'static str,
    /// "configured", "probed", or why io_uring could not run.
    pub reason: String,
}

impl ValidConfig {
    /// What the client fronts bound connections by: `[listen]`'s budget, per-peer limit and
    /// deadlines, and the tenant share `limits.tenant_inflight_bytes_max`.
    pub fn connection_bounds(&self) -> ConnectionBounds {
        let l = &self.listen;
        ConnectionBounds {
            inflight_body_bytes_max: l.inflight_body_bytes_max,
            tenant_inflight_body_bytes_max: self.limits.tenant_inflight_bytes_max,
            peer_inflight_body_bytes_max: l.peer_inflight_body_bytes_max,
            body_timeout: Duration::from_millis(l.body_timeout_ms),
            hello_timeout: Duration::from_millis(l.hello_timeout_ms),
            connections_per_peer_max: l.connections_per_peer_max.min(l.connections_max),
        }
    }

    /// Opens the configured store: a MemoryStore, a FileStore under `store.root`, or the DPU
    /// agent (started first, so that a native backend fails closed before the disk is touched)
    /// in front of that FileStore.
    pub fn open_store(&self, clock: Arc<dyn Clock>) -> Result<OpenedStore, StoreOpenError> {
        let open_file = |clock| {
            self.file_store_config().open(clock).map_err(|source| StoreOpenError::FileStore {
                root: self.store.root.clone(),
                source,
            })
        };
        match self.store.kind {
            StoreKind::Memory => {
                let limits = self.limits();
                let arena = if self.store.preallocate {
                    let bytes = limits.retained_bytes_max;
                    let arena = PayloadArena::new(bytes)
                        .map_err(|source| StoreOpenError::Preallocate { bytes, source })?;
                    tracing::info!(bytes, "memory store: payload arena mapped and faulted in");
                    Some(arena)
                } else {
                    None
                };
                let eviction = match self.store.eviction() {
                    Eviction::Refuse => None,
                    Eviction::Policy(policy) => Some(policy),
                };
                let options = MemoryOptions { eviction, arena, hand_down: false };
                let store =
                    MemoryStore::with_options(limits, clock, Box::new(LocalEpochs), options)
                        .map_err(|source| StoreOpenError::Memory { source })?;
                Ok(OpenedStore {
                    store: Arc::new(store),
                    dpu: None,
                    io_engine: None,
                    tiered: None,
                    cold: None,
                })
            }
            StoreKind::Tiered => {
                let memory = self.store.memory_tier();
                let store = TieredStore::open(self.file_store_config(), memory, clock).map_err(
                    |e| match e {
                        TieredError::File(source) => {
                            StoreOpenError::FileStore { root: self.store.root.clone(), source }
                        }
                        TieredError::Memory(source) => StoreOpenError::Memory { source },
                        TieredError::Map { bytes, source } => {
                            StoreOpenError::TierMapping { bytes, source }
                        }
                        TieredError::HugePages { bytes, source } => StoreOpenError::TierMapping {
                            bytes,
                            source: std::io::Error::other(source),
                        },
                    },
                )?;
                tracing::info!(
                    memory_bytes = memory.capacity_bytes,
                    memory_policy = %memory.policy,
                    write = %memory.write,
                    "tiered store opened"
                );
                let io_engine = Some(IoEngineReport {
                    engine: store.file().engine_name(),
                    reason: store.file().engine_reason().to_owned(),
                });
                let store = Arc::new(store);
                store.start_flusher().map_err(|source| StoreOpenError::Flusher { source })?;
                let tiered = Some(Arc::clone(&store));
                match self.store.s3_tier() {
                    Some(section) => {
                        let cold = Arc::new(open_cold(section, &self.tenants, store)?);
                        Ok(OpenedStore {
                            store: Arc::clone(&cold) as Arc<dyn Store>,
                            dpu: None,
                            io_engine,
                            tiered,
                            cold: Some(cold),
                        })
                    }
                    None => Ok(OpenedStore { store, dpu: None, io_engine, tiered, cold: None }),
                }
            }
            StoreKind::File => {
                let store = open_file(clock)?;
                let io_engine = Some(IoEngineReport {
                    engine: store.engine_name(),
                    reason: store.engine_reason().to_owned(),
                });
                Ok(OpenedStore {
                    store: Arc::new(store),
                    dpu: None,
                    io_engine,
                    tiered: None,
                    cold: None,
                })
            }
            StoreKind::Dpu => {
                let agent = dpu::start_agent(&self.dpu)?;
                let backing = open_file(clock)?;
                let config =
                    DpuStoreConfig { op_deadline: Duration::from_millis(self.dpu.op_deadline_ms) };
                let store = Arc::new(DpuStore::new(Arc::new(agent), Arc::new(backing), config));
                Ok(OpenedStore {
                    store: Arc::clone(&store) as Arc<dyn Store>,
                    dpu: Some(store),
                    io_engine: None,
                    tiered: None,
                    cold: None,
                })
            }
        }
    }

    /// The s3 tier of this configuration opened alone, off any service (for the operator's
    /// commands on the bucket), with what opening it found; none without an s3 tier.
    pub fn open_cold_tier(
        &self,
    ) -> Option<Result<(ColdTier, gpucache_cold::OpenReport), StoreOpenError>> {
        let section = self.store.s3_tier()?;
        Some(open_cold_tier(section, &self.tenants).map(|(tier, report, _)| (tier, report)))
    }

    /// Builds the service this configuration describes and starts it: every listener is
    /// accepting when this returns. Call it with the stop signals blocked (see the module
    /// documentation).
    pub fn build(self) -> Result<Service, StartError> {
        check_ports(&self)?;
        // Freed request buffers go back to the kernel, so the in-flight budget bounds memory.
        if !fix_malloc_mmap_threshold() {
            tracing::debug!("the allocator's mmap threshold is not adjustable here");
        }
        let (staging, staging_name) = staging(&self).map_err(StartError::Staging)?;
        let clock = Arc::new(MonotonicClock::default());
        let mut created_root = CreatedRoot::before_open(&self);
        let OpenedStore { store, dpu, io_engine, tiered, cold } = self.open_store(clock)?;

        let mut registry = match &dpu {
            Some(d) => dpu::offload_registry(d.agent()),
            None => Registry::default(),
        };
        if let Some(staging) = &staging {
            StagingGauges::register(&mut registry, Arc::clone(staging));
        }
        register_limits(&mut registry, &self.limits());
        if let Some(tiered) = &tiered {
            let memory = self.store.memory_tier().capacity_bytes;
            let file = self.file_store_config().limits.retained_bytes_max;
            TierSeries::register(&mut registry, Arc::clone(tiered), memory, file);
        }
        if let Some(cold) = &cold {
            ColdSeries::register(&mut registry, Arc::clone(cold));
        }
        // One guard for both client fronts: the in-flight body budget and the per-peer limit
        // are the service's, and its refusals are counted in the service's registry.
        let refusals = Refusals::default();
        refusals.register(&mut registry);
        let guard = Arc::new(Guard::with_refusals(self.connection_bounds(), refusals));
        GuardGauges::register(&mut registry, Arc::clone(&guard));
        let mut checks = vec![
            Check::store_io(Arc::clone(&store)),
            Check::disk_room(Arc::clone(&store), self.limits.object_bytes_max),
        ];
        if let Some(d) = &dpu {
            checks.push(Check::dpu_reactors(Arc::clone(d.agent())));
        }
        if let Some(staging) = &staging {
            checks.push(Check::staging(Arc::clone(staging)));
        }
        let ready = Arc::new(Probe::new(Arc::clone(&store), checks));
        ready.register(&mut registry);
        let metrics = Arc::new(Metrics::with_registry(registry));
        let metered = MeteredStore::shared(store, Arc::clone(&metrics));
        let fills = Arc::new(Fills::new(Arc::new(MonotonicClock::default())));
        let cluster = &self.cluster;
        let node = cluster.enabled().then(|| {
            let held = usize::try_from(cluster.held_keys_max).unwrap_or(usize::MAX);
            Arc::new(ClusterNode::new(
                NodeId(cluster.node),
                held,
                metered.clone(),
                Arc::clone(&fills),
            ))
        });
        let shared: Arc<dyn Store> = match &node {
            Some(node) => Arc::new(FencedStore::new(metered.clone(), Arc::clone(node))),
            None => metered.clone(),
        };

        let l = &self.listen;
        let mut server_config = ServerConfig::new(l.native, self.callers().to_vec());
        server_config.connections_max = l.connections_max;
        server_config.idle_timeout = Duration::from_millis(l.idle_timeout_ms);
        server_config.write_timeout = Duration::from_millis(l.write_timeout_ms);
        server_config.guard = Arc::clone(&guard);
        server_config.clock_skew_max = Duration::from_millis(l.clock_skew_max_ms);
        server_config.auth = self.tenant_auth().clone();
        server_config.local = self.local_socket();
        server_config.shm_mapped_bytes_max = l.shm_mapped_bytes_max;
        server_config.staging = staging;
        // LIMITS states it, so a client refuses an oversize value before it reads or sends it.
        server_config.object_bytes_max = Some(self.limits.object_bytes_max);
        server_config.cluster = node.clone();
        server_config.fills = fills;
        let server = start_native(server_config, Arc::clone(&shared)).map_err(|source| {
            StartError::Native { addr: l.native, local: self.local_socket(), source }
        })?;
        if let Some(path) = server.local_path().map(Path::to_path_buf) {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::Permissions::from_mode(LOCAL_SOCKET_MODE);
            if let Err(source) = std::fs::set_permissions(&path, mode) {
                let _ = server.shutdown();
                return Err(StartError::LocalSocketMode { path, source });
            }
        }

        let resp_caller = self.resp_caller().clone();
        let resp_tenant = resp_caller.tenant.clone();
        let mut resp_config = RespConfig::new(l.resp, resp_caller)
            .map_err(|e| StartError::RespNamespace(e.to_string()))?;
        resp_config.connections_max = l.connections_max;
        resp_config.idle_timeout = Duration::from_millis(l.idle_timeout_ms);
        resp_config.write_timeout = Duration::from_millis(l.write_timeout_ms);
        resp_config.guard = guard;
        // The RESP listener checks the same keys (re-read on change) with AUTH.
        resp_config.auth = self.tenant_auth().get(&resp_tenant).map(|a| Arc::clone(&a.keys));
        resp_config.limits = RespLimits::for_object_bytes_max(self.limits.object_bytes_max);
        let resp = RespServer::start(resp_config, Arc::clone(&shared))
            .map_err(|source| StartError::Resp { addr: l.resp, source })?;
        let http = MetricsServer::start(l.metrics, metrics, ready)
            .map_err(|source| StartError::Metrics { addr: l.metrics, source })?;
        // Registered last, once every listener accepts: the view may send clients here at
        // once.
        let registration = match &node {
            Some(node) => {
                let advertise = self.cluster.advertise.clone();
                let address = advertise.unwrap_or_else(|| server.local_addr().to_string());
                match register(&self.cluster, address, self.limits.retained_bytes_max, node) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        let _ = server.shutdown() + resp.shutdown() + http.shutdown();
                        return Err(e.into());
                    }
                }
            }
            None => None,
        };
        created_root.keep();
        Ok(Service {
            registration,
            config: self,
            server,
            resp,
            http,
            store: shared,
            dpu,
            tiered,
            cold,
            io_engine,
            staging_name,
        })
    }
}

/// Registers the node in its cluster (see `gpucache_cluster::Registration`).
fn register(
    cluster: &ClusterSection,
    address: String,
    capacity: u64,
    node: &Arc<ClusterNode>,
) -> Result<Registration, gpucache_cluster::ClusterError> {
    let mut etcd = EtcdConfig::new(cluster.etcd.clone(), cluster.name.clone());
    etcd.request_timeout_ms = cluster.request_timeout_ms;
    let coordinator = Arc::new(Coordinator::connect(etcd)?);
    let config = NodeConfig {
        node: NodeId(cluster.node),
        address,
        fault_domain: cluster.fault_domain.clone(),
        capacity,
        lease_ttl_s: cluster.lease_ttl_s,
        poll_ms: cluster.poll_ms,
    };
    Registration::start(coordinator, config, Arc::clone(node) as Arc<dyn NodeEvents>)
}

/// Starts the native listener. Its Unix socket is bound with no access for others (the umask
/// gains 007 for the moment of binding); the build then gives it [`LOCAL_SOCKET_MODE`] whatever
/// the umask was.
fn start_native(config: ServerConfig, store: Arc<dyn Store>) -> io::Result<Server> {
    // SAFETY: umask only swaps the process's file creation mask; no memory is involved.
    let umask = unsafe { libc::umask(0o077) };
    // SAFETY: as above.
    unsafe { libc::umask(umask | 0o007) };
    let started = Server::start(config, store);
    // SAFETY: as above, restoring the mask found.
    unsafe { libc::umask(umask) };
    started
}

/// The block staging `[nixl]` asks for, with how the start line names it. Enabled but unable to
/// run here (built without the feature, `libnixl_capi.so` not found, no UCX plugin) is an
/// error with the typed reason.
fn staging(config: &ValidConfig) -> Result<(Option<Arc<dyn BlockStaging>>, String), String> {
    let n = &config.nixl;
    if !n.enabled {
        return Ok((None, "none".to_owned()));
    }
    nixl_staging::build(n)
}

// NIXL staging with the `nixl` feature, refused as not built without it; both offer `build`.
#[cfg(feature = "nixl")]
use nixl_real as nixl_staging;
#[cfg(not(feature = "nixl"))]
use nixl_unavailable as nixl_staging;

/// The staging pool `[nixl]` describes, registered with a NIXL agent of this process.
#[cfg(feature = "nixl")]
mod nixl_real {
    use std::sync::Arc;

    use gpucache_nic::nixl::NixlStagingConfig;
    use gpucache_storage::host::pool::{HugePagePolicy, Tier};
    use gpucache_wire::staging::BlockStaging;

    use crate::config::NixlSection;

    pub(super) fn build(
        n: &NixlSection,
    ) -> Result<(Option<Arc<dyn BlockStaging>>, String), String> {
        let agent = n.agent_name();
        let built = NixlStagingConfig {
            agent_name: agent.clone(),
            slot_bytes: usize::try_from(n.slot_bytes).map_err(|e| e.to_string())?,
            slots: usize::try_from(n.slots()).map_err(|e| e.to_string())?,
            limits: n.limits(),
            // 2 MiB pages at best: 1 GiB pages would round a small pool up to a whole GiB.
            huge_pages: HugePagePolicy::default().prefer(Tier::Huge2M),
        }
        .build()
        .map_err(|e| e.to_string())?;
        let staging: Arc<dyn BlockStaging> = Arc::new(built);
        Ok((Some(staging), format!("nixl:{agent}")))
    }
}

/// A build without the `nixl` feature: enabled staging is refused with the typed reason.
#[cfg(not(feature = "nixl"))]
mod nixl_unavailable {
    use std::sync::Arc;

    use gpucache_wire::staging::BlockStaging;

    use crate::config::NixlSection;

    pub(super) fn build(
        _n: &NixlSection,
    ) -> Result<(Option<Arc<dyn BlockStaging>>, String), String> {
        let reason = gpucache_nic::NixlUnavailable::NotBuilt;
        Err(gpucache_nic::NicError::NixlUnavailable { reason }.to_string())
    }
}

/// The TCP listeners the configuration names, with the words an operator knows them by.
fn tcp_listeners(config: &ValidConfig) -> [(&'static str, SocketAddr); 3] {
    [
        ("native listener", config.listen.native),
        ("RESP listener", config.listen.resp),
        ("metrics listener", config.listen.metrics),
    ]
}

/// Binds each configured TCP address once and lets it go, before the store is opened, so that a
/// port in use is refused naming its listener and without touching the disk. (A port taken in
/// the moment between this and the real bind still fails later, naming the listener too.)
fn check_ports(config: &ValidConfig) -> Result<(), StartError> {
    for (listener, addr) in tcp_listeners(config) {
        if addr.port() == 0 {
            continue;
        }
        if let Err(source) = std::net::TcpListener::bind(addr) {
            return Err(StartError::PortInUse { listener, addr, source });
        }
    }
    Ok(())
}

/// Removes a store root that this build created, when the build failed before serving: no
/// block was written, and an empty data directory left behind only misleads.
struct CreatedRoot(Option<PathBuf>);

impl CreatedRoot {
    fn before_open(config: &ValidConfig) -> Self {
        let root = &config.store.root;
        let creates = config.store.kind != StoreKind::Memory && !root.exists();
        Self(creates.then(|| root.clone()))
    }

    /// The service started: the root stays.
    fn keep(&mut self) {
        self.0 = None;
    }
}

impl Drop for CreatedRoot {
    fn drop(&mut self) {
        if let Some(root) = self.0.take()
            && let Err(e) = std::fs::remove_dir_all(&root)
        {
            tracing::warn!(root = %root.display(), error = %e, "could not remove the store root this failed start created");
        }
    }
}

/// A running service: the store behind the native, RESP and HTTP listeners, serving until
/// [`Service::stop`].
pub struct Service {
    config: ValidConfig,
    server: Server,
    resp: RespServer,
    http: MetricsServer,
    /// The metered store, as the listeners hold it.
    store: Arc<dyn Store>,
    dpu: Option<Arc<DpuStore>>,
    /// The tiered store, when it is one: written down at the stop when it writes back.
    tiered: Option<Arc<TieredStore>>,
    /// The cold tier's layer: its sink drained once more at the stop.
    cold: Option<Arc<ColdTiered>>,
    io_engine: Option<IoEngineReport>,
    staging_name: String,
    /// The node's registration, when it is a node of a cluster.
    registration: Option<Registration>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("native", &self.server.local_addr())
            .field("resp", &self.resp.local_addr())
            .field("metrics", &self.http.local_addr())
            .field("store", &self.store.info().name)
            .finish()
    }
}

impl Service {
    /// Where the native listener accepts (the port the kernel chose for port 0).
    pub fn native_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The same-host Unix socket, when there is one.
    pub fn local_path(&self) -> Option<&Path> {
        self.server.local_path()
    }

    pub fn resp_addr(&self) -> SocketAddr {
        self.resp.local_addr()
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        self.http.local_addr()
    }

    /// What the service runs, as the lines `serve` logs at start: the `listening` line with
    /// every listener, the store, its epoch, root, I/O engine and limits (and the DPU agent's
    /// own offload report), then the agent's and the staging pool's lines when they run.
    pub fn start_lines(&self) -> Vec<String> {
        let config = &self.config;
        let info = self.store.info();
        let local =
            self.local_path().map_or_else(|| "none".to_owned(), |p| p.display().to_string());
        // The agent's own report, never a claim of its own: `offload=host-threads` on host threads.
        let offload = self.dpu.as_ref().map(|d| format!(" {}", dpu::offload_fields(d.agent())));
        let root = match config.store.kind {
            StoreKind::Memory => "none".to_owned(),
            _ => config.store.root.display().to_string(),
        };
        let (engine, engine_reason) = self
            .io_engine
            .as_ref()
            .map_or(("none", "no file store"), |e| (e.engine, e.reason.as_str()));
        let l = &config.limits;
        let mut lines = vec![format!(
            "listening native={} local={local} resp={} metrics={} store={} epoch={} root={root} \
             io_engine={engine} object_bytes_max={} retained_bytes_max={} \
             inflight_requests_max={} connections_max={} connections_per_peer_max={} \
             inflight_body_bytes_max={} resp_tenant={} sealed_tenants={} staging={}{} \
             io_engine_reason=\"{engine_reason}\"",
            self.native_addr(),
            self.resp_addr(),
            self.metrics_addr(),
            info.name,
            self.store.epoch().0,
            l.object_bytes_max,
            l.retained_bytes_max,
            l.inflight_requests_max,
            config.listen.connections_max,
            config.listen.connections_per_peer_max,
            config.listen.inflight_body_bytes_max,
            config.resp_caller().tenant,
            config.tenant_auth().len(),
            self.staging_name,
            offload.unwrap_or_default(),
        )];
        if let Some(d) = &self.dpu {
            let c = &config.dpu;
            lines.push(format!(
                "dpu agent backend={} state_dir={} queues_per_reactor={} queue_depth={} \
                 slab={}x{} bytes",
                c.backend.as_str(),
                c.state_dir.display(),
                c.queues_per_reactor,
                c.queue_depth,
                c.slab_slots,
                c.slab_slot_bytes
            ));
            lines.extend(dpu::reactor_lines(d.agent()).into_iter().map(|l| format!("dpu {l}")));
        }
        if config.nixl.enabled {
            let n = &config.nixl;
            lines.push(format!(
                "block staging over NIXL ({}): {} slots of {} bytes, stage lease {} ms, stages \
                 per connection {}, stages in all {}",
                self.staging_name,
                n.slots(),
                n.slot_bytes,
                n.stage_lease_ms,
                n.per_connection_max,
                n.staged_max
            ));
        }
        lines
    }

    /// Stops the service: the native listener first (connections finish the request in hand),
    /// then the RESP listener, then the HTTP endpoint, then the store (a tiered store that
    /// writes back writes its memory-only blocks down; the DPU agent's reactors are joined when
    /// its last holder goes). Answers how many connection threads did not stop in time.
    pub fn stop(self) -> usize {
        let Self { server, resp, http, store, dpu, tiered, cold, registration, .. } = self;
        // Out of the view first: clients route its keys to their next choices at once.
        if let Some(r) = registration
            && let Err(e) = r.leave()
        {
            tracing::warn!(error = %e, "could not leave the cluster view; its lease will lapse");
        }
        let left = server.shutdown() + resp.shutdown();
        let http_left = http.shutdown();
        if let Some(t) = tiered.filter(|t| t.write_mode() == WriteMode::Back) {
            let written = t.flush();
            tracing::info!(written, "write-back: blocks held only in memory written down");
        }
        if let Some(c) = cold {
            c.close(COLD_CLOSE_WITHIN);
            let d = c.sink().depth();
            tracing::info!(
                pending = d.pending,
                failed = d.failed,
                "cold tier: sink drained at the stop (what is left is lost: clean misses)"
            );
        }
        drop(store);
        drop(dpu);
        left + http_left
    }
}
