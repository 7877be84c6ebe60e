//! FileStore restart semantics: committed blocks reload byte-exact, every open takes a new epoch,
//! open reservations and unfinished writes do not survive, region ids keep growing, a second
//! open of the same directory is refused, eviction order carries over, and opening reads block
//! headers, not payloads.
//!
//! `GPUCACHE_RESTART_SEED` replays a run.

mod common;

use std::path::Path;

use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::registry::RegionId;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Invalidate, Lookup, MissReason, Put, Reserve, Store};
use gpucache_dataplane::testing::fixture::caller;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStore, FileStoreError, fsck};

use common::assert_exact;

const SEED_VAR: &str = "GPUCACHE_RESTART_SEED";

fn open(root: &Path, engine: EngineChoice, direct: bool) -> FileStore {
    let mut c = common::config(root, engine, Durability::PerBlock);
    c.direct_io = direct;
    common::open(c)
}

fn open_with(root: &Path, limits: ResourceLimits) -> FileStore {
    let mut c = common::config(root, EngineChoice::Psync, Durability::PerBlock);
    c.limits = limits;
    common::open(c)
}

fn put_ok(store: &FileStore, key: &gpucache_dataplane::PhysicalKey, data: &[u8]) {
    match store.put(&caller(0), key, data, None) {
        Ok(Put::Committed(_)) => {}
        other => panic!("put: {other:?}"),
    }
}

/// Reserves, writes and commits `data` under `key`; returns the region the block got.
fn put_region(store: &FileStore, key: &gpucache_dataplane::PhysicalKey, data: &[u8]) -> RegionId {
    let Reserve::Reserved(r) =
        store.reserve(&caller(0), key, data.len() as u64, None).expect("reserve")
    else {
        panic!("reserve refused");
    };
    store.write(&caller(0), &r, 0, data).expect("write");
    store.commit(&caller(0), &r).expect("commit");
    r.region
}

fn lookup(store: &FileStore, key: &gpucache_dataplane::PhysicalKey) -> Lookup {
    store.lookup(&caller(0), key).expect("lookup")
}

#[test]
fn committed_blocks_reload_byte_exact_on_any_engine() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 1]));
    let variants =
        [(EngineChoice::Psync, false), (EngineChoice::Uring, false), (EngineChoice::Uring, true)];
    for (v, &(engine, direct)) in variants.iter().enumerate() {
        let what = format!("seed {seed}: written by {engine:?} direct={direct}");
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path();
        let store = open(root, engine, direct);
        let blocks: Vec<_> = (0..30u16)
            .map(|i| {
                let k = common::block_key(0x01, u16::try_from(v).expect("small"), i);
                let bits = rng.range(0, 19);
                let len = usize::try_from(rng.range(1 << bits, (2 << bits) - 1)).expect("fits");
                let d = common::payload(rng.next_u64(), len);
                put_ok(&store, &k, &d);
                (k, d)
            })
            .collect();
        // One block is invalidated before the restart: it stays gone.
        let (gone, _) = &blocks[7];
        assert_eq!(store.invalidate(&caller(0), gone).expect("invalidate"), Invalidate::Removed);
        let before = store.stats();
        drop(store);
        // Read back by every engine in turn.
        for &(engine2, direct2) in &variants {
            let store = open(root, engine2, direct2);
            let report = store.open_report().clone();
            let kept: Vec<_> = blocks.iter().filter(|(k, _)| k != gone).collect();
            let bytes: u64 = kept.iter().map(|(_, d)| d.len() as u64).sum();
            assert_eq!(report.loaded, kept.len() as u64, "{what}: {report:?}");
            assert_eq!(report.loaded_bytes, bytes, "{what}: {report:?}");
            assert!(report.skipped.is_empty() && report.tmp_removed == 0, "{what}: {report:?}");
            let after = store.stats();
            assert_eq!(after.usage, before.usage, "{what}: usage after restart");
            assert_eq!(after.committed_blocks, before.committed_blocks, "{what}");
            for (k, d) in &kept {
                assert_exact(&store, k, d, &format!("{what}, read by {engine2:?}/{direct2}"));
            }
            assert_eq!(lookup(&store, gone), Lookup::Miss(MissReason::Absent), "{what}");
        }
    }
}

#[test]
fn every_open_takes_a_new_epoch() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let mut last = 0;
    for i in 0..8 {
        let store = open(root, EngineChoice::Psync, false);
        let epoch = store.open_report().epoch;
        assert_eq!(epoch, last + 1, "open {i}: epoch");
        assert_eq!(store.epoch().0, epoch, "open {i}: store epoch");
        last = epoch;
        if i % 3 == 1 {
            // A bump inside a run is persisted before it takes effect.
            let bumped = store.bump_epoch().expect("bump");
            assert_eq!(bumped.0, epoch + 1, "open {i}: bump");
            last = bumped.0;
        }
    }
}

