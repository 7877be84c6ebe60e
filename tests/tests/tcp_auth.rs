//! Authenticated sessions of the native service (ADR 0012) against a live in-process server:
//! every HELLO refusal is its own typed reason, sealed frames that were tampered with or
//! replayed are refused, rotation through the key file needs no restart, a bad reload keeps the
//! keys in force, rights and tenants are enforced per op, and the client never hands out an
//! answer whose seal fails. Time is a `ManualClock`; nothing sleeps.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpucache_client::{ClientConfig, Credentials, TcpStore};
use gpucache_dataplane::caller::{Caller, Right, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Get, Put, Store, StoreError};
use gpucache_service::auth::{Secret, TenantKeys};
use gpucache_service::resp::IdentityTemplate;
use gpucache_service::{Server, ServerConfig, TenantAuth};
use gpucache_storage::MemoryStore;
use gpucache_wire::seal::{self, NONCE_BYTES};
use gpucache_wire::{
    AuthFailure, Frame, FrameDecoder, HEADER_BYTES, HelloAuth, HelloSession, Request, Response,
    SealAlgorithm, SealKey, VERSION, WireError, header_checksum, offset,
};

/// The servers' and clients' clock: a fixed Unix time, moved only by the tests.
const NOW_MS: u64 = 1_800_000_000_000;
const NOW_S: u64 = NOW_MS / 1000;

const SEALED_RW: &str = "sealed-rw";
const SEALED_RO: &str = "sealed-ro";
const SEALED_ADMIN: &str = "sealed-admin";
const OPEN_RW: &str = "open-rw";

fn tenant(name: &str) -> TenantId {
    TenantId::parse(name).expect("tenant name")
}

fn secret(fill: u8) -> Secret {
    Secret::new(vec![fill; 32]).expect("32-byte secret")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Replaces `path` atomically with a 0600 file holding `text` (as an operator would: write a
/// new file, then rename it over the old one).
fn write_keys(path: &Path, text: &str) {
    let dir = path.parent().expect("key file has a directory");
    let mut next = tempfile::NamedTempFile::new_in(dir).expect("temp key file");
    next.write_all(text.as_bytes()).expect("write keys");
    std::fs::set_permissions(next.path(), std::fs::Permissions::from_mode(0o600)).expect("chmod");
    next.persist(path).expect("rename over the key file");
}

fn key_line(id: &str, fill: u8, not_after_s: Option<u64>) -> String {
    let s = secret(fill);
    match not_after_s {
        Some(t) => format!("{id} {} {t}\n", hex(s.bytes())),
        None => format!("{id} {}\n", hex(s.bytes())),
    }
}

struct Fixture {
    server: Server,
    clock: ManualClock,
    /// `SEALED_RW`'s key file (keys `k1` = 0x11.., `k2` = 0x22..).
    rw_keys: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let rw_keys = dir.path().join("sealed-rw.keys");
        write_keys(&rw_keys, &key_line("k1", 0x11, None));
        let clock = ManualClock::default();
        clock.advance_ms(NOW_MS);
        let store = Arc::new(
            MemoryStore::new(ResourceLimits::default(), Arc::new(clock.clone())).expect("store"),
        );
        let tenants = vec![
            Caller::new(tenant(SEALED_RW), Rights::READ_WRITE),
            Caller::new(tenant(SEALED_RO), Rights::READ_ONLY),
            Caller::new(tenant(SEALED_ADMIN), Rights::ALL),
            Caller::new(tenant(OPEN_RW), Rights::READ_WRITE),
        ];
        let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), tenants);
        config.clock = Arc::new(clock.clone());
        let fixed = |id: &str, fill: u8, not_after_s: Option<u64>| {
            let key = gpucache_service::auth::TenantKey {
                id: id.into(),
                secret: secret(fill),
                not_after_s,
            };
            TenantAuth::new(TenantKeys::fixed(vec![key]).expect("keys"))
        };
        let rw = TenantAuth::new(TenantKeys::load(&rw_keys).expect("key file loads"));
        config.auth.insert(tenant(SEALED_RW), rw);
        config.auth.insert(tenant(SEALED_RO), fixed("ro1", 0x33, None));
        let mut admin = fixed("adm", 0x44, None);
        admin.accepted = vec![SealAlgorithm::HmacSha256];
        config.auth.insert(tenant(SEALED_ADMIN), admin);
        let server = Server::start(config, store).expect("server");
        Self { server, clock, rw_keys, _dir: dir }
    }

    fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// A client whose callers ask for every right; `credentials` per tenant.
    fn client(&self, control: &str, credentials: &[(&str, Credentials)]) -> TcpStore {
        let mut config = ClientConfig::new(self.addr(), Caller::new(tenant(control), Rights::ALL));
        config.clock = Arc::new(self.clock.clone());
        config.deadline = Duration::from_secs(10);
        for (name, c) in credentials {
            config = config.with_credentials(tenant(name), c.clone());
        }
        TcpStore::new(config)
    }
}

