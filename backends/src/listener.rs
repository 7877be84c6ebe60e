//! The accept side shared by the native and the RESP listeners (ADR 0011): one accept thread,
//! one thread per connection up to a limit, and a shutdown that stops accepting and joins every
//! connection thread within a deadline. What a connection does is the caller's.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// What one read of a connection gave.
pub(crate) enum ReadTick {
    /// This many bytes arrived.
    Data(usize),
    /// Nothing arrived within the read timeout, and the connection is not idle yet.
    Quiet,
    /// The peer closed, the read failed, or nothing complete arrived for `idle_timeout`.
    Closed,
}

/// Reads once from a connection whose read timeout is a short tick, so the caller's loop can
/// check for shutdown between ticks; a connection with no complete request since
/// `last_request` for longer than `idle_timeout` is reported closed.
pub(crate) fn read_tick(
    stream: &mut TcpStream,
    buf: &mut [u8],
    last_request: Instant,
    idle_timeout: Duration,
) -> ReadTick {
    match io::Read::read(stream, buf) {
        Ok(0) => ReadTick::Closed,
        Ok(n) => ReadTick::Data(n),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
            ) =>
        {
            if last_request.elapsed() > idle_timeout {
                tracing::debug!(peer = ?stream.peer_addr().ok(), "closing an idle connection");
                ReadTick::Closed
            } else {
                ReadTick::Quiet
            }
        }
        Err(_) => ReadTick::Closed,
    }
}

/// A running accept loop.
#[derive(Debug)]
pub(crate) struct Acceptor {
    addr: SocketAddr,
    gate: Arc<Gate>,
    accept: Option<JoinHandle<()>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    shutdown_deadline: Duration,
}

/// How an accept loop runs.
pub(crate) struct AcceptorConfig<R, S> {
    /// Thread name prefix ("gpucache-resp" gives "gpucache-resp-accept" and "-conn").
    pub(crate) name: &'static str,
    pub(crate) connections_max: u32,
    pub(crate) shutdown_deadline: Duration,
    /// Answers a connection over the limit (`open`, `max`) before it is closed.
    pub(crate) refuse: R,
    /// Serves one connection until it ends.
    pub(crate) serve: S,
}

impl Acceptor {
    pub(crate) fn start<R, S>(
        listener: TcpListener,
        gate: Arc<Gate>,
        config: AcceptorConfig<R, S>,
    ) -> io::Result<Self>
    where
        R: Fn(&mut TcpStream, u32, u32) + Send + 'static,
        S: Fn(TcpStream) + Send + Sync + 'static,
    {
        let addr = listener.local_addr()?;
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let gate = Arc::clone(&gate);
            let connections = Arc::clone(&connections);
            let AcceptorConfig { name, connections_max, refuse, serve, .. } = config;
            let serve = Arc::new(serve);
            std::thread::Builder::new().name(format!("{name}-accept")).spawn(move || {
                for stream in listener.incoming() {
                    if gate.stopping() {
                        break;
                    }
                    let Ok(mut stream) = stream else { continue };
                    let open = gate.open.fetch_add(1, Ordering::AcqRel);
                    if open >= connections_max {
                        gate.open.fetch_sub(1, Ordering::AcqRel);
                        let _ = stream.set_write_timeout(Some(REFUSAL_WRITE_TIMEOUT));
                        refuse(&mut stream, open, connections_max);
                        continue;
                    }
                    let (conn_gate, serve) = (Arc::clone(&gate), Arc::clone(&serve));
                    let spawned =
                        std::thread::Builder::new().name(format!("{name}-conn")).spawn(move || {
                            serve(stream);
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
            addr,
            gate,
            accept: Some(accept),
            connections,
            shutdown_deadline: config.shutdown_deadline,
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn open_connections(&self) -> u32 {
        self.gate.open.load(Ordering::Acquire)
    }

    /// Stops accepting and joins every connection thread within the deadline; returns how many
    /// were still running then.
    pub(crate) fn stop(&mut self) -> usize {
        self.gate.stopping.store(true, Ordering::Release);
        // Wake the accept call.
        let _ = TcpStream::connect_timeout(&self.addr, WAKE_CONNECT_TIMEOUT);
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
