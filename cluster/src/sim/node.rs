//! One simulated node: the data plane's real [`NodeFence`] and [`ShardDirectory`] around a
//! model store, with the timers and mail of its life.

use std::collections::{BTreeMap, VecDeque};

use gpucache_dataplane::credits::{CreditPool, Credits};
use gpucache_dataplane::key::KeyDigest;
use gpucache_dataplane::registry::Epoch;
use gpucache_dataplane::shard::{
    ClusterView, MemberState, NodeFence, NodeId, NotAdmitting, ShardDirectory, ShardId, ViewMember,
};

use super::config::STEP_MS;
use super::mail::{AppliedRecord, Inbox, Mailbox};

/// Keys one node's model store holds; a full store evicts before it takes a new key.
const STORE_KEYS_MAX: usize = 256;
/// Keys a node's fence remembers. The fence only remembers keys its store holds, so it can
/// never fill up before the store does.
const HELD_KEYS_MAX: usize = STORE_KEYS_MAX;
/// Recent view applies kept per node, to explain a failure.
const APPLIES_KEPT: usize = 8;
/// Fills a directory keeps in flight.
const FILLS_MAX: usize = 64;
/// Credits each directory's pool holds, and what one fill is charged.
const POOL_CREDITS: Credits = Credits::new(8, 8);
pub(super) const FILL_COST: Credits = Credits::new(1, 1);
/// A fill's lease. Leaders take 1..=7 steps, so the slowest run out of lease and fail.
const FILL_LEASE_MS: u64 = 6 * STEP_MS;
/// Fault domains the members are spread over.
const DOMAINS: u64 = 16;

/// A node's slot in the simulation's table.
pub(super) fn slot(node: NodeId) -> usize {
    usize::try_from(node.0).unwrap_or(usize::MAX)
}

/// One block in a model store: which version, and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stored {
    pub(super) version: u64,
    pub(super) bytes: u64,
    /// The node kept this copy after a view handed it back (only under
    /// [`SimFaults::skip_drop_on_apply`](super::SimFaults::skip_drop_on_apply)).
    pub(super) kept: bool,
    /// The node wrote this copy while the key was not servable (only under
    /// [`SimFaults::ignore_settlement`](super::SimFaults::ignore_settlement)).
    pub(super) unsettled: bool,
}

/// What applying one view did on a node.
#[derive(Debug, Default)]
pub(super) struct Applied {
    pub(super) skipped: bool,
    pub(super) dropped: usize,
    pub(super) fenced: usize,
}

/// One node: its fence, its directory, its model store and its inbox.
#[derive(Debug)]
pub(super) struct Node {
    pub(super) id: NodeId,
    /// Its registration number, as a view records it: every restart and every new
    /// registration after a lost lease takes a larger one.
    pub(super) node_epoch: u64,
    /// Bumped by every restart: a fill begun in an earlier life ended with it.
    pub(super) life: u64,
    pub(super) running: bool,
    pub(super) down_since: u64,
    /// When a crashed node comes back (none: it stays down until it is asked to join).
    pub(super) restart_at: Option<u64>,
    /// A restarted node that has not registered yet.
    pub(super) wants_registration: bool,
    /// When a node that lost its lease registers again.
    pub(super) reregister_at: Option<u64>,
    /// When a draining member is removed.
    pub(super) drain_until: Option<u64>,
    pub(super) slow_until: Option<u64>,
    pub(super) fence: NodeFence<KeyDigest>,
    pub(super) directory: ShardDirectory,
    pub(super) store: BTreeMap<KeyDigest, Stored>,
    pub(super) inbox: Inbox,
    /// (step, epoch) of its last view applies.
    pub(super) applies: VecDeque<(u64, u64)>,
    /// When the coordinator lets this node's lost lease go.
    pub(super) lapse_at: Option<u64>,
    /// Settled epochs on their way to this node.
    pub(super) settle_inbox: Mailbox<u64>,
    /// The largest settled epoch the coordinator has sent this node (this life).
    pub(super) settle_sent: u64,
    /// Its applied epochs on their way to the coordinator.
    pub(super) outbox: Mailbox<AppliedRecord>,
    /// What it last published (this life).
    pub(super) published: AppliedRecord,
    /// (step, settled epoch) of its last settles that raised the epoch.
    pub(super) settles: VecDeque<(u64, u64)>,
}

impl Node {
    /// A node that has just started: empty, at epoch 0, not registered.
    pub(super) fn started(id: NodeId, node_epoch: u64, life: u64) -> Self {
        Self {
            id,
            node_epoch,
            life,
            running: true,
            down_since: 0,
            restart_at: None,
            wants_registration: false,
            reregister_at: None,
            drain_until: None,
            slow_until: None,
            fence: NodeFence::new(id, HELD_KEYS_MAX),
            directory: fresh_directory(),
            store: BTreeMap::new(),
            inbox: Inbox::default(),
            applies: VecDeque::new(),
            lapse_at: None,
            settle_inbox: Mailbox::default(),
            settle_sent: 0,
            outbox: Mailbox::default(),
            published: AppliedRecord::default(),
            settles: VecDeque::new(),
        }
    }