fn creds(id: &str, fill: u8) -> Credentials {
    Credentials::new(id, secret(fill))
}

fn key_of(tenant_name: &str, name: &str) -> PhysicalKey {
    IdentityTemplate::for_tenant(&tenant(tenant_name))
        .expect("template")
        .key_for(name.as_bytes())
        .expect("key")
}

fn everything(name: &str) -> Caller {
    Caller::new(tenant(name), Rights::ALL)
}

/// A connection driven by hand, frame by frame.
struct Raw {
    stream: TcpStream,
    decoder: FrameDecoder,
    session: Option<SealKey>,
}

/// What a hand-made HELLO claims.
struct Claim {
    tenant: &'static str,
    key_id: &'static str,
    fill: u8,
    timestamp_ms: u64,
    seal: SealAlgorithm,
    /// Seal the HELLO with the secret (a correct client always does).
    sealed: bool,
    /// Carry credentials at all.
    keyed: bool,
}

impl Claim {
    fn rw() -> Self {
        Self {
            tenant: SEALED_RW,
            key_id: "k1",
            fill: 0x11,
            timestamp_ms: NOW_MS,
            seal: SealAlgorithm::Blake3,
            sealed: true,
            keyed: true,
        }
    }
}

impl Raw {
    fn connect(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        Self { stream, decoder: FrameDecoder::new(), session: None }
    }

    /// Sends `claim`'s HELLO and returns the answer; on success the session key is kept.
    fn hello(addr: SocketAddr, claim: &Claim) -> (Self, Response) {
        let mut raw = Self::connect(addr);
        let secret = secret(claim.fill);
        let client_nonce = [0x5a; NONCE_BYTES];
        let request = Request::Hello {
            tenant: tenant(claim.tenant),
            client_name: "raw".into(),
            rights: Rights::ALL,
            auth: claim.keyed.then(|| HelloAuth {
                key_id: claim.key_id.into(),
                fingerprint: seal::fingerprint(secret.bytes(), claim.tenant),
                client_nonce,
                timestamp_ms: claim.timestamp_ms,
                seal: claim.seal,
            }),
        };
        let hello_key = SealKey::hello(secret.bytes());
        let mut bytes = Vec::new();
        request
            .encode_sealed_frame(1, claim.sealed.then_some(&hello_key), &mut bytes)
            .expect("hello encodes");
        raw.send(&bytes);
        let frame = raw.frame().expect("an answer to HELLO");
        let answer = Response::from_frame(&frame).expect("answer decodes");
        if let Response::Hello { session: Some(HelloSession { server_nonce, seal: alg }), .. } =
            &answer
        {
            let key = seal::session_key(secret.bytes(), &client_nonce, server_nonce, claim.tenant);
            let key = SealKey::new(*alg, &key);
            assert_eq!(frame.verify_seal(&key), Ok(()), "the HELLO answer is sealed");
            raw.session = Some(key);
        }
        (raw, answer)
    }

