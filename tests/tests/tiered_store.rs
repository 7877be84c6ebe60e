//! The tiered store beyond the conformance suite: against a model, no committed block is ever
//! lost to the memory tier's evictions while the file tier holds it; a block being read is never
//! evicted from memory; one tenant's quota never takes another tenant's blocks from either tier;
//! kill -9 of a process writing through both tiers loses nothing it acknowledged, and serves no
//! torn block after the restart; writing back, every block memory evicts is written down, kill
//! -9 loses no block flushed or demoted, and a damaged only copy is a miss.

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
use gpucache_dataplane::testing::fixture::{caller, get_lent, key, payload};
use gpucache_storage::evict::PolicyKind;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_storage::file::{Durability, FileStoreConfig};
use gpucache_storage::tiered::{MemoryTier, TieredStore, WriteMode};
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
    open_writing(root, limits, memory_bytes, durability, WriteMode::Through)
}

fn open_writing(
    root: &Path,
    limits: ResourceLimits,
    memory_bytes: u64,
    durability: Durability,
    write: WriteMode,
) -> TieredStore {
    let mut file = FileStoreConfig::new(root);
    file.engine = EngineChoice::Psync;
    file.engine_config.staging_bytes = 0;
    file.durability = durability;
    file.policy = PolicyKind::Prefix;
    file.limits = limits;
    let memory = MemoryTier { write, ..MemoryTier::new(memory_bytes, PolicyKind::Prefix) };
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
        against_the_model(&ops, WriteMode::Through)?;
    }

    /// As above when PUTs write back: every block the memory tier evicts is written down to
    /// the file tier, which loses none of them while it has room.
    #[test]
    fn demotions_never_lose_a_block_the_file_tier_has_room_for(ops in ops()) {
        against_the_model(&ops, WriteMode::Back)?;
    }
}

fn against_the_model(ops: &[Op], write: WriteMode) -> Result<(), TestCaseError> {
    {
        let dir = shm_dir();
        let store =
            open_writing(dir.path(), limits(16 * KIB, 16 * KIB), 5 * KIB, Durability::None, write);
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
                            prop_assert!(
                                !model.contains_key(&k),
                                "step {}: create-only put committed twice",
                                step
                            );
                            model.insert(k, data);
                        }
                        Put::AlreadyCommitted => {
                            prop_assert!(model.contains_key(&k), "step {}", step)
                        }
                        other => prop_assert!(false, "step {}: put answered {:?}", step, other),
                    }
                }
                Op::Get { key: k } => {
                    let got = store.get_into(&caller(0), &block_key(k), &mut dst).expect("get");
                    match (got, model.get(&k)) {
                        (Get::Hit { len, .. }, Some(want)) => {
                            prop_assert_eq!(
                                &dst[..usize::try_from(len).expect("len")],
                                &want[..],
                                "step {}: wrong bytes",
                                step
                            );
                        }
                        (Get::Miss(_), None) => {}
                        (got, want) => prop_assert!(
                            false,
                            "step {}: got {:?}, model holds {:?}",
                            step,
                            got,
                            want.map(Vec::len)
                        ),
                    }
                }
                Op::Invalidate { key: k } => {
                    let got = store.invalidate(&caller(0), &block_key(k)).expect("invalidate");
                    prop_assert_eq!(
                        got == Invalidate::Removed,
                        model.remove(&k).is_some(),
                        "step {}",
                        step
                    );
                }
            }
            for gone in store.take_evicted_for_test() {
                let k = (0..24u8).find(|k| block_key(*k) == gone).expect("a key of this test");
                prop_assert!(
                    model.remove(&k).is_some(),
                    "step {}: evicted {} it did not hold",
                    step,
                    k
                );
            }
        }
        let c = store.counters();
        prop_assert_eq!(store.file().stats().committed_blocks, model.len() as u64);
        prop_assert!(store.memory().stats().usage.retained_bytes <= 5 * KIB);
        // Hits split between the tiers; every GET was counted once.
        let gets = ops.iter().filter(|o| matches!(o, Op::Get { .. })).count() as u64;
        prop_assert_eq!(c.memory_hits + c.file_hits + c.misses, gets);
        if write == WriteMode::Back {
            // Nothing was lost on the way down, and every block not in memory has its file.
            prop_assert_eq!(c.write_back_lost, 0);
            for k in model.keys() {
                let in_memory = store.memory().committed_checksum(&block_key(*k)).is_some();
                prop_assert!(
                    in_memory || !store.file().is_deferred(&block_key(*k)),
                    "block {} is nowhere",
                    k
                );
            }
        }
    }
    Ok(())
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
    let lent = get_lent(&store, &caller(0), &block_key(0), held.len(), |bytes, _| {
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
// kill -9 while writing through both tiers, or writing back

/// Set in the child: `<dir>:<seed>:<write mode>`.
const CHILD_ENV: &str = "GPUCACHE_TIERED_CRASH_CHILD";
const CHILD_PUTS_MAX: u32 = 100_000;
const CHILD_DEADLINE: Duration = Duration::from_secs(60);
const ROUNDS: u64 = 8;
/// Writing back, the child flushes after this many PUTs.
const FLUSH_EVERY: u32 = 16;

fn crash_key(i: u32) -> PhysicalKey {
    let b = i.to_le_bytes();
    key(0, &[0xD3, b[0], b[1], b[2]], KvDtype::Bf16, 16)
}

fn crash_payload(seed: u64, i: u32) -> Vec<u8> {
    let extra = SplitMix64::new(seed ^ u64::from(i)).next_u64() % (48 * KIB);
    let len = 1024 + usize::try_from(extra).expect("small");
    payload(seed.wrapping_mul(31) ^ u64::from(i), len)
}

fn crash_store(root: &Path, write: WriteMode) -> TieredStore {
    // Memory holds a few blocks and evicts (demoting, when writing back) on nearly every PUT;
    // the file tier holds them all.
    open_writing(root, limits(1 << 30, 1 << 30), 128 * KIB, Durability::PerBlock, write)
}

#[test]
fn child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let mut parts = spec.rsplitn(3, ':');
    let write: WriteMode = parts.next().expect("mode").parse().expect("write mode");
    let seed: u64 = parts.next().expect("seed").parse().expect("seed");
    let dir = parts.next().expect("dir");
    let store = crash_store(Path::new(dir), write);
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
        let mut said = writeln!(out, "ACK {i}");
        if write == WriteMode::Back && i % FLUSH_EVERY == FLUSH_EVERY - 1 {
            store.flush();
            said = said.and_then(|()| writeln!(out, "FLUSHED {i}"));
        }
        if said.and_then(|()| out.flush()).is_err() {
            return;
        }
    }
}

