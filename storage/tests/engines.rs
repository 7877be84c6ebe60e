//! The file I/O engines (psync, io_uring) against real files, and the seeded faulty-disk layer.
//!
//! io_uring works on the machines this project tests on, so the uring tests fail when it is
//! unavailable; `GPUCACHE_REQUIRE_URING=0` turns that into a skip.

use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use gpucache_dataplane::rng::SplitMix64;
use gpucache_storage::file::engine::faulty::{FaultConfig, FaultyEngine};
use gpucache_storage::file::engine::psync::PsyncEngine;
use gpucache_storage::file::engine::uring::{SLOT_BYTES, UringEngine};
use gpucache_storage::file::engine::{BatchRead, DIRECT_ALIGN, EngineConfig, IoEngine, Staging};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Helpers

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "gpucache-engines-{tag}-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .expect("open file")
}

/// Opens with O_DIRECT, or `None` (with a note) where the file system refuses it.
fn open_direct(path: &Path) -> Option<File> {
    match OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Some(f),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!("skipping O_DIRECT check: {} does not support O_DIRECT", path.display());
            None
        }
        Err(e) => panic!("open O_DIRECT {}: {e}", path.display()),
    }
}

/// Deterministic bytes, different per seed.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    SplitMix64::bytes(seed, len)
}

fn small_config() -> EngineConfig {
    EngineConfig { queue_depth: 8, chunk_bytes: 256 << 10, staging_bytes: 2 * SLOT_BYTES }
}

fn require_uring() -> bool {
    std::env::var("GPUCACHE_REQUIRE_URING").as_deref() != Ok("0")
}

/// A uring engine, or `None` when io_uring is unavailable and `GPUCACHE_REQUIRE_URING=0`.
fn uring_with(config: EngineConfig, rings: usize) -> Option<UringEngine> {
    match UringEngine::with_limits(config, rings, Duration::from_secs(5)) {
        Ok(e) => Some(e),
        Err(e) if !require_uring() => {
            eprintln!("skipping io_uring test (GPUCACHE_REQUIRE_URING=0): {e}");
            None
        }
        Err(e) => panic!(
            "io_uring unavailable ({e}); it works on this project's machines. Set GPUCACHE_REQUIRE_URING=0 to skip"
        ),
    }
}

fn uring() -> Option<UringEngine> {
    uring_with(small_config(), 8)
}

/// One uring engine shared by property cases (ring setup and arena registration cost time).
fn shared_uring() -> Option<&'static UringEngine> {
    static ENGINE: OnceLock<Option<UringEngine>> = OnceLock::new();
    ENGINE.get_or_init(uring).as_ref()
}

/// Every engine under test: psync always, uring where available.
fn engines() -> Vec<Box<dyn IoEngine>> {
    let mut all: Vec<Box<dyn IoEngine>> = vec![Box::new(PsyncEngine)];
    if let Some(u) = uring() {
        all.push(Box::new(u));
    }
    all
}

// ---------------------------------------------------------------------------------------------
// Both engines

#[test]
fn uring_probe_succeeds_here() {
    if require_uring() {
        let e = UringEngine::new(EngineConfig::default()).expect("io_uring probe");
        assert_eq!(e.name(), "uring");
        assert_eq!(e.rings_open(), 1, "rings open lazily; the probe ring is the first");
        // 64 MiB of staging is 7 whole slots.
        assert_eq!(e.staging_slots(), (7, 7));
    }
}

#[test]
fn round_trips_at_odd_sizes_and_offsets() {
    let dir = TempDir::new("roundtrip");
    let cases: [(usize, u64); 4] =
        [(1, 7), (4096, 4096 * 3 + 1), ((1 << 20) + 3, 12_345), (5 << 20, (1 << 20) + 17)];
    for engine in engines() {
        let path = dir.path(engine.name());
        let file = open_rw(&path);
        for (i, &(len, offset)) in cases.iter().enumerate() {
            let data = pattern(len, u64::try_from(i).unwrap() + 1);
            engine.write_all_at(&file, offset, &data).unwrap();
            let mut back = vec![0u8; len];
            engine.read_exact_at(&file, offset, &mut back).unwrap();
            assert!(back == data, "{}: {len} bytes at {offset} did not round-trip", engine.name());
            // And the bytes really are in the file.
            let mut direct = vec![0u8; len];
            file.read_exact_at(&mut direct, offset).unwrap();
            assert!(direct == data, "{}: file content differs", engine.name());
        }
        engine.sync(&file).unwrap();
        engine.write_all_at(&file, 3, &[]).unwrap();
        engine.read_exact_at(&file, 1 << 40, &mut []).unwrap();
    }
}

