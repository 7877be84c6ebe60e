//! DpuStore's batch calls: every queue of a batch gets its items before any completion is waited
//! on, a batch larger than the slab answers every item exactly as the single-key calls do and
//! leaves every slot free, and a lost or failed completion answers only its own item (with the
//! retirement the single-key rule gives it) and quarantines only its own slot.

// Test indices and byte patterns are small and truncation is what the patterns want.
#![allow(clippy::cast_possible_truncation)]

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{
    BatchGet, BatchPut, Get, Invalidate, Lookup, MissReason, Put, Retirement, Store, StoreError,
};
use gpucache_dataplane::testing::fixture;
use gpucache_dpu::sim::{Fault, SimConfig};
use gpucache_dpu::{
    Agent, AgentConfig, DpuStore, DpuStoreConfig, PinPolicy, QueueId, QueueKind, QueueSpec,
    ReactorId, ReactorSpec, SlabConfig,
};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::host::pool::{HugePagePolicy, Tier};

const SLOT: usize = 4096;

/// An agent with one queue per reactor (`kinds[i]` owned by reactor `i`), each `depth` deep,
/// over a slab of `slots` slots.
fn agent(dir: &Path, kinds: Vec<QueueKind>, depth: usize, slots: usize) -> Arc<Agent> {
    let reactors =
        (0..kinds.len()).map(|i| ReactorSpec { id: ReactorId(i as u16), core: None }).collect();
    let queues = kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| QueueSpec {
            id: QueueId(i as u32),
            owner: ReactorId(i as u16),
            depth_max: depth,
            kind,
        })
        .collect();
    let config = AgentConfig {
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
    };
    Arc::new(config.start().unwrap())
}

fn sims(scripts: Vec<Vec<Fault>>) -> Vec<QueueKind> {
    scripts
        .into_iter()
        .enumerate()
        .map(|(i, script)| {
            let mut sim = SimConfig::new(11 + i as u64);
            sim.script = script;
            QueueKind::Sim(sim)
        })
        .collect()
}

fn memory() -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default())).unwrap())
}

fn store(agent: &Arc<Agent>, backing: Arc<dyn Store>, op_deadline: Duration) -> DpuStore {
    DpuStore::new(Arc::clone(agent), backing, DpuStoreConfig { op_deadline })
}

/// Distinct single-link keys of tenant 0 (no one a prefix of another).
fn keys(n: usize) -> Vec<PhysicalKey> {
    (0..n).map(|i| fixture::key(0, &[i as u8], KvDtype::F16, 16)).collect()
}

/// The bytes stored under the `i`-th key: their length varies, so a mixed-up block shows.
fn bytes(i: usize) -> Vec<u8> {
    fixture::payload(i as u64, 100 + 37 * i)
}

/// Every slot of `agent`'s slab is free again and no queue holds a submission.
fn assert_all_settled(agent: &Agent, slots: usize) {
    let stats = agent.stats();
    assert_eq!((stats.slab.free, stats.slab.regions.quarantined), (slots, 0), "{stats:?}");
    for q in &stats.queues {
        assert_eq!(q.outstanding, 0, "{q:?}");
    }
}

/// How many GETs have reached the backing store, and whether one gave up waiting for the rest.
#[derive(Debug, Default)]
struct Meeting {
    arrived: usize,
    gave_up: bool,
}

/// Longest a GET waits at the meeting for the GETs of the other queues. It only bounds how long
/// a failing run takes: a passing run never waits for it to pass.
const MEETING_PATIENCE: Duration = Duration::from_secs(20);

