//! A MeteredStore over MemoryStore runs the whole conformance suite: recording metrics changes
//! no answer.

use std::sync::{Arc, Weak};

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::Subject;
use gpucache_service::metered::{ExpositionFormat, MeteredStore, Metrics};
use gpucache_storage::MemoryStore;

fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
    let memory = Arc::new(MemoryStore::new(limits, Arc::new(clock)).expect("valid limits"));
    let hook = Arc::clone(&memory);
    let metrics = Arc::new(Metrics::new());
    // The wrapper itself goes to the suite (not an `Arc` of it, whose Store impl would turn
    // `put` into reserve, write and commit), so its own `put` is exercised too.
    let store = MeteredStore::new(Arc::clone(&memory), Arc::clone(&metrics));
    let weak: Weak<dyn Store> = Arc::downgrade(&memory) as Weak<dyn Store>;
    metrics.watch_store(weak);
    // Encoding while the suite runs also exercises the stats collector on every store it builds.
    let text = store.metrics().encode(ExpositionFormat::Prometheus);
    assert!(text.contains("gpucache_epoch "), "store gauges missing:\n{text}");
    Subject {
        store: Box::new(store),
        corrupt: Box::new(move |key| hook.corrupt_for_test(key, 17)),
        evicted: None,
    }
}

gpucache_dataplane::conformance_suite!(make);
