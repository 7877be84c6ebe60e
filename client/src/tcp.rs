//! The client of the native GPCW service, as a [`Store`]: every call is one request frame and
//! its answer, over pooled connections (one pool per tenant and rights), each with a deadline.
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
//! segment (that is what a hit means), so the client does not hash them again. A failed call whose server side may still be writing a caller's shared buffer
//! reports [`Retirement::Unknown`]; a bounce buffer in that state is quarantined for good.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use std::sync::Arc;

use gpucache_dataplane::caller::{Caller, Right};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::{Clock, UnixClock};
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::RequestId;
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::store::{
    Abort, Committed, FullPolicy, Get, Implementation, Invalidate, Lookup, MissReason, Put,
    Reclaimed, Reservation, Reserve, Retirement, Store, StoreError, StoreInfo, StoreStats,
};

use gpucache_storage::host::segment::{Pages, Segment, SharedArena, SharedBuf, send_with_fd};

use crate::Credentials;
use gpucache_wire::seal::{self, NONCE_BYTES, SealKey};
use gpucache_wire::staging::{StageCallError, StageId, StagedGet, StagedSlot, StagingStats};
use gpucache_wire::{
    BATCH_ITEMS_MAX, FetchedRef, Frame, FrameDecoder, GetItem, HelloAuth, Op, PAYLOAD_BYTES_MAX,
    RemoteInfo, Request, Response, ServerLimits, SharedGetItem, SharedPutItem, WireError,
    decode_get_response, encode_put_request,
};

