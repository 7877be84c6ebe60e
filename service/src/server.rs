//! The native GPCW service: an accept thread and one thread per connection (ADR 0011), serving a
//! shared [`Store`] to authenticated tenants.
//!
//! A connection starts with HELLO, which names its tenant and the rights it asks for; it gets
//! the rights it asks for that its tenant's configuration grants, and keeps that identity until
//! it closes. A tenant with keys must prove itself in a sealed HELLO; its session then seals
//! every frame both ways and refuses replayed request ids (ADR 0012). A tenant without keys
//! ("open") is trusted on its word. Frames are answered in order, one at a time: the next frame
//! is read once the answer before it is written, so a client may send several (pipelining). The
//! items of a batch frame (LOOKUP, GET, PUT, INVALIDATE, GET_SHARED, PUT_SHARED) go to the store
//! as one batch call, which answers each item as its single-key call would; PUT items go with
//! the writer's checksums, which the store compares as it copies (ADR 0022). A one-key GET on an
//! unsealed session goes out from the store's own memory when the store lends it. A frame-level
//! error whose boundary is known is answered and the connection continues; one that loses the
//! stream (bad magic or header, oversize, unknown version) is answered once and the connection
//! closes. Nothing a client sends can stop the accept loop or another connection; what it can
//! hold is bounded (`crate::bounds`).

