//! The client of the native GPCW service, as a [`Store`], over pooled connections (one pool per
//! tenant and rights), each exchange with a deadline. A single-key call is one request frame
//! and its answer. A batch call ([`Store::lookup_batch`], [`Store::get_batch`],
//! [`Store::put_batch`], [`Store::invalidate_batch`]) is one exchange on one connection: the
//! batch is split into as few frames as the protocol's limits allow ([`BATCH_ITEMS_MAX`]
//! items, [`PAYLOAD_BYTES_MAX`] payload bytes), every frame is sent without waiting for the
//! answers before it (at most [`FRAMES_IN_FLIGHT_MAX`] unanswered), and each answer is landed
//! as it arrives. Every item gets its own answer; when the exchange breaks, every item whose
//! frame was not answered gets the failure, with the retirement its buffer is in.
//!
//! A tenant with [`Credentials`] in the configuration opens sealed sessions (ADR 0012): every
//! request is sealed with the session key and every answer's seal is checked before anything in
//! it is used; an answer that does not verify is a transport failure, never data.
//!
//! Over TCP the remote store never touches the caller's memory: a GET's bytes arrive in a frame
//! and are copied into the caller's buffer only after their checksum verifies, and a PUT's bytes
//! are sent before the call returns. So every failure, transport failures included, is retired
//! (`failures_retire` is true). A transport failure is never a hit: the caller recomputes.
//!
//! On the same host ([`LocalConfig`]) the client talks to the server's Unix socket instead and
//! hands it a sealed shared segment at connect; payloads then move through the segment, with
//! the same answers. A buffer from [`TcpStore::shared_buffer`] lives in the segment, so a GET
//! into it is written there by the server directly (no copy here) and a PUT from it is read from
//! there; any other buffer goes through a bounce buffer of the segment (one copy here, none
//! through the socket). The store verifies a block's checksum over the bytes it wrote into the
//! segment (that is what a hit means), so the client does not hash them again. A failed call
//! whose server side may still be writing a caller's shared buffer reports
//! [`Retirement::Unknown`]; a bounce buffer in that state is quarantined for good.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::ops::Range;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use std::sync::Arc;

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::{Checksum, ChecksumBuilder};
use gpucache_dataplane::clock::{Clock, UnixClock};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::shard::{FillLease, FillNotice, FillOutcome, FillStart, FillTicket};
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchGet, BatchPut, Committed, FullPolicy, Get, Implementation,
    Invalidate, Located, Lookup, MissReason, PurgeScope, Purged, Put, Reclaimed, Reservation,
    Reserve, Retirement, Store, StoreError, StoreInfo, StoreStats, put_batch_verified,
};

use gpucache_storage::host::segment::{Pages, Segment, SharedArena, SharedBuf, send_with_fd};

use crate::Credentials;
use gpucache_wire::seal::{self, NONCE_BYTES, SealKey};
use gpucache_wire::staging::{StageCallError, StageId, StagedGet, StagedSlot, StagingStats};
use gpucache_wire::{
    BATCH_ITEMS_MAX, FetchedRef, FillRefused, Frame, FrameDecoder, GetItem, HEADER_BYTES,
    HelloAuth, NodeStatus, Op, RemoteInfo, Request, Response, ServerLimits, SharedGetItem,
    SharedPutItem, WireError, decode_get_response, encode_put_request, put_request_parts, sole_hit,
    write_all_vectored,
};

/// Idle connections kept per (tenant, rights).
const POOL_CONNECTIONS_MAX: usize = 8;
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Largest request buffer a connection keeps between requests.
const OUT_BUFFER_KEEP_BYTES: usize = 8 << 20;
/// Default for [`ClientConfig::handshake_deadline`].
pub const HANDSHAKE_DEADLINE_DEFAULT: Duration = Duration::from_secs(5);
/// Most PURGE requests one [`TcpStore::purge`] sends (each removes at most
/// `PURGE_BLOCKS_MAX` blocks): 4 Mi blocks, more than a server's default registrations.
pub const PURGE_ROUNDS_MAX: usize = 64;

/// How to reach a server.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub addr: SocketAddr,
    /// Sending a request and receiving its answer each must finish within this.
    pub deadline: Duration,
    /// Connecting and the HELLO exchange must finish within this, whatever `deadline` is: a
    /// peer that is not a GPCW server (a RESP or HTTP port) never answers HELLO.
    pub handshake_deadline: Duration,
    /// The identity used for calls the store trait makes without a caller (epoch, stats,
    /// leases, fences).
    pub control: Caller,
    pub client_name: String,
    /// The keys of tenants that authenticate; a tenant not here connects as an open tenant.
    pub credentials: HashMap<TenantId, Credentials>,
    /// Unix-epoch milliseconds, for HELLO timestamps.
    pub clock: Arc<dyn Clock>,
    /// The same-host fast path: talk to the server's Unix socket and share a segment with it.
    pub local: Option<LocalConfig>,
}

/// The same-host fast path of a client. It is required once configured: a server that offers
/// no Unix socket (another host, or no `listen.local`) is a transport error, never a silent
/// fallback to TCP.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// The server's Unix socket (`listen.local` in its configuration); `None` to take the one
    /// the server offers in its HELLO answer to a TCP client on this host.
    pub path: Option<PathBuf>,
    /// Size of the one segment this client shares with the server over all its connections;
    /// it bounds the shared buffers and bounce space in use at once.
    pub segment_bytes: u64,
    pub pages: Pages,
}

impl LocalConfig {
    /// Negotiated at connect: the socket is the one the server offers over TCP.
    pub fn negotiated() -> Self {
        Self { path: None, segment_bytes: 256 << 20, pages: Pages::Normal }
    }

    /// A known socket path.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: Some(path.into()), ..Self::negotiated() }
    }
}

impl ClientConfig {
    pub fn new(addr: SocketAddr, control: Caller) -> Self {
        Self {
            addr,
            deadline: Duration::from_secs(30),
            handshake_deadline: HANDSHAKE_DEADLINE_DEFAULT,
            control,
            client_name: "gpucache-client".into(),
            credentials: HashMap::new(),
            clock: Arc::new(UnixClock),
            local: None,
        }
    }

    /// Adds the credentials `tenant` signs its sessions with.
    pub fn with_credentials(mut self, tenant: TenantId, credentials: Credentials) -> Self {
        self.credentials.insert(tenant, credentials);
        self
    }
}

/// A connection's socket: TCP, or the server's Unix socket on the same host.
#[derive(Debug)]
enum Stream {
    Tcp(TcpStream),
    Local(UnixStream),
}

impl Stream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(t),
            Self::Local(s) => s.set_read_timeout(t),
        }
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(t),
            Self::Local(s) => s.set_write_timeout(t),
        }
    }

    /// A second handle on the same socket, for the thread that sends a batch's frames while
    /// this one reads their answers.
    fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Local(s) => Self::Local(s.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Local(s) => s.shutdown(how),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Local(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Local(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write_vectored(bufs),
            Self::Local(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Local(s) => s.flush(),
        }
    }
}

#[derive(Debug)]
struct Conn {
    stream: Stream,
    /// The request being sent, reused between requests.
    out: Vec<u8>,
    decoder: FrameDecoder,
    buf: Vec<u8>,
    /// Bytes of `buf` read from the socket and not yet fed to the decoder: the start of the
    /// next answer, when several answers arrived in one read.
    pending: Range<usize>,
    /// The session key of a sealed session.
    seal: Option<SealKey>,
    /// The cluster epoch this connection said it routes by (CLUSTER), if it said one.
    declared: Option<u64>,
}

type PoolKey = (TenantId, bool, bool, bool);

fn pool_key(caller: &Caller) -> PoolKey {
    (caller.tenant.clone(), caller.rights.read, caller.rights.write, caller.rights.admin)
}

/// A [`Store`] served by a remote `gpucache serve`.
#[derive(Debug)]
pub struct TcpStore {
    config: ClientConfig,
    pools: Mutex<HashMap<PoolKey, Vec<Conn>>>,
    next_id: AtomicU64,
    info: OnceLock<RemoteInfo>,
    /// The shared segment of the same-host path, made at the first connection.
    arena: OnceLock<SharedArena>,
    /// The Unix socket the server offered, when the configuration names none.
    local_path: OnceLock<PathBuf>,
    shared: SharedCounters,
    /// The cluster epoch requests are routed by; [`NOT_CLUSTERED`] for a server that runs
    /// alone.
    cluster_epoch: AtomicU64,
}

/// [`TcpStore::set_cluster_epoch`] was never called: requests say no epoch.
const NOT_CLUSTERED: u64 = u64::MAX;

/// What the same-host path did, for operators and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedStats {
    /// Items served straight from or into a caller's shared buffer.
    pub direct_items: u64,
    /// Items that went through a bounce buffer of the segment.
    pub bounced_items: u64,
    /// Batches sent as ordinary frames because the segment had no room for a bounce buffer.
    pub framed_batches: u64,
    /// Segment bytes withheld for good after failed requests.
    pub quarantined_bytes: u64,
    /// Segment bytes free now.
    pub free_bytes: u64,
}

#[derive(Debug, Default)]
struct SharedCounters {
    direct_items: AtomicU64,
    bounced_items: AtomicU64,
    framed_batches: AtomicU64,
}

impl SharedCounters {
    fn count(&self, places: &[Place]) {
        let direct = places.iter().filter(|p| matches!(p, Place::Caller(_))).count() as u64;
        self.direct_items.fetch_add(direct, Ordering::Relaxed);
        self.bounced_items.fetch_add(places.len() as u64 - direct, Ordering::Relaxed);
    }
}

fn transport(operation: &'static str, detail: impl std::fmt::Display) -> StoreError {
    StoreError::Backend {
        operation,
        detail: format!("transport: {detail}"),
        retirement: Retirement::Retired,
    }
}

/// A transport failure; one caused by a system I/O error keeps that error's kind.
fn transport_failure(
    operation: &'static str,
    kind: Option<io::ErrorKind>,
    detail: impl std::fmt::Display,
) -> StoreError {
    match kind {
        Some(kind) => StoreError::Io {
            operation,
            kind,
            detail: format!("transport: {detail}"),
            retirement: Retirement::Retired,
        },
        None => transport(operation, detail),
    }
}

