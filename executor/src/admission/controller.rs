//! The admission controller: the scheduler-side owner of L3 preparation. It issues operation
//! ids, charges credits, keeps soft deadlines and Ready holds, runs the gate and the backup
//! queue, and is driven only by the scheduler's calls and ticks on an injected clock.
//!
//! Ordering the caller keeps: apply a tick (and cancellations) before that round's completion
//! records, so a read that expired or detached at the tick cannot publish a late result.

use std::collections::BTreeMap;

use super::backup::{BackupQueue, CandidateId, DropReason, Offer, PendingPut};
use super::config::{AdmissionConfig, ConfigError};
use super::gate::{AdmissionGate, GateChange, PressureSnapshot};
use super::lease::{
    LocalReason, RequestKey, StorageLease, Ticket, TicketId, WaitOutcome, WaitPhase,
};
use super::sync::Arc;
use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::credits::{
    CreditBound, CreditClass, CreditGrant, CreditKind, CreditPool, CreditRefusal, Credits,
};

/// A storage operation's id: increasing, never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OperationId(pub u64);

/// Why a new request skipped L3 preparation. It keeps ordinary local admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bypass {
    /// The admission gate is closed.
    Pressure,
    /// No credits for the query (Host-block exhaustion also rejects a query before backend work).
    Credits(CreditRefusal),
}

/// The answer to [`AdmissionController::prepare`].
#[derive(Debug)]
pub enum Prepare {
    /// Submit a QUERY with this id; the request waits holding the lease.
    Query {
        op: OperationId,
        lease: StorageLease,
    },
    Bypass(Bypass),
}

/// The answer to [`AdmissionController::begin_get`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetStart {
    /// Submit a GET with this id.
    Issued(OperationId),
    /// The destinations do not fit now; the caller may shorten the boundary and ask again, or
    /// drop the lease and admit locally.
    Refused(CreditRefusal),
    /// The request already left for local admission (a tick closed the gate or passed its
    /// deadline), or the gate is closed now; no GET may acquire destinations.
    Local(LocalReason),
}

/// Whether a GET's native I/O is known to have stopped using its Host destinations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NativeRetirement {
    Retired,
    Unknown,
}

/// What a completion did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// A query finished for an attached request; the scheduler matches and may call
    /// [`AdmissionController::begin_get`].
    QueryAnswered(RequestKey),
    /// A GET finished for an attached request; its destinations are held Ready.
    Ready(RequestKey),
    /// The request had detached (lease dropped, timed out or gate closed): nothing publishes and
    /// the operation's credits returned.
    Detached,
    /// Native retirement is unproven: the credits stay charged for the process (quarantine).
    Quarantined,
}

/// Calls that break the protocol; a scheduler bug, not an expected outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdmissionError {
    #[error("operation {0:?} is not in flight")]
    UnknownOperation(OperationId),
    #[error("operation {op:?} is a {actual:?}, not a {expected:?}")]
    WrongOperation { op: OperationId, expected: WaitPhase, actual: WaitPhase },
    #[error("ticket {0:?} is not between its query and its GET")]
    NotAwaitingGet(TicketId),
}

/// A request that stopped waiting at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub request: RequestKey,
    pub ticket: TicketId,
    pub reason: LocalReason,
}

/// What one tick did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickReport {
    pub now_ms: u64,
    pub gate: GateChange,
    /// In ticket order, so replicas that tick alike report alike.
    pub resolved: Vec<Resolved>,
}

/// Event counts (not gauges). Client detachment counts nowhere.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionCounters {
    pub pressure_bypasses: u64,
    pub credit_bypasses: u64,
    pub pressure_detaches: u64,
    pub soft_timeouts: u64,
    pub ready_expired: u64,
    pub unretired_gets: u64,
}

#[derive(Debug)]
struct Wait {
    ticket: Arc<Ticket>,
    phase: WaitPhase,
    /// The operation in flight; `None` between an answered query and the GET.
    op: Option<OperationId>,
    deadline_at_ms: u64,
}

