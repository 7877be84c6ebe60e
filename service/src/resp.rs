//! The RESP front: a Redis-protocol listener (RESP2, and RESP3 after `HELLO 3`) over a shared
//! [`Store`], so that Redis clients (`redis-cli`, `redis-benchmark`, redis-py and the libraries
//! built on it) can keep opaque values in GPUCache.
//!
//! # Keys
//!
//! Identity decides compatibility, never a string key alone. Every RESP connection acts as one
//! configured tenant ([`RespConfig::tenant`]), and a plain Redis key is an opaque byte string
//! inside one fixed identity namespace of that tenant ([`IdentityTemplate`], in the wire crate
//! so that every client maps names the same way): the physical key is the namespace's
//! `CacheIdentity` with a one-link chain whose only link is the BLAKE3 hash of the key bytes,
//! and block and valid token counts of 1. Plain keys therefore never meet KV
//! blocks of a model (their model revision, tokenizer and layout differ), nor another tenant's
//! keys, and two plain keys are the same key exactly when their bytes are equal.
//!
//! # Values
//!
//! The store is create-only, and so is this front. `SET` of a free key stores the value. `SET`
//! of a key that already holds exactly the same bytes answers `+OK`, because the key then holds
//! what was asked for (this is what lets `redis-benchmark`, which writes one value to random
//! keys, run). `SET` of a key that holds different bytes is an error and changes nothing; with
//! `NX` it answers nil instead, whatever the value, and `XX` never stores (a key it finds either
//! holds the same bytes, or other bytes it cannot replace). A value therefore changes only
//! through `DEL` then `SET`. A value must hold at least one byte and fit the store's
//! `object_bytes_max`. A read that finds nothing usable, including a block whose bytes failed
//! their checksum (which the store drops), answers nil.
//!
//! # Expiry
//!
//! `SET ... EX|PX|EXAT|PXAT` gives a key a deadline, kept by this process in a table of at most
//! [`EXPIRING_KEYS_MAX`] keys shared by every connection. A key whose deadline has passed is
//! removed from the store by the next command that touches it and reads as absent; the store
//! itself has no expiry, so the deadline is lost when the process restarts (the block then stays
//! until `DEL` or eviction).
//!
//! # Protocol
//!
//! Requests are RESP2 arrays of bulk strings, or inline commands (one line of words separated
//! by spaces or tabs; quotes are not interpreted). Replies are RESP2 until the connection sends
//! `HELLO 3`, then RESP3 (null `_`, maps `%`, verbatim text `=`). The decoder ([`gpucache_wire::resp`],
//! re-exported here) is strict and bounded (see the constants and [`RespLimits`]); a request it
//! cannot decode is answered `-ERR Protocol error: ...` and the connection closes, because the
//! stream cannot be resynchronised. Command-level mistakes (unknown command, wrong arity, bad option) are answered
//! `-ERR ...` and the connection goes on. Pipelined requests are answered in order.
//!
//! # Transactions
//!
//! `MULTI` starts a transaction: the commands that follow are answered `+QUEUED` and kept (at
//! most [`TRANSACTION_COMMANDS_MAX`] commands and [`TRANSACTION_BYTES_MAX`] bytes of arguments)
//! until `EXEC` runs them in order and answers an array of their replies, or `DISCARD` drops
//! them. No other RESP connection's command runs while an `EXEC` runs (every command of the
//! front holds a shared lock that `EXEC` holds exclusively); clients of the native protocol are
//! not held back, so the store may change between two commands of a transaction under their
//! writes. As in Redis, a command that fails inside `EXEC` does not undo the others (there is
//! no rollback), and a command refused while queueing (unknown, or past the limits) makes `EXEC`
//! answer `-EXECABORT` and run nothing. `WATCH` is not supported (it is an error), so
//! optimistic locking is not available; redis-py's default `pipeline()`, which wraps its
//! commands in `MULTI` / `EXEC`, works.
//!
//! # Threads
//!
//! As for the native listener (ADR 0011): one accept thread, one thread per connection up to
//! `connections_max`, a read tick that notices shutdown and idleness, and a write timeout.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use crate::auth::TenantKeys;
use crate::auth::keys::unhex;
use crate::bounds::{Deadlines, Front, Guard, Reason, UNAUTHENTICATED_REQUEST_BYTES_MAX};
use crate::create_only::{DIFFERENT_VALUE_TEXT, Held, compare_held};
use crate::listener::{
    Acceptor, AcceptorConfig, DeadlineWriter, Gate, ReadTick, TurnedAway, close_after, read_tick,
};

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::clock::{Clock, UnixClock};
use gpucache_dataplane::identity::{Digest32, IdentityError};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{
    BatchGet, BatchPut, Get, Implementation, Invalidate, Lookup, MissReason, Put, Store, StoreError,
};
use subtle::ConstantTimeEq;

// ---------------------------------------------------------------------------------------------
// Protocol

// The RESP codec itself (limits, request decoder, RESP2 and RESP3 replies) is pure and lives in the wire crate;
// it is re-exported here so that the front's users find it next to the listener.
pub use gpucache_wire::resp::{
    ARGS_MAX, BULK_SLACK_BYTES, INLINE_BYTES_MAX, LENGTH_LINE_BYTES_MAX, ProtocolError,
    REQUEST_SLACK_BYTES, Reply, RequestDecoder, RespLimits, RespVersion, VALUE_BYTES_CEILING,
    encode_request, parse_int,
};

// ---------------------------------------------------------------------------------------------
// Limits of the listener

/// The Redis version INFO and HELLO report; clients check it to pick a dialect.
pub const REDIS_VERSION: &str = "7.0.0";
/// The server name HELLO reports.
pub const SERVER_NAME: &str = "gpucache";
/// Longest connection name (`CLIENT SETNAME`, `HELLO ... SETNAME`) and library name or version
/// (`CLIENT SETINFO`).
pub const CLIENT_NAME_BYTES_MAX: usize = 256;
/// Most plain keys with an expiry (`SET ... EX|PX|EXAT|PXAT`) at once, over all connections, by
/// default ([`RespConfig::expiring_keys_max`]).
pub const EXPIRING_KEYS_MAX: usize = 65_536;

/// How often a blocked read wakes to check for shutdown and idleness.
const READ_TICK: Duration = Duration::from_millis(100);
/// Bytes read from a socket per call.
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Buffered replies are written out once they reach this size.
const REPLY_FLUSH_BYTES: usize = 256 << 10;
/// Buffers grown past this by one large request or reply are given back afterwards.
const BUFFER_KEEP_BYTES: usize = 4 << 20;
/// Most bytes of a command name or key quoted in an error.
const SHOWN_BYTES_MAX: usize = 64;

// ---------------------------------------------------------------------------------------------
// Quoting client bytes

/// Client bytes (a command name, a key) made safe to quote in an error: printable ASCII, other
/// bytes as `?`, at most [`SHOWN_BYTES_MAX`] of them.
fn shown(bytes: &[u8]) -> String {
    let mut s: String = bytes
        .iter()
        .take(SHOWN_BYTES_MAX)
        .map(|&b| if (0x20..0x7f).contains(&b) { char::from(b) } else { '?' })
        .collect();
    if bytes.len() > SHOWN_BYTES_MAX {
        s.push_str("...");
    }
    s
}

// ---------------------------------------------------------------------------------------------
// The identity namespace

// Plain names map into a tenant's namespace in the wire crate, so that every client (the CLI,
// the Python package) maps them exactly as this front does.
pub use gpucache_wire::namespace::{IdentityTemplate, chain_link};

// ---------------------------------------------------------------------------------------------
// The server

/// How to run a RESP listener.
#[derive(Debug, Clone)]
pub struct RespConfig {
    pub addr: SocketAddr,
    /// Open connections at most; one more is answered `-ERR max number of clients reached` and
    /// closed.
    pub connections_max: u32,
    /// A connection with no complete request for this long is closed.
    pub idle_timeout: Duration,
    /// Replies the client does not take whole within this long (one deadline for what is
    /// written at once, however slowly it is drained) close the connection.
    pub write_timeout: Duration,
    /// The in-flight request-body budget, the per-peer connection limit, the body and AUTH
    /// deadlines, and the refusal counts; a built service shares one with the native front.
    pub guard: Arc<Guard>,
    /// How long shutdown waits for connection threads.
    pub shutdown_deadline: Duration,
    /// The caller every RESP connection acts as.
    pub tenant: Caller,
    /// Where plain keys live; its tenant must be `tenant`'s.
    pub namespace: IdentityTemplate,
    pub limits: RespLimits,
    /// The tenant's keys when it has any: then a connection must `AUTH` with one of them before
    /// any other command (`AUTH <key-id> <hex secret>`, or `AUTH <key-id>:<hex secret>`), and is
    /// answered `-NOAUTH` until it does. RESP cannot seal, so the secret crosses the wire in
    /// clear: keep the listener on loopback or a trusted network.
    pub auth: Option<Arc<TenantKeys>>,
    /// Most plain keys with a deadline at once ([`EXPIRING_KEYS_MAX`] by default); a SET with
    /// an expiry that would take one more, when none of them is past its deadline, is refused.
    pub expiring_keys_max: usize,
    /// Unix time in milliseconds, by which deadlines and tenant-key expiry are judged
    /// ([`UnixClock`] by default).
    pub clock: Arc<dyn Clock>,
}

