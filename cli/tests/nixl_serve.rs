//! `gpucache serve` with `[nixl] enabled` between two processes: blocks move over NIXL with
//! exact byte checks (and read back over plain TCP and by `gpucache get --nixl`), a server
//! stopped then killed mid-READ leaves the client's slot quarantined until the client's fence,
//! a client killed between RESERVE_PUT and COMMIT_PUT leaves the server's slot quarantined
//! (nothing stored) until BUMP_EPOCH + RECLAIM_FENCED, and NIXL that cannot run stops `serve`
//! with the reason.
//!
//! Needs `libnixl_capi.so` (docs/OPERATIONS.md, `[nixl]`): the tests that move bytes skip with a
//! message without it, or fail when `GPUCACHE_REQUIRE_NIXL=1`. The fault tests re-execute this
//! binary (`GPUCACHE_NIXL_SERVE_ROLE`) so that a process can run with `UCX_TLS=tcp` (a one-sided
//! READ then needs the target's progress, so a stopped target cannot finish it) and be the
//! parent that stops and kills.
#![cfg(feature = "nixl")]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::registry::{QuarantineCause, RegionState, RegisteredPool, SlotLease};
use gpucache_dataplane::store::{Get, MissReason, Put, Store};
use gpucache_dataplane::testing::fixture::payload;
use gpucache_nic::nixl::xfer::UnknownCause;
use gpucache_nic::nixl::{
    NixlAgent, NixlBackend, NixlClient, NixlClientConfig, NixlLimits, NixlOutcome, NixlSlots,
    NixlTransfers, RemoteBlock, unique_agent_name, usable_or_skip,
};
use gpucache_service::resp::IdentityTemplate;
use gpucache_storage::host::pool::{HugePagePolicy, Lock};
use gpucache_wire::staging::{StagedGet, StagingFailure};

mod common;

use common::{Serve, gpucache_with_input as gpucache, http_get};
use gpucache_dataplane::testing::process::{kill_process, output_within, stop_process};

const ROLE_ENV: &str = "GPUCACHE_NIXL_SERVE_ROLE";
const ADDR_ENV: &str = "GPUCACHE_NIXL_SERVE_ADDR";
const NAME_ENV: &str = "GPUCACHE_NIXL_SERVE_NAME";
const TENANT: &str = "default";
const SLOT_BYTES: usize = 4 << 20;
/// Slots of the server's staging pool in these tests.
const SERVER_SLOTS: u64 = 4;
const SIZES: [usize; 3] = [64 << 10, 1 << 20, 4 << 20];
/// How long a test waits for a process or a condition before it fails.
const PATIENCE: Duration = Duration::from_secs(60);

fn caller() -> Caller {
    Caller::new(TenantId::parse(TENANT).expect("tenant"), Rights::ALL)
}

/// The key `gpucache put/get NAME` uses for `name`.
fn key_of(name: &str) -> PhysicalKey {
    let tenant = TenantId::parse(TENANT).expect("tenant");
    IdentityTemplate::for_tenant(&tenant).expect("namespace").key_for(name.as_bytes()).expect("key")
}

fn tcp(addr: SocketAddr) -> TcpStore {
    let mut config = ClientConfig::new(addr, caller());
    config.deadline = Duration::from_secs(30);
    TcpStore::new(config)
}

/// A memory store on 127.0.0.1 ports the kernel picks, one tenant with every right, and
/// `[nixl]` staging of [`SERVER_SLOTS`] slots.
fn write_config(dir: &Path, stage_lease_ms: u64) -> std::path::PathBuf {
    let path = dir.join("gpucache.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nkind = \"memory\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
             [[tenants]]\nname = \"{TENANT}\"\nrights = [\"read\", \"write\", \"admin\"]\n\n\
             [nixl]\nenabled = true\nagent = \"{}\"\npool_bytes = {}\nslot_bytes = {SLOT_BYTES}\n\
             stage_lease_ms = {stage_lease_ms}\nper_connection_max = 4\nstaged_max = 4\n",
            unique_agent_name("serve"),
            SERVER_SLOTS * SLOT_BYTES as u64,
        ),
    )
    .expect("write config");
    path
}

