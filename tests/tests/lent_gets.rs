//! `Store::get_one` lending: a GET that hands the store's own bytes to the sender instead of
//! copying them. The memory store checks the checksum its sender computed as it sent them, and drops a
//! block that does not match, as `get_into` would; a file store lends a block of its log whose
//! pages are in memory, from the segment's map, and copies any other; and the service's one-key GET, which sends a lent block without copying it,
//! answers exactly what the copying path answers.

use std::sync::Arc;
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Get, Lookup, MissReason, Store, StoreError};
use gpucache_dataplane::testing::fixture::{get_lent, key, payload, tenant};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::{Durability, FileStoreConfig, Layout};

fn caller() -> Caller {
    Caller::new(tenant(0), Rights::READ_WRITE)
}

fn memory() -> Arc<MemoryStore> {
    let limits = ResourceLimits { object_bytes_max: 8 << 20, ..ResourceLimits::default() };
    Arc::new(MemoryStore::new(limits, Arc::new(MonotonicClock::default())).expect("store"))
}

fn k(i: u8) -> PhysicalKey {
    key(0, &[i, 3], KvDtype::F16, 16)
}

/// Each call of `send` in one lending GET: the bytes lent and their checksum.
type Lent = Vec<(Vec<u8>, Checksum)>;

/// What one lending GET answered (`None`: the store copied instead) and lent.
fn lend(
    store: &dyn Store,
    key: &PhysicalKey,
    capacity: usize,
) -> (Result<Option<Get>, StoreError>, Lent) {
    lend_with(store, key, capacity, Checksum::of)
}

/// As [`lend`], the sender reporting `sent(bytes)` as the checksum of what it sent.
fn lend_with(
    store: &dyn Store,
    key: &PhysicalKey,
    capacity: usize,
    sent: impl Fn(&[u8]) -> Checksum,
) -> (Result<Option<Get>, StoreError>, Lent) {
    let mut lent = Vec::new();
    let got = get_lent(store, &caller(), key, capacity, |bytes, sum| {
        lent.push((bytes.to_vec(), sum));
        Some(sent(bytes))
    });
    (got, lent)
}

#[test]
fn the_memory_store_checks_what_its_sender_hashed() {
    let store = memory();
    let c = caller();
    let data = payload(5, 300_000);
    store.put(&c, &k(1), &data, None).expect("put");
    let (got, lent) = lend(&*store, &k(1), data.len());
    assert_eq!(got, Ok(Some(Get::Hit { len: data.len() as u64, checksum: Checksum::of(&data) })));
    assert_eq!(lent, vec![(data.clone(), Checksum::of(&data))]);
    // A miss and a too-small capacity lend nothing, answered as get_into answers them.
    let (got, lent) = lend(&*store, &k(2), 10);
    assert_eq!((got, lent.len()), (Ok(Some(Get::Miss(MissReason::Absent))), 0));
    let (got, lent) = lend(&*store, &k(1), data.len() - 1);
    let mut small = vec![0u8; data.len() - 1];
    assert_eq!(got.map(|_| ()), store.get_into(&c, &k(1), &mut small).map(|_| ()));
    assert!(lent.is_empty());
    // A sender that could not send it all leaves the check to the store, which still finds
    // the block intact.
    let got = get_lent(&*store, &c, &k(1), data.len(), |_, _| None);
    assert!(matches!(got, Ok(Some(Get::Hit { .. }))), "{got:?}");
    // Damaged bytes go out only under the committed checksum, which the receiver checks;
    // the sender's checksum shows the damage, and the block is dropped and counted.
    let dropped = store.stats().corrupt_dropped.total();
    assert!(store.corrupt_for_test(&k(1), 4242));
    let (got, lent) = lend(&*store, &k(1), data.len());
    assert_eq!(got, Ok(Some(Get::Miss(MissReason::Corrupt))));
    assert_eq!(lent.len(), 1);
    assert_ne!(Checksum::of(&lent[0].0), lent[0].1, "the damage was not in the lent bytes");
    assert_eq!(store.stats().corrupt_dropped.total(), dropped + 1);
    assert_eq!(store.lookup(&c, &k(1)), Ok(Lookup::Miss(MissReason::Absent)));
    // And the store believes the sender: a checksum that differs drops an intact block too.
    store.put(&c, &k(3), &data, None).expect("put");
    let (got, _) = lend_with(&*store, &k(3), data.len(), |_| Checksum(0));
    assert_eq!(got, Ok(Some(Get::Miss(MissReason::Corrupt))));
}

