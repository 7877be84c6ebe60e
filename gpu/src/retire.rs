//! From a copy's completion event to the registration contract's retirement fact, and from
//! there to the slots it touched.
//!
//! A copy is retired only when its event says so. An event error, or no completion by
//! `deadline_ms`, is [`Completion::Unknown`]: the DMA engine may still read or write both slots,
//! so the device slot and the staging slot are quarantined in their pools. Nothing here frees a
//! quarantined slot; only [`TransferBook::fence`], which demands a [`StreamDrained`] proof, does.
//!
//! The waiting is generic over [`CompletionEvent`], so the whole state machine is tested with a
//! scripted event on a manual clock; [`crate::stream::CudaEvent`] is the real one
//! (`cuEventQuery`). The wait polls: `spin_polls` tight polls, then a `yield_now` between
//! polls, never a sleep.

use std::num::NonZeroUsize;

use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::lifecycle::ReclaimProof;
use gpucache_dataplane::registry::{
    CompleteOutcome, Completion, PoolMemory, RegionId, RegisteredPool, SlotLease,
};

use crate::error::GpuError;

/// What an event says when asked once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventStatus {
    /// Everything recorded before the event has finished.
    Complete,
    /// Still running.
    Pending,
    /// The query failed (the context holds a sticky error, the event is invalid).
    Failed { code: u32 },
}

/// A completion event that can be asked, without blocking, whether the work before it is done.
pub trait CompletionEvent {
    fn query(&mut self) -> EventStatus;
}

/// How long to wait for one copy, and how to poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetireLimits {
    /// After this many milliseconds without completion the copy's outcome is unknown.
    pub deadline_ms: u64,
    /// Tight polls before each poll yields the thread.
    pub spin_polls: u32,
}

/// A 64 MiB block at a pessimistic 1 GB/s takes 64 ms: two seconds leaves room for a stream
/// shared with other work, and is still short enough to quarantine a hung copy promptly.
pub const TRANSFER_DEADLINE_MS: u64 = 2_000;
/// Tight polls before yielding: a 64 KiB copy finishes in a few microseconds.
pub const SPIN_POLLS: u32 = 1_000;

impl Default for RetireLimits {
    fn default() -> Self {
        Self { deadline_ms: TRANSFER_DEADLINE_MS, spin_polls: SPIN_POLLS }
    }
}

/// How a wait for one event ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retirement {
    /// The event completed: the copy stopped touching both slots.
    Retired,
    /// The event query failed: the copy's fate is unknown.
    EventFailed { code: u32 },
    /// No completion by the deadline: the copy may still be running.
    DeadlineMissed { waited_ms: u64 },
}

impl Retirement {
    /// The registration contract's fact for this ending.
    pub fn completion(self) -> Completion {
        match self {
            Self::Retired => Completion::Retired,
            Self::EventFailed { .. } | Self::DeadlineMissed { .. } => Completion::Unknown,
        }
    }
}

/// Polls `event` until it completes, fails, or `limits.deadline_ms` passes on `clock`.
pub fn await_event(
    event: &mut dyn CompletionEvent,
    clock: &dyn Clock,
    limits: RetireLimits,
) -> Retirement {
    let start = clock.now_ms();
    let mut polls: u64 = 0;
    loop {
        match event.query() {
            EventStatus::Complete => return Retirement::Retired,
            EventStatus::Failed { code } => return Retirement::EventFailed { code },
            EventStatus::Pending => {}
        }
        let waited_ms = clock.now_ms().saturating_sub(start);
        if waited_ms >= limits.deadline_ms {
            return Retirement::DeadlineMissed { waited_ms };
        }
        polls = polls.saturating_add(1);
        if polls > u64::from(limits.spin_polls) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Proof that a stream (or the whole context) drained: a synchronize call returned success, so
/// no copy submitted before it can still touch memory. Only a drain can make one.
#[derive(Debug)]
pub struct StreamDrained {
    _private: (),
}

impl StreamDrained {
    /// Made only where the drain was observed: [`crate::stream::GpuStream::synchronize`], and
    /// this crate's tests of the fence on a fake stream.
    pub(crate) fn observed() -> Self {
        Self { _private: () }
    }
}

/// A copy in flight, for [`TransferBook::settle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "t{}", self.0)
    }
}

