//! Registered regions, epochs, quarantine and reclaim: the contract for every buffer that is
//! handed to something that may still touch it (a NIC, a GPU stream, a DPU queue, an io_uring
//! submission, a remote peer, a writer holding a reservation).
//!
//! Rules, enforced here and nowhere else:
//! - Region ids are monotonic and never recycled.
//! - An unknown completion quarantines. Timeout, lease expiry, a late "retired" completion and a
//!   "known idle" report never free a quarantined region.
//! - A quarantined region comes back only through [`Attestation::Drained`] from its owner tenant
//!   or an admin, or through [`RegionTable::bump_epoch`] then [`RegionTable::reclaim_fenced`]
//!   with the new epoch. If the epoch cannot advance, nothing lent out comes back.
//! - Both paths mint the [`ReclaimProof`] the block lifecycle demands.
//!
//! [`RegisteredPool`] applies the same table to a fixed set of slots of any memory kind (host
//! pages, huge pages, NIC-registered memory, GPU memory, a DPU slab) through [`PoolMemory`].

use std::collections::BTreeMap;
use std::fmt;

use crate::caller::Caller;
use crate::identity::TenantId;

/// A registration's id. Monotonic per table, never reused.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

impl fmt::Debug for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}
impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// A fencing epoch. I/O issued under an older epoch is refused by whoever enforces the fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

/// Why an epoch could not advance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EpochError {
    #[error("the epoch authority is unavailable: {detail}")]
    Unavailable { detail: String },
    #[error("epoch space exhausted at {at}")]
    Exhausted { at: Epoch },
}

/// Who decides the next epoch: a local counter, a persisted counter, or a shared authority
/// (etcd compare-and-swap). A failure leaves the current epoch in force.
pub trait EpochSource: Send + fmt::Debug {
    fn advance(&mut self, current: Epoch) -> Result<Epoch, EpochError>;
}

/// An in-process epoch counter.
#[derive(Debug, Default, Clone)]
pub struct LocalEpochs;

impl EpochSource for LocalEpochs {
    fn advance(&mut self, current: Epoch) -> Result<Epoch, EpochError> {
        current.0.checked_add(1).map(Epoch).ok_or(EpochError::Exhausted { at: current })
    }
}

/// What kind of memory a region lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary pageable or locked host memory.
    Host,
    /// Host memory on huge pages of the given size.
    HostHugePages { page_bytes: u64 },
    /// Host memory registered with a NIC (verbs memory region, NIXL DRAM descriptor).
    NicRegistered { transport: &'static str },
    /// Device memory of one GPU.
    Gpu { device: u32 },
    /// A DPU agent's slab.
    DpuSlab,
    /// Storage owned by a store (a file, an object).
    Storage,
}

/// Why a region was quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineCause {
    /// An operation on the region ended with an unknown outcome.
    UnknownCompletion,
    /// A writer's lease ran out before it committed or aborted.
    LeaseExpired,
    /// The peer or device that held the region vanished.
    PeerLost,
    /// A reader's transfer out of an evicting block has an unknown outcome.
    EvictionUnknown,
    /// The epoch moved on while an agent still held the region.
    Fenced,
}

/// How a quarantined region was proven idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReclaimCause {
    /// The owner (or an admin) attested that everything touching it has drained.
    Drained,
    /// An epoch fence: nothing from an older epoch can touch it any more.
    Fenced { epoch: Epoch },
}

/// Evidence, minted only by the registry, that nothing can touch a region any more: the only
/// way a quarantined block goes back to ABSENT (`crate::lifecycle::Transition::Reclaim`).
#[derive(Debug, PartialEq, Eq)]
pub struct ReclaimProof {
    region: RegionId,
    cause: ReclaimCause,
}

impl ReclaimProof {
    pub(crate) fn new(region: RegionId, cause: ReclaimCause) -> Self {
        Self { region, cause }
    }
    pub fn region(&self) -> RegionId {
        self.region
    }
    pub fn cause(&self) -> ReclaimCause {
        self.cause
    }
}