#[test]
fn uring_batches_many_chunks_with_shallow_queue() {
    let dir = TempDir::new("batches");
    // 5 MiB + 5 in 64 KiB chunks, at most 3 in flight: 81 chunks over 27+ batches.
    let config = EngineConfig { queue_depth: 3, chunk_bytes: 64 << 10, staging_bytes: 0 };
    let Some(engine) = uring_with(config, 1) else { return };
    assert_eq!(engine.staging_slots(), (0, 0));
    assert!(matches!(engine.staging(4096).unwrap(), Staging::Owned(_)));
    let file = open_rw(&dir.path("f"));
    let data = pattern((5 << 20) + 5, 9);
    engine.write_all_at(&file, 999, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    engine.read_exact_at(&file, 999, &mut back).unwrap();
    assert!(back == data);
}

#[test]
fn o_direct_round_trip_with_staging_buffers() {
    let dir = TempDir::new("direct");
    for engine in engines() {
        let Some(file) = open_direct(&dir.path(engine.name())) else { return };
        let is_uring = engine.name() == "uring";

        // A 4 MiB block plus a header: a registered slot on uring.
        let len = (4 << 20) + DIRECT_ALIGN;
        let mut out = engine.staging(len).unwrap();
        assert!(out.len() >= len && out.as_ptr().addr().is_multiple_of(DIRECT_ALIGN));
        assert_eq!(matches!(out, Staging::Registered(_)), is_uring, "{}: {out:?}", engine.name());
        out[..len].copy_from_slice(&pattern(len, 21));
        engine.write_all_at(&file, 8192, &out[..len]).unwrap();
        let mut back = engine.staging(len).unwrap();
        assert_eq!(matches!(back, Staging::Registered(_)), is_uring);
        engine.read_exact_at(&file, 8192, &mut back[..len]).unwrap();
        assert!(back[..len] == out[..len], "{}: registered round trip", engine.name());

        // Larger than a slot: an owned buffer on uring, a pooled one on psync.
        let big = SLOT_BYTES + DIRECT_ALIGN;
        let mut owned = engine.staging(big).unwrap();
        let want_kind = if is_uring {
            matches!(owned, Staging::Owned(_))
        } else {
            matches!(owned, Staging::Pooled(_))
        };
        assert!(want_kind, "{}: {owned:?}", engine.name());
        owned[..big].copy_from_slice(&pattern(big, 22));
        let at = u64::try_from(16 * DIRECT_ALIGN).unwrap() + u64::try_from(len).unwrap();
        engine.write_all_at(&file, at, &owned[..big]).unwrap();
        let mut owned_back = engine.staging(big).unwrap();
        engine.read_exact_at(&file, at, &mut owned_back[..big]).unwrap();
        assert!(owned_back[..big] == owned[..big], "{}: owned round trip", engine.name());

        // Mixed: read what the owned buffer wrote into a registered slot.
        drop(back);
        let mut slot = engine.staging(len).unwrap();
        engine.read_exact_at(&file, at, &mut slot[..len]).unwrap();
        assert!(slot[..len] == owned[..len]);
        engine.sync(&file).unwrap();
    }
}

#[test]
fn registered_slots_are_zeroed_reused_and_exhaust_to_owned() {
    let Some(engine) = uring() else { return };
    assert_eq!(engine.staging_slots(), (2, 2));
    let mut a = engine.staging(100).unwrap();
    assert_eq!(a.len(), DIRECT_ALIGN);
    a.fill(0xee);
    let b = engine.staging(SLOT_BYTES).unwrap();
    let c = engine.staging(1).unwrap();
    assert!(matches!(c, Staging::Owned(_)), "no slot left: fallback");
    assert!(matches!(b, Staging::Registered(_)));
    drop(a);
    let again = engine.staging(8192).unwrap();
    assert!(matches!(again, Staging::Registered(_)));
    assert!(again.iter().all(|x| *x == 0), "a reused slot comes back zeroed");
}

#[test]
fn reading_past_end_of_file_is_unexpected_eof() {
    let dir = TempDir::new("eof");
    for engine in engines() {
        let file = open_rw(&dir.path(engine.name()));
        engine.write_all_at(&file, 0, &pattern(100, 3)).unwrap();
        let mut buf = vec![0u8; 200];
        let err = engine.read_exact_at(&file, 0, &mut buf).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedEof, "{}: {err}", engine.name());
        let err = engine.read_exact_at(&file, 4096, &mut buf[..10]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedEof, "{}: {err}", engine.name());
        // A multi-chunk read that runs out part way: still EOF, and the engine still works.
        engine.write_all_at(&file, 0, &pattern(1 << 20, 4)).unwrap();
        let mut big = vec![0u8; 3 << 20];
        let err = engine.read_exact_at(&file, 0, &mut big).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedEof, "{}: {err}", engine.name());
        let mut ok = vec![0u8; 1 << 20];
        engine.read_exact_at(&file, 0, &mut ok).unwrap();
        assert!(ok == pattern(1 << 20, 4));
    }
}