#[derive(Debug)]
struct Pending<E> {
    id: TransferId,
    device: RegionId,
    staging: RegionId,
    event: E,
}

/// What settling one copy found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub transfer: TransferId,
    pub retirement: Retirement,
    /// `None` when retired: the leases stay with the caller for the next copy or release.
    pub device_outcome: Option<CompleteOutcome>,
    pub staging_outcome: Option<CompleteOutcome>,
}

impl Settled {
    pub fn completion(&self) -> Completion {
        self.retirement.completion()
    }
}

/// What a fence returned to the pools.
#[derive(Debug)]
pub struct FenceReport {
    pub device: Vec<ReclaimProof>,
    pub staging: Vec<ReclaimProof>,
    /// Copies still recorded as in flight that the drain proved finished.
    pub forgotten: usize,
}

/// Counters of one book.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferCounters {
    pub submitted: u64,
    pub retired: u64,
    pub unknown: u64,
}

/// The copies in flight on one stream, bounded by `in_flight_max`, and the rule that maps
/// their events onto the two pools whose slots they touch.
#[derive(Debug)]
pub struct TransferBook<E> {
    pending: Vec<Pending<E>>,
    in_flight_max: NonZeroUsize,
    next_id: u64,
    limits: RetireLimits,
    counters: TransferCounters,
}

/// Copies one stream may have in flight by default.
pub const IN_FLIGHT_MAX: usize = 64;

/// Quarantines the two slots of a copy whose end is unknown. Both pools are asked whatever the
/// first answers, so a refusal from one never leaves the other slot lent.
fn quarantine_both<D: PoolMemory, S: PoolMemory>(
    device_pool: &mut RegisteredPool<D>,
    device: RegionId,
    staging_pool: &mut RegisteredPool<S>,
    staging: RegionId,
) -> Result<(CompleteOutcome, CompleteOutcome), GpuError> {
    let device = device_pool.complete(device, Completion::Unknown);
    let staging = staging_pool.complete(staging, Completion::Unknown);
    Ok((device?, staging?))
}

impl<E: CompletionEvent> TransferBook<E> {
    pub fn new(in_flight_max: NonZeroUsize, limits: RetireLimits) -> Self {
        Self {
            pending: Vec::with_capacity(in_flight_max.get()),
            in_flight_max,
            next_id: 1,
            limits,
            counters: TransferCounters::default(),
        }
    }

    pub fn limits(&self) -> RetireLimits {
        self.limits
    }
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
    pub fn counters(&self) -> TransferCounters {
        self.counters
    }

    /// Refuses a new copy when the stream is full or either lease no longer holds its slot.
    /// Called before anything is submitted to the device.
    pub fn admit<D: PoolMemory, S: PoolMemory>(
        &self,
        device_pool: &RegisteredPool<D>,
        device: &SlotLease,
        staging_pool: &RegisteredPool<S>,
        staging: &SlotLease,
    ) -> Result<(), GpuError> {
        if self.pending.len() >= self.in_flight_max.get() {
            return Err(GpuError::InFlightFull {
                in_flight: self.pending.len(),
                max: self.in_flight_max.get(),
            });
        }
        for (lent, region) in [
            (device_pool.holds(device), device.region),
            (staging_pool.holds(staging), staging.region),
        ] {
            if !lent {
                return Err(GpuError::NotLent { region });
            }
        }
        Ok(())
    }

    /// Records a submitted copy and its event. Call only after [`admit`](Self::admit) passed.
    pub fn record(&mut self, device: RegionId, staging: RegionId, event: E) -> TransferId {
        debug_assert!(self.pending.len() < self.in_flight_max.get(), "admit was skipped");
        let id = TransferId(self.next_id);
        self.next_id += 1;
        self.pending.push(Pending { id, device, staging, event });
        self.counters.submitted += 1;
        id
    }