/// Starts `gpucache serve` and checks that its start line names NIXL staging.
fn start(config: &Path) -> Serve {
    let serve = Serve::start(config);
    assert!(serve.field("staging=").starts_with("nixl:"), "staging not active: {}", serve.line);
    serve
}

fn client_pool(agent: &NixlAgent, slots: usize) -> RegisteredPool<NixlSlots> {
    let policy = HugePagePolicy::default().lock(Lock::Off);
    NixlSlots::pool(agent, slots, SLOT_BYTES, policy).expect("registered pool")
}

/// Re-executes this binary in `role` with `envs`; returns its stderr after checking that it
/// passed and printed `role <role>: passed`.
fn run_role(role: &str, envs: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args(["--exact", "role_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = output_within(cmd.spawn().expect("run role"), PATIENCE);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "role {role} failed: {err}");
    assert!(err.contains(&format!("role {role}: passed")), "role {role} did not run: {err}");
    err
}

// ------------------------------------------------------------------------------------------
// Blocks between two processes

#[test]
fn blocks_move_over_nixl_between_serve_and_clients_byte_for_byte() {
    if !usable_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let server = start(&write_config(dir.path(), 30_000));
    let who = caller();
    let config = NixlClientConfig {
        agent_name: unique_agent_name("client"),
        slot_bytes: SLOT_BYTES,
        slots: 2,
        deadline: Duration::from_secs(30),
        huge_pages: HugePagePolicy::default().lock(Lock::Off),
    };
    let nixl = NixlClient::new(tcp(server.native()), config).expect("NIXL client");
    nixl.attach(&who).expect("attach");
    let plain = tcp(server.native());
    let native = server.native().to_string();
    for (i, len) in (0u64..).zip(SIZES) {
        let name = format!("nixl-block-{len}");
        let k = key_of(&name);
        let data = payload(1000 + i, len);
        assert_eq!(
            nixl.put(&who, &k, &data, None).expect("NIXL put"),
            Put::Committed(Checksum::of(&data))
        );

        let mut back = vec![0u8; len];
        let got = nixl.get(&who, &k, &mut back).expect("NIXL get");
        assert_eq!(got, Get::Hit { len: len as u64, checksum: Checksum::of(&data) });
        assert!(back == data, "NIXL GET of {len} bytes differs");

        let mut over_tcp = vec![0u8; len];
        assert!(matches!(
            plain.get_into(&who, &k, &mut over_tcp).expect("tcp get"),
            Get::Hit { .. }
        ));
        assert!(over_tcp == data, "plain TCP GET of a NIXL PUT of {len} bytes differs");

        // A separate process: `gpucache get --nixl` with its own agent.
        let out = gpucache(&["get", &name, "--nixl", "--addr", &native, "--tenant", TENANT], None);
        assert!(out.status.success(), "get --nixl: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout.len(), len);
        assert!(out.stdout == data, "`gpucache get --nixl` of {len} bytes differs");

        // And the other way: `gpucache put --nixl` read back by the NIXL client.
        let name = format!("cli-block-{len}");
        let data = payload(2000 + i, len);
        let out =
            gpucache(&["put", &name, "--nixl", "--addr", &native, "--tenant", TENANT], Some(&data));
        assert!(out.status.success(), "put --nixl: {}", String::from_utf8_lossy(&out.stderr));
        back.fill(0);
        let got = nixl.get(&who, &key_of(&name), &mut back).expect("NIXL get");
        assert_eq!(got, Get::Hit { len: len as u64, checksum: Checksum::of(&data) });
        assert!(back == data, "NIXL GET of a `put --nixl` of {len} bytes differs");
    }
    // A miss over NIXL is a miss, and leaves nothing staged.
    let mut buf = vec![0u8; 4096];
    assert_eq!(
        nixl.get(&who, &key_of("never-stored"), &mut buf).expect("get"),
        Get::Miss(MissReason::Absent)
    );
    let stats = plain.stage_stats().expect("stage stats");
    assert_eq!((stats.open, stats.free_slots, stats.quarantined_slots), (0, SERVER_SLOTS, 0));
    assert_eq!(stats.committed, 6, "{stats:?}");
    let c = nixl.counters();
    assert_eq!((c.puts, c.hits, c.unknown, c.checksum_mismatches), (3, 6, 0, 0));
    server.stop();
}

// ------------------------------------------------------------------------------------------
// The server stops, then dies, mid-READ

#[test]
fn a_server_killed_mid_read_leaves_the_client_slot_quarantined_until_its_fence() {
    if !usable_or_skip() {
        return;
    }
    run_role("server-kill", &[("UCX_TLS", "tcp")]);
}

fn role_server_kill() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The server inherits UCX_TLS=tcp from this process.
    let server = start(&write_config(dir.path(), 60_000));
    let pid = server.pid();
    let who = caller();
    let control = tcp(server.native());
    let k = key_of("read-while-the-server-dies");
    let data = payload(77, 1 << 20);
    assert!(matches!(control.put(&who, &k, &data, None).expect("put"), Put::Committed(_)));

    let mut agent = NixlAgent::new(&unique_agent_name("kill-client")).expect("agent");
    agent.enable(NixlBackend::Ucx).expect("UCX");
    let mut pool = client_pool(&agent, 2);
    let theirs =
        control.nixl_attach(&who, &agent.local_metadata().expect("metadata")).expect("attach");
    agent.load_peer(&theirs).expect("server metadata");
    let lease_deadline_ms = 1_000;
    let l: Vec<SlotLease> = pool.checkout(&who.tenant, 2, Some(lease_deadline_ms)).expect("slots");
    let stage = |control: &TcpStore| {
        let item = gpucache_wire::GetItem { key: k.clone(), capacity: SLOT_BYTES as u64 };
        match control.stage_get(&who, &[item]).expect("stage_get").pop() {
            Some(Ok(StagedGet::Staged { slot, len, checksum })) => {
                assert_eq!((len, checksum), (data.len() as u64, Checksum::of(&data)));
                (slot.stage, RemoteBlock::decode(&slot.descriptor).expect("descriptor"))
            }
            other => panic!("not staged: {other:?}"),
        }
    };

    // One good READ first with a generous deadline, so the UCX connection exists before the
    // server stops.
    let (first, remote) = stage(&control);
    let mut warm = NixlTransfers::new(NixlLimits::default());
    match warm.read(&agent, &mut pool, &l[0], &remote).expect("warm read") {
        NixlOutcome::Done { len_bytes, .. } => assert_eq!(len_bytes, data.len() as u64),
        other => panic!("warm read: {other:?}"),
    }
    assert!(pool.slot_bytes_mut(&l[0]).expect("lent")[..data.len()] == data[..]);
    warm.release(&mut pool, &l[0]).expect("release");
    assert_eq!(control.release_stages(&who, &[first]).expect("release"), vec![true]);

    // STAGE_GET answered, then the server stops (confirmed) before the READ is posted.
    let (_second, remote) = stage(&control);
    stop_process(pid);
    let free_before = pool.free_slots();
    let limits = NixlLimits { deadline: Duration::from_millis(300), ..NixlLimits::default() };
    let mut xfers = NixlTransfers::new(limits);
    let outcome = xfers.read(&agent, &mut pool, &l[1], &remote).expect("posted");
    assert_eq!(
        outcome,
        NixlOutcome::Unknown { region: l[1].region, cause: UnknownCause::DeadlinePassed }
    );
    let quarantined = |pool: &RegisteredPool<NixlSlots>| {
        matches!(
            pool.table().get(l[1].region).map(|r| r.state),
            Some(RegionState::Quarantined { cause: QuarantineCause::UnknownCompletion })
        )
    };
    assert!(quarantined(&pool));
    assert!(pool.slot_bytes_mut(&l[1]).is_none(), "a quarantined slot's bytes are out of reach");

    kill_process(pid);
    server.forget();
    // Whatever NIXL reports for the dead peer, and the lease running out, free nothing.
    xfers.poll_abandoned(&agent, &mut pool).expect("poll");
    pool.expire_leases(lease_deadline_ms + 1);
    assert!(quarantined(&pool));
    assert_eq!(pool.free_slots(), free_before);
    assert_eq!(xfers.abandoned(), 1);

    // Only the client's fence (bump the epoch, reclaim what was lent before it) returns it.
    let proofs = xfers.fence(&mut agent, &mut pool).expect("fence");
    assert!(proofs.iter().any(|p| p.region() == l[1].region), "{proofs:?}");
    assert!(pool.table().get(l[1].region).is_none());
    assert_eq!(pool.free_slots(), 2);
    let c = xfers.counters();
    assert_eq!((c.unknown_deadline, c.peers_invalidated), (1, 1));
    eprintln!("role server-kill: passed");
}

// ------------------------------------------------------------------------------------------
// The client dies between RESERVE_PUT and COMMIT_PUT

#[test]
fn a_client_killed_before_commit_leaves_the_server_slot_quarantined_until_a_fence() {
    if !usable_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    // A 1 ms lease: expired by the time the test asks, so no waiting for it.
    let lease_ms = 1;
    let server = start(&write_config(dir.path(), lease_ms));
    let native = server.native().to_string();
    let name = "put-by-a-client-that-dies";
    let control = tcp(server.native());
    let who = caller();

    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "role_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "put-then-wait")
        .env(ADDR_ENV, &native)
        .env(NAME_ENV, name)
        .env("UCX_TLS", "tcp")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn client role");
    let pid = i32::try_from(child.id()).expect("pid");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let stage: u64 = loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("client role ended before reserving: {:?}", child.try_wait()))
            .expect("read");
        if let Some(rest) = line.strip_prefix("role put-then-wait: written stage ") {
            break rest.trim().parse().expect("stage id");
        }
    };
    std::thread::spawn(move || for _ in lines {});

    // The client wrote the slot and holds its connection open; stopped, it never commits.
    stop_process(pid);
    let stats = control.stage_stats().expect("stats");
    assert_eq!((stats.open, stats.free_slots, stats.quarantined_slots), (1, SERVER_SLOTS - 1, 0));

    // Lease expiry quarantines the slot: the 1 ms lease ran out on the server's clock while
    // the client wrote and was stopped (asked again, without pause, in the unlikely case the
    // server's clock has not moved a millisecond yet).
    let deadline = Instant::now() + PATIENCE;
    let stats = loop {
        control.expire_leases().expect("EXPIRE_LEASES");
        let stats = control.stage_stats().expect("stats");
        if stats.quarantined_slots > 0 {
            break stats;
        }
        assert!(Instant::now() < deadline, "the stage lease never expired: {stats:?}");
        std::thread::yield_now();
    };
    assert_eq!((stats.free_slots, stats.quarantined_slots), (SERVER_SLOTS - 1, 1), "{stats:?}");
    let k = key_of(name);
    let mut buf = vec![0u8; SLOT_BYTES];
    assert_eq!(control.get_into(&who, &k, &mut buf).expect("get"), Get::Miss(MissReason::Absent));
    // A commit of the expired stage (same tenant, another connection) stores nothing.
    let err = control.commit_put(&who, gpucache_wire::staging::StageId(stage)).unwrap_err();
    assert_eq!(err.refusal(), Some(StagingFailure::Memory), "{err}");

    kill_process(pid);
    let _ = child.try_wait();
    // The dead client's connection closes; the slot stays quarantined, nothing is stored.
    control.expire_leases().expect("EXPIRE_LEASES");
    let stats = control.stage_stats().expect("stats");
    assert_eq!((stats.free_slots, stats.quarantined_slots), (SERVER_SLOTS - 1, 1), "{stats:?}");
    assert_eq!(control.get_into(&who, &k, &mut buf).expect("get"), Get::Miss(MissReason::Absent));
    // The operator sees the same on /metrics.
    let scrape = http_get(server.metrics(), "/metrics");
    assert!(scrape.contains("gpucache_staging_quarantined_total 1\n"), "{scrape}");
    assert!(scrape.contains(&format!("gpucache_staging_free_slots {}\n", SERVER_SLOTS - 1)));

    // Only the fence returns it.
    let epoch = control.bump_epoch().expect("BUMP_EPOCH");
    control.reclaim_fenced(epoch).expect("RECLAIM_FENCED");
    let stats = control.stage_stats().expect("stats");
    assert_eq!(
        (stats.open, stats.free_slots, stats.quarantined_slots),
        (0, SERVER_SLOTS, 0),
        "{stats:?}"
    );
    assert!(stats.fenced >= 1, "{stats:?}");
    let scrape = http_get(server.metrics(), "/metrics");
    assert!(scrape.contains(&format!("gpucache_staging_free_slots {SERVER_SLOTS}\n")), "{scrape}");
    assert!(!scrape.contains("gpucache_staging_fenced_total 0\n"), "{scrape}");
    assert_eq!(control.get_into(&who, &k, &mut buf).expect("get"), Get::Miss(MissReason::Absent));
    // The server still serves NIXL after its fence.
    let data = payload(5, 64 << 10);
    let out =
        gpucache(&["put", name, "--nixl", "--addr", &native, "--tenant", TENANT], Some(&data));
    assert!(
        out.status.success(),
        "put --nixl after the fence: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        matches!(control.get_into(&who, &k, &mut buf).expect("get"), Get::Hit { len, .. } if len == data.len() as u64)
    );
    assert!(buf[..data.len()] == data[..]);
    server.stop();
}

