//! The native server under hostile input: garbage, truncated and oversize frames, unknown
//! versions and requests before HELLO are refused with typed errors while well-behaved clients
//! on other connections keep being served correctly; the connection limit answers Busy. Batches:
//! each frame reaches the store as one batch call, a batch is one pipelined exchange on one
//! connection whose answers equal the single-key answers, and a server that vanishes mid-batch
//! fails every unanswered item, retired.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpucache_client::{ClientConfig, FRAME_PAYLOAD_TARGET, FRAMES_IN_FLIGHT_MAX, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{
    BatchGet, BatchPut, Get, Invalidate, Lookup, MissReason, Put, Retirement, Store, StoreError,
};
use gpucache_dataplane::testing::fixture::{key, payload, tenant};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;

use gpucache_dataplane::testing::counting::{self, Call, Counting};
use gpucache_wire::{
    BATCH_ITEMS_MAX, Fetched, FrameDecoder, HEADER_BYTES, Request, Response, VERSION, WireError,
    header_checksum, offset,
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
    let puts: Vec<_> = keys
        .iter()
        .zip(&data)
        .step_by(2)
        .map(|(key, src)| BatchPut { key, src, request: None })
        .collect();
    let answers = client.put_batch(&caller, &puts);
    assert_eq!(answers.len(), puts.len());
    assert!(answers.iter().all(|a| matches!(a, Ok(Put::Committed(_)))));
    let looked = client.lookup_batch(&caller, &keys.iter().collect::<Vec<_>>());
    for (i, l) in looked.iter().enumerate() {
        let hit = matches!(l, Ok(gpucache_dataplane::store::Lookup::Hit { .. }));
        assert_eq!(hit, i % 2 == 0, "lookup {i}: {l:?}");
    }
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 128]).collect();
    let mut items: Vec<_> =
        keys.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
    let got = client.get_batch(&caller, &mut items);
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

// ---------------------------------------------------------------------------------------------
// Batch exchanges against a scripted stand-in for the server

/// How long the stand-in waits for the client's next bytes before it gives up.
const STAND_IN_PATIENCE: Duration = Duration::from_secs(10);

/// One connection of a scripted stand-in for the server: it reads request frames and writes
/// the answers its script chooses, when it chooses.
struct StandIn {
    stream: TcpStream,
    decoder: FrameDecoder,
    /// Bytes read past the last frame taken.
    rest: Vec<u8>,
}

impl StandIn {
    /// The next request and its id; panics when none arrives within [`STAND_IN_PATIENCE`].
    fn next_request(&mut self) -> (u64, Request) {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let mut input = &self.rest[..];
            let fed = self.decoder.feed(&mut input).expect("the client sends sound frames");
            self.rest = input.to_vec();
            if let Some(frame) = fed {
                let request = Request::from_frame(&frame).expect("the client sends requests");
                return (frame.request_id, request);
            }
            let n = self.stream.read(&mut buf).expect("the client's next request in time");
            assert!(n > 0, "the client closed the connection");
            self.rest.extend_from_slice(&buf[..n]);
        }
    }

    fn answer(&mut self, id: u64, response: &Response) {
        let bytes = response.to_frame_bytes(id).expect("answer encodes");
        self.stream.write_all(&bytes).expect("answer sent");
    }

    /// Ends the connection without answering what is left: the end of the stream first, then
    /// whatever the client still sends is read and dropped until it closes too.
    fn vanish(mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let mut buf = vec![0u8; 64 << 10];
        while matches!(self.stream.read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// A stand-in on a fresh port: it takes one connection, answers its HELLO and runs `script`.
fn stand_in(
    script: impl FnOnce(StandIn) + Send + 'static,
) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let thread = std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("the client connects");
        stream.set_read_timeout(Some(STAND_IN_PATIENCE)).expect("timeout");
        let mut conn = StandIn { stream, decoder: FrameDecoder::new(), rest: Vec::new() };
        let (id, hello) = conn.next_request();
        assert!(matches!(hello, Request::Hello { .. }), "{hello:?}");
        let answer = Response::Hello {
            version: VERSION,
            server: "stand-in".into(),
            session: None,
            local: None,
        };
        conn.answer(id, &answer);
        script(conn);
    });
    (addr, thread)
}