use std::collections::HashMap;
use std::io::{self, IoSlice, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use gpucache_dataplane::caller::{Caller, Right, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::{Clock, UnixClock};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::shard::FillOutcome;
use gpucache_dataplane::store::{
    BatchGet, BatchPut, Delivery, Get, GetTo, GotOne, Reservation, Retirement, Store, StoreError,
    authorize, purge,
};
use subtle::ConstantTimeEq;

use crate::bounds::{self, BodyCharge, Front, Guard, Reason, UNAUTHENTICATED_REQUEST_BYTES_MAX};
use crate::connection::{
    Close, Connection, DeadlineWriter, Drive, Gate, Protocol, READ_CHUNK_BYTES, close_after, drive,
};
use crate::listener::{Acceptor, AcceptorConfig, LocalListener, TurnedAway};
use gpucache_storage::host::segment::Segment;

use crate::auth::{ReplayWindow, TenantAuth};
use crate::cluster::ClusterNode;
use crate::fills::Fills;
use gpucache_wire::seal::{self, NONCE_BYTES, SealKey};
use gpucache_wire::staging::{BlockStaging, PutIntent, StageOwner, StagingError};
use gpucache_wire::{
    AuthFailure, Fetched, FillRefused, Frame, FrameDecoder, GetItem, HelloAuth, HelloSession, Kind,
    Op, PutRef, Request, Response, ServerLimits, SharedGetItem, SharedPutItem, VERSION, WireError,
    begin_get_response, decode_put_request, decode_write_request, finish_get_response,
    get_hit_frame_parts, write_all_vectored,
};

/// Default for [`ServerConfig::clock_skew_max`].
pub const CLOCK_SKEW_MAX_DEFAULT: Duration = Duration::from_secs(120);

/// How to run a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub addr: SocketAddr,
    /// Open connections at most; one more is answered `Busy` and closed.
    pub connections_max: u32,
    /// A connection with no complete request for this long is closed.
    pub idle_timeout: Duration,
    /// A response the client does not take whole within this long (one deadline for the whole
    /// response, however slowly it is drained) closes the connection.
    pub write_timeout: Duration,
    /// The in-flight request-body budget, the per-peer connection limit, the body and HELLO
    /// deadlines, and the refusal counts; a built service shares one with the RESP front.
    pub guard: Arc<Guard>,
    /// The tenants that may connect, each with the most rights it can be granted.
    pub tenants: Vec<Caller>,
    /// The name HELLO answers with.
    pub name: String,
    /// How long shutdown waits for connection threads.
    pub shutdown_deadline: Duration,
    /// The keys of the tenants that must authenticate; a tenant not here is open.
    pub auth: HashMap<TenantId, TenantAuth>,
    /// The most a HELLO timestamp may differ from [`Self::clock`].
    pub clock_skew_max: Duration,
    /// Unix-epoch milliseconds, for HELLO timestamps and key expiry.
    pub clock: Arc<dyn Clock>,
    /// A Unix socket for clients on this host: the same protocol (and the same HELLO), plus
    /// the shared-memory fast path (a client hands over a sealed memfd and payloads move
    /// through it). None by default.
    pub local: Option<PathBuf>,
    /// Bytes of client segments mapped at once, over all local connections; an attach past
    /// it is refused.
    pub shm_mapped_bytes_max: u64,
    /// Registered memory for one-sided block transfers (NIXL_ATTACH and the stage ops); without
    /// it those ops are refused with `WireError::Staging { reason: NotEnabled, .. }`.
    pub staging: Option<Arc<dyn BlockStaging>>,
    /// The store's largest value (`limits.object_bytes_max`), stated in the LIMITS answer so
    /// a client can refuse an oversize value before it reads or sends it. None: not stated.
    pub object_bytes_max: Option<u64>,
    /// The node's standing in its cluster: every keyed request is checked against its view
    /// (the epoch its connection said with CLUSTER). None for a server that runs alone.
    pub cluster: Option<Arc<ClusterNode>>,
    /// The single-flight fills of FILL_BEGIN, FILL_FINISH and FILL_WAIT (a node of a cluster
    /// fences them on every view it applies).
    pub fills: Arc<Fills>,
}

impl ServerConfig {
    pub fn new(addr: SocketAddr, tenants: Vec<Caller>) -> Self {
        Self {
            addr,
            connections_max: 256,
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(30),
            guard: Arc::default(),
            tenants,
            name: format!("gpucache/{}", env!("CARGO_PKG_VERSION")),
            shutdown_deadline: Duration::from_secs(10),
            auth: HashMap::new(),
            clock_skew_max: CLOCK_SKEW_MAX_DEFAULT,
            clock: Arc::new(UnixClock),
            local: None,
            shm_mapped_bytes_max: 16 << 30,
            staging: None,
            object_bytes_max: None,
            cluster: None,
            fills: Arc::new(Fills::new(Arc::new(UnixClock))),
        }
    }
}

struct Shared {
    config: ServerConfig,
    store: Arc<dyn Store>,
    gate: Arc<Gate>,
    /// Bytes of client segments mapped now (bounded by `shm_mapped_bytes_max`).
    shm_mapped: AtomicU64,
    /// The id the next connection gets (it names the owner of its stages).
    next_connection: AtomicU64,
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
        let mut config = config;
        // HELLO offers the socket to clients whose working directory may differ: absolute.
        if let Some(path) = config.local.as_mut()
            && path.is_relative()
        {
            *path = std::env::current_dir()?.join(&*path);
        }
        let local = config.local.clone().map(LocalListener::bind).transpose()?;
        let gate = Arc::new(Gate::default());
        let (connections_max, shutdown_deadline) =
            (config.connections_max, config.shutdown_deadline);
        let guard = Arc::clone(&config.guard);
        let shared = Arc::new(Shared {
            config,
            store,
            gate: Arc::clone(&gate),
            shm_mapped: AtomicU64::new(0),
            next_connection: AtomicU64::new(1),
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
                    guard: Some((Arc::clone(&guard), Front::Native)),
                    refuse: refuse_busy,
                    serve: move |stream: TcpStream| {
                        serve_connection(stream, &shared, Front::Native);
                    },
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
                        guard: Some((guard, Front::Local)),
                        refuse: refuse_busy,
                        serve: move |stream| serve_connection(stream, &shared, Front::Local),
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

/// The answer to a connection turned away (over `connections_max`, or its address over
/// `connections_per_peer_max`): `Busy` with those numbers. Before HELLO there is no session
/// key: unsealed.
fn refuse_busy(why: TurnedAway) -> Vec<u8> {
    let (TurnedAway::ConnectionsMax { open, max } | TurnedAway::PerPeer { open, max }) = why;
    Response::Error(WireError::Busy { connections: open, max })
        .to_frame_bytes(0)
        .unwrap_or_default()
}

/// Largest response buffer a connection keeps between responses.
const OUT_BUFFER_KEEP_BYTES: usize = 8 << 20;

/// Where the answer to one frame goes: the connection's stream (behind its write deadline),
/// its reused response buffer, and the id and seal of the frame answered.
struct Reply<'r, W: Write> {
    stream: &'r mut W,
    out: &'r mut Vec<u8>,
    request_id: u64,
    seal: Option<&'r SealKey>,
}

impl<W: Write> Reply<'_, W> {
    /// Encodes `response` into the buffer and writes it (an answer that cannot be encoded is
    /// answered with why).
    fn send(&mut self, response: &Response) -> io::Result<()> {
        self.out.clear();
        if let Err(e) = response.encode_sealed_frame(self.request_id, self.seal, self.out) {
            self.out.clear();
            Response::Error(e)
                .encode_sealed_frame(self.request_id, self.seal, self.out)
                .map_err(io::Error::other)?;
        }
        self.write_out()
    }

    /// Writes the frame the buffer holds; a buffer grown past [`OUT_BUFFER_KEEP_BYTES`] is let
    /// go.
    fn write_out(&mut self) -> io::Result<()> {
        let written = self.stream.write_all(self.out);
        if self.out.capacity() > OUT_BUFFER_KEEP_BYTES {
            *self.out = Vec::new();
        }
        written
    }
}

/// Sends one response on a connection that has no reply buffer at hand (refusals, frames that
/// did not decode).
fn send<C: Write>(
    stream: &mut C,
    response: &Response,
    request_id: u64,
    seal: Option<&SealKey>,
) -> io::Result<()> {
    Reply { stream, out: &mut Vec::new(), request_id, seal }.send(response)
}

/// Who a connection acts for, once HELLO succeeded.
#[derive(Debug)]
struct Session {
    caller: Caller,
    /// The session key of a sealed session; `None` for an open tenant.
    seal: Option<SealKey>,
    replay: ReplayWindow,
    /// The cluster epoch the connection routes by (CLUSTER); 0 until it says one.
    cluster_epoch: u64,
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

/// The same-host state of a connection, and its id.
#[derive(Default)]
struct Local<'a> {
    /// Names the connection as the owner of its stages.
    connection: u64,
    /// The Unix socket HELLO offers: set on a TCP connection from this host when the server
    /// has one.
    offer: Option<String>,
    /// A descriptor that arrived and waits for its SHM_ATTACH frame (at most one is kept).
    pending_fd: Option<OwnedFd>,
    segment: Option<Mapped<'a>>,
}

/// One native connection as [`drive`] serves it.
struct Native<'a> {
    shared: &'a Shared,
    front: Front,
    decoder: FrameDecoder,
    /// Where reads go when no body is in progress.
    buf: Vec<u8>,
    /// The reused response buffer.
    out: Vec<u8>,
    session: Option<Session>,
    /// The body bytes of the frame in progress, charged when its header arrives (before any of
    /// its body is buffered) and given back once it is answered or the connection ends.
    charge: BodyCharge<'a>,
    local: Local<'a>,
    /// Whether the last read went straight into the decoder's body window.
    direct: bool,
}

fn serve_connection<C: Connection>(stream: C, shared: &Shared, front: Front) {
    let guard = &*shared.config.guard;
    let connection = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    let mut local = Local { connection, ..Local::default() };
    // However the connection ends, its open stages are settled (returned or quarantined).
    let _stages = StagesAtClose { staging: shared.config.staging.as_deref(), connection };
    if stream.peer_is_loopback() {
        local.offer = shared.config.local.as_ref().map(|p| p.display().to_string());
    }
    let mut native = Native {
        shared,
        front,
        decoder: FrameDecoder::new(),
        buf: vec![0u8; READ_CHUNK_BYTES],
        out: Vec::new(),
        session: None,
        charge: guard.charge(stream.peer_ip()),
        local,
        direct: false,
    };
    let how = Drive {
        gate: &shared.gate,
        guard,
        front,
        idle_timeout: shared.config.idle_timeout,
        write_timeout: shared.config.write_timeout,
    };
    drive(stream, &mut native, &how);
}

impl Native<'_> {
    /// Charges the body of the frame whose header has arrived; a refusal is answered and the
    /// connection is to close.
    fn admit_or_close<C: Connection>(&mut self, stream: &mut C) -> Result<(), Close> {
        let tenant = self.session.as_ref().map(|s| &s.caller.tenant);
        let Err((id, refused)) = admit_body(&self.decoder, &mut self.charge, tenant) else {
            return Ok(());
        };
        self.shared.config.guard.count(self.front, refused.reason);
        let seal = self.session.as_ref().and_then(|s| s.seal.as_ref());
        close_refused(stream, refused.error, id, seal, self.shared.config.write_timeout);
        Err(Close)
    }
}

