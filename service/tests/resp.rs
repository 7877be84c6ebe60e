//! The RESP listener (`gpucache_service::resp`) over loopback, driven by a tiny RESP client:
//! every command, binary values, create-only SET and its options (expiry, NX, XX, GET), the
//! HELLO handshake and its RESP2 and RESP3 bytes, CLIENT, pipelining, malformed input (answered, then
//! the connection closes while others keep being served), the connection limit, rights and
//! tenants, and the decoder under arbitrary chunking and arbitrary bytes. When `redis-cli` is
//! installed, the real `redis-cli` and `redis-benchmark` run against it too
//! (`GPUCACHE_REQUIRE_REDIS_CLI=1` makes their absence a failure instead of a skip).
//!
//! A corrupt block reading as nil is tested next to the server, in the RESP front's unit tests
//! (`service/src/resp/tests.rs`), where `MemoryStore::corrupt_for_test` is available.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::{Clock, ManualClock, MonotonicClock, UnixClock};
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::counting::{Call, Counting};
use gpucache_dataplane::testing::fixture;
use gpucache_service::resp::{
    ARGS_MAX, IdentityTemplate, ProtocolError, REDIS_VERSION, Reply, RequestDecoder, RespConfig,
    RespLimits, RespServer, TRANSACTION_COMMANDS_MAX,
};
use gpucache_storage::MemoryStore;
use proptest::collection::vec;
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Helpers

fn memory_store(limits: ResourceLimits) -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(limits, Arc::new(MonotonicClock::default())).expect("store"))
}

fn config_for(caller: Caller) -> RespConfig {
    RespConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), caller).expect("config")
}

fn start(store: Arc<MemoryStore>) -> RespServer {
    RespServer::start(config_for(fixture::caller(0)), store).expect("start")
}

fn server() -> RespServer {
    start(memory_store(ResourceLimits::default()))
}

/// A tiny RESP client (RESP2 and the RESP3 types the front sends).
struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: SocketAddr) -> Self {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        s.set_nodelay(true).expect("nodelay");
        Self { writer: s.try_clone().expect("clone"), reader: BufReader::new(s) }
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).expect("send");
    }

    fn send(&mut self, args: &[&[u8]]) {
        let bytes = encode_request(args);
        self.send_raw(&bytes);
    }

    fn call(&mut self, args: &[&[u8]]) -> Reply {
        self.send(args);
        self.read()
    }

    fn read(&mut self) -> Reply {
        read_reply(&mut self.reader)
    }

    /// Whether the server closed the connection (EOF or reset) without sending more.
    fn closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.reader.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

fn encode_request(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn read_line(r: &mut BufReader<TcpStream>) -> Vec<u8> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line).expect("read reply line");
    assert!(line.ends_with(b"\r\n"), "reply line not ended by CRLF: {line:?}");
    line.truncate(line.len() - 2);
    line
}

fn number(text: &[u8]) -> i64 {
    std::str::from_utf8(text).ok().and_then(|t| t.parse().ok()).expect("a number")
}

fn read_reply(r: &mut BufReader<TcpStream>) -> Reply {
    let line = read_line(r);
    let (kind, rest) = line.split_first().expect("empty reply line");
    let text = || String::from_utf8(rest.to_vec()).expect("utf-8");
    match kind {
        b'+' => Reply::Simple(text()),
        b'-' => Reply::Error(text()),
        b':' => Reply::Integer(number(rest)),
        b'$' => match usize::try_from(number(rest)) {
            Err(_) => Reply::Nil,
            Ok(len) => Reply::Bulk(read_bulk(r, len)),
        },
        b'_' if rest.is_empty() => Reply::Nil,
        b'=' => {
            let data = read_bulk(r, usize::try_from(number(rest)).expect("verbatim length"));
            let text = data.strip_prefix(b"txt:").expect("a txt verbatim string");
            Reply::Verbatim(String::from_utf8(text.to_vec()).expect("utf-8"))
        }
        b'*' => {
            let n = usize::try_from(number(rest)).expect("array length");
            Reply::Array((0..n).map(|_| read_reply(r)).collect())
        }
        b'%' => {
            let n = usize::try_from(number(rest)).expect("map length");
            Reply::Map((0..n).map(|_| (read_reply(r), read_reply(r))).collect())
        }
        other => panic!("unknown reply type {:?}", char::from(*other)),
    }
}

fn read_bulk(r: &mut BufReader<TcpStream>, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len + 2];
    r.read_exact(&mut data).expect("bulk");
    assert_eq!(&data[len..], b"\r\n");
    data.truncate(len);
    data
}

fn ok() -> Reply {
    Reply::ok()
}

fn bulk(b: &[u8]) -> Reply {
    Reply::Bulk(b.to_vec())
}

