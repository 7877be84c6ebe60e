//! The agent's slab: a bounded set of fixed-size slots of registered memory that every
//! submission leases one slot of. Here the memory is a host [`HugePagePool`] labelled
//! [`MemoryKind::DpuSlab`]; on a DPU it would be the card's memory.
//!
//! The registration contract (leases, quarantine, fence) stays in the dataplane's
//! [`RegisteredPool`](gpucache_dataplane::registry::RegisteredPool); this file only adapts the
//! memory and hands reactors a raw view of a leased slot.

use gpucache_dataplane::registry::{BindError, Binding, MemoryKind, PoolMemory};
use gpucache_storage::host::pool::HugePagePool;

/// Most slots one slab may have.
pub const SLAB_SLOTS_MAX: usize = 1 << 16;

/// Host huge-page memory presented as a DPU slab.
#[derive(Debug)]
pub struct SlabMemory {
    pool: HugePagePool,
}

impl SlabMemory {
    pub fn new(pool: HugePagePool) -> Self {
        Self { pool }
    }
    /// A raw view of the whole mapping, for reactors touching leased slots.
    pub(crate) fn raw(&self) -> RawSlab {
        RawSlab {
            base: self.pool.addr(),
            slot_bytes: self.pool.slot_bytes(),
            slot_count: self.pool.slot_count(),
        }
    }
}

impl PoolMemory for SlabMemory {
    fn kind(&self) -> MemoryKind {
        MemoryKind::DpuSlab
    }
    fn slot_count(&self) -> usize {
        self.pool.slot_count()
    }
    fn slot_bytes(&self) -> usize {
        self.pool.slot_bytes()
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        self.pool.bind(slot).map_err(|e| BindError { kind: MemoryKind::DpuSlab, ..e })
    }
    fn unbind(&mut self, slot: usize, binding: Binding) {
        self.pool.unbind(slot, binding);
    }
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        self.pool.slot_mut(slot)
    }
}

/// The slab mapping's address and geometry. The mapping outlives every reactor (the agent
/// joins its reactors before it drops the slab).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawSlab {
    base: usize,
    pub(crate) slot_bytes: usize,
    slot_count: usize,
}

impl RawSlab {
    /// The bytes of `slot`.
    ///
    /// # Safety
    /// The caller must hold the slot's lease exclusively (one submission owns a leased slot
    /// until it settles, and the fence waits for executing submissions before it frees one),
    /// and the slab mapping must outlive the returned slice.
    pub(crate) unsafe fn slot_mut<'a>(&self, slot: usize) -> &'a mut [u8] {
        assert!(slot < self.slot_count, "slot {slot} outside a slab of {}", self.slot_count);
        // SAFETY: `slot * slot_bytes + slot_bytes <= slot_count * slot_bytes`, inside the live
        // mapping; exclusivity and lifetime are the caller's contract above.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.base as *mut u8).add(slot * self.slot_bytes),
                self.slot_bytes,
            )
        }
    }
}