impl RespConfig {
    /// A listener on `addr` for `tenant`, in the tenant's default namespace, with the limits for
    /// the default `object_bytes_max`.
    pub fn new(addr: SocketAddr, tenant: Caller) -> Result<Self, IdentityError> {
        let namespace = IdentityTemplate::for_tenant(&tenant.tenant)?;
        Ok(Self {
            addr,
            connections_max: 256,
            idle_timeout: Duration::from_secs(300),
            write_timeout: Duration::from_secs(30),
            guard: Arc::default(),
            shutdown_deadline: Duration::from_secs(10),
            tenant,
            namespace,
            limits: RespLimits::default(),
            auth: None,
            expiring_keys_max: EXPIRING_KEYS_MAX,
            clock: Arc::new(UnixClock),
        })
    }
}

struct Shared {
    config: RespConfig,
    store: Arc<dyn Store>,
    gate: Arc<Gate>,
    started: Instant,
    port: u16,
    /// The id the next connection gets (`CLIENT ID`, HELLO's `id`), from 1.
    next_client_id: AtomicU64,
    expiries: Expiries,
    /// Held shared by every command and exclusively by `EXEC`, so that a transaction's commands
    /// run with no other RESP command between them.
    transactions: RwLock<()>,
}

// ---------------------------------------------------------------------------------------------
// Expiry

/// The deadlines (Unix milliseconds) of the plain keys stored with one, by [`chain_link`] of the
/// key: at most `max` of them.
#[derive(Debug)]
struct Expiries {
    deadlines: Mutex<HashMap<Digest32, u64>>,
    max: usize,
}

/// Why a deadline could not be set.
#[derive(Debug, PartialEq, Eq)]
struct ExpiriesFull;

impl Expiries {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Digest32, u64>> {
        // The map is consistent after every statement, so a panic elsewhere leaves it usable.
        self.deadlines.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn deadline(&self, link: Digest32) -> Option<u64> {
        self.lock().get(&link).copied()
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    /// Sets the deadline of `link` to `at` and answers the one it replaces. When the table is
    /// full, the keys whose deadlines have passed by `now_ms` are dropped from it first and
    /// handed to `expired` (outside the lock) to be removed from the store.
    fn set(
        &self,
        link: Digest32,
        at: u64,
        now_ms: u64,
        expired: impl FnMut(Digest32),
    ) -> Result<Option<u64>, ExpiriesFull> {
        let mut swept = Vec::new();
        let answer = {
            let mut map = self.lock();
            if map.len() >= self.max && !map.contains_key(&link) {
                map.retain(|&k, &mut d| {
                    let keep = d > now_ms;
                    if !keep {
                        swept.push(k);
                    }
                    keep
                });
            }
            if map.len() >= self.max && !map.contains_key(&link) {
                Err(ExpiriesFull)
            } else {
                Ok(map.insert(link, at))
            }
        };
        swept.into_iter().for_each(expired);
        answer
    }

    /// Puts back the deadline `previous` that a [`Self::set`] to `at` replaced (none: no
    /// deadline), unless another SET has set the key's deadline since.
    fn restore(&self, link: Digest32, at: u64, previous: Option<u64>) {
        let mut map = self.lock();
        if map.get(&link) != Some(&at) {
            return;
        }
        match previous {
            Some(d) => map.insert(link, d),
            None => map.remove(&link),
        };
    }

    /// Forgets the deadline of `link`.
    fn forget(&self, link: Digest32) {
        self.lock().remove(&link);
    }

    /// Forgets the deadline of `link` if it is still `deadline`.
    fn forget_if(&self, link: Digest32, deadline: u64) {
        let mut map = self.lock();
        if map.get(&link) == Some(&deadline) {
            map.remove(&link);
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .field("store", &self.store.info())
            .field("open", &self.gate.open)
            .finish()
    }
}

/// A running RESP listener.
#[derive(Debug)]
pub struct RespServer {
    acceptor: Acceptor,
    addr: SocketAddr,
}

impl RespServer {
    /// Binds and starts serving `store`. Refuses a namespace of another tenant than the
    /// configured caller's.
    pub fn start(config: RespConfig, store: Arc<dyn Store>) -> io::Result<Self> {
        if config.namespace.tenant() != &config.tenant.tenant {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the RESP namespace belongs to tenant {}, the RESP caller is tenant {}",
                    config.namespace.tenant(),
                    config.tenant.tenant
                ),
            ));
        }
        let listener = TcpListener::bind(config.addr)?;
        let addr = listener.local_addr()?;
        let gate = Arc::new(Gate::default());
        let expiries =
            Expiries { deadlines: Mutex::new(HashMap::new()), max: config.expiring_keys_max };
        let (connections_max, shutdown_deadline) =
            (config.connections_max, config.shutdown_deadline);
        let tenant = config.tenant.tenant.clone();
        let guard = Arc::clone(&config.guard);
        let shared = Arc::new(Shared {
            config,
            store,
            gate: Arc::clone(&gate),
            started: Instant::now(),
            port: addr.port(),
            next_client_id: AtomicU64::new(1),
            expiries,
            transactions: RwLock::new(()),
        });
        let acceptor = Acceptor::start(
            listener,
            gate,
            AcceptorConfig {
                name: "gpucache-resp",
                front: Front::Resp,
                connections_max,
                shutdown_deadline,
                guard,
                refuse: |stream: &mut TcpStream, why: TurnedAway| {
                    let text = match why {
                        TurnedAway::ConnectionsMax { .. } => {
                            "-ERR max number of clients reached\r\n".to_owned()
                        }
                        TurnedAway::PerPeer { open, max } => format!(
                            "-ERR max number of clients reached for this address ({open} of \
                             {max})\r\n"
                        ),
                    };
                    let _ = stream.write_all(text.as_bytes());
                },
                serve: move |stream: TcpStream| serve_connection(stream, &shared),
            },
        )?;
        tracing::info!(%addr, %tenant, "gpucache RESP listener up");
        Ok(Self { acceptor, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
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

/// What a connection does after answering a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Continue,
    Close,
}

fn serve_connection(mut stream: TcpStream, shared: &Shared) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(READ_TICK));
    let write_timeout = shared.config.write_timeout;
    let _ = stream.set_write_timeout(Some(write_timeout));
    let guard = &*shared.config.guard;
    let tenant = &shared.config.tenant.tenant;
    // What the decoder holds, charged before each read is appended to it.
    let mut charge = guard.charge(peer.map(|a| a.ip()));
    let mut deadlines = Deadlines::new(guard.bounds(), shared.config.auth.is_some());
    let mut decoder = RequestDecoder::new(shared.config.limits);
    let mut buf = vec![0u8; READ_CHUNK_BYTES];
    let mut out: Vec<u8> = Vec::new();
    let mut last_request = Instant::now();
    let session = Session {
        store: &*shared.store,
        caller: &shared.config.tenant,
        namespace: &shared.config.namespace,
        shared,
        authenticated: Cell::new(shared.config.auth.is_none()),
        version: Cell::new(RespVersion::Resp2),
        id: shared.next_client_id.fetch_add(1, Ordering::Relaxed),
        name: RefCell::new(None),
        library: RefCell::new(Library::default()),
        transaction: RefCell::new(None),
    };
    loop {
        if shared.gate.stopping() && decoder.is_idle() {
            return;
        }
        if let Some(reason) = deadlines.passed(Instant::now()) {
            guard.count(Front::Resp, reason);
            return;
        }
        let n = match read_tick(&mut stream, &mut buf, last_request, shared.config.idle_timeout) {
            // RESP clients cannot send descriptors over TCP; nothing to keep.
            ReadTick::Data(n, _) => n,
            ReadTick::Quiet => continue,
            ReadTick::Idle => {
                guard.count(Front::Resp, Reason::IdleTimeout);
                return;
            }
            ReadTick::Closed => return,
        };
        let held = u64::try_from(decoder.buffered() + n).unwrap_or(u64::MAX);
        let refused = if !session.authenticated.get() && held > UNAUTHENTICATED_REQUEST_BYTES_MAX {
            Some((
                Reason::Oversize,
                format!(
                    "ERR {held} bytes sent before AUTH, more than the \
                     {UNAUTHENTICATED_REQUEST_BYTES_MAX} allowed"
                ),
            ))
        } else {
            charge.set(held, Some(tenant)).err().map(|r| (r.reason, format!("BUSY {}", r.error)))
        };
        if let Some((reason, text)) = refused {
            guard.count(Front::Resp, reason);
            tracing::debug!(?peer, reason = reason.as_str(), "closing a RESP connection: refused");
            Reply::Error(text).encode(&mut out);
            close_after(&mut stream, &out, write_timeout);
            return;
        }
        decoder.feed(&buf[..n]);
        loop {
            match decoder.next_request() {
                Ok(Some(args)) => {
                    last_request = Instant::now();
                    let (reply, then) = session.execute(&args);
                    if session.authenticated.get() {
                        deadlines.authenticated();
                    }
                    reply.encode_as(session.version.get(), &mut out);
                    if then == Then::Close {
                        close_after(&mut stream, &out, write_timeout);
                        return;
                    }
                    if out.len() >= REPLY_FLUSH_BYTES {
                        if !write_out(&mut stream, &out, write_timeout, guard) {
                            return;
                        }
                        out.clear();
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(?peer, error = %e, "closing a RESP connection: bad request");
                    Reply::Error(format!("ERR Protocol error: {e}")).encode(&mut out);
                    close_after(&mut stream, &out, write_timeout);
                    return;
                }
            }
        }
        // What is left buffered is part of the next request (shrinking cannot be refused).
        let _ = charge.set(u64::try_from(decoder.buffered()).unwrap_or(u64::MAX), Some(tenant));
        deadlines.in_request(!decoder.is_idle());
        if !out.is_empty() {
            if !write_out(&mut stream, &out, write_timeout, guard) {
                return;
            }
            out.clear();
            if out.capacity() > BUFFER_KEEP_BYTES {
                out = Vec::new();
            }
        }
    }
}

/// Writes replies within one deadline for all of them; false (the connection is to close) when
/// the client did not take them in time (counted) or the write failed.
fn write_out(stream: &mut TcpStream, out: &[u8], write_timeout: Duration, guard: &Guard) -> bool {
    let mut writer = DeadlineWriter::new(stream, write_timeout);
    let written = writer.write_all(out).is_ok();
    if writer.timed_out {
        guard.count(Front::Resp, Reason::WriteTimeout);
    }
    written
}

// ---------------------------------------------------------------------------------------------
// Commands

/// What one connection acts as and on.
struct Session<'a> {
    store: &'a dyn Store,
    caller: &'a Caller,
    namespace: &'a IdentityTemplate,
    shared: &'a Shared,
    /// Whether the connection may run commands: at once for an open tenant, after a good
    /// `AUTH` (or `HELLO ... AUTH`) for a tenant with keys.
    authenticated: Cell<bool>,
    /// The reply protocol, switched by `HELLO`.
    version: Cell<RespVersion>,
    /// `CLIENT ID`.
    id: u64,
    /// `CLIENT SETNAME`, at most [`CLIENT_NAME_BYTES_MAX`] bytes.
    name: RefCell<Option<Vec<u8>>>,
    /// `CLIENT SETINFO LIB-NAME` and `LIB-VER`.
    library: RefCell<Library>,
    /// The commands queued since `MULTI`, while a transaction is open.
    transaction: RefCell<Option<Transaction>>,
}

/// Most commands one transaction queues; one more makes its `EXEC` abort.
pub const TRANSACTION_COMMANDS_MAX: usize = 4096;
/// Most bytes of arguments one transaction queues; more makes its `EXEC` abort.
pub const TRANSACTION_BYTES_MAX: usize = 256 << 20;

/// A transaction being queued.
#[derive(Debug, Default)]
struct Transaction {
    commands: Vec<Vec<Vec<u8>>>,
    bytes: usize,
    /// A command was refused while queueing: `EXEC` runs nothing.
    aborted: bool,
}

/// The commands the front knows, by their upper-case names: what `MULTI` agrees to queue.
const COMMANDS: &[&[u8]] = &[
    b"AUTH", b"HELLO", b"CLIENT", b"PING", b"GET", b"SET", b"TTL", b"PTTL", b"EXISTS", b"DEL",
    b"MGET", b"MSET", b"INFO", b"COMMAND", b"CONFIG", b"SELECT", b"QUIT",
];

/// What a client said about its library (`CLIENT SETINFO`), each at most
/// [`CLIENT_NAME_BYTES_MAX`] bytes.
#[derive(Debug, Default)]
struct Library {
    name: Option<Vec<u8>>,
    version: Option<Vec<u8>>,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let library = self.library.borrow();
        let text = |v: &Option<Vec<u8>>| v.as_deref().map(shown);
        tracing::debug!(
            id = self.id,
            name = text(&self.name.borrow()),
            lib_name = text(&library.name),
            lib_ver = text(&library.version),
            "RESP connection closed"
        );
    }
}

