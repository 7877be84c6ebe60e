//! Device memory and pinned host staging under the registration contract: one context per
//! device ([`GpuDevice`]), one device allocation carved into fixed block slots ([`GpuSlots`],
//! `MemoryKind::Gpu`), and one page-locked host allocation carved the same way
//! ([`PinnedStaging`]). Both are [`PoolMemory`], used through `RegisteredPool`, which owns
//! checkout, quarantine and reclaim; this module owns only the bytes.
//!
//! Freeing waits for the context to drain: a copy still in flight must never land in freed
//! memory. When the drain cannot be proven the allocation is leaked, on purpose.

use std::num::NonZeroUsize;
use std::sync::Arc;

use cudarc::driver::{result, sys};
use gpucache_dataplane::registry::{BindError, Binding, MemoryKind, PoolMemory};

use crate::error::{GpuError, driver};
use crate::probe;

/// Most slots one allocation is carved into.
pub const SLOTS_MAX: usize = 1 << 16;
/// Largest single allocation: 64 GiB, under half an H200.
pub const ALLOCATION_BYTES_MAX: u64 = 64 << 30;

/// One device's primary context, retained for as long as anything uses it.
#[derive(Debug)]
pub struct GpuDevice {
    ordinal: u32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a driver-API context handle may be made current on, and used from, any thread; the
// handle itself is an opaque pointer that this type never dereferences.
unsafe impl Send for GpuDevice {}
// SAFETY: as above; every use goes through the driver, which serialises on its own.
unsafe impl Sync for GpuDevice {}

impl GpuDevice {
    /// Retains device `ordinal`'s primary context, or says why no GPU can be used.
    pub fn open(ordinal: u32) -> Result<Arc<Self>, GpuError> {
        let dev = probe::device_handle(ordinal)?;
        // SAFETY: `dev` is a valid device handle; the retain is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(driver("cuDevicePrimaryCtxRetain"))?;
        let device = Arc::new(Self { ordinal, dev, ctx });
        device.bind_thread()?;
        Ok(device)
    }

    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Makes this context current on the calling thread (the driver API's calls act on it).
    pub fn bind_thread(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is a retained primary context, alive until Drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(driver("cuCtxSetCurrent"))
    }

    /// Waits until everything on every stream of this context has finished.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.bind_thread()?;
        result::ctx::synchronize().map_err(driver("cuCtxSynchronize"))
    }
}

impl Drop for GpuDevice {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `open`; nothing holds the context any more
        // (every user holds an Arc of this device).
        let _ = unsafe { result::primary_ctx::release(self.dev) };
    }
}

fn carve(slot_count: NonZeroUsize, slot_bytes: NonZeroUsize) -> Result<usize, GpuError> {
    if slot_count.get() > SLOTS_MAX {
        return Err(GpuError::Limit {
            what: "slot count",
            requested: slot_count.get() as u64,
            max: SLOTS_MAX as u64,
        });
    }
    let too_large = |requested| GpuError::Limit {
        what: "allocation bytes",
        requested,
        max: ALLOCATION_BYTES_MAX,
    };
    let total = slot_count.get().checked_mul(slot_bytes.get()).ok_or(too_large(u64::MAX))?;
    if total as u64 > ALLOCATION_BYTES_MAX {
        return Err(too_large(total as u64));
    }
    Ok(total)
}

fn slot_offset(slot: usize, slot_count: usize, slot_bytes: usize) -> Result<usize, GpuError> {
    if slot >= slot_count {
        return Err(GpuError::SlotOutOfRange { slot, slot_count });
    }
    // Cannot overflow: `carve` checked slot_count * slot_bytes.
    Ok(slot * slot_bytes)
}

/// One device allocation carved into `slot_count` block slots of `slot_bytes` each.
#[derive(Debug)]
pub struct GpuSlots {
    device: Arc<GpuDevice>,
    base: sys::CUdeviceptr,
    slot_count: usize,
    slot_bytes: usize,
}

impl GpuSlots {
    /// Allocates the slots on `device` (contents undefined until written).
    pub fn new(
        device: Arc<GpuDevice>,
        slot_count: NonZeroUsize,
        slot_bytes: NonZeroUsize,
    ) -> Result<Self, GpuError> {
        let total = carve(slot_count, slot_bytes)?;
        device.bind_thread()?;
        // SAFETY: a plain device allocation of `total` bytes in the current context; freed in
        // Drop after a drain.
        let base = unsafe { result::malloc_sync(total) }.map_err(driver("cuMemAlloc"))?;
        Ok(Self { device, base, slot_count: slot_count.get(), slot_bytes: slot_bytes.get() })
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }
    /// The allocation's device address and size (what NIXL registers as VRAM).
    pub fn base_ptr(&self) -> u64 {
        self.base
    }
    pub fn total_bytes(&self) -> usize {
        self.slot_count * self.slot_bytes
    }

