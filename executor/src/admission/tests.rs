//! Deterministic tests of every admission rule: a `ManualClock` and explicit ticks. The credit
//! accounting's own tests are in `gpucache_dataplane::credits`.

use std::num::NonZeroUsize;
use std::sync::Arc as StdArc;

use super::*;
use gpucache_dataplane::clock::ManualClock;

const SOFT_DEADLINE_MS: u64 = 100;
const READY_HOLD_MS: u64 = 50;

fn config(credits: Credits, candidates_max: usize) -> AdmissionConfig {
    AdmissionConfig {
        credits,
        soft_deadline_ms: SOFT_DEADLINE_MS,
        ready_hold_ms: READY_HOLD_MS,
        backup_candidates_max: NonZeroUsize::new(candidates_max).expect("nonzero"),
        watermarks: PressureWatermarks {
            queued_jobs: Watermark { high: 10, low: 4 },
            queued_payload_bytes: Watermark { high: 1_000, low: 100 },
            oldest_job_age_ms: Watermark { high: 500, low: 50 },
        },
    }
}

fn controller(credits: Credits, candidates_max: usize) -> (AdmissionController, ManualClock) {
    let clock = ManualClock::default();
    let ctl = AdmissionController::new(config(credits, candidates_max), StdArc::new(clock.clone()))
        .expect("valid config");
    (ctl, clock)
}

fn calm() -> PressureSnapshot {
    PressureSnapshot::default()
}

fn queued_jobs(n: u32) -> PressureSnapshot {
    PressureSnapshot { queued_get_jobs: n, ..PressureSnapshot::default() }
}

fn query(ctl: &mut AdmissionController, request: u64) -> (OperationId, StorageLease) {
    match ctl.prepare(RequestKey(request)) {
        Prepare::Query { op, lease } => (op, lease),
        Prepare::Bypass(b) => panic!("request {request} bypassed: {b:?}"),
    }
}

/// Prepares, answers the query and issues a GET of `host_blocks`.
fn get(
    ctl: &mut AdmissionController,
    request: u64,
    host_blocks: u32,
) -> (OperationId, StorageLease) {
    let (q, lease) = query(ctl, request);
    assert_eq!(ctl.query_done(q), Ok(Completion::QueryAnswered(RequestKey(request))));
    match ctl.begin_get(&lease, host_blocks) {
        Ok(GetStart::Issued(op)) => (op, lease),
        other => panic!("GET not issued: {other:?}"),
    }
}

// ---- leases and tickets ----

#[test]
fn lease_drop_detaches_the_request_from_its_ticket() {
    let (mut ctl, _clock) = controller(Credits::new(4, 8), 8);
    let (op, lease) = get(&mut ctl, 1, 3);
    assert_eq!(lease.outcome(), WaitOutcome::Waiting(WaitPhase::Get));
    drop(lease);
    // The GET's native I/O still holds its credits until it retires.
    assert_eq!(ctl.pool().usage().total, Credits::new(1, 3));
    let report = ctl.tick(&calm());
    assert!(report.resolved.is_empty(), "client detachment is no timeout: {report:?}");
    assert_eq!(ctl.waiting(), 0);
    assert_eq!(ctl.get_done(op, NativeRetirement::Retired), Ok(Completion::Detached));
    assert_eq!(ctl.ready_holds(), 0);
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
    assert_eq!(ctl.counters(), AdmissionCounters::default());
}

#[test]
fn lease_drop_returns_a_ready_holds_credits() {
    let (mut ctl, _clock) = controller(Credits::new(4, 8), 8);
    let (op, lease) = get(&mut ctl, 1, 3);
    assert_eq!(ctl.get_done(op, NativeRetirement::Retired), Ok(Completion::Ready(RequestKey(1))));
    assert_eq!(lease.outcome(), WaitOutcome::Ready);
    assert_eq!(ctl.pool().usage().total, Credits::new(1, 3));
    drop(lease);
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
    assert!(ctl.tick(&calm()).resolved.is_empty());
    assert_eq!(ctl.ready_holds(), 0);
}

