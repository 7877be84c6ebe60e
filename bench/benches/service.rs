//! Criterion benchmarks of the native service's client paths against an in-process server over
//! a MemoryStore:
//!
//! * `service_get/tcp`: GET over loopback TCP into an ordinary buffer (the frame's bytes are
//!   checked and copied into it).
//! * `service_get/shared`: GET on the same-host path into a caller's shared buffer (the server's
//!   store writes and verifies the segment; no copy and no hash on the client).
//! * `service_get/shared_bounce`: the same path into an ordinary buffer (one copy out of a
//!   bounce buffer).
//! * `service_put/*`: the same three paths for PUT (each into a key with no block).
//!
//! memcpy at the same sizes is the `memcpy` group of the `contract` bench.
//!
//! Run: `cargo bench -p gpucache-bench --bench service`. Results: docs/PERFORMANCE.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpucache_bench::fixtures::{
    KIB, MIB, caller, keys, payload, put, size_label, timed_puts, to_u64,
};
use gpucache_client::{ClientConfig, LocalConfig, TcpStore};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Get, Store};
use gpucache_service::{Server, ServerConfig};
use gpucache_storage::MemoryStore;

const SIZES: [usize; 3] = [64 * KIB, MIB, 4 * MIB];
/// Keys one timed batch of puts uses before it is invalidated (untimed).
const PUT_BATCH_KEYS: usize = 16;

struct Bench {
    _server: Server,
    _dir: tempfile::TempDir,
    tcp: TcpStore,
    shared: TcpStore,
}

fn start() -> Bench {
    let limits = ResourceLimits {
        object_bytes_max: 16 * to_u64(MIB),
        retained_bytes_max: 1 << 30,
        tenant_retained_bytes_max: 1 << 30,
        ..ResourceLimits::default()
    };
    let store = match MemoryStore::new(limits, Arc::new(MonotonicClock::default())) {
        Ok(s) => Arc::new(s),
        Err(e) => panic!("bench store: {e}"),
    };
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("socket dir: {e}"),
    };
    let addr = match "127.0.0.1:0".parse() {
        Ok(a) => a,
        Err(e) => panic!("addr: {e}"),
    };
    let mut config = ServerConfig::new(addr, vec![caller()]);
    config.local = Some(dir.path().join("bench.sock"));
    let server = match Server::start(config, store) {
        Ok(s) => s,
        Err(e) => panic!("server: {e}"),
    };
    let tcp = TcpStore::new(ClientConfig::new(server.local_addr(), caller()));
    let mut shared = ClientConfig::new(server.local_addr(), caller());
    let mut local = LocalConfig::new(dir.path().join("bench.sock"));
    local.segment_bytes = 64 * to_u64(MIB);
    shared.local = Some(local);
    Bench { _server: server, _dir: dir, tcp, shared: TcpStore::new(shared) }
}

fn expect_hit(got: Result<Get, gpucache_dataplane::store::StoreError>, bytes: usize) {
    match got {
        Ok(Get::Hit { len, .. }) if len == to_u64(bytes) => {}
        other => panic!("bench get missed: {other:?}"),
    }
}

fn get_benches(c: &mut Criterion) {
    let bench = start();
    let who = caller();
    let mut g = c.benchmark_group("service_get");
    for (i, bytes) in SIZES.into_iter().enumerate() {
        let key = &keys(10_000 + to_u64(i) * 1000, 1)[0];
        put(&bench.tcp, &who, key, &payload(bytes));
        g.throughput(Throughput::Bytes(to_u64(bytes)));
        let mut plain = vec![0u8; bytes];
        g.bench_function(BenchmarkId::new("tcp", size_label(bytes)), |b| {
            b.iter(|| expect_hit(bench.tcp.get_into(&who, key, black_box(&mut plain)), bytes))
        });
        let Some(mut shared) = bench.shared.shared_buffer(bytes) else {
            panic!("no room for a shared buffer")
        };
        g.bench_function(BenchmarkId::new("shared", size_label(bytes)), |b| {
            b.iter(|| expect_hit(bench.shared.get_into(&who, key, black_box(&mut shared)), bytes))
        });
        g.bench_function(BenchmarkId::new("shared_bounce", size_label(bytes)), |b| {
            b.iter(|| expect_hit(bench.shared.get_into(&who, key, black_box(&mut plain)), bytes))
        });
    }
    g.finish();
}

fn put_benches(c: &mut Criterion) {
    let bench = start();
    let who = caller();
    let mut g = c.benchmark_group("service_put");
    for (i, bytes) in SIZES.into_iter().enumerate() {
        let pool = keys(50_000 + to_u64(i) * 1000, PUT_BATCH_KEYS);
        let src = payload(bytes);
        g.throughput(Throughput::Bytes(to_u64(bytes)));
        g.bench_function(BenchmarkId::new("tcp", size_label(bytes)), |b| {
            b.iter_custom(|iters| timed_puts(&bench.tcp, &who, &pool, &src, iters))
        });
        let Some(mut shared) = bench.shared.shared_buffer(bytes) else {
            panic!("no room for a shared buffer")
        };
        shared.copy_from_slice(&src);
        g.bench_function(BenchmarkId::new("shared", size_label(bytes)), |b| {
            b.iter_custom(|iters| timed_puts(&bench.shared, &who, &pool, &shared, iters))
        });
        g.bench_function(BenchmarkId::new("shared_bounce", size_label(bytes)), |b| {
            b.iter_custom(|iters| timed_puts(&bench.shared, &who, &pool, &src, iters))
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = get_benches, put_benches
}
criterion_main!(benches);
