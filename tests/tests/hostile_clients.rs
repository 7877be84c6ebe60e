//! The service under hostile clients, in a child process whose memory is measured (its VmRSS):
//! 100 connections that announce 64 MiB requests (native PUT bodies and RESP bulk strings), send
//! most of them and stall (from 127.0.0.40 to .43), plus 300 that send half a frame or command
//! and stall (from 127.0.0.3 to .12). Meanwhile well-behaved clients from 127.0.0.1 keep storing
//! and reading byte-exact values on both fronts, never refused. The server's memory stays under
//! its in-flight body budget plus a fixed overhead, the stalled requests are cut at the body
//! deadline, the HELLO-less ones at the HELLO deadline, and `/metrics` counts each reason. The
//! other tests check the per-peer connection limit, the 64 KiB bound before HELLO, the
//! whole-response write deadline, the idle timeout and a body past the server's budget.
//!
//! The child is this test binary itself, run with `GPUCACHE_HOSTILE_CHILD` set: it builds the
//! service from a TOML configuration exactly as `gpucache serve` does (`ValidConfig::build`),
//! prints its addresses, and serves until its stdin closes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_dataplane::testing::fixture::{self, tenant};
use gpucache_service::config::ValidConfig;
use gpucache_wire::{
    FrameHeader, HEADER_BYTES, InflightScope, Kind, Op, Request, Response, WireError,
};

const CHILD_ENV: &str = "GPUCACHE_HOSTILE_CHILD";
const CONFIG_ENV: &str = "GPUCACHE_HOSTILE_CONFIG";
/// How long any one wait of these tests may take.
const WAIT: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;
/// The in-flight budget the child is configured with.
const BUDGET: u64 = 320 * MIB;
/// The share of it each peer address gets in the child.
const PEER_SHARE: u64 = 64 * MIB;
/// How many addresses the big hostile requests of each front come from: together (both fronts)
/// they can hold 256 MiB of the budget, so the good clients always find room.
const BIG_PEERS: usize = 2;
/// What the child may hold above its idle footprint and the budget, which no budget charges: the
/// 256 KiB read buffer and the stack pages of each of ~400 connection threads (100 MiB if every
/// read buffer were touched whole; the half-sent requests touch one page of theirs), the good
/// clients' values in flight, and allocator slack. Measured on the development machine: VmRSS
/// peaks of 187 to 284 MiB over 7 MiB idle, below what the hostile addresses may hold (4 x 64
/// MiB) plus 28 MiB.
const OVERHEAD: u64 = 128 * MIB;

/// The service, when this binary runs as the child.
#[test]
#[ignore = "the child process of the other tests here, run by them with GPUCACHE_HOSTILE_CHILD"]
fn child_service() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let text = std::env::var(CONFIG_ENV).expect("the child's configuration");
    let config = ValidConfig::from_toml_str(&text).expect("valid configuration");
    let service = config.build().expect("service starts");
    let ready = format!(
        "READY native={} resp={} metrics={}\n",
        service.native_addr(),
        service.resp_addr(),
        service.metrics_addr()
    );
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(ready.as_bytes()).expect("the READY line");
    stdout.flush().expect("flush");
    drop(stdout);
    // Serve until the parent closes our stdin.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    service.stop();
}

/// The service in a child process, stopped by closing its stdin (and killed by PID if it does
/// not exit in time).
struct ChildService {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    native: SocketAddr,
    resp: SocketAddr,
    metrics: SocketAddr,
}

impl ChildService {
    fn start(listen: &str) -> Self {
        Self::start_with(listen, "")
    }

