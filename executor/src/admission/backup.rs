//! The bounded, non-owning queue of backup candidates: Host blocks that L2 just published and
//! that may be copied to shared storage by a PUT.
//!
//! The queue holds identifiers only, never buffers or references, so queued work cannot pin Host
//! memory. Residency is rechecked through the caller's predicate when a PUT is dispatched, and
//! only then are backup credits taken. Every candidate that leaves without a PUT is counted under
//! exactly one [`DropReason`]; a candidate already queued or already covered by a pending PUT is
//! coalesced, which is not a loss.

use std::collections::{HashMap, HashSet, VecDeque};
use std::num::NonZeroUsize;

use super::sync::Arc;
use gpucache_dataplane::credits::{CreditClass, CreditGrant, CreditPool, Credits};

/// The scheduler's name for one Host block that could be backed up. The queue never
/// dereferences it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CandidateId(pub u64);

/// What one backup PUT charges: one operation and one Host-block reference.
pub const PUT_CREDITS: Credits = Credits::new(1, 1);

/// Why a candidate left the queue (or never entered it) without a PUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The admission gate was closed, or closed while it waited.
    Pressure,
    /// The queue was full and this was its oldest entry.
    Overflow,
    /// At dispatch its Host block was no longer resident.
    Unavailable,
    /// The backup budget can never admit a PUT.
    Disabled,
    /// Frozen-round or clear cleanup discarded queued work.
    Cleanup,
}

impl DropReason {
    pub const ALL: [Self; 5] =
        [Self::Pressure, Self::Overflow, Self::Unavailable, Self::Disabled, Self::Cleanup];

    /// The fixed label a metrics exporter uses for this reason.
    pub fn label(self) -> &'static str {
        match self {
            Self::Pressure => "pressure",
            Self::Overflow => "overflow",
            Self::Unavailable => "unavailable",
            Self::Disabled => "disabled",
            Self::Cleanup => "cleanup",
        }
    }
}

/// Dropped candidate occurrences by reason (occurrences, not distinct blocks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackupDrops {
    pub pressure: u64,
    pub overflow: u64,
    pub unavailable: u64,
    pub disabled: u64,
    pub cleanup: u64,
}

impl BackupDrops {
    pub fn get(&self, reason: DropReason) -> u64 {
        match reason {
            DropReason::Pressure => self.pressure,
            DropReason::Overflow => self.overflow,
            DropReason::Unavailable => self.unavailable,
            DropReason::Disabled => self.disabled,
            DropReason::Cleanup => self.cleanup,
        }
    }

    pub fn total(&self) -> u64 {
        DropReason::ALL.into_iter().map(|r| self.get(r)).sum()
    }

    fn add(&mut self, reason: DropReason, n: u64) {
        let slot = match reason {
            DropReason::Pressure => &mut self.pressure,
            DropReason::Overflow => &mut self.overflow,
            DropReason::Unavailable => &mut self.unavailable,
            DropReason::Disabled => &mut self.disabled,
            DropReason::Cleanup => &mut self.cleanup,
        };
        *slot = slot.saturating_add(n);
    }
}

/// What became of an offered candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    Queued,
    /// Queued; the queue was full, so its oldest candidate was dropped as overflow.
    QueuedDisplacing(CandidateId),
    /// Already queued or covered by a pending PUT: nothing to do, nothing lost.
    Coalesced,
    /// Not queued, counted under the reason.
    Rejected(DropReason),
}

/// A dispatched backup PUT. It holds the backup credits, and keeps its candidate coalescing, until
/// it is handed to [`BackupQueue::retire`] after every owner reported the PUT retired (dropping it
/// has the same effect).
#[derive(Debug)]
#[must_use = "a dispatched PUT must be submitted and later retired"]
pub struct PendingPut {
    candidate: CandidateId,
    grant: CreditGrant,
    /// Shared with the queue's pending entry: the entry is live while this exists.
    live: Arc<()>,
}

impl PendingPut {
    pub fn candidate(&self) -> CandidateId {
        self.candidate
    }
    pub fn credits(&self) -> Credits {
        self.grant.amount()
    }
}

/// The bounded candidate queue.
#[derive(Debug)]
pub struct BackupQueue {
    candidates_max: NonZeroUsize,
    queue: VecDeque<CandidateId>,
    queued: HashSet<CandidateId>,
    /// Candidates with a PUT dispatched and not yet retired; bounded by the backup share of the
    /// operation credits, since each live entry's PUT holds one and dead ones are pruned before
    /// every insert.
    pending: HashMap<CandidateId, Arc<()>>,
    drops: BackupDrops,
    coalesced: u64,
}

