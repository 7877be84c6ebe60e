//! [`DpuStore`]: the dataplane [`Store`] over an agent. Every call that touches a key runs on
//! the reactor that owns the key's queue (queue chosen by a stable hash of the encoded key), as
//! a job against the store the agent fronts (a FileStore with the io_uring engine in the
//! service). Payload bytes pass through a leased slab slot, so the caller's buffers are never
//! held past a call: every failure retires them.
//!
//! Lifecycle, admission and identity stay in the backing store. A lost or failed completion on a
//! read is a clean miss; on a write it is a backend error (the backing store's reservation then
//! follows its own contract: abort, lease expiry, fence).
//!
//! The batch calls run one job per item ([`crate::batch`]): every queue a batch touches is given
//! its items before any answer is waited on, so the queues work on one batch together, and each
//! item answers what its single-key call answers (a batch PUT item runs the backing store's
//! whole PUT as one job on its key's queue, where a single PUT runs reserve, write and commit as
//! three).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{Refusal, RequestId};
use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::store::{
    Abort, BatchAnswers, BatchGet, BatchPut, Committed, Get, Implementation, Invalidate, Lookup,
    MissReason, Put, Reservation, Reserve, Retirement, Store, StoreError, StoreInfo, StoreLayer,
};

use crate::agent::Agent;
use crate::batch::{Batch, Item};
use crate::error::DpuError;
use crate::job::{Answer, FromAnswer, Job, JobOp};
use crate::queue::QueueId;
use crate::reactor::ReactorId;

/// How a [`DpuStore`] waits on its agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DpuStoreConfig {
    /// Longest one call (or one item of a batch call, from its submission) waits for its
    /// completion before the slot is quarantined.
    pub op_deadline: Duration,
}

impl Default for DpuStoreConfig {
    fn default() -> Self {
        Self { op_deadline: Duration::from_secs(30) }
    }
}

/// A store whose key operations run on the agent's reactors.
pub struct DpuStore {
    agent: Arc<Agent>,
    backing: Arc<dyn Store>,
    config: DpuStoreConfig,
}

impl std::fmt::Debug for DpuStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DpuStore(agent epoch {}, offload {:?})",
            self.agent.epoch(),
            self.agent.offload()
        )
    }
}

fn copy_reservation(r: &Reservation) -> Reservation {
    Reservation { region: r.region, epoch: r.epoch, len: r.len, request: r.request }
}

/// A failure of the agent as a store error; one that came from the system keeps its io kind.
fn backend_err(operation: &'static str, e: DpuError) -> StoreError {
    let detail = e.to_string();
    match e {
        DpuError::Io { source, .. } => StoreError::Io {
            operation,
            kind: source.kind(),
            detail,
            retirement: Retirement::Retired,
        },
        _ => StoreError::Backend { operation, detail, retirement: Retirement::Retired },
    }
}

impl DpuStore {
    pub fn new(agent: Arc<Agent>, backing: Arc<dyn Store>, config: DpuStoreConfig) -> Self {
        Self { agent, backing, config }
    }

    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// Runs `op` for `caller` on the reactor owning `hash`'s queue with `payload` in the slot;
    /// `take` sees the job's answer and the slot afterwards.
    fn run<R>(
        &self,
        hash: u64,
        caller: &Caller,
        payload: &[u8],
        op: JobOp,
        take: impl FnOnce(Answer, &[u8]) -> R,
    ) -> Result<R, DpuError> {
        let (reactor, queue) = self.agent.route(hash);
        let job = Job { store: Arc::clone(&self.backing), caller: caller.clone(), op };
        let ticket = self
            .agent
            .submit_job(reactor, queue, |slot| slot[..payload.len()].copy_from_slice(payload), job)
            .map_err(|(e, _)| e)?;
        let deadline = Instant::now() + self.config.op_deadline;
        self.agent.wait_job(ticket, deadline, take)
    }

    /// Runs `op` and answers what the store call answered; a refused, lost or failed job is a
    /// backend error of `operation` (the caller's buffers are retired either way: the job only
    /// ever touched its slab slot).
    fn call<T: FromAnswer>(
        &self,
        operation: &'static str,
        hash: u64,
        caller: &Caller,
        payload: &[u8],
        op: JobOp,
    ) -> Result<T, StoreError> {
        match self.run(hash, caller, payload, op, |answer, _| T::from_answer(answer)) {
            Ok(Ok(r)) => r,
            Ok(Err(e)) | Err(e) => Err(backend_err(operation, e)),
        }
    }

