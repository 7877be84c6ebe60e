//! Owner agreement across processes: four owner processes (this test binary re-run as children)
//! exchange their completion reports each round through an all-gather hub on loopback TCP, and
//! each merges what it receives with its own `Agreement`. The hub hands every owner the round's
//! reports in a different order. Every owner must reach the same outcome as the hub's reference
//! merge, round by round, and an invalid report must fail every owner with the same error.
//!
//! The wire format here is this test's own (the agreement types are plain data); the executor's
//! real transport is the engine's collective, which this stands in for.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::num::{NonZeroU16, NonZeroUsize};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpucache_dataplane::rng::SplitMix64;
use gpucache_executor::{
    Agreement, AgreementLimits, CompletionRecord, OperationId, OperationKind, OwnerIndex,
    OwnerReport, Pressure,
};

const OWNERS: u16 = 4;
const OPERATIONS: u64 = 12;
const ROUNDS: u64 = 6;
const ROUNDS_N: usize = 6;
const OPERATIONS_N: usize = 12;
const KEYS: usize = 5;
const IO_DEADLINE: Duration = Duration::from_secs(30);
/// Seeds the order in which every owner receives each round's reports.
const SHUFFLE_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// Which scenario the owners play.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Scenario {
    /// Every report valid; owners finish each operation in different rounds.
    Valid,
    /// Owner 2 reports one operation with the wrong number of keys in round 3.
    Invalid,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Self::Valid => "valid",
            Self::Invalid => "invalid",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "valid" => Some(Self::Valid),
            "invalid" => Some(Self::Invalid),
            _ => None,
        }
    }
}

fn kind_of(op: u64) -> OperationKind {
    match op % 3 {
        0 => OperationKind::Query,
        1 => OperationKind::Get,
        _ => OperationKind::Put,
    }
}

/// The round in which `owner` reports `op`: spread so that owners finish out of order.
fn round_of(owner: u16, op: u64) -> u64 {
    (op / 2 + u64::from(owner) * (op % 3)) % ROUNDS
}

/// Owner `owner`'s deterministic record of `op`.
fn record(owner: u16, op: u64) -> CompletionRecord {
    let kind = kind_of(op);
    let mut key_ok = Vec::with_capacity(KEYS);
    let mut object_failed = Vec::with_capacity(KEYS);
    for key in 0..KEYS as u64 {
        let h = (op * 31 + key * 7 + u64::from(owner) * 13) % 11;
        let ok = h != 0;
        key_ok.push(ok);
        // Only GETs carry object evidence, and never for a key that succeeded.
        object_failed.push(kind == OperationKind::Get && !ok && h.is_multiple_of(2));
    }
    CompletionRecord {
        operation: OperationId(op + 1),
        kind,
        key_ok,
        object_failed,
        retired: !(op + u64::from(owner)).is_multiple_of(7),
    }
}

fn report(owner: u16, round: u64, scenario: Scenario) -> OwnerReport {
    let mut completions: Vec<CompletionRecord> = (0..OPERATIONS)
        .filter(|op| round_of(owner, *op) == round)
        .map(|op| record(owner, op))
        .collect();
    if scenario == Scenario::Invalid
        && owner == 2
        && round == 3
        && let Some(first) = completions.first_mut()
    {
        first.key_ok.push(true);
    }
    OwnerReport {
        owner: OwnerIndex(owner),
        owners: OWNERS,
        clock_ms: 1_000 * round + u64::from(owner),
        pressure: Pressure {
            queued_jobs: (round * 3 + u64::from(owner)) % 5,
            queued_payload_bytes: (round + 1) * (u64::from(owner) + 1) * 4096,
            oldest_job_age_ms: (u64::from(owner) * 17 + round * 5) % 23,
        },
        completions,
        fault: None,
    }
}

fn agreement() -> Agreement {
    let limits = AgreementLimits {
        operations_inflight_max: NonZeroUsize::new(64).expect("nonzero"),
        keys_per_operation_max: NonZeroUsize::new(16).expect("nonzero"),
    };
    let mut a = Agreement::new(NonZeroU16::new(OWNERS).expect("nonzero"), limits);
    for op in 0..OPERATIONS {
        a.register(OperationId(op + 1), kind_of(op), KEYS).expect("registered");
    }
    a
}

