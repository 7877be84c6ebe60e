//! Checking a parsed file in full, and [`ValidConfig`], the value only a passed check gives.
//!
//! Everything that can be checked without starting the service is checked here: limits and
//! ranges, addresses, the local socket's path, the `[nixl]` and `[dpu]` sections, tenants and
//! their key files. What the check had to work out on the way (each tenant's caller, the RESP
//! tenant, the loaded keys) is kept in the `ValidConfig`, so that nothing downstream parses it
//! again or has an error left to report for it.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

use super::error::{ConfigError, join};
use super::schema::{
    ClusterSection, DpuBackendName, DpuSection, Eviction, LayoutName, NixlSection, S3TierSection,
    ServeConfig, StoreKind, StoreSection, TierKind, TierSection,
};
use crate::auth::{TenantAuth, TenantKeys};
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::limits::LimitsError;
use gpucache_storage::host::pool::POOL_BYTES_MAX;
use gpucache_storage::host::segment::SEGMENT_BYTES_MIN;

/// Largest configuration file read; a bigger one is surely not a configuration file.
pub const CONFIG_BYTES_MAX: u64 = 1 << 20;
/// Deepest io_uring queue accepted (the engine clamps to the same bound).
pub const QUEUE_DEPTH_MAX: u32 = 4096;
/// Most client connections: each one is a thread (ADR 0011).
pub const CONNECTIONS_MAX_LIMIT: u32 = 16_384;
/// Widest HELLO clock window accepted: one hour.
pub const CLOCK_SKEW_MAX_LIMIT_MS: u64 = 3_600_000;
/// Largest `listen.idle_timeout_ms` and `listen.write_timeout_ms`: a day.
pub const TIMEOUT_LIMIT_MS: u64 = 86_400_000;
/// Longest Unix socket path: `sun_path` holds 108 bytes with the terminating NUL.
pub const SOCKET_PATH_BYTES_MAX: usize = 107;
/// Smallest `nixl.slot_bytes`: one page.
pub const NIXL_SLOT_BYTES_MIN: u64 = 4096;
/// Largest `nixl.slot_bytes`.
pub const NIXL_SLOT_BYTES_MAX: u64 = 1 << 30;
/// Most slots `nixl.pool_bytes / nixl.slot_bytes` may give (the staging pool's table bound).
pub const NIXL_SLOTS_MAX: u64 = 65_536;
/// Longest `nixl.agent` name.
pub const NIXL_AGENT_BYTES_MAX: usize = 128;
/// Smallest `dpu.slab_slot_bytes`: one page.
pub const DPU_SLOT_BYTES_MIN: u64 = 4096;
/// Largest `dpu.slab_slot_bytes`.
pub const DPU_SLOT_BYTES_MAX: u64 = 1 << 30;
/// Highest core id `[[dpu.reactors]] core` may name (the kernel's `CPU_SETSIZE` less one).
pub const DPU_CORE_MAX: u64 = 1023;

/// A configuration that passed [`ServeConfig::validate`]. Only that check makes one, so a
/// function that takes a `ValidConfig` needs no check of its own. It reads as the
/// [`ServeConfig`] it holds (through `Deref`), and cannot be changed: a changed configuration
/// is validated again.
#[derive(Debug, Clone)]
pub struct ValidConfig {
    config: ServeConfig,
    /// One per `[[tenants]]` entry, in file order.
    callers: Vec<Caller>,
    /// Index into `callers` of the tenant RESP connections act as.
    resp_tenant: usize,
    /// The tenants with a `secret_file`, keys loaded.
    auth: HashMap<TenantId, TenantAuth>,
}

impl ValidConfig {
    /// Parses and validates a configuration.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        ServeConfig::parse(text)?.validate()
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

    /// The configuration as it was parsed.
    pub fn config(&self) -> &ServeConfig {
        &self.config
    }

    /// The callers the configured tenants act as, in file order.
    pub fn callers(&self) -> &[Caller] {
        &self.callers
    }