#[track_caller]
fn assert_error(reply: &Reply, contains: &str) {
    match reply {
        Reply::Error(text) => {
            assert!(text.starts_with("ERR "), "error without a code: {text}");
            assert!(text.contains(contains), "{text:?} does not say {contains:?}");
        }
        other => panic!("expected an error saying {contains:?}, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Commands

#[test]
fn ping_answers_pong_or_echoes() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"PING"]), Reply::Simple("PONG".into()));
    assert_eq!(c.call(&[b"ping", b"hello world"]), bulk(b"hello world"));
    assert_error(&c.call(&[b"PING", b"a", b"b"]), "wrong number of arguments for 'ping'");
    // Inline form.
    c.send_raw(b"PING\r\n");
    assert_eq!(c.read(), Reply::Simple("PONG".into()));
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn set_get_round_trips_binary_values() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    let values: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (b"crlf".to_vec(), b"line one\r\nline two\r\n".to_vec()),
        (b"\x00bin\xffkey\r\n".to_vec(), (0..=255u8).collect()),
        (b"one-byte".to_vec(), vec![0]),
        (b"big".to_vec(), fixture::payload(9, 3 << 20)),
        (b"$3\r\n*1".to_vec(), b"*1\r\n$4\r\nPING\r\n".to_vec()),
    ];
    for (k, v) in &values {
        assert_eq!(c.call(&[b"SET", k, v]), ok(), "set {k:?}");
    }
    for (k, v) in &values {
        assert_eq!(c.call(&[b"GET", k]), bulk(v), "get {k:?}");
    }
    assert_eq!(c.call(&[b"GET", b"missing"]), Reply::Nil);
    // Keys are compared as bytes.
    assert_eq!(c.call(&[b"GET", b"CRLF"]), Reply::Nil);
    assert_error(&c.call(&[b"GET"]), "wrong number of arguments for 'get'");
    assert_error(&c.call(&[b"SET", b"k"]), "wrong number of arguments for 'set'");
    assert_error(&c.call(&[b"SET", b"empty", b""]), "empty values cannot be stored");
    assert_error(&c.call(&[b"SET", b"k", b"v", b"EX"]), "syntax error");
    assert_error(&c.call(&[b"SET", b"k", b"v", b"EXPIRE", b"10"]), "syntax error");
    assert_eq!(c.call(&[b"GET", b"k"]), Reply::Nil, "a refused SET stored nothing");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn set_is_create_only_and_nx_answers_nil_for_an_existing_key() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"SET", b"k", b"first", b"NX"]), ok());
    assert_eq!(c.call(&[b"SET", b"k", b"second", b"nx"]), Reply::Nil);
    assert_error(&c.call(&[b"SET", b"k", b"second"]), "holds a different value");
    assert_error(&c.call(&[b"SET", b"k", b"firs"]), "create-only");
    assert_error(&c.call(&[b"SET", b"k", b"first!"]), "create-only");
    assert_eq!(c.call(&[b"GET", b"k"]), bulk(b"first"), "a refused SET changed the value");
    // The key already holds exactly these bytes: that is what SET asked for.
    assert_eq!(c.call(&[b"SET", b"k", b"first"]), ok());
    assert_eq!(c.call(&[b"SET", b"k", b"first", b"NX"]), Reply::Nil);
    assert_eq!(c.call(&[b"DEL", b"k"]), Reply::Integer(1));
    assert_eq!(c.call(&[b"SET", b"k", b"second"]), ok());
    assert_eq!(c.call(&[b"GET", b"k"]), bulk(b"second"));
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn exists_and_del_count_keys() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"SET", b"a", b"1"]), ok());
    assert_eq!(c.call(&[b"SET", b"b", b"2"]), ok());
    // Like Redis, a key named twice counts twice.
    assert_eq!(c.call(&[b"EXISTS", b"a", b"b", b"c", b"a"]), Reply::Integer(3));
    assert_eq!(c.call(&[b"DEL", b"a", b"c", b"a"]), Reply::Integer(1));
    assert_eq!(c.call(&[b"EXISTS", b"a", b"b"]), Reply::Integer(1));
    assert_eq!(c.call(&[b"DEL", b"b"]), Reply::Integer(1));
    assert_eq!(c.call(&[b"EXISTS", b"b"]), Reply::Integer(0));
    assert_error(&c.call(&[b"EXISTS"]), "wrong number of arguments for 'exists'");
    assert_error(&c.call(&[b"del"]), "wrong number of arguments for 'del'");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn mset_and_mget() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"MSET", b"x", b"1", b"y", b"2\r\n"]), ok());
    assert_eq!(
        c.call(&[b"MGET", b"x", b"y", b"z", b"x"]),
        Reply::Array(vec![bulk(b"1"), bulk(b"2\r\n"), Reply::Nil, bulk(b"1")])
    );
    // Each pair is stored as SET would (the same bytes again are fine); MSET stops at the first
    // pair not stored.
    assert_eq!(c.call(&[b"MSET", b"x", b"1", b"v", b"5"]), ok());
    let r = c.call(&[b"MSET", b"z", b"3", b"x", b"9", b"w", b"4"]);
    assert_error(&r, "MSET stopped at pair 2 of 3 (key 'x')");
    assert_error(&r, "create-only");
    assert_eq!(
        c.call(&[b"MGET", b"z", b"x", b"w"]),
        Reply::Array(vec![bulk(b"3"), bulk(b"1"), Reply::Nil])
    );
    assert_eq!(c.call(&[b"GET", b"v"]), bulk(b"5"));
    assert_error(&c.call(&[b"MSET", b"a"]), "wrong number of arguments for 'mset'");
    assert_error(&c.call(&[b"MSET", b"a", b"1", b"b"]), "wrong number of arguments");
    assert_error(&c.call(&[b"MGET"]), "wrong number of arguments for 'mget'");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn info_reports_a_redis_version_and_the_store() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"SET", b"a", b"1"]), ok());
    let Reply::Bulk(info) = c.call(&[b"INFO"]) else { panic!("INFO is not a bulk string") };
    let info = String::from_utf8(info).expect("utf-8");
    for line in [
        &format!("redis_version:{REDIS_VERSION}\r\n"),
        &format!("gpucache_version:{}\r\n", env!("CARGO_PKG_VERSION")),
        "gpucache_store:memory\r\n",
        "gpucache_tenant:tenant-a\r\n",
        &format!("tcp_port:{}\r\n", server.local_addr().port()),
        "connected_clients:1\r\n",
        "committed_blocks:1\r\n",
        "db0:keys=1,expires=0,avg_ttl=0\r\n",
    ] {
        assert!(info.contains(line), "INFO lacks {line:?}:\n{info}");
    }
    for section in ["# Server", "# Clients", "# Stats", "# Keyspace"] {
        assert!(info.contains(section), "INFO lacks {section}");
    }
    let Reply::Bulk(only) = c.call(&[b"INFO", b"keyspace"]) else { panic!("not bulk") };
    let only = String::from_utf8(only).expect("utf-8");
    assert!(only.starts_with("# Keyspace\r\n") && !only.contains("# Server"), "{only}");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn the_commands_clients_send_at_startup() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"COMMAND"]), Reply::Array(vec![]));
    assert_eq!(c.call(&[b"COMMAND", b"DOCS"]), Reply::Array(vec![]));
    assert_eq!(c.call(&[b"COMMAND", b"COUNT"]), Reply::Integer(0));
    assert_eq!(c.call(&[b"CONFIG", b"GET", b"save"]), Reply::Array(vec![bulk(b"save"), bulk(b"")]));
    assert_eq!(
        c.call(&[b"CONFIG", b"GET", b"appendonly"]),
        Reply::Array(vec![bulk(b"appendonly"), bulk(b"no")])
    );
    assert_eq!(c.call(&[b"CONFIG", b"GET", b"maxmemory"]), Reply::Array(vec![]));
    assert_error(&c.call(&[b"CONFIG", b"SET", b"save", b""]), "only CONFIG GET");
    assert_eq!(c.call(&[b"SELECT", b"0"]), ok());
    assert_error(&c.call(&[b"SELECT", b"1"]), "DB index is out of range");
    assert_error(&c.call(&[b"SELECT", b"x"]), "not an integer");
    assert_eq!(c.call(&[b"FLUSHALL"]), Reply::Error("ERR unknown command 'FLUSHALL'".into()));
    assert_eq!(c.call(&[b"b\x00d\r\n"]), Reply::Error("ERR unknown command 'b?d??'".into()));
    assert_eq!(c.call(&[b"QUIT"]), ok());
    assert!(c.closed(), "QUIT did not close the connection");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    let mut batch = Vec::new();
    let mut want = Vec::new();
    for i in 0..300u32 {
        let key = format!("key-{i}").into_bytes();
        let value = fixture::payload(u64::from(i), 1 + usize::try_from(i).unwrap_or(0) * 17);
        batch.extend(encode_request(&[b"SET", &key, &value]));
        want.push(ok());
        batch.extend(encode_request(&[b"GET", &key]));
        want.push(Reply::Bulk(value));
        match i % 3 {
            0 => {
                batch.extend_from_slice(format!("PING {i}\r\n").as_bytes());
                want.push(bulk(i.to_string().as_bytes()));
            }
            1 => {
                batch.extend(encode_request(&[b"EXISTS", &key, b"nope"]));
                want.push(Reply::Integer(1));
            }
            _ => {
                batch.extend(encode_request(&[b"NOPE"]));
                want.push(Reply::Error("ERR unknown command 'NOPE'".into()));
            }
        }
    }
    c.send_raw(&batch);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&c.read(), w, "reply {i}");
    }
    assert_eq!(c.call(&[b"PING"]), Reply::Simple("PONG".into()));
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn a_transaction_runs_its_commands_at_exec_in_order() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    let mut other = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"MULTI"]), ok());
    assert_error(&c.call(&[b"MULTI"]), "can not be nested");
    let queued = Reply::Simple("QUEUED".into());
    for cmd in [
        &[&b"SET"[..], b"tx", b"one"][..],
        &[b"GET", b"tx"],
        &[b"SET", b"tx", b"two"],
        &[b"DEL", b"tx"],
        &[b"GET", b"tx"],
        &[b"SET", b"tx", b"three"],
    ] {
        assert_eq!(c.call(cmd), queued);
    }
    // Nothing has run yet.
    assert_eq!(other.call(&[b"GET", b"tx"]), Reply::Nil);
    let Reply::Array(replies) = c.call(&[b"EXEC"]) else { panic!("EXEC answers an array") };
    assert_eq!(replies.len(), 6);
    assert_eq!(replies[..2], [ok(), bulk(b"one")]);
    // A failed command inside does not stop the others, nor undo them.
    assert_error(&replies[2], "create-only");
    assert_eq!(replies[3..], [Reply::Integer(1), Reply::Nil, ok()]);
    assert_eq!(other.call(&[b"GET", b"tx"]), bulk(b"three"));
    assert_error(&c.call(&[b"EXEC"]), "EXEC without MULTI");
    assert_error(&c.call(&[b"DISCARD"]), "DISCARD without MULTI");
    assert_error(&c.call(&[b"WATCH", b"tx"]), "not supported");
    assert_eq!(server.shutdown(), 0);
}

