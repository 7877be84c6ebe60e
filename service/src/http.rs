//! The service's HTTP endpoint: `GET /metrics` (Prometheus or OpenMetrics text), `GET /livez`
//! (the process answers), `GET /readyz` (every readiness check of [`crate::ready`] passes; 503
//! naming the failing ones otherwise) and `GET /healthz` (an alias of `/readyz`). Nothing else.
//!
//! A deliberately small HTTP/1.1 responder on the accept loop the data fronts use
//! ([`crate::listener`], ADR 0011): one accept thread, one thread per connection up to
//! `connections_max` (more are answered 503), one request per connection (`Connection: close`),
//! a bounded request head and a read deadline. It serves scrapers and probes on a trusted
//! network, not browsers; it owns no store and no data path.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::connection::{Gate, READ_TICK, close_after};
use crate::listener::{Acceptor, AcceptorConfig};

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

/// What every connection thread reads.
struct Shared {
    metrics: Arc<Metrics>,
    ready: Arc<Probe>,
    limits: HttpLimits,
    gate: Arc<Gate>,
}

/// A running `/metrics`, `/livez`, `/readyz` and `/healthz` endpoint. Dropping it shuts it down.
pub struct MetricsServer {
    local_addr: SocketAddr,
    acceptor: Acceptor,
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
        let gate = Arc::new(Gate::default());
        let shared = Arc::new(Shared { metrics, ready, limits, gate: Arc::clone(&gate) });
        let acceptor = Acceptor::start(
            listener,
            gate,
            AcceptorConfig {
                name: "gpucache-http",
                connections_max: u32::try_from(limits.connections_max).unwrap_or(u32::MAX),
                shutdown_deadline: Duration::from_millis(limits.shutdown_deadline_ms),
                guard: None,
                refuse: |_| Response::text(503, "too many connections\n").to_bytes(false),
                serve: move |stream: TcpStream| serve(stream, &shared),
            },
        )?;
        Ok(MetricsServer { local_addr, acceptor })
    }

    /// The address actually bound (with the kernel's port when `addr` asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, ends requests still being read, lets responses being written finish,
    /// and waits up to `shutdown_deadline_ms` for every connection. Returns how many were still
    /// open at the deadline (0 on a clean stop); those threads end on their own deadlines.
    pub fn shutdown(mut self) -> usize {
        self.acceptor.stop()
    }
}

/// Answers one request and closes, without a reset destroying the answer (a request left
/// unread past the size limit, or a body after a refused method, is read and dropped for a
/// bounded time).
fn serve(mut stream: TcpStream, shared: &Shared) {
    let write_timeout = Duration::from_millis(shared.limits.write_timeout_ms.max(1));
    let _ = stream.set_write_timeout(Some(write_timeout));
    let deadline = Instant::now() + Duration::from_millis(shared.limits.read_deadline_ms);
    let (response, head_only) =
        match read_head(&mut stream, shared.limits.request_bytes_max, deadline, &shared.gate) {
            Ok(head) => match parse_head(&head) {
                Ok(request) => (route(&request, shared), request.method == "HEAD"),
                Err(why) => (Response::text(400, &format!("bad request: {why}\n")), false),
            },
            Err(HeadError::TooLarge) => (
                Response::text(
                    400,
                    &format!(
                        "bad request: head exceeds {} bytes\n",
                        shared.limits.request_bytes_max
                    ),
                ),
                false,
            ),
            Err(HeadError::TimedOut) => {
                (Response::text(408, "request head not received in time\n"), false)
            }
            // The client left, never sent anything, or the server is stopping: nobody to answer.
            Err(HeadError::Closed) => return,
        };
    close_after(&mut stream, &response.to_bytes(head_only), write_timeout);
}

enum HeadError {
    TooLarge,
    TimedOut,
    Closed,
}

/// Reads up to the blank line that ends a request head, in ticks of [`READ_TICK`] so that a
/// stopping server ends a request still being read.
fn read_head(
    stream: &mut TcpStream,
    bytes_max: usize,
    deadline: Instant,
    gate: &Gate,
) -> Result<Vec<u8>, HeadError> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(if head.is_empty() { HeadError::Closed } else { HeadError::TimedOut });
        }
        if gate.stopping() || stream.set_read_timeout(Some(left.min(READ_TICK))).is_err() {
            return Err(HeadError::Closed);
        }
        let n = match stream.read(&mut chunk) {
            Ok(0) => return Err(HeadError::Closed),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) =>
            {
                continue;
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

    /// The whole response; the head alone (with the body's length) for a HEAD request.
    fn to_bytes(&self, head_only: bool) -> Vec<u8> {
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
        let mut bytes = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}\
             Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            self.status,
            self.content_type,
            self.body.len(),
        )
        .into_bytes();
        if !head_only {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}
