//! [`ControlPlane`]: one shard's directory and the membership it answers to.
//!
//! Every membership change (a node joins or leaves, a fault domain is isolated, a shard moves,
//! an upgrade finishes) advances the epoch by one and fences the directory's fills. Nothing
//! here copies payload bytes: a rebalanced shard starts empty, and its keys are misses until
//! they are filled again.

use std::collections::BTreeMap;

use super::directory::ShardDirectory;
use crate::registry::Epoch;

/// A node of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

/// A member: its node and the fault domain it fails with (a rack, a host, a power feed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node: NodeId,
    pub fault_domain: String,
}

/// Where a rolling upgrade of this node stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upgrade {
    Serving,
    /// New fills are refused; fills in flight finish.
    Draining,
}

/// A change the control plane refuses; it changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("node {0:?} is not a member")]
    UnknownNode(NodeId),
    #[error("node {0:?} is a member already")]
    AlreadyMember(NodeId),
    #[error("no member is in fault domain {0:?}")]
    UnknownDomain(String),
    /// The cluster would have no member left.
    #[error("removing {removed} member(s) would leave the cluster without one")]
    LastMember { removed: usize },
    #[error("no upgrade is draining this node")]
    NotDraining,
}

/// One shard's directory with its cluster's membership (see the module documentation).
#[derive(Debug)]
pub struct ControlPlane {
    members: BTreeMap<NodeId, Member>,
    directory: ShardDirectory,
    upgrade: Upgrade,
}

impl ControlPlane {
    /// A cluster of `members` (at least one) around `directory`.
    pub fn new(members: Vec<Member>, directory: ShardDirectory) -> Result<Self, ControlError> {
        if members.is_empty() {
            return Err(ControlError::LastMember { removed: 0 });
        }
        let mut by_node = BTreeMap::new();
        for m in members {
            let node = m.node;
            if by_node.insert(node, m).is_some() {
                return Err(ControlError::AlreadyMember(node));
            }
        }
        Ok(Self { members: by_node, directory, upgrade: Upgrade::Serving })
    }

    pub fn epoch(&self) -> Epoch {
        self.directory.epoch()
    }

    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    pub fn upgrade(&self) -> Upgrade {
        self.upgrade
    }

    pub fn directory(&self) -> &ShardDirectory {
        &self.directory
    }

    pub fn directory_mut(&mut self) -> &mut ShardDirectory {
        &mut self.directory
    }

    /// One membership change: the next epoch, and the directory's fills fenced.
    fn advance(&mut self) -> Epoch {
        let next = Epoch(self.epoch().0.saturating_add(1));
        self.directory.fence(next);
        next
    }

    pub fn join(&mut self, member: Member) -> Result<Epoch, ControlError> {
        if self.members.contains_key(&member.node) {
            return Err(ControlError::AlreadyMember(member.node));
        }
        self.members.insert(member.node, member);
        Ok(self.advance())
    }

    pub fn remove(&mut self, node: NodeId) -> Result<Epoch, ControlError> {
        if !self.members.contains_key(&node) {
            return Err(ControlError::UnknownNode(node));
        }
        if self.members.len() == 1 {
            return Err(ControlError::LastMember { removed: 1 });
        }
        self.members.remove(&node);
        Ok(self.advance())
    }

    /// Removes every member of `domain`, in one epoch; refused when none is in it or when no
    /// member would be left. Answers the removed nodes.
    pub fn isolate(&mut self, domain: &str) -> Result<Vec<NodeId>, ControlError> {
        let inside: Vec<NodeId> =
            self.members.values().filter(|m| m.fault_domain == domain).map(|m| m.node).collect();
        if inside.is_empty() {
            return Err(ControlError::UnknownDomain(domain.to_owned()));
        }
        if inside.len() == self.members.len() {
            return Err(ControlError::LastMember { removed: inside.len() });
        }
        for node in &inside {
            self.members.remove(node);
        }
        self.advance();
        Ok(inside)
    }

    /// Moves the shard: this directory is fenced (its fills end, their credits come back) and
    /// an empty directory for the destination is returned at the new epoch, charging the same
    /// credits.
    pub fn rebalance(&mut self) -> ShardDirectory {
        let epoch = self.advance();
        ShardDirectory::new(
            self.directory.shard(),
            epoch,
            self.directory.credits().clone(),
            self.directory.fill_cost(),
        )
    }

    /// Starts a rolling upgrade of this node: new fills are refused, fills in flight go on.
    pub fn start_upgrade(&mut self) {
        self.upgrade = Upgrade::Draining;
        self.directory.start_drain();
    }

    /// Ends the drain: the epoch advances, fencing whatever was still in flight.
    pub fn finish_upgrade(&mut self) -> Result<Epoch, ControlError> {
        if self.upgrade != Upgrade::Draining {
            return Err(ControlError::NotDraining);
        }
        self.upgrade = Upgrade::Serving;
        self.directory.stop_drain();
        Ok(self.advance())
    }

    /// Abandons the upgrade before it finished: new fills are admitted again, and fills in
    /// flight complete as if nothing happened (the epoch does not move).
    pub fn rollback_upgrade(&mut self) -> Result<(), ControlError> {
        if self.upgrade != Upgrade::Draining {
            return Err(ControlError::NotDraining);
        }
        self.upgrade = Upgrade::Serving;
        self.directory.stop_drain();
        Ok(())
    }
}
