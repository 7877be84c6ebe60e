//! [`NixlStaging`]: the server's side of block transfers between GPUCache nodes over NIXL. It
//! implements the service's [`BlockStaging`] contract over one [`NixlAgent`] and one
//! [`RegisteredPool`] of [`NixlSlots`] (huge-page host memory registered as DRAM once).
//!
//! The server never posts a transfer: it leases a slot, fills it from the store (a GET) or
//! leaves it for the client to fill (a PUT), and describes it as a [`RemoteBlock`]. The client
//! READs or WRITEs it with its own agent. A stage's slot comes back on RELEASE or COMMIT_PUT;
//! a lease that runs out, or a PUT stage whose connection closed, quarantines it; only
//! [`BlockStaging::fence`] reclaims a quarantined slot.
//!
//! One lock guards the agent, the pool and the stage table. A STAGE_GET holds it while the
//! store copies each block into its slot, and a COMMIT_PUT while the store copies the slot out:
//! staging is serialised per server (see ADR 0018 for what would lift that).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::registry::{
    CompleteOutcome, Completion, PoolMemory, RegisteredPool, SlotLease,
};
use gpucache_dataplane::store::{Get, Put, Retirement, StoreError};
use gpucache_storage::host::pool::HugePagePolicy;
use gpucache_wire::staging::{
    BlockStaging, FillSlot, PutIntent, StageId, StageOwner, StagedGet, StagedSlot, StagingError,
    StagingLimits, StagingStats, StoreSlot,
};

use super::agent::{NixlAgent, NixlBackend};
use super::memory::NixlSlots;
use crate::error::NicError;

/// Fewest slots a staging pool may have.
pub const STAGING_SLOTS_MIN: usize = 1;
/// Most slots a staging pool may have (each is a region in the pool's table).
pub const STAGING_SLOTS_MAX: usize = 65_536;
/// Most connections whose attach this side remembers (one per peer connection that attached;
/// a closed connection's entry goes).
pub const ATTACHED_MAX: usize = super::common::PEERS_MAX;

/// How to build a [`NixlStaging`].
#[derive(Debug, Clone)]
pub struct NixlStagingConfig {
    /// The NIXL agent's name (unique among the agents that exchange metadata).
    pub agent_name: String,
    /// Bytes per slot: the largest block that moves over NIXL.
    pub slot_bytes: usize,
    /// Slots in the pool.
    pub slots: usize,
    pub limits: StagingLimits,
    pub huge_pages: HugePagePolicy,
}

impl NixlStagingConfig {
    /// Creates the agent (UCX backend), maps and registers the pool. Fails closed with the typed
    /// reason when NIXL cannot run here.
    pub fn build(self) -> Result<NixlStaging, NicError> {
        if !(STAGING_SLOTS_MIN..=STAGING_SLOTS_MAX).contains(&self.slots) || self.slot_bytes == 0 {
            return Err(NicError::TooLong {
                len_bytes: self.slot_bytes as u64,
                slot_bytes: self.slots as u64,
            });
        }
        let mut agent = NixlAgent::new(&self.agent_name)?;
        agent.enable(NixlBackend::Ucx)?;
        let pool = NixlSlots::pool(&agent, self.slots, self.slot_bytes, self.huge_pages)?;
        tracing::info!(
            agent = %self.agent_name,
            slots = self.slots,
            slot_bytes = self.slot_bytes,
            "NIXL block staging ready"
        );
        Ok(NixlStaging {
            slot_bytes: self.slot_bytes as u64,
            limits: self.limits,
            inner: Mutex::new(Inner {
                agent,
                pool,
                stages: BTreeMap::new(),
                attached: BTreeMap::new(),
                next_stage: 1,
                stats: StagingStats::default(),
            }),
        })
    }
}

#[derive(Debug)]
struct Stage {
    lease: SlotLease,
    owner: StageOwner,
    /// What a PUT stage stores when committed; `None` for a GET stage.
    put: Option<PutIntent>,
}

#[derive(Debug)]
struct Inner {
    agent: NixlAgent,
    pool: RegisteredPool<NixlSlots>,
    stages: BTreeMap<StageId, Stage>,
    /// Connection → the registration generation it attached to (at most [`ATTACHED_MAX`]).
    attached: BTreeMap<u64, u64>,
    next_stage: u64,
    stats: StagingStats,
}

