//! [`ShardDirectory`]: single-flight fills under an epoch fence, charged to the shard's credits.
//!
//! A fill is the work of making one missing block present: an engine computes it and PUTs it.
//! The first caller of [`ShardDirectory::begin_fill`] for a key leads the fill under a lease and
//! is charged one fill's credits; a caller for the same key while it is in flight joins it and
//! is charged nothing. Each learns the outcome from [`ShardDirectory::notice`]: pending,
//! finished (the leader stored the block; a reader must still GET it, and may miss), failed
//! (the leader gave up, or its lease ran out; a joiner may lead a new fill) or fenced (the epoch
//! moved on; nothing about the key may be assumed). Settled outcomes are remembered for the
//! last [`SETTLED_MAX`] fills, so a joiner that looks late still learns how its fill ended.
//!
//! Every table is bounded: in-flight fills by `fills_max`, outcomes by [`SETTLED_MAX`].

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::credits::{CreditClass, CreditGrant, CreditPool, CreditRefusal, Credits};
use crate::key::KeyDigest;
#[cfg(doc)]
use crate::key::PhysicalKey;
use crate::registry::Epoch;

/// Fills a directory keeps in flight at most, by default.
pub const FILLS_MAX_DEFAULT: usize = 4096;
/// How long a leader may take before its fill fails, by default.
pub const FILL_LEASE_MS_DEFAULT: u64 = 30_000;
/// Settled fills whose outcome a directory remembers.
pub const SETTLED_MAX: usize = 4096;

/// A shard's number; 0 for a single node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardId(pub u32);

/// Names one fill of one key, for the leader and every joiner alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FillTicket {
    pub fill: u64,
    pub epoch: Epoch,
}

/// What the leader holds: the ticket, and when its lease runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillLease {
    pub ticket: FillTicket,
    pub deadline_ms: u64,
}

/// The answer to [`ShardDirectory::begin_fill`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillStart {
    /// Fill the block, then call [`ShardDirectory::finish_fill`].
    Lead(FillLease),
    /// Another caller is filling it: wait on the ticket. Charged nothing.
    Join(FillTicket),
}

/// Why a fill was not begun. None of these charged anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FillRefusal {
    /// The caller's view of membership differs from the shard's: refresh it, then retry.
    #[error("request of epoch {asked}, the shard is at epoch {current}")]
    Epoch { asked: Epoch, current: Epoch },
    /// The shard is draining for an upgrade or a move; fills in flight finish, new ones go
    /// elsewhere.
    #[error("the shard is draining and admits no new fill")]
    Draining,
    #[error("{max} fills are in flight already")]
    TooMany { max: usize },
    #[error("no credits for a fill: {0}")]
    Credits(CreditRefusal),
}

/// How a fill ended, or that it has not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FillNotice {
    Pending,
    /// The leader stored the block. Not a hit: read it, and a miss is still possible.
    Finished,
    /// No block came of it: its leader gave up or its lease ran out. A new fill may begin.
    Failed,
    /// The epoch moved on under it. Not success, whatever the leader did.
    Fenced,
}

/// What the leader reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillOutcome {
    Stored,
    GaveUp,
}

#[derive(Debug)]
struct Fill {
    key: KeyDigest,
    deadline_ms: u64,
    /// Returned to the pool when the fill leaves the table, whichever way.
    _grant: CreditGrant,
}

/// What a directory has done, since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardStats {
    pub in_flight: usize,
    pub led: u64,
    pub joined: u64,
    pub finished: u64,
    pub failed: u64,
    pub fenced: u64,
    pub refused: u64,
}

/// One shard's fills (see the module documentation).
#[derive(Debug)]
pub struct ShardDirectory {
    shard: ShardId,
    epoch: Epoch,
    draining: bool,
    credits: CreditPool,
    fill_cost: Credits,
    fills_max: usize,
    lease_ms: u64,
    next_fill: u64,
    in_flight: HashMap<u64, Fill>,
    by_key: HashMap<KeyDigest, u64>,
    /// (lease deadline, fill) of every fill in flight, soonest first.
    deadlines: BTreeSet<(u64, u64)>,
    settled: HashMap<u64, FillNotice>,
    settled_order: VecDeque<u64>,
    stats: ShardStats,
}

impl ShardDirectory {
    /// An empty directory for `shard` at `epoch`, charging `fill_cost` of `credits` per fill.
    pub fn new(shard: ShardId, epoch: Epoch, credits: CreditPool, fill_cost: Credits) -> Self {
        Self {
            shard,
            epoch,
            draining: false,
            credits,
            fill_cost,
            fills_max: FILLS_MAX_DEFAULT,
            lease_ms: FILL_LEASE_MS_DEFAULT,
            next_fill: 1,
            in_flight: HashMap::new(),
            by_key: HashMap::new(),
            deadlines: BTreeSet::new(),
            settled: HashMap::new(),
            settled_order: VecDeque::new(),
            stats: ShardStats::default(),
        }
    }

    /// At most `fills_max` fills in flight (at least one), each leading for `lease_ms`.
    pub fn with_bounds(mut self, fills_max: usize, lease_ms: u64) -> Self {
        self.fills_max = fills_max.max(1);
        self.lease_ms = lease_ms;
        self
    }

