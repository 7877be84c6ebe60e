//! The one registered Host allocation the executor's jobs read from and write into.
//!
//! The allocation is carved into equal slots, each behind its own lock, so that jobs on
//! different slots move bytes in parallel without any unsafe aliasing. A job's byte range must
//! lie inside one slot; the executor checks every range when the job is submitted, so a worker
//! never meets an out-of-bounds range. The buffer is shared as an `Arc`: the executor keeps a
//! reference for as long as any native call may still touch it, and for the whole process once
//! a call's retirement is unknown.
//!
//! This module decides nothing about who may use which range; that is the scheduler's
//! reservation and the executor's quarantine.

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A byte range of the Host allocation: `len` bytes from `offset`, inside one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostRange {
    pub offset: u64,
    pub len: u64,
}

impl HostRange {
    pub fn new(offset: u64, len: u64) -> Self {
        Self { offset, len }
    }
}

impl fmt::Display for HostRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, +{})", self.offset, self.len)
    }
}

/// Why a range cannot be used with this allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum RangeError {
    #[error("range {range} is empty")]
    Empty { range: HostRange },
    #[error("range {range} ends past the {allocation_bytes}-byte allocation")]
    OutOfBounds { range: HostRange, allocation_bytes: u64 },
    #[error("range {range} crosses a slot boundary (slots are {slot_bytes} bytes)")]
    CrossesSlot { range: HostRange, slot_bytes: u64 },
}

/// Why a Host allocation could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum HostBufferError {
    #[error("{slot_count} slots of {slot_bytes} bytes overflow the address space")]
    TooLarge { slot_count: usize, slot_bytes: usize },
}