impl<C: Connection> Protocol<C> for Native<'_> {
    fn is_idle(&self) -> bool {
        self.decoder.is_idle()
    }

    fn is_authenticated(&self) -> bool {
        self.session.is_some()
    }

    fn admit(&mut self, stream: &mut C) -> Result<(), Close> {
        self.admit_or_close(stream)
    }

    /// The rest of a body in progress is read straight into the decoder's buffer.
    fn read_buffer(&mut self) -> &mut [u8] {
        self.direct = self.decoder.body_window().is_some();
        match self.decoder.body_window() {
            Some(window) => window,
            None => &mut self.buf,
        }
    }

    fn received(&mut self, stream: &mut C, n: usize, fd: Option<OwnedFd>) -> Result<bool, Close> {
        if fd.is_some() && self.local.pending_fd.is_some() {
            tracing::debug!(peer = %stream.peer(), "a second descriptor arrived; closed");
        } else if fd.is_some() {
            self.local.pending_fd = fd;
        }
        let (guard, write_timeout) = (&*self.shared.config.guard, self.shared.config.write_timeout);
        let mut served = false;
        let mut input = if self.direct {
            self.decoder.commit_body(n);
            0..0
        } else {
            0..n
        };
        loop {
            self.admit_or_close(stream)?;
            // A header is fed alone, so that its body is charged before any of it is buffered.
            let take = self.decoder.header_missing().map_or(input.len(), |m| m.min(input.len()));
            let mut part = &self.buf[input.start..input.start + take];
            let fed = self.decoder.feed(&mut part);
            input.start += take - part.len();
            match fed {
                Ok(Some(frame)) => {
                    served = true;
                    let mut writer = DeadlineWriter::new(&mut *stream, write_timeout);
                    let answered = serve_frame(
                        &frame,
                        &mut self.session,
                        &mut self.local,
                        self.shared,
                        &mut writer,
                        &mut self.out,
                    );
                    if writer.timed_out {
                        guard.count(self.front, Reason::WriteTimeout);
                    }
                    self.decoder.recycle(frame.body);
                    // The body is served and its buffer kept for reuse or freed: not in flight.
                    self.charge.release();
                    if !matches!(answered, Ok(true)) {
                        return Err(Close);
                    }
                }
                Ok(None) if input.is_empty() => return Ok(served),
                Ok(None) => {}
                Err(fe) => {
                    self.charge.release();
                    let seal = self.session.as_ref().and_then(|s| s.seal.as_ref());
                    let closes = fe.resync_impossible() || fe.error.closes_connection();
                    let id = fe.request_id.unwrap_or(0);
                    let mut writer = DeadlineWriter::new(&mut *stream, write_timeout);
                    let sent = send(&mut writer, &Response::Error(fe.error), id, seal);
                    if writer.timed_out {
                        guard.count(self.front, Reason::WriteTimeout);
                    }
                    if closes || sent.is_err() {
                        return Err(Close);
                    }
                }
            }
        }
    }

    fn stopping(&mut self, stream: &mut C) {
        let seal = self.session.as_ref().and_then(|s| s.seal.as_ref());
        let _ = send(stream, &Response::Error(WireError::ShuttingDown), 0, seal);
    }
}

/// Charges the body of the frame whose header has arrived, before any of it is buffered: its
/// whole announced length, against the server's budget and (after HELLO) the tenant's share.
/// Before HELLO a body over [`UNAUTHENTICATED_REQUEST_BYTES_MAX`] is refused outright. A
/// refusal comes with the frame's request id.
fn admit_body(
    decoder: &FrameDecoder,
    charge: &mut BodyCharge<'_>,
    tenant: Option<&TenantId>,
) -> Result<(), (u64, bounds::OverBudget)> {
    let Some((request_id, len)) = decoder.body_in_progress() else { return Ok(()) };
    if charge.bytes() > 0 {
        return Ok(());
    }
    let len = u64::try_from(len).unwrap_or(u64::MAX);
    if tenant.is_none() && len > UNAUTHENTICATED_REQUEST_BYTES_MAX {
        let error = WireError::TooLarge { len, max: UNAUTHENTICATED_REQUEST_BYTES_MAX };
        return Err((request_id, bounds::OverBudget { reason: Reason::Oversize, error }));
    }
    charge.set(len, tenant).map_err(|refused| (request_id, refused))
}

