//! The `/metrics`, `/livez`, `/readyz` and `/healthz` endpoint, driven with raw requests over TCP: routes and status
//! codes, content negotiation, bad requests that leave the server serving, the connection limit,
//! and a shutdown that keeps its deadline. With `promtool` on PATH, the scraped text is checked
//! by it too.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Put, Store};
use gpucache_dataplane::testing::process::promtool;
use gpucache_service::http::{HttpLimits, MetricsServer};
use gpucache_service::metered::{MeteredStore, Metrics};
use gpucache_service::ready::{Check, Probe};
use gpucache_storage::MemoryStore;

const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

struct Fixture {
    server: MetricsServer,
    store: Arc<MeteredStore<MemoryStore>>,
    healthy: Arc<AtomicBool>,
}

fn start(limits: HttpLimits) -> Fixture {
    let memory = MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
        .expect("valid limits");
    let metrics = Arc::new(Metrics::new());
    let store = MeteredStore::shared(memory, Arc::clone(&metrics));
    let healthy = Arc::new(AtomicBool::new(true));
    let flag = Arc::clone(&healthy);
    let checks = vec![
        Check::store_io(store.clone()),
        Check::new("test_flag", move || {
            if flag.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err("store offline for the test".to_owned())
            }
        }),
    ];
    let probe = Arc::new(Probe::new(store.clone(), checks));
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = MetricsServer::start_with(addr, metrics, probe, limits).expect("bind");
    Fixture { server, store, healthy }
}

fn key() -> PhysicalKey {
    let id = CacheIdentity::builder()
        .tenant("tenant-http")
        .trust_domain("lab")
        .model_revision("m1")
        .model_config(Digest32([4; 32]))
        .tokenizer_revision("t1")
        .kv_dtype(KvDtype::F16)
        .quant(QuantFormat::None)
        .layout("paged", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::None)
        .chain(vec![Digest32([1; 32])])
        .block_tokens(16)
        .valid_tokens(16)
        .build()
        .expect("valid identity");
    PhysicalKey::new(id)
}

struct Reply {
    status_line: String,
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Sends `raw` and reads until the server closes.
fn exchange(addr: SocketAddr, raw: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(CLIENT_TIMEOUT)).unwrap();
    s.write_all(raw).expect("send");
    let mut bytes = Vec::new();
    s.read_to_end(&mut bytes).expect("read until close");
    let text = String::from_utf8(bytes).expect("UTF-8 reply");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    let status_line = head.lines().next().unwrap_or_default().to_owned();
    Reply { status_line, head: head.to_owned(), body: body.to_owned() }
}

fn get(addr: SocketAddr, path: &str) -> Reply {
    exchange(addr, format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes())
}

