//! [`NodeFence`]: what one node checks before it serves a request of a cluster.
//!
//! A client routes each key by the view it holds and says that view's epoch on its
//! connection. The node serves only requests of its own view's epoch: an older one is refused
//! so that the client refreshes ([`FenceRefusal::StaleEpoch`]); a newer one means the node has not
//! applied that view yet, and the client takes a miss ([`FenceRefusal::NodeBehind`]). New blocks are
//! admitted only while the node holds its registration and the view lists it as serving.
//!
//! A view change reaches the members one by one, so for a moment a key's old owner (still at
//! the old view) and its new owner (already at the new one) would both take writes of it, each
//! from clients of its own epoch. The new owner therefore serves a key it gained only once the
//! view has settled: every live member has applied it ([`NodeFence::settle`], told by the
//! cluster's registration), so none still takes writes under the older view. Until then a read
//! of such a key is a miss and a write is refused ([`NotAdmitting::Settling`]).
//!
//! A hot block may get an extra copy on its second rendezvous choice, for reads to spread
//! over. Such a copy is admitted only from the owner's servable bytes under the current view
//! and lives for that view: every newer view hands it back with the moved keys, so a copy is
//! never needed and losing one is a miss.
//!
//! The fence also remembers which keys this node admitted. When a new view moves a key to
//! another member, [`NodeFence::apply`] hands back every such key for the caller to drop: if
//! the key comes back to this node later, it is a miss, never the copy from before it left
//! (a client may have written a newer one to the other member meanwhile).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use super::control::NodeId;
use super::placement::Placement;
use super::view::{ClusterView, MemberState};
use crate::key::KeyDigest;

/// Keys one node remembers admitting, unless configured otherwise.
pub const HELD_KEYS_MAX_DEFAULT: usize = 1 << 20;
/// Views a node keeps the placement of, to tell which keys it owned through all of the views
/// that have not settled yet.
pub const VIEW_HISTORY_MAX: usize = 16;

/// Why a node takes no new blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotAdmitting {
    /// Its registration lapsed; it admits again once it registers anew (with a new node epoch).
    #[error("the node lost its cluster registration")]
    LeaseLost,
    /// It is being drained for an upgrade.
    #[error("the node is draining")]
    Draining,
    /// The view does not list it.
    #[error("the node is not a member of the cluster view")]
    NotMember,
    /// Its table of admitted keys is full (see [`NodeFence::prune`]).
    #[error("the node's table of admitted keys is full")]
    KeysFull,
    /// The key belongs to another member under the node's view (the view changed while the
    /// request was on its way): the client refreshes its view.
    #[error("the key belongs to another member under the node's view")]
    NotOwner,
    /// The key came to this node with a view that not every live member has applied yet: a
    /// member that owned it before may still take writes of it under the older view. The
    /// node serves it once the view has settled.
    #[error("the key moved to this node with a view that has not settled yet")]
    Settling,
}

impl NotAdmitting {
    pub const ALL: [Self; 6] = [
        Self::LeaseLost,
        Self::Draining,
        Self::NotMember,
        Self::KeysFull,
        Self::NotOwner,
        Self::Settling,
    ];

    /// Its number on the wire.
    pub fn code(self) -> u8 {
        match self {
            Self::LeaseLost => 0,
            Self::Draining => 1,
            Self::NotMember => 2,
            Self::KeysFull => 3,
            Self::NotOwner => 4,
            Self::Settling => 5,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.code() == code)
    }
}

/// A request the fence refuses; nothing was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FenceRefusal {
    #[error("the request was routed by cluster epoch {sent}; the node is at {current}")]
    StaleEpoch { sent: u64, current: u64 },
    #[error("the request was routed by cluster epoch {sent}; the node is still at {current}")]
    NodeBehind { sent: u64, current: u64 },
    #[error(transparent)]
    NotAdmitting(#[from] NotAdmitting),
}

/// One node's view, registration and admitted keys (see the module documentation). `K` is
/// what the caller needs to drop a key from its store.
#[derive(Debug)]
pub struct NodeFence<K> {
    node: NodeId,
    view: ClusterView,
    placement: Placement,
    /// The placements of the views applied, oldest first, at most [`VIEW_HISTORY_MAX`], with
    /// no gap (a skipped epoch clears it).
    history: VecDeque<(u64, Placement)>,
    /// Every live member has applied this epoch or a newer one.
    settled: u64,
    registered: bool,
    held: Mutex<HashMap<KeyDigest, K>>,
    held_max: usize,
    /// Keys held as a hot block's extra copy (this node is their second choice), admitted
    /// under the current view; every newer view drops them.
    replicas: Mutex<HashSet<KeyDigest>>,
}

impl<K: Clone> NodeFence<K> {
    /// A node at epoch 0 (no view yet), not registered, remembering up to `held_max` keys.
    pub fn new(node: NodeId, held_max: usize) -> Self {
        Self {
            node,
            view: ClusterView::default(),
            placement: Placement::default(),
            history: VecDeque::new(),
            settled: 0,
            registered: false,
            held: Mutex::new(HashMap::new()),
            held_max,
            replicas: Mutex::new(HashSet::new()),
        }
    }

    pub fn node(&self) -> NodeId {
        self.node
    }

    pub fn view(&self) -> &ClusterView {
        &self.view
    }

    pub fn epoch(&self) -> u64 {
        self.view.epoch
    }

    pub fn is_registered(&self) -> bool {
        self.registered
    }