/// How one request and its answer failed, before any answer could be read.
#[derive(Debug, thiserror::Error)]
enum ExchangeFailure {
    #[error("request not encodable: {0}")]
    Encode(WireError),
    #[error("{0}")]
    Io(io::Error),
    #[error("no answer within {0:?}")]
    Deadline(Duration),
    #[error("server closed the connection")]
    Closed,
    /// The bytes that came back are not a GPCW frame (or not a sound one).
    #[error("{0}")]
    Frame(WireError),
    #[error("server sent bytes past the answer")]
    PastTheAnswer,
    #[error("answer for request {found} ({what}), expected {expected}")]
    OtherAnswer { found: u64, what: String, expected: u64 },
}

impl ExchangeFailure {
    /// The system's error kind, for a failure of the socket itself.
    fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            Self::Io(e) => Some(e.kind()),
            _ => None,
        }
    }

    /// Whether the connection turned out closed or reset: its server side is gone, and a
    /// request sent on it while it sat idle in the pool can be sent again on a fresh one.
    fn is_dead(&self) -> bool {
        matches!(self, Self::Closed | Self::Io(_))
    }

    fn into_store_error(self, operation: &'static str) -> StoreError {
        match self {
            Self::Encode(e) => not_encodable(operation, e),
            other => transport_failure(operation, other.io_kind(), other),
        }
    }
}

fn not_encodable(operation: &'static str, e: WireError) -> StoreError {
    StoreError::Backend {
        operation,
        detail: format!("request not encodable: {e}"),
        retirement: Retirement::Retired,
    }
}

/// An answer frame as the caller may use it: its seal verified on a sealed session, and not an
/// error that closes the connection (those are transport failures). On failure, says whether
/// the server turned the connection away before serving anything (a dead connection).
fn checked(
    frame: Frame,
    seal: Option<&SealKey>,
    operation: &'static str,
) -> Result<Frame, (StoreError, bool)> {
    if let Some(key) = seal {
        // Never let an answer that fails its seal reach the caller, whatever it holds.
        frame
            .verify_seal(key)
            .map_err(|e| (transport(operation, format!("answer: {e}")), false))?;
    }
    if frame.op == Op::Error {
        let response =
            Response::from_frame(&frame).map_err(|e| (transport(operation, e), false))?;
        if let Response::Error(e) = &response
            && e.closes_connection()
        {
            return Err((unexpected(operation, &response), frame.request_id == 0));
        }
    }
    Ok(frame)
}

/// Why a session could not be opened: the socket, or the server's answer to HELLO. As a
/// [`StoreError`] it is a transport failure whose detail is this message.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot connect to {addr}: {source}")]
    Unreachable { addr: String, source: io::Error },
    /// The server has no such tenant in its configuration.
    #[error("unknown tenant {tenant:?}: the server has no such tenant configured")]
    UnknownTenant { tenant: TenantId },
    /// The server is at its connection limit and turned this one away.
    #[error("the server is busy ({connections} of {max} connections); try again later")]
    Busy { connections: u32, max: u32 },
    /// Nothing came back to HELLO within the handshake deadline: most likely not a GPCW
    /// listener (a RESP or HTTP port waits for more bytes instead of answering).
    #[error(
        "{addr} sent no answer to HELLO within {waited:?}: is it the native (GPCW) listener, not \
         the RESP or metrics one?"
    )]
    NoAnswer { addr: String, waited: Duration },
    /// What came back is not a GPCW frame.
    #[error("{addr} does not speak GPCW (is it the native listener?): {error}")]
    NotGpcw { addr: String, error: WireError },
    /// The server answered HELLO with a refusal (authentication, shutdown, ...).
    #[error("the server refused the session: {0}")]
    Refused(WireError),
    /// The same-host path was asked for and the server offers no Unix socket.
    #[error(
        "the server offers no local socket (it runs on another host, or without listen.local); \
         the same-host path was asked for"
    )]
    NoLocalSocket,
    /// Any other failure while the session was being opened.
    #[error("{0}")]
    Session(String),
}

impl ConnectError {
    fn from_answer(answer: WireError, tenant: &TenantId) -> Self {
        match answer {
            // Servers that predate UnknownTenant answer a HELLO for one this way: HELLO is
            // the one request that cannot be "before HELLO".
            WireError::UnknownTenant { tenant } => Self::UnknownTenant { tenant },
            WireError::NotAuthenticated => Self::UnknownTenant { tenant: tenant.clone() },
            WireError::Busy { connections, max } => Self::Busy { connections, max },
            other => Self::Refused(other),
        }
    }

    fn from_exchange(failure: ExchangeFailure, addr: String) -> Self {
        match failure {
            ExchangeFailure::Deadline(waited) => Self::NoAnswer { addr, waited },
            ExchangeFailure::Frame(
                error @ (WireError::BadMagic { .. }
                | WireError::HeaderChecksum { .. }
                | WireError::UnsupportedVersion { .. }
                | WireError::WrongKind { .. }),
            ) => Self::NotGpcw { addr, error },
            other => Self::Session(format!("HELLO: {other}")),
        }
    }

    /// The system's error kind, when the server could not be reached at all.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            Self::Unreachable { source, .. } => Some(source.kind()),
            _ => None,
        }
    }
}

fn unexpected(operation: &'static str, response: &Response) -> StoreError {
    match response {
        // The server turned the connection away (stopping, full): a transport failure.
        Response::Error(e) if e.closes_connection() => transport(operation, format!("server: {e}")),
        Response::Error(WireError::Fenced(refusal)) => StoreError::Fenced(*refusal),
        Response::Error(e) => StoreError::Backend {
            operation,
            detail: format!("server: {e}"),
            retirement: Retirement::Retired,
        },
        other => transport(operation, format!("unexpected answer {:?}", other.op())),
    }
}

fn check_right(caller: &Caller, right: Right) -> Result<(), StoreError> {
    if caller.rights.has(right) {
        Ok(())
    } else {
        Err(StoreError::Forbidden { tenant: caller.tenant.clone(), right })
    }
}

impl TcpStore {
    pub fn new(config: ClientConfig) -> Self {
        Self {
            config,
            pools: Mutex::default(),
            next_id: AtomicU64::new(1),
            info: OnceLock::new(),
            arena: OnceLock::new(),
            local_path: OnceLock::new(),
            cluster_epoch: AtomicU64::new(NOT_CLUSTERED),
            shared: SharedCounters::default(),
        }
    }

    /// What the same-host path has done so far (all zero over TCP).
    pub fn shared_stats(&self) -> SharedStats {
        let c = &self.shared;
        let arena = self.arena.get();
        SharedStats {
            direct_items: c.direct_items.load(Ordering::Relaxed),
            bounced_items: c.bounced_items.load(Ordering::Relaxed),
            framed_batches: c.framed_batches.load(Ordering::Relaxed),
            quarantined_bytes: arena.map_or(0, SharedArena::quarantined_bytes),
            free_bytes: arena.map_or(0, SharedArena::free_bytes),
        }
    }

    /// The shared segment of the same-host path (made on first use); `None` over TCP.
    fn arena(&self, operation: &'static str) -> Result<Option<&SharedArena>, StoreError> {
        let Some(local) = &self.config.local else { return Ok(None) };
        if let Some(a) = self.arena.get() {
            return Ok(Some(a));
        }
        let segment = Segment::create(local.segment_bytes, local.pages).map_err(|e| {
            transport_failure(operation, e.io_kind(), format!("shared segment: {e}"))
        })?;
        Ok(Some(self.arena.get_or_init(|| SharedArena::new(segment))))
    }

    /// A buffer of `len` bytes inside the segment shared with the server: a GET into it or a PUT
    /// from it moves no payload through the socket and copies nothing on this side. `None` when
    /// the client is not on the same-host path or the segment has no free range that large.
    pub fn shared_buffer(&self, len: usize) -> Option<SharedBuf> {
        self.arena("shared_buffer").ok().flatten()?.alloc(len)
    }

    fn tcp_stream(&self) -> Result<Stream, ConnectError> {
        let addr = self.config.addr;
        let stream = TcpStream::connect_timeout(&addr, self.config.handshake_deadline)
            .map_err(|source| ConnectError::Unreachable { addr: addr.to_string(), source })?;
        let _ = stream.set_nodelay(true);
        Ok(Stream::Tcp(stream))
    }

    /// The server's Unix socket: configured, or learnt from a HELLO over TCP (once).
    fn local_path(&self, local: &LocalConfig, caller: &Caller) -> Result<PathBuf, ConnectError> {
        if let Some(p) = local.path.as_ref().or_else(|| self.local_path.get()) {
            return Ok(p.clone());
        }
        let (_, offered) = self.hello(self.tcp_stream()?, caller)?;
        let path = offered.ok_or(ConnectError::NoLocalSocket)?;
        Ok(self.local_path.get_or_init(|| PathBuf::from(path)).clone())
    }

    /// The Unix socket the server offers to same-host clients, as a fresh HELLO over TCP as
    /// `caller` answers it (`None`: it offers none), whether or not this client uses it.
    pub fn offered_local_socket(&self, caller: &Caller) -> Result<Option<String>, ConnectError> {
        self.hello(self.tcp_stream()?, caller).map(|(_, offered)| offered)
    }

    /// Where the segment shared with the server is mapped in this process (its first byte's
    /// address and its length), once the same-host path has made it; `None` over TCP. A GET
    /// into a range inside it, or a PUT from one, is served there by the server directly.
    pub fn shared_segment_span(&self) -> Option<(usize, usize)> {
        let segment = self.arena.get()?.segment();
        let base = segment.with_bytes(0, segment.len(), |all| all.as_ptr() as usize).ok()?;
        Some((base, usize::try_from(segment.len()).ok()?))
    }

    /// Whether this client takes the same-host path (its configuration has a [`LocalConfig`]).
    pub fn is_local(&self) -> bool {
        self.config.local.is_some()
    }

    /// Opens a session as `caller` now and keeps it in the pool for the next request, so that
    /// a caller learns why the server cannot be used (unreachable, not GPCW, busy, unknown
    /// tenant, refused credentials) as a typed error before its first request.
    pub fn handshake(&self, caller: &Caller) -> Result<(), ConnectError> {
        let conn = self.open(caller)?;
        self.keep(pool_key(caller), conn);
        Ok(())
    }

    fn connect(&self, caller: &Caller, operation: &'static str) -> Result<Conn, StoreError> {
        let mut conn =
            self.open(caller).map_err(|e| transport_failure(operation, e.io_kind(), e))?;
        self.declare(&mut conn, operation)?;
        Ok(conn)
    }

