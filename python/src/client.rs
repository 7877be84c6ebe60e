//! `Client`: one tenant's connection to a `gpucache serve`, over TCP or the same-host
//! shared-memory path (ADR 0013), through the Rust `TcpStore` (pooled connections, pipelined
//! batches). Every call that waits releases the GIL.

use std::borrow::Cow;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpucache_client::key_file::read_key_file;
use gpucache_client::{ClientConfig, ConnectError, Credentials, LocalConfig, TcpStore};
use gpucache_cluster::{ClusterClient, ClusterClientConfig, EtcdConfig, ReplicaPolicy};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{
    BatchGet, BatchPut, FullPolicy, Get, Implementation, Invalidate, Located, Lookup, PurgeScope,
    Put, Store, StoreError, Tier,
};
use gpucache_storage::host::segment::{Pages, SEGMENT_BYTES_MAX, SEGMENT_BYTES_MIN, SharedBuf};
use gpucache_wire::namespace::IdentityTemplate;
use gpucache_wire::{BATCH_ITEMS_MAX, PAYLOAD_BYTES_MAX};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString};

use crate::buffers::{Access, Range, Span, disjoint, range_of};
use crate::errors::{from_connect, from_refusal, from_store, refused};
use crate::keys::Key;

/// Most host ranges one client keeps registered at once.
pub(crate) const REGISTERED_BUFFERS_MAX: usize = 64;
/// Most keys one batch call takes (it is split into frames of [`BATCH_ITEMS_MAX`] keys).
pub(crate) const BATCH_KEYS_MAX: usize = 64 * BATCH_ITEMS_MAX;
/// How many times `get` looks a key up again when its block changed size between the lookup
/// and the read (it was removed and stored again).
const GET_ATTEMPTS: usize = 3;
/// The shared segment of the same-host path, unless `segment_bytes=` says otherwise.
const SEGMENT_BYTES_DEFAULT: u64 = 256 << 20;

/// Which transport `local=` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LocalMode {
    Auto,
    Required,
    Off,
}

/// One tenant's client of a `gpucache serve` native (GPCW) listener.
///
/// `Client(address="127.0.0.1:7470", tenant="default", key_file=None, key_id=None,
/// local="auto", timeout_s=30.0, segment_bytes=256 MiB, client_name="gpucache-python")`. The
/// session opens here: an unreachable server raises UnavailableError, an unknown tenant or
/// refused key RefusedError. `key_file` is a tenant key file (mode 0600, the server's format);
/// `key_id` picks a key when it holds several. `local="auto"` takes the same-host path (a
/// memfd segment of `segment_bytes` shared with the server) when the server offers it and TCP
/// otherwise, `True` requires it, `False` is TCP only. `timeout_s` bounds each request.
#[pyclass(module = "gpucache._native", frozen)]
pub struct Client {
    /// What every call goes to: the one server's `TcpStore`, or the cluster's router.
    store: Arc<dyn Store>,
    /// The one server's client (None for a cluster): the same-host path and its counters.
    tcp: Option<Arc<TcpStore>>,
    /// The cluster's router, for a client made by `Client.cluster`.
    cluster: Option<Arc<ClusterClient>>,
    caller: Caller,
    namespace: IdentityTemplate,
    address: SocketAddr,
    /// The socket the server offered to same-host clients, as learnt at connect (`None` when
    /// it was not asked).
    offered: Option<Option<String>>,
    /// Why `local="auto"` fell back to TCP, when it did.
    fallback: Option<String>,
    segment_bytes: u64,
    /// Registered ranges: address, length, whether inside the shared segment.
    registered: Mutex<Vec<(usize, usize, bool)>>,
    closed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("tenant", &self.caller.tenant)
            .field("address", &self.address)
            .field("cluster", &self.cluster.is_some())
            .finish_non_exhaustive()
    }
}

/// Where one key argument came from: a `Key` is borrowed (a batch call clones no key), a plain
/// name is mapped into the tenant's namespace.
fn key_of<'a>(ns: &IdentityTemplate, obj: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, PhysicalKey>> {
    if let Ok(k) = obj.cast::<Key>() {
        return Ok(Cow::Borrowed(&k.get().key));
    }
    let name: Vec<u8> = if let Ok(s) = obj.cast::<PyString>() {
        s.to_cow()?.as_bytes().to_vec()
    } else if let Ok(b) = obj.cast::<PyBytes>() {
        b.as_bytes().to_vec()
    } else {
        return Err(PyTypeError::new_err(
            "a key is a gpucache.Key, or a plain name (str or bytes)",
        ));
    };
    ns.key_for(&name).map(Cow::Owned).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn resolve(addr: &str) -> PyResult<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| PyValueError::new_err(format!("address {addr:?} resolves to nothing")))
}

