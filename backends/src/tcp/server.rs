//! The native GPCW service: an accept thread and one thread per connection (ADR 0011), serving a
//! shared [`Store`] to authenticated tenants.
//!
//! A connection starts with HELLO, which names its tenant and the rights it asks for; it gets
//! the rights it asks for that its tenant's configuration grants, and keeps that identity until
//! it closes. Frames are answered in order. A frame-level error whose boundary is known is
//! answered and the connection continues; one that loses the stream (bad magic or header,
//! oversize, unknown version) is answered once and the connection closes. Nothing a client
//! sends can stop the accept loop or another connection.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::store::{Get, Put, Retirement, Store, StoreError};

use crate::listener::{
    Acceptor, AcceptorConfig, Connection, Gate, LocalListener, ReadTick, read_tick,
};
use crate::shm::Segment;

use super::proto::{
    Fetched, FrameDecoder, GetItem, Request, Response, SharedGetItem, SharedPutItem, VERSION,
    WireError,
};

/// How often a blocked read wakes to check for shutdown and idleness.
const READ_TICK: Duration = Duration::from_millis(100);
/// Bytes read from a socket per call.
const READ_CHUNK_BYTES: usize = 256 << 10;

/// How to run a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub addr: SocketAddr,
    /// Open connections at most; one more is answered `Busy` and closed.
    pub connections_max: u32,
    /// A connection with no complete request for this long is closed.
    pub idle_timeout: Duration,
    /// A response the client does not read within this long closes the connection.
    pub write_timeout: Duration,
    /// The tenants that may connect, each with the most rights it can be granted.
    pub tenants: Vec<Caller>,
    /// The name HELLO answers with.
    pub name: String,
    /// How long shutdown waits for connection threads.
    pub shutdown_deadline: Duration,
    /// A Unix socket for clients on this host: the same protocol, plus the shared-memory
    /// fast path (a client hands over a sealed memfd and payloads move through it). None by
    /// default.
    pub local: Option<PathBuf>,
    /// Bytes of client segments mapped at once, over all local connections; an attach past
    /// it is refused (the client keeps using the socket).
    pub shm_mapped_bytes_max: u64,
}

impl ServerConfig {
    pub fn new(addr: SocketAddr, tenants: Vec<Caller>) -> Self {
        Self {
            addr,
            connections_max: 256,
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(30),
            tenants,
            name: format!("gpucache/{}", env!("CARGO_PKG_VERSION")),
            shutdown_deadline: Duration::from_secs(10),
            local: None,
            shm_mapped_bytes_max: 16 << 30,
        }
    }
}

struct Shared {
    config: ServerConfig,
    store: Arc<dyn Store>,
    gate: Arc<Gate>,
    /// Bytes of client segments mapped now (bounded by `shm_mapped_bytes_max`).
    shm_mapped: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .field("store", &self.store.info())
            .field("gate", &self.gate)
            .finish()
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    acceptor: Acceptor,
    addr: SocketAddr,
    local: Option<(Acceptor, PathBuf)>,
}