/// Answers a frame whose body will not be read, then closes (the body cannot be skipped
/// safely, so the stream cannot go on).
fn close_refused<C: Connection>(
    stream: &mut C,
    error: WireError,
    request_id: u64,
    seal: Option<&SealKey>,
    write_timeout: Duration,
) {
    let mut bytes = Vec::new();
    if Response::Error(error).encode_sealed_frame(request_id, seal, &mut bytes).is_ok() {
        close_after(stream, &bytes, write_timeout);
    }
}

/// A request as the dispatch serves it: a PUT's blocks and a WRITE's data stay in the frame's
/// body, borrowed (the store copies them once, from there); every other op is decoded whole.
enum Call<'f> {
    Put(Vec<PutRef<'f>>),
    Write { reservation: Reservation, offset: u64, data: &'f [u8] },
    Request(Request),
}

/// Serves one whole frame and writes its answer; whether the connection goes on. Every frame
/// takes the same steps: HELLO opens the session (no other op before it); for a sealed
/// session, the seal and the request id; on a node of a cluster, the fence; then the frame is
/// decoded and [`dispatch`]ed. A step that refuses answers with its error.
fn serve_frame<'a, W: Write>(
    frame: &Frame,
    session: &mut Option<Session>,
    local: &mut Local<'a>,
    shared: &'a Shared,
    stream: &mut W,
    out: &mut Vec<u8>,
) -> io::Result<bool> {
    let request_id = frame.request_id;
    let answer = match session.as_mut() {
        None => open_session(frame, session, local, shared),
        Some(s) => {
            let Session { caller, seal, replay, cluster_epoch } = s;
            let call = check_seal(frame, seal.as_ref(), replay)
                .and_then(|()| check_fence(frame, *cluster_epoch, shared))
                .and_then(|()| decode(frame));
            let mut reply =
                Reply { stream: &mut *stream, out: &mut *out, request_id, seal: seal.as_ref() };
            match call {
                Ok(call) => {
                    match dispatch(call, caller, cluster_epoch, local, shared, &mut reply) {
                        Answer::Sent(sent) => return sent.map(|()| true),
                        Answer::Reply(response) => response,
                    }
                }
                Err(e) => Response::Error(e),
            }
        }
    };
    let closes = matches!(&answer, Response::Error(e) if e.closes_connection());
    // A HELLO that opened a sealed session is answered under the new session's seal.
    let seal = session.as_ref().and_then(|s| s.seal.as_ref());
    Reply { stream, out, request_id, seal }.send(&answer)?;
    Ok(!closes)
}

/// The first step: before a session, only HELLO.
fn open_session(
    frame: &Frame,
    session: &mut Option<Session>,
    local: &Local<'_>,
    shared: &Shared,
) -> Response {
    match Request::from_frame(frame) {
        Ok(Request::Hello { tenant, rights, auth, .. }) => {
            match hello(frame, tenant, rights, auth, local.offer.as_deref(), shared) {
                Ok((opened, answer)) => {
                    *session = Some(opened);
                    answer
                }
                Err(e) => Response::Error(e),
            }
        }
        Ok(_) => Response::Error(WireError::NotAuthenticated),
        Err(e) => Response::Error(e),
    }
}

/// A sealed session's frames carry the session's seal and a request id not seen before.
fn check_seal(
    frame: &Frame,
    seal: Option<&SealKey>,
    replay: &mut ReplayWindow,
) -> Result<(), WireError> {
    let Some(key) = seal else { return Ok(()) };
    frame.verify_seal(key)?;
    replay.accept(frame.request_id)
}

/// On a node of a cluster, a keyed request at a stale epoch, or one the node does not admit
/// now, is refused ([`ClusterNode::check`]).
fn check_fence(frame: &Frame, epoch: u64, shared: &Shared) -> Result<(), WireError> {
    match &shared.config.cluster {
        Some(node) if frame.kind == Kind::Request => {
            node.check(frame.op, epoch).map_err(WireError::Fenced)
        }
        _ => Ok(()),
    }
}

fn decode(frame: &Frame) -> Result<Call<'_>, WireError> {
    if frame.kind == Kind::Request && frame.op == Op::Put {
        return decode_put_request(&frame.body).map(Call::Put);
    }
    if frame.kind == Kind::Request && frame.op == Op::Write {
        return decode_write_request(&frame.body).map(|(reservation, offset, data)| Call::Write {
            reservation,
            offset,
            data,
        });
    }
    Request::from_frame(frame).map(Call::Request)
}

/// What [`dispatch`] did: an answer to send, or a GET it has sent itself.
enum Answer {
    Reply(Response),
    Sent(io::Result<()>),
}

impl From<Response> for Answer {
    fn from(r: Response) -> Self {
        Self::Reply(r)
    }
}

