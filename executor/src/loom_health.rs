//! Model-checked races of the health monitor (`RUSTFLAGS="--cfg loom"`, see `scripts/test.sh`).
//! Loom runs each closure under every interleaving of its threads' lock operations.

use std::num::NonZeroU64;
use std::sync::Arc as StdArc;

use loom::sync::Arc;
use loom::thread;

use super::health::{BackendOutcome, HealthMonitor, HealthState, Rejected};
use gpucache_dataplane::clock::ManualClock;

const COOLDOWN_MS: u64 = 100;

fn monitor() -> (HealthMonitor, ManualClock) {
    let clock = ManualClock::default();
    let cooldown = NonZeroU64::new(COOLDOWN_MS).expect("nonzero");
    (HealthMonitor::new(cooldown, StdArc::new(clock.clone())), clock)
}

/// A call admitted before an outage reports success while another caller records that outage
/// and a third asks to start: in every order the monitor ends cooling down in epoch 1, and the
/// third caller is either admitted under epoch 0 (it came first) or refused.
#[test]
fn loom_stale_success_cannot_undo_a_newer_outage() {
    loom::model(|| {
        let (m, _clock) = monitor();
        let m = Arc::new(m);
        let slow = m.admit().expect("healthy");
        let failing = m.admit().expect("healthy");

        let reporter = {
            let m = Arc::clone(&m);
            thread::spawn(move || m.report(failing, BackendOutcome::BackendError))
        };
        let stale = {
            let m = Arc::clone(&m);
            thread::spawn(move || m.report(slow, BackendOutcome::Succeeded))
        };
        let newcomer = {
            let m = Arc::clone(&m);
            thread::spawn(move || m.admit())
        };
        reporter.join().expect("reporter");
        stale.join().expect("stale reporter");
        match newcomer.join().expect("newcomer") {
            Ok(a) => assert!(a.epoch() == 0 && !a.is_probe()),
            Err(rejected) => {
                assert_eq!(rejected, Rejected::CoolingDown { epoch: 1, until_ms: COOLDOWN_MS })
            }
        }
        let snap = m.snapshot();
        assert_eq!(snap.epoch, 1);
        assert_eq!(snap.state, HealthState::CoolingDown { until_ms: COOLDOWN_MS });
    });
}

/// Two callers race for the probe after the cooldown while a third reads the gauges: exactly
/// one becomes the probe, and reading never takes it.
#[test]
fn loom_one_probe_between_racing_callers() {
    loom::model(|| {
        let (m, clock) = monitor();
        let m = Arc::new(m);
        let first = m.admit().expect("healthy");
        let _ = m.report(first, BackendOutcome::UnretiredPutFailure);
        clock.advance_ms(COOLDOWN_MS);

        let callers: Vec<_> = (0..2)
            .map(|_| {
                let m = Arc::clone(&m);
                thread::spawn(move || m.admit())
            })
            .collect();
        let reader = {
            let m = Arc::clone(&m);
            thread::spawn(move || m.snapshot())
        };
        let results: Vec<_> = callers.into_iter().map(|t| t.join().expect("caller")).collect();
        let seen = reader.join().expect("reader");
        assert_eq!(seen.epoch, 1);
        assert_ne!(seen.state, HealthState::Healthy);

        let probes = results.iter().filter(|r| r.as_ref().is_ok_and(|a| a.is_probe())).count();
        let refused = results
            .iter()
            .filter(|r| matches!(r, Err(Rejected::ProbeInFlight { epoch: 1, .. })))
            .count();
        assert_eq!((probes, refused), (1, 1));
    });
}

/// The stale success races the recovery probe, which fails: whichever order the lock grants,
/// the monitor never becomes healthy and ends cooling down in the probe's new epoch.
#[test]
fn loom_stale_success_races_a_failing_probe() {
    loom::model(|| {
        let (m, clock) = monitor();
        let m = Arc::new(m);
        let slow = m.admit().expect("healthy");
        let failing = m.admit().expect("healthy");
        let _ = m.report(failing, BackendOutcome::BackendError);
        clock.advance_ms(COOLDOWN_MS);

        let prober = {
            let m = Arc::clone(&m);
            thread::spawn(move || {
                let probe = m.admit().expect("the only caller gets the probe");
                assert!(probe.is_probe());
                let _ = m.report(probe, BackendOutcome::UnknownNativeFailure);
            })
        };
        let stale = {
            let m = Arc::clone(&m);
            thread::spawn(move || {
                let _ = m.report(slow, BackendOutcome::Succeeded);
                m.snapshot()
            })
        };
        prober.join().expect("prober");
        let seen = stale.join().expect("stale reporter");
        assert_ne!(seen.state, HealthState::Healthy, "a stale success restored service");
        let snap = m.snapshot();
        assert_eq!(snap.epoch, 2);
        assert_eq!(snap.state, HealthState::CoolingDown { until_ms: 2 * COOLDOWN_MS });
    });
}