impl Server {
    /// Binds and starts serving `store` (on the Unix socket too, when one is configured).
    pub fn start(config: ServerConfig, store: Arc<dyn Store>) -> io::Result<Self> {
        let listener = TcpListener::bind(config.addr)?;
        let addr = listener.local_addr()?;
        let local = config.local.clone().map(LocalListener::bind).transpose()?;
        let gate = Arc::new(Gate::default());
        let (connections_max, shutdown_deadline) =
            (config.connections_max, config.shutdown_deadline);
        let shared = Arc::new(Shared {
            config,
            store,
            gate: Arc::clone(&gate),
            shm_mapped: AtomicU64::new(0),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            Acceptor::start(
                listener,
                Arc::clone(&gate),
                AcceptorConfig {
                    name: "gpucache-native",
                    connections_max,
                    shutdown_deadline,
                    refuse: refuse_busy::<TcpStream>,
                    serve: move |stream: TcpStream| serve_connection(stream, &shared),
                },
            )?
        };
        tracing::info!(%addr, "gpucache native listener up");
        let local = match local {
            Some(listener) => {
                let path = listener.path.clone();
                let acceptor = Acceptor::start(
                    listener,
                    gate,
                    AcceptorConfig {
                        name: "gpucache-local",
                        connections_max,
                        shutdown_deadline,
                        refuse: refuse_busy::<std::os::unix::net::UnixStream>,
                        serve: move |stream| serve_connection(stream, &shared),
                    },
                )?;
                tracing::info!(path = %path.display(), "gpucache local listener up");
                Some((acceptor, path))
            }
            None => None,
        };
        Ok(Self { acceptor, addr, local })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The Unix socket path, when the server listens on one.
    pub fn local_path(&self) -> Option<&std::path::Path> {
        self.local.as_ref().map(|(_, p)| p.as_path())
    }

    /// Connections open right now.
    pub fn open_connections(&self) -> u32 {
        self.acceptor.open_connections()
    }

    /// Stops accepting, lets connections finish the request in hand, and joins every thread
    /// within the configured deadline. Returns how many threads were still running then.
    pub fn shutdown(mut self) -> usize {
        let local = self.local.take().map_or(0, |(mut a, _)| a.stop());
        self.acceptor.stop() + local
    }
}

fn refuse_busy<C: Write>(stream: &mut C, open: u32, max: u32) {
    let busy = Response::Error(WireError::Busy { connections: open, max });
    if let Ok(bytes) = busy.to_frame_bytes(0) {
        let _ = stream.write_all(&bytes);
    }
}

fn send<C: Write>(stream: &mut C, response: &Response, request_id: u64) -> io::Result<()> {
    let bytes = match response.to_frame_bytes(request_id) {
        Ok(b) => b,
        Err(e) => Response::Error(e).to_frame_bytes(request_id).map_err(io::Error::other)?,
    };
    stream.write_all(&bytes)
}

/// A client segment mapped for one connection, charged against `shm_mapped_bytes_max` until
/// the connection ends.
struct Mapped<'a> {
    segment: Segment,
    budget: &'a AtomicU64,
}

impl Drop for Mapped<'_> {
    fn drop(&mut self) {
        self.budget.fetch_sub(self.segment.len(), Ordering::AcqRel);
    }
}

/// What a connection holds between requests.
#[derive(Default)]
struct Session<'a> {
    caller: Option<Caller>,
    /// A descriptor that arrived and waits for its SHM_ATTACH frame (at most one is kept).
    pending_fd: Option<OwnedFd>,
    segment: Option<Mapped<'a>>,
}