#[test]
fn failed_chunks_retire_and_the_ring_stays_usable() {
    let dir = TempDir::new("fail");
    let path = dir.path("ro");
    std::fs::write(&path, pattern(4096, 1)).unwrap();
    let read_only = File::open(&path).unwrap();
    let Some(engine) =
        uring_with(EngineConfig { queue_depth: 4, chunk_bytes: 64 << 10, staging_bytes: 0 }, 1)
    else {
        return;
    };
    // Every chunk of this write fails (EBADF); the call drains them all and reports one error.
    let err = engine.write_all_at(&read_only, 0, &pattern(1 << 20, 2)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{err}");
    assert_eq!(engine.rings_open(), 1, "an I/O error does not cost the ring");
    let mut back = vec![0u8; 4096];
    engine.read_exact_at(&read_only, 0, &mut back).unwrap();
    assert!(back == pattern(4096, 1));
    let psync_err = PsyncEngine.write_all_at(&read_only, 0, &[1]).unwrap_err();
    assert_eq!(psync_err.raw_os_error(), Some(libc::EBADF));
}

/// Files `f0..fN` of `len` bytes each (distinct content), opened for reading and writing.
fn batch_files(dir: &TempDir, n: usize, len: usize) -> (Vec<File>, Vec<Vec<u8>>) {
    (0..n)
        .map(|i| {
            let f = open_rw(&dir.path(&format!("f{i}")));
            let data = pattern(len, 100 + i as u64);
            f.write_all_at(&data, 0).expect("write");
            (f, data)
        })
        .unzip()
}

#[test]
fn batch_reads_answer_per_request_on_every_engine() {
    let dir = TempDir::new("batch");
    let (files, data) = batch_files(&dir, 12, 20_000);
    for engine in engines() {
        let name = engine.name();
        let mut bufs: Vec<Vec<u8>> = (0..files.len() + 3).map(|_| vec![0xEE; 5000]).collect();
        let mut want: Vec<Option<ErrorKind>> = Vec::new();
        let mut reads: Vec<BatchRead<'_>> = Vec::new();
        for (i, buf) in bufs.iter_mut().enumerate() {
            let (file, offset, fails) = match i {
                // Past the end of its file: only this request fails.
                3 => (&files[3], 18_000, Some(ErrorKind::UnexpectedEof)),
                // An offset whose end overflows.
                7 => (&files[7], u64::MAX - 10, Some(ErrorKind::InvalidInput)),
                // Empty reads succeed wherever they point.
                i if i >= files.len() => (&files[0], 1 << 40, None),
                i => (&files[i], 1000 + i as u64, None),
            };
            let buf: &mut [u8] = if i >= files.len() { &mut buf[..0] } else { buf };
            want.push(fails);
            reads.push(BatchRead { file, offset, buf });
        }
        let results = engine.read_batch(&mut reads);
        assert_eq!(results.len(), reads.len(), "{name}");
        let kinds: Vec<Option<ErrorKind>> =
            results.iter().map(|r| r.as_ref().err().map(io::Error::kind)).collect();
        assert_eq!(kinds, want, "{name}");
        drop(reads);
        for (i, buf) in bufs.iter().enumerate().take(files.len()) {
            if want[i].is_none() {
                let at = 1000 + i;
                assert!(buf[..] == data[i][at..at + 5000], "{name}: request {i} got other bytes");
            }
        }
    }
}

#[test]
fn uring_batch_keeps_many_requests_in_flight() {
    let Some(engine) = uring() else { return };
    let dir = TempDir::new("batch-depth");
    // Requests of one chunk each: a single read has one SQE in flight, a batch up to the depth.
    let (files, data) = batch_files(&dir, 20, 16 << 10);
    let mut buf = vec![0u8; 16 << 10];
    for f in &files {
        engine.read_exact_at(f, 0, &mut buf).expect("read");
    }
    assert_eq!(engine.max_in_flight(), 1, "one-chunk reads one by one");
    let mut bufs: Vec<Vec<u8>> = files.iter().map(|_| vec![0u8; 16 << 10]).collect();
    let mut reads: Vec<BatchRead<'_>> = files
        .iter()
        .zip(bufs.iter_mut())
        .map(|(file, buf)| BatchRead { file, offset: 0, buf })
        .collect();
    let results = engine.read_batch(&mut reads);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(
        engine.max_in_flight(),
        small_config().queue_depth,
        "a batch of {} reads fills the queue",
        files.len()
    );
    drop(reads);
    assert_eq!(bufs, data);
    engine.reset_max_in_flight();
    assert_eq!(engine.max_in_flight(), 0);
}

#[test]
fn uring_o_direct_batch_reads_into_slot_pieces_and_owned_buffers() {
    let Some(engine) = uring() else { return };
    let dir = TempDir::new("batch-direct");
    let Some(file) = open_direct(&dir.path("d")) else { return };
    let len = 64 << 10;
    let data = pattern(4 * len, 7);
    let mut staging = engine.staging(data.len()).expect("staging");
    assert!(matches!(staging, Staging::Registered(_)));
    staging[..data.len()].copy_from_slice(&data);
    engine.write_all_at(&file, 0, &staging[..data.len()]).expect("write");
    staging.fill(0);
    let (a, rest) = staging.split_at_mut(len);
    let (b, rest) = rest.split_at_mut(len);
    let mut owned = gpucache_storage::file::engine::AlignedBuf::zeroed(len).expect("aligned");
    let mut reads = vec![
        BatchRead { file: &file, offset: 3 * len as u64, buf: a },
        BatchRead { file: &file, offset: 0, buf: b },
        BatchRead { file: &file, offset: len as u64, buf: &mut owned[..] },
        // Misaligned under O_DIRECT: the kernel refuses this one only.
        BatchRead { file: &file, offset: 100, buf: &mut rest[..len] },
    ];
    let results = engine.read_batch(&mut reads);
    drop(reads);
    assert!(results[..3].iter().all(Result::is_ok), "{results:?}");
    assert_eq!(results[3].as_ref().err().and_then(io::Error::raw_os_error), Some(libc::EINVAL));
    assert!(staging[..len] == data[3 * len..], "registered slot, first piece");
    assert!(staging[len..2 * len] == data[..len], "registered slot, second piece");
    assert!(owned[..] == data[len..2 * len], "unregistered buffer");
}

#[test]
fn finished_reads_are_handed_over_once_each() {
    let dir = TempDir::new("batch-then");
    let (files, data) = batch_files(&dir, 10, 300_000);
    let mut all: Vec<Box<dyn IoEngine>> = engines();
    all.push(Box::new(FaultyEngine::new(
        PsyncEngine,
        FaultConfig { read_eio: 0.5, ..FaultConfig::none(3) },
    )));
    for engine in all {
        let name = engine.name();
        let mut bufs: Vec<Vec<u8>> = files.iter().map(|_| vec![0u8; 200_000]).collect();
        let mut reads: Vec<BatchRead<'_>> = files
            .iter()
            .zip(bufs.iter_mut())
            .enumerate()
            // Request 4 runs past the end of its file.
            .map(|(i, (file, buf))| BatchRead {
                file,
                offset: if i == 4 { 200_000 } else { 7 },
                buf,
            })
            .collect();
        let mut seen: Vec<usize> = Vec::new();
        let results = engine.read_batch_then(&mut reads, &mut |i, buf| {
            // The buffer is complete when it is handed over.
            assert!(buf[..] == data[i][7..200_007], "{name}: request {i} handed over early");
            seen.push(i);
        });
        drop(reads);
        let ok: Vec<usize> = (0..files.len()).filter(|i| results[*i].is_ok()).collect();
        seen.sort_unstable();
        assert_eq!(seen, ok, "{name}: handed over what succeeded, once each");
        assert!(results[4].is_err(), "{name}");
    }
}

#[test]
fn a_panicking_handler_is_rethrown_after_the_batch_is_reaped() {
    let Some(engine) = uring() else { return };
    let dir = TempDir::new("batch-panic");
    let (files, data) = batch_files(&dir, 24, 64 << 10);
    let mut bufs: Vec<Vec<u8>> = files.iter().map(|_| vec![0u8; 64 << 10]).collect();
    let mut handed = 0;
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut reads: Vec<BatchRead<'_>> = files
            .iter()
            .zip(bufs.iter_mut())
            .map(|(file, buf)| BatchRead { file, offset: 0, buf })
            .collect();
        engine.read_batch_then(&mut reads, &mut |_, _| {
            handed += 1;
            panic!("handler fails");
        })
    }));
    assert!(caught.is_err(), "the handler's panic was swallowed");
    assert_eq!(handed, 1, "the handler ran again after it panicked");
    // The ring that saw the panic is not reused; the engine goes on with another.
    let mut buf = vec![0u8; 64 << 10];
    engine.read_exact_at(&files[3], 0, &mut buf).expect("read after the panic");
    assert!(buf == data[3]);
}

