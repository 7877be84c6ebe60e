//! Our service as a peer: `gpucache serve` started as a child process (the `gpucache` binary
//! beside this executable, [`gpucache_exe`]) on a generated configuration with the in-memory
//! store, driven through one client per thread.
//!
//! Each transport is one row of the report: `ours-tcp` (loopback TCP) and `ours-shm` (the
//! same-host path of docs/adr/0013: the Unix socket the server offers in HELLO, and a memfd
//! segment per client through which payloads move). Adding one takes a [`Transport`] variant,
//! its name, and an arm in [`Transport::connect`] that returns a [`KvClient`].

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_client::{ClientConfig, LocalConfig, Stripe, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_service::resp::IdentityTemplate;
use gpucache_storage::host::segment::{ARENA_ALIGN, SEGMENT_BYTES_MIN, SharedBuf};

use super::load::{self, Between, KvClient, LoadSpec, PointResult};
use super::process::{ChildGuard, free_port, loopback};

/// The tenant the benchmark's service defines and its clients act as.
pub(crate) const TENANT: &str = "bench";
/// How long `gpucache serve` may take to listen.
const START_DEADLINE: Duration = Duration::from_secs(30);

/// How the clients reach the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// The native GPCW protocol over loopback TCP, through [`TcpStore`].
    Tcp,
    /// The same-host path: [`TcpStore`] with [`LocalConfig::negotiated`], PUT sources and GET
    /// destinations in shared buffers of the client's segment (the zero-copy path).
    Shm,
}

impl Transport {
    /// The row name in the report.
    pub(crate) fn peer_name(self) -> &'static str {
        match self {
            Transport::Tcp => "ours-tcp",
            Transport::Shm => "ours-shm",
        }
    }

    /// Whether the transport is the shared-memory path (the one compared with memcpy).
    pub(crate) fn is_shared_memory(self) -> bool {
        match self {
            Transport::Tcp => false,
            Transport::Shm => true,
        }
    }

    /// What the row's note says about how it is driven.
    pub(crate) fn note(self) -> &'static str {
        match self {
            Transport::Tcp => {
                "gpucache serve, memory store, one TcpStore (one connection) per client thread, \
                 Store::put / Store::get_into"
            }
            Transport::Shm => {
                "gpucache serve, memory store, one TcpStore per client thread on the Unix socket \
                 offered in HELLO, with its own memfd segment (2x the value + 1 MiB); \
                 Store::put from and Store::get_into a shared buffer (no payload on the socket, \
                 no client copy); the PUT source is filled once and restamped per key"
            }
        }
    }

    fn connect(
        self,
        service: &Service,
        keys: Arc<Vec<PhysicalKey>>,
        value_bytes: usize,
    ) -> Result<OursClient, String> {
        let mut config = ClientConfig::new(service.native, service.caller.clone());
        config.client_name = "gpucache-bench".to_owned();
        let caller = service.caller.clone();
        match self {
            Transport::Tcp => {
                config.stripe = stripe_from_env(config.stripe)?;
                Ok(OursClient { store: TcpStore::new(config), caller, keys, shared: None })
            }
            Transport::Shm => {
                let mut local = LocalConfig::negotiated();
                local.segment_bytes = segment_bytes(value_bytes);
                config.local = Some(local);
                let store = TcpStore::new(config);
                let no_room = || format!("no shared buffer of {value_bytes} bytes");
                let src = store.shared_buffer(value_bytes).ok_or_else(no_room)?;
                let mut dst = store.shared_buffer(value_bytes).ok_or_else(no_room)?;
                // Fault the destination's pages in before the clock starts, as the driver does
                // for its own buffers.
                dst.fill(1);
                Ok(OursClient {
                    store,
                    caller,
                    keys,
                    shared: Some(Shared { src, dst, filled: false, got: 0 }),
                })
            }
        }
    }
}

