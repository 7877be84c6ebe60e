//! The accept side shared by the native and the RESP listeners (ADR 0011): one accept thread,
//! one thread per connection up to a limit, and a shutdown that stops accepting and joins every
//! connection thread within a deadline. What a connection does is the caller's. A connection over
//! `connections_max`, or from an address at `connections_per_peer_max` ([`Guard::admit_peer`]),
//! is answered by the caller's refusal and closed by the accept thread, before a connection
//! thread is spent on it, and counted by reason. Both fronts write their answers through
//! [`DeadlineWriter`] (one deadline per response) and close a refused connection with
//! [`close_after`].

use std::io::{self, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bounds::{Front, Guard, Reason};

/// How long a refused connection gets to take its refusal.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long shutdown tries to connect to its own listener to wake the accept call.
const WAKE_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How often shutdown looks at connection threads that have not finished yet.
const JOIN_POLL: Duration = Duration::from_millis(5);

/// What connection threads watch: whether the listener is stopping, and how many are open.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    pub(crate) stopping: AtomicBool,
    pub(crate) open: AtomicU32,
}

impl Gate {
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }
}

/// A connected stream a listener serves: TCP, or a Unix socket (which can also carry a
/// descriptor, the shared-memory segment of the same-host fast path).
pub(crate) trait Connection: io::Read + io::Write + Send + 'static {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Turns off write coalescing where there is any.
    fn set_nodelay(&self);
    /// The peer, for logs.
    fn peer(&self) -> String;
    /// Whether the peer is a TCP client on a loopback address (this host).
    fn peer_is_loopback(&self) -> bool {
        false
    }
    /// The peer's IP address, which `connections_per_peer_max` counts by; `None` for a Unix
    /// socket peer (not limited per peer).
    fn peer_ip(&self) -> Option<IpAddr> {
        None
    }
    /// Shuts the write side (the client reads the end of the stream).
    fn shutdown_write(&self) {}
    /// Reads like `read`, and also returns a descriptor that arrived with the bytes.
    fn read_with_fd(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        Ok((io::Read::read(self, buf)?, None))
    }
}

impl Connection for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
    fn set_nodelay(&self) {
        let _ = TcpStream::set_nodelay(self, true);
    }
    fn peer(&self) -> String {
        self.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string())
    }
    fn peer_is_loopback(&self) -> bool {
        self.peer_addr().is_ok_and(|a| a.ip().is_loopback())
    }
    fn peer_ip(&self) -> Option<IpAddr> {
        self.peer_addr().ok().map(|a| a.ip().to_canonical())
    }
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}

impl Connection for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
    fn set_nodelay(&self) {}
    fn peer(&self) -> String {
        "unix socket peer".into()
    }
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
    fn read_with_fd(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        gpucache_storage::host::segment::recv_with_fd(self, buf)
    }
}

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
            let _ = TcpStream::connect_timeout(&addr, WAKE_CONNECT_TIMEOUT);
        }
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

/// What one read of a connection gave.
pub(crate) enum ReadTick {
    /// This many bytes arrived (and a descriptor with them, on a Unix socket).
    Data(usize, Option<OwnedFd>),
    /// Nothing arrived within the read timeout, and the connection is not idle yet.
    Quiet,
    /// Nothing complete arrived for `idle_timeout`: the connection is to be closed.
    Idle,
    /// The peer closed, or the read failed.
    Closed,
}

