//! Each policy against a plain reference model: the same events, the same victims.

use proptest::prelude::*;

use super::*;

/// An event of a generated workload. Indexes pick among the blocks resident at that step.
#[derive(Debug, Clone)]
pub(super) enum Event {
    Insert {
        name: u64,
        len: u64,
    },
    Hit(usize),
    Remove(usize),
    /// Asks for a victim; blocks whose id is divisible by `skip` (when not 0) are not eligible,
    /// and the victim is then evicted.
    Evict {
        skip: u64,
    },
}

pub(super) fn events(names: u64) -> impl Strategy<Value = Vec<Event>> {
    let event = prop_oneof![
        4 => (0..names, 1u64..4).prop_map(|(name, len)| Event::Insert { name, len }),
        3 => any::<usize>().prop_map(Event::Hit),
        1 => any::<usize>().prop_map(Event::Remove),
        2 => prop_oneof![Just(0u64), 2u64..5].prop_map(|skip| Event::Evict { skip }),
    ];
    proptest::collection::vec(event, 1..200)
}

/// What a reference model must answer.
pub(super) trait Reference {
    fn insert(&mut self, b: &BlockFacts);
    fn hit(&mut self, id: BlockId);
    fn remove(&mut self, id: BlockId, why: Removal);
    fn victim(&mut self, eligible: &dyn Fn(BlockId) -> bool) -> Option<BlockId>;
    /// Entries kept for blocks that left.
    fn ghosts(&self) -> usize {
        0
    }
}

/// Drives `policy` and `model` through `events` and fails at the first different victim.
pub(super) fn agree(
    policy: &mut dyn EvictionPolicy,
    model: &mut dyn Reference,
    events: &[Event],
) -> Result<(), TestCaseError> {
    let mut resident: Vec<BlockId> = Vec::new();
    let mut names: std::collections::HashMap<u64, BlockId> = Default::default();
    let mut next_id = 1;
    for (step, e) in events.iter().enumerate() {
        match e {
            Event::Insert { name, len } => {
                if names.contains_key(name) {
                    continue;
                }
                let b = BlockFacts {
                    id: next_id,
                    name: *name,
                    parent: None,
                    depth: 1,
                    partial: false,
                    tenant: 0,
                    len: *len,
                    seq: next_id,
                    request: None,
                };
                next_id += 1;
                policy.insert(&b);
                model.insert(&b);
                resident.push(b.id);
                names.insert(*name, b.id);
            }
            Event::Hit(i) if !resident.is_empty() => {
                let id = resident[i % resident.len()];
                policy.hit(id);
                model.hit(id);
            }
            Event::Remove(i) if !resident.is_empty() => {
                let id = resident.remove(i % resident.len());
                names.retain(|_, v| *v != id);
                policy.remove(id, Removal::Invalidated);
                model.remove(id, Removal::Invalidated);
            }
            Event::Evict { skip } => {
                let ok = |id: BlockId| *skip == 0 || !id.is_multiple_of(*skip);
                let got = policy.victim(&mut |id| ok(id));
                let want = model.victim(&ok);
                prop_assert_eq!(got, want, "victim at step {}", step);
                if let Some(id) = got {
                    prop_assert!(resident.contains(&id), "victim {} is not resident", id);
                    resident.retain(|r| *r != id);
                    names.retain(|_, v| *v != id);
                    policy.remove(id, Removal::Evicted);
                    model.remove(id, Removal::Evicted);
                }
            }
            _ => {}
        }
        prop_assert_eq!(policy.resident(), resident.len(), "resident count at step {}", step);
        prop_assert_eq!(policy.ghosts(), model.ghosts(), "ghost count at step {}", step);
    }
    Ok(())
}

/// Oldest insert first.
#[derive(Default)]
struct FifoModel(Vec<BlockId>);

impl Reference for FifoModel {
    fn insert(&mut self, b: &BlockFacts) {
        self.0.push(b.id);
    }
    fn hit(&mut self, _id: BlockId) {}
    fn remove(&mut self, id: BlockId, _why: Removal) {
        self.0.retain(|x| *x != id);
    }
    fn victim(&mut self, eligible: &dyn Fn(BlockId) -> bool) -> Option<BlockId> {
        self.0.iter().copied().find(|id| eligible(*id))
    }
}

