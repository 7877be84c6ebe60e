//! The executor core: bounded QUERY, GET and PUT queues, their worker threads, cancellation,
//! completion polling with the pressure snapshot, the store-result contract and quarantine.
//!
//! Submission never blocks: it either queues an immutable job under a fresh [`OperationId`] or
//! returns a [`SubmitRefusal`]. Workers are the only threads that call the store; `poll` only
//! moves finished results out under the state lock. Every job, queued, running or finished and
//! undelivered, counts against `operations_outstanding_max`.
//!
//! A job reaches the store as batch calls (`lookup_batch`, `get_batch`, `put_batch`): one per
//! [`ExecutorConfig::batch_keys_max`] keys, in key order, and for a GET a new call wherever a
//! key's Host range overlaps one already in the call, so that overlapping destinations are
//! still written in key order. Once a call's answers count as an outage, the job's later calls
//! are not made and their keys are reported [`KeyFailure::NotAttempted`].
//!
//! Lock order: the state lock may be held while asking the health monitor for an admission;
//! nothing takes the state lock while holding the monitor's. No lock is held across a store
//! call except the Host slots the call reads or writes, taken in slot order.
//!
//! The core never decides publication, negative metadata or admission credits, and registers no
//! metrics; it reports facts for the owner to act on.

use std::collections::{BTreeMap, VecDeque};
use std::num::{NonZeroU64, NonZeroUsize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::agreement::{OperationId, OperationKind};
use super::health::{Admission, BackendOutcome, HealthMonitor, HealthSnapshot};
use super::host::{HostBuffer, HostRange};
use super::job::{
    CancelOutcome, CloseReport, Ending, ExecutorCounters, KeyFailure, KeyResult, OperationResult,
    Poll, PressureSnapshot, QuarantinedOperation, QueueLoad, SubmitRefusal,
};
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{
    BatchAnswers, BatchGet, BatchPut, Get, Lookup, MissReason, Put, Retirement, Store, StoreError,
};

/// How long an idle worker waits for work before it looks at the state again. Only bounds the
/// wait; work and shutdown wake workers at once.
const WORKER_IDLE_WAIT: Duration = Duration::from_millis(100);

/// How long dropping an executor that was never closed waits for its workers.
const DROP_JOIN_DEADLINE: Duration = Duration::from_secs(1);

/// The default of [`ExecutorConfig::batch_keys_max`]: most keys of a job sent to the store in
/// one batch call.
pub const EXECUTOR_BATCH_KEYS_MAX: usize = 256;

/// The executor's limits and worker counts. Every queue and table is bounded by one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutorConfig {
    pub queue_depth_query: NonZeroUsize,
    pub queue_depth_get: NonZeroUsize,
    pub queue_depth_put: NonZeroUsize,
    pub workers_query: NonZeroUsize,
    pub workers_get: NonZeroUsize,
    pub workers_put: NonZeroUsize,
    /// Queued jobs, running jobs and undelivered results together.
    pub operations_outstanding_max: NonZeroUsize,
    /// Most keys in one job.
    pub keys_per_job_max: NonZeroUsize,
    /// Most keys in one batch call to the store. A job of more keys goes out as several calls,
    /// in key order; after a call whose answers count as an outage the rest are not sent.
    pub batch_keys_max: NonZeroUsize,
    /// The health monitor's cooldown after an outage.
    pub cooldown_ms: NonZeroU64,
    /// How long an idle worker keeps polling its queue before it sleeps on the condvar; zero
    /// sleeps at once. Spinning saves the wake-up of a sleeping thread on each job (tens of
    /// microseconds) at the price of a busy core while the lane is idle.
    pub worker_spin_us: u32,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        let n = |v: usize| NonZeroUsize::new(v).unwrap_or(NonZeroUsize::MIN);
        Self {
            queue_depth_query: n(256),
            queue_depth_get: n(256),
            queue_depth_put: n(256),
            workers_query: n(1),
            workers_get: n(2),
            workers_put: n(2),
            operations_outstanding_max: n(1024),
            keys_per_job_max: n(4096),
            batch_keys_max: n(EXECUTOR_BATCH_KEYS_MAX),
            cooldown_ms: NonZeroU64::new(5_000).unwrap_or(NonZeroU64::MIN),
            worker_spin_us: 0,
        }
    }
}

/// Why the executor could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecutorError {
    #[error("could not start a {kind} worker: {source}")]
    Spawn { kind: OperationKind, source: std::io::Error },
}