#[test]
fn open_reservations_and_unfinished_writes_do_not_survive() {
    let seed = common::seed(SEED_VAR);
    let mut rng = SplitMix64::new(SplitMix64::mix(&[seed, 3]));
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    for round in 0..5u16 {
        let what = format!("seed {seed}, round {round}");
        let store = open(root, EngineChoice::Psync, false);
        let committed = common::block_key(0x03, round, 0);
        let data = common::payload(rng.next_u64(), 50_000);
        put_ok(&store, &committed, &data);
        // Open reservations: one partly written, one fully written but not committed, one not
        // written at all.
        let mut open_keys = Vec::new();
        for (j, written) in [(1u16, 20_000usize), (2, 50_000), (3, 0)] {
            let k = common::block_key(0x03, round, j);
            let Reserve::Reserved(r) =
                store.reserve(&caller(0), &k, 50_000, None).expect("reserve")
            else {
                panic!("{what}: reserve refused");
            };
            if written > 0 {
                let piece = common::payload(rng.next_u64(), written);
                store.write(&caller(0), &r, 0, &piece).expect("write");
            }
            assert_eq!(
                lookup(&store, &k),
                Lookup::Miss(MissReason::NotReadable(if written > 0 {
                    gpucache_dataplane::BlockState::Writing
                } else {
                    gpucache_dataplane::BlockState::Reserved
                })),
                "{what}"
            );
            open_keys.push(k);
        }
        assert_eq!(store.stats().usage.inflight_requests, 3, "{what}: reservations charged");
        // Reservations are staged in memory: nothing of them is on disk yet.
        assert!(common::tmp_files(root).is_empty(), "{what}: reservation left a tmp file");
        // What a writer killed in the middle of a block file leaves behind.
        let planted = rng.range(1, 3);
        for p in 0..planted {
            std::fs::write(root.join("tmp").join(format!("{}.tmp", 1000 + p)), b"partial")
                .expect("plant tmp");
        }
        drop(store);

        let store = open(root, EngineChoice::Psync, false);
        let report = store.open_report().clone();
        assert_eq!(report.tmp_removed, planted, "{what}: {report:?}");
        assert!(common::tmp_files(root).is_empty(), "{what}: tmp/ not emptied");
        assert!(report.skipped.is_empty(), "{what}: {report:?}");
        assert_exact(&store, &committed, &data, &what);
        let stats = store.stats();
        assert_eq!(stats.usage.inflight_requests, 0, "{what}: reservations survived");
        assert_eq!(u64::from(stats.usage.registrations), stats.committed_blocks, "{what}");
        for k in &open_keys {
            assert_eq!(lookup(&store, k), Lookup::Miss(MissReason::Absent), "{what}");
            // The key is free for a new writer.
            let fresh = common::payload(rng.next_u64(), 1_000);
            put_ok(&store, k, &fresh);
            assert_exact(&store, k, &fresh, &what);
            assert_eq!(store.invalidate(&caller(0), k).expect("invalidate"), Invalidate::Removed);
        }
    }
}

#[test]
fn region_ids_after_a_restart_exceed_all_earlier_ones() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let mut highest = RegionId(0);
    for run in 0..5u16 {
        let store = open(root, EngineChoice::Psync, false);
        for i in 0..6u16 {
            if i == 3 && run % 2 == 1 {
                store.bump_epoch().expect("bump");
            }
            let region = put_region(&store, &common::block_key(0x04, run, i), b"region ids");
            assert!(region > highest, "run {run}, block {i}: {region:?} after {highest:?}");
            highest = region;
        }
        // Reservations that are aborted or left open also consume ids.
        let Reserve::Reserved(r) = store
            .reserve(&caller(0), &common::block_key(0x04, run, 99), 10, None)
            .expect("reserve")
        else {
            panic!("reserve refused");
        };
        assert!(r.region > highest);
        highest = r.region;
    }
}

#[test]
fn a_second_open_of_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let first = open(root, EngineChoice::Psync, false);
    put_ok(&first, &common::block_key(0x05, 0, 0), b"held");
    for engine in [EngineChoice::Psync, EngineChoice::Uring] {
        let mut c = common::config(root, engine, Durability::PerBlock);
        c.limits = ResourceLimits::default();
        match c.open(std::sync::Arc::new(gpucache_dataplane::clock::ManualClock::default())) {
            Err(FileStoreError::Locked { path }) => assert_eq!(path, root.join("LOCK")),
            Err(other) => panic!("second open failed with {other}, not Locked"),
            Ok(_) => panic!("second open of a locked store succeeded"),
        }
    }
    let refused = fsck(root, false, |_, _| {}).expect_err("fsck of an open store");
    assert_eq!(refused.kind(), std::io::ErrorKind::WouldBlock);
    // The refused opens changed nothing: the first store still works, and the epoch moves on
    // from its own.
    let epoch = first.epoch().0;
    assert_exact(&first, &common::block_key(0x05, 0, 0), b"held", "first store");
    drop(first);
    let second = open(root, EngineChoice::Psync, false);
    assert_eq!(second.open_report().epoch, epoch + 1);
    assert_exact(&second, &common::block_key(0x05, 0, 0), b"held", "after the lock is free");
}