fn duration(timeout_s: f64) -> PyResult<Duration> {
    if !(timeout_s.is_finite() && timeout_s > 0.0 && timeout_s <= 86_400.0) {
        return Err(PyValueError::new_err("timeout_s must be in (0, 86400]"));
    }
    Ok(Duration::from_secs_f64(timeout_s))
}

fn local_mode(local: &Bound<'_, PyAny>) -> PyResult<LocalMode> {
    if let Ok(b) = local.cast::<PyBool>() {
        return Ok(if b.is_true() { LocalMode::Required } else { LocalMode::Off });
    }
    match local.extract::<String>().as_deref() {
        Ok("auto") => Ok(LocalMode::Auto),
        _ => Err(PyValueError::new_err("local must be \"auto\", True or False")),
    }
}

/// The credentials of a key file: key `key_id`, or its only key.
fn credentials(path: &Path, key_id: Option<&str>) -> PyResult<Credentials> {
    let keys = read_key_file(path).map_err(|e| refused("key_file", e.to_string()))?;
    let key = match key_id {
        Some(id) => keys.into_iter().find(|k| k.id == id).ok_or_else(|| {
            refused("key_file", format!("{}: no key with id {id:?}", path.display()))
        })?,
        None if keys.len() == 1 => keys
            .into_iter()
            .next()
            .ok_or_else(|| refused("key_file", format!("{}: holds no key", path.display())))?,
        None => {
            return Err(refused(
                "key_file",
                format!("{} holds {} keys: say which with key_id=", path.display(), keys.len()),
            ));
        }
    };
    Ok(Credentials::new(key.id, key.secret))
}

/// What every client of `tenant` starts from: its caller, its connection settings (request
/// deadline, name, the key file's credentials) and the namespace its plain names map into.
fn session(
    addr: SocketAddr,
    tenant: &TenantId,
    key_file: Option<&Path>,
    key_id: Option<&str>,
    timeout_s: f64,
    client_name: &str,
) -> PyResult<(Caller, ClientConfig, IdentityTemplate)> {
    let caller = Caller::new(tenant.clone(), Rights::READ_WRITE);
    let mut config = ClientConfig::new(addr, caller.clone());
    config.deadline = duration(timeout_s)?;
    config.handshake_deadline = config.handshake_deadline.min(config.deadline);
    config.client_name = client_name.to_owned();
    if let Some(path) = key_file {
        config = config.with_credentials(tenant.clone(), credentials(path, key_id)?);
    } else if key_id.is_some() {
        return Err(PyValueError::new_err("key_id= needs key_file="));
    }
    let namespace =
        IdentityTemplate::for_tenant(tenant).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((caller, config, namespace))
}

/// Whether a failed same-host connect may fall back to TCP under `local="auto"`: the server
/// offers no socket, or the one it offers cannot be reached from here.
fn may_fall_back(e: &ConnectError) -> bool {
    match e {
        ConnectError::NoLocalSocket => true,
        ConnectError::Unreachable { addr, .. } => addr.starts_with("local socket"),
        _ => false,
    }
}

impl Client {
    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Whether calls take the same-host path.
    fn is_local(&self) -> bool {
        self.tcp.as_ref().is_some_and(|t| t.is_local())
    }

    pub(crate) fn caller(&self) -> &Caller {
        &self.caller
    }

    /// A key argument (a Key or a plain name of this client's tenant).
    pub(crate) fn key_of(&self, obj: &Bound<'_, PyAny>) -> PyResult<PhysicalKey> {
        key_of(&self.namespace, obj).map(Cow::into_owned)
    }

    /// Whether `len` bytes at `ptr` lie inside the segment shared with the server.
    fn in_segment(&self, ptr: usize, len: usize) -> bool {
        self.tcp.as_ref().and_then(|t| t.shared_segment_span()).is_some_and(|(base, seg)| {
            ptr >= base && ptr.checked_add(len).is_some_and(|end| end <= base + seg)
        })
    }