const KINDS: [OperationKind; 3] = [OperationKind::Query, OperationKind::Get, OperationKind::Put];

fn lane(kind: OperationKind) -> usize {
    match kind {
        OperationKind::Query => 0,
        OperationKind::Get => 1,
        OperationKind::Put => 2,
    }
}

/// An immutable job: what a worker needs, fixed at submission.
#[derive(Debug)]
struct Job {
    operation: OperationId,
    kind: OperationKind,
    keys: Vec<PhysicalKey>,
    /// One per key for GET and PUT; empty for QUERY.
    ranges: Vec<HostRange>,
    admission: Admission,
    payload_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queued,
    Running { detached: bool },
}

/// Bookkeeping of a queued or running job, for pressure and cancellation.
#[derive(Debug)]
struct Active {
    kind: OperationKind,
    submitted_ms: u64,
    phase: Phase,
}

#[derive(Debug)]
struct State {
    next_operation: u64,
    queues: [VecDeque<Job>; 3],
    queued_bytes: [u64; 3],
    /// Queued and running jobs by id; ids increase with submission time, so the first entry is
    /// the oldest.
    active: BTreeMap<OperationId, Active>,
    running: usize,
    results: VecDeque<OperationResult>,
    counters: ExecutorCounters,
    quarantined: Vec<QuarantinedOperation>,
    closing: bool,
    workers_alive: usize,
    /// Per lane, workers waiting on the lane's condvar.
    sleeping: [usize; 3],
    /// Per worker, in start order: it has left its loop and only has to return.
    workers_exited: Vec<bool>,
}

impl State {
    fn outstanding(&self) -> usize {
        self.queues.iter().map(VecDeque::len).sum::<usize>() + self.running + self.results.len()
    }

    fn pressure(&self, now_ms: u64) -> PressureSnapshot {
        let load = |i: usize| QueueLoad {
            jobs: self.queues[i].len() as u64,
            payload_bytes: self.queued_bytes[i],
        };
        PressureSnapshot {
            query: load(0),
            get: load(1),
            put: load(2),
            running_jobs: self.running as u64,
            undelivered_results: self.results.len() as u64,
            oldest_job_age_ms: self
                .active
                .values()
                .next()
                .map_or(0, |a| now_ms.saturating_sub(a.submitted_ms)),
        }
    }
}

struct Shared {
    config: ExecutorConfig,
    store: Arc<dyn Store>,
    failures_retire: bool,
    caller: Caller,
    host: Arc<HostBuffer>,
    clock: Arc<dyn Clock>,
    health: HealthMonitor,
    state: Mutex<State>,
    /// One per lane: work queued, or shutdown.
    work: [Condvar; 3],
    /// Per lane, how many jobs are queued: read without the lock by spinning workers only.
    queued_hint: [AtomicUsize; 3],
    /// A result was pushed, or a worker exited.
    changed: Condvar,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("config", &self.config).finish_non_exhaustive()
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Every critical section finishes its state change without calling anything that panics.
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The asynchronous L3 executor. See the module documentation.
#[derive(Debug)]
pub struct Executor {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    closed: bool,
}

impl Executor {
    /// Starts the workers. The executor uses `store` as `caller` and moves bytes only within
    /// `host`.
    pub fn start(
        config: ExecutorConfig,
        store: Arc<dyn Store>,
        caller: Caller,
        host: Arc<HostBuffer>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, ExecutorError> {
        let failures_retire = store.failures_retire();
        let health = HealthMonitor::new(config.cooldown_ms, Arc::clone(&clock));
        let shared = Arc::new(Shared {
            failures_retire,
            store,
            caller,
            host,
            clock,
            health,
            state: Mutex::new(State {
                next_operation: 1,
                queues: [VecDeque::new(), VecDeque::new(), VecDeque::new()],
                queued_bytes: [0; 3],
                active: BTreeMap::new(),
                running: 0,
                results: VecDeque::new(),
                counters: ExecutorCounters::default(),
                quarantined: Vec::new(),
                closing: false,
                workers_alive: 0,
                workers_exited: Vec::new(),
                sleeping: [0; 3],
            }),
            work: [Condvar::new(), Condvar::new(), Condvar::new()],
            queued_hint: [AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)],
            changed: Condvar::new(),
            config,
        });
        let mut executor = Self { shared, workers: Vec::new(), closed: false };
        for kind in KINDS {
            let count = match kind {
                OperationKind::Query => executor.shared.config.workers_query,
                OperationKind::Get => executor.shared.config.workers_get,
                OperationKind::Put => executor.shared.config.workers_put,
            };
            for i in 0..count.get() {
                let shared = Arc::clone(&executor.shared);
                let index = {
                    let mut state = lock(&shared.state);
                    state.workers_alive += 1;
                    state.workers_exited.push(false);
                    state.workers_exited.len() - 1
                };
                let spawned = std::thread::Builder::new()
                    .name(format!("l3-{}-{i}", kind.to_string().to_lowercase()))
                    .spawn(move || worker(&shared, kind, index));
                match spawned {
                    Ok(handle) => executor.workers.push(handle),
                    Err(source) => {
                        let mut state = lock(&executor.shared.state);
                        state.workers_alive -= 1;
                        // That worker never existed: drop its slot so slots match the handles.
                        state.workers_exited.pop();
                        // Dropping the executor closes the workers already started.
                        return Err(ExecutorError::Spawn { kind, source });
                    }
                }
            }
        }
        Ok(executor)
    }

