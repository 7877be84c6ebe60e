//! The tiered store with a cold tier below runs the whole conformance suite: the hot tiers keep
//! the books, and the layer's demotions (every file-tier eviction read back and offered to the
//! sink) must change none of their answers. The sink does not drain here, so the cold tier
//! serves nothing the suite's model would have to know of; what it serves is tested against
//! moto in `layer.rs`. The object store is in memory (a simulation).

use std::sync::Arc;

use gpucache_cold::{
    ColdConfig, ColdLayerConfig, ColdSink, ColdTier, ColdTiered, MemoryObjects, SinkLimits,
};
use gpucache_dataplane::clock::{ManualClock, UnixClock};
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::Subject;
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::tiered::{MemoryTier, TieredStore};

fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut file = FileStoreConfig::new(dir.path());
    file.engine = EngineChoice::Psync;
    file.engine_config.staging_bytes = 0;
    file.durability = Durability::None;
    file.policy = PolicyKind::Fifo;
    let capacity = (limits.retained_bytes_max / 2).max(1);
    let memory = MemoryTier::new(capacity, PolicyKind::Prefix);
    file.limits = limits;
    let upper = Arc::new(TieredStore::open(file, memory, Arc::new(clock)).expect("tiered store"));
    let objects = Arc::new(MemoryObjects::new(1 << 30));
    let (cold, _) =
        ColdTier::open(objects, ColdConfig::default(), Arc::new(UnixClock)).expect("cold tier");
    let sink = Arc::new(ColdSink::new(SinkLimits::default()));
    let config = ColdLayerConfig { drain_interval_ms: 0, ..ColdLayerConfig::default() };
    let layer = ColdTiered::new(Arc::clone(&upper), Arc::new(cold), sink, config).expect("layer");
    let (hook, log) = (Arc::clone(&upper), Arc::clone(&upper));
    log.take_evicted_for_test();
    Subject {
        store: Box::new(layer),
        corrupt: Box::new(move |key| {
            let _keep = &dir;
            hook.corrupt_for_test(key, 17)
        }),
        evicted: Some(Box::new(move || log.take_evicted_for_test())),
    }
}

gpucache_dataplane::conformance_suite!(make);