/// Serves one request as `who`, every op in this one match. Keyed operations (and ATTEST,
/// which the registry checks against the region's owner) are authorised by the store itself;
/// the store-wide operations that take no caller need the admin right, checked here.
fn dispatch<'a, W: Write>(
    call: Call<'_>,
    who: &Caller,
    cluster_epoch: &mut u64,
    local: &mut Local<'a>,
    shared: &'a Shared,
    reply: &mut Reply<'_, W>,
) -> Answer {
    let store = &*shared.store;
    let config = &shared.config;
    let request = match call {
        Call::Put(items) => return put(store, who, &items).into(),
        Call::Write { reservation, offset, data } => {
            return Response::Write(store.write(who, &reservation, offset, data)).into();
        }
        Call::Request(request) => request,
    };
    let owner = || StageOwner { connection: local.connection, tenant: who.tenant.clone() };
    match request {
        Request::Get { items } => return Answer::Sent(get(store, who, &items, reply)),
        // Whole blocks from a decoded request (the frames this server reads decode PUT as
        // above, borrowing their bytes).
        Request::Put { items } => {
            let batch: Vec<BatchPut<'_>> = items
                .iter()
                .map(|i| BatchPut { key: &i.key, src: &i.data, request: i.request })
                .collect();
            Response::Put(store.put_batch(who, &batch))
        }
        Request::Hello { .. } => Response::Error(WireError::AlreadyAuthenticated),
        Request::Info => Response::Info(store.info().into()),
        Request::Epoch => Response::Epoch(store.epoch()),
        Request::Stats => Response::Stats(store.stats()),
        Request::Condition => Response::Condition(store.condition()),
        Request::Limits => {
            Response::Limits(ServerLimits { object_bytes_max: config.object_bytes_max })
        }
        Request::Locate { keys } => {
            Response::Locate(store.locate(who, &keys.iter().collect::<Vec<_>>()))
        }
        Request::Lookup { keys } => {
            Response::Lookup(store.lookup_batch(who, &keys.iter().collect::<Vec<_>>()))
        }
        Request::Invalidate { keys } => {
            Response::Invalidate(store.invalidate_batch(who, &keys.iter().collect::<Vec<_>>()))
        }
        // The write right on the scope's tenant; at most PURGE_BLOCKS_MAX blocks per request.
        Request::Purge { scope } => Response::Purge(purge(store, who, &scope)),
        // A node of a cluster routes by the epoch a connection says; a server alone has no
        // standing.
        Request::Cluster { epoch } => Response::Cluster(config.cluster.as_ref().map(|node| {
            *cluster_epoch = epoch;
            node.status()
        })),
        Request::FillBegin { key } => fill_begin(&key, who, shared),
        Request::FillFinish { lease, stored } => {
            let outcome = if stored { FillOutcome::Stored } else { FillOutcome::GaveUp };
            Response::FillFinish(config.fills.finish(&lease, outcome))
        }
        Request::FillWait { ticket, wait_ms } => {
            Response::FillWait(config.fills.wait(&ticket, Duration::from_millis(wait_ms)))
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
        Request::ExpireLeases => {
            Response::ExpireLeases(require(who, Right::Admin).and_then(|()| {
                let staged = config.staging.as_ref().map_or(0, |s| s.expire(config.clock.now_ms()));
                store.expire_leases().map(|n| (n + staged) as u64)
            }))
        }
        Request::Attest { region } => Response::Attest(store.attest_drained(who, region)),
        Request::BumpEpoch => {
            Response::BumpEpoch(require(who, Right::Admin).and_then(|()| store.bump_epoch()))
        }
        Request::ReclaimFenced { epoch } => {
            Response::ReclaimFenced(require(who, Right::Admin).and_then(|()| {
                let reclaimed = store.reclaim_fenced(epoch)?;
                // The store's fence passed: fence the staging memory too (its own epoch).
                let staged = match &config.staging {
                    Some(s) => s.fence().map_err(|e| StoreError::Backend {
                        operation: "reclaim_fenced",
                        detail: e.to_string(),
                        retirement: Retirement::Retired,
                    })?,
                    None => 0,
                };
                Ok((reclaimed + staged) as u64)
            }))
        }
        Request::ShmAttach { len } => attach(len, local, shared),
        Request::GetShared { items } => match &local.segment {
            None => shm_error("no segment is attached to this connection"),
            Some(m) => get_shared(store, who, &m.segment, &items),
        },
        Request::PutShared { items } => match &local.segment {
            None => shm_error("no segment is attached to this connection"),
            Some(m) => put_shared(store, who, &m.segment, &items),
        },
        Request::NixlAttach { metadata } => {
            staged(shared, |st| Ok(Response::NixlAttach(st.attach(&owner(), &metadata)?)))
        }
        Request::StageGet { items } => {
            staged(shared, |st| stage_get(st, &owner(), config.clock.now_ms(), store, who, &items))
        }
        Request::ReservePut { key, len, checksum, request } => staged(shared, |st| {
            if let Err(e) = authorize(who, &key, Right::Write) {
                return Ok(Response::ReservePut(Err(e)));
            }
            if len == 0 {
                return Ok(Response::ReservePut(Err(StoreError::EmptyObject)));
            }
            let intent = PutIntent { key: *key, len, checksum, request };
            Ok(Response::ReservePut(Ok(st.reserve_put(&owner(), config.clock.now_ms(), intent)?)))
        }),
        Request::CommitPut { stage } => staged(shared, |st| {
            let mut put = |intent: &PutIntent, bytes: &[u8]| {
                store.put(who, &intent.key, bytes, intent.request)
            };
            Ok(Response::CommitPut(st.commit_put(&owner(), stage, &mut put)?))
        }),
        Request::Release { stages } => {
            staged(shared, |st| Ok(Response::Release(st.release(&owner(), &stages))))
        }
        Request::StageStats => staged(shared, |st| Ok(Response::StageStats(st.stats()))),
    }
    .into()
}

/// PUT: stored straight from the frame body, the frame's items as one batch; the store checks
/// each item against the checksum the client sent as it copies it.
fn put(store: &dyn Store, who: &Caller, items: &[PutRef<'_>]) -> Response {
    let batch: Vec<BatchPut<'_>> =
        items.iter().map(|i| BatchPut { key: &i.key, src: i.data, request: i.request }).collect();
    let sums: Vec<Checksum> = items.iter().map(|i| i.checksum).collect();
    Response::Put(store.put_batch_checked(who, &batch, &sums))
}

/// GET. A one-key GET on an unsealed session asks the store once ([`Store::get_one`]): a
/// lent block goes out from the store's own bytes ([`OneGet`]); a copied one is read into the
/// frame. Any other GET reads its blocks, as one batch, straight into the frame, into the
/// bytes of the last answer sent on this connection (see [`begin_get_response`]).
fn get<W: Write>(
    store: &dyn Store,
    who: &Caller,
    items: &[GetItem],
    reply: &mut Reply<'_, W>,
) -> io::Result<()> {
    if let [item] = items
        && reply.seal.is_none()
        && item.capacity <= gpucache_wire::PAYLOAD_BYTES_MAX
    {
        return get_one(store, who, item, reply);
    }
    let encoded = begin_get_response(items, reply.out)
        .map(|slots| {
            let mut batch: Vec<BatchGet<'_>> = items
                .iter()
                .zip(slots)
                .map(|(item, dst)| BatchGet { key: &item.key, dst })
                .collect();
            store.get_batch(who, &mut batch)
        })
        .and_then(|answers| {
            finish_get_response(reply.request_id, reply.seal, items, answers, reply.out)
        });
    match encoded {
        Ok(()) => reply.write_out(),
        Err(e) => reply.send(&Response::Error(e)),
    }
}

/// The reply side of a one-key GET, as the store delivers it ([`GetTo`]). A lent block is
/// hashed where it lies and, only when it matches its committed checksum, goes out with the
/// frame's header and trailer in one vectored write, so the server copies nothing itself; a
/// block that does not match is never sent (the store drops it and answers a corrupt miss).
/// A copied block lands in a frame laid out in the reply's buffer when the store asks for it.
struct OneGet<'g, 'r, W: Write> {
    reply: &'g mut Reply<'r, W>,
    item: &'g GetItem,
    /// The write of a lent hit.
    sent: Option<io::Result<()>>,
    /// Whether the store asked for the buffer.
    laid_out: bool,
}

impl<W: Write> GetTo for OneGet<'_, '_, W> {
    fn lend(&mut self, bytes: &[u8], checksum: Checksum) -> Option<Checksum> {
        let hashed = Checksum::of(bytes);
        if hashed == checksum {
            let (mut head, mut tail) = (Vec::new(), Vec::new());
            let id = self.reply.request_id;
            self.sent = Some(
                get_hit_frame_parts(id, bytes.len(), checksum, &mut head, &mut tail)
                    .map_err(io::Error::other)
                    .and_then(|()| {
                        let mut parts =
                            [IoSlice::new(&head), IoSlice::new(bytes), IoSlice::new(&tail)];
                        write_all_vectored(self.reply.stream, &mut parts)
                    }),
            );
        }
        Some(hashed)
    }

    fn buffer(&mut self) -> &mut [u8] {
        self.laid_out = true;
        match begin_get_response(std::slice::from_ref(self.item), self.reply.out) {
            Ok(mut slots) => slots.pop().unwrap_or_default(),
            Err(_) => &mut [],
        }
    }
}

fn get_one<W: Write>(
    store: &dyn Store,
    who: &Caller,
    item: &GetItem,
    reply: &mut Reply<'_, W>,
) -> io::Result<()> {
    let capacity = usize::try_from(item.capacity).unwrap_or(usize::MAX);
    let mut to = OneGet { reply, item, sent: None, laid_out: false };
    let got = store.get_one(who, &item.key, capacity, &mut to);
    let OneGet { reply, sent, laid_out, .. } = to;
    let answer = match got {
        Ok(GotOne { get: Get::Hit { .. }, delivery: Delivery::Lent, .. }) => {
            return sent.unwrap_or_else(|| Err(io::Error::other("a lent hit was not sent")));
        }
        Ok(GotOne { get: get @ Get::Hit { .. }, .. }) if laid_out => {
            let items = std::slice::from_ref(item);
            return match finish_get_response(
                reply.request_id,
                None,
                items,
                vec![Ok(get)],
                reply.out,
            ) {
                Ok(()) => reply.write_out(),
                Err(e) => reply.send(&Response::Error(e)),
            };
        }
        Ok(GotOne { get: Get::Hit { .. }, .. }) => Err(StoreError::Backend {
            operation: "get",
            detail: "the store answered a copied hit without copying it".into(),
            retirement: Retirement::Retired,
        }),
        Ok(GotOne { get: Get::Miss(reason), .. }) => Ok(Fetched::Miss(reason)),
        Err(e) => Err(e),
    };
    reply.send(&Response::Get(vec![answer]))
}

/// FILL_BEGIN: a fill begins at the connection's cluster epoch on a node of a cluster (0
/// alone); the caller needs the write right on the key it will fill.
fn fill_begin(key: &PhysicalKey, who: &Caller, shared: &Shared) -> Response {
    if let Err(e) = authorize(who, key, Right::Write) {
        return Response::FillBegin(Err(FillRefused::Forbidden { detail: e.to_string() }));
    }
    let fills = &shared.config.fills;
    // On a node of a cluster the fence has checked the connection's epoch against the view;
    // fills begin at the epoch of the view's last change of members, which a drain does not
    // advance.
    let epoch = if shared.config.cluster.is_some() { fills.epoch() } else { Epoch(0) };
    Response::FillBegin(fills.begin(key.digest(), epoch).map_err(|r| FillRefused::from(&r)))
}

fn refuse(reason: AuthFailure) -> WireError {
    WireError::AuthFailed { reason }
}

/// Opens a session: an open tenant on its word; a tenant with keys after its HELLO proves the
/// key (fingerprint, then the frame's seal), the key is in force, the timestamp is within the
/// skew window and the seal algorithm is accepted. Returns the session and the HELLO answer.
fn hello(
    frame: &Frame,
    tenant: TenantId,
    asked: Rights,
    auth: Option<HelloAuth>,
    offer: Option<&str>,
    shared: &Shared,
) -> Result<(Session, Response), WireError> {
    let config = &shared.config;
    let granted = config
        .tenants
        .iter()
        .find(|c| c.tenant == tenant)
        .ok_or_else(|| WireError::UnknownTenant { tenant: tenant.clone() })?
        .rights;
    let rights = Rights {
        read: asked.read && granted.read,
        write: asked.write && granted.write,
        admin: asked.admin && granted.admin,
    };
    let mut replay = ReplayWindow::new();
    let Some(policy) = config.auth.get(&tenant) else {
        if auth.is_some() {
            return Err(refuse(AuthFailure::TenantOpen));
        }
        let session =
            Session { caller: Caller::new(tenant, rights), seal: None, replay, cluster_epoch: 0 };
        let answer = Response::Hello {
            version: VERSION,
            server: config.name.clone(),
            session: None,
            local: offer.map(str::to_owned),
        };
        return Ok((session, answer));
    };
    let (Some(auth), Some(_)) = (auth, frame.seal) else {
        return Err(refuse(AuthFailure::SecretRequired));
    };
    let key = policy.keys.find(&auth.key_id).ok_or(refuse(AuthFailure::UnknownKey))?;
    let secret = key.secret.bytes();
    let expected = seal::fingerprint(secret, tenant.as_str());
    if !bool::from(expected[..].ct_eq(&auth.fingerprint[..])) {
        return Err(refuse(AuthFailure::BadFingerprint));
    }
    frame.verify_seal(&SealKey::hello(secret)).map_err(|_| refuse(AuthFailure::BadSeal))?;
    let now_ms = config.clock.now_ms();
    if key.expired(now_ms) {
        return Err(refuse(AuthFailure::KeyExpired));
    }
    let skew_max_ms = u64::try_from(config.clock_skew_max.as_millis()).unwrap_or(u64::MAX);
    if now_ms.abs_diff(auth.timestamp_ms) > skew_max_ms {
        return Err(refuse(AuthFailure::ClockSkew));
    }
    if !policy.accepted.contains(&auth.seal) {
        return Err(refuse(AuthFailure::SealAlgorithm));
    }
    replay.accept(frame.request_id)?;
    let mut server_nonce = [0u8; NONCE_BYTES];
    getrandom::fill(&mut server_nonce)
        .map_err(|e| WireError::Internal { detail: format!("no random nonce: {e}") })?;
    let session_key = seal::session_key(secret, &auth.client_nonce, &server_nonce, tenant.as_str());
    tracing::debug!(%tenant, key = %key.id, seal = %auth.seal, "sealed session opened");
    let session = Session {
        caller: Caller::new(tenant, rights),
        seal: Some(SealKey::new(auth.seal, &session_key)),
        replay,
        cluster_epoch: 0,
    };
    let answer = Response::Hello {
        version: VERSION,
        server: config.name.clone(),
        session: Some(HelloSession { server_nonce, seal: auth.seal }),
        local: offer.map(str::to_owned),
    };
    Ok((session, answer))
}

/// Requires `right` of a call the store makes without a caller (so cannot check itself).
fn require(who: &Caller, right: Right) -> Result<(), StoreError> {
    if who.rights.has(right) {
        Ok(())
    } else {
        Err(StoreError::Forbidden { tenant: who.tenant.clone(), right })
    }
}

/// Settles a connection's open stages when it ends ([`BlockStaging::connection_closed`]).
struct StagesAtClose<'a> {
    staging: Option<&'a dyn BlockStaging>,
    connection: u64,
}

impl Drop for StagesAtClose<'_> {
    fn drop(&mut self) {
        if let Some(staging) = self.staging {
            staging.connection_closed(self.connection);
        }
    }
}

