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
//! store's costs over page-cache I/O, not device figures (`gpucache bench file` sets them beside
//! fio). Run: `cargo bench -p gpucache-bench --bench file`. Results: docs/PERFORMANCE.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpucache_backends::file::engine::EngineChoice;
use gpucache_backends::file::{Durability, FileStore, FileStoreConfig};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::{
    CacheIdentity, Digest32, KvDtype, PositionEncoding, QuantFormat, RopeParams, RopeScaling,
    Shard, TenantId,
};
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::store::{Get, Invalidate, Put, Store};

const TENANT: &str = "tenant-0042";
const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PAYLOAD_SIZES: [usize; 4] = [64 * KIB, 256 * KIB, MIB, 4 * MIB];
/// Payload bytes one batch of puts, or the set of blocks a get cycles over, may hold.
const SET_BYTES: usize = 64 * MIB;
/// Most keys in one batch or get set.
const SET_KEYS: usize = 256;

/// A digest derived from `seed` (a splitmix-style walk).
fn digest(seed: u64) -> Digest32 {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(0x2545_f491_4f6c_dd1d);
    let mut out = [0u8; 32];
    for chunk in out.chunks_exact_mut(8) {
        state ^= state >> 31;
        state = state.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        state ^= state >> 29;
        chunk.copy_from_slice(&state.to_le_bytes());
    }
    Digest32(out)
}

/// A production-looking key with a 16-link chain starting at `seed`.
fn key(seed: u64) -> PhysicalKey {
    let rope = match RopeParams::new(500_000.0, RopeScaling::Llama3, 8.0, 8192) {
        Ok(r) => r,
        Err(e) => panic!("bench RoPE parameters are invalid: {e}"),
    };
    let built = CacheIdentity::builder()
        .tenant(TENANT)
        .trust_domain("prod-us-east-1")
        .model_revision("meta-llama/Llama-3.1-70B-Instruct@945c8663")
        .model_config(digest(1))
        .tokenizer_revision("meta-llama/Llama-3.1-70B-Instruct@945c8663:tokenizer")
        .kv_dtype(KvDtype::Bf16)
        .quant(QuantFormat::None)
        .layout("paged-nhd", 2)
        .shard(Shard { tp_rank: 3, tp_size: 8, pp_rank: 0, pp_size: 1 })
        .position(PositionEncoding::Rope)
        .rope(Some(rope))
        .chain((0..16).map(|i| digest(seed.wrapping_add(i))).collect())
        .block_tokens(16)
        .valid_tokens(16)
        .build();
    match built {
        Ok(id) => PhysicalKey::new(id),
        Err(e) => panic!("bench identity is invalid: {e}"),
    }
}

fn keys(first_seed: u64, n: usize) -> Vec<PhysicalKey> {
    (0..to_u64(n)).map(|i| key(first_seed + i * 16)).collect()
}

fn size_label(bytes: usize) -> String {
    if bytes >= MIB { format!("{}MiB", bytes / MIB) } else { format!("{}KiB", bytes / KIB) }
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// A payload with every byte set (no zero pages).
fn payload(bytes: usize) -> Vec<u8> {
    let mut state = 0x1234_5678_u32;
    (0..bytes)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state.to_le_bytes()[3]
        })
        .collect()
}

fn caller() -> Caller {
    match TenantId::parse(TENANT) {
        Ok(t) => Caller::new(t, Rights::READ_WRITE),
        Err(e) => panic!("bench tenant is invalid: {e}"),
    }
}

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

fn put(store: &FileStore, caller: &Caller, key: &PhysicalKey, src: &[u8]) {
    match store.put(caller, key, black_box(src), None) {
        Ok(Put::Committed(sum)) => {
            black_box(sum);
        }
        other => panic!("put was not committed: {other:?}"),
    }
}

/// Times `iters` puts of `src`, each into a key with no block; each batch of `pool` is
/// invalidated after its timed part.
fn timed_puts(
    store: &FileStore,
    caller: &Caller,
    pool: &[PhysicalKey],
    src: &[u8],
    iters: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(pool.len());
        let batch = &pool[..n];
        let start = Instant::now();
        for key in batch {
            put(store, caller, key, src);
        }
        total += start.elapsed();
        for key in batch {
            match store.invalidate(caller, key) {
                Ok(Invalidate::Removed) => {}
                other => panic!("invalidate did not remove the block: {other:?}"),
            }
        }
        left -= to_u64(n);
    }
    total
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