fn batch_keys(n: usize, tag: u8) -> Vec<PhysicalKey> {
    (0..n)
        .map(|i| {
            let [lo, hi, ..] = i.to_le_bytes();
            key(0, &[tag, lo, hi], KvDtype::F16, 16)
        })
        .collect()
}

fn stand_in_client(addr: SocketAddr) -> (TcpStore, Caller) {
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let mut config = ClientConfig::new(addr, caller.clone());
    config.deadline = STAND_IN_PATIENCE;
    (TcpStore::new(config), caller)
}

#[test]
fn a_batch_sends_its_frames_before_it_reads_an_answer() {
    let frames = FRAMES_IN_FLIGHT_MAX + 2;
    let (addr, script) = stand_in(move |mut conn| {
        // Nothing is answered until FRAMES_IN_FLIGHT_MAX frames have arrived: a client that
        // waited for each answer before sending the next frame would never get here.
        let mut waiting = Vec::new();
        while waiting.len() < FRAMES_IN_FLIGHT_MAX {
            waiting.push(conn.next_request());
        }
        let mut answered = 0;
        while answered < frames {
            if waiting.is_empty() {
                waiting.push(conn.next_request());
            }
            let (id, request) = waiting.remove(0);
            let Request::Lookup { keys } = request else { panic!("a lookup: {request:?}") };
            let misses = keys.iter().map(|_| Ok(Lookup::Miss(MissReason::Absent))).collect();
            conn.answer(id, &Response::Lookup(misses));
            answered += 1;
        }
    });
    let (client, caller) = stand_in_client(addr);
    let keys = batch_keys(frames * BATCH_ITEMS_MAX, 1);
    let answers = client.lookup_batch(&caller, &keys.iter().collect::<Vec<_>>());
    assert_eq!(answers.len(), keys.len());
    assert!(answers.iter().all(|a| *a == Ok(Lookup::Miss(MissReason::Absent))), "{answers:?}");
    script.join().expect("the stand-in saw the frames it expected");
}

#[test]
fn a_server_that_vanishes_mid_batch_fails_every_unanswered_item_retired() {
    let data = |i: usize| payload(i as u64, 1 + i % 13);
    let (addr, script) = stand_in(move |mut conn| {
        // The first frame is answered in full, the second is read and never answered.
        let (id, request) = conn.next_request();
        let Request::Get { items } = request else { panic!("a get: {request:?}") };
        let hits = (0..items.len())
            .map(|i| {
                let data = data(i);
                Ok(Fetched::Hit { checksum: Checksum::of(&data), data })
            })
            .collect();
        conn.answer(id, &Response::Get(hits));
        let _ = conn.next_request();
        conn.vanish();
    });
    let (client, caller) = stand_in_client(addr);
    let n = 3 * BATCH_ITEMS_MAX;
    let keys = batch_keys(n, 2);
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 16]).collect();
    let mut items: Vec<_> =
        keys.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
    let answers = client.get_batch(&caller, &mut items);
    drop(items);
    assert_eq!(answers.len(), n);
    for (i, (answer, buf)) in answers.iter().zip(&bufs).enumerate() {
        if i < BATCH_ITEMS_MAX {
            let expected = data(i);
            assert_eq!(
                *answer,
                Ok(Get::Hit { len: expected.len() as u64, checksum: Checksum::of(&expected) }),
                "item {i}"
            );
            assert_eq!(&buf[..expected.len()], &expected[..], "item {i}");
        } else {
            let e = answer.as_ref().expect_err("unanswered items fail");
            assert_eq!(e.retirement(), Retirement::Retired, "item {i}: {e}");
            assert!(e.to_string().contains("transport"), "item {i}: {e}");
            assert!(buf.iter().all(|&b| b == 0), "item {i}: an unanswered buffer was written");
        }
    }
    script.join().expect("stand-in");

    // A PUT batch the same way: the first frame's answers, then a failure for every other item.
    let (addr, script) = stand_in(move |mut conn| {
        let (id, request) = conn.next_request();
        let Request::Put { items } = request else { panic!("a put: {request:?}") };
        let stored = items.iter().map(|i| Ok(Put::Committed(Checksum::of(&i.data)))).collect();
        conn.answer(id, &Response::Put(stored));
        conn.vanish();
    });
    let (client, caller) = stand_in_client(addr);
    let values: Vec<Vec<u8>> = (0..n).map(data).collect();
    let puts: Vec<_> =
        keys.iter().zip(&values).map(|(key, src)| BatchPut { key, src, request: None }).collect();
    let answers = client.put_batch(&caller, &puts);
    for (i, answer) in answers.iter().enumerate() {
        if i < BATCH_ITEMS_MAX {
            assert_eq!(*answer, Ok(Put::Committed(Checksum::of(&values[i]))), "item {i}");
        } else {
            let e = answer.as_ref().expect_err("unanswered items fail");
            assert_eq!(e.retirement(), Retirement::Retired, "item {i}: {e}");
        }
    }
    script.join().expect("stand-in");
}