/// What the parent heard from a child before it killed it.
#[derive(Debug, Default, Clone, Copy)]
struct Heard {
    acked: Option<u32>,
    flushed: Option<u32>,
}

impl Heard {
    fn take(&mut self, line: (bool, u32)) {
        match line {
            (false, i) => self.acked = Some(i),
            (true, i) => self.flushed = Some(i),
        }
    }
}

/// Runs a crash child writing with `write`, kills it with SIGKILL a few hundred PUTs in, and
/// returns what it had said by then.
fn crash_round(exe: &Path, dir: &Path, seed: u64, write: WriteMode) -> Heard {
    let kill_after = 20 + u32::try_from(SplitMix64::new(seed).next_u64() % 200).expect("small");
    let mut child = Command::new(exe)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{}:{seed}:{write}", dir.display()))
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
            let said = match (line.strip_prefix("ACK "), line.strip_prefix("FLUSHED ")) {
                (Some(i), _) => (false, i),
                (_, Some(i)) => (true, i),
                _ => continue,
            };
            if tx.send((said.0, said.1.trim().parse::<u32>().expect("index"))).is_err() {
                break;
            }
        }
    });
    let mut heard = Heard::default();
    while heard.acked.is_none_or(|a| a < kill_after) {
        match rx.recv_timeout(CHILD_DEADLINE) {
            Ok(line) => heard.take(line),
            Err(e) => {
                let _ = child.kill();
                panic!("seed {seed}: crash child silent for {CHILD_DEADLINE:?}: {e}");
            }
        }
    }
    child.kill().expect("SIGKILL the child");
    let status = child.wait().expect("reap the child");
    assert_eq!(status.signal(), Some(libc::SIGKILL), "seed {seed}: {status:?}");
    // Lines read after the kill point were said before it too.
    while let Ok(line) = rx.try_recv() {
        heard.take(line);
    }
    heard
}