/// Each queue has its own reactor, and the backing store holds every GET until one GET of
/// every queue has reached it: the batch's GETs can all get through only when every queue was
/// given its items before the batch waited for any answer. (Had the batch waited for one queue
/// first, that queue's GET would be held until the meeting gave up, and the test would see it.)
#[test]
fn a_batch_reaches_every_queue_before_any_completion_is_awaited() {
    const QUEUES: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent(dir.path(), sims(vec![Vec::new(); QUEUES]), 16, 32);
    let meeting = Arc::new((Mutex::new(Meeting::default()), Condvar::new()));
    let m = Arc::clone(&meeting);
    let hold = move |_dst: &[u8]| {
        let (lock, met) = &*m;
        let mut g = lock.lock().unwrap();
        g.arrived += 1;
        met.notify_all();
        let (mut g, waited) =
            met.wait_timeout_while(g, MEETING_PATIENCE, |g| g.arrived < QUEUES).unwrap();
        if waited.timed_out() {
            g.gave_up = true;
        }
    };
    let backing = Arc::new(fixture::BeforeGet::new(memory(), hold));
    // The op deadline outlasts the meeting's patience: a held GET is slow, never lost.
    let store = store(&agent, backing.clone(), MEETING_PATIENCE * 3);
    let caller = fixture::caller(0);
    // The first two keys (in key order) that each queue owns.
    let mut chosen: Vec<(PhysicalKey, QueueId)> = Vec::new();
    for key in keys(64) {
        let (_, q) = store.route(&key);
        if chosen.iter().filter(|(_, c)| *c == q).count() < 2 {
            chosen.push((key, q));
        }
    }
    assert_eq!(chosen.len(), 2 * QUEUES, "64 keys cover every queue twice");
    for (i, (key, _)) in chosen.iter().enumerate() {
        let put = backing.inner.put(&caller, key, &bytes(i), None).unwrap();
        assert!(matches!(put, Put::Committed(_)), "{put:?}");
    }
    let before: Vec<u64> = agent.stats().queues.iter().map(|q| q.submitted).collect();

    let mut bufs = vec![vec![0u8; SLOT]; chosen.len()];
    let mut items: Vec<BatchGet<'_>> = chosen
        .iter()
        .zip(bufs.iter_mut())
        .map(|((key, _), dst)| BatchGet { key, dst: dst.as_mut_slice() })
        .collect();
    let answers = store.get_batch(&caller, &mut items);
    drop(items);

    let g = meeting.0.lock().unwrap();
    assert!(!g.gave_up, "a GET waited alone: its batch had not reached every queue");
    assert_eq!(g.arrived, chosen.len());
    drop(g);
    for (i, answer) in answers.iter().enumerate() {
        let want = bytes(i);
        match answer {
            Ok(Get::Hit { len, .. }) => {
                assert_eq!(*len as usize, want.len(), "item {i}");
                assert_eq!(&bufs[i][..want.len()], &want[..], "item {i}");
            }
            other => panic!("item {i}: {other:?}"),
        }
    }
    // Each queue was given exactly its own items, one submission each.
    let after = agent.stats().queues;
    for (q, stats) in after.iter().enumerate() {
        let mine = chosen.iter().filter(|(_, c)| *c == QueueId(q as u32)).count() as u64;
        assert_eq!(stats.submitted - before[q], mine, "{stats:?}");
    }
    assert_all_settled(&agent, 32);
}

/// A FileStore under `dir` (io_uring engine when available, no fsync), as the service fronts.
fn file_store(dir: &Path) -> Arc<dyn Store> {
    let mut fc = FileStoreConfig::new(dir.join("store"));
    fc.engine = EngineChoice::Auto;
    fc.engine_config.staging_bytes = 0;
    fc.durability = Durability::None;
    Arc::new(fc.open(Arc::new(ManualClock::default())).unwrap())
}

#[test]
fn a_batch_larger_than_the_slab_answers_as_single_calls_and_leaks_nothing() {
    batch_equals_single_calls(|_| sims(vec![Vec::new(); 2]), |_| memory());
}

#[test]
fn a_batch_over_host_queues_and_a_file_store_answers_as_single_calls() {
    let host = |dir: &Path| {
        (0..2)
            .map(|i| QueueKind::Host {
                root: dir.join(format!("q{i}")),
                engine: EngineChoice::Auto,
                sync: false,
            })
            .collect()
    };
    batch_equals_single_calls(host, file_store);
}

