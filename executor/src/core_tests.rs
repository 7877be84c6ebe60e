//! Tests of the executor core against a scripted store whose calls can be held at a gate the
//! test controls. Time is a [`ManualClock`]; no test sleeps to wait for a condition: every wait
//! is on a channel or on `poll_wait`, each with a deadline.

use std::collections::HashMap;
use std::num::{NonZeroU64, NonZeroUsize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, Shard,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::store::{
    Abort, Committed, Get, Implementation, Invalidate, Lookup, MissReason, Put, Reclaimed,
    Reservation, Reserve, Retirement, Store, StoreError, StoreInfo, StoreStats,
};

/// Longest any test waits for a worker; a healthy run never comes near it.
const WAIT: Duration = Duration::from_secs(10);
const SLOT_BYTES: u64 = 64;
const COOLDOWN_MS: u64 = 1_000;

/// What the scripted store answers for one key.
#[derive(Debug, Clone)]
enum Script {
    /// Lookup: a hit of `len`. Get: `len` bytes of `fill` (reported as `len` even when the
    /// destination is smaller, which makes a malformed result).
    Hit {
        len: u64,
        fill: u8,
    },
    Miss(MissReason),
    Fail(StoreError),
    Put(Put),
}

/// A held call: the tag of its key and the sender that lets it go on.
type Held = (u8, SyncSender<()>);

#[derive(Debug)]
struct FakeStore {
    failures_retire: bool,
    scripts: Mutex<HashMap<u8, Script>>,
    /// When set, every call announces itself here and waits to be released.
    gate: Mutex<Option<SyncSender<Held>>>,
    calls: AtomicU64,
}

fn tag(key: &PhysicalKey) -> u8 {
    key.identity().chain().first().map_or(0, |d| d.0[0])
}

fn backend(retirement: Retirement) -> StoreError {
    StoreError::Backend { operation: "test", detail: "scripted".into(), retirement }
}

impl FakeStore {
    fn new(failures_retire: bool) -> Arc<Self> {
        Arc::new(Self {
            failures_retire,
            scripts: Mutex::new(HashMap::new()),
            gate: Mutex::new(None),
            calls: AtomicU64::new(0),
        })
    }

    fn script(&self, key: u8, script: Script) {
        self.scripts.lock().expect("scripts").insert(key, script);
    }

    /// Holds every later call at the gate; the receiver announces each held call.
    fn hold(&self) -> Receiver<Held> {
        let (tx, rx) = sync_channel(64);
        *self.gate.lock().expect("gate") = Some(tx);
        rx
    }

    /// Lets every later call through; calls already held still wait for their release.
    fn open(&self) {
        *self.gate.lock().expect("gate") = None;
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn enter(&self, key: &PhysicalKey) -> Option<Script> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let gate = self.gate.lock().expect("gate").clone();
        if let Some(gate) = gate {
            let (release, released) = sync_channel(1);
            if gate.send((tag(key), release)).is_ok() {
                // A test that never releases the call leaves it here until the deadline.
                let _ = released.recv_timeout(WAIT);
            }
        }
        self.scripts.lock().expect("scripts").get(&tag(key)).cloned()
    }
}

fn unused<T>() -> Result<T, StoreError> {
    Err(backend(Retirement::Retired))
}

impl Store for FakeStore {
    fn info(&self) -> StoreInfo {
        StoreInfo {
            name: "scripted",
            implementation: Implementation::Simulated { seed: 0 },
            failures_retire: self.failures_retire,
            full_policy: gpucache_dataplane::store::FullPolicy::Refuse,
        }
    }
    fn epoch(&self) -> Epoch {
        Epoch(1)
    }
    fn lookup(&self, _: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        match self.enter(key) {
            Some(Script::Hit { len, .. }) => Ok(Lookup::Hit { len }),
            Some(Script::Miss(reason)) => Ok(Lookup::Miss(reason)),
            Some(Script::Fail(e)) => Err(e),
            Some(Script::Put(_)) | None => Ok(Lookup::Miss(MissReason::Absent)),
        }
    }
    fn get_into(&self, _: &Caller, key: &PhysicalKey, dst: &mut [u8]) -> Result<Get, StoreError> {
        match self.enter(key) {
            Some(Script::Hit { len, fill }) => {
                let n = usize::try_from(len).unwrap_or(usize::MAX).min(dst.len());
                dst[..n].fill(fill);
                Ok(Get::Hit { len, checksum: Checksum(0) })
            }
            Some(Script::Miss(reason)) => Ok(Get::Miss(reason)),
            Some(Script::Fail(e)) => Err(e),
            Some(Script::Put(_)) | None => Ok(Get::Miss(MissReason::Absent)),
        }
    }
    fn put(
        &self,
        _: &Caller,
        key: &PhysicalKey,
        _src: &[u8],
        _: Option<gpucache_dataplane::limits::RequestId>,
    ) -> Result<Put, StoreError> {
        match self.enter(key) {
            Some(Script::Put(answer)) => Ok(answer),
            Some(Script::Fail(e)) => Err(e),
            _ => Ok(Put::Committed(Checksum(0))),
        }
    }
    fn reserve(
        &self,
        _: &Caller,
        _: &PhysicalKey,
        _: u64,
        _: Option<gpucache_dataplane::limits::RequestId>,
    ) -> Result<Reserve, StoreError> {
        unused()
    }
    fn write(&self, _: &Caller, _: &Reservation, _: u64, _: &[u8]) -> Result<(), StoreError> {
        unused()
    }
    fn commit(&self, _: &Caller, _: &Reservation) -> Result<Committed, StoreError> {
        unused()
    }
    fn abort(&self, _: &Caller, _: Reservation, _: Retirement) -> Result<Abort, StoreError> {
        unused()
    }
    fn invalidate(&self, _: &Caller, _: &PhysicalKey) -> Result<Invalidate, StoreError> {
        unused()
    }
    fn expire_leases(&self) -> Result<usize, StoreError> {
        Ok(0)
    }
    fn attest_drained(&self, _: &Caller, _: RegionId) -> Result<Reclaimed, StoreError> {
        unused()
    }
    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        unused()
    }
    fn reclaim_fenced(&self, _: Epoch) -> Result<usize, StoreError> {
        Ok(0)
    }
    fn stats(&self) -> StoreStats {
        StoreStats::default()
    }
}