    /// A child with `limits` as its `[limits]` section.
    fn start_with(listen: &str, limits: &str) -> Self {
        let config = format!(
            "[store]\nkind = \"memory\"\n\n[limits]\n{limits}\n\n[listen]\nnative = \"127.0.0.1:0\"\nresp = \
             \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n{listen}\n\n[[tenants]]\nname = \
             \"{}\"\nrights = [\"read\", \"write\"]\n",
            tenant(0)
        );
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "child_service", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .env(CONFIG_ENV, &config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the child service");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may print the test's name on the same line first.
                if let Some(at) = line.find("READY ") {
                    let _ = tx.send(line[at..].to_owned());
                }
            }
        });
        let line = match rx.recv_timeout(WAIT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("the child service printed no READY line within {WAIT:?}");
            }
        };
        let field = |name: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
        };
        let (native, resp, metrics) = (field("native"), field("resp"), field("metrics"));
        Self { child: Some(child), stdin, native, resp, metrics }
    }

    /// VmRSS of the child, in bytes.
    fn rss(&self) -> u64 {
        let pid = self.child.as_ref().map_or(0, Child::id);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .expect("the child's /proc status");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        kib << 10
    }

    fn metrics(&self) -> String {
        let mut s = TcpStream::connect_timeout(&self.metrics, WAIT).expect("metrics connect");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .expect("metrics request");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("metrics answer");
        text
    }

    /// The value of `gpucache_connections_refused_total{front,reason}`.
    fn refused(&self, front: &str, reason: &str) -> u64 {
        let series =
            format!("gpucache_connections_refused_total{{front=\"{front}\",reason=\"{reason}\"}} ");
        let text = self.metrics();
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in the scrape:\n{text}"))
    }

    /// The value of an unlabelled gauge.
    fn gauge(&self, name: &str) -> u64 {
        let text = self.metrics();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in the scrape:\n{text}"))
    }

    fn stop(mut self) {
        drop(self.stdin.take());
        let mut child = self.child.take().expect("a child");
        let pid = child.id();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        match rx.recv_timeout(WAIT) {
            Ok(status) => {
                let status = status.expect("wait");
                assert!(status.success(), "the child service exited with {status}");
            }
            Err(_) => {
                // SAFETY: kills our own child process, which outlived its deadline.
                unsafe { libc::kill(i32::try_from(pid).unwrap_or(0), libc::SIGKILL) };
                panic!("the child service did not stop within {WAIT:?}");
            }
        }
        let _ = waiter.join();
    }
}

impl Drop for ChildService {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A TCP connection to `to` from the loopback address `from` (bound before connecting).
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let SocketAddr::V4(to) = to else { panic!("IPv4 only") };
    let sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).expect("AF_INET"),
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_in>()).expect("len");
    // SAFETY: plain socket calls on a descriptor this function owns; the addresses are valid
    // sockaddr_in values that live across the calls.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let stream = TcpStream::from_raw_fd(fd);
        let local = sockaddr(SocketAddrV4::new(from, 0));
        let bound = libc::bind(fd, std::ptr::from_ref(&local).cast(), len);
        assert_eq!(bound, 0, "bind {from}: {}", std::io::Error::last_os_error());
        let remote = sockaddr(to);
        let connected = libc::connect(fd, std::ptr::from_ref(&remote).cast(), len);
        assert_eq!(connected, 0, "connect {to} from {from}: {}", std::io::Error::last_os_error());
        stream
    }
}

/// Waits until the server closed `stream` (its end of the stream arrived, or a reset) and
/// returns how long that took; panics past `limit`.
fn wait_closed_by_server(stream: &TcpStream, limit: Duration) -> Duration {
    let start = Instant::now();
    let mut pfd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    loop {
        let left = limit.saturating_sub(start.elapsed());
        assert!(!left.is_zero(), "the server did not close the connection within {limit:?}");
        let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX).max(1);
        // SAFETY: polls one descriptor this test owns.
        let ready = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        if ready > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            return start.elapsed();
        }
    }
}

