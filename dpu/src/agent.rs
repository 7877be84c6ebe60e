//! The agent: starts reactors and queues over one slab, bumps its persisted epoch, takes
//! submissions through the owning reactor only, and settles slab slots as completions are
//! reaped.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::registry::{
    Completion, Epoch, LocalEpochs, PoolError, RegionCounts, RegisteredPool, SlotLease,
};
use gpucache_storage::host::pool::{HugePagePolicy, HugePagePool, Tier};

use crate::error::DpuError;
use crate::job::{Answer, Job};
use crate::queue::{
    BlockId, Done, MissCause, Op, Outcome, QUEUE_DEPTH_MAX, Queue, QueueBackend, QueueId,
    QueueStats, Submission, Ticket,
};
use crate::reactor::{self, PinPolicy, Pinning, ReactorId, ReactorReport, ReactorShared};
use crate::slab::{RawSlab, SLAB_SLOTS_MAX, SlabMemory};

/// One reactor to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReactorSpec {
    pub id: ReactorId,
    /// The core to pin to; `None` runs unpinned (reported as [`Pinning::NotRequested`]).
    pub core: Option<usize>,
}

/// Which backend a queue uses.
#[derive(Debug, Clone)]
pub enum QueueKind {
    /// Block files under `root`, moved by the backends' I/O engine (`engine` picks io_uring,
    /// pread/pwrite, or probes io_uring first).
    Host {
        root: std::path::PathBuf,
        engine: gpucache_storage::file::engine::EngineChoice,
        /// fsync each block file before its completion is posted.
        sync: bool,
    },
    /// The seeded simulation ([`crate::sim`]).
    Sim(crate::sim::SimConfig),
    /// An SPDK NVMe queue. Fails closed at start when SPDK is absent.
    #[cfg(feature = "spdk")]
    Spdk(crate::native::spdk::SpdkConfig),
    /// A DOCA queue on a BlueField. Fails closed at start when DOCA is absent.
    #[cfg(feature = "doca")]
    Doca(crate::native::doca::DocaConfig),
}

/// One queue to create, bound to `owner` for its whole life.
#[derive(Debug, Clone)]
pub struct QueueSpec {
    pub id: QueueId,
    pub owner: ReactorId,
    /// Most submissions outstanding at once, 1..=[`QUEUE_DEPTH_MAX`].
    pub depth_max: usize,
    pub kind: QueueKind,
}

/// The slab every submission leases a slot of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlabConfig {
    /// 1..=[`SLAB_SLOTS_MAX`].
    pub slots: usize,
    /// Largest block payload a submission can carry.
    pub slot_bytes: usize,
    /// A slot lease's lifetime; when it runs out the slot is quarantined (never freed).
    pub lease_ms: u64,
    pub policy: HugePagePolicy,
}

impl Default for SlabConfig {
    fn default() -> Self {
        Self {
            slots: 256,
            slot_bytes: 1 << 20,
            lease_ms: 60_000,
            policy: HugePagePolicy::default().prefer(Tier::Huge2M),
        }
    }
}

/// How to start an agent. [`AgentConfig::start`] validates it and returns a running agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Holds the persisted epoch.
    pub state_dir: PathBuf,
    pub reactors: Vec<ReactorSpec>,
    pub queues: Vec<QueueSpec>,
    pub pin: PinPolicy,
    pub slab: SlabConfig,
    /// Longest an idle reactor parks before it looks again.
    pub idle_park: Duration,
}

/// Most reactors one agent may start.
pub const REACTORS_MAX: usize = 256;
/// Most queues one agent may own.
pub const QUEUES_MAX: usize = 1024;

impl AgentConfig {
    /// Validates, bumps the persisted epoch, maps the slab, opens the queues and starts the
    /// reactors (waiting for each to report its pinning).
    pub fn start(self) -> Result<Agent, DpuError> {
        Agent::start(self)
    }
}

/// What is really running, for the service's INFO and STATS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offload {
    /// Queues run on host threads; no storage work leaves the host CPU.
    HostThreads { reactors: usize, pinned: usize },
    /// At least one queue is the seeded simulation: nothing is offloaded.
    Simulated { seed: u64, reactors: usize, pinned: usize },
    /// A native SPDK or DOCA backend drives the queues. No backend in this build can produce
    /// it: they fail closed at start.
    Active { backend: &'static str },
}

impl Offload {
    /// Whether storage queues really run off the host CPU.
    pub fn active(&self) -> bool {
        matches!(self, Offload::Active { .. })
    }
}