    /// Routes this store's requests by cluster epoch `epoch` from now on: each connection says
    /// it (CLUSTER) before its next request, and a node of a cluster refuses requests of any
    /// other epoch with [`StoreError::Fenced`].
    pub fn set_cluster_epoch(&self, epoch: u64) {
        self.cluster_epoch.store(epoch.min(NOT_CLUSTERED - 1), Ordering::Release);
    }

    /// The node's standing in its cluster (CLUSTER, saying this store's epoch); none for a
    /// server that runs alone.
    pub fn node_status(&self) -> Result<Option<NodeStatus>, StoreError> {
        let epoch = match self.cluster_epoch.load(Ordering::Acquire) {
            NOT_CLUSTERED => 0,
            e => e,
        };
        match self.control(Request::Cluster { epoch }, "cluster")? {
            Response::Cluster(status) => Ok(status),
            other => Err(unexpected("cluster", &other)),
        }
    }

    /// Leads or joins the single-flight fill of `key` (FILL_BEGIN; the caller needs the write
    /// right on it). A leader computes the block, PUTs it and calls
    /// [`finish_fill`](Self::finish_fill); a joiner waits with [`wait_fill`](Self::wait_fill).
    pub fn begin_fill(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
    ) -> Result<Result<FillStart, FillRefused>, StoreError> {
        match self.call(caller, Request::FillBegin { key: Box::new(key.clone()) }, "fill")? {
            Response::FillBegin(begun) => Ok(begun),
            other => Err(unexpected("fill", &other)),
        }
    }

    /// The leader's outcome of its fill (FILL_FINISH); answers how the fill stands after it.
    pub fn finish_fill(
        &self,
        caller: &Caller,
        lease: &FillLease,
        outcome: FillOutcome,
    ) -> Result<FillNotice, StoreError> {
        let stored = outcome == FillOutcome::Stored;
        match self.call(caller, Request::FillFinish { lease: *lease, stored }, "fill")? {
            Response::FillFinish(notice) => Ok(notice),
            other => Err(unexpected("fill", &other)),
        }
    }

    /// The fill's outcome, the server waiting up to `wait` while it is pending (FILL_WAIT); the
    /// wait is kept a second short of this store's request deadline.
    pub fn wait_fill(
        &self,
        caller: &Caller,
        ticket: &FillTicket,
        wait: Duration,
    ) -> Result<FillNotice, StoreError> {
        let most = self.config.deadline.saturating_sub(Duration::from_secs(1));
        let wait_ms = u64::try_from(wait.min(most).as_millis()).unwrap_or(u64::MAX);
        match self.call(caller, Request::FillWait { ticket: *ticket, wait_ms }, "fill")? {
            Response::FillWait(notice) => Ok(notice),
            other => Err(unexpected("fill", &other)),
        }
    }

    /// Removes every committed block of `scope` from the server (PURGE; the caller needs the
    /// write right on the scope's tenant): one request per [`PURGE_BLOCKS_MAX`] blocks, while
    /// the server says more may remain and the last request removed some, at most
    /// [`PURGE_ROUNDS_MAX`] requests. Answers the blocks removed and the busy answers (a
    /// reader or writer held the block; summed over the requests), and `more` when the last
    /// request still left some of the scope.
    ///
    /// [`PURGE_BLOCKS_MAX`]: gpucache_dataplane::store::PURGE_BLOCKS_MAX
    pub fn purge(&self, caller: &Caller, scope: &PurgeScope) -> Result<Purged, StoreError> {
        let mut total = Purged::default();
        for _ in 0..PURGE_ROUNDS_MAX {
            let request = Request::Purge { scope: Box::new(scope.clone()) };
            let round = match self.call(caller, request, "purge")? {
                Response::Purge(answer) => answer?,
                other => return Err(unexpected("purge", &other)),
            };
            total.removed += round.removed;
            total.busy += round.busy;
            total.more = round.more;
            if !round.more || round.removed == 0 {
                break;
            }
        }
        Ok(total)
    }

    /// Says the cluster epoch on `conn` when it has not said the current one yet.
    fn declare(&self, conn: &mut Conn, operation: &'static str) -> Result<(), StoreError> {
        let epoch = self.cluster_epoch.load(Ordering::Acquire);
        if epoch == NOT_CLUSTERED || conn.declared == Some(epoch) {
            return Ok(());
        }
        let frame = self.exchange_with(conn, &Request::Cluster { epoch }, operation, None)?;
        match Response::from_frame(&frame).map_err(|e| transport(operation, e))? {
            Response::Cluster(Some(_)) => {
                conn.declared = Some(epoch);
                Ok(())
            }
            Response::Cluster(None) => Err(StoreError::Backend {
                operation,
                detail: "the server runs alone, not as a node of a cluster".into(),
                retirement: Retirement::Retired,
            }),
            other => Err(unexpected(operation, &other)),
        }
    }

    /// A new connection with its session open (and, on the same-host path, the segment
    /// attached).
    fn open(&self, caller: &Caller) -> Result<Conn, ConnectError> {
        let Some(local) = &self.config.local else {
            return Ok(self.hello(self.tcp_stream()?, caller)?.0);
        };
        let path = self.local_path(local, caller)?;
        let stream = UnixStream::connect(&path).map(Stream::Local).map_err(|source| {
            ConnectError::Unreachable { addr: format!("local socket {}", path.display()), source }
        })?;
        let (mut conn, _) = self.hello(stream, caller)?;
        let arena = self.arena("connect").map_err(|e| ConnectError::Session(e.to_string()))?;
        if let Some(arena) = arena {
            let segment = arena.segment();
            let attach = Request::ShmAttach { len: segment.len() };
            let frame = self
                .exchange_with(&mut conn, &attach, "connect", Some(segment))
                .map_err(|e| ConnectError::Session(format!("SHM_ATTACH: {e}")))?;
            match Response::from_frame(&frame) {
                Ok(Response::ShmAttach(len)) if len == segment.len() => {}
                Ok(Response::Error(e)) => return Err(ConnectError::Refused(e)),
                Ok(other) => {
                    return Err(ConnectError::Session(format!(
                        "SHM_ATTACH answered by {}",
                        other.op()
                    )));
                }
                Err(e) => return Err(ConnectError::Session(format!("SHM_ATTACH answer: {e}"))),
            }
        }
        Ok(conn)
    }

    /// Opens a session on `stream` within the handshake deadline; returns it and the Unix
    /// socket the server offers.
    fn hello(
        &self,
        stream: Stream,
        caller: &Caller,
    ) -> Result<(Conn, Option<String>), ConnectError> {
        let peer = match &stream {
            Stream::Tcp(_) => self.config.addr.to_string(),
            Stream::Local(_) => "the local socket".to_owned(),
        };
        let mut conn = Conn {
            stream,
            out: Vec::new(),
            decoder: FrameDecoder::new(),
            buf: vec![0; READ_CHUNK_BYTES],
            pending: 0..0,
            seal: None,
            declared: None,
        };
        let credentials = self.config.credentials.get(&caller.tenant);
        let mut client_nonce = [0u8; NONCE_BYTES];
        if credentials.is_some() {
            getrandom::fill(&mut client_nonce)
                .map_err(|e| ConnectError::Session(format!("no random nonce: {e}")))?;
        }
        let tenant = caller.tenant.as_str();
        let hello = Request::Hello {
            tenant: caller.tenant.clone(),
            client_name: self.config.client_name.clone(),
            rights: caller.rights,
            auth: credentials.map(|c| HelloAuth {
                key_id: c.key_id.clone(),
                fingerprint: seal::fingerprint(c.secret.bytes(), tenant),
                client_nonce,
                timestamp_ms: self.config.clock.now_ms(),
                seal: c.seal,
            }),
        };
        let hello_key = credentials.map(|c| SealKey::hello(c.secret.bytes()));
        let frame = self
            .exchange_within(
                &mut conn,
                &hello,
                hello_key.as_ref(),
                None,
                self.config.handshake_deadline,
                None,
            )
            .map_err(|f| ConnectError::from_exchange(f, peer))?;
        let answer = Response::from_frame(&frame)
            .map_err(|e| ConnectError::Session(format!("HELLO answer: {e}")))?;
        match (answer, credentials) {
            (Response::Hello { session: None, local, .. }, None) => Ok((conn, local)),
            (Response::Hello { session: Some(s), local, .. }, Some(c)) if s.seal == c.seal => {
                let key =
                    seal::session_key(c.secret.bytes(), &client_nonce, &s.server_nonce, tenant);
                let key = SealKey::new(s.seal, &key);
                frame
                    .verify_seal(&key)
                    .map_err(|e| ConnectError::Session(format!("HELLO answer: {e}")))?;
                conn.seal = Some(key);
                Ok((conn, local))
            }
            (Response::Hello { .. }, _) => Err(ConnectError::Session(
                "HELLO answer does not match the credentials offered".into(),
            )),
            (Response::Error(e), _) => Err(ConnectError::from_answer(e, &caller.tenant)),
            (other, _) => Err(ConnectError::Session(format!("HELLO answered by {}", other.op()))),
        }
    }

    /// Sends one request (handing over `segment`'s descriptor with it, on a Unix socket) and
    /// returns the frame that answers it, its seal verified on a sealed session. An error answer
    /// that closes the connection is a transport failure.
    fn exchange_with(
        &self,
        conn: &mut Conn,
        request: &Request,
        operation: &'static str,
        segment: Option<&Segment>,
    ) -> Result<Frame, StoreError> {
        let seal = conn.seal.clone();
        let frame = self
            .exchange_within(conn, request, seal.as_ref(), segment, self.config.deadline, None)
            .map_err(|f| f.into_store_error(operation))?;
        checked(frame, seal.as_ref(), operation).map_err(|(e, _)| e)
    }