// ---------------------------------------------------------------------------------------------
// The server hands each frame's items to the store as one batch

/// A server over a counting MemoryStore (tenant 0 may read and write), and a TCP client of it.
fn counted_server() -> (Server, Arc<Counting<Arc<MemoryStore>>>, Arc<MemoryStore>) {
    let limits = ResourceLimits { object_bytes_max: 32 << 20, ..ResourceLimits::default() };
    let memory =
        Arc::new(MemoryStore::new(limits, Arc::new(MonotonicClock::default())).expect("store"));
    let counting = Arc::new(Counting::new(Arc::clone(&memory)));
    let config = ServerConfig::new(
        "127.0.0.1:0".parse().expect("addr"),
        vec![Caller::new(tenant(0), Rights::READ_WRITE)],
    );
    let server = Server::start(config, Arc::clone(&counting) as Arc<dyn Store>).expect("server");
    (server, counting, memory)
}

/// The item counts of `calls`, which must all be `call` and all come from one connection.
fn batch_sizes(seen: &[counting::Seen], call: Call) -> Vec<usize> {
    assert!(seen.iter().all(|s| s.call == call), "{seen:?}");
    assert!(
        seen.windows(2).all(|w| w[0].thread == w[1].thread),
        "more than one connection: {seen:?}"
    );
    seen.iter().map(|s| s.items).collect()
}