fn execabort() -> Reply {
    Reply::Error("EXECABORT Transaction discarded because of previous errors.".into())
}

#[test]
fn a_discarded_or_refused_transaction_runs_nothing() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    let queued = Reply::Simple("QUEUED".into());
    assert_eq!(c.call(&[b"MULTI"]), ok());
    assert_eq!(c.call(&[b"SET", b"d", b"x"]), queued);
    assert_eq!(c.call(&[b"DISCARD"]), ok());
    assert_eq!(c.call(&[b"EXISTS", b"d"]), Reply::Integer(0));

    // An unknown command while queueing: EXEC aborts, and later commands were still queued.
    assert_eq!(c.call(&[b"MULTI"]), ok());
    assert_eq!(c.call(&[b"SET", b"d", b"x"]), queued);
    assert_error(&c.call(&[b"NOPE"]), "unknown command 'NOPE'");
    assert_eq!(c.call(&[b"PING"]), queued);
    assert_eq!(c.call(&[b"EXEC"]), execabort());
    assert_eq!(c.call(&[b"EXISTS", b"d"]), Reply::Integer(0));

    // One command past the limit: refused, and EXEC aborts.
    assert_eq!(c.call(&[b"MULTI"]), ok());
    let mut batch = Vec::new();
    for _ in 0..=TRANSACTION_COMMANDS_MAX {
        batch.extend(encode_request(&[b"SET", b"d", b"x"]));
    }
    c.send_raw(&batch);
    for i in 0..TRANSACTION_COMMANDS_MAX {
        assert_eq!(c.read(), queued, "command {i}");
    }
    assert_error(&c.read(), "transaction too large");
    assert_eq!(c.call(&[b"EXEC"]), execabort());
    assert_eq!(c.call(&[b"EXISTS", b"d"]), Reply::Integer(0));
    assert_eq!(server.shutdown(), 0);
}

// ---------------------------------------------------------------------------------------------
// Hostile input