    /// Sends one request (sealed with `seal` when given, with `segment`'s descriptor when
    /// given) and returns the frame that answers it within `deadline`, failing with what went
    /// wrong. The request is encoded into the connection's reused buffer; the rest of a large
    /// answer is read straight into the decoder's body buffer. An ERROR frame with request id
    /// 0 answers the request too: it is how a server turns a connection away (busy, stopping)
    /// or answers a frame whose header it could not trust. With `sink`, the payload of a
    /// one-hit GET answer is read into it instead (see [`Sink`]).
    fn exchange_within(
        &self,
        conn: &mut Conn,
        request: &Request,
        seal: Option<&SealKey>,
        segment: Option<&Segment>,
        deadline: Duration,
        sink: Option<&mut Sink<'_>>,
    ) -> Result<Frame, ExchangeFailure> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        conn.out.clear();
        request.encode_sealed_frame(id, seal, &mut conn.out).map_err(ExchangeFailure::Encode)?;
        let until = Instant::now() + deadline;
        let sent = self.send_out(conn, segment, deadline);
        let frame = self.answer_after_send(conn, sent, id, until, deadline, sink)?;
        // One request, one answer: anything after it breaks the connection.
        if !conn.pending.is_empty() {
            return Err(ExchangeFailure::PastTheAnswer);
        }
        Ok(frame)
    }

    /// Writes the connection's encoded request (with `segment`'s descriptor, on a Unix socket)
    /// within `deadline`.
    fn send_out(
        &self,
        conn: &mut Conn,
        segment: Option<&Segment>,
        deadline: Duration,
    ) -> io::Result<()> {
        conn.stream.set_write_timeout(Some(deadline))?;
        let sent = match (&conn.stream, segment) {
            (Stream::Local(s), Some(seg)) => send_with_fd(s, &conn.out, seg.fd()),
            (Stream::Tcp(_), Some(_)) => Err(io::Error::other("a descriptor needs a Unix socket")),
            (_, None) => conn.stream.write_all(&conn.out),
        };
        if conn.out.capacity() > OUT_BUFFER_KEEP_BYTES {
            conn.out = Vec::new();
        }
        sent
    }

    /// The answer to request `id` once its frame was written (`sent`). When writing failed, a
    /// server that turned the connection away wrote why before it closed: that is the answer.
    fn answer_after_send(
        &self,
        conn: &mut Conn,
        sent: io::Result<()>,
        id: u64,
        until: Instant,
        deadline: Duration,
        sink: Option<&mut Sink<'_>>,
    ) -> Result<Frame, ExchangeFailure> {
        match sent {
            Ok(()) => self.read_answer(conn, id, until, deadline, sink),
            Err(e) => match self.read_answer(conn, id, until, deadline, sink) {
                Ok(frame) if frame.request_id == 0 && frame.op == Op::Error => Ok(frame),
                _ => Err(ExchangeFailure::Io(e)),
            },
        }
    }

    /// Reads the frame that answers request `id`, until `until`. Bytes read past that frame
    /// (the start of the next answer of a pipelined batch) stay in `conn.pending` for the next
    /// call.
    fn read_answer(
        &self,
        conn: &mut Conn,
        id: u64,
        until: Instant,
        deadline: Duration,
        mut sink: Option<&mut Sink<'_>>,
    ) -> Result<Frame, ExchangeFailure> {
        loop {
            if conn.pending.is_empty() {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ExchangeFailure::Deadline(deadline));
                }
                conn.stream.set_read_timeout(Some(left)).map_err(ExchangeFailure::Io)?;
                // A one-hit answer's payload goes straight into the caller's buffer.
                let to_sink = sink.as_deref_mut().and_then(|s| s.next(&conn.decoder));
                let direct = conn.decoder.body_window().is_some();
                let read = match (sink.as_deref_mut(), to_sink.clone()) {
                    (Some(sink), Some(range)) => conn.stream.read(&mut sink.dst[range]),
                    _ => match conn.decoder.body_window() {
                        Some(window) => conn.stream.read(window),
                        None => conn.stream.read(&mut conn.buf),
                    },
                };
                let n = match read {
                    Ok(0) => return Err(ExchangeFailure::Closed),
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        return Err(ExchangeFailure::Deadline(deadline));
                    }
                    Err(e) => return Err(ExchangeFailure::Io(e)),
                };
                if let (Some(sink), Some(_)) = (sink.as_deref_mut(), &to_sink) {
                    sink.took(n);
                    conn.decoder.skip_body(n);
                } else if direct {
                    conn.decoder.commit_body(n);
                } else {
                    conn.pending = 0..n;
                }
            }
            let mut input = conn.buf.get(conn.pending.clone()).unwrap_or_default();
            let before = input.len();
            let fed = conn.decoder.feed(&mut input);
            conn.pending.start += before - input.len();
            match fed {
                Ok(None) => continue,
                Err(e) => return Err(ExchangeFailure::Frame(e.error)),
                Ok(Some(frame)) => {
                    let turned_away = frame.request_id == 0 && frame.op == Op::Error;
                    if frame.request_id != id && !turned_away {
                        let what = Response::from_frame(&frame)
                            .map_or_else(|e| e.to_string(), |r| format!("{:?}", r.op()));
                        return Err(ExchangeFailure::OtherAnswer {
                            found: frame.request_id,
                            what,
                            expected: id,
                        });
                    }
                    return Ok(frame);
                }
            }
        }
    }

    /// A pooled connection as `caller`, or a new one; says which.
    fn take_conn(
        &self,
        caller: &Caller,
        operation: &'static str,
    ) -> Result<(Conn, bool), StoreError> {
        let pooled = self
            .pools
            .lock()
            .ok()
            .and_then(|mut p| p.get_mut(&pool_key(caller)).and_then(Vec::pop));
        match pooled {
            Some(mut c) => {
                self.declare(&mut c, operation)?;
                Ok((c, true))
            }
            None => Ok((self.connect(caller, operation)?, false)),
        }
    }

    /// One request as `caller`, answered by `decode`: a pooled connection, or a new one. A
    /// request that only reads (or whose repetition is harmless) is retried once on a fresh
    /// connection when a pooled one turns out dead; writes are never retried here (their
    /// request ids make a caller's own retry safe).
    fn call_with<T>(
        &self,
        caller: &Caller,
        request: &Request,
        operation: &'static str,
        decode: impl FnOnce(&Frame) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let (mut conn, was_pooled) = self.take_conn(caller, operation)?;
        let frame = match self.exchange_with(&mut conn, request, operation, None) {
            Ok(f) => f,
            Err(e) if was_pooled && retryable(request) => {
                conn = self.connect(caller, operation)?;
                self.exchange_with(&mut conn, request, operation, None).map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        let answer = decode(&frame);
        conn.decoder.recycle(frame.body);
        self.keep(pool_key(caller), conn);
        answer
    }

    /// Returns an idle connection to its pool (unless the pool is full).
    fn keep(&self, key: PoolKey, conn: Conn) {
        if conn.decoder.is_idle()
            && conn.pending.is_empty()
            && let Ok(mut pools) = self.pools.lock()
        {
            let pool = pools.entry(key).or_default();
            if pool.len() < POOL_CONNECTIONS_MAX {
                pool.push(conn);
            }
        }
    }

    fn call(
        &self,
        caller: &Caller,
        request: Request,
        operation: &'static str,
    ) -> Result<Response, StoreError> {
        self.call_with(caller, &request, operation, |frame| {
            Response::from_frame(frame).map_err(|e| transport(operation, e))
        })
    }

    fn control(&self, request: Request, operation: &'static str) -> Result<Response, StoreError> {
        let control = self.config.control.clone();
        self.call(&control, request, operation)
    }

    /// The server's limits (LIMITS, as the control identity). A server that predates the op
    /// answers `UnknownOp`: it states none.
    pub fn limits(&self) -> Result<ServerLimits, StoreError> {
        match self.control(Request::Limits, "limits")? {
            Response::Limits(l) => Ok(l),
            Response::Error(WireError::UnknownOp { .. }) => Ok(ServerLimits::default()),
            other => Err(unexpected("limits", &other)),
        }
    }

    fn remote_info(&self) -> Option<&RemoteInfo> {
        if let Some(i) = self.info.get() {
            return Some(i);
        }
        match self.control(Request::Info, "info") {
            Ok(Response::Info(i)) => Some(self.info.get_or_init(|| i)),
            _ => None,
        }
    }
}

/// Most request frames of one batch exchange that are sent and not yet answered. The server
/// answers a connection's requests one at a time, in order, and reads the next request only
/// after it has written the answer before it; more frames in flight would only wait in the
/// socket buffers. A few keep the server busy while an answer travels back, and the bound keeps
/// a huge batch from running far ahead of its answers.
pub const FRAMES_IN_FLIGHT_MAX: usize = 4;

/// How a batch exchange stopped before every frame was answered.
#[derive(Debug)]
struct Interrupted {
    /// Frames answered, in order, before it stopped: their items have their answers.
    answered: usize,
    /// Frames written whole to the socket. The server may have served any of these; a frame
    /// that never left whole cannot be decoded, so the server never served one past these.
    sent: usize,
    /// Why the answers stopped: the failure of every frame from `answered` on.
    error: StoreError,
    /// Why frames from `sent` on were never sent, when the cause is the request itself (a
    /// frame that could not be encoded) rather than the connection.
    unsent: Option<StoreError>,
    /// Whether the connection turned out dead (closed, reset, turned away) before any
    /// answer: a pooled connection that died while idle.
    dead: bool,
}

impl Interrupted {
    fn before_sending(error: StoreError) -> Box<Self> {
        Box::new(Self { answered: 0, sent: 0, error, unsent: None, dead: false })
    }

    /// Whether the server may have served frame `f` without its answer arriving.
    fn maybe_served(&self, f: usize) -> bool {
        f >= self.answered && f < self.sent
    }

    /// The failure of frame `f`, which was not answered.
    fn error_of(&self, f: usize) -> StoreError {
        match &self.unsent {
            Some(e) if f >= self.sent => e.clone(),
            _ => self.error.clone(),
        }
    }
}

/// The items of a batch as its frames carry them: frame `f` carries items `frames[f]`.
type FrameItems = Vec<Range<usize>>;

/// Every item's answer, in order: what its frame's answer said, or, for the items of frames
/// that were not answered, the exchange's failure; `failed` adjusts that failure per item,
/// given whether the server may have served its frame.
fn every_answer<T>(
    mut answers: Vec<Option<Result<T, StoreError>>>,
    frames: &[Range<usize>],
    outcome: &Result<(), Box<Interrupted>>,
    operation: &'static str,
    mut failed: impl FnMut(usize, bool, StoreError) -> StoreError,
) -> BatchAnswers<T> {
    for (f, items) in frames.iter().enumerate() {
        for i in items.clone() {
            let Some(slot) = answers.get_mut(i) else { continue };
            if slot.is_some() {
                continue;
            }
            *slot = Some(Err(match outcome {
                Err(stop) => failed(i, stop.maybe_served(f), stop.error_of(f)),
                Ok(()) => transport(operation, "the answer left this item out"),
            }));
        }
    }
    answers
        .into_iter()
        .map(|a| a.unwrap_or_else(|| Err(transport(operation, "no frame carried this item"))))
        .collect()
}

/// The same failure for each of `n` items.
fn every_item<T>(n: usize, e: &StoreError) -> BatchAnswers<T> {
    (0..n).map(|_| Err(e.clone())).collect()
}

/// Stores one frame's answers (or its one failure) in the item slots of its range.
fn fill<T>(
    slots: &mut [Option<Result<T, StoreError>>],
    got: Result<BatchAnswers<T>, StoreError>,
    operation: &'static str,
) {
    match got {
        Ok(answers) if answers.len() == slots.len() => {
            for (slot, a) in slots.iter_mut().zip(answers) {
                *slot = Some(a);
            }
        }
        Ok(_) => {
            let e = transport(operation, "answers do not match the batch");
            fill(slots, Err(e), operation);
        }
        Err(e) => {
            for slot in slots {
                *slot = Some(Err(e.clone()));
            }
        }
    }
}

/// One GET or PUT frame of a batch: its items, and where their bytes are in the shared segment
/// when the frame goes through it (GET_SHARED, PUT_SHARED) rather than carrying them.
#[derive(Debug)]
struct PlannedFrame {
    items: Range<usize>,
    offsets: Option<Vec<u64>>,
}

/// Batch exchanges: a batch is split into frames by the protocol's limits, and its frames go out
/// on one connection one after another, without waiting for the answers before them
/// (pipelined); the server answers them in order.
///
/// Deadlock: the server reads one request, serves it, writes its whole answer, and only then
/// reads the next request. A client that wrote frames without reading answers could block
/// writing a request (the server is not reading) while the server blocks writing an answer (the
/// client is not reading): a GET answer of up to 64 MiB fills the socket buffers at once. So a
/// batch of more than one frame is sent by a second thread while this one reads the answers as
/// they come, landing each in the caller's buffers. The reader never waits for the writer, so
/// every answer the server writes is drained and the server always gets back to reading. The
/// writer keeps at most [`FRAMES_IN_FLIGHT_MAX`] frames unanswered, so how far the requests run
/// ahead stays bounded however large the batch, and each side holds one frame in memory at a
/// time. A batch of one frame is written and then read on this thread: the server reads a
/// whole request before it answers, so that cannot deadlock.
impl TcpStore {
    /// Sends `frames` request frames on one connection as `caller` (`encode` writes frame `f`
    /// with a request id and the session's seal) and hands each answer, in order, to `answer`
    /// (which lands it and records per-item failures itself). A request that only reads is sent
    /// again on a fresh connection when a pooled one turns out dead before any answer.
    fn batch_exchange<E, A>(
        &self,
        caller: &Caller,
        operation: &'static str,
        frames: usize,
        retryable: bool,
        encode: &E,
        mut answer: A,
    ) -> Result<(), Box<Interrupted>>
    where
        E: Fn(usize, u64, Option<&SealKey>, &mut Vec<u8>) -> Result<(), WireError> + Sync,
        A: FnMut(usize, &Frame),
    {
        if frames == 0 {
            return Ok(());
        }
        let (mut conn, was_pooled) =
            self.take_conn(caller, operation).map_err(Interrupted::before_sending)?;
        let mut outcome = self.pipeline(&mut conn, operation, frames, encode, &mut answer);
        if let Err(stop) = &outcome
            && was_pooled
            && retryable
            && stop.dead
            && stop.answered == 0
        {
            let sent = stop.sent;
            conn = match self.connect(caller, operation) {
                Ok(c) => c,
                Err(e) => {
                    return Err(Box::new(Interrupted { sent, ..*Interrupted::before_sending(e) }));
                }
            };
            outcome = self.pipeline(&mut conn, operation, frames, encode, &mut answer);
        }
        if outcome.is_ok() {
            self.keep(pool_key(caller), conn);
        }
        outcome
    }

    /// One batch exchange on `conn` (see the `impl` comment above for why more than one frame
    /// is written by another thread).
    fn pipeline<E, A>(
        &self,
        conn: &mut Conn,
        operation: &'static str,
        frames: usize,
        encode: &E,
        answer: &mut A,
    ) -> Result<(), Box<Interrupted>>
    where
        E: Fn(usize, u64, Option<&SealKey>, &mut Vec<u8>) -> Result<(), WireError> + Sync,
        A: FnMut(usize, &Frame),
    {
        let deadline = self.config.deadline;
        let first = self.next_id.fetch_add(frames as u64, Ordering::Relaxed);
        let seal = conn.seal.clone();
        let seal = seal.as_ref();
        let stop = |answered, sent, (error, dead)| {
            Box::new(Interrupted {
                answered,
                sent,
                error,
                unsent: None,
                dead: dead && answered == 0,
            })
        };
        let failed = |f: ExchangeFailure| {
            let dead = f.is_dead();
            (f.into_store_error(operation), dead)
        };
        if frames == 1 {
            conn.out.clear();
            encode(0, first, seal, &mut conn.out)
                .map_err(|e| Interrupted::before_sending(not_encodable(operation, e)))?;
            let until = Instant::now() + deadline;
            let written = self.send_out(conn, None, deadline);
            let sent = usize::from(written.is_ok());
            let frame = self
                .answer_after_send(conn, written, first, until, deadline, None)
                .map_err(|f| stop(0, sent, failed(f)))
                .and_then(|frame| checked(frame, seal, operation).map_err(|e| stop(0, sent, e)))?;
            answer(0, &frame);
            conn.decoder.recycle(frame.body);
            return Ok(());
        }

        let mut writer_stream = conn
            .stream
            .try_clone()
            .and_then(|s| s.set_write_timeout(Some(deadline)).map(|()| s))
            .map_err(|e| Interrupted::before_sending(transport(operation, e)))?;
        let mut out = std::mem::take(&mut conn.out);
        // One credit per answer read: the writer sends frame `f` past the first
        // FRAMES_IN_FLIGHT_MAX only once answer `f - FRAMES_IN_FLIGHT_MAX` was read, so at
        // most that many credits are ever unspent and the channel never fills.
        let (credits, credit) = mpsc::sync_channel::<()>(FRAMES_IN_FLIGHT_MAX);
        // The writer waits for the one answer that frees its next frame; the reader waits for
        // that answer at most `deadline`, and ends the exchange (dropping `credits`) when it
        // does not come. This bound is never what ends a sound exchange.
        let credit_wait = deadline.saturating_mul(2);
        let (answered, failure, sent, unsent) = std::thread::scope(|scope| {
            let out = &mut out;
            let writer = scope.spawn(move || {
                for f in 0..frames {
                    if f >= FRAMES_IN_FLIGHT_MAX && credit.recv_timeout(credit_wait).is_err() {
                        // The reader stopped: the answers ended or never came.
                        return (f, None);
                    }
                    out.clear();
                    let id = first + f as u64;
                    let failure = match encode(f, id, seal, out) {
                        Err(e) => ExchangeFailure::Encode(e),
                        Ok(()) => match writer_stream.write_all(out) {
                            Ok(()) => continue,
                            Err(e) => ExchangeFailure::Io(e),
                        },
                    };
                    // The server answers the whole frames it has and then sees the end of
                    // the stream, so the reader gets those answers and then the close.
                    let _ = writer_stream.shutdown(Shutdown::Write);
                    return (f, Some(failure));
                }
                (frames, None)
            });
            let mut answered = 0;
            let mut failure = None;
            while answered < frames {
                let id = first + answered as u64;
                let until = Instant::now() + deadline;
                let frame = self
                    .read_answer(conn, id, until, deadline, None)
                    .map_err(failed)
                    .and_then(|frame| checked(frame, seal, operation));
                match frame {
                    Ok(frame) => {
                        answer(answered, &frame);
                        conn.decoder.recycle(frame.body);
                        answered += 1;
                        let _ = credits.try_send(());
                    }
                    Err(e) => {
                        // A writer blocked on a socket nobody will read fails at once.
                        let _ = conn.stream.shutdown(Shutdown::Both);
                        failure = Some(e);
                        break;
                    }
                }
            }
            drop(credits);
            // A writer that panicked may have sent any of the frames.
            let (sent, unsent) = writer.join().unwrap_or_else(|_| {
                let panicked = io::Error::other("the sending thread panicked");
                (frames, Some(ExchangeFailure::Io(panicked)))
            });
            (answered, failure, sent, unsent)
        });
        if out.capacity() <= OUT_BUFFER_KEEP_BYTES {
            conn.out = out;
        }
        match failure {
            None => Ok(()),
            Some(e) => {
                let unsent = unsent.and_then(|f| match f {
                    ExchangeFailure::Encode(e) => Some(not_encodable(operation, e)),
                    _ => None,
                });
                Err(Box::new(Interrupted { unsent, ..*stop(answered, sent, e) }))
            }
        }
    }

    /// LOOKUP or INVALIDATE for `keys`: frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on
    /// one connection; `request` builds a frame's request, `take` its answers. A batch that needs
    /// only the read right (LOOKUP) only reads, so it may be sent again on a fresh connection.
    fn keyed_batch<T>(
        &self,
        caller: &Caller,
        keys: &[&PhysicalKey],
        right: Right,
        operation: &'static str,
        request: fn(Vec<PhysicalKey>) -> Request,
        take: fn(Response) -> Result<BatchAnswers<T>, Box<Response>>,
    ) -> BatchAnswers<T> {
        if let Err(e) = check_right(caller, right) {
            return every_item(keys.len(), &e);
        }
        let frames: FrameItems = (0..keys.len())
            .step_by(BATCH_ITEMS_MAX)
            .map(|start| start..(start + BATCH_ITEMS_MAX).min(keys.len()))
            .collect();
        let encode = |f: usize, id: u64, seal: Option<&SealKey>, out: &mut Vec<u8>| {
            let chunk = keys.get(frames[f].clone()).unwrap_or_default();
            request(chunk.iter().map(|k| (*k).clone()).collect()).encode_sealed_frame(id, seal, out)
        };
        let mut answers: Vec<Option<Result<T, StoreError>>> =
            (0..keys.len()).map(|_| None).collect();
        let retryable = right == Right::Read;
        let outcome =
            self.batch_exchange(caller, operation, frames.len(), retryable, &encode, |f, frame| {
                let got = match Response::from_frame(frame) {
                    Ok(response) => take(response).map_err(|other| unexpected(operation, &other)),
                    Err(e) => Err(transport(operation, e)),
                };
                fill(&mut answers[frames[f].clone()], got, operation);
            });
        every_answer(answers, &frames, &outcome, operation, |_, _, e| e)
    }

    /// How a GET or PUT batch of items of `sizes` bytes travels: over TCP, frames within the
    /// payload limit; on the same-host path, shared frames of at most [`BATCH_ITEMS_MAX`]
    /// items, each placed in the segment by `place` (the caller's shared buffer, or a bounce
    /// buffer), except that a group whose bounce buffers do not fit is sent as ordinary frames.
    /// Returns the frames and, for each shared one, its items' places.
    fn plan_frames(
        &self,
        arena: Option<&SharedArena>,
        sizes: &[u64],
        mut place: impl FnMut(&SharedArena, usize) -> Option<Place>,
    ) -> (Vec<PlannedFrame>, Vec<Option<Vec<Place>>>) {
        let (mut frames, mut places) = (Vec::new(), Vec::new());
        let framed = |frames: &mut Vec<PlannedFrame>, places: &mut Vec<_>, at, sizes| {
            for (start, end) in frame_ranges(sizes) {
                frames.push(PlannedFrame { items: at + start..at + end, offsets: None });
                places.push(None);
            }
        };
        let Some(arena) = arena else {
            framed(&mut frames, &mut places, 0, sizes);
            return (frames, places);
        };
        for start in (0..sizes.len()).step_by(BATCH_ITEMS_MAX) {
            let end = (start + BATCH_ITEMS_MAX).min(sizes.len());
            // Stops at the first item that does not fit, freeing the bounce buffers taken.
            let group: Option<Vec<Place>> = (start..end).map(|i| place(arena, i)).collect();
            match group {
                Some(group) => {
                    self.shared.count(&group);
                    let offsets = group.iter().map(Place::offset).collect();
                    frames.push(PlannedFrame { items: start..end, offsets: Some(offsets) });
                    places.push(Some(group));
                }
                None => {
                    self.shared.framed_batches.fetch_add(1, Ordering::Relaxed);
                    framed(&mut frames, &mut places, start, &sizes[start..end]);
                }
            }
        }
        (frames, places)
    }
}

/// Lands one GET frame's answer in its items' buffers.
fn land_framed(
    frame: &Frame,
    dsts: &mut [&mut [u8]],
) -> Result<Vec<Result<Get, StoreError>>, StoreError> {
    if frame.op != Op::Get {
        let answer = Response::from_frame(frame).map_err(|e| transport("get", e))?;
        return Err(unexpected("get", &answer));
    }
    let answers = decode_get_response(&frame.body).map_err(|e| transport("get", e))?;
    if answers.len() != dsts.len() {
        return Err(transport("get", "answers do not match the batch"));
    }
    // The block lands in the caller's buffer straight from the frame body.
    Ok(dsts.iter_mut().zip(answers).map(|(dst, answer)| answer.map(|f| land(f, dst))).collect())
}

/// Lands one GET_SHARED frame's answer: each hit is in the segment at its item's place.
fn land_shared_frame(
    frame: &Frame,
    places: &[Place],
    dsts: &mut [&mut [u8]],
) -> Result<Vec<Result<Get, StoreError>>, StoreError> {
    match Response::from_frame(frame) {
        Ok(Response::GetShared(answers)) if answers.len() == dsts.len() => Ok(dsts
            .iter_mut()
            .zip(places)
            .zip(answers)
            .map(|((dst, place), answer)| answer.map(|g| land_shared(g, place, dst)))
            .collect()),
        // Refused at the protocol level: the server wrote nothing.
        Ok(other) => Err(unexpected("get", &other)),
        Err(e) => Err(transport("get", e)),
    }
}

/// Where one item's bytes sit in the shared segment.
enum Place {
    /// The caller's own buffer, a [`SharedBuf`], at this offset.
    Caller(u64),
    /// A bounce buffer taken for a buffer outside the segment.
    Bounce(SharedBuf),
}

impl Place {
    fn of(arena: &SharedArena, bytes: &[u8]) -> Option<Self> {
        match arena.segment().offset_of(bytes) {
            Some(offset) => Some(Self::Caller(offset)),
            None => arena.alloc(bytes.len()).map(Self::Bounce),
        }
    }

    fn offset(&self) -> u64 {
        match self {
            Self::Caller(offset) => *offset,
            Self::Bounce(b) => b.offset(),
        }
    }

    fn quarantine(self) {
        if let Self::Bounce(b) = self {
            b.quarantine();
        }
    }
}

/// Lands a block the server wrote into the segment: from a bounce buffer it is copied into the
/// caller's buffer. It is not hashed again here: the store's `get_into` verified the bytes in
/// the segment itself (a hit means written and verified), and nothing but this process and the
/// server can write the segment; a length the server could not have delivered is a miss.
fn land_shared(got: Get, place: &Place, dst: &mut [u8]) -> Get {
    match got {
        Get::Hit { len, checksum } => {
            let n = match usize::try_from(len) {
                Ok(n) if n <= dst.len() => n,
                _ => {
                    dst.fill(0);
                    return Get::Miss(MissReason::Corrupt);
                }
            };
            if let Place::Bounce(b) = place {
                dst[..n].copy_from_slice(&b[..n]);
            }
            Get::Hit { len, checksum }
        }
        Get::Miss(MissReason::Corrupt) => {
            dst.fill(0);
            Get::Miss(MissReason::Corrupt)
        }
        miss => miss,
    }
}

/// The same failure, without the promise that the caller's buffers are no longer touched.
fn unknown_retirement(e: StoreError) -> StoreError {
    match e {
        StoreError::Backend { operation, detail, .. } => {
            StoreError::Backend { operation, detail, retirement: Retirement::Unknown }
        }
        StoreError::Io { operation, kind, detail, .. } => {
            StoreError::Io { operation, kind, detail, retirement: Retirement::Unknown }
        }
        other => other,
    }
}

/// Payload bytes after which a batch's frame closes and the next one starts (a single larger
/// item still goes alone, up to [`gpucache_wire::PAYLOAD_BYTES_MAX`]). The server serves a connection's frames
/// one after another, so frames of this size let it read the next frame's blocks while the
/// previous answer is still on the wire and being landed; one frame of the whole batch would
/// read every block before sending any. 2 MiB measured best on loopback (docs/PERFORMANCE.md).
pub const FRAME_PAYLOAD_TARGET: u64 = 2 << 20;

/// Splits items of the given payload sizes into consecutive `[start, end)` ranges that each fit
/// one frame: at most [`BATCH_ITEMS_MAX`] items and [`FRAME_PAYLOAD_TARGET`] payload bytes (a
/// single item is always sent on its own, and the server judges its size).
fn frame_ranges(sizes: &[u64]) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let mut end = start;
        let mut bytes = 0u64;
        while end < sizes.len() && end - start < BATCH_ITEMS_MAX {
            if end > start && bytes + sizes[end] > FRAME_PAYLOAD_TARGET {
                break;
            }
            bytes += sizes[end];
            end += 1;
        }
        ranges.push((start, end));
        start = end;
    }
    ranges
}