    fn check_open(&self) -> PyResult<()> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(crate::errors::unavailable("the client is closed"));
        }
        Ok(())
    }

    fn keys<'a>(&self, keys: &'a [Bound<'_, PyAny>]) -> PyResult<Vec<Cow<'a, PhysicalKey>>> {
        if keys.len() > BATCH_KEYS_MAX {
            return Err(PyValueError::new_err(format!(
                "{} keys: one batch takes at most {BATCH_KEYS_MAX}",
                keys.len()
            )));
        }
        keys.iter().map(|k| key_of(&self.namespace, k)).collect()
    }

    fn lookups(&self, py: Python<'_>, keys: &[Cow<'_, PhysicalKey>]) -> PyResult<Vec<bool>> {
        self.check_open()?;
        let refs: Vec<&PhysicalKey> = keys.iter().map(|k| &**k).collect();
        let answers = py.detach(|| self.store.lookup_batch(&self.caller, &refs));
        answers
            .into_iter()
            .map(|a| match a {
                Ok(Lookup::Hit { .. }) => Ok(true),
                Ok(Lookup::PrefixHit { .. } | Lookup::Miss(_)) => Ok(false),
                Err(e) => Err(from_store(&e)),
            })
            .collect()
    }

    /// One range per item: `objs[i]` with `sizes[i]`.
    fn ranges(
        objs: &[Bound<'_, PyAny>],
        sizes: Option<Vec<Option<usize>>>,
        access: Access,
    ) -> PyResult<Vec<Range>> {
        let sizes = match sizes {
            Some(s) if s.len() != objs.len() => {
                return Err(PyValueError::new_err(format!(
                    "{} buffers but {} sizes",
                    objs.len(),
                    s.len()
                )));
            }
            Some(s) => s,
            None => vec![None; objs.len()],
        };
        objs.iter().zip(sizes).map(|(o, s)| range_arg(o, s, access)).collect()
    }

    fn gets(
        &self,
        py: Python<'_>,
        keys: &[Cow<'_, PhysicalKey>],
        dsts: &[Range],
    ) -> PyResult<Vec<Option<usize>>> {
        self.check_open()?;
        if keys.len() != dsts.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys but {} destinations",
                keys.len(),
                dsts.len()
            )));
        }
        disjoint(dsts)?;
        let spans: Vec<Span> = dsts.iter().map(Span::of).collect();
        let answers = py.detach(|| {
            let mut items: Vec<BatchGet<'_>> = keys
                .iter()
                .zip(&spans)
                // SAFETY: every range is held (view, tensor reference, or the caller's raw
                // address) until after this call, and no two overlap (checked above).
                .map(|(key, s)| BatchGet { key, dst: unsafe { s.bytes_mut() } })
                .collect();
            self.store.get_batch(&self.caller, &mut items)
        });
        batch_answers(answers, |a| match a {
            Ok(Get::Hit { len, .. }) => Ok(Some(usize::try_from(len).unwrap_or(usize::MAX))),
            Ok(Get::Miss(_)) => Ok(None),
            Err(e) => Err(from_store(&e)),
        })
    }

    fn puts(
        &self,
        py: Python<'_>,
        keys: &[Cow<'_, PhysicalKey>],
        srcs: &[Range],
    ) -> PyResult<Vec<bool>> {
        self.check_open()?;
        if keys.len() != srcs.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys but {} sources",
                keys.len(),
                srcs.len()
            )));
        }
        let spans: Vec<Span> = srcs.iter().map(Span::of).collect();
        let answers = py.detach(|| {
            let items: Vec<BatchPut<'_>> = keys
                .iter()
                .zip(&spans)
                // SAFETY: every range is held until after this call and only read.
                .map(|(key, s)| BatchPut { key, src: unsafe { s.bytes() }, request: None })
                .collect();
            self.store.put_batch(&self.caller, &items)
        });
        batch_answers(answers, |a| match a {
            Ok(Put::Committed(_)) => Ok(true),
            Ok(Put::AlreadyCommitted) => Ok(false),
            Ok(Put::Busy) => Err(refused("busy", "another writer holds the key right now")),
            Ok(Put::Refused(r)) => Err(from_refusal(&r)),
            Err(e) => Err(from_store(&e)),
        })
    }
}

/// Every item's answer of a batch, or, when an item failed, the first failed item's exception
/// with `index` (that item) and `results` (every item's answer in order, each failed one as its
/// exception): the other items still ran, and the caller learns what each of them did.
fn batch_answers<T, U>(answers: Vec<T>, f: impl Fn(T) -> PyResult<U>) -> PyResult<Vec<U>>
where
    U: for<'py> IntoPyObject<'py>,
{
    let each: Vec<PyResult<U>> = answers.into_iter().map(f).collect();
    let Some(first) = each.iter().position(Result::is_err) else {
        return each.into_iter().collect();
    };
    Python::attach(|py| {
        let results = PyList::empty(py);
        let mut failed = None;
        for (i, answer) in each.into_iter().enumerate() {
            match answer {
                Ok(u) => results.append(u)?,
                Err(e) => {
                    results.append(e.value(py))?;
                    if i == first {
                        failed = Some(e);
                    }
                }
            }
        }
        let Some(e) = failed else { return Err(PyValueError::new_err("a batch lost its error")) };
        e.value(py).setattr("index", first)?;
        e.value(py).setattr("results", results)?;
        Err(e)
    })
}

