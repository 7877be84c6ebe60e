//! Redis as a peer: `redis-server` started per point on a free loopback port with persistence
//! off, driven by a small binary-safe RESP2 client (SET and GET of bulk strings), one connection
//! per client thread.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::load::{self, KvClient, LoadSpec, PointResult};
use super::process::{ChildGuard, free_port, loopback};

/// How long `redis-server` may take to answer PING.
const START_DEADLINE: Duration = Duration::from_secs(20);
/// Every socket read and write of the client must finish within this.
const IO_DEADLINE: Duration = Duration::from_secs(30);
/// Longest status, error or length line accepted from the server.
const LINE_BYTES_MAX: usize = 64 << 10;
/// Largest bulk reply accepted into a fresh buffer (GET writes into the caller's instead).
const BULK_BYTES_MAX: usize = 512 << 20;

/// A RESP2 reply, as far as this client needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RespReply {
    Simple(String),
    Error(String),
    Integer(i64),
    /// `None` is the nil bulk string.
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<RespReply>>),
}

/// A blocking RESP2 client on one connection.
#[derive(Debug)]
pub(super) struct RespClient {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    header: Vec<u8>,
    line: Vec<u8>,
}

fn protocol(detail: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("RESP: {detail}"))
}

impl RespClient {
    pub(super) fn connect(addr: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect_timeout(&addr, IO_DEADLINE)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(IO_DEADLINE))?;
        stream.set_write_timeout(Some(IO_DEADLINE))?;
        let writer = stream.try_clone()?;
        Ok(Self {
            reader: BufReader::with_capacity(64 << 10, stream),
            writer,
            header: Vec::with_capacity(256),
            line: Vec::with_capacity(64),
        })
    }

    /// Sends one command whose last argument is `tail` (a value sent from the caller's buffer
    /// without copying it), the rest from `args`.
    fn send(&mut self, args: &[&[u8]], tail: Option<&[u8]>) -> io::Result<()> {
        let count = args.len() + usize::from(tail.is_some());
        self.header.clear();
        write!(self.header, "*{count}\r\n")?;
        for a in args {
            write!(self.header, "${}\r\n", a.len())?;
            self.header.extend_from_slice(a);
            self.header.extend_from_slice(b"\r\n");
        }
        let Some(tail) = tail else { return self.writer.write_all(&self.header) };
        write!(self.header, "${}\r\n", tail.len())?;
        super::raw::write_all_vectored(&mut self.writer, &[&self.header, tail, b"\r\n"])
    }

    /// Reads one CRLF-ended line into `self.line`, without the CRLF.
    fn read_line(&mut self) -> io::Result<()> {
        self.line.clear();
        let n =
            (&mut self.reader).take(LINE_BYTES_MAX as u64 + 2).read_until(b'\n', &mut self.line)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if !self.line.ends_with(b"\r\n") {
            return Err(protocol("line not ended by CRLF within the limit"));
        }
        self.line.truncate(self.line.len() - 2);
        Ok(())
    }

    fn line_int(&self) -> io::Result<i64> {
        std::str::from_utf8(&self.line[1..]).ok().and_then(|t| t.parse().ok()).ok_or_else(|| {
            protocol(format!("bad length {:?}", String::from_utf8_lossy(&self.line)))
        })
    }

    fn expect_crlf(&mut self) -> io::Result<()> {
        let mut end = [0u8; 2];
        self.reader.read_exact(&mut end)?;
        if &end != b"\r\n" {
            return Err(protocol("bulk string not followed by CRLF"));
        }
        Ok(())
    }

    /// Reads one whole reply.
    pub(super) fn read_reply(&mut self) -> io::Result<RespReply> {
        self.read_line()?;
        let text = || String::from_utf8_lossy(&self.line[1..]).into_owned();
        match self.line.first() {
            Some(b'+') => Ok(RespReply::Simple(text())),
            Some(b'-') => Ok(RespReply::Error(text())),
            Some(b':') => self.line_int().map(RespReply::Integer),
            Some(b'$') => {
                let len = self.line_int()?;
                if len < 0 {
                    return Ok(RespReply::Bulk(None));
                }
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&l| l <= BULK_BYTES_MAX)
                    .ok_or_else(|| protocol(format!("bulk of {len} bytes is too large")))?;
                let mut data = vec![0u8; len];
                self.reader.read_exact(&mut data)?;
                self.expect_crlf()?;
                Ok(RespReply::Bulk(Some(data)))
            }
            Some(b'*') => {
                let count = self.line_int()?;
                if count < 0 {
                    return Ok(RespReply::Array(None));
                }
                let items = (0..count).map(|_| self.read_reply()).collect::<io::Result<_>>()?;
                Ok(RespReply::Array(Some(items)))
            }
            _ => Err(protocol(format!("unknown reply {:?}", String::from_utf8_lossy(&self.line)))),
        }
    }

    /// Any command; its reply.
    pub(super) fn command(&mut self, args: &[&[u8]]) -> io::Result<RespReply> {
        self.send(args, None)?;
        self.read_reply()
    }

    /// `SET key value`; an error unless the answer is `+OK`.
    pub(super) fn set(&mut self, key: &[u8], value: &[u8]) -> io::Result<()> {
        self.send(&[b"SET", key], Some(value))?;
        match self.read_reply()? {
            RespReply::Simple(s) if s == "OK" => Ok(()),
            other => Err(protocol(format!("SET answered {other:?}"))),
        }
    }

    /// `GET key` straight into `dst`: the value's length, `None` for nil. A value longer than
    /// `dst` is read and dropped, and is an error.
    pub(super) fn get_into(&mut self, key: &[u8], dst: &mut [u8]) -> io::Result<Option<usize>> {
        self.send(&[b"GET", key], None)?;
        self.read_line()?;
        match self.line.first() {
            Some(b'$') => {}
            Some(b'-') => {
                return Err(protocol(format!("GET: {}", String::from_utf8_lossy(&self.line[1..]))));
            }
            _ => {
                return Err(protocol(format!(
                    "GET answered {:?}",
                    String::from_utf8_lossy(&self.line)
                )));
            }
        }
        let len = self.line_int()?;
        let Ok(len) = usize::try_from(len) else { return Ok(None) };
        if len > dst.len() {
            let skipped = io::copy(&mut (&mut self.reader).take(len as u64 + 2), &mut io::sink())?;
            return Err(protocol(format!(
                "GET value of {len} bytes does not fit {} (skipped {skipped})",
                dst.len()
            )));
        }
        self.reader.read_exact(&mut dst[..len])?;
        self.expect_crlf()?;
        Ok(Some(len))
    }
}