#[test]
fn every_frame_reaches_the_store_as_one_batch_call() {
    let (server, counting, _) = counted_server();
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller.clone()));

    // 128 items: one frame, one batch call of 128 items for each kind of call.
    let keys = batch_keys(128, 3);
    let values: Vec<Vec<u8>> = (0..128usize).map(|i| payload(i as u64, 1 + i)).collect();
    let puts: Vec<_> =
        keys.iter().zip(&values).map(|(key, src)| BatchPut { key, src, request: None }).collect();
    assert!(client.put_batch(&caller, &puts).iter().all(|a| matches!(a, Ok(Put::Committed(_)))));
    assert_eq!(counting.take_calls(), [(Call::PutBatch, 128)]);
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    assert!(
        client.lookup_batch(&caller, &refs).iter().all(|a| matches!(a, Ok(Lookup::Hit { .. })))
    );
    assert_eq!(counting.take_calls(), [(Call::LookupBatch, 128)]);
    let mut bufs: Vec<Vec<u8>> = (0..128).map(|_| vec![0u8; 256]).collect();
    let mut items: Vec<_> =
        keys.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
    let got = client.get_batch(&caller, &mut items);
    drop(items);
    assert!(got.iter().all(|a| matches!(a, Ok(Get::Hit { .. }))));
    assert!(bufs.iter().zip(&values).all(|(b, v)| b[..v.len()] == v[..]));
    assert_eq!(counting.take_calls(), [(Call::GetBatch, 128)]);

    // Over BATCH_ITEMS_MAX: ceil(n / BATCH_ITEMS_MAX) frames, each one batch call, all on the
    // one connection of the exchange.
    let n = 2 * BATCH_ITEMS_MAX + 5;
    let keys = batch_keys(n, 4);
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    let split = [BATCH_ITEMS_MAX, BATCH_ITEMS_MAX, 5];
    assert_eq!(client.lookup_batch(&caller, &refs).len(), n);
    assert_eq!(batch_sizes(&counting.take(), Call::LookupBatch), split);
    let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; 16]).collect();
    let mut items: Vec<_> =
        keys.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
    let got = client.get_batch(&caller, &mut items);
    assert!(got.iter().all(|a| *a == Ok(Get::Miss(MissReason::Absent))));
    assert_eq!(batch_sizes(&counting.take(), Call::GetBatch), split);
    let values: Vec<Vec<u8>> = (0..n).map(|i| payload(i as u64, 8)).collect();
    let puts: Vec<_> =
        keys.iter().zip(&values).map(|(key, src)| BatchPut { key, src, request: None }).collect();
    assert!(client.put_batch(&caller, &puts).iter().all(|a| matches!(a, Ok(Put::Committed(_)))));
    assert_eq!(batch_sizes(&counting.take(), Call::PutBatch), split);
    let removed = client.invalidate_batch(&caller, &refs);
    assert!(removed.iter().all(|a| *a == Ok(Invalidate::Removed)));
    assert_eq!(batch_sizes(&counting.take(), Call::InvalidateBatch), split);

    // Over the frame payload target: a frame closes once its capacities would pass
    // FRAME_PAYLOAD_TARGET (a single larger item still goes alone).
    let big = usize::try_from(FRAME_PAYLOAD_TARGET * 3 / 8).expect("fits");
    let keys = batch_keys(3, 5);
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; big]).collect();
    let mut items: Vec<_> =
        keys.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
    let got = client.get_batch(&caller, &mut items);
    assert!(got.iter().all(|a| *a == Ok(Get::Miss(MissReason::Absent))));
    // A frame of one key is one GET_ONE call (the store may lend it).
    assert_eq!(counting.take_calls(), [(Call::GetBatch, 2), (Call::GetOne, 1)]);
    // One item larger than the target is a frame of its own, never refused by the client.
    let huge = usize::try_from(FRAME_PAYLOAD_TARGET * 2).expect("fits");
    let mut bufs: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; huge]).collect();
    let mut items: Vec<_> =
        keys.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
    let got = client.get_batch(&caller, &mut items);
    assert!(got.iter().all(|a| *a == Ok(Get::Miss(MissReason::Absent))));
    assert_eq!(batch_sizes(&counting.take(), Call::GetOne), [1, 1]);
    assert_eq!(server.shutdown(), 0);
}

