//! [`NixlSlots`]: huge-page host memory registered with a NIXL agent once, as one descriptor,
//! and handed to a [`RegisteredPool`] slot by slot. Binding a slot is bookkeeping only: the
//! costly registration happened up front and lasts as long as the slots.

use gpucache_dataplane::lifecycle::ReclaimProof;
use gpucache_dataplane::registry::{
    BindError, Binding, MemoryKind, PoolMemory, RegisteredPool, SlotLease,
};
use gpucache_storage::host::pool::HugePagePool;
use nixl_sys::{MemType, RegistrationHandle};

use super::agent::NixlAgent;
use super::agent::Span;
use super::common::TRANSPORT;
use super::wire::{BlockMem, RemoteBlock};
use crate::error::NicError;

/// Host memory registered with NIXL as DRAM, in fixed slots.
#[derive(Debug)]
pub struct NixlSlots {
    // Field order is drop order: the registration goes before the mapping it names.
    registration: Option<RegistrationHandle>,
    memory: HugePagePool,
    agent: String,
    generation: u64,
}

impl NixlSlots {
    /// Registers all of `memory`'s mapping with `agent`'s backends as `mem`.
    ///
    /// `mem` is a parameter so a GPU pool can come later, but a [`HugePagePool`] is host memory:
    /// only [`BlockMem::Dram`] is accepted, and `Vram` is refused with
    /// [`NicError::NixlMemUnsupported`]. Enable the backends that should see the memory
    /// (UCX for peers, POSIX for files) before calling this.
    pub fn register(
        agent: &NixlAgent,
        memory: HugePagePool,
        mem: BlockMem,
    ) -> Result<Self, NicError> {
        if mem != BlockMem::Dram {
            return Err(NicError::NixlMemUnsupported {
                mem: "VRAM",
                detail: "a huge-page pool is host memory; VRAM needs a GPU pool, none exists here",
            });
        }
        let span =
            Span { addr: memory.addr(), len: memory.mapped_bytes(), mem: MemType::Dram, dev_id: 0 };
        let registration = agent
            .raw()
            .register_memory(&span, None)
            .map_err(super::agent::call_failed("registerMem"))?;
        Ok(Self {
            registration: Some(registration),
            memory,
            agent: agent.name().to_owned(),
            generation: 1,
        })
    }

    /// Deregisters the mapping from `agent` and registers it again: a new registration, so
    /// the agent's metadata changes and peers must load it again. What this revokes depends on
    /// the transport (see ADR 0018). The generation advances as soon as the old registration is
    /// dropped, so whatever was handed out under it is stale even if the new one fails; on
    /// failure the slots stay unregistered (and [`Self::block`] refuses) until a later call
    /// succeeds.
    pub fn reregister(&mut self, agent: &NixlAgent) -> Result<(), NicError> {
        if agent.name() != self.agent {
            return Err(NicError::NixlCall {
                call: "registerMem",
                detail: format!("the pool belongs to agent {}, not {}", self.agent, agent.name()),
            });
        }
        let span = Span {
            addr: self.memory.addr(),
            len: self.memory.mapped_bytes(),
            mem: MemType::Dram,
            dev_id: 0,
        };
        if let Some(mut old) = self.registration.take() {
            self.generation += 1;
            old.deregister().map_err(super::agent::call_failed("deregisterMem"))?;
        }
        let fresh = agent
            .raw()
            .register_memory(&span, None)
            .map_err(super::agent::call_failed("registerMem"))?;
        self.registration = Some(fresh);
        Ok(())
    }

    /// A fresh host pool of `slots` slots of `slot_bytes` (huge pages as `policy` allows),
    /// registered with `agent` as DRAM, under the registration contract with local epochs.
    pub fn pool(
        agent: &NixlAgent,
        slots: usize,
        slot_bytes: usize,
        policy: gpucache_storage::host::pool::HugePagePolicy,
    ) -> Result<RegisteredPool<Self>, NicError> {
        let memory = HugePagePool::new(slots, slot_bytes, policy)
            .map_err(|e| NicError::NixlCall { call: "hugepage pool", detail: e.to_string() })?;
        let slots = Self::register(agent, memory, BlockMem::Dram)?;
        Ok(RegisteredPool::new(slots, Box::new(gpucache_dataplane::registry::LocalEpochs)))
    }