/// A key told apart by `n`, its tag in the scripted store.
fn key(n: u8) -> PhysicalKey {
    let mut link = [0_u8; 32];
    link[0] = n;
    let identity = CacheIdentity::builder()
        .tenant("tenant-a")
        .trust_domain("test.example")
        .model_revision("model@1")
        .model_config(Digest32([3; 32]))
        .tokenizer_revision("tok-1")
        .kv_dtype(KvDtype::F16)
        .quant(QuantFormat::None)
        .layout("paged-nhd", 1)
        .shard(Shard::SOLO)
        .position(PositionEncoding::Alibi)
        .chain(vec![Digest32(link)])
        .block_tokens(16)
        .valid_tokens(16)
        .build()
        .expect("valid identity");
    PhysicalKey::new(identity)
}

fn nz(v: usize) -> NonZeroUsize {
    NonZeroUsize::new(v).expect("nonzero")
}

fn config() -> ExecutorConfig {
    ExecutorConfig {
        queue_depth_query: nz(8),
        queue_depth_get: nz(8),
        queue_depth_put: nz(8),
        workers_query: nz(1),
        workers_get: nz(1),
        workers_put: nz(1),
        operations_outstanding_max: nz(32),
        keys_per_job_max: nz(8),
        batch_keys_max: nz(super::core::EXECUTOR_BATCH_KEYS_MAX),
        cooldown_ms: NonZeroU64::new(COOLDOWN_MS).expect("nonzero"),
        worker_spin_us: 0,
    }
}

struct Rig {
    exec: Executor,
    store: Arc<FakeStore>,
    clock: ManualClock,
    /// Results polled while waiting for another one.
    stash: Vec<OperationResult>,
}

fn rig_with(config: ExecutorConfig, failures_retire: bool) -> Rig {
    let store = FakeStore::new(failures_retire);
    let clock = ManualClock::default();
    let host = Arc::new(HostBuffer::new(nz(16), nz(64)).expect("host"));
    let exec = Executor::start(
        config,
        Arc::clone(&store) as Arc<dyn Store>,
        Caller::new(
            gpucache_dataplane::identity::TenantId::parse("tenant-a").expect("tenant"),
            Rights::ALL,
        ),
        host,
        Arc::new(clock.clone()),
    )
    .expect("starts");
    Rig { exec, store, clock, stash: Vec::new() }
}

fn rig() -> Rig {
    rig_with(config(), true)
}

/// Slot `n`'s first `len` bytes.
fn slot(n: u64, len: u64) -> HostRange {
    HostRange::new(n * SLOT_BYTES, len)
}

impl Rig {
    /// Waits for `operation`'s result, keeping any others for later.
    fn result(&mut self, operation: OperationId) -> OperationResult {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(i) = self.stash.iter().position(|r| r.operation == operation) {
                return self.stash.remove(i);
            }
            assert!(Instant::now() < deadline, "no result for {operation}");
            let poll = self.exec.poll_wait(WAIT);
            self.stash.extend(poll.results);
        }
    }
}

/// The next held call, which must be `expected`'s.
fn entered(gate: &Receiver<Held>, expected: u8) -> SyncSender<()> {
    let (tag, release) = gate.recv_timeout(WAIT).expect("a call reaches the store");
    assert_eq!(tag, expected, "the call that reached the store");
    release
}

fn release(call: &SyncSender<()>) {
    call.send(()).expect("the held call is waiting");
}

#[test]
fn get_succeeds_only_with_the_exact_byte_count() {
    let mut r = rig();
    r.store.script(1, Script::Hit { len: 40, fill: 0xAB });
    r.store.script(2, Script::Hit { len: 39, fill: 0xCD });
    let op = r.exec.submit_get(vec![(key(1), slot(0, 40)), (key(2), slot(1, 40))]).expect("queued");
    let result = r.result(op);
    assert_eq!(result.ending, Ending::Ran);
    assert_eq!(
        result.keys,
        vec![
            KeyResult::Read { bytes: 40 },
            KeyResult::Failed(KeyFailure::ShortRead { expected: 40, got: 39 }),
        ]
    );
    // A short read is a retired failure: nothing is quarantined and it is no object evidence.
    assert!(result.retired);
    assert_eq!(result.record().key_ok, vec![true, false]);
    assert_eq!(result.record().object_failed, vec![false, false]);
    assert!(r.exec.quarantined().is_empty());
    assert_eq!(r.exec.host().read(slot(0, 40)).expect("range"), vec![0xAB; 40]);
    assert_eq!(r.exec.health().epoch, 0, "a short read is no outage");
    let counters = r.exec.counters();
    assert_eq!((counters.get_keys_read, counters.get_bytes_read), (1, 40));
}

#[test]
fn a_malformed_get_is_retired_only_by_the_stores_guarantee() {
    for failures_retire in [true, false] {
        let mut r = rig_with(config(), failures_retire);
        r.store.script(1, Script::Hit { len: 41, fill: 1 });
        let op = r.exec.submit_get(vec![(key(1), slot(0, 40))]).expect("queued");
        let result = r.result(op);
        assert_eq!(
            result.keys,
            vec![KeyResult::Failed(KeyFailure::Malformed { expected: 40, reported: 41 })]
        );
        assert_eq!(result.retired, failures_retire);
        assert_eq!(r.exec.quarantined().is_empty(), failures_retire);
        assert_eq!(r.exec.health().epoch, 1, "a malformed result is an outage");
    }
}