    /// The configuration the executor runs with.
    pub fn config(&self) -> &ExecutorConfig {
        &self.shared.config
    }

    /// The Host allocation jobs address.
    pub fn host(&self) -> &Arc<HostBuffer> {
        &self.shared.host
    }

    /// Queues a QUERY of `keys`.
    pub fn submit_query(&self, keys: Vec<PhysicalKey>) -> Result<OperationId, SubmitRefusal> {
        self.submit(OperationKind::Query, keys, Vec::new())
    }

    /// Queues a GET of each key into its Host range; a key succeeds only if exactly the
    /// range's byte count is read.
    pub fn submit_get(
        &self,
        reads: Vec<(PhysicalKey, HostRange)>,
    ) -> Result<OperationId, SubmitRefusal> {
        let (keys, ranges) = reads.into_iter().unzip();
        self.submit(OperationKind::Get, keys, ranges)
    }

    /// Queues a create-only PUT of each key from its Host range.
    pub fn submit_put(
        &self,
        writes: Vec<(PhysicalKey, HostRange)>,
    ) -> Result<OperationId, SubmitRefusal> {
        let (keys, ranges) = writes.into_iter().unzip();
        self.submit(OperationKind::Put, keys, ranges)
    }

    fn submit(
        &self,
        kind: OperationKind,
        keys: Vec<PhysicalKey>,
        ranges: Vec<HostRange>,
    ) -> Result<OperationId, SubmitRefusal> {
        let config = &self.shared.config;
        if keys.is_empty() {
            return Err(SubmitRefusal::NoKeys);
        }
        if keys.len() > config.keys_per_job_max.get() {
            return Err(SubmitRefusal::TooManyKeys {
                keys: keys.len(),
                max: config.keys_per_job_max.get(),
            });
        }
        let mut payload_bytes = 0_u64;
        for (index, range) in ranges.iter().enumerate() {
            self.shared
                .host
                .check(*range)
                .map_err(|error| SubmitRefusal::BadRange { index, error })?;
            payload_bytes = payload_bytes.saturating_add(range.len);
        }
        let now_ms = self.shared.clock.now_ms();
        let l = lane(kind);
        let mut state = lock(&self.shared.state);
        if state.closing {
            return Err(SubmitRefusal::Closed);
        }
        if let Some(q) = state.quarantined.first() {
            return Err(SubmitRefusal::Quarantined { operation: q.operation });
        }
        let depth = match kind {
            OperationKind::Query => config.queue_depth_query,
            OperationKind::Get => config.queue_depth_get,
            OperationKind::Put => config.queue_depth_put,
        };
        if state.queues[l].len() >= depth.get() {
            return Err(SubmitRefusal::QueueFull {
                kind,
                queued: state.queues[l].len(),
                depth: depth.get(),
            });
        }
        let outstanding = state.outstanding();
        if outstanding >= config.operations_outstanding_max.get() {
            return Err(SubmitRefusal::OutstandingFull {
                outstanding,
                max: config.operations_outstanding_max.get(),
            });
        }
        // Asked last, so that an admission (possibly the recovery probe) is only taken by a job
        // that is certainly queued.
        let admission = self.shared.health.admit()?;
        let operation = OperationId(state.next_operation);
        state.next_operation += 1;
        state.active.insert(operation, Active { kind, submitted_ms: now_ms, phase: Phase::Queued });
        state.queued_bytes[l] += payload_bytes;
        state.queues[l].push_back(Job { operation, kind, keys, ranges, admission, payload_bytes });
        self.shared.queued_hint[l].store(state.queues[l].len(), Ordering::Release);
        let wake = state.sleeping[l] > 0;
        drop(state);
        // A worker that is awake (spinning, or about to look at the queue) needs no wake-up.
        if wake {
            self.shared.work[l].notify_one();
        }
        Ok(operation)
    }