/// Slab slots by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlabCounts {
    pub total: usize,
    pub free: usize,
    pub regions: RegionCounts,
    pub epoch: Epoch,
}

/// Everything the agent counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentStats {
    pub epoch: Epoch,
    pub offload: Offload,
    pub slab: SlabCounts,
    pub queues: Vec<QueueStats>,
}

/// How long dropping an agent waits for its reactors to stop.
pub const REACTOR_STOP_PATIENCE: Duration = Duration::from_secs(30);

/// A running agent. Dropping it stops and joins its reactors; a reactor that does not stop
/// within [`REACTOR_STOP_PATIENCE`] is left running and the slab it may touch is leaked.
#[derive(Debug)]
pub struct Agent {
    epoch: Epoch,
    queues: BTreeMap<QueueId, Arc<Queue>>,
    /// Queues in id order, for routing.
    route: Vec<(ReactorId, QueueId)>,
    reactors: Vec<ReactorReport>,
    threads: Vec<(ReactorId, JoinHandle<()>)>,
    stop: Arc<AtomicBool>,
    /// Disconnected once every reactor thread has ended (each holds a sender until it returns).
    reactors_gone: Mutex<std::sync::mpsc::Receiver<()>>,
    /// The sender reactors clone at spawn; dropped when the last one is started (or the start
    /// fails), so that only the reactors keep the channel open.
    alive: Option<std::sync::mpsc::Sender<()>>,
    /// Dropped only after every reactor ended: they hold a raw view of it.
    slab: std::mem::ManuallyDrop<Mutex<RegisteredPool<SlabMemory>>>,
    raw: RawSlab,
    slab_epoch: Arc<AtomicU64>,
    slab_total: usize,
    lease_ms: u64,
    owner: TenantId,
    started: Instant,
    simulated: Option<u64>,
}

fn build_backend(kind: &QueueKind, epoch: Epoch) -> Result<Box<dyn QueueBackend>, DpuError> {
    match kind {
        QueueKind::Host { root, engine, sync } => {
            Ok(Box::new(crate::uring::HostQueue::open(root, *engine, *sync, epoch)?))
        }
        QueueKind::Sim(config) => Ok(Box::new(crate::sim::SimQueue::new(config.clone()))),
        #[cfg(feature = "spdk")]
        QueueKind::Spdk(config) => Err(crate::native::spdk::open(config)),
        #[cfg(feature = "doca")]
        QueueKind::Doca(config) => Err(crate::native::doca::open(config)),
    }
}