#[test]
fn only_confirmed_misses_are_object_evidence() {
    // Two keys per store call: keys 1-2, 3-4, then 5.
    let mut c = config();
    c.batch_keys_max = nz(2);
    let mut r = rig_with(c, true);
    r.store.script(1, Script::Miss(MissReason::Absent));
    r.store.script(2, Script::Miss(MissReason::Incompatible));
    r.store.script(
        3,
        Script::Miss(MissReason::NotReadable(gpucache_dataplane::lifecycle::BlockState::Writing)),
    );
    r.store.script(4, Script::Fail(backend(Retirement::Retired)));
    r.store.script(5, Script::Hit { len: 8, fill: 1 });
    let reads = (1..=5).map(|k| (key(k), slot(u64::from(k), 8))).collect();
    let op = r.exec.submit_get(reads).expect("queued");
    let result = r.result(op);
    assert_eq!(result.keys[0], KeyResult::ObjectFailed(MissReason::Absent));
    assert_eq!(result.keys[1], KeyResult::ObjectFailed(MissReason::Incompatible));
    assert_eq!(result.keys[2], KeyResult::Failed(KeyFailure::NotReadable));
    assert_eq!(result.keys[3], KeyResult::Failed(KeyFailure::Store(backend(Retirement::Retired))));
    // The backend failed in the second call: the third is not made.
    assert_eq!(result.keys[4], KeyResult::Failed(KeyFailure::NotAttempted));
    assert_eq!(r.store.calls(), 4);
    assert_eq!(r.exec.counters().backend_calls, 2);
    assert_eq!(result.record().object_failed, vec![true, true, false, false, false]);
    assert!(result.retired);
    assert_eq!(r.exec.health().epoch, 1, "a backend exception is an outage");

    // A QUERY miss is a plain "not found", never an object failure.
    let mut r = rig();
    r.store.script(1, Script::Hit { len: 64, fill: 0 });
    let op = r.exec.submit_query(vec![key(1), key(2)]).expect("queued");
    let result = r.result(op);
    assert_eq!(
        result.keys,
        vec![KeyResult::Found { len: 64 }, KeyResult::Failed(KeyFailure::NotFound)]
    );
    assert_eq!(result.record().object_failed, vec![false, false]);
}

#[test]
fn already_committed_put_is_idempotent_success_counted_apart() {
    let mut r = rig();
    r.store.script(2, Script::Put(Put::AlreadyCommitted));
    r.store.script(
        3,
        Script::Put(Put::Refused(gpucache_dataplane::limits::Refusal::InflightRequests {
            current: 1,
            max: 1,
        })),
    );
    let op = r
        .exec
        .submit_put(vec![(key(1), slot(0, 16)), (key(2), slot(1, 16)), (key(3), slot(2, 16))])
        .expect("queued");
    let result = r.result(op);
    assert_eq!(
        result.keys,
        vec![
            KeyResult::Written { bytes: 16 },
            KeyResult::AlreadyStored,
            KeyResult::Failed(KeyFailure::Refused)
        ]
    );
    assert_eq!(result.record().key_ok, vec![true, true, false]);
    assert!(result.retired);
    let c = r.exec.counters();
    assert_eq!((c.put_new_writes, c.put_new_bytes, c.put_already_stored), (1, 16, 1));
    assert_eq!(r.exec.health().epoch, 0, "duplicates and capacity refusals are no outage");
}

#[test]
fn full_queue_and_outstanding_limit_refuse_without_blocking() {
    let mut c = config();
    c.queue_depth_query = nz(2);
    c.operations_outstanding_max = nz(4);
    let mut r = rig_with(c, true);
    let gate = r.store.hold();
    let q1 = r.exec.submit_query(vec![key(1)]).expect("queued");
    let q1_call = entered(&gate, 1);
    let q2 = r.exec.submit_query(vec![key(2)]).expect("queued");
    let q3 = r.exec.submit_query(vec![key(3)]).expect("queued");
    assert_eq!(
        r.exec.submit_query(vec![key(4)]),
        Err(SubmitRefusal::QueueFull { kind: OperationKind::Query, queued: 2, depth: 2 })
    );
    let g1 = r.exec.submit_get(vec![(key(5), slot(0, 8))]).expect("queued");
    let g1_call = entered(&gate, 5);
    assert_eq!(
        r.exec.submit_put(vec![(key(6), slot(1, 8))]),
        Err(SubmitRefusal::OutstandingFull { outstanding: 4, max: 4 })
    );
    release(&q1_call);
    release(&g1_call);
    release(&entered(&gate, 2));
    release(&entered(&gate, 3));
    // Finished but undelivered results still count.
    for op in [q1, q2, q3, g1] {
        let _ = r.result(op);
    }
    // `result` polled them all, so they are delivered now and room is back.
    assert!(r.exec.submit_put(vec![(key(6), slot(1, 8))]).is_ok());
    let _ = entered(&gate, 6);
}

#[test]
fn undelivered_results_hold_the_outstanding_limit() {
    let mut c = config();
    c.operations_outstanding_max = nz(2);
    let mut r = rig_with(c, true);
    let a = r.exec.submit_query(vec![key(1)]).expect("queued");
    let b = r.exec.submit_query(vec![key(2)]).expect("queued");
    // Wait on the condition (both results finished) without taking them.
    assert_eq!(r.exec.wait_undelivered(2, WAIT), 2);
    assert_eq!(
        r.exec.submit_query(vec![key(3)]),
        Err(SubmitRefusal::OutstandingFull { outstanding: 2, max: 2 })
    );
    let _ = (r.result(a), r.result(b));
    assert!(r.exec.submit_query(vec![key(3)]).is_ok());
}

#[test]
fn submissions_are_validated() {
    let r = rig();
    assert_eq!(r.exec.submit_query(vec![]), Err(SubmitRefusal::NoKeys));
    assert_eq!(
        r.exec.submit_query((0..9).map(key).collect()),
        Err(SubmitRefusal::TooManyKeys { keys: 9, max: 8 })
    );
    assert_eq!(
        r.exec.submit_get(vec![(key(1), slot(0, 8)), (key(2), HostRange::new(60, 8))]),
        Err(SubmitRefusal::BadRange {
            index: 1,
            error: crate::RangeError::CrossesSlot {
                range: HostRange::new(60, 8),
                slot_bytes: SLOT_BYTES
            }
        })
    );
    assert!(matches!(
        r.exec.submit_put(vec![(key(1), slot(16, 8))]),
        Err(SubmitRefusal::BadRange { index: 0, .. })
    ));
    assert_eq!(r.store.calls(), 0);
}

