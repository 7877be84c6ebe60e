//! The same-host path: a client on the server's Unix socket sharing a sealed memfd segment.
//! GETs into and PUTs from shared buffers move no payload through the socket and copy nothing
//! on the client; other buffers bounce through the segment, and fall back to frames when it is
//! full. Hostile segments and ranges are refused with typed errors while the connection goes
//! on; a failed GET that the server may still be writing is reported as not retired. A shared
//! frame reaches the store as one batch call (items whose ranges overlap, one at a time), and a
//! batch the server stops answering fails each item with the retirement its buffer is in.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use gpucache_client::{ClientConfig, FRAMES_IN_FLIGHT_MAX, LocalConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{RequestId, ResourceLimits};
use gpucache_dataplane::store::{
    BatchGet, BatchPut, Get, Lookup, MissReason, Put, Retirement, Store, StoreError,
};
use gpucache_dataplane::testing::fixture::{BeforeGet, key, payload, tenant};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;
use gpucache_storage::host::segment::{
    ARENA_ALIGN, Pages, SEGMENT_BYTES_MIN, Segment, send_with_fd,
};
use gpucache_wire::{
    BATCH_ITEMS_MAX, FrameDecoder, Request, Response, SharedGetItem, SharedPutItem, WireError,
};

use gpucache_dataplane::testing::counting::{Call, Counting};

fn caller() -> Caller {
    Caller::new(tenant(0), Rights::READ_WRITE)
}

fn memory() -> Arc<MemoryStore> {
    let limits = ResourceLimits { object_bytes_max: 8 << 20, ..ResourceLimits::default() };
    Arc::new(MemoryStore::new(limits, Arc::new(MonotonicClock::default())).expect("store"))
}

struct Served {
    server: Server,
    _dir: tempfile::TempDir,
}

impl Served {
    fn path(&self) -> PathBuf {
        self.server.local_path().expect("local socket").to_path_buf()
    }

    fn client(&self, segment_bytes: u64) -> TcpStore {
        let mut config = ClientConfig::new(self.server.local_addr(), caller());
        let mut local = LocalConfig::new(self.path());
        local.segment_bytes = segment_bytes;
        config.local = Some(local);
        config.deadline = Duration::from_secs(10);
        TcpStore::new(config)
    }
}

fn serve(store: Arc<dyn Store>, shm_mapped_bytes_max: u64) -> Served {
    let dir = tempfile::tempdir().expect("dir");
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), vec![caller()]);
    config.local = Some(dir.path().join("gpucache.sock"));
    config.shm_mapped_bytes_max = shm_mapped_bytes_max;
    Served { server: Server::start(config, store).expect("server"), _dir: dir }
}

fn k(i: u8) -> PhysicalKey {
    key(0, &[i], KvDtype::F16, 16)
}

#[test]
fn shared_buffers_round_trip_without_bounce() {
    let served = serve(memory(), 1 << 30);
    let client = served.client(16 << 20);
    let c = caller();
    let data = payload(1, 1 << 20);
    let mut src = client.shared_buffer(data.len()).expect("shared buffer");
    src.copy_from_slice(&data);
    assert!(matches!(client.put(&c, &k(1), &src, None), Ok(Put::Committed(_))));
    let mut dst = client.shared_buffer(2 << 20).expect("shared buffer");
    let got = client.get_into(&c, &k(1), &mut dst).expect("get");
    assert_eq!(got, Get::Hit { len: data.len() as u64, checksum: Checksum::of(&data) });
    assert_eq!(&dst[..data.len()], &data[..]);
    let stats = client.shared_stats();
    assert_eq!((stats.direct_items, stats.bounced_items, stats.framed_batches), (2, 0, 0));
    // A miss into a shared buffer is a miss, not stale bytes.
    assert_eq!(client.get_into(&c, &k(2), &mut dst), Ok(Get::Miss(MissReason::Absent)));
    // Buffers return to the segment when dropped.
    drop((src, dst));
    assert_eq!(client.shared_stats().free_bytes, 16 << 20);
}