const NOAUTH_TEXT: &str = "NOAUTH Authentication required.";
const HELLO_NOAUTH_TEXT: &str = "NOAUTH Authentication required: authenticate first with AUTH, or \
                                 in the same command with HELLO <protover> AUTH <key-id> <hex secret>";
const NOPROTO_TEXT: &str = "NOPROTO unsupported protocol version; this server speaks 2 and 3";
const INVALID_EXPIRE_TEXT: &str = "invalid expire time in 'set' command";
const WRONGPASS_TEXT: &str = "WRONGPASS invalid username-password pair or user is disabled.";

/// How many times a read looks a key up again when the value was replaced by a longer one
/// between its lookup and its read, and how many times SET stores again when the value it found
/// in the way was deleted before it could be compared.
const RACE_ATTEMPTS: usize = 3;
/// How long SET waits for another client's write of the same key to finish before it answers
/// that the key is busy, and the longest pause between two tries.
const BUSY_WAIT: Duration = Duration::from_secs(2);
const BUSY_PAUSE_MAX: Duration = Duration::from_millis(20);

/// SET's refusal of another value over a key's: the shared text, and what to do here.
fn exists_text() -> String {
    format!("{DIFFERENT_VALUE_TEXT}; DEL it first, or use SET key value NX")
}
const BUSY_TEXT: &str = "another client kept writing this key; retry";

fn store_error(e: &StoreError) -> Reply {
    Reply::err(e)
}

/// MSET's answer when pair `at` (from 0) was not stored. `batched` is `(end, stored)` when the
/// pairs after it up to `end` went to the store in the same batch, `stored` of them stored.
fn mset_stopped(
    pairs: &[(&[u8], &[u8])],
    at: usize,
    why: NotStored,
    batched: Option<(usize, usize)>,
) -> Reply {
    let why = match why {
        NotStored::Exists | NotStored::Absent => exists_text(),
        NotStored::Reply(Reply::Error(text)) => {
            text.strip_prefix("ERR ").unwrap_or(&text).to_owned()
        }
        NotStored::Reply(other) => format!("{other:?}"),
    };
    let n = pairs.len();
    let rest = match batched {
        Some((end, stored)) if end == at + 2 => format!(
            "pair {end} went to the store with it in one batch and was {}stored{}",
            if stored == 1 { "" } else { "not " },
            if end < n { ", the rest were not tried" } else { "" },
        ),
        Some((end, stored)) if end > at + 2 => format!(
            "pairs {} to {end} went to the store with it in one batch and {stored} of them were \
             stored{}",
            at + 2,
            if end < n { ", the rest were not tried" } else { "" },
        ),
        _ => "the rest were not tried".to_owned(),
    };
    Reply::err(format!(
        "MSET stopped at pair {} of {n} (key '{}'); the pairs before it were stored, {rest}: {why}",
        at + 1,
        shown(pairs[at].0),
    ))
}

/// The length a lookup found for a value (`None` when nothing usable is there).
fn looked_len(looked: Result<Lookup, StoreError>) -> Result<Option<usize>, Reply> {
    match looked.map_err(|e| store_error(&e))? {
        Lookup::Hit { len } => usize::try_from(len)
            .map(Some)
            .map_err(|_| Reply::err(format!("a {len}-byte value does not fit this host"))),
        // A one-link chain has no strict prefix, so a prefix hit cannot be this key.
        Lookup::PrefixHit { .. } | Lookup::Miss(_) => Ok(None),
    }
}

/// What a GET into `value` (sized by the lookup before it) read: the value or `None`, or
/// `None` itself when the value was replaced by a longer one since the lookup (look again).
fn read_value(
    got: Result<Get, StoreError>,
    mut value: Vec<u8>,
) -> Option<Result<Option<Vec<u8>>, Reply>> {
    match got {
        Ok(Get::Hit { len, .. }) => {
            let n = value.len();
            value.truncate(usize::try_from(len).unwrap_or(n));
            Some(Ok(Some(value)))
        }
        Ok(Get::Miss(_)) => Some(Ok(None)),
        // Deleted and stored again, longer, since the lookup.
        Err(StoreError::BufferTooSmall { .. }) => None,
        Err(e) => Some(Err(store_error(&e))),
    }
}

/// One key of an MGET's batch read.
enum BatchRead {
    /// Its value, `None`, or the error that answers the MGET.
    Read(Result<Option<Vec<u8>>, Reply>),
    /// Replaced by a longer value between the lookup and the read: read it again.
    Again,
}

/// A connection or library name as Redis takes one: at most [`CLIENT_NAME_BYTES_MAX`] bytes of
/// printable ASCII without spaces (empty: no name).
fn checked_name(what: &str, name: &[u8]) -> Result<(), Reply> {
    if name.len() > CLIENT_NAME_BYTES_MAX {
        return Err(Reply::err(format!(
            "a {what} of {} bytes is over the limit of {CLIENT_NAME_BYTES_MAX}",
            name.len()
        )));
    }
    if !name.iter().all(|b| (0x21..0x7f).contains(b)) {
        return Err(Reply::err(format!(
            "a {what} may hold only printable ASCII, without spaces or newlines"
        )));
    }
    Ok(())
}

