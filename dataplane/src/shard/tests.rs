//! The directory against a sequential model, and the control plane's rules one by one.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::credits::{CreditPool, Credits};
use crate::key::KeyDigest;
use crate::registry::Epoch;

const LEASE_MS: u64 = 100;
const FILLS_MAX: usize = 4;
const COST: Credits = Credits::new(1, 2);

fn digest(k: u8) -> KeyDigest {
    let mut d = [0u8; 32];
    d[0] = k;
    KeyDigest(d)
}

/// A small count as the credits' unit.
fn n32(n: usize) -> u32 {
    u32::try_from(n).expect("a small count")
}

fn directory(operations: u32) -> ShardDirectory {
    let pool = CreditPool::new(Credits::new(operations, 2 * operations));
    ShardDirectory::new(ShardId(0), Epoch(1), pool, COST).with_bounds(FILLS_MAX, LEASE_MS)
}

#[derive(Debug, Clone)]
enum Op {
    /// A caller of key `key` whose view of the epoch is off by `skew` (0: current).
    Begin {
        key: u8,
        skew: i8,
        after_ms: u64,
    },
    /// The leader of the `lease`-th lease handed out so far reports.
    Finish {
        lease: usize,
        stored: bool,
        after_ms: u64,
    },
    Look {
        ticket: usize,
    },
    Fence,
    Drain,
    StopDrain,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        6 => (0u8..6, prop_oneof![8 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)], 0u64..60)
            .prop_map(|(key, skew, after_ms)| Op::Begin { key, skew, after_ms }),
        4 => (0usize..16, any::<bool>(), 0u64..60)
            .prop_map(|(lease, stored, after_ms)| Op::Finish { lease, stored, after_ms }),
        3 => (0usize..32).prop_map(|ticket| Op::Look { ticket }),
        1 => Just(Op::Fence),
        1 => Just(Op::Drain),
        1 => Just(Op::StopDrain),
    ];
    proptest::collection::vec(op, 1..80)
}