/// NIXL-registered staging memory of one server.
#[derive(Debug)]
pub struct NixlStaging {
    slot_bytes: u64,
    limits: StagingLimits,
    inner: Mutex<Inner>,
}

fn memory_error(e: impl std::fmt::Display) -> StagingError {
    StagingError::Memory { detail: e.to_string() }
}

impl NixlStaging {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a slot half-settled in a way that frees
        // it: every free goes through the pool's own checks. Keep serving.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The agent's name (what descriptors name).
    pub fn agent_name(&self) -> String {
        self.lock().agent.name().to_owned()
    }

    /// How many times the staging memory was registered (1, plus one per fence).
    pub fn registration(&self) -> u64 {
        self.lock().pool.memory().generation()
    }
}

impl Inner {
    /// Refuses the stage ops of a connection that attached before the current registration.
    fn current(&self, owner: &StageOwner) -> Result<(), StagingError> {
        let current = self.pool.memory().generation();
        match self.attached.get(&owner.connection) {
            Some(&attached) if attached != current => {
                Err(StagingError::Reattach { attached, current })
            }
            _ => Ok(()),
        }
    }

    /// Refuses `asked` more stages past a limit or the free slots.
    fn budget(
        &self,
        limits: &StagingLimits,
        owner: &StageOwner,
        asked: usize,
    ) -> Result<(), StagingError> {
        let mine = self.stages.values().filter(|s| s.owner.connection == owner.connection).count();
        if mine + asked > limits.per_connection_max {
            return Err(StagingError::OverBudget {
                scope: "the connection",
                open: mine,
                asked,
                max: limits.per_connection_max,
            });
        }
        let open = self.stages.len();
        if open + asked > limits.staged_max {
            return Err(StagingError::OverBudget {
                scope: "the server",
                open,
                asked,
                max: limits.staged_max,
            });
        }
        let free = self.pool.free_slots();
        if asked > free {
            let total = PoolMemory::slot_count(self.pool.memory());
            return Err(StagingError::OverBudget {
                scope: "the staging pool",
                open: total - free,
                asked,
                max: total,
            });
        }
        Ok(())
    }

    fn next_id(&mut self) -> StageId {
        let id = StageId(self.next_stage);
        self.next_stage += 1;
        id
    }

    fn settle(&mut self, lease: &SlotLease, completion: Completion) -> Option<CompleteOutcome> {
        let outcome = self.pool.complete(lease.region, completion).ok()?;
        match outcome {
            CompleteOutcome::Freed => self.stats.released += 1,
            CompleteOutcome::Quarantined => self.stats.quarantined += 1,
            CompleteOutcome::StillQuarantined => {}
        }
        Some(outcome)
    }

    fn describe(&self, lease: &SlotLease, len: u64) -> Result<Vec<u8>, StagingError> {
        let block = NixlSlots::block(&self.pool, lease, len).map_err(memory_error)?;
        block.encode().map_err(memory_error)
    }

    /// The open stage `stage` of `owner`'s tenant, taken out of the table.
    fn take(&mut self, owner: &StageOwner, stage: StageId) -> Result<Stage, StagingError> {
        match self.stages.get(&stage) {
            Some(s) if s.owner.tenant == owner.tenant => {
                Ok(self.stages.remove(&stage).expect("present"))
            }
            _ => Err(StagingError::UnknownStage { stage }),
        }
    }
}

impl BlockStaging for NixlStaging {
    fn attach(&self, owner: &StageOwner, peer_metadata: &[u8]) -> Result<Vec<u8>, StagingError> {
        let mut inner = self.lock();
        let known = inner.attached.contains_key(&owner.connection);
        if !known && inner.attached.len() >= ATTACHED_MAX {
            return Err(StagingError::Peer {
                detail: format!("{} connections attached (limit {ATTACHED_MAX})", ATTACHED_MAX),
            });
        }
        let peer = inner
            .agent
            .load_peer(peer_metadata)
            .map_err(|e| StagingError::Peer { detail: e.to_string() })?;
        tracing::debug!(%peer, "NIXL peer attached");
        let metadata = inner.agent.local_metadata().map_err(memory_error)?;
        let generation = inner.pool.memory().generation();
        inner.attached.insert(owner.connection, generation);
        Ok(metadata)
    }

    fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    fn stage_get(
        &self,
        owner: &StageOwner,
        now_ms: u64,
        fills: &mut [&mut FillSlot<'_>],
    ) -> Result<Vec<Result<StagedGet, StoreError>>, StagingError> {
        let mut inner = self.lock();
        inner.current(owner)?;
        inner.budget(&self.limits, owner, fills.len())?;
        let deadline = now_ms.saturating_add(self.limits.stage_lease_ms);
        let leases =
            inner.pool.checkout(&owner.tenant, fills.len(), Some(deadline)).map_err(|e| {
                StagingError::OverBudget {
                    scope: "the staging pool",
                    open: 0,
                    asked: fills.len(),
                    max: inner_free(&e),
                }
            })?;
        let mut out = Vec::with_capacity(fills.len());
        for (lease, fill) in leases.iter().zip(fills.iter_mut()) {
            let Some(slot) = inner.pool.slot_bytes_mut(lease) else {
                out.push(Err(StoreError::Backend {
                    operation: "get",
                    detail: format!("staging slot of {} is not usable", lease.region),
                    retirement: Retirement::Retired,
                }));
                continue;
            };
            let got = fill(slot);
            let staged = match got {
                Ok(Get::Hit { len, checksum }) => {
                    // Paired with the store's own check: the slot holds what the answer says.
                    let in_slot = usize::try_from(len).ok().and_then(|n| slot.get(..n));
                    if in_slot.map(Checksum::of) != Some(checksum) {
                        Err(StoreError::Backend {
                            operation: "get",
                            detail: format!("staged bytes of {} do not match", lease.region),
                            retirement: Retirement::Retired,
                        })
                    } else {
                        match inner.describe(lease, len) {
                            Ok(descriptor) => {
                                let stage = inner.next_id();
                                inner.stages.insert(
                                    stage,
                                    Stage { lease: *lease, owner: owner.clone(), put: None },
                                );
                                inner.stats.staged += 1;
                                out.push(Ok(StagedGet::Staged {
                                    slot: StagedSlot {
                                        stage,
                                        descriptor,
                                        lease_ms: self.limits.stage_lease_ms,
                                    },
                                    len,
                                    checksum,
                                }));
                                continue;
                            }
                            Err(e) => Err(StoreError::Backend {
                                operation: "get",
                                detail: e.to_string(),
                                retirement: Retirement::Retired,
                            }),
                        }
                    }
                }
                Ok(Get::Miss(m)) => Ok(StagedGet::Miss(m)),
                Err(e) => Err(e),
            };
            // Not staged: the slot goes back, unless the store may still be writing it.
            let unknown = matches!(&staged, Err(e) if e.retirement() == Retirement::Unknown);
            let completion = if unknown { Completion::Unknown } else { Completion::Retired };
            inner.settle(lease, completion);
            out.push(staged);
        }
        Ok(out)
    }

    fn reserve_put(
        &self,
        owner: &StageOwner,
        now_ms: u64,
        intent: PutIntent,
    ) -> Result<StagedSlot, StagingError> {
        if intent.len == 0 || intent.len > self.slot_bytes {
            return Err(StagingError::TooLarge {
                len_bytes: intent.len,
                slot_bytes: self.slot_bytes,
            });
        }
        let mut inner = self.lock();
        inner.current(owner)?;
        inner.budget(&self.limits, owner, 1)?;
        let deadline = now_ms.saturating_add(self.limits.stage_lease_ms);
        let lease = inner.pool.checkout(&owner.tenant, 1, Some(deadline)).map_err(|e| {
            StagingError::OverBudget {
                scope: "the staging pool",
                open: 0,
                asked: 1,
                max: inner_free(&e),
            }
        })?[0];
        let descriptor = match inner.describe(&lease, intent.len) {
            Ok(d) => d,
            Err(e) => {
                inner.settle(&lease, Completion::Retired);
                return Err(e);
            }
        };
        let stage = inner.next_id();
        inner.stages.insert(stage, Stage { lease, owner: owner.clone(), put: Some(intent) });
        inner.stats.staged += 1;
        Ok(StagedSlot { stage, descriptor, lease_ms: self.limits.stage_lease_ms })
    }

    fn commit_put(
        &self,
        owner: &StageOwner,
        stage: StageId,
        store: &mut StoreSlot<'_>,
    ) -> Result<Result<Put, StoreError>, StagingError> {
        let mut inner = self.lock();
        let open = inner.take(owner, stage)?;
        let Some(intent) = open.put else {
            // A GET stage cannot be committed: put it back untouched.
            inner.stages.insert(stage, open);
            return Err(StagingError::UnknownStage { stage });
        };
        let lease = open.lease;
        let len = usize::try_from(intent.len).unwrap_or(usize::MAX);
        let Some(bytes) = inner.pool.slot_bytes_mut(&lease).and_then(|s| s.get(..len)) else {
            // Quarantined (its lease ran out): it stays so until a fence.
            return Err(StagingError::Memory {
                detail: format!("{stage}'s slot is quarantined (its lease ran out)"),
            });
        };
        let computed = Checksum::of(bytes);
        if computed != intent.checksum {
            inner.settle(&lease, Completion::Retired);
            return Err(StagingError::ChecksumMismatch {
                stage,
                announced: intent.checksum.0,
                computed: computed.0,
            });
        }
        let stored = store(&intent, bytes);
        if stored.is_ok() {
            inner.stats.committed += 1;
        }
        // The store copied synchronously: it is done with the slot either way.
        inner.settle(&lease, Completion::Retired);
        Ok(stored)
    }

    fn release(&self, owner: &StageOwner, stages: &[StageId]) -> Vec<bool> {
        let mut inner = self.lock();
        stages
            .iter()
            .map(|stage| match inner.take(owner, *stage) {
                Ok(open) => {
                    inner.settle(&open.lease, Completion::Retired);
                    true
                }
                Err(_) => false,
            })
            .collect()
    }

    fn connection_closed(&self, connection: u64) {
        let mut inner = self.lock();
        inner.attached.remove(&connection);
        let ids: Vec<StageId> = inner
            .stages
            .iter()
            .filter(|(_, s)| s.owner.connection == connection)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let Some(open) = inner.stages.remove(&id) else { continue };
            // The peer may still be writing a PUT stage, or reading a GET stage it never
            // released because its READ's end is unknown: neither slot may be lent again.
            inner.settle(&open.lease, Completion::Unknown);
        }
    }