#[test]
fn batch_answers_equal_the_single_key_answers() {
    let (server, counting, memory) = counted_server();
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller.clone()));
    let k = |space: u8, i: u8| key(0, &[space, i], KvDtype::F16, 16);
    let theirs = |space: u8| key(1, &[space], KvDtype::F16, 16);

    // PUTs: stored, the same key again, another tenant's key, an empty value, one too large.
    // The batch and the one-by-one calls each write their own keys (a PUT changes the store).
    let data = payload(1, 300);
    let large = vec![3u8; (32 << 20) + 1];
    let put_answers = |space: u8, batch: bool| {
        let (a, b) = (k(space, 1), theirs(space));
        let items = [
            BatchPut { key: &a, src: &data, request: None },
            BatchPut { key: &a, src: &data, request: None },
            BatchPut { key: &b, src: &data, request: None },
            BatchPut { key: &k(space, 2), src: &[], request: None },
            BatchPut { key: &k(space, 3), src: &large, request: None },
        ];
        if batch {
            client.put_batch(&caller, &items)
        } else {
            items.iter().map(|i| client.put(&caller, i.key, i.src, i.request)).collect()
        }
    };
    let (batched, single) = (put_answers(10, true), put_answers(11, false));
    assert_eq!(batched, single);
    assert!(matches!(batched[0], Ok(Put::Committed(_))), "{batched:?}");
    assert_eq!(batched[1], Ok(Put::AlreadyCommitted));
    assert!(matches!(batched[2], Err(StoreError::WrongTenant { .. })), "{batched:?}");
    assert!(batched[3].is_err() && matches!(batched[4], Ok(Put::Refused(_))), "{batched:?}");

    // Reads of a mix: a hit, a miss, another tenant's key, a hit into too small a buffer, a hit
    // into exactly its size, and the first key again.
    let short = payload(2, 40);
    assert!(matches!(client.put(&caller, &k(12, 1), &short, None), Ok(Put::Committed(_))));
    let keys = [k(10, 1), k(12, 9), theirs(12), k(10, 1), k(12, 1), k(10, 1)];
    let sizes = [1024, 64, 64, 100, short.len(), 300];
    let refs: Vec<&PhysicalKey> = keys.iter().collect();
    let looked = client.lookup_batch(&caller, &refs);
    let looked_one: Vec<_> = keys.iter().map(|key| client.lookup(&caller, key)).collect();
    let looked_here: Vec<_> = keys.iter().map(|key| memory.lookup(&caller, key)).collect();
    assert_eq!(looked, looked_one);
    assert_eq!(looked, looked_here);
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let mut items: Vec<_> =
        keys.iter().zip(&mut bufs).map(|(key, dst)| BatchGet { key, dst }).collect();
    let got = client.get_batch(&caller, &mut items);
    drop(items);
    let mut one_bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let got_one: Vec<_> = keys
        .iter()
        .zip(&mut one_bufs)
        .map(|(key, dst)| client.get_into(&caller, key, dst))
        .collect();
    let mut here_bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let got_here: Vec<_> = keys
        .iter()
        .zip(&mut here_bufs)
        .map(|(key, dst)| memory.get_into(&caller, key, dst))
        .collect();
    assert_eq!(got, got_one);
    assert_eq!(got, got_here);
    assert_eq!(bufs, one_bufs);
    assert_eq!(bufs, here_bufs);
    assert!(matches!(got[0], Ok(Get::Hit { len: 300, .. })), "{got:?}");
    assert_eq!(got[1], Ok(Get::Miss(MissReason::Absent)));
    assert!(matches!(got[2], Err(StoreError::WrongTenant { .. })), "{got:?}");
    assert!(matches!(got[3], Err(StoreError::BufferTooSmall { .. })), "{got:?}");

    // INVALIDATE: removed, absent, another tenant's key, the same key again.
    let drop_answers = |space: u8, batch: bool| {
        let keys = [k(space, 1), k(space, 7), theirs(space), k(space, 1)];
        if batch {
            client.invalidate_batch(&caller, &keys.iter().collect::<Vec<_>>())
        } else {
            keys.iter().map(|key| client.invalidate(&caller, key)).collect()
        }
    };
    let (batched, single) = (drop_answers(10, true), drop_answers(11, false));
    assert_eq!(batched, single);
    assert_eq!(batched[0], Ok(Invalidate::Removed));
    assert_eq!(batched[3], Ok(Invalidate::Absent));
    // The single-key calls went to the store as batches of one (a GET as one `get_one`).
    assert!(
        counting
            .take()
            .iter()
            .all(|s| !matches!(s.call, Call::Lookup | Call::Get | Call::Put | Call::Invalidate))
    );
    assert_eq!(server.shutdown(), 0);
}

/// CONDITION answers what the server's store says of itself: a memory store tracks neither
/// I/O nor free space; a FileStore's last I/O is good after a PUT, and it names its free space
/// and per-block overhead as it does in process.
#[test]
fn condition_answers_what_the_store_says_of_itself() {
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let (server, _, memory) = counted_server();
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller.clone()));
    assert_eq!(client.server_condition(), Ok(memory.condition()));
    assert_eq!(memory.condition(), gpucache_dataplane::store::StoreCondition::default());
    assert_eq!(server.shutdown(), 0);

    let dir = tempfile::tempdir().expect("dir");
    let mut config = gpucache_storage::file::FileStoreConfig::new(dir.path());
    config.durability = gpucache_storage::file::Durability::None;
    let file = Arc::new(config.open(Arc::new(MonotonicClock::default())).expect("file store"));
    let server_config =
        ServerConfig::new("127.0.0.1:0".parse().expect("addr"), vec![caller.clone()]);
    let server = Server::start(server_config, Arc::clone(&file) as Arc<dyn Store>).expect("server");
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller.clone()));
    client.put(&caller, &key(0, &[1], KvDtype::F16, 16), &payload(1, 4096), None).expect("put");
    let remote = client.server_condition().expect("condition");
    let local = file.condition();
    assert_eq!(remote.io_failure, Some(None), "{remote:?}");
    assert_eq!(remote.block_overhead_bytes, local.block_overhead_bytes);
    assert!(remote.free_bytes.is_some_and(|b| b > 0), "{remote:?}");
    assert_eq!(server.shutdown(), 0);
}