/// What a SET does with the key's deadline when it leaves the value there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    /// No option: the key has no deadline afterwards.
    Clear,
    /// `KEEPTTL`: the deadline it had stays.
    Keep,
    /// `EX`, `PX`, `EXAT`, `PXAT`: this deadline, in Unix milliseconds.
    At(u64),
}

/// The options of one SET.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SetOptions {
    nx: bool,
    xx: bool,
    get: bool,
    expiry: Expiry,
}

/// Reads `[NX|XX] [GET] [EX s|PX ms|EXAT unix-s|PXAT unix-ms|KEEPTTL]`, in any order, as Redis
/// does: one condition, one expiry, a positive time that does not overflow.
fn set_options(options: &[Vec<u8>], now_ms: u64) -> Result<SetOptions, Reply> {
    let syntax = || Reply::err("syntax error");
    let mut o = SetOptions { nx: false, xx: false, get: false, expiry: Expiry::Clear };
    let mut expiry_given = false;
    let mut words = options.iter();
    while let Some(word) = words.next() {
        let upper = word.to_ascii_uppercase();
        match upper.as_slice() {
            b"NX" if !o.xx => o.nx = true,
            b"XX" if !o.nx => o.xx = true,
            b"GET" => o.get = true,
            b"KEEPTTL" if !expiry_given => {
                expiry_given = true;
                o.expiry = Expiry::Keep;
            }
            b"EX" | b"PX" | b"EXAT" | b"PXAT" if !expiry_given => {
                let time = words.next().ok_or_else(syntax)?;
                let time = parse_int(time)
                    .ok_or_else(|| Reply::err("value is not an integer or out of range"))?;
                let time = u64::try_from(time)
                    .ok()
                    .filter(|&t| t > 0)
                    .ok_or_else(|| Reply::err(INVALID_EXPIRE_TEXT))?;
                let at = match upper.as_slice() {
                    b"EX" => time.checked_mul(1000).and_then(|ms| now_ms.checked_add(ms)),
                    b"PX" => now_ms.checked_add(time),
                    b"EXAT" => time.checked_mul(1000),
                    _ => Some(time),
                };
                expiry_given = true;
                o.expiry = Expiry::At(at.ok_or_else(|| Reply::err(INVALID_EXPIRE_TEXT))?);
            }
            _ => return Err(syntax()),
        }
    }
    Ok(o)
}

/// Queues `args` (a command named `upper` in upper case) in an open transaction: `+QUEUED`, or
/// an error that makes the transaction's `EXEC` abort.
fn queue(transaction: &mut Transaction, upper: &[u8], args: &[Vec<u8>]) -> Reply {
    if !COMMANDS.contains(&upper) {
        transaction.aborted = true;
        return Reply::err(format!("unknown command '{}'", shown(&args[0])));
    }
    let bytes: usize = args.iter().map(Vec::len).sum();
    if transaction.commands.len() >= TRANSACTION_COMMANDS_MAX
        || transaction.bytes + bytes > TRANSACTION_BYTES_MAX
    {
        transaction.aborted = true;
        return Reply::err(format!(
            "transaction too large: at most {TRANSACTION_COMMANDS_MAX} commands and \
             {TRANSACTION_BYTES_MAX} bytes of arguments"
        ));
    }
    transaction.bytes += bytes;
    transaction.commands.push(args.to_vec());
    Reply::Simple("QUEUED".to_owned())
}

fn arity(name: &str) -> Reply {
    Reply::err(format!("wrong number of arguments for '{name}' command"))
}

/// Why SET did not leave the value under the key.
enum NotStored {
    /// Another value is there (or, with NX, any value).
    Exists,
    /// With XX: no value is there.
    Absent,
    Reply(Reply),
}