#[test]
fn a_file_store_lends_warm_blocks_of_its_log_and_copies_the_rest() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    let dir = tempfile::tempdir().expect("dir");
    let open = |layout| {
        let mut config = FileStoreConfig::new(dir.path().join(format!("{layout:?}")));
        config.durability = Durability::PerBlock;
        config.layout = layout;
        config.open(Arc::new(MonotonicClock::default())).expect("file store")
    };
    let c = caller();
    let data = payload(6, 300_000);
    let sum = Checksum::of(&data);

    // A file per block: copied.
    let files = open(Layout::Files);
    files.put(&c, &k(1), &data, None).expect("put");
    assert_eq!(lend(&files, &k(1), data.len()), (Ok(None), Vec::new()));

    let log = open(Layout::Log);
    log.put(&c, &k(1), &data, None).expect("put");
    let (segment, payload_at) = log.block_location(&k(1)).expect("committed");
    // Out of memory (flushed by the durable PUT, then dropped from the page cache): copied,
    // since a page read through a map cannot report a device error.
    let file = std::fs::File::open(&segment).expect("open the segment");
    // SAFETY: posix_fadvise on a descriptor we own touches no memory of ours.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise");
    assert_eq!(lend(&log, &k(1), data.len()), (Ok(None), Vec::new()));
    // The copy read it back into memory: now lent, from the segment's own pages.
    let (got, lent) = lend(&log, &k(1), data.len());
    assert_eq!(got, Ok(Some(Get::Hit { len: data.len() as u64, checksum: sum })));
    assert_eq!(lent, vec![(data.clone(), sum)]);
    // A sender whose checksum differs: the store checks a private copy, finds the block
    // intact and keeps it.
    let (got, _) = lend_with(&log, &k(1), data.len(), |_| Checksum(0));
    assert_eq!(got, Ok(Some(Get::Miss(MissReason::Corrupt))));
    assert_eq!(log.lookup(&c, &k(1)), Ok(Lookup::Hit { len: data.len() as u64 }));
    // Damage in the segment: lent under the committed checksum, which the sender's does not
    // match; the block is dropped and counted.
    let writable = std::fs::OpenOptions::new().write(true).open(&segment).expect("open");
    writable.write_all_at(&[data[100] ^ 0x5A], payload_at + 100).expect("damage");
    let (got, lent) = lend(&log, &k(1), data.len());
    assert_eq!(got, Ok(Some(Get::Miss(MissReason::Corrupt))));
    assert_eq!(lent.len(), 1);
    assert_ne!(Checksum::of(&lent[0].0), lent[0].1);
    assert_eq!(log.stats().corrupt_dropped.total(), 1);
    assert_eq!(log.lookup(&c, &k(1)), Ok(Lookup::Miss(MissReason::Absent)));
}

#[test]
fn the_service_sends_lent_blocks_as_the_copying_path_would() {
    let store = memory();
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), vec![caller()]);
    config.connections_max = 8;
    let server = Server::start(config, Arc::clone(&store) as Arc<dyn Store>).expect("server");
    let mut client = ClientConfig::new(server.local_addr(), caller());
    client.deadline = Duration::from_secs(10);
    let client = TcpStore::new(client);
    let c = caller();
    let sizes = [1, 4096, 1 << 20, (4 << 20) + 3];
    for (i, &n) in (0u8..).zip(&sizes) {
        let data = payload(u64::from(i) + 10, n);
        client.put(&c, &k(i), &data, None).expect("put");
        // A one-key GET (lent) and the same key in a two-key batch (copied into the frame).
        let mut one = vec![0u8; n + 7];
        let got = client.get_into(&c, &k(i), &mut one).expect("get");
        assert_eq!(got, Get::Hit { len: n as u64, checksum: Checksum::of(&data) });
        assert_eq!(&one[..n], &data[..], "{n} bytes");
        let mut a = vec![0u8; n];
        let mut b = vec![0u8; 8];
        let mut batch = [
            gpucache_dataplane::store::BatchGet { key: &k(i), dst: &mut a },
            gpucache_dataplane::store::BatchGet { key: &k(200), dst: &mut b },
        ];
        let answers = client.get_batch(&c, &mut batch);
        assert_eq!(answers[0], Ok(got));
        assert_eq!(answers[1], Ok(Get::Miss(MissReason::Absent)));
        assert_eq!(a, data);
    }
    // Misses, refusals and damage come back through the same path as typed answers.
    let mut dst = vec![0u8; 16];
    assert_eq!(client.get_into(&c, &k(99), &mut dst), Ok(Get::Miss(MissReason::Absent)));
    assert!(matches!(client.get_into(&c, &k(2), &mut dst), Err(StoreError::BufferTooSmall { .. })));
    assert!(store.corrupt_for_test(&k(2), 99));
    let mut big = vec![0xEE_u8; 1 << 20];
    assert_eq!(client.get_into(&c, &k(2), &mut big), Ok(Get::Miss(MissReason::Corrupt)));
    assert!(big.iter().all(|&b| b == 0), "a corrupt miss left bytes in the buffer");
    assert_eq!(server.shutdown(), 0);
}