#[test]
fn eviction_order_survives_restarts() {
    const LEN: usize = 10_000;
    const CAPACITY: u16 = 10;
    let limits = ResourceLimits {
        object_bytes_max: LEN as u64,
        retained_bytes_max: LEN as u64 * u64::from(CAPACITY),
        tenant_retained_bytes_max: LEN as u64 * u64::from(CAPACITY),
        ..ResourceLimits::default()
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let key = |i: u16| common::block_key(0x06, 0, i);
    let data = |i: u16| common::payload(u64::from(i) + 600, LEN);
    // Commit order 0..CAPACITY over three runs (restart after 4 and after 7).
    for (from, to) in [(0, 4), (4, 7), (7, CAPACITY)] {
        let store = open_with(root, limits.clone());
        assert_eq!(store.open_report().loaded, u64::from(from));
        for i in from..to {
            put_ok(&store, &key(i), &data(i));
        }
        assert_eq!(store.stats().evictions, 0);
    }
    // Full. Every later block evicts exactly the oldest survivor, across restarts; reading an
    // old block does not make it younger.
    let mut oldest = 0u16;
    for next in CAPACITY..CAPACITY + 8 {
        let store = open_with(root, limits.clone());
        assert_eq!(store.open_report().loaded, u64::from(CAPACITY), "before block {next}");
        assert_exact(&store, &key(oldest), &data(oldest), "oldest block before eviction");
        put_ok(&store, &key(next), &data(next));
        assert_eq!(store.stats().evictions, 1, "block {next}: one eviction");
        assert_eq!(
            lookup(&store, &key(oldest)),
            Lookup::Miss(MissReason::Absent),
            "block {next} should have evicted block {oldest}"
        );
        assert!(common::block_files(root, &key(oldest)).is_empty(), "evicted file left");
        for i in oldest + 1..=next {
            assert_eq!(lookup(&store, &key(i)), Lookup::Hit { len: LEN as u64 }, "block {i}");
        }
        oldest += 1;
    }
    // An invalidation frees room: the next block evicts nothing.
    let store = open_with(root, limits.clone());
    let victim = oldest + 3;
    assert_eq!(
        store.invalidate(&caller(0), &key(victim)).expect("invalidate"),
        Invalidate::Removed
    );
    drop(store);
    let store = open_with(root, limits);
    put_ok(&store, &key(100), &data(100));
    assert_eq!(store.stats().evictions, 0);
    assert_eq!(lookup(&store, &key(oldest)), Lookup::Hit { len: LEN as u64 });
}

/// `rchar` of this process: bytes it asked read(2) and friends for.
fn process_rchar() -> u64 {
    let text = std::fs::read_to_string("/proc/self/io").expect("read /proc/self/io");
    text.lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("rchar line")
}

const OPEN_CHILD_VAR: &str = "GPUCACHE_OPEN_RCHAR_DIR";

/// Runs only as the child of `open_reads_headers_not_payloads`: opens the store (whose header
/// scan runs on several threads) alone in its process and prints how many bytes it read.
#[test]
fn open_rchar_child() {
    let Ok(dir) = std::env::var(OPEN_CHILD_VAR) else { return };
    let before = process_rchar();
    let store = open(Path::new(&dir), EngineChoice::Psync, false);
    let read = process_rchar() - before;
    let loaded = store.open_report().loaded;
    let mut out = std::io::stdout().lock();
    std::io::Write::write_all(&mut out, format!("open-rchar {read} loaded {loaded}\n").as_bytes())
        .expect("stdout");
}

#[test]
fn open_reads_headers_not_payloads() {
    const BLOCKS: u16 = 1_000;
    const LEN: usize = 256 << 10;
    // A tmpfs keeps the 250 MiB off the disk; the counter is the same on any filesystem.
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }
        .expect("temp dir");
    let root = dir.path();
    let data = common::payload(7, LEN);
    {
        let mut c = common::config(root, EngineChoice::Psync, Durability::None);
        c.engine_config.staging_bytes = 0;
        let store = common::open(c);
        for i in 0..BLOCKS {
            put_ok(&store, &common::block_key(0x07, 0, i), &data);
        }
    }
    let payload_total = u64::from(BLOCKS) * LEN as u64;
    // The open runs in a child process so that the process-wide counter sees only its reads.
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "open_rchar_child", "--nocapture", "--test-threads=1"])
        .env(OPEN_CHILD_VAR, root)
        .output()
        .expect("run child");
    assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // The harness may print its own "test ... " prefix on the same line.
    let line = text
        .lines()
        .find_map(|l| l.split_once("open-rchar ").map(|(_, rest)| rest))
        .expect("child's report line");
    let fields: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    let (read, loaded) = (fields[0], fields[1]);
    assert_eq!(loaded, u64::from(BLOCKS), "{line}");
    // One 4 KiB header page per block, plus the store record and this counter's own reads.
    let headers = u64::from(BLOCKS) * 4096;
    assert!(read >= headers, "rchar {read} < {headers}: the counter missed the header reads");
    assert!(
        read < headers + (256 << 10),
        "open read {read} bytes for {BLOCKS} blocks ({payload_total} bytes of payload)"
    );
    assert!(read * 20 < payload_total, "open read {read} of {payload_total} bytes");
    let store = open(root, EngineChoice::Psync, false);
    assert_eq!(store.open_report().loaded_bytes, payload_total);
    assert_exact(&store, &common::block_key(0x07, 0, BLOCKS - 1), &data, "last block");
}

