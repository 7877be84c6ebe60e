//! One connection, from its first byte to its close, for the fronts that keep a connection
//! open for many requests (the native protocol over TCP and the Unix socket, and RESP).
//!
//! [`drive`] owns the loop every such connection runs: it reads in short ticks so that it sees
//! a shutdown, ends a connection that passed one of its [`Deadlines`] or stayed idle, and
//! hands what arrived to the front's [`Protocol`], which decodes, serves and writes the answers.
//! Fronts write through [`DeadlineWriter`] (one deadline per response) and close a connection
//! whose request they refuse with [`close_after`], which keeps the refusal from being lost to a
//! reset.

use std::io::{self, Write};
use std::net::{IpAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::bounds::{Deadlines, Front, Guard, Reason};

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

/// How often a blocked read wakes to check for shutdown and idleness.
pub(crate) const READ_TICK: Duration = Duration::from_millis(100);
/// Bytes read from a socket per call.
pub(crate) const READ_CHUNK_BYTES: usize = 256 << 10;

/// A connected stream a front serves: TCP, or a Unix socket (which can also carry a
/// descriptor, the shared-memory segment of the same-host fast path).
pub(crate) trait Connection: io::Read + io::Write + Send + 'static {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
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
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        TcpStream::set_nonblocking(self, nonblocking)
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
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        UnixStream::set_nonblocking(self, nonblocking)
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

/// What one read of a connection gave.
enum ReadTick {
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
fn read_tick<C: Connection>(
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

/// What a front does with a connection's bytes. [`drive`] calls it in this order each turn:
/// [`Protocol::admit`], a read into [`Protocol::read_buffer`], then [`Protocol::received`].
pub(crate) trait Protocol<C: Connection> {
    /// Whether no request is partly received (a stopping server closes only such connections).
    fn is_idle(&self) -> bool;
    /// Whether the connection has authenticated; until then the deadline to authenticate runs.
    fn is_authenticated(&self) -> bool;
    /// Checks what the connection holds against its byte budgets before the next read. A
    /// refusal is counted and answered, and the connection closes.
    fn admit(&mut self, _stream: &mut C) -> Result<(), Close> {
        Ok(())
    }
    /// Where the next read goes.
    fn read_buffer(&mut self) -> &mut [u8];
    /// Takes the `n` bytes just read into [`Protocol::read_buffer`] (with a descriptor that came
    /// with them), serves every request they complete and writes the answers. Gives whether a
    /// request was served, or that the connection is to close (a refusal counted and answered
    /// first).
    fn received(&mut self, stream: &mut C, n: usize, fd: Option<OwnedFd>) -> Result<bool, Close>;
    /// Says goodbye to an idle connection of a stopping server.
    fn stopping(&mut self, _stream: &mut C) {}
}

/// The connection is to close: the peer left, or the front refused or failed a request (and
/// counted and answered what it refused).
pub(crate) struct Close;

/// What [`drive`] needs from the front's configuration.
pub(crate) struct Drive<'a> {
    pub(crate) gate: &'a Gate,
    /// The connection bounds and the refusal counts.
    pub(crate) guard: &'a Guard,
    /// The front, as refusals are counted.
    pub(crate) front: Front,
    pub(crate) idle_timeout: Duration,
    pub(crate) write_timeout: Duration,
}

/// Serves one connection until it closes, the server stops, or a bound ends it.
pub(crate) fn drive<C: Connection, P: Protocol<C>>(
    mut stream: C,
    protocol: &mut P,
    how: &Drive<'_>,
) {
    stream.set_nodelay();
    let _ = stream.set_read_timeout(Some(READ_TICK));
    let _ = stream.set_write_timeout(Some(how.write_timeout));
    let mut deadlines = Deadlines::new(how.guard.bounds(), !protocol.is_authenticated());
    let mut last_request = Instant::now();
    let end = |reason: Reason| how.guard.count(how.front, reason);
    loop {
        if how.gate.stopping() && protocol.is_idle() {
            protocol.stopping(&mut stream);
            return;
        }
        if let Some(reason) = deadlines.passed(Instant::now()) {
            return end(reason);
        }
        if protocol.admit(&mut stream).is_err() {
            return;
        }
        let buf = protocol.read_buffer();
        let (n, fd) = match read_tick(&mut stream, buf, last_request, how.idle_timeout) {
            ReadTick::Data(n, fd) => (n, fd),
            ReadTick::Quiet => continue,
            ReadTick::Idle => return end(Reason::IdleTimeout),
            ReadTick::Closed => return,
        };
        match protocol.received(&mut stream, n, fd) {
            Ok(true) => last_request = Instant::now(),
            Ok(false) => {}
            Err(Close) => return,
        }
        if protocol.is_authenticated() {
            deadlines.authenticated();
        }
        deadlines.in_request(!protocol.is_idle());
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
    while drained < CLOSE_DRAIN_BYTES {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut sink) {
            Ok(0) => return,
            Ok(n) => drained += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}
