//! The tiered store beyond the conformance suite: against a model, no committed block is ever
//! lost to the memory tier's evictions while the file tier holds it; a block being read is never
//! evicted from memory; one tenant's quota never takes another tenant's blocks from either tier;
//! and kill -9 of a process writing through both tiers loses nothing it acknowledged, and serves
//! no torn block after the restart.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use gpucache_dataplane::caller::Caller;
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Invalidate, Put, Store};
use gpucache_dataplane::testing::fixture::{caller, key, payload};
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::tiered::{MemoryTier, TieredStore};
use proptest::prelude::*;

const KIB: u64 = 1 << 10;
/// [`KIB`] as a buffer length.
const KIB_LEN: usize = 1 << 10;

fn limits(retained: u64, tenant: u64) -> ResourceLimits {
    ResourceLimits {
        object_bytes_max: (64 * KIB).min(tenant),
        retained_bytes_max: retained,
        tenant_retained_bytes_max: tenant,
        ..ResourceLimits::default()
    }
}

fn open(
    root: &Path,
    limits: ResourceLimits,
    memory_bytes: u64,
    durability: Durability,
) -> TieredStore {
    let mut file = FileStoreConfig::new(root);
    file.engine = EngineChoice::Psync;
    file.engine_config.staging_bytes = 0;
    file.durability = durability;
    file.policy = PolicyKind::Prefix;
    file.limits = limits;
    let memory =
        MemoryTier { capacity_bytes: memory_bytes, policy: PolicyKind::Prefix, promote: true };
    TieredStore::open(file, memory, Arc::new(ManualClock::default())).expect("tiered store opens")
}

fn shm_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.expect("temp dir")
}

#[derive(Debug, Clone)]
enum Op {
    Put { key: u8, len: u16, seed: u8 },
    Get { key: u8 },
    Invalidate { key: u8 },
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        3 => (0u8..24, 1u16..8, any::<u8>()).prop_map(|(key, len, seed)| Op::Put { key, len, seed }),
        4 => (0u8..24).prop_map(|key| Op::Get { key }),
        1 => (0u8..24).prop_map(|key| Op::Invalidate { key }),
    ];
    proptest::collection::vec(op, 1..120)
}

fn block_key(k: u8) -> PhysicalKey {
    key(0, &[k], KvDtype::F16, 16)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// The memory tier holds room for 4 KiB-blocks a few at a time and evicts all the while;
    /// the file tier holds 16 KiB. A block stays readable, byte for byte, from its commit until
    /// it is invalidated or the file tier reports evicting it; never a hit after that.
    #[test]
    fn memory_evictions_never_lose_a_block_the_file_tier_holds(ops in ops()) {
        let dir = shm_dir();
        let store = open(dir.path(), limits(16 * KIB, 16 * KIB), 5 * KIB, Durability::None);
        store.take_evicted_for_test();
        let mut model: HashMap<u8, Vec<u8>> = HashMap::new();
        let mut dst = vec![0u8; 8 * KIB_LEN];
        for (step, op) in ops.iter().enumerate() {
            match *op {
                Op::Put { key: k, len, seed } => {
                    let data = payload(u64::from(seed), usize::from(len) * 1000);
                    let got = store.put(&caller(0), &block_key(k), &data, None).expect("put");
                    match got {
                        Put::Committed(c) => {
                            prop_assert_eq!(c, Checksum::of(&data));
                            prop_assert!(!model.contains_key(&k), "step {}: create-only put committed twice", step);
                            model.insert(k, data);
                        }
                        Put::AlreadyCommitted => prop_assert!(model.contains_key(&k), "step {}", step),
                        other => prop_assert!(false, "step {}: put answered {:?}", step, other),
                    }
                }
                Op::Get { key: k } => {
                    let got = store.get_into(&caller(0), &block_key(k), &mut dst).expect("get");
                    match (got, model.get(&k)) {
                        (Get::Hit { len, .. }, Some(want)) => {
                            prop_assert_eq!(&dst[..usize::try_from(len).expect("len")], &want[..], "step {}: wrong bytes", step);
                        }
                        (Get::Miss(_), None) => {}
                        (got, want) => prop_assert!(false, "step {}: got {:?}, model holds {:?}", step, got, want.map(Vec::len)),
                    }
                }
                Op::Invalidate { key: k } => {
                    let got = store.invalidate(&caller(0), &block_key(k)).expect("invalidate");
                    prop_assert_eq!(got == Invalidate::Removed, model.remove(&k).is_some(), "step {}", step);
                }
            }
            for gone in store.take_evicted_for_test() {
                let k = (0..24u8).find(|k| block_key(*k) == gone).expect("a key of this test");
                prop_assert!(model.remove(&k).is_some(), "step {}: evicted {} it did not hold", step, k);
            }
        }
        let c = store.counters();
        prop_assert_eq!(store.file().stats().committed_blocks, model.len() as u64);
        prop_assert!(store.memory().stats().usage.retained_bytes <= 5 * KIB);
        // Hits split between the tiers; every GET was counted once.
        let gets = ops.iter().filter(|o| matches!(o, Op::Get { .. })).count() as u64;
        prop_assert_eq!(c.memory_hits + c.file_hits + c.misses, gets);
    }
}