/// Whether the server closes `stream` within `limit` (waiting at most that long for it).
fn closed_within(stream: &TcpStream, limit: Duration) -> bool {
    let mut pfd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    let ms = libc::c_int::try_from(limit.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: polls one descriptor this test owns, for at most `limit`.
    let ready = unsafe { libc::poll(&raw mut pfd, 1, ms) };
    ready > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

fn hello_frame() -> Vec<u8> {
    Request::Hello {
        tenant: tenant(0),
        client_name: "hostile".into(),
        rights: Rights::READ_WRITE,
        auth: None,
    }
    .to_frame_bytes(1)
    .expect("hello")
}

/// Reads one whole response frame from `s`.
fn read_frame(s: &mut TcpStream) -> Response {
    let mut all = vec![0u8; HEADER_BYTES];
    s.read_exact(&mut all).expect("a response header");
    let header: [u8; HEADER_BYTES] = all[..].try_into().expect("header");
    let len = usize::try_from(FrameHeader::from_bytes(&header).body_len).expect("len");
    all.resize(HEADER_BYTES + len, 0);
    s.read_exact(&mut all[HEADER_BYTES..]).expect("a response body");
    let mut input: &[u8] = &all;
    let frame = gpucache_wire::FrameDecoder::new()
        .feed(&mut input)
        .expect("a frame")
        .expect("a whole frame");
    Response::from_frame(&frame).expect("a response")
}

/// The header of a PUT whose body is announced as `len` bytes (its checksum never matches:
/// these bodies are never completed).
fn big_put_header(len: u32) -> [u8; HEADER_BYTES] {
    let mut h = FrameHeader::new(Kind::Request, Op::Put, 2, &[]);
    h.body_len = len;
    h.to_bytes()
}

/// Writes as much of `bytes` as the server takes within `limit`; how many went.
fn write_some(s: &mut TcpStream, bytes: &[u8], limit: Duration) -> usize {
    s.set_write_timeout(Some(Duration::from_millis(200))).expect("timeout");
    let start = Instant::now();
    let mut sent = 0;
    while sent < bytes.len() && start.elapsed() < limit {
        match s.write(&bytes[sent..]) {
            Ok(0) | Err(_) if start.elapsed() >= limit => break,
            Ok(0) => break,
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    sent
}

fn hostile_address(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 3 + u8::try_from(i % 10).expect("small"))
}

/// Runs `op` once: a well-behaved client from its own address is never refused, whatever the
/// hostile addresses hold (their connections and their share of the budget are their own).
fn must<T>(what: &str, op: impl FnOnce() -> Result<T, String>) -> T {
    op().unwrap_or_else(|e| panic!("{what} failed under the hostile load: {e}"))
}

/// A RESP exchange on a fresh connection: sends `request`, reads `len` bytes of answer.
fn redis_exchange(resp: SocketAddr, request: &[u8], len: usize) -> Result<Vec<u8>, String> {
    let mut s = TcpStream::connect(resp).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(WAIT)).map_err(|e| e.to_string())?;
    s.write_all(request).map_err(|e| e.to_string())?;
    let mut answer = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match s.read(&mut answer[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(e.to_string()),
        }
    }
    answer.truncate(got);
    if answer.first() == Some(&b'-') {
        return Err(String::from_utf8_lossy(&answer).into_owned());
    }
    Ok(answer)
}

/// The good clients' work: native PUT then GET of fresh keys, and RESP SET then GET, every value
/// checked byte for byte, until `stop`.
fn good_clients(
    native: SocketAddr,
    resp: SocketAddr,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let caller = Caller::new(tenant(0), Rights::READ_WRITE);
        let mut i: u32 = 0;
        while !stop.load(Ordering::Acquire) {
            i += 1;
            let value = fixture::payload(u64::from(i), 64 << 10);
            let [_, a, b, c] = i.to_be_bytes();
            let chain = [b'g', a, b, c];
            let key = fixture::key(0, &chain, KvDtype::F16, 16);
            must("a good PUT", || {
                let client = TcpStore::new(ClientConfig::new(native, caller.clone()));
                match client.put(&caller, &key, &value, None) {
                    Ok(Put::Committed(_) | Put::AlreadyCommitted) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            });
            let dst = must("a good GET", || {
                let client = TcpStore::new(ClientConfig::new(native, caller.clone()));
                let mut dst = vec![0u8; value.len()];
                match client.get_into(&caller, &key, &mut dst) {
                    Ok(Get::Hit { len, .. }) if usize::try_from(len) == Ok(value.len()) => Ok(dst),
                    other => Err(format!("{other:?}")),
                }
            });
            assert!(dst == value, "GET {i} returned other bytes");
            // Dropped again, so that the store's own memory stays flat through the run.
            must("a good INVALIDATE", || {
                let client = TcpStore::new(ClientConfig::new(native, caller.clone()));
                client.invalidate(&caller, &key).map_err(|e| e.to_string())
            });

            let name = format!("good-{i}");
            let mut set = Vec::new();
            gpucache_service::resp::encode_request(&[b"SET", name.as_bytes(), &value], &mut set);
            let ok = must("a good SET", || redis_exchange(resp, &set, 5));
            assert_eq!(ok, b"+OK\r\n", "SET {i}");
            let mut get = Vec::new();
            gpucache_service::resp::encode_request(&[b"GET", name.as_bytes()], &mut get);
            let head = format!("${}\r\n", value.len());
            let answer =
                must("a good GET", || redis_exchange(resp, &get, head.len() + value.len() + 2));
            assert_eq!(&answer[..head.len()], head.as_bytes(), "GET {i} length line");
            assert!(answer[head.len()..head.len() + value.len()] == value[..], "GET {i} bytes");
            let mut del = Vec::new();
            gpucache_service::resp::encode_request(&[b"DEL", name.as_bytes()], &mut del);
            let deleted = must("a good DEL", || redis_exchange(resp, &del, 4));
            assert_eq!(deleted, b":1\r\n", "DEL {i}");
            done.fetch_add(1, Ordering::AcqRel);
        }
    })
}

/// One hostile request of the big kind, as it ended for its writer.
struct BigRequest {
    native: bool,
    stream: TcpStream,
    /// Body bytes the server took.
    sent: usize,
    /// The server answered `Overloaded` (native).
    overloaded: bool,
}

/// Announces a 64 MiB request (a native PUT after HELLO for even `i`, a RESP SET for odd) and
/// sends `body` (63 MiB) of it, or as much as the server takes within a second.
fn big_request(i: usize, native: SocketAddr, resp: SocketAddr, body: &[u8]) -> BigRequest {
    let is_native = i.is_multiple_of(2);
    // Native ones from 127.0.0.40 and .41, RESP ones from .42 and .43.
    let peer = (i / 2) % BIG_PEERS + if is_native { 0 } else { BIG_PEERS };
    let from = Ipv4Addr::new(127, 0, 0, 40 + u8::try_from(peer).expect("small"));
    let announced = 64u32 << 20;
    let mut stream = if is_native {
        let mut s = connect_from(from, native);
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        s.write_all(&hello_frame()).expect("HELLO");
        match read_frame(&mut s) {
            Response::Hello { .. } => {}
            // The address's share is held by its other requests: even HELLO is refused.
            Response::Error(WireError::Overloaded { scope: InflightScope::Peer, max, .. })
                if max == PEER_SHARE =>
            {
                return BigRequest { native: true, stream: s, sent: 0, overloaded: true };
            }
            other => panic!("HELLO answered {other:?}"),
        }
        s.write_all(&big_put_header(announced)).expect("a PUT header");
        s
    } else {
        let mut s = connect_from(from, resp);
        let head = format!("*3\r\n$3\r\nSET\r\n$4\r\nbig{}\r\n${announced}\r\n", i % 10);
        s.write_all(head.as_bytes()).expect("a SET head");
        s
    };
    let sent = write_some(&mut stream, body, Duration::from_secs(1));
    let mut overloaded = false;
    if is_native && sent < body.len() {
        // Refused at its header: the answer is Overloaded with the numbers.
        stream.set_read_timeout(Some(Duration::from_secs(1))).expect("timeout");
        let mut header = [0u8; HEADER_BYTES];
        if stream.read_exact(&mut header).is_ok() {
            let len = usize::try_from(FrameHeader::from_bytes(&header).body_len).expect("len");
            let mut all = header.to_vec();
            all.resize(HEADER_BYTES + len, 0);
            if stream.read_exact(&mut all[HEADER_BYTES..]).is_ok() {
                let mut input: &[u8] = &all;
                let frame = gpucache_wire::FrameDecoder::new().feed(&mut input);
                if let Ok(Some(frame)) = frame {
                    overloaded = matches!(
                        Response::from_frame(&frame),
                        Ok(Response::Error(WireError::Overloaded {
                            scope: InflightScope::Peer,
                            max,
                            ..
                        })) if max == PEER_SHARE
                    );
                }
            }
        }
    }
    BigRequest { native: is_native, stream, sent, overloaded }
}

#[test]
fn stalled_requests_are_bounded_by_the_budget_and_cut_at_their_deadlines() {
    let service = ChildService::start(
        "connections_max = 512\nconnections_per_peer_max = 100\ninflight_body_bytes_max = \
         \"320MiB\"\npeer_inflight_body_bytes_max = \"64MiB\"\nbody_timeout_ms = 2000\n\
         hello_timeout_ms = 1500\n",
    );
    let idle_rss = service.rss();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let good = good_clients(service.native, service.resp, Arc::clone(&stop), Arc::clone(&done));

    // 300 half-sent frames and commands: half a native header (no HELLO), half a RESP command.
    let mut half = Vec::new();
    let half_header = &hello_frame()[..HEADER_BYTES / 2];
    for i in 0..300 {
        let from = hostile_address(i);
        let (addr, bytes): (SocketAddr, &[u8]) = if i.is_multiple_of(2) {
            (service.native, half_header)
        } else {
            (service.resp, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10")
        };
        let mut s = connect_from(from, addr);
        s.write_all(bytes).expect("half a request");
        half.push((i.is_multiple_of(2), Instant::now(), s));
    }

    // 100 connections at once that announce 64 MiB and send 63 MiB of it (or as much as the
    // server takes), then stall; half native PUTs after HELLO, half RESP SETs.
    let chunk = Arc::new(vec![0x5Au8; 63 << 20]);
    let (native, resp) = (service.native, service.resp);
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..100 {
        let (tx, chunk) = (tx.clone(), Arc::clone(&chunk));
        std::thread::spawn(move || {
            let _ = tx.send(big_request(i, native, resp, &chunk));
        });
    }
    drop(tx);
    let mut peak = service.rss();
    let mut stalled = Vec::new();
    while stalled.len() < 100 {
        // Sampling the server's memory while the requests arrive.
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(done) => stalled.push(done),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("a hostile writer died: {e}"),
        }
        peak = peak.max(service.rss());
    }
    let refused_native = stalled.iter().filter(|b| b.overloaded).count();
    // The server took more of these bodies than socket buffers hold: it was reading them.
    let stalled_native = stalled.iter().filter(|b| b.native && b.sent > 16 << 20).count();
    let in_flight = service.gauge("gpucache_request_body_bytes_inflight");
    assert!(in_flight <= BUDGET, "{in_flight} bytes charged, over the budget");
    for _ in 0..10 {
        peak = peak.max(service.rss());
    }
    let over = peak.saturating_sub(idle_rss);
    eprintln!(
        "VmRSS idle {} MiB, peak under load {} MiB: {} MiB above idle with a {} MiB budget",
        idle_rss / MIB,
        peak / MIB,
        over / MIB,
        BUDGET / MIB
    );
    assert!(
        over <= BUDGET + OVERHEAD,
        "the server grew {} MiB under stalled requests; the budget is {} MiB (+{} MiB overhead)",
        over / MIB,
        BUDGET / MIB,
        OVERHEAD / MIB
    );
    assert!(refused_native > 0, "no native request was answered Overloaded");
    assert!(stalled_native > 0, "no native request was admitted and stalled");

    // Every half-sent request is cut: HELLO-less native ones at the HELLO deadline (1.5 s), RESP
    // ones at the body deadline (2 s); the stalled bodies at the body deadline.
    for (native, since, s) in &half {
        let _ = wait_closed_by_server(s, WAIT);
        let took = since.elapsed();
        let deadline = if *native { 1500 } else { 2000 };
        assert!(
            took >= Duration::from_millis(deadline) - Duration::from_millis(50),
            "a half-sent request was closed after {took:?}, before its deadline"
        );
    }
    for b in &stalled {
        let _ = wait_closed_by_server(&b.stream, WAIT);
    }
    stop.store(true, Ordering::Release);
    if good.join().is_err() {
        let scrape = service.metrics();
        let counted: Vec<&str> = scrape
            .lines()
            .filter(|l| l.starts_with("gpucache_connections_refused_total") && !l.ends_with(" 0"))
            .collect();
        panic!("a good client failed (above); the server counted {counted:#?}");
    }
    assert!(done.load(Ordering::Acquire) > 0, "the good clients completed nothing");
    // Every request was answered or its connection closed: nothing is charged any more.
    assert_eq!(service.gauge("gpucache_request_body_bytes_inflight"), 0, "charges left behind");

    assert!(service.refused("native", "hello_timeout") >= 150);
    assert!(service.refused("resp", "body_timeout") >= 150);
    assert!(service.refused("native", "peer_inflight_bytes") > 0);
    assert!(service.refused("resp", "peer_inflight_bytes") > 0);
    assert!(service.refused("native", "body_timeout") > 0, "stalled native bodies are cut");
    service.stop();
}

#[test]
fn per_peer_limits_unauthenticated_oversize_and_write_deadlines() {
    let service = ChildService::start(
        "connections_per_peer_max = 3\nwrite_timeout_ms = 1500\nhello_timeout_ms = 30000\n",
    );
    let from = Ipv4Addr::new(127, 0, 0, 21);
    let held: Vec<TcpStream> = (0..3).map(|_| connect_from(from, service.native)).collect();
    let mut fourth = connect_from(from, service.native);
    fourth.set_read_timeout(Some(WAIT)).expect("timeout");
    match read_frame(&mut fourth) {
        Response::Error(WireError::Busy { connections: 3, max: 3 }) => {}
        other => panic!("the fourth connection of one address got {other:?}"),
    }
    let mut resp = connect_from(from, service.resp);
    resp.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut line = String::new();
    BufReader::new(&mut resp).read_line(&mut line).expect("a refusal line");
    assert!(line.starts_with("-ERR max number of clients reached for this address"), "{line}");
    // Another address is another peer.
    let mut other = connect_from(Ipv4Addr::new(127, 0, 0, 22), service.native);
    other.set_read_timeout(Some(WAIT)).expect("timeout");
    // Before HELLO, a frame announcing more than 64 KiB is refused outright.
    other.write_all(&big_put_header(1 << 20)).expect("a header");
    match read_frame(&mut other) {
        Response::Error(WireError::TooLarge { len, max: 65_536 }) => assert_eq!(len, 1 << 20),
        other => panic!("an oversize frame before HELLO got {other:?}"),
    }
    drop(held);

    // A pipelined reader that stops reading is cut at the write deadline of one response.
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(service.native, caller.clone()));
    let key = fixture::key(0, b"big", KvDtype::F16, 16);
    let value = fixture::payload(7, 16 << 20);
    assert!(matches!(client.put(&caller, &key, &value, None), Ok(Put::Committed(_))));
    let mut slow = connect_from(Ipv4Addr::new(127, 0, 0, 23), service.native);
    slow.set_read_timeout(Some(WAIT)).expect("timeout");
    slow.write_all(&hello_frame()).expect("HELLO");
    assert!(matches!(read_frame(&mut slow), Response::Hello { .. }));
    let get = |id: u64| {
        Request::Get {
            items: vec![gpucache_wire::GetItem { key: key.clone(), capacity: 16 << 20 }],
        }
        .to_frame_bytes(id)
        .expect("GET frame")
    };
    for id in 2..6 {
        slow.write_all(&get(id)).expect("a pipelined GET");
    }
    // The client drains slowly, 64 KiB at a time, waiting up to 100 ms for the server's close
    // between reads: each write of the server makes progress well within 1.5 s, so only a
    // deadline for the whole response cuts it.
    let start = Instant::now();
    let mut drip = vec![0u8; 64 << 10];
    let took = loop {
        if closed_within(&slow, Duration::from_millis(100)) {
            break start.elapsed();
        }
        assert!(start.elapsed() < WAIT, "the slow reader was never cut");
        match slow.read(&mut drip) {
            Ok(0) | Err(_) => break start.elapsed(),
            Ok(_) => {}
        }
    };
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_secs(10),
        "a reader that drains slowly was cut after {took:?}, the write deadline is 1.5 s"
    );
    assert_eq!(service.refused("native", "per_peer"), 1);
    assert_eq!(service.refused("resp", "per_peer"), 1);
    assert_eq!(service.refused("native", "oversize"), 1);
    assert!(service.refused("native", "write_timeout") >= 1);
    service.stop();
}

