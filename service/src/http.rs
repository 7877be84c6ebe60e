//! The service's HTTP endpoint: `GET /metrics` (Prometheus or OpenMetrics text), `GET /livez`
//! (the process answers), `GET /readyz` (every readiness check of [`crate::ready`] passes; 503
//! naming the failing ones otherwise) and `GET /healthz` (an alias of `/readyz`). Nothing else.
//!
//! A deliberately small HTTP/1.1 responder on std's `TcpListener`, in the thread-per-connection
//! shape of ADR 0011: one accept thread, one thread per connection up to `connections_max`, one
//! request per connection (`Connection: close`), a bounded request head and a read deadline. It
//! serves scrapers and probes on a trusted network, not browsers; it owns no store and no data
//! path.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::metered::{ExpositionFormat, Metrics};

use crate::ready::Probe;

/// Bounds of the HTTP endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections served at once; more are answered 503 and closed.
    pub connections_max: usize,
    /// Largest request head (request line and headers) accepted.
    pub request_bytes_max: usize,
    /// Time a client has to send its whole request head.
    pub read_deadline_ms: u64,
    /// Time a single write of the response may block.
    pub write_timeout_ms: u64,
    /// How long [`MetricsServer::shutdown`] waits for connections in progress.
    pub shutdown_deadline_ms: u64,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            connections_max: 16,
            request_bytes_max: 8 << 10,
            read_deadline_ms: 5_000,
            write_timeout_ms: 5_000,
            shutdown_deadline_ms: 2_000,
        }
    }
}

/// State shared by the accept thread, the connection threads and the handle.
struct Shared {
    metrics: Arc<Metrics>,
    ready: Arc<Probe>,
    limits: HttpLimits,
    stopping: AtomicBool,
    next_id: AtomicU64,
    /// Threads answering connections over the limit with 503.
    rejecting: AtomicUsize,
    /// Connections being served, by id: a clone of each socket so that shutdown can end a
    /// request that is still being read.
    open: Mutex<HashMap<u64, TcpStream>>,
    closed: Condvar,
}

impl Shared {
    fn open(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        // A panicking connection thread leaves the map consistent (insert and remove are single
        // calls), so its poison carries no meaning.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a connection if there is room; `None` when `connections_max` are open.
    fn enter(&self, stream: &TcpStream) -> Option<u64> {
        let mut open = self.open();
        if open.len() >= self.limits.connections_max {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Without a clone, shutdown could not interrupt this connection; serving it anyway is
        // still bounded by the read deadline.
        if let Ok(clone) = stream.try_clone() {
            open.insert(id, clone);
        }
        Some(id)
    }

    fn leave(&self, id: u64) {
        self.open().remove(&id);
        self.closed.notify_all();
    }
}

/// A running `/metrics`, `/livez`, `/readyz` and `/healthz` endpoint. Dropping it shuts it down.
pub struct MetricsServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer").field("local_addr", &self.local_addr).finish()
    }
}

impl MetricsServer {
    /// Binds `addr` and serves with [`HttpLimits::default`].
    pub fn start(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        ready: Arc<Probe>,
    ) -> io::Result<MetricsServer> {
        Self::start_with(addr, metrics, ready, HttpLimits::default())
    }

