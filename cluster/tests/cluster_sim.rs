//! The seeded cluster simulation (`gpucache_cluster::sim`, built with the `sim` feature) over a
//! fixed list of seeds, its determinism, the faults that its checks must catch, and that every
//! view it makes is what the crate's membership rules make.
//!
//! Every seed prints its steps and steps per second. A failure names its seed; to replay just
//! that seed, set `GPUCACHE_SIM_SEED`, and optionally `GPUCACHE_SIM_STEPS` for the step count:
//!
//! ```text
//! GPUCACHE_SIM_SEED=7 GPUCACHE_SIM_STEPS=20000 \
//!     cargo test -p gpucache-cluster --features sim --test cluster_sim every_seed -- --nocapture
//! ```

use std::time::Instant;

use gpucache_cluster::sim::{
    self, KEPT_COPY, MembershipChange, SimCheck, SimConfig, SimFailure, SimReport, UNSETTLED,
};
use gpucache_cluster::{Change, drain, finish, join, remove_life};
use gpucache_dataplane::shard::{ClusterView, ControlError};

/// The seeds every run goes through.
const SEEDS: [u64; 8] = [1, 2, 3, 5, 8, 13, 21, 34];
/// Steps per seed, sized so that all seeds take 20 to 40 seconds in a debug build on two
/// cores.
const STEPS: u64 = 4000;
/// Members at the start of every run.
const NODES: usize = 128;
const CLIENTS: usize = 16;

fn env_number(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(value.trim().parse().unwrap_or_else(|_| panic!("{name}={value:?} is not a number")))
}

fn config(seed: u64, steps: u64) -> SimConfig {
    SimConfig { nodes: NODES, clients: CLIENTS, steps, ..SimConfig::new(seed) }
}

/// Runs one seed, printing how fast it went.
fn run_seed(config: &SimConfig) -> Result<SimReport, SimFailure> {
    let started = Instant::now();
    let result = sim::run(config);
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let steps = result.as_ref().map_or_else(|f| f.step, |r| r.steps);
    eprintln!(
        "seed {}: {steps} steps in {secs:.2} s, {:.0} steps/s",
        config.seed,
        steps as f64 / secs
    );
    result
}

fn replay_hint(failure: &SimFailure) -> String {
    format!("{failure}\n(replay it with GPUCACHE_SIM_SEED={})", failure.seed)
}

#[test]
fn every_seed_keeps_every_rule() {
    let steps = env_number("GPUCACHE_SIM_STEPS").unwrap_or(STEPS);
    let seeds: Vec<u64> = match env_number("GPUCACHE_SIM_SEED") {
        Some(seed) => vec![seed],
        None => SEEDS.to_vec(),
    };
    let mut failures = Vec::new();
    let mut settling = 0;
    for seed in seeds {
        match run_seed(&config(seed, steps)) {
            Ok(report) => {
                eprintln!("seed {seed}: {report:?}");
                settling += report.settling_misses + report.settling_refusals;
            }
            Err(failure) => {
                eprintln!("{}", replay_hint(&failure));
                failures.push(failure);
            }
        }
    }
    let failed: Vec<String> = failures
        .iter()
        .map(|f| format!("seed {} (step {}, {})", f.seed, f.step, f.check.name()))
        .collect();
    assert!(
        failed.is_empty(),
        "broken rules in {}; first: {}",
        failed.join(", "),
        replay_hint(&failures[0])
    );
    // The runs went through views that had not settled yet: the rule was in play.
    assert!(settling > 0, "no node refused or missed a key for want of settlement");
}

#[test]
fn one_seed_gives_one_report() {
    let config = config(SEEDS[0], STEPS / 4);
    let first = sim::run(&config).map_err(|f| replay_hint(&f));
    let second = sim::run(&config).map_err(|f| replay_hint(&f));
    assert_eq!(first, second, "two runs of seed {} differ", config.seed);
}

/// Nodes that keep the keys a view moved away serve them again when the keys come back,
/// though a newer version was written elsewhere meanwhile: the stale check must say so, and
/// must name the kept copy as what it served.
#[test]
fn keeping_keys_apply_handed_back_is_caught_as_a_stale_hit() {
    let caught = SEEDS.iter().find_map(|&seed| {
        let mut config = config(seed, STEPS);
        config.faults.skip_drop_on_apply = true;
        sim::run(&config)
            .err()
            .filter(|f| f.check == SimCheck::StaleHit && f.detail.contains(KEPT_COPY))
    });
    let failure = caught.expect("no seed caught nodes keeping the keys apply handed back");
    eprintln!("caught as expected: {failure}");
}

/// Nodes that serve a key as soon as a view gives it to them, before every live member has
/// applied that view, race the key's old owner, which still takes writes of it under the
/// older view: the stale check must say so, and must name the unsettled key as what it served.
#[test]
fn serving_before_the_view_settled_is_caught_as_a_stale_hit() {
    let caught = SEEDS.iter().find_map(|&seed| {
        let mut config = config(seed, STEPS);
        config.faults.ignore_settlement = true;
        sim::run(&config)
            .err()
            .filter(|f| f.check == SimCheck::StaleHit && f.detail.contains(UNSETTLED))
    });
    let failure = caught.expect("no seed caught nodes serving keys before their view settled");
    eprintln!("caught as expected: {failure}");
}