/// Least recent use first; a hit moves a block to the back.
#[derive(Default)]
struct LruModel(Vec<BlockId>);

impl Reference for LruModel {
    fn insert(&mut self, b: &BlockFacts) {
        self.0.push(b.id);
    }
    fn hit(&mut self, id: BlockId) {
        if let Some(p) = self.0.iter().position(|x| *x == id) {
            self.0.remove(p);
            self.0.push(id);
        }
    }
    fn remove(&mut self, id: BlockId, _why: Removal) {
        self.0.retain(|x| *x != id);
    }
    fn victim(&mut self, eligible: &dyn Fn(BlockId) -> bool) -> Option<BlockId> {
        self.0.iter().copied().find(|id| eligible(*id))
    }
}

/// ARC as plain lists, oldest first. Resident entries are (id, name, len), ghosts (name, len).
struct ArcModel {
    capacity: u64,
    ghosts_max: usize,
    p: u64,
    t1: Vec<(BlockId, u64, u64)>,
    t2: Vec<(BlockId, u64, u64)>,
    b1: Vec<(u64, u64)>,
    b2: Vec<(u64, u64)>,
}

impl ArcModel {
    fn new(capacity: u64, ghosts_max: usize) -> Self {
        Self { capacity, ghosts_max, p: 0, t1: vec![], t2: vec![], b1: vec![], b2: vec![] }
    }
}

fn ghost_bytes(list: &[(u64, u64)]) -> u64 {
    list.iter().map(|g| g.1).sum()
}

impl Reference for ArcModel {
    fn insert(&mut self, b: &BlockFacts) {
        let (in_b1, in_b2) = (ghost_bytes(&self.b1), ghost_bytes(&self.b2));
        let weight = b.len.max(1);
        let entry = (b.id, b.name, b.len);
        if let Some(i) = self.b1.iter().position(|g| g.0 == b.name) {
            let ratio = in_b2.checked_div(in_b1).unwrap_or(1).max(1);
            self.p = (self.p + ratio * weight).min(self.capacity);
            self.b1.remove(i);
            self.t2.push(entry);
        } else if let Some(i) = self.b2.iter().position(|g| g.0 == b.name) {
            let ratio = in_b1.checked_div(in_b2).unwrap_or(1).max(1);
            self.p = self.p.saturating_sub(ratio * weight);
            self.b2.remove(i);
            self.t2.push(entry);
        } else {
            self.t1.push(entry);
        }
    }
    fn hit(&mut self, id: BlockId) {
        if let Some(i) = self.t1.iter().position(|e| e.0 == id) {
            let e = self.t1.remove(i);
            self.t2.push(e);
        } else if let Some(i) = self.t2.iter().position(|e| e.0 == id) {
            let e = self.t2.remove(i);
            self.t2.push(e);
        }
    }
    fn remove(&mut self, id: BlockId, why: Removal) {
        let (e, seen_again) = if let Some(i) = self.t1.iter().position(|e| e.0 == id) {
            (self.t1.remove(i), false)
        } else if let Some(i) = self.t2.iter().position(|e| e.0 == id) {
            (self.t2.remove(i), true)
        } else {
            return;
        };
        if why != Removal::Evicted {
            return;
        }
        self.b1.retain(|g| g.0 != e.1);
        self.b2.retain(|g| g.0 != e.1);
        if seen_again {
            self.b2.push((e.1, e.2))
        } else {
            self.b1.push((e.1, e.2))
        }
        loop {
            let (n1, n2) = (ghost_bytes(&self.b1), ghost_bytes(&self.b2));
            if n1 + n2 <= self.capacity && self.b1.len() + self.b2.len() <= self.ghosts_max {
                break;
            }
            if (n1, self.b1.len()) >= (n2, self.b2.len()) {
                self.b1.remove(0);
            } else {
                self.b2.remove(0);
            }
        }
    }
    fn victim(&mut self, eligible: &dyn Fn(BlockId) -> bool) -> Option<BlockId> {
        let t1_bytes: u64 = self.t1.iter().map(|e| e.2).sum();
        let (first, second) =
            if t1_bytes > self.p { (&self.t1, &self.t2) } else { (&self.t2, &self.t1) };
        first.iter().chain(second.iter()).map(|e| e.0).find(|id| eligible(*id))
    }
    fn ghosts(&self) -> usize {
        self.b1.len() + self.b2.len()
    }
}