impl BackupQueue {
    pub fn new(candidates_max: NonZeroUsize) -> Self {
        Self {
            candidates_max,
            queue: VecDeque::with_capacity(candidates_max.get()),
            queued: HashSet::with_capacity(candidates_max.get()),
            pending: HashMap::new(),
            drops: BackupDrops::default(),
            coalesced: 0,
        }
    }

    pub fn candidates_max(&self) -> NonZeroUsize {
        self.candidates_max
    }
    pub fn len(&self) -> usize {
        self.queue.len()
    }
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
    pub fn pending_puts(&self) -> usize {
        self.pending.values().filter(|live| Arc::strong_count(live) > 1).count()
    }
    pub fn drops(&self) -> BackupDrops {
        self.drops
    }
    /// Offers that found their candidate already queued or pending.
    pub fn coalesced(&self) -> u64 {
        self.coalesced
    }

    /// Offers one candidate. `gate_open` is the admission gate's state now.
    pub fn offer(&mut self, candidate: CandidateId, gate_open: bool, pool: &CreditPool) -> Offer {
        self.prune_pending();
        if self.queued.contains(&candidate) || self.pending.contains_key(&candidate) {
            self.coalesced = self.coalesced.saturating_add(1);
            return Offer::Coalesced;
        }
        if pool.never_fits(CreditClass::Backup, PUT_CREDITS).is_some() {
            self.drops.add(DropReason::Disabled, 1);
            return Offer::Rejected(DropReason::Disabled);
        }
        if !gate_open {
            self.drops.add(DropReason::Pressure, 1);
            return Offer::Rejected(DropReason::Pressure);
        }
        let displaced = if self.queue.len() >= self.candidates_max.get() {
            let oldest = self.queue.pop_front();
            if let Some(oldest) = oldest {
                self.queued.remove(&oldest);
                self.drops.add(DropReason::Overflow, 1);
            }
            oldest
        } else {
            None
        };
        self.queue.push_back(candidate);
        self.queued.insert(candidate);
        debug_assert!(self.queue.len() <= self.candidates_max.get());
        debug_assert_eq!(self.queue.len(), self.queued.len());
        displaced.map_or(Offer::Queued, Offer::QueuedDisplacing)
    }

    /// Dispatches up to `puts_max` PUTs from the front of the queue. Each candidate's Host
    /// residency is rechecked through `is_resident` first; one that is gone is dropped as
    /// unavailable. When backup credits are only busy, the front candidate and everything behind
    /// it stay queued for a later tick.
    pub fn dispatch(
        &mut self,
        pool: &CreditPool,
        gate_open: bool,
        puts_max: usize,
        mut is_resident: impl FnMut(CandidateId) -> bool,
    ) -> Vec<PendingPut> {
        let mut puts = Vec::new();
        if !gate_open {
            return puts;
        }
        self.prune_pending();
        while puts.len() < puts_max {
            let Some(&candidate) = self.queue.front() else { break };
            if !is_resident(candidate) {
                self.pop_front_dropped(DropReason::Unavailable);
                continue;
            }
            match pool.acquire(CreditClass::Backup, PUT_CREDITS) {
                Ok(grant) => {
                    self.queue.pop_front();
                    self.queued.remove(&candidate);
                    let live = Arc::new(());
                    self.pending.insert(candidate, Arc::clone(&live));
                    puts.push(PendingPut { candidate, grant, live });
                }
                Err(refusal) if refusal.is_permanent() => {
                    self.pop_front_dropped(DropReason::Disabled);
                }
                Err(_) => break,
            }
        }
        puts
    }

    /// Every owner reported the PUT retired: its candidate is no longer pending and its credits
    /// return.
    pub fn retire(&mut self, put: PendingPut) {
        let removed = self.pending.remove(&put.candidate);
        debug_assert!(
            removed.is_some_and(|live| Arc::ptr_eq(&live, &put.live)),
            "retired a PUT this queue did not dispatch"
        );
        drop(put);
    }

    /// Drops every queued candidate under `reason` (the gate closed, or cleanup); returns how
    /// many. Pending PUTs are not touched: they continue.
    pub fn drop_all(&mut self, reason: DropReason) -> usize {
        let n = self.queue.len();
        self.queue.clear();
        self.queued.clear();
        self.drops.add(reason, u64::try_from(n).unwrap_or(u64::MAX));
        n
    }

    /// Forgets pending entries whose `PendingPut` was dropped without being retired.
    fn prune_pending(&mut self) {
        self.pending.retain(|_, live| Arc::strong_count(live) > 1);
    }

    fn pop_front_dropped(&mut self, reason: DropReason) {
        if let Some(candidate) = self.queue.pop_front() {
            self.queued.remove(&candidate);
            self.drops.add(reason, 1);
        }
    }
}