#[test]
fn faulty_batch_draws_what_reads_one_by_one_draw() {
    let dir = TempDir::new("batch-faulty");
    let (files, _) = batch_files(&dir, 16, 4096);
    let mut injected = 0;
    for seed in 0..20u64 {
        let config = FaultConfig { read_eio: 0.3, read_bit_flip: 0.3, ..FaultConfig::none(seed) };
        let one = FaultyEngine::new(PsyncEngine, config);
        let batched = FaultyEngine::new(PsyncEngine, config);
        let mut single: Vec<(Option<i32>, Vec<u8>)> = Vec::new();
        for f in &files {
            let mut buf = vec![0u8; 4096];
            let r = one.read_exact_at(f, 0, &mut buf);
            single.push((r.err().and_then(|e| e.raw_os_error()), buf));
        }
        let mut bufs: Vec<Vec<u8>> = files.iter().map(|_| vec![0u8; 4096]).collect();
        let mut reads: Vec<BatchRead<'_>> = files
            .iter()
            .zip(bufs.iter_mut())
            .map(|(file, buf)| BatchRead { file, offset: 0, buf })
            .collect();
        let results = batched.read_batch(&mut reads);
        drop(reads);
        let together: Vec<(Option<i32>, Vec<u8>)> =
            results.into_iter().map(|r| r.err().and_then(|e| e.raw_os_error())).zip(bufs).collect();
        assert_eq!(together, single, "seed {seed}");
        assert_eq!(batched.counts(), one.counts(), "seed {seed}");
        injected += one.counts().total();
    }
    assert!(injected > 0, "no fault was injected: the comparison proved nothing");
}

