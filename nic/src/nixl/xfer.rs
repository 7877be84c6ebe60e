//! Moves one block between a leased [`NixlSlots`] slot and a peer's [`RemoteBlock`] (UCX) or a
//! [`NixlFile`] range (POSIX), and maps what NIXL reports onto the registration contract the
//! way [`crate::transfer`] does for verbs:
//!
//! | NIXL says | outcome | the slot |
//! |---|---|---|
//! | post or status: success | [`NixlOutcome::Done`] | lent and reusable ([`NixlTransfers::release`]) |
//! | create or post refused (nothing posted) | `Err(NicError)` | lent, untouched |
//! | an error status after posting | [`NixlOutcome::Unknown`] (`ErrorAfterPost`) | quarantined |
//! | still in progress at the deadline | [`NixlOutcome::Unknown`] (`DeadlinePassed`) | quarantined |
//! | peer vanished | one of the two rows above | quarantined |
//!
//! NIXL does not promise that a backend has stopped touching memory after an error status or
//! while a request is in flight, so both are unknown outcomes. A late success or error
//! ([`NixlTransfers::poll_abandoned`]), a lease expiry or a known-idle attestation never frees
//! the slot; only [`NixlTransfers::fence`] does: it releases (aborts) the abandoned requests,
//! invalidates the metadata of the peers they targeted so no connection to them survives,
//! advances the pool's epoch and reclaims every slot lent before it.
//!
//! The deadline is wall-clock ([`NixlLimits::deadline`]); the wait spins, then yields, and
//! never sleeps.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use gpucache_dataplane::lifecycle::ReclaimProof;
use gpucache_dataplane::registry::{
    CompleteOutcome, Completion, PoolError, RegionId, RegisteredPool, RegistryError, SlotLease,
};
use nixl_sys::{MemType, XferDescList, XferOp, XferRequest, XferStatus};

use super::agent::call_failed;
use super::agent::{NixlAgent, NixlBackend};
use super::common::ABANDONED_MAX;
use super::file::NixlFile;
use super::memory::NixlSlots;
use super::wire::{BlockMem, RemoteBlock};
use crate::error::NicError;

/// Default wall-clock deadline for one block.
pub const DEADLINE_DEFAULT_MS: u64 = 5_000;
/// Status polls that spin before the wait starts yielding the thread.
pub const SPINS_BEFORE_YIELD_DEFAULT: u32 = 256;

/// How long a transfer waits and how much it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NixlLimits {
    /// From the post to giving up (the outcome is then unknown).
    pub deadline: Duration,
    /// Busy polls before each further poll yields the thread.
    pub spins_before_yield: u32,
    /// Unknown-outcome requests kept until a fence (at most [`ABANDONED_MAX`]).
    pub abandoned_max: usize,
}

impl Default for NixlLimits {
    fn default() -> Self {
        Self {
            deadline: Duration::from_millis(DEADLINE_DEFAULT_MS),
            spins_before_yield: SPINS_BEFORE_YIELD_DEFAULT,
            abandoned_max: ABANDONED_MAX,
        }
    }
}

/// Why an outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownCause {
    /// Still in progress when the deadline passed.
    DeadlinePassed,
    /// NIXL reported an error after the request was posted.
    ErrorAfterPost,
}

/// How one transfer ended. `Done` leaves the slot lent and usable; `Unknown` quarantined it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NixlOutcome {
    Done { len_bytes: u64, elapsed: Duration },
    Unknown { region: RegionId, cause: UnknownCause },
}

/// What the transfers saw, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NixlCounters {
    pub posted: u64,
    pub done: u64,
    /// Refused by create or post: nothing was posted.
    pub refused: u64,
    pub unknown_deadline: u64,
    pub unknown_error: u64,
    /// Abandoned requests that later reported success; none freed anything.
    pub late_done: u64,
    /// Abandoned requests that later reported an error; none freed anything.
    pub late_error: u64,
    /// Abandoned request handles released by fences.
    pub released: u64,
    /// Peers whose metadata fences invalidated.
    pub peers_invalidated: u64,
    /// Slots returned by fences.
    pub fenced: u64,
}

struct Abandoned {
    request: XferRequest,
    region: RegionId,
    /// The peer it targeted; `None` for a file on this host.
    peer: Option<String>,
    settled: bool,
}

impl std::fmt::Debug for Abandoned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Abandoned")
            .field("region", &self.region)
            .field("peer", &self.peer)
            .field("settled", &self.settled)
            .finish_non_exhaustive()
    }
}

/// Transfers through one agent. Not thread-safe by itself: one owner drives it.
#[derive(Debug)]
pub struct NixlTransfers {
    limits: NixlLimits,
    abandoned: Vec<Abandoned>,
    counters: NixlCounters,
}