    /// Binds `addr` and serves until [`MetricsServer::shutdown`].
    pub fn start_with(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        ready: Arc<Probe>,
        limits: HttpLimits,
    ) -> io::Result<MetricsServer> {
        if limits.connections_max == 0 || limits.request_bytes_max == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "connections_max and request_bytes_max must be at least 1",
            ));
        }
        let listener = TcpListener::bind(addr)?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            metrics,
            ready,
            limits,
            stopping: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            rejecting: AtomicUsize::new(0),
            open: Mutex::new(HashMap::new()),
            closed: Condvar::new(),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("gpucache-http-accept".to_owned())
            .spawn(move || accept_loop(&listener, &accept_shared))?;
        Ok(MetricsServer { local_addr, shared, accept: Some(accept) })
    }

    /// The address actually bound (with the kernel's port when `addr` asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, ends requests still being read, lets responses being written finish,
    /// and waits up to `shutdown_deadline_ms` for every connection. Returns how many were still
    /// open at the deadline (0 on a clean stop); those threads end on their own deadlines.
    pub fn shutdown(mut self) -> usize {
        self.stop()
    }

    fn stop(&mut self) -> usize {
        let Some(accept) = self.accept.take() else { return 0 };
        let deadline =
            Instant::now() + Duration::from_millis(self.shared.limits.shutdown_deadline_ms);
        self.shared.stopping.store(true, Ordering::SeqCst);
        // accept() blocks; a connection of our own wakes it to see the flag.
        let wake = wake_address(self.local_addr);
        let woke = TcpStream::connect_timeout(&wake, Duration::from_millis(500)).is_ok();
        for stream in self.shared.open().values() {
            // Ends a request still being read at once; a response being written is unaffected.
            let _ = stream.shutdown(Shutdown::Read);
        }
        if woke {
            let _ = accept.join();
        }
        let mut open = self.shared.open();
        while !open.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            open = self
                .shared
                .closed
                .wait_timeout(open, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        open.len()
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where to connect to reach a listener bound to `addr` (a wildcard address is reached through
/// loopback).
fn wake_address(addr: SocketAddr) -> SocketAddr {
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

/// Pause after a failed accept (out of file descriptors, say), so the loop does not spin.
const ACCEPT_RETRY_MS: u64 = 10;

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(_) => {
                thread::sleep(Duration::from_millis(ACCEPT_RETRY_MS));
                continue;
            }
        };
        let write_timeout = Duration::from_millis(shared.limits.write_timeout_ms.max(1));
        let _ = stream.set_write_timeout(Some(write_timeout));
        let Some(id) = shared.enter(&stream) else {
            reject(stream, shared);
            continue;
        };
        let conn_shared = Arc::clone(shared);
        let spawned = thread::Builder::new().name("gpucache-http".to_owned()).spawn(move || {
            serve(stream, &conn_shared);
            conn_shared.leave(id);
        });
        if spawned.is_err() {
            // The stream went down with the closure; the slot must come back.
            shared.leave(id);
        }
    }
}

/// Most threads answering connections over the limit at once.
const REJECTING_MAX: usize = 16;

/// Answers a connection over the limit with 503, on a thread of its own so that the lingering
/// close does not hold up the accept thread. Past [`REJECTING_MAX`] such threads the accept
/// thread answers itself and closes at once, without lingering (best effort).
fn reject(stream: TcpStream, shared: &Arc<Shared>) {
    let mut stream = stream;
    if shared.rejecting.fetch_add(1, Ordering::SeqCst) >= REJECTING_MAX {
        shared.rejecting.fetch_sub(1, Ordering::SeqCst);
        let _ = stream.set_nonblocking(true);
        let _ = Response::text(503, "too many connections\n").write_to(&mut stream, false);
        let _ = stream.shutdown(Shutdown::Write);
        return;
    }
    let reject_shared = Arc::clone(shared);
    let spawned = thread::Builder::new().name("gpucache-http-busy".to_owned()).spawn(move || {
        let _ = Response::text(503, "too many connections\n").write_to(&mut stream, false);
        linger_close(&mut stream);
        reject_shared.rejecting.fetch_sub(1, Ordering::SeqCst);
    });
    if spawned.is_err() {
        shared.rejecting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Longest a connection lingers after its response, reading what the client still sends.
const LINGER_MS: u64 = 500;
/// Most bytes read and dropped while lingering.
const LINGER_BYTES_MAX: usize = 64 << 10;

/// Closes after a response without losing it. Closing a socket that still has unread input
/// makes the kernel send a reset, which can destroy the response before the client reads it
/// (a request left unread past the size limit, a body after a refused method). So: send FIN,
/// then read and drop input until the client closes, for a bounded time and amount.
fn linger_close(stream: &mut TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = Instant::now() + Duration::from_millis(LINGER_MS);
    let mut chunk = [0u8; 1024];
    let mut drained = 0;
    while drained < LINGER_BYTES_MAX {
        let now = Instant::now();
        if now >= deadline || stream.set_read_timeout(Some(deadline - now)).is_err() {
            return;
        }
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => drained += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn serve(mut stream: TcpStream, shared: &Shared) {
    let deadline = Instant::now() + Duration::from_millis(shared.limits.read_deadline_ms);
    let response = match read_head(&mut stream, shared.limits.request_bytes_max, deadline) {
        Ok(head) => match parse_head(&head) {
            Ok(request) => {
                let head_only = request.method == "HEAD";
                let response = route(&request, shared);
                let _ = response.write_to(&mut stream, head_only);
                linger_close(&mut stream);
                return;
            }
            Err(why) => Response::text(400, &format!("bad request: {why}\n")),
        },
        Err(HeadError::TooLarge) => Response::text(
            400,
            &format!("bad request: head exceeds {} bytes\n", shared.limits.request_bytes_max),
        ),
        Err(HeadError::TimedOut) => Response::text(408, "request head not received in time\n"),
        // The client left, or never sent anything: nobody to answer.
        Err(HeadError::Closed) => return,
    };
    let _ = response.write_to(&mut stream, false);
    linger_close(&mut stream);
}

enum HeadError {
    TooLarge,
    TimedOut,
    Closed,
}

/// Reads up to the blank line that ends a request head.
fn read_head(
    stream: &mut TcpStream,
    bytes_max: usize,
    deadline: Instant,
) -> Result<Vec<u8>, HeadError> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(if head.is_empty() { HeadError::Closed } else { HeadError::TimedOut });
        }
        if stream.set_read_timeout(Some(deadline - now)).is_err() {
            return Err(HeadError::Closed);
        }
        let n = match stream.read(&mut chunk) {
            Ok(0) => return Err(HeadError::Closed),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(if head.is_empty() { HeadError::Closed } else { HeadError::TimedOut });
            }
            Err(_) => return Err(HeadError::Closed),
        };
        // Only the bytes new to this read (and three before them) can complete the terminator.
        let search_from = head.len().saturating_sub(3);
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_head_end(&head[search_from..]) {
            if search_from + end > bytes_max {
                return Err(HeadError::TooLarge);
            }
            head.truncate(search_from + end);
            return Ok(head);
        }
        if head.len() > bytes_max {
            return Err(HeadError::TooLarge);
        }
    }
}

/// The length of the head up to its blank line (`\r\n\r\n`, or a bare `\n\n`).
fn find_head_end(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).enumerate().find_map(|(i, w)| match w {
        b"\n\n" => Some(i + 1),
        b"\n\r" if bytes.get(i + 2) == Some(&b'\n') => Some(i + 1),
        _ => None,
    })
}

