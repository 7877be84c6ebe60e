//! NIXL through nixl-sys: unavailable path, two agents in one process, two processes over
//! loopback TCP, a peer that stops and dies mid-transfer, and the POSIX file backend.
//!
//! These need `libnixl_capi.so` (see docs/HARDWARE.md): without it they skip with a message,
//! or fail when `GPUCACHE_REQUIRE_NIXL=1` (CI). The test binary re-executes itself for the
//! second process: `GPUCACHE_NIXL_ROLE` selects the role and `role_entry` runs it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpucache_dataplane::registry::{QuarantineCause, RegionState, RegisteredPool, SlotLease};
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::testing::fixture::tenant;
use gpucache_dataplane::testing::process::{kill_process, output_within, stop_process};
use gpucache_nic::nixl::xfer::UnknownCause;
use gpucache_nic::nixl::{
    BlockMem, NixlAgent, NixlBackend, NixlFile, NixlLimits, NixlOutcome, NixlSlots, NixlTransfers,
    RemoteBlock,
};
use gpucache_nic::{NicError, NixlUnavailable};
use gpucache_storage::host::pool::{HugePagePolicy, HugePagePool, Lock};

const ROLE_ENV: &str = "GPUCACHE_NIXL_ROLE";
const PORT_ENV: &str = "GPUCACHE_NIXL_PORT";
const SLOT_BYTES: usize = 4 << 20;
const SIZES: [usize; 4] = [64 << 10, 256 << 10, 1 << 20, 4 << 20];
const PEER_SEED: u64 = 0x5eed_0001;
const PARENT_SEED: u64 = 0x5eed_0002;
/// How long the parent waits for the child's connection and each control frame.
const CONTROL_DEADLINE: Duration = Duration::from_secs(60);
/// Largest control frame (metadata is a few KiB).
const FRAME_BYTES_MAX: usize = 1 << 20;

/// Whether NIXL can run here; skips (or fails in CI) with the typed reason when not.
fn nixl_here() -> bool {
    match gpucache_nic::nixl::probe_or_skip() {
        Ok(p) => {
            assert!(p.plugins.iter().any(|n| n == "UCX"), "plugins: {:?}", p.plugins);
            true
        }
        Err(reason) => {
            eprintln!("skipping: NIXL unavailable: {reason}");
            false
        }
    }
}

/// Bytes that depend on seed and position only, so any prefix of a pattern is the pattern of
/// that length.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    SplitMix64::bytes(seed, len)
}