/// The executor's registered Host allocation: `slot_count` slots of `slot_bytes` each.
pub struct HostBuffer {
    slot_bytes: NonZeroUsize,
    slots: Vec<Mutex<Box<[u8]>>>,
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("slot_count", &self.slots.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

fn lock_slot(slot: &Mutex<Box<[u8]>>) -> MutexGuard<'_, Box<[u8]>> {
    // A panic while a slot is held leaves only bytes behind, never a broken invariant.
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HostBuffer {
    /// A zeroed allocation of `slot_count` slots of `slot_bytes` bytes.
    pub fn new(
        slot_count: NonZeroUsize,
        slot_bytes: NonZeroUsize,
    ) -> Result<Self, HostBufferError> {
        let too_large = HostBufferError::TooLarge {
            slot_count: slot_count.get(),
            slot_bytes: slot_bytes.get(),
        };
        let total = slot_count.get().checked_mul(slot_bytes.get()).ok_or(too_large)?;
        u64::try_from(total).map_err(|_| too_large)?;
        let slots = (0..slot_count.get())
            .map(|_| Mutex::new(vec![0_u8; slot_bytes.get()].into_boxed_slice()))
            .collect();
        Ok(Self { slot_bytes, slots })
    }

    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes.get()
    }

    /// Total bytes of the allocation.
    pub fn len_bytes(&self) -> u64 {
        // `new` checked that the product fits a u64.
        (self.slots.len() as u64).saturating_mul(self.slot_bytes.get() as u64)
    }

    /// The slot index and the in-slot start and end of `range`, or why it is unusable.
    fn locate(&self, range: HostRange) -> Result<(usize, usize, usize), RangeError> {
        if range.len == 0 {
            return Err(RangeError::Empty { range });
        }
        let allocation_bytes = self.len_bytes();
        let out = RangeError::OutOfBounds { range, allocation_bytes };
        let end = range.offset.checked_add(range.len).ok_or(out)?;
        if end > allocation_bytes {
            return Err(out);
        }
        let slot_bytes = self.slot_bytes.get() as u64;
        let slot = range.offset / slot_bytes;
        let start = range.offset % slot_bytes;
        if start + range.len > slot_bytes {
            return Err(RangeError::CrossesSlot { range, slot_bytes });
        }
        // All three values are below the allocation size, which fits a usize.
        let as_usize = |v: u64| usize::try_from(v).map_err(|_| out);
        Ok((as_usize(slot)?, as_usize(start)?, as_usize(start + range.len)?))
    }

    /// Checks that `range` is usable, without touching it.
    pub fn check(&self, range: HostRange) -> Result<(), RangeError> {
        self.locate(range).map(|_| ())
    }

    /// Runs `f` on the bytes of `range`, holding its slot.
    pub fn with_range_mut<R>(
        &self,
        range: HostRange,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, RangeError> {
        let (slot, start, end) = self.locate(range)?;
        let mut guard = self
            .slots
            .get(slot)
            .map(lock_slot)
            .ok_or(RangeError::OutOfBounds { range, allocation_bytes: self.len_bytes() })?;
        let bytes = guard
            .get_mut(start..end)
            .ok_or(RangeError::OutOfBounds { range, allocation_bytes: self.len_bytes() })?;
        Ok(f(bytes))
    }

    /// Runs `f` on the bytes of `range`, holding its slot.
    pub fn with_range<R>(
        &self,
        range: HostRange,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, RangeError> {
        self.with_range_mut(range, |bytes| f(bytes))
    }

    /// Copies `src` into the front of `range` (the owner filling a PUT source).
    pub fn write(&self, range: HostRange, src: &[u8]) -> Result<(), RangeError> {
        self.with_range_mut(range, |dst| {
            let n = dst.len().min(src.len());
            dst[..n].copy_from_slice(&src[..n]);
        })
    }

    /// A copy of the bytes of `range` (the owner publishing a GET destination).
    pub fn read(&self, range: HostRange) -> Result<Vec<u8>, RangeError> {
        self.with_range(range, <[u8]>::to_vec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer() -> HostBuffer {
        let n = |v| NonZeroUsize::new(v).expect("nonzero");
        HostBuffer::new(n(4), n(64)).expect("fits")
    }

    #[test]
    fn ranges_are_checked_against_the_slots() {
        let b = buffer();
        assert_eq!(b.len_bytes(), 256);
        assert_eq!(b.check(HostRange::new(64, 64)), Ok(()));
        assert_eq!(
            b.check(HostRange::new(10, 0)),
            Err(RangeError::Empty { range: HostRange::new(10, 0) })
        );
        assert_eq!(
            b.check(HostRange::new(250, 10)),
            Err(RangeError::OutOfBounds { range: HostRange::new(250, 10), allocation_bytes: 256 })
        );
        assert_eq!(
            b.check(HostRange::new(u64::MAX, 2)),
            Err(RangeError::OutOfBounds {
                range: HostRange::new(u64::MAX, 2),
                allocation_bytes: 256
            })
        );
        assert_eq!(
            b.check(HostRange::new(60, 8)),
            Err(RangeError::CrossesSlot { range: HostRange::new(60, 8), slot_bytes: 64 })
        );
    }

    #[test]
    fn writes_and_reads_land_in_their_range() {
        let b = buffer();
        b.write(HostRange::new(130, 4), &[1, 2, 3, 4]).expect("in bounds");
        assert_eq!(
            b.read(HostRange::new(128, 8)).expect("in bounds"),
            vec![0, 0, 1, 2, 3, 4, 0, 0]
        );
    }

    #[test]
    fn error_messages_carry_the_numbers() {
        assert_eq!(
            RangeError::CrossesSlot { range: HostRange::new(60, 8), slot_bytes: 64 }.to_string(),
            "range [60, +8) crosses a slot boundary (slots are 64 bytes)"
        );
        assert_eq!(
            RangeError::OutOfBounds { range: HostRange::new(250, 10), allocation_bytes: 256 }
                .to_string(),
            "range [250, +10) ends past the 256-byte allocation"
        );
        assert_eq!(
            RangeError::Empty { range: HostRange::new(3, 0) }.to_string(),
            "range [3, +0) is empty"
        );
    }
}
