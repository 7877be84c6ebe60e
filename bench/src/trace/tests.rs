use std::path::PathBuf;
use std::sync::Arc;

use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::identity::TenantId;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::rng::SplitMix64;
use gpucache_dataplane::store::{Get, Store, StoreError, StoreLayer};
use gpucache_storage::MemoryStore;
use gpucache_storage::evict::PolicyKind;

use super::*;

/// Small blocks keep the debug-build tests fast; the replay logic does not depend on the size.
const BLOCK: u64 = 256;
const BLOCK_USIZE: usize = 256;

fn caller() -> Caller {
    Caller::new(
        TenantId::parse(replay::TENANT).unwrap_or_else(|e| panic!("{e}")),
        Rights::READ_WRITE,
    )
}

fn store(policy: PolicyKind, blocks: u64, trace: &Trace) -> MemoryStore {
    MemoryStore::evicting(
        limits_for(BLOCK, blocks, trace.unique_blocks()),
        Arc::new(MonotonicClock::default()),
        policy,
    )
    .unwrap_or_else(|e| panic!("limits: {e}"))
}

fn run(store: &dyn Store, trace: &Trace) -> Replay {
    let mut out = replay(&[store], &caller(), trace, "test", BLOCK_USIZE, &mut |_| {});
    out.pop().unwrap_or_else(|| panic!("one store, no replay"))
}