#[test]
fn a_detached_query_cannot_lead_to_a_get() {
    let (mut ctl, _clock) = controller(Credits::new(4, 8), 8);
    let (q, lease) = query(&mut ctl, 7);
    let ticket = lease.ticket();
    drop(lease);
    assert_eq!(ctl.query_done(q), Ok(Completion::Detached));
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
    assert_eq!(ctl.query_done(q), Err(AdmissionError::UnknownOperation(q)));
    let (_q2, other) = query(&mut ctl, 8);
    assert_ne!(other.ticket(), ticket);
    assert_eq!(ctl.begin_get(&other, 1), Err(AdmissionError::NotAwaitingGet(other.ticket())));
}

#[test]
fn operation_ids_increase_and_completions_check_their_kind() {
    let (mut ctl, _clock) = controller(Credits::new(4, 8), 8);
    let (q1, _a) = query(&mut ctl, 1);
    let (q2, _b) = query(&mut ctl, 2);
    assert!(q2 > q1);
    assert_eq!(
        ctl.get_done(q1, NativeRetirement::Retired),
        Err(AdmissionError::WrongOperation {
            op: q1,
            expected: WaitPhase::Get,
            actual: WaitPhase::Query
        })
    );
}

// ---- soft deadlines ----

#[test]
fn soft_deadline_expires_at_a_tick_and_not_before() {
    let (mut ctl, clock) = controller(Credits::new(4, 8), 8);
    let (_q, lease) = query(&mut ctl, 1);
    clock.advance_ms(SOFT_DEADLINE_MS - 1);
    assert!(ctl.tick(&calm()).resolved.is_empty());
    assert_eq!(lease.outcome(), WaitOutcome::Waiting(WaitPhase::Query));
    clock.advance_ms(1);
    // The deadline has passed, but only a tick processes it.
    assert_eq!(lease.outcome(), WaitOutcome::Waiting(WaitPhase::Query));
    let report = ctl.tick(&calm());
    assert_eq!(
        report.resolved,
        vec![Resolved {
            request: RequestKey(1),
            ticket: lease.ticket(),
            reason: LocalReason::SoftTimeout
        }]
    );
    assert_eq!(lease.outcome(), WaitOutcome::Local(LocalReason::SoftTimeout));
    assert_eq!(ctl.counters().soft_timeouts, 1);
    assert!(ctl.tick(&calm()).resolved.is_empty(), "a timeout is reported once");
}

#[test]
fn soft_deadline_counts_from_the_query_through_the_get() {
    let (mut ctl, clock) = controller(Credits::new(4, 8), 8);
    let (q, lease) = query(&mut ctl, 1);
    clock.advance_ms(60);
    assert_eq!(ctl.query_done(q), Ok(Completion::QueryAnswered(RequestKey(1))));
    let Ok(GetStart::Issued(g)) = ctl.begin_get(&lease, 2) else { panic!("GET not issued") };
    clock.advance_ms(SOFT_DEADLINE_MS - 60);
    let report = ctl.tick(&calm());
    assert_eq!(report.resolved.len(), 1);
    assert_eq!(report.resolved[0].reason, LocalReason::SoftTimeout);
    // A soft timeout ends the wait, not the native I/O: the GET keeps its credits until it
    // retires, and its late result cannot publish.
    assert_eq!(ctl.pool().usage().total, Credits::new(1, 2));
    assert_eq!(ctl.get_done(g, NativeRetirement::Retired), Ok(Completion::Detached));
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
    assert_eq!(lease.outcome(), WaitOutcome::Local(LocalReason::SoftTimeout));
}

// ---- Ready holds ----