#[derive(Clone, Copy)]
struct Queued {
    id: BlockId,
    name: u64,
    len: u64,
    reads: u8,
}

/// S3-FIFO as plain lists, head first.
struct S3FifoModel {
    capacity: u64,
    ghosts_max: usize,
    small: Vec<Queued>,
    main: Vec<Queued>,
    ghost: Vec<(u64, u64)>,
}

impl S3FifoModel {
    fn new(capacity: u64, ghosts_max: usize) -> Self {
        Self { capacity, ghosts_max, small: vec![], main: vec![], ghost: vec![] }
    }

    /// Walks the main queue (or the small one) from its head: a read block goes to the main
    /// queue's tail with one read less (or none), the first unread eligible block is the victim.
    fn walk(&mut self, main: bool, eligible: &dyn Fn(BlockId) -> bool) -> Option<BlockId> {
        let mut i = 0;
        loop {
            let list = if main { &mut self.main } else { &mut self.small };
            let q = *list.get(i)?;
            if !eligible(q.id) {
                i += 1;
                continue;
            }
            if q.reads == 0 {
                return Some(q.id);
            }
            list.remove(i);
            let reads = if main { q.reads - 1 } else { 0 };
            self.main.push(Queued { reads, ..q });
        }
    }
}

impl Reference for S3FifoModel {
    fn insert(&mut self, b: &BlockFacts) {
        let q = Queued { id: b.id, name: b.name, len: b.len, reads: 0 };
        if let Some(i) = self.ghost.iter().position(|g| g.0 == b.name) {
            self.ghost.remove(i);
            self.main.push(q);
        } else {
            self.small.push(q);
        }
    }
    fn hit(&mut self, id: BlockId) {
        if let Some(q) = self.small.iter_mut().chain(self.main.iter_mut()).find(|q| q.id == id) {
            q.reads = (q.reads + 1).min(3);
        }
    }
    fn remove(&mut self, id: BlockId, why: Removal) {
        self.main.retain(|q| q.id != id);
        let Some(i) = self.small.iter().position(|q| q.id == id) else { return };
        let q = self.small.remove(i);
        if why == Removal::Evicted {
            self.ghost.retain(|g| g.0 != q.name);
            self.ghost.push((q.name, q.len));
            let bytes_max = self.capacity - self.capacity / 10;
            while ghost_bytes(&self.ghost) > bytes_max || self.ghost.len() > self.ghosts_max {
                self.ghost.remove(0);
            }
        }
    }
    fn victim(&mut self, eligible: &dyn Fn(BlockId) -> bool) -> Option<BlockId> {
        let small_bytes: u64 = self.small.iter().map(|q| q.len).sum();
        if small_bytes >= self.capacity / 10 || !self.main.iter().any(|q| eligible(q.id)) {
            self.walk(false, eligible).or_else(|| self.walk(true, eligible))
        } else {
            self.walk(true, eligible).or_else(|| self.walk(false, eligible))
        }
    }
    fn ghosts(&self) -> usize {
        self.ghost.len()
    }
}