/// One line per round: the outcome, or the error that failed the round.
fn merge_line(a: &mut Agreement, reports: &[OwnerReport]) -> String {
    match a.merge_round(reports) {
        Ok(outcome) => format!("ok {outcome:?}"),
        Err(e) => format!("error {e}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The test's wire format: length-prefixed reports.

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bits(out: &mut Vec<u8>, bits: &[bool]) {
    put_u64(out, bits.len() as u64);
    out.extend(bits.iter().map(|b| u8::from(*b)));
}

fn encode(r: &OwnerReport) -> Vec<u8> {
    let mut out = Vec::new();
    put_u64(&mut out, u64::from(r.owner.0));
    put_u64(&mut out, u64::from(r.owners));
    put_u64(&mut out, r.clock_ms);
    put_u64(&mut out, r.pressure.queued_jobs);
    put_u64(&mut out, r.pressure.queued_payload_bytes);
    put_u64(&mut out, r.pressure.oldest_job_age_ms);
    put_u64(&mut out, r.completions.len() as u64);
    for c in &r.completions {
        put_u64(&mut out, c.operation.0);
        let kind = match c.kind {
            OperationKind::Query => 0,
            OperationKind::Get => 1,
            OperationKind::Put => 2,
        };
        put_u64(&mut out, kind);
        put_bits(&mut out, &c.key_ok);
        put_bits(&mut out, &c.object_failed);
        put_u64(&mut out, u64::from(c.retired));
    }
    out
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn u64(&mut self) -> u64 {
        let (head, rest) = self.0.split_at(8);
        self.0 = rest;
        u64::from_le_bytes(head.try_into().expect("8 bytes"))
    }

    fn bits(&mut self) -> Vec<bool> {
        let n = usize::try_from(self.u64()).expect("length");
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head.iter().map(|b| *b != 0).collect()
    }
}

fn decode(bytes: &[u8]) -> OwnerReport {
    let mut c = Cursor(bytes);
    let owner = OwnerIndex(u16::try_from(c.u64()).expect("owner"));
    let owners = u16::try_from(c.u64()).expect("owners");
    let clock_ms = c.u64();
    let pressure = Pressure {
        queued_jobs: c.u64(),
        queued_payload_bytes: c.u64(),
        oldest_job_age_ms: c.u64(),
    };
    let n = c.u64();
    let completions = (0..n)
        .map(|_| CompletionRecord {
            operation: OperationId(c.u64()),
            kind: match c.u64() {
                0 => OperationKind::Query,
                1 => OperationKind::Get,
                _ => OperationKind::Put,
            },
            key_ok: c.bits(),
            object_failed: c.bits(),
            retired: c.u64() != 0,
        })
        .collect();
    assert!(c.0.is_empty(), "trailing bytes in a report");
    OwnerReport { owner, owners, clock_ms, pressure, completions, fault: None }
}

fn send_frame(stream: &mut TcpStream, bytes: &[u8]) {
    stream.write_all(&(bytes.len() as u64).to_le_bytes()).expect("send length");
    stream.write_all(bytes).expect("send frame");
}

fn recv_frame(stream: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len).expect("receive length");
    let mut bytes = vec![0u8; usize::try_from(u64::from_le_bytes(len)).expect("length")];
    stream.read_exact(&mut bytes).expect("receive frame");
    bytes
}

// ---------------------------------------------------------------------------------------------
// The owner process.

/// The entry point of the owner processes the mesh test starts; it does nothing unless run as
/// one of them (the hub's address and the owner's index are in its environment).
#[test]
#[ignore = "run by agreement_across_processes as a child process"]
fn owner_process() {
    let (Ok(addr), Ok(owner), Ok(scenario)) = (
        std::env::var("GPUCACHE_MESH_HUB"),
        std::env::var("GPUCACHE_MESH_OWNER"),
        std::env::var("GPUCACHE_MESH_SCENARIO"),
    ) else {
        return;
    };
    let owner: u16 = owner.parse().expect("owner index");
    let scenario = Scenario::parse(&scenario).expect("scenario");
    let mut hub = TcpStream::connect(addr.parse::<SocketAddr>().expect("hub address"))
        .expect("connect to the hub");
    hub.set_read_timeout(Some(IO_DEADLINE)).expect("timeout");
    hub.set_write_timeout(Some(IO_DEADLINE)).expect("timeout");
    let mut a = agreement();
    let mut lines = Vec::new();
    for round in 0..ROUNDS {
        let mine = report(owner, round, scenario);
        // An owner checks its own report first; once the agreement failed, it stays failed.
        if a.failure().is_none()
            && let Err(e) = a.check_local(&mine)
        {
            lines.push(format!("local {e}"));
        }
        send_frame(&mut hub, &encode(&mine));
        let gathered: Vec<OwnerReport> =
            (0..OWNERS).map(|_| decode(&recv_frame(&mut hub))).collect();
        lines.push(merge_line(&mut a, &gathered));
    }
    send_frame(&mut hub, lines.join("\n").as_bytes());
}

// ---------------------------------------------------------------------------------------------
// The hub (the test itself).

fn spawn_owner(addr: SocketAddr, owner: u16, scenario: Scenario) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "owner_process", "--ignored", "--test-threads", "1", "--quiet"])
        .env("GPUCACHE_MESH_HUB", addr.to_string())
        .env("GPUCACHE_MESH_OWNER", owner.to_string())
        .env("GPUCACHE_MESH_SCENARIO", scenario.name())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("owner process starts")
}

