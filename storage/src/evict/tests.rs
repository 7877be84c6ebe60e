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
                let ok = |id: BlockId| *skip == 0 || id % skip != 0;
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

proptest! {
    #[test]
    fn fifo_matches_its_model(events in events(40)) {
        agree(&mut Fifo::default(), &mut FifoModel::default(), &events)?;
    }

    #[test]
    fn lru_matches_its_model(events in events(40)) {
        agree(&mut Lru::default(), &mut LruModel::default(), &events)?;
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