    fn sealed(&self, request: &Request, id: u64) -> Vec<u8> {
        let mut bytes = Vec::new();
        request.encode_sealed_frame(id, self.session.as_ref(), &mut bytes).expect("encodes");
        bytes
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send");
    }

    /// The next whole frame, or `None` once the server closed the connection.
    fn frame(&mut self) -> Option<Frame> {
        let mut buf = [0u8; 64 << 10];
        loop {
            let mut empty: &[u8] = &[];
            if let Ok(Some(frame)) = self.decoder.feed(&mut empty) {
                return Some(frame);
            }
            let n = self.stream.read(&mut buf).ok().filter(|n| *n > 0)?;
            let mut input = &buf[..n];
            match self.decoder.feed(&mut input) {
                Ok(Some(frame)) => {
                    assert!(input.is_empty(), "one answer per request");
                    return Some(frame);
                }
                Ok(None) => {}
                Err(e) => panic!("server sent an undecodable frame: {e}"),
            }
        }
    }

    /// The next answer, its seal checked under the session key.
    fn answer(&mut self) -> Response {
        let frame = self.frame().expect("an answer");
        if let Some(key) = &self.session {
            assert_eq!(frame.verify_seal(key), Ok(()), "answers on a sealed session are sealed");
        }
        Response::from_frame(&frame).expect("answer decodes")
    }

    fn closed(&mut self) -> bool {
        self.frame().is_none()
    }
}

fn refused(answer: &Response) -> Option<AuthFailure> {
    match answer {
        Response::Error(WireError::AuthFailed { reason }) => Some(*reason),
        _ => None,
    }
}

#[test]
fn a_correct_hello_opens_a_sealed_session_with_either_algorithm() {
    let f = Fixture::start();
    for alg in SealAlgorithm::ALL {
        let (mut raw, answer) = Raw::hello(f.addr(), &Claim { seal: alg, ..Claim::rw() });
        assert!(
            matches!(answer, Response::Hello { version: VERSION, session: Some(s), .. } if s.seal == alg),
            "{answer:?}"
        );
        let bytes = raw.sealed(&Request::Epoch, 2);
        raw.send(&bytes);
        assert!(matches!(raw.answer(), Response::Epoch(_)));
    }
}

#[test]
fn each_hello_refusal_has_its_own_reason_and_closes() {
    let f = Fixture::start();
    let skew = 120_000;
    let cases: Vec<(Claim, AuthFailure)> = vec![
        (Claim { fill: 0x99, ..Claim::rw() }, AuthFailure::BadFingerprint),
        (Claim { key_id: "k9", ..Claim::rw() }, AuthFailure::UnknownKey),
        (Claim { timestamp_ms: NOW_MS - skew - 1, ..Claim::rw() }, AuthFailure::ClockSkew),
        (Claim { timestamp_ms: NOW_MS + skew + 1, ..Claim::rw() }, AuthFailure::ClockSkew),
        (Claim { sealed: false, ..Claim::rw() }, AuthFailure::SecretRequired),
        (Claim { keyed: false, sealed: false, ..Claim::rw() }, AuthFailure::SecretRequired),
        (Claim { tenant: OPEN_RW, ..Claim::rw() }, AuthFailure::TenantOpen),
        (
            Claim {
                tenant: SEALED_ADMIN,
                key_id: "adm",
                fill: 0x44,
                seal: SealAlgorithm::Blake3,
                ..Claim::rw()
            },
            AuthFailure::SealAlgorithm,
        ),
    ];
    for (i, (claim, reason)) in cases.iter().enumerate() {
        let (mut raw, answer) = Raw::hello(f.addr(), claim);
        assert_eq!(refused(&answer), Some(*reason), "case {i}: {answer:?}");
        assert!(raw.closed(), "case {i}: a failed HELLO closes the connection");
    }
    // Inside the window both ways is fine.
    for ts in [NOW_MS - skew, NOW_MS + skew] {
        let (_, answer) = Raw::hello(f.addr(), &Claim { timestamp_ms: ts, ..Claim::rw() });
        assert!(matches!(answer, Response::Hello { .. }), "{answer:?}");
    }
    // The admin tenant accepts HMAC-SHA-256.
    let claim = Claim {
        tenant: SEALED_ADMIN,
        key_id: "adm",
        fill: 0x44,
        seal: SealAlgorithm::HmacSha256,
        ..Claim::rw()
    };
    assert!(matches!(Raw::hello(f.addr(), &claim).1, Response::Hello { session: Some(_), .. }));
}