impl Client {
    /// What `offers()` says of a client of a cluster: its view and what routing did.
    fn cluster_offers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cluster = self.cluster.as_ref().ok_or_else(|| PyValueError::new_err("no transport"))?;
        let view = cluster.view();
        let stats = ClusterClient::stats(cluster);
        let d = PyDict::new(py);
        d.set_item("version", crate::VERSION)?;
        d.set_item("tenant", self.caller.tenant.as_str())?;
        d.set_item("transport", "cluster")?;
        d.set_item("epoch", view.epoch)?;
        let members: Vec<(u64, String, &'static str)> =
            view.members.iter().map(|m| (m.node.0, m.address.clone(), m.state.name())).collect();
        d.set_item("members", members)?;
        d.set_item("views", stats.views)?;
        d.set_item("refused", stats.refused)?;
        d.set_item("unreachable_misses", stats.unreachable_misses)?;
        d.set_item("copies", stats.copies)?;
        d.set_item("copy_hits", stats.copy_hits)?;
        d.set_item("payload_bytes_max", PAYLOAD_BYTES_MAX)?;
        d.set_item("batch_items_max", BATCH_ITEMS_MAX)?;
        Ok(d)
    }
}

#[pymethods]
impl Client {
    /// A client of a cluster: `Client.cluster(etcd=["http://127.0.0.1:2379"], name="gpucache",
    /// tenant="default", key_file=None, key_id=None, timeout_s=30.0, poll_ms=200,
    /// client_name="gpucache-python", hot_reads=None, hot_window_ms=1000)`. With `hot_reads`,
    /// a block read that many times within `hot_window_ms` gets an extra copy on its second
    /// choice, and its reads then alternate between the two. It reads the cluster's view from etcd (raising
    /// UnavailableError when etcd does not answer), routes every key to the member that owns
    /// it, and splits each batch per member. A read from a member that is unreachable or
    /// behind the view is a miss; a write there raises.
    #[staticmethod]
    #[pyo3(signature = (
        etcd, name = "gpucache", tenant = "default", key_file = None, key_id = None,
        timeout_s = 30.0, poll_ms = 200, client_name = "gpucache-python", hot_reads = None,
        hot_window_ms = 1000
    ))]
    #[allow(clippy::too_many_arguments)]
    fn cluster(
        py: Python<'_>,
        etcd: Vec<String>,
        name: &str,
        tenant: &str,
        key_file: Option<PathBuf>,
        key_id: Option<&str>,
        timeout_s: f64,
        poll_ms: u64,
        client_name: &str,
        hot_reads: Option<u32>,
        hot_window_ms: u64,
    ) -> PyResult<Self> {
        if etcd.is_empty() {
            return Err(PyValueError::new_err("etcd= needs at least one URL"));
        }
        let tenant_id =
            TenantId::parse(tenant).map_err(|e| PyValueError::new_err(e.to_string()))?;
        // The address is each member's own; this one is never dialled.
        let unused = SocketAddr::from(([127, 0, 0, 1], 0));
        let (caller, config, namespace) =
            session(unused, &tenant_id, key_file.as_deref(), key_id, timeout_s, client_name)?;
        let mut etcd = EtcdConfig::new(etcd, name);
        let deadline_ms = u64::try_from(config.deadline.as_millis()).unwrap_or(u64::MAX);
        etcd.request_timeout_ms = deadline_ms.min(gpucache_cluster::REQUEST_TIMEOUT_MS_DEFAULT);
        let cluster = py
            .detach(|| {
                let mut cluster = ClusterClientConfig::new(etcd, config);
                cluster.poll_ms = poll_ms;
                cluster.replicate =
                    hot_reads.map(|reads| ReplicaPolicy { reads, window_ms: hot_window_ms });
                ClusterClient::connect(cluster)
            })
            .map_err(|e| crate::errors::unavailable(e.to_string()))?;
        let cluster = Arc::new(cluster);
        Ok(Self {
            store: Arc::clone(&cluster) as Arc<dyn Store>,
            tcp: None,
            cluster: Some(cluster),
            caller,
            namespace,
            address: unused,
            offered: None,
            fallback: None,
            segment_bytes: 0,
            registered: Mutex::new(Vec::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    #[new]
    #[pyo3(signature = (
        address = "127.0.0.1:7470", tenant = "default", key_file = None, key_id = None,
        local = None, timeout_s = 30.0, segment_bytes = SEGMENT_BYTES_DEFAULT,
        client_name = "gpucache-python"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        address: &str,
        tenant: &str,
        key_file: Option<PathBuf>,
        key_id: Option<&str>,
        local: Option<&Bound<'_, PyAny>>,
        timeout_s: f64,
        segment_bytes: u64,
        client_name: &str,
    ) -> PyResult<Self> {
        let addr = resolve(address)?;
        let tenant_id =
            TenantId::parse(tenant).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let mode = match local {
            None => LocalMode::Auto,
            Some(l) => local_mode(l)?,
        };
        if !(SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&segment_bytes) {
            return Err(PyValueError::new_err(format!(
                "segment_bytes must be in {SEGMENT_BYTES_MIN}..={SEGMENT_BYTES_MAX}"
            )));
        }
        let (caller, config, namespace) =
            session(addr, &tenant_id, key_file.as_deref(), key_id, timeout_s, client_name)?;
        let local_config =
            LocalConfig { segment_bytes, pages: Pages::Normal, ..LocalConfig::negotiated() };
        let (store, offered, fallback) = py
            .detach(|| -> Result<_, ConnectError> {
                if mode == LocalMode::Off {
                    let store = TcpStore::new(config);
                    store.handshake(&caller)?;
                    return Ok((store, None, None));
                }
                let mut shared = config.clone();
                shared.local = Some(local_config);
                let store = TcpStore::new(shared);
                match store.handshake(&caller) {
                    Ok(()) => {
                        let offered = store.offered_local_socket(&caller).ok().flatten();
                        Ok((store, Some(offered), None))
                    }
                    Err(e) if mode == LocalMode::Auto && may_fall_back(&e) => {
                        let offered = !matches!(e, ConnectError::NoLocalSocket);
                        let store = TcpStore::new(config);
                        store.handshake(&caller)?;
                        let seen = if offered {
                            store.offered_local_socket(&caller).ok().flatten()
                        } else {
                            None
                        };
                        Ok((store, Some(seen), Some(e.to_string())))
                    }
                    Err(e) => Err(e),
                }
            })
            .map_err(|e| from_connect(&e))?;
        let tcp = Arc::new(store);
        Ok(Self {
            store: Arc::clone(&tcp) as Arc<dyn Store>,
            tcp: Some(tcp),
            cluster: None,
            caller,
            namespace,
            address: addr,
            offered,
            fallback,
            segment_bytes,
            registered: Mutex::new(Vec::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// What the server offers and what this client uses: `version` (this package), `address`,
    /// `tenant`, `transport` ("local" or "tcp"), `same_host_offered` (bool, or None when not
    /// asked), `local_socket`, `fallback` (why "auto" took TCP), `object_bytes_max` (None when
    /// the server states none), `payload_bytes_max`, `batch_items_max`, `server` (its store's
    /// implementation and full_policy), `failures_retire` (whether a failed call has stopped
    /// touching its buffers), `shared` (the same-host path's counters).
    fn offers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_open()?;
        let Some(tcp) = &self.tcp else { return self.cluster_offers(py) };
        let (limits, info, offered, stats) = py.detach(|| {
            let offered = match &self.offered {
                Some(o) => Ok(o.clone()),
                None => tcp.offered_local_socket(&self.caller),
            };
            (tcp.limits(), tcp.info(), offered, tcp.shared_stats())
        });
        let limits = limits.map_err(|e| from_store(&e))?;
        let d = PyDict::new(py);
        d.set_item("version", crate::VERSION)?;
        d.set_item("address", self.address.to_string())?;
        d.set_item("tenant", self.caller.tenant.as_str())?;
        d.set_item("transport", if self.is_local() { "local" } else { "tcp" })?;
        match offered {
            Ok(path) => {
                d.set_item("same_host_offered", path.is_some())?;
                d.set_item("local_socket", path)?;
            }
            Err(e) => {
                d.set_item("same_host_offered", py.None())?;
                d.set_item("local_socket", py.None())?;
                d.set_item("same_host_error", e.to_string())?;
            }
        }
        d.set_item("fallback", self.fallback.clone())?;
        d.set_item("object_bytes_max", limits.object_bytes_max)?;
        d.set_item("payload_bytes_max", PAYLOAD_BYTES_MAX)?;
        d.set_item("batch_items_max", BATCH_ITEMS_MAX)?;
        let server = PyDict::new(py);
        server.set_item(
            "implementation",
            match info.implementation {
                Implementation::Real => "real".to_owned(),
                Implementation::Simulated { seed } => format!("simulated(seed={seed})"),
            },
        )?;
        server.set_item(
            "full_policy",
            match info.full_policy {
                FullPolicy::Refuse => "refuse",
                FullPolicy::EvictOldest => "evict_oldest",
                FullPolicy::Evict => "evict",
            },
        )?;
        d.set_item("server", server)?;
        // False on the same-host path: a failed GET may still be written by the server.
        d.set_item("failures_retire", info.failures_retire)?;
        let shared = PyDict::new(py);
        shared.set_item("segment_bytes", if self.is_local() { self.segment_bytes } else { 0 })?;
        shared.set_item("direct_items", stats.direct_items)?;
        shared.set_item("bounced_items", stats.bounced_items)?;
        shared.set_item("framed_batches", stats.framed_batches)?;
        shared.set_item("quarantined_bytes", stats.quarantined_bytes)?;
        shared.set_item("free_bytes", stats.free_bytes)?;
        d.set_item("shared", shared)?;
        Ok(d)
    }

    /// The tenant this client acts as.
    #[getter]
    fn tenant(&self) -> &str {
        self.caller.tenant.as_str()
    }

    /// "local" (same-host shared segment), "tcp", or "cluster" (a client made by
    /// `Client.cluster`).
    #[getter]
    fn transport(&self) -> &'static str {
        match (&self.cluster, self.is_local()) {
            (Some(_), _) => "cluster",
            (None, true) => "local",
            (None, false) => "tcp",
        }
    }

    /// The key a plain name maps to for this client's tenant.
    fn key(&self, name: &Bound<'_, PyAny>) -> PyResult<Key> {
        key_of(&self.namespace, name).map(|key| Key { key: key.into_owned() })
    }

    /// Whether the exact key holds a committed block.
    fn exists(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = [key_of(&self.namespace, key)?];
        Ok(self.lookups(py, &k)?[0])
    }

    /// `exists` for many keys, in one pipelined exchange.
    fn batch_exists(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let keys = self.keys(&keys)?;
        self.lookups(py, &keys)
    }

    /// Per key, which tier of the server's store holds its block: "memory" or "file" for a
    /// tiered store, "single" for a store of one tier, None when the exact key holds none.
    /// A lookup, not a read: no eviction policy hears of it.
    fn batch_tier(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Option<&'static str>>> {
        self.check_open()?;
        let keys = self.keys(&keys)?;
        let refs: Vec<&PhysicalKey> = keys.iter().map(|k| &**k).collect();
        let answers = py.detach(|| self.store.locate(&self.caller, &refs));
        answers
            .into_iter()
            .map(|a| match a {
                Ok(Located { lookup: Lookup::Hit { .. }, tier }) => {
                    Ok(Some(tier.map_or("single", Tier::name)))
                }
                Ok(_) => Ok(None),
                Err(e) => Err(from_store(&e)),
            })
            .collect()
    }

    /// How many leading keys hold a block (the length of the cached prefix).
    fn prefix_len(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<usize> {
        let keys = self.keys(&keys)?;
        Ok(self.lookups(py, &keys)?.iter().take_while(|&&b| b).count())
    }

    /// The block's bytes, or None on a miss (absent, or unusable: a corrupt block is a miss).
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        self.check_open()?;
        let key = key_of(&self.namespace, key)?;
        let got = py.detach(|| -> Result<Option<Vec<u8>>, StoreError> {
            let mut last = None;
            for _ in 0..GET_ATTEMPTS {
                let len = match self.store.lookup(&self.caller, &key)? {
                    Lookup::Hit { len } => len,
                    Lookup::PrefixHit { .. } | Lookup::Miss(_) => return Ok(None),
                };
                let len = usize::try_from(len.min(PAYLOAD_BYTES_MAX)).unwrap_or(0);
                let mut buf = vec![0u8; len];
                match self.store.get_into(&self.caller, &key, &mut buf) {
                    Ok(Get::Hit { len, .. }) => {
                        buf.truncate(usize::try_from(len).unwrap_or(0));
                        return Ok(Some(buf));
                    }
                    Ok(Get::Miss(_)) => return Ok(None),
                    // Removed and stored again, larger, between the lookup and the read.
                    Err(e @ StoreError::BufferTooSmall { .. }) => last = Some(e),
                    Err(e) => return Err(e),
                }
            }
            Err(last.unwrap_or(StoreError::EmptyObject))
        });
        match got {
            Ok(v) => Ok(v.map(|b| PyBytes::new(py, &b))),
            Err(e) => Err(from_store(&e)),
        }
    }

    /// Stores `data` (bytes or any buffer) under the key. True: committed now; False: the key
    /// already held a block, which stays (the store is create-only).
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let key = [key_of(&self.namespace, key)?];
        let src = [range_arg(data, None, Access::Read)?];
        Ok(self.puts(py, &key, &src)?[0])
    }

    /// Reads the block into `dst` (an int address with `size`, a writable buffer, or a CPU
    /// torch tensor): the bytes written, or None on a miss.
    #[pyo3(signature = (key, dst, size = None))]
    fn get_into(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        size: Option<usize>,
    ) -> PyResult<Option<usize>> {
        let key = [key_of(&self.namespace, key)?];
        let dst = [range_arg(dst, size, Access::Write)?];
        Ok(self.gets(py, &key, &dst)?[0])
    }

    /// `get_into` for many keys, in one pipelined exchange; the destinations must not overlap.
    #[pyo3(signature = (keys, dsts, sizes = None))]
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        dsts: Vec<Bound<'_, PyAny>>,
        sizes: Option<Vec<Option<usize>>>,
    ) -> PyResult<Vec<Option<usize>>> {
        let keys = self.keys(&keys)?;
        let dsts = Self::ranges(&dsts, sizes, Access::Write)?;
        self.gets(py, &keys, &dsts)
    }

    /// Stores `size` bytes of `src` (an int address with `size`, a buffer, or a CPU tensor).
    #[pyo3(signature = (key, src, size = None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
        size: Option<usize>,
    ) -> PyResult<bool> {
        let key = [key_of(&self.namespace, key)?];
        let src = [range_arg(src, size, Access::Read)?];
        Ok(self.puts(py, &key, &src)?[0])
    }

    /// `put_from` for many keys, in one pipelined exchange.
    #[pyo3(signature = (keys, srcs, sizes = None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        srcs: Vec<Bound<'_, PyAny>>,
        sizes: Option<Vec<Option<usize>>>,
    ) -> PyResult<Vec<bool>> {
        let keys = self.keys(&keys)?;
        let srcs = Self::ranges(&srcs, sizes, Access::Read)?;
        self.puts(py, &keys, &srcs)
    }

    /// Removes the key's block: True when it was there.
    fn remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.check_open()?;
        let key = key_of(&self.namespace, key)?;
        match py.detach(|| self.store.invalidate(&self.caller, &key)) {
            Ok(Invalidate::Removed) => Ok(true),
            Ok(Invalidate::Absent) => Ok(false),
            Ok(Invalidate::Busy) => Err(refused("busy", "a writer or reader holds the key now")),
            Err(e) => Err(from_store(&e)),
        }
    }

    /// Removes from the server every committed block of the namespace `key` belongs to: the
    /// blocks of this tenant whose model fields (model and its config, revisions, trust domain,
    /// adapter) are `key`'s and whose layout name begins with `layout_prefix`, whatever their
    /// shard (TP/PP rank and size), dtype, block size or chain: what every rank and instance of
    /// one engine connector stored. One PURGE request per PURGE_BLOCKS_MAX blocks, sent until
    /// none remain. Needs the write right. Returns (removed, busy, more): blocks removed,
    /// blocks a reader or writer held (they stay), and whether some of the namespace may
    /// remain. Not on a client of a cluster (RefusedError "purge").
    #[pyo3(signature = (key, layout_prefix = ""))]
    fn purge(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        layout_prefix: &str,
    ) -> PyResult<(u64, u64, bool)> {
        self.check_open()?;
        let Some(tcp) = self.tcp.as_ref() else {
            return Err(refused("purge", "a client of a cluster cannot purge a namespace"));
        };
        let key = key_of(&self.namespace, key)?.into_owned();
        let scope = PurgeScope::new(key, layout_prefix)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        match py.detach(|| tcp.purge(&self.caller, &scope)) {
            Ok(p) => Ok((p.removed, p.busy, p.more)),
            Err(e) => Err(from_store(&e)),
        }
    }

    /// Registers a host range (an engine's KV pool) that later calls will name ranges of.
    /// Returns whether the range lies inside the segment shared with the server (made from
    /// `shared_buffer`): then a GET into it is written by the server's own read and a PUT from
    /// it read by the server's own write, with no copy in this process; any other range costs
    /// one copy in this process each way (docs/adr/0021-python-engine-buffers.md). Overlapping
    /// ranges and more than REGISTERED_BUFFERS_MAX of them are refused.
    #[pyo3(signature = (dst_or_ptr, size = None))]
    fn register_buffer(
        &self,
        dst_or_ptr: &Bound<'_, PyAny>,
        size: Option<usize>,
    ) -> PyResult<bool> {
        let r = range_arg(dst_or_ptr, size, Access::Write)?;
        if r.len == 0 {
            return Err(PyValueError::new_err("an empty range cannot be registered"));
        }
        let direct = self.in_segment(r.ptr, r.len);
        let mut reg = self.registered.lock().map_err(|_| PyValueError::new_err("poisoned"))?;
        if reg.len() >= REGISTERED_BUFFERS_MAX {
            return Err(refused(
                "registrations",
                format!("{REGISTERED_BUFFERS_MAX} ranges are registered already"),
            ));
        }
        let (start, end) = (r.ptr, r.ptr + r.len);
        if let Some(&(s, l, _)) = reg.iter().find(|&&(s, l, _)| start < s + l && s < end) {
            return Err(PyValueError::new_err(format!(
                "range {start:#x}+{} overlaps the registered {s:#x}+{l}",
                r.len
            )));
        }
        reg.push((start, r.len, direct));
        Ok(direct)
    }

    /// Forgets the registered range that starts at `ptr` (an int, or the object registered).
    fn unregister_buffer(&self, ptr: &Bound<'_, PyAny>) -> PyResult<()> {
        let start = match ptr.extract::<usize>() {
            Ok(p) => p,
            Err(_) => range_arg(ptr, None, Access::Read)?.ptr,
        };
        let mut reg = self.registered.lock().map_err(|_| PyValueError::new_err("poisoned"))?;
        let before = reg.len();
        reg.retain(|&(s, _, _)| s != start);
        if reg.len() == before {
            return Err(PyValueError::new_err(format!("no registered range starts at {start:#x}")));
        }
        Ok(())
    }

    /// The registered ranges, as (address, size, direct): direct when inside the shared segment.
    fn registered_buffers(&self) -> PyResult<Vec<(usize, usize, bool)>> {
        Ok(self.registered.lock().map_err(|_| PyValueError::new_err("poisoned"))?.clone())
    }

    /// A buffer of `size` bytes inside the segment shared with the server (same-host path
    /// only): a GET into it is written there by the server, a PUT from it read from there, with
    /// no copy in this process. None when the segment has no free range that large.
    fn shared_buffer(&self, size: usize) -> PyResult<Option<SharedBuffer>> {
        self.check_open()?;
        let Some(tcp) = self.tcp.as_ref().filter(|t| t.is_local()) else {
            return Err(refused(
                "not_local",
                "shared buffers need the same-host path (local=True)",
            ));
        };
        if size == 0 {
            return Err(PyValueError::new_err("size must be positive"));
        }
        Ok(tcp.shared_buffer(size).map(|buf| SharedBuffer { buf }))
    }

    /// An executor over this client (see `gpucache.Executor`).
    #[pyo3(signature = (allocation_bytes, **kwargs))]
    fn executor<'py>(
        slf: &Bound<'py, Self>,
        allocation_bytes: u64,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Looked up in the module rather than named here: the executor module builds on this
        // one, so this one does not import it.
        let cls = PyModule::import(slf.py(), "gpucache._native")?.getattr("Executor")?;
        cls.call((slf, allocation_bytes), kwargs)
    }

    /// Marks the client closed: later calls raise UnavailableError. Its connections close
    /// when the client is collected.
    fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::Release);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "Client({}, tenant={:?}, transport={})",
            self.address,
            self.caller.tenant.as_str(),
            self.transport()
        )
    }
}