#[test]
fn ids_increase_and_are_never_reused() {
    let mut r = rig();
    let gate = r.store.hold();
    let mut seen = Vec::new();
    let first = r.exec.submit_query(vec![key(1)]).expect("queued");
    let call = entered(&gate, 1);
    seen.push(first);
    for round in 0..3_u8 {
        let queued = r.exec.submit_query(vec![key(10 + round)]).expect("queued");
        assert_eq!(r.exec.cancel(queued), CancelOutcome::Cancelled);
        assert_eq!(r.result(queued).ending, Ending::Cancelled);
        seen.push(queued);
        let get = r.exec.submit_get(vec![(key(20 + round), slot(0, 8))]).expect("queued");
        release(&entered(&gate, 20 + round));
        let _ = r.result(get);
        seen.push(get);
    }
    release(&call);
    let _ = r.result(first);
    let last = r.exec.submit_put(vec![(key(30), slot(0, 8))]).expect("queued");
    seen.push(last);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "ids strictly increase: {seen:?}");
}

#[test]
fn a_queued_job_is_cancelled_at_once_while_the_worker_is_busy() {
    let mut r = rig();
    r.store.script(1, Script::Hit { len: 8, fill: 9 });
    let gate = r.store.hold();
    let running = r.exec.submit_get(vec![(key(1), slot(0, 8))]).expect("queued");
    let call = entered(&gate, 1);
    let queued =
        r.exec.submit_get(vec![(key(2), slot(1, 8)), (key(3), slot(2, 8))]).expect("queued");

    // The only GET worker is held in the store; the cancel does not wait for it.
    assert_eq!(r.exec.cancel(queued), CancelOutcome::Cancelled);
    let poll = r.exec.poll();
    assert_eq!(poll.results.len(), 1);
    let cancelled = &poll.results[0];
    assert_eq!(cancelled.operation, queued);
    assert_eq!(cancelled.ending, Ending::Cancelled);
    assert!(cancelled.retired);
    assert_eq!(cancelled.keys, vec![KeyResult::Failed(KeyFailure::NotAttempted); 2]);
    assert_eq!(cancelled.record().object_failed, vec![false, false], "no object evidence");
    assert_eq!(poll.pressure.get, QueueLoad::default());
    assert_eq!(poll.pressure.running_jobs, 1);

    // A running job keeps its lifetime: cancelling only detaches it.
    assert_eq!(r.exec.cancel(running), CancelOutcome::Detached);
    release(&call);
    let result = r.result(running);
    assert!(result.detached);
    assert_eq!((result.ending, result.retired), (Ending::Ran, true));
    assert_eq!(result.keys, vec![KeyResult::Read { bytes: 8 }]);
    assert_eq!(r.exec.cancel(running), CancelOutcome::NotOutstanding);
    assert_eq!(r.exec.cancel(OperationId(999)), CancelOutcome::NotOutstanding);
    assert_eq!(r.store.calls(), 1, "the cancelled job never reached the store");
}

#[test]
fn one_unretired_result_quarantines_the_executor() {
    let mut r = rig_with(config(), false);
    r.store.script(2, Script::Fail(backend(Retirement::Unknown)));
    let op = r
        .exec
        .submit_get(vec![(key(1), slot(3, 8)), (key(2), slot(4, 16)), (key(3), slot(5, 8))])
        .expect("queued");
    let result = r.result(op);
    assert!(!result.retired);
    assert_eq!(result.record().key_ok, vec![false, false, false]);
    let quarantined = r.exec.quarantined();
    assert_eq!(
        quarantined,
        vec![QuarantinedOperation {
            operation: op,
            kind: OperationKind::Get,
            ranges: vec![slot(3, 8), slot(4, 16), slot(5, 8)],
        }]
    );
    assert_eq!(r.exec.counters().unretired_operations, 1);
    // Once the cooldown has passed, health would admit again; quarantine still refuses.
    r.clock.advance_ms(COOLDOWN_MS);
    assert_eq!(
        r.exec.submit_query(vec![key(7)]),
        Err(SubmitRefusal::Quarantined { operation: op })
    );
    let store = Arc::clone(&r.store);
    let report = r.exec.close(WAIT);
    assert!(report.restart_required);
    assert_eq!(report.workers_stuck, 0);
    assert_eq!(report.quarantined, quarantined);
    assert!(report.to_string().contains("restart the process"));
    // The store is kept for the process: the executor's reference was never released.
    assert!(Arc::strong_count(&store) >= 2);
}

#[test]
fn an_unretired_put_failure_quarantines_too() {
    let mut r = rig_with(config(), false);
    r.store.script(1, Script::Fail(backend(Retirement::Unknown)));
    let op = r.exec.submit_put(vec![(key(1), slot(0, 8))]).expect("queued");
    assert!(!r.result(op).retired);
    assert!(matches!(
        r.exec.submit_put(vec![(key(2), slot(1, 8))]),
        Err(SubmitRefusal::Quarantined { .. })
    ));

    // The same error from a store that guarantees retirement on failure quarantines nothing.
    let mut r = rig_with(config(), true);
    r.store.script(1, Script::Fail(backend(Retirement::Unknown)));
    let op = r.exec.submit_put(vec![(key(1), slot(0, 8))]).expect("queued");
    assert!(r.result(op).retired);
    assert!(r.exec.quarantined().is_empty());
}

