//! Moves one block between a checked-out [`RegisteredPool`] slot and a peer's region through a
//! [`NicEndpoint`], and maps what the NIC reports onto the registration contract:
//!
//! - a `Success` completion: the bytes moved and the NIC is done with the slot;
//! - an error completion (remote access, local protection, retry exceeded, flushed): the NIC is
//!   done with the slot too (a completion always means that), so the failure is retired and the
//!   slot is reusable; after `RetryExceeded` the peer's bytes may be partly written;
//! - no completion within [`TransferLimits::deadline_polls`] polls: the outcome is unknown and
//!   the slot is quarantined. A late completion, a duplicate, lease expiry or a known-idle
//!   report never frees it; only [`Transfers::fence`] (reset the queue pair, `bump_epoch`, then
//!   `reclaim_fenced`) or a drained attestation does.
//!
//! In both retired cases the slot stays lent to the caller, who reads it, retries, or returns
//! it with [`Transfers::release`]. Deadlines count polls, never wall time.
//!
//! A [`Transfers`] owns its endpoint's completion queue: completions it did not wait for are
//! sorted into late-after-quarantine, duplicates and unknown ids, counted and ignored.

use std::collections::BTreeMap;
use std::num::{NonZeroU32, NonZeroUsize};

use gpucache_dataplane::lifecycle::ReclaimProof;
use gpucache_dataplane::registry::{
    CompleteOutcome, Completion, PoolError, PoolMemory, RegionId, RegisteredPool, RegistryError,
    SlotLease,
};

use crate::error::NicError;
use crate::slots::local_key;
use crate::verbs::{
    CompletionStatus, NicEndpoint, Opcode, POLL_ENTRIES_MAX, RemoteSlice, WorkCompletion,
    WorkRequest, WorkRequestId,
};

/// How long a transfer waits and how much it takes per poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferLimits {
    /// Polls after the post before the outcome is declared unknown.
    pub deadline_polls: NonZeroU32,
    /// Completions taken per poll (at most [`POLL_ENTRIES_MAX`]).
    pub poll_entries: NonZeroUsize,
}

impl Default for TransferLimits {
    fn default() -> Self {
        Self {
            deadline_polls: NonZeroU32::new(4).expect("4 is not zero"),
            poll_entries: NonZeroUsize::new(POLL_ENTRIES_MAX).expect("the limit is not zero"),
        }
    }
}

/// How one transfer ended. Every variant but `Unknown` leaves the slot lent and usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferOutcome {
    /// The bytes moved.
    Done { len_bytes: u64 },
    /// The NIC finished the request with an error; it no longer touches the slot.
    Failed { status: CompletionStatus },
    /// No completion by the deadline: the slot's region is quarantined.
    Unknown { region: RegionId, polls: u32 },
}

/// What the glue saw, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferCounters {
    pub posted: u64,
    pub done: u64,
    pub failed: u64,
    pub unknown: u64,
    /// Completions of requests already completed.
    pub duplicates_ignored: u64,
    /// Completions of requests whose slot was already quarantined; none freed anything.
    pub late_after_quarantine: u64,
    /// Completions naming a request this glue never posted.
    pub unknown_ids_ignored: u64,
    /// Regions returned by fences.
    pub fenced: u64,
}

/// Transfers through one endpoint.
#[derive(Debug)]
pub struct Transfers {
    limits: TransferLimits,
    next_request: u64,
    /// Requests whose slot was quarantined, until a fence. At most one per pool slot, since a
    /// quarantined slot cannot be posted again before the fence returns it.
    abandoned: BTreeMap<WorkRequestId, RegionId>,
    counters: TransferCounters,
    polled: Vec<WorkCompletion>,
}

impl Transfers {
    pub fn new(limits: TransferLimits) -> Self {
        let entries = limits.poll_entries.get().min(POLL_ENTRIES_MAX);
        Self {
            limits,
            next_request: 1,
            abandoned: BTreeMap::new(),
            counters: TransferCounters::default(),
            polled: Vec::with_capacity(entries),
        }
    }

    pub fn counters(&self) -> TransferCounters {
        self.counters
    }

    /// Requests abandoned to quarantine and not yet fenced.
    pub fn abandoned(&self) -> usize {
        self.abandoned.len()
    }

