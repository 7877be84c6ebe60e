//! Storage tickets and the leases that attach a request to one.
//!
//! A ticket is the admission side's record of one request's L3 preparation. The request's state
//! (waiting on QUERY or GET, then holding a Ready result) owns a [`StorageLease`]; whatever ends
//! that state drops the lease, and the drop detaches the request from the ticket and returns a
//! Ready hold's credits. Credits of operations still in flight are not the lease's: native I/O
//! keeps them until it retires, however the request ended.

use super::sync::{Arc, Mutex, lock};
use gpucache_dataplane::credits::CreditGrant;

/// The scheduler's handle for a request; the admission side only hands it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestKey(pub u64);

/// One request's preparation, unique for the controller's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketId(pub u64);

/// Which storage operation a waiting request is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitPhase {
    Query,
    Get,
}

/// Why a request stopped waiting for L3 and goes to ordinary local admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LocalReason {
    /// Its soft deadline, counted from the query's issue, passed at a tick.
    SoftTimeout,
    /// The admission gate was closed while it waited on a query or before its GET.
    Pressure,
    /// Its Ready hold expired at a tick before admission took it.
    ReadyExpired,
    /// Its GET ended without proof that native I/O retired; the references are quarantined.
    Unretired,
}

/// What the scheduler reads from a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// Still waiting on a storage operation (or, between QUERY and GET, on its own matcher).
    Waiting(WaitPhase),
    /// Read blocks are held for admission to take.
    Ready,
    /// Use ordinary local admission.
    Local(LocalReason),
    /// The lease's owner let go; nothing more will happen for this request.
    Detached,
}

#[derive(Debug)]
struct TicketState {
    outcome: WaitOutcome,
    /// A Ready hold's destination credits, while the hold lasts.
    ready: Option<CreditGrant>,
}

/// The state shared by a ticket's lease and the controller.
#[derive(Debug)]
pub(crate) struct Ticket {
    id: TicketId,
    request: RequestKey,
    state: Mutex<TicketState>,
}

impl Ticket {
    pub(crate) fn new(id: TicketId, request: RequestKey) -> Arc<Self> {
        Arc::new(Self {
            id,
            request,
            state: Mutex::new(TicketState {
                outcome: WaitOutcome::Waiting(WaitPhase::Query),
                ready: None,
            }),
        })
    }

    pub(crate) fn id(&self) -> TicketId {
        self.id
    }

    pub(crate) fn request(&self) -> RequestKey {
        self.request
    }

    pub(crate) fn outcome(&self) -> WaitOutcome {
        lock(&self.state).outcome
    }

    /// Whether completions may still publish for this request.
    pub(crate) fn is_attached(&self) -> bool {
        matches!(lock(&self.state).outcome, WaitOutcome::Waiting(_) | WaitOutcome::Ready)
    }

    /// Moves a still-attached ticket to `outcome`; false when it was already detached.
    pub(crate) fn advance(&self, outcome: WaitOutcome) -> bool {
        let mut state = lock(&self.state);
        if !matches!(state.outcome, WaitOutcome::Waiting(_) | WaitOutcome::Ready) {
            return false;
        }
        state.outcome = outcome;
        true
    }

    /// Parks a completed GET's credits as the Ready hold. Hands them back if the request
    /// detached first, so the caller drops them.
    pub(crate) fn hold_ready(&self, grant: CreditGrant) -> Result<(), CreditGrant> {
        let mut state = lock(&self.state);
        if !matches!(state.outcome, WaitOutcome::Waiting(_)) {
            return Err(grant);
        }
        state.outcome = WaitOutcome::Ready;
        state.ready = Some(grant);
        Ok(())
    }

    /// Admission takes a live Ready hold's credits; `None` when there is no hold any more.
    pub(crate) fn take_ready(&self) -> Option<CreditGrant> {
        let mut state = lock(&self.state);
        if state.outcome != WaitOutcome::Ready {
            return None;
        }
        state.outcome = WaitOutcome::Detached;
        state.ready.take()
    }

    /// Ends the ticket with `outcome` and takes the Ready hold's credits, if any; the caller
    /// drops them outside the lock.
    pub(crate) fn end(&self, outcome: WaitOutcome) -> Option<CreditGrant> {
        let mut state = lock(&self.state);
        if matches!(state.outcome, WaitOutcome::Waiting(_) | WaitOutcome::Ready) {
            state.outcome = outcome;
        }
        state.ready.take()
    }
}

/// A request's attachment to its storage ticket. Dropping it detaches the request: a later
/// completion cannot publish for it, and a Ready hold's credits return at once.
#[derive(Debug)]
#[must_use = "dropping the lease detaches the request from its ticket"]
pub struct StorageLease {
    ticket: Arc<Ticket>,
}

impl StorageLease {
    pub(crate) fn new(ticket: Arc<Ticket>) -> Self {
        Self { ticket }
    }

    pub fn ticket(&self) -> TicketId {
        self.ticket.id()
    }

    pub fn request(&self) -> RequestKey {
        self.ticket.request()
    }

    /// Where the request stands; read it after each tick.
    pub fn outcome(&self) -> WaitOutcome {
        self.ticket.outcome()
    }

    pub(crate) fn shared(&self) -> &Arc<Ticket> {
        &self.ticket
    }
}

impl Drop for StorageLease {
    fn drop(&mut self) {
        let released = self.ticket.end(WaitOutcome::Detached);
        drop(released);
    }
}