#[test]
fn ordinary_buffers_bounce_and_fall_back_to_frames_when_the_segment_is_full() {
    let served = serve(memory(), 1 << 30);
    let client = served.client(4 << 20);
    let c = caller();
    let data = payload(2, 3 << 20);
    assert!(matches!(client.put(&c, &k(3), &data, None), Ok(Put::Committed(_))));
    let mut dst = vec![0u8; data.len()];
    assert!(matches!(client.get_into(&c, &k(3), &mut dst), Ok(Get::Hit { .. })));
    assert_eq!(dst, data);
    assert_eq!(client.shared_stats().bounced_items, 2);
    // Take most of the segment: a 3 MiB bounce no longer fits, so frames carry the bytes.
    let _held = client.shared_buffer(2 << 20).expect("shared buffer");
    let mut again = vec![0u8; data.len()];
    assert!(matches!(client.get_into(&c, &k(3), &mut again), Ok(Get::Hit { .. })));
    assert_eq!(again, data);
    let other = payload(3, 3 << 20);
    assert!(matches!(client.put(&c, &k(4), &other, None), Ok(Put::Committed(_))));
    let stats = client.shared_stats();
    assert_eq!((stats.bounced_items, stats.framed_batches), (2, 2));
    // Batches mix both kinds of buffer in one frame.
    let mut shared_dst = client.shared_buffer(1 << 20).expect("shared buffer");
    let mut plain_dst = vec![0u8; 4 << 20];
    let (k3, k4) = (k(3), k(4));
    let answers = client.get_batch(
        &c,
        &mut [
            BatchGet { key: &k4, dst: &mut plain_dst[..] },
            BatchGet { key: &k3, dst: &mut shared_dst[..] },
        ],
    );
    assert!(matches!(answers[0], Ok(Get::Hit { len, .. }) if len == other.len() as u64));
    assert_eq!(&plain_dst[..other.len()], &other[..]);
    // 3 MiB does not fit a 1 MiB buffer: the store's own answer, through the segment or not.
    assert!(answers[1].is_err(), "{:?}", answers[1]);
}

/// A raw connection on the Unix socket, for what a well-behaved client never sends.
struct Raw {
    stream: UnixStream,
    decoder: FrameDecoder,
    next: u64,
}

impl Raw {
    fn connect(path: &Path) -> Self {
        let stream = UnixStream::connect(path).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut raw = Self { stream, decoder: FrameDecoder::new(), next: 1 };
        let hello = Request::Hello {
            tenant: tenant(0),
            client_name: "raw".into(),
            rights: Rights::ALL,
            auth: None,
        };
        assert!(matches!(raw.call(&hello, None), Response::Hello { .. }));
        raw
    }

    fn call(&mut self, request: &Request, fd: Option<&OwnedFd>) -> Response {
        let id = self.next;
        self.next += 1;
        let bytes = request.to_frame_bytes(id).expect("encodes");
        match fd {
            Some(fd) => {
                use std::os::fd::AsFd;
                send_with_fd(&self.stream, &bytes, fd.as_fd()).expect("send with fd");
            }
            None => self.stream.write_all(&bytes).expect("send"),
        }
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = self.stream.read(&mut buf).expect("answer");
            assert!(n > 0, "server closed the connection");
            let mut input = &buf[..n];
            if let Some(frame) = self.decoder.feed(&mut input).expect("frame") {
                assert_eq!(frame.request_id, id);
                return Response::from_frame(&frame).expect("response");
            }
        }
    }

    fn alive(&mut self) {
        assert!(matches!(self.call(&Request::Epoch, None), Response::Epoch(_)));
    }
}

fn shm_refused(response: &Response) -> bool {
    matches!(response, Response::Error(WireError::SharedMemory { .. }))
}

