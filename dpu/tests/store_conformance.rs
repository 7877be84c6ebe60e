//! The store conformance suite through DpuStore: every key call runs on an agent reactor over a
//! FileStore (io_uring engine when available). GPUCACHE_CONFORMANCE_CASES bounds the cases.

use std::sync::Arc;
use std::time::Duration;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::Subject;
use gpucache_dpu::{
    AgentConfig, DpuStore, DpuStoreConfig, PinPolicy, QueueId, QueueKind, QueueSpec, ReactorId,
    ReactorSpec, SlabConfig,
};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::host::pool::{HugePagePolicy, Tier};

fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
    let dir = tempfile::tempdir().unwrap();
    let mut fc = FileStoreConfig::new(dir.path().join("store"));
    fc.engine = EngineChoice::Auto;
    fc.engine_config.staging_bytes = 0;
    fc.durability = Durability::None;
    // Slots as large as the largest block the limits admit, so that every refusal the suite
    // expects names the limits' maximum rather than a smaller slot.
    let slot_bytes = usize::try_from(limits.object_bytes_max).unwrap();
    fc.limits = limits;
    let file = Arc::new(fc.open(Arc::new(clock)).unwrap());
    let reactors: Vec<ReactorSpec> =
        (0..2).map(|i| ReactorSpec { id: ReactorId(i), core: None }).collect();
    let queues = (0..2)
        .map(|i| QueueSpec {
            id: QueueId(u32::from(i)),
            owner: ReactorId(i),
            depth_max: 64,
            kind: QueueKind::Host {
                root: dir.path().join(format!("q{i}")),
                engine: EngineChoice::Auto,
                sync: false,
            },
        })
        .collect();
    let agent = AgentConfig {
        state_dir: dir.path().join("agent"),
        reactors,
        queues,
        pin: PinPolicy::BestEffort,
        slab: SlabConfig {
            slots: 32,
            slot_bytes,
            lease_ms: 60_000,
            policy: HugePagePolicy::only(Tier::Plain),
        },
        idle_park: Duration::from_millis(1),
    }
    .start()
    .unwrap();
    let store = DpuStore::new(Arc::new(agent), file.clone(), DpuStoreConfig::default());
    Subject {
        store: Box::new(store),
        corrupt: Box::new(move |key| {
            let _keep = &dir;
            file.corrupt_for_test(key, 17)
        }),
        evicted: None,
    }
}

gpucache_dataplane::conformance_suite!(make);