    /// Starts this node again from nothing, under a new life and a new registration number.
    pub(super) fn restart(&mut self) {
        *self = Self::started(self.id, self.node_epoch + 1, self.life + 1);
    }

    /// The process dies: everything it held is gone.
    pub(super) fn crash(&mut self, step: u64, restart_at: Option<u64>) {
        let (node_epoch, life) = (self.node_epoch, self.life);
        *self = Self::started(self.id, node_epoch, life);
        self.running = false;
        self.down_since = step;
        self.restart_at = restart_at;
    }

    pub(super) fn entry(&self, state: MemberState) -> ViewMember {
        let n = self.id.0;
        ViewMember {
            node: self.id,
            address: format!("10.0.{}.{}:7400", n / 256, n % 256),
            fault_domain: format!("rack-{}", n % DOMAINS),
            capacity: 1 << 40,
            node_epoch: self.node_epoch,
            state,
        }
    }

    pub(super) fn is_slow(&self, step: u64) -> bool {
        self.slow_until.is_some_and(|until| step < until)
    }

    /// Applies `view` if it is newer than the node's: drops the keys the fence hands back
    /// (unless `keep` says to keep them, a fault), fences the directory and drains it when the
    /// view lists this node as draining.
    pub(super) fn apply(&mut self, view: &ClusterView, keep: bool, step: u64) -> Option<Applied> {
        let before = self.fence.epoch();
        if view.epoch <= before {
            return None;
        }
        let state = view.member(self.id).map(|m| m.state);
        let handed_back = self.fence.apply(view.clone());
        let mut dropped = 0;
        for key in &handed_back {
            if keep {
                if let Some(stored) = self.store.get_mut(key) {
                    stored.kept = true;
                }
            } else if self.store.remove(key).is_some() {
                dropped += 1;
            }
        }
        let fenced = self.directory.fence(Epoch(view.epoch));
        match state {
            Some(MemberState::Draining) => self.directory.start_drain(),
            _ => self.directory.stop_drain(),
        }
        if self.applies.len() == APPLIES_KEPT {
            self.applies.pop_front();
        }
        self.applies.push_back((step, view.epoch));
        Some(Applied { skipped: before != 0 && view.epoch != before + 1, dropped, fenced })
    }

    /// Whether the node may serve `key` now (under
    /// [`SimFaults::ignore_settlement`](super::SimFaults::ignore_settlement), whenever it owns
    /// it).
    pub(super) fn may_serve(&self, key: &KeyDigest, ignore_settlement: bool) -> bool {
        if ignore_settlement { self.fence.owns(key) } else { self.fence.servable(key) }
    }

    /// Why the node would refuse to admit `key` (past its fence's check), as the real store
    /// layer says it: not the owner, or owned but not servable yet.
    pub(super) fn admission(
        &self,
        key: &KeyDigest,
        ignore_settlement: bool,
    ) -> Result<(), NotAdmitting> {
        if !self.fence.owns(key) {
            Err(NotAdmitting::NotOwner)
        } else if !self.may_serve(key, ignore_settlement) {
            Err(NotAdmitting::Settling)
        } else {
            Ok(())
        }
    }

    /// Takes the settled epochs that have arrived; answers how many raised the node's.
    pub(super) fn take_settles(&mut self, step: u64) -> u64 {
        let mut raised = 0;
        while let Some(epoch) = self.settle_inbox.pop_due(step) {
            if epoch > self.fence.settled() {
                self.fence.settle(epoch);
                raised += 1;
                if self.settles.len() == APPLIES_KEPT {
                    self.settles.pop_front();
                }
                self.settles.push_back((step, epoch));
            }
        }
        raised
    }

    /// Stores `stored` under `key` and has the fence remember it, evicting first when full.
    pub(super) fn store_put(&mut self, key: KeyDigest, stored: Stored) -> Result<(), NotAdmitting> {
        if !self.store.contains_key(&key)
            && self.store.len() >= STORE_KEYS_MAX
            && let Some((evicted, _)) = self.store.pop_first()
        {
            self.fence.forget(&evicted);
        }
        self.fence.record(key, &key)?;
        self.store.insert(key, stored);
        Ok(())
    }
}

fn fresh_directory() -> ShardDirectory {
    ShardDirectory::new(ShardId(0), Epoch(0), CreditPool::new(POOL_CREDITS), FILL_COST)
        .with_bounds(FILLS_MAX, FILL_LEASE_MS)
}
