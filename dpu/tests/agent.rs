//! Agent behaviour: reactors and affinity, back-pressure, slab quarantine and fence, restart
//! fencing (graceful and kill -9), native backends failing closed, and accounting under faults.

// Test indices and byte patterns are small and truncation is what the patterns want.
#![allow(clippy::cast_possible_truncation)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Lookup, MissReason};
use gpucache_dataplane::testing::fixture;
use gpucache_dpu::sim::{Fault, FaultRates, SimConfig};
use gpucache_dpu::{
    AgentConfig, BlockId, DpuError, DpuStore, DpuStoreConfig, MissCause, Offload, Outcome,
    PinPolicy, Pinning, QueueId, QueueKind, QueueSpec, ReactorId, ReactorSpec, SlabConfig,
};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::host::pool::{HugePagePolicy, Tier};

const SLOT: usize = 4096;

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn config(dir: &Path, kinds: Vec<QueueKind>, depth_max: usize, slots: usize) -> AgentConfig {
    let reactors = vec![
        ReactorSpec { id: ReactorId(0), core: Some(0) },
        ReactorSpec { id: ReactorId(1), core: Some(1) },
    ];
    let queues = kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| QueueSpec {
            id: QueueId(i as u32),
            owner: ReactorId((i % 2) as u16),
            depth_max,
            kind,
        })
        .collect();
    AgentConfig {
        state_dir: dir.join("state"),
        reactors,
        queues,
        pin: PinPolicy::BestEffort,
        slab: SlabConfig {
            slots,
            slot_bytes: SLOT,
            lease_ms: 60_000,
            policy: HugePagePolicy::only(Tier::Plain),
        },
        idle_park: Duration::from_millis(1),
    }
}

fn host(dir: &Path, i: usize) -> QueueKind {
    QueueKind::Host { root: dir.join(format!("q{i}")), engine: EngineChoice::Auto, sync: false }
}

fn payload(q: u32, b: u64) -> Vec<u8> {
    (0..SLOT - 7).map(|i| (i as u64 ^ b.wrapping_mul(31) ^ (u64::from(q) * 7)) as u8).collect()
}

/// After a restart: block 1 (written and completed before) reads back as `kept`; block 2 (in
/// flight when the agent went) is a clean miss.
fn assert_only_the_committed_block(agent: &gpucache_dpu::Agent) {
    let mut buf = [0u8; 16];
    let t = agent.submit_read(ReactorId(0), QueueId(0), BlockId(2)).unwrap();
    assert_eq!(agent.wait(t, deadline(), &mut buf).unwrap(), Outcome::Miss(MissCause::Absent));
    let t = agent.submit_read(ReactorId(0), QueueId(0), BlockId(1)).unwrap();
    assert_eq!(agent.wait(t, deadline(), &mut buf).unwrap(), Outcome::Read { len: 4 });
    assert_eq!(&buf[..4], b"kept");
}

#[test]
fn two_reactors_carry_traffic_and_report_pinning_truthfully() {
    let dir = tempfile::tempdir().unwrap();
    let kinds = (0..4).map(|i| host(dir.path(), i)).collect();
    let agent = config(dir.path(), kinds, 16, 64).start().unwrap();
    let mut tickets = Vec::new();
    for q in 0..4u32 {
        let owner = ReactorId((q % 2) as u16);
        for b in 0..6u64 {
            tickets
                .push(agent.submit_write(owner, QueueId(q), BlockId(b), &payload(q, b)).unwrap());
        }
    }
    for t in tickets {
        assert_eq!(agent.wait(t, deadline(), &mut []).unwrap(), Outcome::Written);
    }
    let mut buf = vec![0u8; SLOT];
    for q in 0..4u32 {
        for b in 0..6u64 {
            let t = agent.submit_read(ReactorId((q % 2) as u16), QueueId(q), BlockId(b)).unwrap();
            let out = agent.wait(t, deadline(), &mut buf).unwrap();
            let want = payload(q, b);
            assert_eq!(out, Outcome::Read { len: want.len() });
            assert_eq!(&buf[..want.len()], &want[..]);
        }
    }
    let t = agent.submit_read(ReactorId(0), QueueId(0), BlockId(99)).unwrap();
    assert_eq!(agent.wait(t, deadline(), &mut buf).unwrap(), Outcome::Miss(MissCause::Absent));
    // Both reactors did work.
    let stats = agent.stats();
    for s in &stats.queues {
        let extra = u64::from(s.queue == Some(QueueId(0)));
        assert_eq!(s.reaped, 12 + extra, "{s:?}");
    }
    // Pinning is reported as it is: a reactor is Pinned only if its mask reads back as one core.
    let pinned = agent.reactors().iter().filter(|r| matches!(r.pinning, Pinning::Pinned { .. }));
    let pinned = pinned.count();
    assert_eq!(agent.offload(), Offload::HostThreads { reactors: 2, pinned });
    assert!(!agent.offload().active());
    assert_eq!(stats.slab.free, 64, "every slot came back");
}