#[test]
fn hostile_segments_and_ranges_are_refused_and_the_connection_goes_on() {
    let served = serve(memory(), 1 << 30);
    let mut raw = Raw::connect(&served.path());
    let item = |offset, capacity| SharedGetItem { key: k(5), offset, capacity };

    // Shared requests before any segment.
    let r = raw.call(&Request::GetShared { items: vec![item(0, 16)] }, None);
    assert!(shm_refused(&r), "{r:?}");
    // An attach without a descriptor.
    assert!(shm_refused(&raw.call(&Request::ShmAttach { len: 1 << 20 }, None)));
    raw.alive();

    // A file that could shrink under the server (not a sealed memfd).
    let file = tempfile::tempfile().expect("temp file");
    file.set_len(1 << 20).expect("size");
    let unsealed = OwnedFd::from(file);
    let r = raw.call(&Request::ShmAttach { len: 1 << 20 }, Some(&unsealed));
    assert!(
        matches!(&r, Response::Error(WireError::SharedMemory { detail }) if detail.contains("sealed")),
        "{r:?}"
    );
    raw.alive();

    // A sealed segment whose announced length is wrong, then the right one.
    let segment = Segment::create(SEGMENT_BYTES_MIN, Pages::Normal).expect("segment");
    let owned = segment.fd().try_clone_to_owned().expect("dup");
    assert!(shm_refused(&raw.call(&Request::ShmAttach { len: 2 << 20 }, Some(&owned))));
    let r = raw.call(&Request::ShmAttach { len: SEGMENT_BYTES_MIN }, Some(&owned));
    assert_eq!(r, Response::ShmAttach(SEGMENT_BYTES_MIN));
    // A second attach on the same connection.
    assert!(shm_refused(&raw.call(&Request::ShmAttach { len: SEGMENT_BYTES_MIN }, Some(&owned))));

    // Ranges outside the segment, including ones that overflow, in any item of a batch.
    for (offset, capacity) in [(SEGMENT_BYTES_MIN, 1), (SEGMENT_BYTES_MIN - 8, 16), (u64::MAX, 2)] {
        let r = raw
            .call(&Request::GetShared { items: vec![item(0, 16), item(offset, capacity)] }, None);
        assert!(shm_refused(&r), "{offset}+{capacity}: {r:?}");
    }
    raw.alive();

    // A PUT whose bytes do not hash to the checksum the client sent is dropped, never served.
    let data = payload(9, 4096);
    segment.with_bytes_mut(8192, 4096, |b| b.copy_from_slice(&data)).expect("in range");
    let put = |checksum, request| SharedPutItem {
        key: k(6),
        request: Some(RequestId(request)),
        offset: 8192,
        len: 4096,
        checksum,
    };
    let r = raw.call(&Request::PutShared { items: vec![put(Checksum(1), 1)] }, None);
    assert!(
        matches!(&r, Response::PutShared(items) if matches!(items[0], Err(StoreError::Backend { .. }))),
        "{r:?}"
    );
    let r = raw.call(&Request::Lookup { keys: vec![k(6)] }, None);
    assert!(
        matches!(&r, Response::Lookup(items) if items[0] == Ok(Lookup::Miss(MissReason::Absent))),
        "{r:?}"
    );
    // With the right checksum it is stored, and a GET through the segment returns it.
    let r = raw.call(&Request::PutShared { items: vec![put(Checksum::of(&data), 2)] }, None);
    assert!(
        matches!(&r, Response::PutShared(items) if matches!(items[0], Ok(Put::Committed(_)))),
        "{r:?}"
    );
    let r = raw.call(
        &Request::GetShared {
            items: vec![SharedGetItem { key: k(6), offset: 65536, capacity: 8192 }],
        },
        None,
    );
    assert_eq!(
        r,
        Response::GetShared(vec![Ok(Get::Hit { len: 4096, checksum: Checksum::of(&data) })])
    );
    segment.with_bytes(65536, 4096, |b| assert_eq!(b, &data[..])).expect("in range");
}

#[test]
fn the_mapping_budget_is_enforced_and_tcp_clients_are_unaffected() {
    let served = serve(memory(), SEGMENT_BYTES_MIN * 3 / 2);
    // A TCP client of the same server is not affected by the local socket.
    let tcp = TcpStore::new(ClientConfig::new(served.server.local_addr(), caller()));
    assert!(matches!(tcp.put(&caller(), &k(7), b"abc", None), Ok(Put::Committed(_))));
    let first = served.client(SEGMENT_BYTES_MIN);
    let mut buf = vec![0u8; 16];
    assert!(matches!(first.get_into(&caller(), &k(7), &mut buf), Ok(Get::Hit { len: 3, .. })));
    // The second segment would pass shm_mapped_bytes_max: its connection is refused, clearly.
    let second = served.client(SEGMENT_BYTES_MIN);
    let e = second.get_into(&caller(), &k(7), &mut buf).expect_err("over the budget");
    assert!(e.to_string().contains("shm_mapped_bytes_max"), "{e}");
}