    fn expire(&self, now_ms: u64) -> usize {
        let mut inner = self.lock();
        let expired = inner.pool.expire_leases(now_ms).len();
        inner.stats.quarantined += expired as u64;
        expired
    }

    fn fence(&self) -> Result<usize, StagingError> {
        let mut inner = self.lock();
        let peers: Vec<String> = inner.agent.peers().map(str::to_owned).collect();
        for peer in peers {
            inner.agent.forget_peer(&peer).map_err(memory_error)?;
        }
        // A new registration (descriptors and metadata handed out before it are stale, and every
        // attached connection must attach again before staging more), then the new epoch.
        let Inner { agent, pool, .. } = &mut *inner;
        let proofs = NixlSlots::fence(pool, agent).map_err(memory_error)?;
        // Every stage was lent before the new epoch: all of them ended.
        inner.stages.clear();
        inner.stats.fenced += proofs.len() as u64;
        Ok(proofs.len())
    }

    fn stats(&self) -> StagingStats {
        let inner = self.lock();
        let counts = inner.pool.table().counts();
        StagingStats {
            open: inner.stages.len() as u64,
            free_slots: inner.pool.free_slots() as u64,
            quarantined_slots: counts.quarantined as u64,
            peers: inner.agent.peers().count() as u64,
            slot_bytes: self.slot_bytes,
            ..inner.stats
        }
    }

    fn registered(&self) -> bool {
        self.lock().pool.memory().registered()
    }
}

fn inner_free(e: &gpucache_dataplane::registry::PoolError) -> usize {
    match e {
        gpucache_dataplane::registry::PoolError::Exhausted { total, .. } => *total,
        _ => 0,
    }
}