fn checksum(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

fn pool_for(agent: &NixlAgent, slots: usize) -> RegisteredPool<NixlSlots> {
    let policy = HugePagePolicy::default().lock(Lock::Off);
    NixlSlots::pool(agent, slots, SLOT_BYTES, policy).expect("registered pool")
}

fn fill(pool: &mut RegisteredPool<NixlSlots>, lease: &SlotLease, bytes: &[u8]) {
    pool.slot_bytes_mut(lease).expect("lent")[..bytes.len()].copy_from_slice(bytes);
}

fn front(pool: &mut RegisteredPool<NixlSlots>, lease: &SlotLease, len: usize) -> Vec<u8> {
    pool.slot_bytes_mut(lease).expect("lent")[..len].to_vec()
}

fn block_of(block: &RemoteBlock, len: usize) -> RemoteBlock {
    RemoteBlock { len_bytes: len as u64, ..block.clone() }
}

fn assert_done(outcome: NixlOutcome, len: usize) -> Duration {
    match outcome {
        NixlOutcome::Done { len_bytes, elapsed } => {
            assert_eq!(len_bytes, len as u64);
            elapsed
        }
        other => panic!("expected Done, got {other:?}"),
    }
}

fn rate(len: usize, elapsed: Duration) -> f64 {
    len as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

// ------------------------------------------------------------------------------------------
// Unavailable

#[test]
fn without_the_library_probe_and_agent_report_library_missing() {
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "role_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "absent")
        .env_remove("LD_LIBRARY_PATH")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = output_within(child, CONTROL_DEADLINE);
    let out = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "child failed: {out}");
    assert!(out.contains("role absent: LibraryMissing seen"), "role did not run: {out}");
}

fn role_absent() {
    assert_eq!(gpucache_nic::nixl::probe(), Err(NixlUnavailable::LibraryMissing));
    let err = NixlAgent::new("absent").unwrap_err();
    assert_eq!(err, NicError::NixlUnavailable { reason: NixlUnavailable::LibraryMissing });
    eprintln!("role absent: LibraryMissing seen");
}

// ------------------------------------------------------------------------------------------
// One process, two agents

#[test]
fn two_agents_in_one_process_read_and_write_blocks() {
    if !nixl_here() {
        return;
    }
    let mut a = NixlAgent::new(&format!("inproc-a-{}", std::process::id())).unwrap();
    let mut b = NixlAgent::new(&format!("inproc-b-{}", std::process::id())).unwrap();
    a.enable(NixlBackend::Ucx).unwrap();
    b.enable(NixlBackend::Ucx).unwrap();
    let mut pa = pool_for(&a, 2);
    let mut pb = pool_for(&b, 1);
    let la = pa.checkout(&tenant(0), 2, None).unwrap();
    let lb = pb.checkout(&tenant(0), 1, None).unwrap()[0];
    fill(&mut pb, &lb, &pattern(PEER_SEED, SLOT_BYTES));
    let remote = NixlSlots::block(&pb, &lb, SLOT_BYTES as u64).unwrap();
    // The descriptor survives its encoding, as it would over the control channel.
    let remote = RemoteBlock::decode(&remote.encode().unwrap()).unwrap();
    assert_eq!(a.load_peer(&b.local_metadata().unwrap()).unwrap(), b.name());

    let mut xfers = NixlTransfers::new(NixlLimits::default());
    for (i, len) in SIZES.into_iter().enumerate() {
        fill(&mut pa, &la[0], &vec![0; len]);
        let took =
            assert_done(xfers.read(&a, &mut pa, &la[0], &block_of(&remote, len)).unwrap(), len);
        let got = front(&mut pa, &la[0], len);
        assert_eq!(checksum(&got), checksum(&pattern(PEER_SEED, len)), "read {len}");
        assert!(got == pattern(PEER_SEED, len));
        eprintln!("in-process READ {len} bytes: {:.2} GB/s", rate(len, took));

        let data = pattern(100 + i as u64, len);
        fill(&mut pa, &la[1], &data);
        let took =
            assert_done(xfers.write(&a, &mut pa, &la[1], &block_of(&remote, len)).unwrap(), len);
        assert!(front(&mut pb, &lb, len) == data, "write {len}");
        fill(&mut pb, &lb, &pattern(PEER_SEED, len)); // what the next read expects
        eprintln!("in-process WRITE {len} bytes: {:.2} GB/s", rate(len, took));
    }
    let c = xfers.counters();
    assert_eq!((c.posted, c.done, c.unknown_deadline + c.unknown_error), (8, 8, 0));
    assert_eq!(xfers.abandoned(), 0);
    // Done slots stay lent and reusable; release returns them.
    xfers.release(&mut pa, &la[0]).unwrap();
    assert_eq!(pa.free_slots(), 1);

    // A peer whose metadata was dropped is refused before anything is posted.
    assert!(a.forget_peer(b.name()).unwrap());
    let err = xfers.read(&a, &mut pa, &la[1], &remote).unwrap_err();
    assert_eq!(err, NicError::NixlPeerUnknown { agent: b.name().to_owned() });
    assert_eq!(xfers.counters().posted, 8);
}

#[test]
fn a_reregistered_pool_serves_a_peer_that_reloads_its_metadata() {
    if !nixl_here() {
        return;
    }
    let mut a = NixlAgent::new(&format!("rereg-a-{}", std::process::id())).unwrap();
    let mut b = NixlAgent::new(&format!("rereg-b-{}", std::process::id())).unwrap();
    a.enable(NixlBackend::Ucx).unwrap();
    b.enable(NixlBackend::Ucx).unwrap();
    let mut pa = pool_for(&a, 1);
    let mut pb = pool_for(&b, 1);
    let la = pa.checkout(&tenant(0), 1, None).unwrap()[0];
    let lb = pb.checkout(&tenant(0), 1, None).unwrap()[0];
    let len = 64 << 10;
    fill(&mut pb, &lb, &pattern(PEER_SEED, len));
    let remote = NixlSlots::block(&pb, &lb, len as u64).unwrap();
    let before = b.local_metadata().unwrap();
    a.load_peer(&before).unwrap();
    let mut xfers = NixlTransfers::new(NixlLimits::default());
    assert_done(xfers.read(&a, &mut pa, &la, &remote).unwrap(), len);

    assert_eq!(pb.memory().generation(), 1);
    pb.memory_mut().reregister(&b).unwrap();
    assert_eq!(pb.memory().generation(), 2);
    assert!(pb.memory().registered());
    // With the wheel's UCX on one host (TCP, CMA) the new registration's remote key packs to
    // the same bytes, so the metadata may not change; with key-checking transports it does.
    let after = b.local_metadata().unwrap();
    eprintln!("metadata changed by re-registration: {}", before != after);
    // Another agent's pool is refused.
    assert!(pb.memory_mut().reregister(&a).is_err());
    assert_eq!(pb.memory().generation(), 2);

    // A peer that loads the new metadata reads what the slot holds now.
    let now = pattern(PEER_SEED + 1, len);
    fill(&mut pb, &lb, &now);
    a.load_peer(&after).unwrap();
    fill(&mut pa, &la, &vec![0; len]);
    assert_done(xfers.read(&a, &mut pa, &la, &remote).unwrap(), len);
    assert!(front(&mut pa, &la, len) == now);
}

#[test]
fn vram_registration_of_host_memory_is_refused() {
    if !nixl_here() {
        return;
    }
    let mut a = NixlAgent::new(&format!("vram-{}", std::process::id())).unwrap();
    a.enable(NixlBackend::Ucx).unwrap();
    let memory = HugePagePool::new(1, 1 << 20, HugePagePolicy::default().lock(Lock::Off)).unwrap();
    let err = NixlSlots::register(&a, memory, BlockMem::Vram).unwrap_err();
    assert!(matches!(err, NicError::NixlMemUnsupported { mem: "VRAM", .. }), "{err}");
}

// ------------------------------------------------------------------------------------------
// Two processes over loopback TCP

fn send(stream: &mut TcpStream, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).unwrap();
    stream.write_all(&len.to_le_bytes()).unwrap();
    stream.write_all(bytes).unwrap();
}