/// A range of the shared segment, owned by Python: `ptr` and `size` name it; pass the object
/// itself (or `ptr` with `size`) to `get_into` / `put_from`. The range goes back to the segment
/// when the object is collected (a call in progress keeps it alive).
#[pyclass(module = "gpucache._native", frozen)]
#[derive(Debug)]
pub struct SharedBuffer {
    buf: SharedBuf,
}

#[pymethods]
impl SharedBuffer {
    /// The address of the first byte.
    #[getter]
    fn ptr(&self) -> usize {
        self.buf.as_ptr() as usize
    }

    #[getter]
    fn size(&self) -> usize {
        self.buf.len()
    }

    fn __len__(&self) -> usize {
        self.buf.len()
    }

    fn __repr__(&self) -> String {
        format!("SharedBuffer(offset={}, size={})", self.buf.offset(), self.buf.len())
    }
}

/// `obj` as a byte range: a [`SharedBuffer`], or whatever [`range_of`] takes.
fn range_arg(obj: &Bound<'_, PyAny>, size: Option<usize>, access: Access) -> PyResult<Range> {
    match obj.cast::<SharedBuffer>() {
        Ok(b) => {
            let whole = b.get().buf.len();
            let len = match size {
                None => whole,
                Some(n) if n <= whole => n,
                Some(n) => {
                    return Err(PyValueError::new_err(format!(
                        "size={n} exceeds the shared buffer's {whole} bytes"
                    )));
                }
            };
            Ok(Range::held(b.get().buf.as_ptr() as usize, len, obj.clone().unbind()))
        }
        Err(_) => range_of(obj, size, access),
    }
}
