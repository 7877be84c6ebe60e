//! The one registered Host allocation the executor's jobs read from and write into.
//!
//! The allocation is carved into equal slots, each behind its own lock, so that jobs on
//! different slots move bytes in parallel without any unsafe aliasing. A job's byte range must
//! lie inside one slot; the executor checks every range when the job is submitted, so a worker
//! never meets an out-of-bounds range. A worker handing several ranges to one batch call holds
//! each slot they lie in once, taking the slots in index order so that two such workers never
//! wait on each other in a cycle, and splits each slot's bytes into the disjoint ranges. The buffer is shared as an `Arc`: the executor keeps a
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
    #[error("ranges {first} and {second} overlap, and both are to be written at once")]
    Overlaps { first: HostRange, second: HostRange },
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

/// A locked slot and its index.
type HeldSlot<'a> = (usize, MutexGuard<'a, Box<[u8]>>);

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

    /// Locks the slots `sorted` names (ascending, repeats allowed), each once, in that order.
    fn lock_slots(
        &self,
        sorted: impl Iterator<Item = usize>,
    ) -> Result<Vec<HeldSlot<'_>>, RangeError> {
        let mut guards: Vec<HeldSlot<'_>> = Vec::new();
        for slot in sorted {
            if guards.last().is_some_and(|(held, _)| *held == slot) {
                continue;
            }
            let guard = self.slots.get(slot).map(lock_slot).ok_or(RangeError::OutOfBounds {
                range: HostRange::new(
                    (slot as u64).saturating_mul(self.slot_bytes.get() as u64),
                    self.slot_bytes.get() as u64,
                ),
                allocation_bytes: self.len_bytes(),
            })?;
            guards.push((slot, guard));
        }
        Ok(guards)
    }

    /// Runs `f` on the bytes of every range of `ranges`, given to it in the same order. The
    /// ranges must not overlap one another (several may share a slot); each slot they lie in is
    /// locked once, in slot order, and held until `f` returns.
    pub fn with_ranges_mut<R>(
        &self,
        ranges: &[HostRange],
        f: impl FnOnce(Vec<&mut [u8]>) -> R,
    ) -> Result<R, RangeError> {
        // (slot, start, end, position in `ranges`), sorted by place in the allocation.
        let mut placed = Vec::with_capacity(ranges.len());
        for (i, range) in ranges.iter().enumerate() {
            let (slot, start, end) = self.locate(*range)?;
            placed.push((slot, start, end, i));
        }
        placed.sort_unstable();
        for pair in placed.windows(2) {
            let ((slot_a, _, end_a, a), (slot_b, start_b, _, b)) = (pair[0], pair[1]);
            if slot_a == slot_b && end_a > start_b {
                return Err(RangeError::Overlaps { first: ranges[a], second: ranges[b] });
            }
        }
        let mut guards = self.lock_slots(placed.iter().map(|p| p.0))?;
        let mut pieces: Vec<Option<&mut [u8]>> = ranges.iter().map(|_| None).collect();
        let mut next = placed.iter().peekable();
        for (slot, guard) in &mut guards {
            // The slot's bytes not handed out yet, starting at `cursor`.
            let mut rest: &mut [u8] = guard;
            let mut cursor = 0;
            while let Some((_, start, end, i)) = next.next_if(|p| p.0 == *slot) {
                let out = RangeError::OutOfBounds {
                    range: ranges[*i],
                    allocation_bytes: self.len_bytes(),
                };
                let (_, tail) =
                    std::mem::take(&mut rest).split_at_mut_checked(start - cursor).ok_or(out)?;
                let (piece, tail) = tail.split_at_mut_checked(end - start).ok_or(out)?;
                pieces[*i] = Some(piece);
                rest = tail;
                cursor = *end;
            }
        }
        let pieces: Option<Vec<&mut [u8]>> = pieces.into_iter().collect();
        let pieces = pieces.ok_or(RangeError::OutOfBounds {
            range: ranges.first().copied().unwrap_or(HostRange::new(0, 0)),
            allocation_bytes: self.len_bytes(),
        })?;
        Ok(f(pieces))
    }

    /// Runs `f` on the bytes of every range of `ranges`, given to it in the same order (ranges
    /// may overlap). Each slot they lie in is locked once, in slot order, and held until `f`
    /// returns.
    pub fn with_ranges<R>(
        &self,
        ranges: &[HostRange],
        f: impl FnOnce(Vec<&[u8]>) -> R,
    ) -> Result<R, RangeError> {
        let located: Vec<(usize, usize, usize)> =
            ranges.iter().map(|r| self.locate(*r)).collect::<Result<_, _>>()?;
        let mut slots: Vec<usize> = located.iter().map(|l| l.0).collect();
        slots.sort_unstable();
        let guards = self.lock_slots(slots.into_iter())?;
        let mut pieces = Vec::with_capacity(ranges.len());
        for (range, (slot, start, end)) in ranges.iter().zip(&located) {
            let bytes = guards
                .binary_search_by_key(slot, |(held, _)| *held)
                .ok()
                .and_then(|g| guards[g].1.get(*start..*end))
                .ok_or(RangeError::OutOfBounds {
                    range: *range,
                    allocation_bytes: self.len_bytes(),
                })?;
            pieces.push(bytes);
        }
        Ok(f(pieces))
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
    fn several_ranges_of_one_slot_are_handed_out_disjoint_and_in_order() {
        let b = buffer();
        // Two ranges in slot 2 (given out of order), one in slot 0.
        let ranges = [HostRange::new(140, 4), HostRange::new(3, 2), HostRange::new(128, 8)];
        let lens = b
            .with_ranges_mut(&ranges, |pieces| {
                let lens: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
                for (n, piece) in (1..).zip(pieces) {
                    piece.fill(n);
                }
                lens
            })
            .expect("disjoint ranges");
        assert_eq!(lens, vec![4, 2, 8]);
        assert_eq!(b.read(HostRange::new(0, 6)).expect("in bounds"), vec![0, 0, 0, 2, 2, 0]);
        assert_eq!(
            b.read(HostRange::new(128, 18)).expect("in bounds"),
            [vec![3; 8], vec![0; 4], vec![1; 4], vec![0; 2]].concat()
        );
        let seen = b
            .with_ranges(&ranges, |pieces| pieces.iter().map(|p| p.to_vec()).collect::<Vec<_>>())
            .expect("in bounds");
        assert_eq!(seen, vec![vec![1; 4], vec![2; 2], vec![3; 8]]);
        // Overlapping ranges may be read together, never written together.
        let overlapping = [HostRange::new(130, 4), HostRange::new(128, 4)];
        assert_eq!(
            b.with_ranges(&overlapping, |pieces| pieces.concat()).expect("reads may overlap"),
            vec![3; 8]
        );
        assert_eq!(
            b.with_ranges_mut(&overlapping, |_| ()),
            Err(RangeError::Overlaps { first: overlapping[1], second: overlapping[0] })
        );
        // Any unusable range refuses the whole call before a slot is touched.
        assert_eq!(
            b.with_ranges_mut(&[HostRange::new(0, 4), HostRange::new(60, 8)], |_| ()),
            Err(RangeError::CrossesSlot { range: HostRange::new(60, 8), slot_bytes: 64 })
        );
        assert_eq!(b.read(HostRange::new(0, 4)).expect("in bounds"), vec![0, 0, 0, 2]);
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