#[test]
fn tighter_limits_at_reopen_keep_the_newest_blocks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let keys: Vec<_> = (0..10u8)
        .map(|i| {
            gpucache_dataplane::testing::fixture::key(
                0,
                &[40, i],
                gpucache_dataplane::identity::KvDtype::F16,
                16,
            )
        })
        .collect();
    {
        let store = open_with(dir.path(), ResourceLimits::default());
        for (i, k) in keys.iter().enumerate() {
            put_ok(&store, k, &common::payload(i as u64, 1000));
        }
    }
    let tight = ResourceLimits {
        object_bytes_max: 1000,
        retained_bytes_max: 5000,
        tenant_retained_bytes_max: 5000,
        ..ResourceLimits::default()
    };
    let store = open_with(dir.path(), tight);
    assert_eq!(store.open_report().skipped.get("over limits"), Some(&5));
    for (i, k) in keys.iter().enumerate() {
        let present = lookup(&store, k) != Lookup::Miss(MissReason::Absent);
        assert_eq!(present, i >= 5, "block {i}: the oldest must go, the newest stay");
    }
    drop(store);
    let report = fsck(dir.path(), false, |_, _| {}).expect("fsck");
    assert_eq!(report.ok, 5, "the left-out files must be removed");
}

#[test]
fn a_crafted_payload_length_is_skipped_not_a_panic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let k = gpucache_dataplane::testing::fixture::key(
        0,
        &[41],
        gpucache_dataplane::identity::KvDtype::F16,
        16,
    );
    {
        let store = open_with(dir.path(), ResourceLimits::default());
        put_ok(&store, &k, &common::payload(1, 100));
    }
    // Rewrite the header with payload_len = u64::MAX and a valid header checksum.
    let file = common::block_files(dir.path(), &k).into_iter().next().expect("one block file");
    let mut bytes = std::fs::read(&file).expect("read");
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    bytes[48..56].fill(0);
    let header_len =
        usize::try_from(u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]))
            .unwrap_or(0);
    let sum = gpucache_dataplane::checksum::Checksum::of(&bytes[..header_len]);
    bytes[48..56].copy_from_slice(&sum.0.to_le_bytes());
    std::fs::write(&file, &bytes).expect("write");
    let store = open_with(dir.path(), ResourceLimits::default());
    assert_eq!(common::skipped_total(store.open_report()), 1);
    assert_eq!(lookup(&store, &k), Lookup::Miss(MissReason::Absent));
}

/// A lock held for a moment by another process (as a child of the previous holder holds it
/// between its fork and its exec) delays an open instead of failing it.
#[test]
fn a_lock_held_for_a_moment_elsewhere_delays_the_open_and_does_not_refuse_it() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    drop(open(root, EngineChoice::Psync, false));
    // util-linux flock(1) takes the lock, says so, holds it 300 ms and lets go.
    let mut holder = std::process::Command::new("flock")
        .args(["-x"])
        .arg(root.join("LOCK"))
        .args(["sh", "-c", "echo held; sleep 0.3"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("flock(1) from util-linux");
    let mut line = String::new();
    std::io::BufReader::new(holder.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line, "held\n");
    let started = std::time::Instant::now();
    let store = open(root, EngineChoice::Psync, false);
    assert!(started.elapsed() >= std::time::Duration::from_millis(100), "the lock was not held");
    assert!(holder.wait().expect("wait").success());
    put_ok(&store, &common::block_key(0x06, 0, 0), b"after the wait");
}
