//! Device memory and pinned host staging under the registration contract: one context per
//! device ([`GpuDevice`]), one device allocation carved into fixed block slots ([`GpuSlots`],
//! `MemoryKind::Gpu`), and one page-locked host allocation carved the same way
//! ([`PinnedStaging`]). Both are [`PoolMemory`], used through `RegisteredPool`, which owns
//! checkout, quarantine and reclaim; this module owns only the bytes.
//!
//! Freeing waits for the context to drain: a copy still in flight must never land in freed
//! memory. The wait is bounded by [`CONTEXT_DRAIN_DEADLINE_MS`]; when the drain is not observed
//! in time (or the driver reports an error) the allocation is leaked, on purpose, with a
//! warning, and so is the context itself when the device is dropped.

use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::registry::{BindError, Binding, MemoryKind, PoolMemory};

use crate::error::{DriverCode, GpuError, driver};
use crate::probe;
use crate::retire::{
    CompletionEvent, EventStatus, RetireLimits, Retirement, SPIN_POLLS, await_event,
};

/// Most slots one allocation is carved into.
pub const SLOTS_MAX: usize = 1 << 16;
/// Largest single allocation: 64 GiB, under half an H200.
pub const ALLOCATION_BYTES_MAX: u64 = 64 << 30;
/// How long a whole-context drain may take before it counts as not observed. A stream's full
/// book ([`crate::retire::IN_FLIGHT_MAX`] copies of a 64 MiB block) is 4 GiB, about 4.3 s at a
/// pessimistic 1 GB/s; ten seconds covers two such streams sharing the link, and is still short
/// enough that dropping memory on a hung device gives up (and leaks) instead of hanging.
pub const CONTEXT_DRAIN_DEADLINE_MS: u64 = 10_000;

/// A context handle carried to the thread that drains it.
#[derive(Debug, Clone, Copy)]
struct ContextHandle(sys::CUcontext);

// SAFETY: an opaque driver handle, valid on any thread once made current there; the drain
// thread does exactly that and nothing else with it.
unsafe impl Send for ContextHandle {}

/// What the drain thread found: `None` while the driver call has not returned.
type DrainAnswer = Arc<OnceLock<Result<(), DriverCode>>>;

/// The drain thread's answer as a completion event, so the wait for it is the crate's one
/// deadline-bounded poll ([`await_event`]).
struct DrainIdle(DrainAnswer);

impl CompletionEvent for DrainIdle {
    fn query(&mut self) -> EventStatus {
        match self.0.get() {
            None => EventStatus::Pending,
            Some(Ok(())) => EventStatus::Complete,
            Some(Err(code)) => EventStatus::Failed { code: code.code },
        }
    }
}

/// Runs `drain` on a thread of its own and waits at most `deadline_ms` for it to return.
///
/// The driver offers a blocking whole-context wait (`cuCtxSynchronize`) and no non-blocking
/// query for a context: the blocking call runs apart so that this caller can give up. A drain
/// that misses the deadline keeps its thread (blocked in the driver) and whatever `drain`
/// captured; the caller must then leave alive everything the pending work may touch.
fn drain_bounded<F>(drain: F, deadline_ms: u64) -> Result<(), GpuError>
where
    F: FnOnce() -> Result<(), DriverCode> + Send + 'static,
{
    let answer: DrainAnswer = Arc::new(OnceLock::new());
    let told = Arc::clone(&answer);
    std::thread::Builder::new()
        .name("gpucache-ctx-drain".to_owned())
        .spawn(move || {
            let _ = told.set(drain());
        })
        .map_err(|e| GpuError::DrainThread { detail: e.to_string() })?;
    let limits = RetireLimits { deadline_ms, spin_polls: SPIN_POLLS };
    match await_event(&mut DrainIdle(Arc::clone(&answer)), &MonotonicClock::default(), limits) {
        Retirement::Retired => Ok(()),
        Retirement::EventFailed { code } => Err(GpuError::Driver {
            call: "cuCtxSynchronize",
            code: match answer.get() {
                Some(Err(named)) => named.clone(),
                _ => DriverCode { code, name: "unnamed".to_owned() },
            },
        }),
        Retirement::DeadlineMissed { waited_ms } => {
            Err(GpuError::ContextDrainDeadline { waited_ms, deadline_ms })
        }
    }
}