/// Lands a fetched block in the caller's buffer after checking its checksum.
fn land(fetched: FetchedRef<'_>, dst: &mut [u8]) -> Get {
    match fetched {
        FetchedRef::Hit { checksum, data } => {
            // Checked in the caller's buffer, in the pass that copies it there; what does not
            // verify is zeroed, as the store zeroes a corrupt read.
            match Checksum::copy_of(dst, data) {
                Some(sum) if sum == checksum => Get::Hit { len: data.len() as u64, checksum },
                Some(_) => {
                    dst[..data.len()].fill(0);
                    Get::Miss(MissReason::Corrupt)
                }
                None => Get::Miss(MissReason::Corrupt),
            }
        }
        FetchedRef::Miss(MissReason::Corrupt) => {
            // The store zeroes a corrupt read's destination; so does its remote form.
            dst.fill(0);
            Get::Miss(MissReason::Corrupt)
        }
        FetchedRef::Miss(reason) => Get::Miss(reason),
    }
}

/// The caller's buffer for the payload of a one-hit GET answer
/// ([`gpucache_wire::FLAG_SOLE_HIT`]): when the
/// payload fits, it is read into the buffer straight from the socket (the part that arrived
/// with the header is copied from the decoder), instead of into the decoder and copied out
/// after; the decoder still takes the header and the trailer.
struct Sink<'a> {
    dst: &'a mut [u8],
    /// Payload bytes in `dst`, once the answer started coming this way.
    at: Option<usize>,
    payload: usize,
    /// The checksum of the bytes in `dst` so far: each piece is hashed as soon as it has
    /// landed, while it is in the cache and while the rest is still on its way.
    hashed: ChecksumBuilder,
}