/// Batch calls over a slab of 4 slots and queues 2 deep, with up to 44 items, answer item for
/// item what the single-key calls answer on a twin store (bytes in the buffers included);
/// afterwards every slot is free. `queues` and `backing` make each twin's queues and store
/// under its own directory.
fn batch_equals_single_calls(
    queues: impl Fn(&Path) -> Vec<QueueKind>,
    backing: impl Fn(&Path) -> Arc<dyn Store>,
) {
    const SLOTS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let single_dir = tempfile::tempdir().unwrap();
    let batched_agent = agent(dir.path(), queues(dir.path()), 2, SLOTS);
    let single_agent = agent(single_dir.path(), queues(single_dir.path()), 2, SLOTS);
    let deadline = Duration::from_secs(30);
    let batched = store(&batched_agent, backing(dir.path()), deadline);
    let single = store(&single_agent, backing(single_dir.path()), deadline);
    let caller = fixture::caller(0);

    let ks = keys(40);
    let other_tenant = fixture::key(1, &[200], KvDtype::F16, 16);
    let empty_key = fixture::key(0, &[201], KvDtype::F16, 16);
    let too_large = vec![7u8; SLOT + 1];
    let payloads: Vec<Vec<u8>> = (0..ks.len()).map(bytes).collect();
    // Forty blocks, the first one again (already committed by then), a block of another
    // tenant, one larger than a slot, and an empty one.
    let mut puts: Vec<BatchPut<'_>> =
        ks.iter().zip(&payloads).map(|(key, src)| BatchPut { key, src, request: None }).collect();
    puts.push(BatchPut { key: &ks[0], src: &payloads[1], request: None });
    puts.push(BatchPut { key: &other_tenant, src: &payloads[2], request: None });
    puts.push(BatchPut { key: &ks[3], src: &too_large, request: None });
    puts.push(BatchPut { key: &empty_key, src: &[], request: None });
    let put_answers = batched.put_batch(&caller, &puts);
    let want: Vec<Result<Put, StoreError>> =
        puts.iter().map(|p| single.put(&caller, p.key, p.src, p.request)).collect();
    assert_eq!(put_answers, want);
    assert_eq!(put_answers[40], Ok(Put::AlreadyCommitted));
    assert!(put_answers[..40].iter().all(|a| matches!(a, Ok(Put::Committed(_)))));
    assert_all_settled(&batched_agent, SLOTS);

    // Every block, a missing one, and one read into a buffer too small for it.
    let missing = fixture::key(0, &[202], KvDtype::F16, 16);
    let mut get_keys: Vec<&PhysicalKey> = ks.iter().collect();
    get_keys.push(&missing);
    get_keys.push(&ks[39]);
    let sizes: Vec<usize> = (0..get_keys.len()).map(|i| if i == 41 { 10 } else { SLOT }).collect();
    let mut batch_bufs: Vec<Vec<u8>> = sizes.iter().map(|n| vec![0xEE; *n]).collect();
    let mut items: Vec<BatchGet<'_>> = get_keys
        .iter()
        .zip(batch_bufs.iter_mut())
        .map(|(key, dst)| BatchGet { key, dst: dst.as_mut_slice() })
        .collect();
    let get_answers = batched.get_batch(&caller, &mut items);
    drop(items);
    let mut single_bufs: Vec<Vec<u8>> = sizes.iter().map(|n| vec![0xEE; *n]).collect();
    let want: Vec<Result<Get, StoreError>> = get_keys
        .iter()
        .zip(single_bufs.iter_mut())
        .map(|(key, dst)| single.get_into(&caller, key, dst))
        .collect();
    assert_eq!(get_answers, want);
    assert_eq!(batch_bufs, single_bufs, "the same bytes landed in the same buffers");
    for (i, src) in payloads.iter().enumerate() {
        assert_eq!(&batch_bufs[i][..src.len()], &src[..], "item {i}");
    }
    assert_eq!(get_answers[40], Ok(Get::Miss(MissReason::Absent)));
    assert!(matches!(get_answers[41], Err(StoreError::BufferTooSmall { .. })));
    assert_all_settled(&batched_agent, SLOTS);

    // Lookups (a prefix of a stored chain among them), then invalidations with one key twice,
    // then the lookups again.
    let prefixed = fixture::key(0, &[5, 9], KvDtype::F16, 16);
    let mut look: Vec<&PhysicalKey> = ks.iter().collect();
    look.push(&prefixed);
    look.push(&missing);
    let lookups = batched.lookup_batch(&caller, &look);
    let want: Vec<Result<Lookup, StoreError>> =
        look.iter().map(|k| single.lookup(&caller, k)).collect();
    assert_eq!(lookups, want);
    assert!(matches!(lookups[40], Ok(Lookup::PrefixHit { .. })), "{:?}", lookups[40]);
    let mut gone: Vec<&PhysicalKey> = ks.iter().step_by(2).collect();
    gone.push(&ks[0]);
    gone.push(&other_tenant);
    let invalidations = batched.invalidate_batch(&caller, &gone);
    let want: Vec<Result<Invalidate, StoreError>> =
        gone.iter().map(|k| single.invalidate(&caller, k)).collect();
    assert_eq!(invalidations, want);
    assert_eq!(invalidations[gone.len() - 2], Ok(Invalidate::Absent), "the second one");
    let lookups = batched.lookup_batch(&caller, &look);
    let want: Vec<Result<Lookup, StoreError>> =
        look.iter().map(|k| single.lookup(&caller, k)).collect();
    assert_eq!(lookups, want);
    assert_all_settled(&batched_agent, SLOTS);
    assert_all_settled(&single_agent, SLOTS);
}