#[test]
fn cooldown_refuses_submissions_until_one_probe_recovers() {
    let mut r = rig();
    r.store.script(1, Script::Fail(backend(Retirement::Retired)));
    let op = r.exec.submit_get(vec![(key(1), slot(0, 8))]).expect("queued");
    let _ = r.result(op);
    let refused = r.exec.submit_query(vec![key(2)]);
    assert_eq!(
        refused,
        Err(SubmitRefusal::Unhealthy(Rejected::CoolingDown { epoch: 1, until_ms: COOLDOWN_MS }))
    );
    r.clock.advance_ms(COOLDOWN_MS);
    let gate = r.store.hold();
    let probe = r.exec.submit_query(vec![key(2)]).expect("the probe");
    let call = entered(&gate, 2);
    assert!(matches!(
        r.exec.submit_query(vec![key(3)]),
        Err(SubmitRefusal::Unhealthy(Rejected::ProbeInFlight { .. }))
    ));
    r.store.open();
    release(&call);
    let _ = r.result(probe);
    assert_eq!(r.exec.health().state, HealthState::Healthy);
    assert!(r.exec.submit_query(vec![key(3)]).is_ok());
}

#[test]
fn a_stale_success_does_not_undo_a_newer_outage() {
    let mut c = config();
    c.workers_get = nz(2);
    let mut r = rig_with(c, true);
    r.store.script(1, Script::Hit { len: 8, fill: 1 });
    r.store.script(2, Script::Fail(backend(Retirement::Retired)));
    let gate = r.store.hold();
    let slow = r.exec.submit_get(vec![(key(1), slot(0, 8))]).expect("queued");
    let slow_call = entered(&gate, 1);
    let failing = r.exec.submit_get(vec![(key(2), slot(1, 8))]).expect("queued");
    let failing_call = entered(&gate, 2);
    // Both workers are busy; this one waits in the queue, admitted under epoch 0 too.
    let queued = r.exec.submit_get(vec![(key(3), slot(2, 8))]).expect("queued");

    release(&failing_call);
    let _ = r.result(failing);
    assert_eq!(r.exec.health().epoch, 1);
    // The freed worker takes the queued job, which was admitted before the outage: it is
    // rejected without reaching the store and carries no object evidence.
    let rejected = r.result(queued);
    assert_eq!(rejected.ending, Ending::Rejected);
    assert!(rejected.retired);
    assert_eq!(rejected.record().object_failed, vec![false]);

    release(&slow_call);
    let success = r.result(slow);
    assert_eq!(success.keys, vec![KeyResult::Read { bytes: 8 }]);
    let health = r.exec.health();
    assert_eq!(health.epoch, 1);
    assert_eq!(health.state, HealthState::CoolingDown { until_ms: COOLDOWN_MS });
    assert!(matches!(r.exec.submit_query(vec![key(4)]), Err(SubmitRefusal::Unhealthy(_))));
    assert_eq!(r.store.calls(), 2);
}

#[test]
fn pressure_counts_queued_work_and_ages_the_oldest_job() {
    let mut r = rig();
    let gate = r.store.hold();
    let g1 = r.exec.submit_get(vec![(key(1), slot(0, 64))]).expect("queued");
    let g1_call = entered(&gate, 1);
    r.clock.advance_ms(10);
    let p1 = r.exec.submit_put(vec![(key(2), slot(1, 8))]).expect("queued");
    let p1_call = entered(&gate, 2);
    let q1 = r.exec.submit_query(vec![key(3)]).expect("queued");
    let q1_call = entered(&gate, 3);
    let g2 = r.exec.submit_get(vec![(key(4), slot(2, 32)), (key(5), slot(3, 16))]).expect("queued");
    let p2 = r.exec.submit_put(vec![(key(6), slot(4, 24))]).expect("queued");
    let q2 = r.exec.submit_query(vec![key(7), key(8), key(9)]).expect("queued");
    r.clock.advance_ms(5);

    let poll = r.exec.poll();
    assert!(poll.results.is_empty());
    let p = poll.pressure;
    assert_eq!(p.query, QueueLoad { jobs: 1, payload_bytes: 0 });
    assert_eq!(p.get, QueueLoad { jobs: 1, payload_bytes: 48 });
    assert_eq!(p.put, QueueLoad { jobs: 1, payload_bytes: 24 });
    assert_eq!((p.running_jobs, p.undelivered_results), (3, 0));
    assert_eq!(p.oldest_job_age_ms, 15, "the running GET submitted at 0");
    assert_eq!(
        p.observation(),
        crate::Pressure { queued_jobs: 3, queued_payload_bytes: 72, oldest_job_age_ms: 15 }
    );

    release(&g1_call);
    // The only GET worker takes g2 after queuing g1's result.
    let g2_call = entered(&gate, 4);
    let p = r.exec.pressure();
    assert_eq!(p.get, QueueLoad::default());
    assert_eq!((p.running_jobs, p.undelivered_results), (3, 1));
    assert_eq!(p.oldest_job_age_ms, 5, "finished work no longer ages the snapshot");

    r.store.open();
    for call in [p1_call, q1_call, g2_call] {
        release(&call);
    }
    for op in [g1, p1, q1, g2, p2, q2] {
        let _ = r.result(op);
    }
    assert_eq!(r.exec.poll().pressure, PressureSnapshot::default());
    // Per-kind totals on the executor's clock: g1 ran from 0 to 15 without queueing; g2 was
    // queued at 10 and taken at 15, then ran with the clock standing still.
    let get = *r.exec.counters().of(OperationKind::Get);
    assert_eq!(
        get,
        crate::KindCounters {
            completed_jobs: 2,
            completed_payload_bytes: 64 + 48,
            queued_ms: 5,
            backend_ms: 15,
        }
    );
    assert_eq!(r.exec.counters().of(OperationKind::Query).completed_jobs, 2);
}