impl<'a> Sink<'a> {
    fn new(dst: &'a mut [u8]) -> Self {
        Self { dst, at: None, payload: 0, hashed: ChecksumBuilder::default() }
    }

    /// Where in `dst` the next read goes, while the frame `decoder` is taking is a one-hit
    /// answer that fits and whose payload has not all arrived.
    fn next(&mut self, decoder: &FrameDecoder) -> Option<Range<usize>> {
        let (payload, so_far) = decoder.sole_hit_payload()?;
        if payload > self.dst.len() {
            return None;
        }
        let at = match self.at {
            Some(at) => at,
            None => {
                let first = self.dst.get_mut(..so_far.len())?;
                first.copy_from_slice(so_far);
                self.hashed.update(first);
                self.payload = payload;
                so_far.len()
            }
        };
        self.at = Some(at);
        (at < payload).then_some(at..payload)
    }

    fn took(&mut self, n: usize) {
        if let Some(at) = self.at {
            self.hashed.update(self.dst.get(at..at + n).unwrap_or_default());
            self.at = Some(at + n);
        }
    }

    /// The payload's length and the checksum of what landed, when all of it is in `dst`.
    fn landed(&self) -> Option<(usize, Checksum)> {
        self.at.filter(|&at| at == self.payload).map(|at| (at, self.hashed.finish()))
    }

    /// Zeroes what an answer that failed wrote into `dst`.
    fn undo(&mut self) {
        if let Some(at) = self.at.take() {
            self.dst[..at].fill(0);
        }
    }
}