fn recv(stream: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).unwrap();
    let len = u32::from_le_bytes(len) as usize;
    assert!(len <= FRAME_BYTES_MAX, "frame of {len} bytes");
    let mut bytes = vec![0; len];
    stream.read_exact(&mut bytes).unwrap();
    bytes
}

/// A child peer process, connected, with metadata exchanged both ways.
struct Peer {
    child: Child,
    stream: TcpStream,
    block: RemoteBlock,
}

impl Peer {
    /// Starts the peer role; `tcp_only` confines its UCX to TCP (see the fault test).
    fn start(agent: &mut NixlAgent, own: &RemoteBlock, tcp_only: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "role_entry", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, "peer")
            .env(PORT_ENV, port.to_string())
            .stdout(Stdio::null());
        if tcp_only {
            cmd.env("UCX_TLS", "tcp");
        }
        let mut child = cmd.spawn().unwrap();
        let deadline = Instant::now() + CONTROL_DEADLINE;
        let mut stream = gpucache_nic::nixl::accept_before(&listener, deadline, || {
            child.try_wait().unwrap().map(|status| status.to_string())
        })
        .unwrap();
        stream.set_read_timeout(Some(CONTROL_DEADLINE)).unwrap();
        let md = recv(&mut stream);
        let block = RemoteBlock::decode(&recv(&mut stream)).unwrap();
        assert_eq!(agent.load_peer(&md).unwrap(), block.agent);
        send(&mut stream, &agent.local_metadata().unwrap());
        send(&mut stream, &own.encode().unwrap());
        Self { child, stream, block }
    }

    fn ask(&mut self, command: &str) -> String {
        send(&mut self.stream, command.as_bytes());
        String::from_utf8(recv(&mut self.stream)).unwrap()
    }

    fn finish(self) {
        let Self { child, mut stream, .. } = self;
        send(&mut stream, b"bye");
        let out = output_within(child, CONTROL_DEADLINE);
        assert!(out.status.success(), "peer failed: {}", out.status);
    }
}