/// Reads block `i` after a restart: `Some(true)` whole, `None` a miss; a torn block panics.
fn read_back(store: &TieredStore, seed: u64, i: u32, dst: &mut [u8]) -> bool {
    match store.get_into(&caller(0), &crash_key(i), dst).expect("get") {
        Get::Hit { len, .. } => {
            let want = crash_payload(seed, i);
            assert_eq!(
                &dst[..usize::try_from(len).expect("len")],
                &want[..],
                "seed {seed}: block {i} torn"
            );
            true
        }
        Get::Miss(_) => false,
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
        let heard = crash_round(&exe, dir.path(), seed, WriteMode::Through);
        let acked = heard.acked.expect("some acks");
        let store = crash_store(dir.path(), WriteMode::Through);
        let mut dst = vec![0u8; 64 * KIB_LEN];
        for i in 0..=acked {
            assert!(
                read_back(&store, seed, i, &mut dst),
                "round {round}: acknowledged block {i} of {acked} lost"
            );
        }
        // The one PUT in flight at the kill is either whole or absent; nothing past it exists.
        read_back(&store, seed, acked + 1, &mut dst);
        assert!(
            !read_back(&store, seed, acked + 2, &mut dst),
            "round {round}: a block never written"
        );
        assert!(
            store.counters().file_hits > u64::from(acked),
            "round {round}: after a restart memory starts empty, so the file tier served them"
        );
    }
}

/// Writing back, a PUT is acknowledged once memory holds it; its block is durable once it has
/// been demoted or flushed. kill -9 at any point of that loses no flushed block, serves no
/// torn one, and keeps the blocks demoted since the last flush.
#[test]
fn kill_9_while_writing_back_loses_nothing_flushed_and_keeps_what_was_demoted() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("current exe");
    let mut kept_past_flush = 0;
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir().expect("temp dir");
        let seed = 0xB4C0_0000 + round;
        let heard = crash_round(&exe, dir.path(), seed, WriteMode::Back);
        let (acked, flushed) = (heard.acked.expect("some acks"), heard.flushed);
        let store = crash_store(dir.path(), WriteMode::Back);
        let mut dst = vec![0u8; 64 * KIB_LEN];
        if let Some(f) = flushed {
            for i in 0..=f {
                assert!(
                    read_back(&store, seed, i, &mut dst),
                    "round {round}: flushed block {i} (of {f}) lost"
                );
            }
        }
        let after = flushed.map_or(0, |f| f + 1);
        for i in after..=acked + 1 {
            kept_past_flush += u32::from(read_back(&store, seed, i, &mut dst));
        }
        assert!(
            !read_back(&store, seed, acked + 2, &mut dst),
            "round {round}: a block never written"
        );
        assert_eq!(store.file().deferred_blocks(), vec![], "a restart knows only written blocks");
    }
    // Memory holds about five of these blocks: most blocks written after a flush were demoted
    // (written down) before the kill.
    assert!(kept_past_flush > 0, "no block demoted after a flush survived a kill");
}

#[test]
fn writing_back_a_block_waits_in_memory_until_it_is_evicted_or_flushed() {
    use gpucache_storage::tiered::Tier;
    let dir = tempfile::tempdir().expect("temp dir");
    let (k0, k1, k2) = (block_key(0), block_key(1), block_key(2));
    let (a, b, c) = (payload(1, 4 * KIB_LEN), payload(2, 4 * KIB_LEN), payload(3, 4 * KIB_LEN));
    let lim = limits(1 << 20, 1 << 20);
    {
        // Memory holds two 4 KiB blocks.
        let store =
            open_writing(dir.path(), lim.clone(), 8 * KIB, Durability::PerBlock, WriteMode::Back);
        for (k, v) in [(&k0, &a), (&k1, &b)] {
            assert!(matches!(store.put(&caller(0), k, v, None), Ok(Put::Committed(_))));
        }
        // Committed in the file tier's books, with no file yet.
        assert!(store.file().is_deferred(&k0) && store.file().is_deferred(&k1));
        assert!(store.file().block_location(&k0).is_none());
        let tiers: Vec<_> = store
            .locate(&caller(0), &[&k0, &k1, &k2])
            .into_iter()
            .map(|l| l.expect("lookup"))
            .map(|l| (l.lookup, l.tier))
            .collect();
        assert!(
            matches!(
                tiers[0],
                (gpucache_dataplane::store::Lookup::Hit { len: 4096 }, Some(Tier::Memory))
            ),
            "{tiers:?}"
        );
        assert!(
            matches!(tiers[2], (gpucache_dataplane::store::Lookup::Miss(_), None)),
            "{tiers:?}"
        );
        // A third block evicts the oldest from memory, which writes it down.
        assert!(matches!(store.put(&caller(0), &k2, &c, None), Ok(Put::Committed(_))));
        let down: Vec<bool> = [&k0, &k1, &k2].iter().map(|k| store.file().is_deferred(k)).collect();
        assert_eq!(down.iter().filter(|d| !**d).count(), 1, "one block was demoted: {down:?}");
        let counters = store.counters();
        assert_eq!(
            (counters.written_back, counters.demotions, counters.write_back_lost),
            (1, 1, 0)
        );
        let demoted = [&k0, &k1, &k2]
            .into_iter()
            .zip(&down)
            .find(|(_, d)| !**d)
            .map(|(k, _)| k)
            .expect("one");
        let tiers = store.locate(&caller(0), &[demoted]);
        assert_eq!(
            tiers[0].as_ref().expect("lookup").tier,
            Some(Tier::File),
            "a demoted block is in the file tier only"
        );
        // Closing the store writes the other two down.
    }
    let store = open_writing(dir.path(), lim, 8 * KIB, Durability::PerBlock, WriteMode::Back);
    let mut dst = vec![0u8; 4 * KIB_LEN];
    for (k, v) in [(&k0, &a), (&k1, &b), (&k2, &c)] {
        let got = store.get_into(&caller(0), k, &mut dst).expect("get");
        assert!(matches!(got, Get::Hit { .. }) && dst == *v, "{got:?}");
    }
}