#[test]
fn concurrent_clients_get_exact_bytes_through_the_segment() {
    let served = serve(memory(), 1 << 30);
    let client = Arc::new(served.client(64 << 20));
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                let c = caller();
                for round in 0..40u8 {
                    let key = key(0, &[t, round], KvDtype::F16, 16);
                    let data = payload(
                        u64::from(t) * 1000 + u64::from(round),
                        1000 + 997 * usize::from(round),
                    );
                    if round % 2 == 0 {
                        let mut src = client.shared_buffer(data.len()).expect("room");
                        src.copy_from_slice(&data);
                        assert!(matches!(client.put(&c, &key, &src, None), Ok(Put::Committed(_))));
                    } else {
                        assert!(matches!(client.put(&c, &key, &data, None), Ok(Put::Committed(_))));
                    }
                    let mut dst = client.shared_buffer(64 << 10).expect("room");
                    let mut plain = vec![0u8; 64 << 10];
                    let (a, b) = (
                        client.get_into(&c, &key, &mut dst).expect("get"),
                        client.get_into(&c, &key, &mut plain).expect("get"),
                    );
                    assert_eq!(a, b);
                    assert_eq!(&dst[..data.len()], &data[..]);
                    assert_eq!(&plain[..data.len()], &data[..]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    let stats = client.shared_stats();
    assert_eq!(stats.direct_items + stats.bounced_items, 8 * 40 * 3);
    assert_eq!((stats.framed_batches, stats.quarantined_bytes), (0, 0));
    assert_eq!(stats.free_bytes, 64 << 20);
}

#[test]
fn the_local_socket_is_negotiated_over_tcp_and_required_once_asked_for() {
    let served = serve(memory(), 1 << 30);
    let mut config = ClientConfig::new(served.server.local_addr(), caller());
    config.local = Some(LocalConfig::negotiated());
    let client = TcpStore::new(config);
    let c = caller();
    let data = payload(5, 100_000);
    assert!(matches!(client.put(&c, &k(10), &data, None), Ok(Put::Committed(_))));
    let mut dst = client.shared_buffer(data.len()).expect("segment made at connect");
    assert!(matches!(client.get_into(&c, &k(10), &mut dst), Ok(Get::Hit { .. })));
    assert_eq!(&dst[..], &data[..]);
    assert_eq!(client.shared_stats().direct_items, 1);

    // A server without a local socket: asking for the same-host path fails closed.
    let tcp_only = {
        let config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), vec![caller()]);
        Server::start(config, memory()).expect("server")
    };
    let mut config = ClientConfig::new(tcp_only.local_addr(), caller());
    config.local = Some(LocalConfig::negotiated());
    let client = TcpStore::new(config);
    let e = client.put(&c, &k(11), b"x", None).expect_err("no local socket offered");
    assert!(e.to_string().contains("offers no local socket"), "{e}");
}

#[test]
fn a_stopped_server_is_a_transport_error_never_a_hit() {
    let served = serve(memory(), 1 << 30);
    let client = served.client(SEGMENT_BYTES_MIN);
    let c = caller();
    assert!(matches!(client.put(&c, &k(8), b"kept", None), Ok(Put::Committed(_))));
    let mut dst = client.shared_buffer(16).expect("room");
    assert!(matches!(client.get_into(&c, &k(8), &mut dst), Ok(Get::Hit { len: 4, .. })));
    assert_eq!(served.server.shutdown(), 0);
    dst.fill(0);
    let e = client.get_into(&c, &k(8), &mut dst).expect_err("server is gone");
    assert!(e.to_string().contains("transport"), "{e}");
    assert!(dst.iter().all(|&b| b == 0));
}

/// Holds GETs until the test opens it: the client's deadline passes while the server is still
/// inside `get_into`.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().expect("gate") = true;
        self.opened.notify_all();
    }

    /// Waits until the gate opens, at most 30 s.
    fn pass(&self) {
        let guard = self.open.lock().expect("gate");
        let deadline = Duration::from_secs(30);
        let _ = self.opened.wait_timeout_while(guard, deadline, |open| !*open).expect("gate");
    }
}