/// What the model knows of one fill.
#[derive(Debug, Clone, Copy)]
struct Known {
    key: u8,
    epoch: u64,
    deadline: u64,
    /// None while in flight.
    outcome: Option<FillNotice>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// One leader per key at a time; joiners are never charged; credits come back on every
    /// way out; an older epoch's fill is fenced and never reported finished; a lease that ran
    /// out fails its fill.
    #[test]
    fn the_directory_answers_as_the_model(ops in ops(), operations in 1u32..6) {
        let mut d = directory(operations);
        let mut now = 0u64;
        let mut epoch = 1u64;
        let mut draining = false;
        let mut fills: HashMap<u64, Known> = HashMap::new();
        let mut leases: Vec<FillLease> = Vec::new();
        let mut tickets: Vec<FillTicket> = Vec::new();
        let expire = |fills: &mut HashMap<u64, Known>, now: u64, epoch: u64| {
            for f in fills.values_mut() {
                if f.epoch == epoch && f.outcome.is_none() && f.deadline <= now {
                    f.outcome = Some(FillNotice::Failed);
                }
            }
        };
        let live = |fills: &HashMap<u64, Known>, epoch: u64| {
            fills.iter().filter(|(_, f)| f.epoch == epoch && f.outcome.is_none()).count()
        };
        for (step, op) in ops.iter().enumerate() {
            match *op {
                Op::Begin { key, skew, after_ms } => {
                    now += after_ms;
                    let asked = Epoch(epoch.saturating_add_signed(i64::from(skew)));
                    let got = d.begin_fill(digest(key), asked, now);
                    if asked.0 != epoch {
                        prop_assert_eq!(got, Err(FillRefusal::Epoch { asked, current: Epoch(epoch) }), "step {}", step);
                        continue;
                    }
                    expire(&mut fills, now, epoch);
                    let in_flight = fills.iter().find(|(_, f)| f.key == key && f.epoch == epoch && f.outcome.is_none()).map(|(id, _)| *id);
                    match (got, in_flight) {
                        (Ok(FillStart::Join(t)), Some(id)) => {
                            prop_assert_eq!(t, FillTicket { fill: id, epoch: Epoch(epoch) });
                            tickets.push(t);
                        }
                        (Ok(FillStart::Lead(l)), None) => {
                            prop_assert!(!draining, "step {}: led while draining", step);
                            prop_assert!(live(&fills, epoch) < FILLS_MAX && n32(live(&fills, epoch)) < operations);
                            prop_assert_eq!(l.deadline_ms, now + LEASE_MS);
                            fills.insert(l.ticket.fill, Known { key, epoch, deadline: l.deadline_ms, outcome: None });
                            leases.push(l);
                            tickets.push(l.ticket);
                        }
                        (Err(FillRefusal::Draining), None) => prop_assert!(draining),
                        (Err(FillRefusal::TooMany { .. }), None) => prop_assert_eq!(live(&fills, epoch), FILLS_MAX),
                        (Err(FillRefusal::Credits(_)), None) => prop_assert_eq!(n32(live(&fills, epoch)), operations),
                        (got, in_flight) => prop_assert!(false, "step {}: {:?} with {:?} in flight", step, got, in_flight),
                    }
                }
                Op::Finish { lease, stored, after_ms } => {
                    let Some(l) = leases.get(lease).copied() else { continue };
                    now += after_ms;
                    expire(&mut fills, now, epoch);
                    let outcome = if stored { FillOutcome::Stored } else { FillOutcome::GaveUp };
                    let got = d.finish_fill(&l, outcome, now);
                    let f = fills.get_mut(&l.ticket.fill).expect("a fill the model saw");
                    let want = if f.epoch != epoch {
                        FillNotice::Fenced
                    } else if let Some(done) = f.outcome {
                        done
                    } else {
                        let done = if stored { FillNotice::Finished } else { FillNotice::Failed };
                        f.outcome = Some(done);
                        done
                    };
                    prop_assert_eq!(got, want, "step {}", step);
                }
                Op::Look { ticket } => {
                    let Some(t) = tickets.get(ticket).copied() else { continue };
                    let f = fills[&t.fill];
                    // Looking does not expire leases: the model's view may lag the clock.
                    let want = if f.epoch != epoch { FillNotice::Fenced } else { f.outcome.unwrap_or(FillNotice::Pending) };
                    let got = d.notice(&t);
                    // A lease that ran out since the last call is still pending until a call
                    // that takes the time expires it.
                    prop_assert_eq!(got, want, "step {}", step);
                }
                Op::Fence => {
                    let fenced = d.fence(Epoch(epoch + 1));
                    prop_assert_eq!(fenced, live(&fills, epoch), "step {}", step);
                    epoch += 1;
                }
                Op::Drain => {
                    d.start_drain();
                    draining = true;
                }
                Op::StopDrain => {
                    d.stop_drain();
                    draining = false;
                }
            }
            // Credits held are exactly the live leaders' (joiners pay nothing).
            let leaders = n32(d.stats().in_flight);
            prop_assert_eq!(d.credits().usage().total, Credits::new(leaders * COST.operations, leaders * COST.host_blocks), "step {}", step);
            prop_assert!(d.stats().in_flight <= FILLS_MAX);
        }
        // Every way out returned its credits.
        d.fence(Epoch(epoch + 1));
        prop_assert_eq!(d.credits().usage().total, Credits::ZERO);
    }
}

#[test]
fn sixteen_fillers_of_one_key_make_one_leader_and_fifteen_joiners_told_finished() {
    let mut d = directory(4);
    let starts: Vec<FillStart> =
        (0..16).map(|_| d.begin_fill(digest(7), Epoch(1), 0).expect("admitted")).collect();
    let leads: Vec<FillLease> = starts
        .iter()
        .filter_map(|s| match s {
            FillStart::Lead(l) => Some(*l),
            FillStart::Join(_) => None,
        })
        .collect();
    assert_eq!(leads.len(), 1);
    assert_eq!(d.credits().usage().total, COST, "joiners are charged nothing");
    let joiners: Vec<FillTicket> = starts
        .iter()
        .filter_map(|s| match s {
            FillStart::Join(t) => Some(*t),
            FillStart::Lead(_) => None,
        })
        .collect();
    assert!(joiners.iter().all(|t| d.notice(t) == FillNotice::Pending));
    assert_eq!(d.finish_fill(&leads[0], FillOutcome::Stored, 10), FillNotice::Finished);
    assert_eq!(joiners.len(), 15);
    assert!(joiners.iter().all(|t| d.notice(t) == FillNotice::Finished));
    assert_eq!(d.credits().usage().total, Credits::ZERO);
    // A new miss of the same key leads a new fill.
    assert!(matches!(d.begin_fill(digest(7), Epoch(1), 11), Ok(FillStart::Lead(_))));
}

