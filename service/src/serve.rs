//! `gpucache serve`: the store a validated configuration names, behind the native GPCW listener,
//! the RESP (Redis protocol) listener and the metrics/health endpoint, until SIGINT or SIGTERM.
//!
//! Startup order: block the stop signals (so every thread inherits the mask and only the main
//! thread receives them), open the store (a FileStore restart bumps the epoch and drops
//! unfinished writes), wrap it in the metrics recorder, start the listeners (native with its
//! same-host Unix socket, whose mode is then set to 0660; RESP; HTTP), then wait. A TCP port in
//! use is found before the store is opened, and a store root this start created is removed when
//! the start fails. Shutdown stops the native listener first (connections finish the request in
//! hand), then the RESP listener, then the HTTP endpoint, then closes the store. Everything it
//! says goes through `tracing` (the start line at info), so `--log-format json` covers it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use crate::config::{LOCAL_SOCKET_MODE, OpenedStore, ServeConfig, StoreKind};
use crate::dpu;
use crate::http::MetricsServer;
use crate::metered::{MeteredStore, Metrics, StagingGauges, register_limits};
use crate::ready::{Check, Probe};
use crate::resp::{RespConfig, RespLimits, RespServer};
use crate::{Server, ServerConfig};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::store::Store;
use gpucache_wire::staging::BlockStaging;
use prometheus_client::registry::Registry;

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a sigset_t we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// The block staging `[nixl]` asks for, with how the start line names it. Enabled but unable to
/// run here (built without the feature, `libnixl_capi.so` not found, no UCX plugin) is an
/// error with the typed reason: the service never starts without the staging it was told to
/// offer.
fn staging(config: &ServeConfig) -> Result<(Option<Arc<dyn BlockStaging>>, String), String> {
    let n = &config.nixl;
    if !n.enabled {
        return Ok((None, "none".to_owned()));
    }
    #[cfg(feature = "nixl")]
    {
        use gpucache_nic::nixl::NixlStagingConfig;
        use gpucache_storage::host::pool::{HugePagePolicy, Tier};
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
    #[cfg(not(feature = "nixl"))]
    {
        let reason = gpucache_nic::NixlUnavailable::NotBuilt;
        Err(gpucache_nic::NicError::NixlUnavailable { reason }.to_string())
    }
}

fn fail(what: &str, e: impl std::fmt::Display) -> ExitCode {
    tracing::error!("gpucache serve: {what}: {e}");
    ExitCode::from(2)
}

/// `gpucache dpu-agent`: `serve` for a configuration of `store.kind = "dpu"` only.
pub fn run_agent(config_path: &Path) -> ExitCode {
    match ServeConfig::load(config_path) {
        Ok(c) if c.store.kind == StoreKind::Dpu => serve(c),
        Ok(c) => fail(
            "store.kind",
            format!("dpu-agent runs store.kind = \"dpu\" only, this file has {:?}", c.store.kind),
        ),
        Err(e) => fail("invalid configuration", e),
    }
}

pub fn run(config_path: Option<&Path>) -> ExitCode {
    let config = match config_path {
        Some(p) => ServeConfig::load(p),
        None => Ok(ServeConfig::default()),
    };
    match config {
        Ok(c) => serve(c),
        Err(e) => fail("invalid configuration", e),
    }
}

/// The TCP listeners the configuration names, with the words an operator knows them by.
fn tcp_listeners(config: &ServeConfig) -> [(&'static str, SocketAddr); 3] {
    [
        ("native listener", config.listen.native),
        ("RESP listener", config.listen.resp),
        ("metrics listener", config.listen.metrics),
    ]
}

/// Binds each configured TCP address once and lets it go, before the store is opened, so that a
/// port in use is refused naming its listener and without touching the disk. (A port taken in
/// the moment between this and the real bind still fails below, naming the listener too.)
fn check_ports(config: &ServeConfig) -> Result<(), String> {
    for (name, addr) in tcp_listeners(config) {
        if addr.port() == 0 {
            continue;
        }
        if let Err(e) = std::net::TcpListener::bind(addr) {
            return Err(format!("{name} {addr}: {e}"));
        }
    }
    Ok(())
}

/// Removes a store root that this start created, when the start failed before serving: no
/// block was written, and an empty data directory left behind only misleads.
struct CreatedRoot(Option<PathBuf>);

impl CreatedRoot {
    fn before_open(config: &ServeConfig) -> Self {
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

/// Runs the service a loaded (validated) configuration describes until SIGINT or SIGTERM.
fn serve(config: ServeConfig) -> ExitCode {
    let signals = stop_signals();
    // SAFETY: blocks two signals for this thread (and the threads it starts); no memory shared.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut()) } != 0 {
        return fail("signals", std::io::Error::last_os_error());
    }
    if let Err(e) = check_ports(&config) {
        return fail("listen", e);
    }
    // After the signal mask: the NIXL agent starts threads, and they must inherit it.
    let (staging, staging_name) = match staging(&config) {
        Ok(s) => s,
        Err(e) => return fail("nixl.enabled", e),
    };
    let clock = Arc::new(MonotonicClock::default());
    let mut created_root = CreatedRoot::before_open(&config);
    let OpenedStore { store, dpu, io_engine } = match config.open(clock) {
        Ok(opened) => opened,
        Err(e) => return fail("store", e),
    };
    let mut registry = match &dpu {
        Some(d) => dpu::offload_registry(d.agent()),
        None => Registry::default(),
    };
    if let Some(staging) = &staging {
        StagingGauges::register(&mut registry, Arc::clone(staging));
    }
    register_limits(&mut registry, &config.limits());
    let mut checks = vec![
        Check::store_io(Arc::clone(&store)),
        Check::disk_room(Arc::clone(&store), config.limits.object_bytes_max),
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
    let tenants = match config.callers() {
        Ok(t) => t,
        Err(e) => return fail("tenants", e),
    };
    let mut server_config = ServerConfig::new(config.listen.native, tenants);
    server_config.connections_max = config.listen.connections_max;
    server_config.clock_skew_max =
        std::time::Duration::from_millis(config.listen.clock_skew_max_ms);
    server_config.auth = match config.tenant_auth() {
        Ok(a) => a,
        Err(e) => return fail("tenant keys", e),
    };
    let sealed = server_config.auth.len();
    // The RESP listener checks the same keys (re-read on change) with AUTH.
    let keys_by_tenant: std::collections::HashMap<_, _> =
        server_config.auth.iter().map(|(t, a)| (t.clone(), Arc::clone(&a.keys))).collect();
    server_config.local = config.local_socket();
    server_config.shm_mapped_bytes_max = config.listen.shm_mapped_bytes_max;
    server_config.staging = staging;
    // LIMITS states it, so a client refuses an oversize value before it reads or sends it.
    server_config.object_bytes_max = Some(config.limits.object_bytes_max);
    let shared: Arc<dyn Store> = metered.clone();
    // The local socket is bound with no access for others (the umask gains 007 for the moment
    // of binding), then chmod gives it LOCAL_SOCKET_MODE whatever the umask was.
    // SAFETY: umask only swaps the process's file creation mask; no memory is involved.
    let umask = unsafe { libc::umask(0o077) };
    // SAFETY: as above.
    unsafe { libc::umask(umask | 0o007) };
    let started = Server::start(server_config, Arc::clone(&shared));
    // SAFETY: as above, restoring the mask found.
    unsafe { libc::umask(umask) };
    let server = match started {
        Ok(s) => s,
        Err(e) => {
            let local = config.local_socket().map(|p| format!(" or local socket {}", p.display()));
            return fail(
                &format!("native listener {}{}", config.listen.native, local.unwrap_or_default()),
                e,
            );
        }
    };
    if let Some(path) = server.local_path().map(Path::to_path_buf) {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::Permissions::from_mode(LOCAL_SOCKET_MODE);
        if let Err(e) = std::fs::set_permissions(&path, mode) {
            let _ = server.shutdown();
            return fail(
                &format!("local socket {}: chmod {LOCAL_SOCKET_MODE:o}", path.display()),
                e,
            );
        }
    }
    let resp_caller = match config.resp_caller() {
        Ok(c) => c,
        Err(e) => return fail("tenants", e),
    };
    let resp_tenant = resp_caller.tenant.clone();
    let mut resp_config = match RespConfig::new(config.listen.resp, resp_caller) {
        Ok(c) => c,
        Err(e) => return fail("RESP key namespace", e),
    };
    resp_config.connections_max = config.listen.connections_max;
    resp_config.auth = keys_by_tenant.get(&resp_tenant).cloned();
    resp_config.limits = RespLimits::for_object_bytes_max(config.limits.object_bytes_max);
    let resp = match RespServer::start(resp_config, Arc::clone(&shared)) {
        Ok(s) => s,
        Err(e) => return fail(&format!("RESP listener {}", config.listen.resp), e),
    };
    let http = match MetricsServer::start(config.listen.metrics, metrics, ready) {
        Ok(h) => h,
        Err(e) => return fail(&format!("metrics listener {}", config.listen.metrics), e),
    };
    created_root.keep();
    let info = shared.info();
    let local = server.local_path().map_or_else(|| "none".to_owned(), |p| p.display().to_string());
    // The agent's own report, never a claim of its own: `offload=host-threads` on host threads.
    let offload = dpu.as_ref().map(|d| format!(" {}", dpu::offload_fields(d.agent())));
    let root = match config.store.kind {
        StoreKind::Memory => "none".to_owned(),
        _ => config.store.root.display().to_string(),
    };
    let (engine, engine_reason) =
        io_engine.map_or(("none", "no file store".to_owned()), |e| (e.engine, e.reason));
    let l = &config.limits;
    tracing::info!(
        "listening native={} local={local} resp={} metrics={} store={} epoch={} root={root} \
         io_engine={engine} object_bytes_max={} retained_bytes_max={} inflight_requests_max={} \
         connections_max={} resp_tenant={} sealed_tenants={sealed} staging={staging_name}{} \
         io_engine_reason=\"{engine_reason}\"",
        server.local_addr(),
        resp.local_addr(),
        http.local_addr(),
        info.name,
        shared.epoch().0,
        l.object_bytes_max,
        l.retained_bytes_max,
        l.inflight_requests_max,
        config.listen.connections_max,
        resp_tenant,
        offload.unwrap_or_default(),
    );
    if let Some(d) = &dpu {
        let c = &config.dpu;
        tracing::info!(
            "dpu agent backend={} state_dir={} queues_per_reactor={} queue_depth={} slab={}x{} \
             bytes",
            c.backend.as_str(),
            c.state_dir.display(),
            c.queues_per_reactor,
            c.queue_depth,
            c.slab_slots,
            c.slab_slot_bytes
        );
        for line in dpu::reactor_lines(d.agent()) {
            tracing::info!("dpu {line}");
        }
    }
    if config.nixl.enabled {
        let n = &config.nixl;
        tracing::info!(
            "block staging over NIXL ({staging_name}): {} slots of {} bytes, stage lease {} ms, \
             stages per connection {}, stages in all {}",
            n.slots(),
            n.slot_bytes,
            n.stage_lease_ms,
            n.per_connection_max,
            n.staged_max
        );
    }
    let mut signal: libc::c_int = 0;
    // SAFETY: waits for one of the blocked signals; `signal` is a valid out pointer.
    let waited = unsafe { libc::sigwait(&signals, &mut signal) };
    if waited != 0 {
        return fail("waiting for a stop signal", std::io::Error::from_raw_os_error(waited));
    }
    tracing::info!("signal {signal}, shutting down");
    let left = server.shutdown() + resp.shutdown();
    let http_left = http.shutdown();
    drop(shared);
    drop(metered);
    // The agent's reactors are joined when its last holder goes.
    drop(dpu);
    if left + http_left > 0 {
        tracing::error!("{} connection threads did not stop in time", left + http_left);
        return ExitCode::from(1);
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}
