//! The seeded cluster simulation (`shard::sim`) over a fixed list of seeds, its determinism,
//! and the faults that its checks must catch.
//!
//! Every seed prints its steps and steps per second. A failure names its seed; to replay just
//! that seed, set `GPUCACHE_SIM_SEED`, and optionally `GPUCACHE_SIM_STEPS` for the step count:
//!
//! ```text
//! GPUCACHE_SIM_SEED=7 GPUCACHE_SIM_STEPS=20000 \
//!     cargo test -p gpucache-dataplane --test cluster_sim every_seed -- --nocapture
//! ```

use std::time::Instant;

use gpucache_dataplane::shard::sim::{
    self, KEPT_COPY, SimCheck, SimConfig, SimFailure, SimReport, UNSETTLED,
};

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