    /// Cancels `operation`. A queued job becomes inert at once and its cancelled result is
    /// queued for the next poll; a running job is only marked detached.
    pub fn cancel(&self, operation: OperationId) -> CancelOutcome {
        let mut state = lock(&self.shared.state);
        let Some(active) = state.active.get_mut(&operation) else {
            return CancelOutcome::NotOutstanding;
        };
        match active.phase {
            Phase::Running { .. } => {
                active.phase = Phase::Running { detached: true };
                CancelOutcome::Detached
            }
            Phase::Queued => {
                let l = lane(active.kind);
                let position = state.queues[l].iter().position(|j| j.operation == operation);
                let Some(job) = position.and_then(|p| state.queues[l].remove(p)) else {
                    return CancelOutcome::NotOutstanding;
                };
                self.shared.queued_hint[l].store(state.queues[l].len(), Ordering::Release);
                state.active.remove(&operation);
                state.queued_bytes[l] -= job.payload_bytes;
                let admission = finish_unattempted(&mut state, job, Ending::Cancelled);
                drop(state);
                self.shared.changed.notify_all();
                self.shared.health.report(admission, BackendOutcome::NotAttempted);
                CancelOutcome::Cancelled
            }
        }
    }

    /// Takes every finished result and, under the same lock, the pressure snapshot. Never
    /// calls the store.
    pub fn poll(&self) -> Poll {
        let now_ms = self.shared.clock.now_ms();
        let mut state = lock(&self.shared.state);
        let results: Vec<OperationResult> = state.results.drain(..).collect();
        Poll { results, pressure: state.pressure(now_ms) }
    }

    /// Like [`poll`](Self::poll), but first waits up to `timeout` for at least one result.
    pub fn poll_wait(&self, timeout: Duration) -> Poll {
        self.wait_results(1, timeout);
        self.poll()
    }

    /// Waits up to `timeout` until at least `count` results are undelivered, without taking
    /// them; returns how many there are.
    fn wait_results(&self, count: usize, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.shared.state);
        while state.results.len() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        state.results.len()
    }

    #[cfg(all(test, not(loom)))]
    pub(crate) fn wait_undelivered(&self, count: usize, timeout: Duration) -> usize {
        self.wait_results(count, timeout)
    }

    /// The pressure snapshot alone.
    pub fn pressure(&self) -> PressureSnapshot {
        let now_ms = self.shared.clock.now_ms();
        lock(&self.shared.state).pressure(now_ms)
    }

    /// The health monitor's state and epoch; reading never takes the probe.
    pub fn health(&self) -> HealthSnapshot {
        self.shared.health.snapshot()
    }

    /// Cumulative counters.
    pub fn counters(&self) -> ExecutorCounters {
        lock(&self.shared.state).counters
    }

    /// Operations whose results were unretired; non-empty means the executor takes no more
    /// work.
    pub fn quarantined(&self) -> Vec<QuarantinedOperation> {
        lock(&self.shared.state).quarantined.clone()
    }

    /// Refuses new work, drops queued jobs (their results say shutdown), waits up to
    /// `join_deadline` for the workers, and joins those that exited. If a worker is still in a
    /// store call, or any result was unretired, the store and the Host allocation are kept for
    /// the life of the process and the report says a restart is required.
    pub fn close(mut self, join_deadline: Duration) -> CloseReport {
        self.shutdown(join_deadline)
    }