#[test]
fn malformed_input_is_answered_then_closes_only_that_connection() {
    let server = server();
    let mut bystander = Client::connect(server.local_addr());
    assert_eq!(bystander.call(&[b"SET", b"k", b"v"]), ok());
    let cases: &[(&[u8], &str)] = &[
        (b"*1\r\n$abc\r\nPING\r\n", "Protocol error: invalid bulk length"),
        (b"*1\r\n$-5\r\n", "Protocol error: invalid bulk length"),
        (b"*5000\r\n", "Protocol error: 5000 arguments exceed the limit of 1024"),
        (b"*x\r\n", "Protocol error: invalid multibulk length"),
        (b"*2\r\n$3\r\nGET\r\n:1\r\n", "Protocol error: expected '$', got ':'"),
        (b"*2\r\n$3\r\nSET\r\n$999999999999\r\n", "Protocol error: bulk string of 999999999999"),
        (b"*1\r\n$4\r\nPINGxx", "Protocol error: bulk string not followed by CRLF"),
        (b"*11111111111111111111111111111111111111", "Protocol error: length line"),
    ];
    for (input, says) in cases {
        let mut c = Client::connect(server.local_addr());
        c.send_raw(input);
        assert_error(&c.read(), says);
        assert!(c.closed(), "the connection stayed open after {input:?}");
        assert_eq!(bystander.call(&[b"GET", b"k"]), bulk(b"v"), "after {input:?}");
    }
    // An inline line longer than the limit.
    let mut c = Client::connect(server.local_addr());
    c.send_raw(&vec![b'x'; 70 << 10]);
    assert_error(&c.read(), "Protocol error: inline request longer than 65536 bytes");
    assert!(c.closed());
    // Binary garbage on one line is an unknown inline command: answered, and the stream goes on.
    let mut c = Client::connect(server.local_addr());
    c.send_raw(b"\x00\xff\xfe garbage \x01\r\n");
    assert_error(&c.read(), "unknown command '???'");
    assert_eq!(c.call(&[b"GET", b"k"]), bulk(b"v"));
    // New connections are still served.
    let mut fresh = Client::connect(server.local_addr());
    assert_eq!(fresh.call(&[b"PING"]), Reply::Simple("PONG".into()));
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn the_connection_limit_refuses_one_more() {
    let mut config = config_for(fixture::caller(0));
    config.connections_max = 2;
    let server = RespServer::start(config, memory_store(ResourceLimits::default())).expect("start");
    let mut a = Client::connect(server.local_addr());
    let mut b = Client::connect(server.local_addr());
    assert_eq!(a.call(&[b"PING"]), Reply::Simple("PONG".into()));
    assert_eq!(b.call(&[b"PING"]), Reply::Simple("PONG".into()));
    let mut c = Client::connect(server.local_addr());
    assert_error(&c.read(), "max number of clients reached");
    assert!(c.closed());
    drop(a);
    // The slot comes back once the server notices the close.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.open_connections() > 1 {
        assert!(Instant::now() < deadline, "a closed connection kept its slot");
        // Polls a counter the server updates when it notices the close; bounded by the deadline.
        std::thread::park_timeout(Duration::from_millis(10));
    }
    let mut d = Client::connect(server.local_addr());
    assert_eq!(d.call(&[b"PING"]), Reply::Simple("PONG".into()));
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn the_request_limits_follow_the_object_limit() {
    let limits = ResourceLimits {
        object_bytes_max: 1024,
        tenant_inflight_bytes_max: 1 << 20,
        ..ResourceLimits::default()
    };
    let mut config = config_for(fixture::caller(0));
    config.limits = RespLimits::for_object_bytes_max(limits.object_bytes_max);
    let server = RespServer::start(config, memory_store(limits)).expect("start");
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"SET", b"fits", &[7; 1024]]), ok());
    // Over the object limit but within the slack: the store refuses, the connection goes on.
    assert_error(
        &c.call(&[b"SET", b"over", &[7; 2000]]),
        "refused: object of 2000 bytes exceeds object_bytes_max 1024",
    );
    assert_eq!(c.call(&[b"GET", b"fits"]), bulk(&[7; 1024]));
    // Beyond the slack: a protocol error, before the value is read.
    let too_big = 1024 + (64 << 10) + 1;
    c.send_raw(format!("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n${too_big}\r\n").as_bytes());
    assert_error(&c.read(), "Protocol error: bulk string of 66561 bytes exceeds the limit");
    assert!(c.closed());
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn an_mget_reply_is_bounded_like_a_request() {
    let mut config = config_for(fixture::caller(0));
    config.limits = RespLimits { bulk_bytes_max: 4096, request_bytes_max: 3000 };
    let server = RespServer::start(config, memory_store(ResourceLimits::default())).expect("start");
    let mut c = Client::connect(server.local_addr());
    for k in [&b"a"[..], b"b", b"c"] {
        assert_eq!(c.call(&[b"SET", k, &[1; 1024]]), ok());
    }
    assert_eq!(
        c.call(&[b"MGET", b"a", b"nope", b"b"]),
        Reply::Array(vec![bulk(&[1; 1024]), Reply::Nil, bulk(&[1; 1024])])
    );
    assert_error(&c.call(&[b"MGET", b"a", b"b", b"c"]), "MGET values exceed 3000 bytes");
    assert_eq!(c.call(&[b"PING"]), Reply::Simple("PONG".into()));
    assert_eq!(server.shutdown(), 0);
}

// ---------------------------------------------------------------------------------------------
// Tenants, rights, shutdown

#[test]
fn tenants_are_separate_namespaces_and_rights_apply() {
    let store = memory_store(ResourceLimits::default());
    let a = start(store.clone());
    let b = RespServer::start(config_for(fixture::caller(1)), store.clone()).expect("start b");
    let reader_caller = Caller::new(fixture::tenant(0), Rights::READ_ONLY);
    let reader = RespServer::start(config_for(reader_caller), store.clone()).expect("start r");
    let mut ca = Client::connect(a.local_addr());
    let mut cb = Client::connect(b.local_addr());
    let mut cr = Client::connect(reader.local_addr());
    assert_eq!(ca.call(&[b"SET", b"shared-name", b"from a"]), ok());
    assert_eq!(cb.call(&[b"GET", b"shared-name"]), Reply::Nil);
    assert_eq!(cb.call(&[b"SET", b"shared-name", b"from b"]), ok());
    assert_eq!(ca.call(&[b"GET", b"shared-name"]), bulk(b"from a"));
    assert_eq!(cb.call(&[b"GET", b"shared-name"]), bulk(b"from b"));
    // The read-only caller of tenant a reads a's values and may not write.
    assert_eq!(cr.call(&[b"GET", b"shared-name"]), bulk(b"from a"));
    assert_error(&cr.call(&[b"SET", b"new", b"x"]), "lacks the write right");
    assert_error(&cr.call(&[b"DEL", b"shared-name"]), "lacks the write right");
    assert_eq!(store.stats().committed_blocks, 2);
    for s in [a, b, reader] {
        assert_eq!(s.shutdown(), 0);
    }
}

