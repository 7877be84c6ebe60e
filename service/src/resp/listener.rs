//! The RESP listener: binding and accepting connections, and the loop that reads one
//! connection's requests, runs them and writes the replies within the configured bounds.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use gpucache_dataplane::store::Store;
use gpucache_wire::resp::{Reply, RequestDecoder, RespVersion};

use crate::bounds::{Deadlines, Front, Guard, Reason, UNAUTHENTICATED_REQUEST_BYTES_MAX};
use crate::listener::{
    Acceptor, AcceptorConfig, DeadlineWriter, Gate, ReadTick, TurnedAway, close_after, read_tick,
};

use super::config::RespConfig;
use super::expiry::Expiries;
use super::session::{Library, RespSession, Shared, Then};

/// How often a blocked read wakes to check for shutdown and idleness.
const READ_TICK: Duration = Duration::from_millis(100);
/// Bytes read from a socket per call.
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Buffered replies are written out once they reach this size.
const REPLY_FLUSH_BYTES: usize = 256 << 10;
/// Buffers grown past this by one large request or reply are given back afterwards.
const BUFFER_KEEP_BYTES: usize = 4 << 20;

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
    let session = RespSession {
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