impl Session<'_> {
    fn execute(&self, args: &[Vec<u8>]) -> (Reply, Then) {
        let Some((name, rest)) = args.split_first() else {
            return (Reply::err("empty command"), Then::Continue);
        };
        let upper = name.to_ascii_uppercase();
        if !self.authenticated.get() && !matches!(upper.as_slice(), b"AUTH" | b"HELLO" | b"QUIT") {
            return (Reply::Error(NOAUTH_TEXT.into()), Then::Continue);
        }
        match upper.as_slice() {
            b"MULTI" => return (self.multi(rest), Then::Continue),
            b"EXEC" => return self.exec(rest),
            b"DISCARD" => return (self.discard(rest), Then::Continue),
            b"WATCH" | b"UNWATCH" => {
                return (Reply::err(format!("{} is not supported", shown(name))), Then::Continue);
            }
            _ => {}
        }
        if upper.as_slice() != b"QUIT"
            && let Some(queued) = self.transaction.borrow_mut().as_mut()
        {
            return (queue(queued, &upper, args), Then::Continue);
        }
        let _shared = self.shared.transactions.read().unwrap_or_else(PoisonError::into_inner);
        self.run(name, &upper, rest)
    }

    /// `MULTI`: opens a transaction.
    fn multi(&self, rest: &[Vec<u8>]) -> Reply {
        if !rest.is_empty() {
            return arity("multi");
        }
        let mut open = self.transaction.borrow_mut();
        if open.is_some() {
            return Reply::err("MULTI calls can not be nested");
        }
        *open = Some(Transaction::default());
        Reply::ok()
    }

    /// `DISCARD`: drops the open transaction's commands.
    fn discard(&self, rest: &[Vec<u8>]) -> Reply {
        if !rest.is_empty() {
            return arity("discard");
        }
        match self.transaction.borrow_mut().take() {
            Some(_) => Reply::ok(),
            None => Reply::err("DISCARD without MULTI"),
        }
    }

    /// `EXEC`: runs the open transaction's commands in order, with no other RESP command in
    /// between, and answers their replies.
    fn exec(&self, rest: &[Vec<u8>]) -> (Reply, Then) {
        if !rest.is_empty() {
            return (arity("exec"), Then::Continue);
        }
        let Some(transaction) = self.transaction.borrow_mut().take() else {
            return (Reply::err("EXEC without MULTI"), Then::Continue);
        };
        if transaction.aborted {
            let text = "EXECABORT Transaction discarded because of previous errors.";
            return (Reply::Error(text.into()), Then::Continue);
        }
        let _alone = self.shared.transactions.write().unwrap_or_else(PoisonError::into_inner);
        // QUIT is never queued, so no queued command closes the connection.
        let replies = transaction
            .commands
            .iter()
            .filter_map(|args| args.split_first())
            .map(|(name, rest)| self.run(name, &name.to_ascii_uppercase(), rest).0)
            .collect();
        (Reply::Array(replies), Then::Continue)
    }

    /// Runs one command (`upper` is its name in upper case) outside any transaction logic.
    fn run(&self, name: &[u8], upper: &[u8], rest: &[Vec<u8>]) -> (Reply, Then) {
        let reply = match upper {
            b"AUTH" => self.auth(rest),
            b"HELLO" => self.hello(rest),
            b"CLIENT" => self.client(rest),
            b"PING" => match rest {
                [] => Reply::Simple("PONG".to_owned()),
                [message] => Reply::Bulk(message.clone()),
                _ => arity("ping"),
            },
            b"GET" => match rest {
                [key] => self.get(key).unwrap_or_else(|r| r),
                _ => arity("get"),
            },
            b"SET" => self.set(rest),
            b"TTL" | b"PTTL" => match rest {
                [key] => self.ttl(key, upper == b"PTTL").unwrap_or_else(|r| r),
                _ => arity(&String::from_utf8_lossy(&name.to_ascii_lowercase())),
            },
            b"EXISTS" if !rest.is_empty() => self.count(rest, |s, k| s.exists(k)),
            b"DEL" if !rest.is_empty() => self.count(rest, |s, k| s.del(k)),
            b"MGET" if !rest.is_empty() => self.mget(rest),
            b"MSET" if !rest.is_empty() && rest.len().is_multiple_of(2) => self.mset(rest),
            b"EXISTS" | b"DEL" | b"MGET" | b"MSET" => {
                arity(&String::from_utf8_lossy(&name.to_ascii_lowercase()))
            }
            b"INFO" => self.info(rest),
            b"COMMAND" => match rest.first() {
                Some(sub) if sub.eq_ignore_ascii_case(b"COUNT") => Reply::Integer(0),
                // Command docs are a map (an empty one: there are none).
                Some(sub) if sub.eq_ignore_ascii_case(b"DOCS") => Reply::Map(Vec::new()),
                _ => Reply::Array(Vec::new()),
            },
            b"CONFIG" => config(rest),
            b"SELECT" => match rest {
                [db] => match parse_int(db) {
                    Some(0) => Reply::ok(),
                    Some(_) => Reply::err("DB index is out of range"),
                    None => Reply::err("value is not an integer or out of range"),
                },
                _ => arity("select"),
            },
            b"QUIT" => return (Reply::ok(), Then::Close),
            _ => Reply::err(format!("unknown command '{}'", shown(name))),
        };
        (reply, Then::Continue)
    }

    /// `AUTH <key-id> <hex secret>` or `AUTH <key-id>:<hex secret>` against the tenant's keys
    /// in force (re-read when the key file changed; an expired key is refused).
    fn auth(&self, rest: &[Vec<u8>]) -> Reply {
        let Some(keys) = &self.shared.config.auth else {
            return Reply::err(
                "AUTH <password> called without any password configured for the default user",
            );
        };
        let (id, hex) = match rest {
            [user, pass] => (&user[..], &pass[..]),
            [joined] => match joined.iter().position(|b| *b == b':') {
                Some(at) => (&joined[..at], &joined[at + 1..]),
                None => return Reply::Error(WRONGPASS_TEXT.into()),
            },
            _ => return arity("auth"),
        };
        self.check_key(keys, id, hex)
    }

    /// Authenticates the connection when `id` names a key of the tenant in force whose secret
    /// is the hex `hex`: `+OK`, else `-WRONGPASS` and nothing changes.
    fn check_key(&self, keys: &TenantKeys, id: &[u8], hex: &[u8]) -> Reply {
        let id = String::from_utf8_lossy(id);
        let offered = std::str::from_utf8(hex).ok().and_then(unhex);
        let now_ms = self.shared.config.clock.now_ms();
        let good = match (keys.find(&id), offered) {
            (Some(key), Some(offered)) => {
                !key.expired(now_ms) && bool::from(key.secret.bytes().ct_eq(&offered[..]))
            }
            _ => false,
        };
        if good {
            self.authenticated.set(true);
            Reply::ok()
        } else {
            Reply::Error(WRONGPASS_TEXT.into())
        }
    }

    /// `HELLO [protover [AUTH key-id hex-secret] [SETNAME name]]`: checks everything first, so
    /// that a refused HELLO changes nothing; then authenticates, switches the reply protocol and
    /// names the connection, and answers who the server is (a map in RESP3, a flat array of
    /// field-value pairs in RESP2).
    fn hello(&self, rest: &[Vec<u8>]) -> Reply {
        let mut version = self.version.get();
        let mut credentials: Option<(&[u8], &[u8])> = None;
        let mut setname: Option<&[u8]> = None;
        if let Some((protover, mut options)) = rest.split_first() {
            let Some(number) = parse_int(protover) else {
                return Reply::err("protocol version is not an integer or out of range");
            };
            let Some(asked) = RespVersion::from_number(number) else {
                return Reply::Error(NOPROTO_TEXT.into());
            };
            version = asked;
            while let Some((option, after)) = options.split_first() {
                let syntax =
                    || Reply::err(format!("syntax error in HELLO option '{}'", shown(option)));
                if option.eq_ignore_ascii_case(b"AUTH") {
                    let [user, pass, more @ ..] = after else { return syntax() };
                    credentials = Some((user, pass));
                    options = more;
                } else if option.eq_ignore_ascii_case(b"SETNAME") {
                    let [name, more @ ..] = after else { return syntax() };
                    if let Err(r) = checked_name("client name", name) {
                        return r;
                    }
                    setname = Some(name);
                    options = more;
                } else {
                    return syntax();
                }
            }
        }
        match (credentials, &self.shared.config.auth) {
            (Some((user, pass)), Some(keys)) => {
                let answer = self.check_key(keys, user, pass);
                if answer != Reply::ok() {
                    return answer;
                }
            }
            (Some(_), None) => return self.auth(&[]),
            (None, _) if !self.authenticated.get() => {
                return Reply::Error(HELLO_NOAUTH_TEXT.into());
            }
            (None, _) => {}
        }
        self.version.set(version);
        if let Some(name) = setname {
            *self.name.borrow_mut() = (!name.is_empty()).then(|| name.to_vec());
        }
        let text = |t: &str| Reply::Bulk(t.as_bytes().to_vec());
        Reply::Map(vec![
            (text("server"), text(SERVER_NAME)),
            (text("version"), text(REDIS_VERSION)),
            (text("proto"), Reply::Integer(version.number())),
            (text("id"), Reply::Integer(i64::try_from(self.id).unwrap_or(i64::MAX))),
            (text("mode"), text("standalone")),
            (text("role"), text("master")),
            (text("modules"), Reply::Array(Vec::new())),
        ])
    }

    /// `CLIENT ID | GETNAME | SETNAME name | SETINFO LIB-NAME|LIB-VER value`; any other
    /// subcommand is an error that names the ones answered.
    fn client(&self, rest: &[Vec<u8>]) -> Reply {
        let Some((sub, args)) = rest.split_first() else { return arity("client") };
        let upper = sub.to_ascii_uppercase();
        match (upper.as_slice(), args) {
            (b"ID", []) => Reply::Integer(i64::try_from(self.id).unwrap_or(i64::MAX)),
            (b"GETNAME", []) => self.name.borrow().clone().map_or(Reply::Nil, Reply::Bulk),
            (b"SETNAME", [name]) => match checked_name("client name", name) {
                Ok(()) => {
                    *self.name.borrow_mut() = (!name.is_empty()).then(|| name.clone());
                    Reply::ok()
                }
                Err(r) => r,
            },
            (b"SETINFO", [attribute, value]) => {
                let mut library = self.library.borrow_mut();
                let (slot, what) = if attribute.eq_ignore_ascii_case(b"LIB-NAME") {
                    (&mut library.name, "library name")
                } else if attribute.eq_ignore_ascii_case(b"LIB-VER") {
                    (&mut library.version, "library version")
                } else {
                    return Reply::err(format!(
                        "CLIENT SETINFO attribute '{}' is not known; use LIB-NAME or LIB-VER",
                        shown(attribute)
                    ));
                };
                match checked_name(what, value) {
                    Ok(()) => {
                        *slot = (!value.is_empty()).then(|| value.clone());
                        Reply::ok()
                    }
                    Err(r) => r,
                }
            }
            (b"ID" | b"GETNAME" | b"SETNAME" | b"SETINFO", _) => {
                arity(&format!("client|{}", String::from_utf8_lossy(&sub.to_ascii_lowercase())))
            }
            _ => Reply::err(format!(
                "unknown subcommand CLIENT {}; this server answers CLIENT ID, GETNAME, SETNAME \
                 and SETINFO",
                shown(sub)
            )),
        }
    }

    fn key(&self, plain: &[u8]) -> Result<PhysicalKey, Reply> {
        self.namespace.key_for(plain).map_err(|e| Reply::err(format!("key namespace: {e}")))
    }

    /// The physical key of `plain`, and whether it is live. A key whose deadline has passed is
    /// not: it is removed from the store and its deadline forgotten (when the store cannot
    /// remove it, for a tenant without `write` say, the deadline stays and it still is not).
    fn live_key(&self, plain: &[u8]) -> Result<(PhysicalKey, bool), Reply> {
        let key = self.key(plain)?;
        let link = chain_link(plain);
        let expiries = &self.shared.expiries;
        match expiries.deadline(link) {
            Some(deadline) if deadline <= self.shared.config.clock.now_ms() => {
                match self.store.invalidate(self.caller, &key) {
                    Ok(Invalidate::Removed | Invalidate::Absent) => {
                        expiries.forget_if(link, deadline);
                    }
                    // Being written again right now: that SET sets the deadline anew.
                    Ok(Invalidate::Busy) => {}
                    Err(e) => tracing::debug!(error = %e, "an expired RESP key stays in the store"),
                }
                Ok((key, false))
            }
            _ => Ok((key, true)),
        }
    }

    /// Removes the key of `link` from the store, whose deadline was dropped from the table.
    fn remove_expired(&self, link: Digest32) {
        if let Ok(key) = self.namespace.key_for_link(link) {
            let _ = self.store.invalidate(self.caller, &key);
        }
    }

    /// GET: the value, or nil when nothing usable is there.
    fn get(&self, plain: &[u8]) -> Result<Reply, Reply> {
        let (key, live) = self.live_key(plain)?;
        if !live {
            return Ok(Reply::Nil);
        }
        Ok(self.read(&key)?.map_or(Reply::Nil, Reply::Bulk))
    }

    /// TTL (seconds, rounded) or PTTL (milliseconds): -2 for a key that holds nothing, -1 for
    /// one without a deadline.
    fn ttl(&self, plain: &[u8], millis: bool) -> Result<Reply, Reply> {
        if !self.exists(plain)? {
            return Ok(Reply::Integer(-2));
        }
        let Some(deadline) = self.shared.expiries.deadline(chain_link(plain)) else {
            return Ok(Reply::Integer(-1));
        };
        let left = deadline.saturating_sub(self.shared.config.clock.now_ms());
        let left = if millis { left } else { left.saturating_add(500) / 1000 };
        Ok(Reply::Integer(i64::try_from(left).unwrap_or(i64::MAX)))
    }

    /// The value under `key`, `None` when nothing usable is there.
    fn read(&self, key: &PhysicalKey) -> Result<Option<Vec<u8>>, Reply> {
        self.read_within(key, RACE_ATTEMPTS)
    }

    /// [`Self::read`] with `attempts` lookups at most.
    fn read_within(&self, key: &PhysicalKey, attempts: usize) -> Result<Option<Vec<u8>>, Reply> {
        for _ in 0..attempts {
            let Some(len) = looked_len(self.store.lookup(self.caller, key))? else {
                return Ok(None);
            };
            let mut value = vec![0u8; len];
            let got = self.store.get_into(self.caller, key, &mut value);
            if let Some(read) = read_value(got, value) {
                return read;
            }
        }
        Ok(None)
    }

    /// Reads `keys` with one lookup batch and one get batch: the value or `None` per key, in
    /// order, for the keys up to the one whose length takes the values together past `budget`
    /// (that one included, so that reading it finds the limit passed); the keys after it are
    /// left unread (`None` in the answer), so the buffers stay within `budget` and one value.
    fn read_batch(&self, keys: &[PhysicalKey], budget: usize) -> Vec<Option<BatchRead>> {
        let refs: Vec<&PhysicalKey> = keys.iter().collect();
        let mut reads: Vec<Option<BatchRead>> = (0..keys.len()).map(|_| None).collect();
        let mut wanted: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut total: usize = 0;
        for (i, looked) in self.store.lookup_batch(self.caller, &refs).into_iter().enumerate() {
            match looked_len(looked) {
                Err(r) => reads[i] = Some(BatchRead::Read(Err(r))),
                Ok(None) => reads[i] = Some(BatchRead::Read(Ok(None))),
                Ok(Some(len)) => {
                    wanted.push((i, vec![0u8; len]));
                    total = total.saturating_add(len);
                }
            }
            if total > budget {
                break;
            }
        }
        let mut items: Vec<BatchGet<'_>> =
            wanted.iter_mut().map(|(i, value)| BatchGet { key: &keys[*i], dst: value }).collect();
        let mut answers = self.store.get_batch(self.caller, &mut items).into_iter();
        drop(items);
        for (i, value) in wanted {
            let got = answers.next().unwrap_or_else(|| {
                Err(StoreError::Backend {
                    operation: "get",
                    detail: "the store left this key unanswered".into(),
                    retirement: gpucache_dataplane::store::Retirement::Retired,
                })
            });
            reads[i] = Some(match read_value(got, value) {
                Some(read) => BatchRead::Read(read),
                None => BatchRead::Again,
            });
        }
        reads
    }

    /// Leaves `value` under `plain`: stores it when the key is free; when the key already holds
    /// exactly these bytes, that is success too (unless `nx`), since the outcome is the same.
    /// Waits up to [`BUSY_WAIT`] for another client's write of the key to finish. The caller has
    /// removed the key first if its deadline had passed ([`Self::live_key`]).
    fn store_value(&self, plain: &[u8], value: &[u8], nx: bool) -> Result<(), NotStored> {
        if value.is_empty() {
            return Err(NotStored::Reply(Reply::err(
                "empty values cannot be stored: a block holds at least one byte",
            )));
        }
        let key = self.key(plain).map_err(NotStored::Reply)?;
        let first = self.store.put(self.caller, &key, value, None);
        self.settle(&key, value, nx, first)
    }

    /// Finishes leaving `value` under `key` (as [`Self::store_value`]) once a PUT of it has
    /// answered `first`: compares what holds the key, or stores again, as the answer requires.
    fn settle(
        &self,
        key: &PhysicalKey,
        value: &[u8],
        nx: bool,
        first: Result<Put, StoreError>,
    ) -> Result<(), NotStored> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(1);
        let mut vanished = 0;
        let mut answer = first;
        loop {
            match answer {
                Ok(Put::Committed(_)) => return Ok(()),
                Ok(Put::AlreadyCommitted) if nx => return Err(NotStored::Exists),
                Ok(Put::AlreadyCommitted) => {
                    let held = compare_held(self.store, self.caller, key, value)
                        .map_err(|e| NotStored::Reply(store_error(&e)))?;
                    match held {
                        Held::Same => return Ok(()),
                        Held::Different => return Err(NotStored::Exists),
                        // Deleted (or found corrupt and dropped) since the put: try again.
                        Held::Gone if vanished < RACE_ATTEMPTS => vanished += 1,
                        Held::Gone => return Err(NotStored::Reply(Reply::err(BUSY_TEXT))),
                    }
                }
                Ok(Put::Busy) => {
                    if started.elapsed() >= BUSY_WAIT {
                        return Err(NotStored::Reply(Reply::err(BUSY_TEXT)));
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(BUSY_PAUSE_MAX);
                }
                Ok(Put::Refused(r)) => {
                    return Err(NotStored::Reply(Reply::err(format!("refused: {r}"))));
                }
                Err(e) => return Err(NotStored::Reply(store_error(&e))),
            }
            answer = self.store.put(self.caller, key, value, None);
        }
    }

    /// SET with its options. The store is create-only, so XX never stores: a key it finds
    /// either holds these bytes already (`+OK`) or other bytes it cannot replace (an error),
    /// and a missing one answers nil. GET reads the value held before the SET.
    fn set(&self, args: &[Vec<u8>]) -> Reply {
        let [plain, value, options @ ..] = args else { return arity("set") };
        let now_ms = self.shared.config.clock.now_ms();
        let o = match set_options(options, now_ms) {
            Ok(o) => o,
            Err(r) => return r,
        };
        // A key past its deadline is removed first, so that it is free for this SET.
        if let Err(r) = self.live_key(plain) {
            return r;
        }
        let old = if o.get {
            match self.get(plain) {
                Ok(old) => old,
                Err(r) => return r,
            }
        } else {
            Reply::Nil
        };
        let link = chain_link(plain);
        let expiries = &self.shared.expiries;
        // Take the deadline's place in the table before storing, so that a value is never
        // stored without the deadline it was asked with; put the old one back if not stored.
        let previous = match o.expiry {
            Expiry::At(at) => {
                match expiries.set(link, at, now_ms, |swept| self.remove_expired(swept)) {
                    Ok(previous) => Some(previous),
                    Err(ExpiriesFull) => {
                        return Reply::err(format!(
                            "{} keys already have a deadline, the most this \
                             server tracks; SET without EX/PX/EXAT/PXAT, or DEL some",
                            expiries.max
                        ));
                    }
                }
            }
            Expiry::Clear | Expiry::Keep => None,
        };
        let stored = if o.xx {
            self.replace_only(plain, value)
        } else {
            self.store_value(plain, value, o.nx)
        };
        match stored {
            Ok(()) => {
                if o.expiry == Expiry::Clear {
                    expiries.forget(link);
                }
                if o.get { old } else { Reply::ok() }
            }
            Err(not_stored) => {
                if let (Some(previous), Expiry::At(at)) = (previous, o.expiry) {
                    expiries.restore(link, at, previous);
                }
                match not_stored {
                    // NX found a value, XX none: nothing to do, and GET answers what is there.
                    NotStored::Exists if o.nx => old,
                    NotStored::Absent => old,
                    NotStored::Exists => Reply::err(exists_text()),
                    NotStored::Reply(r) => r,
                }
            }
        }
    }

    /// SET XX: what holds the key decides; nothing is ever stored. The caller has removed the
    /// key first if its deadline had passed ([`Self::live_key`]).
    fn replace_only(&self, plain: &[u8], value: &[u8]) -> Result<(), NotStored> {
        let key = self.key(plain).map_err(NotStored::Reply)?;
        match compare_held(self.store, self.caller, &key, value) {
            Ok(Held::Same) => Ok(()),
            Ok(Held::Different) => Err(NotStored::Exists),
            Ok(Held::Gone) => Err(NotStored::Absent),
            Err(e) => Err(NotStored::Reply(store_error(&e))),
        }
    }

    fn exists(&self, plain: &[u8]) -> Result<bool, Reply> {
        let (key, live) = self.live_key(plain)?;
        if !live {
            return Ok(false);
        }
        match self.store.lookup(self.caller, &key) {
            Ok(Lookup::Hit { .. }) => Ok(true),
            Ok(Lookup::PrefixHit { .. } | Lookup::Miss(_)) => Ok(false),
            Err(e) => Err(store_error(&e)),
        }
    }

    fn del(&self, plain: &[u8]) -> Result<bool, Reply> {
        let (key, live) = self.live_key(plain)?;
        if !live {
            return Ok(false);
        }
        match self.store.invalidate(self.caller, &key) {
            Ok(Invalidate::Removed) => {
                self.shared.expiries.forget(chain_link(plain));
                Ok(true)
            }
            Ok(Invalidate::Absent | Invalidate::Busy) => Ok(false),
            Err(e) => Err(store_error(&e)),
        }
    }

    /// How many keys `check` says yes to; the first error answers instead.
    fn count(
        &self,
        keys: &[Vec<u8>],
        check: impl Fn(&Self, &[u8]) -> Result<bool, Reply>,
    ) -> Reply {
        let mut n: i64 = 0;
        for key in keys {
            match check(self, key) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(r) => return r,
            }
        }
        Reply::Integer(n)
    }

    /// MGET: one value or nil per key. The values together may be as large as one request may
    /// be, so that a reply cannot grow without bound. The keys are read as one lookup batch and
    /// one get batch; the answer is what reading them one by one, in order, answers (the first
    /// key that fails, or passes the limit, answers instead). A key read again because its
    /// value changed under the batch, or one past the limit, is read on its own.
    fn mget(&self, keys: &[Vec<u8>]) -> Reply {
        let max = self.shared.config.limits.request_bytes_max;
        // The keys up to the first that does not map into the namespace: that one answers
        // once every key before it has been read.
        let mut physical = Vec::with_capacity(keys.len());
        let mut live = Vec::with_capacity(keys.len());
        let mut refused = None;
        for plain in keys {
            match self.live_key(plain) {
                Ok((key, is_live)) => {
                    physical.push(key);
                    live.push(is_live);
                }
                Err(r) => {
                    refused = Some(r);
                    break;
                }
            }
        }
        let reads = self.read_batch(&physical, max);
        let mut values = Vec::with_capacity(keys.len());
        let mut total: usize = 0;
        for ((key, read), is_live) in physical.iter().zip(reads).zip(live) {
            let value = match read {
                // Expired, but the store could not remove it.
                _ if !is_live => Ok(None),
                Some(BatchRead::Read(read)) => read,
                Some(BatchRead::Again) => self.read_within(key, RACE_ATTEMPTS - 1),
                None => self.read(key),
            };
            match value {
                Ok(Some(v)) => {
                    total += v.len();
                    if total > max {
                        return Reply::err(format!(
                            "MGET values exceed {max} bytes together; ask for fewer keys"
                        ));
                    }
                    values.push(Reply::Bulk(v));
                }
                Ok(None) => values.push(Reply::Nil),
                Err(r) => return r,
            }
        }
        if let Some(r) = refused {
            return r;
        }
        Reply::Array(values)
    }

    /// MSET: stores pairs in order, each as SET would; stops at the first one not stored. The
    /// keys are looked up as one batch first; each run of pairs whose keys are free then goes to
    /// the store as one put batch, and a pair whose key is not free (or whose value or key is
    /// refused before the store is asked) is stored as SET stores it, on its own. So the pairs
    /// after one that is not stored are not tried, unless they went to the store in the same
    /// batch (its key taken or the store refusing it after the lookup), which the answer says.
    fn mset(&self, args: &[Vec<u8>]) -> Reply {
        let pairs: Vec<(&[u8], &[u8])> =
            args.chunks_exact(2).map(|p| (&p[0][..], &p[1][..])).collect();
        // The keys of the pairs up to the first the store would not be asked about.
        let keys: Vec<PhysicalKey> = pairs
            .iter()
            .map_while(|(plain, value)| {
                (!value.is_empty()).then(|| self.live_key(plain).ok().map(|(k, _)| k)).flatten()
            })
            .collect();
        let refs: Vec<&PhysicalKey> = keys.iter().collect();
        let free: Vec<bool> = if refs.is_empty() {
            Vec::new()
        } else {
            let looked = self.store.lookup_batch(self.caller, &refs);
            looked.iter().map(|l| matches!(l, Ok(Lookup::Miss(MissReason::Absent)))).collect()
        };
        let mut i = 0;
        while i < pairs.len() {
            let run = (i..keys.len()).take_while(|&j| free.get(j) == Some(&true)).count();
            if run == 0 {
                if let Err(why) = self.store_value(pairs[i].0, pairs[i].1, false) {
                    return mset_stopped(&pairs, i, why, None);
                }
                // Like SET without an expiry, MSET leaves its keys without a deadline.
                self.shared.expiries.forget(chain_link(pairs[i].0));
                i += 1;
                continue;
            }
            let batch: Vec<BatchPut<'_>> = (i..i + run)
                .map(|j| BatchPut { key: &keys[j], src: pairs[j].1, request: None })
                .collect();
            let mut answers: Vec<Option<Result<Put, StoreError>>> =
                self.store.put_batch(self.caller, &batch).into_iter().map(Some).collect();
            answers.resize_with(run, || None);
            for j in i..i + run {
                let answer = answers[j - i].take().unwrap_or_else(|| {
                    Err(StoreError::Backend {
                        operation: "put",
                        detail: "the store left this pair unanswered".into(),
                        retirement: gpucache_dataplane::store::Retirement::Retired,
                    })
                });
                if let Err(why) = self.settle(&keys[j], pairs[j].1, false, answer) {
                    let later = &answers[j + 1 - i..];
                    let mut stored = 0;
                    for (k, a) in (j + 1..).zip(later) {
                        if matches!(a, Some(Ok(Put::Committed(_)))) {
                            self.shared.expiries.forget(chain_link(pairs[k].0));
                            stored += 1;
                        }
                    }
                    return mset_stopped(&pairs, j, why, Some((i + run, stored)));
                }
                self.shared.expiries.forget(chain_link(pairs[j].0));
            }
            i += run;
        }
        Reply::ok()
    }

    fn info(&self, sections: &[Vec<u8>]) -> Reply {
        let everything = sections.is_empty()
            || sections.iter().any(|s| {
                [&b"all"[..], b"everything", b"default"].iter().any(|a| s.eq_ignore_ascii_case(a))
            });
        let wanted = |name: &str| {
            everything || sections.iter().any(|s| s.eq_ignore_ascii_case(name.as_bytes()))
        };
        let info = self.store.info();
        let stats = self.store.stats();
        let mut text = String::new();
        // Writing to a String cannot fail.
        if wanted("server") {
            let implementation = match info.implementation {
                Implementation::Real => "real".to_owned(),
                Implementation::Simulated { seed } => format!("simulated(seed={seed})"),
            };
            let _ = write!(
                text,
                "# Server\r\nredis_version:{REDIS_VERSION}\r\nredis_mode:standalone\r\n\
                 gpucache_version:{}\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\n\
                 gpucache_store:{}\r\ngpucache_store_implementation:{implementation}\r\n\
                 gpucache_epoch:{}\r\ngpucache_tenant:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                std::process::id(),
                self.shared.port,
                self.shared.started.elapsed().as_secs(),
                info.name,
                self.store.epoch().0,
                self.caller.tenant,
            );
        }
        if wanted("clients") {
            let _ = write!(
                text,
                "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n\r\n",
                self.shared.gate.open.load(Ordering::Acquire),
                self.shared.config.connections_max,
            );
        }
        if wanted("stats") {
            let u = stats.usage;
            let r = stats.regions;
            let _ = write!(
                text,
                "# Stats\r\ncommitted_blocks:{}\r\ncorrupt_dropped:{}\r\nevicted_keys:{}\r\n\
                 retained_bytes:{}\r\ninflight_requests:{}\r\nregistrations:{}\r\n\
                 tenants_active:{}\r\nquarantined_regions:{}\r\nquarantined_bytes:{}\r\n\r\n",
                stats.committed_blocks,
                stats.corrupt_dropped.total(),
                stats.evictions,
                u.retained_bytes,
                u.inflight_requests,
                u.registrations,
                u.tenants,
                r.quarantined,
                r.quarantined_bytes,
            );
        }
        if wanted("keyspace") {
            let _ = write!(
                text,
                "# Keyspace\r\ndb0:keys={},expires={},avg_ttl=0\r\n\r\n",
                stats.committed_blocks,
                self.shared.expiries.len(),
            );
        }
        Reply::Verbatim(text)
    }
}