/// The index in `keys` of the `nth` key (from 0) that `store` routes to `queue`.
fn nth_on(store: &DpuStore, keys: &[PhysicalKey], queue: QueueId, nth: usize) -> usize {
    keys.iter()
        .enumerate()
        .filter(|(_, k)| store.route(k).1 == queue)
        .nth(nth)
        .map(|(i, _)| i)
        .expect("enough keys on the queue")
}

/// The op deadline of the tests that lose completions: each lost item costs its batch this much
/// wall time, and every other item completes long before it.
const LOSS_DEADLINE: Duration = Duration::from_secs(1);

/// Twelve GETs over a slab of 4 slots: queue 0 loses the completion of its second item and
/// queue 1 answers its first with an error completion. Those two items are clean misses with
/// their buffers untouched (as a lost or failed single GET is), every other item reads its
/// bytes, and exactly the two failed items' slots are quarantined until the store's fence.
#[test]
fn a_lost_completion_in_a_get_batch_fails_only_its_item() {
    const SLOTS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let agent =
        agent(dir.path(), sims(vec![vec![Fault::None, Fault::Lost], vec![Fault::Error]]), 8, SLOTS);
    let backing = memory();
    let store = store(&agent, backing.clone(), LOSS_DEADLINE);
    let caller = fixture::caller(0);
    let ks = keys(12);
    // Stored straight into the backing store: the queues' scripted faults are the batch's.
    for (i, key) in ks.iter().enumerate() {
        assert!(matches!(backing.put(&caller, key, &bytes(i), None), Ok(Put::Committed(_))));
    }
    let lost = nth_on(&store, &ks, QueueId(0), 1);
    let failed = nth_on(&store, &ks, QueueId(1), 0);

    let mut bufs = vec![vec![0xEEu8; SLOT]; ks.len()];
    let mut items: Vec<BatchGet<'_>> = ks
        .iter()
        .zip(bufs.iter_mut())
        .map(|(key, dst)| BatchGet { key, dst: dst.as_mut_slice() })
        .collect();
    let answers = store.get_batch(&caller, &mut items);
    drop(items);

    for (i, answer) in answers.iter().enumerate() {
        if i == lost || i == failed {
            assert_eq!(*answer, Ok(Get::Miss(MissReason::Absent)), "item {i}");
            assert!(bufs[i].iter().all(|b| *b == 0xEE), "item {i}: its buffer was touched");
        } else {
            let want = bytes(i);
            assert!(
                matches!(answer, Ok(Get::Hit { len, .. }) if *len as usize == want.len()),
                "item {i}: {answer:?}"
            );
            assert_eq!(&bufs[i][..want.len()], &want[..], "item {i}");
        }
    }
    let s = agent.slab();
    assert_eq!((s.free, s.regions.quarantined), (SLOTS - 2, 2));
    let e = store.bump_epoch().unwrap();
    assert_eq!(store.reclaim_fenced(e).unwrap(), 2);
    assert_all_settled(&agent, SLOTS);
}

