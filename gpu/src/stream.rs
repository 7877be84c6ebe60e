//! Block-slot copies on one CUDA stream: H2D from a staging slot into a device slot and D2H
//! back, each followed by its own completion event, settled through [`TransferBook`].

use std::num::NonZeroUsize;
use std::sync::Arc;

use cudarc::driver::{result, sys};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::registry::{PoolMemory, RegisteredPool, SlotLease};

use crate::error::{DriverCode, GpuError, driver};
use crate::memory::{GpuDevice, GpuSlots, PinnedStaging};
use crate::retire::{
    CompletionEvent, EventStatus, FenceReport, RetireLimits, Retirement, Settled, StreamDrained,
    TransferBook, TransferCounters, TransferId, await_event,
};

/// A recorded `cuEvent`; dropping it destroys the event (the driver lets an incomplete event be
/// destroyed; it releases it at completion).
#[derive(Debug)]
pub struct CudaEvent {
    raw: sys::CUevent,
}

// SAFETY: an event handle may be queried and destroyed from any thread of its context.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    fn record_on(stream: sys::CUstream) -> Result<Self, GpuError> {
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(driver("cuEventCreate"))?;
        let event = Self { raw };
        // SAFETY: both handles are live: the event was just created, the stream is the caller's.
        unsafe { result::event::record(event.raw, stream) }.map_err(driver("cuEventRecord"))?;
        Ok(event)
    }
}

impl CompletionEvent for CudaEvent {
    fn query(&mut self) -> EventStatus {
        // SAFETY: `raw` is a live, recorded event.
        match unsafe { result::event::query(self.raw) } {
            Ok(()) => EventStatus::Complete,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => EventStatus::Pending,
            Err(e) => EventStatus::Failed { code: e.0 as u32 },
        }
    }
}

/// The stream itself as a completion: complete once everything queued on it has finished.
struct StreamIdle(sys::CUstream);

