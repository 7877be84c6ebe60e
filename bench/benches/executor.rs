//! Criterion benchmark of the executor core's own overhead on the QUERY path.
//!
//! * `executor_query_spin{0,50}us`: one QUERY job of 1, 16 or 256 keys submitted to an
//!   executor over a MemoryStore whose keys are all committed, then `poll` (spinning, as an
//!   engine loop that polls every round would, never sleeping) until its result arrives. One
//!   QUERY worker, so the submitting thread and the worker fit on two cores. Reported per key
//!   (criterion's element throughput); the cloned key vector is built outside the timing. The
//!   suffix is `worker_spin_us`: 0 puts an idle worker to sleep at once, 50 spins first.
//! * `memory_lookup`: the same keys looked up directly on the store, for the floor the
//!   executor adds to.
//!
//! Run: `cargo bench -p gpucache-bench --bench executor`.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpucache_bench::fixtures::{caller, keys, put, to_u64};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::store::{Lookup, Store};
use gpucache_executor::{Executor, ExecutorConfig, HostBuffer, KeyResult, Poll};
use gpucache_storage::MemoryStore;

const BATCHES: [usize; 3] = [1, 16, 256];
/// Idle-worker spin settings measured: sleeping at once, and spinning 50 us first.
const SPIN_US: [u32; 2] = [0, 50];
/// Longest one job may take before the bench gives up on it.
const RESULT_WAIT: Duration = Duration::from_secs(10);

fn nz(v: usize) -> NonZeroUsize {
    NonZeroUsize::new(v).unwrap_or(NonZeroUsize::MIN)
}

/// Polls the way an engine round does, without sleeping, until a result is there.
fn poll_until_result(exec: &Executor) -> Poll {
    let deadline = Instant::now() + RESULT_WAIT;
    loop {
        let poll = exec.poll();
        if !poll.results.is_empty() || Instant::now() > deadline {
            return poll;
        }
        std::hint::spin_loop();
    }
}

fn bench_executor(c: &mut Criterion, spin_us: u32, store: &Arc<MemoryStore>, all: &[PhysicalKey]) {
    let host = match HostBuffer::new(nz(1), nz(64)) {
        Ok(h) => Arc::new(h),
        Err(e) => panic!("bench host buffer: {e}"),
    };
    let config = ExecutorConfig {
        workers_query: nz(1),
        worker_spin_us: spin_us,
        ..ExecutorConfig::default()
    };
    let exec = match Executor::start(
        config,
        Arc::clone(store) as Arc<dyn Store>,
        caller(),
        host,
        Arc::new(MonotonicClock::default()),
    ) {
        Ok(e) => e,
        Err(e) => panic!("executor does not start: {e}"),
    };
    let mut g = c.benchmark_group(format!("executor_query_spin{spin_us}us"));
    for n in BATCHES {
        let batch = &all[..n];
        g.throughput(Throughput::Elements(to_u64(n)));
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_batched(
                || batch.to_vec(),
                |job| {
                    let op = match exec.submit_query(job) {
                        Ok(op) => op,
                        Err(e) => panic!("query refused: {e}"),
                    };
                    let poll = poll_until_result(&exec);
                    match poll.results.first() {
                        Some(r) if r.operation == op => {
                            assert!(matches!(r.keys.first(), Some(KeyResult::Found { .. })));
                        }
                        other => panic!("no result for {op}: {other:?}"),
                    }
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
    let report = exec.close(RESULT_WAIT);
    assert!(!report.restart_required, "{report}");
}

fn query_benches(c: &mut Criterion) {
    let store =
        match MemoryStore::new(ResourceLimits::default(), Arc::new(MonotonicClock::default())) {
            Ok(s) => Arc::new(s),
            Err(e) => panic!("bench limits are invalid: {e}"),
        };
    let all = keys(1, BATCHES[BATCHES.len() - 1]);
    for key in &all {
        put(store.as_ref(), &caller(), key, &[7_u8; 64]);
    }
    for spin_us in SPIN_US {
        bench_executor(c, spin_us, &store, &all);
    }

    let mut g = c.benchmark_group("memory_lookup");
    let who = caller();
    for n in BATCHES {
        let batch = &all[..n];
        g.throughput(Throughput::Elements(to_u64(n)));
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                for key in batch {
                    match store.lookup(&who, key) {
                        Ok(Lookup::Hit { .. }) => {}
                        other => panic!("lookup missed: {other:?}"),
                    }
                }
            })
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
    targets = query_benches
}
criterion_main!(benches);