#[test]
fn a_damaged_only_copy_is_a_corrupt_miss_and_leaves_the_books() {
    use gpucache_dataplane::store::{Lookup, MissReason};
    let dir = shm_dir();
    let store = open_writing(
        dir.path(),
        limits(1 << 20, 1 << 20),
        64 * KIB,
        Durability::None,
        WriteMode::Back,
    );
    let k = block_key(0);
    store.put(&caller(0), &k, &payload(1, 4 * KIB_LEN), None).expect("put");
    assert!(store.corrupt_for_test(&k, 99), "the memory copy is there to damage");
    let mut dst = vec![0u8; 4 * KIB_LEN];
    let got = store.get_into(&caller(0), &k, &mut dst).expect("get");
    assert_eq!(got, Get::Miss(MissReason::Corrupt));
    assert!(dst.iter().all(|b| *b == 0), "no damaged byte reached the caller");
    assert!(
        matches!(store.lookup(&caller(0), &k).expect("lookup"), Lookup::Miss(_)),
        "the books let it go"
    );
    let stats = store.stats();
    assert_eq!((stats.committed_blocks, stats.corrupt_dropped.total()), (0, 1));
    assert_eq!(store.counters().write_back_lost, 1);
    // The key can be written again.
    assert!(matches!(
        store.put(&caller(0), &k, &payload(2, 4 * KIB_LEN), None),
        Ok(Put::Committed(_))
    ));
}

#[test]
fn a_memory_tier_on_huge_pages_holds_its_blocks_in_the_pool() {
    use gpucache_storage::tiered::TierMemory;
    let dir = shm_dir();
    let mut file = FileStoreConfig::new(dir.path());
    file.engine = EngineChoice::Psync;
    file.durability = Durability::None;
    file.limits = limits(1 << 20, 1 << 20);
    let memory = MemoryTier {
        backing: TierMemory::HugePages,
        ..MemoryTier::new(256 * KIB, PolicyKind::Prefix)
    };
    let store = TieredStore::open(file, memory, Arc::new(ManualClock::default())).expect("opens");
    let data = payload(4, 8 * KIB_LEN);
    store.put(&caller(0), &block_key(0), &data, None).expect("put");
    let arena = store.memory().arena_stats().expect("the memory tier has an arena");
    assert_eq!(arena.lent_bytes, 8 * KIB, "the block's copy is in the pool");
    let mut dst = vec![0u8; 8 * KIB_LEN];
    let (got, tier) = store.get_with_tier(&caller(0), &block_key(0), &mut dst).expect("get");
    assert!(matches!(got, Get::Hit { .. }) && dst == data, "{got:?}");
    assert_eq!(tier, Some(gpucache_storage::tiered::Tier::Memory));
}