    /// Records a submitted copy whose completion event could not be made: nothing will say when
    /// the DMA engine is done with either slot, so both are quarantined at once (as an unknown
    /// completion would) and only a drain-proven fence returns them. Answers `error`.
    pub fn unobservable<D: PoolMemory, S: PoolMemory>(
        &mut self,
        device_pool: &mut RegisteredPool<D>,
        device: &SlotLease,
        staging_pool: &mut RegisteredPool<S>,
        staging: &SlotLease,
        error: GpuError,
    ) -> GpuError {
        self.counters.submitted += 1;
        self.counters.unknown += 1;
        if let Err(e) = quarantine_both(device_pool, device.region, staging_pool, staging.region) {
            tracing::warn!(error = %e, "quarantine after a lost completion event");
        }
        error
    }

    /// Waits for `transfer`'s event and applies the outcome: retired leaves both leases with the
    /// caller; unknown quarantines both slots in their pools.
    pub fn settle<D: PoolMemory, S: PoolMemory>(
        &mut self,
        transfer: TransferId,
        device_pool: &mut RegisteredPool<D>,
        staging_pool: &mut RegisteredPool<S>,
        clock: &dyn Clock,
    ) -> Result<Settled, GpuError> {
        let at = self
            .pending
            .iter()
            .position(|p| p.id == transfer)
            .ok_or(GpuError::UnknownTransfer { transfer: transfer.0 })?;
        let retirement = await_event(&mut self.pending[at].event, clock, self.limits);
        let Pending { device, staging, .. } = self.pending.swap_remove(at);
        match retirement.completion() {
            Completion::Retired => {
                self.counters.retired += 1;
                Ok(Settled { transfer, retirement, device_outcome: None, staging_outcome: None })
            }
            Completion::Unknown => {
                self.counters.unknown += 1;
                let (device_outcome, staging_outcome) =
                    quarantine_both(device_pool, device, staging_pool, staging)?;
                Ok(Settled {
                    transfer,
                    retirement,
                    device_outcome: Some(device_outcome),
                    staging_outcome: Some(staging_outcome),
                })
            }
        }
    }