#[test]
fn affinity_violation_is_typed_and_submits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let agent =
        config(dir.path(), vec![host(dir.path(), 0), host(dir.path(), 1)], 4, 8).start().unwrap();
    let err = agent.submit_write(ReactorId(1), QueueId(0), BlockId(1), b"x").unwrap_err();
    assert!(
        matches!(
            err,
            DpuError::AffinityViolation {
                queue: QueueId(0),
                owner: ReactorId(0),
                asked: ReactorId(1)
            }
        ),
        "{err}"
    );
    let s = agent.queue_stats(QueueId(0)).unwrap();
    assert_eq!((s.submitted, s.outstanding, s.affinity_violations), (0, 0, 1));
    assert_eq!(agent.slab().free, 8);
}

#[test]
fn full_queue_answers_queue_full_until_one_is_reaped() {
    let dir = tempfile::tempdir().unwrap();
    let agent = config(dir.path(), vec![host(dir.path(), 0)], 3, 8).start().unwrap();
    let r = ReactorId(0);
    let mut t: Vec<_> =
        (0..3).map(|b| agent.submit_write(r, QueueId(0), BlockId(b), b"abc").unwrap()).collect();
    let err = agent.submit_write(r, QueueId(0), BlockId(9), b"abc").unwrap_err();
    assert!(matches!(err, DpuError::QueueFull { queue: QueueId(0), depth_max: 3 }), "{err}");
    assert_eq!(agent.slab().free, 5, "the refused submission leased nothing");
    assert_eq!(agent.wait(t.remove(0), deadline(), &mut []).unwrap(), Outcome::Written);
    let next = agent.submit_write(r, QueueId(0), BlockId(9), b"abc").unwrap();
    for x in t.into_iter().chain([next]) {
        assert_eq!(agent.wait(x, deadline(), &mut []).unwrap(), Outcome::Written);
    }
}

#[test]
fn lost_completion_quarantines_until_the_fence() {
    let dir = tempfile::tempdir().unwrap();
    let mut sim = SimConfig::new(7);
    sim.script = vec![Fault::Lost];
    let agent = config(dir.path(), vec![QueueKind::Sim(sim)], 4, 4).start().unwrap();
    assert!(matches!(agent.offload(), Offload::Simulated { seed: 7, .. }));
    let t = agent.submit_write(ReactorId(0), QueueId(0), BlockId(1), b"lost").unwrap();
    let err = agent.wait(t, Instant::now() + Duration::from_millis(200), &mut []).unwrap_err();
    assert!(matches!(err, DpuError::Lost { .. }), "{err}");
    let s = agent.slab();
    assert_eq!((s.free, s.regions.quarantined), (3, 1));
    // Lease expiry never frees a quarantined slot.
    agent.expire_slab_leases(u64::MAX);
    let s = agent.slab();
    assert_eq!((s.free, s.regions.quarantined), (3, 1));
    let e = agent.bump_epoch().unwrap();
    assert_eq!(agent.reclaim_fenced(e, deadline()).unwrap(), 1);
    assert_eq!(agent.slab().free, 4);
    // The lost write never became readable.
    let t = agent.submit_read(ReactorId(0), QueueId(0), BlockId(1)).unwrap();
    assert_eq!(agent.wait(t, deadline(), &mut [0; 8]).unwrap(), Outcome::Miss(MissCause::Absent));
}