/// The outcome an agent reports for an operation on a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The agent has provably stopped touching the region.
    Retired,
    /// The agent may still touch it (timeout, lost completion, error after submission).
    Unknown,
}

/// What a caller asserts about a quarantined region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attestation {
    /// Every agent that could touch the region has drained: reclaim it.
    Drained,
    /// The region looks idle. Not proof: it stays quarantined.
    KnownIdle,
}

/// A region's state in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionState {
    /// Handed out: something may write or read it until it settles; an expiring lease
    /// quarantines it.
    Lent {
        lease_deadline_ms: Option<u64>,
    },
    /// Held by its store (committed bytes); nothing outside touches it.
    Held,
    Quarantined {
        cause: QuarantineCause,
    },
}

/// One registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub id: RegionId,
    pub owner: TenantId,
    pub kind: MemoryKind,
    pub bytes: u64,
    /// The epoch it was registered under.
    pub epoch: Epoch,
    pub state: RegionState,
}

/// Why a registry call was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    #[error("region table holds {regions} regions, its limit is {max}")]
    Full { regions: usize, max: usize },
    #[error("region {0} is not registered")]
    Unknown(RegionId),
    #[error("region {region} is {state}, which cannot {operation}")]
    WrongState { region: RegionId, state: &'static str, operation: &'static str },
    #[error("tenant {caller} may not attest region {region} owned by {owner}")]
    NotAuthorized { region: RegionId, caller: TenantId, owner: TenantId },
    #[error("reclaim_fenced with {given}, but the current epoch is {current}")]
    StaleEpoch { given: Epoch, current: Epoch },
    #[error("epoch did not advance: {0}")]
    Epoch(#[from] EpochError),
    #[error("region id space exhausted")]
    IdsExhausted,
}

fn state_name(s: RegionState) -> &'static str {
    match s {
        RegionState::Lent { .. } => "lent",
        RegionState::Held => "held",
        RegionState::Quarantined { .. } => "quarantined",
    }
}

/// The outcome of an attestation.
#[derive(Debug, PartialEq, Eq)]
pub enum AttestOutcome {
    Reclaimed(ReclaimProof),
    /// A `KnownIdle` report: recorded, nothing freed.
    StillQuarantined,
}

/// The outcome of [`RegionTable::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompleteOutcome {
    /// The region was lent and is now free.
    Freed,
    /// The region is now quarantined.
    Quarantined,
    /// The region was already quarantined; a late completion does not free it.
    StillQuarantined,
}

/// Counts of regions by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionCounts {
    pub lent: usize,
    pub held: usize,
    pub quarantined: usize,
    pub quarantined_bytes: u64,
}

/// All registrations of one owner (a store, a pool, a transport endpoint).
#[derive(Debug)]
pub struct RegionTable {
    regions: BTreeMap<RegionId, Region>,
    regions_max: usize,
    next_id: u64,
    epoch: Epoch,
    epochs: Box<dyn EpochSource>,
}

impl RegionTable {
    /// A table starting at `epoch` and at region id `first_id` (a restarted owner passes ids
    /// above any it handed out before, so ids stay unique across restarts).
    pub fn new(
        regions_max: usize,
        epoch: Epoch,
        first_id: u64,
        epochs: Box<dyn EpochSource>,
    ) -> Self {
        Self { regions: BTreeMap::new(), regions_max, next_id: first_id.max(1), epoch, epochs }
    }

    /// A table with a local epoch counter starting at epoch 1.
    pub fn local(regions_max: usize) -> Self {
        Self::new(regions_max, Epoch(1), 1, Box::new(LocalEpochs))
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }
    pub fn len(&self) -> usize {
        self.regions.len()
    }
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
    pub fn capacity_left(&self) -> usize {
        self.regions_max.saturating_sub(self.regions.len())
    }
    /// The id the next registration will get.
    pub fn next_id(&self) -> RegionId {
        RegionId(self.next_id)
    }
    pub fn get(&self, id: RegionId) -> Option<&Region> {
        self.regions.get(&id)
    }
    pub fn regions(&self) -> impl Iterator<Item = &Region> {
        self.regions.values()
    }