/// The environment variable that turns on striping for `ours-tcp` clients: the number of parts
/// a PUT of at least the client's threshold (1 MiB) is split into (unset: the client's
/// default, which stripes nothing).
pub(crate) const STRIPE_PARTS_ENV: &str = "GPUCACHE_BENCH_STRIPE_PARTS";

/// `base` with the parts [`STRIPE_PARTS_ENV`] names, when it is set.
fn stripe_from_env(base: Stripe) -> Result<Stripe, String> {
    match std::env::var(STRIPE_PARTS_ENV) {
        Err(_) => Ok(base),
        Ok(v) => v
            .parse()
            .map(|parts| Stripe { parts, ..base })
            .map_err(|e| format!("{STRIPE_PARTS_ENV}={v:?}: {e}")),
    }
}

/// One client's segment: room for a PUT source and a GET destination of `value_bytes` each,
/// plus 1 MiB of slack.
pub(crate) fn segment_bytes(value_bytes: usize) -> u64 {
    let buffer = (value_bytes as u64).div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
    (2 * buffer + (1 << 20)).max(SEGMENT_BYTES_MIN)
}

/// The shared buffers of an `ours-shm` client.
struct Shared {
    src: SharedBuf,
    dst: SharedBuf,
    /// Whether `src` holds the payload; after that only the stamped index changes per PUT.
    filled: bool,
    /// Length of the value the last GET left in `dst`.
    got: usize,
}

/// A running `gpucache serve`, stopped when dropped.
/// A `gpucache serve` child of a bench, stopped by PID when this drops.
pub(crate) struct Service {
    pub native: SocketAddr,
    pub caller: Caller,
    _child: ChildGuard,
}

/// One client thread's handle on the service.
struct OursClient {
    store: TcpStore,
    caller: Caller,
    keys: Arc<Vec<PhysicalKey>>,
    /// The shared buffers, on the same-host path.
    shared: Option<Shared>,
}

/// Key `index` of the working set.
fn key_at(keys: &[PhysicalKey], index: u64) -> Result<&PhysicalKey, String> {
    usize::try_from(index)
        .ok()
        .and_then(|i| keys.get(i))
        .ok_or_else(|| format!("key index {index} outside the working set"))
}

impl KvClient for OursClient {
    fn put(&mut self, index: u64, value: &[u8]) -> Result<(), String> {
        let key = key_at(&self.keys, index)?;
        let src: &[u8] = match &mut self.shared {
            None => value,
            Some(sh) => {
                if sh.src.len() != value.len() {
                    return Err(format!(
                        "a {}-byte value for a {}-byte buffer",
                        value.len(),
                        sh.src.len()
                    ));
                }
                // The load's values differ only in the index stamped in their first 8 bytes.
                let stamped = value.len().min(8);
                if sh.filled {
                    sh.src[..stamped].copy_from_slice(&value[..stamped]);
                } else {
                    sh.src.copy_from_slice(value);
                    sh.filled = true;
                }
                &sh.src
            }
        };
        match self.store.put(&self.caller, key, src, None) {
            Ok(Put::Committed(_)) => Ok(()),
            Ok(other) => Err(format!("PUT answered {other:?}")),
            Err(e) => Err(format!("PUT: {e}")),
        }
    }

    fn get(&mut self, index: u64, dst: &mut [u8]) -> Result<usize, String> {
        let key = key_at(&self.keys, index)?;
        let dst: &mut [u8] = match &mut self.shared {
            None => dst,
            Some(sh) => {
                sh.got = 0;
                &mut sh.dst
            }
        };
        let len = match self.store.get_into(&self.caller, key, dst) {
            Ok(Get::Hit { len, .. }) => usize::try_from(len).map_err(|e| e.to_string())?,
            Ok(Get::Miss(reason)) => return Err(format!("GET missed: {reason:?}")),
            Err(e) => return Err(format!("GET: {e}")),
        };
        if let Some(sh) = &mut self.shared {
            sh.got = len;
        }
        Ok(len)
    }