fn staging_of(shared: &Shared) -> Result<&dyn BlockStaging, WireError> {
    shared.config.staging.as_deref().ok_or_else(|| {
        StagingError::NotEnabled {
            reason: "the server runs without [nixl] (see docs/OPERATIONS.md)".into(),
        }
        .into()
    })
}

/// Runs a stage op (NIXL_ATTACH, STAGE_GET, RESERVE_PUT, COMMIT_PUT, RELEASE, STAGE_STATS)
/// against the server's staging memory; refused when the server runs without it. Keys are
/// authorised exactly as GET and PUT authorise them (by the store, or by [`authorize`] before
/// a slot is leased); stages belong to the tenant that opened them.
fn staged(
    shared: &Shared,
    op: impl FnOnce(&dyn BlockStaging) -> Result<Response, WireError>,
) -> Response {
    staging_of(shared).and_then(op).unwrap_or_else(Response::Error)
}

/// STAGE_GET: each block read from the store into its leased slot.
fn stage_get(
    staging: &dyn BlockStaging,
    owner: &StageOwner,
    now_ms: u64,
    store: &dyn Store,
    who: &Caller,
    items: &[GetItem],
) -> Result<Response, WireError> {
    let mut fills: Vec<_> = items
        .iter()
        .map(|item| {
            move |slot: &mut [u8]| {
                let capacity = usize::try_from(item.capacity).unwrap_or(usize::MAX);
                let end = capacity.min(slot.len());
                store.get_into(who, &item.key, &mut slot[..end])
            }
        })
        .collect();
    let mut refs: Vec<&mut gpucache_wire::staging::FillSlot<'_>> =
        fills.iter_mut().map(|f| f as &mut gpucache_wire::staging::FillSlot<'_>).collect();
    Ok(Response::StageGet(staging.stage_get(owner, now_ms, &mut refs)?))
}

fn shm_error(detail: impl std::fmt::Display) -> Response {
    Response::Error(WireError::SharedMemory { detail: detail.to_string() })
}
/// Maps the segment whose descriptor arrived with SHM_ATTACH, within the server-wide budget.
fn attach<'a>(len: u64, local: &mut Local<'a>, shared: &'a Shared) -> Response {
    let Some(fd) = local.pending_fd.take() else {
        return shm_error("no descriptor arrived with SHM_ATTACH (it needs the Unix socket)");
    };
    if local.segment.is_some() {
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
    local.segment = Some(Mapped { segment, budget: &shared.shm_mapped });
    Response::ShmAttach(len)
}

/// GET straight into the client's segment. Every range is checked before any is written; the
/// items then go to the store as one batch, each into its own range. Ranges that overlap (which
/// a client's distinct buffers never do) cannot be handed out together, so such a frame is
/// served one item at a time, in order.
fn get_shared(
    store: &dyn Store,
    who: &Caller,
    segment: &Segment,
    items: &[SharedGetItem],
) -> Response {
    if let Some(e) = items.iter().find_map(|i| segment.check(i.offset, i.capacity).err()) {
        return shm_error(e);
    }
    let ranges: Option<Vec<Range<usize>>> =
        items.iter().map(|i| usize_range(i.offset, i.capacity)).collect();
    let Some(ranges) = ranges.filter(|r| disjoint(r)) else {
        return Response::GetShared(
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
        );
    };
    let answers = segment.with_bytes_mut(0, segment.len(), |all| {
        let mut batch: Vec<BatchGet<'_>> = items
            .iter()
            .zip(split_disjoint(all, &ranges))
            .map(|(item, dst)| BatchGet { key: &item.key, dst })
            .collect();
        store.get_batch(who, &mut batch)
    });
    match answers {
        Ok(answers) => Response::GetShared(answers),
        Err(e) => shm_error(e),
    }
}

/// PUT straight from the client's segment, the frame's items as one batch. The store checks
/// what it copied against the checksum the client sent, in the pass that copies it, and
/// commits nothing whose bytes changed during the copy.
fn put_shared(
    store: &dyn Store,
    who: &Caller,
    segment: &Segment,
    items: &[SharedPutItem],
) -> Response {
    if let Some(e) = items.iter().find_map(|i| segment.check(i.offset, i.len).err()) {
        return shm_error(e);
    }
    let Some(ranges) =
        items.iter().map(|i| usize_range(i.offset, i.len)).collect::<Option<Vec<_>>>()
    else {
        return shm_error("a range does not fit this host's addresses");
    };
    let sums: Vec<Checksum> = items.iter().map(|i| i.checksum).collect();
    let answers = segment.with_bytes(0, segment.len(), |all| {
        let batch: Vec<BatchPut<'_>> = items
            .iter()
            .zip(&ranges)
            .map(|(item, range)| BatchPut {
                key: &item.key,
                src: all.get(range.clone()).unwrap_or_default(),
                request: item.request,
            })
            .collect();
        store.put_batch_checked(who, &batch, &sums)
    });
    match answers {
        Ok(answers) => Response::PutShared(answers),
        Err(e) => shm_error(e),
    }
}

/// `len` bytes at `offset`, as a range of this host's addresses.
fn usize_range(offset: u64, len: u64) -> Option<Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    Some(start..start.checked_add(usize::try_from(len).ok()?)?)
}