#[test]
fn ready_hold_expires_on_its_own_at_a_tick() {
    let (mut ctl, clock) = controller(Credits::new(4, 8), 8);
    let (g, lease) = get(&mut ctl, 1, 3);
    clock.advance_ms(10);
    assert_eq!(ctl.get_done(g, NativeRetirement::Retired), Ok(Completion::Ready(RequestKey(1))));
    // The hold has its own clock: past the soft deadline it is still held.
    clock.advance_ms(READY_HOLD_MS - 1);
    assert!(ctl.tick(&calm()).resolved.is_empty());
    assert_eq!(lease.outcome(), WaitOutcome::Ready);
    clock.advance_ms(1);
    assert_eq!(ctl.pool().usage().total, Credits::new(1, 3), "no expiry between ticks");
    let report = ctl.tick(&calm());
    assert_eq!(
        report.resolved,
        vec![Resolved {
            request: RequestKey(1),
            ticket: lease.ticket(),
            reason: LocalReason::ReadyExpired
        }]
    );
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
    assert_eq!(lease.outcome(), WaitOutcome::Local(LocalReason::ReadyExpired));
    assert_eq!(ctl.counters().ready_expired, 1);
    assert_eq!(ctl.counters().soft_timeouts, 0);
    assert!(ctl.take_ready(lease).is_none());
}

#[test]
fn admission_takes_a_ready_hold_with_its_credits() {
    let (mut ctl, clock) = controller(Credits::new(4, 8), 8);
    let (g, lease) = get(&mut ctl, 1, 3);
    assert_eq!(ctl.get_done(g, NativeRetirement::Retired), Ok(Completion::Ready(RequestKey(1))));
    let grant = ctl.take_ready(lease).expect("hold still live");
    assert_eq!(grant.amount(), Credits::new(1, 3));
    assert_eq!(ctl.ready_holds(), 0);
    clock.advance_ms(READY_HOLD_MS * 2);
    assert!(ctl.tick(&calm()).resolved.is_empty());
    assert_eq!(ctl.pool().usage().total, Credits::new(1, 3), "the H2D side holds them now");
    drop(grant);
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
}

#[test]
fn an_unretired_get_quarantines_its_credits() {
    let (mut ctl, _clock) = controller(Credits::new(4, 8), 8);
    let (g, lease) = get(&mut ctl, 1, 3);
    assert_eq!(ctl.get_done(g, NativeRetirement::Unknown), Ok(Completion::Quarantined));
    assert_eq!(lease.outcome(), WaitOutcome::Local(LocalReason::Unretired));
    drop(lease);
    assert_eq!(ctl.quarantined_credits(), Credits::new(1, 3));
    assert_eq!(ctl.pool().usage().total, Credits::new(1, 3));
}

#[test]
fn get_refused_for_credits_can_retry_shorter() {
    let (mut ctl, _clock) = controller(Credits::new(4, 4), 8);
    let (q, lease) = query(&mut ctl, 1);
    assert_eq!(ctl.query_done(q), Ok(Completion::QueryAnswered(RequestKey(1))));
    assert!(matches!(
        ctl.begin_get(&lease, 5),
        Ok(GetStart::Refused(CreditRefusal::NeverFits { requested: 5, limit: 4, .. }))
    ));
    assert!(matches!(ctl.begin_get(&lease, 4), Ok(GetStart::Issued(_))));
}

#[test]
fn host_credit_exhaustion_bypasses_a_new_query() {
    let (mut ctl, _clock) = controller(Credits::new(4, 2), 8);
    let (_g, _lease) = get(&mut ctl, 1, 2);
    match ctl.prepare(RequestKey(2)) {
        Prepare::Bypass(Bypass::Credits(CreditRefusal::Exhausted {
            kind: CreditKind::HostBlocks,
            held: 2,
            limit: 2,
            ..
        })) => {}
        other => panic!("expected a Host-credit bypass, got {other:?}"),
    }
    assert_eq!(ctl.counters().credit_bypasses, 1);
}

// ---- the gate ----

fn gate() -> AdmissionGate {
    AdmissionGate::new(config(Credits::new(1, 1), 1).watermarks).expect("valid watermarks")
}

