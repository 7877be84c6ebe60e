//! Fixtures for tests that drive an executor over a real store.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucache_dataplane::Store;
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::testing::fixture::tenant;

use crate::{Executor, ExecutorConfig, HostBuffer, OperationId, OperationResult};

/// An executor with the default configuration over `store`, acting for tenant 0 with every
/// right, on a fresh host buffer of `slots` slots of `slot_bytes` and a manual clock.
pub fn executor(
    store: Arc<dyn Store>,
    slots: usize,
    slot_bytes: usize,
) -> (Executor, Arc<HostBuffer>) {
    let n = |v| NonZeroUsize::new(v).expect("executor fixture: sizes must be nonzero");
    let host = Arc::new(HostBuffer::new(n(slots), n(slot_bytes)).expect("host buffer"));
    let exec = Executor::start(
        ExecutorConfig::default(),
        store,
        Caller::new(tenant(0), Rights::ALL),
        Arc::clone(&host),
        Arc::new(ManualClock::default()),
    )
    .expect("executor starts");
    (exec, host)
}

/// Waits for `operation`'s result from `exec`, failing the test once `patience` has passed.
/// Results of other operations that arrive meanwhile are dropped: use it for one operation at a
/// time.
pub fn wait_for(exec: &Executor, operation: OperationId, patience: Duration) -> OperationResult {
    let deadline = Instant::now() + patience;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no result for {operation} within {patience:?}");
        let poll = exec.poll_wait(left);
        if let Some(result) = poll.results.into_iter().find(|r| r.operation == operation) {
            return result;
        }
    }
}