proptest! {
    #[test]
    fn fifo_matches_its_model(events in events(40)) {
        agree(&mut Fifo::default(), &mut FifoModel::default(), &events)?;
    }

    #[test]
    fn lru_matches_its_model(events in events(40)) {
        agree(&mut Lru::default(), &mut LruModel::default(), &events)?;
    }

    #[test]
    fn arc_matches_its_model(events in events(16), capacity in 0u64..40, ghosts_max in 1usize..12) {
        let mut policy = AdaptiveReplacement::new(capacity);
        policy.ghost_entries_max = ghosts_max;
        agree(&mut policy, &mut ArcModel::new(capacity, ghosts_max), &events)?;
    }

    /// Without chains or partial blocks, the prefix policy is ARC exactly.
    #[test]
    fn prefix_without_chains_or_partial_blocks_is_arc(
        events in events(16), capacity in 0u64..40, ghosts_max in 1usize..12,
    ) {
        let mut policy = PrefixAware::new(capacity);
        policy.arc.ghost_entries_max = ghosts_max;
        agree(&mut policy, &mut ArcModel::new(capacity, ghosts_max), &events)?;
    }

    #[test]
    fn s3fifo_matches_its_model(events in events(16), capacity in 0u64..40, ghosts_max in 1usize..12) {
        let mut policy = S3Fifo::new(capacity);
        policy.ghost_entries_max = ghosts_max;
        agree(&mut policy, &mut S3FifoModel::new(capacity, ghosts_max), &events)?;
    }
}

#[test]
fn names_round_trip_and_unknown_names_are_refused() {
    for kind in PolicyKind::ALL {
        assert_eq!(kind.name().parse::<PolicyKind>(), Ok(*kind));
        assert_eq!(kind.build(1 << 20).kind(), *kind);
    }
    let err = "mru".parse::<PolicyKind>().unwrap_err();
    assert_eq!(err.given, "mru");
    assert!(err.known.contains("lru"), "{err}");
}

/// A store that holds at most `capacity` bytes and, before each commit, evicts the policy's
/// victims until the block fits: how the catalog drives a policy.
struct Store {
    policy: Box<dyn EvictionPolicy>,
    capacity: u64,
    held: std::collections::HashMap<BlockId, u64>,
    next_id: BlockId,
}

impl Store {
    fn new(policy: Box<dyn EvictionPolicy>, capacity: u64) -> Self {
        Self { policy, capacity, held: Default::default(), next_id: 1 }
    }

    fn commit(&mut self, name: u64, len: u64) -> BlockId {
        self.commit_in_chain(name, len, None, false)
    }

    fn commit_in_chain(
        &mut self,
        name: u64,
        len: u64,
        parent: Option<u64>,
        partial: bool,
    ) -> BlockId {
        while self.held.values().sum::<u64>() + len > self.capacity {
            let id = self.policy.victim(&mut |_| true).expect("a full store has a victim");
            assert!(self.held.remove(&id).is_some(), "victim {id} is not held");
            self.policy.remove(id, Removal::Evicted);
        }
        let id = self.next_id;
        self.next_id += 1;
        let b = BlockFacts {
            id,
            name,
            parent,
            depth: 1,
            partial,
            tenant: 0,
            len,
            seq: id,
            request: None,
        };
        self.policy.insert(&b);
        self.held.insert(id, len);
        id
    }

    fn holds(&self, id: BlockId) -> bool {
        self.held.contains_key(&id)
    }
}

#[test]
fn arc_keeps_a_block_read_twice_through_a_scan_of_one_time_blocks() {
    let kept = |kind: PolicyKind| {
        let mut store = Store::new(kind.build(8), 8);
        let hot = store.commit(1_000, 1);
        store.policy.hit(hot);
        for name in 0..100 {
            store.commit(name, 1);
        }
        store.holds(hot)
    };
    assert!(kept(PolicyKind::Arc), "ARC gave up a block read twice to one-time blocks");
    assert!(!kept(PolicyKind::Lru), "the scan is too short to push the block out of LRU");
}

#[test]
fn s3fifo_evicts_a_one_time_block_from_the_small_queue_before_a_block_that_was_hit() {
    let mut store = Store::new(PolicyKind::S3Fifo.build(10), 10);
    let ids: Vec<BlockId> = (1..=5).map(|name| store.commit(name, 1)).collect();
    store.policy.hit(ids[0]);
    let mut fifo = Fifo::default();
    for (seq, id) in ids.iter().enumerate() {
        let b = BlockFacts {
            id: *id,
            name: *id,
            parent: None,
            depth: 1,
            partial: false,
            tenant: 0,
            len: 1,
            seq: seq as u64,
            request: None,
        };
        fifo.insert(&b);
    }
    assert_eq!(fifo.victim(&mut |_| true), Some(ids[0]), "plain FIFO takes the oldest");
    assert_eq!(store.policy.victim(&mut |_| true), Some(ids[1]));
    store.policy.remove(ids[1], Removal::Evicted);
    assert_eq!(store.policy.ghosts(), 1);
    // The block that was hit went to the main queue; the small queue still goes first.
    assert_eq!(store.policy.victim(&mut |_| true), Some(ids[2]));
    // The evicted name comes back into the main queue, so the small queue still goes first.
    let again = store.commit(2, 1);
    assert_eq!(store.policy.ghosts(), 0);
    assert_eq!(store.policy.victim(&mut |_| true), Some(ids[2]));
    assert!(store.holds(again));
}