#[test]
fn a_fence_ends_fills_as_fenced_never_as_finished() {
    let mut d = directory(4);
    let Ok(FillStart::Lead(lease)) = d.begin_fill(digest(1), Epoch(1), 0) else { panic!() };
    let Ok(FillStart::Join(joiner)) = d.begin_fill(digest(1), Epoch(1), 0) else { panic!() };
    assert_eq!(d.fence(Epoch(2)), 1);
    assert_eq!(d.credits().usage().total, Credits::ZERO, "a fence returns the credits");
    assert_eq!(d.finish_fill(&lease, FillOutcome::Stored, 1), FillNotice::Fenced);
    assert_eq!(d.notice(&joiner), FillNotice::Fenced);
    // A caller still at the old epoch is told to refresh.
    assert_eq!(
        d.begin_fill(digest(1), Epoch(1), 1),
        Err(FillRefusal::Epoch { asked: Epoch(1), current: Epoch(2) })
    );
}

fn member(node: u64, domain: &str) -> Member {
    Member { node: NodeId(node), fault_domain: domain.into() }
}

fn plane() -> ControlPlane {
    ControlPlane::new(
        vec![member(1, "rack-a"), member(2, "rack-a"), member(3, "rack-b")],
        directory(8),
    )
    .expect("members")
}

#[test]
fn isolating_a_domain_removes_its_members_in_one_epoch_and_never_the_last() {
    let mut p = plane();
    let Ok(FillStart::Lead(lease)) = p.directory_mut().begin_fill(digest(1), Epoch(1), 0) else {
        panic!()
    };
    assert_eq!(p.isolate("rack-c"), Err(ControlError::UnknownDomain("rack-c".into())));
    assert_eq!(p.isolate("rack-a"), Ok(vec![NodeId(1), NodeId(2)]));
    assert_eq!(p.epoch(), Epoch(2));
    assert_eq!(p.directory_mut().finish_fill(&lease, FillOutcome::Stored, 1), FillNotice::Fenced);
    assert_eq!(p.isolate("rack-b"), Err(ControlError::LastMember { removed: 1 }));
    assert_eq!(p.remove(NodeId(3)), Err(ControlError::LastMember { removed: 1 }));
    assert_eq!(p.members().count(), 1);
    assert_eq!(p.epoch(), Epoch(2), "a refused change moves no epoch");
}

#[test]
fn a_rebalance_fences_the_source_and_the_destination_starts_empty() {
    let mut p = plane();
    let Ok(FillStart::Lead(lease)) = p.directory_mut().begin_fill(digest(1), Epoch(1), 0) else {
        panic!()
    };
    let dest = p.rebalance();
    assert_eq!((dest.epoch(), dest.stats().in_flight), (Epoch(2), 0));
    assert_eq!(p.directory().credits().usage().total, Credits::ZERO);
    assert_eq!(p.directory_mut().finish_fill(&lease, FillOutcome::Stored, 1), FillNotice::Fenced);
}