impl Agent {
    fn start(config: AgentConfig) -> Result<Self, DpuError> {
        validate(&config)?;
        // Queues first: a native backend that fails closed must fail before anything else.
        // The run's epoch is known before it is persisted, so the queues get the real one.
        let epoch = crate::epoch::next_epoch(&config.state_dir)?;
        let mut built = Vec::with_capacity(config.queues.len());
        for q in &config.queues {
            built.push((q.clone(), build_backend(&q.kind, epoch)?));
        }
        crate::epoch::persist(&config.state_dir, epoch)?;
        let simulated = built.iter().find_map(|(_, b)| b.simulated());
        let pool = HugePagePool::new(config.slab.slots, config.slab.slot_bytes, config.slab.policy)
            .map_err(|e| DpuError::Config(format!("slab: {e}")))?;
        let memory = SlabMemory::new(pool);
        let raw = memory.raw();
        let slab = RegisteredPool::new(memory, Box::new(LocalEpochs));
        let slab_epoch = Arc::new(AtomicU64::new(slab.epoch().0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut queues = BTreeMap::new();
        let mut route = Vec::new();
        for (spec, backend) in built {
            let q = Arc::new(Queue::new(spec.id, spec.owner, spec.depth_max, backend));
            route.push((spec.owner, spec.id));
            queues.insert(spec.id, q);
        }
        let (alive, reactors_gone) = std::sync::mpsc::channel::<()>();
        let mut agent = Self {
            epoch,
            queues,
            route,
            reactors: Vec::new(),
            threads: Vec::new(),
            stop: Arc::clone(&stop),
            reactors_gone: Mutex::new(reactors_gone),
            alive: Some(alive),
            slab: std::mem::ManuallyDrop::new(Mutex::new(slab)),
            raw,
            slab_epoch: Arc::clone(&slab_epoch),
            slab_total: config.slab.slots,
            lease_ms: config.slab.lease_ms,
            owner: TenantId::parse("dpu-agent").map_err(|e| DpuError::Config(e.to_string()))?,
            started: Instant::now(),
            simulated,
        };
        for spec in &config.reactors {
            let mine: Vec<Arc<Queue>> =
                agent.queues.values().filter(|q| q.owner == spec.id).cloned().collect();
            let ids = mine.iter().map(|q| q.id).collect();
            let shared = ReactorShared {
                queues: mine,
                stop: Arc::clone(&stop),
                slab_epoch: Arc::clone(&slab_epoch),
                slab: raw,
                idle_park: config.idle_park,
            };
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            let core = spec.core;
            let alive = agent.alive.clone();
            let handle = std::thread::Builder::new()
                .name(format!("dpu-{}", spec.id))
                .spawn(move || {
                    // Held until this thread ends, however it ends.
                    let _alive = alive;
                    let pinning = core.map_or(Pinning::NotRequested, reactor::pin_current);
                    let refused = matches!(pinning, Pinning::Refused { .. });
                    let _ = tx.send(pinning);
                    if refused && config.pin == PinPolicy::Required {
                        return;
                    }
                    reactor::run(shared);
                })
                .map_err(|e| DpuError::Config(format!("spawn {}: {e}", spec.id)))?;
            agent.threads.push((spec.id, handle));
            let pinning = rx.recv().map_err(|_| DpuError::Stopped)?;
            if let Pinning::Refused { core, detail } = &pinning {
                tracing::warn!(reactor = %spec.id, core, detail, "reactor runs unpinned");
                if config.pin == PinPolicy::Required {
                    return Err(DpuError::PinRefused {
                        reactor: spec.id,
                        core: *core,
                        detail: detail.clone(),
                    });
                }
            }
            agent.reactors.push(ReactorReport { id: spec.id, pinning, queues: ids });
        }
        agent.alive = None;
        tracing::info!(epoch = %epoch, offload = ?agent.offload(), "dpu agent started");
        Ok(agent)
    }

    /// The agent epoch of this run (persisted, bumped at every start).
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// What is really running.
    pub fn offload(&self) -> Offload {
        let reactors = self.reactors.len();
        let pinned =
            self.reactors.iter().filter(|r| matches!(r.pinning, Pinning::Pinned { .. })).count();
        match self.simulated {
            Some(seed) => Offload::Simulated { seed, reactors, pinned },
            None => Offload::HostThreads { reactors, pinned },
        }
    }

    pub fn reactors(&self) -> &[ReactorReport] {
        &self.reactors
    }

    /// The reactors whose thread has ended (a panic, or a stop): their queues are served by
    /// nobody, so a running agent with any is not ready. Empty while every reactor runs.
    pub fn reactors_stopped(&self) -> Vec<ReactorId> {
        self.threads.iter().filter(|(_, t)| t.is_finished()).map(|(id, _)| *id).collect()
    }

    /// The queue (and its owning reactor) for a stable hash of a key.
    pub fn route(&self, hash: u64) -> (ReactorId, QueueId) {
        let n = self.route.len() as u64;
        // n >= 1 (validated); the index is below n, so it fits usize.
        self.route[usize::try_from(hash % n).unwrap_or(0)]
    }

    /// Largest payload one submission carries.
    pub fn slot_bytes(&self) -> usize {
        self.raw.slot_bytes
    }

    /// Milliseconds since this agent started: the clock slab leases run on.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn pool(&self) -> MutexGuard<'_, RegisteredPool<SlabMemory>> {
        self.slab.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn queue(&self, id: QueueId) -> Result<&Arc<Queue>, DpuError> {
        self.queues.get(&id).ok_or(DpuError::UnknownQueue(id))
    }

    fn wake(&self, owner: ReactorId) {
        if let Some((_, t)) = self.threads.iter().find(|(id, _)| *id == owner) {
            t.thread().unpark();
        }
    }

    /// Submits `work` (made into its operation by `op`) through `reactor` to `queue`:
    /// affinity, depth and slab are checked first and a refusal submits and leases nothing and
    /// hands `work` back. `fill` writes the payload into the leased slot.
    fn submit<W>(
        &self,
        reactor: ReactorId,
        queue: QueueId,
        fill: impl FnOnce(&mut [u8]),
        work: W,
        op: impl FnOnce(W) -> Op,
    ) -> Result<Ticket, (DpuError, W)> {
        let q = match self.queue(queue) {
            Ok(q) => q,
            Err(e) => return Err((e, work)),
        };
        let mut st = q.lock();
        if q.owner != reactor {
            st.stats.affinity_violations += 1;
            let e = DpuError::AffinityViolation { queue, owner: q.owner, asked: reactor };
            return Err((e, work));
        }
        if self.stop.load(Ordering::Acquire) {
            return Err((DpuError::Stopped, work));
        }
        if st.outstanding.len() >= q.depth_max {
            st.stats.queue_full += 1;
            return Err((DpuError::QueueFull { queue, depth_max: q.depth_max }, work));
        }
        let leased = {
            let mut pool = self.pool();
            let deadline = self.now_ms().saturating_add(self.lease_ms);
            match pool.checkout(&self.owner, 1, Some(deadline)) {
                Ok(mut l) => l.pop().ok_or(DpuError::Stopped),
                Err(PoolError::Exhausted { free, total, .. }) => {
                    Err(DpuError::SlabExhausted { free, total })
                }
                Err(e) => Err(e.into()),
            }
        };
        let lease = match leased {
            Ok(l) => l,
            Err(e) => return Err((e, work)),
        };
        // SAFETY: the lease was just checked out to this submission and nothing else holds it;
        // the slab lives as long as `self`.
        fill(unsafe { self.raw.slot_mut(lease.slot) });
        let seq = st.next_seq;
        st.next_seq += 1;
        st.outstanding.insert(seq, lease);
        st.pending.push_back(Submission { seq, lease, op: op(work) });
        st.stats.submitted += 1;
        drop(st);
        self.wake(reactor);
        Ok(Ticket { queue, seq, epoch: self.epoch })
    }

    /// Submits a write of `data` as `block` through `reactor` (which must own `queue`).
    pub fn submit_write(
        &self,
        reactor: ReactorId,
        queue: QueueId,
        block: BlockId,
        data: &[u8],
    ) -> Result<Ticket, DpuError> {
        if data.len() > self.raw.slot_bytes {
            return Err(DpuError::PayloadTooLarge {
                len: data.len(),
                slot_bytes: self.raw.slot_bytes,
            });
        }
        let len = data.len();
        let write = Op::Write { block, len };
        self.submit(reactor, queue, |slot| slot[..len].copy_from_slice(data), write, |op| op)
            .map_err(|(e, _)| e)
    }

    /// Submits a read of `block` through `reactor` (which must own `queue`).
    pub fn submit_read(
        &self,
        reactor: ReactorId,
        queue: QueueId,
        block: BlockId,
    ) -> Result<Ticket, DpuError> {
        self.submit(reactor, queue, |_| {}, Op::Read { block }, |op| op).map_err(|(e, _)| e)
    }

    /// Submits a store job through `reactor` (which must own `queue`); `fill` writes the job's
    /// payload into the leased slot. A refusal hands the job back with its reason, so that a
    /// batch can submit it again once its own submissions have freed room (by value: a refusal
    /// allocates nothing either).
    #[allow(clippy::result_large_err)]
    pub(crate) fn submit_job(
        &self,
        reactor: ReactorId,
        queue: QueueId,
        fill: impl FnOnce(&mut [u8]),
        job: Job,
    ) -> Result<Ticket, (DpuError, Job)> {
        self.submit(reactor, queue, fill, job, Op::Store)
    }

    /// Most submissions `queue` holds outstanding (0 for a queue that does not exist).
    pub(crate) fn depth_max(&self, queue: QueueId) -> usize {
        self.queues.get(&queue).map_or(0, |q| q.depth_max)
    }

    /// Slots of the slab, whatever their state.
    pub(crate) fn slab_slots(&self) -> usize {
        self.slab_total
    }

    /// Waits until `deadline` for the ticket's completion and settles its slot: retired on a
    /// completion, quarantined on an error completion or when the deadline passes (`Lost`).
    /// A ticket from an earlier run of the agent is a clean `Miss(Fenced)`.
    pub fn wait(
        &self,
        ticket: Ticket,
        deadline: Instant,
        dst: &mut [u8],
    ) -> Result<Outcome, DpuError> {
        let q = Arc::clone(self.queue(ticket.queue)?);
        if ticket.epoch != self.epoch {
            return Ok(Outcome::Miss(MissCause::Fenced));
        }
        let (lease, done) = self.reap(&q, &ticket, deadline)?;
        let outcome = match done {
            Done::Staged(staged) => match q.backend().publish(staged) {
                Ok(()) => Outcome::Written,
                Err(detail) => {
                    self.settle(&lease, Completion::Unknown);
                    return Err(DpuError::Completion { queue: q.id, seq: ticket.seq, detail });
                }
            },
            Done::Read { len } => {
                if dst.len() < len {
                    self.settle(&lease, Completion::Retired);
                    return Err(DpuError::BufferTooSmall { needed: len, provided: dst.len() });
                }
                // Copied under the slab lock, and only while the lease still holds the slot: a
                // fence between the completion and this wait may have reclaimed it and lent it
                // to another submission, whose bytes these would be.
                let mut pool = self.pool();
                if !pool.holds(&lease) {
                    return Ok(Outcome::Miss(MissCause::Fenced));
                }
                // SAFETY: the completion is posted, so the reactor is done with the slot; the
                // lease holds it and the slab lock keeps it from being reclaimed meanwhile.
                let slot = unsafe { self.raw.slot_mut(lease.slot) };
                dst[..len].copy_from_slice(&slot[..len]);
                if let Err(e) = pool.complete(lease.region, Completion::Retired) {
                    tracing::debug!(region = %lease.region, error = %e, "slab slot already settled");
                }
                return Ok(Outcome::Read { len });
            }
            Done::Miss(cause) => Outcome::Miss(cause),
            Done::Store(_) => Outcome::Miss(MissCause::Absent),
        };
        self.settle(&lease, Completion::Retired);
        Ok(outcome)
    }

    /// Waits for a job's completion, hands its answer and the slot's bytes to `take`, then
    /// retires the slot.
    pub(crate) fn wait_job<R>(
        &self,
        ticket: Ticket,
        deadline: Instant,
        take: impl FnOnce(Answer, &[u8]) -> R,
    ) -> Result<R, DpuError> {
        let q = Arc::clone(self.queue(ticket.queue)?);
        let (lease, done) = self.reap(&q, &ticket, deadline)?;
        let r = match done {
            Done::Store(out) => {
                // As in `wait`: only while the lease still holds the slot, under the slab lock.
                let pool = self.pool();
                if !pool.holds(&lease) {
                    return Err(DpuError::Completion {
                        queue: q.id,
                        seq: ticket.seq,
                        detail: "fenced".into(),
                    });
                }
                // SAFETY: posted, so the reactor is done; the lease holds the slot and the slab
                // lock keeps it from being reclaimed while `take` reads it.
                let slot = unsafe { self.raw.slot_mut(lease.slot) };
                let r = Ok(take(out, slot));
                drop(pool);
                r
            }
            Done::Miss(_) | Done::Read { .. } | Done::Staged(_) => {
                Err(DpuError::Completion { queue: q.id, seq: ticket.seq, detail: "fenced".into() })
            }
        };
        self.settle(&lease, Completion::Retired);
        r
    }

    /// Takes the ticket's completion, or abandons it at the deadline (quarantining its slot).
    fn reap(
        &self,
        q: &Queue,
        ticket: &Ticket,
        deadline: Instant,
    ) -> Result<(SlotLease, Done), DpuError> {
        let seq = ticket.seq;
        let mut st = q.lock();
        if !st.outstanding.contains_key(&seq) {
            return Err(DpuError::UnknownTicket { queue: q.id, seq });
        }
        let posted = loop {
            if let Some(p) = st.completed.remove(&seq) {
                break p;
            }
            let now = Instant::now();
            if now >= deadline {
                let lease = st.outstanding.remove(&seq);
                drop(st);
                if let Some(lease) = lease {
                    self.settle(&lease, Completion::Unknown);
                }
                return Err(DpuError::Lost { queue: q.id, seq });
            }
            st = q.changed.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        };
        let lease =
            st.outstanding.remove(&seq).ok_or(DpuError::UnknownTicket { queue: q.id, seq })?;
        st.stats.reaped += 1;
        drop(st);
        match posted {
            Ok(done) => Ok((lease, done)),
            Err(detail) => {
                self.settle(&lease, Completion::Unknown);
                Err(DpuError::Completion { queue: q.id, seq, detail })
            }
        }
    }

    fn settle(&self, lease: &SlotLease, completion: Completion) {
        // A slot the fence already reclaimed is unknown to the pool: nothing left to settle.
        if let Err(e) = self.pool().complete(lease.region, completion) {
            tracing::debug!(region = %lease.region, error = %e, "slab slot already settled");
        }
    }

    /// Slab slots by state.
    pub fn slab(&self) -> SlabCounts {
        let pool = self.pool();
        SlabCounts {
            total: self.slab_total,
            free: pool.free_slots(),
            regions: pool.table().counts(),
            epoch: pool.epoch(),
        }
    }

    /// Quarantines slab slots whose lease ran out by `now_ms` ([`Agent::now_ms`]). Never frees.
    pub fn expire_slab_leases(&self, now_ms: u64) -> usize {
        self.pool().expire_leases(now_ms).len()
    }

    /// Raises the slab fence: submissions leased under an older slab epoch will not run.
    pub fn bump_epoch(&self) -> Result<Epoch, DpuError> {
        let mut pool = self.pool();
        let e = pool.bump_epoch()?;
        self.slab_epoch.store(e.0, Ordering::Release);
        Ok(e)
    }

    /// Waits (until `deadline`) for every submission executing under an older slab epoch to
    /// end, then returns every slot leased before `epoch` (the current slab epoch) to the slab.
    pub fn reclaim_fenced(&self, epoch: Epoch, deadline: Instant) -> Result<usize, DpuError> {
        for q in self.queues.values() {
            let mut st = q.lock();
            while st.executing.is_some_and(|e| e < epoch) {
                let now = Instant::now();
                if now >= deadline {
                    return Err(DpuError::FenceNotDrained { executing: 1 });
                }
                st =
                    q.changed.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
        Ok(self.pool().reclaim_fenced(epoch)?.len())
    }

    pub fn queue_stats(&self, queue: QueueId) -> Result<QueueStats, DpuError> {
        let q = self.queue(queue)?;
        let st = q.lock();
        let mut s = st.stats.clone();
        s.outstanding = st.outstanding.len();
        Ok(s)
    }

    pub fn stats(&self) -> AgentStats {
        AgentStats {
            epoch: self.epoch,
            offload: self.offload(),
            slab: self.slab(),
            queues: self.queues.keys().filter_map(|id| self.queue_stats(*id).ok()).collect(),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.alive = None;
        for (_, t) in &self.threads {
            t.thread().unpark();
        }
        let gone = self.reactors_gone.get_mut().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + REACTOR_STOP_PATIENCE;
        let all_ended = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match gone.recv_timeout(left) {
                Ok(()) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break true,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => break false,
            }
        };
        if !all_ended {
            let stuck: Vec<String> = self
                .threads
                .iter()
                .filter(|(_, t)| !t.is_finished())
                .map(|(id, _)| id.to_string())
                .collect();
            tracing::error!(?stuck, "dpu reactors did not stop; their slab is leaked");
            return;
        }
        for (_, t) in self.threads.drain(..) {
            let _ = t.join();
        }
        // SAFETY: every reactor thread has ended, so nothing holds a view of the slab; dropped
        // once, here.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.slab) };
    }
}

fn validate(c: &AgentConfig) -> Result<(), DpuError> {
    let bad = |s: String| Err(DpuError::Config(s));
    if c.reactors.is_empty() || c.reactors.len() > REACTORS_MAX {
        return bad(format!("{} reactors, need 1..={REACTORS_MAX}", c.reactors.len()));
    }
    if c.queues.is_empty() || c.queues.len() > QUEUES_MAX {
        return bad(format!("{} queues, need 1..={QUEUES_MAX}", c.queues.len()));
    }
    if c.slab.slots == 0 || c.slab.slots > SLAB_SLOTS_MAX || c.slab.slot_bytes == 0 {
        return bad(format!("slab of {} slots of {} bytes", c.slab.slots, c.slab.slot_bytes));
    }
    if c.idle_park.is_zero() || c.idle_park > Duration::from_secs(1) {
        return bad(format!("idle_park {:?} outside (0, 1s]", c.idle_park));
    }
    let mut ids = std::collections::BTreeSet::new();
    for r in &c.reactors {
        if !ids.insert(r.id) {
            return bad(format!("{} appears twice", r.id));
        }
    }
    let mut qids = std::collections::BTreeSet::new();
    for q in &c.queues {
        if !qids.insert(q.id) {
            return bad(format!("{} appears twice", q.id));
        }
        if !ids.contains(&q.owner) {
            return Err(DpuError::UnknownReactor(q.owner));
        }
        if q.depth_max == 0 || q.depth_max > QUEUE_DEPTH_MAX {
            return bad(format!("{} depth_max {}, need 1..={QUEUE_DEPTH_MAX}", q.id, q.depth_max));
        }
    }
    Ok(())
}