#[test]
fn concurrent_callers_share_fewer_rings() {
    let dir = TempDir::new("concurrent");
    let Some(engine) = uring_with(small_config(), 2) else { return };
    let engine = Arc::new(engine);
    let file = Arc::new(open_rw(&dir.path("shared")));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let engine = Arc::clone(&engine);
            let file = Arc::clone(&file);
            std::thread::spawn(move || {
                for round in 0..16u64 {
                    let len = 4096 * 7 + usize::try_from(round).unwrap() * 1000;
                    let data = pattern(len, t * 100 + round);
                    let offset = t * (1 << 20) + round * 4096;
                    engine.write_all_at(&file, offset, &data).unwrap();
                    let mut back = vec![0u8; len];
                    engine.read_exact_at(&file, offset, &mut back).unwrap();
                    assert!(back == data, "thread {t} round {round}");
                    if round % 4 == 0 {
                        engine.sync(&file).unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(engine.rings_open() <= 2, "rings stay within the bound: {}", engine.rings_open());
}

#[derive(Debug, Clone)]
struct WriteOp {
    offset: u64,
    len: usize,
    seed: u64,
}

fn write_ops() -> impl Strategy<Value = Vec<WriteOp>> {
    proptest::collection::vec(
        (0u64..(768 << 10), 1usize..(320 << 10), any::<u64>())
            .prop_map(|(offset, len, seed)| WriteOp { offset, len, seed }),
        1..10,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random writes through uring and through psync produce identical files, and uring reads
    /// agree with psync reads.
    #[test]
    fn uring_and_psync_write_identical_files(ops in write_ops(), probe in (0u64..(1 << 20), 1usize..(300 << 10))) {
        let Some(uring) = shared_uring() else { return Ok(()) };
        let dir = TempDir::new("prop");
        let a = open_rw(&dir.path("uring"));
        let b = open_rw(&dir.path("psync"));
        for op in &ops {
            let data = pattern(op.len, op.seed);
            uring.write_all_at(&a, op.offset, &data).unwrap();
            PsyncEngine.write_all_at(&b, op.offset, &data).unwrap();
        }
        let fa = std::fs::read(dir.path("uring")).unwrap();
        let fb = std::fs::read(dir.path("psync")).unwrap();
        prop_assert_eq!(fa.len(), fb.len());
        prop_assert!(fa == fb);

        let (offset, len) = probe;
        let mut ra = vec![0u8; len];
        let mut rb = vec![0u8; len];
        let got_a = uring.read_exact_at(&a, offset, &mut ra).map_err(|e| e.kind());
        let got_b = PsyncEngine.read_exact_at(&b, offset, &mut rb).map_err(|e| e.kind());
        prop_assert_eq!(got_a, got_b);
        if got_a.is_ok() {
            prop_assert!(ra == rb);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Faulty layer

fn always(seed: u64, set: impl FnOnce(&mut FaultConfig)) -> FaultyEngine<PsyncEngine> {
    let mut config = FaultConfig::none(seed);
    set(&mut config);
    FaultyEngine::new(PsyncEngine, config)
}

#[test]
fn faulty_describes_itself_as_a_simulation() {
    let e = always(42, |_| {});
    assert_eq!(e.name(), "faulty");
    assert!(e.describe().contains("simulated faulty disk (seed 42)"), "{}", e.describe());
}

/// Runs a fixed call sequence; returns the outcome of each call, the counts and the file bytes.
fn scripted_run(
    seed: u64,
) -> (Vec<String>, gpucache_storage::file::engine::faulty::FaultCounts, Vec<u8>) {
    let dir = TempDir::new("script");
    let config = FaultConfig {
        seed,
        short_write: 0.1,
        write_eio: 0.1,
        write_enospc: 0.1,
        torn_write: 0.1,
        read_eio: 0.2,
        read_bit_flip: 0.2,
        dropped_sync: 0.3,
    };
    let engine = FaultyEngine::new(PsyncEngine, config);
    let path = dir.path("f");
    let file = open_rw(&path);
    engine.set_enabled(false);
    engine.write_all_at(&file, 0, &vec![0u8; 64 << 10]).unwrap();
    engine.sync(&file).unwrap();
    engine.set_enabled(true);
    let mut outcomes = Vec::new();
    let outcome = |r: io::Result<()>| match r {
        Ok(()) => "ok".to_string(),
        Err(e) => format!("{:?}/{:?}", e.kind(), e.raw_os_error()),
    };
    for i in 0..120u64 {
        let offset = (i * 7919) % (60 << 10);
        let len = 1 + usize::try_from((i * 104_729) % 4000).unwrap();
        match i % 4 {
            0 | 1 => outcomes.push(outcome(engine.write_all_at(&file, offset, &pattern(len, i)))),
            2 => {
                let mut buf = vec![0u8; len];
                let r = engine.read_exact_at(&file, offset, &mut buf);
                outcomes.push(format!(
                    "{} {}",
                    outcome(r),
                    buf.iter().map(|b| u64::from(*b)).sum::<u64>()
                ));
            }
            _ => outcomes.push(outcome(engine.sync(&file))),
        }
    }
    let report = engine.crash().unwrap();
    outcomes.push(format!("{report:?}"));
    let counts = engine.counts();
    let bytes = std::fs::read(&path).unwrap();
    (outcomes, counts, bytes)
}

#[test]
fn faulty_same_seed_same_faults() {
    let (o1, c1, b1) = scripted_run(0xfeed);
    let (o2, c2, b2) = scripted_run(0xfeed);
    assert_eq!(c1, c2);
    assert_eq!(o1, o2);
    assert!(b1 == b2, "same seed, same file bytes");
    assert!(c1.total() > 10, "the schedule injects faults: {c1:?}");
    assert!(
        c1.short_writes > 0 && c1.write_eio > 0 && c1.write_enospc > 0 && c1.torn_writes > 0,
        "{c1:?}"
    );
    assert!(c1.read_eio > 0 && c1.read_bit_flips > 0 && c1.dropped_syncs > 0, "{c1:?}");
    let (o3, c3, _) = scripted_run(0xbeef);
    assert!(o3 != o1 || c3 != c1, "a different seed gives a different schedule");
}

#[test]
fn faulty_enospc_writes_nothing() {
    let dir = TempDir::new("enospc");
    let e = always(1, |c| c.write_enospc = 1.0);
    let file = open_rw(&dir.path("f"));
    let err = e.write_all_at(&file, 0, &pattern(10_000, 1)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
    assert_eq!(file.metadata().unwrap().len(), 0, "nothing written");
    assert_eq!(e.counts().write_enospc, 1);
    assert_eq!(e.unsynced_bytes(), 0);
}

#[test]
fn faulty_eio_and_short_writes_leave_a_prefix_and_fail() {
    let dir = TempDir::new("prefix");
    let data = vec![0xa5u8; 50_000];
    for (kind, e) in
        [("eio", always(2, |c| c.write_eio = 1.0)), ("short", always(3, |c| c.short_write = 1.0))]
    {
        let path = dir.path(kind);
        let file = open_rw(&path);
        let err = e.write_all_at(&file, 0, &data).unwrap_err();
        if kind == "eio" {
            assert_eq!(err.raw_os_error(), Some(libc::EIO));
        } else {
            assert_eq!(err.kind(), ErrorKind::WriteZero);
            assert!(err.to_string().contains("injected short write"), "{err}");
        }
        let written = std::fs::read(&path).unwrap();
        assert!(written.len() < data.len(), "{kind}: a strict prefix");
        assert!(written.iter().all(|b| *b == 0xa5), "{kind}: the prefix is the data's");
    }
}

#[test]
fn faulty_torn_write_reports_success_but_the_file_differs() {
    let dir = TempDir::new("torn");
    let e = always(4, |c| c.torn_write = 1.0);
    let path = dir.path("f");
    let file = open_rw(&path);
    let data = vec![0x5au8; 30_000];
    e.write_all_at(&file, 0, &data).unwrap();
    let written = std::fs::read(&path).unwrap();
    assert!(written != data, "a torn write loses the tail");
    assert!(written.len() < data.len() && written.iter().all(|b| *b == 0x5a));
    assert_eq!(e.counts().torn_writes, 1);
}

#[test]
fn faulty_read_eio_and_bit_flip() {
    let dir = TempDir::new("read");
    let path = dir.path("f");
    let data = pattern(20_000, 5);
    std::fs::write(&path, &data).unwrap();
    let file = File::open(&path).unwrap();

    let eio = always(5, |c| c.read_eio = 1.0);
    let mut buf = vec![0u8; data.len()];
    let err = eio.read_exact_at(&file, 0, &mut buf).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    assert_eq!(eio.counts().read_eio, 1);

    let flip = always(6, |c| c.read_bit_flip = 1.0);
    for round in 0..5 {
        flip.read_exact_at(&file, 0, &mut buf).unwrap();
        let differing: u32 = buf.iter().zip(&data).map(|(a, b)| (a ^ b).count_ones()).sum();
        assert_eq!(differing, 1, "round {round}: exactly one bit flipped");
    }
    assert_eq!(flip.counts().read_bit_flips, 5);
    flip.set_enabled(false);
    flip.read_exact_at(&file, 0, &mut buf).unwrap();
    assert!(buf == data, "paused: no injection");
    assert_eq!(flip.counts().read_bit_flips, 5);
}

#[test]
fn faulty_dropped_sync_loses_data_in_a_crash_and_a_real_sync_survives() {
    let dir = TempDir::new("crash");
    let e = always(7, |c| c.dropped_sync = 1.0);
    let lost_path = dir.path("lost");
    let kept_path = dir.path("kept");
    let lost = open_rw(&lost_path);
    let kept = open_rw(&kept_path);
    let data = pattern(100_000, 7);

    e.write_all_at(&lost, 4096, &data).unwrap();
    e.sync(&lost).unwrap(); // dropped
    assert_eq!(e.counts().dropped_syncs, 1);

    e.write_all_at(&kept, 4096, &data).unwrap();
    e.set_enabled(false);
    e.sync(&kept).unwrap(); // real
    e.set_enabled(true);
    // Written after its sync: lost too, though the synced range survives.
    e.write_all_at(&kept, 200_000, &data[..1000]).unwrap();
    assert_eq!(e.unsynced_bytes(), 101_000);

    drop(lost); // closing does not sync either
    let report = e.crash().unwrap();
    assert_eq!((report.files, report.ranges, report.bytes), (2, 2, 101_000));
    assert_eq!(e.unsynced_bytes(), 0);

    let lost_bytes = std::fs::read(&lost_path).unwrap();
    assert_eq!(lost_bytes.len(), 4096 + data.len());
    assert!(lost_bytes[..4096].iter().all(|b| *b == 0), "untouched before the range");
    assert!(lost_bytes[4096..] != data[..], "the unsynced range is garbled");
    let kept_bytes = std::fs::read(&kept_path).unwrap();
    assert!(kept_bytes[4096..4096 + data.len()] == data[..], "a really synced range survives");
    assert!(kept_bytes[200_000..] != data[..1000], "but not what was written after the sync");

    // A second crash has nothing left to lose.
    assert_eq!(e.crash().unwrap().bytes, 0);
    assert_eq!(e.counts().crashes, 2);
}

#[test]
fn faulty_tracking_is_bounded_by_simulated_writeback() {
    use gpucache_storage::file::engine::faulty::TRACKED_RANGES_MAX;
    let dir = TempDir::new("bound");
    let e = always(8, |_| {});
    let file = open_rw(&dir.path("f"));
    // Disjoint one-byte writes with gaps: one range each.
    for i in 0..=u64::try_from(TRACKED_RANGES_MAX).unwrap() {
        e.write_all_at(&file, i * 2, &[1]).unwrap();
    }
    assert_eq!(e.counts().writebacks, 1);
    assert_eq!(e.unsynced_bytes(), 0, "the file was written back and forgotten");
    e.write_all_at(&file, 10, &[2]).unwrap();
    assert_eq!(e.unsynced_bytes(), 1);
}

#[test]
fn faulty_over_uring_keeps_o_direct_prefixes_aligned() {
    let dir = TempDir::new("faulty-direct");
    let Some(inner) = uring() else { return };
    let e = FaultyEngine::new(inner, FaultConfig { torn_write: 1.0, ..FaultConfig::none(9) });
    let Some(file) = open_direct(&dir.path("f")) else { return };
    let len = 64 * DIRECT_ALIGN;
    let mut buf = e.staging(len).unwrap();
    assert!(matches!(buf, Staging::Registered(_)), "staging passes through to the inner engine");
    buf.fill(0x77);
    for round in 0..8u64 {
        // Torn at sector granularity; the inner O_DIRECT write must stay valid.
        e.write_all_at(&file, round * u64::try_from(len).unwrap(), &buf[..len]).unwrap();
    }
    let size = file.metadata().unwrap().len();
    assert_eq!(
        size % u64::try_from(DIRECT_ALIGN).unwrap(),
        0,
        "prefixes are whole sectors: {size}"
    );
    assert_eq!(e.counts().torn_writes, 8);
    // Crash garbage through O_DIRECT is aligned too.
    e.crash().unwrap();
}

#[test]
fn buffer_pool_recycles_within_its_bound() {
    use gpucache_storage::file::engine::{BufferPool, POOLED_STAGING_BYTES_MAX};
    let pool = std::sync::Arc::new(BufferPool::default());
    let a = pool.take(1 << 20).unwrap();
    let addr = a.buf_addr();
    drop(a);
    let b = pool.take(1 << 20).unwrap();
    assert_eq!(b.buf_addr(), addr, "a returned buffer was not reused");
    // A much smaller request does not take a buffer over twice its size.
    let c = pool.take(4096).unwrap();
    assert_ne!(c.buf_addr(), addr);
    drop(b);
    // Buffers beyond the byte bound are freed, not kept.
    let many: Vec<_> = (0..(POOLED_STAGING_BYTES_MAX / (1 << 20)) + 4)
        .map(|_| pool.take(1 << 20).unwrap())
        .collect();
    drop(many);
    assert!(pool.kept_bytes() <= POOLED_STAGING_BYTES_MAX);
}