/// A load-driver client on Redis: key `index` is `k<index>`.
struct RedisClient {
    client: RespClient,
    key: Vec<u8>,
}

impl RedisClient {
    fn key(&mut self, index: u64) -> &[u8] {
        self.key.clear();
        // Writing to a Vec cannot fail.
        let _ = write!(self.key, "k{index}");
        &self.key
    }
}

impl KvClient for RedisClient {
    fn put(&mut self, index: u64, value: &[u8]) -> Result<(), String> {
        self.key(index);
        self.client.set(&self.key, value).map_err(|e| format!("SET: {e}"))
    }

    fn get(&mut self, index: u64, dst: &mut [u8]) -> Result<usize, String> {
        self.key(index);
        match self.client.get_into(&self.key, dst) {
            Ok(Some(len)) => Ok(len),
            Ok(None) => Err(format!("GET k{index}: nil")),
            Err(e) => Err(format!("GET: {e}")),
        }
    }
}

/// `redis-server --version`'s first line, or `None` when it is not on PATH.
pub(super) fn version() -> Option<String> {
    super::process::found_on_path("redis-server")
        .then(|| super::process::version_line(Path::new("redis-server"), &["--version"]))
        .flatten()
}

/// How a `redis-server` keeps its data: not at all (the `redis` row), or in an append-only file
/// flushed before every reply (`always`) or once a second (`everysec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Persistence {
    Off,
    AofAlways,
    AofEverysec,
}

