//! `put_batch_checked`: a PUT whose bytes do not hash to the writer's checksum is refused and
//! nothing is stored for it, on every path that carries the writer's checksum: the memory
//! store (which compares in the pass that copies), the file store (which hashes once, before it
//! writes), a layer on the trait's default (hashed first), the metered layer, and the service
//! over TCP frames and over the same-host segment, where the server hands the client's
//! checksums to the store.

use std::sync::Arc;
use std::time::Duration;

use gpucache_client::{ClientConfig, LocalConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{BatchPut, Get, Lookup, MissReason, Put, Store, StoreError};
use gpucache_dataplane::testing::counting::{Call, Counting};
use gpucache_dataplane::testing::fixture::{key, payload, tenant};
use gpucache_service::metered::{MeteredStore, Metrics};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;
use gpucache_storage::file::{Durability, FileStoreConfig};

fn caller() -> Caller {
    Caller::new(tenant(0), Rights::READ_WRITE)
}

fn limits() -> ResourceLimits {
    ResourceLimits { object_bytes_max: 8 << 20, ..ResourceLimits::default() }
}

fn memory() -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(limits(), Arc::new(MonotonicClock::default())).expect("store"))
}

fn k(i: u8) -> PhysicalKey {
    key(0, &[i, 7], KvDtype::F16, 16)
}

/// Three items under keys after `base`, the middle one under a checksum its bytes do not have (and, when there is
/// room, a fourth without any checksum): the sound ones are stored and read back byte for
/// byte, the damaged one is refused and leaves nothing under its key, and the store's counts
/// moved by the sound ones only.
fn refuses_only_the_damaged_item(
    store: &dyn Store,
    base: u8,
    sizes: [usize; 3],
    missing_sum: bool,
) {
    let c = caller();
    let keys = [k(base + 1), k(base + 2), k(base + 3), k(base + 4)];
    let values: Vec<Vec<u8>> =
        sizes.iter().enumerate().map(|(i, &n)| payload(i as u64, n)).collect();
    let mut sums: Vec<Checksum> = values.iter().map(|v| Checksum::of(v)).collect();
    sums[1] = Checksum(sums[1].0 ^ 0x8000);
    let mut items: Vec<BatchPut<'_>> =
        keys.iter().zip(&values).map(|(key, src)| BatchPut { key, src, request: None }).collect();
    if missing_sum {
        items.push(BatchPut { key: &keys[3], src: &values[0], request: None });
    }
    let before = store.stats();
    let answers = store.put_batch_checked(&c, &items, &sums);
    assert_eq!(answers.len(), items.len());
    assert_eq!(answers[0], Ok(Put::Committed(Checksum::of(&values[0]))));
    assert_eq!(answers[2], Ok(Put::Committed(Checksum::of(&values[2]))));
    match &answers[1] {
        Err(StoreError::Backend { operation: "put", detail, .. }) => {
            assert!(detail.contains("nothing was stored"), "{detail}");
        }
        other => panic!("a damaged item was answered {other:?}"),
    }
    if missing_sum {
        assert!(matches!(answers[3], Err(StoreError::Backend { .. })), "{:?}", answers[3]);
        assert_eq!(store.lookup(&c, &keys[3]), Ok(Lookup::Miss(MissReason::Absent)));
    }
    assert_eq!(store.lookup(&c, &keys[1]), Ok(Lookup::Miss(MissReason::Absent)));
    for i in [0, 2] {
        let mut dst = vec![0u8; sizes[i]];
        let got = store.get_into(&c, &keys[i], &mut dst).expect("get");
        assert!(matches!(got, Get::Hit { .. }), "{got:?}");
        assert_eq!(dst, values[i], "item {i} read back different bytes");
    }
    let after = store.stats();
    assert_eq!(
        after.usage.retained_bytes - before.usage.retained_bytes,
        (sizes[0] + sizes[2]) as u64,
        "the refused item was charged"
    );
    // The key the damaged item named is still free for a sound PUT.
    let sound = [BatchPut { key: &keys[1], src: &values[1], request: None }];
    let again = store.put_batch_checked(&c, &sound, &[Checksum::of(&values[1])]);
    assert_eq!(again, vec![Ok(Put::Committed(Checksum::of(&values[1])))]);
}

const SIZES: [usize; 3] = [4096, 3 << 20, 65_537];