    pub fn counts(&self) -> RegionCounts {
        let mut c = RegionCounts::default();
        for r in self.regions.values() {
            match r.state {
                RegionState::Lent { .. } => c.lent += 1,
                RegionState::Held => c.held += 1,
                RegionState::Quarantined { .. } => {
                    c.quarantined += 1;
                    c.quarantined_bytes += r.bytes;
                }
            }
        }
        c
    }

    /// Registers a region lent to an agent under the current epoch.
    pub fn lend(
        &mut self,
        owner: &TenantId,
        kind: MemoryKind,
        bytes: u64,
        lease_deadline_ms: Option<u64>,
    ) -> Result<RegionId, RegistryError> {
        self.add(owner, kind, bytes, RegionState::Lent { lease_deadline_ms })
    }

    fn add(
        &mut self,
        owner: &TenantId,
        kind: MemoryKind,
        bytes: u64,
        state: RegionState,
    ) -> Result<RegionId, RegistryError> {
        if self.regions.len() >= self.regions_max {
            return Err(RegistryError::Full { regions: self.regions.len(), max: self.regions_max });
        }
        let id = RegionId(self.next_id);
        self.next_id = self.next_id.checked_add(1).ok_or(RegistryError::IdsExhausted)?;
        self.regions
            .insert(id, Region { id, owner: owner.clone(), kind, bytes, epoch: self.epoch, state });
        Ok(id)
    }

    /// A region its owner holds from the start, as [`Self::lend`] then [`Self::settle`] leave
    /// it: for a block an owner restores after a restart, which no agent writes.
    pub fn hold(
        &mut self,
        owner: &TenantId,
        kind: MemoryKind,
        bytes: u64,
    ) -> Result<RegionId, RegistryError> {
        self.add(owner, kind, bytes, RegionState::Held)
    }

    fn region_mut(&mut self, id: RegionId) -> Result<&mut Region, RegistryError> {
        self.regions.get_mut(&id).ok_or(RegistryError::Unknown(id))
    }

    /// A lent region's agent retired and its owner keeps the bytes (a committed block).
    pub fn settle(&mut self, id: RegionId) -> Result<(), RegistryError> {
        let r = self.region_mut(id)?;
        match r.state {
            RegionState::Lent { .. } => {
                r.state = RegionState::Held;
                Ok(())
            }
            s => Err(RegistryError::WrongState {
                region: id,
                state: state_name(s),
                operation: "settle",
            }),
        }
    }

    /// An agent reports the outcome of its work on a lent region.
    pub fn complete(
        &mut self,
        id: RegionId,
        completion: Completion,
    ) -> Result<CompleteOutcome, RegistryError> {
        let r = self.region_mut(id)?;
        match (r.state, completion) {
            (RegionState::Quarantined { .. }, _) => Ok(CompleteOutcome::StillQuarantined),
            (RegionState::Lent { .. }, Completion::Retired) => {
                self.regions.remove(&id);
                Ok(CompleteOutcome::Freed)
            }
            (RegionState::Lent { .. }, Completion::Unknown) => {
                r.state = RegionState::Quarantined { cause: QuarantineCause::UnknownCompletion };
                Ok(CompleteOutcome::Quarantined)
            }
            (s @ RegionState::Held, _) => Err(RegistryError::WrongState {
                region: id,
                state: state_name(s),
                operation: "complete",
            }),
        }
    }

