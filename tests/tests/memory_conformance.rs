//! MemoryStore runs the whole conformance suite.

use std::sync::Arc;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::Subject;
use gpucache_storage::MemoryStore;

fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
    let store = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
    let hook = Arc::clone(&store);
    Subject { store: Box::new(store), corrupt: Box::new(move |key| hook.corrupt_for_test(key, 17)) }
}

gpucache_dataplane::conformance_suite!(make);