#[test]
fn a_get_the_server_may_still_write_is_not_retired() {
    let gate = Arc::new(Gate::default());
    let waits = Arc::clone(&gate);
    let gated = BeforeGet::new(memory(), move |_: &[u8]| waits.pass());
    let served = serve(Arc::new(gated), 1 << 30);
    let mut config = ClientConfig::new(served.server.local_addr(), caller());
    config.local = Some(LocalConfig::new(served.path()));
    config.deadline = Duration::from_millis(300);
    let client = TcpStore::new(config);
    let c = caller();
    assert!(!client.info().failures_retire, "the shared path cannot promise retirement");
    assert!(matches!(client.put(&c, &k(9), &payload(4, 8192), None), Ok(Put::Committed(_))));

    // Into a caller's shared buffer: the server may write it later, so the error says so.
    let mut dst = client.shared_buffer(8192).expect("room");
    let e = client.get_into(&c, &k(9), &mut dst).expect_err("deadline passes");
    assert_eq!(e.retirement(), Retirement::Unknown, "{e}");
    // Into an ordinary buffer: the bounce buffer is quarantined and the caller's is untouched.
    let mut plain = vec![0u8; 8192];
    let e = client.get_into(&c, &k(9), &mut plain).expect_err("deadline passes");
    assert_eq!(e.retirement(), Retirement::Retired, "{e}");
    assert!(plain.iter().all(|&b| b == 0));
    assert_eq!(client.shared_stats().quarantined_bytes, 8192);
    gate.open();
}

#[test]
fn shared_frames_reach_the_store_as_one_batch_call() {
    let counting = Arc::new(Counting::new(memory()));
    let served = serve(Arc::clone(&counting) as Arc<dyn Store>, 1 << 30);
    let client = served.client(16 << 20);
    let c = caller();
    let keys: Vec<PhysicalKey> = (0..10u8).map(|i| key(0, &[40, i], KvDtype::F16, 16)).collect();
    let values: Vec<Vec<u8>> = (0..10usize).map(|i| payload(i as u64, 100 + 10 * i)).collect();
    // Half from shared buffers, half bounced.
    let mut shared: Vec<_> = (0..5).map(|_| client.shared_buffer(4096).expect("room")).collect();
    for (buf, value) in shared.iter_mut().zip(&values) {
        buf[..value.len()].copy_from_slice(value);
    }
    let puts: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let src = if i < 5 { &shared[i][..values[i].len()] } else { &values[i][..] };
            BatchPut { key, src, request: None }
        })
        .collect();
    assert!(client.put_batch(&c, &puts).iter().all(|a| matches!(a, Ok(Put::Committed(_)))));
    drop(puts);
    assert_eq!(counting.take_calls(), [(Call::PutBatch, 10)]);
    let mut plain: Vec<Vec<u8>> = (0..5).map(|_| vec![0u8; 4096]).collect();
    let mut dsts: Vec<&mut [u8]> = shared.iter_mut().map(|b| &mut b[..]).collect();
    dsts.extend(plain.iter_mut().map(|b| &mut b[..]));
    let mut items: Vec<_> = keys.iter().zip(dsts).map(|(key, dst)| BatchGet { key, dst }).collect();
    let got = client.get_batch(&c, &mut items);
    drop(items);
    assert_eq!(counting.take_calls(), [(Call::GetBatch, 10)]);
    for (i, answer) in got.iter().enumerate() {
        assert!(
            matches!(answer, Ok(Get::Hit { len, .. }) if *len == values[i].len() as u64),
            "{i}: {answer:?}"
        );
        let landed = if i < 5 { &shared[i][..] } else { &plain[i - 5][..] };
        assert_eq!(&landed[..values[i].len()], &values[i][..], "item {i}");
    }
    let stats = client.shared_stats();
    assert_eq!((stats.direct_items, stats.bounced_items, stats.framed_batches), (10, 10, 0));

    // A raw client whose ranges overlap: such items cannot be handed out together, so they are
    // served one at a time, with the same answers.
    let mut raw = Raw::connect(&served.path());
    let segment = Segment::create(SEGMENT_BYTES_MIN, Pages::Normal).expect("segment");
    let fd = segment.fd().try_clone_to_owned().expect("dup");
    assert_eq!(
        raw.call(&Request::ShmAttach { len: SEGMENT_BYTES_MIN }, Some(&fd)),
        Response::ShmAttach(SEGMENT_BYTES_MIN)
    );
    let item = |i: usize, offset| SharedGetItem { key: keys[i].clone(), offset, capacity: 4096 };
    let hit =
        |i: usize| Ok(Get::Hit { len: values[i].len() as u64, checksum: Checksum::of(&values[i]) });
    let _ = counting.take();
    let r = raw.call(&Request::GetShared { items: vec![item(0, 0), item(1, 4096)] }, None);
    assert_eq!(r, Response::GetShared(vec![hit(0), hit(1)]));
    assert_eq!(counting.take_calls(), [(Call::GetBatch, 2)]);
    let r = raw.call(&Request::GetShared { items: vec![item(0, 0), item(1, 100)] }, None);
    assert_eq!(r, Response::GetShared(vec![hit(0), hit(1)]));
    assert_eq!(counting.take_calls(), [(Call::Get, 1), (Call::Get, 1)]);
    segment
        .with_bytes(100, values[1].len() as u64, |b| assert_eq!(b, &values[1][..]))
        .expect("in range");
}

