//! KV blocks from GPU memory to a store and back into other GPU slots, across processes.
//!
//! The parent test re-executes this binary twice. The writer fills device block slots with
//! patterned blocks (H2D from a host pattern: no kernels), copies them D2H into pinned staging,
//! PUTs them through the data plane's executor into a FileStore in a temporary directory, and
//! exits. A fresh reader allocates new device memory filled with a sentinel, GETs the blocks
//! into different host slots, copies them H2D into different device slots, reads back the WHOLE
//! device allocation and checks every byte: restored slots hold their patterns and every other
//! byte still holds the sentinel. It then invalidates the objects and checks that GETs are clean,
//! retired misses.
//!
//! Without a usable GPU the test skips and says why; `GPUCACHE_REQUIRE_GPU=1` makes that a
//! failure (scripts/gpu-check.sh sets it; CI does not).

use std::num::NonZeroUsize;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::registry::{Completion, LocalEpochs, RegisteredPool, SlotLease};
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Invalidate, MissReason, Store};
use gpucache_dataplane::testing::fixture::{key, tenant};
use gpucache_executor::testing;
use gpucache_executor::{
    Ending, Executor, HostBuffer, HostRange, KeyResult, OperationId, OperationResult,
};
use gpucache_gpu::retire::{IN_FLIGHT_MAX, RetireLimits};
use gpucache_gpu::{Direction, GpuDevice, GpuSlots, GpuStream, PinnedStaging, REQUIRE_GPU_ENV};
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};

const ROLE_ENV: &str = "GPUCACHE_GPU_E2E_ROLE";
const DIR_ENV: &str = "GPUCACHE_GPU_E2E_DIR";
/// One KV block: 256 KiB, odd enough in content that a shifted copy cannot pass.
const BLOCK_BYTES: usize = 256 << 10;
const BLOCKS: usize = 6;
const DEVICE_SLOTS: usize = 16;
/// Where the reader restores block i: never the writer's slot i.
const READER_SLOTS: [usize; BLOCKS] = [11, 3, 14, 8, 0, 6];
const SENTINEL: u8 = 0xA5;
const WAIT: Duration = Duration::from_secs(30);

fn n(v: usize) -> NonZeroUsize {
    NonZeroUsize::new(v).expect("nonzero")
}

fn caller() -> Caller {
    Caller::new(tenant(0), Rights::ALL)
}

fn keys() -> Vec<PhysicalKey> {
    (0..BLOCKS)
        .map(|i| key(0, &[0x40, u8::try_from(i).expect("few blocks")], KvDtype::Bf16, 16))
        .collect()
}

/// Block i's bytes: a function of the key and the offset in the block.
fn pattern(key: &PhysicalKey, len: usize) -> Vec<u8> {
    let seed = key
        .encoded()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    SplitMix64::bytes(seed, len)
}

fn store(dir: &Path) -> Arc<dyn Store> {
    let mut config = FileStoreConfig::new(dir);
    config.engine = EngineChoice::Psync;
    config.durability = Durability::None;
    Arc::new(config.open(Arc::new(ManualClock::default())).expect("file store opens"))
}

fn executor(store: Arc<dyn Store>, host_slots: usize) -> (Executor, Arc<HostBuffer>) {
    testing::executor(store, host_slots, BLOCK_BYTES)
}

fn host_range(slot: usize) -> HostRange {
    HostRange::new((slot * BLOCK_BYTES) as u64, BLOCK_BYTES as u64)
}

fn wait_for(exec: &Executor, operation: OperationId) -> OperationResult {
    let result = testing::wait_for(exec, operation, WAIT);
    assert_eq!(result.ending, Ending::Ran);
    assert!(result.retired, "{operation} retired");
    result
}

struct Gpu {
    stream: GpuStream,
    device: RegisteredPool<GpuSlots>,
    staging: RegisteredPool<PinnedStaging>,
}

