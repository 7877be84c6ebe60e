//! The executor's private backend-health monitor.
//!
//! After a backend call ends in an outage, the monitor refuses new work for a cooldown. Once the
//! cooldown has passed, the next caller is admitted as the single recovery probe and everyone
//! else is refused until that probe reports: a healthy answer restores service, an outage starts
//! a new cooldown, and a probe that never reached the backend hands the probe to the next caller.
//!
//! Every recorded outage advances the health epoch, and each admission remembers the epoch it was
//! granted under. A report from an older epoch describes a call that started before the newest
//! outage; it changes nothing, so a slow call that happens to succeed cannot undo an outage
//! somebody else saw after it started.
//!
//! The monitor owns no thread and offers nothing beyond what the executor needs: admit, report,
//! and a read-only snapshot for the health-state and epoch gauges. Reading never consumes the
//! probe. Time comes from the injected [`Clock`]. It must not decide pressure admission,
//! quarantine or negative-cache policy; soft timeouts never reach it.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;

use super::sync::{Mutex, lock};
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::store::{Retirement, StoreError};

/// What one admitted backend call ended with, as far as health is concerned. The executor maps
/// each store answer to exactly one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendOutcome {
    /// The call did what was asked: a QUERY answered every key, a GET moved the exact byte
    /// count, a PUT committed.
    Succeeded,
    /// QUERY or GET metadata confirmed the object is absent before any destination transfer
    /// (Mooncake `OBJECT_NOT_FOUND`).
    ExistenceMiss,
    /// A GET failed in a way that proves it stopped touching the destination: a nonnegative
    /// short read, an invalid object.
    RetiredGetMiss,
    /// A create-only PUT found the object already stored (Mooncake `OBJECT_ALREADY_EXISTS`):
    /// idempotent success.
    PutAlreadyExists,
    /// The store refused a PUT for lack of space before any source transfer (Mooncake
    /// `NO_AVAILABLE_HANDLE`); the page stays unacknowledged and can be offered again.
    RetiredPutCapacityRejection,
    /// The store refused the request for the caller's own reasons (rights, tenant, sizes)
    /// before touching any buffer.
    CallerRefused,
    /// The call raised an error from the backend or its transport.
    BackendError,
    /// A PUT failed without proving that it stopped reading its sources.
    UnretiredPutFailure,
    /// A native failure whose retirement is unknown: any other negative transfer code, an
    /// exception after native submission, a malformed result.
    UnknownNativeFailure,
    /// The job never reached the backend: cancelled while queued, refused by a queue, or
    /// dropped at shutdown.
    NotAttempted,
}

/// What an outcome says about the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Evidence {
    /// The backend answered as a working backend does, even if the answer was "no".
    Healthy,
    /// The backend or its transport failed.
    Outage,
    /// Nothing: the backend was never asked.
    Nothing,
}

impl BackendOutcome {
    /// Every outcome, for tests and exhaustive tables.
    pub const ALL: [BackendOutcome; 10] = [
        Self::Succeeded,
        Self::ExistenceMiss,
        Self::RetiredGetMiss,
        Self::PutAlreadyExists,
        Self::RetiredPutCapacityRejection,
        Self::CallerRefused,
        Self::BackendError,
        Self::UnretiredPutFailure,
        Self::UnknownNativeFailure,
        Self::NotAttempted,
    ];

    /// What this outcome says about the backend.
    ///
    /// Misses, retired GET failures, create-only duplicates and retired capacity refusals are
    /// answers a working backend gives, so they count as health. Backend and transport errors,
    /// unretired PUT failures and native failures of unknown retirement are outages. A job that
    /// never reached the backend is no evidence either way.
    pub fn evidence(self) -> Evidence {
        match self {
            Self::Succeeded
            | Self::ExistenceMiss
            | Self::RetiredGetMiss
            | Self::PutAlreadyExists
            | Self::RetiredPutCapacityRejection
            | Self::CallerRefused => Evidence::Healthy,
            Self::BackendError | Self::UnretiredPutFailure | Self::UnknownNativeFailure => {
                Evidence::Outage
            }
            Self::NotAttempted => Evidence::Nothing,
        }
    }

