//! The native server under hostile input: garbage, truncated and oversize frames, unknown
//! versions and requests before HELLO are refused with typed errors while well-behaved clients
//! on other connections keep being served correctly; the connection limit answers Busy.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Put, Retirement, Store, StoreError};
use gpucache_dataplane::testing::fixture::{key, payload, tenant};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;
use gpucache_wire::{
    FrameDecoder, HEADER_BYTES, Request, Response, WireError, header_checksum, offset,
};

fn server(connections_max: u32) -> Server {
    let store = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default()))
            .expect("store"),
    );
    let mut config = ServerConfig::new(
        "127.0.0.1:0".parse().expect("addr"),
        vec![Caller::new(tenant(0), Rights::READ_WRITE)],
    );
    config.connections_max = connections_max;
    Server::start(config, store).expect("server")
}

/// Sends `bytes` on a fresh connection and returns every response frame until the server
/// closes it or 2 s pass.
fn send_raw(addr: SocketAddr, bytes: &[u8]) -> Vec<Response> {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
    let _ = s.write_all(bytes);
    let mut decoder = FrameDecoder::new();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        let mut input = &buf[..n];
        while let Ok(Some(frame)) = decoder.feed(&mut input) {
            out.push(Response::from_frame(&frame).expect("server frames decode"));
        }
    }
    out
}

fn hello() -> Vec<u8> {
    Request::Hello {
        tenant: tenant(0),
        client_name: "t".into(),
        rights: Rights::READ_WRITE,
        auth: None,
    }
    .to_frame_bytes(1)
    .expect("hello")
}

#[test]
fn hostile_connections_do_not_disturb_good_clients() {
    let server = server(64);
    let addr = server.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let caller = Caller::new(tenant(0), Rights::READ_WRITE);
            let client = TcpStore::new(ClientConfig::new(addr, caller.clone()));
            let mut rounds = 0u32;
            let mut buf = vec![0u8; 70_000];
            while !stop.load(Ordering::Acquire) || rounds < 50 {
                let k = key(0, &[9, u8::try_from(rounds % 200).unwrap_or(0)], KvDtype::F16, 16);
                let data = payload(u64::from(rounds % 200), 1 + (rounds as usize % 200) * 300);
                match client.put(&caller, &k, &data, None).expect("good put") {
                    Put::Committed(_) | Put::AlreadyCommitted => {}
                    other => panic!("good put: {other:?}"),
                }
                match client.get_into(&caller, &k, &mut buf).expect("good get") {
                    Get::Hit { len, .. } => {
                        assert_eq!(&buf[..usize::try_from(len).unwrap_or(0)], &data[..])
                    }
                    other => panic!("good get after put: {other:?}"),
                }
                rounds += 1;
            }
            rounds
        })
    };

    // Garbage: the stream cannot be resynchronised; one typed error, then the connection closes.
    let got = send_raw(
        addr,
        b"this is not a frame at all, not even close....................................",
    );
    assert!(matches!(got.as_slice(), [Response::Error(WireError::BadMagic { .. })]), "{got:?}");

    // A request before HELLO: a per-frame error, the connection stays usable.
    let mut bytes = Request::Epoch.to_frame_bytes(5).expect("epoch");
    bytes.extend(hello());
    bytes.extend(Request::Epoch.to_frame_bytes(6).expect("epoch"));
    let got = send_raw(addr, &bytes);
    assert!(matches!(got.first(), Some(Response::Error(WireError::NotAuthenticated))), "{got:?}");
    assert!(matches!(got.get(1), Some(Response::Hello { .. })), "{got:?}");
    assert!(matches!(got.get(2), Some(Response::Epoch(_))), "{got:?}");

    // An unknown version: answered, then closed.
    let mut v2 = hello();
    v2[offset::VERSION] = 3;
    let got = send_raw(addr, &v2);
    assert!(
        matches!(got.as_slice(), [Response::Error(WireError::UnsupportedVersion { found: 3, .. })]),
        "{got:?}"
    );

    // An oversize body length with a valid header checksum: refused before any allocation.
    let mut big = hello();
    big[offset::BODY_LEN..offset::BODY_LEN + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let sum = header_checksum(&big[..HEADER_BYTES - 4]);
    big[HEADER_BYTES - 4..HEADER_BYTES].copy_from_slice(&sum.to_le_bytes());
    let got = send_raw(addr, &big[..HEADER_BYTES]);
    assert!(matches!(got.as_slice(), [Response::Error(WireError::TooLarge { .. })]), "{got:?}");

    // A corrupted body: a per-frame error, and the next frame is served.
    let mut bad_body = hello();
    let last = bad_body.len() - 1;
    bad_body[last] ^= 0x40;
    bad_body.extend(hello());
    let got = send_raw(addr, &bad_body);
    assert!(
        matches!(got.first(), Some(Response::Error(WireError::BodyChecksum { .. }))),
        "{got:?}"
    );
    assert!(matches!(got.get(1), Some(Response::Hello { .. })), "{got:?}");

    // Truncated frames and random bytes on many connections, then hang up.
    let mut rng = SplitMix64::new(0x2545_f491_4f6c_dd1d);
    for i in 0..40usize {
        let mut bytes = hello();
        bytes.extend(Request::Stats.to_frame_bytes(2).expect("stats"));
        let cut = i * 7 % bytes.len();
        bytes.truncate(cut);
        let noise = bytes.len()..bytes.len() + (i % 5) * 13;
        bytes.resize(noise.end, 0);
        rng.fill_bytes(&mut bytes[noise]);
        let mut s = TcpStream::connect(addr).expect("connect");
        let _ = s.write_all(&bytes);
    }
    stop.store(true, Ordering::Release);
    let rounds = good.join().expect("good client panicked");
    assert!(rounds >= 50);
    assert_eq!(server.shutdown(), 0, "connection threads outlived the shutdown deadline");
}