#[test]
fn a_hello_sealed_with_another_secret_is_refused() {
    let f = Fixture::start();
    // The right fingerprint, but the frame sealed with a different secret.
    let mut raw = Raw::connect(f.addr());
    let good = secret(0x11);
    let request = Request::Hello {
        tenant: tenant(SEALED_RW),
        client_name: "raw".into(),
        rights: Rights::ALL,
        auth: Some(HelloAuth {
            key_id: "k1".into(),
            fingerprint: seal::fingerprint(good.bytes(), SEALED_RW),
            client_nonce: [1; NONCE_BYTES],
            timestamp_ms: NOW_MS,
            seal: SealAlgorithm::Blake3,
        }),
    };
    let mut bytes = Vec::new();
    request
        .encode_sealed_frame(1, Some(&SealKey::hello(&[0x77; 32])), &mut bytes)
        .expect("encodes");
    raw.send(&bytes);
    assert_eq!(refused(&raw.answer()), Some(AuthFailure::BadSeal));
    assert!(raw.closed());
}

#[test]
fn the_client_reports_a_wrong_secret_as_an_authentication_failure() {
    let f = Fixture::start();
    let client = f.client(SEALED_RW, &[(SEALED_RW, creds("k1", 0x99))]);
    let k = key_of(SEALED_RW, "x");
    let e = client.put(&everything(SEALED_RW), &k, b"v", None).expect_err("refused");
    assert!(e.to_string().contains("tenant fingerprint does not match"), "{e}");
    // And with the right one, a round trip.
    let client = f.client(SEALED_RW, &[(SEALED_RW, creds("k1", 0x11))]);
    let who = everything(SEALED_RW);
    assert!(matches!(client.put(&who, &k, b"v", None), Ok(Put::Committed(_))));
    let mut buf = [0u8; 8];
    assert!(matches!(client.get_into(&who, &k, &mut buf), Ok(Get::Hit { len: 1, .. })));
}

/// Flips the first payload byte of a captured PUT frame. The frame checksum covers only a PUT's
/// trailer, so the frame still decodes: the seal notices first (and the item's checksum would).
fn tamper_body(frame: &[u8]) -> Vec<u8> {
    let mut bytes = frame.to_vec();
    bytes[HEADER_BYTES] ^= 0x01;
    bytes
}

fn fix_header_checksum(bytes: &mut [u8]) {
    let sum = header_checksum(&bytes[..offset::HEADER_CHECKSUM]);
    bytes[offset::HEADER_CHECKSUM..HEADER_BYTES].copy_from_slice(&sum.to_le_bytes());
}

fn put_request(tenant_name: &str, name: &str, data: &[u8]) -> Request {
    Request::Put {
        items: vec![gpucache_wire::PutItem {
            key: key_of(tenant_name, name),
            request: None,
            data: data.to_vec(),
        }],
    }
}

#[test]
fn tampered_bodies_and_headers_fail_the_seal_and_close() {
    let f = Fixture::start();
    let (mut raw, _) = Raw::hello(f.addr(), &Claim::rw());
    let frame = raw.sealed(&put_request(SEALED_RW, "t", b"value"), 2);
    raw.send(&tamper_body(&frame));
    assert_eq!(raw.answer(), Response::Error(WireError::SealMismatch));
    assert!(raw.closed());

    let (mut raw, _) = Raw::hello(f.addr(), &Claim::rw());
    let mut frame = raw.sealed(&put_request(SEALED_RW, "t", b"value"), 2);
    frame[offset::REQUEST_ID] ^= 0x04; // request id 2 -> 6, header checksum fixed up
    fix_header_checksum(&mut frame);
    raw.send(&frame);
    assert_eq!(raw.answer(), Response::Error(WireError::SealMismatch));
    assert!(raw.closed());

    // Nothing was stored by either attempt.
    let client = f.client(SEALED_RW, &[(SEALED_RW, creds("k1", 0x11))]);
    let mut buf = [0u8; 8];
    let got = client.get_into(&everything(SEALED_RW), &key_of(SEALED_RW, "t"), &mut buf);
    assert!(matches!(got, Ok(Get::Miss(_))), "{got:?}");
}