/// RESERVE_PUT and a NIXL WRITE of the slot, then wait (never commit) until killed.
fn role_put_then_wait() {
    let addr: SocketAddr = std::env::var(ADDR_ENV).expect("addr").parse().expect("addr");
    let k = key_of(&std::env::var(NAME_ENV).expect("name"));
    let who = caller();
    let control = tcp(addr);
    let mut agent = NixlAgent::new(&unique_agent_name("dying-client")).expect("agent");
    agent.enable(NixlBackend::Ucx).expect("UCX");
    let mut pool = client_pool(&agent, 1);
    let theirs =
        control.nixl_attach(&who, &agent.local_metadata().expect("metadata")).expect("attach");
    agent.load_peer(&theirs).expect("server metadata");
    let data = payload(99, 1 << 20);
    let staged = control
        .reserve_put(&who, &k, data.len() as u64, Checksum::of(&data), None)
        .expect("RESERVE_PUT");
    let remote = RemoteBlock::decode(&staged.descriptor).expect("descriptor");
    let lease = pool.checkout(&who.tenant, 1, None).expect("slot")[0];
    pool.slot_bytes_mut(&lease).expect("lent")[..data.len()].copy_from_slice(&data);
    let mut xfers = NixlTransfers::new(NixlLimits::default());
    match xfers.write(&agent, &mut pool, &lease, &remote).expect("write") {
        NixlOutcome::Done { .. } => {}
        other => panic!("write: {other:?}"),
    }
    eprintln!("role put-then-wait: written stage {}", staged.stage.0);
    // Wait for the kill: standard input stays open until then.
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    panic!("role put-then-wait: still alive after its standard input closed");
}