#[test]
fn each_hit_says_which_tier_served_it_and_a_file_hit_is_promoted() {
    use gpucache_dataplane::store::BatchGet;
    use gpucache_storage::tiered::Tier;
    let dir = shm_dir();
    // Memory holds one 4 KiB block.
    let store = open(dir.path(), limits(1 << 20, 1 << 20), 4 * KIB, Durability::None);
    let (a, b) = (payload(1, 4 * KIB_LEN), payload(2, 4 * KIB_LEN));
    store.put(&caller(0), &block_key(0), &a, None).expect("put");
    store.put(&caller(0), &block_key(1), &b, None).expect("put");
    let mut dst = vec![0u8; 4 * KIB_LEN];
    // Block 1 was copied up last; block 0's copy made room for it.
    let (got, tier) = store.get_with_tier(&caller(0), &block_key(1), &mut dst).expect("get");
    assert!(matches!(got, Get::Hit { .. }) && tier == Some(Tier::Memory) && dst == b);
    let (got, tier) = store.get_with_tier(&caller(0), &block_key(0), &mut dst).expect("get");
    assert!(matches!(got, Get::Hit { .. }) && tier == Some(Tier::File) && dst == a);
    // The file hit was promoted: block 0 is in memory now, and block 1 went back to file only.
    let (mut d0, mut d1, mut d2) = (vec![0u8; 4 * KIB_LEN], vec![0u8; 4 * KIB_LEN], vec![0u8; 16]);
    let (k0, k1, k2) = (block_key(0), block_key(1), block_key(2));
    let mut items = [
        BatchGet { key: &k0, dst: &mut d0 },
        BatchGet { key: &k1, dst: &mut d1 },
        BatchGet { key: &k2, dst: &mut d2 },
    ];
    let answers = store.get_batch_with_tiers(&caller(0), &mut items);
    let tiers: Vec<Option<Tier>> = answers.iter().map(|(_, t)| *t).collect();
    assert_eq!(tiers, vec![Some(Tier::Memory), Some(Tier::File), None]);
    assert!(matches!(answers[2].0, Ok(Get::Miss(_))), "{:?}", answers[2].0);
    assert_eq!((d0, d1), (a, b));
    let c = store.counters();
    assert_eq!((c.memory_hits, c.file_hits, c.misses, c.promotions), (2, 2, 1, 2));
}

