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
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::store::{Get, Store, StoreError};

use crate::listener::{Acceptor, AcceptorConfig, Gate, ReadTick, read_tick};

use super::proto::{Fetched, FrameDecoder, GetItem, Request, Response, VERSION, WireError};

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
        }
    }
}

struct Shared {
    config: ServerConfig,
    store: Arc<dyn Store>,
    gate: Arc<Gate>,
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
}

impl Server {
    /// Binds and starts serving `store`.
    pub fn start(config: ServerConfig, store: Arc<dyn Store>) -> io::Result<Self> {
        let listener = TcpListener::bind(config.addr)?;
        let addr = listener.local_addr()?;
        let gate = Arc::new(Gate::default());
        let (connections_max, shutdown_deadline) =
            (config.connections_max, config.shutdown_deadline);
        let shared = Arc::new(Shared { config, store, gate: Arc::clone(&gate) });
        let acceptor = Acceptor::start(
            listener,
            gate,
            AcceptorConfig {
                name: "gpucache-native",
                connections_max,
                shutdown_deadline,
                refuse: |stream: &mut TcpStream, open: u32, max: u32| {
                    let busy = Response::Error(WireError::Busy { connections: open, max });
                    if let Ok(bytes) = busy.to_frame_bytes(0) {
                        let _ = stream.write_all(&bytes);
                    }
                },
                serve: move |stream: TcpStream| serve_connection(stream, &shared),
            },
        )?;
        tracing::info!(%addr, "gpucache native listener up");
        Ok(Self { acceptor })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }

    /// Connections open right now.
    pub fn open_connections(&self) -> u32 {
        self.acceptor.open_connections()
    }

    /// Stops accepting, lets connections finish the request in hand, and joins every thread
    /// within the configured deadline. Returns how many threads were still running then.
    pub fn shutdown(mut self) -> usize {
        self.acceptor.stop()
    }
}

fn send(stream: &mut TcpStream, response: &Response, request_id: u64) -> io::Result<()> {
    let bytes = match response.to_frame_bytes(request_id) {
        Ok(b) => b,
        Err(e) => Response::Error(e).to_frame_bytes(request_id).map_err(io::Error::other)?,
    };
    stream.write_all(&bytes)
}

fn serve_connection(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(READ_TICK));
    let _ = stream.set_write_timeout(Some(shared.config.write_timeout));
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; READ_CHUNK_BYTES];
    let mut caller: Option<Caller> = None;
    let mut last_request = Instant::now();
    loop {
        if shared.gate.stopping() && decoder.is_idle() {
            let _ = send(&mut stream, &Response::Error(WireError::ShuttingDown), 0);
            return;
        }
        let n = match read_tick(&mut stream, &mut buf, last_request, shared.config.idle_timeout) {
            ReadTick::Data(n) => n,
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
                        Ok(request) => answer(request, &mut caller, shared),
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

fn answer(request: Request, caller: &mut Option<Caller>, shared: &Shared) -> Response {
    let store = &*shared.store;
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
    }
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