// ------------------------------------------------------------------------------------------
// Fail closed

#[test]
fn serve_and_client_fail_closed_without_libnixl_and_on_a_bad_section() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_config(dir.path(), 30_000);
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["serve", "--config"])
        .arg(&config)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "serve started without libnixl_capi.so: {err}");
    assert!(
        err.contains("nixl.enabled: NIXL unavailable: libnixl_capi.so cannot be loaded"),
        "{err}"
    );
    assert!(!err.contains("listening"), "{err}");

    let value = dir.path().join("value");
    std::fs::write(&value, b"a value").expect("write value");
    let value = value.to_str().expect("utf-8 path");
    for args in [&["get", "x", "--nixl"][..], &["put", "x", value, "--nixl"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
            .args(args)
            .env_remove("LD_LIBRARY_PATH")
            .stdin(Stdio::null())
            .output()
            .expect("run client");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("--nixl: NIXL unavailable: libnixl_capi.so"), "{args:?}: {err}");
    }

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[nixl]\nenabled = true\nslot_bytes = \"1M\"\npool_bytes = \"1536K\"\n")
        .expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_gpucache"))
        .args(["serve", "--config"])
        .arg(&bad)
        .output()
        .expect("run serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("nixl.pool_bytes: 1572864 is not a multiple of nixl.slot_bytes"), "{err}");
}

// ------------------------------------------------------------------------------------------
// Roles of the re-executed test binary

#[test]
fn role_entry() {
    match std::env::var(ROLE_ENV).as_deref() {
        Ok("server-kill") => role_server_kill(),
        Ok("put-then-wait") => role_put_then_wait(),
        Ok(other) => panic!("unknown role {other:?}"),
        Err(_) => {} // Not a child: nothing to do.
    }
}