fn policy(name: &str) -> PolicyKind {
    name.parse().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_handmade_trace_gives_its_prefix_hits_with_room_for_everything() {
    // Blocks (chains): [1] [1,2] [1,2,3] [1,2,4] [1,5] [1,2,3,6] [7]: 7 distinct.
    // Request 1 hits nothing (3 refs); request 2 hits 1,2 then misses 4 (2 of 3); request 3
    // hits 1, misses 5 (1 of 2); request 4 hits 1,2,3, misses 6 (3 of 4); request 5 misses 7.
    // 6 hits of 13 references, whatever the policy, since nothing is evicted.
    let t = Trace::from_ids(
        "hand",
        [vec![1, 2, 3], vec![1, 2, 4], vec![1, 5], vec![1, 2, 3, 6], vec![7]],
    );
    assert_eq!(t.unique_blocks(), 7);
    for &p in PolicyKind::ALL {
        let r = run(&store(p, 7, &t), &t);
        assert_eq!((r.hits, r.refs), (6, 13), "{p}");
        assert!(r.clean(), "{p}: {r:?}");
        // 7 distinct blocks committed once each; the 13 - 6 - 7 = 0 others were resident.
        assert_eq!(r.puts_committed, 7, "{p}");
        assert_eq!(r.verified_get_bytes, 6 * BLOCK, "{p}");
    }
    assert_eq!(belady(&t, 7), Outcome { hits: 6, refs: 13 });
    assert_eq!(lru(&t, 7), Outcome { hits: 6, refs: 13 });
}

#[test]
fn at_two_blocks_lru_keeps_the_block_it_read_and_fifo_does_not() {
    // [1] [2] [1] [3] [1], room for two blocks. LRU: 1, 2 stored; 1 hits and is touched; 3
    // evicts 2; 1 hits again: 2 of 5. FIFO: 3 evicts 1, the oldest commit, so the last 1
    // misses: 1 of 5. Belady: 2 and 3 are never used again, so 1 stays: 2 of 5.
    let t = Trace::from_ids("two", [vec![1], vec![2], vec![1], vec![3], vec![1]]);
    let r = run(&store(policy("lru"), 2, &t), &t);
    assert_eq!((r.hits, r.refs), (2, 5));
    assert!(r.clean(), "{r:?}");
    let r = run(&store(policy("fifo"), 2, &t), &t);
    assert_eq!((r.hits, r.refs), (1, 5));
    assert!(r.clean(), "{r:?}");
    assert_eq!(lru(&t, 2), Outcome { hits: 2, refs: 5 });
    assert_eq!(belady(&t, 2), Outcome { hits: 2, refs: 5 });
}

/// A store that damages one byte of every hit it returns, after the inner store verified it.
struct Flipping(MemoryStore);

impl StoreLayer for Flipping {
    type Inner = MemoryStore;
    fn inner(&self) -> &MemoryStore {
        &self.0
    }
}

impl Store for Flipping {
    fn get_into(
        &self,
        caller: &Caller,
        key: &PhysicalKey,
        dst: &mut [u8],
    ) -> Result<Get, StoreError> {
        let got = self.0.get_into(caller, key, dst);
        if let (Ok(Get::Hit { .. }), Some(b)) = (&got, dst.first_mut()) {
            *b ^= 0x01;
        }
        got
    }
    gpucache_dataplane::forward_store!(
        fences, reports, info, lookup, reserve, write, commit, abort, invalidate, scope_keys
    );
}

#[test]
fn a_damaged_hit_is_a_mismatch_never_a_hit() {
    // Request 2's first GET finds [1] but with a flipped byte: a mismatch that ends the
    // prefix; both of its blocks are then PUT and answered AlreadyCommitted.
    let t = Trace::from_ids("bad", [vec![1, 2], vec![1, 2]]);
    let r = run(&Flipping(store(policy("lru"), 4, &t)), &t);
    assert_eq!((r.hits, r.refs, r.mismatches), (0, 4, 1));
    assert_eq!((r.puts_committed, r.puts_already_committed), (2, 2));
    assert_eq!(r.verified_get_bytes, 0);
    assert!(!r.clean());
}

/// A prefix-tree trace: each request picks one of `roots` shared system prompts, then one of a
/// few continuations, then fresh blocks of its own, so that reuse is partial and skewed.
fn generated(requests: usize, seed: u64) -> Trace {
    let mut rng = SplitMix64::new(seed);
    let mut fresh = 1_000_000u64;
    let reqs = (0..requests).map(|_| {
        let root = rng.next_u64() % 8;
        let branch = rng.next_u64() % 16;
        let own = 1 + rng.next_u64() % 6;
        let mut ids = vec![root, 100 + root * 16 + branch];
        if rng.next_u64().is_multiple_of(2) {
            ids.push(10_000 + (root * 16 + branch) * 4 + rng.next_u64() % 4);
        }
        for _ in 0..own {
            ids.push(fresh);
            fresh += 1;
        }
        ids
    });
    Trace::from_ids("generated", reqs.collect::<Vec<_>>())
}

fn belady_bounds_every_policy(t: &Trace, capacity: Capacity) {
    let blocks = capacity.blocks(t.unique_blocks(), BLOCK);
    let bound = belady(t, blocks);
    assert!(bound.hits >= lru(t, blocks).hits, "{}: LRU-offline beat Belady", t.name);
    let stores: Vec<MemoryStore> = PolicyKind::ALL.iter().map(|&p| store(p, blocks, t)).collect();
    let dyns: Vec<&dyn Store> = stores.iter().map(|s| s as &dyn Store).collect();
    let replays = replay(&dyns, &caller(), t, "test", BLOCK_USIZE, &mut |_| {});
    assert_eq!(replays.len(), PolicyKind::ALL.len());
    for (&p, r) in PolicyKind::ALL.iter().zip(replays) {
        assert!(r.clean(), "{} {p}: {r:?}", t.name);
        assert_eq!(r.refs, bound.refs);
        assert!(
            bound.hits >= r.hits,
            "{} at {} blocks: {p} replay hit {} > Belady {}",
            t.name,
            blocks,
            r.hits,
            bound.hits
        );
    }
}

#[test]
fn belady_bounds_every_policy_on_a_generated_trace() {
    let t = generated(1500, 0x5eed);
    for c in ["2%", "5%", "20%"] {
        belady_bounds_every_policy(&t, Capacity::parse(c).unwrap_or_else(|e| panic!("{e}")));
    }
}

#[test]
fn the_offline_lru_agrees_with_the_store_lru() {
    let t = generated(1000, 7);
    for c in ["3%", "10%"] {
        let blocks =
            Capacity::parse(c).unwrap_or_else(|e| panic!("{e}")).blocks(t.unique_blocks(), BLOCK);
        let r = run(&store(policy("lru"), blocks, &t), &t);
        assert_eq!(r.hits, lru(&t, blocks).hits, "at {blocks} blocks");
    }
}

/// The shared traces' directory: `GPUCACHE_TRACES_DIR`, else /work/shared/traces.
fn shared_trace(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("GPUCACHE_TRACES_DIR")
        .map_or_else(|| PathBuf::from("/work/shared/traces"), PathBuf::from);
    let path = dir.join(name);
    if path.is_file() {
        return Some(path);
    }
    let why = format!("{} is missing (set GPUCACHE_TRACES_DIR)", path.display());
    assert!(std::env::var("GPUCACHE_REQUIRE_TRACES").as_deref() != Ok("1"), "{why}");
    eprintln!("skipped: {why}");
    None
}

#[test]
fn belady_bounds_every_policy_on_the_shared_traces() {
    // One thread per trace: the debug build's store calls are slow enough to be worth two.
    std::thread::scope(|scope| {
        for name in ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"] {
            let Some(path) = shared_trace(name) else { continue };
            scope.spawn(move || {
                let t = Trace::read(&path, Some(2000)).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(t.requests.len(), 2000);
                belady_bounds_every_policy(&t, Capacity::Fraction(0.05));
            });
        }
    });
}