    fn shutdown(&mut self, join_deadline: Duration) -> CloseReport {
        self.closed = true;
        let deadline = Instant::now() + join_deadline;
        let mut admissions = Vec::new();
        let mut state = lock(&self.shared.state);
        state.closing = true;
        for l in 0..KINDS.len() {
            self.shared.queued_hint[l].store(0, Ordering::Release);
            while let Some(job) = state.queues[l].pop_front() {
                state.active.remove(&job.operation);
                state.queued_bytes[l] -= job.payload_bytes;
                admissions.push(finish_unattempted(&mut state, job, Ending::Shutdown));
            }
        }
        drop(state);
        for admission in admissions {
            self.shared.health.report(admission, BackendOutcome::NotAttempted);
        }
        for condvar in &self.shared.work {
            condvar.notify_all();
        }
        let mut state = lock(&self.shared.state);
        while state.workers_alive > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let workers_stuck = state.workers_alive;
        let results: Vec<OperationResult> = state.results.drain(..).collect();
        let quarantined = state.quarantined.clone();
        let exited = state.workers_exited.clone();
        drop(state);
        let mut workers_joined = 0;
        for (index, handle) in std::mem::take(&mut self.workers).into_iter().enumerate() {
            if exited.get(index).copied().unwrap_or(false) {
                // The worker has left its loop and only returns, so this join is immediate.
                let _ = handle.join();
                workers_joined += 1;
            }
            // Any other handle is dropped, which detaches its thread: it keeps its own
            // references to the store and the Host allocation until its call returns.
        }
        let restart_required = workers_stuck > 0 || !quarantined.is_empty();
        if restart_required {
            // Native retirement is unknown: never close the store or release the Host
            // allocation. Leaking one reference keeps both for the process.
            std::mem::forget(Arc::clone(&self.shared));
        }
        CloseReport { workers_joined, workers_stuck, results, quarantined, restart_required }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        if !self.closed {
            // Dropped without close(): stop the workers, waiting briefly; the report is lost,
            // but unknown retirement still keeps the store alive.
            let _ = self.shutdown(DROP_JOIN_DEADLINE);
        }
    }
}

/// Completes a job that never reached the store; returns its admission for a `NotAttempted`
/// report outside the lock.
fn finish_unattempted(state: &mut State, job: Job, ending: Ending) -> Admission {
    state.results.push_back(OperationResult {
        operation: job.operation,
        kind: job.kind,
        ending,
        keys: vec![KeyResult::Failed(KeyFailure::NotAttempted); job.keys.len()],
        retired: true,
        detached: false,
    });
    job.admission
}

/// One worker: takes jobs of its lane until shutdown.
fn worker(shared: &Shared, kind: OperationKind, index: usize) {
    let l = lane(kind);
    loop {
        let mut state = lock(&shared.state);
        let mut spun = false;
        let job = loop {
            if state.closing {
                break None;
            }
            if let Some(job) = state.queues[l].pop_front() {
                shared.queued_hint[l].store(state.queues[l].len(), Ordering::Release);
                break Some(job);
            }
            if !spun && shared.config.worker_spin_us > 0 {
                spun = true;
                drop(state);
                spin_for_work(&shared.queued_hint[l], shared.config.worker_spin_us);
                state = lock(&shared.state);
                continue;
            }
            state.sleeping[l] += 1;
            state = shared.work[l]
                .wait_timeout(state, WORKER_IDLE_WAIT)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.sleeping[l] -= 1;
            spun = false;
        };
        let Some(job) = job else {
            state.workers_alive -= 1;
            if let Some(exited) = state.workers_exited.get_mut(index) {
                *exited = true;
            }
            drop(state);
            shared.changed.notify_all();
            return;
        };
        state.queued_bytes[l] -= job.payload_bytes;
        // A job admitted before the newest outage, or queued when the executor was quarantined,
        // does not reach the store.
        let stale = shared.health.snapshot().epoch != job.admission.epoch();
        if stale || !state.quarantined.is_empty() {
            state.active.remove(&job.operation);
            let admission = finish_unattempted(&mut state, job, Ending::Rejected);
            drop(state);
            shared.health.report(admission, BackendOutcome::NotAttempted);
            shared.changed.notify_all();
            continue;
        }
        let started_ms = shared.clock.now_ms();
        let mut queued_ms = 0;
        if let Some(a) = state.active.get_mut(&job.operation) {
            a.phase = Phase::Running { detached: false };
            queued_ms = started_ms.saturating_sub(a.submitted_ms);
        }
        state.running += 1;
        drop(state);

        let ran = run(shared, &job);
        let backend_ms = shared.clock.now_ms().saturating_sub(started_ms);
        let payload_bytes = job.payload_bytes;
        // Health first, so that whoever sees the result also sees its effect on health.
        let Job { operation, kind, ranges, admission, .. } = job;
        shared.health.report(admission, ran.outcome);

        // One critical section takes the job off the running count and queues its result, so
        // the outstanding count never dips in between.
        let mut state = lock(&shared.state);
        state.running -= 1;
        let detached = matches!(
            state.active.remove(&operation).map(|a| a.phase),
            Some(Phase::Running { detached: true })
        );
        state.counters.backend_calls += ran.calls;
        let totals = state.counters.of_mut(kind);
        totals.completed_jobs += 1;
        totals.completed_payload_bytes += payload_bytes;
        totals.queued_ms += queued_ms;
        totals.backend_ms += backend_ms;
        for key in &ran.keys {
            match key {
                KeyResult::Found { .. } => state.counters.query_keys_found += 1,
                KeyResult::Read { bytes } => {
                    state.counters.get_keys_read += 1;
                    state.counters.get_bytes_read += bytes;
                }
                KeyResult::Written { bytes } => {
                    state.counters.put_new_writes += 1;
                    state.counters.put_new_bytes += bytes;
                }
                KeyResult::AlreadyStored => state.counters.put_already_stored += 1,
                KeyResult::ObjectFailed(_) | KeyResult::Failed(_) => {}
            }
        }
        if !ran.retired {
            state.counters.unretired_operations += 1;
            state.quarantined.push(QuarantinedOperation { operation, kind, ranges });
        }
        state.results.push_back(OperationResult {
            operation,
            kind,
            ending: Ending::Ran,
            keys: ran.keys,
            retired: ran.retired,
            detached,
        });
        drop(state);
        shared.changed.notify_all();
    }
}

