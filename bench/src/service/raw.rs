//! The raw-socket peer: the ceiling of `ours-tcp` on this machine, in this run.
//!
//! A bare blocking TCP server, a thread of the bench process on 127.0.0.1 and a free port, and
//! the shared load loop's client threads, one blocking [`TcpStream`] (`TCP_NODELAY`) each. Every
//! operation moves the same bytes as one of ours over TCP ([`FrameSizes`], taken from the wire
//! crate's own encoding of a one-key GET and PUT and their answers):
//!
//! - GET: the client writes a request of a one-key GET request's size; the server answers with
//!   a prefix of a GET answer's size less the value, then the value (one vectored write of the
//!   prefix and the value buffer as it lies in memory);
//! - PUT: the client writes a prefix of a PUT request's size less the value, then the value; the
//!   server reads the value straight into its value buffer and answers with an acknowledgement
//!   of a PUT answer's size.
//!
//! What it does not do: no key lookup, no hashing or checksum, no store, no allocation per
//! operation, no limits or tenants. Each connection's server thread holds ONE value buffer of
//! the point's size: the PUTs overwrite it and the GETs answer it, with the requested key's
//! index written into its first 8 bytes so that the driver's sampled full comparison holds (the
//! rest of the bytes are those the last PUT delivered).

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::store::Put;
use gpucache_wire::{Fetched, GetItem, HEADER_BYTES, PutItem, Request, Response};

use super::load::{self, KvClient, LoadSpec, PointResult};

/// Every socket read and write on either side must finish within this.
const IO_DEADLINE: Duration = Duration::from_secs(30);
/// Most filler bytes (the stand-in for keys and answer fields) a frame of this protocol holds.
const FILLER_BYTES_MAX: usize = 4096;

/// What the first header byte says a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    Get = 1,
    Put = 2,
    GetAnswer = 3,
    PutAnswer = 4,
}

const OP_GET: u8 = Op::Get as u8;
const OP_PUT: u8 = Op::Put as u8;
/// Where the body length (u64, little-endian) and the key index (u64) lie in the header.
const AT_LEN: usize = 8;
const AT_INDEX: usize = 16;

/// Bytes on the wire of ours over TCP for one value of a given size, each from the wire crate's
/// encoding of that frame (header included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameSizes {
    pub value_bytes: usize,
    /// A GET request for one key.
    pub get_request: usize,
    /// A GET answer for one hit, less the value.
    pub get_answer_overhead: usize,
    /// A PUT request of one block, less the value.
    pub put_request_overhead: usize,
    /// A PUT answer for one block.
    pub put_answer: usize,
}

impl FrameSizes {
    /// The sizes for values of `value_bytes` under the bench's first key (`k0`).
    pub(crate) fn for_value(value_bytes: usize) -> Result<Self, String> {
        let tenant = gpucache_dataplane::identity::TenantId::parse(super::ours::TENANT)
            .map_err(|e| format!("bench tenant: {e}"))?;
        let key = super::ours::keys(&tenant, 1)?.pop().ok_or("no key")?;
        let value = vec![0u8; value_bytes];
        let checksum = Checksum::of(&value);
        let frame = |r: Result<Vec<u8>, gpucache_wire::WireError>| {
            r.map(|f| f.len()).map_err(|e| format!("encoding a frame: {e}"))
        };
        let capacity = value_bytes as u64;
        let get_request = frame(
            Request::Get { items: vec![GetItem { key: key.clone(), capacity }] }.to_frame_bytes(1),
        )?;
        let put_answer =
            frame(Response::Put(vec![Ok(Put::Committed(checksum))]).to_frame_bytes(1))?;
        let put_request = frame(
            Request::Put { items: vec![PutItem { key, request: None, data: value.clone() }] }
                .to_frame_bytes(1),
        )?;
        let get_answer = frame(
            Response::Get(vec![Ok(Fetched::Hit { checksum, data: value })]).to_frame_bytes(1),
        )?;
        Self::from_frames(value_bytes, get_request, get_answer, put_request, put_answer)
    }

    /// The sizes from whole frame lengths, checked to hold a header and at most
    /// [`FILLER_BYTES_MAX`] bytes besides the header and the value.
    fn from_frames(
        value_bytes: usize,
        get_request: usize,
        get_answer: usize,
        put_request: usize,
        put_answer: usize,
    ) -> Result<Self, String> {
        let overhead = |what: &str, frame: usize, value: usize| {
            frame
                .checked_sub(value)
                .filter(|o| (HEADER_BYTES..=HEADER_BYTES + FILLER_BYTES_MAX).contains(o))
                .ok_or_else(|| {
                    format!("a {what} frame of {frame} bytes for a {value}-byte value is not sized")
                })
        };
        Ok(Self {
            value_bytes,
            get_request: overhead("GET request", get_request, 0)?,
            get_answer_overhead: overhead("GET answer", get_answer, value_bytes)?,
            put_request_overhead: overhead("PUT request", put_request, value_bytes)?,
            put_answer: overhead("PUT answer", put_answer, 0)?,
        })
    }
}