/// Reads once from a connection whose read timeout is a short tick, so the caller's loop can
/// check for shutdown between ticks; a connection with no complete request since
/// `last_request` for longer than `idle_timeout` is reported idle.
pub(crate) fn read_tick<C: Connection>(
    stream: &mut C,
    buf: &mut [u8],
    last_request: Instant,
    idle_timeout: Duration,
) -> ReadTick {
    match stream.read_with_fd(buf) {
        Ok((0, _)) => ReadTick::Closed,
        Ok((n, fd)) => ReadTick::Data(n, fd),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
            ) =>
        {
            if last_request.elapsed() > idle_timeout {
                tracing::debug!(peer = %stream.peer(), "closing an idle connection");
                ReadTick::Idle
            } else {
                ReadTick::Quiet
            }
        }
        Err(_) => ReadTick::Closed,
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
    /// The front, as refusals are counted.
    pub(crate) front: Front,
    pub(crate) connections_max: u32,
    pub(crate) shutdown_deadline: Duration,
    /// Per-peer limits and refusal counts, shared with the other fronts.
    pub(crate) guard: Arc<Guard>,
    /// Answers a connection turned away before it is closed.
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
        R: Fn(&mut L::Stream, TurnedAway) + Send + 'static,
        S: Fn(L::Stream) + Send + Sync + 'static,
    {
        let listener = Arc::new(listener);
        let waker = Arc::clone(&listener);
        let wake = Box::new(move || waker.wake());
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let gate = Arc::clone(&gate);
            let connections = Arc::clone(&connections);
            let AcceptorConfig { name, front, connections_max, refuse, serve, .. } = config;
            let guard = Arc::clone(&config.guard);
            let serve = Arc::new(serve);
            std::thread::Builder::new().name(format!("{name}-accept")).spawn(move || {
                loop {
                    let stream = listener.accept();
                    if gate.stopping() {
                        break;
                    }
                    let Ok(mut stream) = stream else { continue };
                    let turn_away = |stream: &mut L::Stream, why: TurnedAway| {
                        let reason = match why {
                            TurnedAway::ConnectionsMax { .. } => Reason::ConnectionsMax,
                            TurnedAway::PerPeer { .. } => Reason::PerPeer,
                        };
                        guard.count(front, reason);
                        let _ = Connection::set_write_timeout(stream, Some(REFUSAL_WRITE_TIMEOUT));
                        refuse(stream, why);
                    };
                    let open = gate.open.fetch_add(1, Ordering::AcqRel);
                    if open >= connections_max {
                        gate.open.fetch_sub(1, Ordering::AcqRel);
                        let why = TurnedAway::ConnectionsMax { open, max: connections_max };
                        turn_away(&mut stream, why);
                        continue;
                    }
                    let peer = match stream.peer_ip().map(|ip| guard.admit_peer(ip)) {
                        None => None,
                        Some(Ok(slot)) => Some(slot),
                        Some(Err((open, max))) => {
                            gate.open.fetch_sub(1, Ordering::AcqRel);
                            turn_away(&mut stream, TurnedAway::PerPeer { open, max });
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

/// How long a connection closed after a refusal keeps reading and dropping what its client
/// still sends, so that the refusal is not destroyed by a reset.
const CLOSE_DRAIN: Duration = Duration::from_millis(500);
/// Most bytes read and dropped while closing after a refusal.
const CLOSE_DRAIN_BYTES: usize = 4 << 20;

/// How far past its deadline a response may run before the socket's timeout is cut to what is
/// left (saving a system call per write for responses that go out quickly).
const DEADLINE_SLACK: Duration = Duration::from_millis(10);

/// Writes a whole response within one deadline: every write call (plain or vectored, one or
/// many) fails with `TimedOut` once `timeout` has passed since the writer was made, however the
/// client drains it. The connection's own write timeout is expected to be `timeout` already (set
/// once when the connection opens), so the first writes of a response cost no extra system
/// call; once more than [`DEADLINE_SLACK`] has passed, the socket timeout is cut to what is left
/// before each write, and restored when the writer is dropped.
pub(crate) struct DeadlineWriter<'s, C: Connection> {
    stream: &'s mut C,
    timeout: Duration,
    /// When the whole response must be written by: one deadline over every write call.
    deadline: Instant,
    /// Whether the socket's timeout was cut below `timeout` (put back on drop).
    shortened: bool,
    /// Whether a write ran out of time.
    pub(crate) timed_out: bool,
}

impl<'s, C: Connection> DeadlineWriter<'s, C> {
    pub(crate) fn new(stream: &'s mut C, timeout: Duration) -> Self {
        let deadline = Instant::now() + timeout;
        Self { stream, timeout, deadline, shortened: false, timed_out: false }
    }

    /// One write call within what is left of the deadline.
    fn within<T>(&mut self, write: impl FnOnce(&mut C) -> io::Result<T>) -> io::Result<T> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            self.timed_out = true;
            return Err(io::ErrorKind::TimedOut.into());
        }
        if left + DEADLINE_SLACK < self.timeout {
            self.stream.set_write_timeout(Some(left))?;
            self.shortened = true;
        }
        match write(self.stream) {
            Err(e) if timed_out_kind(e.kind()) => {
                self.timed_out = true;
                Err(io::ErrorKind::TimedOut.into())
            }
            other => other,
        }
    }
}

impl<C: Connection> Drop for DeadlineWriter<'_, C> {
    fn drop(&mut self) {
        if self.shortened {
            let _ = self.stream.set_write_timeout(Some(self.timeout));
        }
    }
}

fn timed_out_kind(kind: io::ErrorKind) -> bool {
    matches!(kind, io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Every write call, `write_all`'s and vectored ones alike, is bounded by the one deadline.
impl<C: Connection> Write for DeadlineWriter<'_, C> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.within(|s| s.write(buf))
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.within(|s| s.write_vectored(bufs))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// Sends `out` (within `write_timeout`), then closes without a reset destroying it: the write
/// side is shut and what the client still sends is read and dropped for a moment (bounded in
/// time and bytes). For a connection closed after a refusal whose body was not read.
pub(crate) fn close_after<C: Connection>(stream: &mut C, out: &[u8], write_timeout: Duration) {
    if DeadlineWriter::new(stream, write_timeout).write_all(out).is_err() {
        return;
    }
    stream.shutdown_write();
    let deadline = Instant::now() + CLOSE_DRAIN;
    let mut sink = [0u8; 16 << 10];
    let mut drained = 0;
    while Instant::now() < deadline && drained < CLOSE_DRAIN_BYTES {
        match stream.read(&mut sink) {
            Ok(0) => return,
            Ok(n) => drained += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}
