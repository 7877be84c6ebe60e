//! The synchronisation primitives the executor's shared state uses: the standard library's in
//! ordinary builds, loom's when built with `--cfg loom` so that the model checker can explore
//! every interleaving of the loom tests.

#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, taking the data even if a holder panicked: every critical section in the
/// executor finishes its state change without calling anything that can panic, so a poisoned
/// lock still guards consistent data.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
