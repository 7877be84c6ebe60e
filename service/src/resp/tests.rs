//! Tests of the RESP front over a real socket: the key namespace, a corrupt value, and
//! authentication with tenant keys through AUTH and HELLO.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::fixture;
use gpucache_storage::MemoryStore;

use crate::bounds::{Front, Guard, Reason};

use super::auth::{HELLO_NOAUTH_TEXT, NOAUTH_TEXT, WRONGPASS_TEXT};
use super::{IdentityTemplate, REDIS_VERSION, RespConfig, RespServer, chain_link, encode_request};

#[test]
fn plain_keys_map_into_the_tenant_namespace() {
    let ns = IdentityTemplate::for_tenant(&fixture::tenant(0)).expect("namespace");
    let a = ns.key_for(b"alpha").expect("key");
    assert_eq!(a, ns.key_for(b"alpha").expect("key"));
    assert_ne!(a, ns.key_for(b"alpha ").expect("key"));
    assert_eq!(a.identity().chain(), &[chain_link(b"alpha")]);
    assert_eq!(a.identity().block_tokens(), 1);
    assert_eq!(a.identity().valid_tokens(), 1);
    assert_eq!(a.tenant(), &fixture::tenant(0));
    let other = IdentityTemplate::for_tenant(&fixture::tenant(1)).expect("namespace");
    assert_ne!(a, other.key_for(b"alpha").expect("key"));
}

fn exchange(stream: &mut TcpStream, request: &[u8], reply_len: usize) -> Vec<u8> {
    stream.write_all(request).expect("send");
    let mut reply = vec![0u8; reply_len];
    stream.read_exact(&mut reply).expect("reply");
    reply
}