    /// The queue that runs `key`'s calls, and the reactor that owns it.
    pub fn route(&self, key: &PhysicalKey) -> (ReactorId, QueueId) {
        self.agent.route(Self::key_hash(key))
    }

    fn batch<'a>(&'a self, caller: &'a Caller) -> Batch<'a> {
        Batch {
            agent: &self.agent,
            store: &self.backing,
            caller,
            op_deadline: self.config.op_deadline,
        }
    }

    /// Runs one job per key (made by `op`) as a batch and answers per key, in order, as
    /// [`DpuStore::call`] does for one key.
    fn call_batch<T: FromAnswer>(
        &self,
        operation: &'static str,
        caller: &Caller,
        keys: &[&PhysicalKey],
        op: impl Fn(&PhysicalKey) -> JobOp,
    ) -> BatchAnswers<T> {
        let mut answers: Vec<Option<Result<T, StoreError>>> =
            std::iter::repeat_with(|| None).take(keys.len()).collect();
        for round in rounds(keys.iter().copied()) {
            let items = round.into_iter().map(|index| Item {
                index,
                hash: Self::key_hash(keys[index]),
                payload: &[],
                op: op(keys[index]),
            });
            self.batch(caller).run(items, |index, done| {
                let answer = match done.and_then(|(answer, _)| T::from_answer(answer)) {
                    Ok(r) => r,
                    Err(e) => Err(backend_err(operation, e)),
                };
                answers[index] = Some(answer);
            });
        }
        collect(operation, answers)
    }

    /// Which queue runs the key's calls: the key's own digest (made once, with the key), not a
    /// second hash of its bytes per call.
    fn key_hash(key: &PhysicalKey) -> u64 {
        let [a, b, c, d, e, f, g, h, ..] = key.digest().0;
        u64::from_le_bytes([a, b, c, d, e, f, g, h])
    }
}

/// What a GET whose job was refused, lost or failed answers: a clean miss (nothing was copied
/// to the caller's buffer).
const GET_NOT_COMPLETED: Result<Get, StoreError> = Ok(Get::Miss(MissReason::Absent));

/// What a GET of `room` bytes (at most a slot) into `dst` answers, from its job's answer and
/// slot: a hit is copied from the slot to `dst`, and a corrupt miss zeroes `dst` as the backing
/// store zeroed the slot.
fn get_answer(
    slot_bytes: usize,
    room: usize,
    dst: &mut [u8],
    answer: Answer,
    slot: &[u8],
) -> Result<Get, StoreError> {
    let Answer::Get(r) = answer else {
        return GET_NOT_COMPLETED;
    };
    if let Ok(Get::Hit { len, .. }) = &r {
        // len <= room <= dst.len(): the backing store wrote that much.
        let n = usize::try_from(*len).unwrap_or(usize::MAX).min(room);
        dst[..n].copy_from_slice(&slot[..n]);
    }
    if let Ok(Get::Miss(MissReason::Corrupt)) = &r {
        // The backing store zeroed what it read; so does the caller's buffer.
        dst[..room].fill(0);
    }
    match r {
        Err(StoreError::BufferTooSmall { needed, provided })
            if usize::try_from(needed).is_ok_and(|n| n > slot_bytes)
                && usize::try_from(provided).is_ok_and(|p| p == room)
                && dst.len() >= slot_bytes =>
        {
            // Larger than one slab slot: this agent cannot carry it.
            Ok(Get::Miss(MissReason::Absent))
        }
        r => r,
    }
}

/// The answers of a batch in item order. Every item is answered exactly once by the batch; a
/// missing one would be a fault of the batch itself, answered as a backend error.
/// The items of a batch in rounds that may each run in flight together and still answer as the
/// items would one by one, in order: one call can change another's answer only through the same
/// logical key (a GET that drops a damaged block makes a later GET of that key, or of its other
/// physical forms, a different miss; an INVALIDATE removes what a later one of the key finds), so
/// each item goes in the round after the last one holding an item of its logical key. A batch
/// of distinct logical keys is one round.
fn rounds<'k>(keys: impl Iterator<Item = &'k PhysicalKey>) -> Vec<Vec<usize>> {
    let mut last: std::collections::HashMap<gpucache_dataplane::key::KeyDigest, usize> =
        std::collections::HashMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (index, key) in keys.enumerate() {
        let round = last.get(&key.logical_digest()).map_or(0, |r| r + 1);
        last.insert(key.logical_digest(), round);
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push(index);
    }
    rounds
}

