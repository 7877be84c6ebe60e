//! [`NicSlots`]: host memory carved into fixed slots whose bind registers each slot with a NIC
//! endpoint, so a [`gpucache_dataplane::registry::RegisteredPool`] keeps its registrations
//! across checkouts. Its kind is `MemoryKind::NicRegistered` with the endpoint's transport name.

use gpucache_dataplane::registry::{BindError, Binding, MemoryKind, PoolMemory};

use crate::verbs::{Access, LocalKey, NicEndpoint};

/// Slots registered with one endpoint for its own work requests (local access only).
#[derive(Debug)]
pub struct NicSlots<E> {
    endpoint: E,
    bytes: Vec<u8>,
    slot_bytes: usize,
    registrations: u64,
}

impl<E: NicEndpoint> NicSlots<E> {
    pub fn new(endpoint: E, slot_count: usize, slot_bytes: usize) -> Self {
        Self { endpoint, bytes: vec![0; slot_count * slot_bytes], slot_bytes, registrations: 0 }
    }
    pub fn endpoint(&self) -> &E {
        &self.endpoint
    }
    /// Registrations made so far (binds are costly; tests check that they are kept).
    pub fn registrations(&self) -> u64 {
        self.registrations
    }
}

/// The local key a pool binding made by [`NicSlots`] carries. A binding from another kind of
/// memory maps to key 0, which no endpoint hands out, so its posts fail their local check.
pub fn local_key(binding: Binding) -> LocalKey {
    LocalKey(u32::try_from(binding.key).unwrap_or(0))
}

impl<E: NicEndpoint + Send> PoolMemory for NicSlots<E> {
    fn kind(&self) -> MemoryKind {
        MemoryKind::NicRegistered { transport: self.endpoint.implementation().transport() }
    }
    fn slot_count(&self) -> usize {
        self.bytes.len().checked_div(self.slot_bytes).unwrap_or(0)
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        let region = self
            .endpoint
            .register(self.slot_bytes as u64, Access::LOCAL)
            .map_err(|e| BindError { slot, kind: self.kind(), detail: e.to_string() })?;
        self.registrations += 1;
        Ok(Binding { key: u64::from(region.lkey.0) })
    }
    fn unbind(&mut self, _slot: usize, binding: Binding) {
        // The key came from our own bind, so deregistering cannot meet an unknown key; if it
        // somehow did, the registration is already gone and nothing is left to undo.
        let _ = self.endpoint.deregister(local_key(binding));
    }
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        let start = slot.checked_mul(self.slot_bytes)?;
        self.bytes.get_mut(start..start.checked_add(self.slot_bytes)?)
    }
}