    pub fn shard(&self) -> ShardId {
        self.shard
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// The pool this directory charges (a successor of a rebalance charges the same one).
    pub fn credits(&self) -> &CreditPool {
        &self.credits
    }

    /// What one fill is charged.
    pub fn fill_cost(&self) -> Credits {
        self.fill_cost
    }

    pub fn stats(&self) -> ShardStats {
        ShardStats { in_flight: self.in_flight.len(), ..self.stats }
    }

    /// Leads or joins the fill of the block whose physical key has digest `key`
    /// ([`PhysicalKey::digest`]) for a caller that sees the cluster at `epoch`.
    pub fn begin_fill(
        &mut self,
        key: KeyDigest,
        epoch: Epoch,
        now_ms: u64,
    ) -> Result<FillStart, FillRefusal> {
        let refused = |s: &mut Self, r| {
            s.stats.refused += 1;
            Err(r)
        };
        if epoch != self.epoch {
            return refused(self, FillRefusal::Epoch { asked: epoch, current: self.epoch });
        }
        self.expire(now_ms);
        let digest = key;
        if let Some(&fill) = self.by_key.get(&digest) {
            self.stats.joined += 1;
            return Ok(FillStart::Join(FillTicket { fill, epoch: self.epoch }));
        }
        if self.draining {
            return refused(self, FillRefusal::Draining);
        }
        if self.in_flight.len() >= self.fills_max {
            return refused(self, FillRefusal::TooMany { max: self.fills_max });
        }
        let grant = match self.credits.acquire(CreditClass::Read, self.fill_cost) {
            Ok(g) => g,
            Err(e) => return refused(self, FillRefusal::Credits(e)),
        };
        let fill = self.next_fill;
        self.next_fill += 1;
        let deadline_ms = now_ms.saturating_add(self.lease_ms);
        self.in_flight.insert(fill, Fill { key: digest, deadline_ms, _grant: grant });
        self.by_key.insert(digest, fill);
        self.deadlines.insert((deadline_ms, fill));
        self.stats.led += 1;
        Ok(FillStart::Lead(FillLease {
            ticket: FillTicket { fill, epoch: self.epoch },
            deadline_ms,
        }))
    }

    /// The leader's report; answers how the fill stands now (fenced when the epoch moved on,
    /// failed when its lease ran out first).
    pub fn finish_fill(
        &mut self,
        lease: &FillLease,
        outcome: FillOutcome,
        now_ms: u64,
    ) -> FillNotice {
        self.expire(now_ms);
        let ticket = lease.ticket;
        if ticket.epoch != self.epoch || !self.in_flight.contains_key(&ticket.fill) {
            return self.notice(&ticket);
        }
        let notice = match outcome {
            FillOutcome::Stored => FillNotice::Finished,
            FillOutcome::GaveUp => FillNotice::Failed,
        };
        self.settle(ticket.fill, notice);
        notice
    }

    /// How the fill on `ticket` stands.
    pub fn notice(&self, ticket: &FillTicket) -> FillNotice {
        if ticket.epoch != self.epoch {
            return FillNotice::Fenced;
        }
        if self.in_flight.contains_key(&ticket.fill) {
            return FillNotice::Pending;
        }
        // Forgotten past SETTLED_MAX: nothing may be assumed, so the joiner starts over.
        self.settled.get(&ticket.fill).copied().unwrap_or(FillNotice::Failed)
    }

    /// Fails every fill whose lease ran out by `now_ms`; answers how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut lapsed = 0;
        while let Some(&(deadline, fill)) = self.deadlines.first()
            && deadline <= now_ms
        {
            self.deadlines.pop_first();
            self.settle(fill, FillNotice::Failed);
            lapsed += 1;
        }
        lapsed
    }

    /// Moves to `epoch` (later than the current one; an equal or older one changes nothing):
    /// every fill in flight is fenced and its credits come back. Answers how many were fenced.
    pub fn fence(&mut self, epoch: Epoch) -> usize {
        if epoch <= self.epoch {
            return 0;
        }
        let n = self.in_flight.len();
        self.stats.fenced += n as u64;
        // Fills of an older epoch all answer Fenced; their outcomes need no record.
        self.in_flight.clear();
        self.by_key.clear();
        self.deadlines.clear();
        self.settled.clear();
        self.settled_order.clear();
        self.epoch = epoch;
        n
    }

    /// Refuses new fills from now on; fills in flight go on.
    pub fn start_drain(&mut self) {
        self.draining = true;
    }

    /// Admits new fills again; fills begun before the drain were never stopped.
    pub fn stop_drain(&mut self) {
        self.draining = false;
    }

    fn settle(&mut self, fill: u64, notice: FillNotice) {
        let Some(f) = self.in_flight.remove(&fill) else { return };
        self.by_key.remove(&f.key);
        self.deadlines.remove(&(f.deadline_ms, fill));
        match notice {
            FillNotice::Finished => self.stats.finished += 1,
            FillNotice::Failed => self.stats.failed += 1,
            FillNotice::Fenced => self.stats.fenced += 1,
            FillNotice::Pending => {}
        }
        if self.settled_order.len() == SETTLED_MAX
            && let Some(old) = self.settled_order.pop_front()
        {
            self.settled.remove(&old);
        }
        self.settled_order.push_back(fill);
        self.settled.insert(fill, notice);
    }
}