    /// The caller every RESP connection acts as: `listen.resp_tenant`, or the first tenant,
    /// with that tenant's configured rights.
    pub fn resp_caller(&self) -> &Caller {
        &self.callers[self.resp_tenant]
    }

    /// The authentication of every tenant with a `secret_file`, keys as loaded by the check
    /// (the server re-reads a file when it changes).
    pub fn tenant_auth(&self) -> &HashMap<TenantId, TenantAuth> {
        &self.auth
    }
}

impl Deref for ValidConfig {
    type Target = ServeConfig;

    fn deref(&self) -> &ServeConfig {
        &self.config
    }
}

impl ServeConfig {
    /// Checks everything that can be checked without starting the service: limits, ranges,
    /// addresses, tenants, and that secret files exist and hold good keys. The first problem
    /// found is the error, naming its key path.
    pub fn validate(self) -> Result<ValidConfig, ConfigError> {
        self.limits().validate().map_err(|source| {
            let name = match &source {
                LimitsError::Zero { name } => *name,
                LimitsError::Inconsistent { smaller, .. } => *smaller,
                _ => "",
            };
            ConfigError::Limits { key: join("limits", name), source }
        })?;
        let s = &self.store;
        if s.eviction == Some(Eviction::Refuse) && s.kind != StoreKind::Memory {
            let kind = match s.kind {
                StoreKind::Dpu => "dpu",
                StoreKind::Tiered => "tiered",
                _ => "file",
            };
            return Err(ConfigError::FileStoreRefuses { kind });
        }
        if s.direct_io && s.layout == Some(LayoutName::Log) {
            return Err(ConfigError::DirectLog);
        }
        check_tiers(s)?;
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
        // Above connections_max it is connections_max (the build takes the smaller), so a
        // configuration that lowers connections_max alone stays valid.
        in_range(
            "listen.connections_per_peer_max",
            l.connections_per_peer_max.into(),
            1,
            CONNECTIONS_MAX_LIMIT.into(),
        )?;
        // One request of the largest value must fit.
        in_range(
            "listen.inflight_body_bytes_max",
            l.inflight_body_bytes_max,
            self.limits.object_bytes_max,
            u64::MAX,
        )?;
        in_range(
            "listen.peer_inflight_body_bytes_max",
            l.peer_inflight_body_bytes_max,
            self.limits.object_bytes_max,
            u64::MAX,
        )?;
        in_range("listen.idle_timeout_ms", l.idle_timeout_ms, 1, TIMEOUT_LIMIT_MS)?;
        in_range("listen.write_timeout_ms", l.write_timeout_ms, 1, TIMEOUT_LIMIT_MS)?;
        // A request that is slower than idleness, or a HELLO allowed longer, would make no sense.
        in_range("listen.body_timeout_ms", l.body_timeout_ms, 1, l.idle_timeout_ms)?;
        in_range("listen.hello_timeout_ms", l.hello_timeout_ms, 1, l.idle_timeout_ms)?;
        in_range(
            "listen.shm_mapped_bytes_max",
            l.shm_mapped_bytes_max,
            SEGMENT_BYTES_MIN,
            u64::MAX,
        )?;
        check_listen(&self)?;
        check_local(&self)?;
        check_nixl(&self.nixl)?;
        check_dpu(&self.dpu)?;
        check_cluster(&self.cluster, self.store.kind)?;
        let (callers, auth) = check_tenants(&self)?;
        let resp_tenant = resp_tenant(&self)?;
        Ok(ValidConfig { config: self, callers, resp_tenant, auth })
    }
}

fn in_range(key: &'static str, value: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange { key, value, min, max })
    }
}