#[test]
fn a_block_being_read_from_memory_is_never_evicted_there() {
    let dir = shm_dir();
    // Memory has room for two 4 KiB blocks; the file tier for many.
    let store = open(dir.path(), limits(1 << 20, 1 << 20), 8 * KIB, Durability::None);
    let held = payload(1, 4 * KIB_LEN);
    store.put(&caller(0), &block_key(0), &held, None).expect("put");
    let mut during = Vec::new();
    let lent = store
        .get_lent(&caller(0), &block_key(0), held.len(), &mut |bytes, _| {
            // While the memory tier lends the block, more blocks arrive and evict there.
            for k in 1..6u8 {
                let data = payload(u64::from(k), 4 * KIB_LEN);
                let put = store.put(&caller(0), &block_key(k), &data, None).expect("put");
                assert!(matches!(put, Put::Committed(_)), "{put:?}");
            }
            during.extend_from_slice(bytes);
            Some(Checksum::of(bytes))
        })
        .expect("lent get");
    assert!(matches!(lent, Some(Get::Hit { .. })), "{lent:?}");
    assert_eq!(during, held, "the lent bytes changed while they were read");
    assert!(store.memory().stats().evictions >= 3, "the puts made the memory tier evict");
    // Everything is still readable from one tier or the other.
    let mut dst = vec![0u8; 4 * KIB_LEN];
    for k in 0..6u8 {
        let got = store.get_into(&caller(0), &block_key(k), &mut dst).expect("get");
        assert!(matches!(got, Get::Hit { .. }), "block {k}: {got:?}");
        assert_eq!(dst, payload(if k == 0 { 1 } else { u64::from(k) }, 4 * KIB_LEN));
    }
}

#[test]
fn one_tenants_quota_never_takes_another_tenants_blocks_from_either_tier() {
    let dir = shm_dir();
    // Each tenant may keep 16 KiB in the file tier; memory holds 12 KiB for everyone.
    let store = open(dir.path(), limits(1 << 20, 16 * KIB), 12 * KIB, Durability::None);
    let b_keys: Vec<PhysicalKey> = (0..3u8).map(|k| key(1, &[k], KvDtype::F16, 16)).collect();
    for (i, k) in b_keys.iter().enumerate() {
        let put = store.put(&caller(1), k, &payload(i as u64, 4 * KIB_LEN), None).expect("put");
        assert!(matches!(put, Put::Committed(_)), "{put:?}");
    }
    // Tenant 0 writes three times its quota: its own oldest blocks make the room.
    for k in 0..12u8 {
        let put =
            store.put(&caller(0), &block_key(k), &payload(50, 4 * KIB_LEN), None).expect("put");
        assert!(matches!(put, Put::Committed(_)), "{put:?}");
    }
    let mut dst = vec![0u8; 4 * KIB_LEN];
    for (i, k) in b_keys.iter().enumerate() {
        let got = store.get_into(&caller(1), k, &mut dst).expect("get");
        assert!(matches!(got, Get::Hit { .. }), "tenant 1 lost block {i}: {got:?}");
        assert_eq!(dst, payload(i as u64, 4 * KIB_LEN));
    }
    let file = store.file().stats();
    assert_eq!(file.evictions, 8, "tenant 0's twelve blocks fit four at a time");
    assert_eq!(file.usage.retained_bytes, 7 * 4 * KIB);
    // Tenant 0 cannot read tenant 1's blocks through either tier.
    let foreign: Caller = caller(0);
    assert!(store.get_into(&foreign, &b_keys[0], &mut dst).is_err());
}

// ---------------------------------------------------------------------------------------------
// kill -9 while writing through both tiers

/// Set in the child: `<dir>:<seed>`.
const CHILD_ENV: &str = "GPUCACHE_TIERED_CRASH_CHILD";
const CHILD_PUTS_MAX: u32 = 100_000;
const CHILD_DEADLINE: Duration = Duration::from_secs(60);
const ROUNDS: u64 = 8;

fn crash_key(i: u32) -> PhysicalKey {
    let b = i.to_le_bytes();
    key(0, &[0xD3, b[0], b[1], b[2]], KvDtype::Bf16, 16)
}

fn crash_payload(seed: u64, i: u32) -> Vec<u8> {
    let extra = SplitMix64::new(seed ^ u64::from(i)).next_u64() % (48 * KIB);
    let len = 1024 + usize::try_from(extra).expect("small");
    payload(seed.wrapping_mul(31) ^ u64::from(i), len)
}