#[test]
fn the_memory_store_compares_before_it_commits() {
    refuses_only_the_damaged_item(&*memory(), 0, SIZES, true);
}

#[test]
fn a_layer_on_the_default_hashes_first() {
    // The call-counting layer overrides put_batch only: put_batch_checked is the default,
    // which hashes each item and hands the sound ones to that put_batch.
    let store = Counting::new(memory());
    refuses_only_the_damaged_item(&store, 0, SIZES, true);
    let batches: Vec<usize> = store
        .take_calls()
        .into_iter()
        .filter(|(c, _)| *c == Call::PutBatch)
        .map(|(_, n)| n)
        .collect();
    assert_eq!(batches, [2, 1], "the damaged and unchecked items reached the inner store");
}

#[test]
fn the_file_store_compares_before_it_commits() {
    let dir = tempfile::tempdir().expect("dir");
    let mut config = FileStoreConfig::new(dir.path());
    config.durability = Durability::None;
    config.limits = limits();
    let store = config.open(Arc::new(MonotonicClock::default())).expect("file store");
    refuses_only_the_damaged_item(&store, 0, SIZES, true);
}

#[test]
fn the_metered_layer_hands_the_checksums_on() {
    let store = MeteredStore::new(memory(), Arc::new(Metrics::new()));
    refuses_only_the_damaged_item(&store, 0, SIZES, true);
}

fn serve(dir: &tempfile::TempDir) -> Server {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), vec![caller()]);
    config.local = Some(dir.path().join("gpucache.sock"));
    Server::start(config, memory()).expect("server")
}

#[test]
fn the_service_refuses_a_damaged_item_from_a_frame() {
    let dir = tempfile::tempdir().expect("dir");
    let server = serve(&dir);
    let mut config = ClientConfig::new(server.local_addr(), caller());
    config.deadline = Duration::from_secs(10);
    let client = TcpStore::new(config);
    refuses_only_the_damaged_item(&client, 0, SIZES, true);
    // A plain PUT is hashed by the client as it is framed, and lands intact.
    let data = payload(9, 1 << 20);
    assert_eq!(client.put(&caller(), &k(9), &data, None), Ok(Put::Committed(Checksum::of(&data))));
}

#[test]
fn the_service_refuses_a_damaged_item_from_the_shared_segment() {
    let dir = tempfile::tempdir().expect("dir");
    let server = serve(&dir);
    let mut config = ClientConfig::new(server.local_addr(), caller());
    let mut local = LocalConfig::new(server.local_path().expect("socket").to_path_buf());
    local.segment_bytes = 16 << 20;
    config.local = Some(local);
    config.deadline = Duration::from_secs(10);
    let client = TcpStore::new(config);
    // Sources in the segment go by offset (no copy on the client); the store gets the
    // client's checksums with them.
    let c = caller();
    let values: Vec<Vec<u8>> =
        SIZES.iter().enumerate().map(|(i, &n)| payload(i as u64, n)).collect();
    let mut shared = Vec::new();
    for v in &values {
        let mut b = client.shared_buffer(v.len()).expect("shared buffer");
        b.copy_from_slice(v);
        shared.push(b);
    }
    let keys = [k(1), k(2), k(3)];
    let items: Vec<BatchPut<'_>> =
        keys.iter().zip(&shared).map(|(key, b)| BatchPut { key, src: b, request: None }).collect();
    let mut sums: Vec<Checksum> = values.iter().map(|v| Checksum::of(v)).collect();
    sums[1] = Checksum(sums[1].0 ^ 1);
    let answers = client.put_batch_checked(&c, &items, &sums);
    assert_eq!(client.shared_stats().direct_items, 3, "the sources did not go by offset");
    assert_eq!(answers[0], Ok(Put::Committed(Checksum::of(&values[0]))));
    assert!(matches!(answers[1], Err(StoreError::Backend { .. })), "{:?}", answers[1]);
    assert_eq!(answers[2], Ok(Put::Committed(Checksum::of(&values[2]))));
    assert_eq!(client.lookup(&c, &keys[1]), Ok(Lookup::Miss(MissReason::Absent)));
    // Ordinary buffers bounce through the segment, hashed in the pass that copies them.
    refuses_only_the_damaged_item(&client, 10, [100, 200, 300].map(|n| n + (1 << 20)), false);
}
