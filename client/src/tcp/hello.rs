//! Opening a session: the socket (TCP, or the server's Unix socket learnt over TCP), the HELLO
//! exchange with its authentication and seal, attaching the shared segment, and the typed
//! [`ConnectError`] a caller gets when any of it fails.

use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::store::StoreError;
use gpucache_wire::seal::{self, NONCE_BYTES, SealKey};
use gpucache_wire::{FrameDecoder, HelloAuth, Request, Response, WireError};

use super::config::LocalConfig;
use super::conn::{Conn, READ_CHUNK_BYTES, Stream};
use super::errors::{ExchangeFailure, transport_failure};
use super::tcp_store::{TcpStore, pool_key};

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

impl TcpStore {
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

    /// Opens a session as `caller` now and keeps it in the pool for the next request, so that
    /// a caller learns why the server cannot be used (unreachable, not GPCW, busy, unknown
    /// tenant, refused credentials) as a typed error before its first request.
    pub fn handshake(&self, caller: &Caller) -> Result<(), ConnectError> {
        let conn = self.open(caller)?;
        self.keep(pool_key(caller), conn);
        Ok(())
    }

    pub(super) fn connect(
        &self,
        caller: &Caller,
        operation: &'static str,
    ) -> Result<Conn, StoreError> {
        let mut conn =
            self.open(caller).map_err(|e| transport_failure(operation, e.io_kind(), e))?;
        self.declare(&mut conn, operation)?;
        Ok(conn)
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
}