#[test]
fn connections_over_the_limit_are_answered_busy() {
    let server = server(2);
    let addr = server.local_addr();
    let a = TcpStream::connect(addr).expect("a");
    let b = TcpStream::connect(addr).expect("b");
    // Make sure both are accepted before the third arrives.
    for s in [&a, &b] {
        let mut s = s.try_clone().expect("clone");
        s.write_all(&hello()).expect("hello");
        let mut header = [0u8; HEADER_BYTES];
        s.read_exact(&mut header).expect("hello answer");
    }
    let got = send_raw(addr, &hello());
    assert!(matches!(got.as_slice(), [Response::Error(WireError::Busy { max: 2, .. })]), "{got:?}");
    drop((a, b));
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn batches_answer_per_item_in_order_across_frames() {
    let server = server(8);
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller.clone()));
    // More items than one frame may carry, so the client splits them.
    let n = gpucache_wire::BATCH_ITEMS_MAX + 37;
    let keys: Vec<_> = (0..n)
        .map(|i| {
            key(
                0,
                &[3, u8::try_from(i % 251).unwrap_or(0), u8::try_from(i / 251).unwrap_or(0)],
                KvDtype::F16,
                16,
            )
        })
        .collect();
    let data: Vec<Vec<u8>> = (0..n).map(|i| payload(i as u64, 1 + i % 97)).collect();
    // Every other key is written.
    let puts: Vec<_> =
        keys.iter().zip(&data).step_by(2).map(|(k, d)| (k.clone(), d.as_slice(), None)).collect();
    let answers = client.put_many(&caller, &puts).expect("put_many");
    assert_eq!(answers.len(), puts.len());
    assert!(answers.iter().all(|a| matches!(a, Ok(Put::Committed(_)))));
    let looked = client.lookup_many(&caller, &keys).expect("lookup_many");
    for (i, l) in looked.iter().enumerate() {
        let hit = matches!(l, Ok(gpucache_dataplane::store::Lookup::Hit { .. }));
        assert_eq!(hit, i % 2 == 0, "lookup {i}: {l:?}");
    }
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 128]).collect();
    let mut items: Vec<_> =
        keys.iter().cloned().zip(bufs.iter_mut().map(|b| b.as_mut_slice())).collect();
    let got = client.get_many(&caller, &mut items).expect("get_many");
    drop(items);
    for (i, g) in got.iter().enumerate() {
        match g {
            Ok(Get::Hit { len, .. }) => {
                assert_eq!(i % 2, 0, "get {i} hit a key never written");
                assert_eq!(
                    &bufs[i][..usize::try_from(*len).unwrap_or(0)],
                    &data[i][..],
                    "get {i}: wrong bytes"
                );
            }
            Ok(Get::Miss(_)) => assert_eq!(i % 2, 1, "get {i} missed a written key"),
            Err(e) => panic!("get {i}: {e}"),
        }
    }
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn an_unreachable_server_is_an_io_failure_with_the_system_kind() {
    // A loopback port nobody listens on any more: connecting is refused at once.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port");
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(addr, caller.clone()));
    let e = client.lookup(&caller, &key(0, &[1], KvDtype::F16, 16)).expect_err("nobody listens");
    assert!(
        matches!(
            e,
            StoreError::Io {
                operation: "lookup",
                kind: std::io::ErrorKind::ConnectionRefused,
                retirement: Retirement::Retired,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("transport"), "{e}");
}