#[test]
fn a_namespace_of_another_tenant_is_refused() {
    let mut config = config_for(fixture::caller(0));
    config.namespace = IdentityTemplate::for_tenant(&fixture::tenant(1)).expect("namespace");
    let err = RespServer::start(config, memory_store(ResourceLimits::default()))
        .expect_err("a foreign namespace was accepted");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

#[test]
fn a_custom_namespace_is_used_for_keys() {
    let store = memory_store(ResourceLimits::default());
    let mut config = config_for(fixture::caller(0));
    let model = fixture::identity(0, &[1, 2], gpucache_dataplane::identity::KvDtype::F16, 16);
    config.namespace = IdentityTemplate::from_identity(&model).expect("namespace");
    let namespace = config.namespace.clone();
    let server = RespServer::start(config, store.clone()).expect("start");
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"SET", b"k", b"v"]), ok());
    let key = namespace.key_for(b"k").expect("key");
    assert_eq!(key.identity().model_revision(), model.model_revision());
    let caller = fixture::caller(0);
    let mut buf = [0u8; 1];
    assert!(matches!(
        store.get_into(&caller, &key, &mut buf),
        Ok(gpucache_dataplane::store::Get::Hit { len: 1, .. })
    ));
    assert_eq!(&buf, b"v");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn shutdown_closes_idle_connections() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"PING"]), Reply::Simple("PONG".into()));
    let addr = server.local_addr();
    assert_eq!(server.shutdown(), 0);
    assert!(c.closed(), "an idle connection outlived shutdown");
    assert!(TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err());
}

// ---------------------------------------------------------------------------------------------
// The decoder