    /// The pool half of an epoch fence: registers the memory anew (what peers hold of the old
    /// registration is stale), then advances the epoch and reclaims every slot lent before it.
    /// If the registration fails nothing is reclaimed: quarantined slots stay so; fence again.
    pub fn fence(
        pool: &mut RegisteredPool<Self>,
        agent: &NixlAgent,
    ) -> Result<Vec<ReclaimProof>, NicError> {
        pool.memory_mut().reregister(agent)?;
        let epoch = pool.bump_epoch()?;
        Ok(pool.reclaim_fenced(epoch)?)
    }

    /// Which registration the mapping is under: 1 after [`Self::register`], one more at each
    /// [`Self::reregister`].
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The agent the memory is registered with.
    pub fn agent(&self) -> &str {
        &self.agent
    }

    /// A slot's start address.
    pub fn slot_addr(&self, slot: usize) -> Option<u64> {
        let bytes = PoolMemory::slot_bytes(&self.memory);
        (slot < PoolMemory::slot_count(&self.memory))
            .then(|| (self.memory.addr() + slot * bytes) as u64)
    }

    /// Describes the first `len_bytes` of `lease`'s slot for a peer, which may then read or
    /// write them until the slot is returned. Refused unless the lease is still lent and usable.
    pub fn block(
        pool: &RegisteredPool<Self>,
        lease: &SlotLease,
        len_bytes: u64,
    ) -> Result<RemoteBlock, NicError> {
        let memory = pool.memory();
        let usable = pool.holds(lease) && memory.registered();
        let addr = memory.slot_addr(lease.slot).filter(|_| usable);
        let addr = addr.ok_or(NicError::LeaseNotUsable { region: lease.region })?;
        let slot_bytes = PoolMemory::slot_bytes(memory) as u64;
        if len_bytes == 0 || len_bytes > slot_bytes {
            return Err(NicError::TooLong { len_bytes, slot_bytes });
        }
        Ok(RemoteBlock {
            agent: memory.agent.clone(),
            mem: BlockMem::Dram,
            addr,
            len_bytes,
            dev_id: 0,
        })
    }

    /// True while a registration is held (until drop, or a failed [`Self::reregister`]).
    pub fn registered(&self) -> bool {
        self.registration.as_ref().is_some_and(|r| r.agent_name().is_some())
    }
}

impl PoolMemory for NixlSlots {
    fn kind(&self) -> MemoryKind {
        MemoryKind::NicRegistered { transport: TRANSPORT }
    }
    fn slot_count(&self) -> usize {
        PoolMemory::slot_count(&self.memory)
    }
    fn slot_bytes(&self) -> usize {
        PoolMemory::slot_bytes(&self.memory)
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        // One registration covers every slot: binding is the host pool's bookkeeping.
        self.memory.bind(slot).map_err(|e| BindError { kind: self.kind(), ..e })
    }
    fn unbind(&mut self, slot: usize, binding: Binding) {
        self.memory.unbind(slot, binding);
    }
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        self.memory.slot_mut(slot)
    }
}

/// Device memory (VRAM) that another crate owns, registered with a NIXL agent once, as one
/// descriptor; dropping it deregisters. The GPU crate builds its NIXL-visible slots on this.
#[derive(Debug)]
pub struct NixlVramRegistration {
    registration: RegistrationHandle,
    agent: String,
    addr: u64,
    len_bytes: u64,
    dev_id: u64,
}

impl NixlVramRegistration {
    /// Registers `len_bytes` of device memory at device address `addr` on GPU `dev_id` with
    /// `agent`'s enabled backends as [`MemType::Vram`].
    ///
    /// # Safety
    /// `addr..addr + len_bytes` must be one live device allocation on GPU `dev_id`, and it must
    /// outlive the returned registration (drop the registration first).
    pub unsafe fn register(
        agent: &NixlAgent,
        addr: u64,
        len_bytes: u64,
        dev_id: u64,
    ) -> Result<Self, NicError> {
        let too_long = NicError::TooLong { len_bytes, slot_bytes: usize::MAX as u64 };
        let span = Span {
            addr: usize::try_from(addr).map_err(|_| too_long.clone())?,
            len: usize::try_from(len_bytes).map_err(|_| too_long)?,
            mem: MemType::Vram,
            dev_id,
        };
        let registration = agent
            .raw()
            .register_memory(&span, None)
            .map_err(super::agent::call_failed("registerMem"))?;
        Ok(Self { registration, agent: agent.name().to_owned(), addr, len_bytes, dev_id })
    }

    /// The agent the memory is registered with.
    pub fn agent(&self) -> &str {
        &self.agent
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
    pub fn dev_id(&self) -> u64 {
        self.dev_id
    }
    /// True while the registration is held (always, until drop); for tests.
    pub fn registered(&self) -> bool {
        self.registration.agent_name().is_some()
    }
}