fn collect<T>(
    operation: &'static str,
    answers: Vec<Option<Result<T, StoreError>>>,
) -> BatchAnswers<T> {
    answers
        .into_iter()
        .map(|a| {
            a.unwrap_or_else(|| {
                Err(StoreError::Backend {
                    operation,
                    detail: "the batch ended without answering this item".into(),
                    retirement: Retirement::Retired,
                })
            })
        })
        .collect()
}

impl StoreLayer for DpuStore {
    type Inner = dyn Store;

    fn inner(&self) -> &Self::Inner {
        &*self.backing
    }
}

impl Store for DpuStore {
    fn info(&self) -> StoreInfo {
        let inner = self.backing.info();
        let implementation = match self.agent.offload() {
            crate::Offload::Simulated { seed, .. } => Implementation::Simulated { seed },
            _ => inner.implementation,
        };
        StoreInfo {
            name: "dpu",
            implementation,
            failures_retire: true,
            full_policy: inner.full_policy,
        }
    }

    fn lookup(&self, caller: &Caller, key: &PhysicalKey) -> Result<Lookup, StoreError> {
        let op = JobOp::Lookup { key: key.clone() };
        self.call("lookup", Self::key_hash(key), caller, &[], op)
    }

    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let slot_bytes = self.agent.slot_bytes();
        let room = dst.len().min(slot_bytes);
        let op = JobOp::Get { key: key.clone(), room };
        // `dst` is touched only once the job completed, while the slot's lease holds.
        self.run(Self::key_hash(key), caller, &[], op, |answer, slot| {
            get_answer(slot_bytes, room, dst, answer, slot)
        })
        .unwrap_or(GET_NOT_COMPLETED)
    }

    fn reserve(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        len: u64,
        request: Option<RequestId>,
    ) -> Result<Reserve, StoreError> {
        let max = self.agent.slot_bytes() as u64;
        if len > max {
            // Too large for a slot, but the backing store's answer comes first: a key it already
            // holds (or a writer holds, or its own limits refuse) answers as it would anywhere.
            // Only a block it would have taken is refused for the slot, its reservation released
            // at once (no byte was written).
            return match self.backing.reserve(caller, key, len, request)? {
                Reserve::Reserved(r) => {
                    self.backing.abort(caller, r, Retirement::Retired)?;
                    Ok(Reserve::Refused(Refusal::ObjectTooLarge { bytes: len, max }))
                }
                other => Ok(other),
            };
        }
        let op = JobOp::Reserve { key: key.clone(), len, request };
        self.call("reserve", Self::key_hash(key), caller, &[], op)
    }

    fn write(
        &self,
        caller: &Caller,
        reservation: &Reservation,
        offset: u64,
        src: &[u8],
    ) -> Result<(), StoreError> {
        let slot_bytes = self.agent.slot_bytes();
        let mut done = 0usize;
        // Pieces larger than a slot go slot by slot; an empty write still goes once.
        loop {
            let n = (src.len() - done).min(slot_bytes);
            let op = JobOp::Write {
                reservation: copy_reservation(reservation),
                offset: offset + done as u64,
                len: n,
            };
            self.call::<()>("write", reservation.region.0, caller, &src[done..done + n], op)?;
            done += n;
            if done >= src.len() {
                return Ok(());
            }
        }
    }

    fn commit(&self, caller: &Caller, reservation: &Reservation) -> Result<Committed, StoreError> {
        let op = JobOp::Commit { reservation: copy_reservation(reservation) };
        self.call("commit", reservation.region.0, caller, &[], op)
    }

    fn abort(
        &self,
        caller: &Caller,
        reservation: Reservation,
        outcome: Retirement,
    ) -> Result<Abort, StoreError> {
        let hash = reservation.region.0;
        self.call("abort", hash, caller, &[], JobOp::Abort { reservation, outcome })
    }

    fn invalidate(&self, caller: &Caller, key: &PhysicalKey) -> Result<Invalidate, StoreError> {
        let op = JobOp::Invalidate { key: key.clone() };
        self.call("invalidate", Self::key_hash(key), caller, &[], op)
    }

    /// Each key's lookup runs on its queue's reactor; every queue gets its keys before any
    /// answer is waited on.
    fn lookup_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Lookup> {
        self.call_batch("lookup", caller, keys, |key| JobOp::Lookup { key: key.clone() })
    }

    /// Each item's read runs on its queue's reactor into the item's own slab slot, copied into
    /// the item's buffer when its completion is reaped; a refused, lost or failed item is a
    /// clean miss with its buffer untouched, as for [`Store::get_into`].
    fn get_batch(&self, caller: &Caller, items: &mut [BatchGet<'_>]) -> BatchAnswers<Get> {
        let slot_bytes = self.agent.slot_bytes();
        let mut answers: Vec<Option<Result<Get, StoreError>>> = vec![None; items.len()];
        for round in rounds(items.iter().map(|item| item.key)) {
            let jobs: Vec<Item<'static>> = round
                .into_iter()
                .map(|index| Item {
                    index,
                    hash: Self::key_hash(items[index].key),
                    payload: &[],
                    op: JobOp::Get {
                        key: items[index].key.clone(),
                        room: items[index].dst.len().min(slot_bytes),
                    },
                })
                .collect();
            self.batch(caller).run(jobs, |index, done| {
                let dst = &mut *items[index].dst;
                let room = dst.len().min(slot_bytes);
                answers[index] = Some(match done {
                    Ok((answer, slot)) => get_answer(slot_bytes, room, dst, answer, slot),
                    Err(_) => GET_NOT_COMPLETED,
                });
            });
        }
        collect("get", answers)
    }

    /// Each item's whole PUT runs as one job (reserve, write, commit) on its key's queue's
    /// reactor from a slab slot, one item after another: a PUT's admission depends on what is
    /// in flight and committed before it, so items run in flight together could be refused where
    /// the same PUTs one by one are not. A refused, lost or failed job is a backend error (the
    /// caller's bytes were copied into the slot before submission, so they are retired). An item
    /// larger than a slot takes the single-key path, whose refusal follows the backing store's
    /// own answer (see `reserve` here).
    fn put_batch(&self, caller: &Caller, items: &[BatchPut<'_>]) -> BatchAnswers<Put> {
        let max = self.agent.slot_bytes();
        items
            .iter()
            .map(|item| {
                if item.src.len() > max {
                    return Store::put(self, caller, item.key, item.src, item.request);
                }
                let job = Item {
                    index: 0,
                    hash: Self::key_hash(item.key),
                    payload: item.src,
                    op: JobOp::Put {
                        key: item.key.clone(),
                        len: item.src.len(),
                        request: item.request,
                    },
                };
                let mut answer = None;
                self.batch(caller).run(vec![job], |_, done| {
                    answer = Some(match done.and_then(|(answer, _)| Put::from_answer(answer)) {
                        Ok(r) => r,
                        Err(e) => Err(backend_err("put", e)),
                    });
                });
                // One item in, one answer out (`collect` answers every item it is given).
                collect("put", vec![answer]).swap_remove(0)
            })
            .collect()
    }

    /// Each key's invalidation runs on its queue's reactor; every queue gets its keys before
    /// any answer is waited on.
    fn invalidate_batch(&self, caller: &Caller, keys: &[&PhysicalKey]) -> BatchAnswers<Invalidate> {
        self.call_batch("invalidate", caller, keys, |key| JobOp::Invalidate { key: key.clone() })
    }

    /// The store's leases, and the agent's slab slots whose lease ran out (quarantined).
    fn expire_leases(&self) -> Result<usize, StoreError> {
        let slab = self.agent.expire_slab_leases(self.agent.now_ms());
        Ok(self.backing.expire_leases()? + slab)
    }

    /// Fences the agent's slab with the store: slab slots quarantined by lost or failed calls
    /// come back only through this fence, as the store's own do.
    fn bump_epoch(&self) -> Result<Epoch, StoreError> {
        self.agent.bump_epoch().map_err(|e| backend_err("bump_epoch", e))?;
        self.backing.bump_epoch()
    }

    /// The store's fenced regions and the agent's slab slots leased before its current epoch
    /// (after the calls still running on them end, within the op deadline), counted together.
    fn reclaim_fenced(&self, epoch: Epoch) -> Result<usize, StoreError> {
        let deadline = Instant::now() + self.config.op_deadline;
        let slab = self
            .agent
            .reclaim_fenced(self.agent.slab().epoch, deadline)
            .map_err(|e| backend_err("reclaim_fenced", e))?;
        Ok(self.backing.reclaim_fenced(epoch)? + slab)
    }
    gpucache_dataplane::forward_store!(reports, epoch, attest_drained, scope_keys);
}