fn crash_store(root: &Path) -> TieredStore {
    // Memory holds a few blocks and evicts on nearly every PUT; the file tier holds them all.
    open(root, limits(1 << 30, 1 << 30), 128 * KIB, Durability::PerBlock)
}

#[test]
fn child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let (dir, seed) = spec.rsplit_once(':').expect("dir:seed");
    let seed: u64 = seed.parse().expect("seed");
    let store = crash_store(Path::new(dir));
    let mut out = std::io::stdout().lock();
    let mut rng = SplitMix64::new(seed);
    let mut dst = vec![0u8; 64 * KIB_LEN];
    writeln!(out).expect("stdout");
    for i in 0..CHILD_PUTS_MAX {
        let put = store.put(&caller(0), &crash_key(i), &crash_payload(seed, i), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "crash child: put {i} answered {put:?}");
        // Reads of older blocks promote them, so memory keeps turning over.
        let old = u32::try_from(rng.next_u64() % u64::from(i + 1)).expect("below i");
        let _ = store.get_into(&caller(0), &crash_key(old), &mut dst);
        if writeln!(out, "ACK {i}").and_then(|()| out.flush()).is_err() {
            return;
        }
    }
}

#[test]
fn kill_9_while_writing_through_both_tiers_loses_nothing_acknowledged() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("current exe");
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir().expect("temp dir");
        let seed = 0x7E57_0000 + round;
        let kill_after = 20 + u32::try_from(SplitMix64::new(seed).next_u64() % 200).expect("small");
        let mut child = Command::new(&exe)
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, format!("{}:{seed}", dir.path().display()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn crash child");
        let stdout = child.stdout.take().expect("child stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(i) = line.strip_prefix("ACK ")
                    && tx.send(i.trim().parse::<u32>().expect("ack index")).is_err()
                {
                    break;
                }
            }
        });
        let mut acked = None;
        while acked.is_none_or(|a| a < kill_after) {
            match rx.recv_timeout(CHILD_DEADLINE) {
                Ok(i) => acked = Some(i),
                Err(e) => {
                    let _ = child.kill();
                    panic!("round {round}: crash child silent for {CHILD_DEADLINE:?}: {e}");
                }
            }
        }
        child.kill().expect("SIGKILL the child");
        let status = child.wait().expect("reap the child");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "round {round}: {status:?}");
        // Acks read after the kill point are acknowledged too.
        while let Ok(i) = rx.try_recv() {
            acked = Some(i);
        }
        let acked = acked.expect("some acks");

        let store = crash_store(dir.path());
        let mut dst = vec![0u8; 64 * KIB_LEN];
        for i in 0..=acked {
            let got = store.get_into(&caller(0), &crash_key(i), &mut dst).expect("get");
            let want = crash_payload(seed, i);
            match got {
                Get::Hit { len, .. } => {
                    assert_eq!(
                        &dst[..usize::try_from(len).expect("len")],
                        &want[..],
                        "round {round}: block {i} torn"
                    )
                }
                miss => panic!("round {round}: acknowledged block {i} of {acked} lost: {miss:?}"),
            }
        }
        // The one PUT in flight at the kill is either whole or absent; nothing past it exists.
        let next = acked + 1;
        match store.get_into(&caller(0), &crash_key(next), &mut dst).expect("get") {
            Get::Hit { len, .. } => {
                assert_eq!(
                    &dst[..usize::try_from(len).expect("len")],
                    &crash_payload(seed, next)[..]
                )
            }
            Get::Miss(_) => {}
        }
        let beyond = store.get_into(&caller(0), &crash_key(next + 1), &mut dst).expect("get");
        assert!(matches!(beyond, Get::Miss(_)), "round {round}: a block never written: {beyond:?}");
        assert!(
            store.counters().file_hits > u64::from(acked),
            "round {round}: after a restart memory starts empty, so the file tier served them"
        );
    }
}