    /// Whether this outcome starts (or, from a probe, restarts) a cooldown: exactly the
    /// outcomes whose [`evidence`](Self::evidence) is [`Evidence::Outage`].
    pub fn counts_as_outage(self) -> bool {
        self.evidence() == Evidence::Outage
    }

    /// The outcome of a store call that returned an error. A backend failure
    /// ([`StoreError::is_backend_failure`]: `Backend`, `Storage` or `Io`) of unknown retirement
    /// is a native failure, a retired one a backend error; every other error is the store
    /// refusing the caller before touching a buffer.
    pub fn from_store_error(error: &StoreError) -> Self {
        if !error.is_backend_failure() {
            return Self::CallerRefused;
        }
        match error.retirement() {
            Retirement::Unknown => Self::UnknownNativeFailure,
            Retirement::Retired => Self::BackendError,
        }
    }
}

/// Where the monitor stands (on /metrics: one `gpucache_executor_health_state` series per state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthState {
    /// Work is admitted.
    Healthy,
    /// An outage was recorded; work is refused until `until_ms`, after which the next caller
    /// becomes the recovery probe.
    CoolingDown { until_ms: u64 },
    /// The recovery probe admitted at `since_ms` has not reported yet; everyone else is refused.
    Probing { since_ms: u64 },
}

impl fmt::Display for HealthState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Healthy => f.write_str("healthy"),
            Self::CoolingDown { until_ms } => write!(f, "cooling down until {until_ms} ms"),
            Self::Probing { since_ms } => write!(f, "probing since {since_ms} ms"),
        }
    }
}

/// A read of the monitor for the metrics gauges. Carries no request or key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HealthSnapshot {
    pub state: HealthState,
    /// Outages recorded so far.
    pub epoch: u64,
}

/// Permission to make one backend call. Hand it back to [`HealthMonitor::report`] with the
/// call's outcome; a probe that is never reported keeps every other caller refused. Neither
/// `Clone` nor `Copy`, so one call is reported once.
#[must_use = "report the call's outcome, or the probe is never released"]
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Admission {
    epoch: u64,
    probe: bool,
}

impl Admission {
    /// The health epoch the call was admitted under.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether this call is the recovery probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }
}

/// Why the monitor refused a call. An expected answer while the backend is down: the job
/// completes without touching the backend and carries no evidence about any object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum Rejected {
    #[error("backend unhealthy (health epoch {epoch}): cooling down until {until_ms} ms")]
    CoolingDown { epoch: u64, until_ms: u64 },
    #[error(
        "backend unhealthy (health epoch {epoch}): a recovery probe is running since {since_ms} ms"
    )]
    ProbeInFlight { epoch: u64, since_ms: u64 },
}

/// What a report changed, for logs and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReportEffect {
    /// Nothing: a healthy answer while healthy, or no evidence from an ordinary call.
    Unchanged,
    /// An outage was recorded; the new epoch is refused until `until_ms`.
    OutageRecorded { epoch: u64, until_ms: u64 },
    /// The probe got a healthy answer; work is admitted again.
    Recovered { epoch: u64 },
    /// The probe never reached the backend; the next caller becomes the probe.
    ProbeReleased { epoch: u64 },
    /// The call was admitted before the newest outage; its report is ignored.
    Stale { admitted_epoch: u64, current_epoch: u64 },
}

#[derive(Debug)]
struct Inner {
    state: HealthState,
    epoch: u64,
}

/// The executor's health monitor. Shared by the executor's workers; every method takes one
/// short lock and never blocks on anything else.
pub struct HealthMonitor {
    cooldown_ms: NonZeroU64,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
}

impl fmt::Debug for HealthMonitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HealthMonitor")
            .field("cooldown_ms", &self.cooldown_ms)
            .field("snapshot", &self.snapshot())
            .finish_non_exhaustive()
    }
}

impl HealthMonitor {
    /// A healthy monitor at epoch 0 that refuses work for `cooldown_ms` after each outage.
    pub fn new(cooldown_ms: NonZeroU64, clock: Arc<dyn Clock>) -> Self {
        Self {
            cooldown_ms,
            clock,
            inner: Mutex::new(Inner { state: HealthState::Healthy, epoch: 0 }),
        }
    }

    /// The cooldown after an outage.
    pub fn cooldown_ms(&self) -> NonZeroU64 {
        self.cooldown_ms
    }