/// A one-key GET asks each tier once and says how it went: a memory copy of the version the
/// file tier holds is lent; without one the file tier's copy lands in the caller's buffer and
/// is promoted; a key neither holds is a miss. The tier counters move by exactly one each time.
#[test]
fn a_one_key_get_asks_each_tier_once_and_says_how_it_delivered() {
    use gpucache_dataplane::store::{Delivery, GotOne, MissReason, Tier};
    use gpucache_dataplane::testing::fixture::Deliver;
    let dir = shm_dir();
    let store = open(dir.path(), limits(1 << 20, 1 << 20), 64 * KIB, Durability::None);
    let data = payload(7, 3 * KIB_LEN);
    let sum = Checksum::of(&data);
    store.put(&caller(0), &block_key(0), &data, None).expect("put");
    let get = |key: &PhysicalKey| {
        let mut lent = Vec::new();
        let mut to = Deliver {
            lend: |bytes: &[u8], _| {
                lent.extend_from_slice(bytes);
                Some(Checksum::of(bytes))
            },
            copy: vec![0u8; 4 * KIB_LEN],
        };
        let got = store.get_one(&caller(0), key, 4 * KIB_LEN, &mut to).expect("get");
        let copied = to.copy;
        (got, lent, copied)
    };
    let hit = Get::Hit { len: data.len() as u64, checksum: sum };
    let before = store.counters();
    let (got, lent, _) = get(&block_key(0));
    assert_eq!(got, GotOne { get: hit, delivery: Delivery::Lent, tier: Some(Tier::Memory) });
    assert_eq!(lent, data);
    assert_eq!(store.counters().memory_hits, before.memory_hits + 1);
    assert_eq!(store.counters().file_hits, before.file_hits);

    // Only the file tier holds it now: copied into the buffer, counted once, promoted.
    let removed = store.memory().invalidate(&caller(0), &block_key(0)).expect("drop");
    assert_eq!(removed, Invalidate::Removed);
    let (got, lent, copied) = get(&block_key(0));
    assert_eq!(got, GotOne { get: hit, delivery: Delivery::Copied, tier: Some(Tier::File) });
    assert!(lent.is_empty());
    assert_eq!(&copied[..data.len()], &data[..]);
    let after = store.counters();
    assert_eq!((after.file_hits, after.promotions), (before.file_hits + 1, before.promotions + 1));
    assert_eq!(after.memory_hits, before.memory_hits + 1);
    let (got, _, _) = get(&block_key(0));
    assert_eq!(got.delivery, Delivery::Lent, "the promoted copy is lent next");

    let (got, lent, _) = get(&block_key(9));
    assert_eq!(
        got,
        GotOne { get: Get::Miss(MissReason::Absent), delivery: Delivery::Copied, tier: None }
    );
    assert!(lent.is_empty());
    assert_eq!(store.counters().misses, before.misses + 1);
}

/// A block the memory tier takes as already verified (a copy-up or a write-through) is still
/// checked on every read: bytes that do not match the checksum it was committed under are a
/// corrupt miss, never a hit, however they are read.
#[test]
fn bytes_taken_as_verified_that_do_not_match_are_a_corrupt_miss() {
    use gpucache_dataplane::store::MissReason;
    let dir = shm_dir();
    let store = open(dir.path(), limits(1 << 20, 1 << 20), 64 * KIB, Durability::None);
    let memory = store.memory();
    let data = payload(8, 2 * KIB_LEN);
    let wrong = Checksum(Checksum::of(&data).0 ^ 1);
    let put = memory.put_verified(&caller(0), &block_key(1), &data, wrong).expect("put");
    assert_eq!(put, Put::Committed(wrong));
    let mut dst = vec![0u8; data.len()];
    let got = memory.get_into(&caller(0), &block_key(1), &mut dst).expect("get");
    assert_eq!(got, Get::Miss(MissReason::Corrupt));
    memory.put_verified(&caller(0), &block_key(2), &data, wrong).expect("put");
    let lent =
        get_lent(memory, &caller(0), &block_key(2), data.len(), |b, _| Some(Checksum::of(b)));
    assert_eq!(lent, Ok(Some(Get::Miss(MissReason::Corrupt))));
}

/// A FileStore asks the kernel for its free space once as it opens, then keeps its own
/// account: a hundred PUTs well under the recount mark ask nothing more.
#[test]
fn puts_do_not_ask_the_kernel_for_free_space() {
    let dir = shm_dir();
    let mut config = FileStoreConfig::new(dir.path());
    config.durability = Durability::None;
    let file = config.open(Arc::new(ManualClock::default())).expect("file store");
    assert_eq!(file.free_space_counts(), 1);
    for k in 0..100u8 {
        let put = file.put(&caller(0), &block_key(k), &payload(u64::from(k), 4 * KIB_LEN), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    }
    assert_eq!(file.free_space_counts(), 1);
}