fn role_peer() {
    let port: u16 = std::env::var(PORT_ENV).unwrap().parse().unwrap();
    let mut agent = NixlAgent::new(&format!("peer-{}", std::process::id())).unwrap();
    agent.enable(NixlBackend::Ucx).unwrap();
    let mut pool = pool_for(&agent, 2);
    let leases = pool.checkout(&tenant(0), 2, None).unwrap();
    fill(&mut pool, &leases[0], &pattern(PEER_SEED, SLOT_BYTES));
    let mine = NixlSlots::block(&pool, &leases[0], SLOT_BYTES as u64).unwrap();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    send(&mut stream, &agent.local_metadata().unwrap());
    send(&mut stream, &mine.encode().unwrap());
    let parent_md = recv(&mut stream);
    let parent = RemoteBlock::decode(&recv(&mut stream)).unwrap();
    assert_eq!(agent.load_peer(&parent_md).unwrap(), parent.agent);
    let mut xfers = NixlTransfers::new(NixlLimits::default());
    loop {
        let command = String::from_utf8(recv(&mut stream)).unwrap();
        let words: Vec<&str> = command.split(' ').collect();
        let reply = match words.as_slice() {
            ["bye"] => break,
            ["check", seed, len] => {
                let (seed, len): (u64, usize) = (seed.parse().unwrap(), len.parse().unwrap());
                let ok = front(&mut pool, &leases[0], len) == pattern(seed, len);
                fill(&mut pool, &leases[0], &pattern(PEER_SEED, len)); // for the next read
                if ok { "ok".to_owned() } else { format!("bad bytes after a write of {len}") }
            }
            ["read", len] => {
                let len: usize = len.parse().unwrap();
                let outcome = xfers.read(&agent, &mut pool, &leases[1], &block_of(&parent, len));
                match outcome {
                    Ok(NixlOutcome::Done { .. })
                        if front(&mut pool, &leases[1], len) == pattern(PARENT_SEED, len) =>
                    {
                        "ok".to_owned()
                    }
                    other => format!("read of {len}: {other:?}"),
                }
            }
            _ => format!("unknown command {command:?}"),
        };
        send(&mut stream, reply.as_bytes());
    }
}

#[test]
fn two_processes_move_blocks_both_ways() {
    if !nixl_here() {
        return;
    }
    let mut agent = NixlAgent::new(&format!("parent-{}", std::process::id())).unwrap();
    agent.enable(NixlBackend::Ucx).unwrap();
    let mut pool = pool_for(&agent, 3);
    let l = pool.checkout(&tenant(0), 3, None).unwrap();
    fill(&mut pool, &l[2], &pattern(PARENT_SEED, SLOT_BYTES));
    let own = NixlSlots::block(&pool, &l[2], SLOT_BYTES as u64).unwrap();
    let mut peer = Peer::start(&mut agent, &own, false);
    let mut xfers = NixlTransfers::new(NixlLimits::default());
    for (i, len) in SIZES.into_iter().enumerate() {
        // Peer to parent, pulled by the parent.
        fill(&mut pool, &l[0], &vec![0; len]);
        let took = assert_done(
            xfers.read(&agent, &mut pool, &l[0], &block_of(&peer.block, len)).unwrap(),
            len,
        );
        assert!(front(&mut pool, &l[0], len) == pattern(PEER_SEED, len), "read {len}");
        eprintln!("two-process READ {len} bytes: {:.2} GB/s", rate(len, took));
        // Parent to peer, pushed by the parent; the peer checks its bytes.
        let seed = 200 + i as u64;
        fill(&mut pool, &l[1], &pattern(seed, len));
        let took = assert_done(
            xfers.write(&agent, &mut pool, &l[1], &block_of(&peer.block, len)).unwrap(),
            len,
        );
        assert_eq!(peer.ask(&format!("check {seed} {len}")), "ok");
        eprintln!("two-process WRITE {len} bytes: {:.2} GB/s", rate(len, took));
        // Parent to peer, pulled by the peer.
        assert_eq!(peer.ask(&format!("read {len}")), "ok");
    }
    peer.finish();
    assert_eq!(xfers.counters().done, 8);
}