#[test]
fn close_with_a_stuck_worker_keeps_its_deadline() {
    let r = rig();
    let gate = r.store.hold();
    let stuck = r.exec.submit_query(vec![key(1)]).expect("queued");
    let call = entered(&gate, 1);
    let queued = r.exec.submit_query(vec![key(2)]).expect("queued");
    let store = Arc::clone(&r.store);
    let started = Instant::now();
    let report = r.exec.close(Duration::from_millis(50));
    assert!(started.elapsed() < WAIT, "close waited past its deadline");
    assert_eq!(report.workers_stuck, 1);
    assert_eq!(report.workers_joined, 2);
    assert!(report.restart_required, "a call still in the store has unknown retirement");
    assert_eq!(report.results.len(), 1);
    assert_eq!(report.results[0].operation, queued);
    assert_eq!(report.results[0].ending, Ending::Shutdown);
    assert!(report.results.iter().all(|r| r.operation != stuck));
    // The store stays referenced; let the held call return so its thread can end.
    assert!(Arc::strong_count(&store) >= 2);
    release(&call);
}

#[test]
fn a_clean_close_joins_every_worker_and_releases_the_store() {
    let mut r = rig();
    let op = r.exec.submit_query(vec![key(1)]).expect("queued");
    let _ = r.result(op);
    let Rig { exec, store, .. } = r;
    let report = exec.close(WAIT);
    assert_eq!((report.workers_joined, report.workers_stuck), (3, 0));
    assert!(!report.restart_required);
    assert!(report.results.is_empty());
    assert_eq!(Arc::strong_count(&store), 1, "the executor let go of the store");
}

#[test]
fn refusals_say_what_and_how_much() {
    let cases: [(SubmitRefusal, &str); 4] = [
        (
            SubmitRefusal::QueueFull { kind: OperationKind::Get, queued: 8, depth: 8 },
            "the GET queue holds 8 jobs, its depth is 8",
        ),
        (
            SubmitRefusal::OutstandingFull { outstanding: 4, max: 4 },
            "4 operations are outstanding, operations_outstanding_max is 4",
        ),
        (
            SubmitRefusal::Quarantined { operation: OperationId(3) },
            "op3 left an unretired result: the executor takes no more work until restart",
        ),
        (
            SubmitRefusal::TooManyKeys { keys: 9, max: 8 },
            "a job of 9 keys exceeds keys_per_job_max 8",
        ),
    ];
    for (refusal, text) in cases {
        assert_eq!(refusal.to_string(), text);
    }
}

/// A seeded walk of submissions, cancellations, polls and clock steps against a store that
/// answers at random. Every accepted operation gets exactly one result, ids only increase,
/// the outstanding bound holds at every poll, cancelled results carry no evidence, and only
/// GETs report object failures. A failure names its seed.
#[test]
fn seeded_walk_keeps_the_executor_invariants() {
    for seed in 1..=24_u64 {
        walk(seed);
    }
}

fn walk(seed: u64) {
    let mut rng = gpucache_dataplane::rng::SplitMix64::new(seed);
    let mut next = move |n: u64| rng.below(n);
    let failures_retire = next(2) == 0;
    let mut c = config();
    c.operations_outstanding_max = nz(6);
    c.queue_depth_get = nz(3);
    // Odd seeds let idle workers spin before sleeping, so both ways of waiting are walked.
    c.worker_spin_us = if seed % 2 == 1 { 50 } else { 0 };
    let r = rig_with(c, failures_retire);
    for k in 1..=12_u8 {
        let script = match next(6) {
            0 => Script::Miss(MissReason::Absent),
            1 => Script::Fail(backend(if next(4) == 0 {
                Retirement::Unknown
            } else {
                Retirement::Retired
            })),
            2 => Script::Hit { len: 8 + next(2), fill: k },
            3 => Script::Put(Put::AlreadyCommitted),
            _ => Script::Hit { len: 8, fill: k },
        };
        r.store.script(k, script);
    }
    let mut accepted: Vec<OperationId> = Vec::new();
    let mut results: Vec<OperationResult> = Vec::new();
    let check = |poll: Poll, results: &mut Vec<OperationResult>| {
        let p = poll.pressure;
        let queued = p.query.jobs + p.get.jobs + p.put.jobs;
        assert!(
            queued + p.running_jobs + poll.results.len() as u64 <= 6,
            "seed {seed}: outstanding bound broken: {p:?}"
        );
        results.extend(poll.results);
    };
    for _ in 0..200 {
        match next(10) {
            0..=5 => {
                let n = 1 + next(3);
                let keys: Vec<(PhysicalKey, HostRange)> = (0..n)
                    .map(|i| (key(1 + u8::try_from(next(12)).unwrap_or(0)), slot(i, 8)))
                    .collect();
                let submitted = match next(3) {
                    0 => r.exec.submit_query(keys.into_iter().map(|(k, _)| k).collect()),
                    1 => r.exec.submit_get(keys),
                    _ => r.exec.submit_put(keys),
                };
                if let Ok(op) = submitted {
                    if let Some(last) = accepted.last() {
                        assert!(op > *last, "seed {seed}: {op} after {last}");
                    }
                    accepted.push(op);
                }
            }
            6 => {
                if let Some(op) = accepted.last() {
                    let _ = r.exec.cancel(*op);
                }
            }
            7 => r.clock.advance_ms(next(2 * COOLDOWN_MS)),
            _ => check(r.exec.poll(), &mut results),
        }
    }
    let report = r.exec.close(WAIT);
    assert_eq!(report.workers_stuck, 0, "seed {seed}");
    results.extend(report.results);
    let mut got: Vec<OperationId> = results.iter().map(|r| r.operation).collect();
    got.sort();
    assert_eq!(got, accepted, "seed {seed}: one result per accepted operation");
    for result in &results {
        let record = result.record();
        if result.kind != OperationKind::Get {
            assert!(!record.object_failed.contains(&true), "seed {seed}: {result:?}");
        }
        if result.ending != Ending::Ran {
            assert!(result.retired, "seed {seed}: {result:?}");
            assert!(!record.object_failed.contains(&true), "seed {seed}: {result:?}");
            assert!(!record.key_ok.contains(&true), "seed {seed}: {result:?}");
        }
    }
    assert_eq!(report.restart_required, results.iter().any(|r| !r.retired), "seed {seed}");
}