#[test]
fn unsealed_frames_on_a_sealed_session_are_refused_and_close() {
    let f = Fixture::start();
    let (mut raw, _) = Raw::hello(f.addr(), &Claim::rw());
    raw.send(&Request::Epoch.to_frame_bytes(2).expect("encodes"));
    assert_eq!(raw.answer(), Response::Error(WireError::Unsealed));
    assert!(raw.closed());
}

#[test]
fn replayed_frames_are_refused_on_their_connection_and_fail_on_another() {
    let f = Fixture::start();
    let (mut raw, _) = Raw::hello(f.addr(), &Claim::rw());
    let put = raw.sealed(&put_request(SEALED_RW, "r", b"once"), 7);
    raw.send(&put);
    assert!(
        matches!(raw.answer(), Response::Put(items) if matches!(items[..], [Ok(Put::Committed(_))]))
    );
    raw.send(&put);
    assert_eq!(raw.answer(), Response::Error(WireError::Replayed { request_id: 7 }));
    // The connection goes on; an older unseen id is fine, id 0 and the HELLO's id are not.
    let epoch = raw.sealed(&Request::Epoch, 5);
    raw.send(&epoch);
    assert!(matches!(raw.answer(), Response::Epoch(_)));
    for used in [0, 1, 5] {
        let again = raw.sealed(&Request::Epoch, used);
        raw.send(&again);
        assert_eq!(raw.answer(), Response::Error(WireError::Replayed { request_id: used }));
    }
    let far = raw.sealed(&Request::Epoch, 7 + 1024);
    raw.send(&far);
    assert!(matches!(raw.answer(), Response::Epoch(_)));
    let old = raw.sealed(&Request::Epoch, 6);
    raw.send(&old);
    assert_eq!(raw.answer(), Response::Error(WireError::Replayed { request_id: 6 }));

    // The captured PUT on another connection of the same tenant and key: another session key.
    let (mut other, _) = Raw::hello(f.addr(), &Claim::rw());
    other.send(&put);
    assert_eq!(other.answer(), Response::Error(WireError::SealMismatch));
    assert!(other.closed());
}

#[test]
fn rotation_through_the_key_file_needs_no_restart() {
    let f = Fixture::start();
    let who = everything(SEALED_RW);
    let old = f.client(SEALED_RW, &[(SEALED_RW, creds("k1", 0x11))]);
    let new = || f.client(SEALED_RW, &[(SEALED_RW, creds("k2", 0x22))]);
    let k = key_of(SEALED_RW, "rot");
    assert!(old.put(&who, &k, b"1", None).is_ok());
    let e = new().lookup(&who, &k).expect_err("k2 is not known yet");
    assert!(e.to_string().contains("key id is not one of"), "{e}");

    // Step 1: add k2; both work.
    let overlap = NOW_S + 3600;
    write_keys(&f.rw_keys, &(key_line("k1", 0x11, Some(overlap)) + &key_line("k2", 0x22, None)));
    assert!(new().lookup(&who, &k).is_ok());
    assert!(f.client(SEALED_RW, &[(SEALED_RW, creds("k1", 0x11))]).lookup(&who, &k).is_ok());

    // Step 2: the overlap ends; k1 is refused as expired, k2 goes on.
    f.clock.advance_ms((overlap - NOW_S) * 1000 + 1);
    let (_, answer) = Raw::hello(f.addr(), &Claim { timestamp_ms: f.clock_now(), ..Claim::rw() });
    assert_eq!(refused(&answer), Some(AuthFailure::KeyExpired), "{answer:?}");
    assert!(new().lookup(&who, &k).is_ok());

    // Step 3: k1's line is removed; it is unknown now.
    write_keys(&f.rw_keys, &key_line("k2", 0x22, None));
    let (_, answer) = Raw::hello(f.addr(), &Claim { timestamp_ms: f.clock_now(), ..Claim::rw() });
    assert_eq!(refused(&answer), Some(AuthFailure::UnknownKey), "{answer:?}");
}