// ------------------------------------------------------------------------------------------
// A peer that stops, then dies, mid-transfer

/// Deterministic "mid-transfer" without sleeps: the peer's UCX is confined to TCP, where a
/// READ (a get) is served by the peer's own progress engine, and the peer is stopped with
/// SIGSTOP (confirmed by waitpid) before the post. The request can then only stay in progress
/// until the deadline, whatever the timing; SIGKILL afterwards makes the peer vanish for good.
#[test]
fn a_stopped_then_killed_peer_leaves_the_slot_quarantined_until_a_fence() {
    if !nixl_here() {
        return;
    }
    let mut agent = NixlAgent::new(&format!("fault-{}", std::process::id())).unwrap();
    agent.enable(NixlBackend::Ucx).unwrap();
    let mut pool = pool_for(&agent, 2);
    let lease_deadline_ms = 1_000;
    let l = pool.checkout(&tenant(0), 2, Some(lease_deadline_ms)).unwrap();
    let own = NixlSlots::block(&pool, &l[1], SLOT_BYTES as u64).unwrap();
    let peer = Peer::start(&mut agent, &own, true);
    let limits = NixlLimits { deadline: Duration::from_millis(300), ..NixlLimits::default() };
    let mut xfers = NixlTransfers::new(limits);
    // One good read first (default deadline: TCP wire-up can be slow on a loaded host), so
    // the connection exists before the peer stops.
    let len = 64 << 10;
    let mut warm = NixlTransfers::new(NixlLimits::default());
    assert_done(warm.read(&agent, &mut pool, &l[0], &block_of(&peer.block, len)).unwrap(), len);
    assert!(front(&mut pool, &l[0], len) == pattern(PEER_SEED, len));

    let pid = i32::try_from(peer.child.id()).unwrap();
    stop_process(pid);
    let free_before = pool.free_slots();
    let outcome = xfers.read(&agent, &mut pool, &l[0], &block_of(&peer.block, SLOT_BYTES)).unwrap();
    assert_eq!(
        outcome,
        NixlOutcome::Unknown { region: l[0].region, cause: UnknownCause::DeadlinePassed }
    );
    let quarantined = |pool: &RegisteredPool<NixlSlots>| {
        matches!(
            pool.table().get(l[0].region).map(|r| r.state),
            Some(RegionState::Quarantined { cause: QuarantineCause::UnknownCompletion })
        )
    };
    assert!(quarantined(&pool));
    // A quarantined slot's bytes are out of reach, and it cannot be posted again.
    assert!(pool.slot_bytes_mut(&l[0]).is_none());
    assert_eq!(
        xfers.read(&agent, &mut pool, &l[0], &peer.block).unwrap_err(),
        NicError::LeaseNotUsable { region: l[0].region }
    );

    let mut peer = peer;
    kill_process(pid);
    let _ = peer.child.try_wait();

    // Whatever NIXL says now (still in progress, or an error for the dead peer), it frees
    // nothing; neither does the lease running out.
    xfers.poll_abandoned(&agent, &mut pool).unwrap();
    pool.expire_leases(lease_deadline_ms + 1);
    assert!(quarantined(&pool));
    assert_eq!(pool.free_slots(), free_before);
    assert_eq!(xfers.abandoned(), 1);

    let proofs = xfers.fence(&mut agent, &mut pool).unwrap();
    assert!(proofs.iter().any(|p| p.region() == l[0].region), "{proofs:?}");
    assert!(pool.table().get(l[0].region).is_none());
    assert_eq!(pool.free_slots(), 2, "the fence returns every slot lent before it");
    let c = xfers.counters();
    assert_eq!((c.unknown_deadline, c.released, c.peers_invalidated), (1, 1, 1));
    assert!(!agent.knows_peer(&peer.block.agent));
    eprintln!("fault counters: {c:?}");
}

