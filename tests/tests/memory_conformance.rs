//! MemoryStore runs the whole conformance suite: on the heap, and with its blocks in a
//! pre-faulted arena (a small one, so that blocks past it fall back to the heap in the same
//! store).

use std::sync::Arc;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::Subject;
use gpucache_storage::MemoryStore;

fn subject(store: MemoryStore) -> Subject {
    let store = Arc::new(store);
    let hook = Arc::clone(&store);
    let log = Arc::clone(&store);
    log.take_evicted();
    Subject {
        store: Box::new(store),
        corrupt: Box::new(move |key| hook.corrupt_for_test(key, 17)),
        evicted: Some(Box::new(move || log.take_evicted())),
    }
}

fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
    subject(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"))
}

gpucache_dataplane::conformance_suite!(make);

mod in_an_arena {
    use super::*;
    use gpucache_storage::host::arena::PayloadArena;

    /// Smaller than most rules' retained bytes, so both kinds of block meet in one store.
    const ARENA_BYTES: u64 = 2 << 20;

    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let arena = PayloadArena::new(ARENA_BYTES.min(limits.retained_bytes_max)).expect("arena");
        subject(MemoryStore::with_arena(limits, Arc::new(clock), arena).expect("valid limits"))
    }

    gpucache_dataplane::conformance_suite!(make);
}

/// The store as a cache tier: full quotas evict by each policy instead of refusing.
macro_rules! evicting {
    ($($module:ident => $policy:expr),* $(,)?) => {$(
        mod $module {
            use super::*;
            use gpucache_storage::evict::PolicyKind;

            fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
                let policy: PolicyKind = $policy;
                subject(MemoryStore::evicting(limits, Arc::new(clock), policy).expect("valid limits"))
            }

            gpucache_dataplane::conformance_suite!(make);
        }
    )*};
}

evicting!(
    evicting_fifo => PolicyKind::Fifo,
    evicting_lru => PolicyKind::Lru,
    evicting_arc => PolicyKind::Arc,
    evicting_s3fifo => PolicyKind::S3Fifo,
    evicting_prefix => PolicyKind::Prefix,
);