fn gpu(staging_slots: usize) -> Gpu {
    let dev = GpuDevice::open(0).expect("device 0");
    let slots = GpuSlots::new(Arc::clone(&dev), n(DEVICE_SLOTS), n(BLOCK_BYTES)).expect("slots");
    let pinned = PinnedStaging::new(Arc::clone(&dev), n(staging_slots), n(BLOCK_BYTES))
        .expect("pinned staging");
    let stream = GpuStream::new(dev, n(IN_FLIGHT_MAX), RetireLimits::default()).expect("stream");
    Gpu {
        stream,
        device: RegisteredPool::new(slots, Box::new(LocalEpochs)),
        staging: RegisteredPool::new(pinned, Box::new(LocalEpochs)),
    }
}

/// Starts one copy per pair, then settles them all: several copies in flight on one stream.
fn copy_all(g: &mut Gpu, direction: Direction, pairs: &[(SlotLease, SlotLease)]) {
    let ids: Vec<_> = pairs
        .iter()
        .map(|(d, s)| {
            g.stream
                .copy(direction, &mut g.device, d, &mut g.staging, s, BLOCK_BYTES)
                .expect("copy submitted")
        })
        .collect();
    assert_eq!(g.stream.in_flight(), pairs.len());
    for id in ids {
        let settled = g.stream.settle(id, &mut g.device, &mut g.staging).expect("settles");
        assert_eq!(settled.completion(), Completion::Retired, "{direction:?} {settled:?}");
    }
}

fn release(g: &mut Gpu, device: &[SlotLease], staging: &[SlotLease]) {
    for l in device {
        g.device.complete(l.region, Completion::Retired).expect("device slot released");
    }
    for l in staging {
        g.staging.complete(l.region, Completion::Retired).expect("staging slot released");
    }
    assert_eq!(g.device.table().counts().quarantined, 0);
    assert_eq!(g.staging.table().counts().quarantined, 0);
}

fn writer(dir: &Path) {
    let mut g = gpu(BLOCKS);
    g.device.memory().fill(0).expect("zeroed");
    let owner = tenant(0);
    let d = g.device.checkout(&owner, BLOCKS, None).expect("device slots");
    let s = g.staging.checkout(&owner, BLOCKS, None).expect("staging slots");
    let keys = keys();
    for (i, lease) in s.iter().enumerate() {
        let bytes = g.staging.slot_bytes_mut(lease).expect("staging is host memory");
        bytes.copy_from_slice(&pattern(&keys[i], BLOCK_BYTES));
    }
    let pairs: Vec<_> = d.iter().copied().zip(s.iter().copied()).collect();
    copy_all(&mut g, Direction::HostToDevice, &pairs);
    for lease in &s {
        g.staging.slot_bytes_mut(lease).expect("staging").fill(0);
    }
    copy_all(&mut g, Direction::DeviceToHost, &pairs);

    let (exec, host) = executor(store(dir), BLOCKS);
    for (i, lease) in s.iter().enumerate() {
        let bytes = g.staging.slot_bytes_mut(lease).expect("staging");
        // Paired check: what came back from the device is what went in.
        assert!(bytes == pattern(&keys[i], BLOCK_BYTES).as_slice(), "block {i} after D2H");
        host.write(host_range(i), bytes).expect("host slot");
    }
    let puts = keys.iter().enumerate().map(|(i, k)| (k.clone(), host_range(i))).collect();
    let put = exec.submit_put(puts).expect("put queued");
    let result = wait_for(&exec, put);
    let written = [KeyResult::Written { bytes: BLOCK_BYTES as u64 }];
    assert_eq!(result.keys, vec![written[0].clone(); BLOCKS], "new writes");
    let report = exec.close(WAIT);
    assert!(!report.restart_required, "{report}");
    release(&mut g, &d, &s);
    eprintln!("writer: {BLOCKS} blocks of {BLOCK_BYTES} bytes PUT from device slots 0..{BLOCKS}");
}