fn serve_connection<C: Connection>(mut stream: C, shared: &Shared) {
    stream.set_nodelay();
    let _ = stream.set_read_timeout(Some(READ_TICK));
    let _ = stream.set_write_timeout(Some(shared.config.write_timeout));
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; READ_CHUNK_BYTES];
    let mut session = Session::default();
    let mut last_request = Instant::now();
    loop {
        if shared.gate.stopping() && decoder.is_idle() {
            let _ = send(&mut stream, &Response::Error(WireError::ShuttingDown), 0);
            return;
        }
        let n = match read_tick(&mut stream, &mut buf, last_request, shared.config.idle_timeout) {
            ReadTick::Data(n, fd) => {
                if fd.is_some() && session.pending_fd.is_some() {
                    tracing::debug!(peer = %stream.peer(), "a second descriptor arrived; closed");
                } else if fd.is_some() {
                    session.pending_fd = fd;
                }
                n
            }
            ReadTick::Quiet => continue,
            ReadTick::Closed => return,
        };
        let mut input = &buf[..n];
        loop {
            match decoder.feed(&mut input) {
                Ok(Some(frame)) => {
                    last_request = Instant::now();
                    let request_id = frame.request_id;
                    let response = match Request::from_frame(&frame) {
                        Ok(request) => answer(request, &mut session, shared),
                        Err(e) => Response::Error(e),
                    };
                    let closes = matches!(&response, Response::Error(e) if e.closes_connection());
                    if send(&mut stream, &response, request_id).is_err() || closes {
                        return;
                    }
                }
                Ok(None) => break,
                Err(fe) => {
                    let closes = fe.resync_impossible() || fe.error.closes_connection();
                    let sent =
                        send(&mut stream, &Response::Error(fe.error), fe.request_id.unwrap_or(0));
                    if closes || sent.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

fn shm_error(detail: impl std::fmt::Display) -> Response {
    Response::Error(WireError::SharedMemory { detail: detail.to_string() })
}

fn answer<'a>(request: Request, session: &mut Session<'a>, shared: &'a Shared) -> Response {
    let store = &*shared.store;
    let caller = &mut session.caller;
    if let Request::Hello { tenant, rights, .. } = &request {
        if caller.is_some() {
            return Response::Error(WireError::AlreadyAuthenticated);
        }
        let Some(granted) = shared.config.tenants.iter().find(|c| &c.tenant == tenant) else {
            return Response::Error(WireError::NotAuthenticated);
        };
        let rights = Rights {
            read: rights.read && granted.rights.read,
            write: rights.write && granted.rights.write,
            admin: rights.admin && granted.rights.admin,
        };
        *caller = Some(Caller::new(tenant.clone(), rights));
        return Response::Hello { version: VERSION, server: shared.config.name.clone() };
    }
    let Some(who) = caller.as_ref() else { return Response::Error(WireError::NotAuthenticated) };
    match request {
        Request::Hello { .. } => Response::Error(WireError::AlreadyAuthenticated),
        Request::Info => Response::Info(store.info().into()),
        Request::Epoch => Response::Epoch(store.epoch()),
        Request::Stats => Response::Stats(store.stats()),
        Request::Lookup { keys } => {
            Response::Lookup(keys.iter().map(|k| store.lookup(who, k)).collect())
        }
        Request::Get { items } => {
            Response::Get(items.iter().map(|item| fetch(store, who, item)).collect())
        }
        Request::Put { items } => Response::Put(
            items.iter().map(|i| store.put(who, &i.key, &i.data, i.request)).collect(),
        ),
        Request::Invalidate { keys } => {
            Response::Invalidate(keys.iter().map(|k| store.invalidate(who, k)).collect())
        }
        Request::Reserve { key, len, request } => {
            Response::Reserve(store.reserve(who, &key, len, request))
        }
        Request::Write { reservation, offset, data } => {
            Response::Write(store.write(who, &reservation, offset, &data))
        }
        Request::Commit { reservation } => Response::Commit(store.commit(who, &reservation)),
        Request::Abort { reservation, outcome } => {
            Response::Abort(store.abort(who, reservation, outcome))
        }
        Request::ExpireLeases => Response::ExpireLeases(store.expire_leases().map(|n| n as u64)),
        Request::Attest { region } => Response::Attest(store.attest_drained(who, region)),
        Request::BumpEpoch => Response::BumpEpoch(store.bump_epoch()),
        Request::ReclaimFenced { epoch } => {
            Response::ReclaimFenced(store.reclaim_fenced(epoch).map(|n| n as u64))
        }
        Request::ShmAttach { len } => attach(len, session, shared),
        Request::GetShared { items } => match &session.segment {
            None => shm_error("no segment is attached to this connection"),
            Some(m) => get_shared(store, who, &m.segment, &items),
        },
        Request::PutShared { items } => match &session.segment {
            None => shm_error("no segment is attached to this connection"),
            Some(m) => put_shared(store, who, &m.segment, &items),
        },
    }
}

/// Maps the segment whose descriptor arrived with SHM_ATTACH, within the server-wide budget.
fn attach<'a>(len: u64, session: &mut Session<'a>, shared: &'a Shared) -> Response {
    let Some(fd) = session.pending_fd.take() else {
        return shm_error("no descriptor arrived with SHM_ATTACH (it needs the Unix socket)");
    };
    if session.segment.is_some() {
        return shm_error("a segment is already attached to this connection");
    }
    let segment = match Segment::attach(fd) {
        Ok(s) => s,
        Err(e) => return shm_error(e),
    };
    if segment.len() != len {
        return shm_error(format!(
            "the client mapped {len} bytes but the segment holds {}",
            segment.len()
        ));
    }
    let max = shared.config.shm_mapped_bytes_max;
    let charged = shared.shm_mapped.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
        now.checked_add(len).filter(|total| *total <= max)
    });
    if let Err(now) = charged {
        return shm_error(format!(
            "mapping {len} more bytes would exceed shm_mapped_bytes_max ({now} of {max} mapped)"
        ));
    }
    session.segment = Some(Mapped { segment, budget: &shared.shm_mapped });
    Response::ShmAttach(len)
}