#[test]
fn metrics_are_served_in_both_formats() {
    let f = start(HttpLimits::default());
    let caller = Caller::new(TenantId::parse("tenant-http").unwrap(), Rights::READ_WRITE);
    assert!(matches!(
        Store::put(&*f.store, &caller, &key(), &[5u8; 64], None),
        Ok(Put::Committed(_))
    ));
    let addr = f.server.local_addr();

    let r = get(addr, "/metrics");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"));
    assert_eq!(r.header("connection"), Some("close"));
    assert_eq!(r.header("content-length"), Some(r.body.len().to_string().as_str()));
    assert!(r.body.contains("gpucache_ops_total{op=\"put\",outcome=\"committed\"} 1\n"));
    assert!(r.body.contains("gpucache_committed_blocks 1\n"), "{}", r.body);

    let r = exchange(
        addr,
        b"GET /metrics?x=1 HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n",
    );
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    assert_eq!(
        r.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(r.body.ends_with("# EOF\n"));
    assert!(r.body.contains("gpucache_bytes_total{op=\"put\",direction=\"in\"} 64\n"));

    let r = exchange(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    assert!(r.body.is_empty(), "HEAD got a body");
    assert_eq!(f.server.shutdown(), 0);
}

#[test]
fn readyz_and_its_healthz_alias_follow_the_checks_and_livez_does_not() {
    let f = start(HttpLimits::default());
    let addr = f.server.local_addr();
    for path in ["/readyz", "/healthz"] {
        let r = get(addr, path);
        assert_eq!(r.status_line, "HTTP/1.1 200 OK", "{path}");
        assert_eq!(r.body, "ready store=memory epoch=1\nok store_io\nok test_flag\n", "{path}");
    }
    f.healthy.store(false, Ordering::SeqCst);
    for path in ["/readyz", "/healthz"] {
        let r = get(addr, path);
        assert_eq!(r.status_line, "HTTP/1.1 503 Service Unavailable", "{path}");
        assert_eq!(
            r.body,
            "not ready store=memory epoch=1 failing=test_flag\nok store_io\n\
             fail test_flag: store offline for the test\n",
            "{path}"
        );
    }
    // Liveness is only that the process answers.
    let r = get(addr, "/livez");
    assert_eq!(r.status_line, "HTTP/1.1 200 OK");
    assert_eq!(r.body, "alive\n");
    f.healthy.store(true, Ordering::SeqCst);
    assert_eq!(get(addr, "/readyz").status_line, "HTTP/1.1 200 OK");
}

#[test]
fn unknown_paths_and_methods() {
    let f = start(HttpLimits::default());
    let addr = f.server.local_addr();
    assert_eq!(get(addr, "/").status_line, "HTTP/1.1 404 Not Found");
    assert_eq!(get(addr, "/metrics/extra").status_line, "HTTP/1.1 404 Not Found");
    let r = exchange(addr, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 405 Method Not Allowed");
    assert_eq!(r.header("allow"), Some("GET, HEAD"));
    let r = exchange(addr, b"DELETE /healthz HTTP/1.0\r\n\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 405 Method Not Allowed");
}

#[test]
fn bad_requests_get_400_and_the_server_keeps_serving() {
    let limits = HttpLimits { request_bytes_max: 1024, ..HttpLimits::default() };
    let f = start(limits);
    let addr = f.server.local_addr();
    let garbage: [&[u8]; 6] = [
        b"\x00\x01\x02garbage\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET /metrics HTTP/2.0\r\n\r\n",
        b"GET metrics HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
        b"get /metrics HTTP/1.1\r\n\r\n",
    ];
    for raw in garbage {
        let r = exchange(addr, raw);
        assert_eq!(r.status_line, "HTTP/1.1 400 Bad Request", "for {raw:?}");
        assert_eq!(get(addr, "/healthz").status_line, "HTTP/1.1 200 OK");
    }
    // An oversize head: the server answers once it has read past the limit, without waiting
    // for the end of the head.
    let mut big = b"GET /metrics HTTP/1.1\r\nX-Filler: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 4096));
    let r = exchange(addr, &big);
    assert_eq!(r.status_line, "HTTP/1.1 400 Bad Request");
    assert!(r.body.contains("1024 bytes"), "{}", r.body);
    assert_eq!(get(addr, "/metrics").status_line, "HTTP/1.1 200 OK");
}

#[test]
fn a_slow_client_gets_408_at_the_read_deadline() {
    let limits = HttpLimits { read_deadline_ms: 200, ..HttpLimits::default() };
    let f = start(limits);
    let r = exchange(f.server.local_addr(), b"GET /metrics HTTP/1.1\r\n");
    assert_eq!(r.status_line, "HTTP/1.1 408 Request Timeout");
}

#[test]
fn connections_over_the_limit_get_503() {
    let limits = HttpLimits { connections_max: 1, ..HttpLimits::default() };
    let f = start(limits);
    let addr = f.server.local_addr();
    // Holds the only slot: connected, sending nothing. The accept thread takes connections in
    // order, so this one is counted before the next is looked at.
    let idle = TcpStream::connect(addr).unwrap();
    let r = get(addr, "/healthz");
    assert_eq!(r.status_line, "HTTP/1.1 503 Service Unavailable");
    drop(idle);
    // The slot comes back once the idle connection's thread sees the close.
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    loop {
        let r = get(addr, "/healthz");
        if r.status_line == "HTTP/1.1 200 OK" {
            break;
        }
        assert!(Instant::now() < deadline, "the slot never came back");
        std::thread::yield_now();
    }
}

#[test]
fn shutdown_keeps_its_deadline_and_stops_listening() {
    let limits = HttpLimits { shutdown_deadline_ms: 500, ..HttpLimits::default() };
    let f = start(limits);
    let addr = f.server.local_addr();
    assert_eq!(get(addr, "/healthz").status_line, "HTTP/1.1 200 OK");
    // An idle connection mid-request must not hold shutdown up for the 5 s read deadline.
    let mut idle = TcpStream::connect(addr).unwrap();
    idle.write_all(b"GET /metr").unwrap();
    // Make sure the server has taken the connection before shutting down.
    let probe = get(addr, "/healthz");
    assert_eq!(probe.status_line, "HTTP/1.1 200 OK");
    let started = Instant::now();
    let left_open = f.server.shutdown();
    let took = started.elapsed();
    assert!(took < Duration::from_millis(1500), "shutdown took {took:?}");
    assert_eq!(left_open, 0, "the idle connection was not ended");
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
        "still accepting after shutdown"
    );
}

/// `promtool check metrics` reads the Prometheus text format from stdin and lints it: no error
/// and no warning.
#[test]
fn promtool_accepts_the_scrape() {
    let f = start(HttpLimits::default());
    let caller = Caller::new(TenantId::parse("tenant-http").unwrap(), Rights::READ_WRITE);
    let _ = Store::put(&*f.store, &caller, &key(), &[1u8; 8], None);
    let body = get(f.server.local_addr(), "/metrics").body;
    let Some((ok, printed)) = promtool(&["check", "metrics"], Path::new("."), &body) else {
        return;
    };
    assert!(
        ok && printed.is_empty(),
        "promtool refused the scrape:\n{printed}\n--- scrape ---\n{body}"
    );
}
