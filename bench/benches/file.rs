//! Criterion benchmarks of the FileStore on its two engines (io_uring and psync).
//!
//! * `file_store/put/<engine>`: `Store::put` of a key that holds no block, buffered I/O,
//!   `Durability::None`: create a temporary file, write header and payload, rename it into
//!   `blocks/`. Keys come in batches of at most 64 MiB (and 256 keys); each batch's blocks are
//!   invalidated (their files unlinked) after the timed part.
//! * `file_store/get_into/<engine>`: `Store::get_into` into one reused buffer, cycling over up
//!   to 64 MiB of committed blocks (so not one hot file), open + read + checksum of what was read.
//!
//! Both at 64 KiB, 256 KiB, 1 MiB and 4 MiB, reported in bytes per second. The stores live in a
//! temporary directory on the system temp file system; the page cache is kept, so these are the
//! store's costs over page-cache I/O, not device figures (`gpucache-bench file` sets them beside
//! fio). Run: `cargo bench -p gpucache-bench --bench file`. Results: docs/PERFORMANCE.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpucache_bench::fixtures::{
    KIB, MIB, caller, keys, payload, put, size_label, timed_puts, to_u64,
};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::store::{Get, Invalidate, Store};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStore, FileStoreConfig};

const PAYLOAD_SIZES: [usize; 4] = [64 * KIB, 256 * KIB, MIB, 4 * MIB];
/// Payload bytes one batch of puts, or the set of blocks a get cycles over, may hold.
const SET_BYTES: usize = 64 * MIB;
/// Most keys in one batch or get set.
const SET_KEYS: usize = 256;

/// A buffered store with no flushes, on `engine`, under `dir`.
fn open(dir: &std::path::Path, engine: EngineChoice) -> FileStore {
    let mut config = FileStoreConfig::new(dir);
    config.engine = engine;
    config.durability = Durability::None;
    config.direct_io = false;
    match config.open(Arc::new(MonotonicClock::default())) {
        Ok(s) => s,
        Err(e) => panic!("the bench store does not open: {e}"),
    }
}

fn file_store_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("file_store");
    let caller = caller();
    for (engine, name) in [(EngineChoice::Uring, "uring"), (EngineChoice::Psync, "psync")] {
        let dir = match tempfile::Builder::new().prefix("gpucache-bench-file-").tempdir() {
            Ok(d) => d,
            Err(e) => panic!("no temporary directory: {e}"),
        };
        let store = open(dir.path(), engine);
        assert_eq!(store.engine_name(), name, "the store runs on the engine asked for");
        for (size_index, bytes) in PAYLOAD_SIZES.into_iter().enumerate() {
            let label = size_label(bytes);
            let src = payload(bytes);
            g.throughput(Throughput::Bytes(to_u64(bytes)));
            let set_len = (SET_BYTES / bytes).clamp(1, SET_KEYS);
            let seed_base = to_u64(size_index + 1) << 40;

            let pool = keys(seed_base, set_len);
            g.bench_function(BenchmarkId::new(format!("put/{name}"), &label), |b| {
                b.iter_custom(|iters| timed_puts(&store, &caller, &pool, &src, iters))
            });

            let committed = keys(seed_base | (1 << 39), set_len);
            for key in &committed {
                put(&store, &caller, key, &src);
            }
            let mut dst = vec![0u8; bytes];
            let mut next = 0;
            g.bench_function(BenchmarkId::new(format!("get_into/{name}"), &label), |b| {
                b.iter(|| {
                    let key = &committed[next % committed.len()];
                    next += 1;
                    match store.get_into(&caller, black_box(key), black_box(&mut dst)) {
                        Ok(Get::Hit { len, .. }) => len,
                        other => panic!("get_into missed: {other:?}"),
                    }
                })
            });
            assert!(dst == src, "get_into delivered other bytes than were put");
            for key in &committed {
                match store.invalidate(&caller, key) {
                    Ok(Invalidate::Removed) => {}
                    other => panic!("invalidating a get block failed: {other:?}"),
                }
            }
        }
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = file_store_benches
}
criterion_main!(benches);