/// `cuCtxSynchronize` on `ctx`, made current on the calling (drain) thread.
fn synchronize_context(ctx: ContextHandle) -> Result<(), DriverCode> {
    // SAFETY: the caller keeps the context retained for as long as this call may run.
    unsafe { result::ctx::set_current(ctx.0) }?;
    result::ctx::synchronize()?;
    Ok(())
}

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

    /// Waits until everything on every stream of this context has finished, for at most
    /// [`CONTEXT_DRAIN_DEADLINE_MS`]: [`GpuError::ContextDrainDeadline`] when it did not. A
    /// drain still running then holds this device (and so its context) alive.
    pub fn synchronize(self: &Arc<Self>) -> Result<(), GpuError> {
        let ctx = ContextHandle(self.ctx);
        let device = Arc::clone(self);
        drain_bounded(
            move || {
                let _alive = device;
                synchronize_context(ctx)
            },
            CONTEXT_DRAIN_DEADLINE_MS,
        )
    }
}

impl Drop for GpuDevice {
    fn drop(&mut self) {
        // Releasing the last retain destroys the context and every allocation in it, so it
        // waits for the drain like any free.
        let ctx = ContextHandle(self.ctx);
        if let Err(error) =
            drain_bounded(move || synchronize_context(ctx), CONTEXT_DRAIN_DEADLINE_MS)
        {
            tracing::warn!(
                device = self.ordinal,
                %error,
                "GPU context left retained: its drain was not observed, a copy may still use its memory"
            );
            return;
        }
        // SAFETY: releases the retain taken in `open` after the context drained; nothing holds
        // the context any more (every user holds an Arc of this device).
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
        if let Err(error) = self.device.synchronize() {
            // The drain is unproven: a copy may still target this memory. Leak it.
            tracing::warn!(
                device = self.device.ordinal,
                bytes = self.total_bytes(),
                %error,
                "device slots leaked: the context's drain was not observed, a copy may still use them"
            );
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
        if let Err(error) = self.device.synchronize() {
            // As for the device slots: a copy may still read or write these pages. Leak them.
            tracing::warn!(
                device = self.device.ordinal,
                bytes = self.slot_count * self.slot_bytes,
                %error,
                "pinned staging leaked: the context's drain was not observed, a copy may still use it"
            );
            return;
        }
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once, after the context drained.
        let _ = unsafe { result::free_host(self.base.cast()) };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// How long a test's stand-in for a hung driver call stays blocked unless released.
    const HUNG_PATIENCE: Duration = Duration::from_secs(10);

    #[test]
    fn a_drain_that_returns_is_observed() {
        assert_eq!(drain_bounded(|| Ok(()), 1_000), Ok(()));
    }

    #[test]
    fn a_failed_drain_carries_the_driver_code() {
        let code = DriverCode { code: 700, name: "CUDA_ERROR_ILLEGAL_ADDRESS".to_owned() };
        let failing = code.clone();
        assert_eq!(
            drain_bounded(move || Err(failing), 1_000),
            Err(GpuError::Driver { call: "cuCtxSynchronize", code })
        );
    }

    #[test]
    fn a_hung_drain_gives_up_at_the_deadline() {
        let (release, hung) = mpsc::channel::<()>();
        let (exited, exit) = mpsc::channel::<()>();
        let deadline_ms = 20;
        let outcome = drain_bounded(
            move || {
                let _ = hung.recv_timeout(HUNG_PATIENCE);
                let _ = exited.send(());
                Ok(())
            },
            deadline_ms,
        );
        match outcome {
            Err(GpuError::ContextDrainDeadline { waited_ms, deadline_ms: d }) => {
                assert_eq!(d, deadline_ms);
                assert!(waited_ms >= deadline_ms, "gave up after {waited_ms} ms");
            }
            other => panic!("expected the drain deadline, got {other:?}"),
        }
        // The drain thread was still blocked when the caller gave up; release it and see it end.
        release.send(()).expect("the drain thread is still waiting");
        exit.recv_timeout(HUNG_PATIENCE).expect("the released drain thread ends");
    }
}
