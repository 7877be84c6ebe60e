//! [`Fills`]: the node's single-flight fills, shared by every connection.
//!
//! The first engine to miss a key asks to fill it (FILL_BEGIN) and leads the fill under a
//! lease: it computes the block, PUTs it and says so (FILL_FINISH). Every engine that asks
//! while that fill is in flight joins it instead, charged nothing, and waits for its outcome
//! (FILL_WAIT, bounded by [`FILL_WAIT_MS_MAX`]): finished (read the block; a miss is still
//! possible), failed (the leader gave up or its lease ran out: begin again), or fenced (the
//! cluster's members changed). A node of a cluster fences its fills on every view that changes
//! the members (a join, a leave, a new life of a node); a view that only drains a node, or
//! rolls a drain back, fences nothing: the drained node refuses new fills and lets those in
//! flight finish.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpucache_dataplane::clock::Clock;
use gpucache_dataplane::credits::{CreditPool, Credits};
use gpucache_dataplane::key::KeyDigest;
use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::shard::{
    FILLS_MAX_DEFAULT, FillLease, FillNotice, FillOutcome, FillRefusal, FillStart, FillTicket,
    ShardDirectory, ShardId, ShardStats,
};

/// The longest one FILL_WAIT waits for an outcome.
pub const FILL_WAIT_MS_MAX: u64 = 30_000;

/// One node's fills (see the module documentation).
pub struct Fills {
    directory: Mutex<ShardDirectory>,
    changed: Condvar,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Fills {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fills").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl Fills {
    /// Shard 0 at epoch 0, one credit per fill out of [`FILLS_MAX_DEFAULT`], leases timed by
    /// `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        let budget = u32::try_from(FILLS_MAX_DEFAULT).unwrap_or(u32::MAX);
        let pool = CreditPool::new(Credits::new(budget, budget));
        let directory = ShardDirectory::new(ShardId(0), Epoch(0), pool, Credits::new(1, 1));
        Self { directory: Mutex::new(directory), changed: Condvar::new(), clock }
    }

    fn lock(&self) -> MutexGuard<'_, ShardDirectory> {
        self.directory.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> ShardStats {
        self.lock().stats()
    }

    /// Leads or joins the fill of `key` for a caller at `epoch`.
    pub fn begin(&self, key: KeyDigest, epoch: Epoch) -> Result<FillStart, FillRefusal> {
        let now = self.clock.now_ms();
        let mut directory = self.lock();
        if directory.expire(now) > 0 {
            self.changed.notify_all();
        }
        directory.begin_fill(key, epoch, now)
    }

    /// The leader's word on its fill; wakes every joiner.
    pub fn finish(&self, lease: &FillLease, outcome: FillOutcome) -> FillNotice {
        let notice = self.lock().finish_fill(lease, outcome, self.clock.now_ms());
        self.changed.notify_all();
        notice
    }

    /// The fill's outcome, waiting up to `wait` (at most [`FILL_WAIT_MS_MAX`]) while it is
    /// pending. A leader whose lease runs out during the wait fails the fill when the wait
    /// ends.
    pub fn wait(&self, ticket: &FillTicket, wait: Duration) -> FillNotice {
        let wait = wait.min(Duration::from_millis(FILL_WAIT_MS_MAX));
        let until = Instant::now() + wait;
        let mut directory = self.lock();
        loop {
            if directory.expire(self.clock.now_ms()) > 0 {
                self.changed.notify_all();
            }
            let notice = directory.notice(ticket);
            let left = until.saturating_duration_since(Instant::now());
            if notice != FillNotice::Pending || left.is_zero() {
                return notice;
            }
            directory = self
                .changed
                .wait_timeout(directory, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// The epoch fills begin at now (a node of a cluster: that of the last change of its
    /// members).
    pub fn epoch(&self) -> Epoch {
        self.lock().epoch()
    }

    /// The members changed: every fill in flight is fenced and its credits come back.
    pub fn fence(&self, epoch: Epoch) {
        if self.lock().fence(epoch) > 0 {
            self.changed.notify_all();
        }
    }

    /// Draining refuses new fills (`Draining`) and lets those in flight finish; undraining
    /// (a rolled-back upgrade) admits them again.
    pub fn drain(&self, draining: bool) {
        let mut directory = self.lock();
        if draining {
            directory.start_drain();
        } else {
            directory.stop_drain();
        }
    }
}
