//! One client's large PUT striped over several connections (RESERVE, parallel WRITEs, COMMIT)
//! against a real `gpucache serve`: the bytes round-trip exactly, the server saw one WRITE per
//! part, and a part damaged on the way fails the whole PUT and stores nothing.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::thread;

use gpucache_client::{ClientConfig, Stripe, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::store::{Get, MissReason, Put, Store};
use gpucache_dataplane::testing::fixture::{key, payload};

mod common;

use common::{Serve, http_get};

/// Parts a striped value is sent in here.
const PARTS: usize = 4;
/// Stream offset (of every connection through the damaging proxy, client to server) whose
/// byte is flipped: past HELLO and RESERVE, inside the first WRITE's data.
const FLIP_AT: u64 = 200_000;

fn serve(dir: &Path) -> Serve {
    let config = dir.join("gpucache.toml");
    std::fs::write(
        &config,
        "[store]\nkind = \"memory\"\n\n\
         [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
         [[tenants]]\nname = \"tenant-a\"\nrights = [\"read\", \"write\"]\n",
    )
    .expect("config");
    Serve::start_in(dir, &config)
}

fn caller() -> Caller {
    Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE)
}

fn client(addr: SocketAddr, stripe: Stripe) -> TcpStore {
    let mut config = ClientConfig::new(addr, caller());
    config.stripe = stripe;
    TcpStore::new(config)
}

/// The count of the server's store calls of `op` with `outcome` (0 when never counted).
fn ops(metrics: SocketAddr, op: &str, outcome: &str) -> u64 {
    let body = http_get(metrics, "/metrics");
    let prefix = format!("gpucache_ops_total{{op=\"{op}\",outcome=\"{outcome}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |n| n.trim().parse().unwrap_or_else(|e| panic!("{l}: {e}", l = n)))
}

#[test]
fn a_striped_put_round_trips_exact_bytes_in_parts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = serve(dir.path());
    let caller = caller();
    let striped = client(server.native(), Stripe::new(1 << 20, PARTS));
    let plain = client(server.native(), Stripe::default());

    // Odd sizes: the parts differ by a byte, and the last one ends on no boundary.
    for (i, len) in (0u8..).zip([(4 << 20) + 3, (1 << 20) + 1]) {
        let writes_before = ops(server.metrics(), "write", "ok");
        let k = key(0, &[9, i], KvDtype::Bf16, 16);
        let data = payload(31 + u64::from(i), len);
        let put = striped.put(&caller, &k, &data, None).expect("striped put");
        assert_eq!(put, Put::Committed(Checksum::of(&data)));
        assert_eq!(
            ops(server.metrics(), "write", "ok") - writes_before,
            PARTS as u64,
            "one WRITE per part"
        );
        for reader in [&plain, &striped] {
            let mut dst = vec![0u8; len];
            let got = reader.get_into(&caller, &k, &mut dst).expect("get");
            assert_eq!(got, Get::Hit { len: len as u64, checksum: Checksum::of(&data) });
            assert!(dst == data, "the bytes read back are the bytes written");
        }
        // The key is committed: a second striped PUT stores nothing and says so.
        let again = striped.put(&caller, &k, &payload(99, len), None).expect("second put");
        assert_eq!(again, Put::AlreadyCommitted);
    }

    // Below the threshold a value goes as one PUT frame: no WRITE at all.
    let writes_before = ops(server.metrics(), "write", "ok");
    let small = payload(5, (1 << 20) - 1);
    let k = key(0, &[9, 9], KvDtype::Bf16, 16);
    assert!(matches!(striped.put(&caller, &k, &small, None), Ok(Put::Committed(_))));
    assert_eq!(ops(server.metrics(), "write", "ok"), writes_before);
    server.stop();
}

/// A proxy to `to` that flips the byte at stream offset [`FLIP_AT`] of what every client
/// connection sends; the answers pass untouched. Its threads end when their sockets close.
fn damaging_proxy(to: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
    let addr = listener.local_addr().expect("proxy address");
    thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(to) else { return };
            let (c2, s2) = (
                client.try_clone().expect("clone client"),
                server.try_clone().expect("clone server"),
            );
            thread::spawn(move || pump(client, server, Some(FLIP_AT)));
            thread::spawn(move || pump(s2, c2, None));
        }
    });
    addr
}

fn pump(mut from: TcpStream, mut to: TcpStream, flip: Option<u64>) {
    let mut buf = vec![0u8; 64 << 10];
    let mut at = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(f) = flip
            && (at..at + n as u64).contains(&f)
        {
            buf[usize::try_from(f - at).expect("small")] ^= 0xff;
        }
        at += n as u64;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

#[test]
fn a_part_damaged_on_the_way_fails_the_put_and_stores_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = serve(dir.path());
    let caller = caller();
    let proxy = damaging_proxy(server.native());
    let striped = client(proxy, Stripe::new(1 << 20, PARTS));
    let direct = client(server.native(), Stripe::default());

    let len = 4 << 20;
    let k = key(0, &[4, 4], KvDtype::Bf16, 16);
    let data = payload(8, len);
    let put = striped.put(&caller, &k, &data, None);
    assert!(put.is_err(), "a damaged part fails the whole PUT: {put:?}");

    // Nothing of it is readable: no partial or damaged block.
    let mut dst = vec![0u8; len];
    assert_eq!(direct.get_into(&caller, &k, &mut dst).expect("get"), Get::Miss(MissReason::Absent));
    // The reservation was given back: the key can be written whole.
    assert_eq!(
        direct.put(&caller, &k, &data, None).expect("put"),
        Put::Committed(Checksum::of(&data))
    );
    let got = direct.get_into(&caller, &k, &mut dst).expect("get");
    assert!(matches!(got, Get::Hit { .. }) && dst == data);
    server.stop();
}