#[derive(Debug)]
struct InFlight {
    ticket: Arc<Ticket>,
    phase: WaitPhase,
    grant: CreditGrant,
}

#[derive(Debug)]
struct Hold {
    ticket: Arc<Ticket>,
    expires_at_ms: u64,
}

/// The admission side of the asynchronous L3 path.
#[derive(Debug)]
pub struct AdmissionController {
    config: AdmissionConfig,
    clock: std::sync::Arc<dyn Clock>,
    pool: CreditPool,
    gate: AdmissionGate,
    backups: BackupQueue,
    next_op: u64,
    next_ticket: u64,
    /// Requests waiting on QUERY or GET. Bounded by the operation credits plus the requests
    /// between their query and GET.
    waits: BTreeMap<TicketId, Wait>,
    /// QUERY and GET operations whose native work has not retired. Each holds an operation
    /// credit, so the map is bounded by the operation budget.
    inflight: BTreeMap<OperationId, InFlight>,
    holds: BTreeMap<TicketId, Hold>,
    /// Credits of GETs whose retirement is unproven; never returned.
    quarantined: Vec<CreditGrant>,
    counters: AdmissionCounters,
}

impl AdmissionController {
    pub fn new(
        config: AdmissionConfig,
        clock: std::sync::Arc<dyn Clock>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let gate = AdmissionGate::new(config.watermarks).map_err(ConfigError::Watermark)?;
        Ok(Self {
            pool: CreditPool::new(config.credits),
            backups: BackupQueue::new(config.backup_candidates_max),
            gate,
            config,
            clock,
            next_op: 1,
            next_ticket: 1,
            waits: BTreeMap::new(),
            inflight: BTreeMap::new(),
            holds: BTreeMap::new(),
            quarantined: Vec::new(),
            counters: AdmissionCounters::default(),
        })
    }

    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }
    pub fn pool(&self) -> &CreditPool {
        &self.pool
    }
    pub fn gate(&self) -> &AdmissionGate {
        &self.gate
    }
    pub fn backups(&self) -> &BackupQueue {
        &self.backups
    }
    pub fn counters(&self) -> AdmissionCounters {
        self.counters
    }
    /// Requests waiting on a QUERY or GET (as of the last call or tick).
    pub fn waiting(&self) -> usize {
        self.waits.len()
    }
    /// Ready holds not yet taken, expired or released (as of the last call or tick).
    pub fn ready_holds(&self) -> usize {
        self.holds.len()
    }
    /// Operations whose native work has not retired, attached or not.
    pub fn operations_in_flight(&self) -> usize {
        self.inflight.len()
    }
    /// Credits kept by unretired GETs.
    pub fn quarantined_credits(&self) -> Credits {
        self.quarantined.iter().fold(Credits::ZERO, |acc, g| {
            let a = g.amount();
            Credits::new(
                acc.operations.saturating_add(a.operations),
                acc.host_blocks.saturating_add(a.host_blocks),
            )
        })
    }

    fn next_operation(&mut self) -> OperationId {
        let op = OperationId(self.next_op);
        self.next_op += 1;
        op
    }

    /// Starts L3 preparation for a request that missed locally: charges one operation credit
    /// for its QUERY and starts its soft deadline now.
    pub fn prepare(&mut self, request: RequestKey) -> Prepare {
        if !self.gate.is_open() {
            self.counters.pressure_bypasses += 1;
            return Prepare::Bypass(Bypass::Pressure);
        }
        let budget = self.pool.budget();
        let held = self.pool.usage().total;
        if held.host_blocks >= budget.host_blocks {
            self.counters.credit_bypasses += 1;
            return Prepare::Bypass(Bypass::Credits(CreditRefusal::Exhausted {
                kind: CreditKind::HostBlocks,
                class: CreditClass::Read,
                bound: CreditBound::Budget,
                requested: 1,
                held: held.host_blocks,
                limit: budget.host_blocks,
            }));
        }
        let grant = match self.pool.acquire(CreditClass::Read, Credits::new(1, 0)) {
            Ok(grant) => grant,
            Err(refusal) => {
                self.counters.credit_bypasses += 1;
                return Prepare::Bypass(Bypass::Credits(refusal));
            }
        };
        let ticket = Ticket::new(TicketId(self.next_ticket), request);
        self.next_ticket += 1;
        let op = self.next_operation();
        let now_ms = self.clock.now_ms();
        self.inflight
            .insert(op, InFlight { ticket: Arc::clone(&ticket), phase: WaitPhase::Query, grant });
        self.waits.insert(
            ticket.id(),
            Wait {
                ticket: Arc::clone(&ticket),
                phase: WaitPhase::Query,
                op: Some(op),
                deadline_at_ms: now_ms.saturating_add(self.config.soft_deadline_ms),
            },
        );
        Prepare::Query { op, lease: StorageLease::new(ticket) }
    }

    /// A QUERY retired on every owner. Its operation credit returns whatever the answer.
    pub fn query_done(&mut self, op: OperationId) -> Result<Completion, AdmissionError> {
        let flight = self.take_inflight(op, WaitPhase::Query)?;
        drop(flight.grant);
        let id = flight.ticket.id();
        if !flight.ticket.is_attached() {
            self.waits.remove(&id);
            return Ok(Completion::Detached);
        }
        if let Some(wait) = self.waits.get_mut(&id) {
            wait.op = None;
        }
        Ok(Completion::QueryAnswered(flight.ticket.request()))
    }

    /// Issues the GET for a request whose query was answered: one operation credit and
    /// `host_blocks` destination references. The soft deadline still counts from the query.
    pub fn begin_get(
        &mut self,
        lease: &StorageLease,
        host_blocks: u32,
    ) -> Result<GetStart, AdmissionError> {
        let id = lease.ticket();
        if let WaitOutcome::Local(reason) = lease.outcome() {
            // Already sent to local admission at a tick (pressure or soft deadline).
            return Ok(GetStart::Local(reason));
        }
        let awaiting =
            self.waits.get(&id).is_some_and(|w| w.phase == WaitPhase::Query && w.op.is_none());
        if !awaiting || !lease.shared().is_attached() {
            return Err(AdmissionError::NotAwaitingGet(id));
        }
        if !self.gate.is_open() {
            lease.shared().advance(WaitOutcome::Local(LocalReason::Pressure));
            self.waits.remove(&id);
            self.counters.pressure_detaches += 1;
            return Ok(GetStart::Local(LocalReason::Pressure));
        }
        let grant = match self.pool.acquire(CreditClass::Read, Credits::new(1, host_blocks)) {
            Ok(grant) => grant,
            Err(refusal) => return Ok(GetStart::Refused(refusal)),
        };
        let op = self.next_operation();
        lease.shared().advance(WaitOutcome::Waiting(WaitPhase::Get));
        self.inflight.insert(
            op,
            InFlight { ticket: Arc::clone(lease.shared()), phase: WaitPhase::Get, grant },
        );
        if let Some(wait) = self.waits.get_mut(&id) {
            wait.phase = WaitPhase::Get;
            wait.op = Some(op);
        }
        Ok(GetStart::Issued(op))
    }

    /// A GET finished on every owner. A retired GET of an attached request becomes a Ready hold
    /// that keeps its credits until admission takes it, the lease drops, or it expires.
    pub fn get_done(
        &mut self,
        op: OperationId,
        retirement: NativeRetirement,
    ) -> Result<Completion, AdmissionError> {
        let flight = self.take_inflight(op, WaitPhase::Get)?;
        let ticket = flight.ticket;
        self.waits.remove(&ticket.id());
        if retirement == NativeRetirement::Unknown {
            self.quarantined.push(flight.grant);
            self.counters.unretired_gets += 1;
            ticket.advance(WaitOutcome::Local(LocalReason::Unretired));
            return Ok(Completion::Quarantined);
        }
        match ticket.hold_ready(flight.grant) {
            Ok(()) => {
                let expires_at_ms = self.clock.now_ms().saturating_add(self.config.ready_hold_ms);
                let request = ticket.request();
                self.holds.insert(ticket.id(), Hold { ticket, expires_at_ms });
                Ok(Completion::Ready(request))
            }
            Err(grant) => {
                drop(grant);
                Ok(Completion::Detached)
            }
        }
    }

    /// Ordinary admission acquires the Host sources of a Ready hold: its credits move to the
    /// caller (the H2D ticket) and the lease ends. `None` when the hold is gone.
    pub fn take_ready(&mut self, lease: StorageLease) -> Option<CreditGrant> {
        self.holds.remove(&lease.ticket());
        lease.shared().take_ready()
    }

    /// One scheduler tick: applies the round's combined pressure, then ends the waits whose
    /// soft deadline has come and the Ready holds that expired. Nothing expires between ticks.
    pub fn tick(&mut self, pressure: &PressureSnapshot) -> TickReport {
        let now_ms = self.clock.now_ms();
        let gate = self.gate.observe(pressure);
        if matches!(gate, GateChange::Closed { .. }) {
            self.backups.drop_all(DropReason::Pressure);
        }
        let gate_open = self.gate.is_open();
        let mut resolved = Vec::new();
        let mut ended = Vec::new();
        for (id, wait) in &self.waits {
            if !wait.ticket.is_attached() {
                ended.push(*id);
                continue;
            }
            let reason = if !gate_open && wait.phase == WaitPhase::Query {
                self.counters.pressure_detaches += 1;
                LocalReason::Pressure
            } else if now_ms >= wait.deadline_at_ms {
                self.counters.soft_timeouts += 1;
                LocalReason::SoftTimeout
            } else {
                continue;
            };
            wait.ticket.advance(WaitOutcome::Local(reason));
            resolved.push(Resolved { request: wait.ticket.request(), ticket: *id, reason });
            ended.push(*id);
        }
        for id in ended {
            self.waits.remove(&id);
        }
        let mut expired = Vec::new();
        for (id, hold) in &self.holds {
            if !hold.ticket.is_attached() {
                expired.push((*id, None));
            } else if now_ms >= hold.expires_at_ms {
                expired.push((*id, Some(hold.ticket.request())));
            }
        }
        for (id, request) in expired {
            let Some(hold) = self.holds.remove(&id) else { continue };
            if let Some(request) = request {
                let reason = LocalReason::ReadyExpired;
                drop(hold.ticket.end(WaitOutcome::Local(reason)));
                self.counters.ready_expired += 1;
                resolved.push(Resolved { request, ticket: id, reason });
            }
        }
        resolved.sort_by_key(|r| r.ticket);
        TickReport { now_ms, gate, resolved }
    }

    /// Offers a just-published Host block as a backup candidate.
    pub fn offer_backup(&mut self, candidate: CandidateId) -> Offer {
        self.backups.offer(candidate, self.gate.is_open(), &self.pool)
    }

    /// Dispatches up to `puts_max` backup PUTs, rechecking each candidate's Host residency
    /// through `is_resident` before taking its credits.
    pub fn dispatch_backups(
        &mut self,
        puts_max: usize,
        is_resident: impl FnMut(CandidateId) -> bool,
    ) -> Vec<PendingPut> {
        self.backups.dispatch(&self.pool, self.gate.is_open(), puts_max, is_resident)
    }

    /// A backup PUT retired on every owner.
    pub fn retire_put(&mut self, put: PendingPut) {
        self.backups.retire(put);
    }

    /// Frozen-round or clear cleanup: queued candidates are discarded; PUTs in flight continue.
    pub fn cleanup_backups(&mut self) -> usize {
        self.backups.drop_all(DropReason::Cleanup)
    }

    fn take_inflight(
        &mut self,
        op: OperationId,
        expected: WaitPhase,
    ) -> Result<InFlight, AdmissionError> {
        match self.inflight.get(&op) {
            None => Err(AdmissionError::UnknownOperation(op)),
            Some(f) if f.phase != expected => {
                Err(AdmissionError::WrongOperation { op, expected, actual: f.phase })
            }
            Some(_) => self.inflight.remove(&op).ok_or(AdmissionError::UnknownOperation(op)),
        }
    }
}