    fn got(&self) -> Option<&[u8]> {
        self.shared.as_ref().map(|sh| &sh.dst[..sh.got])
    }
}

/// Which store a bench service runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreConfig<'a> {
    /// The memory store.
    Memory,
    /// A file store under `root` with `store.durability = durability` and `store.layout =
    /// layout`.
    File { root: &'a Path, durability: &'static str, layout: &'static str },
}

/// The `gpucache serve` configuration for one point: the store with room for the working set
/// (its capacity, `limits.retained_bytes_max`), on the three given loopback ports, one
/// read-write tenant, and the same-host socket at `local` when given (none otherwise).
pub(crate) fn serve_config(
    ports: [u16; 3],
    value_bytes: u64,
    working_set_bytes: u64,
    local: Option<&Path>,
    store: &StoreConfig<'_>,
) -> String {
    let slack = 64 << 20;
    let retained = working_set_bytes + 2 * value_bytes + slack;
    let object = value_bytes.max(1 << 20);
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(s, "# generated by gpucache-bench service");
    match store {
        StoreConfig::Memory => {
            // Every block of the run fits in memory faulted in at start.
            let _ = writeln!(s, "[store]\nkind = \"memory\"\npreallocate = true\n");
        }
        StoreConfig::File { root, durability, layout } => {
            let _ = writeln!(s, "[store]\nkind = \"file\"");
            // Debug quoting is a valid TOML basic string for the paths used here.
            let _ = writeln!(s, "root = {:?}", root.display().to_string());
            let _ = writeln!(s, "durability = \"{durability}\"");
            let _ = writeln!(s, "layout = \"{layout}\"\n");
        }
    }
    let _ = writeln!(s, "[limits]");
    let _ = writeln!(s, "object_bytes_max = {object}");
    let _ = writeln!(s, "retained_bytes_max = {retained}");
    let _ = writeln!(s, "tenant_retained_bytes_max = {retained}");
    let _ = writeln!(s, "tenant_inflight_bytes_max = {}", (1u64 << 30).max(64 * object));
    let _ = writeln!(s, "registrations_max = {}", 1u64 << 20);
    let _ = writeln!(s, "\n[listen]");
    let _ = writeln!(s, "native = \"127.0.0.1:{}\"", ports[0]);
    let _ = writeln!(s, "resp = \"127.0.0.1:{}\"", ports[1]);
    let _ = writeln!(s, "metrics = \"127.0.0.1:{}\"", ports[2]);
    let _ = writeln!(s, "connections_max = 256");
    match local {
        // Debug quoting is a valid TOML basic string for the paths used here.
        Some(path) => {
            let _ = writeln!(s, "local = {:?}", path.display().to_string());
        }
        // A file store would otherwise offer a socket inside its root.
        None => {
            let _ = writeln!(s, "local = \"\"");
        }
    }
    let _ = writeln!(s, "\n[[tenants]]\nname = \"{TENANT}\"\nrights = [\"read\", \"write\"]");
    s
}

fn start_service(
    transport: Transport,
    scratch: &Path,
    spec: &LoadSpec,
    working_set_bytes: u64,
) -> Result<Service, String> {
    let tag = format!("{}-{}-{}", transport.peer_name(), spec.value_bytes, spec.clients);
    let socket = scratch.join(format!("{tag}.sock"));
    let local = transport.is_shared_memory().then_some(socket.as_path());
    start_serve(scratch, &tag, spec.value_bytes as u64, working_set_bytes, local)
}

/// The `gpucache` binary whose `serve` the harnesses measure: the one in this executable's
/// folder, where one build (`cargo build -p gpucache-cli`, `cargo install --path cli`) puts
/// both `gpucache-bench` and `gpucache`.
pub(crate) fn gpucache_exe() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let gpucache = exe.with_file_name(format!("gpucache{}", std::env::consts::EXE_SUFFIX));
    if gpucache.is_file() {
        Ok(gpucache)
    } else {
        Err(format!(
            "no gpucache binary beside this one at {}: build both (cargo build -p gpucache-cli)",
            gpucache.display()
        ))
    }
}

