//! [`DpuStore`]: the dataplane [`Store`] over an agent. Every call that touches a key runs on
//! the reactor that owns the key's queue (queue chosen by a stable hash of the encoded key), as
//! a job against the store the agent fronts (a FileStore with the io_uring engine in the
//! service). Payload bytes pass through a leased slab slot, so the caller's buffers are never
//! held past a call: every failure retires them.
//!
//! Lifecycle, admission and identity stay in the backing store. A lost or failed completion on a
//! read is a clean miss; on a write it is a backend error (the backing store's reservation then
//! follows its own contract: abort, lease expiry, fence).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::{Refusal, RequestId};
use gpucache_dataplane::registry::{Epoch, RegionId};
use gpucache_dataplane::store::{
    Abort, Committed, Get, Implementation, Invalidate, Lookup, MissReason, Reclaimed, Reservation,
    Reserve, Retirement, Store, StoreError, StoreInfo, StoreStats,
};

use crate::agent::Agent;
use crate::error::DpuError;
use crate::job::{Answer, FromAnswer, Job, JobOp};

/// How a [`DpuStore`] waits on its agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DpuStoreConfig {
    /// Longest one call waits for its completion before the slot is quarantined.
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

fn backend_err(operation: &'static str, e: DpuError) -> StoreError {
    StoreError::Backend { operation, detail: e.to_string(), retirement: Retirement::Retired }
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

    fn epoch(&self) -> Epoch {
        self.backing.epoch()
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
            return Ok(Reserve::Refused(Refusal::ObjectTooLarge { bytes: len, max }));
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

    /// The store's leases, and the agent's slab slots whose lease ran out (quarantined).
    fn expire_leases(&self) -> Result<usize, StoreError> {
        let slab = self.agent.expire_slab_leases(self.agent.now_ms());
        Ok(self.backing.expire_leases()? + slab)
    }

    fn attest_drained(&self, caller: &Caller, region: RegionId) -> Result<Reclaimed, StoreError> {
        self.backing.attest_drained(caller, region)
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

    fn stats(&self) -> StoreStats {
        self.backing.stats()
    }

    fn condition(&self) -> gpucache_dataplane::store::StoreCondition {
        self.backing.condition()
    }
}