impl Fixture {
    fn clock_now(&self) -> u64 {
        use gpucache_dataplane::clock::Clock;
        self.clock.now_ms()
    }
}

#[test]
fn a_reload_that_fails_validation_keeps_the_keys_in_force() {
    let f = Fixture::start();
    let who = everything(SEALED_RW);
    let k = key_of(SEALED_RW, "keep");
    let k1 = || f.client(SEALED_RW, &[(SEALED_RW, creds("k1", 0x11))]);
    assert!(k1().lookup(&who, &k).is_ok());
    // A malformed line (k2's secret is too short): the whole file is refused.
    write_keys(&f.rw_keys, &format!("{}k2 abcd\n", key_line("k1", 0x11, Some(NOW_S - 1))));
    assert!(k1().lookup(&who, &k).is_ok(), "the previous keys stay, k1 without an expiry");
    let e = f.client(SEALED_RW, &[(SEALED_RW, creds("k2", 0x22))]).lookup(&who, &k);
    assert!(e.is_err());
    // A file others may read is refused the same way.
    write_keys(&f.rw_keys, &key_line("k2", 0x22, None));
    std::fs::set_permissions(&f.rw_keys, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    // chmod changes no content; make the change visible as a new version of the file.
    let text = std::fs::read_to_string(&f.rw_keys).expect("read");
    std::fs::write(&f.rw_keys, text + "# touched\n").expect("append");
    assert!(k1().lookup(&who, &k).is_ok(), "a world-readable file is not loaded");
    // Fixed: loaded at the next HELLO.
    write_keys(&f.rw_keys, &key_line("k2", 0x22, None));
    assert!(f.client(SEALED_RW, &[(SEALED_RW, creds("k2", 0x22))]).lookup(&who, &k).is_ok());
    assert!(k1().lookup(&who, &k).is_err());
}

#[test]
fn rights_are_enforced_per_op_on_the_server() {
    let f = Fixture::start();
    let all = [
        (SEALED_RW, creds("k1", 0x11)),
        (SEALED_RO, creds("ro1", 0x33)),
        (SEALED_ADMIN, Credentials { seal: SealAlgorithm::HmacSha256, ..creds("adm", 0x44) }),
    ];
    // The callers ask for every right, so the client's own checks pass; the server grants
    // only what the tenant's configuration allows.
    let ro = f.client(SEALED_RO, &all);
    let k = key_of(SEALED_RO, "ro");
    let e = ro.put(&everything(SEALED_RO), &k, b"v", None).expect_err("read-only");
    assert!(matches!(e, StoreError::Forbidden { right: Right::Write, .. }), "{e}");
    assert!(ro.lookup(&everything(SEALED_RO), &k).is_ok());

    let rw = f.client(SEALED_RW, &all);
    for (what, result) in [
        ("bump_epoch", rw.bump_epoch().map(|_| ())),
        ("reclaim_fenced", rw.reclaim_fenced(gpucache_dataplane::registry::Epoch(1)).map(|_| ())),
        ("expire_leases", rw.expire_leases().map(|_| ())),
    ] {
        let e = result.expect_err(what);
        assert!(matches!(e, StoreError::Forbidden { right: Right::Admin, .. }), "{what}: {e}");
    }
    let before = rw.epoch();
    let admin = f.client(SEALED_ADMIN, &all);
    let bumped = admin.bump_epoch().expect("admin may bump");
    assert!(bumped.0 > before.0);
}

#[test]
fn keys_of_another_tenant_are_refused() {
    let f = Fixture::start();
    let client = f.client(SEALED_RW, &[(SEALED_RW, creds("k1", 0x11))]);
    let open = f.client(OPEN_RW, &[]);
    let theirs = key_of(OPEN_RW, "theirs");
    assert!(matches!(open.put(&everything(OPEN_RW), &theirs, b"x", None), Ok(Put::Committed(_))));
    let me = everything(SEALED_RW);
    let mut buf = [0u8; 8];
    for e in [
        client.get_into(&me, &theirs, &mut buf).map(|_| ()).expect_err("cross-tenant get"),
        client.put(&me, &theirs, b"y", None).map(|_| ()).expect_err("cross-tenant put"),
        client.invalidate(&me, &theirs).map(|_| ()).expect_err("cross-tenant invalidate"),
    ] {
        assert!(
            matches!(&e, StoreError::WrongTenant { caller, owner }
                if caller.as_str() == SEALED_RW && owner.as_str() == OPEN_RW),
            "{e}"
        );
    }
    assert_eq!(buf, [0u8; 8]);
}

/// Reads the next whole frame from `stream`.
fn read_frame(stream: &mut TcpStream, decoder: &mut FrameDecoder) -> Option<Frame> {
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).ok().filter(|n| *n > 0)?;
        let mut input = &buf[..n];
        if let Ok(Some(frame)) = decoder.feed(&mut input) {
            return Some(frame);
        }
    }
}