    /// Moves `remote.len_bytes` between the front of `lease`'s slot and `remote`: `Read` pulls
    /// the peer's bytes into the slot, `Write` pushes the slot's bytes to the peer. `Err`
    /// means nothing was posted and nothing changed.
    pub fn run<M: PoolMemory, E: NicEndpoint>(
        &mut self,
        pool: &mut RegisteredPool<M>,
        endpoint: &mut E,
        lease: &SlotLease,
        opcode: Opcode,
        remote: RemoteSlice,
    ) -> Result<TransferOutcome, NicError> {
        let id = WorkRequestId(self.next_request);
        let next = self
            .next_request
            .checked_add(1)
            .ok_or(NicError::RequestIdsExhausted { at: self.next_request })?;
        let slot =
            pool.slot_bytes_mut(lease).ok_or(NicError::LeaseNotUsable { region: lease.region })?;
        let slot_bytes = slot.len() as u64;
        let local = usize::try_from(remote.len_bytes)
            .ok()
            .and_then(|len| slot.get_mut(..len))
            .ok_or(NicError::TooLong { len_bytes: remote.len_bytes, slot_bytes })?;
        let request = WorkRequest { id, opcode, lkey: local_key(lease.binding), remote };
        endpoint.post(request, local)?;
        self.next_request = next;
        self.counters.posted += 1;

        let entries = self.limits.poll_entries.get().min(POLL_ENTRIES_MAX);
        for _ in 1..=self.limits.deadline_polls.get() {
            self.polled.clear();
            endpoint.poll(&mut self.polled, entries);
            let mut mine = None;
            for wc in std::mem::take(&mut self.polled) {
                if wc.id == id && mine.is_none() {
                    mine = Some(wc);
                } else {
                    self.absorb_one(pool, wc)?;
                }
            }
            if let Some(wc) = mine {
                return Ok(if wc.status == CompletionStatus::Success {
                    self.counters.done += 1;
                    TransferOutcome::Done { len_bytes: wc.len_bytes }
                } else {
                    self.counters.failed += 1;
                    TransferOutcome::Failed { status: wc.status }
                });
            }
        }
        let outcome = pool.complete(lease.region, Completion::Unknown)?;
        assert_eq!(outcome, CompleteOutcome::Quarantined, "a lent slot must quarantine");
        self.abandoned.insert(id, lease.region);
        self.counters.unknown += 1;
        Ok(TransferOutcome::Unknown {
            region: lease.region,
            polls: self.limits.deadline_polls.get(),
        })
    }

    /// Returns a slot whose transfer retired (done or failed) to the pool.
    pub fn release<M: PoolMemory>(
        &mut self,
        pool: &mut RegisteredPool<M>,
        lease: &SlotLease,
    ) -> Result<CompleteOutcome, NicError> {
        Ok(pool.complete(lease.region, Completion::Retired)?)
    }

    /// Polls once outside a transfer and sorts what arrived; returns how many completions.
    pub fn absorb<M: PoolMemory, E: NicEndpoint>(
        &mut self,
        pool: &mut RegisteredPool<M>,
        endpoint: &mut E,
    ) -> Result<usize, NicError> {
        self.polled.clear();
        let entries = self.limits.poll_entries.get().min(POLL_ENTRIES_MAX);
        let n = endpoint.poll(&mut self.polled, entries);
        for wc in std::mem::take(&mut self.polled) {
            self.absorb_one(pool, wc)?;
        }
        Ok(n)
    }

    /// A completion nobody is waiting for. Every id below `next_request` was posted and has
    /// either been matched already or been abandoned (a reset drops the rest at a fence), so
    /// one that is not abandoned is a duplicate.
    fn absorb_one<M: PoolMemory>(
        &mut self,
        pool: &mut RegisteredPool<M>,
        wc: WorkCompletion,
    ) -> Result<(), NicError> {
        if let Some(region) = self.abandoned.remove(&wc.id) {
            // The contract's own rule, asserted here too: a late completion frees nothing. The
            // region may already be gone through a drained attestation; its id is never reused,
            // so the completion cannot reach whoever holds the slot now.
            match pool.complete(region, Completion::Retired) {
                Ok(outcome) => assert_eq!(
                    outcome,
                    CompleteOutcome::StillQuarantined,
                    "a late completion freed {region}"
                ),
                Err(PoolError::Registry(RegistryError::Unknown(_))) => {}
                Err(e) => return Err(e.into()),
            }
            self.counters.late_after_quarantine += 1;
        } else if wc.id.0 < self.next_request {
            self.counters.duplicates_ignored += 1;
        } else {
            self.counters.unknown_ids_ignored += 1;
        }
        Ok(())
    }

    /// The epoch fence for this endpoint: reset its queue pair so nothing posted before can
    /// still touch memory, advance the pool's epoch, then reclaim every slot lent before it.
    /// If the epoch cannot advance, nothing comes back.
    pub fn fence<M: PoolMemory, E: NicEndpoint>(
        &mut self,
        pool: &mut RegisteredPool<M>,
        endpoint: &mut E,
    ) -> Result<Vec<ReclaimProof>, NicError> {
        endpoint.reset();
        let epoch = pool.bump_epoch()?;
        let proofs = pool.reclaim_fenced(epoch)?;
        let reclaimed: std::collections::BTreeSet<RegionId> =
            proofs.iter().map(|p| p.region()).collect();
        self.abandoned.retain(|_, region| !reclaimed.contains(region));
        self.counters.fenced += proofs.len() as u64;
        Ok(proofs)
    }
}