    /// Drops a held region its owner no longer needs (an evicted block nobody is reading).
    pub fn release_held(&mut self, id: RegionId) -> Result<(), RegistryError> {
        let r = self.region_mut(id)?;
        match r.state {
            RegionState::Held => {
                self.regions.remove(&id);
                Ok(())
            }
            s => Err(RegistryError::WrongState {
                region: id,
                state: state_name(s),
                operation: "release",
            }),
        }
    }

    /// Quarantines a lent or held region.
    pub fn quarantine(
        &mut self,
        id: RegionId,
        cause: QuarantineCause,
    ) -> Result<(), RegistryError> {
        let r = self.region_mut(id)?;
        if let RegionState::Quarantined { .. } = r.state {
            return Ok(());
        }
        r.state = RegionState::Quarantined { cause };
        Ok(())
    }

    /// Quarantines every lent region whose lease has run out; returns them.
    pub fn expire_leases(&mut self, now_ms: u64) -> Vec<RegionId> {
        let mut expired = Vec::new();
        for r in self.regions.values_mut() {
            if let RegionState::Lent { lease_deadline_ms: Some(d) } = r.state
                && d <= now_ms
            {
                r.state = RegionState::Quarantined { cause: QuarantineCause::LeaseExpired };
                expired.push(r.id);
            }
        }
        expired
    }

    /// Applies an attestation from `caller` to a quarantined region.
    pub fn attest(
        &mut self,
        caller: &Caller,
        id: RegionId,
        attestation: Attestation,
    ) -> Result<AttestOutcome, RegistryError> {
        let r = self.regions.get(&id).ok_or(RegistryError::Unknown(id))?;
        if r.owner != caller.tenant && !caller.rights.admin {
            return Err(RegistryError::NotAuthorized {
                region: id,
                caller: caller.tenant.clone(),
                owner: r.owner.clone(),
            });
        }
        if !matches!(r.state, RegionState::Quarantined { .. }) {
            return Err(RegistryError::WrongState {
                region: id,
                state: state_name(r.state),
                operation: "be attested",
            });
        }
        match attestation {
            Attestation::KnownIdle => Ok(AttestOutcome::StillQuarantined),
            Attestation::Drained => {
                self.regions.remove(&id);
                Ok(AttestOutcome::Reclaimed(ReclaimProof::new(id, ReclaimCause::Drained)))
            }
        }
    }

    /// Advances the epoch through the epoch source. On failure the epoch is unchanged.
    pub fn bump_epoch(&mut self) -> Result<Epoch, RegistryError> {
        let next = self.epochs.advance(self.epoch)?;
        debug_assert!(next > self.epoch, "epoch source went backwards");
        if next <= self.epoch {
            return Err(RegistryError::Epoch(EpochError::Unavailable {
                detail: format!("source answered {next}, not above {}", self.epoch),
            }));
        }
        self.epoch = next;
        Ok(next)
    }

    /// Reclaims every lent or quarantined region registered before `epoch`, which must be the
    /// current epoch (so the fence is really up). Held regions are the owner's and stay.
    pub fn reclaim_fenced(&mut self, epoch: Epoch) -> Result<Vec<ReclaimProof>, RegistryError> {
        if epoch != self.epoch {
            return Err(RegistryError::StaleEpoch { given: epoch, current: self.epoch });
        }
        let fenced: Vec<RegionId> = self
            .regions
            .values()
            .filter(|r| r.epoch < epoch && !matches!(r.state, RegionState::Held))
            .map(|r| r.id)
            .collect();
        Ok(fenced
            .into_iter()
            .map(|id| {
                self.regions.remove(&id);
                ReclaimProof::new(id, ReclaimCause::Fenced { epoch })
            })
            .collect())
    }
}

// ---------------------------------------------------------------------------------------------
// Registered pools

/// A memory binding (verbs lkey/rkey, NIXL descriptor index, CUDA handle): costly to make,
/// so pools keep it across checkouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Binding {
    pub key: u64,
}

/// Why a slot could not be bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("binding slot {slot} of {kind:?} memory failed: {detail}")]
pub struct BindError {
    pub slot: usize,
    pub kind: MemoryKind,
    pub detail: String,
}