/// A server that answers HELLO correctly and then a GET with a frame sealed under the wrong
/// key: the client must not hand out what that frame holds.
#[test]
fn the_client_never_returns_data_from_an_answer_whose_seal_fails() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let fake = std::thread::spawn(move || {
        let s = secret(0x11);
        let (mut stream, _) = listener.accept().expect("accept");
        let mut decoder = FrameDecoder::new();
        let hello = read_frame(&mut stream, &mut decoder).expect("hello");
        let Ok(Request::Hello { auth: Some(auth), .. }) = Request::from_frame(&hello) else {
            panic!("expected a keyed HELLO")
        };
        let server_nonce = [3u8; NONCE_BYTES];
        let key = seal::session_key(s.bytes(), &auth.client_nonce, &server_nonce, SEALED_RW);
        let key = SealKey::new(auth.seal, &key);
        let answer = Response::Hello {
            version: VERSION,
            server: "fake".into(),
            session: Some(HelloSession { server_nonce, seal: auth.seal }),
            local: None,
        };
        let mut out = Vec::new();
        answer.encode_sealed_frame(hello.request_id, Some(&key), &mut out).expect("encodes");
        stream.write_all(&out).expect("hello answer");
        let get = read_frame(&mut stream, &mut decoder).expect("get");
        assert_eq!(get.verify_seal(&key), Ok(()), "the client seals its requests");
        let data = b"forged!!".to_vec();
        let forged = Response::Get(vec![Ok(gpucache_wire::Fetched::Hit {
            checksum: Checksum::of(&data),
            data,
        })]);
        let wrong = SealKey::new(auth.seal, &[0u8; 32]);
        let mut reply = Vec::new();
        forged.encode_sealed_frame(get.request_id, Some(&wrong), &mut reply).expect("encodes");
        stream.write_all(&reply).expect("forged answer");
    });
    let mut config = ClientConfig::new(addr, everything(SEALED_RW));
    config.deadline = Duration::from_secs(10);
    let client = TcpStore::new(config.with_credentials(tenant(SEALED_RW), creds("k1", 0x11)));
    let mut buf = [0u8; 16];
    let got = client.get_into(&everything(SEALED_RW), &key_of(SEALED_RW, "g"), &mut buf);
    let e = got.expect_err("a forged answer is a transport failure");
    assert!(e.to_string().contains("seal does not verify"), "{e}");
    assert_eq!(buf, [0u8; 16], "nothing of the forged answer reached the caller");
    fake.join().expect("fake server");
}