/// Where the other end of a transfer is.
struct Target<'a> {
    agent: &'a str,
    list: XferDescList<'a>,
    backend: NixlBackend,
    peer: Option<String>,
}

impl NixlTransfers {
    pub fn new(limits: NixlLimits) -> Self {
        let limits =
            NixlLimits { abandoned_max: limits.abandoned_max.min(ABANDONED_MAX), ..limits };
        Self { limits, abandoned: Vec::new(), counters: NixlCounters::default() }
    }

    pub fn counters(&self) -> NixlCounters {
        self.counters
    }

    /// Requests with an unknown outcome not yet fenced.
    pub fn abandoned(&self) -> usize {
        self.abandoned.len()
    }

    /// Pulls `remote`'s bytes into the front of `lease`'s slot.
    pub fn read(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
        remote: &RemoteBlock,
    ) -> Result<NixlOutcome, NicError> {
        self.remote(agent, pool, lease, XferOp::Read, remote)
    }

    /// Pushes the front of `lease`'s slot to `remote`.
    pub fn write(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
        remote: &RemoteBlock,
    ) -> Result<NixlOutcome, NicError> {
        self.remote(agent, pool, lease, XferOp::Write, remote)
    }

    /// Reads `len_bytes` at `offset` of `file` into the front of `lease`'s slot.
    pub fn read_file(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
        file: &NixlFile,
        offset: u64,
        len_bytes: u64,
    ) -> Result<NixlOutcome, NicError> {
        self.file(agent, pool, lease, XferOp::Read, file, offset, len_bytes)
    }

    /// Writes the front `len_bytes` of `lease`'s slot to `file` at `offset`.
    pub fn write_file(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
        file: &NixlFile,
        offset: u64,
        len_bytes: u64,
    ) -> Result<NixlOutcome, NicError> {
        self.file(agent, pool, lease, XferOp::Write, file, offset, len_bytes)
    }

    fn remote(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
        op: XferOp,
        remote: &RemoteBlock,
    ) -> Result<NixlOutcome, NicError> {
        if !agent.knows_peer(&remote.agent) {
            return Err(NicError::NixlPeerUnknown { agent: remote.agent.clone() });
        }
        let mem = match remote.mem {
            BlockMem::Dram => MemType::Dram,
            BlockMem::Vram => MemType::Vram,
        };
        let mut list = XferDescList::new(mem).map_err(call_failed("createXferDlist"))?;
        let addr = usize::try_from(remote.addr);
        let len = usize::try_from(remote.len_bytes);
        let (Ok(addr), Ok(len)) = (addr, len) else {
            return Err(NicError::TooLong { len_bytes: remote.len_bytes, slot_bytes: 0 });
        };
        list.add_desc(addr, len, remote.dev_id);
        let target = Target {
            agent: &remote.agent,
            list,
            backend: NixlBackend::Ucx,
            peer: Some(remote.agent.clone()),
        };
        self.run(agent, pool, lease, op, remote.len_bytes, target)
    }

    #[allow(clippy::too_many_arguments)]
    fn file(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
        op: XferOp,
        file: &NixlFile,
        offset: u64,
        len_bytes: u64,
    ) -> Result<NixlOutcome, NicError> {
        file.check(op == XferOp::Write, offset, len_bytes)?;
        let mut list = XferDescList::new(MemType::File).map_err(call_failed("createXferDlist"))?;
        // `check` bounded both by the registration's usize length.
        let (Ok(at), Ok(len)) = (usize::try_from(offset), usize::try_from(len_bytes)) else {
            return Err(NicError::NixlFileRange {
                offset,
                len_bytes,
                limit_bytes: file.registered_bytes(),
            });
        };
        list.add_desc(at, len, file.fd() as u64);
        let target = Target { agent: agent.name(), list, backend: NixlBackend::Posix, peer: None };
        self.run(agent, pool, lease, op, len_bytes, target)
    }