    /// The device address of `slot`.
    pub fn slot_ptr(&self, slot: usize) -> Result<u64, GpuError> {
        Ok(self.base + slot_offset(slot, self.slot_count, self.slot_bytes)? as u64)
    }

    /// Sets every byte of the allocation to `byte`, then waits for it.
    pub fn fill(&self, byte: u8) -> Result<(), GpuError> {
        self.device.bind_thread()?;
        // SAFETY: the range is exactly this allocation, which lives until Drop.
        unsafe { result::memset_d8_sync(self.base, byte, self.total_bytes()) }
            .map_err(driver("cuMemsetD8"))?;
        self.device.synchronize()
    }

    /// A copy of the whole allocation, taken after the context drained (so no copy in flight
    /// can change it underneath).
    pub fn read_all(&self) -> Result<Vec<u8>, GpuError> {
        self.device.synchronize()?;
        let mut out = vec![0_u8; self.total_bytes()];
        // SAFETY: `out` is exactly the allocation's size and lives across this synchronous copy.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.base) }.map_err(driver("cuMemcpyDtoH"))?;
        Ok(out)
    }
}

impl PoolMemory for GpuSlots {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Gpu { device: self.device.ordinal }
    }
    fn slot_count(&self) -> usize {
        self.slot_count
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    /// The binding is the slot's device address: nothing to register per slot.
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        self.slot_ptr(slot).map(|key| Binding { key }).map_err(|e| BindError {
            slot,
            kind: self.kind(),
            detail: e.to_string(),
        })
    }
    fn unbind(&mut self, _slot: usize, _binding: Binding) {}
    fn host_bytes_mut(&mut self, _slot: usize) -> Option<&mut [u8]> {
        None
    }
}

impl Drop for GpuSlots {
    fn drop(&mut self) {
        if self.device.synchronize().is_err() {
            // The drain is unproven: a copy may still target this memory. Leak it.
            return;
        }
        // SAFETY: allocated in `new`, freed once, after the context drained.
        let _ = unsafe { result::free_sync(self.base) };
    }
}

/// Page-locked host memory (cuMemHostAlloc) carved into staging slots: the DMA engine copies to
/// and from it directly, so asynchronous copies really are asynchronous.
#[derive(Debug)]
pub struct PinnedStaging {
    device: Arc<GpuDevice>,
    base: *mut u8,
    slot_count: usize,
    slot_bytes: usize,
}

// SAFETY: the allocation is owned by this value alone; `&mut self` guards every CPU access and
// the driver's copies are ordered by the caller's events and the drain in Drop.
unsafe impl Send for PinnedStaging {}

impl PinnedStaging {
    /// Allocates and zeroes the staging slots.
    pub fn new(
        device: Arc<GpuDevice>,
        slot_count: NonZeroUsize,
        slot_bytes: NonZeroUsize,
    ) -> Result<Self, GpuError> {
        let total = carve(slot_count, slot_bytes)?;
        device.bind_thread()?;
        // SAFETY: page-locked allocation of `total` bytes, freed in Drop after a drain.
        let base = unsafe { result::malloc_host(total, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(driver("cuMemHostAlloc"))?
            .cast::<u8>();
        // SAFETY: `base` points to `total` writable bytes nobody else knows about yet.
        unsafe { std::ptr::write_bytes(base, 0, total) };
        Ok(Self { device, base, slot_count: slot_count.get(), slot_bytes: slot_bytes.get() })
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.device
    }

    /// The host address of `slot` (for the driver's copies).
    pub(crate) fn slot_ptr(&self, slot: usize) -> Result<*mut u8, GpuError> {
        let offset = slot_offset(slot, self.slot_count, self.slot_bytes)?;
        // SAFETY: `offset` is inside the allocation (checked above).
        Ok(unsafe { self.base.add(offset) })
    }
}

impl PoolMemory for PinnedStaging {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn slot_count(&self) -> usize {
        self.slot_count
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn bind(&mut self, slot: usize) -> Result<Binding, BindError> {
        self.slot_ptr(slot).map(|p| Binding { key: p as u64 }).map_err(|e| BindError {
            slot,
            kind: MemoryKind::Host,
            detail: e.to_string(),
        })
    }
    fn unbind(&mut self, _slot: usize, _binding: Binding) {}
    fn host_bytes_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        let ptr = self.slot_ptr(slot).ok()?;
        // SAFETY: the slot lies inside the allocation and `&mut self` makes this the only CPU
        // view; the pool hands it out only while the slot's lease is lent.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, self.slot_bytes) })
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        if self.device.synchronize().is_err() {
            return;
        }
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once, after the context drained.
        let _ = unsafe { result::free_host(self.base.cast()) };
    }
}