fn check_listen(c: &ServeConfig) -> Result<(), ConfigError> {
    let l = &c.listen;
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
fn check_local(c: &ServeConfig) -> Result<(), ConfigError> {
    let Some(path) = c.local_socket() else { return Ok(()) };
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
    let store_creates =
        matches!(c.store.kind, StoreKind::File | StoreKind::Dpu | StoreKind::Tiered)
            && parent.components().eq(c.store.root.components());
    if !store_creates && !parent.is_dir() {
        return Err(refuse(format!(
            "its directory {} does not exist (only store.root of a file store is created \
             at start)",
            parent.display()
        )));
    }
    Ok(())
}

/// Longest `cluster.name`, `cluster.fault_domain` and `cluster.advertise`.
pub const CLUSTER_TEXT_BYTES_MAX: usize = 255;

fn check_cluster(c: &ClusterSection, kind: StoreKind) -> Result<(), ConfigError> {
    if !c.enabled() {
        return Ok(());
    }
    let bad = |key, why: &str| Err(ConfigError::Cluster { key, why: why.to_owned() });
    // A node that restarts must come back empty: other members may have taken newer writes
    // of its keys while it was away, and a durable store would serve the old ones.
    if kind != StoreKind::Memory {
        return bad(
            "cluster.etcd",
            "a node of a cluster needs store.kind = \"memory\" in this build",
        );
    }
    for url in &c.etcd {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return bad("cluster.etcd", &format!("{url:?} is not an http:// or https:// URL"));
        }
    }
    if c.node == 0 {
        return bad("cluster.node", "every node of a cluster needs a number of its own, 1 or more");
    }
    for (key, text) in [("cluster.name", &c.name), ("cluster.fault_domain", &c.fault_domain)] {
        if text.is_empty() || text.len() > CLUSTER_TEXT_BYTES_MAX || text.contains('/') {
            return bad(key, &format!("{text:?} must be 1 to 255 bytes with no '/'"));
        }
    }
    if let Some(a) = &c.advertise
        && (a.len() > CLUSTER_TEXT_BYTES_MAX || a.parse::<std::net::SocketAddr>().is_err())
    {
        return bad("cluster.advertise", &format!("{a:?} is not a host:port address"));
    }
    in_range("cluster.lease_ttl_s", c.lease_ttl_s, 1, 3_600)?;
    in_range("cluster.poll_ms", c.poll_ms, 10, c.lease_ttl_s * 1_000 / 3)?;
    in_range("cluster.request_timeout_ms", c.request_timeout_ms, 10, TIMEOUT_LIMIT_MS)?;
    in_range("cluster.held_keys_max", c.held_keys_max, 1, 1 << 32)?;
    Ok(())
}

