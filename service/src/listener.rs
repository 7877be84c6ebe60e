//! The accept side every front shares (native over TCP and the Unix socket, RESP, and the HTTP
//! endpoint; ADR 0011): one accept thread, one thread per connection up to a limit, and a
//! shutdown that stops accepting and joins every connection thread within a deadline. What a
//! connection does is the front's (for the long-lived ones, [`crate::connection::drive`]). A
//! connection over `connections_max`, or from an address at `connections_per_peer_max`
//! ([`Guard::admit_peer`]), never gets a connection thread: it is counted by reason and given
//! the front's refusal, which a refusal thread (at most [`REFUSING_MAX`] at once) writes and
//! closes without a reset destroying it.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bounds::{Front, Guard, Reason};
use crate::connection::{Connection, Gate, close_after};

/// How long a refused connection gets to take its refusal.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Most refusal threads at once. Past it the accept thread writes a refusal itself, without
/// waiting for the socket, and closes at once (best effort).
pub(crate) const REFUSING_MAX: usize = 16;
/// How long shutdown tries to connect to its own listener to wake the accept call.
const WAKE_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How often shutdown looks at connection threads that have not finished yet.
const JOIN_POLL: Duration = Duration::from_millis(5);

/// A bound listener the accept loop takes connections from.
pub(crate) trait Listen: Send + 'static {
    type Stream: Connection;
    fn accept(&self) -> io::Result<Self::Stream>;
    /// Wakes a blocked `accept` (by connecting to it), during shutdown.
    fn wake(&self);
}

impl Listen for TcpListener {
    type Stream = TcpStream;
    fn accept(&self) -> io::Result<TcpStream> {
        TcpListener::accept(self).map(|(s, _)| s)
    }
    fn wake(&self) {
        if let Ok(addr) = self.local_addr() {
            let _ = TcpStream::connect_timeout(&reachable(addr), WAKE_CONNECT_TIMEOUT);
        }
    }
}

/// Where to connect to reach a listener bound to `addr` (one bound to a wildcard address is
/// reached through loopback).
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V4(a) if a.ip().is_unspecified() => {
            SocketAddr::from((Ipv4Addr::LOCALHOST, a.port()))
        }
        SocketAddr::V6(a) if a.ip().is_unspecified() => {
            SocketAddr::from((Ipv6Addr::LOCALHOST, a.port()))
        }
        other => other,
    }
}

/// A Unix listener and the path it is bound to.
#[derive(Debug)]
pub(crate) struct LocalListener {
    pub(crate) listener: UnixListener,
    pub(crate) path: PathBuf,
}

impl LocalListener {
    /// Binds `path`, replacing a stale socket left by an earlier run (but nothing else).
    pub(crate) fn bind(path: PathBuf) -> io::Result<Self> {
        use std::os::unix::fs::FileTypeExt;
        if let Ok(meta) = std::fs::symlink_metadata(&path) {
            if !meta.file_type().is_socket() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            if UnixStream::connect(&path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by another process", path.display()),
                ));
            }
            std::fs::remove_file(&path)?;
        }
        let listener = UnixListener::bind(&path)?;
        Ok(Self { listener, path })
    }
}

impl Listen for LocalListener {
    type Stream = UnixStream;
    fn accept(&self) -> io::Result<UnixStream> {
        self.listener.accept().map(|(s, _)| s)
    }
    fn wake(&self) {
        let _ = UnixStream::connect(&self.path);
    }
}

impl Drop for LocalListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A running accept loop.
pub(crate) struct Acceptor {
    wake: Box<dyn Fn() + Send + Sync>,
    gate: Arc<Gate>,
    accept: Option<JoinHandle<()>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    shutdown_deadline: Duration,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor")
            .field("gate", &self.gate)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .finish_non_exhaustive()
    }
}

/// Why the accept loop turned a connection away, with the count it was at and its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TurnedAway {
    /// The listener holds `open` connections, `max` is `connections_max`.
    ConnectionsMax { open: u32, max: u32 },
    /// The peer's address holds `open`, `max` is `connections_per_peer_max`.
    PerPeer { open: u32, max: u32 },
}

/// How an accept loop runs.
pub(crate) struct AcceptorConfig<R, S> {
    /// Thread name prefix ("gpucache-resp" gives "gpucache-resp-accept" and "-conn").
    pub(crate) name: &'static str,
    pub(crate) connections_max: u32,
    pub(crate) shutdown_deadline: Duration,
    /// The per-peer limits and refusal counts shared with the other data fronts, and the front
    /// this listener counts as; none for a listener with neither (the HTTP endpoint).
    pub(crate) guard: Option<(Arc<Guard>, Front)>,
    /// The bytes that answer a connection turned away, before it is closed.
    pub(crate) refuse: R,
    /// Serves one connection until it ends.
    pub(crate) serve: S,
}