#[test]
fn idle_connections_are_closed_at_the_idle_timeout() {
    let service = ChildService::start(
        "idle_timeout_ms = 1500\nhello_timeout_ms = 1000\nbody_timeout_ms = 1000\n",
    );
    let opened = Instant::now();
    let mut native = connect_from(Ipv4Addr::new(127, 0, 0, 31), service.native);
    native.set_read_timeout(Some(WAIT)).expect("timeout");
    native.write_all(&hello_frame()).expect("HELLO");
    assert!(matches!(read_frame(&mut native), Response::Hello { .. }));
    let resp = connect_from(Ipv4Addr::new(127, 0, 0, 31), service.resp);
    // Both said nothing more (RESP needs no AUTH here): closed at the idle timeout, not before.
    for (name, s) in [("native", &native), ("resp", &resp)] {
        let _ = wait_closed_by_server(s, WAIT);
        let took = opened.elapsed();
        assert!(
            took >= Duration::from_millis(1400) && took < Duration::from_secs(10),
            "an idle {name} connection was closed after {took:?}; idle_timeout_ms is 1500"
        );
    }
    assert_eq!(service.refused("native", "idle_timeout"), 1);
    assert_eq!(service.refused("resp", "idle_timeout"), 1);
    assert_eq!(service.refused("native", "hello_timeout"), 0);
    service.stop();
}

#[test]
fn a_body_past_the_server_budget_is_refused_before_it_is_read() {
    let service = ChildService::start_with(
        "inflight_body_bytes_max = \"1MiB\"\n",
        "object_bytes_max = \"1MiB\"\n",
    );
    let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 51), service.native);
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    s.write_all(&hello_frame()).expect("HELLO");
    assert!(matches!(read_frame(&mut s), Response::Hello { .. }));
    s.write_all(&big_put_header(2 << 20)).expect("a header");
    match read_frame(&mut s) {
        Response::Error(WireError::Overloaded {
            scope: InflightScope::Server,
            requested,
            in_flight: 0,
            max,
        }) => assert_eq!((requested, max), (2 << 20, MIB)),
        other => panic!("a body over the budget got {other:?}"),
    }
    let _ = wait_closed_by_server(&s, WAIT);
    assert_eq!(service.refused("native", "inflight_bytes"), 1);
    assert_eq!(service.gauge("gpucache_request_body_bytes_inflight"), 0);
    assert_eq!(service.gauge("gpucache_limit_request_body_bytes_inflight"), MIB);
    service.stop();
}