fn check_nixl(n: &NixlSection) -> Result<(), ConfigError> {
    in_range("nixl.slot_bytes", n.slot_bytes, NIXL_SLOT_BYTES_MIN, NIXL_SLOT_BYTES_MAX)?;
    in_range("nixl.pool_bytes", n.pool_bytes, n.slot_bytes, POOL_BYTES_MAX)?;
    if !n.pool_bytes.is_multiple_of(n.slot_bytes) {
        return Err(ConfigError::NixlPoolNotWhole {
            pool_bytes: n.pool_bytes,
            slot_bytes: n.slot_bytes,
        });
    }
    in_range("nixl.pool_bytes / nixl.slot_bytes", n.slots(), 1, NIXL_SLOTS_MAX)?;
    in_range("nixl.stage_lease_ms", n.stage_lease_ms, 1, CLOCK_SKEW_MAX_LIMIT_MS)?;
    in_range("nixl.per_connection_max", n.per_connection_max.into(), 1, NIXL_SLOTS_MAX)?;
    in_range("nixl.staged_max", n.staged_max.into(), n.per_connection_max.into(), NIXL_SLOTS_MAX)?;
    if let Some(name) = &n.agent {
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

fn check_dpu(d: &DpuSection) -> Result<(), ConfigError> {
    let refuse = |key: String, why: String| Err(ConfigError::Dpu { key, why });
    let reactors_max = gpucache_dpu::REACTORS_MAX as u64;
    in_range("dpu.reactors (entries)", d.reactors.len() as u64, 1, reactors_max)?;
    let mut ids = BTreeMap::new();
    for (i, r) in d.reactors.iter().enumerate() {
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
    let queues_max = (gpucache_dpu::QUEUES_MAX / d.reactors.len()) as u64;
    in_range("dpu.queues_per_reactor", d.queues_per_reactor.into(), 1, queues_max)?;
    in_range("dpu.queue_depth", d.queue_depth.into(), 1, gpucache_dpu::QUEUE_DEPTH_MAX as u64)?;
    in_range("dpu.slab_slots", d.slab_slots.into(), 1, gpucache_dpu::SLAB_SLOTS_MAX as u64)?;
    in_range("dpu.slab_slot_bytes", d.slab_slot_bytes, DPU_SLOT_BYTES_MIN, DPU_SLOT_BYTES_MAX)?;
    let slab_bytes = u64::from(d.slab_slots).saturating_mul(d.slab_slot_bytes);
    in_range("dpu.slab_slots * dpu.slab_slot_bytes", slab_bytes, 1, POOL_BYTES_MAX)?;
    in_range("dpu.slab_lease_ms", d.slab_lease_ms, 1, CLOCK_SKEW_MAX_LIMIT_MS)?;
    in_range("dpu.op_deadline_ms", d.op_deadline_ms, 1, CLOCK_SKEW_MAX_LIMIT_MS)?;
    if d.state_dir.as_os_str().is_empty() {
        return refuse("dpu.state_dir".into(), "is empty".into());
    }
    let native = [
        ("dpu.spdk_pci_addr", &d.spdk_pci_addr, DpuBackendName::Spdk),
        ("dpu.doca_device", &d.doca_device, DpuBackendName::Doca),
    ];
    for (key, value, wants) in native {
        match value {
            Some(v) if d.backend != wants => {
                return refuse(
                    key.into(),
                    format!(
                        "{v:?} is set but dpu.backend is {:?}; it applies to {:?} only",
                        d.backend.as_str(),
                        wants.as_str()
                    ),
                );
            }
            Some(v) if v.is_empty() => return refuse(key.into(), "is empty".into()),
            None if d.backend == wants => {
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

/// Each tenant's name, rights, seals and key file, in file order; the callers they act as and
/// the keys of those that authenticate.
fn check_tenants(
    c: &ServeConfig,
) -> Result<(Vec<Caller>, HashMap<TenantId, TenantAuth>), ConfigError> {
    if c.tenants.is_empty() {
        return Err(ConfigError::NoTenants);
    }
    let max = c.limits.tenants_max;
    if c.tenants.len() > usize::try_from(max).unwrap_or(usize::MAX) {
        return Err(ConfigError::TooManyTenants { configured: c.tenants.len(), max });
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut callers = Vec::with_capacity(c.tenants.len());
    let mut auth = HashMap::new();
    for (i, t) in c.tenants.iter().enumerate() {
        let key = |leaf: &str| format!("tenants[{i}].{leaf}");
        let caller =
            t.caller().map_err(|source| ConfigError::TenantName { key: key("name"), source })?;
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
        if t.cold_retention_s.is_some() && c.store.s3_tier().is_none() {
            return Err(ConfigError::ColdRetentionWithoutTier { key: key("cold_retention_s") });
        }
        let accepted = t
            .accepted_seals()
            .map_err(|name| ConfigError::SealAlgorithm { key: key("seal_algorithms"), name })?;
        match &t.secret_file {
            Some(path) => {
                let keys = TenantKeys::load(path)
                    .map_err(|source| ConfigError::KeyFile { key: key("secret_file"), source })?;
                auth.insert(caller.tenant.clone(), TenantAuth { keys: Arc::new(keys), accepted });
            }
            None => {
                let addr = c.listen.native;
                if !addr.ip().to_canonical().is_loopback() && !c.listen.allow_open_tenants {
                    return Err(ConfigError::OpenTenant {
                        key: key("secret_file"),
                        name: t.name.clone(),
                        addr,
                    });
                }
            }
        }
        callers.push(caller);
    }
    Ok((callers, auth))
}

/// The index of the `[[tenants]]` entry RESP connections act as: `listen.resp_tenant`, or the
/// first entry.
fn resp_tenant(c: &ServeConfig) -> Result<usize, ConfigError> {
    let found = match &c.listen.resp_tenant {
        None if c.tenants.is_empty() => None,
        None => Some(0),
        Some(name) => c.tenants.iter().position(|t| &t.name == name),
    };
    found.ok_or_else(|| match &c.listen.resp_tenant {
        Some(name) => ConfigError::UnknownRespTenant {
            name: name.clone(),
            known: c.tenants.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", "),
        },
        None => ConfigError::NoTenants,
    })
}

/// `[[store.tiers]] kind = "s3"`: a bucket, a name prefix that is a plain folder, nonzero
/// budgets and bounds. (The keys of the tiers above are refused by the parser.)
fn check_s3_tier(i: usize, t: &S3TierSection) -> Result<(), ConfigError> {
    let refuse = |why: String| Err(ConfigError::Tiers { why });
    if t.bucket.is_empty() {
        return refuse(format!("tiers[{i}].bucket: the s3 tier needs a bucket"));
    }
    if let Some(p) = &t.prefix
        && (p.is_empty() || p.starts_with('/') || p.ends_with('/') || p.contains("//"))
    {
        return refuse(format!(
            "tiers[{i}].prefix: {p:?} is not a folder name (no leading, trailing or double slash)"
        ));
    }
    if let Some(e) = &t.endpoint
        && !(e.starts_with("http://") || e.starts_with("https://"))
    {
        return refuse(format!("tiers[{i}].endpoint: {e:?} is not an http:// or https:// URL"));
    }
    let nonzero = [
        ("request_timeout_ms", t.request_timeout_ms),
        ("refill_bytes_max", t.refill_bytes_max),
        ("refill_within_ms", t.refill_within_ms),
        ("queue_bytes_max", t.queue_bytes_max),
        ("pack_bytes", t.pack_bytes),
        ("drain_interval_ms", t.drain_interval_ms),
        ("queue_jobs_max", t.queue_jobs_max.map(|n| n as u64)),
    ];
    if let Some((key, _)) = nonzero.iter().find(|(_, v)| *v == Some(0)) {
        return refuse(format!("tiers[{i}].{key}: must be more than 0"));
    }
    if let (Some(pack), Some(queue)) = (t.pack_bytes, t.queue_bytes_max)
        && pack > queue
    {
        return refuse(format!(
            "tiers[{i}].pack_bytes: {pack} is more than queue_bytes_max ({queue})"
        ));
    }
    Ok(())
}

/// `[[store.tiers]]`: only with `kind = "tiered"`, a memory tier and then a file tier (each at
/// most once, in that order), each with a policy rather than `"refuse"` and room for a block,
/// then optionally an s3 tier (which needs the two above it spelled out).
fn check_tiers(s: &StoreSection) -> Result<(), ConfigError> {
    let refuse = |why: String| Err(ConfigError::Tiers { why });
    if s.kind != StoreKind::Tiered {
        if !s.tiers.is_empty() {
            return refuse("tiers are for kind = \"tiered\"".into());
        }
        return Ok(());
    }
    let kinds: Vec<TierKind> = s.tiers.iter().map(TierSection::kind).collect();
    if !matches!(
        kinds.as_slice(),
        [] | [TierKind::Memory]
            | [TierKind::Memory, TierKind::File]
            | [TierKind::Memory, TierKind::File, TierKind::S3]
    ) {
        return refuse(format!(
            "{kinds:?}: a tiered store takes a memory tier, then a file tier (either may be left \
             out for its defaults when no s3 tier follows), then optionally an s3 tier"
        ));
    }
    for (i, t) in s.tiers.iter().enumerate() {
        if t.eviction() == Some(Eviction::Refuse) {
            return refuse(format!(
                "tiers[{i}].eviction: a tier evicts; \"refuse\" is not a policy"
            ));
        }
        if t.capacity() == Some(0) {
            return refuse(format!("tiers[{i}].capacity: 0 bytes holds no block"));
        }
        if let TierSection::S3(s3) = t {
            check_s3_tier(i, s3)?;
        }
    }
    Ok(())
}