#[test]
fn jobs_queued_at_quarantine_never_reach_the_store() {
    let mut r = rig_with(config(), false);
    r.store.script(1, Script::Fail(backend(Retirement::Unknown)));
    let gate = r.store.hold();
    let failing = r.exec.submit_get(vec![(key(1), slot(0, 8))]).expect("queued");
    let call = entered(&gate, 1);
    let queued = r.exec.submit_get(vec![(key(2), slot(1, 8))]).expect("queued");
    // Cancelling the running job detaches it; it does not retire it.
    assert_eq!(r.exec.cancel(failing), CancelOutcome::Detached);
    release(&call);
    let result = r.result(failing);
    assert!(result.detached && !result.retired);
    let rejected = r.result(queued);
    assert_eq!(rejected.ending, Ending::Rejected);
    assert!(rejected.retired);
    assert_eq!(r.store.calls(), 1);
    assert_eq!(r.exec.quarantined().len(), 1);
}

#[test]
fn the_executor_can_be_shared_between_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<Executor>();
    shared::<HostBuffer>();
}

#[test]
fn dropping_without_close_stops_the_workers_and_releases_the_store() {
    let mut r = rig();
    let op = r.exec.submit_query(vec![key(1)]).expect("queued");
    let _ = r.result(op);
    let Rig { exec, store, .. } = r;
    drop(exec);
    assert_eq!(Arc::strong_count(&store), 1);
}

/// A store decorator that records which trait methods the executor called and with how many
/// items, then forwards each call to the scripted store.
#[derive(Debug)]
struct Recorder {
    inner: Arc<FakeStore>,
    log: Mutex<Vec<(&'static str, usize)>>,
}

impl Recorder {
    fn note(&self, method: &'static str, items: usize) {
        self.log.lock().expect("log").push((method, items));
    }

    fn take(&self) -> Vec<(&'static str, usize)> {
        std::mem::take(&mut *self.log.lock().expect("log"))
    }
}

impl Store for Recorder {
    fn info(&self) -> StoreInfo {
        self.inner.info()
    }
    fn epoch(&self) -> Epoch {
        self.inner.epoch()
    }
    fn lookup(&self, c: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        self.note("lookup", 1);
        self.inner.lookup(c, key)
    }
    fn get_into(&self, c: &Caller, key: &PhysicalKey, dst: &mut [u8]) -> Result<Get, StoreError> {
        self.note("get_into", 1);
        self.inner.get_into(c, key, dst)
    }
    fn put(
        &self,
        c: &Caller,
        key: &PhysicalKey,
        src: &[u8],
        request: Option<gpucache_dataplane::limits::RequestId>,
    ) -> Result<Put, StoreError> {
        self.note("put", 1);
        self.inner.put(c, key, src, request)
    }
    fn lookup_batch(
        &self,
        c: &Caller,
        keys: &[&PhysicalKey],
    ) -> gpucache_dataplane::store::BatchAnswers<Lookup> {
        self.note("lookup_batch", keys.len());
        self.inner.lookup_batch(c, keys)
    }
    fn get_batch(
        &self,
        c: &Caller,
        items: &mut [gpucache_dataplane::store::BatchGet<'_>],
    ) -> gpucache_dataplane::store::BatchAnswers<Get> {
        self.note("get_batch", items.len());
        self.inner.get_batch(c, items)
    }
    fn put_batch(
        &self,
        c: &Caller,
        items: &[gpucache_dataplane::store::BatchPut<'_>],
    ) -> gpucache_dataplane::store::BatchAnswers<Put> {
        self.note("put_batch", items.len());
        self.inner.put_batch(c, items)
    }
    fn reserve(
        &self,
        c: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<gpucache_dataplane::limits::RequestId>,
    ) -> Result<Reserve, StoreError> {
        self.note("reserve", 1);
        self.inner.reserve(c, key, len, request)
    }
    fn write(&self, c: &Caller, r: &Reservation, at: u64, src: &[u8]) -> Result<(), StoreError> {
        self.note("write", 1);
        self.inner.write(c, r, at, src)
    }
    fn commit(&self, c: &Caller, r: &Reservation) -> Result<Committed, StoreError> {
        self.note("commit", 1);
        self.inner.commit(c, r)
    }
    fn abort(&self, c: &Caller, r: Reservation, outcome: Retirement) -> Result<Abort, StoreError> {
        self.note("abort", 1);
        self.inner.abort(c, r, outcome)
    }
    fn invalidate(&self, c: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        self.note("invalidate", 1);
        self.inner.invalidate(c, key)
    }
    fn expire_leases(&self) -> Result<usize, StoreError> {
        self.inner.expire_leases()
    }
    fn attest_drained(&self, c: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        self.inner.attest_drained(c, region)
    }
    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        self.inner.bump_epoch()
    }
    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        self.inner.reclaim_fenced(epoch)
    }
    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
}

/// An executor over a [`Recorder`] of a fresh scripted store, on 16 slots of 64 bytes.
fn recorded(config: ExecutorConfig) -> (Executor, Arc<Recorder>, Arc<FakeStore>) {
    let inner = FakeStore::new(true);
    let recorder = Arc::new(Recorder { inner: Arc::clone(&inner), log: Mutex::new(Vec::new()) });
    let host = Arc::new(HostBuffer::new(nz(16), nz(64)).expect("host"));
    let exec = Executor::start(
        config,
        Arc::clone(&recorder) as Arc<dyn Store>,
        Caller::new(
            gpucache_dataplane::identity::TenantId::parse("tenant-a").expect("tenant"),
            Rights::ALL,
        ),
        host,
        Arc::new(ManualClock::default()),
    )
    .expect("starts");
    (exec, recorder, inner)
}

/// Waits for `operation`'s result; the tests using it run one operation at a time.
fn finished(exec: &Executor, operation: OperationId) -> OperationResult {
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "no result for {operation}");
        let poll = exec.poll_wait(WAIT);
        if let Some(result) = poll.results.into_iter().find(|r| r.operation == operation) {
            return result;
        }
    }
}

