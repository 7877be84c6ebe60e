//! The synchronisation primitives the admission module uses, in one place: the standard
//! library's normally, loom's model-checked ones when built with `--cfg loom`. Nothing else in
//! the module names `std::sync` for shared state, so a loom run checks every interleaving of it.

#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

/// Locks `mutex`, taking the state over if a holder panicked: every critical section in this
/// module leaves the state consistent before anything that could panic, so a poisoned lock
/// carries no half-done update.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