/// Polls `queued` for up to `spin_us` microseconds; returns as soon as work shows up.
fn spin_for_work(queued: &AtomicUsize, spin_us: u32) {
    let deadline = Instant::now() + Duration::from_micros(u64::from(spin_us));
    while queued.load(Ordering::Acquire) == 0 && Instant::now() < deadline {
        std::hint::spin_loop();
    }
}

/// What running one job against the store produced.
#[derive(Debug)]
struct Ran {
    keys: Vec<KeyResult>,
    retired: bool,
    outcome: BackendOutcome,
    calls: u64,
}

/// One key's answer with its retirement and health meaning.
#[derive(Debug)]
struct KeyAnswer {
    result: KeyResult,
    retired: bool,
    outcome: BackendOutcome,
}

/// How much an outcome matters when a job's keys are summed up into one report: outages
/// first, unknown retirement above all.
fn severity(outcome: BackendOutcome) -> u8 {
    match outcome {
        BackendOutcome::UnknownNativeFailure => 4,
        BackendOutcome::UnretiredPutFailure => 3,
        BackendOutcome::BackendError => 2,
        BackendOutcome::NotAttempted => 0,
        _ => 1,
    }
}

/// Keys of one job that go to the store in one batch call, with their Host ranges (none for a
/// QUERY).
#[derive(Debug, Default)]
struct Call<'a> {
    /// Each key's position in the job.
    index: Vec<usize>,
    keys: Vec<&'a PhysicalKey>,
    ranges: Vec<HostRange>,
    /// For a GET: the call's ranges by offset, to tell whether another one overlaps them.
    spans: BTreeMap<u64, u64>,
}

impl Call<'_> {
    /// Whether `range` overlaps a range already in the call. The spans are disjoint, so the
    /// last one starting before `range` ends is the only one that can reach into it.
    fn overlaps(&self, range: HostRange) -> bool {
        let end = range.offset.saturating_add(range.len);
        self.spans.range(..end).next_back().is_some_and(|(_, e)| *e > range.offset)
    }
}

/// Splits a job's keys into its batch calls, in key order. A key whose range is missing or
/// unusable is in no call: it stays `NotAttempted`. A call holds at most `batch_keys_max` keys,
/// and a GET's call never holds two overlapping destinations.
fn plan<'a>(shared: &Shared, job: &'a Job) -> Vec<Call<'a>> {
    let limit = shared.config.batch_keys_max.get();
    let mut calls: Vec<Call<'a>> = Vec::new();
    let mut current = Call::default();
    for (i, key) in job.keys.iter().enumerate() {
        let range = match job.kind {
            OperationKind::Query => None,
            OperationKind::Get | OperationKind::Put => {
                match job.ranges.get(i).copied().filter(|r| shared.host.check(*r).is_ok()) {
                    Some(range) => Some(range),
                    // Checked at submission; never sent.
                    None => continue,
                }
            }
        };
        let overlaps = job.kind == OperationKind::Get && range.is_some_and(|r| current.overlaps(r));
        if current.keys.len() >= limit || overlaps {
            calls.push(std::mem::take(&mut current));
        }
        current.index.push(i);
        current.keys.push(key);
        if let Some(range) = range {
            current.ranges.push(range);
            if job.kind == OperationKind::Get {
                current.spans.insert(range.offset, range.offset.saturating_add(range.len));
            }
        }
    }
    if !current.keys.is_empty() {
        calls.push(current);
    }
    calls
}