/// A block whose stored bytes were damaged reads as nil (the store drops it).
#[test]
fn a_corrupt_value_reads_as_nil() {
    let store = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
            .expect("store"),
    );
    let config =
        RespConfig::new("127.0.0.1:0".parse().expect("addr"), fixture::caller(0)).expect("config");
    let namespace = config.namespace.clone();
    let server = RespServer::start(config, store.clone()).expect("start");
    let mut s = TcpStream::connect(server.local_addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    assert_eq!(exchange(&mut s, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n", 5), b"+OK\r\n");
    assert_eq!(exchange(&mut s, b"GET k\r\n", 11), b"$5\r\nhello\r\n");
    let key = namespace.key_for(b"k").expect("key");
    assert!(store.corrupt_for_test(&key, 2));
    assert_eq!(exchange(&mut s, b"GET k\r\n", 5), b"$-1\r\n");
    assert_eq!(exchange(&mut s, b"EXISTS k\r\n", 4), b":0\r\n");
    assert_eq!(store.stats().corrupt_dropped.total(), 1);
    // The key is free again.
    assert_eq!(exchange(&mut s, b"SET k again\r\n", 5), b"+OK\r\n");
    assert_eq!(server.shutdown(), 0);
}

/// A server over a memory store whose tenant has two keys of the secret `byte` x 32: `k1`,
/// and `old`, expired long ago; and that secret in hex.
fn server_with_keys(byte: u8) -> (RespServer, String) {
    server_with_keys_bounded(byte, Arc::default())
}

fn server_with_keys_bounded(byte: u8, guard: Arc<Guard>) -> (RespServer, String) {
    use crate::auth::{Secret, TenantKey, TenantKeys};
    let store = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
            .expect("store"),
    );
    let secret = vec![byte; 32];
    let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let key = |id: &str, not_after_s| TenantKey {
        id: id.into(),
        secret: Secret::new(secret.clone()).expect("secret"),
        not_after_s,
    };
    let keys = TenantKeys::fixed(vec![key("k1", None), key("old", Some(1))]).expect("keys");
    let mut config =
        RespConfig::new("127.0.0.1:0".parse().expect("addr"), fixture::caller(0)).expect("config");
    config.auth = Some(Arc::new(keys));
    config.guard = guard;
    (RespServer::start(config, store).expect("start"), hex)
}

/// Before AUTH a connection of a tenant with keys may buffer 64 KiB at most, and must
/// authenticate within the AUTH deadline; an authenticated one has no such deadline.
#[test]
fn unauthenticated_connections_are_bounded_in_bytes_and_time() {
    use crate::bounds::ConnectionBounds;
    let bounds = ConnectionBounds {
        hello_timeout: Duration::from_millis(300),
        ..ConnectionBounds::default()
    };
    let guard = Arc::new(Guard::new(bounds));
    let (server, hex) = server_with_keys_bounded(0x5b, Arc::clone(&guard));
    let connect = || {
        let s = TcpStream::connect(server.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        s
    };
    let mut big = connect();
    let mut request = Vec::new();
    encode_request(&[b"SET".as_slice(), b"k", &vec![b'v'; 100 << 10]], &mut request);
    // The server may close before it has read everything: a failed write is expected.
    let _ = big.write_all(&request);
    let mut reply = String::new();
    let _ = big.read_to_string(&mut reply);
    assert!(reply.starts_with("-ERR ") && reply.contains("before AUTH"), "{reply:?}");

    let started = Instant::now();
    let mut silent = connect();
    let mut rest = Vec::new();
    assert_eq!(silent.read_to_end(&mut rest).expect("closed by the server"), 0);
    assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());

    let mut authed = connect();
    authed.write_all(format!("AUTH k1 {hex}\r\n").as_bytes()).expect("auth");
    let mut ok = [0u8; 5];
    authed.read_exact(&mut ok).expect("auth answer");
    assert_eq!(&ok, b"+OK\r\n");
    // Past the AUTH deadline the authenticated connection still answers.
    let after = Instant::now() + Duration::from_millis(600);
    while Instant::now() < after {
        authed.write_all(b"PING\r\n").expect("ping");
        let mut pong = [0u8; 7];
        authed.read_exact(&mut pong).expect("pong");
        assert_eq!(&pong, b"+PONG\r\n");
    }
    let counted = |reason| guard.refusals().get(Front::Resp, reason);
    assert_eq!((counted(Reason::Oversize), counted(Reason::HelloTimeout)), (1, 1));
    assert_eq!(guard.body_bytes_in_flight(), 0);
    drop(authed);
    server.shutdown();
}

/// A tenant with keys: nothing but AUTH, HELLO and QUIT before a good AUTH; wrong, unknown and
/// expired keys are refused alike; each connection authenticates for itself.
#[test]
fn a_tenant_with_keys_needs_auth() {
    let (server, hex) = server_with_keys(0x5a);
    let connect = || {
        let s = TcpStream::connect(server.local_addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        s
    };
    let noauth = format!("-{NOAUTH_TEXT}\r\n");
    let wrongpass = format!("-{WRONGPASS_TEXT}\r\n");
    let mut s = connect();
    assert_eq!(exchange(&mut s, b"GET k\r\n", noauth.len()), noauth.as_bytes());
    assert_eq!(exchange(&mut s, b"PING\r\n", noauth.len()), noauth.as_bytes());
    let wrong = format!("AUTH k1 {}\r\n", "00".repeat(32));
    assert_eq!(exchange(&mut s, wrong.as_bytes(), wrongpass.len()), wrongpass.as_bytes());
    let unknown = format!("AUTH nobody {hex}\r\n");
    assert_eq!(exchange(&mut s, unknown.as_bytes(), wrongpass.len()), wrongpass.as_bytes());
    let expired = format!("AUTH old {hex}\r\n");
    assert_eq!(exchange(&mut s, expired.as_bytes(), wrongpass.len()), wrongpass.as_bytes());
    assert_eq!(exchange(&mut s, b"GET k\r\n", noauth.len()), noauth.as_bytes());
    let good = format!("AUTH k1 {hex}\r\n");
    assert_eq!(exchange(&mut s, good.as_bytes(), 5), b"+OK\r\n");
    assert_eq!(exchange(&mut s, b"SET k v\r\n", 5), b"+OK\r\n");
    assert_eq!(exchange(&mut s, b"GET k\r\n", 7), b"$1\r\nv\r\n");
    // Another connection starts unauthenticated; the `id:secret` form works too.
    let mut t = connect();
    assert_eq!(exchange(&mut t, b"GET k\r\n", noauth.len()), noauth.as_bytes());
    let joined = format!("AUTH k1:{hex}\r\n");
    assert_eq!(exchange(&mut t, joined.as_bytes(), 5), b"+OK\r\n");
    assert_eq!(exchange(&mut t, b"GET k\r\n", 7), b"$1\r\nv\r\n");
    assert_eq!(server.shutdown(), 0);
}

/// AUTH inside HELLO, as redis-py sends it for a client with a username and password: the
/// same keys and failures as AUTH; a refused HELLO neither authenticates nor switches the
/// protocol.
#[test]
fn hello_authenticates_with_a_tenant_key() {
    let (server, hex) = server_with_keys(0xa5);
    let mut s = TcpStream::connect(server.local_addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let request = |words: &[&str]| {
        let mut out = Vec::new();
        encode_request(words, &mut out);
        out
    };
    let noauth = format!("-{HELLO_NOAUTH_TEXT}\r\n");
    let wrongpass = format!("-{WRONGPASS_TEXT}\r\n");
    assert_eq!(exchange(&mut s, &request(&["HELLO", "3"]), noauth.len()), noauth.as_bytes());
    assert_eq!(exchange(&mut s, &request(&["HELLO"]), noauth.len()), noauth.as_bytes());
    for (user, pass) in [("k1", "00".repeat(32)), ("nobody", hex.clone()), ("old", hex.clone())] {
        let hello = request(&["HELLO", "3", "AUTH", user, &pass, "SETNAME", "x"]);
        assert_eq!(exchange(&mut s, &hello, wrongpass.len()), wrongpass.as_bytes(), "{user}");
    }
    let noauth_get = format!("-{NOAUTH_TEXT}\r\n");
    assert_eq!(exchange(&mut s, b"GET k\r\n", noauth_get.len()), noauth_get.as_bytes());
    let good = request(&["HELLO", "3", "AUTH", "k1", &hex, "SETNAME", "app"]);
    let want = format!(
        "%7\r\n$6\r\nserver\r\n$8\r\ngpucache\r\n$7\r\nversion\r\n$5\r\n{REDIS_VERSION}\r\n\
         $5\r\nproto\r\n:3\r\n$2\r\nid\r\n:1\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n\
         $4\r\nrole\r\n$6\r\nmaster\r\n$7\r\nmodules\r\n*0\r\n"
    );
    assert_eq!(String::from_utf8_lossy(&exchange(&mut s, &good, want.len())), want);
    assert_eq!(exchange(&mut s, b"GET k\r\n", 3), b"_\r\n");
    assert_eq!(exchange(&mut s, b"CLIENT GETNAME\r\n", 9), b"$3\r\napp\r\n");
    // Once authenticated, HELLO needs no AUTH.
    let two = exchange(&mut s, &request(&["HELLO", "2"]), 5);
    assert_eq!(two, b"*14\r\n");
    assert_eq!(server.shutdown(), 0);
}
