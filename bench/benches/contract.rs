//! Criterion benchmarks of the data-plane contract and the in-memory reference store.
//!
//! * `key`: building a physical key (canonical encoding plus its BLAKE3 digest), strictly
//!   decoding one, and deriving the logical key, for token-prefix chains of 1, 16 and 256 links.
//! * `identity_digest`: `KeyDigest::of` over a physical encoding, and the shape digest.
//! * `memory_store`: `Store::put` (reserve, write, commit) and `Store::get_into` into a
//!   preallocated buffer, from 4 KiB to 4 MiB, reported as bytes per second.
//! * `memcpy`: `copy_from_slice` at the same sizes: the physical limit the store is read against.
//!
//! Run: `cargo bench -p gpucache-bench --bench contract`.
//! Results and how to read them: docs/PERFORMANCE.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpucache_bench::fixtures::{
    KIB, MIB, caller, identity, payload, size_label, timed_puts, to_u64,
};
use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::key::{KeyDigest, LogicalKey, PhysicalKey};
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Get, Invalidate, Put, Store};
use gpucache_storage::MemoryStore;

const CHAIN_LENGTHS: [usize; 3] = [1, 16, 256];
const PAYLOAD_SIZES: [usize; 5] = [4 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB];
/// Payload bytes one timed batch of puts may hold before it is invalidated (untimed).
const PUT_BATCH_BYTES: usize = 64 * MIB;
/// Most keys in one timed batch of puts.
const PUT_BATCH_KEYS: usize = 256;

fn key_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    for links in CHAIN_LENGTHS {
        let id = identity(links, 1000);
        let encoded = PhysicalKey::new(id.clone()).encoded().to_vec();
        g.bench_function(BenchmarkId::new("physical_new", links), |b| {
            // The clone (reference-count bumps) stays outside the timing.
            b.iter_batched(|| id.clone(), PhysicalKey::new, BatchSize::SmallInput)
        });
        g.bench_function(BenchmarkId::new("physical_decode", links), |b| {
            b.iter(|| match PhysicalKey::decode(black_box(&encoded)) {
                Ok(k) => k,
                Err(e) => panic!("bench key does not decode: {e}"),
            })
        });
        g.bench_function(BenchmarkId::new("logical_from_identity", links), |b| {
            b.iter(|| LogicalKey::from_identity(black_box(&id)))
        });
    }
    g.finish();
}

fn digest_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("identity_digest");
    for links in CHAIN_LENGTHS {
        let key = PhysicalKey::new(identity(links, 1000));
        let encoded = key.encoded().to_vec();
        g.bench_function(BenchmarkId::new("key_digest_of", links), |b| {
            b.iter(|| KeyDigest::of(black_box(&encoded)))
        });
        // A key caches its shape digest after the first call, so each iteration gets a key
        // that has not computed it yet (made outside the timed part).
        g.bench_function(BenchmarkId::new("shape_digest", links), |b| {
            b.iter_batched(
                || PhysicalKey::new(key.identity().clone()),
                |fresh| fresh.shape_digest(),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

fn store_and_caller() -> (MemoryStore, Caller) {
    match MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default())) {
        Ok(s) => (s, caller()),
        Err(e) => panic!("default limits are refused: {e}"),
    }
}

fn memory_store_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("memory_store");
    let (store, caller) = store_and_caller();
    for (size_index, bytes) in PAYLOAD_SIZES.into_iter().enumerate() {
        let label = size_label(bytes);
        let src = payload(bytes);
        g.throughput(Throughput::Bytes(to_u64(bytes)));

        let pool_len = (PUT_BATCH_BYTES / bytes).clamp(1, PUT_BATCH_KEYS);
        let seed_base = to_u64(size_index + 1) << 32;
        let pool: Vec<PhysicalKey> = (0..pool_len)
            .map(|i| PhysicalKey::new(identity(16, seed_base + to_u64(i) * 16)))
            .collect();
        g.bench_function(BenchmarkId::new("put", &label), |b| {
            b.iter_custom(|iters| timed_puts(&store, &caller, &pool, &src, iters))
        });

        let key = PhysicalKey::new(identity(16, seed_base | 0xffff_0000));
        match store.put(&caller, &key, &src, None) {
            Ok(Put::Committed(_)) => {}
            other => panic!("seeding the get block failed: {other:?}"),
        }
        let mut dst = vec![0u8; bytes];
        match store.get_into(&caller, &key, &mut dst) {
            Ok(Get::Hit { len, .. }) if len == to_u64(bytes) => {}
            other => panic!("checking the get block failed: {other:?}"),
        }
        assert!(dst == src, "get_into delivered other bytes than were put");
        g.bench_function(BenchmarkId::new("get_into", &label), |b| {
            b.iter(|| match store.get_into(&caller, black_box(&key), black_box(&mut dst)) {
                Ok(Get::Hit { len, .. }) => len,
                other => panic!("get_into missed: {other:?}"),
            })
        });
        match store.invalidate(&caller, &key) {
            Ok(Invalidate::Removed) => {}
            other => panic!("invalidating the get block failed: {other:?}"),
        }
    }
    g.finish();
}

fn memcpy_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("memcpy");
    for bytes in PAYLOAD_SIZES {
        let src = payload(bytes);
        let mut dst = vec![0u8; bytes];
        g.throughput(Throughput::Bytes(to_u64(bytes)));
        g.bench_function(BenchmarkId::new("copy_from_slice", size_label(bytes)), |b| {
            b.iter(|| black_box(&mut dst[..]).copy_from_slice(black_box(&src[..])))
        });
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
    targets = key_benches, digest_benches, memory_store_benches, memcpy_benches
}
criterion_main!(benches);