fn run(shared: &Shared, job: &Job) -> Ran {
    let mut keys = vec![KeyResult::Failed(KeyFailure::NotAttempted); job.keys.len()];
    let mut retired = true;
    let mut outcome = BackendOutcome::Succeeded;
    let mut calls = 0;
    for call in plan(shared, job) {
        if outcome.counts_as_outage() {
            // The backend just failed: the job's later calls are not made.
            break;
        }
        let (answers, called) = match job.kind {
            OperationKind::Query => (query_call(shared, &call), true),
            OperationKind::Get => get_call(shared, &call),
            OperationKind::Put => put_call(shared, &call),
        };
        calls += u64::from(called);
        for (i, answer) in call.index.iter().zip(answers) {
            retired &= answer.retired;
            if severity(answer.outcome) > severity(outcome) {
                outcome = answer.outcome;
            }
            if let Some(slot) = keys.get_mut(*i) {
                *slot = answer.result;
            }
        }
    }
    Ran { keys, retired, outcome, calls }
}

/// A batch call's answers, exactly one per item. A store that answered another number of items
/// than it was given has said nothing reliable about any of them: every item then fails with a
/// backend error whose retirement is unknown.
fn one_per_item<T>(
    answers: BatchAnswers<T>,
    items: usize,
    operation: &'static str,
) -> BatchAnswers<T> {
    if answers.len() == items {
        return answers;
    }
    let detail = format!("the store answered {} items of {items}", answers.len());
    let failure = StoreError::Backend { operation, detail, retirement: Retirement::Unknown };
    (0..items).map(|_| Err(failure.clone())).collect()
}

/// Whether a failed call has stopped touching the caller's buffers: always when the store
/// guarantees it, otherwise as the error says.
fn failure_retired(shared: &Shared, error: &StoreError) -> bool {
    shared.failures_retire || error.retirement() == Retirement::Retired
}

fn query_call(shared: &Shared, call: &Call<'_>) -> Vec<KeyAnswer> {
    let answers = shared.store.lookup_batch(&shared.caller, &call.keys);
    one_per_item(answers, call.keys.len(), "lookup_batch").into_iter().map(query_answer).collect()
}

fn query_answer(answer: Result<Lookup, StoreError>) -> KeyAnswer {
    let (result, outcome) = match answer {
        Ok(Lookup::Hit { len }) => (KeyResult::Found { len }, BackendOutcome::Succeeded),
        Ok(Lookup::PrefixHit { .. } | Lookup::Miss(_)) => {
            (KeyResult::Failed(KeyFailure::NotFound), BackendOutcome::ExistenceMiss)
        }
        Err(e) => {
            let outcome = BackendOutcome::from_store_error(&e);
            (KeyResult::Failed(KeyFailure::Store(e)), outcome)
        }
    };
    // A QUERY is handed no Host payload, so even its failures retain nothing.
    KeyAnswer { result, retired: true, outcome }
}

/// Reads every key of `call` into its range in one `get_batch`, holding the ranges' slots; says
/// whether the store was called.
fn get_call(shared: &Shared, call: &Call<'_>) -> (Vec<KeyAnswer>, bool) {
    let called = shared.host.with_ranges_mut(&call.ranges, |dsts| {
        let mut items: Vec<BatchGet<'_>> =
            call.keys.iter().zip(dsts).map(|(key, dst)| BatchGet { key, dst }).collect();
        shared.store.get_batch(&shared.caller, &mut items)
    });
    let Ok(answers) = called else {
        // Checked before planning; the store was not called.
        return (call.keys.iter().map(|_| not_attempted()).collect(), false);
    };
    let answers = one_per_item(answers, call.keys.len(), "get_batch");
    let keys = answers.into_iter().zip(&call.ranges).map(|(a, r)| get_answer(shared, *r, a));
    (keys.collect(), true)
}