#[test]
fn capacities_and_policies_parse_and_refuse_nonsense() {
    assert_eq!(Capacity::parse("5%"), Ok(Capacity::Fraction(0.05)));
    assert_eq!(Capacity::parse("64MiB").map(|c| c.blocks(10, 4096)), Ok(16384));
    assert_eq!(Capacity::Fraction(0.05).blocks(43_924, 4096), 2196);
    assert_eq!(Capacity::Fraction(0.001).blocks(10, 4096), 1);
    assert_eq!(Capacity::Fraction(0.125).label(), "12.5%");
    for bad in ["0%", "101%", "x", "0", "-5%"] {
        assert!(Capacity::parse(bad).is_err(), "{bad}");
    }
    assert!(Capacity::parse_list(" , ").is_err());
    assert_eq!(parse_policies("all"), Ok(PolicyKind::ALL.to_vec()));
    assert_eq!(parse_policies("lru,lru"), Ok(vec![policy("lru")]));
    assert!(parse_policies("lru,mru").is_err_and(|e| e.contains("mru")));
}

#[test]
fn the_table_and_chart_show_every_series() {
    let t = Trace::from_ids("tiny", [vec![1, 2], vec![1, 3], vec![1, 2]]);
    let mut rows = Vec::new();
    for cap in ["50%", "100%"] {
        let c = Capacity::parse(cap).unwrap_or_else(|e| panic!("{e}"));
        let blocks = c.blocks(t.unique_blocks(), BLOCK);
        for &p in PolicyKind::ALL {
            rows.push(Row {
                trace: t.name.clone(),
                capacity: c.label(),
                capacity_blocks: Some(blocks),
                policy: Some(p.name().into()),
                replay: Some(run(&store(p, blocks, &t), &t)),
                belady: Some(belady(&t, blocks)),
                lru_offline: Some(lru(&t, blocks)),
                vs_best: Some(1.0),
                tiers: None,
            });
        }
    }
    let text = report::table(&rows);
    assert_eq!(text.lines().count(), 1 + rows.len());
    assert!(text.contains("Belady") && text.contains("s3-fifo"), "{text}");
    let caps = vec!["50%".to_owned(), "100%".to_owned()];
    let svg = report::svg(&rows, &caps, "a <title>");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("a &lt;title&gt;"));
    let series = PolicyKind::ALL.len() + 2;
    assert_eq!(svg.matches("<polyline class=\"series\"").count(), series);
    assert_eq!(svg.matches("<circle class=\"point\"").count(), series * caps.len());
    // At 100% (3 blocks) request 3 hits [1] and [1,2]; request 2 hits [1]: 3 of 6.
    assert!(
        svg.contains("data-series=\"belady\" data-capacity=\"100%\" data-ratio=\"0.5000\""),
        "{svg}"
    );
}

#[test]
fn a_tiered_store_gives_the_file_tiers_hits_and_says_which_tier_served_them() {
    use gpucache_storage::file::{Durability, FileStoreConfig};
    use gpucache_storage::tiered::{MemoryTier, TieredStore, WriteMode};
    // The handmade trace of the first test, room for every block in the file tier and for one
    // block in memory: the same 6 hits of 13, split between the tiers.
    let t = Trace::from_ids(
        "hand",
        [vec![1, 2, 3], vec![1, 2, 4], vec![1, 5], vec![1, 2, 3, 6], vec![7]],
    );
    for write in [WriteMode::Through, WriteMode::Back] {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut file = FileStoreConfig::new(dir.path());
        file.durability = Durability::None;
        file.limits = limits_for(BLOCK, 7, t.unique_blocks());
        file.policy = policy("lru");
        let memory = MemoryTier { write, ..MemoryTier::new(BLOCK, policy("lru")) };
        let store = TieredStore::open(file, memory, Arc::new(MonotonicClock::default()))
            .unwrap_or_else(|e| panic!("{e}"));
        let r = run(&store, &t);
        assert_eq!((r.hits, r.refs), (6, 13), "{write}");
        assert!(r.clean(), "{write}: {r:?}");
        let c = store.counters();
        assert_eq!(c.memory_hits + c.file_hits, 6, "{write}: {c:?}");
        // With room for one block, memory holds the last block written or read: request 2's
        // first hit (block [1]) was written by request 1 three blocks earlier, so it came from
        // the file.
        assert!(c.file_hits >= 1 && c.promotions == c.file_hits, "{write}: {c:?}");
        // Writing back, every block memory gave up had to be written down to be hit later.
        assert_eq!(c.written_back > 0, write == WriteMode::Back, "{write}: {c:?}");
        assert_eq!(c.write_back_lost, 0, "{write}: {c:?}");
    }
}