#[test]
fn gate_closes_when_any_observation_reaches_its_high_watermark() {
    let cases = [
        (queued_jobs(10), Observation::QueuedJobs, 10, 10),
        (
            PressureSnapshot { queued_put_payload_bytes: 1_200, ..calm() },
            Observation::QueuedPayloadBytes,
            1_200,
            1_000,
        ),
        (
            PressureSnapshot { oldest_job_age_ms: 500, ..calm() },
            Observation::OldestJobAge,
            500,
            500,
        ),
    ];
    for (snapshot, trigger, value, high) in cases {
        let mut g = gate();
        assert_eq!(g.observe(&queued_jobs(9)), GateChange::Unchanged, "below high stays open");
        assert_eq!(g.observe(&snapshot), GateChange::Closed { trigger, value, high });
        assert_eq!(g.state(), GateState::Closed { trigger, value, high });
    }
}

#[test]
fn gate_stays_closed_until_every_observation_is_at_or_below_low() {
    let mut g = gate();
    assert!(matches!(g.observe(&queued_jobs(12)), GateChange::Closed { .. }));
    // Below high but above low: still closed.
    assert_eq!(g.observe(&queued_jobs(5)), GateChange::Unchanged);
    // Jobs at their low, but the age is still above its own low.
    let aged = PressureSnapshot { oldest_job_age_ms: 51, ..queued_jobs(4) };
    assert_eq!(g.observe(&aged), GateChange::Unchanged);
    assert!(!g.is_open());
    let all_low = PressureSnapshot {
        queued_query_jobs: 2,
        queued_get_jobs: 1,
        queued_put_jobs: 1,
        queued_get_payload_bytes: 60,
        queued_put_payload_bytes: 40,
        oldest_job_age_ms: 50,
    };
    assert_eq!(g.observe(&all_low), GateChange::Reopened);
    assert!(g.is_open());
    assert_eq!(g.observe(&queued_jobs(9)), GateChange::Unchanged);
}

#[test]
fn watermarks_need_low_below_high() {
    let mut w = config(Credits::new(1, 1), 1).watermarks;
    w.oldest_job_age_ms = Watermark { high: 50, low: 50 };
    let err = AdmissionGate::new(w).expect_err("equal marks");
    assert_eq!(err, WatermarkError { observation: Observation::OldestJobAge, low: 50, high: 50 });
    assert_eq!(
        err.to_string(),
        "oldest_job_age_ms low watermark 50 is not below its high watermark 50"
    );
    let mut c = config(Credits::new(1, 1), 1);
    c.ready_hold_ms = 0;
    assert_eq!(c.validate(), Err(ConfigError::ZeroDuration { name: "ready_hold_ms" }));
    assert_eq!(c.validate().map_err(|e| e.to_string()), Err("ready_hold_ms is zero".into()));
}

#[test]
fn pressure_snapshots_combine_by_maximum() {
    let a = PressureSnapshot { queued_get_jobs: 3, oldest_job_age_ms: 9, ..calm() };
    let b = PressureSnapshot { queued_get_jobs: 1, queued_put_payload_bytes: 7, ..calm() };
    let m = a.max(b);
    assert_eq!(m.queued_get_jobs, 3);
    assert_eq!(m.queued_put_payload_bytes, 7);
    assert_eq!(m.oldest_job_age_ms, 9);
    assert_eq!(m.queued_jobs(), 3);
    assert_eq!(m.queued_payload_bytes(), 7);
}

#[test]
fn closed_gate_bypasses_a_new_request() {
    let (mut ctl, _clock) = controller(Credits::new(4, 8), 8);
    assert!(matches!(ctl.tick(&queued_jobs(10)).gate, GateChange::Closed { .. }));
    assert!(matches!(ctl.prepare(RequestKey(1)), Prepare::Bypass(Bypass::Pressure)));
    assert_eq!(ctl.counters().pressure_bypasses, 1);
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
}

#[test]
fn closing_the_gate_detaches_a_query_wait_but_not_a_get_or_a_ready_hold() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 8);
    let (_q, querying) = query(&mut ctl, 1);
    let (_g, reading) = get(&mut ctl, 2, 2);
    let (g3, ready) = get(&mut ctl, 3, 2);
    assert_eq!(ctl.get_done(g3, NativeRetirement::Retired), Ok(Completion::Ready(RequestKey(3))));
    let report = ctl.tick(&queued_jobs(10));
    assert_eq!(
        report.resolved,
        vec![Resolved {
            request: RequestKey(1),
            ticket: querying.ticket(),
            reason: LocalReason::Pressure
        }]
    );
    assert_eq!(querying.outcome(), WaitOutcome::Local(LocalReason::Pressure));
    assert_eq!(reading.outcome(), WaitOutcome::Waiting(WaitPhase::Get));
    assert_eq!(ready.outcome(), WaitOutcome::Ready);
    assert_eq!(ctl.counters().pressure_detaches, 1);
}