fn get_answer(shared: &Shared, range: HostRange, answer: Result<Get, StoreError>) -> KeyAnswer {
    match answer {
        Ok(Get::Hit { len, .. }) if len == range.len => KeyAnswer {
            result: KeyResult::Read { bytes: len },
            retired: true,
            outcome: BackendOutcome::Succeeded,
        },
        Ok(Get::Hit { len, .. }) if len < range.len => KeyAnswer {
            result: KeyResult::Failed(KeyFailure::ShortRead { expected: range.len, got: len }),
            retired: true,
            outcome: BackendOutcome::RetiredGetMiss,
        },
        Ok(Get::Hit { len, .. }) => {
            // More bytes than the destination holds: the result is malformed, and only the
            // store's failure guarantee can say the call retired.
            let retired = shared.failures_retire;
            KeyAnswer {
                result: KeyResult::Failed(KeyFailure::Malformed {
                    expected: range.len,
                    reported: len,
                }),
                retired,
                outcome: if retired {
                    BackendOutcome::BackendError
                } else {
                    BackendOutcome::UnknownNativeFailure
                },
            }
        }
        Ok(Get::Miss(reason @ (MissReason::Absent | MissReason::Incompatible))) => KeyAnswer {
            result: KeyResult::ObjectFailed(reason),
            retired: true,
            outcome: BackendOutcome::ExistenceMiss,
        },
        Ok(Get::Miss(MissReason::Corrupt)) => KeyAnswer {
            result: KeyResult::ObjectFailed(MissReason::Corrupt),
            retired: true,
            outcome: BackendOutcome::RetiredGetMiss,
        },
        Ok(Get::Miss(MissReason::NotReadable(_))) => KeyAnswer {
            result: KeyResult::Failed(KeyFailure::NotReadable),
            retired: true,
            outcome: BackendOutcome::ExistenceMiss,
        },
        Err(e) => {
            let retired = failure_retired(shared, &e);
            let outcome = if retired {
                BackendOutcome::from_store_error(&e)
            } else {
                BackendOutcome::UnknownNativeFailure
            };
            KeyAnswer { result: KeyResult::Failed(KeyFailure::Store(e)), retired, outcome }
        }
    }
}

/// Writes every key of `call` from its range in one `put_batch`, holding the ranges' slots;
/// says whether the store was called.
fn put_call(shared: &Shared, call: &Call<'_>) -> (Vec<KeyAnswer>, bool) {
    let called = shared.host.with_ranges(&call.ranges, |srcs| {
        let items: Vec<BatchPut<'_>> = call
            .keys
            .iter()
            .zip(srcs)
            .map(|(key, src)| BatchPut { key, src, request: None })
            .collect();
        shared.store.put_batch(&shared.caller, &items)
    });
    let Ok(answers) = called else {
        return (call.keys.iter().map(|_| not_attempted()).collect(), false);
    };
    let answers = one_per_item(answers, call.keys.len(), "put_batch");
    let keys = answers.into_iter().zip(&call.ranges).map(|(a, r)| put_answer(shared, *r, a));
    (keys.collect(), true)
}

fn put_answer(shared: &Shared, range: HostRange, answer: Result<Put, StoreError>) -> KeyAnswer {
    let (result, retired, outcome) = match answer {
        Ok(Put::Committed(_)) => {
            (KeyResult::Written { bytes: range.len }, true, BackendOutcome::Succeeded)
        }
        Ok(Put::AlreadyCommitted) => {
            (KeyResult::AlreadyStored, true, BackendOutcome::PutAlreadyExists)
        }
        Ok(Put::Busy) => (KeyResult::Failed(KeyFailure::Busy), true, BackendOutcome::CallerRefused),
        Ok(Put::Refused(_)) => (
            KeyResult::Failed(KeyFailure::Refused),
            true,
            BackendOutcome::RetiredPutCapacityRejection,
        ),
        Err(e) => {
            let retired = failure_retired(shared, &e);
            let outcome = if retired {
                BackendOutcome::from_store_error(&e)
            } else {
                BackendOutcome::UnretiredPutFailure
            };
            (KeyResult::Failed(KeyFailure::Store(e)), retired, outcome)
        }
    };
    KeyAnswer { result, retired, outcome }
}

fn not_attempted() -> KeyAnswer {
    KeyAnswer {
        result: KeyResult::Failed(KeyFailure::NotAttempted),
        retired: true,
        outcome: BackendOutcome::NotAttempted,
    }
}
