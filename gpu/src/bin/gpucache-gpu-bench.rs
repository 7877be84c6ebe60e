//! H2D and D2H copy bandwidth and per-block latency on one GPU, pinned against pageable host
//! memory, for block sizes 64 KiB to 64 MiB.
//!
//! `gpucache-gpu-bench [--device N] [--bytes-per-point BYTES] [--latency-samples N]`
//!
//! Bandwidth: `bytes-per-point` bytes (at least 8 copies) queued back to back on one
//! non-blocking stream, timed from the first submission to the stream's drain. Latency: one
//! block copied and drained at a time, `latency-samples` times; p50 and p99 reported.
//! Exits 2 with the reason when there is no usable GPU.

#![allow(clippy::print_stdout)] // a command-line report

use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::time::Instant;

use cudarc::driver::{result, sys};
use gpucache_dataplane::registry::{LocalEpochs, RegisteredPool};
use gpucache_gpu::{Direction, GpuDevice, GpuError, GpuSlots, PinnedStaging, probe};

/// Block sizes measured: 64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB.
const BLOCK_BYTES: [usize; 6] = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20];
const BYTES_PER_POINT_DEFAULT: usize = 2 << 30;
const LATENCY_SAMPLES_DEFAULT: usize = 50;
const COPIES_MIN: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Args {
    device: u32,
    bytes_per_point: usize,
    latency_samples: usize,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        device: 0,
        bytes_per_point: BYTES_PER_POINT_DEFAULT,
        latency_samples: LATENCY_SAMPLES_DEFAULT,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: std::num::ParseIntError| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--device" => args.device = value.parse().map_err(bad)?,
            "--bytes-per-point" => args.bytes_per_point = value.parse().map_err(bad)?,
            "--latency-samples" => args.latency_samples = value.parse().map_err(bad)?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if args.latency_samples == 0 {
        return Err("--latency-samples must be at least 1".into());
    }
    Ok(args)
}

struct Stream(sys::CUstream);

impl Stream {
    fn new() -> Result<Self, GpuError> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map(Self)
            .map_err(|e| GpuError::Driver { call: "cuStreamCreate", code: e.into() })
    }
    fn sync(&self) -> Result<(), GpuError> {
        // SAFETY: a live stream created in `new`.
        unsafe { result::stream::synchronize(self.0) }
            .map_err(|e| GpuError::Driver { call: "cuStreamSynchronize", code: e.into() })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

/// Queues one copy of `len` bytes between `host` and `dev`.
fn copy(
    dir: Direction,
    host: *mut u8,
    dev: u64,
    len: usize,
    stream: &Stream,
) -> Result<(), GpuError> {
    // SAFETY: `host` and `dev` each address at least `len` bytes that outlive the stream's next
    // drain, which every caller waits for before touching or freeing them.
    let r = unsafe {
        match dir {
            Direction::HostToDevice => {
                sys::cuMemcpyHtoDAsync_v2(dev, host.cast_const().cast(), len, stream.0)
            }
            Direction::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, len, stream.0),
        }
    };
    r.result().map_err(|e| GpuError::Driver { call: "cuMemcpyAsync", code: e.into() })
}

struct Point {
    gib_s: f64,
    p50_us: f64,
    p99_us: f64,
}

fn measure(
    dir: Direction,
    host: *mut u8,
    dev: u64,
    len: usize,
    args: Args,
    stream: &Stream,
) -> Result<Point, GpuError> {
    // Warm-up: first-touch and driver staging setup stay out of the numbers.
    copy(dir, host, dev, len, stream)?;
    stream.sync()?;
    let copies = (args.bytes_per_point / len).max(COPIES_MIN);
    let start = Instant::now();
    for _ in 0..copies {
        copy(dir, host, dev, len, stream)?;
    }
    stream.sync()?;
    let seconds = start.elapsed().as_secs_f64();
    let gib_s = (copies * len) as f64 / seconds / f64::from(1_u32 << 30);
    let mut samples: Vec<f64> = Vec::with_capacity(args.latency_samples);
    for _ in 0..args.latency_samples {
        let t = Instant::now();
        copy(dir, host, dev, len, stream)?;
        stream.sync()?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    // Nearest rank: index (len - 1) * percent / 100, in integers.
    let at = |percent: usize| samples[(samples.len() - 1) * percent / 100];
    Ok(Point { gib_s, p50_us: at(50), p99_us: at(99) })
}

fn run(args: Args) -> Result<(), GpuError> {
    let info = gpucache_gpu::probe::describe(args.device)?;
    println!(
        "device {}: {} ({} GiB, compute capability {}.{})",
        info.ordinal,
        info.name,
        info.memory_bytes >> 30,
        info.compute_capability.0,
        info.compute_capability.1
    );
    let max = BLOCK_BYTES[BLOCK_BYTES.len() - 1];
    let one = NonZeroUsize::MIN;
    let max_nz = NonZeroUsize::new(max).unwrap_or(NonZeroUsize::MIN);
    let device = GpuDevice::open(args.device)?;
    let slots = GpuSlots::new(device.clone(), one, max_nz)?;
    let dev = slots.base_ptr();
    let mut pinned =
        RegisteredPool::new(PinnedStaging::new(device, one, max_nz)?, Box::new(LocalEpochs));
    let owner = gpucache_dataplane::identity::TenantId::parse("bench")
        .map_err(|_| GpuError::Limit { what: "tenant", requested: 0, max: 0 })?;
    let lease = pinned.checkout(&owner, 1, None)?;
    let pinned_ptr = pinned
        .slot_bytes_mut(&lease[0])
        .map(|b| b.as_mut_ptr())
        .ok_or(GpuError::NotLent { region: lease[0].region })?;
    let mut pageable = vec![0x5a_u8; max];
    let stream = Stream::new()?;
    println!(
        "{:>9} {:>8} {:>4} {:>9} {:>10} {:>10}",
        "block", "host", "dir", "GiB/s", "p50 us", "p99 us"
    );
    for len in BLOCK_BYTES {
        for (mode, host) in [("pinned", pinned_ptr), ("pageable", pageable.as_mut_ptr())] {
            for dir in [Direction::HostToDevice, Direction::DeviceToHost] {
                let p = measure(dir, host, dev, len, args, &stream)?;
                println!(
                    "{:>8}K {:>8} {:>4} {:>9.2} {:>10.1} {:>10.1}",
                    len >> 10,
                    mode,
                    match dir {
                        Direction::HostToDevice => "H2D",
                        Direction::DeviceToHost => "D2H",
                    },
                    p.gib_s,
                    p.p50_us,
                    p.p99_us
                );
            }
        }
    }
    stream.sync()?;
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpucache-gpu-bench: {e}");
            return ExitCode::from(64);
        }
    };
    if let Err(why) = probe() {
        eprintln!("gpucache-gpu-bench: no usable GPU: {why}");
        return ExitCode::from(2);
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpucache-gpu-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