#[test]
fn error_completion_quarantines_and_late_one_stays_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    let mut sim = SimConfig::new(3);
    sim.script = vec![Fault::Error, Fault::Late { polls: 1_000_000 }];
    let agent = config(dir.path(), vec![QueueKind::Sim(sim)], 4, 4).start().unwrap();
    let t = agent.submit_write(ReactorId(0), QueueId(0), BlockId(1), b"e").unwrap();
    assert!(matches!(agent.wait(t, deadline(), &mut []), Err(DpuError::Completion { .. })));
    let t = agent.submit_write(ReactorId(0), QueueId(0), BlockId(2), b"l").unwrap();
    assert!(matches!(
        agent.wait(t, Instant::now() + Duration::from_millis(100), &mut []),
        Err(DpuError::Lost { .. })
    ));
    assert_eq!(agent.slab().regions.quarantined, 2);
}

#[test]
fn restart_bumps_epoch_and_in_flight_work_is_a_clean_miss() {
    let dir = tempfile::tempdir().unwrap();
    let make = || config(dir.path(), vec![host(dir.path(), 0)], 4, 4);
    let agent = make().start().unwrap();
    let first = agent.epoch();
    let t = agent.submit_write(ReactorId(0), QueueId(0), BlockId(1), b"kept").unwrap();
    assert_eq!(agent.wait(t, deadline(), &mut []).unwrap(), Outcome::Written);
    let in_flight = agent.submit_write(ReactorId(0), QueueId(0), BlockId(2), b"never").unwrap();
    drop(agent);
    let agent = make().start().unwrap();
    assert!(agent.epoch() > first);
    assert_eq!(
        agent.wait(in_flight, deadline(), &mut []).unwrap(),
        Outcome::Miss(MissCause::Fenced)
    );
    assert_only_the_committed_block(&agent);
}

const CHILD_ENV: &str = "GPUCACHE_DPU_TEST_CHILD_DIR";

/// Runs the agent in a child process (when the parent test asks for it), then waits on stdin
/// until it is killed.
#[test]
fn child_agent_process() {
    let Ok(dir) = std::env::var(CHILD_ENV) else { return };
    let dir = Path::new(&dir);
    let agent = config(dir, vec![host(dir, 0)], 4, 4).start().unwrap();
    let t = agent.submit_write(ReactorId(0), QueueId(0), BlockId(1), b"kept").unwrap();
    assert_eq!(agent.wait(t, deadline(), &mut []).unwrap(), Outcome::Written);
    let _in_flight = agent.submit_write(ReactorId(0), QueueId(0), BlockId(2), b"never").unwrap();
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY {}", agent.epoch().0).unwrap();
        out.flush().unwrap();
    }
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn kill_9_then_restart_fences_what_was_in_flight() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_agent_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let child_epoch = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child ended before READY");
        if let Some(at) = line.find("READY ") {
            let e = line[at + 6..].trim();
            break e.parse::<u64>().unwrap();
        }
    };
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let agent = config(dir.path(), vec![host(dir.path(), 0)], 4, 4).start().unwrap();
    assert_eq!(agent.epoch().0, child_epoch + 1);
    assert_only_the_committed_block(&agent);
}

/// A read whose completion is posted but not yet collected when a fence reclaims its slot, and
/// the slot is lent again and filled: the late waiter gets a clean fenced miss, never the next
/// owner's bytes.
#[test]
fn a_fence_between_completion_and_wait_is_a_miss_not_the_next_owners_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let agent = config(dir.path(), vec![host(dir.path(), 0)], 8, 2).start().unwrap();
    let (r, q) = (ReactorId(0), QueueId(0));
    let t = agent.submit_write(r, q, BlockId(1), b"mine").unwrap();
    assert_eq!(agent.wait(t, deadline(), &mut []).unwrap(), Outcome::Written);
    let early = agent.submit_read(r, q, BlockId(1)).unwrap();
    let later = agent.submit_read(r, q, BlockId(9)).unwrap();
    // One queue runs in order: once the later read is answered, the early one is posted too.
    let mut buf = [0u8; 16];
    assert_eq!(agent.wait(later, deadline(), &mut buf).unwrap(), Outcome::Miss(MissCause::Absent));
    let e = agent.bump_epoch().unwrap();
    assert_eq!(agent.reclaim_fenced(e, deadline()).unwrap(), 1, "the early read's slot");
    // Both slots lent again and filled with someone else's bytes.
    let theirs: Vec<_> =
        (0..2).map(|i| agent.submit_write(r, q, BlockId(10 + i), b"THEIRS").unwrap()).collect();
    assert_eq!(agent.wait(early, deadline(), &mut buf).unwrap(), Outcome::Miss(MissCause::Fenced));
    assert_eq!(buf, [0u8; 16], "nothing was copied out");
    for t in theirs {
        assert_eq!(agent.wait(t, deadline(), &mut []).unwrap(), Outcome::Written);
    }
    assert_eq!(agent.slab().free, 2);
}