/// Fixed-size slots of some memory kind, bindable to the agent that will touch them.
pub trait PoolMemory: Send + fmt::Debug {
    fn kind(&self) -> MemoryKind;
    fn slot_count(&self) -> usize;
    fn slot_bytes(&self) -> usize;
    /// Registers slot `slot` with its agent.
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError>;
    /// Undoes a bind made for a batch that could not be completed.
    fn unbind(&mut self, slot: usize, binding: Binding);
    /// The slot's bytes when the CPU can address them (host kinds); `None` for device memory.
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]>;
}

/// Plain host memory carved into slots; bindings are bookkeeping only.
#[derive(Debug)]
pub struct HostSlots {
    bytes: Vec<u8>,
    slot_bytes: usize,
    binds: u64,
}

impl HostSlots {
    pub fn new(slot_count: usize, slot_bytes: usize) -> Self {
        Self { bytes: vec![0; slot_count * slot_bytes], slot_bytes, binds: 0 }
    }
    /// How many binds were made (tests check that bound slots are preferred).
    pub fn binds(&self) -> u64 {
        self.binds
    }
}

impl PoolMemory for HostSlots {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn slot_count(&self) -> usize {
        self.bytes.len().checked_div(self.slot_bytes).unwrap_or(0)
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        self.binds += 1;
        Ok(Binding { key: (slot as u64) << 32 | self.binds })
    }
    fn unbind(&mut self, _slot: usize, _binding: Binding) {}
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        let start = slot.checked_mul(self.slot_bytes)?;
        self.bytes.get_mut(start..start + self.slot_bytes)
    }
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Free { binding: Option<Binding> },
    Out { region: RegionId, binding: Binding },
}

/// One checked-out slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLease {
    pub region: RegionId,
    pub slot: usize,
    pub epoch: Epoch,
    pub binding: Binding,
}

/// Why a pool call was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    #[error("batch of {requested} slots refused: {free} free of {total}")]
    Exhausted { requested: usize, free: usize, total: usize },
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// A fixed set of slots under the registration contract.
///
/// Checkout prefers slots that are already bound, is all-or-nothing for a batch, and never
/// frees a slot whose outcome is unknown until an attestation or an epoch fence says so.
#[derive(Debug)]
pub struct RegisteredPool<M: PoolMemory> {
    memory: M,
    table: RegionTable,
    slots: Vec<Slot>,
    owner_of: BTreeMap<RegionId, usize>,
}