/// A one-hit answer's payload lands straight in the caller's buffer; what arrives there is
/// checked before it is a hit. A server that answers byte by byte, one that damages a payload
/// byte, and one that stops halfway through the payload: the first is a hit with the bytes, the
/// second a corrupt miss, the third a failure, and neither of the last two leaves payload bytes
/// in the buffer.
#[test]
fn a_directly_received_payload_is_checked_and_undone_on_failure() {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use gpucache_wire::{FrameDecoder, Request, Response, VERSION, get_hit_frame_parts};

    #[derive(Clone, Copy)]
    enum Serve {
        InPieces,
        Damaged,
        CutHalfway,
    }
    let data = payload(77, 300_000);
    for how in [Serve::InPieces, Serve::Damaged, Serve::CutHalfway] {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let bytes = data.clone();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut dec = FrameDecoder::new();
            let mut buf = vec![0u8; 4096];
            let mut next = |s: &mut std::net::TcpStream| loop {
                if let Some(frame) = dec.next_frame().expect("frame") {
                    return frame;
                }
                let n = s.read(&mut buf).expect("read");
                assert!(n > 0, "the client closed early");
                assert_eq!(dec.push(&buf[..n]), n);
            };
            let hello = next(&mut s);
            let answer = Response::Hello {
                version: VERSION,
                server: "fake".into(),
                session: None,
                local: None,
            };
            s.write_all(&answer.to_frame_bytes(hello.request_id).expect("hello")).expect("write");
            let get = next(&mut s);
            assert!(matches!(Request::from_frame(&get), Ok(Request::Get { .. })));
            let (mut head, mut tail) = (Vec::new(), Vec::new());
            get_hit_frame_parts(
                get.request_id,
                bytes.len(),
                Checksum::of(&bytes),
                &mut head,
                &mut tail,
            )
            .expect("parts");
            let mut body = bytes.clone();
            match how {
                Serve::InPieces => {}
                Serve::Damaged => body[123_456] ^= 0x10,
                Serve::CutHalfway => {
                    s.write_all(&head).expect("write");
                    s.write_all(&body[..body.len() / 2]).expect("write");
                    return;
                }
            }
            let frame = [head, body, tail].concat();
            for piece in frame.chunks(7919) {
                s.write_all(piece).expect("write");
            }
        });
        let mut config = ClientConfig::new(addr, caller());
        config.deadline = Duration::from_secs(10);
        let client = TcpStore::new(config);
        let mut dst = vec![0xEE_u8; data.len() + 10];
        let got = client.get_into(&caller(), &k(1), &mut dst);
        server.join().expect("fake server");
        match how {
            Serve::InPieces => {
                assert_eq!(
                    got,
                    Ok(Get::Hit { len: data.len() as u64, checksum: Checksum::of(&data) })
                );
                assert_eq!(&dst[..data.len()], &data[..]);
            }
            Serve::Damaged => {
                assert_eq!(got, Ok(Get::Miss(MissReason::Corrupt)));
                assert!(dst[..data.len()].iter().all(|&b| b == 0), "damaged bytes were left");
            }
            Serve::CutHalfway => {
                assert!(got.is_err(), "{got:?}");
                // What arrived was zeroed again; the rest was never written.
                assert!(dst.iter().all(|&b| b == 0 || b == 0xEE), "a partial payload was left");
                assert!(dst.contains(&0), "nothing arrived before the cut");
            }
        }
        assert!(dst[data.len()..].iter().all(|&b| b == 0xEE), "bytes past the payload changed");
    }
}