#[test]
fn ghosts_stay_within_the_capacity_and_the_entry_bound_after_many_evictions() {
    // (policy, most ghosts, block length): with one-byte blocks the byte bound is an entry
    // bound; with a huge capacity only the entry bound applies, whatever the lengths.
    let one = |_: u64| 1;
    let mixed = |name: u64| name % 4 + 1;
    type Run<'a> = (Box<dyn EvictionPolicy>, usize, &'a dyn Fn(u64) -> u64);
    let mut arc = AdaptiveReplacement::new(1 << 30);
    arc.ghost_entries_max = 16;
    let mut s3fifo = S3Fifo::new(1 << 30);
    s3fifo.ghost_entries_max = 16;
    let runs: [Run<'_>; 4] = [
        (Box::new(AdaptiveReplacement::new(64)), 64, &one),
        (Box::new(S3Fifo::new(64)), 64 - 6, &one),
        (Box::new(arc), 16, &mixed),
        (Box::new(s3fifo), 16, &mixed),
    ];
    for (policy, bound, len) in runs {
        let kind = policy.kind();
        let mut store = Store::new(policy, 64);
        let mut most = 0;
        for name in 0..5_000u64 {
            let id = store.commit(name, len(name));
            if name % 3 == 0 {
                store.policy.hit(id);
            }
            let ghosts = store.policy.ghosts();
            assert!(ghosts <= bound, "{kind}: {ghosts} ghosts, bound {bound}");
            most = most.max(ghosts);
        }
        assert_eq!(most, bound, "{kind}: the ghosts never filled up to their bound");
    }
}

#[test]
fn prefix_gives_up_a_partial_block_before_older_full_ones() {
    let first_out = |kind: PolicyKind| {
        let mut store = Store::new(kind.build(3), 3);
        let older = store.commit(1, 1);
        let partial = store.commit_in_chain(2, 1, None, true);
        store.commit(3, 1);
        store.commit(4, 1);
        (store.holds(older), store.holds(partial))
    };
    assert_eq!(first_out(PolicyKind::Prefix), (true, false), "the partial block went first");
    assert_eq!(first_out(PolicyKind::Arc), (false, true), "ARC takes the oldest");
}

#[test]
fn prefix_gives_up_a_block_whose_parent_left_before_older_blocks() {
    let first_out = |kind: PolicyKind| {
        let mut store = Store::new(kind.build(3), 3);
        let older = store.commit(10, 1);
        let parent = store.commit(20, 1);
        let child = store.commit_in_chain(21, 1, Some(20), false);
        store.policy.remove(parent, Removal::Invalidated);
        store.held.remove(&parent);
        store.commit(30, 1);
        store.commit(40, 1);
        (store.holds(older), store.holds(child))
    };
    assert_eq!(first_out(PolicyKind::Prefix), (true, false), "the orphan went first");
    assert_eq!(first_out(PolicyKind::Arc), (false, true), "ARC takes the oldest");
}

#[test]
fn prefix_puts_a_block_committed_without_its_parent_first_in_line() {
    let mut store = Store::new(PolicyKind::Prefix.build(3), 3);
    let older = store.commit(1, 1);
    let stray = store.commit_in_chain(2, 1, Some(99), false);
    let child = store.commit_in_chain(3, 1, Some(1), false);
    store.commit(4, 1);
    assert!(!store.holds(stray), "a block whose parent is absent went first");
    assert!(store.holds(older) && store.holds(child));
}