/// CONFIG GET answers the two settings redis-benchmark asks about (no RDB snapshots, no
/// append-only file: those are Redis' persistence, not the store's) and nothing else.
fn config(args: &[Vec<u8>]) -> Reply {
    let Some((sub, params)) = args.split_first() else { return arity("config") };
    if !sub.eq_ignore_ascii_case(b"GET") {
        return Reply::err(format!("CONFIG {} is not supported; only CONFIG GET", shown(sub)));
    }
    if params.is_empty() {
        return arity("config|get");
    }
    let mut pairs = Vec::new();
    for (name, value) in [("save", ""), ("appendonly", "no")] {
        if params.iter().any(|p| p.eq_ignore_ascii_case(name.as_bytes())) {
            pairs.push((
                Reply::Bulk(name.as_bytes().to_vec()),
                Reply::Bulk(value.as_bytes().to_vec()),
            ));
        }
    }
    Reply::Map(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_dataplane::clock::MonotonicClock;
    use gpucache_dataplane::limits::ResourceLimits;
    use gpucache_dataplane::testing::fixture;
    use gpucache_storage::MemoryStore;
    use std::io::Read;

    #[test]
    fn plain_keys_map_into_the_tenant_namespace() {
        let ns = IdentityTemplate::for_tenant(&fixture::tenant(0)).expect("namespace");
        let a = ns.key_for(b"alpha").expect("key");
        assert_eq!(a, ns.key_for(b"alpha").expect("key"));
        assert_ne!(a, ns.key_for(b"alpha ").expect("key"));
        assert_eq!(a.identity().chain(), &[chain_link(b"alpha")]);
        assert_eq!(a.identity().block_tokens(), 1);
        assert_eq!(a.identity().valid_tokens(), 1);
        assert_eq!(a.tenant(), &fixture::tenant(0));
        let other = IdentityTemplate::for_tenant(&fixture::tenant(1)).expect("namespace");
        assert_ne!(a, other.key_for(b"alpha").expect("key"));
    }

    fn exchange(stream: &mut TcpStream, request: &[u8], reply_len: usize) -> Vec<u8> {
        stream.write_all(request).expect("send");
        let mut reply = vec![0u8; reply_len];
        stream.read_exact(&mut reply).expect("reply");
        reply
    }

    /// A block whose stored bytes were damaged reads as nil (the store drops it).
    #[test]
    fn a_corrupt_value_reads_as_nil() {
        let store = Arc::new(
            MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
                .expect("store"),
        );
        let config = RespConfig::new("127.0.0.1:0".parse().expect("addr"), fixture::caller(0))
            .expect("config");
        let namespace = config.namespace.clone();
        let server = RespServer::start(config, store.clone()).expect("start");
        let mut s = TcpStream::connect(server.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        assert_eq!(
            exchange(&mut s, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n", 5),
            b"+OK\r\n"
        );
        assert_eq!(exchange(&mut s, b"GET k\r\n", 11), b"$5\r\nhello\r\n");
        let key = namespace.key_for(b"k").expect("key");
        assert!(store.corrupt_for_test(&key, 2));
        assert_eq!(exchange(&mut s, b"GET k\r\n", 5), b"$-1\r\n");
        assert_eq!(exchange(&mut s, b"EXISTS k\r\n", 4), b":0\r\n");
        assert_eq!(store.stats().corrupt_dropped.total(), 1);
        // The key is free again.
        assert_eq!(exchange(&mut s, b"SET k again\r\n", 5), b"+OK\r\n");
        assert_eq!(server.shutdown(), 0);
    }

    /// A server over a memory store whose tenant has two keys of the secret `byte` x 32: `k1`,
    /// and `old`, expired long ago; and that secret in hex.
    fn server_with_keys(byte: u8) -> (RespServer, String) {
        server_with_keys_bounded(byte, Arc::default())
    }

    fn server_with_keys_bounded(byte: u8, guard: Arc<Guard>) -> (RespServer, String) {
        use crate::auth::{Secret, TenantKey, TenantKeys};
        let store = Arc::new(
            MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
                .expect("store"),
        );
        let secret = vec![byte; 32];
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        let key = |id: &str, not_after_s| TenantKey {
            id: id.into(),
            secret: Secret::new(secret.clone()).expect("secret"),
            not_after_s,
        };
        let keys = TenantKeys::fixed(vec![key("k1", None), key("old", Some(1))]).expect("keys");
        let mut config = RespConfig::new("127.0.0.1:0".parse().expect("addr"), fixture::caller(0))
            .expect("config");
        config.auth = Some(Arc::new(keys));
        config.guard = guard;
        (RespServer::start(config, store).expect("start"), hex)
    }

    /// Before AUTH a connection of a tenant with keys may buffer 64 KiB at most, and must
    /// authenticate within the AUTH deadline; an authenticated one has no such deadline.
    #[test]
    fn unauthenticated_connections_are_bounded_in_bytes_and_time() {
        use crate::bounds::ConnectionBounds;
        let bounds = ConnectionBounds {
            hello_timeout: Duration::from_millis(300),
            ..ConnectionBounds::default()
        };
        let guard = Arc::new(Guard::new(bounds));
        let (server, hex) = server_with_keys_bounded(0x5b, Arc::clone(&guard));
        let connect = || {
            let s = TcpStream::connect(server.local_addr()).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            s
        };
        let mut big = connect();
        let mut request = Vec::new();
        encode_request(&[b"SET".as_slice(), b"k", &vec![b'v'; 100 << 10]], &mut request);
        // The server may close before it has read everything: a failed write is expected.
        let _ = big.write_all(&request);
        let mut reply = String::new();
        let _ = big.read_to_string(&mut reply);
        assert!(reply.starts_with("-ERR ") && reply.contains("before AUTH"), "{reply:?}");

        let started = Instant::now();
        let mut silent = connect();
        let mut rest = Vec::new();
        assert_eq!(silent.read_to_end(&mut rest).expect("closed by the server"), 0);
        assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());

        let mut authed = connect();
        authed.write_all(format!("AUTH k1 {hex}\r\n").as_bytes()).expect("auth");
        let mut ok = [0u8; 5];
        authed.read_exact(&mut ok).expect("auth answer");
        assert_eq!(&ok, b"+OK\r\n");
        // Past the AUTH deadline the authenticated connection still answers.
        let after = Instant::now() + Duration::from_millis(600);
        while Instant::now() < after {
            authed.write_all(b"PING\r\n").expect("ping");
            let mut pong = [0u8; 7];
            authed.read_exact(&mut pong).expect("pong");
            assert_eq!(&pong, b"+PONG\r\n");
        }
        let counted = |reason| guard.refusals().get(Front::Resp, reason);
        assert_eq!((counted(Reason::Oversize), counted(Reason::HelloTimeout)), (1, 1));
        assert_eq!(guard.body_bytes_in_flight(), 0);
        drop(authed);
        server.shutdown();
    }

    /// A tenant with keys: nothing but AUTH, HELLO and QUIT before a good AUTH; wrong, unknown and
    /// expired keys are refused alike; each connection authenticates for itself.
    #[test]
    fn a_tenant_with_keys_needs_auth() {
        let (server, hex) = server_with_keys(0x5a);
        let connect = || {
            let s = TcpStream::connect(server.local_addr()).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            s
        };
        let noauth = format!("-{NOAUTH_TEXT}\r\n");
        let wrongpass = format!("-{WRONGPASS_TEXT}\r\n");
        let mut s = connect();
        assert_eq!(exchange(&mut s, b"GET k\r\n", noauth.len()), noauth.as_bytes());
        assert_eq!(exchange(&mut s, b"PING\r\n", noauth.len()), noauth.as_bytes());
        let wrong = format!("AUTH k1 {}\r\n", "00".repeat(32));
        assert_eq!(exchange(&mut s, wrong.as_bytes(), wrongpass.len()), wrongpass.as_bytes());
        let unknown = format!("AUTH nobody {hex}\r\n");
        assert_eq!(exchange(&mut s, unknown.as_bytes(), wrongpass.len()), wrongpass.as_bytes());
        let expired = format!("AUTH old {hex}\r\n");
        assert_eq!(exchange(&mut s, expired.as_bytes(), wrongpass.len()), wrongpass.as_bytes());
        assert_eq!(exchange(&mut s, b"GET k\r\n", noauth.len()), noauth.as_bytes());
        let good = format!("AUTH k1 {hex}\r\n");
        assert_eq!(exchange(&mut s, good.as_bytes(), 5), b"+OK\r\n");
        assert_eq!(exchange(&mut s, b"SET k v\r\n", 5), b"+OK\r\n");
        assert_eq!(exchange(&mut s, b"GET k\r\n", 7), b"$1\r\nv\r\n");
        // Another connection starts unauthenticated; the `id:secret` form works too.
        let mut t = connect();
        assert_eq!(exchange(&mut t, b"GET k\r\n", noauth.len()), noauth.as_bytes());
        let joined = format!("AUTH k1:{hex}\r\n");
        assert_eq!(exchange(&mut t, joined.as_bytes(), 5), b"+OK\r\n");
        assert_eq!(exchange(&mut t, b"GET k\r\n", 7), b"$1\r\nv\r\n");
        assert_eq!(server.shutdown(), 0);
    }

    /// AUTH inside HELLO, as redis-py sends it for a client with a username and password: the
    /// same keys and failures as AUTH; a refused HELLO neither authenticates nor switches the
    /// protocol.
    #[test]
    fn hello_authenticates_with_a_tenant_key() {
        let (server, hex) = server_with_keys(0xa5);
        let mut s = TcpStream::connect(server.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let request = |words: &[&str]| {
            let mut out = Vec::new();
            encode_request(words, &mut out);
            out
        };
        let noauth = format!("-{HELLO_NOAUTH_TEXT}\r\n");
        let wrongpass = format!("-{WRONGPASS_TEXT}\r\n");
        assert_eq!(exchange(&mut s, &request(&["HELLO", "3"]), noauth.len()), noauth.as_bytes());
        assert_eq!(exchange(&mut s, &request(&["HELLO"]), noauth.len()), noauth.as_bytes());
        for (user, pass) in [("k1", "00".repeat(32)), ("nobody", hex.clone()), ("old", hex.clone())]
        {
            let hello = request(&["HELLO", "3", "AUTH", user, &pass, "SETNAME", "x"]);
            assert_eq!(exchange(&mut s, &hello, wrongpass.len()), wrongpass.as_bytes(), "{user}");
        }
        let noauth_get = format!("-{NOAUTH_TEXT}\r\n");
        assert_eq!(exchange(&mut s, b"GET k\r\n", noauth_get.len()), noauth_get.as_bytes());
        let good = request(&["HELLO", "3", "AUTH", "k1", &hex, "SETNAME", "app"]);
        let want = format!(
            "%7\r\n$6\r\nserver\r\n$8\r\ngpucache\r\n$7\r\nversion\r\n$5\r\n{REDIS_VERSION}\r\n\
             $5\r\nproto\r\n:3\r\n$2\r\nid\r\n:1\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n\
             $4\r\nrole\r\n$6\r\nmaster\r\n$7\r\nmodules\r\n*0\r\n"
        );
        assert_eq!(String::from_utf8_lossy(&exchange(&mut s, &good, want.len())), want);
        assert_eq!(exchange(&mut s, b"GET k\r\n", 3), b"_\r\n");
        assert_eq!(exchange(&mut s, b"CLIENT GETNAME\r\n", 9), b"$3\r\napp\r\n");
        // Once authenticated, HELLO needs no AUTH.
        let two = exchange(&mut s, &request(&["HELLO", "2"]), 5);
        assert_eq!(two, b"*14\r\n");
        assert_eq!(server.shutdown(), 0);
    }
}
