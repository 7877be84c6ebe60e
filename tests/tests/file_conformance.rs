//! FileStore runs the whole conformance suite, unchanged, on each I/O engine, with an eviction
//! policy other than commit order, and with its blocks in the block log.

use std::sync::Arc;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::testing::Subject;
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig, Layout};

fn subject(
    engine: EngineChoice,
    direct_io: bool,
    limits: ResourceLimits,
    clock: ManualClock,
) -> Subject {
    subject_with(engine, direct_io, PolicyKind::Fifo, limits, clock)
}

fn subject_with(
    engine: EngineChoice,
    direct_io: bool,
    policy: PolicyKind,
    limits: ResourceLimits,
    clock: ManualClock,
) -> Subject {
    subject_durable(engine, direct_io, policy, (Durability::None, Layout::Files), limits, clock)
}

fn subject_durable(
    engine: EngineChoice,
    direct_io: bool,
    policy: PolicyKind,
    (durability, layout): (Durability, Layout),
    limits: ResourceLimits,
    clock: ManualClock,
) -> Subject {
    // Buffered stores live on tmpfs when there is one (the suite opens thousands of stores);
    // O_DIRECT needs a real filesystem.
    let shm = std::path::Path::new("/dev/shm");
    let dir = if !direct_io && shm.is_dir() {
        tempfile::tempdir_in(shm).expect("temp dir")
    } else {
        tempfile::tempdir().expect("temp dir")
    };
    let mut config = FileStoreConfig::new(dir.path());
    config.engine = engine;
    config.direct_io = direct_io;
    // The suite opens thousands of stores: one registered staging slot (O_DIRECT) or none.
    config.engine_config.staging_bytes =
        if direct_io { gpucache_storage::file::engine::uring::SLOT_BYTES } else { 0 };
    config.durability = durability;
    config.layout = layout;
    // Small log segments: the suite opens thousands of stores, and fills some.
    config.log_segment_bytes = gpucache_storage::file::LOG_SEGMENT_BYTES_MIN;
    config.limits = limits;
    config.policy = policy;
    let store = Arc::new(config.open(Arc::new(clock)).expect("file store opens"));
    assert_eq!(
        store.engine_name(),
        match engine {
            EngineChoice::Uring => "uring",
            _ => "psync",
        }
    );
    let hook = Arc::clone(&store);
    let log = Arc::clone(&store);
    log.take_evicted();
    Subject {
        store: Box::new(store),
        evicted: Some(Box::new(move || log.take_evicted())),
        // The closure owns the directory: it is removed when the subject goes.
        corrupt: Box::new(move |key| {
            let _keep = &dir;
            hook.corrupt_for_test(key, 17)
        }),
    }
}

mod psync {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject(EngineChoice::Psync, false, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod uring {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject(EngineChoice::Uring, false, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod uring_direct {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject(EngineChoice::Uring, true, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod psync_prefix {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        subject_with(EngineChoice::Psync, false, PolicyKind::Prefix, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod psync_log_durable {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let layout = (Durability::PerBlock, Layout::Log);
        subject_durable(EngineChoice::Psync, false, PolicyKind::Fifo, layout, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}

mod uring_log {
    use super::*;
    fn make(limits: ResourceLimits, clock: ManualClock) -> Subject {
        let layout = (Durability::None, Layout::Log);
        subject_durable(EngineChoice::Uring, false, PolicyKind::Prefix, layout, limits, clock)
    }
    gpucache_dataplane::conformance_suite!(make);
}