/// A lookup batch and a PUT batch, each losing one completion on queue 0: the lost item answers
/// a backend error whose buffers are retired (DpuStore's single calls fail the same way), the
/// others answer as usual, and only the lost item's slot is quarantined.
#[test]
fn a_lost_completion_in_a_lookup_or_put_batch_fails_only_its_item() {
    const SLOTS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let ks = keys(10);
    let agent = agent(dir.path(), sims(vec![vec![Fault::Lost], Vec::new()]), 8, SLOTS);
    let backing = memory();
    let store = store(&agent, backing.clone(), LOSS_DEADLINE);
    let caller = fixture::caller(0);
    let payloads: Vec<Vec<u8>> = (0..ks.len()).map(bytes).collect();
    assert!(store.failures_retire());

    // The first job queue 0 runs is the lookup batch's first item routed there.
    for (i, key) in ks.iter().enumerate() {
        assert!(matches!(backing.put(&caller, key, &payloads[i], None), Ok(Put::Committed(_))));
    }
    let lost = nth_on(&store, &ks, QueueId(0), 0);
    let refs: Vec<&PhysicalKey> = ks.iter().collect();
    let answers = store.lookup_batch(&caller, &refs);
    for (i, answer) in answers.iter().enumerate() {
        if i == lost {
            let e = answer.as_ref().unwrap_err();
            assert!(matches!(e, StoreError::Backend { .. }), "{e}");
            assert_eq!(e.retirement(), Retirement::Retired);
        } else {
            let len = payloads[i].len() as u64;
            assert_eq!(*answer, Ok(Lookup::Hit { len }), "item {i}");
        }
    }
    assert_eq!(agent.slab().regions.quarantined, 1);
    let e = store.bump_epoch().unwrap();
    assert_eq!(store.reclaim_fenced(e).unwrap(), 1);

    // A second agent whose queue 0 loses its first PUT.
    let dir = tempfile::tempdir().unwrap();
    let agent = self::agent(dir.path(), sims(vec![vec![Fault::Lost], Vec::new()]), 8, SLOTS);
    let backing = memory();
    let store = self::store(&agent, backing.clone(), LOSS_DEADLINE);
    let puts: Vec<BatchPut<'_>> =
        ks.iter().zip(&payloads).map(|(key, src)| BatchPut { key, src, request: None }).collect();
    let answers = store.put_batch(&caller, &puts);
    for (i, answer) in answers.iter().enumerate() {
        if i == lost {
            let e = answer.as_ref().unwrap_err();
            assert!(matches!(e, StoreError::Backend { .. }), "{e}");
            assert_eq!(e.retirement(), Retirement::Retired);
        } else {
            assert!(matches!(answer, Ok(Put::Committed(_))), "item {i}: {answer:?}");
            let mut dst = vec![0u8; SLOT];
            let got = backing.get_into(&caller, &ks[i], &mut dst).unwrap();
            assert!(matches!(got, Get::Hit { len, .. } if len as usize == payloads[i].len()));
            assert_eq!(&dst[..payloads[i].len()], &payloads[i][..], "item {i}");
        }
    }
    let s = agent.slab();
    assert_eq!((s.free, s.regions.quarantined), (SLOTS - 1, 1));
    let e = store.bump_epoch().unwrap();
    assert_eq!(store.reclaim_fenced(e).unwrap(), 1);
    assert_all_settled(&agent, SLOTS);
}