/// Whether no two of `ranges` share a byte (empty ranges share none).
fn disjoint(ranges: &[Range<usize>]) -> bool {
    let mut sorted: Vec<&Range<usize>> = ranges.iter().filter(|r| !r.is_empty()).collect();
    sorted.sort_by_key(|r| r.start);
    sorted.windows(2).all(|w| w[0].end <= w[1].start)
}

/// `all` cut into one slice per range of `ranges` (which are [`disjoint`] and within `all`), in
/// the order of `ranges`.
fn split_disjoint<'a>(all: &'a mut [u8], ranges: &[Range<usize>]) -> Vec<&'a mut [u8]> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].start, ranges[i].end));
    let mut slices: Vec<Option<&'a mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
    let (mut rest, mut at) = (all, 0);
    for i in order {
        let Range { start, end } = ranges[i].clone();
        let tail = std::mem::take(&mut rest);
        let skip = start.saturating_sub(at).min(tail.len());
        let (_, tail) = tail.split_at_mut(skip);
        let take = end.saturating_sub(start).min(tail.len());
        let (slice, tail) = tail.split_at_mut(take);
        slices[i] = Some(slice);
        rest = tail;
        at = at.max(start) + take;
    }
    slices.into_iter().map(Option::unwrap_or_default).collect()
}

fn shm_backend(
    operation: &'static str,
    e: gpucache_storage::host::segment::ShmError,
) -> StoreError {
    let detail = e.to_string();
    match e.io_kind() {
        Some(kind) => StoreError::Io { operation, kind, detail, retirement: Retirement::Retired },
        None => StoreError::Backend { operation, detail, retirement: Retirement::Retired },
    }
}