impl Acceptor {
    pub(crate) fn start<L, R, S>(
        listener: L,
        gate: Arc<Gate>,
        config: AcceptorConfig<R, S>,
    ) -> io::Result<Self>
    where
        L: Listen + Sync,
        R: Fn(TurnedAway) -> Vec<u8> + Send + 'static,
        S: Fn(L::Stream) + Send + Sync + 'static,
    {
        let listener = Arc::new(listener);
        let waker = Arc::clone(&listener);
        let wake = Box::new(move || waker.wake());
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let gate = Arc::clone(&gate);
            let connections = Arc::clone(&connections);
            let AcceptorConfig { name, connections_max, guard, refuse, serve, .. } = config;
            let serve = Arc::new(serve);
            let refusing = Arc::new(AtomicUsize::new(0));
            std::thread::Builder::new().name(format!("{name}-accept")).spawn(move || {
                loop {
                    let stream = listener.accept();
                    if gate.stopping() {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let turn_away = |stream: L::Stream, why: TurnedAway| {
                        if let Some((guard, front)) = &guard {
                            let reason = match why {
                                TurnedAway::ConnectionsMax { .. } => Reason::ConnectionsMax,
                                TurnedAway::PerPeer { .. } => Reason::PerPeer,
                            };
                            guard.count(*front, reason);
                        }
                        send_refusal(stream, refuse(why), name, &refusing);
                    };
                    let open = gate.open.fetch_add(1, Ordering::AcqRel);
                    if open >= connections_max {
                        gate.open.fetch_sub(1, Ordering::AcqRel);
                        turn_away(
                            stream,
                            TurnedAway::ConnectionsMax { open, max: connections_max },
                        );
                        continue;
                    }
                    let admitted = match (&guard, stream.peer_ip()) {
                        (Some((guard, _)), Some(ip)) => guard.admit_peer(ip).map(Some),
                        _ => Ok(None),
                    };
                    let peer = match admitted {
                        Ok(slot) => slot,
                        Err((open, max)) => {
                            gate.open.fetch_sub(1, Ordering::AcqRel);
                            turn_away(stream, TurnedAway::PerPeer { open, max });
                            continue;
                        }
                    };
                    let (conn_gate, serve) = (Arc::clone(&gate), Arc::clone(&serve));
                    let spawned =
                        std::thread::Builder::new().name(format!("{name}-conn")).spawn(move || {
                            serve(stream);
                            drop(peer);
                            conn_gate.open.fetch_sub(1, Ordering::AcqRel);
                        });
                    match spawned {
                        Ok(h) => {
                            if let Ok(mut v) = connections.lock() {
                                v.retain(|h| !h.is_finished());
                                v.push(h);
                            }
                        }
                        Err(e) => {
                            gate.open.fetch_sub(1, Ordering::AcqRel);
                            tracing::warn!(error = %e, "could not start a connection thread");
                        }
                    }
                }
            })?
        };
        Ok(Self {
            wake,
            gate,
            accept: Some(accept),
            connections,
            shutdown_deadline: config.shutdown_deadline,
        })
    }

    pub(crate) fn open_connections(&self) -> u32 {
        self.gate.open.load(Ordering::Acquire)
    }

    /// Stops accepting and joins every connection thread within the deadline; returns how many
    /// were still running then.
    pub(crate) fn stop(&mut self) -> usize {
        self.gate.stopping.store(true, Ordering::Release);
        // Wake the accept call.
        (self.wake)();
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
        let deadline = Instant::now() + self.shutdown_deadline;
        let handles: Vec<JoinHandle<()>> =
            self.connections.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default();
        let mut left = 0;
        for h in handles {
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::park_timeout(JOIN_POLL);
            }
            if h.is_finished() {
                let _ = h.join();
            } else {
                left += 1;
            }
        }
        left
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.stop();
        }
    }
}

/// Writes a refusal and closes, on a refusal thread of its own so that a slow client does not
/// hold the accept thread up; with [`REFUSING_MAX`] already busy, the accept thread writes what
/// the socket takes at once and closes.
fn send_refusal<C: Connection>(
    mut stream: C,
    refusal: Vec<u8>,
    name: &str,
    refusing: &Arc<AtomicUsize>,
) {
    if refusing.fetch_add(1, Ordering::AcqRel) >= REFUSING_MAX {
        refusing.fetch_sub(1, Ordering::AcqRel);
        if stream.set_nonblocking(true).is_ok() {
            let _ = stream.write_all(&refusal);
        }
        return;
    }
    let _ = stream.set_write_timeout(Some(REFUSAL_WRITE_TIMEOUT));
    let done = Arc::clone(refusing);
    let spawned = std::thread::Builder::new().name(format!("{name}-refuse")).spawn(move || {
        close_after(&mut stream, &refusal, REFUSAL_WRITE_TIMEOUT);
        done.fetch_sub(1, Ordering::AcqRel);
    });
    if spawned.is_err() {
        refusing.fetch_sub(1, Ordering::AcqRel);
    }
}