/// Starts `gpucache serve` ([`gpucache_exe`]) on free loopback ports with the bench's
/// configuration, its files named after `tag` in `scratch`, and waits until it listens.
pub(crate) fn start_serve(
    scratch: &Path,
    tag: &str,
    value_bytes: u64,
    working_set_bytes: u64,
    local: Option<&Path>,
) -> Result<Service, String> {
    start_serve_store(scratch, tag, value_bytes, working_set_bytes, local, &StoreConfig::Memory)
}

/// [`start_serve`] on the given store.
pub(crate) fn start_serve_store(
    scratch: &Path,
    tag: &str,
    value_bytes: u64,
    working_set_bytes: u64,
    local: Option<&Path>,
    store: &StoreConfig<'_>,
) -> Result<Service, String> {
    let ports = [free_port()?, free_port()?, free_port()?];
    let config = serve_config(ports, value_bytes, working_set_bytes, local, store);
    let path = scratch.join(format!("serve-{tag}.toml"));
    std::fs::write(&path, config).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut command = Command::new(gpucache_exe()?);
    command.arg("serve").arg("--config").arg(&path);
    let log = scratch.join(format!("serve-{tag}.log"));
    let mut child = ChildGuard::spawn("gpucache serve", command, &log, false)?;
    let native = loopback(ports[0]);
    child.wait_listening(native, Instant::now() + START_DEADLINE).map_err(|e| {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        format!("{e}: {}", tail.lines().last().unwrap_or(""))
    })?;
    let tenant = TenantId::parse(TENANT).map_err(|e| format!("bench tenant: {e}"))?;
    Ok(Service { native, caller: Caller::new(tenant, Rights::READ_WRITE), _child: child })
}

/// Starts `gpucache serve` exactly as the README's first command runs it: no configuration
/// file (the embedded default store, ports and tenant), in `home` as its working directory (so
/// its `./gpucache-data` is there). Fails when a default port is taken.
pub(crate) fn start_default(home: &Path, tag: &str, scratch: &Path) -> Result<Service, String> {
    let defaults = gpucache_service::config::ValidConfig::from_toml_str("")
        .map_err(|e| format!("the embedded default: {e}"))?;
    for addr in [defaults.listen.native, defaults.listen.resp, defaults.listen.metrics] {
        std::net::TcpListener::bind(addr).map_err(|e| {
            format!("{addr} (a default address of gpucache serve) is not free: {e}")
        })?;
    }
    std::fs::create_dir_all(home).map_err(|e| format!("{}: {e}", home.display()))?;
    let mut command = Command::new(gpucache_exe()?);
    command.arg("serve").current_dir(home);
    let log = scratch.join(format!("serve-{tag}.log"));
    let mut child = ChildGuard::spawn("gpucache serve", command, &log, false)?;
    let native = defaults.listen.native;
    child.wait_listening(native, Instant::now() + START_DEADLINE).map_err(|e| {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        format!("{e}: {}", tail.lines().last().unwrap_or(""))
    })?;
    let tenant = &defaults.tenants[0];
    let tenant = TenantId::parse(&tenant.name).map_err(|e| format!("default tenant: {e}"))?;
    Ok(Service { native, caller: Caller::new(tenant, Rights::READ_WRITE), _child: child })
}

/// Measures one point over `transport`, on a service of its own (started and stopped here).
pub(crate) fn measure(
    transport: Transport,
    scratch: &Path,
    spec: LoadSpec,
    working_set_bytes: u64,
) -> PointResult {
    let size = spec.value_bytes as u64;
    match start_service(transport, scratch, &spec, working_set_bytes) {
        Ok(service) => run_on(transport, &service, spec, None),
        Err(e) => PointResult::failed(size, spec.clients, e),
    }
}