#[test]
fn a_job_reaches_the_store_as_one_batch_call() {
    let (exec, recorder, store) = recorded(config());
    store.script(1, Script::Hit { len: 8, fill: 0x11 });
    store.script(2, Script::Miss(MissReason::Absent));
    store.script(3, Script::Hit { len: 16, fill: 0x33 });
    store.script(4, Script::Put(Put::AlreadyCommitted));

    let query = exec.submit_query(vec![key(1), key(2), key(3)]).expect("queued");
    assert_eq!(
        finished(&exec, query).keys,
        vec![
            KeyResult::Found { len: 8 },
            KeyResult::Failed(KeyFailure::NotFound),
            KeyResult::Found { len: 16 }
        ]
    );
    assert_eq!(recorder.take(), vec![("lookup_batch", 3)]);

    // Three destinations in one slot and one in another: one call, each key's bytes in place.
    let reads = vec![
        (key(3), HostRange::new(16, 16)),
        (key(1), slot(0, 8)),
        (key(2), HostRange::new(40, 8)),
        (key(1), slot(5, 8)),
    ];
    let get = exec.submit_get(reads).expect("queued");
    assert_eq!(
        finished(&exec, get).keys,
        vec![
            KeyResult::Read { bytes: 16 },
            KeyResult::Read { bytes: 8 },
            KeyResult::ObjectFailed(MissReason::Absent),
            KeyResult::Read { bytes: 8 },
        ]
    );
    assert_eq!(recorder.take(), vec![("get_batch", 4)]);
    let host = exec.host();
    assert_eq!(
        host.read(HostRange::new(0, 48)).expect("range"),
        [vec![0x11; 8], vec![0; 8], vec![0x33; 16], vec![0; 16]].concat()
    );
    assert_eq!(host.read(slot(5, 8)).expect("range"), vec![0x11; 8]);

    let writes = vec![(key(1), slot(1, 8)), (key(4), HostRange::new(72, 8)), (key(5), slot(2, 24))];
    let put = exec.submit_put(writes).expect("queued");
    assert_eq!(
        finished(&exec, put).keys,
        vec![
            KeyResult::Written { bytes: 8 },
            KeyResult::AlreadyStored,
            KeyResult::Written { bytes: 24 }
        ]
    );
    assert_eq!(recorder.take(), vec![("put_batch", 3)]);
    // The scripted store saw every key; the executor made one store call per job.
    assert_eq!(store.calls(), 3 + 4 + 3);
    assert_eq!(exec.counters().backend_calls, 3);
}

#[test]
fn a_large_job_goes_out_in_bounded_calls_until_an_outage() {
    let mut c = config();
    c.batch_keys_max = nz(3);
    let (exec, recorder, store) = recorded(c);
    for k in 1..=8 {
        store.script(k, Script::Hit { len: 8, fill: k });
    }
    let reads: Vec<(PhysicalKey, HostRange)> =
        (1..=8).map(|k| (key(k), slot(u64::from(k), 8))).collect();
    let get = exec.submit_get(reads.clone()).expect("queued");
    assert!(finished(&exec, get).keys.iter().all(|k| *k == KeyResult::Read { bytes: 8 }));
    assert_eq!(recorder.take(), vec![("get_batch", 3), ("get_batch", 3), ("get_batch", 2)]);
    assert_eq!(exec.counters().backend_calls, 3);

    // An outage in the second call: the third is not made, its keys are not attempted.
    store.script(5, Script::Fail(backend(Retirement::Retired)));
    let get = exec.submit_get(reads).expect("queued");
    let keys = finished(&exec, get).keys;
    assert_eq!(keys[4], KeyResult::Failed(KeyFailure::Store(backend(Retirement::Retired))));
    assert!(keys[..4].iter().chain(&keys[5..6]).all(|k| *k == KeyResult::Read { bytes: 8 }));
    assert_eq!(
        keys[6..],
        [KeyResult::Failed(KeyFailure::NotAttempted), KeyResult::Failed(KeyFailure::NotAttempted)]
    );
    assert_eq!(recorder.take(), vec![("get_batch", 3), ("get_batch", 3)]);
    assert_eq!(exec.counters().backend_calls, 5);
    assert_eq!(store.calls(), 8 + 6);
}

#[test]
fn overlapping_get_destinations_are_written_in_key_order() {
    let (exec, recorder, store) = recorded(config());
    store.script(1, Script::Hit { len: 8, fill: 1 });
    store.script(2, Script::Hit { len: 8, fill: 2 });
    store.script(3, Script::Hit { len: 8, fill: 3 });
    // Key 2's range overlaps key 1's, key 3's overlaps key 2's: each starts a new call, and the
    // later key's bytes win where they overlap, as when every key was its own call.
    let reads = vec![
        (key(1), HostRange::new(0, 8)),
        (key(2), HostRange::new(4, 8)),
        (key(4), slot(3, 8)),
        (key(3), HostRange::new(10, 8)),
    ];
    let get = exec.submit_get(reads).expect("queued");
    let result = finished(&exec, get);
    assert_eq!(result.keys[2], KeyResult::ObjectFailed(MissReason::Absent));
    assert_eq!(recorder.take(), vec![("get_batch", 1), ("get_batch", 2), ("get_batch", 1)]);
    assert_eq!(
        exec.host().read(HostRange::new(0, 20)).expect("range"),
        [vec![1; 4], vec![2; 6], vec![3; 8], vec![0; 2]].concat()
    );
    // The same ranges as sources of a PUT are only read: one call.
    let writes = vec![(key(5), HostRange::new(0, 8)), (key(6), HostRange::new(4, 8))];
    let put = exec.submit_put(writes).expect("queued");
    assert!(finished(&exec, put).keys.iter().all(|k| *k == KeyResult::Written { bytes: 8 }));
    assert_eq!(recorder.take(), vec![("put_batch", 2)]);
}