/// A frame's header-sized prefix: the op, the body length and the key index, zero elsewhere.
fn header(op: Op, body_len: usize, index: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0] = op as u8;
    h[AT_LEN..AT_LEN + 8].copy_from_slice(&(body_len as u64).to_le_bytes());
    h[AT_INDEX..AT_INDEX + 8].copy_from_slice(&index.to_le_bytes());
    h
}

fn parse_header(h: &[u8]) -> (u8, u64, u64) {
    let word = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[at..at + 8]);
        u64::from_le_bytes(b)
    };
    (h[0], word(AT_LEN), word(AT_INDEX))
}

/// A frame of `total` bytes whose prefix is [`header`] followed by zero filler.
fn prefix(op: Op, total: usize, body_len: usize) -> Vec<u8> {
    let mut p = vec![0u8; total];
    p[..HEADER_BYTES].copy_from_slice(&header(op, body_len, 0));
    p
}

fn stamp_index(frame: &mut [u8], index: u64) {
    frame[AT_INDEX..AT_INDEX + 8].copy_from_slice(&index.to_le_bytes());
}

fn protocol(detail: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("raw socket: {detail}"))
}

/// Writes every byte of `bufs` in as few `writev(2)` calls as the socket takes (the same
/// vectored write the service's lent GETs use).
pub(super) fn write_all_vectored(stream: &mut impl Write, bufs: &[&[u8]]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
    gpucache_wire::write_all_vectored(stream, &mut slices)
}

fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_DEADLINE))?;
    stream.set_write_timeout(Some(IO_DEADLINE))
}

/// The server: an accept thread that starts one thread per connection, up to a limit.
pub(crate) struct RawServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<Vec<String>>>,
}