impl Persistence {
    pub(super) fn peer_name(self) -> &'static str {
        match self {
            Persistence::Off => "redis",
            Persistence::AofAlways => "redis-aof-always",
            Persistence::AofEverysec => "redis-aof-everysec",
        }
    }

    pub(super) fn note(self) -> &'static str {
        match self {
            Persistence::Off => {
                "redis-server, no persistence, one RESP2 connection per client thread, SET / GET"
            }
            Persistence::AofAlways => {
                "redis-server, append-only file in a fresh directory per point, appendfsync \
                 always (flushed before each reply), no snapshots or AOF rewrites; GET from \
                 memory"
            }
            Persistence::AofEverysec => {
                "redis-server, append-only file in a fresh directory per point, appendfsync \
                 everysec (flushed once a second), no snapshots or AOF rewrites; GET from memory"
            }
        }
    }
}

/// The arguments of one `redis-server`: loopback only, no snapshots, the append-only file as
/// `persistence` says (never rewritten during a point), `maxmemory` sized for the working set
/// and refusing rather than evicting.
pub(super) fn server_args(
    port: u16,
    maxmemory_bytes: u64,
    dir: &Path,
    persistence: Persistence,
) -> Vec<String> {
    let (appendonly, fsync) = match persistence {
        Persistence::Off => ("no", "everysec"),
        Persistence::AofAlways => ("yes", "always"),
        Persistence::AofEverysec => ("yes", "everysec"),
    };
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        appendonly,
        "--appendfsync",
        fsync,
        "--auto-aof-rewrite-percentage",
        "0",
        "--protected-mode",
        "no",
        "--maxmemory",
        &maxmemory_bytes.to_string(),
        "--maxmemory-policy",
        "noeviction",
        "--dir",
        &dir.display().to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Room for the working set, Redis's per-key overhead, and each client's query and output
/// buffers (a whole value each way).
pub(super) fn maxmemory(working_set_bytes: u64, spec: &LoadSpec) -> u64 {
    let buffers = 2 * spec.clients as u64 * spec.value_bytes as u64;
    working_set_bytes + working_set_bytes / 4 + buffers + (256 << 20)
}

/// Measures one point on a `redis-server` of its own; with an append-only file, in a directory
/// of its own, removed afterwards.
pub(super) fn measure(
    scratch: &Path,
    spec: LoadSpec,
    working_set_bytes: u64,
    persistence: Persistence,
) -> PointResult {
    let size = spec.value_bytes as u64;
    let fail = |e: String| PointResult::failed(size, spec.clients, e);
    let tag = format!("{}-{}-{}", persistence.peer_name(), spec.value_bytes, spec.clients);
    let data = if persistence == Persistence::Off {
        scratch.to_owned()
    } else {
        if let Err(e) =
            super::filestore::ensure_room(scratch, super::filestore::disk_needed(&spec), &tag)
        {
            return fail(e);
        }
        let d = scratch.join(format!("data-{tag}"));
        if let Err(e) = std::fs::create_dir_all(&d) {
            return fail(format!("{}: {e}", d.display()));
        }
        d
    };
    let result = run_server(scratch, &data, &tag, spec, working_set_bytes, persistence);
    if data != scratch
        && let Err(e) = std::fs::remove_dir_all(&data)
    {
        eprintln!("bench: cannot remove {}: {e}", data.display());
    }
    result
}

fn run_server(
    scratch: &Path,
    data: &Path,
    tag: &str,
    spec: LoadSpec,
    working_set_bytes: u64,
    persistence: Persistence,
) -> PointResult {
    let fail = |e: String| PointResult::failed(spec.value_bytes as u64, spec.clients, e);
    let port = match free_port() {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let mut command = Command::new("redis-server");
    command.args(server_args(port, maxmemory(working_set_bytes, &spec), data, persistence));
    let log = scratch.join(format!("{tag}.log"));
    let mut child = match ChildGuard::spawn("redis-server", command, &log, false) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let addr = loopback(port);
    if let Err(e) = child.wait_listening(addr, Instant::now() + START_DEADLINE) {
        return fail(e);
    }
    match RespClient::connect(addr).and_then(|mut c| c.command(&[b"PING"])) {
        Ok(RespReply::Simple(s)) if s == "PONG" => {}
        other => return fail(format!("redis-server did not answer PING: {other:?}")),
    }
    let result = load::run(spec, |_| {
        RespClient::connect(addr)
            .map(|client| RedisClient { client, key: Vec::with_capacity(32) })
            .map_err(|e| format!("connect {addr}: {e}"))
    });
    drop(child);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use gpucache_dataplane::caller::{Caller, Rights};
    use gpucache_dataplane::clock::MonotonicClock;
    use gpucache_dataplane::identity::TenantId;
    use gpucache_dataplane::limits::ResourceLimits;
    use gpucache_service::resp::{RespConfig, RespServer};
    use gpucache_storage::MemoryStore;

    /// The client against our own RESP listener, in process: binary-safe values (CR, LF, NUL),
    /// nil for a missing key, errors as values, a value too large for the buffer.
    #[test]
    fn the_client_talks_to_our_resp_listener() {
        let store = Arc::new(
            MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
                .expect("store"),
        );
        let caller = Caller::new(TenantId::parse("t").expect("tenant"), Rights::READ_WRITE);
        let config = RespConfig::new("127.0.0.1:0".parse().expect("addr"), caller).expect("config");
        let server = RespServer::start(config, store).expect("start");
        let mut c = RespClient::connect(server.local_addr()).expect("connect");
        assert_eq!(c.command(&[b"PING"]).expect("ping"), RespReply::Simple("PONG".into()));

        let value: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).chain(*b"\r\n\0").collect();
        c.set(b"key\r\n1", &value).expect("set");
        let mut dst = vec![0u8; value.len() + 10];
        assert_eq!(c.get_into(b"key\r\n1", &mut dst).expect("get"), Some(value.len()));
        assert_eq!(&dst[..value.len()], &value[..]);
        assert_eq!(c.get_into(b"absent", &mut dst).expect("get"), None);
        assert_eq!(
            c.command(&[b"MGET", b"key\r\n1", b"absent"]).expect("mget"),
            RespReply::Array(Some(vec![
                RespReply::Bulk(Some(value.clone())),
                RespReply::Bulk(None)
            ]))
        );
        assert_eq!(c.command(&[b"EXISTS", b"key\r\n1"]).expect("exists"), RespReply::Integer(1));
        // Create-only: another value under the same key is an error reply, not a broken stream.
        assert!(c.set(b"key\r\n1", b"other").is_err());
        let mut small = [0u8; 16];
        assert!(c.get_into(b"key\r\n1", &mut small).is_err());
        // The stream is still in step after the refused SET and the skipped value.
        assert_eq!(c.command(&[b"PING"]).expect("ping"), RespReply::Simple("PONG".into()));
        assert_eq!(server.shutdown(), 0);
    }

    #[test]
    fn server_args_bind_loopback_without_persistence() {
        let args = server_args(6400, 1 << 30, Path::new("/tmp/x"), Persistence::Off);
        let joined = args.join(" ");
        assert!(joined.contains("--bind 127.0.0.1"), "{joined}");
        assert!(joined.contains("--appendonly no"), "{joined}");
        let save = args.iter().position(|a| a == "--save").expect("save");
        assert_eq!(args[save + 1], "");
        assert!(joined.contains("--maxmemory 1073741824"), "{joined}");
    }

    #[test]
    fn aof_rows_flush_as_named_and_never_rewrite() {
        for (p, fsync) in
            [(Persistence::AofAlways, "always"), (Persistence::AofEverysec, "everysec")]
        {
            let joined = server_args(6400, 1 << 30, Path::new("/d"), p).join(" ");
            assert!(joined.contains("--appendonly yes"), "{joined}");
            assert!(joined.contains(&format!("--appendfsync {fsync} ")), "{joined}");
            assert!(joined.contains("--auto-aof-rewrite-percentage 0"), "{joined}");
            assert!(joined.contains("--dir /d"), "{joined}");
            assert!(p.peer_name().starts_with("redis-aof-"));
        }
    }

    #[test]
    fn maxmemory_holds_every_client_buffer() {
        let spec = |clients| LoadSpec {
            value_bytes: 4 << 20,
            clients,
            keys: 128,
            phase: Duration::from_secs(1),
        };
        let one = maxmemory(512 << 20, &spec(1));
        let many = maxmemory(512 << 20, &spec(32));
        assert_eq!(many - one, 2 * 31 * (4 << 20));
        assert!(one >= (512 << 20) + (128 << 20));
    }
}