/// Requests whose repetition cannot change what the store holds.
fn retryable(request: &Request) -> bool {
    matches!(
        request,
        Request::Info
            | Request::Epoch
            | Request::Stats
            | Request::Lookup { .. }
            | Request::Locate { .. }
            | Request::Get { .. }
            | Request::GetShared { .. }
            | Request::NixlAttach { .. }
            | Request::StageStats
            | Request::Limits
            | Request::Cluster { .. }
            | Request::FillWait { .. }
    )
}

fn single<T>(
    mut items: Vec<Result<T, StoreError>>,
    operation: &'static str,
) -> Result<T, StoreError> {
    if items.len() != 1 {
        return Err(transport(operation, format!("{} answers for one item", items.len())));
    }
    items.pop().unwrap_or_else(|| Err(transport(operation, "no answer")))
}

impl Store for TcpStore {
    fn info(&self) -> StoreInfo {
        let remote = self.remote_info();
        StoreInfo {
            name: "tcp",
            implementation: remote.map_or(Implementation::Real, |i| i.implementation),
            // Over TCP the remote never holds the caller's memory: every failure is retired.
            // On the shared segment a failed GET may still be written by the server.
            failures_retire: self.config.local.is_none(),
            full_policy: remote.map_or(FullPolicy::Refuse, |i| i.full_policy),
        }
    }

    fn epoch(&self) -> Epoch {
        match self.control(Request::Epoch, "epoch") {
            Ok(Response::Epoch(e)) => e,
            _ => Epoch(0),
        }
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        single(self.lookup_batch(caller, &[key]), "lookup")
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        single(self.get_batch(caller, &mut [BatchGet { key, dst }]), "get")
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        check_right(caller, Right::Write)?;
        match self.call(
            caller,
            Request::Reserve { key: Box::new(key.clone()), len, request },
            "reserve",
        )? {
            Response::Reserve(r) => r,
            other => Err(unexpected("reserve", &other)),
        }
    }

    fn write(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        check_right(caller, Right::Write)?;
        let request = Request::Write {
            reservation: copy_reservation(reservation),
            offset,
            data: src.to_vec(),
        };
        match self.call(caller, request, "write")? {
            Response::Write(r) => r,
            other => Err(unexpected("write", &other)),
        }
    }

    fn commit(&self, caller: &Caller, reservation: &Reservation) -> Result<Committed, StoreError> {
        check_right(caller, Right::Write)?;
        match self.call(
            caller,
            Request::Commit { reservation: copy_reservation(reservation) },
            "commit",
        )? {
            Response::Commit(r) => r,
            other => Err(unexpected("commit", &other)),
        }
    }

    fn abort(
        &self,
        caller: &Caller,
        reservation: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        check_right(caller, Right::Write)?;
        match self.call(caller, Request::Abort { reservation, outcome }, "abort")? {
            Response::Abort(r) => r,
            other => Err(unexpected("abort", &other)),
        }
    }

    fn put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<RequestId>,
    ) -> Result<Put, StoreError> {
        single(self.put_batch(caller, &[BatchPut { key, src, request }]), "put")
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        single(self.invalidate_batch(caller, &[key]), "invalidate")
    }

    /// LOOKUP frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on one connection.
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        self.keyed_batch(
            caller,
            keys,
            Right::Read,
            "lookup",
            |keys| Request::Lookup { keys },
            |response| match response {
                Response::Lookup(items) => Ok(items),
                other => Err(Box::new(other)),
            },
        )
    }

    /// LOCATE frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on one connection.
    fn locate(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Located> {
        self.keyed_batch(
            caller,
            keys,
            Right::Read,
            "locate",
            |keys| Request::Locate { keys },
            |response| match response {
                Response::Locate(items) => Ok(items),
                other => Err(Box::new(other)),
            },
        )
    }

    /// GET (or, on the same-host path, GET_SHARED) frames within the protocol's limits,
    /// pipelined on one connection. An item whose frame was not answered fails with the
    /// exchange's failure: retired over TCP (its buffer is written only here, after its answer
    /// verified), and on the same-host path not retired when its frame may have been served
    /// straight into the caller's shared buffer (a bounce buffer in that state is quarantined,
    /// and the caller's own buffer is untouched).
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        if let Err(e) = check_right(caller, Right::Read) {
            return every_item(items.len(), &e);
        }
        let arena = match self.arena("get") {
            Ok(a) => a,
            Err(e) => return every_item(items.len(), &e),
        };
        if let ([item], None) = (&mut *items, arena) {
            return vec![self.get_one(caller, item.key, item.dst)];
        }
        let keys: Vec<&PhysicalKey> = items.iter().map(|i| i.key).collect();
        let capacities: Vec<u64> = items.iter().map(|i| i.dst.len() as u64).collect();
        let (frames, places) =
            self.plan_frames(arena, &capacities, |arena, i| Place::of(arena, items[i].dst));
        let encode = |f: usize, id: u64, seal: Option<&SealKey>, out: &mut Vec<u8>| {
            let frame = &frames[f];
            let request = match &frame.offsets {
                None => Request::Get {
                    items: frame
                        .items
                        .clone()
                        .map(|i| GetItem { key: keys[i].clone(), capacity: capacities[i] })
                        .collect(),
                },
                Some(offsets) => Request::GetShared {
                    items: frame
                        .items
                        .clone()
                        .zip(offsets)
                        .map(|(i, &offset)| SharedGetItem {
                            key: keys[i].clone(),
                            offset,
                            capacity: capacities[i],
                        })
                        .collect(),
                },
            };
            request.encode_sealed_frame(id, seal, out)
        };
        let mut dsts: Vec<&mut [u8]> = items.iter_mut().map(|i| &mut *i.dst).collect();
        let mut answers: Vec<Option<Result<Get, StoreError>>> =
            (0..dsts.len()).map(|_| None).collect();
        let outcome =
            self.batch_exchange(caller, "get", frames.len(), true, &encode, |f, frame| {
                let range = frames[f].items.clone();
                let got = match &places[f] {
                    None => land_framed(frame, &mut dsts[range.clone()]),
                    Some(places) => land_shared_frame(frame, places, &mut dsts[range.clone()]),
                };
                fill(&mut answers[range], got, "get");
            });
        // The caller's own shared buffers, which the server writes directly.
        let mut direct = vec![false; dsts.len()];
        for (frame, group) in frames.iter().zip(&places) {
            for (i, place) in frame.items.clone().zip(group.iter().flatten()) {
                direct[i] = matches!(place, Place::Caller(_));
            }
        }
        if let Err(stop) = &outcome {
            // The server may still be writing the ranges of a frame it was sent; the bounce
            // buffers of frames it never got go back to the segment (as do all the others).
            for (f, group) in places.into_iter().enumerate() {
                if stop.maybe_served(f) {
                    group.into_iter().flatten().for_each(Place::quarantine);
                }
            }
        }
        let item_frames: FrameItems = frames.iter().map(|f| f.items.clone()).collect();
        every_answer(answers, &item_frames, &outcome, "get", |i, maybe_served, e| {
            if maybe_served && direct[i] { unknown_retirement(e) } else { e }
        })
    }

    /// PUT (or, on the same-host path, PUT_SHARED) frames within the protocol's limits,
    /// pipelined on one connection; the bytes go into a frame straight from the caller's
    /// slices, hashed in the pass that copies them there. The server only reads what it is
    /// given, so every failure is retired (a bounce buffer whose frame may have been served is
    /// still kept out of reuse).
    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        self.put_items(caller, items, None)
    }

    /// As [`Self::put_batch`], with the caller's checksums sent as they are (the bytes are not
    /// hashed here); the server's store refuses an item whose bytes do not match its checksum.
    fn put_batch_checked(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: &[Checksum],
    ) -> BatchAnswers<Put> {
        if expected.len() < items.len() {
            return put_batch_verified(items, expected, |sound| self.put_batch(caller, sound));
        }
        self.put_items(caller, items, Some(expected))
    }

    /// INVALIDATE frames of at most [`BATCH_ITEMS_MAX`] keys, pipelined on one connection.
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        self.keyed_batch(
            caller,
            keys,
            Right::Write,
            "invalidate",
            |keys| Request::Invalidate { keys },
            |response| match response {
                Response::Invalidate(items) => Ok(items),
                other => Err(Box::new(other)),
            },
        )
    }

    fn expire_leases(&self) -> Result<usize, StoreError> {
        match self.control(Request::ExpireLeases, "expire_leases")? {
            Response::ExpireLeases(r) => r.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            other => Err(unexpected("expire_leases", &other)),
        }
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        match self.call(caller, Request::Attest { region }, "attest")? {
            Response::Attest(r) => r,
            other => Err(unexpected("attest", &other)),
        }
    }

    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        match self.control(Request::BumpEpoch, "bump_epoch")? {
            Response::BumpEpoch(r) => r,
            other => Err(unexpected("bump_epoch", &other)),
        }
    }

    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        match self.control(Request::ReclaimFenced { epoch }, "reclaim_fenced")? {
            Response::ReclaimFenced(r) => r.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            other => Err(unexpected("reclaim_fenced", &other)),
        }
    }

    fn stats(&self) -> StoreStats {
        match self.control(Request::Stats, "stats") {
            Ok(Response::Stats(s)) => s,
            _ => StoreStats::default(),
        }
    }
}

/// The stage ops (block staging for one-sided transfers, ADR 0018). The transfers themselves
/// are the caller's (`gpucache-nic`'s NIXL client): these only open, settle and count stages.
impl TcpStore {
    fn stage_call(
        &self,
        caller: &Caller,
        request: Request,
        operation: &'static str,
    ) -> Result<Response, StageCallError> {
        match self.call(caller, request, operation)? {
            Response::Error(WireError::Staging { reason, detail }) => {
                Err(StageCallError::Refused { reason, detail })
            }
            other => Ok(other),
        }
    }

    /// NIXL_ATTACH: hands the server this side's agent metadata, answers the server's.
    pub fn nixl_attach(&self, caller: &Caller, metadata: &[u8]) -> Result<Vec<u8>, StageCallError> {
        match self.stage_call(
            caller,
            Request::NixlAttach { metadata: metadata.to_vec() },
            "nixl_attach",
        )? {
            Response::NixlAttach(theirs) => Ok(theirs),
            other => Err(unexpected("nixl_attach", &other).into()),
        }
    }

    /// STAGE_GET: stages each item's block (at most [`BATCH_ITEMS_MAX`] items); `capacity` is
    /// the caller's destination size.
    pub fn stage_get(
        &self,
        caller: &Caller,
        items: &[GetItem],
    ) -> Result<Vec<Result<StagedGet, StoreError>>, StageCallError> {
        check_right(caller, Right::Read)?;
        let n = items.len();
        match self.stage_call(caller, Request::StageGet { items: items.to_vec() }, "stage_get")? {
            Response::StageGet(answers) if answers.len() == n => Ok(answers),
            other => Err(unexpected("stage_get", &other).into()),
        }
    }