impl RawServer {
    /// Listens on 127.0.0.1 and a free port; at most `connections_max` connections are served
    /// (more are closed at once).
    pub(crate) fn start(sizes: FrameSizes, connections_max: usize) -> Result<Self, String> {
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(|e| format!("raw socket: bind: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("raw socket: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let accept = std::thread::Builder::new()
            .name("raw-socket-accept".into())
            .spawn(move || accept_loop(&listener, &flag, sizes, connections_max))
            .map_err(|e| format!("raw socket: cannot start the server thread: {e}"))?;
        Ok(Self { addr, stop, accept: Some(accept) })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, waits for every connection to end (its client closes it, or the I/O
    /// deadline passes) and returns the errors the server met.
    pub(crate) fn finish(mut self) -> Vec<String> {
        self.shut()
    }

    fn shut(&mut self) -> Vec<String> {
        let Some(accept) = self.accept.take() else { return Vec::new() };
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the blocking accept; it sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, IO_DEADLINE);
        accept.join().unwrap_or_else(|_| vec!["the accept thread panicked".into()])
    }
}

impl Drop for RawServer {
    fn drop(&mut self) {
        self.shut();
    }
}

fn accept_loop(
    listener: &TcpListener,
    stop: &AtomicBool,
    sizes: FrameSizes,
    connections_max: usize,
) -> Vec<String> {
    let mut errors = Vec::new();
    let mut served: Vec<JoinHandle<Result<(), String>>> = Vec::new();
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        match stream {
            Ok(s) if served.len() < connections_max => {
                let spawned = std::thread::Builder::new()
                    .name("raw-socket-conn".into())
                    .spawn(move || serve(s, sizes).map_err(|e| e.to_string()));
                match spawned {
                    Ok(h) => served.push(h),
                    Err(e) => errors.push(format!("cannot start a connection thread: {e}")),
                }
            }
            Ok(s) => drop(s),
            Err(e) => errors.push(format!("accept: {e}")),
        }
    }
    for h in served {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("a connection thread panicked".into()),
        }
    }
    errors
}

/// Reads a header into `h`; `false` when the peer closed the connection before its first byte.
fn read_header(stream: &mut TcpStream, h: &mut [u8; HEADER_BYTES]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < HEADER_BYTES {
        match stream.read(&mut h[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// One connection: requests in order until the client closes it.
fn serve(mut stream: TcpStream, sizes: FrameSizes) -> io::Result<()> {
    configure(&stream)?;
    let v = sizes.value_bytes;
    let mut value = vec![0u8; v];
    let mut filler = vec![0u8; FILLER_BYTES_MAX];
    let get_body = sizes.get_request - HEADER_BYTES;
    let put_filler = sizes.put_request_overhead - HEADER_BYTES;
    let get_answer = prefix(
        Op::GetAnswer,
        sizes.get_answer_overhead,
        sizes.get_answer_overhead - HEADER_BYTES + v,
    );
    let put_answer = prefix(Op::PutAnswer, sizes.put_answer, sizes.put_answer - HEADER_BYTES);
    let mut h = [0u8; HEADER_BYTES];
    while read_header(&mut stream, &mut h)? {
        let (op, len, index) = parse_header(&h);
        match op {
            OP_GET if len == get_body as u64 => {
                stream.read_exact(&mut filler[..get_body])?;
                let stamped = v.min(8);
                value[..stamped].copy_from_slice(&index.to_le_bytes()[..stamped]);
                write_all_vectored(&mut stream, &[&get_answer, &value])?;
            }
            OP_PUT if len == (put_filler + v) as u64 => {
                stream.read_exact(&mut filler[..put_filler])?;
                stream.read_exact(&mut value)?;
                stream.write_all(&put_answer)?;
            }
            _ => return Err(protocol(format!("unexpected frame: op {op}, body of {len} bytes"))),
        }
    }
    Ok(())
}

/// One client thread's connection.
struct RawClient {
    stream: TcpStream,
    sizes: FrameSizes,
    get_request: Vec<u8>,
    put_prefix: Vec<u8>,
    answer: Vec<u8>,
}

impl RawClient {
    fn connect(addr: SocketAddr, sizes: FrameSizes) -> Result<Self, String> {
        let stream = TcpStream::connect_timeout(&addr, IO_DEADLINE)
            .map_err(|e| format!("connect {addr}: {e}"))?;
        configure(&stream).map_err(|e| format!("socket options: {e}"))?;
        let v = sizes.value_bytes;
        Ok(Self {
            stream,
            sizes,
            get_request: prefix(Op::Get, sizes.get_request, sizes.get_request - HEADER_BYTES),
            put_prefix: prefix(
                Op::Put,
                sizes.put_request_overhead,
                sizes.put_request_overhead - HEADER_BYTES + v,
            ),
            answer: vec![0u8; sizes.get_answer_overhead.max(sizes.put_answer)],
        })
    }

    /// Reads an answer prefix of `len` bytes and checks its op and body length.
    fn read_answer(&mut self, len: usize, op: Op, body_len: usize) -> io::Result<()> {
        self.stream.read_exact(&mut self.answer[..len])?;
        let (got, got_len, _) = parse_header(&self.answer);
        if got != op as u8 || got_len != body_len as u64 {
            return Err(protocol(format!("answer op {got}, body of {got_len} bytes")));
        }
        Ok(())
    }
}

impl KvClient for RawClient {
    fn put(&mut self, index: u64, value: &[u8]) -> Result<(), String> {
        if value.len() != self.sizes.value_bytes {
            return Err(format!(
                "a {}-byte value for {}-byte frames",
                value.len(),
                self.sizes.value_bytes
            ));
        }
        stamp_index(&mut self.put_prefix, index);
        let sent = write_all_vectored(&mut self.stream, &[&self.put_prefix, value]);
        let n = self.sizes.put_answer;
        sent.and_then(|()| self.read_answer(n, Op::PutAnswer, n - HEADER_BYTES))
            .map_err(|e| format!("PUT: {e}"))
    }

    fn get(&mut self, index: u64, dst: &mut [u8]) -> Result<usize, String> {
        let v = self.sizes.value_bytes;
        if dst.len() < v {
            return Err(format!("a {}-byte buffer for a {v}-byte value", dst.len()));
        }
        stamp_index(&mut self.get_request, index);
        let n = self.sizes.get_answer_overhead;
        self.stream
            .write_all(&self.get_request)
            .and_then(|()| self.read_answer(n, Op::GetAnswer, n - HEADER_BYTES + v))
            .and_then(|()| self.stream.read_exact(&mut dst[..v]))
            .map_err(|e| format!("GET: {e}"))?;
        Ok(v)
    }
}

/// What the row's note says.
pub(crate) fn note(sizes: Option<FrameSizes>) -> String {
    let mut n = String::from(
        "bare blocking TCP server thread in the bench process, one connection per client \
         thread (TCP_NODELAY); the byte counts of our one-key GET and PUT frames and answers, \
         no lookup, no hashing, no store: one value buffer per connection, overwritten by PUTs \
         and answered by GETs; the ceiling of ours-tcp",
    );
    if let Some(s) = sizes {
        let _ = std::fmt::Write::write_fmt(
            &mut n,
            format_args!(
                " (per operation, at every value size: GET request {} B, answer {} B + value; \
                 PUT request {} B + value, answer {} B)",
                s.get_request, s.get_answer_overhead, s.put_request_overhead, s.put_answer
            ),
        );
    }
    n
}

/// Measures one point on a server of its own (started and stopped here).
pub(crate) fn measure(spec: LoadSpec) -> PointResult {
    let size = spec.value_bytes as u64;
    let fail = |e: String| PointResult::failed(size, spec.clients, e);
    let sizes = match FrameSizes::for_value(spec.value_bytes) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let server = match RawServer::start(sizes, spec.clients) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let addr = server.addr();
    let mut result = load::run(spec, |_| RawClient::connect(addr, sizes));
    let errors = server.finish();
    if !errors.is_empty() {
        let server = format!("server: {}", errors.join("; "));
        result.error = Some(match result.error.take() {
            Some(e) => format!("{e}; {server}"),
            None => server,
        });
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_sizes_come_from_the_wire_encoding() {
        let small = FrameSizes::for_value(4096).expect("sizes");
        let big = FrameSizes::for_value(1 << 20).expect("sizes");
        // The overheads do not grow with the value: only the value itself does.
        assert_eq!(small.get_request, big.get_request);
        assert_eq!(small.get_answer_overhead, big.get_answer_overhead);
        assert_eq!(small.put_request_overhead, big.put_request_overhead);
        assert_eq!(small.put_answer, big.put_answer);
        // A one-key GET request is a header and at least the key.
        assert!(small.get_request > HEADER_BYTES, "{small:?}");
        assert!(small.put_request_overhead > HEADER_BYTES, "{small:?}");
    }

    #[test]
    fn frames_without_room_for_a_header_are_refused() {
        assert!(FrameSizes::from_frames(100, 80, 180, 200, 70).is_ok());
        // A GET answer shorter than a header plus the value.
        let e = FrameSizes::from_frames(100, 80, 150, 200, 70).expect_err("short");
        assert!(e.contains("GET answer"), "{e}");
        // A PUT request carrying more than the filler limit besides the value.
        let e =
            FrameSizes::from_frames(100, 80, 180, 100 + HEADER_BYTES + FILLER_BYTES_MAX + 1, 70)
                .expect_err("long");
        assert!(e.contains("PUT request"), "{e}");
    }

    /// The server and client end to end: the bytes a GET answers are those the last PUT sent,
    /// with the requested index in front, and each side moves exactly the sized frames.
    #[test]
    fn the_server_answers_the_last_value_put_with_the_index_stamped() {
        let sizes = FrameSizes::for_value(10_000).expect("sizes");
        let server = RawServer::start(sizes, 1).expect("start");
        let mut c = RawClient::connect(server.addr(), sizes).expect("connect");
        let value: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        c.put(7, &value).expect("put");
        let mut dst = vec![0u8; 10_000];
        assert_eq!(c.get(42, &mut dst).expect("get"), 10_000);
        assert_eq!(&dst[..8], &42u64.to_le_bytes());
        assert_eq!(&dst[8..], &value[8..]);
        assert!(c.put(1, &value[..10]).is_err(), "a value of another size is refused");
        drop(c);
        assert_eq!(server.finish(), Vec::<String>::new());
    }

    #[test]
    fn a_malformed_frame_is_a_server_error() {
        let sizes = FrameSizes::for_value(1000).expect("sizes");
        let server = RawServer::start(sizes, 1).expect("start");
        let mut s = TcpStream::connect(server.addr()).expect("connect");
        s.write_all(&header(Op::Put, 5, 0)).expect("write");
        // The server closes the connection on the bad frame.
        let mut buf = [0u8; 1];
        assert_eq!(s.read(&mut buf).expect("read"), 0);
        drop(s);
        let errors = server.finish();
        assert!(errors.iter().any(|e| e.contains("unexpected frame")), "{errors:?}");
    }

    #[test]
    fn a_point_runs_and_verifies_its_gets() {
        let spec = LoadSpec {
            value_bytes: 65_536,
            clients: 2,
            keys: 16,
            phase: Duration::from_millis(100),
        };
        let r = measure(spec);
        assert_eq!(r.error, None);
        assert_eq!(r.put.as_ref().map(|p| p.ops), Some(16));
        assert!(r.get.as_ref().is_some_and(|g| g.ops >= 16 && g.errors == 0), "{r:?}");
        assert!(r.verified > 0);
        assert_eq!(r.mismatches, 0);
    }
}