#[test]
fn a_configuration_out_of_bounds_is_refused() {
    let failure = sim::run(&SimConfig { nodes: 0, ..SimConfig::new(9) }).expect_err("no nodes");
    assert_eq!((failure.check, failure.step, failure.seed), (SimCheck::Config, 0, 9));
}

/// The outcome of a change in short: its epoch and the entry of the node it is about.
fn brief(outcome: &Change, change: &MembershipChange) -> String {
    let node = match change {
        MembershipChange::Join(m) => m.node,
        MembershipChange::RemoveLife { node, .. }
        | MembershipChange::Drain(node)
        | MembershipChange::Finish(node) => *node,
    };
    match outcome {
        Ok(Some(view)) => format!("epoch {} listing {:?}", view.epoch, view.member(node)),
        Ok(None) => "no change".into(),
        Err(refusal) => format!("a refusal ({refusal})"),
    }
}

/// What one run asked of the membership rules.
#[derive(Debug, Default)]
struct Asked {
    /// Views made by kind: a new node, a new life of a listed node, a leave, a drain, a finish.
    made: [u64; 5],
    /// Changes the rules refused, and how many of those would have removed the last member.
    refused: u64,
    last_member: u64,
}

/// Runs `config` and checks every change the simulated coordinator made against the crate's
/// own rules, called here again: each began from the last view made, got what the rule for it
/// gives, and no view is empty; the report counts what was made and refused. A simulation
/// that edited its view by rules of its own would show up as a view that differs, or as a gap
/// in the chain of views.
fn run_against_the_rules(config: &SimConfig) -> (SimReport, Asked) {
    let mut standing: Option<ClusterView> = None;
    let mut asked = Asked::default();
    let report = sim::run_watched(config, &mut |c| {
        if let Some(view) = &standing {
            assert!(
                c.before == view,
                "step {}: {:?} began from a view at epoch {}, not from the last one made ({})",
                c.step,
                c.change,
                c.before.epoch,
                view.epoch
            );
        }
        let (kind, want) = match c.change {
            MembershipChange::Join(m) if c.before.member(m.node).is_some() => {
                (1, join(c.before, m))
            }
            MembershipChange::Join(m) => (0, join(c.before, m)),
            MembershipChange::RemoveLife { node, node_epoch } => {
                (2, remove_life(c.before, *node, *node_epoch))
            }
            MembershipChange::Drain(node) => (3, drain(c.before, *node)),
            MembershipChange::Finish(node) => (4, finish(c.before, *node)),
        };
        assert!(
            c.outcome == &want,
            "step {}: {:?} made {} where the rules make {}",
            c.step,
            c.change,
            brief(c.outcome, c.change),
            brief(&want, c.change)
        );
        match c.outcome {
            Ok(Some(next)) => {
                assert!(!next.members.is_empty(), "step {}: a view with no member", c.step);
                asked.made[kind] += 1;
                standing = Some(next.clone());
            }
            Ok(None) => {}
            Err(refusal) => {
                asked.refused += 1;
                asked.last_member += u64::from(matches!(refusal, ControlError::LastMember { .. }));
            }
        }
    })
    .unwrap_or_else(|f| panic!("{}", replay_hint(&f)));
    if let Some(last) = &standing {
        assert_eq!((report.final_epoch, report.final_members), (last.epoch, last.members.len()));
    }
    let made = asked.made;
    assert_eq!((report.joins, report.drains), (made[0], made[3]), "seed {}", config.seed);
    assert_eq!(report.leaves, made[2] + made[4], "seed {}", config.seed);
    assert_eq!(report.refused_changes, asked.refused, "seed {}", config.seed);
    (report, asked)
}

#[test]
fn every_view_comes_from_the_membership_rules() {
    let (_, asked) = run_against_the_rules(&config(SEEDS[0], STEPS / 2));
    assert!(
        asked.made.iter().all(|&n| n > 0),
        "views made (join, new life, leave, drain, finish): {:?}",
        asked.made
    );
}

/// A small cluster can lose every member to crashes. The rules refuse to remove the last one,
/// and the simulated coordinator, like the real one, leaves it listed (trying again on later
/// steps) rather than make a view with no member; every rule still holds meanwhile.
#[test]
fn the_last_member_is_never_removed() {
    let found = (1..=64).find_map(|seed| {
        let config = SimConfig { nodes: 8, clients: 4, steps: STEPS, ..SimConfig::new(seed) };
        let (_, asked) = run_against_the_rules(&config);
        (asked.last_member > 0).then_some((seed, asked))
    });
    let (seed, asked) = found.expect("no seed brought a small cluster down to its last member");
    eprintln!("seed {seed}: {} removals of the last member refused", asked.last_member);
}
