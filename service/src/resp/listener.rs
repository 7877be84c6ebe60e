//! The RESP listener: binding and accepting connections, and the loop that reads one
//! connection's requests, runs them and writes the replies within the configured bounds.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::TcpStream;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use gpucache_dataplane::store::Store;
use gpucache_wire::resp::{Reply, RequestDecoder, RespVersion};

use crate::bounds::{BodyCharge, Front, Reason, UNAUTHENTICATED_REQUEST_BYTES_MAX};
use crate::connection::Gate;
use crate::connection::{
    Close, DeadlineWriter, Drive, Protocol, READ_CHUNK_BYTES, close_after, drive,
};
use crate::listener::{Acceptor, AcceptorConfig, TurnedAway};

use super::config::RespConfig;
use super::expiry::Expiries;
use super::session::{Library, RespSession, Shared, Then};

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
                connections_max,
                shutdown_deadline,
                guard: Some((guard, Front::Resp)),
                refuse: |why: TurnedAway| match why {
                    TurnedAway::ConnectionsMax { .. } => {
                        b"-ERR max number of clients reached\r\n".to_vec()
                    }
                    TurnedAway::PerPeer { open, max } => format!(
                        "-ERR max number of clients reached for this address ({open} of \
                         {max})\r\n"
                    )
                    .into_bytes(),
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

/// One RESP connection as [`drive`] serves it.
struct Resp<'a> {
    session: RespSession<'a>,
    shared: &'a Shared,
    peer: Option<IpAddr>,
    decoder: RequestDecoder,
    buf: Vec<u8>,
    /// Replies waiting to be written.
    out: Vec<u8>,
    /// What the decoder holds, charged before each read is appended to it.
    charge: BodyCharge<'a>,
}

fn serve_connection(stream: TcpStream, shared: &Shared) {
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    let guard = &*shared.config.guard;
    let mut resp = Resp {
        session: RespSession {
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
        },
        shared,
        peer,
        decoder: RequestDecoder::new(shared.config.limits),
        buf: vec![0u8; READ_CHUNK_BYTES],
        out: Vec::new(),
        charge: guard.charge(peer),
    };
    let how = Drive {
        gate: &shared.gate,
        guard,
        front: Front::Resp,
        idle_timeout: shared.config.idle_timeout,
        write_timeout: shared.config.write_timeout,
    };
    drive(stream, &mut resp, &how);
}

impl Resp<'_> {
    /// Answers with an error and closes.
    fn close_with(&mut self, stream: &mut TcpStream, text: String) {
        Reply::Error(text).encode(&mut self.out);
        close_after(stream, &self.out, self.shared.config.write_timeout);
    }

    /// Writes the buffered replies within one deadline for all of them; false (the connection
    /// is to close) when the client did not take them in time (counted) or the write failed.
    fn write_out(&mut self, stream: &mut TcpStream) -> bool {
        let mut writer = DeadlineWriter::new(stream, self.shared.config.write_timeout);
        let written = writer.write_all(&self.out).is_ok();
        if writer.timed_out {
            self.shared.config.guard.count(Front::Resp, Reason::WriteTimeout);
        }
        self.out.clear();
        written
    }
}

impl Protocol<TcpStream> for Resp<'_> {
    fn is_idle(&self) -> bool {
        self.decoder.is_idle()
    }

    fn is_authenticated(&self) -> bool {
        self.session.authenticated.get()
    }

    fn read_buffer(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    fn received(
        &mut self,
        stream: &mut TcpStream,
        n: usize,
        _fd: Option<OwnedFd>,
    ) -> Result<bool, Close> {
        let tenant = &self.shared.config.tenant.tenant;
        let held = u64::try_from(self.decoder.buffered() + n).unwrap_or(u64::MAX);
        let refused = if !self.is_authenticated() && held > UNAUTHENTICATED_REQUEST_BYTES_MAX {
            Some((
                Reason::Oversize,
                format!(
                    "ERR {held} bytes sent before AUTH, more than the \
                     {UNAUTHENTICATED_REQUEST_BYTES_MAX} allowed"
                ),
            ))
        } else {
            self.charge
                .set(held, Some(tenant))
                .err()
                .map(|r| (r.reason, format!("BUSY {}", r.error)))
        };
        if let Some((reason, text)) = refused {
            self.shared.config.guard.count(Front::Resp, reason);
            tracing::debug!(peer = ?self.peer, reason = reason.as_str(), "closing a RESP connection: refused");
            self.close_with(stream, text);
            return Err(Close);
        }
        self.decoder.feed(&self.buf[..n]);
        let mut served = false;
        loop {
            match self.decoder.next_request() {
                Ok(Some(args)) => {
                    served = true;
                    let (reply, then) = self.session.execute(&args);
                    reply.encode_as(self.session.version.get(), &mut self.out);
                    if then == Then::Close {
                        close_after(stream, &self.out, self.shared.config.write_timeout);
                        return Err(Close);
                    }
                    if self.out.len() >= REPLY_FLUSH_BYTES && !self.write_out(stream) {
                        return Err(Close);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(peer = ?self.peer, error = %e, "closing a RESP connection: bad request");
                    self.close_with(stream, format!("ERR Protocol error: {e}"));
                    return Err(Close);
                }
            }
        }
        // What is left buffered is part of the next request (shrinking cannot be refused).
        let _ = self
            .charge
            .set(u64::try_from(self.decoder.buffered()).unwrap_or(u64::MAX), Some(tenant));
        if !self.out.is_empty() {
            if !self.write_out(stream) {
                return Err(Close);
            }
            if self.out.capacity() > BUFFER_KEEP_BYTES {
                self.out = Vec::new();
            }
        }
        Ok(served)
    }
}
