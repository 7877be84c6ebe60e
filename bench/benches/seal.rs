//! Criterion benchmarks of the GPCW seal (ADR 0012), per algorithm and body size.
//!
//! * `seal/seal/<algorithm>`: the MAC of a frame, as a sender computes it: the 60 sealed header
//!   bytes and the body, under a session key whose keyed state is built once.
//! * `seal/verify/<algorithm>`: [`Frame::verify_seal`] on a decoded frame, as a receiver does it
//!   (this includes rebuilding the header, so one XXH3 pass over the body).
//!
//! At 64 KiB and 1 MiB, reported in bytes per second of body. One thread. Run:
//! `cargo bench -p gpucache-bench --bench seal`. Results: docs/PERFORMANCE.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpucache_bench::fixtures::{KIB, MIB, payload, size_label, to_u64};
use gpucache_wire::{Frame, FrameDecoder, FrameHeader, Kind, Op, SealAlgorithm, SealKey};

const BODY_SIZES: [usize; 2] = [64 * KIB, MIB];

fn sealed_frame(key: &SealKey, body: &[u8]) -> Frame {
    let mut header = FrameHeader::new(Kind::Request, Op::Put, 7, body);
    header.seal_with(key, body);
    let mut bytes = header.to_bytes().to_vec();
    bytes.extend_from_slice(body);
    let mut input = bytes.as_slice();
    match FrameDecoder::new().feed(&mut input) {
        Ok(Some(frame)) => frame,
        other => panic!("a sealed frame decodes: {other:?}"),
    }
}

fn bench_seal(c: &mut Criterion) {
    let mut group = c.benchmark_group("seal");
    for size in BODY_SIZES {
        let body = payload(size);
        group.throughput(Throughput::Bytes(to_u64(size)));
        for algorithm in SealAlgorithm::ALL {
            let key = SealKey::new(algorithm, &[0x5a; 32]);
            let header = FrameHeader::new(Kind::Request, Op::Put, 7, &body).seal_input();
            let label = format!("{}/{}", algorithm.name(), size_label(size));
            group.bench_function(BenchmarkId::new("seal", &label), |b| {
                b.iter(|| black_box(key.mac(&[&header, black_box(&body)])));
            });
            let frame = sealed_frame(&key, &body);
            group.bench_function(BenchmarkId::new("verify", &label), |b| {
                b.iter(|| black_box(black_box(&frame).verify_seal(&key)));
            });
        }
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_seal
}
criterion_main!(benches);
