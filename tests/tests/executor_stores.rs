//! The executor core against real stores: the same small QUERY/GET/PUT workload through a
//! MemoryStore, a FileStore (psync engine, in a temporary directory) and the TCP client of an
//! in-process server, checking exact bytes after the round trip.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{MissReason, Store};
use gpucache_dataplane::testing::fixture::{key, payload, tenant};
use gpucache_executor::testing;
use gpucache_executor::{
    Ending, Executor, HostRange, KeyFailure, KeyResult, OperationId, OperationResult,
};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};

const SLOT_BYTES: usize = 8192;
const SLOTS: usize = 16;
/// Payload sizes of the objects the workload writes: whole slots and odd tails.
const SIZES: [u64; 4] = [8192, 4096, 1000, 1];
const WAIT: Duration = Duration::from_secs(20);

fn caller() -> Caller {
    Caller::new(tenant(0), Rights::ALL)
}

fn slot(n: usize, len: u64) -> HostRange {
    HostRange::new((n * SLOT_BYTES) as u64, len)
}

fn wait_for(exec: &Executor, operation: OperationId) -> OperationResult {
    let result = testing::wait_for(exec, operation, WAIT);
    assert_eq!(result.ending, Ending::Ran);
    assert!(result.retired, "{operation} retired");
    result
}

/// PUT four objects from slots 0..4, QUERY them and one absent key, GET them into slots 8..12
/// and compare every byte, then PUT them again: create-only duplicates are idempotent success.
fn workload(store: Arc<dyn Store>) {
    let (exec, host) = testing::executor(store, SLOTS, SLOT_BYTES);
    let keys: Vec<_> = (0..SIZES.len())
        .map(|i| key(0, &[u8::try_from(i).expect("small") + 1], KvDtype::F16, 16))
        .collect();
    let absent = key(0, &[99], KvDtype::F16, 16);
    let data: Vec<Vec<u8>> = SIZES
        .iter()
        .enumerate()
        .map(|(i, len)| payload(i as u64 + 7, usize::try_from(*len).expect("small")))
        .collect();
    for (i, bytes) in data.iter().enumerate() {
        host.write(slot(i, SIZES[i]), bytes).expect("source range");
    }

    let writes = keys.iter().enumerate().map(|(i, k)| (k.clone(), slot(i, SIZES[i]))).collect();
    let put = exec.submit_put(writes).expect("put queued");
    let result = wait_for(&exec, put);
    assert!(
        result.keys.iter().all(|k| matches!(k, KeyResult::Written { .. })),
        "new writes: {:?}",
        result.keys
    );

    let mut queried = keys.clone();
    queried.push(absent.clone());
    let query = exec.submit_query(queried).expect("query queued");
    let result = wait_for(&exec, query);
    let expected: Vec<KeyResult> = SIZES
        .iter()
        .map(|len| KeyResult::Found { len: *len })
        .chain([KeyResult::Failed(KeyFailure::NotFound)])
        .collect();
    assert_eq!(result.keys, expected);

    let mut reads: Vec<_> =
        keys.iter().enumerate().map(|(i, k)| (k.clone(), slot(8 + i, SIZES[i]))).collect();
    reads.push((absent, slot(15, 64)));
    let get = exec.submit_get(reads).expect("get queued");
    let result = wait_for(&exec, get);
    let expected: Vec<KeyResult> = SIZES
        .iter()
        .map(|len| KeyResult::Read { bytes: *len })
        .chain([KeyResult::ObjectFailed(MissReason::Absent)])
        .collect();
    assert_eq!(result.keys, expected);
    for (i, bytes) in data.iter().enumerate() {
        assert_eq!(&host.read(slot(8 + i, SIZES[i])).expect("range"), bytes, "object {i}");
    }

    // A destination one byte longer than the object is a short read, never a success.
    let long = exec.submit_get(vec![(keys[2].clone(), slot(12, SIZES[2] + 1))]).expect("queued");
    let result = wait_for(&exec, long);
    assert_eq!(
        result.keys,
        vec![KeyResult::Failed(KeyFailure::ShortRead { expected: SIZES[2] + 1, got: SIZES[2] })]
    );

    let again = keys.iter().enumerate().map(|(i, k)| (k.clone(), slot(i, SIZES[i]))).collect();
    let put = exec.submit_put(again).expect("put queued");
    let result = wait_for(&exec, put);
    assert_eq!(result.keys, vec![KeyResult::AlreadyStored; SIZES.len()]);

    let counters = exec.counters();
    assert_eq!(counters.put_new_writes, 4);
    assert_eq!(counters.put_already_stored, 4);
    assert_eq!(counters.get_bytes_read, SIZES.iter().sum::<u64>());
    assert_eq!(exec.health().epoch, 0);
    let report = exec.close(WAIT);
    assert!(!report.restart_required, "{report}");
    assert_eq!(report.workers_stuck, 0);
}

#[test]
fn executor_round_trips_through_memory_store() {
    let store = MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
        .expect("valid limits");
    workload(Arc::new(store));
}

#[test]
fn executor_round_trips_through_file_store() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = FileStoreConfig::new(dir.path());
    config.engine = EngineChoice::Psync;
    config.durability = Durability::None;
    let store = config.open(Arc::new(ManualClock::default())).expect("file store opens");
    assert_eq!(store.engine_name(), "psync");
    workload(Arc::new(store));
}

#[test]
fn executor_round_trips_through_the_tcp_client() {
    let backing = MemoryStore::new(ResourceLimits::default(), Arc::new(ManualClock::default()))
        .expect("valid limits");
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let server =
        Server::start(ServerConfig::new(addr, vec![caller()]), Arc::new(backing) as Arc<dyn Store>)
            .expect("server starts");
    let client = TcpStore::new(ClientConfig::new(server.local_addr(), caller()));
    workload(Arc::new(client));
    drop(server);
}