fn reader(dir: &Path) {
    let mut g = gpu(BLOCKS);
    g.device.memory().fill(SENTINEL).expect("sentinel");
    let owner = tenant(0);
    let d = g.device.checkout(&owner, DEVICE_SLOTS, None).expect("every device slot");
    let s = g.staging.checkout(&owner, BLOCKS, None).expect("staging slots");
    let keys = keys();
    let store = store(dir);
    // Host slots BLOCKS.. in reverse: nowhere near where the writer's blocks were.
    let (exec, host) = executor(Arc::clone(&store), 2 * BLOCKS);
    let host_slot = |i: usize| 2 * BLOCKS - 1 - i;
    let gets =
        keys.iter().enumerate().map(|(i, k)| (k.clone(), host_range(host_slot(i)))).collect();
    let get = exec.submit_get(gets).expect("get queued");
    let result = wait_for(&exec, get);
    let read = [KeyResult::Read { bytes: BLOCK_BYTES as u64 }];
    assert_eq!(result.keys, vec![read[0].clone(); BLOCKS], "every block read");

    // Staging slot (i + 2) % BLOCKS, device slot READER_SLOTS[i]: all different from the writer.
    let mut pairs = Vec::new();
    for (i, slot) in READER_SLOTS.iter().enumerate() {
        let staging = s[(i + 2) % BLOCKS];
        let bytes = host.read(host_range(host_slot(i))).expect("host slot");
        g.staging.slot_bytes_mut(&staging).expect("staging").copy_from_slice(&bytes);
        let device = *d.iter().find(|l| l.slot == *slot).expect("slot checked out");
        pairs.push((device, staging));
    }
    copy_all(&mut g, Direction::HostToDevice, &pairs);

    let whole = g.device.memory().read_all().expect("whole device buffer");
    assert_eq!(whole.len(), DEVICE_SLOTS * BLOCK_BYTES);
    let mut restored = 0;
    for (slot, bytes) in whole.chunks(BLOCK_BYTES).enumerate() {
        match READER_SLOTS.iter().position(|s| *s == slot) {
            Some(i) => {
                let want = pattern(&keys[i], BLOCK_BYTES);
                let bad = bytes.iter().zip(&want).position(|(a, b)| a != b);
                assert_eq!(bad, None, "device slot {slot} (block {i}) differs at that offset");
                restored += 1;
            }
            None => {
                let bad = bytes.iter().position(|b| *b != SENTINEL);
                assert_eq!(
                    bad, None,
                    "untouched device slot {slot} lost its sentinel at that offset"
                );
            }
        }
    }
    assert_eq!(restored, BLOCKS);

    for k in &keys {
        assert_eq!(store.invalidate(&caller(), k).expect("invalidate"), Invalidate::Removed);
    }
    let gets = keys.iter().enumerate().map(|(i, k)| (k.clone(), host_range(i))).collect();
    let get = exec.submit_get(gets).expect("get queued");
    let result = wait_for(&exec, get);
    let absent = [KeyResult::ObjectFailed(MissReason::Absent)];
    assert_eq!(result.keys, vec![absent[0].clone(); BLOCKS], "clean misses after invalidation");
    let report = exec.close(WAIT);
    assert!(!report.restart_required, "{report}");
    release(&mut g, &d, &s);
    eprintln!(
        "reader: {BLOCKS} blocks restored into device slots {READER_SLOTS:?}, {} untouched slots \
         kept the sentinel, misses after invalidation",
        DEVICE_SLOTS - BLOCKS
    );
}

/// The child processes' entry point; a no-op in a normal test run.
#[test]
fn e2e_role() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    let dir = std::env::var(DIR_ENV).expect("the parent names the store directory");
    match role.as_str() {
        "writer" => writer(Path::new(&dir)),
        "reader" => reader(Path::new(&dir)),
        other => panic!("unknown {ROLE_ENV} {other}"),
    }
}

fn run_role(role: &str, dir: &Path) {
    let exe = std::env::current_exe().expect("test binary path");
    let status = Command::new(exe)
        .args(["--exact", "e2e_role", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .env(DIR_ENV, dir)
        .status()
        .expect("child starts");
    assert!(status.success(), "{role} process failed: {status}");
}

#[test]
fn gpu_kv_blocks_survive_their_writer_and_restore_into_other_slots() {
    if std::env::var_os(ROLE_ENV).is_some() {
        return;
    }
    if let Err(why) = gpucache_gpu::probe() {
        assert!(!gpucache_gpu::gpu_required(), "{REQUIRE_GPU_ENV}=1 but no usable GPU: {why}");
        eprintln!("SKIP gpu e2e: no usable GPU ({why}); set {REQUIRE_GPU_ENV}=1 to fail instead");
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    run_role("writer", dir.path());
    run_role("reader", dir.path());
}
