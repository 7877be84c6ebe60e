//! [`NicSlots`]: pool memory whose bind registers each slot, at the slot's own address and
//! length, with a NIC endpoint, so a [`gpucache_dataplane::registry::RegisteredPool`] keeps its
//! registrations across checkouts and a slot's keys cover exactly that slot. Its kind is
//! `MemoryKind::NicRegistered` with the endpoint's transport name.
//!
//! The memory comes from any [`StableHostMemory`]: a huge-page pool
//! ([`gpucache_storage::host::pool::HugePagePool`], on whatever tier it got) or plain heap slots
//! ([`HostSlots`] from the contract crate, what [`NicSlots::new`] builds). The endpoint registers it through
//! [`RegisterHostMemory`], which the simulated NIC and the verbs endpoint both implement.

use std::ptr::NonNull;

use gpucache_dataplane::registry::{BindError, Binding, HostSlots, MemoryKind, PoolMemory};
use gpucache_storage::host::pool::HugePagePool;

use crate::verbs::{Access, LocalKey, MemoryRegion, RegisterHostMemory};

/// Host pool memory whose slots stay at one address for the value's whole life.
///
/// # Safety
/// For every slot below `slot_count()`, `host_bytes_mut(slot)` must return `slot_bytes()` bytes
/// at the same address every time, for as long as the value lives (moving the value must not
/// move them), slots must not overlap, and the bytes must stay valid until the value is
/// dropped. A NIC keeps using a registered slot's address between calls.
pub unsafe trait StableHostMemory: PoolMemory {}

// SAFETY: the pool's slots lie in one mmap it owns; the mapping is made once, never remapped or
// resized, and unmapped only on drop. Moving the pool moves the pointer, not the pages.
unsafe impl StableHostMemory for HugePagePool {}

// SAFETY: the slots are one Vec allocated at construction and never grown, shrunk or replaced
// (HostSlots has no method that resizes it); moving the value moves the pointer, not the heap
// bytes, which live until the value is dropped.
unsafe impl StableHostMemory for HostSlots {}

/// Pool slots registered one by one with an endpoint: local access only unless
/// [`NicSlots::with_access`] opens them to peers.
///
/// Every registration still live is deregistered when the slots are dropped, before the memory
/// goes away, so no key outlives the bytes it covers.
#[derive(Debug)]
pub struct NicSlots<E: RegisterHostMemory, M: StableHostMemory = HostSlots> {
    endpoint: E,
    memory: M,
    access: Access,
    /// Each slot's live registration.
    regions: Vec<Option<MemoryRegion>>,
    registrations: u64,
}

impl<E: RegisterHostMemory> NicSlots<E, HostSlots> {
    /// `slot_count` heap slots of `slot_bytes`, registered with `endpoint` as they are bound.
    pub fn new(endpoint: E, slot_count: usize, slot_bytes: usize) -> Self {
        Self::on(endpoint, HostSlots::new(slot_count, slot_bytes))
    }
}

impl<E: RegisterHostMemory, M: StableHostMemory> NicSlots<E, M> {
    /// `memory`'s slots (a [`HugePagePool`], say), registered with `endpoint` as they are bound.
    pub fn on(endpoint: E, memory: M) -> Self {
        let regions = vec![None; memory.slot_count()];
        Self { endpoint, memory, access: Access::LOCAL, regions, registrations: 0 }
    }

    /// What peers may do to the slots registered from now on.
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    pub fn endpoint(&self) -> &E {
        &self.endpoint
    }

    /// The memory under the registrations (its tier, its addresses).
    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// Registrations made so far (binds are costly; tests check that they are kept).
    pub fn registrations(&self) -> u64 {
        self.registrations
    }

    /// The live registration of `slot`: its keys and length (the slot's, exactly).
    pub fn region(&self, slot: usize) -> Option<MemoryRegion> {
        self.regions.get(slot).copied().flatten()
    }
}

/// The local key a pool binding made by [`NicSlots`] carries. A binding from another kind of
/// memory maps to key 0, which no endpoint hands out, so its posts fail their local check.
pub fn local_key(binding: Binding) -> LocalKey {
    LocalKey(u32::try_from(binding.key).unwrap_or(0))
}

impl<E: RegisterHostMemory + Send, M: StableHostMemory> PoolMemory for NicSlots<E, M> {
    fn kind(&self) -> MemoryKind {
        MemoryKind::NicRegistered { transport: self.endpoint.implementation().transport() }
    }
    fn slot_count(&self) -> usize {
        self.memory.slot_count()
    }
    fn slot_bytes(&self) -> usize {
        self.memory.slot_bytes()
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        let kind = self.kind();
        let fail = |detail: String| BindError { slot, kind, detail };
        if let Some(region) = self.region(slot) {
            // Already registered (the pool binds a slot only once; this keeps a second bind
            // from leaking a registration).
            return Ok(Binding { key: u64::from(region.lkey.0) });
        }
        let Some(entry) = self.regions.get_mut(slot) else {
            return Err(fail(format!("the memory has {} slots", self.memory.slot_count())));
        };
        let bytes = self
            .memory
            .host_bytes_mut(slot)
            .ok_or_else(|| fail("the slot has no host address".into()))?;
        let (addr, len) = (NonNull::from(&mut *bytes).cast::<u8>(), bytes.len());
        // SAFETY: `M: StableHostMemory` keeps `addr..addr + len` (exactly this slot) valid and
        // in place while `self.memory` lives; the registration is deregistered in `unbind` or
        // in `Drop`, before the memory is. The pool hands the slot's bytes out only while a
        // lease holds it, which is the contract `register_host` asks for.
        let region = unsafe { self.endpoint.register_host(addr, len, self.access) }
            .map_err(|e| fail(e.to_string()))?;
        *entry = Some(region);
        self.registrations += 1;
        Ok(Binding { key: u64::from(region.lkey.0) })
    }
    fn unbind(&mut self, slot: usize, binding: Binding) {
        if let Some(entry) = self.regions.get_mut(slot) {
            *entry = None;
        }
        // The key came from our own bind, so deregistering cannot meet an unknown key; if it
        // somehow did, the registration is already gone and nothing is left to undo.
        let _ = self.endpoint.deregister(local_key(binding));
    }
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        self.memory.host_bytes_mut(slot)
    }
}

impl<E: RegisterHostMemory, M: StableHostMemory> Drop for NicSlots<E, M> {
    fn drop(&mut self) {
        for region in self.regions.iter_mut().filter_map(Option::take) {
            // A key this value registered; an endpoint that already dropped it has nothing
            // left to undo.
            let _ = self.endpoint.deregister(region.lkey);
        }
    }
}