#[test]
fn an_upgrade_drains_then_fences_and_a_rollback_lets_fills_complete() {
    let mut p = plane();
    let d = p.directory_mut();
    let Ok(FillStart::Lead(first)) = d.begin_fill(digest(1), Epoch(1), 0) else { panic!() };
    p.start_upgrade();
    assert_eq!(p.upgrade(), Upgrade::Draining);
    let d = p.directory_mut();
    assert_eq!(d.begin_fill(digest(2), Epoch(1), 1), Err(FillRefusal::Draining));
    // A miss of a key already in flight still joins it.
    assert!(matches!(d.begin_fill(digest(1), Epoch(1), 1), Ok(FillStart::Join(_))));
    // Rolled back: the fill in flight completes, and new fills are admitted.
    p.rollback_upgrade().expect("draining");
    assert_eq!(p.directory_mut().finish_fill(&first, FillOutcome::Stored, 2), FillNotice::Finished);
    assert!(matches!(p.directory_mut().begin_fill(digest(2), Epoch(1), 3), Ok(FillStart::Lead(_))));
    // Finished: the epoch moves and whatever was in flight is fenced.
    p.start_upgrade();
    assert_eq!(p.finish_upgrade(), Ok(Epoch(2)));
    assert_eq!(p.directory().stats().in_flight, 0);
    assert_eq!(p.finish_upgrade(), Err(ControlError::NotDraining));
}

fn spread_key(i: u64) -> KeyDigest {
    // Real digests are BLAKE3 output; these stand in with bytes as well mixed.
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&crate::rng::SplitMix64::new(i).next_u64().to_le_bytes());
    KeyDigest(d)
}

const KEYS: u64 = 20_000;

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// A join moves only the keys the new member now wins, about 1/(N+1) of them; a leave
    /// moves only the leaver's keys, each to its second choice; every member's share is near
    /// 1/N.
    #[test]
    fn rendezvous_moves_only_what_it_must(n in 2u64..40, joiner in 1000u64..2000, leaver in 0usize..40) {
        let before = Placement::new((0..n).map(NodeId));
        let after = Placement::new((0..n).map(NodeId).chain([NodeId(joiner)]));
        let mut moved = 0u64;
        let mut share = vec![0u64; usize::try_from(n).expect("small")];
        for i in 0..KEYS {
            let k = spread_key(i);
            let (was, now) = (before.owner(&k).expect("members"), after.owner(&k).expect("members"));
            share[usize::try_from(was.0).expect("small")] += 1;
            if was != now {
                prop_assert_eq!(now, NodeId(joiner), "a key moved between old members");
                moved += 1;
            }
        }
        let expected = KEYS as f64 / (n + 1) as f64;
        prop_assert!((moved as f64 - expected).abs() < 0.15 * expected + 60.0, "moved {} of {}, expected about {}", moved, KEYS, expected);
        let fair = KEYS as f64 / n as f64;
        for s in &share {
            prop_assert!((*s as f64 - fair).abs() < 0.2 * fair + 60.0, "a share of {} against {}", s, fair);
        }
        // A leave: only the leaver's keys move, each to its second choice.
        let gone = NodeId(u64::try_from(leaver).expect("small") % n);
        let without = Placement::new((0..n).map(NodeId).filter(|m| *m != gone));
        for i in 0..KEYS / 4 {
            let k = spread_key(i);
            let choices = before.choices(&k, 2);
            let now = without.owner(&k).expect("members");
            if choices[0] == gone {
                prop_assert_eq!(now, choices[1]);
            } else {
                prop_assert_eq!(now, choices[0]);
            }
        }
    }
}

#[test]
fn a_batch_splits_by_owner_keeping_item_order_and_no_member_owns_nothing() {
    let p = Placement::new([NodeId(3), NodeId(1), NodeId(2), NodeId(1)]);
    assert_eq!(p.nodes(), &[NodeId(1), NodeId(2), NodeId(3)]);
    let keys: Vec<KeyDigest> = (0..64).map(spread_key).collect();
    let parts = p.split(&keys);
    let mut seen: Vec<usize> = parts.iter().flat_map(|(_, items)| items.clone()).collect();
    for (node, items) in &parts {
        assert!(items.windows(2).all(|w| w[0] < w[1]), "item order kept");
        assert!(items.iter().all(|i| p.owner(&keys[*i]) == Some(*node)));
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..64).collect::<Vec<_>>(), "every item in exactly one part");
    assert_eq!(Placement::default().owner(&keys[0]), None);
    assert_eq!(p.choices(&keys[0], 5).len(), 3);
}