    /// Asks to make one backend call now. While healthy every caller is admitted; after a
    /// cooldown has passed the first caller is admitted as the probe; otherwise refused.
    pub fn admit(&self) -> Result<Admission, Rejected> {
        let now_ms = self.clock.now_ms();
        let mut inner = lock(&self.inner);
        let epoch = inner.epoch;
        match inner.state {
            HealthState::Healthy => Ok(Admission { epoch, probe: false }),
            HealthState::CoolingDown { until_ms } if now_ms < until_ms => {
                Err(Rejected::CoolingDown { epoch, until_ms })
            }
            HealthState::CoolingDown { .. } => {
                inner.state = HealthState::Probing { since_ms: now_ms };
                Ok(Admission { epoch, probe: true })
            }
            HealthState::Probing { since_ms } => Err(Rejected::ProbeInFlight { epoch, since_ms }),
        }
    }

    /// Records how an admitted call ended.
    pub fn report(&self, admission: Admission, outcome: BackendOutcome) -> ReportEffect {
        let now_ms = self.clock.now_ms();
        let mut inner = lock(&self.inner);
        if admission.epoch != inner.epoch {
            return ReportEffect::Stale {
                admitted_epoch: admission.epoch,
                current_epoch: inner.epoch,
            };
        }
        let probing = matches!(inner.state, HealthState::Probing { .. });
        match outcome.evidence() {
            Evidence::Outage => {
                // Epochs count outages; u64 does not run out in any process lifetime, and
                // saturating keeps the monitor refusing rather than wrapping to a stale epoch.
                inner.epoch = inner.epoch.saturating_add(1);
                let until_ms = now_ms.saturating_add(self.cooldown_ms.get());
                inner.state = HealthState::CoolingDown { until_ms };
                ReportEffect::OutageRecorded { epoch: inner.epoch, until_ms }
            }
            Evidence::Healthy if admission.probe && probing => {
                inner.state = HealthState::Healthy;
                ReportEffect::Recovered { epoch: inner.epoch }
            }
            Evidence::Nothing if admission.probe && probing => {
                // The cooldown has already passed: the next caller may probe at once.
                inner.state = HealthState::CoolingDown { until_ms: now_ms };
                ReportEffect::ProbeReleased { epoch: inner.epoch }
            }
            Evidence::Healthy | Evidence::Nothing => ReportEffect::Unchanged,
        }
    }

