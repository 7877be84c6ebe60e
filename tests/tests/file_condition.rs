//! What a FileStore reports of itself for readiness (`Store::condition`): the latest I/O's
//! outcome on its medium, cleared by the next success, and the file system's free space.

mod common;

use std::sync::Arc;

use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::store::{Get, MissReason, Put, Store};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::file::engine::IoEngine;
use gpucache_storage::file::engine::faulty::{FaultConfig, FaultyEngine};
use gpucache_storage::file::engine::psync::PsyncEngine;
use gpucache_storage::file::{FileStore, FileStoreConfig};

#[test]
fn a_failed_write_is_reported_until_the_next_io_succeeds() {
    let dir = tempfile::tempdir().expect("temp dir");
    let engine = Arc::new(FaultyEngine::new(
        Arc::new(PsyncEngine) as Arc<dyn IoEngine>,
        FaultConfig { write_eio: 1.0, ..FaultConfig::none(7) },
    ));
    engine.set_enabled(false);
    let store = FileStore::open_with_engine(
        FileStoreConfig::new(dir.path()),
        Arc::clone(&engine) as Arc<dyn IoEngine>,
        Arc::new(ManualClock::default()),
    )
    .expect("open");
    let condition = store.condition();
    assert_eq!(condition.io_failure, Some(None), "nothing failed yet");
    let free = condition.free_bytes.expect("a file system reports its free space");
    assert!(free > 0);
    assert!(condition.block_overhead_bytes > 0);

    engine.set_enabled(true);
    let failed = store.put(&caller(0), &common::block_key(1, 0, 1), &[5u8; 8192], None);
    assert!(failed.is_err(), "an injected EIO must fail the PUT: {failed:?}");
    let failure = store.condition().io_failure.expect("tracked").expect("the failure is kept");
    assert!(failure.contains("Input/output error") || failure.contains("EIO"), "{failure}");
    // Still reported while nothing has succeeded since.
    assert!(store.condition().io_failure.expect("tracked").is_some());

    engine.set_enabled(false);
    let put = store.put(&caller(0), &common::block_key(1, 0, 2), &[6u8; 8192], None);
    assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    assert_eq!(store.condition().io_failure, Some(None), "a success clears the failure");
}

/// A block file cut short is a damaged block the store drops (a miss), not a failing disk: the
/// readiness' I/O verdict stays clean.
#[test]
fn a_truncated_block_is_a_miss_not_an_io_failure() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = common::open(FileStoreConfig::new(dir.path()));
    let k = common::block_key(2, 0, 1);
    let put = store.put(&caller(0), &k, &[9u8; 16384], None);
    assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    let file = common::block_file(dir.path(), &k);
    let len = std::fs::metadata(&file).expect("block file").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncate");
    let mut dst = vec![0u8; 16384];
    let got = store.get_into(&caller(0), &k, &mut dst).expect("get");
    assert_eq!(got, Get::Miss(MissReason::Corrupt));
    assert_eq!(store.condition().io_failure, Some(None));
}