/// GET straight into the client's segment. Every range is checked before any is written.
fn get_shared(
    store: &dyn Store,
    who: &Caller,
    segment: &Segment,
    items: &[SharedGetItem],
) -> Response {
    if let Some(e) = items.iter().find_map(|i| segment.check(i.offset, i.capacity).err()) {
        return shm_error(e);
    }
    Response::GetShared(
        items
            .iter()
            .map(|item| {
                segment
                    .with_bytes_mut(item.offset, item.capacity, |dst| {
                        store.get_into(who, &item.key, dst)
                    })
                    .unwrap_or_else(|e| Err(shm_backend("get", e)))
            })
            .collect(),
    )
}

/// PUT straight from the client's segment. The store checksums what it copied; a block whose
/// checksum is not the one the client sent (its bytes changed during the copy) is dropped.
fn put_shared(
    store: &dyn Store,
    who: &Caller,
    segment: &Segment,
    items: &[SharedPutItem],
) -> Response {
    if let Some(e) = items.iter().find_map(|i| segment.check(i.offset, i.len).err()) {
        return shm_error(e);
    }
    Response::PutShared(
        items
            .iter()
            .map(|item| {
                let put = segment
                    .with_bytes(item.offset, item.len, |src| {
                        store.put(who, &item.key, src, item.request)
                    })
                    .unwrap_or_else(|e| Err(shm_backend("put", e)))?;
                match put {
                    Put::Committed(sum) if sum != item.checksum => {
                        let _ = store.invalidate(who, &item.key);
                        Err(StoreError::Backend {
                            operation: "put",
                            detail: format!(
                                "the shared bytes hash to {:016x}, the client sent {:016x}: they \
                                 changed while the server copied them; the block was dropped",
                                sum.0, item.checksum.0
                            ),
                            retirement: Retirement::Retired,
                        })
                    }
                    other => Ok(other),
                }
            })
            .collect(),
    )
}

fn shm_backend(operation: &'static str, e: crate::shm::ShmError) -> StoreError {
    StoreError::Backend { operation, detail: e.to_string(), retirement: Retirement::Retired }
}

/// One GET item: read into a buffer of the asked capacity and send what was read.
fn fetch(store: &dyn Store, who: &Caller, item: &GetItem) -> Result<Fetched, StoreError> {
    let capacity = usize::try_from(item.capacity).unwrap_or(usize::MAX);
    let mut buf = vec![0u8; capacity];
    match store.get_into(who, &item.key, &mut buf)? {
        Get::Hit { len, checksum } => {
            buf.truncate(usize::try_from(len).unwrap_or(capacity));
            Ok(Fetched::Hit { checksum, data: buf })
        }
        Get::Miss(reason) => Ok(Fetched::Miss(reason)),
    }
}