#[test]
fn closed_gate_stops_a_new_get() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 8);
    // Answered before the gate closed, GET not yet issued: the closing tick detaches it.
    let (q, answered) = query(&mut ctl, 1);
    assert_eq!(ctl.query_done(q), Ok(Completion::QueryAnswered(RequestKey(1))));
    // Still querying when the gate closes: its answer arrives detached.
    let (q2, querying) = query(&mut ctl, 2);
    assert_eq!(ctl.tick(&queued_jobs(10)).resolved.len(), 2);
    assert_eq!(ctl.begin_get(&answered, 1), Ok(GetStart::Local(LocalReason::Pressure)));
    assert_eq!(ctl.query_done(q2), Ok(Completion::Detached));
    assert_eq!(querying.outcome(), WaitOutcome::Local(LocalReason::Pressure));
    assert_eq!(ctl.begin_get(&querying, 1), Ok(GetStart::Local(LocalReason::Pressure)));
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
}

// ---- backup candidates ----

fn resident(_: CandidateId) -> bool {
    true
}

#[test]
fn overflow_drops_the_oldest_candidate() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 3);
    for id in 1..=3 {
        assert_eq!(ctl.offer_backup(CandidateId(id)), Offer::Queued);
    }
    assert_eq!(ctl.offer_backup(CandidateId(4)), Offer::QueuedDisplacing(CandidateId(1)));
    assert_eq!(ctl.backups().len(), 3);
    assert_eq!(ctl.backups().drops(), BackupDrops { overflow: 1, ..BackupDrops::default() });
    let puts = ctl.dispatch_backups(8, resident);
    let order: Vec<_> = puts.iter().map(PendingPut::candidate).collect();
    // The backup share of 8 is 4, so all three fit; the dropped one never comes back.
    assert_eq!(order, vec![CandidateId(2), CandidateId(3), CandidateId(4)]);
}

#[test]
fn dispatch_rechecks_host_residency() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 8);
    for id in 1..=4 {
        assert_eq!(ctl.offer_backup(CandidateId(id)), Offer::Queued);
    }
    let mut asked = Vec::new();
    let puts = ctl.dispatch_backups(8, |c| {
        asked.push(c);
        c.0 % 2 == 0
    });
    assert_eq!(asked, (1..=4).map(CandidateId).collect::<Vec<_>>());
    let sent: Vec<_> = puts.iter().map(PendingPut::candidate).collect();
    assert_eq!(sent, vec![CandidateId(2), CandidateId(4)]);
    assert_eq!(ctl.backups().drops(), BackupDrops { unavailable: 2, ..BackupDrops::default() });
    assert_eq!(ctl.pool().usage().backup, Credits::new(2, 2));
    for put in puts {
        assert_eq!(put.credits(), backup::PUT_CREDITS);
        ctl.retire_put(put);
    }
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
}

#[test]
fn temporary_exhaustion_keeps_candidates_queued() {
    // Backup share: 2 operations, 2 Host blocks.
    let (mut ctl, _clock) = controller(Credits::new(5, 5), 8);
    for id in 1..=4 {
        assert_eq!(ctl.offer_backup(CandidateId(id)), Offer::Queued);
    }
    let first = ctl.dispatch_backups(8, resident);
    assert_eq!(first.len(), 2);
    assert_eq!(ctl.backups().len(), 2);
    assert!(ctl.dispatch_backups(8, resident).is_empty(), "share is busy, nothing dropped");
    assert_eq!(ctl.backups().len(), 2);
    assert_eq!(ctl.backups().drops().total(), 0);
    for put in first {
        ctl.retire_put(put);
    }
    let second = ctl.dispatch_backups(8, resident);
    let sent: Vec<_> = second.iter().map(PendingPut::candidate).collect();
    assert_eq!(sent, vec![CandidateId(3), CandidateId(4)]);
}