    /// RESERVE_PUT: leases an empty slot for a block of `len` bytes hashing to `checksum`.
    pub fn reserve_put(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        checksum: Checksum,
        request: Option<RequestId>,
    ) -> Result<StagedSlot, StageCallError> {
        check_right(caller, Right::Write)?;
        let request = Request::ReservePut { key: Box::new(key.clone()), len, checksum, request };
        match self.stage_call(caller, request, "reserve_put")? {
            Response::ReservePut(r) => Ok(r?),
            other => Err(unexpected("reserve_put", &other).into()),
        }
    }

    /// COMMIT_PUT: the server checks and stores the stage's bytes, and returns its slot.
    pub fn commit_put(&self, caller: &Caller, stage: StageId) -> Result<Put, StageCallError> {
        check_right(caller, Right::Write)?;
        match self.stage_call(caller, Request::CommitPut { stage }, "commit_put")? {
            Response::CommitPut(r) => Ok(r?),
            other => Err(unexpected("commit_put", &other).into()),
        }
    }

    /// RELEASE: per stage, whether it was open.
    pub fn release_stages(
        &self,
        caller: &Caller,
        stages: &[StageId],
    ) -> Result<Vec<bool>, StageCallError> {
        match self.stage_call(caller, Request::Release { stages: stages.to_vec() }, "release")? {
            Response::Release(open) if open.len() == stages.len() => Ok(open),
            other => Err(unexpected("release", &other).into()),
        }
    }

    /// STAGE_STATS, as the control identity.
    pub fn stage_stats(&self) -> Result<StagingStats, StageCallError> {
        let control = self.config.control.clone();
        match self.stage_call(&control, Request::StageStats, "stage_stats")? {
            Response::StageStats(s) => Ok(s),
            other => Err(unexpected("stage_stats", &other).into()),
        }
    }
}

impl TcpStore {
    /// One GET over frames: the answer's payload lands straight in `dst` when the session is
    /// unsealed (a seal covers the payload, so it must be in the frame to be checked) and the
    /// answer is one hit. A pooled connection whose exchange fails is replaced once, as for any
    /// read.
    fn get_one(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let request =
            Request::Get { items: vec![GetItem { key: key.clone(), capacity: dst.len() as u64 }] };
        let (mut conn, was_pooled) = self.take_conn(caller, "get")?;
        let got = match self.get_on(&mut conn, &request, dst) {
            Err(_) if was_pooled => {
                conn = self.connect(caller, "get")?;
                self.get_on(&mut conn, &request, dst)?
            }
            other => other?,
        };
        self.keep(pool_key(caller), conn);
        got
    }

    /// [`Self::get_one`] on `conn`: the outer error is the exchange's (nothing of it is left
    /// in `dst`), the inner result the store's answer.
    fn get_on(
        &self,
        conn: &mut Conn,
        request: &Request,
        dst: &mut [u8],
    ) -> Result<Result<Get, StoreError>, StoreError> {
        let seal = conn.seal.clone();
        let deadline = self.config.deadline;
        let mut sink = Sink::new(dst);
        let into = if seal.is_none() { Some(&mut sink) } else { None };
        let frame = match self.exchange_within(conn, request, seal.as_ref(), None, deadline, into) {
            Ok(frame) => checked(frame, seal.as_ref(), "get").map_err(|(e, _)| e),
            Err(f) => Err(f.into_store_error("get")),
        };
        let frame = frame.inspect_err(|_| sink.undo())?;
        let got = match (sink.landed(), sole_hit(&frame.body)) {
            (Some((n, landed)), Some((checksum, len))) if n == len => {
                if landed == checksum {
                    Ok(Ok(Get::Hit { len: n as u64, checksum }))
                } else {
                    sink.dst[..n].fill(0);
                    Ok(Ok(Get::Miss(MissReason::Corrupt)))
                }
            }
            (Some(_), _) => {
                sink.undo();
                Err(transport("get", "a one-hit answer did not hold what its header said"))
            }
            (None, _) => land_framed(&frame, &mut [&mut *sink.dst]).map(|mut answers| {
                answers.pop().unwrap_or_else(|| Err(transport("get", "the answer is empty")))
            }),
        };
        conn.decoder.recycle(frame.body);
        got
    }

    /// One PUT over frames on an unsealed session, its bytes sent from the caller's buffer
    /// between the frame's header and trailer (one vectored write, no copy into a frame) and
    /// hashed in place unless the caller gave their checksum. None when the session is sealed
    /// (a seal covers the bytes, so they go through the frame): the caller sends it as a batch.
    /// Never sent twice: a write the server may have stored is not repeated here.
    fn put_one(
        &self,
        caller: &Caller,
        item: &BatchPut<'_>,
        expected: Option<Checksum>,
    ) -> Option<Result<Put, StoreError>> {
        let (mut conn, _) = match self.take_conn(caller, "put") {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        if conn.seal.is_some() {
            self.keep(pool_key(caller), conn);
            return None;
        }
        let sum = expected.unwrap_or_else(|| Checksum::of(item.src));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let item = BatchPut { key: item.key, src: item.src, request: item.request };
        if let Err(e) = put_request_parts(id, std::slice::from_ref(&item), &[sum], &mut conn.out) {
            return Some(Err(not_encodable("put", e)));
        }
        let deadline = self.config.deadline;
        let until = Instant::now() + deadline;
        let sent = conn.stream.set_write_timeout(Some(deadline)).and_then(|()| {
            let (head, tail) = conn.out.split_at(HEADER_BYTES.min(conn.out.len()));
            let mut parts =
                [io::IoSlice::new(head), io::IoSlice::new(item.src), io::IoSlice::new(tail)];
            write_all_vectored(&mut conn.stream, &mut parts)
        });
        let answer = self
            .answer_after_send(&mut conn, sent, id, until, deadline, None)
            .map_err(|f| f.into_store_error("put"))
            .and_then(|frame| checked(frame, None, "put").map_err(|(e, _)| e))
            .map(|frame| {
                let answer = match Response::from_frame(&frame) {
                    Ok(Response::Put(mut answers)) if answers.len() == 1 => {
                        answers.pop().unwrap_or_else(|| Err(transport("put", "no answer")))
                    }
                    Ok(other) => Err(unexpected("put", &other)),
                    Err(e) => Err(transport("put", e)),
                };
                conn.decoder.recycle(frame.body);
                answer
            });
        Some(match answer {
            Ok(answer) => {
                self.keep(pool_key(caller), conn);
                answer
            }
            Err(e) => Err(e),
        })
    }

    /// The batch PUT behind [`Store::put_batch`] and [`Store::put_batch_checked`]: `expected`,
    /// when given, holds one checksum per item.
    fn put_items(
        &self,
        caller: &Caller,
        items: &[BatchPut<'_>],
        expected: Option<&[Checksum]>,
    ) -> BatchAnswers<Put> {
        if let Err(e) = check_right(caller, Right::Write) {
            return every_item(items.len(), &e);
        }
        let arena = match self.arena("put") {
            Ok(a) => a,
            Err(e) => return every_item(items.len(), &e),
        };
        if let ([item], None) = (items, arena) {
            let sum = expected.and_then(|e| e.first().copied());
            if let Some(answer) = self.put_one(caller, item, sum) {
                return vec![answer];
            }
        }
        let sizes: Vec<u64> = items.iter().map(|i| i.src.len() as u64).collect();
        // Each item's checksum: the caller's, or the one its bounce copy computed.
        let mut sums: Vec<Option<Checksum>> =
            (0..items.len()).map(|i| expected.and_then(|e| e.get(i).copied())).collect();
        let (frames, places) = self.plan_frames(arena, &sizes, |arena, i| {
            let src = items[i].src;
            match Place::of(arena, src)? {
                Place::Bounce(mut b) => {
                    let copied = Checksum::copy_of(&mut b, src);
                    sums[i] = sums[i].or(copied);
                    Some(Place::Bounce(b))
                }
                direct => Some(direct),
            }
        });
        let encode = |f: usize, id: u64, seal: Option<&SealKey>, out: &mut Vec<u8>| {
            let frame = &frames[f];
            let batch = items.get(frame.items.clone()).unwrap_or_default();
            match &frame.offsets {
                None => encode_put_request(
                    id,
                    seal,
                    batch,
                    expected.and_then(|e| e.get(frame.items.clone())),
                    out,
                ),
                Some(offsets) => Request::PutShared {
                    items: batch
                        .iter()
                        .zip(offsets)
                        .zip(frame.items.clone())
                        .map(|((item, &offset), i)| SharedPutItem {
                            key: item.key.clone(),
                            request: item.request,
                            offset,
                            len: item.src.len() as u64,
                            checksum: sums[i].unwrap_or_else(|| Checksum::of(item.src)),
                        })
                        .collect(),
                }
                .encode_sealed_frame(id, seal, out),
            }
        };
        let mut answers: Vec<Option<Result<Put, StoreError>>> =
            (0..items.len()).map(|_| None).collect();
        let outcome =
            self.batch_exchange(caller, "put", frames.len(), false, &encode, |f, frame| {
                let range = frames[f].items.clone();
                let got = match (Response::from_frame(frame), frames[f].offsets.is_some()) {
                    (Ok(Response::Put(a)), false) | (Ok(Response::PutShared(a)), true) => Ok(a),
                    (Ok(other), _) => Err(unexpected("put", &other)),
                    (Err(e), _) => Err(transport("put", e)),
                };
                fill(&mut answers[range], got, "put");
            });
        if let Err(stop) = &outcome {
            // The server only reads these ranges, and refuses bytes that no longer match
            // their checksum; bounce buffers it may have been reading are still kept out of
            // reuse.
            for (f, group) in places.into_iter().enumerate() {
                if stop.maybe_served(f) {
                    group.into_iter().flatten().for_each(Place::quarantine);
                }
            }
        }
        let item_frames: FrameItems = frames.iter().map(|f| f.items.clone()).collect();
        every_answer(answers, &item_frames, &outcome, "put", |_, _, e| e)
    }
}

fn copy_reservation(r: &Reservation) -> Reservation {
    Reservation { region: r.region, epoch: r.epoch, len: r.len, request: r.request }
}