impl<M: PoolMemory> RegisteredPool<M> {
    pub fn new(memory: M, epochs: Box<dyn EpochSource>) -> Self {
        let n = memory.slot_count();
        Self {
            memory,
            table: RegionTable::new(n, Epoch(1), 1, epochs),
            slots: vec![Slot::Free { binding: None }; n],
            owner_of: BTreeMap::new(),
        }
    }

    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// The memory itself, mutably: for what it does outside the slot contract (a NIC pool
    /// re-registering its mapping). Slot count and size must not change.
    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.memory
    }
    pub fn table(&self) -> &RegionTable {
        &self.table
    }
    pub fn epoch(&self) -> Epoch {
        self.table.epoch()
    }
    pub fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| matches!(s, Slot::Free { .. })).count()
    }
    pub fn bound_free_slots(&self) -> usize {
        self.slots.iter().filter(|s| matches!(s, Slot::Free { binding: Some(_) })).count()
    }

    /// Checks out `count` slots for `owner`, bound slots first; all or nothing.
    pub fn checkout(
        &mut self,
        owner: &TenantId,
        count: usize,
        lease_deadline_ms: Option<u64>,
    ) -> Result<Vec<SlotLease>, PoolError> {
        let free = self.free_slots();
        if count > free || count > self.table.capacity_left() {
            return Err(PoolError::Exhausted { requested: count, free, total: self.slots.len() });
        }
        let mut chosen: Vec<(usize, Option<Binding>)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Free { binding } => Some((i, *binding)),
                Slot::Out { .. } => None,
            })
            .collect();
        // Bound slots first (stable, so lower indices first within each group).
        chosen.sort_by_key(|(_, b)| b.is_none());
        chosen.truncate(count);
        let mut fresh: Vec<(usize, Binding)> = Vec::new();
        let mut bound = Vec::with_capacity(count);
        for (slot, binding) in chosen {
            match binding {
                Some(b) => bound.push((slot, b)),
                None => match self.memory.bind(slot) {
                    Ok(b) => {
                        fresh.push((slot, b));
                        bound.push((slot, b));
                    }
                    Err(e) => {
                        for (s, b) in fresh {
                            self.memory.unbind(s, b);
                        }
                        return Err(e.into());
                    }
                },
            }
        }
        let kind = self.memory.kind();
        let bytes = self.memory.slot_bytes() as u64;
        let mut leases = Vec::with_capacity(count);
        for (slot, binding) in bound {
            let region = self.table.lend(owner, kind, bytes, lease_deadline_ms)?;
            self.slots[slot] = Slot::Out { region, binding };
            self.owner_of.insert(region, slot);
            leases.push(SlotLease { region, slot, epoch: self.table.epoch(), binding });
        }
        Ok(leases)
    }

    fn free_slot(&mut self, region: RegionId) {
        if let Some(slot) = self.owner_of.remove(&region)
            && let Slot::Out { binding, .. } = self.slots[slot]
        {
            self.slots[slot] = Slot::Free { binding: Some(binding) };
        }
    }

    /// Reports how the agent finished with a checked-out slot.
    pub fn complete(
        &mut self,
        region: RegionId,
        completion: Completion,
    ) -> Result<CompleteOutcome, PoolError> {
        let outcome = self.table.complete(region, completion)?;
        if outcome == CompleteOutcome::Freed {
            self.free_slot(region);
        }
        Ok(outcome)
    }

    /// Quarantines checked-out slots whose lease ran out. They stay checked out.
    pub fn expire_leases(&mut self, now_ms: u64) -> Vec<RegionId> {
        self.table.expire_leases(now_ms)
    }

    pub fn attest(
        &mut self,
        caller: &Caller,
        region: RegionId,
        attestation: Attestation,
    ) -> Result<AttestOutcome, PoolError> {
        let outcome = self.table.attest(caller, region, attestation)?;
        if let AttestOutcome::Reclaimed(_) = outcome {
            self.free_slot(region);
        }
        Ok(outcome)
    }

    pub fn bump_epoch(&mut self) -> Result<Epoch, PoolError> {
        Ok(self.table.bump_epoch()?)
    }

    /// Returns every slot checked out before `epoch` (the current one) to the pool.
    pub fn reclaim_fenced(&mut self, epoch: Epoch) -> Result<Vec<ReclaimProof>, PoolError> {
        let proofs = self.table.reclaim_fenced(epoch)?;
        for p in &proofs {
            self.free_slot(p.region());
        }
        Ok(proofs)
    }

    /// Whether `lease` still holds its slot and the slot is lent (not quarantined, not
    /// returned, not fenced and lent again): the condition for touching the slot's bytes.
    pub fn holds(&self, lease: &SlotLease) -> bool {
        match (self.slots.get(lease.slot), self.table.get(lease.region)) {
            (Some(Slot::Out { region, .. }), Some(r)) => {
                *region == lease.region && matches!(r.state, RegionState::Lent { .. })
            }
            _ => false,
        }
    }

    /// The host bytes of a slot, only while `lease` still holds it and it is not quarantined.
    pub fn slot_bytes_mut(&mut self, lease: &SlotLease) -> Option<&mut [u8]> {
        if self.holds(lease) { self.memory.host_bytes_mut(lease.slot) } else { None }
    }
}