/// Idle connections kept per (tenant, rights).
const POOL_CONNECTIONS_MAX: usize = 8;
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Largest request buffer a connection keeps between requests.
const OUT_BUFFER_KEEP_BYTES: usize = 8 << 20;
/// Default for [`ClientConfig::handshake_deadline`].
pub const HANDSHAKE_DEADLINE_DEFAULT: Duration = Duration::from_secs(5);

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
    /// The session key of a sealed session.
    seal: Option<SealKey>,
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
}

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

    /// Opens a session as `caller` now and keeps it in the pool for the next request, so that
    /// a caller learns why the server cannot be used (unreachable, not GPCW, busy, unknown
    /// tenant, refused credentials) as a typed error before its first request.
    pub fn handshake(&self, caller: &Caller) -> Result<(), ConnectError> {
        let conn = self.open(caller)?;
        self.keep(pool_key(caller), conn);
        Ok(())
    }

    fn connect(&self, caller: &Caller, operation: &'static str) -> Result<Conn, StoreError> {
        self.open(caller).map_err(|e| transport_failure(operation, e.io_kind(), e))
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
                .exchange_with(&mut conn, &Outgoing::Request(&attach), "connect", Some(segment))
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
            seal: None,
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
                &Outgoing::Request(&hello),
                hello_key.as_ref(),
                None,
                self.config.handshake_deadline,
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
        outgoing: &Outgoing<'_>,
        operation: &'static str,
        segment: Option<&Segment>,
    ) -> Result<Frame, StoreError> {
        let seal = conn.seal.clone();
        let frame = self.exchange_frame(conn, outgoing, seal.as_ref(), segment, operation)?;
        if let Some(key) = &seal {
            // Never let an answer that fails its seal reach the caller, whatever it holds.
            frame.verify_seal(key).map_err(|e| transport(operation, format!("answer: {e}")))?;
        }
        if frame.op == Op::Error {
            let response = Response::from_frame(&frame).map_err(|e| transport(operation, e))?;
            if let Response::Error(e) = &response
                && e.closes_connection()
            {
                return Err(unexpected(operation, &response));
            }
        }
        Ok(frame)
    }

    /// Sends one request (sealed with `seal` when given, with `segment`'s descriptor when
    /// given) and returns the frame that answers it, within the request deadline.
    fn exchange_frame(
        &self,
        conn: &mut Conn,
        outgoing: &Outgoing<'_>,
        seal: Option<&SealKey>,
        segment: Option<&Segment>,
        operation: &'static str,
    ) -> Result<Frame, StoreError> {
        self.exchange_within(conn, outgoing, seal, segment, self.config.deadline).map_err(|f| {
            match f {
                ExchangeFailure::Encode(e) => StoreError::Backend {
                    operation,
                    detail: format!("request not encodable: {e}"),
                    retirement: Retirement::Retired,
                },
                other => transport_failure(operation, other.io_kind(), other),
            }
        })
    }

    /// [`Self::exchange_frame`] within `deadline`, failing with what went wrong. The request
    /// is encoded into the connection's reused buffer; the rest of a large answer is read
    /// straight into the decoder's body buffer. An ERROR frame with request id 0 answers the
    /// request too: it is how a server turns a connection away (busy, stopping) or answers a
    /// frame whose header it could not trust.
    fn exchange_within(
        &self,
        conn: &mut Conn,
        outgoing: &Outgoing<'_>,
        seal: Option<&SealKey>,
        segment: Option<&Segment>,
        deadline: Duration,
    ) -> Result<Frame, ExchangeFailure> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        conn.out.clear();
        outgoing.encode(id, seal, &mut conn.out).map_err(ExchangeFailure::Encode)?;
        let until = Instant::now() + deadline;
        conn.stream.set_write_timeout(Some(deadline)).map_err(ExchangeFailure::Io)?;
        let sent = match (&conn.stream, segment) {
            (Stream::Local(s), Some(seg)) => send_with_fd(s, &conn.out, seg.fd()),
            (Stream::Tcp(_), Some(_)) => Err(io::Error::other("a descriptor needs a Unix socket")),
            (_, None) => conn.stream.write_all(&conn.out),
        };
        if conn.out.capacity() > OUT_BUFFER_KEEP_BYTES {
            conn.out = Vec::new();
        }
        if let Err(e) = sent {
            // A server that turned the connection away wrote why before it closed: read that.
            return match self.read_answer(conn, id, until, deadline) {
                Ok(frame) if frame.request_id == 0 && frame.op == Op::Error => Ok(frame),
                _ => Err(ExchangeFailure::Io(e)),
            };
        }
        self.read_answer(conn, id, until, deadline)
    }

    /// Reads the frame that answers request `id`, until `until`.
    fn read_answer(
        &self,
        conn: &mut Conn,
        id: u64,
        until: Instant,
        deadline: Duration,
    ) -> Result<Frame, ExchangeFailure> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ExchangeFailure::Deadline(deadline));
            }
            conn.stream.set_read_timeout(Some(left)).map_err(ExchangeFailure::Io)?;
            let direct = conn.decoder.body_window().is_some();
            let read = match conn.decoder.body_window() {
                Some(window) => conn.stream.read(window),
                None => conn.stream.read(&mut conn.buf),
            };
            let n = match read {
                Ok(0) => return Err(ExchangeFailure::Closed),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    return Err(ExchangeFailure::Deadline(deadline));
                }
                Err(e) => return Err(ExchangeFailure::Io(e)),
            };
            let mut input = if direct {
                conn.decoder.commit_body(n);
                &conn.buf[..0]
            } else {
                &conn.buf[..n]
            };
            match conn.decoder.feed(&mut input) {
                Ok(None) => continue,
                Err(e) => return Err(ExchangeFailure::Frame(e.error)),
                Ok(Some(frame)) => {
                    // One request, one answer: anything else breaks the connection.
                    if !input.is_empty() {
                        return Err(ExchangeFailure::PastTheAnswer);
                    }
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

    /// One request as `caller`, answered by `decode`: a pooled connection, or a new one. A
    /// request that only reads (or whose repetition is harmless) is retried once on a fresh
    /// connection when a pooled one turns out dead; writes are never retried here (their
    /// request ids make a caller's own retry safe).
    fn call_with<T>(
        &self,
        caller: &Caller,
        outgoing: Outgoing<'_>,
        operation: &'static str,
        decode: impl FnOnce(&Frame) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let key = pool_key(caller);
        let pooled = self.pools.lock().ok().and_then(|mut p| p.get_mut(&key).and_then(Vec::pop));
        let was_pooled = pooled.is_some();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.connect(caller, operation)?,
        };
        let frame = match self.exchange_with(&mut conn, &outgoing, operation, None) {
            Ok(f) => f,
            Err(e) if was_pooled && outgoing.retryable() => {
                conn = self.connect(caller, operation)?;
                self.exchange_with(&mut conn, &outgoing, operation, None).map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        let answer = decode(&frame);
        conn.decoder.recycle(frame.body);
        self.keep(key, conn);
        answer
    }

    /// Returns an idle connection to its pool (unless the pool is full).
    fn keep(&self, key: PoolKey, conn: Conn) {
        if conn.decoder.is_idle()
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
        self.call_outgoing(caller, Outgoing::Request(&request), operation)
    }

    fn call_outgoing(
        &self,
        caller: &Caller,
        outgoing: Outgoing<'_>,
        operation: &'static str,
    ) -> Result<Response, StoreError> {
        self.call_with(caller, outgoing, operation, |frame| {
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

impl TcpStore {
    /// Batch QUERY: one answer per key, in order, in as few frames as the limits allow.
    pub fn lookup_many(
        &self,
        caller: &Caller,
        keys: &[PhysicalKey],
    ) -> Result<Vec<Result<Lookup, StoreError>>, StoreError> {
        check_right(caller, Right::Read)?;
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(BATCH_ITEMS_MAX) {
            match self.call(caller, Request::Lookup { keys: chunk.to_vec() }, "lookup")? {
                Response::Lookup(items) if items.len() == chunk.len() => out.extend(items),
                other => return Err(unexpected("lookup", &other)),
            }
        }
        Ok(out)
    }

    /// Batch GET into caller buffers: one answer per item, in order. Over TCP items are grouped
    /// so that each frame's capacities stay within the protocol's payload limit; on the
    /// same-host path they go through the shared segment (falling back to frames when the
    /// segment has no room for a bounce buffer).
    pub fn get_many(
        &self,
        caller: &Caller,
        items: &mut [(PhysicalKey, &mut [u8])],
    ) -> Result<Vec<Result<Get, StoreError>>, StoreError> {
        check_right(caller, Right::Read)?;
        let Some(arena) = self.arena("get")? else { return self.get_framed(caller, items) };
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks_mut(BATCH_ITEMS_MAX) {
            match self.get_shared(caller, arena, chunk)? {
                Some(answers) => out.extend(answers),
                None => {
                    self.shared.framed_batches.fetch_add(1, Ordering::Relaxed);
                    out.extend(self.get_framed(caller, chunk)?);
                }
            }
        }
        Ok(out)
    }

    fn get_framed(
        &self,
        caller: &Caller,
        items: &mut [(PhysicalKey, &mut [u8])],
    ) -> Result<Vec<Result<Get, StoreError>>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        let sizes: Vec<u64> = items.iter().map(|(_, dst)| dst.len() as u64).collect();
        for (start, end) in frame_ranges(&sizes) {
            let request = Request::Get {
                items: items[start..end]
                    .iter()
                    .map(|(key, dst)| GetItem { key: key.clone(), capacity: dst.len() as u64 })
                    .collect(),
            };
            let batch = &mut items[start..end];
            let answers = self.call_with(caller, Outgoing::Request(&request), "get", |frame| {
                if frame.op != Op::Get {
                    let answer = Response::from_frame(frame).map_err(|e| transport("get", e))?;
                    return Err(unexpected("get", &answer));
                }
                let answers = decode_get_response(&frame.body).map_err(|e| transport("get", e))?;
                if answers.len() != batch.len() {
                    return Err(transport("get", "answers do not match the batch"));
                }
                // The block lands in the caller's buffer straight from the frame body.
                Ok(batch
                    .iter_mut()
                    .zip(answers)
                    .map(|((_, dst), answer)| answer.map(|f| land(f, dst)))
                    .collect::<Vec<_>>())
            })?;
            out.extend(answers);
        }
        Ok(out)
    }

    /// One GET_SHARED frame for at most [`BATCH_ITEMS_MAX`] items; `None` when a bounce
    /// buffer does not fit the segment.
    fn get_shared(
        &self,
        caller: &Caller,
        arena: &SharedArena,
        items: &mut [(PhysicalKey, &mut [u8])],
    ) -> Result<Option<Vec<Result<Get, StoreError>>>, StoreError> {
        let mut places = Vec::with_capacity(items.len());
        for (_, dst) in items.iter() {
            match Place::of(arena, dst) {
                Some(p) => places.push(p),
                None => return Ok(None),
            }
        }
        self.shared.count(&places);
        let request = Request::GetShared {
            items: items
                .iter()
                .zip(&places)
                .map(|((key, dst), place)| SharedGetItem {
                    key: key.clone(),
                    offset: place.offset(),
                    capacity: dst.len() as u64,
                })
                .collect(),
        };
        let answers = match self.call(caller, request, "get") {
            Ok(Response::GetShared(a)) if a.len() == items.len() => a,
            // Refused at the protocol level: the server wrote nothing.
            Ok(other) => return Err(unexpected("get", &other)),
            Err(e) => {
                // The server may still be writing the ranges it was given.
                let callers = places.iter().any(|p| matches!(p, Place::Caller(_)));
                places.into_iter().for_each(Place::quarantine);
                return Err(if callers { unknown_retirement(e) } else { e });
            }
        };
        Ok(Some(
            items
                .iter_mut()
                .zip(places)
                .zip(answers)
                .map(|(((_, dst), place), answer)| answer.map(|g| land_shared(g, &place, dst)))
                .collect(),
        ))
    }

    /// Batch PUT: one answer per item, in order. On the same-host path the bytes go through the
    /// shared segment (falling back to frames when it has no room for a bounce buffer).
    pub fn put_many(
        &self,
        caller: &Caller,
        items: &[(PhysicalKey, &[u8], Option<RequestId>)],
    ) -> Result<Vec<Result<Put, StoreError>>, StoreError> {
        check_right(caller, Right::Write)?;
        let Some(arena) = self.arena("put")? else { return self.put_framed(caller, items) };
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(BATCH_ITEMS_MAX) {
            match self.put_shared(caller, arena, chunk)? {
                Some(answers) => out.extend(answers),
                None => {
                    self.shared.framed_batches.fetch_add(1, Ordering::Relaxed);
                    out.extend(self.put_framed(caller, chunk)?);
                }
            }
        }
        Ok(out)
    }

    fn put_framed(
        &self,
        caller: &Caller,
        items: &[(PhysicalKey, &[u8], Option<RequestId>)],
    ) -> Result<Vec<Result<Put, StoreError>>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        let sizes: Vec<u64> = items.iter().map(|(_, data, _)| data.len() as u64).collect();
        for (start, end) in frame_ranges(&sizes) {
            // The payloads go into the frame straight from the caller's slices.
            match self.call_outgoing(caller, Outgoing::Put(&items[start..end]), "put")? {
                Response::Put(a) if a.len() == end - start => out.extend(a),
                other => return Err(unexpected("put", &other)),
            }
        }
        Ok(out)
    }

    /// One PUT_SHARED frame for at most [`BATCH_ITEMS_MAX`] items; `None` when a bounce
    /// buffer does not fit the segment.
    fn put_shared(
        &self,
        caller: &Caller,
        arena: &SharedArena,
        items: &[(PhysicalKey, &[u8], Option<RequestId>)],
    ) -> Result<Option<Vec<Result<Put, StoreError>>>, StoreError> {
        let mut places = Vec::with_capacity(items.len());
        for (_, src, _) in items {
            match Place::of(arena, src) {
                Some(Place::Bounce(mut b)) => {
                    b.copy_from_slice(src);
                    places.push(Place::Bounce(b));
                }
                Some(p) => places.push(p),
                None => return Ok(None),
            }
        }
        self.shared.count(&places);
        let request = Request::PutShared {
            items: items
                .iter()
                .zip(&places)
                .map(|((key, src, request), place)| SharedPutItem {
                    key: key.clone(),
                    request: *request,
                    offset: place.offset(),
                    len: src.len() as u64,
                    checksum: Checksum::of(src),
                })
                .collect(),
        };
        match self.call(caller, request, "put") {
            Ok(Response::PutShared(a)) if a.len() == items.len() => Ok(Some(a)),
            Ok(other) => Err(unexpected("put", &other)),
            Err(e) => {
                // The server only reads these ranges, and refuses bytes that no longer match
                // their checksum; bounce buffers are still kept out of reuse.
                places.into_iter().for_each(Place::quarantine);
                Err(e)
            }
        }
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

/// Splits items of the given payload sizes into consecutive `[start, end)` ranges that each fit
/// one frame: at most [`BATCH_ITEMS_MAX`] items and [`PAYLOAD_BYTES_MAX`] payload bytes (a single
/// item is always sent on its own, and the server judges its size).
fn frame_ranges(sizes: &[u64]) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let mut end = start;
        let mut bytes = 0u64;
        while end < sizes.len() && end - start < BATCH_ITEMS_MAX {
            if end > start && bytes + sizes[end] > PAYLOAD_BYTES_MAX {
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
            if data.len() > dst.len() || Checksum::of(data) != checksum {
                return Get::Miss(MissReason::Corrupt);
            }
            dst[..data.len()].copy_from_slice(data);
            Get::Hit { len: data.len() as u64, checksum }
        }
        FetchedRef::Miss(MissReason::Corrupt) => {
            // The store zeroes a corrupt read's destination; so does its remote form.
            dst.fill(0);
            Get::Miss(MissReason::Corrupt)
        }
        FetchedRef::Miss(reason) => Get::Miss(reason),
    }
}

/// What a request frame is built from: a typed request, or a PUT written straight from the
/// caller's slices.
enum Outgoing<'r> {
    Request(&'r Request),
    Put(&'r [(PhysicalKey, &'r [u8], Option<RequestId>)]),
}

impl Outgoing<'_> {
    fn encode(&self, id: u64, seal: Option<&SealKey>, out: &mut Vec<u8>) -> Result<(), WireError> {
        match self {
            Self::Request(r) => r.encode_sealed_frame(id, seal, out),
            Self::Put(items) => encode_put_request(id, seal, items, out),
        }
    }

    /// Whether repeating the request cannot change what the store holds.
    fn retryable(&self) -> bool {
        match self {
            Self::Request(r) => retryable(r),
            Self::Put(_) => false,
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
            | Request::Get { .. }
            | Request::GetShared { .. }
            | Request::NixlAttach { .. }
            | Request::StageStats
            | Request::Limits
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
        check_right(caller, Right::Read)?;
        match self.call(caller, Request::Lookup { keys: vec![key.clone()] }, "lookup")? {
            Response::Lookup(items) => single(items, "lookup"),
            other => Err(unexpected("lookup", &other)),
        }
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        single(self.get_many(caller, &mut [(key.clone(), dst)])?, "get")
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
        single(self.put_many(caller, &[(key.clone(), src, request)])?, "put")
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        check_right(caller, Right::Write)?;
        match self.call(caller, Request::Invalidate { keys: vec![key.clone()] }, "invalidate")? {
            Response::Invalidate(items) => single(items, "invalidate"),
            other => Err(unexpected("invalidate", &other)),
        }
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

fn copy_reservation(r: &Reservation) -> Reservation {
    Reservation { region: r.region, epoch: r.epoch, len: r.len, request: r.request }
}