// ------------------------------------------------------------------------------------------
// POSIX

#[test]
fn posix_moves_a_block_to_a_file_and_back() {
    if !nixl_here() {
        return;
    }
    let mut agent = NixlAgent::new(&format!("posix-{}", std::process::id())).unwrap();
    agent.enable(NixlBackend::Posix).unwrap();
    let mut pool = pool_for(&agent, 2);
    let l = pool.checkout(&tenant(0), 2, None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blocks");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let registered = 16u64 << 20;
    let file = NixlFile::register(&mut agent, file, registered).unwrap();
    let mut xfers = NixlTransfers::new(NixlLimits::default());
    let mut offset = 4096usize;
    for (i, len) in SIZES.into_iter().enumerate() {
        let data = pattern(300 + i as u64, len);
        fill(&mut pool, &l[0], &data);
        let took = assert_done(
            xfers.write_file(&agent, &mut pool, &l[0], &file, offset as u64, len as u64).unwrap(),
            len,
        );
        let on_disk = std::fs::read(&path).unwrap();
        assert!(on_disk[offset..offset + len] == data, "file bytes {len}");
        fill(&mut pool, &l[1], &vec![0; len]);
        assert_done(
            xfers.read_file(&agent, &mut pool, &l[1], &file, offset as u64, len as u64).unwrap(),
            len,
        );
        assert_eq!(checksum(&front(&mut pool, &l[1], len)), checksum(&data), "read back {len}");
        eprintln!("POSIX WRITE {len} bytes: {:.2} GB/s", rate(len, took));
        offset += len;
    }

    // A read past the end of the file is refused before posting; the slot stays usable.
    let file_bytes = std::fs::metadata(&path).unwrap().len();
    let err = xfers.read_file(&agent, &mut pool, &l[1], &file, file_bytes, 4096).unwrap_err();
    assert_eq!(
        err,
        NicError::NixlFileRange { offset: file_bytes, len_bytes: 4096, limit_bytes: file_bytes }
    );
    // Past the registration too.
    let err = xfers.write_file(&agent, &mut pool, &l[1], &file, registered, 1).unwrap_err();
    assert!(
        matches!(err, NicError::NixlFileRange { limit_bytes, .. } if limit_bytes == registered)
    );
    // A descriptor opened read-only cannot take a write.
    let ro =
        NixlFile::register(&mut agent, std::fs::File::open(&path).unwrap(), registered).unwrap();
    let err = xfers.write_file(&agent, &mut pool, &l[1], &ro, 0, 4096).unwrap_err();
    assert!(matches!(err, NicError::NixlFileAccess { op: "write", .. }), "{err}");
    assert!(pool.slot_bytes_mut(&l[1]).is_some(), "a refused transfer leaves the slot usable");
    let c = xfers.counters();
    assert_eq!((c.posted, c.done), (8, 8));
}

// ------------------------------------------------------------------------------------------
// Roles of the re-executed test binary

#[test]
fn role_entry() {
    match std::env::var(ROLE_ENV).as_deref() {
        Ok("absent") => role_absent(),
        Ok("peer") => role_peer(),
        Ok(other) => panic!("unknown role {other:?}"),
        Err(_) => {} // Not a child: nothing to do.
    }
}