/// A DpuStore call whose completion is lost quarantines its slab slot; the store's own fence
/// (BUMP_EPOCH then RECLAIM_FENCED, as the service's admin ops call it) returns the slot.
#[test]
fn the_store_fence_returns_the_slab_slots_of_lost_calls() {
    use gpucache_dataplane::store::Store;
    let dir = tempfile::tempdir().unwrap();
    let mut sim = SimConfig::new(7);
    sim.script = vec![Fault::Lost];
    let agent = Arc::new(config(dir.path(), vec![QueueKind::Sim(sim)], 4, 4).start().unwrap());
    let backing = Arc::new(
        MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default())).unwrap(),
    );
    let store = DpuStore::new(
        Arc::clone(&agent),
        backing,
        DpuStoreConfig { op_deadline: Duration::from_millis(200) },
    );
    let (caller, key) = (fixture::caller(0), fixture::key(0, &[1], KvDtype::Bf16, 16));
    assert!(store.lookup(&caller, &key).is_err(), "the lost call fails");
    assert_eq!((agent.slab().free, agent.slab().regions.quarantined), (3, 1));
    assert_eq!(store.expire_leases().unwrap(), 0, "lease expiry frees nothing");
    let e = store.bump_epoch().unwrap();
    assert_eq!(store.reclaim_fenced(e).unwrap(), 1);
    assert_eq!((agent.slab().free, agent.slab().regions.quarantined), (4, 0));
    assert_eq!(store.lookup(&caller, &key), Ok(Lookup::Miss(MissReason::Absent)));
}

/// With pinning required, a core this process may not use refuses the start with the reactor
/// and core named; the reactors already started are stopped and nothing is left running.
#[test]
fn required_pinning_to_a_core_not_allowed_refuses_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), vec![host(dir.path(), 0), host(dir.path(), 1)], 4, 4);
    c.pin = PinPolicy::Required;
    c.reactors[0].core = None;
    c.reactors[1].core = Some(1023);
    match c.start() {
        Err(DpuError::PinRefused { reactor, core, .. }) => {
            assert_eq!((reactor, core), (ReactorId(1), 1023));
        }
        other => panic!("expected PinRefused, got {other:?}"),
    }
}

/// One step of [`slab_accounting_and_bytes_follow_a_model_under_seeded_faults`].
#[derive(Debug, Clone)]
enum Step {
    Write { block: u64, fill: u8 },
    Read { block: u64 },
    Fence,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0..4u64, any::<u8>()).prop_map(|(block, fill)| Step::Write { block, fill }),
        4 => (0..4u64).prop_map(|block| Step::Read { block }),
        1 => Just(Step::Fence),
    ]
}

/// What a read of one block may answer, by the model.
#[derive(Debug, Clone, Default)]
struct Expect {
    /// The bytes of the last write that completed, if any.
    committed: Option<Vec<u8>>,
    /// Bytes of writes that failed since: each may or may not have landed, but nothing else may.
    maybe: Vec<Vec<u8>>,
}