    /// Whether this node owns `key` under its view.
    pub fn owns(&self, key: &KeyDigest) -> bool {
        self.placement.owner(key) == Some(self.node)
    }

    /// The epoch every live member has applied (0 until known).
    pub fn settled(&self) -> u64 {
        self.settled
    }

    /// Every live member has applied `epoch` (or newer); never moves back.
    pub fn settle(&mut self, epoch: u64) {
        self.settled = self.settled.max(epoch);
    }

    /// Whether this node is `key`'s second choice under its view: where a hot block's extra
    /// copy goes.
    pub fn seconds(&self, key: &KeyDigest) -> bool {
        self.placement.choices(key, 2).get(1) == Some(&self.node)
    }

    /// Remembers `key` as an extra copy held here (see [`record`](Self::record), which the
    /// caller calls too): it is served under this view only, and dropped by the next.
    pub fn record_replica(&self, digest: KeyDigest) {
        self.replicas.lock().unwrap_or_else(|e| e.into_inner()).insert(digest);
    }

    /// Whether `key` is an extra copy admitted under this view.
    pub fn is_replica(&self, key: &KeyDigest) -> bool {
        self.replicas.lock().unwrap_or_else(|e| e.into_inner()).contains(key)
    }

    /// Whether this node may serve `key` now: it owns it, and no other member may still take
    /// writes of it. That holds once its view has settled, or when this node owned the key in
    /// every view from the settled epoch to its own (a member still at one of those epochs
    /// would refuse the key as not its own).
    pub fn servable(&self, key: &KeyDigest) -> bool {
        if !self.owns(key) {
            // An extra copy was made from its owner's servable block under this same view.
            return self.seconds(key) && self.is_replica(key);
        }
        if self.settled >= self.view.epoch {
            return true;
        }
        let Some(&(oldest, _)) = self.history.front() else { return false };
        if oldest > self.settled {
            return false;
        }
        self.history
            .iter()
            .filter(|(epoch, _)| *epoch >= self.settled)
            .all(|(_, placement)| placement.owner(key) == Some(self.node))
    }

    /// Why this node would refuse a new block now, if it would.
    pub fn admitting(&self) -> Result<(), NotAdmitting> {
        if !self.registered {
            return Err(NotAdmitting::LeaseLost);
        }
        match self.view.member(self.node).map(|m| m.state) {
            None => Err(NotAdmitting::NotMember),
            Some(MemberState::Draining) => Err(NotAdmitting::Draining),
            Some(MemberState::Serving) => Ok(()),
        }
    }

    /// Checks a request routed by epoch `sent`; `admits` when it would store a block.
    pub fn check(&self, sent: u64, admits: bool) -> Result<(), FenceRefusal> {
        let current = self.view.epoch;
        if sent < current {
            return Err(FenceRefusal::StaleEpoch { sent, current });
        }
        if sent > current {
            return Err(FenceRefusal::NodeBehind { sent, current });
        }
        if admits {
            self.admitting()?;
        }
        Ok(())
    }

    /// Remembers that this node admitted `key`. Refused when the table is full: the caller
    /// [prunes](Self::prune) it of keys its store no longer holds, and tries again.
    pub fn record(&self, digest: KeyDigest, key: &K) -> Result<(), NotAdmitting> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.len() >= self.held_max && !held.contains_key(&digest) {
            return Err(NotAdmitting::KeysFull);
        }
        held.insert(digest, key.clone());
        Ok(())
    }

    /// Forgets a key the store dropped (invalidated or evicted).
    pub fn forget(&self, digest: &KeyDigest) {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).remove(digest);
        self.replicas.lock().unwrap_or_else(|e| e.into_inner()).remove(digest);
    }

    /// Keeps only the keys `present` says the store still holds; returns how many it forgot.
    pub fn prune(&self, mut present: impl FnMut(&K) -> bool) -> usize {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let before = held.len();
        held.retain(|_, key| present(key));
        before - held.len()
    }

    pub fn held_len(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Applies a newer view: returns the keys this node admitted that another member now
    /// owns, which the caller must drop before it serves under the new epoch. A view that is
    /// not newer changes nothing. A view that skips epochs (this node missed some changes)
    /// hands back every key: a key may have left and come back in the views it missed.
    pub fn apply(&mut self, view: ClusterView) -> Vec<K> {
        if view.epoch <= self.view.epoch {
            return Vec::new();
        }
        let missed = self.view.epoch != 0 && view.epoch != self.view.epoch + 1;
        self.placement = view.placement();
        if missed {
            self.history.clear();
        }
        if self.history.len() == VIEW_HISTORY_MAX {
            self.history.pop_front();
        }
        self.history.push_back((view.epoch, self.placement.clone()));
        self.view = view;
        // Extra copies live for one view: the next one hands them back with the moved keys,
        // even one whose key this node now owns (its owner may have taken newer bytes since).
        let copies = std::mem::take(self.replicas.get_mut().unwrap_or_else(|e| e.into_inner()));
        let node = self.node;
        let placement = &self.placement;
        let held = self.held.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut moved = Vec::new();
        held.retain(|digest, key| {
            let stays =
                !missed && !copies.contains(digest) && placement.owner(digest) == Some(node);
            if !stays {
                moved.push(key.clone());
            }
            stays
        });
        moved
    }

    /// The node holds a registration (again).
    pub fn registered(&mut self) {
        self.registered = true;
    }

    /// The node's registration lapsed: it admits nothing until [`registered`](Self::registered).
    pub fn lose_registration(&mut self) {
        self.registered = false;
    }
}