/// Kills the owner processes on every path out of the test.
struct Owners(Vec<Child>);

impl Drop for Owners {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs the four owners through every round; returns the hub's reference lines and each
/// owner's lines.
fn run_mesh(scenario: Scenario) -> (Vec<String>, Vec<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("hub binds");
    let addr = listener.local_addr().expect("hub address");
    let mut owners = Owners((0..OWNERS).map(|i| spawn_owner(addr, i, scenario)).collect());
    // Each owner says who it is with its first report.
    let mut conns: Vec<Option<TcpStream>> = (0..OWNERS).map(|_| None).collect();
    let mut first: Vec<Option<OwnerReport>> = (0..OWNERS).map(|_| None).collect();
    for _ in 0..OWNERS {
        let (mut stream, _) = listener.accept().expect("an owner connects");
        stream.set_read_timeout(Some(IO_DEADLINE)).expect("timeout");
        stream.set_write_timeout(Some(IO_DEADLINE)).expect("timeout");
        let r = decode(&recv_frame(&mut stream));
        let i = usize::from(r.owner.0);
        first[i] = Some(r);
        conns[i] = Some(stream);
    }
    let mut conns: Vec<TcpStream> = conns.into_iter().map(|c| c.expect("every owner")).collect();
    let mut reference = agreement();
    let mut expected = Vec::new();
    let mut rng = SplitMix64::new(SHUFFLE_SEED);
    for round in 0..ROUNDS {
        let gathered: Vec<OwnerReport> = if round == 0 {
            first.iter_mut().map(|r| r.take().expect("first report")).collect()
        } else {
            conns.iter_mut().map(|c| decode(&recv_frame(c))).collect()
        };
        expected.push(merge_line(&mut reference, &gathered));
        // Every owner receives the round in its own order.
        for conn in &mut conns {
            let mut order: Vec<usize> = (0..gathered.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.index(i + 1));
            }
            for i in order {
                send_frame(conn, &encode(&gathered[i]));
            }
        }
    }
    let lines: Vec<Vec<String>> = conns
        .iter_mut()
        .map(|c| {
            String::from_utf8(recv_frame(c)).expect("utf-8").lines().map(String::from).collect()
        })
        .collect();
    for (i, child) in owners.0.iter_mut().enumerate() {
        let status = child.wait().expect("owner exits");
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = BufReader::new(&mut e).read_line(&mut err);
        }
        assert!(status.success(), "owner {i} failed: {status} {err}");
    }
    owners.0.clear();
    (expected, lines)
}

#[test]
fn agreement_across_processes() {
    let (expected, owners) = run_mesh(Scenario::Valid);
    assert_eq!(expected.len(), ROUNDS_N);
    assert!(expected.iter().all(|l| l.starts_with("ok ")), "{expected:#?}");
    // Every operation completed once, somewhere in the rounds.
    let completed: usize = expected.iter().map(|l| l.matches("AgreedCompletion").count()).sum();
    assert_eq!(completed, OPERATIONS_N, "{expected:#?}");
    // The leader's clock, the MAX of pressure: the reference shows owner 0's clock per round.
    assert!(expected[2].contains("clock_ms: 2000"), "{}", expected[2]);
    for (i, lines) in owners.iter().enumerate() {
        assert_eq!(lines, &expected, "owner {i} disagrees with the reference");
    }
}

#[test]
fn an_invalid_report_fails_every_owner_alike() {
    let (expected, owners) = run_mesh(Scenario::Invalid);
    assert!(expected[..3].iter().all(|l| l.starts_with("ok ")), "{expected:#?}");
    assert!(expected[3].starts_with("error "), "{}", expected[3]);
    // Once failed, every later round fails with the same error.
    assert!(expected[3..].iter().all(|l| *l == expected[3]), "{expected:#?}");
    for (i, lines) in owners.iter().enumerate() {
        // The owner that sent the bad report also caught it locally before sending it.
        let merged: Vec<&String> = lines.iter().filter(|l| !l.starts_with("local ")).collect();
        let want: Vec<&String> = expected.iter().collect();
        assert_eq!(merged, want, "owner {i} disagrees with the reference");
        assert_eq!(lines.iter().any(|l| l.starts_with("local ")), i == 2, "owner {i}: {lines:?}");
    }
}