/// Runs one point's load over `transport` on a running `service`.
pub(crate) fn run_on(
    transport: Transport,
    service: &Service,
    spec: LoadSpec,
    between: Option<Between<'_>>,
) -> PointResult {
    let keys = match keys(&service.caller.tenant, spec.keys) {
        Ok(k) => Arc::new(k),
        Err(e) => return PointResult::failed(spec.value_bytes as u64, spec.clients, e),
    };
    let connect = |_| transport.connect(service, Arc::clone(&keys), spec.value_bytes);
    load::run_with(spec, connect, between)
}

/// Distinct keys `k0`, `k1`, ... in the plain-key namespace of `tenant` (the same keys the
/// RESP front would use for those names).
pub(crate) fn keys(tenant: &TenantId, count: u64) -> Result<Vec<PhysicalKey>, String> {
    let ns = IdentityTemplate::for_tenant(tenant).map_err(|e| format!("key namespace: {e}"))?;
    (0..count)
        .map(|i| ns.key_for(format!("k{i}").as_bytes()).map_err(|e| format!("key {i}: {e}")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_service::config::{StoreKind, ValidConfig};
    use gpucache_storage::file::{Durability, Layout};

    #[test]
    fn the_generated_config_is_valid_and_sized() {
        let text = serve_config([7001, 7002, 7003], 4 << 20, 1 << 30, None, &StoreConfig::Memory);
        let c = ValidConfig::from_toml_str(&text).expect("valid");
        assert_eq!(c.store.kind, StoreKind::Memory);
        assert_eq!(c.local_socket(), None, "the TCP row's service has no local socket");
        assert!(c.limits.retained_bytes_max >= (1 << 30) + (8 << 20));
        assert!(c.limits.object_bytes_max >= 4 << 20);
        assert_eq!(c.listen.native, loopback(7001));
        assert_eq!(c.tenants[0].name, TENANT);
        let dir = tempfile::tempdir().expect("dir");
        let sock = dir.path().join("ours-shm-1048576-1.sock");
        let text =
            serve_config([7001, 7002, 7003], 1 << 20, 1 << 30, Some(&sock), &StoreConfig::Memory);
        let c = ValidConfig::from_toml_str(&text).expect("valid with a socket");
        assert_eq!(c.local_socket(), Some(sock));
    }

    #[test]
    fn the_file_store_config_names_its_root_and_durability_and_no_socket() {
        let dir = tempfile::tempdir().expect("dir");
        let root = dir.path().join("store-ours-file-none-1048576-8");
        for (name, durability, layout, expect) in [
            ("none", Durability::None, "files", Layout::Files),
            ("per-block", Durability::PerBlock, "log", Layout::Log),
        ] {
            let store = StoreConfig::File { root: &root, durability: name, layout };
            let text = serve_config([7001, 7002, 7003], 1 << 20, 512 << 20, None, &store);
            let c = ValidConfig::from_toml_str(&text).expect("valid");
            assert_eq!(c.store.kind, StoreKind::File);
            assert_eq!(c.store.root, root);
            let f = c.file_store_config();
            assert_eq!(f.durability, durability, "{text}");
            assert_eq!(f.layout, expect, "{text}");
            // Without `local = ""` a file store would offer a socket inside its root.
            assert_eq!(c.local_socket(), None, "{text}");
            assert!(c.limits.retained_bytes_max >= (512 << 20) + (2 << 20));
        }
    }

    #[test]
    fn segments_hold_both_buffers() {
        assert_eq!(segment_bytes(1 << 20), 3 << 20);
        assert_eq!(segment_bytes(100), (1 << 20) + 8192);
        assert!(segment_bytes(16) >= SEGMENT_BYTES_MIN);
    }

    #[test]
    fn keys_are_distinct() {
        let k = keys(&TenantId::parse(TENANT).expect("tenant"), 3).expect("keys");
        assert_ne!(k[0], k[1]);
        assert_ne!(k[1], k[2]);
    }
}