/// A 9-to-40-byte block of `fill` bytes, its length varied with `fill` so that a mixed-up
/// block cannot pass as another.
fn block_bytes(fill: u8) -> Vec<u8> {
    vec![fill; 9 + usize::from(fill % 32)]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 24,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Writes, reads and fences through a simulated queue with seeded faults (lost, late,
    /// duplicated and error completions, stalls), against a model: every failed call holds one
    /// quarantined slot and every completed one none; a fence returns exactly the quarantined
    /// slots; a read answers the last completed write's bytes, or a failed write's, or a miss,
    /// never other bytes.
    #[test]
    fn slab_accounting_and_bytes_follow_a_model_under_seeded_faults(
        seed in proptest::prelude::any::<u64>(),
        rates in proptest::array::uniform5(0..150_000u32),
        steps in proptest::collection::vec(step(), 1..16),
    ) {
        const SLOTS: usize = 8;
        let dir = tempfile::tempdir().unwrap();
        let mut sim = SimConfig::new(seed);
        sim.rates = FaultRates {
            lost_ppm: rates[0],
            late_ppm: rates[1],
            duplicated_ppm: rates[2],
            error_ppm: rates[3],
            stall_ppm: rates[4],
        };
        let agent = config(dir.path(), vec![QueueKind::Sim(sim)], 8, SLOTS).start().unwrap();
        let mut model: [Expect; 4] = Default::default();
        let mut quarantined = 0usize;
        let mut dst = vec![0u8; SLOT];
        // Short per call: a lost completion costs this much wall time.
        let wait_deadline = || Instant::now() + Duration::from_millis(100);
        for (i, st) in steps.iter().enumerate() {
            match *st {
                Step::Write { block, fill } => {
                    let bytes = block_bytes(fill);
                    let t = agent
                        .submit_write(ReactorId(0), QueueId(0), BlockId(block), &bytes)
                        .unwrap();
                    let expect = &mut model[block as usize];
                    match agent.wait(t, wait_deadline(), &mut []) {
                        Ok(Outcome::Written) => {
                            expect.committed = Some(bytes);
                            expect.maybe.clear();
                        }
                        Ok(o) => panic!("step {i}: a write answered {o:?}"),
                        Err(DpuError::Lost { .. } | DpuError::Completion { .. }) => {
                            quarantined += 1;
                            expect.maybe.push(bytes);
                        }
                        Err(e) => panic!("step {i}: {e}"),
                    }
                }
                Step::Read { block } => {
                    let t = agent.submit_read(ReactorId(0), QueueId(0), BlockId(block)).unwrap();
                    let expect = &model[block as usize];
                    match agent.wait(t, wait_deadline(), &mut dst) {
                        Ok(Outcome::Read { len }) => {
                            let got = &dst[..len];
                            let known = expect.committed.as_deref() == Some(got)
                                || expect.maybe.iter().any(|m| m == got);
                            proptest::prop_assert!(known, "step {i}: block {block} read bytes no write put there: {got:?}, model {expect:?}");
                        }
                        // Absent when nothing completed there yet; never a wrong hit.
                        Ok(Outcome::Miss(MissCause::Absent)) => proptest::prop_assert!(
                            expect.committed.is_none(),
                            "step {i}: block {block} missed after a completed write"
                        ),
                        Ok(o) => panic!("step {i}: a read answered {o:?}"),
                        Err(DpuError::Lost { .. } | DpuError::Completion { .. }) => {
                            quarantined += 1;
                        }
                        Err(e) => panic!("step {i}: {e}"),
                    }
                }
                Step::Fence => {
                    let e = agent.bump_epoch().unwrap();
                    let reclaimed = agent.reclaim_fenced(e, deadline()).unwrap();
                    proptest::prop_assert_eq!(reclaimed, quarantined, "step {}: fence", i);
                    quarantined = 0;
                }
            }
            let s = agent.slab();
            proptest::prop_assert_eq!(s.regions.quarantined, quarantined, "step {}", i);
            proptest::prop_assert_eq!(s.free + quarantined, SLOTS, "step {}", i);
        }
    }
}

/// A native backend without its library or device: `start` refuses with the backend's name and
/// the missing device among what it lists, and starts nothing (no epoch persisted).
#[cfg(any(feature = "spdk", feature = "doca"))]
fn assert_fails_closed(kind: QueueKind, backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let err = config(dir.path(), vec![kind], 4, 4).start().unwrap_err();
    match &err {
        DpuError::NativeUnavailable { backend: named, missing } if *named == backend => {
            assert!(
                missing.iter().any(|m| matches!(m, gpucache_dpu::NativeMissing::Device { .. })),
                "{err}"
            );
        }
        e => panic!("{e}"),
    }
    assert!(err.to_string().contains(&format!("{backend} backend unavailable")), "{err}");
    assert!(!dir.path().join("state").join(gpucache_dpu::EPOCH_FILE).exists(), "nothing started");
}

#[cfg(feature = "spdk")]
#[test]
fn spdk_fails_closed_naming_what_is_missing() {
    let pci_addr = "0000:ff:1f.7".into();
    assert_fails_closed(QueueKind::Spdk(gpucache_dpu::SpdkConfig { pci_addr }), "spdk");
}

#[cfg(feature = "doca")]
#[test]
fn doca_fails_closed_naming_what_is_missing() {
    let device = "no-such-bf3".into();
    assert_fails_closed(QueueKind::Doca(gpucache_dpu::DocaConfig { device }), "doca");
}
