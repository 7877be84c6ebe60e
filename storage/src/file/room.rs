//! The free space a FileStore counts on its device: one `statvfs` at open, then the store's
//! own account of what it reserved, counted again from the kernel only when the account runs
//! short or enough has been written since the last count. A PUT costs no system call for it,
//! and a refusal always rests on a fresh count.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes reserved between two counts from the kernel: other writers on the device (and the
/// store's own removals) show up at the next count, at the latest after this much.
pub(crate) const RECOUNT_BYTES: u64 = 256 << 20;

/// Bytes available to this process on the filesystem holding `root`, when the kernel says.
pub(crate) fn free_bytes(root: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(root.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: path is NUL-terminated and st is a valid, writable statvfs.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The account. Concurrent PUTs may each see the same balance; the account only decides when
/// to count again, and the count decides a refusal, so a race costs an extra count, never a
/// wrong refusal.
#[derive(Debug)]
pub(crate) struct DiskRoom {
    /// Free bytes at the last count, less what was reserved since.
    free: AtomicU64,
    /// Bytes reserved since the last count.
    since: AtomicU64,
    /// Counts taken from the kernel, for tests and reports.
    counts: AtomicU64,
}

impl DiskRoom {
    /// Starts the account with a count (none known when the kernel cannot say: then every
    /// admission counts again, as the store did before it kept an account).
    pub(crate) fn new(root: &Path) -> Self {
        Self::counted(|| free_bytes(root))
    }

    fn counted(count: impl FnOnce() -> Option<u64>) -> Self {
        let room =
            Self { free: AtomicU64::new(0), since: AtomicU64::new(0), counts: AtomicU64::new(0) };
        room.recount(count);
        room
    }

    /// Whether `needed` bytes fit: from the account while it has room and was counted less
    /// than [`RECOUNT_BYTES`] ago, otherwise from a fresh count. `Err` holds the free bytes of
    /// the count that refused.
    pub(crate) fn admit(&self, root: &Path, needed: u64) -> Result<(), u64> {
        self.admit_counting(needed, || free_bytes(root))
    }

    /// [`Self::admit`], counting with `count` when it must.
    fn admit_counting(&self, needed: u64, count: impl FnOnce() -> Option<u64>) -> Result<(), u64> {
        let since = self.since.fetch_add(needed, Ordering::Relaxed).saturating_add(needed);
        let free = self.free.load(Ordering::Relaxed);
        if free >= needed && since < RECOUNT_BYTES {
            self.free.fetch_sub(needed.min(free), Ordering::Relaxed);
            return Ok(());
        }
        match self.recount(count) {
            Some(free) if free < needed => Err(free),
            Some(_) => {
                self.free.fetch_sub(needed, Ordering::Relaxed);
                self.since.store(needed, Ordering::Relaxed);
                Ok(())
            }
            // The kernel cannot say: the write itself finds a full device.
            None => Ok(()),
        }
    }

    /// Counts again (from the kernel); the free bytes, when it says.
    fn recount(&self, count: impl FnOnce() -> Option<u64>) -> Option<u64> {
        self.counts.fetch_add(1, Ordering::Relaxed);
        let free = count()?;
        self.free.store(free, Ordering::Relaxed);
        self.since.store(0, Ordering::Relaxed);
        Some(free)
    }

    /// How many times the kernel was asked.
    pub(crate) fn counts(&self) -> u64 {
        self.counts.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use proptest::prelude::*;

    use super::*;

    /// The largest admission the property asks for.
    const NEEDED_MAX: u64 = 64 << 20;

    proptest! {
        /// Against a device whose free space the store's admissions use up and other writers
        /// change at will: a refusal always rests on a count taken for it that really had too
        /// little room, and the kernel is asked once at the start, once each time the account
        /// ran short, and otherwise at most once per `RECOUNT_BYTES` admitted, less the largest
        /// request (the one that crossed the mark).
        #[test]
        fn refusals_rest_on_a_fresh_count_and_counts_are_rare(
            start in 0u64..(4 << 30),
            steps in proptest::collection::vec(
                (1u64..NEEDED_MAX, -(1i64 << 30)..(1i64 << 30)),
                1..200,
            ),
        ) {
            let device = Cell::new(start);
            let room = DiskRoom::counted(|| Some(device.get()));
            let (mut admitted_bytes, mut short) = (0u64, 0u64);
            for (needed, others) in steps {
                // Other writers change the device behind the store's back.
                device.set(device.get().saturating_add_signed(others));
                let counts_before = room.counts();
                if room.free.load(Ordering::Relaxed) < needed {
                    short += 1;
                }
                let counted = Cell::new(None);
                let answer = room.admit_counting(needed, || {
                    counted.set(Some(device.get()));
                    Some(device.get())
                });
                match answer {
                    Err(free) => {
                        prop_assert_eq!(counted.get(), Some(free), "a refusal without a count");
                        prop_assert!(free < needed);
                        prop_assert_eq!(room.counts(), counts_before + 1);
                    }
                    Ok(()) => {
                        device.set(device.get().saturating_sub(needed));
                        admitted_bytes += needed;
                    }
                }
            }
            prop_assert!(
                room.counts() <= 2 + short + admitted_bytes / (RECOUNT_BYTES - NEEDED_MAX),
                "{} counts for {} bytes admitted and {} short accounts",
                room.counts(),
                admitted_bytes,
                short
            );
        }
    }

    #[test]
    fn a_device_the_kernel_cannot_count_refuses_nothing() {
        let room = DiskRoom::counted(|| None);
        assert_eq!(room.admit_counting(1 << 40, || None), Ok(()));
        assert_eq!(room.counts(), 2);
    }
}