fn decode_chunked(bytes: &[u8], chunks: &[usize]) -> Result<Vec<Vec<Vec<u8>>>, ProtocolError> {
    let mut d = RequestDecoder::new(RespLimits::default());
    let mut out = Vec::new();
    let mut at = 0;
    let mut sizes = chunks.iter().copied().cycle();
    while at < bytes.len() {
        let size = sizes.next().unwrap_or(1).max(1);
        let end = bytes.len().min(at + size);
        d.feed(&bytes[at..end]);
        at = end;
        while let Some(r) = d.next_request()? {
            out.push(r);
        }
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn requests_decode_the_same_under_any_chunking(
        requests in vec(vec(vec(any::<u8>(), 0..40), 1..6), 1..12),
        chunks in vec(1usize..64, 1..8),
    ) {
        let mut bytes = Vec::new();
        for r in &requests {
            let args: Vec<&[u8]> = r.iter().map(Vec::as_slice).collect();
            bytes.extend(encode_request(&args));
        }
        prop_assert_eq!(decode_chunked(&bytes, &chunks), Ok(requests));
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_stay_bounded(
        bytes in vec(any::<u8>(), 0..2048),
        chunks in vec(1usize..128, 1..8),
    ) {
        if let Ok(requests) = decode_chunked(&bytes, &chunks) {
            for r in requests {
                prop_assert!(!r.is_empty() && r.len() <= ARGS_MAX);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The real redis-cli and redis-benchmark

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// Runs `bin args`, killing it after `limit`; returns (success, stdout, stderr).
fn run_bounded(bin: &str, args: &[&str], limit: Duration) -> (bool, String, String) {
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout")));
    let err = drain(Box::new(child.stderr.take().expect("stderr")));
    // Wait for the exit on another thread, so this one waits on a channel with a deadline.
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match rx.recv_timeout(limit) {
        Ok(status) => Some(status.expect("wait")),
        Err(_) => {
            // SAFETY: kills our own child process, which outlived its deadline.
            unsafe { libc::kill(i32::try_from(pid).unwrap_or(0), libc::SIGKILL) };
            None
        }
    };
    let _ = waiter.join();
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    assert!(status.is_some(), "{bin} {args:?} ran longer than {limit:?}\n{out}\n{err}");
    (status.is_some_and(|s| s.success()), out, err)
}

#[test]
fn real_redis_cli_and_redis_benchmark() {
    if !on_path("redis-cli") || !on_path("redis-benchmark") {
        assert!(
            std::env::var("GPUCACHE_REQUIRE_REDIS_CLI").ok().as_deref() != Some("1"),
            "redis-cli and redis-benchmark are required (GPUCACHE_REQUIRE_REDIS_CLI=1) but not \
             installed"
        );
        eprintln!(
            "SKIPPED: redis-cli/redis-benchmark are not installed (scripts/test.sh installs \
             redis-tools)"
        );
        return;
    }
    let store = memory_store(ResourceLimits::default());
    let server = start(store.clone());
    let port = server.local_addr().port().to_string();
    let limit = Duration::from_secs(60);
    let cli = |args: &[&str]| {
        let mut all = vec!["-h", "127.0.0.1", "-p", &port];
        all.extend_from_slice(args);
        let (ok, out, err) = run_bounded("redis-cli", &all, limit);
        assert!(ok, "redis-cli {args:?} failed:\n{out}\n{err}");
        out
    };
    assert_eq!(cli(&["ping"]), "PONG\n");
    assert_eq!(cli(&["set", "k", "v"]), "OK\n");
    assert_eq!(cli(&["get", "k"]), "v\n");
    assert_eq!(cli(&["set", "k", "w", "nx"]), "\n", "SET NX of an existing key is nil");
    assert!(cli(&["set", "k", "w"]).contains("create-only"));
    assert_eq!(cli(&["exists", "k", "nope"]), "1\n");
    assert!(cli(&["info", "server"]).contains(&format!("redis_version:{REDIS_VERSION}")));
    assert_eq!(cli(&["del", "k"]), "1\n");
    assert_eq!(cli(&["get", "k"]), "\n");

    let (ok, out, err) = run_bounded(
        "redis-benchmark",
        // 16 connections per test: the SET test's may still be closing on the server when the
        // GET test opens its own, and both together stay under the 64 per address it allows.
        &[
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "set,get",
            "-n",
            "2000",
            "-q",
            "-r",
            "1000",
            "-c",
            "16",
        ],
        limit,
    );
    assert!(ok, "redis-benchmark failed:\n{out}\n{err}");
    for test in ["SET: ", "GET: "] {
        assert!(out.contains(test), "redis-benchmark printed no {test:?} result:\n{out}\n{err}");
    }
    assert!(!err.contains("WARN"), "redis-benchmark warned:\n{err}");
    eprintln!("redis-benchmark against the RESP listener:\n{}", out.trim());
    // At most 1000 distinct keys; SET of an existing one is refused, so each holds one value.
    let committed = store.stats().committed_blocks;
    assert!((1..=1000).contains(&committed), "{committed} keys after the benchmark");
    assert_eq!(server.shutdown(), 0);
}

// ---------------------------------------------------------------------------------------------
// MGET and MSET as store batches

#[test]
fn mget_and_mset_go_to_the_store_as_one_batch_each() {
    let limits = ResourceLimits { object_bytes_max: 1024, ..ResourceLimits::default() };
    let store = Arc::new(Counting::new(memory_store(limits)));
    let server =
        RespServer::start(config_for(fixture::caller(0)), Arc::clone(&store) as Arc<dyn Store>)
            .expect("start");
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"MSET", b"a", b"1", b"b", b"22", b"c", b"333"]), ok());
    assert_eq!(store.take_calls(), [(Call::LookupBatch, 3), (Call::PutBatch, 3)]);
    assert_eq!(
        c.call(&[b"MGET", b"a", b"nope", b"c", b"b"]),
        Reply::Array(vec![bulk(b"1"), Reply::Nil, bulk(b"333"), bulk(b"22")])
    );
    assert_eq!(store.take_calls(), [(Call::LookupBatch, 4), (Call::GetBatch, 3)]);

    // A key that holds a value is settled as SET settles it, on its own, and the free keys
    // around it go in batches: the same value again is fine.
    assert_eq!(c.call(&[b"MSET", b"d", b"4", b"a", b"1", b"e", b"5"]), ok());
    assert_eq!(
        store.take_calls(),
        [
            (Call::LookupBatch, 3),
            (Call::PutBatch, 1),
            (Call::Put, 1),
            (Call::Lookup, 1),
            (Call::Get, 1),
            (Call::PutBatch, 1)
        ]
    );
    // A pair the store refuses after the lookup said its key was free: the pairs sent with it
    // in the same batch are reported.
    let r = c.call(&[b"MSET", b"f", b"6", b"g", &[7; 2000], b"h", b"8"]);
    assert_error(&r, "MSET stopped at pair 2 of 3 (key 'g'); the pairs before it were stored");
    assert_error(&r, "pair 3 went to the store with it in one batch and was stored");
    assert_error(&r, "refused: object of 2000 bytes exceeds object_bytes_max 1024");
    assert_eq!(
        c.call(&[b"MGET", b"f", b"g", b"h"]),
        Reply::Array(vec![bulk(b"6"), Reply::Nil, bulk(b"8")])
    );
    assert_eq!(server.shutdown(), 0);
}

// ---------------------------------------------------------------------------------------------
// The handshake of redis-py and other RESP3 clients, and SET's options

/// Sends `request` and reads exactly as many bytes as `want` holds: the reply must be those
/// bytes.
#[track_caller]
fn assert_bytes(c: &mut Client, request: &[&[u8]], want: &[u8]) {
    c.send(request);
    let mut got = vec![0u8; want.len()];
    c.reader.read_exact(&mut got).expect("reply bytes");
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(want), "{request:?}");
}

/// HELLO's fields after the `%7` or `*14` header, for connection `id` speaking `proto`.
fn hello_fields(id: u32, proto: u8) -> String {
    format!(
        "$6\r\nserver\r\n$8\r\ngpucache\r\n$7\r\nversion\r\n${}\r\n{REDIS_VERSION}\r\n\
         $5\r\nproto\r\n:{proto}\r\n$2\r\nid\r\n:{id}\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n\
         $4\r\nrole\r\n$6\r\nmaster\r\n$7\r\nmodules\r\n*0\r\n",
        REDIS_VERSION.len()
    )
}

#[test]
fn hello_3_switches_every_reply_to_resp3_and_hello_2_back() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    // RESP2 until HELLO: nil is `$-1`, CONFIG GET a flat array.
    assert_bytes(&mut c, &[b"GET", b"nothing"], b"$-1\r\n");
    assert_bytes(&mut c, &[b"CONFIG", b"GET", b"save"], b"*2\r\n$4\r\nsave\r\n$0\r\n\r\n");
    // HELLO without a version answers in the protocol in force and changes nothing.
    assert_bytes(&mut c, &[b"HELLO"], format!("*14\r\n{}", hello_fields(1, 2)).as_bytes());
    // The first connection of the server is id 1; the reply to HELLO 3 is itself RESP3.
    assert_bytes(&mut c, &[b"hello", b"3"], format!("%7\r\n{}", hello_fields(1, 3)).as_bytes());
    assert_bytes(&mut c, &[b"SET", b"k", b"v"], b"+OK\r\n");
    assert_bytes(&mut c, &[b"GET", b"nothing"], b"_\r\n");
    assert_bytes(&mut c, &[b"MGET", b"k", b"nothing"], b"*2\r\n$1\r\nv\r\n_\r\n");
    assert_bytes(&mut c, &[b"EXISTS", b"k"], b":1\r\n");
    assert_bytes(&mut c, &[b"CONFIG", b"GET", b"save"], b"%1\r\n$4\r\nsave\r\n$0\r\n\r\n");
    assert_bytes(&mut c, &[b"COMMAND", b"DOCS"], b"%0\r\n");
    assert_bytes(&mut c, &[b"CLIENT", b"GETNAME"], b"_\r\n");
    assert_bytes(&mut c, &[b"SET", b"k", b"v", b"NX"], b"_\r\n");
    assert_bytes(&mut c, &[b"PING"], b"+PONG\r\n");
    let Reply::Verbatim(info) = c.call(&[b"INFO", b"keyspace"]) else {
        panic!("INFO is not a verbatim string in RESP3")
    };
    assert!(info.starts_with("# Keyspace\r\ndb0:keys=1,expires=0"), "{info}");
    assert_error(&c.call(&[b"GET"]), "wrong number of arguments");
    // Back to RESP2.
    assert_bytes(&mut c, &[b"HELLO", b"2"], format!("*14\r\n{}", hello_fields(1, 2)).as_bytes());
    assert_bytes(&mut c, &[b"GET", b"nothing"], b"$-1\r\n");
    assert_eq!(c.call(&[b"INFO", b"keyspace"]), bulk(info.as_bytes()));
    // Another connection has its own id and starts in RESP2.
    let mut d = Client::connect(server.local_addr());
    assert_bytes(&mut d, &[b"GET", b"nothing"], b"$-1\r\n");
    assert_bytes(&mut d, &[b"CLIENT", b"ID"], b":2\r\n");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn a_refused_hello_changes_nothing() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    assert_eq!(
        c.call(&[b"HELLO", b"4"]),
        Reply::Error("NOPROTO unsupported protocol version; this server speaks 2 and 3".into())
    );
    assert!(matches!(c.call(&[b"HELLO", b"1"]), Reply::Error(e) if e.starts_with("NOPROTO ")));
    assert_error(&c.call(&[b"HELLO", b"three"]), "protocol version is not an integer");
    assert_error(&c.call(&[b"HELLO", b"3", b"SETNAME"]), "syntax error in HELLO option 'SETNAME'");
    assert_error(&c.call(&[b"HELLO", b"3", b"AUTH", b"user"]), "syntax error in HELLO option");
    assert_error(&c.call(&[b"HELLO", b"3", b"LOUDLY"]), "syntax error in HELLO option 'LOUDLY'");
    assert_error(&c.call(&[b"HELLO", b"3", b"SETNAME", b"has space"]), "printable ASCII");
    // AUTH inside HELLO meets the same refusal as AUTH when the tenant has no keys.
    assert_error(&c.call(&[b"HELLO", b"3", b"AUTH", b"default", b"pw"]), "AUTH <password>");
    assert_error(&c.call(&[b"AUTH", b"default", b"pw"]), "AUTH <password>");
    // Still RESP2, still unnamed.
    assert_bytes(&mut c, &[b"GET", b"nothing"], b"$-1\r\n");
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), Reply::Nil);
    // SETNAME inside HELLO names the connection.
    let Reply::Map(fields) = c.call(&[b"HELLO", b"3", b"setname", b"worker-1"]) else {
        panic!("HELLO 3 is not a map")
    };
    assert!(fields.contains(&(bulk(b"proto"), Reply::Integer(3))), "{fields:?}");
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), bulk(b"worker-1"));
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn client_subcommands_answer_as_redis_does() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    let Reply::Integer(id) = c.call(&[b"CLIENT", b"ID"]) else { panic!("CLIENT ID") };
    let Reply::Array(hello) = c.call(&[b"HELLO", b"2"]) else { panic!("HELLO 2") };
    assert_eq!(hello[6..8], [bulk(b"id"), Reply::Integer(id)], "HELLO names the same id");
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), Reply::Nil);
    assert_eq!(c.call(&[b"client", b"setname", b"lmcache-7"]), ok());
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), bulk(b"lmcache-7"));
    assert_error(&c.call(&[b"CLIENT", b"SETNAME", b"two words"]), "without spaces");
    assert_error(&c.call(&[b"CLIENT", b"SETNAME", b"line\n"]), "without spaces");
    let long = vec![b'n'; 257];
    assert_error(&c.call(&[b"CLIENT", b"SETNAME", &long]), "of 257 bytes is over the limit of 256");
    assert_eq!(c.call(&[b"CLIENT", b"SETNAME", &long[..256]]), ok());
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), bulk(&long[..256]));
    // An empty name removes the name.
    assert_eq!(c.call(&[b"CLIENT", b"SETNAME", b""]), ok());
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), Reply::Nil);
    // What redis-py sends after HELLO.
    assert_eq!(c.call(&[b"CLIENT", b"SETINFO", b"LIB-NAME", b"redis-py"]), ok());
    assert_eq!(c.call(&[b"CLIENT", b"SETINFO", b"lib-ver", b"8.1.0"]), ok());
    assert_error(&c.call(&[b"CLIENT", b"SETINFO", b"LIB-NAME", b"a b"]), "library name");
    assert_error(&c.call(&[b"CLIENT", b"SETINFO", b"LIB-COLOR", b"red"]), "LIB-NAME or LIB-VER");
    assert_error(&c.call(&[b"CLIENT", b"SETINFO", b"LIB-VER"]), "'client|setinfo'");
    assert_error(&c.call(&[b"CLIENT", b"ID", b"extra"]), "'client|id'");
    assert_error(&c.call(&[b"CLIENT"]), "wrong number of arguments for 'client'");
    for sub in [&b"LIST"[..], b"KILL", b"MAINT_NOTIFICATIONS", b"TRACKING"] {
        let r = c.call(&[b"CLIENT", sub, b"ON"]);
        assert_error(&r, "this server answers CLIENT ID, GETNAME, SETNAME and SETINFO");
        assert_error(&r, &String::from_utf8_lossy(sub));
    }
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn set_expiry_options_give_keys_a_deadline() {
    // The front's clock starts at the real Unix time and moves only when the test says.
    let clock = ManualClock::default();
    clock.advance_ms(UnixClock.now_ms());
    let mut config = config_for(fixture::caller(0));
    config.clock = Arc::new(clock.clone());
    let server = RespServer::start(config, memory_store(ResourceLimits::default())).expect("start");
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"SET", b"a", b"1", b"EX", b"100"]), ok());
    let Reply::Integer(ttl) = c.call(&[b"TTL", b"a"]) else { panic!("TTL") };
    assert!((99..=100).contains(&ttl), "TTL {ttl}");
    let Reply::Integer(pttl) = c.call(&[b"PTTL", b"a"]) else { panic!("PTTL") };
    assert!((90_000..=100_000).contains(&pttl), "PTTL {pttl}");
    assert_eq!(c.call(&[b"GET", b"a"]), bulk(b"1"));
    // The same value again with KEEPTTL keeps the deadline, without an option clears it.
    assert_eq!(c.call(&[b"SET", b"a", b"1", b"KEEPTTL"]), ok());
    assert!(matches!(c.call(&[b"TTL", b"a"]), Reply::Integer(99 | 100)));
    assert_eq!(c.call(&[b"SET", b"a", b"1"]), ok());
    assert_eq!(c.call(&[b"TTL", b"a"]), Reply::Integer(-1));
    assert_eq!(c.call(&[b"TTL", b"missing"]), Reply::Integer(-2));
    // A refused SET keeps the deadline the key had.
    assert_eq!(c.call(&[b"SET", b"b", b"2", b"PX", b"50000"]), ok());
    assert_error(&c.call(&[b"SET", b"b", b"other", b"EX", b"1"]), "create-only");
    let Reply::Integer(pttl) = c.call(&[b"PTTL", b"b"]) else { panic!("PTTL") };
    assert!((40_000..=50_000).contains(&pttl), "a refused SET moved the deadline: {pttl}");
    // A deadline in the past: stored, and gone at the next touch (GET, EXISTS, MGET, TTL).
    for (key, option) in [(&b"c"[..], &b"PXAT"[..]), (b"d", b"EXAT")] {
        assert_eq!(c.call(&[b"SET", key, b"3", option, b"1"]), ok());
        assert_eq!(c.call(&[b"GET", key]), Reply::Nil);
        assert_eq!(c.call(&[b"EXISTS", key]), Reply::Integer(0));
        assert_eq!(c.call(&[b"TTL", key]), Reply::Integer(-2));
    }
    assert_eq!(c.call(&[b"SET", b"e", b"5", b"PXAT", b"1"]), ok());
    assert_eq!(c.call(&[b"MGET", b"e", b"a"]), Reply::Array(vec![Reply::Nil, bulk(b"1")]));
    // An expired key is free: another value may take it, and DEL finds nothing.
    assert_eq!(c.call(&[b"SET", b"f", b"6", b"PXAT", b"1"]), ok());
    assert_eq!(c.call(&[b"SET", b"f", b"something else"]), ok());
    assert_eq!(c.call(&[b"GET", b"f"]), bulk(b"something else"));
    assert_eq!(c.call(&[b"SET", b"g", b"7", b"PXAT", b"1"]), ok());
    assert_eq!(c.call(&[b"DEL", b"g"]), Reply::Integer(0));
    // A short deadline passes when the clock does, not a millisecond before.
    assert_eq!(c.call(&[b"SET", b"h", b"8", b"PX", b"40"]), ok());
    clock.advance_ms(39);
    assert_eq!(c.call(&[b"PTTL", b"h"]), Reply::Integer(1));
    assert_eq!(c.call(&[b"GET", b"h"]), bulk(b"8"));
    clock.advance_ms(1);
    assert_eq!(c.call(&[b"GET", b"h"]), Reply::Nil);
    let Reply::Bulk(info) = c.call(&[b"INFO", b"keyspace"]) else { panic!("INFO") };
    assert!(String::from_utf8_lossy(&info).contains(",expires=1,"), "only b has a deadline");
    // Bad times and bad combinations.
    for bad in [&b"0"[..], b"-5"] {
        assert_error(&c.call(&[b"SET", b"x", b"1", b"EX", bad]), "invalid expire time in 'set'");
    }
    assert_error(&c.call(&[b"SET", b"x", b"1", b"PX", b"soon"]), "not an integer");
    assert_error(&c.call(&[b"SET", b"x", b"1", b"EX", b"999999999999999999"]), "invalid expire");
    for options in [
        &[&b"EX"[..], b"1", b"PX", b"1"][..],
        &[b"EX", b"1", b"KEEPTTL"],
        &[b"NX", b"XX"],
        &[b"EX"],
        &[b"PERSIST"],
    ] {
        let mut request: Vec<&[u8]> = vec![b"SET", b"x", b"1"];
        request.extend_from_slice(options);
        assert_eq!(c.call(&request), Reply::Error("ERR syntax error".into()), "{options:?}");
    }
    assert_eq!(c.call(&[b"EXISTS", b"x"]), Reply::Integer(0), "a refused SET stored nothing");
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn set_nx_xx_and_get_mean_what_they_say_over_a_create_only_store() {
    let server = server();
    let mut c = Client::connect(server.local_addr());
    // XX on a missing key: nil, nothing stored.
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"XX"]), Reply::Nil);
    assert_eq!(c.call(&[b"EXISTS", b"k"]), Reply::Integer(0));
    // GET answers the value before the SET (nil: none).
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"GET"]), Reply::Nil);
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"GET"]), bulk(b"v"));
    // XX on an existing key: the same bytes are success, other bytes cannot replace them.
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"XX"]), ok());
    assert_error(&c.call(&[b"SET", b"k", b"w", b"XX"]), "create-only");
    assert_error(&c.call(&[b"SET", b"k", b"w", b"GET"]), "create-only");
    // NX on an existing key: nil, whatever the bytes; with GET, the value held.
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"NX"]), Reply::Nil);
    assert_eq!(c.call(&[b"SET", b"k", b"w", b"NX", b"GET"]), bulk(b"v"));
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"XX", b"EX", b"100"]), ok());
    assert!(matches!(c.call(&[b"TTL", b"k"]), Reply::Integer(99 | 100)));
    assert_eq!(c.call(&[b"SET", b"j", b"v", b"XX", b"GET"]), Reply::Nil);
    assert_eq!(c.call(&[b"GET", b"k"]), bulk(b"v"));
    assert_eq!(c.call(&[b"GET", b"j"]), Reply::Nil);
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn the_deadline_table_is_bounded() {
    let mut config = config_for(fixture::caller(0));
    config.expiring_keys_max = 2;
    let server = RespServer::start(config, memory_store(ResourceLimits::default())).expect("start");
    let mut c = Client::connect(server.local_addr());
    assert_eq!(c.call(&[b"SET", b"a", b"1", b"EX", b"100"]), ok());
    assert_eq!(c.call(&[b"SET", b"b", b"2", b"EX", b"100"]), ok());
    let r = c.call(&[b"SET", b"c", b"3", b"EX", b"100"]);
    assert_error(&r, "2 keys already have a deadline, the most this server tracks");
    assert_eq!(c.call(&[b"EXISTS", b"c"]), Reply::Integer(0), "stored without its deadline");
    // A key that has a deadline may change it; one without may be stored without one.
    assert_eq!(c.call(&[b"SET", b"a", b"1", b"PXAT", b"1"]), ok());
    assert_eq!(c.call(&[b"SET", b"c", b"3"]), ok());
    // When full, keys past their deadline make room and leave the store.
    assert_eq!(c.call(&[b"SET", b"d", b"4", b"EX", b"100"]), ok());
    let Reply::Bulk(info) = c.call(&[b"INFO", b"keyspace"]) else { panic!("INFO") };
    assert!(String::from_utf8_lossy(&info).contains("db0:keys=3,expires=2,"), "a left the store");
    assert_eq!(c.call(&[b"MGET", b"a", b"b", b"c", b"d"]).clone(), {
        Reply::Array(vec![Reply::Nil, bulk(b"2"), bulk(b"3"), bulk(b"4")])
    });
    assert_eq!(server.shutdown(), 0);
}
