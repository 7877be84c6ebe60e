//! The tiered store (memory over file) runs the whole conformance suite: the file tier answers
//! for the contract, so its answers must be a FileStore's whatever the memory tier holds and
//! whether PUTs write through or back. The memory tier gets half the file tier's room, so that
//! it evicts (and, writing back, demotes) while the suite runs.

use std::sync::Arc;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::Subject;
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::tiered::{MemoryTier, TieredStore, WriteMode};

fn subject(
    file_policy: PolicyKind,
    write: WriteMode,
    limits: ResourceLimits,
    clock: ManualClock,
) -> Subject {
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }
        .expect("temp dir");
    let mut file = FileStoreConfig::new(dir.path());
    file.engine = EngineChoice::Psync;
    file.engine_config.staging_bytes = 0;
    file.durability = Durability::None;
    file.policy = file_policy;
    let capacity = (limits.retained_bytes_max / 2).max(1);
    let memory = MemoryTier { write, ..MemoryTier::new(capacity, PolicyKind::Prefix) };
    file.limits = limits;
    let store = Arc::new(TieredStore::open(file, memory, Arc::new(clock)).expect("tiered store"));
    let (hook, log) = (Arc::clone(&store), Arc::clone(&store));
    log.take_evicted_for_test();
    Subject {
        store: Box::new(store),
        corrupt: Box::new(move |key| {
            let _keep = &dir;
            hook.corrupt_for_test(key, 17)
        }),
        evicted: Some(Box::new(move || log.take_evicted_for_test())),
    }
}

mod file_fifo {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject(PolicyKind::Fifo, WriteMode::Through, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod file_prefix {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject(PolicyKind::Prefix, WriteMode::Through, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod back_file_fifo {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject(PolicyKind::Fifo, WriteMode::Back, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod back_file_prefix {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject(PolicyKind::Prefix, WriteMode::Back, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}