struct Request<'a> {
    method: &'a str,
    path: &'a str,
    accept: Option<&'a str>,
}

fn parse_head(head: &[u8]) -> Result<Request<'_>, &'static str> {
    let text = std::str::from_utf8(head).map_err(|_| "the head is not UTF-8")?;
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("the request line is not METHOD TARGET VERSION");
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err("the method is not a token");
    }
    if !target.starts_with('/') {
        return Err("the target is not an absolute path");
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err("the version is not HTTP/1.0 or HTTP/1.1");
    }
    let mut accept = None;
    for line in lines.filter(|l| !l.is_empty()) {
        let Some((name, value)) = line.split_once(':') else {
            return Err("a header line has no colon");
        };
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            return Err("a header name is malformed");
        }
        if name.eq_ignore_ascii_case("accept") {
            accept = Some(value.trim());
        }
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    Ok(Request { method, path, accept })
}

fn route(request: &Request<'_>, shared: &Shared) -> Response {
    let known = matches!(request.path, "/metrics" | "/livez" | "/readyz" | "/healthz");
    if !known {
        return Response::text(404, "not found; try /metrics, /livez, /readyz or /healthz\n");
    }
    if request.method != "GET" && request.method != "HEAD" {
        let mut r = Response::text(405, "only GET and HEAD\n");
        r.allow = true;
        return r;
    }
    if request.path == "/metrics" {
        let format = match request.accept {
            Some(a) if a.contains("application/openmetrics-text") => ExpositionFormat::OpenMetrics,
            _ => ExpositionFormat::Prometheus,
        };
        let body = shared.metrics.encode(format);
        return Response { status: 200, content_type: format.content_type(), body, allow: false };
    }
    if request.path == "/livez" {
        return Response::text(200, "alive\n");
    }
    let readiness = shared.ready.run();
    Response::text(if readiness.ready() { 200 } else { 503 }, &readiness.body())
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
    /// Add `Allow: GET, HEAD` (a 405 must say what is allowed).
    allow: bool,
}

impl Response {
    fn text(status: u16, body: &str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.to_owned(),
            allow: false,
        }
    }

    fn write_to(&self, stream: &mut TcpStream, head_only: bool) -> io::Result<()> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            408 => "Request Timeout",
            503 => "Service Unavailable",
            _ => "Unknown",
        };
        let allow = if self.allow { "Allow: GET, HEAD\r\n" } else { "" };
        let head = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}\
             Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            self.status,
            self.content_type,
            self.body.len(),
        );
        stream.write_all(head.as_bytes())?;
        if !head_only {
            stream.write_all(self.body.as_bytes())?;
        }
        stream.flush()
    }
}