#[test]
fn a_batch_the_server_stops_answering_fails_each_item_with_its_retirement() {
    // The second GET_SHARED frame is held inside the store until the client's deadline passes.
    let gate = Arc::new(Gate::default());
    let waits = Arc::clone(&gate);
    let counting = Counting::new(memory()).before_get_batch(move |n| {
        if n == 1 {
            waits.pass();
        }
    });
    let served = serve(Arc::new(counting), 1 << 30);
    let mut config = ClientConfig::new(served.server.local_addr(), caller());
    let mut local = LocalConfig::new(served.path());
    local.segment_bytes = 64 << 20;
    config.local = Some(local);
    config.deadline = Duration::from_secs(1);
    let client = TcpStore::new(config);
    let c = caller();

    // Frames of BATCH_ITEMS_MAX items; even items into the caller's shared buffers, odd ones
    // into ordinary buffers (bounced). Frame 0 is answered; frame 1 is held; the writer sends
    // at most FRAMES_IN_FLIGHT_MAX unanswered, so the last frame is never sent.
    let frames = FRAMES_IN_FLIGHT_MAX + 2;
    let n = frames * BATCH_ITEMS_MAX;
    let keys: Vec<PhysicalKey> = (0..n)
        .map(|i| {
            let [lo, hi, ..] = i.to_le_bytes();
            key(0, &[41, lo, hi], KvDtype::F16, 16)
        })
        .collect();
    let mut shared: Vec<_> = (0..n / 2).map(|_| client.shared_buffer(16).expect("room")).collect();
    let mut plain: Vec<Vec<u8>> = (0..n / 2).map(|_| vec![0u8; 16]).collect();
    let mut items: Vec<_> = shared
        .iter_mut()
        .zip(&mut plain)
        .flat_map(|(s, p)| [&mut s[..], &mut p[..]])
        .zip(&keys)
        .map(|(dst, key)| BatchGet { key, dst })
        .collect();
    let got = client.get_batch(&c, &mut items);
    drop(items);
    gate.open();
    assert_eq!(got.len(), n);
    for (i, answer) in got.iter().enumerate() {
        let frame = i / BATCH_ITEMS_MAX;
        let direct = i % 2 == 0;
        if frame == 0 {
            assert_eq!(*answer, Ok(Get::Miss(MissReason::Absent)), "item {i}");
            continue;
        }
        let e = answer.as_ref().expect_err("unanswered items fail");
        let retirement = e.retirement();
        if frame == 1 && direct {
            // The server is inside this frame: it may still write the caller's buffer.
            assert_eq!(retirement, Retirement::Unknown, "item {i}: {e}");
        } else if !direct || frame == frames - 1 {
            // A bounce buffer keeps the caller's buffer untouched; a frame never sent was
            // never served.
            assert_eq!(retirement, Retirement::Retired, "item {i}: {e}");
        }
    }
    assert!(plain.iter().all(|p| p.iter().all(|&b| b == 0)));
    // The bounce buffers of the frames that may have been served are kept out of reuse, and at
    // least frame 1's are among them; those of the frame never sent are not.
    let quarantined = client.shared_stats().quarantined_bytes;
    let per_frame = (BATCH_ITEMS_MAX as u64 / 2) * ARENA_ALIGN;
    assert!(quarantined >= per_frame, "{quarantined}");
    assert!(quarantined <= per_frame * (frames as u64 - 2), "{quarantined}");
}
