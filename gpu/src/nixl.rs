//! [`NixlGpuSlots`]: a [`GpuSlots`] allocation registered with a NIXL agent as VRAM (device id
//! = the GPU's ordinal), handed to a `RegisteredPool` slot by slot, and described to peers as
//! [`RemoteBlock`]s with [`BlockMem::Vram`]. It fails closed: without a GPU the slots cannot be
//! built ([`GpuError::Unavailable`]), without NIXL the agent cannot be ([`GpuError::Nixl`]).

use gpucache_dataplane::registry::{
    BindError, Binding, MemoryKind, PoolMemory, RegisteredPool, SlotLease,
};
use gpucache_nic::NicError;
use gpucache_nic::nixl::wire::{BlockMem, RemoteBlock};
use gpucache_nic::nixl::{NixlAgent, NixlVramRegistration};

use crate::error::GpuError;
use crate::memory::GpuSlots;

/// Device block slots visible to NIXL as one VRAM registration.
#[derive(Debug)]
pub struct NixlGpuSlots {
    // Field order is drop order: the registration goes before the allocation it names.
    registration: NixlVramRegistration,
    slots: GpuSlots,
}

impl NixlGpuSlots {
    /// Registers the whole of `slots` with `agent` (enable its backends first).
    pub fn register(agent: &NixlAgent, slots: GpuSlots) -> Result<Self, GpuError> {
        let device = u64::from(slots.device().ordinal());
        // SAFETY: the span is exactly `slots`' device allocation on its own device, and this
        // value drops the registration before the allocation (field order).
        let registration = unsafe {
            NixlVramRegistration::register(
                agent,
                slots.base_ptr(),
                slots.total_bytes() as u64,
                device,
            )
        }?;
        Ok(Self { registration, slots })
    }

    pub fn slots(&self) -> &GpuSlots {
        &self.slots
    }
    pub fn registration(&self) -> &NixlVramRegistration {
        &self.registration
    }

    /// Describes the first `len_bytes` of `lease`'s device slot for a peer; refused unless the
    /// lease is still lent.
    pub fn block(
        pool: &RegisteredPool<Self>,
        lease: &SlotLease,
        len_bytes: u64,
    ) -> Result<RemoteBlock, GpuError> {
        if !pool.holds(lease) {
            return Err(GpuError::NotLent { region: lease.region });
        }
        let memory = pool.memory();
        let slot_bytes = memory.slots.slot_bytes();
        if len_bytes == 0 || len_bytes > slot_bytes as u64 {
            return Err(GpuError::TransferTooLong {
                len: usize::try_from(len_bytes).unwrap_or(usize::MAX),
                slot_bytes,
            });
        }
        Ok(RemoteBlock {
            agent: memory.registration.agent().to_owned(),
            mem: BlockMem::Vram,
            addr: memory.slots.slot_ptr(lease.slot)?,
            len_bytes,
            dev_id: memory.registration.dev_id(),
        })
    }
}

impl From<NicError> for GpuError {
    fn from(e: NicError) -> Self {
        GpuError::Nixl(e)
    }
}

impl PoolMemory for NixlGpuSlots {
    fn kind(&self) -> MemoryKind {
        self.slots.kind()
    }
    fn slot_count(&self) -> usize {
        self.slots.slot_count()
    }
    fn slot_bytes(&self) -> usize {
        self.slots.slot_bytes()
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        self.slots.bind(slot)
    }
    fn unbind(&mut self, slot: usize, binding: Binding) {
        self.slots.unbind(slot, binding);
    }
    fn host_bytes_mut(&mut self, _slot: usize) -> Option<&mut [u8]> {
        None
    }
}