#[test]
fn zero_backup_budget_rejects_candidates_at_once() {
    for credits in [Credits::new(1, 8), Credits::new(8, 1), Credits::new(0, 0)] {
        let (mut ctl, _clock) = controller(credits, 8);
        assert_eq!(ctl.offer_backup(CandidateId(1)), Offer::Rejected(DropReason::Disabled));
        assert_eq!(ctl.offer_backup(CandidateId(2)), Offer::Rejected(DropReason::Disabled));
        assert!(ctl.backups().is_empty());
        assert_eq!(ctl.backups().drops(), BackupDrops { disabled: 2, ..BackupDrops::default() });
    }
}

#[test]
fn coalescing_a_candidate_is_not_a_drop() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 8);
    assert_eq!(ctl.offer_backup(CandidateId(1)), Offer::Queued);
    assert_eq!(ctl.offer_backup(CandidateId(1)), Offer::Coalesced, "already queued");
    let puts = ctl.dispatch_backups(1, resident);
    assert_eq!(puts.len(), 1);
    assert_eq!(ctl.offer_backup(CandidateId(1)), Offer::Coalesced, "covered by a pending PUT");
    assert_eq!(ctl.backups().coalesced(), 2);
    assert_eq!(ctl.backups().drops().total(), 0);
    assert!(ctl.backups().is_empty());
    for put in puts {
        ctl.retire_put(put);
    }
    assert_eq!(ctl.offer_backup(CandidateId(1)), Offer::Queued, "retired: a new backup");
}

#[test]
fn a_dropped_pending_put_ends_like_a_retired_one() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 8);
    assert_eq!(ctl.offer_backup(CandidateId(1)), Offer::Queued);
    let puts = ctl.dispatch_backups(1, resident);
    assert_eq!(ctl.backups().pending_puts(), 1);
    drop(puts);
    assert_eq!(ctl.backups().pending_puts(), 0);
    assert_eq!(ctl.pool().usage(), CreditUsage::default());
    assert_eq!(ctl.offer_backup(CandidateId(1)), Offer::Queued, "no stale coalescing");
}

#[test]
fn closing_the_gate_drops_candidates_as_pressure_and_rejects_new_ones() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 8);
    for id in 1..=3 {
        assert_eq!(ctl.offer_backup(CandidateId(id)), Offer::Queued);
    }
    let inflight = ctl.dispatch_backups(1, resident);
    assert!(matches!(ctl.tick(&queued_jobs(10)).gate, GateChange::Closed { .. }));
    assert!(ctl.backups().is_empty());
    assert_eq!(ctl.offer_backup(CandidateId(9)), Offer::Rejected(DropReason::Pressure));
    assert_eq!(ctl.backups().drops(), BackupDrops { pressure: 3, ..BackupDrops::default() });
    // The PUT already dispatched continues; recovery replays nothing.
    assert_eq!(ctl.backups().pending_puts(), 1);
    assert_eq!(ctl.tick(&calm()).gate, GateChange::Reopened);
    assert!(ctl.dispatch_backups(8, resident).is_empty());
    for put in inflight {
        ctl.retire_put(put);
    }
}

#[test]
fn cleanup_discards_queued_candidates_under_its_own_reason() {
    let (mut ctl, _clock) = controller(Credits::new(8, 8), 8);
    for id in 1..=2 {
        assert_eq!(ctl.offer_backup(CandidateId(id)), Offer::Queued);
    }
    assert_eq!(ctl.cleanup_backups(), 2);
    assert_eq!(ctl.backups().drops(), BackupDrops { cleanup: 2, ..BackupDrops::default() });
    let labels: Vec<_> = DropReason::ALL.iter().map(|r| r.label()).collect();
    assert_eq!(labels, ["pressure", "overflow", "unavailable", "disabled", "cleanup"]);
}