    /// After a drain: advances both pools' epochs and returns every slot checked out before them,
    /// quarantined ones included. Leases the caller still holds are void afterwards.
    pub fn fence<D: PoolMemory, S: PoolMemory>(
        &mut self,
        _drained: StreamDrained,
        device_pool: &mut RegisteredPool<D>,
        staging_pool: &mut RegisteredPool<S>,
    ) -> Result<FenceReport, GpuError> {
        let forgotten = self.pending.len();
        self.pending.clear();
        let device_epoch = device_pool.bump_epoch()?;
        let device = device_pool.reclaim_fenced(device_epoch)?;
        let staging_epoch = staging_pool.bump_epoch()?;
        let staging = staging_pool.reclaim_fenced(staging_epoch)?;
        Ok(FenceReport { device, staging, forgotten })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use gpucache_dataplane::clock::ManualClock;
    use gpucache_dataplane::registry::{HostSlots, LocalEpochs, RegionState};
    use gpucache_dataplane::testing::fixture::tenant;

    use super::*;

    /// A scripted event: answers its statuses in order, advancing the shared clock by
    /// `step_ms` on every query; once the script runs out it stays pending.
    #[derive(Debug)]
    struct Scripted {
        answers: VecDeque<EventStatus>,
        clock: ManualClock,
        step_ms: u64,
        queries: u64,
    }

    impl CompletionEvent for Scripted {
        fn query(&mut self) -> EventStatus {
            self.queries += 1;
            self.clock.advance_ms(self.step_ms);
            self.answers.pop_front().unwrap_or(EventStatus::Pending)
        }
    }

    fn scripted(clock: &ManualClock, step_ms: u64, answers: &[EventStatus]) -> Scripted {
        Scripted {
            answers: answers.iter().copied().collect(),
            clock: clock.clone(),
            step_ms,
            queries: 0,
        }
    }

    const LIMITS: RetireLimits = RetireLimits { deadline_ms: 100, spin_polls: 2 };

    fn pool(slots: usize) -> RegisteredPool<HostSlots> {
        RegisteredPool::new(HostSlots::new(slots, 64), Box::new(LocalEpochs))
    }

    fn state<M: PoolMemory>(p: &RegisteredPool<M>, l: &SlotLease) -> Option<RegionState> {
        p.table().get(l.region).map(|r| r.state)
    }

    #[test]
    fn a_completed_event_retires_after_pending_polls() {
        let clock = ManualClock::default();
        let mut e = scripted(
            &clock,
            1,
            &[EventStatus::Pending, EventStatus::Pending, EventStatus::Complete],
        );
        assert_eq!(await_event(&mut e, &clock, LIMITS), Retirement::Retired);
        assert_eq!(e.queries, 3);
        assert_eq!(Retirement::Retired.completion(), Completion::Retired);
    }

    #[test]
    fn an_event_error_is_unknown() {
        let clock = ManualClock::default();
        let mut e = scripted(&clock, 1, &[EventStatus::Pending, EventStatus::Failed { code: 719 }]);
        let r = await_event(&mut e, &clock, LIMITS);
        assert_eq!(r, Retirement::EventFailed { code: 719 });
        assert_eq!(r.completion(), Completion::Unknown);
    }

    #[test]
    fn no_completion_by_the_deadline_is_unknown() {
        let clock = ManualClock::default();
        let mut e = scripted(&clock, 7, &[]);
        let r = await_event(&mut e, &clock, LIMITS);
        // 15 queries of 7 ms reach 105 ms, the first reading at or past 100.
        assert_eq!(r, Retirement::DeadlineMissed { waited_ms: 105 });
        assert_eq!(e.queries, 15);
        assert_eq!(r.completion(), Completion::Unknown);
    }

    #[test]
    fn a_completion_on_the_last_poll_before_the_deadline_still_retires() {
        let clock = ManualClock::default();
        let mut answers = vec![EventStatus::Pending; 9];
        answers.push(EventStatus::Complete);
        let mut e = scripted(&clock, 10, &answers);
        assert_eq!(await_event(&mut e, &clock, LIMITS), Retirement::Retired);
    }

    /// Two copies on one stream: one retires (both leases stay lent), one misses its deadline
    /// (its device and staging slots are quarantined and stay so through a late completion and
    /// a release attempt); only the drain-proven fence returns them.
    #[test]
    fn unknown_quarantines_both_slots_until_the_fence() {
        let clock = ManualClock::default();
        let owner = tenant(0);
        let mut device = pool(4);
        let mut staging = pool(4);
        let d = device.checkout(&owner, 2, None).expect("device slots");
        let s = staging.checkout(&owner, 2, None).expect("staging slots");
        let mut book = TransferBook::new(NonZeroUsize::new(2).expect("nonzero"), LIMITS);

        book.admit(&device, &d[0], &staging, &s[0]).expect("room");
        let ok =
            book.record(d[0].region, s[0].region, scripted(&clock, 1, &[EventStatus::Complete]));
        book.admit(&device, &d[1], &staging, &s[1]).expect("room");
        let hung = book.record(d[1].region, s[1].region, scripted(&clock, 50, &[]));
        assert_eq!(book.in_flight(), 2);
        assert_eq!(
            book.admit(&device, &d[0], &staging, &s[0]),
            Err(GpuError::InFlightFull { in_flight: 2, max: 2 })
        );

        let settled = book.settle(ok, &mut device, &mut staging, &clock).expect("settles");
        assert_eq!(settled.completion(), Completion::Retired);
        assert_eq!(settled.device_outcome, None);
        assert!(matches!(state(&device, &d[0]), Some(RegionState::Lent { .. })));

        let settled = book.settle(hung, &mut device, &mut staging, &clock).expect("settles");
        assert_eq!(settled.retirement, Retirement::DeadlineMissed { waited_ms: 100 });
        assert_eq!(settled.device_outcome, Some(CompleteOutcome::Quarantined));
        assert_eq!(settled.staging_outcome, Some(CompleteOutcome::Quarantined));
        assert!(matches!(state(&device, &d[1]), Some(RegionState::Quarantined { .. })));
        assert!(matches!(state(&staging, &s[1]), Some(RegionState::Quarantined { .. })));
        assert_eq!(book.counters(), TransferCounters { submitted: 2, retired: 1, unknown: 1 });
        assert_eq!(
            book.settle(hung, &mut device, &mut staging, &clock),
            Err(GpuError::UnknownTransfer { transfer: hung.0 })
        );

        // A quarantined slot takes no new copy, and a late "retired" does not free it.
        assert_eq!(
            book.admit(&device, &d[1], &staging, &s[0]),
            Err(GpuError::NotLent { region: d[1].region })
        );
        assert_eq!(
            device.complete(d[1].region, Completion::Retired),
            Ok(CompleteOutcome::StillQuarantined)
        );
        assert_eq!(device.free_slots(), 2);
        assert_eq!(staging.free_slots(), 2);

        // The retired pair is released normally.
        assert_eq!(device.complete(d[0].region, Completion::Retired), Ok(CompleteOutcome::Freed));
        assert_eq!(staging.complete(s[0].region, Completion::Retired), Ok(CompleteOutcome::Freed));
        assert_eq!(device.free_slots(), 3);

        let report =
            book.fence(StreamDrained::observed(), &mut device, &mut staging).expect("fence");
        let regions = |p: &[ReclaimProof]| p.iter().map(ReclaimProof::region).collect::<Vec<_>>();
        assert_eq!(regions(&report.device), vec![d[1].region]);
        assert_eq!(regions(&report.staging), vec![s[1].region]);
        assert_eq!(report.forgotten, 0);
        assert_eq!(device.free_slots(), 4);
        assert_eq!(staging.free_slots(), 4);
        assert_eq!(device.table().counts().quarantined, 0);
    }

    /// A copy submitted whose event could not be made: the caller gets the error, both slots
    /// are quarantined at once (a release frees neither), and the drain-proven fence returns them.
    #[test]
    fn an_unobservable_copy_quarantines_both_slots_until_the_fence() {
        let owner = tenant(0);
        let mut device = pool(2);
        let mut staging = pool(2);
        let d = device.checkout(&owner, 1, None).expect("device slot");
        let s = staging.checkout(&owner, 1, None).expect("staging slot");
        let mut book =
            TransferBook::<Scripted>::new(NonZeroUsize::new(2).expect("nonzero"), LIMITS);
        book.admit(&device, &d[0], &staging, &s[0]).expect("room");
        let lost = GpuError::NotLent { region: d[0].region };
        let e = book.unobservable(&mut device, &d[0], &mut staging, &s[0], lost.clone());
        assert_eq!(e, lost);
        assert!(matches!(state(&device, &d[0]), Some(RegionState::Quarantined { .. })));
        assert!(matches!(state(&staging, &s[0]), Some(RegionState::Quarantined { .. })));
        assert_eq!(book.counters(), TransferCounters { submitted: 1, retired: 0, unknown: 1 });
        assert_eq!(book.in_flight(), 0);
        assert_eq!(
            staging.complete(s[0].region, Completion::Retired),
            Ok(CompleteOutcome::StillQuarantined)
        );
        assert_eq!((device.free_slots(), staging.free_slots()), (1, 1));
        let report =
            book.fence(StreamDrained::observed(), &mut device, &mut staging).expect("fence");
        assert_eq!((report.device.len(), report.staging.len()), (1, 1));
        assert_eq!((device.free_slots(), staging.free_slots()), (2, 2));
    }

    #[test]
    fn a_fence_forgets_copies_the_drain_finished() {
        let clock = ManualClock::default();
        let owner = tenant(0);
        let mut device = pool(1);
        let mut staging = pool(1);
        let d = device.checkout(&owner, 1, None).expect("slot");
        let s = staging.checkout(&owner, 1, None).expect("slot");
        let mut book = TransferBook::new(NonZeroUsize::MIN, LIMITS);
        let _id = book.record(d[0].region, s[0].region, scripted(&clock, 1, &[]));
        let report =
            book.fence(StreamDrained::observed(), &mut device, &mut staging).expect("fence");
        assert_eq!(report.forgotten, 1);
        assert_eq!(book.in_flight(), 0);
        // The lease was fenced: it can carry no new copy.
        assert_eq!(
            book.admit(&device, &d[0], &staging, &s[0]),
            Err(GpuError::NotLent { region: d[0].region })
        );
    }
}