    fn run(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
        op: XferOp,
        len_bytes: u64,
        target: Target<'_>,
    ) -> Result<NixlOutcome, NicError> {
        if self.abandoned.len() >= self.limits.abandoned_max {
            return Err(NicError::QueueFull {
                outstanding: self.abandoned.len(),
                depth: self.limits.abandoned_max,
            });
        }
        let slot =
            pool.slot_bytes_mut(lease).ok_or(NicError::LeaseNotUsable { region: lease.region })?;
        let slot_bytes = slot.len() as u64;
        let local = usize::try_from(len_bytes)
            .ok()
            .filter(|n| *n > 0)
            .and_then(|n| slot.get_mut(..n))
            .ok_or(NicError::TooLong { len_bytes, slot_bytes })?;
        let mut local_list =
            XferDescList::new(MemType::Dram).map_err(call_failed("createXferDlist"))?;
        local_list.add_desc(local.as_mut_ptr().expose_provenance(), local.len(), 0);
        let args = agent.args_for(target.backend)?;
        let raw = agent.raw();
        let request = raw
            .create_xfer_req(op, &local_list, &target.list, target.agent, Some(&args))
            .map_err(|e| {
                self.counters.refused += 1;
                call_failed("createXferReq")(e)
            })?;
        let started = Instant::now();
        let in_progress = raw.post_xfer_req(&request, None).map_err(|e| {
            self.counters.refused += 1;
            call_failed("postXferReq")(e)
        })?;
        self.counters.posted += 1;
        let cause = if in_progress { self.wait(agent, &request, started) } else { None };
        let Some(cause) = cause else {
            self.counters.done += 1;
            return Ok(NixlOutcome::Done { len_bytes, elapsed: started.elapsed() });
        };
        match cause {
            UnknownCause::DeadlinePassed => self.counters.unknown_deadline += 1,
            UnknownCause::ErrorAfterPost => self.counters.unknown_error += 1,
        }
        tracing::warn!(region = %lease.region, ?cause, peer = ?target.peer, "NIXL outcome unknown; slot quarantined");
        // Held before the pool hears of it: whatever the pool answers, the request stays until
        // the fence and the caller is told the outcome is unknown, never that nothing happened.
        self.abandoned.push(Abandoned {
            request,
            region: lease.region,
            peer: target.peer,
            settled: false,
        });
        if let Err(e) = pool.complete(lease.region, Completion::Unknown) {
            tracing::warn!(region = %lease.region, error = %e, "the pool refused the quarantine");
        }
        Ok(NixlOutcome::Unknown { region: lease.region, cause })
    }

    /// Polls `request` until it is done (`None`) or its outcome is unknown.
    fn wait(
        &self,
        agent: &NixlAgent,
        request: &XferRequest,
        started: Instant,
    ) -> Option<UnknownCause> {
        let mut polls: u32 = 0;
        loop {
            match agent.raw().get_xfer_status(request) {
                Ok(XferStatus::Success) => return None,
                Err(_) => return Some(UnknownCause::ErrorAfterPost),
                Ok(XferStatus::InProgress) => {}
            }
            if started.elapsed() >= self.limits.deadline {
                return Some(UnknownCause::DeadlinePassed);
            }
            polls = polls.saturating_add(1);
            if polls > self.limits.spins_before_yield {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Returns a slot whose transfer is done to the pool.
    pub fn release(
        &mut self,
        pool: &mut RegisteredPool<NixlSlots>,
        lease: &SlotLease,
    ) -> Result<CompleteOutcome, NicError> {
        Ok(pool.complete(lease.region, Completion::Retired)?)
    }

    /// Asks NIXL once about every abandoned request that has not settled and counts the late
    /// ones. Returns how many settled now. A late outcome frees nothing: the slot stays
    /// quarantined until [`Self::fence`].
    pub fn poll_abandoned(
        &mut self,
        agent: &NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
    ) -> Result<usize, NicError> {
        let mut settled = 0;
        for entry in self.abandoned.iter_mut().filter(|a| !a.settled) {
            match agent.raw().get_xfer_status(&entry.request) {
                Ok(XferStatus::InProgress) => continue,
                Ok(XferStatus::Success) => self.counters.late_done += 1,
                Err(_) => self.counters.late_error += 1,
            }
            entry.settled = true;
            settled += 1;
            // The contract's own rule, asserted here too: a late outcome frees nothing.
            match pool.complete(entry.region, Completion::Retired) {
                Ok(outcome) => assert_eq!(
                    outcome,
                    CompleteOutcome::StillQuarantined,
                    "a late NIXL outcome freed {}",
                    entry.region
                ),
                Err(PoolError::Registry(RegistryError::Unknown(_))) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(settled)
    }

    /// The epoch fence: releases every abandoned request (NIXL aborts one still in flight),
    /// invalidates the metadata of the peers they targeted (reload it to talk to them again),
    /// then [`NixlSlots::fence`]: a new registration (peers must load this agent's new
    /// metadata), a new epoch and every slot lent before it reclaimed. If that fails, nothing
    /// comes back (the requests are released either way; fence again).
    pub fn fence(
        &mut self,
        agent: &mut NixlAgent,
        pool: &mut RegisteredPool<NixlSlots>,
    ) -> Result<Vec<ReclaimProof>, NicError> {
        let abandoned = std::mem::take(&mut self.abandoned);
        let mut peers = BTreeSet::new();
        for entry in abandoned {
            peers.extend(entry.peer);
            drop(entry.request);
            self.counters.released += 1;
        }
        for peer in peers {
            if agent.forget_peer(&peer)? {
                self.counters.peers_invalidated += 1;
            }
        }
        let proofs = NixlSlots::fence(pool, agent)?;
        self.counters.fenced += proofs.len() as u64;
        Ok(proofs)
    }
}