impl CompletionEvent for StreamIdle {
    fn query(&mut self) -> EventStatus {
        // SAFETY: the stream is live for as long as the GpuStream that made this lends it.
        match unsafe { sys::cuStreamQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => EventStatus::Complete,
            sys::CUresult::CUDA_ERROR_NOT_READY => EventStatus::Pending,
            e => EventStatus::Failed { code: e as u32 },
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the driver defers the release of an incomplete event.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Staging slot to device slot.
    HostToDevice,
    /// Device slot to staging slot.
    DeviceToHost,
}

/// One non-blocking stream of one device, with its bounded book of copies in flight.
#[derive(Debug)]
pub struct GpuStream {
    device: Arc<GpuDevice>,
    raw: sys::CUstream,
    book: TransferBook<CudaEvent>,
    clock: MonotonicClock,
}

// SAFETY: a stream handle may be used from any thread once its context is current; every call
// here makes it current first, and `&mut self` serialises the book.
unsafe impl Send for GpuStream {}

impl GpuStream {
    pub fn new(
        device: Arc<GpuDevice>,
        in_flight_max: NonZeroUsize,
        limits: RetireLimits,
    ) -> Result<Self, GpuError> {
        device.bind_thread()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(driver("cuStreamCreate"))?;
        Ok(Self {
            device,
            raw,
            book: TransferBook::new(in_flight_max, limits),
            clock: MonotonicClock::default(),
        })
    }

    pub fn in_flight(&self) -> usize {
        self.book.in_flight()
    }
    pub fn counters(&self) -> TransferCounters {
        self.book.counters()
    }

    /// Starts a copy of `len` bytes between the staging slot and the device slot. Both leases
    /// must be lent; the bytes must not be touched by the CPU until [`settle`](Self::settle)
    /// says the copy retired.
    pub fn copy(
        &mut self,
        direction: Direction,
        device_pool: &mut RegisteredPool<GpuSlots>,
        device: &SlotLease,
        staging_pool: &mut RegisteredPool<PinnedStaging>,
        staging: &SlotLease,
        len: usize,
    ) -> Result<TransferId, GpuError> {
        self.book.admit(device_pool, device, staging_pool, staging)?;
        let slot_bytes = device_pool.memory().slot_bytes().min(staging_pool.memory().slot_bytes());
        if len > slot_bytes {
            return Err(GpuError::TransferTooLong { len, slot_bytes });
        }
        let staging_device = staging_pool.memory().device().ordinal();
        if staging_device != self.device.ordinal()
            || device_pool.memory().device().ordinal() != self.device.ordinal()
        {
            return Err(GpuError::DeviceMismatch {
                region: staging.region,
                device: self.device.ordinal(),
                staging_device,
            });
        }
        let dptr = device_pool.memory().slot_ptr(device.slot)?;
        let hptr = staging_pool.memory().slot_ptr(staging.slot)?;
        self.device.bind_thread()?;
        // SAFETY: `hptr` and `dptr` address `len` bytes inside their slots (checked above), both
        // slots are lent to this copy, and both allocations outlive it: their Drop drains the
        // context before freeing.
        let submitted = unsafe {
            match direction {
                Direction::HostToDevice => {
                    sys::cuMemcpyHtoDAsync_v2(dptr, hptr.cast_const().cast(), len, self.raw)
                }
                Direction::DeviceToHost => {
                    sys::cuMemcpyDtoHAsync_v2(hptr.cast(), dptr, len, self.raw)
                }
            }
        };
        let call = match direction {
            Direction::HostToDevice => "cuMemcpyHtoDAsync",
            Direction::DeviceToHost => "cuMemcpyDtoHAsync",
        };
        submitted.result().map_err(driver(call))?;
        match CudaEvent::record_on(self.raw) {
            Ok(event) => Ok(self.book.record(device.region, staging.region, event)),
            // The copy is queued but nothing can tell when it ends.
            Err(e) => Err(self.book.unobservable(device_pool, device, staging_pool, staging, e)),
        }
    }

    /// Waits for one copy; see [`TransferBook::settle`].
    pub fn settle(
        &mut self,
        transfer: TransferId,
        device_pool: &mut RegisteredPool<GpuSlots>,
        staging_pool: &mut RegisteredPool<PinnedStaging>,
    ) -> Result<Settled, GpuError> {
        self.device.bind_thread()?;
        self.book.settle(transfer, device_pool, staging_pool, &self.clock)
    }

    /// Waits until everything submitted on this stream finished: the proof a fence needs. The
    /// stream is polled (cuStreamQuery) under the same deadline as one copy's event, so a hung
    /// copy makes this fail with [`GpuError::DrainDeadline`] instead of blocking forever.
    pub fn synchronize(&self) -> Result<StreamDrained, GpuError> {
        self.device.bind_thread()?;
        match await_event(&mut StreamIdle(self.raw), &self.clock, self.book.limits()) {
            Retirement::Retired => Ok(StreamDrained::observed()),
            Retirement::EventFailed { code } => Err(GpuError::Driver {
                call: "cuStreamQuery",
                code: DriverCode { code, name: "stream query failed".to_owned() },
            }),
            Retirement::DeadlineMissed { waited_ms } => Err(GpuError::DrainDeadline { waited_ms }),
        }
    }

    /// Drains the stream and returns every slot of both pools checked out before now,
    /// quarantined ones included.
    pub fn fence(
        &mut self,
        device_pool: &mut RegisteredPool<GpuSlots>,
        staging_pool: &mut RegisteredPool<PinnedStaging>,
    ) -> Result<FenceReport, GpuError> {
        let drained = self.synchronize()?;
        self.book.fence(drained, device_pool, staging_pool)
    }
}

impl Drop for GpuStream {
    fn drop(&mut self) {
        if self.device.bind_thread().is_err() {
            return;
        }
        // SAFETY: destroyed once; the driver finishes queued work before releasing it.
        let _ = unsafe { result::stream::destroy(self.raw) };
    }
}
