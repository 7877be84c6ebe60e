//! [`NodeFence`]: what one node checks before it serves a request of a cluster.
//!
//! A client routes each key by the view it holds and says that view's epoch on its
//! connection. The node serves only requests of its own view's epoch: an older one is refused
//! so that the client refreshes ([`FenceRefusal::StaleEpoch`]); a newer one means the node has not
//! applied that view yet, and the client takes a miss ([`FenceRefusal::NodeBehind`]). New blocks are
//! admitted only while the node holds its registration and the view lists it as serving.
//!
//! The fence also remembers which keys this node admitted. When a new view moves a key to
//! another member, [`NodeFence::apply`] hands back every such key for the caller to drop: if
//! the key comes back to this node later, it is a miss, never the copy from before it left
//! (a client may have written a newer one to the other member meanwhile).

use std::collections::HashMap;
use std::sync::Mutex;

use super::control::NodeId;
use super::placement::Placement;
use super::view::{ClusterView, MemberState};
use crate::key::KeyDigest;

/// Keys one node remembers admitting, unless configured otherwise.
pub const HELD_KEYS_MAX_DEFAULT: usize = 1 << 20;

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
}

impl NotAdmitting {
    pub const ALL: [Self; 5] =
        [Self::LeaseLost, Self::Draining, Self::NotMember, Self::KeysFull, Self::NotOwner];

    /// Its number on the wire.
    pub fn code(self) -> u8 {
        match self {
            Self::LeaseLost => 0,
            Self::Draining => 1,
            Self::NotMember => 2,
            Self::KeysFull => 3,
            Self::NotOwner => 4,
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
    registered: bool,
    held: Mutex<HashMap<KeyDigest, K>>,
    held_max: usize,
}

impl<K: Clone> NodeFence<K> {
    /// A node at epoch 0 (no view yet), not registered, remembering up to `held_max` keys.
    pub fn new(node: NodeId, held_max: usize) -> Self {
        Self {
            node,
            view: ClusterView::default(),
            placement: Placement::default(),
            registered: false,
            held: Mutex::new(HashMap::new()),
            held_max,
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
        self.view = view;
        let node = self.node;
        let placement = &self.placement;
        let held = self.held.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut moved = Vec::new();
        held.retain(|digest, key| {
            let stays = !missed && placement.owner(digest) == Some(node);
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