    /// The current state and epoch. Reading never admits anyone, so it never takes the probe.
    pub fn snapshot(&self) -> HealthSnapshot {
        let inner = lock(&self.inner);
        HealthSnapshot { state: inner.state, epoch: inner.epoch }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpucache_dataplane::clock::ManualClock;

    const COOLDOWN_MS: u64 = 1_000;

    fn monitor() -> (HealthMonitor, ManualClock) {
        let clock = ManualClock::default();
        let cooldown = NonZeroU64::new(COOLDOWN_MS).expect("nonzero");
        (HealthMonitor::new(cooldown, Arc::new(clock.clone())), clock)
    }

    /// Drives a healthy monitor into its first cooldown through one failed call.
    fn fail_once(m: &HealthMonitor) -> u64 {
        let a = m.admit().expect("healthy admits");
        match m.report(a, BackendOutcome::BackendError) {
            ReportEffect::OutageRecorded { until_ms, .. } => until_ms,
            other => panic!("expected an outage, got {other:?}"),
        }
    }

    #[test]
    fn healthy_admits_everyone_without_probes() {
        let (m, _) = monitor();
        for _ in 0..3 {
            let a = m.admit().expect("healthy");
            assert!(!a.is_probe());
            assert_eq!(a.epoch(), 0);
        }
        assert_eq!(m.snapshot(), HealthSnapshot { state: HealthState::Healthy, epoch: 0 });
    }

    #[test]
    fn cooldown_rejects_until_it_ends() {
        let (m, clock) = monitor();
        clock.advance_ms(5);
        let until = fail_once(&m);
        assert_eq!(until, 5 + COOLDOWN_MS);
        assert_eq!(m.admit(), Err(Rejected::CoolingDown { epoch: 1, until_ms: until }));
        clock.advance_ms(COOLDOWN_MS - 1);
        assert_eq!(m.admit(), Err(Rejected::CoolingDown { epoch: 1, until_ms: until }));
        clock.advance_ms(1);
        assert!(m.admit().expect("cooldown over").is_probe());
    }

    #[test]
    fn exactly_one_probe_after_cooldown() {
        let (m, clock) = monitor();
        fail_once(&m);
        clock.advance_ms(COOLDOWN_MS);
        let probe = m.admit().expect("first caller probes");
        assert!(probe.is_probe());
        assert_eq!(probe.epoch(), 1);
        for _ in 0..3 {
            assert_eq!(m.admit(), Err(Rejected::ProbeInFlight { epoch: 1, since_ms: COOLDOWN_MS }));
        }
        clock.advance_ms(10 * COOLDOWN_MS);
        assert!(
            matches!(m.admit(), Err(Rejected::ProbeInFlight { .. })),
            "time alone frees nothing"
        );
    }

    #[test]
    fn probe_success_restores_service() {
        let (m, clock) = monitor();
        fail_once(&m);
        clock.advance_ms(COOLDOWN_MS);
        let probe = m.admit().expect("probe");
        assert_eq!(
            m.report(probe, BackendOutcome::Succeeded),
            ReportEffect::Recovered { epoch: 1 }
        );
        assert_eq!(m.snapshot(), HealthSnapshot { state: HealthState::Healthy, epoch: 1 });
        let a = m.admit().expect("healthy again");
        assert!(!a.is_probe());
        assert_eq!(a.epoch(), 1);
    }

    #[test]
    fn probe_healthy_answers_that_are_not_success_also_restore() {
        for outcome in [BackendOutcome::ExistenceMiss, BackendOutcome::PutAlreadyExists] {
            let (m, clock) = monitor();
            fail_once(&m);
            clock.advance_ms(COOLDOWN_MS);
            let probe = m.admit().expect("probe");
            assert_eq!(
                m.report(probe, outcome),
                ReportEffect::Recovered { epoch: 1 },
                "{outcome:?}"
            );
        }
    }

    #[test]
    fn probe_failure_restarts_cooldown_in_a_new_epoch() {
        let (m, clock) = monitor();
        fail_once(&m);
        clock.advance_ms(COOLDOWN_MS + 7);
        let probe = m.admit().expect("probe");
        let effect = m.report(probe, BackendOutcome::UnknownNativeFailure);
        let until = 2 * COOLDOWN_MS + 7;
        assert_eq!(effect, ReportEffect::OutageRecorded { epoch: 2, until_ms: until });
        assert_eq!(m.admit(), Err(Rejected::CoolingDown { epoch: 2, until_ms: until }));
        clock.advance_ms(COOLDOWN_MS);
        let second = m.admit().expect("a new probe after the new cooldown");
        assert!(second.is_probe());
        assert_eq!(second.epoch(), 2);
    }

    #[test]
    fn probe_that_never_reached_the_backend_hands_the_probe_on() {
        let (m, clock) = monitor();
        fail_once(&m);
        clock.advance_ms(COOLDOWN_MS);
        let probe = m.admit().expect("probe");
        assert_eq!(
            m.report(probe, BackendOutcome::NotAttempted),
            ReportEffect::ProbeReleased { epoch: 1 }
        );
        assert!(m.admit().expect("next caller probes").is_probe());
        assert!(matches!(m.admit(), Err(Rejected::ProbeInFlight { .. })));
    }

    #[test]
    fn stale_success_after_a_newer_outage_does_not_restore() {
        let (m, clock) = monitor();
        let slow = m.admit().expect("started while healthy");
        let slower = m.admit().expect("started while healthy");
        let failing = m.admit().expect("started while healthy");
        assert!(matches!(
            m.report(failing, BackendOutcome::BackendError),
            ReportEffect::OutageRecorded { epoch: 1, .. }
        ));
        assert_eq!(
            m.report(slow, BackendOutcome::Succeeded),
            ReportEffect::Stale { admitted_epoch: 0, current_epoch: 1 }
        );
        assert!(matches!(m.snapshot().state, HealthState::CoolingDown { .. }));
        // Still stale once the probe is running: it cannot finish the probe's job for it.
        clock.advance_ms(COOLDOWN_MS);
        let probe = m.admit().expect("probe");
        assert!(matches!(m.report(slower, BackendOutcome::Succeeded), ReportEffect::Stale { .. }));
        assert!(matches!(m.admit(), Err(Rejected::ProbeInFlight { .. })));
        assert_eq!(
            m.report(probe, BackendOutcome::Succeeded),
            ReportEffect::Recovered { epoch: 1 }
        );
    }

    #[test]
    fn stale_failure_does_not_record_a_second_outage() {
        let (m, clock) = monitor();
        let a = m.admit().expect("healthy");
        let b = m.admit().expect("healthy");
        fail_once(&m);
        assert!(matches!(m.report(a, BackendOutcome::BackendError), ReportEffect::Stale { .. }));
        clock.advance_ms(COOLDOWN_MS);
        let probe = m.admit().expect("probe");
        assert_eq!(
            m.report(probe, BackendOutcome::Succeeded),
            ReportEffect::Recovered { epoch: 1 }
        );
        assert!(matches!(m.report(b, BackendOutcome::BackendError), ReportEffect::Stale { .. }));
        assert_eq!(m.snapshot(), HealthSnapshot { state: HealthState::Healthy, epoch: 1 });
    }

    #[test]
    fn reading_health_does_not_consume_the_probe() {
        let (m, clock) = monitor();
        fail_once(&m);
        clock.advance_ms(COOLDOWN_MS);
        for _ in 0..5 {
            let snap = m.snapshot();
            assert_eq!(snap.state, HealthState::CoolingDown { until_ms: COOLDOWN_MS });
            assert_eq!(snap.epoch, 1);
        }
        let probe = m.admit().expect("the probe is still there");
        assert!(probe.is_probe());
        assert_eq!(m.snapshot().state, HealthState::Probing { since_ms: COOLDOWN_MS });
    }

    #[test]
    fn ordinary_calls_without_evidence_change_nothing() {
        let (m, _) = monitor();
        let a = m.admit().expect("healthy");
        assert_eq!(m.report(a, BackendOutcome::NotAttempted), ReportEffect::Unchanged);
        assert_eq!(m.snapshot(), HealthSnapshot { state: HealthState::Healthy, epoch: 0 });
    }

    #[test]
    fn outage_classification_follows_the_contract() {
        use BackendOutcome as O;
        let table = [
            (O::Succeeded, Evidence::Healthy),
            (O::ExistenceMiss, Evidence::Healthy),
            (O::RetiredGetMiss, Evidence::Healthy),
            (O::PutAlreadyExists, Evidence::Healthy),
            (O::RetiredPutCapacityRejection, Evidence::Healthy),
            (O::CallerRefused, Evidence::Healthy),
            (O::BackendError, Evidence::Outage),
            (O::UnretiredPutFailure, Evidence::Outage),
            (O::UnknownNativeFailure, Evidence::Outage),
            (O::NotAttempted, Evidence::Nothing),
        ];
        assert_eq!(table.len(), O::ALL.len());
        for ((outcome, evidence), listed) in table.into_iter().zip(O::ALL) {
            assert_eq!(outcome, listed, "ALL and the table list outcomes in the same order");
            assert_eq!(outcome.evidence(), evidence, "{outcome:?}");
            assert_eq!(outcome.counts_as_outage(), evidence == Evidence::Outage, "{outcome:?}");
        }
    }

    #[test]
    fn each_outcome_moves_a_healthy_monitor_as_classified() {
        for outcome in BackendOutcome::ALL {
            let (m, _) = monitor();
            let a = m.admit().expect("healthy");
            let effect = m.report(a, outcome);
            if outcome.counts_as_outage() {
                assert_eq!(
                    effect,
                    ReportEffect::OutageRecorded { epoch: 1, until_ms: COOLDOWN_MS },
                    "{outcome:?}"
                );
            } else {
                assert_eq!(effect, ReportEffect::Unchanged, "{outcome:?}");
                assert_eq!(m.snapshot().state, HealthState::Healthy, "{outcome:?}");
            }
        }
    }

    #[test]
    fn store_errors_map_to_outcomes() {
        let unknown = StoreError::Backend {
            operation: "get",
            detail: "transport reset".into(),
            retirement: Retirement::Unknown,
        };
        let retired = StoreError::Backend {
            operation: "get",
            detail: "transport reset".into(),
            retirement: Retirement::Retired,
        };
        let refused = StoreError::BufferTooSmall { needed: 8, provided: 4 };
        assert_eq!(
            BackendOutcome::from_store_error(&unknown),
            BackendOutcome::UnknownNativeFailure
        );
        assert_eq!(BackendOutcome::from_store_error(&retired), BackendOutcome::BackendError);
        assert_eq!(BackendOutcome::from_store_error(&refused), BackendOutcome::CallerRefused);
        // A failed file-system step and a failed socket are failures of the backend too.
        let storage = StoreError::Storage {
            operation: "get",
            step: "block read",
            path: "/cache/blocks/ab/x.blk".into(),
            kind: std::io::ErrorKind::PermissionDenied,
            detail: "permission denied".into(),
            effect: gpucache_dataplane::store::StorageEffect::Unchanged,
            retirement: Retirement::Retired,
        };
        assert_eq!(BackendOutcome::from_store_error(&storage), BackendOutcome::BackendError);
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let io = StoreError::io("get", "transport", &reset);
        assert_eq!(BackendOutcome::from_store_error(&io), BackendOutcome::BackendError);
        let io_unknown = StoreError::Io {
            operation: "get",
            kind: std::io::ErrorKind::ConnectionReset,
            detail: "transport: connection reset".into(),
            retirement: Retirement::Unknown,
        };
        assert_eq!(
            BackendOutcome::from_store_error(&io_unknown),
            BackendOutcome::UnknownNativeFailure
        );
    }

    #[test]
    fn rejection_and_state_display() {
        assert_eq!(
            Rejected::CoolingDown { epoch: 3, until_ms: 1_500 }.to_string(),
            "backend unhealthy (health epoch 3): cooling down until 1500 ms"
        );
        assert_eq!(
            Rejected::ProbeInFlight { epoch: 3, since_ms: 1_500 }.to_string(),
            "backend unhealthy (health epoch 3): a recovery probe is running since 1500 ms"
        );
        assert_eq!(HealthState::Healthy.to_string(), "healthy");
        assert_eq!(HealthState::CoolingDown { until_ms: 9 }.to_string(), "cooling down until 9 ms");
        assert_eq!(HealthState::Probing { since_ms: 9 }.to_string(), "probing since 9 ms");
    }

    /// A seeded walk of admissions, reports and clock steps against the rules: never two
    /// probes out at once, nothing admitted during a cooldown, and epochs only grow.
    #[test]
    fn seeded_walk_keeps_the_invariants() {
        for seed in 0..32_u64 {
            let (m, clock) = monitor();
            // The seed reproduces the walk.
            let mut rng = gpucache_dataplane::rng::SplitMix64::new(seed);
            let mut next = || rng.next_u64();
            let mut out: Vec<Admission> = Vec::new();
            let mut last_epoch = 0;
            for _ in 0..400 {
                match next() % 3 {
                    0 => {
                        let before = m.snapshot();
                        match m.admit() {
                            Ok(a) => {
                                if a.is_probe() {
                                    assert!(
                                        !out.iter().any(|o| o.is_probe() && o.epoch() == a.epoch()),
                                        "seed {seed}: two probes in epoch {}",
                                        a.epoch()
                                    );
                                } else {
                                    assert_eq!(before.state, HealthState::Healthy, "seed {seed}");
                                }
                                out.push(a);
                            }
                            Err(_) => assert_ne!(before.state, HealthState::Healthy, "seed {seed}"),
                        }
                    }
                    1 if !out.is_empty() => {
                        let pick = usize::try_from(next()).unwrap_or(0) % out.len();
                        let a = out.swap_remove(pick);
                        let outcome_index =
                            usize::try_from(next()).unwrap_or(0) % BackendOutcome::ALL.len();
                        m.report(a, BackendOutcome::ALL[outcome_index]);
                    }
                    _ => clock.advance_ms(next() % (COOLDOWN_MS / 2)),
                }
                let epoch = m.snapshot().epoch;
                assert!(epoch >= last_epoch, "seed {seed}: epoch went back");
                last_epoch = epoch;
            }
        }
    }
}
